"""The daemon answers every bad message with an error and keeps serving; slots and backpressure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import zmq

from ckptd.errors import ProtocolError
from ckptd.protocol import request


class Raw:
    """A bare DEALER socket: sends anything, reads one reply."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(endpoint)

    def ask(self, *frames: bytes, timeout: float = 5.0) -> dict:
        self.s.send_multipart(list(frames))
        assert self.s.poll(int(timeout * 1000)), "daemon did not answer"
        return json.loads(self.s.recv())

    def close(self) -> None:
        self.s.close(0)
        self.ctx.term()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def raw(daemon):  # noqa: ANN001, ANN201
    r = Raw(daemon.endpoint)
    yield r
    r.close()


def _op(op: str, **f) -> bytes:  # noqa: ANN003
    return request(op, 1, **f)


ONE = {"world_size": 1, "local_world_size": 1}  # a one-rank job on one node
NO_SEGMENT, NO_LEASE = "ckptd-0-0123456789abcdef/" + "0" * 32, "0" * 32
BAD_MESSAGES = [
    ("garbage", [b"\x00\x01garbage"], "bad_request"),
    ("two frames", [b"{}", b"{}"], "bad_request"),
    ("commit without its tree frame", [_op("commit", job="j", rank=0, **ONE, step=1, segment=NO_SEGMENT, lease=NO_LEASE,
                                           nbytes=1, replicas={})], "bad_request"),
    ("hello with an extra frame", [_op("hello"), b"{}"], "bad_request"),
    ("json list", [b"[]"], "bad_request"),
    ("unknown op", [_op("explode")], "bad_request"),
    ("bad job", [_op("latest", job="../x")], "bad_request"),
    ("unknown segment", [_op("commit", job="j", rank=0, **ONE, step=1, segment=NO_SEGMENT, lease=NO_LEASE, nbytes=1,
                              replicas={}), b"{}"],
     "refused"),
    ("malformed segment name", [_op("release", segment="../../etc/passwd", lease=NO_LEASE)], "refused"),
    ("pid beyond pid_max", [_op("alloc", job="j", rank=0, world_size=1, step=1, nbytes=10, pid=2**64)], "bad_request"),
    ("world of 2**40 ranks", [_op("alloc", job="j", rank=0, world_size=2**40, step=1, nbytes=10, pid=os.getpid())], "bad_request"),
    ("a retired op", [_op("locate", job="j", step=5)], "bad_request"),
    ("alloc over budget", [_op("alloc", job="j", rank=0, world_size=1, step=1, nbytes=1 << 50, pid=os.getpid())], "refused"),
]  # fmt: skip


@pytest.mark.parametrize("frames,code", [c[1:] for c in BAD_MESSAGES], ids=[c[0] for c in BAD_MESSAGES])
def test_bad_message_gets_error_and_daemon_keeps_serving(raw: Raw, daemon, frames, code) -> None:  # noqa: ANN001
    rep = raw.ask(*frames)
    assert rep["ok"] is False and rep["code"] == code and rep["error"]
    assert raw.ask(_op("hello"))["ok"] is True
    assert daemon.proc.poll() is None


def test_commit_must_match_lease(daemon) -> None:  # noqa: ANN001
    with daemon.rpc() as rpc:
        rep = rpc.call("alloc", job="j", rank=0, world_size=1, step=1, nbytes=100, pid=os.getpid())
        seg, lease = rep["segment"], rep["lease"]
        with pytest.raises(ProtocolError, match="does not match the lease"):
            rpc.call("commit", job="j", rank=0, **ONE, step=2, segment=seg, lease=lease, nbytes=100, replicas={}, frames=(b"{}",))
        with pytest.raises(ProtocolError, match="exceeds segment size"):
            rpc.call("commit", job="j", rank=0, **ONE, step=1, segment=seg, lease=lease, nbytes=1 << 40, replicas={}, frames=(b"{}",))
        rpc.call("release", segment=seg, lease=lease)
        with pytest.raises(ProtocolError, match="not leased"):
            rpc.call("release", segment=seg, lease=lease)


def test_garbage_shard_fails_the_step_not_the_daemon(daemon) -> None:  # noqa: ANN001
    """A committed slot whose bytes are not a shard: wait() raises, nothing is committed."""
    with daemon.client("j") as c, daemon.rpc() as rpc:
        rep = rpc.call("alloc", job="j", rank=0, world_size=1, step=1, nbytes=4096, pid=os.getpid())
        rpc.call(
            "commit", job="j", rank=0, **ONE, step=1, segment=rep["segment"], lease=rep["lease"], nbytes=4096, replicas={}, frames=(b"{}",)
        )
        rep = rpc.call("wait", job="j", step=1, timeout=10.0)
        assert rep["state"] == "failed" and "header" in rep["error"]
        assert c.latest() is None
        assert not os.path.exists(os.path.join(daemon.root, "j", "step-1.tmp"))
        assert c.hello()["ok"]


def test_malformed_tree_fails_the_step_not_the_daemon(daemon) -> None:  # noqa: ANN001
    from _models import make

    model, optim = make()
    with daemon.client("j") as c, daemon.rpc() as rpc:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        rep = rpc.call("alloc", job="j", rank=0, world_size=1, step=2, nbytes=1 << 20, pid=os.getpid())
        seg = rep["segment"]
        src = os.path.join(daemon.root, "j", "step-1", "rank-00000.safetensors")
        shard = open(src, "rb").read()
        with open(f"/dev/shm/{seg}", "r+b") as f:
            f.write(shard)  # a valid shard, so only the tree is wrong
        rpc.call(
            "commit",
            job="j",
            rank=0,
            **ONE,
            step=2,
            segment=seg,
            lease=rep["lease"],
            nbytes=len(shard),
            replicas={},
            frames=(b"{not json",),
        )
        rep = rpc.call("wait", job="j", step=2, timeout=10.0)
        assert rep["state"] == "failed" and "tree is not valid JSON" in rep["error"]
        assert c.latest() == 1 and c.hello()["ok"]


def test_backpressure_defers_alloc_until_a_slot_frees(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon("--shm-budget", "4M")
    with d.client("j") as c1, d.rpc() as rpc, Raw(d.endpoint) as raw:
        first = rpc.call("alloc", job="j", rank=0, world_size=2, step=1, nbytes=3 << 20, pid=os.getpid())
        # the second rank's request waits for the first slot to be released
        s = raw.s
        s.send(request("alloc", 99, job="j", rank=1, world_size=2, step=1, nbytes=3 << 20, pid=os.getpid()))
        assert not s.poll(700), "alloc over budget should have been deferred"
        assert c1.status()["deferred_allocs"] == 1
        rpc.call("release", segment=first["segment"], lease=first["lease"])
        assert s.poll(5000)
        rep = json.loads(s.recv())
        assert rep["ok"] and rep["id"] == 99


def test_dead_trainer_lease_is_reclaimed(daemon) -> None:  # noqa: ANN001
    """A trainer that dies mid-copy (leased, never committed) leaves no step and frees its slot."""
    code = (
        f"import os, signal; from ckptd.client.rpc import Channel; c = Channel({daemon.endpoint!r}, 30.0);"
        "c.call('alloc', job='j', rank=0, world_size=1, step=1, nbytes=1000, pid=os.getpid());"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    with daemon.client("j") as c:
        deadline = time.monotonic() + 10
        while c.status()["slots"].get("leased", 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.status()["slots"].get("leased", 0) == 0
        assert c.latest() is None
    assert not os.path.exists(os.path.join(daemon.root, "j"))


def test_second_daemon_on_same_endpoint_refuses(daemon, make_daemon) -> None:  # noqa: ANN001
    rc = subprocess.run(
        [sys.executable, "-m", "ckptd", "serve", "--root", daemon.root + "2", "--endpoint", daemon.endpoint],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert rc.returncode == 1 and "already serving" in rc.stderr
    assert not os.path.exists(daemon.root + "2")  # a start refused at the endpoint makes no root (nor its lock file)


def test_a_daemon_still_starting_on_the_endpoint_keeps_a_second_one_off_it(short_tmp) -> None:  # noqa: ANN001
    """A daemon that bound its socket but is still recovering (deleting a big half-removed step) answers no hello;
    a second daemon with another root took the socket over, and the first one served nobody while it kept its
    root. Found by a review of the daemon's life cycle. The endpoint's lock, held from the check on, keeps it off."""
    import fcntl

    sock_dir = short_tmp / "e"
    sock_dir.mkdir(mode=0o700)
    endpoint = f"ipc://{sock_dir}/d.sock"
    with open(sock_dir / "d.sock.lock", "w") as held:  # what the first daemon holds from its start on
        fcntl.flock(held, fcntl.LOCK_EX)
        rc = subprocess.run(
            [sys.executable, "-m", "ckptd", "serve", "--root", str(short_tmp / "other"), "--endpoint", endpoint],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert rc.returncode == 1 and "or starting on it" in rc.stderr, rc.stderr
    assert not (short_tmp / "other").exists()


def test_clean_stop_unlinks_segments(daemon) -> None:  # noqa: ANN001
    with daemon.rpc() as rpc:
        rep = rpc.call("alloc", job="j", rank=0, world_size=1, step=1, nbytes=100, pid=os.getpid())
        rpc.call("release", segment=rep["segment"], lease=rep["lease"])
    assert daemon.segments() == [rep["segment"]]
    assert daemon.stop() == 0
    assert daemon.segments() == []


def _idle_tasks(pid: int) -> list[int]:
    import psutil

    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            io = psutil.Process(int(tid)).ionice()
            if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE and (io.ioclass, io.value) == (psutil.IOPRIO_CLASS_BE, 7):
                out.append(int(tid))
        except (OSError, psutil.Error):
            pass
    return out


@pytest.mark.parametrize("flag,idle", [((), True), (("--no-idle-priority",), False)])
def test_persist_threads_use_idle_cpu_and_disk_time(make_daemon, flag, idle) -> None:  # noqa: ANN001
    import torch

    d = make_daemon(*flag)
    with d.client("prio") as c:
        c.snapshot(torch.nn.Linear(8, 8), step=1, blocking=True).wait()  # the persist pool's threads now exist
    tasks = _idle_tasks(d.proc.pid)
    assert (len(tasks) >= 1) is idle, tasks
    assert d.proc.pid not in tasks  # the request loop keeps its normal priority


def test_the_daemon_process_never_loads_torch(daemon) -> None:  # noqa: ANN001
    """Start-up speed and memory: the daemon handles bytes and JSON only, even after a persist."""
    import torch

    with daemon.client("t") as c:
        c.snapshot(torch.nn.Linear(4, 4), step=1, blocking=True).wait()
        c.status()
    maps = open(f"/proc/{daemon.proc.pid}/maps").read()
    assert "libtorch" not in maps and "libc10" not in maps
