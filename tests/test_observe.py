"""Observability: ``ckptd status`` for people and as JSON, and Prometheus metrics on localhost."""

from __future__ import annotations

import os
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

from ckptd import shm
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
    assert f"remote      s3://{s3_bucket.bucket}/{s3_bucket.prefix}" in text
    assert re.search(r"persist .* 2 steps committed", text)
    assert re.search(r"upload .* 2 steps uploaded; 0 queued", text)
    assert "last error  none" in text
    assert re.search(r"^obs\s+2\s+2\s+2\s+-$", text, re.M), text  # latest, uploaded, in memory, in flight

    r = _cli("status", "--endpoint", d.endpoint, "--json")
    st = __import__("json").loads(r.stdout)
    assert st["jobs"]["obs"] == {"in_flight": [], "latest": 2, "uploaded": 2, "in_memory": 2}
    assert st["persist_bytes_per_s"] > 0 and st["upload_bytes_per_s"] > 0
    assert not {"v", "id", "ok"} & st.keys()  # the wire's envelope is not the daemon's state

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
    _left_nothing(other)
    r = _cli("status", "--endpoint", d.endpoint)
    assert "remote      none (local disk only)" in r.stdout and "last error  none" in r.stdout
    r = _cli("status", "--endpoint", f"ipc://{short_tmp}/nobody.sock")
    assert r.returncode == 1 and "ckptd:" in r.stderr


def _left_nothing(d) -> None:  # noqa: ANN001
    """A daemon whose start failed left neither its socket file nor a segment directory in /dev/shm."""
    assert not os.path.exists(d.endpoint[len("ipc://") :]), "the failed start left its socket file"
    marker = shm.SegmentDir.read_marker(d.root)
    assert marker is None or not os.path.exists(os.path.join(shm.SHM_DIR, marker)), "the failed start left its /dev/shm directory"


def test_a_start_that_cannot_listen_or_make_its_root_says_why_and_leaves_nothing(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    # the operator's mistakes: a TCP port another program holds, a root path that is a file. Before, a raw
    # ZMQError or FileExistsError traceback, and the port case left its /dev/shm directory behind
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        root = short_tmp / "tcp-root"
        r = _cli("serve", "--root", str(root), "--endpoint", f"tcp://127.0.0.1:{port}")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"ckptd serve: cannot listen on tcp://127.0.0.1:{port}:" in r.stderr
    marker = shm.SegmentDir.read_marker(str(root))
    assert marker is None or not os.path.exists(os.path.join(shm.SHM_DIR, marker))
    a_file = short_tmp / "not-a-dir"
    a_file.write_text("x")
    r = _cli("serve", "--root", str(a_file), "--endpoint", f"ipc://{short_tmp}/f.sock")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.startswith("ckptd serve: "), r.stderr
    assert str(a_file) in r.stderr


def test_cli_numbers_that_cannot_work_are_refused_by_argparse(short_tmp: Path) -> None:
    r = _cli("status", "--endpoint", f"ipc://{short_tmp}/none.sock", "--watch", "-1")
    assert r.returncode == 2 and "a number of seconds > 0, got '-1'" in r.stderr and "Traceback" not in r.stderr
    r = _cli("export", str(short_tmp), "--out", str(short_tmp / "out"), "--format", "hf", "--max-shard-size", "0")
    assert r.returncode == 2 and "a size > 0, got '0'" in r.stderr
