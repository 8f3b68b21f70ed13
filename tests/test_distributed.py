"""Two ranks over gloo: DDP, FSDP1 and FSDP2 save and restore into the same layout, bit-exact."""

from __future__ import annotations

import json
import os

import pytest
from _dist import run_ranks
from _workers import restore_and_compare, save_then_check

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    "kind,blocking",
    [("ddp", True), ("fsdp2", False), ("fsdp1", True), ("fsdp1", False)],
)
def test_save_restore_same_layout(daemon, short_tmp, kind: str, blocking: bool) -> None:  # noqa: ANN001
    expected = str(short_tmp / "expected.safetensors")
    outs = run_ranks(2, save_then_check, kind, daemon.endpoint, "dist", expected, blocking)
    path = outs[0]["path"]
    assert outs[1]["path"] == path
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["world_size"] == 2 and [r["rank"] for r in manifest["ranks"]] == [0, 1]
    # layout-free: keyed by state key and global offsets, every element covered exactly once
    w = manifest["tensors"]["model/inp.weight"]
    assert w["shape"] == [40, 16] and sum(c["sizes"][0] for c in w["chunks"]) == 40
    if kind == "ddp":
        # replicated tensors are written once, and the writing is spread over both ranks
        assert all(len(t["chunks"]) == 1 for t in manifest["tensors"].values())
        files = {c["file"] for t in manifest["tensors"].values() for c in t["chunks"]}
        assert files == {"rank-00000.safetensors", "rank-00001.safetensors"}
    else:
        assert len(w["chunks"]) == 2
    outs = run_ranks(2, restore_and_compare, kind, daemon.endpoint, "dist", expected)
    assert [o["extra"] for o in outs] == [{"rank": 0}, {"rank": 1}]
