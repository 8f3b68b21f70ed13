"""The step table alone (``ckptd.daemon.steps``): commit checks and recording, the pending -> durable /
failed transitions (first outcome stands), superseding older steps, how many finished steps are
remembered, the ``wait`` answers (tracked, untracked, held back, timed out) and the ``status`` counts."""

from __future__ import annotations

import json

import pytest

from ckptd.config import TRACKS_KEPT
from ckptd.daemon.steps import StepState, StepTable, StepTrack
from ckptd.daemon.waiters import Waiter
from ckptd.errors import ProtocolError


class CompletePaths:
    """A catalog's ``complete_path`` stand-in: the steps it knows are durable, and every question asked."""

    def __init__(self, known: dict[tuple[str, int], str] | None = None) -> None:
        self.known = known or {}
        self.asked: list[tuple[str, int]] = []

    def __call__(self, job: str, step: int) -> str | None:
        self.asked.append((job, step))
        return self.known.get((job, step))


def commit(table: StepTable, job: str, step: int, rank: int, ws: int, lws: int | None = None) -> StepTrack:
    """What the daemon's ``commit`` op does with the table: check, then record."""
    lws = ws if lws is None else lws
    track = table.check_commit((job, step), rank, ws, lws)
    table.record_commit((job, step), track, rank, lws)
    return track


def finished(table: StepTable, job: str, step: int, durable: bool = True) -> None:
    """A step of one rank that committed and then became durable (or failed)."""
    commit(table, job, step, 0, 1)
    if durable:
        table.complete((job, step), f"/root/{job}/step-{step}")
    else:
        assert table.fail((job, step), "disk full")


# ------------------------------------------------------------------ commits


def test_check_commit_records_nothing_until_record_commit() -> None:
    table = StepTable(CompletePaths())
    track = table.check_commit(("j", 5), 1, 4, 2)
    assert (track.world_size, track.local_world_size, track.committed, track.state) == (4, 2, set(), StepState.PENDING)
    assert table.get(("j", 5)) is None
    assert table.in_flight() == {}
    table.check_commit(("j", 5), 1, 4, 2)  # not recorded: the same rank may be checked again

    table.record_commit(("j", 5), track, 1, 2)
    assert table.get(("j", 5)) is track
    assert track.committed == {1}
    assert table.in_flight() == {"j": [5]}


def test_check_commit_of_a_later_rank_records_nothing_either() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 3)
    table.check_commit(("j", 1), 1, 3, 3)
    assert table.get(("j", 1)) is not None
    assert table.get(("j", 1)).committed == {0}  # type: ignore[union-attr]


@pytest.mark.parametrize(("ws", "lws"), [(5, 4), (4, 3), (2, 2)], ids=["world_size", "local_world_size", "both"])
def test_commit_with_other_sizes_than_other_ranks_is_refused(ws: int, lws: int) -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 7, 0, 4, 4)
    with pytest.raises(ProtocolError, match=r"step 7: world_size .* differ from 4 / 4 of other ranks"):
        table.check_commit(("j", 7), 1, ws, lws)
    assert table.get(("j", 7)).committed == {0}  # type: ignore[union-attr]
    commit(table, "j", 7, 1, 4, 4)  # the refusal left the step open to correct commits


def test_sizes_are_per_step_and_per_job() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 4, 4)
    commit(table, "j", 2, 0, 8, 2)  # another step may run at another scale
    commit(table, "k", 1, 0, 2, 1)  # ... and another job too
    assert (table.get(("j", 2)).world_size, table.get(("k", 1)).local_world_size) == (8, 1)  # type: ignore[union-attr]


def test_an_adopted_track_takes_the_first_commits_local_world_size() -> None:
    """Crash recovery adopts a step from an old commit record that may lack local_world_size (0)."""
    table = StepTable(CompletePaths())
    adopted = table.adopt(("j", 3), 4)
    adopted.committed.add(0)
    assert table.adopt(("j", 3), 99) is adopted  # adopting again returns the same track, unchanged
    assert adopted.world_size == 4

    track = commit(table, "j", 3, 1, 4, 2)
    assert track is adopted and track.local_world_size == 2 and track.committed == {0, 1}
    assert track.all_committed
    with pytest.raises(ProtocolError, match="differ"):
        table.check_commit(("j", 3), 2, 4, 4)  # from now on, the recorded local_world_size holds


def test_a_rank_committing_twice_is_refused() -> None:
    table = StepTable(CompletePaths())
    commit(table, "job-a", 9, 2, 4)
    with pytest.raises(ProtocolError, match="rank 2 already committed step 9 of job job-a"):
        table.check_commit(("job-a", 9), 2, 4, 4)
    assert table.get(("job-a", 9)).committed == {2}  # type: ignore[union-attr]
    commit(table, "job-b", 9, 2, 4)  # the same rank and step of another job is another step


def test_a_failed_step_refuses_further_commits() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 4, 0, 2)
    assert table.fail(("j", 4), "no space left on device")
    with pytest.raises(ProtocolError, match="step 4 of job j already failed: no space left on device"):
        table.check_commit(("j", 4), 1, 2, 2)
    assert table.get(("j", 4)).committed == {0}  # type: ignore[union-attr]


def test_all_committed_counts_the_ranks_this_daemon_serves() -> None:
    single = StepTrack(world_size=3)
    single.committed |= {0, 1}
    assert not single.all_committed
    single.committed.add(2)
    assert single.all_committed

    multi = StepTrack(world_size=8, local_world_size=2)  # two of eight ranks on this node
    multi.committed.add(4)
    assert not multi.all_committed
    multi.committed.add(5)
    assert multi.all_committed


# ------------------------------------------------------------------ outcomes


def test_fail_acts_only_on_pending_steps_and_the_first_outcome_stands() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 1)
    assert table.fail(("j", 1), "first")
    assert not table.fail(("j", 1), "second")
    assert table.answer(("j", 1)) == {"state": "failed", "path": None, "error": "first"}

    commit(table, "j", 2, 0, 1)
    table.complete(("j", 2), "/r/j/step-2")
    assert not table.fail(("j", 2), "late error")  # a durable step stays durable
    assert table.answer(("j", 2)) == {"state": "durable", "path": "/r/j/step-2", "error": None}

    assert not table.fail(("j", 3), "never seen")
    assert table.get(("j", 3)) is None  # failing an unknown step tracks nothing


def test_answer_of_a_track_is_plain_json() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 2)
    assert table.answer(("j", 1)) == {"state": "pending", "path": None, "error": None}
    table.complete(("j", 1), "s3://bucket/j/step-1")
    reply = table.answer(("j", 1))
    assert json.loads(json.dumps(reply)) == {"state": "durable", "path": "s3://bucket/j/step-1", "error": None}
    assert type(reply["state"]) is str


def test_supersede_fails_only_older_pending_steps_not_every_rank_committed() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 2)  # older, pending, rank 1 never committed: superseded
    commit(table, "j", 2, 0, 2)
    commit(table, "j", 2, 1, 2)  # older, pending, every rank committed (still being written): stays
    finished(table, "j", 3)  # older, durable: stays
    finished(table, "j", 4, durable=False)  # older, failed already: keeps its own error
    commit(table, "j", 5, 0, 8, 2)  # older, multi-node, one of this node's two ranks: superseded
    commit(table, "j", 6, 0, 8, 2)
    commit(table, "j", 6, 1, 8, 2)  # older, multi-node, both of this node's ranks: stays
    commit(table, "j", 7, 0, 2)  # the step that completed
    table.complete(("j", 7), "/r/j/step-7")
    commit(table, "j", 8, 0, 2)  # newer, pending: stays
    commit(table, "other", 1, 0, 2)  # another job's older pending step: stays

    out = table.supersede("j", 7)
    assert [key for key, _ in out] == [("j", 1), ("j", 5)]
    for key, track in out:
        assert track is table.get(key)
        assert track.state is StepState.FAILED
        assert track.error == f"superseded: step 7 was committed before every rank committed step {key[1]}"

    states = {key: t.state for key, t in table.tracks.items()}
    assert states == {
        ("j", 1): StepState.FAILED,
        ("j", 2): StepState.PENDING,
        ("j", 3): StepState.DURABLE,
        ("j", 4): StepState.FAILED,
        ("j", 5): StepState.FAILED,
        ("j", 6): StepState.PENDING,
        ("j", 7): StepState.DURABLE,
        ("j", 8): StepState.PENDING,
        ("other", 1): StepState.PENDING,
    }
    assert table.get(("j", 4)).error == "disk full"  # type: ignore[union-attr]
    assert table.supersede("j", 7) == []  # nothing left to supersede


def test_a_superseded_step_refuses_its_late_rank() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 2)
    finished(table, "j", 2)
    table.supersede("j", 2)
    with pytest.raises(ProtocolError, match="step 1 of job j already failed: superseded"):
        table.check_commit(("j", 1), 1, 2, 2)


# ------------------------------------------------------------------ memory


def test_forget_finished_keeps_the_newest_finished_steps_per_job() -> None:
    table = StepTable(CompletePaths())
    extra = 5
    commit(table, "j", 0, 0, 2)  # the oldest of all, but pending: never forgotten
    for s in range(1, TRACKS_KEPT + extra + 1):
        finished(table, "j", s, durable=s % 3 != 0)  # durable and failed ones alike
        finished(table, "other", s)

    table.forget_finished("j")
    kept = sorted(s for j, s in table.tracks if j == "j")
    assert kept == [0, *range(extra + 1, TRACKS_KEPT + extra + 1)]
    assert sum(1 for j, _ in table.tracks if j == "other") == TRACKS_KEPT + extra  # another job: untouched
    assert table.answer(("j", 1)) == {
        "state": "failed",
        "path": None,
        "error": "the daemon has no record of step 1 of job j and it is not on disk",
        "unknown": True,
    }  # was durable

    table.forget_finished("j")  # idempotent
    assert sorted(s for j, s in table.tracks if j == "j") == kept


def test_forget_finished_keeps_everything_below_the_limit() -> None:
    table = StepTable(CompletePaths())
    for s in range(TRACKS_KEPT):
        finished(table, "j", s)
    table.forget_finished("j")
    assert len(table.tracks) == TRACKS_KEPT


def test_forget_finished_never_drops_a_step_someone_waits_for() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 0, 0, 1)
    assert table.wait(("j", 0), b"client", 1, 100.0) is None  # held while pending
    table.complete(("j", 0), "/r/j/step-0")  # durable; its waiter not answered yet
    for s in range(1, TRACKS_KEPT + 3):
        finished(table, "j", s)

    table.forget_finished("j")
    assert table.get(("j", 0)) is not None
    assert table.get(("j", 1)) is None and table.get(("j", 2)) is None
    assert len([k for k in table.tracks if k[0] == "j"]) == TRACKS_KEPT + 1
    assert table.answered(("j", 0)) == [(Waiter(b"client", 1, 100.0), {"state": "durable", "path": "/r/j/step-0", "error": None})]

    table.forget_finished("j")  # nobody waits any more: now the oldest finished step goes
    assert table.get(("j", 0)) is None


# ------------------------------------------------------------------ wait and its answers


def test_answer_for_an_untracked_step_asks_complete_path() -> None:
    paths = CompletePaths({("j", 4): "/root/j/step-4"})
    table = StepTable(paths)
    assert table.answer(("j", 4)) == {"state": "durable", "path": "/root/j/step-4", "error": None}
    want = {"state": "failed", "path": None, "error": "the daemon has no record of step 5 of job j and it is not on disk", "unknown": True}
    assert table.answer(("j", 5)) == want
    assert table.answer(("k", 4))["error"] == "the daemon has no record of step 4 of job k and it is not on disk"
    assert paths.asked == [("j", 4), ("j", 5), ("k", 4)]
    assert table.tracks == {}  # answering tracks nothing


def test_a_tracked_step_is_answered_from_its_track_alone() -> None:
    paths = CompletePaths({("j", 1): "/somewhere/else"})
    table = StepTable(paths)
    commit(table, "j", 1, 0, 2)
    assert table.answer(("j", 1)) == {"state": "pending", "path": None, "error": None}
    assert paths.asked == []


def test_wait_answers_finished_and_unknown_steps_at_once() -> None:
    paths = CompletePaths({("j", 10): "/root/j/step-10"})
    table = StepTable(paths)
    finished(table, "j", 1)
    finished(table, "j", 2, durable=False)
    assert table.wait(("j", 1), b"c", 1, 0.0) == {"state": "durable", "path": "/root/j/step-1", "error": None}
    assert table.wait(("j", 2), b"c", 2, 0.0) == {"state": "failed", "path": None, "error": "disk full"}
    assert table.wait(("j", 10), b"c", 3, 0.0) == {"state": "durable", "path": "/root/j/step-10", "error": None}
    assert table.wait(("j", 11), b"c", 4, 0.0)["state"] == "failed"  # type: ignore[index]
    assert len(table.waiters) == 0
    assert table.due(1e9) == []


def test_wait_holds_a_pending_step_until_it_finishes() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 2)
    commit(table, "j", 2, 0, 2)
    assert table.wait(("j", 1), b"a", "r1", 50.0) is None
    assert table.wait(("j", 1), b"b", "r2", 60.0) is None
    assert table.wait(("j", 2), b"c", "r3", 70.0) is None
    assert len(table.waiters) == 3

    assert table.answered(("j", 1)) == [
        (Waiter(b"a", "r1", 50.0), {"state": "pending", "path": None, "error": None}),
        (Waiter(b"b", "r2", 60.0), {"state": "pending", "path": None, "error": None}),
    ]  # answered() replies with the state as it is; the daemon calls it once the step left pending
    assert table.answered(("j", 1)) == []  # each waiter once
    assert len(table.waiters) == 1

    table.fail(("j", 2), "bad shard")
    assert table.answered(("j", 2)) == [(Waiter(b"c", "r3", 70.0), {"state": "failed", "path": None, "error": "bad shard"})]
    assert len(table.waiters) == 0


def test_answered_replies_each_waiter_of_a_durable_step_once() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 3, 0, 2)
    for i in range(3):
        assert table.wait(("j", 3), b"c%d" % i, i, 100.0) is None
    commit(table, "j", 3, 1, 2)
    table.complete(("j", 3), "/r/j/step-3")
    reply = {"state": "durable", "path": "/r/j/step-3", "error": None}
    assert table.answered(("j", 3)) == [(Waiter(b"c%d" % i, i, 100.0), reply) for i in range(3)]
    assert table.answered(("j", 3)) == []
    assert table.due(1e9) == []


def test_due_times_out_late_waiters_with_the_pending_state() -> None:
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 2)
    table.wait(("j", 1), b"early", 1, 10.0)
    table.wait(("j", 1), b"late", 2, 30.0)
    pending = {"state": "pending", "path": None, "error": None}

    assert table.due(5.0) == []
    assert table.due(10.0) == [(Waiter(b"early", 1, 10.0), pending)]
    assert table.due(10.0) == []  # forgotten once answered
    assert len(table.waiters) == 1

    commit(table, "j", 1, 1, 2)
    table.complete(("j", 1), "/r/j/step-1")
    assert table.answered(("j", 1)) == [(Waiter(b"late", 2, 30.0), {"state": "durable", "path": "/r/j/step-1", "error": None})]
    assert table.due(1e9) == []


def test_due_answers_a_step_forgotten_meanwhile_from_complete_path() -> None:
    """A waiter outlives its step's track only if the track was dropped by hand; it still gets an answer."""
    paths = CompletePaths({("j", 1): "/r/j/step-1"})
    table = StepTable(paths)
    commit(table, "j", 1, 0, 2)
    table.wait(("j", 1), b"c", 9, 1.0)
    del table.tracks[("j", 1)]
    assert table.due(2.0) == [(Waiter(b"c", 9, 1.0), {"state": "durable", "path": "/r/j/step-1", "error": None})]


# ------------------------------------------------------------------ status


def test_in_flight_lists_pending_steps_by_job() -> None:
    table = StepTable(CompletePaths())
    assert table.in_flight() == {}
    commit(table, "a", 1, 0, 2)
    commit(table, "a", 2, 0, 2)
    commit(table, "b", 7, 0, 2)
    finished(table, "a", 3)
    finished(table, "c", 1, durable=False)
    table.adopt(("d", 4), 2)  # adopted at start-up: pending too
    in_flight = table.in_flight()
    assert {job: sorted(steps) for job, steps in in_flight.items()} == {"a": [1, 2], "b": [7], "d": [4]}


def test_shards_in_flight_sums_every_tracks_inflight_shards() -> None:
    table = StepTable(CompletePaths())
    assert table.shards_in_flight() == 0
    a = commit(table, "a", 1, 0, 4)
    commit(table, "a", 1, 1, 4)
    b = commit(table, "b", 1, 0, 2)
    a.inflight, b.inflight = 2, 1
    assert table.shards_in_flight() == 3
    table.fail(("a", 1), "boom")  # a failed step's shards still being written still count
    assert table.shards_in_flight() == 3
    a.inflight -= 2
    assert table.shards_in_flight() == 1


def test_more_commits_than_this_daemon_serves_are_refused() -> None:
    """A client claiming local_world_size 2 of a 4-rank multi-node step cannot commit a third rank here
    (ranks 2 and 3 are another node's): the step would complete with another node's ranks from here."""
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 4, 2)
    commit(table, "j", 1, 1, 4, 2)
    with pytest.raises(ProtocolError, match="one too many"):
        table.check_commit(("j", 1), 2, 4, 2)


def test_a_durable_step_refuses_commits() -> None:
    """A multi-node step durable in the bucket (nothing under this root) must not take a late commit."""
    table = StepTable(CompletePaths())
    commit(table, "j", 1, 0, 4, 1)
    table.complete(("j", 1), "s3://b/j/step-1")
    with pytest.raises(ProtocolError, match="already committed"):
        table.check_commit(("j", 1), 1, 4, 1)


def test_forget_finished_never_drops_a_step_whose_shards_are_being_written() -> None:
    table = StepTable(CompletePaths())
    track = commit(table, "j", 0, 0, 2)
    track.inflight = 1
    table.fail(("j", 0), "rank 1's shard failed")  # rank 0's is still being written
    for s in range(1, TRACKS_KEPT + 5):
        finished(table, "j", s)
    table.forget_finished("j")
    assert table.get(("j", 0)) is track
