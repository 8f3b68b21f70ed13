"""Running under systemd: the unit file, the notify protocol on a real datagram socket, --config."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO

UNIT = REPO / "systemd" / "ckptd.service"


def _unit_for_here(tmp: Path) -> Path:
    """The shipped unit with this checkout's executable and the current user (verify checks both)."""
    import pwd

    user = pwd.getpwuid(os.getuid()).pw_name
    text = UNIT.read_text().replace("/opt/ckptd/.venv/bin/ckptd", str(Path(sys.executable).parent / "ckptd"))
    text = text.replace("User=trainer", f"User={user}").replace("Group=trainer", f"Group={user}")
    out = tmp / "ckptd.service"
    out.write_text(text)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(short_tmp: Path) -> None:
    unit = _unit_for_here(short_tmp)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Unknown" not in r.stderr and "ignoring" not in r.stderr, r.stderr
    text = UNIT.read_text()
    for line in ("Type=notify", "Restart=on-failure", "WatchdogSec=", "RuntimeDirectory=ckptd", "NoNewPrivileges=yes"):
        assert line in text
    broken = short_tmp / "broken.service"  # the check can fail: a unit whose command does not exist
    broken.write_text(unit.read_text().replace(str(Path(sys.executable).parent / "ckptd"), "/nonexistent/ckptd"))
    assert subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, timeout=60).returncode != 0


def test_notify_ready_watchdog_stopping(make_daemon, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(short_tmp / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s
        daemon = make_daemon()
        ready = sock.recv(4096).decode()
        assert "READY=1" in ready and f"MAINPID={daemon.proc.pid}" in ready
        pings = 0
        deadline = time.monotonic() + 10
        while pings < 2 and time.monotonic() < deadline:
            if sock.recv(4096) == b"WATCHDOG=1":
                pings += 1
        assert pings == 2
        daemon.proc.send_signal(signal.SIGTERM)
        msgs = []
        while "STOPPING=1" not in msgs:
            msgs.append(sock.recv(4096).decode())
        assert daemon.stop() == 0
    finally:
        sock.close()


def _serve(*args: str, timeout: float = 5.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", "serve", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout)


def test_config_file_and_flags(make_daemon, short_tmp: Path) -> None:
    from ckptd.client import Client

    root = short_tmp / "from-config"
    cfg = short_tmp / "ckptd.toml"
    cfg.write_text(f'root = "{root}"\nkeep = 2\nshm_budget = "64M"\nlog_level = "DEBUG"\n')
    daemon = make_daemon("--config", str(cfg), start=False)
    daemon.root = str(root)  # the fixture's --root must not override the file here
    cmd_endpoint = daemon.endpoint
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--config", str(cfg), "--endpoint", cmd_endpoint], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with Client(endpoint=cmd_endpoint, job="x", timeout=0.5) as c:
                    st = c.status()
                break
            except Exception:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert st["root"] == str(root) and st["shm_budget"] == 64 << 20
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize(
    "text,msg",
    [
        ('root = "/tmp/x"\nbogus = 1\n', "unknown settings ['bogus']"),
        ('root = "/tmp/x"\nkeep = "three"\n', "keep must be a int"),
        ('root = "/tmp/x"\nkeep = 0\n', "keep must be >= 1"),
        ('root = "/tmp/x"\nshm_budget = "lots"\n', "not a size"),
        ("root = [\n", "ckptd.toml"),
        ("keep = 2\n", "no checkpoint root"),
    ],
)
def test_bad_config_is_a_clear_error(short_tmp: Path, text: str, msg: str) -> None:
    cfg = short_tmp / "ckptd.toml"
    cfg.write_text(text)
    r = _serve("--config", str(cfg), "--endpoint", f"ipc://{short_tmp}/never.sock")
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_example_config_parses_with_every_commented_setting() -> None:
    """systemd/ckptd.toml, with its commented settings and [remote] table switched on, is a valid config."""
    import re

    from ckptd.config import daemon_config
    from ckptd.storage.s3 import RemoteConfig

    text = (REPO / "systemd" / "ckptd.toml").read_text()
    on = re.sub(r"^# ?((?:\[remote\]|[a-z_]+ = ).*)$", r"\1", text, flags=re.M)
    assert on != text and "[remote]" in on.splitlines()
    on = on.replace('group = "trainers"', 'group = "root"')  # a group this machine has
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(on)
        f.flush()
        cfg = daemon_config({}, f.name)
    assert cfg.group == "root" and cfg.metrics_port == 9464
    assert isinstance(cfg.remote, RemoteConfig) and cfg.remote.max_bandwidth == 200 << 20
    assert (cfg.remote_keep, cfg.remote_keep_every, cfg.commit_timeout) == (3, 1000, 600)
