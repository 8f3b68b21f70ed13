"""Fetches: the daemon's side of a restore that reads disk or the bucket. A fetch asks the catalog
which step to read and, when only the bucket has it, downloads it into the root (verified) first.

The main thread starts fetches (``fetch``) and holds ``fetch_wait`` requests; one fetch thread runs
them one at a time (downloads take minutes and share the network with uploads) and reports a
:class:`~ckptd.daemon.events.Fetched`. A ``latest`` request that must ask the bucket runs on a lookup
thread of its own (never behind a download) and is answered through a
:class:`~ckptd.daemon.events.Answered`. The same thread checks the bucket at start-up, so READY never
waits for the network. Answers nobody asked for (a client that died mid-restore) are bounded.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import FETCH_HOLD_S, FETCHES_KEPT, MAX_FETCH_HOLDS, MAX_FETCH_HOLDS_PER_CLIENT, MAX_FETCHES_PER_CLIENT, MAX_FETCHES_PER_USER
from ..errors import CheckpointError, FormatError, ProtocolError
from ..layout import MANIFEST, bucket_key, is_complete
from ..protocol import Source
from ..storage.local import job_lock
from ..storage.peer import PeerUnion
from ..storage.remote import download_step
from ..storage.store import ObjectStore
from .catalog import Found, NoStep, StepCatalog
from .events import Answered, ErrorReported, EventQueue, Fetched
from .waiters import Waiter, Waiters

log = logging.getLogger("ckptd.daemon")
MAX_PASSED_OVER = 3  # latest steps a restore passes over when no source can deliver them, before it gives up


class Fetcher:
    def __init__(self, catalog: StepCatalog, events: EventQueue, retain: Callable[[str], None] | None = None) -> None:
        self.catalog, self._events, self._retain = catalog, events, retain
        self._holds: dict[int, tuple[str, int, float, bytes | None]] = {}  # fetch id -> (job, step, when it lapses, owner)
        self._users: dict[int, int | None] = {}  # fetch id -> the uid that asked, while it is queued or holds a step
        self._queued: collections.Counter[Any] = collections.Counter()  # uid, and (uid, connection) -> its fetches and lookups not done
        self._owners: dict[int, bytes | None] = {}  # fetch id -> its requester, while its answer is kept
        self._holds_lock = threading.Lock()  # read by persist threads (retention), written by the fetch thread
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-fetch")
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-lookup")
        self.answers: dict[int, dict[str, Any]] = {}  # fetch id -> its fetch_wait reply (state pending until done)
        self.waiters: Waiters[int] = Waiters()
        self._ids = itertools.count(1)
        self.current: tuple[str, int, list[int]] | None = None  # job, step, [bytes downloaded] (fetch thread writes)

    def check_store(self) -> None:
        """Check the bucket on the fetch thread; an unreachable one is reported, never fatal (local
        durability still works, and each upload is tried and reported)."""
        store = self.catalog.store
        if store is None:
            return

        def check() -> None:
            try:
                store.check()
                log.info("object-storage tier: %s", store.url())
            except CheckpointError as e:
                log.error("object-storage tier unreachable: %s", e)
                self._events.post(ErrorReported(f"object storage: {e}"))
                return  # the uploads a dead daemon left open wait for the next start that reaches the bucket
            store.abort_unfinished()

        self._pool.submit(check)

    def _admit(self, who: tuple[int | None, bytes | None], what: str) -> None:
        """Main thread: count one more queued fetch or lookup of connection ``who`` (its uid, its socket identity);
        refused past a connection's share, or its user's (one thread does them all: a client queueing thousands
        would delay every other restore by their sum; each rank of a node has a connection of its own)."""
        with self._holds_lock:
            for key, limit, whose in ((who, MAX_FETCHES_PER_CLIENT, "client"), (who[0], MAX_FETCHES_PER_USER, "user")):
                if self._queued[key] >= limit:
                    raise CheckpointError(f"{limit} {what} requests of this {whose} are queued already: wait for them first")
            self._queued[who] += 1
            self._queued[who[0]] += 1

    def _done(self, who: tuple[int | None, bytes | None]) -> None:
        with self._holds_lock:
            for k in (who, who[0]):
                self._queued[k] -= 1
                if self._queued[k] <= 0:
                    del self._queued[k]

    def start(self, job: str, step: int | None, owner: bytes | None = None, uid: int | None = None) -> int:
        """Main thread: begin a fetch; returns its id. ``owner``: the requester's socket identity; only it may
        collect the answer and release the hold (fetch ids are sequential: another client could guess them);
        ``uid``: its user, whose holds are the ones dropped first when there are too many."""
        self._admit((uid, owner), "fetch")
        fid = next(self._ids)
        self._users[fid] = uid
        self.answers[fid] = {"state": "pending", "step": None, "path": None, "source": None, "error": None}
        self._owners[fid] = owner
        for old in [f for f, r in self.answers.items() if r["state"] != "pending"][:-FETCHES_KEPT]:
            del self.answers[old]  # answers nobody asked for: a client that died mid-restore
            self._owners.pop(old, None)
        self._pool.submit(self._run, fid, job, step, owner)
        return fid

    def latest(self, job: str, ident: bytes, req_id: Any, uid: int | None = None) -> None:
        """Main thread: answer a ``latest`` request from the root and the bucket, on the lookup thread."""
        self._admit((uid, ident), "latest")
        self._lookups.submit(self._run_latest, job, ident, req_id, uid)

    def _run_latest(self, job: str, ident: bytes, req_id: Any, uid: int | None = None) -> None:
        self._done((uid, ident))
        try:
            found = self.catalog.latest_anywhere(job)
            answer: dict[str, Any] = {"step": None, "path": None, "source": None}
            if found is not None:
                answer = {"step": found.step, "path": found.path, "source": found.source.to_wire()}
        except Exception as e:  # the bucket is unreachable: say so, never answer "none" or a possibly stale step
            log.error("latest of job %s: %s", job, e)
            answer = {"error": f"cannot ask the bucket for the latest step of job {job!r}: {e}"}
        self._events.post(Answered(ident, req_id, answer))

    def wait(self, fid: int, ident: bytes, req_id: Any, deadline: float) -> dict[str, Any] | None:
        """Main thread: the answer if the fetch is done (then forgotten: a client that lost it asks
        for a new fetch), else hold the request until ``deadline``."""
        res = self.answers.get(fid)
        if res is None or self._owners.get(fid) not in (None, ident):
            raise ProtocolError(f"unknown fetch {fid}")
        if res["state"] == "pending":
            self.waiters.add(fid, ident, req_id, deadline)
            return None
        self._owners.pop(fid, None)
        return dict(self.answers.pop(fid))

    def done(self, ev: Fetched) -> list[tuple[Waiter, dict[str, Any]]]:
        """Main thread: a fetch finished; returns its waiters with their reply."""
        if ev.fid not in self.answers:
            return []
        self.answers[ev.fid] = ev.answer
        waiters = self.waiters.pop(ev.fid)
        if waiters:
            self.answers.pop(ev.fid, None)
            self._owners.pop(ev.fid, None)
        return [(w, ev.answer) for w in waiters]

    def due(self, now: float) -> list[tuple[Waiter, dict[str, Any]]]:
        """Main thread: held fetch_waits past their deadline, with the state as it is."""
        forgotten = {"state": "failed", "error": "fetch forgotten"}
        return [(w, self.answers.get(fid, forgotten)) for fid, w in self.waiters.due(now)]

    def held(self, job: str) -> set[int]:
        """Steps of ``job`` a restore is reading: local retention must leave them alone (any thread)."""
        now = time.monotonic()
        with self._holds_lock:
            for fid in [f for f, (_, _, until, _) in self._holds.items() if until <= now]:
                self._drop_hold(fid)
            return {step for (j, step, _, _) in self._holds.values() if j == job}

    def release(self, fid: int, owner: bytes | None = None) -> bool:
        """Main thread (``fetch_close``): the restore of fetch ``fid`` is done reading; whether it held a step
        (only the fetch's own requester releases it)."""
        with self._holds_lock:
            hold = self._holds.get(fid)
            if hold is None or hold[3] not in (None, owner):
                return False
            del self._holds[fid]
            self._users.pop(fid, None)
            return True

    def _find_held(self, fid: int, job: str, step: int | None, owner: bytes | None, skip: frozenset[int] = frozenset()) -> Found:
        """The step to read, held. The hold and the check that a local step is still there happen under the
        job's lock, where retention decides what to remove: it either saw the hold, or removed the step
        first and the step is looked for again."""
        for _ in range(3):
            found = self.catalog.find(job, step, skip)
            with job_lock(self.catalog.root, job):
                with self._holds_lock:
                    self._hold(fid, (job, found.step, time.monotonic() + FETCH_HOLD_S, owner))
                if found.store is not None or (found.path is not None and is_complete(found.path)):
                    return found
        raise CheckpointError(f"job {job!r}: the step chosen to restore was removed by retention three times while it was chosen")

    def _hold(self, fid: int, hold: tuple[str, int, float, bytes | None]) -> None:
        """Under the holds lock: record a hold, dropping (oldest first) one of the same connection past its share, and
        past the total one of the user holding the most: another user's fetches never drop a restore's hold."""
        self._holds.pop(fid, None)
        mine = [f for f, h in self._holds.items() if h[3] == hold[3]]
        if hold[3] is not None and len(mine) >= MAX_FETCH_HOLDS_PER_CLIENT:
            self._drop_hold(mine[0])
        if len(self._holds) >= MAX_FETCH_HOLDS:
            users = collections.Counter(self._users.get(f) for f in self._holds)
            most = max(users, key=lambda u: (users[u], u == self._users.get(fid)))
            self._drop_hold(next(f for f in self._holds if self._users.get(f) == most))
        self._holds[fid] = hold

    def _drop_hold(self, fid: int) -> None:
        del self._holds[fid]
        self._users.pop(fid, None)

    def progress(self) -> dict[str, Any] | None:
        cur = self.current
        return None if cur is None else {"job": cur[0], "step": cur[1], "bytes_done": cur[2][0]}

    def shutdown(self) -> None:
        self._lookups.shutdown(wait=True)
        self._pool.shutdown(wait=True)

    def _run(self, fid: int, job: str, step: int | None, owner: bytes | None) -> None:
        """Fetch thread: the step a restore reads; a step only the bucket holds is downloaded first."""
        chosen: list[int] = []  # the steps looked for, once chosen
        report = None
        self._done((self._users.get(fid), owner))
        try:
            found, path, passed = self._fetch(fid, job, step, owner, chosen)
            answer = {"state": "done", "step": found.step, "path": path, "source": found.source.to_wire(), "error": None}
            if passed is not None:
                answer["passed_over"] = passed
        except Exception as e:  # the restore that asked gets it
            self.release(fid, owner)
            self._users.pop(fid, None)  # no hold: nothing to count it by
            answer = {"state": "failed", "step": step, "path": None, "source": None, "error": str(e)}
            if not isinstance(e, NoStep):
                want = chosen[0] if chosen else step  # the step looked for first
                log.error("fetch of job %s step %s failed: %s", job, want, e)
                report = f"fetch of job {job} step {want}: {e}"
        self._events.post(Fetched(fid, answer, report))

    def _prune(self, job: str) -> None:
        """Local retention after a download (the step just fetched is held); a failure is logged, the fetch stands."""
        if self._retain is None:
            return
        try:
            self._retain(job)
        except OSError as e:
            log.error("retention of job %s after a download failed: %s", job, e)

    def _fetch(self, fid: int, job: str, step: int | None, owner: bytes | None, chosen: list[int]) -> tuple[Found, str | None, str | None]:
        """The step to read, held, its directory (downloaded first where only the bucket or a peer holds it) and why a
        later one was passed over. The latest step (``step`` None) that no source can deliver whole is passed over for
        the newest that one can, saying so; an explicit step is that step or an error. ``chosen``: each step chosen,
        appended (for the report)."""
        skip: frozenset[int] = frozenset()
        failed: CheckpointError | None = None  # why the last step chosen could not be delivered
        while True:
            try:
                found = self._find_held(fid, job, step, owner, skip)
            except NoStep:
                if failed is None:
                    raise
                raise CheckpointError(f"{failed}; and no earlier step of job {job!r} is restorable {self.catalog.where(job)}") from None
            chosen.append(found.step)
            passed = None if failed is None else f"{failed}; restoring step {found.step}, the newest still restorable, instead"
            if passed is not None:
                log.error("%s", passed)
                self._events.post(ErrorReported(f"job {job}: {passed}"))
            if found.store is None:
                return found, found.path, passed
            try:
                found, path = self._download_any(job, found)
            except CheckpointError as e:
                if step is not None or len(skip) >= MAX_PASSED_OVER:
                    raise
                skip, failed = skip | {found.step}, e
                continue
            self._prune(job)
            return found, path, passed

    def _download_any(self, job: str, found: Found) -> tuple[Found, str]:
        """Download ``found`` from where it was found, else from the other stores that hold it complete (the bucket,
        other peers): a copy that fails a checksum, or a peer that stops answering, is not the end of the restore.
        A peer's replica that fails its checksums is deleted there (it can never restore). Raises naming every
        source tried."""
        failed: list[str] = []
        assert found.store is not None
        stores = [found.store] + [s for s in self.catalog.holders(job, found.step) if s.url() != found.store.url()]
        # the job's daemons read as one: once through each daemon first (a corrupt copy is one daemon's)
        stores = [r for s in stores for r in (s.rotations() if isinstance(s, PeerUnion) else [s])]
        for store in stores:
            assert store is not None
            try:
                path = self._download(store, job, found.step)
                return Found(found.step, Source.BUCKET if store is self.catalog.store else Source.PEER, None, store), path
            except (CheckpointError, OSError) as e:
                failed.append(f"{store.url()}: {e}")
                log.warning("fetch of job %s step %s from %s failed (%s)%s", job, found.step, store.url(), e,
                            "; trying the next source" if store is not stores[-1] else "")  # fmt: skip
                if isinstance(e, FormatError) and store is not self.catalog.store:
                    self._discard(store, job, found.step)
        raise CheckpointError(f"step {found.step} of job {job!r} could not be fetched from any source: {'; '.join(failed)}")

    @staticmethod
    def _discard(store: ObjectStore, job: str, step: int) -> None:
        """A peer's replica found corrupt: its manifest goes, so that no restore picks it again."""
        try:
            store.delete([bucket_key(job, step, MANIFEST)])
            log.warning("discarded the corrupt replica of job %s step %s on %s", job, step, store.url())
        except CheckpointError as e:
            log.warning("could not discard the corrupt replica of job %s step %s on %s: %s", job, step, store.url(), e)

    def _download(self, store: ObjectStore, job: str, step: int) -> str:
        done = [0]
        self.current = (job, step, done)

        def progress(n: int) -> None:
            done[0] += n

        try:
            log.info("fetching job %s step %s from %s", job, step, store.url())
            t0 = time.monotonic()
            path = download_step(store, self.catalog.root, job, step, progress)
            log.info("fetched job %s step %s: %.2f GB in %.1f s", job, step, done[0] / 1e9, time.monotonic() - t0)
            return path
        finally:
            self.current = None
