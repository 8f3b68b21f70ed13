"""Waiting in tests for what the daemon does in the background (bounded, never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """``cond()``'s first true value, polled every 50 ms; ``AssertionError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
