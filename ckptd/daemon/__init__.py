"""The node daemon (``ckptd serve``). Never imports torch.

:mod:`.server` (loop, op table, lifecycle) wires the components: :mod:`.slots` (shared-memory slots:
lease, budget, eviction, pins, reaping), :mod:`.steps` (per-step state and waiters), :mod:`.catalog`
(which complete steps exist and which one a restore reads), :mod:`.persister` (persist threads),
:mod:`.uploader` (the upload thread), :mod:`.fetcher` (restores from disk or bucket),
:mod:`.recovery` (start-up after a crash), :mod:`.events` (what worker threads report),
:mod:`.status`, :mod:`.access` (file modes and group), :mod:`.sdnotify` (systemd) and
:mod:`.metrics` (Prometheus).
"""

from __future__ import annotations

from .server import Daemon

__all__ = ["Daemon"]
