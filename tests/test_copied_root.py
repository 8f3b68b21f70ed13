"""A copy of a root (``cp -a``, a backup restored on the same node) carries ``.ckptd-shm``, the marker naming the
original daemon's segment directory in ``/dev/shm``. A daemon started on the copy reused that directory: it deleted
the live daemon's free segments and adopted its memory-only steps, which the live daemon then could neither make
durable nor restore. Now the marker records the root it was made for, and a daemon holds its directory's lock
while it runs: a daemon on a copy starts a directory of its own and leaves the original's alone.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DaemonProc

from ckptd import shm
from ckptd.errors import CheckpointError
from ckptd.layout import complete_steps


def _model(step: int) -> torch.nn.Linear:
    m = torch.nn.Linear(8, 8)
    with torch.no_grad():
        m.weight.fill_(float(step))
    return m


def _original_with_a_memory_only_step(base: Path) -> DaemonProc:
    """A daemon whose step 1 is on disk and step 2 in its shared memory only."""
    d = DaemonProc(base / "a", [])
    (base / "a").mkdir()
    d.start()
    with d.client(persist_every=100) as c:
        c.snapshot(_model(1), step=1, blocking=True).wait(60)  # the first step of a job is persisted
        c.snapshot(_model(2), step=2, blocking=True)
    with d.rpc() as rpc:
        assert rpc.call("wait", job="t", step=2, timeout=0.0, persist=False)["state"] == "memory"
    return d


def _copy_root(a: DaemonProc, base: Path) -> DaemonProc:
    (base / "b").mkdir()
    shutil.copytree(a.root, base / "b" / "root", symlinks=True)  # cp -a
    return DaemonProc(base / "b", [])


def test_a_daemon_on_a_copy_of_a_live_root_leaves_the_originals_segments_alone(short_tmp: Path) -> None:
    a = _original_with_a_memory_only_step(short_tmp)
    b = None
    try:
        held = sorted(a.segments())
        b = _copy_root(a, short_tmp).start()
        assert "a copied root?" in b.log.read_text()
        assert shm.SegmentDir.read_marker(b.root) not in (None, shm.SegmentDir.read_marker(a.root))
        assert all(os.path.exists(shm.path_of(n)) for n in held)  # none deleted
        with b.client() as c:
            assert c.latest() == 1  # what the copy holds on disk; step 2 stays the original's
        with a.rpc() as rpc:
            assert rpc.call("wait", job="t", step=2, timeout=30.0)["state"] == "durable"  # the original persists it
        m = torch.nn.Linear(8, 8)
        with a.client() as c:
            assert c.latest() == 2
            c.restore(m)
        assert torch.equal(m.weight, _model(2).weight)
        assert complete_steps(b.root, "t") == [1]  # nothing of step 2 went into the copy
    finally:
        if b is not None:
            b.cleanup()
        a.cleanup()


def test_a_daemon_on_a_copy_of_a_dead_daemons_root_does_not_adopt_its_staged_step(short_tmp: Path) -> None:
    """The original daemon was killed with step 2 staged; the copy's daemon starts first. The staged step stays for
    the original root, whose daemon makes it durable when it comes back."""
    a = _original_with_a_memory_only_step(short_tmp)
    b = None
    try:
        a.kill()
        b = _copy_root(a, short_tmp).start()
        with b.client() as c:
            assert c.latest() == 1
        b.stop()
        assert complete_steps(b.root, "t") == [1]
        a.start()
        with a.rpc() as rpc:
            assert rpc.call("wait", job="t", step=2, timeout=30.0)["state"] == "durable"  # adopted by its own root's daemon
        assert complete_steps(a.root, "t") == [1, 2]
    finally:
        if b is not None:
            b.cleanup()
        a.cleanup()


def test_a_second_daemon_never_takes_a_directory_another_daemon_holds(short_tmp: Path) -> None:
    """Even with a marker that names this root (a copy made with the same inode cannot exist, but a marker can be
    written by hand), a directory whose lock a live daemon holds is left alone."""
    a = _original_with_a_memory_only_step(short_tmp)
    b = None
    try:
        held = sorted(a.segments())
        (short_tmp / "b").mkdir()
        b = DaemonProc(short_tmp / "b", [])
        os.makedirs(b.root, mode=0o700)
        marker = Path(a.root, shm.MARKER).read_text().splitlines()[0]  # the directory alone, as an older ckptd wrote it
        Path(b.root, shm.MARKER).write_text(marker + "\n")
        b.start()
        assert "in use by another running daemon" in b.log.read_text()
        assert shm.SegmentDir.read_marker(b.root) != marker
        assert all(os.path.exists(shm.path_of(n)) for n in held)
        with a.rpc() as rpc:
            assert rpc.call("wait", job="t", step=2, timeout=30.0)["state"] == "durable"
    finally:
        if b is not None:
            b.cleanup()
        a.cleanup()


def test_a_restore_of_the_newest_falls_back_when_its_memory_only_step_is_gone(short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The memory-only step 2 lost its segments (removed by hand, or taken by a daemon on a copy before this fix):
    restore() of the newest reads step 1 from disk and says why; a restore that names step 2 still fails."""
    a = _original_with_a_memory_only_step(short_tmp)
    try:
        for name in a.segments():
            for path in (shm.path_of(name), shm.path_of(name) + shm.RECORD_SUFFIX):
                if os.path.exists(path):
                    os.unlink(path)
        m = torch.nn.Linear(8, 8)
        with a.client() as c, caplog.at_level(logging.WARNING, logger="ckptd"):
            c.restore(m)
            assert c.last_restore["step"] == 1 and c.last_restore["source"] == "disk"
            with pytest.raises(CheckpointError, match="step 2 of job t cannot be restored"):
                c.restore(torch.nn.Linear(8, 8), step=2)
        assert torch.equal(m.weight, _model(1).weight)
        assert "the newest step 2 of job t failed" in caplog.text and "restoring the one before it" in caplog.text
    finally:
        a.cleanup()
