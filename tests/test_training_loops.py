"""What a real training loop does with ckptd, written as the user's actions: ckptd never changes the
training it protects, restore is strict by default and can load a subset or another dtype."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _models import Net, assert_same, full_state, make, train_step

import ckptd
from ckptd import shm
from ckptd.errors import CheckpointError


def _run(steps: int, client: ckptd.Client | None = None, every: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = make()
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 3))
    if client is not None:
        client.prepare(model, optim)
        client.snapshot(model, optim, step=0)  # before the first step: the optimizer has no state yet
    for i in range(steps):
        train_step(model, optim, i)
        sched.step()
        if client is not None and (i + 1) % every == 0:
            client.snapshot(model, optim, step=i + 1, extra={"sched": sched.state_dict()})
    if client is not None:
        client.wait(60)
    return model, optim


def test_prepare_and_snapshot_before_the_first_step_leave_training_unchanged(daemon) -> None:  # noqa: ANN001
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    hooks = set(_global_optimizer_pre_hooks)
    model, optim = make()
    with daemon.client("fresh", overlap="always") as c:
        c.prepare(model, optim)
        c.snapshot(model, optim, step=0, blocking=True)
        c.snapshot(model, optim, step=1).wait(30)
    assert optim.state_dict()["state"] == {}, "prepare()/snapshot() initialized the optimizer's state"
    assert all(p.grad is None for p in model.parameters())
    assert not optim._optimizer_step_pre_hooks and set(_global_optimizer_pre_hooks) == hooks, "a closed client left a hook"
    with daemon.client("loop") as c:
        with_ckptd = _run(6, c)
    without = _run(6)
    assert_same(full_state(*with_ckptd), full_state(*without))


def test_restoring_a_step_taken_before_the_first_step_gives_an_optimizer_without_state(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("zero") as c:
        c.snapshot(model, optim, step=0).wait(30)
        trained, topt = make(seed=3)
        train_step(trained, topt, 0)
        assert topt.state
        c.restore(trained, topt, step=0)
    assert topt.state_dict()["state"] == {}
    fresh_model, fresh_optim = make()
    assert_same(full_state(trained, topt), full_state(fresh_model, fresh_optim))


class Finetune(torch.nn.Module):
    """``Net`` with its output layer replaced by a new head of another name."""

    def __init__(self) -> None:
        super().__init__()
        base = Net()
        self.inp, self.norm, self.hidden = base.inp, base.norm, base.hidden
        self.register_buffer("counter", torch.zeros(3, dtype=torch.int64))
        self.head = torch.nn.Linear(40, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.norm(self.inp(x)))))


def test_restore_is_strict_and_strict_false_loads_the_intersection(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("ft") as c:
        c.snapshot(model, optim, step=1).wait(30)
        ft = Finetune()
        fopt = torch.optim.AdamW(ft.parameters(), lr=1e-3)
        head = ft.head.weight.detach().clone()
        with pytest.raises(CheckpointError, match=r"missing from the checkpoint: model/head\.weight, model/head\.bias.*model/out\.weight"):
            c.restore(ft, fopt)
        got = c.restore(ft, fopt, strict=False)
    assert isinstance(got, dict) and got == {}
    assert got.missing_keys == ["model/head.weight", "model/head.bias", "optim/state/head.weight", "optim/state/head.bias"]
    assert got.unexpected_keys == ["model/out.weight", "optim/state/out.weight"]
    assert torch.equal(ft.inp.weight, model.inp.weight) and torch.equal(ft.head.weight, head)
    assert torch.equal(fopt.state[ft.inp.weight]["exp_avg"], optim.state[model.inp.weight]["exp_avg"])
    assert ft.head.weight not in fopt.state, "a new parameter starts without optimizer state"
    assert fopt.param_groups[0]["lr"] == optim.param_groups[0]["lr"]


def test_restore_into_another_dtype_only_when_asked(daemon) -> None:  # noqa: ANN001
    model, _ = make()
    model = model.to(torch.bfloat16)
    with daemon.client("bf16") as c:
        c.snapshot(model, step=1).wait(30)
        fp32, _ = make(seed=5)
        with pytest.raises(CheckpointError, match=r"holds torch.bfloat16, the target is torch.float32: pass dtype=torch.float32"):
            c.restore(fp32)
        c.restore(fp32, dtype=torch.float32)
    assert fp32.inp.weight.dtype == torch.float32
    assert torch.equal(fp32.inp.weight, model.inp.weight.float())
    assert torch.equal(fp32.counter, model.counter), "integer tensors load as they are"


def test_saved_optimizer_state_reaches_parameters_that_have_none_yet(daemon) -> None:  # noqa: ANN001
    """Rolling back in a live process where some parameters never stepped, and a fresh optimizer whose
    parameters already hold gradients (torch then gives it no state to load into)."""
    model, optim = make()
    for i in range(2):
        train_step(model, optim, i)
    want = full_state(model, optim)
    with daemon.client("partial") as c:
        c.snapshot(model, optim, step=2).wait(30)
        live, lopt = make(seed=4)
        live.out.weight.requires_grad_(False)
        train_step(live, lopt, 0)  # out.weight has no optimizer state
        live.out.weight.requires_grad_(True)
        assert live.out.weight not in lopt.state
        c.restore(live, lopt, step=2)
        assert_same(full_state(live, lopt), want)
        fresh, fopt = make(seed=5)
        fresh(torch.ones(1, 16)).sum().backward()  # gradients, no optimizer state
        c.restore(fresh, fopt)
        assert_same(full_state(fresh, fopt), want)


def test_a_tensor_of_another_size_is_an_error_even_when_not_strict(daemon) -> None:  # noqa: ANN001
    model, _ = make()
    with daemon.client("size") as c:
        c.snapshot(model, step=1).wait(30)
        wider = Net(h=48)
        for strict in (True, False):
            with pytest.raises(
                CheckpointError, match=r"size mismatch for model/inp.weight: the checkpoint holds \[40, 16\], the target \[48, 16\]"
            ):
                c.restore(wider, strict=strict)


def test_param_groups_are_matched_by_their_parameters_not_their_order(daemon) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = Net()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "lr": 1e-3}, {"params": rest, "weight_decay": 0.0, "lr": 2e-3}])
    train_step(model, optim, 0)
    with daemon.client("groups") as c:
        c.snapshot(model, optim, step=1).wait(30)
        other = Net()
        swapped = torch.optim.AdamW(
            [
                {"params": [p for n, p in other.named_parameters() if not n.endswith("weight")], "weight_decay": 0.5, "lr": 1.0},
                {"params": [p for n, p in other.named_parameters() if n.endswith("weight")], "weight_decay": 0.5, "lr": 1.0},
            ]
        )
        c.restore(other, swapped)
    assert [(g["weight_decay"], g["lr"]) for g in swapped.param_groups] == [(0.0, 2e-3), (0.1, 1e-3)]


@pytest.mark.parametrize("opt", ["adamw", "sgd-momentum", "adam-amsgrad"])
def test_prepare_before_the_first_step_sizes_slots_for_the_state_that_step_makes(daemon, opt: str) -> None:  # noqa: ANN001
    """README's loop on a fresh start calls prepare() before the optimizer has state (torch makes it in the first
    step): the slots fit the parameters alone, and the first snapshot after training began made and mapped a
    slot on its own path. A shadow optimizer on the meta device foresees the state; the real one is untouched."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(640, 640), torch.nn.LayerNorm(640), torch.nn.Linear(640, 8))  # 1.6 MB: 2 MiB slots
    model[1].weight.requires_grad_(False)  # frozen: no state
    make_opt = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, foreach=True),
    }[opt]
    optim = make_opt([p for p in model.parameters() if p.requires_grad])
    with daemon.client(f"fresh-{opt}") as c:
        c.prepare(model, optim)
        assert optim.state_dict()["state"] == {} and all(p.grad is None for p in model.parameters())
        sizes = {seg: os.path.getsize(os.path.join(shm.SHM_DIR, seg)) for seg in shm.segments_of(daemon.root)}
        model(torch.randn(4, 640)).sum().backward()
        optim.step()
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        assert c._stager.layout.file_size <= min(sizes.values()), (c._stager.layout.file_size, sizes)
        assert c._maps.made_on_path == 0  # the snapshot found a prepared slot, mapped already


def _ddp_prepare_then_snapshot(rank: int, world: int, endpoint: str, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptd.client import Client

    torch.manual_seed(0)
    dims = [256, 1000, 1000, 256]  # replicated chunks: the plan spreads them, the optimizer state among them
    m = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])]))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with Client(endpoint=endpoint, job="ddp-fresh") as c:
        c.prepare(m, opt)
        dist.barrier()  # both ranks' slots made
        prepared = [os.path.getsize(os.path.join(shm.SHM_DIR, seg)) for seg in shm.segments_of(root)]
        m(torch.randn(4, 256)).sum().backward()
        opt.step()
        c.snapshot(m, opt, step=1, blocking=True).wait(60)
        return {"prepared": prepared, "needed": c._stager.layout.file_size}


@pytest.mark.multiproc
def test_prepare_before_the_first_step_under_ddp_sizes_each_ranks_share_of_the_state(daemon) -> None:  # noqa: ANN001
    """Under DDP every chunk is replicated and the plan spreads them over the ranks: the state the first step makes
    changes each rank's share, so sizing the state of the chunks a rank wrote before gave one rank slots too small."""
    from _dist import run_ranks

    outs = run_ranks(2, _ddp_prepare_then_snapshot, daemon.endpoint, daemon.root)
    for o in outs:
        assert len(o["prepared"]) == 4 and o["needed"] <= min(o["prepared"]), outs  # every prepared slot fits either rank's shard


def _fsdp1_prepare_then_snapshot(rank: int, world: int, endpoint: str, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from ckptd.client import Client

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(2)])
    for i in range(2):
        layers[i] = FSDP(layers[i], device_id=cpu, use_orig_params=True)  # per layer, as an auto-wrap policy does
    m = FSDP(layers, device_id=cpu, use_orig_params=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    with Client(endpoint=endpoint, job="fsdp1-fresh") as c:
        c.prepare(m, opt)
        dist.barrier()
        prepared = [os.path.getsize(os.path.join(shm.SHM_DIR, seg)) for seg in shm.segments_of(root)]
        m(torch.randn(4, 1024)).sum().backward()
        opt.step()
        c.snapshot(m, opt, step=1, blocking=True).wait(60)
        return {"prepared": prepared, "needed": c._stager.layout.file_size, "made_on_path": c._maps.made_on_path}


@pytest.mark.multiproc
def test_prepare_before_the_first_step_under_fsdp1_sizes_the_state_of_its_flat_slices(daemon) -> None:  # noqa: ANN001
    """FSDP1 with use_orig_params: a rank holds a flat 1-D slice of each parameter, saved as row chunks of it. The
    projected state never matched the chunks' shape, went in once as a "step counter" (and the two ranks' equal
    slices then looked like one replicated chunk): slots 10 MiB for a 12.6 MB shard, made again on the path."""
    from _dist import run_ranks

    for o in run_ranks(2, _fsdp1_prepare_then_snapshot, daemon.endpoint, daemon.root):
        assert o["needed"] <= min(o["prepared"]) and o["made_on_path"] == 0, o  # its own prepared slot, mapped already


def test_prepare_sizes_the_state_to_come_of_parameters_a_partial_restore_left_without(daemon) -> None:  # noqa: ANN001
    """Fine-tuning with a new head: restore(strict=False) gives the body its saved optimizer state and the head none;
    prepare() saw state and sized the slots for what the optimizer held, and the first snapshot made a slot."""
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(body.parameters())
    body(torch.randn(2, 256)).sum().backward()
    opt.step()
    with daemon.client("head") as c:
        c.snapshot(body, opt, step=1, blocking=True).wait(30)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2048))
        opt2 = torch.optim.Adam(model.parameters())
        c.restore(model, opt2, strict=False)
        c.prepare(model, opt2)
        made = c._maps.made_on_path  # step 1's snapshot mapped its slot on its path: no prepare() before it
        assert len(opt2.state) == 2  # the real optimizer untouched: the body's weight and bias have state, the head none
        model(torch.randn(2, 256)).sum().backward()
        opt2.step()
        c.snapshot(model, opt2, step=2, blocking=True, extra={"rng": torch.get_rng_state()}).wait(30)
        assert c._maps.made_on_path == made


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"persist_every": 2**31 + 1}, "persist_every must be an int in 1..2147483648"),
        ({"persist_interval": True}, "persist_interval must be a number"),
        ({"persist_interval": "10"}, "persist_interval must be a number"),
        ({"persist_interval": float("nan")}, "persist_interval must be a number"),
    ],
)
def test_tiering_values_the_daemon_refuses_are_refused_when_the_client_is_made(daemon, kwargs: dict[str, Any], match: str) -> None:  # noqa: ANN001
    """They were taken, and every snapshot then copied its state only to be refused at the commit."""
    from ckptd.client import Client

    with pytest.raises(ValueError, match=match):
        Client(endpoint=daemon.endpoint, job="tiers", **kwargs)


@pytest.mark.parametrize("slots", [-3, 2.5, True, 10**6])
def test_prepare_refuses_a_slot_count_that_is_not_one(daemon, slots: Any) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("slots") as c, pytest.raises(ValueError, match=r"prepare\(slots=...\) takes an int in 0..16"):
        c.prepare(model, optim, slots=slots)


def _prepare_with_rank_1s_daemon_down(rank: int, world: int, endpoint: str, short_tmp: str) -> dict[str, Any]:
    import time

    from ckptd.client import Client

    model, optim = make()
    where = endpoint if rank == 0 else f"ipc://{short_tmp}/down.sock"  # node 1's daemon is not running
    t0 = time.monotonic()
    with Client(endpoint=where, job="down", timeout=5.0) as c:
        try:
            c.prepare(model, optim)
            return {"error": None, "took": time.monotonic() - t0}
        except CheckpointError as e:
            return {"error": str(e), "took": time.monotonic() - t0}


@pytest.mark.multiproc
def test_prepare_with_one_ranks_daemon_down_fails_on_every_rank_at_once(daemon, short_tmp, monkeypatch) -> None:  # noqa: ANN001
    """prepare() asked its daemon for the tiering before the plan's collective: the rank whose daemon was down
    raised alone, and the others waited in the collective for CKPTD_COLLECTIVE_TIMEOUT (30 minutes)."""
    from _dist import run_ranks

    monkeypatch.setenv("CKPTD_COLLECTIVE_TIMEOUT", "120")
    for o in run_ranks(2, _prepare_with_rank_1s_daemon_down, daemon.endpoint, str(short_tmp)):
        assert o["error"] is not None and ("[1]" in o["error"] or "no ckptd daemon" in o["error"]) and o["took"] < 60, o


def test_prepare_runs_no_optimizer_step_hook_for_its_shadow_optimizer(daemon) -> None:  # noqa: ANN001
    """The shadow optimizer's step ran the process-wide optimizer hooks: a user's EMA or step counter saw a step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    seen: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append("pre")),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append("post")),
    ]
    try:
        model, optim = make()
        with daemon.client("hooks") as c:
            c.prepare(model, optim)
        assert seen == [] and optim.state_dict()["state"] == {}
    finally:
        for h in handles:
            h.remove()
