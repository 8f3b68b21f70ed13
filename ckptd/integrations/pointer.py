"""The file a framework adapter leaves where the framework looks for its checkpoint: JSON naming the job
and step that hold it (``{"ckptd_pointer": 1, "job": ..., "step": ...}``), written atomically; a second save
at one step adds an ``"overlay"``, what it changed (:mod:`ckptd.integrations.overlay`).

The checkpoint itself is an ordinary ckptd step, kept and deleted by the daemon's retention; a pointer
is read as untrusted input (size-limited JSON, the job name and step checked).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from ..config import MAX_STEP, validate_job
from ..errors import CheckpointError, FormatError
from ..state import unflatten

if TYPE_CHECKING:
    from ..client.api import Client

KEY = "ckptd_pointer"
MAX_POINTER_BYTES = 16 << 20  # an overlay carries small entries inline
_HEAD = 4096  # enough to tell a pointer (its key comes first) from another format's checkpoint


def pointer_doc(path: str | os.PathLike[str], job: str, step: int, overlay: list[Any] | None = None) -> str:
    """The pointer's JSON, or :class:`CheckpointError` if it cannot be written at ``path`` (check before protecting)."""
    path = os.fspath(path)
    if "://" in path:
        raise CheckpointError(f"{path}: a ckptd pointer is a local file (the checkpoint's bytes go to the daemon, which uploads them)")
    doc = json.dumps({KEY: 1, "job": job, "step": step, **({"overlay": overlay} if overlay else {})})
    if len(doc) > MAX_POINTER_BYTES:
        raise CheckpointError(
            f"{path}: this save differs from the first save of step {step} by {len(doc)} bytes of state, over the"
            f" {MAX_POINTER_BYTES} a pointer carries"
        )
    return doc


def write_pointer(path: str | os.PathLike[str], job: str, step: int, overlay: list[Any] | None = None, doc: str | None = None) -> None:
    """Write the pointer at ``path`` (its directory made): a temporary file, fsynced, renamed over it."""
    path = os.fspath(path)
    doc = doc if doc is not None else pointer_doc(path, job, step, overlay)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    # a fresh name (O_EXCL, never following a link someone planted in a shared directory), renamed over the path
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".ckptd-pointer-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(doc)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_pointer(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """``(job, step)`` of the pointer at ``path``; ``None`` if the file is not one (another format's
    checkpoint); :class:`FormatError` for a pointer that is malformed."""
    doc = load_pointer(path)
    return None if doc is None else (doc["job"], doc["step"])


def load_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer at ``path``, its job and step checked (its ``overlay`` is checked when applied); ``None``
    if the file is not one; :class:`FormatError` for a pointer that is malformed."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(_HEAD)
        if not head.lstrip().startswith(b"{") or f'"{KEY}"'.encode() not in head:
            return None
        head += f.read(MAX_POINTER_BYTES + 1 - len(head))
    if len(head) > MAX_POINTER_BYTES:
        raise FormatError(f"{path}: a ckptd pointer of over {MAX_POINTER_BYTES} bytes: not written by ckptd")
    try:
        doc = json.loads(head)
        validate_job(doc["job"])
        step = doc["step"]
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: a malformed ckptd pointer ({e})") from None
    if doc.get(KEY) != 1 or isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise FormatError(f"{path}: a malformed ckptd pointer: {head[:200]!r}")
    return doc


def read_state(client: Client, step: int, rank: int = 0) -> dict[str, Any]:
    """The whole state saved as step ``step`` of the client's job (rank ``rank``'s tree, or rank 0's), on the
    CPU, read through the daemon (its memory, disk or bucket). A later save of this client continues from it."""
    from ..client.api import open_step

    opened = open_step(client, step, hot=True)  # after this client's own copy
    try:
        _, tree = opened.reader.tree_for(rank)
        state = unflatten(tree, opened.reader.read_full)
    finally:
        opened.close()
    client.restored_at(step)  # as after ckptd.restore: the run continues from this step, as a new attempt
    client.last_restore = opened.info
    return state
