"""Restore into any layout: other world sizes and wrappers, and MoE experts sharded over sub-groups."""

from __future__ import annotations

import os

import pytest
from _dist import run_ranks
from _models import assert_same, full_state
from _workers import MoE, restore_layout, restore_moe, save_layout, save_moe, save_moe_colliding
from safetensors.torch import load_file

import ckptd

pytestmark = pytest.mark.multiproc

# saved as (kind, world) → restored into each (kind, world); covers 4→2, 4→1, 2→4, 4→3 (uneven, with an
# empty shard), 2→3, and FSDP1 ↔ FSDP2 ↔ DDP ↔ plain
MATRIX = [
    (("fsdp1", 4), [("fsdp2", 2), ("plain", 1)]),
    (("fsdp2", 2), [("fsdp1", 4), ("ddp", 3)]),
    (("fsdp2", 4), [("fsdp2", 3), ("fsdp1", 3)]),
    (("ddp", 2), [("fsdp2", 2), ("plain", 1)]),
    (("plain", 1), [("fsdp1", 2)]),
]


def _restore_plain(path: str, expected: str) -> None:
    """One plain process, no process group."""
    from _models import make

    model, optim = make(seed=7)
    extra = ckptd.restore(model, optim, path=path)
    assert extra == {"rank": 0}
    assert_same(full_state(model, optim), load_file(expected))


@pytest.mark.parametrize("saved,targets", MATRIX, ids=[f"{s[0]}{s[1]}" for s, _ in MATRIX])
def test_restore_into_other_layouts(daemon, short_tmp, saved, targets) -> None:  # noqa: ANN001
    kind, world = saved
    expected = str(short_tmp / "expected.safetensors")
    path = run_ranks(world, save_layout, kind, daemon.endpoint, "re", expected)[0]["path"]
    for tkind, tworld in targets:
        if tkind == "plain" and tworld == 1:
            _restore_plain(path, expected)
            continue
        outs = run_ranks(tworld, restore_layout, tkind, path, expected)
        # extra is per rank: ranks beyond the saved world size get rank 0's
        assert [o["extra"]["rank"] for o in outs] == [r if r < world else 0 for r in range(tworld)]


def test_moe_sub_groups_restore_into_fsdp2_and_one_process(daemon, short_tmp) -> None:  # noqa: ANN001
    expected = str(short_tmp / "moe")
    path = run_ranks(4, save_moe, daemon.endpoint, "moe", expected)[0]["path"]
    want = load_file(f"{expected}.0") | load_file(f"{expected}.2")
    assert {k for k in want if k.startswith("model/experts.")} == {
        f"model/experts.{e}.{p}" for e in ("0", "1", "s") for p in ("weight", "bias")
    }
    run_ranks(2, restore_moe, "fsdp2", path)
    assert_same(load_file(os.path.join(path, "..", "got-fsdp2-2.safetensors")), want)
    model = MoE(["0", "1", "s"])
    import torch

    for p in model.parameters():
        torch.nn.init.zeros_(p)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ckptd.restore(model, optim, path=path)
    got = full_state(model, optim)
    got.pop("optim/lr")
    assert_same(got, want)


def test_moe_with_per_group_expert_names_is_refused(daemon) -> None:  # noqa: ANN001
    outs = run_ranks(4, save_moe_colliding, daemon.endpoint, "bad")
    err = outs[0]["error"]
    assert err and "model/experts.local" in err and "globally unique" in err
    with daemon.client("bad") as c:
        assert c.latest() is None
