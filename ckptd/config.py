"""Settings in one place: every default, the ``CKPTD_*`` environment variables, the daemon's TOML file.

Precedence: an explicit argument (a function argument, a ``ckptd serve`` flag) wins over the TOML
file, which wins over the environment, which wins over the default. Nothing here imports torch or
zmq: the trainer, the daemon and the CLI all read their settings through this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .s3config import DirConfig, RemoteConfig

# ---------------------------------------------------------------------------- defaults

# the client
CLIENT_TIMEOUT_S = 30.0  # CKPTD_TIMEOUT: each request to the daemon
COLLECTIVE_TIMEOUT_S = 1800.0  # CKPTD_COLLECTIVE_TIMEOUT: a rank waits this long for the others at snapshot()/prepare()
ALLOC_TIMEOUT_S = 600.0  # CKPTD_ALLOC_TIMEOUT: an alloc held back while the memory budget is full
BUSY_RETRY_S = 30.0  # a request the daemon answers busy (an earlier attempt at the step in flight) is asked again this long

# the daemon (ckptd serve): see DaemonConfig for the settable ones
KEEP = 3
WORKERS = 2
NICE = 10
REMOTE_KEEP = 3
REMOTE_KEEP_EVERY = 0
COMMIT_TIMEOUT_S = 600.0

# limits the daemon enforces (not settable)
WAIT_CAP_S = 30.0  # longest a wait / fetch_wait reply is held back
HOUSEKEEPING_S = 0.5  # period of reaping dead lessees, lapsed pins, overdue waiters
TRACKS_KEPT = 256  # finished steps remembered per job, so a late wait() gets the truth
FETCHES_KEPT = 256  # finished fetch answers kept for a client that has not asked yet
HOT_PIN_MAX_S = 600.0  # a hot restore's pin on a slot lapses after this, whatever its pid
FETCH_HOLD_S = 3600.0  # a step a restore reads from disk stays out of local retention until fetch_close, this long at most
MAX_FETCH_HOLDS = 256  # such holds at once (beyond it, the oldest of the user holding the most lapses)
MAX_FETCH_HOLDS_PER_CLIENT = 16  # of one connection (a client fetching in a loop, never closing: its oldest lapses)
MAX_FETCHES_PER_CLIENT = 64  # fetches and bucket lookups one connection has queued at once; more are refused
MAX_FETCHES_PER_USER = 8192  # of all one user's connections (every rank of a node restores through one daemon)
MAX_WORLD_SIZE = 1 << 20  # ranks of one step (a wire field and a recovered record are refused above it)
MAX_LOCAL_WORLD_SIZE = 4096  # ranks one daemon serves in one step
MAX_STEP = (1 << 63) - 1
MAX_DEFERRED_ALLOCS = 4096  # allocs held back for memory at once; more are refused
MAX_PREPARED_SLOTS = 16  # prepare(slots=N): a rank alternates between a few; more only waste the budget
MAX_PINS_PER_READER = 16  # open hot restores of one slot by one process
MAX_PINS_UNNAMED = 256  # ... by the processes the kernel cannot name here (pid 0), together
MAX_NAME_BYTES = 256  # segment names and other short strings on the wire
MAX_PROTECTED_NAME = 4096  # a name that protects a step from retention (a pointer file's path)
MAX_TREE_DEPTH = 256  # nesting of one rank's tree (committed, in a fragment, in a manifest; documents get 3 more levels)
LEASE_TIMEOUT_S = 3600.0  # a leased slot not committed or released by then is taken back
MAX_CONNECTIONS = 4096  # client connections the daemon keeps at once (fewer where the open-files limit is low)
MAX_CONNECTIONS_PER_USER = 1024  # ... of one user (a node's trainers hold a few each)
CONNECTIONS_RESYNC_S = 10.0  # how often held connections are checked against the descriptors (events can be dropped)
FD_RESERVE = 512  # descriptors kept for the daemon's own files, segments and threads, whatever its clients hold
METRICS_MAX_CONNECTIONS = 16  # scrapes served at once; more are closed at once
METRICS_TIMEOUT_S = 10.0  # a metrics connection silent this long is closed
MAX_DOCUMENT_BYTES = 1 << 30  # a manifest or fragment read from the bucket (read whole into memory)


# ---------------------------------------------------------------------------- names and environment

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_job(job: object) -> str:
    """Return ``job`` if it is a safe directory name, else raise ``ValueError``.

    Job names become directory names under the daemon's root, so anything that could escape it
    (``..``, ``/``, empty, control characters) is refused.
    """
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job) or ".." in job:
        raise ValueError(f"invalid job name {job!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit, no '..'")
    return job


def validate_endpoint(endpoint: object) -> str:
    """Return ``endpoint`` if it is one ckptd speaks (``ipc://<path>`` or ``tcp://<host>:<port>``),
    else raise :class:`CheckpointError` saying what one looks like."""
    from .errors import CheckpointError

    ok = isinstance(endpoint, str) and (
        (endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"))
        or re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):(\d{1,5}|\*)", endpoint) is not None
    )
    if not ok:
        raise CheckpointError(
            f"{endpoint!r} is not a ckptd endpoint (CKPTD_ENDPOINT, --endpoint): use ipc:///path/to/ckptd.sock"
            " (the default is a socket of your user's in $XDG_RUNTIME_DIR or the temp dir) or tcp://host:port"
        )
    return endpoint


def default_endpoint() -> str:
    """``CKPTD_ENDPOINT``, else a per-user ipc socket in ``$XDG_RUNTIME_DIR`` or the temp dir."""
    env = os.environ.get("CKPTD_ENDPOINT")
    if env:
        return env
    return per_user_endpoint()


def per_user_endpoint() -> str:
    """The endpoint of this user's own daemon: a socket in ``$XDG_RUNTIME_DIR`` or the temp dir named by the uid."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{os.path.join(base, f'ckptd-{os.getuid()}', 'ckptd.sock')}"


def trusted_group() -> str | None:
    """``CKPTD_TRUST_GROUP``: the client also connects to a daemon whose socket belongs to this group
    (a daemon run by another user for the group's members); by default only a socket owned by the
    client's own user (or root) is trusted."""
    return os.environ.get("CKPTD_TRUST_GROUP") or None


_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


_LOCAL_RANK_RE = re.compile(r"--local[-_]rank(=.*)?")


def _same_on_every_rank(args: list[str]) -> list[str]:
    """The arguments without the per-process ``--local-rank N`` that torch.distributed.launch and
    DeepSpeed's launcher add (every rank must derive the same job name)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        m = _LOCAL_RANK_RE.fullmatch(a)
        if m:
            skip = m.group(1) is None  # "--local-rank N": drop N too
            continue
        out.append(a)
    return out


def default_job(argv: list[str] | None = None, cwd: str | None = None) -> str:
    """The job name when none is given: one that is stable across relaunches of the same run and
    differs between different runs, or a :class:`CheckpointError` saying how to set one.

    1. ``CKPTD_JOB``.
    2. torchrun's ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``) when the user chose it: not ``none`` (plain
       ``torchrun``) and not the random UUID ``torchrun --standalone`` draws for every launch.
    3. On one node: ``<script>-<8 hex>``, the script's name and a hash of its real path, the working
       directory and the arguments (less a launcher's per-process ``--local-rank``): relaunching the
       same command in the same directory resumes, a run with other arguments or in another directory
       is another job.
    Refused: a job spanning nodes without 1 or 2 (paths may differ between nodes, and every node must
    name the job alike), and an interactive session or ``python -c`` (no script to name it by).
    """
    from .errors import CheckpointError

    job = os.environ.get("CKPTD_JOB")
    if job:
        return validate_job(job)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none" and not _UUID_RE.fullmatch(run_id.lower()):
        return validate_job(run_id)
    how = "set CKPTD_JOB=<name> (or pass Client(job=...), or torchrun --rdzv-id=<name>)"
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(world) > int(local):
        raise CheckpointError(f"ckptd needs a job name that every node agrees on for a job spanning nodes: {how}")
    argv = list(sys.argv if argv is None else argv)
    script = argv[0] if argv else ""
    if not script or script == "-c" or not os.path.isfile(script):
        raise CheckpointError(f"ckptd cannot name the job after a script (this is an interactive session or python -c): {how}")
    real = os.path.realpath(script)
    digest = hashlib.sha256(json.dumps([real, cwd or os.getcwd(), _same_on_every_rank(argv[1:])]).encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.splitext(os.path.basename(real))[0]).lstrip("._-")[:48] or "job"
    return validate_job(f"{stem}-{digest}")


def _env(name: str, default: Any, parse: Any, kind: str) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {kind}") from None


def env_float(name: str, default: float) -> float:
    return _env(name, default, float, "a number")


def env_int(name: str, default: int) -> int:
    return _env(name, default, int, "an integer")


def _parse_rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float(parse_size(text))


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def parse_size(text: str) -> int:
    """Bytes from ``8G``, ``512M``, ``64KiB`` or a plain number; ``ValueError`` names the text."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, OverflowError):
        n = -1
    if n < 0:
        raise ValueError(f"not a size: {text!r} (use e.g. 8G, 512M)")
    return n


# ---------------------------------------------------------------------------- the daemon's settings


def default_shm_budget() -> int:
    """Half of the shared-memory filesystem: room to stage while the rest of the node runs."""
    from .shm import SHM_DIR

    st = os.statvfs(SHM_DIR)
    return st.f_frsize * st.f_blocks // 2


@dataclass(frozen=True)
class DaemonConfig:
    """What ``ckptd serve`` runs with. Build it with :func:`daemon_config` (flags, file, environment)."""

    root: str
    endpoint: str
    shm_budget: int | None = None  # bytes of /dev/shm to stage into; None: half of it
    keep: int = KEEP  # complete local steps kept per job
    workers: int = WORKERS  # persist threads
    write_rate_limit: float = 0.0  # bytes/s cap on disk writes, 0: none
    nice: int = NICE  # niceness of persist and upload threads (0: unchanged)
    idle_priority: bool = True  # persist and upload threads: SCHED_IDLE, and the lowest best-effort I/O level (7)
    direct_io: bool = True  # shards are written past the page cache (O_DIRECT) where the file system takes it
    log_level: str = "INFO"
    group: str | int | None = None  # also let this group use the socket, segments and checkpoints
    metrics_port: int = 0  # Prometheus metrics on 127.0.0.1:PORT, 0: off
    remote: RemoteConfig | DirConfig | None = None  # the [remote] table: a bucket, or a shared directory (--remote-path)
    remote_keep: int = REMOTE_KEEP  # newest steps kept in the bucket...
    remote_keep_every: int = REMOTE_KEEP_EVERY  # ...plus every Nth step, forever (0: none)
    commit_timeout: float = COMMIT_TIMEOUT_S  # multi-node: seconds to wait for the other nodes' shards
    lease_timeout: float = LEASE_TIMEOUT_S  # a slot leased but neither committed nor released is taken back after this
    persist_every: int = 1  # tiering (daemon/tiering.py): persist one snapshot in N, the others stay in memory only...
    persist_interval: float = 0.0  # ...and the first one T seconds after the last persisted one (0: no time rule)
    lagging: str = "wait"  # a snapshot due for disk while the disk is busy: "wait" (queued for disk) or "memory" (kept in memory)
    peer_listen: str | None = None  # tcp://ADDR:PORT: hold peers' replicas (daemon/replicas.py)
    peers: tuple[str, ...] = ()  # tcp://ADDR:PORT of peer daemons to replicate to (static: a job on one node)
    peer_key: str | None = None  # the cluster's CurveZMQ key file (ckptd keygen), mode 0600
    replicas: int = 0  # peers each completed step is copied to (0: no replication)
    replicate_rate_limit: float = 0.0  # bytes/s cap on replication, 0: none
    replica_budget: int | None = None  # shared memory set aside for peers' replicas (None: half the shm budget)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

SERVE_KEYS = (
    "root", "endpoint", "shm_budget", "keep", "workers", "write_rate_limit", "nice", "log_level", "group", "metrics_port", "idle_priority",
    "direct_io", "lease_timeout", "persist_every", "persist_interval", "lagging", "peer_listen", "peers", "peer_key", "replicas",
    "replicate_rate_limit", "replica_budget",
)  # fmt: skip
_STR_KEYS = ("root", "endpoint", "log_level", "group", "lagging", "peer_listen", "peer_key")
_FLOAT_KEYS = ("lease_timeout", "persist_interval")
_SIZE_KEYS = ("shm_budget", "write_rate_limit", "replicate_rate_limit", "replica_budget")
# the [remote] table holds the bucket's RemoteConfig and these, the bucket's retention and the multi-node wait
_REMOTE_TIER_KEYS = {"keep": ("remote_keep", 1), "keep_every": ("remote_keep_every", 0), "commit_timeout": ("commit_timeout", 1)}


def _from_env() -> dict[str, Any]:
    return {
        "root": os.environ.get("CKPTD_ROOT"),
        "keep": env_int("CKPTD_KEEP", KEEP),
        "workers": env_int("CKPTD_WORKERS", WORKERS),
        "write_rate_limit": _env("CKPTD_WRITE_RATE_LIMIT", 0.0, _parse_rate, "a size per second (e.g. 500M)"),
        "nice": env_int("CKPTD_NICE", NICE),
        "group": os.environ.get("CKPTD_GROUP") or None,
        "metrics_port": env_int("CKPTD_METRICS_PORT", 0),
        "idle_priority": _env("CKPTD_IDLE_PRIORITY", True, _parse_bool, "a boolean (1/0, true/false, yes/no)"),
        "direct_io": _env("CKPTD_DIRECT_IO", True, _parse_bool, "a boolean (1/0, true/false, yes/no)"),
        "lease_timeout": env_float("CKPTD_LEASE_TIMEOUT", LEASE_TIMEOUT_S),
        "persist_every": env_int("CKPTD_PERSIST_EVERY", 1),
        "persist_interval": env_float("CKPTD_PERSIST_INTERVAL", 0.0),
        "lagging": os.environ.get("CKPTD_LAGGING") or None,
        "remote_path": os.environ.get("CKPTD_REMOTE_PATH") or None,
    }


def _remote_table(table: object, where: str) -> dict[str, Any]:
    from .s3config import DirConfig, RemoteConfig

    if not isinstance(table, dict):
        raise ValueError(f"{where}: [remote] must be a table")
    conf = {k: v for k, v in table.items() if k not in _REMOTE_TIER_KEYS}
    kind = DirConfig if "path" in conf else RemoteConfig
    out: dict[str, Any] = {"remote_unnamed": True} if not conf else {}  # only the tier's keys: --remote-path names it
    for key in ("max_bandwidth", "part_size"):
        if isinstance(conf.get(key), str):
            try:
                conf[key] = parse_size(conf[key])
            except ValueError as e:
                raise ValueError(f"{where}: remote.{key}: {e}") from None
    try:
        if conf:
            out["remote"] = kind.from_dict(conf)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for key, (field, least) in _REMOTE_TIER_KEYS.items():
        if key in table:
            value = table[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{where}: remote.{key} must be an integer >= {least}, got {value!r}")
            out[field] = value
    return out


def _from_file(path: str) -> dict[str, Any]:
    import tomllib

    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    out = _remote_table(data.pop("remote"), path) if "remote" in data else {}
    unknown = set(data) - set(SERVE_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown settings {sorted(unknown)} (known: {', '.join(SERVE_KEYS)})")
    for key, value in data.items():
        if key in _SIZE_KEYS and isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError as e:
                raise ValueError(f"{path}: {key}: {e}") from None
        if key == "peers":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{path}: peers must be a list of endpoints (strings), got {value!r}")
            out[key] = tuple(value)
            continue
        want = str if key in _STR_KEYS else bool if key in ("idle_priority", "direct_io") else float if key in _FLOAT_KEYS else int
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise ValueError(f"{path}: {key} must be a {want.__name__}, got {value!r}")
        out[key] = value
    return out


def _check_apart(root: str, remote: Any) -> None:
    """``ValueError`` for a shared directory that is the root, or holds it, or lies inside it: both keep
    ``<job>/step-N``, and each tier's retention would remove the other's steps."""
    from .s3config import DirConfig

    if not isinstance(remote, DirConfig):
        return
    a, b = os.path.realpath(root), os.path.realpath(remote.path)
    if a == b or a.startswith(b.rstrip(os.sep) + os.sep) or b.startswith(a.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"the shared directory {remote.path} and the root {root} overlap: give the daemon a root of its own on local"
            " disk, apart from the directory every node shares"
        )


PEER_ADDRESS_RE = re.compile(r"tcp://[^\s/:]{1,253}:\d{1,5}")  # a peer link's endpoint: tcp://HOST:PORT


def _check_peers(cfg: dict[str, Any]) -> None:
    """``ValueError`` for peer settings that cannot work: an endpoint that is not ``tcp://HOST:PORT``, more replicas
    than peers (without ``--peer-listen``, where a job that spans nodes names its own), peer links without the cluster's
    key, a replica budget without a port to receive replicas on."""
    cfg["peers"] = tuple(dict.fromkeys(cfg.get("peers") or ()))  # in order, each once
    for what, ep in [("peer_listen", cfg.get("peer_listen"))] + [("peer", p) for p in cfg["peers"]]:
        if ep is not None and (not isinstance(ep, str) or not PEER_ADDRESS_RE.fullmatch(ep)):
            raise ValueError(f"{what} must be tcp://HOST:PORT (peer links are TCP, encrypted with the cluster's key), got {ep!r}")
    replicas = cfg.get("replicas", 0)
    if cfg["peers"] and replicas > len(cfg["peers"]) or replicas and not cfg["peers"] and not cfg.get("peer_listen"):
        raise ValueError(
            f"replicas {replicas} needs at least {replicas} peers (--peer tcp://HOST:PORT, repeated), got {len(cfg['peers'])};"
            " or --peer-listen, for jobs that span nodes (their ranks name the daemons)"
        )
    if (cfg.get("peer_listen") or cfg["peers"]) and not cfg.get("peer_key"):
        raise ValueError(
            "peer links need the cluster's key: give --peer-key FILE (make one with: ckptd keygen FILE, then copy it to every node)"
        )
    if cfg.get("replica_budget") is not None and not cfg.get("peer_listen"):
        raise ValueError("replica_budget sets aside shared memory for peers' replicas: it needs --peer-listen")


def daemon_config(flags: dict[str, Any] | None = None, config_file: str | None = None) -> DaemonConfig:
    """The daemon's settings: ``flags`` (``None`` values ignored) over ``config_file`` (TOML) over
    ``CKPTD_*`` over the defaults. Raises ``ValueError`` naming an unknown key, a wrong type, a bad
    value or a missing root."""
    from .s3config import DirConfig

    cfg = {k: v for k, v in _from_env().items() if v is not None}
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    if "remote_path" in cfg:  # CKPTD_REMOTE_PATH: a shared directory, unless the config file names a [remote]
        cfg["remote"] = DirConfig(cfg.pop("remote_path"))
    if config_file:
        cfg.update(_from_file(config_file))
    if "remote_path" in flags:  # --remote-path replaces the file's [remote] (its keep and commit_timeout stay)
        cfg["remote"] = DirConfig(flags.pop("remote_path"))
    cfg.update(flags)
    if cfg.pop("remote_unnamed", False) and cfg.get("remote") is None:
        raise ValueError(f"{config_file}: [remote] names neither a bucket nor a path: give bucket = or path =, or --remote-path")
    if not cfg.get("root"):
        raise ValueError("no checkpoint root: give --root, root in --config, or CKPTD_ROOT")
    _check_apart(cfg["root"], cfg.get("remote"))
    for key, least in (
        ("keep", 1), ("workers", 1), ("shm_budget", 1), ("write_rate_limit", 0), ("metrics_port", 0), ("lease_timeout", 1),
        ("persist_every", 1), ("persist_interval", 0), ("replicas", 0), ("replicate_rate_limit", 0), ("replica_budget", 1),
    ):  # fmt: skip
        if cfg.get(key) is not None and not math.isfinite(cfg[key]):  # NaN compares false with every bound
            raise ValueError(f"{key} must be a finite number, got {cfg[key]!r}")
        if cfg.get(key) is not None and cfg[key] < least:
            raise ValueError(f"{key} must be >= {least}")
    if cfg.get("group") == "":
        cfg["group"] = None  # no group, as an empty CKPTD_GROUP means (not a group-readable umask with no group)
    cfg["log_level"] = str(cfg.get("log_level", "INFO")).upper()
    if cfg["log_level"] not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {cfg['log_level']!r}")
    if cfg.get("lagging") not in (None, "memory", "wait"):
        raise ValueError(f"lagging must be 'memory' or 'wait', got {cfg['lagging']!r}")
    if not 0 <= cfg.get("nice", NICE) <= 19:  # the threads yield to training; a negative value would raise them above it
        raise ValueError(f"nice must be 0..19 (0: unchanged), got {cfg.get('nice')}")
    if not 0 <= cfg["metrics_port"] <= 65535:
        raise ValueError(f"metrics_port must be a TCP port (0 = off), got {cfg['metrics_port']}")
    if cfg.get("group") is not None:
        from .errors import CheckpointError

        try:
            resolve_group(cfg["group"])
        except CheckpointError as e:
            raise ValueError(str(e)) from None
    _check_peers(cfg)
    cfg["endpoint"] = cfg.get("endpoint") or default_endpoint()
    cfg["write_rate_limit"] = float(cfg["write_rate_limit"])
    cfg["replicate_rate_limit"] = float(cfg.get("replicate_rate_limit", 0.0))
    cfg["commit_timeout"] = float(cfg.get("commit_timeout", COMMIT_TIMEOUT_S))
    cfg["lease_timeout"] = float(cfg.get("lease_timeout", LEASE_TIMEOUT_S))
    cfg["persist_interval"] = float(cfg.get("persist_interval", 0.0))
    known = {f.name for f in dataclasses.fields(DaemonConfig)}
    return DaemonConfig(**{k: v for k, v in cfg.items() if k in known})


def resolve_group(group: str | int | None) -> int | None:
    """The gid of a group given by name or number; ``None`` for none. Raises ``CheckpointError``."""
    if group is None or group == "":
        return None
    import grp

    from .errors import CheckpointError

    try:
        if isinstance(group, int) or group.isdigit():
            return grp.getgrgid(int(group)).gr_gid
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise CheckpointError(f"unknown group {group!r}") from None
