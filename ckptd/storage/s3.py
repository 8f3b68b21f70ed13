"""An S3-compatible bucket (AWS S3, MinIO, ...) reached through boto3: the one
:class:`~ckptd.storage.store.ObjectStore` the daemon ships with.

Objects live under ``<prefix>/<rel>`` in the bucket; every method takes ``rel``, a key relative to
the store's prefix, and :meth:`S3Store.list` returns keys in that same relative form.

Who calls what: the daemon builds one :class:`S3Store` per configured remote, calls
:meth:`S3Store.check` once at start-up (on its fetch thread), then calls the transfer methods from
its upload and fetch threads; it calls :meth:`S3Store.close` at shutdown. Every method blocks until
the request is done or botocore has given up after ``max_attempts`` (standard mode: exponential
backoff with jitter). The store is safe to share between threads: boto3 clients are thread-safe and
all transfers go through one s3transfer manager, so ``max_bandwidth`` caps the store as a whole
rather than each call. Progress callbacks run on s3transfer's worker threads, not the caller's.

Errors: any boto3/botocore failure surfaces as :class:`~ckptd.errors.CheckpointError` naming the
operation, bucket and key; reading a missing object raises :class:`FileNotFoundError`. Except in
:meth:`S3Store.put_bytes_if` / :meth:`S3Store.delete_if`: a failed condition (412, 409, or a missing
object under ``If-Match``) returns False, and ``501 NotImplemented`` falls back to an unconditional
request with one warning. boto3 is
imported on first use, so ``import ckptd`` does not pay for it.
"""

from __future__ import annotations

import builtins  # the method S3Store.list shadows the type inside the class
import contextlib
import functools
import io
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CheckpointError, FormatError
from ..files import fsync_dir
from ..s3config import RemoteConfig, check_rel
from .boto import boto_errors, error_code
from .multipart import UploadLedger

log = logging.getLogger("ckptd.daemon")

_LIST_PAGE = 1000  # keys per ListObjectsV2 request (the S3 maximum)
_DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 maximum)
_CONCURRENCY = 10  # parallel requests per store (parts of one transfer, or several transfers)
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# a conditional request lost: another writer came first (412), or one is writing the object now (409)
_CONDITION_FAILED = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})


_TAG_SEP = "@"  # never in an ETag (a quoted hex digest, maybe with -<parts>)


def _tag(obj: dict[str, Any]) -> str:
    """A listed object's tag: its ETag (what ``If-Match`` compares) and its LastModified."""
    when = obj.get("LastModified")
    return f"{obj.get('ETag', '')}{_TAG_SEP}{when.isoformat() if hasattr(when, 'isoformat') else when}"


def _make_client(config: RemoteConfig) -> Any:
    import boto3.session
    from botocore.config import Config

    # S3-compatible servers (MinIO, moto) are usually reached by host:port, where virtual-host
    # addressing (bucket.host) does not resolve; AWS keeps botocore's own choice.
    s3_options = {"addressing_style": "path"} if config.endpoint_url else None
    botocore_config = Config(
        retries={"total_max_attempts": config.max_attempts, "mode": "standard"},
        connect_timeout=config.connect_timeout,
        read_timeout=config.read_timeout,
        max_pool_connections=_CONCURRENCY + 4,
        s3=s3_options,
    )
    # a private session: creating clients from boto3's default session is not thread-safe
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=config.endpoint_url, region_name=config.region, config=botocore_config)


class S3Store:
    """Files and bytes in one bucket under one key prefix. See the module docstring for threading.

    ``client`` replaces the boto3 S3 client built from ``config`` (tests, or a caller that needs
    its own session); a client passed in is not closed by :meth:`close`.
    """

    def __init__(self, config: RemoteConfig, client: Any = None, ledger: UploadLedger | None = None) -> None:
        """``ledger``: where the multipart uploads this store begins are recorded until they end (the daemon's root,
        :mod:`.multipart`); the ones it holds already, a dead daemon's, are aborted by :meth:`abort_unfinished`."""
        self.config = config
        self._owns_client = client is None
        self.client = _make_client(config) if client is None else client
        self._transfer_manager: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._warned_unconditional = False
        self._ledger = ledger
        self._unfinished = ledger.watch(self.client, config.endpoint_url) if ledger is not None else []

    def __repr__(self) -> str:
        return f"S3Store(s3://{self.config.bucket}/{self.config.prefix} at {self._endpoint()})"

    def __enter__(self) -> S3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for transfers in flight, stop the transfer threads and close the connection pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            manager, self._transfer_manager = self._transfer_manager, None
        if manager is not None:
            manager.shutdown()
        if self._owns_client:
            self.client.close()

    def url(self, rel: str = "") -> str:
        """``s3://bucket/prefix/rel`` (the store's root without ``rel``), for messages."""
        return f"s3://{self.config.bucket}/{self.key(rel) if rel else self.config.prefix}"

    def key(self, rel: str) -> str:
        """The bucket key for ``rel``: ``<prefix>/<rel>`` (just ``rel`` without a prefix)."""
        check_rel("object key", rel)
        return f"{self.config.prefix}/{rel}" if self.config.prefix else rel

    def put_file(self, rel: str, path: str, progress: Callable[[int], None] | None = None) -> None:
        """Upload the file at ``path`` to ``rel``, in parts when it has ``part_size`` bytes or more.

        ``progress`` gets the bytes sent since its last call (negative when a retried part rewinds).
        A file that cannot be read raises ``OSError``.
        """
        key = self.key(rel)
        os.stat(path)  # a missing local file is the caller's OSError, not a missing object
        with self._translate("upload", key):
            self._wait(self._transfers().upload(path, self.config.bucket, key, subscribers=self._subscribers(progress)))

    def put_bytes(self, rel: str, data: bytes) -> None:
        """Upload ``data`` to ``rel`` (same path as :meth:`put_file`: multipart, bandwidth cap)."""
        key = self.key(rel)
        with self._translate("upload", key):
            self._wait(self._transfers().upload(io.BytesIO(data), self.config.bucket, key))

    def put_bytes_if(self, rel: str, data: bytes, tag: str | None) -> bool:
        """A small object (a manifest), written only if ``rel`` is still absent (``tag`` None) or holds ``tag``:
        one ``PutObject`` with ``If-None-Match: *`` or ``If-Match``; False when the condition failed (another
        writer came first, or the object is gone). A store that does not implement conditional requests
        (``501 NotImplemented``), or lists no ETags, gets an unconditional write and one warning."""
        key = self.key(rel)
        put = functools.partial(self.client.put_object, Bucket=self.config.bucket, Key=key, Body=data)
        return self._conditional("upload", key, put, tag, lambda: self.put_bytes(rel, data))

    def delete_if(self, rel: str, tag: str) -> bool:
        """Delete ``rel`` only if it still holds ``tag`` (``DeleteObject`` with ``If-Match``); False when it
        was written again or is gone. Unconditional, with one warning, where the store cannot (as above)."""
        key = self.key(rel)
        delete = functools.partial(self.client.delete_object, Bucket=self.config.bucket, Key=key)
        return self._conditional("delete", key, delete, tag, lambda: self.delete([rel]))

    def _conditional(self, op: str, key: str, call: Callable[..., Any], tag: str | None, fallback: Callable[[], None]) -> bool:
        """``call`` under the condition ``tag`` names: the object absent (None), or still holding that ETag.
        True when done, False when the condition failed (412, 409, or a missing object under ``If-Match``);
        where the store does not implement conditional requests (501) or the listing gave no ETag,
        ``fallback`` (the unconditional request) with one warning. Any other failure raises as usual."""
        etag = None if tag is None else tag.rpartition(_TAG_SEP)[0]
        if etag != "":
            with self._translate(op, key):
                try:
                    call(**({"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}))
                    return True
                except boto_errors() as exc:
                    code = error_code(exc)
                    if code in _CONDITION_FAILED or (etag is not None and code in _MISSING_CODES):
                        return False
                    if code not in ("NotImplemented", "501"):
                        raise
        self._unconditional(key)
        fallback()
        return True

    def _unconditional(self, key: str) -> None:
        if not self._warned_unconditional:
            self._warned_unconditional = True
            log.warning(
                "s3 bucket %r at %s: conditional requests are not available (%s); manifests are written and removed"
                " unconditionally, so nodes racing on one step are not kept apart", self.config.bucket, self._endpoint(), key,
            )  # fmt: skip

    def get_file(self, rel: str, path: str, progress: Callable[[int], None] | None = None, limit: int | None = None) -> None:
        """Download ``rel`` to ``path`` atomically: into ``path + ".part"``, fsync, rename over ``path``.

        An object that grows past ``limit`` bytes fails with :class:`~ckptd.errors.FormatError` at the
        write that crosses it, so an oversized object never fills the disk. On any failure the ``.part``
        file is removed and ``path`` is left as it was. A missing object raises ``FileNotFoundError``.
        """
        key = self.key(rel)
        part = path + ".part"
        done = False
        try:
            with open(part, "wb") as f:
                with self._translate("download", key, missing_is_error=False):
                    sink = f if limit is None else _Capped(f, limit, self.url(rel))
                    future = self._transfers().download(self.config.bucket, key, sink, subscribers=self._subscribers(progress))
                    self._wait(future)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, path)
            done = True
        finally:
            if not done:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
        fsync_dir(os.path.dirname(os.path.abspath(path)))

    def get_bytes(self, rel: str, limit: int | None = None) -> bytes:
        """The content of ``rel``; a missing object raises ``FileNotFoundError``, one past ``limit``
        bytes :class:`~ckptd.errors.FormatError` (at the write that crosses it: never held whole)."""
        key = self.key(rel)
        buf = io.BytesIO()
        with self._translate("download", key, missing_is_error=False):
            sink = buf if limit is None else _Capped(buf, limit, self.url(rel))
            self._wait(self._transfers().download(self.config.bucket, key, sink))
        return buf.getvalue()

    def get_head(self, rel: str, nbytes: int) -> tuple[bytes, int]:
        """The first ``nbytes`` bytes of ``rel`` (all of a shorter object) and the object's size: one ranged
        ``GetObject``, of which no more than ``nbytes`` are read (a server that ignores ``Range`` sends the whole
        object: the rest is never read). A missing object raises ``FileNotFoundError``."""
        key = self.key(rel)
        with self._translate("download", key, missing_is_error=False):
            try:
                response = self.client.get_object(Bucket=self.config.bucket, Key=key, Range=f"bytes=0-{max(nbytes, 1) - 1}")
            except boto_errors() as exc:
                if error_code(exc) not in ("InvalidRange", "416"):
                    raise
                return b"", 0  # an empty object has no byte 0 to start a range at
            body = response["Body"]
            try:
                data = body.read(nbytes)
            finally:
                body.close()
        total = str(response.get("ContentRange") or "").rpartition("/")[2]  # "bytes 0-4095/67108864"
        return data, int(total) if total.isdigit() else int(response.get("ContentLength", len(data)))

    def exists(self, rel: str) -> bool:
        """Whether an object named ``rel`` exists (a HEAD request)."""
        key = self.key(rel)
        try:
            with self._translate("head", key, missing_is_error=False):
                self.client.head_object(Bucket=self.config.bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    def list(self, rel_prefix: str = "") -> builtins.list[str]:
        """Every key that starts with ``rel_prefix`` (a plain string prefix, as in S3), relative and sorted.

        ``list("step-1/")`` lists one directory-like level and below; ``list("step-1")`` would also
        match ``step-10/...``.
        """
        return sorted(self.list_tagged(rel_prefix))

    def list_tagged(self, rel_prefix: str = "") -> dict[str, str]:
        """Every key that starts with ``rel_prefix`` (as :meth:`list`), relative, with its tag: ETag and
        LastModified (the same bytes written again, say by a node re-uploading its part after a restart,
        keep their ETag: only the time tells)."""
        return {k: tag for k, (tag, _) in self.list_sized(rel_prefix).items()}

    def list_sized(self, rel_prefix: str = "") -> dict[str, tuple[str, int]]:
        """Every key that starts with ``rel_prefix`` (as :meth:`list`), relative, with its tag (as :meth:`list_tagged`)
        and its size in bytes: the same listing requests."""
        check_rel("key prefix", rel_prefix, prefix_of_keys=True)
        root = f"{self.config.prefix}/" if self.config.prefix else ""
        found: dict[str, tuple[str, int]] = {}
        with self._translate("list", root + rel_prefix + "*"):
            paginator = self.client.get_paginator("list_objects_v2")
            pages = paginator.paginate(Bucket=self.config.bucket, Prefix=root + rel_prefix, PaginationConfig={"PageSize": _LIST_PAGE})
            for page in pages:
                found.update((obj["Key"][len(root) :], (_tag(obj), int(obj.get("Size", 0)))) for obj in page.get("Contents", ()))
        return found

    def delete(self, rels: builtins.list[str]) -> None:
        """Delete the objects named in ``rels``, up to 1000 per request; missing ones are not an error."""
        keys = list(dict.fromkeys(self.key(rel) for rel in rels))
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            with self._translate("delete", batch[0] if len(batch) == 1 else f"{batch[0]} (+{len(batch) - 1} more)"):
                response = self.client.delete_objects(
                    Bucket=self.config.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            failed = response.get("Errors") or []
            if failed:
                first = failed[0]
                raise CheckpointError(
                    f"s3 delete failed for {len(failed)} of {len(batch)} keys in bucket {self.config.bucket!r} at "
                    f"{self._endpoint()}, first s3://{self.config.bucket}/{first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )

    def check(self) -> None:
        """Raise :class:`CheckpointError` unless the bucket exists and these credentials may use it."""
        try:
            self.client.head_bucket(Bucket=self.config.bucket)
        except boto_errors() as exc:
            code = error_code(exc)
            reason = {"404": "it does not exist", "NoSuchBucket": "it does not exist", "403": "access denied"}.get(code, "unreachable")
            raise CheckpointError(f"s3 bucket {self.config.bucket!r} at {self._endpoint()} is not usable ({reason}): {exc}") from exc

    def abort_unfinished(self) -> int:
        """Abort the multipart uploads a previous daemon on this root began and never ended (see :mod:`.multipart`);
        returns how many. Called once, after :meth:`check`; never raises."""
        unfinished, self._unfinished = self._unfinished, []
        if self._ledger is None:
            return 0
        return self._ledger.abort(self.client, unfinished, self.config.bucket, self.config.endpoint_url, self._endpoint())

    # -- internals --

    def _endpoint(self) -> str:
        meta = getattr(self.client, "meta", None)
        return str(getattr(meta, "endpoint_url", None) or self.config.endpoint_url or "AWS")

    def _transfers(self) -> Any:
        """The store's one s3transfer manager, made on first use (it owns the worker threads)."""
        with self._lock:
            if self._closed:
                raise CheckpointError(f"{self!r} is closed")
            if self._transfer_manager is None:
                from boto3.s3.transfer import TransferConfig, create_transfer_manager

                transfer_config = TransferConfig(
                    multipart_threshold=self.config.part_size,
                    multipart_chunksize=self.config.part_size,
                    max_concurrency=_CONCURRENCY,
                    max_bandwidth=self.config.max_bandwidth,
                    preferred_transfer_client="classic",  # the CRT client ignores max_bandwidth
                )
                self._transfer_manager = create_transfer_manager(self.client, transfer_config)
            return self._transfer_manager

    @staticmethod
    def _subscribers(progress: Callable[[int], None] | None) -> builtins.list[Any] | None:
        if progress is None:
            return None
        from boto3.s3.transfer import ProgressCallbackInvoker

        return [ProgressCallbackInvoker(progress)]

    @staticmethod
    def _wait(future: Any) -> None:
        try:
            future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    @contextlib.contextmanager
    def _translate(self, op: str, key: str, missing_is_error: bool = True) -> Iterator[None]:
        """Turn boto3/botocore failures into ``CheckpointError`` (or ``FileNotFoundError`` for a missing object)."""
        try:
            yield
        except boto_errors() as exc:
            where = f"s3://{self.config.bucket}/{key}"
            if not missing_is_error and error_code(exc) in _MISSING_CODES:
                raise FileNotFoundError(f"no such object {where} at {self._endpoint()}") from exc
            raise CheckpointError(f"s3 {op} {where} at {self._endpoint()} failed: {exc}") from exc


class _Capped:
    """A seekable file object that refuses to hold more than ``limit`` bytes: s3transfer writes each
    downloaded part at its offset (parts of a ranged download arrive in any order), so the end of the
    furthest write is checked, before anything is written."""

    def __init__(self, f: Any, limit: int, where: str) -> None:
        self._f, self._limit, self._where = f, limit, where

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def write(self, data: bytes) -> int:
        if self._f.tell() + len(data) > self._limit:
            raise FormatError(f"{self._where} is larger than the {self._limit} bytes expected; download stopped")
        return self._f.write(data)
