"""POSIX shared-memory segments, created and unlinked by the daemon only, in a directory only it owns.

``/dev/shm`` is writable by every local user, so nothing found there is trusted by name. Each daemon
keeps its segments in a private directory ``/dev/shm/ckptd-<uid>-<16 random hex>`` (mode 0700, 0710
with a group: members may open a segment they were told the name of, but not list the directory),
named in ``<root>/.ckptd-shm`` so that a restarted daemon finds what its previous run committed. A
segment is ``<32 random hex>`` in it; on the wire it is named ``<directory>/<file>``. The daemon
opens, maps, adopts and unlinks only regular files it owns with the mode it set (``O_NOFOLLOW``,
``fstat``): anything else is logged and left alone, never fatal. Names are unguessable and created
with ``O_EXCL`` (a collision is retried).

A commit record ``<segment>.commit`` marks a segment whose shard must be made durable; it survives
a daemon crash together with the segment. It is one line of JSON (the record's fields), a newline,
then the commit's tree exactly as the client sent it: the tree can never change the record's fields.
(``multiprocessing.shared_memory`` is not used: its resource tracker unlinks segments when the
creating process exits.)

Who calls what: the daemon creates, records and unlinks (main thread) and reads segments (persist
workers) through :class:`SegmentDir`; a trainer only maps an existing segment it was leased
(:class:`Mapping`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import stat
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError

if TYPE_CHECKING:  # config imports this module, and protocol imports config
    from .protocol import CommitRecord

log = logging.getLogger("ckptd.daemon")

SHM_DIR = os.environ.get("CKPTD_SHM_DIR", "/dev/shm")
MARKER = ".ckptd-shm"  # in the daemon's root: the name of its private segment directory, and the root's identity
LOCK = ".lock"  # in the segment directory: held (flock) by the daemon using it, for as long as it runs
RECORD_SUFFIX = ".commit"
RECORD_MODE = 0o600  # commit records: read by this daemon alone (whatever the umask or --group), checked so at adoption
ALIGN = 2 << 20  # round segment sizes up so slots can be reused by slightly larger shards
_DIR_RE = re.compile(r"ckptd-\d+-[0-9a-f]{16}")
_FILE_RE = re.compile(r"[0-9a-f]{32}")
NAME_RE = re.compile(rf"{_DIR_RE.pattern}/{_FILE_RE.pattern}")
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC
_HELD: dict[str, list[int]] = {}  # segment directory -> [its lock's fd, this process's SegmentDir objects using it]
_ANY_MODES = frozenset({0o600, 0o640, 0o660})  # a segment's modes under any --group setting: free or leased, committed


class Untrusted(CheckpointError):
    """A file in the segment directory that this daemon did not make (another user, a symlink, a mode)."""


def path_of(name: str) -> str:
    """The path of segment ``name`` (``<directory>/<file>``, as the daemon names it on the wire)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise CheckpointError(f"invalid segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def _identity(root: str) -> str:
    """What tells this root from a copy of it: its device and inode (a copy is a new inode; a rename keeps it)."""
    st = os.stat(root)
    return f"root {st.st_dev}:{st.st_ino}"


def _check_dir(path: str) -> os.stat_result:
    """``path`` is a real directory of this user that no one else may write into."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise Untrusted(f"{path} is not a private directory of uid {os.geteuid()} (uid {st.st_uid}, mode {st.st_mode:o})")
    return st


class SegmentDir:
    """The daemon's private segment directory (daemon main thread; ``open_owned`` on any thread)."""

    def __init__(self, root: str, *, file_mode: int = 0o600, gid: int | None = None) -> None:
        """Use the directory ``<root>/.ckptd-shm`` names if it is ours and this root's (a copied root's marker names the
        original's) and no other daemon holds it; else make a new one."""
        self.file_mode, self.gid = file_mode, gid
        self._marker = os.path.join(root, MARKER)
        self._identity = _identity(root)
        self._locked: str | None = None  # the directory whose lock this object counts in _HELD
        self.name = self._reuse() or self._make()
        self.path = os.path.join(SHM_DIR, self.name)
        self._set_dir_access()  # a reused one as this run's --group setting wants, whatever the previous run's

    def _set_dir_access(self) -> None:
        if self.gid is not None:
            os.chown(self.path, -1, self.gid)
            os.chmod(self.path, 0o710)  # members reach a segment by name, cannot list or create
        else:
            os.chmod(self.path, 0o700)

    @staticmethod
    def read_marker(root: str) -> str | None:
        """The directory name ``root``'s marker holds, if well formed, ours, and made for this root (not copied)."""
        try:
            with open(os.path.join(root, MARKER)) as f:
                name, _, made_for = f.read(4096).strip().partition("\n")
            if not _DIR_RE.fullmatch(name) or made_for.strip() not in ("", _identity(root)):  # "": an older ckptd's marker
                return None
            _check_dir(os.path.join(SHM_DIR, name))
        except (OSError, UnicodeDecodeError, Untrusted):
            return None
        return name

    def _reuse(self) -> str | None:
        name = self.read_marker(os.path.dirname(self._marker))
        if name is None and os.path.exists(self._marker):
            log.warning("%s names no private segment directory of this user and root (a copied root?): starting a new one", self._marker)
        if name is not None and not self._take_lock(os.path.join(SHM_DIR, name)):
            log.warning("%s/%s is in use by another running daemon: its segments are left alone; starting a new one", SHM_DIR, name)
            return None
        return name

    def _take_lock(self, path: str) -> bool:
        """Hold ``path``'s lock while this process uses it (its objects for one directory share it); ``False``: another holds it."""
        if path not in _HELD:
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT | _OPEN, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            _HELD[path] = [fd, 0]
        _HELD[path][1] += 1
        self._locked = path
        return True

    def _make(self) -> str:
        from .files import write_durable

        while True:
            name = f"ckptd-{os.geteuid()}-{secrets.token_hex(8)}"
            path = os.path.join(SHM_DIR, name)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            except OSError as e:
                raise CheckpointError(f"cannot create a segment directory in {SHM_DIR}: {e.strerror}") from None
            try:
                _check_dir(path)
                self._take_lock(path)  # made just now under a random name: no one else holds it
                write_durable(self._marker, f"{name}\n{self._identity}\n".encode())
            except BaseException:
                self._drop_lock()
                os.rmdir(path)  # no directory that no marker names: nothing would ever remove it
                raise
            return name

    def _drop_lock(self) -> None:
        path, self._locked = self._locked, None
        held = _HELD.get(path) if path is not None else None
        if held is not None and held[1] > 1:
            held[1] -= 1
        elif held is not None and path is not None:  # the last of this process's objects for the directory: the lock goes
            del _HELD[path]
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, LOCK))
            os.close(held[0])

    def _path(self, name: str) -> str:
        d, sep, f = name.partition("/")
        if d != self.name or not sep or not _FILE_RE.fullmatch(f):
            raise Untrusted(f"segment {name!r} is not in this daemon's directory {self.path}")
        return os.path.join(self.path, f)

    # ------------------------------------------------------------------ segments

    def names(self) -> tuple[list[str], list[str]]:
        """``(segments, strays)``: segment names in the directory, and every other entry's file name."""
        try:
            entries = sorted(os.listdir(self.path))
        except FileNotFoundError:
            return [], []
        segs = [f"{self.name}/{e}" for e in entries if _FILE_RE.fullmatch(e)]
        ours = {LOCK, *(e for e in entries if _FILE_RE.fullmatch(e[:32]) and e[32:] in ("", RECORD_SUFFIX))}
        strays = [e for e in entries if e not in ours]
        return segs, strays

    def create(self, size: int) -> tuple[str, int]:
        """A new segment of at least ``size`` bytes, every page allocated; returns its name and size. ``posix_fallocate``
        makes a full ``/dev/shm`` fail here (ENOSPC), not in the trainer's copy later (SIGBUS), and prefaults the pages."""
        size = max(ALIGN, -(-size // ALIGN) * ALIGN)
        while True:
            name = f"{self.name}/{secrets.token_hex(16)}"
            path = self._path(name)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, self.file_mode)
                break
            except FileExistsError:
                continue
        try:
            os.fchmod(fd, self.file_mode)
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
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
        return name, size

    def open_owned(self, name: str, flags: int = os.O_RDONLY) -> int:
        """An fd of segment (or record) ``name`` if it is a regular file this daemon made; else :class:`Untrusted`."""
        path = self._path(name.removesuffix(RECORD_SUFFIX)) + (RECORD_SUFFIX if name.endswith(RECORD_SUFFIX) else "")
        try:
            fd = os.open(path, flags | _OPEN)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise Untrusted(f"{path} is a symbolic link") from None
            raise
        st = os.fstat(fd)
        modes = (RECORD_MODE,) if name.endswith(RECORD_SUFFIX) else (self.file_mode, self.sealed_mode)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) not in modes:
            os.close(fd)
            raise Untrusted(f"{path} is not a file this daemon made (uid {st.st_uid}, mode {st.st_mode:o})")
        return fd

    def take_over(self, name: str) -> None:
        """Segment ``name`` a previous run of this daemon left (start-up): accepted under any mode a ckptd
        configuration writes (``--group`` may have been added or dropped since), then given this run's
        committed mode and group. Anything else is :class:`Untrusted`."""
        fd = os.open(self._path(name), os.O_RDONLY | _OPEN)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) not in _ANY_MODES:
                raise Untrusted(f"{self._path(name)} is not a file this daemon made (uid {st.st_uid}, mode {st.st_mode:o})")
            os.fchmod(fd, self.sealed_mode)
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
        finally:
            os.close(fd)

    @property
    def sealed_mode(self) -> int:
        """A committed segment's mode: the group (``--group``) may read it, no longer write it."""
        return self.file_mode & ~0o022

    def seal(self, name: str) -> None:
        """Segment ``name`` was committed: no member of the group opens it for writing from here on (its lessee
        writes through the mapping it has; a hot restore's readers open it read-only)."""
        if self.sealed_mode != self.file_mode:
            os.chmod(self._path(name), self.sealed_mode)

    def unseal(self, name: str, *, rename: bool) -> str:
        """Segment ``name`` is leased again: writable by its lessee; under a fresh name if ``rename`` (its name
        went to hot restores' readers, who must not open it for writing now). Returns its name."""
        if self.sealed_mode == self.file_mode:
            return name
        if not rename:
            os.chmod(self._path(name), self.file_mode)
            return name
        # renamed first, writable after: an open of the old name racing this must never find it 0660
        while True:
            new = f"{self.name}/{secrets.token_hex(16)}"
            try:
                os.link(self._path(name), self._path(new))  # never replaces: a name taken is drawn again
                break
            except FileExistsError:
                continue
        try:
            os.unlink(self._path(name))
        except OSError:
            os.unlink(self._path(new))  # one name, the old one, which the caller then retires
            raise
        try:
            os.chmod(self._path(new), self.file_mode)
        except OSError:
            os.unlink(self._path(new))  # the caller retires the slot by its old name, gone already: nothing is left
            raise
        return new

    def size_of(self, name: str) -> int:
        fd = self.open_owned(name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def unlink(self, name: str) -> None:
        """Remove segment ``name`` and its record (names are checked; the directory is ours, so an
        unlink cannot reach another user's file)."""
        path = self._path(name)
        for p in (path + RECORD_SUFFIX, path):  # the record first: a record never outlives its segment
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def remove_stray(self, entry: str) -> None:
        """Remove a leftover that is not a segment (a torn record's temporary file)."""
        try:
            os.unlink(os.path.join(self.path, os.path.basename(entry)))
        except OSError as e:
            log.warning("cannot remove %s from %s: %s", entry, self.path, e.strerror)

    def close(self) -> None:
        """Shutdown: remove the directory and the marker when no segment is left in it; let go of its lock."""
        self._drop_lock()
        try:
            os.rmdir(self.path)
        except OSError:
            return  # committed segments remain for the next run
        try:
            os.unlink(self._marker)
        except OSError:
            pass

    # ------------------------------------------------------------------ commit records

    def write_record(self, name: str, record: CommitRecord) -> None:
        """Record a commit for segment ``name`` atomically (tmpfs: no fsync needed, it lives as long
        as the segment): the record's fields as one JSON line, then the raw tree bytes (:class:`~ckptd.protocol.CommitRecord`)."""
        path = self._path(name) + RECORD_SUFFIX
        tmp = path + ".tmp"
        try:
            os.unlink(tmp)  # a torn earlier attempt
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, RECORD_MODE)
        with open(fd, "wb") as f:
            f.write(json.dumps(record.fields(), separators=(",", ":")).encode() + b"\n")
            f.write(record.tree)
        os.replace(tmp, path)

    def read_record(self, name: str) -> tuple[dict[str, Any], bytes] | None:
        """``(fields, tree)`` of segment ``name``'s commit record, unchecked (:func:`~ckptd.protocol.validate_record`), or
        ``None`` when there is none or it is torn; :class:`Untrusted` when the record is not this daemon's file."""
        try:
            fd = self.open_owned(name + RECORD_SUFFIX)
        except FileNotFoundError:
            return None
        with open(fd, "rb") as f:
            head, nl, tree = f.read().partition(b"\n")
        try:
            rec = json.loads(head)
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None  # a torn record never happened: the commit was never acknowledged
        return (rec, tree) if nl and isinstance(rec, dict) else None

    def drop_record(self, name: str) -> None:
        try:
            os.unlink(self._path(name) + RECORD_SUFFIX)
        except FileNotFoundError:
            pass


def segments_of(root: str) -> list[str]:
    """Segment names the daemon of ``root`` holds now (tests and tools; no directory is created)."""
    d = SegmentDir.read_marker(root)
    if d is None:
        return []
    return [f"{d}/{e}" for e in sorted(os.listdir(os.path.join(SHM_DIR, d))) if _FILE_RE.fullmatch(e)]


def purge(root: str) -> list[str]:
    """Remove the segment directory of ``root``'s daemon and all in it (after a test or a demo); returns
    what was removed."""
    d = SegmentDir.read_marker(root)
    if d is None:
        return []
    path = os.path.join(SHM_DIR, d)
    gone = sorted(os.listdir(path))
    for e in gone:
        os.unlink(os.path.join(path, e))
    os.rmdir(path)
    os.unlink(os.path.join(root, MARKER))
    return gone


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in for writing


def populate_write(addr: int, size: int) -> bool:
    """Fault ``size`` bytes of a writable mapping at ``addr`` in, as ``MAP_POPULATE`` would, but through a
    ctypes call, which releases the GIL (``mmap.mmap`` with ``MAP_POPULATE`` holds it on Python 3.11: a
    spare warmed on a thread would stall the training thread) and runs no torch or OpenMP code on that
    thread. False where the kernel lacks the advice (the pages then fault on their first copy)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_POPULATE_WRITE) == 0
    except (OSError, AttributeError):
        return False


def dont_fork(mm: mmap.mmap) -> None:
    """Keep a mapping of a segment out of forked children (a DataLoader's workers, forked after a snapshot
    or a restore): a child that inherited it would keep the segment's pages allocated after the daemon
    unlinked it, outside any budget, for as long as the child lives. No child reads these pages."""
    advice = getattr(mmap, "MADV_DONTFORK", None)
    if advice is not None and len(mm):
        mm.madvise(advice)


class Mapping:
    """A long-lived shared mapping of one segment with a ``uint8`` tensor over it.

    Mapped once with ``MAP_POPULATE`` and kept: a fresh mapping of a populated segment costs a
    minor fault per page on its first copy (4x slower than a warm mapping).
    """

    def __init__(self, name: str, *, writable: bool = True, fd: int | None = None, populate: bool = True) -> None:
        """Map segment ``name``: read-write and populated for a trainer (not ``populate``: the caller
        faults the pages in itself); read-only and lazily faulted for the daemon, which passes the ``fd``
        it checked (``MAP_POPULATE`` holds the GIL for the whole call, which would stall the daemon's
        request loop; faults taken inside ``os.write`` and the hashing do not)."""
        self.name = name
        if fd is None:
            fd = os.open(path_of(name), (os.O_RDWR if writable else os.O_RDONLY) | _OPEN)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"segment {name!r} is not a regular file")
            self.size = st.st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if writable and populate else 0)
            self._mm = mmap.mmap(fd, self.size, flags=flags, prot=prot)
            dont_fork(self._mm)
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
