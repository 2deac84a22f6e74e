"""trainmem: how much GPU memory will this training run take, where does it go, will it fit?"""
from .errors import TrainmemError
from .report import MemoryReport, Component, Phase, compare
from .spec import ModelSpec, TrainingSpec, Hardware, resolve_model, get_gpu
from .spec.resolve import Resolved, resolve

__version__ = "0.1.0"
from . import estimate  # callable package: trainmem.estimate(model, **options)
from . import trace  # callable package: trainmem.trace(model, step_fn=None, steps=2, **options)


__all__ = ["TrainmemError", "MemoryReport", "Component", "Phase", "compare", "ModelSpec",
           "TrainingSpec", "Hardware", "resolve_model", "get_gpu", "Resolved", "resolve", "estimate", "trace",
           "__version__"]
