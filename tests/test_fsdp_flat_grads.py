"""FSDP2's sharded gradients of a unit are one flat reduce-scatter output (``reserved.optimizer._flat_grads``;
torch 2.13 ``_fully_shard/_fsdp_collectives.py`` ``foreach_reduce``: ``reduce_scatter_input.new_empty(
(reduce_scatter_output_numel,))``): its size is the unit's shard elements once, not the sum of each
gradient's allocator block. The root unit of a Llama-shaped model (vocabulary 8000 x 1024, over 2 ranks)
reduces 31.25 MiB (two 15.625 MiB shards and the norm's); summing the per-tensor blocks (16 MiB each)
asked for 32.002 MiB, which opens a 34 MiB segment where trace opens 32."""
from __future__ import annotations

import pytest

import trainmem
from trainmem import allocator
from trainmem.trace.api import trace

from test_forward_cast_cache import DEEP, KW


def _off_stream_requests(run) -> list[tuple[int, int]]:
    """Every request of 8 MiB and over made off the default stream (all-gather, reduce-scatter): (stream,
    bytes), in order."""
    seen: list[tuple[int, int]] = []
    orig = allocator.CachingAllocator.allocate

    def spy(self, nbytes, tag=None, stream=None):
        where = self.current_stream if stream is None else stream
        if where != 0 and nbytes >= 8 * 2**20:
            seen.append((where, nbytes))
        return orig(self, nbytes, tag, stream)
    allocator.CachingAllocator.allocate = spy
    try:
        run()
    finally:
        allocator.CachingAllocator.allocate = orig
    return seen


def test_the_flat_reduce_scatter_outputs_are_traces(one_torch_thread):
    est = _off_stream_requests(lambda: trainmem.estimate(DEEP, **KW))
    tr = _off_stream_requests(lambda: trace(DEEP, **KW))
    # the backward's last reduce-scatter is the root unit's (embedding, final norm, head), fp32 shards
    assert tr[-1][1] == pytest.approx((2 * 4000 * 1024 + 512) * 4, abs=512)
    assert est[-1][1] == pytest.approx(tr[-1][1], abs=512)      # (32.002 MiB before: 16 MiB blocks summed)
    rs = [n for w, n in tr if w == tr[-1][0]]                    # every unit's, both steps
    assert [n for w, n in est if w == est[-1][0]] == pytest.approx(rs, abs=512)
