"""The memory tier with two ranks over gloo: a memory-only step of a sharded (FSDP2) or replicated (DDP,
FSDP1) job is restored hot, bit-exact, on two ranks and in one process; a restore that may not read shared
memory persists it first and reads it from disk.

The saving ranks stay alive until each test releases them: the daemon persists a job's newest memory-only
step once every process that committed it is gone, and these tests need it held in memory meanwhile.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from _dist import run_ranks
from _memtier_workers import HOLD_S, restore_from_daemon, save_memory_tier_and_hold
from _models import assert_same, full_state, make
from _poll import until
from safetensors.torch import load_file

from ckptd.layout import complete_steps, step_dir
from ckptd.storage.verify import verify_checkpoint

pytestmark = pytest.mark.multiproc

WORLD = 2
EVERY = 100  # persist one snapshot in 100: of steps 1, 2, 3 only the first reaches disk


def job_status(daemon: Any, job: str) -> dict[str, Any]:
    with daemon.client(job) as c:
        return c.status()["jobs"].get(job, {})


@contextmanager
def held_save(daemon: Any, tmp: Path, kind: str, job: str) -> Iterator[str]:
    """Two ranks of layout ``kind`` snapshot steps 1, 2, 3 with ``persist_every=EVERY`` and stay alive
    inside the block; yields the file holding the full state as of step 3. The ranks are released, and
    their failures raised, on the way out."""
    expected, ready, release = str(tmp / "expected.safetensors"), str(tmp / "ready"), str(tmp / "release")
    result: dict[str, Any] = {}

    def save() -> None:
        try:
            result["outs"] = run_ranks(WORLD, save_memory_tier_and_hold, kind, daemon.endpoint, job, expected, EVERY, ready, release)
        except BaseException as e:  # raised in the test's thread below
            result["error"] = e

    t = threading.Thread(target=save, name="save-ranks", daemon=True)
    t.start()
    try:
        until(lambda: all(os.path.exists(f"{ready}.{r}") for r in range(WORLD)) or not t.is_alive(), timeout=HOLD_S, what="the ranks' save")
        if "error" in result:
            raise result["error"]
        assert t.is_alive(), "the saving ranks exited before the test released them"
        yield expected
    finally:
        Path(release).touch()
        t.join(HOLD_S + 60)
    assert not t.is_alive(), "the saving ranks did not exit once released"
    if "error" in result:
        raise result["error"]
    assert len({o["pid"] for o in result["outs"]}) == WORLD


def memory_only_3_latest_1(daemon: Any, job: str) -> dict[str, Any]:
    """Wait (bounded) until step 3 is complete in memory only, step 1 durable, step 2 dropped. (``latest``
    reads the root: step 1 is on disk there a moment before the daemon counts it durable and takes it off
    ``in_flight``; the counters below are checked after that.)"""
    st = until(
        lambda: (s := job_status(daemon, job)).get("memory_only") == [3] and s.get("latest") == 1 and s.get("in_flight") == [] and s,
        what="step 3 in memory only and step 1 on disk",
    )
    assert st["in_memory"] == 3
    assert complete_steps(daemon.root, job) == [1]
    with daemon.client(job) as c:
        s = c.status()
        assert c.latest() == 1
    assert s["steps_committed"] == 1 and s["memory_steps"] == 2 and s["memory_steps_dropped"] == 1  # step 2, when 3 completed
    assert s["errors"] == 0, s["last_error"]
    return st


def test_fsdp2_memory_only_step_restores_hot_on_two_ranks_and_in_one_process(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    job = "mt2"
    with held_save(daemon, short_tmp, "fsdp2", job) as expected:
        memory_only_3_latest_1(daemon, job)
        outs = run_ranks(WORLD, restore_from_daemon, "fsdp2", daemon.endpoint, job, expected, True)
        assert [(o["source"], o["step"], o["extra"]) for o in outs] == [("memory", 3, {"rank": r}) for r in range(WORLD)]
        # one process, no process group, a plain model: the layout-free path reads both ranks' shards
        model, optim = make(seed=7)
        with daemon.client(job) as c:
            extra = c.restore(model, optim)
            last = dict(c.last_restore or {})
        assert last["source"] == "memory" and last["step"] == 3
        assert extra == {"rank": 0}
        assert_same(full_state(model, optim), load_file(expected))
        # read from memory, not persisted for it: the memory tier still holds step 3, the disk only step 1
        assert complete_steps(daemon.root, job) == [1]
        st = job_status(daemon, job)
        assert st["memory_only"] == [3] and st["latest"] == 1 and st["in_memory"] == 3
    # every process that committed step 3 is gone now: the daemon persists it
    until(lambda: complete_steps(daemon.root, job) == [1, 3], what="step 3 persisted once its run ended")
    assert verify_checkpoint(step_dir(daemon.root, job, 3)) == []


@pytest.mark.parametrize("kind", ["ddp", "fsdp1"])
def test_a_restore_that_may_not_read_memory_persists_the_memory_only_step_on_two_ranks(daemon, short_tmp: Path, kind: str) -> None:  # noqa: ANN001
    job = f"mt-{kind}"
    with held_save(daemon, short_tmp, kind, job) as expected:
        memory_only_3_latest_1(daemon, job)
        outs = run_ranks(WORLD, restore_from_daemon, kind, daemon.endpoint, job, expected, False)
        assert [(o["source"], o["step"], o["extra"]) for o in outs] == [("disk", 3, {"rank": r}) for r in range(WORLD)]
        # persisted for the restore while the run is still alive (not because it ended)
        assert complete_steps(daemon.root, job) == [1, 3]
        st = job_status(daemon, job)
        assert st.get("memory_only", []) == [] and st["latest"] == 3
        with daemon.client(job) as c:
            s = c.status()
        assert s["steps_committed"] == 2 and s["memory_steps_dropped"] == 1 and s["errors"] == 0, s["last_error"]
    path = step_dir(daemon.root, job, 3)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["step"] == 3 and manifest["world_size"] == WORLD and [r["rank"] for r in manifest["ranks"]] == [0, 1]
    assert verify_checkpoint(path) == []  # persisted with checksums, though sealed in memory without them
    assert complete_steps(daemon.root, job) == [1, 3]
