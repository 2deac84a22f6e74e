"""``trace``: run the real training step on tensors without data and report its memory.

The model is real (transformers or your own ``nn.Module``), autograd is real, the optimizer is
``torch.optim``'s; only the tensors are empty (``meta`` storages for an emulated CUDA device,
``FakeTensor``\\ s for the CPU). Every allocation and free goes through an allocator simulation, so the
result is what ``torch.cuda.memory_allocated()`` / ``memory_reserved()`` would show on a GPU.
"""
from __future__ import annotations

import contextlib
import inspect
import time
from collections import defaultdict
from typing import Any, Callable, Mapping

import torch

from ..errors import TrainmemError
from ..report import Component, MemoryReport, Phase
from ..spec import Hardware, ModelSpec, TrainingSpec, get_gpu, resolve_model
from .allocator import CachingAllocator, ExactAllocator, SimulatedOutOfMemory
from .cuda import EMULATED, CudaEmulation, cuda_environment
from .tracker import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_SM90, Record, Tracker, module_pattern
# model building, optimizer and training step: shared with ``measure`` (trainmem.workload)
from ..workload import DROPOUT_KEYS as _DROPOUT_KEYS  # noqa: F401
from ..workload import check_supported as _check_supported
from ..workload import hf_config as _hf_config  # noqa: F401
from ..workload import hf_factory as _hf_factory
from ..workload import hf_step as _hf_step
from ..workload import make_optimizer, optimizer_class  # noqa: F401

_PERSISTENT = {"parameters", "buffers", "gradients", "optimizer_states", "master_weights", "workspace"}


def trace(model: Any, step_fn: Callable | None = None, steps: int = 2, *, device: str = "cuda",
          training: TrainingSpec | None = None, hardware: Hardware | None = None, gpu: str | None = None,
          optimizer_fn: Callable | None = None, overrides: Any = None, expandable_segments: bool = False,
          max_split_size: int | None = None, cublas_workspace: int | None = None,
          attention_backend: str | None = None, capability: tuple[int, int] | None = None,
          simulate_oom: bool = False, timeline_points: int = 4000, largest: int = 20,
          **training_options: Any) -> MemoryReport:
    """Trace ``steps`` training steps and return their memory as a :class:`MemoryReport`.

    ``model``: a catalogue name, config path, hub id or :class:`ModelSpec` (the transformers model
    its ``architectures`` names is built from the config, and trainmem writes the training step
    from the training options), or a zero-argument factory returning your ``nn.Module`` together
    with ``step_fn``. ``step_fn(model)``, ``step_fn(model, optimizer)`` or
    ``step_fn(model, optimizer, step)`` runs one step (forward, backward, optimizer step, zero_grad);
    ``optimizer`` is what ``optimizer_fn(model)`` returned (None without one). Write it for CUDA:
    ``device="cuda"`` tensors, ``torch.autocast("cuda")`` — the emulation handles it.

    Training options are the :class:`TrainingSpec` fields (``batch_size``, ``seq_len``,
    ``precision``, ``optimizer``, ``optimizer_impl``, ``recompute``, ``grad_accum``, ``attention``,
    ``dropout``, ``optimizer_in_backward`` ...), or ``training=`` a TrainingSpec.

    ``device="cuda"`` emulates one GPU (caching allocator, autocast policy, cuBLAS workspaces,
    fused dropout, SDPA backends, foreach optimizers); ``device="cpu"`` traces the same program for
    the CPU, byte-exact, with no CUDA behaviour. ``hardware``/``gpu`` add device_used (reserved +
    CUDA context) and the fit verdict; on a Hopper GPU the cuBLAS workspace is 32 MiB per handle
    (PyTorch's default there), else 8,519,680 B, unless ``cublas_workspace`` says otherwise.
    ``simulate_oom=True`` limits the simulated device to the GPU's capacity minus its CUDA context:
    near the limit the allocator frees its cache and retries as PyTorch does, and a step that does
    not fit stops at the simulated out-of-memory (reported in ``warnings``).
    ``expandable_segments`` and ``max_split_size`` mirror ``PYTORCH_CUDA_ALLOC_CONF``.
    """
    t0 = time.perf_counter()
    if device not in ("cuda", "cpu"):
        raise TrainmemError(f"trace device {device!r}: use 'cuda' (emulated GPU) or 'cpu'")
    if not isinstance(steps, int) or steps < 1:
        raise TrainmemError(f"steps must be a positive integer, got {steps!r}")
    options_given = training is not None or bool(training_options)
    if training is None:
        training = TrainingSpec(**training_options)
    elif training_options:
        raise TrainmemError("give either training= or training options, not both")
    _check_supported(training)
    if hardware is None and gpu is not None:
        hardware = get_gpu(gpu)
    cuda = device == "cuda"
    hopper = hardware is not None and any(k in hardware.name for k in ("h100", "h200", "h800", "gh200"))
    if capability is None:
        capability = (9, 0) if hopper else (8, 0)
    if cublas_workspace is None:
        cublas_workspace = (CUBLAS_WORKSPACE_SM90 if capability >= (9, 0) else CUBLAS_WORKSPACE) if cuda else 0
    if attention_backend is None and training.attention == "flash":
        attention_backend = "flash"

    spec: ModelSpec | None = None
    if isinstance(model, (str, ModelSpec, Mapping)):
        spec = resolve_model(model, overrides=overrides)
        if spec.family == "nanogpt":
            raise TrainmemError(f"{spec.name}: nanoGPT is not a transformers model; pass a factory returning "
                                f"your nanoGPT module and a step_fn (see trainmem.trace.trace)")
        factory = _hf_factory(spec, training)
        if step_fn is not None:
            raise TrainmemError("step_fn is for your own model factory; for a catalogue model trainmem writes "
                                "the training step from the training options")
    elif isinstance(model, torch.nn.Module):
        raise TrainmemError("pass a factory (a function returning the module), not a built module: the trace "
                            "builds the model itself, without memory")
    elif callable(model):
        factory = model
        if step_fn is None:
            raise TrainmemError("a model factory needs a step_fn(model, optimizer) that runs one training step")
    else:
        raise TrainmemError(f"model must be a name, config, ModelSpec or factory, got {type(model).__name__}")

    allocator: Any
    if cuda:
        if simulate_oom and hardware is None:
            raise TrainmemError("simulate_oom needs a GPU (gpu= or hardware=) for its capacity")
        limit = hardware.capacity - hardware.context if (simulate_oom and hardware is not None) else None
        allocator = CachingAllocator(expandable_segments=expandable_segments, max_split_size=max_split_size,
                                     capacity=limit)
        tracker = Tracker(allocator, device_type=EMULATED, cublas_workspace=cublas_workspace,
                          emulate_cuda_kernels=True)
        emulation = CudaEmulation(tracker, attention_backend=attention_backend, capability=capability)
        env = cuda_environment(allocator, capability=capability, emulation=emulation,
                               capacity=hardware.capacity if hardware else None)
        build_ctx: Any = torch.device(EMULATED)
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        allocator = ExactAllocator()
        tracker = Tracker(allocator, device_type="cpu")
        emulation = None
        env = contextlib.nullcontext()
        build_ctx = FakeTensorMode(allow_non_fake_inputs=True)

    oom: SimulatedOutOfMemory | None = None
    with env, (emulation if emulation is not None else contextlib.nullcontext()):
        if cuda:
            with build_ctx:
                module = factory()
            module = _as_module(module)
            if spec is not None and training.precision in ("bf16", "fp16"):
                module.to(torch.bfloat16 if training.precision == "bf16" else torch.float16)
            with tracker:
                _load_to_device(tracker, module)
        else:
            with build_ctx, tracker:
                module = _as_module(factory())
                if spec is not None and training.precision in ("bf16", "fp16"):
                    module.to(torch.bfloat16 if training.precision == "bf16" else torch.float16)
                _mark_model(tracker, module)
        tracker.name_modules(module)
        params = [p for p in module.parameters() if p.requires_grad]
        grad_hooks = tracker.watch_parameters(params)
        run_ctx = build_ctx if not cuda else contextlib.nullcontext()
        try:
            with run_ctx, tracker, tracker.hooks():
                if spec is not None:
                    module.train()
                    optimizer, step = _hf_step(module, spec, training, "cuda" if cuda else "cpu")
                else:
                    optimizer = optimizer_fn(module) if optimizer_fn is not None else None
                    step = _user_step(step_fn, module, optimizer)
                for i in range(1, steps + 1):
                    tracker.begin_step(i)
                    step(i)
                    tracker.end_step()
                    tracker.mark_gradients(params)
                    for opt in _optimizers(optimizer):
                        tracker.mark_optimizer_state(opt)
        except SimulatedOutOfMemory as e:  # only with a capacity-limited allocator
            oom = e
        finally:
            tracker.finish()
            for h in grad_hooks:
                h.remove()
    runtime = time.perf_counter() - t0
    report = _report(tracker, allocator, spec, training if (spec is not None or options_given) else None, hardware,
                     cuda, emulation, runtime, timeline_points, largest, oom, cublas_workspace, expandable_segments)
    if spec is None and options_given:
        report.warnings.append("training options are recorded but not applied to a user step_fn: "
                               "the step function decides batch, precision and optimizer")
    return report


# ----- model building -------------------------------------------------------------------------------
def _as_module(m: Any) -> torch.nn.Module:
    if not isinstance(m, torch.nn.Module):
        raise TrainmemError(f"the model factory returned {type(m).__name__}, not a torch.nn.Module")
    return m


def _load_order(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, str, str]]:
    """(name, tensor, category, module) in the order ``module.to(device)`` moves them."""
    out: list[tuple[str, torch.Tensor, str, str]] = []
    seen: set[int] = set()

    def walk(m: torch.nn.Module, prefix: str) -> None:
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")
        for name, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + name, p, "parameters", prefix[:-1]))
        for name, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append((prefix + name, b, "buffers", prefix[:-1]))

    walk(module, "")
    return out


def _load_to_device(tracker: Tracker, module: torch.nn.Module) -> None:
    """Count parameters and buffers as ``model.to("cuda")`` allocates them (module order)."""
    for name, t, cat, mod in _load_order(module):
        tracker.register_existing(t, cat, "", mod)


def _mark_model(tracker: Tracker, module: torch.nn.Module) -> None:
    for name, t, cat, mod in _load_order(module):
        tracker.reclassify(t, cat)


def _optimizers(opt: Any) -> list[Any]:
    if opt is None:
        return []
    if isinstance(opt, (list, tuple)):
        return [o for o in opt if hasattr(o, "state")]
    if isinstance(opt, dict):
        return [o for o in opt.values() if hasattr(o, "state")]
    return [opt] if hasattr(opt, "state") else []


def _user_step(step_fn: Callable, module: torch.nn.Module, optimizer: Any) -> Callable[[int], None]:
    try:
        n = len([p for p in inspect.signature(step_fn).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    except (TypeError, ValueError):
        n = 2
    if n <= 1:
        return lambda i: step_fn(module)
    if n == 2:
        return lambda i: step_fn(module, optimizer)
    return lambda i: step_fn(module, optimizer, i)


# ----- report ---------------------------------------------------------------------------------------
def _component_key(rec: Record) -> str:
    cat = rec.category
    if cat in ("parameters", "buffers", "gradients", "inputs", "logits"):
        return cat
    if cat == "optimizer_states":
        return f"optimizer_states.{rec.label or 'state'}"
    if cat == "workspace":
        return f"workspace.{rec.label or 'other'}"
    if rec.label in ("autocast_weight_cache", "kernel_scratch"):
        return f"{cat}.{rec.label}"
    mod = module_pattern(rec.module) if rec.module else "top_level"
    return f"{cat}.{mod}.{rec.op}" + (f".{rec.label}" if rec.label else "")


def _report(tracker: Tracker, allocator: Any, spec: ModelSpec | None, training: TrainingSpec,
            hardware: Hardware | None, cuda: bool, emulation: CudaEmulation | None, runtime: float,
            timeline_points: int, largest: int, oom: SimulatedOutOfMemory | None, ws: int,
            expandable: bool) -> MemoryReport:
    peak_event = tracker.peak_event
    live = tracker.live_at(peak_event) if peak_event >= 0 else []
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in live:
        groups[_component_key(r)].append(r)
    comps: list[Component] = []
    overhead = 0
    for key in sorted(groups, key=lambda k: -sum(r.nbytes for r in groups[k])):
        recs = groups[key]
        cat = recs[0].category
        dtypes = sorted({r.dtype for r in recs if r.dtype})
        comps.append(Component(key, cat, sum(r.nbytes for r in recs), "/".join(dtypes) or None,
                               f"{len(recs)} tensor(s) live at the peak", cat in _PERSISTENT))
        overhead += sum(r.block - r.nbytes for r in recs)
    if overhead:
        comps.append(Component("allocator_overhead.rounding", "allocator_overhead", overhead, None,
                               "block sizes above the requested bytes (512 B rounding, unsplit remainders)",
                               False))
    marks = tracker.phase_marks
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for m in marks:
        counts[(m.name, m.step)] += 1
    seen: dict[tuple[str, int], int] = defaultdict(int)
    phases: list[Phase] = []
    peak_phase = ""
    for m in marks:
        name = m.name
        if counts[(m.name, m.step)] > 1:
            seen[(m.name, m.step)] += 1
            name = f"{m.name}.micro{seen[(m.name, m.step)]}"
        phases.append(Phase(name, m.step, m.allocated, m.peak, m.reserved if cuda else None, m.where))
        if m.start_event <= peak_event < max(m.end_event, m.start_event + 1):
            peak_phase = name if m.step == 0 else f"{name}@{m.step}"
    peak_alloc = tracker.peak
    peak_reserved = allocator.peak_reserved if cuda else None
    device_used = peak_reserved + hardware.context if (hardware is not None and peak_reserved is not None) else None
    if oom is not None and hardware is not None:
        # the step did not finish: it needed at least the reserved memory plus the failed segment
        device_used = max(device_used or 0, oom.reserved + oom.requested + hardware.context)
    largest_rows = []
    for r in sorted(live, key=lambda r: -r.block)[:largest]:
        largest_rows.append({"name": _component_key(r), "category": r.category, "bytes": r.nbytes, "block": r.block,
                             "shape": list(r.shape), "dtype": r.dtype, "module": r.module, "op": r.op,
                             "phase": r.phase, "step": r.step})
    warnings = list(tracker.warnings)
    if tracker.data_dependent:
        warnings.append(f"{tracker.data_dependent} data-dependent read(s) of device tensors: the trace has no data, "
                        f"so all() answered True, any() False, numbers 1")
    if emulation is not None and emulation.host_reads:
        warnings.append(f"{emulation.host_reads} copy(ies) of device tensors to the host returned zeros")
    if oom is not None:
        warnings.append(f"simulated out of memory: {oom}")
    extra: dict[str, Any] = {
        "largest_tensors": largest_rows,
        "timeline": tracker.timeline(timeline_points),
        "phase_events": [[pm.name, pm.step, pm.start_event, pm.end_event] for pm in tracker.phase_marks],
        "allocator": allocator.stats.to_dict(),
        "num_segments_at_end": allocator.num_segments,
        "events": len(tracker.ev_rec),
        "ops": tracker.ops_seen,
        "runtime_s": round(runtime, 3),
        "device": "cuda (emulated)" if cuda else "cpu",
        "cublas_workspace": ws,
        "expandable_segments": expandable,
        "peak_event": peak_event,
    }
    if emulation is not None:
        extra["sdpa_backends"] = dict(emulation.sdpa_choices)
    return MemoryReport(
        source="trace", components=comps, phases=phases, peak_allocated=peak_alloc, peak_reserved=peak_reserved,
        device_used=device_used, peak_phase=peak_phase, peak_where=tracker.peak_context,
        capacity=hardware.capacity if hardware is not None else None, method="trace",
        model=spec, training=training, hardware=hardware, warnings=warnings, extra=extra)
