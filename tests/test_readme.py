"""README's quickstart runs as written: the loop is SIGKILLed right after a snapshot returns, and the next run
resumes from that step. The docs cannot drift from the code that way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

# runs README's train.py in this process's scope; with DIE_AT set, SIGKILLs itself right after that step's snapshot
_HARNESS = """
import os, signal, sys
import ckptd
snapshot, die_at = ckptd.snapshot, os.environ.get("DIE_AT")
def killed_after(*args, **kwargs):
    handle = snapshot(*args, **kwargs)
    if die_at is not None and kwargs["step"] == int(die_at):
        os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies: the daemon owns what the snapshot staged
    return handle
ckptd.snapshot = killed_after
scope = {}
exec(compile(open(sys.argv[1]).read(), "README.md", "exec"), scope)
print("started at", scope["start"], flush=True)
"""


def _quickstart() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Quickstart") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_readme_quickstart_is_killed_and_resumes(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    d = make_daemon()
    train = short_tmp / "train.py"
    train.write_text(_quickstart())
    env = {**os.environ, "CKPTD_ENDPOINT": d.endpoint, "CKPTD_JOB": "quickstart"}

    def run(**extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", _HARNESS, str(train)]
        return subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=120, cwd=short_tmp)

    first = run(DIE_AT="50")
    assert first.returncode == -9, first.stderr  # killed right after step 50's snapshot returned
    with d.client("quickstart") as c:
        deadline = time.monotonic() + 60
        while c.latest() != 50:  # the daemon makes the dead trainer's step durable
            assert time.monotonic() < deadline, c.latest()
            time.sleep(0.1)
    second = run()
    assert second.returncode == 0, second.stderr
    assert "started at 51" in second.stdout
    with d.client("quickstart") as c:
        assert c.latest() == 90
