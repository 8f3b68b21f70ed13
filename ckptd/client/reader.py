"""Read a committed checkpoint: verified chunk regions of its tensors, in any placement.

Runs in the trainer's process (and in ``ckptd export`` and the DCP reader), on the calling thread,
and needs no daemon: for every region a caller asks for it copies in the parts of the saved chunks
that intersect it (so a chunk saved whole can fill a shard and the reverse), verifying each saved
chunk's checksum before its bytes are used. :mod:`.load` puts a model and optimizer on top of it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..errors import CheckpointError, FormatError
from ..format import digest, dtype_from_name
from ..layout import MANIFEST, is_complete
from ..storage.local import latest_step
from ..validate import read_manifest, validate_manifest


class CheckpointReader:
    """Reads verified chunk regions from one committed step directory.

    Chunks are read with ``pread`` into memory of their own, not mapped: memory held is one saved
    chunk at a time (an export of a checkpoint larger than RAM stays small), and every chunk's
    checksum is verified on the very bytes that are then used.
    """

    def __init__(
        self, path: str, *, manifest: dict[str, Any] | None = None, files: dict[str, str] | None = None, memory: bool = False
    ) -> None:
        """``path``: a committed step directory. A hot restore passes the step's ``manifest`` and, in
        ``files``, where each shard's bytes are instead (the daemon's shared-memory segments, which
        hold exactly the shard file's bytes and may be longer). ``memory``: the manifest is the daemon's
        of a memory-tier step, which has no checksums (its bytes never left the daemon's memory)."""
        self.path = path
        if manifest is None:
            self.manifest = read_manifest(path)
        else:
            self.manifest = validate_manifest(manifest, os.path.join(path, MANIFEST), memory=memory)
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
        if got != e - b or (c["xxh3_64"] is not None and digest(view) != c["xxh3_64"]):
            where = self.where(c["file"])
            raise FormatError(f"checksum mismatch in {where} (tensor {key!r}, bytes {b}-{e}): the file is corrupt")
        ent = self.manifest["tensors"][key]
        return raw.view(dtype_from_name(ent["dtype"])).view(c["sizes"])

    def read_into(self, key: str, dst: torch.Tensor, offsets: tuple[int, ...], *, cast: torch.dtype | None = None) -> None:
        """Fill ``dst``, the region of tensor ``key`` starting at ``offsets``, from the saved chunks.

        The saved dtype must be ``dst``'s, unless ``dst`` has dtype ``cast`` and both are floating
        point: then the saved values are converted (rounded as ``Tensor.copy_`` rounds)."""
        ent = self.manifest["tensors"].get(key)
        if ent is None:
            raise CheckpointError(f"the checkpoint at {self.path} has no tensor {key!r}")
        saved = dtype_from_name(ent["dtype"])
        if saved != dst.dtype and not (cast == dst.dtype and saved.is_floating_point and dst.dtype.is_floating_point):
            hint = f": pass dtype={dst.dtype} to restore() to convert" if saved.is_floating_point and dst.dtype.is_floating_point else ""
            raise CheckpointError(f"tensor {key!r}: the checkpoint holds {saved}, the target is {dst.dtype}{hint}")
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
