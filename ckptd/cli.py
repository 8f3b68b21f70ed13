"""Command line: ``ckptd serve`` runs the daemon in the foreground; other commands are clients."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from ._config import default_endpoint, env_float, env_int


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 8G, 512M)") from None


SERVE_KEYS = (
    "root", "endpoint", "shm_budget", "keep", "workers", "write_rate_limit", "nice", "log_level", "group", "metrics_port", "idle_priority",
)  # fmt: skip
# the [remote] table: where the bucket is (ckptd.objstore.RemoteConfig), and the bucket's retention
REMOTE_TIER_KEYS = {"keep": 3, "keep_every": 0, "commit_timeout": 600}


def remote_settings(table: object, where: str) -> dict[str, object]:
    """The ``[remote]`` table: ``{"remote": RemoteConfig, "remote_keep", "remote_keep_every",
    "commit_timeout"}``. Raises ``ValueError`` naming what is wrong."""
    from .objstore import RemoteConfig

    if not isinstance(table, dict):
        raise ValueError(f"{where}: [remote] must be a table")
    conf = {k: v for k, v in table.items() if k not in REMOTE_TIER_KEYS}
    for key in ("max_bandwidth", "part_size"):
        if isinstance(conf.get(key), str):
            try:
                conf[key] = _size(conf[key])
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"{where}: remote.{key}: {e}") from None
    try:
        remote = RemoteConfig.from_dict(conf)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    out: dict[str, object] = {"remote": remote}
    for key, default in REMOTE_TIER_KEYS.items():
        value = table.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key != "keep_every" else 0):
            raise ValueError(f"{where}: remote.{key} must be an integer >= {1 if key != 'keep_every' else 0}, got {value!r}")
        out["remote_" + key if key != "commit_timeout" else key] = value
    return out


def serve_settings(args: argparse.Namespace) -> dict[str, object]:
    """The daemon's settings: a flag wins over the TOML file, which wins over CKPTD_* and the defaults.

    Raises ``ValueError`` naming an unknown key, a wrong type or a missing root.
    """
    cfg: dict[str, object] = {
        "root": os.environ.get("CKPTD_ROOT"),
        "endpoint": None,
        "shm_budget": None,
        "keep": env_int("CKPTD_KEEP", 3),
        "workers": env_int("CKPTD_WORKERS", 2),
        "write_rate_limit": int(env_float("CKPTD_WRITE_RATE_LIMIT", 0)),
        "nice": env_int("CKPTD_NICE", 10),
        "log_level": "INFO",
        "group": os.environ.get("CKPTD_GROUP") or None,
        "metrics_port": env_int("CKPTD_METRICS_PORT", 0),
        "idle_priority": os.environ.get("CKPTD_IDLE_PRIORITY", "1") not in ("0", "false", "no"),
    }
    if args.config:
        import tomllib

        with open(args.config, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"{args.config}: {e}") from None
        if "remote" in data:
            cfg.update(remote_settings(data.pop("remote"), args.config))
        unknown = set(data) - set(SERVE_KEYS)
        if unknown:
            raise ValueError(f"{args.config}: unknown settings {sorted(unknown)} (known: {', '.join(SERVE_KEYS)})")
        for key, value in data.items():
            if key in ("shm_budget", "write_rate_limit") and isinstance(value, str):
                try:
                    value = _size(value)
                except argparse.ArgumentTypeError as e:
                    raise ValueError(f"{args.config}: {key}: {e}") from None
            want = str if key in ("root", "endpoint", "log_level", "group") else bool if key == "idle_priority" else int
            if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
                raise ValueError(f"{args.config}: {key} must be a {want.__name__}, got {value!r}")
            cfg[key] = value
    for key in SERVE_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            cfg[key] = value
    if not cfg["root"]:
        raise ValueError("no checkpoint root: give --root, root in --config, or CKPTD_ROOT")
    if int(cfg["keep"]) < 1:  # type: ignore[call-overload]
        raise ValueError("keep must be >= 1")
    if cfg["group"] is not None:
        from .daemon import resolve_group
        from .errors import CheckpointError

        try:
            resolve_group(cfg["group"])  # type: ignore[arg-type]
        except CheckpointError as e:
            raise ValueError(str(e)) from None
    cfg["endpoint"] = cfg["endpoint"] or default_endpoint()
    return cfg


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _rate(n: float | None) -> str:
    return "-" if not n else f"{n / 1e6:.0f} MB/s" if n < 1e9 else f"{n / 1e9:.2f} GB/s"


def _bar(done: float, total: float, width: int = 24) -> str:
    frac = min(1.0, done / total) if total else 0.0
    return "[" + "#" * round(frac * width) + "." * (width - round(frac * width)) + f"] {frac:4.0%}"


def format_status(st: dict[str, Any]) -> str:
    """``ckptd status`` for people: the daemon, its memory, throughput, uploads in progress, jobs."""
    up = int(st.get("uptime_s", 0))
    slots = st.get("slots", {})
    lines = [
        f"ckptd {st.get('version', '?')}, pid {st['pid']}, up {up // 3600}h{up % 3600 // 60:02d}m, root {st['root']}",
        f"bucket      {st.get('remote') or 'none (local disk only)'}",
        f"memory      {_gb(st['shm_bytes'])} of {_gb(st['shm_budget'])} in {sum(slots.values())} slot(s)"
        f" ({', '.join(f'{k} {v}' for k, v in sorted(slots.items())) or 'none'}); {_gb(st.get('staged_bytes', 0))} committed,"
        f" not yet durable; {st['deferred_allocs']} allocation(s) waiting",
        f"persist     {_gb(st['persisted_bytes'])} in {st['persist_seconds']:.1f} s ({_rate(st.get('persist_bytes_per_s'))}),"
        f" {st['steps_committed']} steps committed",
    ]
    if st.get("remote"):
        backlog = st.get("upload_backlog") or []
        lines.append(
            f"upload      {_gb(st['uploaded_bytes'])} in {st['upload_seconds']:.1f} s ({_rate(st.get('upload_bytes_per_s'))}),"
            f" {st['steps_uploaded']} steps uploaded; {len(backlog)} queued"
        )
        u = st.get("uploading")
        if u:
            rate = u["bytes_done"] / u["seconds"] if u["seconds"] else None
            lines.append(
                f"uploading   job {u['job']} step {u['step']}: {_bar(u['bytes_done'], u['bytes_total'])}"
                f" {_gb(u['bytes_done'])} / {_gb(u['bytes_total'])}, {_rate(rate)}"
            )
        if st.get("fetching"):
            f = st["fetching"]
            lines.append(f"fetching    job {f['job']} step {f['step']} from the bucket: {_gb(f['bytes_done'])} so far")
    lines.append(f"last error  {st.get('last_error') or 'none'}" + (f" ({st['errors']} in all)" if st.get("errors") else ""))
    jobs = st.get("jobs") or {}
    if jobs:
        lines += ["", f"{'job':<24} {'latest':>8} {'uploaded':>9} {'in memory':>10}  in flight"]
        for job, info in sorted(jobs.items()):

            def cell(key: str, info: dict[str, Any] = info) -> str:
                v = info.get(key)
                return "-" if v is None else str(v)

            flight = ", ".join(map(str, sorted(info.get("in_flight") or []))) or "-"
            lines.append(f"{job:<24} {cell('latest'):>8} {cell('uploaded'):>9} {cell('in_memory'):>10}  {flight}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ckptd", description="Asynchronous checkpoint daemon for PyTorch.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the node daemon in the foreground")
    s.add_argument("--config", default=None, help="TOML file with any of the settings below (command-line flags win)")
    s.add_argument("--root", default=None, help="directory that holds the checkpoints (<root>/<job>/step-N); required")
    s.add_argument("--endpoint", default=None, help="ZeroMQ endpoint (default: CKPTD_ENDPOINT or a per-user ipc socket)")
    s.add_argument("--shm-budget", type=_size, default=None, help="shared memory to stage into (default: half of /dev/shm)")
    s.add_argument("--keep", type=int, default=None, help="committed steps kept per job (default 3, CKPTD_KEEP)")
    s.add_argument("--workers", type=int, default=None, help="persist threads (default 2, CKPTD_WORKERS)")
    s.add_argument("--write-rate-limit", type=_size, default=None, help="bytes/s cap on disk writes (default: none)")
    s.add_argument("--nice", type=int, default=None, help="niceness of persist threads (default 10; 0 = unchanged)")
    s.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    s.add_argument("--group", default=None, help="also let this group use the socket, segments and checkpoints (default: owner only)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on 127.0.0.1:PORT (default 0: off)")
    s.add_argument(
        "--idle-priority",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="persist and upload threads use only idle CPU and disk time (SCHED_IDLE, idle I/O class; default on)",
    )

    st = sub.add_parser("status", help="ask a running daemon for its state: jobs, memory, throughput, uploads, last error")
    st.add_argument("--endpoint", default=None)
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    st.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS (upload progress); Ctrl-C stops")

    v = sub.add_parser("verify", help="re-read a checkpoint: checksums, headers, coverage, manifest (exit 1 if unsound)")
    v.add_argument("ckpt", help="a step directory, or a job directory (its newest step)")

    ex = sub.add_parser("export", help="consolidate a checkpoint into one full state dict file, streaming")
    ex.add_argument("ckpt", help="a step directory, or a job directory (its newest step)")
    ex.add_argument("--out", required=True)
    ex.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    ex.add_argument("--what", choices=("model", "optim", "all"), default="model")

    ls = sub.add_parser("ls", help="committed steps with size, world size, layout and time")
    ls.add_argument("--root", default=None, help="checkpoint root (default: ask the running daemon)")
    ls.add_argument("--job", default=None)
    ls.add_argument("--endpoint", default=None)

    args = p.parse_args(argv)
    if args.cmd == "serve":
        from .errors import CheckpointError

        try:
            cfg = serve_settings(args)
        except (ValueError, OSError) as e:
            print(f"ckptd serve: {e}", file=sys.stderr)
            return 2
        from .daemon import Daemon

        logging.basicConfig(level=cfg["log_level"].upper(), stream=sys.stderr, format="%(asctime)s ckptd %(levelname)s %(message)s")
        for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
            logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
        try:
            Daemon(
                cfg["root"],
                cfg["endpoint"],
                shm_budget=cfg["shm_budget"],
                keep=cfg["keep"],
                workers=cfg["workers"],
                write_rate_limit=float(cfg["write_rate_limit"]),
                nice=cfg["nice"],
                group=cfg["group"],
                remote=cfg.get("remote"),
                remote_keep=cfg.get("remote_keep", 3),
                remote_keep_every=cfg.get("remote_keep_every", 0),
                commit_timeout=float(cfg.get("commit_timeout", 600)),
                metrics_port=int(cfg["metrics_port"]),  # type: ignore[call-overload]
                idle_priority=bool(cfg["idle_priority"]),
            ).serve()
        except CheckpointError as e:
            print(f"ckptd: {e}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "status":
        from .client import Client
        from .errors import CheckpointError

        try:
            with Client(endpoint=args.endpoint, timeout=5.0) as c:
                while True:
                    st = c.status()
                    out = json.dumps(st, indent=2) if args.json else format_status(st)
                    if args.watch and sys.stdout.isatty():
                        sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place
                    print(out, flush=True)
                    if not args.watch:
                        break
                    time.sleep(args.watch)
        except CheckpointError as e:
            print(f"ckptd: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            pass
        return 0
    if args.cmd == "verify":
        return _verify(args.ckpt)
    if args.cmd == "export":
        from .errors import CheckpointError
        from .export import export_checkpoint

        try:
            stats = export_checkpoint(args.ckpt, args.out, fmt=args.format, what=args.what)
        except (CheckpointError, OSError) as e:
            print(f"ckptd export: {e}", file=sys.stderr)
            return 1
        print(f"wrote {args.out}: {stats['tensors']} tensors, {stats['bytes'] / 1e9:.3f} GB")
        return 0
    if args.cmd == "ls":
        return _ls(args.root, args.job, args.endpoint)
    return 2


def _verify(ckpt: str) -> int:
    from .errors import CheckpointError
    from .reader import resolve_step_dir
    from .verify import stale_warning, verify_checkpoint

    try:
        step_dir = resolve_step_dir(ckpt)
    except CheckpointError as e:
        print(f"ckptd verify: {e}", file=sys.stderr)
        return 1
    problems = verify_checkpoint(step_dir)
    for p in problems:
        print(f"ckptd verify: {p}", file=sys.stderr)
    if problems:
        print(f"{step_dir}: UNSOUND ({len(problems)} problem(s))")
        return 1
    warning = stale_warning(step_dir)
    if warning:
        print(f"ckptd verify: warning: {warning}", file=sys.stderr)
    print(f"{step_dir}: OK")
    return 0


def _ls(root: str | None, job: str | None, endpoint: str | None) -> int:
    import time

    from .errors import CheckpointError, FormatError
    from .format import read_manifest
    from .persist import committed_steps, list_jobs

    if root is None:
        from .client import Client

        try:
            with Client(endpoint=endpoint, timeout=5.0) as c:
                root = c.hello()["root"]
        except CheckpointError as e:
            print(f"ckptd ls: no --root given and {e}", file=sys.stderr)
            return 1
    jobs = [job] if job else list_jobs(root)
    print(f"{'job':<20} {'step':>8} {'size':>10} {'ranks':>5}  {'layout':<34} created")
    for j in jobs:
        for step in committed_steps(root, j):
            d = os.path.join(root, j, f"step-{step}")
            try:
                m = read_manifest(d)
            except FormatError as e:
                print(f"{j:<20} {step:>8}  unreadable: {e}")
                continue
            size = sum(f["size"] for f in m["files"].values())
            sharded = sum(1 for t in m["tensors"].values() if len(t["chunks"]) > 1)
            layout = f"{len(m['tensors'])} tensors, {sharded} sharded"
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("created_unix", 0)))
            print(f"{j:<20} {step:>8} {size / 1e9:>8.3f}GB {m['world_size']:>5}  {layout:<34} {when}")
    return 0
