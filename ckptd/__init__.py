"""ckptd: a per-node asynchronous checkpoint daemon for PyTorch training.

The module-level functions use one default :class:`Client` per process, configured by
``CKPTD_ENDPOINT`` and ``CKPTD_JOB``; create a :class:`Client` to choose them explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    DaemonBusy,
    DaemonUnavailable,
    DiskFull,
    FormatError,
    HeldInMemory,
    ProtocolError,
    StepDropped,
    StepUnknown,
    UnsupportedState,
)  # fmt: skip
from .version import __version__ as __version__

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
    "DaemonBusy",
    "DaemonUnavailable",
    "DiskFull",
    "FormatError",
    "ProtocolError",
    "StepDropped",
    "HeldInMemory",
    "StepUnknown",
    "UnsupportedState",
    "Restored",
    "SnapshotHandle",
    "latest",
    "prepare",
    "restore",
    "snapshot",
    "wait",
]


def _client() -> Client:
    from .client.default import default_client  # (torch is imported with the client: on first use)

    return default_client()


def snapshot(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    blocking: bool = False,
) -> SnapshotHandle:
    """Checkpoint ``model`` and ``optim`` as they are at this call: copy them into the daemon's shared memory as ``step``.

    Collective: every rank calls it, with the same ``step``. By default, when the state is on a GPU (see
    ``CKPTD_OVERLAP``), it may return before the copy of the parameters and the optimizer state ends: a background
    thread finishes it, and an optimizer step pre-hook, the next ``snapshot()``, :func:`restore` and :func:`wait`
    all wait for it first. Everything else (buffers, ``extra``) is copied before it returns. Parameters mutated
    outside ``optimizer.step()`` need ``blocking=True`` (see :doc:`/training-loops`). Calls from several threads take turns (each
    joins the background copy of the one before).

    Args:
        model: The module to save, in any layout (one process, DDP, FSDP1, FSDP2, experts sharded over sub-groups).
        optim: Its optimizer, or ``None`` to save the model alone.
        step: The step number, a non-negative int, the same on every rank.
        extra: This rank's own state (JSON-able values and tensors: RNG states, a data loader's position);
            :func:`restore` returns it.
        blocking: Return only once every byte is in the daemon's shared memory and the commit is recorded there.

    Returns:
        The step's :class:`SnapshotHandle`, whose ``wait()`` returns once the step is durable.

    Raises:
        ValueError: ``step`` is not a non-negative int.
        CheckpointError: Ranks passed different steps (every rank gets it before anything is committed), some ranks
            did not call it within ``CKPTD_COLLECTIVE_TIMEOUT``, an earlier snapshot's background copy failed, an
            optimizer holds a tensor that is not a parameter of ``model``, a lazy module is not initialized yet, or
            another live run saves the same job.
        DaemonUnavailable: No daemon answers at the endpoint (at once when its socket does not exist).
        UnsupportedState: The state holds a dtype or value ckptd cannot store (its path is named; also a ``TypeError``).
    """
    return _client().snapshot(model, optim, step=step, extra=extra, blocking=blocking)


def prepare(model: torch.nn.Module, optim: torch.optim.Optimizer | None = None, *, slots: int | None = None) -> None:
    """Do the first snapshot's one-time work at start-up, so the first ``snapshot()`` in the loop is as fast as later ones.

    Collective: call it on every rank. It plans the layout, has the daemon create the staging slots and the trainer
    map them (page-locked, for CUDA state), side by side, then hands them back unused for the next snapshots to reuse.
    Slots the daemon's ``--shm-budget`` has no room for are not waited for: a warning says how many fit. Each slot
    holds 64 KiB beyond the planned state, for the small tensors in ``extra`` (RNG states) that ``prepare()`` does not see.

    Before the optimizer's first step (no state yet) the slots are sized for the state that step will make, as a
    shadow optimizer of the same class foresees it by stepping meta-device stand-ins without its step hooks (the
    real optimizer is untouched); the plan's spread of replicated chunks (DDP) is then redone over every rank's
    projection, a second collective. So are parameters without state beside others that have it (a new head after
    ``restore(strict=False)``); FSDP1's flat slices (``use_orig_params=True``) are sized as the chunks they are saved
    as. Optimizers outside ``torch.optim``, flat FSDP1 parameters (``use_orig_params=False``) and optimizers whose
    step cannot run on the meta device (L-BFGS, Adafactor, ASGD) get slots for the parameters alone: call
    ``prepare()`` after the first step there.

    Args:
        model: The module ``snapshot()`` will save.
        optim: Its optimizer, or ``None``.
        slots: How many slots to make, an int in 0..16 (default: two, one persisting while the next is filled; three
            with a :doc:`memory tier </memory-tier>`: one persisting, the newest step held, the next filled).

    Raises:
        ValueError: ``slots`` is not an int in 0..16.
        CheckpointError: Some ranks did not call it within ``CKPTD_COLLECTIVE_TIMEOUT``, or an earlier snapshot's
            background copy failed.
        DaemonUnavailable: No daemon answers at the endpoint.
    """
    _client().prepare(model, optim, slots=slots)


def wait(timeout: float | None = None) -> list[str]:
    """Wait until the pending snapshots of this process (the newest 64) are durable.

    Steps the daemon's memory tier keeps in memory only are persisted now; steps it already dropped, as the job's
    tiering policy allows, are skipped. A step a restarted daemon no longer knows is skipped with a warning when a
    later snapshot is durable (retention removed it, or the memory tier dropped it).

    Args:
        timeout: Seconds to wait in all, or ``None`` for no limit.

    Returns:
        The directories of the steps that are durable, oldest first (retention may remove them later).

    Raises:
        StepUnknown: A restarted daemon has no record of a step, it is not on disk, and no later snapshot is durable.
        CheckpointError: A snapshot's copy or persisting failed (each failure is raised once), naming the cause.
        TimeoutError: ``timeout`` passed first.
    """
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
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
) -> Restored:
    """Load the newest committed step (or ``step``) in place, into whatever layout ``model`` and ``optim`` have now.

    Any world size and layout (FSDP1, FSDP2, DDP, one process, experts sharded over sub-groups); a fresh optimizer
    without state is fine. Every chunk's checksum is verified before it returns. A step bit-identical to the one
    before although its optimizer step counter advanced gets a warning (a stale-data guard). A module's extra state
    (``get_extra_state``: TransformerEngine's FP8 metadata) is restored as saved, whatever its size. With
    torch.distributed initialized a strict restore is collective: the ranks agree on what is unexpected and share
    any failure (also one met before reading, such as an earlier snapshot's failed background copy), so call it on
    every rank, or pass ``strict=False`` to restore on some ranks only. After ``restore(step=k)`` saving steps above
    ``k`` again is allowed and starts a new line (see :doc:`/latest-and-rollback`).

    Args:
        model: The module to load into.
        optim: Its optimizer, or ``None``.
        step: The step to load (default: the newest step every rank has committed, also one kept in memory only,
            which :func:`latest` does not name). The daemon downloads it first when only its bucket has it.
        path: A step directory, or a job directory meaning its newest step: read from there, no daemon needed.
        hot: Read the step from the daemon's shared memory while it still holds every rank's shard (a trainer restarted
            on the same node after a crash, before its slots were reused; the daemon pins them until the restore ends);
            ``False`` reads the disk. The result's ``source`` says which was used: ``"memory"``, ``"disk"`` or
            ``"bucket"``.
        strict: As in ``load_state_dict``: target state the checkpoint lacks, or saved model tensors, extra states and
            optimizer entries that no rank's target has, are one error listing them (keys ``model/<fqn>``,
            ``model/<fqn>._extra_state``, ``optim/state/<fqn>``). ``False`` loads the intersection: a new head keeps
            its own values, parameters without saved state start without optimizer state, and rank 0 warns, listing
            what matched nothing (an L-BFGS history saved for parameters of another total size is unexpected).
        rename: Saved parameter names to the model's (a layer renamed since): a dict of name prefixes, the longest
            matching whole name parts winning (``{"encoder.layer": "encoder.layers"}``), or a callable on a saved name.
        dtype: Convert saved floating-point tensors into targets of this dtype (a bf16 checkpoint into an fp32 model
            with ``torch.float32``); without it a dtype mismatch is an error that says so.

    Returns:
        This rank's ``extra`` (rank 0's for ranks the checkpoint did not have), as a :class:`Restored`, a dict with
        ``.step``, ``.source``, ``.missing_keys`` and ``.unexpected_keys``.

    Raises:
        CheckpointError: No committed step, a strict mismatch or a dtype mismatch (naming the keys), or an earlier
            snapshot's failed background copy.
        FormatError: A chunk's checksum does not match, or a file of the step is malformed.
        DaemonUnavailable: No daemon answers at the endpoint (without ``path``).
    """
    from .client.default import current

    if path is not None and current() is None:  # no daemon needed
        return _restore_path(path, model, optim, strict=strict, dtype=dtype, rename=rename)
    return _client().restore(model, optim, step=step, path=path, hot=hot, strict=strict, dtype=dtype, rename=rename)


def _restore_path(path: str, model: torch.nn.Module, optim: torch.optim.Optimizer | None, **how: Any) -> Restored:
    from .client.copy import join_all
    from .client.load import restore_state
    from .client.options import dist_rank_world

    join_all()  # a Client(job=...)'s background copy of these tensors ends first
    return restore_state(path, model, optim, dist_rank_world()[0], **how)


def latest() -> int | None:
    """The latest complete step of this job: the one committed last, on this node's disk or in the daemon's bucket.

    After a rollback that is not the highest number (see :doc:`/latest-and-rollback`). With a bucket, a replaced
    node with an empty root still finds the job's steps there and resumes.

    Returns:
        The step, or ``None`` when the job has none.

    Raises:
        CheckpointError: The bucket cannot be reached (an error, never a silently stale answer).
        DaemonUnavailable: No daemon answers at the endpoint.
    """
    return _client().latest()
