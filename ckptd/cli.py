"""Command line: ``ckptd serve`` runs the daemon in the foreground; the other commands are clients
or offline tools, one function each. ``status`` and ``ls`` talk to the daemon through the torch-free
:class:`~ckptd.client.rpc.Channel`: neither imports torch (nor does ``serve``)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from typing import Any

from .config import SERVE_KEYS, daemon_config, default_endpoint, parse_size, validate_job
from .errors import CheckpointError, FormatError

STATUS_TIMEOUT_S = 5.0


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_size(text: str) -> int:
    n = _size(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"a size > 0, got {text!r}")
    return n


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"a number of seconds > 0, got {text!r}")
    return v


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _rate(n: float | None) -> str:
    return "-" if not n else f"{n / 1e6:.0f} MB/s" if n < 1e9 else f"{n / 1e9:.2f} GB/s"


def _bar(done: float, total: float, width: int = 24) -> str:
    frac = min(1.0, done / total) if total else 0.0
    return "[" + "#" * round(frac * width) + "." * (width - round(frac * width)) + f"] {frac:4.0%}"


def _format_transfers(st: dict[str, Any]) -> list[str]:
    backlog = st.get("upload_backlog") or []
    lines = [
        f"upload      {_gb(st['uploaded_bytes'])} in {st['upload_seconds']:.1f} s ({_rate(st.get('upload_bytes_per_s'))}),"
        f" {st['steps_uploaded']} steps uploaded; {len(backlog)} queued"
    ]
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
    return lines


def _format_jobs(jobs: dict[str, Any]) -> list[str]:
    lines = ["", f"{'job':<24} {'latest':>8} {'uploaded':>9} {'in memory':>10}  in flight"]
    for job, info in sorted(jobs.items()):
        cell = {k: "-" if info.get(k) is None else str(info[k]) for k in ("latest", "uploaded", "in_memory")}
        flight = ", ".join(map(str, sorted(info.get("in_flight") or []))) or "-"
        only = info.get("memory_only") or []
        flight += f"  (memory only: {', '.join(map(str, only))})" if only else ""
        kept = info.get("protected") or []
        flight += f"  (protected: {', '.join(map(str, kept[:8]))}{' ...' if len(kept) > 8 else ''})" if kept else ""
        lines.append(f"{job:<24} {cell['latest']:>8} {cell['uploaded']:>9} {cell['in_memory']:>10}  {flight}")
    return lines


def _format_peers(st: dict[str, Any]) -> list[str]:
    """The replication lines of ``ckptd status``: what goes to peers, and what this daemon holds for them."""
    lines = []
    rep = st.get("replication")
    if isinstance(rep, dict):
        peers = ", ".join(f"{p['endpoint']} {'ok' if p['ok'] else 'untried' if p['ok'] is None else 'FAILING: ' + str(p['error'])}"
                          for p in rep.get("peers", []))  # fmt: skip
        lines.append(f"replicate   {rep.get('replicas')} replica(s) per step to {peers or 'no peer'}")
        for job, r in sorted((rep.get("jobs") or {}).items()):
            lines.append(f"  {job}: step {r['step']} {r['state']} ({', '.join(r['peers']) or 'no peer took it'})")
    held = st.get("replicas_held")
    if isinstance(held, dict):
        steps = ", ".join(f"{j} {s}" for j, s in sorted((held.get("steps_held") or {}).items())) or "none"
        room = f"{_gb(held['replica_bytes'])} of {_gb(held['replica_budget'])}"
        lines.append(f"replicas    {room} held for peers on {held['listen']}: {steps}")
    mesh = st.get("mesh")
    if isinstance(mesh, dict):
        for job, ring in sorted((mesh.get("rings") or {}).items()):
            r = (mesh.get("jobs") or {}).get(job)
            sent = f"; step {r['step']} {r['state']} ({', '.join(r['peers']) or 'no daemon took it'})" if r else ""
            lines.append(f"spans       {job}: {len(ring)} daemons, this one {mesh['me']}{sent}")
    return lines


def format_status(st: dict[str, Any]) -> str:
    """``ckptd status`` for people: the daemon, its memory, throughput, uploads in progress, jobs."""
    up = int(st.get("uptime_s", 0))
    slots = st.get("slots", {})
    lines = [
        f"ckptd {st.get('version', '?')}, pid {st['pid']}, up {up // 3600}h{up % 3600 // 60:02d}m, root {st['root']}",
        f"remote      {st.get('remote') or 'none (local disk only)'}",
        f"memory      {_gb(st['shm_bytes'])} of {_gb(st['shm_budget'])} in {sum(slots.values())} slot(s)"
        f" ({', '.join(f'{k} {v}' for k, v in sorted(slots.items())) or 'none'}); {_gb(st.get('staged_bytes', 0))} committed,"
        f" not yet durable; {st['deferred_allocs']} allocation(s) waiting",
        f"persist     {_gb(st['persisted_bytes'])} in {st['persist_seconds']:.1f} s ({_rate(st.get('persist_bytes_per_s'))}),"
        f" {st['steps_committed']} steps committed",
    ]
    if st.get("remote"):
        lines += _format_transfers(st)
    lines += _format_peers(st)
    lines.append(f"last error  {st.get('last_error') or 'none'}" + (f" ({st['errors']} in all)" if st.get("errors") else ""))
    if st.get("jobs"):
        lines += _format_jobs(st["jobs"])
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptd", description="Asynchronous checkpoint daemon for PyTorch.")
    sub = p.add_subparsers(dest="cmd", required=True)
    _serve_parser(sub.add_parser("serve", help="run the node daemon in the foreground"))

    st = sub.add_parser("status", help="ask a running daemon for its state: jobs, memory, throughput, uploads, last error")
    st.add_argument("--endpoint", default=None)
    st.add_argument("--json", action="store_true", help="print the raw status as JSON")
    st.add_argument("--watch", type=_seconds, default=None, metavar="SECONDS", help="refresh every SECONDS (upload progress); Ctrl-C stops")

    v = sub.add_parser("verify", help="re-read a checkpoint: checksums, headers, coverage, manifest (exit 1 if unsound)")
    _checkpoint_args(v)

    ex = sub.add_parser("export", help="consolidate a checkpoint into one full state dict file, or a Hugging Face model directory")
    _checkpoint_args(ex)
    ex.add_argument("--out", required=True, help="the file to write (hf: the directory to make)")
    ex.add_argument("--format", choices=("safetensors", "torch", "hf"), default="safetensors")
    ex.add_argument("--what", choices=("model", "optim", "all"), default="model")
    ex.add_argument("--max-shard-size", type=_positive_size, default=None, help="hf: the largest weights file (default 5GB)")
    ex.add_argument("--config-from", default=None, help="hf: copy config.json (and tokenizer files) from this model directory")

    im = sub.add_parser("import", help="turn a torch.distributed.checkpoint (DCP) directory into a step of a job, through the daemon")
    im.add_argument("dcp_dir", help="the DCP checkpoint directory (with its .metadata)")
    im.add_argument("--job", required=True)
    im.add_argument("--step", type=int, required=True)
    im.add_argument("--endpoint", default=None)

    ls = sub.add_parser("ls", help="committed steps with size, world size, layout and time")
    ls.add_argument("--root", default=None, help=ROOT_HELP)
    ls.add_argument("--job", default=None)
    ls.add_argument("--endpoint", default=None)

    kg = sub.add_parser("keygen", help="make the cluster's peer key (CurveZMQ) for --peer-key: a new file, mode 0600")
    kg.add_argument("file", help="where to write it (an existing file is never replaced)")
    return p


ROOT_HELP = "checkpoint root (default: ask the running daemon)"


def _checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The checkpoint ``verify`` and ``export`` read: a path, or a job (and step) as ``ckptd ls`` lists them."""
    p.add_argument("ckpt", nargs="?", default=None, help="a step directory, or a job directory (its newest step); or give --job")
    p.add_argument("--job", default=None, help="instead of a path: the job, as `ckptd ls` lists it, under --root")
    p.add_argument("--step", type=int, default=None, help="with --job: the step (default: the job's latest complete step)")
    p.add_argument("--root", default=None, help=f"with --job: the {ROOT_HELP}")
    p.add_argument("--endpoint", default=None, help="with --job and no --root: the daemon to ask (default: CKPTD_ENDPOINT, else your own)")


def _serve_parser(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", default=None, help="TOML file with any of the settings below (command-line flags win)")
    s.add_argument("--root", default=None, help="directory that holds the checkpoints (<root>/<job>/step-N); required")
    s.add_argument("--endpoint", default=None, help="ZeroMQ endpoint (default: CKPTD_ENDPOINT or a per-user ipc socket)")
    s.add_argument(
        "--remote-path",
        default=None,
        help="a shared directory every node mounts (Lustre, GPFS, NFS...): the multi-node tier, instead of [remote] bucket",
    )
    s.add_argument("--shm-budget", type=_size, default=None, help="shared memory to stage into (default: half of /dev/shm)")
    s.add_argument("--keep", type=int, default=None, help="committed steps kept per job (default 3, CKPTD_KEEP)")
    s.add_argument("--workers", type=int, default=None, help="persist threads (default 2, CKPTD_WORKERS)")
    s.add_argument("--write-rate-limit", type=_size, default=None, help="bytes/s cap on disk writes (default: none)")
    s.add_argument("--nice", type=int, default=None, help="niceness of persist threads (default 10; 0 = unchanged)")
    s.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    s.add_argument("--group", default=None, help="also let this group use the socket, segments and checkpoints (default: owner only)")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on 127.0.0.1:PORT (default 0: off)")
    s.add_argument(
        "--lease-timeout",
        type=float,
        default=None,
        help="seconds a slot may stay leased, uncommitted, before it is reclaimed (default 3600)",
    )
    s.add_argument("--persist-every", type=int, default=None, help="persist one snapshot in N; the others stay in memory (default 1)")
    s.add_argument("--persist-interval", type=float, default=None, help="also persist the first snapshot T seconds after the last (0: off)")
    s.add_argument("--lagging", choices=("memory", "wait"), default=None, help="a snapshot due for disk while it is busy: wait or memory")
    s.add_argument("--peer-listen", default=None, metavar="tcp://ADDR:PORT",
                   help="hold other nodes' replicas, and the steps of jobs that span nodes; serve peers here")  # fmt: skip
    s.add_argument("--peer", action="append", dest="peers", default=None, metavar="tcp://ADDR:PORT",
                   help="a peer daemon to replicate steps to (repeat for more)")  # fmt: skip
    s.add_argument("--peer-key", default=None, metavar="FILE", help="the cluster's peer key (ckptd keygen FILE), mode 0600")
    s.add_argument("--replicas", type=int, default=None, help="peers each step (or a node's part) is copied to (default 0: off)")
    s.add_argument("--replicate-rate-limit", type=_size, default=None, help="bytes/s cap on replication (default: none)")
    s.add_argument("--replica-budget", type=_size, default=None, help="shared memory for peers' replicas (default: half the shm budget)")
    s.add_argument(
        "--idle-priority",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="persist and upload threads: idle CPU time only, lowest best-effort disk priority (SCHED_IDLE, best-effort I/O 7; default on)",
    )
    s.add_argument(
        "--direct-io",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write shards past the page cache (O_DIRECT) where the file system takes it (default on)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. A reader that closes stdout early (``ckptd ls | head``) ends any command
    quietly with 141, as ``cat`` killed by SIGPIPE does: Python's recipe (docs.python.org/3/library/signal.html, "Note on
    SIGPIPE"), not SIGPIPE's default action, which would also kill the process on a socket the daemon's peer closed."""
    commands = {"serve": _serve, "status": _status, "verify": _verify, "export": _export, "import": _import, "ls": _ls, "keygen": _keygen}
    parser = _parser()  # argparse drops the help it cannot write itself
    args = parser.parse_args(argv)
    _check_checkpoint_usage(parser, args)
    try:
        rc = commands[args.cmd](args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is found while it can still be handled
        return rc
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit would fail again
        return 128 + signal.SIGPIPE


def _check_checkpoint_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``verify`` and ``export`` take a path or ``--job``, one of them; the other flags go with ``--job``."""
    if args.cmd in ("verify", "export"):
        if (args.ckpt is None) == (args.job is None):
            parser.error(f"{args.cmd}: give a checkpoint's path or --job J (a job as `ckptd ls` lists it), one of the two")
        if args.ckpt is not None and (args.step, args.root, args.endpoint) != (None, None, None):
            parser.error(f"{args.cmd}: --step, --root and --endpoint go with --job (a path names its step itself)")


def _serve(args: argparse.Namespace) -> int:
    try:
        cfg = daemon_config({**{k: getattr(args, k, None) for k in SERVE_KEYS}, "remote_path": args.remote_path}, args.config)
    except (ValueError, OSError) as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 2
    from .daemon import Daemon

    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr, format="%(asctime)s ckptd %(levelname)s %(message)s")
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    # whatever the daemon creates without an explicit mode (temporary files, directories) is private from
    # birth: 077, or 027 when a group shares the checkpoints
    os.umask(0o077 if cfg.group is None else 0o027)
    import zmq

    try:
        Daemon(cfg).serve()
    except (CheckpointError, OSError, zmq.ZMQError) as e:  # a root it cannot make or write, an endpoint it cannot bind
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 1
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from .peerkey import keygen

    try:
        key = keygen(args.file)
    except CheckpointError as e:
        print(f"ckptd keygen: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.file} (mode 0600), public key {key.public.decode()}; copy it to every node (--peer-key {args.file})")
    return 0


def _status(args: argparse.Namespace) -> int:
    from .client.rpc import Channel
    from .protocol import reply_fields

    try:
        with Channel(args.endpoint or default_endpoint(), STATUS_TIMEOUT_S) as rpc:
            while True:
                st = reply_fields(rpc.call("status"))
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


def _verify(args: argparse.Namespace) -> int:
    from .storage.verify import stale_warning, verify_checkpoint

    try:
        step_path = _checkpoint(args)
    except CheckpointError as e:
        print(f"ckptd verify: {e}", file=sys.stderr)
        return 1
    problems = verify_checkpoint(step_path)
    for p in problems:
        print(f"ckptd verify: {p}", file=sys.stderr)
    if problems:
        print(f"{step_path}: UNSOUND ({len(problems)} problem(s))")
        return 1
    warning = stale_warning(step_path)
    if warning:
        print(f"ckptd verify: warning: {warning}", file=sys.stderr)
    print(f"{step_path}: OK")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .tools.export import export_checkpoint

    bare = args.format == "hf" and args.config_from is None
    try:
        step_path = _checkpoint(args)
        if bare and args.what == "model":  # before a long export starts; not refused: config.json may be copied in later
            print(
                f"ckptd export: warning: no --config-from: {args.out} gets the weights only, no config.json, and transformers'"
                " from_pretrained(dir) cannot load it; export with --config-from the model's directory (one save_pretrained"
                " wrote: model.config.save_pretrained(dir) makes one) or its config.json, or copy that config.json into it",
                file=sys.stderr,
            )
        hf = {"max_shard_size": args.max_shard_size} if args.max_shard_size is not None else {}
        stats = export_checkpoint(step_path, args.out, fmt=args.format, what=args.what, config_from=args.config_from, **hf)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"ckptd export: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {stats['tensors']} tensors, {stats['bytes'] / 1e9:.3f} GB{' (weights only: no config.json)' if bare else ''}")
    return 0


def _checkpoint(args: argparse.Namespace) -> str:
    """The step directory ``verify`` or ``export`` reads: the path given (a step, or a job directory: its latest step),
    or ``--job``'s ``--step`` (else its latest complete step) under the root ``ckptd ls`` lists."""
    from .layout import complete_steps, is_complete, step_dir
    from .storage.local import latest_step, resolve_step_dir

    if args.job is None:
        try:
            return resolve_step_dir(args.ckpt)
        except CheckpointError as e:
            named = not os.path.lexists(args.ckpt) and os.sep not in args.ckpt
            raise CheckpointError(f"{e}{f' (to name a job as `ckptd ls` lists it: --job {args.ckpt})' if named else ''}") from None
    root, memory, _ = _find_root(args.root, args.endpoint)
    _find_job(root, args.job, memory)
    job, step, kept = args.job, args.step, memory.get(args.job, [])
    in_memory = f"; in the daemon's memory only, not persisted: step {', '.join(map(str, kept))}" if kept else ""
    if step is None:
        path = latest_step(root, job)[1]
        if path is None:
            raise CheckpointError(f"job {job!r} has no complete step under {root}{in_memory}")
        return path
    if not is_complete(step_dir(root, job, step)):
        if step in kept:
            raise CheckpointError(f"step {step} of job {job!r} is in the daemon's memory only: not persisted, nothing to read on disk")
        steps = ", ".join(map(str, complete_steps(root, job))) or "none"
        raise CheckpointError(f"job {job!r} has no complete step {step} under {root} (complete steps: {steps}){in_memory}")
    return step_dir(root, job, step)


def _import(args: argparse.Namespace) -> int:
    from .tools.dcp_import import import_dcp

    try:
        path = import_dcp(args.dcp_dir, job=args.job, step=args.step, endpoint=args.endpoint)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"ckptd import: {e}", file=sys.stderr)
        return 1
    print(f"imported {args.dcp_dir} as step {args.step} of job {args.job}: {path}")
    return 0


def _protected(root: str, job: str) -> dict[int, str]:
    """Step -> what protects it from retention (:mod:`ckptd.daemon.protected`), for ``ls``."""
    from .daemon.protected import FILE, read

    try:
        names = read(os.path.join(root, job, FILE))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"ckptd ls: {job}/{FILE} cannot be read ({e}): the daemon keeps every step of {job}", file=sys.stderr)
        return {}
    by_step: dict[int, list[str]] = {}
    for name, step in sorted(names.items()):  # escaped: a file an older ckptd wrote may hold control characters
        by_step.setdefault(step, []).append("".join(c if c.isprintable() else ascii(c)[1:-1] for c in name))
    return {step: ", ".join(n) if len(n) < 3 else f"{n[0]} and {len(n) - 1} more" for step, n in by_step.items()}


def _copies(rep: dict[str, Any], step: int) -> str:
    """``ls``: what became of ``step``'s copy to peers, if it is the job's newest step sent (``rep``, from status)."""
    if rep.get("step") != step:
        return ""
    return f"  {rep['state']}" + (f" to {', '.join(rep['peers'])}" if rep.get("peers") else "")


def _find_root(root: str | None, endpoint: str | None) -> tuple[str, dict[str, list[int]], dict[str, dict[str, Any]]]:
    """The checkpoint root ``ls``, ``verify --job`` and ``export --job`` read: ``--root``, else the running daemon's, with
    each job's memory-only steps and the outcome of its newest step's replication to peers (only the daemon knows
    them; none with ``--root``).

    Raises:
        CheckpointError: no root to read, saying why."""
    memory: dict[str, list[int]] = {}
    replicated: dict[str, dict[str, Any]] = {}
    if root is None:
        from .client.rpc import Channel

        try:
            with Channel(endpoint or default_endpoint(), STATUS_TIMEOUT_S) as rpc:
                root = rpc.call("hello")["root"]
                jobs = rpc.call("status")["jobs"]
                memory = {j: info.get("memory_only", []) for j, info in jobs.items()}
                replicated = {j: info["replicated"] for j, info in jobs.items() if isinstance(info.get("replicated"), dict)}
        except CheckpointError as e:
            raise CheckpointError(f"no --root given and {e}") from None
    elif not os.path.isdir(root):
        raise CheckpointError(f"{root} is not a directory (give the daemon's --root)")
    if not os.access(root, os.R_OK | os.X_OK):
        raise CheckpointError(f"cannot read {root} as this user (the daemon's root is private to it and its --group)")
    return root, memory, replicated


def _find_job(root: str, job: str, memory: dict[str, list[int]]) -> None:
    """Raise :class:`CheckpointError` unless ``job`` is a job of ``root`` (or has steps in the daemon's memory)."""
    from .layout import list_jobs

    try:
        validate_job(job)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if job not in list_jobs(root) and not memory.get(job):
        known = ", ".join(sorted(list_jobs(root))[:10]) or "none"
        raise CheckpointError(f"no job {job!r} under {root} (jobs there: {known})")


def _ls(args: argparse.Namespace) -> int:
    from .layout import list_jobs, step_dir
    from .storage.local import latest_step, steps_by_commit
    from .validate import read_manifest

    try:
        root, memory, replicated = _find_root(args.root, args.endpoint)
        if args.job:
            _find_job(root, args.job, memory)
    except CheckpointError as e:
        print(f"ckptd ls: {e}", file=sys.stderr)
        return 1
    print(f"{'job':<20} {'step':>8} {'size':>10} {'ranks':>5}  {'layout':<34} created")
    for j in [args.job] if args.job else sorted(set(list_jobs(root)) | {j for j, steps in memory.items() if steps}):
        rep = replicated.get(j) or {}
        for step in memory.get(j, []):
            print(f"{j:<20} {step:>8}  memory only (the daemon holds it in shared memory; not persisted){_copies(rep, step)}")
        latest, protected = latest_step(root, j)[0], _protected(root, j)
        for step in steps_by_commit(root, j):  # oldest commit first: after a rollback the latest is not the highest
            try:
                m = read_manifest(step_dir(root, j, step))
            except FormatError as e:
                print(f"{j:<20} {step:>8}  unreadable: {e}")
                continue
            size = sum(f["size"] for f in m["files"].values())
            sharded = sum(1 for t in m["tensors"].values() if len(t["chunks"]) > 1)
            layout = f"{len(m['tensors'])} tensors, {sharded} sharded"
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("created_unix", 0)))
            mark = ("  <- latest" if step == latest else "") + (f"  protected by {protected[step]}" if step in protected else "")
            print(f"{j:<20} {step:>8} {size / 1e9:>8.3f}GB {m['world_size']:>5}  {layout:<34} {when}{mark}{_copies(rep, step)}")
    return 0
