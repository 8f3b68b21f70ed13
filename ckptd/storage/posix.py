"""A shared POSIX directory as the multi-node tier: :class:`DirStore`, an :class:`~.store.ObjectStore` over a file
system every node mounts (Lustre, GPFS, NFS, WekaFS, CephFS, sshfs), so the bucket tier's completion code
(:mod:`.remote`) serves it unchanged: keys are paths under the directory (``<job>/step-N/...``).

Written for a network file system, not a local disk:

- **No object is ever half there.** Each is written under a unique temporary name in its final directory
  (``.ckptd-tmp.<name>.<host>.<pid>.<random>``, never listed), fsynced, then published in one step: by ``rename``
  over the key (:meth:`DirStore.put_file`, :meth:`DirStore.put_bytes`: a reader sees the old object or the new one),
  or by ``link``, which never replaces (:meth:`DirStore.put_bytes_if` of an absent key: the manifest that completes
  a step; ``EEXIST`` means another node came first). The directory is fsynced after.
- **A rename or link that reported a failure is checked before it is retried**: NFS retransmits a request whose
  reply was lost, and the retransmission fails (``ENOENT``, ``EEXIST``) although the first one succeeded. A rename
  whose temporary name is gone happened; a link that met ``EEXIST`` won if the key holds its bytes. ``ESTALE``,
  ``EINTR``, ``EAGAIN`` and ``ETIMEDOUT`` are retried a few times; ``ESTALE``/``ENOENT`` in a listing (a directory
  another node removed meanwhile) skip what vanished.
- **A full file system or quota** (``ENOSPC``, ``EDQUOT``) fails the operation with :class:`~ckptd.errors.DiskFull`
  naming the file, its temporary file removed, nothing published. There is no ``latest`` pointer here to strand:
  the newest step is the newest complete manifest by commit order, as in a bucket.
- **Tags** (what a conditional write or delete compares) are the inode number, size and modification time as this
  node sees them; every write makes a new file, so a tag changes whenever an object is written.
- **Nothing here trusts the directory's contents**: another user or node may have put anything there. No symlink
  is followed below the directory (every component is opened ``O_NOFOLLOW`` relative to its parent), only regular
  files are objects, and what is read is bounded by the caller's limit (:mod:`.documents`).

Compare-and-replace of an existing key (:meth:`DirStore.put_bytes_if` with a tag: a rollback's manifest replacing
the step it supersedes) checks the tag, then renames over it, then reads the key back: two writers racing within
that window both publish and the later one's object stays, and only its writer is told it won. Within one job only
one run saves at a time, so the racers there are the nodes of one attempt writing the same manifest.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..errors import CheckpointError, FormatError, write_failed
from ..files import fsync_dir
from ..s3config import check_rel

if TYPE_CHECKING:
    from .store import Progress

log = logging.getLogger("ckptd.daemon")

HIDDEN = ".ckptd-"  # names the store makes for itself (temporary and retired files): never objects
_TMP = HIDDEN + "tmp."
_DEL = HIDDEN + "del."
_TRANSIENT = frozenset((errno.ESTALE, errno.EINTR, errno.EAGAIN, errno.ETIMEDOUT))
_FULL = frozenset((errno.ENOSPC, errno.EDQUOT))
RETRIES = 5  # tries of one rename, link or listing that fails transiently
_BACKOFF_S = 0.05  # doubled after each
MAX_DEPTH = 8  # directories below the store's: keys are <job>/step-N[/attempt]/name
MAX_LISTED = 1_000_000  # objects in one listing: a directory that holds more is refused, not held in memory
STALE_TEMP_S = 3600.0  # a temporary or set-aside file untouched this long is a crashed writer's (a live one writes on)
CHUNK = 8 << 20  # bytes copied per read and write
_D = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_R = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO put there does not hang a read


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"  # no dots: a temporary name splits on them


def tag_of(st: os.stat_result) -> str:
    """An object's tag: inode, modification time (ns) and size, as this node sees them."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


class DirStore:
    """The objects under directory ``path`` (absolute; it must exist: an unmounted mount point is refused at
    :meth:`check` only if it is not a writable directory, so mount it before the daemon starts)."""

    listing_may_lag = True  # a mount's cached directory can miss what another node wrote (sshfs: ~20 s): see remote._probe

    def __init__(self, path: str, *, sleep: Callable[[float], None] = time.sleep) -> None:
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(f"shared directory {path!r} must be an absolute path")
        self.path = os.path.normpath(path)
        self._me = f"{_host()}.{os.getpid()}"
        self._sleep = sleep

    def __repr__(self) -> str:
        return f"DirStore({self.path})"

    def __enter__(self) -> DirStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: every operation opens and closes its own descriptors."""

    def url(self, rel: str = "") -> str:
        """The path of ``rel`` (the directory itself without one), for messages and ``wait()``'s answer."""
        return os.path.join(self.path, rel) if rel else self.path

    # ------------------------------------------------------------------ writing

    def put_file(self, rel: str, path: str, progress: Progress | None = None) -> None:
        """Copy the local file ``path`` to ``rel``: a temporary file, fsynced, renamed over the key."""
        src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._put(rel, lambda fd: _copy(src, fd, None, progress, path))
        finally:
            os.close(src)

    def put_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` as :meth:`put_file` does."""
        self._put(rel, lambda fd: _write_all(fd, data))

    def _put(self, rel: str, feed: Callable[[int], None]) -> None:
        for attempt in range(RETRIES):
            with self._dir_of(rel, create=True) as (dfd, name):
                try:
                    tmp = self._temp(dfd, name, feed, rel)
                except FileNotFoundError:  # another node removed the folder, empty, between our walk and our write
                    if attempt == RETRIES - 1:
                        raise CheckpointError(f"writing {self.url(rel)} failed: its folder keeps vanishing") from None
                    continue
                self._rename(dfd, tmp, name, rel)
                self._sync_dir(dfd)
                return

    def put_bytes_if(self, rel: str, data: bytes, tag: str | None) -> bool:
        """Write ``data`` to ``rel`` only if the key is absent (``tag`` None) or holds ``tag``.

        Args:
            rel: the key.
            data: the object's bytes (a manifest).
            tag: the tag a listing showed, or None for "absent".

        Returns:
            True when this write is what the key holds now (or the same bytes were there already); False when
            another writer came first.
        """
        with self._dir_of(rel, create=True) as (dfd, name):
            if self._tag(dfd, name) != tag:
                return False
            try:
                tmp = self._temp(dfd, name, lambda fd: _write_all(fd, data), rel)
            except FileNotFoundError:  # another node removed the folder meanwhile: the objects it judged are gone
                return False
            try:
                if tag is None:
                    won = self._link(dfd, tmp, name, data, rel)
                else:
                    self._rename(dfd, tmp, name, rel)
                    won = self._holds(dfd, name, data)
            finally:
                _unlink_quietly(dfd, tmp)
            self._sync_dir(dfd)
            return won

    def delete_if(self, rel: str, tag: str) -> bool:
        """Delete ``rel`` only if it still holds ``tag``.

        The key is renamed aside first (one step: no other deleter or writer can take the same file), then its tag
        checked again; an object written meanwhile is put back.

        Args:
            rel: the key.
            tag: the tag a listing showed.

        Returns:
            True when deleted; False when it was written again or is gone.
        """
        with self._dir_of(rel, create=False) as (dfd, name):
            if dfd < 0 or self._tag(dfd, name) != tag:
                return False
            aside = f"{_DEL}{name}.{self._me}.{secrets.token_hex(4)}"
            try:
                self._retry(lambda: os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd), "delete", rel)
            except FileNotFoundError:
                if not _lexists(dfd, aside):
                    return False  # another deleter or writer took it first
                # the rename went through and its retransmission found no source: go on with what was set aside
            if self._tag(dfd, aside) != tag:  # written again between the check and the rename: it goes back
                self._put_back(dfd, aside, name, rel)
                return False
            _unlink_quietly(dfd, aside)
            self._sync_dir(dfd)
            return True

    def _put_back(self, dfd: int, aside: str, name: str, rel: str) -> None:
        """An object :meth:`delete_if` set aside but must keep: linked back under its key unless the key holds a newer
        one (then the old one set aside goes); the set-aside file stays, and the failure is raised, only when neither
        a link nor a rename can bring it back to an empty key."""
        for attempt in range(RETRIES):
            try:
                os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                break
            except OSError as e:
                if isinstance(e, FileExistsError) or self._tag(dfd, name) is not None:
                    break  # a newer object holds the key (sshfs says EPERM for it)
                if e.errno in _TRANSIENT and attempt < RETRIES - 1:
                    self._sleep(_BACKOFF_S * 2**attempt)
                    continue
                try:
                    os.rename(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # the key is empty: nothing is replaced
                    return
                except OSError as e2:
                    raise CheckpointError(
                        f"delete of {self.url(rel)} stopped: it was written again meanwhile, and putting it back failed"
                        f" ({e2.strerror or e2}); it is kept as {aside} in that folder"
                    ) from None
        _unlink_quietly(dfd, aside)

    def delete(self, rels: builtins.list[str]) -> None:
        """Delete these objects (missing ones are not an error), then the directories left empty."""
        emptied: set[str] = set()
        for rel in dict.fromkeys(rels):
            with self._dir_of(rel, create=False) as (dfd, name):
                if dfd < 0:
                    continue
                try:
                    self._retry(lambda: os.unlink(name, dir_fd=dfd), "delete", rel)  # noqa: B023
                except FileNotFoundError:
                    pass
                emptied.add(rel.rpartition("/")[0])
        for folder in sorted(emptied, key=lambda f: -f.count("/")):
            self._prune(folder)

    def _prune(self, folder: str) -> None:
        """Remove ``folder`` and the folders above it (not the store's own) while they are empty."""
        while folder:
            parent, _, name = folder.rpartition("/")
            try:
                with self._dir_of(folder, create=False) as (dfd, _):  # the parent, opened without following links
                    if dfd < 0:
                        return
                    os.rmdir(name, dir_fd=dfd)
            except OSError:
                return  # not empty (another node writes there), gone, or not ours to remove
            folder = parent

    # ------------------------------------------------------------------ reading

    def get_file(self, rel: str, path: str, progress: Progress | None = None, limit: int | None = None) -> None:
        """Copy ``rel`` to the local ``path`` atomically (``path.part``, fsynced, renamed); an object past ``limit``
        bytes raises :class:`~ckptd.errors.FormatError` before more than ``limit`` are written; a missing one
        ``FileNotFoundError``."""
        part = path + ".part"
        with self._open(rel) as (src, size):
            if limit is not None and size > limit:
                raise FormatError(f"{self.url(rel)} is {size} bytes, more than the {limit} expected; not read")
            try:
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise write_failed(part, e) from None
            try:
                try:
                    _copy(src, fd, limit, progress, self.url(rel))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(part, path)
            except BaseException as e:
                _unlink_quietly(None, part)
                if isinstance(e, OSError):
                    raise write_failed(path, e) from None
                raise
        try:
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        except OSError as e:
            raise write_failed(path, e) from None

    def get_bytes(self, rel: str, limit: int | None = None) -> bytes:
        """The object's bytes; past ``limit`` bytes :class:`~ckptd.errors.FormatError` (never held whole); a missing
        object ``FileNotFoundError``."""
        with self._open(rel) as (fd, size):
            if limit is not None and size > limit:
                raise FormatError(f"{self.url(rel)} is {size} bytes, more than the {limit} expected; not read")
            data = _read_up_to(fd, (size if limit is None else limit) + 1, self.url(rel))
        if limit is not None and len(data) > limit:
            raise FormatError(f"{self.url(rel)} grew past the {limit} bytes expected while it was read; not read")
        return data

    def get_head(self, rel: str, nbytes: int) -> tuple[bytes, int]:
        """The first ``nbytes`` bytes of ``rel`` (all of a shorter object) and its size; ``FileNotFoundError`` if
        missing."""
        with self._open(rel) as (fd, size):
            return _read_up_to(fd, max(nbytes, 0), self.url(rel)), size

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is an object (a regular file, not one of the store's own temporary files)."""
        with self._dir_of(rel, create=False) as (dfd, name):
            return dfd >= 0 and self._tag(dfd, name) is not None

    def list(self, rel_prefix: str = "") -> builtins.list[str]:
        """Every key starting with ``rel_prefix`` (a plain string prefix, as in S3), sorted."""
        return sorted(self.list_sized(rel_prefix))

    def list_tagged(self, rel_prefix: str = "") -> dict[str, str]:
        """Every key starting with ``rel_prefix``, with its tag (:func:`tag_of`)."""
        return {k: tag for k, (tag, _) in self.list_sized(rel_prefix).items()}

    def list_sized(self, rel_prefix: str = "") -> dict[str, tuple[str, int]]:
        """Every key starting with ``rel_prefix``, with its tag and size. A directory that vanishes while it is
        listed (another node removed it) is skipped; ``ESTALE`` on the listing itself is retried."""
        check_rel("key prefix", rel_prefix, prefix_of_keys=True)
        parts = rel_prefix.split("/")[:-1]  # the folders the prefix names whole
        found: dict[str, tuple[str, int]] = {}

        def walk() -> None:
            found.clear()
            try:
                fd = self._walk(parts, create=False)
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing under that prefix (or it is not a folder: no object there either)
            try:
                self._scan(fd, "".join(p + "/" for p in parts), rel_prefix, found, len(parts))
            finally:
                os.close(fd)

        self._retry(walk, "list", rel_prefix + "*")
        return found

    def _scan(self, fd: int, rel_dir: str, prefix: str, out: dict[str, tuple[str, int]], depth: int) -> None:
        with os.scandir(fd) as entries:
            for entry in entries:
                key = rel_dir + entry.name
                if entry.name.startswith(HIDDEN) or not (key.startswith(prefix) or prefix.startswith(key + "/")):
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if depth < MAX_DEPTH:
                            sub = os.open(entry.name, _D, dir_fd=fd)
                            try:
                                self._scan(sub, key + "/", prefix, out, depth + 1)
                            finally:
                                os.close(sub)
                    elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                        st = entry.stat(follow_symlinks=False)
                        out[key] = (tag_of(st), st.st_size)
                        if len(out) > MAX_LISTED:
                            raise CheckpointError(f"{self.url(prefix)}*: more than {MAX_LISTED} objects; not listed")
                except OSError as e:
                    if e.errno not in (errno.ENOENT, errno.ESTALE):  # vanished meanwhile: another node removed it
                        raise

    # ------------------------------------------------------------------ the store as a whole

    def check(self) -> None:
        """Raise :class:`CheckpointError` unless the directory exists and this process can write, fsync and hard-link
        there (a step's manifest is published with ``link(2)``)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise CheckpointError(f"shared directory {self.path} is not usable: {e.strerror or e} (is it mounted?)") from None
        linked = f"{_TMP}probe-link.{self._me}.{secrets.token_hex(4)}"
        probe = None
        try:
            try:
                probe = self._temp(fd, "probe", lambda f: _write_all(f, b"ckptd"), "probe")
            except OSError as e:  # the folder vanished under us: a mount going away
                raise CheckpointError(e.strerror or str(e)) from None
            try:
                os.link(probe, linked, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except OSError as e:
                raise CheckpointError(f"no hard links (link(2)), which publishing a step's manifest needs: {e.strerror or e}") from None
        except CheckpointError as e:
            raise CheckpointError(f"shared directory {self.path} is not usable: {e}") from None
        finally:
            for name in (probe, linked):
                if name is not None:
                    _unlink_quietly(fd, name)
            os.close(fd)

    def abort_unfinished(self) -> int:
        """Remove the temporary and set-aside files that crashed writers left: any node's untouched for an hour (a live
        writer's file is written to, then renamed, within seconds of its last write; a pid says nothing across nodes or
        containers that share a host name). Returns how many; never raises."""
        removed = 0
        try:
            for folder, name, st in self._hidden():
                if time.time() - st.st_mtime > STALE_TEMP_S:
                    dfd = self._walk([p for p in folder.split("/") if p], create=False)
                    try:  # one gone already (another node cleaned it up), or not ours to remove, is not counted
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=dfd)
                            removed += 1
                    finally:
                        os.close(dfd)
        except Exception as e:  # never fatal: what is left is invisible to readers and tried again at the next start
            log.warning("shared directory %s: cleaning up unfinished writes failed: %s", self.path, e)
        return removed

    def _hidden(self) -> Iterator[tuple[str, str, os.stat_result]]:
        """(folder key with ``/``, name, stat) of every temporary or set-aside file under the store."""
        stack: list[tuple[str, int]] = [("", 0)]
        while stack:
            folder, depth = stack.pop()
            try:
                fd = self._walk([p for p in folder.split("/") if p], create=False)
            except OSError:
                continue
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False) and depth < MAX_DEPTH:
                            stack.append((folder + entry.name + "/", depth + 1))
                        elif entry.name.startswith((_TMP, _DEL)) and entry.is_file(follow_symlinks=False):
                            try:
                                st = entry.stat(follow_symlinks=False)
                            except OSError:
                                continue  # another node cleaned it up meanwhile
                            yield folder, entry.name, st
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ internals

    @contextmanager
    def _dir_of(self, rel: str, create: bool) -> Iterator[tuple[int, str]]:
        """(fd of the folder holding ``rel``, its last name); fd -1 when that folder does not exist (``create``
        False). A folder another node removes between two steps is made again (``create``)."""
        parts = check_rel("object key", rel).split("/")
        if parts[-1].startswith(HIDDEN):
            raise ValueError(f"object key {rel!r}: names starting with {HIDDEN!r} are the store's own")
        try:
            fd = self._walk(parts[:-1], create)
        except NotADirectoryError as e:
            if create:
                raise CheckpointError(
                    f"writing {self.url(rel)} refused: {e.strerror or e} (a file or a symbolic link where a folder should be)"
                ) from None
            fd = -1
        except FileNotFoundError:
            if create:
                raise CheckpointError(f"writing {self.url(rel)} failed: its folder keeps vanishing") from None
            fd = -1
        except OSError as e:  # EACCES, EIO, a full file system or quota making a folder, ESTALE past the retries
            if create:
                raise write_failed(self.url(rel), e) from None
            raise CheckpointError(f"{self.url(rel)}: {e.strerror or e}") from None
        try:
            yield fd, parts[-1]
        finally:
            if fd >= 0:
                os.close(fd)

    def _walk(self, parts: builtins.list[str], create: bool) -> int:
        """An fd of the folder ``parts`` under the store, each step opened without following a symlink (one planted
        there fails with ``ENOTDIR``: refused); folders made on the way when ``create``, made again should another
        node remove one, empty, meanwhile."""
        for attempt in range(RETRIES):
            try:
                return self._walk_once(parts, create)
            except FileNotFoundError:
                if not create or attempt == RETRIES - 1:
                    raise
            except OSError as e:
                if e.errno not in _TRANSIENT or attempt == RETRIES - 1:
                    raise
                self._sleep(_BACKOFF_S * 2**attempt)
        raise AssertionError("not reached")

    def _walk_once(self, parts: builtins.list[str], create: bool) -> int:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)  # the daemon's umask decides who else may read
                    except FileExistsError:
                        pass
                try:
                    sub = os.open(part, _D, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise NotADirectoryError(errno.ENOTDIR, f"{part} is a symbolic link: not followed") from None
                    raise
                os.close(fd)
                fd = sub
            return fd
        except BaseException:
            os.close(fd)
            raise

    @contextmanager
    def _open(self, rel: str) -> Iterator[tuple[int, int]]:
        """(read fd, size) of object ``rel``: a regular file, opened without following a symlink."""
        with self._dir_of(rel, create=False) as (dfd, name):
            if dfd < 0:
                raise FileNotFoundError(errno.ENOENT, f"no such object {self.url(rel)}")
            try:
                fd = os.open(name, _R, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    raise FileNotFoundError(errno.ENOENT, f"no such object {self.url(rel)}") from None
                raise CheckpointError(f"reading {self.url(rel)} failed: {e.strerror or e}") from None
        try:
            try:
                st = os.fstat(fd)
            except OSError as e:
                raise CheckpointError(f"reading {self.url(rel)} failed: {e.strerror or e}") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{self.url(rel)} is not a regular file; not read")
            yield fd, st.st_size
        finally:
            os.close(fd)

    def _temp(self, dfd: int, name: str, feed: Callable[[int], None], rel: str) -> str:
        """A new temporary file beside ``name`` holding what ``feed`` writes, fsynced and closed; its name."""
        tmp = f"{_TMP}{name}.{self._me}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dfd)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise write_failed(self.url(rel), e) from None
        try:
            try:
                feed(fd)
                os.fsync(fd)  # a network file system reports a failed write here (or at close), not at write()
            finally:
                os.close(fd)
        except BaseException as e:
            _unlink_quietly(dfd, tmp)
            if isinstance(e, OSError):
                raise write_failed(self.url(rel), e) from None
            raise
        return tmp

    def _rename(self, dfd: int, tmp: str, name: str, rel: str) -> None:
        """Rename ``tmp`` over ``name``; a failure after which ``tmp`` is gone was a success whose reply was lost."""
        for attempt in range(RETRIES):
            try:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                return
            except OSError as e:
                if not _lexists(dfd, tmp):
                    log.info("shared directory: rename to %s reported %s after it was done", self.url(rel), e.strerror)
                    return
                if e.errno in _FULL or e.errno not in _TRANSIENT or attempt == RETRIES - 1:
                    _unlink_quietly(dfd, tmp)
                    raise write_failed(self.url(rel), e) from None
                self._sleep(_BACKOFF_S * 2**attempt)

    def _link(self, dfd: int, tmp: str, name: str, data: bytes, rel: str) -> bool:
        """Publish ``tmp`` as ``name`` unless ``name`` exists; True if ``name`` now holds ``data`` by this link (or held
        the same bytes already, or our own link went through and its retransmission failed). A link that fails while
        the key is there lost to another writer, whatever the error says: sshfs reports ``EPERM`` for it, NFS may
        report ``EEXIST`` for a retransmission of our own."""
        for attempt in range(RETRIES):
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                return True
            except OSError as e:
                if isinstance(e, FileExistsError) or self._tag(dfd, name) is not None:
                    return self._holds(dfd, name, data)
                if e.errno in _FULL or e.errno not in _TRANSIENT or attempt == RETRIES - 1:
                    raise write_failed(self.url(rel), e) from None
                self._sleep(_BACKOFF_S * 2**attempt)
        return False  # not reached: the last attempt raises

    def _holds(self, dfd: int, name: str, data: bytes) -> bool:
        """Whether ``name`` is a regular file holding exactly ``data``."""
        try:
            fd = os.open(name, _R, dir_fd=dfd)
        except OSError:
            return False
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode) and _read_up_to(fd, len(data) + 1, name) == data
        except (OSError, CheckpointError):
            return False
        finally:
            os.close(fd)

    def _tag(self, dfd: int, name: str) -> str | None:
        """The tag of object ``name`` in folder ``dfd``; None when absent or not a regular file."""
        try:
            st = self._retry(lambda: os.stat(name, dir_fd=dfd, follow_symlinks=False), "stat", name)
        except FileNotFoundError:
            return None
        return tag_of(st) if stat.S_ISREG(st.st_mode) else None

    def _sync_dir(self, dfd: int) -> None:
        """fsync the folder (the names in it); a file system that cannot fsync a folder is tolerated."""
        try:
            os.fsync(dfd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
                raise CheckpointError(f"fsync of a folder of {self.path} failed: {e.strerror or e}") from None

    def _retry(self, call: Callable[[], object], op: str, rel: str):  # noqa: ANN202
        """``call()``, tried again after a transient error (ESTALE...); ``FileNotFoundError`` passes through, other
        failures become :class:`CheckpointError` naming ``op`` and the key."""
        for attempt in range(RETRIES):
            try:
                return call()
            except FileNotFoundError:
                raise
            except OSError as e:
                if e.errno not in _TRANSIENT or attempt == RETRIES - 1:
                    raise CheckpointError(f"{op} {self.url(rel)} failed: {e.strerror or e}") from None
                self._sleep(_BACKOFF_S * 2**attempt)
        return None  # not reached


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy(src: int, dst: int, limit: int | None, progress: Progress | None, where: str) -> None:
    """Copy ``src`` (``where``, for messages) to ``dst`` in chunks; :class:`FormatError` at the chunk that passes
    ``limit``; a failed read a :class:`CheckpointError` naming ``where``, a failed write the ``OSError`` itself."""
    buf = bytearray(CHUNK)
    view, total = memoryview(buf), 0
    while True:
        try:
            n = os.readv(src, [buf])
        except OSError as e:
            raise CheckpointError(f"reading {where} failed: {e.strerror or e}") from None
        if n == 0:
            return
        total += n
        if limit is not None and total > limit:
            raise FormatError(f"{where} is more than the {limit} bytes expected; not copied")
        _write_all(dst, view[:n])
        if progress is not None:
            progress(n)


def _read_up_to(fd: int, nbytes: int, where: str) -> bytes:
    chunks, left = [], nbytes
    while left > 0:
        try:
            chunk = os.read(fd, min(left, CHUNK))
        except OSError as e:
            raise CheckpointError(f"reading {where} failed: {e.strerror or e}") from None
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _lexists(dfd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: assume it is there (the caller retries or reports)


def _unlink_quietly(dfd: int | None, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass
