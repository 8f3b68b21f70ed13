"""A model with BatchNorm under DDP, FSDP1 and FSDP2: its running statistics differ between ranks (each rank's
batches update its own; DDP broadcasts rank 0's at the next forward, FSDP never syncs them). Every snapshot of such
a model failed ("ranks 0 and 1 hold different bytes under the same name; state keys must be globally unique"),
so the job had no checkpoint at all. Found by a review of resharding. A buffer is now written by its lowest-rank
holder and not compared across ranks."""

from __future__ import annotations

import pytest
import torch
from _bn_workers import BNNet, save_batchnorm
from _dist import run_ranks
from _models import assert_same, full_state
from _workers import _load_expected

import ckptd


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["ddp", "fsdp1", "fsdp2"])
def test_batchnorm_statistics_that_differ_between_ranks_are_checkpointed_as_rank_0s(daemon, short_tmp, kind: str) -> None:  # noqa: ANN001
    expected = str(short_tmp / "expected.safetensors")
    r0, r1 = run_ranks(2, save_batchnorm, kind, daemon.endpoint, f"bn-{kind}", expected)
    assert r0["path"] == r1["path"]
    assert r0["running_mean"] != r1["running_mean"]  # the ranks' statistics do differ
    model = BNNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckptd.restore(model, optim, path=r0["path"])  # into one process
    assert_same(full_state(model, optim), _load_expected(expected))  # rank 0's buffers, everyone's parameters
