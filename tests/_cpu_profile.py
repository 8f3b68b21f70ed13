"""Opt-in pytest plugin: each test's wall time and CPU seconds (its worker's own, plus its children that were reaped
during the test), written per xdist worker to ``$CKPTD_CPU_PROFILE_DIR/cpu_<worker>.json`` as ``[nodeid, wall, cpu]``
rows. Not loaded by ``make test``; to see where the suite's time goes::

    CKPTD_CPU_PROFILE_DIR=/tmp/prof PYTHONPATH=tests .venv/bin/python -m pytest -q -p _cpu_profile -n 3 --dist worksteal tests
    .venv/bin/python tests/_cpu_profile.py /tmp/prof

Processes reaped after their test (a forkserver's ranks, the session's S3 server) and those outside the tree (the
loopback sshd behind sshfs) are not counted per test.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

_rows: list[tuple[str, float, float]] = []


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    t0, c0 = time.monotonic(), _cpu()
    yield
    _rows.append((item.nodeid, round(time.monotonic() - t0, 2), round(_cpu() - c0, 2)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("CKPTD_CPU_PROFILE_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"cpu_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json"), "w") as f:
            json.dump(_rows, f)


def summary(directory: str, top: int = 20) -> str:
    """The totals, then the files and the tests that took the most CPU."""
    paths = sorted(glob.glob(os.path.join(directory, "cpu_*.json")))
    if not paths:
        raise SystemExit(f"no cpu_*.json in {directory}: run pytest with -p _cpu_profile and CKPTD_CPU_PROFILE_DIR={directory}")
    rows = [r for p in paths for r in json.load(open(p))]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, wall, cpu in rows:
        f = files[nodeid.split("::")[0]]
        f[0], f[1], f[2] = f[0] + wall, f[1] + cpu, f[2] + 1
    wall, cpu = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines = [f"{len(rows)} tests: {wall:.0f} s of wall time, {cpu:.0f} s of CPU", "", "wall s  cpu s  tests  file"]
    lines += [f"{w:6.0f} {c:6.0f} {n:6d}  {name}" for name, (w, c, n) in sorted(files.items(), key=lambda kv: -kv[1][1])[:top]]
    lines += ["", "wall s  cpu s  test"]
    lines += [f"{w:6.1f} {c:6.1f}  {nodeid}" for nodeid, w, c in sorted(rows, key=lambda r: -r[2])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
