"""Load a committed checkpoint into whatever layout the caller's model and optimizer have.

Runs in the trainer's process, on the calling thread, and needs no daemon: it reads the manifest,
then for every chunk this process holds copies in the parts of the saved chunks that intersect it
(so a chunk saved whole can fill a shard and the reverse), verifying each saved chunk's checksum
before its bytes are used, and finally hands the state to torch's ``set_state_dict``.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Any

import torch

from .errors import CheckpointError, FormatError
from .format import MANIFEST, digest, dtype_from_name, read_manifest
from .state import LocalChunk, flatten, unflatten


class CheckpointReader:
    """Reads verified chunk regions from one committed step directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.manifest = read_manifest(path)
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._verified: set[tuple[str, int]] = set()

    def close(self) -> None:
        for mm, _ in self._maps.values():
            mm.close()
        self._maps.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _file(self, name: str) -> torch.Tensor:
        if name not in self._maps:
            path = os.path.join(self.path, name)
            want = self.manifest["files"][name]["size"]
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size != want:
                        raise FormatError(f"{path} is {size} bytes, the manifest says {want}: truncated or corrupt")
                    mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            except FileNotFoundError:
                raise FormatError(f"{path} is missing: the checkpoint is incomplete") from None
            t = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
            self._maps[name] = (mm, t)  # type: ignore[assignment]
        return self._maps[name][1]

    def saved_chunk(self, key: str, c: dict[str, Any]) -> torch.Tensor:
        """The saved chunk ``c`` of tensor ``key`` as a tensor view, checksum verified once."""
        buf = self._file(c["file"])
        b, e = c["byte_range"]
        ident = (c["file"], b)
        raw = buf[b:e]
        if ident not in self._verified:
            if e > buf.numel() or digest(raw.numpy()) != c["xxh3_64"]:
                raise FormatError(
                    f"checksum mismatch in {os.path.join(self.path, c['file'])} (tensor {key!r}, bytes {b}-{e}): the file is corrupt"
                )
            self._verified.add(ident)
        ent = self.manifest["tensors"][key]
        return raw.view(dtype_from_name(ent["dtype"])).view(c["sizes"])

    def read_into(self, key: str, dst: torch.Tensor, offsets: tuple[int, ...]) -> None:
        """Fill ``dst``, the region of tensor ``key`` starting at ``offsets``, from the saved chunks."""
        ent = self.manifest["tensors"].get(key)
        if ent is None:
            raise CheckpointError(f"the checkpoint at {self.path} has no tensor {key!r}")
        if dtype_from_name(ent["dtype"]) != dst.dtype:
            raise CheckpointError(f"tensor {key!r}: checkpoint holds {ent['dtype']}, the target is {dst.dtype}")
        sizes = tuple(dst.shape)
        if len(ent["shape"]) != len(sizes) or any(o + s > g for o, s, g in zip(offsets, sizes, ent["shape"])):
            raise CheckpointError(f"tensor {key!r}: region {offsets}+{sizes} does not fit the saved shape {ent['shape']}")
        filled = 0
        for c in ent["chunks"]:
            lo = [max(a, b) for a, b in zip(offsets, c["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c["offsets"], c["sizes"])]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            src = self.saved_chunk(key, c)
            d = dst
            for dim, (l, h) in enumerate(zip(lo, hi)):
                src = src.narrow(dim, l - c["offsets"][dim], h - l)
                d = d.narrow(dim, l - offsets[dim], h - l)
            d.copy_(src)
            filled += math.prod(h - l for l, h in zip(lo, hi))
        if filled != math.prod(sizes):
            raise CheckpointError(f"tensor {key!r}: the checkpoint covers {filled} of the {math.prod(sizes)} elements needed")

    def read_full(self, key: str) -> torch.Tensor:
        ent = self.manifest["tensors"].get(key)
        if ent is None:
            raise CheckpointError(f"the checkpoint at {self.path} has no tensor {key!r}")
        out = torch.empty(ent["shape"], dtype=dtype_from_name(ent["dtype"]))
        self.read_into(key, out, (0,) * len(ent["shape"]))
        return out

    def tree_for(self, rank: int) -> tuple[int, dict[str, Any]]:
        """The saved rank whose tree this rank takes (itself if it existed, else rank 0) and its tree."""
        ranks = {r["rank"]: r["tree"] for r in self.manifest["ranks"]}
        src = rank if rank in ranks else 0
        if src not in ranks:
            raise FormatError(f"{self.path}: manifest lists no rank trees")
        return src, ranks[src]


def resolve_step_dir(path: str) -> str:
    """Accept a step directory, or a job directory (then its ``latest`` committed step)."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    from .persist import latest_path

    if os.path.isdir(path):
        step, d = latest_path(os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path)))
        if d is not None:
            return d
    raise CheckpointError(f"{path} is neither a committed ckptd step directory nor a job directory with one")


def restore_state(path: str, model: torch.nn.Module, optim: torch.optim.Optimizer | None, rank: int) -> dict[str, Any]:
    """Load ``path`` into ``model`` (and ``optim``) in place; return this rank's ``extra``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    with CheckpointReader(resolve_step_dir(path)) as reader:
        if optim is not None:
            msd, osd = get_state_dict(model, optim)
            target_root: dict[str, Any] = {"model": msd, "optim": osd}
        else:
            target_root = {"model": get_model_state_dict(model)}
        _, chunks = flatten(target_root)
        by_key: dict[str, list[LocalChunk]] = {}
        for ch in chunks:
            by_key.setdefault(ch.key, []).append(ch)
        saved_rank, tree = reader.tree_for(rank)
        for part in target_root:
            if part not in tree:
                raise CheckpointError(f"the checkpoint at {reader.path} holds no {part} state")
        targets = _targets(target_root)

        def fill(key: str) -> Any:
            if key not in targets:
                raise CheckpointError(f"checkpoint tensor {key!r} has no counterpart in the {key.split('/')[0]} being restored")
            for ch in by_key.get(key, []):
                reader.read_into(key, ch.tensor, ch.offsets)
            return targets[key]

        loaded = {part: unflatten(tree[part], fill) for part in target_root}
        extra_tree = (tree.get("extra") or {}).get(str(saved_rank))
        extra = unflatten(extra_tree, reader.read_full) if extra_tree is not None else {}
    if optim is not None:
        set_state_dict(model, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, loaded["model"])
    return extra


def _targets(root: dict[str, Any]) -> dict[str, Any]:
    """State key → the target object (tensor, DTensor, ShardedTensor) at that path."""
    out: dict[str, Any] = {}
    from .state import join_key

    def walk(v: Any, path: tuple[str, ...]) -> None:
        if isinstance(v, torch.Tensor):
            out[join_key(path)] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, path + (str(k),))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, path + (str(i),))

    for k, v in root.items():
        walk(v, (k,))
    return out
