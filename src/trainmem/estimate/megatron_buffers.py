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

And what Megatron's pipeline schedules leave referenced after the step (``pipeline_inputs_kept``): each
model chunk's last received input and its gradient, from the chunk's last backward to its next forward.
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
    """Bytes of the pipeline inputs Megatron-LM's schedules leave referenced after a step, on a rank of
    ``stage`` (``--framework megatron`` under ``--pp``; 0 otherwise), for ``n`` tokens of a micro-batch
    on the rank (``b x s / cp``): every model chunk that receives its input from the previous stage
    keeps its last micro-batch's received input and that input's gradient, both ``[s / cp (/ tp
    under --sequence-parallel), b, hidden]`` in the pipeline dtype (the parameters' dtype: bf16 under
    ``--bf16``, the residual stream's here), from the chunk's last backward of the step to its first
    forward of the next one: through the optimizer step and the after-step ``mem-allocated-bytes``.

    Source (Megatron-LM at 6e091e1b, the same in core_v0.15.0 to core_v0.19.0): ``forward_step`` calls
    the model's ``set_input_tensor(input_tensor)`` for every micro-batch
    (megatron/core/pipeline_parallel/schedules.py L428-429), which ``GPTModel.set_input_tensor``
    hands to ``TransformerBlock.set_input_tensor``: ``self.input_tensor = input_tensor``
    (megatron/core/models/gpt/gpt_model.py L282-296; megatron/core/transformer/transformer_block.py
    L440-448), a reference the block keeps until the next call; ``backward_step`` calls
    ``x.retain_grad()`` on the received input before ``backward`` and reads ``x.grad`` to send it
    back (schedules.py L460-512), and nothing clears that ``.grad``. The schedule's own lists
    (``input_tensors``, ``output_tensors``) are popped empty by the step's backwards. A received input
    is a fresh ``torch.empty(tensor_shape, requires_grad=True, dtype=config.pipeline_dtype)``
    (megatron/core/pipeline_parallel/p2p_communication.py L330-344), ``tensor_shape = [seq_length /
    cp (/ tp with sequence parallelism), micro_batch, hidden]`` (schedules.py L1084-1087). Chunks that receive: all ``v`` of a rank under the interleaved
    schedule (``v`` = ``--pp-virtual-stages``; 1 without it) but the first stage's first chunk, which
    starts from the embedding (``set_input_tensor(None)``). ``tp``, ``sp``, ``pp``: arrays over layouts
    (None: ``t.tp``, ``t.sequence_parallel``, ``t.pp``)."""
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
