"""ckptd.client.rpc.Channel, the torch-free request channel of the client and the CLI: replies, error
replies, no daemon, a closed channel, several threads at once, a reply that comes after its request
timed out, and that the channel and the CLI import no torch. Against a real ``ckptd serve`` (the
conftest fixtures), plus a scripted ROUTER where a test needs replies no daemon sends on demand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import REPO, DaemonProc

import ckptd
from ckptd.client.rpc import Channel
from ckptd.errors import CheckpointError, DaemonUnavailable, ProtocolError
from ckptd.protocol import PROTOCOL_VERSION, encode

MIB = 1 << 20
HANG = 10.0  # "returned instead of hanging": far above every timeout these tests use


def _alloc(ch: Channel, step: int, nbytes: int, **kw: Any) -> dict[str, Any]:
    return ch.call("alloc", job="rpc", rank=0, world_size=1, step=step, nbytes=nbytes, pid=os.getpid(), **kw)


def _slots(ch: Channel, rpc_timeout: float | None = None) -> tuple[dict[str, int], int]:
    st = ch.call("status", rpc_timeout=rpc_timeout)
    return st["slots"], st["deferred_allocs"]


def _until(cond: Callable[[], bool], timeout: float = HANG) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# ---------------------------------------------------------------------------- replies


def test_call_returns_the_reply(daemon: DaemonProc) -> None:
    with daemon.rpc() as ch:
        hello = ch.call("hello")
        assert hello["ok"] is True and hello["v"] == PROTOCOL_VERSION
        assert (hello["root"], hello["pid"], hello["server_version"]) == (daemon.root, daemon.proc.pid, ckptd.__version__)
        latest = ch.call("latest", job="nothing-here")
        assert latest["ok"] is True and latest["step"] is None and latest["path"] is None
        status = ch.call("status", rpc_timeout=5.0)
        assert status["root"] == daemon.root and status["slots"] == {}
        assert len({hello["id"], latest["id"], status["id"]}) == 3  # each request its own id


@pytest.mark.parametrize(
    "op,fields,msg",
    [
        ("release", {"segment": "ckptd-0-0123456789abcdef/" + "0" * 32, "lease": "0" * 32}, "unknown segment 'ckptd-0-"),  # by the op
        ("latest", {"job": "../etc"}, "invalid job name '../etc'"),  # refused as a bad request
        ("hello", {"extra": 1}, "unknown fields ['extra']"),
        ("wait", {"job": "j", "step": 1, "timeout": "soon"}, "field 'timeout' has the wrong type"),
    ],
)
def test_error_reply_raises_protocol_error_naming_the_op(daemon: DaemonProc, op: str, fields: dict[str, Any], msg: str) -> None:
    with daemon.rpc() as ch:
        with pytest.raises(ProtocolError) as e:
            ch.call(op, **fields)
        assert not isinstance(e.value, DaemonUnavailable)
        assert str(e.value).startswith(f"daemon refused {op}: ") and msg in str(e.value), str(e.value)
        assert ch.call("hello")["pid"] == daemon.proc.pid  # the channel still works


# ---------------------------------------------------------------------------- no daemon


@pytest.mark.parametrize(
    "timeout,rpc_timeout",
    [
        (0.3, None),  # the channel's own timeout
        (30.0, 0.3),  # a shorter per-call timeout
        (0.3, 30.0),  # a longer one: the daemon is probed every `timeout`, and nobody answers
    ],
)
def test_no_daemon_raises_daemon_unavailable(short_tmp: Path, timeout: float, rpc_timeout: float | None) -> None:
    endpoint = f"ipc://{short_tmp}/nobody.sock"
    with Channel(endpoint, timeout) as ch:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as e:
            ch.call("status", rpc_timeout=rpc_timeout)
        assert time.monotonic() - t0 < HANG
        assert endpoint in str(e.value) and "(op status)" in str(e.value)
        with pytest.raises(DaemonUnavailable):  # and again, on the fresh socket that replaced the abandoned one
            ch.call("hello", rpc_timeout=0.2)
    with Channel(endpoint, 0.3) as probe:
        assert not probe.alive()


def test_daemon_dying_during_a_held_request_is_noticed(make_daemon) -> None:  # noqa: ANN001
    """An ``alloc`` held back by a full budget, with a long ``rpc_timeout``: the daemon is killed, and
    the call fails within a few probes of ``timeout`` instead of waiting out ``rpc_timeout``."""
    d = make_daemon("--shm-budget", "4M")
    with d.rpc(timeout=0.5) as ch:
        _alloc(ch, 1, 3 * MIB)  # the whole budget
        outcome: list[BaseException | dict[str, Any]] = []

        def held() -> None:
            try:
                outcome.append(_alloc(ch, 2, 3 * MIB, rpc_timeout=120.0))
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=held)
        t.start()
        with d.rpc() as other:
            _until(lambda: _slots(other)[1] == 1)  # the second alloc is deferred
        d.kill()
        t0 = time.monotonic()
        t.join(HANG)
        assert not t.is_alive() and time.monotonic() - t0 < HANG
        assert len(outcome) == 1 and isinstance(outcome[0], DaemonUnavailable), outcome
        assert "(op alloc)" in str(outcome[0])


# ---------------------------------------------------------------------------- closing


def test_closed_channel_refuses_calls_and_close_is_idempotent(daemon: DaemonProc) -> None:
    ch = daemon.rpc()
    assert ch.call("hello")["ok"] and not ch.closed
    ch.close()
    assert ch.closed
    ch.close()  # idempotent
    with pytest.raises(CheckpointError, match="closed") as e:
        ch.call("hello")
    assert not isinstance(e.value, (DaemonUnavailable, ProtocolError))
    with daemon.rpc() as ch2:
        pass
    assert ch2.closed
    with pytest.raises(CheckpointError, match="closed"):
        ch2.call("status")
    Channel(daemon.endpoint, 1.0).close()  # never used: nothing to close but the context


def test_close_after_use_from_several_threads_and_a_timeout_returns(daemon: DaemonProc, short_tmp: Path) -> None:
    """Every thread's socket is closed by ``close()`` (else the context's term would hang)."""
    ch = daemon.rpc()
    threads = [threading.Thread(target=ch.call, args=("hello",)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG)
    dead = Channel(f"ipc://{short_tmp}/nobody.sock", 0.2)
    with pytest.raises(DaemonUnavailable):
        dead.call("hello")
    for c in (ch, dead):
        closer = threading.Thread(target=c.close)
        closer.start()
        closer.join(HANG)
        assert not closer.is_alive() and c.closed


# ---------------------------------------------------------------------------- threads


def test_threads_each_get_their_own_answer(daemon: DaemonProc) -> None:
    """One channel, eight threads started together, each asking about its own job, with error replies
    (which carry no id) mixed in: every answer names the asking thread's job."""
    n_threads, rounds = 8, 25
    start = threading.Barrier(n_threads)
    wrong: list[str] = []
    done: list[int] = []

    with daemon.rpc() as ch:

        def worker(i: int) -> None:
            start.wait()
            for r in range(rounds):
                if r % 5 == 4:
                    try:
                        ch.call("latest", job=f"bad/{i}")
                        wrong.append(f"thread {i}: no error")
                    except ProtocolError as e:
                        if f"'bad/{i}'" not in str(e):
                            wrong.append(f"thread {i}: {e}")
                else:
                    rep = ch.call("hot_open", job=f"job{i}", step=None, pid=os.getpid())
                    if f"'job{i}'" not in rep["reason"]:
                        wrong.append(f"thread {i}: {rep}")
            done.append(i)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG * 3)
    assert not wrong, wrong[:5]
    assert sorted(done) == list(range(n_threads))


def test_a_held_request_blocks_neither_other_threads_nor_gives_up_while_the_daemon_answers(make_daemon) -> None:  # noqa: ANN001
    """A deferred ``alloc`` with ``rpc_timeout`` far above ``timeout`` keeps waiting (the daemon answers
    the probes) while the other threads' calls are answered, and gets its grant when memory frees up."""
    d = make_daemon("--shm-budget", "4M")
    with d.rpc(timeout=0.3) as ch:
        first = _alloc(ch, 1, 3 * MIB)
        outcome: list[BaseException | dict[str, Any]] = []

        def held() -> None:
            try:
                outcome.append(_alloc(ch, 2, 3 * MIB, rpc_timeout=60.0))
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=held)
        t.start()
        # this thread's own calls: the channel's 0.3 s is the held call's probe interval, not a deadline for them
        try:
            _until(lambda: _slots(ch, HANG)[1] == 1)  # this thread's calls are answered while the other's is held
            time.sleep(1.5)  # five of the held call's `timeout`s
            assert t.is_alive() and not outcome, outcome
            assert ch.call("hello", rpc_timeout=HANG)["pid"] == d.proc.pid
        finally:
            ch.call("release", rpc_timeout=HANG, segment=first["segment"], lease=first["lease"])
            t.join(HANG)
        assert not t.is_alive() and len(outcome) == 1 and isinstance(outcome[0], dict), outcome
        grant = outcome[0]
        assert grant["ok"] and grant["size"] >= 3 * MIB
        ch.call("release", rpc_timeout=HANG, segment=grant["segment"], lease=grant["lease"])
        assert _slots(ch, HANG) == ({"free": 1}, 0)


# ---------------------------------------------------------------------------- late replies


def test_late_grant_is_never_the_answer_to_a_later_request(make_daemon) -> None:  # noqa: ANN001
    """An ``alloc`` deferred past its ``rpc_timeout``; freeing the budget makes the daemon grant it late.
    The calls after it get their own answers, not that grant."""
    d = make_daemon("--shm-budget", "4M", "--lease-timeout", "5")  # long enough for the calls below on a loaded host
    with d.rpc(timeout=5.0) as ch:
        first = _alloc(ch, 1, 3 * MIB)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match=r"\(op alloc\)"):
            _alloc(ch, 2, 3 * MIB, rpc_timeout=0.3)
        assert time.monotonic() - t0 < HANG
        assert _slots(ch) == ({"leased": 1}, 1)  # still deferred in the daemon

        # the daemon sends the late grant just before this reply
        released = ch.call("release", segment=first["segment"], lease=first["lease"])
        assert released["ok"] and "segment" not in released and "size" not in released, released
        slots, deferred = _slots(ch)
        assert (slots, deferred) == ({"leased": 1}, 0)  # the late grant was made: the freed slot went to it
        hello = ch.call("hello")
        assert hello["pid"] == d.proc.pid and "segment" not in hello

        # the late grant took the only slot under a lease token nobody received: the first lease's token
        # does not release it, the lease timeout does (and retires the segment: its holder might write to it)
        with pytest.raises(ProtocolError, match="not leased to this client"):
            ch.call("release", segment=first["segment"], lease=first["lease"])
        _until(lambda: _slots(ch) == ({}, 0))
        again = _alloc(ch, 3, MIB)  # and the next alloc is answered with a lease of its own, in a new segment
        assert again["ok"] and again["segment"] != first["segment"]
        ch.call("release", segment=again["segment"], lease=again["lease"])
        assert _slots(ch) == ({"free": 1}, 0)


class ScriptedRouter:
    """A ROUTER on an ipc endpoint that hands each request to the test: ``next()`` gives
    ``(identity, request)``; ``send`` answers any identity with any reply."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def next(self, timeout: float = HANG) -> tuple[bytes, dict[str, Any]]:
        assert self.sock.poll(int(timeout * 1000)), "no request came"
        ident, frame = self.sock.recv_multipart()
        return ident, json.loads(frame)

    def send(self, ident: bytes, req_id: int | None, **fields: Any) -> None:
        self.sock.send_multipart([ident, encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": True, **fields})])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def router(short_tmp: Path) -> Iterator[tuple[ScriptedRouter, str]]:
    endpoint = f"ipc://{short_tmp}/router.sock"
    r = ScriptedRouter(endpoint)
    try:
        yield r, endpoint
    finally:
        r.close()


def _call_in_thread(ch: Channel, op: str, **kw: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(ch.call(op, **kw))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_reply_with_another_requests_id_is_skipped(router: tuple[ScriptedRouter, str]) -> None:
    r, endpoint = router
    with Channel(endpoint, 5.0) as ch:
        t, out = _call_in_thread(ch, "hello")
        ident, req = r.next()
        r.send(ident, req["id"] - 1, answer="stale")  # an earlier request's reply, on the same socket
        r.send(ident, req["id"] + 1000, answer="stranger")
        r.send(ident, req["id"], answer="mine")
        t.join(HANG)
        assert len(out) == 1 and isinstance(out[0], dict) and out[0]["answer"] == "mine", out

        t, out = _call_in_thread(ch, "hello", rpc_timeout=0.3)  # only a stale reply comes: no answer
        ident, req = r.next()
        r.send(ident, req["id"] - 1, answer="stale")
        t.join(HANG)
        assert len(out) == 1 and isinstance(out[0], DaemonUnavailable), out


def _refuse_with(r: ScriptedRouter, ident: bytes, req_id: int, code: str) -> None:
    r.sock.send_multipart([ident, encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "code": code, "error": f"said {code}"})])


def test_a_busy_reply_is_asked_again_and_a_refusal_is_not(router: tuple[ScriptedRouter, str]) -> None:
    r, endpoint = router
    with Channel(endpoint, 5.0) as ch:
        t, out = _call_in_thread(ch, "commit", step=7)
        asked = []
        for _ in range(3):  # busy twice (an earlier attempt still in flight), then taken
            ident, req = r.next()
            asked.append(req)
            if len(asked) < 3:
                _refuse_with(r, ident, req["id"], "busy")
            else:
                r.send(ident, req["id"])
        t.join(HANG)
        assert out == [{"v": PROTOCOL_VERSION, "id": asked[-1]["id"], "ok": True}], out
        assert [(q["op"], q["step"]) for q in asked] == [("commit", 7)] * 3 and len({q["id"] for q in asked}) == 3

        t, out = _call_in_thread(ch, "commit", step=8)  # refused: raised at once, never asked again
        ident, req = r.next()
        _refuse_with(r, ident, req["id"], "refused")
        t.join(HANG)
        assert len(out) == 1 and type(out[0]) is ProtocolError and str(out[0]) == "daemon refused commit: said refused", out
        assert not r.sock.poll(300)


def test_late_reply_without_id_is_not_the_next_answer(router: tuple[ScriptedRouter, str]) -> None:
    """A reply that carries no id (the daemon's bad-request form) arrives after its request timed out:
    the next request of the same thread must get its own reply, not that one."""
    r, endpoint = router
    with Channel(endpoint, 5.0) as ch:
        with pytest.raises(DaemonUnavailable):
            ch.call("hello", rpc_timeout=0.3)
        ident, req = r.next()
        assert req["op"] == "hello"
        r.send(ident, None, answer="late")  # to the abandoned request's socket
        r.send(ident, req["id"], answer="late too")
        time.sleep(0.2)  # let them land, were that socket still read
        seen: list[dict[str, Any]] = []

        def serve_one() -> None:
            ident2, req2 = r.next()
            seen.append(req2)
            r.send(ident2, req2["id"], answer="mine")

        t = threading.Thread(target=serve_one)
        t.start()
        rep = ch.call("status")  # on the thread whose request timed out
        t.join(HANG)
        assert [q["op"] for q in seen] == ["status"]
        assert rep["answer"] == "mine", rep


# ---------------------------------------------------------------------------- no torch


def _modules_after(code: str) -> set[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_rpc_and_cli_do_not_import_torch(daemon: DaemonProc) -> None:
    """In a fresh interpreter: import the channel and the CLI, talk to the daemon through both, and no
    torch module is loaded. The same check sees torch once the trainer's Client is imported."""
    report = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ckptd'))))"
    code = (
        "import ckptd.client.rpc, ckptd.cli\n"
        f"with ckptd.client.rpc.Channel({daemon.endpoint!r}, 10.0) as ch:\n"
        "    assert ch.call('hello')['ok']\n"
        f"assert ckptd.cli.main(['status', '--json', '--endpoint', {daemon.endpoint!r}]) == 0\n"
        f"{report}\n"
    )
    loaded = _modules_after(code)
    assert {"ckptd.client.rpc", "ckptd.cli"} <= loaded
    assert not {m for m in loaded if m.split(".")[0] == "torch"}, sorted(loaded)
    control = _modules_after(f"import ckptd.client.client\n{report}\n")
    assert "torch" in control


def test_a_thread_per_request_does_not_exhaust_the_socket_limit(daemon: DaemonProc) -> None:
    """A socket per thread: a long run makes a thread per background copy or DCP save (ZMQ allows 1023 sockets a
    context); the sockets of threads that ended are closed when the next one is made."""
    with Channel(daemon.endpoint, 10.0) as ch:
        for _ in range(1100):
            t = threading.Thread(target=ch.call, args=("hello",))
            t.start()
            t.join()
        assert len(ch._sockets) <= 2
        assert ch.call("hello")["ok"]


def test_a_channel_dropped_in_a_reference_cycle_without_close_does_not_hang_the_garbage_collector(daemon) -> None:  # noqa: ANN001
    # the user's mistake: a client never closed, held by a reference cycle (an exception's frames). Collected
    # together, zmq's Context.__del__ used to term() the context while the cycle's sockets were still open, and the
    # trainer hung inside the garbage collector (seen once in CI). In a child process, so a hang is a timeout here.
    code = (
        "import gc, sys, threading\n"
        "from ckptd.client.rpc import Channel\n"
        "for _ in range(20):\n"
        "    ch = Channel(sys.argv[1], 5.0)\n"
        "    ch.call('hello')\n"
        "    t = threading.Thread(target=ch.call, args=('hello',)); t.start(); t.join()\n"
        "    loop = [ch]; loop.append(loop); ch.loop = loop\n"
        "    del ch, loop, t\n"
        "    gc.collect()\n"
        "print('collected')\n"
    )
    r = subprocess.run([sys.executable, "-c", code, daemon.endpoint], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "collected" in r.stdout, r.stderr[-2000:]


def test_a_snapshot_whose_alloc_waits_across_a_daemon_restart_asks_the_new_daemon(make_daemon) -> None:  # noqa: ANN001
    """The budget is full, a snapshot's alloc waits, and the daemon is restarted (``systemctl restart``): the old
    daemon took the request with it, and the new one answered hello, so the client waited out alloc_timeout (10
    minutes by default) and then said the daemon was not running. It now sees another instance answer and asks it
    (found by a review of the client–daemon conversation)."""
    import torch

    d = make_daemon("--shm-budget", "4M")
    holder = d.client("other", timeout=2)
    holder._alloc(0, 1, 0, 4 << 20, wait=False)  # the whole budget
    c = d.client("t", timeout=10, alloc_timeout=300)  # a restart takes seconds on a loaded machine: 2 s failed one CI run
    out: dict[str, Any] = {}

    def snap() -> None:
        try:
            out["path"] = c.snapshot(torch.nn.Linear(64, 64), step=1, blocking=True).wait(60)
        except Exception as e:  # reported below
            out["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=snap)
    t.start()
    try:
        with d.client("probe", timeout=2) as probe:
            _until(lambda: probe.status()["deferred_allocs"] == 1)
        assert d.stop() == 0
        d.start()
        up = time.monotonic()
        t.join(60)
        assert not t.is_alive() and out.get("path", "").endswith("step-1"), out
        assert time.monotonic() - up < 30  # not alloc_timeout
    finally:
        holder._leases.clear()
        holder.close()
        t.join(60)
        c.close()


def test_a_daemon_of_another_root_taking_the_endpoint_over_is_refused_not_followed(make_daemon) -> None:  # noqa: ANN001
    """Another daemon (another root) took the endpoint over: the client went on with it, latest() said None (a resume
    would start the job over) and new steps landed in the other root. It is refused now, naming both roots."""
    a = make_daemon(sub="a")
    c = a.client("job1", timeout=3)
    try:
        assert c.latest() is None
        a.stop()
        b = make_daemon(start=False, sub="b")
        b.endpoint = a.endpoint
        b.start()
        with pytest.raises(CheckpointError, match=rf"now serves root {b.root}, not {a.root} \(another daemon took the endpoint over\)"):
            c.latest()
    finally:
        c.close()
