"""Whether the chunks of each global tensor cover it exactly once: no element saved twice, none missing.

Every manifest is checked before it is written (:func:`ckptd.format.build_manifest`), and again by
``ckptd verify``: a checkpoint whose ranks disagree on a sharding (two holders of one region under
different names, a gap left by a rank that saved too little) is refused, naming the tensor and region.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Any

from .errors import CheckpointError

Chunk = dict[str, Any]  # a chunk entry of a manifest or fragment


def check_coverage(tensors: dict[str, Any]) -> None:
    """Every global tensor is covered exactly once by its chunks; raise naming the key and region.
    O(n log n) in a tensor's chunks for the shardings torch makes (see :func:`_overlapping_pair`)."""
    for key, ent in tensors.items():
        chunks = [c for c in ent["chunks"] if math.prod(c["sizes"])]  # an empty chunk holds no element to overlap
        pair = _overlapping_pair(chunks)
        if pair is not None:
            c, o = pair
            raise CheckpointError(
                f"tensor {key!r}: chunks at offsets {c['offsets']} ({c['file']}) and {o['offsets']} ({o['file']}) overlap;"
                " state keys must be globally unique"
            )
        total = sum(math.prod(c["sizes"]) for c in chunks)
        want = math.prod(ent["shape"])
        if total != want:
            raise CheckpointError(f"tensor {key!r} of shape {ent['shape']}: chunks cover {total} of {want} elements")


def _overlapping_pair(chunks: list[Chunk]) -> tuple[Chunk, Chunk] | None:
    """Two of ``chunks`` (none of them empty) that share an element, or ``None``.

    A dimension along which every chunk spans the same extent tells no two apart, so it is dropped;
    the others are ordered by how many distinct offsets the chunks have along them, the first is swept.
    """
    if len(chunks) < 2:
        return None
    spans = [{(c["offsets"][d], c["sizes"][d]) for c in chunks} for d in range(len(chunks[0]["offsets"]))]
    dims = sorted((d for d, s in enumerate(spans) if len(s) > 1), key=lambda d: -len({o for o, _ in spans[d]}))
    if not dims:
        return chunks[0], chunks[1]  # all alike: a scalar or a region saved twice
    if len(dims) <= 2:
        return _overlap_2d(chunks, dims[0], dims[-1])
    cuts = [sorted({c["offsets"][d] for c in chunks} | {c["offsets"][d] + c["sizes"][d] for c in chunks}) for d in dims]
    if math.prod(len(x) - 1 for x in cuts) <= 16 * len(chunks):
        return _overlap_cells(chunks, dims, cuts)
    return _overlap_sweep(chunks, dims)


def _overlap_2d(chunks: list[Chunk], a: int, b: int) -> tuple[Chunk, Chunk] | None:
    """Sweep along ``a``: the chunks that contain the sweep position all overlap along ``a``, so (no
    overlap found so far) they are disjoint along ``b``, kept as intervals sorted by start; a new
    chunk can meet only the last of them that starts before it ends. O(n log n) whatever the chunks.
    With ``a == b`` (one sharded dimension) the band holds one chunk at most."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i]["offsets"][a])
    ends: list[tuple[int, int]] = []  # heap: (end along a, index) of the chunks in the band
    band: list[tuple[int, int, int]] = []  # (start, end, index) along b: disjoint, sorted
    for i in order:
        c = chunks[i]
        pos = c["offsets"][a]
        while ends and ends[0][0] <= pos:
            j = heapq.heappop(ends)[1]
            lo_j = chunks[j]["offsets"][b]
            del band[bisect.bisect_left(band, (lo_j, lo_j + chunks[j]["sizes"][b], j))]
        lo = c["offsets"][b]
        hi = lo + c["sizes"][b]
        k = bisect.bisect_left(band, (hi,))
        if k and band[k - 1][1] > lo:
            return chunks[band[k - 1][2]], c
        band.insert(k, (lo, hi, i))
        heapq.heappush(ends, (pos + c["sizes"][a], i))
    return None


def _overlap_cells(chunks: list[Chunk], dims: list[int], cuts: list[list[int]]) -> tuple[Chunk, Chunk] | None:
    """The grid that every chunk boundary cuts the tensor into holds few cells (as for any grid
    sharding): each chunk claims its cells, the first cell claimed twice names an overlap. O(cells)."""
    index = [{v: i for i, v in enumerate(x)} for x in cuts]
    owner: dict[tuple[int, ...], Chunk] = {}
    for c in chunks:
        ranges = [range(ix[c["offsets"][d]], ix[c["offsets"][d] + c["sizes"][d]]) for ix, d in zip(index, dims)]
        for cell in itertools.product(*ranges):
            o = owner.setdefault(cell, c)
            if o is not c:
                return o, c
    return None


def _overlap_sweep(chunks: list[Chunk], dims: list[int]) -> tuple[Chunk, Chunk] | None:
    """Chunks irregular in three or more dimensions (no sharding torch makes): a sweep along the first
    dimension, each chunk compared with those it meets there; quadratic at worst."""
    a, rest = dims[0], dims[1:]
    active: list[tuple[int, int, Chunk]] = []  # heap: (end along a, order, chunk)
    for n, c in enumerate(sorted(chunks, key=lambda c: c["offsets"][a])):
        pos = c["offsets"][a]
        while active and active[0][0] <= pos:
            heapq.heappop(active)
        for _, _, o in active:
            if all(o["offsets"][d] < c["offsets"][d] + c["sizes"][d] and c["offsets"][d] < o["offsets"][d] + o["sizes"][d] for d in rest):
                return o, c
        heapq.heappush(active, (pos + c["sizes"][a], n, c))
    return None
