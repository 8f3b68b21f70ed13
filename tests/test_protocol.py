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
    ("negative", _alloc(nbytes=-1), "must be >= 0"),
    ("rank outside world", _alloc(rank=2), "outside world_size"),
    ("job traversal", _alloc(job="../x"), "invalid job name"),
    ("job slash", _alloc(job="a/b"), "invalid job name"),
    ("job empty", _alloc(job=""), "invalid job name"),
    ("too big", b" " * (MAX_MESSAGE_BYTES + 1), "exceeds"),
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
