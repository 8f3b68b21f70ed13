"""State of unusual shape, found by a review: names that change while the tensors stay (the capture cache), a module's
extra state (a tensor whose size follows its content; missing or unexpected), optimizer parameters the model does not
name, lazy modules not initialized yet, and ``extra`` values that would not come back as given."""

from __future__ import annotations

import collections
import enum
import json
import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import ckptd
from ckptd.client.capture import StateCapture
from ckptd.errors import CheckpointError, UnsupportedState
from ckptd.state import flatten


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int = 0) -> None:
    optim.zero_grad()
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
    optim.step()


def _saved_keys(path: str) -> list[str]:
    with open(os.path.join(path, "manifest.json")) as f:
        return sorted(json.load(f)["tensors"])


# --- the capture cache follows the names the state is saved under ---------------------------------------------


def _rename(m: nn.Sequential) -> None:
    m.add_module("new", m.old)
    del m.old


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrize(m: nn.Sequential) -> None:  # the same tensor, now saved as parametrizations.weight.original
    parametrize.register_parametrization(m.old, "weight", _Symmetric())


def _not_persistent(m: nn.Sequential) -> None:
    m._non_persistent_buffers_set.add("scale")


@pytest.mark.parametrize(
    ("change", "want", "weight"),
    [
        (_rename, ["new.weight", "scale"], "new.weight"),
        (_parametrize, ["old.parametrizations.weight.original", "scale"], "old.parametrizations.weight.original"),
        (_not_persistent, ["old.weight"], "old.weight"),
    ],
    ids=["renamed", "parametrized", "non-persistent"],
)
def test_a_change_of_names_alone_is_captured_afresh(change: Callable[[nn.Sequential], None], want: list[str], weight: str) -> None:
    model = nn.Sequential()
    model.add_module("old", nn.Linear(6, 6, bias=False))
    model.register_buffer("scale", torch.ones(3))  # before the weight, whose tensor stays: only its name changes
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optim)
    cap = StateCapture()
    cap.capture(model, optim)
    assert cap.capture(model, optim)[2]  # cached while nothing changes
    change(model)
    tree, _, reused = cap.capture(model, optim)
    assert not reused
    assert sorted(tree["model"]) == want and list(tree["optim"]["state"]) == [weight]


def test_a_renamed_submodule_is_saved_under_its_new_name(daemon) -> None:  # noqa: ANN001
    model = nn.Sequential()
    model.add_module("old", nn.Linear(6, 6, bias=False))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optim)
    with daemon.client("renamed") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        _rename(model)
        path = c.snapshot(model, optim, step=2, blocking=True).wait(30)
    assert _saved_keys(path) == ["model/new.weight", "optim/state/new.weight/momentum_buffer"]


# --- a module's extra state -----------------------------------------------------------------------------------


class _FP8Like(nn.Module):
    """Extra state as TransformerEngine keeps its FP8 metadata: a uint8 tensor of pickled state, empty when fresh."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.meta: dict[str, int] = {}

    def get_extra_state(self) -> torch.Tensor:
        raw = pickle.dumps(self.meta) if self.meta else b""
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.meta = pickle.loads(state.numpy().tobytes()) if state.numel() else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.meta["amax"] = self.meta.get("amax", 0) + 1
        return self.lin(x)


def test_a_tensor_extra_state_of_another_size_is_restored_as_saved(daemon) -> None:  # noqa: ANN001
    model = _FP8Like()
    optim = torch.optim.Adam(model.parameters())
    _step(model, optim)
    _step(model, optim, 1)
    with daemon.client("fp8") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        fresh = _FP8Like()  # its extra state is empty: another size than the saved one
        restored = c.restore(fresh, torch.optim.Adam(fresh.parameters()))
        assert fresh.meta == model.meta == {"amax": 2}
        assert restored.missing_keys == [] and restored.unexpected_keys == []
        _step(fresh, torch.optim.Adam(fresh.parameters()))
        again = _FP8Like()
        again.meta = {"amax": 7}  # the saved size: read into the target's own tensor
        c.restore(again)
    assert again.meta == {"amax": 2} and torch.equal(again.lin.weight, model.lin.weight)


class _Vocab(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.vocab = ["a"]

    def get_extra_state(self) -> dict[str, Any]:
        return {"vocab": self.vocab}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.vocab = state["vocab"]


def _plain() -> nn.Sequential:
    m = nn.Sequential(nn.Module())
    m[0].lin = nn.Linear(2, 2)
    return m


def test_a_missing_or_unexpected_extra_state_is_a_strict_restores_mismatch(daemon) -> None:  # noqa: ANN001
    with daemon.client("vocab") as c:
        without = c.snapshot(_plain(), step=1, blocking=True).wait(30)
        with_vocab = c.snapshot(nn.Sequential(_Vocab()), step=2, blocking=True).wait(30)
    target = nn.Sequential(_Vocab())
    target[0].vocab = ["stale"]
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: model/0\._extra_state"):
        ckptd.restore(target, path=without)
    assert target[0].vocab == ["stale"]
    got = ckptd.restore(target, path=without, strict=False)
    assert got.missing_keys == ["model/0._extra_state"] and got.unexpected_keys == [] and target[0].vocab == ["stale"]
    with pytest.raises(CheckpointError, match=r"not in the model or optimizer: model/0\._extra_state"):
        ckptd.restore(_plain(), path=with_vocab)
    got = ckptd.restore(_plain(), path=with_vocab, strict=False)
    assert got.missing_keys == [] and got.unexpected_keys == ["model/0._extra_state"]
    ckptd.restore(target, path=with_vocab)
    assert target[0].vocab == ["a"]


# --- optimizer parameters the model does not hold -------------------------------------------------------------


def test_an_optimizer_parameter_outside_the_model_is_refused_naming_it(daemon) -> None:  # noqa: ANN001
    model = nn.Linear(6, 6)
    log_alpha = torch.zeros(1, requires_grad=True)  # SAC's temperature, beside the model
    optim = torch.optim.Adam([*model.parameters(), log_alpha], lr=1e-2)
    (model(torch.randn(2, 6)).sum() * log_alpha.exp()).backward()
    optim.step()
    why = r"parameter 2 of its param group 0 \(shape \[1\]\) is not a parameter of the model"
    with daemon.client("sac") as c:
        with pytest.raises(CheckpointError, match="cannot snapshot the optimizer: " + why):
            c.snapshot(model, optim, step=1, blocking=True)
        path = c.snapshot(model, step=2, blocking=True).wait(30)  # the client goes on
    with pytest.raises(CheckpointError, match="cannot restore into the optimizer: " + why):
        ckptd.restore(model, optim, path=path)


def test_an_optimizer_made_before_the_model_was_materialized_is_refused(daemon) -> None:  # noqa: ANN001
    with daemon.client("meta") as c:
        path = c.snapshot(nn.Linear(6, 6), step=1, blocking=True).wait(30)
    with torch.device("meta"):
        model = nn.Linear(6, 6)
    optim = torch.optim.AdamW(model.parameters())
    model.to_empty(device="cpu")  # new parameters: the optimizer still holds the meta ones
    with pytest.raises(CheckpointError, match="parameter 0 of its param group 0 .* on the meta device: create the optimizer after"):
        ckptd.restore(model, optim, path=path)


# --- lazy modules -----------------------------------------------------------------------------------------------


def test_a_lazy_module_not_initialized_yet_is_refused_naming_its_key(daemon) -> None:  # noqa: ANN001
    model = nn.Sequential(nn.LazyLinear(4))
    model(torch.randn(3, 6))
    with daemon.client("lazy") as c:
        path = c.snapshot(model, step=1, blocking=True).wait(30)
        with pytest.raises(CheckpointError, match=r"cannot snapshot model/0\.weight: .*lazy module .* Run one forward pass"):
            c.snapshot(nn.Sequential(nn.LazyLinear(4)), step=2, blocking=True)
    target = nn.Sequential(nn.LazyLinear(4))
    with pytest.raises(CheckpointError, match=r"cannot restore into model/0\.weight: .*lazy module .* Run one forward pass"):
        ckptd.restore(target, path=path)
    target(torch.randn(1, 6))  # as the message says
    ckptd.restore(target, path=path)
    assert torch.equal(target[0].weight, model[0].weight)


# --- extra values that would not come back as given ------------------------------------------------------------


class _Color(enum.IntEnum):
    RED = 1


class _Key(str):
    pass


def test_a_multisteplr_state_round_trips_and_a_named_tuple_is_refused(daemon) -> None:  # noqa: ANN001
    """MultiStepLR keeps its milestones in a Counter: refused for a while as a subclass of dict (every Lightning save
    of such a run failed); it comes back as a dict, which MultiStepLR takes, and the schedule goes on the same."""
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    with daemon.client("msl") as c:
        c.snapshot(m, opt, step=1, extra={"sched": sched.state_dict(), "size": torch.Size([2, 3])}, blocking=True).wait(30)
        m2 = nn.Linear(2, 2)
        opt2 = torch.optim.SGD(m2.parameters(), lr=1.0)
        got = c.restore(m2, opt2)  # the param groups' lr with it
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[1], gamma=0.5)
    sched2.load_state_dict(got["sched"])
    for _ in range(3):
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert sched.get_last_lr() == sched2.get_last_lr()
    assert got["size"] == (2, 3)
    with pytest.raises(UnsupportedState, match=r"named tuple .* at extra/0/x: store its ._asdict\(\)"):
        flatten({"extra": {"0": {"x": collections.namedtuple("P", "a")(1)}}}, ordered=True)


def test_a_scripted_submodule_is_snapshotted(daemon) -> None:  # noqa: ANN001
    """A torch.jit.script'ed submodule's parameter dict is a wrapper tuple() could not iterate: the capture cache's
    name fingerprint failed every snapshot of such a model."""
    model = nn.Sequential(torch.jit.script(nn.Linear(4, 4)), nn.Linear(4, 2))
    with daemon.client("jit") as c:
        c.snapshot(model, step=1, blocking=True).wait(30)
        c.snapshot(model, step=2, blocking=True).wait(30)
        m2 = nn.Sequential(torch.jit.script(nn.Linear(4, 4)), nn.Linear(4, 2))
        c.restore(m2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))


def test_numpy_float64_and_the_types_a_tree_holds_come_back_as_given(daemon) -> None:  # noqa: ANN001
    extra = {"f": np.float64(0.5), "nan": np.float64("nan"), "od": collections.OrderedDict(b=1, a=True), "t": (1, "x"), "raw": b"\x00"}
    extra |= {"enum": _Color.RED, "s": np.str_("x"), _Key("k"): 2}  # a scalar's subclass: stored as its value
    with daemon.client("np") as c:
        c.snapshot(nn.Linear(2, 2), step=1, extra=extra, blocking=True).wait(30)
        got = c.restore(nn.Linear(2, 2))
    assert type(got["f"]) is np.float64 and got["f"] == 0.5 and type(got["nan"]) is np.float64
    assert type(got["od"]) is collections.OrderedDict and list(got["od"].items()) == [("b", 1), ("a", True)]
    assert got["t"] == (1, "x") and got["raw"] == b"\x00"
    assert type(got["enum"]) is int and got["enum"] == 1 and type(got["s"]) is str and got["k"] == 2
