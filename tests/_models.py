"""Small models and helpers shared by tests (also imported by spawned ranks and subprocesses)."""

from __future__ import annotations

import torch


class Net(torch.nn.Module):
    def __init__(self, d: int = 16, h: int = 40, out: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, h)
        self.norm = torch.nn.LayerNorm(h)
        self.hidden = torch.nn.Linear(h, h)
        self.out = torch.nn.Linear(h, out, bias=False)
        self.register_buffer("counter", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter += 1  # a buffer mutated in forward, as BatchNorm's running stats are
        return self.out(torch.relu(self.hidden(self.norm(self.inp(x)))))


def batch(i: int, d: int = 16, n: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, d, generator=g)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> float:  # noqa: D103
    optim.zero_grad()
    loss = model(batch(i)).pow(2).mean()
    loss.backward()
    optim.step()
    return float(loss.detach())


def make(seed: int = 0, lr: float = 1e-2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = Net()
    return m, torch.optim.AdamW(m.parameters(), lr=lr)


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer (full, gathered) keyed by name, cloned."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    if optim is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {f"model/{k}": _full(v) for k, v in get_model_state_dict(model, options=opts).items()}
    from ckptd.client.capture import no_optimizer_init

    with no_optimizer_init():  # an optimizer without state is compared as it is, not given state
        msd, osd = get_state_dict(model, optim, options=opts)
    out = {f"model/{k}": _full(v) for k, v in msd.items()}
    if True:
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/{fqn}/{k}"] = _full(v)
        out["optim/lr"] = torch.tensor([g["lr"] for g in osd["param_groups"]])
    return out


def _full(v: torch.Tensor) -> torch.Tensor:
    if hasattr(v, "full_tensor"):
        v = v.full_tensor()
    return v.detach().clone()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k} differs"
