"""Consolidate a sharded checkpoint into one file, or a Hugging Face model directory (``ckptd export``), streaming.

For the safetensors and hf formats, peak memory is about the largest tensor plus one saved chunk: each
tensor is assembled from its chunks, written, and dropped before the next. The torch format has to
hold the selected state in memory (``torch.save`` takes one dict). The hf format writes what
``transformers``' ``from_pretrained`` loads: ``model-0000i-of-0000n.safetensors`` files of at most
``max_shard_size`` bytes each, ``model.safetensors.index.json`` mapping every tensor to its file, and
the model's ``config.json`` (and generation / tokenizer files) copied from ``config_from``: its regular files
only, never through a link (see :func:`_open_side_files`). Runs anywhere (no daemon, no process group).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import shutil
import stat
import struct
import sys
import tempfile
from collections.abc import Callable
from typing import IO

import torch

from ..client.reader import CheckpointReader
from ..client.weights import nbytes, write_safetensors
from ..errors import CheckpointError
from ..format import dtype_from_name
from ..state import split_key
from ..storage.local import resolve_step_dir

WHAT = ("model", "optim", "all")
FORMATS = ("safetensors", "torch", "hf")
HF_INDEX = "model.safetensors.index.json"
HF_SHARD_SIZE = 5 * 10**9  # transformers' default max_shard_size ("5GB")
HF_CONFIG = "config.json"  # the one file of config_from an hf export needs
# what config_from contributes besides the weights (the files save_pretrained and tokenizers write)
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip

log = logging.getLogger("ckptd.export")


def _check_replaceable(out: str) -> None:
    """The export replaces ``out`` by a rename: only a regular file (or a link to one, or nothing) may stand
    there. A directory, a device (``--out /dev/null`` run as root would replace the device node), a FIFO or
    a socket is refused before anything is read."""
    try:
        st = os.stat(out)
    except FileNotFoundError:
        return  # nothing there, or a dangling link (replaced)
    except OSError as e:
        raise CheckpointError(f"cannot export to {out}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise CheckpointError(f"{out} is {what}: the export writes a new file there (give a file's path)")


MODEL_ROOTS = ("model", "state_dict")  # snapshot() and most DCP steps; Lightning's CkptdCheckpointIO
OPTIM_ROOTS = ("optim", "optimizer", "optimizer_states")  # snapshot(); DCP steps (torchtitan); Lightning


def output_names(keys: list[str], what: str) -> dict[str, str]:
    """The exported name of each state key ``what`` selects, in the step's layout: model FQNs as ``load_state_dict``
    wants them, under the first of :data:`MODEL_ROOTS` the step has, else its top-level tensors (a DCP state dict
    holding the model's at its top level, as torchtitan saves); optimizer entries under the first of
    :data:`OPTIM_ROOTS`; ``all``: every key but ``extra``'s, its parts joined by dots."""
    parts = {k: split_key(k) for k in keys}
    if what == "all":
        return {k: ".".join(p) for k, p in parts.items() if p[0] != "extra"}
    firsts = {p[0] for p in parts.values() if len(p) > 1}
    root = next((r for r in (MODEL_ROOTS if what == "model" else OPTIM_ROOTS) if r in firsts), None)
    if root is not None:
        return {k: ".".join(p[1:]) for k, p in parts.items() if p[0] == root and len(p) > 1}
    return {k: p[0] for k, p in parts.items() if len(p) == 1} if what == "model" else {}


def _progress_printer(total: int) -> Callable[[int], None]:
    if not sys.stderr.isatty():
        return lambda done: None

    def show(done: int) -> None:
        sys.stderr.write(f"\rexporting {done / max(total, 1):6.1%}  {done / 1e9:.2f} / {total / 1e9:.2f} GB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def export_checkpoint(
    path: str,
    out: str,
    *,
    fmt: str = "safetensors",
    what: str = "model",
    progress: Callable[[int], None] | None = None,
    max_shard_size: int = HF_SHARD_SIZE,
    config_from: str | None = None,
) -> dict[str, int]:
    """Write the full (unsharded) state of checkpoint ``path`` to ``out``; returns counts.

    ``what``: ``model`` (keys are model FQNs, loadable by ``model.load_state_dict``), ``optim``
    (``state.<fqn>.<name>``, tensors only) or ``all`` (``model.<fqn>``, ``optim.state.<fqn>.<name>``).
    The file appears atomically (written to a new hidden file beside it, then renamed). ``fmt="hf"``: ``out``
    is a new directory (see the module's docstring; the model only), made under a new hidden name and renamed.
    """
    if fmt not in FORMATS or what not in WHAT:
        raise ValueError(f"format must be one of {FORMATS} and what one of {WHAT}")
    out = os.path.normpath(out)  # "new/" names the directory "new": its temporary is "new.tmp", beside it
    if fmt == "hf" and what != "model":
        raise ValueError("the hf format holds the model only (what='model')")
    if fmt != "hf":
        _check_replaceable(out)
    step_dir = resolve_step_dir(path)
    with CheckpointReader(step_dir) as reader:
        tensors = reader.manifest["tensors"]
        names = output_names(sorted(tensors), what)
        if not names:
            where = f"under {' or '.join(MODEL_ROOTS if what == 'model' else OPTIM_ROOTS)}" + (
                " nor at the top level" if what == "model" else ""
            )
            raise CheckpointError(f"{step_dir} holds no {what} tensors ({where}): --what all exports every tensor it holds")
        meta = {"format": "pt", "ckptd_step": str(reader.manifest["step"])}
        total = sum(nbytes(tensors[k]) for k in names)
        show = progress or _progress_printer(total)
        if fmt == "hf":
            return _export_hf(reader, names, out, meta, show, max_shard_size, config_from)
        temps: list[str] = []
        try:
            with _temp_beside(out, temps) as f:
                write_safetensors(reader, names, f, meta, show, 0)
            if fmt == "torch":
                with _temp_beside(out, temps) as f:
                    _safetensors_to_torch(temps[0], f)
            os.replace(temps[-1], out)
        finally:
            for p in temps:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
    return {"tensors": len(names), "bytes": total}


def _umask() -> int:
    """The process's umask, read without setting it (setting it to read it would give a file another thread makes
    meanwhile the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: the brief set-and-restore
    os.umask(mask)
    return mask


def _temp_beside(out: str, made: list[str]) -> IO[bytes]:
    """A new file beside ``out``, open for writing, its path appended to ``made``: a fresh name made with O_EXCL
    (never a file or link someone planted there, in a directory others can write), with the mode a plain
    ``open`` would give it (the umask's)."""
    fd, path = tempfile.mkstemp(dir=os.path.dirname(out) or ".", prefix=f".{os.path.basename(out)}.", suffix=".tmp")
    made.append(path)
    os.fchmod(fd, 0o666 & ~_umask())
    return os.fdopen(fd, "wb")


def _export_hf(
    reader: CheckpointReader,
    names: dict[str, str],
    out: str,
    meta: dict[str, str],
    show: Callable[[int], None],
    max_shard_size: int,
    config_from: str | None,
) -> dict[str, int]:
    if os.path.lexists(out):
        raise CheckpointError(f"{out} already exists: the hf export makes a new directory")
    if max_shard_size < 1:
        raise ValueError("max_shard_size must be >= 1 byte")
    # opened (and refused) before any weights are written; read later from these descriptors, never by name again
    side = _open_side_files(config_from) if config_from is not None else []
    try:
        return _write_hf_dir(reader, names, out, meta, show, max_shard_size, side)
    finally:
        for _, s in side:
            s.close()


def _write_hf_dir(
    reader: CheckpointReader,
    names: dict[str, str],
    out: str,
    meta: dict[str, str],
    show: Callable[[int], None],
    max_shard_size: int,
    side: list[tuple[str, IO[bytes]]],
) -> dict[str, int]:
    tensors = reader.manifest["tensors"]
    shards: list[dict[str, str]] = [{}]
    size = 0
    for k, n in names.items():  # in key order, a new file when the next tensor would overflow this one
        if shards[-1] and size + nbytes(tensors[k]) > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = n
        size += nbytes(tensors[k])
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        files = ["model.safetensors"]  # what save_pretrained writes for a model that fits one file
    # a fresh directory (0700 until renamed): its files are made inside it through its descriptor, never through
    # a link someone put in its place in a directory others can write
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out) or ".", prefix=f".{os.path.basename(out)}.", suffix=".tmp")
    dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)

    def new(name: str) -> IO[bytes]:
        return os.fdopen(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=dfd), "wb")

    try:
        done = 0
        for file, shard in zip(files, shards):
            with new(file) as f:
                done = write_safetensors(reader, shard, f, meta, show, done)
        if len(shards) > 1:
            index = {"metadata": {"total_size": done}, "weight_map": {n: f for f, sh in zip(files, shards) for n in sh.values()}}
            with new(HF_INDEX) as f:
                f.write(json.dumps(index, indent=2, sort_keys=True).encode())
        for name, s in side:
            with new(name) as f:
                shutil.copyfileobj(s, f)
        os.chmod(dfd, 0o777 & ~_umask())  # as os.makedirs would have made it
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(dfd)
    return {"tensors": len(names), "bytes": done, "files": len(files)}


def _open_side_files(config_from: str) -> list[tuple[str, IO[bytes]]]:
    """The files of a Hugging Face model directory (or its one ``config.json``) that go beside the weights, open.

    Only regular files of that directory itself are read: an entry that is a symbolic link, a FIFO, a device, a
    socket or a directory is never opened through (a model directory from elsewhere, exported as root, must not put
    ``tokenizer.json -> /etc/shadow`` into a world-readable export, nor hang it on a FIFO). Such an optional file
    is skipped with a warning; ``config.json``, which the export needs, is refused. The directory itself is the
    user's choice and may be a link.

    Returns:
        ``(name, file)`` pairs, in :data:`HF_SIDE_FILES`' order; the caller closes the files.

    Raises:
        CheckpointError: no ``config.json`` there, or one that is not a regular file.
    """
    where, names = config_from, HF_SIDE_FILES
    if os.path.basename(config_from) == HF_CONFIG and not os.path.isdir(config_from):  # the file alone
        where, names = os.path.dirname(config_from) or ".", (HF_CONFIG,)
    try:
        dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise CheckpointError(f"--config-from {config_from}: give a model directory or its config.json") from None
    except OSError as e:
        raise CheckpointError(f"--config-from {config_from}: {e.strerror}") from None
    opened: list[tuple[str, IO[bytes]]] = []
    try:
        for name in names:
            try:
                f = _open_regular(dfd, name)
            except OSError as e:  # unreadable: as a plain open would have failed, naming the file
                raise CheckpointError(f"--config-from {config_from}: {name}: {e.strerror}") from None
            if isinstance(f, str) and name == HF_CONFIG:
                hint = " (a Hugging Face cache snapshot links to its blobs: copy it with cp -rL first)" if f == _LINK else ""
                raise CheckpointError(f"--config-from {config_from}: {name} is {f}, not a regular file: not read{hint}")
            if isinstance(f, str):
                log.warning("--config-from %s: %s is %s, not a regular file: not copied", config_from, name, f)
            elif f is not None:
                opened.append((name, f))
            elif name == HF_CONFIG:
                raise CheckpointError(
                    f"--config-from {config_from}: no config.json there (a directory save_pretrained wrote, or its config.json)"
                )
    except BaseException:
        for _, f in opened:
            f.close()
        raise
    finally:
        os.close(dfd)
    return opened


def _open_regular(dfd: int, name: str) -> IO[bytes] | str | None:
    """Entry ``name`` of directory ``dfd``, open for reading if it is a regular file; else what it is (a phrase
    such as ``"a FIFO"``), or ``None`` if there is no such entry."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)  # first, so a device or a FIFO is never opened at all
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return _kind(st.st_mode)
    # it may have been replaced since: never through a link (O_NOFOLLOW), never waiting on a FIFO (O_NONBLOCK), and
    # what was opened is checked again
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return _LINK
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        return _kind(mode)
    return os.fdopen(fd, "rb")


_LINK = "a symbolic link"


def _kind(mode: int) -> str:
    kinds = {stat.S_IFLNK: _LINK, stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
    return kinds.get(stat.S_IFMT(mode), "a device")


def _safetensors_to_torch(src: str, dst: IO[bytes]) -> None:
    """Re-write a safetensors file as ``torch.save`` output, to ``dst``.

    ``torch.save`` needs every tensor alive at once, with storages of its own: this format holds the
    selected state in memory (the safetensors format is the streaming one).
    """
    with open(src, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        (n,) = struct.unpack_from("<Q", mm, 0)
        header = json.loads(mm[8 : 8 + n])
        data = torch.frombuffer(mm, dtype=torch.uint8)[8 + n :]
        sd = {}
        for name, ent in header.items():
            if name == "__metadata__":
                continue
            b, e = ent["data_offsets"]
            # cloned first: a safetensors body is packed, so a tensor may start off its dtype's alignment
            sd[name] = data[b:e].clone().view(dtype_from_name(ent["dtype"])).view(ent["shape"])
        torch.save(sd, dst)
        dst.flush()
        os.fsync(dst.fileno())
        del sd, data
    finally:
        mm.close()
