"""S3Store (the S3 ObjectStore) against a real S3 HTTP endpoint: moto's standalone server on loopback (fixtures in conftest)."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptd.errors import CheckpointError, FormatError
from ckptd.storage import s3
from ckptd.storage.s3 import RemoteConfig, S3Store

MiB = 1 << 20
PART = 5 * MiB  # the S3 minimum part size


@pytest.fixture
def store(s3_bucket: RemoteConfig) -> Iterator[S3Store]:
    with S3Store(dataclasses.replace(s3_bucket, part_size=PART)) as s:
        yield s


def _write(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket is closed


def _unreachable(bucket: str = "ckptd-nowhere") -> RemoteConfig:
    return RemoteConfig(
        bucket=bucket,
        endpoint_url=f"http://127.0.0.1:{_closed_port()}",
        region="us-east-1",
        max_attempts=1,
        connect_timeout=1,
        read_timeout=1,
    )


def _count_calls(store: S3Store, op: str) -> list[int]:
    calls = [0]

    def count(**_: Any) -> None:
        calls[0] += 1

    store.client.meta.events.register(f"before-send.s3.{op}", count)
    return calls


# -- transfers --


@pytest.mark.parametrize("size", [0, 1234, 12 * MiB], ids=["empty", "small", "multipart"])
def test_file_round_trip(store: S3Store, tmp_path: Path, size: int) -> None:
    data = _write(tmp_path / "src", size)
    store.put_file("step-1/rank-00000.safetensors", str(tmp_path / "src"))

    head = store.client.head_object(Bucket=store.config.bucket, Key="ckpts/step-1/rank-00000.safetensors")
    assert head["ContentLength"] == size
    etag = head["ETag"].strip('"')
    if size > PART:
        assert etag.endswith("-3"), f"expected a 3-part multipart upload, ETag {etag}"
    else:
        assert "-" not in etag, f"expected a single PutObject, ETag {etag}"

    dest = tmp_path / "dest"
    dest.write_bytes(b"old content")
    store.get_file("step-1/rank-00000.safetensors", str(dest))
    assert dest.read_bytes() == data
    assert sorted(os.listdir(tmp_path)) == ["dest", "src"]  # no .part left over


def test_bytes_round_trip_and_exists(store: S3Store) -> None:
    assert not store.exists("manifest.json")
    store.put_bytes("manifest.json", b'{"format_version": 1}')
    assert store.exists("manifest.json")
    assert store.get_bytes("manifest.json") == b'{"format_version": 1}'
    store.put_bytes("manifest.json", b"{}")  # overwrite
    assert store.get_bytes("manifest.json") == b"{}"


def test_list_tagged_tells_a_rewritten_object_from_the_one_listed_before(store: S3Store) -> None:
    """What a cache of a bucket manifest's contents is checked against (another node may rewrite it)."""
    store.put_bytes("j/step-1/manifest.json", b'{"committed_at": 1}')
    store.put_bytes("j/step-2/manifest.json", b'{"committed_at": 2}')
    first = store.list_tagged("j/")
    assert sorted(first) == store.list("j/") == ["j/step-1/manifest.json", "j/step-2/manifest.json"]
    store.put_bytes("j/step-1/manifest.json", b'{"committed_at": 3}')
    again = store.list_tagged("j/")
    assert again["j/step-1/manifest.json"] != first["j/step-1/manifest.json"]
    assert again["j/step-2/manifest.json"] == first["j/step-2/manifest.json"]
    time.sleep(1.1)  # S3's LastModified has a resolution of one second
    store.put_bytes("j/step-2/manifest.json", b'{"committed_at": 2}')  # the same bytes again (a re-upload)
    assert store.list_tagged("j/")["j/step-2/manifest.json"] != first["j/step-2/manifest.json"]


def test_a_conditional_write_lands_only_on_the_object_as_it_was_listed(store: S3Store) -> None:
    """How a multi-node step's manifest is written: never over one another node wrote since this one looked."""
    key = "j/step-6/manifest.json"
    assert store.put_bytes_if(key, b'{"run": 11}', None) is True  # absent, as listed
    assert store.put_bytes_if(key, b'{"run": 22}', None) is False  # another writer came first
    assert store.get_bytes(key) == b'{"run": 11}'
    tag = store.list_tagged("j/")[key]
    store.put_bytes(key, b'{"run": 33}')  # rewritten since the listing
    assert store.put_bytes_if(key, b'{"run": 44}', tag) is False
    assert store.get_bytes(key) == b'{"run": 33}'
    assert store.put_bytes_if(key, b'{"run": 55}', store.list_tagged("j/")[key]) is True
    assert store.get_bytes(key) == b'{"run": 55}'


def test_a_conditional_write_or_delete_of_an_object_gone_since_the_listing_is_a_lost_race_not_an_error(store: S3Store) -> None:
    """Another node's retention removed the manifest between this node's listing and its write (or delete):
    S3 answers 404 to the condition; the caller looks again, it does not fail the step."""
    key = "j/step-6/manifest.json"
    store.put_bytes(key, b'{"run": 11}')
    tag = store.list_tagged("j/")[key]
    store.delete([key])
    assert store.put_bytes_if(key, b'{"run": 22}', tag) is False
    assert store.delete_if(key, tag) is False
    assert not store.exists(key)


def test_a_conditional_delete_leaves_an_object_written_since_the_listing(store: S3Store) -> None:
    key = "j/step-6/manifest.json"
    store.put_bytes(key, b'{"run": 11}')
    tag = store.list_tagged("j/")[key]
    store.put_bytes(key, b'{"run": 22}')  # a rollback completed the step meanwhile
    assert store.delete_if(key, tag) is False
    assert store.get_bytes(key) == b'{"run": 22}'
    assert store.delete_if(key, store.list_tagged("j/")[key]) is True
    assert not store.exists(key)


class _OlderServer:
    """A boto3 client of an S3-compatible server unlike moto's on conditional requests, the real client
    otherwise. ``mode``: ``"501"`` answers NotImplemented to If-Match / If-None-Match (older MinIO and Ceph
    releases); ``"ignore"`` drops those headers; ``"retry"`` applies a DeleteObject and answers as botocore's
    retry of it would after the first response was lost; ``"s3"`` changes nothing."""

    def __init__(self, client: Any, mode: str = "501") -> None:
        self._client, self.mode = client, mode

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if name not in ("put_object", "delete_object"):
            return real

        def call(**kw: Any) -> Any:
            if {"IfMatch", "IfNoneMatch"} & kw.keys():
                if self.mode == "501":
                    from botocore.exceptions import ClientError

                    raise ClientError(
                        {
                            "Error": {
                                "Code": "NotImplemented",
                                "Message": "A header you provided implies functionality that is not implemented",
                            }
                        },
                        name,
                    )
                if self.mode == "ignore":
                    kw = {k: v for k, v in kw.items() if k not in ("IfMatch", "IfNoneMatch")}
                if self.mode == "retry" and name == "delete_object":
                    real(**kw)  # went through; its response was lost, and botocore sends it again
            return real(**kw)

        return call


def _complete_step5(store: Any, manifest: bytes) -> str:
    store.put_bytes("j/step-5/rank-00000.safetensors", b"x")
    store.put_bytes("j/step-5/manifest.json", manifest)
    return "j/step-5/manifest.json"


@pytest.mark.parametrize("mode", ["s3", "501", "ignore"])
def test_retention_keeps_a_step_whose_manifest_was_written_again_since_its_listing_whatever_the_store(
    store: S3Store, s3_bucket: RemoteConfig, mode: str
) -> None:
    """Retention listed step 5; then a rollback completed step 5 anew. Its new manifest (its waiters were told
    the step is complete) stays, also where the store cannot make the delete conditional."""
    from ckptd.storage.remote import _drop_complete

    man = _complete_step5(store, b'{"run": 1}')
    tag = store.list_tagged("j/")[man]
    store.put_bytes(man, b'{"run": 2, "after": 3}')
    with S3Store(s3_bucket, client=_OlderServer(store.client, mode)) as other:
        assert _drop_complete(other, "j", 5, tag, None) is False
    assert store.get_bytes(man) == b'{"run": 2, "after": 3}' and store.exists("j/step-5/rank-00000.safetensors")


def test_a_conditional_delete_retried_after_it_went_through_still_drops_the_whole_step(store: S3Store, s3_bucket: RemoteConfig) -> None:
    """The retry finds no manifest (404 to its condition): the step is gone, and its files must go with it."""
    from ckptd.storage.remote import _drop_complete

    man = _complete_step5(store, b'{"run": 1}')
    with S3Store(s3_bucket, client=_OlderServer(store.client, "retry")) as other:
        assert _drop_complete(other, "j", 5, store.list_tagged("j/")[man], None) is True
    assert store.list("j/") == []


def test_the_memory_double_matches_s3_on_a_rewrite_with_the_same_bytes(store: S3Store) -> None:
    """If-Match compares ETags only: the same bytes written again still match, on S3 and in the tests' double."""
    from doubles import MemoryStore

    got = []
    for each in (store, MemoryStore()):
        man = _complete_step5(each, b'{"run": 1}')
        tag = each.list_tagged("j/")[man]
        time.sleep(1.1 if each is store else 0)  # S3's LastModified counts whole seconds
        each.put_bytes(man, b'{"run": 1}')
        assert each.list_tagged("j/")[man] != tag  # the listing tells them apart (LastModified) ...
        got.append(each.delete_if(man, tag))  # ... S3's condition does not
    assert got == [True, True]


def test_a_store_without_conditional_requests_writes_and_deletes_unconditionally_and_says_so(
    store: S3Store, s3_bucket: RemoteConfig, caplog: pytest.LogCaptureFixture
) -> None:
    key = "j/step-6/manifest.json"
    with S3Store(s3_bucket, client=_OlderServer(store.client)) as old:
        with caplog.at_level("WARNING", logger="ckptd.daemon"):
            assert old.put_bytes_if(key, b'{"run": 11}', None) is True
            assert old.put_bytes_if(key, b'{"run": 22}', "stale@tag") is True
            assert old.get_bytes(key) == b'{"run": 22}'
            assert old.delete_if(key, "stale@tag") is True
        assert not old.exists(key)
    assert [r.getMessage().count("conditional requests are not available") for r in caplog.records] == [1]


def test_progress_sums_to_size(store: S3Store, tmp_path: Path) -> None:
    size = 11 * MiB + 17
    _write(tmp_path / "src", size)
    up: list[int] = []
    down: list[int] = []
    lock = threading.Lock()  # called from s3transfer's worker threads

    def on(seen: list[int]) -> Callable[[int], None]:
        def record(n: int) -> None:
            with lock:
                seen.append(n)

        return record

    store.put_file("big", str(tmp_path / "src"), progress=on(up))
    store.get_file("big", str(tmp_path / "dest"), progress=on(down))
    assert sum(up) == size and len(up) > 1
    assert sum(down) == size and len(down) > 1


def test_missing_object_raises_file_not_found(store: S3Store, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.write_bytes(b"keep me")
    with pytest.raises(FileNotFoundError, match=rf"s3://{store.config.bucket}/ckpts/step-9/nope"):
        store.get_file("step-9/nope", str(dest))
    assert dest.read_bytes() == b"keep me"
    assert os.listdir(tmp_path) == ["dest"]  # the .part file was removed
    with pytest.raises(FileNotFoundError, match="ckpts/nope"):
        store.get_bytes("nope")


@pytest.mark.parametrize("size", [100, 3 * PART + 7])  # one GET; ranged parts written at their offsets
def test_download_past_its_limit_stops_and_leaves_nothing(store: S3Store, tmp_path: Path, size: int) -> None:
    """Another node (or a bad actor) replaced an object with a bigger one than the manifest lists: the
    download fails at the write that crosses the limit, names the object, and writes nothing into place."""
    src = tmp_path / "src"
    data = _write(src, size)
    store.put_file("step-1/big", str(src))
    dest = tmp_path / "dest"
    url = f"s3://{store.config.bucket}/ckpts/step-1/big"
    with pytest.raises(FormatError, match=rf"{url} is larger than the {size - 1} bytes expected"):
        store.get_file("step-1/big", str(dest), limit=size - 1)
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no dest, no .part
    with pytest.raises(FormatError, match=rf"{url} is larger than the 10 bytes expected"):
        store.get_bytes("step-1/big", limit=10)
    store.get_file("step-1/big", str(dest), limit=size)  # exactly the limit is fine
    assert dest.read_bytes() == data
    assert store.get_bytes("step-1/big", limit=size) == data


def test_capped_sink_never_writes_past_its_limit(tmp_path: Path) -> None:
    """Parts of a ranged download arrive in any order: a late part at a far offset is refused before
    it is written, so the file never grows past the limit (a sparse hole would not fill the disk either)."""
    with open(tmp_path / "f", "wb") as f:
        sink = s3._Capped(f, 100, "s3://b/k")
        assert sink.seekable()
        sink.seek(50)
        sink.write(b"x" * 50)
        sink.seek(90)
        with pytest.raises(FormatError, match="s3://b/k is larger than the 100 bytes expected"):
            sink.write(b"y" * 11)
        sink.seek(4096)
        with pytest.raises(FormatError):
            sink.write(b"z")
    assert (tmp_path / "f").stat().st_size == 100


def test_failed_download_removes_part_file(tmp_path: Path) -> None:
    with S3Store(_unreachable()) as s, pytest.raises(CheckpointError, match=r"download s3://ckptd-nowhere/x"):
        s.get_file("x", str(tmp_path / "dest"))
    assert os.listdir(tmp_path) == []


def test_upload_to_missing_bucket_names_operation_bucket_and_key(s3_bucket: RemoteConfig, tmp_path: Path) -> None:
    _write(tmp_path / "src", 100)
    gone = dataclasses.replace(s3_bucket, bucket="ckptd-no-such-bucket")
    with S3Store(gone) as s, pytest.raises(CheckpointError, match=r"upload s3://ckptd-no-such-bucket/ckpts/a/b .*NoSuchBucket"):
        s.put_file("a/b", str(tmp_path / "src"))


def test_missing_local_file_is_os_error(store: S3Store, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-file"):
        store.put_file("x", str(tmp_path / "no-such-file"))


# -- listing and deleting --


def test_list_and_delete(store: S3Store, s3_bucket: RemoteConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3, "_LIST_PAGE", 7)
    monkeypatch.setattr(s3, "_DELETE_BATCH", 7)
    rels = [f"step-{s}/rank-{r:05d}.safetensors" for s in (1, 2, 10) for r in range(9)] + ["latest", "step-1/manifest.json", "step-2/x/y/z"]
    for rel in rels:
        store.put_bytes(rel, rel.encode())
    # a sibling prefix in the same bucket is not part of this store
    with S3Store(dataclasses.replace(s3_bucket, prefix="ckpts-other")) as other:
        other.put_bytes("step-1/rank-00000.safetensors", b"x")

    lists = _count_calls(store, "ListObjectsV2")
    assert store.list() == sorted(rels)
    assert lists[0] == 5  # 30 keys, 7 per page: paginated
    assert store.list("step-1/") == sorted(r for r in rels if r.startswith("step-1/"))
    assert store.list("step-1") == sorted(r for r in rels if r.startswith("step-1"))  # a string prefix: step-10 too
    assert store.list("step-3/") == []

    deletes = _count_calls(store, "DeleteObjects")
    store.delete([r for r in rels if r.startswith("step-1/")] + ["step-1/never-existed"])
    assert deletes[0] == 2  # 11 keys, 7 per request
    assert store.list() == sorted(r for r in rels if not r.startswith("step-1/"))
    store.delete(rels + rels)  # deleting again, and duplicates, is fine
    assert store.list() == []
    store.delete([])
    assert deletes[0] == 2 + 5  # 30 distinct keys; the empty call sent nothing


def test_store_without_prefix(s3_bucket: RemoteConfig) -> None:
    with S3Store(dataclasses.replace(s3_bucket, prefix="")) as s:
        assert s.key("a/b") == "a/b"
        s.put_bytes("a/b", b"1")
        s.put_bytes("c", b"2")
        assert s.list() == ["a/b", "c"]


def _offline_store() -> S3Store:
    """A store whose client must never be used: key validation happens before any request."""
    return S3Store(RemoteConfig(bucket="ckptd-offline", prefix="ckpts"), client=object())


@pytest.mark.parametrize("rel", ["", "/abs", "../up", "a/../b", "a//b", "a/", "./a", "a/.."])
def test_bad_relative_keys(rel: str) -> None:
    store = _offline_store()
    for call in (store.key, store.exists, store.get_bytes, lambda r: store.put_bytes(r, b""), lambda r: store.delete(["ok", r])):
        with pytest.raises(ValueError):
            call(rel)


def test_bad_list_prefix() -> None:
    store = _offline_store()
    for rel_prefix in ("../", "/a", "a//", "a/../b/"):
        with pytest.raises(ValueError):
            store.list(rel_prefix)
    assert store.key("step-1/rank-00000.safetensors") == "ckpts/step-1/rank-00000.safetensors"


# -- check --


def test_check(store: S3Store, s3_bucket: RemoteConfig) -> None:
    store.check()
    with S3Store(dataclasses.replace(s3_bucket, bucket="ckptd-missing-bucket")) as s:
        with pytest.raises(CheckpointError, match=r"ckptd-missing-bucket.*does not exist"):
            s.check()


def test_check_unreachable_endpoint() -> None:
    config = _unreachable("ckptd-far-away")
    t0 = time.monotonic()
    with S3Store(config) as s, pytest.raises(CheckpointError) as info:
        s.check()
    assert "ckptd-far-away" in str(info.value) and config.endpoint_url in str(info.value)
    assert time.monotonic() - t0 < 5


# -- retries: faults injected in front of botocore's HTTP send, so its real retry handler runs --


class _RawBody:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Any:
        yield self._body


def _slow_down(request: Any) -> Any:
    from botocore.awsrequest import AWSResponse

    body = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
    return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _RawBody(body))


def _internal_error(request: Any) -> Any:
    from botocore.awsrequest import AWSResponse

    body = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code><Message>Internal error.</Message></Error>"
    return AWSResponse(request.url, 500, {"Content-Type": "application/xml"}, _RawBody(body))


def _connection_reset(request: Any) -> Any:
    from botocore.exceptions import ConnectionClosedError

    raise ConnectionClosedError(endpoint_url=request.url)


def _inject(store: S3Store, op: str, faults: list[Callable[[Any], Any]]) -> list[int]:
    """Answer the next requests of ``op`` with ``faults`` in order (each reads the body first, as a
    dropped upload would have), then let requests through. Returns the request count."""
    calls = [0]
    pending = list(faults)

    def handler(request: Any, **_: Any) -> Any:
        calls[0] += 1
        if not pending:
            return None
        if hasattr(request.body, "read"):
            request.body.read()  # botocore must rewind the body for the retry
        return pending.pop(0)(request)

    store.client.meta.events.register(f"before-send.s3.{op}", handler)
    return calls


@pytest.mark.parametrize(
    "op,size,faults",
    [
        ("PutObject", 1000, [_slow_down]),
        ("PutObject", 1000, [_connection_reset]),
        ("UploadPart", 6 * MiB, [_internal_error]),
        ("PutObject", 1000, [_connection_reset, _slow_down]),
    ],
    ids=["put-503", "put-reset", "part-500", "put-reset-then-503"],
)
def test_transient_failures_are_retried(s3_bucket: RemoteConfig, op: str, size: int, faults: list[Callable[[Any], Any]]) -> None:
    data = os.urandom(size)
    with S3Store(dataclasses.replace(s3_bucket, part_size=PART, max_attempts=3)) as s:
        calls = _inject(s, op, faults)
        s.put_bytes("obj", data)
        assert s.get_bytes("obj") == data
    sent = calls[0]
    assert sent == len(faults) + 1 + (1 if op == "UploadPart" else 0)  # + the second part of the multipart upload


def test_retries_exhausted_raises(s3_bucket: RemoteConfig) -> None:
    with S3Store(dataclasses.replace(s3_bucket, max_attempts=2)) as s:
        calls = _inject(s, "PutObject", [_slow_down] * 10)
        with pytest.raises(CheckpointError, match=rf"upload s3://{s3_bucket.bucket}/ckpts/obj .*SlowDown"):
            s.put_bytes("obj", b"x")
        assert calls[0] == 2
        assert not s.exists("obj")


# -- bandwidth --


def test_bandwidth_cap(s3_bucket: RemoteConfig) -> None:
    data = os.urandom(4 * MiB)
    with S3Store(s3_bucket) as free, S3Store(dataclasses.replace(s3_bucket, max_bandwidth=4 * MiB)) as capped:
        t0 = time.monotonic()
        free.put_bytes("free", data)
        uncapped = time.monotonic() - t0

        t0 = time.monotonic()
        capped.put_bytes("capped", data)
        up = time.monotonic() - t0
        assert up >= 0.5 and up > 2 * uncapped, (up, uncapped)

        t0 = time.monotonic()
        assert capped.get_bytes("free") == data
        assert time.monotonic() - t0 >= 0.5

        # the cap is per store, not per call: two 2 MiB uploads at once still share 4 MiB/s
        threads = [threading.Thread(target=capped.put_bytes, args=(f"t{i}", data[: 2 * MiB])) for i in range(2)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.monotonic() - t0 >= 0.75
        assert capped.list("t") == ["t0", "t1"]


# -- configuration --


def test_from_dict_accepts_all_fields() -> None:
    c = RemoteConfig.from_dict(
        {
            "bucket": "my-bucket.v2",
            "prefix": "jobs/llama/",
            "endpoint_url": "http://127.0.0.1:9000",
            "region": "eu-west-1",
            "max_bandwidth": 100 * MiB,
            "part_size": 8 * MiB,
            "max_attempts": 3,
            "connect_timeout": 2,
            "read_timeout": 30.5,
        }
    )
    assert c.prefix == "jobs/llama"
    assert c.connect_timeout == 2.0 and isinstance(c.connect_timeout, float)
    assert RemoteConfig.from_dict({"bucket": "abc"}) == RemoteConfig(bucket="abc")


@pytest.mark.parametrize(
    "d,match",
    [
        ({"bucket": "abc", "acl": "private"}, "unknown keys 'acl'"),
        ({"bucket": "abc", "zz": 1, "aa": 2}, "unknown keys 'aa', 'zz'"),
        ({}, "'bucket' is required"),
        ({"bucket": "ab"}, "invalid bucket name"),
        ({"bucket": "My-Bucket"}, "invalid bucket name"),
        ({"bucket": "my_bucket"}, "invalid bucket name"),
        ({"bucket": "-bucket"}, "invalid bucket name"),
        ({"bucket": "bucket-"}, "invalid bucket name"),
        ({"bucket": "a..b"}, "invalid bucket name"),
        ({"bucket": "192.168.1.1"}, "invalid bucket name"),
        ({"bucket": "b" * 64}, "invalid bucket name"),
        ({"bucket": "abc", "prefix": "a/../b"}, "'..'"),
        ({"bucket": "abc", "prefix": ".."}, "'..'"),
        ({"bucket": "abc", "prefix": "/abs"}, "must not start with '/'"),
        ({"bucket": "abc", "prefix": "a//b"}, "empty"),
        ({"bucket": 123}, "bucket must be str"),
        ({"bucket": "abc", "part_size": "64MiB"}, "part_size must be int"),
        ({"bucket": "abc", "max_attempts": True}, "max_attempts must be int"),
        ({"bucket": "abc", "max_bandwidth": 1.5}, "max_bandwidth must be int or None"),
        ({"bucket": "abc", "endpoint_url": 9000}, "endpoint_url must be str or None"),
        ({"bucket": "abc", "read_timeout": "60"}, "read_timeout must be int or float"),
        ({"bucket": "abc", "endpoint_url": "127.0.0.1:9000"}, "http:// or https://"),
        ({"bucket": "abc", "part_size": 1 * MiB}, "part_size must be between"),
        ({"bucket": "abc", "max_attempts": 0}, "at least 1"),
        ({"bucket": "abc", "max_bandwidth": 0}, "positive"),
        ({"bucket": "abc", "connect_timeout": 0}, "positive"),
    ],
)
def test_from_dict_rejects(d: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RemoteConfig.from_dict(d)


def test_from_dict_rejects_non_table() -> None:
    with pytest.raises(ValueError, match="table"):
        RemoteConfig.from_dict(["bucket"])  # type: ignore[arg-type]


def test_import_does_not_load_boto3() -> None:
    code = "import sys, ckptd, ckptd.storage.s3; sys.exit('boto3' in sys.modules or 'botocore' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
