"""``ckptd export --format hf``: a directory transformers' ``from_pretrained`` loads, checked against the
real package (a tiny Llama, CPU, nothing downloaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

transformers = pytest.importorskip("transformers")


def _llama(tie: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _train(model: torch.nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        torch.manual_seed(i)
        ids = torch.randint(0, 128, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    return optim


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.mark.parametrize("tie, shard", [(False, "20K"), (True, None)])
def test_an_hf_export_loads_with_from_pretrained(daemon, short_tmp, tie: bool, shard: str | None) -> None:  # noqa: ANN001
    model = _llama(tie)
    optim = _train(model)
    with daemon.client("hf") as c:
        path = c.snapshot(model, optim, step=2, blocking=True).wait(60)
    cfg_dir = str(short_tmp / "cfg")
    model.config.save_pretrained(cfg_dir)
    out = str(short_tmp / "exported")
    r = _cli("export", path, "--out", out, "--format", "hf", "--config-from", cfg_dir, *(["--max-shard-size", shard] if shard else []))
    assert r.returncode == 0, r.stderr
    files = sorted(os.listdir(out))
    if shard:  # several weight files and the index that names each tensor's
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        weights = sorted(set(index["weight_map"].values()))
        assert len(weights) > 1 and files == sorted(["config.json", "model.safetensors.index.json", *weights])
        assert set(index["weight_map"]) == set(model.state_dict())
    else:
        assert files == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_hf_export_mistakes_are_refused_and_leave_nothing(daemon, short_tmp) -> None:  # noqa: ANN001
    model = _llama(False)
    optim = _train(model)
    with daemon.client("hf") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(60)
    out = str(short_tmp / "x")
    r = _cli("export", path, "--out", out, "--format", "hf", "--config-from", str(short_tmp))
    assert r.returncode == 1 and "no config.json" in r.stderr
    r = _cli("export", path, "--out", out, "--format", "hf", "--what", "optim")
    assert r.returncode == 1 and "model only" in r.stderr
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
    os.makedirs(out)
    r = _cli("export", path, "--out", out, "--format", "hf")
    assert r.returncode == 1 and "already exists" in r.stderr
    assert os.listdir(out) == []  # an existing directory is never written into
    # a trailing slash names the same directory (it failed, renaming new/.tmp onto new/, and left new/ empty)
    slash = str(short_tmp / "new") + "/"
    r = _cli("export", path, "--out", slash, "--format", "hf")
    assert r.returncode == 0, r.stderr
    assert "model.safetensors" in os.listdir(slash) and not os.path.exists(str(short_tmp / "new.tmp"))
