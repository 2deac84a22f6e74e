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
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..spec.model import ModelSpec
from ..spec.training import TrainingSpec
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
