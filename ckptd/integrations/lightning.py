"""Lightning: save and resume through ckptd.

    from ckptd.integrations.lightning import CkptdCheckpointIO

    trainer = Trainer(plugins=[CkptdCheckpointIO("my-job")], callbacks=[ModelCheckpoint(save_last=True)])
    trainer.fit(model, ckpt_path="last")

Lightning hands :meth:`CkptdCheckpointIO.save_checkpoint` its whole checkpoint dict (model, optimizers,
schedulers, loops, callbacks) on global rank 0: it is copied into the node daemon's shared memory and
committed as step ``global_step`` of the job, and ``save_checkpoint`` returns — the daemon writes it to
disk (and its bucket) while training goes on, and finishes it if the trainer is killed. At the path
Lightning chose (``epoch=1-step=20.ckpt``, ``last.ckpt``) a small JSON pointer names the job and step, so
``ModelCheckpoint``'s bookkeeping and ``ckpt_path="last"`` work as with files; ``load_checkpoint`` reads the
step the pointer names, on every rank, from the daemon's memory or disk. A second save at one step (``last.ckpt``,
another ``ModelCheckpoint``) points at the first and carries what it changed (callback and loop state:
:mod:`ckptd.integrations.overlay`), so each path loads what Lightning handed for it. A path that holds an ordinary
Lightning checkpoint (a run that started without ckptd) is loaded by Lightning's ``TorchCheckpointIO``.

For strategies that save through ``CheckpointIO`` (one device, DDP, FSDP with a full state dict). A sharded
FSDP / ModelParallel save goes through DCP: use :class:`ckptd.dcp.Writer` there.

Each pointer protects its step from the daemon's retention, by the pointer's path
(:meth:`ckptd.Client.protect`): the top-k files ``ModelCheckpoint`` keeps, however old, stay loadable (the
daemon's ``--keep`` newest steps are kept besides). Removing a pointer (``remove_checkpoint``: a file that
left the top k) lets its step go to retention.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

from ..client.api import commit_staged, stage_state
from ..dcp.shared import client_for
from ..errors import CheckpointError, FormatError
from .overlay import ENTRY_BYTES, SKIP, Record, apply, changed, record
from .pointer import load_pointer, pointer_doc, read_pointer, read_state, write_pointer

log = logging.getLogger("ckptd.integrations")

__all__ = ["CkptdCheckpointIO"]


class CkptdCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through the node's ckptd daemon: ``Trainer(plugins=[CkptdCheckpointIO(job)])``.

    For strategies that save through ``CheckpointIO`` (one device, DDP, FSDP with a full state dict); a sharded FSDP /
    ModelParallel save goes through DCP (:class:`ckptd.dcp.Writer`). Each pointer it writes protects its step from the
    daemon's retention by the pointer's path (:meth:`ckptd.Client.protect`), so the top-k files ``ModelCheckpoint`` keeps
    stay loadable however old they are. See :doc:`/integrations`.

    Args:
        job: The job (default: as :class:`ckptd.Client`'s, ``CKPTD_JOB``, else one derived from the launch).
        endpoint: The daemon's endpoint (default: ``CKPTD_ENDPOINT``, else the per-user socket).
        durable: Have ``save_checkpoint`` return once the step is on the daemon's disk (default: once the daemon holds it).
        persist_every: The job's memory tier: persist one step in N, as for :class:`ckptd.Client`.
        persist_interval: The job's memory tier: persist the first step T seconds after the last, as for :class:`ckptd.Client`.
    """

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
        self.job, self.endpoint, self.durable = job, endpoint, durable
        self._tiering = (persist_every, persist_interval)
        # steps this process saved, with the keys saved: a second path for one (last.ckpt) is a pointer only
        self._steps: dict[int, frozenset[str]] = {}
        self._first: Record | None = None  # the newest step's first save, which later saves of that step point at

    @property
    def client(self) -> Any:
        c = client_for(self.job, self.endpoint)
        if self._tiering != (None, None):
            c.tier(*self._tiering)
        return c

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save Lightning's checkpoint dict as step ``global_step`` of the job and write a pointer to it at ``path``.

        Lightning calls it on global rank 0. The dict is copied into the daemon's shared memory and committed, and this returns
        while the daemon persists it. A second save at the same step (``last.ckpt``, another ``ModelCheckpoint``) points at
        the first and carries what its callback and loop state changed.

        Args:
            checkpoint: Lightning's whole checkpoint dict (model, optimizers, schedulers, loops, callbacks).
            path: Where Lightning wants the file (``epoch=1-step=20.ckpt``, ``last.ckpt``): a small JSON pointer to the step.
            storage_options: Must be ``None``: the daemon's configuration says where the step goes.

        Raises:
            CheckpointError: ``global_step`` is not a step number, the step was saved already without some of these keys (a
                weights-only save first), or the pointer cannot be written at ``path``.
            ProtocolError: The daemon refused to protect the step.
            TypeError: ``storage_options`` was given.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (the daemon's config says where it goes)")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"a Lightning checkpoint names its step in 'global_step'; this one has {step!r}")
        client = self.client
        overlay: list[Any] = []
        if step not in self._steps:
            handle = commit_staged(stage_state(client, checkpoint, step=step, any_keys=True, solo=True))
            self._steps[step], self._first = frozenset(checkpoint), record(step, checkpoint)
            if self.durable:
                handle.wait()
        else:
            overlay = self._changes(step, checkpoint, os.fspath(path))
        doc = pointer_doc(path, client.job, step, overlay)  # one that cannot be written is refused before protecting
        client.protect(step, os.path.abspath(path))  # first: no pointer ever names a step retention may remove
        write_pointer(path, client.job, step, doc=doc)

    def _changes(self, step: int, checkpoint: dict[str, Any], path: str) -> list[Any]:
        """What a later save of ``step`` changed, for its pointer; refused if that cannot be carried."""
        first = self._first if self._first is not None and self._first.step == step else None  # None: saved before a resume
        overlay, too_large = changed(first, checkpoint) if first is not None else ([], [])
        new = set(checkpoint) - self._steps[step]
        if lacking := sorted(k for k in new if first is None or k in SKIP or any(p[0] == k for p in too_large)):
            # a weights-only save came first at this step: a pointer to it would lose the rest on resume
            raise CheckpointError(
                f"step {step} was saved already without {lacking} (a save_weights_only checkpoint at the same"
                f" global_step?): ckptd keeps one checkpoint per step, and {path} would point to it."
                " Let the weights-only ModelCheckpoint save at other steps, or save the full state first"
            )
        if too_large:
            log.warning(
                "%s: %s changed since the first save of step %s but hold over %s bytes of tensors: loading it gives"
                " the first save's", path, ", ".join("/".join(p) for p in too_large), step, ENTRY_BYTES,
            )  # fmt: skip
        return overlay

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint at ``path``: the step a pointer names, on every rank, or an ordinary Lightning checkpoint.

        Args:
            path: A pointer this plugin wrote (read through the daemon: its memory, disk or bucket), or a file Lightning wrote
                itself (a run that started without ckptd), which Lightning's ``TorchCheckpointIO`` loads.
            map_location: Ignored: a step is read onto the CPU.
            weights_only: Passed to ``TorchCheckpointIO`` for an ordinary Lightning checkpoint.

        Returns:
            The checkpoint dict Lightning handed for this path.

        Raises:
            FormatError: ``path`` holds a malformed pointer.
            CheckpointError: The step cannot be read (gone, or its daemon failed), naming why.
        """
        pointer = load_pointer(path)
        if pointer is None:  # an ordinary Lightning checkpoint: Lightning reads it
            from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

            return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only)
        job, step = pointer["job"], pointer["step"]
        client = client_for(job, self.endpoint)
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        state = apply(read_state(client, step, rank), pointer.get("overlay", []), os.fspath(path))
        self._steps.clear()  # a relaunch that resumed may save the steps after this one again
        self._first = None
        return state

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the file at ``path``; a pointer's step is then left to the daemon's retention (unprotected).

        Args:
            path: The file ``ModelCheckpoint`` no longer keeps (one that left the top k). If the daemon cannot let its step
                go, the step stays protected (kept, never lost), with a warning.
        """
        path = os.fspath(path)
        try:
            pointer = read_pointer(path)
        except (OSError, FormatError):
            pointer = None
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        if pointer is not None:
            try:
                client_for(pointer[0], self.endpoint).unprotect(os.path.abspath(path))
            except CheckpointError as e:  # the step stays protected: kept, never lost
                log.warning("%s removed, but its step %s of job %s stays protected from retention: %s", path, pointer[1], pointer[0], e)
