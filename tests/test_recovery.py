"""Crash recovery at start-up without the daemon's socket (:mod:`ckptd.daemon.recovery`): what a previous
run left in shared memory and under the root. Segments with a commit record are adopted and handed to
``persist`` (and made durable by the real Persister and Completion); a segment without a record, with an
unreadable record, or of a step already complete is unlinked; a partial step with every fragment is
finalized, one that no shard can complete is removed, one a recovered shard can complete is kept; this
node's whole part of a multi-node step goes to the uploader again.

Real /dev/shm segments (each test's own namespace, unlinked at teardown) and a real root under ``tmp_path``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _rig import JOB, FakeUploader, Rig, old_record, record, shard, tear_down, tree

from ckptd import shm
from ckptd.daemon import recovery
from ckptd.daemon.slots import Slot, SlotState
from ckptd.daemon.steps import StepState
from ckptd.errors import CheckpointError
from ckptd.layout import GONE, fragment_name, fragments_present, is_complete, node_parts, shard_name, step_dir, tmp_dir
from ckptd.protocol import CommitRecord, validate_record
from ckptd.storage import local
from ckptd.storage.retention import KeepLatest
from ckptd.storage.verify import verify_checkpoint
from ckptd.validate import read_manifest


def write_fragment(
    root: str,
    step: int,
    rank: int,
    world_size: int,
    lws: int | None = None,
    *,
    row: int | None = None,
    at: int | None = None,
    run: int | None = None,
) -> None:
    """Rank ``rank``'s shard and fragment in ``step-N.tmp``, as a persist thread of the previous run wrote them
    (from a commit record like :func:`_rig.record`'s; ``at``: its ``committed_at``; ``run``: its launch, if named)."""
    data = shard(step, rank, world_size, row=row)
    at = record(step, rank, world_size, len(data), at=at)["committed_at"]
    tr = json.loads(tree(rank))
    local.write_shard(
        root, local.ShardWrite(JOB, step, rank, world_size, memoryview(data), len(data), tr, local_world_size=lws, committed_at=at, run=run)
    )


def complete_step(root: str, step: int, world_size: int) -> str:
    for r in range(world_size):
        write_fragment(root, step, r, world_size)
    return local.finalize_step(root, JOB, step, world_size)


class Node(Rig):
    """One node's root and shared-memory namespace: what a previous run left, and this run's components."""

    def __init__(self, root: str, uploader: FakeUploader | None) -> None:
        super().__init__(root, uploader=uploader)
        self.handed: list[Slot] = []

    # what the previous run left in shared memory

    def segment(self, data: bytes = b"", rec: dict[str, Any] | None = None, *, raw_record: bytes | None = None) -> str:
        """A segment of this daemon's directory holding ``data``, with commit record ``rec`` written as a daemon before
        typed records wrote it (tree added), or the bytes ``raw_record`` (as the daemon's own file: mode 0600)."""
        name, _ = self.pool.segments.create(max(len(data), 1))
        with open(shm.path_of(name), "r+b") as f:
            f.write(data)
        if rec is not None:
            raw_record = old_record(rec, tree(rec.get("rank", 0)))
        if raw_record is not None:
            with open(os.open(shm.path_of(name) + shm.RECORD_SUFFIX, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(raw_record)
        return name

    def committed(self, step: int, rank: int, world_size: int, lws: int | None = None, at: int | None = None) -> str:
        data = shard(step, rank, world_size)
        return self.segment(data, record(step, rank, world_size, len(data), lws, at))

    # this run

    def recover(self, persist: bool = True) -> None:
        """``recovery.recover`` over the job directories, as ``Daemon.serve`` calls it; ``persist=False``
        only records what it hands to ``persist``."""

        def hand(slot: Slot) -> None:
            self.handed.append(slot)
            if persist:
                self.completion.persist(slot)

        recovery.recover(self.pool, self.steps, self.persister, self.uploader, self.root, self.catalog.jobs(), hand)  # type: ignore[arg-type]


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    root = str(tmp_path / "root")
    os.makedirs(os.path.join(root, JOB))
    made: list[Rig] = []

    def make(uploader: bool = True) -> Node:
        node = Node(root, FakeUploader() if uploader else None)
        made.append(node)
        return node

    try:
        yield make
    finally:
        tear_down(made, root)


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node()


def partial_dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(root, JOB)) if n.endswith(".tmp"))


# ---------------------------------------------------------------------------- segments


def test_segments_with_commit_records_are_adopted_and_handed_to_persist(node: Node) -> None:
    a = node.committed(step=5, rank=1, world_size=2)
    b = node.committed(step=5, rank=0, world_size=2)
    c = node.committed(step=6, rank=0, world_size=1)
    node.recover(persist=False)

    assert sorted(s.name for s in node.handed) == sorted([a, b, c])
    for name, (step, rank, ws) in {a: (5, 1, 2), b: (5, 0, 2), c: (6, 0, 1)}.items():
        slot = node.pool.get(name)
        assert slot is not None and slot.state is SlotState.COMMITTED and slot.owner == (JOB, rank)
        assert slot.record == CommitRecord(**record(step, rank, ws, len(shard(step, rank, ws))), tree=tree(rank))
        assert slot.lease is None and slot.tree_bytes == len(tree(rank))
        assert slot.size == node.pool.segments.size_of(name)
    five, six = node.steps.get((JOB, 5)), node.steps.get((JOB, 6))
    assert five is not None and (five.world_size, five.local_world_size, five.committed) == (2, 2, {0, 1})
    assert six is not None and six.committed == {0} and six.state is StepState.PENDING and six.inflight == 0
    assert shm.segments_of(node.root) == sorted([a, b, c])
    # a new lease never gets the name of a segment found
    slot = node.pool.lease({"job": JOB, "rank": 0, "world_size": 1, "step": 7, "nbytes": 10, "pid": os.getpid()})
    assert slot is not None and slot.name not in (a, b, c)


def test_recovered_shards_are_persisted_into_a_durable_step(node: Node) -> None:
    names = [node.committed(step=8, rank=r, world_size=2) for i, r in enumerate((1, 0))]
    node.recover()
    assert node.steps.get((JOB, 8)).inflight == 2
    evs = node.pump(2)

    path = step_dir(node.root, JOB, 8)
    assert all(ev.error is None for ev in evs) and [ev.path for ev in evs if ev.path] == [path]
    assert verify_checkpoint(path) == []
    manifest = read_manifest(path)
    assert sorted(manifest["files"]) == [shard_name(0), shard_name(1)]
    assert [r["tree"] for r in manifest["ranks"]] == [json.loads(tree(0)), json.loads(tree(1))]
    assert node.steps.get((JOB, 8)).state is StepState.DURABLE and node.counters.steps_committed == 1
    assert local.latest_step(node.root, JOB) == (8, path)
    for name in names:  # persisted: the record is dropped, the segment kept as a free slot
        assert node.pool.segments.read_record(name) is None and node.pool.get(name).state is SlotState.FREE
    assert node.uploader.submitted == [(JOB, 8, 2, None)]


def _no_record(node: Node) -> str:
    return node.segment(shard(1, 0, 1))


def _torn_record(node: Node) -> str:
    return node.segment(shard(1, 0, 1), raw_record=b'{"job":"j","rank":0,"world_si')


def _not_an_object(node: Node) -> str:
    return node.segment(shard(1, 0, 1), raw_record=b"[1, 2, 3]")


def _no_world_size(node: Node) -> str:
    rec = record(1, 0, 1, len(shard(1, 0, 1)))
    del rec["world_size"]
    return node.segment(shard(1, 0, 1), rec)


def _no_rank(node: Node) -> str:
    rec = record(1, 0, 1, len(shard(1, 0, 1)))
    del rec["rank"]
    return node.segment(shard(1, 0, 1), rec)


def _job_not_a_string(node: Node) -> str:
    return node.segment(shard(1, 0, 1), {**record(1, 0, 1, len(shard(1, 0, 1))), "job": 17})


def _step_already_complete(node: Node) -> str:
    complete_step(node.root, 1, 1)  # the previous run finalized it just before dying
    return node.committed(step=1, rank=0, world_size=1)


def _job_escapes_the_root(node: Node) -> str:
    return node.segment(shard(1, 0, 1), {**record(1, 0, 1, len(shard(1, 0, 1))), "job": "../escape"})


def _world_of_2_40(node: Node) -> str:
    return node.segment(shard(1, 0, 1), {**record(1, 0, 1, len(shard(1, 0, 1))), "world_size": 2**40})


def _rank_beyond_world(node: Node) -> str:
    return node.segment(shard(1, 0, 1), {**record(1, 0, 1, len(shard(1, 0, 1))), "rank": 3})


def _more_bytes_than_the_segment(node: Node) -> str:
    return node.segment(shard(1, 0, 1), {**record(1, 0, 1, len(shard(1, 0, 1))), "nbytes": 1 << 40})


@pytest.mark.parametrize(
    "leave",
    [
        _no_record, _torn_record, _not_an_object, _no_world_size, _no_rank, _job_not_a_string, _step_already_complete,
        _job_escapes_the_root, _world_of_2_40, _rank_beyond_world, _more_bytes_than_the_segment,
    ],
)  # fmt: skip
def test_segments_without_a_usable_record_are_unlinked(node: Node, leave: Any) -> None:
    dropped = leave(node)
    kept = node.committed(step=3, rank=0, world_size=1)
    node.recover()
    node.pump(1)

    assert [s.name for s in node.handed] == [kept]
    assert shm.segments_of(node.root) == [kept]
    assert not os.path.exists(shm.path_of(dropped)) and not os.path.exists(shm.path_of(dropped) + shm.RECORD_SUFFIX)
    assert node.pool.get(dropped) is None
    assert set(node.steps.tracks) == {(JOB, 3)}  # nothing tracked for the dropped one
    assert node.counters.errors == 0 and verify_checkpoint(step_dir(node.root, JOB, 3)) == []
    if leave is _step_already_complete:  # left as it was
        assert verify_checkpoint(step_dir(node.root, JOB, 1)) == []
    slot = node.pool.lease({"job": "other", "rank": 0, "world_size": 1, "step": 4, "nbytes": 10, "pid": os.getpid()})
    assert slot is not None and slot.name not in (kept, dropped)


# ---------------------------------------------------------------------------- partial steps


def test_a_partial_step_with_every_fragment_is_finalized(node: Node) -> None:
    for r in range(3):
        write_fragment(node.root, 4, r, 3)
    node.recover()

    path = step_dir(node.root, JOB, 4)
    assert partial_dirs(node.root) == [] and is_complete(path)
    assert verify_checkpoint(path) == []
    assert read_manifest(path)["world_size"] == 3
    assert local.latest_step(node.root, JOB) == (4, path)
    assert node.handed == [] and node.uploader.submitted == []


def test_a_partial_step_no_shard_can_complete_is_removed(node: Node) -> None:
    write_fragment(node.root, 2, 0, 2)  # rank 1 never committed: nothing in shared memory either
    os.makedirs(tmp_dir(node.root, JOB, 3))
    with open(os.path.join(tmp_dir(node.root, JOB, 3), shard_name(0)), "wb") as f:
        f.write(b"half a shard")  # died before its fragment: not durable
    write_fragment(node.root, 5, 0, 1)
    with open(os.path.join(tmp_dir(node.root, JOB, 5), fragment_name(0)), "wb") as f:
        f.write(b"{torn")  # no readable fragment: world size unknown
    node.recover()

    assert partial_dirs(node.root) == []
    assert [s for s in range(6) if os.path.exists(step_dir(node.root, JOB, s))] == []
    assert node.steps.tracks == {} and node.handed == [] and node.uploader.submitted == []


def test_a_partial_step_its_run_may_still_complete_is_kept_for_its_other_ranks(node: Node) -> None:
    """Rank 0 of run 7 committed step 2 and its shard is durable; the daemon restarted before rank 1 committed.
    Rank 1 may still lease from the new daemon and commit: the step was removed here, and rank 1's commit then
    began a step that could never complete. Now it is kept as a recovered track of run 7, with rank 0 in it.
    A partial step whose fragments name no run, or one the job moved past (a later step complete), still goes."""
    write_fragment(node.root, 2, 0, 2, run=7)
    write_fragment(node.root, 1, 0, 2, run=7, at=10)  # committed before step 3 below completed: its ranks moved on
    write_fragment(node.root, 3, 0, 1, at=20)
    local.finalize_step(node.root, JOB, 3, 1)
    node.recover()

    assert partial_dirs(node.root) == ["step-2.tmp"]
    track = node.steps.get((JOB, 2))
    assert track is not None and track.state is StepState.PENDING and track.recovered
    assert (track.committed, track.run, track.world_size) == ({0}, 7, 2)
    assert node.steps.get((JOB, 1)) is None


def test_a_partial_step_whose_fragments_cannot_be_merged_is_removed(node: Node) -> None:
    for r in range(2):
        write_fragment(node.root, 6, r, 2, row=0)  # both claim rows 0-3 of model/w
    path = complete_step(node.root, 7, 1)
    write_fragment(node.root, 7, 0, 1)  # a leftover partial of a step already complete
    node.recover()

    assert partial_dirs(node.root) == []
    assert not os.path.exists(step_dir(node.root, JOB, 6))
    assert verify_checkpoint(path) == []  # the complete step is never overwritten


def test_a_partial_step_a_recovered_shard_can_complete_is_kept_and_completed(node: Node) -> None:
    write_fragment(node.root, 9, 0, 2)  # rank 0 was persisted before the crash
    name = node.committed(step=9, rank=1, world_size=2)  # rank 1 committed, not persisted yet
    node.recover(persist=False)

    assert partial_dirs(node.root) == ["step-9.tmp"] and fragments_present(node.root, JOB, 9) == {0}
    track = node.steps.get((JOB, 9))
    assert track is not None and track.committed == {0, 1} and track.state is StepState.PENDING
    assert [s.name for s in node.handed] == [name]

    node.completion.persist(node.handed[0])
    (ev,) = node.pump(1)
    path = step_dir(node.root, JOB, 9)
    assert ev.error is None and ev.path == path and verify_checkpoint(path) == []
    assert sorted(read_manifest(path)["files"]) == [shard_name(0), shard_name(1)]
    assert node.steps.get((JOB, 9)).state is StepState.DURABLE and partial_dirs(node.root) == []


# ---------------------------------------------------------------------------- multi-node


def test_this_nodes_whole_part_of_a_multi_node_step_is_uploaded_again(node: Node) -> None:
    for r in (2, 3):  # ranks 2 and 3 of 4 live on this node
        write_fragment(node.root, 10, r, 4, lws=2)
    node.recover()

    assert node.uploader.submitted == [(JOB, 10, 4, [2, 3])]
    # moved out of step-10.tmp into a directory of its own, which the uploader reads; the bucket completes the step
    ((part, attempt),) = node.uploader.nodes
    assert partial_dirs(node.root) == [] and node_parts(node.root, JOB) == {10: [part]}
    track = node.steps.get((JOB, 10))
    assert attempt == track.attempt
    assert track is not None and (track.world_size, track.local_world_size, track.committed) == (4, 2, {2, 3})
    assert track.state is StepState.PENDING and not os.path.exists(step_dir(node.root, JOB, 10))

    # handed to the uploader: the persist threads do not report this node's part a second time
    name = node.committed(step=10, rank=3, world_size=4, lws=2)
    rec, raw = node.pool.segments.read_record(name) or ({}, b"")
    slot = node.pool.adopt(name, node.pool.segments.size_of(name), validate_record(rec, raw))
    node.completion.persist(slot)
    (ev,) = node.pump(1)
    assert ev.error is None and ev.node_ranks is None
    assert node.uploader.submitted == [(JOB, 10, 4, [2, 3])]


def test_a_multi_node_part_a_recovered_shard_completes_is_reported_once(node: Node) -> None:
    write_fragment(node.root, 11, 2, 4, lws=2)
    node.committed(step=11, rank=3, world_size=4, lws=2)
    node.recover()
    assert node.uploader.submitted == []  # not yet: rank 3 is being written
    (ev,) = node.pump(1)
    assert ev.error is None and ev.node_ranks == [2, 3]
    assert node.uploader.submitted == [(JOB, 11, 4, [2, 3])]
    assert node.steps.get((JOB, 11)).state is StepState.PENDING


def _handed_part(root: str, step: int, at: int, run: int) -> str:
    """Ranks 2 and 3 of 4 of ``step`` (commit time ``at``, launch ``run``), handed over as a persist thread does."""
    for r in (2, 3):
        write_fragment(root, step, r, 4, lws=2, at=at + r, run=run)
    return local.hand_over(root, JOB, step)


def test_a_handed_over_part_is_uploaded_again_and_an_older_attempts_removed(node: Node) -> None:
    # the previous daemon died while uploading: a dead run's attempt at step 15 (given up) and its relaunch's, both here
    old = _handed_part(node.root, 15, 1_000, run=11)
    new = _handed_part(node.root, 15, 5_000, run=22)
    node.recover()
    ((part, attempt),) = node.uploader.nodes
    assert part == new and not os.path.exists(old) and node_parts(node.root, JOB) == {15: [new]}
    track = node.steps.get((JOB, 15))
    assert node.uploader.submitted == [(JOB, 15, 4, [2, 3])] and track.attempt == attempt and track.committed == {2, 3}


def test_a_handed_over_part_that_a_newer_attempt_replaced_is_removed_not_uploaded(node: Node) -> None:
    old = _handed_part(node.root, 16, 1_000, run=11)
    write_fragment(node.root, 16, 2, 4, lws=2, at=5_000, run=22)  # the relaunch's rank 2 was written before the crash
    node.committed(step=16, rank=3, world_size=4, lws=2, at=5_001)  # its rank 3 committed, not written yet
    node.recover()
    assert not os.path.exists(old) and node.uploader.nodes == []
    (ev,) = node.pump(1)  # rank 3 written: the relaunch's part is whole, and goes up from a directory of its own
    assert ev.node_ranks == [2, 3] and [p for p, _ in node.uploader.nodes] == [ev.node_dir] != [old]


def test_a_commit_record_whose_shard_was_handed_over_is_not_written_again(node: Node) -> None:
    # the crash came after the persist thread moved this node's part for the upload, before the record was dropped
    part = _handed_part(node.root, 17, 1_000, run=7)
    name = node.committed(step=17, rank=3, world_size=4, lws=2, at=1_003)
    node.recover()
    assert node.handed == [] and node.pool.get(name) is None and not os.path.exists(shm.path_of(name))
    assert [p for p, _ in node.uploader.nodes] == [part] and partial_dirs(node.root) == []


def test_a_broken_or_unneeded_handed_over_part_is_removed(make_node: Callable[..., Node]) -> None:
    node = make_node(uploader=False)
    whole = _handed_part(node.root, 18, 1_000, run=7)  # no bucket: it can never go up
    for r in (2,):  # only one rank of the node's two: not a part the persist thread hands over
        write_fragment(node.root, 19, r, 4, lws=2)
    broken = local.hand_over(node.root, JOB, 19)
    node.recover()
    assert not os.path.exists(whole) and not os.path.exists(broken) and node.steps.tracks == {}


def test_a_multi_node_part_missing_ranks_of_this_node_is_removed(node: Node) -> None:
    write_fragment(node.root, 12, 2, 4, lws=2)  # rank 3 of this node never committed
    node.recover()
    assert partial_dirs(node.root) == [] and node.uploader.submitted == [] and node.steps.tracks == {}


def test_a_multi_node_part_without_an_uploader_is_removed(make_node: Callable[..., Node]) -> None:
    node = make_node(uploader=False)
    for r in (2, 3):
        write_fragment(node.root, 13, r, 4, lws=2)
    node.recover()
    assert partial_dirs(node.root) == [] and node.steps.tracks == {}


def test_finish_partial_step_alone_finalizes_a_step_its_track_describes(node: Node) -> None:
    for r in range(2):
        write_fragment(node.root, 14, r, 2)
    node.steps.adopt((JOB, 14), 2, 2)
    recovery.finish_partial_step(node.root, JOB, 14, node.steps, node.persister, None)
    assert verify_checkpoint(step_dir(node.root, JOB, 14)) == [] and partial_dirs(node.root) == []


def test_a_step_finalized_by_recovery_is_reported_durable_and_not_written_again(node: Node) -> None:
    """Every shard and fragment was on disk, the commit records still in shared memory: the previous run
    died just before finalizing. Recovery finalizes the step; its slots are not persisted a second time
    (that failed the complete step with "already exists")."""
    names = []
    for r in range(2):
        names.append(node.committed(step=1, rank=r, world_size=2))
        write_fragment(node.root, 1, r, 2)
    node.recover()
    assert node.handed == []
    assert node.steps.answer((JOB, 1))["state"] == "durable"
    assert verify_checkpoint(step_dir(node.root, JOB, 1)) == []
    assert shm.segments_of(node.root) == [] and not any(os.path.exists(shm.path_of(n)) for n in names)


# ---------------------------------------------------------------------------- a rolled-back run's re-save

OLD_AT, NEW_AT = 1_000_005, 2_000_000  # step 5's commit on the abandoned line, and on the new line (later)


def _trash(root: str) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(root, JOB)) if n.endswith((".del", ".old")))


def test_a_rolled_back_re_save_cut_short_leaves_the_old_step_complete(node: Node) -> None:
    """The daemon died while the new line's step 5 had one of its two ranks on disk: the old step 5 is
    still there, complete and verified, and nothing of the new one is left over."""
    old = complete_step(node.root, 5, 2)
    write_fragment(node.root, 5, 0, 2, at=NEW_AT)
    node.recover()
    assert read_manifest(old)["committed_at"] == OLD_AT and verify_checkpoint(old) == []
    assert partial_dirs(node.root) == [] and _trash(node.root) == []
    assert local.latest_step(node.root, JOB) == (5, old)


@pytest.mark.parametrize("renamed", [False, True], ids=["before-the-renames", "between-the-renames"])
def test_a_rolled_back_re_save_whose_every_fragment_is_on_disk_replaces_the_old_step(node: Node, renamed: bool) -> None:
    """The daemon died after the new line's step 5 was on disk but before (or while) it took the old one's
    place: recovery finishes the replacement, and no half-deleted step is left."""
    path = complete_step(node.root, 5, 2)
    for r in range(2):
        write_fragment(node.root, 5, r, 2, at=NEW_AT + r)
    if renamed:  # the old step was moved aside, the new one not yet renamed into place
        os.rename(path, os.path.join(node.root, JOB, "step-5.old"))
    node.recover()
    assert read_manifest(path)["committed_at"] == NEW_AT + 1 and verify_checkpoint(path) == []
    assert partial_dirs(node.root) == [] and _trash(node.root) == []


def test_a_committed_shard_newer_than_the_complete_step_of_its_number_is_persisted_not_dropped(node: Node) -> None:
    """A rolled-back run committed step 5 again and the daemon died before persisting it: the complete step
    5 on disk is the old line's, so the shard is persisted and the new step replaces it (not taken for
    a step the previous run had finished)."""
    path = complete_step(node.root, 5, 1)
    name = node.committed(step=5, rank=0, world_size=1, at=NEW_AT)
    node.recover()
    assert [s.name for s in node.handed] == [name]
    assert read_manifest(path)["committed_at"] == OLD_AT  # until the new one is complete
    (ev,) = node.pump(1)
    assert ev.error is None and ev.path == path and node.steps.get((JOB, 5)).state is StepState.DURABLE
    assert read_manifest(path)["committed_at"] == NEW_AT and verify_checkpoint(path) == []
    assert _trash(node.root) == []


def test_a_cut_short_replacement_whose_new_step_cannot_be_finalized_keeps_the_old_step(node: Node) -> None:
    """The crash came between moving the old step 5 aside and renaming the new one into place, and the new
    one's fragments turn out not to make a checkpoint: the old step is moved back, not deleted."""
    path = complete_step(node.root, 5, 2)
    for r in range(2):
        write_fragment(node.root, 5, r, 2, at=NEW_AT + r, row=0)  # both claim rows 0-3: rows 4-7 uncovered
    os.rename(path, os.path.join(node.root, JOB, "step-5.old"))
    node.recover()
    assert read_manifest(path)["committed_at"] == OLD_AT and verify_checkpoint(path) == []
    assert partial_dirs(node.root) == [] and _trash(node.root) == []


def test_a_half_deleted_step_is_never_moved_back_even_beside_a_partial_step_of_its_number(node: Node) -> None:
    """``step-5.del`` is a step retention (or the retiring of a replaced step) was deleting: some of its
    files may be gone already, so it is deleted, never taken for a replaced step to restore."""
    path = complete_step(node.root, 5, 2)
    os.remove(os.path.join(path, shard_name(1)))  # the delete had begun
    os.rename(path, os.path.join(node.root, JOB, "step-5.del"))
    write_fragment(node.root, 5, 0, 2, at=NEW_AT)  # a partial new step 5
    node.recover()
    assert not os.path.exists(path) and _trash(node.root) == []


def test_a_download_the_daemon_was_killed_in_is_removed_at_start_up(node: Node) -> None:
    """The daemon was killed while it downloaded step 5 from the bucket for a restore: ``step-5.fetch`` (up to a whole
    step's size) was left for good, shown by no listing and judged by no retention. Found by a review of the storage
    path. It is removed at start-up (no download is under way then); the complete step 3 beside it stays."""
    path = complete_step(node.root, 3, 1)
    partial = os.path.join(node.root, JOB, "step-5.fetch")
    os.makedirs(partial)
    with open(os.path.join(partial, shard_name(0)), "wb") as f:
        f.write(b"\0" * 4096)
    node.recover()
    assert not os.path.exists(partial) and verify_checkpoint(path) == []


def test_a_replacement_whose_rename_fails_puts_the_old_step_back(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    path = complete_step(node.root, 5, 1)
    write_fragment(node.root, 5, 0, 1, at=NEW_AT)
    real = os.rename

    def rename(src: str, dst: str) -> None:
        if src.endswith(".tmp"):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        local.finalize_step(node.root, JOB, 5, 1)
    monkeypatch.undo()
    assert read_manifest(path)["committed_at"] == OLD_AT and verify_checkpoint(path) == [] and _trash(node.root) == []


@pytest.mark.parametrize("replacing", [False, True], ids=["new-step", "replacing-an-old-one"])
def test_a_step_whose_rename_cannot_be_synced_is_complete_not_failed(
    node: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, replacing: bool
) -> None:
    """The directory fsync after the rename into place fails (EIO): every file of the step is durable and,
    were the rename lost, recovery would finalize ``step-5.tmp`` again, so the step is complete, not failed."""
    if replacing:
        complete_step(node.root, 5, 1)
    write_fragment(node.root, 5, 0, 1, at=NEW_AT)

    def fsync_dir(path: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local, "fsync_dir", fsync_dir)
    with caplog.at_level("ERROR", logger="ckptd.daemon"):
        path = local.finalize_step(node.root, JOB, 5, 1)
    monkeypatch.undo()
    assert read_manifest(path)["committed_at"] == NEW_AT and verify_checkpoint(path) == []
    assert "step 5 of job j is complete, but syncing its rename into place failed: [Errno 5] Input/output error" in caplog.text
    # the old step is kept aside while the renames are not known durable; the next start settles it
    assert partial_dirs(node.root) == [] and _trash(node.root) == (["step-5.old"] if replacing else [])
    node.recover()
    assert read_manifest(path)["committed_at"] == NEW_AT and _trash(node.root) == []


def test_a_replaced_step_kept_aside_never_comes_back_after_retention_removed_its_replacement(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollback re-save of step 5 replaced the old line's step 5, whose syncing failed (EIO): the old one
    stayed aside (``step-5.old``) for recovery. Retention then removed the new step 5, and the next start took
    the aside one for a replacement that never finished and moved the abandoned line's step back into place.
    Retention now removes the aside copy with the step."""
    complete_step(node.root, 5, 1)
    write_fragment(node.root, 5, 0, 1, at=NEW_AT)

    def fsync_dir(path: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(local, "fsync_dir", fsync_dir)
    local.finalize_step(node.root, JOB, 5, 1)
    monkeypatch.undo()
    assert _trash(node.root) == ["step-5.old"]
    for s in (6, 7):  # the new line goes on
        write_fragment(node.root, s, 0, 1, at=NEW_AT + s)
        local.finalize_step(node.root, JOB, s, 1)
    assert local.apply_retention(node.root, JOB, KeepLatest(2)) == [5]
    node.recover()
    assert not os.path.exists(step_dir(node.root, JOB, 5)) and _trash(node.root) == []


def test_retiring_a_replaced_step_never_removes_a_newer_step_of_its_number(node: Node) -> None:
    """The retire runs on a thread: by then the new step (a memory-tier re-save persisted at once) may be in
    place; only the step committed at the time it names goes."""
    path = complete_step(node.root, 5, 1)
    local.retire_step(node.root, JOB, 5, committed=OLD_AT - 1).join()  # not the step on disk now
    assert read_manifest(path)["committed_at"] == OLD_AT
    local.retire_step(node.root, JOB, 5, committed=OLD_AT).join()
    assert not os.path.exists(path) and _trash(node.root) == []


def test_a_complete_step_is_never_replaced_by_fragments_committed_no_later(node: Node) -> None:
    path = complete_step(node.root, 5, 1)
    write_fragment(node.root, 5, 0, 1, at=OLD_AT)  # the same commit time: not a newer attempt
    with pytest.raises(CheckpointError, match="already exists"):
        local.finalize_step(node.root, JOB, 5, 1)
    assert read_manifest(path)["committed_at"] == OLD_AT and verify_checkpoint(path) == []


def test_leftovers_that_are_not_segments_are_removed(node: Node) -> None:
    """A record torn while being written leaves ``<segment>.commit.tmp``; other names do not belong either."""
    kept = node.committed(step=3, rank=0, world_size=1)
    for junk in (kept.split("/")[1] + ".commit.tmp", "notes.txt"):
        with open(os.path.join(node.pool.segments.path, junk), "w") as f:
            f.write("x")
    node.recover()
    node.pump(1)
    assert sorted(os.listdir(node.pool.segments.path)) == sorted([kept.split("/")[1], shm.LOCK])  # the lock is the daemon's


def test_a_record_the_daemon_did_not_write_is_ignored(node: Node) -> None:
    """Only root (or the daemon's own user) can write into the directory; a record with another mode is
    still not trusted: the segment is neither adopted nor unlinked, and recovery goes on."""
    odd = node.committed(step=4, rank=0, world_size=1)
    os.chmod(shm.path_of(odd) + shm.RECORD_SUFFIX, 0o644)
    kept = node.committed(step=5, rank=0, world_size=1)
    node.recover()
    node.pump(1)
    assert [s.name for s in node.handed] == [kept] and node.pool.get(odd) is None
    assert os.path.exists(shm.path_of(odd))
    assert set(node.steps.tracks) == {(JOB, 5)}


def test_of_two_records_claiming_the_same_rank_only_one_is_adopted(node: Node) -> None:
    a = node.committed(step=6, rank=0, world_size=1)
    b = node.committed(step=6, rank=0, world_size=1)
    node.recover(persist=False)
    assert len(node.handed) == 1 and {a, b} - {node.handed[0].name} != set()
    assert len(shm.segments_of(node.root)) == 1  # the contradicting one is dropped


def test_a_rank_whose_fragment_is_durable_is_not_written_again(node: Node) -> None:
    """The crash came after rank 0's shard and fragment were durable but before its record was dropped.
    Writing the shard again would truncate it while rank 1's completion publishes the step: the
    segment is dropped instead, and the step completes from rank 0's durable files and rank 1's segment."""
    write_fragment(node.root, 9, 0, 2)
    durable = node.committed(step=9, rank=0, world_size=2)
    staged = node.committed(step=9, rank=1, world_size=2)
    node.recover()
    assert [s.name for s in node.handed] == [staged] and node.pool.get(durable) is None
    assert not os.path.exists(shm.path_of(durable))
    (ev,) = node.pump(1)
    assert ev.error is None and ev.path == step_dir(node.root, JOB, 9)
    assert verify_checkpoint(ev.path) == []


def test_a_handed_over_part_whose_removal_was_cut_short_is_removed_not_uploaded(node: Node) -> None:
    # the daemon stopped while a thread removed a part that will not go up: every fragment left, a shard gone
    part = _handed_part(node.root, 20, 1_000, run=7)
    os.unlink(os.path.join(part, shard_name(3)))
    node.recover()
    assert not os.path.exists(part) and node.uploader.nodes == [] and node.steps.tracks == {}


def test_a_given_up_part_is_removed_at_restart_never_uploaded_again(node: Node) -> None:
    # the daemon died after a relaunch gave this attempt up (its part renamed .gone) and before the upload thread
    # removed it: uploaded again, it would hold the upload thread for commit_timeout waiting for nodes long gone
    part = _handed_part(node.root, 21, 1_000, run=7)
    os.rename(part, part + GONE)
    node.recover()
    assert not os.path.exists(part + GONE) and node.uploader.nodes == [] and node.steps.tracks == {}
