"""Draw the benchmarks' JSON results (bench-out/*.json) as PNG bar charts in docs/bench/.

    .venv/bin/python benchmarks/plot.py [--src bench-out] [--out docs/bench]

Each chart shows the median of every measured row; a result file that is absent is skipped.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _bars(path: str, title: str, labels: list[str], values: list[float], unit: str, highlight: str = "ckptd") -> None:
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(labels) + 1.3))
    colors = ["#1f77b4" if highlight in lab else "#999999" for lab in labels]
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    for i, v in enumerate(values[::-1]):
        ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", default="bench-out")
    p.add_argument("--out", default="docs/bench")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    made = []

    def load(name: str) -> dict | None:
        path = os.path.join(args.src, f"{name}.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    if (d := load("stall")) is not None:
        keep = ["floor", "ckptd_blocking", "ckptd_default", "ckptd_first_prepared", "dcp_async_thread", "dcp_async_process_shm",
                "dcp_async_process", "torch_save", "dcp_save"]  # fmt: skip
        rows = [r for k in keep for r in d["rows"] if r["key"] == k and r.get("median_s") is not None]
        gb = d["state"]["bytes"] / 1e9
        _bars(os.path.join(args.out, "stall.png"), f"Time until the call returns, {gb:.2f} GB of state (lower is better)",
              [r["name"].split(":")[0] for r in rows], [r["median_s"] for r in rows], "seconds")  # fmt: skip
        made.append("stall.png")
    if (d := load("many_tensors")) is not None:
        med = d["median"]
        names = {"floor": "floor: fused copy (_foreach_copy_)", "blocking": "ckptd blocking, warm", "default": "ckptd default, warm"}
        _bars(os.path.join(args.out, "many_tensors.png"), f"{d['tensors']} tensors: time until the call returns",
              list(names.values()), [med[k] for k in names], "seconds")  # fmt: skip
        made.append("many_tensors.png")
    if (d := load("training_loop")) is not None:
        res = {k: v for k, v in d["results"].items() if v.get("overhead_per_ckpt_s") is not None}
        _bars(os.path.join(args.out, "training_loop.png"), "Training-loop time added per checkpoint (lower is better)",
              list(res), [max(0.0, v["overhead_per_ckpt_s"]) for v in res.values()], "seconds per checkpoint")  # fmt: skip
        made.append("training_loop.png")
    if (d := load("persist_restore")) is not None:
        med = d["median"]
        names = {"plain": "plain write + fsync", "persist": "ckptd persist", "restore_ckptd": "ckptd restore", "restore_dcp": "dcp.load"}
        if "restore_ckptd_evicted" in med:  # since the restores are also measured from an evicted page cache
            names |= {"restore_ckptd_evicted": "ckptd restore, evicted", "restore_dcp_evicted": "dcp.load, evicted"}
        _bars(os.path.join(args.out, "persist_restore.png"), f"{d['bytes'] / 1e9:.2f} GB: persist and restore",
              list(names.values()), [med[k] for k in names], "seconds")  # fmt: skip
        made.append("persist_restore.png")
    if (d := load("hot_restore")) is not None:
        med = d["median"]
        names = {"memory": "ckptd restore from the daemon's memory (hot)", "disk_cold": "from disk, page cache evicted",
                 "disk_warm": "from disk, page cache warm"}  # fmt: skip
        _bars(os.path.join(args.out, "hot_restore.png"), f"{d['bytes'] / 1e9:.2f} GB: restore after a trainer restart",
              list(names.values()), [med[k] for k in names], "seconds", highlight="memory")  # fmt: skip
        made.append("hot_restore.png")
    if (d := load("scaling")) is not None:
        rows = d["results"]
        labels = [f"{r['bytes'] / 1e9:.2f} GB, {r['ranks']} rank(s)" for r in rows]
        _bars(os.path.join(args.out, "scaling.png"), "Blocking snapshot / floor, slowest rank (1.0 = copy speed)",
              labels, [r["stall_s"] / r["floor_s"] for r in rows], "x floor", highlight="")  # fmt: skip
        made.append("scaling.png")
    print(f"wrote {', '.join(made) or 'nothing'} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
