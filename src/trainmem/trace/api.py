"""``trace``: run the real training step on tensors without data and report its memory.

The model is real (transformers or your own ``nn.Module``), autograd is real, the optimizer is
``torch.optim``'s; only the tensors are empty (``meta`` storages for an emulated CUDA device,
``FakeTensor``\\ s for the CPU). Every allocation and free goes through an allocator simulation, so the
result is what ``torch.cuda.memory_allocated()`` / ``memory_reserved()`` would show on a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..errors import TrainmemError
from ..report import Component, MemoryReport, Phase
from ..spec import Hardware, ModelSpec, TrainingSpec
from ..spec.config import input_notes
from ..spec.kernel_paths import reference_path_note
from ..spec.training import fused_skipped, report_warnings
from ..progress import progress
from ..spec.resolve import TRAINING_FIELDS, Resolved, resolve, resolve_setup
from ..allocator import CachingAllocator, ExactAllocator, SimulatedOutOfMemory
from .cuda import EMULATED, CudaEmulation, _patched, cuda_environment
from . import compiled
from . import distributed as _dist
from ..spec.hardware import default_cublas_workspace, handle_workspace
from .tracker import CUBLAS_WORKSPACE, Record, Tracker, module_pattern
# model building, optimizer and training step: shared with ``measure`` (trainmem.workload)
from ..workload import DROPOUT_KEYS as _DROPOUT_KEYS  # noqa: F401
from ..workload import check_supported as _check_supported
from ..workload import hf_config as _hf_config  # noqa: F401
from ..workload import hf_factory as _hf_factory
from ..workload import prepare_model
from ..workload import attention_implementation as _attention_implementation
from ..workload import padded_steps, step_failure
from ..workload import hf_step as _hf_step
from ..workload import make_optimizer, optimizer_class  # noqa: F401

_PERSISTENT = {"parameters", "buffers", "gradients", "optimizer_states", "master_weights", "workspace"}
#: micro-batches traced per optimizer step under gradient accumulation. The first creates the
#: gradients; from the second on each micro-batch finds them allocated and the previous one's
#: output in the same state, so later ones repeat the same allocations and frees (same shapes,
#: same order). The simulated allocator's reserved memory can still grow once, at the second or
#: the third (tests/test_trace_accumulation.py); the fourth is traced to show it has settled.
#: Tracing all of them (often 8-128) only multiplied the run time.
TRACED_MICRO_BATCHES = 4


#: the training options a user's step function is said to ignore (the allocator's mode applies to it too)
_STEP_OPTIONS = TRAINING_FIELDS - {"expandable_segments"}


def trace(model: Any, step_fn: Callable | None = None, steps: int = 2, *, device: str = "cuda",
          training: TrainingSpec | None = None, hardware: Hardware | None = None, gpu: Any = None,
          gpu_memory: Any = None, context_memory: Any = None, max_fraction: float | None = None,
          optimizer_fn: Callable | None = None, overrides: Any = None,
          max_split_size: int | None = None, cublas_workspace: int | None = None,
          attention_backend: str | None = None, capability: tuple[int, int] | None = None,
          simulate_oom: bool = False, timeline_points: int = 4000, largest: int = 20, rank: int = 0,
          **training_options: Any) -> MemoryReport:
    """Trace ``steps`` training steps and return their memory as a :class:`MemoryReport`.

    ``model``: a catalogue name, config path, hub id, :class:`ModelSpec` or ``Resolved`` (the
    transformers model its ``architectures`` names is built from the config, and trainmem writes
    the training step from the training options), or a zero-argument factory returning your
    ``nn.Module`` together with ``step_fn``. ``step_fn(model)``, ``step_fn(model, optimizer)`` or
    ``step_fn(model, optimizer, step)`` runs one step (forward, backward, optimizer step, zero_grad);
    ``optimizer`` is what ``optimizer_fn(model)`` returned (None without one). Write it for CUDA:
    ``device="cuda"`` tensors, ``torch.autocast("cuda")`` — the emulation handles it.

    Options are those of ``trainmem.estimate`` (``trainmem.spec.resolve``): the
    :class:`TrainingSpec` fields (``batch_size``, ``seq_len``, ``precision``, ``optimizer``,
    ``optimizer_impl``, ``recompute``, ``grad_accum``, ``attention``, ``dropout``,
    ``optimizer_in_backward`` ...) or ``training=`` a TrainingSpec; ``set``/``overrides`` (config
    overrides); the GPU as ``gpu`` (name or Hardware), ``gpu_memory``, ``context_memory`` or
    ``hardware``; ``max_fraction``. ``method`` is accepted and ignored.

    ``device="cuda"`` emulates one GPU (caching allocator, autocast policy, cuBLAS workspaces,
    fused dropout, SDPA backends, foreach optimizers); ``device="cpu"`` traces the same program for
    the CPU, byte-exact, with no CUDA behaviour. A GPU adds device_used (reserved + CUDA context)
    and the fit verdict; on a Hopper GPU the cuBLAS workspace is 32 MiB per handle (PyTorch's
    default there), else 8,519,680 B, unless ``cublas_workspace`` or a calibration profile
    (``calibration=FILE``, ``Hardware.cublas_workspace``) says otherwise.
    ``simulate_oom=True`` limits the simulated device to the GPU's capacity minus its CUDA context:
    near the limit the allocator frees its cache and retries as PyTorch does, and a step that does
    not fit stops at the simulated out-of-memory (reported in ``warnings``). ``expandable_segments``
    (a TrainingSpec field, refused on the CPU) and ``max_split_size`` mirror ``PYTORCH_CUDA_ALLOC_CONF``.
    With data or tensor parallelism (``dp`` > 1, ``fsdp`` with FSDP2 or, ``fsdp_version=1``, FSDP1,
    ``tp`` > 1 with or without ``sequence_parallel``) the step runs on a fake process group of ``dp`` × ``tp`` ranks
    (``trace.distributed``) as rank ``rank`` (default 0, the worst: FSDP2 and DTensor give it the
    largest shards); ``extra["ranks"]`` lists every rank, the others as copies of the traced one.
    With ``pp`` > 1 each stage is a rank of a fake group of ``pp`` (× ``dp``: DDP replicas or FSDP2
    shards of each; × ``tp``: tensor-parallel stages; both on a (pp, dp, tp) mesh) running torch's
    ``PipelineStage`` and its schedule (``pp_schedule``): the first and the last stage (stage 1 too
    under torchtitan's weighted split; and ``rank``) are traced, one after the other, and the report
    is the worst one's, with every traced stage in ``extra["ranks"]``.
    """
    t0 = time.perf_counter()
    if device not in ("cuda", "cpu"):
        raise TrainmemError(f"trace device {device!r}: use 'cuda' (emulated GPU) or 'cpu'")
    if not isinstance(steps, int) or steps < 1:
        raise TrainmemError(f"steps must be a positive integer, got {steps!r}")
    options = dict(training_options, training=training, hardware=hardware, gpu=gpu, gpu_memory=gpu_memory,
                   context_memory=context_memory, max_fraction=max_fraction, overrides=overrides)
    options_given = any(options.get(k) is not None for k in _STEP_OPTIONS | {"training"})
    spec, t, hw, fraction = _inputs(model, options)
    _check_supported(t)
    steps = _steps_run(spec, t, steps)
    _dist.check(t, spec, device)
    _dist.check_rank(t, rank)
    factory = _factory(model, spec, t, step_fn)
    if t.compile:
        compiled.setup(t, spec, device)
    device_options = (device == "cuda", hw, t, t.expandable_segments, max_split_size, cublas_workspace,
                      attention_backend, capability, simulate_oom)
    run = functools.partial(_trace_rank, factory, spec, t, hw, device_options, step_fn, optimizer_fn, steps,
                            t if (spec is not None or options_given) else None, (timeline_points, largest))
    if t.pp > 1:  # the first stage and the last (and rank), each a rank of the fake group (trace.distributed)
        reports = {r: run(r, t0) for r in _dist.pipeline_ranks(t, rank)}
        report = _dist.pipeline_report(reports, t)
    else:
        report = run(rank, t0)
        if _dist.distributed(t):
            _dist.annotate(report, t, rank)
    report.max_fraction = fraction
    _add_notes(report, spec, t, options_given)
    return report


def _add_notes(report: MemoryReport, spec: ModelSpec | None, t: TrainingSpec, options_given: bool) -> None:
    """The report's warnings on what ran: the attention implementation transformers took, the reference
    path of a state-space or linear-attention mixer (``spec.kernel_paths``), and that a user step
    function decides the training options."""
    if spec is not None:
        mixer = reference_path_note(spec.model_type, t.mixer_kernels, fused_skipped(spec, t))
        for note in (_attention_implementation(spec, t)[1], mixer):
            if note:
                report.warnings.append(note)
    if spec is None and options_given:
        report.warnings.append("training options are recorded but not applied to a user step_fn: "
                               "the step function decides batch, precision and optimizer")


def _steps_run(spec: ModelSpec | None, t: TrainingSpec, steps: int) -> int:
    """The steps a model's trace runs: ``steps``, and with ``min_seq_len`` at least the two steps at
    ``seq_len`` and then the steps of micro-batches padded to varying lengths (``workload.padded_steps``,
    run by ``workload.TrainStep._step``)."""
    if spec is None or t.min_seq_len is None:
        return steps
    return max(steps, 2 + len(padded_steps(t)))


def _trace_rank(factory: Callable, spec: ModelSpec | None, t: TrainingSpec, hw: Hardware | None,
                device_options: tuple, step_fn: Callable | None, optimizer_fn: Callable | None, steps: int,
                recorded: TrainingSpec | None, shown: tuple[int, int], rank: int, t0: float) -> MemoryReport:
    """One rank's trace on a device of its own: the model built (wrapped, sharded or cut to this
    rank's pipeline stage) and ``steps`` steps run; on a fake group of the layout's ranks when
    ``t`` is distributed. ``recorded``: the TrainingSpec the report records; ``shown``: (timeline
    points, largest tensors listed)."""
    dev = _device(*device_options)
    several = _dist.distributed(t)
    with progress(steps + 1, "trace") as bar, dev.env, \
            (dev.emulation if dev.emulation is not None else contextlib.nullcontext()), \
            (_dist.fake_group(_dist.world_size(t), rank) if several else contextlib.nullcontext()), \
            _patched(_dist.patches(dev.tracker) if several else {}), _deepspeed(t, dev, rank):
        module = _build(dev, factory, spec, t)
        bar.update(1)  # the model is built
        oom = _run_steps(dev, module, spec, t, step_fn, optimizer_fn, steps, bar.update)
    return _report(dev.tracker, dev.allocator, spec, recorded, hw, dev.cuda, dev.emulation,
                   time.perf_counter() - t0, shown[0], shown[1], oom, dev.cublas_workspace, device_options[3])


@contextlib.contextmanager
def _deepspeed(t: TrainingSpec, dev: "_Device", rank: int) -> Any:
    """With ``--zero`` (no ``--fsdp``): the launcher's environment for this rank and DeepSpeed's
    patches (``trace.deepspeed_engine``); nothing otherwise (DeepSpeed is not imported)."""
    from . import deepspeed_engine
    if not deepspeed_engine.uses_deepspeed(t):
        yield
        return
    with deepspeed_engine.environment(rank, _dist.world_size(t)), \
            _patched(deepspeed_engine.patches(dev.tracker, dev.emulation)):
        yield


# ----- inputs ---------------------------------------------------------------------------------------
def _inputs(model: Any, options: dict[str, Any]) -> tuple[ModelSpec | None, TrainingSpec, Hardware | None, float]:
    """The model (None for a factory), training setup, GPU and max fraction of trace's options."""
    if isinstance(model, (str, os.PathLike, ModelSpec, Mapping, Resolved)):
        r = resolve(model, **options)
        if r.model.family == "nanogpt":
            raise TrainmemError(f"{r.model.name}: nanoGPT is not a transformers model; pass a factory returning "
                                f"your nanoGPT module and a step_fn (see trainmem.trace.trace)")
        if r.model.manual_layernorm:
            raise TrainmemError(f"{r.model.name}: its Python-op LayerNorm (_trainmem.manual_layernorm) is not "
                                f"transformers' GPT-2; pass a factory returning your module and a step_fn")
        return r.model, r.training, r.hardware, r.max_fraction
    if isinstance(model, torch.nn.Module):
        raise TrainmemError("pass a factory (a function returning the module), not a built module: the trace "
                            "builds the model itself, without memory")
    if callable(model):
        t, hw, fraction = resolve_setup(**options)
        return None, t, hw, fraction
    raise TrainmemError(f"model must be a name, config, ModelSpec or factory, got {type(model).__name__}")


def _factory(model: Any, spec: ModelSpec | None, t: TrainingSpec, step_fn: Callable | None) -> Callable:
    """The zero-argument function that builds the module: transformers' for a spec, else ``model``."""
    if spec is not None:
        if step_fn is not None:
            raise TrainmemError("step_fn is for your own model factory; for a catalogue model trainmem writes "
                                "the training step from the training options")
        return _hf_factory(spec, t)
    if step_fn is None:
        raise TrainmemError("a model factory needs a step_fn(model, optimizer) that runs one training step")
    return model


# ----- the simulated device -------------------------------------------------------------------------
@dataclass
class _Device:
    """One trace's device: the allocator simulation, the tracker, the CUDA emulation (None on the
    CPU), the context that installs it, and the context the model is built in."""

    cuda: bool
    allocator: Any
    tracker: Tracker
    emulation: CudaEmulation | None
    env: Any
    build_ctx: Any
    cublas_workspace: int


def _device(cuda: bool, hw: Hardware | None, t: TrainingSpec, expandable_segments: bool,
            max_split_size: int | None, cublas_workspace: int | None, attention_backend: str | None,
            capability: tuple[int, int] | None, simulate_oom: bool) -> _Device:
    """The emulated GPU (``cuda``) or the fake-tensor CPU the trace runs on."""
    if not cuda:
        if expandable_segments:  # the CPU trace counts bytes exactly, with no caching allocator
            raise TrainmemError("--expandable-segments configures the CUDA caching allocator, which a --device cpu "
                                "trace does not emulate: give --no-expandable-segments, or trace on --device cuda")
        from torch._subclasses.fake_tensor import FakeTensorMode
        allocator = ExactAllocator()
        return _Device(False, allocator, Tracker(allocator, device_type="cpu"), None, contextlib.nullcontext(),
                       FakeTensorMode(allow_non_fake_inputs=True), cublas_workspace or 0)
    if capability is None:
        # the catalogue's compute capability (gpus.json); sm80 when the GPU is unknown or not given
        capability = hw.capability if hw is not None and hw.capability else (8, 0)
    if cublas_workspace is None:  # --cublas-workspace-config, a calibration profile's, PyTorch's default
        cublas_workspace = handle_workspace(hw, t)
    if cublas_workspace is None:  # no GPU given: the capability trace emulates
        cublas_workspace = default_cublas_workspace(capability, t.torch_release)
    flag = None  # the --attention value that pins the backend, named in PyTorch's refusals
    if attention_backend is None:
        from ..estimate.layers import SDPA_PINS  # --attention -> the backend it pins
        attention_backend = SDPA_PINS.get(t.attention)
        flag = t.attention if attention_backend else None
    if simulate_oom and hw is None:
        raise TrainmemError("simulate_oom needs a GPU (gpu= or hardware=) for its capacity")
    allocator = CachingAllocator(expandable_segments=expandable_segments, max_split_size=max_split_size,
                                 capacity=hw.capacity - hw.context if (simulate_oom and hw is not None) else None)
    tracker = Tracker(allocator, device_type=EMULATED, cublas_workspace=cublas_workspace, emulate_cuda_kernels=True)
    emulation = CudaEmulation(tracker, attention_backend=attention_backend, capability=capability,
                              attention_flag=flag, attention_call=t.attention_call,
                              math_upcast=t.math_sdpa_upcasts)
    env = cuda_environment(allocator, capability=capability, emulation=emulation,
                           capacity=hw.capacity if hw else None)
    return _Device(True, allocator, tracker, emulation, env, torch.device(EMULATED), cublas_workspace)


# ----- the run --------------------------------------------------------------------------------------
def _cast(module: torch.nn.Module, spec: ModelSpec | None, t: TrainingSpec) -> None:
    """Pure bf16/fp16 training: a catalogue model's weights in that dtype."""
    if spec is not None and t.precision in ("bf16", "fp16"):
        module.to(torch.bfloat16 if t.precision == "bf16" else torch.float16)


def _build(dev: _Device, factory: Callable, spec: ModelSpec | None, t: TrainingSpec) -> torch.nn.Module:
    """Build the module and count its parameters and buffers as loading them would allocate them:
    on the emulated GPU as ``model.to("cuda")`` moves them, on the CPU as they are created. With
    data parallelism the module returned is the wrapped one (FSDP2 shards it before it is loaded,
    so only the shards are counted; DDP wraps the loaded model and allocates its buckets)."""
    tracker = dev.tracker
    if dev.cuda and _dist.deepspeed_engine.builds_under_init(t):
        return _build_under_zero_init(dev, factory, spec, t)
    if dev.cuda:
        with dev.build_ctx:
            module = factory()
            module = _as_module(module)
            _on_device(module)
            _cast(module, spec, t)
            if spec is not None:  # the rope buffers, 4-bit linears, LoRA and litgpt's linears
                module = prepare_model(module, spec, t)
        wrapped = _dist.wrap(module, spec, t, tracker) if _dist.sharded_unloaded(t) else module
        tracker.name_modules(module)
        with tracker:
            _load_to_device(tracker, wrapped)
        if _dist.wraps_loaded(t):  # DDP wraps the loaded model (each pipeline stage's module)
            names = {id(m): tracker.module_names.get(id(m), "") for m in _dist.ddp_targets(wrapped, t)}
            wrapped = _dist.wrap_loaded(wrapped, t, tracker)
            for ddp_module in _dist.ddp_targets(wrapped, t):  # the modules keep their names under DDP's wrapper
                tracker.module_names[id(ddp_module)] = names[id(ddp_module.module)]
        return wrapped
    if spec is not None and t.lora_rank:
        raise TrainmemError("trace --device cpu cannot wrap the model with peft under its byte counter "
                            "(peft moves modules with tensor swaps); trace LoRA with --device cuda")
    with dev.build_ctx, tracker:
        module = _as_module(factory())
        _cast(module, spec, t)
        if spec is not None:  # (--lora-rank refused above, and with it --quantize, which needs it)
            module = prepare_model(module, spec, t)
        _mark_model(tracker, module)
    tracker.name_modules(module)
    return module


def _build_under_zero_init(dev: _Device, factory: Callable, spec: ModelSpec | None, t: TrainingSpec
                           ) -> torch.nn.Module:
    """DeepSpeed ZeRO-3 with ``--zero-init on``: transformers builds the model under ``deepspeed.zero.Init``
    (``trace.deepspeed_engine.zero_init_build``) inside the tracker, on the emulated GPU (zero.Init
    creates every tensor on the accelerator, not on ``meta``: no build device), so the ``model_loaded``
    phase holds each parameter made whole and partitioned, the buffers, and transformers' weight
    init; nothing is moved afterwards (the engine leaves a zero.Init model where it is). Then
    ``deepspeed.initialize`` as for a loaded model (``distributed.wrap_loaded``)."""
    from . import deepspeed_engine
    tracker = dev.tracker
    with deepspeed_engine.zero_init_build(t), tracker:
        # (no ``_cast``: zero.Init makes the parameters in the config's dtype, and the engine keeps fp32
        # buffers such as RoPE's inv_freq, engine.py ``_cast_module_mixed_precision`` L1851-1875)
        module = _as_module(factory())
        if spec is not None:  # (options adding modules after the build are refused: deepspeed_engine.check)
            module = prepare_model(module, spec, t)
    tracker.name_modules(module)
    deepspeed_engine.mark_partitions(module, tracker)
    return _dist.wrap_loaded(module, t, tracker)


def _te_workspace(module: torch.nn.Module, tracker: Tracker) -> Any:
    """Transformer Engine's GEMM workspace under ``--transformer-impl transformer_engine`` (Megatron-LM's
    default layers), which the transformers model trace runs does not allocate: one ``torch.empty`` of
    ``get_cublas_workspace_size_bytes()`` uint8 at the first GEMM, cached and never freed
    (transformer_engine/pytorch/cpp_extensions/gemm.py L34-61 at v2.16; ``estimate.megatron_buffers``),
    made here at the model's first forward on the emulated GPU's compute capability. Returns the hook's
    handle (removed when the trace ends; the workspace stays with the module, as TE's cache does)."""
    from ..estimate.megatron_buffers import te_workspace

    def first_forward(mod: torch.nn.Module, args: Any) -> None:
        if not hasattr(mod, "_trainmem_te_workspace"):
            with tracker.scope("workspace", "transformer_engine"):
                size = te_workspace(tuple(torch.cuda.get_device_capability()))
                mod._trainmem_te_workspace = torch.empty(size, dtype=torch.uint8, device="cuda")
    return module.register_forward_pre_hook(first_forward)


def _example_meta_uncounted(dev: _Device, t: TrainingSpec) -> dict[tuple[Any, str], Any]:
    """Under ``--pp`` on the emulated GPU: the ``device="meta"`` example tensors the pipeline step
    gives ``PipelineStage`` (``workload.PipelineTrainStep._example``: ``input_args``/``output_args``,
    the last stage's a whole (b, s, vocab) logits) are the real meta device, no memory on a GPU
    (torch 2.13 ``distributed/pipelining/stage.py`` ``PipelineStage.__init__`` keeps only their
    metadata). Counted, the last stage's opened a logits-sized segment at model load. Found by
    trace: qwen2.5-1.5b (4 layers) --pp 2 fp16-amp b4 s2048, 2.32 GiB at model_loaded."""
    if t.pp == 1 or dev.emulation is None:
        return {}
    return {(dev.emulation, "explicit_meta_uncounted"): True}


def _run_steps(dev: _Device, module: torch.nn.Module, spec: ModelSpec | None, t: TrainingSpec,
               step_fn: Callable | None, optimizer_fn: Callable | None, steps: int,
               on_step: Callable[[int], None] = lambda n: None) -> SimulatedOutOfMemory | None:
    """Run ``steps`` training steps under the tracker (``on_step(1)`` after each: the progress bar);
    the simulated out-of-memory error, if any."""
    tracker = dev.tracker
    params = [p for p in module.parameters() if p.requires_grad]
    # (DeepSpeed's engine copies each gradient into its bucket and names its own gradient buffers:
    # trace.deepspeed_engine; the per-parameter hook would take the bucket for a gradient)
    grad_hooks = tracker.watch_parameters(params) if type(module).__name__ != "DeepSpeedEngine" else []
    if spec is not None and t.transformer_impl == "transformer_engine" and dev.cuda:
        grad_hooks.append(_te_workspace(module, tracker))
    run_ctx = contextlib.nullcontext() if dev.cuda else dev.build_ctx
    try:
        with run_ctx, tracker, tracker.hooks():
            if spec is not None:
                module.train()
                with _patched(_example_meta_uncounted(dev, t)):
                    optimizer, step = _hf_step(module, spec, t, "cuda" if dev.cuda else "cpu",
                                               micro_batches=TRACED_MICRO_BATCHES)
                if t.compile:  # torch.compile(model): AOTAutograd's partition, run op by op
                    step.model = compiled.CompiledModel(module, tracker)
                    tracker.module_names[id(step.model)] = ""
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
                on_step(1)
    except SimulatedOutOfMemory as e:  # only with a capacity-limited allocator
        return e
    except (TrainmemError, KeyboardInterrupt):
        raise
    except Exception as e:
        if spec is None:
            raise  # the user's own step function: their traceback is theirs to read
        # the real model's step fails on tensors without data: one line saying which and why
        raise TrainmemError(step_failure(spec, e)) from None
    finally:
        tracker.finish()
        for h in grad_hooks:
            h.remove()
    return None


# ----- model building -------------------------------------------------------------------------------
def _as_module(m: Any) -> torch.nn.Module:
    """``m`` if the factory returned an ``nn.Module``, else a TrainmemError."""
    if not isinstance(m, torch.nn.Module):
        raise TrainmemError(f"the model factory returned {type(m).__name__}, not a torch.nn.Module")
    return m


def _load_order(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, str, str]]:
    """(name, tensor, category, module) in the order ``module.to(device)`` moves them."""
    out: list[tuple[str, torch.Tensor, str, str]] = []
    seen: set[int] = set()

    def walk(m: torch.nn.Module, prefix: str) -> None:
        """Children first, then the module's own parameters and buffers (each storage once)."""
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


def _on_device(module: torch.nn.Module) -> None:
    """Move onto the emulated GPU the tensors the build left on the CPU, as ``model.to("cuda")`` moves
    every one: a legacy constructor ignores the default device (XLNet's ``nn.Parameter(torch.FloatTensor(
    d_model, n_head, d_head))``, transformers 5.24 ``models/xlnet/modeling_xlnet.py`` L60-68)."""
    if any(x.device.type == "cpu" for x in (*module.parameters(), *module.buffers())):
        module.to(torch.device(EMULATED))


def _load_to_device(tracker: Tracker, module: torch.nn.Module) -> None:
    """Count parameters and buffers as ``model.to("cuda")`` allocates them (module order)."""
    for name, t, cat, mod in _load_order(module):
        tracker.register_existing(t, cat, "", mod)


def _mark_model(tracker: Tracker, module: torch.nn.Module) -> None:
    """On the CPU: mark the module's tensors, created while counting, as parameters and buffers."""
    for name, t, cat, mod in _load_order(module):
        tracker.reclassify(t, cat)


def _optimizers(opt: Any) -> list[Any]:
    """The optimizers in what ``optimizer_fn`` returned (one, a list/tuple or a dict of them, or None)."""
    if opt is None:
        return []
    if isinstance(opt, (list, tuple)):
        return [o for o in opt if hasattr(o, "state")]
    if isinstance(opt, dict):
        return [o for o in opt.values() if hasattr(o, "state")]
    return [opt] if hasattr(opt, "state") else []


def _user_step(step_fn: Callable, module: torch.nn.Module, optimizer: Any) -> Callable[[int], None]:
    """``step(i)`` calling the user's step_fn with as many of (model, optimizer, step) as it takes."""
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
    """The report component a live tensor belongs to: its category (with the module pattern and op
    for activations and temporaries)."""
    cat = rec.category
    if cat in ("parameters", "buffers", "gradients", "inputs", "logits"):
        return cat
    if cat == "optimizer_states":
        return f"optimizer_states.{rec.label or 'state'}"
    if cat == "workspace":
        return f"workspace.{rec.label or 'other'}"
    if cat == "communication":  # a wrapper's buffers (trace.distributed): one component per kind
        return f"communication.{rec.label or 'other'}"
    if rec.label in ("autocast_weight_cache", "kernel_scratch"):
        return f"{cat}.{rec.label}"
    mod = module_pattern(rec.module) if rec.module else "top_level"
    return f"{cat}.{mod}.{rec.op}" + (f".{rec.label}" if rec.label else "")


def _components(live: list[Record]) -> list[Component]:
    """The tensors live at the peak grouped into components (largest first), plus the bytes the
    allocator's block rounding adds over what they asked for."""
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
    return comps


def _phases(tracker: Tracker, cuda: bool, grad_accum: int = 1) -> tuple[list[Phase], str]:
    """The phases the step marked (a phase repeated within a step numbered per micro-step; the last
    traced micro-step stands for the rest, ``micro3-64``, when fewer than ``grad_accum`` were
    traced) and the name of the one holding the peak."""
    peak_event = tracker.peak_event
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
            k = seen[(m.name, m.step)]
            last = k == counts[(m.name, m.step)] and grad_accum > k
            name = f"{m.name}.micro{k}-{grad_accum}" if last else f"{m.name}.micro{k}"
        phases.append(Phase(name, m.step, m.allocated, m.peak, m.reserved if cuda else None, m.where))
        if m.start_event <= peak_event < max(m.end_event, m.start_event + 1):
            peak_phase = name if m.step == 0 else f"{name}@{m.step}"
    return phases, peak_phase


def _warnings(tracker: Tracker, spec: ModelSpec | None, training: TrainingSpec | None,
              hardware: Hardware | None, emulation: CudaEmulation | None,
              oom: SimulatedOutOfMemory | None) -> list[str]:
    """How the inputs were read and the setup's warnings, then what the trace could not see."""
    warnings = input_notes(spec, hardware) + (report_warnings(training) if training is not None else [])
    warnings += list(tracker.warnings)
    if tracker.data_dependent:
        warnings.append(f"{tracker.data_dependent} data-dependent read(s) of device tensors: the trace has no data, "
                        f"so all() answered True, any() False, numbers 1")
    if emulation is not None and emulation.host_reads:
        warnings.append(f"{emulation.host_reads} copy(ies) of device tensors to the host returned zeros")
    if oom is not None:
        warnings.append(f"simulated out of memory: {oom}")
    if spec is not None and training is not None and training.grad_accum > TRACED_MICRO_BATCHES \
            and training.pp == 1:  # a pipeline schedule runs every micro-batch
        warnings.append(f"traced {TRACED_MICRO_BATCHES} of the {training.grad_accum} micro-batches of each step: "
                        f"the later ones repeat micro-batch {TRACED_MICRO_BATCHES}'s allocations and frees")
    return warnings


def _report(tracker: Tracker, allocator: Any, spec: ModelSpec | None, training: TrainingSpec,
            hardware: Hardware | None, cuda: bool, emulation: CudaEmulation | None, runtime: float,
            timeline_points: int, largest: int, oom: SimulatedOutOfMemory | None, ws: int,
            expandable: bool) -> MemoryReport:
    """The MemoryReport of a finished trace: components live at the peak, phases, peaks, device memory,
    warnings and ``extra`` (largest tensors, timeline, allocator statistics)."""
    peak_event = tracker.peak_event
    live = tracker.live_at(peak_event) if peak_event >= 0 else []
    # micro-batch numbering: the last traced one stands for the rest, unless the pipeline schedule ran them all
    ga = training.grad_accum if (spec is not None and training is not None and training.pp == 1) else 1
    phases, peak_phase = _phases(tracker, cuda, ga)
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
        "simulated_oom": oom is not None,  # the step stopped there: report.device_peak counts it
    }
    if emulation is not None:
        extra["sdpa_backends"] = dict(emulation.sdpa_choices)
    return MemoryReport(
        source="trace", components=_components(live), phases=phases, peak_allocated=peak_alloc,
        peak_reserved=peak_reserved, device_used=device_used, peak_phase=peak_phase,
        peak_where=tracker.peak_context, capacity=hardware.capacity if hardware is not None else None,
        method="trace", model=spec, training=training, hardware=hardware,
        warnings=_warnings(tracker, spec, training, hardware, emulation, oom), extra=extra)
