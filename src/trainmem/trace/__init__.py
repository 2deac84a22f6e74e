"""Trace a real training step on tensors without data: every allocation, as CUDA would see it.

The package is callable: ``trainmem.trace(model, step_fn=None, steps=2, **training_options)`` is
``trainmem.trace.api.trace`` (imported lazily: it needs torch). The building blocks are the
caching-allocator simulation (:mod:`.allocator`), the allocation tracker (:mod:`.tracker`) and the
CUDA emulation for machines without a GPU (:mod:`.cuda`).
"""
from ..callable_package import make_callable
from ..allocator import CachingAllocator, ExactAllocator, SimulatedOutOfMemory, round_size, segment_size

__all__ = ["trace", "CachingAllocator", "ExactAllocator", "SimulatedOutOfMemory", "round_size", "segment_size"]


def trace(*args, **kwargs):
    """See :func:`trainmem.trace.api.trace`."""
    from .api import trace as _trace
    return _trace(*args, **kwargs)


make_callable(__name__, "trainmem.trace.api:trace")
