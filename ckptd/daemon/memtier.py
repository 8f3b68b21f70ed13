"""The memory tier: steps held in the daemon's shared memory only, and how they leave it.

A step the tiering policy (:mod:`.tiering`) keeps in memory is *sealed* instead of persisted: the seal
thread reads each rank's shard header (not its data: no checksums, a few milliseconds), and once
every rank's is read the step's manifest is built in memory, checked for coverage like any other, and
the step is complete in memory (:attr:`~.steps.StepState.MEMORY`): its slots are *held*, a hot restore
on this node reads it (:meth:`MemoryTier.hot_open`), ``status`` and ``ls`` name it.

A memory-only step leaves the tier in one of two ways:

* **dropped** — when a step of its job committed later completes (in memory or on disk), or when a
  snapshot of its job needs its slots and shared memory is full (``lagging = "memory"``; under
  ``"wait"`` only when nothing is being persisted that would free memory; the oldest first, never the
  newest while an older one is pinned by a reader: the snapshot waits instead). Its slots are reused; a
  ``wait`` for it then fails saying why. Counted in ``memory_steps_dropped``.
* **persisted** (promoted) — its held slots go to the persist threads like any committed slot, when
  the disk is free and the job owes a persisted step, when a ``wait`` or a restore that may not read
  shared memory asks for it, when every process of the run that committed it is gone (a trainer that
  crashed, or finished, leaves a durable checkpoint), and at the daemon's shutdown. A daemon that
  crashes persists it on restart (held slots keep their commit records). Its slots stay held until it
  is durable: if persisting fails (a full disk) it is a memory-only step again (``Completion``; a gone
  run's step is retried after :data:`PERSIST_RETRY_S`).

Main thread only (the daemon's loop), except :meth:`MemoryTier._seal` on the seal thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from ..format import ShardOf, attempt_of, build_fragment, build_manifest, commit_time, parse_header
from ..layout import attempt_folder, shard_name
from ..protocol import CommitRecord, encode
from ..storage import local
from ..storage.local import committed_at
from .books import Books
from .events import MeshComplete, ShardSealed
from .mesh import NodePart
from .persister import parse_tree
from .slots import Slot, SlotPool, SlotState
from .steps import StepKey, StepState, StepTrack
from .tiering import Tier, Tiering

log = logging.getLogger("ckptd.daemon")

DEATH_CHECK_S = 2.0  # how often the runs holding memory-only steps are checked for being gone
PERSIST_RETRY_S = 60.0  # a gone run's step that failed to persist (a full disk) is tried again after this,
PERSIST_RETRY_MAX_S = 3600.0  # doubled after each failure, up to this
MESH_GRACE_S = 120.0  # a step that spans nodes, sealed here, whose run ended: the other nodes' fragments may come this long


@dataclass(frozen=True)
class TierHooks:
    """What the memory tier calls in components made after it (the daemon passes calls through itself).

    ``persist(slot)``: hand a committed slot to the persist threads; ``settle(key, track)``: answer a step's waiters
    and clean up after its state changed; ``after_complete(job, step)``: what follows a step's completion (it calls
    :meth:`MemoryTier.completed`); ``run_gone(job)``: every process that committed the job's steps in its current run
    is gone; ``protected(job, step)``: a name keeps the step (:mod:`.protected`); ``publish(part)``: this node's part of
    a step that spans nodes, sealed, goes to the job's daemons (:meth:`.mesh.Mesh.publish`).
    """

    persist: Callable[[Slot], None]
    settle: Callable[[StepKey, StepTrack], None]
    after_complete: Callable[[str, int], None]
    run_gone: Callable[[str], bool]
    protected: Callable[[str, int], bool] = lambda job, step: False
    publish: Callable[[NodePart], None] = lambda part: None


class MemoryTier:
    def __init__(self, books: Books, pool: SlotPool, tiering: Tiering, hooks: TierHooks) -> None:
        """``books``: the steps, catalog, counters, events and replies it shares (:class:`.books.Books`); ``hooks``: its
        calls into completion, admission and protections. The slot pool asks it for room (:meth:`reclaim`,
        :meth:`sealing`): the daemon passes those to the pool."""
        self.steps, self.pool, self.catalog, self.tiering, self.counters = books.steps, pool, books.catalog, tiering, books.counters
        self._events, self._persist, self._settle, self._run_gone = books.events, hooks.persist, hooks.settle, hooks.run_gone
        self._after_complete, self._answer, self._publish = hooks.after_complete, books.answer, hooks.publish
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="ckptd-seal")
        self._lock = threading.Lock()
        # seal thread: fragments of steps being sealed, per attempt (job, step, attempt)
        self._frags: dict[tuple[str, int, int], dict[int, dict[str, Any]]] = {}
        self._last_check = 0.0
        self.protected = hooks.protected

    # ------------------------------------------------------------------ committing

    def decide(self, job: str, step: int, track: StepTrack, multi_node: bool, mesh: bool = False, bucket: bool = False) -> None:
        """A step's first commit: its tier (a crash-recovered step is always persisted, and so is a number a name
        protects: a rolled-back run's re-save of it replaces the old step on disk, :mod:`.protected`). ``mesh``: a step
        that spans nodes may complete in the memory of the job's daemons (:mod:`.mesh`), where it is never persisted;
        with a ``bucket`` (or shared directory) too, the numbers :meth:`.tiering.Tiering.persists_across` names go there."""
        across = bucket and (track.recovered or self.protected(job, step) or self.tiering.persists_across(job, step))
        if not track.committed and mesh and not across:
            track.tier, track.mesh = Tier.MEMORY.value, True
        elif not track.committed:
            always = multi_node or track.recovered or self.protected(job, step)
            tier = self.tiering.decide(job, disk_busy=self.steps.disk_busy(job), multi_node=always)
            track.tier = tier.value

    def seal(self, slot: Slot) -> None:
        """A committed slot goes to the seal thread (a memory-tier step's, or one being persisted: sealed so
        that a hot restore reads it at once)."""
        rec = slot.committed()
        track = self.steps.shard_started((rec.job, rec.step))  # (a committed slot's step is tracked)
        self._exec.submit(self._seal, slot.name, rec, track.attempt, track.mesh)

    def _seal(self, name: str, rec: CommitRecord, attempt: int, mesh: bool = False) -> None:
        """``mesh``: this node's part of a step that spans nodes: its fragments carry their checksums (other nodes
        verify what they are sent, and a restore what it reads), and it is sealed once this node's ranks are."""
        job, step, rank, ws = rec.job, rec.step, rec.rank, rec.world_size
        key = (job, step, attempt)
        try:
            frag = self._fragment(name, rec, mesh)
            manifest, part = None, None
            with self._lock:
                got = self._frags.setdefault(key, {})
                got[rank] = frag
                if len(got) == (rec.local_world_size if mesh else ws):
                    del self._frags[key]
                    if mesh:
                        part = dict(got)
                    else:
                        manifest = build_manifest(job, step, ws, list(got.values()))
            event = ShardSealed(name, job, step, rank, None, manifest, attempt, part)
        except Exception as e:  # reported to the step's waiters, never swallowed
            log.error("sealing %s (job %s step %s rank %s) failed: %s", name, job, step, rank, e)
            event = ShardSealed(name, job, step, rank, f"{e}", None, attempt)
        self._events.post(event)

    def _fragment(self, name: str, rec: CommitRecord, digests: bool) -> dict[str, Any]:
        """The fragment of the shard staged in segment ``name``: from its header alone, or (``digests``) from all of it."""
        fd = self.pool.segments.open_owned(name)
        try:
            head = local.read_header(fd, rec.nbytes)
            layout = parse_header(head, rec.nbytes)
            if layout.file_size != rec.nbytes:
                raise FormatError(f"staged shard is {rec.nbytes} bytes but its header describes {layout.file_size}")
            of = ShardOf(
                job=rec.job, step=rec.step, rank=rec.rank, world_size=rec.world_size, local_world_size=rec.local_world_size,
                replicas=rec.replicas, tree=parse_tree(rec.tree), committed_at=rec.committed_at, run=rec.run, after=rec.after,
            )  # fmt: skip
            if not digests:
                return build_fragment(of, head, layout, digests=False)
            with mmap.mmap(fd, rec.nbytes, prot=mmap.PROT_READ) as mm:
                view = memoryview(mm)
                try:
                    return build_fragment(of, view, layout)
                finally:
                    view.release()
        finally:
            os.close(fd)

    def on_sealed(self, ev: ShardSealed) -> None:
        key = (ev.job, ev.step)
        track, slot = self.steps.get(key), self.pool.get(ev.segment)
        if track is None or track.attempt != ev.attempt:  # an earlier attempt's, replaced since: nothing of this one
            self._forget_attempt(ev.job, ev.step, ev.attempt)
            if self.pool.deferred:  # a request that waited for this seal (sealing()) asks again
                self.pool.retry_deferred()
            return
        self.steps.shard_done(track)
        if track.tier == Tier.DISK.value:
            self._sealed_on_the_way_to_disk(key, track, slot, ev)
            return
        if ev.error is not None:
            self.steps.fail(key, ev.error)
            self.counters.error(f"job {ev.job} step {ev.step}: {ev.error}")
        if slot is None or track.state is not StepState.PENDING:  # failed: now, or abandoned while it was sealed
            if slot is not None:
                self.pool.persisted(slot, None)
            self.forget(key)  # the other ranks' held slots are freed by settle
            self._settle(key, track)
            return
        self.pool.holdings.hold(slot, (ev.job, ev.step, ev.rank))
        if ev.node_part is not None:
            self._node_sealed(key, track, ev.node_part)
        if ev.manifest is None:
            if self.pool.deferred:  # a request held back while this slot was committed may be served now
                self.pool.retry_deferred()
            return
        if not track.all_committed or {r["rank"] for r in ev.manifest["ranks"]} != track.committed:
            self.steps.fail(key, "the sealed shards are not those of the ranks that committed (a stale attempt's)")
            self._settle(key, track)
            return
        self.steps.sealed(key)
        if track.replaces:  # a rolled-back run's re-save, complete in memory: the old line's step goes now
            local.retire_step(self.catalog.root, ev.job, ev.step, track.replaces_at)
        self.catalog.note_memory(ev.job, ev.step, ev.manifest)
        self.counters.memory_steps += 1
        # persisted first if someone asked: completing it may retry a deferred alloc that would drop it
        if track.promote or (self.tiering.owed(ev.job) and not self.steps.disk_busy(ev.job)):
            self.promote(key)
        self._after_complete(ev.job, ev.step)
        self._answer(self.steps.answered_sealed(key))
        self._settle(key, track)

    def _node_sealed(self, key: StepKey, track: StepTrack, frags: dict[int, dict[str, Any]]) -> None:
        """This node's ranks of a step that spans nodes are sealed: their part goes to the job's daemons, and the step
        completes once every rank's fragment is in this daemon's replica store (:meth:`completed_across`)."""
        held = self.pool.holdings.of(*key)
        if set(frags) != track.committed or set(held) != set(frags):
            self.steps.fail(key, "the sealed shards are not those of the ranks that committed (a stale attempt's)")
            self._settle(key, track)
            return
        attempts = {attempt_of(f) for f in frags.values()}
        run, after = attempts.pop() if len(attempts) == 1 and None not in attempts else (None, None)
        if run is None:
            self.steps.fail(key, "the sealed shards name different attempts")
            self._settle(key, track)
            return
        track.mesh_folder, track.mesh_sealed_at = attempt_folder(run, after), time.monotonic()
        marks = [(slot, slot.holds) for slot in held.values()]  # a slot reused since no longer holds this shard
        self._publish(NodePart(
            key[0], key[1], track.mesh_folder, {r: (held[r].name, f["size"]) for r, f in frags.items()},
            {r: encode(f) for r, f in frags.items()}, unchanged=lambda: all(s.holds == h for s, h in marks),
        ))  # fmt: skip

    def completed_across(self, ev: MeshComplete) -> None:
        """A step that spans nodes is complete in the memory of the job's daemons (or, ``ev.error``, cannot be)."""
        key = (ev.job, ev.step)
        track = self.steps.get(key)
        if track is None or not track.mesh or track.state is not StepState.PENDING or track.mesh_folder != ev.folder:
            return  # another attempt's, or complete already (a late fragment), or this node's part never sealed
        if ev.error is not None or ev.manifest is None:
            if self.steps.fail(key, f"its ranks' fragments do not make a checkpoint: {ev.error}"):
                self.counters.error(f"job {ev.job} step {ev.step}: {ev.error}")
            self._settle(key, track)
            return
        self.steps.sealed(key)
        self.catalog.note_memory(ev.job, ev.step, ev.manifest)
        self.counters.memory_steps += 1
        self._after_complete(ev.job, ev.step)
        self._answer(self.steps.answered_sealed(key))
        self._settle(key, track)

    def _sealed_on_the_way_to_disk(self, key: StepKey, track: StepTrack, slot: Slot | None, ev: ShardSealed) -> None:
        """A step bound for disk is sealed too, so that a hot restore reads it before it is durable. A seal
        error is the persist threads' to report (they read the same header); a shard whose slot was freed
        meanwhile (persisted, and leased again) is simply not served from memory."""
        if ev.error is not None or track.state is not StepState.PENDING:
            self.forget(key)
            self._settle(key, track)  # a step that failed while this seal was out: its partial files go now
            return
        rec = slot.record if slot is not None and slot.state is SlotState.COMMITTED else None
        if slot is not None and rec is not None and (rec.job, rec.step, rec.rank) == (ev.job, ev.step, ev.rank):
            slot.holds = (ev.job, ev.step, ev.rank)
        if ev.manifest is not None:
            track.sealed = True
            self.catalog.note_memory(ev.job, ev.step, ev.manifest)
            self._answer(self.steps.answered_sealed(key))

    def forget(self, key: StepKey) -> None:
        """Drop the fragments sealed so far of a step that failed (some rank will never be sealed), of every attempt."""
        with self._lock:
            for k in [k for k in self._frags if k[:2] == key]:
                del self._frags[k]

    def _forget_attempt(self, job: str, step: int, attempt: int) -> None:
        with self._lock:
            self._frags.pop((job, step, attempt), None)

    # ------------------------------------------------------------------ leaving the tier

    def completed(self, job: str, step: int, track: StepTrack) -> None:
        """Step ``step`` of ``job`` is complete (in memory or on disk): the memory-only steps committed
        before it are dropped."""
        for s, t in self.steps.of_job(job, StepState.MEMORY):
            if s != step and (t.committed_at, s) < (track.committed_at, step):
                self.drop((job, s), f"dropped from memory: step {step}, committed later, is complete")
        self.pool.retry_deferred()

    def drop(self, key: StepKey, why: str) -> bool:
        """Drop memory-only step ``key`` unless a hot restore is reading it; True if dropped."""
        held = self.pool.holdings.of(*key)
        if any(s.pins for s in held.values()) or not self.steps.drop_memory(key, why):
            return False
        self.pool.holdings.drop(*key)
        self.catalog.forget_memory(*key)
        self.counters.memory_steps_dropped += 1
        log.info("job %s step %s %s", key[0], key[1], why)
        self._settle(key, self.steps.tracks[key])
        return True

    def reclaim(self, job: str, step: int | None) -> bool:
        """The slot pool is full for a snapshot of ``step``: drop ``job``'s oldest memory-only step to make room
        (under ``lagging = "wait"`` only when no slot is being persisted, which would free memory). The newest
        is dropped only when it is the only one: while an older one is being read (pinned), the snapshot
        waits for that reader rather than lose the newest state."""
        if self.tiering.policy_of(job).lagging == "wait" and any(s.state is SlotState.COMMITTED for s in self.pool):
            return False
        who = "a snapshot" if step is None else f"step {step}"
        held = [s for s, _ in self.steps.of_job(job, StepState.MEMORY) if s != step]
        for s in held[:-1] or held:
            if self.drop((job, s), f"dropped from memory: shared memory was full and {who} needed room"):
                return True
        return False

    def sealing(self, job: str, step: int | None) -> bool:
        """A memory-tier step of ``job`` (not ``step``) has every rank committed and is being sealed while an older
        memory-only step of the job exists, or is being sealed too (snapshots that outrun the seal thread): once
        sealed (milliseconds) it completes and that older step is dropped, its slots freed. A snapshot short of a
        slot waits for this rather than for a new segment."""
        pending = [(s, t) for s, t in self.steps.of_job(job, StepState.PENDING) if t.tier == Tier.MEMORY.value and t.all_committed]
        others = [t for _, t in self.steps.of_job(job, StepState.MEMORY)] + [t for _, t in pending]
        return any(
            s != step and t.inflight > 0 and any(o is not t and o.committed_at <= t.committed_at for o in others) for s, t in pending
        )

    def promote(self, key: StepKey) -> bool:
        """Persist memory-only step ``key`` after all; False if it is not one (any more)."""
        track = self.steps.get(key)
        if track is None or track.state is not StepState.MEMORY:
            return False
        held = self.pool.holdings.memory_only(*key)
        self.steps.to_disk(key)
        self.tiering.persisted(key[0])
        for slot in held:
            self.pool.holdings.release(slot)
            self._persist(slot)
        log.info("job %s step %s: persisting it from memory", *key)
        return True

    def want_durable(self, job: str, step: int | None) -> int | None:
        """Someone needs step ``step`` (``None``: the job's newest memory-only step) durable: persist it
        (at once, or once it is sealed). Returns the step, or ``None`` if no such step is in memory only."""
        if step is None:
            newest = self.steps.of_job(job, StepState.MEMORY)
            if not newest:
                return None
            step = newest[-1][0]
        track = self.steps.get((job, step))
        if track is None or track.tier != Tier.MEMORY.value or track.state not in (StepState.PENDING, StepState.MEMORY):
            return None
        if track.mesh:  # spans nodes, no bucket: there is nowhere to persist it that every node reads
            return None
        if track.state is StepState.PENDING:
            track.promote = True
        else:
            self.promote((job, step))
        return step

    def newest(self, job: str, step: int | None, persist: bool) -> int | None:
        """The ``promote`` op: the step a restore of ``step`` (``None``: the newest) should wait for before it
        reads: ``step`` or the job's newest step whose every rank committed, if it is still pending (sealed
        or persisted shortly) or held in memory only; ``None`` when the durable steps answer. ``persist``
        (the restore may not read shared memory): a memory-only one is persisted."""
        if step is None:
            mine = self.steps.of_job(job, StepState.PENDING) + self.steps.of_job(job, StepState.MEMORY)
            mine = sorted((t.committed_at, s) for s, t in mine if t.all_committed)
            if not mine or self._later_complete(job, *mine[-1]):
                return None  # a step committed later is complete already: it answers
            step = mine[-1][1]
        track = self.steps.get((job, step))
        if track is None or track.state not in (StepState.PENDING, StepState.MEMORY):
            return None
        return self.want_durable(job, step) or step if persist else step

    def _later_complete(self, job: str, first_commit: int, step: int) -> bool:
        """Another step of ``job``, committed after ``step``'s first commit, is complete (held in memory only, or
        durable on disk; a step only sealed on its way to disk is not, yet: its persist may fail). Ranks commit
        in order, so any other step committed since is a later one."""
        for held in self.catalog.in_memory_all(job):
            track = self.steps.get((job, held.step))
            done = track is None or track.state in (StepState.MEMORY, StepState.DURABLE)  # not pending, not failed
            if held.step != step and commit_time(held.manifest) > first_commit and done:
                return True
        latest, path = self.catalog.latest(job)
        return path is not None and latest != step and committed_at(path) > first_commit

    def returned(self, key: StepKey) -> None:
        """Persisting memory-only step ``key`` failed and it is memory-only again: dropped at once if a step of
        its job committed later is complete meanwhile (it would have been dropped then, had it been here)."""
        track = self.steps.get(key)
        if track is not None and track.state is StepState.MEMORY and self._later_complete(key[0], track.committed_at, key[1]):
            self.drop(key, f"dropped from memory: persisting it failed ({track.persist_error}) and a later step is complete")

    def keep_for_restart(self) -> None:
        """Shutdown, after the last persists: a job's newest memory-only step that could not be persisted keeps
        its slots and commit records (committed again), so that the next start persists it."""
        for job in self.steps.memory_steps():
            step, track = self.steps.of_job(job, StepState.MEMORY)[-1]  # the newest by commit order (a rollback saves lower numbers later)
            if track.persist_failures:
                for slot in self.pool.holdings.memory_only(job, step):
                    self.pool.holdings.release(slot)
                log.warning("job %s step %s could not be persisted: kept in shared memory for the next start", job, step)
        # a memory-tier step some ranks had committed and others not yet: its shards are the only copy, and the other
        # ranks commit to the next daemon (the step stays open for its launch): kept with their records, for it to adopt
        partial = {s.holds[:2] for s in self.pool if s.state is SlotState.HELD and s.holds is not None}
        for key in sorted(k for k in partial if (t := self.steps.get(k)) is not None and t.state is StepState.PENDING):
            for slot in self.pool.holdings.memory_only(*key):
                self.pool.holdings.release(slot)
            log.warning("job %s step %s: not every rank had committed it; its shards stay in shared memory for the next start", *key)

    def disk_free(self, job: str) -> None:
        """A persisted step of ``job`` left pending: persist its newest memory-only step if one is owed."""
        if self.tiering.owed(job) and not self.steps.disk_busy(job):
            self.want_durable(job, None)

    def housekeeping(self, now: float) -> None:
        """Persist the newest memory-only step of a job whose run is gone."""
        if now - self._last_check < DEATH_CHECK_S:
            return
        self._last_check = now
        jobs = {
            j for (j, _), t in self.steps.tracks.items() if t.tier == Tier.MEMORY.value and t.state in (StepState.PENDING, StepState.MEMORY)
        }
        for job in jobs:
            if not self._run_gone(job):
                continue
            for s, t in self.steps.of_job(job, StepState.PENDING):
                # a step that spans nodes whose other parts never came (their nodes' runs ended too) holds its slots
                stale = t.mesh and t.mesh_folder is not None and now - t.mesh_sealed_at > MESH_GRACE_S
                memory = t.tier == Tier.MEMORY.value and (not t.all_committed or stale)
                if memory and self.steps.abandon((job, s), "abandoned: its run ended"):
                    self._settle((job, s), t)  # its ranks that committed hold slots: freed
            newest = self.steps.of_job(job, StepState.MEMORY)
            last = newest[-1][1] if newest else None
            if last is not None and last.persist_failures:
                backoff = min(PERSIST_RETRY_MAX_S, PERSIST_RETRY_S * 2 ** (last.persist_failures - 1))
                if now - last.persist_failed_at < backoff:
                    continue  # it failed to persist lately: not again yet
            step = self.want_durable(job, None)
            if step is not None:
                log.info("job %s: its run is gone; persisting step %s from memory", job, step)

    def shutdown(self) -> None:
        """Let the seal thread finish (the caller drains its events, then calls :meth:`persist_all`)."""
        self._exec.shutdown(wait=True)

    def persist_all(self) -> None:
        """Shutdown: every job's newest memory-only step goes to disk (the others are dropped with the pool)."""
        for job in list(self.steps.memory_steps()):
            self.want_durable(job, None)

    # ------------------------------------------------------------------ hot restores

    def hot_open(self, job: str, want: int | None, pid: int, uid: int | None = None) -> dict[str, Any]:
        """The ``hot_open`` reply: the job's newest complete step (or ``want``) if this daemon holds every
        rank's shard of it in shared memory, pinned for the reader; else ``step`` null and a reason."""
        entry = self.catalog.in_memory(job)
        if entry is None:
            return {"step": None, "reason": f"this daemon holds no step of job {job!r} in memory (none completed since it started)"}
        if want is not None:  # any step held here: a memory-only one while a newer step is on its way to disk too
            entry = next((e for e in self.catalog.in_memory_all(job) if e.step == want), None)
            if entry is None:
                return {"step": None, "reason": f"the daemon does not hold step {want} of job {job!r} in memory"}
        latest, path = self.catalog.latest(job)
        if want is None and path is not None and latest != entry.step and committed_at(path) >= commit_time(entry.manifest):
            return {"step": None, "reason": f"step {entry.step} of job {job!r} is in memory, but the latest step is {latest}"}
        if entry.manifest is None or (entry.tier is Tier.DISK and not os.path.isdir(entry.path)):
            return {"step": None, "reason": f"step {entry.step} of job {job!r} is no longer on disk"}
        held = self.pool.holdings.of(job, entry.step)
        track = self.steps.get((job, entry.step))
        if track is not None and track.mesh:
            return {"step": None, "reason": f"step {entry.step} of job {job!r} spans nodes: it is read through the job's daemons"}
        missing = sorted(set(range(entry.manifest["world_size"])) - set(held))
        if missing:
            return {"step": None, "reason": f"the shards of ranks {missing[:8]} of step {entry.step} are no longer in memory"}
        pin = self.pool.holdings.pin(list(held.values()), pid, uid)
        segments = {shard_name(rank): slot.name for rank, slot in held.items()}
        return {
            "step": entry.step, "path": entry.path, "manifest": entry.manifest, "segments": segments, "pin": pin, "reason": None,
            "tier": entry.tier.value,
        }  # fmt: skip
