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
from ckptd.errors import DaemonBusy, ProtocolError


class _Holdings:
    def forget(self, job: str, step: int) -> None:
        pass


def _admission(tmp_path: Any) -> tuple[Admission, StepTable, list[Any]]:
    steps = StepTable(lambda job, step: None)
    settled: list[Any] = []
    return Admission(str(tmp_path), steps, _Holdings(), lambda k, t: settled.append(k)), steps, settled  # type: ignore[arg-type]


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
    with pytest.raises(DaemonBusy, match="saved by a previous run, is still being made durable"):
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


def test_a_multinode_step_this_daemon_saw_complete_is_saved_again_only_after_a_rollback(tmp_path: Any) -> None:
    """A multi-node step lives in the bucket (no local directory); the daemon remembers it durable. A new
    launch that restored an earlier step saves it again (its commits stamped after the old ones); one
    that restored nothing is refused."""
    adm, steps, _ = _admission(tmp_path)
    old = steps.adopt(("j", 4), 4, 2)
    for rank in (0, 1):
        steps.record_commit(("j", 4), old, rank, 2, 11, committed_at=1_000)
    steps.complete(("j", 4), "s3://b/j/step-4")
    assert steps.get(("j", 4)).state is StepState.DURABLE
    with pytest.raises(ProtocolError, match="step 4 of job j is already committed and this client restored no step"):
        adm.admit("j", 4, 0, 4, 2, peer=None, after=None, run=22)
    with pytest.raises(ProtocolError, match="restored step 4"):
        adm.admit("j", 4, 0, 4, 2, peer=None, after=4, run=22)
    track = adm.admit("j", 4, 0, 4, 2, peer=None, after=2, run=22)
    assert track is not old and track.committed == set() and track.replaces and track.replaces_at == 1_000
    steps.record_commit(("j", 4), track, 0, 2, 22, committed_at=2_000)
    assert adm.admit("j", 4, 1, 4, 2, peer=None, after=2, run=22) is track  # the node's other rank joins it
