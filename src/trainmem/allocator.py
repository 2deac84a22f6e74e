"""A simulation of PyTorch's CUDA caching allocator (one device; a pool per stream).

It reproduces what ``torch.cuda.memory_allocated()`` and ``torch.cuda.memory_reserved()`` report
for a sequence of allocations and frees, without a GPU. The rules modelled are those of
``c10/cuda/CUDACachingAllocator.cpp`` with the default configuration:

* **Rounding.** A request of ``n`` bytes becomes a block of ``max(512, 512 * ceil(n / 512))``
  bytes. A request of 0 bytes takes no block at all (PyTorch hands out a null pointer).
* **Two pools.** Rounded requests of at most 1 MiB come from the *small* pool, larger ones from
  the *large* pool. A pool never serves the other pool's requests.
* **Segments.** When no cached free block fits, a new segment is obtained from the device
  ("cudaMalloc"): 2 MiB for a small request, 20 MiB for a large request below 10 MiB, otherwise
  the request rounded up to a multiple of 2 MiB.
* **Best fit.** A request takes the smallest cached free block of its pool that is large enough;
  among equal sizes the one at the lowest address.
* **Splitting.** A small-pool block is split when at least 512 B would remain; a large-pool block
  only when *more than* 1 MiB would remain (and the request is below ``max_split_size``).
  Otherwise the whole block is handed out, and counts as allocated in full — the reason the
  119.23 MiB word-embedding matrix of BERT-large occupies 120.00 MiB.
* **Coalescing.** A freed block merges with free neighbours of the same segment.
* **Streams.** A block is only reused by the stream it was allocated on: ``BlockComparatorSize``
  orders a pool's free blocks by stream first and ``get_free_block`` searches from (stream, size)
  and stops at another stream's blocks (``CUDACachingAllocator.cpp``), so each stream has pools of
  its own and the memory one stream cached is reserved but not usable by another. The stream is
  :attr:`CachingAllocator.current_stream` when ``allocate`` is called (trace's CUDA emulation sets it
  inside ``torch.cuda.stream(s)``: FSDP2's all-gather and reduce-scatter buffers).
* **Frees another stream still uses** (``Tensor.record_stream``). A block whose tensor was recorded
  on a stream other than its own is not returned to its pool when freed: ``free`` calls
  ``insert_events`` (an event recorded on each such stream) and the block rejoins its pool only when a
  later ``malloc`` finds those events complete (``process_events``); meanwhile it counts as reserved
  but not as allocated (``CUDACachingAllocator.cpp``: ``recordStream`` adds to ``stream_uses``,
  ``free`` -> ``insert_events``, ``malloc`` -> ``process_events`` -> ``free_block``). When a new
  segment does not fit the device, ``release_cached_blocks`` first waits for every pending event
  (``synchronize_and_free_events``). Modelled by :meth:`CachingAllocator.free_pending` (the free)
  and :meth:`CachingAllocator.release` (the events found complete): when they complete is the
  caller's model of how far the GPU lags behind the CPU (``estimate/reserved/``, FSDP1).
* **Caching.** Freed blocks stay reserved. ``empty_cache()`` returns every segment that is
  entirely free. When a device capacity is given and a new segment would exceed it, the allocator
  first releases cached segments (as PyTorch does before raising out-of-memory) and retries;
  if that is not enough, :class:`SimulatedOutOfMemory` is raised.
* **max_split_size** (``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N``): unlimited by default.
  When set, blocks of at least that size are never split, requests below it are not served by
  such blocks, and a request of at least that size accepts a cached block at most 20 MiB larger.

``expandable_segments=True`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) models the
allocator's virtual-memory mode: each pool has one segment that reserves a large address range and
maps physical memory into it in pages (2 MiB for the small pool, 20 MiB for the large pool) only as
needed. Blocks of such a segment are split whenever at least 512 B remain (no 1 MiB rule); new
memory is mapped at the lowest address where free plus unmapped space can hold the request, so
the free tail of the mapped range is reused; ``reserved`` is the mapped memory; ``empty_cache()``
unmaps every page that lies wholly inside a free block. Not modelled: page-by-page physical
allocation failure mid-request, peer access, IPC, CUDA graphs' private pools,
``garbage_collection_threshold`` and ``roundup_power2_divisions``.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

from .allocator_rules import (LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER,  # noqa: F401
                               SMALL_SIZE, MiB, round_size, segment_size, splits)

KiB = 1024


class SimulatedOutOfMemory(RuntimeError):
    """The simulated device could not satisfy a request, even after releasing cached segments."""

    def __init__(self, requested: int, allocated: int, reserved: int, capacity: int) -> None:
        self.requested, self.allocated, self.reserved, self.capacity = requested, allocated, reserved, capacity
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {requested} B with {allocated} B allocated, "
            f"{reserved} B reserved, capacity {capacity} B")


class _Block:
    __slots__ = ("addr", "size", "requested", "allocated", "prev", "next", "small", "mapped",
                 "expandable", "handle", "tag", "stream")

    def __init__(self, addr: int, size: int, small: bool, expandable: bool = False, mapped: bool = True,
                 stream: int = 0) -> None:
        self.stream = stream
        self.addr = addr
        self.size = size
        self.requested = 0
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.small = small
        self.mapped = mapped
        self.expandable = expandable
        self.handle: int | None = None
        self.tag: Any = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _SortedBlocks:
    """Blocks ordered by a key (size then address, or address only), like a std::set."""

    def __init__(self, by_size: bool) -> None:
        self._by_size = by_size
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[tuple[int, int], _Block] = {}

    def _key(self, b: _Block) -> tuple[int, int]:
        return (b.size, b.addr) if self._by_size else (b.addr, 0)

    def add(self, b: _Block) -> None:
        k = self._key(b)
        if k in self._blocks:
            raise AssertionError("block already in pool")
        bisect.insort(self._keys, k)
        self._blocks[k] = b

    def remove(self, b: _Block) -> None:
        k = self._key(b)
        i = bisect.bisect_left(self._keys, k)
        if i >= len(self._keys) or self._keys[i] != k:
            raise AssertionError("block not in pool")
        del self._keys[i]
        del self._blocks[k]

    def discard(self, b: _Block) -> bool:
        k = self._key(b)
        if k not in self._blocks:
            return False
        self.remove(b)
        return True

    def index_at_least(self, size: int) -> int:
        return bisect.bisect_left(self._keys, (size, -1))

    def at(self, i: int) -> _Block:
        return self._blocks[self._keys[i]]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[_Block]:
        return (self._blocks[k] for k in list(self._keys))


@dataclass
class AllocatorStats:
    """Counters of the simulated allocator, named after ``torch.cuda.memory_stats()``."""

    allocated: int = 0            # bytes of blocks in use (memory_allocated)
    reserved: int = 0             # bytes of segments / mapped pages (memory_reserved)
    requested: int = 0            # bytes the program asked for (before rounding)
    peak_allocated: int = 0
    peak_reserved: int = 0
    peak_requested: int = 0
    active_blocks: int = 0
    num_allocs: int = 0
    num_frees: int = 0
    num_device_alloc: int = 0     # cudaMalloc calls / page mappings
    num_device_free: int = 0      # cudaFree calls / page unmappings
    num_alloc_retries: int = 0
    num_ooms: int = 0
    pending: int = 0              # bytes freed but awaiting another stream's events (record_stream)

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Pool:
    small: bool
    stream: int = 0
    free: _SortedBlocks = field(default_factory=lambda: _SortedBlocks(by_size=True))
    unmapped: _SortedBlocks = field(default_factory=lambda: _SortedBlocks(by_size=False))


class CachingAllocator:
    """Simulated ``torch.cuda`` caching allocator; see the module docstring for the rules.

    ``allocate(nbytes)`` returns a handle (an int, or None for 0 bytes); ``free(handle)`` gives the
    block back. ``allocated``/``reserved`` and their peaks mirror ``torch.cuda.memory_allocated``,
    ``memory_reserved``, ``max_memory_allocated`` and ``max_memory_reserved``.
    """

    #: where simulated segments start; segments are spaced apart so that neighbours never touch
    _BASE = 0x7F00_0000_0000

    def __init__(self, *, expandable_segments: bool = False, max_split_size: int | None = None,
                 capacity: int | None = None, address_space: int | None = None) -> None:
        if max_split_size is not None and max_split_size <= 0:
            raise ValueError("max_split_size must be positive (None means unlimited)")
        self.expandable_segments = expandable_segments
        self.max_split_size = max_split_size if max_split_size is not None else 1 << 62
        self.capacity = capacity
        self.stats = AllocatorStats()
        self.current_stream = 0  # the stream new requests are made on (0: the default stream)
        self._pools: dict[int, tuple[_Pool, _Pool]] = {}  # stream -> (small pool, large pool)
        self._live: dict[int, _Block] = {}
        self._pending: dict[int, _Block] = {}  # token -> a block freed while another stream uses it
        self._free_ticks = 0                    # pending frees made so far (the latest token)
        self._handles = itertools.count(1)
        self._next_addr = self._BASE
        # expandable mode: one reserved address range per pool
        self._address_space = address_space or (capacity + capacity // 8 if capacity else 1 << 40)
        self._es_base: dict[tuple[int, bool], int] = {}

    # ----- public ------------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        return self.stats.allocated

    @property
    def reserved(self) -> int:
        return self.stats.reserved

    @property
    def peak_allocated(self) -> int:
        return self.stats.peak_allocated

    @property
    def peak_reserved(self) -> int:
        return self.stats.peak_reserved

    @property
    def num_segments(self) -> int:
        """Segments as ``torch.cuda.memory_snapshot()`` lists them (contiguous mapped ranges)."""
        return len(self.segments())

    def reset_peak(self) -> None:
        s = self.stats
        s.peak_allocated, s.peak_reserved, s.peak_requested = s.allocated, s.reserved, s.requested

    def block_size(self, handle: int | None) -> int:
        """Bytes the block of ``handle`` occupies (what it adds to ``allocated``)."""
        return 0 if handle is None else self._live[handle].size

    def block_stream(self, handle: int | None) -> int:
        """The stream the block of ``handle`` was allocated on (its pool's)."""
        return 0 if handle is None else self._live[handle].stream

    def requested_size(self, handle: int | None) -> int:
        """Bytes the request of ``handle`` asked for (before rounding to its block)."""
        return 0 if handle is None else self._live[handle].requested

    def allocate(self, nbytes: int, tag: Any = None, stream: int | None = None) -> int | None:
        """Allocate ``nbytes`` on ``stream`` (default :attr:`current_stream`); returns a handle for
        :meth:`free` (None for a 0-byte request)."""
        if nbytes < 0:
            raise ValueError("cannot allocate a negative number of bytes")
        if nbytes == 0:
            return None
        size = round_size(nbytes)
        pool = self._pool(self.current_stream if stream is None else stream, size <= SMALL_SIZE)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._new_memory(pool, size, nbytes)
        if self._should_split(block, size):
            block = self._split(pool, block, size)
        block.allocated = True
        block.requested = nbytes
        block.tag = tag
        h = next(self._handles)
        block.handle = h
        self._live[h] = block
        s = self.stats
        s.allocated += block.size
        s.requested += nbytes
        s.active_blocks += 1
        s.num_allocs += 1
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        s.peak_requested = max(s.peak_requested, s.requested)
        return h

    def free(self, handle: int | None) -> None:
        """Return the block of ``handle`` to its pool (it stays reserved)."""
        if handle is None:
            return
        self._to_pool(self._unlive(handle))

    def free_pending(self, handle: int | None) -> int | None:
        """Free the block of ``handle`` while another stream still uses it (``record_stream``): it
        stops counting as allocated but stays out of its pool, unusable and unmergeable, until
        :meth:`release` of the returned token (its events found complete by a later ``malloc``).
        Tokens increase in the order of the frees (:meth:`release_upto`)."""
        if handle is None:
            return None
        block = self._unlive(handle)
        block.allocated = True            # not free: neither handed out nor merged (event_count > 0)
        self._free_ticks += 1
        self._pending[self._free_ticks] = block
        self.stats.pending += block.size
        return self._free_ticks

    @property
    def pending_tick(self) -> int:
        """The token of the latest :meth:`free_pending`: an event recorded now, on the stream the
        pending frees wait for, completes after all of them (:meth:`release_upto`)."""
        return self._free_ticks

    def release_upto(self, tick: int) -> None:
        """Release every pending block whose token is at most ``tick`` (an event recorded at
        :attr:`pending_tick` = ``tick`` has completed, and the next ``malloc`` processes them)."""
        for token in [k for k in self._pending if k <= tick]:
            self.release(token)

    def release(self, token: int | None) -> None:
        """A block freed by :meth:`free_pending` rejoins its pool (``process_events`` -> ``free_block``)."""
        block = self._pending.pop(token, None) if token is not None else None
        if block is None:
            return
        self.stats.pending -= block.size
        self._to_pool(block)

    def release_all(self) -> None:
        """Every pending block rejoins its pool (``synchronize_and_free_events``)."""
        for token in list(self._pending):
            self.release(token)

    def _unlive(self, handle: int) -> _Block:
        """Take the block of ``handle`` out of use: the counters of a free."""
        block = self._live.pop(handle)
        s = self.stats
        s.allocated -= block.size
        s.requested -= block.requested
        s.active_blocks -= 1
        s.num_frees += 1
        block.handle = None
        block.tag = None
        block.requested = 0
        return block

    def _to_pool(self, block: _Block) -> None:
        """Put a freed block back into its pool, merged with its free neighbours."""
        block.allocated = False
        pool = self._pool(block.stream, block.small)
        for other in (block.prev, block.next):
            self._try_merge(pool, block, other)
        pool.free.add(block)

    def empty_cache(self) -> None:
        """Release every entirely free segment (and, with expandable segments, free pages)."""
        for small, large in self._pools.values():
            self._release_blocks(large)
            self._release_blocks(small)

    def segments(self) -> list[dict[str, Any]]:
        """Segments with their blocks, like ``torch.cuda.memory_snapshot()``, sorted by address."""
        heads = []
        seen = set()
        for b in self._all_blocks():
            if not b.mapped:
                continue
            head = b
            while head.prev is not None and head.prev.mapped:
                head = head.prev
            if head.addr in seen:
                continue
            seen.add(head.addr)
            heads.append(head)
        out = []
        for head in sorted(heads, key=lambda b: b.addr):
            blocks = []
            b: _Block | None = head
            total = used = 0
            while b is not None and b.mapped:
                in_use = b.allocated and b.handle is not None    # else freed, awaiting events
                state = "active_allocated" if in_use else ("active_pending_free" if b.allocated else "inactive")
                blocks.append({"address": b.addr, "size": b.size, "requested_size": b.requested,
                               "state": state, "tag": b.tag})
                total += b.size
                used += b.size if in_use else 0
                b = b.next
            out.append({"address": head.addr, "total_size": total, "allocated_size": used,
                        "segment_type": "small" if head.small else "large", "stream": head.stream,
                        "is_expandable": head.expandable, "blocks": blocks})
        return out

    def live_blocks(self) -> Iterator[tuple[int, int, int, Any]]:
        """(handle, block size, requested bytes, tag) of every block in use."""
        for h, b in self._live.items():
            yield h, b.size, b.requested, b.tag

    # ----- internals ---------------------------------------------------------------------------
    def _all_blocks(self) -> Iterator[_Block]:
        yield from self._live.values()
        yield from self._pending.values()
        for pools in self._pools.values():
            for pool in pools:
                yield from pool.free

    def _pool(self, stream: int, small: bool) -> _Pool:
        """The small or large pool of ``stream`` (made at its first request)."""
        if stream not in self._pools:
            self._pools[stream] = (_Pool(small=True, stream=stream), _Pool(small=False, stream=stream))
        return self._pools[stream][0 if small else 1]

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        free = pool.free
        i = free.index_at_least(size)
        if i >= len(free):
            return None
        if free.at(i).expandable:
            # best fit over what a block could grow to: prefer a block that is not the free tail
            # in front of unmapped address space (which could take anything)
            def grow(b: _Block) -> int:
                return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
            while i + 1 < len(free) and free.at(i).expandable and grow(free.at(i + 1)) < grow(free.at(i)):
                i += 1
        b = free.at(i)
        mss = self.max_split_size
        if size < mss and b.size >= mss:
            return None
        if size >= mss and b.size >= size + LARGE_BUFFER:
            return None
        free.remove(b)
        return b

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or block.expandable:  # expandable segments split like the small pool
            return splits(True, remaining)
        return size < self.max_split_size and splits(False, remaining)

    def _split(self, pool: _Pool, block: _Block, size: int) -> _Block:
        """Cut ``size`` bytes off the front of ``block``; the rest goes back to the pool."""
        front = _Block(block.addr, size, block.small, block.expandable, stream=block.stream)
        front.prev = block.prev
        if front.prev is not None:
            front.prev.next = front
        front.next = block
        block.prev = front
        block.addr += size
        block.size -= size
        pool.free.add(block)
        return front

    def _try_merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.free.remove(src)
        else:
            pool.unmapped.remove(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _fits_device(self, extra: int) -> bool:
        return self.capacity is None or self.stats.reserved + extra <= self.capacity

    def _new_memory(self, pool: _Pool, size: int, nbytes: int) -> _Block:
        """Get memory from the device, releasing the cache and retrying once if it is full."""
        block = self._device_alloc(pool, size)
        if block is None:
            self.stats.num_alloc_retries += 1
            self.release_all()    # release_cached_blocks: synchronize_and_free_events first
            self.empty_cache()
            block = self._device_alloc(pool, size)
        if block is None:
            self.stats.num_ooms += 1
            need = segment_size(size) if not self.expandable_segments else size
            raise SimulatedOutOfMemory(need, self.stats.allocated, self.stats.reserved, self.capacity or 0)
        return block

    def _device_alloc(self, pool: _Pool, size: int) -> _Block | None:
        if self.expandable_segments:
            return self._expand(pool, size)
        seg = segment_size(size)
        if not self._fits_device(seg):
            return None
        addr = self._next_addr
        self._next_addr += seg + 64 * MiB  # leave a gap: segments are never adjacent
        block = _Block(addr, seg, pool.small, stream=pool.stream)
        s = self.stats
        s.reserved += seg
        s.num_device_alloc += 1
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return block

    def _release_blocks(self, pool: _Pool) -> None:
        for b in list(pool.free):
            if b.expandable:
                self._unmap(pool, b)
            elif b.prev is None and b.next is None:
                pool.free.remove(b)
                self.stats.reserved -= b.size
                self.stats.num_device_free += 1

    # ----- expandable segments -------------------------------------------------------------------
    def _page(self, pool: _Pool) -> int:
        return SMALL_BUFFER if pool.small else LARGE_BUFFER

    def _expandable_base(self, pool: _Pool) -> int:
        key = (pool.stream, pool.small)
        if key not in self._es_base:
            page = self._page(pool)
            space = ((self._address_space + page - 1) // page) * page
            base = self._next_addr
            self._next_addr += space + 64 * MiB
            self._es_base[key] = base
            whole = _Block(base, space, pool.small, expandable=True, mapped=False, stream=pool.stream)
            pool.unmapped.add(whole)
        return self._es_base[key]

    def _expand(self, pool: _Pool, size: int) -> _Block | None:
        base = self._expandable_base(pool)
        page = self._page(pool)
        # lowest address where free + unmapped space can hold the request
        candidate = None
        for u in pool.unmapped:
            c = u
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                candidate = c
                break
        if candidate is None:
            return None
        # physical pages needed for the part of the request that is not yet mapped
        need = 0
        b = candidate
        covered = 0
        while covered < size and b is not None:
            if not b.mapped:
                start = b.addr
                end = min(b.addr + b.size, candidate.addr + size)
                lo = (start - base) // page
                hi = -(-(end - base) // page)
                need += (hi - lo) * page
            covered = b.addr + b.size - candidate.addr
            b = b.next
        if not self._fits_device(need):
            return None
        if not candidate.mapped:
            candidate = self._map(pool, candidate, min(candidate.size, size), base, page)
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped
            # the newly mapped pages merge with the free candidate in front of them
            candidate = self._map(pool, nxt, min(size - candidate.size, nxt.size), base, page)
        pool.free.remove(candidate)
        return candidate

    def _map(self, pool: _Pool, block: _Block, size: int, base: int, page: int) -> _Block:
        """Map whole pages at the front of unmapped ``block`` covering ``size`` bytes."""
        pool.unmapped.remove(block)
        end = base + -(-(block.addr + size - base) // page) * page
        mapped_size = min(end - block.addr, block.size)
        if mapped_size < block.size:
            rest = _Block(block.addr + mapped_size, block.size - mapped_size, pool.small,
                          expandable=True, mapped=False, stream=pool.stream)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pool.unmapped.add(rest)
            block.size = mapped_size
        block.mapped = True
        s = self.stats
        s.reserved += mapped_size
        s.num_device_alloc += 1
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        for other in (block.prev, block.next):
            self._try_merge(pool, block, other)
        pool.free.add(block)
        return block

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """Unmap the pages lying wholly inside free ``block``."""
        base = self._es_base[(pool.stream, pool.small)]
        page = self._page(pool)
        lo = base + -(-(block.addr - base) // page) * page
        hi = base + ((block.addr + block.size - base) // page) * page
        if hi <= lo:
            return
        pool.free.remove(block)
        if lo > block.addr:
            before = _Block(block.addr, lo - block.addr, pool.small, expandable=True, stream=pool.stream)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            pool.free.add(before)
        if hi < block.addr + block.size:
            after = _Block(hi, block.addr + block.size - hi, pool.small, expandable=True, stream=pool.stream)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.free.add(after)
        block.addr, block.size, block.mapped = lo, hi - lo, False
        self.stats.reserved -= block.size
        self.stats.num_device_free += 1
        for other in (block.prev, block.next):
            self._try_merge(pool, block, other)
        pool.unmapped.add(block)


class ExactAllocator:
    """Byte-exact accounting with no caching, for host (CPU) memory: allocated = sum of requests.

    Same interface as :class:`CachingAllocator`; ``reserved`` equals ``allocated``.
    """

    expandable_segments = False

    def __init__(self) -> None:
        self.current_stream = 0  # host memory has no streams: kept for the interface
        self.stats = AllocatorStats()
        self._live: dict[int, tuple[int, Any]] = {}
        self._handles = itertools.count(1)

    @property
    def allocated(self) -> int:
        return self.stats.allocated

    @property
    def reserved(self) -> int:
        return self.stats.allocated

    @property
    def peak_allocated(self) -> int:
        return self.stats.peak_allocated

    @property
    def peak_reserved(self) -> int:
        return self.stats.peak_allocated

    @property
    def num_segments(self) -> int:
        return len(self._live)

    def reset_peak(self) -> None:
        self.stats.peak_allocated = self.stats.allocated
        self.stats.peak_requested = self.stats.requested

    def block_size(self, handle: int | None) -> int:
        return 0 if handle is None else self._live[handle][0]

    def block_stream(self, handle: int | None) -> int:
        return 0  # host memory has no streams: nothing waits for another stream

    def requested_size(self, handle: int | None) -> int:
        return self.block_size(handle)  # no rounding: the block is the request

    pending_tick = 0

    def release_upto(self, tick: int) -> None:
        pass

    def release_all(self) -> None:
        pass

    def allocate(self, nbytes: int, tag: Any = None, stream: int | None = None) -> int | None:
        if nbytes < 0:
            raise ValueError("cannot allocate a negative number of bytes")
        if nbytes == 0:
            return None
        h = next(self._handles)
        self._live[h] = (nbytes, tag)
        s = self.stats
        s.allocated += nbytes
        s.requested += nbytes
        s.active_blocks += 1
        s.num_allocs += 1
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        s.peak_requested = s.peak_allocated
        return h

    def free(self, handle: int | None) -> None:
        if handle is None:
            return
        nbytes, _ = self._live.pop(handle)
        s = self.stats
        s.allocated -= nbytes
        s.requested -= nbytes
        s.active_blocks -= 1
        s.num_frees += 1

    def empty_cache(self) -> None:
        pass

    def segments(self) -> list[dict[str, Any]]:
        return []

    def live_blocks(self) -> Iterator[tuple[int, int, int, Any]]:
        for h, (n, tag) in self._live.items():
            yield h, n, n, tag
