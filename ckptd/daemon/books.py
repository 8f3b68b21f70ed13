"""What every component that drives a step shares, handed to each as one record: :class:`Books`.

The daemon makes one (:meth:`ckptd.daemon.server.Daemon._build`) and gives it to the memory tier, completion and the
commit handler, instead of the same five collaborators as five constructor arguments to each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .catalog import StepCatalog
from .events import EventQueue
from .status import Counters
from .steps import StepTable
from .waiters import Waiter

Answer = Callable[[list[tuple[Waiter, dict[str, Any]]]], None]  # sends held-back replies (the loop's)


@dataclass(frozen=True)
class Books:
    """The daemon's record of its steps and its two outboxes.

    ``root``: the local root (steps on disk); ``steps``: the one owner of every step's state (:mod:`.steps`);
    ``catalog``: what is on disk and in memory, by job; ``counters``: the status and metrics counters; ``events``: the
    queue worker threads report to the loop through; ``answer``: sends replies held back for a step's waiters.
    """

    root: str
    steps: StepTable
    catalog: StepCatalog
    counters: Counters
    events: EventQueue
    answer: Answer
