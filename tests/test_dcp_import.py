"""The checkpoints users already have: ``ckptd import`` turns a torch DCP directory into a ckptd step
(restorable into any layout), and the ``extra`` of a ckptd step is readable through DCP."""

from __future__ import annotations

import io
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


# ----------------------------------------------------------------------------- a .metadata that lies about its tensors
# DCP's loader allocates each declared tensor with torch.empty() and copies in what the chunks hold: a tensor its
# chunks do not cover leaves the importing process's heap in the checkpoint, under weights that verify as sound.

_W = torch.arange(64.0).reshape(8, 8)


def _chunk(offsets: list[int], sizes: list[int]) -> object:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _planted(short_tmp: Path, plant) -> str:  # noqa: ANN001
    """A DCP checkpoint of ``model.w`` (8 x 8) and ``model.b`` whose ``.metadata`` ``plant(md)`` rewrote, as an
    attacker would: chunks it adds read ``model.w``'s saved data, so every chunk has bytes behind it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    d = short_tmp / "planted"
    dcp.save({"model": {"w": _W.clone(), "b": torch.ones(8)}}, checkpoint_id=str(d), no_dist=True)
    md = pickle.loads((d / ".metadata").read_bytes())
    saved_w = md.storage_data[MetadataIndex("model.w", [0, 0])]

    def chunks(fqn: str, *spans: tuple[list[int], list[int]]) -> None:
        md.state_dict_metadata[fqn].chunks = [_chunk(o, s) for o, s in spans]
        for o, _ in spans:
            md.storage_data[MetadataIndex(fqn, o)] = saved_w

    plant(md, chunks)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return str(d)


def _no_chunks(md, chunks) -> None:  # noqa: ANN001
    chunks("model.w")


def _half(md, chunks) -> None:  # noqa: ANN001
    chunks("model.w", ([0, 0], [4, 8]))


def _overlapping(md, chunks) -> None:  # noqa: ANN001
    chunks("model.w", ([0, 0], [4, 8]), ([2, 0], [4, 8]))  # 64 elements in all, rows 6 and 7 in none


def _past_the_end(md, chunks) -> None:  # noqa: ANN001
    chunks("model.w", ([0, 0], [4, 8]), ([5, 0], [4, 8]))  # 64 elements, disjoint; row 4 in none, rows 8 on outside


def _negative(md, chunks) -> None:  # noqa: ANN001
    chunks("model.w", ([-2, 0], [4, 8]), ([2, 0], [4, 8]))  # 64 elements, disjoint; rows 6 and 7 in none


def _absurd(md, chunks) -> None:  # noqa: ANN001
    md.state_dict_metadata["model.w"].size = torch.Size([1 << 60])
    chunks("model.w", ([0], [1 << 60]))


def _more_than_its_data(md, chunks) -> None:  # noqa: ANN001
    md.state_dict_metadata["model.w"].size = torch.Size([1 << 22])  # 16 MiB, from a chunk of 256 bytes
    chunks("model.w", ([0], [1 << 22]))


def _aliased(md, chunks) -> None:  # noqa: ANN001
    # every tensor a whole, sound cover, all reading one saved chunk: more bytes declared than the files hold
    for i in range(64):
        md.state_dict_metadata[f"model.w{i}"] = md.state_dict_metadata["model.w"]
        md.planner_data[f"model.w{i}"] = ("model", f"w{i}")
        chunks(f"model.w{i}", ([0, 0], [8, 8]))


@pytest.mark.parametrize(
    ("plant", "refusal"),
    [
        pytest.param(_no_chunks, r"tensor 'model.w' of shape \[8, 8\]: chunks cover 0 of 64 elements", id="no_chunks"),
        pytest.param(_half, r"tensor 'model.w' of shape \[8, 8\]: chunks cover 32 of 64 elements", id="half"),
        pytest.param(
            _overlapping,
            r"tensor 'model.w': chunks at offsets \[0, 0\] \(__0_0.distcp\) and \[2, 0\] \(__0_0.distcp\) overlap",
            id="overlapping",
        ),
        pytest.param(
            _past_the_end,
            r"tensor 'model.w': chunk 1 at offsets \[5, 0\] with sizes \[4, 8\] reaches past its shape \[8, 8\]",
            id="past_the_end",
        ),
        pytest.param(_negative, r"tensor 'model.w': chunk 0 offsets \[-2, 0\] must be 2 integers in \[0, 2\*\*63 - 1\]", id="negative"),
        pytest.param(
            _absurd, r"tensor 'model.w' declares 1152921504606846976 elements of torch.float32 \(4611686018427387904 bytes\)", id="absurd"
        ),
        pytest.param(
            _more_than_its_data,
            r"tensor 'model.w': chunk 0 at offsets \[0\] needs 16777216 bytes, its data in __0_0.distcp",
            id="more_than_its_data",
        ),
        pytest.param(
            _aliased, r"declares \d+ bytes of tensors in uncompressed chunks, more than its data files hold \(\d+\)", id="aliased"
        ),
    ],
)
def test_a_dcp_metadata_that_does_not_cover_its_tensors_is_refused_before_anything_is_staged(daemon, short_tmp, plant, refusal) -> None:  # noqa: ANN001
    """The import left ``torch.empty()``'s memory wherever the chunks did not reach (the importing process's heap,
    in a step ``ckptd verify`` accepts), allocated whatever size was declared, and read one saved chunk into any
    number of tensors. Found by a security review."""
    d = _planted(short_tmp, plant)
    with pytest.raises(FormatError, match=refusal):
        import_dcp(d, job="planted", step=1, endpoint=daemon.endpoint)
    with daemon.client("planted") as c:
        assert c.latest() is None  # nothing was committed


def test_the_import_command_refuses_an_unsound_dcp_metadata_with_exit_1_and_commits_nothing(daemon, short_tmp) -> None:  # noqa: ANN001
    """What ``ckptd import`` says of one of the unsound covers above (each costs the command ~3 s of importing torch)."""
    d = _planted(short_tmp, _half)
    out = _cli("import", d, "--job", "planted", "--step", "1", "--endpoint", daemon.endpoint)
    assert out.returncode == 1 and "refusing to import it" in out.stderr and "chunks cover 32 of 64 elements" in out.stderr, out.stderr
    with daemon.client("planted") as c:
        assert c.latest() is None


def test_a_tensor_saved_in_chunks_that_cover_it_exactly_imports(short_tmp) -> None:  # noqa: ANN001
    """The coverage check refuses only what is unsound: ``model.w`` saved as two halves, in two files, loads whole."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def halves(md, chunks) -> None:  # noqa: ANN001
        chunks("model.w", ([0, 0], [4, 8]), ([4, 0], [4, 8]))
        blob = io.BytesIO()
        torch.save(_W[4:].clone(), blob)
        (short_tmp / "planted" / "lower.distcp").write_bytes(blob.getvalue())
        md.storage_data[MetadataIndex("model.w", [4, 0])] = _StorageInfo("lower.distcp", 0, len(blob.getvalue()))

    sd = load_dcp(_planted(short_tmp, halves))
    assert torch.equal(sd["model"]["w"], _W) and torch.equal(sd["model"]["b"], torch.ones(8))


def test_the_elements_dcp_copies_are_counted_again_after_the_read(short_tmp, monkeypatch) -> None:  # noqa: ANN001
    """Defence in depth: should a chunk the metadata check passed not be read (a change in DCP's resharding, say), the
    elements DCP copied fall short of the tensor's and the import still refuses rather than keep ``torch.empty()``'s."""
    import ckptd.tools.dcp_import as imp

    monkeypatch.setattr(imp, "_check_tensors", lambda md, path, md_path: None)
    with pytest.raises(FormatError, match=r"DCP copied 32 of the 64 elements of tensor 'model.w': refusing to import it"):
        load_dcp(_planted(short_tmp, _half))
