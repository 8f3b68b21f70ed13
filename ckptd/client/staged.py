"""Snapshot a state dict as it is given, in two halves: :func:`stage_state` copies it into a slot of the
daemon's now (a collective, blocking, on the training thread), :func:`commit_staged` commits it later,
from any thread, naming the step then if staging did not know it.

``Client.snapshot_state`` (``ckptd import``) runs both at once. The DCP :class:`ckptd.dcp.Writer` stages
inside ``dcp.async_save``'s ``stage`` call — before DCP tells it the checkpoint id, so the slot is leased
for a step the commit names — and commits from DCP's background thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError

if TYPE_CHECKING:
    from .client import Client
    from .handle import SnapshotHandle


@dataclass
class StagedState:
    """A state copied into a leased slot, not committed yet."""

    client: Client
    step: int | None  # None: named by the commit
    segment: str
    fields: dict[str, Any]  # the commit's fields but the step
    tree_json: bytes
    thread: int  # the staging thread's ident
    done: bool = False  # committed or released

    def release(self) -> None:
        """Give the slot back uncommitted (a save that failed after staging)."""
        if not self.done:
            self.done = True
            self.client._release(self.segment)


def stage_state(
    client: Client,
    state: dict[str, Any],
    *,
    step: int | None,
    extra: dict[str, Any] | None = None,
    any_keys: bool = False,
    solo: bool = False,
) -> StagedState:
    """Copy ``state`` into a slot now (collective: every rank, the same ``step``). ``any_keys``: any
    top-level keys (a DCP state dict), else ``{"model": ..., "optim": ...}``. ``solo``: this process
    saves the step alone, as rank 0 of 1 (a framework that saves a replicated state from rank 0 only)."""
    from .options import check_not_saved, check_step, dist_rank_world

    if step is not None:
        check_step(step)
        check_not_saved(client, step)
    with client._snapping:  # one at a time with snapshot(): the copy guard follows one background copy
        prior = client._guard.settle()  # a snapshot()'s background copy of this client ends first; its error, with every rank
        rank, world = (0, 1) if solo else dist_rank_world()
        staged = client._stager.run_state(state, extra, rank, step, any_keys=any_keys, solo=solo, prior=prior)
        segment, _ = client._fill(None, rank, world, step, staged, True)
    try:
        fields = client._commit_fields(rank, world, step, segment, staged)
        tree_json = client._trees.encode(staged.tree)
    except BaseException:
        client._release(segment)
        raise
    return StagedState(client, step, segment, fields, tree_json, threading.get_ident())


def commit_staged(st: StagedState, step: int | None = None) -> SnapshotHandle:
    """Commit what :func:`stage_state` copied as step ``step`` (default: the staged one); any thread.
    Raises :class:`CheckpointError` if the daemon refuses it (the slot is then given back)."""
    from .handle import SnapshotHandle
    from .options import check_not_saved, check_step

    if st.done:
        raise CheckpointError(f"the state staged in {st.segment} was already committed or released")
    step = st.step if step is None else step
    if step is None:
        raise CheckpointError("the step of a staged state must be named when it is committed")
    if st.step is not None and step != st.step:
        raise CheckpointError(f"the state was staged as step {st.step}, not step {step}")
    try:
        check_step(step)
        check_not_saved(st.client, step)
    except (CheckpointError, ValueError):
        st.release()
        raise
    client, st.done = st.client, True
    handle = SnapshotHandle(client, step)
    client._commit_now(handle, {**st.fields, "step": step}, st.tree_json)
    client._pending.track(handle)
    return handle
