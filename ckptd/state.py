"""Flatten state into tensor chunks plus a tagged JSON tree, and back.

Tensors are keyed by their path in the state (``model/<fqn>``, ``optim/state/<fqn>/exp_avg``,
``extra/<rank>/...``) and placed by global shape and offsets — never by rank — so a checkpoint can
be read into another layout. Sharded values (``DTensor``, ``ShardedTensor``) are described through
the ``__create_chunk_list__`` / ``__get_tensor_shard__`` protocol that torch's DCP uses.

The tree is plain JSON. Objects with the single tag key ``"__ckptd__"`` stand for what JSON lacks:
``{"__ckptd__": "tensor", "key": K}``, ``{"__ckptd__": "tuple", "items": [..]}``,
``{"__ckptd__": "dict", "items": [[k, v], ..]}`` (a dict with non-string keys, or one that holds
the tag key), ``{"__ckptd__": "odict", "items": [[k, v], ..]}`` (an ``OrderedDict``),
``{"__ckptd__": "float", "value": "nan" | "inf" | "-inf"}``, ``{"__ckptd__": "ndarray", "key": K}``
(a numpy array, stored as a tensor), ``{"__ckptd__": "npscalar", "dtype": "float32", "value": 1.5}``
(a numpy scalar), ``{"__ckptd__": "bytes", "key": K}`` (``bytes``, stored as a uint8 tensor; never
unpickled or otherwise interpreted by ckptd). Named tuples, sets and other objects are refused naming their path: rebuilding a
class named by a checkpoint would let the checkpoint run code. Another subclass of a type above comes back as that
type (a ``Counter`` or ``defaultdict`` as a dict: ``MultiStepLR`` keeps its milestones in a ``Counter`` and takes a
dict back; ``torch.Size`` as a tuple; an ``IntEnum`` as its value; a ``bytearray`` as ``bytes``). Unknown tags are
rejected on read.
A tree nests at most ``config.MAX_TREE_DEPTH`` levels (``{}`` is one, tags count as
the JSON they are): deeper state is refused when saved, a deeper tree when read.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import MAX_TREE_DEPTH
from .errors import FormatError, UnsupportedState
from .validate import NUMPY_SCALARS

TAG = "__ckptd__"


@dataclass
class LocalChunk:
    """One chunk of one tensor held by this process."""

    key: str
    name: str  # name in the shard file: ``key``, or ``key#i`` for the i-th local shard
    tensor: torch.Tensor  # the local data (any device); copied, never referenced, when staged
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...] = field(init=False)  # computed once: read many times per snapshot

    def __post_init__(self) -> None:
        self.sizes = tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 4096


def replica_id(ch: LocalChunk) -> str:
    """A chunk's identity across ranks: state key and region (JSON, so it can key a JSON object)."""
    return json.dumps([ch.key, list(ch.offsets), list(ch.sizes)], separators=(",", ":"))


def sample_digest(t: torch.Tensor) -> str:
    """XXH3-64 of a tensor's bytes, or of 16 evenly spaced 4 KiB windows when it is larger than 64 KiB.

    Cheap enough to run on every snapshot for every replicated chunk; two different tensors
    (say, two experts that share an FQN) differ in every window.
    """
    import xxhash

    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    n = raw.numel()
    if n <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return xxhash.xxh3_64_hexdigest(raw.cpu().numpy())
    h = xxhash.xxh3_64()
    for i in range(SAMPLE_WINDOWS):
        a = (n - SAMPLE_BYTES) * i // (SAMPLE_WINDOWS - 1)
        h.update(raw[a : a + SAMPLE_BYTES].cpu().numpy())
    return h.hexdigest()


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace("/", "%2F")


def join_key(path: tuple[str, ...]) -> str:
    """The state key of a path in the state: its parts escaped (``%`` and ``/``), joined by ``/``."""
    return "/".join(_escape(p) for p in path)


def split_key(key: str) -> list[str]:
    """The path parts of a state key: the inverse of :func:`join_key`."""
    return [p.replace("%2F", "/").replace("%25", "%") for p in key.split("/")]


def local_chunks(key: str, value: torch.Tensor) -> list[LocalChunk]:
    """The chunks of ``value`` that this process holds, with their global placement."""
    if hasattr(value, "local_shards") and hasattr(value, "metadata"):  # ShardedTensor (FSDP1)
        shards = value.local_shards()
        gshape = tuple(value.size())
        return [
            LocalChunk(key, key if len(shards) == 1 else f"{key}#{i}", sh.tensor, gshape, tuple(sh.metadata.shard_offsets))
            for i, sh in enumerate(shards)
        ]
    if hasattr(value, "__create_chunk_list__") and hasattr(value, "__get_tensor_shard__"):
        out = []
        chunks = value.__create_chunk_list__()
        for i, md in enumerate(chunks):
            from torch.distributed.checkpoint.metadata import MetadataIndex

            local = value.__get_tensor_shard__(MetadataIndex(key, md.offsets, i))
            name = key if len(chunks) == 1 else f"{key}#{i}"
            out.append(LocalChunk(key, name, local, tuple(value.shape), tuple(md.offsets)))
        return out
    return [LocalChunk(key, key, value, tuple(value.shape), (0,) * value.dim())]


def flatten(root: dict[str, Any], *, ordered: bool = False) -> tuple[Any, list[LocalChunk]]:
    """Split ``root`` into a JSON tree and the list of local tensor chunks it refers to. ``ordered``:
    an ``OrderedDict`` is tagged as one (``extra``, which comes back as the user gave it; model and
    optimizer state dicts are loaded by ckptd, whatever their mapping type, and stay plain).

    Raises :class:`UnsupportedState` (a ``TypeError``) naming the path of any value it cannot store.
    """
    chunks: list[LocalChunk] = []
    seen: set[str] = set()

    def tensor(t: torch.Tensor, path: tuple[str, ...], tag: str) -> dict[str, Any]:
        key = join_key(path)
        if key in seen:
            raise ValueError(f"two tensors map to the state key {key!r}")
        seen.add(key)
        chunks.extend(local_chunks(key, t))
        return {TAG: tag, "key": key}

    def pairs(v: dict[Any, Any], path: tuple[str, ...], depth: int) -> list[Any]:
        if depth + 2 > MAX_TREE_DEPTH:  # its item list and [key, value] pairs nest two levels further
            raise _too_deep(path)
        return [[enc(k, path + ("<key>",), depth + 3), enc(x, path + (n,), depth + 3)] for n, (k, x) in zip(key_names(v), v.items())]

    def enc(v: Any, path: tuple[str, ...], depth: int) -> Any:
        """``v`` encoded as the JSON it becomes ``depth`` levels down in the tree."""
        if type(v).__module__ == "numpy":  # first: an np.float64 is a float too, and would come back as one
            return str(v) if isinstance(v, str) else _numpy(v, path, tensor, enc, depth)  # np.str_: a str, as ever
        if v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
            return v
        if depth > MAX_TREE_DEPTH:
            raise _too_deep(path)
        if isinstance(v, torch.Tensor):
            return tensor(v, path, "tensor")
        if isinstance(v, (bytes, bytearray)):  # e.g. a data loader's state, pickled by its owner
            return tensor(torch.frombuffer(bytearray(v), dtype=torch.uint8) if v else torch.empty(0, dtype=torch.uint8), path, "bytes")
        if isinstance(v, float):
            return {TAG: "float", "value": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if ordered and isinstance(v, OrderedDict):
            return {TAG: "odict", "items": pairs(v, path, depth)}
        if isinstance(v, dict):
            if all(isinstance(k, str) for k in v) and TAG not in v:
                return {k: enc(x, path + (k,), depth + 1) for k, x in v.items()}
            return {TAG: "dict", "items": pairs(v, path, depth)}
        if isinstance(v, list):
            return [enc(x, path + (str(i),), depth + 1) for i, x in enumerate(v)]
        if isinstance(v, tuple):
            if hasattr(v, "_fields"):
                raise _named_tuple(v, path)
            if depth + 1 > MAX_TREE_DEPTH:  # its item list nests one level further
                raise _too_deep(path)
            return {TAG: "tuple", "items": [enc(x, path + (str(i),), depth + 2) for i, x in enumerate(v)]}
        raise UnsupportedState(
            f"cannot checkpoint {type(v).__name__} at {'/'.join(path)}: use JSON types, tuples, dicts, tensors and numpy arrays"
        )

    tree = {k: enc(v, (k,), 2) for k, v in root.items()}
    return tree, chunks


def key_names(keys: Iterable[Any]) -> list[str]:
    """The path part of each value of a dict stored as pairs (``keys`` in order): ``str(key)``, unless two keys
    share it (1 and "1": their tensors would share a state key), then the type's name before each key that is not
    a string. Saving and restoring both name them so."""
    keys = list(keys)
    names = [str(k) for k in keys]
    if len(set(names)) < len(names):
        names = [k if isinstance(k, str) else f"<{type(k).__name__}>{k}" for k in keys]
    return names


def _numpy(v: Any, path: tuple[str, ...], tensor: Callable[..., Any], enc: Callable[..., Any], depth: int) -> Any:
    """A numpy array (stored as a tensor) or scalar, tagged so that it comes back as one."""
    import numpy as np

    if isinstance(v, np.ndarray):
        if v.dtype.name not in NUMPY_SCALARS:
            raise UnsupportedState(f"cannot checkpoint the numpy array at {'/'.join(path)}: dtype {v.dtype} is not numeric")
        if not v.dtype.isnative:  # big-endian: stored (and restored) in this machine's byte order, the same values
            v = v.astype(v.dtype.newbyteorder("="))
        a = v if v.flags.c_contiguous and v.flags.writeable else v.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        return tensor(torch.from_numpy(a), path, "ndarray")
    if isinstance(v, np.generic) and v.dtype.name in NUMPY_SCALARS:
        return {TAG: "npscalar", "dtype": v.dtype.name, "value": enc(v.item(), path, depth + 1)}
    raise UnsupportedState(f"cannot checkpoint {type(v).__name__} at {'/'.join(path)}: use numeric numpy arrays and scalars")


def _named_tuple(v: Any, path: tuple[str, ...]) -> UnsupportedState:
    return UnsupportedState(
        f"cannot checkpoint the named tuple {type(v).__name__} at {'/'.join(path)}: store its ._asdict() and rebuild it after"
        " restore (ckptd never rebuilds a class a checkpoint names)"
    )


def _too_deep(path: tuple[str, ...]) -> ValueError:
    # the reader refuses deeper trees (ckptd.validate): say so when saving, naming the place
    return ValueError(f"cannot checkpoint the state at {'/'.join(path)}: it nests deeper than {MAX_TREE_DEPTH} levels")


def unflatten(tree: Any, resolve: Callable[[str], Any]) -> Any:
    """Rebuild the object a tree describes, calling ``resolve(key)`` for every tensor reference.

    A tree deeper than ``MAX_TREE_DEPTH`` raises :class:`FormatError` before the stack runs out
    (manifests are checked whole by :mod:`ckptd.validate`; this guards every other caller)."""

    def dec(v: Any, depth: int) -> Any:
        if depth > MAX_TREE_DEPTH and isinstance(v, (list, dict)):
            raise FormatError(f"the saved tree nests deeper than {MAX_TREE_DEPTH} levels: the checkpoint is corrupt or hostile")
        if isinstance(v, list):
            return [dec(x, depth + 1) for x in v]
        if isinstance(v, dict):
            if TAG not in v:
                return {k: dec(x, depth + 1) for k, x in v.items()}
            tag = v[TAG]
            if tag == "tensor":
                return resolve(v["key"])
            if tag == "tuple":
                return tuple(dec(x, depth + 2) for x in v["items"])
            if tag in ("dict", "odict"):
                pairs = ((_hashable(dec(k, depth + 3)), dec(x, depth + 3)) for k, x in v["items"])
                return OrderedDict(pairs) if tag == "odict" else dict(pairs)
            if tag == "float":
                return float(v["value"])
            if tag == "bytes":
                t = resolve(v["key"])
                return t.numpy().tobytes() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t
            if tag in ("ndarray", "npscalar"):
                return _numpy_value(v, resolve, dec, depth)
            raise FormatError(f"unknown tree tag {tag!r}: written by a newer ckptd?")
        return v

    return dec(tree, 1)


def keys_tagged(tree: Any, tag: str) -> set[str]:
    """The state keys the references tagged ``tag`` (``"bytes"``, ``"ndarray"``, ...) in ``tree`` name."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if v.get(TAG) == tag and isinstance(v.get("key"), str):
                out.add(v["key"])
            else:
                stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def _numpy_value(v: dict[str, Any], resolve: Callable[[str], Any], dec: Callable[..., Any], depth: int) -> Any:
    import numpy as np

    if v[TAG] == "ndarray":
        t = resolve(v["key"])
        # a reader that resolves to keys or placeholders (the DCP reader's index) gets them as they are
        return t.numpy() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t
    if v.get("dtype") not in NUMPY_SCALARS:
        raise FormatError(f"unknown numpy scalar type {v.get('dtype')!r} in the saved tree")
    try:
        return np.array(dec(v["value"], depth + 1), dtype=v["dtype"])[()]
    except (OverflowError, ValueError, TypeError) as e:
        raise FormatError(f"the saved numpy {v['dtype']} {v['value']!r} is not one: {e}") from None


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k
