"""The memory tier: snapshots the tiering policy keeps in the daemon's shared memory only, restorable on
this node, dropped or persisted as the policy says, never lost when the trainer or the daemon goes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _models import assert_same, full_state, make, train_step
from _poll import until
from conftest import REPO, env_for

from ckptd import shm
from ckptd.config import daemon_config
from ckptd.daemon.steps import StepState
from ckptd.daemon.tiering import Tier, Tiering, TierPolicy
from ckptd.errors import CheckpointError, StepDropped
from ckptd.layout import complete_steps
from ckptd.protocol import CommitRecord


def job_status(c: Any, job: str) -> dict[str, Any]:
    return c.status()["jobs"].get(job, {})


def _snapshot_steps(c: Any, model: torch.nn.Module, optim: torch.optim.Optimizer, steps: tuple[int, ...]) -> None:
    """A train step, then a blocking snapshot, for each of ``steps``."""
    for step in steps:
        train_step(model, optim, step)
        c.snapshot(model, optim, step=step, blocking=True)


def _restores(c: Any, step: int, want: dict[str, torch.Tensor], seed: int = 4) -> None:
    """A fresh model restored through ``c`` gets step ``step``, bit-exact with ``want``."""
    m2, o2 = make(seed=seed)
    c.restore(m2, o2)
    assert c.last_restore["step"] == step
    assert_same(full_state(m2, o2), want)


# ---------------------------------------------------------------------------- the policy


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_policy_persists_the_first_then_one_in_n() -> None:
    t = Tiering(TierPolicy(persist_every=3))
    tiers = [t.decide("j", disk_busy=False) for _ in range(7)]
    assert tiers == [Tier.DISK, Tier.MEMORY, Tier.MEMORY, Tier.DISK, Tier.MEMORY, Tier.MEMORY, Tier.DISK]


def test_policy_time_rule_and_a_jobs_own_settings() -> None:
    clock = Clock()
    t = Tiering(TierPolicy(persist_every=1000, persist_interval=10.0), clock)
    assert t.decide("j", disk_busy=False) is Tier.DISK
    clock.t += 9
    assert t.decide("j", disk_busy=False) is Tier.MEMORY
    clock.t += 1
    assert t.decide("j", disk_busy=False) is Tier.DISK
    t.set_job("k", 2, None)  # the job's commits override N, keep the daemon's T
    assert [t.decide("k", disk_busy=False) for _ in range(3)] == [Tier.DISK, Tier.MEMORY, Tier.DISK]
    assert t.policy_of("k") == TierPolicy(2, 10.0, "wait")


def test_policy_when_the_disk_lags() -> None:
    mem = Tiering(TierPolicy(lagging="memory"))
    assert mem.decide("j", disk_busy=False) is Tier.DISK
    assert mem.decide("j", disk_busy=True) is Tier.MEMORY and mem.owed("j")  # the newest goes once the disk is free
    assert mem.decide("j", disk_busy=False) is Tier.DISK and not mem.owed("j")
    wait = Tiering(TierPolicy())  # the default: every snapshot reaches disk, lagging or not
    assert [wait.decide("j", disk_busy=True) for _ in range(3)] == [Tier.DISK] * 3
    # a multi-node step is completed through the bucket: always persisted
    assert Tiering(TierPolicy(persist_every=5, lagging="memory")).decide("m", disk_busy=True, multi_node=True) is Tier.DISK


@pytest.mark.parametrize(
    "bad",
    [{"persist_every": 0}, {"persist_interval": -1.0}, {"lagging": "drop"}],
)
def test_bad_tiering_settings_are_refused(bad: dict[str, Any], tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        TierPolicy(**bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        daemon_config({"root": str(tmp_path), **bad})
    conf = tmp_path / "c.toml"
    conf.write_text(f"root = {json.dumps(str(tmp_path))}\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in bad.items()))
    with pytest.raises(ValueError):
        daemon_config(None, str(conf))


def test_a_client_with_bad_tiering_is_refused_and_so_is_a_forged_commit(daemon) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="persist_every"):
        daemon.client("j", persist_every=0)
    with pytest.raises(ValueError, match="persist_interval"):
        daemon.client("j", persist_interval=float("nan"))
    base = dict(job="j", rank=0, world_size=1, local_world_size=1, step=1, segment="x", lease="0" * 32, nbytes=1, replicas={})
    with daemon.rpc() as rpc:
        for bad in ({"persist_every": 0}, {"persist_every": True}, {"persist_interval": -1}, {"persist_interval": "10"}):
            with pytest.raises(CheckpointError, match="persist_"):
                rpc.call("commit", frames=(b"{}",), **base, **bad)
        assert rpc.call("hello")["server_version"]  # the daemon carries on


# ---------------------------------------------------------------------------- a daemon with a memory tier


def test_one_in_n_reaches_disk_the_rest_are_dropped_and_wait_skips_them(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("j", persist_every=3) as c:
        handles = []
        for step in range(1, 8):
            train_step(model, optim, step)
            handles.append(c.snapshot(model, optim, step=step, blocking=True))
        until(lambda: job_status(c, "j").get("memory_only", []) == [] and c.status()["memory_steps_dropped"] == 4, what="drops")
        assert [p.rsplit("-", 1)[1] for p in c.wait(60)] == ["1", "4", "7"]  # the dropped ones skipped, not raised
        with pytest.raises(StepDropped, match="dropped from memory: step 3, committed later"):
            handles[1].wait(10)
        st = c.status()
        assert st["memory_steps"] == 4 and st["steps_committed"] == 3
    assert complete_steps(daemon.root, "j") == [1, 4, 7]


def test_a_memory_only_step_is_restored_hot_named_by_status_and_ls(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("j", persist_every=100) as c:
        for step in (1, 2, 3):
            train_step(model, optim, step)
            c.snapshot(model, optim, step=step, extra={"step": step}, blocking=True)
        want = full_state(model, optim)
        st = until(lambda: (s := job_status(c, "j")).get("memory_only") == [3] and s.get("latest") == 1 and s, what="steps 1 and 3")
        assert st["in_memory"] == 3
    out = subprocess.run(
        [sys.executable, "-m", "ckptd", "ls", "--endpoint", daemon.endpoint], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    lines = {tuple(line.split()[:2]): line for line in out.splitlines()[1:]}
    assert "memory only" in lines[("j", "3")] and "<- latest" in lines[("j", "1")]
    status = subprocess.run(
        [sys.executable, "-m", "ckptd", "status", "--endpoint", daemon.endpoint], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert "(memory only: 3)" in status
    m2, o2 = make(seed=5)
    with daemon.client("j") as c:
        extra = c.restore(m2, o2)
        assert c.last_restore["source"] == "memory" and c.last_restore["step"] == 3
        assert extra == {"step": 3}
    assert_same(full_state(m2, o2), want)
    assert complete_steps(daemon.root, "j") == [1]  # read from memory, not persisted for it


def test_a_restore_that_may_not_read_memory_persists_the_newest_step_first(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("j", persist_every=100) as c:
        _snapshot_steps(c, model, optim, (1, 2))
        want = full_state(model, optim)
        m2, o2 = make(seed=5)
        c.restore(m2, o2, hot=False)
        assert c.last_restore["step"] == 2 and c.last_restore["source"] == "disk"
    assert_same(full_state(m2, o2), want)
    # step 1 (a job's first, persisted) may still be on its way: on a loaded machine step 2's persist ends first
    until(lambda: complete_steps(daemon.root, "j") == [1, 2], what="steps 1 and 2 on disk")
    verify = subprocess.run([sys.executable, "-m", "ckptd", "verify", os.path.join(daemon.root, "j", "step-2")], cwd=REPO)
    assert verify.returncode == 0


def test_a_wait_for_a_memory_only_step_persists_it(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("j", persist_every=100) as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        train_step(model, optim, 1)
        path = c.snapshot(model, optim, step=2).wait(30)  # asked for right away: persisted once sealed
        assert path.endswith("step-2") and os.path.isfile(os.path.join(path, "manifest.json"))
        assert c.status()["memory_steps_dropped"] == 0


def _trainer(daemon: Any, job: str, body: str) -> subprocess.CompletedProcess:
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from _models import make, train_step
from ckptd import Client
model, optim = make()
c = Client(job={job!r}, persist_every=100)
for step in (1, 2, 3):
    train_step(model, optim, step)
    c.snapshot(model, optim, step=step, blocking=True)
{body}
"""
    return subprocess.run([sys.executable, "-c", code], env=env_for(daemon, job), cwd=REPO, timeout=120)


def test_a_trainer_killed_after_a_memory_only_snapshot_still_ends_in_a_durable_checkpoint(daemon) -> None:  # noqa: ANN001
    proc = _trainer(daemon, "k", "os.kill(os.getpid(), signal.SIGKILL)")
    assert proc.returncode == -signal.SIGKILL
    # the restarted trainer reads it from memory, whether or not its persisting has begun
    m2, o2 = make(seed=5)
    with daemon.client("k") as c:
        c.restore(m2, o2)
        assert c.last_restore["step"] == 3 and c.last_restore["source"] == "memory"
    until(lambda: complete_steps(daemon.root, "k") == [1, 3], what="step 3 persisted after the trainer died")
    with daemon.client("k") as c:
        assert c.latest() == 3
        c.restore(m2, o2, hot=False)
        assert c.last_restore["step"] == 3 and c.last_restore["source"] == "disk"


def test_the_daemons_shutdown_persists_memory_only_steps_and_a_crash_loses_none(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon()
    model, optim = make()
    with d.client("s", persist_every=100) as c:
        _snapshot_steps(c, model, optim, (1, 2))
        until(lambda: job_status(c, "s").get("memory_only") == [2], what="step 2 in memory")
        assert d.stop() == 0
    assert complete_steps(d.root, "s") == [1, 2]
    d.start()
    with d.client("c", persist_every=100) as c:
        _snapshot_steps(c, model, optim, (1, 2))
        until(lambda: job_status(c, "c").get("memory_only") == [2], what="step 2 in memory")
        d.kill()  # the daemon crashes holding a memory-only step: its commit records survive in /dev/shm
    d.start()
    until(lambda: complete_steps(d.root, "c") == [1, 2], what="the restarted daemon persisting step 2")


def test_a_restore_of_the_newest_step_while_the_job_snapshots_reads_the_newest(daemon) -> None:  # noqa: ANN001
    """An evaluation process restores the newest step of a job that snapshots every step: the step it settled
    on (2) is dropped from memory by the next snapshot before it opens it. The restore reads the newest (3)
    instead of failing with "step 2 is not a committed checkpoint"."""
    model, optim = make()
    with daemon.client("j", persist_every=100) as c, daemon.client("j") as reader:
        _snapshot_steps(c, model, optim, (1, 2))
        until(lambda: job_status(c, "j").get("memory_only") == [2], what="step 2 in memory")
        real = reader._rpc.call

        def call(op: str, **kw: Any) -> Any:
            if op == "hot_open":  # the trainer's next snapshot lands between the settling and the opening
                _snapshot_steps(c, model, optim, (3,))
                until(lambda: job_status(c, "j").get("memory_only") == [3], what="step 3 in memory, 2 dropped")
            return real(op, **kw)

        reader._rpc.call = call  # type: ignore[method-assign]
        m2, o2 = make(seed=7)
        reader.restore(m2, o2)
        assert reader.last_restore["step"] == 3 and reader.last_restore["source"] == "memory"
        assert_same(full_state(m2, o2), full_state(model, optim))  # the trainer's state at step 3


def test_a_disk_bound_step_that_fails_after_its_seal_leaves_the_memory_only_step_before_it_restorable(daemon) -> None:  # noqa: ANN001
    """Memory-only step 3, then step 4 bound for disk: sealed first (hot restores read it at once), then its
    persist fails. Step 3, still held, must be what a restore reads (it was unreachable: "holds no step in
    memory", then "step 3 is not a committed checkpoint"), and it must not be dropped for step 4."""
    model, optim = make()
    with daemon.client("j", persist_every=3) as c:
        _snapshot_steps(c, model, optim, (1,))
        c.wait(60)
        _snapshot_steps(c, model, optim, (2, 3))
        until(lambda: job_status(c, "j").get("memory_only") == [3], what="step 3 in memory")
        want3 = full_state(model, optim)
        os.makedirs(os.path.join(daemon.root, "j", "step-4.tmp", "rank-00000.safetensors"))  # its shard cannot be written
        train_step(model, optim, 4)
        h4 = c.snapshot(model, optim, step=4, blocking=True)
        with pytest.raises(CheckpointError, match="step 4 of job j failed"):
            h4.wait(60)
        assert job_status(c, "j").get("memory_only") == [3]
    m2, o2 = make(seed=7)
    with daemon.client("j") as r:
        r.restore(m2, o2)
        assert r.last_restore["step"] == 3 and r.last_restore["source"] == "memory"
    assert_same(full_state(m2, o2), want3)


def test_a_rolled_back_run_replaces_a_memory_only_step(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("r", persist_every=100) as c:
        _snapshot_steps(c, model, optim, (1, 2))
        until(lambda: (s := job_status(c, "r")).get("memory_only") == [2] and s.get("latest") == 1, what="steps 1 and 2")
        c.restore(model, optim, step=1)
        train_step(model, optim, 9)
        want = full_state(model, optim)
        c.snapshot(model, optim, step=2, blocking=True).wait(30)  # the abandoned line's step 2 is replaced
        _restores(c, 2, want)


def test_a_rolled_back_re_save_held_in_memory_takes_the_old_steps_place_once_sealed(daemon) -> None:  # noqa: ANN001
    """Steps 1 and 2 on disk; a run rolls back to 1 and saves 2 again, memory-only: once the new step 2 is
    complete in memory the old line's step 2 leaves the disk, so no restore of step 2 (even after the new
    one is dropped or the daemon restarts) can fall back to the abandoned line."""
    model, optim = make()
    with daemon.client("rm") as c:
        _snapshot_steps(c, model, optim, (1, 2))
        c.wait(timeout=30)
    assert complete_steps(daemon.root, "rm") == [1, 2]
    with daemon.client("rm", persist_every=100) as c:
        c.restore(model, optim, step=1)
        train_step(model, optim, 9)
        want = full_state(model, optim)
        c.snapshot(model, optim, step=2, blocking=True)
        until(lambda: job_status(c, "rm").get("memory_only") == [2], what="the new step 2 in memory")
        until(lambda: complete_steps(daemon.root, "rm") == [1], what="the old line's step 2 retired")
        m2, o2 = make(seed=4)
        c.restore(m2, o2, step=2)
        assert c.last_restore["source"] == "memory"
        assert_same(full_state(m2, o2), want)


# ---------------------------------------------------------------------------- persisting slower than snapshots


def _big() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 2.1 M params: 25 MB with Adam
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optim


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    torch.manual_seed(i)
    model(torch.randn(4, 1024)).square().mean().backward()
    optim.step()
    optim.zero_grad()


@contextlib.contextmanager
def _prepared(d: Any, job: str) -> Iterator[tuple[Any, torch.nn.Module, torch.optim.Optimizer]]:
    """A client of ``d`` for ``job`` with ``_big()`` trained one step and its slots prepared."""
    model, optim = _big()
    _step(model, optim, 0)
    with d.client(job) as c:
        c.prepare(model, optim)
        yield c, model, optim


def _snap(c: Any, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    _step(model, optim, step)
    c.snapshot(model, optim, step=step, blocking=True)


SHARD = 25_300_000  # about: 2.1 M fp32 params, Adam's two moments, the header


def test_when_persisting_is_slower_than_snapshots_memory_stays_in_budget_and_the_newest_step_is_restorable(make_daemon) -> None:  # noqa: ANN001
    # a throttled disk (8 MB/s: 3 s per step) behind snapshots taken back to back
    budget = int(3.4 * SHARD)
    d = make_daemon("--lagging", "memory", "--write-rate-limit", "8M", "--shm-budget", str(budget), "--workers", "1")
    model, optim = _big()
    _step(model, optim, 0)
    snapshots = 10
    with d.client("slow") as c:
        c.prepare(model, optim)  # three slots with a memory tier: one persisting, the newest held, one being filled
        segments = set(shm.segments_of(d.root))
        assert len(segments) == 3
        for step in range(1, snapshots + 1):
            _step(model, optim, step)
            c.snapshot(model, optim, step=step, blocking=True)
            st = c.status()
            assert st["shm_bytes"] <= st["shm_budget"] == budget
            assert st["deferred_allocs"] == 0  # no snapshot waited for memory...
            assert set(shm.segments_of(d.root)) == segments  # ...or for a segment to be made
            # the newest step is restorable at once, from memory (it is not on disk yet)
            m2, o2 = _big()
            with d.client("slow") as r:
                r.restore(m2, o2)
                assert r.last_restore["step"] == step and r.last_restore["source"] == "memory"
            assert_same(full_state(m2, o2), full_state(model, optim))
        st = c.status()
        on_disk = complete_steps(d.root, "slow")
        assert st["memory_steps_dropped"] > 0 and len(on_disk) < snapshots  # the memory tier took what the disk could not
        assert st["errors"] == 0, st["last_error"]
        c.wait(120)  # the newest is persisted now; the dropped ones are skipped
    assert complete_steps(d.root, "slow")[-1] == snapshots


@pytest.mark.parametrize("blocking", [True, False])
def test_a_snapshot_every_step_with_room_to_spare_reuses_stale_steps_slots_and_never_waits_for_a_new_segment(
    make_daemon, blocking: bool
) -> None:  # noqa: ANN001
    # the budget would allow ten more segments, and the disk cannot keep up: a snapshot that finds none of its
    # slots free (the step before it not sealed yet, so the one before that not dropped yet) must take a stale
    # memory-only step's slots. Before, it waited while a new segment was made: 3.6 s for 6 GB on an H100 host.
    d = make_daemon("--lagging", "memory", "--write-rate-limit", "8M", "--shm-budget", str(14 * SHARD), "--workers", "1")
    model, optim = _big()
    _step(model, optim, 0)
    with d.client("every") as c:
        c.prepare(model, optim)  # three slots: one persisting, the newest held, one being filled
        segments = set(shm.segments_of(d.root))
        assert len(segments) == 3
        for step in range(1, 13):
            _step(model, optim, step)
            c.snapshot(model, optim, step=step, blocking=blocking)
            assert set(shm.segments_of(d.root)) == segments, f"step {step}: a segment was made on a snapshot's path"
        want = full_state(model, optim)
        c.wait(120)
        st = c.status()
        assert st["memory_steps_dropped"] > 0 and st["errors"] == 0, st["last_error"]
        assert st["deferred_allocs"] == 0
        m2, o2 = _big()
        c.restore(m2, o2)
        assert c.last_restore["step"] == 12
    assert_same(full_state(m2, o2), want)


def test_lagging_wait_puts_every_step_on_disk_with_backpressure(make_daemon) -> None:  # noqa: ANN001
    d = make_daemon("--write-rate-limit", "40M", "--shm-budget", str(int(2.4 * SHARD)), "--workers", "1")
    with _prepared(d, "w") as (c, model, optim):
        for step in range(1, 5):
            _snap(c, model, optim, step)
            st = c.status()
            assert st["shm_bytes"] <= st["shm_budget"]
        assert len(c.wait(120)) == 4
        st = c.status()
        assert st["memory_steps_dropped"] == 0 and st["memory_steps"] == 0 and st["steps_committed"] == 4
    assert complete_steps(d.root, "w") == [2, 3, 4]  # the newest three (keep = 3)


def test_when_the_disk_lags_under_lagging_wait_a_spare_slot_is_made_before_the_next_snapshot_asks(make_daemon) -> None:  # noqa: ANN001
    # prepare() made two slots; the disk (8 MB/s: 3 s per step) lags behind back-to-back snapshots. The rank
    # takes its last free slot while step 1 is still being written: a third segment is made for it right
    # then, off the loop, so step 3 finds it instead of waiting while it is made (3.4 s for 6 GB on one H100)
    d = make_daemon("--write-rate-limit", "8M", "--shm-budget", str(int(3.4 * SHARD)), "--workers", "1")
    with _prepared(d, "spare") as (c, model, optim):
        assert len(shm.segments_of(d.root)) == 2
        for step in (1, 2):
            _snap(c, model, optim, step)
        # step 1 is still being written (3 s), step 2 queued: a free slot now can only be the spare, made
        until(lambda: c.status()["slots"].get("free"), what="a spare segment made for the rank")
        assert len(shm.segments_of(d.root)) == 3
        # the alloc's reply announced the spare: the client leased it on a thread, mapped it and gave it back
        until(lambda: c._spare.warmed == 1 and c.status()["slots"].get("free"), what="the spare mapped ahead by the client")
        waited, made = c.status()["allocs_waited"], c._maps.made_on_path
        _snap(c, model, optim, 3)
        st = c.status()
        assert st["allocs_waited"] == waited, f"step 3 should have found a slot at once; daemon log:\n{d.log.read_text()[-4000:]}"
        assert c._maps.made_on_path == made, "step 3 mapped a slot on its path: the spare was not mapped ahead"
        assert st["shm_bytes"] <= st["shm_budget"] and len(shm.segments_of(d.root)) == 3
        assert len(c.wait(120)) == 3  # lagging="wait": every step reaches disk
    assert complete_steps(d.root, "spare") == [1, 2, 3]


# a daemon whose new segments are not made while the file <root>/../grow-slowly exists (a cold node: 6 GB took seconds to
# zero-fill on one H100 host); the test lets go once a request waits for one
SLOW_GROWER = """
import os, sys, time
from ckptd.daemon import growth
flag = os.path.join(os.path.dirname(os.path.abspath(sys.argv[sys.argv.index("--root") + 1])), "grow-slowly")
make = growth.Grower._make
def slow(self, need, token):
    while os.path.exists(flag):
        time.sleep(0.05)
    return make(self, need, token)
growth.Grower._make = slow
from ckptd.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_a_snapshot_that_finds_no_slot_while_its_spare_is_made_waits_for_it_mapped_never_maps_it_on_its_path(make_daemon) -> None:  # noqa: ANN001
    # seen on one H100 (--lagging wait, 6 GB): step 3 asked while the spare was still being made, took it the moment it
    # was made and mapped and page-locked it on its own path (2.5 s). The spare goes to the client's warming first now
    d = make_daemon("--write-rate-limit", "5M", "--shm-budget", str(int(3.4 * SHARD)), "--workers", "1", start=False)
    d.launcher = ["-c", SLOW_GROWER]
    d.start()
    flag = os.path.join(os.path.dirname(os.path.abspath(d.root)), "grow-slowly")
    with _prepared(d, "slowspare") as (c, model, optim):
        assert len(shm.segments_of(d.root)) == 2
        made = c._maps.made_on_path
        open(flag, "w").close()  # from here the spare is not made until a request waits for it

        def let_go() -> None:
            try:
                with d.rpc() as ch:
                    deadline = time.monotonic() + 60
                    while ch.call("status")["deferred_allocs"] == 0 and time.monotonic() < deadline:
                        time.sleep(0.02)
            finally:
                os.unlink(flag)

        t = threading.Thread(target=let_go)
        t.start()
        for step in (1, 2, 3):  # step 1 is written for 5 s (loaded hosts need the margin); step 2 takes the last slot; step 3 finds none
            _snap(c, model, optim, step)
        t.join(60)
        st = c.status()
        assert st["allocs_waited"] >= 1, "step 3 should have waited: this test no longer reaches the case it is for"
        assert c._maps.made_on_path == made, "step 3 mapped the spare on its path instead of waiting for it mapped ahead"
        # the spare was mapped ahead (before step 3 got it, or after, should step 1's write have ended first on a slow host)
        until(lambda: c._spare.warmed == 1, what="the spare mapped ahead by the client")
        assert len(shm.segments_of(d.root)) == 3 and st["shm_bytes"] <= st["shm_budget"]
        assert len(c.wait(120)) == 3  # lagging="wait": every step reaches disk
    assert complete_steps(d.root, "slowspare") == [1, 2, 3]


def test_a_garbage_shard_in_the_memory_tier_fails_its_step_and_frees_its_slot(daemon) -> None:  # noqa: ANN001
    # a buggy (or hostile) client commits a slot that holds no ckptd shard, as a memory-only step
    model, optim = make()
    with daemon.client("g", persist_every=100) as c, daemon.rpc() as rpc:
        c.snapshot(model, optim, step=1, blocking=True).wait(30)  # the first step of a job is persisted
        rep = rpc.call("alloc", job="g", rank=0, world_size=1, step=2, nbytes=4096, pid=os.getpid())
        with open(shm.path_of(rep["segment"]), "r+b") as f:
            f.write(b"\xff" * 4096)
        rpc.call(
            "commit", frames=(b"{}",), job="g", rank=0, world_size=1, local_world_size=1, step=2, segment=rep["segment"],
            lease=rep["lease"], nbytes=4096, replicas={}, persist_every=100,
        )  # fmt: skip
        got = rpc.call("wait", job="g", step=2, timeout=30)
        assert got["state"] == "failed" and "header" in got["error"]
        st = until(lambda: (s := c.status())["slots"].get("held", 0) == 0 and s, what="the slot freed")
        assert st["jobs"]["g"].get("memory_only") is None and "header" in st["last_error"]
        # the job goes on: the next snapshot is fine, and a restore reads the newest good step
        train_step(model, optim, 3)
        c.snapshot(model, optim, step=3, blocking=True)
        _restores(c, 3, full_state(model, optim), seed=9)


def test_a_refused_commit_from_another_run_does_not_drop_a_memory_only_step(daemon) -> None:  # noqa: ANN001
    # run A holds step 2 in memory only; a second live run B of the same job name, claiming a rollback to
    # step 1, commits step 2: B is refused (two live runs), and A's step 2 stays
    model, optim = make()
    with daemon.client("two", persist_every=100) as c:
        _snapshot_steps(c, model, optim, (1, 2))
        until(lambda: job_status(c, "two").get("memory_only") == [2], what="step 2 in memory")
        code = (
            "import os, sys; from ckptd.client.rpc import Channel; ch = Channel(sys.argv[1], 30.0)\n"
            "rep = ch.call('alloc', job='two', rank=0, world_size=1, step=2, nbytes=4096, pid=os.getpid())\n"
            "try:\n"
            "    ch.call('commit', frames=(b'{}',), job='two', rank=0, world_size=1, local_world_size=1, step=2,"
            " segment=rep['segment'], lease=rep['lease'], nbytes=4096, replicas={}, after=1, run=12345)\n"
            "except Exception as e:\n"
            "    print(e)\n"
        )
        out = subprocess.run([sys.executable, "-c", code, daemon.endpoint], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert "another run" in out.stdout, out.stdout + out.stderr
        st = job_status(c, "two")
        assert st.get("memory_only") == [2] and st["in_memory"] == 2
        _restores(c, 2, full_state(model, optim))


def test_a_gone_runs_half_committed_memory_only_step_is_abandoned_and_frees_its_memory(daemon) -> None:  # noqa: ANN001
    # a 2-rank run commits rank 0 of a memory-only step, then dies before rank 1 commits: the held slot goes
    model, optim = make()
    with daemon.client("src") as c:
        shard = os.path.join(c.snapshot(model, optim, step=1, blocking=True).wait(30), "rank-00000.safetensors")
    code = (
        "import os, shutil, sys; from ckptd import shm; from ckptd.client.rpc import Channel\n"
        "ch, shard = Channel(sys.argv[1], 30.0), sys.argv[2]\n"
        "n = os.path.getsize(shard)\n"
        "for step, world in ((1, 1), (2, 2)):\n"
        "    rep = ch.call('alloc', job='gone', rank=0, world_size=world, step=step, nbytes=n, pid=os.getpid())\n"
        "    shutil.copyfile(shard, shm.path_of(rep['segment']))\n"
        "    ch.call('commit', frames=(b'{}',), job='gone', rank=0, world_size=world, local_world_size=world, step=step,"
        " segment=rep['segment'], lease=rep['lease'], nbytes=n, replicas={}, run=777, persist_every=100)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, daemon.endpoint, shard], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    with daemon.rpc() as rpc:
        got = rpc.call("wait", job="gone", step=2, timeout=20)
        assert got["state"] == "failed" and "its run ended" in got["error"]
        until(lambda: rpc.call("status")["slots"].get("held", 0) == 0, what="the held slot freed")
        assert rpc.call("wait", job="gone", step=1, timeout=20)["state"] == "durable"


def test_with_an_older_step_pinned_by_a_reader_a_snapshot_short_of_memory_waits_and_never_drops_the_newest(make_daemon) -> None:  # noqa: ANN001
    # two ranks, room for four slots: step 2 held (and pinned by a reader), step 3 the newest, both in memory
    # only; rank 0's slot for step 4 must not be made by dropping step 3, the only copy of the newest state
    import threading

    from _rig import shard, tree

    d = make_daemon("--lagging", "memory", "--shm-budget", str(4 * shm.ALIGN + 4096))
    fields = dict(job="r", world_size=2, local_world_size=2, replicas={}, persist_every=1000)

    def alloc(rpc: Any, step: int, rank: int) -> dict[str, Any]:
        nbytes = len(shard(step, rank, 2))
        return rpc.call("alloc", rpc_timeout=60.0, job="r", rank=rank, world_size=2, step=step, nbytes=nbytes, pid=os.getpid())

    def fill_and_commit(rpc: Any, rep: dict[str, Any], step: int, rank: int) -> None:
        data = shard(step, rank, 2)
        with open(shm.path_of(rep["segment"]), "r+b") as f:
            f.write(data)
        lease = {"segment": rep["segment"], "lease": rep["lease"]}
        rpc.call("commit", frames=(tree(rank),), step=step, rank=rank, nbytes=len(data), **lease, **fields)

    with d.rpc() as rpc:
        for step in (1, 2):
            for rank in (0, 1):
                fill_and_commit(rpc, alloc(rpc, step, rank), step, rank)
        assert rpc.call("wait", job="r", step=1, timeout=30.0)["state"] == "durable"  # a job's first step is persisted
        assert rpc.call("wait", job="r", step=2, timeout=30.0, persist=False)["state"] == "memory"
        held = rpc.call("hot_open", job="r", step=2, pid=os.getpid())  # a reader of step 2, still reading
        assert held["step"] == 2
        for rank in (0, 1):
            fill_and_commit(rpc, alloc(rpc, 3, rank), 3, rank)
        assert rpc.call("wait", job="r", step=3, timeout=30.0, persist=False)["state"] == "memory"
        assert rpc.call("status")["jobs"]["r"]["memory_only"] == [2, 3]  # 2 stays while it is read

        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(alloc(d.rpc(), 4, 0)))
        t.start()
        until(lambda: got or rpc.call("status")["deferred_allocs"] == 1, what="the alloc for step 4 to wait or be granted")
        st = rpc.call("status")
        assert not got, f"granted by dropping a step: memory-only steps now {st['jobs']['r']['memory_only']}"
        assert st["jobs"]["r"]["memory_only"] == [2, 3] and st["memory_steps_dropped"] == 0, "the newest step was dropped"
        again = rpc.call("hot_open", job="r", step=None, pid=os.getpid())
        assert again["step"] == 3  # the newest is still there to restore
        rpc.call("hot_close", pin=again["pin"], segments=list(again["segments"].values()))
        rpc.call("hot_close", pin=held["pin"], segments=list(held["segments"].values()))  # the reader of step 2 is done
        t.join(60)
        assert got and "segment" in got[0]  # step 2 made the room, now that nobody reads it
        st = rpc.call("status")
        assert st["jobs"]["r"]["memory_only"] == [3] and st["memory_steps_dropped"] == 1


def _on_a_full_disk(small_fs: str, make_daemon: Any) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    """A daemon whose root is the 3 MiB tmpfs, and a model to save there."""
    d = make_daemon(start=False)
    d.root = small_fs
    d.start()
    return (d, *make())


def _too_big_for_the_disk(c: Any, model: torch.nn.Module, optim: torch.optim.Optimizer) -> Any:
    """Step 1 persisted (a job's first is), then step 2, 4 MiB larger than the disk, held in memory only."""
    _snapshot_steps(c, model, optim, (1,))
    c.wait(30)
    model.register_buffer("bulk", torch.randn(1 << 20))
    train_step(model, optim, 2)
    return c.snapshot(model, optim, step=2, blocking=True)


def test_a_memory_only_step_that_cannot_be_persisted_on_a_full_disk_stays_in_memory(small_fs, make_daemon) -> None:  # noqa: ANN001
    # small_fs first: it is unmounted after the daemon is stopped. Step 2 holds 4 MiB more than the 3 MiB disk:
    # wait() asks for it durable, the disk refuses, and the step must stay restorable from memory (it was lost)
    d, model, optim = _on_a_full_disk(small_fs, make_daemon)
    with d.client("j", persist_every=100) as c:
        h = _too_big_for_the_disk(c, model, optim)
        want = full_state(model, optim)
        with pytest.raises(CheckpointError, match="No space left on device.*still held in memory"):
            h.wait(30)
        st = c.status()
        assert job_status(c, "j")["memory_only"] == [2] and st["memory_steps_dropped"] == 0
        assert not os.path.exists(os.path.join(small_fs, "j", "step-2.tmp")) and complete_steps(small_fs, "j") == [1]
        m2, o2 = make(seed=4)
        m2.register_buffer("bulk", torch.zeros(1 << 20))
        c.restore(m2, o2)  # from memory, as before the failed attempt
        assert c.last_restore["step"] == 2 and c.last_restore["source"] == "memory"
        assert_same(full_state(m2, o2), want)
        errors = c.status()["errors"]
        with pytest.raises(CheckpointError, match="still held in memory"):
            h.wait(30)  # asked again: tried again, and refused again
        assert c.status()["errors"] == errors + 1
        del model.bulk
        _snapshot_steps(c, model, optim, (3,))  # a later step that fits: it replaces step 2 and reaches disk
        until(lambda: job_status(c, "j")["memory_only"] == [3], what="step 2 dropped once step 3 is complete")
        assert c.wait(30)[-1].endswith("step-3")
        assert c.status()["shm_bytes"] <= c.status()["shm_budget"]
    assert complete_steps(small_fs, "j") == [1, 3]


def test_two_ranks_one_shard_written_one_refused_by_a_full_disk_both_stay_in_memory(small_fs, make_daemon) -> None:  # noqa: ANN001
    # each 1.6 MB shard fits the 3 MiB disk alone, not both: one rank's shard may be written when the other's
    # is refused; the step goes back to memory whole (the written rank's slot was not freed) and reads hot
    from _rig import shard, tree
    from _shards import shard_bytes

    d = make_daemon(start=False)
    d.root = small_fs
    d.start()
    n = 400_000
    big = {r: bytes(shard_bytes([("model/big", torch.full((n,), float(r + 1)), (2 * n,), (r * n,))])) for r in (0, 1)}
    big_tree = json.dumps({"model": {"big": {"__ckptd__": "tensor", "key": "model/big"}}}).encode()
    fields = dict(job="b", world_size=2, local_world_size=2, replicas={}, persist_every=100)
    with d.rpc() as rpc:
        for step, data, raw in ((1, {r: shard(1, r, 2) for r in (0, 1)}, tree), (2, big, lambda r: big_tree)):
            for rank in (0, 1):
                rep = rpc.call("alloc", job="b", rank=rank, world_size=2, step=step, nbytes=len(data[rank]), pid=os.getpid())
                with open(shm.path_of(rep["segment"]), "r+b") as f:
                    f.write(data[rank])
                lease = {"segment": rep["segment"], "lease": rep["lease"]}
                rpc.call("commit", frames=(raw(rank),), step=step, rank=rank, nbytes=len(data[rank]), **lease, **fields)
        assert rpc.call("wait", job="b", step=1, timeout=30.0)["state"] == "durable"
        rep = rpc.call("wait", job="b", step=2, timeout=30.0)  # persist=True: promoted, then refused
        assert rep["state"] == "failed" and "No space left on device" in rep["error"] and "still held in memory" in rep["error"]
        st = rpc.call("status")
        assert st["jobs"]["b"]["memory_only"] == [2] and st["slots"].get("held") == 2, st["slots"]
        held = rpc.call("hot_open", job="b", step=2, pid=os.getpid())
        assert held["step"] == 2 and held["tier"] == "memory"
        for rank, seg in ((int(f.split("-")[1].split(".")[0]), s) for f, s in held["segments"].items()):
            with open(shm.path_of(seg), "rb") as f:
                assert f.read(len(big[rank])) == big[rank]
        rpc.call("hot_close", pin=held["pin"], segments=list(held["segments"].values()))
    assert complete_steps(small_fs, "b") == [1] and not os.path.exists(os.path.join(small_fs, "b", "step-2.tmp"))


@pytest.fixture
def tier_parts(tmp_path) -> Any:  # noqa: ANN001
    """A MemoryTier with its real step table, slot pool, catalog and event queue, driven by hand (no loop);
    ``settled`` records its settle calls."""
    import zmq

    from ckptd.daemon.books import Books
    from ckptd.daemon.catalog import StepCatalog
    from ckptd.daemon.events import EventQueue
    from ckptd.daemon.memtier import MemoryTier, TierHooks
    from ckptd.daemon.slots import Room, SlotPool
    from ckptd.daemon.status import Counters
    from ckptd.daemon.steps import StepTable

    root = str(tmp_path / "root")
    os.makedirs(root)
    ctx = zmq.Context()
    events = EventQueue(ctx)
    tiering, made = Tiering(TierPolicy(persist_every=100)), {}
    # the pool asks the tier for room, as the daemon wires them
    room = Room(
        reclaim=lambda job, step: made["tier"].reclaim(job, step), soon=lambda job, step: made["tier"].sealing(job, step),
        want_spare=lambda job: tiering.policy_of(job).lagging == "wait",
    )  # fmt: skip
    pool = SlotPool(shm.SegmentDir(root), 64 << 20, room=room)
    catalog = StepCatalog(root)
    steps = StepTable(catalog.complete_path)
    settled: list[Any] = []
    hooks = TierHooks(
        persist=lambda slot: None, settle=lambda key, track: settled.append((key, track.state)), after_complete=lambda job, step: None,
        run_gone=lambda job: False,
    )  # fmt: skip
    tier = made["tier"] = MemoryTier(Books(root, steps, catalog, Counters(), events, lambda r: None), pool, tiering, hooks)
    try:
        yield {"tier": tier, "steps": steps, "pool": pool, "events": events, "settled": settled}
    finally:
        tier.shutdown()
        for slot in list(pool):
            pool.unlink(slot)
        events.close()
        ctx.term()
        shm.purge(root)


def test_a_seal_of_an_earlier_attempt_never_completes_a_later_attempt_of_the_step(tier_parts) -> None:  # noqa: ANN001
    # the loop has not yet handled attempt 1's seal of rank 0 when step 5 is started afresh (its run gone) and
    # attempt 2's rank 1 is sealed: rank 0's fragment of attempt 1 must not complete attempt 2's manifest
    import time

    from _rig import record, shard, tree

    tier, steps, pool, events = (tier_parts[k] for k in ("tier", "steps", "pool", "events"))

    def commit(rank: int) -> Any:
        data = shard(5, rank, 2)
        slot = pool.lease({"job": "j", "rank": rank, "world_size": 2, "step": 5, "nbytes": len(data), "pid": os.getpid()})
        with open(shm.path_of(slot.name), "r+b") as f:
            f.write(data)
        pool.commit(slot, CommitRecord(**record(5, rank, 2, len(data)), tree=tree(rank)))
        track = steps.check_commit(("j", 5), rank, 2, 2)
        steps.record_commit(("j", 5), track, rank, 2)
        track.tier = Tier.MEMORY.value
        tier.seal(slot)
        return next_event()

    def next_event() -> Any:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = list(events.drain())
            if got:
                assert len(got) == 1, got
                return got[0]
            events.wake.poll(500)
        raise AssertionError("no ShardSealed within 30 s")

    stale = commit(0)  # attempt 1, not handled yet
    steps.drop(("j", 5))  # a new run saves step 5 afresh
    first = commit(1)
    assert first.error is None and first.manifest is None, "attempt 1's rank 0 completed attempt 2"
    tier.on_sealed(stale)  # late: nothing of attempt 2 changes
    tier.on_sealed(first)
    track = steps.get(("j", 5))
    assert track.inflight == 0 and track.state is StepState.PENDING and track.committed == {1}
    last = commit(0)
    assert last.manifest is not None and {r["rank"] for r in last.manifest["ranks"]} == {0, 1}
    tier.on_sealed(last)
    assert steps.get(("j", 5)).state is StepState.MEMORY


def test_a_snapshot_short_of_a_slot_while_the_step_before_it_is_sealed_waits_for_the_seal_not_for_a_new_segment(tier_parts) -> None:  # noqa: ANN001
    # a snapshot every step: step 1 is complete in memory, step 2 committed and being sealed. Step 3's alloc finds
    # no free slot, and the budget has room for another; sealing step 2 will drop step 1 within milliseconds, so
    # step 3 waits for that and gets step 1's slot. Before, a new segment was made while it waited (seconds per GB).
    import time

    from _rig import record, shard, tree

    tier, steps, pool, events = (tier_parts[k] for k in ("tier", "steps", "pool", "events"))
    tier._after_complete = lambda job, step: tier.completed(job, step, steps.get((job, step)))
    grants: list[Any] = []
    pool._on_grant = lambda ident, msg, result: grants.append((ident, result))

    def alloc(step: int, nbytes: int) -> Any:
        return pool.request(b"me", {"job": "j", "rank": 0, "world_size": 1, "step": step, "nbytes": nbytes, "pid": os.getpid()})

    def commit(slot: Any, step: int) -> Any:
        data = shard(step, 0, 1)
        with open(shm.path_of(slot.name), "r+b") as f:
            f.write(data)
        pool.commit(slot, CommitRecord(**record(step, 0, 1, len(data)), tree=tree(0)))
        track = steps.check_commit(("j", step), 0, 1, 1)
        steps.record_commit(("j", step), track, 0, 1)
        track.tier = Tier.MEMORY.value
        tier.seal(slot)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = list(events.drain())
            if got:
                return got[0]
            events.wake.poll(500)
        raise AssertionError("no ShardSealed within 30 s")

    n = len(shard(1, 0, 1))
    first = alloc(1, n)
    tier.on_sealed(commit(first, 1))
    assert steps.get(("j", 1)).state is StepState.MEMORY
    sealed2 = commit(alloc(2, n), 2)  # sealed, not yet handled by the loop
    assert len(list(pool)) == 2 and alloc(3, n) is None, "step 3 should wait for step 2's seal"
    assert len(list(pool)) == 2 and pool.allocs_waited == 1 and not grants
    tier.on_sealed(sealed2)  # step 2 complete: step 1 dropped, its slot goes to step 3
    assert steps.get(("j", 2)).state is StepState.MEMORY and steps.get(("j", 1)).state is not StepState.MEMORY
    assert [(ident, slot.name) for ident, slot in grants] == [(b"me", first.name)] and len(list(pool)) == 2


def test_a_failed_later_step_never_counts_as_complete_for_the_memory_only_step_before_it(tmp_path) -> None:  # noqa: ANN001
    """Memory-only step 1 failed to persist (a full disk) and is back in memory; disk-bound step 2, committed
    later, was sealed, then failed on one rank while another still writes. Step 1 is still the newest state
    there is: it must not be dropped as if a later step were complete, and no restore is served step 2."""
    from ckptd.daemon.books import Books
    from ckptd.daemon.catalog import StepCatalog
    from ckptd.daemon.memtier import MemoryTier, TierHooks
    from ckptd.daemon.status import Counters
    from ckptd.daemon.steps import StepTable, StepTrack

    class Holdings:
        def of(self, job: str, step: int) -> dict[int, Any]:
            return {}

        def drop(self, job: str, step: int) -> int:
            return 0

    class Pool:
        reclaim = None
        holdings = Holdings()

    cat = StepCatalog(str(tmp_path))
    steps = StepTable(cat.complete_path)
    hooks = TierHooks(
        persist=lambda slot: None, settle=lambda key, track: None, after_complete=lambda job, step: None, run_gone=lambda job: False
    )
    books = Books(str(tmp_path), steps, cat, Counters(), None, lambda r: None)  # type: ignore[arg-type]
    tier = MemoryTier(books, Pool(), Tiering(TierPolicy(persist_every=100)), hooks)  # type: ignore[arg-type]
    manifest = lambda step, at: {"step": step, "world_size": 1, "committed_at": at, "ranks": [{"rank": 0}]}  # noqa: E731
    steps.tracks[("j", 1)] = StepTrack(1, 1, {0}, state=StepState.MEMORY, tier="memory", committed_at=100, persist_error="ENOSPC")
    cat.note_memory("j", 1, manifest(1, 100))
    steps.tracks[("j", 2)] = StepTrack(2, 2, {0, 1}, state=StepState.FAILED, tier="disk", committed_at=200, inflight=1, error="ENOSPC")
    cat.note_memory("j", 2, manifest(2, 200))
    assert not tier._later_complete("j", 100, 1)
    tier.returned(("j", 1))
    assert steps.tracks[("j", 1)].state is StepState.MEMORY


def test_a_seal_that_comes_back_after_its_step_failed_on_disk_settles_it(tier_parts) -> None:  # noqa: ANN001
    # a step bound for disk is sealed too; when its persist fails first (a full disk, quickly), the step was settled
    # while the seal was still out (no cleanup then), and the seal's return must settle it (the partial files stayed)
    from ckptd.daemon.events import ShardSealed

    steps, tier = tier_parts["steps"], tier_parts["tier"]
    track = steps.check_commit(("j", 7), 0, 1, 1)
    steps.record_commit(("j", 7), track, 0, 1)
    track.inflight = 1  # the seal, out
    steps.fail(("j", 7), "writing ... failed: No space left on device")
    tier.on_sealed(ShardSealed("gone", "j", 7, 0, None, None, track.attempt))
    assert track.inflight == 0 and tier_parts["settled"] == [(("j", 7), StepState.FAILED)]


def test_a_step_a_full_disk_refused_at_shutdown_is_kept_for_the_next_start(small_fs, make_daemon) -> None:  # noqa: ANN001
    # SIGTERM persists the newest memory-only step; the disk refuses it: its slots and records stay in /dev/shm
    # and the next start, with room on the disk again, persists it
    d, model, optim = _on_a_full_disk(small_fs, make_daemon)
    with d.client("j", persist_every=100) as c:
        _too_big_for_the_disk(c, model, optim)
        want = full_state(model, optim)
    d.stop()
    assert d.segments(), "the step refused at shutdown was not kept"
    assert complete_steps(small_fs, "j") == [1]
    subprocess.run(["mount", "-o", "remount,size=16m", small_fs], check=True)
    d.start()
    m2, o2 = make(seed=4)
    m2.register_buffer("bulk", torch.zeros(1 << 20))
    with d.client("j") as c:
        until(lambda: complete_steps(small_fs, "j") == [1, 2], what="step 2 persisted by the restart")
        c.restore(m2, o2, hot=False)
        assert c.last_restore["step"] == 2
    assert_same(full_state(m2, o2), want)


def test_a_snapshot_waits_for_seals_under_way_even_before_any_step_is_in_memory() -> None:
    # seen once in a full run: snapshots every step outran the seal thread, steps 2 and 3 were both still being sealed
    # (no step held in memory yet) when step 4 found no free slot, and a new segment was made on its path. Step 3's
    # completion drops step 2 and frees its slot in milliseconds: the snapshot waits for that
    from types import SimpleNamespace

    from ckptd.daemon.memtier import MemoryTier
    from ckptd.daemon.steps import StepTable, StepTrack

    steps = StepTable(lambda job, step: None)
    tier = SimpleNamespace(steps=steps)
    for s in (2, 3):
        t = steps.tracks[("j", s)] = StepTrack(1, 1, committed={0}, tier="memory", committed_at=s)
        t.inflight = 1  # being sealed
    assert MemoryTier.sealing(tier, "j", 4)  # type: ignore[arg-type]
    del steps.tracks[("j", 2)]
    assert not MemoryTier.sealing(tier, "j", 4), "one step sealing and nothing older: its completion frees nothing"  # type: ignore[arg-type]
    steps.tracks[("j", 1)] = StepTrack(1, 1, committed={0}, tier="memory", committed_at=1, state=StepState.MEMORY)
    assert MemoryTier.sealing(tier, "j", 4)  # type: ignore[arg-type]
    assert not MemoryTier.sealing(tier, "j", 3), "the step asking is not the one it waits for"  # type: ignore[arg-type]
