"""Steps protected by name from retention (``Client.protect`` / ``unprotect``, ckptd/daemon/protected.py).

A framework keeps a file that points at a step (Lightning's top-k ``epoch=0-step=8.ckpt``); the daemon's
retention keeps the newest ``--keep`` steps and must never remove one such a file names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _models import make, train_step
from _poll import until
from conftest import REPO, DaemonProc
from test_daemon import Raw
from test_remote import remote_toml, wait_uploaded

from ckptd.errors import CheckpointError
from ckptd.layout import is_complete, step_dir
from ckptd.protocol import request
from ckptd.storage.local import complete_steps
from ckptd.storage.remote import remote_steps
from ckptd.storage.s3 import S3Store

JOB = "p"


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
        if fields["job"] == JOB and isinstance(fields["name"], str) and 0 < len(fields["name"]) <= 4096 and "\0" not in fields["name"]:
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
