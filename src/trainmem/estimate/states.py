"""Model states on one GPU: weights, buffers, master weights, gradients, optimizer states.

Counted per tensor, so that each allocation is rounded the way PyTorch's CUDA caching allocator
rounds it (``block_bytes``), then sharded: tensor parallelism divides matmul weights and
embeddings by ``tp``; pipeline stages hold their own layers (the worst stage is reported); ZeRO
stage 1/2/3 (or FSDP) divides optimizer states / gradients / weights over the sharding group.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable

from ..spec.model import ModelSpec, ParamTensor
from ..spec.tf_releases import layer_rotary_cache
from ..spec.vision import VISION_SIDE, in_vision_tower
from ..spec.galore import LOWRANK_OPTIMIZERS
from ..spec.training import TORCHAO_OFFLOAD_MIN, TrainingSpec, galore_target

from ..allocator_rules import block_bytes, placed_bytes
from ..errors import TrainmemError
from .cache import BoundedCache
from .fsdp_wrap import wrap_policy_states
from . import torchao_optim
from .galore import galore_state_bytes
from .gemini import model_gemini
from .fsdp_init import sync_init_events, wrap_units
from .quant4 import builds_on_device, fsdp_packed_bytes, is_quantized, torchtune_v01_build, weight_storage

__all__ = ["States", "model_states", "block_bytes", "default_lora_targets", "state_bytes"]


@dataclass(frozen=True)
class States:
    """Persistent per-rank bytes (allocator-rounded) and the facts the phases need."""

    weights: int
    buffers: int
    master: int
    grads: int
    optimizer: int
    step_tensors: int
    trainable: int            # trainable parameters on this rank (before ZeRO sharding)
    params_rank: int          # parameters held on this rank (before ZeRO-3 sharding)
    layer_grads: int          # gradient bytes of one layer on this rank
    head_grads: int           # gradient bytes produced by the head / final norm (first in backward)
    layer_matmul_half: int    # half-precision copies of one layer's matmul weights (autocast)
    head_matmul_half: int     # half copy of the LM head / tied embedding used as head
    largest_param: int        # bytes of the largest trainable tensor (for-loop optimizer temporaries)
    foreach_group: int        # bytes of all trainable tensors of one dtype (foreach temporaries)
    layer_params_full: int    # bytes of one layer's weights unsharded (ZeRO-3 gather unit)
    lora_params: int
    quantized: int = 0        # of ``weights``: bitsandbytes 4-bit tensors (packed codes, absmax, codes)
    # FSDP's unsharded tensors (``fsdp_unsharded``; 0 otherwise), in the gathered dtype:
    root_full: int = 0        # the root unit's parameters (outside the layers) gathered, tensor by tensor
    head_grads_full: int = 0  # the unsharded gradients of the head and final norm
    emb_grads_full: int = 0   # the unsharded gradient of an untied input embedding
    layer_grads_full: int = 0  # one layer's unsharded gradients, before its reduce-scatter
    layer_rs: int = 0         # one layer's reduce-scatter input (a flat buffer in the reduce dtype)
    root_grads: int = 0       # of ``grads``: the sharded gradients outside the layers (head, norms, embeddings)
    # tensor by tensor, for replaying the step through the caching allocator (``reserved/``):
    load: tuple[int, ...] = ()  # bytes of each weight and buffer in load order (every layer on the rank)
    # each trainable tensor: (where: "before"/"after" the layers, "layer" (one in each layer on the rank)
    # or "layerI" (the rank's I-th layer only), copies, gradient bytes, bytes of each optimizer-state
    # tensor, fp32 master bytes)
    trainables: tuple[tuple[str, int, int, tuple[int, ...], int], ...] = ()
    # FSDP over several ranks: each unsharded parameter of the root unit and of one layer, gathered
    # dtype, bytes (FSDP2 copies each out of the all-gather output)
    root_tensors: tuple[int, ...] = ()
    layer_tensors: tuple[int, ...] = ()
    # gradient bytes of each of the stage's layers, in order, when they differ (``uniform_layers``
    # false: an encoder-decoder's decoder layers hold cross-attention); () when identical
    each_layer_grads: tuple[int, ...] = ()
    # FSDP2's root post-backward (``fsdp_buffers``): its reduce-scatter input, a flat buffer of the
    # root's trainable gradients (each padded along dim 0 to the shard count) in the reduce dtype, and
    # the unsharded gradient of the root's last trainable parameter, in the gathered dtype
    root_rs: int = 0
    root_last_grad: int = 0
    # ... FSDP2's flat all-gather output of the root (every parameter, each padded along dim 0 to the shard
    # count, gathered dtype) and its reduce-scatter input (``root_rs``), as requested: unrounded bytes
    root_ag_raw: int = 0
    root_rs_raw: int = 0
    # the same for the units torchtitan splits the root into (``--fsdp-gathered head``,
    # ``quantities.fsdp_root.fsdp2_split_root``): the final norm and head (registered after the layers), gathered
    # bytes, reduce-scatter input and last unsharded gradient; and the embedding side's
    head_unit_full: int = 0
    head_unit_tensors: tuple[int, ...] = ()  # of ``root_tensors``, the last ones: the final norm's, the head's
    head_unit_rs: int = 0
    head_unit_last: int = 0
    emb_unit_rs: int = 0
    emb_unit_last: int = 0

    # an encoder-decoder's untied position tables of its decoder (BART's ``decoder.embed_positions``):
    # registered after the encoder's layers, their gradients are made by the decoder's embedding
    # backward, after its first layer's backward and before the encoder's (``quantities.layer_moments._grads_above``)
    between_grads: int = 0
    # FSDP1's root unit at the end of backward (``quantities.fsdp1.fsdp1_root_flat_gradient``): the unsharded
    # gradients of its parameters (views of its flat parameter), tensor by tensor, and its flat
    # gradient, one tensor of all of them, both in the gathered dtype
    root_views: int = 0
    root_flat: int = 0
    # FSDP1 ``--fsdp-auto-wrap-policy module`` (``estimate.fsdp_wrap``): the embedding units gathered at
    # their backward, the last units of backward (the root holds nothing), gathered dtype
    emb_units_full: int = 0
    head_units_full: int = 0  # ... and the units after the layers (final norm, head), gathered at their backward
    layer_units_full: int = 0  # ... and a layer's units together (all its modules: kept gathered under grad-op)
    head_units_elems: int = 0  # ... the elements of the units after the layers (their post-backward's flat gradient)
    # FSDP1: the elements of the root's flat parameter that have a gradient (its post-backward's flat gradient)
    root_flat_elems: int = 0
    # autocast's half copies of the matmul weights before the layers (an image model's patch
    # embedding), saved until the embeddings' backward
    embed_matmul_half: int = 0
    # autocast's half copies of a masked LM's transform's weights (of ``head_matmul_half``): cast at
    # the transform's dense, before the decoder's (``_head_pre_cast``)
    head_pre_half: int = 0
    # torchao's low-bit AdamW: the compiled step's buffers of the tensor whose step makes the most
    # (``torchao_optim.step_peak``; one tensor at a time, so the largest sets it)
    torchao_step: int = 0
    torchao_events: tuple = ()  # ... each of ``trainables``' own step buffers, in order (reserved replay)


    # the model's build on the device, replayed instead of ``load`` where it leaves transients' segments
    # cached (torchtune 0.1 with torchao 0.1: quant4.torchtune_v01_build): ("a", id, bytes) / ("f", id)
    build: tuple = ()
    build_temp: int = 0  # its allocated peak above the model it leaves (block-rounded), bytes
    # DeepSpeed ZeRO-3 of a model built whole (``zero3_whole_load``): the allocated peak of ``build``
    # (block-rounded), which is reached before the engine's other buffers exist (``quantities.build._build``)
    build_peak: int = 0
    # FSDP1 with sync_module_states over rank 0's CPU model (``fsdp_init``): the wrap's alloc/free events,
    # replayed instead of ``load`` (the units moved, broadcast, flattened and sharded one by one)
    fsdp_init: tuple = ()
    # DeepSpeed ZeRO-3 (``ds_init_gathers``): the bytes of each trainable parameter whole, in order, as the
    # stage-3 optimizer gathers and re-partitions them one at a time at the end of its init
    gathered: tuple[tuple[int, ...], ...] = ()
    # how ``load`` splits: (tensors before the layers, tensors of one layer, tensors after the layers), the
    # layer's repeated once per layer on the rank; () where the layers differ (``reserved.ddp.stage_loads``)
    load_split: tuple[int, int, int] = ()
    # which of ``load`` are registered buffers, not parameters (``reserved.fsdp._fsdp1_load``: FSDP1
    # flattens a unit's parameters only); () where not known
    load_buffer: tuple[bool, ...] = ()
    # ``head_grads_full`` and ``emb_grads_full``'s tensors' own bytes (elements x the gathered dtype), not
    # rounded to blocks: what the reserved replay requests (``reserved.fsdp._unsharded_grads``)
    head_grads_raw: int = 0
    emb_grads_raw: int = 0
    # ... ``head_grads_raw`` tensor by tensor, in registration order (the final norm's, the head's)
    head_grads_each: tuple[int, ...] = ()
    # each of ``trainables``' whole gradient in bytes, not rounded to the allocator's blocks (a part of
    # a flat buffer such as DDP's buckets takes its elements only); () where not known
    grad_raw: tuple[int, ...] = ()
    # each of ``trainables``' gradient on this rank in bytes, not rounded (``_Rank.grad_raw_bytes``: a
    # shard under FSDP): FSDP's flat reduce-scatter output holds these elements once (``reserved.optimizer._flat_grads``)
    grad_rank_raw: tuple[int, ...] = ()
    # each of ``trainables``' optimizer states in bytes as requested, not rounded to the allocator's
    # blocks (``trainables`` holds the blocks a fresh request is charged): () where not known
    state_raw: tuple[tuple[int, ...], ...] = ()
    # each of ``trainables``' elements, unsharded (the optimizer's per-tensor temporaries: ``quantities.optimizer_step.adafactor_loop``)
    trainable_elems: tuple[int, ...] = ()
    # FSDP accumulating unsharded (no_sync, ``grad_rank_raw`` the unsharded gradients): each one's shard
    # on this rank in bytes, not rounded, as the last micro-batch's reduce-scatter leaves it
    # (``reserved.fsdp._unit_grads``); () otherwise
    grad_shard_raw: tuple[int, ...] = ()


def _dim0_padded(shape: tuple[int, ...], n: int, d: int) -> int:
    """Elements of a gradient of ``n`` elements (``shape``'s trailing dims) padded along dim 0 to a
    multiple of ``d`` ranks, as FSDP2 lays it into the reduce-scatter input (torch
    ``_fully_shard/_fsdp_collectives.py`` ``_get_dim0_padded_size``)."""
    row = 1
    for x in shape[1:]:
        row *= x
    rows = -(-n // max(row, 1))
    return -(-rows // d) * d * row


#: the biases of row-parallel linears (the attention's output and the MLP's down projection), by name
_ROW_PARALLEL_BIASES = ("attn.c_proj.bias", "mlp.c_proj.bias", "o_proj.bias", "down_proj.bias", "output.dense.bias")
#: learned position tables (GPT-2's ``wpe``, BERT's ``position_embeddings``)
_POSITION_TABLES = ("wpe", "position_embeddings")


def _tp_div(p: ParamTensor, tp: int) -> int:
    """Elements of ``p`` on one tensor-parallel rank: matmul weights, the biases of column-parallel
    linears and the token embedding are split; norms, routers, learned position tables and the biases
    of row-parallel linears are replicated (Megatron-LM layout: ``RowParallelLinear`` keeps its whole
    bias on every rank and adds it after the all-reduce, megatron/core/tensor_parallel/layers.py L1268
    ``self.bias = Parameter(torch.empty(self.output_size, ...))``, as Transformer Engine's ``parallel_mode="row"``;
    ``LanguageModelEmbedding`` builds its position table as a plain ``torch.nn.Embedding(max_sequence_length,
    hidden_size)``, megatron/core/models/common/embeddings/language_model_embedding.py L67, both at
    6e091e1b; PyTorch's ``RowwiseParallel`` replicates the bias too, torch/distributed/tensor/parallel/style.py
    ``_partition_linear_fn``)."""
    if tp == 1 or p.role in ("norm", "router") or p.module in _POSITION_TABLES or \
            (p.role == "bias" and p.name.endswith(_ROW_PARALLEL_BIASES)):
        return p.numel
    return -(-p.numel // tp)


def _ep_div(p: ParamTensor, ep: int) -> int:
    """Elements of an expert tensor (``(E, out, in)``) on one expert-parallel rank: E/ep whole
    experts (transformers' ``MoEParamShard``: ``Shard(0)`` on the EP mesh; torchtitan's
    ``ExpertParallel`` likewise). ``spec.layout.ep_problems`` makes ep divide E."""
    return p.numel // ep if ep > 1 else p.numel


def _expert_rank(r: "_Rank", t: TrainingSpec) -> "_Rank":
    """How expert tensors are sharded: the EP ranks hold different experts, so ZeRO/FSDP shards
    each over the ranks that hold the same experts, the sharding group divided by ep
    (transformers' ``DistributedConfig.efsdp_size = fsdp_size * tp_size // ep_size``, torchtitan's
    ``dp_shard_in_ep``); without sharding, DDP all-reduces them over those ranks (Megatron-LM's
    expert data-parallel group). So a sharded expert state keeps 1/(ep * d/ep) = 1/d of the whole."""
    if t.ep == 1:
        return r
    return replace(r, d=max(1, r.d // t.ep))


def dtensor_tp(t: TrainingSpec) -> bool:
    """Whether tensor parallelism runs as PyTorch's DTensor plan (``trainmem.wrappers.tensor_parallel``,
    torchtitan's ``apply_tp``; what ``trace`` and ``measure`` run), not as Megatron-LM's own
    layers (``--framework megatron``). The two differ in what they keep: the sequence-parallel input
    the column-parallel linears save (``layers._llama_layer``), the embedding's gradient
    (``_replicated_grad``) and the vocabulary-parallel loss (``quantities.loss.loss_bytes``)."""
    return t.tp > 1 and t.extra.get("framework") != "megatron"


def torch_cp(t: TrainingSpec) -> bool:
    """Whether context parallelism runs as PyTorch's ``context_parallel`` on the transformers model
    (torch 2.13 ``distributed/tensor/experimental/_context_parallel/_attention.py``: ring attention
    over SDPA's fused kernels, entered by transformers' Trainer through accelerate; what ``trace``
    runs, ``trainmem.wrappers.context_parallel``), not as Megatron-LM's own attention
    (``--framework megatron``). They differ in what the layer keeps (``layers.Builder.ring``: the
    merged output's copy, the ring's buffers) and in the KV cache the transformers model builds
    (``quantities.model_facts.kv_cache``)."""
    return t.cp > 1 and t.extra.get("framework") != "megatron"


def torch_pipeline(t: TrainingSpec) -> bool:
    """Whether pipeline parallelism runs as torch.distributed.pipelining's schedules
    (``PipelineStage`` + ``Schedule1F1B``, torchtitan's; what ``trace`` runs), not as Megatron-LM's
    (``--framework megatron``). They differ in what a stage holds beside its layers' activations
    (``quantities.pipeline.pipeline_buffers``, ``quantities.outer.outer_tensors``, ``quantities.loss.loss_bytes``):
    torch's stage keeps each micro-batch's output until its backward and allocates a receive buffer
    per micro-batch, where Megatron frees the output's data once sent
    (``megatron/core/pipeline_parallel/schedules.py`` ``deallocate_output_tensor``) and receives
    into fresh tensors."""
    return t.pp > 1 and t.extra.get("framework") != "megatron"


def _replicated_grad(m: ModelSpec, t: TrainingSpec, p: ParamTensor, stage: str = "first") -> bool:
    """An untied token embedding under PyTorch's tensor parallelism without FSDP: its gradient is the
    whole (vocab, hidden) table on every rank. ``RowwiseParallel`` shards the weight over the
    vocabulary (``Shard(0)``), but DTensor has no rule that gives ``embedding_dense_backward`` a
    ``Shard(0)`` output (torch 2.13 ``torch/distributed/tensor/_ops/_embedding_ops.py`` L62-97:
    ``Shard(1)``, ``Partial`` or replicated), and with the replicated gradient of the output and
    replicated token ids the replicated strategy needs no communication, so it is chosen: a
    ``Replicate`` gradient of the global shape, kept as ``param.grad`` (the optimizer redistributes it
    to the weight's shard op by op). FSDP2 redistributes it to the weight's placement before its
    reduce-scatter (``_fsdp_param.py`` ``_get_grad_inner_tensor``), so there it is transient, unless
    FSDP2 accumulates the unsharded gradients (``accumulates_unsharded``: ``--grad-sync step``, and
    every pipeline stage under FSDP2): with ``reduce_grads`` off its ``post_backward`` leaves
    autograd's gradient in the unsharded parameter's ``.grad`` (upcast to ``reduce_dtype`` under
    bf16-mp, ``to_accumulated_grad_if_needed``: ``unsharded_grad.to(self.reduce_dtype)``, a DTensor of
    the same placement) and adds the next micro-batch's to it (torch 2.13
    ``_fully_shard/_fsdp_param_group.py`` L603-612, ``_fsdp_param.py`` L802-821), so the replicated
    table is what accumulates until the step's reduce-scatter (found by trace: llama-3.2-1b cut to 4
    layers, --pp 2 --dp 2 --tp 2 --fsdp grad-op --grad-sync step, 4 micro-batches, bf16-amp, the
    first stage -3.3% before: the whole table's second half). A tied embedding's gradient is
    accumulated into the head's ``Shard(0)`` one (transient too), but on torch's pipeline the first
    stage's table is an embedding alone (``stage``; the last stage's own copy is its head, whose
    ``mm`` gradient is ``Shard(0)``): found by trace, Llama-3.2-1B cut to 4 layers, --pp 2 --tp 2,
    fp32, SGD, 2 micro-batches, b 1, s 256, the first stage -16.8% before (1002 MiB, not 501)."""
    alone = not m.tied_embeddings or (t.pp > 1 and stage == "first")
    return (dtensor_tp(t) and p.role == "embedding" and p.name.endswith(TIED_NAMES) and alone
            and (t.fsdp is None and not t.zero_stage or t.fsdp is not None and t.fsdp_version == 2
                 and t.accumulates_unsharded))


def replicated_grad_chunks(m: ModelSpec, t: TrainingSpec) -> tuple[int, ...]:
    """Bytes of this rank's chunk (``Shard(0)`` over ``t.tp``, the weights' dtype) of each trained
    parameter whose gradient is replicated (``_replicated_grad``), in parameter order."""
    return tuple(-(-p.numel // t.tp) * t.weight_bytes for p in m.parameter_tensors()
                 if not _frozen(m, t, p) and _replicated_grad(m, t, p))


def _lora_tensors(m: ModelSpec, t: TrainingSpec) -> list[tuple[str, int, int | None, tuple[int, int]]]:
    """(module, elements, layer, (elements of A, of B)) of the LoRA A and B matrices on the targeted
    linear modules (peft's ``lora_A``/``lora_B`` are separate ``nn.Linear`` weights)."""
    if not t.lora_rank:
        return []
    targets = set(t.lora_targets or default_lora_targets(m))
    out = []
    for p in m.parameter_tensors():
        if m.is_vlm and ".language_model." not in f".{p.name}":
            continue  # a VLM's adapters go on its language model's linears only (``workload.language_model_targets``)
        if p.is_matmul and p.module in targets and len(p.shape) >= 2 and p.role != "embedding":
            rows, cols = p.shape[-2], p.shape[-1]
            if m.family in ("gpt2", "nanogpt"):  # Conv1D stores (in, out)
                rows, cols = cols, rows
            experts = p.shape[0] if len(p.shape) == 3 else 1
            a, b = experts * t.lora_rank * cols, experts * t.lora_rank * rows
            if t.lora_qkv and p.module == "query_key_value":  # litgpt's LoRAQKVLinear: r rows of A per part
                widths = fused_qkv_widths(m, t, rows)
                a, b = len(widths) * t.lora_rank * cols, t.lora_rank * sum(widths)
            out.append((p.module, a + b, p.layer, (a, b)))
    return _litgpt_adapters(out, t)


def fused_qkv_widths(m: ModelSpec, t: TrainingSpec, rows: int | None = None) -> tuple[int, ...]:
    """The output widths of the parts ``--lora-qkv`` enables on a model's fused ``query_key_value``
    (``rows`` outputs: the query heads' ``m.q_size``, then two equal key/value widths), as lit-gpt's
    ``LoRAQKVLinear`` sizes them: ``lora_A`` of ``r * sum(enable_lora)`` rows, ``lora_B`` of
    ``sum(qkv_shapes)`` rows, ``qkv_shapes = (in_features * enable_q, kv_embd_size * enable_k,
    kv_embd_size * enable_v)``, ``kv_embd_size = in_features // (n_head // n_query_groups)``
    (lit_gpt/lora.py at 8641822, ``LoRAQKVLinear.__init__``; litgpt/lora.py at 43c44323 the same):
    StableLM-3B's q, v (4096, 4096), Falcon-7B's (4544, 64) (one key/value head)."""
    if rows is None:
        rows = next(p.shape[0] for p in m.parameter_tensors() if p.module == "query_key_value" and len(p.shape) == 2)
    kv = (rows - m.q_size) // 2
    return tuple({"q": m.q_size, "k": kv, "v": kv}[part] for part in t.lora_qkv_parts)


QKV_MODULES = ("q_proj", "k_proj", "v_proj")


def litgpt_tensors(tensors: Any, t: TrainingSpec) -> tuple[ParamTensor, ...]:
    """``tensors`` as litgpt v0.5.13 holds them: with ``--fused-qkv`` each layer's q, k and v weights
    (and biases) one ``qkv`` tensor of their rows stacked, where q's was (``litgpt/model.py`` L394-398:
    ``nn.Linear(n_embd, (n_head + 2 * n_query_groups) * head_size)``); with ``--split-gate-up`` the
    fused ``gate_up_proj`` two tensors of half its rows, ``fc_1`` and ``fc_2`` (L822-823). The
    allocator places and rounds one block where transformers has three (or two where it has one)."""
    if not (t.fused_qkv or t.split_gate_up):
        return tuple(tensors)
    out: list[ParamTensor] = []
    merged: dict[str, int] = {}
    for p in tensors:
        kind = p.name.rsplit(".", 1)[1]  # weight / bias
        if t.fused_qkv and p.module in QKV_MODULES:
            name = f"{p.name.rsplit('.', 2)[0]}.qkv.{kind}"  # ...self_attn.qkv.weight
            if name in merged:
                q = out[merged[name]]
                out[merged[name]] = replace(q, shape=(q.shape[0] + p.shape[0], *p.shape[1:]))
            else:
                merged[name] = len(out)
                out.append(replace(p, name=name, module="qkv"))
        elif t.split_gate_up and p.module == "gate_up_proj":
            base = p.name.rsplit(".", 2)[0]
            out.extend(replace(p, name=f"{base}.{fc}.{kind}", shape=(p.shape[0] // 2, *p.shape[1:]), module=fc)
                       for fc in ("fc_1", "fc_2"))
        else:
            out.append(p)
    return tuple(out)


def _litgpt_adapters(out: list[tuple[str, int, int | None, tuple[int, int]]], t: TrainingSpec
                     ) -> list[tuple[str, int, int | None, tuple[int, int]]]:
    """peft's adapters (``_lora_tensors``) as litgpt's: with ``--fused-qkv`` one ``LoRAQKVLinear`` pair
    per layer over the enabled parts, ``lora_A`` (r * n, h) and ``lora_B`` (enabled widths, r)
    (litgpt/lora.py L232-244: the elements of peft's n pairs in two tensors); with
    ``--split-gate-up`` a ``LoRALinear`` on each of fc_1 and fc_2 (lora.py L615-622), each with its
    own ``lora_A`` (r, h) and a ``lora_B`` of half the fused rows."""
    if not (t.fused_qkv or t.split_gate_up):
        return out
    merged: dict[int | None, int] = {}
    new: list[tuple[str, int, int | None, tuple[int, int]]] = []
    for mod, n, lyr, (a, b) in out:
        if t.fused_qkv and mod in QKV_MODULES:
            if lyr in merged:
                _, n0, _, (a0, b0) = new[merged[lyr]]
                new[merged[lyr]] = ("qkv", n0 + n, lyr, (a0 + a, b0 + b))
            else:
                merged[lyr] = len(new)
                new.append(("qkv", n, lyr, (a, b)))
        elif t.split_gate_up and mod == "gate_up_proj":
            new.extend((fc, a + b // 2, lyr, (a, b // 2)) for fc in ("fc_1", "fc_2"))
        else:
            new.append((mod, n, lyr, (a, b)))
    return new


def default_lora_targets(m: ModelSpec) -> tuple[str, ...]:
    """peft's default target modules for the model type (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)."""
    if m.family in ("gpt2", "nanogpt"):
        return ("c_attn",)
    if m.family in ("bert", "roberta-prenorm"):
        return ("query", "value")
    if m.family == "derived":
        return derived_lora_targets(m)
    return ("q_proj", "v_proj")


#: peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING (peft/utils/constants.py) for the
#: decoder model types trainmem derives; a type peft lists nowhere has no default (peft raises)
PEFT_DEFAULT_TARGETS = {
    "bloom": ("query_key_value",), "opt": ("q_proj", "v_proj"), "gptj": ("q_proj", "v_proj"),
    "gpt_neox": ("query_key_value",), "gpt_neo": ("q_proj", "v_proj"), "llama4": ("q_proj", "v_proj"),
    "llama4_text": ("q_proj", "v_proj"), "chatglm": ("query_key_value",), "gpt_bigcode": ("c_attn",),
    "mpt": ("Wqkv",), "falcon": ("query_key_value",), "codegen": ("qkv_proj",), "stablelm": ("q_proj", "v_proj"),
    "phi": ("q_proj", "v_proj", "fc1", "fc2"), "gemma": ("q_proj", "v_proj"), "gemma2": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"), "qwen3": ("q_proj", "v_proj"), "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"), "mixtral": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"),
    "gpt2": ("c_attn",), "bert": ("query", "value"), "nemotron_h": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


def derived_lora_targets(m: ModelSpec) -> tuple[str, ...]:
    """peft's default LoRA targets of a derived model's type, or a one-line error naming the fix."""
    from ..errors import TrainmemError
    if m.model_type in PEFT_DEFAULT_TARGETS:
        return PEFT_DEFAULT_TARGETS[m.model_type]
    linears = sorted({p.module for p in m.parameter_tensors() if p.is_matmul and p.layer is not None})
    raise TrainmemError(f"peft has no default LoRA target modules for model_type {m.model_type!r}: pass "
                        f"--lora-targets (its linear modules: {', '.join(linears)})")


def state_bytes(optimizer: str, shape: tuple[int, ...], numel: int, sbytes: int, whole: int | None = None,
                blocksize: int = 256) -> tuple[int, ...]:
    """Optimizer state tensors of one parameter, in bytes each.

    adam/adamw: exp_avg and exp_avg_sq in the state dtype (torch.optim). sgd: none;
    sgd-momentum: momentum_buffer. lion: exp_avg (lion-pytorch ``lion_pytorch.py``:
    ``state['exp_avg'] = torch.zeros_like(p)``). adafactor (transformers, beta1=None): factored
    second moment, row + column vectors for matrices, a full tensor for vectors, in fp32.
    lomo: none (lomo_optim's plain SGD update); adalomo: Adafactor's factored second moment, fp32.
    adagrad: ``sum`` (torch 2.13 ``torch/optim/adagrad.py`` L96: ``torch.full_like(p, ...)``, made in
    the constructor). rmsprop at torch.optim's defaults (momentum 0, not centered): ``square_avg``
    (``rmsprop.py`` L123; ``momentum_buffer`` and ``grad_avg`` only with momentum / centered).
    schedule-free-adamw/-radam: ``z = torch.clone(p)`` and ``exp_avg_sq`` (schedule_free 70785b5
    ``adamw_schedulefree.py`` L163-167, ``radam_schedulefree.py`` L168-169; ``exp_avg`` only with
    ``inner_momentum``, 0 by default); schedule-free-sgd: ``z`` (``sgd_schedulefree.py`` L153).
    The bitsandbytes optimizers: ``bnb_state_bytes``. ``numel`` is this rank's shard; ``whole`` the
    unsharded tensor, which decides the 8-bit threshold: ZeRO and FSDP hand the optimizer flat
    partitions of many tensors, never a small slice of one. The shared 256-entry quantization maps,
    one set per optimizer, are ``bnb_qmap_bytes``. torchao's low-bit AdamW: ``torchao_optim.state_tensors``
    (``blocksize``: its block size), each state's map its own tensor.
    """
    if optimizer in ("adam", "adamw", "schedule-free-adamw", "schedule-free-radam"):
        return (numel * sbytes, numel * sbytes)
    if optimizer == "adalomo":
        # lomo_optim 0.1.1 ``adalomo.py`` L96-118: exp_avg_sq_row (shape[0],) and exp_avg_sq_col (shape[1],)
        # of a matrix, exp_avg_sq (shape[0],) of a vector, fp32, made in the constructor
        return (shape[0] * 4, shape[1] * 4) if len(shape) > 1 else (shape[0] * 4,)
    if optimizer in ("sgd", "lomo"):
        return ()
    if optimizer in ("sgd-momentum", "lion", "adagrad", "rmsprop", "schedule-free-sgd"):
        return (numel * sbytes,)
    if optimizer == "adafactor":
        if len(shape) >= 2:
            lead = numel // (shape[-1] * shape[-2])
            return (lead * shape[-2] * 4, lead * shape[-1] * 4)
        return (numel * 4,)
    if optimizer in BNB_LAYOUTS:
        return bnb_state_bytes(optimizer, numel, numel if whole is None else whole, blocksize)
    if optimizer in torchao_optim.TORCHAO_LAYOUTS:
        # the quantization test reads the tensor the optimizer holds (FSDP2: the local shard, adam.py L78-80)
        return torchao_optim.state_tensors(optimizer, numel, sbytes, blocksize)
    raise ValueError(optimizer)


#: bitsandbytes ``Optimizer2State`` ``min_8bit_size``: smaller tensors keep fp32 states (optim/optimizer.py L414, L502)
MIN_8BIT_SIZE = 4096
#: bitsandbytes ``get_state_buffer`` pages a state only from 1e5 elements (optim/optimizer.py L383)
PAGED_MIN = 100_000
#: the bitsandbytes optimizers as (each state's size in parameter shapes, optim_bits, paged): AdamW
#: (``Optimizer2State``: ``state1``, ``state2``), Lion and RMSprop (``Optimizer1State``: ``state1``),
#: AdEMAMix (``state1`` of shape (2, *p.shape), the two first moments, and ``state2``: ``optim/ademamix.py``
#: L159-173 at 95f9af30)
BNB_LAYOUTS = {"adamw-8bit": ((1, 1), 8, False), "paged-adamw-8bit": ((1, 1), 8, True),
               "paged-adamw": ((1, 1), 32, True), "lion-8bit": ((1,), 8, False), "lion-32bit": ((1,), 32, False),
               "paged-lion-8bit": ((1,), 8, True), "paged-lion": ((1,), 32, True), "rmsprop-8bit": ((1,), 8, False),
               "rmsprop-32bit": ((1,), 32, False), "ademamix": ((2, 1), 32, False),
               "ademamix-8bit": ((2, 1), 8, False), "paged-ademamix": ((2, 1), 32, True),
               "paged-ademamix-8bit": ((2, 1), 8, True)}


def bnb_qmap_bytes(optimizer: str, largest: int) -> int:
    """Device bytes of the quantization maps of a bitsandbytes 8-bit optimizer whose largest
    trainable tensor has ``largest`` elements: at the first 8-bit state, ``fill_qmap`` builds the
    signed and unsigned dynamic maps (256 fp32 each, ``F.create_dynamic_map``) and ``init_state``
    moves to the device once the ones its states use (``self.name2qmap["dynamic"] = ....to(p.device)``):
    both for AdamW and AdEMAMix (``Optimizer2State.init_state`` L513-516, ``ademamix.py`` L162-163),
    the signed one alone for Lion and RMSprop (``Optimizer1State.init_state`` L680-684), shared by
    every parameter's ``qmap1``/``qmap2``. Each is one 1 KiB block (in either allocator mode: below
    10 MiB ``block_bytes`` rounds to 512 B alone)."""
    if optimizer not in BNB_LAYOUTS or BNB_LAYOUTS[optimizer][1] != 8 or largest < MIN_8BIT_SIZE:
        return 0
    return len(BNB_LAYOUTS[optimizer][0]) * block_bytes(256 * 4)


def bnb_state_bytes(optimizer: str, numel: int, whole: int, blocksize: int = 256) -> tuple[int, ...]:
    """Device bytes of a bitsandbytes optimizer's states for one tensor (``BNB_LAYOUTS``), as
    ``init_state`` makes them (``optim/optimizer.py`` L492-532 and L664-690 at 95f9af30;
    ``ademamix.py`` L139-173): fp32 states when ``optim_bits`` is 32 or the tensor has fewer than
    ``min_8bit_size`` = 4096 elements; else uint8 states plus an fp32 ``absmax`` per ``blocksize``
    block of each state (256 since bitsandbytes 0.44.0, 2048 before: ``TrainingSpec.bnb_blocksize``;
    AdEMAMix's ``absmax1`` is (2, blocks)). A paged optimizer's ``get_state_buffer`` (L374-390;
    ``_get_state_double_buffer`` for AdEMAMix) pages the states of tensors of at least 1e5
    elements (``F.get_paged``: ``cudaMallocManaged``, outside the caching allocator); smaller ones
    get ``torch.zeros_like`` on the device; absmax is always an ordinary device tensor."""
    mults, bits, paged = BNB_LAYOUTS[optimizer]
    paged = paged and whole >= PAGED_MIN
    if bits == 32 or whole < MIN_8BIT_SIZE:
        return () if paged else tuple(m * numel * 4 for m in mults)    # fp32, p's shape (x2: AdEMAMix state1)
    blocks = -(-numel // blocksize)
    return (() if paged else tuple(m * numel for m in mults)) + tuple(m * blocks * 4 for m in mults)  # uint8; fp32 absmax


@lru_cache(maxsize=256)
def parameter_order(trainables: tuple) -> tuple[int, ...]:
    """The trainable tensors in the order ``model.parameters()`` yields them, one index per tensor
    (a per-layer item once per layer): those registered before the layers, then each layer's own
    (the items of every layer, then that layer's only ones, such as its LoRA adapters), then those
    after. ``torch.optim``'s ``_init_group`` creates the states in this order and a foreach step
    makes its temporaries in it (``torch/optim/adam.py`` ``_init_group``, ``_multi_tensor_adam``)."""
    layers = max((k for w, k, *_r in trainables if w == "layer"), default=0)
    layers = max([layers] + [int(w[5:]) + 1 for w, *_r in trainables if w.startswith("layer") and w != "layer"])
    out = [j for j, item in enumerate(trainables) if item[0] == "before"]
    for i in range(layers):
        out += [j for j, (w, k, *_r) in enumerate(trainables) if w == "layer" and i < k]
        out += [j for j, item in enumerate(trainables) if item[0] == f"layer{i}"]
    return tuple(out + [j for j, item in enumerate(trainables) if item[0] == "after"])


def _insert_buffer(load: list[tuple[str, int]], name: str, nbytes: int) -> None:
    """Put a buffer where ``Module._apply`` moves it: after its module's parameters and children
    (nanoGPT's mask after ``attn.c_proj``; BERT's ids after the embeddings' LayerNorm; rotary
    frequencies after the final norm)."""
    owner = name.rsplit(".", 1)[0]
    if owner.endswith(".attn"):
        anchor = owner + ".c_proj."
    elif owner.endswith("embeddings"):
        anchor = owner + ".LayerNorm."
    else:
        anchor = None
    idx = len(load)
    if anchor:
        hits = [i for i, (n, _) in enumerate(load) if n.startswith(anchor)]
        if hits:
            idx = hits[-1] + 1
    elif name.startswith("rotary_emb"):
        hits = [i for i, (n, _) in enumerate(load) if n.startswith("norm.")]
        if hits:
            idx = hits[-1] + 1
    load.insert(idx, (name, nbytes))


@lru_cache(maxsize=4096)
def _placed_bytes(before: tuple[int, ...], layer: tuple[int, ...], layers: int, after: tuple[int, ...],
                  expandable: bool = False) -> int:
    """``allocator_rules.placed_bytes``, cached: the model load of one layout."""
    return placed_bytes(before, layer, layers, after, expandable)


_STATES_CACHE = BoundedCache(4096)


def model_states(m: ModelSpec, t: TrainingSpec, stage: str = "first") -> States:
    """Persistent memory of one rank. ``stage``: which pipeline stage ("first", "middle" or "last":
    ``TrainingSpec.stage_span``).

    Cached on the fields that change model states (not batch, sequence, recomputation, ...), so a
    sweep over activations reuses them."""
    key = (m, stage, t.tp, t.ep, dtensor_tp(t), t.pp, t.pp_less, t.precision, t.zero_stage, t.fsdp, t.shard_group, t.optimizer,
           t.impl, t.lora_rank, t.lora_targets, t.lora_dtype, t.distributed_optimizer, t.offload_optimizer,
           t.fp32_master, t.quantize, t.quantize_via, t.bitsandbytes_version, t.torchao_version, t.accumulates_unsharded,
           t.fsdp_mixed_units, t.fsdp_version, t.fsdp_offload_params, t.fsdp_sync_module_states, t.fused_qkv, t.lora_qkv, t.split_gate_up, t.layer_rope_cache, t.rope_cache, t.expandable_segments,
           layer_rotary_cache(m, t.transformers_release),
           t.gemini, t.gemini_chunk_size, t.ds_params_on_host, t.ds_whole_load, t.ds_fp32_clone, t.half_embeddings,
           t.fsdp_auto_wrap_policy, t.fsdp_min_num_params, t.torchao_block, t.torchao_offload, t.optim_target_modules,
           t.optim_args, t.freeze_vision_tower,
           builds_on_device(t))   # (torchtune's on-device build reads the preset, which TrainingSpec's equality leaves out)
    return _STATES_CACHE.get_or_build(key, lambda: _model_states(m, t, stage))


TIED_NAMES = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight")


def word_embedding(m: ModelSpec) -> ParamTensor | None:
    """The model's input embedding table (a tied head's weight): its first ``embedding`` tensor, a
    vision-language model's language model's (its vision tower's position tables come first: SigLIP's
    and CLIP's ``position_embedding``, ``spec.vision.VISION_SIDE``)."""
    return next((p for p in m.parameter_tensors() if p.role == "embedding"
                 and not (m.is_vlm and VISION_SIDE.search(p.name))), None)


def fsdp_grad_op(t: TrainingSpec) -> bool:
    """FSDP's SHARD_GRAD_OP over several ranks, which is not DeepSpeed's ZeRO-2: the parameters are
    stored as shards too, and each layer is gathered at its forward and kept gathered until its
    backward (torch 2.13 ``ShardingStrategy.SHARD_GRAD_OP``, torch/distributed/fsdp/api.py: "this
    strategy unshards before the forward, does not reshard them after the forward, and only reshards
    them after the backward computation"; FSDP2's ``reshard_after_forward=False``,
    _fully_shard/_fully_shard.py). Found by trace on the fake group (docs/trace.md)."""
    return t.fsdp == "grad-op" and t.shard_group > 1


def fsdp1_accumulated_bytes(t: TrainingSpec, w: int) -> int:
    """Bytes per element of the gradients FSDP1 accumulates unsharded under ``no_sync()``: the
    dtype of the unsharded flat parameter autograd accumulates into, ``param_dtype`` (bf16) under
    ``bf16-mp``, not the fp32 of the stored weights. FSDP1's post-backward hook returns before its
    cast to ``reduce_dtype`` when it does not sync (torch 2.13 ``fsdp/_runtime_utils.py`` L740-744:
    ``if not state._sync_gradients: ... return``; the cast is L754-762), and the pre-backward hook
    keeps an unsharded ``.grad`` of the unpadded size as it is (``_flat_param.py`` L1614-1677
    ``prepare_gradient_for_backward``). FSDP2 accumulates in the reduce dtype instead
    (``_fully_shard/_fsdp_param.py`` ``to_accumulated_grad_if_needed``). ``w`` otherwise. Found by
    trace on the fake group: Llama-3.2-1B cut to 2 layers, grad-op bf16-mp, 2 micro-batches under
    ``--grad-sync step``, +10.3% before."""
    if t.fsdp_version == 1 and t.precision == "bf16-mp" and t.accumulates_unsharded:
        return 2
    return w


@dataclass(frozen=True)
class _Rank:
    """Where a rank sits and the dtypes of what it stores."""

    per_stage: int     # layers on this pipeline stage
    lo: int            # its first layer
    hi: int            # one past its last layer
    stage: str
    w: int             # bytes per weight element as stored
    gbytes: int        # gradient dtype: the weight's, or fp32 Megatron main-grads
    sbytes: int        # optimizer-state dtype: fp32 with an fp32 master copy, else the weight's
    half_master: bool  # an fp32 master copy of half weights (TrainingSpec.fp32_master)
    zero: int          # ZeRO stage
    zero_states: int   # ZeRO stage applied to master + states (>= 1 with the distributed optimizer)
    d: int             # ranks the states are sharded over
    grads_sharded: bool  # gradients held as shards (ZeRO >= 2 / FSDP), not accumulated unsharded (no_sync)
    mixed_units: bool  # FSDP1 + LoRA: frozen layer weights get gradients too (TrainingSpec.fsdp_mixed_units)
    gather: int        # bytes per element of a layer gathered for compute (bf16 under FSDP's mixed precision)
    shard_weights: bool = False  # weights stored as shards: ZeRO-3 / FSDP full, and FSDP grad-op (below)
    fsdp_unsharded: bool = False  # FSDP over several ranks: a root unit and per-layer unsharded tensors
    expandable: bool = False  # the allocator runs with expandable segments (TrainingSpec.expandable_segments)
    zero_clone: bool = False  # DeepSpeed ZeRO's fp32 copy of fp32 weights' partition (TrainingSpec.ds_fp32_clone)
    flat_states: bool = False  # DeepSpeed ZeRO on the GPU: master and states flat per group / sub-group (``flat_zero``)
    host_shards: bool = False  # FSDP1 CPUOffload(offload_params=True): the sharded flat parameters in host memory

    @staticmethod
    def of(m: ModelSpec, t: TrainingSpec, stage: str) -> "_Rank":
        lo, hi = t.stage_span(m.num_layers, stage)  # (torchtitan's weighted split: TrainingSpec.stage_layers)
        per_stage = hi - lo
        w = t.weight_bytes
        half_master = t.fp32_master
        return _Rank(per_stage, lo, hi, stage, w, t.main_grad_bytes or fsdp1_accumulated_bytes(t, w),
                     4 if (w == 4 or half_master) else w, half_master, t.zero_stage,
                     max(t.zero_stage, 1) if t.distributed_optimizer else t.zero_stage, t.shard_group,
                     t.zero_stage >= 2 and not t.accumulates_unsharded, t.fsdp_mixed_units,
                     2 if t.precision == "bf16-mp" else w, t.zero_stage == 3 or fsdp_grad_op(t),
                     t.fsdp is not None and t.shard_group > 1, t.expandable_segments, t.ds_fp32_clone,
                     flat_zero(t), t.fsdp_offload_params)

    def block(self, nbytes: int) -> int:
        """Allocator bytes of one fresh request of ``nbytes`` in this run's allocator mode
        (``allocator_rules.block_bytes``: the default allocator's, or expandable segments')."""
        return block_bytes(nbytes, self.expandable)

    def shard(self, nbytes: int) -> int:
        """Device bytes of one parameter's stored shard of ``nbytes`` whole bytes: its ``1/d`` (ceil),
        none under FSDP1's parameter offload (``host_shards``: ``FlatParamHandle._init_flat_param_attributes``
        pins ``_local_shard`` in host memory, torch 2.13 ``fsdp/_flat_param.py`` L1249-1265; each unit's
        shard is copied to the device only to be all-gathered, ``pre_unshard`` L1335-1338)."""
        return 0 if self.host_shards else -(-nbytes // self.d)

    def part(self, nbytes: int) -> int:
        """Bytes of one tensor's master copy or optimizer state: its own block, or under DeepSpeed ZeRO
        its exact part of the group's / sub-group's flat tensor (``flat_states``: the totals are rounded once)."""
        return nbytes if self.flat_states else self.block(nbytes)

    def grad_bytes(self, n: int) -> int:
        """Allocator bytes of one gradient of ``n`` elements on this rank: a shard under ZeRO >= 2 /
        FSDP, the whole tensor when not sharded or accumulated unsharded (``no_sync``)."""
        return self.block(self.grad_raw_bytes(n))

    def grad_raw_bytes(self, n: int) -> int:
        """``grad_bytes`` before the allocator's rounding: the gradient's own bytes on this rank."""
        return -(-n * self.gbytes // self.d) if self.grads_sharded else n * self.gbytes

    def holds(self, m: ModelSpec, pp: int, p: ParamTensor) -> bool:
        """Whether this pipeline stage holds tensor ``p`` (the first stage the embeddings; the last
        the final norm and the head, and its own copy of a tied embedding)."""
        if pp == 1:
            return True
        if p.layer is not None:
            return self.lo <= p.layer < self.hi
        if self.stage == "first":
            return p.role == "embedding"
        if self.stage == "middle":  # a middle stage: its layers only
            return False
        return p.role != "embedding" or (m.tied_embeddings and p.name.endswith(TIED_NAMES))


@dataclass
class _Tally:
    """Running sums over the tensors of a rank (bytes unless named otherwise)."""

    buffers: int = 0
    buffer_names: set = field(default_factory=set)  # the names in the load lists that are buffers
    master: int = 0
    grads: int = 0
    opt: int = 0
    step_t: int = 0
    lora_w: int = 0
    trainable: int = 0       # elements
    params_rank: int = 0     # elements
    layer_grads: int = 0
    head_grads: int = 0
    lmh: int = 0             # autocast half copies of one layer's matmul weights
    hmh: int = 0             # autocast half copies of the head's
    hpre: int = 0            # ... of those a masked LM's transform casts before its decoder (``_head_pre_cast``)
    emh: int = 0             # ... of the matmuls before the layers (an image model's patch embedding)
    largest: int = 0
    largest_n: int = 0       # elements of the largest trainable tensor (bitsandbytes' 8-bit threshold)
    ao_step: int = 0         # torchao's low-bit AdamW: the largest one tensor's compiled-step buffers (bytes)
    ao_events: list = field(default_factory=list)  # ... each item's ``torchao_optim.step_events``
    items: list = field(default_factory=list)  # States.trainables, as they are counted
    item_elems: list = field(default_factory=list)  # ... each one's unsharded elements
    item_rank_raw: list = field(default_factory=list)  # ... each one's gradient bytes on this rank, unrounded
    item_state_raw: list = field(default_factory=list)  # ... each one's optimizer states as requested, unrounded
    root_list: list = field(default_factory=list)   # States.root_tensors
    layer_list: list = field(default_factory=list)  # States.layer_tensors
    group: int = 0
    lpf: int = 0             # one layer's weights, unsharded
    q4: int = 0              # bitsandbytes 4-bit tensors, allocator-rounded
    root: int = 0            # FSDP: the root unit's parameters gathered (bytes, per tensor)
    head_full: int = 0       # FSDP: unsharded head / final-norm gradients (bytes)
    emb_full: int = 0        # FSDP: unsharded untied-embedding gradient (bytes)
    head_raw: int = 0        # ... ``head_full`` and ``emb_full`` unrounded (elements x gathered dtype)
    emb_raw: int = 0
    head_each: list = field(default_factory=list)  # ... ``head_raw`` tensor by tensor
    layer_full: int = 0      # FSDP: one layer's unsharded gradients (bytes, per tensor)
    layer_elems: int = 0     # FSDP: one layer's trainable elements (the reduce-scatter input)
    root_g: int = 0          # FSDP: the sharded gradients outside the layers (bytes)
    root_rs_elems: int = 0   # FSDP: the root's trainable elements, padded (its reduce-scatter input)
    root_ag_elems: int = 0   # FSDP: the root's elements, trainable or not, padded (its all-gather output)
    root_last: int = 0       # FSDP: the unsharded gradient of the root's last trainable tensor (bytes)
    head_unit: int = 0       # FSDP: of ``root``, the tensors after the layers (final norm, head)
    head_list: list = field(default_factory=list)  # ... each, as ``root_list``
    head_rs_elems: int = 0   # ... of ``root_rs_elems``, theirs
    head_last: int = 0       # ... the unsharded gradient of the last of them (bytes)
    emb_last: int = 0        # ... the unsharded gradient of the last tensor before the layers (bytes)
    root_views: int = 0      # FSDP: the root's unsharded gradients, tensor by tensor (bytes)
    root_flat_bytes: int = 0  # FSDP: the root's unsharded gradients as one flat tensor (bytes, unrounded)
    each: dict = field(default_factory=dict)  # layer -> its gradient bytes (layers that differ)
    between: int = 0         # States.between_grads: an encoder-decoder's embedding tables after its encoder's layers
    whole: dict = field(default_factory=dict)  # parameter name -> its whole bytes (``zero3_whole_load``)
    trained: set = field(default_factory=set)  # names of the parameters with a gradient

    def root_param(self, r: "_Rank", shape: tuple[int, ...], n: int) -> None:
        """A parameter of the FSDP root unit, gathered: its block (``root``, ``fsdp_root``) and its
        elements padded along dim 0 to the shard count, its part of FSDP2's flat all-gather output
        (``root_ag_elems``; torch 2.13 ``_fully_shard/_fsdp_param.py`` pads dim 0 so that every rank's
        shard is equal, ``_fsdp_collectives.py`` ``foreach_all_gather`` allocates ``all_gather_input_numel
        * world_size`` elements)."""
        self.root += r.block(n * r.gather)
        self.root_ag_elems += _dim0_padded(shape, n, r.d)

    def root_gradient(self, shape: tuple[int, ...], n: int, d: int, g: int, full: int, gather: int = 0) -> None:
        """A trainable tensor of the FSDP root unit (``full``: its unsharded gradient's bytes, 0
        without FSDP; ``gather``: bytes per element of it): its sharded gradient ``g``, and, in
        registration order, its part of the root's post-backward reduce-scatter
        (``quantities.fsdp_root.fsdp_buffers``) and of FSDP1's flat gradient."""
        if full:
            self.root_views += full
            self.root_flat_bytes += n * gather
            self.root_g += g
            self.root_rs_elems += _dim0_padded(shape, n, d)
            self.root_last = full

    def half_copy(self, m: ModelSpec, p: ParamTensor, n: int, after: bool) -> None:
        """autocast's half copy ((n,) elements, 2 bytes each) of a matmul weight outside the layers:
        after them the head's (``hmh``; of it a masked LM's transform dense's, ``hpre``,
        ``_head_pre_cast``), before them a patch embedding's (``emh``: kept to its backward). A half
        head needs none; a VLM's vision side's is measured (``estimate.derived.vision_side``)."""
        if not after:
            self.emh += n * 2
            return
        self.hmh += n * 2
        self.hpre += n * 2 if _head_pre_cast(m, p) else 0

    def mixed_unit_grad(self, r: _Rank, n: int, k: int, counted_layer: bool) -> None:
        """A frozen layer tensor of ``n`` elements (``k`` of them) in an FSDP1 unit with LoRA adapters
        (``TrainingSpec.fsdp_mixed_units``): the unit's flat parameter gets a gradient for it too (no
        states), unsharded in the layer's backward and reduce-scattered with the adapters'.
        ``counted_layer``: the layer standing for each in the per-layer sums."""
        g = r.grad_bytes(n)
        self.grads += k * g
        self.layer_grads += g
        if r.fsdp_unsharded and counted_layer:
            self.layer_full += r.block(n * r.gather)
            self.layer_elems += n

    def trainable_tensor(self, t: TrainingSpec, r: _Rank, shape: tuple[int, ...], n: int, k: int,
                         grad_n: int | None = None, where: str = "layer", galore: bool = False) -> int:
        """Add gradient, master copy and optimizer states of ``k`` tensors of ``n`` elements on this
        rank (the gradient of ``grad_n`` elements when it is not the weight's shard); returns one
        tensor's gradient bytes. ``galore``: a GaLore target weight (``galore_state_bytes``: its
        projector and projected states)."""
        self.trainable += k * n
        g = r.grad_bytes(n if grad_n is None else grad_n)
        self.grads += k * g
        sh = -(-n // r.d) if r.zero_states >= 1 else n
        master = r.part(sh * 4) if (r.half_master or r.zero_clone) else 0  # (sh,) fp32 partition
        raw = _state_bytes(t, shape, sh, r, n, galore)                 # each state's requested bytes
        sts = tuple(r.part(sb) for sb in raw)                          # ... the blocks they are charged
        host = r.host_shards or (t.torchao_offload is not None and n >= TORCHAO_OFFLOAD_MIN)
        if host:  # CPUOffloadOptimizer: this tensor's optimizer and its states live on the host (cpu_offload.py L88-107);
            # FSDP1 parameter offload: the optimizer holds the host flat parameters, whose ``.grad`` is the
            # pinned ``_cpu_grad`` (torch 2.13 fsdp/_flat_param.py L1694-1698), so it steps there, states and all
            sts = raw = ()
            master = 0 if r.host_shards else master
        self.master += k * master
        events = torchao_optim.step_events(t.optimizer, sh, t.torchao_block) if t.torchao_block and not host else ()
        if events:  # torchao: the compiled step's buffers (torchao_optim.step_events)
            self.ao_step = max(self.ao_step, torchao_optim.step_peak(t.optimizer, sh, t.torchao_block, r.block))
        self.ao_events.append(events)  # aligned with ``items``: the reserved replay's step
        self.opt += k * sum(sts)
        self.items.append((where, k, g, sts, master))
        self.item_elems.append(n)
        self.item_rank_raw.append(r.grad_raw_bytes(n if grad_n is None else grad_n))
        self.item_state_raw.append(tuple(raw))
        if t.impl == "fused" and t.optimizer in ("adam", "adamw", "adagrad") and not host:
            self.step_t += k * r.block(4)  # fused: the scalar fp32 ``step`` on the device (adagrad.py L82-88)
        if not r.host_shards:  # (the step's temporaries: on the host under FSDP1 parameter offload)
            self.largest = max(self.largest, n * r.sbytes)
            self.largest_n = max(self.largest_n, n)
            self.group += k * r.block(sh * r.sbytes)
        return g


def flat_zero(t: TrainingSpec) -> bool:
    """Whether DeepSpeed's ZeRO optimizer keeps this rank's fp32 master and optimizer states as flat tensors
    on the GPU. ZeRO-3: ``_create_fp32_partitions`` clones one flat fp32 tensor per sub-group (DeepSpeed
    v0.19.8 ``stage3.py`` L1169-1172, v0.14.2 the same) and the optimizer steps that one tensor
    (``_optimizer_step`` L1235-1260). ZeRO-1/2: one flat fp32 partition per parameter group,
    ``single_partition_of_fp32_groups`` (v0.19.8 ``stage_1_and_2.py`` L560-561, a clone of the flat half
    group's partition cast to fp32; v0.14.2 L393-394 ``.clone().float()``), which becomes the group's only
    parameter (``param_group['params'] = [...]``, v0.19.8 L584, v0.14.2 L409). So the states (torch
    Adam's ``zeros_like(p)``) are flat too: the allocator rounds each flat tensor once, not each
    parameter's part, and each is one block (trace on a 2-layer Qwen3 ZeRO-2 over 4 ranks: one 178.4 MiB
    master and two 178.4 MiB Adam states, where a per-tensor count made the embedding's 148.4 MiB and
    many small blocks). Under the default allocator a per-tensor count over-states them by up to 2 MiB a
    tensor (Qwen1.5-0.5B on one rank: 218 MiB of master and Adam states; the measured active peaks of
    Giles Thomas's rows with and without expandable segments differ by 4 MiB). Not with the optimizer
    offloaded (host memory), under FSDP, Megatron's distributed optimizer or Gemini."""
    return t.zero >= 1 and t.fsdp is None and not t.distributed_optimizer and t.gemini is None \
        and not t.offload_optimizer


def _state_bytes(t: TrainingSpec, shape: tuple[int, ...], sh: int, r: _Rank, n: int, galore: bool) -> tuple[int, ...]:
    """One tensor's optimizer states (``state_bytes``; GaLore's optimizers: ``galore_state_bytes``, in the
    weight's dtype: GaLore runs without master weights or sharding, ``TrainingSpec._check_galore``)."""
    if t.optimizer in LOWRANK_OPTIMIZERS:
        o = t.galore_options()
        return galore_state_bytes(t.optimizer, shape, galore, r.w, o["rank"], o["proj_type"], t.bnb_blocksize)
    return state_bytes(t.optimizer, shape, sh, r.sbytes, whole=n, blocksize=t.torchao_block or t.bnb_blocksize)


def _model_states(m: ModelSpec, t: TrainingSpec, stage: str) -> States:
    """Sum over the tensors on this rank. Transformer layers are identical, so one layer (the
    first on the rank) is counted and multiplied by the layers on the rank."""
    r = _Rank.of(m, t, stage)
    if t.gemini is not None:
        return _gemini_states(m, t, r)
    acc = _Tally()
    # load order: tensors before the layers, one layer, tensors after the layers (bytes each)
    before: list[tuple[str, int]] = []
    layer: list[tuple[str, int]] = []
    after: list[tuple[str, int]] = []
    _base_tensors(m, t, r, acc, before, layer, after)
    lora = _lora_tensors(m, t)
    _lora_adapters(t, r, acc, lora)
    _buffers(m, r, acc, before, layer, after)
    _layer_rope_cache(m, t, r, acc, layer)
    _hf_layer_rotary_cache(m, t, r, acc, layer)
    _rope_cache(m, t, r, acc, before)
    named = _named_load(before, layer, r.per_stage if m.uniform_layers else 1, after)
    gathered = ds_init_gathers(t, named, acc) if t.zero == 3 and t.fsdp is None and not t.distributed_optimizer \
        and t.gemini is None else ()
    if t.ds_params_on_host:
        before, layer, after = _host_partitions(m, before, layer, after, acc)
    placed = _placed_bytes(tuple(x for _, x in before), tuple(x for _, x in layer),
                           r.per_stage if m.uniform_layers else 1, tuple(x for _, x in after), r.expandable)
    weights = placed - acc.buffers + acc.lora_w
    master, opt, step_t = acc.master, acc.opt, acc.step_t
    if r.flat_states:  # DeepSpeed ZeRO: one flat fp32 master and one flat tensor per state kind
        kinds = max((len(item[3]) for item in acc.items), default=0)
        master = r.block(master) if master else 0
        opt = sum(r.block(sum(item[1] * item[3][i] for item in acc.items if len(item[3]) > i)) for i in range(kinds))
    # bitsandbytes' two shared 256-entry maps (fp32); GaLore's 8-bit AdamW is bitsandbytes' Optimizer2State
    opt += bnb_qmap_bytes("adamw-8bit" if t.optimizer == "galore-adamw-8bit" else t.optimizer, acc.largest_n)
    if t.offload_optimizer:  # ZeRO-Offload: fp32 master weights and optimizer states live in host memory
        master = opt = step_t = 0
    # bitsandbytes' paged optimizers put their states in CUDA unified memory (``cudaMallocManaged``,
    # ``bitsandbytes/functional.py`` get_paged / GlobalPageManager): not device memory the caching
    # allocator holds, paged to the GPU only while the step reads them
    reduce = 4 if t.precision == "bf16-mp" else r.gather  # MixedPrecisionPolicy(reduce_dtype=fp32), else the grads'
    rs = r.block(acc.layer_elems * reduce) if r.fsdp_unsharded else 0
    root_rs = r.block(acc.root_rs_elems * reduce) if (r.fsdp_unsharded and acc.root_rs_elems) else 0
    emb_elems = acc.root_rs_elems - acc.head_rs_elems
    build, build_temp = _device_build(m, t, r)
    build_peak = 0
    if t.ds_whole_load and not build:
        build, build_peak = zero3_whole_load(named, acc.whole, r.block, acc.trained)
    elif zero3_init_on_device(t) and not build:
        build, build_peak = zero3_init_build(named, acc.whole, r.block, acc.trained)
    st = States(weights, acc.buffers, master, acc.grads, opt, step_t, acc.trainable, acc.params_rank,
                  acc.layer_grads, acc.head_grads, acc.lmh, acc.hmh, acc.largest, acc.group, acc.lpf,
                  sum(x[1] for x in lora), acc.q4, acc.root, acc.head_full, acc.emb_full, acc.layer_full, rs,
                  acc.root_g, _load_list(before, layer, r.per_stage if m.uniform_layers else 1, after),
                  fsdp1_rank0_items(t, r, acc), tuple(acc.root_list), tuple(acc.layer_list),
                  each_layer_grads=tuple(g for _, g in sorted(acc.each.items())) if not lora else (),
                  root_rs=root_rs, root_last_grad=acc.root_last if root_rs else 0,
                  root_ag_raw=acc.root_ag_elems * r.gather, root_rs_raw=acc.root_rs_elems * reduce if root_rs else 0,
                  head_grads_raw=acc.head_raw, emb_grads_raw=acc.emb_raw, head_grads_each=tuple(acc.head_each),
                  head_unit_full=acc.head_unit, head_unit_last=acc.head_last, head_unit_tensors=tuple(acc.head_list),
                  head_unit_rs=r.block(acc.head_rs_elems * reduce) if (root_rs and acc.head_rs_elems) else 0,
                  emb_unit_rs=r.block(emb_elems * reduce) if (root_rs and emb_elems) else 0,
                  emb_unit_last=acc.emb_last if root_rs else 0,
                  between_grads=acc.between, root_views=acc.root_views, build=build, build_temp=build_temp,
                  build_peak=build_peak, gathered=gathered,
                  root_flat=r.block(acc.root_flat_bytes) if acc.root_flat_bytes else 0,
                  embed_matmul_half=acc.emh, head_pre_half=acc.hpre, root_flat_elems=acc.root_flat_bytes // r.gather,
                  torchao_step=acc.ao_step, torchao_events=tuple(acc.ao_events) if acc.ao_step else (),
                  fsdp_init=_sync_init(m, t, r, lora, (before, layer, after)) if t.fsdp_sync_module_states else (),
                  load_split=(len(before), len(layer), len(after)) if m.uniform_layers else (),
                  load_buffer=tuple(n in acc.buffer_names for n, _ in _named_load(
                      before, layer, r.per_stage if m.uniform_layers else 1, after)),
                  grad_raw=tuple(n * r.gbytes for n in acc.item_elems), grad_rank_raw=tuple(acc.item_rank_raw),
                  state_raw=tuple(acc.item_state_raw), trainable_elems=tuple(acc.item_elems),
                  grad_shard_raw=tuple(-(-x // r.d) for x in acc.item_rank_raw)
                  if r.fsdp_unsharded and not r.grads_sharded else ())
    return wrap_policy_states(m, t, st, r, acc, litgpt_tensors(m.first_layer_and_outer_tensors, t))


def _gemini_states(m: ModelSpec, t: TrainingSpec, r: _Rank) -> States:
    """ColossalAI Gemini's rank 0 (``estimate.gemini``): its fp16 chunks are the weights (loaded
    first, each one ``torch.empty`` of chunk_size elements, ``Chunk.__init__``), then the buffers
    in their own dtypes (``ZeroDDP._cast_buffers`` moves them to the GPU and casts floating ones to
    fp16, data_parallel.py L525-529: an fp32 buffer is counted at 4 bytes, not 2); its fp32 chunks the
    master weights; no gradient memory (each gradient is copied over its parameter's fp16 slot);
    HybridAdam's two fp32 states per parameter of its chunks. In ``trainables`` the master chunks
    ride on their chunk's first parameter, and each parameter has a gradient of 0 bytes."""
    g = model_gemini(m, t)
    acc = _Tally()
    before: list[tuple[str, int]] = [(f"gemini.fp16_chunk.{i}", b) for i, b in enumerate(g.fp16_chunks)]
    layer: list[tuple[str, int]] = []
    after: list[tuple[str, int]] = []
    _buffers(m, r, acc, before, layer, after)
    placed = _placed_bytes(tuple(x for _, x in before), (), 0, tuple(x for _, x in after), r.expandable)
    states = tuple(r.block(n * 4) for n in g.states)        # exp_avg, exp_avg_sq: (numel,) fp32 each
    firsts = [j == 0 for k in g.chunk_params for j in range(k)]   # each owned chunk's first parameter
    masters = iter(g.fp32_chunks)
    items = tuple(("before", 1, 0, (s, s), next(masters) if first else 0) for s, first in zip(states, firsts))
    trainable = sum(p.numel for p in m.parameter_tensors())
    largest = max(g.states, default=0) * 4
    return States(placed - acc.buffers, acc.buffers, sum(g.fp32_chunks), 0, 2 * sum(states), 0, trainable,
                  trainable, 0, 0, 0, 0, largest, sum(states), 0, 0,
                  load=_load_list(before, layer, 0, after), trainables=items)


def _sync_init(m: ModelSpec, t: TrainingSpec, r: "_Rank", lora: list, loaded: tuple) -> tuple:
    """FSDP1's wrap of rank 0's CPU model with ``sync_module_states`` as alloc/free events
    (``fsdp_init.sync_init_events``): each parameter's whole bytes on the device (a 4-bit weight's
    packed codes in ``quant_storage``, ``quant4.fsdp_packed_bytes``; a half embedding's 2 B), peft's
    adapters in their own dtype (fp32 unless ``lora_half``, ``_lora_adapters``), the buffers and
    quant-state parts from the load lists ``loaded``. One layer stands for each: models whose layers
    differ are refused in one line."""
    if not m.uniform_layers:
        raise TrainmemError(f"--fsdp-sync-module-states: the estimate models the wrap's moves for models whose "
                            f"decoder layers are alike; {m.name} is not one: drop the option")
    root: list[tuple[str, int]] = []
    layer_params: list[tuple[str, int]] = []
    for p in litgpt_tensors(m.first_layer_and_outer_tensors, t):
        if is_quantized(p, t):
            nbytes = fsdp_packed_bytes(p.numel, t)
        else:
            nbytes = p.numel * (2 if half_embedding_tensor(p, t) else r.w)
        (layer_params if p.layer is not None else root).append((p.name, nbytes))
    targets = set(t.lora_targets or default_lora_targets(m)) if t.lora_rank else set()
    adapter_w = r.w if (r.half_master or t.lora_half) else 4
    adapters = [n * adapter_w for _mod, _n, lyr, parts in lora if lyr == r.lo for n in parts]
    units, resident = wrap_units(t, root, layer_params, targets, adapters, loaded, r.per_stage)
    return sync_init_events(units, resident, r.w, t.shard_group, t.fsdp != "no-shard", r.host_shards)


def _device_build(m: ModelSpec, t: TrainingSpec, r: "_Rank") -> tuple[tuple, int]:
    """The model's build events where it is replayed (``quant4.builds_on_device``: torchtune 0.1's
    QLoRA with torchao 0.1, one GPU) and its allocated peak above what it leaves, each tensor
    block-rounded; ((), 0) otherwise."""
    if not builds_on_device(t) or r.per_stage != m.num_layers:
        return (), 0
    events = torchtune_v01_build(m, t)
    peak, cur = _events_peak(events, r.block)
    return events, peak - cur


def _events_peak(events: tuple, block: Callable[[int], int]) -> tuple[int, int]:
    """(allocated peak, allocated at the end) of alloc/free events, each tensor ``block``-rounded
    (``("e",)``, an emptied cache, frees nothing)."""
    live: dict[int, int] = {}
    cur = peak = 0
    for ev in events:
        if ev[0] == "a":
            live[ev[1]] = block(ev[2])
            cur += live[ev[1]]
            peak = max(peak, cur)
        elif ev[0] == "f":
            cur -= live.pop(ev[1])
    return peak, cur


def zero3_whole_load(load: list[tuple[str, int]], whole: dict[str, int],
                     block: Callable[[int], int], trained: set | None = None) -> tuple[tuple, int]:
    """DeepSpeed ZeRO-3 of a model built outside ``zero.Init`` (``TrainingSpec.ds_whole_load``) as
    alloc/free events, and their allocated peak (each tensor ``block``-rounded): the engine moves every
    tensor to the GPU whole in load order (``module.to(device)``: ``whole`` bytes for a parameter, a
    buffer its own); the optimizer then gives each parameter, in order, its partition (``load``'s
    bytes: ceil(numel / dp) elements) and frees the whole tensor; ``defragment`` frees the partitions,
    empties the cache (``("e",)``: every segment with no live block is released, the whole model's
    among them) and copies them back as one flat buffer. The peak is the whole model and the first
    partition: each later partition replaces a larger whole tensor. What stays is the flat buffer
    and the buffers (the registered ones are never partitioned). Only the trainable parameters'
    partitions are flattened (``_defragmented``: ``trained``, the names with a gradient; None: all)."""
    ev: list[tuple] = [("a", i, whole.get(name, x)) for i, (name, x) in enumerate(load)]
    params = [i for i, (name, _x) in enumerate(load) if name in whole]
    n = len(load)
    for i in params:                       # _partition_param: torch.empty(partition), copy_, free_param
        ev += [("a", n + i, load[i][1]), ("f", i)]
    ev += _defragmented(load, params, trained)   # the trainable partitions to one flat buffer
    return tuple(ev), _events_peak(tuple(ev), block)[0]


def _defragmented(load: list[tuple[str, int]], params: list[int], trained: set | None) -> list[tuple]:
    """The events of ZeRO-3's ``defragment`` at the stage-3 optimizer's init: the partitions of the
    parameters it optimizes (``trainable_param_groups``: those with a gradient, v0.19.8 ``stage3.py``
    L440-443 -> ``_create_fp16_partitions_with_defragmentation`` L913-973, ``_get_parameter_partitions``
    L1020-1021) copied to the host and their device data emptied, ``empty_cache()``, one flat buffer of
    them copied back (``zero/utils.py`` ``defragment`` L215-243); a frozen parameter's partition (LoRA's
    base weights) stays where it was. ``params``: indices of ``load`` that are parameters (partitions
    at ``len(load) + i``); ``trained`` the names with a gradient (None: every parameter)."""
    n = len(load)
    moved = [i for i in params if trained is None or load[i][0] in trained]
    return [("f", n + i) for i in moved] + [("e",), ("a", 2 * n, sum(load[i][1] for i in moved))]


def zero3_init_on_device(t: TrainingSpec) -> bool:
    """DeepSpeed ZeRO-3 of a model built under ``deepspeed.zero.Init`` (``TrainingSpec.ds_zero_init``)
    whose partitions stay on the GPU (not ``--remote-device cpu``), which the stage-3 optimizer then
    flattens (``defragment``, as ``zero3_whole_load``)."""
    return (t.zero == 3 and t.fsdp is None and not t.distributed_optimizer and t.gemini is None
            and t.ds_zero_init and not t.ds_params_on_host)


def zero3_init_build(load: list[tuple[str, int]], whole: dict[str, int],
                     block: Callable[[int], int], trained: set | None = None) -> tuple[tuple, int]:
    """DeepSpeed ZeRO-3 of a model built under ``deepspeed.zero.Init`` (``zero3_init_on_device``) as
    alloc/free events, and their allocated peak (each tensor ``block``-rounded). zero.Init creates
    each module's tensors on the GPU as its ``__init__`` makes them (DeepSpeed 0.19.8
    ``partition_parameters.py`` ``_add_tensor_creation_wrappers`` L637-672) and, when the ``__init__``
    returns, partitions its parameters one by one (``_post_init_method`` L1232-1258 ->
    ``_zero_init_param`` L1200-1207 -> ``_partition_param`` L1778-1898: the partition, ceil(numel / dp)
    elements, ``torch.empty``-ed, the slice copied in and the whole tensor freed, ``free_param``
    L314-330). So a module's parameters (``load``'s names that share a module, in load order) are
    whole together, then each gets its partition and its whole tensor is freed; a buffer stays.
    The stage-3 optimizer's ``defragment`` then frees the partitions, empties the cache and copies
    them back as one flat buffer (``stage3.py`` L966-973, ``utils.py`` L215-243; as ``zero3_whole_load``).
    Not replayed: transformers' weight init under ZeRO-3 (``initialize_weights_zero3``, transformers
    5.24 ``integrations/deepspeed.py`` L298-334) gathers each module's and its children's parameters
    whole in turn (``from_pretrained``: each module's own, to load them), transients released by
    the same ``empty_cache`` and below the init's later gathers on top of the fp32 master
    (``ds_init_gathers``), as the ``model_loaded`` peak of trace shows (tests/test_zero_init.py)."""
    ev: list[tuple] = []
    n = len(load)
    params = [i for i, (name, _x) in enumerate(load) if name in whole]
    i = 0
    while i < n:
        name = load[i][0]
        if name not in whole:                    # a buffer: made on the GPU, kept whole
            ev.append(("a", i, load[i][1]))
            i += 1
            continue
        module = name.rsplit(".", 1)[0]
        j = i
        while j < n and load[j][0] in whole and load[j][0].rsplit(".", 1)[0] == module:
            j += 1
        ev += [("a", k, whole[load[k][0]]) for k in range(i, j)]          # the module's __init__
        for k in range(i, j):                                             # _post_init_method
            ev += [("a", n + k, load[k][1]), ("f", k)]
        i = j
    ev += _defragmented(load, params, trained)   # the trainable partitions to one flat buffer
    return tuple(ev), _events_peak(tuple(ev), block)[0]


def ds_init_gathers(t: TrainingSpec, named: list[tuple[str, int]], acc: "_Tally") -> tuple[tuple[int, ...], ...]:
    """The whole bytes of each trainable parameter as DeepSpeed's stage-3 optimizer gathers it at the
    end of its ``__init__``, after ``defragment`` and the fp32 partitions: ``create_reduce_and_remove_grad_hooks``
    calls ``param.all_gather()`` on every parameter that requires a gradient, registers its gradient
    hook and partitions it again, one parameter at a time (DeepSpeed v0.19.2 ``stage3.py`` L491,
    L1290-1323; v0.19.8 L519, L1500-1531); the gather is a ``torch.empty`` of the whole (padded)
    parameter on the GPU (``partition_parameters.py`` ``_allgather_params_sequential``, v0.19.8
    L2134-2142), freed when it is partitioned. The cache was emptied just before, so the largest
    parameter (the embedding or the head) takes a fresh segment that stays reserved into the step.
    With the partitions in host memory (``--remote-device cpu``) the gather first copies the
    partition to the GPU beside it (``param.ds_tensor.to(device)``, L2146). In load order,
    which for a transformers model is ``module.parameters()``'s; each entry: the bytes allocated
    together, then freed."""
    return tuple(((acc.whole[name], x) if t.ds_params_on_host else (acc.whole[name],))
                 for name, x in named if name in acc.trained and name in acc.whole)


def _named_load(before: list, layer: list, k: int, after: list) -> list[tuple[str, int]]:
    """``(name, bytes)`` of every tensor moved to the device, in load order (as ``_load_list``)."""
    return list(before) + list(layer) * k + list(after)


#: optimizers whose states are element-wise copies of the parameter (one state-dtype element each)
ELEMENTWISE_STATES = ("adamw", "adam", "sgd-momentum", "lion", "sgd", "adagrad", "rmsprop", "schedule-free-adamw",
                      "schedule-free-radam", "schedule-free-sgd")


def fsdp1_rank0_items(t: TrainingSpec, r: _Rank, acc: _Tally) -> tuple:
    """``States.trainables`` as rank 0 holds them under FSDP1 (what the reserved-memory replay
    allocates tensor by tensor). FSDP1 flattens a unit's parameters, in registration order, into one
    flat parameter padded to a multiple of the ranks and gives rank ``i`` the ``i``-th contiguous chunk
    (torch 2.13 ``fsdp/_flat_param.py`` ``FlatParamHandle._get_shard``: ``chunk = ceil(numel /
    world_size)``); with ``use_orig_params=True`` the optimizer sees each original parameter's part of
    that chunk, so rank 0 holds the first parameters of the unit whole and nothing of the last ones
    (a Llama layer: q whole and part of k), and its optimizer states and ``foreach`` temporaries have
    those sizes, not a 1/d share of every tensor. Its sharded gradient is one tensor, the flat
    parameter's ``.grad`` of ``chunk`` elements, which the original parameters' gradients view. The
    units: each layer, and the root (the tensors before and after the layers). Totals hardly change
    (the padding); the blocks do. Plain FSDP1 over several ranks with element-wise optimizer states
    only (LoRA's mixed units and factored or 8-bit states keep the 1/d shares). Found by trace on the
    fake group (real FSDP1, rank 0): Llama-2-7B dp 8 bf16-mp, full recompute, reserved -6.7% against
    trace -12.7% before (docs/validation.md, the torchtitan PR #165 FSDP1 rows)."""
    items = tuple(acc.items)
    if (t.fsdp is None or t.fsdp_version != 1 or r.d < 2 or t.lora_rank or r.half_master
            or t.optimizer not in ELEMENTWISE_STATES):
        return items
    out = list(items)
    for unit in (["layer"], ["before", "after"]):
        idx = [j for j, it in enumerate(items) if it[0] in unit]
        elems = [acc.item_elems[j] for j in idx]
        chunk = -(-sum(elems) // r.d)
        offset = 0
        for pos, (j, n) in enumerate(zip(idx, elems)):
            mine = max(0, min(n, chunk - offset))           # this parameter's part of rank 0's chunk
            offset += n
            where, k, _g, sts, master = items[j]
            g = r.block(chunk * r.gbytes) if pos == 0 else 0  # the flat gradient, on the unit's first
            out[j] = (where, k, g, tuple(r.block(mine * r.sbytes) if mine else 0 for _ in sts), master)
    return tuple(out)


def _host_partitions(m: ModelSpec, before: list, layer: list, after: list,
                     acc: _Tally) -> tuple[list, list, list]:
    """The load lists without the parameters when DeepSpeed ZeRO-3 keeps this rank's partitions in
    host memory (``TrainingSpec.ds_params_on_host``: ``zero.Init(remote_device="cpu")``): only the
    registered buffers reach the GPU (the engine's ``self.module.to(self.device)``, DeepSpeed v0.7.0
    ``runtime/engine.py`` L1036-1037, moves them; a partitioned parameter's ``data`` is empty), and
    no partition counts as device weights (LoRA adapters are parameters too: ``acc.lora_w`` 0).
    Gathered parameters stay on the GPU (``quantities.zero3_gather.deepspeed_gathered``); each gather's copy of
    the partitions to the GPU (``p.ds_tensor.to(cuda)``, v0.7.0 ``partition_parameters.py`` L846,
    L869), at most the gathered bytes / dp and freed when the all-gather is issued, is not counted.
    The step's write of the fp32 weights into the fp16 partitions is a blocking GPU-to-host copy,
    which converts on the host (torch ``aten/src/ATen/native/cuda/Copy.cu`` ``copy_kernel_cuda``:
    "For blocking transfers conversions are performed on CPU to avoid allocating extra GPU memory")."""
    params = {p.name for p in m.parameter_tensors()}
    acc.lora_w = 0

    def keep(items: list) -> list:
        return [(n, x) for n, x in items if n.split(".4bit.")[0] not in params]
    return keep(before), keep(layer), keep(after)


def _load_list(before: list, layer: list, k: int, after: list) -> tuple[int, ...]:
    """Bytes of every tensor moved to the device, in load order (``layer`` repeated ``k`` times)."""
    return tuple(x for _, x in before) + tuple(x for _, x in layer) * k + tuple(x for _, x in after)


def half_embedding_tensor(p: ParamTensor, t: TrainingSpec) -> bool:
    """A weight that ``half_embeddings`` keeps in the half dtype (2 bytes) while the other weights
    that are not 4-bit are fp32 under autocast: TRL's ``peft_module_casting_to_bf16`` (trl 0.13.0
    ``trl/trainer/utils.py`` L872-879) casts the modules whose name holds ``lm_head``,
    ``embed_tokens``, ``wte`` or ``wpe`` back to bf16 after peft's ``prepare_model_for_kbit_training``
    made them fp32, norms excepted (those it casts to fp32 first): the embedding tables and the LM
    head. A half head is not cast by autocast (no cached copy), and the embedding's output, the first
    layer's input, is half (``quantities.head_moments.half_embedding_output``)."""
    return t.half_embeddings and p.layer is None and p.role != "norm" and (
        p.role == "embedding" or p.name.startswith("lm_head"))


def _base_tensors(m: ModelSpec, t: TrainingSpec, r: _Rank, acc: _Tally, before: list, layer: list,
                  after: list) -> None:
    """The model's own parameters on this rank. Identical layers: layer 0 stands for each of the
    stage's layers. Layers that differ (``ModelSpec.uniform_layers`` false): each of the stage's
    layers is counted, ``layer`` lists all of them in load order, and the per-layer figures
    (``layer_grads``, ``lmh``) are the stage's average layer, ``lpf`` its largest."""
    uniform = m.uniform_layers
    lpf_of: dict[int, int] = {}
    rank = r
    expert_rank = _expert_rank(r, t)
    for p in litgpt_tensors(m.first_layer_and_outer_tensors if uniform else m.parameter_tensors(), t):
        if p.layer is None and not rank.holds(m, t.pp, p):
            continue
        if p.layer is not None and not uniform and not rank.lo <= p.layer < rank.hi:
            continue
        r = expert_rank if p.role == "expert" else rank
        k = r.per_stage if (p.layer is not None and uniform) else 1  # identical layers on this rank
        n = _tp_div(p, t.tp) if p.role != "expert" else _ep_div(p, t.ep)
        acc.params_rank += k * n
        dest = layer if p.layer is not None else (after if layer else before)
        if is_quantized(p, t):
            # bitsandbytes Linear4bit (packed codes + quant state) or torchao's NF4Tensor (packed codes,
            # int8 scalers, their factors, mean and table) instead of the weight (quant4.py); frozen
            # (LoRA), never cast by autocast; under FSDP1 the packed codes are sharded (_sharded_4bit)
            parts = weight_storage(n, t)
            parts = _sharded_4bit(t, r, acc, p, n, uniform, lpf_of) + parts[1:] if r.shard_weights else parts
            dest.extend((f"{p.name}.4bit.{i}", b) for i, b in enumerate(parts) if b)  # (offloaded shard: none)
            acc.q4 += k * sum(r.block(b) for b in parts if b)
            continue
        half_table = half_embedding_tensor(p, t)
        wb = n * (2 if half_table else r.w)  # (TRL's bf16 embeddings and head: half_embedding_tensor)
        item = (p.name, r.shard(wb) if r.shard_weights else wb)
        dest.extend([item] if item[1] else [])  # (none on the device when FSDP1 offloads the shards: _Rank.shard)
        acc.whole[p.name] = wb
        if r.fsdp_unsharded and p.layer is None:
            acc.root_param(r, p.shape, n)      # the root unit's unsharded parameter (fsdp_root below)
            if layer:
                acc.head_unit += r.block(n * r.gather)
                acc.head_list.append(n * r.gather)
            acc.root_list.append(n * r.gather)
        if r.fsdp_unsharded and p.layer is not None and (uniform or p.layer == r.lo):
            acc.layer_list.append(n * r.gather)   # one layer's unsharded parameter
        if p.layer is not None:
            lpf_of[p.layer] = lpf_of.get(p.layer, 0) + n * r.gather  # FSDP2 gathers in param_dtype (bf16)
            # autocast caches half copies of the weights its matmuls cast; transformers' grouped_mm
            # experts have no autocast rule and run in the weights' dtype (no copies)
            if p.is_matmul and t.amp and p.role != "expert":
                acc.lmh += n * 2
        elif p.is_matmul and t.amp and not half_table and not _vision_side(m, p):
            acc.half_copy(m, p, n, after=bool(layer))  # (a half head needs none; a VLM's vision side's: measured)
        if _frozen(m, t, p):
            if r.mixed_units and p.layer is not None:
                acc.mixed_unit_grad(r, n, k, uniform or p.layer == r.lo)
            continue
        acc.trained.add(p.name)
        g = acc.trainable_tensor(t, r, p.shape, n, k, p.numel if _replicated_grad(m, t, p, r.stage) else n,
                                 "layer" if p.layer is not None else ("after" if layer else "before"),
                                 galore=galore_target(t, p))
        full = r.block(n * r.gather) if r.fsdp_unsharded else 0  # its unsharded gradient under FSDP
        if p.layer is not None:
            acc.layer_grads += g
            if not uniform:
                acc.each[p.layer] = acc.each.get(p.layer, 0) + g
            if uniform or p.layer == r.lo:  # one layer: layer 0 stands for each, else the stage's first
                acc.layer_full += full
                acc.layer_elems += n if full else 0
            continue
        _outer_gradient(m, acc, p, n, r, (g, full), after_layers=bool(layer))
    r = rank
    acc.lpf = max(lpf_of.values(), default=0)
    if not uniform and r.per_stage:
        acc.layer_grads = -(-acc.layer_grads // r.per_stage)
        acc.lmh = -(-acc.lmh // r.per_stage)
    if m.tied_embeddings and t.amp and m.head in ("causal-lm", "masked-lm", "seq2seq-lm", "speech-seq2seq", "vlm") and \
            (t.pp == 1 or r.stage == "last") and not t.half_embeddings:
        # the tied embedding is also the LM head: autocast casts it for the head matmul
        emb = word_embedding(m)
        acc.hmh += _tp_div(emb, t.tp) * 2


def _head_pre_cast(m: ModelSpec, p: ParamTensor) -> bool:
    """Whether ``p``, a matmul weight after the layers, is a masked LM's transform dense, which
    autocast casts at that linear's call, before the decoder's (transformers 5.24
    ``models/bert/modeling_bert.py`` L480-484 ``BertPredictionHeadTransform.forward``: ``dense``
    first, L497-500 ``BertLMPredictionHead.forward``: ``transform`` then ``decoder``; RoBERTa's
    ``lm_head.dense`` alike): its own copy, one request (``aten/src/ATen/autocast_mode.cpp``
    ``cached_cast``: one copy per weight, made at the op that casts it)."""
    return m.head == "masked-lm" and p.layer is None and p.module == "dense"


def _sharded_4bit(t: TrainingSpec, r: _Rank, acc: _Tally, p: ParamTensor, n: int, uniform: bool,
                  lpf_of: dict[int, int]) -> tuple[int]:
    """A bitsandbytes 4-bit weight's packed codes in its decoder layer's FSDP1 unit
    (``quant4.fsdp_packed_bytes``: stored in the flat parameter's dtype): this rank's shard, its
    ``1/d`` of the bytes (returned), and the whole codes gathered with the layer's unit in forward
    and again in backward (``layer_tensors``, ``layer_params_full``). Frozen: the unit holds no
    gradient for it (adapters are units of their own, ``TrainingSpec._check_quantize_sharding``).
    The quant state is whole on every rank (the caller's other ``weight_storage`` parts)."""
    packed = fsdp_packed_bytes(n, t)
    if r.fsdp_unsharded and (uniform or p.layer == r.lo):
        acc.layer_list.append(packed)
    if p.layer is not None:
        lpf_of[p.layer] = lpf_of.get(p.layer, 0) + packed
    return (r.shard(packed),)


def _vision_side(m: ModelSpec, p: ParamTensor) -> bool:
    """Whether ``p`` is a VLM's vision tower's or projector's (``spec.vision.VISION_SIDE``)."""
    return m.is_vlm and bool(VISION_SIDE.search(p.name))


def _frozen(m: ModelSpec, t: TrainingSpec, p: ParamTensor) -> bool:
    """Whether ``p`` gets no gradient: LoRA's frozen base, a parameter built but never given one (``unused``:
    ``spec.profile.without_gradient``, ``spec.vision.unread_vision_parameters``), a VLM's vision tower under
    ``--freeze-vision-tower`` (LLaMA-Factory's: ``spec.vision.VISION_TOWER``)."""
    return bool(t.lora_rank) or p.role == "unused" or (
        m.is_vlm and t.freeze_vision_tower and in_vision_tower(m.model_type, p.name))


def _outer_gradient(m: ModelSpec, acc: _Tally, p: Any, n: int, r: _Rank, grad: tuple[int, int],
                    after_layers: bool) -> None:
    """Tally the gradient of a parameter outside the layers (``grad``: its bytes on this rank and,
    under FSDP, its unsharded block). Those registered after the layers (final norm, head) are made
    first in backward; those before them (embeddings; ViT's patch projection, class token and
    position table) come last, with the embeddings' gradients."""
    g, full = grad
    acc.root_gradient(p.shape, n, r.d, g, full, r.gather)
    if p.role != "embedding" and after_layers:
        acc.head_grads += g
        acc.head_full += full
        acc.head_raw += n * r.gather if full else 0
        acc.head_each += [n * r.gather] if full else []
        if full:
            acc.head_rs_elems, acc.head_last = acc.head_rs_elems + _dim0_padded(p.shape, n, r.d), full
        return
    acc.emb_last = full or acc.emb_last
    if not (m.tied_embeddings and p.name.endswith(TIED_NAMES)):
        acc.emb_full, acc.between = acc.emb_full + full, acc.between + (g if after_layers and m.is_encoder_decoder else 0)
        acc.emb_raw += n * r.gather if full else 0


def _lora_adapters(t: TrainingSpec, r: _Rank, acc: _Tally, lora: list[tuple[str, int, int | None, tuple[int, int]]]
                   ) -> None:
    """LoRA A and B matrices on this stage: trainable, so they get gradients and states. peft keeps
    them in fp32 over half base weights (``get_peft_model(..., autocast_adapter_dtype=True)``
    upcasts bf16/fp16 adapters, ``tuners_utils.py`` ``_cast_adapter_dtype``), so their weights,
    gradients and states are fp32 and need no master copy, unless the framework casts the whole
    model to half with an fp32 master (DeepSpeed ZeRO: ``TrainingSpec.fp32_master``)."""
    if not r.half_master and not t.lora_half:
        r = replace(r, w=4, gbytes=4, sbytes=4)
    for _mod, _n, lyr, parts in lora:
        if lyr is not None and not (r.lo <= lyr < r.hi):
            continue
        for n in parts:
            n = -(-n // t.tp) if t.tp > 1 else n
            held = r.shard(n * r.w) if r.shard_weights else n * r.w
            acc.lora_w += r.block(held) if held else 0
            g = acc.trainable_tensor(t, r, (-(-n // r.d) if r.zero_states >= 1 else n,), n, 1,
                                     where=f"layer{lyr - r.lo}" if lyr is not None else "after")
            if lyr == r.lo:
                acc.layer_grads += g
                if r.fsdp_unsharded:  # FSDP: the adapter's unsharded gradient joins its layer's reduce-scatter
                    acc.layer_full += r.block(n * r.w)
                    acc.layer_elems += n


def _buffers(m: ModelSpec, r: _Rank, acc: _Tally, before: list, layer: list, after: list) -> None:
    """Registered buffers (fp32 / int64 / bool, else the weight dtype), placed in load order."""
    for b in m.buffer_tensors():
        nb = {"float32": 4, "int64": 8, "bool": 1, "bfloat16": 2, "float16": 2}.get(b.dtype, r.w)
        numel = 1
        for x in b.shape:
            numel *= x
        if b.name.startswith("h."):  # nanoGPT's per-layer mask: part of the layer
            if int(b.name.split(".")[1]) != 0:  # layer 0 stands for every layer on this rank
                continue
            acc.buffers += r.per_stage * r.block(numel * nb)
            acc.buffer_names.add(b.name)
            _insert_buffer(layer, b.name, numel * nb)
            continue
        acc.buffers += r.block(numel * nb)
        acc.buffer_names.add(b.name)
        _insert_buffer(after if not b.name.startswith("embeddings") else before, b.name, numel * nb)


def _layer_rope_cache(m: ModelSpec, t: TrainingSpec, r: "_Rank", acc: "_Tally", layer: list) -> None:
    """``--layer-rope-cache N``: each decoder layer's own ``RotaryPositionalEmbeddings`` buffers, as
    torchtune's Llama-2 builder up to v0.5.0 makes them (it builds one layer with its ``rope`` and
    ``TransformerDecoder`` deep-copies it num_layers times, ``_get_clones``: torchtune ff594c231
    ``torchtune/models/llama2/_component_builders.py`` L84-114, ``torchtune/modules/transformer.py``
    L93, L137; v0.6.0 builds the layers in a loop around one shared ``rope``). Per layer, fp32 and
    non-persistent: ``theta`` [head_dim/2] and ``cache`` [N, head_dim/2, 2] (``torchtune/modules/
    position_embeddings.py`` L38, L57-73 at ff594c231), moved after the attention's linears
    (``Module._apply`` moves a module's children before its own buffers)."""
    if t.layer_rope_cache is None:
        return
    half = m.head_dim // 2
    for name, numel in (("theta", half), ("cache", t.layer_rope_cache * half * 2)):   # fp32 each
        acc.buffers += r.per_stage * r.block(numel * 4)
        at = max((i for i, (n, _) in enumerate(layer) if ".self_attn." in n), default=len(layer) - 1) + 1
        layer.insert(at, (f"layers.0.self_attn.pos_embeddings.{name}", numel * 4))
        acc.buffer_names.add(f"layers.0.self_attn.pos_embeddings.{name}")


def _hf_layer_rotary_cache(m: ModelSpec, t: TrainingSpec, r: "_Rank", acc: "_Tally", layer: list) -> None:
    """The ``cos_cached`` and ``sin_cached`` buffers each attention layer of an older transformers
    release keeps (``spec.tf_releases.layer_rotary_cache``: Mistral 4.34-4.41, Mixtral 4.36-4.47, ...):
    each ``[max_position_embeddings, head_dim]`` (4.39.3 ``modeling_mistral.py`` L103-116), in the
    default dtype ``from_pretrained`` sets to the dtype it loads in: half for half weights and for a
    4-bit model (loaded in its half compute dtype; ``prepare_model_for_kbit_training`` upcasts
    parameters, not buffers), fp32 for fp32 or autocast weights. Non-persistent buffers: FSDP keeps
    them whole on every rank."""
    if not layer_rotary_cache(m, t.transformers_release):
        return
    nb = 2 if (t.quantize or t.weight_bytes == 2) else 4
    numel = m.max_positions * m.head_dim
    for name in ("cos_cached", "sin_cached"):
        acc.buffers += r.per_stage * r.block(numel * nb)
        at = max((i for i, (n, _) in enumerate(layer) if ".self_attn." in n), default=len(layer) - 1) + 1
        layer.insert(at, (f"layers.0.self_attn.rotary_emb.{name}", numel * nb))
        acc.buffer_names.add(f"layers.0.self_attn.rotary_emb.{name}")


def _rope_cache(m: ModelSpec, t: TrainingSpec, r: "_Rank", acc: "_Tally", before: list) -> None:
    """``--rope-cache N``: the one RoPE module torchtune's Llama 3.x builders make and hand to every
    layer (``rope = Llama3ScaledRoPE(dim=head_dim, max_seq_len=max_seq_len, ...)`` before the layer
    loop, ``pos_embeddings=rope`` in each: torchtune/models/llama3_2/_component_builders.py L87-99 at
    1814feb17; max_seq_len 131072 for Llama 3.1/3.2). Its buffers, fp32 and non-persistent: ``theta``
    [head_dim/2] and ``cache`` [N, head_dim/2, 2] (``torchtune/models/llama3_1/_position_embeddings.py``
    L84, L96-101), built on the device first, before the layers."""
    if t.rope_cache is None:
        return
    half = m.head_dim // 2
    for i, (name, numel) in enumerate((("theta", half), ("cache", t.rope_cache * half * 2))):   # fp32 each
        acc.buffers += r.block(numel * 4)
        before.insert(i, (f"rope.{name}", numel * 4))
        acc.buffer_names.add(f"rope.{name}")


model_states.cache_clear = _STATES_CACHE.clear  # type: ignore[attr-defined]
