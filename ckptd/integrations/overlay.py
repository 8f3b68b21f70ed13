"""What a second save at one step changed, kept in that save's pointer.

ckptd keeps one checkpoint per step. A framework may save twice at one step (Lightning: a top-k file, then
``last.ckpt``, or a second ``ModelCheckpoint``'s file) and hand different bookkeeping the second time (the
callbacks' and loops' state), never other weights or optimizer state: no training step runs in between. So the
second save stays a pointer to the first, and carries inline the entries of its state that differ from the
first save's; loading the pointer puts them over the step's state, giving what the framework handed for that
path. Entries are the top-level keys, or the string keys one level below a top-level dict (one callback's
state among all); the model and optimizer entries (:data:`SKIP`) and an entry holding over
:data:`ENTRY_BYTES` of tensors are taken from the first save, uncompared.

An overlay is read as untrusted input: the same tagged tree as a manifest's (:mod:`ckptd.state`, no class
is ever rebuilt), its tensors' dtypes, shapes and byte counts checked.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import FormatError
from ..format import MAX_DIMS, dtype_from_name, dtype_name, itemsize
from ..state import TAG, flatten, unflatten

SKIP = frozenset({"state_dict", "optimizer_states"})  # Lightning's model and optimizers: the same at one step
ENTRY_BYTES = 256 << 10

Path = tuple[str, ...]


@dataclass
class Record:
    """The first save of a step, as the entries a later save at that step is compared with."""

    step: int
    encoded: dict[Path, str] = field(default_factory=dict)  # canonical JSON of each entry small enough to compare
    subkeys: set[str] = field(default_factory=set)  # the top-level dicts, compared key by key
    large: set[Path] = field(default_factory=set)  # entries over ENTRY_BYTES: weights-like, the same at one step


def _subs(v: Any) -> dict[str, Any] | None:
    return v if isinstance(v, dict) and v and TAG not in v and all(isinstance(k, str) for k in v) else None


def _entries(checkpoint: dict[str, Any], subkeys: set[str] | None) -> dict[Path, Any]:
    """The entries of ``checkpoint``; with ``subkeys`` (a first save's) a top-level dict is split only where it
    was one then too (a key it no longer holds stays as the first save had it)."""
    out: dict[Path, Any] = {}
    for k, v in checkpoint.items():
        if not isinstance(k, str) or k in SKIP:
            continue
        subs = _subs(v)
        if subs is not None and (subkeys is None or k in subkeys):
            out.update(((k, s), x) for s, x in subs.items())
        else:
            out[(k,)] = v
    return out


def encode(value: Any) -> dict[str, Any] | None:
    """``value`` as JSON with its tensors inline; ``None`` when they are over :data:`ENTRY_BYTES` or sharded."""
    tree, chunks = flatten({"v": value}, ordered=True)
    if sum(c.nbytes for c in chunks) > ENTRY_BYTES or any(c.name != c.key or c.sizes != c.global_shape for c in chunks):
        return None
    tensors = {}
    for c in chunks:
        t = c.tensor.detach().cpu().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        tensors[c.key] = [dtype_name(t.dtype), list(c.global_shape), base64.b64encode(raw).decode()]
    return {"tree": tree["v"], "tensors": tensors}


def _canonical(enc: dict[str, Any] | None) -> str | None:
    return None if enc is None else json.dumps(enc, sort_keys=True)


def record(step: int, checkpoint: dict[str, Any]) -> Record:
    rec = Record(step, subkeys={k for k, v in checkpoint.items() if isinstance(k, str) and _subs(v) is not None})
    for path, v in _entries(checkpoint, None).items():
        if (c := _canonical(encode(v))) is not None:
            rec.encoded[path] = c
        else:
            rec.large.add(path)
    return rec


def changed(first: Record, checkpoint: dict[str, Any]) -> tuple[list[list[Any]], list[Path]]:
    """The entries of ``checkpoint`` that differ from the first save's, as ``[path, encoded]`` pairs for a
    pointer, and the paths of those too large to carry (taken from the first save)."""
    out: list[list[Any]] = []
    too_large: list[Path] = []
    for path, v in _entries(checkpoint, first.subkeys).items():
        enc = encode(v)
        if enc is None:
            if path not in first.large:
                too_large.append(path)
        elif _canonical(enc) != first.encoded.get(path):
            out.append([list(path), enc])
    return out, too_large


def _tensor(spec: Any) -> torch.Tensor:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[1], list) and isinstance(spec[2], str)):
        raise ValueError(f"a malformed tensor {str(spec)[:80]!r}")
    name, shape, data = spec
    if len(shape) > MAX_DIMS or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= ENTRY_BYTES for n in shape):
        raise ValueError(f"a malformed shape {shape!r}")
    raw = base64.b64decode(data, validate=True)
    if len(raw) != math.prod(shape) * itemsize(name):
        raise ValueError(f"{len(raw)} bytes for a {name} tensor of shape {shape}")
    dtype = dtype_from_name(name)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def apply(state: dict[str, Any], overlay: Any, where: str) -> dict[str, Any]:
    """Put a pointer's overlay (as read, untrusted) over ``state``, the step's state."""
    if not isinstance(overlay, list):
        raise FormatError(f"{where}: a malformed ckptd pointer overlay")
    for item in overlay:
        try:
            path, enc = item
            if not (isinstance(path, list) and 1 <= len(path) <= 2 and all(isinstance(p, str) for p in path)):
                raise ValueError(f"a malformed entry path {str(path)[:80]!r}")
            tensors = {k: _tensor(s) for k, s in enc["tensors"].items()}

            def resolve(key: str, tensors: dict[str, torch.Tensor] = tensors) -> torch.Tensor:
                if key not in tensors:
                    raise ValueError(f"a reference to the missing tensor {key[:80]!r}")
                return tensors[key]

            value = unflatten({"v": enc["tree"]}, resolve)["v"]
        except (ValueError, TypeError, KeyError, AttributeError, binascii.Error, FormatError) as e:
            raise FormatError(f"{where}: a malformed ckptd pointer overlay ({e})") from None
        parent = state if len(path) == 1 else state.get(path[0])
        if not isinstance(parent, dict):
            raise FormatError(f"{where}: the pointer's overlay names {'/'.join(path)} but the step holds no dict {path[0]!r}")
        parent[path[-1]] = value
    return state
