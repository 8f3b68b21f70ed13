"""The arithmetic behind ``benchmarks/gpu_loop.py``'s report that no GPU is needed to check: the wait a backpressured
loop cannot avoid on a slow disk (what its lagging row is measured against)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from gpu_loop import forced_wait  # noqa: E402


@pytest.mark.parametrize(
    "checkpoints,slots,interval,persist,want",
    [
        (3, 3, 1.0, 5.0, 0.0),  # as many slots as checkpoints: nothing waits
        (4, 1, 1.0, 0.5, 0.0),  # the disk keeps up
        (4, 3, 1.0, 5.0, 2.0),  # the 4th waits for the 1st to be persisted (at 5 s; due at 3 s)
        (5, 3, 0.84, 8.24, 13.12),  # the H200 run: the 4th waits 5.72 s, the 5th 7.40 s more (one worker, in order)
        (6, 2, 1.0, 2.0, 3.0),  # the disk persists one in 2 s, one is due each second: from the 4th on, each waits 1 s more
    ],
)
def test_forced_wait_is_what_a_disk_of_that_speed_makes_a_loop_of_that_cadence_wait(
    checkpoints: int, slots: int, interval: float, persist: float, want: float
) -> None:
    assert forced_wait(checkpoints, slots, interval, persist) == pytest.approx(want)
