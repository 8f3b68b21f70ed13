"""In-process doubles for the storage components' own tests (the real thing — moto's S3 server, real
disks — is used by the scenario tests):

* :class:`MemoryStore` — an :class:`~ckptd.storage.store.ObjectStore` in a dict, thread-safe.
* :class:`FaultyStore` — wraps a store and fails chosen operations, as torch DCP's
  ``FaultyStorageWriter`` does: ``FaultyStore(store, put_file=[2])`` fails the third ``put_file``;
  ``FaultyStore(store, put_file=["manifest.json"])`` fails every ``put_file`` whose key ends so.
* :class:`FaultyDisk` — makes a phase of the local tier fail with an ``OSError`` (``ENOSPC`` by
  default): ``shard`` (the shard's write), ``fragment``, ``manifest``, ``rename`` (step-N.tmp to
  step-N), ``latest``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from ckptd.errors import CheckpointError, FormatError
from ckptd.layout import MANIFEST


class MemoryStore:
    """Objects in memory under ``mem://<name>/``; the same key rules as :class:`~ckptd.storage.s3.S3Store`."""

    def __init__(self, name: str = "bucket") -> None:
        self.name = name
        self.objects: dict[str, bytes] = {}
        self.writes: dict[str, int] = {}  # key -> how many times it was written (S3's LastModified, in the tag)
        self.calls: list[tuple[str, str]] = []  # (operation, key), in order
        self.closed = False
        self._lock = threading.Lock()

    def _check(self, rel: str) -> str:
        if not isinstance(rel, str) or rel.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            raise ValueError(f"bad key {rel!r}")
        return rel

    def _log(self, op: str, rel: str) -> None:
        with self._lock:
            self.calls.append((op, rel))

    def url(self, rel: str = "") -> str:
        return f"mem://{self.name}/{rel}"

    def put_file(self, rel: str, path: str, progress: Callable[[int], None] | None = None) -> None:
        with open(path, "rb") as f:
            data = f.read()
        self.put_bytes(rel, data)
        if progress is not None:
            progress(len(data))

    def put_bytes(self, rel: str, data: bytes) -> None:
        self._log("put", self._check(rel))
        with self._lock:
            self.objects[rel] = bytes(data)
            self.writes[rel] = self.writes.get(rel, 0) + 1

    def put_bytes_if(self, rel: str, data: bytes, tag: str | None) -> bool:
        self._log("put", self._check(rel))
        with self._lock:
            now = self.objects.get(rel)
            if (now is None) != (tag is None) or (now is not None and tag is not None and not self._matches(rel, tag)):
                return False
            self.objects[rel] = bytes(data)
            self.writes[rel] = self.writes.get(rel, 0) + 1
        return True

    def get_file(self, rel: str, path: str, progress: Callable[[int], None] | None = None, limit: int | None = None) -> None:
        data = self.get_bytes(rel, limit)
        with open(path + ".part", "wb") as f:
            f.write(data)
        os.replace(path + ".part", path)
        if progress is not None:
            progress(len(data))

    def get_bytes(self, rel: str, limit: int | None = None) -> bytes:
        self._log("get", self._check(rel))
        with self._lock:
            if rel not in self.objects:
                raise FileNotFoundError(f"no such object {self.url(rel)}")
            data = self.objects[rel]
        if limit is not None and len(data) > limit:
            raise FormatError(f"{self.url(rel)} is larger than the {limit} bytes expected; download stopped")
        return data

    def exists(self, rel: str) -> bool:
        with self._lock:
            return self._check(rel) in self.objects

    def list(self, rel_prefix: str = "") -> list[str]:
        self._log("list", rel_prefix)
        with self._lock:
            return sorted(k for k in self.objects if k.startswith(rel_prefix))

    def list_tagged(self, rel_prefix: str = "") -> dict[str, str]:
        """As S3Store lists them: each key with the MD5 of its bytes (a single PUT's ETag) and when it was
        written (here: how many times), so that bytes written again read as a change."""
        self._log("list", rel_prefix)
        with self._lock:
            return {k: self._tag(k) for k in self.objects if k.startswith(rel_prefix)}

    def _tag(self, rel: str) -> str:
        return f"{hashlib.md5(self.objects[rel]).hexdigest()}@{self.writes.get(rel, 0)}"

    def _matches(self, rel: str, tag: str) -> bool:
        """S3's ``If-Match``: the ETag alone (the same bytes written again match)."""
        return self._tag(rel).partition("@")[0] == tag.partition("@")[0]

    def delete_if(self, rel: str, tag: str) -> bool:
        with self._lock:
            self.calls.append(("delete", rel))
            if rel not in self.objects or not self._matches(rel, tag):
                return False
            del self.objects[rel]
        return True

    def delete(self, rels: list[str]) -> None:
        with self._lock:
            for rel in rels:
                self.calls.append(("delete", rel))
                self.objects.pop(rel, None)

    def check(self) -> None:
        if self.closed:
            raise CheckpointError(f"{self.url()} is closed")

    def abort_unfinished(self) -> int:
        return 0  # every put is whole: nothing is ever left unfinished here

    def close(self) -> None:
        self.closed = True


class FaultyStore:
    """``store``, except that the operations named in ``faults`` fail with ``CheckpointError``: each
    fault is a call index (0-based, per operation) or a key suffix. ``list`` counts ``list_tagged`` too:
    both are one listing request."""

    def __init__(self, store: Any, **faults: list[int | str]) -> None:
        self.store, self.faults = store, faults
        self.counts: dict[str, int] = {}

    def _maybe_fail(self, op: str, rel: str) -> None:
        n = self.counts.get(op, 0)
        self.counts[op] = n + 1
        for f in self.faults.get(op, ()):
            if f == n or (isinstance(f, str) and rel.endswith(f)):
                raise CheckpointError(f"injected failure: {op} {rel} (call {n})")

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.store, name)
        if name not in (
            "put_file",
            "put_bytes",
            "put_bytes_if",
            "get_file",
            "get_bytes",
            "list",
            "list_tagged",
            "delete",
            "delete_if",
            "exists",
        ):
            return target
        op = {"list_tagged": "list", "put_bytes_if": "put_bytes", "delete_if": "delete"}.get(name, name)

        def call(rel: Any, *args: Any, **kw: Any) -> Any:
            self._maybe_fail(op, rel if isinstance(rel, str) else ",".join(rel))
            return target(rel, *args, **kw)

        return call


PHASES = ("shard", "fragment", "manifest", "rename", "latest")


class FaultyDisk:
    """Fails one phase of :mod:`ckptd.storage.local` with ``OSError(err)``; use :meth:`phase`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mp = monkeypatch

    @contextmanager
    def phase(self, name: str, err: int = errno.ENOSPC) -> Iterator[None]:
        from ckptd import files
        from ckptd.storage import local

        assert name in PHASES, name
        with self.mp.context() as mp:
            if name == "shard":

                def paced(*args: Any) -> dict[str, str]:
                    raise OSError(err, os.strerror(err))

                mp.setattr(local, "_copy_paced", paced)
            elif name in ("fragment", "manifest", "latest"):
                real = files.write_durable
                suffix = {"fragment": ".json", "manifest": MANIFEST, "latest": "latest"}[name]

                def durable(path: str, data: bytes) -> None:
                    if path.endswith(suffix) and not (name == "fragment" and path.endswith(MANIFEST)):
                        raise OSError(err, os.strerror(err))
                    real(path, data)

                mp.setattr(files, "write_durable", durable)
                mp.setattr(local, "write_durable", durable)
            else:
                real_rename = os.rename

                def rename(src: str, dst: str) -> None:
                    if src.endswith(".tmp"):
                        raise OSError(err, os.strerror(err))
                    real_rename(src, dst)

                mp.setattr(local.os, "rename", rename)
            yield
