"""Settings in one place: ``CKPTD_*`` environment variables with defaults.

An explicit function argument always wins over the environment, which wins over the default.
"""

from __future__ import annotations

import os
import re
import tempfile

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_job(job: object) -> str:
    """Return ``job`` if it is a safe directory name, else raise ``ValueError``.

    Job names become directory names under the daemon's root, so anything that could escape it
    (``..``, ``/``, empty, control characters) is refused.
    """
    if not isinstance(job, str) or not _JOB_RE.match(job) or ".." in job:
        raise ValueError(f"invalid job name {job!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit, no '..'")
    return job


def default_endpoint() -> str:
    """``CKPTD_ENDPOINT``, else a per-user ipc socket in ``$XDG_RUNTIME_DIR`` or the temp dir."""
    env = os.environ.get("CKPTD_ENDPOINT")
    if env:
        return env
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{os.path.join(base, f'ckptd-{os.getuid()}', 'ckptd.sock')}"


def default_job() -> str:
    """``CKPTD_JOB``, else torchrun's run id (``TORCHELASTIC_RUN_ID``), else ``default``."""
    job = os.environ.get("CKPTD_JOB") or os.environ.get("TORCHELASTIC_RUN_ID")
    if not job or job == "none":
        job = "default"
    return validate_job(job)


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
