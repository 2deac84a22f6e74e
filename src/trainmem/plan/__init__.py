"""Fit, sweep and plan: make a training run fit a GPU, and show it.

* ``fit(model, gpu=..., seq_len=...)`` — the largest micro-batch that fits (or, with
  ``batch_size=...``, the longest sequence); exact search over the estimator.
* ``suggest(model, **options)`` — every single change that lowers the memory, estimated and
  sorted by its cost to the user (the hook ``estimate --gpu`` prints when a setup is short).
* ``sweep(model, batch_sizes, seq_lens, ...)`` — a grid of reports (``render.plots`` draws it).
* ``plan(model, gpus, seq_len, global_batch, gpu=...)`` — every parallel layout of a cluster, the
  ones that fit, ranked by a documented step-time model (needs numpy).

The planner (and numpy) load on first use, so that ``trainmem`` and its CLI load without numpy.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

# fit, suggest and sweep need no numpy: imported now (which also binds the package names to the
# functions rather than to the submodules of the same name); the planner on first use.
from .fit import FitResult, fit
from .suggest import Suggestion, format_suggestions, suggest, suggest_for_report
from .sweep import SweepCell, SweepResult, sweep

_LAZY = {"plan": "planner", "PlanResult": "planner", "Layout": "planner"}

__all__ = ["fit", "FitResult", "suggest", "suggest_for_report", "Suggestion", "format_suggestions", "sweep",
           "SweepResult", "SweepCell", "plan", "PlanResult", "Layout"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            mod = import_module(f"{__name__}.{_LAZY[name]}")
        except ModuleNotFoundError as e:
            if e.name == "numpy":
                from ..errors import TrainmemError
                raise TrainmemError("trainmem plan needs numpy: pip install numpy") from None
            raise
        value = getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
