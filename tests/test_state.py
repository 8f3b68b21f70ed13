"""Flattening state into a JSON tree plus tensor chunks, and back."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ckptd.errors import FormatError
from ckptd.state import flatten, unflatten


def test_round_trip_tags_and_tensors() -> None:
    t = torch.arange(4.0)
    root = {
        "model": {"layer.0.weight": t},
        "extra": {"0": {"tup": (1, 2.5, "x"), "ints": {3: "a", 4: None}, "nan": float("nan"), "inf": -math.inf, "s/p": t}},
    }
    tree, chunks = flatten(root)
    json.dumps(tree, allow_nan=False)  # strict JSON
    assert [c.key for c in chunks] == ["model/layer.0.weight", "extra/0/s%2Fp"]
    assert chunks[0].global_shape == (4,) and chunks[0].offsets == (0,)
    back = unflatten(tree, lambda k: k)
    e = back["extra"]["0"]
    assert e["tup"] == (1, 2.5, "x") and e["ints"] == {3: "a", 4: None}
    assert math.isnan(e["nan"]) and e["inf"] == -math.inf
    assert back["model"]["layer.0.weight"] == "model/layer.0.weight"
    keys: list[str] = []
    unflatten(tree, keys.append)
    assert keys == ["model/layer.0.weight", "extra/0/s%2Fp"]


def test_tag_key_in_user_dict_is_escaped() -> None:
    tree, _ = flatten({"extra": {"__ckptd__": "tensor", "key": "boom"}})
    assert unflatten(tree, lambda k: pytest.fail("not a tensor"))["extra"] == {"__ckptd__": "tensor", "key": "boom"}


def test_unsupported_value_names_its_path() -> None:
    with pytest.raises(TypeError, match="extra/cfg/fn"):
        flatten({"extra": {"cfg": {"fn": object()}}})


def test_unknown_tag_rejected() -> None:
    with pytest.raises(FormatError, match="unknown tree tag"):
        unflatten({"x": {"__ckptd__": "martian"}}, lambda k: k)
