"""Observability: ``ckptd status`` for people and as JSON, and Prometheus metrics on localhost."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _models import make, train_step
from conftest import REPO
from test_remote import remote_toml, wait_uploaded

from ckptd.storage.s3 import RemoteConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_status_and_metrics(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    port = _free_port()
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket), "--metrics-port", str(port))
    model, optim = make()
    with d.client("obs") as c:
        for step in (1, 2):
            train_step(model, optim, step)
            c.snapshot(model, optim, step=step, blocking=True).wait()
        shard = c.status()["persisted_bytes"]
    wait_uploaded(d, "obs", 2)

    r = _cli("status", "--endpoint", d.endpoint)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert f"bucket      s3://{s3_bucket.bucket}/{s3_bucket.prefix}" in text
    assert re.search(r"persist .* 2 steps committed", text)
    assert re.search(r"upload .* 2 steps uploaded; 0 queued", text)
    assert "last error  none" in text
    assert re.search(r"^obs\s+2\s+2\s+2\s+-$", text, re.M), text  # latest, uploaded, in memory, in flight

    r = _cli("status", "--endpoint", d.endpoint, "--json")
    st = __import__("json").loads(r.stdout)
    assert st["jobs"]["obs"] == {"in_flight": [], "latest": 2, "uploaded": 2, "in_memory": 2}
    assert st["persist_bytes_per_s"] > 0 and st["upload_bytes_per_s"] > 0

    deadline = time.monotonic() + 10  # the snapshot behind the metrics refreshes every 0.5 s
    while True:
        m = _scrape(port)
        if m.get("ckptd_steps_uploaded_total") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m["ckptd_up"] == 1
    assert m["ckptd_steps_committed_total"] == 2 and m["ckptd_steps_uploaded_total"] == 2
    assert m["ckptd_persisted_bytes_total"] == shard > 0
    assert m['ckptd_latest_step{job="obs"}'] == 2 and m['ckptd_uploaded_step{job="obs"}'] == 2
    assert m["ckptd_errors_total"] == 0 and m['ckptd_slots{state="free"}'] >= 1
    assert d.stop() == 0


def test_status_without_bucket_and_metrics_port_in_use(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    d = make_daemon()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        other = make_daemon("--metrics-port", str(busy.getsockname()[1]), start=False, sub="other")
        other.start(wait=False)
        assert other.proc.wait(30) == 1
    assert "cannot serve metrics on 127.0.0.1:" in other.log.read_text()
    r = _cli("status", "--endpoint", d.endpoint)
    assert "bucket      none (local disk only)" in r.stdout and "last error  none" in r.stdout
    r = _cli("status", "--endpoint", f"ipc://{short_tmp}/nobody.sock")
    assert r.returncode == 1 and "ckptd:" in r.stderr
