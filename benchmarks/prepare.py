"""prepare(): how long a trainer's one-time slot set-up takes, and what the first snapshots cost after it.

    .venv/bin/python benchmarks/prepare.py [--params 88e6] [--slots 2] [--reps 3] [--repo DIR ...]

Each sample is a fresh trainer process against a fresh daemon (so every slot is made): ``prepare()``
is timed, then the first ``slots`` blocking snapshots (they must find their slots made and mapped:
about the copy's cost, no segment made on their path). ``--repo`` runs the trainer and daemon of other
checkouts too (``git worktree add /tmp/old <commit>``), interleaved with this one, to compare versions
in one run. Prints a table; writes ``bench-out/prepare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

TRAINER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from _harness import DaemonProcess, build_state
import ckptd
params, slots, work = float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
model, optim = build_state(params)
d = DaemonProcess(os.path.join(work, "root"), f"ipc://{work}/d.sock", os.path.join(work, "d.log"))
try:
    d.wait_ready()
    with ckptd.Client(endpoint=d.endpoint, job="prep") as c:
        t0 = time.perf_counter()
        c.prepare(model, optim, slots=slots)
        prep = time.perf_counter() - t0
        firsts = []
        for step in range(1, slots + 1):
            t0 = time.perf_counter()
            c.snapshot(model, optim, step=step, blocking=True)
            firsts.append(time.perf_counter() - t0)
        made = sum(c.status()["slots"].values())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    print(json.dumps({"prepare_s": prep, "first_snapshots_s": firsts, "slots_made": made, "state_bytes": nbytes}))
finally:
    d.stop()
"""


def sample(repo: str, params: float, slots: int) -> dict[str, float]:
    work = tempfile.mkdtemp(prefix="ckpp", dir=os.environ.get("CKPTD_BENCH_DIR"))
    try:
        env = dict(os.environ, PYTHONPATH=repo)
        out = subprocess.run([sys.executable, "-c", TRAINER, HERE, str(params), str(slots), work],
                             cwd=repo, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"trainer of {repo} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=88e6)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--repo", action="append", default=[], help="another checkout to compare (repeatable)")
    p.add_argument("--json", default="bench-out/prepare.json")
    args = p.parse_args(argv)
    repos = [REPO, *[os.path.abspath(r) for r in args.repo]]
    sample(REPO, args.params, args.slots)  # warm-up, not counted: this VM's first touch of fresh memory costs seconds
    rows: dict[str, list[dict[str, float]]] = {r: [] for r in repos}
    for _ in range(args.reps):
        for r in repos:
            rows[r].append(sample(r, args.params, args.slots))
    gb = rows[REPO][0]["state_bytes"] / 1e9
    print("## prepare() benchmark\n")
    print(f"- state {gb:.3f} GB per slot, {args.slots} slots; {args.reps} reps interleaved after a warm-up, median\n")
    print("| checkout | prepare() (s) | GB/s of slots | first snapshots, each (s) | slots made | samples prepare (s) |")
    print("|---|---:|---:|---:|---:|---|")
    out = {}
    for r in repos:
        prep = statistics.median(s["prepare_s"] for s in rows[r])
        first = statistics.median(x for s in rows[r] for x in s["first_snapshots_s"])
        name = "this" if r == REPO else r
        samples = " ".join(f"{s['prepare_s']:.3f}" for s in rows[r])
        made = max(s["slots_made"] for s in rows[r])
        print(f"| {name} | {prep:.3f} | {gb * args.slots / prep:.2f} | {first:.3f} | {made} | {samples} |")
        out[name] = {"prepare_s": prep, "first_snapshot_s": first, "samples": rows[r]}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"params": args.params, "slots": args.slots, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
