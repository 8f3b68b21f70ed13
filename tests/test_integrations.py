"""The framework adapters against the real packages: train, checkpoint, kill, resume, bit-exact."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from _models import assert_same
from _poll import until
from conftest import REPO
from safetensors.torch import load_file

from ckptd.errors import FormatError
from ckptd.integrations.pointer import read_pointer
from ckptd.layout import is_complete, step_dir
from ckptd.storage.local import complete_steps

TESTS = os.path.dirname(os.path.abspath(__file__))


def _run(script: str, *args: str, expect: int = 0) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}", "PYTHONHASHSEED": "0"}
    p = subprocess.run([sys.executable, os.path.join(TESTS, script), *args], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == expect, f"{script} {args} exited {p.returncode}:\n{p.stderr[-4000:]}"


# ---------------------------------------------------------------------------- Lightning


def test_lightning_checkpoint_io_resumes_bit_exact_after_a_kill(daemon, short_tmp) -> None:  # noqa: ANN001
    pytest.importorskip("pytorch_lightning")
    ep = daemon.endpoint
    _run("_lightning_app.py", ep, "pl-full", str(short_tmp / "full"), "4", "full", str(short_tmp / "full.safetensors"))
    # the same run, SIGKILLed as its third epoch starts (its second epoch's checkpoint saved just before)
    ckpts = short_tmp / "ckpts"
    _run("_lightning_app.py", ep, "pl", str(ckpts), "4", "kill-at-2", str(short_tmp / "never"), expect=-9)
    assert read_pointer(ckpts / "last.ckpt") == ("pl", 16)  # 2 epochs of 8 batches
    assert read_pointer(ckpts / "epoch=1-step=16.ckpt") == ("pl", 16) and read_pointer(ckpts / "epoch=0-step=8.ckpt") == ("pl", 8)
    assert os.path.getsize(ckpts / "last.ckpt") < 200  # a pointer: the state itself went to the daemon
    # resumed in a new process with ckpt_path="last": the rest of the run is the uninterrupted run's, bit for bit
    _run("_lightning_app.py", ep, "pl", str(ckpts), "4", "resume", str(short_tmp / "resumed.safetensors"))
    assert_same(load_file(short_tmp / "resumed.safetensors"), load_file(short_tmp / "full.safetensors"))
    assert read_pointer(ckpts / "last.ckpt") == ("pl", 32)
    with daemon.client("pl") as c:
        until(lambda: c.latest() == 32, 60, "step 32 durable")  # the daemon persists it after the run exited
    assert is_complete(step_dir(daemon.root, "pl", 32))  # (the daemon's retention keeps the newest few steps)


@pytest.mark.multiproc
def test_lightning_ddp_saves_from_rank_0_and_every_rank_resumes(daemon, short_tmp) -> None:  # noqa: ANN001
    """Lightning's own DDP launcher, two CPU ranks: only global rank 0 calls save_checkpoint (no collective may
    wait for the other rank), both ranks load the pointer's step."""
    pytest.importorskip("pytorch_lightning")
    ep = daemon.endpoint
    _run("_lightning_app.py", ep, "pl2-full", str(short_tmp / "full"), "4", "full", str(short_tmp / "full.safetensors"), "2")
    ckpts = short_tmp / "ckpts"
    _run("_lightning_app.py", ep, "pl2", str(ckpts), "4", "kill-at-2", str(short_tmp / "never"), "2", expect=-9)
    assert read_pointer(ckpts / "last.ckpt") == ("pl2", 8)  # 2 epochs of 4 batches per rank
    _run("_lightning_app.py", ep, "pl2", str(ckpts), "4", "resume", str(short_tmp / "resumed.safetensors"), "2")
    assert_same(load_file(short_tmp / "resumed.safetensors"), load_file(short_tmp / "full.safetensors"))
    with daemon.client("pl2") as c:
        until(lambda: c.latest() == 16, 60, "step 16 durable")


def test_lightning_top_k_checkpoints_outlive_the_daemons_retention(make_daemon, short_tmp) -> None:  # noqa: ANN001
    """ModelCheckpoint keeps its best epoch however old; the daemon keeps only its newest step (--keep 1). Each
    pointer protects its step, so the best one still loads; the files Lightning removed let their steps go."""
    pytest.importorskip("pytorch_lightning")
    from ckptd.integrations.lightning import CkptdCheckpointIO

    d = make_daemon("--keep", "1")
    ckpts = short_tmp / "ckpts"
    _run("_lightning_app.py", d.endpoint, "plb", str(ckpts), "4", "best", str(short_tmp / "out.safetensors"))
    files = sorted(os.listdir(ckpts))  # the best epoch, the newest and last.ckpt: Lightning removed the others
    assert len(files) == 3 and {"epoch=3-step=32.ckpt", "last.ckpt"} < set(files), files
    best = next(f for f in files if f.startswith("best-"))
    best_step = read_pointer(ckpts / best)[1]
    assert best_step < 32, f"{best}: the best epoch should be an early one (mode='max')"
    io = CkptdCheckpointIO("plb", endpoint=d.endpoint)
    for f, step in ((best, best_step), ("last.ckpt", 32), ("epoch=3-step=32.ckpt", 32)):
        assert read_pointer(ckpts / f) == ("plb", step)
        assert io.load_checkpoint(ckpts / f)["global_step"] == step
    with d.client("plb") as c:
        c.wait()
        assert c.status()["jobs"]["plb"]["protected"] == [best_step, 32]
    until(lambda: complete_steps(d.root, "plb") == [best_step, 32], 30, "retention to remove the steps no file names")
    io.remove_checkpoint(ckpts / best)  # out of the top k: its step is left to retention
    assert not (ckpts / best).exists()
    with d.client("plb") as c:
        assert c.status()["jobs"]["plb"]["protected"] == [32]


def test_lightning_second_checkpoint_at_a_step_keeps_its_bookkeeping_across_a_resume(daemon, short_tmp) -> None:  # noqa: ANN001
    """The top-1 ModelCheckpoint saves first at each epoch's step, the newest-epoch one second: its file and
    last.ckpt pointed at the first save, whose state still named the newest-epoch callback's previous file. After a
    resume from last.ckpt that callback never removed the file it had saved last: it stayed, and its step stayed
    protected from retention for good. Each pointer now loads the state Lightning handed for it."""
    pytest.importorskip("pytorch_lightning")
    ep, ckpts = daemon.endpoint, short_tmp / "ckpts"
    _run("_lightning_app.py", ep, "plf", str(ckpts), "4", "best-first", str(short_tmp / "a.safetensors"))
    _run("_lightning_app.py", ep, "plf", str(ckpts), "6", "best-first-resume", str(short_tmp / "b.safetensors"))
    files = sorted(os.listdir(ckpts))
    assert files == ["best-epoch=5-step=48.ckpt", "epoch=5-step=48.ckpt", "last.ckpt"], files
    with daemon.client("plf") as c:
        c.wait()
        assert c.status()["jobs"]["plf"]["protected"] == sorted({read_pointer(ckpts / f)[1] for f in files})


def test_lightning_load_refuses_a_forged_pointer_and_reads_plain_checkpoints(daemon, short_tmp) -> None:  # noqa: ANN001
    pytest.importorskip("pytorch_lightning")
    from ckptd.integrations.lightning import CkptdCheckpointIO

    io = CkptdCheckpointIO("forged", endpoint=daemon.endpoint)
    bad = short_tmp / "bad.ckpt"
    for doc in ({"ckptd_pointer": 1, "job": "../../etc", "step": 1}, {"ckptd_pointer": 1, "job": "j", "step": -3}, {"ckptd_pointer": 1}):
        bad.write_text(json.dumps(doc))
        with pytest.raises(FormatError, match="malformed ckptd pointer"):
            io.load_checkpoint(bad)
    bad.write_text(json.dumps({"ckptd_pointer": 1, "job": "nothing", "step": 3}))
    with pytest.raises(Exception, match="step 3|no committed checkpoint"):
        io.load_checkpoint(bad)
    # a checkpoint Lightning wrote itself (a run that started without ckptd) loads as Lightning loads it
    plain = short_tmp / "plain.ckpt"
    torch.save({"global_step": 4, "state_dict": {"w": torch.ones(2)}}, plain)
    got = io.load_checkpoint(plain)
    assert got["global_step"] == 4 and torch.equal(got["state_dict"]["w"], torch.ones(2))
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"global_step": 1}, short_tmp / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(Exception, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, short_tmp / "x.ckpt")
    assert not (short_tmp / "x.ckpt").exists()


def test_lightning_second_save_at_a_step_loads_its_own_state_and_forged_overlays_are_refused(daemon, short_tmp, caplog) -> None:  # noqa: ANN001
    pytest.importorskip("pytorch_lightning")
    from ckptd.integrations.lightning import CkptdCheckpointIO
    from ckptd.integrations.overlay import ENTRY_BYTES

    io = CkptdCheckpointIO("second", endpoint=daemon.endpoint)
    big = torch.arange(ENTRY_BYTES // 4 + 1, dtype=torch.float32)
    first = {
        "global_step": 7, "state_dict": {"w": torch.ones(3)}, "loops": {"fit": {"done": 1}},
        "callbacks": {"A": {"best": "a.ckpt", "score": torch.tensor(0.5)}, "B": {"last": None}, "Ema": {"w": big}},
    }  # fmt: skip
    io.save_checkpoint(first, short_tmp / "a.ckpt")
    second = {
        **first, "loops": {"fit": {"done": 2}}, "hyper_parameters": {"lr": 0.1},
        "callbacks": {**first["callbacks"], "B": {"last": "b.ckpt", "when": (1, float("nan"))}, "Ema": {"w": big + 1}, "C": {"w": big}},
    }  # fmt: skip
    with caplog.at_level("WARNING", logger="ckptd.integrations"):
        io.save_checkpoint(second, short_tmp / "b.ckpt")
    assert "callbacks/C changed since the first save of step 7" in caplog.text  # too large to carry: said
    assert "Ema" not in caplog.text  # large then and now: weights-like state, taken from the first save
    doc = json.loads((short_tmp / "b.ckpt").read_text())
    assert sorted(tuple(p) for p, _ in doc["overlay"]) == [("callbacks", "B"), ("hyper_parameters",), ("loops", "fit")]
    a, b = io.load_checkpoint(short_tmp / "a.ckpt"), io.load_checkpoint(short_tmp / "b.ckpt")
    assert a["loops"] == {"fit": {"done": 1}} and a["callbacks"]["B"] == {"last": None} and "hyper_parameters" not in a
    assert b["loops"] == {"fit": {"done": 2}} and b["hyper_parameters"] == {"lr": 0.1} and b["callbacks"]["B"]["last"] == "b.ckpt"
    assert b["callbacks"]["B"]["when"][0] == 1 and math.isnan(b["callbacks"]["B"]["when"][1])
    assert torch.equal(b["callbacks"]["A"]["score"], torch.tensor(0.5)) and torch.equal(b["state_dict"]["w"], torch.ones(3))
    assert torch.equal(b["callbacks"]["Ema"]["w"], big) and "C" not in b["callbacks"]  # the first save's
    # a pointer edited by hand or by someone else: refused, naming the file, never half-applied
    tensor = ["F32", [2], "AACAPwAAgD8="]  # two float32 ones
    for bad in (
        "nope", [[["loops"], {"tree": {"__ckptd__": "set"}, "tensors": {}}]],
        [[["loops"], {"tree": {"__ckptd__": "tensor", "key": "v/x"}, "tensors": {}}]],
        [[["loops"], {"tree": 1, "tensors": {"v": ["F32", [3], tensor[2]]}}]],
        [[["loops"], {"tree": 1, "tensors": {"v": ["PY", [2], tensor[2]]}}]],
        [[["loops"], {"tree": 1, "tensors": {"v": ["F32", [-2, -1], tensor[2]]}}]], [[["a", "b", "c"], {"tree": 1, "tensors": {}}]],
        [[["global_step", "x"], {"tree": 1, "tensors": {}}]], [[["loops"], {"tree": 1, "tensors": {"v": ["F32", [2], "!!"]}}]],
    ):  # fmt: skip
        (short_tmp / "bad.ckpt").write_text(json.dumps({**doc, "overlay": bad}))
        with pytest.raises(FormatError, match="bad.ckpt: .*overlay"):
            io.load_checkpoint(short_tmp / "bad.ckpt")
    (short_tmp / "ok.ckpt").write_text(
        json.dumps({**doc, "overlay": [[["loops"], {"tree": {"t": {"__ckptd__": "tensor", "key": "v"}}, "tensors": {"v": tensor}}]]})
    )
    assert torch.equal(io.load_checkpoint(short_tmp / "ok.ckpt")["loops"]["t"], torch.ones(2))


def test_lightning_refuses_a_full_checkpoint_of_a_step_saved_weights_only(daemon, short_tmp) -> None:  # noqa: ANN001
    """Two ModelCheckpoint callbacks fire at one global_step, the weights-only one first: the full one (and
    last.ckpt) became a pointer to the weights-only step, and a resume failed for want of optimizer state.
    It is refused, saying why; a second save of the same keys (last.ckpt) is a pointer as before."""
    pytest.importorskip("pytorch_lightning")
    from ckptd.errors import CheckpointError
    from ckptd.integrations.lightning import CkptdCheckpointIO

    io = CkptdCheckpointIO("twice", endpoint=daemon.endpoint)
    weights = {"global_step": 5, "state_dict": {"w": torch.ones(2)}}
    full = {**weights, "optimizer_states": [{"state": {}, "param_groups": []}], "lr_schedulers": []}
    io.save_checkpoint(weights, short_tmp / "weights.ckpt")
    io.save_checkpoint(dict(weights), short_tmp / "weights-last.ckpt")  # the same keys: a pointer
    assert read_pointer(short_tmp / "weights-last.ckpt") == ("twice", 5)
    with pytest.raises(CheckpointError, match=r"step 5 was saved already without \['optimizer_states'\]"):
        io.save_checkpoint(full, short_tmp / "full.ckpt")
    assert not (short_tmp / "full.ckpt").exists()


# ---------------------------------------------------------------------------- Hugging Face Trainer


def test_hf_trainer_callback_resumes_bit_exact_after_a_kill(daemon, short_tmp) -> None:  # noqa: ANN001
    pytest.importorskip("accelerate")
    ep = daemon.endpoint
    _run("_hf_app.py", ep, "hf-full", str(short_tmp / "full"), "full", str(short_tmp / "full.safetensors"))
    full = short_tmp / "full"
    assert not full.exists() or not any(n.startswith("checkpoint-") for n in os.listdir(full))  # nothing written while training
    out = short_tmp / "run"
    # killed after step 10: the newest snapshot is step 8 (every 4 steps), its copy finished by step 9's optimizer step
    _run("_hf_app.py", ep, "hf", str(out), "kill-after-10", str(short_tmp / "never"), expect=-9)
    _run("_hf_app.py", ep, "hf", str(out), "resume", str(short_tmp / "resumed.safetensors"))
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-8"]
    assert read_pointer(out / "checkpoint-8" / "ckptd.json") == ("hf", 8)
    # steps 9-12 again, from step 8: weights, optimizer moments, LR schedule and dropout's RNG as the uninterrupted run's
    assert_same(load_file(short_tmp / "resumed.safetensors"), load_file(short_tmp / "full.safetensors"))
    with daemon.client("hf") as c:
        assert c.latest() == 12


def _torchrun(script: str, *args: str, expect_ok: bool = True) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", os.path.join(TESTS, script)]
    p = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=300)
    assert (p.returncode == 0) == expect_ok, f"{script} {args} exited {p.returncode}:\n{p.stderr[-4000:]}"


@pytest.mark.multiproc
def test_hf_trainer_under_torchrun_resumes_the_step_rank_0_chose(daemon, short_tmp) -> None:  # noqa: ANN001
    """Two CPU ranks (DDP over gloo): every rank snapshots, rank 0 picks and writes the step to resume, every rank
    restores it; the run ends as the uninterrupted one."""
    pytest.importorskip("accelerate")
    ep = daemon.endpoint
    _torchrun("_hf_app.py", ep, "hf2-full", str(short_tmp / "full"), "full", str(short_tmp / "full.safetensors"))
    _torchrun("_hf_app.py", ep, "hf2", str(short_tmp / "run"), "kill-after-10", str(short_tmp / "never"), expect_ok=False)
    _torchrun("_hf_app.py", ep, "hf2", str(short_tmp / "run"), "resume", str(short_tmp / "resumed.safetensors"))
    assert sorted(os.listdir(short_tmp / "run")) == ["checkpoint-8"]
    assert_same(load_file(short_tmp / "resumed.safetensors"), load_file(short_tmp / "full.safetensors"))


def test_hf_callback_not_bound_warns_that_other_callbacks_state_is_not_carried(daemon) -> None:  # noqa: ANN001
    pytest.importorskip("accelerate")
    import types

    from ckptd.integrations.hf import CkptdCallback

    cb = CkptdCallback("warn", save_steps=4, endpoint=daemon.endpoint)
    state = types.SimpleNamespace(global_step=0, stateful_callbacks={"TrainerControl": {}, "EarlyStoppingCallback": {}})
    with pytest.warns(UserWarning, match=r"EarlyStoppingCallback keep state the snapshots do not carry.*bind\(trainer\)"):
        cb.on_train_begin(None, state, None)
    cb._handler = lambda: None  # bound (to a Trainer since collected): no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.on_train_begin(None, state, None)


def test_hf_resume_checkpoint_of_a_new_job_is_none_and_a_foreign_step_is_refused(daemon, short_tmp) -> None:  # noqa: ANN001
    pytest.importorskip("accelerate")
    from _models import make

    from ckptd.errors import CheckpointError
    from ckptd.integrations.hf import CkptdCallback

    assert CkptdCallback("hf-new", endpoint=daemon.endpoint).resume_checkpoint(short_tmp / "o") is None  # a fresh start
    model, optim = make()
    with daemon.client("hf-plain") as c:
        c.snapshot(model, optim, step=3).wait(30)
    with pytest.raises(CheckpointError, match="not saved by CkptdCallback"):
        CkptdCallback("hf-plain", endpoint=daemon.endpoint).resume_checkpoint(short_tmp / "o")
    assert not (short_tmp / "o" / "checkpoint-3").exists()
    with pytest.raises(ValueError, match="save_steps"):
        CkptdCallback("x", save_steps=0)


@pytest.fixture
def hf_args(short_tmp):  # noqa: ANN001, ANN201
    """The run's ``TrainingArguments`` (output_dir ``short_tmp/o``); made before the Accelerator, as the Trainer's
    are: making them resets accelerate's process-wide state."""
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(short_tmp / "o"), save_strategy="no", report_to=[], use_cpu=True)


@pytest.fixture
def accelerator(hf_args, cpu_accelerator):  # noqa: ANN001, ANN201
    """The CPU accelerator, made after the ``TrainingArguments`` (whose making resets accelerate's state)."""
    return cpu_accelerator


def _amp_prepared(accelerator, scaler):  # noqa: ANN001, ANN202
    """Model and optimizer as the Trainer gets them from ``accelerator.prepare``. On a CPU accelerate makes no
    scaler itself (its fp16 AMP needs a GPU), so a real ``GradScaler("cpu")`` (or ``None``: no AMP) goes where
    it puts its CUDA one, ``accelerator.scaler``: ``prepare`` hands it to the ``AcceleratedOptimizer`` and
    ``backward`` scales the loss with it."""
    from _models import make

    accelerator.scaler = scaler
    model, optim = accelerator.prepare(*make())
    assert optim.scaler is scaler
    return model, optim


def _amp_step(accelerator, model, optim, i: int) -> None:  # noqa: ANN001
    from _models import batch

    optim.zero_grad()
    accelerator.backward(model(batch(i)).pow(2).mean())
    optim.step()  # the AcceleratedOptimizer's: scaler.step(optimizer), scaler.update()


def _hf_save(job: str, endpoint: str, args, model, optim, step: int) -> None:  # noqa: ANN001
    """``CkptdCallback.on_step_end`` at ``step`` as the Trainer calls it, ``on_train_end``, and the process's end."""
    from transformers import TrainerControl, TrainerState

    from ckptd.dcp import shared
    from ckptd.integrations.hf import CkptdCallback

    cb, state = CkptdCallback(job, save_steps=step, endpoint=endpoint), TrainerState(global_step=step)
    cb.on_step_end(args, state, TrainerControl(), model=model, optimizer=optim)  # the step is due: taken at the next
    cb.on_train_end(args, state, TrainerControl(), model=model, optimizer=optim)  # begin, or here (every event has them)
    shared._clients.pop((endpoint, job)).close()  # the relaunch is a new process, with a new client


def _hf_resume(job: str, endpoint: str, args, model, optim) -> None:  # noqa: ANN001
    """The restart as the Trainer runs it: ``resume_checkpoint``, the ``TrainerState`` loaded from the directory
    it wrote, ``on_train_begin`` with the new run's model and optimizer."""
    from transformers import TrainerControl, TrainerState

    from ckptd.integrations.hf import CkptdCallback

    cb = CkptdCallback(job, endpoint=endpoint)
    path = cb.resume_checkpoint(args.output_dir)
    assert path is not None
    state = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
    cb.on_train_begin(args, state, TrainerControl(), model=model, optimizer=optim)


def test_hf_callback_restores_the_amp_grad_scaler(daemon, hf_args, accelerator) -> None:  # noqa: ANN001
    """fp16 AMP: the loss scale and growth tracker the run reached come back on resume, as from the Trainer's
    own scaler.pt; a fresh scaler would start again at init_scale (and skip steps while it backs off)."""
    from _models import full_state

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    model, optim = _amp_prepared(accelerator, scaler)
    for i in range(4):  # three steps without overflow double the scale, the fourth counts towards the next
        _amp_step(accelerator, model, optim, i)
    saved = scaler.state_dict()
    assert (saved["scale"], saved["_growth_tracker"]) == (2048.0, 1)
    _hf_save("hf-amp", daemon.endpoint, hf_args, model, optim, 4)
    scaler2 = torch.amp.GradScaler("cpu")  # the restarted run's, with accelerate's defaults
    model2, optim2 = _amp_prepared(accelerator, scaler2)
    _hf_resume("hf-amp", daemon.endpoint, hf_args, model2, optim2)
    assert [(k, type(v), v) for k, v in scaler2.state_dict().items()] == [(k, type(v), v) for k, v in saved.items()]
    # both runs take step 5: the same scale on the loss, the same update, the same scaler state after it
    _amp_step(accelerator, model, optim, 4)
    _amp_step(accelerator, model2, optim2, 4)
    assert scaler2.state_dict() == scaler.state_dict() and scaler.state_dict()["_growth_tracker"] == 2
    assert_same(full_state(model2, optim2.optimizer), full_state(model, optim.optimizer))


def test_hf_callback_resumes_an_amp_step_without_amp(daemon, hf_args, accelerator, caplog) -> None:  # noqa: ANN001
    """fp16 turned off at the restart: the scaler's state is not needed (the weights are fp32), the step restores."""
    from _models import full_state

    model, optim = _amp_prepared(accelerator, torch.amp.GradScaler("cpu"))
    _amp_step(accelerator, model, optim, 0)
    _hf_save("hf-amp-off", daemon.endpoint, hf_args, model, optim, 1)
    model2, optim2 = _amp_prepared(accelerator, None)
    with caplog.at_level("INFO", logger="ckptd.integrations"):
        _hf_resume("hf-amp-off", daemon.endpoint, hf_args, model2, optim2)
    assert "has no gradient scaler" in caplog.text
    assert_same(full_state(model2, optim2.optimizer), full_state(model, optim.optimizer))


def test_hf_callback_resumes_with_amp_from_a_step_without_scaler_state(daemon, hf_args, accelerator) -> None:  # noqa: ANN001
    """fp16 turned on at the restart (or a step saved before ckptd kept the scaler): a fresh scaler, said once."""
    model, optim = _amp_prepared(accelerator, None)
    _amp_step(accelerator, model, optim, 0)
    _hf_save("hf-amp-on", daemon.endpoint, hf_args, model, optim, 1)
    scaler = torch.amp.GradScaler("cpu")
    model2, optim2 = _amp_prepared(accelerator, scaler)
    with pytest.warns(UserWarning, match="no gradient scaler state.*starts afresh") as caught:
        _hf_resume("hf-amp-on", daemon.endpoint, hf_args, model2, optim2)
    assert len([w for w in caught if "scaler" in str(w.message)]) == 1
    assert scaler.state_dict() == torch.amp.GradScaler("cpu").state_dict()


# ---------------------------------------------------------------------------- torchtitan


def test_torchtitan_checkpoint_manager_resumes_bit_exact_after_a_kill(make_daemon, short_tmp) -> None:  # noqa: ANN001
    pytest.importorskip("torchtitan")
    # a memory tier: step 8 is held in memory only when the run dies; the daemon persists it once the run is gone,
    # or when the resume asks for the newest step first (whichever comes first)
    daemon = make_daemon("--persist-every", "100")
    ep = daemon.endpoint
    (short_tmp / "a").mkdir()
    (short_tmp / "b").mkdir()
    _run("_titan_app.py", ep, "tt-full", str(short_tmp / "a"), "full", str(short_tmp / "full.safetensors"))
    # async_mode="async" saves every 4 steps through ckptd.dcp.Writer; SIGKILLed after step 10
    _run("_titan_app.py", ep, "tt", str(short_tmp / "b"), "kill-after-10", str(short_tmp / "never"), expect=-9)
    _run("_titan_app.py", ep, "tt", str(short_tmp / "b"), "resume", str(short_tmp / "resumed.safetensors"))
    resumed = json.loads((short_tmp / "resumed.safetensors.json").read_text())
    assert resumed == {"loaded": True, "resumed_at": 8}  # the newest step, not step 4 (the one persisted as first)
    assert_same(load_file(short_tmp / "resumed.safetensors"), load_file(short_tmp / "full.safetensors"))
    assert not (short_tmp / "b" / "ckpt").exists()  # nothing went to torchtitan's folder: the steps are the daemon's
    with daemon.client("tt") as c:
        until(lambda: c.latest() == 12, 60, "step 12 durable")


def test_torchtitan_config_refuses_what_cannot_work() -> None:
    pytest.importorskip("torchtitan")
    from ckptd.integrations.torchtitan import CkptdCheckpointManager

    with pytest.raises(ValueError, match="keep_latest_k must be 0"):
        CkptdCheckpointManager.Config(enable=True, keep_latest_k=5)
    with pytest.raises(ValueError, match="process mode"):
        CkptdCheckpointManager.Config(enable=True, async_mode="async_with_pinned_mem")
