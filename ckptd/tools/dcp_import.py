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
values are loaded with ``torch.load(weights_only=True)`` (numpy arrays and scalars allowed too).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from typing import Any

import torch

from ..errors import CheckpointError, FormatError

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
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                with torch.serialization.safe_globals(_numpy_globals()):
                    obj = torch.load(value, weights_only=True)
            except Exception as e:  # the restricted unpickler refuses anything but plain data
                raise FormatError(f"{path}: value {read_item.dest_index.fqn!r} is not plain data: {e}") from None
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    sd: dict[str, Any] = {}
    try:
        _load_state_dict(sd, storage_reader=Reader(path), planner=Planner(), no_dist=True)
    except CheckpointException as e:  # DCP wraps what went wrong, per rank
        first = next((err for err, _ in e.failures.values() if isinstance(err, CheckpointError)), None)
        raise first or FormatError(f"{path}: DCP could not read it: {e}") from None
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
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.basename(rel) != rel or rel in (".", ".."):  # data files only in the checkpoint's directory
            raise FormatError(f"{md_path} points outside the checkpoint directory ({rel!r}): refusing to read it")
        _plain_file(os.path.join(path, rel))
    return md


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
