"""The checkpoints users already have: ``ckptd import`` turns a torch DCP directory into a ckptd step
(restorable into any layout), and the ``extra`` of a ckptd step is readable through DCP."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from _models import assert_same, full_state, make, train_step
from _workers import _save_expected, restore_and_compare
from conftest import REPO
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import ckptd
import ckptd.dcp
from ckptd.errors import CheckpointError, FormatError
from ckptd.tools.dcp_import import import_dcp, load_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model, optim = make(seed=1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for i in range(steps):
        train_step(model, optim, i)
        sched.step()
    return model, optim, sched


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)


@pytest.mark.multiproc
def test_import_a_dcp_checkpoint_and_restore_it_in_any_layout(daemon, short_tmp) -> None:  # noqa: ANN001
    model, optim, sched = _trained()
    msd, osd = get_state_dict(model, optim)
    d = str(short_tmp / "dcp-step-3")
    dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict(), "note": "from dcp"}, checkpoint_id=d, no_dist=True)
    out = _cli("import", d, "--job", "imported", "--step", "3", "--endpoint", daemon.endpoint)
    assert out.returncode == 0, out.stderr
    assert "imported" in out.stdout and "step-3" in out.stdout
    fresh, fopt = make(seed=9)
    with daemon.client("imported") as c:
        extra = c.restore(fresh, fopt)
    assert extra.step == 3 and extra["sched"] == sched.state_dict() and extra["note"] == "from dcp"
    assert_same(full_state(fresh, fopt), full_state(model, optim))
    # and into two FSDP2 ranks, resharded: every rank gets the imported extra (rank 0's)
    expected = str(short_tmp / "expected.safetensors")
    _save_expected(expected, full_state(model, optim))
    outs = run_ranks(2, restore_and_compare, "fsdp2", daemon.endpoint, "imported", expected, False)
    assert [o["extra"]["note"] for o in outs] == ["from dcp", "from dcp"]


def test_import_a_model_only_and_a_flattened_optimizer(daemon, short_tmp) -> None:  # noqa: ANN001
    model, optim, _ = _trained()
    flat_dir, titan_dir = str(short_tmp / "flat"), str(short_tmp / "titan")
    dcp.save(dict(model.state_dict()), checkpoint_id=flat_dir, no_dist=True)  # dcp.save(model.state_dict())
    msd, fosd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"model": msd, "optimizer": fosd, "train_state": {"step": 3}}, checkpoint_id=titan_dir, no_dist=True)  # torchtitan-like
    import_dcp(flat_dir, job="flat", step=1, endpoint=daemon.endpoint)
    import_dcp(titan_dir, job="titan", step=3, endpoint=daemon.endpoint)
    only, _ = make(seed=9)
    with daemon.client("flat") as c:
        c.restore(only)
    assert all(torch.equal(a, b) for a, b in zip(only.state_dict().values(), model.state_dict().values()))
    fresh, fopt = make(seed=9)
    with daemon.client("titan") as c:
        extra = c.restore(fresh, fopt)
    assert extra == {"train_state": {"step": 3}}
    assert_same(full_state(fresh, fopt), full_state(model, optim))


def test_import_of_torchtitans_layout_keeps_its_optimizer_and_a_plain_optimizer_state_dict_is_refused(daemon, short_tmp) -> None:  # noqa: ANN001
    """torchtitan 0.3.0 saves its model's tensors at the top level beside ``optimizer``, ``lr_scheduler`` and
    ``train_state``: the import put the optimizer into ``extra``, and ``restore(model, optim)`` then failed on a step
    with "no optim state". A plain ``optimizer.state_dict()`` (parameters by number) imported with exit 0 and every
    restore then called the step corrupt. Both found by a review of the tools."""
    model, optim, _ = _trained()
    msd, fosd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    titan, plain = str(short_tmp / "titan"), str(short_tmp / "plain")
    dcp.save({**msd, "optimizer": fosd, "train_state": {"step": 3}}, checkpoint_id=titan, no_dist=True)
    import_dcp(titan, job="titan0", step=3, endpoint=daemon.endpoint)
    fresh, fopt = make(seed=9)
    with daemon.client("titan0") as c:
        assert c.restore(fresh, fopt) == {"train_state": {"step": 3}}
    assert_same(full_state(fresh, fopt), full_state(model, optim))
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=plain, no_dist=True)
    out = _cli("import", plain, "--job", "plain", "--step", "1", "--endpoint", daemon.endpoint)
    assert out.returncode == 1 and "by number (a plain optimizer.state_dict())" in out.stderr and "get_state_dict" in out.stderr
    with daemon.client("plain") as c:
        assert c.latest() is None  # nothing was committed


def test_import_refuses_what_is_not_a_dcp_checkpoint(daemon, short_tmp) -> None:  # noqa: ANN001
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_dcp(str(short_tmp / "nowhere"))
    (short_tmp / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no .metadata"):
        load_dcp(str(short_tmp / "empty"))
    out = _cli("import", str(short_tmp / "empty"), "--job", "j", "--step", "1", "--endpoint", daemon.endpoint)
    assert out.returncode == 1 and "ckptd import:" in out.stderr and "has no .metadata" in out.stderr


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {_Boom.marker}",))

    marker = ""


def test_a_hostile_dcp_metadata_pickle_is_refused_not_run(daemon, short_tmp) -> None:  # noqa: ANN001
    model, optim, _ = _trained(1)
    d = short_tmp / "hostile"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(d), no_dist=True)
    _Boom.marker = str(short_tmp / "pwned")
    (d / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(FormatError, match="names posix.system, which is not DCP metadata"):
        load_dcp(str(d))
    assert not Path(_Boom.marker).exists()


def test_numpy_state_imports_and_a_hostile_object_array_is_refused_not_run(daemon, short_tmp) -> None:  # noqa: ANN001
    """``np.random.get_state()`` in a DCP checkpoint (a data loader's RNG, as trainers save it) failed the import with
    torch's "Weights only load failed"; numpy arrays and scalars now import (snapshots store them too). An object
    array holding anything else is still refused, never run. Found by a review of the tools."""
    model, optim, _ = _trained(1)
    msd, osd = get_state_dict(model, optim)
    rng, arr, scalar = np.random.RandomState(3).get_state(), np.arange(5, dtype=np.int16), np.float32(1.5)
    good = str(short_tmp / "numpy")
    dcp.save({"model": msd, "optim": osd, "rng": rng, "arr": arr, "scalar": scalar}, checkpoint_id=good, no_dist=True)
    import_dcp(good, job="np", step=1, endpoint=daemon.endpoint)
    fresh, fopt = make(seed=9)
    with daemon.client("np") as c:
        extra = c.restore(fresh, fopt)
    assert extra["rng"][0] == rng[0] and np.array_equal(extra["rng"][1], rng[1]) and extra["rng"][2:] == rng[2:]
    assert np.array_equal(extra["arr"], arr) and extra["arr"].dtype == np.int16 and extra["scalar"] == scalar
    _Boom.marker = str(short_tmp / "pwned-array")
    bad = str(short_tmp / "hostile-array")
    dcp.save({"model": msd, "x": np.array([_Boom()], dtype=object)}, checkpoint_id=bad, no_dist=True)
    with pytest.raises(FormatError, match="value 'x' is not plain data"):
        load_dcp(bad)
    assert not Path(_Boom.marker).exists()


def test_the_extra_of_a_ckptd_step_is_readable_through_dcp(daemon) -> None:  # noqa: ANN001
    model, optim, sched = _trained()
    extra = {"sched": sched.state_dict(), "rng": torch.get_rng_state(), "steps": np.arange(4)}
    with daemon.client("via-dcp") as c:
        path = c.snapshot(model, optim, step=3, extra=extra).wait(30)
    target = {"extra": {"0": {"sched": {k: None for k in extra["sched"]}, "rng": torch.empty_like(extra["rng"]), "steps": torch.zeros(4)}}}
    target["extra"]["0"]["steps"] = torch.zeros(4, dtype=torch.int64)
    dcp.load(target, storage_reader=ckptd.dcp.Reader(path), no_dist=True)
    got = target["extra"]["0"]
    assert got["sched"] == sched.state_dict()
    assert torch.equal(got["rng"], extra["rng"]) and got["steps"].tolist() == [0, 1, 2, 3]


def test_a_dcp_metadata_pointing_outside_its_directory_is_refused(short_tmp) -> None:  # noqa: ANN001
    """A planted .metadata naming another user's file (any torch.save file the importer can read) as a data file."""
    model, _, _ = _trained(1)
    d = short_tmp / "traversal"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(d), no_dist=True)
    md = pickle.loads((d / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "../victim/__0_0.distcp"
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(FormatError, match=r"points outside the checkpoint directory \('../victim/__0_0.distcp'\)"):
        load_dcp(str(d))
    (d / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(FormatError, match="holds a dict, not DCP metadata"):
        load_dcp(str(d))


@pytest.mark.parametrize("what", ["symlink", "fifo"])
def test_a_dcp_data_file_that_is_a_link_or_a_fifo_is_refused(short_tmp, what: str) -> None:  # noqa: ANN001
    """The data file's name is plain, but the file is a symbolic link to another user's DCP shard (read
    through it, its tensors came back), or a FIFO (the import hung)."""
    model, _, _ = _trained(1)
    victim, d = short_tmp / "victim", short_tmp / "planted"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(victim), no_dist=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(d), no_dist=True)
    (data,) = [p for p in d.iterdir() if p.suffix == ".distcp"]
    data.unlink()
    if what == "symlink":
        data.symlink_to(next(p for p in victim.iterdir() if p.suffix == ".distcp"))
    else:
        os.mkfifo(data)
    with pytest.raises(FormatError, match="is not a regular file"):
        load_dcp(str(d))


def test_import_with_no_daemon_says_so_before_reading_the_checkpoint(short_tmp, monkeypatch) -> None:  # noqa: ANN001
    # a large DCP checkpoint takes minutes to read: a wrong --endpoint must not cost them first
    import ckptd.tools.dcp_import as imp

    read: list[str] = []
    monkeypatch.setattr(imp, "load_dcp", lambda path: read.append(path))
    with pytest.raises(CheckpointError, match="daemon"):
        import_dcp(str(short_tmp), job="j", step=1, endpoint=f"ipc://{short_tmp}/nobody.sock")
    assert read == []
