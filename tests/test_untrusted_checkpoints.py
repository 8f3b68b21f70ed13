"""Untrusted checkpoints, attacked: a manifest or fragment (from a bucket, another node or a disk) that
names files outside its step, lies about byte ranges or offsets, or nests without end gets a
``FormatError`` naming the file and the field — never a traceback, never a file opened outside the
step — and the coverage check stays O(n log n) however many chunks a tensor has."""

from __future__ import annotations

import builtins
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _shards import shard_bytes
from conftest import REPO

from ckptd.config import MAX_TREE_DEPTH
from ckptd.coverage import check_coverage
from ckptd.errors import CheckpointError, FormatError
from ckptd.format import ShardOf, build_fragment, build_manifest, digest, parse_header
from ckptd.layout import MANIFEST, shard_name, step_dir
from ckptd.state import TAG, flatten, unflatten
from ckptd.storage.verify import verify_checkpoint
from ckptd.validate import confined_name, parse_fragment, read_manifest

JOB, STEP, WS = "j", 1, 2
KEY = "model/w"
TREE = {"model": {"w": {TAG: "tensor", "key": KEY}}, "extra": {"0": {"lr": 0.1, "betas": {TAG: "tuple", "items": [0.9, 0.99]}}}}


def _shards_and_fragments() -> list[tuple[bytes, dict[str, Any]]]:
    """Two ranks, each saving two rows of the float32 tensor ``model/w`` of shape [4, 3]."""
    out = []
    for r in range(WS):
        t = torch.arange(6, dtype=torch.float32).view(2, 3) + 6 * r
        buf = bytes(shard_bytes([(KEY, t, (2 * WS, 3), (2 * r, 0))]))
        layout = parse_header(memoryview(buf), len(buf))
        of = ShardOf(job=JOB, step=STEP, rank=r, world_size=WS, local_world_size=WS, replicas={}, tree=TREE, committed_at=7)
        out.append((buf, build_fragment(of, buf, layout)))
    return out


def _write_manifest(step: Path, manifest: dict[str, Any], tree_json: str | None = None) -> None:
    """``tree_json``: raw JSON for rank 0's tree (deeper than ``json.dumps`` could write)."""
    manifest = {k: v for k, v in manifest.items() if k != "digest"}
    text = json.dumps(manifest, separators=(",", ":"))
    if tree_json is not None:
        text = text.replace(json.dumps(manifest["ranks"][0]["tree"], separators=(",", ":")), tree_json, 1)
    # ended with the digest of what it holds, as its writer would: a hostile manifest, not a damaged one
    (step / MANIFEST).write_text(text[:-1] + ',"digest":"' + digest(text.encode()) + '"}')


def _manifest(step: Path) -> dict[str, Any]:
    return json.loads((step / MANIFEST).read_text())


@pytest.fixture
def step(tmp_path: Path) -> Path:
    d = Path(step_dir(str(tmp_path / "root"), JOB, STEP))
    d.mkdir(parents=True)
    pairs = _shards_and_fragments()
    for r, (buf, _) in enumerate(pairs):
        (d / shard_name(r)).write_bytes(buf)
    _write_manifest(d, build_manifest(JOB, STEP, WS, [f for _, f in pairs]))
    (d.parent / "x").write_bytes(pairs[0][0])  # sentinels outside the step, each a valid shard
    (d.parent / shard_name(0)).write_bytes(pairs[0][0])
    return d


@contextmanager
def _opened_paths() -> Iterator[list[str]]:
    """Every path passed to ``open`` or ``os.open`` inside the block, resolved."""
    paths: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def rec_open(file: Any, *a: Any, **kw: Any) -> Any:
        if isinstance(file, (str, bytes, os.PathLike)):
            paths.append(os.path.realpath(os.fsdecode(file)))
        return real_open(file, *a, **kw)

    def rec_os_open(path: Any, *a: Any, **kw: Any) -> int:
        paths.append(os.path.realpath(os.fsdecode(path)))
        return real_os_open(path, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", rec_open)
        mp.setattr(os, "open", rec_os_open)
        yield paths


def _assert_inside(paths: list[str], step: Path) -> None:
    outside = [p for p in paths if os.path.dirname(p) != os.path.realpath(step)]
    assert not outside, f"opened outside the step directory: {outside}"


def test_the_honest_step_passes_every_check(step: Path) -> None:
    m = read_manifest(str(step))
    assert m["files"][shard_name(1)]["rank"] == 1
    with _opened_paths() as paths:
        assert verify_checkpoint(str(step)) == []
    _assert_inside(paths, step)
    assert sorted(set(paths)) == sorted(str(step / n) for n in (MANIFEST, shard_name(0), shard_name(1)))
    for _, frag in _shards_and_fragments():
        assert parse_fragment(json.dumps(frag).encode(), "frag") == frag
    assert unflatten(m["ranks"][0]["tree"], lambda k: k)["extra"]["0"]["betas"] == (0.9, 0.99)


# ----------------------------------------------------------------------------- file names


HOSTILE_NAMES = ["/etc/hostname", "../x", "../" + shard_name(0), "../../../../../../etc/hostname", MANIFEST, "", ".", "..",
                 "sub/rank-00000.safetensors", "..\\x", "x\0y", "é" * 128, "\ud800"]  # fmt: skip


def _rename_file(m: dict[str, Any], old: str, new: str) -> None:
    m["files"][new] = m["files"].pop(old)
    for c in m["tensors"][KEY]["chunks"]:
        c["file"] = new if c["file"] == old else c["file"]
    for r in m["ranks"]:
        r["file"] = new if r["file"] == old else r["file"]


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_a_manifest_naming_a_file_outside_the_step_is_refused_and_nothing_outside_is_opened(step: Path, name: str) -> None:
    m = _manifest(step)
    _rename_file(m, shard_name(0), name)
    _write_manifest(step, m)
    with pytest.raises(FormatError, match="manifest.json names a file outside the step: .* in files") as e:
        read_manifest(str(step))
    assert str(step / MANIFEST) in str(e.value)
    with _opened_paths() as paths:
        problems = verify_checkpoint(str(step))
    assert problems == [str(e.value)]
    _assert_inside(paths, step)


def test_confined_name() -> None:
    for ok in (shard_name(0), "a..b", "é" * 127, "x" * 255):
        assert confined_name(ok, "here") == ok
    for bad in [*HOSTILE_NAMES, "x" * 256, None, 7, ["a"]]:
        with pytest.raises(FormatError, match="^here names a file outside the step: .* in f "):
            confined_name(bad, "here", "f")


def test_ckptd_verify_reports_a_hostile_manifest_without_a_traceback(step: Path) -> None:
    m = _manifest(step)
    _rename_file(m, shard_name(0), "/etc/hostname")
    m["tensors"][KEY]["chunks"][1]["byte_range"] = [True, 25]
    _write_manifest(step, m)
    r = subprocess.run([sys.executable, "-m", "ckptd", "verify", str(step)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 1 and "UNSOUND" in r.stdout, r.stderr
    assert "names a file outside the step: '/etc/hostname' in files" in r.stderr and "Traceback" not in r.stderr


def test_verify_does_not_hang_on_a_fifo_in_place_of_a_shard(step: Path) -> None:
    os.unlink(step / shard_name(1))
    os.mkfifo(step / shard_name(1))
    problems = verify_checkpoint(str(step))
    assert any(p.endswith(f"{shard_name(1)}: not a regular file") for p in problems), problems


@pytest.mark.parametrize("what", ["a FIFO", "a link to /dev/zero"])
def test_the_cli_does_not_hang_on_a_manifest_that_is_not_a_file(step: Path, what: str) -> None:
    """In a directory another user controls, a FIFO (or a link to /dev/zero, read until memory ran out) put in
    place of manifest.json or latest hung ckptd verify and ckptd ls --root for good."""
    os.unlink(step / MANIFEST)
    if what == "a FIFO":
        os.mkfifo(step / MANIFEST)
        os.mkfifo(step.parent / "latest")
    else:
        os.symlink("/dev/zero", step / MANIFEST)
        os.symlink("/dev/zero", step.parent / "latest")
    for args in (["verify", str(step)], ["ls", "--root", str(step.parent.parent)]):
        r = subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert "Traceback" not in r.stderr, r.stderr
        if args[0] == "verify":
            assert r.returncode == 1 and "is not a regular file" in r.stdout + r.stderr, (r.stdout, r.stderr)


# ----------------------------------------------------------------------------- fields of a manifest


def _chunk(m: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return m["tensors"][KEY]["chunks"][i]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation: set the field at ``path`` (keys and list indices) of the manifest to ``value``, or delete it."""

    def mutate(m: dict[str, Any]) -> None:
        node: Any = m
        for p in path[:-1]:
            node = node[p]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    return mutate


_DELETE = object()
C0 = ("tensors", KEY, "chunks", 0)
F0 = ("files", shard_name(0))
R0 = ("ranks", 0)
T0 = ("ranks", 0, "tree", "model")


def _range(m: dict[str, Any], f: Callable[[int, int, int], Any]) -> None:
    """Replace chunk 0's byte range ``[b, e]`` by ``f(b, e, size of its file)``."""
    b, e = _chunk(m)["byte_range"]
    _chunk(m)["byte_range"] = f(b, e, m["files"][_chunk(m)["file"]]["size"])


MANIFEST_ATTACKS = [
    ("past the file", lambda m: _range(m, lambda b, e, n: [n - 8, n + 16]), "chunks[0].byte_range", "does not lie within"),
    ("negative", lambda m: _range(m, lambda b, e, n: [-8, 16]), "chunks[0].byte_range", "non-negative integers"),
    ("bool", lambda m: _range(m, lambda b, e, n: [True, 25]), "chunks[0].byte_range", "non-negative integers"),
    ("floats", lambda m: _range(m, lambda b, e, n: [float(b), float(e)]), "chunks[0].byte_range", "non-negative integers"),
    ("wrong length", lambda m: _range(m, lambda b, e, n: [b - 4, e]), "chunks[0].byte_range", "holds 28 bytes"),
    ("reversed", lambda m: _range(m, lambda b, e, n: [e, b]), "chunks[0].byte_range", "does not lie within"),
    ("three ends", lambda m: _range(m, lambda b, e, n: [b, e, e]), "chunks[0].byte_range", "2 non-negative"),
    ("a string", lambda m: _range(m, lambda b, e, n: f"{b}-{e}"), "chunks[0].byte_range", "list of 2"),
    ("missing", _set((*C0, "byte_range"), _DELETE), "chunks[0].byte_range", "list of 2"),
    ("offset outside shape", _set((*C0, "offsets"), [3, 0]), "chunks[0].offsets", "reach past the tensor's shape"),
    ("negative offset", _set((*C0, "offsets"), [-1, 0]), "chunks[0].offsets", "non-negative"),
    ("bool offset", _set((*C0, "offsets"), [False, 0]), "chunks[0].offsets", "non-negative"),
    ("offsets of another rank", _set((*C0, "offsets"), [0]), "chunks[0].offsets", "list of 2"),
    ("sizes outside shape", _set((*C0, "sizes"), [2, 4]), "chunks[0].offsets", "reach past"),
    ("shape of bools", _set(("tensors", KEY, "shape"), [4, True]), f"tensors['{KEY}'].shape", "non-negative"),
    ("unknown dtype", _set(("tensors", KEY, "dtype"), "Q7"), f"tensors['{KEY}'].dtype", "not a dtype"),
    ("chunks not a list", _set(("tensors", KEY, "chunks"), {}), f"tensors['{KEY}'].chunks", "must be a list"),
    ("uppercase checksum", _set((*C0, "xxh3_64"), "ABCDEF0123456789"), "chunks[0].xxh3_64", "16 lowercase hex"),
    ("short checksum", _set((*C0, "xxh3_64"), "abc"), "chunks[0].xxh3_64", "16 lowercase hex"),
    ("unlisted file", _set((*C0, "file"), shard_name(9)), "chunks[0].file", "not listed in files"),
    ("chunk name", _set((*C0, "name"), 5), "chunks[0].name", "must be a string"),
    ("step bool", _set(("step",), True), "step", "must be an integer"),
    ("step negative", _set(("step",), -1), "step", "must be an integer"),
    ("world size 0", _set(("world_size",), 0), "world_size", "must be an integer in [1,"),
    ("world size bool", _set(("world_size",), True), "world_size", "must be an integer"),
    ("committed_at negative", _set(("committed_at",), -1), "committed_at", "must be an integer"),
    ("job escapes", _set(("job",), "../evil"), "job", "is not valid"),
    ("version bool", _set(("format_version",), True), "format_version True", "not supported"),
    ("file rank", _set((*F0, "rank"), 2), f"files['{shard_name(0)}'].rank", "[0, 1]"),
    ("file size", _set((*F0, "size"), -1), f"files['{shard_name(0)}'].size", "must be an integer"),
    ("file header", _set((*F0, "header_xxh3_64"), None), f"files['{shard_name(0)}'].header_xxh3_64", "16 lowercase hex"),
    ("file entry", _set(F0, [1]), f"files['{shard_name(0)}']", "must be a JSON object"),
    ("files", _set(("files",), []), "files", "must be a JSON object"),
    ("rank", _set((*R0, "rank"), 5), "ranks[0].rank", "must be an integer"),
    ("rank file", _set((*R0, "file"), "nope"), "ranks[0].file", "not listed in files"),
    ("tree not an object", _set((*R0, "tree"), []), "ranks[0].tree", "must be a JSON object"),
    ("extra not an object", _set((*R0, "tree", "extra"), [1]), "ranks[0].tree['extra']", "must be a JSON object"),
    ("unknown tag", _set(T0, {TAG: "martian"}), "ranks[0].tree", "unknown tag 'martian'"),
    ("tensor tag", _set(T0, {TAG: "tensor", "key": 5}), "ranks[0].tree", "malformed 'tensor'"),
    ("float tag", _set(T0, {TAG: "float", "value": "1e999"}), "ranks[0].tree", "malformed 'float'"),
    ("tuple tag", _set(T0, {TAG: "tuple", "items": 5}), "ranks[0].tree", "malformed 'tuple'"),
    ("dict tag pair", _set(T0, {TAG: "dict", "items": [[1, 2, 3]]}), "ranks[0].tree", "malformed 'dict'"),
    ("dict tag key", _set(T0, {TAG: "dict", "items": [[{"a": 1}, 2]]}), "ranks[0].tree", "malformed 'dict'"),
    ("tuple key of dicts", _set(T0, {TAG: "dict", "items": [[{TAG: "tuple", "items": [{}]}, 2]]}),
     "ranks[0].tree", "malformed 'dict'"),
]  # fmt: skip


@pytest.mark.parametrize("case,mutate,field,problem", MANIFEST_ATTACKS, ids=[a[0] for a in MANIFEST_ATTACKS])
def test_every_malformed_manifest_field_is_a_format_error_naming_file_and_field(
    step: Path, case: str, mutate: Callable[[dict[str, Any]], None], field: str, problem: str
) -> None:
    m = _manifest(step)
    mutate(m)
    _write_manifest(step, m)
    with pytest.raises(FormatError) as e:
        read_manifest(str(step))
    msg = str(e.value)
    assert msg.startswith(f"{step / MANIFEST}: ") and field in msg and problem in msg, msg
    with _opened_paths() as paths:
        assert verify_checkpoint(str(step)) == [msg]
    _assert_inside(paths, step)


# ----------------------------------------------------------------------------- nesting


def _deep_json(depth: int) -> str:
    """A JSON object nesting ``depth`` levels: ``{"a": {"a": ... 1}}``."""
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [10_000, 300, MAX_TREE_DEPTH + 1])
def test_a_manifest_with_a_deep_tree_is_refused_without_recursion_error(step: Path, depth: int) -> None:
    _write_manifest(step, _manifest(step), tree_json=_deep_json(depth))
    with pytest.raises(FormatError, match="nests deeper than") as e:
        read_manifest(str(step))
    assert str(step / MANIFEST) in str(e.value)
    assert verify_checkpoint(str(step)) == [str(e.value)]


def test_a_tree_as_deep_as_allowed_is_read_and_decoded(step: Path) -> None:
    _write_manifest(step, _manifest(step), tree_json=_deep_json(MAX_TREE_DEPTH))
    tree = read_manifest(str(step))["ranks"][0]["tree"]
    node = unflatten(tree, lambda k: k)
    for _ in range(MAX_TREE_DEPTH - 1):
        node = node["a"]
    assert node == {"a": 1}


def _fragment_json(tree_json: str | None = None, **fields: Any) -> bytes:
    """Rank 0's fragment with ``fields`` replaced (and its tree by the raw JSON ``tree_json``)."""
    frag = _shards_and_fragments()[0][1] | fields
    text = json.dumps(frag)
    if tree_json is not None:
        text = text.replace(json.dumps(frag["tree"]), tree_json, 1)
    return text.encode()


@pytest.mark.parametrize("depth", [10_000, 300, MAX_TREE_DEPTH + 1])
def test_a_fragment_with_a_deep_tree_is_refused(depth: int) -> None:
    with pytest.raises(FormatError, match="^node-7/rank-00000.json: .*nests deeper than"):
        parse_fragment(_fragment_json(_deep_json(depth)), "node-7/rank-00000.json")
    assert parse_fragment(_fragment_json(_deep_json(MAX_TREE_DEPTH)), "f")["rank"] == 0


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe{}", b"[]", b'"fragment"', b"1" * 5000, b'{"kind": "ckptd-fragment"} x'])
def test_a_fragment_that_is_not_a_json_object_is_refused(raw: bytes) -> None:
    with pytest.raises(FormatError, match="^where is not (valid JSON|a ckptd fragment)"):
        parse_fragment(raw, "where")


def test_unflatten_refuses_a_deep_tree_instead_of_overflowing_the_stack() -> None:
    tree: Any = 1
    for _ in range(10_000):
        tree = {"a": tree}
    with pytest.raises(FormatError, match=f"deeper than {MAX_TREE_DEPTH} levels"):
        unflatten(tree, lambda k: k)


def _nested(kind: str, depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = {"a": v} if kind == "dict" else (v,) if kind == "tuple" else {1: v}
    return v


@pytest.mark.parametrize("kind", ["dict", "tuple", "int-keyed dict"])
def test_flatten_refuses_what_a_reader_would_refuse_and_nothing_else(kind: str) -> None:
    """Around the limit, every tree ``flatten`` writes parses as a fragment; the deeper ones it refuses."""
    written = refused = 0
    for depth in range(MAX_TREE_DEPTH // 3 - 4, MAX_TREE_DEPTH + 2):
        try:
            tree, _ = flatten({"extra": _nested(kind, depth)})
        except ValueError as e:
            assert f"deeper than {MAX_TREE_DEPTH} levels" in str(e) and "extra" in str(e)
            refused += 1
            continue
        written += 1
        assert parse_fragment(_fragment_json(json.dumps(tree)), "f")["tree"] == tree
        unflatten(tree, lambda k: k)
    assert written and refused


# ----------------------------------------------------------------------------- fields of a fragment

FRAGMENT_ATTACKS = [
    ("a manifest", {"kind": "ckptd-manifest"}, "is not a ckptd fragment"),
    ("newer version", {"format_version": 2}, "format_version 2 is not supported"),
    ("job", {"job": ""}, "job is not valid"),
    ("rank past world size", {"rank": 2}, "rank must be an integer in [0, 1]"),
    ("rank bool", {"rank": True}, "rank must be an integer"),
    ("world size", {"world_size": 0}, "world_size must be an integer in [1,"),
    ("local world size", {"local_world_size": 3}, "local_world_size must be an integer in [1, 2]"),
    ("file escapes", {"file": "../../etc/passwd"}, "names a file outside the step: '../../etc/passwd' in file"),
    ("file absolute", {"file": "/etc/hostname"}, "names a file outside the step"),
    ("another rank's file", {"file": shard_name(1)}, f"file '{shard_name(1)}' is not '{shard_name(0)}'"),
    ("size", {"size": -1}, "size must be an integer"),
    ("header", {"header_xxh3_64": "x" * 16}, "header_xxh3_64 must be 16 lowercase hex"),
    ("replicas", {"replicas": {"id": "nothex"}}, "replicas['id'] must be 16 lowercase hex"),
    ("replicas list", {"replicas": []}, "replicas must be a JSON object"),
    ("committed_at", {"committed_at": True}, "committed_at must be an integer"),
    ("tree", {"tree": 5}, "tree must be a JSON object"),
    ("chunks", {"chunks": None}, "chunks must be a list"),
]  # fmt: skip


def _bad_chunk(**fields: Any) -> dict[str, Any]:
    return {"chunks": [_shards_and_fragments()[0][1]["chunks"][0] | fields]}


FRAGMENT_CHUNK_ATTACKS = [
    ("byte range past the shard", {"byte_range": [10_000, 10_024]}, "chunks[0].byte_range [10000, 10024] does not lie within"),
    ("byte range bool", {"byte_range": [False, 24]}, "chunks[0].byte_range must be a list of 2"),
    ("offsets outside", {"offsets": [4, 0]}, "chunks[0].offsets [4, 0] with sizes [2, 3] reach past"),
    ("global shape bools", {"global_shape": [4, True]}, "chunks[0].global_shape must be a list"),
    ("dtype", {"dtype": ["F32"]}, "chunks[0].dtype ['F32'] is not a dtype"),
    ("key", {"key": 5}, "chunks[0].key must be a string"),
    ("checksum", {"xxh3_64": 0}, "chunks[0].xxh3_64 must be 16 lowercase hex"),
]  # fmt: skip


@pytest.mark.parametrize(
    "fields,problem",
    [(f, p) for _, f, p in FRAGMENT_ATTACKS] + [(_bad_chunk(**f), p) for _, f, p in FRAGMENT_CHUNK_ATTACKS],
    ids=[a[0] for a in FRAGMENT_ATTACKS] + [a[0] for a in FRAGMENT_CHUNK_ATTACKS],
)
def test_every_malformed_fragment_field_is_a_format_error(fields: dict[str, Any], problem: str) -> None:
    where = "s3://b/j/step-1/rank-00000.json"
    with pytest.raises(FormatError) as e:
        parse_fragment(_fragment_json(**fields), where)
    assert str(e.value).startswith(where) and problem in str(e.value), str(e.value)


def test_disagreeing_replicas_with_a_foreign_id_still_name_it() -> None:
    f0, f1 = (f for _, f in _shards_and_fragments())
    f0["replicas"], f1["replicas"] = {"[[[": "a" * 16}, {"[[[": "b" * 16}
    with pytest.raises(CheckpointError, match=r"chunk '\[\[\[': ranks 0 and 1 hold different bytes"):
        build_manifest(JOB, STEP, WS, [f0, f1])


# ----------------------------------------------------------------------------- coverage


def _box(offsets: list[int], sizes: list[int], file: str = "f") -> dict[str, Any]:
    return {"offsets": offsets, "sizes": sizes, "file": file}


def _coverage(shape: list[int], chunks: list[dict[str, Any]]) -> str:
    """``check_coverage``'s verdict: "ok", "overlap" or "count"."""
    try:
        check_coverage({"t": {"shape": shape, "chunks": chunks}})
    except CheckpointError as e:
        assert str(e).startswith("tensor 't'"), e
        return "overlap" if "overlap" in str(e) else "count"
    return "ok"


def test_fifty_thousand_chunks_sharing_offset_zero_are_checked_fast() -> None:
    """A tensor sharded along dim 1 in 50,000 columns: every chunk starts at 0 on dim 0 (quadratic before)."""
    n = 50_000
    chunks = [_box([0, i], [8, 1]) for i in range(n)]
    assert _coverage([8, n], chunks) == "ok"
    with pytest.raises(CheckpointError, match=r"offsets \[0, 25000\] .* overlap"):
        check_coverage({"t": {"shape": [8, n], "chunks": chunks + [_box([0, 25_000], [8, 1], "g")]}})
    assert _coverage([8, n], chunks[:-1]) == "count"


def test_a_large_uneven_tp_by_fsdp_grid_is_checked_fast() -> None:
    rows = [0, *sorted(random.Random(1).sample(range(1, 100_000), 249)), 100_000]  # 250 uneven row shards
    cols = [0, *sorted(random.Random(2).sample(range(1, 1_000), 199)), 1_000]  # 200 uneven column shards
    chunks = [_box([r0, c0], [r1 - r0, c1 - c0]) for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(cols, cols[1:])]
    assert len(chunks) == 50_000 and _coverage([100_000, 1_000], chunks) == "ok"
    chunks[-1] = _box([rows[-2], cols[-2] - 1], [rows[-1] - rows[-2], cols[-1] - cols[-2]])  # one column too far left
    assert _coverage([100_000, 1_000], chunks) == "overlap"


@pytest.mark.parametrize(
    "shape,boxes,verdict",
    [
        ([], [([], [])], "ok"),  # a scalar
        ([], [([], []), ([], [])], "overlap"),
        ([], [], "count"),
        ([0, 4], [([0, 0], [0, 4]), ([0, 0], [0, 4])], "ok"),  # zero-size: every rank saves an empty chunk
        ([4, 0], [([0, 0], [4, 0]), ([2, 0], [2, 0])], "ok"),
        ([6], [([3], [0]), ([0], [3]), ([3], [3])], "ok"),  # an empty chunk inside another holds nothing
        ([10], [([0], [3]), ([3], [4]), ([7], [3])], "ok"),  # uneven 1-D
        ([10], [([0], [4]), ([3], [4]), ([7], [3])], "overlap"),
        ([10], [([0], [10]), ([2], [1]), ([9], [1])], "overlap"),
        ([2, 6], [([0, 0], [2, 3]), ([0, 3], [2, 3])], "ok"),  # dim-1 sharding
        ([2, 6], [([0, 0], [2, 4]), ([0, 3], [2, 3])], "overlap"),
        ([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 2]), ([2, 2], [2, 2])], "ok"),  # 2 x 2 grid
        ([4, 4], [([0, 0], [2, 4]), ([2, 0], [2, 2]), ([1, 2], [3, 2])], "overlap"),
        ([4, 4], [([0, 0], [2, 4]), ([2, 0], [2, 2]), ([2, 2], [1, 2])], "count"),
    ],
)
def test_coverage_cases(shape: list[int], boxes: list[tuple[list[int], list[int]]], verdict: str) -> None:
    assert _coverage(shape, [_box(o, s) for o, s in boxes]) == verdict


def _tiling(rng: random.Random, shape: list[int], pieces: int) -> list[tuple[list[int], list[int]]]:
    """An exact, irregular cover of ``shape``: boxes split at random along random dimensions."""
    boxes = [([0] * len(shape), list(shape))]
    for _ in range(pieces):
        i = rng.randrange(len(boxes))
        offs, sizes = boxes[i]
        dims = [d for d, s in enumerate(sizes) if s > 1]
        if not dims:
            continue
        d = rng.choice(dims)
        cut = rng.randrange(1, sizes[d])
        a, b = (list(offs), list(sizes)), (list(offs), list(sizes))
        a[1][d], b[0][d], b[1][d] = cut, offs[d] + cut, sizes[d] - cut
        boxes[i : i + 1] = [a, b]
    return boxes


def _reference(shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> str:
    full = [b for b in boxes if math.prod(b[1])]
    for i, (o1, s1) in enumerate(full):
        for o2, s2 in full[i + 1 :]:
            if all(a < c + t and c < a + s for a, s, c, t in zip(o1, s1, o2, s2)):
                return "overlap"
    return "ok" if sum(math.prod(s) for _, s in boxes) == math.prod(shape) else "count"


def test_coverage_agrees_with_brute_force_on_random_shardings() -> None:
    """Exact and damaged covers in one to four dimensions: grids, guillotine cuts, shifted and dropped chunks."""
    rng = random.Random(0)
    seen = set()
    for trial in range(600):
        ndim = rng.randint(1, 4)
        shape = [rng.randint(1, 9) for _ in range(ndim)]
        boxes = _tiling(rng, shape, rng.randint(0, 30))
        damage = rng.choice(["none", "drop", "duplicate", "shift", "empty"])
        if damage == "drop" and len(boxes) > 1:
            boxes.pop(rng.randrange(len(boxes)))
        elif damage == "duplicate":
            boxes.append(rng.choice(boxes))
        elif damage == "shift":
            offs, sizes = boxes.pop(rng.randrange(len(boxes)))
            d = rng.randrange(ndim)
            offs = list(offs)
            offs[d] = rng.randrange(0, shape[d] - sizes[d] + 1)
            boxes.append((offs, sizes))
        elif damage == "empty":
            d = rng.randrange(ndim)
            boxes.append(([rng.randrange(shape[d] + 1) if i == d else 0 for i in range(ndim)], [0 if i == d else 1 for i in range(ndim)]))
        rng.shuffle(boxes)
        want = _reference(shape, boxes)
        assert _coverage(shape, [_box(o, s) for o, s in boxes]) == want, (trial, shape, boxes)
        seen.add(want)
    assert seen == {"ok", "overlap", "count"}
