"""The GPU path: page-locked slots and side-stream copies. Skipped without CUDA, except the fallback."""

from __future__ import annotations

from typing import Any

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


def _as_if_reshaped(monkeypatch) -> None:  # noqa: ANN001
    """No chunk fills its destination whole, as in a restore into another layout: the hot path maps and page-locks the segment."""
    from ckptd.client import reader

    monkeypatch.setattr(reader, "_whole", lambda *a, **k: None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "hot,whole,path", [(True, True, "pread"), (True, True, "register"), (True, False, "auto"), (False, True, "auto")],
    ids=["hot-pread", "hot-register", "hot-reshaped", "disk"],
)  # fmt: skip
def test_cuda_restore_from_memory_and_disk_is_exact(daemon, hot: bool, whole: bool, path: str, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CKPTD_HOT_PATH", path)  # (read by the trainer: this process)
    if not whole:
        _as_if_reshaped(monkeypatch)
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
    _as_if_reshaped(monkeypatch)
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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("corrupt", [None, "small", "big"])
def test_cuda_hotread_through_page_locked_slots_is_exact_and_catches_a_flipped_byte(tmp_path, corrupt: str | None) -> None:  # noqa: ANN001
    # chunks next to each other read together, one larger than a slot read in parts, several threads, real streams
    import os

    from ckptd.client.hotread import Flat, HotRead
    from ckptd.errors import FormatError
    from ckptd.format import digest

    data, spans, seg = _segment(tmp_path)  # the 3 MiB chunk spans three 1 MiB slots
    dev = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
    flats = [
        Flat(f"t{i}", {"file": "segment", "byte_range": [b, e], "xxh3_64": digest(data[b:e])}, dev[b:e], dev.device)
        for i, (b, e) in enumerate(spans)
    ]
    if corrupt is not None:
        b, _ = spans[0 if corrupt == "small" else 4]
        seg.write_bytes(data[: b + 7] + bytes([data[b + 7] ^ 1]) + data[b + 8 :])
    up = cuda.Uploads(dev.device, {})
    fd = os.open(seg, os.O_RDONLY)
    try:
        reader = HotRead({"segment": fd}, str, lambda _: up, workers=3, slot=1 << 20)
        if corrupt is None:
            reader.read(flats)
        else:
            with pytest.raises(FormatError, match="checksum mismatch .*'t" + ("0" if corrupt == "small" else "4")):
                reader.read(flats)
    finally:
        up.finish()
        os.close(fd)
    if corrupt is None:
        got = dev.cpu().numpy().tobytes()
        assert all(got[b:e] == data[b:e] for b, e in spans)


@pytest.mark.gpu
@needs_cuda
def test_page_locked_blocks_are_on_huge_pages_where_the_kernel_gives_them_and_copy_exactly() -> None:
    from ckptd.client import pinned

    up = cuda.Uploads(torch.device("cuda", torch.cuda.current_device()), {})
    before = pinned.MADE.copy()
    bufs = [up.pinned(3 << 20) for _ in range(2)]  # (not a multiple of a huge page)
    assert pinned.MADE - before == {"huge" if pinned.huge_pages() else "pinned": 2}
    dev = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    for i, buf in enumerate(bufs):
        assert buf.numel() == 3 << 20 and buf.is_pinned()
        buf.fill_(i + 1)
        with torch.cuda.stream(up.stream):
            dev.copy_(buf, non_blocking=True)
        up.stream.synchronize()
        assert int(dev.sum()) == (i + 1) * (3 << 20)
    del buf
    bufs.clear()
    up.finish()  # unregistered and unmapped: nothing is page-locked any more
    assert up._made == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("corrupt", [None, "small", "big"])
def test_cuda_registered_read_straight_from_the_segment_is_exact_and_catches_a_flipped_byte(tmp_path, corrupt: str | None) -> None:  # noqa: ANN001
    import mmap
    import warnings

    from ckptd.client.hotread import Flat
    from ckptd.client.hotreg import RegisteredRead, ranges
    from ckptd.errors import FormatError
    from ckptd.format import digest

    data, spans, seg = _segment(tmp_path)  # the 3 MiB chunk spans several 1 MiB ranges
    if corrupt is not None:
        b, _ = spans[0 if corrupt == "small" else 4]
        seg.write_bytes(data[: b + 7] + bytes([data[b + 7] ^ 1]) + data[b + 8 :])
    dev = torch.zeros(len(data), dtype=torch.uint8, device="cuda")
    flats = [
        Flat(f"t{i}", {"file": "segment", "byte_range": [b, e], "xxh3_64": digest(data[b:e])}, dev[b:e], dev.device)
        for i, (b, e) in enumerate(spans)
    ]

    def check(key: str, c: dict, raw: torch.Tensor) -> None:
        if digest(memoryview(raw.numpy())) != c["xxh3_64"]:
            raise FormatError(f"checksum mismatch (tensor {key!r})")

    registered: dict[int, bool] = {}
    up = cuda.Uploads(dev.device, registered)
    with open(seg, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is only read
        warnings.simplefilter("ignore", UserWarning)
        views = {"segment": torch.frombuffer(mm, dtype=torch.uint8)}
    try:
        reader = RegisteredRead(views.__getitem__, lambda _: up, check, str, workers=3, register_bytes=1 << 20)
        if corrupt is None:
            assert reader.read(flats) == []
        else:
            with pytest.raises(FormatError, match="'t" + ("0" if corrupt == "small" else "4")):
                reader.read(flats)
    finally:
        up.finish()
        assert len(registered) == len(ranges(flats, len(data), 1 << 20)) == 5 and all(registered.values())  # each range page-locked
        cuda.unregister(registered)
        views.clear()
        mm.close()
    if corrupt is None:
        got = dev.cpu().numpy().tobytes()
        assert all(got[b:e] == data[b:e] for b, e in spans)


def _segment(tmp_path: Any) -> tuple[bytes, list[tuple[int, int]], Any]:
    """A segment file of random chunks (small ones next to each other, one of 3 MiB), 64 bytes apart: its bytes,
    the chunks' byte ranges, its path."""
    import os

    sizes = [300, 4096, 5000, 64 << 10, 3 << 20, 17, 1 << 20]
    data = os.urandom(sum(sizes) + 64 * len(sizes))
    spans, pos = [], 0
    for n in sizes:
        spans.append((pos, pos + n))
        pos += n + 64
    seg = tmp_path / "segment"
    seg.write_bytes(data)
    return data, spans, seg
