"""The step catalog: the daemon's one answer to "which complete steps does a job have, and which
one does a restore read" — under the local root, in the bucket, and in shared memory.

One definition of "the latest step" of a job: the complete step committed last (commit order, not
the step number: see :mod:`ckptd.storage.local`), under the root or in the bucket.

* :meth:`StepCatalog.latest` — the latest complete local step (``latest`` when it names a complete
  step, else the one committed last): ``status``, ``hot_open``, the ``latest`` op without a bucket.
* :meth:`StepCatalog.latest_anywhere` — the latest step under the root *or* in the bucket (a replaced
  node's empty root, every root of a multi-node job): the ``latest`` op with a bucket, on the lookup
  thread; a restore of "the latest". Blocks on the network.
* :meth:`StepCatalog.find` — the step a restore reads: the one asked for, or the latest anywhere
  (blocks on the network: the fetch thread only).
* :meth:`StepCatalog.in_memory` — the newest step this daemon completed since it started (on disk or in
  the memory tier only), with its manifest: the only step a hot restore reads from shared memory.
* :meth:`StepCatalog.note_uploaded` / :meth:`uploaded` — the newest step complete in the bucket
  (this run), for ``status``.

``in_memory`` and ``uploaded`` are written and read by the main thread only; the rest reads storage
and may run on any thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..format import commit_time
from ..layout import is_complete, list_jobs, step_dir, was_fetched
from ..protocol import Source
from ..storage.local import committed_at, latest_step, steps_by_commit
from ..storage.remote import bucket_committed_at, bucket_steps_by_commit, remote_steps, step_complete
from ..storage.store import ObjectStore
from ..validate import I64_MAX
from .tiering import Tier

if TYPE_CHECKING:
    from .slot import Slot

log = logging.getLogger("ckptd.daemon")


class NoStep(CheckpointError):
    """The asked-for step exists neither under the root nor in the bucket."""


@dataclass(frozen=True)
class Found:
    """The step a restore reads and where it is (a local path when on disk)."""

    step: int
    source: Source  # DISK, BUCKET or PEER
    path: str | None
    store: ObjectStore | None = field(default=None, compare=False)  # BUCKET, PEER: where it is downloaded from


@dataclass(frozen=True)
class InMemory:
    step: int
    path: str  # where the step is (or, in the memory tier only, would be) on disk
    manifest: dict[str, Any] | None
    tier: Tier = Tier.DISK


class StepCatalog:
    def __init__(
        self, root: str, store: ObjectStore | None = None, peers: list[ObjectStore] | None = None,
        ring: Callable[[str], ObjectStore | None] = lambda job: None,
    ) -> None:  # fmt: skip
        """``store``: the bucket or shared directory; ``peers``: the replica stores of peer daemons (``--peer``), asked
        after both, for steps this node lost (:mod:`ckptd.storage.peer`); ``ring(job)``: the replica stores of the
        daemons a job that spans nodes named, read as one (:mod:`.mesh`), or ``None``."""
        self.root, self.store, self.peers, self.ring = root, store, list(peers or []), ring
        # job -> step -> a step completed (or sealed on its way to disk) here: the newest by commit order is the
        # one hot restores read; the ones before it come back when it fails or is dropped
        self._in_memory: dict[str, dict[int, InMemory]] = {}
        self._uploaded: dict[str, int] = {}

    def jobs(self) -> list[str]:
        return list_jobs(self.root)

    def latest(self, job: str) -> tuple[int | None, str | None]:
        """The newest complete local step of ``job`` and its directory, or ``(None, None)``."""
        return latest_step(self.root, job)

    def complete_path(self, job: str, step: int) -> str | None:
        """The directory of step ``step`` if it is complete under the root."""
        path = step_dir(self.root, job, step)
        return path if is_complete(path) else None

    def local_steps(self, job: str) -> list[int]:
        """Complete local steps of ``job``, oldest commit first."""
        return steps_by_commit(self.root, job)

    def made_here(self, job: str) -> list[int]:
        """Complete local steps of ``job`` this node made (not downloaded from the bucket: never its to upload), oldest commit first."""
        return [s for s in steps_by_commit(self.root, job) if not was_fetched(self.root, job, s)]

    def bucket_steps(self, job: str) -> list[int]:
        """Complete steps of ``job`` in the bucket (network: worker threads only); none without one."""
        return remote_steps(self.store, job)[0] if self.store is not None else []

    def where(self, job: str | None = None) -> str:
        """Where this catalog looks (for ``job``), for messages."""
        more = [f"in {self.store.url()}"] if self.store is not None else []
        more += [f"in the replicas of peer {p.url()}" for p in (self.peers if job is None else self._peers_of(job))]
        return f"under {self.root}" + "".join(f" or {m}" for m in more)

    def latest_anywhere(self, job: str, skip: frozenset[int] = frozenset()) -> Found | None:
        """The latest complete step of ``job`` under the root, in the bucket or in a peer's replicas, whichever was
        committed later (the local copy when several hold it); ``None`` if none has one. Blocks on the network.

        An unreachable bucket raises (naming the local step, if any): the bucket may hold a later step
        (another node saved on), and resuming from a stale local one without a word is what we exist to
        prevent. A restore of an explicit step still works from disk. ``skip``: steps found unrestorable from the bucket
        and every peer (a restore then takes the newest one still restorable)."""
        local, path = self.latest(job)
        found = Found(local, Source.DISK, path) if local is not None and path is not None else None
        return self._newest_of_peers(job, self._with_bucket(job, found, skip), skip)

    def _with_bucket(self, job: str, found: Found | None, skip: frozenset[int] = frozenset()) -> Found | None:
        """``found`` (the local latest, or ``None``) or the bucket's latest step, whichever was committed later."""
        local, path = (found.step, found.path) if found is not None else (None, None)
        if self.store is None:
            return found
        try:
            complete, _ = bucket_steps_by_commit(self.store, job)
            complete = [s for s in complete if s not in skip]
            remote = complete[-1] if complete else None
            if remote is None:
                return found
            if found is not None and path is not None:
                if (committed_at(path), local) >= (bucket_committed_at(self.store, job, remote) or 0, remote):
                    return found
        except CheckpointError as e:
            if found is None:
                raise
            raise CheckpointError(
                f"{e}; the bucket may hold a later step of job {job!r} than step {local} on this node's disk:"
                f" restore step={local} explicitly to resume from it"
            ) from None
        return Found(remote, Source.BUCKET, None, self.store)

    def _commit_of(self, job: str, found: Found) -> int:
        if found.path is not None:
            return committed_at(found.path)
        assert found.store is not None
        return bucket_committed_at(found.store, job, found.step) or 0

    def _newest_of_peers(self, job: str, found: Found | None, skip: frozenset[int] = frozenset()) -> Found | None:
        """``found``, or a step a peer holds a replica of that was committed later. A peer that cannot be asked is
        skipped, with a warning: peers are there for a node that was lost, and one of them may be the one lost."""
        best = (self._commit_of(job, found), found.step) if found is not None else None
        for peer in self._peers_of(job):
            try:
                complete = [s for s in bucket_steps_by_commit(peer, job)[0] if s not in skip]
                if not complete:
                    continue
                mine = ((bucket_committed_at(peer, job, complete[-1]) or 0), complete[-1])
            except CheckpointError as e:
                log.warning("could not ask peer %s for replicas of job %s: %s", peer.url(), job, e)
                continue
            if best is None or mine > best:
                best, found = mine, Found(complete[-1], Source.PEER, None, peer)
        return found

    def _peers_of(self, job: str) -> list[ObjectStore]:
        """The peers asked for ``job``'s steps: ``--peer``'s, then the job's own daemons (if it named them)."""
        ring = self.ring(job)
        return self.peers + ([ring] if ring is not None else [])

    def holders(self, job: str, step: int) -> list[ObjectStore]:
        """The bucket and the peers that hold step ``step`` of ``job`` complete, in that order (network: worker threads)."""
        out = []
        for store in ([self.store] if self.store is not None else []) + self._peers_of(job):
            try:
                if step_complete(store, job, step):
                    out.append(store)
            except CheckpointError as e:
                log.warning("could not ask %s for step %s of job %s: %s", store.url(), step, job, e)
        return out

    def find(self, job: str, step: int | None = None, skip: frozenset[int] = frozenset()) -> Found:
        """Step ``step`` of ``job`` (or the latest anywhere); raises :class:`NoStep` when neither the root nor
        the bucket has it. An explicit step is read from the local copy unless the bucket holds that number
        committed later (a rollback re-save by other nodes). Blocks on the network."""
        if step is None:
            found = self.latest_anywhere(job, skip)
            if found is None:
                raise NoStep(f"job {job!r} has no committed checkpoint {self.where(job)}")
            return found
        path = self.complete_path(job, step)
        if path is not None and not self._replaced_in_bucket(job, step, path):
            return Found(step, Source.DISK, path)
        holders = self.holders(job, step)
        if not holders:
            raise NoStep(f"step {step} of job {job!r} is not a committed checkpoint {self.where(job)}")
        return Found(step, Source.BUCKET if holders[0] is self.store else Source.PEER, None, holders[0])

    def _replaced_in_bucket(self, job: str, step: int, path: str) -> bool:
        """Whether the bucket holds step ``step`` committed after the local copy at ``path`` (a rollback re-save
        by other nodes, this node's copy being of the abandoned line). An unreachable bucket: no (the disk
        answers an explicit step)."""
        if self.store is None:
            return False
        try:
            complete, _ = bucket_steps_by_commit(self.store, job)  # its listing refreshes the cached commit times
            return step in complete and (bucket_committed_at(self.store, job, step) or 0) > committed_at(path)
        except CheckpointError as e:
            log.warning("the bucket could not be asked about step %s of job %s (%s): reading the local copy", step, job, e)
            return False

    # ------------------------------------------------------------------ what this run completed (main thread)

    def note_complete(self, job: str, step: int, path: str, manifest: dict[str, Any] | None, tier: Tier = Tier.DISK) -> None:
        """Step ``step`` completed here (on disk, ``tier`` DISK), or was sealed into memory (``note_memory``):
        hot restores read the newest such step by commit order (persist threads may finish steps in any
        order). A step completed on disk ends the entries of the disk steps committed before it; memory
        entries end by :meth:`forget_memory` (dropped, or failed)."""
        entries = self._in_memory.setdefault(job, {})
        entries[step] = InMemory(step, path, manifest, tier)
        if tier is Tier.DISK:
            at = (commit_time(manifest), step)
            for s, e in list(entries.items()):
                if e.tier is Tier.DISK and (commit_time(e.manifest), s) < at:
                    del entries[s]

    def note_memory(self, job: str, step: int, manifest: dict[str, Any]) -> None:
        """Step ``step`` is complete in the memory tier only, or sealed on its way to disk (its manifest has
        no checksums)."""
        self.note_complete(job, step, step_dir(self.root, job, step), manifest, Tier.MEMORY)

    def forget_memory(self, job: str, step: int) -> None:
        """Memory-only step ``step`` was dropped, or a sealed step failed: hot restores no longer read it, and
        the step before it (if this daemon still has it) is the job's newest again."""
        entries = self._in_memory.get(job, {})
        cur = entries.get(step)
        if cur is not None and cur.tier is Tier.MEMORY:
            del entries[step]
            if not entries:
                del self._in_memory[job]

    def prune(self, held: set[tuple[str, int]]) -> None:
        """Housekeeping: forget the disk steps no slot holds a shard of any more (their slots were reused: no hot
        restore can read them), so that a daemon serving many jobs does not keep every job's last manifest."""
        for job in list(self._in_memory):
            entries = self._in_memory[job]
            for s in [s for s, e in entries.items() if e.tier is Tier.DISK and (job, s) not in held]:
                del entries[s]
            if not entries:
                del self._in_memory[job]

    def in_memory(self, job: str) -> InMemory | None:
        """The job's newest step completed or sealed here, by commit order."""
        return max(self.in_memory_all(job), key=lambda e: (commit_time(e.manifest), e.step), default=None)

    def in_memory_all(self, job: str) -> list[InMemory]:
        return list(self._in_memory.get(job, {}).values())

    def in_memory_steps(self) -> dict[str, int]:
        return {job: m.step for job in self._in_memory if (m := self.in_memory(job)) is not None}

    def note_uploaded(self, job: str, step: int) -> None:
        self._uploaded[job] = max(step, self._uploaded.get(job, -1))

    def uploaded(self) -> dict[str, int]:
        return dict(self._uploaded)


class CommitClock:
    """Each job's commit clock (main thread): the ``committed_at`` stamp of its commits, the order ``latest`` follows."""

    def __init__(self, catalog: StepCatalog, pool: Iterable[Slot]) -> None:
        self._catalog, self._pool = catalog, pool
        self._last: dict[str, int] = {}

    def stamp(self, job: str, after: int = 0) -> int:
        """Nanoseconds since the epoch, strictly increasing per job in this run (up to 2^63-1; a clock stepped back
        must not make a later commit look older), and later than ``after`` (the step the client restored
        and the old step a rolled-back run's re-save replaces, which another node's clock may have stamped,
        one that ran ahead and has left the job since)."""
        if job not in self._last:  # after a restart: later than every step on disk or adopted, whatever the clock says
            times = [sl.record.committed_at for sl in self._pool if sl.record is not None and sl.record.job == job]
            self._last[job] = max([committed_at(p) for p in [self._catalog.latest(job)[1]] if p is not None] + times, default=0)
        t = min(max(time.time_ns(), self._last[job] + 1, after + 1), I64_MAX)  # a stamp readers accept
        self._last[job] = t
        return t
