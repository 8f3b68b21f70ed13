"""The one :class:`ckptd.Client` per job and endpoint that this process's DCP writers and readers share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config import default_endpoint, default_job, validate_job

if TYPE_CHECKING:
    from ..client.api import Client

_clients: dict[tuple[str, str], Client] = {}
_lock = threading.Lock()


def client_for(job: str | None, endpoint: str | None) -> Client:
    """The process's client of ``job`` at ``endpoint`` (defaults as :class:`ckptd.Client`'s), made once."""
    from ..client.api import Client, default_for, is_open

    ep = endpoint or default_endpoint()
    name = validate_job(job if job is not None else default_job())
    default = default_for(ep, name)
    if default is not None:
        return default
    with _lock:
        c = _clients.get((ep, name))
        if c is None or not is_open(c):
            c = _clients[(ep, name)] = Client(ep, name)
        return c


def step_of(checkpoint_id: object, who: str) -> int:
    """A DCP ``checkpoint_id`` as a ckptd step: an int, or a string of digits; ``ValueError`` otherwise."""
    from ..config import MAX_STEP

    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        step = checkpoint_id
    elif isinstance(checkpoint_id, str) and checkpoint_id.isascii() and checkpoint_id.isdigit():
        step = int(checkpoint_id)
    else:
        raise ValueError(f"{who}: checkpoint_id is the step number (an int or a string of digits), got {checkpoint_id!r}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"{who}: step {step} is outside 0..{MAX_STEP}")
    return step


_NONE, _FAILED = -1, -2


def rank0_step(pick: Callable[[], int | None]) -> int | None:
    """``pick()`` run on rank 0 (a step or ``None``), the same answer on every rank: one broadcast over the default
    group, a tensor on the device its backend needs. A failure on rank 0 is raised there and named on every
    other rank, which would otherwise wait for rank 0 forever. Without torch.distributed: ``pick()``."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return pick()
    from ..client.api import collective_device
    from ..errors import CheckpointError

    got, error = _NONE, None
    if dist.get_rank() == 0:
        try:
            step = pick()
            got = _NONE if step is None else step
        except Exception as e:
            got, error = _FAILED, e
    t = torch.tensor([got], dtype=torch.int64, device=collective_device())
    dist.broadcast(t, src=0)
    if error is not None:
        raise error
    got = int(t.item())
    if got == _FAILED:
        raise CheckpointError("rank 0 could not choose the step to resume (see its error)")
    return None if got == _NONE else got


def resume_step(client: Client) -> int | None:
    """The step a relaunch resumes: the newest the daemon holds — one it is still persisting, or holds in its memory
    tier only, is persisted first and waited for — else the latest durable one; ``None`` if the job has none."""
    from ..client.api import settled

    newest = settled(client, None, persist=True)
    return newest if newest is not None else client.latest()
