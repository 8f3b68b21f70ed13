"""The daemon's socket: the endpoint checked before anything is created, then bound.

An ``ipc://`` endpoint's directory must be the daemon's own (:meth:`.access.Access.make_socket_dir`), and a
live daemon already serving it refuses the start; a dead daemon's socket file is replaced. The bound socket
file gets the daemon's file mode (``--group``: the group may connect). ``ZMQ_MAXMSGSIZE`` bounds each frame
of a message, the receive high-water mark how many messages wait per connection (:mod:`.inbox`: a message is
whole in memory before the loop sees it). Main thread only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

import zmq

from ..config import validate_endpoint
from ..errors import CheckpointError
from ..protocol import MAX_MESSAGE_BYTES, endpoint_answers
from .access import Access

# whole messages that may wait per connection before libzmq stops reading from it (its default is 1,000, each frame up
# to MAX_MESSAGE_BYTES): a ckptd client has one request in flight per socket; a flood waits in its sender's queue instead
QUEUED_PER_PEER = 4


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def check_endpoint(access: Access, ctx: zmq.Context, endpoint: str) -> int | None:
    """Refuse an endpoint ckptd does not speak, an ipc endpoint whose directory is not the daemon's own, or one
    another daemon serves or is starting on. Returns the endpoint's lock, held for the daemon's life (``<socket>.lock``
    beside it, ``flock``ed): a daemon still recovering answers no ``hello`` yet, and a second one would otherwise take
    its socket over (with another root: ranks split between two daemons)."""
    if not validate_endpoint(endpoint).startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    access.make_socket_dir(path)
    with access.file_umask():
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, access.file_mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointError(f"another daemon is already serving {endpoint}, or starting on it (it holds {path}.lock)") from None
    if os.path.exists(path) and endpoint_answers(ctx, endpoint, 0.5):  # one that predates the lock
        os.close(fd)
        raise CheckpointError(f"another daemon is already serving {endpoint}")
    return fd


def bind(access: Access, ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The daemon's ROUTER socket, bound; a failure (a port taken, a host that does not resolve) is a
    :class:`CheckpointError` naming the endpoint."""
    path = ipc_path(endpoint)
    if path is not None:
        access.make_socket_dir(path)  # checked again: this is the moment it counts
        if os.path.lexists(path):
            os.unlink(path)  # a dead daemon's stale socket (a live one was refused at start)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, QUEUED_PER_PEER)
    try:
        with access.file_umask():
            sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(0)
        raise CheckpointError(f"cannot listen on {endpoint}: {e}") from None
    if path is not None:
        try:
            access.restrict(path, access.file_mode)
        except BaseException:  # an open socket left behind would hang the context's term() at shutdown
            sock.close(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
    return sock


def identity(endpoint: str) -> tuple[int, int] | None:
    """The bound socket file's (device, inode): what :func:`unlink_own` checks before removing it."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def unlink_own(endpoint: str, ident: tuple[int, int] | None) -> None:
    """Remove the socket file at shutdown only if it is still the one this daemon bound: a daemon started on
    the same endpoint while this one shut down (no answer from it, so its file was replaced) keeps its own."""
    path = ipc_path(endpoint)
    if path is None or ident is None:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == ident:
        os.unlink(path)
