"""The hot restore's path into a GPU for chunks that do not fill their destination whole (a restore in another
layout: ``CheckpointReader._hot_to_device``, checksums on worker threads while the mapping is registered and the
copies are enqueued; whole chunks are read by ``tests/test_hotread.py``'s path), driven on CPU: the step's shard file stands in for the
daemon's segment, a stand-in for ``cuda.Uploads`` copies synchronously, and the pieces name a CUDA device.
``tests/test_cuda.py`` runs the real thing where a GPU is."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _shards import shard_bytes

from ckptd.client.reader import CheckpointReader
from ckptd.errors import FormatError
from ckptd.layout import shard_name
from ckptd.state import TAG
from ckptd.storage import local

GPU = torch.device("cuda", 0)


class CopiesOnCpu:
    """What ``_hot_to_device`` asks of ``cuda.Uploads``, with the copies done on the CPU at once."""

    def __init__(self) -> None:
        self.registered: list[int] = []

    def register(self, view: torch.Tensor) -> bool:
        self.registered.append(view.untyped_storage().data_ptr())
        return True

    def host_source(self, view: torch.Tensor) -> torch.Tensor:
        self.register(view)
        return view

    @contextlib.contextmanager
    def stream_for(self, raw: torch.Tensor) -> Iterator[None]:
        yield

    def keep(self, dst: torch.Tensor) -> None:
        pass

    def finish(self) -> None:
        pass


@pytest.fixture
def step(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    full = {f"model/t{i}": torch.randn(4, 64, generator=g) for i in range(40)}
    buf = shard_bytes([(k, t.clone(), tuple(t.shape), (0, 0)) for k, t in full.items()])
    tree = {"model": {k.split("/", 1)[1]: {TAG: "tensor", "key": k} for k in full}}
    root = str(tmp_path)
    local.write_shard(root, local.ShardWrite("j", 1, 0, 1, memoryview(buf), len(buf), tree, local_world_size=1, committed_at=7))
    return local.finalize_step(root, "j", 1, 1), full


def _reader(path: str) -> tuple[CheckpointReader, CopiesOnCpu]:
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    reader = CheckpointReader(path, manifest=manifest, files={shard_name(0): os.path.join(path, shard_name(0))})
    up = reader._uploads[GPU] = CopiesOnCpu()
    return reader, up


def _pieces(reader: CheckpointReader, full: dict[str, torch.Tensor], failing: str | None = None) -> tuple[dict, list[Any]]:
    out = {k: torch.empty_like(t) for k, t in full.items()}
    pieces = []
    for k, t in out.items():
        for key, c, put, *_ in reader.pieces(k, t, (0, 0)):
            if key == failing:

                def put(src: torch.Tensor) -> None:
                    raise RuntimeError("CUDA error: invalid argument (a copy that failed)")

            pieces.append((key, c, put, GPU, None))  # None: not read whole (as in another layout)
    return out, pieces


def _flip(path: str, key: str) -> None:
    with open(os.path.join(path, "manifest.json")) as f:
        (c,) = json.load(f)["tensors"][key]["chunks"]
    with open(os.path.join(path, c["file"]), "r+b") as f:
        f.seek(c["byte_range"][0] + 3)
        b = f.read(1)
        f.seek(c["byte_range"][0] + 3)
        f.write(bytes([b[0] ^ 0xFF]))


def test_every_chunk_is_verified_and_copied_once_and_the_mapping_registered_once(step) -> None:  # noqa: ANN001
    path, full = step
    reader, up = _reader(path)
    checked: list[str] = []
    check = reader._check
    reader._check = lambda key, c, raw: (checked.append(key), check(key, c, raw))[1]  # type: ignore[method-assign]
    out, pieces = _pieces(reader, full)
    with reader:
        reader.read_many(pieces)
    assert sorted(checked) == sorted(full) and len(set(up.registered)) == 1
    assert all(torch.equal(out[k], full[k]) for k in full)


def test_a_corrupt_chunk_in_the_daemons_memory_is_a_format_error(step) -> None:  # noqa: ANN001
    path, full = step
    _flip(path, "model/t5")
    reader, _ = _reader(path)
    _, pieces = _pieces(reader, full)
    with reader, pytest.raises(FormatError, match=r"checksum mismatch .*'model/t5'"):
        reader.read_many(pieces)


def test_a_corrupt_chunk_is_reported_even_when_a_later_copy_fails(step) -> None:  # noqa: ANN001
    # the FormatError is what sends a hot restore to the disk's intact copy: a copy's failure must not hide it
    path, full = step
    _flip(path, "model/t5")
    reader, _ = _reader(path)
    _, pieces = _pieces(reader, full, failing="model/t30")
    with reader, pytest.raises(FormatError, match="model/t5") as got:
        reader.read_many(pieces)
    assert "a copy that failed" in str(got.value.__cause__)


def _views_into(exc: BaseException | None, lo: int, hi: int) -> list[str]:
    """Locals in ``exc``'s tracebacks (and those chained to it) that are tensors inside [lo, hi)."""
    found, todo, seen = [], [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            for name, v in tb.tb_frame.f_locals.items():
                if isinstance(v, torch.Tensor) and lo <= v.data_ptr() < hi:
                    found.append(f"{tb.tb_frame.f_code.co_name}:{name}")
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
    return found


def test_a_failed_hot_read_leaves_no_view_of_the_unmapped_segment_in_its_traceback(step) -> None:  # noqa: ANN001
    # a user's error reporter that prints frame locals (pytest's long tracebacks, sentry) would read the
    # unmapped pages and crash the process: the reader clears those frames before unmapping
    path, full = step
    _flip(path, "model/t5")  # a worker thread's checksum failure, chained to a copy's
    reader, _ = _reader(path)
    _, pieces = _pieces(reader, full, failing="model/t30")
    base = reader._mapped(shard_name(0), populate=False)
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    del base
    with pytest.raises(FormatError) as got, reader:
        reader.read_many(pieces)
    assert not reader._maps
    assert got.value.__cause__ is not None and not _views_into(got.value, lo, hi)


def test_a_hot_read_inside_a_users_except_block_leaves_the_users_exception_alone(step) -> None:  # noqa: ANN001
    # only the exception that leaves the reader has its frames cleared: a restore run while the trainer handles
    # an error of its own must not wipe the locals its error reporter shows
    path, full = step
    reader, _ = _reader(path)
    out, pieces = _pieces(reader, full)

    def users_code() -> None:
        shown = "kept"  # noqa: F841 (a local the user's error reporter prints)
        raise ValueError("the trainer's own error")

    try:
        users_code()
    except ValueError as e:
        with reader:
            reader.read_many(pieces)
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        assert tb.tb_frame.f_locals.get("shown") == "kept"
    assert all(torch.equal(out[k], full[k]) for k in full)
