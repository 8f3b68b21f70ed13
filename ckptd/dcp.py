"""Interop: read a ckptd checkpoint with ``torch.distributed.checkpoint.load``.

    import torch.distributed.checkpoint as dcp
    import ckptd.dcp
    dcp.load({"model": model.state_dict()}, storage_reader=ckptd.dcp.Reader(path))

DCP's planner does the resharding; this reader describes ckptd's chunks as DCP metadata and copies
the requested regions out of checksum-verified chunks. Keys are DCP's flattened names
(``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``, ``extra.<rank>.<key>``),
so a state dict shaped like the one given to ``ckptd.snapshot`` (``{"model": ..., "optim": ...}``)
loads as is, and each rank's ``extra`` with ``{"extra": {"<rank>": {...}}}``.
Non-tensor values are handed to the planner serialized in memory, as DCP's planner expects; nothing
is pickled on disk.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .client.reader import CheckpointReader, resolve_step_dir
from .errors import CheckpointError
from .format import dtype_from_name
from .layout import is_complete
from .state import split_key, unflatten

__all__ = ["Reader"]


class Reader(StorageReader):
    """A DCP ``StorageReader`` over one committed ckptd step (or a job directory: its newest step).

    DCP calls, on every rank: ``reset``, ``read_metadata`` (coordinator), ``set_up_storage_reader``,
    ``prepare_local_plan``, ``prepare_global_plan`` (coordinator), then ``read_data``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = resolve_step_dir(os.fspath(path))
        self._reader: CheckpointReader | None = None
        self._tensor_keys: dict[str, str] = {}  # DCP name -> ckptd state key
        self._values: dict[str, Any] = {}  # DCP name -> non-tensor value

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = resolve_step_dir(os.fspath(checkpoint_id))
        self._close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_complete(os.fspath(checkpoint_id))

    def _open(self) -> CheckpointReader:
        if self._reader is None:
            self._reader = CheckpointReader(self.path)
            self._index(self._reader)
        return self._reader

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _index(self, reader: CheckpointReader) -> None:
        placeholders: dict[int, str] = {}

        def mark(key: str) -> torch.Tensor:
            t = torch.empty(0, device="meta")
            placeholders[id(t)] = key
            return t

        # every rank's tree: tensors some ranks hold alone (MoE experts), and each rank's extra (extra.<rank>...)
        for r in reader.manifest["ranks"]:
            flat, _ = flatten_state_dict(unflatten(r["tree"], mark))
            for name, value in flat.items():
                if isinstance(value, torch.Tensor) and id(value) in placeholders:
                    self._tensor_keys[name] = placeholders[id(value)]
                else:
                    self._values.setdefault(name, value)
        for key in reader.manifest["tensors"]:
            self._tensor_keys.setdefault(".".join(split_key(key)), key)

    def read_metadata(self) -> Metadata:
        reader = self._open()
        md: dict[str, Any] = {}
        for name, key in self._tensor_keys.items():
            ent = reader.manifest["tensors"][key]
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(ent["dtype"])),
                size=torch.Size(ent["shape"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])) for c in ent["chunks"]],
            )
        for name in self._values:
            md[name] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reader = self._open()
        for item in plan.items:
            name = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(self._values[name], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            key = self._tensor_keys[name]
            offsets = list(item.storage_index.offset)
            chunk = next((c for c in reader.manifest["tensors"][key]["chunks"] if c["offsets"] == offsets), None)
            if chunk is None:
                raise CheckpointError(f"{self.path}: tensor {key!r} has no chunk at offsets {offsets}")
            src = reader.saved_chunk(key, chunk)
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, off, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(src)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
