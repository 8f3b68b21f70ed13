"""Names and paths (:mod:`ckptd.layout`): shard and fragment file names, local step paths and when a step
is complete, the listings of jobs and steps on a real directory tree, and bucket keys (built and parsed
back, with no confusion between jobs or between ``step-1`` and ``step-10``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd import layout
from ckptd.layout import (
    MANIFEST,
    bucket_key,
    bucket_prefix,
    complete_steps,
    fetch_dir,
    fragment_name,
    fragment_rank,
    fragments_present,
    is_complete,
    job_dir,
    latest_file,
    list_jobs,
    parse_bucket_key,
    partial_steps,
    shard_name,
    step_dir,
    tmp_dir,
)

JOB = "job"


# ---------------------------------------------------------------------------- file names


@pytest.mark.parametrize("rank", [0, 1, 7, 42, 99999])
def test_file_names(rank: int) -> None:
    assert shard_name(rank) == f"rank-{rank:05d}.safetensors"
    assert fragment_name(rank) == f"rank-{rank:05d}.json"
    assert fragment_rank(fragment_name(rank)) == rank
    assert fragment_rank(shard_name(rank)) is None


def test_names_sort_in_rank_order() -> None:
    assert sorted(fragment_name(r) for r in (10, 2, 1)) == [fragment_name(1), fragment_name(2), fragment_name(10)]


@pytest.mark.parametrize(
    "name",
    [
        "rank-0.json",  # not five digits
        "rank-00001.json.tmp",  # a fragment being written (write_durable's temporary)
        "rank-00001.safetensors",
        "rank-00001.JSON",
        "xrank-00001.json",
        "rank-0000a.json",
        "rank--0001.json",
        MANIFEST,
        "latest",
        "",
    ],
)
def test_fragment_rank_rejects_other_names(name: str) -> None:
    assert fragment_rank(name) is None


# ---------------------------------------------------------------------------- local paths


def test_paths() -> None:
    root = "/r"
    assert job_dir(root, JOB) == "/r/job"
    assert step_dir(root, JOB, 12) == "/r/job/step-12"
    assert tmp_dir(root, JOB, 12) == "/r/job/step-12.tmp"
    assert fetch_dir(root, JOB, 12) == "/r/job/step-12.fetch"
    assert latest_file(root, JOB) == "/r/job/latest"
    assert len({step_dir(root, JOB, 1), tmp_dir(root, JOB, 1), fetch_dir(root, JOB, 1), step_dir(root, JOB, 10)}) == 4


def test_is_complete_needs_the_manifest(tmp_path: Path) -> None:
    d = tmp_path / "step-1"
    assert not is_complete(str(d))  # missing directory
    d.mkdir()
    (d / shard_name(0)).write_bytes(b"x")
    (d / fragment_name(0)).write_text("{}")
    assert not is_complete(str(d))
    (d / (MANIFEST + ".tmp")).write_text("{}")  # a manifest still being written does not count
    assert not is_complete(str(d))
    (d / MANIFEST).write_text("{}")
    assert is_complete(str(d))


# ---------------------------------------------------------------------------- local listings


def _tree(root: Path) -> None:
    """A job with complete, partial, fetching, incomplete and foreign entries."""
    j = root / JOB
    for s in (1, 2, 10):
        (j / f"step-{s}").mkdir(parents=True)
        (j / f"step-{s}" / MANIFEST).write_text("{}")
    (j / "step-3").mkdir()  # no manifest: not complete
    for s in (3, 11, 4):
        (j / f"step-{s}.tmp").mkdir()
    (j / "step-12.fetch").mkdir()
    (j / "step-5.tmp.old").mkdir()
    (j / "step-x").mkdir()
    (j / "latest").write_text("10\n")
    (j / "step-7").write_text("a file, not a directory")


def test_complete_and_partial_steps(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert complete_steps(str(tmp_path), JOB) == [1, 2, 10]  # numeric order, not 1, 10, 2
    assert partial_steps(str(tmp_path), JOB) == [3, 4, 11]
    assert complete_steps(str(tmp_path), "other") == []
    assert partial_steps(str(tmp_path), "other") == []


def test_list_jobs(tmp_path: Path) -> None:
    assert list_jobs(str(tmp_path / "missing")) == []
    assert list_jobs(str(tmp_path)) == []
    for name in ("b", "a", ".hidden"):
        (tmp_path / name).mkdir()
    (tmp_path / "c").write_text("a file is not a job")
    assert list_jobs(str(tmp_path)) == ["a", "b"]


def test_fragments_present_ignores_files_that_are_not_fragments(tmp_path: Path) -> None:
    assert fragments_present(str(tmp_path), JOB, 1) == set()  # no step-1.tmp
    d = Path(tmp_dir(str(tmp_path), JOB, 1))
    d.mkdir(parents=True)
    assert fragments_present(str(tmp_path), JOB, 1) == set()
    for r in (0, 2):
        (d / shard_name(r)).write_bytes(b"x")
        (d / fragment_name(r)).write_text("{}")
    (d / shard_name(1)).write_bytes(b"x")  # shard without its fragment: not durable yet
    for junk in ("rank-00001.json.tmp", MANIFEST, "rank-3.json", "notes.json", "rank-00004.json.bak"):
        (d / junk).write_text("{}")
    assert fragments_present(str(tmp_path), JOB, 1) == {0, 2}
    assert fragments_present(str(tmp_path), JOB, 10) == set()  # another step's directory is not consulted


# ---------------------------------------------------------------------------- bucket keys


def test_bucket_keys() -> None:
    assert bucket_prefix(JOB, 1) == "job/step-1/"
    assert bucket_key(JOB, 1, MANIFEST) == "job/step-1/manifest.json"
    assert bucket_key(JOB, 10, shard_name(3)) == "job/step-10/rank-00003.safetensors"
    # the trailing slash: step 1's prefix does not select step 10's (or step 1x's) keys
    assert not bucket_key(JOB, 10, MANIFEST).startswith(bucket_prefix(JOB, 1))
    assert not bucket_key("jobs", 1, MANIFEST).startswith(bucket_prefix(JOB, 1))  # nor another job's


@pytest.mark.parametrize("step,name", [(0, MANIFEST), (1, shard_name(0)), (10, fragment_name(12)), (123456789, "x")])
def test_parse_bucket_key_inverts_bucket_key(step: int, name: str) -> None:
    assert parse_bucket_key(JOB, bucket_key(JOB, step, name)) == (step, name)


@pytest.mark.parametrize(
    "key",
    [
        "other/step-1/manifest.json",  # another job
        "jobx/step-1/manifest.json",  # a job whose name starts with this one's
        "jo/step-1/manifest.json",
        "job-step-1/manifest.json",  # the job name followed by anything but "/"
        "jobxstep-1/manifest.json",
        "job",
        "job/",
        "job/latest",
        "job/step-1",  # the step's prefix without a file
        "job/step-1/",
        "job/step-/manifest.json",
        "job/step-1.tmp/manifest.json",
        "job/step-x/manifest.json",
        "job/nested/step-1/manifest.json",
        "step-1/manifest.json",  # no job at all
    ],
)
def test_parse_bucket_key_rejects_other_keys(key: str) -> None:
    assert parse_bucket_key(JOB, key) is None


def test_parse_bucket_key_rejects_keys_of_a_job_with_a_longer_name() -> None:
    assert parse_bucket_key("job", "job-2/step-1/manifest.json") is None
    assert parse_bucket_key("job-2", "job/step-1/manifest.json") is None
    assert parse_bucket_key("job-2", "job-2/step-1/manifest.json") == (1, MANIFEST)


def test_step_1_and_step_10_are_not_confused() -> None:
    assert parse_bucket_key(JOB, "job/step-10/manifest.json") == (10, MANIFEST)
    assert parse_bucket_key(JOB, "job/step-1/0/manifest.json") == (1, "0/manifest.json")  # a file under step 1, not step 10
    keys = [bucket_key(JOB, s, MANIFEST) for s in (1, 10, 100, 11)]
    assert [k for k in keys if k.startswith(bucket_prefix(JOB, 1))] == ["job/step-1/manifest.json"]
    assert sorted(p[0] for k in keys if (p := parse_bucket_key(JOB, k))) == [1, 10, 11, 100]


def test_layout_names_are_module_constants() -> None:
    assert (layout.MANIFEST, layout.LATEST) == ("manifest.json", "latest")
    assert os.path.basename(latest_file("/r", JOB)) == layout.LATEST


@pytest.mark.parametrize("name", ["rank-00001.json\n", "rank-000001.json", "rank-1.json"])
def test_only_the_canonical_spelling_of_a_fragment_is_one(name: str) -> None:
    assert fragment_rank(name) is None


def test_ranks_past_five_digits_are_still_fragments() -> None:
    assert fragment_rank(fragment_name(100000)) == 100000 and fragment_name(100000) == "rank-100000.json"


def test_a_step_directory_spelled_with_leading_zeros_is_not_a_step(tmp_path: Path) -> None:
    root = str(tmp_path)
    for name in ("step-1", "step-01", "step-2\n", "step-02.tmp", "step-3.tmp"):
        os.makedirs(os.path.join(root, "j", name))
        open(os.path.join(root, "j", name, MANIFEST), "w").close()
    assert complete_steps(root, "j") == [1]
    assert partial_steps(root, "j") == [3]


@pytest.mark.parametrize("key", ["j/step-1/manifest.json\n", "j/step-01/x", "j/step-1/a\nb"])
def test_bucket_keys_that_are_not_canonical_are_not_a_steps_files(key: str) -> None:
    assert parse_bucket_key("j", key) is None


def test_jobs_are_directories_a_job_may_be_named_after(tmp_path: Path) -> None:
    # a root at the top of a data disk holds lost+found: `ckptd status` and `ls` listed it as a job
    for name in ("train-a", "lost+found", ".hidden", "b.2"):
        (tmp_path / name).mkdir()
    (tmp_path / "a-file").write_text("x")
    assert layout.list_jobs(str(tmp_path)) == ["b.2", "train-a"]
    assert layout.list_jobs(str(tmp_path / "missing")) == []
