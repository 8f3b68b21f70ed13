"""Acceptance: a real ``transformers`` Llama trained under two-rank FSDP2 with a ``StatefulDataLoader``, AdamW and
an LR schedule ends bit-identical to a run without ckptd, whether ckptd only snapshots it or the run is SIGKILLed
and a fresh launch resumes it from the daemon."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _llama_fsdp2 import EVERY, KILL_AFTER, STEPS, train

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORLD = 2


def _run(mode: str, out: Path, daemon: Any = None, job: str | None = None, expect_exit: int = 0) -> tuple[list[Any], dict[str, Any] | None]:
    """One launch of the job on ``WORLD`` fresh ranks; each rank's result and the final state rank 0 saved."""
    args = (str(out),) if daemon is None else (str(out), daemon.endpoint, job)
    outs = run_ranks(WORLD, train, mode, *args, expect_exit=expect_exit)
    final = torch.load(out, weights_only=False) if out.exists() else None
    return outs, final


def _wait_durable(daemon: Any, job: str, step: int, timeout: float = 60.0) -> None:
    """The daemon owns a committed step: wait until it made it durable (as a relaunch that takes a while would)."""
    with daemon.rpc() as rpc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rep = rpc.call("wait", job=job, step=step, timeout=5.0)
            if rep["state"] == "durable":
                return
            assert rep["state"] == "pending", rep
    raise AssertionError(f"step {step} of {job} never became durable")


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit-identical: every parameter, every optimizer-state tensor (the step counts included), the param groups
    and the scheduler. Names every difference (step counts first), not only the first one."""
    steps, diffs = [], []
    assert got["optim"].keys() == want["optim"].keys(), sorted(got["optim"].keys() ^ want["optim"].keys())
    for fqn, ws in want["optim"].items():
        gs = got["optim"][fqn]
        assert gs.keys() == ws.keys(), (fqn, sorted(gs.keys() ^ ws.keys()))
        for k, w in ws.items():
            g = gs[k]
            if k == "step":
                if not torch.equal(torch.as_tensor(g), torch.as_tensor(w)):
                    steps.append(f"optimizer step count of {fqn}: {float(g)} (want {float(w)})")
            elif g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
                diffs.append(f"optimizer {k} of {fqn}: max |diff| {_maxdiff(g, w)}")
    assert got["model"].keys() == want["model"].keys(), sorted(got["model"].keys() ^ want["model"].keys())
    for k, w in want["model"].items():
        g = got["model"][k]
        if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
            diffs.append(f"parameter {k}: max |diff| {_maxdiff(g, w)}")
    if got["param_groups"] != want["param_groups"]:
        diffs.append(f"param groups: {got['param_groups']} (want {want['param_groups']})")
    if got["sched"] != want["sched"]:
        diffs.append(f"scheduler: {got['sched']} (want {want['sched']})")
    lines = steps + diffs
    if lines:
        shown = lines[:8] + ([f"... and {len(lines) - 8} more"] if len(lines) > 8 else [])
        summary = f"{len(steps)} optimizer step counts and {len(diffs)} other tensors/values differ from the reference run"
        raise AssertionError(summary + ":\n  " + "\n  ".join(shown))


def _maxdiff(g: torch.Tensor, w: torch.Tensor) -> str:
    if g.shape != w.shape or g.dtype != w.dtype:
        return f"n/a ({g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)})"
    return f"{(g.double() - w.double()).abs().max().item():.3g}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], dict[str, Any]]:
    """The run without ckptd: each rank's losses and the final full state."""
    outs, final = _run("plain", tmp_path_factory.mktemp("llama-ref") / "final.pt")
    assert final is not None
    return outs, final


def test_reference_run_is_deterministic(reference, tmp_path: Path) -> None:  # noqa: ANN001
    # the premise of the two tests below: without ckptd, two launches of this job end bit-identical
    ref_outs, ref = reference
    outs, final = _run("plain", tmp_path / "final.pt")
    assert [o["losses"] for o in outs] == [o["losses"] for o in ref_outs]
    assert_same_state(final, ref)
    assert all(len(o["losses"]) == STEPS for o in outs)
    assert ref["optim"] and all(float(st["step"]) == STEPS for st in ref["optim"].values())


def test_uninterrupted_run_with_ckptd_is_bit_identical(reference, daemon, tmp_path: Path) -> None:  # noqa: ANN001
    ref_outs, ref = reference
    outs, final = _run("ckptd", tmp_path / "final.pt", daemon, "llama-whole")
    assert [len(o["durable"]) for o in outs] == [STEPS // EVERY] * WORLD  # every snapshot committed and durable
    assert_same_state(final, ref)
    assert [o["losses"] for o in outs] == [o["losses"] for o in ref_outs]


def test_killed_and_restored_run_ends_bit_identical(reference, daemon, tmp_path: Path) -> None:  # noqa: ANN001
    ref_outs, ref = reference
    job = "llama-killed"
    resumed_from = KILL_AFTER // EVERY * EVERY  # the last snapshot before the kill: step 6
    assert KILL_AFTER % EVERY != 0 and resumed_from > 0

    # launch 1: snapshots at steps 3 and 6, trains step 7 (not checkpointed), then every rank is SIGKILLed
    out = tmp_path / "final.pt"
    _, final = _run("killed", out, daemon, job, expect_exit=-9)
    assert final is None
    killed = [json.load(open(f"{out}.killed-{r}.json")) for r in range(WORLD)]
    _wait_durable(daemon, job, resumed_from)  # the daemon finishes what the dead ranks committed

    # launch 2: fresh processes, built the same way, restored from the daemon, trained to the end
    outs, final = _run("resume", out, daemon, job)
    for o in outs:
        assert o["latest"] == resumed_from and o["extra_step"] == resumed_from
        assert o["last_restore"]["step"] == resumed_from, o["last_restore"]
    assert os.path.isdir(outs[0]["last_restore"]["path"])
    assert_same_state(final, ref)
    for r in range(WORLD):  # the loss of every step, in either launch, is the reference run's
        assert killed[r]["losses"] == {s: v for s, v in ref_outs[r]["losses"].items() if int(s) <= KILL_AFTER}
        assert outs[r]["losses"] == {s: v for s, v in ref_outs[r]["losses"].items() if int(s) > resumed_from}
