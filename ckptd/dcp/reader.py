"""``ckptd.dcp.Reader``: read a ckptd step with ``torch.distributed.checkpoint.load``.

    dcp.load({"model": model.state_dict()}, storage_reader=ckptd.dcp.Reader(path))     # a step directory
    dcp.load(state, storage_reader=ckptd.dcp.Reader(job="my-job"))                     # through the daemon

DCP's planner does the resharding; this reader describes ckptd's chunks as DCP metadata and copies
the requested regions out of checksum-verified chunks. Keys are DCP's flattened names
(``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ``optim.param_groups.0.lr``, ``extra.<rank>.<key>``),
so a state dict shaped like the one given to ``ckptd.snapshot`` (``{"model": ..., "optim": ...}``)
loads as is, and each rank's ``extra`` with ``{"extra": {"<rank>": {...}}}``; a step written by
:class:`ckptd.dcp.Writer` loads under the names it was saved with.
Non-tensor values are handed to the planner serialized in memory, as DCP's planner expects; nothing
is pickled on disk.
"""

from __future__ import annotations

import dataclasses
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

from ..client.api import CheckpointReader, OpenStep, join_all, open_step, resolve_step_dir
from ..errors import CheckpointError
from ..format import dtype_from_name
from ..layout import is_complete
from ..state import keys_tagged, split_key, unflatten
from .shared import client_for, step_of

__all__ = ["Reader"]


class Reader(StorageReader):
    """A DCP ``StorageReader`` over one committed ckptd step, resharded into the caller's layout by DCP's planner.

    ``dcp.load(state, storage_reader=ckptd.dcp.Reader(job=job))`` loads the newest complete step of the job (or ``step``, or
    the ``checkpoint_id`` given to ``dcp.load``) through the node's daemon: from its shared memory while it holds the step
    (also a step kept in the memory tier only), else its disk, else its bucket. ``Reader(path)`` reads a step directory
    without a daemon. A ``snapshot()`` step loads with ``{"model": ..., "optim": ...}``, and rank 0's ``extra`` with
    ``{"extra": {"0": {...}}}``; a :class:`ckptd.dcp.Writer` step loads under the names DCP gave it. Every rank reads the
    same step: a load whose ranks found different newest steps (one completed in between) fails naming them.

    DCP calls, on every rank: ``reset``, ``read_metadata``, ``set_up_storage_reader``, ``prepare_local_plan``,
    ``prepare_global_plan`` (coordinator), then ``read_data``.

    Args:
        path: A step directory, or a job directory meaning its newest step; give either ``path`` or ``job``.
        job: The job to read through the daemon.
        step: The step to read (with ``job`` only; default: the newest complete one, or ``dcp.load``'s ``checkpoint_id``).
        endpoint: The daemon's endpoint (default: ``CKPTD_ENDPOINT``, else the per-user socket).
        hot: Read the step from the daemon's shared memory while it holds it; ``False`` reads its disk or bucket.

    Raises:
        ValueError: Both or neither of ``path`` and ``job`` are given, ``step`` is given with ``path``, or ``step`` is not a
            step number.
        CheckpointError: ``path`` is neither a committed step directory nor a job directory with one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        job: str | None = None,
        step: int | None = None,
        endpoint: str | None = None,
        hot: bool = True,
    ) -> None:
        super().__init__()
        if (path is None) == (job is None):
            raise ValueError("ckptd.dcp.Reader reads a step directory, Reader(path), or a job through the daemon, Reader(job=...)")
        if path is not None and step is not None:
            raise ValueError("ckptd.dcp.Reader(path) reads the step at path: give step only with job")
        self.path = resolve_step_dir(os.fspath(path)) if path is not None else None
        self.job, self.endpoint, self.hot = job, endpoint, hot
        self.step = step_of(step, "ckptd.dcp.Reader") if step is not None else None
        self.last_restore: dict[str, Any] | None = None  # job mode: which step was read, from where
        self._reader: CheckpointReader | None = None
        self._tensor_keys: dict[str, str] = {}  # DCP name -> ckptd state key
        self._values: dict[str, Any] = {}  # DCP name -> non-tensor value

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._close()
        if checkpoint_id is None:
            return
        if self.job is not None:
            self.step = step_of(checkpoint_id, "ckptd.dcp.Reader(job=...)")
        else:
            self.path = resolve_step_dir(os.fspath(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_complete(os.fspath(checkpoint_id))

    def _open(self) -> CheckpointReader:
        """The step's reader, its names indexed. Job mode: the daemon's segments are pinned only while this
        opens and indexes the step, and again inside ``read_data``: a load that fails in DCP's planning
        (which never closes a reader) leaves no pin behind."""
        if self._reader is None:
            if self.job is not None:
                opened = self._open_step()
                try:
                    self._index(opened.reader)
                finally:
                    opened.close()
                self._reader, self.path = opened.reader, opened.reader.path
            else:
                join_all()  # DCP then loads into tensors a client of this process may still be copying
                self._reader = CheckpointReader(self.path)  # type: ignore[arg-type]
                self._index(self._reader)
        return self._reader

    def _open_step(self, step: int | None = None) -> OpenStep:
        client = client_for(self.job, self.endpoint)
        join_all()  # DCP then loads into tensors a client of this process may still be copying
        return open_step(client, self.step if step is None else step, hot=self.hot)  # (this client's copy's error raised)

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = None
        self._tensor_keys, self._values = {}, {}

    def close(self) -> None:
        """Release what the reader holds (``dcp.load`` does, when it has read)."""
        self._close()

    def _index(self, reader: CheckpointReader) -> None:
        placeholders: dict[int, str] = {}
        trees = [r["tree"] for r in reader.manifest["ranks"]]
        as_bytes = set().union(*(keys_tagged(t, "bytes") for t in trees))
        as_numpy = set().union(*(keys_tagged(t, "ndarray") for t in trees))

        def mark(key: str) -> Any:
            # a bytes value or a numpy array: DCP saves and loads these as objects (BYTE_IO), not as tensors
            if key in as_bytes:
                return reader.read_full(key).numpy().tobytes()
            if key in as_numpy:
                return reader.read_full(key).numpy()
            t = torch.empty(0, device="meta")
            placeholders[id(t)] = key
            return t

        def filled(value: Any) -> Any:
            """A value DCP keeps whole (a tuple, and what it holds), its tensors read: no placeholder is loaded."""
            if isinstance(value, torch.Tensor) and id(value) in placeholders:
                return reader.read_full(placeholders[id(value)])
            if isinstance(value, (tuple, list)):
                return type(value)(filled(v) for v in value) if not hasattr(value, "_fields") else type(value)(*map(filled, value))
            if isinstance(value, dict):
                return {k: filled(v) for k, v in value.items()}
            return value

        # every rank's tree: tensors some ranks hold alone (MoE experts), and each rank's extra (extra.<rank>...)
        for r in reader.manifest["ranks"]:
            flat, _ = flatten_state_dict(unflatten(r["tree"], mark))
            for name, value in flat.items():
                if isinstance(value, torch.Tensor) and id(value) in placeholders:
                    self._tensor_keys[name] = placeholders[id(value)]
                elif name not in self._values:
                    self._values[name] = filled(value)
        for key in reader.manifest["tensors"]:
            if key not in as_bytes and key not in as_numpy:
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
        return dataclasses.replace(plan, storage_data={"ckptd_step": self._open().manifest["step"]})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = [p.storage_data.get("ckptd_step") if isinstance(p.storage_data, dict) else None for p in plans]
        if len({s for s in steps if s is not None}) > 1:
            said = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
            raise CheckpointError(
                f"the ranks opened different steps of job {self.job} ({said}): a step completed during the load;"
                " load again, or name one with Reader(job=..., step=N)"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.job is None:
            self._read(self._open(), plan, planner)
        else:
            indexed = self._open().manifest
            step = indexed["step"]
            opened = self._open_step(step)  # the same step again, pinned while this rank reads it
            try:
                if opened.reader.manifest.get("committed_at") != indexed.get("committed_at"):
                    raise CheckpointError(
                        f"step {step} of job {self.job} changed between DCP's planning and the read (dropped from memory,"
                        " or replaced by a rolled-back run's save): load again"
                    )
                self._read(opened.reader, plan, planner)
            finally:
                opened.close()
                self._close()
            self.last_restore = opened.info
            # as after ckptd.restore: this run continues from the step read, and may save the later numbers again
            client_for(self.job, self.endpoint).restored_at(step)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read(self, reader: CheckpointReader, plan: LoadPlan, planner: LoadPlanner) -> None:
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
