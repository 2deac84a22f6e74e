"""Measurements of real runs. ``live``: ``LiveBytes``, live/peak bytes of real tensors on any device
(the CPU included), checked against the PyTorch profiler's allocator events."""
from .live import LiveBytes, Mark, profiler_peak, storage_preserved

__all__ = ["LiveBytes", "Mark", "profiler_peak", "storage_preserved"]
