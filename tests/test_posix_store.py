"""The shared directory as an object store (:class:`ckptd.storage.posix.DirStore`): the store contract on a local
directory and on a real network file system (sshfs mounts of one export), the anomalies network file systems show
(injected by a fault double around the ``os`` calls it makes), a real full file system, racing writers on separate
mounts, and what another user may have planted in a shared directory."""

from __future__ import annotations

import errno
import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import SharedFS
from test_bucket import write_rank

from ckptd.errors import CheckpointError, DiskFull, FormatError
from ckptd.layout import MANIFEST, bucket_key, tmp_dir
from ckptd.storage import posix
from ckptd.storage.posix import DirStore
from ckptd.storage.remote import remote_steps, try_complete, upload_ranks
from ckptd.storage.store import ObjectStore, SizedStore

JOB = "j"


def _names(top: str) -> list[str]:
    return sorted(n for _, dirs, files in os.walk(top) for n in dirs + files)


def test_the_store_contract_on_a_shared_directory(shared_fs: SharedFS, tmp_path: Path) -> None:
    store = DirStore(shared_fs.mount("a"))
    wanted = [n for n, v in vars(ObjectStore).items() if callable(v) and not n.startswith("_")]
    assert isinstance(store, SizedStore) and all(callable(getattr(store, n, None)) for n in wanted), wanted
    store.check()
    src = tmp_path / "shard"
    src.write_bytes(b"x" * 3_000_000)
    moved: list[int] = []
    store.put_file("j/step-1/rank-00000.safetensors", str(src), moved.append)
    assert sum(moved) == 3_000_000
    store.put_bytes("j/step-1/run-1-after-none/rank-00000.json", b"{}")
    store.put_bytes("j/step-10/manifest.json", b"{}")
    assert store.list("j/step-1/") == ["j/step-1/rank-00000.safetensors", "j/step-1/run-1-after-none/rank-00000.json"]
    assert len(store.list("j/step-1")) == 3  # a plain string prefix, as in S3: step-10 too
    assert store.list("nothing/") == [] and store.list("j/step-1/rank-00000.safetensors/") == []
    sized = store.list_sized("j/")
    assert sized["j/step-1/rank-00000.safetensors"][1] == 3_000_000
    assert store.get_head("j/step-1/rank-00000.safetensors", 10) == (b"x" * 10, 3_000_000)
    out = tmp_path / "back"
    store.get_file("j/step-1/rank-00000.safetensors", str(out), limit=3_000_000)
    assert out.read_bytes() == src.read_bytes()
    with pytest.raises(FormatError, match="more than the 100 expected"):
        store.get_file("j/step-1/rank-00000.safetensors", str(tmp_path / "capped"), limit=100)
    assert not (tmp_path / "capped").exists() and not (tmp_path / "capped.part").exists()
    with pytest.raises(FormatError):
        store.get_bytes("j/step-1/rank-00000.safetensors", limit=100)
    with pytest.raises(FileNotFoundError):
        store.get_bytes("j/step-2/manifest.json")
    assert store.exists("j/step-10/manifest.json") and not store.exists("j/step-2/manifest.json")
    # a write again changes the tag, even with the same bytes
    before = store.list_tagged("j/step-10/")["j/step-10/manifest.json"]
    time.sleep(0.01)
    store.put_bytes("j/step-10/manifest.json", b"{}")
    assert store.list_tagged("j/step-10/")["j/step-10/manifest.json"] != before
    store.delete(store.list(""))
    store.delete(["j/step-99/gone.json"])  # missing: not an error
    assert _names(shared_fs.export) == [], "deleting every object leaves no folder and no temporary file behind"


def test_conditional_writes_and_deletes(shared_fs: SharedFS) -> None:
    store = DirStore(shared_fs.mount("a"))
    key = bucket_key(JOB, 1, MANIFEST)
    assert store.put_bytes_if(key, b"first", None) is True
    assert store.put_bytes_if(key, b"second", None) is False  # present: a no-replace write loses
    tag = store.list_tagged("j/")[key]
    assert store.put_bytes_if(key, b"third", "not-its-tag") is False
    assert store.put_bytes_if(key, b"third", tag) is True and store.get_bytes(key) == b"third"
    assert store.put_bytes_if(key, b"fourth", tag) is False  # the tag it judged is gone
    assert store.delete_if(key, tag) is False and store.exists(key)
    now = store.list_tagged("j/")[key]
    assert store.delete_if(key, now) is True and not store.exists(key)
    assert store.delete_if(key, now) is False  # already gone
    assert _names(shared_fs.export) == ["j", "step-1"]


def test_writers_racing_on_one_key_from_separate_mounts_one_wins(shared_fs: SharedFS) -> None:
    """Eight writers, each on its own mount (its own node), publish different bytes under one absent key at once:
    exactly one is told it won, and the key holds that writer's bytes."""
    stores = [DirStore(shared_fs.mount(f"n{i}")) for i in range(8)]
    for round_ in range(3):
        key = bucket_key(JOB, round_, MANIFEST)
        start, results = threading.Barrier(len(stores)), [None] * len(stores)

        def write(i: int, k: str, start: threading.Barrier, results: list[Any]) -> None:
            start.wait()
            results[i] = stores[i].put_bytes_if(k, f"writer {i}".encode(), None)

        threads = [threading.Thread(target=write, args=(i, key, start, results)) for i in range(len(stores))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results.count(True) == 1, results
        assert stores[0].get_bytes(key) == f"writer {results.index(True)}".encode()
    assert not [n for n in _names(shared_fs.export) if n.startswith(posix.HIDDEN)]


def _fragments(store: DirStore, step: int, ws: int = 4) -> None:
    """Every rank's shard and fragment of ``step`` in the store, as two nodes' daemons upload them (2 ranks each)."""
    with tempfile.TemporaryDirectory() as root:
        for rank in range(ws):
            write_rank(root, JOB, step, rank, ws, local_world_size=2)
        upload_ranks(store, tmp_dir(root, JOB, step), JOB, step, list(range(ws)))


def test_two_daemons_completing_one_step_at_once_leave_one_manifest(shared_fs: SharedFS) -> None:
    stores = [DirStore(shared_fs.mount(f"n{i}")) for i in range(2)]
    for step in (1, 2, 3):
        _fragments(stores[0], step)
        start, done = threading.Barrier(2), [False, False]

        def complete(i: int, s: int, start: threading.Barrier, done: list[bool]) -> None:
            start.wait()
            done[i] = try_complete(stores[i], JOB, s, 4)

        threads = [threading.Thread(target=complete, args=(i, step, start, done)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert any(done), done
        assert all(try_complete(s, JOB, step, 4) for s in stores)  # the other sees it at its next poll
    # one manifest each, complete; read where the directory is exported (a mount's cached listing may lag for seconds)
    assert remote_steps(DirStore(shared_fs.export), JOB) == ([1, 2, 3], [])


# ---------------------------------------------------------------------------- the anomalies, injected


class FaultyOS:
    """``os`` as :mod:`ckptd.storage.posix` sees it, with some calls replaced: ``faults[name](real, *args)``."""

    def __init__(self, **faults: Callable[..., Any]) -> None:
        self.faults = faults

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        fault = self.faults.get(name)
        return real if fault is None else functools.partial(fault, real)


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _once(fault: Callable[..., Any]) -> Callable[..., Any]:
    """``fault`` on the first call, the real call after."""
    fired: list[bool] = []

    def call(real: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if fired:
            return real(*args, **kw)
        fired.append(True)
        return fault(real, *args, **kw)

    return call


def test_a_rename_that_reports_a_failure_after_it_was_done_is_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def done_then_lost(real: Callable[..., Any], *args: Any, **kw: Any) -> None:
        real(*args, **kw)  # the server renamed; the reply was lost and the retransmission finds no source
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(posix, "os", FaultyOS(rename=_once(done_then_lost)))
    store = DirStore(str(tmp_path))
    store.put_bytes("j/step-1/rank-00000.json", b"data")
    assert store.get_bytes("j/step-1/rank-00000.json") == b"data"
    assert _names(str(tmp_path)) == ["j", "rank-00000.json", "step-1"]


def test_a_rename_that_failed_transiently_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def stale(real: Callable[..., Any], *args: Any, **kw: Any) -> None:
        raise OSError(errno.ESTALE, "Stale file handle")

    monkeypatch.setattr(posix, "os", FaultyOS(rename=_once(stale)))
    store = DirStore(str(tmp_path), sleep=lambda s: None)
    store.put_bytes("j/step-1/a.json", b"data")
    assert store.get_bytes("j/step-1/a.json") == b"data"


def test_a_manifest_link_whose_retransmission_met_eexist_won(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def done_then_exists(real: Callable[..., Any], *args: Any, **kw: Any) -> None:
        real(*args, **kw)
        raise FileExistsError(errno.EEXIST, "File exists")

    monkeypatch.setattr(posix, "os", FaultyOS(link=_once(done_then_exists)))
    store = DirStore(str(tmp_path))
    assert store.put_bytes_if(bucket_key(JOB, 1, MANIFEST), b"mine", None) is True
    assert store.get_bytes(bucket_key(JOB, 1, MANIFEST)) == b"mine"
    assert not [n for n in _names(str(tmp_path)) if n.startswith(posix.HIDDEN)]


def test_estale_while_listing_is_retried_and_a_vanished_folder_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirStore(str(tmp_path), sleep=lambda s: None)
    for step in (1, 2):
        store.put_bytes(bucket_key(JOB, step, MANIFEST), b"{}")

    def stale(real: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        raise OSError(errno.ESTALE, "Stale file handle")

    def vanished(real: Callable[..., Any], path: Any, *args: Any, **kw: Any) -> Any:
        if path == "step-2":  # another node removed it between the listing of j/ and its own
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        return real(path, *args, **kw)

    monkeypatch.setattr(posix, "os", FaultyOS(scandir=_once(stale), open=vanished))
    assert store.list("j/") == [bucket_key(JOB, 1, MANIFEST)]


def test_enospc_on_the_manifest_fails_the_completion_clearly_and_leaves_no_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirStore(str(tmp_path))
    _fragments(store, 1)

    def full(real: Callable[..., Any], fd: int, data: Any) -> int:
        if MANIFEST in _path_of(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(posix, "os", FaultyOS(write=full))
    with pytest.raises(DiskFull, match=rf"writing {tmp_path}/j/step-1/manifest.json failed: No space left on device"):
        try_complete(store, JOB, 1, 4)
    monkeypatch.setattr(posix, "os", os)
    assert remote_steps(store, JOB) == ([], [1])  # partial, never complete, and no temporary file left
    assert not [n for n in _names(str(tmp_path)) if n.startswith(posix.HIDDEN)]
    assert try_complete(store, JOB, 1, 4) and remote_steps(store, JOB) == ([1], [])  # room again: it completes


def test_edquot_reported_at_fsync_fails_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A network file system reports a failed write at fsync or close, not at write(): the quota is caught there."""
    store = DirStore(str(tmp_path))

    def quota(real: Callable[..., Any], fd: int) -> None:
        if "rank-00001" in _path_of(fd):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return real(fd)

    monkeypatch.setattr(posix, "os", FaultyOS(fsync=quota))
    store.put_bytes("j/step-1/rank-00000.json", b"ok")
    with pytest.raises(DiskFull, match="rank-00001.json failed: Disk quota exceeded"):
        store.put_bytes("j/step-1/rank-00001.json", b"over")
    assert not store.exists("j/step-1/rank-00001.json") and store.exists("j/step-1/rank-00000.json")
    assert not [n for n in _names(str(tmp_path)) if n.startswith(posix.HIDDEN)]


def test_a_really_full_shared_file_system(small_fs: str) -> None:
    """A 3 MiB tmpfs as the shared directory: the shard that does not fit fails with ENOSPC, naming it; nothing of it
    stays, and what is already there is intact."""
    store = DirStore(small_fs)
    store.put_bytes("j/step-1/rank-00000.safetensors", b"a" * (1 << 20))
    with pytest.raises(DiskFull, match="rank-00001.safetensors failed: No space left on device"):
        store.put_bytes("j/step-1/rank-00001.safetensors", b"b" * (4 << 20))
    assert store.list("j/") == ["j/step-1/rank-00000.safetensors"]
    assert store.get_bytes("j/step-1/rank-00000.safetensors") == b"a" * (1 << 20)
    assert not [n for n in _names(small_fs) if n.startswith(posix.HIDDEN)]


# ---------------------------------------------------------------------------- what another user may plant


def test_links_and_special_files_planted_in_the_shared_directory_are_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("private key")
    shared = tmp_path / "shared"
    (shared / "j" / "step-1").mkdir(parents=True)
    os.symlink(secret, shared / "j" / "step-1" / "manifest.json")  # a key that points elsewhere
    os.symlink(tmp_path, shared / "j" / "step-2")  # a folder that points elsewhere
    os.mkfifo(shared / "j" / "step-1" / "rank-00000.json")  # a read that would hang
    store = DirStore(str(shared))
    assert store.list("") == []  # neither links nor FIFOs are objects
    with pytest.raises((FileNotFoundError, CheckpointError)):
        store.get_bytes("j/step-1/manifest.json")
    with pytest.raises(CheckpointError, match="not a regular file"):
        store.get_bytes("j/step-1/rank-00000.json")
    with pytest.raises(CheckpointError):
        store.put_bytes("j/step-2/manifest.json", b"{}")  # never written through the planted folder link
    assert not (tmp_path / "manifest.json").exists() and secret.read_text() == "private key"
    with pytest.raises(ValueError):
        store.put_bytes("j/step-1/.ckptd-tmp.x", b"")  # the store's own names are not keys
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"")


def test_unfinished_writes_of_dead_writers_are_cleaned_up(tmp_path: Path) -> None:
    """A temporary or set-aside file untouched for an hour is a crashed writer's, whichever node or container wrote
    it; a recent one may be a live writer's (another node's, or this host's in another PID namespace): kept."""
    store = DirStore(str(tmp_path))
    store.put_bytes("j/step-1/manifest.json", b"{}")
    folder = tmp_path / "j" / "step-1"
    old_tmp = folder / f"{posix.HIDDEN}tmp.rank-00000.json.{posix._host()}.999999999.abcd"
    old_del = folder / f"{posix.HIDDEN}del.rank-00003.json.elsewhere.5.abcd"
    recent = folder / f"{posix.HIDDEN}tmp.rank-00002.json.elsewhere.5.abcd"
    for p in (old_tmp, old_del, recent):
        p.write_bytes(b"partial")
    for p in (old_tmp, old_del):
        os.utime(p, (time.time() - 2 * 3600, time.time() - 2 * 3600))
    assert store.abort_unfinished() == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted(["manifest.json", recent.name])
    assert store.list("") == ["j/step-1/manifest.json"]


def test_a_delete_whose_rename_reported_a_failure_after_it_was_done_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirStore(str(tmp_path))
    key = bucket_key(JOB, 1, MANIFEST)
    store.put_bytes(key, b"old")
    tag = store.list_tagged("")[key]

    def done_then_lost(real: Callable[..., Any], *args: Any, **kw: Any) -> None:
        real(*args, **kw)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(posix, "os", FaultyOS(rename=_once(done_then_lost)))
    assert store.delete_if(key, tag) is True and not store.exists(key)
    assert not [n for n in _names(str(tmp_path)) if n.startswith(posix.HIDDEN)], "the set-aside object was left behind"


def test_errors_making_a_folder_or_reading_are_the_store_s_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quota hit making a step's folder is a DiskFull naming the key; an I/O error while reading a CheckpointError."""
    store = DirStore(str(tmp_path))
    store.put_bytes("j/step-1/a.json", b"data")

    def quota(real: Callable[..., Any], *args: Any, **kw: Any) -> None:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    def eio(real: Callable[..., Any], *args: Any, **kw: Any) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(posix, "os", FaultyOS(mkdir=quota))
    with pytest.raises(DiskFull, match="step-2/a.json failed: Disk quota exceeded"):
        store.put_bytes("j/step-2/a.json", b"data")
    monkeypatch.setattr(posix, "os", FaultyOS(read=eio, readv=eio))
    with pytest.raises(CheckpointError, match="reading .*step-1/a.json failed: Input/output error"):
        store.get_bytes("j/step-1/a.json")
    with pytest.raises(CheckpointError, match="reading .*step-1/a.json failed"):
        store.get_file("j/step-1/a.json", str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists() and not (tmp_path / "copy.part").exists()


def test_a_file_system_without_hard_links_is_not_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(real: Callable[..., Any], *args: Any, **kw: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(posix, "os", FaultyOS(link=no_links))
    with pytest.raises(CheckpointError, match=r"not usable: no hard links \(link\(2\)\)"):
        DirStore(str(tmp_path)).check()
    assert os.listdir(tmp_path) == []


def test_a_directory_that_is_not_there_or_not_writable_is_not_usable(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not usable.*is it mounted"):
        DirStore(str(tmp_path / "absent")).check()
    with pytest.raises(ValueError, match="absolute"):
        DirStore("relative/path")


def test_a_delete_that_finds_the_object_written_again_puts_it_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another node writes the key again between this delete's check and its rename: the object set aside is not the
    one judged, so it goes back under its key, and the delete says it did not delete."""
    store = DirStore(str(tmp_path))
    key = bucket_key(JOB, 1, MANIFEST)
    store.put_bytes(key, b"judged")
    tag = store.list_tagged("")[key]

    def rewritten_first(real: Callable[..., Any], *args: Any, **kw: Any) -> None:
        DirStore(str(tmp_path)).put_bytes(key, b"written again")  # the other node, just before this rename
        real(*args, **kw)

    monkeypatch.setattr(posix, "os", FaultyOS(rename=_once(rewritten_first)))
    assert store.delete_if(key, tag) is False
    monkeypatch.setattr(posix, "os", os)
    assert store.get_bytes(key) == b"written again"
    assert not [n for n in _names(str(tmp_path)) if n.startswith(posix.HIDDEN)]
