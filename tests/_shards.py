"""Real shard files for the component tests: ckptd's own header (``format.build_layout``), then each
chunk's bytes where the layout puts it — what the client leaves in a slot (``ckptd.client.copy``)."""

from __future__ import annotations

import torch

from ckptd.format import build_layout, dtype_from_name

Chunk = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]  # state key, local data, global shape, offsets


def shard_bytes(chunks: list[Chunk], slack: int = 0) -> bytearray:
    """The shard of ``chunks`` (each chunk named by its key), followed by ``slack`` unused bytes (a slot
    is usually larger than its shard)."""
    data = {key: t for key, t, _, _ in chunks}
    layout = build_layout([(key, key, t.dtype, tuple(t.shape), gshape, offs) for key, t, gshape, offs in chunks])
    buf = bytearray(layout.file_size + slack)
    buf[: layout.data_start] = layout.header
    base = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    for spec in layout.chunks:
        view = base[layout.data_start + spec.begin : layout.data_start + spec.end].view(dtype_from_name(spec.dtype)).view(spec.sizes)
        view.copy_(data[spec.key])
    return buf
