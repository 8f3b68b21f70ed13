"""How many connections the daemon holds, and how many file descriptors it may open: an attacker who opens
connections must not exhaust the daemon's descriptors.

libzmq accepts connections on its own I/O thread and aborts the whole process when ``accept`` fails with
EMFILE (``Too many open files (src/ipc_listener.cpp:297)``); every held connection costs one descriptor.
So, at start, the soft ``RLIMIT_NOFILE`` is raised to the hard limit (systemd's default soft limit is 1,024,
its hard one 524,288), and :class:`ConnectionGuard` watches the socket's accepted and closed connections
(a ZeroMQ socket monitor) and shuts down, as soon as the loop hears of it, each connection past a cap: one
per user and one in all, both well under the descriptor limit. A refused peer is logged with its uid and
pid; the daemon serves the connections it kept.

Threads: everything here runs on the daemon's main loop; ``shutdown(2)`` on a descriptor libzmq owns is safe
from any thread (libzmq sees the peer gone and closes it itself).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import struct
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..config import CONNECTIONS_RESYNC_S, FD_RESERVE, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_USER

log = logging.getLogger("ckptd.daemon")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_NR_OPEN = 1 << 20  # Linux's default ceiling for any one process
_WARN_EVERY_S = 10.0  # a refusal is logged at once, then at most this often (an attacker must not flood the log)


def raise_open_files_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _NR_OPEN if hard == resource.RLIM_INFINITY else hard  # a soft limit of "infinity" is refused
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)
    return target if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True)
class ConnectionCaps:
    """The most connections the daemon keeps: in all, and of one user; and the open-files limit they are cut from."""

    total: int
    per_user: int
    open_files: int

    @classmethod
    def for_limit(cls, open_files: int) -> ConnectionCaps:
        """Caps that leave ``FD_RESERVE`` descriptors for the daemon's own files, and as many again for a burst of
        connections libzmq accepts before the loop can refuse them."""
        total = max(8, min(MAX_CONNECTIONS, (open_files - FD_RESERVE) // 2))
        return cls(total, max(4, min(MAX_CONNECTIONS_PER_USER, total // 2)), open_files)


class ConnectionGuard:
    """Counts the connections ``sock`` (bound at ``endpoint``) accepted, by user, and refuses those past ``caps``.

    Order of calls (main loop): construct after the bind; register :attr:`monitor` with the loop's poller and call
    :meth:`on_events` when it is readable; :meth:`housekeeping` on the loop's housekeeping (the monitor drops events when the loop
    falls behind, so the counts are checked against the descriptors themselves); :meth:`close` before the socket.
    """

    def __init__(self, sock: zmq.Socket, endpoint: str, caps: ConnectionCaps) -> None:
        self.caps = caps
        self._endpoint = endpoint
        self._path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None
        self._sock = sock
        self.monitor: zmq.Socket = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._uid_of: dict[int, int] = {}  # descriptor of a kept connection -> its peer's uid (-1: unknown, over tcp)
        self.refused = 0
        self._last_warning = self._last_resync = 0.0

    def on_events(self) -> None:
        """Read every event the monitor holds (never blocks)."""
        while True:
            try:
                msg = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ev = parse_monitor_message(msg)
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                self._uid_of.pop(fd, None)
            elif ev["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)

    def _accepted(self, fd: int) -> None:
        cred = self._ours(fd)
        if cred is None:
            return  # already gone (its descriptor closed, maybe reused by something else): nothing to count
        pid, uid = cred
        self._uid_of.pop(fd, None)  # a reused number: the old connection's close event was dropped
        if len(self._uid_of) >= self.caps.total:
            why = f"{len(self._uid_of)} connections held (at most {self.caps.total})"
        elif uid >= 0 and sum(1 for u in self._uid_of.values() if u == uid) >= self.caps.per_user:
            why = f"uid {uid} holds {self.caps.per_user} connections (at most {self.caps.per_user} per user)"
        else:
            self._uid_of[fd] = uid
            return
        self._refuse(fd, pid, uid, why)

    def _ours(self, fd: int) -> tuple[int, int] | None:
        """(pid, uid) of the peer if ``fd`` is still a connection accepted on this daemon's endpoint; uid -1 over tcp."""
        try:
            s = socket.socket(fileno=fd)  # wraps libzmq's descriptor: detached below, never closed here
        except OSError:
            return None
        try:
            if self._path is not None:
                if s.family != socket.AF_UNIX or s.getsockname() != self._path:
                    return None
                pid, uid, _gid = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                return pid, uid
            return (0, -1) if s.type == socket.SOCK_STREAM else None
        except OSError:
            return None
        finally:
            s.detach()

    def _refuse(self, fd: int, pid: int, uid: int, why: str) -> None:
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):  # closed meanwhile: nothing held
                s.shutdown(socket.SHUT_RDWR)  # libzmq sees the peer gone and closes its descriptor
        finally:
            s.detach()
        self.refused += 1
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning("refusing a connection from pid %d uid %d: %s (%d refused so far)", pid, uid, why, self.refused)

    def housekeeping(self, now: float) -> None:
        """Every ``CONNECTIONS_RESYNC_S``, forget descriptors that are no longer this endpoint's connections (their
        close events were dropped)."""
        if now - self._last_resync < CONNECTIONS_RESYNC_S:
            return
        self._last_resync = now
        for fd in list(self._uid_of):
            if self._ours(fd) is None:
                del self._uid_of[fd]

    @property
    def held(self) -> int:
        return len(self._uid_of)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the socket closed first
            self._sock.disable_monitor()
        self.monitor.close(0)


def open_descriptors() -> int:
    """How many descriptors this process holds (for ``status``)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1
