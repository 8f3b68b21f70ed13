"""The upload thread (:class:`ckptd.daemon.uploader.Uploader`) in process, against the in-memory bucket
of :mod:`doubles`: a single-node upload and its :class:`~ckptd.daemon.events.Uploaded`, failures that
are reported without stopping the thread, skipping a queued step when a newer one of the same job is
queued (unless ``keep_every`` keeps it, it belongs to another job, or it is multi-node), ``pending`` /
``backlog`` while uploads are held, multi-node completion through the bucket and its commit timeout,
bucket retention after each upload (sparing queued steps' partial uploads), start-up catch-up, and
``close`` finishing the queue. Steps on local disk are written with ckptd's own writer."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from _shards import Chunk, shard_bytes
from doubles import FaultyStore, MemoryStore

from ckptd.daemon.events import Uploaded
from ckptd.daemon.uploader import Uploader
from ckptd.errors import CheckpointError
from ckptd.layout import GONE, MANIFEST, bucket_key, bucket_prefix, node_parts, parse_bucket_key, step_dir, tmp_dir
from ckptd.storage.local import ShardWrite, finalize_step, hand_over, write_shard
from ckptd.storage.remote import (
    apply_remote_retention,
    bucket_committed_at,
    download_step,
    rank_files,
    remote_steps,
    try_complete,
    upload_ranks,
    upload_step,
)
from ckptd.storage.retention import KeepLatest, Protect
from ckptd.storage.store import Progress

JOB = "j"
WAIT_S = 30.0  # generous: only a broken uploader waits this long


# ---------------------------------------------------------------------------- helpers


def write_rank(
    root: str, job: str, step: int, rank: int, world_size: int, at: int = 0, run: int | None = None, after: int | None = None
) -> None:
    """Rank ``rank``'s shard of a step into ``step-N.tmp`` (row ``rank`` of ``model/w``; rank 0 also holds
    ``model/b``), committed at ``at`` by launch ``run``, which had restored step ``after``."""
    chunks: list[Chunk] = [("model/w", torch.full((1, 4), float(100 * step + rank), dtype=torch.float32), (world_size, 4), (rank, 0))]
    if rank == 0:
        chunks.append(("model/b", torch.arange(3, dtype=torch.int16) + step, (3,), (0,)))
    buf = shard_bytes(chunks)
    write_shard(
        root, ShardWrite(job, step, rank, world_size, memoryview(buf), len(buf), {"step": step}, committed_at=at, run=run, after=after)
    )


def write_step(root: str, job: str, step: int, at: int = 0) -> str:
    """A complete single-rank step under ``root``; returns its directory."""
    write_rank(root, job, step, 0, 1, at)
    return finalize_step(root, job, step, 1)


def local_size(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))


def put_steps(store: MemoryStore, job: str = JOB) -> set[int]:
    """The steps of ``job`` any object was ever written for."""
    return {p[0] for op, k in store.calls if op == "put" and (p := parse_bucket_key(job, k)) is not None}


class Results:
    """The ``done`` callback: records every :class:`Uploaded`, in order; ``fail_first`` makes the first call raise."""

    def __init__(self, fail_first: bool = False) -> None:
        self.items: list[Uploaded] = []
        self._fail_first = fail_first
        self._cv = threading.Condition()

    def __call__(self, res: Uploaded) -> None:
        with self._cv:
            self.items.append(res)
            self._cv.notify_all()
            if self._fail_first and len(self.items) == 1:
                raise RuntimeError("the loop is gone")

    def wait(self, n: int) -> list[Uploaded]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.items) >= n, WAIT_S), f"only {len(self.items)} of {n} uploads reported"
            return list(self.items)

    def steps(self) -> list[tuple[str, int]]:
        with self._cv:
            return [(r.job, r.step) for r in self.items]


class GatedStore(MemoryStore):
    """A bucket whose ``put_file`` waits for :attr:`gate`: the first upload stays in progress (and
    :attr:`entered` is set) until the test has queued what it wants behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def put_file(self, rel: str, path: str, progress: Progress | None = None) -> None:
        self.entered.set()
        if not self.gate.wait(WAIT_S):
            raise CheckpointError(f"gate never opened for {rel}")
        super().put_file(rel, path, progress)


def handed(root: str, step: int, job: str = JOB) -> str:
    """This node's part of ``step``, moved out of ``step-N.tmp`` as the persist thread hands it to the uploader."""
    return hand_over(root, job, step)


def upload_part(store: Any, root: str, results: Results, step: int, *, commit_timeout: float) -> tuple[Uploaded, Uploader]:
    """Upload rank 0's part of a 2-rank step of JOB with an uploader of its own; its one result, and the
    uploader (closed)."""
    up = make_uploader(store, root, results, commit_timeout=commit_timeout)
    try:
        up.submit(JOB, step, 2, ranks=[0], node=handed(root, step))
        (res,) = results.wait(1)
    finally:
        up.close()
    return res, up


def make_uploader(
    store: Any,
    root: str,
    done: Callable[[Uploaded], None],
    *,
    keep: int = 0,
    keep_every: int = 0,
    commit_timeout: float = WAIT_S,
    initializer: Callable[[], None] | None = None,
) -> Uploader:
    return Uploader(store, root, done, keep=keep, keep_every=keep_every, commit_timeout=commit_timeout, initializer=initializer)


def hold_first_upload(up: Uploader, store: GatedStore, job: str, step: int) -> None:
    """Submit ``step`` and wait until its upload is in progress (held at the gate)."""
    up.submit(job, step, 1)
    assert store.entered.wait(WAIT_S), "the first upload never started"


# ---------------------------------------------------------------------------- single node


def test_single_node_upload_reports_uploaded_and_copies_every_file(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    d = write_step(root, JOB, 1)
    store, results, threads = MemoryStore(), Results(), []
    up = make_uploader(store, root, results, initializer=lambda: threads.append(threading.current_thread().name))
    try:
        up.submit(JOB, 1, 1)
        (res,) = results.wait(1)
    finally:
        up.close()
    assert res == Uploaded(JOB, 1, None, local_size(d), res.seconds, True, False, store.url("j/step-1"))
    assert res.seconds >= 0
    assert threads == ["ckptd-upload"]  # the initializer ran once, on the upload thread
    for name in os.listdir(d):
        with open(os.path.join(d, name), "rb") as f:
            assert store.objects[bucket_key(JOB, 1, name)] == f.read()
    puts = [k for op, k in store.calls if op == "put"]
    assert puts[-1] == bucket_key(JOB, 1, MANIFEST)  # the manifest last: the step is never seen half-uploaded
    assert remote_steps(store, JOB) == ([1], [])
    assert up.pending(JOB) == set() and up.backlog() == [] and up.current is None


def test_failed_upload_is_reported_and_the_thread_goes_on(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write_step(root, JOB, 1)
    write_step(root, JOB, 2)
    mem = MemoryStore()
    store = FaultyStore(mem, put_bytes=[0])  # step 1's manifest (the first put_bytes)
    results = Results()
    up = make_uploader(store, root, results)
    try:
        up.submit(JOB, 1, 1)
        first = results.wait(1)[0]
        assert first.job == JOB and first.step == 1
        assert first.error is not None and "injected failure" in first.error and MANIFEST in first.error
        assert not first.complete and not first.multi_node
        assert remote_steps(mem, JOB) == ([], [1])  # data without a manifest: not a checkpoint
        up.submit(JOB, 2, 1)
        second = results.wait(2)[1]
    finally:
        up.close()
    assert second.step == 2 and second.error is None and second.complete
    # step 1's partial upload is older than the newest complete step: retention removes it
    assert remote_steps(mem, JOB) == ([2], [])


def test_a_raising_done_callback_does_not_stop_the_thread(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write_step(root, JOB, 1)
    write_step(root, "other", 1)
    results = Results(fail_first=True)
    up = make_uploader(MemoryStore(), root, results)
    try:
        up.submit(JOB, 1, 1)
        results.wait(1)
        up.submit("other", 1, 1)
        got = results.wait(2)
    finally:
        up.close()
    assert [(r.job, r.step, r.error) for r in got] == [(JOB, 1, None), ("other", 1, None)]


# ---------------------------------------------------------------------------- skipping queued steps


def test_queued_step_skipped_when_a_newer_one_of_the_job_is_queued(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    for s in (1, 2, 3, 4):
        write_step(root, JOB, s)
    store, results = GatedStore(), Results()
    up = make_uploader(store, root, results)
    try:
        hold_first_upload(up, store, JOB, 1)
        for s in (2, 3, 4):
            up.submit(JOB, s, 1)
        assert up.current is not None and (up.current.job, up.current.step) == (JOB, 1)
        assert up.backlog() == [(JOB, 2), (JOB, 3), (JOB, 4)]
        assert up.pending(JOB) == {1, 2, 3, 4}  # local retention leaves queued and uploading steps alone
        assert up.pending("other") == set()
        store.gate.set()
    finally:
        store.gate.set()
        up.close()
    assert results.steps() == [(JOB, 1), (JOB, 4)]
    assert all(r.error is None and r.complete for r in results.items)
    assert put_steps(store) == {1, 4}  # nothing of the skipped steps reached the bucket
    assert remote_steps(store, JOB) == ([1, 4], [])
    assert up.pending(JOB) == set() and up.backlog() == []


def test_after_a_rollback_a_queued_step_is_skipped_only_for_a_step_committed_later_not_a_higher_number(tmp_path: Path) -> None:
    """A run rolled back from step 8 to 4 saves 5; step 8 of the abandoned line is queued again behind it (a name
    protects it, so it goes up again). Skipping compared step numbers: 8 > 5 skipped the new line's newest step, and
    the bucket lacked it. Newer means committed later (found by a review of the storage path)."""
    root = str(tmp_path / "root")
    for s, at in ((8, 100), (4, 200), (5, 300)):
        write_step(root, JOB, s, at=at)
    store, results = GatedStore(), Results()
    up = make_uploader(store, root, results)
    try:
        hold_first_upload(up, store, JOB, 4)
        up.submit(JOB, 5, 1)
        up.submit(JOB, 8, 1, catch_up=True)
        store.gate.set()
    finally:
        store.gate.set()
        up.close()
    assert results.steps() == [(JOB, 4), (JOB, 5), (JOB, 8)]


def test_keep_every_steps_and_other_jobs_are_not_skipped(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    for s in (1, 2, 3, 5):
        write_step(root, "a", s)
    write_step(root, "b", 1)
    store, results = GatedStore(), Results()
    up = make_uploader(store, root, results, keep=1, keep_every=2)
    try:
        hold_first_upload(up, store, "a", 1)
        for job, s in (("a", 2), ("a", 3), ("b", 1), ("a", 5)):
            up.submit(job, s, 1)
        store.gate.set()
    finally:
        store.gate.set()
        up.close()
    # a2: kept forever by keep_every; a3: a newer step of "a" is queued; b1: no newer step of "b"
    assert results.steps() == [("a", 1), ("a", 2), ("b", 1), ("a", 5)]
    assert all(r.error is None for r in results.items)
    assert put_steps(store, "a") == {1, 2, 5}
    assert remote_steps(store, "a") == ([2, 5], []) and remote_steps(store, "b") == ([1], [])


def test_a_protected_step_is_neither_skipped_nor_removed_from_the_bucket(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    for s in (1, 2, 3, 4):
        write_step(root, JOB, s)
    store, results = GatedStore(), Results()
    up = make_uploader(store, root, results, keep=1)
    up.protected = lambda job: Protect(frozenset({2} if job == JOB else ()))  # a name protects step 2 (daemon/protected.py)
    try:
        hold_first_upload(up, store, JOB, 1)
        for s in (2, 3, 4):
            up.submit(JOB, s, 1)
        store.gate.set()
    finally:
        store.gate.set()
        up.close()
    assert results.steps() == [(JOB, 1), (JOB, 2), (JOB, 4)]  # 3 skipped as usual; 2 uploaded although 4 was queued
    assert remote_steps(store, JOB) == ([2, 4], [])  # keep 1, plus the protected step


def test_multi_node_step_is_never_skipped(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write_step(root, JOB, 1)
    write_rank(root, JOB, 2, 0, 1)  # this node's part of step 2, durable in step-2.tmp (one rank: completes at once)
    write_step(root, JOB, 3)
    store, results = GatedStore(), Results()
    up = make_uploader(store, root, results)
    try:
        hold_first_upload(up, store, JOB, 1)
        up.submit(JOB, 2, 1, ranks=[0], node=handed(root, 2))
        up.submit(JOB, 3, 1)
        store.gate.set()
    finally:
        store.gate.set()
        up.close()
    assert results.steps() == [(JOB, 1), (JOB, 2), (JOB, 3)]
    two = results.items[1]
    assert two.error is None and two.complete and two.multi_node and two.url == store.url("j/step-2")
    assert remote_steps(store, JOB) == ([1, 2, 3], [])
    assert not os.path.exists(tmp_dir(root, JOB, 2))  # the bucket holds it now


# ---------------------------------------------------------------------------- multi node


def test_two_nodes_complete_a_step_in_the_bucket(tmp_path: Path) -> None:
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for rank, root in enumerate(roots):
        write_rank(root, JOB, 7, rank, 2)
    store = MemoryStore()
    results = [Results(), Results()]
    ups = [make_uploader(store, root, res) for root, res in zip(roots, results)]
    try:
        for rank, up in enumerate(ups):
            up.submit(JOB, 7, 2, ranks=[rank], node=handed(roots[rank], 7))
        got = [res.wait(1)[0] for res in results]
    finally:
        for up in ups:
            up.close()
    for res in got:
        assert (res.job, res.step, res.error, res.complete, res.multi_node) == (JOB, 7, None, True, True)
        assert res.url == store.url("j/step-7") and res.nbytes > 0
    for root in roots:
        assert not os.path.exists(tmp_dir(root, JOB, 7))
    assert remote_steps(store, JOB) == ([7], [])
    # every rank's files were put once each, its shard before its fragment
    for rank in (0, 1):
        keys = [k for op, k in store.calls if op == "put" and k != bucket_key(JOB, 7, MANIFEST)]
        mine = [k for k in keys if f"rank-{rank:05d}" in k]
        assert mine == [bucket_key(JOB, 7, n) for n in rank_files([rank])]
    # the merged step is a sound checkpoint: it downloads (every checksum verified) into a fresh root
    path = download_step(store, str(tmp_path / "fresh"), JOB, 7)
    assert path == step_dir(str(tmp_path / "fresh"), JOB, 7) and os.path.exists(os.path.join(path, MANIFEST))


def test_multi_node_step_times_out_naming_the_step(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write_rank(root, JOB, 7, 0, 2)  # rank 1's node never uploads
    store, results = MemoryStore(), Results()
    res, up = upload_part(store, root, results, 7, commit_timeout=0.5)
    assert res.job == JOB and res.step == 7 and not res.complete and res.multi_node
    assert res.error is not None and "step 7 of job j" in res.error and "not every rank" in res.error
    assert not store.exists(bucket_key(JOB, 7, MANIFEST))
    assert remote_steps(store, JOB) == ([], [7])
    assert node_parts(root, JOB) == {}  # this node's part is removed: the step can never complete (its track is failed)
    assert up.pending(JOB) == set()


def test_inconsistent_fragments_fail_the_multi_node_step(tmp_path: Path) -> None:
    """try_complete's CheckpointError (here: rank 1's fragment without its shard) is the step's error."""
    roots = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    for rank, root in enumerate(roots):
        write_rank(root, JOB, 7, rank, 2)
    store, results = MemoryStore(), Results()
    store.put_file(bucket_key(JOB, 7, rank_files([1])[1]), os.path.join(tmp_dir(roots[1], JOB, 7), rank_files([1])[1]))
    up = make_uploader(store, roots[0], results)
    try:
        up.submit(JOB, 7, 2, ranks=[0], node=handed(roots[0], 7))
        (res,) = results.wait(1)
    finally:
        up.close()
    assert res.error is not None and "rank 1's fragment is in the bucket but its shard is not" in res.error
    assert not res.complete and res.multi_node


# ---------------------------------------------------------------------------- retention and catch-up


def test_bucket_retention_after_each_upload(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    for s in range(1, 6):
        write_step(root, JOB, s)
    store, results = MemoryStore(), Results()
    store.put_bytes(bucket_key(JOB, 0, "rank-00000.safetensors"), b"left by a crash")  # a stale partial upload
    seen = []
    up = make_uploader(store, root, results, keep=1, keep_every=2)
    try:
        for s in range(1, 6):
            up.submit(JOB, s, 1)
            results.wait(s)
            seen.append(remote_steps(store, JOB))
    finally:
        up.close()
    # keep=1: the newest step; keep_every=2: every 2nd step forever; the stale partial step 0 went with the first upload
    assert seen == [([1], []), ([2], []), ([2, 3], []), ([2, 4], []), ([2, 4, 5], [])]
    assert [op for op, k in store.calls if k.startswith("j/step-0/") and op != "list"] == ["put", "delete"]


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_retention_failure_after_an_upload_never_fails_the_step_it_follows(tmp_path: Path, nodes: int) -> None:
    """The bucket refuses to delete an old step (a policy without DeleteObject, or retries exhausted) while
    retention prunes it: the step just uploaded is complete in the bucket, and its waiters must hear so; the
    retention's failure is reported on its own."""
    roots = [str(tmp_path / f"node{i}") for i in range(nodes)]
    store, results = MemoryStore(), Results()
    upload_step(store, write_step(str(tmp_path / "old"), JOB, 5), JOB, 5)  # complete, older: retention prunes it
    real_delete = store.delete

    def delete(rels: list[str]) -> None:
        if any(r.startswith(f"{JOB}/step-5/") for r in rels):
            raise CheckpointError(f"injected failure: delete {rels[0]}")
        real_delete(rels)

    def delete_if(rel: str, tag: str) -> bool:
        delete([rel])
        return True

    store.delete = delete  # type: ignore[method-assign]
    store.delete_if = delete_if  # type: ignore[method-assign]
    if nodes == 1:
        write_step(roots[0], JOB, 10, at=10)
    else:
        for rank, root in enumerate(roots):
            write_rank(root, JOB, 10, rank, 2, at=10, run=5)
        upload_ranks(store, tmp_dir(roots[1], JOB, 10), JOB, 10, [1], attempt=(5, None))
    up = make_uploader(store, roots[0], results, keep=1)
    try:
        up.submit(JOB, 10, nodes, ranks=None if nodes == 1 else [0], node="" if nodes == 1 else handed(roots[0], 10))
        (res,) = results.wait(1)
    finally:
        up.close()
    assert res.error is None and res.complete, res
    assert res.retention_error is not None and "injected failure: delete" in res.retention_error
    assert remote_steps(store, JOB)[0] == [5, 10]


def test_retention_spares_the_partial_upload_of_a_queued_step(tmp_path: Path) -> None:
    here, there = str(tmp_path / "node0"), str(tmp_path / "node1")
    for s in (3, 5):
        write_rank(here, JOB, s, 0, 2)
        write_rank(there, JOB, s, 1, 2)
    store, results = GatedStore(), Results()
    store.gate.set()
    for s in (3, 5):  # the other node's part of both steps is in the bucket already
        upload_ranks(store, tmp_dir(there, JOB, s), JOB, s, [1])
    store.gate.clear()
    store.entered.clear()
    up = make_uploader(store, here, results, commit_timeout=5.0)
    try:
        up.submit(JOB, 5, 2, ranks=[0], node=handed(here, 5))
        assert store.entered.wait(WAIT_S)
        up.submit(JOB, 3, 2, ranks=[0], node=handed(here, 3))  # queued while step 5 uploads: 3 is older than the newest complete step
        store.gate.set()
        got = results.wait(2)
        after5 = got[0]
    finally:
        store.gate.set()
        up.close()
    assert [(r.step, r.error, r.complete) for r in got] == [(5, None, True), (3, None, True)]
    assert after5.multi_node
    # step 3 completed although step 5's retention ran while only rank 1 of it was in the bucket
    assert remote_steps(store, JOB) == ([3, 5], [])
    assert not any(op == "delete" for op, _ in store.calls)


def test_catch_up_queues_newest_and_forever_steps_and_skips_those_in_the_bucket(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    for s in range(1, 6):
        write_step(root, JOB, s)
    store, results = MemoryStore(), Results()
    upload_step(store, step_dir(root, JOB, 4), JOB, 4)  # a previous run uploaded step 4
    before = len(store.calls)
    up = make_uploader(store, root, results, keep=1, keep_every=2)
    try:
        up.catch_up(JOB, [1, 2, 3, 4, 5])
        got = results.wait(3)
        up.catch_up("empty", [])  # a job without complete steps queues nothing
    finally:
        up.close()
    assert [(r.step, r.error, r.complete) for r in got] == [(2, None, True), (4, None, True), (5, None, True)]
    assert got[0].nbytes == local_size(step_dir(root, JOB, 2)) and got[2].nbytes == local_size(step_dir(root, JOB, 5))
    assert got[1].nbytes == 0 and got[1].url == store.url("j/step-4")  # already there: not sent again
    assert not got[1].multi_node
    new_puts = {p[0] for op, k in store.calls[before:] if op == "put" and (p := parse_bucket_key(JOB, k)) is not None}
    assert new_puts == {2, 5}
    assert remote_steps(store, JOB) == ([2, 4, 5], [])
    assert len(results.items) == 3


# ---------------------------------------------------------------------------- close


@pytest.mark.parametrize("finish_queue", [True, False])
def test_close_finishes_the_upload_in_progress_and_the_queue_unless_told_not_to(tmp_path: Path, finish_queue: bool) -> None:
    # finish_queue=False: a daemon whose start failed after its catch-up queued uploads (its metrics port taken)
    # must not upload a whole backlog, possibly for hours, before it exits; the next start's catch-up queues them
    root = str(tmp_path / "root")
    for job in ("a", "b", "c"):
        write_step(root, job, 1)
    store, results = GatedStore(), Results()
    up = make_uploader(store, root, results)
    closer = threading.Thread(target=up.close, kwargs={"finish_queue": finish_queue}, daemon=True)
    try:
        hold_first_upload(up, store, "a", 1)
        up.submit("b", 1, 1)
        up.submit("c", 1, 1)
        closer.start()  # close while "a" is uploading and "b", "c" are queued
        deadline = time.monotonic() + WAIT_S
        while not finish_queue and up.backlog() and time.monotonic() < deadline:  # dropped while "a" still uploads
            time.sleep(0.01)
        store.gate.set()
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close() did not return"
    finally:
        store.gate.set()
        up.close()
    if not finish_queue:
        assert results.steps() == [("a", 1)] and remote_steps(store, "b") == ([], [])
        return
    assert results.steps() == [("a", 1), ("b", 1), ("c", 1)]
    assert all(r.error is None and r.complete for r in results.items)
    assert remote_steps(store, "b") == ([1], []) and remote_steps(store, "c") == ([1], [])


def test_catch_up_sends_a_step_that_replaced_the_bucket_s_older_step_of_its_number(tmp_path: Path) -> None:
    """The bucket holds the old line's step 4; a rolled-back run's step 4 replaced it here and the daemon
    restarted before uploading it: the catch-up sends it (the bucket's is an older commit), not skips it."""
    root, other = str(tmp_path / "root"), str(tmp_path / "other")
    store, results = MemoryStore(), Results()
    upload_step(store, write_step(other, JOB, 4, at=1_000), JOB, 4)
    write_step(root, JOB, 4, at=2_000)
    up = make_uploader(store, root, results)
    try:
        up.catch_up(JOB, [4])
        (got,) = results.wait(1)
    finally:
        up.close()
    assert got.error is None and got.complete and got.nbytes == local_size(step_dir(root, JOB, 4))
    assert bucket_committed_at(store, JOB, 4) == 2_000


def clocked_uploader(store: MemoryStore, root: str) -> tuple[Uploader, list[float]]:
    """An uploader (commit_timeout 60 s) whose clock the test moves: ``now[0]``, from 100."""
    now = [100.0]
    up = make_uploader(store, root, Results(), commit_timeout=60.0)
    up.clock = lambda: now[0]
    return up, now


def seen(up: Uploader, store: MemoryStore, step: int) -> bool:
    """What the uploader's retention pass asks of a partial step of ``JOB``: every object under its prefix."""
    return up._settled(JOB)(step, frozenset(store.list_tagged(bucket_prefix(JOB, step)).items()))


def test_a_multinode_partial_step_is_settled_once_its_objects_stay_unchanged_for_commit_timeout(tmp_path: Path) -> None:
    """Retention's test for a multi-node job's partial steps: objects unchanged since this uploader first saw
    them, for longer than any node waits for the others (commit_timeout)."""
    store, now = MemoryStore(), [100.0]
    up = make_uploader(store, str(tmp_path), Results(), commit_timeout=60.0)
    up.clock = lambda: now[0]
    try:
        store.put_bytes(bucket_key(JOB, 4, "rank-00000.safetensors"), b"x")
        settled = partial(seen, up, store)
        assert settled(4) is False  # first seen now
        now[0] += 59.0
        assert settled(4) is False
        store.put_bytes(bucket_key(JOB, 4, "rank-00000.json"), b"{}")  # another node is still uploading it
        now[0] += 30.0
        assert settled(4) is False  # changed: the wait starts again
        now[0] += 60.0
        assert settled(4) is True
    finally:
        up.close()


def test_a_new_attempts_part_under_the_names_of_one_given_up_long_ago_is_not_settled(tmp_path: Path) -> None:
    """Node 1's retention once saw step 4 partial (node 0's part of an attempt that later completed and was
    pruned). After a rollback, node 0 uploads its part of a new attempt of step 4: the same object names.
    Settling compared names only, and the old sighting counted: node 1 deleted node 0's in-flight part, and the
    step could never complete. Objects are told apart by their tags now."""
    store = MemoryStore()
    up, now = clocked_uploader(store, str(tmp_path / "node1"))
    node0 = str(tmp_path / "node0")
    try:
        write_rank(node0, JOB, 4, 0, 2, at=10, run=11)
        upload_ranks(store, tmp_dir(node0, JOB, 4), JOB, 4, [0])
        assert seen(up, store, 4) is False  # first seen
        store.delete(store.list(f"{JOB}/step-4/"))  # the old attempt went on, completed, and was pruned
        now[0] += 600.0  # ten minutes later a rollback saves step 4 again
        write_rank(node0, JOB, 4, 0, 2, at=5000, run=22)
        upload_ranks(store, tmp_dir(node0, JOB, 4), JOB, 4, [0])
        assert seen(up, store, 4) is False  # new objects: the wait starts again
        now[0] += 61.0
        assert seen(up, store, 4) is True
    finally:
        up.close()


def complete_in_bucket(store: MemoryStore, tmp_path: Path, step: int, attempt: tuple[int, int | None], at: int) -> None:
    """Step ``step`` of JOB over two nodes (one rank each), saved by ``attempt`` and complete in the bucket."""
    for rank in (0, 1):
        root = str(tmp_path / f"{attempt[0]}-node{rank}")
        write_rank(root, JOB, step, rank, 2, at=at, run=attempt[0], after=attempt[1])
        upload_ranks(store, tmp_dir(root, JOB, step), JOB, step, [rank], attempt=attempt)
    assert try_complete(store, JOB, step, 2, attempt) is True


def test_another_attempts_objects_under_a_complete_step_go_once_settled_never_the_steps_own(tmp_path: Path) -> None:
    """Step 4 is complete in the bucket, saved by launch 22 (which had restored step 2); beside it lies the part
    of launch 11, a dead attempt uploaded late, in its own folder. Retention removes that folder once it has
    stayed unchanged for commit_timeout (every node waiting for it has given up), and never the step's files."""
    store, now = MemoryStore(), [100.0]
    complete_in_bucket(store, tmp_path, 4, (22, 2), at=2_000)
    own = dict(store.objects)
    dead = str(tmp_path / "dead")
    write_rank(dead, JOB, 4, 0, 2, at=1_000, run=11)
    upload_ranks(store, tmp_dir(dead, JOB, 4), JOB, 4, [0], attempt=(11, None))
    up = make_uploader(store, str(tmp_path / "node2"), Results(), commit_timeout=60.0)
    up.clock = lambda: now[0]
    try:
        for dt in (0.0, 59.0):  # first seen, then not yet settled
            now[0] += dt
            assert apply_remote_retention(store, JOB, KeepLatest(0), settled=up._settled(JOB)) == []
            assert store.objects.keys() - own.keys() == {bucket_key(JOB, 4, f"run-11-after-none/{n}") for n in rank_files([0])}
        now[0] += 2.0
        assert apply_remote_retention(store, JOB, KeepLatest(0), settled=up._settled(JOB)) == []
        assert store.objects == own
    finally:
        up.close()


def test_a_complete_step_retention_removes_leaves_another_attempts_part_on_its_way_up(tmp_path: Path) -> None:
    """Retention prunes step 4 (launch 22's), while a rollback, launch 33 (it restored step 3), is uploading its
    step 4 into its own folder: only launch 22's files go; launch 33's part stays, a partial step now, and is
    removed only once settled."""
    store = MemoryStore()
    complete_in_bucket(store, tmp_path, 4, (22, 2), at=2_000)
    complete_in_bucket(store, tmp_path, 5, (22, 2), at=3_000)
    node = str(tmp_path / "rollback")
    write_rank(node, JOB, 4, 0, 2, at=4_000, run=33, after=3)
    upload_ranks(store, tmp_dir(node, JOB, 4), JOB, 4, [0], attempt=(33, 3))
    in_flight = {k: v for k, v in store.objects.items() if "/run-33-after-3/" in k}
    up = make_uploader(store, str(tmp_path / "node2"), Results(), commit_timeout=60.0)
    try:
        assert apply_remote_retention(store, JOB, KeepLatest(1), settled=up._settled(JOB)) == [4]
        assert {k: v for k, v in store.objects.items() if k.startswith(f"{JOB}/step-4/")} == in_flight
        assert remote_steps(store, JOB) == ([5], [4])
    finally:
        up.close()


def test_a_part_uploaded_again_with_the_same_bytes_after_a_restart_is_not_settled(tmp_path: Path) -> None:
    """Node 0's daemon uploaded its part of step 4, died, and uploads the same bytes again after its restart
    (then waits commit_timeout for node 1's part). The ETags are the same: only the write time tells node 2's
    retention that the part changed, so it does not delete it from under the waiting node."""
    store = MemoryStore()
    up, now = clocked_uploader(store, str(tmp_path / "node2"))
    node0 = str(tmp_path / "node0")
    try:
        write_rank(node0, JOB, 4, 0, 2, at=10, run=11)
        upload_ranks(store, tmp_dir(node0, JOB, 4), JOB, 4, [0], attempt=(11, None))
        assert seen(up, store, 4) is False  # first seen
        now[0] += 50.0
        upload_ranks(store, tmp_dir(node0, JOB, 4), JOB, 4, [0], attempt=(11, None))  # after the restart
        now[0] += 11.0
        assert seen(up, store, 4) is False  # written again: the wait starts again
        now[0] += 60.0
        assert seen(up, store, 4) is True
    finally:
        up.close()


def test_a_nodes_part_that_may_not_replace_the_buckets_step_is_refused_and_removed(tmp_path: Path) -> None:
    """The bucket holds step 3, complete (launch 11). A node's part of step 3 by launch 22, which restored no
    step (its daemon had forgotten step 3: a restart), must not overwrite it: the upload fails saying why,
    and the part, which can never complete, is removed."""
    old, here = str(tmp_path / "old"), str(tmp_path / "here")
    store, results = MemoryStore(), Results()
    for r in (0, 1):
        write_rank(old, JOB, 3, r, 2, at=1_000, run=11)
    upload_ranks(store, tmp_dir(old, JOB, 3), JOB, 3, [0, 1])
    store.put_bytes(bucket_key(JOB, 3, MANIFEST), b'{"run": 11, "after": null, "committed_at": 1000}')
    write_rank(here, JOB, 3, 0, 2, at=5_000, run=22)
    before = dict(store.objects)
    res, _ = upload_part(store, here, results, 3, commit_timeout=5.0)
    assert res.error is not None and "is complete in the bucket" in res.error and "restored no step" in res.error
    assert store.objects == before  # nothing of the bucket's step 3 was touched
    assert not os.path.exists(tmp_dir(here, JOB, 3))


def test_a_given_up_attempt_stops_between_objects_and_the_next_upload_goes_on(tmp_path: Path) -> None:
    # a relaunch saves the step again while this node's part of the dead run's attempt is still going up: the upload
    # stops before its next object (seen in review: raised from the progress callback, on a transfer thread, it was
    # taken for a network error and retried 7 to 42 times, using up the S3 client's retry quota) and its part goes
    root = str(tmp_path / "root")
    for rank in (0, 1):
        write_rank(root, JOB, 7, rank, 4, run=11)
    old = handed(root, 7)
    store, results = GatedStore(), Results()
    up = make_uploader(store, root, results, commit_timeout=1.0)
    try:
        up.submit(JOB, 7, 4, ranks=[0, 1], node=old, attempt=1)
        assert store.entered.wait(WAIT_S), "the upload never started"
        up.give_up(JOB, 7, 1)
        assert os.path.isdir(old + GONE) and not os.path.exists(old), "marked at once: a restart never uploads it again"
        for rank in (0, 1):
            write_rank(root, JOB, 7, rank, 4, run=22)
        up.submit(JOB, 7, 4, ranks=[0, 1], node=handed(root, 7), attempt=2)  # the relaunch's part, queued behind it
        store.gate.set()
        stopped, nxt = results.wait(2)
    finally:
        store.gate.set()
        up.close()
    assert stopped.given_up and not stopped.complete and "this attempt was given up" in (stopped.error or "")
    old_puts = [k for op, k in store.calls if op == "put" and "run-11" in k]
    assert len(old_puts) <= 1, f"the given-up attempt went on uploading: {old_puts}"  # the object in flight at most
    assert not os.path.exists(old) and not os.path.exists(old + GONE) and nxt.attempt == 2 and not nxt.given_up
    assert nxt.error is not None and "not every rank" in nxt.error  # ranks 2 and 3 never come here: it waited its turn


def test_a_given_up_attempt_on_a_real_bucket_stops_within_its_object_and_retries_nothing(tmp_path: Path, s3_bucket: Any) -> None:
    # moto's S3, 4 MB/s: rank 0's 12 MB shard goes up in three 5 MB parts while the attempt is given up. Raised from the
    # progress callback, the stop was taken for a network error: every part was sent again and again (review: 41 retries
    # for 40 MB, the client's retry quota down from 500 to 11), and the next object was tried too
    import dataclasses

    from ckptd.storage.s3 import S3Store

    root = str(tmp_path / "root")
    for rank, n in ((0, 3 << 20), (1, 1024)):
        w = torch.zeros(n, dtype=torch.float32)
        data = shard_bytes([("model/w", w, (4 * n,), (rank * n,))])
        tree = {"w": {"__ckptd__": "tensor", "key": "model/w"}}
        write_shard(root, ShardWrite(JOB, 7, rank, 4, memoryview(data), len(data), tree, local_world_size=2, committed_at=5, run=11))
    part = handed(root, 7)
    sends: list[str] = []
    results = Results()
    cfg = dataclasses.replace(s3_bucket, max_bandwidth=4 << 20, part_size=5 << 20)
    with S3Store(cfg) as store:
        store.client.meta.events.register("before-send.s3", lambda request, **kw: sends.append(request.url))
        up = make_uploader(store, root, results, commit_timeout=30.0)
        try:
            up.submit(JOB, 7, 4, ranks=[0, 1], node=part, attempt=1)
            deadline = time.monotonic() + WAIT_S
            while (up.current is None or up.current.bytes_done == 0) and time.monotonic() < deadline:
                time.sleep(0.01)
            up.give_up(JOB, 7, 1)
            (res,) = results.wait(1)
        finally:
            up.close()
    assert res.given_up and "this attempt was given up" in (res.error or "")
    mine = [u for u in sends if "run-11" in u]
    assert not any("rank-00001" in u for u in mine), "the next object was sent after the attempt was given up"
    assert len(mine) <= 6, f"{len(mine)} requests for one 12 MB object in 5 MB parts: retried? {mine}"
    assert not os.path.exists(part) and not os.path.exists(part + GONE)


def test_giving_up_an_attempt_whose_upload_already_ended_holds_nothing(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    write_rank(root, JOB, 8, 0, 1)
    store, results = MemoryStore(), Results()
    up = make_uploader(store, root, results)
    try:
        up.submit(JOB, 8, 1, ranks=[0], node=handed(root, 8), attempt=3)
        (res,) = results.wait(1)
        up.give_up(JOB, 8, 3)  # its result was on its way to the loop when a relaunch took the step over
        up.give_up(JOB, 9, 4)  # or nothing of it was ever queued here
        assert res.complete and up._given_up == set(), "a give-up no upload will ever clear stays for the daemon's life"
    finally:
        up.close()
