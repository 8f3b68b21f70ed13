"""Steps protected by name from retention (``Client.protect`` / ``unprotect``, ckptd/daemon/protected.py).

A framework keeps a file that points at a step (Lightning's top-k ``epoch=0-step=8.ckpt``); the daemon's
retention keeps the newest ``--keep`` steps and must never remove one such a file names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from _models import full_state, make, train_step
from _poll import until
from conftest import REPO, DaemonProc
from test_daemon import Raw
from test_remote import remote_toml, wait_uploaded

from ckptd.errors import CheckpointError
from ckptd.layout import is_complete, step_dir
from ckptd.protocol import request
from ckptd.storage.local import committed_at, complete_steps
from ckptd.storage.remote import remote_steps
from ckptd.storage.s3 import S3Store

JOB = "p"


def _patched(make_daemon: Any, code: str, *args: str) -> DaemonProc:
    """A daemon started by ``code`` (a part of it replaced by a slow double, then ``ckptd.cli.main``)."""
    d = make_daemon(*args, start=False)
    d.launcher = ["-c", code]
    return d.start()


def _save(d: DaemonProc, steps: range, **kw: object) -> None:
    model, optim = make()
    with d.client(JOB, **kw) as c:
        for step in steps:
            train_step(model, optim, step)
            c.snapshot(model, optim, step=step).wait()


def _on_disk(d: DaemonProc) -> list[int]:
    return sorted(complete_steps(d.root, JOB))


def _settled(d: DaemonProc, want: list[int]) -> None:
    until(lambda: _on_disk(d) == want, 30, f"complete steps {want} (have {_on_disk(d)})")


def test_a_protected_step_outlives_retention_until_unprotected_and_a_name_moves(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon("--keep", "1")
    _save(d, range(1, 2))
    with d.client(JOB) as c:
        c.protect(1, "/ckpts/best.ckpt")
    _save(d, range(2, 3))
    with d.client(JOB) as c:
        c.protect(2, "/ckpts/last.ckpt")
    _save(d, range(3, 6))
    _settled(d, [1, 2, 5])  # the newest, and the two named, however old
    with d.client(JOB) as c:
        c.protect(5, "/ckpts/last.ckpt")  # a name protects one step: last.ckpt moves on, step 2 is left to retention
        assert c.status()["jobs"][JOB]["protected"] == [1, 5]
        assert c.unprotect("/ckpts/best.ckpt") is True
        assert c.unprotect("/ckpts/best.ckpt") is False  # nothing left to let go
    _save(d, range(6, 7))
    _settled(d, [5, 6])  # 1 and 2 are no longer named: the next retention pass removes them
    with open(os.path.join(d.root, JOB, "protected.json")) as f:
        assert json.load(f) == {"names": {"/ckpts/last.ckpt": 5}}


def test_protections_survive_a_daemon_restart_and_a_kill(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon("--keep", "1")
    _save(d, range(1, 2))
    with d.client(JOB) as c:
        c.protect(1, "best")
    d.kill()  # recorded durably before the reply: a crash right after it loses nothing
    d.start()
    _save(d, range(3, 5))
    _settled(d, [1, 4])
    assert d.stop() == 0
    d.start()
    _save(d, range(5, 6))
    _settled(d, [1, 5])
    r = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--root", d.root], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "protected by best" in next(line for line in r.stdout.splitlines() if line.split()[:2] == [JOB, "1"])
    # a name with terminal escapes, recorded by a ckptd that still took them: printed escaped, never sent to the terminal
    assert d.stop() == 0
    path = os.path.join(d.root, JOB, "protected.json")
    with open(path) as f:
        doc = json.load(f)
    doc["names"]["\x1b[2J\x1b]0;owned\x07x"] = 5
    with open(path, "w") as f:
        json.dump(doc, f)
    r = subprocess.run([sys.executable, "-m", "ckptd", "ls", "--root", d.root], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout and "protected by \\x1b[2J" in r.stdout, r.stdout


@pytest.mark.parametrize("damage", ["garbage", "a planted symlink", "a step that is not a number"])
def test_an_unreadable_protections_file_keeps_every_step_and_refuses_changes_naming_it(make_daemon, short_tmp, damage) -> None:  # noqa: ANN001
    """Nothing guesses at lost protections: every step of the job stays until an operator mends or removes the file."""
    d = make_daemon("--keep", "1")
    _save(d, range(1, 2))
    with d.client(JOB) as c:
        c.protect(1, "best")
    _save(d, range(2, 3))
    assert d.stop() == 0
    path = os.path.join(d.root, JOB, "protected.json")
    os.unlink(path)
    if damage == "garbage":
        with open(path, "wb") as f:
            f.write(b'{"names": {"best": 1')
    elif damage == "a planted symlink":
        (short_tmp / "elsewhere.json").write_text(json.dumps({"names": {"best": 1}}))
        os.symlink(short_tmp / "elsewhere.json", path)
    else:
        with open(path, "w") as f:
            json.dump({"names": {"best": "1"}}, f)
    d.start()
    _save(d, range(3, 5))
    with d.client(JOB) as c:
        c.wait()
        with pytest.raises(CheckpointError, match="protected.json cannot be read"):
            c.protect(4, "last")
        with pytest.raises(CheckpointError, match="every step of job p is kept"):
            c.unprotect("best")
        assert c.latest() == 4
    assert _on_disk(d) == [1, 2, 3, 4]  # retention (keep 1) removed nothing
    assert "protected.json cannot be read" in d.log.read_text()
    # the operator removes it: retention goes back to --keep and protect works again
    assert d.stop() == 0
    os.unlink(path)
    d.start()
    with d.client(JOB) as c:
        c.protect(4, "best")
    _save(d, range(5, 6))
    _settled(d, [4, 5])


def test_protecting_a_step_retention_removed_or_never_saved_says_so(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon("--keep", "1")
    _save(d, range(1, 3))
    _settled(d, [2])
    with d.client(JOB) as c:
        for step in (1, 9):
            with pytest.raises(CheckpointError, match=f"step {step} of job p is neither being saved nor complete on this node's disk"):
                c.protect(step, "best")
        c.protect(2, "best")
        assert c.status()["jobs"][JOB]["protected"] == [2]


def test_protecting_a_memory_only_step_persists_it(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon("--keep", "1")
    model, optim = make()
    with d.client(JOB, persist_every=100) as c:
        for step in range(1, 4):
            train_step(model, optim, step)
            c.snapshot(model, optim, step=step)
        until(lambda: c.status()["jobs"].get(JOB, {}).get("memory_only") == [3], 30, "step 3 held in memory only")
        assert not is_complete(step_dir(d.root, JOB, 3))
        c.protect(3, "best")  # a file will point at it: it must survive a power loss
        until(lambda: is_complete(step_dir(d.root, JOB, 3)), 30, "step 3 persisted")
    _settled(d, [3])  # step 1 (the first, always persisted) is neither the newest nor named


BAD = [
    ("an empty name", dict(job=JOB, step=1, name="")),
    ("a name of 4097 characters", dict(job=JOB, step=1, name="x" * 4097)),
    ("a NUL in the name", dict(job=JOB, step=1, name="a\0b")),
    ("terminal escapes in the name", dict(job=JOB, step=1, name="\x1b[2J\x1b]0;owned\x07ckpt\n7  <- latest")),
    ("a C1 control in the name", dict(job=JOB, step=1, name="a\x9bb")),
    ("a negative step", dict(job=JOB, step=-1, name="a")),
    ("a step that is a bool", dict(job=JOB, step=True, name="a")),
    ("a name that is a number", dict(job=JOB, step=1, name=7)),
    ("a job that escapes the root", dict(job="../etc", step=1, name="a")),
    ("a field too many", dict(job=JOB, step=1, name="a", keep=True)),
]


@pytest.mark.parametrize("fields", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_protect_requests_are_refused_and_change_nothing(daemon, fields) -> None:  # noqa: ANN001
    with Raw(daemon.endpoint) as raw:
        rep = raw.ask(request("protect", 1, **fields))
        assert rep["ok"] is False and rep["code"] == "bad_request" and rep["error"]
        rep = raw.ask(request("unprotect", 2, job=fields["job"], name=fields["name"]))
        name = fields["name"]
        if (
            fields["job"] == JOB and isinstance(name, str) and 0 < len(name) <= 4096 and "\0" not in name
        ):  # unprotect takes control characters
            assert rep["ok"] is True and rep["before"] is None
        else:
            assert rep["ok"] is False and rep["code"] == "bad_request"
        assert raw.ask(request("hello", 3))["ok"] is True
    assert not os.path.exists(os.path.join(daemon.root, JOB, "protected.json"))


def test_a_full_disk_refuses_protect_saying_so_and_keeps_what_was_protected(small_fs, make_daemon) -> None:  # noqa: ANN001
    # small_fs first: it is unmounted after the daemon is stopped
    d = make_daemon("--keep", "1", start=False)
    d.root = small_fs
    d.start()
    _save(d, range(7, 8))
    with d.client(JOB) as c:
        c.protect(7, "best")
    _save(d, range(8, 9))
    with d.client(JOB) as c:
        fd = os.open(os.path.join(small_fs, "filler"), os.O_WRONLY | os.O_CREAT)  # the disk fills up
        try:
            while os.write(fd, b"\0" * (64 << 10)):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with pytest.raises(CheckpointError, match=r"could not protect step 8 as 'next' of job p: .*No space left"):
            c.protect(8, "next")
        with pytest.raises(CheckpointError, match="No space left"):
            c.protect(8, "best")  # moving a name fails whole: it still protects step 7
        assert c.status()["jobs"][JOB]["protected"] == [7]
        os.unlink(os.path.join(small_fs, "filler"))
        c.protect(8, "next")
        assert c.status()["jobs"][JOB]["protected"] == [7, 8]
    with open(os.path.join(small_fs, JOB, "protected.json")) as f:
        assert json.load(f) == {"names": {"best": 7, "next": 8}}


def test_the_bucket_keeps_a_protected_step_too(make_daemon, short_tmp, s3_bucket) -> None:  # noqa: ANN001
    """Bucket retention (keep 1) keeps the step a name protects; unprotected, the next pass removes it there."""
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket, keep=1), "--keep", "1")
    _save(d, range(1, 2))
    with d.client(JOB) as c:
        c.protect(1, "best")
    _save(d, range(2, 4))
    wait_uploaded(d, JOB, 3)
    with S3Store(s3_bucket) as store:
        until(lambda: remote_steps(store, JOB)[0] == [1, 3], 30, "bucket retention: steps 1 and 3")
        with d.client(JOB) as c:
            assert c.unprotect("best") is True
        _settled(d, [3])  # locally at once
        _save(d, range(4, 5))
        wait_uploaded(d, JOB, 4)
        until(lambda: remote_steps(store, JOB)[0] == [4], 30, "bucket retention: step 4 only")


# found by a review of the first version: each failed before its fix

SLOW_LISTING = """import sys, threading, time, ckptd.storage.local as L
orig = L.steps_by_commit
def slow(root, job):
    if threading.current_thread().name.startswith("ckptd-persist") and job == "p":
        time.sleep(1.5)  # a retention pass between reading its policy and renaming what it dooms (many steps, a slow disk)
    return orig(root, job)
L.steps_by_commit = slow
from ckptd.cli import main
raise SystemExit(main(sys.argv[1:]))"""


def test_a_protect_during_a_retention_pass_that_removes_the_step_is_refused_not_answered_ok(make_daemon) -> None:  # noqa: ANN001
    """The step was checked on the loop while a retention pass that had read its policy before the protect was
    about to rename it: the protect was answered OK and recorded, and the step was deleted anyway."""
    d = _patched(make_daemon, SLOW_LISTING, "--keep", "1")
    model, optim = make()
    with d.client(JOB) as c:
        train_step(model, optim, 1)
        c.snapshot(model, optim, step=1).wait()
        train_step(model, optim, 2)
        h = c.snapshot(model, optim, step=2, blocking=True)
        time.sleep(0.6)  # step 2 is complete; its retention pass is listing the steps
        try:
            c.protect(1, "best")
            accepted = True
        except CheckpointError as e:
            assert "nothing to protect" in str(e)
            accepted = False
        h.wait()
    if accepted:
        _settled(d, [1, 2])
    else:
        _settled(d, [2])
        with d.client(JOB) as c:
            assert "protected" not in c.status()["jobs"][JOB]


def test_a_rolled_back_re_save_of_a_protected_step_number_is_persisted(make_daemon) -> None:  # noqa: ANN001
    """A name protects step 2. A rolled-back run re-saves 2 with a memory tier: the old step 2 left the disk
    when the re-save was sealed, and the new one, memory-only, was dropped at step 3: the name protected nothing."""
    d = make_daemon("--keep", "1")
    model, optim = make()
    with d.client(JOB, persist_every=100) as c:
        for s in (1, 2):
            train_step(model, optim, s)
            c.snapshot(model, optim, step=s).wait()
            c.protect(s, f"/ckpts/{s}.ckpt")
    model, optim = make()
    with d.client(JOB, persist_every=100) as c:
        c.restore(model, optim, step=1)
        for s in (2, 3):
            train_step(model, optim, s)
            c.snapshot(model, optim, step=s, blocking=True)
        want = full_state(model, optim)  # after step 3: step 2's state is the one before
        until(
            lambda: is_complete(step_dir(d.root, JOB, 2)) and committed_at(step_dir(d.root, JOB, 2)) > 0, 30, "the re-saved step 2 on disk"
        )
        m2, o2 = make(seed=5)
        c.restore(m2, o2, step=2, hot=False)
        assert c.last_restore["source"] == "disk"
    assert want  # the restore of 2 read the disk: the new line's step 2, kept for its name


def test_the_loop_answers_other_requests_while_a_protect_is_being_written(make_daemon) -> None:  # noqa: ANN001
    """The writer thread held the lock the loop takes during its fsync: a second protect (and with it every
    other request) waited for a slow disk."""
    d = _patched(make_daemon, SLOW_WRITE)
    _save(d, range(1, 2))
    done: list[str] = []
    with d.client(JOB) as c1, d.client(JOB) as c2, d.client("other") as c3:
        t = threading.Thread(target=lambda: (c1.protect(1, "slow"), done.append("first")))
        t.start()
        until(lambda: os.path.exists(os.path.join(d.base, "writing")), 30, "the first protect's write under way")
        t2 = threading.Thread(target=lambda: (c2.protect(1, "second"), done.append("second")))
        t2.start()
        time.sleep(0.3)  # the second protect is queued behind the first write
        assert c3.latest() is None and done == []  # answered while both protects wait for the disk
        os.unlink(os.path.join(d.base, "writing"))
        t.join(30)
        t2.join(30)
    # both answered once the disk let go; which client thread appends first is the scheduler's choice
    assert sorted(done) == ["first", "second"]


SLOW_WRITE = """import os, sys, time, ckptd.daemon.protected as P
orig = P.write_durable
def slow(path, data):
    if b'"slow"' in data and b'"second"' not in data:
        flag = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(path))), "writing")
        open(flag, "w").close()
        while os.path.exists(flag):  # the disk is slow until the test lets it go
            time.sleep(0.05)
    return orig(path, data)
P.write_durable = slow
from ckptd.cli import main
raise SystemExit(main(sys.argv[1:]))"""


def test_protecting_a_step_the_bucket_no_longer_holds_uploads_it_again(make_daemon, short_tmp, s3_bucket) -> None:  # noqa: ANN001
    """Local keep 3, bucket keep 1: step 2 is on the disk, no longer in the bucket. A name that protects it had it
    kept on the disk only: the node's loss lost it."""
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket, keep=1), "--keep", "3")
    _save(d, range(1, 4))
    wait_uploaded(d, JOB, 3)
    with S3Store(s3_bucket) as store:
        until(lambda: remote_steps(store, JOB)[0] == [3], 30, "bucket retention: step 3 only")
        with d.client(JOB) as c:
            c.protect(2, "best")
        until(lambda: remote_steps(store, JOB)[0] == [2, 3], 60, "step 2 uploaded again")
        _save(d, range(4, 5))
        wait_uploaded(d, JOB, 4)
        until(lambda: remote_steps(store, JOB)[0] == [2, 4], 30, "bucket retention keeps the protected step")


def test_protections_forget_the_steps_of_answered_requests(tmp_path) -> None:  # noqa: ANN001
    """Every step ever protected stayed in the count of protects being written, walked on the loop at each request."""
    import zmq

    from ckptd.daemon.events import EventQueue
    from ckptd.daemon.protected import Protections

    ctx = zmq.Context()
    events = EventQueue(ctx)
    try:
        p = Protections(str(tmp_path), events, retain=lambda job: None)
        for step in range(50):
            p.submit(b"x", step, JOB, "last.ckpt", step, live=True)  # last.ckpt follows the newest save
        p.shutdown()
        assert p._coming == {} and p._queued == 0 and p.names(JOB) == {"last.ckpt": 49}
        assert p.policy(JOB).keeps(list(range(50))) == {49}
    finally:
        events.close()
        ctx.term()


SLOW_DELETE = """import os, shutil, sys, threading, time
orig = shutil.rmtree
def slow(path, *a, **k):
    if threading.current_thread().name.startswith("ckptd-protect"):
        flag = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(path))), "deleting")
        open(flag, "w").close()
        while os.path.exists(flag):  # deleting GBs of a step let go
            time.sleep(0.05)
    return orig(path, *a, **k)
shutil.rmtree = slow
from ckptd.cli import main
raise SystemExit(main(sys.argv[1:]))"""


def test_a_step_let_go_is_deleted_without_holding_up_the_jobs_next_commit(make_daemon) -> None:  # noqa: ANN001
    """Retention deleted under the job's lock, which the loop takes to count a committed shard: while an unprotect's
    retention pass deleted a big step, the job's next commit (and the whole daemon) waited for it."""
    d = _patched(make_daemon, SLOW_DELETE, "--keep", "1")
    _save(d, range(1, 2))
    with d.client(JOB) as c:
        c.protect(1, "best")
    _save(d, range(2, 3))
    with d.client(JOB) as c:
        assert c.unprotect("best")
        until(lambda: os.path.exists(os.path.join(d.base, "deleting")), 30, "step 1 being deleted")
        model, optim = make()
        c.snapshot(model, optim, step=3, blocking=True)  # committed while the deletion goes on
        assert os.path.exists(os.path.join(d.base, "deleting"))
        os.unlink(os.path.join(d.base, "deleting"))
    _settled(d, [3])
