"""Bugs a review of the daemon found, each seen from the buggy or hostile client that hits it (raw frames on a
DEALER socket): a message of thousands of frames, an alloc that can never fit the budget, a step number a
failed shard kept from a relaunch, a dead client's partial memory-tier step committed without ``run``."""

from __future__ import annotations

import itertools
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq
from _poll import until
from conftest import REPO

from ckptd import shm
from ckptd.daemon.access import Access
from ckptd.daemon.admission import Admission
from ckptd.daemon.endpoint import bind
from ckptd.daemon.steps import StepState, StepTable
from ckptd.errors import CheckpointError, DaemonBusy, ProtocolError
from ckptd.format import build_layout
from ckptd.protocol import MAX_MESSAGE_BYTES, request

MiB = 1 << 20


def shard(n: int = 16) -> bytes:
    """A valid one-tensor shard file of ``n`` fp32 values."""
    import torch

    layout = build_layout([("model/w", "model/w", torch.float32, (n,), (n,), (0,))])
    buf = bytearray(layout.file_size)
    buf[: layout.data_start] = layout.header
    buf[layout.data_start :] = torch.ones(n).numpy().tobytes()
    return bytes(buf)


class Wire:
    """A bare socket speaking the wire protocol by hand."""

    def __init__(self, endpoint: str, kind: int = zmq.DEALER) -> None:
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(kind)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(endpoint)
        self.ids = itertools.count(1)

    def reply(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.s.poll(int(timeout * 1000)), "the daemon did not answer"
        return json.loads(self.s.recv_multipart()[-1])

    def call(self, op: str, *frames: bytes, within: float = 30.0, **fields: Any) -> dict[str, Any]:
        """``op``'s reply, if it comes ``within`` seconds."""
        self.s.send_multipart([request(op, next(self.ids), **fields), *frames])
        return self.reply(within)

    def save(self, job: str, step: int, data: bytes, *, ws: int = 1, rank: int = 0, **commit: Any) -> dict[str, Any]:
        """``rank``'s alloc, copy and commit of ``data`` as ``step``: the commit's reply (a refused lease is released)."""
        lease = self.call("alloc", job=job, rank=rank, world_size=ws, step=step, nbytes=len(data), pid=os.getpid())
        assert lease["ok"], lease
        fd = os.open(shm.path_of(lease["segment"]), os.O_RDWR)
        try:
            with mmap.mmap(fd, len(data)) as m:
                m[:] = data
        finally:
            os.close(fd)
        rep = self.call(
            "commit", b"{}", job=job, rank=rank, world_size=ws, local_world_size=ws, step=step, segment=lease["segment"],
            lease=lease["lease"], nbytes=len(data), replicas={}, **commit,
        )  # fmt: skip
        if not rep["ok"]:
            self.call("release", segment=lease["segment"], lease=lease["lease"])
        return rep

    def state(self, job: str, step: int, persist: bool = True) -> dict[str, Any]:
        return self.call("wait", job=job, step=step, timeout=20, persist=persist)

    def close(self) -> None:
        self.s.close(0)
        self.ctx.term()


@pytest.fixture
def wires() -> Any:
    made: list[Wire] = []

    def make(endpoint: str, kind: int = zmq.DEALER) -> Wire:
        made.append(Wire(endpoint, kind))
        return made[-1]

    yield make
    for w in made:
        w.close()


# ------------------------------------------------------------------ 1. a message of many frames

# a daemon whose socket hands out frames that note every copy of their bytes (a file, one size a line)
COUNTING = """
import sys, zmq
LOG = {log!r}

class Counted:
    def __init__(self, frame): self.frame = frame
    def __len__(self): return len(self.frame)
    def __getattr__(self, name): return getattr(self.frame, name)
    def __bytes__(self): return self.bytes
    def _copied(self):
        with open(LOG, "a") as f: f.write(f"{{len(self.frame)}}\\n")
    @property
    def bytes(self): self._copied(); return self.frame.bytes
    @property
    def buffer(self): self._copied(); return self.frame.buffer

recv = zmq.Socket.recv_multipart
def recv_multipart(self, flags=0, copy=True, track=False):
    parts = recv(self, flags, copy=copy, track=track)
    return parts if copy else [Counted(p) for p in parts]
zmq.Socket.recv_multipart = recv_multipart
from ckptd.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_a_message_of_more_frames_than_any_request_is_refused_with_none_of_its_frames_copied(make_daemon, wires) -> None:  # noqa: ANN001
    # ZMQ_MAXMSGSIZE caps each frame: 48 frames of 32 MiB were one 1.5 GiB message, and the loop copied every frame
    # (3.1 GB resident) before it counted them. 40 frames of 256 KiB here, each as large as any frame gets to the loop
    d = make_daemon(start=False)
    copies = d.base / "copies"
    d.launcher = ["-c", COUNTING.format(log=str(copies))]
    d.start()
    big = os.urandom(256 << 10)
    dealer, req = wires(d.endpoint), wires(d.endpoint, zmq.REQ)
    for w in (dealer, req):  # REQ: its envelope (the empty delimiter) is stripped, and the refusal still reaches it
        w.s.send_multipart([request("hello", 1), *[big] * 40])
        rep = w.reply()
        assert rep["ok"] is False and rep["code"] == "bad_request" and "at most 2 frames" in rep["error"], rep
        assert "41" in rep["error"]
        assert w.call("hello")["ok"] is True, "the daemon goes on answering"
    copied = [int(n) for n in copies.read_text().split()]
    assert copied and max(copied) < len(big), f"frames of the refused messages were copied: {sorted(copied)[-3:]}"
    assert d.proc is not None and d.proc.poll() is None


def test_the_daemons_socket_lets_few_whole_messages_wait_per_connection(short_tmp: Path) -> None:
    # libzmq's default high-water mark let 1,000 messages wait per connection, each frame up to 64 MiB
    ctx = zmq.Context()
    sock = bind(Access(None), ctx, f"ipc://{short_tmp / 'run' / 's'}")
    try:
        assert sock.getsockopt(zmq.RCVHWM) * MAX_MESSAGE_BYTES <= 1 << 30
        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
    finally:
        sock.close(0)
        ctx.term()


# ------------------------------------------------------------------ 2. an alloc that can never fit


def test_an_alloc_whose_segment_can_never_fit_the_budget_is_refused_at_once_and_drops_no_memory_step(make_daemon, wires) -> None:  # noqa: ANN001
    # 7 MiB is not a whole number of 2 MiB units: a 7 MiB shard's segment takes 8. It was accepted, dropped the job's
    # memory-only step to make room, then waited out its timeout
    d = make_daemon("--shm-budget", str(7 * MiB))
    w = wires(d.endpoint)
    assert w.save("j", 1, shard(), run=1)["ok"] and w.state("j", 1)["state"] == "durable"
    assert w.save("j", 2, shard(), run=1, persist_every=100)["ok"]
    assert w.state("j", 2, persist=False)["state"] == "memory"
    for nbytes in (7 * MiB, 6 * MiB + 1):
        rep = w.call("alloc", job="j", rank=0, world_size=1, step=3, nbytes=nbytes, pid=os.getpid(), timeout=3)
        assert rep["ok"] is False and "exceeds the shared-memory budget" in rep["error"], rep
    st = w.call("status")
    assert st["memory_steps_dropped"] == 0 and st["deferred_allocs"] == 0
    assert w.state("j", 2, persist=False)["state"] == "memory", "the job's newest state was dropped for nothing"
    assert "use at most 6291456 bytes" in d.log.read_text(), "the start-up log says how much of the budget segments use"
    rep = w.call("alloc", job="j", rank=0, world_size=1, step=3, nbytes=4 * MiB, pid=os.getpid(), wait=False)
    assert rep["ok"], rep  # 4 MiB fits beside the step held in memory
    w.call("release", segment=rep["segment"], lease=rep["lease"])


# ------------------------------------------------------------------ 3. a failed step number and a relaunch


def test_a_relaunch_saves_again_a_step_number_whose_shard_failed(daemon, wires) -> None:  # noqa: ANN001
    w = wires(daemon.endpoint)
    assert w.save("j", 1, shard(), run=1)["ok"] and w.state("j", 1)["state"] == "durable"
    assert w.save("j", 5, b"\0" * 4096, run=1)["ok"]  # not a shard: its persist fails the step
    assert w.state("j", 5)["state"] == "failed"
    rep = w.save("j", 5, shard(), run=1)
    assert not rep["ok"] and "step 5 of job j already failed" in rep["error"], rep  # the run that failed it: refused

    # a relaunch (run 1 is gone) resumed from step 1 and reaches step 5 again. The step fails at its first shard
    # thread's report; the seal of the same shard may still be reading it, and until it is done the daemon refuses
    # a new attempt, saying to retry (a real relaunch comes seconds later): so does this one, for a while
    def relaunch() -> dict[str, Any] | None:
        rep = w.save("j", 5, shard(), run=2)
        return None if not rep["ok"] and rep["code"] == "busy" and "still being written; retry" in rep["error"] else rep

    rep = until(relaunch, what="the failed attempt's shards to be done with")
    assert rep["ok"], rep
    assert w.state("j", 5)["state"] == "durable"
    rep = w.save("j", 5, shard(), run=3)  # complete now: only a run that rolled back past it saves it again
    assert not rep["ok"] and "already committed and this client restored no step" in rep["error"], rep
    assert w.save("j", 5, shard(), run=3, after=1)["ok"] and w.state("j", 5)["state"] == "durable"


def _failed_while_rank_0_writes(make_daemon, wires, mib: int) -> tuple[Any, Wire]:  # noqa: ANN001
    """A daemon writing at 1 MB/s, and step 4 of job ``r`` (run 1, 2 ranks) failed while rank 0's ``mib``-MiB shard
    is still being written, for about ``mib`` seconds: rank 1's commit was not a shard."""
    d = make_daemon("--write-rate-limit", "1M")
    w = wires(d.endpoint)
    assert w.save("r", 4, shard(mib << 18), ws=2, run=1)["ok"]
    assert w.save("r", 4, b"\0" * 4096, ws=2, rank=1, run=1)["ok"]  # not a shard: the step fails at once
    assert w.state("r", 4)["state"] == "failed"
    return d, w


def test_a_relaunchs_snapshot_waits_out_an_earlier_attempt_still_being_written(make_daemon, wires, caplog) -> None:  # noqa: ANN001
    # the user's relaunch, moments after step 4 failed on rank 1 while rank 0's shard still goes to a throttled disk:
    # the daemon answers its commit busy (it changed nothing), and the client asks again until the shard is written
    import torch

    import ckptd

    d, w = _failed_while_rank_0_writes(make_daemon, wires, 4)
    probe = w.save("r", 4, shard(), run=2)
    assert not probe["ok"] and probe["code"] == "busy" and "still being written; retry" in probe["error"], probe
    assert w.state("r", 4)["state"] == "failed"  # the busy answer changed nothing

    model = torch.nn.Linear(8, 8)
    with caplog.at_level("INFO", logger="ckptd.client"), ckptd.Client(d.endpoint, job="r") as c:
        c.snapshot(model, step=4, blocking=True).wait()
        assert any("still being written; retry; asking again" in r.getMessage() for r in caplog.records)
        fresh = torch.nn.Linear(8, 8)
        assert c.restore(fresh).step == 4
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_a_commit_refused_busy_for_longer_than_the_client_asks_raises_daemon_busy(make_daemon, wires, monkeypatch) -> None:  # noqa: ANN001
    import torch

    import ckptd
    from ckptd.client import rpc

    monkeypatch.setattr(rpc, "BUSY_RETRY_S", 0.5)
    d, w = _failed_while_rank_0_writes(make_daemon, wires, 8)
    with ckptd.Client(d.endpoint, job="r") as c:
        with pytest.raises(CheckpointError, match=r"still being written; retry; asked again for 0.5 s$") as e:
            c.snapshot(torch.nn.Linear(8, 8), step=4, blocking=True).wait()
        assert isinstance(e.value.__cause__, DaemonBusy), repr(e.value.__cause__)
        assert c.snapshot(torch.nn.Linear(8, 8), step=5, blocking=True).wait() is not None  # the next step is not held up
    st = w.call("status")
    assert st["slots"].get("leased", 0) == 0, st  # the refused attempt's slot was given back


def test_a_failed_step_still_being_written_is_not_started_afresh_by_a_relaunch(tmp_path: Path) -> None:
    steps = StepTable(lambda job, step: None)
    settled: list[Any] = []
    adm = Admission(str(tmp_path), steps, None, lambda k, t: settled.append(k))  # type: ignore[arg-type]
    track = adm.admit("j", 4, 0, 2, 2, peer=None, after=None, run=1)
    steps.record_commit(("j", 4), track, 0, 2, 1)
    track.inflight = 1
    assert steps.fail(("j", 4), "no space left on device")
    with pytest.raises(DaemonBusy, match="still being written; retry"):
        adm.admit("j", 4, 0, 2, 2, peer=None, after=None, run=2)
    track.inflight = 0
    with pytest.raises(ProtocolError, match="already failed: no space left on device"):
        adm.admit("j", 4, 1, 2, 2, peer=None, after=None, run=1)  # the run that failed it
    fresh = adm.admit("j", 4, 0, 2, 2, peer=None, after=None, run=2)
    assert fresh is not track and fresh.committed == set() and fresh.state is StepState.PENDING
    adm.writing = lambda job, step: 1  # an earlier attempt's shard still queued for a persist thread
    steps.tracks[("j", 4)] = track
    with pytest.raises(DaemonBusy, match="retry"):
        adm.admit("j", 4, 0, 2, 2, peer=None, after=None, run=3)


# ------------------------------------------------------------------ 4. a dead client's partial step, without run

# a client process that commits rank 0 of a step and exits (argv: endpoint, job, step, world size, shard hex, persist_every)
ONE_COMMIT = """
import sys
sys.path.insert(0, {tests!r})
from test_hostile_clients import Wire
endpoint, job, step, ws, data, every = sys.argv[1:]
w = Wire(endpoint)
rep = w.save(job, int(step), bytes.fromhex(data), ws=int(ws), persist_every=int(every))
assert rep["ok"], rep
w.close()
"""


def _commit_and_exit(endpoint: str, job: str, step: int, ws: int) -> None:
    code = ONE_COMMIT.format(tests=str(REPO / "tests"))
    args = [endpoint, job, str(step), str(ws), shard().hex(), "1000"]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_dead_clients_partial_memory_step_committed_without_run_is_abandoned_and_frees_its_slot(make_daemon, wires) -> None:  # noqa: ANN001
    # commits that name no launch recorded no committer: the step stayed pending, its slot held, for ever
    d = make_daemon("--shm-budget", str(8 * MiB))
    w = wires(d.endpoint)
    _commit_and_exit(d.endpoint, "norun", 1, 1)  # a job's first step goes to disk
    assert w.state("norun", 1)["state"] == "durable"
    _commit_and_exit(d.endpoint, "norun", 2, 2)  # rank 0 of 2, kept in memory; the process is gone, rank 1 never comes
    done = until(lambda: (r := w.state("norun", 2, persist=False))["state"] != "pending" and r, timeout=30, what="step 2 abandoned")
    assert done["state"] == "failed" and "its run ended" in done["error"], done
    st = until(lambda: (s := w.call("status"))["slots"].get("held", 0) == 0 and s, what="the held slot freed")
    assert set(st["slots"]) == {"free"} and st["jobs"]["norun"]["in_flight"] == [], st


# ------------------------------------------------------------------ 5. a flood of held requests


def test_a_flood_of_waits_is_refused_once_too_many_are_held_and_the_daemon_answers_others(make_daemon, wires) -> None:  # noqa: ANN001
    """Each ``wait`` on a pending step is held up to 30 s: a client sending them as fast as it can grew the daemon's
    memory with its rate (1.1 M held waits, +220 MB in 20 s in a review). Past a bound they are refused."""
    d = make_daemon(start=False)
    d.launcher = [
        "-c",
        "import sys, ckptd.daemon.waiters as w; w.MAX_WAITERS = 64\nfrom ckptd.cli import main\nraise SystemExit(main(sys.argv[1:]))",
    ]
    d.start()
    w = wires(d.endpoint)
    assert w.save("j", 1, shard(), ws=2)["ok"]  # rank 0 of 2: the step stays pending
    for i in range(80):
        w.s.send_multipart([request("wait", 1000 + i, job="j", step=1, timeout=30)])
    refused = []
    while w.s.poll(2000):
        rep = json.loads(w.s.recv_multipart()[-1])
        refused.append(rep)
        if len(refused) == 16:
            break
    assert len(refused) == 16 and all(not r["ok"] and "64 requests wait for an answer already" in r["error"] for r in refused)
    assert wires(d.endpoint).call("hello")["ok"]  # others are served
