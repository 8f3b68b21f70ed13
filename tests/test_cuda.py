"""The GPU path: page-locked slots and side-stream copies. Skipped without CUDA, except the fallback."""

from __future__ import annotations

import pytest
import torch
from _models import assert_same, full_state

from ckptd.client import cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_pin_falls_back_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the fallback is not taken")
    buf = torch.empty(4096, dtype=torch.uint8)
    assert cuda.pin(buf.data_ptr(), buf.numel()) is False


def _cuda_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from _models import Net

    torch.manual_seed(0)
    model = Net().cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    from _models import batch

    optim.zero_grad()
    model(batch(i).cuda()).pow(2).mean().backward()
    optim.step()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("blocking", [True, False])
def test_cuda_snapshot_is_state_at_call(daemon, blocking: bool) -> None:  # noqa: ANN001
    model, optim = _cuda_model()
    _step(model, optim, 0)
    with daemon.client("g") as c:
        for step in (1, 2):
            want = {k: v.cpu() for k, v in full_state(model, optim).items()}
            h = c.snapshot(model, optim, step=step, blocking=blocking)
            _step(model, optim, step)  # mutates right after the call: must not leak in
            h.wait(60)
            assert c._maps.pinned, "the slot should be page-locked for device copies"
            m2, o2 = _cuda_model()
            c.restore(m2, o2, step=step)
            got = {k: v.cpu() for k, v in full_state(m2, o2).items()}
            assert_same(got, want)
