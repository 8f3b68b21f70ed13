"""The trainer's side of ckptd: :class:`Client` (the facade) and :class:`SnapshotHandle`.

Modules: :mod:`.rpc` (the torch-free channel to the daemon, also used by the CLI), :mod:`.client`
(snapshot / prepare / wait / restore), :mod:`.stage` (capture :mod:`.capture`, plan :mod:`.plan`,
layout cache), :mod:`.copy` (slot mappings, copies, the optimizer guard; :mod:`.cuda` for the GPU),
:mod:`.restore` (memory / disk / bucket), :mod:`.load` (loading into any layout, strict or not) and
:mod:`.reader` (verified reads of saved chunks). :mod:`.api` is the internal API that :mod:`ckptd.dcp` and
:mod:`ckptd.integrations` use, and the only client module they import. Importing this package does not import
torch; :class:`Client` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client, SnapshotHandle
    from .load import Restored

__all__ = ["Client", "Restored", "SnapshotHandle"]


def __getattr__(name: str) -> Any:
    if name == "Restored":
        from .load import Restored

        return Restored
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'ckptd.client' has no attribute {name!r}")
