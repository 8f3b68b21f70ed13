"""The daemon's admission of commits (daemon/admission.py), at the unit level: steps left by a daemon
crash or a dead run, and the processes a run is known by."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from ckptd.daemon.admission import Admission, started
from ckptd.daemon.steps import StepState, StepTable
from ckptd.errors import ProtocolError


class _Pool:
    def forget_held(self, job: str, step: int) -> None:
        pass


def _admission(tmp_path: Any) -> tuple[Admission, StepTable, list[Any]]:
    steps = StepTable(lambda job, step: None)
    settled: list[Any] = []
    return Admission(str(tmp_path), steps, _Pool(), lambda k, t: settled.append(k)), steps, settled  # type: ignore[arg-type]


def test_a_half_step_recovered_after_a_daemon_crash_is_not_joined_by_a_new_run(tmp_path: Any) -> None:
    adm, steps, settled = _admission(tmp_path)
    steps.adopt(("j", 4), 2, 2).committed.add(0)  # rank 0's shard of run A survived the crash; rank 1's never will
    track = adm.admit("j", 4, 1, 2, 2, peer=None, after=None, run=777)
    assert track.committed == set(), "run B's rank 1 starts step 4 afresh instead of completing run A's"
    assert settled == [("j", 4)]
    steps.record_commit(("j", 4), track, 1, 2, 777)
    assert adm.admit("j", 4, 0, 2, 2, peer=None, after=None, run=777) is track  # run B's rank 0 joins its own run's step


def test_a_dead_runs_step_that_every_rank_committed_is_not_abandoned(tmp_path: Any) -> None:
    adm, steps, _ = _admission(tmp_path)
    track = steps.adopt(("j", 4), 2, 2)
    track.committed |= {0, 1}
    track.inflight = 2  # being made durable
    with pytest.raises(ProtocolError, match="saved by a previous run, is still being made durable"):
        adm.admit("j", 4, 0, 2, 2, peer=None, after=None, run=5)
    assert track.state is StepState.PENDING


def test_a_zombie_or_a_reused_pid_is_not_a_live_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and started(child.pid) is not None:
        time.sleep(0.05)  # exited, not reaped: a zombie
    assert started(child.pid) is None
    child.wait()
    import os

    assert started(os.getpid()) is not None
