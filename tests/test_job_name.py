"""The derived job name, as a new user met it: ``--steps 30`` changed to ``--steps 35`` silently started a new job
from step 0 (the name, which hashes the arguments, was logged at INFO, which Python hides). Now rank 0 says, at
warning level, which job it is and whether it has steps, and names the other runs of the same script that do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_TRAIN = """
import sys
import torch
import ckptd
model = torch.nn.Linear(4, 4)
if ckptd.latest() is None:
    ckptd.snapshot(model, step=1, blocking=True).wait(60)
"""


def _run(script: Path, endpoint: str, *args: str, job: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_JOB", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["CKPTD_ENDPOINT"] = endpoint
    if job is not None:
        env["CKPTD_JOB"] = job
    r = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=120, cwd=script.parent)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_a_changed_argument_says_it_starts_another_job_and_names_the_first(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    d = make_daemon()
    script = short_tmp / "train.py"
    script.write_text(_TRAIN)
    first = _run(script, d.endpoint, "--steps", "30")
    assert "ckptd job 'train-" in first and "no step of it yet: it starts fresh" in first
    assert "other runs of this script" not in first
    name = first.split("ckptd job '", 1)[1].split("'", 1)[0]

    second = _run(script, d.endpoint, "--steps", "35")  # the user's change: another job, said so
    assert "no step of it yet: it starts fresh" in second
    assert f"other runs of this script have steps under the daemon's root: {name} (step 1)" in second
    assert "set CKPTD_JOB to its name" in second

    again = _run(script, d.endpoint, "--steps", "30")
    assert f"ckptd job '{name}'" in again and "its newest step is 1" in again

    assert "ckptd job" not in _run(script, d.endpoint, "--steps", "30", job="chosen")  # a chosen name needs no word
