"""Inputs: the model's architecture, the training setup, the GPU, and the one resolver of them
(``trainmem.spec.resolve``: ``resolve(model, **options) -> Resolved``; the function is not bound
here, so that ``trainmem.spec.resolve`` stays the module)."""
from .model import ModelSpec, ParamTensor, BufferTensor
from .training import TrainingSpec, check_against
from .hardware import Hardware, get_gpu, gpu_names, catalogue, catalogue_table
from .config import resolve_model, load_config, spec_from_config, catalogue_names, apply_overrides
from .resolve import Resolved

__all__ = ["ModelSpec", "ParamTensor", "BufferTensor", "TrainingSpec", "check_against", "Hardware",
           "get_gpu", "gpu_names", "catalogue", "catalogue_table", "resolve_model", "load_config",
           "spec_from_config", "catalogue_names", "apply_overrides", "Resolved"]
