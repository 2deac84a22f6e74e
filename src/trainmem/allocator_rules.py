"""The CUDA caching allocator's rules and constants, in one place.

Used by the estimate (model states rounded per tensor, the simulated model load, the reserved
memory rule) and by trace's block-by-block simulator (``trainmem.trace.allocator``). Source:
PyTorch ``c10/cuda/CUDACachingAllocator.cpp`` (``kMinBlockSize``, ``kSmallSize``,
``kSmallBuffer``, ``kLargeBuffer``, ``kMinLargeAlloc``, ``kRoundLarge``; ``round_size``,
``get_allocation_size``, ``shouldSplit``).

``block_bytes`` works on Python integers and on numpy integer arrays alike (the planner evaluates
the estimate engine on arrays of layouts). Its ``expandable`` argument selects the rule of
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``TrainingSpec.expandable_segments``), which
``trainmem.allocator.CachingAllocator(expandable_segments=True)`` simulates block by block.
"""
from __future__ import annotations

from typing import Any

import numpy as np

MiB = 1 << 20
MIN_BLOCK = 512                # kMinBlockSize: every block is a multiple of this
SMALL_SIZE = 1 * MiB           # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 * MiB         # kSmallBuffer: segment size of the small pool
LARGE_BUFFER = 20 * MiB        # kLargeBuffer: segment for large requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB     # kMinLargeAlloc: from here a segment is the request rounded to ROUND_LARGE
ROUND_LARGE = 2 * MiB          # kRoundLarge

#: reserved - allocated at the peak = peak // OVERHEAD_DIVISOR (about 3%; see ``reserved_overhead``)
OVERHEAD_DIVISOR = 32


def round_size(nbytes: int) -> int:
    """The block size PyTorch uses for a request of ``nbytes`` (512 B granularity, 512 B minimum)."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((nbytes + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """The size of the segment (``cudaMalloc``) a rounded request needs when nothing cached fits."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


def splits(small: bool, remaining: int) -> bool:
    """``shouldSplit`` without ``max_split_size``: a small block is split when at least 512 B
    remain, a large one when more than 1 MiB remains."""
    return remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE


def block_bytes(nbytes: Any, expandable: Any = False) -> Any:
    """Bytes the caching allocator charges a fresh request of ``nbytes`` (int or int64 array).

    Default allocator: requests round up to 512 B. A request of 10 MiB or more gets a segment
    rounded up to 2 MiB, and the block is not split when the remainder is at most 1 MiB, so it
    occupies the whole segment (a 119.23 MiB BERT-large embedding occupies 120.00 MiB).
    ``expandable`` (bool, or an int/bool array beside an array ``nbytes``): expandable segments,
    where every block is the request rounded to 512 B (:func:`expandable_block_bytes`).
    """
    if isinstance(nbytes, np.ndarray) or isinstance(expandable, np.ndarray):
        x = np.asarray(nbytes).astype(np.int64)
        r = np.maximum(MIN_BLOCK, (x + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)
        seg = (r + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
        whole = (r >= MIN_LARGE_ALLOC) & (seg - r <= SMALL_SIZE)   # the default allocator's unsplit segment
        out = np.where(whole & ~np.asarray(expandable, dtype=bool), seg, r)
        return np.where(x <= 0, 0, out)
    if expandable:
        return expandable_block_bytes(nbytes)
    if nbytes <= 0:
        return 0
    rounded = max(MIN_BLOCK, (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)
    if rounded < MIN_LARGE_ALLOC:
        return rounded
    seg = (rounded + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
    return seg if seg - rounded <= SMALL_SIZE else rounded


def expandable_block_bytes(nbytes: Any) -> Any:
    """Bytes a request of ``nbytes`` (int or int64 array) occupies under expandable segments: the
    request rounded up to 512 B (``round_size``), 0 for 0 bytes, whatever its size.

    ``CUDACachingAllocator.cpp`` ``should_split``: ``if (block->pool->is_small ||
    CUDAAllocatorConfig::expandable_segments()) return remaining >= kMinBlockSize;`` -- with
    expandable segments a large-pool block is split like a small-pool one, so no request keeps an
    unsplit remainder, and a request that finds no free block maps only the pages it needs into its
    pool's one segment (``try_allocate_expandable_block`` is passed the rounded request, not
    ``get_allocation_size``'s 2 MiB-rounded segment), the rest of the mapped page staying a free
    block of the pool (``Note [Expandable Segments]`` in the same file: "we use 2MiB pages for our
    small pool and 20MiB pages for our large pool"; read at pytorch/pytorch 001074d2).
    ``trainmem.allocator.CachingAllocator._should_split`` models the same rule.
    """
    if isinstance(nbytes, np.ndarray):
        x = nbytes.astype(np.int64)
        return np.where(x <= 0, 0, np.maximum(MIN_BLOCK, (x + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK))
    return 0 if nbytes <= 0 else round_size(nbytes)


def reserved_overhead(peak_allocated: Any) -> Any:
    """Reserved minus allocated at the peak (int or array): blocks the allocator keeps cached
    after earlier frees, and segment rounding. A rule of thumb, 1/32 (about 3%) of the peak: the
    BERT-large notebook ("Understand GPU Memory Usage when Training Language Models") measured
    3.4% (10926 MiB reserved at a 10562.79 MiB allocated peak). ``trace`` simulates the
    allocator block by block instead."""
    return peak_allocated // OVERHEAD_DIVISOR


class LoadSimulator:
    """The caching allocator for a sequence of allocations with no frees (``model.to(device)``).

    The rules above (512 B rounding; the small pool's 2 MiB segments split when >= 512 B remain;
    large requests from 20 MiB segments below 10 MiB, else a segment rounded to 2 MiB; a large
    block split only when more than 1 MiB remains; best fit), reduced to what a free-less
    sequence needs: the sizes of the free remainders.
    """

    def __init__(self) -> None:
        self.small: list[int] = []
        self.large: list[int] = []
        self.allocated = 0

    def allocate(self, nbytes: int) -> None:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.small if small else self.large
        fits = [b for b in pool if b >= size]
        if fits:
            block = min(fits)
            pool.remove(block)
        else:
            block = segment_size(size)
        rest = block - size
        if splits(small, rest):
            pool.append(rest)
            self.allocated += size
        else:
            self.allocated += block

    def signature(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(sorted(self.small)), tuple(sorted(self.large))

    def prune(self, min_small: int, min_large: int) -> None:
        """Forget free remainders smaller than every request still to come in their pool: best fit
        can never pick them, so dropping them changes no outcome (and lets layers repeat)."""
        self.small = [b for b in self.small if b >= min_small]
        self.large = [b for b in self.large if b >= min_large]


def placed_bytes(before: tuple[int, ...], layer: tuple[int, ...], layers: int, after: tuple[int, ...],
                 expandable: bool = False) -> int:
    """Allocated bytes after ``model.to("cuda")`` places tensors in order into an empty allocator:
    ``before`` the layers, ``layers`` copies of one ``layer``, then ``after``. Blocks carved from
    earlier segments can keep an unsplit remainder of up to 1 MiB, so the total exceeds the sum of
    rounded sizes (Edward Rees, "Transformer Memory Arithmetic", calls them gaps). Once the free
    remainders after a layer repeat an earlier layer's, the rest is extrapolated exactly.
    ``expandable``: expandable segments split every block, so there are no gaps: the sum of
    :func:`expandable_block_bytes`."""
    if expandable:
        return (sum(expandable_block_bytes(x) for x in before + after)
                + layers * sum(expandable_block_bytes(x) for x in layer))
    sim = LoadSimulator()
    for x in before:
        sim.allocate(x)
    future = [round_size(x) for x in layer + after]
    huge = 1 << 62
    min_small = min((r for r in future if r <= SMALL_SIZE), default=huge)
    min_large = min((r for r in future if r > SMALL_SIZE), default=huge)
    seen: dict[tuple, tuple[int, int]] = {}
    i = 0
    while i < layers:
        sim.prune(min_small, min_large)
        sig = sim.signature()
        if sig in seen:
            j, alloc_j = seen[sig]
            period, per_period = i - j, sim.allocated - alloc_j
            cycles = (layers - i) // period
            sim.allocated += cycles * per_period
            i += cycles * period
            seen = {}
            if i >= layers:
                break
        seen[sig] = (i, sim.allocated)
        for x in layer:
            sim.allocate(x)
        i += 1
    for x in after:
        sim.allocate(x)
    return sim.allocated
