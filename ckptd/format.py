"""Shard files and manifests: the on-disk format, specified here in prose and tested byte for byte.

Shard file (one per rank and step, ``rank-RRRRR.safetensors``) — a valid safetensors file:

* bytes ``[0, 8)``: ``N``, the header length, unsigned 64-bit little-endian;
* bytes ``[8, 8+N)``: a UTF-8 JSON object, right-padded with spaces (0x20) so that ``8+N`` is a
  multiple of 64. Each key except ``__metadata__`` names one tensor chunk and maps to
  ``{"dtype": D, "shape": [..], "data_offsets": [b, e]}``; ``b``/``e`` count from byte ``8+N``.
  ``__metadata__`` maps ``"ckptd"`` to a JSON string ``{"format_version": 1, "chunks": {name:
  {"key": K, "global_shape": [..], "offsets": [..]}}}`` that places each chunk in its global tensor.
* bytes ``[8+N, end)``: the chunks' raw little-endian bytes, packed without gaps in header order,
  larger element sizes first, so every chunk is aligned to its element size.

The trainer writes exactly these bytes into the daemon's shared-memory slot, so persisting a slot
is one sequential write and the daemon never deserializes tensors.

Manifest (``manifest.json``, written last; a step directory without it is not a checkpoint):
a JSON object with ``format_version`` (integer, :data:`MANIFEST_VERSION`; 1 before manifests carried
``digest``, the checksum of the rest, last: :func:`encode_manifest`), ``kind``
``"ckptd-manifest"``, ``job``, ``step``, ``world_size``, ``created_unix``, ``files`` (file name →
``{"rank", "size", "header_xxh3_64"}``), ``committed_at`` (integer, nanoseconds since the epoch when
the daemon accepted the step's last commit; 0 in checkpoints written before it existed: it orders
steps for ``latest``), ``tensors`` (state key → ``{"dtype", "shape", "chunks":
[{"file", "name", "offsets", "sizes", "byte_range", "xxh3_64"}]}``, ``byte_range`` absolute in the
file) and ``ranks`` (one ``{"rank", "file", "tree"}`` per saving rank: the non-tensor state as a
tagged JSON tree, see :mod:`ckptd.state`); ``run`` and ``after`` name the attempt that saved it (see
:func:`attempt_of`), and a multi-node step's manifest in the bucket has ``attempt_objects: true``: its
files lie in that attempt's folder (:func:`objects_folder`). Checksums are XXH3-64 as 16 lowercase hex digits.
Readers trust none of it: :mod:`ckptd.validate` checks every field, file names and nesting depth included.

Fragment (``rank-RRRRR.json``, one per rank beside its shard until the step completes): a JSON object
with ``format_version``, ``kind`` ``"ckptd-fragment"``, ``job``, ``step``, ``rank``, ``world_size``,
``local_world_size``, ``file``, ``size``, ``header_xxh3_64``, ``chunks`` (``{"name", "key", "dtype",
"sizes", "global_shape", "offsets", "byte_range", "xxh3_64"}`` each), ``replicas`` (chunk id → sample
digest of the chunks other ranks hold too), ``committed_at`` and ``tree``. :func:`build_manifest` merges them.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from .coverage import check_coverage
from .errors import CheckpointError, FormatError
from .layout import attempt_folder, shard_name

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
MANIFEST_VERSION = 2  # a manifest ending with its own digest (:func:`encode_manifest`); version 1 ones are read as before
HEADER_ALIGN = 64
MAX_HEADER_BYTES = 256 << 20  # refuse absurd headers from untrusted shared memory or disk
MAX_DIMS = 64  # torch allows at most 64 dimensions; more is hostile (and math.prod over them slow)
_I64 = (1 << 63) - 1  # sizes, offsets and byte positions: torch and the file system count in int64

# safetensors dtype names → element size; the daemon validates shards with this table alone
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8,
}  # fmt: skip
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (trainer side: imports torch)."""
    name = str(dtype).removeprefix("torch.")
    for k, v in _TORCH_NAMES.items():
        if v == name:
            return k
    raise FormatError(f"tensors of dtype {dtype} cannot be checkpointed")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    if name not in _TORCH_NAMES:
        raise FormatError(f"unknown dtype {name!r} in checkpoint")
    return getattr(torch, _TORCH_NAMES[name])


def itemsize(name: str) -> int:
    try:
        return _ITEMSIZE[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r} in checkpoint") from None


def digest(buf: Any) -> str:
    """XXH3-64 of a buffer, as 16 hex digits (releases the GIL: safe to run on worker threads)."""
    return xxhash.xxh3_64_hexdigest(buf)


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """A manifest's bytes as written: compact JSON, ``format_version`` :data:`MANIFEST_VERSION`, and last ``digest``,
    XXH3-64 of the same JSON without it. The non-tensor state (``extra``, hyperparameters, scheduler and RNG state)
    lives only here: a damaged digit must fail a restore and ``verify``, not come back as another value."""
    body = {**{k: v for k, v in manifest.items() if k != "digest"}, "format_version": MANIFEST_VERSION}
    raw = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    return raw[:-1] + b',"digest":"' + digest(raw).encode() + b'"}'


def check_manifest_digest(raw: bytes, manifest: dict[str, Any], where: str) -> None:
    """Raise :class:`FormatError` unless ``raw`` (the parsed ``manifest``'s bytes) ends with the digest of the rest
    (a version-1 manifest has none; another version is refused by validation)."""
    d = manifest.get("digest")
    if manifest.get("format_version") != MANIFEST_VERSION and d is None:
        return  # version 1: written before manifests carried a digest (a damaged "2" reads as 1 only without one)
    tail = b',"digest":"' + d.encode() + b'"}' if type(d) is str and d.isascii() else b""
    if not tail or not raw.endswith(tail) or digest(raw[: -len(tail)] + b"}") != d:
        raise FormatError(f"{where}: its contents do not match the digest it ends with: the manifest is damaged or was altered")


def fill_digests(manifest: dict[str, Any], shards: dict[str, Any]) -> None:
    """Fill a memory-tier manifest's missing checksums (``null``: :func:`build_fragment` with ``digests=False``) from
    its shards' bytes (file name -> a buffer of the file's bytes, header included), in place: every file's header
    checksum and every chunk's, as a persisted step's manifest has them. Checksums already there are kept."""
    for name, ent in manifest["files"].items():
        if ent.get("header_xxh3_64") is None:
            buf = shards[name]
            (n,) = struct.unpack_from("<Q", buf, 0)
            ent["header_xxh3_64"] = digest(buf[: 8 + n])
    for tensor in manifest["tensors"].values():
        for c in tensor["chunks"]:
            if c.get("xxh3_64") is None:
                begin, end = c["byte_range"]
                c["xxh3_64"] = digest(shards[c["file"]][begin:end])


def digester() -> Any:
    """A streaming :func:`digest`: ``update(buf)`` part by part (releases the GIL too), then ``hexdigest()``."""
    return xxhash.xxh3_64()


@dataclass(frozen=True)
class ChunkSpec:
    """One tensor chunk in a shard file: ``name`` in the file, state ``key``, placement, bytes."""

    name: str
    key: str
    dtype: str
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    begin: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardLayout:
    """The layout of one shard file: header bytes and where every chunk's data goes."""

    header: bytes  # the full prefix: 8-byte length + padded JSON
    chunks: tuple[ChunkSpec, ...]

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.data_start + (self.chunks[-1].end if self.chunks else 0)


def build_layout(items: list[tuple[str, str, torch.dtype, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]) -> ShardLayout:
    """Lay out chunks ``(name, key, dtype, sizes, global_shape, offsets)`` as a shard file.

    Order: larger element sizes first (keeps every chunk aligned), then by name, so the layout
    depends only on the set of chunks.
    """
    order = sorted(items, key=lambda it: (-it[2].itemsize, it[0]))
    pos = 0
    specs = []
    for name, key, dtype, sizes, gshape, offs in order:
        nbytes = math.prod(sizes) * dtype.itemsize
        specs.append(ChunkSpec(name, key, dtype_name(dtype), tuple(sizes), tuple(gshape), tuple(offs), pos, pos + nbytes))
        pos += nbytes
    meta = {
        "format_version": FORMAT_VERSION,
        "chunks": {s.name: {"key": s.key, "global_shape": list(s.global_shape), "offsets": list(s.offsets)} for s in specs},
    }
    header_obj: dict[str, Any] = {"__metadata__": {"ckptd": json.dumps(meta, separators=(",", ":"))}}
    for s in specs:
        header_obj[s.name] = {"dtype": s.dtype, "shape": list(s.sizes), "data_offsets": [s.begin, s.end]}
    body = json.dumps(header_obj, separators=(",", ":")).encode()
    pad = (-(8 + len(body))) % HEADER_ALIGN
    body += b" " * pad
    return ShardLayout(struct.pack("<Q", len(body)) + body, tuple(specs))


def _int_list(v: Any, what: str) -> tuple[int, ...]:
    """At most :data:`MAX_DIMS` integers in [0, 2**63 - 1]: a hostile header's thousands of huge integers
    would hold the GIL in ``math.prod`` for minutes (the daemon's loop included)."""
    if (
        not isinstance(v, list)
        or len(v) > MAX_DIMS
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _I64 for x in v)
    ):
        raise FormatError(f"{what} must be a list of at most {MAX_DIMS} integers in [0, 2**63 - 1], got {_brief(v)}")
    return tuple(v)


def _brief(v: Any, limit: int = 200) -> str:
    """``repr(v)``, cut to ``limit`` characters: an untrusted value goes into logs and ``status``."""
    text = repr(v) if not isinstance(v, list) or len(v) <= 64 else f"[{len(v)} items: {repr(v[:8])[1:-1]}, ...]"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _chunk_spec(name: str, ent: Any, cm: Any) -> ChunkSpec:
    """One chunk's header entry ``ent`` and ckptd metadata ``cm``, validated."""
    if not isinstance(ent, dict) or not isinstance(cm, dict):
        raise FormatError(f"chunk {name!r}: entry is not an object")
    dt = ent.get("dtype")
    sizes = _int_list(ent.get("shape"), f"chunk {name!r} shape")
    offsets = ent.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise FormatError(f"chunk {name!r}: data_offsets must be [begin, end]")
    b, e = _int_list(offsets, f"chunk {name!r} data_offsets")
    gshape = _int_list(cm.get("global_shape"), f"chunk {name!r} global_shape")
    offs = _int_list(cm.get("offsets"), f"chunk {name!r} offsets")
    key = cm.get("key")
    if not isinstance(key, str):
        raise FormatError(f"chunk {name!r}: key must be a string")
    if len(gshape) != len(sizes) or len(offs) != len(sizes) or any(o + s > g for o, s, g in zip(offs, sizes, gshape)):
        raise FormatError(f"chunk {name!r}: offsets {offs} + sizes {sizes} do not fit global shape {gshape}")
    if math.prod(sizes) * itemsize(dt) > _I64 or e - b != math.prod(sizes) * itemsize(dt):
        raise FormatError(f"chunk {name!r}: {e - b} bytes do not match shape {list(sizes)} of {dt}")
    return ChunkSpec(name, key, dt, sizes, gshape, offs, b, e)


def parse_header(buf: Any, limit: int) -> ShardLayout:
    """Parse and validate a shard header from ``buf`` (untrusted) holding at least ``limit`` bytes.

    Checks: header length in bounds, JSON well formed, ckptd metadata of a known version, every
    chunk's dtype known, its byte size matching its shape, chunks packed without overlap, and the
    data inside ``limit``.
    """
    if limit < 8:
        raise FormatError("shard too small to hold a header")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > MAX_HEADER_BYTES or 8 + n > limit:
        raise FormatError(f"shard header length {n} out of bounds (shard holds {limit} bytes)")
    raw = bytes(buf[8 : 8 + n])
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"shard header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise FormatError("shard header is not a JSON object")
    try:
        meta = json.loads(obj["__metadata__"]["ckptd"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise FormatError("shard header lacks ckptd metadata (not a ckptd shard)") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise FormatError(f"shard format_version {version!r} is not supported (this ckptd reads {FORMAT_VERSION})")
    cmeta = meta.get("chunks")
    if not isinstance(cmeta, dict):
        raise FormatError("shard metadata 'chunks' is not an object")
    names = [k for k in obj if k != "__metadata__"]
    if set(names) != set(cmeta):
        raise FormatError("shard header and its ckptd metadata list different chunks")
    specs = [_chunk_spec(name, obj[name], cmeta[name]) for name in names]
    specs.sort(key=lambda s: s.begin)
    pos = 0
    for s in specs:
        if s.begin != pos:
            raise FormatError(f"chunk {s.name!r}: data not packed (starts at {s.begin}, expected {pos})")
        pos = s.end
    if 8 + n + pos > limit:
        raise FormatError(f"shard data ends at byte {8 + n + pos}, beyond the {limit} bytes present")
    return ShardLayout(bytes(buf[: 8 + n]), tuple(specs))


# ----------------------------------------------------------------------------- manifest


@dataclass(frozen=True, kw_only=True)
class ShardOf:
    """Whose shard a fragment describes and the commit that made it: all a fragment records besides its chunks.

    Attributes:
        job: the job.
        step: the step number.
        rank: the rank whose shard it is (it names the shard's file).
        world_size: how many ranks the step has.
        local_world_size: how many of them the node that wrote it serves (fewer than ``world_size``: a multi-node step,
            completed through the bucket).
        replicas: chunk id -> sample digest of each chunk other ranks hold too.
        tree: the rank's non-tensor state, parsed.
        committed_at: when the daemon accepted the rank's commit (ns since the epoch): it orders steps.
        run: the launch that saved it (every rank of a launch shares it; ``None``: not known).
        after: the step that launch last restored (``None``: none). With ``run`` it names the attempt
            (:func:`attempt_of`): a step saved again after a rollback is never merged with an earlier attempt's fragments.
    """

    job: str
    step: int
    rank: int
    world_size: int
    local_world_size: int
    replicas: dict[str, str]
    tree: Any
    committed_at: int = 0
    run: int | None = None
    after: int | None = None


def build_fragment(
    of: ShardOf, shard: Any, layout: ShardLayout, *, digests: bool = True, sums: tuple[str, dict[str, str]] | None = None
) -> dict[str, Any]:
    """The fragment of the shard ``of`` describes (``shard``: its bytes, header included, laid out as ``layout``);
    checksums every chunk. ``digests=False``: no checksums (``null``): a memory-tier step's, never written to disk.
    ``sums``: computed already (the header's, and each chunk's by its name). With either, ``shard`` is the header alone."""
    start = layout.data_start
    if sums is None:
        digest_of = digest if digests else (lambda buf: None)
        sums = (digest_of(shard[:start]), {c.name: digest_of(shard[start + c.begin : start + c.end]) for c in layout.chunks})
    header_sum, chunk_sums = sums
    chunks = [
        {
            "name": c.name,
            "key": c.key,
            "dtype": c.dtype,
            "sizes": list(c.sizes),
            "global_shape": list(c.global_shape),
            "offsets": list(c.offsets),
            "byte_range": [start + c.begin, start + c.end],
            "xxh3_64": chunk_sums[c.name],
        }
        for c in layout.chunks
    ]
    return {
        "format_version": FORMAT_VERSION,
        "kind": "ckptd-fragment",
        "job": of.job,
        "step": of.step,
        "rank": of.rank,
        "world_size": of.world_size,
        "local_world_size": of.local_world_size,  # fewer than world_size: a multi-node step, completed through the bucket
        "file": shard_name(of.rank),
        "size": layout.file_size,
        "header_xxh3_64": header_sum,
        "chunks": chunks,
        "replicas": of.replicas,
        "committed_at": of.committed_at,
        "tree": of.tree,
    } | ({} if of.run is None else {"run": of.run, "after": of.after})


def _region(cid: str) -> str:
    try:
        key, offsets, sizes = json.loads(cid)
        return f"tensor {key!r} region offsets {offsets} sizes {sizes}"
    except (ValueError, TypeError, RecursionError):  # an id this ckptd did not write
        return f"chunk {cid!r}"


def check_replicas(frags: list[dict[str, Any]]) -> None:
    """Every holder of a replicated chunk reported the same sample digest; else name key and region."""
    seen: dict[str, tuple[str, int]] = {}
    for fr in frags:
        for cid, dig in (fr.get("replicas") or {}).items():
            if cid in seen and seen[cid][0] != dig:
                raise CheckpointError(
                    f"{_region(cid)}: ranks {seen[cid][1]} and {fr['rank']} hold different bytes under the same name;"
                    " state keys (FQNs) must be globally unique, e.g. name experts by their global index (module buffers,"
                    " whose ranks may differ, are exempt through snapshot(); a DCP state dict carries no model to tell them:"
                    " make such buffers equal on every rank first, e.g. SyncBatchNorm)"
                )
            seen.setdefault(cid, (dig, fr["rank"]))


def commit_time(manifest: bytes | dict[str, Any] | None) -> int:
    """A manifest's ``committed_at`` (its bytes or parsed), the order ``latest`` follows: 0 for one
    written before ckptd recorded it, or one that is unreadable or holds no non-negative integer."""
    if isinstance(manifest, bytes):
        try:
            manifest = json.loads(manifest)
        except (ValueError, RecursionError):
            return 0
    value = manifest.get("committed_at", 0) if isinstance(manifest, dict) else 0
    return value if type(value) is int and value >= 0 else 0


def build_manifest(job: str, step: int, world_size: int, frags: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge every rank's fragment into the step's manifest, after the coverage and replica checks.

    Called where a step completes: a persist thread (one node) or the upload thread (through the bucket).
    """
    tensors: dict[str, Any] = {}
    files: dict[str, Any] = {}
    ranks = []
    for fr in sorted(frags, key=lambda f: f["rank"]):
        if (fr.get("job"), fr.get("step"), fr.get("world_size")) != (job, step, world_size):
            raise CheckpointError(f"fragment of rank {fr.get('rank')} belongs to another job/step/world size")
        files[fr["file"]] = {"rank": fr["rank"], "size": fr["size"], "header_xxh3_64": fr["header_xxh3_64"]}
        ranks.append({"rank": fr["rank"], "file": fr["file"], "tree": fr["tree"]})
        for c in fr["chunks"]:
            ent = tensors.setdefault(c["key"], {"dtype": c["dtype"], "shape": c["global_shape"], "chunks": []})
            if ent["dtype"] != c["dtype"] or ent["shape"] != c["global_shape"]:
                raise CheckpointError(
                    f"tensor {c['key']!r}: rank {fr['rank']} saved {c['dtype']}{c['global_shape']},"
                    f" another rank {ent['dtype']}{ent['shape']}"
                )
            ent["chunks"].append({k: c[k] for k in ("name", "offsets", "sizes", "byte_range", "xxh3_64")} | {"file": fr["file"]})
    attempts = {attempt_of(fr) for fr in frags}
    if len(attempts - {None}) > 1:  # a fragment naming no attempt (an older ckptd's) conflicts with none
        raise CheckpointError(
            f"step {step} of job {job}: its fragments come from different attempts (launch, restored step):"
            f" {sorted(attempts - {None}, key=str)}, never merged"
        )
    check_coverage(tensors)
    check_replicas(frags)
    return {
        "format_version": FORMAT_VERSION,
        "kind": "ckptd-manifest",
        "job": job,
        "step": step,
        "world_size": world_size,
        "created_unix": time.time(),
        # commit order, not step number, decides which step is the latest (a rollback saves lower steps later)
        "committed_at": max((fr.get("committed_at") or 0 for fr in frags), default=0),
        "files": files,
        "tensors": tensors,
        "ranks": ranks,
    } | _attempt_fields(attempts.pop() if len(attempts) == 1 else None)


def fragments_of(manifest: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each rank's fragment of a single-node step, rebuilt from its manifest (rank -> fragment): what a step persisted
    on one node keeps beside its shards, for a step that was never persisted (a memory-tier step sent to a peer, where
    the bucket tier bounds a manifest by its fragments' sizes). ``replicas`` is empty: the sample digests of chunks
    several ranks hold are not in a manifest (they were checked when it was built)."""
    files = {name: ent["rank"] for name, ent in manifest["files"].items()}
    chunks: dict[int, list[dict[str, Any]]] = {rank: [] for rank in files.values()}
    for key, t in manifest["tensors"].items():
        for c in t["chunks"]:
            chunks[files[c["file"]]].append(
                {"name": c["name"], "key": key, "dtype": t["dtype"], "sizes": c["sizes"], "global_shape": t["shape"],
                 "offsets": c["offsets"], "byte_range": c["byte_range"], "xxh3_64": c["xxh3_64"]}
            )  # fmt: skip
    trees = {r["rank"]: r["tree"] for r in manifest["ranks"]}
    attempt = attempt_of(manifest)
    return {
        rank: {
            "format_version": FORMAT_VERSION, "kind": "ckptd-fragment", "job": manifest["job"], "step": manifest["step"],
            "rank": rank, "world_size": manifest["world_size"], "local_world_size": manifest["world_size"], "file": name,
            "size": manifest["files"][name]["size"], "header_xxh3_64": manifest["files"][name]["header_xxh3_64"],
            "chunks": chunks[rank], "replicas": {}, "committed_at": manifest.get("committed_at", 0), "tree": trees.get(rank),
        } | _attempt_fields(attempt)
        for name, rank in files.items()
    }  # fmt: skip


Attempt = tuple[int, int | None]  # (launch, the step it had restored): see attempt_of


def _attempt_fields(attempt: Attempt | None) -> dict[str, Any]:
    return {} if attempt is None else {"run": attempt[0], "after": attempt[1]}


def attempt_of(doc: Any) -> Attempt | None:
    """The attempt that wrote a fragment or manifest: ``(run, after)``, its launch and the step that launch
    had restored (a launch that rolls back and saves a step number again makes a new attempt of it);
    ``None`` when it does not say (written before 2026-11-24, or not a JSON object)."""
    run = doc.get("run") if isinstance(doc, dict) else None
    if type(run) is not int:
        return None
    after = doc.get("after")
    return run, after if type(after) is int else None


def objects_folder(doc: Any) -> str:
    """Where a bucket manifest's files lie under its step's prefix: the folder of its attempt when it says
    so (``attempt_objects``: a multi-node step completed by a ckptd since 5c636b6, 2026-11-24), else the prefix itself."""
    attempt = attempt_of(doc)
    if attempt is None or doc.get("attempt_objects") is not True:
        return ""
    return attempt_folder(*attempt)


def files_dir(step_path: str, manifest: Any) -> str:
    """The directory a step's shard files are read from: the step's own, or, for a multi-node step read in place in a
    shared directory (:class:`ckptd.storage.posix.DirStore`), its attempt's folder under it (:func:`objects_folder`). A
    step downloaded to a node's root keeps that manifest but holds its files directly: the folder decides."""
    folder = objects_folder(manifest)
    if folder and os.path.isdir(os.path.join(step_path, folder)):
        return os.path.join(step_path, folder)
    return step_path
