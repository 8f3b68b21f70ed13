"""The local-disk tier: make staged shards durable and complete steps atomically (layout in
:mod:`ckptd.layout`).

Order of calls: :func:`write_shard` once per rank (any thread), then :func:`finalize_step` by whoever
observes every rank's fragment (the daemon serializes it per job; across daemons the rename of
``step-N.tmp`` arbitrates), then :func:`apply_retention`. A step directory without ``manifest.json``
is never named by ``latest`` and is removed on restart. Blocking disk I/O: the daemon's persist
threads call the writers; :func:`latest_step` is also read by trainers and tools (no daemon needed).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from ..errors import CheckpointError, FormatError
from ..format import build_fragment, build_manifest, parse_header
from ..layout import MANIFEST, complete_steps, fragment_name, is_complete, job_dir, latest_file, shard_name, step_dir, tmp_dir
from .files import fsync_dir, write_durable, write_json_durable
from .retention import RetentionPolicy, doomed

WRITE_BLOCK = 16 << 20


def _write_paced(fd: int, view: memoryview, nbytes: int, rate_limit: float) -> None:
    """Write ``view[:nbytes]``; ``rate_limit`` (bytes/s, 0 = unlimited) paces it so training I/O is not starved."""
    t0 = time.monotonic()
    pos = 0
    while pos < nbytes:
        pos += os.write(fd, view[pos : min(nbytes, pos + WRITE_BLOCK)])
        if rate_limit > 0:
            ahead = pos / rate_limit - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


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
    committed_at: int = 0,
) -> None:
    """Write one staged shard (``view[:nbytes]``) and then its fragment into ``step-N.tmp`` durably.

    Raises :class:`CheckpointError` (full disk, bad header); the partial files are removed.
    """
    layout = parse_header(view, nbytes)
    if layout.file_size != nbytes:
        raise FormatError(f"staged shard is {nbytes} bytes but its header describes {layout.file_size}")
    d = tmp_dir(root, job, step)
    os.makedirs(d, exist_ok=True)
    path, frag_path = os.path.join(d, shard_name(rank)), os.path.join(d, fragment_name(rank))
    frag = build_fragment(job, step, rank, world_size, local_world_size or world_size, view, layout, replicas or {}, tree, committed_at)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_paced(fd, view, nbytes, rate_limit)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_json_durable(frag_path, frag)  # last: a fragment present means its shard is durable
    except OSError as e:
        for p in (path, frag_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        raise CheckpointError(f"writing {path} failed: {e.strerror or e}") from None


def read_fragment(root: str, job: str, step: int, rank: int) -> dict[str, Any]:
    with open(os.path.join(tmp_dir(root, job, step), fragment_name(rank)), "rb") as f:
        return json.loads(f.read())


def fragment_sizes(root: str, job: str, step: int, ranks: set[int]) -> tuple[int | None, int | None]:
    """World size and local world size recorded in a partial step's fragments, if one is readable."""
    for r in sorted(ranks):
        try:
            frag = read_fragment(root, job, step, r)
            ws = int(frag["world_size"])
            return ws, int(frag.get("local_world_size", ws))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None, None


def finalize_step(root: str, job: str, step: int, world_size: int) -> str:
    """Merge all fragments into ``manifest.json``, rename ``step-N.tmp`` to ``step-N``, move ``latest``.

    Returns the complete step's directory. Call only when every rank's fragment is present.
    """
    d = tmp_dir(root, job, step)
    frags = [read_fragment(root, job, step, r) for r in range(world_size)]
    write_json_durable(os.path.join(d, MANIFEST), build_manifest(job, step, world_size, frags))
    final = step_dir(root, job, step)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists: a complete checkpoint is never overwritten")
    os.rename(d, final)
    fsync_dir(job_dir(root, job))
    update_latest(root, job, step)
    return final


def read_latest(root: str, job: str) -> int | None:
    """The step number in ``latest``, or ``None`` (missing or unreadable). Not checked for completeness."""
    try:
        with open(latest_file(root, job)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def update_latest(root: str, job: str, step: int) -> None:
    """Point ``latest`` at ``step`` unless it already names a newer step that still exists."""
    cur = read_latest(root, job)
    if cur is not None and cur > step and os.path.isdir(step_dir(root, job, cur)):
        return
    write_durable(latest_file(root, job), f"{step}\n".encode())


def latest_step(root: str, job: str) -> tuple[int | None, str | None]:
    """The newest complete local step of ``job`` and its directory (``latest`` if it names a complete
    step, else the highest complete one), or ``(None, None)``."""
    cur = read_latest(root, job)
    if cur is not None and is_complete(step_dir(root, job, cur)):
        return cur, step_dir(root, job, cur)
    steps = complete_steps(root, job)
    if not steps:
        return None, None
    return steps[-1], step_dir(root, job, steps[-1])


def remove_partial(root: str, job: str, step: int) -> None:
    shutil.rmtree(tmp_dir(root, job, step), ignore_errors=True)


def apply_retention(root: str, job: str, policy: RetentionPolicy) -> list[int]:
    """Remove the complete steps of ``job`` that ``policy`` does not keep; returns them.

    Partial steps are not touched here: the daemon removes those it knows can no longer complete.
    """
    removed = doomed(policy, complete_steps(root, job))
    for s in removed:
        shutil.rmtree(step_dir(root, job, s), ignore_errors=True)
    return removed
