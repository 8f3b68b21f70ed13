"""torchtitan: its ``CheckpointManager``, saving through :class:`ckptd.dcp.Writer` and resuming through
:class:`ckptd.dcp.Reader`.

    from ckptd.integrations.torchtitan import CkptdCheckpointManager

    checkpoint = CkptdCheckpointManager.Config(enable=True, interval=500, async_mode="async", job="my-job")

torchtitan builds the manager from that config (``Configurable``): its saves (``dcp.save`` /
``dcp.async_save`` of the model, optimizers, LR schedulers, data loader and train state, every ``interval``
steps) go to the node's daemon as step ``<step>`` of the job instead of ``<folder>/step-<step>``, and
``load()`` resumes from the newest step the daemon holds (one still being persisted, or in the memory tier
only, is persisted and waited for first; rank 0 decides, every rank loads that step), or ``load_step``.
torchtitan's last save is model-only by default (``last_save_model_only``): a job resumed after its last
step fails on the missing optimizer state, as torchtitan's own folder would. torchtitan's
``keep_latest_k`` purge has nothing to delete: the daemon's retention keeps steps (it must be 0). Saves
torchtitan converts to Hugging Face format (``last_save_in_hf``) still go to its folder, as torchtitan
writes them. ``async_mode="async_with_pinned_mem"`` (DCP's process mode) is refused: ``"async"`` stages
into the daemon's shared memory already. Written against torchtitan 0.3.0, whose method names it overrides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

from ..dcp import Reader, Writer
from ..dcp.shared import client_for, rank0_step, resume_step

__all__ = ["CkptdCheckpointManager"]


class CkptdCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with ckptd as its storage; torchtitan builds it from :class:`Config`.

    Saves (``dcp.save`` / ``dcp.async_save`` every ``interval`` steps) go to the node's daemon as step ``<step>`` of the
    job, through a :class:`ckptd.dcp.Writer` that knows its step; ``load()`` resumes from the newest step the daemon holds
    (rank 0 decides, every rank loads it), or ``load_step``, through :class:`ckptd.dcp.Reader`. See :doc:`/integrations`.

    Args:
        config: Its :class:`Config`: torchtitan's ``CheckpointManager.Config`` with ``job`` and ``endpoint``;
            ``keep_latest_k`` must be 0 and ``async_mode`` may not be ``"async_with_pinned_mem"`` (``ValueError``).
        **kwargs: Passed to torchtitan's ``CheckpointManager`` as they are (its data loader, model parts, optimizers...).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        job: str | None = None
        """The ckptd job name (default ``CKPTD_JOB``, else one derived from the launch)."""

        endpoint: str | None = None
        """The daemon's endpoint (default ``CKPTD_ENDPOINT``, else the per-user socket)."""

        keep_latest_k: int = 0
        """Must stay 0, as the daemon's retention keeps steps."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.keep_latest_k != 0:
                raise ValueError("CkptdCheckpointManager: keep_latest_k must be 0 (the ckptd daemon's retention keeps steps)")
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise ValueError(
                    'CkptdCheckpointManager: async_mode "async_with_pinned_mem" is DCP\'s process mode; use "async"'
                    " (it stages into the daemon's shared memory)"
                )

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.job, self.endpoint = config.job, config.endpoint

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf:  # a Hugging Face export of the last step: torchtitan writes it to its folder
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = _step_of(checkpoint_id)
        writer = Writer(self.job, endpoint=self.endpoint, step=step)  # commits inside async_save: kill-safe at its return
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)
            return None
        return dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=step, process_group=self.pg)

    def _load(self, step: int = -1) -> bool:
        client = client_for(self.job, self.endpoint)
        # rank 0 decides, every rank loads that step: the daemon may still be persisting the newest one
        newest = rank0_step(lambda: resume_step(client)) if step == -1 else step
        if newest is None:  # the job has no step: a fresh start, or torchtitan's initial_load_path
            return super()._load(step)
        states = self._states_to_load(model_only=newest == 0)
        dcp.load(states, storage_reader=Reader(job=self.job, endpoint=self.endpoint, step=newest))
        if MODEL in self.states:  # as torchtitan's own load: its model state is loaded through its wrapper
            self.states[MODEL].load_state_dict(states)
        return True


def _step_of(checkpoint_id: str) -> int:
    m = re.search(r"step-(\d+)$", str(checkpoint_id))
    if m is None:
        raise ValueError(f"CkptdCheckpointManager: {checkpoint_id!r} does not name a step (torchtitan's <folder>/step-<N>)")
    return int(m.group(1))
