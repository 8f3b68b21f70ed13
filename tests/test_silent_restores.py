"""Restores that went wrong without a word, written as the user's mistake or the attack: a model left on
the meta device, a manifest whose chunks overlap or whose shapes outgrow its files, a FIFO planted in
place of a shard, a refused restore that stepped a fresh optimizer, non-tensor state cut down to the
target's shape, and one rank's early failure that left the other waiting."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

import ckptd
from ckptd import coverage
from ckptd.client.reader import CheckpointReader
from ckptd.coverage import check_coverage
from ckptd.errors import CheckpointError, FormatError
from ckptd.format import digest, encode_manifest
from ckptd.layout import MANIFEST, shard_name


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("count", torch.tensor(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return model, optim


def _save(daemon: Any, job: str, model: torch.nn.Module, optim: torch.optim.Optimizer | None = None, step: int = 1) -> str:
    with daemon.client(job) as c:
        return c.snapshot(model, optim, step=step, blocking=True).wait(30)


def _copy(path: str, where: Path) -> Path:
    """A copy of step ``path`` to alter (under a job directory of its own, as a step has)."""
    dst = where / "job" / os.path.basename(path)
    shutil.copytree(path, dst)
    return dst


def _alter(step: Path, change: Any) -> None:
    m = json.loads((step / MANIFEST).read_text())
    change(m)
    (step / MANIFEST).write_bytes(encode_manifest(m))  # with its digest again: altered, not damaged


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- a model on the meta device


def test_a_model_on_the_meta_device_is_refused_saying_how_to_materialize_it(daemon, tmp_path: Path) -> None:  # noqa: ANN001
    """Built under ``torch.device("meta")`` for a fast start, the model has no memory: a restore into it
    "succeeded" and loaded nothing. Refused, from disk and from the daemon's memory, before anything is read."""
    model, optim = _trained()
    path = _save(daemon, "meta", model, optim)
    with torch.device("meta"):
        target = Net()
    for how in ({"path": path}, {}):
        with (
            daemon.client("meta") as c,
            pytest.raises(CheckpointError, match=r"parameter 'lin.weight': it is on the meta device.*to_empty"),
        ):
            c.restore(target, torch.optim.AdamW(target.parameters()), **how)
    with pytest.raises(CheckpointError, match="meta device"):  # before any file is looked at
        ckptd.restore(target, path=str(tmp_path / "nowhere"))
    target.to_empty(device="cpu")
    ckptd.restore(target, path=path)
    assert _same(_params(target), _params(model))


# ----------------------------------------------------------------------------- altered manifests


def _overlapping(m: dict[str, Any]) -> None:
    """``lin.weight`` [3, 4] as rows [0, 1) and [0, 2): 12 elements, as many as the tensor has, row 0 twice, row 2 never."""
    ent = m["tensors"]["model/lin.weight"]
    c = ent["chunks"][0]
    b = c["byte_range"][0]
    ent["chunks"] = [{**c, "name": f"w{n}", "offsets": [0, 0], "sizes": [n, 4], "byte_range": [b, b + 16 * n]} for n in (1, 2)]


def test_a_manifest_whose_chunks_overlap_is_refused_and_nothing_is_loaded(daemon, tmp_path: Path) -> None:  # noqa: ANN001
    model, _ = _trained()
    step = _copy(_save(daemon, "overlap", model), tmp_path)
    data = (step / shard_name(0)).read_bytes()

    def overlap_with_checksums(m: dict[str, Any]) -> None:
        _overlapping(m)
        for c in m["tensors"]["model/lin.weight"]["chunks"]:
            c["xxh3_64"] = digest(memoryview(data)[c["byte_range"][0] : c["byte_range"][1]])

    _alter(step, overlap_with_checksums)
    torch.manual_seed(5)
    target = Net()
    before = _params(target)
    with pytest.raises(FormatError, match=r"tensor 'model/lin.weight': chunks at offsets \[0, 0\] .* overlap"):
        ckptd.restore(target, path=str(step))
    assert _same(_params(target), before)


def test_a_damaged_digit_of_the_manifest_fails_the_restore_and_verify_instead_of_restoring_another_value(daemon, tmp_path: Path) -> None:  # noqa: ANN001
    """The non-tensor state (``extra``, hyperparameters, scheduler and RNG state) lives only in the manifest, which
    had no checksum: one flipped bit on disk turned ``data_pos`` 1234 into 9234, ``ckptd verify`` said OK and the
    restore returned 9234. Found by a review of the tools. A manifest now ends with its own digest."""
    import subprocess
    import sys

    from ckptd.validate import read_manifest

    model, optim = _trained()
    with daemon.client("digest") as c:
        path = c.snapshot(model, optim, step=1, extra={"data_pos": 1234}, blocking=True).wait(30)
    step = _copy(path, tmp_path)
    raw = (step / MANIFEST).read_bytes()
    assert raw.count(b'"data_pos":1234') == 1
    (step / MANIFEST).write_bytes(raw.replace(b'"data_pos":1234', b'"data_pos":9234'))  # '1' -> '9': one bit
    m2, o2 = _trained(seed=1)
    with pytest.raises(FormatError, match="do not match the digest it ends with: the manifest is damaged"):
        ckptd.restore(m2, o2, path=str(step))
    verify = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(step)], capture_output=True, text=True, timeout=120)
    assert verify.returncode != 0 and "digest" in verify.stdout + verify.stderr, verify
    # the version digit itself damaged, 2 -> 1 ("2" is 0x32, "1" 0x31): a version-1 manifest never had a digest
    assert raw.count(b'"format_version":2') == 1
    (step / MANIFEST).write_bytes(raw.replace(b'"format_version":2', b'"format_version":1'))
    with pytest.raises(FormatError, match="do not match the digest"):
        ckptd.restore(m2, o2, path=str(step))
    # a manifest written before manifests carried a digest (format_version 1) is read as before
    old = {k: v for k, v in read_manifest(path).items() if k != "digest"} | {"format_version": 1}
    (step / MANIFEST).write_text(json.dumps(old))
    assert ckptd.restore(m2, o2, path=str(step)) == {"data_pos": 1234}


def _staircase(n: int) -> list[dict[str, Any]]:
    """An exact cover of [n + 1, n, 2] by 4n chunks irregular in all three dimensions (no sharding torch
    makes, and no grid): column j split at row j + 1 in plane 0 and at row n + 1 - j % 7 in plane 1."""
    out = []
    for j in range(n):
        cut = n + 1 - j % 7
        for offs, sizes in (
            ([0, j, 0], [j + 1, 1, 1]),
            ([j + 1, j, 0], [n - j, 1, 1]),
            ([0, j, 1], [cut, 1, 1]),
            ([cut, j, 1], [n + 1 - cut, 1, 1]),
        ):
            out.append({"file": "f", "offsets": offs, "sizes": sizes})
    return out


def test_an_irregular_cover_is_checked_without_comparing_chunks_pairwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore checks every manifest it opens: chunks a hostile manifest makes irregular in three dimensions
    (the pairwise sweep is quadratic in them) are judged in one pass instead."""
    n = 2000
    shape = [n + 1, n, 2]

    def no_sweep(*a: Any) -> None:
        raise AssertionError("the pairwise sweep ran on a sound cover")

    with monkeypatch.context() as mp:
        mp.setattr(coverage, "_overlap_sweep", no_sweep)
        check_coverage({"t": {"shape": shape, "chunks": _staircase(n)}})
    bad = _staircase(n)
    bad[4] = {**bad[4], "offsets": [0, 1, 1]}  # over chunk 6, and the place it had left empty
    with pytest.raises(CheckpointError, match=r"tensor 't': chunks at offsets \[0, 1, 1\] .* overlap"):
        check_coverage({"t": {"shape": shape, "chunks": bad}})
    monkeypatch.setattr(coverage, "SWEEP_BUDGET", 0)  # a search too long to finish: the verdict stands without the pair
    with pytest.raises(CheckpointError, match=r"tensor 't' of shape .*: chunks overlap and leave as many elements out"):
        check_coverage({"t": {"shape": shape, "chunks": bad}})


HUGE = 1 << 46  # float32 elements: 256 TiB, more than any address space holds


def _huge_file(m: dict[str, Any]) -> None:
    """Optimizer state of a huge shape, its chunk and its file's declared size to match: the file is 3 KB."""
    ent = m["tensors"]["optim/state/lin.bias/exp_avg"]
    c = ent["chunks"][0]
    b = c["byte_range"][0]
    ent["shape"], c["sizes"], c["byte_range"] = [HUGE], [HUGE], [b, b + 4 * HUGE]
    m["files"][c["file"]]["size"] = b + 4 * HUGE + 4096


def _huge_shape(m: dict[str, Any]) -> None:
    """A huge shape whose one small chunk covers three elements of it."""
    m["tensors"]["optim/state/lin.bias/exp_avg"]["shape"] = [HUGE]


@pytest.mark.parametrize(
    "change,problem",
    [(_huge_file, r"rank-00000.safetensors is \d+ bytes, the manifest says \d+"), (_huge_shape, rf"chunks cover 3 of {HUGE} elements")],
    ids=["file", "shape"],
)
def test_a_manifest_claiming_a_huge_tensor_is_refused_before_it_is_allocated(daemon, tmp_path: Path, change: Any, problem: str) -> None:  # noqa: ANN001
    model, optim = _trained()
    step = _copy(_save(daemon, "huge", model, optim), tmp_path)
    _alter(step, change)
    target, fresh = Net(), None
    fresh = torch.optim.AdamW(target.parameters())
    target(torch.randn(2, 4)).sum().backward()  # a warm-up backward: gradients, no optimizer state yet
    with pytest.raises(FormatError, match=problem):
        ckptd.restore(target, fresh, path=str(step))
    assert not fresh.state


@contextmanager
def _fifo_writer(fifo: Path) -> Iterator[None]:
    """Someone holding the FIFO's other end, so that a reader that opens it blocking does not hang the test."""
    fds: list[int] = []
    t = threading.Thread(target=lambda: fds.append(os.open(fifo, os.O_WRONLY)), daemon=True)
    t.start()
    try:
        yield
    finally:
        if t.is_alive():  # nobody opened it to read: let the writer's open return
            fds.append(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        t.join()
        for fd in fds:
            os.close(fd)


def test_a_fifo_in_place_of_a_shard_is_refused_instead_of_blocking(daemon, tmp_path: Path) -> None:  # noqa: ANN001
    model, _ = _trained()
    step = _copy(_save(daemon, "fifo", model), tmp_path)
    shard = step / shard_name(0)
    kept = shard.read_bytes()
    with CheckpointReader(str(step)) as reader:  # planted after the step was opened
        shard.unlink()
        os.mkfifo(shard)
        with _fifo_writer(shard), pytest.raises(FormatError, match="rank-00000.safetensors is not a regular file"):
            reader.read_full("model/lin.weight")
    with _fifo_writer(shard), pytest.raises(FormatError, match="rank-00000.safetensors is not a regular file"):
        ckptd.restore(Net(), path=str(step))
    shard.unlink()
    shard.write_bytes(kept)
    ckptd.restore(Net(), path=str(step))


def test_param_groups_that_do_not_list_parameter_names_are_a_format_error(daemon, tmp_path: Path) -> None:  # noqa: ANN001
    model, optim = _trained()
    step = _copy(_save(daemon, "groups", model, optim), tmp_path)
    for params in (5, [{"a": 1}], [["lin.weight"]]):
        _alter(step, lambda m, params=params: m["ranks"][0]["tree"]["optim"]["param_groups"][0].update(params=params))
        target = Net()
        with pytest.raises(FormatError, match="param_groups that do not list their parameters by name"):
            ckptd.restore(target, torch.optim.AdamW(target.parameters()), path=str(step))


# ----------------------------------------------------------------------------- the optimizer is never stepped


class Wider(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 1)


def test_a_refused_restore_leaves_a_fresh_optimizer_unstepped_and_a_good_one_steps_nothing(daemon) -> None:  # noqa: ANN001
    """torch's get_state_dict gives a fresh optimizer state by running a zero-lr optimizer.step(): a step
    hook and an LR scheduler see it, AdamW's next step is its second. A restore never does."""
    model, optim = _trained()
    path = _save(daemon, "steps", model, optim)
    target = Wider()
    fresh = torch.optim.AdamW(target.parameters(), lr=1e-3)
    steps: list[int] = []
    fresh.register_step_pre_hook(lambda *a: steps.append(1))
    with pytest.raises(CheckpointError, match="missing from the checkpoint: model/head.weight"):
        ckptd.restore(target, fresh, path=path)
    assert not fresh.state and not steps and fresh.param_groups[0]["lr"] == 1e-3
    target = Net()
    fresh = torch.optim.AdamW(target.parameters(), lr=1e-3)
    fresh.register_step_pre_hook(lambda *a: steps.append(1))
    ckptd.restore(target, fresh, path=path)
    assert not steps
    for p, q in zip(model.parameters(), target.parameters()):
        assert sorted(fresh.state[q]) == sorted(optim.state[p])
        assert all(torch.equal(fresh.state[q][k], v) for k, v in optim.state[p].items())


# ----------------------------------------------------------------------------- non-tensor state as saved


def _lbfgs(seed: int, max_iter: int) -> tuple[torch.nn.Linear, torch.optim.LBFGS]:
    torch.manual_seed(seed)
    m = torch.nn.Linear(3, 1)
    return m, torch.optim.LBFGS(m.parameters(), history_size=5, max_iter=max_iter)


def _lbfgs_step(m: torch.nn.Linear, o: torch.optim.LBFGS) -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)

    def closure() -> torch.Tensor:
        o.zero_grad()
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        return loss

    o.step(closure)


def _lbfgs_equal(a: torch.optim.LBFGS, b: torch.optim.LBFGS) -> None:
    (sa,), (sb,) = a.state.values(), b.state.values()
    assert sorted(sa) == sorted(sb)
    for k, v in sa.items():
        w = sb[k]
        if isinstance(v, list):
            assert len(v) == len(w), k
            assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(v, w)), k
        else:
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k


def test_lbfgs_resumes_with_its_whole_history_into_a_fresh_or_a_stepped_optimizer(daemon) -> None:  # noqa: ANN001
    model, optim = _lbfgs(0, max_iter=4)
    for _ in range(2):
        _lbfgs_step(model, optim)
    assert len(optim.state[model.weight]["old_dirs"]) == 5
    path = _save(daemon, "lbfgs", model, optim)
    fresh = _lbfgs(1, max_iter=4)
    stepped = _lbfgs(2, max_iter=4)
    _lbfgs_step(*stepped)  # its history: shorter than the saved one
    for m, o in (fresh, stepped):
        restored = ckptd.restore(m, o, path=path)
        assert restored.missing_keys == [] and restored.unexpected_keys == []
        _lbfgs_equal(optim, o)
    _lbfgs_step(model, optim)
    for m, o in (fresh, stepped):
        _lbfgs_step(m, o)
        assert _same(_params(m), _params(model))


class WiderLinear(torch.nn.Module):
    """``_lbfgs``'s model with one more parameter: a new head, trained from the old model's weights."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(1, 3))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.head = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.T + self.bias) * self.head


@pytest.mark.parametrize("stepped", [False, True])
def test_lbfgs_history_of_a_smaller_model_is_left_out_of_a_non_strict_restore_never_loaded_to_fail_the_next_step(
    daemon, stepped: bool
) -> None:  # noqa: ANN001
    """The user's mistake: strict=False into a wider model (a new head) with L-BFGS. Its history vectors span
    every parameter (4 elements saved, 5 now). Into a fresh optimizer they were loaded as saved and the next
    ``optim.step()`` failed deep in torch with a size mismatch; into a stepped one the restore raised. Now
    that history is one of the unexpected keys either way (the optimizer starts without it) and training goes on."""
    model, optim = _lbfgs(0, max_iter=4)
    _lbfgs_step(model, optim)
    path = _save(daemon, "lbfgs-wider", model, optim)
    torch.manual_seed(1)
    wider = WiderLinear()
    o = torch.optim.LBFGS(wider.parameters(), history_size=5, max_iter=4)
    if stepped:
        _lbfgs_step(wider, o)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=r"L-BFGS history .* 4 elements, .* parameters 5"):
        restored = ckptd.restore(wider, o, path=path, strict=False)
    assert "model/head" in restored.missing_keys
    assert restored.unexpected_keys == ["optim/state/weight"]  # every entry of it
    assert torch.equal(wider.weight.detach(), model.weight.detach()) and not o.state.get(wider.weight)
    _lbfgs_step(wider, o)  # type: ignore[arg-type]
    again = WiderLinear()
    with (
        pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model or optimizer: optim/state/weight\."),
        pytest.warns(UserWarning, match="L-BFGS history"),
    ):
        ckptd.restore(again, torch.optim.LBFGS(again.parameters()), path=path)  # strict: refused, naming it


class Vocab(torch.nn.Module):
    """A module with extra state (``get_extra_state``) that grows as it sees data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.seen: list[str] = []
        self.scale = torch.ones(2)

    def get_extra_state(self) -> dict[str, Any]:
        return {"seen": list(self.seen), "scale": self.scale.clone(), "by": {"n": len(self.seen)}}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.seen, self.scale, self.n = list(state["seen"]), state["scale"], state["by"]["n"]


def test_a_modules_extra_state_comes_back_as_saved(daemon) -> None:  # noqa: ANN001
    v = Vocab()
    v.seen, v.scale = ["a", "b", "c"], torch.tensor([2.0, 3.0])
    path = _save(daemon, "vocab", v)
    for target in (Vocab(), _with(Vocab(), ["z"], torch.ones(5))):  # a fresh module, and one that has seen other data
        restored = ckptd.restore(target, path=path)
        assert restored.missing_keys == [] and restored.unexpected_keys == []
        assert target.seen == ["a", "b", "c"] and target.n == 3 and torch.equal(target.scale, v.scale)


def _with(v: Vocab, seen: list[str], scale: torch.Tensor) -> Vocab:
    v.seen, v.scale = seen, scale
    return v


# ----------------------------------------------------------------------------- one rank fails before the check-in


def _one_rank_fails_first(rank: int, world: int, path: str, endpoint: str) -> dict[str, Any]:
    os.environ["CKPTD_COLLECTIVE_TIMEOUT"] = "30"
    torch.manual_seed(rank)
    out: dict[str, Any] = {}
    attempts = [
        ("path", path if rank == 0 else path + "-nowhere", None),  # no checkpoint there: resolve_step_dir
        ("daemon", None, 1 if rank == 0 else 99),  # the daemon has no step 99: fetch
        ("good", path, None),
        ("good daemon", None, 1),
    ]
    for name, where, step in attempts:
        try:
            if where is not None:
                ckptd.restore(Net(), path=where)
            else:
                with ckptd.Client(endpoint=endpoint, job="dist") as c:
                    c.restore(Net(), step=step)
            out[name] = None
        except CheckpointError as e:
            out[name] = str(e)
    return out


@pytest.mark.multiproc
def test_a_rank_failing_before_the_check_in_fails_every_rank_and_the_retry_works(daemon) -> None:  # noqa: ANN001
    path = _save(daemon, "dist", _trained()[0])
    outs = run_ranks(2, _one_rank_fails_first, path, daemon.endpoint, timeout=100)
    assert "is neither a committed ckptd step directory" in outs[1]["path"], outs
    assert "restore failed on rank(s) [1]" in outs[0]["path"] and "nothing was loaded" in outs[0]["path"], outs
    assert outs[1]["daemon"] and "restore failed on rank(s) [1]" in outs[0]["daemon"], outs
    assert [o["good"] for o in outs] == [None, None] and [o["good daemon"] for o in outs] == [None, None], outs


# ----------------------------------------------------------------------------- found by a review of the fixes above


class _Extra(torch.nn.Module):
    """A module whose extra state holds tensors, in a dict with the keys 1 and "1" among others."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3).to(dtype)
        self.st: dict[Any, Any] = {"t": torch.zeros(5, dtype=dtype), 1: torch.zeros(2), "1": torch.zeros(2), "n": 0}

    def get_extra_state(self) -> dict[Any, Any]:
        return self.st

    def set_extra_state(self, s: dict[Any, Any]) -> None:
        self.st = s


def test_dtype_converts_tensors_inside_extra_state_and_keys_1_and_the_string_1_stay_apart(daemon) -> None:  # noqa: ANN001
    """dtype= converted tensors read into the target's own, but not those nested in a module's extra state (a
    bf16 tensor came back into an fp32 model); and of the keys 1 and "1", both came back with the value of "1"."""
    saved = _Extra(torch.bfloat16)
    saved.st = {"t": torch.arange(5, dtype=torch.bfloat16) + 0.5, 1: torch.ones(2), "1": torch.full((2,), 2.0), "n": 9}
    _save(daemon, "extra-dtype", saved)
    with daemon.client("extra-dtype") as c:
        target = _Extra(torch.float32)
        c.restore(target, dtype=torch.float32)
    st = target.st
    assert st["t"].dtype == torch.float32 and st["t"].tolist() == [0.5, 1.5, 2.5, 3.5, 4.5] and st["n"] == 9
    assert st[1].tolist() == [1.0, 1.0] and st["1"].tolist() == [2.0, 2.0]


def test_a_fresh_optimizer_restored_with_dtype_gets_its_state_in_that_dtype_once(daemon, monkeypatch) -> None:  # noqa: ANN001
    """With torch no longer stepping a fresh optimizer, its buffers were made in the saved dtype (fp32 for a bf16
    model restored with dtype=bf16), and load_state_dict then copied them again: three times the state's memory."""
    model, optim = _trained()
    _save(daemon, "opt-dtype", model, optim)
    handed: list[dict[str, torch.dtype]] = []
    real = torch.optim.Optimizer.load_state_dict

    def spy(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        handed.extend({k: v.dtype for k, v in st.items() if isinstance(v, torch.Tensor)} for st in state_dict["state"].values())
        return real(self, state_dict)

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", spy)
    torch.manual_seed(1)
    m2 = Net().to(torch.bfloat16)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    with daemon.client("opt-dtype") as c:
        c.restore(m2, o2, dtype=torch.bfloat16)
    assert handed and all(d["exp_avg"] == d["exp_avg_sq"] == torch.bfloat16 and d["step"] == torch.float32 for d in handed)
    want = optim.state_dict()["state"][0]["exp_avg"].to(torch.bfloat16)
    assert torch.equal(o2.state_dict()["state"][0]["exp_avg"], want)


def _mixed_hot_restore(rank: int, world: int, step_dir: str) -> dict[str, Any]:
    """Rank 0's daemon says the step is in memory but its segment is gone (a FormatError when the hot reader
    opens); rank 1's says it is not: rank 0 falls back to the disk."""
    import logging

    from ckptd.client.restore import restore_from_daemon

    logging.disable(logging.WARNING)

    class Rpc:
        timeout = 5.0

        def call(self, op: str, **kw: Any) -> dict[str, Any]:
            if op == "promote":
                return {"step": None}
            if op == "hot_open":
                if rank == 1:
                    return {"step": None, "reason": "not in memory here"}
                manifest = json.loads((Path(step_dir) / MANIFEST).read_text())
                gone = "ckptd-0-0000000000000000/" + "0" * 32
                return {"step": 1, "path": step_dir, "manifest": manifest, "segments": {shard_name(0): gone}, "pin": "0" * 32,
                        "tier": "disk", "reason": None}  # fmt: skip
            if op == "fetch":
                return {"fetch": 1}
            if op == "fetch_wait":
                return {"state": "done", "path": step_dir, "step": 1, "source": "local"}
            return {}

    torch.manual_seed(3)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {}
    for attempt in range(2):
        try:
            if attempt == 0:
                restore_from_daemon(Rpc(), "mixed", model, optim, rank, step=None, hot=True, how={"strict": True})  # type: ignore[arg-type]
            else:
                ckptd.restore(model, optim, path=step_dir)  # the next restore of every rank, together
            out[f"attempt{attempt}"] = "ok"
        except Exception as e:
            out[f"attempt{attempt}"] = f"{type(e).__name__}: {e}"
    out["weight"] = model.lin.weight.tolist()
    return out


@pytest.mark.multiproc
def test_a_hot_restore_that_falls_back_to_disk_on_one_rank_keeps_the_ranks_paired(daemon, monkeypatch) -> None:  # noqa: ANN001
    """One rank's hot reader failed (a FormatError), and it read the step from disk again: a second check-in that
    the other rank, which had read the disk from the start and raised the shared failure, never made. The first
    rank then waited out the collective timeout, or paired with the other's next restore."""
    model, optim = _trained()
    path = _save(daemon, "mixed", model, optim)
    monkeypatch.setenv("CKPTD_COLLECTIVE_TIMEOUT", "20")
    outs = run_ranks(2, _mixed_hot_restore, path, timeout=120)
    assert [o["attempt0"] for o in outs] == ["ok", "ok"] and [o["attempt1"] for o in outs] == ["ok", "ok"], outs
    assert all(o["weight"] == model.lin.weight.tolist() for o in outs)


def test_a_tensor_sharded_two_ways_by_two_groups_of_holders_is_refused_naming_it() -> None:
    """README: a tensor sharded 2-way on some ranks and 3-way on others has chunks that overlap without being the
    same chunk (not replicas), refused at commit rather than saved twice over."""
    chunk = lambda o, n: {"offsets": [o], "sizes": [n], "file": "f"}  # noqa: E731
    with pytest.raises(CheckpointError, match="tensor 'model/w': chunks at offsets .* overlap"):
        check_coverage({"model/w": {"shape": [6], "chunks": [chunk(0, 3), chunk(3, 3), chunk(0, 2), chunk(2, 2), chunk(4, 2)]}})
