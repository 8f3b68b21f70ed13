"""The process's default client: the one the module-level functions (``ckptd.snapshot``, ``ckptd.restore``, ...)
use, made on first use from ``CKPTD_ENDPOINT`` and ``CKPTD_JOB``. ``ckptd.dcp`` takes it too when it serves the
same job at the same endpoint, so one process has one client per job."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .client import Client

_default: Client | None = None
_lock = threading.Lock()


def default_client() -> Client:
    """The default client, made now if it is not yet."""
    global _default
    with _lock:
        if _default is None:
            from .client import Client

            _default = Client()
        return _default


def current() -> Client | None:
    """The default client if one was made, else ``None`` (nothing is made)."""
    return _default
