"""Traps a new user fell into, each written as the user's mistake: ``ckptd ls | head``, a job named where a path
goes (``ckptd verify <job>`` as ``ckptd ls`` prints it), an hf export without ``--config-from``, and a ``tcp://``
endpoint where nothing listens (or no daemon at the default endpoint)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _models import make, train_step
from conftest import REPO

import ckptd


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, cwd=REPO, timeout=300, env=env)


def _steps(daemon, job: str, n: int) -> list[str]:  # noqa: ANN001
    model, optim = make()
    paths = []
    with daemon.client(job) as c:
        for step in range(1, n + 1):
            train_step(model, optim, step)
            paths.append(c.snapshot(model, optim, step=step).wait(30))
    return paths


# ---------------------------------------------------------------------------- ckptd ls | head


def test_ls_into_a_pipe_closed_early_ends_quietly(short_tmp: Path) -> None:
    """``ckptd ls | head``: head exits after its lines, and ckptd printed a BrokenPipeError traceback."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before ckptd writes: every write to the pipe fails with EPIPE
    try:
        p = subprocess.run(
            [sys.executable, "-m", "ckptd", "ls", "--root", str(short_tmp)], stdout=w, stderr=subprocess.PIPE, cwd=REPO, timeout=120
        )
    finally:
        os.close(w)
    assert (p.returncode, p.stderr.decode()) == (141, "")  # 128 + SIGPIPE, silent: what cat and ls give the shell


# ---------------------------------------------------------------------------- a job where a path goes


def test_verify_and_export_take_the_job_as_ls_lists_it(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    first, last = _steps(daemon, "run1", 2)
    env = dict(os.environ, CKPTD_ENDPOINT=daemon.endpoint)
    listed = _cli("ls", env=env)
    assert listed.returncode == 0 and "run1" in listed.stdout, listed.stderr
    r = _cli("verify", "run1", env=env)  # the job's name as ls printed it, where a path goes
    assert r.returncode == 1 and "--job run1" in r.stderr, r.stderr
    r = _cli("verify", "--job", "run1", env=env)  # its latest complete step, under the root the daemon names
    assert (r.returncode, r.stdout.strip()) == (0, f"{last}: OK"), r.stderr
    r = _cli("verify", "--job", "run1", "--step", "1", "--root", daemon.root)
    assert (r.returncode, r.stdout.strip()) == (0, f"{first}: OK"), r.stderr
    out = short_tmp / "model.safetensors"
    r = _cli("export", "--job", "run1", "--step", "1", "--root", daemon.root, "--out", str(out))
    assert r.returncode == 0 and out.is_file(), r.stderr
    assert _cli("verify", last).returncode == 0  # the path form as before

    r = _cli("verify", "--job", "run2", env=env)
    assert r.returncode == 1 and f"no job 'run2' under {daemon.root} (jobs there: run1)" in r.stderr, r.stderr
    r = _cli("export", "--job", "run1", "--step", "7", "--root", daemon.root, "--out", str(short_tmp / "x"))
    assert r.returncode == 1 and "job 'run1' has no complete step 7" in r.stderr and "(complete steps: 1, 2)" in r.stderr, r.stderr
    assert not (short_tmp / "x").exists()
    assert _cli("verify", last, "--job", "run1").returncode == 2  # a path or a job, not both
    assert _cli("verify", last, "--step", "1").returncode == 2  # --step goes with --job
    assert _cli("verify").returncode == 2


# ---------------------------------------------------------------------------- hf export without a config


def test_an_hf_export_without_a_config_says_from_pretrained_cannot_load_it(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    (path,) = _steps(daemon, "hf", 1)
    out = short_tmp / "exported"
    r = _cli("export", path, "--out", str(out), "--format", "hf")
    assert r.returncode == 0, r.stderr
    assert os.listdir(out) == ["model.safetensors"]  # no config.json: from_pretrained(out) fails on it
    warning = r.stderr.strip()
    assert warning.startswith("ckptd export: warning: no --config-from") and "no config.json" in warning, r.stderr
    assert "from_pretrained" in warning and "save_pretrained" in warning and "copy that config.json" in warning  # the remedies
    assert r.stdout.strip().endswith("(weights only: no config.json)")

    cfg = short_tmp / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = _cli("export", path, "--out", str(short_tmp / "complete"), "--format", "hf", "--config-from", str(cfg))
    assert r.returncode == 0 and "warning" not in r.stderr and "weights only" not in r.stdout, r.stderr


# ---------------------------------------------------------------------------- no daemon where the client looks


def test_a_tcp_endpoint_where_nothing_listens_fails_within_ckptd_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """CKPTD_TIMEOUT=30 and nothing listening at a tcp:// endpoint: the client gave up after 61 s (the request's wait,
    then a hello probe's as long again). It gives up within the timeout, naming the endpoint and CKPTD_ENDPOINT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # free once closed: nothing listens there
    monkeypatch.setenv("CKPTD_ENDPOINT", endpoint)
    monkeypatch.setenv("CKPTD_TIMEOUT", "2")
    model, optim = make()
    # the first request a trainer makes (resume: latest), and a snapshot (its alloc may wait long for memory); the
    # snapshot's bound allows for its staging, done before it asks the daemon
    with ckptd.Client(job="j") as c:
        for call, bound in ((c.latest, 3.0), (lambda: c.snapshot(model, optim, step=1), 4.5)):
            t0 = time.monotonic()
            with pytest.raises(ckptd.DaemonUnavailable) as e:
                call()
            assert time.monotonic() - t0 < bound
            assert f"no answer from the ckptd daemon at {endpoint} within 2." in str(e.value), e.value
            assert "CKPTD_ENDPOINT" in str(e.value) and "is `ckptd serve` running there?" in str(e.value)


def test_no_daemon_at_the_default_endpoint_points_at_ckptd_endpoint(short_tmp: Path) -> None:
    """The daemon was started with --endpoint elsewhere; the CLI looked at the default socket and said only that no
    daemon runs. It says which endpoint it tried, that it is the default one, and how to point at another."""
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_ENDPOINT"}
    env["XDG_RUNTIME_DIR"] = str(short_tmp)  # the default endpoint: a socket of this user's there, absent
    r = _cli("ls", env=env)
    assert r.returncode == 1, r.stderr
    assert f"no ckptd daemon at ipc://{short_tmp}/ckptd-{os.getuid()}/ckptd.sock" in r.stderr, r.stderr
    assert "this user's default endpoint (CKPTD_ENDPOINT is not set)" in r.stderr
    assert "reached by setting CKPTD_ENDPOINT to it" in r.stderr
