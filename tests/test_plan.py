"""Who writes replicated chunks: each distinct chunk exactly once, spread over its holders."""

from __future__ import annotations

import logging

import pytest

from ckptd.client.plan import assign
from ckptd.errors import CheckpointError


def test_replicated_chunks_written_once_and_spread() -> None:
    full = [(("model/a", (0,), (10,)), 400), (("model/b", (0,), (10,)), 400), (("optim/step", (), ()), 4)]
    out = assign([full, full])
    assert out[0] | out[1] == {c for c, _ in full} and not out[0] & out[1]
    assert {len(out[0]), len(out[1])} == {1, 2}  # the two big chunks go to different ranks


def test_sharded_chunks_stay_with_their_only_holder() -> None:
    r0 = [(("model/w", (0, 0), (5, 4)), 80), (("model/s", (), ()), 4)]
    r1 = [(("model/w", (5, 0), (5, 4)), 80), (("model/s", (), ()), 4)]
    out = assign([r0, r1])
    assert ("model/w", (0, 0), (5, 4)) in out[0] and ("model/w", (5, 0), (5, 4)) in out[1]
    assert (("model/s", (), ()) in out[0]) != (("model/s", (), ()) in out[1])


def test_sub_group_holders() -> None:
    """Experts held by a sub-group only: never assigned to a rank outside it."""
    dense = (("model/d", (0,), (8,)), 32)
    e0, e1 = (("model/e0", (0,), (8,)), 32), (("model/e1", (0,), (8,)), 32)
    out = assign([[dense, e0], [dense, e0], [dense, e1], [dense, e1]])
    assert ("model/e0", (0,), (8,)) in out[0] | out[1]
    assert ("model/e1", (0,), (8,)) in out[2] | out[3]
    assert sum(len(o) for o in out) == 3


def test_buffers_go_to_their_lowest_rank_holder_whatever_the_load() -> None:
    """A buffer's holders may hold different bytes (BatchNorm statistics under DDP): the lowest-rank holder's copy
    is written, the one DDP broadcasts at the next forward; a buffer of ranks 2 and 3 only goes to rank 2."""
    big, bn = (("model/w", (0,), (100,)), 400), (("model/bn.running_mean", (0,), (10,)), 40)
    sub = (("model/e.running_mean", (0,), (10,)), 40)
    out = assign([[big, bn], [big, bn], [big, bn, sub], [big, bn, sub]], lowest={bn[0], sub[0]})
    assert big[0] in out[0] and bn[0] in out[0] and sub[0] in out[2]  # rank 0 holds the big chunk already, yet takes bn
    assert assign([[big, bn], [big, bn]])[1] == {bn[0]}  # without the flag: spread by load, as before


class _NeverComplete:
    """A process group's store where one of two ranks has checked in, and the other never does."""

    def wait(self, keys: list[str], timeout: object) -> None:
        raise RuntimeError("Socket Timeout")  # what torch's TCPStore raises (a DistStoreError)

    def add(self, key: str, n: int) -> int:
        return 1


def test_rank_0_only_snapshot_says_the_fix_at_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``if rank == 0: snapshot(...)``: the warning after a minute said only how many ranks had arrived; the fix came
    30 minutes later, chained to the store's own timeout error. Now the first warning names the deadline and the fix,
    and the error does not drag the store's traceback along."""
    from ckptd.client import plan

    monkeypatch.setattr(plan, "WARN_EVERY_S", 0.01)
    with caplog.at_level(logging.WARNING, logger="ckptd.client"), pytest.raises(CheckpointError) as e:
        plan.Arrivals._wait(_NeverComplete(), "k", 2, "ckptd.snapshot(step=5)", 0.03, 0)
    first = caplog.records[0].getMessage()
    assert "1 of 2 ranks arrived" in first and "until 0 s (CKPTD_COLLECTIVE_TIMEOUT)" in first
    assert "never under `if rank == 0`" in first
    assert "only 1 of 2 ranks called it within 0.03 s" in str(e.value) and "never under `if rank == 0`" in str(e.value)
    assert e.value.__cause__ is None and e.value.__context__ is None
