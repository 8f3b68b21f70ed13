"""The client's internal API: all that :mod:`ckptd.dcp` and :mod:`ckptd.integrations` may use of the client.

Not the user-facing API (that is :mod:`ckptd` and :class:`ckptd.Client`): an internal one, for the adapters in this
package only, named here so that the client's other modules can change behind it. ``tests/test_architecture.py``
checks that the adapters import no other client module. The client's own modules do not import this one.

* A client: :class:`Client` (with its public methods, and the internal ``tier`` and ``restored_at``), whether one
  :func:`is_open`, and the process's :func:`default_for` a job and endpoint (``ckptd.snapshot``'s), if made.
* Saving a state dict as it is given: :func:`stage_state` copies it into a daemon slot now (collective, training
  thread), :func:`commit_staged` commits the :class:`StagedState` later from any thread; :func:`wait_step` asks how a
  committed step stands.
* Reading a step: :func:`open_step` through the daemon (memory, disk or bucket) as an :class:`OpenStep`, closed when
  done; :class:`CheckpointReader` over a step directory (:func:`resolve_step_dir`); :func:`settled` for the newest step
  the daemon still works on; :func:`join_all` before loading into tensors a client of this process may be copying;
  :func:`write_safetensors` for a step's tensors as one file. After loading a step itself an adapter calls
  ``Client.restored_at(step)``, as ``restore()`` does.
* :func:`collective_device`: where a tensor for a collective over the default group must be.

Of these functions only :func:`stage_state` is a collective (every rank calls it, on the training thread).
"""

from __future__ import annotations

from typing import Any

from ..storage.local import resolve_step_dir
from .client import Client
from .copy import join_all
from .default import current
from .plan import collective_device
from .reader import CheckpointReader
from .restore import OpenStep
from .restore import open_step as _open_step
from .restore import settled as _settled
from .staged import StagedState, commit_staged, stage_state
from .weights import write_safetensors

__all__ = [
    "CheckpointReader",
    "Client",
    "OpenStep",
    "StagedState",
    "collective_device",
    "commit_staged",
    "default_for",
    "is_open",
    "join_all",
    "open_step",
    "resolve_step_dir",
    "settled",
    "stage_state",
    "wait_step",
    "write_safetensors",
]


def is_open(client: Client) -> bool:
    """Whether ``client`` may still be used (it was not closed)."""
    return not client._closed


def default_for(endpoint: str, job: str) -> Client | None:
    """The process's default client (``ckptd.snapshot``'s) if it was made, is open and serves ``job`` at ``endpoint``.

    Args:
        endpoint: The daemon's endpoint, as resolved.
        job: The job's name, validated.

    Returns:
        That client, or ``None`` (nothing is made).
    """
    c = current()
    return c if c is not None and is_open(c) and (c.endpoint, c.job) == (endpoint, job) else None


def open_step(client: Client, step: int | None, *, hot: bool = True) -> OpenStep:
    """The client's job's newest complete step (or ``step``) opened for reading through the daemon; close it when done.

    This client's background copy (the step it is committing) ends first, its error raised. Read from the daemon's
    shared memory while it holds the step (``hot``), pinned until closed; else from its disk, downloaded from the bucket
    first if need be. Any thread but the client's background copy.

    Args:
        client: The job's client.
        step: The step to open, or ``None`` for the newest complete one.
        hot: Read the daemon's shared memory while it holds the step.

    Returns:
        The opened step: its ``reader`` and ``info`` (what ``Client.last_restore`` says).

    Raises:
        CheckpointError: The copy failed, the job has no committed step, or the step cannot be read.
    """
    client._guard.finish()
    return _open_step(client._rpc, client.job, step, hot=hot)


def settled(client: Client, step: int | None = None, *, persist: bool) -> int | None:
    """The step the daemon still works on or holds in memory only (``step``, or the newest), once it is complete.

    Args:
        client: The job's client.
        step: The step, or ``None`` for the newest.
        persist: Wait until it is durable (a memory-only step is persisted for it), not only complete in memory.

    Returns:
        That step; ``step`` itself when the durable steps answer (``None`` then for the newest).

    Raises:
        CheckpointError: ``step`` was given and failed or was dropped.
    """
    return _settled(client._rpc, client.job, step, persist=persist)


def wait_step(client: Client, step: int, *, persist: bool, timeout: float) -> dict[str, Any]:
    """Wait up to ``timeout`` seconds for a committed step of the client's job to settle; any thread.

    Args:
        client: The job's client.
        step: The step.
        persist: Wait for it to be durable (a memory-only step is persisted), not only complete in memory.
        timeout: Seconds the daemon waits before it answers with the state as it is.

    Returns:
        The daemon's ``wait`` reply: ``state`` (``pending``, ``memory``, ``durable``, ``failed`` or
        ``dropped``), ``path`` and ``error``.
    """
    rpc = client._rpc
    return rpc.call("wait", rpc_timeout=rpc.timeout + timeout + 5.0, job=client.job, step=step, timeout=timeout, persist=persist)
