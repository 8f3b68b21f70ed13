"""The fetch thread (:class:`ckptd.daemon.fetcher.Fetcher`) in process, with a :class:`StepCatalog` over a
temporary root and the in-memory bucket of :mod:`doubles`, reporting through a real
:class:`~ckptd.daemon.events.EventQueue` (no daemon, no socket but the queue's inproc wake-up):
``start`` posts a :class:`~ckptd.daemon.events.Fetched`; ``wait`` returns a finished answer once and
forgets it, or holds the request; ``done`` answers held waiters, ``due`` overdue ones; a step only the
bucket has is downloaded (``remote`` on the wire) and a local one is read in place (``local``); a
missing step fails without a report, a corrupt bucket object fails with one and leaves nothing in the
root; ``check_store`` reports an unusable bucket; answers nobody collected are bounded by
``FETCHES_KEPT``. Steps are written with ckptd's own writer and uploaded with ``upload_step``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from _shards import shard_bytes
from doubles import MemoryStore

from ckptd.config import FETCHES_KEPT
from ckptd.daemon import fetcher as fetcher_mod
from ckptd.daemon.catalog import StepCatalog
from ckptd.daemon.events import ErrorReported, Event, EventQueue, Fetched
from ckptd.daemon.fetcher import Fetcher
from ckptd.daemon.persister import Persister, PersistOptions
from ckptd.daemon.waiters import Waiter
from ckptd.errors import CheckpointError, ProtocolError
from ckptd.layout import FETCHED, MANIFEST, bucket_key, fetch_dir, shard_name, step_dir
from ckptd.storage.local import ShardWrite, apply_retention, complete_steps, finalize_step, latest_step, write_shard
from ckptd.storage.remote import upload_step
from ckptd.storage.retention import KeepLatest, Protect
from ckptd.storage.store import Progress

JOB = "j"
WAIT_S = 30.0  # generous: only a broken fetcher waits this long


# ---------------------------------------------------------------------------- helpers


def write_step(root: str, job: str, step: int) -> str:
    """A complete single-rank step under ``root``, written by ckptd's local tier; returns its directory."""
    w, b = torch.full((2, 4), float(step), dtype=torch.float32), torch.arange(3, dtype=torch.int16) + step
    buf = shard_bytes([("model/w", w, (2, 4), (0, 0)), ("model/b", b, (3,), (0,))])
    write_shard(root, ShardWrite(job, step, 0, 1, memoryview(buf), len(buf), {"step": step}))
    return finalize_step(root, job, step, 1)


def put_in_bucket(store: MemoryStore, src_root: str, job: str, step: int) -> str:
    """Write a step under ``src_root`` (another node) and upload it; returns its directory there."""
    d = write_step(src_root, job, step)
    upload_step(store, d, job, step)
    return d


class Inbox:
    """The loop's side of the event queue: the next event, waiting on the queue's wake-up socket."""

    def __init__(self, events: EventQueue) -> None:
        self.events = events
        self._buf: list[Event] = []

    def next(self) -> Event:
        deadline = time.monotonic() + WAIT_S
        while not self._buf:
            self._buf += self.events.drain()
            if self._buf:
                break
            left = deadline - time.monotonic()
            assert left > 0, "no event came"
            self.events.wake.poll(int(left * 1000) + 1)
        return self._buf.pop(0)

    def fetched(self) -> Fetched:
        ev = self.next()
        assert isinstance(ev, Fetched), ev
        return ev


@contextmanager
def running(catalog: StepCatalog, keep: int | None = None) -> Iterator[tuple[Fetcher, Inbox]]:
    """A fetcher over ``catalog`` posting to a real event queue; everything closed even on failure. With
    ``keep``, local retention is the daemon's (:class:`Persister` keeping ``keep`` steps and what the fetcher holds)."""
    ctx = zmq.Context()
    try:
        events = EventQueue(ctx)
        try:
            protect = lambda job: Protect(frozenset(fetcher.held(job)))  # noqa: E731
            persister = Persister(catalog.root, events, PersistOptions(1, keep or 0), protect=protect)
            fetcher = Fetcher(catalog, events, retain=persister.retain if keep is not None else None)
            fetcher.persister = persister  # type: ignore[attr-defined]  # the test completes steps through it
            try:
                yield fetcher, Inbox(events)
            finally:
                fetcher.shutdown()
                persister.shutdown()
        finally:
            events.close()
    finally:
        ctx.term()


def done_answer(step: int, path: str, source: str) -> dict[str, Any]:
    return {"state": "done", "step": step, "path": path, "source": source, "error": None}


class GatedStore(MemoryStore):
    """A bucket whose ``get_file`` waits for :attr:`gate` (and sets :attr:`entered`): a download in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def get_file(self, rel: str, path: str, progress: Progress | None = None, limit: int | None = None) -> None:
        self.entered.set()
        if not self.gate.wait(WAIT_S):
            raise CheckpointError(f"gate never opened for {rel}")
        super().get_file(rel, path, progress, limit)


# ---------------------------------------------------------------------------- answers and waiters


def test_local_step_answers_the_held_waiter_on_done(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write_step(root, JOB, 1)
    path3 = write_step(root, JOB, 3)
    store = MemoryStore()
    with running(StepCatalog(root, store)) as (fetcher, inbox):
        fid = fetcher.start(JOB, None)
        assert fetcher.answers[fid]["state"] == "pending"
        deadline = time.monotonic() + 600
        # the main thread has not handled the Fetched event yet: the request is held, whatever the thread did
        assert fetcher.wait(fid, b"client-1", 7, deadline) is None
        assert len(fetcher.waiters) == 1
        ev = inbox.fetched()
        assert ev.fid == fid and ev.report is None
        assert ev.answer == done_answer(3, path3, "local")  # the newest complete step, read in place
        assert fetcher.done(ev) == [(Waiter(b"client-1", 7, deadline), ev.answer)]
        assert len(fetcher.waiters) == 0
        assert fid not in fetcher.answers  # answered: forgotten
        with pytest.raises(ProtocolError, match=f"unknown fetch {fid}"):
            fetcher.wait(fid, b"client-1", 8, deadline)
    assert not any(op == "get" for op, _ in store.calls)  # a local step is not downloaded


def test_wait_after_done_returns_the_answer_once(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    path1 = write_step(root, JOB, 1)
    write_step(root, JOB, 2)
    with running(StepCatalog(root, MemoryStore())) as (fetcher, inbox):
        fid = fetcher.start(JOB, 1)  # an older step, by number
        ev = inbox.fetched()
        assert fetcher.done(ev) == []  # nobody is waiting yet: the answer is kept
        got = fetcher.wait(fid, b"c", 1, time.monotonic() + 600)
        assert got == done_answer(1, path1, "local")
        assert len(fetcher.waiters) == 0
        with pytest.raises(ProtocolError, match="unknown fetch"):
            fetcher.wait(fid, b"c", 2, time.monotonic() + 600)  # a client that lost it asks for a new fetch
        assert fetcher.done(Fetched(999, done_answer(1, path1, "local"))) == []  # an event for no fetch is ignored
        assert 999 not in fetcher.answers


def test_due_answers_overdue_waiters_with_the_state_as_it_is(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    path = write_step(root, JOB, 5)
    with running(StepCatalog(root)) as (fetcher, inbox):  # no bucket: the local tier alone
        fid = fetcher.start(JOB, None)
        t0 = 1000.0  # deadlines and "now" are plain numbers: no clock involved
        assert fetcher.wait(fid, b"early", 1, t0 + 5) is None
        assert fetcher.wait(fid, b"late", 2, t0 + 100) is None
        assert fetcher.due(t0) == []
        overdue = fetcher.due(t0 + 5)
        assert overdue == [(Waiter(b"early", 1, t0 + 5), {"state": "pending", "step": None, "path": None, "source": None, "error": None})]
        assert len(fetcher.waiters) == 1
        ev = inbox.fetched()
        assert fetcher.done(ev) == [(Waiter(b"late", 2, t0 + 100), done_answer(5, path, "local"))]
        assert fetcher.due(t0 + 1000) == []  # answered waiters are gone
        assert fid not in fetcher.answers


# ---------------------------------------------------------------------------- the bucket


def test_step_only_in_the_bucket_is_downloaded(tmp_path: Path) -> None:
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    path2 = write_step(root, JOB, 2)
    store = MemoryStore()
    src = put_in_bucket(store, other, JOB, 4)  # newer than anything local: the node lost it
    with running(StepCatalog(root, store)) as (fetcher, inbox):
        fid = fetcher.start(JOB, None)
        ev = inbox.fetched()
        assert ev.fid == fid and ev.report is None
        assert ev.answer == done_answer(4, step_dir(root, JOB, 4), "remote")
        assert fetcher.progress() is None  # the download is over
        fid2 = fetcher.start(JOB, 2)  # a step the root has is read in place
        assert inbox.fetched().answer == done_answer(2, path2, "local")
        assert fid2 != fid
    got = step_dir(root, JOB, 4)
    assert sorted(os.listdir(got)) == [FETCHED, MANIFEST, shard_name(0)]  # marked: a restarted daemon never uploads it
    with open(os.path.join(got, shard_name(0)), "rb") as a, open(os.path.join(src, shard_name(0)), "rb") as b:
        assert a.read() == b.read()
    assert latest_step(root, JOB) == (4, got)
    assert not os.path.exists(fetch_dir(root, JOB, 4))


# ---------------------------------------------------------------------------- holds against local retention


def test_a_step_downloaded_for_a_rollback_is_held_from_retention_until_closed(tmp_path: Path) -> None:
    """A rollback restore of step 3, older than the node's steps 5 and 6 (keep 2): the download used to be
    doomed by the next retention pass (a trainer of the job completing step 7) while ranks still read it,
    and a node that only restores never pruned its downloads. Now the step is held until the restore
    closes its fetch, and the download's own retention pass prunes what no hold covers."""
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    store = MemoryStore()
    put_in_bucket(store, other, JOB, 3)  # committed first: the oldest
    for s in (4, 5, 6):
        write_step(root, JOB, s)
    with running(StepCatalog(root, store), keep=2) as (fetcher, inbox):
        fid = fetcher.start(JOB, 3)
        assert inbox.fetched().answer == done_answer(3, step_dir(root, JOB, 3), "remote")
        assert complete_steps(root, JOB) == [3, 5, 6]  # the download's retention pass pruned 4, not the held 3
        write_step(root, JOB, 7)
        fetcher.persister.retain(JOB)  # type: ignore[attr-defined]  # as after a trainer's step completes
        assert complete_steps(root, JOB) == [3, 6, 7]
        assert fetcher.held(JOB) == {3}
        assert fetcher.release(fid) is True  # fetch_close: the restore is done reading
        assert fetcher.release(fid) is False
        assert fetcher.held(JOB) == set()
        fetcher.persister.retain(JOB)  # type: ignore[attr-defined]
        assert complete_steps(root, JOB) == [6, 7]


def test_another_client_can_neither_collect_nor_release_a_fetch(tmp_path: Path) -> None:
    """Fetch ids are sequential: a local client in bad faith (or a buggy one) guessing another restore's id
    could take its answer (the restore then failed with "unknown fetch") or release its hold (retention could
    then remove the step under its ranks). Only the requester's socket may do either."""
    root = str(tmp_path / "root")
    path = write_step(root, JOB, 3)
    with running(StepCatalog(root), keep=1) as (fetcher, inbox):
        fid = fetcher.start(JOB, 3, owner=b"victim")
        fetcher.done(inbox.fetched())
        with pytest.raises(ProtocolError, match=f"unknown fetch {fid}"):
            fetcher.wait(fid, b"intruder", 1, time.monotonic() + 600)
        assert fetcher.release(fid, b"intruder") is False and fetcher.held(JOB) == {3}
        assert fetcher.wait(fid, b"victim", 2, time.monotonic() + 600) == done_answer(3, path, "local")
        assert fetcher.release(fid, b"victim") is True and fetcher.held(JOB) == set()


def test_holds_lapse_and_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that died mid-restore never closes its fetch: its hold lapses after FETCH_HOLD_S. A client
    fetching in a loop without closing (a bug, or a local user keeping steps from retention on purpose)
    holds at most MAX_FETCH_HOLDS fetches; the oldest lapses first. A failed fetch holds nothing."""
    monkeypatch.setattr(fetcher_mod, "MAX_FETCH_HOLDS", 2)
    root = str(tmp_path / "root")
    for s in (1, 2, 3):
        write_step(root, JOB, s)
    with running(StepCatalog(root)) as (fetcher, inbox):
        for s in (1, 2, 3):
            fetcher.start(JOB, s)
            assert inbox.fetched().answer["state"] == "done"
        assert fetcher.held(JOB) == {2, 3}
        fetcher.start(JOB, 9)
        assert inbox.fetched().answer["state"] == "failed"
        assert fetcher.held(JOB) == {2, 3}
        monkeypatch.setattr(fetcher_mod, "FETCH_HOLD_S", 0.0)
        fetcher.start(JOB, 1)
        inbox.fetched()
        assert fetcher.held(JOB) == {3}  # the new hold lapsed at once; 2 was pushed out by it


def test_another_users_fetches_never_drop_a_restores_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holds were capped at MAX_FETCH_HOLDS, the oldest dropped whoever held it: another client fetching 256 times
    without closing dropped a restore's hold, and retention removed the step under it. A connection now drops
    its own oldest past MAX_FETCH_HOLDS_PER_CLIENT, and past the total the user holding the most loses one."""
    monkeypatch.setattr(fetcher_mod, "MAX_FETCH_HOLDS", 4)
    monkeypatch.setattr(fetcher_mod, "MAX_FETCH_HOLDS_PER_CLIENT", 2)
    root = str(tmp_path / "root")
    for s in (1, 2, 3, 4, 5):
        write_step(root, JOB, s)
    with running(StepCatalog(root)) as (fetcher, inbox):
        fetcher.start(JOB, 1, owner=b"victim", uid=1000)
        fetcher.done(inbox.fetched())
        for s in (2, 3, 4):  # one connection in a loop: it keeps its newest two
            fetcher.done((fetcher.start(JOB, s, owner=b"loop", uid=65534), inbox.fetched())[1])
        assert fetcher.held(JOB) == {1, 3, 4}
        for i, s in enumerate((5, 2, 5)):  # a connection each: past the total, that user loses its oldest
            fetcher.done((fetcher.start(JOB, s, owner=b"c%d" % i, uid=65534), inbox.fetched())[1])
        assert 1 in fetcher.held(JOB) and len(fetcher._holds) == 4


def test_queued_fetches_are_bounded_per_connection_and_per_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One fetch thread serves every restore: 3,000 fetches queued by one client delayed another's by 18 s. A
    connection queues at most MAX_FETCHES_PER_CLIENT; a user's connections (every rank of a node restoring at
    once, each with its own) at most MAX_FETCHES_PER_USER."""
    monkeypatch.setattr(fetcher_mod, "MAX_FETCHES_PER_CLIENT", 2)
    monkeypatch.setattr(fetcher_mod, "MAX_FETCHES_PER_USER", 3)
    root = str(tmp_path / "root")
    write_step(root, JOB, 1)
    gate = threading.Event()
    with running(StepCatalog(root)) as (fetcher, inbox):
        fetcher._pool.submit(gate.wait)  # the fetch thread busy: what is asked now stays queued
        fetcher.start(JOB, 1, owner=b"a", uid=65534)
        fetcher.start(JOB, 1, owner=b"a", uid=65534)
        with pytest.raises(CheckpointError, match="2 fetch requests of this client are queued already"):
            fetcher.start(JOB, 1, owner=b"a", uid=65534)
        fetcher.start(JOB, 1, owner=b"b", uid=65534)  # another rank's connection is taken
        with pytest.raises(CheckpointError, match="3 fetch requests of this user are queued already"):
            fetcher.start(JOB, 1, owner=b"c", uid=65534)
        fetcher.start(JOB, 1, owner=b"v", uid=1000)  # another user's is taken
        gate.set()
        for _ in range(4):
            fetcher.done(inbox.fetched())
        fetcher.start(JOB, 1, owner=b"a", uid=65534)  # done: room again
        fetcher.done(inbox.fetched())


def test_a_local_step_removed_between_choosing_and_holding_it_is_looked_for_again(tmp_path: Path) -> None:
    """Retention decides under the job's lock; the fetch holds its step under it too. A step retention removed
    after the catalog chose it (and before the hold) is never handed to a restore: the fetch looks again and
    reads the bucket's copy."""
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    store = MemoryStore()
    put_in_bucket(store, other, JOB, 1)
    path1 = write_step(root, JOB, 1)
    for s in (2, 3):
        write_step(root, JOB, s)
    catalog = StepCatalog(root, store)
    real = catalog.find
    calls = []

    def find(job: str, step: int | None = None, skip: frozenset[int] = frozenset()) -> Any:
        found = real(job, step, skip)
        calls.append(found.path)
        if len(calls) == 1:
            apply_retention(root, JOB, KeepLatest(2))  # another thread's pass, landing right after the choice
        return found

    catalog.find = find  # type: ignore[method-assign]
    with running(catalog) as (fetcher, inbox):
        fetcher.start(JOB, 1)
        assert inbox.fetched().answer == done_answer(1, step_dir(root, JOB, 1), "remote")
    assert calls == [path1, None]  # the local copy, gone; then the bucket's
    assert os.path.exists(os.path.join(step_dir(root, JOB, 1), FETCHED))


def test_progress_names_the_download_in_flight(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    store = GatedStore()
    put_in_bucket(store, str(tmp_path / "other"), JOB, 4)
    with running(StepCatalog(root, store)) as (fetcher, inbox):
        try:
            fetcher.start(JOB, 4)
            assert store.entered.wait(WAIT_S), "the download never started"
            assert fetcher.progress() == {"job": JOB, "step": 4, "bytes_done": 0}
        finally:
            store.gate.set()  # before shutdown(), which waits for the download
        ev = inbox.fetched()
        assert ev.answer["state"] == "done" and ev.answer["source"] == "remote"
        assert fetcher.progress() is None


def test_missing_step_fails_without_a_report(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write_step(root, JOB, 1)
    store = MemoryStore()
    put_in_bucket(store, str(tmp_path / "other"), JOB, 4)
    with running(StepCatalog(root, store)) as (fetcher, inbox):
        fetcher.start(JOB, 9)
        ev = inbox.fetched()
        assert ev.report is None  # a step that does not exist is the client's business, not the daemon's error
        assert {k: v for k, v in ev.answer.items() if k != "error"} == {"state": "failed", "step": 9, "path": None, "source": None}
        assert "step 9 of job 'j' is not a committed checkpoint" in ev.answer["error"] and store.url() in ev.answer["error"]
        fetcher.start("nothing", None)
        ev = inbox.fetched()
        assert ev.report is None and ev.answer["state"] == "failed" and ev.answer["step"] is None
        assert "job 'nothing' has no committed checkpoint" in ev.answer["error"]
    assert not os.path.exists(step_dir(root, JOB, 9))


@pytest.mark.parametrize(
    "damage, problem",
    [
        ("flip", "checksum mismatch in tensor"),
        ("truncate", "bytes, the manifest says"),
        ("delete", "no such object"),
    ],
)
def test_corrupt_bucket_object_fails_with_a_report(tmp_path: Path, damage: str, problem: str) -> None:
    root = str(tmp_path / "root")
    store = MemoryStore()
    put_in_bucket(store, str(tmp_path / "other"), JOB, 4)
    key = bucket_key(JOB, 4, shard_name(0))
    data = store.objects[key]
    if damage == "flip":
        store.objects[key] = data[:-1] + bytes([data[-1] ^ 0xFF])  # the last tensor byte
    elif damage == "truncate":
        store.objects[key] = data[:-1]
    else:
        del store.objects[key]
    with running(StepCatalog(root, store)) as (fetcher, inbox):
        fetcher.start(JOB, None)
        ev = inbox.fetched()
        assert ev.answer["state"] == "failed" and ev.answer["path"] is None and ev.answer["source"] is None
        assert problem in ev.answer["error"]
        assert ev.report is not None and ev.report.startswith("fetch of job j step 4: ") and problem in ev.report
    # nothing half-downloaded enters the root: later restores do not trip over it
    assert not os.path.exists(step_dir(root, JOB, 4)) and not os.path.exists(fetch_dir(root, JOB, 4))
    assert latest_step(root, JOB) == (None, None)


# ---------------------------------------------------------------------------- check_store


@pytest.mark.parametrize("bucket", ["usable", "closed", "none"])
def test_check_store_reports_only_an_unusable_bucket(tmp_path: Path, bucket: str) -> None:
    store = MemoryStore()
    if bucket == "closed":
        store.close()  # its check() raises CheckpointError
    with running(StepCatalog(str(tmp_path / "root"), None if bucket == "none" else store)) as (fetcher, inbox):
        fetcher.check_store()
        fid = fetcher.start(JOB, None)  # the same single thread: its Fetched comes after any report of the check
        first = inbox.next()
        if bucket == "closed":
            assert isinstance(first, ErrorReported)
            assert first.message.startswith("object storage: ") and "mem://bucket/ is closed" in first.message
            first = inbox.next()
        assert isinstance(first, Fetched) and first.fid == fid


# ---------------------------------------------------------------------------- bounded answers


def test_answers_nobody_collected_are_bounded(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    path = write_step(root, JOB, 1)
    with running(StepCatalog(root)) as (fetcher, inbox):
        held = fetcher.start(JOB, 1)
        held_ev = inbox.fetched()  # not handed to done(): this fetch stays pending
        finished = []
        for _ in range(FETCHES_KEPT + 5):
            finished.append(fetcher.start(JOB, 1))
            assert fetcher.done(inbox.fetched()) == []  # the client never asks
        newest = fetcher.start(JOB, 1)  # a new fetch drops the oldest uncollected answers
        kept = [fid for fid, r in fetcher.answers.items() if r["state"] != "pending"]
        assert kept == finished[5:]
        assert held in fetcher.answers and newest in fetcher.answers  # pending fetches are never dropped
        with pytest.raises(ProtocolError, match="unknown fetch"):
            fetcher.wait(finished[0], b"c", 1, time.monotonic() + 600)
        assert fetcher.wait(finished[-1], b"c", 2, time.monotonic() + 600) == done_answer(1, path, "local")
        deadline = time.monotonic() + 600
        assert fetcher.wait(held, b"c", 3, deadline) is None
        assert fetcher.done(held_ev) == [(Waiter(b"c", 3, deadline), done_answer(1, path, "local"))]
        assert inbox.fetched().fid == newest
