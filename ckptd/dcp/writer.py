"""``ckptd.dcp.Writer``: ``dcp.save`` and ``dcp.async_save`` into the node daemon.

    writer = ckptd.dcp.Writer("my-job")
    dcp.save(state, storage_writer=writer, checkpoint_id=str(step))            # blocking
    fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=str(step))  # returns after the copy

The writer is a ``StorageWriter`` and an ``AsyncStager``. ``dcp.async_save`` calls :meth:`Writer.stage`
on the training thread: the state is copied into a slot of the daemon's shared memory there (the copy
``ckptd.snapshot(blocking=True)`` makes, a collective over the default group: every rank saves), so the
state saved is the state at the call and training may change it as soon as ``async_save`` returns.
DCP's background thread then runs its planning and :meth:`Writer.write_data`, which commits the slot as
step ``checkpoint_id`` of the job — from then on the daemon owns the bytes: a trainer killed at any
later point still ends in a complete step. ``dcp.save`` stages and commits inside ``write_data``.

The saved step is an ordinary ckptd step: the state dict is stored as it was given (after DCP called
``state_dict()`` on its ``Stateful`` values), its tensors keyed by their path, ``DTensor`` /
``ShardedTensor`` chunks by global offsets, replicated tensors written once. ``ckptd.restore(model,
optim)`` loads it when it was saved as ``{"model": ..., "optim": ...}`` the way ``get_state_dict`` gives
them; :class:`ckptd.dcp.Reader` loads any of it under the names DCP gave.

``finish`` (on the coordinator, before ``dcp.save`` returns or the future resolves) waits until the daemon
holds every rank's shard and the step is complete in its memory; ``durable=True`` waits until it is on the
daemon's disk. The step becomes ``latest`` only once durable, as every ckptd step.

Not supported: ``async_checkpointer_type=PROCESS`` (the copy is made already: a process adds nothing
and this writer's lease cannot move to another process), and a planner other than
``DefaultSavePlanner`` (or a subclass) with ``dcp.save``: ``write_data`` reads the state from it.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any

from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..client.staged import StagedState, commit_staged, stage_state
from ..errors import CheckpointError
from .shared import client_for, step_of

__all__ = ["Writer"]

WAIT_POLL_S = 30.0


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that saves step ``checkpoint_id`` of ``job`` through the
    node's ckptd daemon. ``job`` / ``endpoint`` default as :class:`ckptd.Client`'s (``CKPTD_JOB``,
    ``CKPTD_ENDPOINT``). ``persist_every`` / ``persist_interval``: the job's tiering, as for ``Client``."""

    _synchronize_after_execute = False  # stage() returns once the copy is done: nothing to synchronize

    def __init__(
        self,
        job: str | None = None,
        *,
        endpoint: str | None = None,
        durable: bool = False,
        persist_every: int | None = None,
        persist_interval: float | None = None,
    ) -> None:
        super().__init__()
        self._client = client_for(job, endpoint)
        self.job = self._client.job
        self.durable = durable
        if persist_every is not None or persist_interval is not None:
            from ..client.client import tier_settings

            self._client._tiering = tier_settings(persist_every, persist_interval)
        self._local = threading.local()  # this save's step and role: DCP runs a save on one thread
        self._staged: deque[StagedState] = deque()  # staged by async_save, in order, until write_data commits
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ AsyncStager

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the daemon's shared memory now (collective: every rank). Returns it as
        given: DCP plans from its shapes; its data is not read again."""
        st = stage_state(self._client, state_dict, step=None, any_keys=True)
        with self._lock:
            self._staged.append(st)
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is done."""

    def close(self) -> None:
        """Give back slots staged by saves that never reached ``write_data`` (a save that failed in between)."""
        with self._lock:
            staged, self._staged = list(self._staged), deque()
        for st in staged:
            st.release()

    def __getstate__(self) -> dict[str, Any]:
        raise CheckpointError(
            "ckptd.dcp.Writer cannot move to another process: use dcp.async_save's default thread mode"
            " (the state is copied into the daemon's memory already, a process adds nothing)"
        )

    # ------------------------------------------------------------------ StorageWriter

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._local.step = None if checkpoint_id is None else step_of(checkpoint_id, "ckptd.dcp.Writer")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            step_of(checkpoint_id, cls.__name__)
        except ValueError:
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._local.coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def _step(self) -> int:
        step = getattr(self._local, "step", None)
        if step is None:
            raise CheckpointError("ckptd.dcp.Writer saves a step of a job: pass checkpoint_id=str(step) to dcp.save / dcp.async_save")
        return step

    def _take_staged(self) -> StagedState | None:
        """The oldest state :meth:`stage` copied on another thread (``async_save``'s): this save's."""
        me = threading.get_ident()
        with self._lock:
            for st in self._staged:
                if st.thread != me:
                    self._staged.remove(st)
                    return st
        return None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        step = self._step()
        st = self._take_staged()
        if st is None:  # dcp.save: stage here (on every rank, DCP's foreground thread)
            st = stage_state(self._client, _state_of(planner), step=None, any_keys=True)
        commit_staged(st, step)
        results = [WriteResult(index=item.index, size_in_bytes=_nbytes(item), storage_data=None) for item in plan.items]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Wait until the step is complete in the daemon (``durable``: on its disk); raise if it failed."""
        step, rpc = self._step(), self._client._rpc
        while True:
            rep = rpc.call("wait", rpc_timeout=rpc.timeout + WAIT_POLL_S + 5.0, job=self.job, step=step,
                           timeout=WAIT_POLL_S, persist=self.durable)  # fmt: skip
            state = rep["state"]
            if state == "durable" or (state in ("memory", "dropped") and not self.durable):
                return  # dropped: a later step is complete already, as the job's memory tier allows
            if state in ("failed", "dropped"):
                raise CheckpointError(f"step {step} of job {self.job} failed: {rep['error']}")

    def storage_meta(self) -> None:
        return None


def _state_of(planner: SavePlanner) -> dict[str, Any]:
    """The state dict ``dcp.save`` gave, nested again, from DCP's default planner."""
    flat = getattr(planner, "state_dict", None)
    if not isinstance(flat, dict):
        raise CheckpointError(
            f"ckptd.dcp.Writer reads the state from DCP's DefaultSavePlanner; {type(planner).__name__} has none:"
            " use the default planner, or dcp.async_save (which hands the writer the state directly)"
        )
    mappings = getattr(planner, "mappings", None)
    if not mappings:
        return flat
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict(flat, mappings)


def _nbytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.chunk.sizes:
        n *= s
    return n * item.tensor_data.properties.dtype.itemsize
