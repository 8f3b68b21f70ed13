"""The channel to a node's daemon: one request, one reply, over a ZeroMQ DEALER socket per calling
thread. Torch-free: the trainer's :class:`~ckptd.client.client.Client` and the CLI's ``status`` and
``ls`` both talk through it.

Any thread may call :meth:`Channel.call`; each thread gets its own socket, so a background copy
thread's commit never waits behind the training thread's request.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import zmq

from ..errors import CheckpointError, DaemonUnavailable, ProtocolError
from ..protocol import decode_reply, endpoint_answers, request


class Channel:
    """``timeout`` bounds each request unless the call gives its own ``rpc_timeout``; a longer wait
    (an ``alloc`` under backpressure) checks every ``timeout`` that the daemon still answers."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        self.endpoint, self.timeout = endpoint, timeout
        self._ctx = zmq.Context()
        self._tls = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._sock_lock = threading.Lock()
        self._ids = itertools.count(1)
        self.closed = False

    def call(self, op: str, rpc_timeout: float | None = None, frames: tuple[bytes, ...] = (), **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raise :class:`ProtocolError` on an error reply and
        :class:`DaemonUnavailable` when no answer comes in time."""
        if self.closed:
            raise CheckpointError("client is closed")
        timeout = self.timeout if rpc_timeout is None else rpc_timeout
        req_id = next(self._ids)
        s = self._socket()
        s.send_multipart([request(op, req_id, **fields), *frames])
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            left = deadline - time.monotonic()
            slice_s = min(left, self.timeout)
            if left > 0 and not s.poll(int(slice_s * 1000) + 1) and slice_s < left and self.alive():
                continue
            if left <= 0 or not s.poll(0):
                # a late reply must not be read as the answer to a later request
                self._drop_socket()
                raise DaemonUnavailable(
                    f"no answer from the ckptd daemon at {self.endpoint} within {time.monotonic() - t0:.1f} s (op {op});"
                    " is `ckptd serve` running?"
                )
            rep = decode_reply(s.recv())
            if rep.get("id") not in (req_id, None):
                continue  # stale reply to an earlier, abandoned request
            if not rep["ok"]:
                raise ProtocolError(f"daemon refused {op}: {rep.get('error')}")
            return rep

    def alive(self) -> bool:
        """Whether the daemon answers ``hello`` on a fresh socket within ``timeout``."""
        return endpoint_answers(self._ctx, self.endpoint, self.timeout)

    def _socket(self) -> zmq.Socket:
        s = getattr(self._tls, "sock", None)
        if s is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            try:
                s.connect(self.endpoint)
            except zmq.ZMQError as e:
                s.close(0)
                raise CheckpointError(f"cannot connect to {self.endpoint!r}: {e}") from None
            self._tls.sock = s
            with self._sock_lock:
                self._sockets.append(s)
        return s

    def _drop_socket(self) -> None:
        s = getattr(self._tls, "sock", None)
        if s is not None:
            self._tls.sock = None
            with self._sock_lock:
                if s in self._sockets:
                    self._sockets.remove(s)
            s.close(0)

    def close(self) -> None:
        """Close every thread's socket and the context. Idempotent."""
        if self.closed:
            return
        self.closed = True
        with self._sock_lock:
            for s in self._sockets:
                s.close(0)
            self._sockets.clear()
        self._ctx.term()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
