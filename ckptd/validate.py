"""Manifests and fragments read from where ckptd cannot vouch for them: a bucket another node wrote,
a disk anyone could have written, a step copied in by hand.

Every field that ckptd later uses is checked here, once, so a malformed file ends in a
:class:`~ckptd.errors.FormatError` that names the file and the field (``tensors['w'].chunks[3].byte_range``),
never in a ``KeyError``, a ``RecursionError`` or a path outside the step directory:

* a file name is a plain name inside the step directory (:func:`confined_name`);
* a document nests at most :data:`MAX_DOCUMENT_DEPTH` levels and a rank's tree at most
  ``config.MAX_TREE_DEPTH``, the limit :mod:`ckptd.state` writes and decodes trees under, and every
  tag in a tree is one that :func:`ckptd.state.unflatten` decodes;
* integers are JSON integers (``true`` is not ``1``), chunks lie inside their tensor, byte ranges
  lie inside their file and hold exactly their chunk, checksums are 16 lowercase hex digits.

Coverage (every element saved exactly once) is :func:`ckptd.coverage.check_coverage`'s job, the bytes
themselves :mod:`ckptd.storage.verify`'s. :mod:`ckptd.format` re-exports this module's public names.
Pure functions, no torch: safe on any thread, in the daemon, the trainer and the CLI.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from .config import MAX_STEP, MAX_TREE_DEPTH, MAX_WORLD_SIZE, validate_job
from .errors import FormatError
from .format import FORMAT_VERSION, MANIFEST_VERSION, MAX_DIMS, check_manifest_digest, itemsize
from .layout import MANIFEST, shard_name

_MAX_RUN = (1 << 63) - 1  # a launch id (protocol.MAX_ID)

MAX_NAME_BYTES = 255  # a file name, as Linux file systems allow
MAX_DOCUMENT_DEPTH = MAX_TREE_DEPTH + 3  # a rank's tree sits three levels down in a manifest: object, ranks list, entry
I64_MAX = _I64 = (1 << 63) - 1  # sizes, offsets, byte positions and commit times: torch and the file system count in int64
_HEX16 = re.compile(r"[0-9a-f]{16}")
_TAG = "__ckptd__"  # ckptd.state.TAG (that module imports torch, which the daemon never loads)
_KNOWN_TAGS = ("tensor", "tuple", "dict", "float", "odict", "ndarray", "npscalar", "bytes")
NUMPY_SCALARS = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64")
_FLOAT_WORDS = ("nan", "inf", "-inf")

_short = reprlib.Repr()  # hostile values are quoted in errors: keep them short
_short.maxstring = _short.maxother = 60
_short.maxlist = _short.maxdict = 8
_short.maxlevel = 3


def confined_name(name: Any, where: str, field: str = "") -> str:
    """``name`` if it is a plain file name that stays inside a step directory, else raise :class:`FormatError`
    naming the file it came from (``where``) and its ``field``. Every name from a manifest or a fragment
    passes here before it becomes a path."""
    ok = isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and not any(c in name for c in "/\\\0")
    if ok:
        try:
            ok = len(name.encode()) <= MAX_NAME_BYTES
        except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"): no file system can name it
            ok = False
    if not ok:
        raise FormatError(
            f"{where} names a file outside the step: {_short.repr(name)}{f' in {field}' if field else ''}"
            f" (a file name in a step has no '/', '\\' or NUL, is not '.', '..' or {MANIFEST}, and has at most {MAX_NAME_BYTES} bytes)"
        )
    return name


def nesting_depth(obj: Any, limit: int) -> int:
    """How deep ``obj`` nests (a scalar 0, ``[]`` 1, ``{"a": []}`` 2), counted without recursion; the
    count stops just past ``limit``."""
    deepest = 0
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        v, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list)))
    return deepest


_TOO_DEEP = object()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused, for the whole process, while many small objects are made
    and stay alive: a manifest parsed (3 MB for 10,000 tensors: collections over its objects doubled the
    time to read it), a restore planning every chunk and reading them. None of them is cyclic: reference
    counting frees them. Concurrent users may re-enable it for each other early; it is enabled again if
    it was before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_json(raw: bytes | str, where: str) -> Any:
    """Parse untrusted JSON (``where`` names it in errors); refuse it when it nests deeper than
    :data:`MAX_DOCUMENT_DEPTH`, whether ``json`` itself runs out of stack or not."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        obj = _TOO_DEEP
    except (ValueError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise FormatError(f"{where} is not valid JSON: {e}") from None
    if obj is _TOO_DEEP or nesting_depth(obj, MAX_DOCUMENT_DEPTH) > MAX_DOCUMENT_DEPTH:
        raise FormatError(f"{where}: JSON nests deeper than {MAX_DOCUMENT_DEPTH} levels")
    return obj


# ----------------------------------------------------------------------------- fields


def _fail(where: str, field: str, problem: str) -> NoReturn:
    raise FormatError(f"{where}: {field} {problem}")


def _int(v: Any, where: str, field: str, lo: int = 0, hi: int = _I64) -> int:
    if type(v) is not int or not lo <= v <= hi:  # type(), not isinstance(): JSON's true is not the integer 1
        _fail(where, field, f"must be an integer in [{lo}, {hi}], got {_short.repr(v)}")
    return v


def _ints(v: Any, where: str, field: str, n: int | None = None) -> list[int]:
    """A list of non-negative integers (of length ``n`` if given)."""
    if type(v) is not list or (n is not None and len(v) != n) or not all(type(x) is int and 0 <= x <= _I64 for x in v):
        _fail(where, field, f"must be a list of {'' if n is None else f'{n} '}non-negative integers, got {_short.repr(v)}")
    return v


def _str(v: Any, where: str, field: str) -> str:
    if type(v) is not str:
        _fail(where, field, f"must be a string, got {_short.repr(v)}")
    return v


def _hex(v: Any, where: str, field: str) -> str:
    if type(v) is not str or not _HEX16.fullmatch(v):
        _fail(where, field, f"must be 16 lowercase hex digits (XXH3-64), got {_short.repr(v)}")
    return v


def _object(v: Any, where: str, field: str) -> dict[str, Any]:
    if type(v) is not dict:
        _fail(where, field, f"must be a JSON object, got {_short.repr(v)}")
    return v


def _list(v: Any, where: str, field: str) -> list[Any]:
    if type(v) is not list:
        _fail(where, field, f"must be a list, got {_short.repr(v)}")
    return v


def _dtype_size(v: Any, where: str, field: str) -> int:
    try:
        return itemsize(v)
    except FormatError:
        _fail(where, field, f"{_short.repr(v)} is not a dtype this ckptd knows")


def _shape(v: Any, where: str, field: str) -> list[int]:
    if isinstance(v, list) and len(v) > MAX_DIMS:
        _fail(where, field, f"has {len(v)} dimensions, more than {MAX_DIMS}")
    shape = _ints(v, where, field)
    if math.prod(shape) > _I64:
        _fail(where, field, f"{_short.repr(v)} holds more than 2**63 - 1 elements")
    return shape


def _placement(c: dict[str, Any], where: str, field: str, shape: list[int]) -> int:
    """A chunk's ``offsets`` and ``sizes``, checked against its tensor's ``shape``; its element count."""
    offs = _ints(c.get("offsets"), where, f"{field}.offsets", len(shape))
    sizes = _ints(c.get("sizes"), where, f"{field}.sizes", len(shape))
    for d, (o, s, g) in enumerate(zip(offs, sizes, shape)):
        if o + s > g:
            _fail(where, f"{field}.offsets", f"{offs} with sizes {sizes} reach past the tensor's shape {shape} in dim {d}")
    return math.prod(sizes)


def _byte_range(v: Any, where: str, field: str, file: str, file_size: int, nbytes: int) -> None:
    b, e = _ints(v, where, field, 2)
    if not b <= e <= file_size:
        _fail(where, field, f"{v} does not lie within {file} ({file_size} bytes)")
    if e - b != nbytes:
        _fail(where, field, f"{v} holds {e - b} bytes, the chunk's sizes and dtype need {nbytes}")


def _envelope(obj: Any, where: str, kind: str) -> dict[str, Any]:
    """The fields every manifest and fragment has: kind, version, job, step, world size, commit time."""
    if type(obj) is not dict or obj.get("kind") != kind:
        raise FormatError(f"{where} is not a {kind.replace('-', ' ')}")
    version, known = obj.get("format_version"), (FORMAT_VERSION, MANIFEST_VERSION) if kind == "ckptd-manifest" else (FORMAT_VERSION,)
    if type(version) is not int or version not in known:
        raise FormatError(f"{where}: format_version {_short.repr(version)} is not supported (this ckptd reads {known[-1]})")
    try:
        validate_job(obj.get("job"))
    except ValueError as e:
        _fail(where, "job", f"is not valid: {e}")
    _int(obj.get("step"), where, "step", 0, MAX_STEP)
    _int(obj.get("world_size"), where, "world_size", 1, MAX_WORLD_SIZE)
    if "committed_at" in obj:  # absent from checkpoints written before it existed
        _int(obj["committed_at"], where, "committed_at")
    if "run" in obj:  # the launch that saved it; absent before it existed
        _int(obj["run"], where, "run", 1, _MAX_RUN)
    if obj.get("after") is not None:  # the step that launch had restored
        _int(obj["after"], where, "after", 0, MAX_STEP)
    return obj


# ----------------------------------------------------------------------------- trees


def _key_decodes_hashable(k: Any) -> bool:
    """Whether ``unflatten`` turns ``k`` into something a dict can be keyed by (no dicts inside)."""
    stack = [k]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            tag = v.get(_TAG)
            if tag == "tuple" and type(v.get("items")) is list:
                stack.extend(v["items"])
            elif tag not in ("tensor", "float", "npscalar"):
                return False
    return True


def _scalar_value(x: Any) -> bool:
    if type(x) in (bool, int, float):
        return True
    return type(x) is dict and x.get(_TAG) == "float" and x.get("value") in _FLOAT_WORDS and len(x) == 2


def _tagged_children(v: dict[str, Any], where: str, field: str) -> Iterable[Any]:
    """What a tagged node holds below it, once its tag checks out."""
    tag, items = v[_TAG], v.get("items")
    if tag in ("tensor", "ndarray", "bytes") and type(v.get("key")) is str:
        return ()
    if tag == "float" and v.get("value") in _FLOAT_WORDS:
        return ()
    if tag == "npscalar" and v.get("dtype") in NUMPY_SCALARS and _scalar_value(v.get("value")):
        return ()
    if tag == "tuple" and type(items) is list:
        return (items,)
    pairs_ok = type(items) is list and all(type(p) is list and len(p) == 2 and _key_decodes_hashable(p[0]) for p in items)
    if tag in ("dict", "odict") and pairs_ok:
        return (items,)
    if not isinstance(tag, str) or tag not in _KNOWN_TAGS:
        _fail(where, field, f"holds the unknown tag {_short.repr(tag)} (written by a newer ckptd?)")
    _fail(where, field, f"holds a malformed {tag!r} node: {_short.repr(v)}")


def _tree(tree: Any, where: str, field: str) -> None:
    """A rank's non-tensor state as :mod:`ckptd.state` writes it, walked without recursion."""
    _object(tree, where, field)
    if "extra" in tree:
        _object(tree["extra"], where, f"{field}['extra']")
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_TREE_DEPTH:
            _fail(where, field, f"nests deeper than {MAX_TREE_DEPTH} levels")
        if isinstance(v, dict):
            kids = _tagged_children(v, where, field) if _TAG in v else v.values()
        else:
            kids = v
        stack.extend((x, d + 1) for x in kids if isinstance(x, (dict, list)))


# ----------------------------------------------------------------------------- manifest


MAX_FILE_READ = 1 << 31  # a manifest, fragment or small file read whole: over this it is not one ckptd wrote


def read_regular(path: str, limit: int = MAX_FILE_READ) -> bytes:
    """The bytes of the regular file at ``path`` (a link to one is followed): a FIFO put in its place cannot block
    the open (``O_NONBLOCK``) and, like a device (a link to ``/dev/zero``) or a file over ``limit``, is refused with
    :class:`FormatError` before anything is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path} is not a regular file (a FIFO, a device or a directory): the checkpoint is corrupt or hostile")
        if st.st_size > limit:
            raise FormatError(f"{path} is {st.st_size} bytes, over the {limit} a ckptd file of its kind can be")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    finally:
        os.close(fd)


def read_manifest(step_dir: str) -> dict[str, Any]:
    """Read and validate ``step_dir/manifest.json``; raise :class:`FormatError` naming what is wrong."""
    path = os.path.join(step_dir, MANIFEST)
    try:
        raw = read_regular(path)
    except FileNotFoundError:
        raise FormatError(f"{step_dir} has no {MANIFEST}: not a complete ckptd checkpoint") from None
    except IsADirectoryError:
        raise FormatError(f"{path} is not a regular file (a FIFO, a device or a directory): the checkpoint is corrupt") from None
    return parse_manifest(raw, path)


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """A manifest's bytes from anywhere (a bucket object), parsed and validated; ``where`` names it in errors."""
    with gc_paused():
        obj = load_json(raw, where)
        if type(obj) is dict:
            check_manifest_digest(raw, obj, where)
        return validate_manifest(obj, where)


def validate_manifest(obj: Any, path: str, *, memory: bool = False) -> dict[str, Any]:
    """Check every field of a parsed manifest that ckptd uses (``path`` names it in errors); return it.
    ``memory``: the daemon's manifest of a memory-tier step (a hot restore's), whose checksums are ``null``.

    Not checked here: that the chunks cover their tensors (``check_coverage``) and what the files hold (``verify``).
    """
    _envelope(obj, path, "ckptd-manifest")
    if "attempt_objects" in obj and (obj["attempt_objects"] is not True or "run" not in obj):
        _fail(path, "attempt_objects", f"is {_short.repr(obj['attempt_objects'])}: only true, beside the attempt's run")
    files = _files(obj.get("files"), path, obj["world_size"], memory)
    for key, ent in _object(obj.get("tensors"), path, "tensors").items():
        _tensor(key, ent, path, files, memory)
    for i, r in enumerate(_list(obj.get("ranks"), path, "ranks")):
        field = f"ranks[{i}]"
        _object(r, path, field)
        _int(r.get("rank"), path, f"{field}.rank", 0, obj["world_size"] - 1)
        if type(r.get("file")) is not str or r["file"] not in files:
            _fail(path, f"{field}.file", f"{_short.repr(r.get('file'))} is not listed in files")
        _tree(r.get("tree"), path, f"{field}.tree")
    return obj


def _digest(v: Any, path: str, field: str, memory: bool) -> None:
    if not (memory and v is None):
        _hex(v, path, field)


def _files(v: Any, path: str, world_size: int, memory: bool = False) -> dict[str, Any]:
    for name, ent in _object(v, path, "files").items():
        field = f"files[{_short.repr(name)}]"
        confined_name(name, path, "files")
        _object(ent, path, field)
        _int(ent.get("rank"), path, f"{field}.rank", 0, world_size - 1)
        _int(ent.get("size"), path, f"{field}.size")
        _digest(ent.get("header_xxh3_64"), path, f"{field}.header_xxh3_64", memory)
    return v


def _tensor(key: Any, ent: Any, path: str, files: dict[str, Any], memory: bool = False) -> None:
    field = f"tensors[{_short.repr(key)}]"
    _str(key, path, field)
    _object(ent, path, field)
    item = _dtype_size(ent.get("dtype"), path, f"{field}.dtype")
    shape = _shape(ent.get("shape"), path, f"{field}.shape")
    for i, c in enumerate(_list(ent.get("chunks"), path, f"{field}.chunks")):
        cf = f"{field}.chunks[{i}]"
        _object(c, path, cf)
        file = c.get("file")
        if type(file) is not str or file not in files:
            _fail(path, f"{cf}.file", f"{_short.repr(file)} is not listed in files")
        _str(c.get("name"), path, f"{cf}.name")
        n = _placement(c, path, cf, shape)
        _byte_range(c.get("byte_range"), path, f"{cf}.byte_range", file, files[file]["size"], n * item)
        _digest(c.get("xxh3_64"), path, f"{cf}.xxh3_64", memory)


# ----------------------------------------------------------------------------- fragment


def parse_fragment(raw: bytes, where: str) -> dict[str, Any]:
    """A fragment's bytes (``rank-RRRRR.json``, from this node's disk or another node through the bucket),
    parsed and validated; ``where`` names it in errors."""
    with gc_paused():
        return validate_fragment(load_json(raw, where), where)


def validate_fragment(obj: Any, where: str) -> dict[str, Any]:
    """Check every field of a parsed fragment that :func:`ckptd.format.build_manifest` uses; return it."""
    _envelope(obj, where, "ckptd-fragment")
    ws = obj["world_size"]
    rank = _int(obj.get("rank"), where, "rank", 0, ws - 1)
    obj.setdefault("local_world_size", ws)  # written before multi-node steps: one node held every rank
    _int(obj["local_world_size"], where, "local_world_size", 1, ws)
    file = confined_name(obj.get("file"), where, "file")
    if file != shard_name(rank):
        _fail(where, "file", f"{file!r} is not {shard_name(rank)!r}, the shard of rank {rank}")
    size = _int(obj.get("size"), where, "size")
    _hex(obj.get("header_xxh3_64"), where, "header_xxh3_64")
    for i, c in enumerate(_list(obj.get("chunks"), where, "chunks")):
        field = f"chunks[{i}]"
        _object(c, where, field)
        _str(c.get("name"), where, f"{field}.name")
        _str(c.get("key"), where, f"{field}.key")
        item = _dtype_size(c.get("dtype"), where, f"{field}.dtype")
        n = _placement(c, where, field, _shape(c.get("global_shape"), where, f"{field}.global_shape"))
        _byte_range(c.get("byte_range"), where, f"{field}.byte_range", file, size, n * item)
        _hex(c.get("xxh3_64"), where, f"{field}.xxh3_64")
    for cid, dig in _object(obj.get("replicas"), where, "replicas").items():
        _hex(dig, where, f"replicas[{_short.repr(cid)}]")
    _tree(obj.get("tree"), where, "tree")
    return obj
