"""Load a committed checkpoint into whatever layout the caller's model and optimizer have.

Runs in the trainer's process (and in ``ckptd export`` and the DCP reader), on the calling thread,
and needs no daemon: it reads the manifest, then for every chunk this process holds copies in the
parts of the saved chunks that intersect it (so a chunk saved whole can fill a shard and the
reverse), verifying each saved chunk's checksum before its bytes are used, and finally hands the
state to torch's ``set_state_dict``.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch

from ..errors import CheckpointError, FormatError
from ..format import digest, dtype_from_name
from ..layout import MANIFEST, is_complete
from ..state import TAG, join_key, local_chunks, unflatten
from ..storage.local import latest_step
from ..tools.verify import stale_warning
from ..validate import read_manifest, validate_manifest


class CheckpointReader:
    """Reads verified chunk regions from one committed step directory.

    Chunks are read with ``pread`` into memory of their own, not mapped: memory held is one saved
    chunk at a time (an export of a checkpoint larger than RAM stays small), and every chunk's
    checksum is verified on the very bytes that are then used.
    """

    def __init__(self, path: str, *, manifest: dict[str, Any] | None = None, files: dict[str, str] | None = None) -> None:
        """``path``: a committed step directory. A hot restore passes the step's ``manifest`` and, in
        ``files``, where each shard's bytes are instead (the daemon's shared-memory segments, which
        hold exactly the shard file's bytes and may be longer)."""
        self.path = path
        self.manifest = read_manifest(path) if manifest is None else validate_manifest(manifest, os.path.join(path, MANIFEST))
        self._files = dict(files or {})
        self._fds: dict[str, int] = {}

    def where(self, name: str) -> str:
        """The path the bytes of shard file ``name`` are read from."""
        return self._files.get(name) or os.path.join(self.path, name)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            path = self.where(name)
            want = self.manifest["files"][name]["size"]
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise FormatError(f"{path} is missing: the checkpoint is incomplete") from None
            size = os.fstat(fd).st_size
            if size < want or (size != want and name not in self._files):
                os.close(fd)
                raise FormatError(f"{path} is {size} bytes, the manifest says {want}: truncated or corrupt")
            self._fds[name] = fd
        return self._fds[name]

    def saved_chunk(self, key: str, c: dict[str, Any]) -> torch.Tensor:
        """The saved chunk ``c`` of tensor ``key``, read and checksum-verified."""
        b, e = c["byte_range"]
        fd = self._fd(c["file"])
        raw = torch.empty(e - b, dtype=torch.uint8)
        view = memoryview(raw.numpy())
        got = 0
        while got < e - b:
            n = os.preadv(fd, [view[got:]], b + got)
            if n == 0:
                break
            got += n
        if got != e - b or digest(view) != c["xxh3_64"]:
            where = self.where(c["file"])
            raise FormatError(f"checksum mismatch in {where} (tensor {key!r}, bytes {b}-{e}): the file is corrupt")
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
    if is_complete(path):
        return path
    if os.path.isdir(path):
        _, d = latest_step(os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.abspath(path)))
        if d is not None:
            return d
    raise CheckpointError(f"{path} is neither a committed ckptd step directory nor a job directory with one")


_MISSING = object()


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
    """The saved tree node at ``path`` (keys as ``flatten`` names them), or ``_MISSING``."""
    node = tree
    for part in path:
        if isinstance(node, dict) and TAG in node:
            if node[TAG] == "tuple":
                node = node["items"]
            elif node[TAG] == "dict":
                node = {str(unflatten(k, lambda key: key)): v for k, v in node["items"]}
            else:
                return _MISSING
        if isinstance(node, dict):
            if part not in node:
                return _MISSING
            node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return _MISSING
            node = node[int(part)]
        else:
            return _MISSING
    return node


def load_into(reader: CheckpointReader, target_root: dict[str, Any], rank: int) -> dict[str, Any]:
    """Fill ``target_root`` (state dicts in the caller's layout) from the checkpoint, in place.

    The target drives: every tensor chunk it holds is read from the intersecting saved chunks (so
    any world size, wrapper or sub-group sharding works), and every non-tensor leaf takes the saved
    value at the same path, from this rank's saved tree if it exists, else from any saved rank's.
    Which parameters an optimizer group holds (``param_groups/*/params``) stays the target's.
    """
    ranks = sorted(reader.manifest["ranks"], key=lambda r: (r["rank"] != rank, r["rank"]))
    trees = [r["tree"] for r in ranks]
    for part in target_root:
        if not any(part in t for t in trees):
            raise CheckpointError(f"the checkpoint at {reader.path} holds no {part} state")

    def saved(path: tuple[str, ...]) -> Any:
        for t in trees:
            node = _lookup(t, path)
            if node is not _MISSING:
                return node
        return _MISSING

    def build(v: Any, path: tuple[str, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            key = join_key(path)
            for ch in local_chunks(key, v):
                reader.read_into(key, ch.tensor, ch.offsets)
            return v
        if isinstance(v, dict):
            return {k: build(x, path + (str(k),)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            if path[:2] == ("optim", "param_groups") and path[-1] == "params":
                return v
            out = [build(x, path + (str(i),)) for i, x in enumerate(v)]
            return tuple(out) if isinstance(v, tuple) else out
        node = saved(path)
        return v if node is _MISSING else unflatten(node, reader.read_full)

    return {part: build(v, (part,)) for part, v in target_root.items()}


def restore_state(
    path: str, model: torch.nn.Module, optim: torch.optim.Optimizer | None, rank: int, *, reader: CheckpointReader | None = None
) -> dict[str, Any]:
    """Load ``path`` (or what ``reader`` reads) into ``model`` (and ``optim``) in place, in whatever
    layout they have now.

    Returns this rank's ``extra`` (rank 0's when the checkpoint had fewer ranks).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

    with reader or CheckpointReader(resolve_step_dir(path)) as reader:
        if optim is not None:
            msd, osd = get_state_dict(model, optim)
            target_root: dict[str, Any] = {"model": msd, "optim": osd}
        else:
            target_root = {"model": get_model_state_dict(model)}
        loaded = load_into(reader, target_root, rank)
        stale = stale_warning(reader.path, reader.manifest)
        if stale:
            warnings.warn(stale, stacklevel=3)
        saved_rank, tree = reader.tree_for(rank)
        extra_tree = (tree.get("extra") or {}).get(str(saved_rank))
        extra = unflatten(extra_tree, reader.read_full) if extra_tree is not None else {}
    if optim is not None:
        set_state_dict(model, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    else:
        set_model_state_dict(model, loaded["model"])
    return extra
