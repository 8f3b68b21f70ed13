"""The systemd notify protocol (``sd_notify``), without libsystemd: datagrams to ``$NOTIFY_SOCKET``.

The daemon sends ``READY=1`` once it serves, ``WATCHDOG=1`` at half the unit's ``WatchdogSec``
while its loop runs, and ``STOPPING=1`` on shutdown. Outside systemd (no ``NOTIFY_SOCKET``) every
call is a no-op.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    """Send ``state`` (``KEY=value`` lines); True if a notify socket took it."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(addr)
        sock.sendall(state.encode())
    except OSError:
        return False
    finally:
        sock.close()
    return True


def watchdog_interval() -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec``), or None if no watchdog is asked for."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None
