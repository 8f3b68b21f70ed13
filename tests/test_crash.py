"""Crashes: a trainer SIGKILLed right after snapshot() returns, a daemon SIGKILLed mid-persist."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from _dist import run_ranks
from _models import assert_same, full_state, make, train_step
from _workers import restore_and_compare, snapshot_then_die
from conftest import REPO, env_for
from safetensors.torch import load_file

import ckptd
from ckptd import shm
from ckptd.layout import complete_steps, shard_name, tmp_dir
from ckptd.storage import local
from ckptd.storage.verify import verify_checkpoint
from ckptd.validate import read_manifest


def _wait_durable(daemon, job: str, step: int, timeout: float = 60.0) -> str:  # noqa: ANN001
    with daemon.rpc() as rpc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rep = rpc.call("wait", job=job, step=step, timeout=5.0)
            if rep["state"] == "durable":
                return rep["path"]
            assert rep["state"] == "pending", rep
    raise AssertionError(f"step {step} never became durable")


def _kill_mid_persist(daemon, job: str, step: int) -> None:  # noqa: ANN001
    """SIGKILL the daemon once it has begun writing rank 0's shard of ``step`` (a throttled disk: mid-write)."""
    shard = os.path.join(tmp_dir(daemon.root, job, step), shard_name(0))
    deadline = time.monotonic() + 30
    while not (os.path.exists(shard) and os.path.getsize(shard) > 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.path.exists(shard), "persist never started"
    daemon.kill()


def test_trainer_killed_after_blocking_snapshot_still_commits(make_daemon, short_tmp) -> None:  # noqa: ANN001
    # a slow disk: the trainer is dead long before the daemon has made the step durable
    daemon = make_daemon("--write-rate-limit", "8k")  # the shard persists in seconds, long after the kill
    expected = str(short_tmp / "expected.safetensors")
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "_trainer.py"), expected, "3"], env=env_for(daemon, "crash"), cwd=REPO / "tests", timeout=120
    )
    assert proc.returncode == -9
    assert open(expected + ".state").read() == "pending"  # killed before durability
    path = _wait_durable(daemon, "crash", 3)
    model, optim = make(seed=11)
    extra = ckptd.restore(model, optim, path=path)
    assert_same(full_state(model, optim), load_file(expected))
    assert extra["step"] == 3 and isinstance(extra["rng"], torch.Tensor)


@pytest.mark.multiproc
def test_two_fsdp2_ranks_killed_after_blocking_snapshot(make_daemon, short_tmp) -> None:  # noqa: ANN001
    daemon = make_daemon("--write-rate-limit", "8k")
    expected = str(short_tmp / "expected.safetensors")
    run_ranks(2, snapshot_then_die, "fsdp2", daemon.endpoint, "crash2", expected, expect_exit=-9)
    assert {open(f"{expected}.state-{r}").read() for r in range(2)} == {"pending"}
    _wait_durable(daemon, "crash2", 2)
    # the restarted trainer takes the step from the daemon's memory (hot), and the disk holds the same
    for hot, source in ((True, "memory"), (False, "disk")):
        outs = run_ranks(2, restore_and_compare, "fsdp2", daemon.endpoint, "crash2", expected, hot)
        assert [o["extra"] for o in outs] == [{"rank": 0, "note": "pre-kill"}, {"rank": 1, "note": "pre-kill"}]
        assert [o["source"] for o in outs] == [source, source]


def test_daemon_killed_mid_persist_finishes_after_restart(make_daemon) -> None:  # noqa: ANN001
    daemon = make_daemon()
    model, optim = make()
    model.register_buffer("bulk", torch.randn(1 << 20))  # 4 MiB: slow to write at the capped rate
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
    daemon.stop()
    daemon.start(["--write-rate-limit", "1M"])
    train_step(model, optim, 1)
    want = full_state(model, optim)
    jobdir = os.path.join(daemon.root, "j")
    with daemon.client("j") as c:
        h = c.snapshot(model, optim, step=2, blocking=True)
        _kill_mid_persist(daemon, "j", 2)  # the shard is partly written, no manifest
        assert not os.path.exists(os.path.join(jobdir, "step-2", "manifest.json"))
        assert open(os.path.join(jobdir, "latest")).read().strip() == "1"  # never an incomplete step
        assert daemon.segments(), "the committed shard must survive the daemon in shared memory"
        daemon.start([])
        path = h.wait(60)  # the same handle reconnects to the restarted daemon
    assert path.endswith("step-2") and open(os.path.join(jobdir, "latest")).read().strip() == "2"
    assert sorted(os.listdir(jobdir)) == ["latest", "step-1", "step-2"]
    m2, o2 = make(seed=3)
    m2.register_buffer("bulk", torch.zeros(1 << 20))
    ckptd.restore(m2, o2, path=path)
    assert_same(full_state(m2, o2), want)
    assert "recovered committed shard" in daemon.log.read_text()


def test_a_second_daemon_on_the_root_is_refused_while_the_first_still_drains(make_daemon) -> None:  # noqa: ANN001
    """A daemon told to stop (SIGTERM) finishes its persists first, and its loop no longer answers meanwhile:
    a restart on the same root (here even on another endpoint) was not refused, adopted the same committed
    segment and wrote the same shard file; the step ended complete with a half-written shard. Now the root's
    lock refuses it until the first is done, and the step is sound."""
    a = make_daemon("--write-rate-limit", "2M")
    model, optim = make()
    model.register_buffer("bulk", torch.randn(2 << 20))  # 8 MiB: about 4 s at the capped rate
    train_step(model, optim, 0)
    want = full_state(model, optim)
    with a.client("j") as c:
        c.snapshot(model, optim, step=1, blocking=True)  # committed: the daemon owns it now
    shard = os.path.join(tmp_dir(a.root, "j", 1), shard_name(0))
    deadline = time.monotonic() + 30
    while not (os.path.exists(shard) and os.path.getsize(shard) > 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    a.proc.send_signal(signal.SIGTERM)  # drains: finishes the persist
    b = make_daemon(sub="b", start=False)
    b.root = a.root  # the same root, its own endpoint
    with pytest.raises(RuntimeError, match=r"another ckptd daemon is using the root .*\.ckptd\.lock"):
        b.start()
    assert a.proc.wait(60) == 0
    path = os.path.join(a.root, "j", "step-1")
    assert verify_checkpoint(path) == []
    b.start()  # the first is gone: the root is free
    with b.client("j") as c:
        m2, o2 = make(seed=3)
        m2.register_buffer("bulk", torch.zeros(2 << 20))
        c.restore(m2, o2)
    assert_same(full_state(m2, o2), want)


def _stage_and_commit(d, rank: int, step: int = 1, ws: int = 2) -> None:  # noqa: ANN001
    """One rank of launch 7 leasing, filling and committing its shard, on the wire (``_rig``'s real shard)."""
    from _rig import shard, tree

    data = shard(step, rank, ws)
    with d.rpc() as rpc:
        rep = rpc.call("alloc", job="j", rank=rank, world_size=ws, step=step, nbytes=len(data), pid=os.getpid())
        with open(f"/dev/shm/{rep['segment']}", "r+b") as f:
            f.write(data)
        rpc.call(
            "commit", job="j", rank=rank, world_size=ws, local_world_size=ws, step=step, segment=rep["segment"],
            lease=rep["lease"], nbytes=len(data), replicas={}, run=7, after=None, frames=(tree(rank),),
        )  # fmt: skip


@pytest.mark.parametrize("staged", [True, False], ids=["shard-in-shm", "shard-on-disk"])
def test_a_daemon_restart_between_two_ranks_commits_loses_nothing(make_daemon, staged: bool) -> None:  # noqa: ANN001
    """Rank 0 of a two-rank launch commits step 1; the daemon restarts; rank 1 (which had not leased yet) commits
    to the new daemon. Rank 0's shard was discarded (recovered from shared memory, its track took the new
    commit for another run's) or its durable partial step removed at start-up, and step 1 stayed pending for
    good. Now the step completes with both ranks."""
    d = make_daemon("--write-rate-limit", "1") if staged else make_daemon()  # 1 byte/s: rank 0's shard stays staged
    _stage_and_commit(d, 0)
    if not staged:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(tmp_dir(d.root, "j", 1), "rank-00000.json")) and time.monotonic() < deadline:
            time.sleep(0.02)
    d.kill()
    d.start(["--keep", "3"])  # at full speed now
    _stage_and_commit(d, 1)
    with d.rpc() as rpc:
        rep = rpc.call("wait", job="j", step=1, timeout=20.0)
    assert rep["state"] == "durable", rep
    assert verify_checkpoint(rep["path"]) == [] and read_manifest(rep["path"])["world_size"] == 2


def test_client_wait_after_a_daemon_restart_judges_steps_it_no_longer_knows(make_daemon, caplog) -> None:  # noqa: ANN001
    """Snapshots whose handles were not waited, then a daemon restart (even a clean one): the new daemon has no
    record of steps retention removed, and Client.wait() raised for them although a later step is durable.
    They are skipped now, with a warning. A step that is gone with nothing durable after it (the node lost its
    shared memory before the step was persisted) is still an error: StepUnknown."""
    d = make_daemon("--keep", "1")
    model, optim = make()
    c = d.client("j")
    try:
        for s in (1, 2, 3):
            train_step(model, optim, s)
            c.snapshot(model, optim, step=s, blocking=True)
        d.stop()
        d.start(["--keep", "1"])
        with caplog.at_level("WARNING", logger="ckptd.client"):
            assert [os.path.basename(p) for p in c.wait(60)] == ["step-3"]
        assert "no record of step 1 of job j" in caplog.text and "step 3, snapshot after it, is durable" in caplog.text
    finally:
        c.close()
    lost = make_daemon("--write-rate-limit", "1", sub="lost")  # 1 byte/s: the shard stays staged
    c = lost.client("j")
    try:
        c.snapshot(model, optim, step=1, blocking=True)
        lost.kill()
        for seg in lost.segments():  # a reboot: /dev/shm is empty
            os.unlink(shm.path_of(seg))
        lost.start(["--keep", "3"])
        with pytest.raises(ckptd.StepUnknown, match="no record of step 1 of job j and it is not on disk"):
            c.wait(60)
    finally:
        c.close()


def test_a_wait_in_progress_when_the_daemon_restarts_gets_the_new_daemons_answer(make_daemon) -> None:  # noqa: ANN001
    """handle.wait() was waiting when the daemon was killed and restarted: its request died with the old daemon,
    the client polled on while the new one answered hello, and raised DaemonUnavailable ("is ckptd serve
    running?") although the new daemon made the step durable at once. An idempotent request is asked again."""
    d = make_daemon("--write-rate-limit", "1")  # 1 byte/s: the step stays pending until the restart
    model, optim = make()
    out: dict = {}
    # each request slice, and the hello probe after it, lasts the client's timeout: the restarted daemon must answer
    # within it. 10 s, not 3: on a loaded 2-core CI machine a daemon's start and recovery took longer than 3 s
    with d.client("j", timeout=10.0) as c:
        h = c.snapshot(model, optim, step=1, blocking=True)

        connected = threading.Event()

        def wait() -> None:
            try:
                c.latest()  # this thread's socket is connected before the daemon goes (a new one would find nobody)
                connected.set()
                out["path"] = h.wait(30.0)
            except Exception as e:  # the assertion below names it
                out["error"] = e
                connected.set()

        t = threading.Thread(target=wait)
        t.start()
        assert connected.wait(30)
        time.sleep(1.0)  # the wait is asked meanwhile (or queued on the connected socket if not yet)
        d.kill()
        d.start(["--keep", "3"])
        t.join(60)
    assert "error" not in out, out
    assert out["path"].endswith("step-1") and verify_checkpoint(out["path"]) == []


def test_a_trainer_lets_go_of_the_segments_a_restarted_daemon_unlinked(make_daemon) -> None:  # noqa: ANN001
    """prepare() mapped the trainer's slots; the daemon restarted and unlinked them (no commit record). The
    trainer kept those mappings (it evicts only past four), so their shared memory stayed allocated for
    the run, invisible in /dev/shm and outside the new daemon's budget. They are dropped at the next new slot."""
    d = make_daemon()
    model = torch.nn.Linear(256, 256)
    with d.client("j") as c:
        c.prepare(model)
        c.snapshot(model, step=1, blocking=True).wait(30)
        before = c._maps.names()
        d.kill()
        d.start(["--keep", "3"])
        assert not any(os.path.exists(shm.path_of(n)) for n in before)  # the new daemon unlinked them
        for s in (2, 3):
            c.snapshot(model, step=s, blocking=True).wait(30)
        assert c._maps.names() and all(os.path.exists(shm.path_of(n)) for n in c._maps.names())


def test_a_step_committed_after_a_restart_is_newer_than_the_adopted_ones_whatever_the_clock(make_daemon) -> None:  # noqa: ANN001
    """The clock went back an hour across a crash: a step committed after the restart, while an adopted step
    was still being persisted, was stamped older than it, so latest stayed on the adopted step and retention
    (keep 1) removed the newer one. Commit times after a restart are later than every adopted record's."""
    d = make_daemon("--write-rate-limit", "1k", "--keep", "1")  # 1 kB/s: step 1 stays staged
    with d.client("j") as c:
        c.snapshot_state({"model": {"w": torch.randn(1 << 20)}}, step=1)  # 4 MiB
    (seg,) = d.segments()
    d.kill()
    path = shm.path_of(seg) + shm.RECORD_SUFFIX
    with open(path, "rb") as f:
        head, _, tree = f.read().partition(b"\n")
    rec = json.loads(head)
    rec["committed_at"] += 3600 * 10**9  # stamped by a clock an hour ahead of today's
    with open(path, "wb") as f:
        f.write(json.dumps(rec, separators=(",", ":")).encode() + b"\n" + tree)
    d.start(["--write-rate-limit", "1M", "--keep", "1"])  # step 1 takes seconds to persist; step 2 is small
    with d.client("j") as c:
        c.snapshot_state({"model": {"w": torch.randn(4)}}, step=2).wait(60)
        with d.rpc() as rpc:
            assert rpc.call("wait", job="j", step=1, timeout=30.0)["state"] == "durable"  # then retention ran
        assert c.latest() == 2
    assert local.steps_by_commit(d.root, "j") == [2]


def test_daemon_killed_mid_persist_of_a_rolled_back_re_save_keeps_the_old_step(make_daemon) -> None:  # noqa: ANN001
    """Steps 1 and 2 saved; the user restores step 1 and saves 2 again on a new line. The daemon dies while
    the new step 2 is being written: the old step 2 is still complete and restorable (it is replaced only
    by a complete new one); after the restart the new step 2 is finished and takes its place."""
    daemon = make_daemon()
    model, optim = make()
    model.register_buffer("bulk", torch.randn(1 << 20))  # 4 MiB: slow to write at the capped rate
    states = {}
    with daemon.client("rb") as c:
        for step in (1, 2):
            train_step(model, optim, step)
            states[step] = full_state(model, optim)
            c.snapshot(model, optim, step=step, blocking=True).wait(30)
    daemon.stop()
    daemon.start(["--write-rate-limit", "1M"])
    jobdir = os.path.join(daemon.root, "rb")
    with daemon.client("rb") as c:
        c.restore(model, optim, step=1)
        assert_same(full_state(model, optim), states[1])
        train_step(model, optim, 100)
        new = full_state(model, optim)
        h = c.snapshot(model, optim, step=2, blocking=True)
        _kill_mid_persist(daemon, "rb", 2)
        m2, o2 = make(seed=3)
        m2.register_buffer("bulk", torch.zeros(1 << 20))
        ckptd.restore(m2, o2, path=os.path.join(jobdir, "step-2"))  # the old line's step 2, complete
        assert_same(full_state(m2, o2), states[2])
        daemon.start([])
        path = h.wait(60)  # the same handle reconnects to the restarted daemon
    assert path == os.path.join(jobdir, "step-2") and sorted(os.listdir(jobdir)) == ["latest", "step-1", "step-2"]
    ckptd.restore(m2, o2, path=path)
    assert_same(full_state(m2, o2), new)


def test_restart_removes_unfinishable_partial_steps(make_daemon) -> None:  # noqa: ANN001
    daemon = make_daemon()
    jobdir = os.path.join(daemon.root, "j")
    os.makedirs(os.path.join(jobdir, "step-9.tmp"))
    open(os.path.join(jobdir, "step-9.tmp", "rank-00000.safetensors"), "wb").write(b"partial")
    daemon.stop()
    daemon.start([])
    assert not os.path.exists(os.path.join(jobdir, "step-9.tmp"))
    with daemon.client("j") as c:
        assert c.latest() is None


def test_full_disk_fails_the_step_and_keeps_the_previous(small_disk, make_daemon) -> None:  # noqa: ANN001
    # small_disk first: it is unmounted after the daemon is stopped and its segment directory removed
    """ENOSPC during persist: wait() raises clearly, the partial step is removed, the previous step
    stays intact and loads, and the daemon keeps serving."""
    daemon = make_daemon(start=False)
    daemon.root = small_disk
    daemon.start()
    model, optim = make()
    train_step(model, optim, 0)
    want = full_state(model, optim)
    with daemon.client("j") as c:
        c.snapshot(model, optim, step=1).wait(30)
        model.register_buffer("bulk", torch.randn(1 << 20))  # 4 MiB: cannot fit
        h = c.snapshot(model, optim, step=2)
        with pytest.raises(ckptd.CheckpointError, match="No space left on device"):
            h.wait(30)
        assert c.latest() == 1
        assert not os.path.exists(os.path.join(small_disk, "j", "step-2.tmp"))
        del model.bulk
        m2, o2 = make(seed=4)
        c.restore(m2, o2)
        assert_same(full_state(m2, o2), want)
        train_step(model, optim, 1)
        assert c.snapshot(model, optim, step=3).wait(30).endswith("step-3")  # space was freed


def test_a_disk_sized_for_keep_steps_keeps_saving(small_fs, make_daemon) -> None:  # noqa: ANN001
    """--keep 2 on a disk that holds two steps: retention ran only after a new step completed, and the third never
    fit (ENOSPC at every step, for good). A shard that does not fit now removes first the step its completion would
    remove, never the one latest names, and is written again."""
    daemon = make_daemon(start=False)
    daemon.root = small_fs  # 3 MiB
    daemon.start(["--keep", "2"])
    m = torch.nn.Module()
    m.register_buffer("bulk", torch.zeros(1 << 18))  # 1 MiB a step: two fit, not three
    with daemon.client("j") as c:
        for step in (1, 2, 3, 4):
            m.bulk.fill_(float(step))
            assert c.snapshot(m, step=step).wait(30).endswith(f"step-{step}")
            assert complete_steps(small_fs, "j") == ([step - 1, step] if step > 1 else [1])
        m2 = torch.nn.Module()
        m2.register_buffer("bulk", torch.zeros(1 << 18))
        c.restore(m2)
    assert torch.equal(m2.bulk, torch.full((1 << 18,), 4.0))
    assert "did not fit on disk: removed steps [1] now" in daemon.log.read_text()


SLOW_SEAL = """import sys, time, ckptd.daemon.memtier as M
orig = M.MemoryTier._seal
def slow(self, *a, **k):
    time.sleep(1.5)  # the seal thread behind: the persist fails first
    return orig(self, *a, **k)
M.MemoryTier._seal = slow
from ckptd.cli import main
raise SystemExit(main(sys.argv[1:]))"""


def test_a_failed_persist_leaves_no_partial_step_when_its_waiters_hear_even_with_a_seal_still_out(small_fs, make_daemon) -> None:  # noqa: ANN001
    """A disk too full fails a persist at once (its blocks are reserved first), while the step's seal for a hot
    restore may still be on its thread. The waiters heard of the failure first and the partial step went only once
    the seal came back: ``wait()`` raised with ``step-N.tmp`` still there. Seen as a flaky full-disk test under load."""
    daemon = make_daemon(start=False)
    daemon.root = small_fs
    daemon.launcher = ["-c", SLOW_SEAL]
    daemon.start()
    model, optim = make()
    model.register_buffer("bulk", torch.randn(1 << 20))  # 4 MiB: cannot fit on the 3 MiB disk
    with daemon.client("j") as c:
        h = c.snapshot(model, optim, step=1)
        with pytest.raises(ckptd.CheckpointError, match="No space left on device"):
            h.wait(30)
        assert not os.path.exists(os.path.join(small_fs, "j", "step-1.tmp"))


def test_restart_after_finalize_drops_the_stale_record(make_daemon) -> None:  # noqa: ANN001
    """A crash between the manifest rename and dropping the commit record must not re-persist."""
    from ckptd import shm
    from ckptd.protocol import validate_record

    daemon = make_daemon()
    model, optim = make()
    with daemon.client("j") as c, daemon.rpc() as rpc:
        rep = rpc.call("alloc", job="j", rank=0, world_size=1, step=1, nbytes=4096, pid=os.getpid())
        rpc.call("release", segment=rep["segment"], lease=rep["lease"])
        path = c.snapshot(model, optim, step=1, blocking=True).wait(30)
    daemon.kill()
    record = {"job": "j", "rank": 0, "world_size": 1, "local_world_size": 1, "step": 1, "nbytes": 4096, "replicas": {}, "committed_at": 1}
    segs = shm.SegmentDir(daemon.root)
    segs.write_record(rep["segment"], validate_record(record, b"{}"))  # as if the crash came right after finalizing step 1
    segs.close()  # the test lets go of the directory's lock: the restarted daemon takes it and finds the record
    daemon.start([])
    assert daemon.segments() == []
    with daemon.client("j") as c:
        assert c.latest() == 1
    assert sorted(os.listdir(os.path.dirname(path))) == ["latest", "step-1"]
