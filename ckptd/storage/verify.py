"""Check a committed checkpoint end to end (``ckptd verify``) and flag silently stale steps.

Runs anywhere (no daemon, no process group, no torch): the CLI, trainers, and the daemon's fetch
thread before a downloaded step enters the root. Reads every byte once, in bounded blocks.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from ..coverage import check_coverage
from ..errors import CheckpointError, FormatError
from ..format import MAX_HEADER_BYTES, ChunkSpec, files_dir, parse_header
from ..layout import MANIFEST, complete_steps, step_dir
from ..validate import confined_name, read_manifest

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
    """Every problem found in ``step_path`` as a sentence naming the file and tensor; empty if sound.

    The manifest is untrusted: a malformed one is one problem (the :class:`FormatError` naming its field),
    and only files it names inside ``step_path`` are opened, each once."""
    manifest_path = os.path.join(step_path, MANIFEST)
    try:
        manifest = read_manifest(step_path)
    except FormatError as e:
        return [str(e)]
    except OSError as e:
        return [f"{manifest_path}: cannot read ({e.strerror})"]
    chunks: dict[str, list[tuple[str, str, dict[str, Any]]]] = {name: [] for name in manifest["files"]}
    for key, ent in manifest["tensors"].items():
        for c in ent["chunks"]:
            chunks[c["file"]].append((key, ent["dtype"], c))
    problems: list[str] = []
    folder = files_dir(step_path, manifest)  # a multi-node step in a shared directory: its attempt's
    for name, meta in manifest["files"].items():
        path = os.path.join(folder, confined_name(name, manifest_path, "files"))
        problems += _verify_file(path, meta, chunks[name])
    try:
        check_coverage(manifest["tensors"])
    except CheckpointError as e:
        problems.append(f"{step_path}: {e}")
    return problems


def _verify_file(path: str, meta: dict[str, Any], chunks: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """The problems of one shard file: size, header, and the checksum of every chunk ``(key, dtype, entry)`` in it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO in the step cannot hang verify
    except OSError as e:
        return [f"{path}: cannot open ({e.strerror})"]
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return [f"{path}: not a regular file"]
        problems, specs = _check_header(fd, path, meta, st.st_size)
        for key, dtype, c in chunks:
            b, e = c["byte_range"]
            if specs is not None:  # else the header's problem is reported; the checksums still tell which data is sound
                # by name: empty chunks (an FSDP2 rank's empty shard) share one byte range
                at, spec = specs.get(c["name"], ((-1, -1), None))
                if spec is None or at != (b, e) or spec.key != key or list(spec.sizes) != list(c["sizes"]) or spec.dtype != dtype:
                    problems.append(f"{path}: tensor {key!r} bytes {c['byte_range']} do not match the shard header")
                    continue
            if _digest_range(fd, b, e) != c["xxh3_64"]:
                problems.append(f"{path}: checksum mismatch in tensor {key!r} (bytes {b}-{e})")
        return problems
    finally:
        os.close(fd)


def _check_header(
    fd: int, path: str, meta: dict[str, Any], size: int
) -> tuple[list[str], dict[str, tuple[tuple[int, int], ChunkSpec]] | None]:
    """Size and header problems of an open shard, and its chunks by name with their absolute byte ranges
    (``None`` if unreadable)."""
    problems = []
    if size != meta["size"]:
        problems.append(f"{path}: {size} bytes, the manifest says {meta['size']}")
    try:
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        layout = parse_header(os.pread(fd, 8 + min(n, MAX_HEADER_BYTES), 0), size)
    except (FormatError, struct.error) as e:
        return problems + [f"{path}: {e}"], None
    if xxhash.xxh3_64_hexdigest(layout.header) != meta["header_xxh3_64"]:
        problems.append(f"{path}: header checksum mismatch")
    return problems, {c.name: ((layout.data_start + c.begin, layout.data_start + c.end), c) for c in layout.chunks}


def stale_warning(step_path: str, manifest: dict[str, Any] | None = None) -> str | None:
    """A warning if this step is bit-identical to the committed step before it although its optimizer
    step counters advanced (a saver that keeps re-writing old data), else ``None``."""
    manifest = manifest or read_manifest(step_path)
    if any(f["header_xxh3_64"] is None for f in manifest["files"].values()):
        return None  # a memory-tier step's manifest: no checksums to compare
    job_path = os.path.dirname(os.path.abspath(step_path))
    root, job = os.path.dirname(job_path), os.path.basename(job_path)
    earlier = [s for s in complete_steps(root, job) if s < manifest["step"]]
    if not earlier:
        return None
    try:
        prev = read_manifest(step_dir(root, job, earlier[-1]))
    except (FormatError, OSError):
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


def stale_check(step_path: str, manifest: dict[str, Any] | None = None) -> Callable[[], str | None]:
    """:func:`stale_warning` on a thread of its own (a restore's copies run meanwhile); the function returned
    waits for it and returns its warning, or raises what it raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="ckptd-stale-check")
    try:
        return pool.submit(stale_warning, step_path, manifest).result
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task
