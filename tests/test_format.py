"""The shard and manifest format, byte for byte, and rejection of malformed input."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from ckptd.errors import FormatError
from ckptd.files import write_json_durable
from ckptd.format import FORMAT_VERSION, build_layout, parse_header
from ckptd.validate import read_manifest


def _layout():
    return build_layout(
        [
            ("model/b", "model/b", torch.float16, (2,), (4,), (2,)),
            ("model/w", "model/w", torch.float32, (2, 3), (2, 3), (0, 0)),
        ]
    )


def test_header_bytes_exact() -> None:
    lay = _layout()
    meta = (
        '{"format_version":1,"chunks":{"model/w":{"key":"model/w","global_shape":[2,3],"offsets":[0,0]},'
        '"model/b":{"key":"model/b","global_shape":[4],"offsets":[2]}}}'
    )
    body = json.dumps(
        {
            "__metadata__": {"ckptd": meta},
            "model/w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "model/b": {"dtype": "F16", "shape": [2], "data_offsets": [24, 28]},
        },
        separators=(",", ":"),
    ).encode()
    body += b" " * ((-(8 + len(body))) % 64)
    assert lay.header == struct.pack("<Q", len(body)) + body
    assert len(lay.header) % 64 == 0
    assert lay.file_size == len(lay.header) + 28
    # wider dtypes first keeps every chunk aligned to its element size
    assert [c.name for c in lay.chunks] == ["model/w", "model/b"]


def test_shard_is_a_safetensors_file(tmp_path) -> None:
    from safetensors.torch import load_file

    lay = _layout()
    w = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = torch.tensor([1.5, -2.0], dtype=torch.float16)
    buf = bytearray(lay.file_size)
    buf[: lay.data_start] = lay.header
    for c, t in zip(lay.chunks, (w, b)):
        buf[lay.data_start + c.begin : lay.data_start + c.end] = t.numpy().tobytes()
    (tmp_path / "s.safetensors").write_bytes(bytes(buf))
    got = load_file(str(tmp_path / "s.safetensors"))
    assert torch.equal(got["model/w"], w) and torch.equal(got["model/b"], b)
    back = parse_header(memoryview(bytes(buf)), len(buf))
    assert back.chunks == lay.chunks


def _mutate_header(obj_fn) -> bytes:  # noqa: ANN001
    lay = _layout()
    (n,) = struct.unpack_from("<Q", lay.header)
    obj = json.loads(lay.header[8 : 8 + n])
    obj_fn(obj)
    body = json.dumps(obj).encode()
    return struct.pack("<Q", len(body)) + body + bytes(28)


def _set_meta(obj, **kw) -> None:  # noqa: ANN001
    meta = json.loads(obj["__metadata__"]["ckptd"])
    meta.update(kw)
    obj["__metadata__"]["ckptd"] = json.dumps(meta)


BAD_HEADERS = [
    ("length beyond data", lambda: struct.pack("<Q", 1 << 40) + b"{}", "out of bounds"),
    ("not json", lambda: struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
    ("no ckptd metadata", lambda: _mutate_header(lambda o: o.pop("__metadata__")), "not a ckptd shard"),
    ("newer version", lambda: _mutate_header(lambda o: _set_meta(o, format_version=FORMAT_VERSION + 1)), "not supported"),
    ("size mismatch", lambda: _mutate_header(lambda o: o["model/w"].update(shape=[1, 3])), "do not match"),
    ("gap", lambda: _mutate_header(lambda o: o["model/b"].update(data_offsets=[26, 30])), "not packed"),
    ("unknown dtype", lambda: _mutate_header(lambda o: o["model/b"].update(dtype="Q7")), "unknown dtype"),
    ("outside global", lambda: _mutate_header(lambda o: _set_meta(o, chunks={
        "model/w": {"key": "model/w", "global_shape": [2, 3], "offsets": [1, 0]},
        "model/b": {"key": "model/b", "global_shape": [4], "offsets": [2]}})), "do not fit"),
    ("chunk lists differ", lambda: _mutate_header(lambda o: _set_meta(o, chunks={})), "different chunks"),
    ("data_offsets not a list", lambda: _mutate_header(lambda o: o["model/b"].update(data_offsets=7)), "must be \\[begin, end\\]"),
    ("offset past int64", lambda: _mutate_header(lambda o: o["model/b"].update(data_offsets=[24, 1 << 63])), "at most 64 integers"),
]  # fmt: skip


def test_a_header_of_thousands_of_huge_dimensions_is_refused_before_any_arithmetic() -> None:
    """The attack: a lessee commits a shard whose header gives a chunk 700 dimensions of 4,300 digits each.
    Multiplying them held the GIL for 50 s (the daemon's loop stopped answering, past systemd's watchdog);
    the refusal must come from counting, and the message (logged, shown by ``status``) stay short."""
    huge = [int("9" * 4300)] * 700
    buf = _mutate_header(lambda o: o["model/w"].update(shape=huge))
    with pytest.raises(FormatError, match="at most 64 integers") as err:
        parse_header(memoryview(buf), len(buf))
    assert len(str(err.value)) < 400


@pytest.mark.parametrize("case,make,msg", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
def test_bad_headers_rejected(case: str, make, msg: str) -> None:  # noqa: ANN001
    buf = make()
    with pytest.raises(FormatError, match=msg):
        parse_header(memoryview(buf), len(buf))


def test_truncated_data_rejected() -> None:
    lay = _layout()
    with pytest.raises(FormatError, match="beyond"):
        parse_header(memoryview(lay.header + bytes(10)), len(lay.header) + 10)


def test_manifest_version_and_kind_checked(tmp_path) -> None:
    base = {"format_version": FORMAT_VERSION, "kind": "ckptd-manifest", "job": "j", "step": 1, "world_size": 1}
    base |= {"files": {}, "tensors": {}, "ranks": []}
    write_json_durable(str(tmp_path / "manifest.json"), base)
    assert read_manifest(str(tmp_path))["step"] == 1
    write_json_durable(str(tmp_path / "manifest.json"), base | {"format_version": 99})
    with pytest.raises(FormatError, match="format_version 99"):
        read_manifest(str(tmp_path))
    write_json_durable(str(tmp_path / "manifest.json"), base | {"kind": "other"})
    with pytest.raises(FormatError, match="not a ckptd manifest"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{trunc")
    with pytest.raises(FormatError, match="not valid JSON"):
        read_manifest(str(tmp_path))
    with pytest.raises(FormatError, match="no manifest.json"):
        read_manifest(str(tmp_path / "nowhere"))
