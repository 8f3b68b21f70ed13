"""Prometheus metrics for the daemon, served on localhost (prometheus-client's exposition, a bounded server).

The daemon's main loop refreshes a status snapshot (the same dict ``ckptd status`` prints) every
housekeeping tick; a scrape reads the newest snapshot and never touches the daemon's live state, so
it needs no lock and cannot slow the loop down. Names (all prefixed ``ckptd_``):

counters  ``persisted_bytes_total``, ``persist_seconds_total``, ``steps_committed_total``,
          ``uploaded_bytes_total``, ``upload_seconds_total``, ``steps_uploaded_total``, ``errors_total``,
          ``memory_steps_total``, ``memory_steps_dropped_total``, ``allocs_waited_total``
gauges    ``up``, ``uptime_seconds``, ``shm_budget_bytes``, ``shm_bytes``, ``staged_bytes``,
          ``slots{state}``, ``deferred_allocs``, ``upload_backlog_steps``, ``upload_in_progress_bytes``,
          ``upload_in_progress_total_bytes``, and per job: ``latest_step{job}``,
          ``uploaded_step{job}``, ``in_flight_steps{job}``
peers     counters ``replication_steps_total{outcome}``, ``replication_peer_failures_total``,
          ``replica_bytes_received_total``; gauges ``replica_bytes``, ``replica_budget_bytes``, ``peer_up{peer}``,
          ``replicated_step{job}`` (:mod:`.replicator`, :mod:`.mesh`, :mod:`.replicas`)
"""

from __future__ import annotations

import logging
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from ..config import METRICS_MAX_CONNECTIONS, METRICS_TIMEOUT_S
from ..errors import CheckpointError

log = logging.getLogger("ckptd.daemon")

_COUNTERS = {
    "persisted_bytes": "bytes written durably to local disk",
    "persist_seconds": "seconds spent writing shards to local disk",
    "steps_committed": "steps made durable (locally, or in the bucket for multi-node jobs)",
    "uploaded_bytes": "bytes uploaded to the object-storage tier",
    "upload_seconds": "seconds spent uploading",
    "steps_uploaded": "steps complete in the bucket",
    "errors": "errors reported in ckptd status' last_error",
    "memory_steps": "steps complete in the memory tier only (some persisted later)",
    "memory_steps_dropped": "memory-only steps dropped without being persisted",
    "allocs_waited": "snapshot allocations that waited for memory or for a segment to be made",
}
_GAUGES = {
    "uptime_s": ("uptime_seconds", "seconds since the daemon started"),
    "shm_budget": ("shm_budget_bytes", "shared memory the daemon may stage into"),
    "shm_bytes": ("shm_bytes", "shared memory held in staging slots"),
    "staged_bytes": ("staged_bytes", "committed bytes not yet durable"),
    "deferred_allocs": ("deferred_allocs", "snapshot allocations waiting for memory (backpressure)"),
}


class StatusCollector:
    """A prometheus-client collector over ``snapshot()``, a function returning the newest status dict."""

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.snapshot()
        yield GaugeMetricFamily("ckptd_up", "1 while the daemon serves", value=1 if st is not None else 0)
        if st is None:
            return
        for key, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"ckptd_{key}", doc, value=float(st.get(key) or 0))
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(f"ckptd_{name}", doc, value=float(st.get(key) or 0))
        slots = GaugeMetricFamily("ckptd_slots", "staging slots by state", labels=["state"])
        for state in ("free", "leased", "committed"):
            slots.add_metric([state], float(st.get("slots", {}).get(state, 0)))
        yield slots
        yield GaugeMetricFamily("ckptd_upload_backlog_steps", "steps queued for upload", value=float(len(st.get("upload_backlog") or ())))
        up = st.get("uploading") or {}
        done, total = float(up.get("bytes_done", 0)), float(up.get("bytes_total", 0))
        yield GaugeMetricFamily("ckptd_upload_in_progress_bytes", "bytes sent of the step uploading now", value=done)
        yield GaugeMetricFamily("ckptd_upload_in_progress_total_bytes", "size of the step uploading now", value=total)
        per_job = {
            "latest": GaugeMetricFamily("ckptd_latest_step", "newest durable local step", labels=["job"]),
            "uploaded": GaugeMetricFamily("ckptd_uploaded_step", "newest step complete in the bucket", labels=["job"]),
            "in_flight": GaugeMetricFamily("ckptd_in_flight_steps", "steps committed by some rank, not durable yet", labels=["job"]),
        }
        for job, info in sorted((st.get("jobs") or {}).items()):
            for key, fam in per_job.items():
                v = info.get(key)
                if key == "in_flight":
                    fam.add_metric([job], float(len(v or ())))
                elif v is not None:
                    fam.add_metric([job], float(v))
        yield from per_job.values()
        yield from _peers(st)


def _peers(st: dict[str, Any]) -> Iterator[Any]:
    """Replication to peers (``--peer`` and the job's daemons together) and the replicas held for them."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    senders = [s for s in (st.get("replication"), st.get("mesh")) if isinstance(s, dict)]
    steps = CounterMetricFamily("ckptd_replication_steps", "steps sent to peers, by outcome", labels=["outcome"])
    for outcome, key in (("replicated", "steps_replicated"), ("degraded", "steps_degraded"), ("superseded", "superseded")):
        steps.add_metric([outcome], float(sum(s.get(key, 0) for s in senders)))
    yield steps
    failures = float(sum(s.get("peer_failures", 0) for s in senders))
    yield CounterMetricFamily("ckptd_replication_peer_failures", "sends to a peer that failed", value=failures)
    held = {k: float(v) for k, v in (st.get("replicas_held") or {}).items() if isinstance(v, int)}
    yield CounterMetricFamily("ckptd_replica_bytes_received", "bytes of replicas received from peers", value=held.get("bytes_received", 0))
    yield GaugeMetricFamily("ckptd_replica_bytes", "shared memory held for peers' replicas", value=held.get("replica_bytes", 0))
    yield GaugeMetricFamily("ckptd_replica_budget_bytes", "memory set aside for peers' replicas", value=held.get("replica_budget", 0))
    up = GaugeMetricFamily("ckptd_peer_up", "1 while a --peer takes steps, 0 while it fails", labels=["peer"])
    for p in (st.get("replication") or {}).get("peers", []):
        if p.get("ok") is not None:
            up.add_metric([p["endpoint"]], 1.0 if p["ok"] else 0.0)
    yield up
    newest = GaugeMetricFamily("ckptd_replicated_step", "newest step K peers took", labels=["job"])
    for job, info in sorted((st.get("jobs") or {}).items()):
        rep = info.get("replicated")
        if rep and rep.get("state") == "replicated":
            newest.add_metric([job], float(rep["step"]))
    yield newest


class _BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A WSGI server with a thread per connection, at most ``METRICS_MAX_CONNECTIONS`` of them, each closed once
    silent for ``METRICS_TIMEOUT_S``: any local user can connect, and prometheus-client's own server gave every
    connection a thread and a descriptor for as long as the peer kept it open (a thousand idle ones exhausted the
    daemon's descriptors). A connection past the cap is closed at once; a scrape then fails, the daemon does not."""

    daemon_threads = True  # a scrape in progress never holds up the daemon's exit
    request_queue_size = 128  # the listen backlog: socketserver's 5 made a burst of connects wait on SYN retries

    def __init__(self, addr: tuple[str, int]) -> None:
        self._slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self.held = 0  # connections being served now
        self.refused = 0
        self._last_warning = 0.0
        super().__init__(addr, _QuietHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            now = time.monotonic()
            if now - self._last_warning >= 10.0:  # an attacker must not flood the log either
                self._last_warning = now
                log.warning(
                    "metrics: closing a connection from %s: %d open (%d refused so far)",
                    client_address,
                    METRICS_MAX_CONNECTIONS,
                    self.refused,
                )
            self.shutdown_request(request)
            return
        with self._lock:
            self.held += 1
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self.held -= 1
        self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: connection from %s ended in error", client_address, exc_info=True)  # a peer's fault: no traceback on stderr


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_TIMEOUT_S  # applied to the connection's socket: a silent peer is dropped

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """One line per scrape would flood the journal."""


def serve(port: int, snapshot: Callable[[], dict[str, Any] | None], addr: str = "127.0.0.1") -> Any:
    """Start the HTTP endpoint (``/metrics``) on ``addr:port`` in a daemon thread; returns the server (``shutdown()``,
    then ``server_close()``). A port that cannot be bound raises :class:`~ckptd.errors.CheckpointError`."""
    from prometheus_client import CollectorRegistry, make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    try:
        server = _BoundedServer((addr, port))
    except OSError as e:
        raise CheckpointError(f"cannot serve metrics on {addr}:{port}: {e.strerror or e}") from None
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="ckptd-metrics", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return server
