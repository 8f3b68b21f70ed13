"""A checkpoint saved before a layer was renamed (or a wrapper added), restored with ``rename=``; a non-strict restore
that leaves state unmatched says so; the result says where it was read from (``Restored.source``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _models import Net, assert_same, full_state, train_step

import ckptd
from ckptd.client.rename import as_function, rename_keys, target_to_saved
from ckptd.errors import CheckpointError


class Renamed(Net):
    """``Net`` with its ``hidden`` layer called ``middle`` and the rest inside a ``body`` wrapper name-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.middle = self.hidden
        del self.hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter += 1
        return self.out(torch.relu(self.middle(self.norm(self.inp(x)))))


def _trained(cls: type[torch.nn.Module], seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = cls()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for i in range(3):
        train_step(m, o, i)
    return m, o


def _as_saved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``Renamed``'s full state under ``Net``'s names."""
    return {k.replace("middle.", "hidden."): v for k, v in state.items()}


@pytest.mark.parametrize("how", ["prefix", "callable"])
def test_a_renamed_layer_is_restored_with_its_optimizer_state_through_rename(daemon, how: str) -> None:  # noqa: ANN001
    m, o = _trained(Net, 0)
    want = full_state(m, o)
    with daemon.client("rn") as c:
        c.snapshot(m, o, step=3, blocking=True).wait()
        m2, o2 = _trained(Renamed, 1)
        rename = {"hidden": "middle"} if how == "prefix" else (lambda name: name.replace("hidden.", "middle."))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a strict, matching restore says nothing
            got = c.restore(m2, o2, rename=rename)
    assert got.step == 3 and got.missing_keys == [] and got.unexpected_keys == []
    assert_same(_as_saved(full_state(m2, o2)), want)


def test_without_rename_a_non_strict_restore_warns_what_matched_nothing_and_how_to_map_it(daemon) -> None:  # noqa: ANN001
    m, o = _trained(Net, 0)
    with daemon.client("rn") as c:
        c.snapshot(m, o, step=3, blocking=True).wait()
        m2, o2 = _trained(Renamed, 1)
        before = m2.middle.weight.detach().clone()
        with pytest.raises(CheckpointError, match="does not match the model"):
            c.restore(m2, o2)
        with pytest.warns(UserWarning, match=r"restore\(strict=False\): 4 target key\(s\) not in the checkpoint") as w:
            got = c.restore(m2, o2, strict=False)
    text = str(w[0].message)
    assert w[0].filename == __file__  # said at the user's call, not inside ckptd
    assert "model/middle.weight" in text and "model/hidden.weight" in text and "rename={'old.prefix': 'new.prefix'}" in text
    assert "model/middle.weight" in got.missing_keys and "model/hidden.weight" in got.unexpected_keys
    assert torch.equal(m2.middle.weight, before)  # kept its own values, as the warning says
    assert torch.equal(m2.inp.weight, m.inp.weight)  # what matched was loaded


def test_a_restore_from_a_path_renames_too_and_says_it_read_the_disk(daemon) -> None:  # noqa: ANN001
    m, o = _trained(Net, 0)
    with daemon.client("rn") as c:
        path = c.snapshot(m, o, step=3, blocking=True).wait()
    m2, o2 = _trained(Renamed, 1)
    got = ckptd.restore(m2, o2, path=path, rename={"hidden": "middle"})
    assert got.source == "disk" and got.step == 3
    assert_same(_as_saved(full_state(m2, o2)), full_state(m, o))


def test_the_result_says_where_the_step_was_read_from(daemon) -> None:  # noqa: ANN001
    m, o = _trained(Net, 0)
    with daemon.client("src") as c:
        c.snapshot(m, o, step=1, blocking=True).wait()
        assert c.restore(m, o).source == "memory" == c.last_restore["source"]
        assert c.restore(m, o, hot=False).source == "disk" == c.last_restore["source"]


def test_two_saved_names_renamed_to_one_are_refused_naming_both(daemon) -> None:  # noqa: ANN001
    m, o = _trained(Net, 0)
    with daemon.client("rn") as c:
        c.snapshot(m, o, step=3, blocking=True).wait()
        m2, o2 = _trained(Net, 1)
        before = full_state(m2, o2)
        with pytest.raises(CheckpointError, match="the same name 'out.weight'"):
            c.restore(m2, o2, rename=lambda name: "out.weight" if name.endswith(".weight") and "norm" not in name else name)
    assert_same(full_state(m2, o2), before)  # refused before anything was read


@pytest.mark.parametrize("rename,why", [(["hidden"], "a dict of name prefixes or a callable"), ({"hidden": 3}, "str to str")])
def test_a_rename_of_the_wrong_kind_is_a_clear_type_error(rename: object, why: str) -> None:
    with pytest.raises(TypeError, match=why):
        as_function(rename)  # type: ignore[arg-type]


def test_prefixes_match_whole_name_parts_and_the_longest_wins() -> None:
    fn = as_function({"enc": "encoder", "enc.layer": "encoder.layers"})
    assert fn is not None
    assert [fn(n) for n in ["enc.layer.0.w", "enc.x", "enc", "encx.w", "other"]] == [
        "encoder.layers.0.w", "encoder.x", "encoder", "encx.w", "other",
    ]  # fmt: skip
    mapping = target_to_saved({"enc.layer.0.w", "enc.x", "head.w"}, fn)
    assert mapping == {"encoder.layers.0.w": "enc.layer.0.w", "encoder.x": "enc.x"}
    back = {v: k for k, v in mapping.items()}
    keys = ["model/enc.x", "optim/state/enc.layer.0.w/exp_avg", "model/head.w", "extra/enc.x"]
    assert rename_keys(keys, back) == ["model/encoder.x", "optim/state/encoder.layers.0.w/exp_avg", "model/head.w", "extra/enc.x"]
