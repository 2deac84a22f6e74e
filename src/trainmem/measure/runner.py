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
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..errors import TrainmemError
from ..progress import progress
from ..paths import NotWritten, check_dir, check_file, not_written
from ..report import Component, MemoryReport
from ..spec import Hardware, TrainingSpec, get_gpu
from ..spec.training import report_warnings
from ..spec.resolve import TRAINING_FIELDS, Resolved, resolve
from ..units import parse_bytes
from ..workload import TrainStep, check_supported, hf_factory, prepare_model, step_class
from . import alloc_conf
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


def _inputs(model: Any, training: TrainingSpec | None, overrides: Any,
            options: dict[str, Any]) -> tuple[Resolved, dict[str, Any], Any]:
    """The resolved inputs of ``measure``, the training options to record (all fields of a given
    TrainingSpec, else those given) and the config overrides to record."""
    options.pop("method", None)
    r = resolve(model, training=training, overrides=overrides, **options)
    check_supported(r.training, "measure")
    if r.model.family == "nanogpt":
        raise TrainmemError(f"{r.model.name}: nanoGPT is not a transformers model; measure runs catalogue models "
                            "built with transformers")
    base = training if training is not None else (model.training if isinstance(model, Resolved) else None)
    recorded: dict[str, Any] = {}
    if base is not None:
        recorded = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "extra"}
    recorded.update({k: v for k, v in options.items() if k in TRAINING_FIELDS and v is not None})
    return r, recorded, overrides if overrides is not None else options.get("set")


def _limit_hardware(kind: str, limit: int | None) -> Hardware | None:
    """A memory limit as the "GPU" the fit is judged against (None without one)."""
    if limit is None:
        return None
    return Hardware("cpu-limit" if kind == "cpu" else "memory-limit", limit, 0, "memory limit (--memory-limit)")


def _named_tensors(model: Any, optimizer: Any, batch: Mapping[str, Any] | None) -> dict[int, tuple[str, str]]:
    """data_ptr -> (name, category) for the tensors a training run knows by name."""
    out: dict[int, tuple[str, str]] = {}

    def put(t: Any, name: str, cat: str) -> None:
        """Name the storage of ``t`` (the first name given wins)."""
        t = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
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


def _predicted_fit(r: Resolved, kind: str, limit: int | None, total: int | None, context: int | None,
                   by: str = "auto") -> dict[str, Any]:
    """``trainmem.plan.fit``'s largest micro-batch at this sequence length on this device/limit:
    the GPU the inputs name, else the memory limit, else the measured CUDA device."""
    from ..plan import fit
    by = predictor_for(kind, by)
    base, extra = r, {}
    if by == "trace":
        base = r.replace(optimizer_bucket_mb=None)
        extra["device"] = "cpu" if kind == "cpu" else "cuda"
    if r.hardware is not None:
        hw: dict[str, Any] = {}
        on = r.hardware.name if r.hardware.name != "custom" else f"a {r.hardware.capacity / MiB:.0f} MiB GPU"
    elif limit is not None:
        hw = dict(gpu_memory=limit, context_memory=0)
        on = f"the {limit / MiB:.2f} MiB limit"
    elif kind == "cuda" and total:
        hw = dict(gpu_memory=total, context_memory=max(context or 0, 0))
        on = f"this GPU ({total / MiB:.0f} MiB, context {max(context or 0, 0) / MiB:.0f} MiB)"
    else:
        return {"batch_size": None, "note": "no memory size to fit into (give --gpu, --gpu-memory or --memory-limit)"}
    try:
        res = fit(base, by=by, seq_len=r.training.seq_len, suggestions=False, **hw, **extra)
    except TrainmemError as e:
        return {"batch_size": None, "note": f"trainmem.plan.fit could not answer: {e}"}
    return {"batch_size": res.batch_size, "device_used": res.device_used, "limit": res.limit, "on": on,
            "method": res.method if by == "estimate" else f"trace on {extra['device']}", "by": by, "fits": res.fits,
            "evaluations": res.evaluations}


def save_snapshot(snapshot: Any, pickle_path: str | None = None, html_path: str | None = None) -> list[str]:
    """Write an allocator snapshot (``torch.cuda.memory._snapshot()``) as a pickle (load it in
    https://pytorch.org/memory_viz) and/or as the ``trace_plot`` HTML page. Returns the paths; a
    file that cannot be written raises a one-line ``TrainmemError`` naming it."""
    import pickle
    written = []
    if pickle_path:
        try:
            with open(pickle_path, "wb") as f:
                pickle.dump(snapshot, f)
        except OSError as e:
            raise TrainmemError(not_written(pickle_path, "--snapshot", e)) from None
        written.append(pickle_path)
    if html_path:
        from torch.cuda._memory_viz import trace_plot
        try:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(trace_plot(snapshot))
        except OSError as e:
            raise TrainmemError(not_written(html_path, "--html", e)) from None
        written.append(html_path)
    return written


def _profiler(profile_dir: str | None, kind: str) -> Any:
    """A ``torch.profiler`` context recording memory when ``profile_dir`` is given, else a no-op context."""
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
        env["allocator_settings"] = alloc_conf.settings()  # what PyTorch parsed last (--expandable-segments)
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


@dataclass
class _Run:
    """One measured run: its inputs (``r``, what to record of them, the device, the probe) and
    what it leaves for the report (phases, out-of-memory record, sizes, statistics, files)."""

    r: Resolved
    options: dict[str, Any]
    overrides: Any
    model_arg: Any
    kind: str
    probe: Any
    hw: Hardware | None
    limit: int | None
    steps: int
    seed: int
    empty_cache: bool
    recorder: PhaseRecorder
    warnings: list[str] = field(default_factory=list)
    oom: dict[str, Any] | None = None
    params_b: int = 0
    buffers_b: int = 0
    opt_b: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    not_written: list[str] = field(default_factory=list)  # output files the run could not write, one line each
    on_step: Callable[[int], None] = lambda n: None  # the progress bar: 1 when the model is loaded, 1 per step
    wrap: Callable[[Any], Any] | None = None  # several ranks: DDP / FSDP / TP around the loaded model (distributed.py)


def measure(model: Any, steps: int = 2, *, device: str = "cuda", training: TrainingSpec | None = None,
            overrides: Any = None, gpu: Any = None, gpu_memory: Any = None, context_memory: Any = None,
            max_fraction: float | None = None, memory_limit: Any = None, snapshot: str | None = None,
            html: str | None = None, profile: str | None = None, largest: int = 10, seed: int = 0,
            empty_cache: bool = False, predict_on_oom: bool = True, predict_by: str = "auto", probe: Any = None,
            progress_bar: bool | None = None, **training_options: Any) -> MemoryReport:
    """Run ``steps`` real training steps of a catalogue model and report their memory per phase.

    ``model``: catalogue name, config path, hub id, ModelSpec or ``Resolved``; the options are
    those of ``trainmem.estimate`` (``trainmem.spec.resolve``): ``overrides`` or ``set`` (config
    overrides such as ``["num_hidden_layers=2"]``), the TrainingSpec fields (``batch_size``,
    ``seq_len``, ``precision``, ``optimizer``, ``optimizer_impl``, ``attention``, ``grad_accum``,
    ``recompute``, ``dropout``, ``optimizer_in_backward``) or ``training=``, ``max_fraction``.
    ``device``: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. ``gpu``/``gpu_memory``/``context_memory``:
    the GPU to judge the fit against (on CUDA the device itself by default). ``memory_limit``: a
    size ("64MiB" or bytes) beyond which allocations fail with ``torch.OutOfMemoryError``.
    ``empty_cache``: ``gc.collect()`` + ``torch.cuda.empty_cache()`` after reading each phase, as
    notebooks that print memory after each phase do (Moritz Scherrmann's BERT-large notebook; it lowers reserved memory).
    ``predict_by``: the predictor ``plan.fit`` uses for "what would fit" after an out-of-memory
    error (auto: trace on the CPU, estimate on CUDA). ``probe``: a probe object to use instead of
    the device's (tests). ``snapshot``/``html``/``profile``: output paths, checked before the run;
    one that still cannot be written afterwards raises ``trainmem.paths.NotWritten`` with the
    measured report as its ``report``. ``progress_bar``: a bar on stderr (``trainmem.progress``;
    None: off unless the CLI turned it on). ``expandable_segments=True`` runs the allocator with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``measure.alloc_conf``: set before CUDA is
    initialised; an environment that configures the allocator otherwise is refused).
    """
    predictor_for("cpu", predict_by)
    t0 = time.perf_counter()
    if not isinstance(steps, int) or steps < 1:
        raise TrainmemError(f"--steps must be a positive integer, got {steps!r}")
    kind, index = parse_device(device)
    given = overrides
    r, options, overrides = _inputs(model, training, overrides, dict(training_options, gpu=gpu, gpu_memory=gpu_memory,
                                                                     context_memory=context_memory,
                                                                     max_fraction=max_fraction))
    from .distributed import check_layout, launcher_env, measure_rank, needs_launcher, several
    mixer_note = _mixer_path(r.model.model_type, r.training, kind)  # (refuses a fused path that cannot run)
    alloc_warnings = alloc_conf.apply(r.training.expandable_segments, kind)  # before CUDA is initialised
    alloc_warnings = mixer_note + list(alloc_warnings)
    alloc_conf.apply_cublas(r.training.cublas_workspace_config, kind)  # before the first matmul
    env = launcher_env()
    if probe is None and ((env is not None and env["world_size"] > 1) or several(r.training)):
        if env is None:
            check_layout(r.model, r.training, r.training.dp * r.training.tp)  # what no launcher would mend
            raise TrainmemError(needs_launcher(r.training))
        # one rank of torch.distributed: the wrappers, then every rank's report gathered on rank 0
        return measure_rank(model, steps, device=device, training=training, overrides=given, gpu=gpu,
                            gpu_memory=gpu_memory, context_memory=context_memory, max_fraction=max_fraction,
                            memory_limit=memory_limit, snapshot=snapshot, html=html, profile=profile, largest=largest,
                            seed=seed, empty_cache=empty_cache, predict_on_oom=predict_on_oom, predict_by=predict_by,
                            progress_bar=progress_bar, env=env, **training_options)
    limit = _check_outputs(kind, memory_limit, snapshot, html, profile)
    if probe is None:
        probe = CpuProbe(limit) if kind == "cpu" else CudaProbe(index, limit, record_history=bool(snapshot or html))
    run = _Run(r, options, overrides, model, kind, probe, r.hardware or _limit_hardware(kind, limit), limit, steps,
               seed, empty_cache, PhaseRecorder(probe, r.training.grad_accum, empty_cache),
               _not_applied(r.training) + alloc_warnings)
    torch.manual_seed(seed)
    with progress(steps + 1, "measure", progress_bar) as bar:
        run.on_step = bar.update
        _run(run, largest, snapshot, html, profile)
    probe.empty_cache()
    report = _report(run, time.perf_counter() - t0, predict_on_oom, predict_by)
    if run.not_written:  # the measurement is kept: the error carries the report
        raise NotWritten(run.not_written[0], report)
    return report


def _check_outputs(kind: str, memory_limit: Any, snapshot: str | None, html: str | None,
                   profile: str | None) -> int | None:
    """Check the memory limit and the output paths before anything runs; the limit in bytes."""
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    if limit is not None and limit <= 0:
        raise TrainmemError("--memory-limit must be a positive size")
    if (snapshot or html) and kind != "cuda":
        raise TrainmemError("--snapshot and --html need --device cuda: they record the CUDA caching allocator's "
                            "history (torch.cuda.memory._record_memory_history); on the CPU use --profile DIR")
    for path, option in ((snapshot, "--snapshot"), (html, "--html")):
        if path:
            check_file(path, option)
    if profile:
        check_dir(profile, "--profile")
    return limit


def _mixer_path(model_type: str, t: TrainingSpec, kind: str) -> list[str]:
    """The mixer path the installed packages make a state-space model's run take (``spec.kernel_paths``:
    transformers 5.24 takes mamba-ssm's fused Functions when they import), as a report line; ``--mixer-kernels
    fused`` refused in one line where they do not."""
    import importlib.util
    from ..spec.kernel_paths import KERNEL_PACKAGES, PACKAGE_MODULES, measured_path_note
    packages = KERNEL_PACKAGES.get(model_type, ())
    installed = bool(packages) and all(importlib.util.find_spec(PACKAGE_MODULES[p]) for p in packages)
    note = measured_path_note(model_type, t.mixer_kernels, installed, kind == "cuda")
    return [note] if note else []


def _not_applied(t: TrainingSpec) -> list[str]:
    """Warnings for the training options the measured (eager, one-piece-loss) step does not apply."""
    warnings = report_warnings(t)
    return warnings  # --compile and --loss fused are refused (workload.check_supported); the rest is applied


def _run(run: _Run, largest: int, snapshot: str | None, html: str | None, profile: str | None) -> None:
    """Train inside the probe (and the profiler, when asked); write the profile; read the environment."""
    with run.probe:
        with _profiler(profile, run.kind) as prof:
            _train(run, largest, snapshot, html)
        if prof is not None:
            path = os.path.join(profile, f"trainmem-measure-{run.r.model.name}-{run.kind}.json".replace("/", "_"))
            try:
                prof.export_chrome_trace(path)
                run.written.append(path)
            except OSError as e:
                run.not_written.append(not_written(path, "--profile", e))
        run.env = environment(run.kind, run.probe)


def _train(run: _Run, largest: int, snapshot: str | None, html: str | None) -> None:
    """Build the model, load it, run the steps phase by phase (an out-of-memory error is recorded in
    ``run.oom``), save the allocator snapshot, then free everything and read the allocator's stats."""
    probe, recorder, m, t = run.probe, run.recorder, run.r.model, run.r.training
    module: Any = None
    step: TrainStep | None = None
    snap: Any = None
    try:
        module = hf_factory(m, t)()
        # --layer-rope-cache, peft's LoRA (--lora-rank), litgpt's linears (--fused-qkv, --split-gate-up),
        # as trace builds it (workload.prepare_model)
        module = prepare_model(module, m, t)
        if run.kind == "cuda":
            module.to(probe.device)
        if run.wrap is not None:
            module = run.wrap(module)
        module.train()
        run.params_b = tensor_bytes(module.parameters())
        run.buffers_b = tensor_bytes(module.buffers())
        recorder.mark("model_loaded", 0)
        run.on_step(1)
        # the batch is made where the probe's device is: "cuda" (the current device) or "cpu"
        # (--trainer: TRL's DPOTrainer or RewardTrainer step, workload.step_class)
        step = step_class(t)(module, m, t, probe.device.type, on_phase=recorder.mark, what="measure")
        st = step.state
        recorder.watch([p for p in module.parameters() if p.requires_grad], step.optimizer,
                       lambda: tensor_bytes(st.get("batch", {}).values()))
        for i in range(1, run.steps + 1):
            step(i)
            run.on_step(1)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_oom(e):
            raise
        run.oom = _oom_record(e, probe, recorder, module, step, largest)
        if snapshot or html:  # while the step's tensors are still alive
            snap = torch.cuda.memory._snapshot(probe.device)
        del e
    finally:
        recorder.unwatch()
    if snapshot or html:
        if snap is None:
            snap = torch.cuda.memory._snapshot(probe.device)
        try:
            run.written += save_snapshot(snap, snapshot, html)
        except TrainmemError as e:
            run.not_written.append(str(e))
        del snap
    run.opt_b = tensor_bytes(optimizer_tensors(step.optimizer if step else None))
    if step is not None:
        remove = getattr(step.optimizer, "remove", None)
        if callable(remove):
            remove()  # optimizer-in-backward hooks
        step.release()
    del step, module
    run.stats = probe.stats()


def _oom_record(e: BaseException, probe: Any, recorder: PhaseRecorder, module: Any, step: TrainStep | None,
                largest: int) -> dict[str, Any]:
    """What an out-of-memory error leaves to report: the phase, the message, the refused request,
    the peak so far and what was live."""
    msg = str(e).strip()
    return {"phase": recorder.in_progress, "message": msg.splitlines()[0][:500] if msg else type(e).__name__,
            "requested": requested_bytes(msg, probe),
            "peak_allocated": max([r.phase.peak for r in recorder.records] + [probe.peak()]),
            **live_tensors(probe, module, step.optimizer if step else None,
                           step.state.get("batch") if step else None, largest)}


def _report(run: _Run, runtime: float, predict_on_oom: bool, predict_by: str) -> MemoryReport:
    """The MemoryReport of a measured run: peaks, components, device memory, the out-of-memory outcome."""
    records, oom, cuda = run.recorder.records, run.oom, run.kind == "cuda"
    best = run.recorder.peak_record()
    peak_alloc = max([p.peak for p in run.recorder.phases] + [oom["peak_allocated"] if oom else 0])
    peak_res = None
    if cuda:
        peak_res = max([r.peak_reserved or 0 for r in records] + [(oom or {}).get("reserved") or 0])
    contexts = [r.context for r in records if r.context is not None]
    context = contexts[-1] if contexts else None
    comps = _components(run, best)
    if cuda and peak_res is not None and peak_res > peak_alloc:
        comps.append(Component("allocator_overhead", "allocator_overhead", peak_res - peak_alloc, None,
                               "peak reserved − peak allocated (cached blocks, segment rounding)"))
    if cuda and context is not None:
        comps.append(Component("cuda_context", "cuda_context", context, None,
                               "driver's figure − reserved at the last phase (CUDA context, kernels, NCCL/cuBLAS "
                               "handles outside the allocator)", True))
    device_used = peak_res + context if (cuda and peak_res is not None and context is not None) else None
    hw = run.hw
    if cuda and hw is None and getattr(run.probe, "total", 0):
        hw = Hardware(str(run.env.get("gpu") or "cuda"), int(run.probe.total), max(context or 0, 0),
                      "measured device")
    if oom is not None:
        device_used = _oom_outcome(run, hw, context, device_used, predict_on_oom, predict_by)
    peak_phase = peak_where = ""
    if best is not None and best.phase.peak >= peak_alloc:
        peak_phase, peak_where = f"{best.phase.name}@{best.phase.step}", best.phase.where
    elif oom is not None:
        peak_phase, peak_where = oom["phase"], "when it ran out of memory"
    return MemoryReport(
        source="measure", components=comps, phases=run.recorder.phases, peak_allocated=int(peak_alloc),
        peak_reserved=peak_res, device_used=device_used, peak_phase=peak_phase, peak_where=peak_where,
        capacity=hw.capacity if hw is not None else None, max_fraction=run.r.max_fraction, method="measure",
        model=run.r.model, training=run.r.training, hardware=hw, warnings=run.warnings,
        extra=_extra(run, runtime, context))


def _components(run: _Run, best: Any) -> list[Component]:
    """The named parts of the peak phase (parameters, buffers, gradients, optimizer states, the
    batch) and the rest of it as one activations amount."""
    if best is None:
        return []
    ph = best.phase
    parts = [("parameters", "parameters", run.params_b, "the model's parameters (distinct storages)", True),
             ("buffers", "buffers", run.buffers_b, "the model's buffers", True),
             ("gradients", "gradients", best.gradients_at_peak,
              "gradients alive at the peak (to within one gradient tensor)", True),
             ("optimizer_states", "optimizer_states", best.states_at_peak, "optimizer states alive at the peak", True),
             ("inputs", "inputs", best.inputs if ph.step > 0 else 0, "the batch", False)]
    comps: list[Component] = []
    known = 0
    for name, cat, b, formula, persistent in parts:
        if b:
            comps.append(Component(name, cat, int(b), None, formula, persistent))
            known += b
    rest = ph.peak - known
    if rest < 0:
        run.warnings.append(f"the peak ({ph.peak} B) is below the named tensors ({known} B): memory from before "
                            "the run was freed during it?")
    elif rest:
        comps.append(Component("activations.other", "activations", rest, None,
                               "the rest of the peak: activations saved for backward, logits and temporaries "
                               "(a measurement sees bytes, not their purpose)"))
    return comps


def _oom_outcome(run: _Run, hw: Hardware | None, context: int | None, device_used: int | None,
                 predict_on_oom: bool, predict_by: str) -> int | None:
    """After an out-of-memory error: warn, predict what would fit, and return the device memory the
    step needed at least (what it held plus the refused allocation)."""
    oom, probe = run.oom, run.probe
    assert oom is not None
    run.warnings.insert(0, f"out of memory in {oom['phase']}: {oom['message']}")
    if predict_on_oom:
        oom["fit"] = _predicted_fit(run.r, run.kind, run.limit, getattr(probe, "total", None), context, predict_by)
    lb = getattr(probe, "lb", None)
    if run.kind == "cuda":
        held = (oom.get("reserved") or 0) + max(context or 0, 0)
    elif lb is not None and getattr(lb, "failed_request", 0):
        held = lb.failed_current
    else:
        held = oom.get("allocated", 0)
    if oom.get("requested"):
        needed = held + oom["requested"]
    else:
        needed = hw.capacity + 1 if hw is not None else None
    if needed is None:
        return device_used
    oom["needed_at_least"] = needed
    return max(device_used or 0, needed)


def _extra(run: _Run, runtime: float, context: int | None) -> dict[str, Any]:
    """The report's ``extra``: phases, the out-of-memory record, environment, files, the inputs."""
    extra: dict[str, Any] = {
        "device": run.kind if run.kind == "cpu" else str(run.probe.device),
        "steps": run.steps,
        "seed": run.seed,
        "phases": [r.to_dict() for r in run.recorder.records],
        "oom": run.oom,
        "optimizer_states_bytes": run.opt_b,
        "allocator": run.stats,
        "environment": run.env,
        "notes": list(getattr(run.probe, "notes", [])),
        "files": run.written,
        "runtime_s": round(runtime, 3),
        "model_arg": run.model_arg if isinstance(run.model_arg, str) else run.r.model.name,
        "overrides": list(run.overrides) if isinstance(run.overrides, (list, tuple)) else run.overrides,
        "options": run.options,
        "empty_cache_each_phase": run.empty_cache,
    }
    if run.kind == "cuda":
        extra["cuda_context"] = context
    return extra


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
    training_options.pop("batch_size", None)
    kind, _ = parse_device(device)
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    if kind == "cpu" and limit is None:
        raise TrainmemError("--find-max-batch on the CPU needs --memory-limit SIZE (the CPU has no fixed memory "
                            "to run out of)")
    if not isinstance(batch_cap, int) or batch_cap < 1:
        raise TrainmemError(f"batch cap must be a positive integer, got {batch_cap!r}")
    training_options.pop("method", None)
    r = resolve(model, overrides=overrides, gpu=gpu, gpu_memory=gpu_memory, context_memory=context_memory,
                **training_options)
    tries: list[dict[str, Any]] = []
    last: dict[str, MemoryReport] = {}

    def runs(b: int) -> bool:
        """Measure micro-batch ``b``; record the try; True when it ran without running out of memory."""
        rep = measure(r, steps, device=device, memory_limit=limit, predict_on_oom=False, batch_size=b)
        oom = rep.extra["oom"]
        row = {"batch_size": b, "ok": oom is None, "peak_allocated": rep.peak_allocated,
               "peak_reserved": rep.peak_reserved, "oom_phase": oom["phase"] if oom else None,
               "runtime_s": rep.extra["runtime_s"]}
        tries.append(row)
        if on_try is not None:
            on_try(row)
        last["ok" if oom is None else "bad"] = rep
        return oom is None

    best, first_bad = search_max(runs, batch_cap)
    ref = last.get("ok") or last.get("bad")
    ctx = ref.extra.get("cuda_context") if ref is not None else None
    total = ref.extra["environment"].get("gpu_memory_total") if ref is not None else None
    predicted = _predicted_fit(r, kind, limit, total, ctx, predict_by)
    return {"model": r.model.name, "device": device, "seq_len": r.training.seq_len, "steps": steps,
            "limit": limit, "measured_max": best, "first_failing": first_bad,
            "limited_by": "memory" if first_bad is not None else "batch_cap", "batch_cap": batch_cap,
            "predicted_max": predicted.get("batch_size"), "prediction": predicted, "tries": tries}


# ----- validation fixtures --------------------------------------------------------------------------------
def fixture_model(model: Any, path: str | None) -> Any:
    """The ``model`` entry of a fixture to be written at ``path``: a local config file or model
    directory (not a catalogue name) as a path relative to the fixture's folder, so that
    ``trainmem validate`` finds it from any directory; anything else unchanged."""
    from ..spec.config import catalogue_names
    if path is None or not isinstance(model, str) or model.strip().lower() in catalogue_names() \
            or not os.path.exists(model):
        return model
    return os.path.relpath(os.path.abspath(model), os.path.dirname(os.path.abspath(path)))


def fixture(report: MemoryReport, command: str = "", name: str | None = None, path: str | None = None) -> dict[str, Any]:
    """A validation fixture (the format ``trainmem.validate`` reads) of a measured report: model,
    overrides, setup (the estimate/trace options), the measured quantities in bytes, and the full
    metadata (device, driver, CUDA, torch and transformers versions, the command). ``path``: where
    it will be written (a local model path is then stored relative to it, :func:`fixture_model`)."""
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
        "model": fixture_model(ex.get("model_arg"), path) or (m.name if m is not None else ""),
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
