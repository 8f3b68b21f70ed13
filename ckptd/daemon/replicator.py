"""Replication: every step that completes on this node is copied into K peer daemons' memory, off the training path.

Once a step is complete here (in the memory tier, or durable on disk), :meth:`Replicator.submit` queues it and the
replication thread sends it to ``replicas`` peers (``--peer``, in the order given: the first K that take it; a peer
that is down or refuses is skipped for the next, and the step counts as *degraded* if fewer than K took it). A step
goes to a peer as it would go to a bucket: its shard files, then its manifest last (:mod:`ckptd.storage.peer`), so
the peer holds it complete or not at all. A memory-only step's manifest has no checksums; they are computed here,
from the shared memory that holds the shards, before anything is sent, and the step is sent only if its slots still
hold it once every shard is out (a slot reused meanwhile ends the attempt: the manifest never goes, and a newer step
is on its way anyway). A durable step is sent from its files.

Nothing here can slow a snapshot: the thread only reads shared memory and files the daemon holds, a job keeps only
its newest queued step (an older one not yet sent is skipped: it is superseded), and the link is paced
(``--replicate-rate-limit``). ``summary()`` is what ``ckptd status`` shows.

The queue and the results are under one lock: :meth:`submit` and :meth:`summary` run on the daemon's loop.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from ..format import commit_time, encode_manifest, fill_digests, fragments_of
from ..layout import MANIFEST, bucket_key, fragment_name, shard_name
from ..protocol import encode
from ..storage.local import committed_at
from ..storage.peer import PeerStore
from ..storage.remote import upload_step
from .catalog import StepCatalog
from .events import Replicated
from .holdings import Holdings
from .sending import NewestPerJob, Superseded
from .waiters import Waiter, Waiters

log = logging.getLogger("ckptd.daemon")
MIN_BACKOFF_S = 5.0  # a peer that failed is skipped for this long, doubling after each failure...
MAX_BACKOFF_S = 60.0  # ...up to this


@dataclass(frozen=True)
class ReplicaSource:
    """A step complete on this node, as the replicator reads it: a durable step's directory (``path``), or a
    memory-only step's manifest (checksums null) and, per shard file, its segment and size. ``unchanged()``: the
    memory-only step's slots still hold it (read on the replication thread)."""

    job: str
    step: int
    committed_at: int
    path: str | None = None
    manifest: dict[str, Any] | None = None
    shards: dict[str, tuple[str, int]] = field(default_factory=dict)
    unchanged: Callable[[], bool] = lambda: True


@dataclass
class PeerState:
    endpoint: str
    ok: bool | None = None  # None: not tried yet
    error: str | None = None
    bytes_sent: int = 0
    steps: dict[str, int] = field(default_factory=dict)  # job -> newest step it took
    retry_at: float = 0.0  # a peer that failed is not asked again before this (monotonic)
    backoff: float = 0.0

    def failed(self, error: str, now: float) -> None:
        self.ok, self.error = False, error
        self.backoff = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self.backoff))
        self.retry_at = now + self.backoff

    def took(self, job: str, step: int) -> None:
        self.ok, self.error, self.backoff, self.retry_at = True, None, 0.0, 0.0
        self.steps[job] = step


class Replicator(NewestPerJob[ReplicaSource]):
    def __init__(self, peers: list[PeerStore], replicas: int, open_segment: Callable[[str], int],
                 report: Callable[[Replicated], None], initializer: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        """``peers``: the stores of the peers to use, in order (each with a context of its own, its sockets made on the
        replication thread); ``replicas``: how many of them each step goes to; ``open_segment(name)``: a read-only fd
        of one of this daemon's segments; ``report``: what became of each step submitted (any thread: the daemon posts
        it to its loop); ``initializer``: run first on the thread (the daemon's lowers its priority, and the ZeroMQ
        threads it starts, which encrypt every byte, inherit it)."""
        self.peers, self.replicas, self._open = peers, replicas, open_segment
        self._sent: dict[tuple[str, int], int] = {}  # (job, step) -> committed_at sent (or being sent)
        self._newest: dict[str, int] = {}  # job -> the newest committed_at sent (or being sent)
        self.state = {p.endpoint: PeerState(p.endpoint) for p in peers}
        super().__init__("ckptd-replicate", report, initializer)

    def submit(self, src: ReplicaSource) -> None:
        """Queue a step complete on this node (a step already sent with that commit is not sent again)."""
        with self._lock:
            if self._sent.get((src.job, src.step)) == src.committed_at:
                return  # sent already (a memory-only step, now persisted)
            queued = self._queue.get(src.job)
            if src.committed_at < max(self._newest.get(src.job, -1), queued.committed_at if queued is not None else -1):
                # a step persisted after a later one was sealed (and taken, or queued: it stays queued, never replaced)
                self._report(Replicated(src.job, src.step, "superseded"))
                return
            self._enqueue(src)

    def _taken(self, src: ReplicaSource) -> None:
        self._sent[(src.job, src.step)] = src.committed_at
        self._newest[src.job] = max(src.committed_at, self._newest.get(src.job, -1))

    def _closing(self) -> None:
        for p in self.peers:
            p.close()

    def _send(self, src: ReplicaSource) -> None:
        t0 = time.monotonic()
        with _Prepared(src, self._open) as prepared:
            took: list[str] = []
            for peer in self.peers:
                st = self.state[peer.endpoint]
                if len(took) >= self.replicas or st.retry_at > time.monotonic():
                    continue
                try:
                    st.bytes_sent += prepared.send(peer)
                except Superseded as e:
                    log.info("replication of job %s step %s abandoned: %s", src.job, src.step, e)
                    self.counters["superseded"] += 1
                    self._report(Replicated(src.job, src.step, "superseded", tuple(took)))
                    return
                except (CheckpointError, OSError) as e:
                    st.failed(str(e), time.monotonic())
                    self.counters["peer_failures"] += 1
                    log.warning("peer %s did not take job %s step %s (%s); not asked again for %.0f s", peer.endpoint, src.job,
                                src.step, e, st.backoff)  # fmt: skip
                    continue
                st.took(src.job, src.step)
                took.append(peer.endpoint)
        self._done(src, "replicated" if len(took) >= self.replicas else "degraded", took, time.monotonic() - t0)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "replicas": self.replicas,
                "queued": {j: s.step for j, s in self._queue.items()},
                "current": list(self.current) if self.current else None,
                "jobs": {j: dict(r) for j, r in self.results.items()},
                "peers": [
                    {"endpoint": p.endpoint, "ok": p.ok, "error": p.error, "bytes_sent": p.bytes_sent, "steps": dict(p.steps)}
                    for p in self.state.values()
                ],
                **dict(self.counters),
            }


class _Prepared:
    """A step ready to send to any number of peers: a memory-only step's segments mapped and its checksums computed
    once (the mappings are let go on exit)."""

    def __init__(self, src: ReplicaSource, open_segment: Callable[[str], int]) -> None:
        self.src, self._open = src, open_segment
        self._maps: list[mmap.mmap] = []
        self.views: dict[str, memoryview] = {}
        self.manifest: bytes | None = None
        self.fragments: dict[str, bytes] = {}

    def __enter__(self) -> _Prepared:
        if self.src.path is not None:
            return self
        try:
            for name, (segment, size) in self.src.shards.items():
                try:
                    fd = self._open(segment)
                except (CheckpointError, OSError):
                    if not self.src.unchanged():
                        raise Superseded(f"the shared memory of job {self.src.job} step {self.src.step} was reused") from None
                    raise
                try:
                    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                self._maps.append(mm)
                self.views[name] = memoryview(mm)[:size]
            manifest = copy.deepcopy(self.src.manifest)
            assert manifest is not None
            fill_digests(manifest, self.views)
            self.manifest = encode_manifest(manifest)
            # beside the shards, as a persisted step has them (the bucket tier bounds a manifest by its fragments)
            self.fragments = {fragment_name(rank): encode(frag) for rank, frag in fragments_of(manifest).items()}
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for v in self.views.values():
            v.release()
        self.views.clear()
        for mm in self._maps:
            with contextlib.suppress(BufferError):  # a frame libzmq still holds (sent without a copy): closed once freed
                mm.close()
        self._maps.clear()

    def send(self, peer: PeerStore) -> int:
        """Send the step to ``peer``, manifest last; the bytes sent."""
        src = self.src
        if src.path is not None:
            try:
                return upload_step(peer, src.path, src.job, src.step)
            except (CheckpointError, OSError):
                if not os.path.isdir(src.path):  # local retention removed it meanwhile: a later step is there
                    raise Superseded(f"job {src.job} step {src.step} was removed by retention while it was sent") from None
                raise
        assert self.manifest is not None
        peer.delete([bucket_key(src.job, src.step, MANIFEST)])  # a step saved again (a rollback) is incomplete until sent whole
        total = 0
        for name in sorted(self.views):
            peer.put_bytes(bucket_key(src.job, src.step, name), self.views[name])
            total += len(self.views[name])
        for name, doc in sorted(self.fragments.items()):
            peer.put_bytes(bucket_key(src.job, src.step, name), doc)
            total += len(doc)
        if not src.unchanged():
            raise Superseded(f"its shared memory was reused for a later snapshot while job {src.job} step {src.step} was sent")
        peer.put_bytes(bucket_key(src.job, src.step, MANIFEST), self.manifest)
        return total + len(self.manifest)


def source_of(job: str, step: int, catalog: StepCatalog, holdings: Holdings) -> ReplicaSource | None:
    """Step ``step`` of ``job``, just complete here, as the replicator reads it: from its directory once durable, else
    from the slots that hold it in the memory tier; ``None`` for a step this node does not hold whole (a multi-node
    step: the bucket or the shared directory completes those)."""
    path = catalog.complete_path(job, step)
    if path is not None:
        return ReplicaSource(job, step, committed_at(path), path=path)
    mem = next((m for m in catalog.in_memory_all(job) if m.step == step and m.manifest is not None), None)
    held = holdings.of(job, step)
    if mem is None or mem.manifest is None or not held:
        return None
    files = mem.manifest["files"]
    if sorted(files) != sorted(shard_name(r) for r in held):
        return None
    shards = {shard_name(rank): (slot.name, files[shard_name(rank)]["size"]) for rank, slot in held.items()}
    marks = [(slot, slot.holds) for slot in held.values()]  # a slot reused since no longer holds this shard
    return ReplicaSource(
        job, step, commit_time(mem.manifest), manifest=mem.manifest, shards=shards, unchanged=lambda: all(s.holds == h for s, h in marks)
    )


class Outcomes:
    """What became of each step's replication (the newest :data:`KEPT`), and the ``replicated`` requests held until it
    is known. Main thread only."""

    KEPT = 4096

    def __init__(self) -> None:
        self._known: collections.OrderedDict[tuple[str, int], dict[str, Any]] = collections.OrderedDict()
        self.waiters: Waiters[tuple[str, int]] = Waiters()

    def wait(self, job: str, step: int, ident: bytes, req_id: Any, deadline: float) -> dict[str, Any] | None:
        """The step's outcome if known, else ``None`` (the request is held until it is, or ``deadline``)."""
        known = self._known.get((job, step))
        if known is not None:
            return dict(known)
        self.waiters.add((job, step), ident, req_id, deadline)
        return None

    def done(self, ev: Replicated) -> list[tuple[Waiter, dict[str, Any]]]:
        """An outcome: recorded, and the replies of the requests that waited for it."""
        answer = {"state": ev.state, "step": ev.step, "peers": list(ev.peers), "reason": ev.reason}
        self._known[(ev.job, ev.step)] = answer
        self._known.move_to_end((ev.job, ev.step))
        while len(self._known) > self.KEPT:
            self._known.popitem(last=False)
        return [(w, dict(answer)) for w in self.waiters.pop((ev.job, ev.step))]

    def due(self, now: float) -> list[tuple[Waiter, dict[str, Any]]]:
        """Requests whose deadline passed: answered ``pending``."""
        return [(w, {"state": "pending", "step": key[1], "peers": [], "reason": None}) for key, w in self.waiters.due(now)]
