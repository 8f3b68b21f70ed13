"""``ckptd import``: turn an existing ``torch.distributed.checkpoint`` directory into a ckptd step.

The DCP checkpoint is read whole into this process's memory (every tensor at its full shape), mapped
onto ckptd's state — ``model`` when the state dict has it, else every top-level tensor is the model
(torchtitan's layout), and ``optim`` (or ``optimizer``) when it has one, keyed by parameter name (a plain
``optimizer.state_dict()``, keyed by number, is refused); an optimizer state dict in DCP's flattened form
(``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>``) is nested as ``get_state_dict`` gives it;
everything else becomes rank 0's ``extra`` — and committed through the daemon as an ordinary step,
which then restores into any layout.

A DCP directory is untrusted input: its ``.metadata`` is a pickle, read here by an unpickler that
builds only DCP's own metadata classes (anything else is refused, never run), and its non-tensor
values are loaded with ``torch.load(weights_only=True)`` (numpy arrays and scalars allowed too). DCP allocates
each declared tensor with ``torch.empty()`` and copies in what its chunks hold, so before anything is allocated
every declared size is bounded (by int64, this machine's memory and, for uncompressed chunks, the bytes the data
files hold) and every tensor's chunks must cover it exactly once (:func:`ckptd.coverage.check_coverage`): a gap
would carry this process's heap into the step, where ``ckptd verify`` accepts it. Once read, the elements DCP
copied are counted again against every tensor's size.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import reprlib
import stat
from collections import Counter
from typing import Any, NoReturn

import torch

from ..coverage import check_coverage
from ..errors import CheckpointError, FormatError
from ..format import MAX_DIMS

_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_META, n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}
_I64 = (1 << 63) - 1  # torch counts bytes in int64
_short = reprlib.Repr()  # hostile values are quoted in errors: keep them short
_short.maxlist = _short.maxtuple = 8


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise FormatError(f"the DCP metadata names {module}.{name}, which is not DCP metadata: refusing to load it")


def load_dcp(path: str) -> dict[str, Any]:
    """The whole state dict of the DCP checkpoint at ``path``, nested as it was saved, on the CPU."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    md = _read_metadata(path)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(md, "storage_meta", None) is not None:
                md.storage_meta.load_id = self.load_id
            return md

    class Planner(_EmptyStateDictLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.written: Counter[str] = Counter()  # fqn -> elements DCP copied into it

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            self.written[read_item.dest_index.fqn] += math.prod(read_item.lengths)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                with torch.serialization.safe_globals(_numpy_globals()):
                    obj = torch.load(value, weights_only=True)
            except Exception as e:  # the restricted unpickler refuses anything but plain data
                raise FormatError(f"{path}: value {read_item.dest_index.fqn!r} is not plain data: {e}") from None
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    sd: dict[str, Any] = {}
    planner = Planner()
    try:
        _load_state_dict(sd, storage_reader=Reader(path), planner=planner, no_dist=True)
    except CheckpointException as e:  # DCP wraps what went wrong, per rank
        first = next((err for err, _ in e.failures.values() if isinstance(err, CheckpointError)), None)
        raise first or FormatError(f"{path}: DCP could not read it: {e}") from None
    # the chunks were proven disjoint (_check_tensors): as many elements copied as a tensor has is every one of them
    for fqn, t in planner.state_dict.items():
        if isinstance(t, torch.Tensor) and planner.written[fqn] != t.numel():
            _refuse(path, f"DCP copied {planner.written[fqn]} of the {t.numel()} elements of tensor {fqn!r}")
    return sd


def _read_metadata(path: str) -> Any:
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a directory (a DCP checkpoint is a directory with a .metadata file)")
    from torch.distributed.checkpoint.metadata import Metadata

    md_path = os.path.join(path, ".metadata")
    _plain_file(md_path)
    try:
        with open(md_path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a DCP checkpoint: it has no .metadata") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
        raise FormatError(f"{md_path} is not readable DCP metadata: {e!r}") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise FormatError(f"{md_path} holds a {type(md).__name__}, not DCP metadata")
    if md.storage_data is not None and not isinstance(md.storage_data, dict):
        raise FormatError(f"{md_path}: storage_data is a {type(md.storage_data).__name__}, not DCP's map of chunks to their data")
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.basename(rel) != rel or rel in (".", ".."):  # data files only in the checkpoint's directory
            raise FormatError(f"{md_path} points outside the checkpoint directory ({rel!r}): refusing to read it")
        _plain_file(os.path.join(path, rel))
    _check_tensors(md, path, md_path)
    return md


def _refuse(where: str, problem: str) -> NoReturn:
    raise FormatError(f"{where}: {problem}: refusing to import it")


def _brief(v: Any) -> str:
    return _short.repr(list(v) if isinstance(v, tuple) else v)


def _ints(v: Any, what: str, md_path: str, n: int | None = None) -> list[int]:
    """``v`` (a ``torch.Size``) as a list of at most :data:`MAX_DIMS` integers in [0, 2**63 - 1], exactly ``n`` of
    them if given; else refuse, naming ``what`` it is."""
    if isinstance(v, (tuple, list)) and len(v) <= MAX_DIMS and (n is None or len(v) == n):
        if all(type(x) is int and 0 <= x <= _I64 for x in v):  # type(): True is not the integer 1
            return list(v)
    _refuse(md_path, f"{what} {_brief(v)} must be {f'at most {MAX_DIMS}' if n is None else n} integers in [0, 2**63 - 1]")


def _memory_bytes() -> int:
    """This machine's physical memory, which the import holds every tensor of the checkpoint in at once; at most
    2**63 - 1, as torch counts bytes."""
    try:
        return min(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), _I64)
    except (ValueError, OSError, AttributeError):  # no such sysconf here: int64 still bounds what torch allocates
        return _I64


def _check_tensors(md: Any, path: str, md_path: str) -> None:
    """Refuse a ``.metadata`` whose tensors DCP cannot fill from the checkpoint's own bytes, before DCP allocates
    any of them: sizes past this machine's memory, a chunk outside its tensor, chunks that do not cover their
    tensor exactly once (a gap is ``torch.empty()``'s memory in the step), a chunk with no data or with fewer bytes
    than it declares, and more bytes declared than the data files hold (one saved chunk read into many tensors).
    The last two for uncompressed chunks, whose bytes ``torch.save`` stores whole.

    Raises:
        FormatError: what is wrong, naming ``md_path`` and the tensor.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    storage = md.storage_data or {}  # a dict: _read_metadata saw to it
    memory = _memory_bytes()
    file_sizes: dict[str, int] = {}
    tensors: dict[str, dict[str, Any]] = {}  # as ckptd.coverage checks them
    declared = whole = 0  # bytes of every tensor; of the chunks stored uncompressed
    for fqn, ent in md.state_dict_metadata.items():
        if isinstance(ent, BytesStorageMetadata):
            continue  # read by torch.load(weights_only=True): nothing is allocated from a declared size
        if not isinstance(fqn, str) or not isinstance(ent, TensorStorageMetadata):
            _refuse(md_path, f"entry {_brief(fqn)} is a {type(ent).__name__}, neither a tensor nor bytes")
        dtype = getattr(getattr(ent, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            _refuse(md_path, f"tensor {fqn!r} has dtype {_brief(dtype)}, not a torch dtype")
        shape = _ints(getattr(ent, "size", None), f"tensor {fqn!r} size", md_path)
        numel = math.prod(shape)
        declared += numel * dtype.itemsize
        if declared > memory:
            _refuse(
                md_path,
                f"tensor {fqn!r} declares {numel} elements of {dtype} ({numel * dtype.itemsize} bytes): the import would hold"
                f" {declared} bytes of tensors in memory, more than this machine has ({memory} bytes)",
            )
        chunks = getattr(ent, "chunks", None)
        if not isinstance(chunks, list):
            _refuse(md_path, f"tensor {fqn!r} chunks is a {type(chunks).__name__}, not a list")
        placed = tensors[fqn] = {"shape": shape, "chunks": []}
        whole += _place_chunks(chunks, fqn, shape, dtype, placed["chunks"], storage, path, md_path, file_sizes)
    if whole > sum(file_sizes.values()):  # each chunk DCP saves is stored apart from the others
        _refuse(
            md_path,
            f"it declares {whole} bytes of tensors in uncompressed chunks, more than its data files hold ({sum(file_sizes.values())})",
        )
    try:
        check_coverage(tensors)
    except CheckpointError as e:
        _refuse(md_path, f"{e} (chunks must cover each tensor exactly once, or the step would hold uninitialized memory)")


def _place_chunks(
    chunks: list[Any], fqn: str, shape: list[int], dtype: torch.dtype, placed: list[dict[str, Any]], storage: dict[Any, Any],
    path: str, md_path: str, file_sizes: dict[str, int],
) -> int:  # fmt: skip
    """Check ``fqn``'s chunks lie inside its ``shape`` and have their data, and append each non-empty one to ``placed``
    (as :mod:`ckptd.coverage` checks them); returns the bytes of those stored uncompressed."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    whole = 0
    for i, c in enumerate(chunks):
        what = f"tensor {fqn!r}: chunk {i}"
        if not isinstance(c, ChunkStorageMetadata):
            _refuse(md_path, f"{what} is a {type(c).__name__}")
        offs = _ints(getattr(c, "offsets", None), f"{what} offsets", md_path, len(shape))
        sizes = _ints(getattr(c, "sizes", None), f"{what} sizes", md_path, len(shape))
        if any(o + s > g for o, s, g in zip(offs, sizes, shape)):  # DCP would copy only the part inside
            _refuse(md_path, f"{what} at offsets {offs} with sizes {sizes} reaches past its shape {shape}")
        nbytes = math.prod(sizes) * dtype.itemsize
        if nbytes:  # an empty chunk holds no element: DCP reads nothing for it
            what = f"{what} at offsets {offs}"
            file, length, stored_whole = _chunk_data(storage, fqn, offs, what, path, md_path, file_sizes)
            if stored_whole:
                whole += nbytes
                if nbytes > length:
                    _refuse(md_path, f"{what} needs {nbytes} bytes, its data in {file} holds {length}")
            placed.append({"offsets": offs, "sizes": sizes, "file": file})
    return whole


def _chunk_data(
    storage: dict[Any, Any], fqn: str, offs: list[int], what: str, path: str, md_path: str, file_sizes: dict[str, int]
) -> tuple[str, int, bool]:
    """Where the data of ``fqn``'s chunk at ``offs`` lies: its file, its length in bytes, and whether it is stored
    uncompressed; refused if it has none or it lies past its file's end. ``file_sizes`` caches the files' sizes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = storage.get(MetadataIndex(fqn, offs))
    if not isinstance(info, _StorageInfo):
        _refuse(md_path, f"{what} has no data in the checkpoint")
    file, start, length = info.relative_path, info.offset, info.length
    if type(start) is not int or type(length) is not int or start < 0 or length < 0:
        _refuse(md_path, f"{what} has its data at {_brief(start)} ({_brief(length)} bytes)")
    if file not in file_sizes:
        try:
            file_sizes[file] = os.lstat(os.path.join(path, file)).st_size  # a regular file: _read_metadata saw to it
        except FileNotFoundError:
            _refuse(md_path, f"{what} has its data in {file}, which is missing")
    if start + length > file_sizes[file]:
        _refuse(md_path, f"{what} has its data at bytes {start} to {start + length} of {file}, past its end ({file_sizes[file]} bytes)")
    return file, length, not getattr(info, "transform_descriptors", None)


def _numpy_globals() -> list[Any]:
    """What numpy arrays and scalars (``np.random.get_state()``, a data loader's position) need from the restricted
    unpickler besides plain data: their reconstructors and types, which build nothing else (as torch documents)."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    kinds = [getattr(np.dtypes, n) for n in getattr(np.dtypes, "__all__", ())]  # Int64DType...: numpy >= 1.25
    return [multiarray._reconstruct, multiarray.scalar, np.ndarray, np.dtype, *kinds]


def _plain_file(path: str) -> None:
    """``path``, if it exists, is a regular file: not a symbolic link (to another user's checkpoint, say) nor a
    FIFO (a read that never ends)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # reported by whoever reads it
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{path} is not a regular file (a symbolic link, a FIFO, a device): refusing to read it")


def _nest_optimizer(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict as ``get_state_dict`` gives it, from DCP's flattened form if need be."""
    if set(osd) <= {"state", "param_groups"}:
        return osd
    if not all(k.startswith(("state.", "param_groups.")) for k in osd):
        raise CheckpointError(f"the optimizer state holds keys ckptd does not know: {sorted(osd)[:5]}")
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, v in osd.items():
        kind, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        (state if kind == "state" else hyper).setdefault(fqn, {})[name] = v
    groups: list[dict[str, Any]] = []
    for fqn, hp in hyper.items():
        g = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hp), None)
        if g is None:
            groups.append(g := {**hp, "params": []})
        g["params"].append(fqn)
    return {"state": state, "param_groups": groups}


def _by_name(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd``, if its parameter groups list parameters by name, as ckptd restores them; else a clear refusal (a plain
    ``optimizer.state_dict()`` numbers them: the step would import and then fail every restore as corrupt)."""
    params = [p for g in osd.get("param_groups") or [] if isinstance(g, dict) for p in g.get("params") or []]
    if not all(isinstance(p, str) for p in params):
        raise CheckpointError(
            "the optimizer state lists its parameters by number (a plain optimizer.state_dict()), not by name: ckptd"
            " restores optimizer state by parameter name, into any layout. Save the checkpoint with"
            " torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) (or get_optimizer_state_dict),"
            " or leave the optimizer out of the DCP state dict to import the model alone"
        )
    return osd


def ckptd_state(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({"model": ..., "optim": ...}, extra)`` for a DCP state dict (see the module's docstring): a ``model`` entry,
    or the top-level tensors (torchtitan keeps its model's there), and the optimizer under ``optim`` or ``optimizer``."""
    okey = "optim" if isinstance(sd.get("optim"), dict) else "optimizer" if isinstance(sd.get("optimizer"), dict) else None
    if isinstance(sd.get("model"), dict):
        state = {"model": sd["model"]}
        taken = {"model", okey}
    else:
        state = {"model": {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}}
        if not state["model"]:
            raise CheckpointError("the DCP checkpoint holds no model: neither a 'model' entry nor top-level tensors")
        taken = {*state["model"], okey}
    if okey is not None:
        state["optim"] = _by_name(_nest_optimizer(sd[okey]))
    return state, {k: v for k, v in sd.items() if k not in taken}


def import_dcp(path: str, *, job: str, step: int, endpoint: str | None = None) -> str:
    """Read the DCP checkpoint at ``path`` and commit it as step ``step`` of ``job`` through the daemon
    at ``endpoint``; return the step's directory once it is durable."""
    from ..client import Client

    with Client(endpoint=endpoint, job=job) as c:
        c.hello()  # a daemon that is not there is said before the checkpoint is read, not after
        state, extra = ckptd_state(load_dcp(path))
        return c.snapshot_state(state, step=step, extra=extra).wait()
