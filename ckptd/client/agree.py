"""How the ranks of a collective restore agree: on the keys no rank holds, and on a failure of any rank.

:mod:`.load` calls these on the trainer's thread. A strict restore with torch.distributed initialized and
more than one rank is collective (:func:`collective`): every rank checks in once (:func:`agree`, a
restore on some ranks only is an error, not a hang), and then, after the tensors were read, shares its
read errors once more (:func:`failed` of :func:`gather`). Every rank makes exactly these calls on every
attempt, whatever failed on it and wherever (:func:`fail_early`), so a retry never pairs with an
earlier attempt's collective. What a rank does after a failure is decided by the type it raises
(:func:`raise_failure`): a :class:`ReadAgain` reads the step from disk again, anything else is raised to the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from ..errors import CheckpointError, FormatError
from .plan import Arrivals

ARRIVALS = Arrivals("restore")  # one count per process: every rank restores as often as the others
Failure = tuple[int, str, bool, bool]  # a failed rank, its error, whether a FormatError (a bad file), whether read hot


def collective(strict: bool) -> bool:
    """Whether a restore agrees with the other ranks: strict, with torch.distributed running more than one."""
    import torch.distributed as dist

    return strict and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(error: BaseException | None, *more: Any, hot: bool = False) -> list[Any]:
    """Every rank's ``(error, *more)``, the error as ``(text, is a FormatError, read from the daemon's memory)`` or ``None``."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (None if error is None else (str(error), isinstance(error, FormatError), hot), *more))
    return every


def failed(every: list[Any]) -> list[Failure]:
    return [(r, *mine[0]) for r, mine in enumerate(every) if mine[0] is not None]


def agree(
    missing: list[str], unexpected: list[str], error: BaseException | None, strict: bool, hot: bool = False
) -> tuple[list[str], list[str], list[Failure]]:
    """Every rank's view, when the restore is :func:`collective`: the union of missing keys, the saved
    keys no rank's target has (those every rank found unexpected), and the ranks that failed. One
    ``all_gather_object``, after every rank checked in (a restore on some ranks only is an error, not a
    hang); the only check-in of the restore."""
    if not collective(strict):
        return missing, unexpected, []
    ARRIVALS.check("ckptd.restore()")
    every = gather(error, sorted(missing), sorted(unexpected), hot=hot)
    all_missing = sorted({k for _, m, _ in every for k in m})
    common = set(every[0][2]).intersection(*(u for _, _, u in every[1:]))
    return all_missing, [k for k in unexpected if k in common], failed(every)


class ReadAgain(FormatError):
    """A restore read a bad file, and a rank read the daemon's memory: every rank of the restore reads the step
    from disk again, together (:func:`.restore.read_step`), the ranks that read the disk already as well, so that
    their collectives stay paired. Raised by :func:`raise_failure` (and by a reader of one rank's own segments:
    :func:`.restore.open_step`), caught by :func:`.restore.read_step`; the message is the failure's."""


def raise_failure(error: BaseException | None, failures: list[Failure], then: str, *, mine_too: bool = False, hot: bool = False) -> None:
    """Raise this rank's error, or (it had none) one naming the ranks that failed and saying ``then``
    (``mine_too``: this rank's own error says it as well, its type kept). A FormatError only where every
    failure was one, on every rank alike: a :class:`ReadAgain` where one of them read the daemon's memory
    (``hot``: this rank did), and then every rank reads the step from disk again, together; else a plain one,
    and none does."""
    if error is None and not failures:
        return
    bad_file = all(f for _, _, f, _ in failures)
    again = (bad_file and any(h for *_, h in failures)) if failures else (hot and isinstance(error, FormatError))
    if error is not None and (bad_file or not isinstance(error, FormatError)):
        if again:  # this rank's own bad file, the message kept, the type the decision's
            raise ReadAgain(f"{error}; {then}" if mine_too else str(error)) from error
        if not mine_too:
            raise error
        said = type(error) if isinstance(error, CheckpointError) else CheckpointError
        raise said(f"{error}; {then}") from error
    first = failures[0][1] if len(failures[0][1]) <= 300 else failures[0][1][:300] + "..."
    kind = ReadAgain if again else FormatError if bad_file else CheckpointError
    raise kind(f"restore failed on rank(s) {[r for r, *_ in failures][:8]} ({first}); {then}") from error


def fail_early(error: BaseException, strict: bool, hot: bool = False) -> NoReturn:
    """Raise ``error``, which this rank met before the restore's check-in (no checkpoint at the path, a
    malformed manifest, a model on the meta device), after the other ranks heard of it at that check-in:
    each of them raises too, rather than wait for this one, and the next attempt of every rank checks in
    afresh, together."""
    _, _, failures = agree([], [], error, strict, hot)
    raise_failure(error, failures, "nothing was loaded on this rank", hot=hot)
    raise error  # not reached: raise_failure raises whenever this rank has an error


def shared(strict: bool, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``call(*args, **kw)``; what it raises is raised on every rank of a collective restore (:func:`fail_early`)."""
    try:
        return call(*args, **kw)
    except Exception as e:
        fail_early(e, strict)
