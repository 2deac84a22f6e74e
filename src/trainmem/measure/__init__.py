"""Measurements of real runs. ``live``: ``LiveBytes``, live/peak bytes of real tensors on any device
(the CPU included), checked against the PyTorch profiler's allocator events; ``probes``: where a
measured number comes from (CPU: LiveBytes; CUDA: the caching allocator, NVML) and the phase
recorder; ``runner``: real training steps recorded phase by phase (``trainmem measure``), the
largest micro-batch that runs, validation fixtures; ``compare``: estimate | trace | measure side
by side (``trainmem compare``). The commands live in ``trainmem.cli.measure``, the text in
``trainmem.render.measure``.

Attributes are imported lazily so that importing the package (e.g. for the CLI) does not import torch.
"""
from importlib import import_module

_LAZY = {"LiveBytes": "live", "Mark": "live", "profiler_peak": "live", "storage_preserved": "live",
         "measure": "runner", "find_max_batch": "runner", "fixture": "runner",
         "compare_sources": "compare", "compare_reports": "compare", "render_comparison": "compare"}  # re-exported from render.measure

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
