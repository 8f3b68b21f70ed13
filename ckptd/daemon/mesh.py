"""The job's daemons as one memory tier: a step that spans nodes completes in their memory, no bucket needed.

The ranks of a job that spans nodes tell their daemon which daemons serve the job: its *ring*, every rank's daemon's
peer address in rank order (:mod:`ckptd.client.ring`, gathered at the job's first snapshot and at a restore; the
``ring`` request). A daemon with peer links (``--peer-listen``, ``--peer-key``, ``--replicas K``) that knows its job's
ring keeps the job's steps in this tier (with a bucket or shared directory, all but those whose number is a multiple
of the job's ``persist_every``, which go there: :meth:`.tiering.Tiering.persists_across`):

1. it seals its own ranks' shards, checksums included (:meth:`.memtier.MemoryTier.seal`), and publishes its part of
   the step (:meth:`Mesh.publish`; the mesh thread): its own replica store serves its shards by reference (the held
   slots: no copy); the next K daemons of the ring get a copy (the shards, then the fragments: a fragment there means
   its shard is there); then its own replica store and every other daemon of the ring get the fragments. A node's
   fragments reach no daemon before its part reached its next K, so a step complete anywhere has K + 1 copies of every
   part (fewer only where a daemon refused one: the step is then reported *degraded*);
2. a daemon whose replica store holds every rank's fragment of the attempt merges them into the step's manifest (the
   same merge and checks as the bucket's, :func:`ckptd.format.build_manifest`) and keeps it beside them: the step is
   complete in memory on that node (:class:`~.events.MeshComplete`), and the replica store lets the job's older steps
   go. No daemon waits for another to decide: the same fragments make the same manifest everywhere;
3. a restore reads the ring's replica stores as one (:class:`~ckptd.storage.peer.PeerUnion`): the step committed last
   whose every file some daemon still holds, downloaded and verified as from a bucket, into any layout.

A node lost loses its own copy of its part; its next K daemons hold another. A step kept here is never persisted
later. Fragments go to every daemon of the ring: a step costs each node ``n - 1`` small messages.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import MAX_DOCUMENT_BYTES
from ..errors import CheckpointError
from ..format import attempt_of, build_manifest, encode_manifest
from ..layout import MANIFEST, bucket_key, fragment_name, fragment_rank, shard_name
from ..peerkey import PeerKey
from ..storage.peer import Pacer, PeerStore, PeerUnion
from ..validate import parse_fragment
from .events import MeshComplete
from .replicas import ReplicaServer
from .sending import NewestPerJob, Superseded

log = logging.getLogger("ckptd.daemon")
DECIDED_KEPT = 4096  # attempts whose manifest this daemon built, remembered so that a late fragment builds none again


def advertised(listen: str, port: int | None) -> str:
    """The address other daemons reach this one's replica store at: ``--peer-listen``, a wildcard host replaced by this
    host's name and a port 0 by the one bound."""
    host, _, want = listen.removeprefix("tcp://").rpartition(":")
    if host in ("*", "0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return f"tcp://{host}:{port if port else want}"


@dataclass(frozen=True)
class NodePart:
    """This node's part of a step that spans nodes, sealed: its ranks' shards (``rank -> (segment, size)``) and their
    fragments (checksums included, encoded), of the attempt whose folder is ``folder``. ``unchanged()``: the slots still
    hold the step (a slot reused for a later snapshot meanwhile ends the sending)."""

    job: str
    step: int
    folder: str
    shards: dict[int, tuple[str, int]]
    fragments: dict[int, bytes]
    unchanged: Callable[[], bool] = lambda: True


class Mesh(NewestPerJob[NodePart]):
    def __init__(self, me: str, key: PeerKey, server: ReplicaServer, replicas: int, *, report: Callable[[Any], None],
                 open_segment: Callable[[str], int], pacer: Pacer | None = None,
                 initializer: Callable[[], None] = lambda: None) -> None:  # fmt: skip
        """``me``: this daemon's advertised peer address (:func:`advertised`); ``server``: its replica store, whose
        ``published`` hook calls :meth:`published`; ``replicas``: K; ``report``: posts :class:`~.events.MeshComplete` and
        :class:`~.events.Replicated` events to the daemon's loop (any thread); ``open_segment(name)``: a read-only fd of
        one of this daemon's segments; ``initializer``: run first on the mesh thread (the daemon's lowers its priority)."""
        self.me, self.replicas, self._key, self._server = me, replicas, key, server
        self._open, self._pacer = open_segment, pacer or Pacer()
        self.rings: dict[str, tuple[str, ...]] = {}  # job -> its daemons in rank order (replaced whole: read anywhere)
        self._send_links: dict[str, PeerStore] = {}  # mesh thread only
        self._read_links: dict[str, PeerStore] = {}  # restores (worker threads), under the lock
        self._decided: collections.OrderedDict[tuple[str, int, str], None] = collections.OrderedDict()
        super().__init__("ckptd-mesh", report, initializer)

    # ------------------------------------------------------------------ the job's ring (main thread)

    def set_ring(self, job: str, ring: list[str]) -> str | None:
        """A rank told the job's ring (validated by the protocol). Returns why it is not used, or ``None``."""
        if self.me not in ring:
            return f"this daemon's peer address {self.me} is not in the ring of job {job!r}; its steps stay on this node"
        if self.rings.get(job) != tuple(ring):
            log.info("job %s spans %d daemons: %s", job, len(ring), ", ".join(ring))
            self.rings[job] = tuple(ring)
        return None

    def ready(self, job: str) -> bool:
        """Whether a step of ``job`` that spans nodes can complete in this tier: its ring is known, with this daemon."""
        return len(self.rings.get(job, ())) >= 2

    def union(self, job: str) -> PeerUnion | None:
        """The ring's replica stores read as one (this daemon's own among them), or ``None`` without a ring."""
        ring = self.rings.get(job)
        if not ring:
            return None
        with self._lock:
            links = [self._read_links.setdefault(a, PeerStore(a, self._key)) for a in ring]
        return PeerUnion(links)

    def publish(self, part: NodePart) -> None:
        """Queue this node's part of a step (a job's older part not yet sent is skipped: a later step goes instead)."""
        with self._lock:
            self._enqueue(part)

    def shutdown(self, timeout: float = 5.0) -> None:
        super().shutdown(timeout)
        with self._lock:
            links = list(self._read_links.values())
        for link in links:
            link.close()

    # ------------------------------------------------------------------ sending (the mesh thread)

    def _closing(self) -> None:
        for link in self._send_links.values():
            link.close()

    def _link(self, addr: str) -> PeerStore:
        if addr not in self._send_links:
            self._send_links[addr] = PeerStore(addr, self._key, pacer=self._pacer)
        return self._send_links[addr]

    def _send(self, part: NodePart) -> None:
        t0 = time.monotonic()
        ring = self.rings.get(part.job, ())
        if self.me not in ring:
            return
        i, n = ring.index(self.me), len(ring)
        successors = [ring[(i + k) % n] for k in range(1, min(self.replicas, n - 1) + 1)]
        shard_keys = {r: bucket_key(part.job, part.step, part.folder + shard_name(r)) for r in part.shards}
        frag_keys = {r: bucket_key(part.job, part.step, part.folder + fragment_name(r)) for r in part.fragments}
        for rank, (segment, size) in sorted(part.shards.items()):  # this node's own copy: its slots, by reference
            self._server.adopt_segment(shard_keys[rank], segment, size)
        if not part.unchanged():
            raise Superseded("its shared memory was reused for a later snapshot before it was published")
        took, fragments_only = [], [a for a in ring if a != self.me and a not in successors]
        with _Mapped(part, self._open) as views:
            for addr in successors:
                try:
                    for rank in sorted(views):
                        self._link(addr).put_bytes(shard_keys[rank], views[rank])
                    if not part.unchanged():
                        raise Superseded("its shared memory was reused for a later snapshot while it was sent")
                    self._put_fragments(addr, part, frag_keys)
                    took.append(addr)
                except (CheckpointError, OSError) as e:
                    if isinstance(e, Superseded):
                        raise
                    log.warning("daemon %s did not take job %s step %s's part from this node: %s", addr, part.job, part.step, e)
                    self.counters["peer_failures"] += 1
                    fragments_only.append(addr)  # it may still complete the step, its own part being there
        # the fragments last, here too: a step complete on any daemon has every node's part at its next K daemons
        for rank, doc in sorted(part.fragments.items()):
            self._server.adopt_bytes(frag_keys[rank], doc)
        for addr in fragments_only:
            try:
                self._put_fragments(addr, part, frag_keys)
            except (CheckpointError, OSError) as e:  # that daemon cannot complete the step: its ranks' waits say so
                log.warning("daemon %s did not take job %s step %s's fragments from this node: %s", addr, part.job, part.step, e)
        self._done(part, "replicated" if len(took) >= min(self.replicas, n - 1) else "degraded", took, time.monotonic() - t0)

    def _put_fragments(self, addr: str, part: NodePart, keys: dict[int, str]) -> None:
        for rank, doc in sorted(part.fragments.items()):
            self._link(addr).put_bytes(keys[rank], doc)

    # ------------------------------------------------------------------ deciding (the thread that published a fragment)

    def published(self, key: str) -> None:
        """An object arrived in the replica store (its ``published`` hook): if it is a fragment, and the replica store
        now holds every rank's fragment of its attempt, the step is complete in memory here."""
        parts = key.split("/")
        if len(parts) != 4 or fragment_rank(parts[3]) is None or not parts[1].startswith("step-"):
            return
        job, folder = parts[0], parts[2] + "/"
        try:
            step = int(parts[1].removeprefix("step-"))
            if bucket_key(job, step, "") != f"{job}/{parts[1]}/":
                return
            prefix = bucket_key(job, step, folder)
            first = self._fragment(key)
            ws, names = first["world_size"], self._server.names(prefix)
            if any(prefix + fragment_name(r) not in names for r in range(ws)):
                return
            with self._lock:
                if (job, step, folder) in self._decided:
                    return
                self._decided[(job, step, folder)] = None
                while len(self._decided) > DECIDED_KEPT:
                    self._decided.popitem(last=False)
            frags = [self._fragment(prefix + fragment_name(r)) for r in range(ws)]
            if len({attempt_of(f) for f in frags}) != 1:
                raise CheckpointError(f"the fragments in {prefix} name different attempts")
            manifest = build_manifest(job, step, ws, frags)
            manifest["attempt_objects"] = True
            self._server.adopt_bytes(bucket_key(job, step, MANIFEST), encode_manifest(manifest))
        except CheckpointError as e:  # FormatError included: another daemon's fragment, checked as a bucket's
            log.error("job %s: the fragments under %s do not make a checkpoint: %s", job, key.rsplit("/", 1)[0], e)
            self._report(MeshComplete(job, step, folder, error=str(e)))
            return
        log.info("job %s step %s is complete in the memory of its %d daemons", job, step, len(self.rings.get(job, ())) or ws)
        self._report(MeshComplete(job, step, folder, manifest))

    def _fragment(self, key: str) -> dict[str, Any]:
        raw = self._server.read(key, MAX_DOCUMENT_BYTES)
        if raw is None:
            raise CheckpointError(f"{key} is gone or too large")
        return parse_fragment(raw, f"{self.me}/{key}")

    # ------------------------------------------------------------------ status

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "me": self.me,
                "replicas": self.replicas,
                "rings": {j: list(r) for j, r in self.rings.items()},
                "queued": {j: p.step for j, p in self._queue.items()},
                "current": list(self.current) if self.current else None,
                "jobs": {j: dict(r) for j, r in self.results.items()},
                **dict(self.counters),
            }


class _Mapped:
    """A part's shards mapped read-only for sending (let go on exit)."""

    def __init__(self, part: NodePart, open_segment: Callable[[str], int]) -> None:
        self.part, self._open = part, open_segment
        self._maps: list[mmap.mmap] = []
        self.views: dict[int, memoryview] = {}

    def __enter__(self) -> dict[int, memoryview]:
        try:
            for rank, (segment, size) in self.part.shards.items():
                try:
                    fd = self._open(segment)
                except (CheckpointError, OSError):
                    raise Superseded(f"the segment of rank {rank}'s shard is gone") from None
                try:
                    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                self._maps.append(mm)
                self.views[rank] = memoryview(mm)[:size]
        except BaseException:
            self.__exit__()
            raise
        return self.views

    def __exit__(self, *exc: Any) -> None:
        for v in self.views.values():
            v.release()
        self.views.clear()
        for mm in self._maps:
            with contextlib.suppress(BufferError):  # a frame libzmq still holds: closed once freed
                mm.close()
        self._maps.clear()
