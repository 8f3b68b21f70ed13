"""Alloc burst: several ranks ask one daemon for a new staging slot at once (a job's first snapshot or
``prepare()``), and a client asks ``hello`` meanwhile. Measures when the last slot is granted and how
long the loop kept the ``hello`` waiting (segments made on the loop block it; made by worker threads,
they do not).

    .venv/bin/python benchmarks/alloc_burst.py [--ranks 4] [--gb 0.5] [--repo DIR]

``--repo`` runs the daemon of another checkout (``python -m ckptd serve`` with that directory first on
the path), to compare versions in one run. Prints a table; writes ``bench-out/alloc_burst.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptd.client.rpc import Channel  # noqa: E402


def burst(repo: str, ranks: int, nbytes: int) -> dict[str, float]:
    d = tempfile.mkdtemp(prefix="ckab")
    ep = f"ipc://{d}/d.sock"
    env = dict(os.environ, PYTHONPATH=repo)
    proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", f"{d}/root", "--endpoint", ep], cwd=repo, env=env,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{d}/d.sock") and time.monotonic() < deadline:
            time.sleep(0.05)
        with Channel(ep, 60.0) as rpc:
            rpc.call("hello")
            done: list[float] = []
            t0 = time.monotonic()

            def one(rank: int) -> None:
                rpc.call("alloc", rpc_timeout=120.0, job="b", rank=rank, world_size=ranks, step=1, nbytes=nbytes, pid=os.getpid())
                done.append(time.monotonic() - t0)

            threads = [threading.Thread(target=one, args=(r,)) for r in range(ranks)]
            for t in threads:
                t.start()
            time.sleep(0.05)  # the allocs are in
            h0 = time.monotonic()
            rpc.call("hello")
            hello = time.monotonic() - h0
            for t in threads:
                t.join()
        return {"all_granted_s": max(done), "hello_s": hello}
    finally:
        proc.terminate()
        proc.wait(30)
        subprocess.run(["rm", "-rf", d], check=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--repo", action="append", default=None, help="checkouts to compare (default: this one)")
    args = ap.parse_args()
    repos = args.repo or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    rows = {}
    for _ in range(args.reps):
        for repo in repos:  # interleaved: the machine's noise falls on every version alike
            r = burst(repo, args.ranks, int(args.gb * 2**30))
            rows.setdefault(repo, []).append(r)
    print("| daemon | ranks x GB | all granted (s, median) | hello answered during it (s, median) |\n|---|---:|---:|---:|")
    out = {}
    for repo, rs in rows.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
        out[repo] = {"runs": rs, "median": med}
        print(f"| {repo} | {args.ranks} x {args.gb} | {med['all_granted_s']:.2f} | {med['hello_s']:.3f} |")
    os.makedirs("bench-out", exist_ok=True)
    with open("bench-out/alloc_burst.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
