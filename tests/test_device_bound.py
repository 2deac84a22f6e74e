"""The estimate's replayed reserved memory is bounded by the GPU (estimate/api.py ``_bound_by_device``):
the caching allocator frees its cache and retries before it holds more than the device has."""
from __future__ import annotations

import trainmem

SETUP = dict(batch_size=4, seq_len=1024, precision="bf16-amp", recompute="full")
MiB = 2**20


def _unbounded():
    return trainmem.estimate("llama-3.2-1b", **SETUP)


def test_reserved_above_the_device_is_cut_to_it_with_one_warning():
    free = _unbounded()
    assert free.peak_reserved > free.peak_allocated + 64 * MiB   # the replay leaves a cache to cut
    context = 500 * MiB
    room = (free.peak_allocated + free.peak_reserved) // 2        # between allocated and replayed reserved
    r = trainmem.estimate("llama-3.2-1b", gpu_memory=f"{room + context}B", context_memory=f"{context}B", **SETUP)
    assert r.peak_allocated == free.peak_allocated
    assert r.peak_reserved == room and r.extra["replayed_reserved"] == free.peak_reserved
    assert r.device_used == room + context
    assert sum("num_alloc_retries" in w for w in r.warnings) == 1


def test_a_device_with_room_leaves_the_replay_alone():
    free = _unbounded()
    context = 500 * MiB
    r = trainmem.estimate("llama-3.2-1b", gpu_memory=f"{free.peak_reserved + context + MiB}B",
                          context_memory=f"{context}B", **SETUP)
    assert r.peak_reserved == free.peak_reserved and "replayed_reserved" not in r.extra
    assert not any("num_alloc_retries" in w for w in r.warnings)


def test_an_allocated_peak_above_the_device_is_not_cut():
    free = _unbounded()
    context = 500 * MiB
    r = trainmem.estimate("llama-3.2-1b", gpu_memory=f"{free.peak_allocated // 2 + context}B",
                          context_memory=f"{context}B", **SETUP)
    assert r.peak_reserved == free.peak_reserved and r.fits is False
