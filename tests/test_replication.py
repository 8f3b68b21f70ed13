"""Replication between node daemons, each its own "node" on loopback (own root, socket, segment directory, peer
port): a single-node job whose node is lost restores its newest memory-only step from a peer's replica, bit-exact; a
corrupt replica is caught and the next source used; a step no source holds whole is passed over for the newest one
still restorable; a peer that is down, or holds another key, never fails or stalls a snapshot."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import assert_same, full_state, train_step

from ckptd import shm
from ckptd.peerkey import keygen

JOB = "rep"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Big enough that its shard lies in a segment of the peer's (not its small-object memory)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.Linear(256, 16))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


class Nodes:
    """Daemons as nodes: ``peer(name)`` holds replicas; ``node(name, peers)`` replicates to them."""

    def __init__(self, make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
        self.make, self.tmp = make_daemon, short_tmp
        self.key = str(short_tmp / "cluster.key")
        keygen(self.key)
        self.ports: dict[str, int] = {}

    def peer(self, name: str, *extra: str, key: str | None = None):  # noqa: ANN201
        self.ports[name] = free_port()
        return self.make("--peer-listen", self.url(name), "--peer-key", key or self.key, "--shm-budget", "256M", *extra, sub=name)

    def url(self, name: str) -> str:
        return f"tcp://127.0.0.1:{self.ports[name]}"

    def node(self, name: str, peers: list[str], replicas: int = 1, *extra: str):  # noqa: ANN201
        links = [a for p in peers for a in ("--peer", self.url(p) if p in self.ports else p)]
        return self.make(*links, "--peer-key", self.key, "--replicas", str(replicas), "--shm-budget", "256M", *extra, sub=name)


@pytest.fixture
def nodes(make_daemon, short_tmp: Path) -> Nodes:  # noqa: ANN001
    return Nodes(make_daemon, short_tmp)


def lose(d) -> None:  # noqa: ANN001
    """The node is gone: its daemon killed, its root and its shared memory with it."""
    marker = shm.SegmentDir.read_marker(d.root)
    d.kill()
    shm.purge(d.root)
    if marker:
        shutil.rmtree(os.path.join(shm.SHM_DIR, marker), ignore_errors=True)
    shutil.rmtree(d.root)


def replicated(d, job: str, step: int, timeout: float = 60.0) -> dict[str, Any]:  # noqa: ANN001
    """Wait until ``d`` reports step ``step`` of ``job`` sent to its peers; its status."""
    deadline = time.monotonic() + timeout
    while True:
        with d.client("probe") as c:
            st = c.status()
        got = (st.get("replication") or {}).get("jobs", {}).get(job)
        if got is not None and got["step"] == step:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} not replicated: {st.get('replication')}")
        time.sleep(0.1)


def train_and_snapshot(d, steps: range, persist_every: int = 1000) -> dict[int, dict[str, torch.Tensor]]:  # noqa: ANN001
    model, optim = make_model()
    states = {}
    with d.client(JOB, persist_every=persist_every) as c:
        for step in steps:
            train_step(model, optim, step)
            states[step] = full_state(model, optim)
            c.snapshot(model, optim, step=step, extra={"step": step}).wait_copied()
    return states


def restore_on(d, step: int | None = None) -> tuple[dict[str, torch.Tensor], Any]:  # noqa: ANN001
    model, optim = make_model(seed=1)
    with d.client(JOB) as c:
        extra = c.restore(model, optim, step=step)
        return full_state(model, optim), (extra, c.last_restore)


def peer_segments(d) -> list[str]:  # noqa: ANN001
    """The files of the segments a peer daemon holds replicas in, largest first."""
    marker = shm.SegmentDir.read_marker(d.root)
    base = os.path.join(shm.SHM_DIR, marker)
    files = [os.path.join(base, f) for f in os.listdir(base) if len(f) == 32]
    return sorted(files, key=os.path.getsize, reverse=True)


def test_a_lost_node_restores_its_newest_memory_only_step_from_a_peer(nodes: Nodes) -> None:
    from test_observe import _free_port, _scrape

    b = nodes.peer("b")
    port = _free_port()
    a = nodes.node("a", ["b"], 1, "--metrics-port", str(port))
    states = train_and_snapshot(a, range(1, 6))
    st = replicated(a, JOB, 5)
    assert st["replication"]["jobs"][JOB]["state"] == "replicated"
    deadline = time.monotonic() + 10  # the scrape reads a snapshot the daemon refreshes every 0.5 s
    while (got := _scrape(port)).get(f'ckptd_replicated_step{{job="{JOB}"}}') != 5:
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    assert got[f'ckptd_peer_up{{peer="{nodes.url("b")}"}}'] == 1 and got['ckptd_replication_steps_total{outcome="replicated"}'] >= 1
    assert st["jobs"][JOB]["latest"] == 1  # the first step went to disk; 2..5 stayed in memory only
    ls = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--endpoint", a.endpoint], capture_output=True, text=True, check=True)
    assert f"5  memory only (the daemon holds it in shared memory; not persisted)  replicated to {nodes.url('b')}" in ls.stdout
    with b.client("probe") as c:
        held = c.status()["replicas_held"]
    assert held["steps_held"] == {JOB: [5]} and held["replica_bytes"] > 0
    lose(a)
    a2 = nodes.node("a2", ["b"])  # a replacement node: empty root, empty shared memory, the same peer
    got, (extra, how) = restore_on(a2)
    assert extra == {"step": 5} and how["step"] == 5 and how["source"] == "peer"
    assert_same(got, states[5])


def test_a_corrupt_replica_is_discarded_and_the_next_peer_restores(nodes: Nodes) -> None:
    b = nodes.peer("b")
    nodes.peer("c")
    a = nodes.node("a", ["b", "c"], 2)
    states = train_and_snapshot(a, range(1, 4))
    st = replicated(a, JOB, 3)
    assert st["replication"]["jobs"][JOB]["state"] == "replicated"
    assert st["replication"]["jobs"][JOB]["peers"] == [nodes.url("b"), nodes.url("c")]
    shard = peer_segments(b)[0]  # B's copy of the shard, damaged in its memory
    with open(shard, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    lose(a)
    a2 = nodes.node("a2", ["b", "c"], 2)
    got, (extra, how) = restore_on(a2)
    assert extra == {"step": 3} and how["source"] == "peer"
    assert_same(got, states[3])
    log = a2.log.read_text()
    assert "corrupt" in log and "discarded the corrupt replica" in log
    with b.client("probe") as cl:
        assert cl.status()["replicas_held"]["steps_held"] == {}  # B's bad copy can no longer be picked


def test_a_step_no_source_holds_whole_is_passed_over_for_the_newest_restorable(nodes: Nodes, short_tmp: Path) -> None:
    shared = short_tmp / "shared"
    shared.mkdir()
    b = nodes.peer("b")
    # persisting one step in 2: steps 1 and 3 durable in the shared directory; 4 in memory only, and in B's replica
    a = nodes.node("a", ["b"], 1, "--remote-path", str(shared))
    states = train_and_snapshot(a, range(1, 5), persist_every=2)
    replicated(a, JOB, 4)
    deadline = time.monotonic() + 60
    while not (shared / JOB / "step-3" / "manifest.json").exists():
        assert time.monotonic() < deadline, "step 3 never reached the shared directory"
        time.sleep(0.1)
    for shard in peer_segments(b):
        with open(shard, "r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 64)
    lose(a)
    a2 = nodes.node("a2", ["b"], 1, "--remote-path", str(shared))
    got, (extra, how) = restore_on(a2)
    assert extra["step"] == 3 and how["source"] == "bucket"  # the shared directory's step, the newest restorable
    assert_same(got, states[3])
    assert "restoring step 3, the newest still restorable, instead" in a2.log.read_text()
    with pytest.raises(Exception, match="not a committed checkpoint"):
        restore_on(a2, step=4)  # asked for by number: that step or an error naming why (its bad replica was discarded)


def test_a_peer_that_is_down_or_holds_another_key_never_fails_a_snapshot(nodes: Nodes, short_tmp: Path) -> None:
    other = str(short_tmp / "other.key")
    keygen(other)
    nodes.peer("stranger", key=other)
    a = nodes.node("a", ["stranger", f"tcp://127.0.0.1:{free_port()}"], 2, "--log-level", "DEBUG")
    model, optim = make_model()
    with a.client(JOB) as c:
        for step in range(1, 4):
            train_step(model, optim, step)
            t0 = time.monotonic()
            path = c.snapshot(model, optim, step=step).wait(timeout=60)
            assert time.monotonic() - t0 < 30 and os.path.isdir(path)  # durable, whatever the peers do
        assert c.snapshot(model, optim, step=4).wait_replicated(60) == {"state": "degraded", "peers": [], "reason": None}
    st = replicated(a, JOB, 4, timeout=120)
    rep = st["replication"]
    assert rep["jobs"][JOB]["state"] == "degraded" and rep["jobs"][JOB]["peers"] == []
    assert all(p["ok"] is False and p["error"] for p in rep["peers"])
    assert st["last_error"] is None  # a peer down is degraded replication, not an error of the checkpoints


def test_a_peer_that_stalls_never_holds_up_a_snapshot_and_replication_resumes_when_it_answers(nodes: Nodes) -> None:
    b = nodes.peer("b")
    a = nodes.node("a", ["b"])
    model, optim = make_model()
    with a.client(JOB, persist_every=1000) as c:
        train_step(model, optim, 1)
        assert c.snapshot(model, optim, step=1).wait_replicated(60)["state"] == "replicated"
        os.kill(b.proc.pid, signal.SIGSTOP)  # alive, its port open, answering nothing: the slowest peer there is
        try:
            for step in range(2, 8):
                train_step(model, optim, step)
                c.snapshot(model, optim, step=step).wait_copied()
            with a.rpc() as rpc:  # step 7 complete in A's memory while its replication waits on B
                assert rpc.call("wait", job=JOB, step=7, timeout=30, persist=False)["state"] == "memory"
            st = c.status()
            assert st["jobs"][JOB]["memory_only"] == [7] and st["replication"]["jobs"][JOB]["step"] == 1
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        final = replicated(a, JOB, 7, timeout=120)["replication"]["jobs"][JOB]
        assert final["state"] == "replicated" and final["peers"] == [nodes.url("b")], final
    with b.client("probe") as cl:
        assert cl.status()["replicas_held"]["steps_held"] == {JOB: [7]}


def test_a_snapshot_can_wait_for_its_replication(nodes: Nodes, make_daemon) -> None:  # noqa: ANN001
    nodes.peer("b")
    a = nodes.node("a", ["b"])
    model, optim = make_model()
    with a.client(JOB, persist_every=1000) as c:
        train_step(model, optim, 1)
        first = c.snapshot(model, optim, step=1)
        assert first.wait_replicated(60) == {"state": "replicated", "peers": [nodes.url("b")], "reason": None}
        handles = []
        for step in range(2, 6):  # in a burst: the thread sends the newest queued, the ones it skipped are superseded
            train_step(model, optim, step)
            handles.append(c.snapshot(model, optim, step=step))
        outcomes = [h.wait_replicated(60)["state"] for h in handles]
        assert outcomes[-1] == "replicated" and set(outcomes) <= {"replicated", "superseded"}
    with make_daemon(sub="plain").client(JOB) as c:  # a daemon that replicates nothing says so
        h = c.snapshot(model, optim, step=9)
        with pytest.raises(Exception, match="replicates nothing"):
            h.wait_replicated(10)


def test_peer_settings_that_cannot_work_are_refused_at_start(nodes: Nodes, short_tmp: Path) -> None:
    key = nodes.key
    loose = short_tmp / "loose.key"
    keygen(str(loose))
    os.chmod(loose, 0o644)
    cases = [
        (["--replicas", "1"], "needs at least 1 peers"),
        (["--peer", "tcp://127.0.0.1:1"], "--peer-key"),
        (["--peer", "ipc:///tmp/x", "--peer-key", key], "tcp://HOST:PORT"),
        (["--peer-listen", "tcp://127.0.0.1:1", "--peer-key", str(loose)], "mode 0644"),
        (["--replica-budget", "1G"], "needs --peer-listen"),
    ]
    for i, (args, match) in enumerate(cases):
        d = nodes.make(*args, start=False, sub=f"bad{i}")
        with pytest.raises(RuntimeError, match=match):
            d.start()


@pytest.mark.multiproc
def test_a_two_rank_fsdp2_memory_only_step_comes_back_from_a_peer_on_two_ranks_and_in_one_process(nodes: Nodes, short_tmp: Path) -> None:
    from _dist import run_ranks
    from _memtier_workers import restore_from_daemon
    from _models import make
    from safetensors.torch import load_file
    from test_memory_tier_dist import held_save

    nodes.peer("b")
    a = nodes.node("a", ["b"])
    job = "rep2"
    with held_save(a, short_tmp, "fsdp2", job) as expected:  # steps 1..3, sharded over two gloo ranks; 3 in memory only
        assert replicated(a, job, 3)["replication"]["jobs"][job]["state"] == "replicated"
    lose(a)
    a2 = nodes.node("a2", ["b"])
    outs = run_ranks(2, restore_from_daemon, "fsdp2", a2.endpoint, job, expected, True)  # rank 0 compares bit for bit
    assert [(o["step"], o["extra"]) for o in outs] == [(3, {"rank": r}) for r in range(2)]
    assert {o["source"] for o in outs} <= {"peer", "disk"} and "peer" in {o["source"] for o in outs}
    model, optim = make(seed=7)  # one process, a plain model: another world size and layout
    with a2.client(job) as c:
        assert c.restore(model, optim) == {"rank": 0} and c.last_restore["step"] == 3
    assert_same(full_state(model, optim), load_file(expected))
