"""Hot restore: a restarted trainer reads the newest step from the daemon's shared memory, not the disk."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from _models import assert_same, full_state, make, train_step
from conftest import REPO

from ckptd import shm
from ckptd.errors import FormatError


def _trained(steps: int = 2, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = make(seed=seed)
    for i in range(steps):
        train_step(model, optim, i)
    return model, optim


def test_restore_reads_memory_not_disk(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon()
    model, optim = _trained()
    want = full_state(model, optim)
    with d.client("hot") as c:
        path = c.snapshot(model, optim, step=5, extra={"note": "x"}, blocking=True).wait()
    # the shard's bytes are gone from disk: only the daemon's memory can still answer
    os.unlink(os.path.join(path, "rank-00000.safetensors"))
    m2, o2 = make(seed=3)
    with d.client("hot") as c:
        extra = c.restore(m2, o2)
        assert c.last_restore == {"step": 5, "path": path, "source": "memory"}
        assert_same(full_state(m2, o2), want)
        assert extra == {"note": "x"}
        with pytest.raises(FormatError, match="rank-00000.safetensors is missing"):
            c.restore(*make(seed=4), hot=False)
        # unpinned after the restore: the slot serves the next snapshot again
        assert c.status()["hot_pins"] == {}


def test_falls_back_to_disk_once_the_slot_is_reused(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon()
    model, optim = _trained()
    want1 = full_state(model, optim)
    with d.client("hot") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait()
        train_step(model, optim, 7)
        c.snapshot(model, optim, step=2, blocking=True).wait()  # reuses rank 0's slot
        m2, o2 = make(seed=3)
        c.restore(m2, o2, step=1)
        assert c.last_restore["source"] == "disk"
        assert_same(full_state(m2, o2), want1)
        c.restore(m2, o2)
        assert c.last_restore == {"step": 2, "path": c.last_restore["path"], "source": "memory"}
        assert_same(full_state(m2, o2), full_state(model, optim))


def test_pinned_slot_is_not_overwritten_and_dead_readers_unpin(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon()
    model, optim = _trained()
    with d.client("hot") as c, d.rpc() as rpc:
        c.snapshot(model, optim, step=1, blocking=True).wait()
        held = rpc.call("hot_open", job="hot", step=None, pid=os.getpid())
        assert held["step"] == 1
        seg = held["segments"]["rank-00000.safetensors"]
        before = open(shm.path_of(seg), "rb").read()
        train_step(model, optim, 9)
        c.snapshot(model, optim, step=2, blocking=True).wait()  # must lease another slot
        assert open(shm.path_of(seg), "rb").read() == before
        # a reader that died leaves no pin behind
        # another reader pins step 2 and dies without hot_close (the daemon knows its pid from the socket)
        code = (
            "import sys; from ckptd.client.rpc import Channel; ch = Channel(sys.argv[1], 30.0);"
            "print(ch.call('hot_open', job='hot', step=None, pid=1)['step'])"
        )
        out = subprocess.run([sys.executable, "-c", code, d.endpoint], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.stdout.strip() == "2", out.stderr
        rpc.call("hot_close", pin=held["pin"], segments=[seg])
        deadline = time.monotonic() + 10  # housekeeping drops the dead pid's pin within a second
        while rpc.call("status")["hot_pins"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rpc.call("status")["hot_pins"] == {}


def test_nothing_held_after_a_daemon_restart(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon()
    model, optim = _trained()
    want = full_state(model, optim)
    with d.client("hot") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait()
    d.stop()
    d.start()
    m2, o2 = make(seed=3)
    with d.client("hot") as c, d.rpc() as rpc:
        rep = rpc.call("hot_open", job="hot", step=None, pid=os.getpid())
        assert rep["step"] is None and "no step" in rep["reason"]
        c.restore(m2, o2)
        assert c.last_restore["source"] == "disk"
    assert_same(full_state(m2, o2), want)
