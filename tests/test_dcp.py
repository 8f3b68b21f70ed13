"""A ckptd checkpoint loads through torch.distributed.checkpoint.load with ckptd.dcp.Reader."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from _models import assert_same, full_state, make, train_step
from _workers import save_layout
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptd


def test_dcp_load_model_only(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        path = c.snapshot(model, optim, step=1).wait(30)
    m2, _ = make(seed=5)
    sd = {"model": m2.state_dict()}
    dcp.load(sd, storage_reader=ckptd.dcp.Reader(path))
    m2.load_state_dict(sd["model"])
    assert_same(full_state(m2, None), full_state(model, None))


@pytest.mark.multiproc
def test_dcp_load_resharded_model_and_optimizer(daemon, short_tmp) -> None:  # noqa: ANN001
    """Saved by 2 FSDP2 ranks; loaded by DCP into one plain process, optimizer included."""
    expected = str(short_tmp / "expected.safetensors")
    path = run_ranks(2, save_layout, "fsdp2", daemon.endpoint, "dcp", expected)[0]["path"]
    model, optim = make(seed=9)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=ckptd.dcp.Reader(path))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_same(full_state(model, optim), load_file(expected))
    assert isinstance(sd["optim"]["param_groups"][0]["lr"], float)


def test_dcp_reader_verifies_checksums(daemon) -> None:  # noqa: ANN001
    import os

    model, optim = make()
    with daemon.client("j") as c:
        path = c.snapshot(model, optim, step=1).wait(30)
    import json

    chunk = json.load(open(os.path.join(path, "manifest.json")))["tensors"]["model/inp.weight"]["chunks"][0]
    with open(os.path.join(path, chunk["file"]), "r+b") as f:
        f.seek(chunk["byte_range"][0] + 4)
        f.write(b"\xff\xff")
    m2, _ = make(seed=5)
    with pytest.raises(BaseException, match="checksum mismatch"):  # DCP wraps it in a BaseException
        dcp.load({"model": m2.state_dict()}, storage_reader=ckptd.dcp.Reader(path))
    assert torch.is_tensor(m2.inp.weight)
