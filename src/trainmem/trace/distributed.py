"""Data, tensor and pipeline parallelism traced on torch.distributed's own code, in one process.

``trace(..., dp=N)`` (DDP), ``trace(..., dp=N, fsdp="full"|"grad-op")`` (FSDP2; with
``fsdp_version=1`` FSDP1 ``FullyShardedDataParallel``, ``wrappers.fsdp1``) and
``trace(..., cp=C)`` (PyTorch's ``context_parallel`` around each micro-batch's forward and backward,
``wrappers.context_parallel``; FSDP2 over dp x cp with ``fsdp``),
``trace(..., tp=T)`` (``parallelize_module`` with torchtitan's Llama plan,
``trainmem.wrappers.tensor_parallel``; with ``sequence_parallel``, and with FSDP2 over the ``dp``
dimension of a (dp, tp) mesh) start a fake process group of N × T ranks in this process — PyTorch's ``fake`` backend
(``torch/testing/_internal/distributed/fake_pg.py``: ``FakeStore`` and ``FakeProcessGroup``,
whose collectives return at once and move no data) — and wrap the model with the real wrappers
(:mod:`trainmem.wrappers`, the code ``measure`` runs on real ranks) on the emulated GPU. This
process is rank 0 (or ``rank``). What the wrappers allocate goes through the same tracker and allocator
simulation as the rest of the step: FSDP2's all-gather buffers and unsharded parameters, its
reduce-scatter buffers and sharded gradients, DDP's gradient buckets, DTensor's collectives
(``_c10d_functional`` ops whose outputs are new tensors of the real shapes) and its ops on the
local shards.

The emulated GPU's tensors live on ``meta`` (``trace/cuda.py``), which FSDP2 and DDP were not
written for; :func:`patches` makes them take their CUDA paths (each patch cites the code it
answers):

* FSDP2 refuses to train parameters on ``meta`` (``FSDPParamGroup._validate_no_meta_params``,
  torch 2.13 ``_fully_shard/_fsdp_param_group.py`` L1027-1038): here ``meta`` is the device.
* ``_get_device_handle(device.type)`` (``torch/distributed/device_mesh.py`` L143-150) is
  ``getattr(torch, device_type)``; for ``meta`` it answers ``torch.cuda`` (the emulated module:
  one timeline, events that do nothing, streams that only choose the allocator's pool).
* DDP checks that every rank has the same parameters with an all-gather
  (``_verify_param_shape_across_processes``, ``torch/nn/parallel/distributed.py`` L1064,
  ``torch/distributed/utils.py`` L286); the fake group fills no outputs, so it is skipped.
* DDP's default communication hook needs the all-reduce's future to hold the bucket
  (``reducer.cpp``, comm.cpp L114 asserts it), and a fake ``Work``'s future holds None
  (``FakeProcessGroup.hpp`` ``FakeWork::getFuture``): trace registers a hook that does what the
  built-in ``AllReduceCommHook::runHook`` does (``default_comm_hooks.cpp``: divide the bucket in
  place by the world size, all-reduce it in place) and returns the bucket.

Attribution (:meth:`Tracker.scope`): FSDP2's ``foreach_all_gather`` (the flat all-gather output and,
with a mixed-precision policy, the cast copy-in) is ``communication.fsdp_all_gather``;
``foreach_all_gather_copy_out`` (the unsharded parameters, re-allocated with
``UntypedStorage.resize_``) ``communication.fsdp_unsharded_params``; ``foreach_reduce`` (the
reduce-scatter input and output) ``communication.fsdp_reduce_scatter``, whose output becomes the
sharded gradients (FSDP2 calls the sharded parameters' post-accumulate-grad hooks); the unsharded
gradients are ``gradients`` from ``post_backward`` on; DDP's buckets (built in ``__init__`` and
rebuilt in the second step's ``_pre_forward``) ``communication.ddp_buckets``.

FSDP1 (:func:`_fsdp1_patches`) is built on the emulated GPU and wrapped with
``device_id=torch.device("meta")``: its initialisation takes ``meta`` for the device, not for an
unmaterialised model (:func:`_fsdp1_init_patches`); the FSDP1 functions that compare data pointers
see an emulated storage's address (:func:`_with_addresses`); ``FlatParamHandle.unshard`` (the
padded unsharded flat parameter) is ``communication.fsdp_unsharded_params``, the mixed-precision
shard ``communication.fsdp_all_gather``, the post-backward hook's copies
``communication.fsdp_reduce_scatter`` (:func:`_fsdp1_post_backward`). FSDP1 pads every rank's flat
shard to one size; ranks differ by the 512-byte rounding of the optimizer states of the parameter
pieces their shard holds (:func:`describe`).

Every rank runs the same program. DDP replicates everything, so the ranks are identical. FSDP2
shards each parameter with ``torch.chunk`` on dim 0 and pads every rank's shard to the first
rank's size (``_fsdp_param.py`` ``_init_sharded_param``); only the optimizer states, made with
``zeros_like`` of the unpadded local shard, are smaller on the last ranks when a dimension does not
divide. So rank 0 is the worst rank and is the one traced (``trace(..., rank=k)`` traces another:
``tests/test_trace_distributed.py`` checks that the last rank of an uneven split is not above it).

Pipeline parallelism (``--pp``, alone, with ``--tp``, with ``--dp`` or with both): the model is cut to
one stage before it is loaded (``wrappers.PipelineStageModule``, torchtitan's split, weighted with
``--pp-first/last-stage-less-layers``); on a (pp, dp, tp) mesh of the dimensions used
(:func:`_pipeline_stage`) the stage is parallelized over ``tp`` and then sharded with FSDP2 over
``dp`` (torchtitan's ``parallelize_llama`` on each model part), or, without FSDP and TP, wrapped in
DDP over the ``dp`` group once loaded (:func:`wrap_loaded`); ``workload.PipelineTrainStep`` runs
torch's ``PipelineStage`` and ``Schedule1F1B`` (or ``ScheduleGPipe``; or ``ScheduleInterleaved1F1B``
or ``ScheduleInterleavedZeroBubble`` over the rank's ``--pp-virtual-stages`` stages,
``wrappers.PipelineRankModule``) as that stage's rank of a fake group of ``pp`` × ``dp`` × ``tp``;
``pipeline_ranks`` says which ranks are traced (rank 0 of the first and the last stage, and of stage 1
under the weighted split), each on its own emulated GPU, and ``pipeline_report`` keeps the worst. Two patches make the schedule run on the fake group
(``_static_vote``, ``_p2p_one_by_one``); sends and receives move nothing, so a stage computes on
its receive buffers, which have the real shapes and dtypes.

FSDP's all-gather / reduce-scatter streams are emulated as streams with pools of their own in the
allocator simulation (``cuda._stream_patches``; the caching allocator reuses a block only on the
stream that allocated it). DDP's construction (``_sync_module_states``: the module flattened into
250 MiB chunks by ``dist._broadcast_coalesced``, freed to the cache when it returns), its first
iteration's one bucket of every parameter and the bucket rebuild in the second step's ``_pre_forward``
all run here (``tests/test_trace_distributed.py``), on the side stream Lightning builds DDP on under
``--ddp-init-stream side`` (``wrappers.ddp``). Not modelled: NCCL's own buffers (outside the caching
allocator), and the wait of a block a real NCCL collective used (``recordStream`` on NCCL's stream:
the broadcast's chunks, the buckets freed by the rebuild) before the caching allocator reuses it, which
depends on how far the CPU runs ahead of the GPU, not on the code (docs/validation.md, fifteenth
session, later: up to +336 MiB on the cvpr2023 DDP row's setup built on the current stream).
"""
from __future__ import annotations

import contextlib
import warnings
import functools
import importlib
from typing import Any, Callable, Iterator

import torch

from ..errors import TrainmemError
from ..units import fmt
from ..spec import TrainingSpec
from ..wrappers import (CP_MODEL_TYPES, PP_MODEL_TYPES, SCHEDULE_NAMES, TP_MODEL_TYPES, context_parallel_hooks, ddp, dp_mesh,
                        fsdp1, fsdp2, mesh, pipeline_stage_module, tensor_parallel,
                        wrapper_name)
from . import deepspeed_engine
from .cuda import _patched
from .tracker import Tracker

#: modules that hold their own reference to ``torch.distributed.device_mesh._get_device_handle``
_DEVICE_HANDLE_USERS = ("torch.distributed.device_mesh", "torch.distributed.tensor._random",
                        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
                        "torch.distributed.fsdp._fully_shard._fsdp_init",
                        "torch.distributed.fsdp._fully_shard._fsdp_state",
                        "torch.distributed.fsdp._fully_shard._fsdp_param_group")


def distributed(t: TrainingSpec) -> bool:
    """Whether the setup runs on several ranks (DDP, FSDP, tensor, pipeline or context parallelism)
    or through DeepSpeed's engine (``--zero``: it needs a process group even over one rank)."""
    return (t.dp > 1 or t.fsdp is not None or t.tp > 1 or t.pp > 1 or t.cp > 1
            or deepspeed_engine.uses_deepspeed(t))


def world_size(t: TrainingSpec) -> int:
    """The ranks of the layout: dp × cp × tp (the mesh ``wrappers.mesh`` builds), or pp × dp × tp
    (the pipeline stages, each tensor-parallel over tp and replicated by DDP or sharded by FSDP2 over
    dp; ``check`` refuses pp with cp)."""
    return t.dp * t.tp * t.pp * t.cp


def sharded_unloaded(t: TrainingSpec) -> bool:
    """Whether the wrappers shard the model before it is loaded (FSDP2, tensor parallelism, a
    pipeline stage's split: built on ``meta``, sharded or cut, then given memory, as torchtitan
    does), so only the rank's part is ever loaded; and under context parallelism, whose mesh and
    attention hooks are set on the model before it is loaded (:func:`wrap`)."""
    return t.fsdp is not None or t.tp > 1 or t.pp > 1 or t.cp > 1


def _what(t: TrainingSpec) -> str:
    parts = [f"--pp {t.pp}"] if t.pp > 1 else []
    parts += [f"--dp {t.dp}"] if t.dp > 1 or t.fsdp else []
    parts += [f"--fsdp {t.fsdp}"] if t.fsdp else []
    parts += [f"--cp {t.cp}"] if t.cp > 1 else []
    parts += [f"--zero {t.zero}"] if deepspeed_engine.uses_deepspeed(t) else []
    parts += [f"--tp {t.tp}"] if t.tp > 1 else []
    return " ".join(parts + (["--sequence-parallel"] if t.sequence_parallel else []))


def check(t: TrainingSpec, spec: Any, device: str) -> None:
    """Refuse, in one line, the parallel setups trace does not run."""
    if not distributed(t):
        return
    what = _what(t)
    if deepspeed_engine.uses_deepspeed(t):
        deepspeed_engine.check(t)
    if t.pp > 1:
        _check_pp(t, spec, device, what)
    if t.tp > 1:
        _check_tp(t, spec, device, what)
    if t.cp > 1:
        _check_cp(t, spec, device, what)
    if device != "cuda":
        raise TrainmemError(f"trace {what} runs on the emulated GPU: drop --device cpu")
    if spec is None:
        raise TrainmemError(f"trace {what} wraps a catalogue or transformers model (FSDP units, the TP plan and "
                            "pipeline stages follow its decoder layers); for your own module and step_fn, wrap "
                            "it yourself in the factory")
    if t.fsdp == "hybrid":
        raise TrainmemError("trace --fsdp hybrid (HSDP, a 2-D mesh) is not traced yet: use --fsdp full or grad-op, "
                            "or estimate")
    if t.fsdp is not None and t.fsdp_version == 1:
        _check_fsdp1(t, what)
    if t.loss == "chunked" or t.loss_chunks > 1:
        what_loss = "--loss chunked" if t.loss == "chunked" else f"--loss-chunks {t.loss_chunks}"
        raise TrainmemError(f"trace {what} with {what_loss} is not traced: the chunked loss runs the model's body "
                            "and head outside the wrapper's forward (DDP's reducer, FSDP2's root unit); use estimate")
    if t.fsdp is not None and t.fsdp_version == 2 and t.optimizer == "adafactor":
        raise TrainmemError(f"trace {what} with --optimizer adafactor is not traced: transformers' Adafactor mixes "
                            "plain tensors with FSDP2's DTensor shards, which DTensor refuses; use estimate")
    if t.fsdp is None and t.dp > 1 and t.optimizer_in_backward:
        raise TrainmemError(f"trace {what} with --optimizer-in-backward is not traced: the per-parameter hooks run "
                            "before DDP all-reduces the gradient (PyTorch's way is DDP._register_fused_optim); "
                            "use --fsdp full or grad-op, or estimate")


def _check_fsdp1(t: TrainingSpec, what: str) -> None:
    """The FSDP1 refusals: what ``wrappers.fsdp1`` on the fake group does not run as a real job would."""
    what = f"{what} --fsdp-version 1"
    if t.tp > 1:
        raise TrainmemError(f"trace {what}: FSDP1 over tensor-parallel DTensor parameters is not traced (measure "
                            "refuses it too); use --fsdp-version 2, or estimate")
    if t.optimizer_in_backward:
        raise TrainmemError(f"trace {what} with --optimizer-in-backward is not traced: with use_orig_params=True "
                            "autograd accumulates into FSDP1's flat parameter, so the original parameters' "
                            "post-accumulate-grad hooks never fire; use --fsdp-version 2, or estimate")
    if t.precision == "bf16-mp" and t.lora_rank and t.fsdp_lora_units == "separate" and not t.lora_half:
        raise TrainmemError(f"trace {what} --precision bf16-mp with --lora-rank fails in FSDP1 itself: peft casts "
                            "the input to its adapter's dtype, read outside the adapter's own unit as the fp32 shard, "
                            "and the unit, gathered in bf16, does not cast its inputs (MixedPrecision."
                            "cast_forward_inputs=False), so F.linear gets fp32 and bf16; use --fsdp-lora-units layer, "
                            "--precision bf16-amp or --fsdp-version 2")
    if t.fsdp_mixed_units and t.precision in ("bf16", "fp16") and not t.lora_half:
        raise TrainmemError(f"trace {what} --fsdp-lora-units layer --precision {t.precision}: FSDP1 refuses a unit "
                            f"holding {t.precision} base weights and fp32 adapters (_flat_param.py "
                            "_validate_tensors_to_flatten: 'Must flatten tensors with uniform dtype'); add "
                            "--lora-dtype half (litgpt builds the adapters in the model's dtype)")
    if t.optimizer == "adafactor":
        raise TrainmemError(f"trace {what} with --optimizer adafactor is not traced: FSDP1 hands the optimizer "
                            "1-D views of its flat shards (use_orig_params=True, _flat_param.py "
                            "_use_sharded_views), so Adafactor would keep unfactored states the estimate does not "
                            "model; use --fsdp-version 2, or estimate")


def _check_pp(t: TrainingSpec, spec: Any, device: str, what: str) -> None:
    """The pipeline-parallel refusals: what ``wrappers.PipelineStageModule`` and ``workload.
    PipelineTrainStep`` (torch's ``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``,
    ``ScheduleInterleavedZeroBubble``) do not run (the virtual stages' own rules: ``TrainingSpec``)."""
    if device != "cuda" or spec is None:
        return  # refused below with the data-parallel setups' reasons
    if spec.model_type not in PP_MODEL_TYPES or spec.head != "causal-lm":
        raise TrainmemError(f"trace {what}: the pipeline split is written for Llama, Mistral and Qwen2 (embeddings, "
                            f"decoder layers, final norm and head of a causal LM), not a {spec.model_type} "
                            f"{spec.head} model ({spec.name}); use estimate")
    if t.fsdp is not None and t.fsdp_version == 1:
        raise TrainmemError(f"trace {what} --fsdp-version 1: torch's PipelineStage drives FSDP2 (FSDPModule) and "
                            "DDP modules (stage.py backward_maybe_with_nosync), not FSDP1's FullyShardedDataParallel; "
                            "use --fsdp-version 2, or estimate")
    if t.fsdp is not None and t.grad_sync != "step" and t.grad_accum > 1:
        raise TrainmemError(f"trace {what} with --grad-sync {t.grad_sync}: torch's PipelineStage keeps FSDP2's "
                            "gradients unsharded through every micro-batch and reduce-scatters them once after the "
                            "schedule (stage.py backward_maybe_with_nosync, perform_reduce_grad), which is "
                            "--grad-sync step; add it (or use estimate)")
    if t.grad_accum < t.pp and t.pp_schedule == "1f1b":
        raise TrainmemError(f"trace {what} with --grad-accum {t.grad_accum}: torch's Schedule1F1B needs at least as "
                            f"many micro-batches as stages (schedules.py); use --grad-accum {t.pp} or more, or "
                            "--pp-schedule gpipe")
    if t.pp_schedule in ("interleaved-1f1b", "zero-bubble") and t.num_microbatches_in_flight is not None:
        raise TrainmemError(f"trace {what} with --num-microbatches-in-flight {t.num_microbatches_in_flight}: trace "
                            f"runs torch's {SCHEDULE_NAMES[t.pp_schedule]}, whose virtual stages each keep their "
                            "own count in flight; drop it")
    inflight = t.pp if t.pp_schedule == "1f1b" else t.grad_accum
    if t.num_microbatches_in_flight not in (None, inflight):
        raise TrainmemError(f"trace {what} with --num-microbatches-in-flight {t.num_microbatches_in_flight}: trace "
                            f"runs torch's {t.pp_schedule} schedule, whose first stage keeps {inflight} in flight; "
                            "drop it")
    # (--lora-rank runs: the split cuts peft's base model, wrappers.pipeline_stage_module; with --tp: _check_tp)
    refused = [(t.quantize, "--quantize"),
               (t.loss_chunks > 1 or t.loss in ("chunked", "fused", "chunked-nll"), "a chunked loss"),
               (t.hold_output != "loss", f"--hold-output {t.hold_output} (the schedule returns no output to the "
                                         "loop: return_outputs=False)"),
               (t.optimizer_in_backward, "--optimizer-in-backward")]
    bad = [name for flag, name in refused if flag]
    if bad:
        raise TrainmemError(f"trace {what} with {bad[0]} is not traced; use estimate")


#: --attention values whose SDPA call PyTorch's ring attention takes: its handler runs the flash,
#: memory-efficient and cuDNN kernels only (torch 2.13 ``_context_parallel/_attention.py`` ``_sdpa_handler``,
#: L897-939: "CP only supports flash attention and memory efficient attention now")
CP_ATTENTION = ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")


def _check_cp(t: TrainingSpec, spec: Any, device: str, what: str) -> None:
    """The context-parallel refusals: what PyTorch's ``context_parallel`` on the transformers model
    (``wrappers.context_parallel``, as transformers' Trainer and accelerate run it) does not run."""
    if device != "cuda" or spec is None:
        return  # refused below with the data-parallel setups' reasons
    if spec.model_type not in CP_MODEL_TYPES or spec.head != "causal-lm":
        raise TrainmemError(f"trace {what}: context parallelism is traced for Llama, Mistral and Qwen2 causal LMs "
                            f"(their self_attn modules take accelerate's mask hooks), not a {spec.model_type} "
                            f"{spec.head} model ({spec.name}); use estimate")
    if t.attention not in CP_ATTENTION:
        raise TrainmemError(f"trace {what} with --attention {t.attention}: PyTorch's context_parallel replaces "
                            "F.scaled_dot_product_attention and its ring runs the flash, memory-efficient and cuDNN "
                            "kernels only (transformers' Trainer refuses any other attention); give --attention sdpa")
    refused = [(t.pp > 1, f"--pp {t.pp} (a (pp, cp) mesh is not built)"),
               (t.dp > 1 and t.fsdp is None, f"--dp {t.dp} without --fsdp (accelerate runs context parallelism "
                                             "with FSDP2 only, sharded over dp x cp; add --fsdp full)"),
               (t.fsdp is not None and t.fsdp_version == 1, "--fsdp-version 1 (FSDP2 shards over dp x cp)"),
               (t.loss is not None or t.loss_chunks > 1, "a loss other than the model's own (the Trainer's "
                                                         "sharded shift_labels feed the model's loss)"),
               (t.compile, "--compile"), (bool(t.quantize), "--quantize")]
    bad = [name for flag, name in refused if flag]
    if bad:
        raise TrainmemError(f"trace {what} with {bad[0]} is not traced; use estimate")


def _check_tp(t: TrainingSpec, spec: Any, device: str, what: str) -> None:
    """The tensor-parallel refusals: what the plan (``wrappers.tp_layer_plan``) does not cover."""
    if device != "cuda" or spec is None:
        return  # refused below with the data-parallel setups' reasons
    if spec.model_type not in TP_MODEL_TYPES:
        raise TrainmemError(f"trace {what}: the tensor-parallel plan is written for Llama, Mistral, Qwen2 and Qwen3 layers "
                            f"(q/k/v/o and gate/up/down projections), not {spec.model_type} ({spec.name}); "
                            "use estimate")
    if t.dp > 1 and t.fsdp is None:
        raise TrainmemError(f"trace {what}: --dp with --tp needs --fsdp (FSDP2 over the dp dimension of the mesh); "
                            "DDP does not wrap tensor-parallel DTensor parameters (torchtitan v0.2.2 "
                            "models/llama3/infra/parallelize.py L148-152: \"DDP has not supported > 1D parallelism\")")
    if t.lora_rank:
        raise TrainmemError(f"trace {what} with --lora-rank is not traced: peft's LoRA linears replace the "
                            "projections the tensor-parallel plan names; use estimate")
    if t.loss == "chunked":
        raise TrainmemError(f"trace {what} with --loss chunked is not traced: the chunked loss runs the head "
                            "outside the plan's vocabulary-parallel output (loss_parallel); use estimate")
    if t.optimizer == "adafactor":
        raise TrainmemError(f"trace {what} with --optimizer adafactor is not traced: transformers' Adafactor mixes "
                            "plain tensors with the DTensor shards, which DTensor refuses; use estimate")


@contextlib.contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in which this process is rank ``rank``."""
    import torch.distributed as dist
    if not dist.is_available():
        raise TrainmemError("this PyTorch build has no torch.distributed: trace cannot run data parallelism")
    if dist.is_initialized():
        raise TrainmemError("a torch.distributed process group is already initialised in this process; trace "
                            "runs data parallelism on a fake group of its own (call it outside a distributed run)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    _forget_local_shapes()
    try:
        with warnings.catch_warnings():  # the wrappers' advice to a training script (e.g. FSDP2's "returned a
            warnings.filterwarnings("ignore", module=r"torch\.distributed")  # view tensor") is not the user's
            yield
    finally:
        dist.destroy_process_group()
        _forget_local_shapes()


def _forget_local_shapes() -> None:
    """Empty DTensor's sharding-propagation caches, Python's and the C++ fast path's (torch 2.13
    ``distributed/tensor/debug/__init__.py`` ``_clear_sharding_prop_cache`` clears the same two;
    ``_sharding_prop.py`` L385: ``propagate_op_sharding`` is an ``lru_cache`` keyed by the op
    schema). Their answers hold this rank's local shapes (``compute_local_shape_and_global_offset``
    for shape arguments such as a view's, ``_sharding_prop.py`` L1060), but the key names the mesh,
    not the rank, since a real process is one rank for good. Trace runs one rank after another in
    one process: a cached answer of rank 0 would give rank 2 of an uneven split rank 0's shapes."""
    from torch.distributed.tensor import DTensor
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


# ----- patches: the wrappers on the emulated GPU ------------------------------------------------------
def _scoped(tracker: Tracker, category: str, label: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with tracker.scope(category, label):
            return fn(*args, **kwargs)
    return run


def _device_handle(orig: Callable) -> Callable:
    def handle(device_type: str = "cuda") -> Any:
        return torch.cuda if device_type == "meta" else orig(device_type)
    return handle


def _post_backward(tracker: Tracker, orig: Callable) -> Callable:
    """``FSDPParamGroup.post_backward`` with its unsharded gradients counted as gradients."""
    @functools.wraps(orig)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        for fsdp_param in self.fsdp_params:
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is not None and param.grad is not None:
                tracker.reclassify(param.grad, "gradients", "unsharded")
        return orig(self, *args, **kwargs)
    return run


def _fsdp1_post_backward(tracker: Tracker, orig: Callable) -> Callable:
    """FSDP1's ``_post_backward_hook`` (torch 2.13 ``fsdp/_runtime_utils.py`` L700-773) with its
    buffers named: the flat parameter's unsharded gradient (made by autograd's ``AccumulateGrad``)
    is ``gradients.unsharded``; what the hook allocates (the gradient cast to ``reduce_dtype``,
    ``F.pad``'s padded copy when the world size does not divide it, ``_get_reduce_scatter_tensors``'
    new shard) ``communication.fsdp_reduce_scatter``; the reduced shard it keeps
    (``_saved_grad_shard``, the optimizer's gradient) ``gradients``."""
    @functools.wraps(orig)
    def run(state: Any, handle: Any, flat_param: Any, *unused: Any) -> Any:
        flat = handle.flat_param
        if flat.grad is not None:
            tracker.reclassify(flat.grad, "gradients", "unsharded")
        with tracker.scope("communication", "fsdp_reduce_scatter"):
            out = orig(state, handle, flat_param, *unused)
        shard = getattr(flat, "_saved_grad_shard", None)
        if shard is not None:
            tracker.reclassify(shard, "gradients", "")
        return out
    return run


def _fsdp1_device_handle(orig: Callable) -> Callable:
    """``_FSDPDeviceHandle.from_device`` (torch 2.13 ``fsdp/_common_utils.py`` L236-248) answers
    ``getattr(torch, device.type)``; for ``meta``, the emulated GPU, it is ``torch.cuda`` (the
    emulated module), as ``_device_handle`` answers FSDP2."""
    def from_device(device: torch.device) -> Any:
        return torch.cuda if device.type == "meta" else orig(device)
    return from_device


def _fsdp1_init_patches() -> dict[tuple[Any, str], Any]:
    """FSDP1's initialisation on the emulated GPU (``device_id=torch.device("meta")``,
    ``wrappers.fsdp1``). ``_init_param_handle_from_module`` (torch 2.13 ``fsdp/_init_utils.py``
    L563-640) takes ``meta`` parameters for a model not yet materialised
    (``_need_to_materialize_module`` L873-900) and would ``to_empty`` + ``reset_parameters()`` it;
    on the emulated GPU ``meta`` is the device and the model is already there, so nothing is to be
    materialised. ``_get_device_from_device_id`` (L843-870) replaces a device without an index by
    ``torch.device(current_device())``, which ``_get_compute_device`` (L1075-1104) then finds
    inconsistent with the parameters' ``meta``: the emulated device is kept as given; a unit with no
    parameters of its own (``always_wrap_policy`` wraps every module: activations, the rotary
    embedding, a ``ModuleList`` whose children are units) asks ``current_device()`` in
    ``_get_compute_device`` (L1075-1104), which gets that device too. The flat parameters are then
    built, sharded and run by FSDP1's own code."""
    from torch.distributed.fsdp import _common_utils as common
    from torch.distributed.fsdp import _init_utils as init
    from_device = _fsdp1_device_handle(common._FSDPDeviceHandle.from_device)
    materialize = init._need_to_materialize_module
    from_id = init._get_device_from_device_id

    def need_to_materialize(module: Any, ignored_params: Any, ignored_modules: Any) -> tuple[bool, bool]:
        if all(p.device.type == "meta" for p in module.parameters()):
            return False, False
        return materialize(module, ignored_params, ignored_modules)

    def device_from_id(device_id: Any, rank: int, device_handle: Any) -> Any:
        if isinstance(device_id, torch.device) and device_id.type == "meta":
            return device_id
        return from_id(device_id, rank, device_handle)

    def compute_device(module: Any, ignored_params: Any, device: Any, rank: int, device_handle: Any) -> Any:
        if device is not None and device.type == "meta":
            return device
        return compute(module, ignored_params, device, rank, device_handle)

    compute = init._get_compute_device
    return {(common._FSDPDeviceHandle, "from_device"): staticmethod(from_device),
            (init, "_need_to_materialize_module"): need_to_materialize,
            (init, "_get_device_from_device_id"): device_from_id, (init, "_get_compute_device"): compute_device}


def _storage_address(st: Any) -> int:
    """An emulated GPU storage's address: the ``StorageImpl``'s (``UntypedStorage._cdata``), one per
    allocation and stable across ``resize_``, or 0 once it has no bytes, as CUDA's null pointer of a
    freed (``resize_(0)``) storage; a ``meta`` storage's ``data_ptr()`` is always 0."""
    return st._cdata if st.nbytes() > 0 else 0


@contextlib.contextmanager
def _addresses() -> Iterator[None]:
    """``Tensor.data_ptr`` and ``UntypedStorage.data_ptr`` of the emulated GPU's tensors as
    :func:`_storage_address` (plus the tensor's offset), for the FSDP1 code that compares or tests
    data pointers."""
    tensor_ptr, storage_ptr = torch.Tensor.data_ptr, torch.UntypedStorage.data_ptr

    def tensor_address(t: torch.Tensor) -> int:
        if t.device.type != "meta":
            return tensor_ptr(t)
        base = _storage_address(t.untyped_storage())
        return base + t.storage_offset() * t.element_size() if base else 0

    def storage_address(st: Any) -> int:
        return _storage_address(st) if st.device.type == "meta" else storage_ptr(st)

    with _patched({(torch.Tensor, "data_ptr"): tensor_address, (torch.UntypedStorage, "data_ptr"): storage_address}):
        yield


def _with_addresses(fn: Callable) -> Callable:
    """``fn`` run under :func:`_addresses`. FSDP1 asks whether the flat parameter is back on its
    sharded storage by comparing data pointers (torch 2.13 ``fsdp/_runtime_utils.py`` L1145-1150,
    ``_catch_all_reshard``: ``flat_param.data_ptr() == flat_param._local_shard.data_ptr()``), and,
    before each unshard, whether the unsharded flat parameter kept for SHARD_GRAD_OP's skipped views
    is allocated and whether the original parameters still share its storage
    (``_flat_param.py`` L2241-2330 ``_writeback_orig_params``: ``_data_ptr_allocated``,
    ``_same_storage``). On ``meta`` every pointer is 0: the first answer would always be "already
    resharded" (a unit whose post-backward hook did not run would stay gathered), the second "not
    allocated" (SHARD_GRAD_OP stops on its assertion)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _addresses():
            return fn(*args, **kwargs)
    return run


def _fsdp1_patches(tracker: Tracker) -> dict[tuple[Any, str], Any]:
    """FSDP1 on the emulated GPU (:func:`_fsdp1_init_patches`) with its buffers attributed:
    ``FlatParamHandle.unshard`` (the padded unsharded flat parameter, allocated with
    ``_alloc_storage``, i.e. ``UntypedStorage.resize_``, and all-gathered into) is
    ``communication.fsdp_unsharded_params``; ``_use_low_precision_shard`` (the shard cast to
    ``param_dtype`` under mixed precision, the all-gather's input, freed by ``post_unshard``)
    ``communication.fsdp_all_gather``; ``_post_backward_hook`` as :func:`_fsdp1_post_backward`."""
    from torch.distributed.fsdp import _flat_param as fp
    from torch.distributed.fsdp import _runtime_utils as rt
    out = _fsdp1_init_patches()
    handle = fp.FlatParamHandle
    out[(handle, "unshard")] = _scoped(tracker, "communication", "fsdp_unsharded_params", handle.unshard)
    out[(handle, "_use_low_precision_shard")] = _scoped(tracker, "communication", "fsdp_all_gather",
                                                        handle._use_low_precision_shard)
    out[(rt, "_post_backward_hook")] = _fsdp1_post_backward(tracker, rt._post_backward_hook)
    out[(rt, "_catch_all_reshard")] = _with_addresses(rt._catch_all_reshard)
    out[(handle, "_writeback_orig_params")] = _with_addresses(handle._writeback_orig_params)
    return out


def patches(tracker: Tracker) -> dict[tuple[Any, str], Any]:
    """(object, attribute) -> value: FSDP2, FSDP1 and DDP on the emulated GPU, their buffers attributed."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
    import torch.distributed.utils as dist_utils
    import torch.nn.parallel.distributed as ddp_module
    out: dict[tuple[Any, str], Any] = {}
    for name in _DEVICE_HANDLE_USERS:
        mod = importlib.import_module(name)
        out[(mod, "_get_device_handle")] = _device_handle(vars(mod)["_get_device_handle"])
    out[(pg.FSDPParamGroup, "_validate_no_meta_params")] = lambda self: None
    out[(pg.FSDPParamGroup, "post_backward")] = _post_backward(tracker, pg.FSDPParamGroup.post_backward)
    out[(pg, "foreach_all_gather")] = _scoped(tracker, "communication", "fsdp_all_gather", pg.foreach_all_gather)
    out[(pg, "foreach_all_gather_copy_out")] = _scoped(tracker, "communication", "fsdp_unsharded_params",
                                                       pg.foreach_all_gather_copy_out)
    out[(pg, "foreach_reduce")] = _scoped(tracker, "communication", "fsdp_reduce_scatter", pg.foreach_reduce)
    out[(ddp_module, "_verify_param_shape_across_processes")] = lambda *a, **k: None
    out[(dist_utils, "_verify_param_shape_across_processes")] = lambda *a, **k: None
    out.update(_speed_patches())
    out.update(_meta_uncounted(tracker))
    dp_cls = ddp_module.DistributedDataParallel
    out[(dp_cls, "_pre_forward")] = _scoped(tracker, "communication", "ddp_buckets", dp_cls._pre_forward)
    from torch.distributed.pipelining import schedules
    out[(schedules._PipelineSchedule, "_warmup_p2p")] = _static_vote(schedules._PipelineSchedule._warmup_p2p)
    import torch.distributed as dist
    out[(dist, "batch_isend_irecv")] = _p2p_one_by_one
    out.update(_fsdp1_patches(tracker))
    from torch.distributed import _functional_collectives as funcol
    out[(funcol, "_maybe_wrap_tensor")] = _wrap_without_copy(funcol._maybe_wrap_tensor)
    return out


def _wrap_without_copy(orig: Callable) -> Callable:
    """``_functional_collectives._maybe_wrap_tensor`` (torch 2.13 ``_functional_collectives.py``
    L1402-1405) on the emulated GPU. Every functional collective (DTensor's redistributions, the ring
    attention's all-gather and all-to-all) hands its output to the ``_wrap_tensor_autograd`` custom op,
    whose kernel returns ``AsyncCollectiveTensor(input)``, a wrapper around the same storage (L1325-1343,
    identity backward L1354-1385), and the first use waits with ``wait_tensor``, whose CUDA kernel
    returns its input (``torch/csrc/distributed/c10d/Functional.cpp`` ``wait_tensor``). On ``meta``
    the dispatcher runs the fake kernels instead, both ``torch.empty_like(input)`` (L1346-1351,
    ``_wait_tensor_meta`` L1470), a second buffer of the output's size that a GPU never allocates.
    Here the collective's output is returned as it is: the storage a GPU keeps, with its autograd
    edge (the fake group completes every collective at once, so there is nothing to wait for)."""
    from torch.distributed._functional_collectives import _are_we_tracing

    def run(self: torch.Tensor) -> torch.Tensor:
        if self.device.type != "meta" or _are_we_tracing():
            return orig(self)
        return self
    return run


def _p2p_one_by_one(p2p_op_list: list) -> list:
    """``dist.batch_isend_irecv`` as its branch for a backend without coalescing (torch 2.13
    ``distributed_c10d.py`` ``batch_isend_irecv``: each ``P2POp`` issued in order, their works
    returned). The pipeline schedules call it for a mixed batch of sends and receives
    (``schedules.py`` ``_batch_p2p``); its coalescing branch asks the group for the backend of the
    tensors' device, and the emulated GPU's tensors are on ``meta``, which the fake group has no
    backend for. Coalescing groups NCCL's launches and allocates nothing the caching allocator sees."""
    reqs = []
    for op in p2p_op_list:
        key = "group_dst" if op.op is torch.distributed.isend else "group_src"
        work = op.op(op.tensor, group=op.group, tag=op.tag, **{key: op.group_peer})
        if work:
            reqs.append(work)
    return reqs


def _static_vote(orig: Callable) -> Callable:
    """The pipeline schedule's warm-up vote on the fake group (torch 2.13
    ``distributed/pipelining/schedules.py`` ``_warmup_p2p``; ``stage.py`` ``_warmup_forward_vote`` /
    ``_warmup_backward_result``): each stage votes 1 (static: its example inputs and outputs were
    given) or 0, the product travels to the last stage and back with ``dist.send`` / ``dist.recv``,
    and ``result.item() == 1`` selects the static mode. On the fake group a receive leaves its
    buffer as allocated and ``.item()`` of an emulated tensor reads 0, so every stage would fall to
    the dynamic mode, whose metadata exchange (``recv_object_list``) the fake group cannot answer.
    Every rank's ``PipelineTrainStep`` gives its stage both example tensors, so every real vote is
    1: the stages are set to the static mode the vote would have reached."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.stage import PipelineStage

    @functools.wraps(orig)
    def run(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        if not all(isinstance(s, PipelineStage) and not InferenceMode.needs_dynamic(s._user_meta, has_backward)
                   for s in stages):
            return orig(self, stages, has_backward, p2p_done)
        for s in stages:
            s._inference_mode = InferenceMode.STATIC
    return run


def _strided_flag_once(orig: Callable) -> Callable:
    """``_propagate_use_strided_shard_flag`` (torch 2.13 ``distributed/tensor/_sharding_prop.py``
    L48-80) scans the whole op schema's ``args_spec`` for ``_StridedShard`` inputs, and
    ``propagate_op_sharding_non_cached`` calls it once per child of a foreach op's strategy with the
    same schema (L920-923): quadratic in the number of tensors, 90% of a 70B FSDP2 optimizer step
    here. The scan's answer depends on the schema alone, so it is made once per schema; a schema
    without ``_StridedShard`` inputs (FSDP2's ``Shard(0)``) has nothing to fix up, as in the
    original. Speed only: the same strategies come out."""
    from torch.distributed.tensor.placement_types import _StridedShard
    last: list[Any] = [None, False]  # the schema last scanned (held, so its id is not reused) and its answer

    def run(op_strategy: Any, op_schema: Any) -> None:
        if last[0] is not op_schema:
            last[0] = op_schema
            last[1] = any(isinstance(p, _StridedShard) for spec in op_schema.args_spec for p in spec.placements)
        if last[1]:
            orig(op_strategy, op_schema)
    return run


def _meta_uncounted(tracker: Tracker) -> dict[tuple[Any, str], Any]:
    """DTensor's sharding propagation on a cache miss (a rank's first step: every op's first schema)
    runs the op once on fake tensors of the GLOBAL shapes for its output's metadata (torch 2.13
    ``distributed/tensor/_sharding_prop.py`` L520-578 ``_propagate_tensor_meta_non_cached``:
    ``fake_mode = detect_fake_mode() or FakeTensorMode()`` L546, ``gen_fake_args()`` and
    ``op_schema.op(...)`` L548-550; "We must call the tracing in fake tensor mode so that it avoids
    materializing memory", L531). On a GPU no fake mode is active, so a fresh ``FakeTensorMode``
    makes them and no device memory is taken. Trace runs inside its own fake mode, which
    ``detect_fake_mode`` finds, so without this the tracker counted those global-shape tensors as
    device blocks: under TP 2 with autocast, ``ToCopyBackward0``'s fp32 cast of the tied head's
    gradient as the whole (vocab, hidden) table (1002 MiB for Llama-3.2, first step only) opened a
    segment the real run never opens. Here they pass through uncounted (``Tracker.paused``)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(orig)
    def run(self: Any, op_schema: Any) -> Any:
        with tracker.paused():
            return orig(self, op_schema)
    return {(ShardingPropagator, "_propagate_tensor_meta_non_cached"): run}


def _speed_patches() -> dict[tuple[Any, str], Any]:
    """DTensor's sharding propagation made cheaper for a foreach optimizer step over many shards,
    the same strategies coming out (:func:`_strided_flag_once`, :func:`_foreach_deduplicated`);
    ``tests/test_trace_speed.py`` traces with and without them and compares the reports."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    return {(sharding_prop, "_propagate_use_strided_shard_flag"): _strided_flag_once(
                sharding_prop._propagate_use_strided_shard_flag),
            (sharding_prop, "_expand_single_dim_strategy_to_mesh"): _foreach_deduplicated(
                sharding_prop._expand_single_dim_strategy_to_mesh)}


_FOREACH_PREFIXES = ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")


def _foreach_deduplicated(orig: Callable) -> Callable:
    """``_expand_single_dim_strategy_to_mesh`` (torch 2.13 ``distributed/tensor/_ops/
    single_dim_strategy.py`` L627-745) for a foreach op expands a strategy for every index of its
    tensor lists (``expanded_foreach_strategy``: the per-index schema, L698-725, then the full-mesh
    expansion, L653-676), each from that index's input specs and output metadata alone (the other
    arguments, such as a scalar list, are passed whole to every index). An AdamW step over the 723
    FSDP2 shards of a 70B model repeats that 723 times per foreach op for a dozen distinct specs,
    and the per-index schema copies the op's scalar lists each time (quadratic): most of the step.
    Here the expansion runs once per distinct (input specs, output metadata) — the key DTensor's
    own sharding cache uses (``DTensorSpec.__hash__``/``__eq__``: mesh, placements, shard order,
    shape, stride, dtype), plus ``use_strided_shard_as_shard_order`` — and each index gets its
    group's strategy (shared: ``_propagate_use_strided_shard_flag``, L48-90, then sets every
    ``_StridedShard`` spec of a child to one value computed from the whole schema, so fixing a
    shared child up twice is fixing it once). A wrapped input with more than one strategy, or an
    unhashable (symbolic) spec, takes the original path."""
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy

    def expand(mesh: Any, op_schema: Any, strategy_info: Any, output_tensor_meta: Any) -> Any:
        groups = _foreach_groups(op_schema, output_tensor_meta, OpStrategy, TupleStrategy)
        if groups is None:
            return orig(mesh, op_schema, strategy_info, output_tensor_meta)
        firsts, group_of = groups
        args = tuple(type(a)(tuple(a.children[i] for i in firsts)) if isinstance(a, TupleStrategy) else a
                     for a in op_schema.args_schema)
        metas = None if output_tensor_meta is None else [output_tensor_meta[i] for i in firsts]
        schema = OpSchema(op_schema.op, args, op_schema.kwargs_schema, schema_info=op_schema.schema_info)
        fn = orig(mesh, schema, strategy_info, metas)

        def strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
            done = fn(op, args_schema, kwargs_schema)
            return TupleStrategy([done.children[g] for g in group_of])
        return strategy
    return expand


def _foreach_groups(op_schema: Any, output_tensor_meta: Any, op_strategy: type,
                    tuple_strategy: type) -> tuple[list[int], list[int]] | None:
    """For a foreach op whose list indices repeat: the first index of each distinct (input specs,
    output metadata) and each index's group; None where :func:`_foreach_deduplicated` keeps the
    original path (not a foreach op, no repeat, or a case it does not take)."""
    lists = [a for a in op_schema.args_schema if isinstance(a, tuple_strategy)]
    if not lists or not op_schema.op.name().startswith(_FOREACH_PREFIXES) or any(
            isinstance(v, tuple_strategy) for v in op_schema.kwargs_schema.values()):
        return None
    n = len(lists[0].children)
    if any(len(a.children) != n for a in lists) or (output_tensor_meta is not None and (
            not isinstance(output_tensor_meta, (list, tuple)) or len(output_tensor_meta) != n)):
        return None  # left to the original, which checks the lengths
    keys = []
    for i in range(n):
        key = []
        for a in lists:
            child = a.children[i]
            if not isinstance(child, op_strategy) or len(child.strategies) != 1:
                return None
            spec = child.strategies[0].output_specs
            key.append((spec, getattr(spec, "use_strided_shard_as_shard_order", None)))
        key.append(None if output_tensor_meta is None else output_tensor_meta[i])
        keys.append(tuple(key))
    index: dict[Any, int] = {}
    try:
        group_of = [index.setdefault(k, len(index)) for k in keys]
    except TypeError:  # a symbolic shape: not hashable
        return None
    if len(index) == n:
        return None
    firsts = [0] * len(index)
    for i in reversed(range(n)):
        firsts[group_of[i]] = i
    return firsts, group_of


def _allreduce_in_place(world: int, group: Any = None) -> Callable:
    """DDP's built-in all-reduce hook on the fake group: ``AllReduceCommHook::runHook``
    (default_comm_hooks.cpp) divides the bucket by the world size and all-reduces it in place
    (over ``group``, DDP's process group; None: the default group)."""
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
        import torch.distributed as dist
        buf = bucket.buffer()
        buf.div_(world)
        dist.all_reduce(buf, group=group)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut
    return hook


def wrap(module: torch.nn.Module, spec: Any, t: TrainingSpec, tracker: Tracker) -> torch.nn.Module:
    """The model wrapped as ``t`` asks, on the fake group. FSDP2 shards the unmaterialised model
    (as torchtitan does: built on ``meta``, sharded, then given memory), so only the shards are
    ever loaded; DDP wraps the loaded model inside the tracker: its buckets are counted. A pipeline
    stage is cut from the unmaterialised model (``wrappers.PipelineStageModule``, this rank's stage)."""
    if t.pp > 1:
        return _pipeline_stage(module, spec, t)
    device_mesh = mesh(t, "cuda")
    if t.tp > 1:
        tensor_parallel(module, spec, device_mesh["tp"], t.sequence_parallel)
    if t.cp > 1:  # the mesh TrainStep's context_parallel runs on, and accelerate's mask hooks
        module.cp_mesh = device_mesh["cp"]
        context_parallel_hooks(module)
    if t.fsdp is not None and t.fsdp_version == 1:  # the flat parameters built and sharded on the emulated GPU
        return fsdp1(module, spec, t, device_mesh["dp"], torch.device("meta"))
    if t.fsdp is not None:
        fsdp2(module, spec, t, dp_mesh(device_mesh, t))
        return module
    return module


def wraps_loaded(t: TrainingSpec) -> bool:
    """Whether DDP wraps the model once it is loaded (``wrap_loaded``): ``--dp`` without FSDP, on
    one model or on each pipeline stage."""
    return (t.dp > 1 and t.fsdp is None) or deepspeed_engine.uses_deepspeed(t)


def wrap_loaded(module: torch.nn.Module, t: TrainingSpec, tracker: Tracker) -> torch.nn.Module:
    """DDP around the loaded model, its buckets counted (``communication.ddp_buckets``). Under
    pipeline parallelism each stage module is wrapped over its stage's data-parallel group, as
    torchtitan's ``apply_ddp`` wraps each model part; the schedule's ``PipelineStage`` takes the DDP
    module (torch 2.13 ``pipelining/stage.py`` ``forward_maybe_with_nosync`` and
    ``backward_maybe_with_nosync``: every micro-batch under ``no_sync`` but the stage's last backward,
    before which it calls the reducer's ``prepare_for_backward``). With ``--zero`` (no ``--fsdp``)
    the loaded model goes to ``deepspeed.initialize`` instead (``trace.deepspeed_engine.wrap``)."""
    if deepspeed_engine.uses_deepspeed(t):
        return deepspeed_engine.wrap(module, t, tracker)
    if t.pp == 1:
        return _ddp(module, t, tracker, None)
    group = module.dp_group
    if t.virtual_stages > 1:  # the rank's stages, each its own DDP module
        for i, stage in enumerate(list(module.stages)):
            module.stages[i] = _ddp(stage, t, tracker, group)
        return module
    return _ddp(module, t, tracker, group)


def ddp_targets(module: torch.nn.Module, t: TrainingSpec) -> list[torch.nn.Module]:
    """The modules :func:`wrap_loaded` wraps in DDP (before it) or its DDP modules (after): the
    model, or the rank's virtual pipeline stages."""
    if deepspeed_engine.uses_deepspeed(t):
        return []  # the engine keeps the model as its ``module``, which keeps its name
    return list(module.stages) if t.pp > 1 and t.virtual_stages > 1 else [module]


def _ddp(module: torch.nn.Module, t: TrainingSpec, tracker: Tracker, group: Any) -> torch.nn.Module:
    """``wrappers.ddp`` on the emulated GPU, inside the tracker, with the in-place all-reduce hook."""
    with tracker, tracker.scope("communication", "ddp_buckets"):
        wrapped = ddp(module, t, torch.device("meta"), group)
    wrapped.register_comm_hook(None, _allreduce_in_place(t.dp, group))
    return wrapped


def _pipeline_stage(module: torch.nn.Module, spec: Any, t: TrainingSpec) -> torch.nn.Module:
    """This rank's pipeline stage (``wrappers.PipelineStageModule``, cut from the unmaterialised
    model with torchtitan's split, ``TrainingSpec.pp_less``; the rank's virtual stages,
    ``PipelineRankModule``, under an interleaved schedule). With ``--tp`` and / or ``--dp``, on a
    (pp, dp, tp) ``DeviceMesh`` of the dimensions used, row-major (rank = (stage × dp + dp rank) ×
    tp + tp rank), as torchtitan's ``ParallelDims`` builds its ``("pp", "dp_replicate", "fsdp",
    "tp")`` mesh (v0.2.2 ``distributed/parallel_dims.py`` L149-153) and ``pipeline_llm`` then
    parallelizes each model part (``parallelize_llama``, ``models/llama3/infra/parallelize.py``
    L76-146): the TP plan over the ``tp`` dimension first (with sequence parallelism the stage's
    boundary is its local (b, s/tp, h) shard, ``PipelineStageModule.sp_mesh``), then each stage
    module sharded with FSDP2 over the ``dp`` dimension (its decoder layers, then the stage;
    ``PipelineStage`` drives the units itself, stage.py ``backward_maybe_with_nosync`` and
    ``perform_reduce_grad``); with dp alone and no FSDP its data-parallel group is kept
    (``dp_group``) for DDP once loaded (:func:`wrap_loaded`). Its ``PipelineStage`` sends over the
    ``pp`` dimension's group (``pp_group``)."""
    import torch.distributed as dist
    if t.tp == 1 and t.dp == 1:
        return pipeline_stage_module(module, spec, t.pp, dist.get_rank(), t.virtual_stages, t.pp_less)
    from torch.distributed.device_mesh import init_device_mesh
    dims = [("pp", t.pp)] + [(name, n) for name, n, on in (("dp", t.dp, t.dp > 1 or t.fsdp is not None),
                                                           ("tp", t.tp, t.tp > 1)) if on]
    device_mesh = init_device_mesh("cuda", tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))
    stage = pipeline_stage_module(module, spec, t.pp, device_mesh["pp"].get_local_rank(), t.virtual_stages,
                                  t.pp_less)
    if t.tp == 1 and t.fsdp is None:
        stage.dp_group = device_mesh["dp"].get_group()
    for part in (stage.stages if t.virtual_stages > 1 else [stage]):
        if t.tp > 1:  # each stage module (each virtual stage) over the one tp dimension
            tensor_parallel(part, spec, device_mesh["tp"], t.sequence_parallel)
            part.sp_mesh = device_mesh["tp"] if t.sequence_parallel else None
        part.pp_group = device_mesh["pp"].get_group()
        if t.fsdp is not None:  # each stage module sharded over dp (its own layers, then itself)
            fsdp2(part, spec, t, device_mesh["dp"], part.model.layers)
    return stage


def check_rank(t: TrainingSpec, rank: Any) -> int:
    """The world size, once ``rank`` is known to be one of its ranks (else a one-line error)."""
    world = world_size(t)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise TrainmemError(f"rank {rank!r}: trace one of the {world} ranks (0 to {world - 1})")
    return world


def annotate(report: Any, t: TrainingSpec, rank: int) -> None:
    """The ranks (``extra["ranks"]``, measure's per-rank format), the wrapper and which rank was traced."""
    report.extra.update({"ranks": rank_entries(report, t, rank), "rank": rank, "world_size": world_size(t),
                         "traced_ranks": [rank], "wrapper": wrapper_name(t)})
    report.warnings.append(describe(t, rank))


def describe(t: TrainingSpec, rank: int = 0) -> str:
    """The wrapper and which rank was traced, in words."""
    why = ("every rank holds the same replicas and buckets" if t.fsdp is None and t.tp == 1 else
           "every rank's shards are as large as rank 0's or smaller (torch.chunk gives the first ranks the extra "
           "rows; FSDP2 pads its shards to rank 0's size)")
    which = "rank 0 traced, the worst rank" if rank == 0 else f"rank {rank} traced (rank 0 is the worst)"
    if t.cp > 1:
        why = ("every context-parallel rank but the last merges its ring attention's second half-sequence "
               "iterations with torch.cat, whose contiguous output transformers copies before o_proj; the last "
               "rank's merge holds one more fp32 output-sized temporary instead")
    elif deepspeed_engine.uses_deepspeed(t):
        why = ("ZeRO pads every rank's flat partition to one size; the buckets and gathered parameters are the "
               "same on every rank")
        if t.offload_optimizer:  # (copy_grads_in_partition's device copies: the rank's own parameters)
            why = ("with the optimizer offloaded each rank copies its own partition's gradients for the host: the "
                   "rank holding the largest parameter (rank 0: the embedding; the last: an untied head) peaks "
                   "higher; trace(..., rank=N) traces another")
        which = "rank 0 traced" if rank == 0 else f"rank {rank} traced"
    if t.fsdp == "no-shard":
        why = "NO_SHARD: every rank holds the same whole flat parameters and gradients"
    elif t.fsdp is not None and t.fsdp_version == 1:
        why = ("FSDP1 pads every rank's flat shard to one size; the optimizer keeps a state per piece of an original "
               "parameter in the rank's shard, so a rank whose shard cuts more parameters rounds a few more "
               "512-byte blocks: other ranks may differ by some KiB")
        which = "rank 0 traced" if rank == 0 else f"rank {rank} traced"
    return (f"{wrapper_name(t)} on a fake process group of {world_size(t)} ranks (torch.distributed's fake "
            f"backend): {which} ({why})")


def rank_entries(report: Any, t: TrainingSpec, rank: int = 0) -> list[dict[str, Any]]:
    """``extra["ranks"]`` (the JSON's ``ranks``) in ``measure``'s per-rank format: the traced rank as
    traced, every other rank a copy of it marked ``traced: false`` and ``copied_from``."""
    params = sum(c.bytes for c in report.components if c.category == "parameters")
    states = sum(c.bytes for c in report.components if c.category == "optimizer_states")
    traced = {"rank": rank, "world_size": world_size(t), "local_rank": rank, "host": None,
              "device": report.extra.get("device"), "peak_allocated": int(report.peak_allocated),
              "peak_reserved": report.peak_reserved, "device_used": report.device_used,
              "peak_phase": report.peak_phase, "peak_where": report.peak_where,
              "parameters_bytes": params, "optimizer_states_bytes": states,
              "cuda_context": report.hardware.context if report.hardware is not None else None, "oom": None,
              "components": [c.to_dict() for c in report.components],
              "phases": [p.to_dict() for p in report.phases], "traced": True}
    keep = ("world_size", "device", "peak_allocated", "peak_reserved", "device_used", "peak_phase",
            "parameters_bytes", "optimizer_states_bytes", "cuda_context")
    why = ({"not_traced": "the same program; FSDP1 pads every rank's flat shard to one size, and the optimizer "
                          "states of the parameter pieces in it may round to some KiB more or less"}
           if t.fsdp is not None and t.fsdp_version == 1 and t.fsdp != "no-shard" else
           {"not_traced": "the same program on its share of the sequence; the ring attention's steps differ by "
                          "context-parallel rank (the last one makes no copy of the merged output and holds one more "
                          "fp32 output-sized temporary while merging); trace rank=k for another"}
           if t.cp > 1 else {})
    return [traced if r == rank else
            {"rank": r, "local_rank": r, **{k: traced[k] for k in keep}, "traced": False, "copied_from": rank, **why}
            for r in range(world_size(t))]


# ----- pipeline parallelism: the stages traced and the report of the worst ----------------------------
def pipeline_ranks(t: TrainingSpec, rank: int = 0) -> list[int]:
    """The ranks traced, one per pipeline stage traced: the stages that can be the worst
    (``TrainingSpec.worst_stage_candidates``, the estimate's too): the first (embeddings, the most
    micro-batches in flight under 1F1B: ``pp`` of them) and the last (final norm, head and loss,
    one micro-batch in flight), and under torchtitan's weighted split stage 1 (of the middle stages
    the one with the most layers and micro-batches in flight, and possibly more layers than the
    first); plus ``rank`` if another was asked for. With an even split a middle stage holds its
    layers' activations for fewer micro-batches than the first (``pp - stage``) and neither the
    embeddings nor the head, so it is below the first stage unless the embedding table is smaller
    than the activations one micro-batch of its layers keeps; it is traced on request
    (``rank=k``). A stage's ranks are ``stage × dp × tp`` to ``(stage + 1) × dp × tp − 1``
    (row-major (pp, dp, tp)): its DDP replicas (the same program on the same tensors) or its FSDP2
    and tensor-parallel ranks, of which the first holds the largest shards (``torch.chunk`` gives
    the first ranks the extra rows, FSDP2 pads to rank 0's size), as without pipelining; the first
    is traced."""
    per = t.tp * t.dp
    return sorted({t.stage_number(s) * per for s in t.worst_stage_candidates} | {rank})


def pipeline_report(reports: dict[int, Any], t: TrainingSpec) -> Any:
    """The report of the worst traced stage (highest peak allocated), with ``extra["ranks"]``
    listing every traced stage as traced and the others as not traced."""
    worst = max(reports, key=lambda r: (reports[r].peak_allocated, -r))
    report = reports[worst]
    world, tp = world_size(t), t.tp * t.dp  # ranks per stage: its tensor-parallel ranks or its DDP replicas
    entries = {r: {**rank_entries(rep, t, r)[r], "pipeline_stage": r // tp} for r, rep in reports.items()}
    replica = ("an FSDP2 and tensor-parallel rank of a traced stage: the same program on shards no larger than its "
               "stage's rank 0's" if t.fsdp is not None and t.tp > 1 else
               "an FSDP2 rank of a traced stage: the same program on shards no larger than its data-parallel rank "
               "0's" if t.fsdp is not None else
               "a DDP replica of a traced stage: the same program on the same tensors" if t.dp > 1 else
               "a tensor-parallel rank of a traced stage: the same program on shards no larger than its stage's "
               "tensor-parallel rank 0's")

    def untraced(r: int) -> dict[str, Any]:
        why = (replica if r - r % tp in reports else
               "a middle stage: fewer micro-batches in flight than the first (or stage 1), no embeddings or head, "
               "no more layers than stage 1")
        return {"rank": r, "local_rank": r, "world_size": world, "pipeline_stage": r // tp, "traced": False,
                "not_traced": why}
    ranks = [entries.get(r) or untraced(r) for r in range(world)]
    # the estimate's names for the stage (its ``extra["pipeline_stage"]``): first, last or middle
    stage = worst // tp
    name = "first" if stage == 0 else ("last" if stage == t.pp - 1 else "middle")
    report.extra.update({"ranks": ranks, "rank": worst, "world_size": world, "traced_ranks": sorted(reports),
                         "wrapper": wrapper_name(t), "pipeline_stage": name})
    peaks = ", ".join(f"stage {r // tp} {fmt(reports[r].peak_allocated, 'auto')}" for r in sorted(reports))
    which = ("one rank each" if tp == 1 else f"one rank each (rank 0 of the stage's {t.dp} × {t.tp})"
             if t.tp > 1 and t.dp > 1 else f"one rank each (tensor-parallel rank 0 of {tp})" if t.tp > 1 else
             f"one rank each (data-parallel rank 0 of {tp})")
    report.warnings.append(f"{wrapper_name(t)} on a fake process group of {world} ranks (torch.distributed's fake "
                           f"backend): stages {', '.join(str(r // tp) for r in sorted(reports))} traced, {which} "
                           f"(peak allocated {peaks}); the report is stage {stage}'s, the worst")
    return report
