"""The upload thread: copies complete local steps to the bucket in the order they became durable, and
completes multi-node steps there (:mod:`ckptd.storage.remote` does the I/O).

The main thread calls :meth:`Uploader.submit` (a step completed locally, or this node's part of a
multi-node step is durable); the upload thread runs each upload, applies the bucket's retention, and
calls ``done`` (on the upload thread) with an :class:`~ckptd.daemon.events.Uploaded`. Persist threads
call :meth:`Uploader.pending` so local retention keeps what is not uploaded yet.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..files import fsync_dir
from ..format import Attempt, attempt_of, commit_time
from ..layout import GONE, MANIFEST, bucket_key, step_dir
from ..storage.local import committed_at as local_committed_at
from ..storage.local import read_fragment
from ..storage.remote import (
    Settled,
    apply_remote_retention,
    check_replaces,
    get_document,
    rank_files,
    step_url,
    try_complete,
    upload_ranks,
    upload_step,
)
from ..storage.retention import AnyOf, KeepEvery, KeepLatest, Protect, RetentionPolicy
from ..storage.store import ObjectStore, Progress
from .events import Uploaded

log = logging.getLogger("ckptd.daemon")
PROBE_EVERY = 8  # multi-node polls: every 8th (2 s) also asks by name for what a lagging listing misses


@dataclass
class Upload:
    job: str
    step: int
    world_size: int
    ranks: list[int] | None = None  # multi-node: this node's ranks; None: the whole local step
    catch_up: bool = False  # queued at start-up: skip it if the bucket already has the step
    node_dir: str = ""  # multi-node: this node's part (:func:`ckptd.layout.node_dir`), removed once done with
    attempt: int = 0  # multi-node: the step's attempt in the daemon (:meth:`Uploader.give_up` names it)
    bytes_total: int = 0
    bytes_done: int = 0
    started: float = 0.0


class Uploader:
    """One thread, one queue.

    When uploads fall behind, a queued step is skipped if a newer one of the same job is queued and
    it is not one the bucket keeps forever (``keep_every``, or a name protects it: :mod:`.protected`): the
    bucket wants the newest state, and skipping bounds the backlog. Multi-node steps are never skipped (other nodes wait for them).
    """

    POLL_S = 0.25

    def __init__(
        self,
        store: ObjectStore,
        root: str,
        done: Callable[[Uploaded], None],
        *,
        keep: int,
        keep_every: int,
        commit_timeout: float,
        initializer: Callable[[], None] | None = None,
        protected: Callable[[str], RetentionPolicy] = lambda job: Protect(frozenset()),
    ) -> None:
        """``done(result)``: an upload ended (the upload thread calls it); ``protected(job)``: the steps of ``job`` a
        name keeps (:mod:`.protected`; any thread)."""
        self.store, self.root, self.done = store, root, done
        self.every, self.latest = KeepEvery(keep_every), KeepLatest(keep)
        self.protected = protected
        self.commit_timeout = commit_timeout
        self.clock = time.monotonic  # tests move it
        self._partials: dict[
            tuple[str, int], tuple[frozenset[tuple[str, str]], float]
        ] = {}  # (job, step) -> its objects and tags, since when
        self._initializer = initializer
        self._queue: list[Upload] = []
        self._given_up: set[tuple[str, int, int]] = set()  # (job, step, attempt): a relaunch saves the number again
        self._cv = threading.Condition()
        self._closing = False
        self.current: Upload | None = None
        self._thread = threading.Thread(target=self._run, name="ckptd-upload", daemon=True)
        self._thread.start()

    def submit(
        self,
        job: str,
        step: int,
        world_size: int,
        ranks: list[int] | None = None,
        *,
        catch_up: bool = False,
        node: str = "",
        attempt: int = 0,
    ) -> None:
        """Queue a step's upload; multi-node: this node's ``ranks`` of attempt ``attempt``, in directory ``node``."""
        with self._cv:
            self._queue.append(Upload(job, step, world_size, ranks, catch_up=catch_up, node_dir=node, attempt=attempt))
            self._cv.notify()

    def give_up(self, job: str, step: int, attempt: int) -> None:
        """Any thread: stop uploading or waiting for attempt ``attempt`` of multi-node step ``step`` (a relaunch saves
        the number again; this attempt's other nodes are gone). Its part is renamed at once (:data:`~ckptd.layout.GONE`:
        a restart removes it, never uploads it again); its upload ends soon after, ``given_up``."""
        renamed = []
        with self._cv:
            for u in (self.current, *self._queue):
                if u is None or (u.job, u.step, u.attempt) != (job, step, attempt):
                    continue
                self._given_up.add((job, step, attempt))  # until its upload ends (none queued or running: nothing to stop)
                if u.node_dir and not u.node_dir.endswith(GONE):
                    try:
                        os.rename(u.node_dir, u.node_dir + GONE)
                    except OSError as e:  # still given up; a restart would upload it again
                        log.warning("could not rename %s, given up, to %s: %s", u.node_dir, GONE, e)
                        continue
                    u.node_dir += GONE
                    renamed.append(os.path.dirname(u.node_dir))
        for d in renamed:  # the rename made durable off the caller's thread (the daemon's loop), best effort
            threading.Thread(target=_sync, args=(d,), name="ckptd-sync", daemon=True).start()

    def _check(self, u: Upload) -> bool:
        """Raise if ``u``'s attempt was given up; else False."""
        with self._cv:
            if (u.job, u.step, u.attempt) in self._given_up:
                raise CheckpointError(_gave_up(u))
        return False

    def catch_up(self, job: str, steps: list[int]) -> None:
        """Start-up: a previous run may have stopped before uploading some of ``steps`` (complete local
        steps, ascending): queue the newest and those the bucket keeps forever; each is skipped if the
        bucket has it already."""
        for step in sorted(self.forever(job).keeps(steps[:-1])) + steps[-1:]:
            self.submit(job, step, 0, catch_up=True)  # world size: only multi-node uploads use it

    def forever(self, job: str) -> RetentionPolicy:
        """The steps of ``job`` the bucket keeps whatever their age: every ``keep_every``-th, those protected by name."""
        return AnyOf((self.every, self.protected(job)))

    def pending(self, job: str) -> set[int]:
        """Steps of ``job`` queued or uploading: local retention must leave them alone."""
        with self._cv:
            out = {u.step for u in self._queue if u.job == job}
            cur = self.current
        if cur is not None and cur.job == job:
            out.add(cur.step)
        return out

    def backlog(self) -> list[tuple[str, int]]:
        with self._cv:
            return [(u.job, u.step) for u in self._queue]

    def close(self, finish_queue: bool = True) -> None:
        """Finish the upload in progress and (``finish_queue``) the queue, then stop. A start that failed
        drops the queue: the next start's catch-up queues the same steps again."""
        with self._cv:
            if not finish_queue:
                self._queue.clear()
            self._closing = True
            self._cv.notify()
        self._thread.join()

    def _next(self) -> Upload | None:
        with self._cv:
            while not self._queue and not self._closing:
                self._cv.wait()
            while self._queue:
                u = self._queue.pop(0)
                # newer: committed later (a rolled-back run saves lower numbers later), by the local steps' manifests
                # (cached per manifest: retention has read each one already to order the job's steps)
                order = lambda q: (local_committed_at(step_dir(self.root, q.job, q.step)), q.step)  # noqa: E731
                mine = order(u) if u.ranks is None and any(q.job == u.job for q in self._queue) else None
                newer = mine is not None and any(q.job == u.job and order(q) > mine for q in self._queue)
                if u.ranks is None and newer and not self.forever(u.job).keeps([u.step]):
                    log.info("upload of job %s step %s skipped: a newer step is queued", u.job, u.step)
                    continue
                self.current = u
                return u
            return None

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()  # the daemon lowers this thread's CPU and I/O priority
        while True:
            u = self._next()
            if u is None:
                return
            try:
                res = self._upload(u)
            except Exception as e:  # reported, never swallowed: the step's waiters or status get it
                with self._cv:  # however the stop came through (a transfer thread's callback raised it)
                    given_up = (u.job, u.step, u.attempt) in self._given_up
                err = _gave_up(u) if given_up else str(e)  # given up: whatever it failed on then (its part renamed)
                (log.info if given_up else log.error)("upload of job %s step %s failed: %s (%s)", u.job, u.step, err, e)
                multi, took = u.ranks is not None, time.monotonic() - u.started
                res = Uploaded(u.job, u.step, err, u.bytes_done, took, False, multi, attempt=u.attempt, given_up=given_up)
            finally:
                with self._cv:
                    self.current = None
                    self._given_up.discard((u.job, u.step, u.attempt))
                    part = u.node_dir  # as give_up may have renamed it
                if part:
                    shutil.rmtree(part, ignore_errors=True)  # uploaded, or never to be: this node's part is no checkpoint
            try:
                self.done(res)
            except Exception:
                log.exception("upload result for job %s step %s was not delivered", u.job, u.step)

    def _progress(self, u: Upload) -> Progress:
        last = [time.monotonic()]

        def cb(n: int) -> None:
            u.bytes_done += n
            now = time.monotonic()
            if now - last[0] >= 10.0 and u.bytes_total:
                last[0] = now
                rate = u.bytes_done / max(now - u.started, 1e-9)
                log.info(
                    "uploading job %s step %s: %.0f%% (%.2f of %.2f GB, %.0f MB/s)",
                    u.job, u.step, 100 * u.bytes_done / u.bytes_total, u.bytes_done / 1e9, u.bytes_total / 1e9, rate / 1e6,
                )  # fmt: skip

        return cb

    def _bucket_has(self, job: str, step: int) -> bool:
        """The bucket holds this local step already: a step of that number committed no earlier (not the
        old line's step a rolled-back run's re-save replaced here, left there by a restart before its upload)."""
        try:  # read now, not from the process's cache: another node's retention may have changed it
            at = commit_time(get_document(self.store, bucket_key(job, step, MANIFEST)))
        except FileNotFoundError:
            return False
        return at >= local_committed_at(step_dir(self.root, job, step))

    def _upload(self, u: Upload) -> Uploaded:
        u.started = time.monotonic()
        multi = u.ranks is not None
        url = step_url(self.store, u.job, u.step)
        if u.catch_up and u.ranks is None and self._bucket_has(u.job, u.step):
            return Uploaded(u.job, u.step, None, 0, 0.0, True, False, url)
        if u.ranks is None:
            d = step_dir(self.root, u.job, u.step)
            u.bytes_total = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
            nbytes = upload_step(self.store, d, u.job, u.step, self._progress(u))
        else:
            d = u.node_dir
            self._check(u)
            u.bytes_total = sum(os.path.getsize(os.path.join(d, n)) for n in rank_files(u.ranks))
            frag = read_fragment(self.root, u.job, u.step, u.ranks[0], d)
            self._check_replaces(u, frag)
            checked = _Checked(self.store, lambda: self._check(u))  # a given-up attempt stops between objects
            nbytes = upload_ranks(checked, d, u.job, u.step, u.ranks, self._progress(u), attempt_of(frag))
            self._wait_complete(u, attempt_of(frag))
        pruned: str | None = None
        try:  # the step is complete in the bucket: a failure to prune older steps is reported, never the step's
            settled = self._settled(u.job) if multi else None
            retention = AnyOf((self.latest, self.forever(u.job)))
            removed = apply_remote_retention(self.store, u.job, retention, busy={u.step} | self.pending(u.job), settled=settled)
            if removed:
                log.info("remote retention: removed steps %s of job %s from the bucket", removed, u.job)
        except Exception as e:
            log.error("remote retention of job %s after step %s failed: %s", u.job, u.step, e)
            pruned = f"{e}"
        return Uploaded(u.job, u.step, None, nbytes, time.monotonic() - u.started, True, multi, url, pruned, u.attempt)

    def _settled(self, job: str) -> Settled:
        """Multi-node: whether objects of a step of ``job`` in the bucket (a partial step's, or another attempt's
        under a complete step) can no longer become part of a complete step. Another node may be uploading any
        of them (after a rollback, numbered below the latest too); objects that have not changed for
        ``commit_timeout`` (as this uploader's retention passes saw them) have been given up by every node that
        waited for them. Objects are told apart by their tags (ETag and LastModified), not only their names: an
        attempt that uploads again after a restart writes the same names and bytes."""

        def settled(step: int, keys: frozenset[tuple[str, str]]) -> bool:
            now = self.clock()
            seen = self._partials.get((job, step))
            if seen is None or seen[0] != keys:
                if len(self._partials) > 4096:
                    self._partials.clear()
                self._partials[(job, step)] = (keys, now)
                return False
            return now - seen[1] >= self.commit_timeout

        return settled

    def _check_replaces(self, u: Upload, frag: dict[str, Any]) -> None:
        """Multi-node: before this node's ranks go up, check that this attempt may replace a step of that number
        another attempt completed in the bucket (a rollback); else this node's part can never complete: the upload
        fails saying why (and its directory is removed)."""
        if check_replaces(self.store, u.job, u.step, frag):
            log.warning(
                "step %s of job %s in the bucket was saved by an earlier attempt: this one %s (a run rolled back to step %s)"
                " replaces it once every node has uploaded its ranks; the old step stays complete until then",
                u.step, u.job, attempt_of(frag), frag.get("after"),
            )  # fmt: skip

    def _wait_complete(self, u: Upload, attempt: Attempt | None) -> None:
        """Multi-node: poll the bucket until every node's ranks of this attempt are there and the manifest is written
        (checking before each try that the attempt was not given up: then it never completes there)."""
        deadline = time.monotonic() + self.commit_timeout
        polls = itertools.count()
        while self._check(u) or not try_complete(self.store, u.job, u.step, u.world_size, attempt, probe=next(polls) % PROBE_EVERY == 1):
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"step {u.step} of job {u.job}: not every rank's shard of this attempt reached the bucket within"
                    f" {self.commit_timeout:g} s (is every node's daemon configured with the same bucket and prefix, or the same"
                    " shared directory?)"
                )
            time.sleep(self.POLL_S)


def _sync(d: str) -> None:
    try:
        fsync_dir(d)
    except OSError as e:  # the rename may not survive a crash: then a restart uploads the part again
        log.warning("could not sync %s: %s", d, e)


def _gave_up(u: Upload) -> str:
    return f"step {u.step} of job {u.job}: this attempt was given up (a new run saves the step again)"


class _Checked:
    """``store``, calling ``check()`` before each object it uploads (which may stop the upload by raising there: raised
    in a progress callback, on a transfer thread, it would be taken for a network error and retried)."""

    def __init__(self, store: ObjectStore, check: Callable[[], None]) -> None:
        self._store, self._check = store, check

    def put_file(self, rel: str, path: str, progress: Progress | None = None) -> None:
        self._check()
        self._store.put_file(rel, path, progress)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
