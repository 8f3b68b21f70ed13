"""The restore ladder (:func:`ckptd.client.restore.read_step`): hot read, then the disk on a bad segment, then the disk
again with a rank whose hot read failed; and the decision that drives it, the type :func:`.agree.raise_failure` raises."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import assert_same, full_state, make, train_step

from ckptd import shm
from ckptd.client.agree import Failure, ReadAgain, raise_failure
from ckptd.client.reader import CheckpointReader
from ckptd.client.restore import open_step, read_step
from ckptd.errors import CheckpointError, FormatError
from ckptd.layout import MANIFEST, shard_name

CKPTD = Path(__file__).resolve().parent.parent / "ckptd"
THEN = "nothing was loaded on this rank"
BAD, HOT, DISK = True, True, False  # a Failure's "a FormatError" and "read hot" fields, by name

# ---------------------------------------------------------------------------- the decision: raise_failure's type

# (case, this rank's error, every rank's failures, this rank read hot, mine_too) -> the type raised, the same object or not
DECISIONS: list[tuple[str, BaseException | None, list[Failure], bool, bool, type[BaseException], bool]] = [
    ("alone: my bad segment", FormatError("bad chunk"), [], True, False, ReadAgain, False),
    ("alone: my bad segment, after a partial read", FormatError("bad chunk"), [], True, True, ReadAgain, False),
    ("alone: my bad file on disk", FormatError("bad chunk"), [], False, False, FormatError, True),
    ("alone: my error, not a bad file, read hot", CheckpointError("size mismatch"), [], True, False, CheckpointError, True),
    ("alone: my EIO, after a partial read", OSError("EIO"), [], True, True, CheckpointError, False),
    ("my bad segment", FormatError("bad chunk"), [(0, "bad chunk", BAD, HOT)], True, False, ReadAgain, False),
    ("another rank's bad segment", None, [(1, "bad chunk", BAD, HOT)], True, False, ReadAgain, False),
    ("another rank's bad segment, I read the disk", None, [(1, "bad chunk", BAD, HOT)], False, False, ReadAgain, False),
    ("another rank's bad file on disk", None, [(1, "bad chunk", BAD, DISK)], True, False, FormatError, False),
    ("my bad file on disk, another's bad segment", FormatError("bad"), [(0, "bad", BAD, DISK), (1, "bad", BAD, HOT)],
     False, False, ReadAgain, False),
    ("my bad segment, another rank's other error", FormatError("bad"), [(0, "bad", BAD, HOT), (1, "EIO", not BAD, DISK)],
     True, False, CheckpointError, False),
    ("another rank's error, not a bad file", None, [(1, "size mismatch", not BAD, HOT)], True, False, CheckpointError, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("error", "failures", "hot", "mine_too", "kind", "same"), [c[1:] for c in DECISIONS], ids=[c[0] for c in DECISIONS]
)
def test_raise_failure_says_by_its_type_whether_every_rank_reads_the_disk_again(
    error: BaseException | None, failures: list[Failure], hot: bool, mine_too: bool, kind: type[BaseException], same: bool
) -> None:
    with pytest.raises(CheckpointError) as got:
        raise_failure(error, failures, THEN, mine_too=mine_too, hot=hot)
    assert type(got.value) is kind, got.value
    assert (got.value is error) is same
    if error is not None and not same:  # a new exception: this rank's own error is its cause, and its message stays
        assert got.value.__cause__ is error
        assert str(error) in str(got.value)
    if error is None or mine_too:
        assert str(got.value).endswith(THEN)


def test_raise_failure_without_a_failure_raises_nothing() -> None:
    assert raise_failure(None, [], THEN, hot=True) is None


def test_read_again_is_a_format_error_so_callers_that_catch_those_still_do() -> None:
    assert issubclass(ReadAgain, FormatError) and issubclass(ReadAgain, CheckpointError)


def test_no_exception_carries_a_patched_on_fall_back_attribute() -> None:
    """The decision was an attribute set on exceptions and read back with ``getattr`` defaults that differed."""
    offenders = [str(p.relative_to(CKPTD)) for p in sorted(CKPTD.rglob("*.py")) if "fall_back" in p.read_text()]
    assert offenders == []


# ---------------------------------------------------------------------------- the ladder, with a daemon that answers as told


class Rpc:
    """The daemon's side of a restore: nothing to settle, the step held hot (``held``) or not, fetched from ``step_dir``."""

    timeout = 5.0

    def __init__(self, step_dir: str, held: dict[str, Any] | None = None) -> None:
        self.step_dir, self.held = step_dir, held
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        self.calls.append((op, kw))
        if op == "promote":
            return {"step": None}
        if op == "hot_open":
            return self.held or {"step": None, "reason": "not in memory"}
        if op == "fetch":
            return {"fetch": 7}
        if op == "fetch_wait":
            return {"state": "done", "path": self.step_dir, "step": 1, "source": "local"}
        return {}

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]


def _held(step_dir: str, segment: str = "ckptd-0-0000000000000000/" + "0" * 32) -> dict[str, Any]:
    """``hot_open``'s reply for step 1 at ``step_dir`` (its manifest, where there is one); its one segment (by default) long gone."""
    at = Path(step_dir) / MANIFEST
    manifest = json.loads(at.read_text()) if at.exists() else {}
    return {"step": 1, "path": step_dir, "manifest": manifest, "segments": {shard_name(0): segment}, "pin": "p" * 32, "tier": "disk"}


def _reads(*outcomes: Any) -> tuple[list[Any], Any]:
    """A read that returns or raises each of ``outcomes`` in turn, and the list of what it was called with."""
    seen: list[Any] = []

    def read(arg: Any) -> Any:
        seen.append(arg)
        out = outcomes[len(seen) - 1]
        if isinstance(out, BaseException):
            raise out
        return out

    return seen, read


@pytest.mark.parametrize("asked", [None, 1])
def test_a_bad_segment_reads_the_step_from_disk_once_the_segments_are_let_go(asked: int | None) -> None:
    rpc = Rpc("/ckpt/step-1", _held("/ckpt/step-1"))
    hot_seen, memory = _reads(ReadAgain("bad chunk"))
    disk_seen, disk = _reads("from disk")
    got, info, hold = read_step(rpc, "j", asked, hot=True, memory=memory, disk=disk)  # type: ignore[arg-type]
    assert (got, info, disk_seen) == ("from disk", {"step": 1, "path": "/ckpt/step-1", "source": "disk"}, ["/ckpt/step-1"])
    assert len(hot_seen) == 1 and rpc.ops() == ["promote", "hot_open", "hot_close", "promote", "fetch", "fetch_wait"]
    # a restore of the newest settles on the newest again (the step may not be made durable), one of a step on that step
    assert rpc.calls[3][1] == {"job": "j", "step": asked, "persist": True}
    assert hold.fid == 7 and hold.held is None  # the caller's to release
    hold.release()
    hold.release()
    assert rpc.ops()[-1] == "fetch_close" and rpc.ops().count("fetch_close") == 1


def test_a_plain_format_error_of_a_hot_read_is_raised_and_nothing_is_read_from_disk() -> None:
    """Another rank's file on disk is bad (raise_failure's plain FormatError): every rank raises, none reads again."""
    rpc = Rpc("/ckpt/step-1", _held("/ckpt/step-1"))
    _, memory = _reads(FormatError("restore failed on rank(s) [1]"))
    disk_seen, disk = _reads("from disk")
    with pytest.raises(FormatError, match=r"rank\(s\) \[1\]") as got:
        read_step(rpc, "j", None, hot=True, memory=memory, disk=disk)  # type: ignore[arg-type]
    assert type(got.value) is FormatError and disk_seen == []
    assert rpc.ops() == ["promote", "hot_open", "hot_close"]


def test_a_disk_read_told_to_read_again_reads_once_more_within_the_same_fetch(caplog: pytest.LogCaptureFixture) -> None:
    rpc = Rpc("/ckpt/step-1")
    disk_seen, disk = _reads(ReadAgain("restore failed on rank(s) [1]"), "again")
    with caplog.at_level(logging.WARNING, logger="ckptd.client"):
        got, info, hold = read_step(rpc, "j", None, hot=True, memory=lambda held: "never", disk=disk)  # type: ignore[arg-type]
    assert got == "again" and disk_seen == ["/ckpt/step-1"] * 2 and info["source"] == "disk"
    assert "restore of step 1 again from disk" in caplog.text
    assert rpc.ops() == ["promote", "hot_open", "promote", "fetch", "fetch_wait"]  # the fetch held until the caller releases it
    hold.release()
    assert rpc.ops()[-1] == "fetch_close"


@pytest.mark.parametrize("outcomes", [(ReadAgain("bad"), ReadAgain("bad")), (CheckpointError("size mismatch"),)], ids=["twice", "other"])
def test_a_disk_read_that_fails_for_good_lets_go_of_the_fetch(outcomes: tuple[BaseException, ...]) -> None:
    rpc = Rpc("/ckpt/step-1")
    _, disk = _reads(*outcomes)
    with pytest.raises(type(outcomes[-1])):
        read_step(rpc, "j", None, hot=False, memory=lambda held: "never", disk=disk)  # type: ignore[arg-type]
    assert rpc.ops() == ["promote", "fetch", "fetch_wait", "fetch_close"]


def test_a_failed_share_of_the_daemons_answer_is_raised_before_anything_is_read() -> None:
    """``share`` wraps every call to the daemon (restore_from_daemon's: :func:`.agree.shared`)."""
    shared: list[str] = []

    def share(call: Any, *args: Any, **kw: Any) -> Any:
        shared.append(getattr(call, "__name__", ""))
        if call.__name__ == "fetch":
            raise CheckpointError("the daemon is gone")
        return call(*args, **kw)

    rpc = Rpc("/ckpt/step-1")
    with pytest.raises(CheckpointError, match="gone"):
        read_step(rpc, "j", None, hot=True, memory=lambda held: "never", disk=lambda path: "never", share=share)  # type: ignore[arg-type]
    assert shared == ["_settle", "call", "_settle", "fetch"]


# ---------------------------------------------------------------------------- open_step and a restore, on a real step


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = make(seed=0)
    for i in range(2):
        train_step(model, optim, i)
    return model, optim


def test_open_step_with_its_segment_gone_opens_the_step_on_disk(daemon) -> None:  # noqa: ANN001
    model, optim = _trained()
    with daemon.client("gone") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(30)
    rpc = Rpc(path, _held(path))
    opened = open_step(rpc, "gone", None)  # type: ignore[arg-type]
    try:
        assert isinstance(opened.reader, CheckpointReader) and not opened.reader.hot
        assert opened.info == {"step": 1, "path": path, "source": "disk"}
        assert rpc.ops() == ["promote", "hot_open", "hot_close", "promote", "fetch", "fetch_wait"]
    finally:
        opened.close()
    assert rpc.ops()[-1] == "fetch_close"


def _spoil_segment(root: str) -> None:
    """Overwrite the first bytes of the first tensor in the daemon's shared-memory copy of the shard."""
    (name,) = shm.segments_of(root)
    with open(shm.path_of(name), "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        first = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        f.seek(8 + n + first)
        f.write(b"\x7f" * 16)


def test_a_corrupt_hot_segment_restores_from_disk(daemon, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    model, optim = _trained()
    want = full_state(model, optim)
    with daemon.client("spoiled") as c:
        path = c.snapshot(model, optim, step=1, extra={"note": "x"}, blocking=True).wait(30)
        _spoil_segment(daemon.root)
        m2, o2 = make(seed=3)
        with caplog.at_level(logging.WARNING, logger="ckptd.client"):
            extra = c.restore(m2, o2)
        assert c.last_restore == {"step": 1, "path": path, "source": "disk"} and extra.source == "disk"
        assert extra == {"note": "x"} and extra.step == 1
        assert_same(full_state(m2, o2), want)
        assert "hot restore of step 1 failed" in caplog.text
        assert c.status()["hot_pins"] == {}  # the segments were let go of before the disk was read
