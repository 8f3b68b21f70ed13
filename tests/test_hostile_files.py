"""Hostile files where ckptd reads or writes on a user's behalf, written as the attacks: a model directory given to
``ckptd export --format hf --config-from`` whose side files link out (to a secret, a directory) or are FIFOs, or
change while the export runs; links planted in a Trainer's ``output_dir`` before ckptd writes its resume directory."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from _models import make
from safetensors.torch import load_file
from test_export_hf import _cli
from test_integrations import _hf_save

from ckptd.errors import CheckpointError
from ckptd.integrations.pointer import read_pointer
from ckptd.tools.export import export_checkpoint

SECRET = b"root:$6$the-hash-nobody-else-may-read:19000:0:99999:7:::\n"
CONFIG = b'{"model_type": "llama"}'


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file only its owner may read (``/etc/shadow`` when the export runs as root): never to reach an export."""
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture
def step_path(daemon) -> str:  # noqa: ANN001
    """A committed step of a small model, to export."""
    model, optim = make()
    with daemon.client("hostile") as c:
        return c.snapshot(model, optim, step=1, blocking=True).wait(60)


def _model_dir(path: Path) -> Path:
    """A model directory as save_pretrained writes one: its config.json, regular."""
    path.mkdir()
    (path / "config.json").write_bytes(CONFIG)
    return path


def _assert_secret_nowhere_in(out: Path) -> None:
    for root, _, files in os.walk(out):
        for name in files:
            assert SECRET not in (Path(root) / name).read_bytes(), f"{name} holds the secret"


def _export(step: str, out: Path, config_from: Path) -> subprocess.CompletedProcess:
    return _cli("export", step, "--out", str(out), "--format", "hf", "--config-from", str(config_from))


# ---------------------------------------------------------------------------- ckptd export --config-from


def test_export_skips_a_side_file_that_links_to_a_secret(step_path: str, secret: Path, tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "model")
    (src / "tokenizer.json").symlink_to(secret)  # absolute
    (src / "vocab.json").symlink_to(os.path.join("..", secret.name))  # relative, out of the directory
    (src / "tokenizer_config.json").write_text("{}")  # a regular side file: still copied
    out = tmp_path / "out"
    r = _export(step_path, out, src)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    for name in ("tokenizer.json", "vocab.json"):
        assert f"--config-from {src}: {name} is a symbolic link, not a regular file: not copied" in r.stderr
    _assert_secret_nowhere_in(out)


def test_export_refuses_a_config_json_that_links_to_a_secret_or_is_a_fifo(step_path: str, secret: Path, tmp_path: Path) -> None:
    """config.json is what the export needs (and, as --config-from FILE, what the user named): refused, not skipped."""
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").symlink_to(secret)
    out = tmp_path / "out"
    for config_from in (src, src / "config.json"):
        r = _export(step_path, out, config_from)
        assert r.returncode == 1 and f"--config-from {config_from}: config.json is a symbolic link" in r.stderr, r.stderr
        assert "cp -rL" in r.stderr  # what to do with a Hugging Face cache snapshot, whose files all link to blobs
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    for config_from in (src, src / "config.json"):
        r = _export(step_path, out, config_from)
        assert r.returncode == 1 and f"--config-from {config_from}: config.json is a FIFO, not a regular file" in r.stderr, r.stderr
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".out.")]


@pytest.mark.timeout(120)  # a FIFO opened for reading waits for a writer forever: this must end, and soon
def test_export_skips_fifos_without_waiting_on_them(step_path: str, tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "model")
    os.mkfifo(src / "tokenizer.model")
    os.mkfifo(tmp_path / "pipe")
    (src / "merges.txt").symlink_to(tmp_path / "pipe")
    out = tmp_path / "out"
    r = _export(step_path, out, src)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert f"--config-from {src}: tokenizer.model is a FIFO, not a regular file: not copied" in r.stderr
    assert f"--config-from {src}: merges.txt is a symbolic link, not a regular file: not copied" in r.stderr


def test_export_skips_side_files_that_are_or_link_to_directories(step_path: str, secret: Path, tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "model")
    (src / "tokenizer.json").symlink_to(secret.parent, target_is_directory=True)  # a linked directory entry
    (src / "added_tokens.json").mkdir()
    out = tmp_path / "out"
    r = _export(step_path, out, src)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert f"--config-from {src}: tokenizer.json is a symbolic link, not a regular file: not copied" in r.stderr
    assert f"--config-from {src}: added_tokens.json is a directory, not a regular file: not copied" in r.stderr
    _assert_secret_nowhere_in(out)


def _swap_during_export(step: str, out: Path, src: Path, swap: dict[str, Path | None]) -> tuple[threading.Thread, list[BaseException]]:
    """Export in a thread; at the first tensor written (the side files already looked at), each side file ``name`` of
    ``swap`` is replaced: by a link to a path, or by a FIFO (``None``). Returns the thread and what it raised."""
    errors: list[BaseException] = []

    def progress(done: int) -> None:
        for name, to in swap.items():
            tmp = src / f".{name}.swap"
            if to is None:
                os.mkfifo(tmp)
            else:
                tmp.symlink_to(to)
            os.replace(tmp, src / name)
        swap.clear()

    def run() -> None:
        try:
            export_checkpoint(step, str(out), fmt="hf", config_from=str(src), progress=progress)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


def test_export_copies_side_files_as_checked_though_swapped_for_a_link_meanwhile(step_path: str, secret: Path, tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "model")
    (src / "tokenizer.json").write_bytes(b'{"version": "1.0"}')
    out = tmp_path / "out"
    t, errors = _swap_during_export(step_path, out, src, {"tokenizer.json": secret, "config.json": secret})
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert (out / "tokenizer.json").read_bytes() == b'{"version": "1.0"}' and (out / "config.json").read_bytes() == CONFIG
    _assert_secret_nowhere_in(out)


def test_export_never_waits_on_a_side_file_swapped_for_a_fifo_meanwhile(step_path: str, tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "model")
    (src / "tokenizer.model").write_bytes(b"sentencepiece")
    out = tmp_path / "out"
    t, errors = _swap_during_export(step_path, out, src, {"tokenizer.model": None})
    t.join(60)
    if t.is_alive():  # blocked opening the FIFO: a writer that comes and goes lets it go, then fail
        os.close(os.open(src / "tokenizer.model", os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("the export waited on a FIFO put in a side file's place")
    assert not errors, errors
    assert (out / "tokenizer.model").read_bytes() == b"sentencepiece"


# ---------------------------------------------------------------------------- the Trainer's output_dir


def _saved_by_the_callback(daemon, job: str) -> torch.nn.Module:  # noqa: ANN001
    """Step 1 of ``job``, saved as CkptdCallback saves (its trainer state in ``extra``); returns the model."""
    model, optim = make()
    _hf_save(job, daemon.endpoint, None, model, optim, 1)
    return model


def _victim(path: Path) -> Path:
    path.write_bytes(b"# the user's own file\n")
    path.chmod(0o600)
    return path


def test_hf_resume_dir_replaces_links_planted_in_it_and_never_writes_through_them(daemon, cpu_accelerator, tmp_path: Path) -> None:  # noqa: ANN001
    from ckptd.integrations.hf import CkptdCallback

    model = _saved_by_the_callback(daemon, "hf-planted")
    output_dir = tmp_path / "o"
    ckpt = output_dir / "checkpoint-1"
    ckpt.mkdir(parents=True)  # an earlier attempt's, in an output_dir others can write into
    planted = {name: _victim(tmp_path / f"victim-{name}") for name in ("trainer_state.json", "model.safetensors", "ckptd.json")}
    for name, target in planted.items():
        (ckpt / name).symlink_to(target)
    path = CkptdCallback("hf-planted", endpoint=daemon.endpoint).resume_checkpoint(output_dir)
    assert path == str(ckpt)
    for target in planted.values():
        assert target.read_bytes() == b"# the user's own file\n" and (target.stat().st_mode & 0o777) == 0o600
    assert sorted(os.listdir(ckpt)) == ["ckptd.json", "model.safetensors", "trainer_state.json"]  # no temporaries left
    assert not any((ckpt / name).is_symlink() for name in planted)
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 1
    assert read_pointer(ckpt / "ckptd.json") == ("hf-planted", 1)
    weights = load_file(ckpt / "model.safetensors")
    assert set(weights) == set(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(weights[k], v), k


def test_hf_resume_dir_refuses_a_checkpoint_dir_that_links_elsewhere(daemon, cpu_accelerator, tmp_path: Path) -> None:  # noqa: ANN001
    from ckptd.integrations.hf import CkptdCallback

    _saved_by_the_callback(daemon, "hf-linked")
    elsewhere = tmp_path / "home"  # a directory of the user's that the link points into
    elsewhere.mkdir()
    _victim(elsewhere / "trainer_state.json")
    output_dir = tmp_path / "o"
    output_dir.mkdir()
    (output_dir / "checkpoint-1").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"checkpoint-1 is a symbolic link: .*never through a link"):
        CkptdCallback("hf-linked", endpoint=daemon.endpoint).resume_checkpoint(output_dir)
    assert os.listdir(elsewhere) == ["trainer_state.json"]
    assert (elsewhere / "trainer_state.json").read_bytes() == b"# the user's own file\n"
