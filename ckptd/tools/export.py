"""Consolidate a sharded checkpoint into one file (``ckptd export``), streaming.

For the safetensors format, peak memory is about the largest tensor plus one saved chunk: each
tensor is assembled from its chunks, written, and dropped before the next. The torch format has to
hold the selected state in memory (``torch.save`` takes one dict). Runs anywhere (no daemon, no process group).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Callable

import torch

from ..client.reader import CheckpointReader, resolve_step_dir
from ..errors import CheckpointError
from ..format import dtype_from_name
from ..state import split_key

WHAT = ("model", "optim", "all")
FORMATS = ("safetensors", "torch")


def output_name(key: str, what: str) -> str | None:
    """The exported name of a state key: model FQNs as ``model.load_state_dict`` wants them by default."""
    parts = split_key(key)
    if parts[0] == "extra" or (what != "all" and parts[0] != what):
        return None
    if what == "all":
        return ".".join(parts)
    return ".".join(parts[1:])


def _progress_printer(total: int) -> Callable[[int], None]:
    if not sys.stderr.isatty():
        return lambda done: None

    def show(done: int) -> None:
        sys.stderr.write(f"\rexporting {done / max(total, 1):6.1%}  {done / 1e9:.2f} / {total / 1e9:.2f} GB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def export_checkpoint(
    path: str,
    out: str,
    *,
    fmt: str = "safetensors",
    what: str = "model",
    progress: Callable[[int], None] | None = None,
) -> dict[str, int]:
    """Write the full (unsharded) state of checkpoint ``path`` to ``out``; returns counts.

    ``what``: ``model`` (keys are model FQNs, loadable by ``model.load_state_dict``), ``optim``
    (``state.<fqn>.<name>``, tensors only) or ``all`` (``model.<fqn>``, ``optim.state.<fqn>.<name>``).
    The file appears atomically (written to ``out.tmp``, then renamed).
    """
    if fmt not in FORMATS or what not in WHAT:
        raise ValueError(f"format must be one of {FORMATS} and what one of {WHAT}")
    step_dir = resolve_step_dir(path)
    tmp = out + ".tmp"
    with CheckpointReader(step_dir) as reader:
        tensors = reader.manifest["tensors"]
        names = {k: n for k in sorted(tensors) if (n := output_name(k, what)) is not None}
        if not names:
            raise CheckpointError(f"{step_dir} holds no {what} tensors")
        header: dict[str, object] = {"__metadata__": {"format": "pt", "ckptd_step": str(reader.manifest["step"])}}
        pos = 0
        for k, n in names.items():
            ent = tensors[k]
            nbytes = dtype_from_name(ent["dtype"]).itemsize * math.prod(ent["shape"])
            header[n] = {"dtype": ent["dtype"], "shape": ent["shape"], "data_offsets": [pos, pos + nbytes]}
            pos += nbytes
        body = json.dumps(header, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)
        show = progress or _progress_printer(pos)
        try:
            with open(tmp if fmt == "safetensors" else out + ".st.tmp", "wb") as f:
                f.write(struct.pack("<Q", len(body)) + body)
                done = 0
                for k in names:
                    full = reader.read_full(k)
                    f.write(memoryview(full.reshape(-1).view(torch.uint8).numpy()))
                    done += full.numel() * full.element_size()
                    del full
                    show(done)
                f.flush()
                os.fsync(f.fileno())
            if fmt == "torch":
                _safetensors_to_torch(out + ".st.tmp", tmp)
            os.replace(tmp, out)
        finally:
            for p in (tmp, out + ".st.tmp"):
                if os.path.exists(p):
                    os.unlink(p)
    return {"tensors": len(names), "bytes": pos}


def _safetensors_to_torch(src: str, dst: str) -> None:
    """Re-write a safetensors file as ``torch.save`` output.

    ``torch.save`` needs every tensor alive at once, with storages of its own: this format holds the
    selected state in memory (the safetensors format is the streaming one).
    """
    with open(src, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        (n,) = struct.unpack_from("<Q", mm, 0)
        header = json.loads(mm[8 : 8 + n])
        data = torch.frombuffer(mm, dtype=torch.uint8)[8 + n :]
        sd = {}
        for name, ent in header.items():
            if name == "__metadata__":
                continue
            b, e = ent["data_offsets"]
            sd[name] = data[b:e].view(dtype_from_name(ent["dtype"])).view(ent["shape"]).clone()
        torch.save(sd, dst)
        del sd, data
    finally:
        mm.close()
