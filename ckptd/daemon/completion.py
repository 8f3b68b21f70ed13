"""Step completion: drives a step from its ranks' commits to durable or failed, in one place.

A committed slot goes to the persist threads (:meth:`Completion.persist`); each written shard comes
back as a :class:`~ckptd.daemon.events.ShardPersisted`. The shard that completes the step locally
makes it durable; on a multi-node step this node's durable part goes to the uploader, and the step is
durable once the bucket completes it (:class:`~ckptd.daemon.events.Uploaded`). A durable step is
noted in the catalog (the newest one hot restores read), queued for upload, and fails the older
steps some rank never committed; a failed step's partial directory is removed once no shard of it is
being written; waiters are answered once the step leaves pending.

Main thread only, except :meth:`Completion.uploaded`, which the upload thread calls.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..storage import local
from .books import Books
from .events import ShardPersisted, Uploaded
from .persister import Persister
from .slots import Slot
from .steps import StepKey, StepState, StepTrack
from .uploader import Uploader

if TYPE_CHECKING:
    from .memtier import MemoryTier
    from .slots import SlotPool

log = logging.getLogger("ckptd.daemon")


class Completion:
    def __init__(
        self, books: Books, persister: Persister, uploader: Uploader | None, pool: SlotPool, memory: MemoryTier | None = None,
        replicate: Callable[[str, int], None] = lambda job, step: None,
    ) -> None:  # fmt: skip
        """``books``: the root, steps, catalog, counters, events and replies it shares (:class:`.books.Books`);
        ``memory``: the memory tier (memory-only steps superseded by a durable one are dropped; None: no memory tier);
        ``replicate(job, step)``: a step complete here goes to the peers (:mod:`.replicator`)."""
        self.root, self.steps, self.catalog, self.persister, self.uploader = books.root, books.steps, books.catalog, persister, uploader
        self.counters, self._events, self._answer, self.pool = books.counters, books.events, books.answer, pool
        self.memory, self._replicate = memory, replicate

    def persist(self, slot: Slot) -> None:
        """A committed slot (just committed, or adopted at start-up) goes to a persist thread."""
        rec = slot.committed()
        track = self.steps.shard_started((rec.job, rec.step))  # (a committed slot's step is tracked)
        self.persister.submit(slot, track.attempt)

    def on_persisted(self, ev: ShardPersisted) -> None:
        """A persist thread is done with a shard: its slot is freed (remembering the shard for hot restores),
        or, for a step persisted from the memory tier, held until the step is durable; then the step moves on."""
        try:
            self._on_persisted(ev)
        finally:
            if ev.path is not None:  # its upload is queued now (:meth:`.Persister.reported`)
                self.persister.reported(ev.job, ev.step)

    def _on_persisted(self, ev: ShardPersisted) -> None:
        key = (ev.job, ev.step)
        track = self.steps.get(key)
        slot = self.pool.get(ev.segment)
        if track is not None and track.attempt != ev.attempt:
            # an earlier attempt's shard (its step was replaced by a rolled-back run between the write and now):
            # the bytes went with the old step, and nothing of it counts toward the new attempt
            if slot is not None:
                self.pool.persisted(slot, None)
            if ev.node_dir is not None:
                _remove(ev.node_dir)
            log.info("job %s step %s: a shard of a replaced attempt of it was written; ignored", ev.job, ev.step)
            return
        from_memory = track is not None and track.from_memory and track.state is StepState.PENDING
        if slot is not None and from_memory:
            self.pool.holdings.hold(slot, (ev.job, ev.step, ev.rank))  # its bytes stay the step's only sure copy
        elif slot is not None:
            self.pool.persisted(slot, (ev.job, ev.step, ev.rank) if ev.error is None else None)
        if track is None:
            return
        self.steps.shard_done(track)
        self.counters.persisted_bytes += ev.nbytes
        self.counters.persist_seconds += ev.seconds
        if ev.error is not None and from_memory:
            track.persist_error = track.persist_error or ev.error
            self.counters.error(f"job {ev.job} step {ev.step}: {ev.error} (kept in memory)")
        elif ev.error is not None and self.steps.fail(key, ev.error):
            self.counters.error(f"job {ev.job} step {ev.step}: {ev.error}")
        if ev.node_dir is not None and self.uploader is not None:
            if track.state is StepState.PENDING:
                self.uploader.submit(ev.job, ev.step, track.world_size, ev.node_ranks, node=ev.node_dir, attempt=track.attempt)
            else:  # failed meanwhile (a rank's shard could not be written): its part never goes up
                _remove(ev.node_dir)
        if ev.path is not None:
            self.steps.complete(key, ev.path)
            if self.memory is not None:
                self.memory.forget(key)  # fragments of seals that failed or came too late (the shard was persisted first)
            self.catalog.note_complete(ev.job, ev.step, ev.path, ev.manifest)
            if self.uploader is not None:
                self.uploader.submit(ev.job, ev.step, track.world_size)
            self.counters.steps_committed += 1
            log.info("committed job %s step %s -> %s", ev.job, ev.step, ev.path)
            if track.from_memory:  # durable now: its held slots are free (and still serve hot restores)
                for held in self.pool.holdings.memory_only(*key):
                    self.pool.persisted(held, held.holds)
            self.after_complete(ev.job, ev.step)
        elif track.persist_error is not None and track.inflight == 0 and track.state is StepState.PENDING:
            self._back_to_memory(key)
        self.settle(key, track)
        if track.state is not StepState.PENDING and self.memory is not None:
            self.memory.disk_free(ev.job)  # a step owed to disk may go now

    def _back_to_memory(self, key: StepKey) -> None:
        """Persisting a step from memory failed (a full disk): its partial files go, the step stays in memory
        (restorable on this node as before), and whoever waited for it on disk hears why."""
        local.remove_partial(self.root, *key)
        log.error("job %s step %s: persisting it from memory failed; it stays in memory", *key)
        self._answer(self.steps.back_to_memory(key, time.monotonic()))
        if self.memory is not None:
            self.memory.returned(key)
        self.pool.retry_deferred()  # its slots are held again, no longer being persisted: a waiting alloc may reclaim

    def uploaded(self, res: Uploaded) -> None:
        """Upload thread: a step's upload ended. Local steps it protected may go now."""
        if res.error is None and not res.multi_node:
            self.persister.retain(res.job)  # takes the job's lock to choose, not to delete
        self._events.post(res)

    def on_uploaded(self, res: Uploaded) -> None:
        key = (res.job, res.step)
        track = self.steps.get(key)
        if res.multi_node and (res.given_up or track is None or track.attempt != res.attempt):
            # an attempt a relaunch took over (Admission abandoned its step then): no error of the job's
            log.info("job %s step %s: the upload of an abandoned attempt ended: %s", res.job, res.step, res.error or "complete")
            return
        self.counters.uploaded_bytes += res.nbytes
        self.counters.upload_seconds += res.seconds
        if res.retention_error is not None:
            self.counters.error(f"bucket retention of job {res.job} after step {res.step}: {res.retention_error}")
        if res.error is not None:
            self.counters.error(f"upload of job {res.job} step {res.step}: {res.error}")
        elif res.complete:
            self.counters.steps_uploaded += 1
            self.catalog.note_uploaded(res.job, res.step)
            log.info("uploaded job %s step %s -> %s (%.2f GB in %.1f s)", res.job, res.step, res.url, res.nbytes / 1e9, res.seconds)
        if not res.multi_node:
            return
        # a multi-node step is durable once it is complete in the bucket
        if track is None or track.state is not StepState.PENDING:
            return
        if res.error is not None:  # abandoned: a relaunch may save the step afresh (its nodes never completed it)
            self.steps.abandon(key, res.error)
        else:
            self.steps.complete(key, res.url)
            self.counters.steps_committed += 1
            log.info("committed job %s step %s across nodes -> %s", res.job, res.step, res.url)
            self.after_complete(res.job, res.step)
        self.settle(key, track)

    def settle(self, key: StepKey, track: StepTrack) -> None:
        """After a step's state may have changed: clean up a failed step once no shard of it is being
        written, and answer its waiters once it left pending."""
        if track.state is StepState.FAILED:
            self.catalog.forget_memory(*key)  # sealed, then failed to persist: no hot restore reads it, from now
        if track.state is StepState.FAILED and not self.persister.writing(*key):
            local.remove_partial(self.root, *key)  # before waiters hear of it (a seal still out writes nothing there)
        if track.state is StepState.FAILED and track.inflight == 0:
            if self.pool.holdings.drop(*key):  # ranks of it that were sealed into the memory tier
                self.pool.retry_deferred()
            if self.memory is not None:
                self.memory.forget(key)
        if track.state is not StepState.PENDING:
            self._answer(self.steps.answered(key))

    def after_complete(self, job: str, step: int) -> None:
        """Step ``step`` of ``job`` is complete (on disk, or in memory only): older steps that can no longer
        complete fail, memory-only steps committed before it are dropped."""
        for key, track in self.steps.supersede(job, step):
            self.settle(key, track)
        if self.memory is not None:
            self.memory.completed(job, step, self.steps.tracks[(job, step)])
        self._replicate(job, step)
        self.steps.forget_finished(job)


def _remove(path: str) -> None:
    """Delete a directory of shards (GBs) on a thread of its own, never on the daemon's loop."""
    threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True}, name="ckptd-remove", daemon=True).start()
