"""Durable-file primitives shared by the local and bucket tiers: fsync a directory, write a file
atomically (temporary file, fsync, rename, fsync of the directory).

Blocking disk I/O: called from the daemon's persist, upload and fetch threads, never its loop.
"""

from __future__ import annotations

import json
import os
from typing import Any


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def create_new(path: str, mode: int = 0o644) -> int:
    """A write fd of a file made here and now: never one found in place, never through a symlink
    (``O_EXCL|O_NOFOLLOW``). A leftover of a crashed writer is removed first (unlinking a planted
    symlink removes the link, not its target)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (through a temporary made by :func:`create_new`)."""
    tmp = path + ".tmp"
    fd = create_new(tmp)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)  # a full disk leaves no half-written temporary behind
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_json_durable(path: str, obj: Any) -> None:
    """Write ``obj`` as compact JSON to ``path`` atomically and durably."""
    write_durable(path, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode())
