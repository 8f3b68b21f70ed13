"""Manifest assembly: coverage is checked, inconsistent fragments are refused."""

from __future__ import annotations

import pytest

from ckptd.errors import CheckpointError
from ckptd.format import build_manifest


def _frag(rank: int, chunks: list[dict], ws: int = 2) -> dict:
    return {
        "job": "j", "step": 1, "world_size": ws, "rank": rank, "file": f"rank-{rank:05d}.safetensors",
        "size": 0, "header_xxh3_64": "0" * 16, "tree": {}, "chunks": chunks,
    }  # fmt: skip


def _chunk(key: str, offsets: list[int], sizes: list[int], shape: list[int], dtype: str = "F32") -> dict:
    return {"name": key, "key": key, "dtype": dtype, "sizes": sizes, "global_shape": shape, "offsets": offsets,
            "byte_range": [0, 0], "xxh3_64": "0" * 16}  # fmt: skip


def test_complete_coverage_accepted() -> None:
    m = build_manifest("j", 1, 2, [_frag(0, [_chunk("w", [0, 0], [2, 3], [4, 3])]), _frag(1, [_chunk("w", [2, 0], [2, 3], [4, 3])])])
    assert [c["file"] for c in m["tensors"]["w"]["chunks"]] == ["rank-00000.safetensors", "rank-00001.safetensors"]


@pytest.mark.parametrize(
    "c0,c1,msg",
    [
        (_chunk("w", [0, 0], [2, 3], [4, 3]), _chunk("w", [1, 0], [3, 3], [4, 3]), "overlap"),
        (_chunk("w", [0, 0], [2, 3], [4, 3]), _chunk("w", [3, 0], [1, 3], [4, 3]), "cover 9 of 12"),
        (_chunk("w", [0, 0], [2, 3], [4, 3]), _chunk("w", [2, 0], [2, 3], [4, 3], "F16"), "another rank"),
        (_chunk("w", [0, 0], [2, 3], [4, 3]), _chunk("w", [2, 0], [2, 3], [5, 3]), "another rank"),
    ],
)
def test_bad_coverage_names_the_tensor(c0: dict, c1: dict, msg: str) -> None:
    with pytest.raises(CheckpointError, match=msg):
        build_manifest("j", 1, 2, [_frag(0, [c0]), _frag(1, [c1])])


def test_fragment_of_another_step_refused() -> None:
    other = _frag(1, []) | {"step": 2}
    with pytest.raises(CheckpointError, match="another job/step"):
        build_manifest("j", 1, 2, [_frag(0, []), other])


def test_disagreeing_replicas_name_the_fqn_and_region() -> None:
    cid = '["model/experts.local.weight",[0,0],[4,4]]'
    f0, f1 = _frag(0, []), _frag(1, [])
    f0["replicas"], f1["replicas"] = {cid: "a" * 16}, {cid: "b" * 16}
    with pytest.raises(CheckpointError, match=r"'model/experts.local.weight' region offsets \[0, 0\] sizes \[4, 4\].*globally unique"):
        build_manifest("j", 1, 2, [f0, f1])
    f1["replicas"] = {cid: "a" * 16}
    build_manifest("j", 1, 2, [f0, f1])
