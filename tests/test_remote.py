"""The object-storage tier through the daemon, against a real S3 endpoint (moto's server) on loopback:
upload after local durability (data first, manifest last), per-tier retention, restore from the
bucket when the local copy is gone, a corrupt object caught by its checksum, an unreachable bucket."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _models import assert_same, full_state, make, train_step

from ckptd.errors import CheckpointError
from ckptd.storage import remote
from ckptd.storage.s3 import RemoteConfig, S3Store


def remote_toml(path: Path, cfg: RemoteConfig, **extra: Any) -> str:
    """A ``--config`` file holding only the ``[remote]`` table for ``cfg`` plus ``extra`` keys."""
    lines = ["[remote]", f'bucket = "{cfg.bucket}"', f'prefix = "{cfg.prefix}"', f'endpoint_url = "{cfg.endpoint_url}"']
    for k, v in extra.items():
        lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def wait_uploaded(d, job: str, step: int, timeout: float = 60.0) -> dict[str, Any]:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    with d.client(job) as c:
        while time.monotonic() < deadline:
            st = c.status()
            if st["jobs"].get(job, {}).get("uploaded", -1) >= step:
                return st
            time.sleep(0.1)
    raise AssertionError(f"step {step} of {job} was never uploaded: {st}")


def _steps(store: S3Store, job: str) -> tuple[list[int], list[int]]:
    return remote.remote_steps(store, job)


def test_upload_retention_and_restore_from_bucket(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    conf = remote_toml(short_tmp / "r.toml", s3_bucket, keep=2, keep_every=2, part_size="5M", max_bandwidth="1G")
    d = make_daemon("--config", conf, "--keep", "2")
    model, optim = make()
    states = {}
    with d.client("up") as c:
        for step in range(1, 6):
            train_step(model, optim, step)
            states[step] = full_state(model, optim)
            c.snapshot(model, optim, step=step, extra={"step": step}, blocking=True).wait()
    st = wait_uploaded(d, "up", 5)
    assert st["steps_uploaded"] >= 3 and st["uploaded_bytes"] > 0 and st["last_error"] is None
    store = S3Store(s3_bucket)
    # bucket: the newest 2 and every 2nd; local disk: the newest 2
    deadline = time.monotonic() + 10
    while _steps(store, "up") != ([2, 4, 5], []) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _steps(store, "up") == ([2, 4, 5], [])
    assert sorted(os.listdir(Path(d.root) / "up")) == ["latest", "step-4", "step-5"]
    # every object is byte-identical to the local file it came from
    for name in os.listdir(Path(d.root) / "up" / "step-5"):
        assert store.get_bytes(f"up/step-5/{name}") == (Path(d.root) / "up" / "step-5" / name).read_bytes()

    # the node is lost: a fresh root restores from the bucket, newest first, or any kept step
    d.stop()
    shutil.rmtree(Path(d.root) / "up")
    d.start()
    with d.client("up") as c:
        m2, o2 = make(seed=9)
        assert c.restore(m2, o2) == {"step": 5}
        assert c.last_restore["source"] == "bucket" and c.last_restore["step"] == 5
        assert_same(full_state(m2, o2), states[5])
        assert c.restore(m2, o2, step=2) == {"step": 2}
        assert_same(full_state(m2, o2), states[2])
        c.restore(m2, o2, step=5)
        assert c.last_restore["source"] == "disk"  # downloaded once, local from then on
        with pytest.raises(CheckpointError, match="step 3 of job 'up' is not a committed checkpoint"):
            c.restore(m2, o2, step=3)
    store.close()


def _two_steps_uploaded(d, job: str, s3_bucket: RemoteConfig) -> tuple[dict[str, Any], str]:  # noqa: ANN001
    """Steps 1 and 2 of ``job`` saved and uploaded; returns step 1's state and the key of step 2's shard."""
    model, optim = make()
    with d.client(job) as c:
        c.snapshot(model, optim, step=1, blocking=True).wait()
        want1 = full_state(model, optim)
        train_step(model, optim, 1)
        c.snapshot(model, optim, step=2, blocking=True).wait()
    wait_uploaded(d, job, 2)
    return want1, f"{s3_bucket.prefix}/{job}/step-2/rank-00000.safetensors"


def _local_copies_lost(d, job: str) -> None:  # noqa: ANN001
    """The node is replaced: a restarted daemon with nothing of ``job`` under its root."""
    d.stop()
    shutil.rmtree(Path(d.root) / job)
    d.start()


def test_corrupt_object_is_caught_by_its_checksum(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig, s3_server) -> None:  # noqa: ANN001
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket))
    want1, key = _two_steps_uploaded(d, "bad", s3_bucket)
    s3 = s3_server.client()
    data = bytearray(s3.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read())
    data[-100] ^= 0xFF  # a flipped bit deep in the tensor data, same size
    s3.put_object(Bucket=s3_bucket.bucket, Key=key, Body=bytes(data))
    _local_copies_lost(d, "bad")
    with d.client("bad") as c:
        m2, o2 = make(seed=9)
        url = f"s3://{s3_bucket.bucket}/{s3_bucket.prefix}/bad/step-2/rank-00000.safetensors"
        corrupt = rf"step 2 of job bad in the bucket is corrupt: {url}: checksum mismatch in tensor '"
        with pytest.raises(CheckpointError, match=corrupt):
            c.restore(m2, o2, step=2)  # asked for by number: that step, or why not
        assert not (Path(d.root) / "bad" / "step-2").exists()  # nothing of the corrupt step entered the root
        c.restore(m2, o2)  # the latest: the corrupt step is passed over for the newest one still restorable, saying so
        assert c.last_restore["step"] == 1
        assert_same(full_state(m2, o2), want1)
        assert re.search(corrupt, c.status()["last_error"]) and "restoring step 1, the newest still restorable" in c.status()["last_error"]


def test_an_object_bigger_than_its_manifest_says_is_refused_as_it_arrives(
    make_daemon,
    short_tmp: Path,
    s3_bucket: RemoteConfig,
    s3_server,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """A shard object replaced by a far bigger one (a bad actor with bucket access, a botched copy) must not
    fill the root's disk before the size check: the download stops at the manifest's size; a manifest
    past the document limit is never read whole into the daemon's memory."""
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket))
    want1, key = _two_steps_uploaded(d, "big", s3_bucket)
    s3c = s3_server.client()
    size = len(s3c.get_object(Bucket=s3_bucket.bucket, Key=key)["Body"].read())
    s3c.put_object(Bucket=s3_bucket.bucket, Key=key, Body=os.urandom(size + (8 << 20)))
    _local_copies_lost(d, "big")
    with d.client("big") as c:
        url = f"s3://{s3_bucket.bucket}/{key}"
        with pytest.raises(CheckpointError, match=rf"{url} is larger than the {size} bytes expected"):
            c.restore(*make(seed=9), step=2)
        assert sorted(os.listdir(Path(d.root) / "big")) == []  # no .fetch directory, no step
        m1, o1 = make(seed=9)
        c.restore(m1, o1)  # the latest passed over for the newest step still restorable
        assert c.last_restore["step"] == 1
        assert_same(full_state(m1, o1), want1)
    monkeypatch.setattr(remote, "MAX_DOCUMENT_BYTES", 100)
    with S3Store(s3_bucket) as store:
        man = f"s3://{s3_bucket.bucket}/{s3_bucket.prefix}/big/step-1/manifest.json"
        with pytest.raises(CheckpointError, match=rf"{man} is larger than the 100 bytes expected"):
            remote.download_step(store, str(short_tmp / "other"), "big", 1)


def test_unreachable_bucket_keeps_local_durability(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    cfg = RemoteConfig(bucket="ckptd-nowhere", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1, connect_timeout=1, read_timeout=1)
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", cfg, max_attempts=1, connect_timeout=1, read_timeout=1))
    model, optim = make()
    with d.client("off") as c:
        deadline = time.monotonic() + 30  # the daemon checks the bucket off its loop, after READY
        while "object storage" not in (c.status()["last_error"] or "") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "object storage" in c.status()["last_error"]
        path = c.snapshot(model, optim, step=1, blocking=True).wait()
        assert os.path.exists(os.path.join(path, "manifest.json"))
        deadline = time.monotonic() + 30
        while "upload of job off step 1" not in (c.status()["last_error"] or "") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "upload of job off step 1" in c.status()["last_error"]
        m2, o2 = make(seed=9)
        with pytest.raises(CheckpointError, match="ckptd-nowhere"):
            c.restore(m2, o2, hot=False)  # it asks the bucket whether a newer step exists: it cannot know
    assert d.stop() == 0


@pytest.mark.parametrize(
    "table,match",
    [
        ('[remote]\nprefix = "x"\n', "'bucket' is required"),
        ('[remote]\nbucket = "Bad_Bucket"\n', "invalid bucket name"),
        ('[remote]\nbucket = "ok-bucket"\nkeep = 0\n', "remote.keep must be an integer >= 1"),
        ('[remote]\nbucket = "ok-bucket"\nspeed = 1\n', "unknown keys 'speed'"),
        ('[remote]\nbucket = "ok-bucket"\npart_size = "lots"\n', "remote.part_size"),
        ("remote = 3\n", r"\[remote\] must be a table"),
    ],
)
def test_bad_remote_config_is_refused(tmp_path: Path, table: str, match: str) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(table)
    r = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--root", str(tmp_path / "r"), "--config", str(conf)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert __import__("re").search(match, r.stderr), r.stderr


class _Recorder:
    """A store that records the order of uploads (the real one is tested against moto above)."""

    def __init__(self) -> None:
        self.puts: list[str] = []

    def put_file(self, rel: str, path: str, progress: Any = None) -> None:
        self.puts.append(rel)

    def put_bytes(self, rel: str, data: bytes) -> None:
        self.puts.append(rel)

    def delete(self, rels: list[str]) -> None:
        self.puts.extend(f"delete {r}" for r in rels)

    def url(self, rel: str = "") -> str:
        return f"rec://{rel}"


def test_upload_order_is_data_then_fragments_then_manifest(tmp_path: Path) -> None:
    d = tmp_path / "step-7"
    d.mkdir()
    for name in ("manifest.json", "rank-00001.json", "rank-00000.safetensors", "rank-00000.json", "rank-00001.safetensors"):
        (d / name).write_bytes(b"x")
    rec = _Recorder()
    remote.upload_step(rec, str(d), "j", 7)
    order = ("rank-00000.safetensors", "rank-00001.safetensors", "rank-00000.json", "rank-00001.json", "manifest.json")
    assert rec.puts == ["delete j/step-7/manifest.json"] + [f"j/step-7/{n}" for n in order]


def test_restart_uploads_what_a_previous_run_did_not(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    d = make_daemon("--keep", "5")  # no bucket yet: steps 1-5 are durable on local disk only
    model, optim = make()
    with d.client("late") as c:
        for step in range(1, 6):
            c.snapshot(model, optim, step=step, blocking=True).wait()
    d.stop()
    conf = remote_toml(short_tmp / "r.toml", s3_bucket, keep_every=2)
    d.start(["--config", conf, "--keep", "5"])
    wait_uploaded(d, "late", 5)
    deadline = time.monotonic() + 30
    with S3Store(s3_bucket) as store:
        while _steps(store, "late") != ([2, 4, 5], []) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _steps(store, "late") == ([2, 4, 5], [])  # the newest, and those kept forever
    d.stop()
    d.start(["--config", conf, "--keep", "5"])  # already there: nothing to send
    st = wait_uploaded(d, "late", 1)
    assert st["uploaded_bytes"] == 0


def test_a_restarted_daemon_never_uploads_a_step_it_downloaded(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    """A replaced node restores step 1 from the bucket; the bucket then drops step 1 (another node's retention).
    The daemon restarts: its catch-up used to take the downloaded step for one of its own and upload it again,
    bringing a deleted step back (and, single-node, pruning other nodes' partial steps after it)."""
    conf = remote_toml(short_tmp / "r.toml", s3_bucket)
    d = make_daemon("--config", conf)
    model, optim = make()
    with d.client("back") as c:
        for step in (1, 2):
            c.snapshot(model, optim, step=step, blocking=True).wait()
    wait_uploaded(d, "back", 2)
    d.stop()
    shutil.rmtree(Path(d.root) / "back")  # the node was replaced
    d.start()
    with d.client("back") as c:
        c.restore(*make(seed=9), step=1)
        assert c.last_restore["source"] == "bucket"
    with S3Store(s3_bucket) as store:
        store.delete(store.list("back/step-1/"))
        assert _steps(store, "back") == ([2], [])
    d.stop()
    d.start()
    with d.client("back") as c:
        c.snapshot(model, optim, step=3, blocking=True).wait()  # uploads run in order: after any catch-up
    wait_uploaded(d, "back", 3)
    with S3Store(s3_bucket) as store:
        assert _steps(store, "back") == ([2, 3], [])


def test_missing_object_fails_the_restore_and_leaves_no_partial_download(make_daemon, short_tmp: Path, s3_bucket: RemoteConfig) -> None:  # noqa: ANN001
    d = make_daemon("--config", remote_toml(short_tmp / "r.toml", s3_bucket))
    model, optim = make()
    with d.client("gone") as c:
        c.snapshot(model, optim, step=3, blocking=True).wait()
    wait_uploaded(d, "gone", 3)
    with S3Store(s3_bucket) as store:
        store.delete(["gone/step-3/rank-00000.safetensors"])  # the manifest still claims it
    d.stop()
    shutil.rmtree(Path(d.root) / "gone")
    d.start()
    with d.client("gone") as c:
        with pytest.raises(CheckpointError, match=r"gone/step-3/rank-00000\.safetensors"):
            c.restore(*make(seed=9))
        assert "fetch of job gone step 3" in c.status()["last_error"]
    assert not any(p.name.endswith(".fetch") for p in (Path(d.root) / "gone").iterdir())
