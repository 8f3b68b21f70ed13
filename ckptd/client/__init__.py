"""The trainer's side of ckptd: :class:`Client` (the facade) and :class:`SnapshotHandle`.

Modules: :mod:`.rpc` (the torch-free channel to the daemon, also used by the CLI), :mod:`.client`
(snapshot / prepare / wait / restore), :mod:`.stage` (capture :mod:`.capture`, plan :mod:`.plan`,
layout cache), :mod:`.copy` (slot mappings, copies, the optimizer guard; :mod:`.cuda` for the GPU),
:mod:`.restore` (memory / disk / bucket) and :mod:`.reader` (loading into any layout). Importing
this package does not import torch; :class:`Client` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client, SnapshotHandle

__all__ = ["Client", "SnapshotHandle"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'ckptd.client' has no attribute {name!r}")
