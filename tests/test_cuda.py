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


def _saved(daemon, job: str) -> tuple[dict[str, torch.Tensor], str]:  # noqa: ANN001
    """A CUDA model + AdamW, prepared (slots made, mapped and page-locked up front), stepped and saved."""
    model, optim = _cuda_model()
    _step(model, optim, 0)
    with daemon.client(job) as c:
        c.prepare(model, optim)
        assert len(c._maps.pinned) >= 2, "prepare() should page-lock its slots for device copies"
        path = c.snapshot(model, optim, step=1, blocking=True).wait(60)
    return {k: v.cpu() for k, v in full_state(model, optim).items()}, path


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hot", [True, False])
def test_cuda_restore_from_memory_and_disk_is_exact(daemon, hot: bool) -> None:  # noqa: ANN001
    want, _ = _saved(daemon, "gr")
    with daemon.client("gr") as c:
        m2, o2 = _cuda_model()
        c.restore(m2, o2, hot=hot)
        assert c.last_restore["source"] == ("memory" if hot else "disk")
    torch.cuda.synchronize()
    assert_same({k: v.cpu() for k, v in full_state(m2, o2).items()}, want)


@pytest.mark.gpu
@needs_cuda
def test_cuda_restore_goes_through_page_locked_buffers_when_registering_fails(daemon, monkeypatch) -> None:  # noqa: ANN001
    want, _ = _saved(daemon, "gb")
    monkeypatch.setattr(cuda, "pin", lambda *a, **k: False)  # a driver that refuses read-only registration
    with daemon.client("gb") as c:
        m2, o2 = _cuda_model()
        c.restore(m2, o2)
        assert c.last_restore["source"] == "memory"
    assert_same({k: v.cpu() for k, v in full_state(m2, o2).items()}, want)


@pytest.mark.gpu
@needs_cuda
def test_cuda_restore_of_a_corrupt_shard_fails_naming_it(daemon) -> None:  # noqa: ANN001
    import os

    import ckptd

    _, path = _saved(daemon, "gc")
    shard = next(os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors"))
    with open(shard, "r+b") as f:  # flip a byte of the last tensor's data: hashed while the GPU copies it
        f.seek(-8, os.SEEK_END)
        b = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    m2, o2 = _cuda_model()
    with pytest.raises(ckptd.FormatError, match="checksum mismatch"):
        ckptd.restore(m2, o2, path=path)


@pytest.mark.gpu
@needs_cuda
def test_cuda_hot_restore_verifies_every_chunk_and_falls_back_to_disk_on_a_corrupt_segment(daemon) -> None:  # noqa: ANN001
    # the hot path into a GPU hashes on worker threads while the copies run: a flipped byte in the daemon's
    # segment must still be caught (the restore then reads the intact disk copy), never loaded silently
    import os

    from ckptd import shm

    want, path = _saved(daemon, "gh")
    shard = next(f for f in sorted(os.listdir(path)) if f.endswith(".safetensors"))
    size = os.path.getsize(os.path.join(path, shard))
    flipped = 0
    for name in shm.segments_of(daemon.root):
        seg = shm.path_of(name)
        with open(seg, "rb") as f:
            if f.read(64) != open(os.path.join(path, shard), "rb").read(64):
                continue  # not the slot that holds this shard
        os.chmod(seg, 0o600)
        with open(seg, "r+b") as f:
            f.seek(size - 8)
            b = f.read(1)
            f.seek(size - 8)
            f.write(bytes([b[0] ^ 0xFF]))
        flipped += 1
    assert flipped, "the daemon should still hold the step in a slot"
    with daemon.client("gh") as c:
        m2, o2 = _cuda_model()
        c.restore(m2, o2)
        assert c.last_restore["source"] == "disk"
    torch.cuda.synchronize()
    assert_same({k: v.cpu() for k, v in full_state(m2, o2).items()}, want)
