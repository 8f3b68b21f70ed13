"""Command line: ``ckptd serve`` runs the daemon in the foreground; other commands are clients."""

from __future__ import annotations

import argparse
import json
import logging
import sys

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ckptd", description="Asynchronous checkpoint daemon for PyTorch.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the node daemon in the foreground")
    s.add_argument("--root", required=True, help="directory that holds the checkpoints (<root>/<job>/step-N)")
    s.add_argument("--endpoint", default=None, help="ZeroMQ endpoint (default: CKPTD_ENDPOINT or a per-user ipc socket)")
    s.add_argument("--shm-budget", type=_size, default=None, help="shared memory to stage into (default: half of /dev/shm)")
    s.add_argument("--keep", type=int, default=env_int("CKPTD_KEEP", 3), help="committed steps kept per job (default 3)")
    s.add_argument("--workers", type=int, default=env_int("CKPTD_WORKERS", 2), help="persist threads (default 2)")
    s.add_argument(
        "--write-rate-limit",
        type=_size,
        default=int(env_float("CKPTD_WRITE_RATE_LIMIT", 0)),
        help="bytes/s cap on disk writes (default: none)",
    )
    s.add_argument("--log-level", default="INFO")

    st = sub.add_parser("status", help="ask a running daemon for its state")
    st.add_argument("--endpoint", default=None)

    args = p.parse_args(argv)
    if args.cmd == "serve":
        from .daemon import Daemon
        from .errors import CheckpointError

        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s ckptd %(levelname)s %(message)s")
        if args.keep < 1:
            p.error("--keep must be >= 1")
        try:
            Daemon(
                args.root,
                args.endpoint or default_endpoint(),
                shm_budget=args.shm_budget,
                keep=args.keep,
                workers=args.workers,
                write_rate_limit=float(args.write_rate_limit),
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
                print(json.dumps(c.status(), indent=2))
        except CheckpointError as e:
            print(f"ckptd: {e}", file=sys.stderr)
            return 1
        return 0
    return 2
