"""Multipart uploads a killed daemon left open are aborted by its next start, and only those (``storage/multipart.py``),
against moto's S3 server: an open upload keeps its parts in the bucket, billed, until someone aborts it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import assert_same, full_state
from botocore.exceptions import ConnectionClosedError
from test_remote import remote_toml, wait_uploaded
from test_s3 import PART, _unreachable

from ckptd.errors import CheckpointError
from ckptd.storage.multipart import LEDGER_DIR, Upload, UploadLedger
from ckptd.storage.s3 import RemoteConfig, S3Store

MiB = 1 << 20


def _open_uploads(s3: Any, cfg: RemoteConfig) -> dict[str, str]:
    """upload id -> key of every multipart upload open in the bucket."""
    listed = s3.client().list_multipart_uploads(Bucket=cfg.bucket)
    return {u["UploadId"]: u["Key"] for u in listed.get("Uploads", ())}


def _ledger(root: Path) -> list[str]:
    """The records in ``root``'s ledger (not a temporary of one being written)."""
    try:
        return sorted(n for n in os.listdir(root / LEDGER_DIR) if not n.endswith(".tmp"))
    except FileNotFoundError:
        return []


def _store(cfg: RemoteConfig, root: Path, **kw: Any) -> S3Store:
    return S3Store(dataclasses.replace(cfg, part_size=PART, **kw), ledger=UploadLedger(str(root)))


# ---------------------------------------------------------------------------- the daemon


def test_a_daemon_killed_mid_upload_has_its_open_upload_aborted_at_the_restart(
    make_daemon, short_tmp: Path, s3_bucket: RemoteConfig, s3_server
) -> None:  # noqa: ANN001
    """The user's case: the daemon is killed (OOM killer, ``systemctl kill``) while a 20 MB shard is on its way up in
    5 MiB parts. Its upload stays open in the bucket; the restarted daemon uploads the step again under a new upload
    and aborts the old one, so nothing is left billed."""
    slow = remote_toml(short_tmp / "slow.toml", s3_bucket, part_size="5M", max_bandwidth=2 * MiB)
    fast = remote_toml(short_tmp / "fast.toml", s3_bucket, part_size="5M")
    d = make_daemon("--config", slow)
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1664)  # 6.5 MiB of weights; with AdamW's two moments a 20 MiB shard
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    optim.step()
    saved = full_state(model, optim)
    with d.client("mp") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
    deadline = time.monotonic() + 60
    while not (_open_uploads(s3_server, s3_bucket) and _ledger(Path(d.root))) and time.monotonic() < deadline:
        time.sleep(0.05)
    before = _open_uploads(s3_server, s3_bucket)
    assert before and _ledger(Path(d.root)), "the shard's multipart upload never began"
    d.kill()
    assert _open_uploads(s3_server, s3_bucket) == before  # what a kill leaves: an upload nobody will finish

    d.start(["--config", fast])
    wait_uploaded(d, "mp", 1)
    deadline = time.monotonic() + 30
    while _open_uploads(s3_server, s3_bucket) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _open_uploads(s3_server, s3_bucket) == {}, d.log.read_text()
    assert _ledger(Path(d.root)) == []
    assert "that a previous daemon left unfinished" in d.log.read_text()
    d.stop()  # the node is replaced: a daemon with nothing of the job under its root restores from the bucket
    shutil.rmtree(Path(d.root) / "mp")
    d.start(["--config", fast])
    fresh = torch.nn.Linear(1024, 1664)
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    with d.client("mp") as c:
        c.restore(fresh, fresh_optim)
        assert c.last_restore["source"] == "bucket"
    assert_same(full_state(fresh, fresh_optim), saved)


# ---------------------------------------------------------------------------- the store and its ledger


def test_an_upload_that_ends_leaves_no_record(short_tmp: Path, s3_bucket: RemoteConfig, s3_server) -> None:  # noqa: ANN001
    with _store(s3_bucket, short_tmp) as s:
        s.put_bytes("whole", os.urandom(PART + 1))  # two parts
        assert _ledger(short_tmp) == [] and _open_uploads(s3_server, s3_bucket) == {}
        assert s.get_bytes("whole") is not None


def test_an_upload_s3transfer_gives_up_is_aborted_and_forgotten(short_tmp: Path, s3_bucket: RemoteConfig, s3_server) -> None:  # noqa: ANN001
    """A part that keeps failing: s3transfer aborts the upload itself, and the record goes with it."""
    with _store(s3_bucket, short_tmp, max_attempts=1) as s:

        def refuse(request: Any, **_: Any) -> None:
            raise ConnectionClosedError(endpoint_url=request.url)  # the network went away mid-part

        s.client.meta.events.register("before-send.s3.UploadPart", refuse)
        with pytest.raises(CheckpointError, match="upload"):
            s.put_bytes("broken", os.urandom(PART + 1))
    assert _open_uploads(s3_server, s3_bucket) == {}
    assert _ledger(short_tmp) == []


def _leave_open(cfg: RemoteConfig, root: Path, key: str) -> str:
    """An upload a daemon began and was killed before it ended: recorded in ``root``'s ledger, open in the bucket."""
    s = _store(cfg, root)
    upload_id = s.client.create_multipart_upload(Bucket=cfg.bucket, Key=f"{cfg.prefix}/{key}")["UploadId"]
    s.close()  # the daemon is gone; no complete, no abort
    return upload_id


def test_the_next_store_on_the_root_aborts_what_the_last_left_open(short_tmp: Path, s3_bucket: RemoteConfig, s3_server) -> None:  # noqa: ANN001
    mine = _leave_open(s3_bucket, short_tmp, "job/step-1/rank-00000.safetensors")
    theirs = s3_server.client().create_multipart_upload(Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/job/step-1.node-1/x")
    assert len(_ledger(short_tmp)) == 1
    with _store(s3_bucket, short_tmp) as s:
        key = f"{s3_bucket.prefix}/job/step-2/rank-00000.safetensors"
        live = s.client.create_multipart_upload(Bucket=s3_bucket.bucket, Key=key)["UploadId"]  # this daemon's, under way
        assert len(_ledger(short_tmp)) == 2
        assert s.abort_unfinished() == 1
        assert s.abort_unfinished() == 0  # once
        left = _open_uploads(s3_server, s3_bucket)
        assert mine not in left
        assert left == {theirs["UploadId"]: f"{s3_bucket.prefix}/job/step-1.node-1/x", live: key}  # another node's; its own live one
        assert len(_ledger(short_tmp)) == 1
        s.client.abort_multipart_upload(Bucket=s3_bucket.bucket, Key=key, UploadId=live)
    assert _ledger(short_tmp) == []
    s3_server.client().abort_multipart_upload(
        Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/job/step-1.node-1/x", UploadId=theirs["UploadId"]
    )


def test_an_upload_that_ended_before_its_record_went_is_forgotten(short_tmp: Path, s3_bucket: RemoteConfig, s3_server) -> None:  # noqa: ANN001
    """Killed between S3's answer to the complete and the record's removal: the abort finds no such upload."""
    upload_id = _leave_open(s3_bucket, short_tmp, "done")
    s3_server.client().abort_multipart_upload(Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/done", UploadId=upload_id)
    with _store(s3_bucket, short_tmp) as s:
        assert s.abort_unfinished() == 0
    assert _ledger(short_tmp) == []


@pytest.mark.parametrize("code", ["NoSuchUpload", "404"])
def test_an_abort_answered_gone_forgets_the_record_whatever_the_server_says(tmp_path: Path, code: str) -> None:
    """S3 answers an upload that ended with ``NoSuchUpload``; a proxy or another S3-compatible server may answer a bare
    404 without an error body (botocore then calls it ``404``). Either way the record goes, not kept for every start."""
    from botocore.stub import Stubber

    from ckptd.storage.s3 import _make_client

    cfg = RemoteConfig(bucket="ckptd-stubbed", prefix="ckpts", region="us-east-1")
    ledger = UploadLedger(str(tmp_path))
    ledger.record(Upload(cfg.bucket, "ckpts/k", "id-gone", None))
    client = _make_client(cfg)
    with Stubber(client) as stub, S3Store(cfg, client=client, ledger=ledger) as s:
        stub.add_client_error("abort_multipart_upload", service_error_code=code, http_status_code=404)
        assert s.abort_unfinished() == 0
        stub.assert_no_pending_responses()
    assert ledger.pending() == []


def test_a_bucket_unreachable_at_the_start_keeps_the_records_for_the_next(short_tmp: Path, s3_bucket: RemoteConfig, s3_server) -> None:  # noqa: ANN001
    upload_id = _leave_open(s3_bucket, short_tmp, "later")
    offline = S3Store(_unreachable(s3_bucket.bucket)).client  # the same bucket, which cannot be reached now
    with S3Store(dataclasses.replace(s3_bucket, part_size=PART), client=offline, ledger=UploadLedger(str(short_tmp))) as s:
        assert s.abort_unfinished() == 0
    assert len(_ledger(short_tmp)) == 1 and upload_id in _open_uploads(s3_server, s3_bucket)
    with _store(s3_bucket, short_tmp) as s:
        assert s.abort_unfinished() == 1
    assert upload_id not in _open_uploads(s3_server, s3_bucket)


def test_a_record_of_another_bucket_is_forgotten_not_aborted(short_tmp: Path, s3_bucket: RemoteConfig, s3_server, caplog) -> None:  # noqa: ANN001
    """The daemon's configuration moved to another bucket: what it recorded for the old one is not this store's to abort
    (a lifecycle rule there is the backstop); the record is dropped, saying so."""
    upload_id = _leave_open(s3_bucket, short_tmp, "moved")
    other = f"{s3_bucket.bucket}-new"
    s3_server.client().create_bucket(Bucket=other)
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon"), _store(dataclasses.replace(s3_bucket, bucket=other), short_tmp) as s:
        assert s.abort_unfinished() == 0
    assert upload_id in _open_uploads(s3_server, s3_bucket)
    assert _ledger(short_tmp) == []
    assert f"this daemon now uses bucket {other!r}" in caplog.text
    s3_server.client().abort_multipart_upload(Bucket=s3_bucket.bucket, Key=f"{s3_bucket.prefix}/moved", UploadId=upload_id)
    s3_server.client().delete_bucket(Bucket=other)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not json", "wrong version", "no key", "renamed", "a directory", "a fifo", "huge", "a temporary"],
)
def test_a_damaged_record_is_removed_and_the_others_still_aborted(
    short_tmp: Path, s3_bucket: RemoteConfig, s3_server, damage: str, caplog
) -> None:  # noqa: ANN001
    """A record cut short by a crash (or otherwise unreadable) names nothing to abort: logged and removed, never fatal,
    and the sound records beside it are still acted on."""
    good = _leave_open(s3_bucket, short_tmp, "good")
    ledger = short_tmp / LEDGER_DIR
    sound = json.dumps({"format_version": 1, "bucket": s3_bucket.bucket, "key": "k", "upload_id": "u", "endpoint": None})
    bad = ledger / "0123456789abcdef0123456789abcdef.json"
    if damage == "truncated":
        bad.write_text(sound[:20])
    elif damage == "not json":
        bad.write_bytes(b"\xff\x00")
    elif damage == "wrong version":
        bad.write_text(sound.replace('"format_version": 1', '"format_version": 9'))
    elif damage == "no key":
        bad.write_text(sound.replace('"key": "k"', '"key": ""'))
    elif damage == "renamed":  # a sound record under another upload's name
        bad.write_text(sound)
    elif damage == "a directory":
        bad.mkdir()
    elif damage == "a fifo":
        os.mkfifo(bad)
    elif damage == "huge":
        bad.write_bytes(b" " * 20_000)
    else:
        bad = ledger / "0123456789abcdef0123456789abcdef.json.tmp"
        bad.write_text(sound)
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon"), _store(s3_bucket, short_tmp) as s:
        assert s.abort_unfinished() == 1
    assert good not in _open_uploads(s3_server, s3_bucket)
    if damage == "a directory":
        assert os.listdir(ledger) == [bad.name]  # left alone (nothing a daemon writes): logged
    else:
        assert os.listdir(ledger) == []
    if damage != "a temporary":
        assert "unreadable record" in caplog.text


def test_a_record_that_cannot_be_written_never_fails_the_upload(short_tmp: Path, s3_bucket: RemoteConfig, s3_server, caplog) -> None:  # noqa: ANN001
    """The root's disk is full (or the ledger's place is taken): the upload goes on unrecorded, with a warning."""
    (short_tmp / LEDGER_DIR).write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon"), _store(s3_bucket, short_tmp) as s:
        s.put_bytes("anyway", os.urandom(PART + 1))
        assert s.exists("anyway")
    assert "cannot record multipart upload" in caplog.text
    assert _open_uploads(s3_server, s3_bucket) == {}


def test_a_ledger_in_a_full_disk_never_fails_the_upload(small_fs: str, s3_bucket: RemoteConfig, s3_server, caplog) -> None:  # noqa: ANN001
    root = Path(small_fs)
    with open(root / "filler", "wb") as f:  # the 3 MiB tmpfs, full
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    with caplog.at_level(logging.WARNING, logger="ckptd.daemon"), _store(s3_bucket, root) as s:
        s.put_bytes("full", os.urandom(PART + 1))
        assert s.exists("full")
    assert "cannot record multipart upload" in caplog.text


def test_records_round_trip(tmp_path: Path) -> None:
    ledger = UploadLedger(str(tmp_path))
    assert ledger.pending() == []
    ups = [Upload("b", "p/k1", "id-1", None), Upload("b", "p/k2", "id/2+=", "http://127.0.0.1:9000")]
    for u in ups:
        ledger.record(u)
    assert sorted(ledger.pending(), key=lambda u: u.key) == ups
    assert (tmp_path / LEDGER_DIR).stat().st_mode & 0o777 == 0o700
    ledger.forget("id-1")
    ledger.forget("never recorded")
    assert ledger.pending() == [ups[1]]
