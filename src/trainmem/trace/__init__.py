"""Trace a real training step on tensors without data: every allocation, as CUDA would see it.

``trace(model, step_fn=None, steps=2, **training_options) -> MemoryReport``; the building blocks are
the caching-allocator simulation (:mod:`.allocator`), the allocation tracker (:mod:`.tracker`) and
the CUDA emulation for machines without a GPU (:mod:`.cuda`).
"""
from .allocator import CachingAllocator, ExactAllocator, SimulatedOutOfMemory, round_size, segment_size

__all__ = ["trace", "CachingAllocator", "ExactAllocator", "SimulatedOutOfMemory", "round_size", "segment_size"]


def trace(*args, **kwargs):
    """See :func:`trainmem.trace.api.trace` (imported lazily: it needs torch)."""
    from .api import trace as _trace
    return _trace(*args, **kwargs)
