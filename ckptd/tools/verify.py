"""Check a committed checkpoint end to end (``ckptd verify``) and flag silently stale steps.

Runs anywhere (no daemon, no process group, no torch): the CLI, trainers, and the daemon's fetch
thread before a downloaded step enters the root. Reads every byte once, in bounded blocks.
"""

from __future__ import annotations

import os
import re
import struct
from typing import Any

import xxhash

from ..errors import CheckpointError, FormatError
from ..format import MAX_HEADER_BYTES, check_coverage, parse_header, read_manifest
from ..layout import complete_steps, step_dir

_STEP_COUNTER = re.compile(r"^optim/state/.+/step$")
_BLOCK = 64 << 20


def _digest_range(fd: int, begin: int, end: int) -> str:
    h = xxhash.xxh3_64()
    pos = begin
    while pos < end:
        data = os.pread(fd, min(_BLOCK, end - pos), pos)
        if not data:
            break
        h.update(data)
        pos += len(data)
    return h.hexdigest() if pos == end else "truncated"


def verify_checkpoint(step_path: str) -> list[str]:
    """Every problem found in ``step_path`` as a sentence naming the file and tensor; empty if sound."""
    try:
        manifest = read_manifest(step_path)
    except FormatError as e:
        return [str(e)]
    problems: list[str] = []
    headers: dict[str, dict[str, Any]] = {}
    for name, meta in manifest["files"].items():
        path = os.path.join(step_path, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            problems.append(f"{path}: cannot open ({e.strerror})")
            continue
        try:
            size = os.fstat(fd).st_size
            if size != meta.get("size"):
                problems.append(f"{path}: {size} bytes, the manifest says {meta.get('size')}")
            head = os.pread(fd, 8, 0)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            layout = parse_header(os.pread(fd, 8 + min(n, MAX_HEADER_BYTES), 0), size)
            if xxhash.xxh3_64_hexdigest(layout.header) != meta.get("header_xxh3_64"):
                problems.append(f"{path}: header checksum mismatch")
            headers[name] = {(layout.data_start + c.begin, layout.data_start + c.end): c for c in layout.chunks}
        except (FormatError, struct.error) as e:
            problems.append(f"{path}: {e}")
        finally:
            os.close(fd)
    for key, ent in manifest["tensors"].items():
        for c in ent["chunks"]:
            path = os.path.join(step_path, c["file"])
            spec = headers.get(c["file"], {}).get(tuple(c["byte_range"]))
            if c["file"] in headers and (spec is None or spec.key != key or list(spec.sizes) != c["sizes"] or spec.dtype != ent["dtype"]):
                problems.append(f"{path}: tensor {key!r} bytes {c['byte_range']} do not match the shard header")
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue  # already reported above
            try:
                if _digest_range(fd, *c["byte_range"]) != c["xxh3_64"]:
                    problems.append(f"{path}: checksum mismatch in tensor {key!r} (bytes {c['byte_range'][0]}-{c['byte_range'][1]})")
            finally:
                os.close(fd)
    try:
        check_coverage(manifest["tensors"])
    except CheckpointError as e:
        problems.append(f"{step_path}: {e}")
    return problems


def stale_warning(step_path: str, manifest: dict[str, Any] | None = None) -> str | None:
    """A warning if this step is bit-identical to the committed step before it although its optimizer
    step counters advanced (a saver that keeps re-writing old data), else ``None``."""
    manifest = manifest or read_manifest(step_path)
    job_path = os.path.dirname(os.path.abspath(step_path))
    root, job = os.path.dirname(job_path), os.path.basename(job_path)
    earlier = [s for s in complete_steps(root, job) if s < manifest["step"]]
    if not earlier:
        return None
    try:
        prev = read_manifest(step_dir(root, job, earlier[-1]))
    except FormatError:
        return None

    def digests(m: dict[str, Any], counters: bool) -> dict[str, list[str]]:
        return {
            k: sorted(c["xxh3_64"] for c in e["chunks"])
            for k, e in m["tensors"].items()
            if bool(_STEP_COUNTER.match(k)) == counters and not k.startswith("extra/")
        }

    now_c, prev_c = digests(manifest, True), digests(prev, True)
    if not now_c or now_c == prev_c:
        return None  # no step counters, or they did not advance: identical data is expected
    if digests(manifest, False) == digests(prev, False):
        return (
            f"step {manifest['step']} is bit-identical to step {prev['step']} although the optimizer step counter advanced:"
            " the saved state may be stale (is the snapshot taken from a copy that is no longer updated?)"
        )
    return None
