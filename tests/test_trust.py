"""Lose nothing, trust nothing: each case is an attack by another local user or client, or a user's
action (a rollback, a replaced node), against a real daemon. Cases that need a second user run as
root and act as ``nobody`` (``tests/_as_user.py``); they skip otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from _as_user import needs_nobody, python_as_nobody
from _models import assert_same, full_state, make, train_step
from conftest import REPO
from test_remote import remote_toml

from ckptd import shm
from ckptd.errors import ProtocolError
from ckptd.format import encode_manifest
from ckptd.layout import complete_steps, step_dir
from ckptd.protocol import request, validate_record
from ckptd.storage.s3 import RemoteConfig


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` (Python) as user nobody, group nogroup."""
    return subprocess.run(python_as_nobody(code, *args), capture_output=True, text=True, timeout=60, cwd="/")


def _save(c, model, optim, step: int, states: dict) -> None:  # noqa: ANN001
    train_step(model, optim, step)
    states[step] = full_state(model, optim)
    c.snapshot(model, optim, step=step, extra={"step": step}, blocking=True).wait(60)


def _roll_back(c, model, optim, saved: tuple[int, ...], to: int, states: dict) -> None:  # noqa: ANN001
    """Save ``saved``, then restore step ``to`` (a loss spike: the user goes back)."""
    for step in saved:
        _save(c, model, optim, step, states)
    assert c.restore(model, optim, step=to) == {"step": to}


# ---------------------------------------------------------------------------- a replaced node, a rollback


def test_a_replaced_node_resumes_from_the_bucket(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    """New daemon, empty root, the same bucket holding step 6: latest() names step 6, so README's resume
    idiom (``if latest() is not None: restore()``) resumes instead of starting from zero."""
    conf = remote_toml(short_tmp / "r.toml", s3_bucket)
    old = make_daemon("--config", conf, sub="old")
    model, optim = make()
    states: dict = {}
    with old.client("node") as c:
        for step in (5, 6):
            _save(c, model, optim, step, states)
    from test_remote import wait_uploaded

    wait_uploaded(old, "node", 6)
    old.stop()

    new = make_daemon("--config", conf, sub="new")  # another node: its root has never seen the job
    assert complete_steps(new.root, "node") == []
    with new.client("node") as c:
        assert c.latest() == 6
        m2, o2 = make(seed=3)
        assert c.restore(m2, o2) == {"step": 6}
        assert c.last_restore["source"] == "bucket"
        assert_same(full_state(m2, o2), states[6])


def test_a_rollback_keeps_the_new_line_and_latest_follows_it(make_daemon) -> None:  # noqa: ANN001
    """keep=3; steps 100, 200, 300; the user restores step 100 (a loss spike) and trains on, saving 110,
    120, 130. latest names 130 (committed last), retention drops the abandoned 200 and 300 before any
    step of the new line, and a crash resumes the new line."""
    d = make_daemon("--keep", "3")
    model, optim = make()
    states: dict = {}
    with d.client("rb") as c:
        _roll_back(c, model, optim, (100, 200, 300), 100, states)
        for step in (110, 120, 130):
            _save(c, model, optim, step, states)
            assert c.latest() == step
    assert complete_steps(d.root, "rb") == [110, 120, 130]

    d.kill()  # a crash: the restarted trainer resumes the new line
    d.start()
    with d.client("rb") as c:
        assert c.latest() == 130
        m2, o2 = make(seed=5)
        assert c.restore(m2, o2) == {"step": 130}
        assert_same(full_state(m2, o2), states[130])
    out = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--root", d.root], capture_output=True, text=True, timeout=60).stdout
    assert [line.split()[1] for line in out.splitlines() if "<- latest" in line] == ["130"]


def test_the_abandoned_branch_is_kept_until_retention_drops_it_but_never_resumed(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon("--keep", "5")
    model, optim = make()
    states: dict = {}
    with d.client("ab") as c:
        _roll_back(c, model, optim, (10, 20, 30), 10, states)
        _save(c, model, optim, 11, states)
        assert c.latest() == 11
        assert complete_steps(d.root, "ab") == [10, 11, 20, 30]  # 20 and 30 stay, restorable by number
        m2, o2 = make(seed=8)
        c.restore(m2, o2)
        assert_same(full_state(m2, o2), states[11])
        c.restore(m2, o2, step=30)
        assert_same(full_state(m2, o2), states[30])


# ---------------------------------------------------------------------------- the segment directory


@needs_nobody
def test_another_user_cannot_plant_a_segment_or_a_commit_record(make_daemon) -> None:  # noqa: ANN001
    """nobody knows neither the directory's name (random, in the daemon's 0700 root) nor may enter it; the
    names it can predict (the old flat ones) and symlinks in /dev/shm are ignored; the daemon starts,
    snapshots and restarts as if nothing were there."""
    d = make_daemon()
    model, optim = make()
    with d.client("forge") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
    seg = d.segments()[0]
    private = os.path.dirname(shm.path_of(seg))
    uid = os.getuid()
    plant = f"""
import os, sys
shm = {shm.SHM_DIR!r}
planted = []
for name in ("ckptd-{uid}-00000000-00000000", "ckptd-{uid}-00000000-00000000.commit", "ckptd-{uid}-deadbeefdeadbeef"):
    with open(os.path.join(shm, name), "w") as f:
        f.write('{{"job":"forge","rank":0,"world_size":1,"step":99}}')
    planted.append(name)
os.symlink("/etc/passwd", os.path.join(shm, "ckptd-{uid}-link"))
try:
    open(os.path.join({private!r}, "0" * 32), "w")
    print("ENTERED")
except PermissionError:
    print("DENIED")
try:
    os.listdir({private!r})
    print("LISTED")
except PermissionError:
    print("NOLIST")
"""
    r = as_nobody(plant)
    try:
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["DENIED", "NOLIST"]
        d.kill()
        d.start()
        with d.client("forge") as c:
            assert c.latest() == 1  # nothing adopted as step 99
            train_step(model, optim, 2)
            c.snapshot(model, optim, step=2, blocking=True).wait(60)
        assert complete_steps(d.root, "forge") == [1, 2]
    finally:
        for name in os.listdir(shm.SHM_DIR):
            if name.startswith(f"ckptd-{uid}-0000") or name in (f"ckptd-{uid}-deadbeefdeadbeef", f"ckptd-{uid}-link"):
                os.unlink(os.path.join(shm.SHM_DIR, name))


@needs_nobody
def test_a_foreign_file_in_the_segment_directory_is_never_adopted_and_never_fatal(make_daemon) -> None:  # noqa: ANN001
    """Only root could put another user's file (or a symlink) into the daemon's directory; even then the
    daemon adopts nothing it did not make, does not follow the link, and restarts fine."""
    d = make_daemon()
    model, optim = make()
    with d.client("f") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
    d.kill()
    segs = shm.SegmentDir(d.root)
    rec = {"job": "f", "rank": 0, "world_size": 1, "local_world_size": 1, "step": 7, "nbytes": 4096, "replicas": {}, "committed_at": 1}
    # a foreign segment with a valid-looking record, owned by nobody
    foreign = f"{segs.name}/{'a' * 32}"
    with open(shm.path_of(foreign), "wb") as f:
        f.write(b"\0" * 4096)
    segs.write_record(foreign, validate_record(rec, b"{}"))
    os.chown(shm.path_of(foreign), 65534, 65534)
    # a symlink to a file outside, with a record of our own
    link = f"{segs.name}/{'b' * 32}"
    os.symlink("/etc/hostname", shm.path_of(link))
    segs.write_record(link, validate_record({**rec, "step": 8}, b"{}"))
    before = open("/etc/hostname", "rb").read()
    segs.close()  # the test lets go of the directory's lock: the daemon takes it and looks at what is there
    d.start()
    with d.client("f") as c:
        assert c.latest() == 1 and c.hello()["ok"]
        assert c.status()["slots"] == {}  # never adopted: no step 7 or 8 is pending or made
    assert complete_steps(d.root, "f") == [1] and not os.path.exists(step_dir(d.root, "f", 7) + ".tmp")
    assert open("/etc/hostname", "rb").read() == before
    assert os.path.exists(shm.path_of(foreign))  # not ours: left alone (and logged)
    assert "ignoring segment" in d.log.read_text()
    os.unlink(shm.path_of(foreign))
    os.unlink(shm.path_of(foreign) + shm.RECORD_SUFFIX)


def test_a_tree_cannot_rewrite_the_commit_record(make_daemon) -> None:  # noqa: ANN001
    """The commit's tree frame used to be spliced into the record's JSON: a tree of
    ``{...},"job":"../escape","step":7`` took over the record after a restart and the step was written to
    ``<root>/../escape``. Now the tree is stored after the record; a restart fails that step (its tree is
    not JSON) and writes nothing outside the root."""
    d = make_daemon()
    model, optim = make()
    with d.client("j") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
    shard = open(os.path.join(d.root, "j", "step-1", "rank-00000.safetensors"), "rb").read()
    d.stop()
    d.start(["--workers", "1", "--write-rate-limit", "1k"])  # one slow persist thread: both commits stay staged
    evil = b'{"model":{}},"job":"../escape","step":7,"x":{"y":1}'
    with d.rpc() as rpc:
        for step, tree in ((2, b"{}"), (3, evil)):
            rep = rpc.call("alloc", job="j", rank=0, world_size=1, step=step, nbytes=len(shard), pid=os.getpid())
            with open(shm.path_of(rep["segment"]), "r+b") as f:
                f.write(shard)
            fields = dict(job="j", rank=0, world_size=1, local_world_size=1, step=step, nbytes=len(shard), replicas={})
            rpc.call("commit", segment=rep["segment"], lease=rep["lease"], frames=(tree,), **fields)
    d.kill()
    d.start([])  # full speed: the restart persists what the records hold
    with d.rpc() as rpc:
        assert rpc.call("wait", job="j", step=2, timeout=20.0)["state"] == "durable"
        rep = rpc.call("wait", job="j", step=3, timeout=20.0)
    assert rep["state"] == "failed" and "tree is not valid JSON" in rep["error"]  # the tree, not the record
    root = Path(d.root)
    assert not (root.parent / "escape").exists() and not (root / "escape").exists()
    assert sorted(os.listdir(root / "j")) == ["latest", "step-1", "step-2"]


# ---------------------------------------------------------------------------- leases and messages


@pytest.mark.parametrize("keep", [0, "half"])
def test_a_lessee_that_truncates_its_segment_cannot_kill_the_daemon(daemon, keep: int | str) -> None:  # noqa: ANN001
    """The attack: lease a slot, let a persist read it once, lease it again, truncate the file (the lessee holds
    it open for writing) and commit. The daemon kept a mapping of the segment and read past its end: SIGBUS.
    Now it reads segments with pread: the step fails, saying so, and the daemon answers on."""
    from _rig import shard, tree

    data = shard(1, 0, 1)
    fields = dict(job="j", rank=0, world_size=1, local_world_size=1, nbytes=len(data), replicas={})
    with daemon.rpc() as rpc:
        for step in (1, 2):
            rep = rpc.call("alloc", job="j", rank=0, world_size=1, step=step, nbytes=len(data), pid=os.getpid())
            fd = os.open(shm.path_of(rep["segment"]), os.O_RDWR)
            try:
                os.pwrite(fd, data, 0)
                if step == 2:
                    os.ftruncate(fd, 0 if keep == 0 else len(data) // 2)
            finally:
                os.close(fd)
            rpc.call("commit", segment=rep["segment"], lease=rep["lease"], frames=(tree(0),), step=step, **fields)
            done = rpc.call("wait", job="j", step=step, timeout=30.0)
            if step == 1:
                assert done["state"] == "durable"
        assert done["state"] == "failed" and "truncated" in done["error"], done
        assert daemon.proc.poll() is None and rpc.call("hello")["ok"]
        assert rpc.call("latest", job="j")["step"] == 1


def test_another_client_cannot_commit_or_release_a_lease_it_did_not_take(daemon) -> None:  # noqa: ANN001
    with daemon.rpc() as a, daemon.rpc() as b:
        lease = a.call("alloc", job="j", rank=0, world_size=1, step=1, nbytes=4096, pid=os.getpid())
        seg = lease["segment"]
        with pytest.raises(ProtocolError, match="missing field 'lease'"):
            b.call("release", segment=seg)
        with pytest.raises(ProtocolError, match="not leased to this client"):
            b.call("release", segment=seg, lease="0" * 32)
        fields = dict(job="j", rank=0, world_size=1, local_world_size=1, step=1, nbytes=4096, replicas={})
        with pytest.raises(ProtocolError, match="not leased to this client"):
            b.call("commit", segment=seg, lease="f" * 32, frames=(b"{}",), **fields)
        assert b.call("status")["slots"] == {"leased": 1}  # still A's
        a.call("release", segment=seg, lease=lease["lease"])
        assert b.call("status")["slots"] == {"free": 1}


def test_a_leaked_lease_token_is_useless_to_another_process(daemon) -> None:  # noqa: ANN001
    """Even holding the token (seen in a log, say), another process cannot release or commit the lease:
    over ipc the daemon also checks that the request comes from the process that took it."""
    with daemon.rpc() as rpc:
        lease = rpc.call("alloc", job="j", rank=0, world_size=1, step=1, nbytes=4096, pid=os.getpid())
        code = (
            "import sys; from ckptd.client.rpc import Channel; from ckptd.errors import ProtocolError;"
            "ch = Channel(sys.argv[1], 30.0)\n"
            "try:\n    ch.call('release', segment=sys.argv[2], lease=sys.argv[3]); print('RELEASED')\n"
            "except ProtocolError as e:\n    print(e)"
        )
        cmd = [sys.executable, "-c", code, daemon.endpoint, lease["segment"], lease["lease"]]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert "another process took the lease" in out.stdout, (out.stdout, out.stderr)
        assert rpc.call("status")["slots"] == {"leased": 1}
        rpc.call("release", segment=lease["segment"], lease=lease["lease"])


def test_a_lease_whose_holder_dies_is_reaped_whatever_pid_it_claimed(daemon) -> None:  # noqa: ANN001
    """A client claims pid 1 (always alive; or its pid in another PID namespace) and dies holding a lease:
    the daemon takes the holder's pid from the socket (SO_PEERCRED), not from the message, and reaps it."""
    code = (
        "import sys; from ckptd.client.rpc import Channel; ch = Channel(sys.argv[1], 30.0);"
        "print(ch.call('alloc', job='j', rank=0, world_size=1, step=1, nbytes=4096, pid=1)['segment'])"
    )
    out = subprocess.run([sys.executable, "-c", code, daemon.endpoint], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    with daemon.rpc() as rpc:
        deadline = time.monotonic() + 20
        while rpc.call("status")["slots"] != {"free": 1} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rpc.call("status")["slots"] == {"free": 1}


def test_a_req_socket_gets_its_answer(daemon) -> None:  # noqa: ANN001
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(daemon.endpoint)
        s.send(request("hello", 5))
        assert s.poll(5000), "a REQ client got no answer"
        rep = json.loads(s.recv())
        assert rep["ok"] and rep["id"] == 5
        s.send(b"garbage")
        assert s.poll(5000) and json.loads(s.recv())["code"] == "bad_request"
    finally:
        s.close(0)
        ctx.term()


def test_hostile_numbers_never_reach_housekeeping(daemon) -> None:  # noqa: ANN001
    """``alloc`` with pid 2**64 was accepted and the next housekeeping tick died in os.kill; a world
    size of 2**40 made recovery build a set of 2**40 integers. Both are refused; the daemon lives on."""
    with daemon.rpc() as rpc:
        for fields in ({"pid": 2**64}, {"pid": 0}, {"world_size": 2**40}):
            msg = {"job": "j", "rank": 0, "world_size": 1, "step": 1, "nbytes": 10, "pid": os.getpid(), **fields}
            with pytest.raises(ProtocolError, match="bad_request|outside|process id"):
                rpc.call("alloc", **msg)
        time.sleep(1.2)  # two housekeeping ticks
        assert rpc.call("hello")["pid"] == daemon.proc.pid
    assert daemon.proc.poll() is None


# ---------------------------------------------------------------------------- files the daemon writes


def test_files_the_daemon_writes_are_private_from_birth(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("u") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(60)
    for p in [os.path.join(daemon.root, "u", "latest"), path, *(os.path.join(path, n) for n in os.listdir(path))]:
        assert os.stat(p).st_mode & 0o077 == 0, (p, oct(os.stat(p).st_mode))


def test_a_planted_latest_tmp_symlink_is_not_followed(daemon, tmp_path: Path) -> None:  # noqa: ANN001
    """A member of the daemon's group (or a stale leftover) leaves ``latest.tmp`` as a symlink to a file
    elsewhere: the daemon replaces the link, never writes through it."""
    model, optim = make()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    with daemon.client("s") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
        os.symlink(victim, os.path.join(daemon.root, "s", "latest.tmp"))
        train_step(model, optim, 2)
        c.snapshot(model, optim, step=2, blocking=True).wait(60)
        assert c.latest() == 2
    assert victim.read_text() == "precious"


def test_a_clock_stepped_back_across_a_restart_does_not_order_new_steps_first(make_daemon) -> None:  # noqa: ANN001
    """Step 1 was committed by a daemon whose clock ran 10 minutes ahead (or by a replaced node's): after
    the restart the next commit must still come later in commit order, or latest would stay on step 1
    and retention (keep 1) would delete the step just committed."""
    d = make_daemon("--keep", "1")
    model, optim = make()
    with d.client("clk") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(60)
    d.stop()
    manifest_path = os.path.join(path, "manifest.json")
    manifest = json.loads(open(manifest_path).read())
    manifest["committed_at"] = time.time_ns() + 600 * 10**9
    with open(manifest_path, "wb") as f:
        f.write(encode_manifest(manifest))
    d.start()
    with d.client("clk") as c:
        train_step(model, optim, 2)
        assert c.snapshot(model, optim, step=2, blocking=True).wait(60).endswith("step-2")
        assert c.latest() == 2
    assert complete_steps(d.root, "clk") == [2]


@pytest.mark.parametrize(
    "stamp", [lambda: time.time_ns() + 600 * 10**9, lambda: (1 << 63) - 1], ids=["ten-minutes-ahead", "the-largest-stamp"]
)
def test_a_relaunch_resuming_a_step_another_nodes_clock_stamped_ahead_orders_its_new_steps_after_it(make_daemon, stamp) -> None:  # noqa: ANN001
    """The daemon keeps running across the relaunch (so it remembers the job's last commit time), and the step
    the relaunch restores was stamped 10 minutes ahead by another node's clock (a multi-node step downloaded
    from the bucket; that node has left the job since). The relaunch's next step must come later in commit
    order than the one it resumed from, or latest stays on the old step and retention (keep 1) deletes the
    step just committed. A stamp at the largest value a manifest may hold (a corrupt or hostile one) must not
    push the next stamps past it: their fragments would be refused and the step lost."""
    d = make_daemon("--keep", "1")
    model, optim = make()
    with d.client("skew") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
        train_step(model, optim, 2)
        path = c.snapshot(model, optim, step=2, blocking=True).wait(60)
    manifest_path = os.path.join(path, "manifest.json")
    manifest = json.loads(open(manifest_path).read())
    manifest["committed_at"] = stamp()
    with open(manifest_path + ".new", "wb") as f:
        f.write(encode_manifest(manifest))
    os.replace(manifest_path + ".new", manifest_path)
    relaunched, optim2 = make()
    with d.client("skew") as c:
        c.restore(relaunched, optim2)
        assert c.last_restore is not None and c.last_restore["step"] == 2
        train_step(relaunched, optim2, 3)
        assert c.snapshot(relaunched, optim2, step=3, blocking=True).wait(60).endswith("step-3")
        assert c.latest() == 3
    assert complete_steps(d.root, "skew") == [3]
