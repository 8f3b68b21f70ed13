"""Restores a user can get wrong without noticing: an optimizer holding frozen parameters, an LR scheduler
resumed after a restore, a strict restore that refuses, and optimizer state not shaped like its parameter."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import ckptd
from ckptd import shm
from ckptd.errors import CheckpointError, FormatError


def _layers(seed: int, n: int = 4) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(n)])


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    optim.zero_grad()
    g = torch.Generator().manual_seed(i)
    model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
    optim.step()


def _freeze(model: torch.nn.Sequential, layers: tuple[int, ...]) -> None:
    for i in layers:
        for p in model[i].parameters():
            p.requires_grad_(False)


def test_optimizer_state_of_frozen_parameters_is_restored(daemon) -> None:  # noqa: ANN001
    """Staged unfreezing: layers 0 and 2 are frozen but stay in the optimizer with their Adam moments."""
    model = _layers(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        _step(model, optim, i)
    _freeze(model, (0, 2))
    _step(model, optim, 2)
    with daemon.client("frozen") as c:
        path = c.snapshot(model, optim, step=3, blocking=True).wait(30)
    m2 = _layers(1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    _freeze(m2, (0, 2))
    flags = [p.requires_grad for p in m2.parameters()]
    restored = ckptd.restore(m2, o2, path=path)
    assert restored.missing_keys == [] and restored.unexpected_keys == []
    assert [p.requires_grad for p in m2.parameters()] == flags == [False, False, True, True, False, False, True, True]
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        want, got = optim.state[p], o2.state[q]
        assert sorted(got) == sorted(want) == ["exp_avg", "exp_avg_sq", "step"]
        for name in want:
            assert torch.equal(got[name], want[name]), name


def _decay(epoch: int) -> float:
    return 0.5**epoch


def test_lr_scheduler_resumes_after_restore_as_if_never_interrupted(daemon) -> None:  # noqa: ANN001
    """An LR scheduler adds ``initial_lr`` to each param group; resuming one at its epoch needs it back."""
    model = _layers(0, n=2)
    optim = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _decay)
    for i in range(3):
        _step(model, optim, i)
        sched.step()
    with daemon.client("sched") as c:
        path = c.snapshot(model, optim, step=3, extra={"epoch": sched.last_epoch}, blocking=True).wait(30)
    m2 = _layers(1, n=2)
    o2 = torch.optim.SGD(m2.parameters(), lr=1.0, momentum=0.9)
    extra = ckptd.restore(m2, o2, path=path)
    assert o2.param_groups[0]["initial_lr"] == 1.0 and o2.param_groups[0]["lr"] == optim.param_groups[0]["lr"] == 0.125
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, _decay, last_epoch=extra["epoch"] - 1)  # a KeyError without initial_lr
    for i in range(3, 5):
        for m, o, s in ((model, optim, sched), (m2, o2, s2)):
            _step(m, o, i)
            s.step()
    assert o2.param_groups[0]["lr"] == optim.param_groups[0]["lr"] == 1.0 * 0.5**5
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_a_refused_strict_restore_leaves_the_model_and_optimizer_as_they_were(daemon) -> None:  # noqa: ANN001
    """A live run with a new head restores a checkpoint without it: the strict restore says what is missing,
    and the run goes on with its own weights and moments, not the checkpoint's under the new head."""
    model = _layers(0, n=2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim, 0)
    with daemon.client("head") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(30)
    live = _layers(5, n=3)
    lo = torch.optim.AdamW(live.parameters(), lr=1e-2)
    _step(live, lo, 1)
    params = [p.detach().clone() for p in live.parameters()]
    moments = [{k: v.clone() for k, v in lo.state[p].items()} for p in live.parameters()]
    with pytest.raises(CheckpointError, match="missing from the checkpoint: model/2.weight, model/2.bias"):
        ckptd.restore(live, lo, path=path)
    for p, before, state in zip(live.parameters(), params, moments):
        assert torch.equal(p, before)
        assert sorted(lo.state[p]) == sorted(state) and all(torch.equal(lo.state[p][k], v) for k, v in state.items())
    assert not torch.equal(live[0].weight, model[0].weight)


def test_a_read_that_fails_midway_says_the_model_may_be_partly_overwritten(daemon) -> None:  # noqa: ANN001
    """A shard whose last tensor is corrupt on disk: the tensors before it were already read into the live
    model. A single-process restore said only "checksum mismatch", as if nothing had changed; it now says to
    restore again (still a FormatError: a hot restore falls back to the disk on it)."""
    model = _layers(0, n=2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim, 0)
    with daemon.client("midway") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(30)
    shard = next(os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors"))
    with open(shard, "r+b") as f:  # a flipped byte in the last tensor's data
        f.seek(-8, os.SEEK_END)
        b = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    live = _layers(5, n=2)
    lo = torch.optim.AdamW(live.parameters(), lr=1e-2)
    with pytest.raises(
        FormatError,
        match=r"checksum mismatch in .*rank-00000.safetensors \(tensor .*; "
        r"this rank's model and optimizer may be partly overwritten: restore again",
    ):
        ckptd.restore(live, lo, path=path)


def _two_layers(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _refused_on_rank_1(rank: int, world: int, path: str) -> dict[str, Any]:
    model = _two_layers(9)
    if rank == 1:
        model = model.double()  # a mistake on one rank only
    before = [p.detach().clone() for p in model.parameters()]
    try:
        ckptd.restore(model, path=path)
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "unchanged": all(torch.equal(p, b) for p, b in zip(model.parameters(), before))}


@pytest.mark.multiproc
def test_a_restore_refused_on_one_rank_loads_nothing_on_any_rank(daemon) -> None:  # noqa: ANN001
    with daemon.client("one") as c:
        path = c.snapshot(_two_layers(0), step=1, blocking=True).wait(30)
    outs = run_ranks(2, _refused_on_rank_1, path, timeout=100)
    assert "the checkpoint holds torch.float32, the target is torch.float64" in outs[1]["error"], outs
    assert "restore failed on rank(s) [1]" in outs[0]["error"] and "nothing was loaded on this rank" in outs[0]["error"], outs
    assert all(o["unchanged"] for o in outs), outs


def _own(rank: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.shared = torch.nn.Linear(2, 2)  # replicated: the same on every rank
    torch.manual_seed(seed + 1 + rank)
    setattr(model, f"own{rank}", torch.nn.Linear(16, 16))  # only this rank holds it
    return model


def _spoil_own_segment(root: str, key: str) -> None:
    """Overwrite the first bytes of ``key`` in the daemon's shared-memory copy of this rank's shard."""
    for name in shm.segments_of(root):
        with open(shm.path_of(name), "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            if key in header:
                f.seek(8 + n + header[key]["data_offsets"][0])
                f.write(b"\x7f" * 16)
                return
    raise AssertionError(f"no segment holds {key}")


def _hot_restore_spoiled_on_rank_1(rank: int, world: int, endpoint: str, root: str, key: str) -> dict[str, Any]:
    os.environ["CKPTD_COLLECTIVE_TIMEOUT"] = "20"  # a rank left alone in the collective fails in 20 s, not 30 min
    model = _own(rank, 0)
    kept = torch.arange(64.0) + rank
    with ckptd.Client(endpoint=endpoint, job="spoiled") as c:
        c.snapshot(model, step=1, extra={"kept": kept}, blocking=True).wait(60)
        if rank == 1:
            _spoil_own_segment(root, key)
        dist.barrier()
        other = _own(rank, 9)
        extra = c.restore(other)
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters())) and torch.equal(extra["kept"], kept)
        return {"source": c.last_restore["source"], "same": same}


@pytest.mark.multiproc
@pytest.mark.parametrize("key", ["model/own1.weight", "extra/1/kept"])
def test_a_hot_restore_corrupt_on_one_rank_reads_the_disk_on_every_rank(daemon, key: str) -> None:  # noqa: ANN001
    """Rank 1's shared-memory copy of a parameter, or of a tensor in its ``extra``, is corrupt: its read fails
    after rank 0 read its own. Every rank is told the checkpoint is bad (a FormatError) and every rank reads
    the step from disk, together (rank 1 used to go alone, and wait in the collective until it timed out)."""
    outs = run_ranks(2, _hot_restore_spoiled_on_rank_1, daemon.endpoint, daemon.root, key, timeout=100)
    assert [o["source"] for o in outs] == ["disk", "disk"] and all(o["same"] for o in outs), outs


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="this torch has no Adafactor")
def test_factored_optimizer_state_restores_after_a_warm_up_backward(daemon) -> None:  # noqa: ANN001
    """Adafactor keeps a weight's second moment factored (``row_var`` [out, 1], ``col_var`` [1, in]). A
    resumed run whose parameters already have gradients (a warm-up backward) but whose optimizer has no
    state yet gets it all back, and its next step is the uninterrupted run's."""
    model = _layers(0, n=2)
    optim = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    for i in range(2):
        _step(model, optim, i)
    assert tuple(optim.state[model[0].weight]["row_var"].shape) == (6, 1)
    with daemon.client("factored") as c:
        path = c.snapshot(model, optim, step=2, blocking=True).wait(30)
    m2 = _layers(1, n=2)
    o2 = torch.optim.Adafactor(m2.parameters(), lr=1e-2)
    m2(torch.randn(5, 6)).sum().backward()  # gradients, no optimizer state
    restored = ckptd.restore(m2, o2, path=path)
    assert restored.missing_keys == [] and restored.unexpected_keys == []
    for p, q in zip(model.parameters(), m2.parameters()):
        assert sorted(o2.state[q]) == sorted(optim.state[p])
        assert all(torch.equal(o2.state[q][k], v) for k, v in optim.state[p].items())
    _step(model, optim, 2)
    _step(m2, o2, 2)
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(o2.state[q][k], v) for k, v in optim.state[p].items())


def _factored_into_fsdp2(rank: int, world: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _layers(1, n=2)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    model(torch.randn(5, 6)).sum().backward()  # gradients, no optimizer state
    try:
        ckptd.restore(model, optim, path=path)
    except CheckpointError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.multiproc
@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="this torch has no Adafactor")
def test_factored_state_into_a_sharded_parameter_without_state_says_when_to_restore(daemon) -> None:  # noqa: ANN001
    """FSDP2 parameters shard their optimizer state like themselves; with no state yet there is no layout
    for a factored entry: the error names it and says what works, instead of listing it missing and unexpected."""
    model = _layers(0, n=2)
    optim = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    _step(model, optim, 0)
    with daemon.client("factored-fsdp") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(30)
    (out,) = run_ranks(1, _factored_into_fsdp2, path, timeout=100)
    assert "cannot restore optim/state/0.weight/row_var (saved shape [6, 1]) into sharded parameter 0.weight" in out["error"], out
    assert "which has no optimizer state yet to take its layout from (ckptd never steps an optimizer" in out["error"], out
    assert "take one optimizer step before restoring" in out["error"], out
    assert "missing from the checkpoint" not in out["error"], out
