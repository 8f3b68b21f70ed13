"""Who may use the daemon: the owner only by default, or one configured group (socket, segments, root)."""

from __future__ import annotations

import errno
import grp
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from _as_user import python_as
from conftest import REPO, DaemonProc

from ckptd import shm

NOBODY = 65534
# a system group that exists on Debian-like images and that the test user is not relying on
GROUP = "adm"


def _group_gid() -> int:
    """The test group's gid; the test is skipped where the group does not exist."""
    try:
        return grp.getgrnam(GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no group {GROUP!r} here")


def _group_daemon(base: Path) -> tuple[int, DaemonProc]:
    """A daemon (not started) serving the test group, in ``base`` (made traversable for the group's processes)."""
    gid = _group_gid()
    os.chmod(base, 0o755)
    return gid, DaemonProc(base, ["--group", GROUP])


def _mode(path: str | Path) -> tuple[int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def _snapshot_one(d: DaemonProc) -> None:
    m = torch.nn.Linear(4, 4)
    with d.client() as c:
        c.snapshot(m, step=1, blocking=True).wait()


def _segments(d: DaemonProc) -> list[str]:
    return shm.segments_of(os.path.abspath(d.root))


def test_owner_only_by_default(make_daemon) -> None:
    d = make_daemon()
    _snapshot_one(d)
    assert _mode(d.endpoint[len("ipc://") :])[0] == 0o600
    assert _mode(d.root)[0] == 0o700
    segs = _segments(d)
    assert segs
    assert _mode(os.path.dirname(shm.path_of(segs[0])))[0] == 0o700  # private: nobody else lists or creates in it
    for name in segs:
        assert _mode(shm.path_of(name))[0] == 0o600
        if os.path.exists(shm.path_of(name) + shm.RECORD_SUFFIX):
            assert _mode(shm.path_of(name) + shm.RECORD_SUFFIX)[0] == 0o600


def test_unknown_group_is_a_config_error(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ckptd", "serve", "--root", str(tmp_path / "r"), "--group", "no-such-group-ckptd"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "unknown group 'no-such-group-ckptd'" in r.stderr


_PROBE = """
import zmq
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(sys.argv[1])
s.send_multipart([b'{"op":"hello","v":1,"id":1}'])
print("answered" if s.poll(3000) else "silent")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_group_members_get_in_and_others_do_not() -> None:
    try:
        gid = grp.getgrnam(GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no group {GROUP!r} here")
    base = Path(tempfile.mkdtemp(prefix="ckg"))
    os.chmod(base, 0o755)  # the probes, as another user, must reach the socket's directory
    d = DaemonProc(base, ["--group", GROUP])
    d.endpoint = f"ipc://{base / 'run' / 'd.sock'}"  # a directory the daemon creates with the group's mode
    try:
        d.start()
        _snapshot_one(d)
        assert _mode(base / "run") == (0o750, gid)
        assert _mode(base / "run" / "d.sock") == (0o660, gid)
        assert _mode(d.root) == (0o2750, gid)
        for name in _segments(d):
            assert _mode(shm.path_of(name)) == (0o640, gid)  # committed: members may read it, no longer write it
        assert _mode(os.path.dirname(shm.path_of(name))) == (0o710, gid)  # members open a named segment, cannot list
        step_dir = Path(d.root) / "t" / "step-1"
        assert os.stat(step_dir).st_gid == gid  # inherited through the setgid root

        def probe(g: int) -> str:
            argv = python_as(_PROBE, d.endpoint, uid=NOBODY, gid=g, groups=[g], imports=["zmq"])
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            return r.stdout.strip()

        assert probe(gid) == "answered"
        assert probe(NOBODY) == "silent"
    finally:
        d.cleanup()
        import shutil

        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_with_a_group_a_crashed_daemon_adopts_its_commit_records(short_tmp: Path) -> None:
    """With ``--group`` the daemon runs under umask 027: records were made 0640 while adoption wanted 0660,
    so after a crash every commit (a memory-only step here) was called "not a file this daemon made", lost,
    and its segment left in /dev/shm for good. Records are 0600 (only the daemon reads them), checked so."""
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        pytest.skip(f"no group {GROUP!r} here")
    d = DaemonProc(short_tmp, ["--group", GROUP])
    try:
        d.start()
        m = torch.nn.Linear(4, 4)
        with d.client(persist_every=100) as c:
            c.snapshot(m, step=1, blocking=True).wait()
            c.snapshot(m, step=2, blocking=True)  # committed when it returns, held in memory only
            assert d.rpc().call("wait", job="t", step=2, timeout=0.0, persist=False)["state"] == "memory"
            records = [n for n in _segments(d) if os.path.exists(shm.path_of(n) + shm.RECORD_SUFFIX)]
            assert records and all(_mode(shm.path_of(n) + shm.RECORD_SUFFIX)[0] == 0o600 for n in records)
            d.kill()  # a crash: the commit records are all that is left of step 2
        d.start()
        assert d.rpc().call("wait", job="t", step=2, timeout=60.0)["state"] == "durable"  # adopted, then persisted
        with d.client() as c:
            assert c.latest() == 2
        assert "not a file this daemon made" not in d.log.read_text()
    finally:
        d.cleanup()


_OPENS = """
for path in sys.argv[1:]:
    for how, flag in (("read", os.O_RDONLY), ("write", os.O_RDWR)):
        try:
            os.close(os.open(path, flag))
            print(how, "ok")
        except OSError as e:
            print(how, e.errno)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_a_group_member_cannot_rewrite_another_jobs_committed_shard(short_tmp: Path) -> None:
    """The attack (``--group``): a member asks ``hot_open`` for another job's step, which names its segments,
    and opens them for writing to change the shard before it is persisted (memory-only steps have no
    checksum). Committed segments are read-only to the group, and a segment whose name went to a reader is
    renamed before it is leased again, so the name learned is of no use later either."""
    gid, d = _group_daemon(short_tmp)
    try:
        d.start()
        m = torch.nn.Linear(4, 4)
        with d.client("victim") as c, d.rpc() as rpc:
            c.snapshot(m, step=1, blocking=True).wait()
            held = rpc.call("hot_open", job="victim", step=None, pid=os.getpid())
            paths = [shm.path_of(seg) for seg in held["segments"].values()]
            r = subprocess.run(python_as(_OPENS, *paths, uid=NOBODY, gid=gid, groups=[gid]), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split("\n")[:2] == ["read ok", f"write {errno.EACCES}"]
            rpc.call("hot_close", pin=held["pin"], segments=list(held["segments"].values()))
            c.snapshot(m, step=2, blocking=True).wait()  # the victim's rank leases its slot again
            assert not any(os.path.exists(p) for p in paths)  # under a new name: the one learned opens nothing
            assert rpc.call("latest", job="victim")["step"] == 2
    finally:
        d.cleanup()


_KEEPER = r"""
import json, mmap, struct, time, zmq
s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(sys.argv[1])
def call(**kw):
    s.send(json.dumps({"v": 1, "id": 1, **kw}).encode())
    assert s.poll(10000), "no answer"
    return json.loads(s.recv())
# a lease under the victim's job and rank, its segment kept open for writing, then given back to the pool
rep = call(op="alloc", job="victim", rank=0, world_size=1, step=None, nbytes=1 << 16, pid=os.getpid())
leased = os.open("/dev/shm/" + rep["segment"], os.O_RDWR)
assert call(op="release", segment=rep["segment"], lease=rep["lease"])["ok"]
print("ready", flush=True)
sys.stdin.readline()  # the victim snapshotted step 1 (memory only)
for _ in range(200):  # the step is in memory once the daemon sealed it, just after the commit
    rep = call(op="hot_open", job="victim", step=None, pid=os.getpid())
    if rep.get("segments"):
        break
    time.sleep(0.05)
read = os.open("/dev/shm/" + next(iter(rep["segments"].values())), os.O_RDONLY)  # a reader's fd, kept
call(op="hot_close", pin=rep["pin"], segments=list(rep["segments"].values()))
print("read", flush=True)
sys.stdin.readline()  # the victim snapshotted step 2 (memory only) into its slot again
for fd in (leased, os.open(f"/proc/self/fd/{read}", os.O_RDWR) if os.access(f"/proc/self/fd/{read}", os.W_OK) else None):
    if fd is not None:
        with mmap.mmap(fd, os.fstat(fd).st_size) as m:
            m[:] = m[:].replace(struct.pack("<f", 1.0), struct.pack("<f", 666.0))
print("reopened" if os.access(f"/proc/self/fd/{read}", os.W_OK) else "read-only", flush=True)
"""
_KEEPER_IMPORTS = ("json", "mmap", "struct", "time", "zmq")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_a_group_member_keeps_no_write_access_to_a_segment_it_leased_or_read(short_tmp: Path) -> None:
    """Two attacks by a member of the group (another user) on a victim job's memory-only steps: it leases a slot
    under the victim's job name and rank, keeps the segment open for writing and gives it back, so the victim's
    rank is handed that very segment as its own; or it reads the victim's step (hot_open) and keeps the fd, which it
    reopens for writing through /proc/self/fd once the segment is leased (0660) again under whatever name. Either
    way its writes changed the victim's shards. A segment whose name went to another user is now retired instead."""
    gid, d = _group_daemon(short_tmp)
    att = None
    try:
        d.start()
        argv = python_as(_KEEPER, d.endpoint, uid=NOBODY, gid=gid, groups=[gid], imports=_KEEPER_IMPORTS)
        att = subprocess.Popen(argv, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")  # fmt: skip
        assert att.stdout.readline() == "ready\n", att.stderr.read() if att.poll() is not None else ""
        m = torch.nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            m.weight.fill_(1.0)
        with d.client("victim", persist_every=100) as c:
            c.snapshot(m, step=1, blocking=True)
            att.stdin.write("go\n"), att.stdin.flush()
            assert att.stdout.readline() == "read\n", att.stderr.read() if att.poll() is not None else ""
            c.snapshot(m, step=2, blocking=True)
            att.stdin.write("go\n"), att.stdin.flush()
            assert att.stdout.readline() == "read-only\n", att.stderr.read() if att.poll() is not None else ""
            assert att.wait(30) == 0, att.stderr.read()
            c.wait()
        m2 = torch.nn.Linear(4, 4, bias=False)
        with d.client("victim") as c:
            c.restore(m2, hot=False)
        assert torch.equal(m2.weight, torch.ones(4, 4))
    finally:
        if att is not None and att.poll() is None:
            att.kill()
        d.cleanup()


@pytest.mark.parametrize("change", ["group-added", "group-dropped"])
def test_a_restart_with_another_group_setting_keeps_the_committed_shard(short_tmp: Path, change: str) -> None:
    """The daemon is killed with a committed shard not yet durable and restarted with ``--group`` added (or
    dropped): the previous run's own segment (0600, or 0640) was taken for a stranger's file, never adopted,
    never unlinked, and the acknowledged step was lost. It is taken over now, with this run's mode and group."""
    try:
        gid = grp.getgrnam(GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no group {GROUP!r} here")
    group = ["--group", GROUP]
    first, second = ([], group) if change == "group-added" else (group, [])
    d = DaemonProc(short_tmp, [*first, "--write-rate-limit", "1k"])  # 1 kB/s: the shard stays staged
    try:
        d.start()
        m = torch.nn.Linear(64, 64)
        with d.client() as c:
            c.snapshot(m, step=1, blocking=True)  # committed: the daemon owns it
        segs = _segments(d)
        d.kill()
        d.start([*second, "--keep", "3"])
        with d.rpc() as rpc:
            rep = rpc.call("wait", job="t", step=1, timeout=20.0)
        assert rep["state"] == "durable", rep
        seg_dir = os.path.dirname(shm.path_of(segs[0]))
        assert _mode(seg_dir) == ((0o710, gid) if second else (0o700, _mode(seg_dir)[1]))
        d.stop()
        assert not os.path.exists(seg_dir)  # nothing left behind
    finally:
        d.cleanup()


_STATUS_AS = """
from ckptd.client.rpc import Channel
from ckptd.errors import DaemonUnavailable
try:
    Channel(sys.argv[1], 5.0).call("status")
    print("answered")
except DaemonUnavailable as e:
    print(e)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
def test_a_user_the_daemon_does_not_let_in_is_told_so_not_that_no_daemon_runs(make_daemon) -> None:  # noqa: ANN001
    # another user's `ckptd status` against a private daemon: before, a 10 s wait and "is `ckptd serve` running?"
    d = make_daemon()
    os.chmod(os.path.dirname(d.endpoint[len("ipc://") :]), 0o755)  # the directory is reachable, the 0600 socket is not
    argv = python_as(_STATUS_AS, d.endpoint, uid=NOBODY, gid=NOBODY, imports=["grp", "pwd", "socket", "ckptd.client.rpc", "ckptd.errors"])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "does not let this user in: permission denied" in r.stdout, r.stdout
