"""What only ``optimizer.step()`` mutates (the sources a snapshot copies behind the next step, which the step's
pre-hook waits for), and the watch that catches anything else writing them meanwhile."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedState
from .capture import local_tensor


def storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def torch_optimizer(optim: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer.optimizer``,
    Lightning's ``LightningOptimizer._optimizer``): the one whose ``step()`` runs the pre-hooks that guard a
    background copy, and whose state is the same. Anything else is returned as it is; several optimizers (a
    list, as torch's ``get_state_dict`` takes them) are refused, saying what to do instead."""
    if isinstance(optim, (list, tuple)):
        raise UnsupportedState(
            f"ckptd takes one optimizer per model, got a {type(optim).__name__} of {len(optim)}: snapshot each model with"
            " its own optimizer as a job of its own (Client(job=...)), or pass the others' state_dict() in extra"
        )
    for _ in range(4):
        if optim is None or hasattr(optim, "_optimizer_step_pre_hooks"):
            break
        inner = getattr(optim, "optimizer", None) or getattr(optim, "_optimizer", None)
        if inner is None:
            break
        optim = inner
    return optim


def hookable(optim: Any) -> bool:
    """Whether ``optim.step()`` can be made to wait for a background copy (a ``torch.optim.Optimizer``)."""
    return optim is None or hasattr(optim, "_optimizer_step_pre_hooks")


def optimizer_storages(optim: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> set[int]:
    """Storages that only ``optim.step()`` mutates: its parameters and its state tensors, but for the weights
    of ``model``'s embeddings with ``max_norm``, whose forward renormalizes the rows it looks up in place."""
    out = set()
    for group in optim.param_groups:
        for p in group["params"]:
            out.add(storage_of(local_tensor(p)))
    for st in optim.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.add(storage_of(local_tensor(v)))
    for m in model.modules() if model is not None else ():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None:
            out.discard(storage_of(local_tensor(m.weight)))
    out.discard(0)
    return out


class TornCopy(CheckpointError):
    """A background copy saw its sources written meanwhile: that step is not committed (raised by its handle's
    ``wait()`` only; the client copies before ``snapshot()`` returns from then on)."""


class Watch:
    """The version counters of the tensors a background copy reads, as of the snapshot: an in-place write to one
    by anything but ``optimizer.step()`` (which waits for the copy) while it runs bumps it, and the copy may hold
    bytes of before and after the write. :meth:`check` then fails the snapshot rather than commit a torn step."""

    def __init__(self, keys: list[str], tensors: list[torch.Tensor]) -> None:
        self.keys, self.tensors = keys, tensors
        self.versions = [t._version for t in tensors]

    def check(self, step: int | None) -> None:
        moved = [k for k, t, v in zip(self.keys, self.tensors, self.versions) if t._version != v]
        if moved:
            raise TornCopy(
                f"{len(moved)} tensor(s) of step {step} were written in place while its background copy ran ({', '.join(moved[:4])}"
                f"{', ...' if len(moved) > 4 else ''}): only optimizer.step() waits for the copy, so the step is not committed,"
                " and this client's later snapshots copy before they return, as blocking=True does (what a loop that changes"
                " parameters or optimizer state outside optimizer.step() needs: a clamp after the step, EMA weights swapped"
                " in for evaluation, load_state_dict)"
            )
