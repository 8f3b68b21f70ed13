"""Make staged shards durable and commit steps atomically. Runs in the daemon's worker threads.

Directory layout under the daemon's root::

    <root>/<job>/step-<N>.tmp/rank-RRRRR.safetensors   shard bytes, exactly as staged
    <root>/<job>/step-<N>.tmp/rank-RRRRR.json          the rank's fragment: chunk digests + tree
    <root>/<job>/step-<N>/manifest.json                written last, then the directory renamed
    <root>/<job>/latest                                the newest committed step number

Order of calls: :func:`write_shard` once per rank (any thread, any node), then
:func:`finalize_step` by whoever observes every rank's fragment (the daemon serializes it per
step; across daemons the rename of ``step-N.tmp`` arbitrates), then :func:`apply_retention`.
A step directory without ``manifest.json`` is never named by ``latest`` and is removed on restart.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from typing import Any

from .errors import CheckpointError, FormatError
from .format import FORMAT_VERSION, MANIFEST, digest, fsync_dir, parse_header, write_json_durable

log = logging.getLogger("ckptd.persist")

_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.tmp$")
_FRAG_RE = re.compile(r"^rank-(\d{5})\.json$")
WRITE_BLOCK = 16 << 20


def job_dir(root: str, job: str) -> str:
    return os.path.join(root, job)


def step_dir(root: str, job: str, step: int) -> str:
    return os.path.join(root, job, f"step-{step}")


def tmp_dir(root: str, job: str, step: int) -> str:
    return os.path.join(root, job, f"step-{step}.tmp")


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def write_shard(
    root: str,
    job: str,
    step: int,
    rank: int,
    world_size: int,
    view: memoryview,
    nbytes: int,
    tree: dict[str, Any],
    rate_limit: float = 0.0,
    replicas: dict[str, str] | None = None,
    local_world_size: int | None = None,
) -> None:
    """Write one staged shard (``view[:nbytes]``) and its fragment into ``step-N.tmp`` durably.

    ``rate_limit`` (bytes/s, 0 = unlimited) paces the write so persisting does not starve training
    I/O. Raises :class:`CheckpointError` (full disk, bad header); the partial file is removed.
    """
    layout = parse_header(view, nbytes)
    if layout.file_size != nbytes:
        raise FormatError(f"staged shard is {nbytes} bytes but its header describes {layout.file_size}")
    d = tmp_dir(root, job, step)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, shard_name(rank))
    chunks = [
        {
            "name": c.name,
            "key": c.key,
            "dtype": c.dtype,
            "sizes": list(c.sizes),
            "global_shape": list(c.global_shape),
            "offsets": list(c.offsets),
            "byte_range": [layout.data_start + c.begin, layout.data_start + c.end],
            "xxh3_64": digest(view[layout.data_start + c.begin : layout.data_start + c.end]),
        }
        for c in layout.chunks
    ]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            t0 = time.monotonic()
            pos = 0
            while pos < nbytes:
                pos += os.write(fd, view[pos : min(nbytes, pos + WRITE_BLOCK)])
                if rate_limit > 0:
                    ahead = pos / rate_limit - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            os.fsync(fd)
        finally:
            os.close(fd)
        frag = {
            "format_version": FORMAT_VERSION,
            "kind": "ckptd-fragment",
            "job": job,
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "local_world_size": local_world_size or world_size,  # fewer: a multi-node step, committed through the bucket
            "file": shard_name(rank),
            "size": nbytes,
            "header_xxh3_64": digest(view[: layout.data_start]),
            "chunks": chunks,
            "replicas": replicas or {},
            "tree": tree,
        }
        write_json_durable(os.path.join(d, f"rank-{rank:05d}.json"), frag)
    except OSError as e:
        for p in (path, os.path.join(d, f"rank-{rank:05d}.json")):
            try:
                os.unlink(p)
            except OSError:
                pass
        raise CheckpointError(f"writing {path} failed: {e.strerror or e}") from None


def fragments_present(root: str, job: str, step: int) -> set[int]:
    try:
        names = os.listdir(tmp_dir(root, job, step))
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for n in names if (m := _FRAG_RE.match(n))}


def _boxes_overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a["offsets"], a["sizes"], b["offsets"], b["sizes"]))


def check_coverage(tensors: dict[str, Any]) -> None:
    """Every global tensor is covered exactly once by its chunks; raise naming the key and region."""
    for key, ent in tensors.items():
        total = 0
        chunks = sorted(ent["chunks"], key=lambda c: c["offsets"])
        for i, c in enumerate(chunks):
            total += math.prod(c["sizes"])
            for o in chunks[i + 1 :]:
                if o["offsets"][:1] and c["offsets"][:1] and o["offsets"][0] >= c["offsets"][0] + c["sizes"][0]:
                    break
                if _boxes_overlap(c, o):
                    raise CheckpointError(
                        f"tensor {key!r}: chunks at offsets {c['offsets']} ({c['file']}) and {o['offsets']} ({o['file']}) overlap;"
                        " state keys must be globally unique"
                    )
        want = math.prod(ent["shape"])
        if total != want:
            raise CheckpointError(f"tensor {key!r} of shape {ent['shape']}: chunks cover {total} of {want} elements")


def check_replicas(frags: list[dict[str, Any]]) -> None:
    """Every holder of a replicated chunk reported the same sample digest; else name key and region."""
    seen: dict[str, tuple[str, int]] = {}
    for fr in frags:
        for cid, dig in (fr.get("replicas") or {}).items():
            if cid in seen and seen[cid][0] != dig:
                key, offsets, sizes = json.loads(cid)
                raise CheckpointError(
                    f"tensor {key!r} region offsets {offsets} sizes {sizes}: ranks {seen[cid][1]} and {fr['rank']} hold"
                    " different bytes under the same name; state keys (FQNs) must be globally unique, e.g. name experts"
                    " by their global index"
                )
            seen.setdefault(cid, (dig, fr["rank"]))


def build_manifest(job: str, step: int, world_size: int, frags: list[dict[str, Any]]) -> dict[str, Any]:
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
    check_coverage(tensors)
    check_replicas(frags)
    return {
        "format_version": FORMAT_VERSION,
        "kind": "ckptd-manifest",
        "job": job,
        "step": step,
        "world_size": world_size,
        "created_unix": time.time(),
        "files": files,
        "tensors": tensors,
        "ranks": ranks,
    }


def finalize_step(root: str, job: str, step: int, world_size: int) -> str:
    """Merge all fragments into ``manifest.json``, rename ``step-N.tmp`` to ``step-N``, move ``latest``.

    Returns the committed directory. Call only when :func:`fragments_present` holds every rank.
    """
    d = tmp_dir(root, job, step)
    frags = []
    for r in range(world_size):
        with open(os.path.join(d, f"rank-{r:05d}.json"), "rb") as f:
            frags.append(json.loads(f.read()))
    manifest = build_manifest(job, step, world_size, frags)
    write_json_durable(os.path.join(d, MANIFEST), manifest)
    final = step_dir(root, job, step)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists: a complete checkpoint is never overwritten")
    os.rename(d, final)
    fsync_dir(job_dir(root, job))
    update_latest(root, job, step)
    return final


def read_latest(root: str, job: str) -> int | None:
    try:
        with open(os.path.join(job_dir(root, job), "latest")) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def update_latest(root: str, job: str, step: int) -> None:
    """Point ``latest`` at ``step`` unless it already names a newer committed step."""
    cur = read_latest(root, job)
    if cur is not None and cur > step and os.path.isdir(step_dir(root, job, cur)):
        return
    path = os.path.join(job_dir(root, job), "latest")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(job_dir(root, job))


def committed_steps(root: str, job: str) -> list[int]:
    """Steps of ``job`` whose directory holds a manifest, ascending."""
    try:
        names = os.listdir(job_dir(root, job))
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        m = _STEP_RE.match(n)
        if m and os.path.exists(os.path.join(root, job, n, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out)


def partial_steps(root: str, job: str) -> list[int]:
    try:
        names = os.listdir(job_dir(root, job))
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _TMP_RE.match(n)))


def remove_partial(root: str, job: str, step: int) -> None:
    shutil.rmtree(tmp_dir(root, job, step), ignore_errors=True)


def apply_retention(root: str, job: str, keep: int, protect: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Keep the newest ``keep`` committed steps of ``job`` and those in ``protect`` (not uploaded
    yet); returns the steps removed.

    Partial steps are not touched here: the daemon removes those it knows can no longer complete.
    """
    steps = committed_steps(root, job)
    removed = []
    if keep > 0 and len(steps) > keep:
        for s in steps[:-keep]:
            if s in protect:
                continue
            shutil.rmtree(step_dir(root, job, s), ignore_errors=True)
            removed.append(s)
    return removed


def latest_path(root: str, job: str) -> tuple[int | None, str | None]:
    """The newest committed step and its directory, trusting ``latest`` only if its manifest exists."""
    cur = read_latest(root, job)
    if cur is not None and os.path.exists(os.path.join(step_dir(root, job, cur), MANIFEST)):
        return cur, step_dir(root, job, cur)
    steps = committed_steps(root, job)
    if not steps:
        return None, None
    return steps[-1], step_dir(root, job, steps[-1])


def list_jobs(root: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)) and not n.startswith("."))
    except FileNotFoundError:
        return []
