"""ckptd as DCP's storage layer: dcp.save / dcp.async_save through ckptd.dcp.Writer, dcp.load through
ckptd.dcp.Reader(job=...), and the interop both ways with snapshot() / restore()."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dcp_workers import dcp_load, dcp_save
from _dist import run_ranks
from _models import assert_same, full_state, make, train_step
from _poll import until
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptd
import ckptd.dcp
from ckptd.errors import CheckpointError
from ckptd.layout import is_complete, step_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _fresh_clients():
    """Each test's writers and readers get their own client (the registry is per process)."""
    from ckptd.dcp import shared

    yield
    for c in shared._clients.values():
        c.close()
    shared._clients.clear()


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _load_into(model: torch.nn.Module, optim: torch.optim.Optimizer, reader: ckptd.dcp.Reader, **others: object) -> dict:
    state = {**_state(model, optim), **others}
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state


def _leased(daemon) -> int:  # noqa: ANN001
    with daemon.client("probe") as c:
        return c.status()["slots"].get("leased", 0)


def test_dcp_save_is_a_ckptd_step_that_restore_reader_and_verify_read(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    want = full_state(model, optim)
    loader_state = pickle.dumps({"epoch": 2, "offset": 1234})  # as a data loader's state_dict often is: opaque bytes
    state = {**_state(model, optim), "trainer": {"step": 5, "lrs": (0.1, 0.01), "nan": float("nan")}, "loader": loader_state}
    state["trainer"]["rng"] = np.arange(4, dtype=np.int32)
    dcp.save(state, storage_writer=ckptd.dcp.Writer("j", endpoint=daemon.endpoint, durable=True), checkpoint_id="5")

    # an ordinary ckptd step: ckptd.restore reads its model and optimizer
    m2, o2 = make(seed=3)
    with daemon.client("j") as c:
        c.restore(m2, o2)
        assert c.last_restore["step"] == 5
        path = step_dir(daemon.root, "j", 5)
    assert_same(full_state(m2, o2), want)
    assert is_complete(path)  # durable=True: on disk when dcp.save returned
    verify = subprocess.run([sys.executable, "-m", "ckptd", "verify", path], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr

    # and DCP reads all of it back under the names it saved
    m3, o3 = make(seed=4)
    like = {"step": 0, "lrs": (0, 0), "nan": 0.0, "rng": np.zeros(1)}
    got = _load_into(m3, o3, ckptd.dcp.Reader(job="j", endpoint=daemon.endpoint), trainer=like, loader=b"")
    assert_same(full_state(m3, o3), want)
    assert got["loader"] == loader_state
    assert got["trainer"]["step"] == 5 and list(got["trainer"]["lrs"]) == [0.1, 0.01] and np.isnan(got["trainer"]["nan"])
    assert np.array_equal(got["trainer"]["rng"], np.arange(4, dtype=np.int32))


def test_async_save_saves_the_state_at_the_call_while_training_goes_on(make_daemon) -> None:  # noqa: ANN001
    # a slow disk (8 MB/s: ~3 s for this 25 MB state): the future resolves once the daemon holds the step,
    # training runs meanwhile, and the step reaches the disk later
    d = make_daemon("--write-rate-limit", "8M")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        torch.manual_seed(i)
        model(torch.randn(4, 1024)).square().mean().backward()
        optim.step()
        optim.zero_grad()

    step(0)
    writer = ckptd.dcp.Writer("a", endpoint=d.endpoint)
    want = full_state(model, optim)
    fut = dcp.async_save(_state(model, optim), storage_writer=writer, checkpoint_id=1)
    for i in range(1, 4):
        step(i)  # every parameter and moment changes while the save is in flight
    fut.result()
    assert not is_complete(step_dir(d.root, "a", 1))  # resolved before the slow disk had it: training was not held up
    m2 = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
    reader = ckptd.dcp.Reader(job="a", endpoint=d.endpoint)
    _load_into(m2, o2, reader)
    assert reader.last_restore["source"] == "memory"  # read from the daemon's memory, hot
    assert_same(full_state(m2, o2), want)  # the state at the call, not after the steps that followed

    # durable=True: the future resolves once the step is on the daemon's disk
    want2 = full_state(model, optim)
    fut = dcp.async_save(_state(model, optim), storage_writer=ckptd.dcp.Writer("a", endpoint=d.endpoint, durable=True), checkpoint_id=2)
    step(9)
    fut.result()
    assert is_complete(step_dir(d.root, "a", 2))
    m3 = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    o3 = torch.optim.Adam(m3.parameters(), lr=1e-3)
    ckptd.restore(m3, o3, path=step_dir(d.root, "a", 2))
    assert_same(full_state(m3, o3), want2)
    with d.client("a") as c:
        assert c.status()["errors"] == 0


class _App:
    """DCP's Stateful protocol, as in its tutorial: the state dict is made and loaded by the object."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.loaded = model, optim, False

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.loaded = True


def test_stateful_values_are_saved_and_loaded_as_dcp_does(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    want = full_state(model, optim)
    fut = dcp.async_save({"app": _App(model, optim)}, storage_writer=ckptd.dcp.Writer("s", endpoint=daemon.endpoint), checkpoint_id="3")
    fut.result()
    m2, o2 = make(seed=9)
    app = _App(m2, o2)
    dcp.load({"app": app}, storage_reader=ckptd.dcp.Reader(job="s", endpoint=daemon.endpoint))
    assert app.loaded
    assert_same(full_state(m2, o2), want)


def test_reader_reads_snapshot_steps_through_the_daemon(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    wants = {}
    with daemon.client("snap") as c:
        for s in (1, 2):
            train_step(model, optim, s)
            wants[s] = full_state(model, optim)
            c.snapshot(model, optim, step=s, extra={"note": f"at {s}"})
        c.wait(30)
    newest, first = ckptd.dcp.Reader(job="snap", endpoint=daemon.endpoint), ckptd.dcp.Reader(job="snap", endpoint=daemon.endpoint, step=1)
    for step, reader in ((2, newest), (1, first)):
        m2, o2 = make(seed=5)
        got = _load_into(m2, o2, reader, extra={"0": {"note": ""}})
        assert reader.last_restore["step"] == step
        assert_same(full_state(m2, o2), wants[step])
        assert got["extra"]["0"]["note"] == f"at {step}"
    # dcp.load's checkpoint_id names the step too; hot=False reads the disk
    m3, o3 = make(seed=6)
    reader = ckptd.dcp.Reader(job="snap", endpoint=daemon.endpoint, hot=False)
    state = _state(m3, o3)
    dcp.load(state, storage_reader=reader, checkpoint_id="1")
    set_state_dict(m3, o3, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert reader.last_restore["step"] == 1 and reader.last_restore["source"] == "disk"
    assert_same(full_state(m3, o3), wants[1])


def test_tensors_inside_a_tuple_are_read_back_not_placeholders(daemon) -> None:  # noqa: ANN001
    """DCP keeps a tuple whole: the Reader handed back its tensors as the empty meta placeholders it indexes
    with, silently. Read through the Reader, a snapshot's and a Writer's tuples hold their values."""
    pair = (torch.arange(3.0), torch.ones(2))
    with daemon.client("tup") as c:
        path = c.snapshot(torch.nn.Linear(2, 2), step=1, extra={"pair": pair}, blocking=True).wait(30)
    target: dict = {"extra": {"0": {"pair": None}}}
    dcp.load(target, storage_reader=ckptd.dcp.Reader(path), no_dist=True)
    got = target["extra"]["0"]["pair"]
    assert isinstance(got, tuple) and all(torch.equal(a, b) for a, b in zip(got, pair)), got
    writer = ckptd.dcp.Writer("tupw", endpoint=daemon.endpoint)
    dcp.save({"w": torch.arange(4.0), "pair": pair}, storage_writer=writer, checkpoint_id="5", no_dist=True)
    target = {"w": torch.zeros(4), "pair": None}
    dcp.load(target, storage_reader=ckptd.dcp.Reader(job="tupw", endpoint=daemon.endpoint), no_dist=True)
    assert torch.equal(target["w"], torch.arange(4.0)) and all(torch.equal(a, b) for a, b in zip(target["pair"], pair)), target


def test_a_save_after_a_reader_restore_continues_the_run(daemon) -> None:  # noqa: ANN001
    """As after ckptd.restore: a relaunch that loaded step 1 may save step 2 again (the old run's step 2 is replaced)."""
    model, optim = make()
    w = ckptd.dcp.Writer("r", endpoint=daemon.endpoint, durable=True)
    for s in (1, 2):
        train_step(model, optim, s)
        dcp.save(_state(model, optim), storage_writer=w, checkpoint_id=s)
    from ckptd.dcp import shared

    shared._clients.pop((daemon.endpoint, "r")).close()  # the relaunch: a new process, a new client
    m2, o2 = make(seed=1)
    _load_into(m2, o2, ckptd.dcp.Reader(job="r", endpoint=daemon.endpoint, step=1))
    train_step(m2, o2, 42)
    want = full_state(m2, o2)
    dcp.save(_state(m2, o2), storage_writer=ckptd.dcp.Writer("r", endpoint=daemon.endpoint, durable=True), checkpoint_id=2)
    m3, o3 = make(seed=2)
    ckptd.restore(m3, o3, path=step_dir(daemon.root, "r", 2))
    assert_same(full_state(m3, o3), want)


def _titan_state(model: torch.nn.Module, optim: torch.optim.Optimizer, sched: object, loader: bytes, step: int) -> dict:
    """What torchtitan's CheckpointManager hands DCP: the model's keys at the top level, the optimizer flattened."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    return {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optim, options=flat),
        "lr_scheduler": sched.state_dict(),  # type: ignore[attr-defined]
        "dataloader": {"dp_rank_0": loader},
        "train_state": {"step": step, "ntokens_seen": 4096 * step},
    }


def test_a_torchtitan_shaped_state_round_trips(daemon) -> None:  # noqa: ANN001
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    model, optim = make()
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.9**s)
    for i in range(2):
        train_step(model, optim, i)
        sched.step()
    want, loader = full_state(model, optim), pickle.dumps({"sample": 17})
    fut = dcp.async_save(
        _titan_state(model, optim, sched, loader, 5), storage_writer=ckptd.dcp.Writer("tt", endpoint=daemon.endpoint), checkpoint_id=5
    )
    fut.result()
    m2, o2 = make(seed=8)
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda s: 0.9**s)
    state = _titan_state(m2, o2, s2, b"", 0)
    dcp.load(state, storage_reader=ckptd.dcp.Reader(job="tt", endpoint=daemon.endpoint, step=5))
    set_model_state_dict(m2, {k: state[k] for k in m2.state_dict()})
    set_optimizer_state_dict(m2, o2, state["optimizer"], options=StateDictOptions(flatten_optimizer_state_dict=True))
    s2.load_state_dict(state["lr_scheduler"])
    assert_same(full_state(m2, o2), want)
    assert state["dataloader"]["dp_rank_0"] == loader and state["train_state"] == {"step": 5, "ntokens_seen": 4096 * 5}
    assert s2.last_epoch == sched.last_epoch == 2 and s2.get_last_lr() == sched.get_last_lr()


def test_a_writer_that_knows_its_step_commits_before_async_save_returns(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    want = full_state(model, optim)
    fut = dcp.async_save(_state(model, optim), storage_writer=ckptd.dcp.Writer("known", endpoint=daemon.endpoint, step=4))
    with daemon.rpc() as rpc:  # before DCP's thread did anything: the daemon has every rank's commit already
        assert rpc.call("wait", job="known", step=4, timeout=0.0, persist=False)["state"] in ("pending", "memory", "durable")
    fut.result()
    m2, o2 = make(seed=2)
    with daemon.client("known") as c:
        c.restore(m2, o2, step=4)
    assert_same(full_state(m2, o2), want)
    with pytest.raises(BaseException, match="saves step 5; the save names checkpoint_id 6"):
        dcp.save(_state(model, optim), storage_writer=ckptd.dcp.Writer("known", endpoint=daemon.endpoint, step=5), checkpoint_id=6)


# ---------------------------------------------------------------------------- mistakes


def test_a_save_without_a_step_or_with_a_path_for_one_is_refused_and_leaves_nothing(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    w = ckptd.dcp.Writer("m", endpoint=daemon.endpoint)
    with pytest.raises(BaseException, match="checkpoint_id=str"):
        dcp.save(_state(model, optim), storage_writer=w)
    with pytest.raises(ValueError, match="checkpoint_id is the step number"):
        dcp.save(_state(model, optim), storage_writer=w, checkpoint_id="/ckpt/step-5")
    with pytest.raises(ValueError, match="checkpoint_id is the step number"):
        dcp.async_save(_state(model, optim), storage_writer=w, checkpoint_id="-1").result()
    fut = dcp.async_save(_state(model, optim), storage_writer=w)
    with pytest.raises(BaseException, match="checkpoint_id=str"):
        fut.result()
    assert not ckptd.dcp.Writer.validate_checkpoint_id("/ckpt/x") and ckptd.dcp.Writer.validate_checkpoint_id("12")
    w2 = ckptd.dcp.Writer("m2", endpoint=daemon.endpoint)
    dcp.save(_state(model, optim), storage_writer=w2, checkpoint_id=1)
    with pytest.raises(BaseException, match="checkpoint_id=str"):  # the next save names its own step, or none: never 1 again
        dcp.save(_state(model, optim), storage_writer=w2)
    w.close()  # the async save that failed before committing gave nothing back by itself
    assert _leased(daemon) == 0
    with daemon.client("m") as c:
        assert c.latest() is None


def test_a_reused_writer_commits_each_save_its_own_state_after_a_failed_save(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    w = ckptd.dcp.Writer("reuse", endpoint=daemon.endpoint)
    train_step(model, optim, 0)
    failed = dcp.async_save(_state(model, optim), storage_writer=w, checkpoint_id="/ckpt/step-1")  # staged, then refused
    with pytest.raises(ValueError, match="checkpoint_id is the step number"):
        failed.result()
    train_step(model, optim, 1)
    want = full_state(model, optim)
    dcp.async_save(_state(model, optim), storage_writer=w, checkpoint_id=2).result()
    m2, o2 = make(seed=3)
    with daemon.client("reuse") as c:
        c.restore(m2, o2, step=2)
    assert_same(full_state(m2, o2), want)  # the state of its own call, not the failed save's left in the writer
    assert _leased(daemon) == 1  # the failed save's copy, held until the writer is closed (or 4 newer ones)...
    del w, failed
    gc.collect()
    until(lambda: _leased(daemon) == 0, 10, "the slot given back")  # ...or dropped, as one made per save is


def test_a_value_ckptd_cannot_store_is_named_and_nothing_is_leased(daemon) -> None:  # noqa: ANN001
    model, optim = make()
    w = ckptd.dcp.Writer("v", endpoint=daemon.endpoint)
    with pytest.raises(BaseException, match="cannot checkpoint set at trainer/seen"):
        dcp.save({**_state(model, optim), "trainer": {"seen": {1, 2}}}, storage_writer=w, checkpoint_id=1)
    with pytest.raises(CheckpointError, match="'extra' entry is ckptd's per-rank extra"):
        dcp.async_save({**_state(model, optim), "extra": [1, 2]}, storage_writer=w, checkpoint_id=1)
    assert _leased(daemon) == 0


def test_process_mode_is_refused_with_a_reason(daemon) -> None:  # noqa: ANN001
    w = ckptd.dcp.Writer("p", endpoint=daemon.endpoint)
    with pytest.raises(CheckpointError, match="default thread mode"):
        pickle.dumps(w)  # what async_save(async_checkpointer_type=PROCESS) does to hand it to its process


def test_reader_mistakes_are_clear(daemon) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="Reader\\(path\\), or a job"):
        ckptd.dcp.Reader()
    with pytest.raises(ValueError, match="give step only with job"):
        ckptd.dcp.Reader("/tmp", step=3)
    model, optim = make()
    with pytest.raises(BaseException, match="has no committed checkpoint"):
        dcp.load(_state(model, optim), storage_reader=ckptd.dcp.Reader(job="nothing-here", endpoint=daemon.endpoint))
    with daemon.client("x") as c:
        c.snapshot(model, optim, step=1).wait(30)
    with pytest.raises(BaseException, match="step 7"):
        dcp.load(_state(model, optim), storage_reader=ckptd.dcp.Reader(job="x", endpoint=daemon.endpoint, step=7))
    with pytest.raises(ValueError, match="checkpoint_id is the step number"):
        dcp.load(_state(model, optim), storage_reader=ckptd.dcp.Reader(job="x", endpoint=daemon.endpoint), checkpoint_id="latest")
    with pytest.raises(BaseException, match="model.nope"):  # DCP's planner fails after the reader opened the step (hot)
        dcp.load({"model": {"nope": torch.zeros(2)}}, storage_reader=ckptd.dcp.Reader(job="x", endpoint=daemon.endpoint))
    with daemon.client("probe") as c:
        assert c.status()["hot_pins"] == {}  # no hot pin left behind by the failed loads


# ---------------------------------------------------------------------------- several ranks


@pytest.mark.multiproc
def test_two_rank_fsdp2_dcp_saves_load_into_one_process_and_into_ddp(daemon, short_tmp) -> None:  # noqa: ANN001
    expected = str(short_tmp / "expected")
    run_ranks(2, dcp_save, "fsdp2", daemon.endpoint, "f2", expected)
    from safetensors.torch import load_file

    # one process, through DCP's planner (step 2: the async one) and through ckptd.restore (step 1)
    m, o = make(seed=11)
    reader = ckptd.dcp.Reader(job="f2", endpoint=daemon.endpoint, step=2)
    got = _load_into(m, o, reader, trainer={"step": 0, "rank_seen": 0})
    assert_same(full_state(m, o), load_file(f"{expected}.2"))
    assert got["trainer"]["step"] == 2
    m1, o1 = make(seed=12)
    with daemon.client("f2") as c:
        c.restore(m1, o1, step=1)
    assert_same(full_state(m1, o1), load_file(f"{expected}.1"))
    # two DDP ranks, the newest step; then two FSDP1 ranks, the blocking one
    out = run_ranks(2, dcp_load, "ddp", daemon.endpoint, "f2", expected, 2)
    assert [r["trainer"]["step"] for r in out] == [2, 2]
    run_ranks(2, dcp_load, "fsdp1", daemon.endpoint, "f2", expected, 1)


def test_the_guides_dcp_snippet_runs(daemon, monkeypatch) -> None:  # noqa: ANN001
    import re

    from conftest import REPO

    text = (REPO / "docs" / "integrations.md").read_text()
    section = text[text.index("## `torch.distributed.checkpoint`") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    monkeypatch.setenv("CKPTD_ENDPOINT", daemon.endpoint)
    model, optim = make()
    train_step(model, optim, 0)
    want = full_state(model, optim)
    scope = {"model": model, "optim": optim, "step": 3}
    exec(compile(snippet, "docs/integrations.md", "exec"), scope)  # noqa: S102 - the guide's own code
    assert scope["state"]["trainer"]["step"] == 3  # type: ignore[index]  (loaded back by the snippet's dcp.load)
    m2, o2 = make(seed=4)
    with daemon.client("my-job") as c:
        c.restore(m2, o2, step=3)
    assert_same(full_state(m2, o2), want)
