"""What Megatron-LM and Transformer Engine allocate at a run's first forward and keep until it ends
(``--framework megatron``; ``TrainingSpec.transformer_impl``): memory no tensor of the step stands for,
alive at every phase from the first forward on, the after-step ``mem-allocated-bytes`` included.

* **Transformer Engine's GEMM workspace** (``--transformer-impl transformer_engine``, Megatron's
  default: megatron/core/transformer/transformer_config.py L1220-1222 at core_v0.19.0). TE's GEMMs
  do not use PyTorch's cuBLAS handles: ``general_gemm`` passes ``get_cublas_workspace(device, ub,
  grouped_gemm)`` (transformer_engine/pytorch/cpp_extensions/gemm.py L42-61 and L133 at v2.16, the
  same at v2.14 and v2.18), an ``lru_cache`` d ``torch.empty`` of ``get_cublas_workspace_size_bytes()``
  uint8 (L34-39): 32 MiB + 1024 B when the device's major compute capability is 9 or more (Hopper,
  Blackwell), else 4 MiB. One per device, shared by the forward and the autograd thread, never freed.
  The matmuls Megatron runs in PyTorch beside it (the output layer, ``ColumnParallelLinear``, and
  unfused attention's ``baddbmm``/``bmm``) still bind PyTorch's cuBLAS handles (counted apart).
* **Megatron's global memory buffer** (``_GLOBAL_MEMORY_BUFFER``, megatron/core/parallel_state.py
  L2061-2065 at a53107c006; ``GlobalMemoryBuffer.get_tensor``, megatron/core/utils.py L693-716 at
  core_v0.19.0): a ``torch.empty`` per (name, dtype), grown to the largest request and kept. Two users
  here, both under the name ``"mpu"``:
  - the local layers' unfused attention (``--transformer-impl local``: ``DotProductAttention``,
    megatron/core/transformer/dot_product_attention.py L189-200 at core_v0.19.0) takes its ``baddbmm``
    input from it, ``[b * heads / tp, s, s]`` in the query's dtype, and ``baddbmm(beta=0)`` writes a new
    tensor beside it: the buffer itself holds nothing live but stays allocated;
  - under ``--sequence-parallel``, ``LinearWithGradAccumulationAndAsyncCommunication`` all-gathers a
    column-parallel linear's input into it in forward and again in backward
    (megatron/core/tensor_parallel/layers.py L566-572 and L606-616 at core_v0.19.0), ``[s / cp, b,
    hidden]`` in the input's dtype: the output layer (``tensor_parallel.ColumnParallelLinear``,
    megatron/core/models/gpt/gpt_model.py L264-269) on the stage that holds it, and with local layers
    also their ``linear_qkv`` and ``linear_fc1``.
  Requests of the same dtype share one buffer (the larger one); of different dtypes, one each.

And what Megatron's loop leaves referenced after backward: its pipeline schedules, each model chunk's last
received input and its gradient (``pipeline_inputs_kept``); release 0.18's ``RerunDataIterator``, the step's
micro-batches on the GPU (``rerun_batches_kept``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..spec.model import ModelSpec
from ..spec.training import MULTI_STAGE_SCHEDULES, PP_VIRTUAL_STAGES, TrainingSpec
from . import unsloth
from .layers import Policy

#: transformer_engine/pytorch/cpp_extensions/gemm.py ``get_cublas_workspace_size_bytes`` (v2.14-v2.18)
TE_WORKSPACE_SM90 = 32 * 1024 * 1024 + 1024   # major compute capability >= 9
TE_WORKSPACE = 4_194_304                      # older GPUs (and a GPU not known)


def te_workspace(capability: tuple[int, int] | None) -> int:
    """Bytes of Transformer Engine's one GEMM workspace on a GPU of ``capability`` (None: not known,
    the pre-Hopper size, as ``spec.hardware.default_cublas_workspace`` does for PyTorch's)."""
    return TE_WORKSPACE_SM90 if capability is not None and capability[0] >= 9 else TE_WORKSPACE


def global_buffer(m: ModelSpec, t: TrainingSpec, head_here: bool, n: Any, nsq: Any, tp: Any = None,
                  sp: Any = None) -> Any:
    """Bytes of Megatron's ``_GLOBAL_MEMORY_BUFFER`` on this rank for ``n`` tokens of a micro-batch on
    it and ``nsq`` token x key pairs (see the module doc): by dtype, the larger request; summed.
    ``tp``, ``sp``: the tensor-parallel degree and sequence parallelism (arrays over layouts; None:
    ``t.tp``, ``t.sequence_parallel``)."""
    tp = t.tp if tp is None else tp
    sp = t.sequence_parallel if sp is None else sp
    pol = Policy.of(t.precision)
    by_dtype: dict[int, Any] = {}
    if t.transformer_impl == "local":
        # [b * heads / tp, s, s] in the query's dtype (a linear's output: the matmul dtype)
        by_dtype[pol.half] = (m.num_heads // tp) * nsq * pol.half
    if head_here or t.transformer_impl == "local":
        # [s / cp, b, hidden] gathered over the TP group, in the residual stream's dtype (tp > 1 only)
        gathered = np.where((np.asarray(tp) > 1) & (np.asarray(sp) != 0), n * m.hidden_size * pol.stream, 0)
        by_dtype[pol.stream] = np.maximum(by_dtype.get(pol.stream, 0), gathered)
    total = sum(by_dtype.values())
    return int(total) if np.ndim(total) == 0 else total


def kept_buffers(m: ModelSpec, t: TrainingSpec, stage: str, n: Any, nsq: Any,
                 capability: tuple[int, int] | None, tp: Any = None, sp: Any = None) -> tuple:
    """(Transformer Engine's workspace, Megatron's global buffer[, Unsloth's checkpoint GPU buffer and its
    dequantization buffer]) in bytes on a rank of ``stage``, each allocated in the first forward (Unsloth's at patch time, its
    initial 2 MiB: counted from the first forward too) and kept to the end: zero without
    ``transformer_impl`` (any framework but Megatron-LM) and ``unsloth_gc``. ``tp``, ``sp``: as
    ``global_buffer``."""
    if t.unsloth_gc or t.unsloth_kernels:  # (one GPU: Unsloth's GPU buffers, estimate.unsloth)
        gc = unsloth.gpu_buffer_bytes(m.hidden_size, Policy.of(t.precision).stream, n) if t.unsloth_gc else 0
        return 0, 0, gc, unsloth.weight_buffer_bytes(m, t)
    if t.transformer_impl is None:
        return 0, 0
    te = te_workspace(capability) if t.transformer_impl == "transformer_engine" else 0
    return te, global_buffer(m, t, t.pp == 1 or stage == "last", n, nsq, tp, sp)


def pipeline_inputs_kept(m: ModelSpec, t: TrainingSpec, stage: str, n: Any, tp: Any = None, sp: Any = None,
                         pp: Any = None) -> Any:
    """Bytes of the pipeline inputs Megatron-LM's schedules leave referenced after a step, on a rank of ``stage``
    (``--framework megatron`` under ``--pp``; 0 otherwise), for ``n`` tokens of a micro-batch on the rank (``b x
    s / cp``): every model chunk that receives its input from the previous stage keeps its last micro-batch's
    received input and that input's gradient, both ``[s / cp (/ tp under --sequence-parallel), b, hidden]`` in
    the pipeline dtype (the parameters' dtype: bf16 under ``--bf16``, the residual stream's here), from the
    chunk's last backward of the step to its first forward of the next one: through the optimizer step and the
    after-step ``mem-allocated-bytes``. Source (Megatron-LM at 6e091e1b, the same in core_v0.15.0 to
    core_v0.19.0): ``forward_step`` calls the model's ``set_input_tensor(input_tensor)`` for every micro-batch
    (megatron/core/pipeline_parallel/schedules.py L428-429), which ``GPTModel.set_input_tensor`` hands to
    ``TransformerBlock.set_input_tensor``: ``self.input_tensor = input_tensor``
    (megatron/core/models/gpt/gpt_model.py L282-296; megatron/core/transformer/transformer_block.py L440-448), a
    reference the block keeps until the next call; ``backward_step`` calls ``x.retain_grad()`` on the received
    input before ``backward`` and reads ``x.grad`` to send it back (schedules.py L460-512), and nothing clears
    that ``.grad``. The schedule's own lists (``input_tensors``, ``output_tensors``) are popped empty by the
    step's backwards. A received input is a fresh ``torch.empty(tensor_shape, requires_grad=True,
    dtype=config.pipeline_dtype)`` (megatron/core/pipeline_parallel/p2p_communication.py L330-344),
    ``tensor_shape = [seq_length / cp (/ tp with sequence parallelism), micro_batch, hidden]`` (schedules.py
    L1084-1087). Chunks that receive: all ``v`` of a rank under the interleaved schedule (``v`` =
    ``--pp-virtual-stages``; 1 without it) but the first stage's first chunk, which starts from the embedding
    (``set_input_tensor(None)``). ``tp``, ``sp``, ``pp``: arrays over layouts (None: ``t.tp``,
    ``t.sequence_parallel``, ``t.pp``)."""
    if not t.megatron_ddp:
        return 0
    tp = t.tp if tp is None else tp
    sp = t.sequence_parallel if sp is None else sp
    pp = np.asarray(t.pp if pp is None else pp)
    v = (t.pp_virtual_stages or PP_VIRTUAL_STAGES) if t.pp_schedule in MULTI_STAGE_SCHEDULES else 1
    chunks = np.where(pp > 1, v - (1 if stage == "first" else 0), 0)   # chunks fed by the previous stage
    # [s / cp (/ tp under SP), b, hidden] in the pipeline (parameter) dtype, twice: the input and its .grad
    tok = np.where(np.asarray(sp) != 0, n // np.asarray(tp), n)
    total = chunks * 2 * tok * m.hidden_size * Policy.of(t.precision).stream
    return int(total) if np.ndim(total) == 0 else total


#: bytes per token of what Megatron's ``get_batch`` leaves in a micro-batch's dict after moving it to the GPU,
#: by pipeline stage (``"whole"``: no pipeline): tokens, labels, position_ids int64, loss_mask fp32
#: (GPTDataset.__getitem__, megatron/core/datasets/gpt_dataset.py L240-296 at 6e091e1b); the first stage drops
#: labels and loss_mask, the last tokens and position_ids (megatron/core/utils.py L2084-2100)
BATCH_BYTES_PER_TOKEN = {"whole": 8 + 8 + 4 + 8, "first": 8 + 8, "last": 8 + 4, "middle": 0}


def rerun_batches_kept(m: ModelSpec, t: TrainingSpec, stage: str, n: Any, tp: Any = None, pp: Any = None,
                       seq_len: Any = None, ga: Any = None) -> Any:
    """Bytes of the step's micro-batches Megatron-LM 0.18's ``RerunDataIterator`` keeps on the GPU on a
    rank of ``stage`` (``TrainingSpec.megatron_keeps_batches``; 0 otherwise, and on TP ranks other than
    0: see below) after the step's backward, for ``n`` tokens of a micro-batch on the rank (``b x s / cp``).

    Source: with ``--rerun-mode validate_results`` (the default, megatron/training/config/resilience_config.py
    L21 at 6e091e1b) ``RerunDataIterator.__next__`` appends each micro-batch dict it returns to
    ``saved_microbatches`` (megatron/core/rerun_state_machine.py L1143-1156), emptied by ``advance()`` when
    the next step starts (``should_run_forward_backward``, L300-316). From PR #4103 (5e4fc931, 2026-05-21;
    core_v0.18.0 and 0.18.2) ``pretrain_gpt.get_batch`` moves the batch to the GPU in that same dict,
    ``batch[key] = batch[key].cuda(non_blocking=True)`` (pretrain_gpt.py L94-98 at 6e091e1b), so the saved
    dicts hold the GPU copies; PR #5635 (bf32f441, 2026-07-06; core_v0.19.0) saves ``copy.copy(n)`` instead.
    Only TP rank 0 calls ``next(data_iterator)`` (L95-97; the others receive into fresh tensors,
    ``get_batch_on_this_tp_rank``), and only the first and last pipeline stages do (a middle one returns
    before, L91-92; under the interleaved schedule only the first stage's first chunk and the last stage's
    last chunk): ``grad_accum`` micro-batches a step. Each keeps ``BATCH_BYTES_PER_TOKEN`` of its stage per
    token and the dataset's causal mask, ``[b, 1, s / cp, s]`` bool (``create_attention_mask``, on by
    default: ``--no-create-attention-mask-in-dataloader`` is not modelled; ``_get_ltor_masks_and_position_ids``
    ``< 0.5``, gpt_dataset.py L740-778), sliced in the same dict under context parallelism
    (``get_pretrain_batch_on_this_cp_rank``, megatron/core/utils.py L2348-2364). Counted for a rank of TP
    rank 0 when ``tp`` is 1 (the estimate's rank is any TP rank; ``engine.estimate_stage`` notes TP rank 0's
    more). ``tp``, ``pp``, ``seq_len``, ``ga``: arrays over layouts (None: ``t.tp``, ``t.pp``, ``t.seq_len``,
    ``t.grad_accum``)."""
    if not t.megatron_keeps_batches:
        return 0
    tp = np.asarray(t.tp if tp is None else tp)
    pp = np.asarray(t.pp if pp is None else pp)
    per_token = np.where(pp > 1, BATCH_BYTES_PER_TOKEN[stage], BATCH_BYTES_PER_TOKEN["whole"])
    seq_len = t.seq_len if seq_len is None else seq_len
    ga = t.grad_accum if ga is None else ga
    mask = np.where((pp > 1) & (stage == "middle"), 0, n * seq_len)   # [b, 1, s / cp, s] bool
    total = np.where(tp == 1, ga * (n * per_token + mask), 0)
    return int(total) if np.ndim(total) == 0 else total


def tp_rank0_note(m: ModelSpec, t: TrainingSpec, stage: str, n: int) -> str | None:
    """One line where TP rank 0 keeps more after the step than the rank the estimate reports
    (``rerun_batches_kept``, under ``--tp``); None elsewhere."""
    if not t.megatron_keeps_batches or t.tp == 1:
        return None
    more = rerun_batches_kept(m, t, stage, n, tp=1)   # (TP rank 0's)
    if not more:
        return None
    return (f"Megatron {t.megatron_version}: TP rank 0 of each group keeps the step's micro-batches "
            f"({t.grad_accum} a step) on the GPU until the next step ({more:,} B more after the step than the rank "
            "reported here)")
