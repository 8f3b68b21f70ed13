"""POSIX shared-memory segments, created and unlinked by the daemon only.

Segments are plain files in ``/dev/shm`` (not ``multiprocessing.shared_memory``, whose resource
tracker unlinks segments when the creating process exits). Names are
``ckptd-<uid>-<ns>-<NNNNNNNN>`` where ``ns`` is derived from the daemon's root directory, so a
restarted daemon finds its own segments and two daemons on one node never collide. A commit
record ``<segment>.commit`` (JSON, written atomically) marks a segment whose shard must be made
durable; it survives a daemon crash together with the segment.

Who calls what: the daemon creates, records and unlinks (main thread) and reads segments (persist
workers); a trainer only maps an existing segment it was leased (:class:`Mapping`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from typing import Any

from .errors import CheckpointError

SHM_DIR = os.environ.get("CKPTD_SHM_DIR", "/dev/shm")
SEGMENT_RE = re.compile(r"^ckptd-\d+-[0-9a-f]{8}-\d{8}$")
RECORD_SUFFIX = ".commit"
ALIGN = 2 << 20  # round segment sizes up so slots can be reused by slightly larger shards


def namespace(root: str) -> str:
    h = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:8]
    return f"ckptd-{os.getuid()}-{h}"


def path_of(name: str) -> str:
    if not SEGMENT_RE.match(name):
        raise CheckpointError(f"invalid segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def list_segments(ns: str) -> list[str]:
    """Names of this namespace's segments present in shared memory, sorted."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(ns + "-") and SEGMENT_RE.match(n))


def create(name: str, size: int, *, mode: int = 0o600, gid: int | None = None) -> int:
    """Create a segment of ``size`` bytes with every page allocated; returns the rounded size.

    ``mode`` is applied whatever the umask; ``gid`` (if given) becomes the segment's group, for
    trainers that run as another user of that group.

    ``posix_fallocate`` makes a full ``/dev/shm`` fail here with ENOSPC instead of a SIGBUS in the
    trainer's copy later, and prefaults the pages so the first copy runs at memory speed.
    """
    size = max(ALIGN, -(-size // ALIGN) * ALIGN)
    path = path_of(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.posix_fallocate(fd, 0, size)
        # fallocated tmpfs pages are still zeroed one fault at a time when the trainer first maps
        # them (0.4-3 s per GB, measured); writing the zeros here costs 0.14 s per GB and leaves
        # the trainer's MAP_POPULATE at ~0.12 s per GB
        zeros = memoryview(bytes(min(size, 64 << 20)))
        for off in range(0, size, len(zeros)):
            os.pwrite(fd, zeros[: size - off], off)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise CheckpointError(f"cannot allocate {size} bytes of shared memory in {SHM_DIR}: {e.strerror}") from None
    os.close(fd)
    return size


def size_of(name: str) -> int:
    return os.stat(path_of(name)).st_size


def unlink(name: str) -> None:
    for p in (path_of(name), path_of(name) + RECORD_SUFFIX):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def write_record(name: str, record: dict[str, Any], tree: bytes = b"{}") -> None:
    """Record a commit for segment ``name`` atomically (tmpfs: no fsync needed, lives as long as the
    segment). ``tree`` is the commit's raw tree JSON, stored as it came, under the key ``"tree"``."""
    path = path_of(name) + RECORD_SUFFIX
    tmp = path + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(json.dumps(record, separators=(",", ":")).encode()[:-1] + b',"tree":' + tree + b"}")
    os.replace(tmp, path)


def read_record(name: str) -> dict[str, Any] | None:
    try:
        with open(path_of(name) + RECORD_SUFFIX, "rb") as f:
            rec = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # a torn record never happened: the commit was never acknowledged
    return rec if isinstance(rec, dict) else None


def drop_record(name: str) -> None:
    try:
        os.unlink(path_of(name) + RECORD_SUFFIX)
    except FileNotFoundError:
        pass


class Mapping:
    """A long-lived shared mapping of one segment with a ``uint8`` tensor over it.

    Mapped once with ``MAP_POPULATE`` and kept: a fresh mapping of a populated segment costs a
    minor fault per page on its first copy (4x slower than a warm mapping).
    """

    def __init__(self, name: str, *, writable: bool = True) -> None:
        """Map segment ``name``: read-write and populated for a trainer; read-only and lazily
        faulted for the daemon (``MAP_POPULATE`` holds the GIL for the whole call, which would
        stall the daemon's request loop; faults taken inside ``os.write`` and the hashing do not)."""
        self.name = name
        fd = os.open(path_of(name), os.O_RDWR if writable else os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            populate = getattr(mmap, "MAP_POPULATE", 0) if writable else 0
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | populate, prot=prot)
        finally:
            os.close(fd)
        self.view = memoryview(self._mm)
        self.tensor = None
        if writable:  # trainer side only: the daemon never imports torch
            import torch

            self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    def close(self) -> None:
        self.tensor = None
        self.view.release()
        self._mm.close()
