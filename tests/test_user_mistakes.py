"""What users of real training loops do, and get wrong, written as their actions: each ends in what
they need (the state they saved, the same job after a relaunch) or in one clear CheckpointError."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time
import warnings
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from _dist import run_ranks
from _mistakes import (
    bad_extra_on_one_rank,
    die_before_commit,
    different_steps,
    restore_and_compare,
    restore_different_steps,
    restore_into_a_model_one_rank_extended,
    resume_and_save_again,
    snapshot_on_rank0_only,
)
from _models import make, train_step
from conftest import REPO

import ckptd
from ckptd.errors import CheckpointError, UnsupportedState
from ckptd.protocol import MAX_MESSAGE_BYTES

# ----------------------------------------------------------------------------- extra


def test_extra_round_trips_what_training_loops_keep(daemon) -> None:  # noqa: ANN001
    from torchdata.stateful_dataloader import StatefulDataLoader

    random.seed(3)
    np.random.seed(4)
    rng = np.random.default_rng(5)
    loader = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(6))
    it = iter(loader)
    next(it), next(it)
    extra = {
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "generator": rng.bit_generator.state,  # PCG64: 128-bit integers
        "torch_rng": torch.get_rng_state(),
        "loader": loader.state_dict(),
        "arrays": {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "strided": np.arange(10)[::3], "zero_d": np.array(7)},
        "scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.float64("nan")],
        "order": OrderedDict([("b", 1), ("a", 2)]),
    }
    model, optim = make()  # (draws from torch's RNG: the saved state is the one above)
    with daemon.client("extra") as c:
        c.snapshot(model, optim, step=1, extra=extra).wait(30)
        got = c.restore(model, optim)
    assert got["python_rng"] == extra["python_rng"]
    want_np = extra["numpy_rng"]
    assert got["numpy_rng"][0] == want_np[0] and np.array_equal(got["numpy_rng"][1], want_np[1]) and got["numpy_rng"][2:] == want_np[2:]
    assert got["generator"] == rng.bit_generator.state
    assert torch.equal(got["torch_rng"], extra["torch_rng"])
    random.setstate(got["python_rng"])
    np.random.set_state(got["numpy_rng"])
    torch.set_rng_state(got["torch_rng"])  # each takes the state back as it gave it
    for k, a in extra["arrays"].items():
        assert type(got["arrays"][k]) is np.ndarray and got["arrays"][k].dtype == a.dtype and np.array_equal(got["arrays"][k], a), k
    s = got["scalars"]
    assert [type(x) for x in s] == [np.float32, np.int64, np.bool_, np.float64] and s[:3] == [1.5, -3, True] and np.isnan(s[3])
    assert type(got["order"]) is OrderedDict and list(got["order"]) == ["b", "a"]
    # the restored loader goes on with the very batches the saved one would have given
    again = StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(99))
    again.load_state_dict(got["loader"])
    assert [b.tolist() for b in again] == [b.tolist() for b in it]


def test_extra_that_cannot_be_stored_is_refused_naming_the_key(daemon) -> None:  # noqa: ANN001
    Batch = namedtuple("Batch", "x y")
    model, optim = make()
    with daemon.client("bad-extra") as c:
        with pytest.raises(UnsupportedState, match=r"named tuple Batch at extra/0/last: store its ._asdict\(\)"):
            c.snapshot(model, optim, step=1, extra={"last": Batch(1, 2)})
        with pytest.raises(CheckpointError, match=r"numpy array at extra/0/names: dtype <U1 is not numeric"):
            c.snapshot(model, optim, step=1, extra={"names": np.array(["a", "b"])})
        with pytest.raises(TypeError, match="cannot checkpoint set at extra/0/seen"):  # also a TypeError, as before
            c.snapshot(model, optim, step=1, extra={"seen": {1, 2}})
        assert c.snapshot(model, optim, step=1, extra={"last": Batch(1, 2)._asdict()}).wait(30)


def test_oversized_extra_is_refused_naming_its_size_and_the_limit(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    huge = {"log": ["x" * 1000] * (MAX_MESSAGE_BYTES // 1000)}  # a list of strings: JSON, not tensors
    with daemon.client("huge") as c:
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match=r"extra's non-tensor values take 6\d\.\d MiB as JSON, over the 48 MiB limit"):
            c.snapshot(model, optim, step=1, extra=huge)
        assert time.monotonic() - t0 < 20, "refused at once, not after a timeout"
        c.snapshot(model, optim, step=1, extra={"log": np.zeros(MAX_MESSAGE_BYTES, dtype=np.uint8)}).wait(60)  # arrays: no limit


# ----------------------------------------------------------------------------- errors


def test_unsupported_dtype_is_a_checkpoint_error(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("dtype") as c:
        with pytest.raises(CheckpointError, match=r"tensor 'extra/0/z' has dtype torch.complex128, which ckptd cannot store \(it stores"):
            c.snapshot(model, optim, step=1, extra={"z": torch.zeros(2, dtype=torch.complex128)})


def test_a_failed_background_snapshot_is_raised_once(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)  # optimizer state exists: a default snapshot copies it in the background
    with daemon.client("once") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
    with daemon.client("once", overlap="always") as c:  # another run of the job, saving a step that is already committed
        h = c.snapshot(model, optim, step=1)
        train_step(model, optim, 1)
        with pytest.raises(CheckpointError, match="step 1 of job once is already committed"):
            h.wait(30)
        c.snapshot(model, optim, step=2)  # the failure was raised: not again here
        assert len(c.wait(30)) == 1  # ... nor here
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c.close()  # ... nor here
    with daemon.client("once", overlap="always") as c:
        h = c.snapshot(model, optim, step=2)
        with pytest.raises(CheckpointError, match="already committed"):
            c.snapshot(model, optim, step=3)  # the next snapshot raises it (it is the first to see it) ...
        assert c.wait(30) == []  # ... and wait() does not raise it again
        assert c.snapshot(model, optim, step=3).wait(30)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c.close()


def test_a_failed_default_snapshot_of_cpu_state_is_raised_by_the_call(daemon) -> None:  # noqa: ANN001
    """ "auto" copies a CPU-only state before returning: the daemon's refusal is the call's own error."""
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("now") as c:
        c.snapshot(model, optim, step=1).wait(30)
    with daemon.client("now") as c:
        with pytest.raises(CheckpointError, match="^snapshot of step 1 failed: daemon refused commit: step 1 of job now is already"):
            c.snapshot(model, optim, step=1)
        assert c.status()["slots"].get("leased", 0) == 0  # the refused step's slot was given back
        assert c.snapshot(model, optim, step=2).wait(30)  # not raised again
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c.close()


def test_no_daemon_fails_fast_naming_the_endpoint(short_tmp) -> None:  # noqa: ANN001
    endpoint = f"ipc://{short_tmp}/ckptd.sock"
    model, optim = make()
    t0 = time.monotonic()
    with ckptd.Client(endpoint=endpoint, job="j") as c:  # the default timeout: 30 s
        with pytest.raises(ckptd.DaemonUnavailable, match=f"no ckptd daemon at {endpoint}.*is `ckptd serve` running"):
            c.snapshot(model, optim, step=1)
    assert time.monotonic() - t0 < 5


def test_a_killed_daemons_leftover_socket_fails_fast(make_daemon) -> None:  # noqa: ANN001
    daemon = make_daemon()
    daemon.kill()  # SIGKILL: the socket file stays behind, nobody listens on it
    model, optim = make()
    t0 = time.monotonic()
    with ckptd.Client(endpoint=daemon.endpoint, job="j") as c:
        with pytest.raises(ckptd.DaemonUnavailable, match="exists but nobody listens on it"):
            c.snapshot(model, optim, step=1)
    assert time.monotonic() - t0 < 5


def test_bad_endpoint_syntax_says_what_an_endpoint_looks_like(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_ENDPOINT", "/run/user/1000/ckptd/ckptd.sock")  # a path, without ipc://
    with pytest.raises(CheckpointError, match="is not a ckptd endpoint.*ipc:///path/to/ckptd.sock.*tcp://host:port"):
        ckptd.Client(job="j")


@pytest.mark.multiproc
def test_ranks_passing_different_steps_all_get_one_clear_error(daemon) -> None:  # noqa: ANN001
    outs = run_ranks(2, different_steps, daemon.endpoint, "steps")
    for o in outs:
        assert "the ranks passed different steps (rank 0: 4, rank 1: 5)" in o["error"], o
        assert o["in_flight"] == []
    assert not list((Path(daemon.root) / "steps").glob("step-*")), "nothing of either step was committed"


def test_ranks_that_restored_different_steps_get_one_clear_error_at_the_next_snapshot(daemon) -> None:  # noqa: ANN001
    outs = run_ranks(2, restore_different_steps, daemon.endpoint, "restores")
    for o in outs:
        assert "the ranks restored different steps before it (rank 0: 2, rank 1: 4)" in o["error"], o
    assert not (Path(daemon.root) / "restores" / "step-5").exists()


@pytest.mark.multiproc
def test_snapshot_on_rank_0_only_is_an_error_not_a_hang(daemon, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CKPTD_COLLECTIVE_TIMEOUT", "3")
    t0 = time.monotonic()
    outs = run_ranks(2, snapshot_on_rank0_only, daemon.endpoint, "rank0", timeout=60)
    assert "only 1 of 2 ranks called it within 3 s" in outs[0]["error"] and "never under `if rank == 0`" in outs[0]["error"]
    assert outs[1]["error"] is None
    assert time.monotonic() - t0 < 45


@pytest.mark.multiproc
def test_a_mistake_on_one_rank_is_every_ranks_error_at_once(daemon, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CKPTD_COLLECTIVE_TIMEOUT", "60")
    t0 = time.monotonic()
    outs = run_ranks(2, bad_extra_on_one_rank, daemon.endpoint, "one-bad", timeout=60)
    assert "cannot checkpoint set at extra/1/seen" in outs[1]["error"]
    assert "rank(s) [1] could not stage their state" in outs[0]["error"]
    assert all(o["then"].endswith("step-2") for o in outs)
    assert time.monotonic() - t0 < 40, "no rank waited for the collective timeout"


@pytest.mark.multiproc
def test_a_restore_that_fails_on_one_rank_fails_on_every_rank(daemon) -> None:  # noqa: ANN001
    outs = run_ranks(2, restore_into_a_model_one_rank_extended, daemon.endpoint, "one-rank")
    for o in outs:
        assert "missing from the checkpoint: model/extra_stat" in o["error"], o


# ----------------------------------------------------------------------------- runs and steps


@pytest.mark.multiproc
def test_relaunch_after_a_crash_mid_step_never_mixes_two_runs(daemon, short_tmp) -> None:  # noqa: ANN001
    """Rank 0 committed step 4, rank 1 died first. The relaunch resumes from step 2 and saves step 4
    again: step 4 is all the new run's, not rank 0's old shard beside rank 1's new one."""
    run_ranks(2, die_before_commit, daemon.endpoint, "mixed", expect_exit=9)
    expected = str(short_tmp / "expected.safetensors")
    outs = run_ranks(2, resume_and_save_again, daemon.endpoint, "mixed", expected)
    assert [o["restored"] for o in outs] == [2, 2]
    outs = run_ranks(2, restore_and_compare, daemon.endpoint, "mixed", expected)
    assert outs == [{"step": 4, "same": True}] * 2
    assert not (Path(daemon.root) / "mixed" / "step-4.tmp").exists()


def test_rolling_back_then_saving_again_starts_a_new_line(make_daemon) -> None:  # noqa: ANN001
    daemon = make_daemon("--keep", "10")
    model, optim = make()
    with daemon.client("roll") as c:
        for i in range(4):
            train_step(model, optim, i)
            c.snapshot(model, optim, step=i + 1).wait(30)
    with daemon.client("roll") as c:  # a fresh run must not overwrite step 3 by accident, even after saving others
        c.snapshot(model, optim, step=9, blocking=True).wait(30)
        with pytest.raises(CheckpointError, match="step 3 of job roll is already committed and this client restored no step.*rolled back"):
            c.snapshot(model, optim, step=3, blocking=True)
    with daemon.client("roll") as c:  # the loss spiked after step 2: go back and train on other data
        assert c.restore(model, optim, step=2).step == 2
        for i in (2, 3):
            train_step(model, optim, 100 + i)
            c.snapshot(model, optim, step=i + 1, blocking=True).wait(30)
        assert c.latest() == 4
        with pytest.raises(CheckpointError, match="step 4 of job roll was already saved by this client since it restored step 2"):
            c.snapshot(model, optim, step=4, blocking=True)
        fresh, fopt = make(seed=7)
        c.restore(fresh, fopt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


def test_two_live_runs_sharing_a_job_are_refused(daemon) -> None:  # noqa: ANN001
    script = textwrap.dedent(
        """
        import sys, torch, ckptd
        m = torch.nn.Linear(2, 2)
        with ckptd.Client(endpoint=sys.argv[1], job="shared") as c:
            c.snapshot(m, step=1, blocking=True).wait(30)
            print("saved", flush=True)
            sys.stdin.readline()  # stays alive until told
        """
    )
    other = subprocess.Popen(
        [sys.executable, "-c", script, daemon.endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert other.stdout.readline().strip() == "saved"  # type: ignore[union-attr]
        model = torch.nn.Linear(2, 2)
        with daemon.client("shared") as c:
            with pytest.raises(
                CheckpointError, match=rf"job 'shared' is being saved by another run whose processes are alive \(pids \[{other.pid}\]"
            ):
                c.snapshot(model, step=2, blocking=True)
        other.communicate("\n", timeout=30)
        with daemon.client("shared") as c:  # that run is gone: a relaunch takes the job over
            c.snapshot(model, step=2, blocking=True).wait(30)
    finally:
        other.kill()
        other.wait()


def test_torchrun_standalone_relaunch_resumes_the_same_job(daemon, short_tmp) -> None:  # noqa: ANN001
    """``torchrun --standalone`` draws a new run id per launch; the job must not change with it."""
    script = short_tmp / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist, ckptd
            dist.init_process_group("gloo")
            m = torch.nn.Linear(2, 2)
            c = ckptd.Client()
            last = c.latest()
            start = 0 if last is None else c.restore(m).step
            c.snapshot(m, step=start + 1, blocking=True).wait(30)
            print(c.job, start, flush=True)
            dist.destroy_process_group()
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_JOB"}
    env.update(CKPTD_ENDPOINT=daemon.endpoint, PYTHONPATH=str(REPO))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(script), "--lr", "1e-3"]
    runs = [subprocess.run(torchrun, env=env, cwd=short_tmp, capture_output=True, text=True, timeout=120) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    (job1, start1), (job2, start2) = (r.stdout.split()[-2:] for r in runs)
    assert job1 == job2 and job1.startswith("train-") and (start1, start2) == ("0", "1")
