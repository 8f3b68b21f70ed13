"""Restores a user can get wrong without noticing: an optimizer holding frozen parameters, an LR scheduler
resumed after a restore, a strict restore that refuses, and optimizer state not shaped like its parameter."""

from __future__ import annotations

import torch

import ckptd


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
