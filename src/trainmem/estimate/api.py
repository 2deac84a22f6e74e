"""``trainmem.estimate(model, **options)``: resolve inputs, run a method, attach the hardware view."""
from __future__ import annotations

import inspect
from typing import Any, Mapping

from ..allocator_rules import OVERHEAD_DIVISOR, reserved_overhead  # noqa: F401 (OVERHEAD_DIVISOR: public)
from ..report import Component, MemoryReport
from ..spec.config import input_notes
from ..spec.hardware import Hardware, handle_workspace
from ..spec.model import ModelSpec
from ..spec.resolve import (HARDWARE_OPTIONS, OTHER_OPTIONS, TRAINING_DEFAULTS, TRAINING_FIELDS,  # noqa: F401
                            Resolved, check_max_fraction, check_options, hardware_from, resolve, training_values)
from ..spec.training import TrainingSpec, report_warnings
from ..errors import TrainmemError
from .methods import get_method


def training_spec(**options: Any) -> TrainingSpec:
    """A TrainingSpec from keyword options named as the CLI flags (snake_case); None means the
    field's default (``seq_len``: 2048 — ``resolve`` defaults it by the model instead)."""
    check_options(options, TRAINING_FIELDS)
    return TrainingSpec(**training_values(options))


def attach_hardware(report: MemoryReport, hw: Hardware | None, max_fraction: float = 1.0) -> MemoryReport:
    """Add capacity, CUDA context and device memory to a report (estimates: reserved ~ allocated
    plus the allocator's overhead model)."""
    report.max_fraction = check_max_fraction(max_fraction)
    if hw is None:
        return report
    report.hardware = hw
    report.capacity = hw.capacity
    if report.peak_reserved is None:
        # the published methods compare allocated + context with the GPU; ours adds the allocator's cache
        extra = allocator_overhead(report) if report.method in ("trainmem", "") else 0
        report.peak_reserved = report.peak_allocated + extra
    _bound_by_device(report, hw)
    report.device_used = report.peak_reserved + hw.context
    names = {c.name for c in report.components}
    if "allocator_overhead" not in names and report.peak_reserved > report.peak_allocated:
        report.components.append(Component("allocator_overhead", "allocator_overhead",
                                           report.peak_reserved - report.peak_allocated, None,
                                           "reserved but unallocated: cached blocks freed earlier in the step"))
    if "cuda_context" not in names:
        report.components.append(Component("cuda_context", "cuda_context", hw.context, None, context_formula(hw),
                                           True))
    return report


def _bound_by_device(report: MemoryReport, hw: Hardware) -> None:
    """A trainmem estimate's replayed reserved memory (``reserved/``) bounded by the GPU: the caching
    allocator never holds more than the device has beside the CUDA context. When ``cudaMalloc`` fails
    it first waits for pending events and returns every cached unsplit segment to the driver, then
    retries (PyTorch ``c10/cuda/CUDACachingAllocator.cpp`` ``DeviceCachingAllocator::malloc``:
    ``alloc_block`` -> ``release_available_cached_blocks`` -> ``release_cached_blocks`` ->
    ``alloc_block`` again, counted in ``num_alloc_retries``), so ``max_memory_reserved`` stays at most
    ``capacity - context`` (bytes) in a run whose allocated peak fits. The replay knows no capacity
    (its segments come from the step alone), so a replay above that bound is cut to it, with one
    warning: the run flushes its cache under pressure, and how far below the bound its reserved
    peak settles depends on which segments were free at the flush. A report whose allocated peak
    itself exceeds the bound is left as replayed (it does not fit either way)."""
    if report.source != "estimate" or report.method not in ("trainmem", "") or report.peak_reserved is None:
        return
    room = hw.capacity - hw.context   # bytes cudaMalloc can hand out beside the context
    if report.peak_allocated <= room < report.peak_reserved:
        replayed = report.peak_reserved
        report.peak_reserved = room
        report.extra["replayed_reserved"] = replayed
        report.warnings.append(
            f"the replayed step reserves {replayed / 2**30:.2f} GiB, more than the {hw.name} has beside its CUDA "
            f"context ({room / 2**30:.2f} GiB): the caching allocator frees its cached segments and retries "
            f"(num_alloc_retries > 0), so peak reserved is at most {room / 2**30:.2f} GiB")


def context_formula(hw: Hardware) -> str:
    """Where the CUDA context figure comes from: the GPU catalogue (``gpus.json``, or
    ``--context-memory``), or a calibration profile measured by ``trainmem calibrate``."""
    if hw.calibration:
        return f"CUDA context and driver memory measured by trainmem calibrate ({hw.calibration})"
    return "CUDA context, driver and other processes before training"


def allocator_overhead(report: MemoryReport) -> int:
    """Reserved-minus-allocated at the peak: ``allocator_rules.reserved_overhead`` (1/32 of the
    peak allocated memory, from Moritz Scherrmann's BERT-large measurement)."""
    return reserved_overhead(report.peak_allocated)


def bucket_check(report: MemoryReport, m: ModelSpec, t: TrainingSpec) -> None:
    """The distributed-optimizer bucket check of Jianbin Chang's "GPT Training Memory Estimation -
    NeMo Training Practice" (https://shjwudp.github.io/blog/2023/gpt-training-memory-estimation-nemo-training-practice/):
    NeMo/apex make one bucket per layer, so a
    bucket larger than one layer's fp32 shard, 4·P/(L·t) bytes, is padding. Warn with the waste
    (``trainmem.estimate.methods.nemo.bucket_padding_bytes``) and the right size."""
    if t.optimizer_bucket_mb is None:
        return
    from .methods.nemo import bucket_padding_bytes, right_bucket_bytes
    bucket = int(round(t.optimizer_bucket_mb * 2**20))
    right = right_bucket_bytes(m.num_params, m.num_layers, t.tp)
    waste = bucket_padding_bytes(m.num_params, m.num_layers, t.tp, t.shard_group, bucket)
    if waste > 0:
        report.warnings.append(
            f"optimizer bucket {t.optimizer_bucket_mb:g} MiB exceeds one layer's fp32 shard 4P/(L·t) = "
            f"{right / 2**20:.1f} MiB: about {waste / 2**30:.2f} GiB of padding per GPU; "
            f"use a bucket of at most {right / 2**20:.0f} MiB")


def estimate(model: "str | ModelSpec | Mapping[str, Any] | Resolved", **options: Any) -> MemoryReport:
    """Closed-form estimate of one GPU's training memory.

    ``model``: catalogue name, config.json path, model directory, hub id, config dict, ModelSpec, or
    a :class:`~trainmem.spec.resolve.Resolved` (``options`` then apply on top of it).
    ``options`` (keyword-only; None or absent means the option's default): the CLI flags in
    snake_case — the TrainingSpec fields (batch_size, seq_len,
    precision, optimizer, zero, tp, recompute, attention, lora_rank, ...), plus ``gpu``,
    ``gpu_memory``, ``context_memory``, ``calibration`` (a ``trainmem calibrate`` profile),
    ``max_fraction``, ``method``, ``set`` (config overrides),
    ``training`` (a TrainingSpec) and ``hardware`` (a Hardware); see ``trainmem.spec.resolve``.
    """
    r = model if isinstance(model, Resolved) and not options else resolve(model, **options)
    return estimate_resolved(r)


def _options_signature() -> inspect.Signature:
    """``estimate``'s signature as ``help()`` and ``inspect.signature`` show it: ``model`` and every
    keyword option ``resolve`` accepts (the TrainingSpec fields in their order, then the GPU and the
    other options), each defaulting to None, which means the option's default."""
    names = [n for n in TRAINING_DEFAULTS if n in TRAINING_FIELDS]
    names += sorted(HARDWARE_OPTIONS) + sorted(OTHER_OPTIONS)
    params = [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names]
    return inspect.Signature(params, return_annotation=MemoryReport)


estimate.__signature__ = _options_signature()  # type: ignore[attr-defined]


def estimate_resolved(r: Resolved, replay: bool = True) -> MemoryReport:
    """Run ``r.method`` on the resolved inputs and attach the GPU (capacity, context, fit).
    ``replay``: the trainmem engine also replays the step through the caching allocator for peak
    reserved (milliseconds; seconds under ``--min-seq-len``); callers that read only the fit verdict
    (allocated + 1/32 + context, ``MemoryReport.device_peak``) skip it."""
    fn = get_method(r.method)
    t = r.training
    if r.method != "trainmem" and (t.recompute == "op" or t.offload_activations or t.gemini is not None):
        what = ("--recompute op" if t.recompute == "op" else "--offload-activations" if t.offload_activations
                else "ColossalAI Gemini (--gemini)")
        raise TrainmemError(f"--method {r.method}: the published formulas have no {what}; use --method trainmem")
    if r.method != "trainmem" and t.trainer is not None:
        raise TrainmemError(f"--method {r.method}: the published formulas have no --trainer {t.trainer} step; "
                            "use --method trainmem")
    ws = handle_workspace(r.hardware, t)
    # only the default engine counts cuBLAS workspaces: --cublas-workspace-config's, else the GPU's default size
    # or a calibration profile's
    # the trainmem engine also replays the step through the caching allocator (peak reserved)
    cap = r.hardware.capability if r.hardware is not None else None
    # the bytes cudaMalloc can hand out beside the CUDA context: where DeepSpeed ZeRO-1/2 flattens its groups
    room = r.hardware.capacity - r.hardware.context if r.hardware is not None else None
    report = fn(r.model, r.training, cublas_workspace=ws, reserved=replay, capability=cap, room=room) \
        if r.method == "trainmem" else fn(r.model, r.training)
    if r.method == "trainmem":
        bucket_check(report, r.model, r.training)
    report.method = r.method
    report.model, report.training = r.model, r.training
    report.warnings[:0] = input_notes(r.model, r.hardware) + report_warnings(r.training)
    return attach_hardware(report, r.hardware, r.max_fraction)
