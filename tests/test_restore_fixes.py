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
