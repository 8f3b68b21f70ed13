"""What the daemon's worker threads report to its loop: typed events through a queue, plus a
ZeroMQ inproc wake-up so the loop's poller returns at once.

Workers (persist, upload, fetch threads) call :meth:`EventQueue.post`; the main thread polls
:attr:`EventQueue.wake` and calls :meth:`EventQueue.drain`, then handles each event by its type. The
main thread owns every table (slots, steps, fetches): an event is how a worker's result reaches them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq


@dataclass(frozen=True)
class ShardPersisted:
    """A persist thread wrote (or failed to write) one rank's shard from its slot."""

    segment: str
    job: str
    step: int
    rank: int
    nbytes: int
    seconds: float
    error: str | None = None
    path: str | None = None  # this shard was the last: the step is complete here
    manifest: dict[str, Any] | None = None  # ... and this is its manifest, kept for hot restores
    node_ranks: list[int] | None = None  # multi-node: this node's part is durable, these ranks to upload
    attempt: int = 0  # the step's attempt (:attr:`~ckptd.daemon.steps.StepTrack.attempt`) the shard was committed to
    node_dir: str | None = None  # multi-node: where this node's part (``node_ranks``) was moved for the upload


@dataclass(frozen=True)
class ShardSealed:
    """The seal thread read (or failed to read) the header of a memory-tier step's shard."""

    segment: str
    job: str
    step: int
    rank: int
    error: str | None = None
    manifest: dict[str, Any] | None = None  # this shard was the last: the step is complete in memory
    attempt: int = 0  # the step's attempt (:attr:`~ckptd.daemon.steps.StepTrack.attempt`) the shard was committed to
    node_part: dict[int, dict[str, Any]] | None = None  # a step that spans nodes: this shard was this node's last (fragments)


@dataclass(frozen=True)
class SlotCreated:
    """A grow thread made (or failed to make) a staging segment the slot pool asked for."""

    token: int
    name: str | None  # None: it failed
    size: int
    error: str | None = None


@dataclass(frozen=True)
class Uploaded:
    """The upload thread finished (or failed) one step's upload."""

    job: str
    step: int
    error: str | None
    nbytes: int
    seconds: float
    complete: bool  # the step is complete in the bucket
    multi_node: bool
    url: str = ""
    retention_error: str | None = None  # the step is uploaded; pruning older steps of the bucket failed
    attempt: int = 0  # multi-node: the step's attempt this node's part was of (a relaunch's new one is another)
    given_up: bool = False  # multi-node: the daemon gave the attempt up (a relaunch saves the number again)


@dataclass(frozen=True)
class Answered:
    """A worker thread answered a request the loop handed it (a ``latest`` that asked the bucket, a ``protect``);
    an ``"error"`` field makes it a refusal."""

    ident: bytes
    req_id: Any
    answer: dict[str, Any]  # the reply's fields


@dataclass(frozen=True)
class Fetched:
    """The fetch thread chose (and, from the bucket, downloaded) the step a restore reads."""

    fid: int
    answer: dict[str, Any]  # the fetch_wait reply's fields
    report: str | None = None  # an error for ``status``' last_error (not for a step that does not exist)


@dataclass(frozen=True)
class Replicated:
    """The replication thread is done with a step: ``state`` ``replicated`` (K peers hold it, verified), ``degraded``
    (fewer took it), ``superseded`` (a later step of the job went instead) or ``not_replicated`` (``reason``)."""

    job: str
    step: int
    state: str
    peers: tuple[str, ...] = ()
    reason: str | None = None


@dataclass(frozen=True)
class MeshComplete:
    """A step that spans nodes is complete in the memory of its job's daemons (:mod:`.mesh`): this daemon's replica
    store holds every rank's fragment of attempt ``folder`` and the ``manifest`` it built from them; or ``error``, why
    they do not make a checkpoint."""

    job: str
    step: int
    folder: str
    manifest: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class ErrorReported:
    """A worker's error that belongs to no request (the bucket is unreachable at start-up)."""

    message: str


Event = ShardPersisted | Uploaded | Fetched | ErrorReported | Replicated


class EventQueue:
    """Many posting threads, one draining thread (the loop)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._addr = f"inproc://ckptd-wake-{id(self)}"
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._tls = threading.local()
        self._pushes: list[zmq.Socket] = []  # each posting thread's socket, closed by close()
        self._lock = threading.Lock()
        self.wake = ctx.socket(zmq.PULL)  # the loop polls this
        self.wake.setsockopt(zmq.LINGER, 0)
        self.wake.bind(self._addr)

    def post(self, event: Event) -> None:
        """Any thread: queue ``event`` and wake the loop."""
        self._queue.put(event)
        sock = getattr(self._tls, "push", None)
        if sock is None:
            sock = self._tls.push = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._addr)
            with self._lock:
                self._pushes.append(sock)
        # zmq.Again: the loop is far behind, wake-ups are already pending, and the event is queued
        with contextlib.suppress(zmq.Again):
            sock.send(b"", zmq.NOBLOCK)

    def drain(self) -> Iterator[Event]:
        """Main thread: every event queued so far, oldest first."""
        while self.wake.poll(0):
            self.wake.recv()
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        """Close every socket, the posting threads' too (call once they are done), so the context can
        terminate."""
        with self._lock:
            pushes, self._pushes = self._pushes, []
        for sock in pushes:
            sock.close(0)
        self.wake.close(0)
