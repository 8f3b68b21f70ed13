"""The one :class:`ckptd.Client` per job and endpoint that this process's DCP writers and readers share."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..config import default_endpoint, default_job, validate_job

if TYPE_CHECKING:
    from ..client import Client

_clients: dict[tuple[str, str], Client] = {}
_lock = threading.Lock()


def client_for(job: str | None, endpoint: str | None) -> Client:
    """The process's client of ``job`` at ``endpoint`` (defaults as :class:`ckptd.Client`'s), made once."""
    import ckptd

    ep = endpoint or default_endpoint()
    name = validate_job(job if job is not None else default_job())
    default = ckptd._default
    if default is not None and not default._closed and (default.endpoint, default.job) == (ep, name):
        return default
    with _lock:
        c = _clients.get((ep, name))
        if c is None or c._closed:
            from ..client import Client

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
