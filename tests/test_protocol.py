"""Wire messages: exact encoding and validation of malformed requests."""

from __future__ import annotations

import json

import pytest

from ckptd.errors import ProtocolError
from ckptd.protocol import MAX_MESSAGE_BYTES, decode_request, reply_error, reply_ok, request


def test_request_bytes_exact() -> None:
    assert request("latest", 7, job="j") == b'{"v":1,"op":"latest","id":7,"job":"j"}'
    assert reply_ok(7, step=None) == b'{"v":1,"id":7,"ok":true,"step":null}'
    assert reply_error("x", "bad_request", "no") == b'{"v":1,"id":null,"ok":false,"code":"bad_request","error":"no"}'


def _alloc(**over) -> bytes:  # noqa: ANN003
    msg = {"v": 1, "op": "alloc", "id": 1, "job": "j", "rank": 0, "world_size": 2, "step": 3, "nbytes": 10, "pid": 1}
    msg.update(over)
    return json.dumps({k: v for k, v in msg.items() if v is not ...}).encode()


BAD = [
    ("not json", b"\xff\x00garbage", "not valid JSON"),
    ("array", b"[1,2]", "not a JSON object"),
    ("old version", _alloc(v=0), "protocol version 0"),
    ("unknown op", _alloc(op="format_disk"), "unknown op"),
    ("no id", _alloc(id=...), "'id'"),
    ("bool id", _alloc(id=True), "'id'"),
    ("missing field", _alloc(pid=...), "missing field 'pid'"),
    ("extra field", _alloc(evil=1), "unknown fields"),
    ("wrong type", _alloc(nbytes="10"), "wrong type"),
    ("bool as int", _alloc(step=True), "wrong type"),
    ("negative", _alloc(nbytes=-1), "'nbytes' = -1 is outside"),
    # bounds: one message must not make the daemon build, kill or allocate anything absurd
    ("pid 2**64", _alloc(pid=2**64), "not a process id"),
    ("pid 0", _alloc(pid=0), "not a process id"),
    ("pid negative", _alloc(pid=-1), "not a process id"),
    ("world 2**40", _alloc(world_size=2**40), "'world_size' = 1099511627776 is outside"),
    ("world 0", _alloc(world_size=0, rank=0), "'world_size' = 0 is outside"),
    ("step 2**64", _alloc(step=2**64), "'step'"),
    ("id 2**64", _alloc(id=2**64), "64-bit"),
    ("nbytes 2**60", _alloc(nbytes=2**60), "'nbytes'"),
    ("rank outside world", _alloc(rank=2), "outside world_size"),
    ("job traversal", _alloc(job="../x"), "invalid job name"),
    ("job slash", _alloc(job="a/b"), "invalid job name"),
    ("job empty", _alloc(job=""), "invalid job name"),
    ("too big", b" " * (MAX_MESSAGE_BYTES + 1), "exceeds"),
    ("alloc wait not bool", _alloc(wait=1), "wrong type"),
    ("alloc timeout negative", _alloc(timeout=-1), "finite number >= 0"),
    ("alloc timeout string", _alloc(timeout="600"), "wrong type"),
    ("alloc timeout NaN", _alloc(timeout=...)[:-1] + b',"timeout":NaN}', "finite"),
]


@pytest.mark.parametrize("frame,msg", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_rejected(frame: bytes, msg: str) -> None:
    with pytest.raises(ProtocolError, match=msg):
        decode_request(frame)


def test_good_request_accepted() -> None:
    assert decode_request(_alloc())["nbytes"] == 10


def test_unhashable_op_is_rejected_not_raised() -> None:
    with pytest.raises(ProtocolError, match="unknown op"):
        decode_request(b'{"v":1,"op":{},"id":1}')
    with pytest.raises(ProtocolError, match="unknown op"):
        decode_request(b'{"v":1,"op":["hello"],"id":1}')


def _commit(**over) -> bytes:  # noqa: ANN003
    msg = {
        "v": 1, "op": "commit", "id": 1, "job": "j", "rank": 0, "world_size": 2, "local_world_size": 2, "step": 3,
        "segment": "ckptd-0-0123456789abcdef/" + "a" * 32, "lease": "b" * 32, "nbytes": 10, "replicas": {},
    }  # fmt: skip
    msg.update(over)
    return json.dumps({k: v for k, v in msg.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    "frame,msg",
    [
        (_commit(local_world_size=3), "local_world_size 3 is not within"),
        (_commit(local_world_size=0), "'local_world_size' = 0"),
        (_commit(lease="../../etc"), "not a token"),
        (_commit(lease=...), "missing field 'lease'"),
        (_commit(segment="x" * 10_000), "longer than"),
        (_commit(replicas={"k": "short"}), "16-digit"),
        (_commit(replicas={"k": 5}), "16-digit"),
        (b'{"v":1,"op":"wait","id":1,"job":"j","step":1,"timeout":NaN}', "finite"),
        (b'{"v":1,"op":"wait","id":1,"job":"j","step":1,"timeout":Infinity}', "finite"),
        (b'{"v":1,"op":"hot_close","id":1,"pin":"' + b"c" * 32 + b'","segments":[1,2]}', "segment names"),
        (b'{"v":1,"op":"fetch_wait","id":1,"fetch":0,"timeout":1}', "'fetch' = 0"),
    ],
)
def test_bounds_on_other_ops(frame: bytes, msg: str) -> None:
    with pytest.raises(ProtocolError, match=msg):
        decode_request(frame)


def test_a_commit_record_is_checked_like_a_commit() -> None:
    from ckptd.protocol import validate_record

    good = {"job": "j", "rank": 0, "world_size": 2, "local_world_size": 2, "step": 3, "nbytes": 10, "replicas": {}}
    good |= {"committed_at": 5, "run": 7, "after": 2}
    assert validate_record(dict(good), b"{}").fields() == good
    older = {k: v for k, v in good.items() if k not in ("run", "after")}  # written before records named their attempt
    assert validate_record(older, b"{}").fields() == {**good, "run": None, "after": None}
    for bad, msg in (
        ({**good, "run": 0}, "'run' = 0 is outside"),
        ({**good, "run": "7"}, "'run' has the wrong type"),
        ({**good, "after": -1}, "'after' = -1 is outside"),
        ({**good, "job": "../escape"}, "invalid job name"),
        ({**good, "world_size": 2**40}, "world_size"),
        ({**good, "rank": 7}, "outside world_size"),
        ({**good, "tree": {}}, "unknown fields"),
        ({k: v for k, v in good.items() if k != "committed_at"}, "missing field"),
    ):
        with pytest.raises(ProtocolError, match=msg):
            validate_record(bad, b"{}")
