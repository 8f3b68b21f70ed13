"""Whether the chunks of each global tensor cover it exactly once: no element saved twice, none missing.

Every manifest is checked before it is written (:func:`ckptd.format.build_manifest`), again by
``ckptd verify``, and by every :class:`ckptd.client.reader.CheckpointReader` that opens one (a restore: an
altered manifest must not leave part of a tensor unread): a checkpoint whose ranks disagree on a sharding
(two holders of one region under different names, a gap left by a rank that saved too little) is
refused, naming the tensor and region. Linear in the chunks when they are sound, whatever their shape.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import secrets
from typing import Any, cast

from .errors import CheckpointError

Chunk = dict[str, Any]  # a chunk entry of a manifest or fragment
_PRIME = (1 << 61) - 1  # the field :func:`_exact_cover` computes in
MANY_CHUNKS = 1024  # a tensor of more chunks is judged by :func:`_exact_cover` first (a list insert per chunk is not free)
SWEEP_BUDGET = 1 << 20  # chunk pairs :func:`_overlap_sweep` compares at most before it gives up naming one
_IRREGULAR = object()  # what :func:`_overlapping_pair` says of chunks it leaves to :func:`_exact_cover`


def check_coverage(tensors: dict[str, Any]) -> None:
    """Every global tensor is covered exactly once by its chunks; raise naming the key and region.
    O(n log n) in a tensor's chunks for the shardings torch makes (see :func:`_overlapping_pair`); linear
    for a tensor of more than :data:`MANY_CHUNKS` chunks and for chunks irregular in three or more
    dimensions (:func:`_exact_cover`), whatever a hostile manifest holds; only a tensor that fails is
    searched for the pair that overlaps (the irregular sweep within :data:`SWEEP_BUDGET` comparisons)."""
    rng = random.Random(secrets.randbits(64))  # unknown to whoever wrote the chunks
    for key, ent in tensors.items():
        chunks = [c for c in ent["chunks"] if math.prod(c["sizes"])]  # an empty chunk holds no element to overlap
        if len(chunks) > MANY_CHUNKS and _exact_cover(ent["shape"], chunks, rng):
            continue  # sound, in one pass: the search below is for naming what is wrong
        found = _overlapping_pair(chunks)
        irregular = found is _IRREGULAR
        if irregular:
            if _exact_cover(ent["shape"], chunks, rng):
                continue
            found = _overlap_sweep(chunks, _varying(chunks))
        pair = cast("tuple[Chunk, Chunk] | None", found)
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
        if irregular:  # not an exact cover, yet as many elements: some overlap (the search gave up naming them)
            raise CheckpointError(f"tensor {key!r} of shape {ent['shape']}: chunks overlap and leave as many elements out")


def _exact_cover(shape: list[int], chunks: list[Chunk], rng: random.Random) -> bool:
    """Whether ``chunks`` (boxes inside ``shape``) cover it exactly once. Their indicator functions sum to the
    tensor's if and only if every corner point gets the same signed count from the chunks as from the tensor
    (the indicator of a box is the signed sum of the steps at its corners, and those steps are linearly
    independent), that is if the polynomial ``sum over chunks of prod_d (X_d[end_d] - X_d[start_d])`` equals
    the tensor's own, in one variable per dimension and coordinate. Evaluated at a random point modulo a
    prime (Schwartz-Zippel): an exact cover always passes, any other with probability at most
    ``len(shape) / _PRIME``. O(chunks x dimensions)."""
    points: list[dict[int, int]] = [{} for _ in shape]  # per dimension: coordinate -> its variable's random value

    def at(pts: dict[int, int], v: int) -> int:
        x = pts.get(v)
        if x is None:
            x = pts[v] = rng.randrange(_PRIME)
        return x

    total = 0
    for c in chunks:
        term = 1
        for pts, o, s in zip(points, c["offsets"], c["sizes"]):
            term = term * (at(pts, o + s) - at(pts, o)) % _PRIME
        total += term
    want = 1
    for pts, g in zip(points, shape):
        want = want * (at(pts, g) - at(pts, 0)) % _PRIME
    return total % _PRIME == want


def _varying(chunks: list[Chunk]) -> list[int]:
    """The dimensions along which not every chunk spans the same extent (the others tell no two apart),
    ordered by how many distinct offsets the chunks have along them."""
    spans = [{(c["offsets"][d], c["sizes"][d]) for c in chunks} for d in range(len(chunks[0]["offsets"]))]
    return sorted((d for d, s in enumerate(spans) if len(s) > 1), key=lambda d: -len({o for o, _ in spans[d]}))


def _overlapping_pair(chunks: list[Chunk]) -> object:
    """Two of ``chunks`` (none of them empty) that share an element, or ``None``; :data:`_IRREGULAR` for
    chunks irregular in three or more dimensions (no sharding torch makes), which only a quadratic search
    tells apart. The dimensions of :func:`_varying` are searched, the first swept."""
    if len(chunks) < 2:
        return None
    dims = _varying(chunks)
    if not dims:
        return chunks[0], chunks[1]  # all alike: a scalar or a region saved twice
    if len(dims) <= 2:
        return _overlap_2d(chunks, dims[0], dims[-1])
    cuts = [sorted({c["offsets"][d] for c in chunks} | {c["offsets"][d] + c["sizes"][d] for c in chunks}) for d in dims]
    if math.prod(len(x) - 1 for x in cuts) <= 16 * len(chunks):
        return _overlap_cells(chunks, dims, cuts)
    return _IRREGULAR


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
    dimension, each chunk compared with those it meets there; quadratic at worst, so it gives up (``None``)
    after :data:`SWEEP_BUDGET` comparisons."""
    a, rest = dims[0], dims[1:]
    active: list[tuple[int, int, Chunk]] = []  # heap: (end along a, order, chunk)
    budget = SWEEP_BUDGET
    for n, c in enumerate(sorted(chunks, key=lambda c: c["offsets"][a])):
        pos = c["offsets"][a]
        while active and active[0][0] <= pos:
            heapq.heappop(active)
        budget -= len(active)
        if budget < 0:  # hostile chunks: the caller says what is wrong without naming the pair
            return None
        for _, _, o in active:
            if all(o["offsets"][d] < c["offsets"][d] + c["sizes"][d] and c["offsets"][d] < o["offsets"][d] + o["sizes"][d] for d in rest):
                return o, c
        heapq.heappush(active, (pos + c["sizes"][a], n, c))
    return None
