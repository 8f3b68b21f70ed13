"""The bucket tier (:mod:`ckptd.storage.remote`) on its own, against the in-memory object store double:
the upload order of a complete step and of one node's ranks, how a multi-node step completes in the
bucket (coverage, replicas, missing shards), which steps the bucket holds, downloading a step back
(verified; a corrupt object, a size mismatch, a manifest naming a file outside the step or describing
another job or step each fail with a clear error and leave nothing in the root), and the bucket's
retention with the policies of :mod:`ckptd.storage.retention`.

The steps are real: ckptd's own writer (``write_shard`` + ``finalize_step``) persists shards built
with ``build_layout`` and filled the way the client fills a slot. No daemon, no network."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _shards import Chunk, shard_bytes
from doubles import FaultyStore, MemoryStore

from ckptd.errors import CheckpointError, FormatError
from ckptd.format import encode_manifest
from ckptd.layout import (
    FETCHED,
    MANIFEST,
    bucket_key,
    bucket_prefix,
    fetch_dir,
    fragment_name,
    is_complete,
    job_dir,
    shard_name,
    step_dir,
    tmp_dir,
)
from ckptd.storage.local import ShardWrite, finalize_step, read_latest, write_shard
from ckptd.storage.remote import (
    apply_remote_retention,
    bucket_attempt,
    check_replaces,
    download_step,
    remote_steps,
    try_complete,
    upload_ranks,
    upload_step,
)
from ckptd.storage.retention import AnyOf, KeepEvery, KeepLatest, Protect
from ckptd.storage.verify import verify_checkpoint
from ckptd.validate import read_manifest

JOB = "j"


# ---------------------------------------------------------------------------- real steps on disk


def rank_chunks(step: int, rank: int, world_size: int) -> list[Chunk]:
    """Rank ``rank``'s rows of ``model/w`` (float32, two rows per rank) and, on rank 0, ``model/b`` (bfloat16)."""
    w = torch.arange(6 * rank, 6 * rank + 6, dtype=torch.float32).reshape(2, 3) + step
    chunks: list[Chunk] = [("model/w", w, (2 * world_size, 3), (2 * rank, 0))]
    if rank == 0:
        chunks.append(("model/b", torch.full((4,), float(step), dtype=torch.bfloat16), (4,), (0,)))
    return chunks


def write_rank(
    root: str,
    job: str,
    step: int,
    rank: int,
    world_size: int,
    chunks: list[Chunk] | None = None,
    *,
    local_world_size: int | None = None,
    replicas: dict[str, str] | None = None,
    run: int | None = None,
    after: int | None = None,
    at: int = 0,
) -> None:
    buf = shard_bytes(rank_chunks(step, rank, world_size) if chunks is None else chunks)
    tree = {"rank": rank, "step": step}
    attempt = {"committed_at": at, "run": run, "after": after}
    lws, replicas = local_world_size, replicas or {}
    write_shard(
        root, ShardWrite(job, step, rank, world_size, memoryview(buf), len(buf), tree, replicas=replicas, local_world_size=lws, **attempt)
    )


def make_step(root: str, job: str, step: int, world_size: int = 1) -> str:
    """A complete local step written by ckptd's own writer; returns its directory."""
    for rank in range(world_size):
        write_rank(root, job, step, rank, world_size)
    return finalize_step(root, job, step, world_size)


def uploaded(store: MemoryStore, root: str, job: str, step: int, world_size: int = 1) -> str:
    path = make_step(root, job, step, world_size)
    upload_step(store, path, job, step)
    return path


def step_keys(store: MemoryStore, job: str, step: int) -> list[str]:
    return store.list(bucket_prefix(job, step))


def assert_nothing_left(root: str, job: str, step: int, latest: int | None = None) -> None:
    """A failed download left neither ``step-N`` nor ``step-N.fetch``, and ``latest`` as it was."""
    names = sorted(os.listdir(job_dir(root, job))) if os.path.isdir(job_dir(root, job)) else []
    assert not os.path.exists(step_dir(root, job, step)), names
    assert not os.path.exists(fetch_dir(root, job, step)), names
    assert [n for n in names if n.startswith(f"step-{step}")] == []
    assert read_latest(root, job) == latest


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def src(tmp_path: Path) -> str:
    """The root steps are written (and uploaded) from."""
    return str(tmp_path / "src")


@pytest.fixture
def dst(tmp_path: Path) -> str:
    """A fresh root steps are downloaded into (a replaced node)."""
    return str(tmp_path / "dst")


# ---------------------------------------------------------------------------- upload_step


def test_upload_step_sends_shards_then_fragments_then_manifest(store: MemoryStore, src: str) -> None:
    path = make_step(src, JOB, 4, world_size=2)
    moved: list[int] = []
    sent = upload_step(store, path, JOB, 4, moved.append)
    order = [shard_name(0), shard_name(1), fragment_name(0), fragment_name(1), MANIFEST]
    # first the manifest of an older step of that number goes (none here), then data, fragments, manifest
    assert [op for op, _ in store.calls] == ["delete"] + ["put"] * 5  # the manifest as the bytes read before the files
    assert [key for _, key in store.calls] == [bucket_key(JOB, 4, n) for n in [MANIFEST, *order]]
    for name in order:  # every object is the local file, byte for byte
        assert store.objects[bucket_key(JOB, 4, name)] == Path(path, name).read_bytes()
    assert sent == sum(os.path.getsize(os.path.join(path, n)) for n in order) == sum(moved)
    assert remote_steps(store, JOB) == ([4], [])


def test_upload_step_refuses_a_step_that_is_not_complete(store: MemoryStore, src: str) -> None:
    write_rank(src, JOB, 4, 0, 1)  # durable shard and fragment, never finalized: no manifest
    with pytest.raises(CheckpointError, match=r"has no manifest\.json: only complete steps are uploaded"):
        upload_step(store, tmp_dir(src, JOB, 4), JOB, 4)
    assert store.objects == {}


def test_upload_failing_at_the_manifest_leaves_a_partial_step(store: MemoryStore, src: str) -> None:
    path = make_step(src, JOB, 4)
    with pytest.raises(CheckpointError, match="injected failure: put_bytes j/step-4/manifest.json"):
        upload_step(FaultyStore(store, put_bytes=[MANIFEST]), path, JOB, 4)
    assert step_keys(store, JOB, 4) == [bucket_key(JOB, 4, fragment_name(0)), bucket_key(JOB, 4, shard_name(0))]
    assert remote_steps(store, JOB) == ([], [4])  # data without a manifest: not complete in the bucket
    upload_step(store, path, JOB, 4)  # the retry completes it
    assert remote_steps(store, JOB) == ([4], [])


def test_an_upload_whose_step_is_replaced_midway_never_completes_in_the_bucket(store: MemoryStore, src: str) -> None:
    """A rolled-back run's step 4 takes the old step 4's place while the old one is being uploaded: the
    files sent may be of either, so no manifest goes up (the new step's own upload completes it)."""
    path = make_step(src, JOB, 4)

    class Swapping:
        def __init__(self) -> None:
            self.done = False

        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def put_file(self, rel: str, local: str, progress: Any = None) -> None:
            store.put_file(rel, local, progress)
            if not self.done:  # after the first file: the new step is renamed into place
                self.done = True
                os.rename(path, path + ".old")
                shutil.copytree(path + ".old", path)

    with pytest.raises(CheckpointError, match="was replaced by a new step 4 while it was uploaded"):
        upload_step(Swapping(), path, JOB, 4)  # type: ignore[arg-type]
    assert remote_steps(store, JOB) == ([], [4])  # data without a manifest: not a checkpoint
    upload_step(store, path, JOB, 4)
    assert remote_steps(store, JOB) == ([4], [])


# ---------------------------------------------------------------------------- multi-node: upload_ranks, try_complete


def test_upload_ranks_sends_this_nodes_shards_before_its_fragments(store: MemoryStore, src: str) -> None:
    for rank in (0, 1):  # this node serves ranks 0 and 1 of 3
        write_rank(src, JOB, 6, rank, 3, local_world_size=2)
    d = tmp_dir(src, JOB, 6)
    sent = upload_ranks(store, d, JOB, 6, [1, 0])
    order = [shard_name(0), shard_name(1), fragment_name(0), fragment_name(1)]
    assert [key for _, key in store.calls] == [bucket_key(JOB, 6, n) for n in order]
    assert sent == sum(os.path.getsize(os.path.join(d, n)) for n in order)
    assert remote_steps(store, JOB) == ([], [6])


def test_try_complete_writes_the_manifest_once_every_rank_is_there(store: MemoryStore, tmp_path: Path, dst: str) -> None:
    node_a, node_b = str(tmp_path / "a"), str(tmp_path / "b")
    for rank in (0, 1):
        write_rank(node_a, JOB, 6, rank, 3, local_world_size=2)
    write_rank(node_b, JOB, 6, 2, 3, local_world_size=1)
    upload_ranks(store, tmp_dir(node_a, JOB, 6), JOB, 6, [0, 1])
    assert try_complete(store, JOB, 6, 3) is False  # rank 2's fragment is not there yet
    assert not store.exists(bucket_key(JOB, 6, MANIFEST))
    upload_ranks(store, tmp_dir(node_b, JOB, 6), JOB, 6, [2])
    assert try_complete(store, JOB, 6, 3) is True
    manifest = json.loads(store.objects[bucket_key(JOB, 6, MANIFEST)])
    assert (manifest["job"], manifest["step"], manifest["world_size"]) == (JOB, 6, 3)
    assert sorted(manifest["files"]) == [shard_name(0), shard_name(1), shard_name(2)]
    assert remote_steps(store, JOB) == ([6], [])
    puts = sum(op == "put" for op, _ in store.calls)
    assert try_complete(store, JOB, 6, 3) is True  # already complete: nothing written again
    assert sum(op == "put" for op, _ in store.calls) == puts
    # the merged step is a whole, verifiable checkpoint: it comes back into a fresh root
    path = download_step(store, dst, JOB, 6)
    assert verify_checkpoint(path) == []
    assert read_manifest(path)["tensors"]["model/w"]["shape"] == [6, 3]


@pytest.mark.parametrize(
    ("rank1_offsets", "msg"),
    [
        ((0, 0), r"tensor 'model/w': chunks at offsets \[0, 0\] .* overlap"),
        ((4, 0), r"tensor 'model/w' of shape \[6, 3\]: chunks cover 12 of 18"),
    ],
    ids=["overlap", "gap"],
)
def test_try_complete_refuses_fragments_that_do_not_cover_the_tensors(
    store: MemoryStore, src: str, rank1_offsets: tuple[int, int], msg: str
) -> None:
    # a global [6, 3] tensor whose rows the two ranks' chunks do not cover exactly once
    write_rank(src, JOB, 6, 0, 2, [("model/w", torch.zeros(2, 3), (6, 3), (0, 0))], local_world_size=2)
    write_rank(src, JOB, 6, 1, 2, [("model/w", torch.ones(2, 3), (6, 3), rank1_offsets)], local_world_size=2)
    upload_ranks(store, tmp_dir(src, JOB, 6), JOB, 6, [0, 1])
    with pytest.raises(CheckpointError, match=msg):
        try_complete(store, JOB, 6, 2)
    assert not store.exists(bucket_key(JOB, 6, MANIFEST))
    assert remote_steps(store, JOB) == ([], [6])


def test_try_complete_refuses_replicas_that_differ(store: MemoryStore, tmp_path: Path) -> None:
    # both nodes hold model/emb replicated; rank 0 saves it, and each reports the digest of its copy
    cid = json.dumps(["model/emb", [0], [4]], separators=(",", ":"))
    node_a, node_b = str(tmp_path / "a"), str(tmp_path / "b")
    write_rank(node_a, JOB, 2, 0, 2, [("model/emb", torch.zeros(4), (4,), (0,))], local_world_size=1, replicas={cid: "00" * 8})
    write_rank(node_b, JOB, 2, 1, 2, [("model/x", torch.ones(2), (2,), (0,))], local_world_size=1, replicas={cid: "ff" * 8})
    upload_ranks(store, tmp_dir(node_a, JOB, 2), JOB, 2, [0])
    upload_ranks(store, tmp_dir(node_b, JOB, 2), JOB, 2, [1])
    with pytest.raises(CheckpointError, match=r"tensor 'model/emb' region offsets \[0\] sizes \[4\]: ranks 0 and 1 hold different bytes"):
        try_complete(store, JOB, 2, 2)
    assert not store.exists(bucket_key(JOB, 2, MANIFEST))


def test_try_complete_refuses_a_fragment_whose_shard_is_missing(store: MemoryStore, src: str) -> None:
    for rank in (0, 1):
        write_rank(src, JOB, 6, rank, 2, local_world_size=2)
    upload_ranks(store, tmp_dir(src, JOB, 6), JOB, 6, [0, 1])
    store.delete([bucket_key(JOB, 6, shard_name(1))])
    with pytest.raises(CheckpointError, match=r"step 6 of job j: rank 1's fragment is in the bucket but its shard is not"):
        try_complete(store, JOB, 6, 2)
    assert not store.exists(bucket_key(JOB, 6, MANIFEST))


def _frag(root: str, step: int, rank: int) -> dict[str, Any]:
    from ckptd.storage.local import read_fragment

    return read_fragment(root, JOB, step, rank)


@pytest.mark.parametrize("new_run", [22, 11], ids=["another-launch", "the-same-launch"])
def test_a_rollback_resave_across_nodes_replaces_the_bucket_step_once_complete_and_never_mixes_attempts(
    store: MemoryStore, tmp_path: Path, dst: str, new_run: int
) -> None:
    """Launch 11 completed step 6 over two nodes; then a launch (another, or 11 itself) restored step 2 and
    saves step 6 again. Its files go into its own attempt's folder, so the old step stays complete (and
    restorable, bitwise) until every node has uploaded the new attempt's ranks; then the new manifest takes
    its place, and the old attempt's fragments are never merged with the new ones."""
    old, new = (11, None), (new_run, 2)
    old_a, old_b, new_a, new_b = (str(tmp_path / n) for n in ("old_a", "old_b", "new_a", "new_b"))
    for root, ranks, (run, after), base, at in (
        (old_a, (0, 1), old, 6, 1_000), (old_b, (2,), old, 6, 1_001), (new_a, (0, 1), new, 106, 2_000), (new_b, (2,), new, 106, 2_001)
    ):  # fmt: skip
        for rank in ranks:
            write_rank(root, JOB, 6, rank, 3, rank_chunks(base, rank, 3), local_world_size=len(ranks), run=run, after=after, at=at)
    upload_ranks(store, tmp_dir(old_a, JOB, 6), JOB, 6, [0, 1], attempt=old)
    upload_ranks(store, tmp_dir(old_b, JOB, 6), JOB, 6, [2], attempt=old)
    assert try_complete(store, JOB, 6, 3, old) is True
    assert bucket_attempt(store, JOB, 6) == (True, old)
    assert check_replaces(store, JOB, 6, _frag(old_b, 6, 2)) is False  # its own attempt's step (an upload again)

    assert check_replaces(store, JOB, 6, _frag(new_a, 6, 0)) is True  # node a: the new attempt will replace it
    upload_ranks(store, tmp_dir(new_a, JOB, 6), JOB, 6, [0, 1], attempt=new)
    assert try_complete(store, JOB, 6, 3, new) is False  # rank 2 of the new attempt is not there yet
    assert bucket_attempt(store, JOB, 6) == (True, old)  # meanwhile the old step stays whole and restorable
    assert verify_checkpoint(download_step(store, str(tmp_path / "meanwhile"), JOB, 6)) == []
    upload_ranks(store, tmp_dir(new_b, JOB, 6), JOB, 6, [2], attempt=new)
    assert try_complete(store, JOB, 6, 3, new) is True
    assert bucket_attempt(store, JOB, 6) == (True, new)
    with pytest.raises(CheckpointError, match=r"saved by another attempt .* \(11, None\) \(restored no step, committed earlier\) does not"):
        try_complete(store, JOB, 6, 3, old)  # a node of the old attempt still waiting: the new step is not its completion
    assert bucket_attempt(store, JOB, 6) == (True, new)
    path = download_step(store, dst, JOB, 6)
    assert verify_checkpoint(path) == []
    from safetensors.torch import load_file

    got = torch.cat([load_file(os.path.join(path, shard_name(r)))["model/w"] for r in range(3)])
    assert torch.equal(got, torch.cat([rank_chunks(106, r, 3)[0][1] for r in range(3)]))  # every row is the new attempt's


@pytest.mark.parametrize(
    ("after", "at", "why"),
    [
        (None, 5_000, r"restored no step, committed later"),
        (6, 5_000, r"restored step 6, committed later"),
        (2, 500, r"restored step 2, committed earlier"),
    ],
    ids=["restored-nothing", "restored-this-step", "a-dead-attempt-uploaded-late"],
)
def test_a_complete_bucket_step_is_replaced_only_by_a_newer_rollback_attempt(
    store: MemoryStore, tmp_path: Path, after: int | None, at: int, why: str
) -> None:
    """A relaunch that restored nothing (on a node whose daemon forgot the step), or the part of a dead
    attempt found on a node's disk after a restart, must not delete the bucket's complete step 6."""
    old, other = str(tmp_path / "old"), str(tmp_path / "other")
    write_rank(old, JOB, 6, 0, 2, local_world_size=2, run=11, at=1_000)
    write_rank(old, JOB, 6, 1, 2, local_world_size=2, run=11, at=1_000)
    upload_ranks(store, tmp_dir(old, JOB, 6), JOB, 6, [0, 1], attempt=(11, None))
    assert try_complete(store, JOB, 6, 2, (11, None)) is True
    write_rank(other, JOB, 6, 0, 2, local_world_size=1, run=22, after=after, at=at)
    with pytest.raises(CheckpointError, match=rf"step 6 of job j is complete in the bucket, .*\(22, {after}\) \({why}\) does not replace"):
        check_replaces(store, JOB, 6, _frag(other, 6, 0))
    assert bucket_attempt(store, JOB, 6) == (True, (11, None))


def test_a_dead_attempts_part_uploaded_late_never_overwrites_the_new_complete_step(store: MemoryStore, tmp_path: Path, dst: str) -> None:
    """Launch 11 (which restored nothing) saved step 6 on two nodes and died: node a's daemon had checked the
    bucket (no step 6 yet) and was still uploading its part. The relaunch, 22, restored step 2, saved step 6
    again and completed it in the bucket. Then node a's late upload lands. Both attempts used the same object
    names once, and the late shard replaced the new step's: every restore failed its checksums. In the
    attempt's own folder it touches nothing of the new step, and the dead attempt can never complete it."""
    dead, new = (11, None), (22, 2)
    dead_a, new_a, new_b = (str(tmp_path / n) for n in ("dead_a", "new_a", "new_b"))
    for rank in (0, 1):
        write_rank(dead_a, JOB, 6, rank, 3, rank_chunks(6, rank, 3), local_world_size=2, run=11, at=1_000)
        write_rank(new_a, JOB, 6, rank, 3, rank_chunks(106, rank, 3), local_world_size=2, run=22, after=2, at=2_000)
    write_rank(new_b, JOB, 6, 2, 3, rank_chunks(106, 2, 3), local_world_size=1, run=22, after=2, at=2_001)
    assert check_replaces(store, JOB, 6, _frag(dead_a, 6, 0)) is False  # the dead attempt's node: nothing there yet
    upload_ranks(store, tmp_dir(new_a, JOB, 6), JOB, 6, [0, 1], attempt=new)
    upload_ranks(store, tmp_dir(new_b, JOB, 6), JOB, 6, [2], attempt=new)
    assert try_complete(store, JOB, 6, 3, new) is True
    new_objects = {k: v for k, v in store.objects.items() if k != bucket_key(JOB, 6, MANIFEST)}

    upload_ranks(store, tmp_dir(dead_a, JOB, 6), JOB, 6, [0, 1], attempt=dead)  # the late upload
    assert {k: store.objects[k] for k in new_objects} == new_objects  # not one byte of the new step changed
    assert try_complete(store, JOB, 6, 3, dead) is False  # its rank 2 never comes: node b's upload is refused now
    with pytest.raises(CheckpointError, match=r"\(11, None\) \(restored no step, committed earlier\) does not replace"):
        check_replaces(store, JOB, 6, _frag(dead_a, 6, 0))
    assert bucket_attempt(store, JOB, 6) == (True, new)
    path = download_step(store, dst, JOB, 6)
    assert verify_checkpoint(path) == []
    from safetensors.torch import load_file

    got = torch.cat([load_file(os.path.join(path, shard_name(r)))["model/w"] for r in range(3)])
    assert torch.equal(got, torch.cat([rank_chunks(106, r, 3)[0][1] for r in range(3)]))


def test_a_multinode_steps_objects_lie_in_its_attempts_folder(store: MemoryStore, tmp_path: Path) -> None:
    for rank in (0, 1):
        write_rank(str(tmp_path), JOB, 6, rank, 2, local_world_size=2, run=7, after=3, at=10)
    upload_ranks(store, tmp_dir(str(tmp_path), JOB, 6), JOB, 6, [0, 1], attempt=(7, 3))
    assert try_complete(store, JOB, 6, 2, (7, 3)) is True
    folder = f"{JOB}/step-6/run-7-after-3/"
    assert sorted(store.objects) == [bucket_key(JOB, 6, MANIFEST)] + sorted(
        folder + n for n in [*map(shard_name, (0, 1)), *map(fragment_name, (0, 1))]
    )
    manifest = json.loads(store.objects[bucket_key(JOB, 6, MANIFEST)])
    assert (manifest["run"], manifest["after"], manifest["attempt_objects"]) == (7, 3, True)
    assert sorted(manifest["files"]) == [shard_name(0), shard_name(1)]  # the names a local step's files have


@pytest.mark.parametrize(
    ("change", "msg"),
    [
        ({"attempt_objects": "../../other-job/step-6/run-7-after-3/"}, r"attempt_objects is '\.\./"),
        ({"attempt_objects": 1}, r"attempt_objects is 1: only true"),
        ({"attempt_objects": True, "run": None}, r"run"),
    ],
    ids=["a-path", "not-true", "no-run"],
)
def test_a_manifest_pointing_its_files_elsewhere_is_refused(
    store: MemoryStore, tmp_path: Path, dst: str, change: dict[str, Any], msg: str
) -> None:
    """Whoever can write the bucket's manifest (another node, a bad actor) chooses only whether the files lie
    in the folder its run and step name, never a path of its own."""
    for rank in (0, 1):
        write_rank(str(tmp_path), JOB, 6, rank, 2, local_world_size=2, run=7, after=3, at=10)
    upload_ranks(store, tmp_dir(str(tmp_path), JOB, 6), JOB, 6, [0, 1], attempt=(7, 3))
    assert try_complete(store, JOB, 6, 2, (7, 3)) is True
    manifest = json.loads(store.objects[bucket_key(JOB, 6, MANIFEST)])
    manifest.update(change)
    if manifest["run"] is None:
        del manifest["run"]
    store.objects[bucket_key(JOB, 6, MANIFEST)] = encode_manifest(manifest)
    with pytest.raises(FormatError, match=msg):
        download_step(store, dst, JOB, 6)
    assert_nothing_left(dst, JOB, 6)


def test_try_complete_refuses_a_fragment_in_another_attempts_folder(store: MemoryStore, tmp_path: Path) -> None:
    """A fragment copied into attempt (7, 3)'s folder but naming attempt (8, 3) is never merged as (7, 3)'s."""
    for rank in (0, 1):
        write_rank(str(tmp_path), JOB, 6, rank, 2, local_world_size=2, run=8 if rank else 7, after=3, at=10)
    upload_ranks(store, tmp_dir(str(tmp_path), JOB, 6), JOB, 6, [0, 1], attempt=(7, 3))
    with pytest.raises(CheckpointError, match=r"run-7-after-3/rank-00001.json names attempt \(8, 3\), not its folder's \(7, 3\)"):
        try_complete(store, JOB, 6, 2, (7, 3))
    assert not store.exists(bucket_key(JOB, 6, MANIFEST))


def test_fragments_of_two_attempts_are_never_merged_into_one_manifest(tmp_path: Path) -> None:
    root = str(tmp_path)
    write_rank(root, JOB, 6, 0, 2, run=11)
    write_rank(root, JOB, 6, 1, 2, run=11, after=2)  # the same launch after a rollback: another attempt
    with pytest.raises(CheckpointError, match=r"step 6 of job j: its fragments come from different attempts .*\(11, 2\)"):
        finalize_step(root, JOB, 6, 2)
    write_rank(root, JOB, 7, 0, 2, run=11)
    write_rank(root, JOB, 7, 1, 2)  # a fragment that names no launch (an older ckptd): not a conflict
    assert "run" not in read_manifest(finalize_step(root, JOB, 7, 2))


@pytest.mark.parametrize(("field", "value"), [("run", v) for v in (0, -1, "11", True, 1 << 63, 1.5)] + [("after", v) for v in (-1, "2")])
def test_a_fragment_naming_an_attempt_that_is_not_one_is_refused(tmp_path: Path, field: str, value: object) -> None:
    from ckptd.validate import parse_fragment

    write_rank(str(tmp_path), JOB, 6, 0, 1, run=5, after=2)
    frag = _frag(str(tmp_path), 6, 0)
    assert (frag["run"], frag["after"]) == (5, 2)
    frag[field] = value
    with pytest.raises(FormatError, match=field):
        parse_fragment(json.dumps(frag).encode(), "rank-00000.json")


def test_try_complete_refuses_a_fragment_of_another_world_size(store: MemoryStore, tmp_path: Path) -> None:
    node_a, node_b = str(tmp_path / "a"), str(tmp_path / "b")
    write_rank(node_a, JOB, 6, 0, 2, local_world_size=1)
    write_rank(node_b, JOB, 6, 1, 3, local_world_size=1)  # a node still configured for an older run
    upload_ranks(store, tmp_dir(node_a, JOB, 6), JOB, 6, [0])
    upload_ranks(store, tmp_dir(node_b, JOB, 6), JOB, 6, [1])
    with pytest.raises(CheckpointError, match=r"fragment of rank 1 belongs to another job/step/world size"):
        try_complete(store, JOB, 6, 2)
    assert not store.exists(bucket_key(JOB, 6, MANIFEST))


# ---------------------------------------------------------------------------- remote_steps


def test_remote_steps_splits_complete_from_partial_and_ignores_other_keys(store: MemoryStore, src: str) -> None:
    for step in (2, 10):
        uploaded(store, src, JOB, step)
    with pytest.raises(CheckpointError):  # an upload that died before its manifest
        upload_step(FaultyStore(store, put_bytes=[MANIFEST]), make_step(src, JOB, 3), JOB, 3)
    uploaded(store, src, "jx", 7)  # another job whose name starts the same
    for key in ("j/latest", "j/step-x/manifest.json", "j/notes/step-4/manifest.json", "jmanifest.json"):
        store.put_bytes(key, b"{}")
    assert remote_steps(store, JOB) == ([2, 10], [3])  # numeric order, not string order
    assert remote_steps(store, "jx") == ([7], [])
    assert remote_steps(store, "none") == ([], [])


# ---------------------------------------------------------------------------- download_step


def test_download_step_brings_a_step_back_verified(store: MemoryStore, src: str, dst: str) -> None:
    original = uploaded(store, src, JOB, 3, world_size=2)
    moved: list[int] = []
    path = download_step(store, dst, JOB, 3, moved.append)
    assert path == step_dir(dst, JOB, 3) and is_complete(path)
    names = sorted(os.listdir(original))
    got = sorted(os.listdir(path))
    # the files the manifest lists, and the manifest: fragments are not needed once a step is complete;
    # the empty marker says the step came from the bucket (a restarted daemon never uploads it)
    assert got == sorted([shard_name(0), shard_name(1), MANIFEST, FETCHED])
    assert Path(path, FETCHED).read_bytes() == b""
    got.remove(FETCHED)
    for name in got:
        assert name in names and Path(path, name).read_bytes() == Path(original, name).read_bytes()
    assert sum(moved) == sum(os.path.getsize(os.path.join(path, n)) for n in got if n != MANIFEST)
    assert verify_checkpoint(path) == []
    assert read_latest(dst, JOB) == 3
    assert sorted(os.listdir(job_dir(dst, JOB))) == ["latest", "step-3"]


def test_download_step_of_a_step_complete_locally_reads_only_the_manifest(store: MemoryStore, src: str) -> None:
    """Its commit time tells whether the bucket's step replaced the local copy; no shard is read."""
    path = uploaded(store, src, JOB, 3)
    store.calls.clear()
    assert download_step(store, src, JOB, 3) == path
    assert store.calls == [("get", bucket_key(JOB, 3, MANIFEST))]


def test_download_step_replaces_a_stale_fetch_directory(store: MemoryStore, src: str, dst: str) -> None:
    uploaded(store, src, JOB, 3)
    stale = fetch_dir(dst, JOB, 3)
    os.makedirs(stale)
    Path(stale, shard_name(0)).write_bytes(b"half a download from a daemon that died")
    Path(stale, "junk").write_bytes(b"x")
    path = download_step(store, dst, JOB, 3)
    assert not os.path.exists(stale)
    assert sorted(os.listdir(path)) == [FETCHED, MANIFEST, shard_name(0)]
    assert verify_checkpoint(path) == []


def test_download_step_never_moves_latest_back(store: MemoryStore, src: str, dst: str) -> None:
    uploaded(store, src, JOB, 4)
    make_step(dst, JOB, 9)
    assert read_latest(dst, JOB) == 9
    download_step(store, dst, JOB, 4)
    assert read_latest(dst, JOB) == 9
    assert is_complete(step_dir(dst, JOB, 4))


def _flip(store: MemoryStore, key: str, pos: int) -> None:
    data = bytearray(store.objects[key])
    data[pos] ^= 0xFF
    store.objects[key] = bytes(data)


def _set_manifest(store: MemoryStore, job: str, step: int, manifest: dict) -> None:
    store.objects[bucket_key(job, step, MANIFEST)] = encode_manifest(manifest)


def test_download_step_rejects_a_corrupt_object_and_leaves_nothing(store: MemoryStore, src: str, dst: str) -> None:
    original = uploaded(store, src, JOB, 3)
    make_step(dst, JOB, 1)  # an older local step: it stays the newest after the failed fetch
    (begin, _end) = read_manifest(original)["tensors"]["model/w"]["chunks"][0]["byte_range"]
    _flip(store, bucket_key(JOB, 3, shard_name(0)), begin + 1)
    url = re.escape(store.url(bucket_key(JOB, 3, shard_name(0))))
    with pytest.raises(FormatError, match=rf"step 3 of job j in the bucket is corrupt: {url}: checksum mismatch in tensor 'model/w'"):
        download_step(store, dst, JOB, 3)
    assert_nothing_left(dst, JOB, 3, latest=1)
    assert sorted(os.listdir(job_dir(dst, JOB))) == ["latest", "step-1"]


def test_download_step_rejects_a_corrupt_shard_header(store: MemoryStore, src: str, dst: str) -> None:
    uploaded(store, src, JOB, 3)
    key = bucket_key(JOB, 3, shard_name(0))
    data = store.objects[key]
    assert data.count(b'"F32"') == 1
    store.objects[key] = data.replace(b'"F32"', b'"I32"')  # same size, still parses: only the header checksum can tell
    url = re.escape(store.url(key))
    with pytest.raises(FormatError, match=rf"step 3 of job j in the bucket is corrupt: {url}: header checksum mismatch"):
        download_step(store, dst, JOB, 3)
    assert_nothing_left(dst, JOB, 3)


@pytest.mark.parametrize("change", [b"\0", b""], ids=["longer", "shorter"])
def test_download_step_rejects_an_object_of_the_wrong_size(store: MemoryStore, src: str, dst: str, change: bytes) -> None:
    path = uploaded(store, src, JOB, 3, world_size=2)
    key = bucket_key(JOB, 3, shard_name(1))
    size = os.path.getsize(os.path.join(path, shard_name(1)))
    store.objects[key] = store.objects[key] + change if change else store.objects[key][:-1]
    url = re.escape(store.url(key))
    # a longer object is stopped as it arrives (no more than the manifest's size is written), a shorter one checked after
    want = rf"^{url} is larger than the {size} bytes expected" if change else rf"^{url} is {size - 1} bytes, the manifest says {size}$"
    with pytest.raises(FormatError, match=want):
        download_step(store, dst, JOB, 3)
    assert_nothing_left(dst, JOB, 3)


@pytest.mark.parametrize("name", ["../escape.safetensors", "sub/rank-00000.safetensors", "/etc/passwd", "..", "."])
def test_download_step_refuses_a_manifest_naming_a_file_outside_the_step(store: MemoryStore, src: str, dst: str, name: str) -> None:
    original = uploaded(store, src, JOB, 3)
    manifest = read_manifest(original)
    manifest["files"][name] = dict(manifest["files"][shard_name(0)])
    _set_manifest(store, JOB, 3, manifest)
    if name.startswith("sub/"):  # an object the store would hand out: only the check stops it
        store.put_bytes(bucket_key(JOB, 3, name), store.objects[bucket_key(JOB, 3, shard_name(0))])
    with pytest.raises(FormatError, match=rf"manifest\.json names a file outside the step: {re.escape(repr(name))}"):
        download_step(store, dst, JOB, 3)
    assert ("get", bucket_key(JOB, 3, name)) not in store.calls
    assert_nothing_left(dst, JOB, 3)
    assert sorted(p.name for p in Path(dst).rglob("*")) == [JOB]  # nothing written beside or above the step either


def test_download_step_refuses_a_manifest_naming_the_downloaded_marker(store: MemoryStore, src: str, dst: str) -> None:
    """A manifest listing ``.fetched`` as a data file would make its step look downloaded (never uploaded again)."""
    original = uploaded(store, src, JOB, 3)
    manifest = read_manifest(original)
    manifest["files"][FETCHED] = dict(manifest["files"][shard_name(0)])
    _set_manifest(store, JOB, 3, manifest)
    with pytest.raises(FormatError, match=r"manifest\.json lists a file named '\.fetched'"):
        download_step(store, dst, JOB, 3)
    assert_nothing_left(dst, JOB, 3)


@pytest.mark.parametrize(("job", "step"), [("other", 3), (JOB, 2)], ids=["another-job", "another-step"])
def test_download_step_refuses_a_manifest_of_another_job_or_step(store: MemoryStore, src: str, dst: str, job: str, step: int) -> None:
    # a copy of another step's objects (a bad sync between prefixes) under step 3 of job j
    uploaded(store, src, job, step)
    for key in step_keys(store, job, step):
        store.put_bytes(bucket_key(JOB, 3, key.rsplit("/", 1)[1]), store.objects[key])
    url = re.escape(store.url(bucket_key(JOB, 3, MANIFEST)))
    with pytest.raises(FormatError, match=rf"^{url} describes job {job} step {step}$"):
        download_step(store, dst, JOB, 3)
    assert_nothing_left(dst, JOB, 3)


@pytest.mark.parametrize(
    ("raw", "msg"),
    [
        (b'{"kind": "ckptd-manif', "is not valid JSON"),
        (b"\x80abc", "is not valid JSON"),
        (b'{"kind": "ckptd-fragment"}', "is not a ckptd manifest"),
    ],
    ids=["truncated", "not-utf8", "a-fragment"],
)
def test_download_step_refuses_a_manifest_that_is_not_one(store: MemoryStore, src: str, dst: str, raw: bytes, msg: str) -> None:
    uploaded(store, src, JOB, 3)
    store.objects[bucket_key(JOB, 3, MANIFEST)] = raw
    with pytest.raises(FormatError, match=msg):
        download_step(store, dst, JOB, 3)
    assert_nothing_left(dst, JOB, 3)


def test_download_step_of_a_missing_object_fails_and_leaves_nothing(store: MemoryStore, src: str, dst: str) -> None:
    uploaded(store, src, JOB, 3, world_size=2)
    store.delete([bucket_key(JOB, 3, shard_name(1))])  # the manifest still names it
    with pytest.raises(FileNotFoundError, match=re.escape(store.url(bucket_key(JOB, 3, shard_name(1))))):
        download_step(store, dst, JOB, 3)
    assert_nothing_left(dst, JOB, 3)


def test_download_step_of_a_step_that_is_not_in_the_bucket_leaves_nothing(store: MemoryStore, src: str, dst: str) -> None:
    with pytest.raises(CheckpointError):
        upload_step(FaultyStore(store, put_bytes=[MANIFEST]), make_step(src, JOB, 3), JOB, 3)
    with pytest.raises(FileNotFoundError, match=re.escape(store.url(bucket_key(JOB, 3, MANIFEST)))):
        download_step(store, dst, JOB, 3)  # a partial upload: data, no manifest
    assert_nothing_left(dst, JOB, 3)


# ---------------------------------------------------------------------------- apply_remote_retention


def test_remote_retention_keeps_what_the_policies_keep(store: MemoryStore, src: str) -> None:
    for step in range(1, 8):
        uploaded(store, src, JOB, step)
    kept_before = {s: {k: store.objects[k] for k in step_keys(store, JOB, s)} for s in (3, 6, 7)}
    store.calls.clear()
    removed = apply_remote_retention(store, JOB, AnyOf((KeepLatest(2), KeepEvery(3))))
    assert removed == [1, 2, 4, 5]
    assert remote_steps(store, JOB) == ([3, 6, 7], [])
    for s in removed:
        assert step_keys(store, JOB, s) == []
    for s, objects in kept_before.items():  # the kept steps are untouched
        assert {k: store.objects[k] for k in step_keys(store, JOB, s)} == objects
    # each removed step loses its manifest before its data: a half-removed step never looks complete
    for s in removed:
        deletes = [k for op, k in store.calls if op == "delete" and k.startswith(bucket_prefix(JOB, s))]
        assert deletes[0] == bucket_key(JOB, s, MANIFEST) and len(deletes) == 3


def test_remote_retention_protects_named_steps(store: MemoryStore, src: str) -> None:
    for step in (1, 2, 3):
        uploaded(store, src, JOB, step)
    assert apply_remote_retention(store, JOB, AnyOf((KeepLatest(1), Protect(frozenset({1}))))) == [2]
    assert remote_steps(store, JOB) == ([1, 3], [])
    assert apply_remote_retention(store, JOB, KeepLatest(0)) == []  # 0: keep every step
    assert remote_steps(store, JOB) == ([1, 3], [])


def test_remote_retention_removes_stale_partial_uploads_but_not_busy_or_newer_ones(store: MemoryStore, src: str) -> None:
    faulty = FaultyStore(store, put_bytes=[MANIFEST])
    for step in (1, 3, 4, 7):  # uploads that died before their manifest
        with pytest.raises(CheckpointError):
            upload_step(faulty, make_step(src, JOB, step), JOB, step)
    for step in (2, 5):
        uploaded(store, src, JOB, step)
    assert remote_steps(store, JOB) == ([2, 5], [1, 3, 4, 7])
    # 3 is still being uploaded (busy); 7 is newer than the newest complete step: it may still complete
    assert apply_remote_retention(store, JOB, KeepLatest(0), busy={3}) == [1, 4]
    assert remote_steps(store, JOB) == ([2, 5], [3, 7])
    assert apply_remote_retention(store, JOB, KeepLatest(1)) == [2, 3]
    assert remote_steps(store, JOB) == ([5], [7])


def test_remote_retention_of_a_multinode_job_removes_the_partial_steps_it_is_told_are_settled(store: MemoryStore, src: str) -> None:
    """Another node may be uploading any partial step of a multi-node job, even one numbered below the latest
    (a rolled-back line's): only those ``settled`` names go, whatever their number."""
    faulty = FaultyStore(store, put_bytes=[MANIFEST])
    for step in (1, 3, 7):
        with pytest.raises(CheckpointError):
            upload_step(faulty, make_step(src, JOB, step), JOB, step)
    uploaded(store, src, JOB, 5)
    asked: list[int] = []

    def settled(step: int, keys: frozenset[tuple[str, str]]) -> bool:
        assert {k for k, _ in keys} == set(step_keys(store, JOB, step))  # every object of the partial step, with its tag
        asked.append(step)
        return step in (3, 7)

    assert apply_remote_retention(store, JOB, KeepLatest(0), busy={7}, settled=settled) == [3]
    assert asked == [1, 3] and remote_steps(store, JOB) == ([5], [1, 7])


def test_remote_retention_without_a_complete_step_keeps_every_partial_upload(store: MemoryStore, src: str) -> None:
    faulty = FaultyStore(store, put_bytes=[MANIFEST])
    for step in (1, 2):
        with pytest.raises(CheckpointError):
            upload_step(faulty, make_step(src, JOB, step), JOB, step)
    assert apply_remote_retention(store, JOB, KeepLatest(1)) == []
    assert remote_steps(store, JOB) == ([], [1, 2])


def test_remote_retention_touches_only_its_job(store: MemoryStore, src: str) -> None:
    for step in (1, 2):
        uploaded(store, src, JOB, step)
        uploaded(store, src, "jx", step)
    assert apply_remote_retention(store, JOB, KeepLatest(1)) == [1]
    assert remote_steps(store, JOB) == ([2], [])
    assert remote_steps(store, "jx") == ([1, 2], [])


# ---------------------------------------------------------------------------- commit order in the bucket


def _manifest_at(store: MemoryStore, step: int, at: int) -> None:
    """A real (empty) manifest of ``step`` committed at ``at``: a document that is not one makes no step complete."""
    doc = {"kind": "ckptd-manifest", "job": JOB, "step": step, "world_size": 1, "committed_at": at, "files": {}, "tensors": {}, "ranks": []}
    store.put_bytes(f"{JOB}/step-{step}/manifest.json", encode_manifest(doc))


@pytest.mark.parametrize("deleted_first", [True, False])
def test_a_step_number_saved_again_by_other_nodes_is_ordered_by_its_new_commit(deleted_first: bool) -> None:
    """After a rollback a step number is saved again, by other nodes' daemons: this process (a daemon that
    only restores the job, or one of another node) was never told, yet its order must follow the new
    manifest, not its cached time of the old one (its `latest` would name the wrong step, its retention
    would delete the step just uploaded). Deleted by retention in between, or replaced in place."""
    from ckptd.storage.remote import bucket_steps_by_commit

    store = MemoryStore()
    for at, step in enumerate((100, 200, 300, 110)):
        _manifest_at(store, step, at)
    assert bucket_steps_by_commit(store, JOB)[0] == [100, 200, 300, 110]
    if deleted_first:
        assert apply_remote_retention(store, JOB, KeepLatest(2)) == [100, 200]
        assert bucket_steps_by_commit(store, JOB)[0] == [300, 110]
    _manifest_at(store, 200, 9)  # 200 saved again on the new line, its manifest written by another node
    assert bucket_steps_by_commit(store, JOB)[0] == ([300, 110, 200] if deleted_first else [100, 300, 110, 200])
    assert apply_remote_retention(store, JOB, KeepLatest(2)) == ([300] if deleted_first else [100, 300])


def test_a_manifest_deleted_by_another_node_meanwhile_is_no_error() -> None:
    """Every node of a multi-node job runs bucket retention: a step listed a moment ago may be gone."""
    from ckptd.storage.remote import bucket_steps_by_commit

    store = MemoryStore()
    for step in (1, 2):
        _manifest_at(store, step, step)
    real = store.get_bytes

    def vanished(rel: str, limit: int | None = None) -> bytes:
        if rel == f"{JOB}/step-1/manifest.json":
            raise FileNotFoundError(rel)
        return real(rel, limit)

    store.get_bytes = vanished  # type: ignore[method-assign]
    assert bucket_steps_by_commit(store, JOB)[0] == [2]


def _attempt_step(root: str, step: int, run: int, after: int | None, at: int) -> str:
    write_rank(root, JOB, step, 0, 1, run=run, after=after, at=at)
    return finalize_step(root, JOB, step, 1)


def test_a_fresh_run_never_overwrites_the_buckets_step_of_that_number(store: MemoryStore, tmp_path: Path) -> None:
    """A replaced node, or the same command run again (the same default job name), restores nothing and saves
    step 100, which the bucket holds from the first run: the upload is refused, saying why, and the bucket
    keeps the first run's step (the local root and a multi-node upload refuse it too). A run that restored
    an earlier step replaces it."""
    upload_step(store, _attempt_step(str(tmp_path / "a"), 100, run=11, after=None, at=10), JOB, 100)
    with pytest.raises(CheckpointError, match="does not replace it"):
        upload_step(store, _attempt_step(str(tmp_path / "b"), 100, run=22, after=None, at=20), JOB, 100)
    assert bucket_attempt(store, JOB, 100) == (True, (11, None))
    upload_step(store, _attempt_step(str(tmp_path / "c"), 100, run=33, after=50, at=30), JOB, 100)
    assert bucket_attempt(store, JOB, 100) == (True, (33, 50))


def test_a_local_copy_of_a_step_the_bucket_replaced_is_never_restored(store: MemoryStore, tmp_path: Path) -> None:
    """A node holds a copy of step 6 (downloaded, or its own part's) when other nodes roll back and save step 6
    again: the bucket's step 6 is the new line's. Asked for the latest or for step 6, the catalog names the
    bucket's, and the download replaces the stale copy (it used to be restored, silently, as it was)."""
    from ckptd.daemon.catalog import StepCatalog
    from ckptd.protocol import Source
    from ckptd.storage.local import committed_at

    here = str(tmp_path / "here")
    old = _attempt_step(here, 6, run=11, after=None, at=10)
    upload_step(store, old, JOB, 6)
    new = _attempt_step(str(tmp_path / "there"), 6, run=22, after=2, at=20)
    upload_step(store, new, JOB, 6)  # the rollback re-save replaces the bucket's step 6
    cat = StepCatalog(here, store)
    assert cat.latest_anywhere(JOB).source is Source.BUCKET
    assert cat.find(JOB, 6).source is Source.BUCKET
    path = download_step(store, here, JOB, 6)
    assert committed_at(path) == 20 and read_manifest(path)["run"] == 22
    assert cat.find(JOB, 6) == cat.latest_anywhere(JOB) and cat.find(JOB, 6).source is Source.DISK
    assert sorted(os.listdir(job_dir(here, JOB))) == ["latest", "step-6"]


def test_upload_step_hides_an_older_step_of_the_same_number_first(store: MemoryStore, src: str) -> None:
    _manifest_at(store, 4, 1)  # an older step 4 (abandoned branch) still in the bucket
    path = make_step(src, JOB, 4, world_size=2)
    store.calls.clear()
    upload_step(store, path, JOB, 4)
    assert store.calls[0] == ("delete", bucket_key(JOB, 4, MANIFEST))  # never complete while its files are replaced
    assert store.objects[bucket_key(JOB, 4, MANIFEST)] == Path(path, MANIFEST).read_bytes()


# ---------------------------------------------------------------------------- older steps and races between nodes


def _older_multinode_step6(store: MemoryStore, root: str) -> None:
    """Step 6 completed across nodes by a ckptd that named no attempts: files and manifest directly under the step."""
    for rank in (0, 1):
        write_rank(root, JOB, 6, rank, 2, rank_chunks(6, rank, 2), local_world_size=2, at=1_000)
    upload_ranks(store, tmp_dir(root, JOB, 6), JOB, 6, [0, 1])
    assert try_complete(store, JOB, 6, 2, None) is True
    assert bucket_attempt(store, JOB, 6) == (True, None)


def test_a_rollback_resave_over_an_older_ckptds_multinode_step_replaces_it_and_retention_keeps_it(tmp_path: Path, dst: str) -> None:
    """A manifest naming no attempt is another attempt's, not this one's completion: the rollback's nodes must
    not report step 6 uploaded while the bucket still holds the abandoned line's, and retention must not then
    take the re-save's folder for another attempt's leftovers."""
    store = MemoryStore()
    _older_multinode_step6(store, str(tmp_path / "old"))
    new_root, new = str(tmp_path / "new"), (22, 2)
    for rank in (0, 1):
        write_rank(new_root, JOB, 6, rank, 2, rank_chunks(106, rank, 2), local_world_size=2, run=22, after=2, at=2_000)
    assert check_replaces(store, JOB, 6, _frag(new_root, 6, 0)) is True
    upload_ranks(store, tmp_dir(new_root, JOB, 6), JOB, 6, [0, 1], attempt=new)
    assert try_complete(store, JOB, 6, 2, new) is True
    assert bucket_attempt(store, JOB, 6) == (True, new)
    apply_remote_retention(store, JOB, KeepLatest(5), settled=lambda s, k: True)  # commit_timeout later
    assert all("/run-22-after-2/" in k for k in step_keys(store, JOB, 6) if not k.endswith(MANIFEST))
    path = download_step(store, dst, JOB, 6)
    assert verify_checkpoint(path) == [] and read_manifest(path)["run"] == 22


def test_a_fresh_run_never_replaces_an_older_ckptds_step_in_the_bucket(store: MemoryStore, tmp_path: Path) -> None:
    """One node: the bucket's step 6 names no attempt (an older ckptd's). A run that restored nothing (a
    replaced node) saving step 6 again is refused before it sends a byte; a rollback takes the old manifest
    down first, so an upload failing midway leaves the step missing, never complete over mixed shards."""
    old = str(tmp_path / "old")
    for rank in (0, 1):
        write_rank(old, JOB, 6, rank, 2, rank_chunks(6, rank, 2), at=1_000)
    upload_step(store, finalize_step(old, JOB, 6, 2), JOB, 6)
    before = dict(store.objects)
    fresh, rollback = str(tmp_path / "fresh"), str(tmp_path / "rollback")
    for rank in (0, 1):
        write_rank(fresh, JOB, 6, rank, 2, rank_chunks(106, rank, 2), run=33, after=None, at=2_000)
        write_rank(rollback, JOB, 6, rank, 2, rank_chunks(206, rank, 2), run=44, after=2, at=3_000)
    with pytest.raises(CheckpointError, match=r"restored no step, committed later\) does not replace it"):
        upload_step(store, finalize_step(fresh, JOB, 6, 2), JOB, 6)
    assert store.objects == before
    with pytest.raises(CheckpointError, match=r"injected"):
        upload_step(FaultyStore(store, put_file=[1]), finalize_step(rollback, JOB, 6, 2), JOB, 6)
    assert remote_steps(store, JOB) == ([], [6])


def test_a_dead_attempt_completing_late_never_overwrites_the_manifest_a_rollback_wrote_meanwhile(tmp_path: Path) -> None:
    """The dead attempt's late node lists step 6 (no manifest) and reads its fragments; meanwhile another node
    completes the rollback attempt. The dead attempt's manifest must not land over it unseen (a conditional
    write), or retention would later delete the rollback's folder as another attempt's."""
    store = MemoryStore()
    dead, new = (11, None), (22, 2)
    dead_r, new_r = str(tmp_path / "dead"), str(tmp_path / "new")
    for rank in (0, 1):
        write_rank(dead_r, JOB, 6, rank, 2, rank_chunks(6, rank, 2), local_world_size=2, run=11, at=1_000)
        write_rank(new_r, JOB, 6, rank, 2, rank_chunks(106, rank, 2), local_world_size=2, run=22, after=2, at=2_000)
    upload_ranks(store, tmp_dir(dead_r, JOB, 6), JOB, 6, [0, 1], attempt=dead)
    upload_ranks(store, tmp_dir(new_r, JOB, 6), JOB, 6, [0, 1], attempt=new)
    real, fired = store.get_bytes, [False]

    def get_bytes(rel: str, limit: int | None = None) -> bytes:
        if rel.endswith("run-11-after-none/rank-00000.json") and not fired[0]:
            fired[0] = True
            assert try_complete(store, JOB, 6, 2, new) is True  # another node completes the rollback meanwhile
        return real(rel, limit)

    store.get_bytes = get_bytes  # type: ignore[method-assign]
    assert try_complete(store, JOB, 6, 2, dead) is False  # lost the race: it looks again at its next poll
    store.get_bytes = real  # type: ignore[method-assign]
    assert fired[0] and bucket_attempt(store, JOB, 6) == (True, new)
    with pytest.raises(CheckpointError, match=r"\(11, None\) \(restored no step, committed earlier\) does not replace"):
        try_complete(store, JOB, 6, 2, dead)  # its next poll: the rollback's step is not its to replace
    apply_remote_retention(store, JOB, KeepLatest(5), settled=lambda s, k: True)
    assert bucket_attempt(store, JOB, 6) == (True, new)
    assert not any("/run-11-after-none/" in k for k in store.objects)


def test_retention_never_drops_a_step_whose_manifest_a_rollback_replaced_after_the_listing(tmp_path: Path) -> None:
    store = MemoryStore()
    a, new = (11, None), (22, 2)
    ra, rn = str(tmp_path / "a"), str(tmp_path / "n")
    for step in (6, 7):
        for rank in (0, 1):
            write_rank(ra, JOB, step, rank, 2, rank_chunks(step, rank, 2), local_world_size=2, run=11, at=1_000 + step)
        upload_ranks(store, tmp_dir(ra, JOB, step), JOB, step, [0, 1], attempt=a)
        assert try_complete(store, JOB, step, 2, a)
    for rank in (0, 1):
        write_rank(rn, JOB, 6, rank, 2, rank_chunks(106, rank, 2), local_world_size=2, run=22, after=2, at=3_000)
    upload_ranks(store, tmp_dir(rn, JOB, 6), JOB, 6, [0, 1], attempt=new)
    real = store.list_tagged

    def listing(prefix: str = "") -> dict[str, str]:
        if prefix == bucket_prefix(JOB, 6):  # the drop's own look: the re-save completed just before
            store.list_tagged = real  # type: ignore[method-assign]
            assert try_complete(store, JOB, 6, 2, new)
        return real(prefix)

    store.list_tagged = listing  # type: ignore[method-assign]
    assert apply_remote_retention(store, JOB, KeepLatest(1), settled=lambda s, k: False) == []
    assert bucket_attempt(store, JOB, 6) == (True, new)


def test_retention_removes_exactly_the_settled_objects_of_a_partial_step(tmp_path: Path) -> None:
    """A rollback attempt's node uploads its part of step 5 while retention removes a dead attempt's settled
    leftovers there: the fresh part stays (it arrived after the listing the leftovers were judged on)."""
    store = MemoryStore()
    ra, rd, rc = (str(tmp_path / n) for n in ("a", "dead", "c"))
    for rank in (0, 1):
        write_rank(ra, JOB, 7, rank, 2, rank_chunks(7, rank, 2), local_world_size=2, run=11, at=1_007)
        write_rank(rd, JOB, 5, rank, 2, rank_chunks(5, rank, 2), local_world_size=2, run=11, at=1_005)
        write_rank(rc, JOB, 5, rank, 2, rank_chunks(105, rank, 2), local_world_size=2, run=22, after=2, at=2_005)
    upload_ranks(store, tmp_dir(ra, JOB, 7), JOB, 7, [0, 1], attempt=(11, None))
    assert try_complete(store, JOB, 7, 2, (11, None))
    upload_ranks(store, tmp_dir(rd, JOB, 5), JOB, 5, [1], attempt=(11, None))  # a dead attempt's half of step 5
    given_up = frozenset(store.list_tagged(bucket_prefix(JOB, 5)).items())
    real, fired = store.get_bytes, [False]

    def get_bytes(rel: str, limit: int | None = None) -> bytes:
        if rel == bucket_key(JOB, 7, MANIFEST) and not fired[0]:
            fired[0] = True  # meanwhile a rollback attempt's node uploads its part of step 5
            upload_ranks(store, tmp_dir(rc, JOB, 5), JOB, 5, [0], attempt=(22, 2))
        return real(rel, limit)

    store.get_bytes = get_bytes  # type: ignore[method-assign]
    assert apply_remote_retention(store, JOB, KeepLatest(5), settled=lambda s, keys: keys == given_up) == [5]
    assert fired[0]
    assert sorted(step_keys(store, JOB, 5)) == sorted(bucket_key(JOB, 5, f"run-22-after-2/{n}") for n in (shard_name(0), fragment_name(0)))
