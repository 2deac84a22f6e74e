"""DeepSpeed ZeRO 1/2/3 (``--zero N`` without ``--fsdp``) traced through DeepSpeed's own engine.

``trace(..., zero=N, dp=D)`` builds the model, loads it on the emulated GPU (``model.to("cuda")``)
and hands it, with the ``torch.optim`` optimizer the options name, to ``deepspeed.initialize`` on the
fake process group of ``trace.distributed`` (DeepSpeed's ``deepspeed.comm`` over the already
initialised ``torch.distributed`` group: ``init_distributed`` finds it initialised and keeps it). The
engine then runs as on a GPU: ``DeepSpeedZeroOptimizer`` (stages 1, 2: ``runtime/zero/stage_1_and_2.py``)
or ``DeepSpeedZeroOptimizer_Stage3`` (``runtime/zero/stage3.py``; the engine converts the loaded
model's parameters to ZeRO-3 partitions, ``parameter_offload.py`` ``_convert_to_zero_parameters``)
builds its fp32 master partitions, gradient buckets and partitions on the emulated GPU, and the step
loop is DeepSpeed's (``loss = engine(**batch).loss; engine.backward(loss); engine.step()``,
``workload.DeepSpeedTrainStep``). Every allocation goes through the tracker and the caching-allocator
simulation, as the rest of the step.

ZeRO-1/2 with ``--offload-optimizer`` (``offload_optimizer: {device: cpu, pin_memory: true}``) runs
DeepSpeed's ``cpu_offload`` path (``stage_1_and_2.py`` v0.19.8): the pinned fp32 partition and its
gradient on the host, ``temp_grad_buffer_for_gpu_offload`` (the largest parameter's elements in the
model's dtype) on the GPU, ``copy_grads_in_partition``'s per-gradient device copies for the host at each
bucket's reduction (``set_norm_for_param_grad_in_gpu``'s float64 copy, the fp32 cast of
``async_inplace_copy_grad_to_fp32_buffer_from_gpu``; ``async_accumulate_grad_in_cpu_via_gpu`` under
accumulation), the step on the host and the upload of the updated half partition. The host tensors
are fake CPU tensors (:func:`host_buffers`): shape and dtype, no data, no host memory, so an 8B
model's partition costs nothing here. The optimizer on them is the options' ``torch.optim`` one with
``zero_force_ds_cpu_optimizer: false`` (engine.py ``_configure_optimizer`` L2342-2346 accepts a
client optimizer then): DeepSpeed's ``DeepSpeedCPUAdam``, which the runs used, is a compiled op
(``csrc/adam/cpu_adam.cpp``) that reads and writes the host arrays' data, which fake tensors do not
have; both step on the host only, and the GPU is what is measured.

The DeepSpeed config is written from the options (:func:`config`): ``zero_optimization`` with the
stage, ``reduce_bucket_size``, ``overlap_comm``, ``contiguous_gradients`` and the stage-3
``sub_group_size``, ``stage3_max_reuse_distance`` and ``stage3_prefetch_bucket_size`` (DeepSpeed's
defaults where an option is not given, the values the estimate takes: ``TrainingSpec.ds_*``),
``bf16`` or ``fp16`` enabled for ``--precision bf16`` / ``fp16`` (DeepSpeed casts the model to the
half dtype and keeps fp32 master partitions: ``--master-weights fp32``, its only mode on the GPU), the
micro-batch and ``gradient_accumulation_steps``.

What the fake group and the emulated GPU cannot do as DeepSpeed does, and what stands in for it
(:func:`patches`; each changes no allocation):

* ``get_accelerator()`` (``deepspeed/accelerator/real_accelerator.py`` L51-150) is DeepSpeed's
  ``CUDA_Accelerator`` (``cuda_accelerator.py``), whose ``torch.cuda`` calls the emulation answers;
  ``DS_ACCELERATOR=cuda`` when DeepSpeed is first imported here.
* ``LOCAL_RANK``, ``RANK`` and ``WORLD_SIZE``, which a launcher sets and the engine asserts
  (``engine.py`` ``_do_args_sanity_check`` L1972), are set for the trace and restored after it.
* NVTX ranges (``utils/nvtx.py`` ``instrument_w_nvtx`` -> ``torch.cuda.nvtx.range_push``): profiler
  markers, which a CPU build of PyTorch refuses; here they do nothing.
* ``GatheredParameters`` with a ``modifier_rank`` checks, before its broadcast, that each parameter is
  on ``get_accelerator().current_device_name()`` (``partition_parameters.py`` ``_exit`` L2551-2557),
  "cuda:0", where the emulated GPU's tensors are on ``meta``: the check is made against the emulated
  GPU's device (:func:`_gathered_exit`); the broadcast and the partitioning run as they are.
* ZeRO-3's cross-rank consistency checks (``runtime/zero/utils.py`` ``assert_lst_len_same_as_other_ranks``
  L80-95 and ``get_lst_from_rank0`` L98-110, run by ``partitioned_param_coordinator.py`` ``reset_step``
  L260-267 after the first step): the same device tensor is made, broadcast and copied to the host,
  but the fake group fills no data, so rank 0's list (every rank runs this program) is taken as this
  rank's instead of the zeros the copy holds.
* The ZeRO-1/2 gradient hooks (``register_post_accumulate_grad_hook``, ``utils/torch.py``
  ``register_grad_hook``) and ZeRO-3's ``Tensor.record_stream`` calls run under the emulation
  (``trace.cuda``).
* ZeRO-1/2 compute their flat layout from ``torch.zeros_like(param, device="meta")``
  (``stage_1_and_2.py`` L485): no memory on a GPU, but ``meta`` is the emulated GPU, so a
  ``device="meta"`` the program asks for itself is not counted (``CudaEmulation.explicit_meta_uncounted``).
* DeepSpeed's process-group state (``comm/comm.py`` ``cdb``, ``utils/groups.py``' cached groups)
  starts empty for each traced rank, as in a new process (:func:`_fresh_groups`), and ZeRO-3's
  ``F.linear`` replacement, which persists for a process, is put back after the trace (:func:`patches`).

The model reaches ``deepspeed.initialize`` in one of two ways (``--zero-init``, :func:`builds_under_init`):

* ``--zero-init off`` (``TrainingSpec.ds_whole_load``): the model is loaded whole
  (``deepspeed.initialize(model=model)`` of a model on the GPU), so for ZeRO-3 the ``model_loaded``
  phase holds the whole model, then DeepSpeed's own conversion (a partition made and the whole
  tensor freed, parameter by parameter), its ``defragment`` (``empty_cache`` and one flat buffer),
  which the estimate replays (``estimate.states.zero3_whole_load``; both agree on its allocated and
  reserved peak, tests/test_zero_init.py).
* ``--zero-init on`` (ZeRO-3; ``TrainingSpec.ds_zero_init``: the HF Trainer, TRL and Accelerate):
  transformers builds the model under ``deepspeed.zero.Init`` itself, as it does when a ZeRO-3 config
  is registered (:func:`zero_init_build`: ``HfDeepSpeedConfig`` of the same config dict, which the
  Trainer's ``TrainingArguments`` registers; transformers 5.24 ``modeling_utils.py`` ``_from_config``
  L1435-1462: ``init.no_init_weights()``, ``prevent_arange_dtype_change()``,
  ``deepspeed.zero.Init(config_dict_or_path=deepspeed_config())``, ``set_zero3_state()``, then
  ``initialize_weights_zero3`` and ``tie_weights``). zero.Init creates every tensor on the (emulated)
  GPU in the config's dtype (``partition_parameters.py`` ``_add_tensor_creation_wrappers`` L637-672)
  and, as each module's ``__init__`` returns, partitions its parameters one by one
  (``_post_init_method`` L1232-1258 -> ``_zero_init_param`` L1200-1207: broadcast from rank 0, a
  partition ``torch.empty`` of ceil(numel / dp) elements, the whole tensor freed, ``_partition_param``
  L1778-1898); buffers stay whole on the GPU. transformers then initialises the weights module by
  module (``integrations/deepspeed.py`` ``initialize_weights_zero3`` L298-334): each module's own and
  its children's parameters gathered whole (``GatheredParameters(params, modifier_rank=0)``), the
  init run on rank 0 (in-place ``normal_`` ... on tensors without data: nothing computed), broadcast
  and partitioned again. The engine does not move a zero.Init model (``engine.py``
  ``_configure_distributed_model`` L2077-2094) and the stage-3 optimizer's ``defragment`` flattens
  the partitions as in the off case. Everything is allocated inside the tracker, in ``model_loaded``.

Attribution (:func:`_mark_master`, :func:`patches`): the flat half parameters are ``parameters``, the
fp32 partitions ``master_weights``, ZeRO-1/2's ``grads_in_partition`` (``copy_grads_in_partition``) and
ZeRO-3's gradient partition ``gradients``, the buckets ``communication.deepspeed_buckets``, ZeRO-3's
gathered parameters ``communication.deepspeed_gathered``; ``DeepSpeedEngine.step`` at the boundary is
the ``optimizer_step`` phase (its flat fp32 gradients come before the torch optimizer's own step).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Any, Callable, Iterator

import torch

from ..errors import TrainmemError
from ..spec import TrainingSpec
from .cuda import EMULATED

#: the torch optimizers DeepSpeed's ZeRO takes without ``zero_allow_untested_optimizer`` (``runtime/zero/utils.py``
#: ``ZERO_SUPPORTED_OPTIMIZERS``: torch.optim.Adam, AdamW, ...) that trace builds as the client optimizer
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")


def uses_deepspeed(t: TrainingSpec) -> bool:
    """Whether the setup is DeepSpeed's ZeRO engine (``--zero 1|2|3`` without ``--fsdp``)."""
    return bool(t.zero) and t.fsdp is None and t.gemini is None and not t.distributed_optimizer


def builds_under_init(t: TrainingSpec) -> bool:
    """Whether transformers builds the model under ``deepspeed.zero.Init`` (``--zero-init on`` with
    ZeRO-3 on DeepSpeed's engine) rather than whole (:func:`zero_init_build`)."""
    return uses_deepspeed(t) and t.zero == 3 and t.ds_zero_init


def _added_modules(t: TrainingSpec) -> str:
    """The options under which ``workload.prepare_model`` adds parameters or buffers to the built
    model (peft's adapters, Liger's and litgpt's modules, torchtune's RoPE caches, TRL's reference
    copy, the half embeddings' cast): under zero.Init they would be made outside it, which trace
    does not run ("" when none is given)."""
    from ..spec.preference import ref_model_of
    named = [("--lora-rank", t.lora_rank), ("--liger", t.liger), ("--fused-qkv", t.fused_qkv),
             ("--split-gate-up", t.split_gate_up), ("--layer-rope-cache", t.layer_rope_cache is not None),
             ("--rope-cache", t.rope_cache is not None), ("--half-embeddings", t.half_embeddings),
             ("--ref-model copy", ref_model_of(t) == "copy")]
    return next((name for name, given in named if given), "")


def available() -> bool:
    """Whether DeepSpeed is importable."""
    return importlib.util.find_spec("deepspeed") is not None


def check(t: TrainingSpec) -> None:
    """Refuse, in one line, what trace does not run through DeepSpeed's engine."""
    what = f"trace --zero {t.zero}"
    refused = [(t.offload_optimizer and t.zero == 3,
                "--offload-optimizer with --zero 3 (ZeRO-3's host partitions and their swapper)"),
               (t.remote_device == "cpu", "--remote-device cpu (zero.Init partitions in pinned host memory)"),
               (builds_under_init(t) and _added_modules(t),
                f"--zero-init on with {_added_modules(t)} (modules added after zero.Init built the model)"),
               (t.tp > 1 or t.pp > 1, "--tp/--pp (DeepSpeed's engine over a model-parallel mpu)"),
               (t.cp > 1, "--cp (PyTorch's context_parallel inside DeepSpeed's engine)"),
               (t.precision not in ("bf16", "fp16", "fp32"),
                f"--precision {t.precision} (DeepSpeed runs bf16/fp16 weights with an fp32 master, or fp32)"),
               (t.master_weights == "none" and t.precision in ("bf16", "fp16"),
                "--master-weights none (DeepSpeed's ZeRO keeps an fp32 master of half weights)"),
               (t.optimizer not in OPTIMIZERS or t.optimizer_in_backward,
                f"--optimizer {t.optimizer}{' with --optimizer-in-backward' if t.optimizer_in_backward else ''} "
                f"(trace hands DeepSpeed a torch.optim {', '.join(OPTIMIZERS)})"),
               (t.zero_grad != "none", f"--zero-grad {t.zero_grad} (the engine's step zeroes its own gradients)"),
               (t.loss_chunks > 1 or t.loss in ("chunked", "chunked-nll"),
                "a chunked loss (it runs the model's body and head outside the engine's forward)"),
               (t.quantize is not None, f"--quantize {t.quantize}"),
               (t.compile, "--compile"), (t.offload_activations, "--offload-activations"),
               (t.min_seq_len is not None or t.later_seq_len is not None, "varying sequence lengths")]
    bad = [name for flag, name in refused if flag]
    if bad:
        raise TrainmemError(f"{what} does not run {bad[0]} through DeepSpeed's engine; use estimate")
    if not available():
        raise TrainmemError(f"{what} runs DeepSpeed's own engine: pip install deepspeed (DS_BUILD_OPS=0 builds no "
                            "kernels), or use estimate")
    installed = _installed_release()
    if t.deepspeed_version is not None and t.deepspeed_release()[:2] != installed[:2]:
        raise TrainmemError(f"deepspeed_version {t.deepspeed_version}: {what} runs the installed DeepSpeed "
                            f"{'.'.join(map(str, installed))}; use estimate for another release, or drop it")


def _installed_release() -> tuple[int, ...]:
    """The installed DeepSpeed's release as numbers (its metadata, without importing it)."""
    from importlib.metadata import version
    return tuple(int(x) for x in version("deepspeed").split("+")[0].split(".")[:3] if x.isdigit())


def config(t: TrainingSpec) -> dict[str, Any]:
    """The DeepSpeed config of ``t`` (DeepSpeed's defaults for the engine options not given, as the
    estimate takes them: ``TrainingSpec.ds_reduce_bucket`` ...)."""
    zero: dict[str, Any] = {"stage": t.zero, "reduce_bucket_size": t.ds_reduce_bucket,
                            "overlap_comm": t.ds_overlap_comm, "contiguous_gradients": t.contiguous_gradients}
    if t.zero == 3:
        zero.update(sub_group_size=t.ds_sub_group, stage3_max_reuse_distance=t.ds_reuse_distance,
                    stage3_prefetch_bucket_size=t.ds_prefetch)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": t.batch_size,
                           "gradient_accumulation_steps": t.grad_accum,
                           "train_batch_size": t.batch_size * t.grad_accum * t.dp,
                           "zero_optimization": zero, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if t.offload_optimizer:  # ZeRO-1/2's offload (``check`` refuses stage 3's); the client torch.optim optimizer on
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}  # the host (module docstring)
        cfg["zero_force_ds_cpu_optimizer"] = False
    if t.precision in ("bf16", "fp16"):
        cfg[t.precision] = {"enabled": True}
    if t.optimizer not in ("adamw", "adam"):  # torch.optim.SGD is not in ZERO_SUPPORTED_OPTIMIZERS: the engine
        cfg["zero_allow_untested_optimizer"] = True  # asserts this key (engine.py _do_optimizer_sanity_check)
    return cfg


@contextlib.contextmanager
def environment(rank: int, world: int) -> Iterator[None]:
    """What a launcher sets for a rank (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, and
    ``DS_ACCELERATOR=cuda``), restored on exit."""
    values = {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
              "DS_ACCELERATOR": "cuda"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def zero_init_build(t: TrainingSpec) -> Iterator[None]:
    """The context in which transformers builds the model under ``deepspeed.zero.Init`` (:func:`builds_under_init`):
    DeepSpeed's communication on the fake group (``init_distributed``, as :func:`wrap`; zero.Init
    needs it, ``partition_parameters.py`` L1086-1088) and the ZeRO-3 config registered as the HF
    Trainer registers it (``TrainingArguments`` -> ``HfTrainerDeepSpeedConfig``; transformers 5.24
    ``integrations/deepspeed.py`` ``HfDeepSpeedConfig`` L60-82, ``set_hf_deepspeed_config`` L270-275),
    so that ``is_deepspeed_zero3_enabled()`` is true and ``_from_config`` enters zero.Init with
    ``deepspeed_config()``, the dict :func:`config` writes (``modeling_utils.py`` L1435-1462).
    Unregistered on exit (``unset_hf_deepspeed_config``, L278-281): later traces start without it."""
    import deepspeed
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config
    deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
    registered = HfDeepSpeedConfig(config(t))  # (transformers keeps a weak reference: held here)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del registered


def mark_partitions(module: torch.nn.Module, tracker: Any) -> None:
    """A zero.Init model's memory named once it is built: each parameter's partition (``ds_tensor``)
    as ``parameters``, the buffers as ``buffers`` (made inside the tracker, they were counted as the
    build's temporaries; the whole tensors freed during the build stay so)."""
    for p in module.parameters():
        if getattr(p, "ds_tensor", None) is not None:
            tracker.reclassify(p.ds_tensor, "parameters")
    for b in module.buffers():
        tracker.reclassify(b, "buffers")


def wrap(module: torch.nn.Module, t: TrainingSpec, tracker: Any) -> Any:
    """``deepspeed.initialize`` of the loaded model with the client ``torch.optim`` optimizer the
    options name (``workload.make_optimizer`` over the trainable parameters), inside the tracker;
    returns the engine."""
    import deepspeed
    from ..workload import make_optimizer
    optimizer = make_optimizer(t, [p for p in module.parameters() if p.requires_grad])
    with tracker:
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config(t))
    _mark_master(engine, tracker)
    return engine


def _mark_master(engine: Any, tracker: Any) -> None:
    """The ZeRO optimizer's buffers named once it is built: its flat half parameters (stages 1, 2:
    ``bit16_groups_flat``; stage 3: ``fp16_partitioned_groups_flat``, the rank's partitions) as
    ``parameters``, the fp32 partitions its torch optimizer steps as ``master_weights`` (an fp32
    engine's too: they are clones of its fp32 partitions, ``TrainingSpec.ds_fp32_clone``; one that
    is the flat partition itself stays ``parameters``), stage 3's gradient partition buffer
    (``grad_partitions_flat_buffer``, ``stage3.py`` L791) as ``gradients`` and its bucket (L780-784,
    made in ``__init__`` and kept) as ``communication.deepspeed_buckets``."""
    opt = engine.optimizer
    flats = getattr(opt, "bit16_groups_flat", None) or getattr(opt, "fp16_partitioned_groups_flat", None) or []
    for flat in flats:
        tracker.reclassify(flat, "parameters", "")
    for p in (getattr(opt, "single_partition_of_fp32_groups", None)
              or getattr(opt, "fp32_partitioned_groups_flat", None) or []):
        if not any(p is flat for flat in flats):
            tracker.reclassify(p, "master_weights", "")
    offload = getattr(opt, "temp_grad_buffer_for_gpu_offload", None)  # ZeRO-Offload's device gradient buffer
    if offload is not None:                                             # (v0.19.8 ``stage_1_and_2.py`` L659-661)
        tracker.reclassify(offload, "communication", "deepspeed_offload_buffer")
    grads = getattr(opt, "grad_partitions_flat_buffer", None)
    if grads is not None:
        tracker.reclassify(grads, "gradients", "")
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        if isinstance(getattr(bucket, "buffer", None), torch.Tensor):  # stage 3's, kept from __init__
            tracker.reclassify(bucket.buffer, "communication", "deepspeed_buckets")


def _gathered_exit(orig: Callable, accelerator: Any) -> Callable:
    """``GatheredParameters._exit`` (``partition_parameters.py`` L2523-2569) with its device check
    made against the emulated GPU: with a ``modifier_rank`` it refuses a parameter not on
    ``torch.device(get_accelerator().current_device_name())`` (L2551-2557), "cuda:0", while the
    emulated GPU's tensors are on ``meta``. During the call the accelerator names that device;
    nothing in the call allocates on it by that name (the broadcast and ``_partition_param`` use the
    parameters' own tensors and ``Init``'s ``remote_device``). Without a ``modifier_rank`` it runs as it is."""
    @functools.wraps(orig)
    def run(self: Any, *exc: Any) -> Any:
        if self.src_rank is None:
            return orig(self, *exc)
        accelerator.current_device_name = lambda: EMULATED
        try:
            return orig(self, *exc)
        finally:
            del accelerator.current_device_name
    return run


def _rank0_list(lst: list[int]) -> list[int]:
    """``get_lst_from_rank0`` (``runtime/zero/utils.py`` L98-110): the same device tensor, broadcast
    and copied to the host; rank 0's list is this rank's (every rank runs the same program), where
    the fake group's broadcast leaves the zeros of no data."""
    t = _rank_tensor(lst)
    t.cpu()
    return list(lst)


def _same_length(lst: list[int]) -> None:
    """``assert_lst_len_same_as_other_ranks`` (``runtime/zero/utils.py`` L80-95): the same device
    scalar, broadcast and copied to the host; the lengths agree (one program on every rank)."""
    _rank_tensor(len(lst)).cpu()


def _rank_tensor(value: Any) -> torch.Tensor:
    """The int64 device tensor the checks broadcast from rank 0 (``dtype=int`` on ``LOCAL_RANK``'s device)."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    t = torch.tensor(value, dtype=int, device=torch.device(get_accelerator().device_name(os.environ["LOCAL_RANK"])),
                     requires_grad=False)
    dist.broadcast(t, src=0, async_op=False)
    return t


def _gather_handles() -> list[type]:
    """ZeRO-3's all-gather handles, whose ``wait`` builds each whole parameter from the gathered
    partitions (``partition_parameters.py`` ``AllGatherCoalescedHandle.wait``: ``torch.cat``)."""
    import deepspeed.runtime.zero.partition_parameters as pp
    return [c for c in vars(pp).values() if isinstance(c, type) and c.__name__.endswith("Handle")
            and c.__module__ == pp.__name__ and "wait" in vars(c)]


def _scoped(tracker: Any, orig: Callable, label: str, category: str = "communication") -> Callable:
    """``orig`` with what it allocates named ``<category>.<label>``."""
    @functools.wraps(orig)
    def run(*args: Any, **kwargs: Any) -> Any:
        with tracker.scope(category, label):
            return orig(*args, **kwargs)
    return run


def _partition_scope(tracker: Any, orig: Callable) -> Callable:
    """``copy_grads_in_partition`` with what it allocates named: ``grads_in_partition`` as ``gradients``;
    under ZeRO-Offload (``cpu_offload``) the per-gradient device copies it makes for the host
    (``set_norm_for_param_grad_in_gpu``'s float64 copy, ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``'s
    fp32 cast, v0.19.8 ``stage_1_and_2.py`` L1873-1912, L2161-2178) as ``temporaries.deepspeed.offload_check``,
    the estimate's name for them (``quantities.zero_offload.deepspeed_offload_steps``)."""
    @functools.wraps(orig)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        category, label = ("temporaries", "deepspeed.offload_check") if self.cpu_offload else ("gradients", "")
        with tracker.scope(category, label):
            return orig(self, *args, **kwargs)
    return run


def _step_phase(tracker: Any, orig: Callable) -> Callable:
    """``DeepSpeedEngine.step`` as the ``optimizer_step`` phase (its flat fp32 gradients, the torch
    optimizer's step and the copy back into the half parameters)."""
    @functools.wraps(orig)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.is_gradient_accumulation_boundary():
            tracker.enter_phase("optimizer_step")
        return orig(self, *args, **kwargs)
    return run


#: the ZeRO-1/2 optimizer's methods that make its ZeRO-Offload host buffers (DeepSpeed 0.19.8
#: ``runtime/zero/stage_1_and_2.py``): ``__init__`` (the pinned fp32 partition, a ``.to(device="cpu")`` of the
#: rank's half partition, L559-561; its half copy ``temp_buffer_bit16`` L567-575;
#: ``temp_grad_buffer_for_cpu_offload`` L653-658; the fp32 gradient partition, ``initialize_optimizer_states``
#: L937-941) and ``async_accumulate_grad_in_cpu_via_gpu`` (a gradient's host accumulation buffer under
#: accumulation, L1822-1825)
HOST_BUFFER_METHODS = ("__init__", "async_accumulate_grad_in_cpu_via_gpu")


def host_buffers(tracker: Any, emulation: Any) -> dict[tuple[Any, str], Any]:
    """ZeRO-Offload's host buffers without data: while DeepSpeed's ZeRO-1/2 optimizer runs one of
    :data:`HOST_BUFFER_METHODS`, a host tensor it makes (``torch.zeros(..., device="cpu")``, a copy
    of a device tensor to the host) is a fake CPU tensor (``torch._subclasses.FakeTensorMode``:
    shape, dtype and device, no storage), so that an 8B model's fp32 partition and optimizer states
    take no host memory; what is computed from them (the torch optimizer's states and step on the host,
    ``bit16_partition_buffer``) is fake too, by the tensor subclass's own dispatch. Nothing on the
    emulated GPU changes: the copies between host and device allocate no device memory (``copy_``
    into an existing tensor), and the device tensors they copy from are made and counted as before.
    Without offload none of these methods makes a host tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    fake = FakeTensorMode(allow_non_fake_inputs=True)

    def scoped(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def run(*args: Any, **kwargs: Any) -> Any:
            saved = emulation.fake_host, tracker.fake_host
            emulation.fake_host = tracker.fake_host = fake
            try:
                return orig(*args, **kwargs)
            finally:
                emulation.fake_host, tracker.fake_host = saved
        return run
    return {(DeepSpeedZeroOptimizer, name): scoped(getattr(DeepSpeedZeroOptimizer, name))
            for name in HOST_BUFFER_METHODS}


def _fresh_groups() -> dict[tuple[Any, str], Any]:
    """DeepSpeed's process-group state as a new process starts it: ``deepspeed.comm``'s backend
    (``comm/comm.py`` L46-58: ``cdb`` and the backends) and ``deepspeed.utils.groups``' cached groups
    (``utils/groups.py`` L38-86). A real rank initialises them once; trace starts a fake group of
    its own for every rank it traces, and a group cached from an earlier trace is destroyed."""
    import deepspeed.comm.comm as comm
    import deepspeed.utils.groups as groups
    out: dict[tuple[Any, str], Any] = {(comm, k): None for k in ("cdb", "nccl_backend", "mpi_backend", "ccl_backend",
                                                                 "hccl_backend") if hasattr(comm, k)}
    for k, v in vars(groups).items():
        if k.startswith("_") and k.endswith(("_GROUP", "_GROUP_RANKS", "_WORLD_SIZE", "_RANK")) and not k.startswith("__"):
            out[(groups, k)] = {} if isinstance(v, dict) else None
    for k in ("mpu", "mesh_device"):
        if hasattr(groups, k):
            out[(groups, k)] = None
    return out


def patches(tracker: Any, emulation: Any) -> dict[tuple[Any, str], Any]:
    """(object, attribute) -> value: DeepSpeed's engine on the fake group and the emulated GPU (see the
    module's docstring), its buffers named, and what DeepSpeed changes for the rest of a process
    put back after the trace: ZeRO-3 replaces ``F.linear`` with its memory-efficient
    ``zero3_linear_wrap`` (``partition_parameters.py`` ``_enable_mem_efficient_linear`` L412-419:
    "This will persist unless manually reset"), in force through the trace as in the rank's own
    process, not in the next trace's."""
    import deepspeed.accelerator.real_accelerator as real
    import deepspeed.runtime.zero.utils as zero_utils
    import torch.cuda.nvtx as nvtx
    import torch.nn.functional as F
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    accelerator = CUDA_Accelerator()
    buckets = DeepSpeedZeroOptimizer.setup_buckets  # stages 1, 2: made at backward's first gradient
    gather = Coordinator._PartitionedParameterCoordinator__all_gather_params  # stage 3: whole parameters
    partition = DeepSpeedZeroOptimizer.copy_grads_in_partition  # stages 1, 2: ``grads_in_partition``
    named = {(DeepSpeedZeroOptimizer, "setup_buckets"): _scoped(tracker, buckets, "deepspeed_buckets"),
             (DeepSpeedZeroOptimizer, "copy_grads_in_partition"): _partition_scope(tracker, partition),
             (Coordinator, "_PartitionedParameterCoordinator__all_gather_params"):
                 _scoped(tracker, gather, "deepspeed_gathered"),
             **{(cls, "wait"): _scoped(tracker, cls.wait, "deepspeed_gathered") for cls in _gather_handles()},
             **host_buffers(tracker, emulation),
             (DeepSpeedEngine, "step"): _step_phase(tracker, DeepSpeedEngine.step),
             (GatheredParameters, "_exit"): _gathered_exit(GatheredParameters._exit, accelerator)}
    return {**_fresh_groups(), **named, (F, "linear"): F.linear, (F, "embedding"): F.embedding,
            (real, "ds_accelerator"): accelerator,
            (zero_utils, "get_lst_from_rank0"): _rank0_list,
            (zero_utils, "assert_lst_len_same_as_other_ranks"): _same_length,
            (nvtx, "range_push"): lambda *a, **k: None, (nvtx, "range_pop"): lambda *a, **k: None,
            (emulation, "explicit_meta_uncounted"): True, **_log_to_stderr()}


def _log_to_stderr() -> dict[tuple[Any, str], Any]:
    """DeepSpeed's logger writes to stdout (``utils/logging.py`` ``LoggerFactory.create_logger``:
    ``StreamHandler(stream=sys.stdout)``); during a trace it writes to stderr, so that stdout holds
    only trainmem's report (``--json`` stays parseable)."""
    import sys
    from deepspeed.utils.logging import logger
    return {(h, "stream"): sys.stderr for h in logger.handlers
            if getattr(h, "stream", None) is sys.stdout}
