"""A committed step's tensors written out whole as a safetensors file (``ckptd export --format hf``, and the Hugging
Face callback's resume directory), one tensor at a time."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from typing import IO, Any

import torch

from ..format import dtype_from_name
from .reader import CheckpointReader


def nbytes(ent: dict[str, Any]) -> int:
    """The bytes of a manifest tensor entry (its dtype and shape)."""
    return dtype_from_name(ent["dtype"]).itemsize * math.prod(ent["shape"])


def write_safetensors(
    reader: CheckpointReader, names: dict[str, str], f: IO[bytes], meta: dict[str, str], show: Callable[[int], None], done: int
) -> int:
    """Write the tensors ``names`` (state key -> name in the file) as a safetensors file to ``f``, one at a
    time, fsynced; returns ``done`` plus the bytes written (for progress across files)."""
    tensors = reader.manifest["tensors"]
    header: dict[str, object] = {"__metadata__": meta}
    pos = 0
    for k, n in names.items():
        size = nbytes(tensors[k])
        header[n] = {"dtype": tensors[k]["dtype"], "shape": tensors[k]["shape"], "data_offsets": [pos, pos + size]}
        pos += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    f.write(struct.pack("<Q", len(body)) + body)
    for k in names:
        full = reader.read_full(k)
        f.write(memoryview(full.reshape(-1).view(torch.uint8).numpy()))
        done += full.numel() * full.element_size()
        del full
        show(done)
    f.flush()
    os.fsync(f.fileno())
    return done
