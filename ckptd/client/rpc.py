"""The channel to a node's daemon: one request, one reply, over a ZeroMQ DEALER socket per calling
thread. Torch-free: the trainer's :class:`~ckptd.client.client.Client` and the CLI's ``status`` and
``ls`` both talk through it.

Any thread may call :meth:`Channel.call`; each thread gets its own socket, so a background copy
thread's commit never waits behind the training thread's request.

Before it connects to an ``ipc://`` endpoint, a channel checks that the socket is its own user's
daemon's (:func:`check_socket`): anyone who can bind a socket at that path would otherwise receive the
trainer's requests and answer them. ``tcp://`` (and abstract ``ipc://@name``) endpoints have no owner to
check: use them on trusted networks only.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
import weakref
from typing import Any, NoReturn

import zmq

from ..config import BUSY_RETRY_S, per_user_endpoint, trusted_group, validate_endpoint
from ..errors import CheckpointError, DaemonBusy, DaemonUnavailable, ProtocolError
from ..protocol import decode_reply, hello_reply, request


def check_socket(endpoint: str, op: str | None = None) -> None:
    """Refuse an ``ipc://`` socket this user should not trust; ``tcp://`` and abstract endpoints pass.

    Trusted: a socket (not a symlink, not another kind of file) owned by this user or root, or, only
    when ``CKPTD_TRUST_GROUP`` names a group and the endpoint is not this user's own per-uid default (any member
    of the group could make that directory and bind there first), one whose group is that group; in a directory (not a
    symlink) owned by this user, root or the socket's owner and writable by nobody else, so that no one
    else can put a socket of their own there between this check and the connect. Raises
    :class:`DaemonUnavailable` at once when the socket does not exist or nobody listens on it (no
    daemon: nothing to wait for), else :class:`CheckpointError` naming the path, its owner and how to
    trust it. Two ``lstat`` calls and one ``connect``: cheap enough for every new socket.
    """
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return
    path = endpoint[len("ipc://") :]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        where = f" (op {op})" if op else ""
        raise DaemonUnavailable(f"no ckptd daemon at {endpoint}{where}: {path} does not exist; {_running_there(endpoint)}") from None
    except OSError as e:
        raise CheckpointError(f"cannot check the ckptd socket {path}: {e.strerror or e}") from None
    me = os.geteuid()
    if not stat.S_ISSOCK(st.st_mode):
        _refuse(endpoint, f"{path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a socket'}", st)
    group = (_trusted_gid() if endpoint != per_user_endpoint() else None) if st.st_uid not in (me, 0) else None
    if st.st_uid not in (me, 0) and (group is None or st.st_gid != group):
        hint = (
            f"if a daemon run by that user serves your group, trust the group with CKPTD_TRUST_GROUP={_name('group', st.st_gid)}"
            if endpoint != per_user_endpoint()
            else "this is your own user's default endpoint, where only your daemon belongs: point CKPTD_ENDPOINT at the"
            " socket of the daemon that serves your group"
        )
        _refuse(endpoint, f"the socket {path} belongs to another user", st, hint)
    d = os.path.dirname(os.path.abspath(path))
    dst = os.lstat(d)
    if not stat.S_ISDIR(dst.st_mode):
        _refuse(endpoint, f"the socket's directory {d} is a symlink", dst)
    if dst.st_uid not in (me, 0, st.st_uid):
        _refuse(endpoint, f"the socket's directory {d} belongs to another user", dst)
    if dst.st_mode & 0o022:
        _refuse(endpoint, f"the socket's directory {d} is writable by other users (anyone of them could replace the socket)", dst)
    _listening(endpoint, path, op)


def _listening(endpoint: str, path: str, op: str | None) -> None:
    """A socket file nobody listens on (a daemon that was killed leaves it behind): fail now, not after
    the request timeout. ZeroMQ connects lazily and would queue the request."""
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(path)
    except ConnectionRefusedError:
        where = f" (op {op})" if op else ""
        raise DaemonUnavailable(
            f"no ckptd daemon at {endpoint}{where}: {path} exists but nobody listens on it (a daemon that stopped or was killed);"
            f" {_running_there(endpoint)}"
        ) from None
    except PermissionError:
        where = f" (op {op})" if op else ""
        raise DaemonUnavailable(
            f"the ckptd daemon at {endpoint}{where} does not let this user in: permission denied on {path}"
            " (the daemon's socket is its own user's, and its --group's when it has one)"
        ) from None
    except OSError:
        return  # anything else (a timeout under load): let the request itself find out
    finally:
        probe.close()


def _running_there(endpoint: str) -> str:
    """The end of every no-daemon message: is a daemon running, and at this endpoint (a daemon started with
    ``--endpoint`` elsewhere is reached through ``CKPTD_ENDPOINT``, and only through it, by default)."""
    env = os.environ.get("CKPTD_ENDPOINT")
    if env == endpoint:
        came = "this endpoint is CKPTD_ENDPOINT's; "
    elif not env and endpoint == per_user_endpoint():
        came = "this is this user's default endpoint (CKPTD_ENDPOINT is not set); "
    else:
        came = ""
    hint = f"{came}a daemon on another endpoint (its --endpoint) is reached by setting CKPTD_ENDPOINT to it"
    return f"is `ckptd serve` running there? {hint[0].upper()}{hint[1:]}"


def _trusted_gid() -> int | None:
    name = trusted_group()
    if name is None:
        return None
    import grp

    try:
        return grp.getgrgid(int(name)).gr_gid if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise CheckpointError(f"CKPTD_TRUST_GROUP={name!r} names no group on this node") from None


def _name(kind: str, n: int) -> str:
    """The user (``kind`` ``"user"``) or group name of a number, or the number when it has none."""
    import grp
    import pwd

    try:
        return pwd.getpwuid(n).pw_name if kind == "user" else grp.getgrgid(n).gr_name
    except KeyError:
        return str(n)


def _refuse(endpoint: str, problem: str, st: os.stat_result, hint: str | None = None) -> NoReturn:
    owner = f"owner {_name('user', st.st_uid)} (uid {st.st_uid}), group {_name('group', st.st_gid)} (gid {st.st_gid})"
    mode = f"mode {stat.S_IMODE(st.st_mode):o}"
    hint = hint or "remove it, or run the daemon with --endpoint in a directory only its user can write"
    raise CheckpointError(f"refusing to connect to {endpoint}: {problem} ({owner}, {mode}), so it may not be your ckptd daemon; {hint}")


log = logging.getLogger("ckptd.client")

_PROBE_S = 2.0  # the longest a hello probe is given where the time is short: a live daemon answers it at once

# asked again of a restarted daemon: no harm twice (protecting a name moves it to the same step again)
_RESENDABLE = frozenset({"hello", "status", "latest", "wait", "promote", "protect", "unprotect"})


def _close(ctx: zmq.Context, sockets: list[tuple[threading.Thread, zmq.Socket]], lock: threading.Lock) -> None:
    """Close every thread's socket, then the context (a :class:`Channel`'s close, or its finalizer)."""
    with lock:
        for _, s in sockets:
            s.close(0)
        sockets.clear()
    ctx.term()


class Channel:
    """``timeout`` bounds each request unless the call gives its own ``rpc_timeout``; a longer wait
    (an ``alloc`` under backpressure) checks every ``timeout`` that the daemon still answers. Where no daemon
    answers, a call fails within its timeout, its hello probes included; only a request asked again of a daemon
    that answers waits longer. Each new socket is preceded by :func:`check_socket`."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        self.endpoint, self.timeout = validate_endpoint(endpoint), timeout
        self._ctx = zmq.Context()
        self._tls = threading.local()
        self._sockets: list[tuple[threading.Thread, zmq.Socket]] = []  # each thread's socket, with its thread
        self._sock_lock = threading.Lock()
        self._ids = itertools.count(1)
        self.daemon: dict[str, Any] | None = None  # the first daemon's root, and the instance last seen (hello)
        self.closed = False
        # a channel never closed and collected in a reference cycle (a client dropped with an exception's frames):
        # zmq's own Context.__del__ would term() the context while the cycle's sockets, already unreachable to it,
        # are open, and hang the trainer in the garbage collector; this closes them first
        self._finalizer = weakref.finalize(self, _close, self._ctx, self._sockets, self._sock_lock)
        # not at interpreter exit: a daemon thread of the trainer may still be inside call(), and closing its socket
        # from the exiting thread would pull it from under that thread's poll (zmq sockets are not thread-safe)
        self._finalizer.atexit = False

    def call(self, op: str, rpc_timeout: float | None = None, frames: tuple[bytes, ...] = (), **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raise :class:`ProtocolError` on an error reply (one answered ``busy``
        is asked again first, :meth:`_asked_again`) and :class:`DaemonUnavailable` when no answer comes in time."""
        if self.closed:
            raise CheckpointError("client is closed")
        try:
            return self._asked_again(op, rpc_timeout, frames, fields)
        except zmq.ZMQError as e:  # e.g. the context's socket limit: an error naming it, never a bare ZMQError
            self._drop_socket()
            raise DaemonUnavailable(f"cannot talk to the ckptd daemon at {self.endpoint} (op {op}): {e}") from None

    def _asked_again(self, op: str, rpc_timeout: float | None, frames: tuple[bytes, ...], fields: dict[str, Any]) -> dict[str, Any]:
        """:meth:`_call`, asked again while the daemon answers ``busy`` (it changed nothing: an earlier attempt at the step
        is still being written, queued, sealed or made durable), for :data:`BUSY_RETRY_S` at most."""
        until, pause = time.monotonic() + BUSY_RETRY_S, 0.05
        while True:
            try:
                return self._call(op, rpc_timeout, frames, fields)
            except DaemonBusy as e:
                if time.monotonic() + pause > until:
                    raise DaemonBusy(f"{e}; asked again for {BUSY_RETRY_S:g} s") from None
                log.info("%s; asking again in %.2f s", e, pause)
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _call(self, op: str, rpc_timeout: float | None, frames: tuple[bytes, ...], fields: dict[str, Any]) -> dict[str, Any]:
        timeout = self.timeout if rpc_timeout is None else rpc_timeout
        t0 = time.monotonic()
        req_id = next(self._ids)
        if self.daemon is None and timeout > self.timeout and self._who() is None:
            # a request that may wait long (an alloc under backpressure, a wait) asks first which daemon will have it, so that
            # a restart that loses it is told by the instance that answers later; none answers within timeout: none runs
            check_socket(self.endpoint, op)  # a socket file missing or left behind says so itself
            raise self._unanswered(op, t0)
        known = (self.daemon or {}).get("instance")
        s = self._socket(op)
        s.send_multipart([request(op, req_id, **fields), *frames])
        sent = time.monotonic()
        deadline, resent = t0 + timeout, 0
        held = fields.get("timeout", 0.0)  # how long the daemon may hold the reply back on purpose (if a number)
        held = float(held) if isinstance(held, (int, float)) and not isinstance(held, bool) else 0.0
        spare = min(_PROBE_S, timeout / 2)  # a wait a probe follows ends this long before the deadline: none outlives it
        while True:
            left = deadline - time.monotonic()
            cut = min(self.timeout, left - spare)
            # a probe follows this slice if it is not the last, or if the request, still unanswered then, may have been lost
            lost = op in _RESENDABLE and resent < 3 and time.monotonic() + cut - sent > held + 1.0
            probe = lost or cut < left - spare
            if left > 0 and not s.poll(int(max(cut if probe else left, 0) * 1000) + 1):
                rest = deadline - time.monotonic()
                now = self._who(min(self.timeout, rest)) if probe and rest > 0 else None
                if now is not None:
                    # a daemon answers; another instance than the one asked (a restart) has lost this request
                    moved = known is not None and now.get("instance") not in (None, known) and resent < 3
                    if moved and op not in _RESENDABLE and op != "alloc":  # an alloc never granted is asked again
                        self._drop_socket()
                        raise DaemonUnavailable(
                            f"the ckptd daemon at {self.endpoint} restarted while {op} waited for its answer (pid"
                            f" {now.get('pid')} now): the request was lost with the daemon that had it"
                        )
                    if lost or moved:  # ask the daemon that answers now
                        self._drop_socket()
                        s, req_id, resent, known = self._socket(op), next(self._ids), resent + 1, now.get("instance")
                        s.send_multipart([request(op, req_id, **fields), *frames])
                        sent = time.monotonic()
                        deadline = max(deadline, sent + held + self.timeout)
                    continue
            if left <= 0 or not s.poll(0):
                self._drop_socket()  # a late reply must not be read as the answer to a later request
                raise self._unanswered(op, t0)
            rep = decode_reply(s.recv())
            if rep.get("id") not in (req_id, None):
                continue  # stale reply to an earlier, abandoned request
            if not rep["ok"]:
                raise (DaemonBusy if rep.get("code") == "busy" else ProtocolError)(f"daemon refused {op}: {rep.get('error')}")
            if rep.get("instance") not in (None, (self.daemon or {}).get("instance")):
                self._who()  # the first answer, or one from a daemon that replaced the one before: of the same root?
            return rep

    def _unanswered(self, op: str, t0: float) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"no answer from the ckptd daemon at {self.endpoint} within {time.monotonic() - t0:.1f} s (op {op});"
            f" {_running_there(self.endpoint)}"
        )

    def alive(self) -> bool:
        """Whether the daemon answers ``hello`` on a fresh socket within ``timeout``; ``False`` at once
        when its socket file is gone, :class:`CheckpointError` when the socket is not to be trusted."""
        return self._who() is not None

    def _who(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The ``hello`` of the daemon answering now (:meth:`alive`), noted in :attr:`daemon`; a daemon of another root
        than the first one this channel talked to (it replaced that one on the endpoint) is refused, never followed:
        new steps would land in the other root and ``latest()`` would start the job over."""
        try:
            check_socket(self.endpoint)
        except DaemonUnavailable:
            return None
        rep = hello_reply(self._ctx, self.endpoint, self.timeout if timeout is None else timeout)
        if rep is None or "root" not in rep:
            return rep
        if self.daemon is not None and rep["root"] != self.daemon["root"]:
            raise CheckpointError(
                f"the ckptd daemon at {self.endpoint} now serves root {rep['root']}, not {self.daemon['root']} (another"
                " daemon took the endpoint over): refusing to go on with it; restart the trainer to use it"
            )
        self.daemon = {"root": rep["root"], "instance": rep.get("instance"), "pid": rep.get("pid")}
        return rep

    def _socket(self, op: str) -> zmq.Socket:
        s = getattr(self._tls, "sock", None)
        if s is None:
            check_socket(self.endpoint, op)
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            try:
                s.connect(self.endpoint)
            except zmq.ZMQError as e:
                s.close(0)
                raise CheckpointError(f"cannot connect to {self.endpoint!r}: {e}") from None
            self._tls.sock = s
            with self._sock_lock:
                # a socket per thread: those of threads that ended (a background copy, DCP's save thread, one
                # per save) are closed here, or a long run would hit the context's socket limit
                ended = [(t, x) for t, x in self._sockets if not t.is_alive()]
                for t, x in ended:
                    x.close(0)
                    self._sockets.remove((t, x))
                self._sockets.append((threading.current_thread(), s))
        return s

    def _drop_socket(self) -> None:
        s = getattr(self._tls, "sock", None)
        if s is not None:
            self._tls.sock = None
            with self._sock_lock:
                self._sockets[:] = [(t, x) for t, x in self._sockets if x is not s]  # in place: the finalizer holds this list
            s.close(0)

    def close(self) -> None:
        """Close every thread's socket and the context. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
