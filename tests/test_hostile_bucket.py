"""Attacks through the bucket, against the real S3 endpoint (moto's server): objects that anyone with write access to
the bucket (or a broken node) put where ckptd reads manifests and fragments.

A document read back must cost the daemon memory in proportion to what a real one of its step can be, not ~24x its
own size (``json.loads`` of 64 MiB of ``[{},{},...]`` took a daemon from 56 MiB to 1.7 GiB in one ``latest()``), and a
step counts as complete only when its manifest validates: ``latest()`` answers the newest such step, and a restore
of "the latest" reads it. Peak memory is measured, not timed: the kernel's high-water mark of the process's resident
set (``VmHWM``), reset just before the attack (``clear_refs``), as a ratio to the hostile object's size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _models import assert_same, full_state, make
from test_bucket import rank_chunks, write_rank
from test_remote import _local_copies_lost, remote_toml, wait_uploaded

from ckptd import protocol
from ckptd.errors import FormatError
from ckptd.format import encode_manifest
from ckptd.layout import MANIFEST, attempt_folder, bucket_key, fragment_name, shard_name, tmp_dir
from ckptd.storage import remote
from ckptd.storage.s3 import RemoteConfig, S3Store

JOB = "hb"
HUGE = 64 << 20  # the hostile manifest
FAR_FUTURE = 9 * 10**18  # a committed_at later than any real step's (ns since the epoch), still under 2**63
MAX_GROWTH = 1 / 4  # of the hostile object's size: reading it whole alone would cost 1; parsing it, ~24


def _status(pid: int | str, field: str) -> int:
    """A ``/proc/<pid>/status`` memory field, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]


def reset_peak(pid: int | str) -> int:
    """Reset the process's peak resident set to what it holds now (Linux ``clear_refs`` 5); returns that."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status(pid, "VmRSS")


def peak_growth(pid: int | str, base: int) -> int:
    """How far the process's resident set rose above ``base`` at its peak since :func:`reset_peak`."""
    return _status(pid, "VmHWM") - base


def list_bomb(size: int) -> bytes:
    """``[{},{},...]`` of ``size`` bytes: valid JSON, ~24 bytes of Python objects for each of its own."""
    n = (size - 2) // 3
    return b"[" + b"{}," * n + b"{}]"


def envelope_bomb(size: int, step: int) -> bytes:
    """A manifest's envelope as ckptd writes it (committed after every real step), then ``{}`` after ``{}``."""
    head = json.dumps(
        {
            "format_version": 2,
            "kind": "ckptd-manifest",
            "job": JOB,
            "step": step,
            "world_size": 1,
            "created_unix": 1.0,
            "committed_at": FAR_FUTURE,
            "files": {},
            "tensors": {},
        },  # fmt: skip
        separators=(",", ":"),
    ).encode()[:-1]
    body = head + b',"ranks":['
    n = (size - len(body) - 2) // 3
    return body + b"{}," * n + b"{}]}"


def fails_validation(step: int) -> bytes:
    """Valid JSON with a correct digest and ckptd's envelope, committed after every real step, that names a file
    its tensor's chunk is in but lists no such file: not a manifest."""
    return encode_manifest(
        {"format_version": 2, "kind": "ckptd-manifest", "job": JOB, "step": step, "world_size": 1, "created_unix": 1.0,
         "committed_at": FAR_FUTURE, "files": {},
         "tensors": {"w": {"dtype": "F32", "shape": [2], "chunks": [{"file": shard_name(0), "name": "w"}]}}, "ranks": []}
    )  # fmt: skip


def _key(cfg: RemoteConfig, step: int, name: str) -> str:
    return f"{cfg.prefix}/{bucket_key(JOB, step, name)}"


def plant_step(s3: Any, cfg: RemoteConfig, like: int, step: int, manifest: bytes) -> None:
    """Step ``step`` in the bucket, as a real one looks: a copy of step ``like``'s shard and fragment, and ``manifest``."""
    for name in (shard_name(0), fragment_name(0)):
        src = {"Bucket": cfg.bucket, "Key": _key(cfg, like, name)}
        s3.copy_object(Bucket=cfg.bucket, Key=_key(cfg, step, name), CopySource=src)
    s3.put_object(Bucket=cfg.bucket, Key=_key(cfg, step, MANIFEST), Body=manifest)


def save_step_1(d) -> dict[str, Any]:  # noqa: ANN001
    """Step 1 of the job saved and uploaded by daemon ``d``; returns its state."""
    model, optim = make()
    with d.client(JOB) as c:
        c.snapshot(model, optim, step=1, extra={"step": 1}, blocking=True).wait()
    wait_uploaded(d, JOB, 1)
    return full_state(model, optim)


def restores_step_1_from_the_bucket(d, want: dict[str, Any]) -> None:  # noqa: ANN001
    """A replaced node (nothing of the job under its root) restores "the latest": step 1, from the bucket."""
    _local_copies_lost(d, JOB)
    with d.client(JOB) as c:
        m, o = make(seed=9)
        assert c.restore(m, o) == {"step": 1}
        assert c.last_restore["source"] == "bucket"
        assert_same(full_state(m, o), want)


@pytest.mark.parametrize("bomb", ["list", "envelope"])
def test_a_huge_manifest_of_a_newer_step_costs_the_daemon_no_memory_and_is_no_step(
    make_daemon,
    short_tmp: Path,
    s3_bucket: RemoteConfig,
    s3_server,
    bomb: str,  # noqa: ANN001
) -> None:
    """64 MiB at step 2's manifest.json: the issue's ``[{},{},...]``, and the same behind an envelope that orders it
    after every real step. ``latest()`` answers step 1, the daemon's peak memory barely moves, and a replaced node
    restores step 1."""
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket))
    want = save_step_1(d)
    hostile = list_bomb(HUGE) if bomb == "list" else envelope_bomb(HUGE, 2)
    plant_step(s3_server.client(), s3_bucket, 1, 2, hostile)
    pid = d.proc.pid
    base = reset_peak(pid)
    with d.client(JOB) as c:
        answer = c.latest()
    grown = peak_growth(pid, base)
    print(f"daemon peak memory during latest(): +{grown / 2**20:.1f} MiB for a {len(hostile) / 2**20:.0f} MiB manifest")
    assert grown < MAX_GROWTH * len(hostile), f"the daemon's memory rose {grown / len(hostile):.2f}x the hostile manifest's size"
    assert answer == 1
    restores_step_1_from_the_bucket(d, want)


NOT_MANIFESTS = ["{}", "[]", "fails validation", "another step's manifest"]


@pytest.mark.parametrize("what", NOT_MANIFESTS)
def test_a_manifest_json_that_is_not_a_manifest_makes_no_step(
    make_daemon,
    short_tmp: Path,
    s3_bucket: RemoteConfig,
    s3_server,
    what: str,  # noqa: ANN001
) -> None:
    """Step 2's manifest.json is not a manifest of step 2: not complete, in no list of the bucket's steps; ``latest()``
    answers step 1 and a replaced node restores it (a step counted complete because the object existed was answered
    by ``latest()``, and the restore of it failed)."""
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket))
    want = save_step_1(d)
    s3 = s3_server.client()
    body = {
        "{}": b"{}",
        "[]": b"[]",
        "fails validation": fails_validation(2),
        "another step's manifest": s3.get_object(Bucket=s3_bucket.bucket, Key=_key(s3_bucket, 1, MANIFEST))["Body"].read(),
    }[what]
    plant_step(s3, s3_bucket, 1, 2, body)
    with S3Store(s3_bucket) as store:
        assert remote.remote_steps(store, JOB) == ([1], [])
        assert remote.bucket_steps_by_commit(store, JOB) == ([1], [])
        assert remote.bucket_committed_at(store, JOB, 2) is None
    with d.client(JOB) as c:
        assert c.latest() == 1
    restores_step_1_from_the_bucket(d, want)


def test_an_oversized_fragment_is_refused_unread(s3_bucket: RemoteConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Multi-node: rank 1's fragment in the bucket is 16 MiB of ``[{},{},...]`` beside a shard of a few hundred bytes.
    A fragment holds its shard's chunk table and its rank's tree, which a trainer commits in one frame (here at most
    1 MiB): the node completing the step refuses it as listed, without reading it, and writes no manifest."""
    monkeypatch.setattr(protocol, "MAX_MESSAGE_BYTES", 1 << 20)  # trees of 1 MiB at most: a bomb of 16 MiB is oversized
    root, attempt = str(tmp_path / "root"), (11, None)
    for rank in (0, 1):
        write_rank(root, JOB, 6, rank, 2, rank_chunks(6, rank, 2), local_world_size=1, run=11, at=1_000)
    hostile = list_bomb(16 << 20)
    with S3Store(s3_bucket) as store:
        remote.upload_ranks(store, tmp_dir(root, JOB, 6), JOB, 6, [0, 1], attempt=attempt)
        store.put_bytes(bucket_key(JOB, 6, attempt_folder(*attempt) + fragment_name(1)), hostile)
        base = reset_peak("self")
        with pytest.raises(FormatError) as refused:
            remote.try_complete(store, JOB, 6, 2, attempt)
        grown = peak_growth("self", base)
        print(f"peak memory during try_complete(): +{grown / 2**20:.1f} MiB for a {len(hostile) / 2**20:.0f} MiB fragment")
        assert grown < MAX_GROWTH * len(hostile), f"memory rose {grown / len(hostile):.2f}x the hostile fragment's size"
        assert re.search(r"rank-00001\.json is larger than the \d+ bytes expected", str(refused.value)), refused.value
        assert not store.exists(bucket_key(JOB, 6, MANIFEST))
