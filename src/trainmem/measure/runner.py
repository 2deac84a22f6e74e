"""``measure``: run real training steps and record their memory, phase by phase.

The model is built from its config with random weights (``trainmem.workload``: the transformers
class the config's ``architectures`` names; nothing is downloaded), trained for ``steps`` steps
with the step trainmem writes for every source (random batch, forward, ``loss.backward()``,
``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``), and the memory is read at the end
of each phase: ``model_loaded`` (step 0), then ``forward``, ``backward``, ``optimizer_step`` and
``zero_grad`` of every step. The result is a :class:`~trainmem.report.MemoryReport` with source
``"measure"``, like ``estimate`` and ``trace`` return.

* ``device="cuda"``: the CUDA caching allocator's statistics (allocated, reserved, peak allocated
  per phase), the driver's figure (NVML where ``pynvml`` is installed, else ``cudaMemGetInfo``) and
  the CUDA context (driver − reserved). The model is built on the host and moved with
  ``model.to("cuda")``, as a ``from_pretrained`` + ``.to()`` loop does. ``snapshot``/``html``
  record the allocator's history (``torch.cuda.memory._record_memory_history``) and save
  ``torch.cuda.memory._snapshot()`` (pickle, for pytorch.org/memory_viz) and its
  ``torch.cuda._memory_viz.trace_plot`` page.
* ``device="cpu"``: real tensors on the CPU, counted by ``LiveBytes`` (reserved is None). The model
  is built while counting, as ``trace(..., device="cpu")`` does, so the two agree phase by phase.
* ``memory_limit``: on the CPU a budget for LiveBytes, on CUDA ``set_per_process_memory_fraction``;
  exceeding it raises ``torch.OutOfMemoryError`` as a full GPU does.
* ``profile``: a ``torch.profiler`` trace of the run (chrome trace JSON, for Perfetto / chrome://tracing).

An out-of-memory error is caught: the report says in which phase it happened, lists the largest live
tensors, and gives the largest micro-batch ``trainmem.plan.fit`` predicts fits at this sequence
length (``extra["oom"]``). ``find_max_batch`` searches the largest micro-batch that really runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import platform
import re
import time
from typing import Any, Callable, Mapping

import torch

from ..errors import TrainmemError
from ..report import Component, MemoryReport
from ..spec import Hardware, ModelSpec, TrainingSpec, get_gpu, resolve_model
from ..units import parse_bytes
from ..workload import TrainStep, check_supported, hf_factory
from .probes import CpuProbe, CudaProbe, PhaseRecorder, optimizer_tensors, parse_device, tensor_bytes

MiB = 2**20
OOM_TEXT = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_oom(e: BaseException) -> bool:
    """torch.OutOfMemoryError, or the RuntimeError a library raises when its workspace allocation
    fails (cuBLAS / cuDNN "ALLOC_FAILED", "CUDA error: out of memory")."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in OOM_TEXT)


_REQUEST = re.compile(r"tried to allocate ([0-9.]+) ?(B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNIT = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def requested_bytes(message: str, probe: Any = None) -> int | None:
    """The size of the allocation that failed: exact from LiveBytes, else read from the message
    ("Tried to allocate 2.00 GiB", to the message's rounding)."""
    lb = getattr(probe, "lb", None)
    if lb is not None and getattr(lb, "failed_request", 0):
        return int(lb.failed_request)
    m = _REQUEST.search(message or "")
    if not m:
        return None
    return int(float(m.group(1)) * _UNIT[m.group(2).lower()])


def _training(training: TrainingSpec | None, options: dict[str, Any]) -> tuple[TrainingSpec, dict[str, Any]]:
    from ..estimate.api import training_spec
    if training is not None:
        if options:
            raise TrainmemError("give either training= or training options, not both")
        d = {f.name: getattr(training, f.name) for f in dataclasses.fields(training) if f.name != "extra"}
        return training, d
    opts = {k: v for k, v in options.items() if v is not None}
    return training_spec(**dict(opts)), opts


def _hardware(kind: str, gpu: Any, gpu_memory: Any, context_memory: Any, limit: int | None) -> Hardware | None:
    if isinstance(gpu, Hardware):
        return gpu
    if gpu is not None or gpu_memory is not None:
        return get_gpu(gpu, gpu_memory, context_memory)
    if limit is not None:
        return Hardware("cpu-limit" if kind == "cpu" else "memory-limit", limit, 0,
                        "memory limit (--memory-limit)")
    return None


def _named_tensors(model: Any, optimizer: Any, batch: Mapping[str, Any] | None) -> dict[int, tuple[str, str]]:
    """data_ptr -> (name, category) for the tensors a training run knows by name."""
    out: dict[int, tuple[str, str]] = {}

    def put(t: Any, name: str, cat: str) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            out.setdefault(t.untyped_storage().data_ptr(), (name, cat))

    if model is not None:
        names = {}
        for n, p in model.named_parameters():
            names[id(p)] = n
            put(p, n, "parameters")
            if p.grad is not None:
                put(p.grad, f"{n}.grad", "gradients")
        for n, b in model.named_buffers():
            put(b, n, "buffers")
        if optimizer is not None:
            for p, st in getattr(optimizer, "state", {}).items():
                if isinstance(st, dict):
                    for k, v in st.items():
                        put(v, f"{names.get(id(p), 'param')}.{k}", "optimizer_states")
    for k, v in (batch or {}).items():
        put(v, f"batch.{k}", "inputs")
    return out


def live_tensors(probe: Any, model: Any, optimizer: Any, batch: Mapping[str, Any] | None,
                 largest: int = 10) -> dict[str, Any]:
    """What is live now: bytes per kind and the largest tensors.

    On the CPU every live storage is known (LiveBytes), with the op that allocated it. On CUDA the
    named tensors (parameters, gradients, optimizer states, the batch) and every tensor Python
    still references (``gc``) are listed; the rest of the allocated memory is held where Python
    cannot see it (tensors saved for backward, C++-held buffers) and is reported as one amount.
    """
    names = _named_tensors(model, optimizer, batch)
    rows: list[dict[str, Any]] = []
    live = probe.live()
    if live is not None:
        for r in live:
            name, cat = names.get(r["ptr"], ("", "activations/temporaries"))
            rows.append({"bytes": r["bytes"], "name": name or f"{r['op']} output", "category": cat,
                         "shape": r["shape"], "dtype": r["dtype"], "op": r["op"], "allocated_in": r["tag"]})
    else:
        seen: set[int] = set()
        dev = probe.device
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.is_meta or obj.device.type != dev.type:
                    continue
                s = obj.untyped_storage()
            except Exception:
                continue
            ptr = s.data_ptr()
            if ptr in seen or not s.nbytes():
                continue
            seen.add(ptr)
            name, cat = names.get(ptr, ("tensor referenced from Python", "activations/temporaries"))
            rows.append({"bytes": int(s.nbytes()), "name": name, "category": cat, "shape": list(obj.shape),
                         "dtype": str(obj.dtype).replace("torch.", ""), "op": "", "allocated_in": ""})
        rows.sort(key=lambda r: -r["bytes"])
    allocated = probe.allocated()
    by: dict[str, int] = {}
    for r in rows:
        by[r["category"]] = by.get(r["category"], 0) + r["bytes"]
    hidden = allocated - sum(by.values())
    if live is None and hidden > 0:
        by["not visible from Python (saved for backward, C++-held)"] = hidden
    return {"allocated": allocated, "reserved": probe.reserved(), "by_kind": by, "largest": rows[:largest]}


def predictor_for(kind: str, by: str = "auto") -> str:
    """Which predictor ``plan.fit`` uses for a measured device: ``estimate`` (the formulas, which
    model a CUDA GPU) on CUDA, ``trace`` (the tracer, byte-exact for the CPU) on the CPU."""
    if by == "auto":
        return "trace" if kind == "cpu" else "estimate"
    if by not in ("estimate", "trace"):
        raise TrainmemError(f"--predict-by {by!r}: use auto, estimate or trace")
    return by


def _predicted_fit(spec: ModelSpec, options: dict[str, Any], kind: str, gpu: Any, gpu_memory: Any,
                   context_memory: Any, limit: int | None, total: int | None, context: int | None,
                   by: str = "auto") -> dict[str, Any]:
    """``trainmem.plan.fit``'s largest micro-batch at this sequence length on this device/limit."""
    from ..plan import fit
    by = predictor_for(kind, by)
    opts = {k: v for k, v in options.items() if k not in ("batch_size",)}
    if by == "trace":
        opts = {k: v for k, v in opts.items() if k != "optimizer_bucket_mb"}
        opts["device"] = "cpu" if kind == "cpu" else "cuda"
    if gpu is not None or gpu_memory is not None:
        hw = dict(gpu=gpu, gpu_memory=gpu_memory, context_memory=context_memory)
        on = gpu if isinstance(gpu, str) else (gpu_memory or getattr(gpu, "name", "GPU"))
    elif limit is not None:
        hw = dict(gpu=None, gpu_memory=limit, context_memory=0)
        on = f"the {limit / MiB:.2f} MiB limit"
    elif kind == "cuda" and total:
        hw = dict(gpu=None, gpu_memory=total, context_memory=max(context or 0, 0))
        on = f"this GPU ({total / MiB:.0f} MiB, context {max(context or 0, 0) / MiB:.0f} MiB)"
    else:
        return {"batch_size": None, "note": "no memory size to fit into (give --gpu, --gpu-memory or --memory-limit)"}
    try:
        r = fit(spec, by=by, seq_len=opts.pop("seq_len", None) or 2048, suggestions=False, **hw, **opts)
    except TrainmemError as e:
        return {"batch_size": None, "note": f"trainmem.plan.fit could not answer: {e}"}
    return {"batch_size": r.batch_size, "device_used": r.device_used, "limit": r.limit, "on": on,
            "method": r.method if by == "estimate" else f"trace on {opts['device']}", "by": by, "fits": r.fits,
            "evaluations": r.evaluations}


def save_snapshot(snapshot: Any, pickle_path: str | None = None, html_path: str | None = None) -> list[str]:
    """Write an allocator snapshot (``torch.cuda.memory._snapshot()``) as a pickle (load it in
    https://pytorch.org/memory_viz) and/or as the ``trace_plot`` HTML page. Returns the paths."""
    import pickle
    written = []
    if pickle_path:
        with open(pickle_path, "wb") as f:
            pickle.dump(snapshot, f)
        written.append(pickle_path)
    if html_path:
        from torch.cuda._memory_viz import trace_plot
        with open(html_path, "w", encoding="utf-8") as f:
            f.write(trace_plot(snapshot))
        written.append(html_path)
    return written


def _profiler(profile_dir: str | None, kind: str) -> Any:
    if not profile_dir:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kind == "cuda" else [])
    return profile(activities=acts, profile_memory=True, record_shapes=True)


def environment(kind: str, probe: Any = None) -> dict[str, Any]:
    """Versions and the device, for reports and fixtures."""
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "platform": platform.platform(), "device": kind}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if kind == "cpu":
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    else:
        env["gpu"] = None
        env["gpu_memory_total"] = int(getattr(probe, "total", 0) or 0) or None
        env["cuda"] = torch.version.cuda
        nv = getattr(probe, "nvml", None)
        env["driver"] = nv.driver_version() if nv is not None else None
        env["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
        try:
            idx = getattr(probe, "index", 0)
            props = torch.cuda.get_device_properties(idx)
            env["gpu"] = props.name
            env["compute_capability"] = f"{props.major}.{props.minor}"
            env["gpu_memory_total"] = env["gpu_memory_total"] or int(props.total_memory)
            env["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        except (RuntimeError, AssertionError, AttributeError) as e:  # a probe without a real device (tests)
            env["gpu_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        if getattr(probe, "describe", None):
            env.update(probe.describe())
    return env


def measure(model: Any, steps: int = 2, *, device: str = "cuda", training: TrainingSpec | None = None,
            overrides: Any = None, gpu: Any = None, gpu_memory: Any = None, context_memory: Any = None,
            max_fraction: float | None = None, memory_limit: Any = None, snapshot: str | None = None,
            html: str | None = None, profile: str | None = None, largest: int = 10, seed: int = 0,
            empty_cache: bool = False, predict_on_oom: bool = True, predict_by: str = "auto", probe: Any = None,
            **training_options: Any) -> MemoryReport:
    """Run ``steps`` real training steps of a catalogue model and report their memory per phase.

    ``model``: catalogue name, config path, hub id or ModelSpec (``overrides`` or ``set``: config
    overrides such as ``["num_hidden_layers=2"]``). Training options are the TrainingSpec fields
    (``batch_size``, ``seq_len``, ``precision``, ``optimizer``, ``optimizer_impl``, ``attention``,
    ``grad_accum``, ``recompute``, ``dropout``, ``optimizer_in_backward``), or ``training=``.
    ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. ``gpu``/``gpu_memory``/``context_memory``:
    the GPU to judge the fit against (on CUDA the device itself by default). ``memory_limit``: a
    size ("64MiB" or bytes) beyond which allocations fail with ``torch.OutOfMemoryError``.
    ``empty_cache``: ``gc.collect()`` + ``torch.cuda.empty_cache()`` after reading each phase, as
    notebooks that print memory after each phase do (seed 003; it lowers reserved memory).
    ``predict_by``: the predictor ``plan.fit`` uses for "what would fit" after an out-of-memory
    error (auto: trace on the CPU, estimate on CUDA). ``probe``: a probe object to use instead of
    the device's (tests).
    """
    predictor_for("cpu", predict_by)
    t0 = time.perf_counter()
    if overrides is None:
        overrides = training_options.pop("set", None)
    else:
        training_options.pop("set", None)
    for k in ("method",):
        training_options.pop(k, None)
    if not isinstance(steps, int) or steps < 1:
        raise TrainmemError(f"--steps must be a positive integer, got {steps!r}")
    kind, index = parse_device(device)
    t, options = _training(training, training_options)
    check_supported(t, "measure")
    spec = resolve_model(model, overrides=overrides)
    if spec.family == "nanogpt":
        raise TrainmemError(f"{spec.name}: nanoGPT is not a transformers model; measure runs catalogue models "
                            "built with transformers")
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    if limit is not None and limit <= 0:
        raise TrainmemError("--memory-limit must be a positive size")
    if (snapshot or html) and kind != "cuda":
        raise TrainmemError("--snapshot and --html need --device cuda: they record the CUDA caching allocator's "
                            "history (torch.cuda.memory._record_memory_history); on the CPU use --profile DIR")
    for path in (snapshot, html):
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise TrainmemError(f"cannot write {path}: directory {parent} does not exist")
    if profile:
        if os.path.exists(profile) and not os.path.isdir(profile):
            raise TrainmemError(f"--profile {profile}: exists and is not a directory")
        os.makedirs(profile, exist_ok=True)
    warnings: list[str] = []
    if t.compile:
        warnings.append("--compile is not applied: measure runs the step eagerly")
    if t.loss_chunks > 1:
        warnings.append("--loss-chunks is not applied: the measured step computes the loss in one piece")
    if probe is None:
        probe = CpuProbe(limit) if kind == "cpu" else CudaProbe(index, limit, record_history=bool(snapshot or html))
    hw = _hardware(kind, gpu, gpu_memory, context_memory, limit)

    recorder = PhaseRecorder(probe, t.grad_accum, empty_cache)
    oom: dict[str, Any] | None = None
    params_b = buffers_b = 0
    written: list[str] = []
    device_str = probe.device.type  # where the batch is made: "cuda" (the current device) or "cpu"
    torch.manual_seed(seed)
    with probe:
        prof_ctx = _profiler(profile, kind)
        with prof_ctx as prof:
            module: Any = None
            step: TrainStep | None = None
            snap: Any = None
            try:
                factory = hf_factory(spec, t)
                module = factory()
                if kind == "cuda":
                    module.to(probe.device)
                module.train()
                params_b = tensor_bytes(module.parameters())
                buffers_b = tensor_bytes(module.buffers())
                recorder.mark("model_loaded", 0)
                step = TrainStep(module, spec, t, device_str, on_phase=recorder.mark, what="measure")
                st = step.state
                recorder.watch([p for p in module.parameters() if p.requires_grad], step.optimizer,
                               lambda: tensor_bytes(st.get("batch", {}).values()))
                for i in range(1, steps + 1):
                    step(i)
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_oom(e):
                    raise
                msg = str(e).strip()
                oom = {"phase": recorder.in_progress, "message": msg.splitlines()[0][:500] if msg else type(e).__name__,
                       "requested": requested_bytes(msg, probe),
                       "peak_allocated": max([r.phase.peak for r in recorder.records] + [probe.peak()]),
                       **live_tensors(probe, module, step.optimizer if step else None,
                                      step.state.get("batch") if step else None, largest)}
                if snapshot or html:  # while the step's tensors are still alive
                    snap = torch.cuda.memory._snapshot(probe.device)
                del e
            finally:
                recorder.unwatch()
            if snapshot or html:
                if snap is None:
                    snap = torch.cuda.memory._snapshot(probe.device)
                written += save_snapshot(snap, snapshot, html)
                del snap
            opt_b = tensor_bytes(optimizer_tensors(step.optimizer if step else None))
            if step is not None:
                remove = getattr(step.optimizer, "remove", None)
                if callable(remove):
                    remove()  # optimizer-in-backward hooks
                step.release()
            del step, module
            stats = probe.stats()
        if prof is not None:
            path = os.path.join(profile, f"trainmem-measure-{spec.name}-{kind}.json".replace("/", "_"))
            prof.export_chrome_trace(path)
            written.append(path)
        env = environment(kind, probe)
    probe.empty_cache()
    runtime = time.perf_counter() - t0
    return _report(spec, t, options, overrides, model, kind, probe, recorder, hw, max_fraction, oom, params_b,
                   buffers_b, opt_b, stats, env, written, warnings, runtime, steps, seed, predict_on_oom,
                   gpu, gpu_memory, context_memory, limit, empty_cache, predict_by)


def _report(spec: ModelSpec, t: TrainingSpec, options: dict[str, Any], overrides: Any, model_arg: Any, kind: str,
            probe: Any, recorder: PhaseRecorder, hw: Hardware | None, max_fraction: float | None,
            oom: dict[str, Any] | None, params_b: int, buffers_b: int, opt_b: int, stats: dict[str, Any],
            env: dict[str, Any], written: list[str], warnings: list[str], runtime: float, steps: int, seed: int,
            predict_on_oom: bool, gpu: Any, gpu_memory: Any, context_memory: Any, limit: int | None,
            empty_cache: bool, predict_by: str) -> MemoryReport:
    records = recorder.records
    phases = recorder.phases
    best = recorder.peak_record()
    peak_alloc = max([p.peak for p in phases] + [oom["peak_allocated"] if oom else 0])
    cuda = kind == "cuda"
    peak_res = None
    if cuda:
        peak_res = max([r.peak_reserved or 0 for r in records] + [(oom or {}).get("reserved") or 0])
    contexts = [r.context for r in records if r.context is not None]
    context = contexts[-1] if contexts else None
    comps: list[Component] = []
    if best is not None:
        ph = best.phase
        parts = [("parameters", "parameters", params_b, "the model's parameters (distinct storages)", True),
                 ("buffers", "buffers", buffers_b, "the model's buffers", True),
                 ("gradients", "gradients", best.gradients_at_peak,
                  "gradients alive at the peak (to within one gradient tensor)", True),
                 ("optimizer_states", "optimizer_states", best.states_at_peak,
                  "optimizer states alive at the peak", True),
                 ("inputs", "inputs", best.inputs if ph.step > 0 else 0, "the batch", False)]
        known = 0
        for name, cat, b, formula, persistent in parts:
            if b:
                comps.append(Component(name, cat, int(b), None, formula, persistent))
                known += b
        rest = ph.peak - known
        if rest < 0:
            warnings.append(f"the peak ({ph.peak} B) is below the named tensors ({known} B): memory from before "
                            "the run was freed during it?")
        elif rest:
            comps.append(Component("activations.other", "activations", rest, None,
                                   "the rest of the peak: activations saved for backward, logits and temporaries "
                                   "(a measurement sees bytes, not their purpose)"))
    if cuda and peak_res is not None and peak_res > peak_alloc:
        comps.append(Component("allocator_overhead", "allocator_overhead", peak_res - peak_alloc, None,
                               "peak reserved − peak allocated (cached blocks, segment rounding)"))
    if cuda and context is not None:
        comps.append(Component("cuda_context", "cuda_context", context, None,
                               "driver's figure − reserved at the last phase (CUDA context, kernels, NCCL/cuBLAS "
                               "handles outside the allocator)", True))
    device_used = peak_res + context if (cuda and peak_res is not None and context is not None) else None
    if cuda and hw is None:
        total = getattr(probe, "total", 0)
        if total:
            hw = Hardware(str(env.get("gpu") or "cuda"), int(total), max(context or 0, 0), "measured device")
    if oom is not None:
        warnings.insert(0, f"out of memory in {oom['phase']}: {oom['message']}")
        if predict_on_oom:
            oom["fit"] = _predicted_fit(spec, options, kind, gpu, gpu_memory, context_memory, limit,
                                        getattr(probe, "total", None), context, predict_by)
        # the step did not finish: it needed at least what it held plus the refused allocation
        lb = getattr(probe, "lb", None)
        if cuda:
            held = (oom.get("reserved") or 0) + max(context or 0, 0)
        elif lb is not None and getattr(lb, "failed_request", 0):
            held = lb.failed_current
        else:
            held = oom.get("allocated", 0)
        if oom.get("requested"):
            needed = held + oom["requested"]
        else:
            needed = hw.capacity + 1 if hw is not None else None
        if needed is not None:
            oom["needed_at_least"] = needed
            device_used = max(device_used or 0, needed)
    notes = list(getattr(probe, "notes", []))
    extra: dict[str, Any] = {
        "device": kind if kind == "cpu" else str(probe.device),
        "steps": steps,
        "seed": seed,
        "phases": [r.to_dict() for r in records],
        "oom": oom,
        "optimizer_states_bytes": opt_b,
        "allocator": stats,
        "environment": env,
        "notes": notes,
        "files": written,
        "runtime_s": round(runtime, 3),
        "model_arg": model_arg if isinstance(model_arg, str) else spec.name,
        "overrides": list(overrides) if isinstance(overrides, (list, tuple)) else overrides,
        "options": options,
        "empty_cache_each_phase": empty_cache,
    }
    if cuda:
        extra["cuda_context"] = context
    peak_phase = peak_where = ""
    if best is not None and best.phase.peak >= peak_alloc:
        peak_phase, peak_where = f"{best.phase.name}@{best.phase.step}", best.phase.where
    elif oom is not None:
        peak_phase, peak_where = oom["phase"], "when it ran out of memory"
    report = MemoryReport(
        source="measure", components=comps, phases=phases, peak_allocated=int(peak_alloc), peak_reserved=peak_res,
        device_used=device_used, peak_phase=peak_phase, peak_where=peak_where,
        capacity=hw.capacity if hw is not None else None, max_fraction=max_fraction or 1.0, method="measure",
        model=spec, training=t, hardware=hw, warnings=warnings, extra=extra)
    return report


# ----- the largest micro-batch that runs ----------------------------------------------------------------
def find_max_batch(model: Any, *, device: str = "cuda", steps: int = 2, memory_limit: Any = None,
                   batch_cap: int = 4096, gpu: Any = None, gpu_memory: Any = None, context_memory: Any = None,
                   overrides: Any = None, on_try: Callable[[dict[str, Any]], None] | None = None,
                   predict_by: str = "auto", **training_options: Any) -> dict[str, Any]:
    """The largest micro-batch that really runs ``steps`` steps: doubling from 1 until a try runs
    out of memory, then bisection. Every try builds a fresh model and optimizer (``measure``
    empties the allocator's cache before and after). Beside it, the largest micro-batch
    ``trainmem.plan.fit`` predicts at this sequence length for the same memory.
    On the CPU a ``memory_limit`` is required (the CPU has no fixed memory to run out of)."""
    from ..plan.fit import search_max
    if overrides is None:
        overrides = training_options.pop("set", None)
    training_options.pop("batch_size", None)
    kind, _ = parse_device(device)
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    if kind == "cpu" and limit is None:
        raise TrainmemError("--find-max-batch on the CPU needs --memory-limit SIZE (the CPU has no fixed memory "
                            "to run out of)")
    if not isinstance(batch_cap, int) or batch_cap < 1:
        raise TrainmemError(f"batch cap must be a positive integer, got {batch_cap!r}")
    spec = resolve_model(model, overrides=overrides)
    tries: list[dict[str, Any]] = []
    last: dict[str, MemoryReport] = {}

    def runs(b: int) -> bool:
        r = measure(spec, steps, device=device, memory_limit=limit, gpu=gpu, gpu_memory=gpu_memory,
                    context_memory=context_memory, predict_on_oom=False, batch_size=b, **training_options)
        oom = r.extra["oom"]
        row = {"batch_size": b, "ok": oom is None, "peak_allocated": r.peak_allocated,
               "peak_reserved": r.peak_reserved, "oom_phase": oom["phase"] if oom else None,
               "runtime_s": r.extra["runtime_s"]}
        tries.append(row)
        if on_try is not None:
            on_try(row)
        if oom is None:
            last["ok"] = r
        else:
            last["bad"] = r
        return oom is None

    best, first_bad = search_max(runs, batch_cap)
    ref = last.get("ok") or last.get("bad")
    ctx = ref.extra.get("cuda_context") if ref is not None else None
    total = ref.extra["environment"].get("gpu_memory_total") if ref is not None else None
    opts = dict(training_options)
    opts.pop("method", None)
    _, options = _training(None, opts)
    predicted = _predicted_fit(spec, options, kind, gpu, gpu_memory, context_memory, limit, total, ctx, predict_by)
    return {"model": spec.name, "device": device, "seq_len": options.get("seq_len", 2048), "steps": steps,
            "limit": limit, "measured_max": best, "first_failing": first_bad,
            "limited_by": "memory" if first_bad is not None else "batch_cap", "batch_cap": batch_cap,
            "predicted_max": predicted.get("batch_size"), "prediction": predicted, "tries": tries}


# ----- validation fixtures --------------------------------------------------------------------------------
def fixture(report: MemoryReport, command: str = "", name: str | None = None) -> dict[str, Any]:
    """A validation fixture (the format ``trainmem.validate`` reads) of a measured report: model,
    overrides, setup (the estimate/trace options), the measured quantities in bytes, and the full
    metadata (device, driver, CUDA, torch and transformers versions, the command)."""
    if report.source != "measure":
        raise TrainmemError(f"a fixture records a measured run, not a {report.source!r} report")
    ex = report.extra
    if ex.get("oom"):
        raise TrainmemError("the run ran out of memory: no fixture written (its phases are incomplete)")
    setup = {k: v for k, v in (ex.get("options") or {}).items() if v is not None}
    hw = report.hardware
    if hw is not None and getattr(hw, "name", "") and hw.name not in ("custom", "cpu-limit", "memory-limit"):
        try:
            get_gpu(hw.name)
            setup["gpu"] = hw.name
        except TrainmemError:
            pass
    measured: list[dict[str, Any]] = [{"quantity": "peak_allocated", "bytes": int(report.peak_allocated)}]
    if report.peak_reserved is not None:
        measured.append({"quantity": "peak_reserved", "bytes": int(report.peak_reserved)})
    if report.device_used is not None and "gpu" in setup:
        measured.append({"quantity": "device_used", "bytes": int(report.device_used),
                         "note": "peak reserved + the CUDA context measured on this GPU"})
    for p in report.phases:
        measured.append({"quantity": f"phase:{p.name}@{p.step}:allocated", "bytes": int(p.allocated)})
        measured.append({"quantity": f"phase:{p.name}@{p.step}:peak", "bytes": int(p.peak)})
        if p.reserved is not None:
            measured.append({"quantity": f"phase:{p.name}@{p.step}:reserved", "bytes": int(p.reserved)})
    env = ex.get("environment", {})
    dev = env.get("gpu") or f"CPU ({env.get('cpu', '')})"
    m = report.model
    label = name or (f"{ex.get('model_arg')} measured on {dev}: micro-batch {report.training.batch_size} x "
                     f"seq {report.training.seq_len}, {report.training.precision}, {ex.get('steps')} steps")
    fx: dict[str, Any] = {
        "name": label,
        "source": f"trainmem measure (real run, {ex.get('steps')} steps) on {dev}",
        "model": ex.get("model_arg") or (m.name if m is not None else ""),
    }
    if ex.get("overrides"):
        fx["overrides"] = list(ex["overrides"])
    fx.update({
        "setup": setup,
        "device": "cpu" if env.get("device") == "cpu" else "cuda",
        "steps": ex.get("steps"),
        "seed": ex.get("seed"),
        "empty_cache_each_phase": ex.get("empty_cache_each_phase", False),
        "environment": env,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cuda_context": ex.get("cuda_context"),
        "measured": measured,
    })
    return fx
