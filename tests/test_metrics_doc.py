"""Every metric the daemon serves has its row on the daemon's page (docs/daemon.md), and every row names one it
serves: the names come from the collector itself, fed a status snapshot of one job."""

from __future__ import annotations

import re

from conftest import REPO

from ckptd.daemon.metrics import StatusCollector

STATUS = {
    "slots": {"free": 1},
    "jobs": {"j": {"latest": 3, "uploaded": 2, "in_flight": [4], "replicated": {"step": 3, "state": "replicated", "peers": ["p"]}}},
    "uploading": {"bytes_done": 1},
    "replication": {"steps_replicated": 2, "peers": [{"endpoint": "tcp://b:7100", "ok": True}]},
    "mesh": {"steps_degraded": 1},
    "replicas_held": {"replica_bytes": 10, "replica_budget": 100, "bytes_received": 10},
}


def _served() -> dict[str, str]:
    """Metric name (as Prometheus exposes it, a counter with ``_total``) -> its type."""
    out = {}
    for fam in StatusCollector(lambda: STATUS).collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name + ("{" + ",".join(fam.samples[0].labels) + "}" if fam.samples and fam.samples[0].labels else "")] = fam.type
    return out


def test_every_metric_served_has_a_row_and_every_row_is_served() -> None:
    text = (REPO / "docs" / "daemon.md").read_text()
    rows = dict(re.findall(r"^\| `(ckptd_[a-z_]+(?:\{[a-z]+\})?)` \| (counter|gauge) \|", text, re.M))
    assert rows == _served()
