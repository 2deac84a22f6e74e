"""The torch.distributed wrappers a TrainingSpec asks for, shared by ``trace`` and ``measure``.

``trace`` runs them on a fake process group in one process (``trace/distributed.py``), ``measure``
on real ranks (``measure/distributed.py``, whose wrapping these functions are, moved here so that
both run the same code). PyTorch's own wrappers; line references are to torch 2.13:

* ``--dp N`` without sharding: ``torch.nn.parallel.DistributedDataParallel`` with
  ``bucket_cap_mb=ddp_bucket_mb`` (default 25, ``torch/nn/parallel/distributed.py``); on CUDA
  ``device_ids=[LOCAL_RANK]``.
* ``--fsdp full|grad-op|hybrid`` (``fsdp_version`` 2, the default): FSDP2
  ``torch.distributed.fsdp.fully_shard`` on every decoder layer, then on the root
  (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``); ``grad-op`` is
  ``reshard_after_forward=False``; ``hybrid`` a 2-D mesh (replicate, shard) with shard groups of
  ``fsdp_node_size`` ranks (HSDP); ``--precision bf16-mp`` is
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
* ``fsdp_version=1``: ``FullyShardedDataParallel`` with ``ShardingStrategy`` FULL_SHARD /
  SHARD_GRAD_OP / HYBRID_SHARD and ``ModuleWrapPolicy({decoder layer class})``.
* ``--tp N``: ``parallelize_module`` on every decoder layer of a Llama / Mistral / Qwen2 model:
  ``ColwiseParallel`` on q/k/v and gate/up, ``RowwiseParallel`` on o_proj and down_proj, as
  torchtitan's Llama plan does. With ``--fsdp`` too, FSDP2 shards over the ``dp`` dimension.
"""
from __future__ import annotations

from typing import Any

import torch

from .spec import TrainingSpec

#: model types whose decoder layers have the attention and MLP projections the TP plan names
TP_MODEL_TYPES = ("llama", "mistral", "qwen2")
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def mesh(t: TrainingSpec, device_type: str) -> Any:
    """The DeviceMesh of the layout (``torch/distributed/device_mesh.py`` ``init_device_mesh``):
    (dp, tp), with dp split into (replicate, shard) for hybrid FSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    dims: list[tuple[str, int]] = []
    if t.fsdp == "hybrid":
        dims += [("replicate", t.dp // t.shard_group), ("shard", t.shard_group)]
    else:
        dims.append(("dp", t.dp))
    dims.append(("tp", t.tp))
    return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))


def dp_mesh(device_mesh: Any, t: TrainingSpec) -> Any:
    """The data-parallel part of the layout's mesh (FSDP shards over it)."""
    return device_mesh["replicate", "shard"] if t.fsdp == "hybrid" else device_mesh["dp"]


def decoder_layers(module: torch.nn.Module, spec: Any) -> torch.nn.ModuleList:
    """The model's list of decoder layers (``spec.profile.layers_list``): FSDP's units, TP's plan."""
    from .spec.profile import layers_list
    return module.get_submodule(layers_list(module, spec.num_layers))


def tensor_parallel(module: torch.nn.Module, spec: Any, tp_mesh: Any) -> None:
    """ColwiseParallel / RowwiseParallel on every decoder layer's projections
    (``torch/distributed/tensor/parallel/api.py``, ``style.py``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for layer in decoder_layers(module, spec):
        plan = {name: ColwiseParallel() if style == "colwise" else RowwiseParallel()
                for name, style in TP_PLAN.items()}
        parallelize_module(layer, tp_mesh, plan)


def fsdp2(module: torch.nn.Module, spec: Any, t: TrainingSpec, fsdp_mesh: Any) -> None:
    """FSDP2 ``fully_shard`` on each decoder layer, then on the root (``reshard_after_forward`` off
    for grad-op; bf16-mp as ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw: dict[str, Any] = {"mesh": fsdp_mesh, "reshard_after_forward": t.fsdp != "grad-op"}
    if t.precision == "bf16-mp":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(module, spec):
        fully_shard(layer, **kw)
    fully_shard(module, **kw)


def fsdp1(module: torch.nn.Module, spec: Any, t: TrainingSpec, fsdp_mesh: Any, device: torch.device) -> Any:
    """FSDP1 ``FullyShardedDataParallel`` with one unit per decoder layer (``ModuleWrapPolicy``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    strategy = {"full": ShardingStrategy.FULL_SHARD, "grad-op": ShardingStrategy.SHARD_GRAD_OP,
                "hybrid": ShardingStrategy.HYBRID_SHARD}[t.fsdp]
    kw: dict[str, Any] = {"sharding_strategy": strategy, "device_mesh": fsdp_mesh,
                          "auto_wrap_policy": ModuleWrapPolicy({type(layer) for layer in decoder_layers(module, spec)}),
                          "device_id": device}  # on the CPU too: without it FSDP1 asks for an accelerator
    if t.precision == "bf16-mp":
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return FullyShardedDataParallel(module, **kw)


def ddp(module: torch.nn.Module, t: TrainingSpec, device: torch.device) -> Any:
    """``DistributedDataParallel`` with ``bucket_cap_mb=ddp_bucket_mb`` (``device_ids`` on CUDA)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                   bucket_cap_mb=t.ddp_bucket_mb)


def wrap(module: torch.nn.Module, spec: Any, t: TrainingSpec, device_mesh: Any, device: torch.device) -> Any:
    """The model as the TrainingSpec runs it on this rank: TP first, then FSDP2 / FSDP1 / DDP over dp."""
    if t.tp > 1:
        tensor_parallel(module, spec, device_mesh["tp"])
    if t.fsdp is not None and t.fsdp_version == 1:
        return fsdp1(module, spec, t, dp_mesh(device_mesh, t), device)
    if t.fsdp is not None:
        fsdp2(module, spec, t, dp_mesh(device_mesh, t))
        return module
    if t.dp > 1:
        return ddp(module, t, device)
    return module


def wrapper_name(t: TrainingSpec) -> str:
    """The wrappers of the layout in words (``DDP over 8``, ``FSDP2 fully_shard full over 8``)."""
    parts = []
    if t.tp > 1:
        parts.append(f"tensor parallel ×{t.tp} (parallelize_module)")
    if t.fsdp is not None:
        parts.append(("FSDP1 FullyShardedDataParallel " if t.fsdp_version == 1 else "FSDP2 fully_shard ")
                     + f"{t.fsdp} over {t.dp}")
    elif t.dp > 1:
        parts.append(f"DDP over {t.dp}")
    return ", ".join(parts) or "none"
