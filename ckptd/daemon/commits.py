"""A rank's ``commit``: from the checked request to the step it joins, in one domain method (:meth:`Commits.commit`).

The commit names the slot its rank leased and wrote, and the step. It is checked against the lease and the segment,
refused for a multi-node step without a bucket, admitted (:mod:`.admission`: which attempt of the step it joins, or
why not), given its tier (:mod:`.memtier`), stamped with its place in the job's commit order (:class:`.catalog.CommitClock`)
and recorded beside the segment (from then on the shard survives any crash of the daemon). The slot is then
committed in the pool, the rank in the step table, and the shard goes to a persist thread (tier ``disk``) and, on
a single-node step, to the seal thread (the memory tier's; bound for disk, a hot restore reads it at once).

Main thread only (the daemon's loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError
from ..layout import step_dir
from ..protocol import CommitRecord
from ..storage.local import committed_at
from .admission import Admission
from .books import Books
from .catalog import CommitClock
from .completion import Completion
from .memtier import MemoryTier
from .slots import Slot, SlotPool
from .steps import StepTrack
from .tiering import Tiering

LEASE_KEYS = ("job", "rank", "world_size")  # what a commit must say as its lease said it


class Commits:
    """Takes ranks' commits (:meth:`commit`), with the components a commit passes through."""

    def __init__(
        self,
        books: Books,
        pool: SlotPool,
        clock: CommitClock,
        admission: Admission,
        tiering: Tiering,
        memory: MemoryTier,
        completion: Completion,
        mesh_ready: Callable[[str], bool] = lambda job: False,
    ) -> None:
        """``books``: the root, steps and catalog it reads (:class:`.books.Books`); ``clock``: the commit order;
        ``mesh_ready(job)``: the job's steps that span nodes can complete in its daemons' memory (:mod:`.mesh`)."""
        self.root, self.pool, self.catalog, self.steps, self.clock = books.root, pool, books.catalog, books.steps, clock
        self.admission, self.tiering, self.memory, self.completion = admission, tiering, memory, completion
        self.mesh_ready = mesh_ready

    def commit(self, msg: dict[str, Any]) -> None:
        """Take a validated ``commit`` request (:mod:`ckptd.protocol`), or raise :class:`ProtocolError` saying why not."""
        slot = self._checked(msg)
        job, step, rank, ws, lws = msg["job"], msg["step"], msg["rank"], msg["world_size"], msg["local_world_size"]
        track = self.admission.admit(job, step, rank, ws, lws, msg["peer"], msg["after"], msg["run"])
        self.tiering.set_job(job, msg["persist_every"], msg["persist_interval"])
        mesh = lws < ws and self.mesh_ready(job)
        self.memory.decide(job, step, track, lws < ws, mesh=mesh, bucket=self.catalog.store is not None)
        record = self._record(msg, track)
        self.pool.segments.write_record(slot.name, record)  # from here on the shard survives any crash
        self.pool.commit(slot, record, len(record.tree))
        self.steps.record_commit((job, step), track, rank, lws, record.run, record.committed_at)
        self.admission.committed(job, step, rank, msg["peer"], msg["run"])
        if track.tier == "disk":
            self.completion.persist(slot)
        if lws == ws or track.mesh:  # sealed into the memory tier (or, bound for disk, readable by a hot restore at once)
            self.memory.seal(slot)

    def _checked(self, msg: dict[str, Any]) -> Slot:
        """The slot the commit names, leased to its sender, its lease and size matching the commit."""
        slot = self.pool.leased(msg["segment"], msg["lease"], msg["peer"])
        job, step, rank, ws, lws = msg["job"], msg["step"], msg["rank"], msg["world_size"], msg["local_world_size"]
        lease = slot.lease or {}
        if any(lease.get(k) != msg[k] for k in LEASE_KEYS) or lease.get("step") not in (None, step):
            raise ProtocolError(f"commit for {job}/{step}/rank {rank} does not match the lease of {slot.name}")
        if msg["nbytes"] > slot.size:
            raise ProtocolError(f"commit of {msg['nbytes']} bytes exceeds segment size {slot.size}")
        if lws < ws and self.catalog.store is None and not self.mesh_ready(job):
            raise ProtocolError(
                f"step {step} of job {job} spans several nodes ({lws} of {ws} ranks on this one):"
                " a multi-node job is committed through a bucket or a shared directory every node mounts, or in the memory of"
                " the job's daemons; configure [remote] (bucket = ... or path = ...) or --remote-path on every node's daemon,"
                " or --peer-listen, --peer-key and --replicas on every node's daemon"
            )
        return slot

    def _record(self, msg: dict[str, Any], track: StepTrack) -> CommitRecord:
        """The commit record kept beside the segment: what the request said, its commit time, its attempt, its tree."""
        job, after = msg["job"], msg["after"]
        restored = 0 if after is None else committed_at(step_dir(self.root, job, after))  # maybe another node's clock
        return CommitRecord(
            job=job,
            rank=msg["rank"],
            world_size=msg["world_size"],
            local_world_size=msg["local_world_size"],
            step=msg["step"],
            nbytes=msg["nbytes"],
            replicas=msg["replicas"],
            committed_at=self.clock.stamp(job, max(track.replaces_at, restored)),
            # into the fragment: the attempt (launch, restored step), never merged with another attempt's fragments
            run=msg["run"],
            after=after,
            tree=msg["frames"][0],  # raw JSON as it came: parsed on the persist thread
        )
