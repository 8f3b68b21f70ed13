"""Hugging Face ``transformers.Trainer``: checkpoint through ckptd, resume with ``resume_from_checkpoint``.

    from ckptd.integrations.hf import CkptdCallback

    ckpt = CkptdCallback("my-job", save_steps=500)
    args = TrainingArguments(output_dir, save_strategy="no", ...)   # the Trainer's own saving off
    trainer = Trainer(model, args, train_dataset=..., callbacks=[ckpt])
    ckpt.bind(trainer)   # with other stateful callbacks (EarlyStoppingCallback): their state goes in the snapshots
    trainer.train(resume_from_checkpoint=ckpt.resume_checkpoint(args.output_dir))   # None: a fresh start

Every ``save_steps`` optimizer steps a ``ckptd.snapshot`` is taken of the model and optimizer, when the next step
begins (:meth:`CkptdCallback.on_step_begin`; the run's last one at :meth:`on_train_end`): after the Trainer logged
and evaluated that step and, at an epoch's end, started the next epoch's data loader, as its own checkpoint would
be (on every rank; the default mode: on a GPU the copy overlaps the next forward and backward), with the LR
scheduler's state, the ``TrainerState``, the RNG states and, under fp16 AMP, the gradient scaler's state (loss
scale and growth tracker: the Trainer's own ``scaler.pt``) as ``extra``: step ``global_step`` of the job. Nothing
is written under ``output_dir`` while training.

Resuming: the Trainer loads ``resume_from_checkpoint`` from a checkpoint directory — at least a model
weights file and ``trainer_state.json``, from which it fast-forwards the data loader. :meth:`resume_checkpoint`
writes that directory once, at the restart, for the newest step of the job (``checkpoint-<step>``: the
model's weights as ``model.safetensors``, ``trainer_state.json`` and a ``ckptd.json`` pointer; each a new file
renamed into place, so a link planted there is replaced, never written through, and a link in the directory's
place is refused). Then
:meth:`on_train_begin` restores the model, the optimizer, the scheduler and the gradient scaler in place
from the ckptd step itself (the optimizer never goes through a file), and the RNG states are restored where they
were taken, when the first step after the resume begins. fp16 turned off at the restart: the step's
scaler state is not used (logged at INFO). Turned on, from a step without scaler state: the scaler starts
afresh from its ``init_scale``, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import secrets
import stat
import warnings
import weakref
from collections.abc import Callable
from typing import IO, Any

import numpy as np
import torch
from transformers import TrainerCallback

from ..dcp.shared import client_for, rank0_step
from .pointer import pointer_doc, read_pointer

__all__ = ["CkptdCallback"]

POINTER = "ckptd.json"

log = logging.getLogger("ckptd.integrations")


def _inner(obj: Any, attr: str) -> Any:
    """The torch optimizer / scheduler inside accelerate's wrapper."""
    return getattr(obj, attr, obj)


def _scaler(optimizer: Any) -> Any:
    """The AMP gradient scaler accelerate steps the optimizer with (``AcceleratedOptimizer.scaler``: fp16 AMP);
    ``None`` without one, or when it is disabled (its state is then empty)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not callable(getattr(scaler, "state_dict", None)):
        return None
    enabled = getattr(scaler, "is_enabled", None)
    return None if callable(enabled) and not enabled() else scaler


def _restore_scaler(scaler: Any, saved: dict[str, Any] | None, job: str, step: int) -> None:
    if scaler is not None and saved is not None:
        scaler.load_state_dict(saved)
    elif saved is not None:  # fp16 off now: fp32 weights need no loss scale
        log.info("job %s step %s was saved under fp16 AMP; this run has no gradient scaler: its state is not used", job, step)
    elif scaler is not None:
        warnings.warn(
            f"job {job} step {step} has no gradient scaler state (saved without fp16 AMP, or by a ckptd that did not keep it):"
            f" the loss scale starts afresh at {scaler.get_scale()}",
            stacklevel=2,  # named at on_train_begin
        )


def _rng() -> dict[str, Any]:
    out: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng(rng: dict[str, Any]) -> None:
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(rng["numpy"]))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


class CkptdCallback(TrainerCallback):
    """A Hugging Face ``TrainerCallback`` that checkpoints the run through ckptd: ``Trainer(..., callbacks=[CkptdCallback(job)])``.

    Every ``save_steps`` steps it takes a ``ckptd.snapshot`` of the model and optimizer (on every rank) when the next step
    begins, with the LR scheduler, the ``TrainerState``, the RNG states and, under fp16 AMP, the gradient scaler's state as
    ``extra``: step ``global_step`` of the job. Turn the Trainer's own saving off (``save_strategy="no"``); resume with
    :meth:`resume_checkpoint`. See :doc:`/integrations`.

    Args:
        job: The job (default: as :class:`ckptd.Client`'s, ``CKPTD_JOB``, else one derived from the launch).
        save_steps: Snapshot every this many optimizer steps, an int >= 1 (default: the ``TrainingArguments``' ``save_steps``).
        endpoint: The daemon's endpoint (default: ``CKPTD_ENDPOINT``, else the per-user socket).
        blocking: Take each snapshot with ``blocking=True``.

    Raises:
        ValueError: ``save_steps`` is not an int >= 1.
    """

    def __init__(
        self, job: str | None = None, *, save_steps: int | None = None, endpoint: str | None = None, blocking: bool = False
    ) -> None:
        if save_steps is not None and (isinstance(save_steps, bool) or not isinstance(save_steps, int) or save_steps < 1):
            raise ValueError(f"save_steps must be an int >= 1, got {save_steps!r}")
        self.job, self.endpoint, self.save_steps, self.blocking = job, endpoint, save_steps, blocking
        self.last: Any = None  # the newest SnapshotHandle
        self._rng: dict[str, Any] | None = None  # RNG states to restore before the first step after a resume
        self._resume_step: int | None = None  # the step resume_checkpoint() chose (on every rank)
        self._due: int | None = None  # a step that ended due for a snapshot, taken when the next one begins
        self._handler: Any = None  # a weak reference to the bound Trainer's callback handler (bind())

    def bind(self, trainer: Any) -> CkptdCallback:
        """Carry the state of the Trainer's stateful callbacks in every snapshot, as the Trainer's own checkpoints do.

        Stateful callbacks are ``ExportableState`` ones, such as ``EarlyStoppingCallback``'s patience counter. A callback gets
        no reference to its Trainer, so call this once after making it; without it the callback warns at the start of
        training, naming the stateful callbacks it cannot carry. The Trainer puts them back on a resume when
        ``restore_callback_states_from_checkpoint=True``.

        Args:
            trainer: The ``transformers.Trainer`` this callback was given to.

        Returns:
            This callback.
        """
        self._handler = weakref.ref(trainer.callback_handler)
        return self

    @property
    def client(self) -> Any:
        return client_for(self.job, self.endpoint)

    def _every(self, args: Any) -> int:
        if self.save_steps is not None:
            return self.save_steps
        every = args.save_steps
        if not isinstance(every, int) or every < 1:  # a fraction of the run, or unset
            raise ValueError(f"CkptdCallback needs save_steps (an int >= 1): TrainingArguments.save_steps is {every!r}")
        return every

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step % self._every(args) == 0:
            # taken when the next step begins: the Trainer logs, evaluates (a new best metric, the eval loader's RNG
            # draw) and, at an epoch's end, starts the next epoch's loader after on_step_end; its own checkpoint
            # holds all of that, and the resume puts the RNG back exactly there (on_step_begin)
            self._due = state.global_step

    def _snapshot(self, state: Any, control: Any, model: Any = None, optimizer: Any = None, lr_scheduler: Any = None, **kw: Any) -> None:
        trainer_state = _state_dict(state)
        handler = self._handler() if self._handler is not None else None
        trainer_state["stateful_callbacks"] = _stateful(handler, control, trainer_state.get("stateful_callbacks") or {})
        extra = {
            "trainer_state": json.dumps(trainer_state),
            "scheduler": _inner(lr_scheduler, "scheduler").state_dict() if lr_scheduler is not None else None,
            "rng": _rng(),
        }
        if (scaler := _scaler(optimizer)) is not None:
            extra["scaler"] = scaler.state_dict()  # floats and ints (the scale read back from the device)
        self.last = self.client.snapshot(model, _inner(optimizer, "optimizer"), step=state.global_step, extra=extra, blocking=self.blocking)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._due is not None:  # the run's last step: no next step begins
            self._due = None
            self._snapshot(state, control, **kw)
        self.client.wait()  # every snapshot of the run durable before train() returns

    def resume_checkpoint(self, output_dir: str | os.PathLike[str]) -> str | None:
        """Write ``output_dir/checkpoint-<step>`` for the newest step of the job, for the Trainer to resume from.

        Call it on every rank, at the restart: rank 0 picks the step and writes the directory once (``model.safetensors``,
        ``trainer_state.json`` and a ``ckptd.json`` pointer, each a new file renamed into place), every rank then resumes that
        step. The model, optimizer, scheduler and gradient scaler are then restored in place from the ckptd step itself
        (``on_train_begin``), and the RNG states when the first step begins.

        Args:
            output_dir: The ``TrainingArguments``' ``output_dir``.

        Returns:
            The directory to pass as ``trainer.train(resume_from_checkpoint=...)``, or ``None`` if the job has no step yet.

        Raises:
            CheckpointError: The newest step was not saved by ``CkptdCallback``, or ``checkpoint-<step>`` is a link or not a
                directory.
        """
        step = rank0_step(lambda: self._write_resume_dir(os.fspath(output_dir)))
        self._resume_step = step
        return None if step is None else os.path.join(os.fspath(output_dir), f"checkpoint-{step}")

    def _write_resume_dir(self, output_dir: str) -> int | None:
        """Write ``checkpoint-<step>`` for the newest step; return the step (``None``: the job has none)."""
        from ..client.api import open_step
        from ..errors import CheckpointError

        client = self.client
        try:
            opened = open_step(client, None, hot=True)
        except CheckpointError as e:
            if "no committed checkpoint" in str(e):
                return None
            raise
        try:
            step = opened.reader.manifest["step"]
            _, tree = opened.reader.tree_for(0)
            extra = (tree.get("extra") or {}).get("0") or {}
            if "trainer_state" not in extra:
                raise CheckpointError(f"step {step} of job {client.job} was not saved by CkptdCallback: it has no trainer state")
            out = os.path.join(output_dir, f"checkpoint-{step}")
            os.makedirs(output_dir, exist_ok=True)
            # every file is made through this descriptor: output_dir may be one others can write into (a shared
            # scratch), and a link planted there (trainer_state.json -> ~/.bashrc) must never be written through
            dfd = _open_resume_dir(out)
            try:
                if read_pointer_at(out) == (client.job, step):
                    return step  # written by an earlier attempt at this restart
                keys = [k for k in opened.reader.manifest["tensors"] if k.startswith("model/")]
                _replace_at(dfd, out, "model.safetensors", lambda f: _write_weights(f, opened.reader, keys))
                _replace_at(dfd, out, "trainer_state.json", lambda f: f.write(extra["trainer_state"].encode()))
                doc = pointer_doc(os.path.join(out, POINTER), client.job, step).encode()
                _replace_at(dfd, out, POINTER, lambda f: f.write(doc), mode=0o644)  # last: the directory is complete
                os.fsync(dfd)
            finally:
                os.close(dfd)
            return step
        finally:
            opened.close()

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, lr_scheduler: Any = None, **kw: Any
    ) -> None:
        others = sorted(set(getattr(state, "stateful_callbacks", None) or {}) - {"TrainerControl"})
        if others and self._handler is None:
            warnings.warn(
                f"{', '.join(others)} keep state the snapshots do not carry (a resume starts them afresh): call"
                " CkptdCallback.bind(trainer) once after making the Trainer",
                stacklevel=2,
            )
        if self._resume_step is not None:  # resume_checkpoint() in this process: the step every rank agreed on
            (job, step), self._resume_step = (self.client.job, self._resume_step), None
        else:
            pointer = read_pointer_at(os.path.join(args.output_dir, f"checkpoint-{state.global_step}")) if state.global_step else None
            if pointer is None:
                return  # a fresh start, or a resume from a checkpoint the Trainer wrote itself
            job, step = pointer
        if state.global_step != step:
            from ..errors import CheckpointError

            raise CheckpointError(f"the Trainer resumes at step {state.global_step}, but ckptd's step to restore is {step}")
        client = client_for(job, self.endpoint)
        extra = client.restore(model, _inner(optimizer, "optimizer"), step=step)
        if lr_scheduler is not None and extra.get("scheduler") is not None:
            _inner(lr_scheduler, "scheduler").load_state_dict(extra["scheduler"])
        _restore_scaler(_scaler(optimizer), extra.get("scaler"), job, step)
        self._rng = extra.get("rng")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._rng is not None:  # where the step's snapshot was taken: after the data was fast-forwarded
            _set_rng(self._rng)
            self._rng = None
        if self._due is not None:  # the step that ended last (global_step still names it): see on_step_end
            self._due = None
            self._snapshot(state, control, **kw)


def _open_resume_dir(out: str) -> int:
    """``out`` (made if missing) open as a directory; a link (or anything else) in its place is refused, not followed."""
    from ..errors import CheckpointError

    with contextlib.suppress(FileExistsError):
        os.mkdir(out)
    try:
        return os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW with O_DIRECTORY: ENOTDIR for a link
            raise
        what = "a symbolic link" if os.path.islink(out) else "not a directory"
        raise CheckpointError(
            f"{out} is {what}: ckptd writes the Trainer's resume directory there itself, never through a link; remove it"
        ) from None


def _replace_at(dfd: int, where: str, name: str, write: Callable[[IO[bytes]], object], mode: int | None = None) -> None:
    """Make ``name`` in directory ``dfd`` (``where``, for messages): a new file under a fresh name (O_EXCL), written
    by ``write``, fsynced, renamed over ``name``. A link planted at ``name`` is replaced, its target untouched."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if mode is not None:
                os.fchmod(fd, mode)
            os.fsync(fd)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                log.warning("%s was a symbolic link: replaced by a file, its target left as it was", os.path.join(where, name))
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def _write_weights(f: IO[bytes], reader: Any, keys: list[str]) -> None:
    """The step's tensors ``keys`` (``model/<fqn>``) as a safetensors file of FQNs, one tensor in memory at a time
    (``save_file`` takes a path, which could be a planted link, and every tensor at once)."""
    from ..client.api import write_safetensors
    from ..format import itemsize

    ents = reader.manifest["tensors"]
    keys = sorted(keys, key=lambda k: (-itemsize(ents[k]["dtype"]), k))  # larger elements first, as save_file: each one aligned
    write_safetensors(reader, {k: k.removeprefix("model/") for k in keys}, f, {"format": "pt"}, lambda done: None, 0)


def read_pointer_at(directory: str) -> tuple[str, int] | None:
    path = os.path.join(directory, POINTER)
    return read_pointer(path) if os.path.isfile(path) else None


def _stateful(handler: Any, control: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """``TrainerState.stateful_callbacks`` as of now, as the Trainer writes it at a save: each ``ExportableState``
    callback's ``state()`` by class name (a list for several of one class), ``TrainerControl``'s included. Without a
    bound handler the other callbacks' entries stay as the state holds them (from the start of training)."""
    from transformers.trainer_callback import ExportableState

    callbacks = [*(handler.callbacks if handler is not None else []), control]
    out = {k: v for k, v in saved.items() if handler is None}
    groups: dict[str, list[Any]] = {}
    for cb in callbacks:
        if isinstance(cb, ExportableState):
            groups.setdefault(type(cb).__name__, []).append(cb.state())
    out.update({name: states[0] if len(states) == 1 else states for name, states in groups.items()})
    return out


def _state_dict(state: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(state)
