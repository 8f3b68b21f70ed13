"""The step state machine (issue 36, item 2): the step table makes every state change, each named in one table
(``ckptd.daemon.steps.TRANSITIONS``), and refuses one its state does not allow; docs/architecture.md shows the same
table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

from ckptd.daemon.steps import TRANSITIONS, IllegalTransition, StepState, StepTable, StepTrack


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
@pytest.mark.parametrize("state", list(StepState))
def test_each_transition_starts_only_from_its_states(name: str, state: StepState) -> None:
    start, end = TRANSITIONS[name]
    track = StepTrack(1, state=state)
    if state in start:
        track.move(name)
        assert track.state is end
    else:
        with pytest.raises(IllegalTransition, match=f"state {state.value} cannot be {name!r}"):
            track.move(name)
        assert track.state is state  # (unchanged)


def test_finished_states_are_final_and_memory_steps_leave_only_by_persist_or_drop() -> None:
    for final in (StepState.DURABLE, StepState.FAILED, StepState.DROPPED):
        assert not [n for n, (start, _) in TRANSITIONS.items() if final in start]
    assert {n for n, (start, _) in TRANSITIONS.items() if StepState.MEMORY in start} == {"to_disk", "drop"}


def test_the_table_refuses_a_second_outcome_and_counts_shards_in_flight() -> None:
    steps = StepTable(lambda job, step: None)
    track = steps.check_commit(("j", 1), 0, 1, 1)
    steps.record_commit(("j", 1), track, 0, 1)
    assert steps.shard_started(("j", 1)) is track and track.inflight == 1 and steps.shards_in_flight() == 1
    steps.shard_done(track)
    steps.complete(("j", 1), "/root/j/step-1")
    assert not steps.fail(("j", 1), "late")  # the first outcome stands
    with pytest.raises(IllegalTransition):
        steps.sealed(("j", 1))  # a durable step is never sealed into memory afterwards
    assert track.state is StepState.DURABLE and track.inflight == 0


def test_the_architecture_page_shows_the_same_transitions() -> None:
    text = (Path(REPO) / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([a-z, ]+) \| (\w+) \|", text, re.M)
    shown = {name: (frozenset(StepState(s.strip()) for s in start.split(",")), StepState(end)) for name, start, end in rows}
    assert shown == TRANSITIONS
