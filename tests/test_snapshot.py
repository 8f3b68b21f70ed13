"""Single-process snapshot / restore against a real daemon."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _models import assert_same, full_state, make, train_step

import ckptd
from ckptd.errors import CheckpointError, FormatError


def test_blocking_snapshot_restores_bit_exact(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    for i in range(3):
        train_step(model, optim, i)
    want = full_state(model, optim)
    rng = torch.get_rng_state()
    with daemon.client("j") as c:
        h = c.snapshot(model, optim, step=3, extra={"epoch": 1, "rng": rng, "pos": (3, 7)}, blocking=True)
        assert h.copied()
        path = h.wait(30)
        assert path == os.path.join(daemon.root, "j", "step-3") and c.latest() == 3
        m2, o2 = make(seed=1)  # other weights, optimizer without state
        extra = c.restore(m2, o2)
    assert_same(full_state(m2, o2), want)
    assert extra["epoch"] == 1 and extra["pos"] == (3, 7) and torch.equal(extra["rng"], rng)
    # training continues identically from the restored state
    assert train_step(m2, o2, 3) == train_step(model, optim, 3)


@pytest.mark.parametrize("overlap", ["auto", "always"])
def test_overlapped_snapshot_is_state_at_call(daemon, overlap: str) -> None:  # noqa: ANN001
    """Default mode: optim.step() right after the call must not leak into the checkpoint, whether the
    optimizer's tensors are copied behind the next step ("always") or, CPU state in "auto", before return."""
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("j", overlap=overlap) as c:
        for step in (1, 2, 3):
            want = full_state(model, optim)
            h = c.snapshot(model, optim, step=step)
            # which path ran: a copy left for the background thread, or none (committed before return)
            assert (c._guard._thread is not None) == (overlap == "always")
            assert h.copied() or overlap == "always"
            train_step(model, optim, step)  # forward mutates a buffer, step() mutates params + state
            train_step(model, optim, step + 10)
            h.wait(30)
            m2, o2 = make(seed=5)
            c.restore(m2, o2, step=step)
            assert_same(full_state(m2, o2), want)


def test_changed_steps_have_changed_bytes(daemon) -> None:  # noqa: ANN001
    """A cached layout must never re-write an earlier step's data."""
    model, optim = make()
    with daemon.client("j") as c:
        train_step(model, optim, 0)
        c.snapshot(model, optim, step=1).wait(30)
        train_step(model, optim, 1)
        c.snapshot(model, optim, step=2).wait(30)
        m1 = json.load(open(os.path.join(daemon.root, "j", "step-1", "manifest.json")))
        m2 = json.load(open(os.path.join(daemon.root, "j", "step-2", "manifest.json")))
        for key in ("model/inp.weight", "optim/state/inp.weight/exp_avg"):
            assert m1["tensors"][key]["chunks"][0]["xxh3_64"] != m2["tensors"][key]["chunks"][0]["xxh3_64"]


def test_retention_keeps_newest_three_and_latest(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("j") as c:
        for step in range(1, 6):
            train_step(model, optim, step)
            c.snapshot(model, optim, step=step)
        assert len(c.wait(60)) == 5
        assert c.latest() == 5
    names = sorted(os.listdir(os.path.join(daemon.root, "j")))
    assert names == ["latest", "step-3", "step-4", "step-5"]
    assert open(os.path.join(daemon.root, "j", "latest")).read().strip() == "5"


def test_restore_by_path_needs_no_daemon(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    want = full_state(model, optim)
    with daemon.client("j") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(30)
    daemon.stop()
    m2, o2 = make(seed=3)
    assert ckptd.restore(m2, o2, path=path) == {}
    assert_same(full_state(m2, o2), want)
    m3, o3 = make(seed=4)
    ckptd.restore(m3, o3, path=os.path.dirname(path))  # a job directory means its latest step
    assert_same(full_state(m3, o3), want)


def test_model_only_and_many_jobs(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("a") as a, daemon.client("b") as b:
        a.snapshot(model, step=1)
        train_step(model, optim, 0)
        want = full_state(model, None)
        b.snapshot(model, step=7, blocking=True)
        a.wait(30), b.wait(30)
        assert (a.latest(), b.latest()) == (1, 7)
        m2, _ = make(seed=9)
        b.restore(m2)
        assert_same(full_state(m2, None), want)


def test_corrupt_shard_is_named_on_restore(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        path = c.snapshot(model, optim, step=1).wait(30)
    shard = os.path.join(path, "rank-00000.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    m2, o2 = make(seed=2)
    with pytest.raises(FormatError, match="rank-00000.safetensors"):
        ckptd.restore(m2, o2, path=path)
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(FormatError, match="truncated"):
        ckptd.restore(m2, o2, path=path)


def test_restore_errors_are_clear(daemon, tmp_path) -> None:  # noqa: ANN001
    model, optim = make()
    with daemon.client("empty") as c:
        assert c.latest() is None
        with pytest.raises(CheckpointError, match="no committed checkpoint"):
            c.restore(model, optim)
        with pytest.raises(CheckpointError, match="not a committed checkpoint"):
            c.restore(model, optim, step=4)
        c.snapshot(model, optim, step=1).wait(30)
        other = torch.nn.Linear(3, 3)
        with pytest.raises(CheckpointError, match="missing from the checkpoint: model/weight, model/bias; in the checkpoint but not"):
            c.restore(other)
    with pytest.raises(CheckpointError, match="neither a committed"):
        ckptd.restore(model, optim, path=str(tmp_path))


def test_no_daemon_is_a_clear_error(short_tmp) -> None:  # noqa: ANN001
    model, optim = make()
    with ckptd.Client(endpoint=f"ipc://{short_tmp}/none.sock", job="j", timeout=0.5) as c:
        with pytest.raises(ckptd.DaemonUnavailable, match="is `ckptd serve` running"):
            c.snapshot(model, optim, step=1)


def test_bad_arguments(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    with pytest.raises(ValueError, match="invalid job"):
        ckptd.Client(endpoint=daemon.endpoint, job="../x")
    with daemon.client("j") as c:
        with pytest.raises(ValueError, match="step"):
            c.snapshot(model, optim, step=-1)
        with pytest.raises(TypeError, match="extra/0/f"):
            c.snapshot(model, optim, step=1, extra={"f": print})
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        with pytest.raises(CheckpointError, match="already committed"):
            c.snapshot(model, optim, step=1, blocking=True)
        assert c.snapshot(model, optim, step=2, blocking=True).wait(30)  # still usable


def test_each_restore_starts_a_new_attempt_even_of_the_same_step(daemon) -> None:  # noqa: ANN001
    """Rolling back to step 1 twice in one process and saving step 3 again each time: every save of step 3 is
    another attempt (launch id drawn afresh, restored step), so no two are ever taken for one another (in the
    bucket, a multi-node step's files of two attempts share their names)."""
    from ckptd.validate import read_manifest

    model, optim = make()
    attempts = []
    with daemon.client("att") as c:
        for line in range(3):
            if line:
                assert c.restore(model, optim, step=1).step == 1
            for step in (2, 3) if line else (1, 2, 3):
                train_step(model, optim, 10 * line + step)
                c.snapshot(model, optim, step=step).wait(30)
            m = read_manifest(os.path.join(daemon.root, "att", "step-3"))
            attempts.append((m["run"], m["after"]))
    assert attempts[0][1] is None and attempts[1][1] == attempts[2][1] == 1
    assert len({run for run, _ in attempts}) == 3


def test_a_bad_overlap_setting_is_refused_up_front(daemon, monkeypatch) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="overlap must be one of auto, always, never, got 'yes'"):
        daemon.client("j", overlap="yes")
    monkeypatch.setenv("CKPTD_OVERLAP", "on")
    with pytest.raises(ValueError, match="CKPTD_OVERLAP='on' is not one of auto, always, never"):
        daemon.client("j")
    monkeypatch.setenv("CKPTD_OVERLAP", "never")
    with daemon.client("j") as c:
        assert c.overlap == "never"
    monkeypatch.setenv("CKPTD_OVERLAP", "")
    with daemon.client("j") as c:
        assert c.overlap == "auto"


@pytest.mark.parametrize("endpoint", ["bogus://nowhere", "/run/ckptd/ckptd.sock", "tcp://host", "ipc://"])
def test_bad_endpoint_is_a_clear_error(endpoint: str) -> None:
    with pytest.raises(CheckpointError, match="is not a ckptd endpoint .*use ipc:///path/to/ckptd.sock"):
        ckptd.Client(endpoint=endpoint, job="x", timeout=1)


def test_layout_cache_reused_and_invalidated(daemon) -> None:  # noqa: ANN001
    """The shard layout is built once and reused while the state's chunks keep their shapes and set."""
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        c.snapshot(model, optim, step=1, blocking=True)
        first = c._stager.layout
        train_step(model, optim, 1)
        c.snapshot(model, optim, step=2, blocking=True)
        assert c._stager.layout is first  # values changed, layout did not
        model.hidden = torch.nn.Linear(40, 40, bias=False)  # a parameter leaves the set
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, optim, 2)
        c.snapshot(model, optim, step=3, blocking=True)
        second = c._stager.layout
        assert second is not first and "model/hidden.bias" not in {s.key for s in second.chunks}
        model.out = torch.nn.Linear(40, 6, bias=False)  # a parameter changes shape
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, optim, 3)
        c.snapshot(model, optim, step=4, blocking=True)
        assert c._stager.layout is not second
        assert next(s for s in c._stager.layout.chunks if s.key == "model/out.weight").sizes == (6, 40)
        c.wait(30)
        m2, o2 = make(seed=2)
        m2.hidden, m2.out = torch.nn.Linear(40, 40, bias=False), torch.nn.Linear(40, 6, bias=False)
        c.restore(m2, torch.optim.AdamW(m2.parameters(), lr=1e-2))
        assert torch.equal(m2.out.weight, model.out.weight)


def test_prepare_creates_and_maps_the_slots_ahead(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        c.prepare(model, optim)
        st = c.status()
        assert st["slots"] == {"free": 2}
        prepared = c._maps.names()
        assert len(prepared) == 2
        for step in (1, 2, 3):
            c.snapshot(model, optim, step=step, blocking=True).wait(30)  # slots free again: no third is needed
            train_step(model, optim, step)
        assert c._maps.names() == prepared  # no new segment was created or mapped
        assert sum(c.status()["slots"].values()) == 2


def test_prepare_again_keeps_its_mappings_and_asking_for_many_slots_or_none_works(daemon) -> None:  # noqa: ANN001
    from ckptd.client.copy import MAPPINGS_KEPT

    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        c.prepare(model, optim)
        mapped = dict(c._maps._maps)
        c.snapshot(model, optim, step=1, blocking=True).wait(30)
        c.prepare(model, optim)  # the daemon gives the rank its own slots back: their mappings are kept, not made twice
        assert all(c._maps._maps[name] is m for name, m in mapped.items())
        c.prepare(model, optim, slots=0)
        c.prepare(model, optim, slots=MAPPINGS_KEPT + 2)  # asked for side by side, all made; the newest few kept mapped
        assert sum(c.status()["slots"].values()) == MAPPINGS_KEPT + 2
        assert len(c._maps.names()) == MAPPINGS_KEPT
        c.snapshot(model, optim, step=2, blocking=True).wait(30)
    m2, o2 = make(seed=3)
    with daemon.client("j") as r:
        r.restore(m2, o2)
    assert_same(full_state(m2, o2), full_state(model, optim))


def test_prepare_on_a_budget_too_small_for_its_slots_takes_those_that_fit_and_says_so(make_daemon, caplog) -> None:  # noqa: ANN001
    # it waited for the alloc timeout (600 s), failed "is ckptd serve running?", and the slot it had asked for
    # was granted later to nobody, so the next snapshot failed the same way
    from ckptd import shm

    d = make_daemon("--shm-budget", str(int(1.5 * shm.ALIGN)))
    model, optim = make()
    train_step(model, optim, 0)
    with d.client("j") as c:
        with caplog.at_level("WARNING", logger="ckptd.client"):
            c.prepare(model, optim)
        assert "prepare(): 1 of 2 slots fit now" in caplog.text and "raise --shm-budget" in caplog.text
        assert c.status()["slots"] == {"free": 1} and c.status()["deferred_allocs"] == 0
        assert c.snapshot(model, optim, step=1, blocking=True).wait(30).endswith("step-1")


def test_a_forked_child_does_not_inherit_the_trainers_slot_mappings(daemon) -> None:  # noqa: ANN001
    # DataLoader workers are forked from the trainer: a child holding a mapping of a slot would keep its pages
    # allocated after the daemon unlinked the segment, outside the daemon's budget, for as long as it lives
    from ckptd import shm

    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("fork") as c:
        c.prepare(model, optim)
        c.snapshot(model, optim, step=1).wait(30)
        names = c._maps.names()
        assert names

        def mapped() -> set[str]:
            with open("/proc/self/maps") as f:
                lines = [line.rstrip() for line in f]
            return {n for n in names if any(line.endswith(shm.path_of(n)) for line in lines)}

        assert mapped(), "the trainer maps its slots"
        pid = os.fork()
        if pid == 0:  # the child: only os-level calls, then out
            os._exit(0 if not mapped() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked child inherited a slot mapping"
