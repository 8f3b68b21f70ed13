"""Who may use what the daemon creates (its owner only, or also one configured group), and who sent a request.

Owner-only (the default): the checkpoint root 0700, the socket's directory 0700, the socket and every
segment 0600. With ``--group G``: root 2750 (setgid, so every step below inherits the group and G's
members can restore), socket directory 0750, socket and segments 0660 with group G.
Called by the daemon's main thread at start-up (root, socket) and when it creates a segment.

The socket's directory is trusted only when it is the daemon user's own: whoever can write in it can
bind a socket of their own in place of the daemon's and receive every trainer's requests (a
``/tmp/ckptd-<uid>`` made in advance by another user, where ``XDG_RUNTIME_DIR`` is unset). The client's
side of the same check is in :mod:`ckptd.client.rpc`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from collections.abc import Iterator

import zmq

from ..config import resolve_group
from ..errors import CheckpointError

log = logging.getLogger("ckptd.daemon")

ROOT_LOCK = ".ckptd.lock"  # in the root: flock'ed by the daemon that uses it


def describe_owner(uid: int) -> str:
    """``nobody (uid 65534)``; ``uid 1234`` for a uid with no passwd entry."""
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _name_of_group(gid: int) -> str:
    import grp

    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


class Access:
    """The file modes and group of everything the daemon creates."""

    def __init__(self, group: str | int | None = None) -> None:
        self.gid = resolve_group(group)
        self.file_mode = 0o600 if self.gid is None else 0o660  # socket, segments
        self.dir_mode = 0o700 if self.gid is None else 0o750  # the socket's directory
        self.root_mode = 0o700 if self.gid is None else 0o2750

    def restrict(self, path: str, mode: int) -> None:
        os.chmod(path, mode)
        if self.gid is not None:
            os.chown(path, -1, self.gid)

    def make_root(self, root: str) -> int:
        """Create the checkpoint root with the right mode, or check an existing one: the daemon's user's (or root's)
        and writable by no one else, who could otherwise put a forged job directory in a job's place (a warning if
        everyone may read it). Then take its lock: one daemon per root, whatever its endpoint, also while another
        still drains or recovers (two would persist the same segments into the same files). Returns the lock's fd."""
        if not os.path.isdir(root):
            os.makedirs(root)
            self.restrict(root, self.root_mode)
        st = os.stat(root)  # a link to the root is followed: its target is checked
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o002:
            raise CheckpointError(
                f"checkpoint root {root} {'is writable by every user' if st.st_uid in (os.geteuid(), 0) else 'belongs to another user'}"
                f" ({_owned(st)}; the daemon runs as {describe_owner(os.geteuid())}): whoever can write in it can replace a job's"
                f" checkpoints with their own; chown it to the daemon's user and chmod o-w, or choose another --root"
            )
        if st.st_mode & 0o020:  # a umask of 002, a Kubernetes fsGroup volume: the group is often the user's own
            log.warning(
                "checkpoint root %s is writable by its group %s (mode %o): its members could replace a job's checkpoints",
                root, _name_of_group(st.st_gid), st.st_mode & 0o7777,
            )  # fmt: skip
        if st.st_mode & 0o007:
            log.warning("checkpoint root %s is accessible to every user on this node (mode %o)", root, st.st_mode & 0o7777)
        fd = os.open(os.path.join(root, ROOT_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(f"another ckptd daemon is using the root {root} (it holds {ROOT_LOCK}); stop it first") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def make_socket_dir(self, path: str) -> None:
        """Make the directory of the socket at ``path`` (mode ``dir_mode``) or check an existing one, and
        check what is at ``path``, before the daemon removes a stale socket there and binds. Raises
        ``CheckpointError`` naming the path, its owner and mode when the directory is a symlink, not a
        directory, another user's or writable by group or others, or when ``path`` is a symlink, not a
        socket, or another user's file."""
        d = os.path.dirname(os.path.abspath(path))
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            st = self._create_socket_dir(d)
        problem = (
            f"is a symlink (to {os.readlink(d)})" if stat.S_ISLNK(st.st_mode)
            else "is not a directory" if not stat.S_ISDIR(st.st_mode)
            else "belongs to another user" if st.st_uid != os.geteuid()
            else "is writable by other users" if st.st_mode & 0o022
            else None
        )  # fmt: skip
        if problem:
            raise CheckpointError(
                f"socket directory {d} {problem} ({_owned(st)}; the daemon runs as {describe_owner(os.geteuid())}):"
                f" whoever can write in it can put a socket of their own in the daemon's place; {_fix(d)}"
            )
        self._check_socket_path(path)

    def _create_socket_dir(self, d: str) -> os.stat_result:
        """Parents as ``makedirs`` makes them; the directory itself by this call, never one found there."""
        os.makedirs(os.path.dirname(d), exist_ok=True)
        try:
            os.mkdir(d, 0o700)  # private from birth; the group, if any, comes next
        except FileExistsError:
            return os.lstat(d)  # made by someone else meanwhile: checked like any existing one
        self.restrict(d, self.dir_mode)
        return os.lstat(d)

    @staticmethod
    def _check_socket_path(path: str) -> None:
        """The daemon removes a stale socket before it binds: never through a symlink, never a file
        that is not a socket or not its own."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        what = (
            f"is a symlink (to {os.readlink(path)})" if stat.S_ISLNK(st.st_mode)
            else "is not a socket" if not stat.S_ISSOCK(st.st_mode)
            else "is another user's socket" if st.st_uid != os.geteuid()
            else None
        )  # fmt: skip
        if what:
            raise CheckpointError(f"the daemon's socket path {path} {what} ({_owned(st)}); the daemon will not remove it: {_fix(path)}")

    @contextlib.contextmanager
    def file_umask(self) -> Iterator[None]:
        """Files created inside get at most ``file_mode`` from birth (a socket file cannot be made
        with a mode of its own: restricting it after bind would leave a race)."""
        old = os.umask(0o777 & ~self.file_mode)
        try:
            yield
        finally:
            os.umask(old)


def _owned(st: os.stat_result) -> str:
    return f"owner {describe_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):o}"


def _fix(path: str) -> str:
    """What to do about a socket directory or path the daemon refuses."""
    return f"set XDG_RUNTIME_DIR or --endpoint to a directory only the daemon's user can write, or remove {path} if it should not be there"


def peer_cred(frame: zmq.Frame) -> tuple[int | None, int | None]:
    """The sender's pid and uid from an ipc message's metadata (libzmq reads them with ``SO_PEERCRED``:
    ``Peer-Address`` is ``host:uid:gid:pid``); pid 0 for an ipc peer outside the daemon's PID namespace
    (the kernel cannot name it there); ``None`` over tcp or where the transport gives nothing."""
    try:
        parts = frame.get("Peer-Address").rsplit(":", 3)
    except (zmq.ZMQError, AttributeError, UnicodeDecodeError):
        return None, None
    if len(parts) != 4:
        return None, None
    return (int(parts[3]) if parts[3].isdigit() else None), (int(parts[1]) if parts[1].isdigit() else None)
