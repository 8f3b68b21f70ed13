"""Before and after a change: stall.py, many_tensors.py, training_loop.py and cpu_per_checkpoint.py on two checkouts of this repository,
the two alternating in one run on one machine.

    .venv/bin/python benchmarks/before_after.py [--before 0d2d4fa] [--after worktree] [--rounds 2]
        [--benchmarks stall,many_tensors,training_loop,cpu_per_checkpoint] [--stall-args "..."] [--many-tensors-args "..."]
        [--training-loop-args "..."] [--json bench-out/before_after.json]

What it is for: showing that a change (issue 36's refactor of the daemon) leaves the benchmarks unchanged within
noise. Numbers from two runs at different times are not comparable on a shared machine (the load, the page cache,
the CPU's clock all move); so in each round, for each benchmark, the before checkout and the after checkout run back
to back, the order swapped every round (neither always runs first, right after the other's daemon has exited), and
both sides see the same machine at nearly the same moment: their ratio is fair.

A checkout is a git revision, checked out detached with ``git worktree add`` in a temp directory (removed at the
end, also on an error or Ctrl-C), or ``worktree``: this repository's working tree as it is, uncommitted edits
included (the default for ``--after``; ``--before`` defaults to 0d2d4fa, the commit before the refactor began).
Each run is ``<this python> <checkout>/benchmarks/<script>.py --json <tmp> <args>`` in the checkout with
``PYTHONPATH=<checkout>``, so the checkout's ``ckptd`` is imported, by the benchmark and by the ``python -m ckptd
serve`` daemon it starts, before the installed one (checked for each checkout before the first run); torch is the
same on both sides. cpu_per_checkpoint.py, which uses only the public API, is the exception: both sides run this
repository's copy of it (with the checkout's ``ckptd``), so that a checkout older than the script is measured too.
The default arguments are small (2 rounds take about 10-15 minutes on 2 cores) and skip torch DCP rows where a flag
allows (DCP is the same code on both sides); ``--stall-args`` etc. replace a benchmark's arguments (a single option
needs ``=``: ``--stall-args=--skip-process``).

The headline numbers taken from each run's JSON (a key missing in an older checkout's JSON reads n/a):

* stall: the ckptd rows' median stall (ms): the first snapshot, the first after prepare(), warm blocking, default;
  a blocking snapshot's call to durable; the median of the per-pair ratios warm blocking / floor copy.
* many_tensors: warm blocking and default snapshot (ms), the first snapshot, a restore from disk, and the median
  of the per-pair ratios warm blocking / fused floor.
* training_loop: each ckptd mode's overhead per checkpoint (ms, the median of the script's own rounds).
* cpu_per_checkpoint: each mode's CPU time per checkpoint (ms) in the trainer's process and in the daemon, and the
  idle daemon's CPU per second: what a wall-clock overhead is made of, and far less noisy than one.

Each benchmark also gives a reference row with no ckptd code in it (the floor copy, the quiet training step): its
after/before is how much the machine itself moved between the sides. Prints a markdown table (per metric: the median
over rounds and the rounds' samples, before and after, after/before and after - before) and writes it, with every
run's metrics and raw JSON, to ``--json``. Exits 1 if a benchmark run fails (the tail of its output is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import alternate, machine_info, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKTREE = "worktree"  # a checkout spec: the working tree of REPO as it is, not a revision
DEFAULT_BEFORE = "0d2d4fa"  # the commit before issue 36's refactor began
SIDES = ("before", "after")
REF = "(reference, no ckptd) "
Metrics = dict[str, float | None]


def log(msg: str) -> None:
    print(f"[before_after {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchFailed(Exception):
    """A benchmark run (or the import check before the runs) failed; the message carries the tail of its output."""


# ---------------------------------------------------------------------------- metrics


def dig(obj: Any, *path: str) -> Any:
    """``obj[path[0]][path[1]]...``, or ``None`` where a key is missing or a level is not a dict."""
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return obj


def number(x: Any, scale: float = 1.0) -> float | None:
    """``x * scale`` for a finite int or float, else ``None`` (a missing or null value, a string, NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        return None
    return float(x) * scale


STALL_ROWS = {  # stall.py's Results row keys (Results.to_json in _harness.py) -> metric
    "ckptd_first": "first snapshot(blocking=True), allocating its slot (ms)",
    "ckptd_first_prepared": "first snapshot(blocking=True) after prepare() (ms)",
    "ckptd_blocking": "warm snapshot(blocking=True) (ms)",
    "ckptd_default": "warm snapshot() default (ms)",
    "ckptd_blocking_durable": "blocking snapshot: call -> durable (ms)",
}
MANY_TENSORS_KEYS = {  # many_tensors.py's "median" keys -> metric
    "blocking_first": "first snapshot(blocking=True) (ms)",
    "blocking": "warm snapshot(blocking=True) (ms)",
    "default": "warm snapshot() default (ms)",
    "restore": "ckptd.restore from disk (ms)",
}


def stall_metrics(out: dict[str, Any]) -> Metrics:
    """stall.py's JSON: the ckptd rows' medians (ms), the paired blocking / floor ratio, the floor copy alone (ms)."""
    rows = {r.get("key"): r for r in out.get("rows") or [] if isinstance(r, dict)}
    m: Metrics = {label: number(dig(rows, key, "median_s"), 1e3) for key, label in STALL_ROWS.items()}
    m["warm blocking / paired floor copy (median of per-pair ratios)"] = paired_floor_ratio(out)
    m[REF + "floor copy (ms)"] = number(dig(rows, "floor", "median_s"), 1e3)
    return m


def paired_floor_ratio(out: dict[str, Any]) -> float | None:
    """The criterion against ``floor_paired``; else the median of ``extra.ckptd.paired_ratios``."""
    for c in out.get("criteria") or []:
        if isinstance(c, dict) and c.get("against") == "floor_paired":
            return number(c.get("ratio"))
    pairs = [v for v in (number(p) for p in dig(out, "extra", "ckptd", "paired_ratios") or []) if v is not None]
    return statistics.median(pairs) if pairs else None


def many_tensors_metrics(out: dict[str, Any]) -> Metrics:
    """many_tensors.py's JSON: ckptd's medians (ms), the paired blocking / fused floor ratio, the fused floor (ms)."""
    m: Metrics = {label: number(dig(out, "median", key), 1e3) for key, label in MANY_TENSORS_KEYS.items()}
    m["warm blocking / paired fused floor (median of per-pair ratios)"] = number(out.get("paired_ratio_median"))
    m[REF + "fused floor copy (ms)"] = number(dig(out, "median", "floor"), 1e3)
    return m


def training_loop_metrics(out: dict[str, Any]) -> Metrics:
    """training_loop.py's JSON: every ckptd mode's overhead per checkpoint (ms), the quiet step (ms)."""
    results = out.get("results") if isinstance(out.get("results"), dict) else {}
    m: Metrics = {
        f"overhead per checkpoint, {mode} (ms)": number(dig(r, "overhead_per_ckpt_s"), 1e3)
        for mode, r in results.items()
        if mode.startswith("ckptd")
    }
    m[REF + "quiet training step (ms)"] = number(dig(results, "no checkpoints", "quiet_step_s"), 1e3)
    return m


def cpu_metrics(out: dict[str, Any]) -> Metrics:
    """cpu_per_checkpoint.py's JSON: each mode's trainer and daemon CPU per checkpoint (ms), the copy floor's CPU (ms)."""
    m: Metrics = {}
    for mode, r in (out.get("modes") if isinstance(out.get("modes"), dict) else {}).items():
        m[f"{mode}: trainer CPU per checkpoint (ms)"] = number(dig(r, "trainer_cpu_s"), 1e3)
        m[f"{mode}: daemon CPU per checkpoint (ms)"] = number(dig(r, "daemon_cpu_s"), 1e3)
    m["idle daemon CPU (ms per s)"] = number(out.get("idle_cpu_per_s"), 1e3)
    m[REF + "CPU to copy the state once (ms)"] = number(out.get("floor_cpu_s"), 1e3)
    return m


@dataclass(frozen=True)
class Benchmark:
    name: str  # the script's stem; its option is --<name with dashes>-args
    args: str  # the default arguments: small, no DCP rows where a flag allows
    metrics: Callable[[dict[str, Any]], Metrics]
    # the script is this repository's, run against each checkout's ckptd (it uses only the public API, so a checkout
    # older than the script measures too); otherwise each checkout runs its own copy
    script_from_here: bool = False


BENCHMARKS = (
    Benchmark("stall", "--params 22e6 --reps 7 --slow-reps 1 --skip-process", stall_metrics),
    Benchmark("many_tensors", "--layers 1250 --reps 5", many_tensors_metrics),
    # DCP's thread mode has no flag to skip it: it runs, and is not reported
    Benchmark("training_loop", "--params 5.5e6 --steps 24 --every 4 --rounds 2 --skip-process", training_loop_metrics),
    Benchmark("cpu_per_checkpoint", "--params 5.5e6 --checkpoints 12 --rounds 3", cpu_metrics, script_from_here=True),
)


# ---------------------------------------------------------------------------- the summary


def side_cell(values: list[float | None]) -> dict[str, Any]:
    """One side of one metric over the rounds: the median of the values present, the samples, how many were n/a."""
    samples = [v for v in values if v is not None]
    return {"median": statistics.median(samples) if samples else None, "samples": samples, "missing": len(values) - len(samples)}


def ratio(before: float | None, after: float | None) -> float | None:
    """after / before, or ``None`` where either is missing or the ratio means nothing (before <= 0, after < 0:
    an overhead inside the noise can come out negative)."""
    if before is None or after is None or before <= 0 or after < 0:
        return None
    return after / before


def summarize(runs: list[dict[str, Any]], benchmarks: list[str]) -> list[dict[str, Any]]:
    """One row per benchmark and metric (the metrics of all runs, in the order first seen): each side's
    :func:`side_cell`, after / before of the medians, after - before, and the per-round after / before."""
    rows = []
    for bench in benchmarks:
        mine = [r for r in runs if r["benchmark"] == bench]
        names: dict[str, None] = {}
        for r in mine:
            names.update(dict.fromkeys(r["metrics"]))
        for metric in names:
            values = {s: [r["metrics"].get(metric) for r in mine if r["side"] == s] for s in SIDES}
            before, after = (side_cell(values[s]) for s in SIDES)
            b, a = before["median"], after["median"]
            by_round = [ratio(x, y) for x, y in zip(values["before"], values["after"])]
            rows.append(
                {"benchmark": bench, "metric": metric, "before": before, "after": after, "ratio": ratio(b, a),
                 "diff": a - b if a is not None and b is not None else None, "ratio_by_round": by_round}
            )  # fmt: skip
    return rows


def fmt(v: float | None, sign: bool = False) -> str:
    """Three significant digits, no exponent; ``n/a`` for ``None``."""
    if v is None:
        return "n/a"
    text = f"{v:g}" if v == 0 or not math.isfinite(v) else f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}"
    return "+" + text if sign and v > 0 else text


def cell(side: dict[str, Any]) -> str:
    if side["median"] is None:
        return "n/a"
    samples = ", ".join(fmt(v) for v in side["samples"]) + ", n/a" * side["missing"]
    return f"{fmt(side['median'])} ({samples})"


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| benchmark | metric | before: median (rounds) | after: median (rounds) | after / before | after - before |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['benchmark']} | {r['metric']} | {cell(r['before'])} | {cell(r['after'])} | {fmt(r['ratio'])} | {fmt(r['diff'], True)} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------- checkouts


@dataclass(frozen=True)
class Checkout:
    side: str  # "before" or "after"
    spec: str  # as given: a revision, or WORKTREE
    path: Path
    commit: str  # the revision's commit; the working tree's HEAD
    modified: int  # the working tree's tracked files that differ from HEAD (0 for a revision)

    @property
    def label(self) -> str:
        if self.spec == WORKTREE:
            return f"working tree at {self.commit[:10]}" + (f" + {self.modified} modified files" if self.modified else "")
        return f"{self.spec} ({self.commit[:10]})"


def git(*args: str, repo: Path = REPO) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str, repo: Path = REPO) -> str:
    """The commit ``rev`` names. Raises ValueError for one that names none."""
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", repo=repo)
    except subprocess.CalledProcessError:
        raise ValueError(f"{rev!r} names no commit of {repo}") from None


@contextlib.contextmanager
def git_worktree(rev: str, repo: Path = REPO, parent: str | None = None) -> Iterator[Path]:
    """A detached ``git worktree`` of ``rev`` in a new temp directory (under ``parent``); on exit, also on an error or
    Ctrl-C, ``git worktree remove --force``, the directory removed and ``git worktree prune``."""
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-before-after-", dir=parent))
    path = tmp / "checkout"
    try:
        git("worktree", "add", "--detach", str(path), rev, repo=repo)
        yield path
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


@contextlib.contextmanager
def open_checkout(side: str, spec: str) -> Iterator[Checkout]:
    """``spec`` as a :class:`Checkout`: a revision in a temporary worktree, or (WORKTREE) REPO itself."""
    if spec == WORKTREE:
        modified = len(git("status", "--porcelain", "--untracked-files=no").splitlines())
        yield Checkout(side, spec, REPO, git("rev-parse", "HEAD"), modified)
        return
    commit = resolve(spec)
    log(f"{side}: git worktree add --detach {commit[:10]} ({spec})")
    with git_worktree(commit) as path:
        yield Checkout(side, spec, path, commit, 0)


# ---------------------------------------------------------------------------- runs


def child_env(co: Checkout) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (the benchmark and the daemon it starts inherit it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(co.path), os.environ.get("PYTHONPATH")) if p)
    return env


def check_imports(co: Checkout) -> None:
    """The checkout's runs import its own ``ckptd``, not the installed one. Raises BenchFailed otherwise."""
    cmd = [sys.executable, "-c", "import ckptd; print(ckptd.__file__)"]
    got = subprocess.run(cmd, cwd=co.path, env=child_env(co), capture_output=True, text=True)
    where = got.stdout.strip()
    if got.returncode != 0 or Path(where).resolve().parent != (co.path / "ckptd").resolve():
        raise BenchFailed(
            f"{co.side} ({co.label}) imports ckptd from {where or '(nothing)'}, not {co.path / 'ckptd'}:\n{got.stderr[-3000:]}"
        )


def run_child(cmd: list[str], co: Checkout, stdout: Any, stderr: Any, grace: float = 120.0) -> int:
    """Run ``cmd`` in the checkout; its exit status. In a session of its own, so that a Ctrl-C reaches it only from
    here: on any exception (KeyboardInterrupt included) it gets SIGINT, so that its ``finally`` blocks stop its daemon
    and remove its files, then SIGKILL if it is still running after ``grace`` seconds."""
    proc = subprocess.Popen(
        cmd, cwd=co.path, env=child_env(co), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True
    )
    try:
        return proc.wait()
    except BaseException:
        if proc.poll() is None:
            log(f"stopping {Path(cmd[1]).name} (pid {proc.pid})")
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise


def tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def run_benchmark(bench: Benchmark, co: Checkout, argv: list[str], tmp: Path, rnd: int) -> dict[str, Any]:
    """One run of ``bench`` in ``co``: its wall time, metrics and raw JSON. Raises BenchFailed with its output's tail."""
    stem = tmp / f"{bench.name}-{co.side}-r{rnd}"
    out_json, out_log, err_log = (stem.with_suffix(s) for s in (".json", ".out", ".err"))
    script = (REPO if bench.script_from_here else co.path) / "benchmarks" / f"{bench.name}.py"
    cmd = [sys.executable, str(script), "--json", str(out_json), *argv]
    t0 = time.perf_counter()
    with open(out_log, "wb") as fo, open(err_log, "wb") as fe:
        rc = run_child(cmd, co, fo, fe)
    wall = time.perf_counter() - t0
    if rc != 0 or not out_json.exists():
        why = f"exited with status {rc}" if rc != 0 else f"wrote no {out_json.name}"
        raise BenchFailed(
            f"{bench.name} in {co.side} ({co.label}) {why}: {shlex.join(cmd)}\n--- stderr (tail) ---\n{tail(err_log)}"
            f"\n--- stdout (tail) ---\n{tail(out_log, 15)}"
        )
    raw = json.loads(out_json.read_text())
    metrics = bench.metrics(raw if isinstance(raw, dict) else {})
    return {"round": rnd, "benchmark": bench.name, "side": co.side, "wall_s": wall, "metrics": metrics, "raw": raw}


def run_rounds(benches: list[Benchmark], sides: tuple[Checkout, Checkout], argvs: dict[str, list[str]], rounds: int,
               tmp: Path, runs: list[dict[str, Any]]) -> None:  # fmt: skip
    """Every benchmark on both sides, ``rounds`` times; the sides' order swapped every round (:func:`_harness.alternate`).
    Appends to ``runs``."""

    def run(bench: Benchmark, co: Checkout, rnd: int) -> None:
        log(f"round {rnd + 1}/{rounds}: {bench.name} on {co.side} ({co.label})")
        runs.append(run_benchmark(bench, co, argvs[bench.name], tmp, rnd))
        log(f"  {runs[-1]['wall_s']:.0f} s")

    for rnd in range(rounds):
        for bench in benches:
            alternate(rnd, functools.partial(run, bench, sides[0], rnd), functools.partial(run, bench, sides[1], rnd))


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=DEFAULT_BEFORE, help=f"a git revision, or {WORKTREE!r} (default {DEFAULT_BEFORE})")
    p.add_argument("--after", default=WORKTREE, help=f"a git revision, or {WORKTREE!r}: {REPO} as it is (the default)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each benchmark on each side (default 2)")
    names = ",".join(b.name for b in BENCHMARKS)
    p.add_argument("--benchmarks", default=names, help=f"which to run, comma-separated (default {names})")
    for b in BENCHMARKS:
        p.add_argument(f"--{b.name.replace('_', '-')}-args", default=b.args, help=f"replace {b.name}.py's arguments (default: {b.args})")
    p.add_argument("--json", default="bench-out/before_after.json", help="where to write the results (default bench-out/before_after.json)")
    a = p.parse_args(argv)
    a.selected = [n.strip() for n in a.benchmarks.split(",") if n.strip()]
    unknown = sorted(set(a.selected) - {b.name for b in BENCHMARKS})
    if unknown or not a.selected:
        p.error(f"--benchmarks: unknown {', '.join(unknown)}; choose among {names}" if unknown else "--benchmarks: none given")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    for spec in (a.before, a.after):
        if spec != WORKTREE:
            try:
                resolve(spec)
            except ValueError as e:
                p.error(str(e))
    return a


def report(sides: tuple[Checkout, Checkout], args: argparse.Namespace, argvs: dict[str, list[str]], mach: dict[str, Any],
           rows: list[dict[str, Any]], elapsed: float) -> str:  # fmt: skip
    load = " -> ".join("/".join(f"{x:.2f}" for x in mach[k]) for k in ("loadavg_start", "loadavg_end"))
    lines = [
        "## ckptd before / after",
        "",
        *(f"- {co.side}: {co.label}" for co in sides),
        f"- rounds: {args.rounds}, the sides alternating (order swapped every round); each metric: median over rounds (the rounds)",
        *(f"- {name}.py {shlex.join(argv)}" for name, argv in argvs.items()),
        f"- machine: nproc {mach['nproc']}, CPU {mach['cpu_model']}, python {mach['python']}, torch {mach['torch']}; "
        f"load average {load}; {elapsed / 60:.1f} min in all",
        "- reference rows run no ckptd code: their after / before is how much the machine moved between the sides",
        "",
        markdown(rows),
    ]
    return "\n".join(lines)


def _exit_on_sigterm(signum: int, frame: Any) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: the running benchmark is stopped, the worktrees removed


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    benches = [b for b in BENCHMARKS if b.name in args.selected]
    argvs = {b.name: shlex.split(getattr(args, f"{b.name}_args")) for b in benches}
    t0 = time.perf_counter()
    mach = machine_info()
    mach["loadavg_start"] = os.getloadavg()
    runs: list[dict[str, Any]] = []
    error = None
    with contextlib.ExitStack() as stack:
        sides = (stack.enter_context(open_checkout("before", args.before)), stack.enter_context(open_checkout("after", args.after)))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptd-before-after-runs-")))
        try:
            for co in sides:
                check_imports(co)
            run_rounds(benches, sides, argvs, args.rounds, tmp, runs)
        except BenchFailed as e:
            error = str(e)
    mach["loadavg_end"] = os.getloadavg()
    elapsed = time.perf_counter() - t0
    rows = summarize(runs, [b.name for b in benches])
    print(report(sides, args, argvs, mach, rows, elapsed))
    checkouts = {co.side: {"spec": co.spec, "commit": co.commit, "label": co.label, "modified_files": co.modified} for co in sides}
    write_json(
        args.json,
        {"benchmark": "before_after", "checkouts": checkouts, "rounds": args.rounds, "args": argvs, "machine": mach, "table": rows,
         "runs": runs, "error": error, "elapsed_s": elapsed, "unix_time": time.time()},
    )  # fmt: skip
    log(f"wrote {args.json}")
    if error is not None:
        print(f"\nerror: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the running benchmark was stopped and the worktrees removed on the way out
        log("interrupted")
        sys.exit(130)
