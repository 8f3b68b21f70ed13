"""``benchmarks/before_after.py`` without running a benchmark: the headline numbers read from JSON shaped like each
script's output (and from an older, shorter one), the summary's medians and ratios, the table, and the temporary
git worktree it runs a revision in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import before_after as ba  # noqa: E402

REF = ba.REF


def stall_json() -> dict[str, Any]:
    """stall.py's output: ``rows`` as Results.to_json writes them, ``criteria``, ``extra``."""

    def row(key: str, median: float | None) -> dict[str, Any]:
        return {
            "key": key,
            "name": key,
            "n": 3,
            "median_s": median,
            "ratio_to_floor": None,
            "samples_s": [median],
            "note": "",
            "error": None,
        }

    rows = [row("floor", 0.1), row("floor_paired", 0.11), row("ckptd_first", 0.5), row("ckptd_prepare", 0.7)]
    rows += [row("ckptd_first_prepared", 0.13), row("ckptd_blocking", 0.12), row("ckptd_blocking_durable", 1.0)]
    rows += [row("ckptd_default", 0.125), row("ckptd_default_copied", 0.125), row("dcp_async_thread", 0.6)]
    criteria = [
        {"name": "paired", "against": "floor_paired", "ratio": 1.05, "target": "<= 1.1", "verdict": "PASS"},
        {"name": "vs async", "against": "dcp_async_thread", "ratio": 0.2, "target": "<= 0.7", "verdict": "PASS"},
    ]
    return {"benchmark": "stall", "rows": rows, "criteria": criteria, "extra": {"ckptd": {"paired_ratios": [1.0, 1.1, 1.2]}}}


def test_stall_metrics_are_the_ckptd_rows_in_ms_the_paired_criterion_and_the_floor() -> None:
    m = ba.stall_metrics(stall_json())
    assert m == pytest.approx(
        {
            "first snapshot(blocking=True), allocating its slot (ms)": 500.0,
            "first snapshot(blocking=True) after prepare() (ms)": 130.0,
            "warm snapshot(blocking=True) (ms)": 120.0,
            "warm snapshot() default (ms)": 125.0,
            "blocking snapshot: call -> durable (ms)": 1000.0,
            "warm blocking / paired floor copy (median of per-pair ratios)": 1.05,
            REF + "floor copy (ms)": 100.0,
        }
    )


def test_stall_metrics_of_an_older_shorter_json_read_none_where_a_key_is_missing() -> None:
    out = stall_json()
    del out["criteria"]  # the paired ratio then comes from extra.ckptd.paired_ratios
    out["rows"] = [r for r in out["rows"] if r["key"] != "ckptd_first_prepared"]
    out["rows"][0]["median_s"] = None  # a row measured no sample
    m = ba.stall_metrics(out)
    assert m["first snapshot(blocking=True) after prepare() (ms)"] is None
    assert m[REF + "floor copy (ms)"] is None
    assert m["warm blocking / paired floor copy (median of per-pair ratios)"] == pytest.approx(1.1)
    assert set(ba.stall_metrics({}).values()) == {None}


def test_many_tensors_metrics() -> None:
    median = {"floor": 0.038, "floor_loop": 0.029, "blocking_first": 1.3, "blocking_first_durable": 3.0, "blocking": 0.098}
    median |= {"default": 0.077, "capture": 0.34, "fingerprint": 0.027, "restore": 2.79, "torch_load": 0.72}
    out = {"tensors": 10000, "bytes": 15850000, "samples": {k: [v] for k, v in median.items()}, "median": median}
    out |= {"paired_ratios": [2.7], "paired_ratio_median": 2.71, "target": 1.3}
    assert ba.many_tensors_metrics(out) == pytest.approx(
        {
            "first snapshot(blocking=True) (ms)": 1300.0,
            "warm snapshot(blocking=True) (ms)": 98.0,
            "warm snapshot() default (ms)": 77.0,
            "ckptd.restore from disk (ms)": 2790.0,
            "warm blocking / paired fused floor (median of per-pair ratios)": 2.71,
            REF + "fused floor copy (ms)": 38.0,
        }
    )
    del out["median"]["restore"], out["paired_ratio_median"]
    m = ba.many_tensors_metrics(out)
    assert m["ckptd.restore from disk (ms)"] is None
    assert m["warm blocking / paired fused floor (median of per-pair ratios)"] is None


def test_training_loop_metrics_are_the_ckptd_modes_overheads_not_dcps() -> None:
    def mode(overhead: float) -> dict[str, Any]:
        return {"loop_s": 7.0, "call_s": {"median": 0.03, "max": 0.3}, "overhead_per_ckpt_s": overhead, "overheads_s": [overhead]}

    results = {"no checkpoints": {"loop_s": 5.0, "runs_s": [5.0], "quiet_step_s": 0.247}}
    results |= {"ckptd default": mode(0.75), "ckptd blocking": mode(-0.02), "dcp.async_save thread": mode(2.2)}
    results["ckptd default, overlap=always"] = {"loop_s": 7.0}  # an older script without the key
    m = ba.training_loop_metrics({"results": results, "default_minus_blocking_s": [0.1], "bytes": 1, "args": {}})
    assert m == pytest.approx(
        {
            "overhead per checkpoint, ckptd default (ms)": 750.0,
            "overhead per checkpoint, ckptd blocking (ms)": -20.0,
            "overhead per checkpoint, ckptd default, overlap=always (ms)": None,
            REF + "quiet training step (ms)": 247.0,
        }
    )
    assert ba.training_loop_metrics({"results": "garbage"}) == {REF + "quiet training step (ms)": None}


def run(side: str, rnd: int, metrics: dict[str, float | None], bench: str = "b") -> dict[str, Any]:
    return {"round": rnd, "benchmark": bench, "side": side, "wall_s": 1.0, "metrics": metrics, "raw": {}}


def test_summary_medians_ratios_and_a_metric_missing_on_one_side() -> None:
    runs = [
        run("before", 0, {"x": 10.0, "old": 1.0}),
        run("after", 0, {"x": 12.0, "new": 5.0}),
        run("after", 1, {"x": 14.0, "new": None}),
        run("before", 1, {"x": 20.0, "old": 3.0}),
        run("before", 0, {"x": 99.0}, bench="other"),
    ]
    rows = {r["metric"]: r for r in ba.summarize(runs, ["b"])}
    assert list(rows) == ["x", "old", "new"]
    x = rows["x"]
    assert (x["before"]["median"], x["before"]["samples"], x["after"]["median"]) == (15.0, [10.0, 20.0], 13.0)
    assert x["ratio"] == pytest.approx(13 / 15) and x["diff"] == pytest.approx(-2.0)
    assert x["ratio_by_round"] == pytest.approx([1.2, 0.7])
    assert rows["old"]["after"] == {"median": None, "samples": [], "missing": 2}
    assert rows["old"]["ratio"] is None and rows["old"]["diff"] is None
    assert rows["new"]["after"] == {"median": 5.0, "samples": [5.0], "missing": 1}
    table = ba.markdown(list(rows.values())).splitlines()
    assert table[2] == "| b | x | 15.0 (10.0, 20.0) | 13.0 (12.0, 14.0) | 0.867 | -2.00 |"
    assert table[3] == "| b | old | 2.00 (1.00, 3.00) | n/a | n/a | n/a |"
    assert table[4] == "| b | new | n/a | 5.00 (5.00, n/a) | n/a | n/a |"


@pytest.mark.parametrize(
    "before,after,want",
    [(10.0, 5.0, 0.5), (None, 5.0, None), (10.0, None, None), (0.0, 5.0, None), (-3.0, 5.0, None), (4.0, -1.0, None), (4.0, 0.0, 0.0)],
)
def test_ratio_only_where_it_means_something(before: float | None, after: float | None, want: float | None) -> None:
    assert ba.ratio(before, after) == want


FMT_CASES = [(None, False, "n/a"), (1234.5, False, "1234"), (12.345, False, "12.3"), (0.012345, False, "0.0123")]
FMT_CASES += [(0.0, True, "0"), (2.5, True, "+2.50"), (-2.5, True, "-2.50")]


@pytest.mark.parametrize("v,sign,want", FMT_CASES)
def test_fmt(v: float | None, sign: bool, want: str) -> None:
    assert ba.fmt(v, sign) == want


def worktrees() -> str:
    return subprocess.run(["git", "-C", str(ba.REPO), "worktree", "list", "--porcelain"], check=True, capture_output=True, text=True).stdout


def test_git_worktree_of_head_is_made_and_removed_also_on_an_error(tmp_path: Path) -> None:
    head = ba.resolve("HEAD")
    with ba.git_worktree(head, parent=str(tmp_path)) as path:
        assert f"worktree {path}\n" in worktrees()
        assert (path / "ckptd" / "__init__.py").is_file()
        assert ba.git("rev-parse", "HEAD", repo=path) == head
        (path / "untracked.txt").write_text("a run's leftovers")  # remove --force takes them too
    assert str(path) not in worktrees() and not path.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt), ba.git_worktree(head, parent=str(tmp_path)) as path:
        raise KeyboardInterrupt
    assert str(path) not in worktrees() and list(tmp_path.iterdir()) == []


def test_resolve_rejects_a_name_of_no_commit() -> None:
    with pytest.raises(ValueError, match="names no commit"):
        ba.resolve("no-such-revision-anywhere")


def test_a_checkout_runs_its_own_ckptd(tmp_path: Path) -> None:
    co = ba.Checkout("after", ba.WORKTREE, ba.REPO, "0" * 40, 0)
    assert ba.child_env(co)["PYTHONPATH"].split(os.pathsep)[0] == str(ba.REPO)
    ba.check_imports(co)
    # a directory with no ckptd of its own: the installed one (this repository's, editable) is imported instead
    with pytest.raises(ba.BenchFailed, match="imports ckptd from"):
        ba.check_imports(ba.Checkout("before", "x", tmp_path, "0" * 40, 0))


def test_cpu_metrics_are_each_modes_trainer_and_daemon_cpu_in_ms() -> None:
    modes = {"blocking": {"trainer_cpu_s": 0.031, "daemon_cpu_s": 0.12, "wall_s": 0.3}, "memory": {"trainer_cpu_s": 0.02}}
    m = ba.cpu_metrics({"modes": modes, "floor_cpu_s": 0.0225, "idle_cpu_per_s": 0.004})
    assert m == pytest.approx(
        {
            "blocking: trainer CPU per checkpoint (ms)": 31.0,
            "blocking: daemon CPU per checkpoint (ms)": 120.0,
            "memory: trainer CPU per checkpoint (ms)": 20.0,
            "memory: daemon CPU per checkpoint (ms)": None,
            "idle daemon CPU (ms per s)": 4.0,
            REF + "CPU to copy the state once (ms)": 22.5,
        }
    )
    assert ba.cpu_metrics({"modes": ["garbage"]}) == {"idle daemon CPU (ms per s)": None, REF + "CPU to copy the state once (ms)": None}


def test_a_script_from_here_runs_this_repositorys_copy_against_the_checkouts_ckptd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here, old = tmp_path / "here", tmp_path / "old"
    script = "import json, sys; json.dump({'argv0': sys.argv[0]}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    for d in (here, old):
        (d / "benchmarks").mkdir(parents=True)
    (here / "benchmarks" / "probe.py").write_text(script)  # the older checkout has no copy of the script
    monkeypatch.setattr(ba, "REPO", here)
    co = ba.Checkout("before", "x", old, "0" * 40, 0)
    bench = ba.Benchmark("probe", "", lambda out: {"argv0": None}, script_from_here=True)
    got = ba.run_benchmark(bench, co, [], tmp_path, 0)
    assert got["raw"]["argv0"] == str(here / "benchmarks" / "probe.py")
    with pytest.raises(ba.BenchFailed, match="exited with status"):  # without the flag, the checkout's own copy: none
        ba.run_benchmark(ba.Benchmark("probe", "", lambda out: {}), co, [], tmp_path, 1)
