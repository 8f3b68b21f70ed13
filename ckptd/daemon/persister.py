"""The persist threads: write a committed slot's shard durably, and complete its step when every
rank's fragment is on disk (then apply local retention).

The main thread calls :meth:`Persister.submit` for each committed slot; a worker thread writes it
(:func:`ckptd.storage.local.write_shard`), decides under the job's lock whether the step is now
complete (one node) or this node's part of it is (multi-node: then the upload thread completes it in
the bucket), and posts a :class:`~ckptd.daemon.events.ShardPersisted`. Completion is read off storage
(every rank's fragment present), never off the trainers' process groups. Workers run at lowered CPU
and I/O priority: on a busy node the trainer's step time matters more.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import shm
from ..config import MAX_TREE_DEPTH
from ..errors import DiskFull, FormatError, ProtocolError
from ..layout import MANIFEST, fragments_present, tmp_dir
from ..protocol import CommitRecord
from ..storage import local
from ..storage.retention import AnyOf, KeepLatest, Protect, RetentionPolicy
from ..validate import load_json, nesting_depth
from .events import EventQueue, ShardPersisted
from .slots import Slot

log = logging.getLogger("ckptd.daemon")


IO_LEVEL = 7  # the persist and upload threads' best-effort I/O level: the lowest


def lower_priority(nice: int, idle: bool) -> Callable[[], None]:
    """A thread initializer that makes the calling thread yield CPU (``nice``, ``SCHED_IDLE`` when
    ``idle``) and disk (the lowest best-effort I/O level) to training. Linux: priorities are per thread,
    and threads it starts (a shard's writers) inherit them."""

    def init() -> None:
        tid = threading.get_native_id()
        try:
            if nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            if idle:
                # only CPU time that nothing else on the node wants; disk time behind the trainer's own I/O (best
                # effort, level 4 by default) but never starved: shards are written direct by these threads, and
                # the idle I/O class waits for an idle disk under BFQ and mq-deadline (a trainer reading its data
                # from the same disk would hold every persist back, and with it the slots)
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                import psutil

                psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, IO_LEVEL)
        except (OSError, AttributeError, ImportError) as e:
            log.warning("cannot lower the priority of %s: %s", threading.current_thread().name, e)

    return init


def parse_tree(raw: bytes) -> dict[str, Any]:
    """A commit's tree, parsed from the raw frame the trainer sent (or the commit record kept)."""
    try:
        tree = load_json(raw, "the committed tree")
    except FormatError as e:
        raise ProtocolError(str(e)) from None
    if nesting_depth(tree, MAX_TREE_DEPTH) > MAX_TREE_DEPTH:
        raise ProtocolError(f"the committed tree nests deeper than {MAX_TREE_DEPTH} levels")
    if not isinstance(tree, dict):
        raise ProtocolError("the committed tree is not a JSON object")
    return tree


def _shard_write(rec: CommitRecord, source: int) -> local.ShardWrite:
    """The shard a commit record describes (its tree parsed), staged in the segment open as ``source``: what a persist
    thread hands :func:`ckptd.storage.local.write_shard`, built once for every attempt at writing it."""
    return local.ShardWrite(
        rec.job,
        rec.step,
        rec.rank,
        rec.world_size,
        source,
        rec.nbytes,
        parse_tree(rec.tree),
        local_world_size=rec.local_world_size,
        replicas=rec.replicas,
        committed_at=rec.committed_at,
        run=rec.run,
        after=rec.after,
    )


def _own_manifest(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST), "rb") as f:
        return json.loads(f.read())


@dataclass(frozen=True)
class PersistOptions:
    """How the persist threads work: ``workers`` threads; ``keep`` complete local steps kept per job, besides those
    retention protects; ``policy``: the write rate limit and O_DIRECT (:class:`ckptd.storage.local.WritePolicy`);
    ``uploads``: steps go to a bucket, so a step completed here is kept from retention until the loop has queued its
    upload (:meth:`Persister.reported`)."""

    workers: int = 1
    keep: int = 0
    policy: local.WritePolicy = local.WritePolicy()
    uploads: bool = False


class Persister:
    def __init__(
        self,
        root: str,
        events: EventQueue,
        options: PersistOptions,
        *,
        protect: Callable[[str], RetentionPolicy] = lambda job: Protect(frozenset()),
        initializer: Callable[[], None] | None = None,
        open_segment: Callable[[str], int] | None = None,
    ) -> None:
        """``protect(job)``: what retention keeps besides ``options.keep`` (not uploaded yet, named...); ``initializer``:
        run on each persist thread first; ``open_segment``: a read-only fd of a segment, checked to be the daemon's own."""
        self.root, self._events, self._open_segment = root, events, open_segment
        self.keep, self._protect = options.keep, protect
        self.write_policy = options.policy
        self._pool = ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix="ckptd-persist", initializer=initializer)
        self._writing: dict[tuple[str, int], int] = {}  # (job, step) -> its shards being written or queued (job's lock)
        # job -> steps completed here whose event the loop has not handled yet (job's lock): retention keeps them, since
        # until then no upload of theirs is queued, and another thread's retention would otherwise remove one unsent
        self._unreported: dict[str, set[int]] = {}
        self._uploads = options.uploads

    def job_lock(self, job: str) -> threading.RLock:
        """Serializes completing and pruning a job's steps and moving its ``latest`` across persist,
        upload and fetch threads (:func:`ckptd.storage.local.job_lock`)."""
        return local.job_lock(self.root, job)

    def submit(self, slot: Slot, attempt: int) -> None:
        """Main thread: persist this committed slot, of the step's ``attempt`` (its event names it). It is the
        worker's until its event is handled. Counted as being written from now (:meth:`writing`), queued or not:
        until it is written whole, its step's directory is neither finalized nor handed over."""
        rec = slot.committed()
        with self.job_lock(rec.job):
            self._writing[(rec.job, rec.step)] = self._writing.get((rec.job, rec.step), 0) + 1
        try:
            self._pool.submit(self._run, slot, rec, attempt)
        except BaseException:
            self._written(rec.job, rec.step)
            raise

    def retain(self, job: str) -> None:
        """Keep the newest ``keep`` local steps and those ``protect`` keeps (still to be uploaded, read by a
        restore, named by a user). Any thread: the protected steps are asked under the job's lock, where a fetch holds a
        step; the doomed steps are deleted outside it (the loop takes it to count a shard: it must not wait for an rmtree)."""
        unsent = lambda: Protect(frozenset(self._unreported.get(job, ())))  # noqa: E731
        removed = local.apply_retention(self.root, job, lambda: AnyOf((KeepLatest(self.keep), self._protect(job), unsent())))
        if removed:
            log.info("retention: removed steps %s of job %s", removed, job)

    def shutdown(self) -> None:
        """Finish every submitted shard, then stop the threads."""
        self._pool.shutdown(wait=True)

    def _run(self, slot: Slot, rec: CommitRecord, attempt: int) -> None:
        job, step, rank, ws, lws = rec.job, rec.step, rec.rank, rec.world_size, rec.local_world_size
        wrote = False
        try:
            t0 = time.monotonic()
            # read with pread, never mapped: the lessee can still truncate its segment, and a mapping's read past the
            # end would kill the daemon (SIGBUS); a short read fails this shard alone
            fd = self._open_segment(slot.name) if self._open_segment is not None else os.open(shm.path_of(slot.name), os.O_RDONLY)
            try:
                shard = _shard_write(rec, fd)
                try:
                    local.write_shard(self.root, shard, self.write_policy)
                except DiskFull:
                    if not self._make_room(job, step):
                        raise
                    local.write_shard(self.root, shard, self.write_policy)
            finally:
                os.close(fd)
            seconds, wrote = time.monotonic() - t0, True
            path, manifest, node = self._after_write(job, step, ws, lws)
            ranks = sorted(fragments_present(self.root, job, step, node)) if node else None
            event = ShardPersisted(slot.name, job, step, rank, rec.nbytes, seconds, None, path, manifest, ranks, attempt, node)
        except Exception as e:  # reported to every waiter of the step, never swallowed
            if not wrote:
                self._written(job, step)
            log.error("persisting %s (job %s step %s rank %s) failed: %s", slot.name, job, step, rank, e)
            event = ShardPersisted(slot.name, job, step, rank, 0, 0.0, f"{e}", attempt=attempt)
        self._events.post(event)

    def _make_room(self, job: str, step: int) -> bool:
        """A shard of ``step`` did not fit: remove now the steps its completion would remove (all but the newest
        ``keep - 1``, less what ``protect`` keeps, never the one ``latest`` names), so a disk sized for ``keep`` steps
        keeps saving. Whether any was removed (then the shard is written again)."""
        if self.keep < 2:  # keep 1: only latest's step would go, which stays until this one completes; keep 0: all stay
            return False
        unsent = lambda: Protect(frozenset(self._unreported.get(job, ())))  # noqa: E731
        removed = local.apply_retention(self.root, job, lambda: AnyOf((KeepLatest(self.keep - 1), self._protect(job), unsent())))
        if removed:
            log.warning("job %s step %s did not fit on disk: removed steps %s now, as its completion would have", job, step, removed)
        return bool(removed)

    def reported(self, job: str, step: int) -> None:
        """Main thread: the completion of ``step`` was handled (its upload queued): retention judges it as any step."""
        with self.job_lock(job):
            left = self._unreported.get(job, set())
            left.discard(step)
            if not left:
                self._unreported.pop(job, None)

    def writing(self, job: str, step: int) -> int:
        """Any thread: how many shards of ``step`` are being written into its ``step-N.tmp``, or queued to be."""
        with self.job_lock(job):
            return self._writing.get((job, step), 0)

    def _written(self, job: str, step: int) -> int:
        """One shard of the step is no longer being written; how many still are. Under (or takes) the job's lock."""
        with self.job_lock(job):
            left = self._writing.pop((job, step), 1) - 1
            if left:
                self._writing[(job, step)] = left
            return left

    def _after_write(self, job: str, step: int, ws: int, lws: int) -> tuple[str | None, dict[str, Any] | None, str | None]:
        """Under the job's lock: complete the step if every rank's fragment is here (returns its directory and
        manifest), or, multi-node, move this node's whole part into a directory of its own for the uploader (returns
        that directory: a relaunch's new attempt at the number never writes where the upload reads). Neither while
        another shard of the step is still being written or queued: a fragment is visible before its writer has synced
        the directory, which must not move under it (the thread of the last shard completes the step)."""
        with self.job_lock(job):
            if self._written(job, step):
                return None, None, None
            present = fragments_present(self.root, job, step)
            if lws < ws:
                # multi-node: this node's part is durable; the upload thread completes it in the bucket
                return None, None, local.hand_over(self.root, job, step) if len(present) == lws else None
            if not (present >= set(range(ws)) and os.path.isdir(tmp_dir(self.root, job, step))):
                return None, None, None
            path = local.finalize_step(self.root, job, step, ws)
            # kept in memory for hot restores (they read no disk): the manifest just written under the
            # daemon's own root, so parsed, not validated again (~0.2 s per 10,000 tensors); read here,
            # under the lock, before retention (this call's or another thread's) may remove the step
            manifest = _own_manifest(path)
            if self._uploads:  # until the loop handles this call's event (reported()), which queues its upload
                self._unreported.setdefault(job, set()).add(step)
        # here, off the main loop and outside the job's lock (deleting GBs takes a while), and before wait() is
        # answered; the step is complete whatever retention meets (its failure is logged: the event must go out)
        try:
            self.retain(job)
        except Exception as e:
            log.error("retention of job %s after step %s failed: %s", job, step, e)
        return path, manifest, None
