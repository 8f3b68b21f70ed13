"""The step catalog (:class:`ckptd.daemon.catalog.StepCatalog`) on its own: which complete steps a job
has under the local root and in the bucket, which one ``latest`` names, which one a restore reads
(``find``: the local copy when it is the newest, the bucket's when it is newer, :class:`NoStep` naming
the job and where it looked), and what this run completed and uploaded.

The steps are real: ckptd's own writer (``write_shard`` + ``finalize_step``) persists a shard built with
``build_layout``, and ``upload_step`` puts it in the in-memory object store double. No daemon, no network."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from _shards import shard_bytes
from doubles import FaultyStore, MemoryStore

from ckptd.daemon.catalog import Found, InMemory, NoStep, StepCatalog
from ckptd.errors import CheckpointError
from ckptd.layout import MANIFEST, job_dir, latest_file, step_dir
from ckptd.protocol import Source
from ckptd.storage.local import ShardWrite, finalize_step, write_shard
from ckptd.storage.remote import download_step, upload_step
from ckptd.validate import read_manifest

JOB = "j"


def make_step(root: str, job: str, step: int) -> str:
    """A complete one-rank step written by ckptd's own writer (a shard filled as the client fills a
    slot: header, then each tensor copied into its typed view); returns its directory."""
    write_partial(root, job, step)
    return finalize_step(root, job, step, 1)


def write_partial(root: str, job: str, step: int) -> None:
    """Rank 0's durable shard and fragment in ``step-N.tmp``: a step that never completed."""
    buf = shard_bytes([("model/w", torch.arange(6, dtype=torch.float32).reshape(2, 3) + step, (2, 3), (0, 0))])
    write_shard(root, ShardWrite(job, step, 0, 1, memoryview(buf), len(buf), {"step": step}))


def set_latest(root: str, job: str, text: str | None) -> None:
    if text is None:
        os.unlink(latest_file(root, job))
    else:
        Path(latest_file(root, job)).write_text(text)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore("ckpts")


@pytest.fixture
def root(tmp_path: Path) -> str:
    return str(tmp_path / "root")


@pytest.fixture
def other(tmp_path: Path) -> str:
    """Another node's root: steps only the bucket has are written and uploaded from here."""
    return str(tmp_path / "other")


def to_bucket(store: MemoryStore, root: str, job: str, *steps: int) -> None:
    for step in steps:
        upload_step(store, make_step(root, job, step), job, step)


# ---------------------------------------------------------------------------- local steps


def test_latest_trusts_a_latest_file_naming_a_complete_step(root: str) -> None:
    for step in (1, 2, 3):
        make_step(root, JOB, step)
    assert StepCatalog(root).latest(JOB) == (3, step_dir(root, JOB, 3))
    set_latest(root, JOB, "2\n")  # e.g. an operator rolled back
    assert StepCatalog(root).latest(JOB) == (2, step_dir(root, JOB, 2))


@pytest.mark.parametrize(
    "latest",
    ["7\n", "4\n", "5\n", "not a number\n", "", None],
    ids=["names-a-missing-step", "names-a-dir-without-manifest", "names-a-partial-step", "garbage", "empty", "no-file"],
)
def test_latest_falls_back_to_the_highest_complete_step(root: str, latest: str | None) -> None:
    for step in (2, 10):
        make_step(root, JOB, step)
    os.makedirs(step_dir(root, JOB, 4))  # a step directory without its manifest is not a checkpoint
    write_partial(root, JOB, 5)  # step-5.tmp: never completed
    set_latest(root, JOB, latest)
    assert StepCatalog(root).latest(JOB) == (10, step_dir(root, JOB, 10))  # numerically highest, not "2" > "10"


def test_latest_of_a_job_without_a_complete_step(root: str) -> None:
    cat = StepCatalog(root)
    assert cat.latest(JOB) == (None, None)  # not even a root
    write_partial(root, JOB, 1)
    Path(latest_file(root, JOB)).write_text("1\n")
    assert cat.latest(JOB) == (None, None)
    assert cat.local_steps(JOB) == []


def test_complete_path_and_local_steps_count_complete_steps_only(root: str) -> None:
    for step in (9, 10, 1):
        make_step(root, JOB, step)
    write_partial(root, JOB, 11)
    os.makedirs(step_dir(root, JOB, 12))
    os.unlink(os.path.join(make_step(root, JOB, 13), MANIFEST))  # its manifest lost: no longer complete
    cat = StepCatalog(root)
    assert cat.local_steps(JOB) == [1, 9, 10]
    assert cat.complete_path(JOB, 10) == step_dir(root, JOB, 10)
    for step in (11, 12, 13, 14):
        assert cat.complete_path(JOB, step) is None
    assert cat.local_steps("nobody") == [] and cat.complete_path("nobody", 1) is None


def test_jobs_lists_job_directories(root: str) -> None:
    assert StepCatalog(root).jobs() == []
    make_step(root, "b", 1)
    make_step(root, "a", 1)
    os.makedirs(os.path.join(root, ".hidden"))
    Path(root, "stray-file").write_text("x")
    assert StepCatalog(root).jobs() == ["a", "b"]


# ---------------------------------------------------------------------------- the bucket


def test_bucket_steps_are_complete_uploads_only(root: str, other: str, store: MemoryStore) -> None:
    assert StepCatalog(root).bucket_steps(JOB) == []  # no bucket configured
    to_bucket(store, other, JOB, 2, 10)
    with pytest.raises(CheckpointError):  # an upload that died before its manifest
        upload_step(FaultyStore(store, put_bytes=[MANIFEST]), make_step(other, JOB, 11), JOB, 11)
    to_bucket(store, other, "jx", 12)
    assert StepCatalog(root, store).bucket_steps(JOB) == [2, 10]
    assert StepCatalog(root, store).bucket_steps("jx") == [12]


def test_where_names_the_root_and_the_bucket(root: str, store: MemoryStore) -> None:
    assert StepCatalog(root).where() == f"under {root}"
    assert StepCatalog(root, store).where() == f"under {root} or in mem://ckpts/"


# ---------------------------------------------------------------------------- find: which step a restore reads


def test_find_prefers_the_local_step_when_it_is_the_newest(root: str, other: str, store: MemoryStore) -> None:
    to_bucket(store, other, JOB, 1, 2)
    make_step(root, JOB, 3)
    assert StepCatalog(root, store).find(JOB) == Found(3, Source.DISK, step_dir(root, JOB, 3))
    to_bucket(store, root, JOB, 4)  # uploaded from this node: both tiers hold it
    assert StepCatalog(root, store).find(JOB) == Found(4, Source.DISK, step_dir(root, JOB, 4))


def test_find_picks_the_bucket_step_when_it_is_newer(root: str, other: str, store: MemoryStore) -> None:
    make_step(root, JOB, 2)
    to_bucket(store, other, JOB, 2, 5)
    cat = StepCatalog(root, store)
    assert cat.find(JOB) == Found(5, Source.BUCKET, None)
    # once downloaded, the same step is found on disk
    download_step(store, root, JOB, 5)
    assert cat.find(JOB) == Found(5, Source.DISK, step_dir(root, JOB, 5))
    assert read_manifest(step_dir(root, JOB, 5))["step"] == 5


def test_find_of_a_step_only_the_bucket_has(root: str, other: str, store: MemoryStore) -> None:
    make_step(root, JOB, 7)
    to_bucket(store, other, JOB, 3, 7)
    cat = StepCatalog(root, store)
    assert cat.find(JOB, 3) == Found(3, Source.BUCKET, None)
    assert cat.find(JOB, 7) == Found(7, Source.DISK, step_dir(root, JOB, 7))  # both have it: the local copy
    os.makedirs(step_dir(root, JOB, 4))  # a local directory without a manifest does not count ...
    to_bucket(store, other, JOB, 4)
    assert cat.find(JOB, 4) == Found(4, Source.BUCKET, None)  # ... the bucket's complete copy does
    with pytest.raises(NoStep, match="step 5 of job 'j' is not a committed checkpoint"):
        cat.find(JOB, 5)  # between the steps either tier has


def test_find_ignores_partial_uploads(root: str, other: str, store: MemoryStore) -> None:
    make_step(root, JOB, 2)
    with pytest.raises(CheckpointError):
        upload_step(FaultyStore(store, put_bytes=[MANIFEST]), make_step(other, JOB, 6), JOB, 6)
    cat = StepCatalog(root, store)
    assert cat.find(JOB) == Found(2, Source.DISK, step_dir(root, JOB, 2))
    with pytest.raises(NoStep, match="step 6 of job 'j' is not a committed checkpoint"):
        cat.find(JOB, 6)


def test_find_without_a_bucket_reads_the_root_only(root: str) -> None:
    make_step(root, JOB, 1)
    make_step(root, JOB, 2)
    cat = StepCatalog(root)
    assert cat.find(JOB) == Found(2, Source.DISK, step_dir(root, JOB, 2))
    assert cat.find(JOB, 1) == Found(1, Source.DISK, step_dir(root, JOB, 1))
    with pytest.raises(NoStep) as e:
        cat.find(JOB, 3)
    assert str(e.value) == f"step 3 of job 'j' is not a committed checkpoint under {root}"


def test_no_step_names_the_job_and_where_it_looked(root: str, other: str, store: MemoryStore) -> None:
    write_partial(root, JOB, 1)  # partial steps do not count, locally or in the bucket
    with pytest.raises(CheckpointError):
        upload_step(FaultyStore(store, put_bytes=[MANIFEST]), make_step(other, JOB, 2), JOB, 2)
    to_bucket(store, other, "another", 3)
    cat = StepCatalog(root, store)
    where = re.escape(f"under {root} or in mem://ckpts/")
    with pytest.raises(NoStep, match=rf"^job 'j' has no committed checkpoint {where}$"):
        cat.find(JOB)
    with pytest.raises(NoStep, match=rf"^step 3 of job 'j' is not a committed checkpoint {where}$"):
        cat.find(JOB, 3)
    assert issubclass(NoStep, CheckpointError)


def test_find_after_the_local_copy_is_gone(root: str, store: MemoryStore) -> None:
    to_bucket(store, root, JOB, 1, 2)  # uploaded from this node, then the node lost its disk
    shutil.rmtree(os.path.join(root, JOB))
    cat = StepCatalog(root, store)
    assert cat.latest(JOB) == (None, None)
    assert cat.find(JOB) == Found(2, Source.BUCKET, None)
    assert cat.find(JOB, 1) == Found(1, Source.BUCKET, None)
    assert not os.path.exists(job_dir(root, JOB))  # finding downloads nothing into the root


# ---------------------------------------------------------------------------- what this run completed and uploaded


def test_in_memory_is_the_last_step_noted_per_job(root: str) -> None:
    cat = StepCatalog(root)
    assert cat.in_memory(JOB) is None and cat.in_memory_steps() == {}
    path = make_step(root, JOB, 1)
    manifest = read_manifest(path)
    cat.note_complete(JOB, 1, path, manifest)
    assert cat.in_memory(JOB) == InMemory(1, path, manifest)
    cat.note_complete(JOB, 2, step_dir(root, JOB, 2), None)
    cat.note_complete("other", 5, step_dir(root, "other", 5), None)
    assert cat.in_memory(JOB) == InMemory(2, step_dir(root, JOB, 2), None)
    assert cat.in_memory_steps() == {JOB: 2, "other": 5}
    assert StepCatalog(root).in_memory(JOB) is None  # a fresh catalog (a restarted daemon) holds nothing


def test_when_the_newest_step_in_memory_fails_the_one_before_it_is_the_newest_again(root: str) -> None:
    """Memory-only step 3, then step 4 sealed on its way to disk: hot restores read 4. When 4's persist fails
    (a full disk) it is forgotten, and 3, still held, is what they read, not nothing (the catalog kept one
    entry per job, and a restore then looked for step 3 on disk). A step completed on disk ends the disk
    entries before it."""
    from ckptd.daemon.tiering import Tier

    cat = StepCatalog(root)
    m3, m4 = {"committed_at": 30}, {"committed_at": 40}
    cat.note_memory(JOB, 3, m3)
    cat.note_memory(JOB, 4, m4)
    assert cat.in_memory(JOB) == InMemory(4, step_dir(root, JOB, 4), m4, Tier.MEMORY)
    cat.forget_memory(JOB, 4)
    assert cat.in_memory(JOB) == InMemory(3, step_dir(root, JOB, 3), m3, Tier.MEMORY)
    assert cat.in_memory_steps() == {JOB: 3}
    cat.note_complete(JOB, 1, step_dir(root, JOB, 1), {"committed_at": 10})
    cat.note_complete(JOB, 5, step_dir(root, JOB, 5), {"committed_at": 50})
    assert [e.step for e in cat.in_memory_all(JOB)] == [3, 5]  # disk step 1 ended by 5; memory step 3 waits for its drop
    cat.forget_memory(JOB, 5)  # a disk step is not forgotten so
    cat.forget_memory(JOB, 3)
    assert cat.in_memory(JOB).step == 5


def test_uploaded_is_the_newest_step_per_job(root: str) -> None:
    cat = StepCatalog(root)
    assert cat.uploaded() == {}
    cat.note_uploaded(JOB, 4)
    cat.note_uploaded(JOB, 2)  # an older step's upload finishing late does not move it back
    cat.note_uploaded("other", 0)
    got = cat.uploaded()
    assert got == {JOB: 4, "other": 0}
    got[JOB] = 99  # a copy: the caller cannot change the catalog
    assert cat.uploaded() == {JOB: 4, "other": 0}


def test_a_step_on_disk_is_found_while_the_bucket_is_unreachable(root: str, store: MemoryStore) -> None:
    make_step(root, "j", 3)
    cat = StepCatalog(root, FaultyStore(store, list=[0, 1, 2]))
    assert cat.find("j", 3) == Found(3, Source.DISK, step_dir(root, "j", 3))
    with pytest.raises(CheckpointError, match="injected failure"):
        cat.find("j")  # the newest step may be in the bucket: that question needs the bucket


def test_an_older_step_completing_late_does_not_replace_the_one_in_memory(root: str) -> None:
    cat = StepCatalog(root)
    cat.note_complete("j", 5, "p5", None)
    cat.note_complete("j", 4, "p4", None)  # a persist thread finished step 4 after step 5
    assert cat.in_memory("j") == InMemory(5, "p5", None)


def test_prune_forgets_the_disk_steps_no_slot_holds_and_keeps_memory_only_ones(root: str) -> None:
    """Each job's newest manifest (with every rank's parsed tree) stayed in the daemon for its whole life, outside
    --shm-budget: a daemon serving many jobs grew by their trees (555 MB for twelve 15 MB trees in a review)."""
    from ckptd.daemon.tiering import Tier

    cat = StepCatalog(root)
    cat.note_complete("a", 1, step_dir(root, "a", 1), {"committed_at": 10})
    cat.note_complete("b", 2, step_dir(root, "b", 2), {"committed_at": 20})
    cat.note_memory("c", 3, {"committed_at": 30})
    cat.prune({("a", 1)})  # b's slots were reused for another job's shards
    assert cat.in_memory_steps() == {"a": 1, "c": 3}
    assert cat.in_memory("c") == InMemory(3, step_dir(root, "c", 3), {"committed_at": 30}, Tier.MEMORY)
    cat.prune(set())  # a memory-only step goes only when dropped (forget_memory)
    assert cat.in_memory_steps() == {"c": 3}
