"""Descriptor exhaustion: whoever can connect (any local user to the metrics port; the daemon's user or a
``--group`` member to its socket) holds connections open until the daemon cannot open a file, and libzmq
then aborts the process (``Too many open files (src/ipc_listener.cpp:297)``). With systemd's limits (soft
1,024, hard higher) the daemon raises its soft limit, caps its client connections by user and in all, and
bounds and times out metrics connections: it keeps serving its other clients.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from _as_user import NOBODY, needs_nobody, python_as, python_as_nobody
from conftest import DaemonProc
from test_observe import _free_port

from ckptd.daemon import metrics

SYSTEMD_LIMITS = (1024, 4096)  # systemd's default soft limit; its hard one is higher still (524,288)
HOLD = 1100  # connections an attacker holds: past the soft limit the daemon started with
GROUP = "adm"  # a system group on Debian-like images, as tests/test_access.py uses


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _snapshot_and_restore(d: DaemonProc, step: int) -> None:
    """What a trainer does: a snapshot made durable, then a restore of it."""
    m = torch.nn.Linear(8, 8)
    with d.client(timeout=30.0) as c:
        c.snapshot(m, step=step, blocking=True).wait(60)
        m2 = torch.nn.Linear(8, 8)
        c.restore(m2, step=step)
    assert torch.equal(m.weight, m2.weight)


_HOLD_TCP = """
import socket, time
held = []
for _ in range(int(sys.argv[2])):
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
    held.append(s)
print("held", len(held), flush=True)
sys.stdin.readline()  # until the test has looked
"""


@needs_nobody
def test_another_user_holding_metrics_connections_cannot_take_the_daemon_down(make_daemon) -> None:  # noqa: ANN001
    """The attack: nobody opens 1,100 idle connections to the metrics port. Before, each got a thread and a
    descriptor: the daemon ran out of descriptors and libzmq aborted it."""
    port = _free_port()
    d: DaemonProc = make_daemon("--metrics-port", str(port), start=False)
    d.open_files = SYSTEMD_LIMITS
    d.start()
    argv = python_as_nobody(_HOLD_TCP, str(port), str(HOLD), imports=["socket", "time", "encodings.idna"])
    att = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        assert att.stdout is not None and att.stdout.readline() == f"held {HOLD}\n", att.stderr.read() if att.stderr else ""
        time.sleep(2 * 0.5)  # two housekeeping ticks: where descriptors ran out, they failed
        assert d.proc is not None and d.proc.poll() is None, d.log.read_text()[-2000:]
        assert _open_fds(d.proc.pid) < 300  # 16 metrics connections at most, not 1,100
        _snapshot_and_restore(d, 1)
        assert "metrics: closing a connection" in d.log.read_text()
    finally:
        att.kill()
        att.wait()
    deadline = time.monotonic() + 30  # the attacker's connections are gone: a scrape is served again
    while True:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            break
        except OSError:
            assert time.monotonic() < deadline, "metrics never served again"
            time.sleep(0.2)
    assert "ckptd_up 1.0" in body
    assert d.proc is not None and d.proc.poll() is None


def test_a_silent_metrics_connection_is_closed_and_one_past_the_cap_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics._QuietHandler, "timeout", 0.5)
    server = metrics.serve(0, lambda: None)
    port = server.server_address[1]
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(metrics.METRICS_MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 10
        while server.held < metrics.METRICS_MAX_CONNECTIONS:  # accepted, each on its thread
            assert time.monotonic() < deadline, server.held
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            assert extra.recv(1) == b""  # past the cap: closed at once, long before the silence timeout
        for s in held:  # silent: each is closed after the timeout
            s.settimeout(10)
            assert s.recv(1) == b""
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "ckptd_up 0.0" in body  # a snapshot of None: the daemon is not serving yet
        assert server.refused >= 1
    finally:
        for s in held:
            s.close()
        server.shutdown()
        server.server_close()


_HOLD_ZMQ = """
import zmq
ctx = zmq.Context()
ctx.set(zmq.MAX_SOCKETS, int(sys.argv[2]) + 16)
held = []
for _ in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
    held.append(s)
print("held", len(held), flush=True)
sys.stdin.readline()
for s in held:
    s.close()
ctx.term()
"""


@needs_nobody
def test_a_group_member_holding_connections_cannot_take_the_daemon_down(short_tmp: Path) -> None:
    """The attack: a member of the daemon's group opens 1,100 ZeroMQ connections and holds them. Before, the daemon
    (soft limit 1,024) aborted in libzmq at once; now it refuses the member's connections past its share and
    serves the owner's trainer."""
    try:
        gid = __import__("grp").getgrnam(GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no group {GROUP!r} here")
    assert NOBODY is not None
    os.chmod(short_tmp, 0o755)
    d = DaemonProc(short_tmp, ["--group", GROUP])
    d.open_files = SYSTEMD_LIMITS
    att = None
    try:
        d.start()
        argv = python_as(_HOLD_ZMQ, d.endpoint, str(HOLD), uid=NOBODY.pw_uid, gid=gid, groups=[gid], imports=["zmq"])
        att = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        assert att.stdout is not None and att.stdout.readline() == f"held {HOLD}\n", att.stderr.read() if att.stderr else ""
        deadline = time.monotonic() + 30
        while "refusing a connection from" not in d.log.read_text():  # libzmq connects in the background
            assert d.proc is not None and d.proc.poll() is None, d.log.read_text()[-2000:]
            assert time.monotonic() < deadline, d.log.read_text()[-2000:]
            time.sleep(0.2)
        assert d.proc is not None and d.proc.poll() is None, d.log.read_text()[-2000:]
        _snapshot_and_restore(d, 1)  # the owner's trainer is served meanwhile
        with d.rpc() as rpc:
            conns = rpc.call("status")["connections"]
        assert conns["open_files_limit"] == SYSTEMD_LIMITS[1]  # raised at start
        assert conns["refused"] > 0 and conns["held"] <= conns["max"]
        assert f"uid {NOBODY.pw_uid} holds" in d.log.read_text()
        assert _open_fds(d.proc.pid) < SYSTEMD_LIMITS[1] - 512
    finally:
        if att is not None:
            att.kill()
            att.wait()
        d.cleanup()


def test_the_daemons_own_user_past_its_share_is_refused_not_fatal(make_daemon) -> None:  # noqa: ANN001
    """The same attack by the daemon's own user (a leaking trainer): the daemon stays up, refuses what is past the
    per-user share, and serves again once the connections close."""
    d: DaemonProc = make_daemon(start=False)
    d.open_files = SYSTEMD_LIMITS
    d.start()
    argv = [sys.executable, "-c", "import sys\n" + _HOLD_ZMQ, d.endpoint, str(HOLD)]
    att = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert att.stdout is not None and att.stdout.readline() == f"held {HOLD}\n"
        deadline = time.monotonic() + 30
        while "refusing a connection from" not in d.log.read_text():
            assert d.proc is not None and d.proc.poll() is None, d.log.read_text()[-2000:]
            assert time.monotonic() < deadline, d.log.read_text()[-2000:]
            time.sleep(0.2)
        assert att.stdin is not None
        att.stdin.write("done\n")
        att.stdin.flush()
        assert att.wait(60) == 0, att.stderr.read() if att.stderr else ""
    finally:
        if att.poll() is None:
            att.kill()
            att.wait()
    _snapshot_and_restore(d, 1)
    with d.rpc() as rpc:
        st = rpc.call("status")
    assert st["connections"]["refused"] > 0 and st["connections"]["held"] < 16  # the leaked ones are gone, counted no more
