"""What ``ckptd status`` and the Prometheus metrics report: the daemon's counters, and the status
dict built from its components. Main thread only (metrics read a copy the loop refreshes)."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..version import __version__

if TYPE_CHECKING:
    from .server import Daemon


@dataclass
class Counters:
    """Totals since start-up; the names are ``status`` fields and ``ckptd_<name>_total`` metrics."""

    persisted_bytes: int = 0
    persist_seconds: float = 0.0
    steps_committed: int = 0  # steps made durable (locally, or in the bucket for multi-node jobs)
    uploaded_bytes: int = 0
    upload_seconds: float = 0.0
    steps_uploaded: int = 0
    memory_steps: int = 0  # steps complete in the memory tier only (some persisted later)
    memory_steps_dropped: int = 0  # memory-only steps dropped unpersisted (a later step completed, or memory was full)
    errors: int = 0
    last_error: str | None = None

    def error(self, message: str) -> None:
        """Remember the newest error for ``status`` and count it for metrics."""
        self.last_error = message
        self.errors += 1


def _connections(d: Daemon) -> dict[str, int] | None:
    """Client connections held and refused (:mod:`.connections`), against the caps and the open-files limit."""
    g = d.connections
    if g is None:
        return None
    caps = g.caps
    return {"held": g.held, "refused": g.refused, "max": caps.total, "max_per_user": caps.per_user, "open_files_limit": caps.open_files}


def _rate(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds if seconds else None


def _jobs(d: Daemon) -> dict[str, Any]:
    jobs: dict[str, Any] = {}

    def job(name: str) -> dict[str, Any]:
        return jobs.setdefault(name, {"in_flight": []})

    for name, steps in d.steps.in_flight().items():
        job(name)["in_flight"] = steps
    for name in d.catalog.jobs():
        job(name)["latest"] = d.catalog.latest(name)[0]
        if protected := d.protections.names(name):
            job(name)["protected"] = sorted(set(protected.values()))  # steps kept from retention by name (daemon/protected.py)
    for name, step in d.catalog.uploaded().items():
        job(name)["uploaded"] = step
    held = d.pool.holdings.steps()
    for name, step in d.catalog.in_memory_steps().items():
        if (name, step) in held:
            job(name)["in_memory"] = step  # a hot restore can read it (if every rank's shard is held)
    for name, steps in d.steps.memory_steps().items():
        job(name)["memory_only"] = steps  # complete in shared memory, not persisted
    for sender in (d.replicator, d.mesh):
        for name, outcome in (sender.summary()["jobs"] if sender is not None else {}).items():
            job(name)["replicated"] = {k: outcome[k] for k in ("step", "state", "peers")}  # the newest step sent to peers
    return jobs


def build_status(d: Daemon) -> dict[str, Any]:
    """The ``status`` reply: the daemon, its memory, its jobs, throughput, transfers, errors."""
    c = d.counters
    uploading = None
    if d.uploader is not None and (u := d.uploader.current) is not None:
        uploading = {"job": u.job, "step": u.step, "bytes_done": u.bytes_done, "bytes_total": u.bytes_total,
                     "seconds": time.monotonic() - u.started if u.started else 0.0}  # fmt: skip
    store = d.catalog.store
    return {
        "version": __version__,
        "root": d.root,
        "pid": os.getpid(),
        "uptime_s": time.monotonic() - d.started,
        "remote": store.url() if store is not None else None,
        **d.pool.summary(),
        "jobs": _jobs(d),
        "persist_bytes_per_s": _rate(c.persisted_bytes, c.persist_seconds),
        "upload_bytes_per_s": _rate(c.uploaded_bytes, c.upload_seconds),
        "uploading": uploading,
        "upload_backlog": [list(x) for x in d.uploader.backlog()] if d.uploader is not None else [],
        "fetching": d.fetcher.progress(),
        "connections": _connections(d),
        "replication": d.replicator.summary() if d.replicator is not None else None,  # what this node sends to peers
        "replicas_held": d.replica_server.summary() if d.replica_server is not None else None,  # what peers sent here
        "mesh": d.mesh.summary() if d.mesh is not None else None,  # the jobs that span nodes, and their parts sent
        **dataclasses.asdict(c),
    }
