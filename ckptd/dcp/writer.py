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
later point still ends in a complete step. A writer made for one save, ``Writer(job, step=N)``, commits
inside ``stage()`` already: killed as soon as ``async_save`` returned, the step still completes.
``dcp.save`` stages and commits inside ``write_data``.

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

import logging
import os
import secrets
import threading
import weakref
from typing import Any

from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..client.api import StagedState, commit_staged, stage_state, wait_step
from ..errors import CheckpointError
from .shared import client_for, step_of

__all__ = ["Writer"]

log = logging.getLogger("ckptd.dcp")

WAIT_POLL_S = 30.0
TOKEN = "__ckptd_staged__"  # the key stage() adds to the state dict it hands back: which staged copy a save commits
MAX_STAGED = 4  # staged copies a writer keeps uncommitted; older ones (their saves failed) are released


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` and ``AsyncStager`` that saves into the node's ckptd daemon.

    ``dcp.save`` / ``dcp.async_save(state, storage_writer=ckptd.dcp.Writer(job), checkpoint_id=str(step))`` stage the state
    into the daemon's shared memory and commit it as step ``checkpoint_id`` of ``job``: an ordinary ckptd step, which
    :func:`ckptd.restore` reads when saved as ``{"model": ..., "optim": ...}`` from ``get_state_dict``, and
    :class:`ckptd.dcp.Reader` reads under the names DCP gave (see :doc:`/integrations`). ``async_save`` calls :meth:`stage`
    on the training thread, a collective over the default group (every rank saves), and returns once the state is copied;
    DCP's thread then plans and calls ``write_data``, which commits, and ``finish`` on the coordinator, which waits until
    the daemon holds every rank's shard and the step is complete in its memory. The checkpoint id is the step.

    Args:
        job: The job (default: as :class:`ckptd.Client`'s, ``CKPTD_JOB``, else one derived from the launch).
        endpoint: The daemon's endpoint (default: ``CKPTD_ENDPOINT``, else the per-user socket).
        step: The step this writer saves, when it is known before the call (a writer per save): ``async_save`` then commits
            inside ``stage()``, so the daemon owns the state by the time ``async_save`` returns (without it, once DCP's
            thread reached ``write_data``, milliseconds later), and ``checkpoint_id`` may be left out.
        durable: Have ``finish`` (so ``dcp.save``, or the future) wait until the step is on the daemon's disk.
        persist_every: The job's memory tier: persist one step in N, as for :class:`ckptd.Client`.
        persist_interval: The job's memory tier: persist the first step T seconds after the last, as for :class:`ckptd.Client`.

    Raises:
        ValueError: ``step`` is not a step number (an int or a string of digits).
        CheckpointError: No job name is given and none can be derived, or the endpoint is not ``ipc://`` or ``tcp://``.
    """

    _synchronize_after_execute = False  # stage() returns once the copy is done: nothing to synchronize

    def __init__(
        self,
        job: str | None = None,
        *,
        endpoint: str | None = None,
        step: int | None = None,
        durable: bool = False,
        persist_every: int | None = None,
        persist_interval: float | None = None,
    ) -> None:
        super().__init__()
        self._client = client_for(job, endpoint)
        self.job = self._client.job
        self.step = None if step is None else step_of(step, "ckptd.dcp.Writer")
        self.durable = durable
        if persist_every is not None or persist_interval is not None:
            self._client.tier(persist_every, persist_interval)
        self._local = threading.local()  # this save's step and role: DCP runs a save on one thread
        self._staged: dict[str, StagedState] = {}  # staged by async_save, by the token in its state dict, until committed
        self._lock = threading.Lock()
        # a writer dropped without close() (one per save, as DCP's examples make them) gives back what a failed save left
        weakref.finalize(self, _release_all, self._staged, self._lock)

    # ------------------------------------------------------------------ AsyncStager

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into the daemon's shared memory now (collective: every rank). Returns it with
        a token naming the copy (DCP plans from the shapes; no data is read again): ``write_data`` commits
        exactly the copy its own save staged."""
        st = stage_state(self._client, state_dict, step=self.step, any_keys=True)
        if self.step is not None:  # the step is known: committed now, the daemon owns the state when async_save returns
            commit_staged(st)
        token = secrets.token_hex(8)
        with self._lock:
            self._staged[token] = st
            stale = list(self._staged)[:-MAX_STAGED]
            stale_states = [self._staged.pop(t) for t in stale]
        for old in stale_states:  # saves that failed between stage and write_data; their slots go back
            log.warning("ckptd.dcp.Writer: a state staged by an earlier async_save was never committed (that save failed?); released")
            old.release()
        return {**state_dict, TOKEN: token}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is done."""

    def close(self) -> None:
        """Give back slots staged by saves that never reached ``write_data`` (a save that failed in between).
        A writer keeps at most the newest few such slots, so closing it matters only to give them back at once."""
        _release_all(self._staged, self._lock)

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
            step = self.step
        if step is None:
            raise CheckpointError("ckptd.dcp.Writer saves a step of a job: pass checkpoint_id=str(step) to dcp.save / dcp.async_save")
        return step

    def _take_staged(self, planner: SavePlanner) -> StagedState | None:
        """The state this save's :meth:`stage` copied (``async_save``), found by its token; ``None`` for ``dcp.save``."""
        flat = getattr(planner, "state_dict", None)
        token = flat.get(TOKEN) if isinstance(flat, dict) else None
        if token is None:
            if self._staged and not isinstance(flat, dict):
                raise CheckpointError(
                    f"ckptd.dcp.Writer finds the state async_save staged through DCP's DefaultSavePlanner; {type(planner).__name__}"
                    " keeps no state_dict: use the default planner"
                )
            return None
        with self._lock:
            st = self._staged.pop(token, None)
        if st is None:
            raise CheckpointError("the state this async_save staged is gone: committed already, or released by Writer.close()")
        return st

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        step = self._step()
        if self.step is not None and step != self.step:
            raise CheckpointError(f"this ckptd.dcp.Writer saves step {self.step}; the save names checkpoint_id {step}")
        st = self._take_staged(planner)
        if st is None:  # dcp.save: stage here (on every rank, DCP's foreground thread)
            st = stage_state(self._client, _state_of(planner), step=None, any_keys=True)
        if not st.done:  # (committed by stage() already when the writer knew its step)
            commit_staged(st, step)
        self._local.step, self._local.saved = None, step  # a later save on this thread names its own step (or fails)
        results = [WriteResult(index=item.index, size_in_bytes=_nbytes(item), storage_data=None) for item in plan.items]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Wait until the step is complete in the daemon (``durable``: on its disk); raise if it failed."""
        saved = getattr(self._local, "saved", None)
        step = self._step() if saved is None else saved
        while True:
            rep = wait_step(self._client, step, persist=self.durable, timeout=WAIT_POLL_S)
            state = rep["state"]
            if state == "durable" or (state in ("memory", "dropped") and not self.durable):
                return  # dropped: a later step is complete already, as the job's memory tier allows
            if state in ("failed", "dropped"):
                raise CheckpointError(f"step {step} of job {self.job} failed: {rep['error']}")

    def storage_meta(self) -> None:
        return None


def _release_all(staged: dict[str, StagedState], lock: threading.Lock) -> None:
    with lock:
        states = list(staged.values())
        staged.clear()
    for st in states:
        st.release()


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
        return {k: v for k, v in flat.items() if k != TOKEN}
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict({k: v for k, v in flat.items() if k != TOKEN}, mappings)


def _nbytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.chunk.sizes:
        n *= s
    return n * item.tensor_data.properties.dtype.itemsize
