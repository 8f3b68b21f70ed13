"""The object-store interface the multi-node tier (:mod:`.remote`) is written against.

:class:`~ckptd.storage.s3.S3Store` implements it for S3-compatible buckets, :class:`~ckptd.storage.posix.DirStore`
for a shared directory every node mounts; tests use an in-memory double. Keys (``rel``) are relative to the
store's own prefix (or directory), ``/``-separated, never starting with ``/`` and free of ``.``/``..``/empty
segments. Every method blocks until done and may be called from any thread. Failures raise
:class:`~ckptd.errors.CheckpointError` naming the operation and key; reading a missing object raises :class:`FileNotFoundError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..s3config import DirConfig, RemoteConfig

Progress = Callable[[int], None]  # bytes moved since the last call (negative when a retry rewinds)


class ObjectStore(Protocol):
    def url(self, rel: str = "") -> str:
        """Where ``rel`` (or the store's root) lives, for messages: ``s3://bucket/prefix/rel``."""
        ...

    def put_file(self, rel: str, path: str, progress: Progress | None = None) -> None:
        """Upload the local file ``path`` to ``rel``; an unreadable file raises ``OSError``."""
        ...

    def put_bytes(self, rel: str, data: bytes) -> None: ...

    def put_bytes_if(self, rel: str, data: bytes, tag: str | None) -> bool:
        """Write ``data`` to ``rel`` only if the object is as a listing showed it: absent (``tag`` None) or
        with the tag ``tag``; False when another writer came first (S3's conditional PUT: ``If-None-Match``
        / ``If-Match``). A store that ignores those headers writes unconditionally."""
        ...

    def delete_if(self, rel: str, tag: str) -> bool:
        """Delete ``rel`` only if it still has the tag ``tag`` a listing showed; False when it was written
        again or is gone (S3's conditional ``DeleteObject``). Unconditional where the store cannot."""
        ...

    def get_file(self, rel: str, path: str, progress: Progress | None = None, limit: int | None = None) -> None:
        """Download ``rel`` to ``path`` atomically (a failure leaves ``path`` as it was); an object past
        ``limit`` bytes raises :class:`~ckptd.errors.FormatError` before more than ``limit`` are written."""
        ...

    def get_bytes(self, rel: str, limit: int | None = None) -> bytes:
        """The object's bytes; past ``limit`` bytes, :class:`~ckptd.errors.FormatError` (never held whole)."""
        ...

    def exists(self, rel: str) -> bool: ...

    def list(self, rel_prefix: str = "") -> list[str]:
        """Every key starting with ``rel_prefix`` (a plain string prefix), sorted."""
        ...

    def list_tagged(self, rel_prefix: str = "") -> dict[str, str]:
        """Every key starting with ``rel_prefix``, with a tag that changes whenever the object is written,
        even with the same bytes (S3's ETag and LastModified, which counts whole seconds): what a cache of an
        object's contents checks before it is trusted, and what tells a part uploaded again from one left alone."""
        ...

    def delete(self, rels: list[str]) -> None:
        """Delete these objects; missing ones are not an error."""
        ...

    def check(self) -> None:
        """Raise ``CheckpointError`` unless the store is reachable and usable."""
        ...

    def abort_unfinished(self) -> int:
        """Abort the uploads a previous daemon on this root began and never ended (an S3 multipart upload keeps its
        parts, billed, until aborted); returns how many. The daemon calls it once, after :meth:`check`; never raises."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class SizedStore(Protocol):
    """What a store may tell besides :class:`ObjectStore`'s (:class:`~ckptd.storage.s3.S3Store` does): each listed
    object's size, and the head of an object. The bucket tier (:mod:`.remote`) bounds every manifest and fragment it
    reads by the sizes of its step's other objects, and orders steps by a manifest's head alone; a store that cannot
    tell sizes gets the fixed ceiling (``config.MAX_DOCUMENT_BYTES``) and whole reads."""

    def list_sized(self, rel_prefix: str = "") -> dict[str, tuple[str, int]]:
        """Every key starting with ``rel_prefix``, with its tag (as :meth:`ObjectStore.list_tagged`) and size in bytes."""
        ...

    def get_head(self, rel: str, nbytes: int) -> tuple[bytes, int]:
        """The first ``nbytes`` bytes of ``rel`` (all of a shorter object) and the object's size, whatever that is:
        never more than ``nbytes`` held. A missing object raises :class:`FileNotFoundError`."""
        ...


def open_store(remote: RemoteConfig | DirConfig | None, root: str | None = None) -> ObjectStore | None:
    """The store ``remote`` describes (an :class:`ObjectStore`): a bucket, or a shared directory
    (:class:`~.posix.DirStore`); ``None`` without one. ``root``: the daemon's, where the multipart uploads it begins
    are recorded until they end (:mod:`.multipart`)."""
    if remote is None:
        return None
    from ..s3config import DirConfig

    if isinstance(remote, DirConfig):
        from .posix import DirStore

        return DirStore(remote.path)
    from .multipart import UploadLedger
    from .s3 import S3Store

    return S3Store(remote, ledger=UploadLedger(root) if root is not None else None)
