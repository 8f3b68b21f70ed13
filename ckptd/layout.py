"""Names and paths, once: where a job's steps live on local disk and in the bucket, what shard and
fragment files are called, and when a step counts as complete.

Local root (the daemon's ``--root``)::

    <root>/<job>/step-<N>.tmp/      a step being written: rank-RRRRR.safetensors + rank-RRRRR.json
    <root>/<job>/step-<N>.fetch/    a step being downloaded from the bucket
    <root>/<job>/step-<N>/          a complete step: it holds manifest.json (written last); ``.fetched``
                                    in it marks a step downloaded from the bucket (never uploaded again)
    <root>/<job>/step-<N>.del/      a step retention is deleting (renamed out of the way first)
    <root>/<job>/step-<N>.old/      a complete step being replaced by a newer commit of its number (a rollback)
    <root>/<job>/latest             the step number ``latest`` names: the complete step committed last

Bucket (keys relative to the store's prefix)::

    <job>/step-<N>/rank-RRRRR.safetensors, <job>/step-<N>/rank-RRRRR.json     a one-node step's files
    <job>/step-<N>/run-<R>-after-<A>/rank-RRRRR.safetensors, .../rank-RRRRR.json
                                    a multi-node step's files, in the folder of the attempt that saved
                                    them (launch R, which had restored step A, or ``none``): two attempts
                                    of one step number never write the same shard or fragment
    <job>/step-<N>/manifest.json    written last: the step is complete in the bucket iff it exists; a
                                    multi-node step's names its attempt and ``attempt_objects``

Vocabulary used across the package: a rank *commits* its shard to the daemon (the ``commit`` op, the
commit record in shared memory); a step is *complete* once its manifest exists; the daemon reports a
complete step as *durable* to ``wait()``.

Pure functions except the ``list_*`` / ``*_steps`` / ``fragments_present`` helpers, which read one
directory. Safe on any thread, in the daemon and in the trainer.
"""

from __future__ import annotations

import os
import re

MANIFEST = "manifest.json"
LATEST = "latest"
FETCHED = ".fetched"  # in a complete local step: it was downloaded from the bucket, not made on this node

# each name is parsed, then accepted only if it is the canonical spelling of what it parsed to
# (no "step-01", no trailing newline, ranks past 99999 included)
_STEP_RE = re.compile(r"step-(\d+)")
_TMP_RE = re.compile(r"step-(\d+)\.tmp")
_DEL_RE = re.compile(r"step-(\d+)\.del")
_OLD_RE = re.compile(r"step-(\d+)\.old")
_FETCH_RE = re.compile(r"step-(\d+)\.fetch")
_NODE_RE = re.compile(r"step-(\d+)\.node-([0-9a-f]{8})")
GONE = ".gone"  # a node part's suffix once its attempt was given up: removed, never uploaded again
_FRAGMENT_RE = re.compile(r"rank-(\d{5,})\.json")
_BUCKET_KEY_RE = re.compile(r"step-(\d+)/(.+)", re.S)


# ---------------------------------------------------------------------------- file names in a step


def shard_name(rank: int) -> str:
    """The shard file of ``rank``: its staged bytes, a safetensors file."""
    return f"rank-{rank:05d}.safetensors"


def fragment_name(rank: int) -> str:
    """The fragment file of ``rank``: its chunk table, checksums and tree, merged into the manifest."""
    return f"rank-{rank:05d}.json"


def fragment_rank(name: str) -> int | None:
    """The rank a fragment file name belongs to, or ``None`` if ``name`` is not a fragment."""
    m = _FRAGMENT_RE.fullmatch(name)
    return int(m.group(1)) if m and fragment_name(int(m.group(1))) == name else None


def _step_of(pattern: re.Pattern[str], name: str, spell: str) -> int | None:
    m = pattern.fullmatch(name)
    return int(m.group(1)) if m and spell.format(int(m.group(1))) == name else None


# ---------------------------------------------------------------------------- local paths


def job_dir(root: str, job: str) -> str:
    return os.path.join(root, job)


def step_dir(root: str, job: str, step: int) -> str:
    return os.path.join(root, job, f"step-{step}")


def tmp_dir(root: str, job: str, step: int) -> str:
    return os.path.join(root, job, f"step-{step}.tmp")


def node_dir(root: str, job: str, step: int, tag: str) -> str:
    """This node's whole part of one attempt at a multi-node step (``tag``: 8 hex digits), moved out of
    ``step-N.tmp`` when it became durable, for the upload thread alone: a new attempt at the same number
    (a relaunch) writes a fresh ``step-N.tmp`` beside it."""
    return os.path.join(root, job, f"step-{step}.node-{tag}")


def fetch_dir(root: str, job: str, step: int) -> str:
    return os.path.join(root, job, f"step-{step}.fetch")


def trash_dir(root: str, job: str, step: int) -> str:
    """Where retention moves a complete step before deleting it: out of the committed namespace in one
    rename, so a crash mid-delete never leaves a ``step-N`` with a manifest and missing shards."""
    return os.path.join(root, job, f"step-{step}.del")


def replaced_dir(root: str, job: str, step: int) -> str:
    """Where a complete step waits, intact, while a newer commit of its number takes its place: deleted
    once that one is in place, moved back if it cannot be (never confused with a ``.del`` half-deleted)."""
    return os.path.join(root, job, f"step-{step}.old")


def was_fetched(root: str, job: str, step: int) -> bool:
    """Whether the complete local step ``step`` was downloaded from the bucket (it holds :data:`FETCHED`)."""
    return os.path.exists(os.path.join(step_dir(root, job, step), FETCHED))


def latest_file(root: str, job: str) -> str:
    return os.path.join(root, job, LATEST)


def is_complete(step_path: str) -> bool:
    """Whether the step directory ``step_path`` is a complete checkpoint: its manifest exists."""
    return os.path.exists(os.path.join(step_path, MANIFEST))


# ---------------------------------------------------------------------------- local listings


def list_jobs(root: str) -> list[str]:
    """Job directories under ``root``, sorted: directories whose name a job may have (a file system's
    ``lost+found`` at the root of a data disk is none)."""
    from .config import validate_job

    def is_job(name: str) -> bool:
        try:
            return bool(validate_job(name))
        except ValueError:
            return False

    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if is_job(n) and os.path.isdir(os.path.join(root, n)))


def complete_steps(root: str, job: str) -> list[int]:
    """Steps of ``job`` whose directory holds a manifest, ascending."""
    try:
        names = os.listdir(job_dir(root, job))
    except FileNotFoundError:
        return []
    steps = (s for n in names if (s := _step_of(_STEP_RE, n, "step-{}")) is not None)
    return sorted(s for s in steps if is_complete(step_dir(root, job, s)))


def partial_steps(root: str, job: str) -> list[int]:
    """Steps of ``job`` with a ``step-N.tmp`` directory (being written, or left by a crash), ascending."""
    return _steps_named(root, job, _TMP_RE, "step-{}.tmp")


def trashed_steps(root: str, job: str) -> list[int]:
    """Steps of ``job`` with a ``step-N.del`` directory (retention was deleting it), ascending."""
    return _steps_named(root, job, _DEL_RE, "step-{}.del")


def fetching_steps(root: str, job: str) -> list[int]:
    """Steps of ``job`` with a ``step-N.fetch`` directory (a download under way, or one a crash cut short), ascending."""
    return _steps_named(root, job, _FETCH_RE, "step-{}.fetch")


def replaced_steps(root: str, job: str) -> list[int]:
    """Steps of ``job`` with a ``step-N.old`` directory (a replacement was cut short), ascending."""
    return _steps_named(root, job, _OLD_RE, "step-{}.old")


def node_parts(root: str, job: str, gone: bool = False) -> dict[int, list[str]]:
    """This node's parts of multi-node steps of ``job`` (``step-N.node-*`` directories), by step; ``gone``: those of
    attempts given up instead (named with :data:`GONE` after it)."""
    try:
        names = os.listdir(job_dir(root, job))
    except FileNotFoundError:
        return {}
    out: dict[int, list[str]] = {}
    for n in names:
        m = _NODE_RE.fullmatch(n.removesuffix(GONE)) if n.endswith(GONE) == gone else None
        if m and f"step-{int(m.group(1))}.node-{m.group(2)}" == n.removesuffix(GONE) and os.path.isdir(p := os.path.join(root, job, n)):
            out.setdefault(int(m.group(1)), []).append(p)
    return {s: sorted(ds) for s, ds in sorted(out.items())}


def _steps_named(root: str, job: str, pattern: re.Pattern[str], spell: str) -> list[int]:
    try:
        names = os.listdir(job_dir(root, job))
    except FileNotFoundError:
        return []
    return sorted(s for n in names if (s := _step_of(pattern, n, spell)) is not None)


def fragments_present(root: str, job: str, step: int, directory: str | None = None) -> set[int]:
    """The ranks whose fragment is in ``step-N.tmp`` (or ``directory``): their shard is durable (the fragment comes last)."""
    try:
        names = os.listdir(directory or tmp_dir(root, job, step))
    except FileNotFoundError:
        return set()
    return {r for n in names if (r := fragment_rank(n)) is not None}


# ---------------------------------------------------------------------------- bucket keys


def bucket_prefix(job: str, step: int) -> str:
    """The key prefix of one step in the bucket (ends with ``/``: ``step-1/`` must not match ``step-10/``)."""
    return f"{job}/step-{step}/"


def bucket_key(job: str, step: int, name: str) -> str:
    return bucket_prefix(job, step) + name


def attempt_folder(run: int, after: int | None) -> str:
    """The folder (ends with ``/``) under a multi-node step's prefix that holds one attempt's shards and
    fragments: launch ``run``, which had restored step ``after`` (``None``: it restored nothing)."""
    return f"run-{run}-after-{'none' if after is None else after}/"


def parse_bucket_key(job: str, key: str) -> tuple[int, str] | None:
    """``(step, file name)`` of a key under ``<job>/``, or ``None`` if it is not a step's file."""
    if not key.startswith(job + "/"):
        return None
    rest = key[len(job) + 1 :]
    m = _BUCKET_KEY_RE.fullmatch(rest)
    if m is None or "\n" in rest or bucket_key(job, int(m.group(1)), m.group(2)) != key:
        return None
    return int(m.group(1)), m.group(2)
