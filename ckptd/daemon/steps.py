"""The step table: per (job, step), which ranks committed, how many shards are still being written,
whether the step is pending, durable or failed, and who waits for the answer.

Main thread only (the daemon's loop): persist and upload threads report through events, and the loop
updates the table. A step leaves ``pending`` once (durable or failed); the table keeps the newest
:data:`~ckptd.config.TRACKS_KEPT` finished steps per job so a late ``wait()`` still gets the truth.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..config import TRACKS_KEPT
from ..errors import ProtocolError
from .waiters import Waiter, Waiters

StepKey = tuple[str, int]  # (job, step)
_ATTEMPTS = itertools.count(1)


class StepState(StrEnum):
    PENDING = "pending"
    MEMORY = "memory"  # complete in the memory tier only (see :mod:`.tiering`); may still be persisted
    DURABLE = "durable"
    FAILED = "failed"
    DROPPED = "dropped"  # a memory-only step dropped without being persisted, as the tiering policy allows


# Every state change a step may make, named, and the states it may make it from: the step table makes them all
# (:meth:`StepTable.move`); the other components report what happened (a commit, a seal, a persisted shard, an upload)
# and the table moves the step. docs/architecture.md shows this table (tests/test_step_states.py keeps them alike).
TRANSITIONS: dict[str, tuple[frozenset[StepState], StepState]] = {
    "sealed": (frozenset({StepState.PENDING}), StepState.MEMORY),  # every rank's shard sealed into the memory tier
    "complete": (frozenset({StepState.PENDING}), StepState.DURABLE),  # on disk (single node) or in the bucket (multi-node)
    "fail": (frozenset({StepState.PENDING}), StepState.FAILED),  # a shard not written, abandoned, superseded
    "to_disk": (frozenset({StepState.MEMORY}), StepState.PENDING),  # a memory-only step persisted after all
    "back_to_memory": (frozenset({StepState.PENDING}), StepState.MEMORY),  # persisting it from memory failed
    "drop": (frozenset({StepState.MEMORY}), StepState.DROPPED),  # a memory-only step let go unpersisted
}


class IllegalTransition(RuntimeError):
    """A step was asked to make a state change its state does not allow: a bug in the daemon, never a client's doing."""


@dataclass
class StepTrack:
    world_size: int
    local_world_size: int = 0  # ranks of this step on this node (< world_size: a multi-node step)
    committed: set[int] = field(default_factory=set)  # ranks whose commit the daemon recorded
    inflight: int = 0  # shards of it being written by persist threads
    state: StepState = StepState.PENDING
    error: str | None = None
    path: str | None = None  # where the durable step is: a directory, or the bucket's URL
    run: int | None = None  # the launch its first commit named
    abandoned: bool = False  # failed because its ranks moved on without it: a new attempt may start afresh
    recovered: bool = False  # adopted after a daemon crash: ranks that had not committed never will
    tier: str = "disk"  # decided at its first commit: "disk" (persisted) or "memory" (held in shared memory only)
    committed_at: int = 0  # its first commit's time (ns): orders the job's steps
    promote: bool = False  # a memory-tier step someone wants durable: persisted as soon as it is sealed
    sealed: bool = False  # complete in shared memory (every rank's header read): a hot restore can read it
    from_memory: bool = False  # being persisted from the memory tier: its slots stay held until it is durable
    persist_error: str | None = None  # this attempt at persisting it from memory failed (the step stays in memory)
    persist_failed_at: float = 0.0  # when an attempt last failed (monotonic): automatic retries wait a while
    persist_failures: int = 0  # attempts that failed: the automatic retries back off
    replaces: bool = False  # a rolled-back run's re-save of a number complete on disk: it takes the old step's place
    replaces_at: int = 0  # ... whose committed_at this is (its own commits are stamped later)
    mesh: bool = False  # spans nodes and completes in the memory of the job's daemons (:mod:`.mesh`): never persisted
    mesh_folder: str | None = None  # ... its attempt's folder, once this node's part is sealed
    mesh_sealed_at: float = 0.0  # ... and when (monotonic)
    # this track's own number: a step number saved again (abandoned, rolled back) is a new attempt, and work
    # still in flight for an earlier one (a seal) must not count toward this one
    attempt: int = field(default_factory=lambda: next(_ATTEMPTS))

    def move(self, transition: str) -> None:
        """Make the state change ``transition`` names (:data:`TRANSITIONS`); :class:`IllegalTransition` from a state
        it may not start from."""
        start, end = TRANSITIONS[transition]
        if self.state not in start:
            raise IllegalTransition(f"a step in state {self.state.value} cannot be {transition!r} (to {end.value})")
        self.state = end

    @property
    def all_committed(self) -> bool:
        """Every rank this daemon serves for the step has committed."""
        return len(self.committed) >= (self.local_world_size or self.world_size)

    def answer(self) -> dict[str, Any]:
        """The ``wait`` reply for this step (``peers_only``: in memory, and never persisted: :attr:`mesh`)."""
        return {"state": self.state.value, "path": self.path, "error": self.error, **({"peers_only": True} if self.mesh else {})}


class StepTable:
    """``complete_path(job, step)`` answers for steps the table does not track (a directory or ``None``)."""

    def __init__(self, complete_path: Callable[[str, int], str | None]) -> None:
        self._complete_path = complete_path
        self.tracks: dict[StepKey, StepTrack] = {}
        self.waiters: Waiters[StepKey] = Waiters()
        self.seal_waiters: Waiters[StepKey] = Waiters()  # wait(persist=False): answered once the step is sealed

    def get(self, key: StepKey) -> StepTrack | None:
        return self.tracks.get(key)

    def live(self, key: StepKey) -> bool:
        """Whether step ``key`` is being saved or is held in the memory tier."""
        return (t := self.tracks.get(key)) is not None and t.state in (StepState.PENDING, StepState.MEMORY)

    def adopt(self, key: StepKey, world_size: int, local_world_size: int = 0) -> StepTrack:
        """The track of ``key``, made if new (crash recovery: shards and fragments a previous run left)."""
        return self.tracks.setdefault(key, StepTrack(world_size, local_world_size, recovered=True))

    def check_commit(self, key: StepKey, rank: int, world_size: int, local_world_size: int) -> StepTrack:
        """Check a rank's commit against what other ranks of the step said; ``ProtocolError`` if it
        does not fit. Records nothing: call :meth:`record_commit` once the commit is stored."""
        job, step = key
        track = self.tracks.get(key) or StepTrack(world_size, local_world_size)
        if (track.world_size, track.local_world_size or local_world_size) != (world_size, local_world_size):
            raise ProtocolError(
                f"step {step}: world_size {world_size} / local_world_size {local_world_size} differ from"
                f" {track.world_size} / {track.local_world_size} of other ranks"
            )
        if track.state is StepState.FAILED:  # first: what a re-commit of a rank of it needs to hear
            raise ProtocolError(f"step {step} of job {job} already failed: {track.error}")
        if rank in track.committed:
            raise ProtocolError(f"rank {rank} already committed step {step} of job {job}")
        if track.state is StepState.DURABLE:
            raise ProtocolError(f"step {step} of job {job} is already committed ({track.path})")
        if track.state is StepState.MEMORY:
            raise ProtocolError(f"step {step} of job {job} is already committed (held in memory)")
        if track.committed and track.all_committed:
            raise ProtocolError(
                f"step {step} of job {job}: all {track.local_world_size} ranks this daemon serves have committed;"
                f" rank {rank} is one too many (local_world_size must count the ranks on this node)"
            )
        return track

    def record_commit(
        self, key: StepKey, track: StepTrack, rank: int, local_world_size: int, run: int | None = None, committed_at: int = 0
    ) -> None:
        track.local_world_size = local_world_size
        track.committed.add(rank)
        if track.run is None:
            track.run = run
        track.committed_at = track.committed_at or committed_at
        self.tracks[key] = track

    def drop(self, key: StepKey) -> None:
        """Forget ``key`` (a new attempt of the step starts afresh); its waiters were answered."""
        self.tracks.pop(key, None)

    def abandon(self, key: StepKey, why: str) -> bool:
        """Fail a pending step whose ranks will never all commit; a new attempt may start it afresh."""
        if not self.fail(key, why):
            return False
        self.tracks[key].abandoned = True
        return True

    def abandon_others(self, job: str, step: int, rank: int) -> list[tuple[StepKey, StepTrack]]:
        """``rank`` committed ``step``: abandon every other pending step of ``job`` that some rank never
        committed (see :mod:`.admission`). Returns them; their waiters are the caller's to answer."""

        def why(s: int, t: StepTrack) -> str:
            missing = sorted(set(range(t.world_size)) - t.committed)[:8]
            return (
                f"abandoned: rank {rank} committed step {step} before ranks {missing} committed step {s}"
                " (they crashed, or called snapshot() with another step)"
            )

        return self._fail_incomplete(job, lambda s: s != step, why, abandoned=True)

    def _fail_incomplete(
        self, job: str, which: Callable[[int], bool], why: Callable[[int, StepTrack], str], *, abandoned: bool
    ) -> list[tuple[StepKey, StepTrack]]:
        """Fail the pending steps of ``job`` (those ``which`` picks) that some rank never committed."""
        out = []
        for (j, s), t in list(self.tracks.items()):
            if j == job and which(s) and t.state is StepState.PENDING and not t.all_committed:
                t.move("fail")
                t.error, t.abandoned = why(s, t), abandoned
                out.append(((j, s), t))
        return out

    def fail(self, key: StepKey, error: str) -> bool:
        """Mark a pending step failed; False if it was not pending (the first outcome stands)."""
        track = self.tracks.get(key)
        if track is None or track.state is not StepState.PENDING:
            return False
        track.move("fail")
        track.error = error
        return True

    def drop_memory(self, key: StepKey, why: str) -> bool:
        """A memory-only step leaves the memory tier without being persisted (``why``); its number may be
        saved again. False if it was not a memory-only step."""
        track = self.tracks.get(key)
        if track is None or track.state is not StepState.MEMORY:
            return False
        track.move("drop")
        track.error, track.abandoned = why, True
        return True

    def to_disk(self, key: StepKey) -> StepTrack:
        """A memory-only step is persisted after all: pending again, bound for disk."""
        track = self.tracks[key]
        track.move("to_disk")
        track.tier, track.promote = "disk", False
        track.from_memory, track.persist_error = True, None
        return track

    def back_to_memory(self, key: StepKey, now: float) -> list[tuple[Waiter, dict[str, Any]]]:
        """Persisting a step from memory failed: it is a memory-only step again (its slots still hold it).
        Returns the waiters for its durability with the failure, forgotten here."""
        track = self.tracks[key]
        error = f"persisting step {key[1]} of job {key[0]} failed ({track.persist_error}); it is still held in memory on this node"
        track.move("back_to_memory")
        track.tier, track.from_memory, track.persist_failed_at = "memory", False, now
        track.persist_failures += 1
        failed = {"state": StepState.FAILED.value, "path": None, "error": error, "in_memory": True}  # a later wait tries again
        return [(w, failed) for w in self.waiters.pop(key)] + [(w, self.answer(key, sealed_ok=True)) for w in self.seal_waiters.pop(key)]

    def complete(self, key: StepKey, path: str) -> None:
        """Step ``key`` is durable at ``path`` (a directory, or the bucket's URL)."""
        track = self.tracks[key]
        track.move("complete")
        track.path = path

    def sealed(self, key: StepKey) -> StepTrack:
        """Every rank of step ``key`` is sealed into the memory tier: complete in memory, readable by a hot restore."""
        track = self.tracks[key]
        track.move("sealed")
        track.sealed = True
        return track

    def shard_started(self, key: StepKey) -> StepTrack:
        """A shard of step ``key`` went to a persist or seal thread: the step's files are being written or read."""
        track = self.tracks[key]
        track.inflight += 1
        return track

    def shard_done(self, track: StepTrack) -> None:
        """A persist or seal thread reported back on one of ``track``'s shards."""
        track.inflight -= 1

    def supersede(self, job: str, step: int) -> list[tuple[StepKey, StepTrack]]:
        """Step ``step`` of ``job`` completed: fail older pending steps some rank never committed (they
        can no longer complete). Returns them; their waiters are the caller's to answer."""
        why = lambda s, t: f"superseded: step {step} was committed before every rank committed step {s}"  # noqa: E731
        return self._fail_incomplete(job, lambda s: s < step, why, abandoned=False)

    def forget_finished(self, job: str) -> None:
        """Keep the newest finished tracks of ``job`` (even those retention removed from disk); never one
        whose shards are still being written or waited for."""
        done = sorted(
            s
            for (j, s), t in self.tracks.items()
            if j == job
            and t.state in (StepState.DURABLE, StepState.FAILED, StepState.DROPPED)
            and t.inflight == 0
            and not self.waiters.has((j, s))
        )
        for s in done[:-TRACKS_KEPT]:
            del self.tracks[(job, s)]

    def answer(self, key: StepKey, sealed_ok: bool = False) -> dict[str, Any]:
        """The ``wait`` reply for ``key`` now (``sealed_ok``: a step complete in memory, still being persisted,
        is answered ``memory``)."""
        track = self.tracks.get(key)
        if track is not None:
            if sealed_ok and track.sealed and track.state is StepState.PENDING:
                return {"state": StepState.MEMORY.value, "path": None, "error": None}
            return track.answer()
        path = self._complete_path(*key)
        if path is not None:
            return {"state": StepState.DURABLE.value, "path": path, "error": None}
        # a step from before a restart that is not on disk: removed by retention, dropped by the memory tier, or lost
        why = f"the daemon has no record of step {key[1]} of job {key[0]} and it is not on disk"
        return {"state": StepState.FAILED.value, "path": None, "error": why, "unknown": True}

    def wait(self, key: StepKey, ident: bytes, req_id: Any, deadline: float, persist: bool = True) -> dict[str, Any] | None:
        """The ``wait`` reply if the step is not pending (``persist`` false: or sealed); else hold the request
        until ``deadline``."""
        track = self.tracks.get(key)
        if track is None or track.state is not StepState.PENDING or (track.sealed and not persist):
            return self.answer(key, sealed_ok=not persist)
        (self.waiters if persist else self.seal_waiters).add(key, ident, req_id, deadline)
        return None

    def answered(self, key: StepKey) -> list[tuple[Waiter, dict[str, Any]]]:
        """The waiters of ``key`` with their reply, forgotten here (call once the step left pending)."""
        return [(w, self.answer(key)) for w in self.waiters.pop(key) + self.seal_waiters.pop(key)]

    def answered_sealed(self, key: StepKey) -> list[tuple[Waiter, dict[str, Any]]]:
        """The waiters of ``key`` that wait only for it to be sealed, with their reply, forgotten here."""
        return [(w, self.answer(key, sealed_ok=True)) for w in self.seal_waiters.pop(key)]

    def due(self, now: float) -> list[tuple[Waiter, dict[str, Any]]]:
        """Waiters past their deadline with the state as it is, forgotten here."""
        late = [(w, self.answer(key)) for key, w in self.waiters.due(now)]
        return late + [(w, self.answer(key, sealed_ok=True)) for key, w in self.seal_waiters.due(now)]

    def in_flight(self) -> dict[str, list[int]]:
        """Pending steps by job, for ``status``."""
        out: dict[str, list[int]] = {}
        for (job, step), t in self.tracks.items():
            if t.state is StepState.PENDING:
                out.setdefault(job, []).append(step)
        return out

    def of_job(self, job: str, state: StepState) -> list[tuple[int, StepTrack]]:
        """The steps of ``job`` in ``state``, oldest commit first."""
        found = [(s, t) for (j, s), t in self.tracks.items() if j == job and t.state is state]
        return sorted(found, key=lambda st: (st[1].committed_at, st[0]))

    def disk_busy(self, job: str) -> bool:
        """A step of ``job`` is being persisted (pending, bound for disk)."""
        return any(t.tier == "disk" for _, t in self.of_job(job, StepState.PENDING))

    def memory_steps(self) -> dict[str, list[int]]:
        """Steps held only in the memory tier, by job, for ``status``."""
        out: dict[str, list[int]] = {}
        for (job, step), t in self.tracks.items():
            if t.state is StepState.MEMORY:
                out.setdefault(job, []).append(step)
        return {j: sorted(s) for j, s in out.items()}

    def shards_in_flight(self) -> int:
        return sum(t.inflight for t in self.tracks.values())
