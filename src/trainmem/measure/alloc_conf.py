"""The caching allocator's configuration of a measured run (``TrainingSpec.expandable_segments``).

PyTorch reads ``PYTORCH_ALLOC_CONF`` or its older name ``PYTORCH_CUDA_ALLOC_CONF`` once, the first
time the allocator's configuration is used (``c10/core/AllocatorConfig.cpp``
``AcceleratorAllocatorConfig::instance``: a function-local static parsed from the environment on
first use; ``c10/cuda/CUDAAllocatorConfig.h`` ``CUDAAllocatorConfig::instance`` before 2.8), and
``torch._C._accelerator_setAllocatorSettings`` (``torch.cuda.memory._set_allocator_settings`` before
it) parses a setting string at run time ("Expandable blocks can be enabled/disabled throughout the run
of a program. When disabled, the allocator will not put new allocations in an expandable block":
``c10/cuda/CUDACachingAllocator.cpp``, Note [Expandable Segments], read at pytorch/pytorch 001074d2). With ``--expandable-segments``, ``measure`` runs in that mode: before CUDA is initialised in the
process it sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (which the ranks ``--launcher
torchrun`` spawns inherit, and each sets again) and applies the setting. It refuses, in one line, an
environment that configures the allocator otherwise and a process whose CUDA is initialised already
(its segments would be the default allocator's).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import TrainmemError

#: the variables PyTorch reads its allocator configuration from (the newer name first)
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: the setting ``--expandable-segments`` stands for (``CUDAAllocatorConfig::parseExpandableSegments``
#: accepts "True" or "False" only)
EXPANDABLE = "expandable_segments:True"


def configured(environ: Mapping[str, str]) -> dict[str, str]:
    """The allocator configuration variables set in ``environ`` (name -> value)."""
    return {k: environ[k] for k in ALLOC_CONF_VARS if environ.get(k) is not None}


def is_expandable(value: str) -> bool:
    """Whether a configuration string is exactly expandable segments on (no other setting)."""
    return [x.strip() for x in value.split(",") if x.strip()] == [EXPANDABLE]


def plan(expandable: bool, kind: str, environ: Mapping[str, str], cuda_initialized: bool) -> tuple[bool, list[str]]:
    """What measure does about the allocator's mode: (whether to switch expandable segments on,
    warnings). Raises one-line TrainmemErrors for what it cannot honour."""
    given = configured(environ)
    text = ", ".join(f"{k}={v}" for k, v in given.items())
    if not expandable:
        if any(EXPANDABLE in v.replace(" ", "") for v in given.values()):
            return False, [f"the environment sets {text}: the measured run uses expandable segments; give "
                           "--expandable-segments so that estimates compared with it model them"]
        return False, []
    if kind != "cuda":
        raise TrainmemError("--expandable-segments configures the CUDA caching allocator, which a --device cpu run "
                            "does not use: give --no-expandable-segments, or measure on --device cuda")
    if any(not is_expandable(v) for v in given.values()):
        raise TrainmemError(f"--expandable-segments runs with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}, but the "
                            f"environment sets {text}: unset it, or drop --expandable-segments")
    if given:
        return False, []  # the process was started in that mode already
    if cuda_initialized:
        raise TrainmemError("--expandable-segments: CUDA is already initialised in this process with the default "
                            f"allocator; start Python with PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}")
    return True, []


def apply(expandable: bool, kind: str) -> list[str]:
    """Put this process's allocator in the mode ``expandable`` asks for (see :func:`plan`);
    returns the warnings."""
    import torch
    switch, warnings = plan(expandable, kind, os.environ, kind == "cuda" and torch.cuda.is_initialized())
    if switch:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE  # read at first use; inherited by spawned ranks
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:  # PyTorch before the accelerator-generic allocator config
            setter = torch.cuda.memory._set_allocator_settings
        setter(EXPANDABLE)
    return warnings


def apply_cublas(config: str | None, kind: str, environ: Any = None) -> None:
    """Give the measured run ``--cublas-workspace-config``: PyTorch reads ``CUBLAS_WORKSPACE_CONFIG`` once, at
    the process's first cuBLAS call (aten/src/ATen/cuda/CublasHandlePool.cpp ``getChosenWorkspaceSize``: a
    function-local static), so it is set in the environment before the model runs (spawned ranks inherit
    it). An environment that already sets another value is refused in one line; on the CPU no cuBLAS runs."""
    environ = os.environ if environ is None else environ
    if config is None:
        return
    if kind != "cuda":
        raise TrainmemError("--cublas-workspace-config sizes the CUDA cuBLAS workspaces, which a --device cpu run "
                            "does not have: drop it, or measure on --device cuda")
    given = environ.get("CUBLAS_WORKSPACE_CONFIG")
    if given is not None and given != config:
        raise TrainmemError(f"--cublas-workspace-config {config} but the environment sets CUBLAS_WORKSPACE_CONFIG="
                            f"{given}: unset it, or give --cublas-workspace-config {given}")
    environ["CUBLAS_WORKSPACE_CONFIG"] = config


def settings() -> Any:
    """The allocator settings PyTorch parsed last (None where it cannot say), for the report."""
    import torch
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        return getter() if getter is not None else None
    except RuntimeError:
        return None
