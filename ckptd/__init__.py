"""ckptd: a per-node asynchronous checkpoint daemon for PyTorch training.

The module-level functions use one default :class:`Client` per process, configured by
``CKPTD_ENDPOINT`` and ``CKPTD_JOB``; create a :class:`Client` to choose them explicitly.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import CheckpointError, DaemonUnavailable, FormatError, ProtocolError, StepDropped, StepUnknown  # noqa: E402

if TYPE_CHECKING:
    import torch

    from .client import Client, Restored, SnapshotHandle


def __getattr__(name: str) -> Any:
    # torch is imported on first use, so `ckptd serve` (which never touches tensors) starts fast and small
    if name in ("Client", "SnapshotHandle", "Restored"):
        from . import client

        return getattr(client, name)
    if name == "dcp":  # ckptd.dcp.Reader: a torch.distributed.checkpoint StorageReader
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module 'ckptd' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "Client",
    "DaemonUnavailable",
    "FormatError",
    "ProtocolError",
    "StepDropped",
    "StepUnknown",
    "Restored",
    "SnapshotHandle",
    "latest",
    "prepare",
    "restore",
    "snapshot",
    "wait",
]

_default: Client | None = None
_default_lock = threading.Lock()


def _client() -> Client:
    global _default
    with _default_lock:
        if _default is None:
            from .client import Client

            _default = Client()
        return _default


def snapshot(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    blocking: bool = False,
) -> SnapshotHandle:
    """Checkpoint ``model`` and ``optim`` as of this call; see :meth:`Client.snapshot`."""
    return _client().snapshot(model, optim, step=step, extra=extra, blocking=blocking)


def prepare(model: torch.nn.Module, optim: torch.optim.Optimizer | None = None, *, slots: int | None = None) -> None:
    """Move the first snapshot's allocation out of the loop; see :meth:`Client.prepare` (``slots``: two,
    three with a memory tier)."""
    _client().prepare(model, optim, slots=slots)


def wait(timeout: float | None = None) -> list[str]:
    """Wait until every snapshot of this process is durable; return their directories."""
    return _client().wait(timeout)


def restore(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    path: str | None = None,
    hot: bool = True,
    strict: bool = True,
    dtype: torch.dtype | None = None,
) -> Restored:
    """Load the newest committed step (or ``step``, or ``path``) in place; return ``extra``; see
    :meth:`Client.restore` for ``strict`` and ``dtype``.

    The daemon's shared memory is read instead of the disk while it still holds the step (``hot``)."""
    if path is not None and _default is None:
        from .client.copy import join_all
        from .client.load import restore_state
        from .client.options import dist_rank_world

        join_all()  # a Client(job=...)'s background copy of these tensors ends first
        return restore_state(path, model, optim, dist_rank_world()[0], strict=strict, dtype=dtype)  # no daemon needed
    return _client().restore(model, optim, step=step, path=path, hot=hot, strict=strict, dtype=dtype)


def latest() -> int | None:
    """The newest committed step of this job (asks the daemon), or ``None``."""
    return _client().latest()
