"""Read a committed checkpoint: verified chunk regions of its tensors, in any placement.

Runs in the trainer's process (and in ``ckptd export`` and the DCP reader), on the calling thread,
and needs no daemon: for every region a caller asks for it copies in the parts of the saved chunks
that intersect it (so a chunk saved whole can fill a shard and the reverse), verifying each saved
chunk's checksum on the bytes it copies. :mod:`.load` puts a model and optimizer on top of it.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import stat
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .. import shm
from ..coverage import check_coverage
from ..errors import CheckpointError, FormatError
from ..format import digest, dtype_from_name, files_dir
from ..layout import MANIFEST
from ..validate import read_manifest, validate_manifest
from .hotread import Flat, HotRead, pread_into
from .hotreg import read_registered

log = logging.getLogger("ckptd.client")

UNMAP_AWAY = 1 << 30  # page-locked mappings of at least this many bytes in all are let go on a thread (cuda.let_go)
HASH_WORKERS = min(8, os.cpu_count() or 1)  # checksum threads of a hot restore into a GPU (XXH3 of 6 GB: 0.88 s on one, 0.16 s on 8)

# one saved chunk a region needs: (tensor key, the manifest's chunk entry, the copy into the region, its GPU or None,
# and the region's bytes where the chunk fills a contiguous part of it whole in its own dtype, else None)
Piece = tuple[str, dict[str, Any], Callable[[torch.Tensor], None], torch.device | None, torch.Tensor | None]


class CheckpointReader:
    """Reads verified chunk regions from one committed step directory.

    Where the bytes come from, and how many times they are copied:

    * shard files on disk are read with ``pread`` into one scratch buffer reused from chunk to chunk
      (memory held: the largest saved chunk, so an export of a checkpoint larger than RAM stays small);
      :meth:`read_many` (a restore) reads them on a thread instead, in file order, adjacent chunks in one
      read, one run ahead of the checksum and copy (:mod:`.readahead`; memory held: two buffers of
      ``RUN_BYTES`` or the largest chunk up to ``CHUNK_MAX``, page-locked for a GPU destination; larger
      chunks are read one at a time into the scratch buffer);
    * the daemon's shared-memory segments of a hot restore: by :meth:`read_many`, a chunk that fills a
      contiguous part of its destination whole is read with ``pread`` on threads (:mod:`.hotread`: into a
      CPU destination straight, verified there; into a GPU through page-locked slots); the other chunks
      come from the segment mapped read-only, used in place: the only copy is into the destination.

    A destination on a GPU gets non-blocking copies on a side stream from page-locked host memory (the
    slots of :mod:`.hotread`, the mapping registered with ``cudaHostRegister``, or a page-locked scratch
    pair for disk reads; see :class:`.cuda.Uploads`). Every saved chunk's checksum is verified on the very
    bytes that are copied: before the copy into a CPU destination from disk or a mapping (hashing on a
    second thread beside the copy measured no faster on CPU), after a whole chunk was read straight into a
    CPU destination, while the GPU's DMA runs for a GPU destination; a mismatch raises :class:`FormatError`
    before :meth:`read_into` or :meth:`read_many` returns, and a failed read may leave the destination
    partly written (or holding the corrupt bytes: a hot restore then reads the disk's copy over every
    destination). :meth:`close` waits for copies in flight.
    """

    def __init__(
        self, path: str, *, manifest: dict[str, Any] | None = None, files: dict[str, str] | None = None, memory: bool = False
    ) -> None:
        """``path``: a committed step directory. A hot restore passes the step's ``manifest`` and, in
        ``files``, where each shard's bytes are instead (the daemon's shared-memory segments, which
        hold exactly the shard file's bytes and may be longer). ``memory``: the manifest is the daemon's
        of a memory-tier step, which has no checksums (its bytes never left the daemon's memory)."""
        self.path = path
        if manifest is None:
            self.manifest = read_manifest(path)
        else:
            self.manifest = validate_manifest(manifest, os.path.join(path, MANIFEST), memory=memory)
        self._files = dict(files or {})
        self._folder = files_dir(path, self.manifest)  # a multi-node step read in a shared directory
        self.hot = bool(self._files)  # it reads the daemon's segments (a hot restore), not the disk
        self._check_step()
        self._fds: dict[str, int] = {}
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}  # segments mapped read-only (hot)
        self._scratch = torch.empty(0, dtype=torch.uint8)  # disk reads into a CPU destination
        self._uploads: dict[torch.device, Any] = {}  # per GPU: a .cuda.Uploads
        self._registered: dict[int, bool] = {}  # mappings page-locked for those GPUs (base address -> done)

    def where(self, name: str) -> str:
        """The path the bytes of shard file ``name`` are read from: a segment (hot), else the step's folder, or the
        folder of the attempt that saved it where the step is a multi-node one in a shared directory."""
        return self._files.get(name) or os.path.join(self._folder, name)

    def close(self) -> None:
        """Wait for the device copies in flight, then let go of every registration, mapping, buffer and
        descriptor (views handed out by :meth:`saved_chunk` are invalid from here on). Left by an exception
        (``with``: a failed hot read), the reader first clears the locals of that exception's finished frames
        and of those chained to it: they may hold views of the mappings, and reading one later (an error
        reporter printing locals) would read unmapped memory and crash the process."""
        errors: list[Exception] = []
        for up in self._uploads.values():
            try:
                up.finish()
            except Exception as e:  # every device still finishes: raised once all did
                errors.append(e)
        self._uploads.clear()
        maps = [mm for mm, _ in self._maps.values()]
        self._maps.clear()
        if self._registered:  # unregistered, then unmapped (large ones on a thread of their own)
            from . import cuda

            cuda.let_go(self._registered, maps, UNMAP_AWAY)
            maps = []
        for mm in maps:
            mm.close()
        self._scratch = torch.empty(0, dtype=torch.uint8)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and self._maps:  # a failed hot read: its frames' locals may hold views of what close() unmaps
            _forget_locals(exc)
        self.close()

    def _check_step(self) -> None:
        """What the manifest's validation cannot tell, checked once, before any caller allocates a tensor of a
        shape the manifest gives: every tensor's chunks cover it exactly once (:func:`ckptd.coverage.check_coverage`,
        linear in the chunks: an overlap would leave part of a region unread, a gap unfilled), and every shard
        is a regular file of the size the manifest says (its chunks' byte ranges lie within that size), so a
        tensor is never larger than the files hold. A :class:`FormatError` naming the file otherwise."""
        try:
            check_coverage(self.manifest["tensors"])
        except CheckpointError as e:
            raise FormatError(f"{os.path.join(self.path, MANIFEST)}: {e}: the checkpoint is corrupt or was altered") from None
        for name in self.manifest["files"]:
            try:
                st = os.stat(self.where(name))  # a stat, not an open: a FIFO cannot block it, and no descriptor is held
            except FileNotFoundError:
                raise FormatError(f"{self.where(name)} is missing: the checkpoint is incomplete") from None
            self._refuse_file(name, st)

    def _refuse_file(self, name: str, st: os.stat_result) -> None:
        """Raise :class:`FormatError` unless shard ``name`` is a regular file of the manifest's size (a
        segment of the daemon's: at least that size). The manifest's byte ranges lie within that size."""
        path, want = self.where(name), self.manifest["files"][name]["size"]
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path} is not a regular file (a FIFO, a device or a directory): the checkpoint is corrupt")
        if st.st_size < want or (st.st_size != want and name not in self._files):
            raise FormatError(f"{path} is {st.st_size} bytes, the manifest says {want}: truncated or corrupt")

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            path = self.where(name)
            try:  # O_NONBLOCK: a FIFO put in the file's place cannot block the open (checked below)
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                raise FormatError(f"{path} is missing: the checkpoint is incomplete") from None
            try:
                self._refuse_file(name, os.fstat(fd))
                os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
            self._fds[name] = fd
        return self._fds[name]

    def _mapped(self, name: str, populate: bool = True) -> torch.Tensor:
        """Shared-memory segment ``name``, mapped read-only (a ``uint8`` tensor that must never be written).
        ``populate``: build its page tables up front (``MAP_POPULATE``; not for a mapping about to be
        page-locked, which builds them again: measured 0.6 s for 6 GB on an H100 host, for nothing)."""
        got = self._maps.get(name)
        if got is None:
            fd = self._fd(name)
            size = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
            shm.dont_fork(mm)
            with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is only ever a copy's source
                warnings.simplefilter("ignore", UserWarning)
                got = self._maps[name] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        return got[1]

    def _pread(self, fd: int, into: torch.Tensor, offset: int) -> int:
        return pread_into(fd, into, offset)

    def _raw(self, c: dict[str, Any], device: torch.device | None) -> torch.Tensor:
        """The bytes of saved chunk ``c``, not yet verified: a view of the mapped segment (hot), else read
        into scratch (page-locked, for ``device``, a GPU). Valid until the next call."""
        b, e = c["byte_range"]
        if c["file"] in self._files:
            view = self._mapped(c["file"])[b:e]
            return view if device is None else self._upload(device).host_source(view)
        fd = self._fd(c["file"])
        if device is None:
            if self._scratch.numel() < e - b:
                self._scratch = torch.empty(e - b, dtype=torch.uint8)
            raw = self._scratch[: e - b]
        else:
            raw = self._upload(device).staging(e - b)
        if self._pread(fd, raw, b) != e - b:
            raise FormatError(f"{self.where(c['file'])} ends inside bytes {b}-{e}: truncated")
        return raw

    def _upload(self, device: torch.device) -> Any:
        up = self._uploads.get(device)
        if up is None:
            from . import cuda

            up = self._uploads[device] = cuda.Uploads(device, self._registered)
        return up

    def _check(self, key: str, c: dict[str, Any], raw: torch.Tensor) -> None:
        if c["xxh3_64"] is not None and digest(memoryview(raw.numpy())) != c["xxh3_64"]:
            b, e = c["byte_range"]
            raise FormatError(f"checksum mismatch in {self.where(c['file'])} (tensor {key!r}, bytes {b}-{e}): the file is corrupt")

    def _typed(self, key: str, c: dict[str, Any], raw: torch.Tensor) -> torch.Tensor:
        dtype = dtype_from_name(self.manifest["tensors"][key]["dtype"])
        if raw.storage_offset() % dtype.itemsize:  # ckptd aligns every chunk; another writer may not have
            raw = raw.clone()
        return raw.view(dtype).view(c["sizes"])

    def saved_chunk(self, key: str, c: dict[str, Any]) -> torch.Tensor:
        """The saved chunk ``c`` of tensor ``key``, checksum-verified: a view of the reader's own memory,
        valid until the next read or :meth:`close` (copy it to keep it); never write to it."""
        raw = self._raw(c, None)
        self._check(key, c, raw)
        return self._typed(key, c, raw)

    def _copy_chunk(self, key: str, c: dict[str, Any], put: Callable[[torch.Tensor], None], device: torch.device | None) -> None:
        """``put`` the typed saved chunk ``c`` (it copies the part it needs), verifying its checksum meanwhile."""
        self._consume(key, c, self._raw(c, device), put, device)

    def _consume(
        self, key: str, c: dict[str, Any], raw: torch.Tensor, put: Callable[[torch.Tensor], None], device: torch.device | None
    ) -> None:
        if device is not None:  # the GPU copies (non-blocking, from page-locked memory) while the CPU hashes
            with self._upload(device).stream_for(raw):
                put(self._typed(key, c, raw))
            self._check(key, c, raw)
            return
        self._check(key, c, raw)  # a CPU destination: checked first (hashing beside the copy gained nothing on CPU)
        put(self._typed(key, c, raw))

    def read_into(self, key: str, dst: torch.Tensor, offsets: tuple[int, ...], *, cast: torch.dtype | None = None) -> None:
        """Fill ``dst``, the region of tensor ``key`` starting at ``offsets``, from the saved chunks.

        The saved dtype must be ``dst``'s, unless ``dst`` has dtype ``cast`` and both are floating
        point: then the saved values are converted (rounded as ``Tensor.copy_`` rounds)."""
        for _, c, put, device, _ in self.pieces(key, dst, offsets, cast=cast):
            self._copy_chunk(key, c, put, device)

    def read_many(self, pieces: list[Piece]) -> None:
        """Copy in the :meth:`pieces` of many regions (each fills its own part of its destination, so in any
        order). From the daemon's memory, chunks that fill a contiguous part of their destination whole are
        read by several threads (:class:`.hotread.HotRead`: no mapping); the others are copied from the
        segment mapped (and, for a GPU, page-locked). Chunks read from disk are taken in file order, per
        destination device, and read ahead on a thread (:class:`.readahead.ReadAhead`) while this one
        verifies and copies them."""
        from .readahead import CHUNK_MAX

        disk: dict[torch.device | None, list[Piece]] = {}
        hot: dict[torch.device, list[Piece]] = {}
        flat: list[Flat] = []
        for p in pieces:
            b, e = p[1]["byte_range"]
            if p[1]["file"] in self._files and p[4] is not None:  # the daemon's memory, read straight in
                flat.append(Flat(p[0], p[1], p[4], p[3]))
            elif p[1]["file"] in self._files and p[3] is not None:  # the daemon's memory into a GPU, reshaped
                hot.setdefault(p[3], []).append(p)
            elif p[1]["file"] in self._files or e - b > CHUNK_MAX:  # the daemon's memory (mapped), or a huge chunk
                self._copy_chunk(*p[:4])
            else:
                disk.setdefault(p[3], []).append(p)
        if flat:
            fds = {f.c["file"]: self._fd(f.c["file"]) for f in flat}  # opened and size-checked here
            flat = read_registered(flat, self.where, lambda name: self._mapped(name, populate=False), self._upload, self._check)
            HotRead(fds, self.where, self._upload).read(flat)
        for device, group in hot.items():
            self._hot_to_device(group, device)
        for device, group in disk.items():
            if len(group) < 2:  # nothing to read ahead of
                self._copy_chunk(*group[0][:4])
                continue
            group.sort(key=lambda p: (p[1]["file"], p[1]["byte_range"][0]))
            self._read_ahead(group, device)

    def _hot_to_device(self, group: list[Piece], device: torch.device) -> None:
        """The daemon's memory into GPU ``device``: every mapping page-locked (on this thread: the driver
        serializes registrations, so more threads gain nothing) while :data:`HASH_WORKERS` threads verify
        the chunks' checksums from the same pages; then every copy enqueued from the registered pages. A
        checksum mismatch raises once the copies are enqueued (the destination may then hold those bytes)."""
        up = self._upload(device)
        views = {name: self._mapped(name, populate=False) for name in {p[1]["file"] for p in group}}
        failed: BaseException | None = None
        with ThreadPoolExecutor(min(HASH_WORKERS, len(group)), thread_name_prefix="ckptd-verify") as pool:
            checks = [pool.submit(self._check, key, c, views[c["file"]][c["byte_range"][0] : c["byte_range"][1]]) for key, c, *_ in group]
            try:
                for view in views.values():
                    up.register(view)  # the whole mapping, before any copy (where refused, chunks go through staging)
                for key, c, put, *_ in group:
                    raw = self._raw(c, device)
                    with up.stream_for(raw):
                        put(self._typed(key, c, raw))
            except Exception as e:
                failed = e
        # every check has ended (the pool's exit waits for them): a mismatch comes first, even before a copy's
        # failure (its FormatError sends a hot restore to the disk's intact copy)
        for f in checks:
            e = f.exception()
            if e is not None:
                raise e from failed
        if failed is not None:
            raise failed

    def _read_ahead(self, group: list[Piece], device: torch.device | None) -> None:
        from .readahead import ReadAhead

        fds = {p[1]["file"]: self._fd(p[1]["file"]) for p in group}  # opened (and size-checked) here, read on the thread
        kw: dict[str, Any] = {}
        if device is not None:  # page-locked buffers, refilled once the copies from them ended
            up = self._upload(device)
            kw = {"alloc": up.pinned, "fence": up.fence, "init": lambda: torch.cuda.set_device(device)}
        with ReadAhead([p[1] for p in group], lambda name, into, offset: self._pread(fds[name], into, offset), self.where, **kw) as ra:
            for key, c, put, *_ in group:
                self._consume(key, c, ra.take(c), put, device)

    def pieces(self, key: str, dst: torch.Tensor, offsets: tuple[int, ...], *, cast: torch.dtype | None = None) -> list[Piece]:
        """What filling ``dst`` (see :meth:`read_into`) takes: each saved chunk it needs, with the function
        that copies the chunk's part into ``dst``, checked (dtype, shape, full coverage) but not yet read."""
        ent = self.manifest["tensors"].get(key)
        if ent is None:
            raise CheckpointError(f"the checkpoint at {self.path} has no tensor {key!r}")
        saved = dtype_from_name(ent["dtype"])
        if saved != dst.dtype and not (cast == dst.dtype and saved.is_floating_point and dst.dtype.is_floating_point):
            hint = f": pass dtype={dst.dtype} to restore() to convert" if saved.is_floating_point and dst.dtype.is_floating_point else ""
            raise CheckpointError(f"tensor {key!r}: the checkpoint holds {saved}, the target is {dst.dtype}{hint}")
        sizes = tuple(dst.shape)
        if len(ent["shape"]) != len(sizes) or any(o + s > g for o, s, g in zip(offsets, sizes, ent["shape"])):
            raise CheckpointError(f"tensor {key!r}: region {offsets}+{sizes} does not fit the saved shape {ent['shape']}")
        filled = 0
        device = dst.device if dst.device.type == "cuda" else None
        out: list[Piece] = []
        for c in ent["chunks"]:
            lo = [max(a, b) for a, b in zip(offsets, c["offsets"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c["offsets"], c["sizes"])]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue

            def put(src: torch.Tensor, c: dict[str, Any] = c, lo: list[int] = lo, hi: list[int] = hi) -> None:
                d = _narrowed(dst, lo, hi, offsets)
                d.copy_(_narrowed(src, lo, hi, c["offsets"]), non_blocking=device is not None)
                if device is not None:
                    self._upload(device).keep(d)

            out.append((key, c, put, device, _whole(dst, offsets, c, lo, hi, saved)))
            filled += math.prod(h - l for l, h in zip(lo, hi))
        if filled != math.prod(sizes):
            raise CheckpointError(f"tensor {key!r}: the checkpoint covers {filled} of the {math.prod(sizes)} elements needed")
        return out

    def read_full(self, key: str) -> torch.Tensor:
        ent = self.manifest["tensors"].get(key)
        if ent is None:
            raise CheckpointError(f"the checkpoint at {self.path} has no tensor {key!r}")
        out = torch.empty(ent["shape"], dtype=dtype_from_name(ent["dtype"]))
        self.read_into(key, out, (0,) * len(ent["shape"]))
        return out

    def tree_for(self, rank: int) -> tuple[int, dict[str, Any]]:
        """The saved rank whose tree this rank takes (itself if it existed, else rank 0) and its tree."""
        ranks = {r["rank"]: r["tree"] for r in self.manifest["ranks"]}
        src = rank if rank in ranks else 0
        if src not in ranks:
            raise FormatError(f"{self.path}: manifest lists no rank trees")
        return src, ranks[src]


def _narrowed(t: torch.Tensor, lo: list[int], hi: list[int], start: tuple[int, ...] | list[int]) -> torch.Tensor:
    """The part ``[lo, hi)`` (global coordinates) of ``t``, which starts at ``start``."""
    for dim, (l, h) in enumerate(zip(lo, hi)):
        t = t.narrow(dim, l - start[dim], h - l)
    return t


def _whole(
    dst: torch.Tensor, offsets: tuple[int, ...], c: dict[str, Any], lo: list[int], hi: list[int], saved: torch.dtype
) -> torch.Tensor | None:
    """The bytes of ``dst``'s part that saved chunk ``c`` fills, if it fills that part whole, contiguous, in the
    saved dtype, on the CPU or a GPU (a ``uint8`` view a read can land in); else None."""
    if type(dst) not in (torch.Tensor, torch.nn.Parameter):
        return None  # a tensor subclass (a quantized wrapper, a __torch_dispatch__ tensor): its bytes are not its values
    if dst.dtype != saved or dst.device.type not in ("cpu", "cuda") or dst.is_conj() or dst.is_neg():
        return None
    if any(l != o or h != o + s for l, h, o, s in zip(lo, hi, c["offsets"], c["sizes"])):
        return None  # the chunk lies partly outside the region
    d = _narrowed(dst.detach(), lo, hi, offsets)
    if not d.is_contiguous():
        return None
    try:
        return d.view(-1).view(torch.uint8)
    except RuntimeError:  # a dtype whose bytes cannot be viewed so
        return None


def _forget_locals(exc: BaseException | None) -> None:
    """Clear the locals of every finished frame in the tracebacks of ``exc``, its cause, its context and the
    members of an exception group, recursively (frames still running are left as they are)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
