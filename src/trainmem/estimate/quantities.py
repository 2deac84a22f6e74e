"""The quantities of one rank that do not depend on batch, sequence or accumulation.

``quantities(m, t, stage)`` gathers, for one model trained one way on one pipeline stage:
model states (``states.py``), the layer's saved tensors as bytes per token and per token x key
(``layers.py``), the tensors outside the layers (embeddings, final norm, head input), the loss's
bytes per logit, the autocast cache, optimizer temporaries and communication buffers. The step
(``moments.py``) then turns them into bytes for any batch and sequence, on Python numbers or on
numpy arrays; ``gather`` stacks the quantities of many layouts into arrays for that.

Conventions: ``n`` = tokens on this rank (micro-batch x local sequence), ``nsq`` = tokens x keys
(n x full sequence: context parallelism sees every key); a per-token pair ``(tok, sq)`` stands
for ``int(tok * n + sq * nsq)`` bytes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from ..errors import TrainmemError
from ..spec.frameworks import (OWN_MODEL_CODE, caps_hidden_not_logits, torchtune_loop_shifts_fp32_logits,
                               torchtune_norm_saves_fp32, torchtune_offload_exempts_parameters)
from ..spec.model import ModelSpec
from ..spec.tf_releases import (cache_values_own_dtype, causal_lm_loss, checkpoint_wraps_unit, code_release,
                                eager_clamp, kv_cache_kind, moe_expert_loop, rotary_keys_half, sdpa_repeats_kv)
from ..spec.training import (BNB_OPTIMIZERS, CHUNKED_NLL_TOKENS, LOMO_OPTIMIZERS, RECOMPUTE, TORCHAO_OPTIMIZERS,
                             TrainingSpec, chunked_nll_problem, config_use_cache, galore_target)
from . import torchao_optim
from .cache import BoundedCache
from .elementwise import NEVER
from .derived import adapters_computed_half, batch1 as derived_batch1, point_at, regime as derived_regime
from .derived import head_during_loss as derived_head_loss, layer_coefs as derived_layer, outer as derived_outer
from .derived import logits_bytes as derived_logits_bytes, outer_ssq as derived_outer_ssq
from .derived import decoder_embedding_activations, decoder_embedding_temporaries
from .derived import decoder_ratio, grad_views as derived_grad_views, head_forward as derived_head_forward
from .derived import loss_upcasts as derived_loss_upcasts, outer_const as derived_outer_const
from .derived import outer_per_sample as derived_outer_per_sample
from .derived import first_free_casts as derived_first_free_casts, view_casts as derived_view_casts
from ..spec.vision import VISION_SIDE
from .derived import top_forward as derived_top_forward
from .derived import coefficients as derived_coefficients
from .derived import moment_activations
from .layers import ALL_MOMENTS, HALF, LayerCoefs, LayerKey, Policy, ep_rank_rows, layer_coefficients
from .layers import layer_sdpa_backend, sdpa_saves_padded
from .quant4 import dequant_dtypes, dequant_scratch, is_quantized
from . import unsloth
from .schedules import in_flight_at_backwards, rank_order
from .gemini import model_gemini
from .galore import GTensor, step_order, step_replay
from ..spec.galore import LOWRANK_OPTIMIZERS
from .states import (States, flat_zero, word_embedding, block_bytes, default_lora_targets, parameter_order, dtensor_tp, fsdp_grad_op, model_states,
                     torch_cp, torch_pipeline)

F32 = 4
#: ``pp_inflight`` under GPipe: no bound below the step's micro-batches (min(this, grad_accum) = grad_accum)
GPIPE_INFLIGHT = 1 << 30
#: outer tensors whose ``tok`` coefficient counts bytes per sequence position (shared by the micro-batch)
PER_POSITION = ("rotary.cos_sin",)
#: a layer transient whose op's saved tensors are still held by its autograd node (``layers._gelu``): in
#: a checkpointed layer the node got them from the recomputation and dropped them when it returned
#: (torch 2.13 torch/utils/checkpoint.py L1205-1206, ``unpack_hook``: ``holder.handles[gid] = None``
#: drops the handle keying ``frame.recomputed``'s weak-key dictionary, so the frame lets go), so the moment
#: is below its op's own (``.backward``) one, which stands in for it under full recompute. Found by trace:
#: GPT-2 (2 layers, n_embd 64) sequence classification, bf16-amp, full recompute, 4 x 256: +1.8% with it
ENGINE_CAST = ".engine_cast"
#: outer tensors of the final norm and the head (``_head_side``), freed by the head's backward before the
#: last layer's (``qa_outputs.input`` among them: before, a question-answering head's saved input stayed
#: in the layers' backward moments; trace, Llama 2 layers hidden 256, fp32, 4 x 256: +0.9%)
HEAD_KEYS = ("final_norm", "lm_head.input", "mlm.transform", "pooler.input", "qa_outputs.input", "derived.head_side",
             "offload.stash_top_input")


@dataclass(frozen=True)
class Detail:
    """What the breakdown of a scalar report needs beyond numbers (not gathered into arrays)."""

    states: States
    layer: LayerCoefs
    outer: tuple[tuple[str, float, float], ...]   # tensors outside the layers: (name, tok, sq)
    comm_name: str
    input_tok: float                              # a layer's input per token (full recompute keeps it)
    received_tok: float = 0.0                     # of the first layer's saved input, the pipeline's receive buffer
    half_input_tok: float = 0.0                   # ... what a half embedding output keeps less (half_embedding_output)
    recompute_ops: int = 0                        # of ``transients``, the last ones: recompute_transients


@dataclass(eq=False)  # not frozen: built once per setup and cached; nothing changes one afterwards
class Quantities:
    """Bytes of one rank for one layout, before batch and sequence are known (see module doc)."""

    fixed: int             # weights + buffers + fp32 master + communication buffers, from load on
    grads: int             # every gradient on this rank (0: freed in backward hooks)
    grads_loaded: int      # gradients that exist from model wrap (Megatron main-grads), else 0
    states: int            # optimizer states + step tensors (created by the first step)
    layer_grads: int       # one layer's gradients
    head_grads: int        # gradients of the head and final norm (first in backward)
    layers: int            # layers on this rank
    pp_inflight: int       # 1F1B keeps min(pp, grad_accum) micro-batches in flight on the first stage (GPipe all)
    fixed_inflight: int    # micro-batches in flight when fixed (else 0)
    saved_tok: float       # one layer, everything autograd saves
    saved_sq: float
    kept_tok: float        # one layer under the recompute policy (full: its input only)
    kept_sq: float
    redo_tok: float        # re-created while one layer is recomputed in backward
    redo_sq: float
    redo_const: int        # that layer's autocast weight copies, under full recompute
    held_tok: float        # KV-cache bytes per token the output holds without autograd (fp32, amp)
    held_b1_tok: float     # ... at a micro-batch of one sequence (layers.Recipe.held_b1)
    cache_tok: float       # the whole KV cache per token
    outer_head_tok: float  # final norm / head input, per token
    outer_rest_tok: float  # embeddings' saved tensors, rotary tables, 4-D mask
    outer_rest_sq: float
    outer_rest_pos: float  # per sequence position, shared by the micro-batch (derived architectures)
    head_loss_tok: float   # per token, alive only while the model's own loss runs (derived architectures)
    cast_layer: int        # autocast half copies of one layer's matmul weights, saved for backward
    cast_head: int         # the head's half copy
    cast_forward_only: int  # full recompute: the layers' copies live only until forward ends
    gathered_layer: int    # FSDP grad-op: one layer's gathered weights, kept from its forward to its backward
    logit_chunks: int      # chunked cross-entropy: chunks of tokens
    logit_width: int       # vocabulary on this rank (LM heads) or labels (classifiers)
    tp: int
    logits_held: int       # bytes per logit element: the output the loop keeps (0: only the loss)
    logits_out: int        # the head's output, alive while the loss runs
    loss_saved: int        # saved by the loss (log-probabilities, nll_loss's fp32 copy)
    loss_forward: int      # the .float() copy alive while log_softmax runs
    loss_backward: int     # gradients alive at the start of backward
    loss_forward_chunk: int   # per element of one loss chunk (chunked / fused losses)
    loss_backward_chunk: int
    loss_saved_tok: int    # bytes per token saved by a fused loss
    loss_saved_const: int  # bytes saved by a fused loss whatever the batch (the head weight's gradient)
    liger_factor: int      # fused: ceil(vocab / hidden), Liger's chunking (0: chunks from logit_chunks)
    step_temp: int         # optimizer.step() temporaries
    oib_mid: int           # optimizer in backward: one update's gradient + temporaries, mid-backward
    oib_end: int           # ... for the embeddings, updated last
    tied_grad: int         # a tied head's gradient waiting in autograd's input buffer
    transients: Any        # per layer-op backward transient: tuple of (a, b, c, g, d, at), or a TransientTable
    logits_cast: int = 0   # --cast-output: the fp32 copy of the head's output (0: fp32 logits, nothing to cast)
    step_events: tuple = ()  # GaLore: a steady step's allocations and frees in order (galore.step_replay)
    step_events_first: tuple = ()  # ... and a projector update's (the replay's first step)
    loss_saves_out: int = 0  # 1: the loss saves the head's output itself (loss_saved is not a new tensor)
    loss_fp32_logits: int = 0  # 1: the model's forward returns fp32 logits and shifts them (``fp32_logits_replay``)
    loss_tt_shift: int = 0  # 1: torchtune < 0.3's loop shifts the fp32 logits and keeps the copy (``reserved._torchtune_loop_loss``)
    loss_logps: int = 0    # 1: --loss logps, TRL's selective_log_softmax (reserved.py replays its backward)
    dpo_reference: int = 0  # --trainer dpo: 1 when a reference forward runs after the policy's log-probs
    dpo_metrics: int = 0    # --trainer dpo: 1, _compute_loss's metrics (both replayed by reserved.py)
    loss_elem: int = 4     # bytes per element of each of the loss's logits-sized tensors (LossBytes.elem)
    cast_output: int = 0   # 1: --cast-output, the loop rebinds its output before its loss (litgpt under Fabric)
    head_wgrad: int = 0    # autocast: the LM head's weight gradient in the half dtype, beside its fp32 cast (head_wgrad)
    fwd_temp: int = 0      # a layer's largest forward transient: a dequantized 4-bit weight (quant4.py)
    fwd_temp_tok: float = 0.0  # ... and its matmul output per token
    fwd_scratch: int = 0   # ... or, torchao NF4, the larger dequantization peak before that output exists
    build_temp: int = 0    # the model build's transients above the model (States.build_temp): model_loaded only
    head_temp: int = 0     # the LM head's dequantized 4-bit weight, in its forward and its backward
    # FSDP over several ranks (``fsdp_buffers``; 0 otherwise), alive only in forward and backward:
    fsdp_root: int = 0        # the root unit's parameters, gathered from forward until backward ends
    fsdp_layer_buf: int = 0   # one layer's all-gathered parameters (FSDP full / hybrid)
    fsdp_rs_buf: int = 0      # one layer's reduce-scatter input, held until the next layer's (FSDP2, torch >= 2.5)
    fsdp_rs_side: int = 0     # ... before 2.5: made on the reduce-scatter stream, freed when the reduce returns
    fsdp_head_full: int = 0   # the head's and final norm's unsharded gradients, until backward ends
    fsdp_emb_full: int = 0    # an untied embedding's unsharded gradient, at its backward
    fsdp_ag_result: int = 0   # FSDP2: the last layer's all-gather output, kept from its forward to the next
    fsdp2_cast_shards: int = 0  # FSDP2 under bf16-mp: the ranks a unit is sharded over (its bf16 all-gather
    #                             input, 1/that of the output, is a copy: reserved._Fsdp.unshard)
    fsdp_root_sharded: int = 0  # of ``grads``: the root's sharded gradients (after the root's reduce-scatter)
    fsdp_root_rs: int = 0     # FSDP2: the root's reduce-scatter input, at its post-backward (end of backward)
    fsdp_root_last: int = 0   # ... and the root's last unsharded gradient, alive until the reduce returns
    fsdp1_post: int = 0       # FSDP1: a layer's gradients in its post-backward hook (fsdp1_post_backward)
    fsdp1_head_wait: int = 0  # FSDP1: the head's unsharded gradient, waiting for the root's flat gradient
    fsdp1_flat: int = 0       # FSDP1: a layer's gradients as its flat gradient is made (fsdp1_flat_gradient)
    fsdp1_init: tuple = ()    # FSDP1: the buffers its lazy init allocates and frees, in order (fsdp1_lazy_init)
    fsdp1_root_raw: int = 0   # FSDP1: the root's padded unsharded flat parameter as requested (fsdp1_flat_bytes)
    fsdp1_mp_shards: int = 0  # FSDP1 under bf16-mp: the ranks a unit is sharded over (its low-precision shard, reserved._Fsdp.unshard)
    fsdp1_hook: tuple = ()    # FSDP1: a layer's post-backward hook's tensors, (request, charge) each (fsdp1_hook_requests)
    fsdp1_root_views: int = 0  # FSDP1: the root's unsharded view gradients at its flat gradient's cat ...
    fsdp1_root_flat: int = 0   # ... and that flat gradient (fsdp1_root_flat_gradient)
    fsdp1_emb_units: int = 0   # FSDP1 --fsdp-auto-wrap-policy module: the embedding units gathered at their backward
    fsdp1_root_post: int = 0   # FSDP1: the root's post-backward beside its flat gradient (fsdp1_root_post_backward)
    fsdp1_root_cast: int = 0   # ... of which its flat gradient's fp32 copy under bf16-mp, as asked for (fsdp1_root_cast)
    fsdp1_head_unit: int = 0   # FSDP1 --fsdp-auto-wrap-policy module: the final norm and head units gathered ...
    fsdp1_head_in_tok: float = 0.0  # ... at the head's backward, beside its input's gradient (per token)
    fsdp1_head_post: int = 0   # ... and what the head unit's post-backward allocates beside its flat gradient
    # FSDP accumulating unsharded gradients (no_sync, ``fsdp_no_sync``): what one layer's and all the
    # rank's gradients shrink by when the step's last micro-batch reduce-scatters them to shards ...
    fsdp_accumulates: int = 0  # 1 where FSDP accumulates unsharded (no_sync), else 0
    fsdp_mp_new: int = 0       # 1 where FSDP2 accumulates in fp32 beside each micro-batch's new bf16 gradients
    nosync_layer_reduce: int = 0
    nosync_reduce: int = 0
    # ... and, under FSDP1's SHARD_GRAD_OP, a layer's and the root's parameters kept gathered after a no_sync backward
    nosync_kept_layer: int = 0
    nosync_kept_root: int = 0
    fsdp1_unprefetched: int = -1  # FSDP1, LoRA units of their own: layer ops from this one on (forward
    #                               order) run their backward before the previous layer is prefetched
    fsdp1_host_shards: int = 0    # FSDP1 parameter offload: the ranks a unit is sharded over (its shard is
    #                               copied to the device before each all-gather: reserved._Fsdp.unshard); 0 off
    fsdp1_held_inputs: int = 0    # 1 where FSDP1's reshard-only hooks hold every layer's input and its gradient
    #                               to the end of backward (reentrant checkpointing, frozen layer units)
    fsdp1_adapter_units: int = 0  # FSDP1, LoRA units of their own: a layer's adapter units (lora_A, lora_B each),
    #                               each unsharded and resharded through FSDP1's rate limiter (reserved._Fsdp)
    lower_layers: int = 0  # an encoder-decoder's encoder layers on this rank (backward after the decoder's)
    above_bottom: int = 0  # gradient bytes of the layers above the bottom one (made before its backward)
    above_decoder_bottom: int = 0  # ... above an encoder-decoder's decoder-bottom layer
    outer_rest_ssq: float = 0.0  # per sequence position squared, shared by the micro-batch (T5's position buckets)
    outer_rest_b: float = 0.0  # per sample, whatever the sequence (derived.outer_per_sample: an encoder head's)
    outer_rest_const: float = 0.0  # bytes whatever the batch and sequence (derived.outer_const: an encoder head's)
    loss_backward_tok: float = 0.0  # per token, alive at the start of backward (--compile: the KV cache's zero gradients)
    # TRL's chunked_nll (``loss_bytes``): tokens per chunk (0: another loss), and its forward's matmul
    # moment (the head weight's cast, then the chunk's logits) and its backward's constant
    loss_chunk_tokens: int = 0
    loss_matmul_const: int = 0
    loss_chunk_const: int = 0   # fused: alive beside a chunk's logits at its weight-gradient moment (LossBytes.chunk_const)
    # fused: (weight.t()'s uncached copy, the cached copy, mm's output, its .float(), per chunk logit, the half
    # dtype's bytes) for the allocator replay (fused_linear_ce_parts); () for other losses
    fused_parts: tuple = ()
    loss_matmul_chunk: int = 0
    loss_backward_const: int = 0
    loss_backward_more: int = 0
    # Unsloth's fused loss (``_unsloth_loss_bytes``): per token of one chunk beside its logits (the compiled
    # chunk's (N, h) input gradient), and 1 where it is the loss (the allocator replay's order)
    loss_chunk_tok: float = 0.0
    unsloth_loss: int = 0
    tied_compiled: int = 0  # --compile: a tied embedding's backward tables (compiled_tied_grads)
    tied_final: int = 0     # --compile: ... and its gradient in the weight's dtype (in ``grads``, made last)
    input_tok: float = 8.0  # the input batch per token: int64 ids, or an image model's pixel values per patch
    input_sample: int = 0   # ... less this per sample (an image model's class tokens have no pixels)
    input_pixels: int = 0   # a vision-language model's pixel values per sample, a tensor of their own (fp32)
    embeds_tok: float = 0.0  # the base model's embedding output held, unsaved, until it returns (held_embeddings)
    # an encoder-decoder's decoder tokens per encoder token, dec_num / dec_den (``derived.decoder_ratio``):
    # its labels and logits are (b, target_len), b*s * dec_num // dec_den tokens
    dec_num: int = 1
    dec_den: int = 1
    # a derived encoder-decoder's activations alive at its bottom and decoder-bottom backward moments
    # (``derived.moment_activations``): per token, per token x key, per position, per position squared
    head_fwd_tok: float = 0.0  # a derived image model's head forward beyond its saved tensors (derived.head_forward)
    # a derived encoder head's two top-forward moments (derived.top_forward), the higher counted: per token, per
    # token x key, per position, per sample, per position pair
    head_fwd_sq: float = 0.0
    head_fwd_pos: float = 0.0
    head_fwd_b: float = 0.0
    head_fwd_ssq: float = 0.0
    head_fwd2_tok: float = 0.0
    head_fwd2_sq: float = 0.0
    head_fwd2_pos: float = 0.0
    head_fwd2_b: float = 0.0
    head_fwd2_ssq: float = 0.0
    final_norm_bwd_tok: float = 0.0  # a classifier's final RMSNorm backward beyond the saved tensors (final_norm_backward)
    final_norm_fwd_tok: float = 0.0  # ... and its forward beyond them (final_norm_forward)
    bert_top_fwd_tok: float = 0.0  # a BERT classifier's last LayerNorm forward beyond the saved tensors (bert_top_forward)
    # gradient storages beyond the gradients after backward (derived.grad_views: ViT's class token at
    # micro-batch 1 keeps the (1, s, hidden) embedding gradient): per token, per position, constant
    grad_view_tok: float = 0.0
    grad_view_pos: float = 0.0
    grad_view_const: float = 0.0
    bottom_tok: float = 0.0
    bottom_sq: float = 0.0
    bottom_pos: float = 0.0
    bottom_ssq: float = 0.0
    decb_tok: float = 0.0
    decb_sq: float = 0.0
    decb_pos: float = 0.0
    decb_ssq: float = 0.0
    # a speech encoder-decoder's (Whisper's) decoder embedding backward (derived.decoder_embedding_activations):
    # the activations alive there (per token, per token x key, per position, per position squared) and the
    # gradients made by then when fresh (the decoder's layers and tables, the head's)
    decemb_tok: float = 0.0
    decemb_sq: float = 0.0
    decemb_pos: float = 0.0
    decemb_ssq: float = 0.0
    decemb_temp_tok: float = 0.0  # ... its backward temporaries beyond the tied table's (derived.decoder_embedding_temporaries)
    decoder_grads: int = 0
    head_read: int = 0     # ... of it, the copy its matmul reads (the cast, else the dequantized weight)
    head_lora: int = 0     # a LoRA adapter on that 4-bit head: logits-sized tensors alive in its forward (3)
    step_groups: int = 1   # a foreach step's temporaries: how many per tensor, all alive at once (``foreach_groups``)
    step_linger: bool = False  # a per-tensor loop keeps each tensor's last temporary until the next's (``step_lingers``)
    step_adafactor: tuple = ()  # transformers' Adafactor, tensor by tensor (``adafactor_loop``); () otherwise
    ds_backward_buf: int = 0  # DeepSpeed ZeRO-1/2's gradient bucket buffers, alive during backward (``deepspeed_buckets``)
    ds_loss_buf: int = 0      # ... of them, those alive in the loss's and the head's backward (before v0.18.3)
    ds_bucket: int = 0        # one DeepSpeed bucket buffer (ZeRO-3's is kept from engine start, in ``fixed``)
    ds_step_fp32: int = 0     # DeepSpeed's step: the group's fp32 gradient (``deepspeed_step_grad``) ...
    ds_fp32_convert: int = 0  # DeepSpeed ZeRO-3's init: the fp32 copy its master is cloned from (``deepspeed_fp32_convert``)
    ds_fp32_group: int = 0    # ... an fp32 engine's: the elements of its largest sub-group, cloned as is (``deepspeed_fp32_group``)
    ds_init_grads: int = 0    # ... its flat gradient partition buffer, made in its ``__init__`` (``deepspeed_init_grads``)
    ds_offload_buf: int = 0   # DeepSpeed ZeRO-1/2 offloading the optimizer: its GPU gradient buffer (``deepspeed_offload_grad_buffer``)
    ds_partition: int = 0     # DeepSpeed ZeRO-3: elements of this rank's flat fp32 partition, all sub-groups (``deepspeed_partition_elems``)
    ds_step_flat: int = 0     # ... and the flat copy in the gradient dtype beside it during the cast
    ds_gathered_top: int = 0  # DeepSpeed ZeRO-3's gathered parameters at the top layer's backward
    ds_gathered_head: int = 0  # ... from forward's end through the head's backward (``deepspeed_gathered_head``)
    ds_gathered_fwd: int = 0  # ... at the top layer's forward, with the prefetch's flat output (``deepspeed_gathered_forward``)
    ds_head_wgrad: int = 0    # DeepSpeed ZeRO-3: an untied head's whole weight gradient at its backward (``deepspeed_head_wgrad``)
    ds_gathered_low: int = 0  # ... in the rest of backward (``deepspeed_gathered``)
    ds_gathered_emb: int = 0  # ... at the embedding's backward, the last module's (``deepspeed_gathered_embedding``)
    ds_coalesced: int = 0     # ... and the flat all-gather output of the prefetch in flight at the top
    #                           layer's forward, steps after the first (``deepspeed_coalesced``)
    ds_reduce_cat: int = 0    # ... the reduce-scatter's flat input of its largest reduction (``deepspeed_reduce_cat``)
    ds_reduce_cats: tuple = ()  # ... and of each bucket's, in backward order (``deepspeed_reduce_cats``)
    ds_leaf_held: tuple = (-1, 0)  # ... a leaf MoE block's down gradient alive at gate/up's backward (``deepspeed_leaf_held``)
    ds_layer_params: tuple = ()  # ZeRO-3 over several ranks: one layer's parameters, whole (elements), in
    #                              module order: each gathered at its module (``deepspeed_layer_params``)
    ds_param_bytes: int = 0   # ... bytes per element of a gathered parameter (the engine's dtype)
    ds_events: tuple = ()     # ... the coordinator's gathers and releases at each module fetch, first step and
    #                           after (``deepspeed_gather_events``; () where not replayed: ``ds_layer_params``)
    ds_prefetch: int = 0      # ... stage3_prefetch_bucket_size (elements; 0: no prefetch)
    ds_max_live: int = 0      # ... stage3_max_live_parameters (elements; ``DS_MAX_LIVE``)
    ds_emb_numel: int = 0     # ... the input embedding's elements, gathered at its forward
    ds_layers_kept: int = 0   # ... the top layers kept gathered from their forward to their backward once the
    #                           module order is recorded (``deepspeed_layers_kept``)
    ds_streams: int = 0       # 1: ZeRO-3 under overlap_comm: fetches on its all-gather stream, reductions on its own
    ds_emb_kept: int = 0      # 1: ZeRO-3 keeps the embedding gathered from its forward to its backward (``deepspeed_embedding_kept``)
    ds_norm_fp64: int = 0     # ZeRO-3's step, which takes each gradient partition's norm on a float64 copy:
    #                           bytes per gradient element (0 off ZeRO-3 on the device; ``reserved._zero3_step``)
    ds_offload_steps: tuple = ()  # ZeRO-1/2 offloading the optimizer: each of rank 0's gradients' float64 norm
    #                               copy, inf/NaN check and fp32 copy for the host at the boundary, raw bytes of
    #                               each step's tensors (``deepspeed_offload_epilogue``, ``reserved._offload_epilogue``)
    ds_partition_grads: int = 0  # DeepSpeed ZeRO-2's gradient partition when a reduction in backward makes it
    ds_partition_from: int = 3   # ... which backward moment it exists from (``deepspeed_partition_from``)
    ds_emb_grads: int = 0        # ... the gradients beside the word embedding's (``deepspeed_grads_at_embedding``)
    ds_accumulated: int = 0      # ZeRO-2: the earlier micro-batches' partition gradients (``all_grad_tensors``)
    ds_offload_clone: int = 0    # ZeRO-1/2 offloaded: the half clone of the partition at init (``deepspeed_offload_clone``)
    ds_offload_upload: int = 0   # ... (before v0.17.0) the fp32 partition copied to the GPU at each step
    #                              (``deepspeed_offload_upload``)
    ds_flat_group: int = 0       # ZeRO-1/2 (v0.19.0+): the flat half group made on the GPU beside the parameters
    #                              at init (``deepspeed_flat_on_gpu``; 0 where it goes to the host, ``without_gpu_flatten``)
    ds_flat_temp: int = 0        # ... its bytes above ``model_loaded``'s end: ``ds_flat_group`` - master - comm
    ds_flat_frees: int = 0       # 1: ... every weight is in it, so the parameters' own blocks are freed after it
    ds_flat_need: int = 0        # ... the free bytes it needs beside the CUDA context: loaded weights, buffers, group
    ds_epilogue_cats: tuple = ()  # ZeRO-1/2: the flat copies the epilogue's reduction of the last bucket makes
    #                              (bytes each, ``deepspeed_epilogue_cats``)
    ds_keeps_sum: int = 0        # 1: ZeRO-2 without contiguous gradients keeps a tied embedding's summed gradient
    #                              whole until the step (``deepspeed_keeps_tied_sum``)
    ds_host_grads: int = 0       # 1: ZeRO-2 offloaded: an earlier micro-batch's gradients are on the host,
    #                              none on the GPU (``deepspeed_grads_on_host``)
    ds_kept_buf: int = 0         # ZeRO-1 under accumulation: the buckets kept from one micro-batch to the next
    ds_reduce_grads: int = 0     # ZeRO-1/2's last reduction after backward: the gradients ...
    ds_reduce_flat: int = 0      # ... and the flat copy of the bucket (``deepspeed_epilogue``)
    ds_bucketed: int = 0      # 1: DeepSpeed ZeRO-1/2's hooks reduce buckets in backward (``deepspeed_hooks_reduce``)
    ds_norm_temp: int = 0     # DeepSpeed ZeRO-1/2's step: the float64 copy of one gradient piece its norm takes
    ds_flat12: int = 0        # DeepSpeed ZeRO-1/2 on the GPU, flat master and states: its partition's elements (``deepspeed_flat12``)
    ds_clone12: int = 0       # ... the half clone of its partition the master is cast from at init (``deepspeed_clone12``)
    ds_epilogue_part: int = 0  # ZeRO-1: ``grads_in_partition`` made by backward's epilogue (``deepspeed_epilogue_partition``)
    ds_hook_part: int = 0     # ZeRO-1/2 reducing in its hooks: ``grads_in_partition`` (``deepspeed_hook_partition``) ...
    ds_hook_at: int = -1      # ... the backward moment it is made at (``deepspeed_partition_from``: PARTITION_*)
    ds_reduce_side: int = 0   # ... 1: made on the reduction stream (``overlap_comm``), 0: the default stream
    ds_linear_wrap: int = 0  # 1: DeepSpeed ZeRO-3's linears run through its ``zero3_linear_wrap``
    #                          (``deepspeed_linear_wrap``)
    ds_linear_kept: int = 0  # DeepSpeed ZeRO-3 with torch's F.linear: one layer's gathered matmul weights its
    #                          autograd keeps from its forward to its backward (``deepspeed_linear_kept``)
    ds_offload_grad: int = 0  # DeepSpeed ZeRO-1/2 offloaded: the gradient of rank 0's largest parameter, own tensor,
    ds_offload_check: int = 0  # ... and its largest step's tensors (``deepspeed_offload_check``, ``deepspeed_offload_steps``)
    ds_head_grad: int = 0     # ... the untied head's gradient, own tensor, when its bucket is reduced at the top of
    ds_head_check: int = 0    # backward, and its largest step's tensors, on the rank that holds it (``deepspeed_offload_check_head``)
    ds_cast_grads: int = 0    # DeepSpeed's step: the gradients alive while the fp32 gradient is cast (``deepspeed_partition_grads``)
    ds_opt_grads: int = 0     # ... and while the optimizer steps (ZeRO-3's persistent partition; none for stages 1, 2)
    gemini_top: int = 0       # ColossalAI Gemini: other ranks' fp16 chunks gathered and the gradient hook's two
    gemini_low: int = 0       # copies, in the top layer's backward / any other layer's (``gemini_fields``)
    graph_tok: float = 0.0  # per layer, saved bytes per token the graph keeps until it is freed (bnb < 0.43.2)
    graph_extra_tok: float = 0.0  # ... of it, per layer on average, not among the kept activations (checkpointed)
    pipe_batch: int = 0    # 1: torch's pipeline schedule takes the whole step's batch (every micro-batch's ids, labels)
    # a pipeline's last stage, full recompute under autocast: the layers' cached half weight copies, alive
    # until the stage forward's autocast region closes, before the loss (loss_after_stage_forward)
    cast_stage_only: int = 0
    pipe_recv: int = 0     # torch's pipeline receive buffers per micro-batch on this stage (pipeline_buffers)
    pipe_buf_tok: float = 0.0  # ... bytes per token of one
    pipe_sent_tok: float = 0.0  # 1F1B, a later stage: the previous micro-batch's input gradient its send ops hold
    # interleaved 1F1B (several stages per rank, ``--pp-schedule interleaved-1f1b``): ``layers`` is one
    # stage's and a "micro-batch in flight" one (stage, micro-batch) pair (schedules.in_flight_at_backwards)
    pipe_units: int = 0        # pairs in flight at the rank's first backward (0: not interleaved)
    pipe_units_later: int = 0  # ... the most at a later one
    pipe_fed: int = 0          # ... of them, pairs of a stage fed by a receive buffer (not the model's first)
    pipe_fed_later: int = 0
    pipe_grads_absent: int = 0  # ... the gradients of its stages not yet back-propagated at the later one
    pipe_units_alt: int = 0     # another later backward (the most gradients), its pairs in flight ...
    pipe_fed_alt: int = 0
    pipe_grads_absent_alt: int = 0
    pipe_head_once: int = 0    # 1: the last rank, whose head stage holds one micro-batch in flight; the others ...
    pipe_out_tok: float = 0.0  # ... keep their stage's output (b, s, h), bytes per token
    # torch's interleaved schedule, the last rank: its actions in order, (F or B, local stage, micro-batch)
    # (schedules.rank_order), which the allocator replay walks (reserved._pipeline_pairs); () elsewhere
    pipe_order: tuple = ()
    # 1: torch's pipeline, the last stage of a tied model: its head is its own copy of the embedding table
    # (``states._Rank.holds``, listed before the layers), whose gradient the head's backward makes
    pipe_head_tied: int = 0
    # the head side's gradients its backward makes, one copy each (``head_added_grads``): beside an existing
    # ``.grad`` until AccumulateGrad adds them (a later micro-batch, ``zero_grad(set_to_none=False)``)
    head_added: int = 0
    # stages this rank holds (interleaved: virtual_stages). Under FSDP grad-op each layer of each is
    # gathered once, however many micro-batches are in flight (torch 2.13 _fully_shard/_fsdp_param_group.py
    # ``unshard`` returns when the parameters are unsharded), all forwarded before the rank's first backward
    pipe_stages: int = 1
    # ... while the loss and its backward run: the root and the prefetched last layer, or nothing when
    # the loop computes the loss after FSDP2 resharded the root (``root_resharded_for_loss``)
    fsdp_loss_root: int = 0
    fsdp_loss_buf: int = 0
    fsdp_root_regather: int = 0  # ... then the root gathered again (its all-gather buffer and parameters)
    fsdp_root_regather_own: int = 0  # FSDP2 full, the model's own loss: the root gathered again at its first node
    fsdp_pipe_top: int = 0  # pipeline first stage, FSDP2 full: its top layer gathered first (pipeline_top_first)
    pipe_kept_layer: int = 0  # pipeline stage, FSDP2 full: a back-propagated layer kept gathered (pipeline_kept_layer)
    fsdp_loss_ag: int = 0     # FSDP2: the last layer's all-gather output while the loss runs (model's own loss)
    fsdp_root_kept: int = 0   # the root's gathered parameters between forward and backward (not resharded)
    fsdp_last_kept: int = 0   # FSDP2 --fsdp-gathered root-last: the last layer's, from its forward to its backward
    # FSDP2 --fsdp-gathered head (torchtitan's units since July 2025, ``fsdp2_split_root``; 0 otherwise):
    fsdp_emb_unit: int = 0    # the embedding unit gathered: its all-gather output at the first layer's forward
    #                           unshard and prefetched at the first layer's backward, its parameters at its own
    fsdp_head_unit: int = 0   # the [norm, head] unit's all-gather output, while the head's forward runs
    fsdp_head_pref: int = 0   # the last layer's all-gather output, prefetched at the logits' gradient
    fsdp_head_done: int = 0   # the head's unsharded gradients, reduce-scattered by its unit's post-backward
    fsdp_head_shard: int = 0  # ... into its sharded gradients (of ``grads``)
    fsdp_head_rs: int = 0     # ... its reduce-scatter input, kept until the last layer's post-backward
    fsdp_head_last: int = 0   # ... and the head's unsharded gradient, alive until that reduce returns
    cast_embed: int = 0    # the half weight copies of the matmuls before the layers (``_autocast_copies``)
    # checkpointed layers' autocast weight copies: none saved. autocast caches the cast of a leaf that
    # requires grad until forward ends (``cast_forward_only``); a frozen one (LoRA's base weights) is
    # not cached (``autocast_mode.cpp`` ``cached_cast``), so its copy dies with the checkpointed op
    cast_checkpointed: int = 0
    # LoRA: what the first layer does not save (its input needs no gradient; ``first_layer_unsaved``)
    first_unsaved_tok: float = 0.0
    first_unsaved_sq: float = 0.0
    cast_first_free: int = 0  # ... and the half weight copies of its frozen linears on that input
    tied_replicated: int = 0  # DTensor TP: the tied embedding's whole-vocabulary gradient at its backward
    emb_grad: int = 0      # an untied embedding's new gradient, added to the accumulated .grad (emb_accumulated)
    emb_upcast: int = 0    # ... and in a step's first micro-batch, beside its fp32 copy (FSDP2 bf16-mp, emb_upcast)
    chunk_head_grads: int = 0  # chunked output loss: the head's per-chunk weight gradients being summed
    # autocast, a trainable head: its weight gradient in the compute dtype (``head_weight_grad_half``)
    head_wgrad_half: int = 0
    # 1: the head's output linear has a bias, so its backward computes the input's gradient before the
    # weight's (``head_input_grad_first``; the replay's autograd workspace comes between them)
    head_input_first: int = 0
    head_side: tuple = ()  # bytes per token of each head-side saved tensor, in order (``head_side_tensors``)
    linear_replay: int = 0  # 1: the allocator replay makes each linear's blocks in turn (``per_linear_replay``)
    # ... and the bytes per logit element a final soft-cap's tanh saves (part of the derived head side),
    # freed chunk by chunk before that chunk's head backward (``softcap_saved``)
    softcap_saved: int = 0
    expandable: int = 0  # 1: the allocator runs with expandable segments (TrainingSpec.expandable_segments)
    ddp_side: int = 0    # 1: DDP built on a side stream (TrainingSpec.ddp_init_stream, reserved._ddp_side_stream)
    trainer_cp: int = 1  # the context-parallel ranks of the Trainer's sharded buffers (trainer_cp_inputs); 1 none
    detail: Detail | None = None


@dataclass(frozen=True)
class TransientTable:
    """Backward transients of many layouts: (layouts x ops) arrays, padded with ``pad`` = NEVER:
    ``a * b*s + b * b*s^2 + c + d * s^2 + g`` bytes (``d``: tensors shared by the micro-batch), at the
    backward moments ``at`` names (a bit mask of ``layers.TOP``, ``BOTTOM``, ``DECODER_BOTTOM``);
    ``e * b*s`` less at the top layer of a stage fed its output gradient (``_layer_transients``)."""

    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    g: np.ndarray
    pad: np.ndarray
    d: np.ndarray
    at: np.ndarray
    e: np.ndarray


# ----------------------------------------------------------------------------------------------
def act_impl(m: ModelSpec) -> str:
    """The MLP activation's implementation: ``gelu_new`` (tanh formula in Python ops) or fused."""
    cfg = m.config or {}
    a = str(cfg.get("activation_function") or cfg.get("hidden_act") or "gelu").lower()
    if m.family == "nanogpt":
        return "gelu"  # nn.GELU(): fused
    return "gelu_new" if a == "gelu_new" else "gelu"


def layer_key(m: ModelSpec, t: TrainingSpec) -> LayerKey:
    """Everything ``layers.layer_coefficients`` needs about the model and the setup."""
    lora = ()
    if t.lora_rank:
        targets = set(t.lora_targets or default_lora_targets(m))
        lora = tuple((p.module, t.lora_rank, 1) for p in m.parameter_tensors()
                     if p.layer == 0 and p.is_matmul and p.module in targets)
    release = code_release(t.transformers_release)  # the transformers code the run executes
    return LayerKey(m.family, act_impl(m), t.precision, t.attention, t.dropout, m.hidden_dropout,
                    m.attention_dropout, m.hidden_size, m.ffn_size, m.q_size, m.kv_size, m.num_heads,
                    m.num_kv_heads, m.head_dim, t.tp, t.sequence_parallel, t.sequence_parallel and dtensor_tp(t),
                    m.num_experts,
                    m.experts_top_k, m.pre_norm, lora, t.lora_dropout if lora else 0.0,
                    bool(lora) and adapters_computed_half(t),
                    (*dequant_dtypes(t), dequant_scratch(t)) if t.quantize else (0, 0, 0),
                    t.bnb_saves_input, t.checkpoint_reentrant,
                    kv_cache(m, t), biased=biased_linears(m) if t.recompute == "op" else (), ep=t.ep,
                    ep_rows=ep_rank_rows(m.experts_top_k, m.num_experts, t.ep, t.moe_imbalance) if t.ep > 1 else 0.0,
                    compiled=t.compile, lora_base_trains=bool(lora) and t.fsdp_mixed_units,
                    softmax_saves_input=t.softmax_saves_input, attention_call=release_attention_call(m, t),
                    math_upcast=t.math_sdpa_upcasts,
                    eager_clamp=t.attention == "eager" and eager_clamp(m, t.transformers_release),
                    cache_values_own_dtype=cache_values_own_dtype(release), cache_kind=kv_cache_kind(release),
                    rotary_keys_half=rotary_keys_half(m, release), ring=t.cp if torch_cp(t) else 1,
                    qk_norm=m.qk_norm, rms_norm_input=t.rms_norm == "input", liger=t.liger,
                    unsloth=t.unsloth_kernels, expert_loop=bool(m.num_experts) and moe_expert_loop(m, release),
                    norm_fp32_product=torchtune_norm_saves_fp32(m, t), manual_layernorm=m.manual_layernorm,
                    separate_qkv=m.separate_qkv, quant_nested=bool(t.quantize) and t.quantize.endswith("-dq"),
                    quant_bnb=bool(t.quantize) and t.quantize_via != "torchao",
                    model_code=model_code(t))


def model_code(t: TrainingSpec) -> str:
    """Whose code a layer runs: the framework that re-implements the model
    (``spec.frameworks.OWN_MODEL_CODE``: torchtune, torchtitan, litgpt...), else "transformers"."""
    framework = t.extra.get("framework")
    return framework if framework in OWN_MODEL_CODE else "transformers"


def release_attention_call(m: ModelSpec, t: TrainingSpec) -> str:
    """How the layer calls SDPA: ``t.attention_call``, or "repeat-kv" where the run's transformers
    release copies grouped keys and values to the query's heads before the call
    (``spec.tf_releases.sdpa_repeats_kv``: before 4.54), which is litgpt's call's memory."""
    if t.attention_call == "model" and t.attention.startswith("sdpa") and m.num_heads != m.num_kv_heads \
            and sdpa_repeats_kv(m, t.transformers_release):
        return "repeat-kv"
    return t.attention_call


def biased_linears(m: ModelSpec) -> tuple[str, ...]:
    """The modules of a layer whose linear has a bias: ``at::linear`` runs them as ``addmm``, the
    others as ``mm`` (which torchtitan's per-op checkpointing policy counts, ``layers.op_checkpoint_saved``)."""
    return tuple(sorted({p.module for p in m.parameter_tensors() if p.layer == 0 and p.role == "bias"}))


def kv_cache(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether the forward builds a KV cache: transformers' decoder models create a
    ``DynamicCache`` whenever ``config.use_cache`` (default True) is set, in training too, except
    under gradient checkpointing (``merge_with_config_defaults`` turns it off); its ``torch.cat``
    copies of each layer's keys and values are what attention then consumes. Megatron-style
    tensor/pipeline/context parallel code has no such cache; PyTorch's tensor parallelism runs the
    transformers model itself (``states.dtensor_tp``), whose cache then holds each rank's own heads,
    and so does PyTorch's context parallelism (``states.torch_cp``), whose cache holds the rank's own
    tokens' keys and values (the ring gathers the others' into buffers of its own). A decoder's
    classifier and question-answering heads run the same base model with the config's
    ``use_cache`` (transformers 5.24 gpt2/modeling_gpt2.py L882-906, GPT2ForSequenceClassification
    passes ``use_cache=None`` on to GPT2Model, which builds the cache at L561-563); encoders have none."""
    if t.recompute in ("full", "op") or t.pp > 1 or (t.cp > 1 and not torch_cp(t)) \
            or (t.tp > 1 and not dtensor_tp(t)):
        return False
    if m.head not in ("causal-lm", "seq-cls", "qa") or m.family in ("nanogpt", "bert", "roberta-prenorm"):
        return False
    return config_use_cache(m.config, t)


def loss_upcasts(m: ModelSpec) -> bool:
    """Whether the model's loss upcasts half logits to fp32 first.

    transformers' causal-LM heads call ``ForCausalLMLoss`` (``logits.float()``). Its masked-LM heads
    (``BertForMaskedLM``, ``XLMRobertaXLForMaskedLM``) call ``CrossEntropyLoss()`` on the logits
    as they are, and so does nanoGPT (``F.cross_entropy``): in pure bf16 the log-probabilities and
    both loss gradients stay bf16; under autocast ``cross_entropy`` has no autocast rule, so
    ``log_softmax`` keeps the half dtype and ``nll_loss`` (fp32 list) saves an fp32 copy.
    """
    return m.head in ("causal-lm", "vlm") and m.family != "nanogpt"


def is_lm(m: ModelSpec) -> bool:
    """A language-model head (logits over the vocabulary per token; an encoder-decoder's per
    decoder token)."""
    return m.head in ("causal-lm", "masked-lm", "seq2seq-lm", "speech-seq2seq", "vlm")


def classifier_width(m: ModelSpec, t: TrainingSpec) -> int:
    """Logits per sample of a classifier head: its labels, or for extractive question answering two
    classifications over the sequence's positions, ``start_logits`` and ``end_logits`` of (b, s)
    each, whose cross-entropies are averaged (transformers 5.24 bert/modeling_bert.py L1331-1351,
    ``BertForQuestionAnswering.forward``: ``logits.split(1, dim=-1)``, ``squeeze(-1).contiguous()``,
    ``CrossEntropyLoss(ignore_index=ignored_index)`` on each)."""
    return 2 * t.seq_len if m.head == "qa" else m.num_labels


def input_bytes(m: ModelSpec, t: TrainingSpec) -> tuple[float, int]:
    """The input batch as (bytes per token, bytes less per sample): int64 token ids, or an image
    model's pixel values (b, channels, N, N) in the weights' dtype (``workload.model_batch``):
    channels x patch^2 values per patch token, none for its class tokens; a speech seq2seq model's
    (Whisper's) log-mel ``input_features`` (b, num_mel_bins, 2 * max_source_positions) in the weights'
    dtype: 2 x num_mel_bins values per encoder position (``workload.model_batch``)."""
    if getattr(m, "is_speech_seq2seq", False):
        return float(2 * m.mel_bins * (2 if t.precision in ("bf16", "fp16") else 4)), 0
    if m.is_vlm:  # ids and labels, and Qwen2-VL's ``mm_token_type_ids`` or Gemma 3's ``token_type_ids`` (b, s)
        return (16.0 if m.model_type != "llava" else 8.0), 0
    if not m.is_image:
        return 8.0, 0
    per_patch = m.num_channels * m.patch_size ** 2 * (2 if t.precision in ("bf16", "fp16") else 4)
    return float(per_patch), per_patch * m.class_tokens


def vlm_pixel_bytes(m: ModelSpec, t: TrainingSpec) -> int:
    """A vision-language model's ``pixel_values`` per sample (``spec.vision.image_batch``), fp32 as its
    processor returns them and the HF Trainer moves them (no cast without DeepSpeed): ``--images`` x
    Qwen2-VL's (S/14)^2 patches of 3 x 2 x 14 x 14 values, or LLaVA's and Gemma 3's 3 x S x S; 0 for other
    models. (Qwen2-VL's ``image_grid_thw``, [images, 3] int64, one 512-byte block on a GPU, stays on the host
    in trace: not counted.)"""
    if not m.is_vlm:
        return 0
    from ..spec.vision import vision_inputs
    vis = vision_inputs(m.config)
    side = vis.side(t.image_size)
    per = vis.patches(t.image_size) * vis.channels * vis.temporal * vis.patch ** 2 if vis.kind == "patches" \
        else vis.channels * side * side
    return t.images * per * 4


def trainer_cp_inputs(m: ModelSpec, t: TrainingSpec) -> int:
    """The context-parallel ranks when the batch is the one transformers' Trainer shards for PyTorch's
    ``context_parallel`` (a transformers causal LM, ``states.torch_cp``: ``moments._input_blocks``), else 1."""
    if not torch_cp(t) or m.head != "causal-lm" or t.extra.get("framework") in OWN_MODEL_CODE:
        return 1
    return t.cp


def outer_tensors(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> tuple[tuple[str, float, float], ...]:
    """Tensors saved outside the layers, for one micro-batch on this rank: (name, bytes per token,
    bytes per token x key). Sequence parallelism splits the tokens of the replicated regions."""
    h, sp = m.hidden_size, (t.tp if t.sequence_parallel else 1)
    out: list[tuple[str, float, float]] = []
    if t.pp == 1 or stage == "first":
        out += _embedding_side(m, t, pol, h, sp)
    if t.pp == 1 or stage == "last":
        out += _head_side(m, pol, h, sp, fused=is_lm(m) and loss_mode(m, t) in ("fused", "chunked-nll", "unsloth"), quant_head=_quant_head(m, t),
                          frozen=bool(t.lora_rank), head_adapted=_head_is_lora_target(m, t),
                          rms_input=t.rms_norm == "input", norm_fp32=torchtune_norm_saves_fp32(m, t),
                          liger=t.liger or t.unsloth_kernels)  # (Unsloth's final norm: Fast_RMS_Layernorm, Liger's set)
        if offload_stash_keeps_top_input(t):
            out.append(("offload.stash_top_input", h * pol.stream / sp, 0.0))
    elif torch_pipeline(t):
        # the stage's output (b, s, h), residual dtype: torch's PipelineStage keeps it in ``fwd_cache``
        # from the micro-batch's forward to its backward (torch 2.13 distributed/pipelining/stage.py
        # ``forward_one_chunk`` stores ``(output_tuple, input_values)``, ``backward_one_chunk`` pops it);
        # on one GPU it is the final norm's saved input, counted on the last stage. Found by trace:
        # llama-3.2-1b (4 layers) --pp 2, fp32, first stage -1.8% before
        out.append(("pipeline.stage_output", h * pol.stream / sp, 0.0))
    return tuple(out)


def pipeline_buffers(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> tuple[int, float]:
    """torch.distributed.pipelining's receive buffers of one stage: (how many per micro-batch, bytes
    per token of one). ``PipelineStage`` allocates, when the schedule first runs, one buffer per
    micro-batch of the step for each tensor it receives, and keeps them for the schedule's life
    (torch 2.13 ``stage.py`` ``_setup_forward_recv_info``: every stage but the first receives its
    input activations, ``_make_tensor_from_meta`` for each ``chunk_id in range(num_microbatches)``;
    ``_setup_backward_recv_info`` / ``_create_grad_recv_info``: every stage but the last receives
    the gradient of its output). Each is a (b, s, h) tensor of the residual stream's dtype (the
    hidden states between stages). Not Megatron's (``states.torch_pipeline``)."""
    if not torch_pipeline(t):
        return 0, 0.0
    # (the input gradient a later stage sends back is a tensor of the same kind: under 1F1B the list of
    # send ops holding it, ``bwd_sends`` in ``Schedule1F1B._step_microbatches``, is rebound only after
    # the next micro-batch's backward: ``Quantities.pipe_sent_tok``, moments.tokens)
    # interleaved: each of the rank's ``virtual_stages`` stages has its own; only the model's first stage
    # receives no activations and only its last no gradient
    count = 2 * t.virtual_stages - (stage == "first") - (stage == "last")
    return count, m.hidden_size * pol.stream / (t.tp if t.sequence_parallel else 1)


def _embedding_side(m: ModelSpec, t: TrainingSpec, pol: Policy, h: int, sp: int) -> list[tuple[str, float, float]]:
    drop = t.dropout and m.hidden_dropout > 0
    out = [("inputs_embeds", 0.0, 0.0)]
    if m.family in ("gpt2", "nanogpt", "roberta-prenorm") and drop:
        out.append(("embeddings.dropout.mask", h / sp, 0.0))                  # bool (b, s, h)
    if m.family == "bert":
        out.append(("embeddings.LayerNorm", (h * pol.stream + 8) / sp, 0.0))  # input + fp32 mean/rstd
        if drop:
            out.append(("embeddings.dropout.mask", h / sp, 0.0))
    if m.position == "rotary":
        # cos and sin in the residual dtype, shared by every layer's rotary mul: (1, s, head_dim), as
        # transformers builds the position ids for the sequence (``cache_position.unsqueeze(0)``), so
        # they are bytes per sequence position (PER_POSITION), not per token of the micro-batch
        # -- unless transformers' Trainer passes its (b, s) ``position_ids`` for context parallelism
        # (``trainer_cp_inputs``; trainer.py ``_prepare_context_parallel_inputs``): then (b, s/cp, head_dim)
        name = "rotary.cos_sin_per_token" if trainer_cp_inputs(m, t) > 1 else "rotary.cos_sin"
        out.append((name, 2.0 * m.head_dim * pol.stream, 0.0))
    if t.recompute in ("full", "op") and t.attention == "eager" and m.head == "causal-lm" and m.family != "nanogpt":
        # transformers' eager attention adds a 4-D float causal mask (b, 1, s, s) in the
        # embeddings' dtype; checkpointed layers keep it as an input until the first layer's
        # backward (without recompute it dies with the base model's forward)
        out.append(("causal_mask", 0.0, float(pol.stream)))
    return out


def head_during_loss(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> float:
    """Bytes per token alive only while a causal-LM's own loss runs inside its forward: the final
    norm's output. transformers' ``LlamaForCausalLM.forward`` / ``GPT2LMHeadModel.forward`` keep the
    body's output (``outputs.last_hidden_state``, ``transformer_outputs[0]``) in a local until they
    return, after ``self.loss_function``. Under autocast it is fp32 (the norm runs in fp32) and the
    head saves its own half cast, so it is a tensor of its own; without autocast the head saves it
    (``lm_head.input`` in ``_head_side``), counted already. Under sequence parallelism it is the
    (b, s/tp, h) shard the final norm returns (``trainmem.wrappers.tp_model_plan``). None when the
    loop computes the loss from the logits (``--loss``: the body's output is gone by then) or off the
    last pipeline stage. Derived architectures measure the same tensor (``derived.head_during_loss``)."""
    if t.loss in ("chunked-nll", "fused") and m.head == "causal-lm" and (t.pp == 1 or stage == "last"):
        # TRL's forward and Liger's ``lce_forward`` (transformers/model/llama.py at v0.6.4: ``hidden_states =
        # outputs[0]``, then the loss) keep ``outputs`` until the loss returns
        return float(m.hidden_size * pol.stream)
    if t.loss == "unsloth" and m.head == "causal-lm":
        # Unsloth's ``CausalLM_fast_forward`` keeps ``hidden_states = outputs[0]`` until the loss returns
        # (models/llama.py L1487, L1544-1556), and the loss's shifted int64 labels (``_unsloth_loss_bytes``)
        return float(m.hidden_size * pol.stream + 8)
    if t.loss is not None or m.head != "causal-lm" or not m.final_norm or not pol.amp:
        return 0.0
    if not (t.pp == 1 or stage == "last"):
        return 0.0
    return m.hidden_size * F32 / (t.tp if t.sequence_parallel else 1)


def _quant_head(m: ModelSpec, t: TrainingSpec) -> str:
    """"": the LM head is not a bitsandbytes 4-bit linear; "keeps": it is and its ``MatMul4Bit``
    keeps its input (bitsandbytes < 0.43.2, ``ctx.tensors = (A, B)``), "none": it is and saves
    nothing for backward (its weight is frozen, so no input is needed: ``ctx.tensors = (None, B)``)."""
    if not t.quantize or not any(p.layer is None and is_quantized(p, t) for p in m.parameter_tensors()):
        return ""
    if _head_is_lora_target(m, t):
        return ""  # its LoRA adapter's lora_A saves the input as a plain head would
    return "keeps" if t.bnb_saves_input else "none"


def mlm_transform_tensors(h: int, pol: Policy, frozen: bool) -> tuple[float, ...]:
    """Bytes per token of each tensor a masked LM's head transform saves, in forward order
    (transformers 5.24 ``models/bert/modeling_bert.py`` ``BertPredictionHeadTransform.forward``:
    ``dense``, ``transform_act_fn``, ``LayerNorm``): the dense's input (its half cast under autocast;
    none for a frozen weight), the activation's input (the dense's output, compute dtype), the
    LayerNorm's input (the activation's output, in the LayerNorm's dtype: fp32 under autocast) and
    its fp32 mean and rstd (one each per token)."""
    return (float(0 if frozen else h * pol.half), float(h * pol.half), float(h * pol.stream), float(F32), float(F32))


def head_side_tensors(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> tuple[tuple[float, int], ...]:
    """The head side's tensors one by one, in forward order, for the allocator replay
    (``reserved._head_side``): (bytes per token, how long it lives: 0 saved for backward, 1 until
    the next one is made, 2 until the logits are made). A masked LM's transform saves
    ``mlm_transform_tensors`` and its decoder's half input (as ``_head_side`` counts them); under
    autocast two more live in forward only: the activation's half output, until the LayerNorm has
    cast it to fp32 (the LayerNorm saves that copy), and the LayerNorm's fp32 output, which the
    decoder casts (and saves the cast) and which ``BertLMPredictionHead.forward`` holds until the
    decoder returns (transformers 5.24 ``models/bert/modeling_bert.py`` L497-500; trace's op stream:
    the activation's output freed after the fp32 cast, the LayerNorm's after the logits). ()
    elsewhere: the replay keeps the head side as one block. Found by the agreement grid: BERT b4 s512
    fp32 with bitsandbytes' paged 8-bit AdamW read -14.4 % below trace's peak reserved memory; as one
    24 MiB block the transform's tensors opened a segment of their own whose hole then took autograd's
    cuBLAS workspace, which trace places in a freed logits segment (where it stays, so trace's second
    step opens one more)."""
    if m.head == "causal-lm" and (t.pp == 1 or stage == "last"):
        return derived_head_tensors(m, t, pol) if m.family == "derived" else causal_lm_head_tensors(m, t, pol)
    if m.head != "masked-lm" or m.family == "derived" or not (t.pp == 1 or stage == "last"):
        return ()
    frozen = bool(t.lora_rank)
    h = m.hidden_size
    dense_in, dense_out, norm_in, mean, rstd = mlm_transform_tensors(h, pol, frozen)
    temp = pol.amp and pol.half != pol.stream
    out = [(dense_in, 0), (dense_out, 0)] + ([(float(h * pol.half), 1)] if temp else [])
    out += [(norm_in, 0), (mean, 0), (rstd, 0)] + ([(float(h * pol.stream), 2)] if temp else [])
    return tuple(out) + (() if frozen else ((float(h * pol.half), 0),))


#: ``head_side_tensors``' lifetimes: saved for backward; freed once the next one (two) are made; alive
#: until the logits are made; until the model's own loss returns
HEAD_SAVED, HEAD_NEXT, HEAD_LOGITS, HEAD_LOSS, HEAD_NEXT2 = 0, 1, 2, 3, 4


def causal_lm_head_tensors(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[tuple[float, int], ...]:
    """A transformers causal LM's final norm and head input, tensor by tensor in forward order, for the
    allocator replay (``head_side_tensors``): (bytes per token, lifetime ``HEAD_*``). What it saves sums
    to ``_head_side``'s ``final_norm`` and ``lm_head.input``: HF RMSNorm's (``rmsnorm_head_tensors``),
    nn.LayerNorm's (GPT-2's ``ln_f``: ``native_layer_norm`` saves its input and fp32 mean and rstd and
    returns the output), then the head's input (``head_input_tensors``). () where the replay keeps the
    side as one block: another norm (Liger's, ``--rms-norm input``, torchtune's, a Python-op
    LayerNorm), a fused loss, a 4-bit head, sequence parallelism, another framework's model code,
    ``--compile`` (inductor's fused kernels make none of the norm's temporaries).
    Found by the agreement grid: Mistral (2 layers, hidden 1024) b4 s512 bf16-amp, op recompute,
    AdamW-8bit: the side's 20 MiB as one block took a logits segment's head in the second step, where
    trace's 8, 8, 8 and 4 MiB tensors fit the layers' freed blocks."""
    fused = loss_mode(m, t) in ("fused", "chunked-nll", "unsloth")
    if (m.family not in ("gpt2", "llama", "mixtral") or not m.final_norm or model_code(t) != "transformers"
            or fused or _quant_head(m, t) or t.sequence_parallel or t.liger or t.unsloth_kernels
            or t.rms_norm == "input" or torchtune_norm_saves_fp32(m, t) or m.manual_layernorm or t.compile):
        return ()
    h, frozen = m.hidden_size, bool(t.lora_rank)
    if m.norm == "rmsnorm":
        norm = rmsnorm_head_tensors(h, pol, frozen, input_counted=False)
    else:                                                         # input, fp32 mean and rstd
        norm = ((float(h * pol.stream), HEAD_SAVED), (8.0, HEAD_SAVED))
    return norm + head_input_tensors(h, pol, _head_is_lora_target(m, t) or not frozen, t.loss is None)


def rmsnorm_head_tensors(h: int, pol: Policy, frozen: bool, input_counted: bool) -> tuple[tuple[float, int], ...]:
    """HF RMSNorm's tensors up to its output (transformers 5.24 ``models/llama/modeling_llama.py``
    L62-67; Qwen2's, Mistral's, Qwen3's ``modeling_qwen3.py`` L59-64, Phi-3's ``modeling_phi3.py``
    L266-271 the same), bytes per token and lifetime (``HEAD_*``): ``to(float32)`` (in a half stream an
    fp32 copy, saved by ``pow`` and ``mul``; in an fp32 stream the input itself, listed unless
    ``input_counted``: a derivation counts the top layer's output with the layers), ``pow(2)`` (fp32,
    freed once ``mean`` has read it), ``rsqrt`` (fp32 (b, s, 1), saved), ``hidden * rsqrt`` (fp32: in an
    fp32 stream the normed tensor itself; in a half stream freed as the norm returns, after its
    ``to(input_dtype)`` cast and the product), the normed tensor ``weight * normed`` saves for a
    trainable weight (``frozen``: freed once the product is made). The output: ``head_input_tensors``."""
    x = () if (input_counted and pol.stream == F32) else ((float(h * F32), HEAD_SAVED),)
    out = x + ((float(h * F32), HEAD_NEXT), (float(F32), HEAD_SAVED))
    if pol.stream == F32:                                         # normed: fp32, the product's input
        return out + ((float(h * F32), HEAD_NEXT if frozen else HEAD_SAVED),)
    return out + ((float(h * F32), HEAD_NEXT2), (float(h * pol.stream), HEAD_NEXT if frozen else HEAD_SAVED))


def head_input_tensors(h: int, pol: Policy, keeps_input: bool, own_loss: bool) -> tuple[tuple[float, int], ...]:
    """The final norm's output and the head's input, bytes per token and lifetime (``HEAD_*``). Without
    autocast the output is the head's input, saved (``keeps_input``: a trainable or LoRA-adapted head;
    ``mm`` saves ``self`` only for ``mat2``'s gradient, ``derivatives.yaml``). Under autocast it is an
    fp32 tensor the causal LM's forward holds as ``hidden_states`` (``LlamaForCausalLM.forward``,
    transformers 5.24 ``modeling_llama.py`` L469-475) until its own loss returns (``own_loss``:
    ``head_during_loss``) or, when the loop computes the loss, until forward returns after the logits,
    and ``lm_head`` saves its half cast (a frozen head's cast dies with the matmul). An unsaved output
    lives as the body's output does."""
    body = HEAD_LOSS if own_loss else HEAD_LOGITS
    if pol.amp:
        return ((float(h * pol.stream), body), (float(h * pol.half), HEAD_SAVED if keeps_input else HEAD_LOGITS))
    return ((float(h * pol.stream), HEAD_SAVED if keeps_input else body),)


def derived_head_tensors(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[tuple[float, int], ...]:
    """A derived causal LM's final norm and head input tensor by tensor (``head_side_tensors``), where its
    final norm is HF RMSNorm's code (``HF_RMSNORM_TYPES``, ``rmsnorm_head_tensors``) and what those
    tensors save is the head side the derivation measured (``derived.outer``'s ``doc["head"]``, bytes
    per token): else () (one block, as before). Found by the agreement grid: Qwen3 (2 layers) b8 s256
    bf16, ZeRO-2 dp 4: the measured 16 MiB as one block opened a segment of its own and in the second
    step split a logits segment, where trace's 8 + 4 + 4 MiB tensors (and the 8 MiB ``pow`` and fp32
    normed tensors freed in the norm) fit a 20 MiB one."""
    if (m.model_type not in HF_RMSNORM_TYPES or m.head != "causal-lm" or t.sequence_parallel
            or loss_mode(m, t) in ("fused", "chunked-nll", "unsloth") or t.liger or t.quantize or t.compile):
        return ()
    h, frozen = m.hidden_size, bool(t.lora_rank)
    out = rmsnorm_head_tensors(h, pol, frozen, input_counted=True)
    out += head_input_tensors(h, pol, _head_is_lora_target(m, t) or not frozen, t.loss is None)
    tok, s, _sq = derived_coefficients(m, t)["head"]
    return out if abs(sum(x for x, held in out if held == HEAD_SAVED) - (tok + max(s, 0.0))) < 1.0 else ()


#: derived model types whose final norm is transformers' Llama RMSNorm code (``rmsnorm_head_tensors``)
HF_RMSNORM_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def _head_side(m: ModelSpec, pol: Policy, h: int, sp: int, fused: bool = False, quant_head: str = "",
               frozen: bool = False, head_adapted: bool = False, rms_input: bool = False,
               norm_fp32: bool = False, liger: bool = False
               ) -> list[tuple[str, float, float]]:
    """The final norm's saved tensors and the head's input (which a fused linear cross-entropy
    does not save: it keeps the gradients it computed in forward instead; a 4-bit head saves it
    only before bitsandbytes 0.43.2, as the final norm's output itself: ``_quant_head``).

    ``frozen`` (LoRA: peft freezes the head and the norms): a linear with a frozen weight saves no
    input (``mm`` saves ``self`` only when ``mat2`` requires grad: ``derivatives.yaml``, ``mm``:
    ``self: mm_mat1_backward(grad, mat2, ...)``, ``mat2: mm_mat2_backward(grad, self, ...)``), so
    neither the head's input nor a dense transform's is kept unless peft adapts the head
    (``head_adapted``: its ``lora_A`` saves the input); HF RMSNorm's ``weight * normed`` saves
    ``normed`` only for the weight's gradient (as ``layers.Builder.rms_norm_hf``); ``norm_fp32``
    (torchtune 0.5-0.6.1's ``F.rms_norm``, ``spec.frameworks.torchtune_norm_saves_fp32``): that
    normed tensor is fp32.

    ``rms_input`` (``--rms-norm input``): the final RMSNorm computes in its input's dtype
    (``layers.Builder.rms_norm_input``): it saves its input itself (the last layer's output, which
    nothing else keeps), one ``rsqrt`` per token in that dtype and, for a trainable weight, ``normed``.
    ``liger`` (``--liger``): the final norm is ``LigerRMSNorm`` (``layers.Builder.rms_norm_liger``):
    its input itself and one fp32 ``RSTD`` per token, whether the weight trains or not."""
    out: list[tuple[str, float, float]] = []
    if m.final_norm and m.family != "bert":
        if m.norm == "rmsnorm" and liger:
            out.append(("final_norm", (h * pol.stream + F32) / sp, 0.0))
        elif m.norm == "rmsnorm" and rms_input:
            out.append(("final_norm", (h * pol.stream * (1 if frozen else 2) + pol.stream) / sp, 0.0))
        elif m.norm == "rmsnorm":  # HF RMSNorm: fp32 input copy, the normed tensor (trainable weight), fp32 rstd
            normed = 0 if frozen else (F32 if norm_fp32 else pol.stream)
            out.append(("final_norm", (h * (F32 + normed) + 4) / sp, 0.0))
        elif m.manual_layernorm:  # Python-op LayerNorm (layers.Builder.layer_norm_manual): x, x - mean,
            # norm_x (b, s, h) and sqrt(var + eps) (b, s, 1), all in the stream dtype
            out.append(("final_norm", (h * pol.stream * 3 + pol.stream) / sp, 0.0))
        else:                    # layer_norm: input + fp32 mean/rstd
            out.append(("final_norm", (h * pol.stream + 8) / sp, 0.0))
    if m.head == "masked-lm":
        # transform: dense (saves its input) + activation + LayerNorm, then the decoder's input
        out.append(("mlm.transform", float(sum(mlm_transform_tensors(h, pol, frozen))), 0.0))
        if not frozen:
            out.append(("lm_head.input", float(h * pol.half), 0.0))
    elif m.head == "causal-lm" and quant_head:
        if quant_head == "keeps":  # Linear4bit casts to the compute dtype, which is the input's then
            out.append(("lm_head.input", float(h * pol.stream), 0.0))
    elif m.head == "causal-lm" and not fused and (head_adapted or not frozen):
        # lm_head saves its input: a half cast under autocast, else the final norm's output
        half_in = pol.amp or (m.norm == "rmsnorm" and pol.stream == 2)
        out.append(("lm_head.input", float(h * (pol.half if half_in else pol.stream)), 0.0))
    elif m.head == "seq-cls" and m.family == "bert":
        # BERT's pooler takes hidden[:, 0]; the view it saves keeps the last layer's output storage
        # alive. Under autocast it saves the view's (b, h) half cast instead (per sample, left out),
        # and the output lives only while the model's forward runs (bert_top_forward counts it there;
        # trace, BERT hidden 64 seq-cls bf16-amp 4 x 256: the forward's end +1.0% before)
        if not pol.amp:
            out.append(("pooler.input", float(h * pol.stream), 0.0))
    elif m.head == "seq-cls":
        # the score linear runs on every token: it saves its (b, s, h) input in the matmul dtype
        out.append(("pooler.input", float(h * pol.half), 0.0))
    elif m.head == "qa":
        # qa_outputs, Linear(h, 2), saves its input, every token's output of the encoder: the
        # tensor itself, or autocast's half copy of it ((b, s, h) in the matmul dtype)
        out.append(("qa_outputs.input", float(h * pol.half), 0.0))
    return out


class LossBytes(NamedTuple):
    """Bytes of the loss per logit element (of the whole micro-batch, or of one chunk), per token and
    in total; see ``loss_bytes``."""

    held: int = 0           # the output the loop keeps (0: only the loss)
    out: int = 0            # the head's output, alive while the loss runs
    saved: int = 0          # saved for backward by the loss
    forward: int = 0        # alive only while the loss is computed
    backward: int = 0       # alive at the start of backward
    forward_chunk: int = 0  # per element of one chunk: alive while that chunk's loss is computed
    backward_chunk: int = 0  # per element of one chunk: its backward
    saved_tok: int = 0      # per token, saved (Liger: the input gradient in the compute dtype, fp32 loss)
    saved_const: int = 0    # in total, saved (Liger: the head weight's gradient)
    cast: int = 0           # the fp32 copy a wrapper makes of the head's output as forward returns (--cast-output)
    matmul_const: int = 0   # chunked-nll: alive at a chunk's head matmul, whatever the chunk (the weight's copy)
    chunk_const: int = 0    # fused: alive beside ``forward_chunk``'s tensors, whatever the chunk (weight copies)
    matmul_chunk: int = 0   # ... per element of the chunk's logits then
    backward_const: int = 0  # chunked-nll: alive through a chunk's backward whatever the chunk (the weight's copy)
    backward_more: int = 0  # chunked-nll, a trained head: more in backward when there are several chunks
    saves_out: int = 0      # 1: ``saved`` is the tensor the loss reads (the output, or its --cast-output copy)
    elem: int = F32         # bytes per element of the loss's own logits-sized tensors: fp32, or the half
    #                         dtype of a loss run in it without autocast (pure bf16/fp16: _eager_loss_bytes)


def loss_mode(m: ModelSpec, t: TrainingSpec) -> str:
    """The loss a run computes: ``t.loss``, else the model's own: transformers' causal-LM heads call
    ``ForCausalLMLoss`` (upcast); nanoGPT and transformers' masked-LM heads ``F.cross_entropy`` on
    the logits as they are (half)."""
    if t.loss is not None:
        return t.loss
    if release_loss(m, t) == "shift-half":
        return "half"
    measured = derived_loss_upcasts(m, t)  # a derived model's own loss, as traced (None: not measured)
    return "upcast" if (loss_upcasts(m) if measured is None else measured) else "half"


def release_loss(m: ModelSpec, t: TrainingSpec) -> str:
    """How the model's own causal-LM loss treats the logits in the run's transformers release
    (``spec.tf_releases.causal_lm_loss``: "labels", "loss-fp32-shift", "forward-fp32" or
    "shift-half"); "labels" when the loop computes the loss (``--loss`` given)."""
    if t.loss is not None or t.transformers_version is None:
        return "labels"
    return causal_lm_loss(m, t.transformers_release)


def loss_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy) -> LossBytes:
    """The loss's tensors. The loop holds the output's logits unless it keeps only the loss.

    * upcast: transformers ``loss_utils.ForCausalLMLoss``: ``logits.float()`` (an fp32 copy freed
      after the loss), ``cross_entropy`` -> ``log_softmax`` saves fp32 log-probabilities; backward
      starts with ``nll_loss_backward`` and ``_log_softmax_backward_data``, one fp32 tensor each.
    * half: ``F.cross_entropy`` on half logits under autocast: ``cross_entropy_loss`` has no
      autocast rule, so ``log_softmax`` keeps the half dtype and ``nll_loss`` (autocast fp32 list)
      saves an fp32 copy; backward starts with one fp32 gradient. Pure half: all half. With
      ``loss_chunks`` N > 1, litgpt's chunked head and loss (``model(x, lm_head_chunk_size=128)``
      returns the head's output per chunk of the sequence, litgpt/model.py ``GPT.forward``;
      ``chunked_cross_entropy`` in litgpt/utils.py runs ``F.cross_entropy`` on each half chunk
      and sums): every chunk's log-probabilities are saved, the backward gradients exist for one
      chunk at a time.
    * chunked: torchtune ``modules/loss/ce_chunked_output_loss.py`` (``CEWithChunkedOutputLoss``):
      the model returns the output projection of each of ``num_output_chunks`` token chunks (all
      kept in a list, half), the loss upcasts one chunk at a time (``logits.float()``) and its
      ``log_softmax`` saves that chunk's fp32 log-probabilities: all chunks' are saved, the fp32
      copy and the two backward gradients exist for one chunk at a time (autograd runs the
      chunks' branches one after another, the last first).
    * fused: Liger-Kernel ``ops/fused_linear_cross_entropy.py`` (``fused_linear_cross_entropy_forward``):
      no logits output; forward allocates ``grad_input`` (tokens x hidden, the input's dtype),
      ``grad_weight`` (the head weight's shape and dtype) and an fp32 ``loss_1d`` per token, all
      saved for backward, and one logits chunk of ``next_power_of_2(ceil(BT / ceil(V / H)))``
      tokens at a time; backward returns the saved gradients (no new tensors when the loss's
      gradient is 1).
    * loss parallel (upcast, PyTorch's tensor parallelism, ``states.dtensor_tp``): :func:`_loss_parallel_bytes`.
    * ``torch.compile`` with the model's own upcast loss (transformers' ``ForCausalLMLoss``,
      ``--loss`` not given): :func:`_compiled_loss_bytes`.
      A loss the loop computes from the logits (``--loss upcast|half``) runs eagerly outside the
      compiled call (trace/compiled.py): the eager formulas (the KV cache's zero gradients are
      added in ``_build``).
    Classifier heads: fp32 loss tensors of (b, labels).
    """
    # the loop's reference to the output keeps them; on a pipeline's last stage (the only one with a
    # loss) torch's PipelineStage keeps the logits in ``fwd_cache`` until the micro-batch's backward
    # has run (stage.py ``backward_one_chunk``: ``stage_output`` is popped and held through it), as a
    # loop holding its output until backward ends would (Kept). Found by trace: llama-3.2-1b (4
    # layers) --pp 2, fp32, last stage -7.7% before
    held = pol.half if (t.hold_output != "loss" or torch_pipeline(t)) else 0
    b = _loss_in_one_piece(m, t, pol, held)
    kind = release_loss(m, t)
    if kind in ("forward-fp32", "loss-fp32-shift"):
        b = _release_upcast_bytes(b, pol, kind)
    if (t.loss_shift == "logits" or kind == "shift-half") and is_lm(m):
        # ``logits[..., :-1, :].contiguous()`` on the half logits (ColossalAI's GPTLMLoss, older
        # transformers models before ForCausalLMLoss shifted the labels instead, 4.49, many
        # hand-written loops): a half copy, alive while log_softmax runs (neither slice nor contiguous saves it
        # for backward; SliceBackward's zero-filled gradient comes after log_softmax's has freed the
        # log-probabilities, so backward's peak does not change)
        b = b._replace(forward=b.forward + pol.half)
    if t.softmax_saves_input and is_lm(m):
        b = _log_softmax_keeps_input(b, t, pol, loss_mode(m, t), kind == "shift-half")
    return b


def fp32_logits_replay(m: ModelSpec, t: TrainingSpec, pol: Policy, b: LossBytes) -> bool:
    """Whether the allocator replay makes the ``forward-fp32`` loss (``_release_upcast_bytes``) tensor by
    tensor (``reserved._fp32_logits_forward`` / ``_backward``) rather than as the sums ``loss_bytes``
    gives the moments: the causal-LM loss of a transformers release whose forward upcasts the half
    logits (Qwen2 4.37-4.44, Llama 4.31-4.45, ... ``spec.tf_releases.causal_lm_loss``), one piece (no
    chunks, no ``--cast-output``, no shifted half copy, PyTorch >= 1.11), one tensor-parallel rank."""
    return (is_lm(m) and release_loss(m, t) == "forward-fp32" and pol.half != F32 and t.loss_chunks <= 1
            and not b.cast and not b.saves_out and t.loss_shift != "logits" and not t.softmax_saves_input
            and t.tp == 1)


def _release_upcast_bytes(b: LossBytes, pol: Policy, kind: str) -> LossBytes:
    """The model's own upcast loss (``b``: the installed ``ForCausalLMLoss``, which shifts the labels)
    as an older transformers release computes it (``spec.tf_releases``), per logit element:

    * ``loss-fp32-shift`` (4.46-4.48 ``ForCausalLMLoss``): besides the fp32 copy of the half logits
      (``logits = logits.float()``, a local alive until the loss returns; none when they are fp32),
      ``shift_logits = logits[..., :-1, :].contiguous()`` is a second fp32 tensor, alive while
      ``cross_entropy`` runs: ``forward`` + 4 B. The saved fp32 log-probabilities and the backward's
      two fp32 gradients are as before (one token fewer); ``SliceBackward``'s zero-filled fp32 gradient
      comes after the log-probabilities are freed.
    * ``forward-fp32`` (Llama 4.31-4.45, Mistral to 4.47, ...): the model's forward upcasts
      (``logits = logits.float()``) and returns the fp32 tensor; its half output is freed by the
      upcast (rebound or a temporary). While the loss runs, the fp32 logits and their fp32 shifted
      copy are alive: counted as the half output (``out``, as the gradient handed back to the head
      is half again after ``ToCopyBackward``) plus ``forward`` = 4 - 2 + 4 B (4 B with fp32 logits,
      whose ``.float()`` is the tensor itself). A loop that holds the output holds fp32 logits
      (``held`` 4 B)."""
    half = pol.half
    if kind == "loss-fp32-shift":
        return b._replace(forward=b.forward + F32)   # (b, s - 1, vocab) fp32: the shifted copy
    upcast = F32 - half if half != F32 else 0        # the fp32 logits in place of the half output
    return b._replace(held=F32 if b.held else 0, forward=upcast + F32)


def _log_softmax_keeps_input(b: LossBytes, t: TrainingSpec, pol: Policy, mode: str,
                             shifted: bool = False) -> LossBytes:
    """PyTorch < 1.11 (``spec.releases``): ``LogSoftmaxBackward`` saves the tensor ``log_softmax``
    read until the loss's backward, per logit element: the fp32 copy of an upcast loss under
    autocast or in pure half (moved from the forward-only bytes to the saved ones); else the
    shifted half copy (``loss_shift logits``); else the logits themselves, which stay alive when the
    loop does not hold them anyway (``held``). Chunked and fused losses are refused for these
    releases (``releases.torch_problems``)."""
    if mode == "upcast" and pol.half != F32:
        return b._replace(saved=b.saved + F32, forward=b.forward - F32)   # the .float() copy, fp32
    if t.loss_shift == "logits" or shifted:
        return b._replace(saved=b.saved + pol.half, forward=b.forward - pol.half)  # the shifted copy
    return b if b.held else b._replace(saved=b.saved + b.out)   # the logits, in their dtype


def _loss_in_one_piece(m: ModelSpec, t: TrainingSpec, pol: Policy, held: int) -> LossBytes:
    """``loss_bytes`` before the logits are shifted (see there)."""
    if not is_lm(m):
        return LossBytes(held, pol.half, F32, F32, 2 * F32)
    mode, half = loss_mode(m, t), pol.half
    if mode == "chunked-nll":
        return _chunked_nll_bytes(m, t, pol)
    if m.family == "derived" and m.is_encoder_decoder and half != F32 and derived_logits_bytes(m, t) == F32:
        # fp32 logits under autocast (BART: ``lm_logits = self.lm_head(outputs[0]) +
        # self.final_logits_bias``, a half output plus an fp32 buffer, promoted; measured by the
        # derivation): CrossEntropyLoss's log_softmax saves fp32 log-probabilities, nll_loss needs no
        # copy; backward starts with two fp32 gradients
        return LossBytes(F32 if held else 0, F32, F32, 0, 2 * F32)
    if mode == "fused":
        return fused_linear_ce_bytes(m, t, pol)
    if mode == "unsloth":
        return _unsloth_loss_bytes(m, pol)
    if mode == "chunked" and t.compile:
        return _compiled_chunked_loss_bytes(held, half)
    if mode == "upcast" and t.cast_output and torchtune_compiles_whole_loss(t):
        return _compiled_fp32_loss_bytes(held, half)
    if mode == "chunked":
        return LossBytes(held, half, F32, forward_chunk=F32 if half != F32 else 0, backward_chunk=2 * F32)
    if mode == "vocab-parallel":
        return _vocab_parallel_bytes(held, half, _head_weight_numel(m, t.tp) * t.weight_bytes)
    if t.compile and t.loss is None and mode == "upcast":
        return _compiled_loss_bytes(m, t, held, half)
    if t.compile and t.loss is None:
        # a model's own loss on half logits (nanoGPT's F.cross_entropy), fused by inductor; trace
        # --compile cannot run nanoGPT (it needs a step_fn), so this is not read off a partition:
        # no fp32 copy in forward, one fp32 logits gradient in backward (the layers warn, too)
        return LossBytes(held, half, F32, 0, F32)
    if t.compile:   # the loop's loss, eager, on the compiled model's outputs
        return _eager_loss_bytes(m, t, pol, held, mode, half)
    return _eager_loss_bytes(m, t, pol, held, mode, half)


def fused_linear_ce_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy) -> LossBytes:
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` (``--loss fused``, ``--liger``):
    ``fused_linear_cross_entropy_forward`` (ops/fused_linear_cross_entropy.py, v0.6.4 L16-228,
    v0.5.10 L16-155, v0.8.2 L21-300) computes the loss and both gradients in forward, over chunks of
    ``next_power_of_2(ceil(BT / ceil(V / H)))`` tokens (``Quantities.liger_factor``), and
    ``ctx.save_for_backward(grad_input, grad_weight, grad_bias)`` keeps them (v0.6.4 L340-344):

    * per token: ``grad_input = torch.zeros_like(_input)`` in the input's dtype, the final norm's
      output (the residual stream's dtype: fp32 under autocast, whose RMSNorm output is fp32;
      ``amp_custom_fwd`` is ``torch.amp.custom_fwd`` without ``cast_inputs``, ops/utils.py L74-84:
      autocast stays on and nothing is cast), and ``loss_1d``, fp32 (L55, L69);
    * in total: ``grad_weight = torch.zeros_like(weight)`` in the weight's dtype (None for a frozen
      head, L58-63; ``accum_dtype`` is not set by the HF patches);
    * per chunk, in forward: ``logits_chunk = _input_chunk @ weight.t()`` (chunk, V) in the matmul
      dtype, which the Triton kernel overwrites with its gradient (L96, L126-168), then
      ``grad_input[chunk] = grad_logits_chunk @ weight`` and the weight gradient's accumulation
      (``_fused_weight_grad_bytes``).

    Under autocast each matmul casts the fp32 weight: ``weight.t()`` is a view, which autocast never
    caches (aten/src/ATen/autocast_mode.cpp ``cached_cast``: fp32 leaves that require grad, not
    views), so the first matmul of every chunk makes a (V, H) half copy and frees it; ``weight`` in
    the second is cached from the first chunk on, until the autocast region ends with the loss
    (nothing saves it: no copy outlives the forward, ``head_casts``). A frozen head's weight is
    cast anew by both. The moments: the first matmul, with the cached copy and the uncached one
    (``matmul_const``), beside two chunks' logits (the previous chunk's, still bound to
    ``logits_chunk`` / ``grad_logits_chunk`` while the loop's next matmul makes the new one); the
    weight gradient's, with the cached copy (``chunk_const``), beside one."""
    half, h = pol.half, m.hidden_size
    head = _head_weight_numel(m, t.tp)
    grad_w = 0 if t.lora_rank else head * t.weight_bytes
    first, cached, mm, flt, chunk = fused_linear_ce_parts(m, t, pol)
    return LossBytes(saved_tok=h * max(pol.stream, half) + F32, saved_const=grad_w,
                     forward_chunk=half + chunk, chunk_const=cached + mm + flt,
                     matmul_const=cached + first, matmul_chunk=2 * half)


def _unsloth_loss_bytes(m: ModelSpec, pol: Policy) -> LossBytes:
    """unsloth_zoo's ``UnslothFusedLoss`` (``--loss unsloth``; ``unsloth_fused_ce_loss``, which Unsloth's
    ``CausalLM_fast_forward`` calls whenever labels are given and ``UNSLOTH_RETURN_LOGITS`` is not set
    (its ``bsz * q_len <= 1024`` branch sets ``RETURN_LOGITS = False`` too): unsloth 2026.3.5
    ``models/llama.py`` L1521-1556; unsloth_zoo 2026.3.4 ``fused_losses/cross_entropy_loss.py``
    L162-430). No logits leave the model (``logits = EMPTY_LOGITS``). Its forward:

    * ``grad_inputs = torch.empty_like(hidden_states)`` (L217), the final norm's (b, s, h) output's
      dtype, saved for backward (``ctx.save_for_backward(grad_inputs, grad_lm_head, ...)``, L416:
      the head is frozen under LoRA, so ``grad_lm_head`` is None); backward returns it as it is (L422-428);
    * the shifted labels, ``torch.empty_like(labels)`` (int64 per token, L194), alive until forward
      returns (``head_during_loss``);
    * per chunk of ``torch.chunk(hidden_states.view(-1, hd), n_chunks)`` (L230-232), the
      ``torch.compile``'d ``accumulate_chunk`` (``torch.func.grad_and_value`` of
      ``compute_fused_ce_loss``: the head's matmul, ``.float()``, ``cross_entropy``, and their
      gradient in one graph). Inductor's wrapper for it (torch 2.13, unsloth_zoo's compile options:
      ``memory_planning=True``; read off the code it generates for that function on the CPU,
      tests/test_unsloth.py) allocates one pool of ``align(2·N·V) + max(2·N·h, 12·N)`` bytes:
      the chunk's bf16 logits, which the fused kernel (log_softmax, nll_loss and their backward, the
      fp32 upcast folded in) overwrites with their gradient (``buf5 = buf0; # reuse``), and the
      ``mm`` of that gradient with the head's weight, (N, h), copied into ``grad_inputs``. No fp32
      logits-sized tensor exists. Per logit element of a chunk: the half logits
      (``forward_chunk``); per token of a chunk: the (N, h) gradient (``Quantities.loss_chunk_tok``).

    ``n_chunks``: ``get_chunk_size`` (L153-160) from half the GPU's free memory at the first call
    (cached): ``max(4·round(tokens·V / (free / 2)), 1)`` chunks, one whenever the fp32 logits
    (tokens·V·4 B) are smaller than the free memory; ``--loss-chunks N`` is
    ``UNSLOTH_CE_LOSS_N_CHUNKS=N`` (default 1)."""
    half = pol.half
    return LossBytes(saved_tok=m.hidden_size * max(pol.stream, half), forward_chunk=half)


def fused_linear_ce_parts(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[int, int, int, int, int]:
    """The transient tensors of Liger's fused linear cross-entropy forward (``fused_linear_ce_bytes``),
    for the allocator replay (``reserved._fused_forward``): bytes of autocast's uncached (V, H) half copy
    of ``weight.t()`` (each chunk's first matmul), of its cached copy of ``weight`` (a trained head under
    autocast), of the weight-gradient ``mm``'s (V, H) output and of its ``.float()`` copy, and per logit
    element of a chunk the fp32 copy of the logits before 0.6.2 under autocast."""
    head = _head_weight_numel(m, t.tp)
    trained = not t.lora_rank
    first = head * HALF if pol.amp else 0                          # weight.t()'s uncached half copy
    cached = head * HALF if (pol.amp and trained) else 0          # the cached half weight (second matmul)
    chunk, mm, flt = _fused_weight_grad_bytes(t, pol, head, trained)
    return first, cached, mm, flt, chunk


def _fused_weight_grad_bytes(t: TrainingSpec, pol: Policy, head: int, trained: bool) -> tuple[int, int, int]:
    """How Liger's fused linear cross-entropy adds a chunk's weight gradient to ``grad_weight``, by
    release (``TrainingSpec.liger_version``): (bytes per element of the chunk's logits, bytes of the
    ``mm`` output, bytes of its ``.float()`` copy) alive beside the chunk's logits then.

    * before 0.6.2: ``torch.addmm(input=grad_weight, mat1=logits_chunk.t().to(_input_chunk.dtype),
      mat2=_input_chunk, out=grad_weight)`` in place (v0.5.10 L127-135, v0.3.0 L122-129): no (V, H)
      tensor; under autocast the fp32 input makes ``.to()`` an fp32 copy of the chunk's logits;
    * 0.6.2 to 0.8.0: ``grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()``
      (v0.6.2 L134, v0.6.4 L198, v0.7.0 L199; commit 2845fe83 "Add accum_dtype option", 2025-07-30): a (V, H)
      tensor in the matmul dtype and its fp32 copy (the same tensor in fp32 training);
    * from 0.8.1: ``torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=torch.float32,
      out=grad_weight)`` when grad_weight is fp32 and the logits half on a CUDA device of compute
      capability >= 8 (autocast over fp32 weights; v0.8.2 L233-257, commit c9fc646f), else the
      0.6.2 path (pure bf16: a bf16 grad_weight). The input chunk's half cast it makes is (chunk, H),
      left out beside the (chunk, V) logits."""
    if not trained:
        return 0, 0, 0
    v = t.liger_release()
    if v < (0, 6, 2):
        return (F32 if pol.amp else 0), 0, 0
    if v >= (0, 8, 1) and pol.amp:
        return 0, 0, 0
    return 0, head * pol.half, (head * F32 if pol.half != F32 else 0)   # (fp32: .float() is the tensor itself)


def torchtune_compiles_whole_loss(t: TrainingSpec) -> bool:
    """Whether torchtune's recipe runs a loss other than ``CEWithChunkedOutputLoss`` compiled under
    ``compile: True``. ``training.compile_loss`` compiles such a loss by returning a new module,
    ``loss = torch.compile(loss, backend=backend)`` (torchtune/training/_compile.py L80-82 at
    1814feb17); only the chunked loss is patched in place (``loss.compute_cross_entropy =
    torch.compile(...)``, L74-77). ``lora_finetune_single_device`` keeps the returned module
    (``self._loss_fn = training.compile_loss(self._loss_fn)``, recipes/lora_finetune_single_device.py
    L296), but ``full_finetune_single_device`` (L292), ``full_finetune_distributed`` (L299) and
    ``lora_finetune_distributed`` (L302) call ``training.compile_loss(self._loss_fn)`` and drop what it
    returns (unchanged at torchtune main bd2a0fc7c, 2026-04-23): their ``nn.CrossEntropyLoss`` runs eagerly on the
    compiled layers' output. The single-device LoRA recipe is told apart by ``--lora-rank`` without
    FSDP."""
    return t.compile and t.extra.get("framework") == "torchtune" and bool(t.lora_rank) and t.fsdp is None


def _compiled_chunked_loss_bytes(held: int, half: int) -> LossBytes:
    """torchtune's ``CEWithChunkedOutputLoss`` under ``compile: True``: ``training.compile_loss``
    compiles only ``compute_cross_entropy`` (``F.cross_entropy(logits.float(), labels,
    reduction="sum")`` on one chunk; torchtune/training/_compile.py L58-82 and
    torchtune/modules/loss/ce_chunked_output_loss.py L35-43 at 1814feb17), called once per chunk.
    Inductor's decompositions turn ``log_softmax`` + ``nll_loss`` into ``amax``, ``exp``, ``sum``,
    ``log`` and a ``gather``, and its min-cut partition (``min_cut_rematerialization_partition``,
    ``compiler="inductor"``) saves the chunk's half logits themselves (the graph input), its labels
    (int64, the ``reshape(-1)`` copy of a column chunk) and the per-row fp32 ``amax`` and ``log``,
    recomputing the fp32 log-probabilities in backward: no fp32 tensor of the chunk is saved, and
    the fused kernels materialize none in forward. The backward kernel writes the chunk's gradient
    in the logits' dtype directly (the upcast's ``convert_element_type`` fused), freeing the saved
    chunk after. Per logit element: the output (``half``), saved as it is (``saves_out``: counted
    once while the loss runs), one chunk's half gradient in backward; per token 16 B saved (read off
    the installed torch's partition of that function, ``tests/test_torchtune_flags.py``)."""
    return LossBytes(held, half, half, backward_chunk=half, saved_tok=2 * F32 + 8, saves_out=1)


def _compiled_fp32_loss_bytes(held: int, half: int) -> LossBytes:
    """torchtune's ``nn.CrossEntropyLoss`` under ``compile: True`` on the fp32 logits its decoder
    returns (``F.linear(h, tok_embeddings.weight).float()`` outside the compiled layers,
    torchtune/modules/transformer.py L937 at 1814feb17; ``--cast-output``), in the recipe that keeps
    ``compile_loss``'s compiled module (``torchtune_compiles_whole_loss``: the LoRA single-device
    one; the full-finetune recipes run the loss eagerly): the whole loss module is compiled
    (torchtune/training/_compile.py L58-82), and inductor's
    partition saves its fp32 input itself, the fp32 logits, with per-row fp32 ``amax`` and ``log``
    (as in ``_compiled_chunked_loss_bytes``; the labels are a view of the batch's). The forward
    kernels materialize no logits-sized tensor; the backward kernel writes one fp32 gradient, the
    saved logits then freed, and the decoder's ``ToCopyBackward`` casts it to the head's dtype.
    Per logit element: the half output and its fp32 copy as forward returns (``cast``), the copy
    saved as it is (``saves_out``: the tensor the loss reads), 4 B in backward; per token 8 B."""
    kept = F32 if held else 0
    cast = F32 if half != F32 else 0
    return LossBytes(kept, half, F32, 0, F32, saved_tok=2 * F32, cast=cast, saves_out=1)


def _vocab_parallel_bytes(held: int, half: int, head_grad: int) -> LossBytes:
    """Megatron-LM's ``_VocabParallelCrossEntropy`` (megatron/core/tensor_parallel/cross_entropy.py at
    6e091e1b, L122-216; ``GPTModel.compute_language_model_loss`` runs it on the output layer's
    (s, b, vocab / tp) logits), per logit element of this rank:

    * forward: ``calculate_logits_max`` makes one fp32 copy (``vocab_parallel_logits.float()``, L28;
      none when the logits are fp32), which every later step overwrites in place: ``-= logits_max``
      (L45), ``torch.exp(..., out=exp_logits)`` (L64-65), ``exp_logits.div_(sum_exp_logits)`` (L80):
      the half logits and that copy are alive together, nothing more;
    * saved: the copy, now the softmax (``ctx.save_for_backward(exp_logits, ...)``, L187), fp32;
    * backward: the gradient is the saved softmax itself (``grad_input = softmax``, L91; updated in
      place, L114-117, returned L216), returned in fp32 for the half logits, so autograd's engine casts it to their
      dtype (``validate_outputs``) while it is alive: one half tensor more (none for fp32 logits).
    With fp32 logits ``.float()`` returns them as they are: the logits become the softmax, counted
    once (``forward`` takes back the saved bytes ``out`` already holds), and the gradient handed to the
    head is that fp32 tensor itself, alive while the head's matmul backward makes its weight gradient
    (``head_grad``, the head weight's bytes on this rank) and its input's gradient (fp32, per token,
    ``_chunked_nll_fields``): that moment is the loss's backward peak (found by trace: GPT-2 and Llama,
    2 layers, fp32, -7% and -8% before). The other per-token terms (int64 targets, fp32 maxima, sums
    and losses) are left out, as for the other losses."""
    if half == F32:
        return LossBytes(held, F32, F32, -F32, 0, backward_const=head_grad)
    return LossBytes(held, half, F32, 0, half)


def _chunked_nll_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy) -> LossBytes:
    """TRL's ``loss_type="chunked_nll"`` over a frozen head (trl v1.9.0 trl/trainer/sft_trainer.py
    L99-378; run by ``workload._patch_chunked_nll``). No logits of the micro-batch exist; per token it
    saves the labelled tokens' hidden states gathered to the front (``hidden[order]``, the residual
    stream's dtype), their labels and the gather's int64 indices (``IndexBackward`` keeps them); the
    chunks (``CHUNKED_NLL_TOKENS`` tokens, ``torch.utils.checkpoint``) keep nothing. ``_chunk`` computes
    ``h.float() @ w.float().t()``: under autocast the frozen fp32 weight is cast to the half dtype at
    every call (not cached: it requires no grad), in pure half ``w.float()`` is an fp32 copy, in fp32
    nothing is copied. A chunk's forward peaks either at the matmul (the weight's copy, the chunk's
    hidden cast and its logits, half under autocast, else fp32) or when ``log_p.exp() * log_p`` is made
    (the logits, log_softmax's fp32 output, exp and the product; under autocast also log_softmax's
    fp32 copy of the half logits, freed before): 2 + 4 + 4 + 4 bytes per logit under autocast, 16
    otherwise. Its backward first recomputes it, the matmul saving the weight's copy for the hidden
    states' gradient: the weight's copy and the same four tensors at once, beside the gradient of the
    gathered hidden states (``loss_backward_tok``). The final norm's output, kept by TRL's forward
    until the loss returns, is ``head_during_loss``."""
    problem = chunked_nll_problem(m, bool(t.quantize) and t.quantize_via == "fabric")
    if problem:
        raise TrainmemError(f"--loss chunked-nll (TRL's chunked_nll): {problem}, which the estimate does not "
                            "model: use trainmem trace, or drop --loss chunked-nll for the model's own loss over the "
                            "whole logits (an upper bound)")
    half = pol.half
    w = m.vocab_size * m.hidden_size   # the head weight's elements
    copy = half if pol.amp else (F32 if half != F32 else 0)   # the weight's copy per matmul, bytes per element
    logit = half if pol.amp else F32
    per_logit = logit + 3 * F32
    weight = int(block_of(t, w * copy)) if copy else 0   # the copy's block (the default allocator's unsplit remainder)
    frozen = LossBytes(saved_tok=m.hidden_size * pol.stream + 8 + 8, forward_chunk=per_logit,
                       backward_chunk=per_logit, matmul_const=weight + CHUNKED_NLL_TOKENS * m.hidden_size * logit,
                       matmul_chunk=logit, backward_const=weight)
    if t.lora_rank and "lm_head" not in (t.lora_targets or ()):
        return frozen
    return _chunked_nll_trained(frozen, w, weight, pol)


def _chunked_nll_trained(frozen: LossBytes, w: int, weight: int, pol: Policy) -> LossBytes:
    """``_chunked_nll_bytes`` over a trained head (full fine-tuning; ``frozen``: the same over a frozen
    one, ``w`` the head weight's elements, ``weight`` its copy's block). The forward is the frozen
    head's: ``w.float().t()`` is a view, which autocast does not cache. In backward each chunk's
    matmul makes the weight's gradient in its copy's dtype (the copy, saved by the matmul, freed
    then), ``ToCopyBackward`` casts it to the weight's dtype and autograd's input buffer for the
    weight sums it with the earlier chunks' out of place (a transposed gradient): from the second
    chunk on the buffer, the new gradient and their sum, three weight-sized tensors in the weight's
    dtype (``backward_more`` adds them). The largest of these moments, per precision: under autocast
    the half gradient with its fp32 cast (one chunk), the sum (several: 3 x fp32); in pure half the
    fp32 copy with its fp32 gradient and the chunk's fp32 logits gradient, plus the half buffer when
    there are several; in fp32 the gradient (one), the sum (several). The chunk's other logits-sized
    tensors are freed by then (they are smaller than the weight once the hidden size passes ~700)."""
    if pol.amp:
        single, several, chunk = w * (pol.half + F32), 3 * w * F32, 0
    elif weight:
        single, several, chunk = weight + w * F32, weight + w * F32 + w * pol.half, F32
    else:
        single, several, chunk = w * F32, 3 * w * F32, 0
    return frozen._replace(backward_chunk=chunk, backward_const=single, backward_more=several - single)


def _chunked_nll_fields(m: ModelSpec, t: TrainingSpec, pol: Policy, loss: LossBytes, head_here: bool) -> dict:
    """``Quantities``' fields of TRL's chunked_nll (``_chunked_nll_bytes``): its chunk of tokens, the
    matmul moment's and the backward's constants, and the gathered hidden states' gradient per token,
    alive from the second chunk's backward on (the first, a partial chunk, has none yet)."""
    if head_here and loss_mode(m, t) == "vocab-parallel" and loss.backward_const:
        # fp32 logits: the head's weight gradient and its input's (b, s, h) fp32 gradient (_vocab_parallel_bytes)
        return dict(loss_backward_const=loss.backward_const, loss_backward_tok=float(m.hidden_size * F32))
    if head_here and loss_mode(m, t) == "fused":   # Liger's (V, H) tensors beside a chunk's logits
        first, cached, mm, flt, chunk = fused_linear_ce_parts(m, t, pol)
        return dict(loss_matmul_const=loss.matmul_const, loss_matmul_chunk=loss.matmul_chunk,
                    loss_chunk_const=loss.chunk_const, fused_parts=(first, cached, mm, flt, chunk, pol.half))
    if head_here and loss_mode(m, t) == "unsloth":   # the compiled chunk's (N, h) gradient (_unsloth_loss_bytes)
        return dict(loss_chunk_tok=float(m.hidden_size * pol.half), unsloth_loss=1)
    if not (head_here and loss_mode(m, t) == "chunked-nll"):
        return {}
    return dict(loss_backward_tok=float(m.hidden_size * pol.stream), loss_chunk_tokens=CHUNKED_NLL_TOKENS,
                loss_matmul_const=loss.matmul_const, loss_matmul_chunk=loss.matmul_chunk,
                loss_backward_const=loss.backward_const, loss_backward_more=loss.backward_more)


def _eager_loss_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy, held: int, mode: str, half: int) -> LossBytes:
    """The upcast / half loss run eagerly (``loss_bytes``)."""
    if t.cast_output:
        return _cast_output_loss_bytes(t, held, half)
    if dtensor_tp(t) and mode in ("upcast", "half"):
        return _loss_parallel_bytes(held, half, mode == "half", pol.amp)
    if mode == "half" and half != F32:
        if t.loss_chunks > 1:  # litgpt: each chunk's loss backward in turn
            if pol.amp:
                return LossBytes(held, half, half + F32, backward_chunk=F32)
            return LossBytes(held, half, half, backward_chunk=2 * half, elem=half)
        if pol.amp:
            return LossBytes(held, half, half + F32, 0, F32)
        # pure half: log_softmax's output (saved) and, in backward, nll_loss_backward's and
        # _log_softmax_backward_data's gradients, each a (b*s, vocab) tensor in the logits' half dtype
        return LossBytes(held, half, half, 0, 2 * half, elem=half)
    if mode == "half" and t.loss_chunks > 1:  # fp32 logits, litgpt's chunked loss: one chunk's gradients at a time
        return LossBytes(held, F32, F32, backward_chunk=2 * F32)
    return LossBytes(held, half, F32, F32 if half != F32 else 0, 2 * F32)


def fused_qkv_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--fused-qkv``: litgpt's ``CausalSelfAttention`` computes q, k and v with one linear of
    ``(n_head + 2 * n_query_groups) * head_size`` outputs, views it as (B, T, groups, q_per_kv + 2,
    head) and permutes it to (B, groups, q_per_kv + 2, T, head), splits q, k and v and reshapes each
    to (B, heads, T, head) (litgpt 0.5.3 ``litgpt/model.py`` L268-290; the same at 00af8b0d). With
    one query head per key/value group (q_per_kv = 1) those reshapes are views of the fused output,
    and the value goes to SDPA as such: SDPA saves it, so the whole fused output (with LoRA, the sum
    ``pretrained + lora``) stays alive until the layer's backward. transformers' attention (separate
    ``q_proj``/``k_proj``/``v_proj``) keeps only the value projection's output, counted already: the
    difference is the query and key widths, per token, in the matmul dtype (``pol.half``; shape
    (b, s, q_size + kv_size)). With grouped-query heads (q_per_kv > 1) ``expand`` then ``reshape``
    copies, and nothing more is kept (litgpt v0.5.13 ``litgpt/model.py`` L472-479, L490-499,
    L536-539 splits the fused output into q, k and v views and repeats k and v with
    ``repeat_interleave``: the same tensors kept). Nor when the flash kernel pads a head_dim that
    is not a multiple of 8 (``layers.sdpa_saves_padded``): SDPA then saves a padded copy of the
    value, not the view, and the fused output is freed with the layer's forward (found on the
    lightning-thunder Lit-GPT open_llama_3b run, head_dim 100: trace keeps no fused output, and the
    estimate was 1300 MiB over it at 2 x 2048 tokens, 26 layers). Under autocast with the weights trained (no
    LoRA), each of transformers' three linears casts the fp32 input to half for itself and saves
    that cast (autocast caches weights, not activations); litgpt's one linear makes and saves one:
    two (b, s, h) half casts fewer (found by trace: Mistral-shaped, bf16-amp, 16 MiB over 2 layers at
    2 x 1024 tokens). With LoRA on q, k or v, ``fused_qkv_lora``'s terms too."""
    if not t.fused_qkv:
        return lc
    parts = [(n, b) for n, b in fused_qkv_lora(m, t, pol) if b]
    if m.num_heads == m.num_kv_heads and not sdpa_saves_padded(layer_key(m, t)):
        parts.append(("attn.fused_qkv", float((m.q_size + m.kv_size) * pol.half)))  # (b, s, q + k) of the output
    if pol.amp and not t.lora_rank:  # (b, s, h) half casts of the input: transformers' three, litgpt's one
        parts.append(("attn.fused_qkv.one_cast", -2.0 * m.hidden_size * HALF))
    if not parts:
        return lc
    extra = sum(b for _, b in parts)
    tensors = lc.tensors + tuple((b, 0.0) for _, b in parts) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + tuple((n, b, 0.0) for n, b in parts), tensors=tensors)


def _stage_layer(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> LayerCoefs:
    """The stage's layer: a derived architecture's traced coefficients (with an older release's
    clamp, ``derived_clamp``), else the hand-written recipe's."""
    if m.family == "derived":
        return derived_clamp(m, t, pol, derived_layer(m, t, stage))
    return layer_coefficients(layer_key(m, t))


def derived_clamp(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """A derived layer (traced from the installed transformers) as an older release's eager
    attention runs it, where the two differ by one saved tensor (``spec.tf_releases.eager_clamp``:
    OPT before 4.49). ``OPTAttention.forward`` adds the (b, 1, s, s) mask to the (b, heads, s, s) bmm
    scores and clamps the sum with ``torch.max(attn_weights, torch.tensor(finfo.min))`` (4.28.1
    ``modeling_opt.py`` L224-225; with ``device=`` from 4.30: a 0-dim tensor per layer, not counted),
    whose backward keeps the sum: per layer, heads x dtype bytes per token x key, in the scores'
    dtype. ``spec.tf_releases.transformers_problems`` admits fp16 and fp32 only, where the rest of
    that release's eager path (``softmax(dtype=float32).to(float16)`` for fp16 scores, plain softmax
    for fp32, dropout, ``bmm`` with the values) saves what the installed ``eager_attention_forward``
    saves. The layer's traced backward transients are kept as measured relative to its saved
    tensors: exact for the moments before ``MaximumBackward`` runs (the MLP, the output projection,
    ``bmm``'s and softmax's backward), one tensor high for the q/k/v projections' backward after it."""
    if not (t.attention == "eager" and eager_clamp(m, t.transformers_release)):
        return lc
    sq = float(m.num_heads * pol.half)  # (b, heads, s, s) in the scores' dtype: fp16 or fp32
    tensors = lc.tensors + ((0.0, sq),) if lc.tensors else lc.tensors
    return replace(lc, sq=lc.sq + sq, parts=lc.parts + (("attn.scores_clamp_input", 0.0, sq),), tensors=tensors)


def litgpt_terms(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """A layer of transformers' model as litgpt's own modules differ from it (``--fused-qkv``,
    ``--split-gate-up``), or torchvision's (``--attention-call mha``): ``lc`` with their per-token
    terms added."""
    return mha_kept(m, t, pol, split_gate_up_kept(m, t, pol, lora_qkv_kept(m, t, pol, fused_qkv_kept(m, t, pol, lc))))


def lora_qkv_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--lora-qkv``: litgpt's ``LoRAQKVLinear`` on a model's own fused ``query_key_value`` (GPT-NeoX,
    Falcon), against peft's adapter on the whole linear that the derived layer was traced with: bytes per
    token of one layer, in the adapters' dtype (``pol.half`` for half adapters, else fp32; half under
    autocast). ``forward`` runs ``after_A = F.linear(self.lora_dropout(x), self.lora_A)`` (one dropout,
    as peft's), ``after_B = self.conv1d(after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1))``, whose
    grouped conv saves its (b, r * n, s) input where peft's ``lora_B`` saves a (b, s, r) one
    (``lora.qkv.lora_A_rows``: (n - 1) * r more), and ``zero_pad``: with some but not all parts
    enabled, ``result.index_copy(1, lora_ind, x.reshape(-1, sum(self.qkv_shapes)))`` scatters the
    (b * s, enabled widths) delta into zeros of the fused width (lit_gpt/lora.py L256-296 at 8641822;
    litgpt/lora.py L334-338 at 43c44323), and ``index_copy``'s backward reads its ``source``
    (derivatives.yaml: ``source: grad.index_select(dim, index)...``; ``fused_qkv_lora``), so the delta
    stays saved until the layer's backward (``lora.qkv.zero_pad``). peft's full-width delta is saved
    by nothing. StableLM-3B, q and v: 16 layers x 8192 x 2 B = 0.27 MB per token."""
    if not t.lora_qkv:
        return lc
    from .states import fused_qkv_widths
    widths = fused_qkv_widths(m, t)
    adapter = HALF if pol.amp else (pol.half if adapters_computed_half(t) else F32)
    parts = [("lora.qkv.lora_A_rows", float((len(widths) - 1) * t.lora_rank * adapter))]
    if len(widths) < 3:
        parts.append(("lora.qkv.zero_pad", float(sum(widths) * adapter)))
    parts = [(n, b) for n, b in parts if b]
    if not parts:
        return lc
    extra = sum(b for _, b in parts)
    tensors = lc.tensors + tuple((b, 0.0) for _, b in parts) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + tuple((n, b, 0.0) for n, b in parts), tensors=tensors)


def mha_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--attention-call mha``: torchvision's ``EncoderBlock`` runs ``nn.MultiheadAttention(x, x, x,
    need_weights=False)`` (torchvision/models/vision_transformer.py ``EncoderBlock.forward``), whose
    ``F.multi_head_attention_forward`` (torch/nn/functional.py, 2.0-2.13) works sequence-first: it
    makes q, k and v one contiguous (3, s, b, h) copy of the packed ``in_proj`` output
    (``_in_projection_packed``) and hands SDPA (b, heads, s, d) views of it, then runs
    ``attn_output.permute(2, 0, 1, 3).contiguous()`` for ``out_proj``. Against transformers'
    ``ViTSelfAttention`` + ``ViTSelfOutput`` (three linears, batch-first) that saves, per layer:

    * one (b, s, h) tensor more, in the matmul dtype (``pol.half``), where the kernel lays its output
      out as (b, s, heads, d) whatever the query's strides: the memory-efficient kernel
      (``_efficient_attention_forward``: ``at::empty({B, M, num_heads, Kv})``) and, before PyTorch
      2.2, the flash kernel (FlashAttention v1 packs q, k, v as (b * s, heads, d) and returns a
      contiguous output; FlashAttention-2, which SDPA runs from 2.2 on (the 2.2 release notes; pytorch/pytorch
      issue #106280 "Ship FlashAttentionV2"), allocates ``empty_like(q)``). MHA's
      permute of that output is then a copy, which ``out_proj``'s ``linear`` saves beside the output
      SDPA keeps; transformers' ``transpose(1, 2).contiguous()`` of it is a view. With FlashAttention-2
      the output follows the query's sequence-first layout and the permute is a view: nothing more
      (so on the CPU, whose flash kernel does the same: tests/test_memopt.py);
    * under autocast, two (b, s, h) half tensors fewer: the one packed ``in_proj`` casts the fp32
      LayerNorm output to half once and saves it once, transformers' three linears three times (on
      the CPU, measured: tests/test_memopt.py).

    The math and cuDNN kernels keep other tensors of the packed copy (the math kernel's value is a
    view of it) and are refused."""
    if t.attention_call != "mha":
        return lc
    backend = layer_sdpa_backend(layer_key(m, t))
    if backend not in ("efficient", "flash"):
        raise TrainmemError(f"--attention-call mha is modelled for SDPA's memory-efficient and flash kernels; this "
                            f"setup runs the {backend} kernel: give --attention sdpa-efficient or drop --attention-call")
    release = t.torch_release
    parts = []
    if backend == "efficient" or (release is not None and release < (2, 2)):
        parts.append(("attn.mha_out_copy", float(m.hidden_size * pol.half)))  # (b, s, h): the permuted output
    if pol.amp:
        parts.append(("attn.mha_one_cast", -2.0 * m.hidden_size * HALF))  # (b, s, h) half casts: 1, not 3
    if not parts:
        return lc
    extra = sum(b for _, b in parts)
    tensors = lc.tensors + tuple((b, 0.0) for _, b in parts) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + tuple((n, b, 0.0) for n, b in parts), tensors=tensors)


def split_gate_up_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--split-gate-up``: litgpt's ``LLaMAMLP`` runs the gate and up projections as two
    ``LoRALinear``s, ``fc_1`` and ``fc_2``, each with its own ``nn.Dropout`` and ``lora_A``
    (litgpt/lora.py ``LLaMAMLP.__init__`` at f247be87; litgpt/config.py there gives Phi-3
    ``mlp_class_name="LLaMAMLP"``, and scripts/convert_hf_checkpoint.py L294-298 splits the
    checkpoint's ``gate_up_proj`` into ``fc_1`` and ``fc_2``), where transformers' ``Phi3MLP`` has one
    fused ``gate_up_proj`` and peft one adapter on it. With LoRA on it and a LoRA dropout, litgpt
    keeps one more 1-byte mask and dropped (b, s, h) copy per layer (in the adapters' dtype; lora_A's
    half cast under autocast) and one more rank-r ``lora_A`` output; the projections' outputs are the
    same bytes (``fc_1``'s saved by the SiLU, ``fc_2``'s by the product, where transformers' two
    chunks are views that keep the fused output). Under autocast with the weights trained (no LoRA)
    each of the two linears casts the fp32 input to half for itself and saves that cast, where
    transformers' one linear saves one: one (b, s, h) half cast more (found by trace: Phi-3-shaped,
    bf16-amp, 8 MiB over 2 layers at 2 x 1024 tokens)."""
    if not t.split_gate_up:
        return lc
    if pol.amp and not t.lora_rank:
        extra = float(m.hidden_size * HALF)  # fc_2's own (b, s, h) half cast of the input
    elif t.lora_rank and "gate_up_proj" in set(t.lora_targets or default_lora_targets(m)):
        adapter = pol.half if adapters_computed_half(t) else F32
        dropped = HALF if pol.amp else adapter
        # a dropout: its mask and dropped copy; none: under autocast the second lora_A's own half cast
        own = m.hidden_size * (1 + dropped) if t.lora_dropout > 0 else (m.hidden_size * HALF if pol.amp else 0)
        extra = float(own + t.lora_rank * dropped)
    else:
        return lc
    tensors = lc.tensors + ((extra, 0.0),) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + (("lora.mlp.split_gate_up", extra, 0.0),), tensors=tensors)


def fused_qkv_lora(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[tuple[str, float], ...]:
    """LoRA on litgpt's fused q/k/v linear (``LoRAQKVLinear``), against peft's adapters on the
    separate ``q_proj``/``k_proj``/``v_proj`` that the layer recipe counts: bytes per token, by name.

    * One dropout, one ``lora_A``: ``F.linear(self.lora_dropout(x), self.lora_A)`` runs once over the
      shared input with ``lora_A`` of ``r * n`` rows for the n enabled parts (litgpt/lora.py
      ``LoRAQKVLinear.__init__`` and ``forward``, at 43c44323 and 00af8b0d; lit_gpt/lora.py at
      29de2828), where peft puts an ``nn.Dropout`` and an ``lora_A`` on each of the n linears, each
      saving a 1-byte mask and its dropped (b, s, h) copy: n - 1 of those are not made (negative).
    * ``zero_pad``: with some but not all of q, k and v enabled the delta (b, s, widths of the enabled
      parts) is scattered into zeros of the fused width with ``index_copy`` (or ``index_copy_``,
      litgpt from f247be87), whose backward formula reads ``source`` (tools/autograd's
      derivatives.yaml, ``index_copy``: ``source.dim() > 0 ? grad.index_select(dim, index).expand_as(
      source) : ...``), so autograd saves the delta until the layer's backward (checked on the CPU:
      ``IndexCopyBackward0._saved_source``).
    The delta and the dropped copy are in the adapters' dtype (``pol.half`` for half adapters, else
    fp32; under autocast lora_A saves its half cast and lora_B's output is half)."""
    if not t.lora_rank:
        return ()
    targets = set(t.lora_targets or default_lora_targets(m))
    widths = {"q_proj": m.q_size, "k_proj": m.kv_size, "v_proj": m.kv_size}
    on = [w for name, w in widths.items() if name in targets]
    adapter = pol.half if adapters_computed_half(t) else F32
    dropped = HALF if pol.amp else adapter   # lora_A's saved input (Builder.adapter)
    out = []
    if t.lora_dropout > 0 and len(on) > 1:  # (b, s, h) mask (1 B) and dropped copy per extra peft adapter
        out.append(("lora.qkv.one_dropout", -float((len(on) - 1) * m.hidden_size * (1 + dropped))))
    elif pol.amp and len(on) > 1:  # no dropout: each peft lora_A saves its own half cast of the fp32 input
        out.append(("lora.qkv.one_cast", -float((len(on) - 1) * m.hidden_size * HALF)))
    if 0 < len(on) < 3:
        out.append(("lora.qkv.zero_pad", float(sum(on) * (HALF if pol.amp else adapter))))
    return tuple(out)


def _cast_output_loss_bytes(t: TrainingSpec, held: int, half: int) -> LossBytes:
    """The loss on the fp32 copy of the logits that Lightning Fabric hands the loop (``--cast-output``).

    ``_FabricModule.forward`` ends with ``output = precision.convert_output(output)``, and every
    precision plugin a half run uses (``HalfPrecision`` for bf16-true, ``MixedPrecision``,
    ``FSDPPrecision``, ``BitsandbytesPrecision``) converts each floating tensor of the output, a list
    of chunks included, with ``tensor.to(torch.get_default_dtype())`` (lightning 2.4.0
    ``fabric/wrappers.py`` L135-146, ``fabric/plugins/precision/half.py`` L61-62,
    ``bitsandbytes.py`` L155-156, ``fsdp.py`` L121-122; the same at Lightning master of 2023-09,
    https://github.com/Lightning-AI/pytorch-lightning/blob/master/src/lightning/fabric/wrappers.py).
    So the head's half output (``out``, per element: 2 B) and its fp32 copy (``cast``: 4 B) both
    exist as forward returns; the half one is then unreferenced (``ToCopyBackward`` saves no tensor)
    and the loop keeps the fp32 one (``held``: 4 B). litgpt's loop (``finetune/lora.py``: ``logits =
    model(input_ids, lm_head_chunk_size=128)``, then ``chunked_cross_entropy(logits, ...)``) rebinds
    ``logits`` before its loss, so the previous micro-batch's copy is freed before the loss runs
    (``moments._micro_step``). ``F.cross_entropy`` on fp32 logits: ``log_softmax`` saves fp32
    log-probabilities (4 B; no autocast copy: the input is fp32 already); backward starts with
    ``nll_loss_backward``'s and ``_log_softmax_backward_data``'s fp32 gradients (8 B), one chunk at
    a time under litgpt's chunked loss (``utils.py`` ``chunked_cross_entropy``: one
    ``cross_entropy(reduction="none")`` per chunk), each chunk's gradient cast back to the head's
    dtype by ``ToCopyBackward``. Not counted: the copy ``reshape`` makes of the last chunk when
    litgpt slices it (``logits[-1][..., :-1, :]``) with a micro-batch above 1, alive until the loss
    returns (4 B per element of one chunk, below the backward's 8). With fp32 logits (``--precision
    fp32``) ``.to(fp32)`` returns the tensor itself: nothing is cast, the loop's rebinding stays."""
    kept = F32 if held else 0  # the loop's fp32 copy (fp32 logits: the output itself, nothing cast)
    cast = F32 if half != F32 else 0
    if t.loss == "logps":
        return _logps_bytes(kept, half, cast)
    if t.loss_chunks > 1:
        return LossBytes(kept, half, F32, backward_chunk=2 * F32, cast=cast)
    return LossBytes(kept, half, F32, 0, 2 * F32, cast=cast)


def _logps_bytes(kept: int, half: int, cast: int) -> LossBytes:
    """``--loss logps`` (under ``--cast-output``): TRL's ``selective_log_softmax`` on the shifted fp32
    logits (trl/trainer/utils.py L506-510 at v1.9.0: ``torch.gather(logits, -1, index)``, then
    ``torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])``), per logit element:

    * saved: the fp32 logits themselves (``saves_out``: the cast copy the loss reads), which
      ``GatherBackward`` (``gather_backward(grad, self, ...)``, derivatives.yaml) and each
      ``LogsumexpBackward`` save; forward makes one sequence's ``(self - maxes).exp_()`` at a time
      (ATen ReduceOps.cpp ``logsumexp_out_impl``), per element of the whole logits nothing;
    * backward: autograd runs the later-made nodes first: each sequence's ``LogsumexpBackward``
      (``grad * (self - result).exp()``, FunctionsManual.cpp ``logsumexp_backward``) into
      ``UnbindBackward``'s input buffer (the loop iterates ``logits``, ``Tensor.__iter__`` =
      ``unbind(0)``), which stacks them (4 B), then ``GatherBackward``: ``grad.new_zeros(sizes)
      .scatter_add(dim, index, grad)``, a zero-filled tensor and the out-of-place result (4 + 4 B),
      beside the stacked gradient and the saved logits: 12 B at the start of backward (the shifted
      (s - 1) tokens counted as s). ``SliceBackward``'s (b, s, vocab) zero-filled gradient comes after
      the gather's has been added to the stacked one and freed (8 B), then ``ToCopyBackward``'s half one."""
    return LossBytes(kept, half, F32, 0, 3 * F32, cast=cast, saves_out=1)


def _compiled_loss_bytes(m: ModelSpec, t: TrainingSpec, held: int, half: int) -> LossBytes:
    """The model's own causal-LM loss inside ``torch.compile(model)`` (the graph trace --compile
    runs: AOTAutograd's joint graph with inductor's decompositions, split by inductor's
    ``partition_fn``, ``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``).

    * Forward: inductor's decomposition of ``_log_softmax`` (``torch/_decomp/decompositions.py``
      ``_log_softmax``: ``x - amax(x) - log(sum(exp(x - amax)))``, computed in fp32 from the half
      logits that ``ForCausalLMLoss``'s ``logits.float()`` upcasts) and of ``nll_loss_forward``
      (a gather of one log-probability per token) are pointwise ops and reductions: no
      (tokens, vocab) tensor is written but the head's output. The min cut saves, besides it, the
      per-token ``amax`` and ``log(sum(exp))`` (fp32, (tokens, 1) each) and the labels shifted by
      ``ForCausalLMLoss`` (``F.pad(labels, (0, 1), value=-100)``: int64, (b, s + 1)): 16 bytes per
      token. The logits (half, (b, s, vocab)) are saved too: they are the loop's output when it
      holds it (counted there: ``held``), else saved for backward only.
    * Backward: AOTAutograd's ``CompiledFunction`` is an autograd function, which materializes a
      zero gradient for every output the loss does not reach (``torch/_functorch/_aot_autograd/
      runtime_wrappers.py``: tangents of unused outputs are ``zeros_like``): the logits' (half) and
      every KV-cache tensor's (``Quantities.loss_backward_tok``, set in ``_build``). The loss's backward (``_log_softmax_backward_data``
      and ``nll_loss_backward`` decomposed: ``grad - exp(x - amax - log) * sum(grad)`` with the
      ``where`` inductor's joint-graph pass makes of the scatter) is fused into one kernel that reads
      the saved logits and the zero tangent and writes the logits' gradient in the logits' dtype.
      Trace's graph runner frees the saved logits at the fused chain's first read (their last use
      in the graph, node ``convert_element_type`` of the logits) and the tangent after the ``add``
      that writes the gradient: at the start of backward the saved logits and the zero tangent
      are alive (one half logits-sized tensor on top of the saved ones); the gradient then
      replaces the saved logits. When the loop holds the output (``--hold-output step|backward``)
      the logits outlive the graph's read, and the gradient comes on top: two half tensors.
    Checked against trace --compile (tests/test_estimate_compile.py).
    """
    saved = 0 if held else half  # the logits: the held output, else saved for the backward only
    # backward: the zero tangent (half), and the gradient (half) when the held logits outlive the read
    return LossBytes(held, half if held else 0, saved, 0, (2 if held else 1) * half, saved_tok=2 * F32 + 8)


def _loss_parallel_bytes(held: int, half: int, on_half: bool, amp: bool) -> LossBytes:
    """The loss on vocabulary-sharded logits under ``loss_parallel()`` (PyTorch's tensor parallelism:
    the head's logits are (b, s, vocab / tp) DTensors, ``trainmem.wrappers.parallel_loss``). Its
    handlers replace the fused CUDA kernels with decompositions (torch 2.13
    ``torch/distributed/tensor/parallel/loss.py``), each tensor (b, s, vocab / tp):

    * forward, ``_log_softmax`` (L197-221): the input in fp32 (``logits.float()`` for ``upcast``;
      ``x.to(computation_dtype)``, fp32, of half logits for ``half``; none when they are fp32),
      ``shifted = x - x_max`` and ``torch.exp(shifted)`` are alive together; ``result = shifted -
      logsumexp`` replaces the exponentials and is cast back to half logits' dtype (``result.to(
      result_dtype)``): three fp32 tensors, and the half result, at the most;
    * saved: the log-probabilities (fp32 for ``upcast``; half for ``half``, plus the fp32 copy
      autocast makes for ``nll_loss``, an fp32-list op);
    * backward, ``_nll_loss_and_log_softmax_backward`` (L451-518), which does the log-softmax's
      backward too, in the saved log-probabilities' dtype: ``grad_input = torch.zeros_like(x)``,
      ``torch.exp(x)`` and their sum, then the product with the gradient replaces the exponentials:
      three tensors (the native kernels make two, ``nll_loss_backward``'s and
      ``_log_softmax_backward_data``'s)."""
    if not on_half or half == F32:
        copy = F32 if half != F32 else 0   # logits.float(): a copy of half logits, fp32 ones returned as they are
        return LossBytes(held, half, F32, copy + F32, 3 * F32)
    if amp:
        return LossBytes(held, half, half + F32, 2 * F32, 3 * F32)
    return LossBytes(held, half, half, 3 * F32, 3 * half)


def _head_weight_numel(m: ModelSpec, tp: int) -> int:
    """Elements of the LM head's weight on this rank (a tied head is the input embedding)."""
    head = [p for p in m.parameter_tensors() if p.role != "embedding" and p.layer is None and p.is_matmul
            and not (m.is_vlm and VISION_SIDE.search(p.name))]  # (not a VLM's vision tower nor projector)
    p = head[-1] if head else word_embedding(m)
    return -(-p.numel // tp)


def step_temporaries(t: TrainingSpec, st: States, m: ModelSpec | None = None) -> int:
    """Bytes ``optimizer.step()`` allocates and frees again (steady state, states already exist).

    From torch/optim/adam.py (torch 2.13; AdamW = Adam with decoupled weight decay, in place):
      * for-loop (``_single_tensor_adam``): ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)
        .add_(eps)``: the square root and the quotient of one tensor coexist -> 2 x the largest
        parameter (in the state dtype);
      * foreach (``_multi_tensor_adam``): ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``
        then in-place div/add/addcdiv -> one state-sized tensor per parameter, the whole group at once;
      * fused (``_fused_adamw_``): none.
    Measured on the CPU with ``trainmem.measure.LiveBytes`` (tests/test_optim_transients.py).
    Under optimizer-in-backward each parameter has its own optimizer: foreach is a group of one
    (1 x the parameter), for-loop 2 x, fused none; the largest parameter sets the peak.
    """
    k = step_copies(t)
    if deepspeed_zero(t) and not t.offload_optimizer and st.trainable:
        # DeepSpeed hands the optimizer one flat fp32 partition per group: a per-tensor loop or a
        # foreach step sees that one tensor (``deepspeed_group_elems``); fused steps make none
        flat = block_of(t, deepspeed_group_elems(t, st) * 4)
        return deepspeed_step_grad(t, st, m) + (foreach_groups(t) * flat if k is None else k * flat)
    if t.optimizer == "adafactor" and not t.offload_optimizer:
        return _adafactor_temporaries(t, st, k)
    if t.torchao_block:
        # torchao's low-bit AdamW: one compiled graph per tensor, its buffers freed when it returns
        # (estimate.torchao_optim.step_events; the largest tensor's set the peak)
        return st.torchao_step
    if k is None:
        return foreach_groups(t) * st.foreach_group
    if k and step_lingers(t) and st.trainables:
        return loop_pair_bytes(st, k)
    return k * block_of(t, st.largest_param)


#: per-tensor loops that keep the last temporary of a tensor in a local until the next tensor's
#: replaces it (``loop_pair_bytes``)
LINGERING_LOOPS = ("adam", "adamw", "adagrad", "rmsprop", "schedule-free-adamw", "schedule-free-radam")


def step_lingers(t: TrainingSpec) -> bool:
    """Whether the step is such a loop over whole tensors (``LINGERING_LOOPS``, for-loop, one
    optimizer for every parameter, the states not sharded)."""
    return (t.optimizer in LINGERING_LOOPS and t.impl == "for-loop" and not t.grads_freed_in_backward
            and not t.offload_optimizer and t.zero_stage == 0 and t.fsdp is None and t.gemini is None)


def loop_pair_bytes(st: States, copies: int) -> int:
    """A per-tensor loop whose expression makes ``copies`` temporaries of the tensor's size and
    keeps the last in a local variable: torch 2.13 ``_single_tensor_adam`` (adam.py L544
    ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: the square root and the
    quotient, 2), ``_single_tensor_adagrad`` (adagrad.py L425 ``std = state_sum.sqrt().add_(eps)``,
    1), ``_single_tensor_rmsprop`` (rmsprop.py L325 ``avg = square_avg.sqrt()``, 1), schedule_free's
    ``denom = exp_avg_sq.div(bias_correction2).sqrt_().add_(eps)`` (1). The previous tensor's
    temporary is freed only when the name is rebound, after the next tensor's are made, so the
    peak is the largest ``previous + copies x this`` over neighbours in parameter order (a
    state-sized block each; a GPT-2's token embedding and then its position embedding; a Llama
    whose MLP matrices are its largest: gate_proj, then up_proj), measured with LiveBytes
    (tests/test_hf_optimizers.py)."""
    order = [st.trainables[j][3] for j in parameter_order(st.trainables)]
    sizes = [sts[0] for sts in order if sts]
    return max([copies * x for x in sizes[:1]] + [a + copies * b for a, b in zip(sizes, sizes[1:])])


def foreach_groups(t: TrainingSpec) -> int:
    """State-sized temporaries per tensor a foreach step holds at once, for the whole group. Adam,
    RMSprop and the schedule-free optimizers: one (``torch._foreach_sqrt(exp_avg_sqs)``, rmsprop.py
    L448 ``avg = torch._foreach_sqrt(square_avgs)``, schedule_free ``denom = torch._foreach_div(exp_avg_sq,
    bias_correction2)``, the update then in place: ``_foreach_div_(grad, denom)``). Adagrad: two
    (torch 2.13 ``adagrad.py`` ``_multi_tensor_adagrad`` L530-540: ``std = torch._foreach_sqrt(state_sums)``
    and, without weight decay or maximize, ``numerator = torch._foreach_mul(device_grads, minus_clr)``
    in the gradient's dtype, the parameter's, both alive at ``_foreach_addcdiv_``). Adam and AdamW before
    PyTorch 2.1: two (``exp_avg_sq_sqrt`` and ``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``, torch
    2.0 ``adam.py`` / ``adamw.py`` ``_multi_tensor_adam(w)``; ``spec.releases.foreach_adam_denom_copy``)."""
    if t.optimizer in ("adam", "adamw") and t.foreach_adam_denom_copy:
        return 2
    return 2 if t.optimizer == "adagrad" else 1


def deepspeed_zero(t: TrainingSpec) -> bool:
    """Whether DeepSpeed's ZeRO engine runs the step: ``--zero`` 1-3 (FSDP and Megatron's
    distributed optimizer shard their own way)."""
    return t.zero >= 1 and t.fsdp is None and not t.distributed_optimizer


def grads_from_wrap(t: TrainingSpec) -> bool:
    """Whether the gradients' memory exists from model wrap and is never freed: Megatron's main-grad
    buffers (its DDP's, with or without the distributed optimizer: ``TrainingSpec.megatron_ddp``),
    DeepSpeed ZeRO-3's ``grad_partitions_flat_buffer``
    (``torch.zeros`` of this rank's partition in the engine's dtype, made in ``__init__``, the
    partitioned gradients are views of it: ``stage3.py`` L542-557 at 38327e0; in host memory when
    the optimizer is offloaded)."""
    return t.distributed_optimizer or t.megatron_ddp or (deepspeed_zero(t) and t.zero == 3 and not t.offload_optimizer)


def deepspeed_buckets(t: TrainingSpec) -> tuple[int, int]:
    """(bytes from engine start, bytes alive only during backward) of DeepSpeed ZeRO's gradient
    bucket buffers: ``reduce_bucket_size`` elements each in the engine's dtype (fp16/bf16 weights:
    2 bytes, else 4), allocated whatever the model's size. DeepSpeed at commit 38327e0:

    * stage 3 (``deepspeed/runtime/zero/stage3.py`` L536-540): with ``contiguous_gradients`` one
      ``__ipg_bucket_flat_buffer = torch.empty(reduce_bucket_size)``, made in ``__init__`` and kept;
    * stages 1 and 2 (``stage_1_and_2.py`` ``backward`` L2047-2061): with ``contiguous_gradients``
      every backward makes ``buf_0`` and, under ``overlap_comm``, a second ``buf_1`` (its comment:
      double buffers to avoid a data access conflict); ``_release_ipg_buffers`` (L676-679, called
      when backward's gradients are reduced, L802) drops them. From v0.18.3 the same buffers are
      made by the first gradient's hook (``setup_buckets``, v0.19.8 L3256-3281), after the loss's
      and the head's backward (``TrainingSpec.ds_buckets_at_backward_start``, ``ds_loss_buf``).

    Without ``contiguous_gradients`` gradients stay where autograd made them (no buffer)."""
    if not deepspeed_zero(t) or not t.contiguous_gradients:
        return 0, 0
    one = block_of(t, t.ds_reduce_bucket * t.weight_bytes)  # (reduce_bucket_size,) fp16/bf16 or fp32
    if t.zero == 3:
        return one, 0
    return 0, (2 if t.ds_overlap_comm else 1) * one


def _deepspeed_fields(m: ModelSpec, t: TrainingSpec, st: States) -> dict[str, int]:
    """The ``Quantities`` fields of DeepSpeed's ZeRO engine (all 0 off it)."""
    kept, backward = deepspeed_buckets(t)
    fp32, flat = deepspeed_step_parts(t, st, m)
    each = kept or (backward // (2 if t.ds_overlap_comm else 1))
    top, low = deepspeed_gathered(m, t, st)
    # ZeRO-2 (and ZeRO-1 reducing in its hooks) copies each reduced bucket's share into
    # ``grads_in_partition``, one buffer made at the first reduction holding one of the rank's parameters:
    # from the backward moment ``deepspeed_partition_from`` finds, or after backward (then 0 here)
    held = deepspeed_partition_grads(m, t, st)
    hooked = deepspeed_hooks_reduce(t)
    made = deepspeed_partition_from(m, t, st) if hooked else PARTITION_AFTER
    part = held if made < PARTITION_AFTER else 0
    # the step (``deepspeed_step_grad``): stages 1 and 2 free every gradient before the optimizer runs,
    # ZeRO-3's partition buffer stays
    cast, opt = (held, 0) if t.zero in (1, 2) else (st.grads, st.grads)
    if not fp32:
        cast = opt = 0
    # the buckets exist in the loss's and the head's backward only when backward's start makes them
    # (before v0.18.3); since, the first gradient's hook does (a head's weight, or a tied head's final norm)
    loss_buf = backward if t.ds_buckets_at_backward_start else 0
    return {"ds_backward_buf": backward, "ds_loss_buf": loss_buf, "ds_bucket": each, "ds_step_fp32": fp32,
            "ds_fp32_convert": deepspeed_fp32_convert(t, st),
            "ds_fp32_group": deepspeed_fp32_group(t, st), "ds_init_grads": deepspeed_init_grads(t, st),
            "ds_partition": deepspeed_partition_elems(t, st),
            "ds_offload_buf": deepspeed_offload_grad_buffer(t, st),
            "ds_offload_steps": deepspeed_offload_epilogue(m, t, st), "ds_linear_kept": deepspeed_linear_kept(m, t),
            "ds_linear_wrap": int(deepspeed_linear_wrap(t)),
            "ds_step_flat": flat,
            "ds_gathered_top": top, "ds_gathered_low": low, "ds_coalesced": deepspeed_coalesced(m, t),
            "ds_gathered_head": deepspeed_gathered_head(m, t, st), "ds_gathered_fwd": deepspeed_gathered_forward(m, t, st),
            "ds_head_wgrad": deepspeed_head_wgrad(m, t, st),
            "ds_gathered_emb": deepspeed_gathered_embedding(m, t),
            "ds_reduce_cat": deepspeed_reduce_cat(t, st), "ds_reduce_cats": deepspeed_reduce_cats(t, st),
            "ds_layer_params": deepspeed_layer_params(m, t), "ds_param_bytes": t.weight_bytes,
            "ds_events": deepspeed_gather_events(m, t, st),
            "ds_prefetch": t.ds_prefetch if deepspeed_layer_params(m, t) else 0, "ds_max_live": DS_MAX_LIVE,
            "ds_emb_numel": deepspeed_gathered_embedding(m, t) and next(
                (-(-p.numel // t.tp) for p in m.parameter_tensors() if p.role == "embedding"), 0),
            "ds_layers_kept": deepspeed_layers_kept(m, t, st),
            "ds_emb_kept": int(deepspeed_embedding_kept(m, t, st)),
            # v0.19.8 ``parameter_offload.py`` L195-196, ``stage3.py`` L340-341: the side streams exist
            # under ``overlap_comm`` (else the default stream is used)
            "ds_streams": int(deepspeed_zero(t) and t.zero == 3 and t.ds_overlap_comm),
            "ds_norm_fp64": t.weight_bytes if (deepspeed_zero(t) and t.zero == 3 and not t.offload_optimizer
                                                and st.trainable > 0) else 0,
            "ds_partition_grads": part, "ds_cast_grads": cast,
            "ds_partition_from": made,
            "ds_emb_grads": deepspeed_grads_at_embedding(m, t, st) if hooked else 0,
            # under accumulation ZeRO-2's epilogue keeps the partition's gradients (the parameters' own
            # ``.grad``, the views of ``grads_in_partition`` with contiguous gradients) in
            # ``all_grad_tensors`` until the boundary (``get_all_grad_tensors``, L1036-1044, L2703-2710),
            # so a later micro-batch makes its own ``grads_in_partition`` beside them
            "ds_accumulated": held if hooked and t.zero == 2 else 0,
            "ds_host_grads": int(deepspeed_grads_on_host(t, st)), "ds_keeps_sum": int(deepspeed_keeps_tied_sum(m, t, st)), "ds_offload_clone": deepspeed_offload_clone(t, st),
            "ds_offload_upload": deepspeed_offload_upload(t, st),
            "ds_flat_group": deepspeed_flat_on_gpu(t, st), "ds_flat_frees": int(deepspeed_flat_frees(m, t, st)),
            "ds_flat_need": deepspeed_flat_on_gpu(t, st) and st.weights + st.buffers + deepspeed_flat_on_gpu(t, st),
            **dict(zip(("ds_reduce_grads", "ds_reduce_flat"), deepspeed_epilogue(m, t, st))),
            "ds_epilogue_cats": deepspeed_epilogue_cats(m, t, st),
            # ZeRO-1 reduces at the boundary only (``engine.py`` v0.19.8 ``allreduce_gradients`` L3083-3093),
            # so ``_release_ipg_buffers`` (L924-932, from the epilogue) runs there only: the buckets the
            # first micro-batch's first hook made (``setup_buckets``, made once until released) stay
            # through the later micro-batches' forward and loss
            "ds_kept_buf": backward if (t.zero == 1 and t.grad_accum > 1) else 0,
            "ds_bucketed": int(hooked),
            "ds_norm_temp": deepspeed_norm_temp(m, t, st), "ds_flat12": deepspeed_group_elems(t, st) if deepspeed_flat12(t, st) else 0,
            "ds_clone12": deepspeed_clone12(t, st),
            "ds_epilogue_part": held if made == PARTITION_AFTER and deepspeed_epilogue_partition(m, t, st) else 0,
            **_hook_partition_fields(m, t, st, made),
            **dict(zip(("ds_offload_grad", "ds_offload_check"), deepspeed_offload_check(m, t, st))),
            **dict(zip(("ds_head_grad", "ds_head_check"), deepspeed_offload_check_head(m, t, st))),
            "ds_opt_grads": opt}


def deepspeed_flat12(t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-1/2 keeps its fp32 master and optimizer states on the GPU as flat tensors
    of this rank's partition (``states.flat_zero``): the reserved replay makes the master as
    ``DeepSpeedZeroOptimizer.__init__`` does and the states inside the first step
    (``reserved._zero12_master``, ``reserved._zero12_step``)."""
    return deepspeed_zero(t) and t.zero in (1, 2) and flat_zero(t) and st.trainable > 0 and st.master > 0


def deepspeed_epilogue_partition(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-1 on the GPU makes rank 0's ``grads_in_partition``
    (``deepspeed_partition_grads``) in backward's epilogue and drops the parameters' own gradients there
    (the reserved replay's ``_zero12_epilogue``): with ``contiguous_gradients`` and without
    ``overlap_comm``, whose hooks reduce nothing, so it reduces only there. (ZeRO-2's hooks free each gradient as they copy it into the bucket buffer, which the replay's
    per-parameter shards stand for; not replayed here.) ZeRO-1's
    ``reduce_gradients`` (v0.19.8 ``stage_1_and_2.py`` L958-981, from the engine's ``allreduce_gradients``
    L3083-3093) walks the parameters: a gradient is copied into the bucket buffer
    (``reduce_independent_p_g_buckets_and_remove_grads`` L1450-1460: the parameter's ``.grad`` becomes a
    view of it, its own storage freed) or, larger than the bucket, reduced alone; each reduction copies
    the partition's parameters into ``grads_in_partition`` (``reduce_ipg_grads`` L2205-2274 ->
    ``copy_grads_in_partition`` L2142-2195: ``torch.empty`` of the whole parameters that overlap the
    partition, made by the first copy) and the epilogue ends with every ``.grad`` cleared
    (``_clear_param_grad_only``, L1067), so only that buffer reaches the step, which drops it after
    its fp32 cast (trace: a 2-layer Qwen3 ZeRO-1 over 4 ranks, its 296.75 MiB embedding-sized buffer
    made after the embedding's backward, the gradients freed after it). v0.14.2 the same
    (``reduce_ipg_grads`` L1404-1406, ``copy_grads_in_partition``), except that it clears no ``.grad``:
    those outside the partition stay views of the bucket buffer until the step frees them (L1876), which
    keeps that buffer (``reduce_bucket_size`` elements) alive to the step; not replayed. Not offloaded,
    not under a partial layout (``_partial_layout``)."""
    return deepspeed_zero(t) and t.zero == 1 and not t.offload_optimizer and st.trainable > 0 \
        and t.contiguous_gradients and not t.ds_overlap_comm and not _partial_layout(m, t, st)


def _hook_partition_fields(m: ModelSpec, t: TrainingSpec, st: States, made: int) -> dict[str, int]:
    """``ds_hook_part``, ``ds_hook_at``, ``ds_reduce_side`` (``deepspeed_hook_partition``; off it 0, -1, 0)."""
    if not deepspeed_hook_partition(m, t, st):
        return {"ds_hook_part": 0, "ds_hook_at": -1, "ds_reduce_side": 0}
    return {"ds_hook_part": deepspeed_partition_grads(m, t, st), "ds_hook_at": made,
            "ds_reduce_side": int(t.ds_overlap_comm)}


def deepspeed_hook_partition(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether the reserved replay makes DeepSpeed ZeRO-1/2's ``grads_in_partition`` where its gradient
    hooks reduce the buckets (``deepspeed_hooks_reduce``), with ``contiguous_gradients``, one micro-batch:
    each hook copies its parameter's gradient into the bucket buffer and frees it
    (``reduce_independent_p_g_buckets_and_remove_grads``, v0.19.8 ``stage_1_and_2.py`` L1450-1460; a
    parameter larger than the bucket is reduced alone and its gradient freed when it is copied into the
    partition or cleared, ``reduce_ipg_grads`` L2253-2274), and the first reduction holding one of rank
    0's parameters makes ``grads_in_partition`` (``copy_grads_in_partition`` L2184-2195) at the moment
    ``deepspeed_partition_from`` finds (the epilogue when none in backward), on the reduction stream
    under ``overlap_comm`` (``reduce_ipg_grads`` L2239-2249: ``stream = self.reduction_stream``), whose
    pool no default-stream tensor shares (found by trace: Mistral-shaped ZeRO-1 ``overlap_comm`` over 2
    ranks, its 90.5 MiB buffer in a segment of its own). The step drops it after the fp32 cast. Not
    offloaded, under accumulation or a partial layout (``_partial_layout``)."""
    return deepspeed_zero(t) and t.zero in (1, 2) and not t.offload_optimizer and st.trainable > 0 \
        and t.contiguous_gradients and deepspeed_hooks_reduce(t) and t.grad_accum == 1 \
        and not _partial_layout(m, t, st)


def deepspeed_clone12(t: TrainingSpec, st: States) -> int:
    """Bytes of the clone of this rank's half partition DeepSpeed ZeRO-1/2 casts its fp32 master from
    (``deepspeed_flat12``; 0 off it or for fp32 weights, whose clone is the master itself):
    ``.detach().clone().to(device, fp32)`` (v0.19.8 ``stage_1_and_2.py`` L560-561; v0.14.2 L393-394
    ``.to(device).clone().float()``, the same blocks), ceil(trainable / dp) elements in the weights' dtype."""
    if not deepspeed_flat12(t, st) or t.weight_bytes == 4:
        return 0
    return block_of(t, -(-st.trainable // t.shard_group) * t.weight_bytes)


def deepspeed_norm_temp(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes of the float64 copy DeepSpeed ZeRO-1/2's step makes of the largest gradient piece of
    rank 0's partition to take its norm (0 off them, or offloaded): ``step`` -> ``scaled_global_norm``
    -> ``get_grad_norm_direct`` over ``averaged_gradients`` (the partition's pieces of each parameter),
    ``torch.linalg.vector_norm(g.data.to(get_norm_dtype()))`` per piece, ``get_norm_dtype()`` float64
    on CUDA (``stage_1_and_2.py`` v0.19.8 L2677-2685, L59-63, called at L2951 before the fp32 cast at
    L3117; ``g.data.double().norm(2)`` at v0.9.0 L1503, ``vector_norm(g.data.double())`` at v0.16.4
    L1699): one piece at a time, each freed after its norm. Rank 0's pieces run from the first
    parameter to its partition's end (``deepspeed_partition_grads``); LoRA adapters (small pieces)
    are neglected, a tensor- or pipeline-parallel layout takes its largest tensor's shard."""
    if not (deepspeed_zero(t) and t.zero in (1, 2) and not t.offload_optimizer and st.trainable):
        return 0
    part = -(-st.trainable // t.shard_group)   # elements of rank 0's partition
    tensors = m.parameter_tensors()
    if t.lora_rank:
        return 0
    if t.tp > 1 or t.pp > 1 or tensor_elements(tensors) != st.trainable:
        return block_of(t, min(part, largest_tensor_elements(tensors) // t.tp) * 8)
    largest, start = 0, 0
    for p in tensors:
        if start >= part:
            break
        largest = max(largest, min(start + p.numel, part) - start)
        start += p.numel
    return block_of(t, largest * 8)              # (piece,) float64


def deepspeed_offload_steps(t: TrainingSpec, piece: int, whole: int) -> tuple[tuple[int, ...], ...]:
    """The device tensors DeepSpeed ZeRO-1/2, the optimizer offloaded (``contiguous_gradients`` forced
    on: ``self.contiguous_gradients = contiguous_gradients or self.cpu_offload``, ``stage_1_and_2.py``
    v0.14.2 L205, v0.19.5 L259, v0.19.8 L300), makes for one gradient of its partition at the
    accumulation boundary: ``copy_grads_in_partition``'s three calls, one after another, each step's
    tensors alive together and freed before the next; as raw bytes per step. ``piece``: the gradient's
    elements in the rank's partition (``grad_position``'s ``num_elements``), ``whole``: the parameter's.

    1. ``set_norm_for_param_grad_in_gpu``: ``accumulated_grad.view(-1).narrow(...).double().norm(2)``,
       a (piece,) float64 copy, 8 B per element, in every release read: ``.double()`` at v0.14.2
       L1244-1257, v0.16.9 L1259-1272, v0.17.0 L1275-1288, v0.19.5 L1548-1561; ``.to(get_norm_dtype())``
       from v0.19.6 (L1585-1598), ``torch.double`` on a device with float64 (``zero/utils.py`` v0.19.8
       L59-63). v0.19.8's compact partition buffer (L2145-2160) is taken only when ``grad_accum_dtype``
       is fp32 and the model's dtype is not (L1259-1266); the engine's default is the model's dtype
       (``engine.py`` v0.19.8 ``get_data_types`` L1799-1810), so the per-gradient path stays (L2161-2178).
    2. ``_has_inf_or_nan`` on the parameter's whole gradient, elementwise up to v0.19.5:
       ``float_x = x.float()`` (whole,) fp32, ``isnan``, ``isinf``, ``logical_or`` (whole,) bool each,
       ``inf_or_nan.float()`` (whole,) fp32: 11 B per element (v0.14.2 L1167-1170, L2019-2025; v0.17.1+
       through ``update_offload_overflow_tracker_for_param_grad``; v0.19.5 L1471-1477, L2459-2465).
       DeepSpeed #8325 ("stop allocating per-element temporaries in the overflow check", stas00) made it
       ``runtime/utils.py`` ``has_inf_or_nan``: ``isfinite(x.amax())`` and ``x.amin()``, scalars only
       (v0.19.6 L225-248, v0.19.8 L205-228); v0.19.6 (2026-08-27) is the first release with it, read from
       the v0.19.5 tag (elementwise) and the v0.19.6 and v0.19.7 sdists (``TrainingSpec.ds_elementwise_overflow``).
    3. ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: the (piece,) slice cast to fp32 on the device
       before the host copy, 4 B per element (``src_tensor.float()``, v0.14.2 L1259-1275, through
       v0.18.2; ``src_tensor.to(self.master_weights_and_grads_dtype)`` from v0.18.3, v0.19.5 L1563-1578),
       none for an fp32 gradient (``.float()`` and ``.to`` return the tensor itself)."""
    steps: list[tuple[int, ...]] = [(piece * 8,)]                 # (piece,) float64
    if t.ds_elementwise_overflow:                                 # (whole,) fp32, 3 x (whole,) bool, fp32
        steps.append((whole * 4, whole, whole, whole, whole * 4))
    if t.weight_bytes != 4:                                       # (piece,) fp32
        steps.append((piece * 4,))
    return tuple(steps)


def deepspeed_offload_clone(t: TrainingSpec, st: States) -> int:
    """Bytes of the half clone of the rank's flat partition that DeepSpeed ZeRO-1/2, the optimizer
    offloaded, makes on the GPU at init (0 otherwise): from v0.18.3 the fp32 master partition is
    ``parallel_partitioned_bit16_groups[i][partition_id].detach().clone().to(device=self.device,
    dtype=...)`` (v0.18.3 ``stage_1_and_2.py`` L449, v0.19.8 L559-561): the clone is made where the
    partition is, on the GPU, in the engine's half dtype, ceil(trainable / dp) elements, and freed once
    ``.to`` has copied it to the host (``self.device`` is ``cpu``), before ``temp_grad_buffer_for_gpu_offload``
    (L653-661). Up to v0.18.2 it was ``.to(self.device).clone().float()`` (v0.14.2 L393-394): the host copy
    first, nothing on the GPU. Its segment stays cached under the offload buffer and the forward's first
    tensors (found by trace: DeepSpeed 0.19.8's engine on Giles Thomas's Qwen1.5-0.5B offload setup)."""
    if not _offloads_grads(t, st) or t.deepspeed_release() < (0, 18, 3):
        return 0
    return block_of(t, -(-st.trainable // t.shard_group) * t.weight_bytes)


def deepspeed_offload_upload(t: TrainingSpec, st: States) -> int:
    """Bytes of the fp32 master partition that DeepSpeed ZeRO-1/2, the optimizer offloaded, copies to the
    GPU at each step before v0.17.0 (0 otherwise): after the host optimizer's step,
    ``bit16_partitions[partition_id].data.copy_(fp32_partition.to(get_accelerator().current_device_name()).data)``
    (v0.14.2 ``stage_1_and_2.py`` L1868-1871, v0.16.9 L1888-1891): ``.to`` makes a (partition,) fp32 tensor
    on the GPU, the cast into the half partition reads it there, and it is freed when the statement ends
    (a step that overflows returns before it, L1829-1842). The partition is ceil(trainable / (2 x dp)) x 2
    elements (the flat group padded to ``nccl_start_alignment_factor`` 2 x the data-parallel size, L350-362,
    split in dp equal parts). DeepSpeed #7309 ("Fix the GPU memory usage of ZeRO-Offload", first in
    v0.17.0: a pinned 16-bit host buffer, ``param_buffer_of_bit16_for_cpu_offload_groups``, copied in
    place) says of the old path: "the memory usage is about 3x that of params_FP16". Found on Giles
    Thomas's Llama-3-8B ZeRO-2 offload rows (DeepSpeed 0.14.2, dp 8): ranks 1-4 peak at 20,418 MiB at one
    token, the half weights (15,316.5 MiB), the offload buffer (1,002.0), two cuBLAS workspaces and this
    3,829.1 MiB copy making 20,164 MiB; none of their backward moments comes near it."""
    if not _offloads_grads(t, st) or t.deepspeed_release() >= (0, 17, 0):
        return 0
    align = 2 * t.shard_group                                     # nccl_start_alignment_factor x world size
    return block_of(t, -(-st.trainable // align) * 2 * 4)         # (partition,) fp32


def deepspeed_flat_on_gpu(t: TrainingSpec, st: States) -> int:
    """Bytes of the flat copy of the trainable parameters that DeepSpeed ZeRO-1/2 makes on the GPU beside
    them at init, from v0.19.0 (0 before, or off ZeRO-1/2): ``DeepSpeedZeroOptimizer.__init__`` flattens each
    parameter group on the accelerator when ``available_memory() >= flat_buffer_bytes`` (v0.19.0
    ``stage_1_and_2.py`` L383-423, v0.19.8 L449-510; commit 37e232faf, DeepSpeed PR #7948), then points the
    parameters at it (``_update_model_bit16_weights``, L535), which frees their own storages; up to v0.18.x
    each group went to the host first (``param.data.cpu()``, ``empty_cache()``, v0.14.2 L318-362): nothing
    on the GPU beside it. ``flat_buffer_bytes``: the group's elements rounded up to
    ``nccl_start_alignment_factor`` (2, v0.19.8 L387) x the data-parallel size, in the engine's dtype
    (fp16/bf16, fp32 for an fp32 engine: ``t.weight_bytes``), one (elements,) tensor (``torch.cat``); the
    per-parameter padding to 16 bytes (L444-445) and the split into the HF Trainer's decay and no-decay
    groups (the norms and biases, a few MiB) are left out: one group holds every trainable element. Whether
    it fits is decided on the GPU's free memory where the GPU is known (``without_gpu_flatten``)."""
    if not (deepspeed_zero(t) and t.zero in (1, 2) and st.trainable) or t.deepspeed_release() < (0, 19, 0):
        return 0
    align = 2 * t.shard_group                                     # nccl_start_alignment_factor x world size
    return block_of(t, -(-st.trainable // align) * align * t.weight_bytes)   # (elements,) half


_ELEMENTS: dict[int, tuple] = {}


def tensor_elements(tensors: tuple) -> int:
    """Elements of ``tensors`` (a model's ``parameter_tensors()``, the sum of each ``ParamTensor.numel``,
    the product of its shape), computed once per tuple: the same for every layout of the model, which
    the DeepSpeed fields below compare with each layout's trainable elements (``_build`` of every shape).
    Keyed by the tuple's identity, which the entry keeps alive (a ``ModelSpec`` builds it once)."""
    hit = _ELEMENTS.get(id(tensors))
    if hit is None or hit[0] is not tensors:
        if len(_ELEMENTS) >= 64:                         # (models met: few; a tuple built per call: bounded)
            _ELEMENTS.clear()
        numels = [p.numel for p in tensors]
        hit = _ELEMENTS[id(tensors)] = (tensors, sum(numels), max(numels, default=0))
    return hit[1]


def largest_tensor_elements(tensors: tuple) -> int:
    """Elements of the largest of ``tensors`` (``max`` of each ``ParamTensor.numel``), once per tuple
    as ``tensor_elements``; 0 for none."""
    tensor_elements(tensors)
    return _ELEMENTS[id(tensors)][2]


def deepspeed_flat_frees(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether the flat group of ``deepspeed_flat_on_gpu`` holds every weight of the model (no frozen
    parameter), so that the reserved replay frees the loaded weights' blocks once it exists (a LoRA run's
    group holds its adapters only; their small blocks stay in the replay)."""
    return bool(deepspeed_flat_on_gpu(t, st)) and st.trainable >= tensor_elements(m.parameter_tensors()) // t.tp


def without_gpu_flatten(q: "Quantities", room: int | None) -> "Quantities":
    """``q`` with DeepSpeed's flat group made on the host when it does not fit in the GPU's free memory
    (``deepspeed_flat_on_gpu``): ``available_memory()`` is NVML's free bytes (``CUDA_Accelerator``,
    v0.19.8 ``accelerator/cuda_accelerator.py`` L193-201), after ``empty_cache()`` (``stage_1_and_2.py``
    L449): ``room`` (the GPU's capacity less its CUDA context and other processes, bytes) less the loaded
    weights and buffers (``Quantities.ds_flat_need``). ``room`` None (no GPU given): the flat group is
    taken to fit, the common case (a model whose half copy fits twice), and ``q`` is returned as it is.
    ``q`` of many layouts (``gather``'s arrays): the transient is dropped row by row."""
    if room is None:
        return q
    if isinstance(q.ds_flat_need, np.ndarray):
        return replace(q, ds_flat_temp=np.where(q.ds_flat_need <= room, q.ds_flat_temp, 0))
    if q.ds_flat_need <= room:
        return q
    return replace(q, ds_flat_group=0, ds_flat_temp=0, ds_flat_frees=0, ds_flat_need=0)


def deepspeed_grads_on_host(t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-2, the optimizer offloaded (its hooks reduce in every micro-batch's
    backward, ``process_gradients`` under ``partition_gradients``, v0.19.8 L2284-2291; ZeRO-1's only at
    the boundary, so its earlier micro-batches keep ``.grad``), leaves no gradient on the GPU from one
    micro-batch to the next: each
    reduced gradient of the rank's partition goes to a host buffer (``copy_grads_in_partition`` ->
    ``async_accumulate_grad_in_cpu_via_gpu`` when ``micro_step_id > 0 or not boundary``, the host's
    ``accumulated_grads_in_cpu``; v0.19.8 ``stage_1_and_2.py`` L1809-1871, L2161-2170; v0.14.2 the same
    under ``gradient_accumulation_steps > 1``), the other parameters' are cleared, and backward's epilogue
    frees the rest: ``zero_grad(set_to_none=True)`` (v0.14.2 ``independent_gradient_partition_epilogue``
    L795); on the GPU there is no ``averaged_gradients`` partition to keep (``if self.cpu_offload is False``,
    v0.14.2 L769, v0.19.8 L1032). Found by trace: a 2-layer Llama over 2 ranks, ZeRO-2 offloaded,
    2 micro-batches, 5e5-element buckets: the second micro-batch's loss backward holds no gradient
    (the estimate held the sharded gradients there, +8.8 %)."""
    return _offloads_grads(t, st) and t.zero == 2


def deepspeed_keeps_tied_sum(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-2 on the GPU without ``contiguous_gradients`` keeps a tied word embedding's
    whole gradient on rank 0 from the embedding's backward to the step. Its hook appends the gradient
    itself to the bucket (``bucket.grads.append(grad_reduc)``, v0.19.8 ``stage_1_and_2.py`` L1414-1474:
    the copy into the bucket buffer is under ``if self.contiguous_gradients``); after the bucket's
    reduction only the gradients of parameters outside the rank's partition are cleared
    (``reduce_ipg_grads``, ``clear_grad_attribute``), and rank 0's partition starts with the word
    embedding (registered first), so its ``.grad`` -- autograd's out-of-place sum of the head's and the
    embedding's parts (``tied_head_grad``) -- stays whole until ``step`` frees the partition's
    gradients after their fp32 cast (``free_grad_in_param_list``, L3128). Found by the agreement grid:
    BERT b1 s1024 ZeRO-2 fp16 without contiguous gradients read -11.0 % under trace's reserved peak, the
    replay's sum freed at the embedding's backward where trace keeps it past the step's float64 norm copy.
    Not under offloading (contiguous gradients forced on) nor LoRA (the head is frozen)."""
    return (deepspeed_zero(t) and t.zero == 2 and not t.contiguous_gradients and not t.offload_optimizer
            and bool(st.trainable) and tied_head_grad(m, t) > 0)


def _offloads_grads(t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-1/2 hands the gradients to an offloaded optimizer (``deepspeed_offload_steps``)."""
    return bool(deepspeed_zero(t) and t.zero in (1, 2) and t.offload_optimizer and st.trainable)


def _offload_peak(t: TrainingSpec, piece: int, whole: int) -> tuple[int, int]:
    """(bytes of a ``whole``-element gradient kept as its own tensor, bytes of the largest step of
    ``deepspeed_offload_steps`` for it, in blocks) for ``deepspeed_offload_check`` and
    ``deepspeed_offload_check_head``: a parameter larger than ``reduce_bucket_size`` keeps its gradient as
    its own tensor (``extra_large_param_to_reduce``, v0.14.2 ``stage_1_and_2.py`` L944-946) until
    ``param.grad = None`` (L1275); a smaller one's is a view of the bucket buffer (counted there)."""
    own = block_of(t, whole * t.weight_bytes) if whole > t.ds_reduce_bucket else 0
    return own, max(sum(block_of(t, b) for b in step) for step in deepspeed_offload_steps(t, piece, whole))


def deepspeed_offload_grads(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[tuple[int, int], ...]:
    """(elements in rank 0's partition, elements of the parameter) of each gradient rank 0 hands to the
    offloaded optimizer, in registration order: the parameters overlapping its partition of
    ceil(trainable / dp) elements (``_rank0_own``). Where the rank's flat group is not the model's tensors
    in order (``_partial_layout``: LoRA, tensor or pipeline parallelism, a partial set) every trainable
    tensor of ``States.trainables`` is taken whole (its gradient bytes over the engine's dtype). () off
    DeepSpeed ZeRO-1/2 with ``offload_optimizer``."""
    if not _offloads_grads(t, st):
        return ()
    if _partial_layout(m, t, st):
        wb = t.weight_bytes
        return tuple((st.trainables[j][2] // wb,) * 2 for j in parameter_order(st.trainables))
    part, start, out = -(-st.trainable // t.shard_group), 0, []
    for p in m.parameter_tensors():
        if start >= part:
            break
        out.append((min(start + p.numel, part) - start, p.numel))
        start += p.numel
    return tuple(out)


def deepspeed_offload_epilogue(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[tuple[int, ...], ...]:
    """The steps of ``deepspeed_offload_steps`` (raw bytes of each step's tensors) for every gradient of
    rank 0's partition (``deepspeed_offload_grads``), in the order backward made them (the parameters'
    reversed), for the reserved replay at the accumulation boundary (``reserved._offload_epilogue``):
    ``reduce_ipg_grads`` calls ``copy_grads_in_partition`` for each parameter of the reduced bucket in the
    order its hooks filled it (v0.14.2 ``stage_1_and_2.py`` L1356-1412, v0.19.8 L2205-2275). Under the
    default ``reduce_bucket_size`` (5e8 elements) a model of fewer parameters is one bucket reduced at the
    end of backward (``independent_gradient_partition_epilogue``), the word embedding's gradient last;
    a larger model's buckets reduced during backward are replayed there too (their sizes, not their place)."""
    return tuple(step for piece, whole in reversed(deepspeed_offload_grads(m, t, st))
                 for step in deepspeed_offload_steps(t, piece, whole))


def deepspeed_offload_check(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """(bytes of the parameter's gradient when it is its own tensor, bytes of the largest step of
    ``deepspeed_offload_steps``) on rank 0 for the largest gradient of its partition, when DeepSpeed
    ZeRO-1/2, the optimizer offloaded, hands it to the host at the accumulation boundary; (0, 0) off that
    path. Up to v0.19.5 the largest step is the elementwise inf/NaN check, 11 B per element of the whole
    gradient; from v0.19.6 the norm's float64 copy, 8 B per element of its piece.

    Rank 0's partition holds the first parameters in registration order (``_rank0_own``), with the word
    embedding, whose gradient comes last in backward: its steps run in backward's epilogue, the
    activations freed. A partial set of trainable tensors or a tensor- or pipeline-parallel layout takes
    its largest trainable tensor's shard; LoRA's adapters are neglected. Found by Giles Thomas's
    Llama-3-8B ZeRO-2 offload rows over 8 GPUs (DeepSpeed 0.14.2): ranks 0 and 7, whose partitions hold
    the embedding and the head (525,336,576 elements: 5,511 MiB for the check), peak 3.4-3.5 GiB above
    the other ranks; DeepSpeed #8325 gives the same 11 B per element."""
    if not _offloads_grads(t, st) or t.lora_rank:
        return 0, 0
    if _partial_layout(m, t, st):
        n = max(p.numel for p in m.parameter_tensors()) // t.tp
        return _offload_peak(t, n, n)
    piece, whole = max(deepspeed_offload_grads(m, t, st), key=lambda g: g[1])
    return _offload_peak(t, piece, whole)


def deepspeed_offload_check_head(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """(bytes of the head's gradient when it is its own tensor, bytes of the largest step of
    ``deepspeed_offload_steps``) for an untied LM head (``lm_head.weight``, registered last: the last
    rank's partition ends with it, whole), whose steps run where its bucket is reduced: the head's
    gradient is the first of backward, and the next gradient's hook (the final norm's) reduces the bucket
    when adding it would pass ``reduce_bucket_size`` (v0.14.2 ``stage_1_and_2.py``
    ``reduce_independent_p_g_buckets_and_remove_grads`` L927-936), with every activation still saved.
    That rank is not rank 0 over several ranks; its other bytes are rank 0's (the fp16 weights, the
    buckets and the offload buffer are replicated), so the estimate's peak is the worse of the two
    (the measured quantity of Giles Thomas's Llama-3-8B offload rows is the worst rank's: rank 7 at
    24,205 and 24,484 MiB, rank 0 at 23,929). (0, 0) where the head is tied or absent, frozen, its
    bucket reduced later in backward (a head and final norm within one bucket), or off the path."""
    if not _offloads_grads(t, st) or t.lora_rank or _partial_layout(m, t, st):
        return 0, 0
    tensors = m.parameter_tensors()
    head = tensors[-1] if tensors and tensors[-1].name == "lm_head.weight" else None
    if head is None or len(tensors) < 2 or head.numel + tensors[-2].numel <= t.ds_reduce_bucket:
        return 0, 0
    return _offload_peak(t, head.numel, head.numel)


def deepspeed_hooks_reduce(t: TrainingSpec) -> bool:
    """Whether DeepSpeed ZeRO-1/2's gradient hooks reduce buckets during backward (on the GPU, not
    offloaded): ``process_gradients`` reduces when ``partition_gradients or overlap_comm``
    (``stage_1_and_2.py`` v0.19.8 L2284-2291), and ZeRO-1's ``reduce_ready_partitions_and_remove_grads``
    only at the accumulation boundary (L2293-2295): ZeRO-2 always, ZeRO-1 under ``overlap_comm``
    (taken without accumulation only: its other micro-batches keep ``.grad`` as without DeepSpeed,
    which the estimate's moments do not tell apart; and with ``contiguous_gradients`` only, without
    which ZeRO-1's reduction frees no gradient, L2272-2274, so that its memory is that of plain
    gradients). Without ``overlap_comm`` ZeRO-1 reduces after backward (``reduce_gradients`` L958-981)."""
    if not deepspeed_zero(t) or t.offload_optimizer:
        return False
    return t.zero == 2 or (t.zero == 1 and t.ds_overlap_comm and t.contiguous_gradients and t.grad_accum == 1)


#: ``deepspeed_partition_from``: ZeRO-2's ``grads_in_partition`` exists from the top layer's backward,
#: from the bottom layer's, from the embedding's, or at none of backward's moments (made by the
#: embedding's own hook or the epilogue)
PARTITION_TOP, PARTITION_BOTTOM, PARTITION_EMBEDDING, PARTITION_AFTER = 0, 1, 2, 3


def deepspeed_partition_from(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """The first backward moment at which rank 0's ``grads_in_partition`` (DeepSpeed ZeRO-2,
    ``deepspeed_partition_grads``) exists (``PARTITION_*``). ``copy_grads_in_partition`` makes it
    when it first copies a gradient of a parameter in the rank's partition (``stage_1_and_2.py``
    v0.19.8 L2184-2194), which ``reduce_ipg_grads`` does for the bucket's parameters once the bucket
    is reduced (L2266-2274); a gradient's hook reduces the bucket when adding its parameter would pass
    ``reduce_bucket_size`` elements (``reduce_independent_p_g_buckets_and_remove_grads`` L1414-1424),
    and a parameter larger than the bucket fills it alone (``extra_large_param_to_reduce``, L1444-1449:
    its elements still count, so the next gradient reduces it). Rank 0's partition holds the first
    parameters in registration order (the embeddings, the lowest layers), whose gradients come last
    in backward: the partition is made when the bucket holding the first of them that backward
    reaches is reduced, often well below the top layer, and never before the epilogue
    (L1211) when every gradient fits one bucket. The hooks are taken in reverse registration
    order (a layer's norms before its linears, a tied embedding last); a reduction in a layer
    counts from the layers below it, one at an embedding's parameter from the word embedding's
    backward when it comes before it. Without ``contiguous_gradients`` (no partition buffer: the
    rank's gradients stay where autograd made them, the others' freed at each reduction), a partial
    set of trainable tensors or a tensor- or pipeline-parallel layout, it is taken from the top
    layer whenever the trainable elements pass one bucket (``reduce_first_in_backward``)."""
    tensors = m.parameter_tensors()
    if not t.contiguous_gradients or _partial_layout(m, t, st):
        return PARTITION_TOP if reduce_first_in_backward(t, st) else PARTITION_AFTER
    own = _rank0_own(tensors, st, t)
    for i, bucket in _bucket_reductions(tensors, t)[:-1]:
        if min(bucket) < own:
            return _partition_moment(tensors, i)
    return PARTITION_AFTER


def _partial_layout(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether the rank's flat group is not the model's tensors whole in registration order: a
    tensor- or pipeline-parallel layout, LoRA, or a partial set of trainable tensors (the bucket
    walks of ``_bucket_reductions`` do not apply)."""
    return t.tp > 1 or t.pp > 1 or bool(t.lora_rank) or tensor_elements(m.parameter_tensors()) != st.trainable


def _rank0_own(tensors: tuple, st: States, t: TrainingSpec) -> int:
    """How many parameters (the first, in registration order) overlap rank 0's partition of
    ceil(trainable / dp) elements (``deepspeed_partition_grads``)."""
    part, start, own = -(-st.trainable // t.shard_group), 0, 0
    for p in tensors:
        if start >= part:
            break
        start, own = start + p.numel, own + 1
    return own


def _bucket_reductions(tensors: tuple, t: TrainingSpec, forward: bool = False) -> list[tuple[int, list[int]]]:
    """DeepSpeed ZeRO-1/2's bucket reductions during backward, in order: (the parameter whose hook
    reduces, the registration indices of the bucket's parameters). A hook reduces the bucket when
    adding its parameter would pass ``reduce_bucket_size`` elements (``stage_1_and_2.py`` v0.19.8
    ``reduce_independent_p_g_buckets_and_remove_grads`` L1414-1424), then adds the parameter, whose
    elements count even when it alone is larger than the bucket (``extra_large_param_to_reduce``,
    L1444-1449); an empty parameter is skipped (L1416-1417). The hooks are taken in reverse
    registration order (``forward``: in registration order, as ZeRO-1's ``reduce_gradients`` walks
    them after backward, L972-977); the bucket left is the last item, with index -1: the epilogue
    reduces it (``reduce_ipg_grads`` from ``independent_gradient_partition_epilogue``, L1018)."""
    out: list[tuple[int, list[int]]] = []
    bucket: list[int] = []
    elements = 0
    for i in (range(len(tensors)) if forward else reversed(range(len(tensors)))):
        n = tensors[i].numel
        if n == 0:
            continue
        if elements + n > t.ds_reduce_bucket:
            if bucket:
                out.append((i, bucket))
            bucket, elements = [], 0
        bucket.append(i)
        elements += n
    return out + [(-1, bucket)] if bucket else out


def deepspeed_epilogue(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """(bytes of the gradients, bytes of the flat copy) on rank 0 when DeepSpeed ZeRO-1/2 reduces
    the last bucket after backward (0, 0 off them or offloaded). Every reduction flattens the
    bucket's gradients into one new tensor: ``average_tensor`` -> ``allreduce_and_scatter`` ->
    ``allreduce_bucket`` ``self.flatten(bucket)`` (``stage_1_and_2.py`` v0.19.8 L1590-1725,
    L2359-2367; DeepSpeed's defaults ``reduce_scatter`` and ``use_multi_rank_bucket_allreduce`` put
    every slice of the bucket in one ``allreduce`` group, flattened together up to
    ``reduce_bucket_size``), or without ``contiguous_gradients`` ``buffered_reduce_fallback`` ->
    ``allreduce_no_retain`` -> ``allreduce_and_copy`` (L2538-2556, L2402-2439), freed once copied
    back; the last bucket is reduced by the epilogue (``_bucket_reductions``), where the most
    gradients exist. Beside that copy: with contiguous gradients only ``grads_in_partition`` (when
    an earlier reduction made it; the bucket buffers are ``ds_backward_buf``); without, the
    gradients autograd made less those ZeRO-2 freed (``deepspeed_grads_at_embedding``), all of
    them under ZeRO-1. ZeRO-1 without ``overlap_comm`` reduces after backward in registration order
    (``reduce_gradients``). A partial set of trainable tensors or a tensor- or pipeline-parallel
    layout: (0, 0)."""
    if not (deepspeed_zero(t) and t.zero in (1, 2) and not t.offload_optimizer and st.trainable):
        return 0, 0
    if _partial_layout(m, t, st):
        return 0, 0
    tensors = m.parameter_tensors()
    hooked = t.zero == 2 or t.ds_overlap_comm
    reductions = _bucket_reductions(tensors, t, forward=not hooked)
    if not reductions:
        return 0, 0
    earlier, last = [b for _i, b in reductions[:-1]], reductions[-1][1]
    own = _rank0_own(tensors, st, t)
    if t.contiguous_gradients:
        held = deepspeed_partition_grads(m, t, st) if any(min(b) < own for b in earlier) else 0
    else:
        alive = st.trainable
        if t.zero == 2:
            alive -= sum(tensors[j].numel for b in earlier for j in b if j >= own)
        held = block_of(t, alive * t.weight_bytes)
    flat = block_of(t, sum(tensors[j].numel for j in last) * t.weight_bytes)  # (bucket,) gradient dtype
    return held, flat


def deepspeed_epilogue_cats(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, ...]:
    """Bytes of each flat copy DeepSpeed ZeRO-1/2 makes when backward's epilogue reduces the last bucket
    (``_bucket_reductions``) with contiguous gradients, in order (() elsewhere). ``average_tensor``
    (v0.19.8 ``stage_1_and_2.py`` L1590-1725; v0.14.2 L1037-1140) cuts the bucket -- its gradients in
    hook order, a parameter larger than the bucket alone (``extra_large_param_to_reduce``) -- into one
    slice per partition it overlaps, in offset order, merging consecutive slices of one rank; with
    ``use_multi_rank_bucket_allreduce`` (the default) all go to ``allreduce_and_scatter``, which gathers
    slices until their elements pass ``reduce_bucket_size`` and then calls
    ``allreduce_and_copy_with_multiple_ranks`` -> ``allreduce_bucket`` -> ``self.flatten``: a ``torch.cat``
    of the group, a new (elements,) tensor of the gradient dtype, when it holds more than one slice (one is
    a view), freed once copied back. Partitions: ceil(trainable / (2 x dp)) x 2 elements (the flat group
    padded to 2 x dp). Found by trace: Gemma-2 1 x 2048 ZeRO-1 fp16 ``overlap_comm`` dp 4, the embedding's
    589.8M elements over ranks 0-3, a 1066.5 MiB ``cat`` of its first three slices (559.2M elements, past
    5e8) on the reduction stream before ``grads_in_partition``. Not without contiguous gradients
    (``buffered_reduce_fallback``), under offloading, or for a partial layout."""
    if not (deepspeed_zero(t) and t.zero in (1, 2) and t.contiguous_gradients and not t.offload_optimizer
            and st.trainable and (t.zero == 2 or t.ds_overlap_comm)) or _partial_layout(m, t, st):
        return ()
    tensors = m.parameter_tensors()
    reductions = _bucket_reductions(tensors, t)
    if not reductions:
        return ()
    part = -(-st.trainable // (2 * t.shard_group)) * 2              # a partition's elements
    starts, at = [], 0
    for p in tensors:
        starts.append(at)
        at += p.numel
    slices: list[list[int]] = []                                    # [rank, elements], merged by rank
    for j in reductions[-1][1]:                                     # hook order
        lo, hi = starts[j], starts[j] + tensors[j].numel
        for r in range(lo // part, (hi - 1) // part + 1):
            n = min(hi, (r + 1) * part) - max(lo, r * part)
            if slices and slices[-1][0] == r:
                slices[-1][1] += n
            else:
                slices.append([r, n])
    cats, group, total = [], 0, 0
    for _r, n in slices:                                            # allreduce_and_scatter's groups
        group, total = group + 1, total + n
        if total > t.ds_reduce_bucket:
            cats += [total * t.weight_bytes] if group > 1 else []
            group, total = 0, 0
    cats += [total * t.weight_bytes] if group > 1 else []
    return tuple(cats)


def deepspeed_grads_at_embedding(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes of the gradients on rank 0 beside the word embedding's own when its backward runs (the
    last gradient of backward), where DeepSpeed ZeRO-1/2's hooks reduce buckets
    (``deepspeed_hooks_reduce``). With ``contiguous_gradients`` every gradient is copied into the
    bucket buffer by its hook, so only ``grads_in_partition`` is there, if a reduction made it
    before (``deepspeed_partition_from``). Without, gradients stay where autograd made them: every
    parameter's before the embedding's, less those ZeRO-2 freed at a reduction, the parameters
    outside the rank's partition (``reduce_ipg_grads`` L2260-2268: ``clear_grad_attribute``; under
    ``overlap_comm`` at the next reduction, ``previous_reduced_grads``, L1026-1030); the rank's own
    are kept. A partial set of trainable tensors or a tensor- or pipeline-parallel layout takes
    the sharded gradients."""
    if t.contiguous_gradients:
        made = deepspeed_partition_from(m, t, st)
        return deepspeed_partition_grads(m, t, st) if made <= PARTITION_EMBEDDING else 0
    if _partial_layout(m, t, st):
        return st.grads
    tensors = m.parameter_tensors()
    word = min((j for j, p in enumerate(tensors) if p.role == "embedding"), default=0)
    own = _rank0_own(tensors, st, t)
    alive = sum(p.numel for p in tensors[word + 1:])
    freed: list[list[int]] = []  # the buckets whose other ranks' gradients are freed (before ``word``)
    reductions = [b for i, b in _bucket_reductions(tensors, t)[:-1] if i > word]
    if t.zero == 2:
        freed = reductions if not t.ds_overlap_comm else reductions[:-1]
    alive -= sum(tensors[j].numel for b in freed for j in b if j >= own)
    return block_of(t, alive * t.weight_bytes)   # the gradients in the weights' dtype


def _partition_moment(tensors: tuple, i: int) -> int:
    """``deepspeed_partition_from``'s moment for a reduction at parameter ``i``'s hook: above the
    layers (the head, the final norm), in a layer (the layers below it), at an embedding's
    parameter (before the word embedding's backward when it comes later in registration order)."""
    p = tensors[i]
    layered = [j for j, q in enumerate(tensors) if q.layer is not None]
    if p.layer is None and layered and i > layered[-1]:
        return PARTITION_TOP
    if p.layer is not None:
        return PARTITION_BOTTOM if p.layer > min(q.layer for q in tensors if q.layer is not None) else \
            PARTITION_EMBEDDING
    word = min((j for j, q in enumerate(tensors) if q.role == "embedding"), default=0)
    return PARTITION_EMBEDDING if i > word else PARTITION_AFTER


def reduce_first_in_backward(t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-1/2 reduces a bucket before backward's end: a gradient's hook reduces
    the bucket when adding the parameter would pass ``reduce_bucket_size`` elements
    (``stage_1_and_2.py`` v0.19.8 ``reduce_independent_p_g_buckets_and_remove_grads`` L1414-1424:
    ``bucket.elements + param.numel() > self.reduce_bucket_size``); when all of the trainable
    elements fit in one bucket, nothing is reduced until ``overlapping_partition_gradients_reduce_epilogue``
    (L1211) after the last gradient, which makes ``grads_in_partition`` then."""
    return st.trainable > t.ds_reduce_bucket


def deepspeed_partition_grads(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes of DeepSpeed ZeRO-1/2's ``grads_in_partition`` on rank 0 (0 off them, offloaded or
    frozen): one buffer in the gradient dtype of the *whole* parameters that overlap the rank's
    partition (``stage_1_and_2.py`` L1344-1355 at v0.16.4, L2183-2194 at v0.19.8: ``total_size +=
    param_in_partition.numel()``), so rank 0's runs from the first parameter to the one that
    crosses its partition's end, in the order the optimizer's group holds them (the model's
    registration order). Under stage 1 the same bytes are the gradients of those parameters kept
    for the step (v0.16.4: the parameters' own; v0.19.8: this buffer, ``copy_grads_in_partition``
    in backward's epilogue): both free the other parameters' gradients before the flat copy
    (``free_grad_in_param_list(params_not_in_partition)``). A partial set of trainable tensors
    (LoRA, a frozen part) or a tensor- or pipeline-parallel layout takes the partition itself
    (ceil(trainable / dp) elements). DeepSpeed's 2 x dp element alignment of the flat buffer is
    neglected."""
    if not (deepspeed_zero(t) and t.zero in (1, 2) and not t.offload_optimizer and st.trainable):
        return 0
    gb = t.weight_bytes
    part = -(-st.trainable // t.shard_group)
    tensors = m.parameter_tensors()
    if t.tp > 1 or t.pp > 1 or t.lora_rank or tensor_elements(tensors) != st.trainable:
        return block_of(t, part * gb)
    held = 0
    for p in tensors:
        held += p.numel
        if held >= part:
            break
    return block_of(t, held * gb)


def gemini_fields(m: ModelSpec, t: TrainingSpec) -> dict[str, int]:
    """ColossalAI Gemini's bytes beside the model states in a layer's backward, on rank 0
    (``estimate.gemini``): the fp16 chunks of other ranks that hold one of the layer's parameters,
    gathered from its recomputed forward until every parameter in them has its gradient (the top
    layer's; the most of any other layer's), the chunks gathered through all of backward (a tied
    embedding's, when rank 0 does not own it), and ``grad_handle``'s gradient and its ``grad / dp``
    copy of the layer's largest parameter, counted together with the layer's transients. At the
    loss rank 0 gathers nothing: the loss runs inside ``ZeroDDP.forward`` (Lightning's
    ``_LightningModuleWrapperBase.forward`` calls ``training_step``, Lightning 2fef6d9403
    ``src/pytorch_lightning/overrides/base.py`` L92-106), where the chunks of earlier ops were
    released at the next op (``exec_lazy_release`` in ``pre_op``, ColossalAI bbc58d881
    ``zero_hook_v2.py`` L29) and only the head's stays, which for a tied head is chunk 0, rank 0's own
    (an untied head's chunk of another rank is not counted)."""
    g = model_gemini(m, t)
    if g is None:
        return {}
    top = g.gathered_layer[-1] if g.gathered_layer else 0
    low = max(g.gathered_layer[:-1], default=top)
    return {"gemini_top": top + g.gathered_always + g.grad_hook, "gemini_low": low + g.gathered_always + g.grad_hook}


def deepspeed_head_wgrad(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes of an untied LM head's weight gradient, whole (vocab x hidden, the engine's dtype), as
    its ``MmBackward0`` makes it under DeepSpeed ZeRO-3, beside the logits' gradient it reads and the
    head still gathered (``deepspeed_gathered``). ZeRO-3 partitions a gradient only in the hook after
    autograd made it whole: ``reduce_independent_p_g_buckets_and_remove_grads`` ->
    ``__add_grad_to_ipg_bucket`` copies it into the bucket buffer when it fits, else keeps it as its
    own tensor until the next hook reduces the bucket (v0.14.2 ``stage3.py`` L1191-1243; v0.19.8 the
    same path), so the whole gradient exists at the head's backward in every release. The layers'
    weight gradients are counted in their backward's temporaries; a tied head's waits in autograd's
    input buffer (``tied_head_grad``). Found by tracing DeepSpeed 0.14.2's engine on Giles Thomas's
    Llama-3-8B ZeRO-3 row at one token (8 GPUs, no zero.Init): the peak is the head's ``mm`` backward,
    1,002 MiB (128256 x 4096 fp16) above the moments before. 0 off ZeRO-3, for a tied, absent or
    frozen head, or a partial set of trainable tensors."""
    if not (deepspeed_zero(t) and t.zero == 3 and st.trainable) or _partial_layout(m, t, st):
        return 0
    tensors = m.parameter_tensors()
    head = tensors[-1] if tensors and tensors[-1].name == "lm_head.weight" and not m.tied_embeddings else None
    return block_of(t, head.numel * t.weight_bytes) if head is not None else 0   # (vocab, hidden) fp16/bf16


def deepspeed_gathered(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """DeepSpeed ZeRO-3's gathered (whole) parameters in the engine's dtype: (at the top layer's
    backward, in the rest of backward); (0, 0) off ZeRO-3 over several ranks. None at the optimizer
    step: ``step`` starts by releasing every parameter (``stage3.py`` ``_partition_all_parameters``).
    Where the coordinator's replay applies (``deepspeed_gather_zones``: an LM, no pipeline stages,
    recompute none, selective or full) its top-layer and lower-layer maxima; else the rule below, which neglects
    the prefetcher's passes over gathered entries (so the layers kept past the reuse distance) and
    the live-parameter limit.

    ZeRO-3 gathers a submodule's own parameters when its forward or backward hook fires and
    releases them after it, except a parameter that comes up again within the next
    ``stage3_max_reuse_distance`` parameter elements of the module order recorded in the first
    step (``partitioned_param_coordinator.py`` ``__params_to_release`` L524-554, at 38327e0). So at
    the end of forward the LM head stays (its backward comes next; a tied embedding is the head),
    and so do the top K layers: between a layer's forward and its next use run the head's forward
    and backward (2 x head elements) and, for each layer above it, that layer's backward and, under
    full recompute, its recomputed forward first: the j-th layer from the top (j = 0, 1, ...) stays
    while 2 head + c j layer < the distance (c = 2, or 3 recomputed). Beside them the module being
    computed (at most a layer, or an untied embedding) and the prefetch
    (``stage3_prefetch_bucket_size`` elements gathered ahead, L285-418): parameters taken from the
    queue of the recorded order that are not gathered yet (``fetch_sub_module``: ``ds_status ==
    NOT_AVAILABLE``, DeepSpeed v0.19.8 ``partitioned_param_coordinator.py`` L451-485), so at most
    the model's parameters not already counted as gathered. The kept layers are
    released as backward passes them, so below the top only the current module and the prefetch
    are gathered. Modules within a layer are taken as the layer (their offsets in it neglected)."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1):
        return 0, 0
    zones = deepspeed_gather_zones(m, t, st)
    if zones is not None:
        return zones[2], zones[3]
    wb = t.weight_bytes
    layer = st.layer_params_full                            # one layer's weights, whole, engine dtype
    layer_n = layer // wb
    head_n = _head_weight_numel(m, t.tp) if is_lm(m) else 0  # (vocab, hidden) elements
    emb_n = 0 if m.tied_embeddings else next((-(-p.numel // t.tp) for p in m.parameter_tensors()
                                               if p.role == "embedding"), 0)
    dist = t.ds_reuse_distance
    c = 3 if t.recompute == "full" else 2
    layers = m.num_layers // t.pp
    k = min(layers, -(-(dist - 2 * head_n) // (c * layer_n))) if (layer_n and dist > 2 * head_n) else 0
    total_n = sum(-(-p.numel // t.tp) for p in m.parameter_tensors()) // t.pp  # the stage's parameters

    def prefetch(gathered_n: int) -> int:
        """(up to stage3_prefetch_bucket_size,) gathered ahead: only parameters not gathered yet"""
        return block_of(t, min(t.ds_prefetch, max(0, total_n - gathered_n)) * wb)
    current_n = max(layer_n, emb_n)
    current = max(layer, block_of(t, emb_n * wb))
    head = block_of(t, head_n * wb) if dist > 0 else 0
    kept_n = (head_n if dist > 0 else 0) + max(k, 1) * layer_n
    # the kept layers' matmul weights are the storage autograd holds under torch's F.linear (counted
    # with the layers' activations: deepspeed_linear_kept); their norms are neglected
    kept_layers = 0 if deepspeed_linear_kept(m, t) else max(k, 1) * layer
    return head + kept_layers + prefetch(kept_n), current + prefetch(current_n)


def deepspeed_gathered_head(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes DeepSpeed ZeRO-3 holds gathered (engine's dtype) from the end of forward through the
    LM head's backward (the loss's moments): the replay's (``deepspeed_gather_zones``), else the
    rule's top (``deepspeed_gathered``); 0 off ZeRO-3 over several ranks."""
    zones = deepspeed_gather_zones(m, t, st)
    return deepspeed_gathered(m, t, st)[0] if zones is None else zones[1]


def deepspeed_gathered_forward(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes DeepSpeed ZeRO-3 holds gathered (engine's dtype) at the top layer's forward from the
    second step on, a prefetch's flat all-gather output included: the replay's
    (``deepspeed_gather_zones``), else the rule's top and ``deepspeed_coalesced``."""
    zones = deepspeed_gather_zones(m, t, st)
    if zones is None:
        return deepspeed_gathered(m, t, st)[0] + deepspeed_coalesced(m, t)
    return zones[0]


def deepspeed_gather_zones(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int, int, int] | None:
    """Bytes DeepSpeed ZeRO-3 holds gathered (whole parameters and the flat all-gather buffers,
    the engine's dtype) at most in the top layer's forward, from forward's end through the head's
    backward, in the top layer's backward and in the other layers' backward (with the flat ``cat`` of
    a gradient bucket reduced there), from the second step on: the coordinator
    replayed over the model's module order (``zero3_replay.gathered_zones``; the same code at
    DeepSpeed v0.14.2 and v0.19.8, ``partitioned_param_coordinator.py`` v0.19.8 L353-490, L634-664).
    The prefetcher pops queue entries of parameters gathered already without counting them, so it
    runs ahead until ``stage3_max_live_parameters`` (1e9 elements) are gathered, and each entry it
    passes marks its parameter as fetched for that later use, which its module's release then keeps:
    at forward's end the head and the layers below it up to that count stay gathered into backward.
    None where the replay does not apply (the rule in ``deepspeed_gathered`` then): off ZeRO-3 over
    several ranks, a model without an LM head, pipeline stages, ``--recompute op`` (refused with ZeRO-3
    anyway), or mixture-of-experts layers whose experts a step calls only when routed to (``_z3_leaves``).
    Mixture-of-experts blocks: one fetch of the block where DeepSpeed makes it a leaf module, else its
    router and fused experts in turn (``_z3_leaves``). ``--recompute selective`` recomputes the
    attention core, which holds no parameters: the order is none's.
    Found by trace (DeepSpeed 0.19.8): Giles Thomas's Llama-3-8B ZeRO-3 setup cut to 6 layers, dp 8,
    one token: at the second step's backward start the head, layers 5 and 4 and layer 3's down_proj
    gathered, and at layer 4's MLP the embedding and layer 0's q/k/v in one flat all-gather (1,050 MiB)."""
    args = _gather_order_args(m, t)
    if args is None:
        return None
    from .zero3_replay import gathered_zones
    bucket = t.ds_reduce_bucket if (st.trainable > 0 and not _partial_layout(m, t, st)) else 0      # the reductions' cats with every parameter trainable
    params, head, tied, leaves, views = args
    return gathered_zones(params, head, tied, t.recompute == "full", t.ds_reuse_distance, t.ds_prefetch,
                          DS_MAX_LIVE, deepspeed_linear_kept(m, t) > 0, bucket, t.weight_bytes,
                          bool(t.expandable_segments), leaves, views)


def _gather_order_args(m: ModelSpec, t: TrainingSpec) -> tuple | None:
    """``zero3_replay.module_order``'s inputs from the spec: each parameter (name, whole elements on this
    rank, layer), the untied head's module or the tied table's index, the ZeRO-3 leaf modules' paths
    (``_z3_leaves``), the parameters whose forward storage a saved view holds (``zero3_replay.view_held``);
    None where the replay does not apply (``deepspeed_gather_zones``)."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1) or not is_lm(m) or t.pp > 1:
        return None
    if t.recompute not in ("none", "full", "selective"):
        return None   # selective: Megatron's attention core, recomputed without parameters: none's order
    tensors = m.parameter_tensors()
    leaves = _z3_leaves(m, t)
    if leaves is None:
        return None   # experts as modules skipped when no token routes to them: the recorded order varies
    params = tuple((p.name, -(-p.numel // t.tp), p.layer) for p in tensors)   # (name, whole elements, layer)
    last = tensors[-1] if tensors else None                # an untied head: the last tensor, outside the layers
    untied = not m.tied_embeddings and last is not None and last.layer is None and last.role == "linear"
    head = ".".join(last.name.split(".")[:-1]) if untied else None
    tied = None if untied else next((i for i, p in enumerate(tensors) if p.role == "embedding"), None)
    if head is None and tied is None:
        return None
    from .zero3_replay import view_held
    return params, head, tied, leaves, view_held(tuple(p.role for p in tensors))


#: DeepSpeed's default ZeRO-3 leaf modules (``zero_optimization.leaf_module.classes``), by transformers
#: model type: ``runtime/zero/leaf_module_config.py`` ``DEFAULT_LEAF_MODULE_CLASSES`` (v0.19.8 L11-15;
#: added in v0.18.0, #7604 "Improve leaf module interface", 7d9a2f2), applied to every model the engine
#: wraps (``engine.py`` ``_configure_distributed_model`` L2076 ``apply_zero_leaf_module_config``)
DS_DEFAULT_LEAF_TYPES = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
                         "qwen3_moe": "Qwen3MoeSparseMoeBlock"}


def _z3_leaves(m: ModelSpec, t: TrainingSpec) -> tuple[str, ...] | None:
    """The module paths ZeRO-3 fetches as leaf modules (one fetch of every parameter under them, no
    hooks below: ``zero3_replay._path``), () for none; None where the recorded module order varies step
    to step. A mixture-of-experts block (the module holding ``experts``) is a leaf under DeepSpeed
    >= 0.18.0 for the model types it lists by default (``DS_DEFAULT_LEAF_TYPES``). Elsewhere its router
    and experts are fetched as modules of their own, each in every step: transformers >= 5 holds a
    layer's experts as fused 3-D parameters of one module that the block always calls (5.24
    ``modeling_mixtral.py`` ``MixtralExperts`` L56-93, ``MixtralSparseMoeBlock.forward`` L122-131), so the
    order is the same each step. Before 5, each expert is a module of its own that the block calls only
    when a token routes to it (4.x ``MixtralSparseMoeBlock.forward``: ``expert_hitted =
    torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()``, ``for expert_idx in expert_hitted:
    expert_layer = self.experts[expert_idx]``): the order changes, and DeepSpeed drops its trace
    (v0.19.8 ``partitioned_param_coordinator.py`` ``trace_prologue`` L202-219, ``_invalidate_trace``): None."""
    experts = [p.name for p in m.parameter_tensors() if p.role == "expert"]
    if not experts:
        return ()
    if t.deepspeed_release() >= (0, 18, 0) and m.model_type in DS_DEFAULT_LEAF_TYPES:
        return tuple(dict.fromkeys(n.rsplit(".experts.", 1)[0] for n in experts if ".experts." in n))
    tf = t.transformers_release
    return () if tf is None or tf >= (5,) else None


def deepspeed_gather_events(m: ModelSpec, t: TrainingSpec, st: States) -> tuple:
    """DeepSpeed ZeRO-3's gathered storage made and freed at each module fetch of the recorded order, for
    the run's first step and the steps after it (``zero3_replay.gather_events``: elements, the engine's
    dtype) and the gradient buckets' flat ``cat`` at each backward hook that reduces one (``reduce_cats``),
    which the reserved replay runs through the allocator (``reserved._Zero3Replay``); () where
    the coordinator's replay does not apply (``deepspeed_gather_zones``)."""
    args = _gather_order_args(m, t)
    if args is None:
        return ()
    from .zero3_replay import gather_events
    bucket = t.ds_reduce_bucket if (st.trainable > 0 and not _partial_layout(m, t, st)) else 0   # with every parameter trainable
    params, head, tied, leaves, views = args
    return gather_events(params, head, tied, t.recompute == "full", t.ds_reuse_distance, t.ds_prefetch,
                         DS_MAX_LIVE, bucket, leaves, views)


def deepspeed_linear_wrap(t: TrainingSpec) -> bool:
    """Whether DeepSpeed ZeRO-3 runs ``F.linear`` as its ``zero3_linear_wrap`` (``LinearFunctionForZeroStage3``,
    ``zero/linear.py``): under ``zero.Init``, and for a model built outside it from v0.19.4
    (``TrainingSpec.ds_linear_keeps_gathered`` says when not). Its backward computes the input's gradient
    first, ``grad_output.matmul(weight)``, then the weight's (v0.19.8 ``zero/linear.py`` L125-134), so the
    first cuBLAS call of autograd's thread, which binds that thread's workspace, is the input gradient's,
    before the head's weight gradient exists (``reserved._head_backward``)."""
    return deepspeed_zero(t) and t.zero == 3 and t.gemini is None and not t.ds_linear_keeps_gathered


def deepspeed_linear_kept(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of one layer's matmul weights, whole, in the engine's dtype, that autograd keeps gathered
    from the layer's forward to its backward under DeepSpeed ZeRO-3 with torch's own ``F.linear``
    (``TrainingSpec.ds_linear_keeps_gathered``: a model built outside ``zero.Init``, DeepSpeed up to
    0.19.1); 0 otherwise, on one rank (there a gathered parameter is its partition itself:
    ``_no_gather_coalesced``, v0.14.2 L769-779, ``NoGatherHandle``: ``param.data = ds_tensor.data``),
    or under full recompute (a checkpointed layer's forward saves nothing under ``no_grad``; the
    second copy its recomputed forward keeps through that layer's backward is neglected).

    ``F.linear`` on a (b, s, h) input is ``matmul(input, weight.t())`` (ATen ``linear``), whose
    ``MmBackward`` saves ``mat2``, the transposed weight: a view of the gathered storage, not the
    parameter. After the module's forward ZeRO-3 releases the parameter (``free_param``, v0.14.2
    ``partition_parameters.py`` L279-289: ``param.data = torch.empty(0)``), which frees nothing while
    the view holds the storage; it goes when the linear's backward has run, after ZeRO-3 gathered the
    parameter again (a new tensor) for that backward. ``zero3_linear_wrap`` saves the parameter
    itself, whose storage ``free_param`` does swap out (DeepSpeed #8189: "the standard Linear
    implementation can retain the gathered weight storage until backward completes"). The layers ZeRO-3
    keeps gathered anyway (``deepspeed_gathered``'s reuse distance) are the same storage, counted here.
    Found by Giles Thomas's Llama-3-8B ZeRO-3 rows over 8 GPUs (no ``zero.Init``, DeepSpeed 0.14.2): at
    1001 and 2001 tokens the worst rank was the estimate plus 14,953 / 14,963 MiB at the loss, and 32
    layers' matmul weights in fp16 are 13,312 MiB (the head's 1,002 counted already as kept)."""
    if not (t.ds_linear_keeps_gathered and t.shard_group > 1 and t.recompute != "full"):
        return 0
    layer = [p for p in m.parameter_tensors() if p.layer == 0 and p.is_matmul]
    return sum(block_of(t, -(-p.numel // t.tp) * t.weight_bytes) for p in layer)   # (out, in) per weight


def deepspeed_gathered_embedding(m: ModelSpec, t: TrainingSpec) -> int:
    """DeepSpeed ZeRO-3's gathered parameters at the input embedding's backward, the last module of
    backward (0 off ZeRO-3 over several ranks, or without an embedding): its pre-backward hook
    fetches the module's own parameters whole (v0.19.8 ``parameter_offload.py``
    ``_pre_backward_module_hook`` L410 -> ``pre_sub_module_backward_function`` L573 ->
    ``fetch_sub_module``), a tied table too, since the head's backward released it (it is gathered for
    the embedding module as for any other: ``deepspeed_gathered`` counted none for a tied one); and no
    prefetch is in flight, since no module of the recorded order comes after it
    (``partitioned_param_coordinator.py`` L451-485). Found by trace: Llama-3.2-1B (tied, vocabulary
    128256) cut to 2 layers, ZeRO-3 dp 4 bf16: the step's peak, at the embedding's backward, holds the
    whole table gathered (501 MiB) and no prefetch; the estimate read -6.5% with a layer and a
    prefetch bucket there."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1):
        return 0
    emb = next((-(-p.numel // t.tp) for p in m.parameter_tensors() if p.role == "embedding"), 0)
    return block_of(t, emb * t.weight_bytes) if emb else 0


def deepspeed_coalesced(m: ModelSpec, t: TrainingSpec) -> int:
    """DeepSpeed ZeRO-3's coalesced all-gather output of the prefetch in flight at the top layer's
    forward, beside the parameters built from it (steps after the first); 0 off ZeRO-3 over several
    ranks or without prefetch. A prefetch takes parameters of the order recorded in the first step
    (none before that trace is complete) that are not gathered yet, up to ``stage3_prefetch_bucket_size``
    elements (DeepSpeed v0.19.8 ``partitioned_param_coordinator.py`` L451-480), and gathers them with one
    ``all_gather_coalesced`` (L582-613: one handle, registered in ``__inflight_param_registry`` for each
    of them), whose output is one flat tensor of their partitions (``partition_parameters.py``
    ``_all_gather_dtype`` L1329-1350: ``partitions`` are views of it). The first of them fetched waits
    on the handle, which builds every parameter of the group by ``torch.cat`` of its pieces
    (``AllGatherCoalescedHandle.wait`` L761-803) while ``self.partitions`` still views the flat tensor;
    it lives until the last of the group is popped from the registry (coordinator L407-411). The root
    module's fetch (no parameters of its own) starts the step's first prefetch, so a stage within the
    bucket is one group, alive from the embedding's forward to the last module's (the final norm):
    the stage's parameters, up to the bucket, in the engine's dtype. Found by trace: a Llama of 8
    layers (hidden 512, vocab 8192) ZeRO-3 dp 4 bf16, 1 x 128: the second step's forward peak at the
    top layer's MLP holds the model gathered twice; the estimate read -2.8% without it."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1) or t.ds_prefetch <= 0:
        return 0
    total_n = sum(-(-p.numel // t.tp) for p in m.parameter_tensors()) // t.pp  # the stage's parameters
    return block_of(t, min(t.ds_prefetch, total_n) * t.weight_bytes)


def deepspeed_embedding_kept(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-3, once its module order is recorded (from the run's second forward on:
    ``reset_step`` at each forward's start completes the trace, v0.19.8 ``parameter_offload.py`` L304-306,
    ``partitioned_param_coordinator.py`` L251-270), keeps the input embedding's table gathered from its
    forward to its backward. A module's parameters are not released if they come up again in the
    modules of the recorded order within ``stage3_max_reuse_distance`` elements after it (``__params_to_release``
    L634-664: the traversal stops once the elements it passed reach the distance). Between the
    embedding's uses come: a tied table (the head's weight), the layers' forward, then (after the
    head's forward and backward, which use it) the layers' backward, recomputed forward first under
    full recompute; an untied one, the layers' forward, the head's forward and backward, the layers'
    backward. (The final norm's elements are neglected.)"""
    if not deepspeed_gathered_embedding(m, t) or not is_lm(m):
        return False
    layer_n = st.layer_params_full // t.weight_bytes
    layers = m.num_layers // t.pp
    back = (2 if t.recompute == "full" else 1) * layers * layer_n      # the layers' backward (recomputed)
    if m.tied_embeddings:
        return max(layers * layer_n, back) < t.ds_reuse_distance
    return layers * layer_n + 2 * _head_weight_numel(m, t.tp) + back < t.ds_reuse_distance


def deepspeed_reduce_cat(t: TrainingSpec, st: States) -> int:
    """Bytes of the flat tensor DeepSpeed ZeRO-3's largest gradient reduction makes (0 off ZeRO-3; the
    largest of ``deepspeed_reduce_cats``)."""
    return max(deepspeed_reduce_cats(t, st), default=0)


def deepspeed_reduce_cats(t: TrainingSpec, st: States) -> tuple[int, ...]:
    """Bytes of the flat tensor each of DeepSpeed ZeRO-3's gradient reductions makes, in backward order
    (() off ZeRO-3; 0 for a bucket reduced in place). ``__reduce_and_partition_ipg_grads`` hands the
    bucket's whole gradients to ``__avg_scatter_grads`` (v0.19.8 ``stage3.py`` L1678, L1931; v0.14.2
    L1274, L1343), whose ``reduce_scatter_coalesced`` concatenates every rank's piece of each of them,
    padded to a multiple of the ranks, into one new tensor in the gradient dtype
    (``comm/coalesced_collectives.py`` L122 ``torch.cat``), made and freed within the reduction; a
    bucket of one tensor whose elements divide by the ranks is reduced in place (L102-105, the same at
    v0.14.2; on one rank too). The bucket fills in the order backward makes the gradients
    (``reduce_independent_p_g_buckets_and_remove_grads`` L1583-1585: reduced first when the next
    gradient would take it past ``reduce_bucket_size`` elements; the last at the end of backward,
    ``independent_gradient_partition_epilogue``), here the parameters' reversed order, each gradient
    ceil(numel / dp) * dp elements (``States.trainables`` holds a rank's partition; a tensor alone in its
    bucket is taken to divide by the ranks). Found by trace: Llama-3.2-1B cut to 2 layers, ZeRO-3 dp 2
    bf16: a 733 MiB ``cat`` (the whole model's gradients) at the end of each backward; on one rank too
    (Qwen1.5-0.5B, Giles Thomas's rows: an 885 MiB ``cat``); cut to 4 layers (506M elements, more
    than the 500M bucket): the layers' ``cat`` (464 MiB in bf16) and none for the tied embedding,
    reduced alone at the end."""
    if not (deepspeed_zero(t) and t.zero == 3) or not st.trainables:
        return ()
    d, wb = t.shard_group, t.weight_bytes
    sizes = [st.trainables[j][2] // wb * d for j in reversed(parameter_order(st.trainables))]  # whole, padded
    return tuple(block_of(t, n * wb) for n in _reduce_cats(sizes, t.ds_reduce_bucket))  # (n,) gradient dtype


def _reduce_cats(sizes: list[int], bucket: int) -> list[int]:
    """Elements of each ``cat`` of ZeRO-3's gradient buckets (``deepspeed_reduce_cats``): ``sizes`` fill a
    bucket in order, reduced before one would take it past ``bucket`` elements; a bucket of several
    tensors is concatenated, one of a single tensor not."""
    out, cur = [], []
    for n in sizes + [None]:
        if cur and (n is None or sum(cur) + n > bucket):
            out.append(sum(cur) if len(cur) > 1 else 0)
            cur = []
        if n is not None:
            cur.append(n)
    return out


#: DeepSpeed ZeRO-3's ``stage3_max_live_parameters`` (DeepSpeed v0.19.8 ``runtime/zero/config.py`` L245:
#: 1e9 elements; not an option here, and trace's engine runs with this default too)
DS_MAX_LIVE = 1_000_000_000


def deepspeed_layer_params(m: ModelSpec, t: TrainingSpec) -> tuple[int, ...]:
    """Elements of each of one layer's parameters, whole, in the order the layer's modules run (norm
    before attention, attention before the MLP; () off ZeRO-3 over several ranks). ZeRO-3 gathers a
    module's own parameters at its forward and backward hooks (v0.19.8
    ``partitioned_param_coordinator.py`` ``fetch_sub_module`` L340-381); each whole parameter is a
    tensor of its own in the engine's dtype (``partition_parameters.py`` ``_allgather_params_coalesced``,
    or built by ``torch.cat`` from a prefetch's flat output: ``AllGatherCoalescedHandle.wait``
    L761-803), on the all-gather stream under ``overlap_comm`` (coordinator L400)."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1):
        return ()
    layer = sorted((p for p in m.parameter_tensors() if p.layer == 0),   # (stable: registration order within)
                   key=lambda p: (0 if "input_layernorm" in p.module else 1 if "attn" in p.module else
                                  2 if "post_attention" in p.module else 3))
    return tuple(-(-p.numel // t.tp) for p in layer)


def deepspeed_layers_kept(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """The top layers whose gathered parameters ZeRO-3 keeps from their forward to their backward once
    its module order is recorded: those whose next use comes within ``stage3_max_reuse_distance``
    elements (``__params_to_release`` L634-664; the count ``deepspeed_gathered`` takes)."""
    if not deepspeed_layer_params(m, t):
        return 0
    layer_n = st.layer_params_full // t.weight_bytes
    head_n = _head_weight_numel(m, t.tp) if is_lm(m) else 0
    c, dist, layers = (3 if t.recompute == "full" else 2), t.ds_reuse_distance, m.num_layers // t.pp
    return min(layers, -(-(dist - 2 * head_n) // (c * layer_n))) if (layer_n and dist > 2 * head_n) else 0


def deepspeed_group_elems(t: TrainingSpec, st: States) -> int:
    """Elements of the largest flat fp32 partition DeepSpeed's ZeRO optimizer steps at once on this
    rank: the parameter group's partition, ceil(trainable / dp) (stages 1 and 2: one flat group per
    optimizer parameter group, ``stage_1_and_2.py`` L1870-1917; the decay group holds nearly every
    element), or under stage 3 one sub-group: parameters join it until their partitions reach
    ``sub_group_size`` (``stage3.py`` ``_create_fp16_sub_groups`` L943-966), so a sub-group holds
    fewer than ``sub_group_size`` + the largest parameter's partition elements."""
    d = t.shard_group
    part = -(-st.trainable // d)
    if t.zero != 3:
        return part
    sb = 4 if (t.weight_bytes == 4 or t.fp32_master) else t.weight_bytes
    return min(part, t.ds_sub_group - 1 + -(-(st.largest_param // sb) // d))


def deepspeed_partition_elems(t: TrainingSpec, st: States) -> int:
    """Elements of this rank's flat fp32 partitions under DeepSpeed ZeRO-3, all sub-groups together:
    ceil(trainable / dp), each parameter's partition ``ceil(numel / dp)`` (``stage3.py``
    ``_create_fp16_sub_groups``, v0.19.8 L1210-1233), so the sub-groups' sizes are this cut at
    ``deepspeed_group_elems`` (``reserved._zero3_sub_groups``); 0 where neither ``deepspeed_fp32_convert``
    nor ``deepspeed_fp32_group`` is (an fp32 engine's partitions are cut alike)."""
    if not (deepspeed_fp32_convert(t, st) or deepspeed_fp32_group(t, st)):
        return 0
    return -(-st.trainable // t.shard_group)


def deepspeed_fp32_convert(t: TrainingSpec, st: States) -> int:
    """Bytes of the fp32 copy DeepSpeed ZeRO-3 makes of a sub-group's half partition to clone its fp32
    master from, at init (0 off ZeRO-3, offloaded or without a half master): ``_create_fp32_partitions``
    runs ``converted = fp16_partitioned_groups_flat[i].to(device, dtype=fp32)`` and appends
    ``converted.clone()`` (DeepSpeed v0.19.2 ``stage3.py`` L1008-1010; v0.19.8
    L1169-1172), so the copy lives until the next sub-group's replaces it, and the last one until the
    function returns; the largest sub-group's (``deepspeed_group_elems``) is counted. It comes before
    the gradient bucket and the gradient partition buffer (``_setup_for_real_optimizer``), so its
    segment stays cached under them (found by trace: the end of the load reserved 710 MiB more on an
    8B-shaped 2-layer Llama over 8 ranks)."""
    if not (deepspeed_zero(t) and t.zero == 3) or t.offload_optimizer or not st.trainable \
            or not (t.fp32_master and t.weight_bytes != 4):
        return 0
    return block_of(t, deepspeed_group_elems(t, st) * 4)


def deepspeed_fp32_group(t: TrainingSpec, st: States) -> int:
    """Elements of the largest sub-group's fp32 master of an fp32 DeepSpeed ZeRO-3 engine
    (``TrainingSpec.ds_fp32_clone``; 0 otherwise, and where ``deepspeed_fp32_convert`` makes the copy):
    ``_create_fp32_partitions``' ``flat.to(device, dtype=float32)`` is the flat fp32 partition itself
    (same device and dtype: no copy) and its ``clone()`` the sub-group's master, one flat tensor
    (DeepSpeed v0.19.8 ``stage3.py`` L1163-1172), not one per parameter (trace: an fp32 Llama over 4
    ranks holds one 366.5 MiB master block at the load's end)."""
    if not (deepspeed_zero(t) and t.zero == 3) or t.offload_optimizer or not st.trainable \
            or not t.ds_fp32_clone or deepspeed_fp32_convert(t, st):
        return 0
    return deepspeed_group_elems(t, st)


def deepspeed_init_grads(t: TrainingSpec, st: States) -> int:
    """Bytes of DeepSpeed ZeRO-3's gradient partition buffer as its ``__init__`` makes it (0 off it or
    offloaded): one ``torch.zeros`` of every parameter's partition in the gradient dtype
    (``grad_partitions_flat_buffer``, v0.19.8 ``stage3.py`` L791-793, in ``_setup_for_real_optimizer``
    after the fp32 partitions and the bucket, L780-784), before ``create_reduce_and_remove_grad_hooks``
    gathers each parameter (L519, ``states.ds_init_gathers``). Counted as the rank's gradients
    (``States.grads``: each partition's bytes block-rounded, at most 511 B each above the flat sum)."""
    return st.grads if grads_from_wrap(t) and deepspeed_zero(t) and t.zero == 3 and st.trainable else 0


def deepspeed_step_parts(t: TrainingSpec, st: States, m: ModelSpec | None = None) -> tuple[int, int]:
    """(the fp32 gradient, the flat copy in the gradient dtype) of ``deepspeed_step_grad``; ``m`` given,
    no flat copy where rank 0's ZeRO-1/2 partition is one piece (``deepspeed_partition_one_piece``)."""
    if not deepspeed_zero(t) or t.offload_optimizer or not st.trainable:
        return 0, 0
    n = deepspeed_group_elems(t, st)
    gb = t.weight_bytes
    one = m is not None and deepspeed_partition_one_piece(m, t, st)
    return block_of(t, n * 4), (block_of(t, n * gb) if gb != 4 and not one else 0)  # (n,) fp32; (n,) fp16/bf16


def deepspeed_partition_one_piece(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether rank 0's ZeRO-1/2 gradient partition lies inside the group's first parameter (a large
    embedding table over several ranks), so the step's flatten copies nothing: ``averaged_gradients[i]``
    is ``get_flat_partition(..., return_tensor_list=True)``, a list of narrowed views of the gradients of
    the parameters in the partition (v0.19.8 ``stage_1_and_2.py`` L1085-1091, L2715-2790), and
    ``self.flatten`` (L263, torch ``_flatten_dense_tensors``) of a single tensor returns
    ``tensors[0].contiguous().view({-1})`` (torch ``csrc/utils/tensor_flatten.h``
    ``flatten_dense_tensors``), a view; only the fp32 cast allocates (L3117-3118; v0.14.2 L1870-1890 the
    same). Found by trace: a 2-layer Qwen3 (vocab 151,936) ZeRO-1/2 over 4 ranks makes no (n,) bf16
    block in its step. Not under LoRA (small adapters), tensor or pipeline parallelism."""
    if not (deepspeed_zero(t) and t.zero in (1, 2)) or t.lora_rank or t.tp > 1 or t.pp > 1:
        return False
    tensors = m.parameter_tensors()
    if not tensors or tensor_elements(tensors) != st.trainable:
        return False
    return tensors[0].numel >= -(-st.trainable // t.shard_group)


def deepspeed_step_grad(t: TrainingSpec, st: States, m: ModelSpec | None = None) -> int:
    """Bytes DeepSpeed's ZeRO step adds on the GPU before the optimizer runs (0 off DeepSpeed, or
    with the optimizer offloaded: its fp32 gradients are in host memory). For each group it
    flattens the group's gradient partition (``self.flatten``, torch ``_flatten_dense_tensors``: a
    ``cat``, a new tensor in the gradient dtype) and casts it to the fp32 partition's dtype, so the
    flat copy and the fp32 gradient exist together during the cast; the fp32 gradient then lives
    through the optimizer's step and is dropped after it (``stage_1_and_2.py`` L1892-1917,
    ``stage3.py`` ``_prepare_fp32_grad_for_sub_group`` L1895-1905 and ``_release_sub_group``). An
    fp32 engine's cast returns the flat copy itself: one fp32 tensor."""
    return sum(deepspeed_step_parts(t, st, m))


def step_copies(t: TrainingSpec) -> int | None:
    """Temporaries per tensor of an optimizer step that loops over tensors (None: a foreach step
    makes one per tensor for the whole group at once; 0: none), as ``step_temporaries`` counts them."""
    if t.optimizer in LOWRANK_OPTIMIZERS + LOMO_OPTIMIZERS:
        return 0
    if t.optimizer == "adafactor" and not t.offload_optimizer:
        return 2 if (t.weight_bytes == 4 or t.fp32_master) else 4
    return _copies_per_tensor(t, t.grads_freed_in_backward)


def adafactor_loop(t: TrainingSpec, st: States) -> tuple:
    """What each trainable tensor of ``States.trainables`` (by index) allocates in transformers'
    ``Adafactor.step``, for the reserved replay (``reserved._adafactor_step``): (one fp32 tensor of its
    size, its fp32 copies of a half gradient and weight (``grad.float()``, ``p.float()``; 0 for fp32),
    the row and the column vector of a factored tensor's ``update.mean(dim=-1)`` / ``(dim=-2)`` and
    ``_approx_sq_grad``'s ``r_factor`` / ``c_factor`` (fp32, the sizes of its two states; 0 for a vector)),
    each the block of its request. () where the optimizer is not transformers' Adafactor on one device
    over whole tensors (sharded or offloaded states keep ``_adafactor_temporaries``' count)."""
    if (t.optimizer != "adafactor" or t.offload_optimizer or t.zero_stage or t.fsdp is not None or t.tp > 1
            or t.gemini is not None or t.grads_freed_in_backward
            or len(st.trainable_elems) != len(st.trainables)):
        return ()
    half = not (t.weight_bytes == 4 or t.fp32_master)            # bf16/fp16 weights stepped as they are
    out = []
    for (_w, _k, _g, sts, _m), n in zip(st.trainables, st.trainable_elems):
        f = int(block_of(t, n * 4))                               # (shape,) fp32
        row, col = (sts[0], sts[1]) if len(sts) == 2 else (0, 0)  # factored: (lead, rows) and (lead, cols) fp32
        out.append((f, f if half else 0, row, col))
    return tuple(out)


def _adafactor_temporaries(t: TrainingSpec, st: States, copies: int) -> int:
    """transformers' Adafactor (``optimization.py``, ``Adafactor.step``) is a loop over tensors in
    fp32 (there is no foreach version): ``update = grad**2 + eps`` and the factored approximation
    that replaces it, then ``-update * lr``, leave two fp32 tensors of the parameter's size alive at
    once; a bf16/fp16 parameter adds its fp32 copy (``p.float()``) and its gradient's
    (``grad.float()``). The largest parameter sets the peak (2x or 4x its fp32 size, as trace of
    the real optimizer shows: tests/test_optim_transients.py; ``copies``: ``step_copies``). On one
    device over whole tensors (``adafactor_loop``) the previous tensor's ``update`` is freed only when
    the name is rebound, after this tensor's ``grad**2`` and ``+ eps`` exist (L1258; the copies of a
    half gradient and weight come before them), so the peak is the largest ``previous + copies x this``
    over neighbours in parameter order, as ``loop_pair_bytes`` for Adam's loop: a Llama whose MLP
    matrices are its largest tensors holds gate_proj's update beside up_proj's two (fp32) or four (half)
    temporaries (trace, 2 layers, hidden 1024, MLP 8192, vocab 8000, b1 s64: 32 MiB above ``copies``
    x the largest)."""
    loop = adafactor_loop(t, st)
    if loop:
        f = [loop[j][0] for j in parameter_order(st.trainables)]  # each tensor's fp32 block, in step order
        return max([copies * f[0]] + [a + copies * b for a, b in zip(f, f[1:])])
    sb = 4 if (t.weight_bytes == 4 or t.fp32_master) else t.weight_bytes
    elems = st.largest_param // sb
    return copies * block_of(t, elems * 4)


def lomo_temporaries(t: TrainingSpec, shape: tuple[int, ...]) -> int:
    """Peak bytes one parameter's update adds inside lomo_optim's hook (``fuse_update``: lomo.py
    L96-140, adalomo.py L143-205), above its gradient: ``grad_fp32 = p.grad.to(torch.float32)`` (a
    copy of a half gradient, which ``p.grad = None`` then frees; an fp32 gradient is ``grad_fp32``
    itself, kept alive by it) and ``p_fp32 = p.data.to(torch.float32)`` (a copy of half weights; the
    weight itself when fp32). Lomo then updates in place. AdaLomo also makes ``update = grad_fp32**2 +
    eps`` (two fp32 tensors of the parameter's size at once), then, that sum still bound to ``update``,
    the factored ``torch.mul(r_factor, c_factor)`` beside its row and column factors, and at the end
    ``p_fp32`` beside the update. Measured on lomo_optim 0.1.1 with LiveBytes (tests/test_lomo.py)."""
    n = 1
    for d in shape:
        n *= d
    half = t.weight_bytes != 4
    g32 = block_of(t, n * 4) if half else 0          # grad_fp32 (half: a copy; fp32: the gradient itself)
    p32 = block_of(t, n * 4) if half else 0          # p_fp32
    after = g32 - block_of(t, n * t.weight_bytes) if half else 0   # p.grad = None: a half gradient freed
    if t.optimizer == "lomo":
        return max(g32, after + p32)                 # the copy beside the gradient; then p_fp32 for it
    f = block_of(t, n * 4)                           # one fp32 tensor of the parameter's size
    factors = block_of(t, shape[0] * 4) + block_of(t, shape[1] * 4) if len(shape) > 1 else 0
    return max(after + 2 * f + factors, after + f + p32)


def lomo_update_bytes(m: ModelSpec, t: TrainingSpec) -> tuple[int, int]:
    """LOMO / AdaLomo (``oib_update_bytes``): a parameter's tensor hook runs before its gradient is
    accumulated, and updates the parameters whose gradient was accumulated since the previous hook (its
    neighbour, the next in registration order, whose backward ran just before), so that gradient, the
    hook's own parameter's incoming gradient and the update's temporaries (``lomo_temporaries``) exist
    together; after ``loss.backward()``, ``fused_backward`` calls the hook once more for the last ones
    (the input embeddings). Returns the largest such amount among the hooks of the tensors updated while
    activations are alive, and among all."""
    ps = [p for p in m.parameter_tensors() if p.role != "unused"]
    w = t.weight_bytes

    def upd(q: Any) -> int:
        return int(block_of(t, q.numel * w)) + lomo_temporaries(t, q.shape)
    mid = [int(block_of(t, p.numel * w)) + upd(q) for p, q in zip(ps, ps[1:])]
    return max(mid + [0]), max(mid + [upd(p) for p in ps if p.role == "embedding"] + [upd(ps[0])])


def _galore_fields(m: ModelSpec, t: TrainingSpec, st: States, oib: bool) -> dict[str, Any]:
    """``step_temp`` (and GaLore's ``step_events``): a layerwise GaLore steps inside backward (none)."""
    if t.optimizer not in LOWRANK_OPTIMIZERS:
        return {"step_temp": step_temporaries(t, st, m)}
    if oib:
        return {"step_temp": 0}
    o, tensors = t.galore_options(), step_order([x for _, x in _galore_tensors(m, t)])
    steps = {svd: step_replay(tensors, t.optimizer, t.weight_bytes, o["rank"], o["proj_type"], svd,
                              lambda b: int(block_of(t, b))) for svd in (True, False)}
    # the peak: the higher of the two (galore_step_bytes); the replay's first step updates the projectors
    # (as every run's does), the second is a steady one
    return {"step_temp": max(peak for peak, _ in steps.values()), "step_events": steps[False][1],
            "step_events_first": steps[True][1]}


def _galore_tensors(m: ModelSpec, t: TrainingSpec) -> list[tuple[bool, GTensor]]:
    """The trainable tensors in ``model.parameters()`` order, each (input embedding?, shape and
    GaLore target or not)."""
    return [(p.role == "embedding", GTensor(p.shape, galore_target(t, p))) for p in m.parameter_tensors()
            if p.role != "unused"]


def _galore_peak(t: TrainingSpec, tensors: list[GTensor], layerwise: bool) -> tuple[int, tuple]:
    """``galore.step_replay`` at a steady step and at a projector-update step (every ``update_proj_gap``
    steps, the first included), allocator-rounded: the higher peak of the two, and its events."""
    o = t.galore_options()
    return max((step_replay(tensors, t.optimizer, t.weight_bytes, o["rank"], o["proj_type"], svd,
                            lambda b: int(block_of(t, b)), layerwise) for svd in (False, True)),
               key=lambda pe: pe[0])


def galore_step_bytes(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes GaLore's ``optimizer.step()`` allocates above what exists before it (``estimate.galore``):
    one optimizer over the non-target group, then the target weights (``galore.step_order``)."""
    return galore_step_events(m, t)[0]


def galore_step_events(m: ModelSpec, t: TrainingSpec) -> tuple[int, tuple]:
    """``galore_step_bytes`` and the allocations behind it, for the allocator replay."""
    return _galore_peak(t, step_order([x for _, x in _galore_tensors(m, t)]), False)


def galore_oib_bytes(m: ModelSpec, t: TrainingSpec) -> tuple[int, int]:
    """GaLore's layerwise variants (``oib_update_bytes``): one parameter's gradient plus its own
    optimizer's step peak, the largest among the tensors updated while activations are alive (all
    but the input embeddings) and among all."""
    def one(x: GTensor) -> int:
        return int(block_of(t, x.numel * t.weight_bytes)) + _galore_peak(t, [x], True)[0]
    each = [(emb, one(x)) for emb, x in _galore_tensors(m, t)]
    return max([b for emb, b in each if not emb] + [0]), max(b for _, b in each)


def _copies_per_tensor(t: TrainingSpec, per_parameter: bool) -> int | None:
    """State-sized temporaries one optimizer step makes per tensor (None: the whole group's worth).
    SGD, with momentum or not, makes none: without weight decay or ``maximize`` (torch.optim.SGD's
    defaults, which the workload keeps) the foreach step is ``_foreach_mul_``/``_foreach_add_`` on
    the momentum buffers and ``_foreach_add_(params, grads, alpha=-lr)``, all in place, and the
    first step's buffers are ``grad.detach().clone()``, the state itself (torch 2.13
    ``torch/optim/sgd.py`` ``_multi_tensor_sgd`` L403-472; the for-loop ``_single_tensor_sgd`` alike).
    Found by trace: Mistral (2 layers) fp16-amp SGD momentum: +6.4% before (a gradient-sized
    temporary charged at the step)."""
    if t.optimizer in LOWRANK_OPTIMIZERS + LOMO_OPTIMIZERS:
        return 0  # replayed tensor by tensor (galore_step_bytes, galore_oib_bytes; lomo_update_bytes)
    if t.optimizer in ("sgd", "sgd-momentum", "schedule-free-sgd") + BNB_OPTIMIZERS + TORCHAO_OPTIMIZERS \
            or t.offload_optimizer or t.torchao_offload or t.fsdp_offload_params:
        # torchao's CPUOffloadOptimizer steps the tensors of >= 4096 elements on the host and copies them
        # back in place (``p_device.copy_(p_host, non_blocking=True)``, cpu_offload.py L131-135); the
        # smaller ones' on-device optimizer is fused AdamW by default (none) and small
        # torchao's compiled step makes buffers, not state-sized copies: ``torchao_optim.step_events``
        # bitsandbytes' step is one in-place CUDA kernel per tensor (``optimizer_update_8bit_blockwise``
        # / ``optimizer_update_32bit`` write state1/2, absmax and the parameter in place); schedule-free
        # SGD's is ``lerp_``/``add_``/``sub_`` on y, z and the gradient (``sgd_schedulefree.py`` L155-186)
        return 0
    if t.optimizer in ("rmsprop", "schedule-free-adamw", "schedule-free-radam") and t.impl != "foreach":
        # for-loop: one temporary of the tensor's size, the rest in place (rmsprop.py L325 ``avg =
        # square_avg.sqrt()`` then ``avg.add_(eps)``; schedule_free ``denom = exp_avg_sq.div(bc2).sqrt_().add_(eps)``
        # and ``grad.div_(denom)``)
        return 1
    if t.optimizer == "adagrad" and t.impl != "fused":
        # for-loop: ``std = state_sum.sqrt().add_(eps)``, then ``param.addcdiv_(grad, std)`` (adagrad.py
        # L423-426); foreach, a group of one under optimizer-in-backward: ``foreach_groups``
        return (2 if per_parameter else None) if t.impl == "foreach" else 1
    if t.optimizer == "lion":
        # lion-pytorch (lion_pytorch.py ``update_fn``), a loop over tensors whatever optimizer_impl says:
        # ``update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()``: the clone and
        # the sum coexist, two tensors of the parameter's size
        return 2
    if t.impl == "fused":
        return 0
    if t.impl == "foreach":
        return 1 if per_parameter else None
    return 2


def oib_update_bytes(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """Optimizer-in-backward: the gradient of one parameter plus its update's temporaries, alive
    together inside its post-accumulate-grad hook (the gradient is freed right after). Returns the
    largest such amount among tensors updated while activations are alive (all but the input
    embeddings, e.g. an untied LM head right after the loss) and among all (the embeddings, whose
    gradients complete last). Sharded (ZeRO/FSDP2) tensors update their shard."""
    if t.optimizer in LOWRANK_OPTIMIZERS:
        return galore_oib_bytes(m, t)
    if t.optimizer in LOMO_OPTIMIZERS:
        return lomo_update_bytes(m, t)
    k = _copies_per_tensor(t, True) or 0
    sb = 4 if (t.weight_bytes == 4 or t.fp32_master) else t.weight_bytes
    gb = t.main_grad_bytes or t.weight_bytes
    d = t.shard_group if t.zero_stage >= 1 else 1
    if t.lora_rank:
        n_all = n_mid = st.largest_param // sb  # adapters only, all inside the layers
    else:
        sizes = [(p.role == "embedding", p.numel if t.tp == 1 or p.role in ("norm", "router")
                  else -(-p.numel // t.tp)) for p in m.parameter_tensors()]
        n_all = max(n for _, n in sizes)
        n_mid = max([n for emb, n in sizes if not emb] + [0])

    def one(n: int) -> int:
        n = -(-n // d)
        ao = torchao_optim.step_peak(t.optimizer, n, t.torchao_block, lambda x: block_of(t, x)) \
            if t.torchao_block else 0  # torchao: the tensor's compiled-step buffers
        return block_of(t, n * gb) + k * block_of(t, n * sb) + ao
    return one(n_mid), one(n_all)


def _head_is_lora_target(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether peft puts a LoRA adapter on the LM head (``lm_head`` among the target modules). Over
    a 4-bit head its layer (peft ``tuners/lora/bnb.py`` ``Linear4bit.forward``) runs
    ``result = result.clone()`` (the base output freed), then ``lora_B(lora_A(dropout(x))) *
    scaling`` and ``result + output``: three logits-sized tensors alive at once (the clone, the
    adapter's output and its scaled copy; then the clone, the scaled copy and the sum)."""
    targets = set(t.lora_targets or default_lora_targets(m)) if t.lora_rank else set()
    return bool(targets) and any(p.layer is None and p.role == "linear" and p.module in targets for p in m.parameter_tensors())


def head_dequant_bytes(m: ModelSpec, t: TrainingSpec) -> tuple[int, int]:
    """(bytes of the LM head's weight dequantized from 4 bits plus its cast to the compute dtype,
    bytes of the copy the matmul reads: the cast, else the dequantized weight) when the head is
    quantized (Lightning Fabric converts ``lm_head`` too: ``quant4.is_quantized``); (0, 0)
    otherwise. In ``F.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)``
    (bitsandbytes 0.42.0 ``autograd/_functions.py`` L516; backward L546) the dequantized weight
    and its cast coexist only inside ``.to()``: the dequantized one is a temporary of the
    expression, freed before the matmul allocates its output, so the matmul runs beside the cast
    alone (as trace of ``trainmem.bnb.MatMul4Bit`` shows)."""
    if not t.quantize:
        return 0, 0
    dq, cast = dequant_dtypes(t)
    heads = [p for p in m.parameter_tensors() if p.layer is None and is_quantized(p, t)]
    both = max((block_of(t, p.numel * dq) + (block_of(t, p.numel * cast) if cast else 0) for p in heads), default=0)
    read = max((block_of(t, p.numel * (cast or dq)) for p in heads), default=0)
    return both, read


def tied_head_grad(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of the LM head's gradient contribution to a tied input embedding.

    The head and the embedding feed one ``AccumulateGrad`` node, so autograd's input buffer holds
    the head's gradient (the weight's dtype) from the head's backward until the embedding's, when
    ``InputBuffer::accumulate`` adds the embedding's gradient out of place (the head's gradient is
    a transposed view whose storage is shared, so it cannot be reused): head part, embedding part
    and their sum are alive together, then the sum becomes ``.grad``."""
    if not (m.tied_embeddings and is_lm(m)) or t.lora_rank or t.pp > 1:
        return 0
    # under FSDP's mixed precision the gradient is the bf16 unsharded parameter's
    return _embedding_block(m, t.tp, 2 if t.precision == "bf16-mp" else t.weight_bytes, t.expandable_segments)


def whole_model_compiled(t: TrainingSpec) -> bool:
    """Whether ``--compile`` puts the embeddings and the head in one compiled graph with the layers
    (``torch.compile(model)``, as trace --compile runs a transformers model). torchtune compiles
    each decoder layer on its own (``training.compile_model``: ``m.compile(backend=backend)`` for
    every ``TransformerSelfAttentionLayer``, torchtune/training/_compile.py L45-55 at 1814feb17)
    and its loss apart or not at all (``torchtune_compiles_whole_loss``), so its token embedding
    and output projection run eagerly: a tied embedding's gradient is autograd's (``tied_head_grad``), not the compiled
    backward graph's (``compiled_tied_grads``)."""
    return t.compile and t.extra.get("framework") != "torchtune"


def compiled_tied_grads(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[int, int]:
    """A tied embedding's gradient under ``torch.compile`` (the backward graph trace --compile runs):
    (the head's part, held while the layers' backward runs; the embedding's part, at its backward).

    The weight is one graph input read twice, so the backward graph sums its two gradients itself
    and returns the sum: the head's part is the ``mm`` of the logits' gradient and the head's input,
    in the compute dtype, read again only by the final ``add``; the embedding's part is inductor's
    decomposition of ``embedding_dense_backward`` (``torch/_decomp/decompositions.py``: an fp32
    ``new_zeros`` table, ``full`` in the graph, and ``_unsafe_masked_index_put_accumulate`` into it,
    out of place: two fp32 (vocab, hidden) tables), then cast and added. Under autocast the head's
    part is cast to fp32 first (a pointwise op fused into the ``add``); trace's runner frees a fused
    chain's inputs at its first read, so there the head's part is not held (0): a GPU kernel would
    hold the half ``mm`` output until the ``add``. Measured against trace --compile on
    llama-3.2-1b (tied; tests/test_estimate_compile.py)."""
    elems = tied_head_grad(m, t) // max(t.weight_bytes, 1) if tied_head_grad(m, t) else 0
    if not elems:
        return 0, 0
    return (0 if pol.amp else elems * pol.half), 2 * F32 * elems


def chunk_head_grads(m: ModelSpec, t: TrainingSpec, pol: Policy) -> int:
    """A loss over ``--loss-chunks`` output chunks calls the head once per chunk, and each call's
    backward makes a weight gradient of the whole head (vocab x hidden, in the matmul's dtype: the
    half copy's under autocast). They meet in one input buffer (the weight's ``AccumulateGrad``, or
    autocast's cached cast's ``ToCopyBackward0``): the first is ``TBackward0``'s transposed view of
    the ``mm`` output, which ``InputBuffer::accumulate`` cannot reuse (``can_accumulate_inplace``:
    not a view), so the second chunk's add is out of place: two chunk gradients and their sum at once
    (the later adds go into the sum in place). Returns those three gradients' bytes (0 without
    chunks, with a frozen head, or off one GPU, where trace does not run the chunked loop). Found by
    trace: Llama-3.2 (2 layers, tied head) pure bf16, 4 chunks: -11.6% before; the chunks' logits
    gradients waiting meanwhile are the moments' (``moments._micro_step``). Not an artifact of trace's
    dispatch mode, under which every ``InputBuffer`` add is out of place (``trace/cuda_kernels.py``):
    on plain tensors, as on CUDA, ``can_accumulate_inplace`` also needs the buffer's tensor to hold
    the last reference to its storage, and the first chunk's gradient is a view
    (``mm_mat2_backward``'s ``grad.t().mm(mat1).t()`` for the column-major ``weight.t()``, then
    ``TBackward0``'s ``.t()``, torch/csrc/autograd/FunctionsManual.cpp) whose view metadata keeps the
    ``mm`` output alive (``as_view``, torch/csrc/autograd/VariableTypeUtils.h): the CPU profiler shows one
    out-of-place ``aten::add`` of the weight's size, then in-place ``add_``
    (tests/test_torchtune_readme31.py)."""
    if not (is_lm(m) and t.loss_chunks > 1 and loss_mode(m, t) in ("chunked", "half")) or t.lora_rank:
        return 0
    if t.dp > 1 or t.tp > 1 or t.pp > 1 or t.cp > 1 or t.fsdp is not None or t.zero_stage:
        return 0
    return 3 * block_of(t, _head_weight_numel(m, 1) * pol.half)


def torchtune_cap_bytes(m: ModelSpec, t: TrainingSpec, half: int, out_bytes: int) -> int:
    """Bytes per token the head side of a derived model differs by where torchtune caps the hidden
    state (``caps_hidden_not_logits``): ``TanhBackward0`` saves its result, a (b, s, hidden) tensor in
    the activations' dtype (``half``), in place of transformers' (b, s, vocab) one in the logits'
    dtype (``out_bytes``), which the derived head side measured; the division and the scalar product
    save nothing, and the capped state the output projection saves is the size of the normed state
    transformers' head saves. 0 for other runs."""
    if not caps_hidden_not_logits(m, t):
        return 0
    return m.hidden_size * half - m.vocab_size * out_bytes


def softcap_saved(m: ModelSpec, out_bytes: int, t: TrainingSpec | None = None) -> int:
    """Bytes per logit element that a final logit soft-cap saves: transformers'
    ``Gemma2ForCausalLM.forward`` (Gemma-3's too, when its config sets one) computes ``logits / cap``,
    ``torch.tanh``, ``* cap`` on the head's output (``models/gemma2/modeling_gemma2.py``), and ``TanhBackward0``
    saves its result, a (b, s, vocab) tensor in the head output's dtype (``out_bytes``;
    derivatives.yaml ``tanh``: ``tanh_backward(grad, result)``); the division and the scalar
    product save nothing. A derived architecture's head side counts it already (measured through
    the model's forward); the chunked loss loop caps each chunk the same way
    (``workload._chunked_output_loss``), so each chunk's copy is freed when that chunk's tanh is
    back-propagated, just before its head backward (``moments._head_backward``). 0 without a
    ``final_logit_softcapping`` in the config, or where ``t`` caps the hidden state instead
    (``caps_hidden_not_logits``)."""
    cap = m.config.get("final_logit_softcapping") if m.config else None
    if t is not None and caps_hidden_not_logits(m, t):
        return 0  # torchtune caps the hidden state, not the logits
    return out_bytes if (is_lm(m) and cap is not None) else 0


def emb_accumulated(m: ModelSpec, t: TrainingSpec, stage: str) -> int:
    """Bytes of an untied token embedding's gradient as its backward makes it, when an earlier
    micro-batch's gradient is already in ``.grad``: ``embedding_dense_backward`` returns the whole
    (vocab, hidden) gradient in the weight's dtype and ``AccumulateGrad`` then adds it to ``.grad``
    (torch ``csrc/autograd/functions/accumulate_grad.h`` ``accumulateGrad``: ``variable_grad +=
    new_grad``), so both exist for a moment (``moments._layers_backward``, valid from the second
    micro-step on). It is the first pipeline stage's peak when the other micro-batches in flight
    keep their activations meanwhile. Found by trace: llama-3.2-1b --pp 4 --grad-accum 8 bf16, b 1,
    s 1024, first stage -0.8% before. Under PyTorch's tensor parallelism (DTensor) the whole table,
    replicated (``states._replicated_grad``: ``embedding_dense_backward`` has no ``Shard(0)`` output),
    beside the replicated ``.grad`` it is added to (found by trace: Llama 2 layers, --tp 2, fp32, SGD,
    2 micro-batches, b 1, s 256, the second micro-batch's ``embedding_dense_backward``: -4.0% before).
    0 for a tied embedding (``tied_head_grad``; ``tied_replicated_grad`` under DTensor), a frozen one
    (LoRA), FSDP / ZeRO (sharded gradients), but FSDP2 accumulating unsharded gradients
    (``accumulates_unsharded``, every pipeline stage under FSDP2): its ``post_backward`` adds the new
    unsharded gradient to the accumulated one in place (torch 2.13 ``_fully_shard/_fsdp_param.py``
    L815-821 ``accumulate_unsharded_grad_if_needed``: ``unsharded_accumulated_grad +=
    unsharded_param.grad``, the fp32 copy under bf16-mp; without a reduce dtype ``AccumulateGrad``
    adds it to ``.grad``), the new one in the gradient's dtype (bf16 under bf16-mp), the whole
    table under DTensor's tensor parallelism (``states._replicated_grad``). Found by trace:
    llama-3.2-1b cut to 4 layers, --pp 2 --dp 2 --tp 2 --sequence-parallel --fsdp full, bf16-mp, first
    stage -2.5% before (the embedding's backward of the second micro-batch)."""
    if not (t.pp == 1 or stage == "first") or t.lora_rank or t.grads_freed_in_backward or tied_head_grad(m, t):
        return 0
    if t.fsdp is not None and t.fsdp_version == 2 and t.accumulates_unsharded and t.shard_group > 1:
        return _embedding_block(m, 1 if dtensor_tp(t) else t.tp, 2 if t.precision == "bf16-mp" else t.weight_bytes,
                                t.expandable_segments)
    if t.fsdp is not None or t.zero_stage:
        return 0
    return _embedding_block(m, 1 if dtensor_tp(t) else t.tp, t.weight_bytes, t.expandable_segments)


def emb_upcast(m: ModelSpec, t: TrainingSpec, stage: str) -> int:
    """Bytes of an untied embedding's new bf16 gradient beside the fp32 copy FSDP2 makes of it in a
    step's first micro-batch when it accumulates unsharded gradients under bf16-mp: its
    ``post_backward`` with ``reduce_grads`` off calls ``to_accumulated_grad_if_needed``
    (torch 2.13 ``_fully_shard/_fsdp_param.py`` L802-813: ``self.unsharded_accumulated_grad =
    unsharded_grad.to(self.reduce_dtype)`` while ``unsharded_grad`` is still referenced), so the bf16
    gradient and its fp32 copy, counted with the gradients, exist together (:func:`emb_accumulated`
    is the same tensor in the later micro-batches). With DTensor's tensor parallelism both are the
    whole table (``states._replicated_grad``). Found by trace: llama-3.2-1b cut to 4 layers, --pp 2
    --dp 2 --tp 2 --sequence-parallel --fsdp full, bf16-mp, the first stage -2.5% before, at the
    root's post-backward of the step's first micro-batch with the second still in flight."""
    if t.precision != "bf16-mp" or t.fsdp_version != 2 or not t.accumulates_unsharded:
        return 0
    return emb_accumulated(m, t, stage)


def tied_replicated_grad(m: ModelSpec, t: TrainingSpec) -> int:
    """PyTorch's tensor parallelism (alone or under FSDP2), a tied embedding: bytes of the embedding's own
    gradient, which DTensor computes replicated, the whole (vocab, hidden) table
    (``embedding_dense_backward`` has no ``Shard(0)`` output strategy: ``states._replicated_grad``),
    and which lives while ``InputBuffer::accumulate`` redistributes it to the head's ``Shard(0)``
    gradient (a copy of this rank's rows) and adds the two: replicated table, its shard, the head's
    part and their sum at once. Found by trace: Llama-3.2 (2 layers) --tp 2 --recompute full, where
    the embedding's backward is the peak: -8.3% before."""
    if not tied_head_grad(m, t) or not dtensor_tp(t):
        return 0
    return _embedding_block(m, 1, 2 if t.precision == "bf16-mp" else t.weight_bytes, t.expandable_segments)


def block_of(t: TrainingSpec, nbytes: Any) -> Any:
    """``allocator_rules.block_bytes`` in ``t``'s allocator mode: the default caching allocator's
    blocks, or expandable segments' (``TrainingSpec.expandable_segments``: 512 B rounding alone)."""
    return block_bytes(nbytes, t.expandable_segments)


@lru_cache(maxsize=1024)
def _embedding_block(m: ModelSpec, tp: int, nbytes: int, expandable: bool) -> int:
    emb = word_embedding(m)
    return block_bytes(-(-emb.numel // tp) * nbytes, expandable) if emb is not None else 0


# ----------------------------------------------------------------------------------------------
#: TrainingSpec fields that quantities depend on: all but the batch, the sequence and accumulation
_STEP_FIELDS = tuple(f.name for f in fields(TrainingSpec) if f.name not in ("batch_size", "seq_len",
                                                                           "grad_accum", "extra"))
_key_of = operator.attrgetter(*_STEP_FIELDS)
_POSITION = {name: i for i, name in enumerate(_STEP_FIELDS)}
_CACHE = BoundedCache(8192)


def quantities(m: ModelSpec, t: TrainingSpec, stage: str = "first") -> Quantities:
    """The quantities of ``m`` trained as ``t`` on pipeline stage ``stage`` (cached)."""
    if t.pp > 1 and t.pp_schedule == "zero-bubble":
        raise TrainmemError("--pp-schedule zero-bubble: the estimate does not model ScheduleInterleavedZeroBubble's "
                            "split backward (each input-gradient backward retains its graph, saved tensors and "
                            "output gradients, until the weight-gradient backward); use trace")
    if t.pp > 1 and t.pp_weighted and not torch_pipeline(t):
        raise TrainmemError("--pp-first-stage-less-layers / --pp-last-stage-less-layers: torchtitan's stage split "
                            "is modelled, not Megatron-LM's uneven split (--decoder-first-pipeline-num-layers, "
                            "--account-for-embedding-in-pipeline-split: --framework megatron); drop one of them")
    if t.virtual_stages > 1 and not torch_pipeline(t) and (t.pp_schedule != "interleaved-1f1b" or t.grad_accum % t.pp):
        raise TrainmemError(f"--framework megatron --pp-schedule {t.pp_schedule}: Megatron-LM's interleaved schedule "
                            "is modelled as --pp-schedule interleaved-1f1b with --grad-accum a multiple of --pp (its "
                            "default micro-batch group of pp; other counts raise in "
                            "forward_backward_pipelining_with_interleaving)")
    # accumulation enters only through whether FSDP accumulates its gradients unsharded (no_sync)
    # (an encoder-decoder's coefficients are read at its decoder-to-encoder length ratio)
    # (and interleaved 1F1B's pairs in flight, from the schedule of grad_accum micro-batches)
    # (and whether the model builds a KV cache: config.use_cache, which ModelSpec's equality leaves out)
    # (and, for a derived architecture, whether the micro-batch is 1: its batch-1 coefficients)
    # (and the framework preset, whose own model code some terms read: TrainingSpec's equality leaves
    # ``extra`` out, e.g. torchtune's compile units and Gemma-2 soft-cap, ``caps_hidden_not_logits``)
    # (and the batch and sequence of a derived model whose coefficients hold at one point: ``point_at``)
    key = (m, stage, _key_of(t), derived_regime(m, t), derived_batch1(m, t), decoder_ratio(m, t), point_at(m, t),
           t.accumulates_unsharded, t.grad_accum if t.virtual_stages > 1 else 0, kv_cache(m, t),
           t.extra.get("framework"), t.extra.get("framework_version"), unsloth_offloads(m, t))
    return _CACHE.get_or_build(key, lambda: _build(m, t, stage))


def unsloth_offloads(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether ``--unsloth-gc`` moves the layers' inputs to host memory at this micro-batch: a (b, s, h)
    input above 2 MiB in the model dtype (``estimate.unsloth.offloads``)."""
    return t.unsloth_gc and unsloth.offloads(m.hidden_size, Policy.of(t.precision).stream, t.batch_size * t.seq_len)


#: layout fields of a parallel shape, in the order ``shape_quantities`` reads its rows
SHAPE_FIELDS = ("tp", "pp", "cp", "dp", "zero", "recompute", "sequence_parallel")
_RECOMPUTE = RECOMPUTE
_SHAPES: dict[tuple, dict[tuple, tuple]] = {}


def shape_quantities(m: ModelSpec, base: TrainingSpec, stage: str, rows: list[list[int]]) -> list[tuple]:
    """``quantities`` of ``base`` with each row's parallel shape, as gather-ready tuples (ints,
    floats, transients, parameters on the rank). A row is the ``SHAPE_FIELDS`` (recompute as an index
    into none/selective/full, sequence parallelism as 0/1) then a valid batch, sequence and
    accumulation, used only to build the spec the first time a shape is met."""
    memo = _SHAPES.setdefault((m, stage, _key_of(base), derived_regime(m, base), derived_batch1(m, base),
                               decoder_ratio(m, base), point_at(m, base), base.extra.get("framework"),
                               base.extra.get("framework_version"), unsloth_offloads(m, base)), {})
    out = []
    for row in rows:
        # + FSDP no_sync accumulation, and interleaved 1F1B's micro-batches (its pairs in flight)
        shape = (*row[:7], base.grad_sync == "step" and row[9] > 1, row[9] if base.virtual_stages > 1 else 0)
        hit = memo.get(shape)
        if hit is None:
            tp, pp, cp, dp, zero, rec, sp, b, s, ga = row
            every = base.recompute_every if _RECOMPUTE[rec] == "full" else 1  # every N-th layer: full only
            t = replace(base, tp=tp, pp=pp, cp=cp, dp=dp, zero=zero, recompute=_RECOMPUTE[rec],
                        recompute_every=every, sequence_parallel=bool(sp), batch_size=b, seq_len=s, grad_accum=ga)
            q = quantities(m, t, stage)
            hit = memo[shape] = (_ints_of(q), _floats_of(q), q.transients, q.detail.states.params_rank)
        out.append(hit)
    return out


def clear_cache() -> None:
    _CACHE.clear()
    _SHAPES.clear()
    model_states.cache_clear()


def _inflight(t: TrainingSpec, stage: str) -> tuple[int, int]:
    """(micro-batches in flight on this pipeline stage, the fixed count when the schedule fixes it)."""
    # micro-batches in flight: 1F1B's first stage min(pp, grad_accum) (``pp_inflight``, moments.tokens),
    # its later stages fewer (the last one); GPipe runs every forward of the step before the first
    # backward on every stage (torch schedules.py ``ScheduleGPipe._step_microbatches``): all of them
    # (a middle stage, stage 1: min(pp - 1, grad_accum), Schedule1F1B's warm-up there, torch 2.13
    # schedules.py L1052-1055 ``Schedule1F1B._step_microbatches``: ``warmup_chunks = min(n_microbatches,
    # num_stages - stage_index)``)
    gpipe = t.pp > 1 and t.pp_schedule == "gpipe"
    inflight_fixed = 1 if (t.pp == 1 or (stage == "last" and not gpipe)) else (t.num_microbatches_in_flight or 0)
    pp_inflight = GPIPE_INFLIGHT if gpipe else t.pp - (stage == "middle")
    return pp_inflight, inflight_fixed


def _head_dequant_fields(m: ModelSpec, t: TrainingSpec, head_here: bool) -> dict[str, int]:
    """The 4-bit LM head's terms (``head_dequant_bytes``: its dequantized weight and cast, bytes),
    on the stage that holds the head; ``head_lora``: 3 when peft adapts that head."""
    temp, read = head_dequant_bytes(m, t) if head_here else (0, 0)
    return {"head_temp": temp, "head_read": read,
            "head_lora": 3 if (temp and _head_is_lora_target(m, t)) else 0}


def _top_fields(m: ModelSpec, t: TrainingSpec, pol: Policy) -> dict[str, float]:
    """Bytes per token above the layers of a classifier or question-answering head: its final
    RMSNorm's backward and forward (``final_norm_backward``/``final_norm_forward``) and a BERT
    head's last LayerNorm forward (``bert_top_forward``)."""
    return {"final_norm_bwd_tok": final_norm_backward(m, t, pol), "final_norm_fwd_tok": final_norm_forward(m, t, pol),
            "bert_top_fwd_tok": bert_top_forward(m, t, pol)}


def _build_temp(t: TrainingSpec, st: States, comm: int) -> int:
    """The model build's allocated peak above what ``model_loaded`` ends with (``Quantities.build_temp``).
    DeepSpeed ZeRO-3 of a model built whole (``TrainingSpec.ds_whole_load``): the conversion's peak
    (``states.zero3_whole_load``: the whole model and one partition) is reached before the optimizer
    makes its fp32 partitions, its gradient partition buffer and its bucket, so it is measured
    against all of ``model_loaded``'s end, not only the weights; a smaller peak adds nothing. DeepSpeed
    ZeRO-3's last init step gathers each trainable parameter whole on top of all of it
    (``states.ds_init_gathers``): its largest one. Before them its fp32 master is cloned from an fp32
    copy of the half partition (``deepspeed_fp32_convert``). ZeRO-1/2 offloaded clones the half
    partition on the GPU before its offload buffer exists (``deepspeed_offload_clone``)."""
    gather = max((sum(block_bytes(x, t.expandable_segments) for x in g) for g in st.gathered), default=0)
    grads = st.grads if grads_from_wrap(t) and not t.optimizer_in_backward else 0
    convert = max(0, deepspeed_fp32_convert(t, st) - comm - grads)  # (before the bucket and the gradients)
    # ZeRO-1/2 offloaded: the partition's half clone, before the offload buffer (``comm``) exists
    convert = max(convert, deepspeed_offload_clone(t, st) - comm)
    if not st.build_peak:
        return max(st.build_temp, gather, convert)
    return max(0, st.build_peak - (st.weights + st.buffers + st.master + comm + grads), gather, convert)


def _flat_temp(t: TrainingSpec, st: States, comm: int) -> int:
    """``Quantities.ds_flat_temp``: bytes of DeepSpeed ZeRO-1/2's flat group (``deepspeed_flat_on_gpu``) above
    what ``model_loaded`` ends with: it is made before the fp32 partitions (``st.master``) and the offload
    buffer or buckets (``comm``), and it replaces the parameters, so only its excess over those counts."""
    return max(0, deepspeed_flat_on_gpu(t, st) - st.master - comm)


def _derived_outer_fields(m: ModelSpec, t: TrainingSpec, stage: str) -> dict[str, float]:
    """A derived model's outer bytes per position pair, per sample and per step (an encoder head's:
    ``estimate.derived.outer_ssq``, ``outer_per_sample``, ``outer_const``); zeros otherwise."""
    if m.family != "derived":
        return {"outer_rest_ssq": 0.0, "outer_rest_b": 0.0, "outer_rest_const": 0.0}
    return {"outer_rest_ssq": derived_outer_ssq(m, t, stage), "outer_rest_b": derived_outer_per_sample(m, t, stage),
            "outer_rest_const": derived_outer_const(m, t, stage)}


def _build(m: ModelSpec, t: TrainingSpec, stage: str) -> Quantities:
    pol = Policy.of(t.precision)
    st = model_states(m, t, stage)
    derived = m.family == "derived"
    lc = litgpt_terms(m, t, pol, _stage_layer(m, t, pol, stage))
    lo, hi = t.stage_span(m.num_layers, stage)  # the stage's (torchtitan's weighted split: uneven)
    layers = (hi - lo) // t.virtual_stages  # one stage's (interleaved: a rank holds several)
    oib = t.grads_freed_in_backward
    input_tok = m.hidden_size * pol.stream / (t.tp if t.sequence_parallel else 1)  # a layer's input (b, s, h)
    checkpointed = layers // t.recompute_every if t.recompute in ("full", "op") else 0
    kept, redo, top_recomputed = _kept_and_redone(t, lc, input_tok, checkpointed, layers)
    kept = unsloth.kept_per_layer(kept, input_tok, layers) if unsloth_offloads(m, t) else kept  # (inputs on host)
    head_here = t.pp == 1 or stage == "last"
    cast_layer, cast_head, cast_embed = _autocast_copies(m, t, st, pol, head_here, stage)
    lora_first = first_layer_unsaved(t, lc, stage)
    pipe, received = _pipeline_terms(m, t, st, pol, stage, input_tok, lc)
    half_in = half_embedding_output(t, pol, stage, input_tok)
    first = lora_first + received + half_in + peft_offload_leaf(t, stage, input_tok)
    outer, rest_pos = derived_outer(m, t, stage) if derived else (outer_tensors(m, t, pol, stage), 0.0)
    loss = loss_bytes(m, t, pol) if head_here else LossBytes()
    if derived and head_here and caps_hidden_not_logits(m, t):
        cap = torchtune_cap_bytes(m, t, pol.half, loss.out)
        outer = [(n, tok + cap if n == "derived.head_side" else tok, sq) for n, tok, sq in outer]
    head_tok, rest_tok, rest_sq, rest_pos = _split_outer(outer, rest_pos)
    comm, comm_name = _communication(t, st)
    fsdp = {**fsdp_buffers(m, t, st, lc), **fsdp_no_sync(m, t, st, stage)}   # empty without FSDP
    oib_mid, oib_end = oib_update_bytes(m, t, st) if oib else (0, 0)
    # gradients of the layer's linears as its backward creates them (per weight byte): unsharded under FSDP
    layer_grads_live = st.layer_grads_full if fsdp else st.layer_grads
    gpw = layer_grads_live / lc.weights if (lc.weights and not oib) else 0.0
    trans = _layer_transients(t, lc, pol, gpw, 2.0 if cast_layer else 0.0, input_tok, receives_output_grad(t, stage))
    pp_inflight, inflight_fixed = _inflight(t, stage)
    lower, above_bottom, above_decoder_bottom = _grads_above(m, t, st, layers)
    return Quantities(
        first_unsaved_tok=sum(a for _, a, _ in first), first_unsaved_sq=sum(b for _, _, b in first),
        cast_first_free=_cast_first_free(m, t, lc, bool(lora_first and cast_layer), bool(cast_layer), stage),
        fixed=st.weights + st.buffers + st.master + comm, grads=0 if oib else st.grads,
        grads_loaded=(0 if oib else st.grads) if grads_from_wrap(t) else 0,
        build_temp=_build_temp(t, st, comm), states=st.optimizer + st.step_tensors, ds_flat_temp=_flat_temp(t, st, comm),
        layer_grads=0 if oib else st.layer_grads, head_grads=0 if oib else st.head_grads, layers=layers,
        pp_inflight=pp_inflight, fixed_inflight=inflight_fixed, saved_tok=lc.tok, saved_sq=lc.sq,
        kept_tok=kept[0], kept_sq=kept[1], redo_tok=redo[0], redo_sq=redo[1],
        # (a layer traced checkpointed has its recomputed copies in its measured transients)
        redo_const=cast_layer if (checkpointed and top_recomputed and not lc.checkpointed) else 0,
        **_output_cache(t, lc),
        outer_head_tok=head_tok, outer_rest_tok=rest_tok, outer_rest_sq=rest_sq, outer_rest_pos=rest_pos,
        head_loss_tok=derived_head_loss(m, t, stage) if derived else head_during_loss(m, t, pol, stage),
        cast_layer=cast_layer, cast_head=cast_head, cast_embed=cast_embed, cast_checkpointed=cast_layer * checkpointed, head_wgrad=head_wgrad(m, t, cast_head),
        cast_forward_only=0 if (t.lora_rank or fsdp1_views(t) or loss_after_stage_forward(t, stage))
        else cast_layer * checkpointed,  # see cast_checkpointed
        cast_stage_only=_cast_stage_only(t, stage, cast_layer * checkpointed),
        gathered_layer=(st.layer_units_full or st.layer_params_full) if fsdp_grad_op(t) else 0,
        logit_chunks=t.loss_chunks, logit_width=m.vocab_size if is_lm(m) else classifier_width(m, t),
        tp=t.tp if is_lm(m) else 1, cast_output=int(t.cast_output), **_loss_fields(m, t, pol, loss, head_here),
        **_preference_fields(m, t),
        # --compile: the zero gradients of the KV-cache tensors the model returns (_compiled_loss_bytes)
        **{"loss_backward_tok": lc.cache * layers if whole_model_compiled(t) else 0.0,
           **_chunked_nll_fields(m, t, pol, loss, head_here)},
        liger_factor=-(-m.vocab_size // m.hidden_size) if (head_here and is_lm(m) and loss_mode(m, t) == "fused") else 0,
        **_galore_fields(m, t, st, oib), step_groups=foreach_groups(t), step_linger=step_lingers(t),
        linear_replay=int(per_linear_replay(t)), oib_mid=oib_mid, oib_end=oib_end, **_deepspeed_fields(m, t, st),
        **gemini_fields(m, t), step_adafactor=adafactor_loop(t, st),
        **_tied_fields(m, t, pol),
        emb_grad=emb_accumulated(m, t, stage), head_added=0 if oib else head_added_grads(m, t, st, stage), emb_upcast=emb_upcast(m, t, stage), softcap_saved=softcap_saved(m, loss.out, t) if head_here else 0,
        chunk_head_grads=chunk_head_grads(m, t, pol) if head_here else 0, ds_leaf_held=deepspeed_leaf_held(m, t, lc),
        transients=z3_leaf_grads_held(trans, deepspeed_leaf_held(m, t, lc)),
        fwd_temp=int(lc.fwd_const), fwd_temp_tok=lc.fwd_tok, fwd_scratch=int(lc.fwd_scratch), head_wgrad_half=head_weight_grad_half(m, t, cast_head),
        **_head_dequant_fields(m, t, head_here), **_head_replay_fields(m, t, pol, stage),
        **_graph_held(t, lc.graph_held, checkpointed, layers), **fsdp,
        **_derived_outer_fields(m, t, stage),
        lower_layers=lower, above_bottom=above_bottom, above_decoder_bottom=above_decoder_bottom,
        decoder_grads=_decoder_grads(m, t, st, layers),
        input_tok=input_bytes(m, t)[0], input_sample=input_bytes(m, t)[1], expandable=int(t.expandable_segments),
        ddp_side=int(t.ddp_init_stream == "side"),
        input_pixels=vlm_pixel_bytes(m, t),
        trainer_cp=trainer_cp_inputs(m, t), embeds_tok=held_embeddings(m, t, pol, lc),
        **_top_fields(m, t, pol),
        dec_num=decoder_ratio(m, t)[0], dec_den=decoder_ratio(m, t)[1], **_derived_fields(m, t, stage), **pipe,
        detail=Detail(st, lc, outer, comm_name, input_tok, sum(a for _, a, _ in received),
                      half_input_tok=sum(a for _, a, _ in half_in), recompute_ops=len(recompute_transients(t, lc))))


def _loss_fields(m: ModelSpec, t: TrainingSpec, pol: Policy, loss: LossBytes, head_here: bool) -> dict[str, Any]:
    """The loss's per-logit and per-token terms (``loss_bytes``) under the names ``Quantities`` gives them,
    and whether the replay builds transformers 4.40's fp32-logits loss tensor by tensor."""
    return dict(logits_held=loss.held, logits_out=loss.out, loss_saved=loss.saved, logits_cast=loss.cast,
                loss_forward=loss.forward, loss_backward=loss.backward, loss_saves_out=loss.saves_out,
                loss_elem=loss.elem, loss_forward_chunk=loss.forward_chunk, loss_backward_chunk=loss.backward_chunk,
                loss_saved_tok=loss.saved_tok, loss_saved_const=loss.saved_const,
                loss_fp32_logits=int(head_here and fp32_logits_replay(m, t, pol, loss)),
                loss_tt_shift=int(head_here and is_lm(m) and t.tp == 1 and torchtune_loop_shifts_fp32_logits(t)))


def _tied_fields(m: ModelSpec, t: TrainingSpec, pol: Policy) -> dict[str, int]:
    """The tied embedding/head gradient's terms (``tied_head_grad``, ``tied_replicated_grad``; under a
    whole-model compile ``compiled_tied_grads``' two)."""
    compiled = whole_model_compiled(t)
    tied = compiled_tied_grads(m, t, pol) if compiled else (0, 0)
    return {"tied_grad": tied[0] if compiled else tied_head_grad(m, t), "tied_replicated": tied_replicated_grad(m, t),
            "tied_compiled": tied[1] if compiled else 0, "tied_final": tied_head_grad(m, t) if compiled else 0}


def _preference_fields(m: ModelSpec, t: TrainingSpec) -> dict[str, int]:
    """What the reserved replay reads of ``--loss logps`` (its backward) and ``--trainer dpo`` (the
    reference forward and metrics after the log-probs: ``estimate.preference``, ``reserved._dpo_after_logps``)."""
    dpo = t.trainer == "dpo"
    return {"loss_logps": int(t.loss == "logps" and is_lm(m)), "dpo_metrics": int(dpo),
            "dpo_reference": int(dpo and t.ref_model != "precomputed")}


def _graph_held(t: TrainingSpec, held: float, checkpointed: int, layers: int) -> dict[str, float]:
    """``graph_tok`` and ``graph_extra_tok``: per layer, the bytes per token that autograd nodes keep
    outside ``save_for_backward`` until the graph is freed (bitsandbytes < 0.43.2 ``MatMul4Bit``'s
    ``ctx.tensors``, ``held``). A non-reentrant checkpoint (transformers 5) runs a checkpointed layer's
    first forward with grad enabled: its nodes keep those inputs too, beyond the activations the
    checkpoint keeps (``graph_extra_tok``). A reentrant one (transformers 4,
    ``tf_releases.reentrant_checkpointing``) runs it under ``no_grad`` (torch 2.13
    ``utils/checkpoint.py`` L273, ``CheckpointFunction.forward``: ``with torch.no_grad(): outputs =
    run_function(*args)``), so no node exists, and the recompute's nodes, built in
    ``CheckpointFunction.backward``, are freed when it returns: a checkpointed layer keeps nothing
    in the outer graph, only while its own backward runs (among its saved activations)."""
    if not layers:
        return {"graph_tok": held, "graph_extra_tok": 0.0}
    if checkpointed and t.checkpoint_reentrant:
        return {"graph_tok": held * (layers - checkpointed) / layers, "graph_extra_tok": 0.0}
    return {"graph_tok": held, "graph_extra_tok": held * checkpointed / layers}


def _classifier_rms_norm(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether the model is a transformers decoder's classifier or question-answering head after
    transformers' own RMSNorm (``final_norm_forward``, ``final_norm_backward``): not under
    ``--compile`` (fused kernels), tensor or pipeline parallelism (the norm sharded or another
    rank's) or a framework's own model code."""
    return m.head in ("seq-cls", "qa") and m.family in ("llama", "mixtral") and m.final_norm \
        and m.norm == "rmsnorm" and not t.compile and t.tp == 1 and t.pp == 1 \
        and t.extra.get("framework") not in OWN_MODEL_CODE


def final_norm_forward(m: ModelSpec, t: TrainingSpec, pol: Policy) -> float:
    """Bytes per token alive at the final RMSNorm's last forward op beyond the saved tensors, for a
    decoder's classifier or question-answering head (``_classifier_rms_norm``), whose forward has no
    vocabulary-sized loss after it to peak at.

    transformers 5.24 ``models/llama/modeling_llama.py`` L62-67: ``self.weight *
    hidden_states.to(input_dtype)`` allocates its output while the norm's input (the caller's
    ``hidden_states``, L404 ``hidden_states = self.norm(hidden_states)``) and its local fp32
    ``x32 * rsqrt(...)`` product are still referenced. In a half residual dtype (pure bf16/fp16)
    those are tensors of their own: the input (h, half), the fp32 product (h x 4), and the base
    model's ``inputs_embeds`` (``held_embeddings``, L372 and L390: h, half); the output is the head's saved input
    (``_head_side``), counted. In an fp32 residual (fp32, autocast) ``to(float32)`` and
    ``to(input_dtype)`` return their input, so the input and product are the norm's saved tensors;
    the output (h x 4) is new, and under autocast the head saves its half cast instead, made only
    after (counted in the saved tensors but not yet there). Found by trace: Llama (2 layers, hidden
    256) question answering, pure bf16, 4 x 256: forward -4.6% before. 0 under LoRA (the frozen
    norm's multiply saves nothing, so its operand is one more frame-held tensor: not modelled)."""
    if not _classifier_rms_norm(m, t) or t.lora_rank:
        return 0.0
    h = m.hidden_size
    if pol.stream != F32:
        return float(h * pol.stream + h * F32 + h * pol.stream)
    return float(h * F32 - h * pol.half)


def bert_top_forward(m: ModelSpec, t: TrainingSpec, pol: Policy) -> float:
    """Bytes per token alive at the last BERT layer's output LayerNorm (the forward's peak for a
    classifier or question-answering head, which has no vocabulary-sized loss after it) beyond the
    saved tensors (transformers 5.24 ``models/bert/modeling_bert.py``):

    * ``BertOutput.forward`` L349-352: its local ``hidden_states``, the dropout's output (the dense
      output without dropout), (b, s, h) in the matmul dtype, is referenced while ``self.LayerNorm(
      hidden_states + input_tensor)`` runs; the LayerNorm's output (residual dtype) is new. The head
      saves that output itself (``pooler.input``; under autocast a per-sample cast, and the output is
      extra) or, for question answering, its half cast made later (``qa_outputs.input``), counted in
      the saved tensors.
    * Under autocast the linears save half casts, so fp32 (b, s, h) tensors that only Python frames
      hold are extra: ``BertModel.forward``'s ``embedding_output`` (L657, until it returns),
      ``BertEncoder.forward``'s ``hidden_states`` (L439-440: the last layer's input, another tensor
      with two layers or more) and ``BertLayer.feed_forward_chunk``'s ``attention_output`` (L417-419).
      In fp32 / pure half those are the q/k/v and ``intermediate.dense`` inputs, saved already.

    Found by trace: BERT (2 layers, hidden 64) question answering, bf16-amp, 4 x 256: the step's
    peak is this forward moment, -2.2% before. 0 for other heads and families, under recompute (a
    checkpointed layer saves nothing in forward), LoRA (frozen linears save no input), --compile,
    tensor or pipeline parallelism, and a framework's own model code."""
    if m.head not in ("seq-cls", "qa") or m.family != "bert" or t.recompute not in (None, "none") \
            or t.lora_rank or t.compile or t.tp > 1 or t.pp > 1 or t.extra.get("framework") in OWN_MODEL_CODE:
        return 0.0
    h = m.hidden_size
    out = h * pol.half + h * pol.stream       # the dropout's output (half), the LayerNorm's output
    out -= h * (pol.half if m.head == "qa" else 0 if pol.amp else pol.stream)   # the head's input, counted
    if pol.amp:  # embedding_output, the last layer's input (two layers or more), attention_output
        out += h * pol.stream * ((2 if m.num_layers > 1 else 1) + 1)
    return float(out)


def final_norm_backward(m: ModelSpec, t: TrainingSpec, pol: Policy) -> float:
    """Bytes per token alive at the final RMSNorm's backward beyond the saved tensors, for a decoder's
    classifier or question-answering head (``*ForSequenceClassification``, ``*ForQuestionAnswering``),
    whose backward reaches the norm with every layer's saved tensors still alive and no vocabulary-
    sized loss before it (a causal LM's cross-entropy backward is its peak instead).

    transformers 5.24 ``models/llama/modeling_llama.py`` L62-67, ``LlamaRMSNorm.forward``:
    ``x32 = hidden_states.to(torch.float32)``; ``variance = x32.pow(2).mean(-1, keepdim=True)``;
    ``x32 * torch.rsqrt(variance + eps)``; ``self.weight * normed.to(input_dtype)``. Backward, in
    autograd's order: the weight's ``MulBackward0`` (then ``normed``, saved only for the weight's
    gradient, is freed: ``_head_side`` counts it); the multiply by ``rsqrt``'s, which hands x32 its
    first gradient (b, s, h) fp32, held in autograd's input buffer until the second arrives;
    ``RsqrtBackward0`` and ``MeanBackward0``, whose ``sum_backward(...) / numel`` (PyTorch
    ``tools/autograd/derivatives.yaml`` ``mean.dim``, ``FunctionsManual.cpp`` ``mean_backward``)
    materialises (b, s, h) fp32; then ``PowBackward0``, ``pow_backward``: ``grad * (exponent *
    self.pow(exponent - 1))`` (``FunctionsManual.cpp``), three more (b, s, h) fp32 tensors alive
    together within the expression: five in all (fp32, h each per token), beside x32 (saved by
    ``pow`` and the multiply). By then the head's saved input (``qa_outputs.input`` /
    ``pooler.input`` in ``_head_side``, (b, s, h) in the matmul dtype) was released by its ``mm``'s
    backward. The head's and the norm's weight gradients ((num_labels + 1) x h elements) are left
    out. Found by trace: Llama (2 layers, hidden 256) question answering, pure bf16, 4 x 256, whose
    peak is the final norm's ``PowBackward0``: -0.8% before.

    0 where ``_classifier_rms_norm`` does not hold."""
    if not _classifier_rms_norm(m, t):
        return 0.0
    h = m.hidden_size
    normed = 0 if t.lora_rank else h * pol.stream   # frozen (LoRA): never saved (``_head_side``)
    head_input = h * pol.half                       # qa_outputs / score saves its input (``_head_side``)
    return float(5 * h * F32 - normed - head_input)


def held_embeddings(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs | None = None) -> float:
    """Bytes per token of the embedding output (b, s, h) that a transformers decoder's base model
    holds in forward although autograd saves none of it: ``XModel.forward`` binds it to its local
    ``inputs_embeds``, starts the layers from ``hidden_states = inputs_embeds`` and rebinds only
    ``hidden_states``, so the tensor is freed when the base model returns, after the final norm and
    before the head's matmul (transformers 5.24 ``models/qwen3/modeling_qwen3.py`` L375, L403, L418;
    ``models/llama/modeling_llama.py`` the same, every model built on its template). Counted where
    nothing else holds it: in a half residual dtype (pure bf16 / fp16), where the first layer's
    RMSNorm saves its own fp32 copy (``hidden_states.to(torch.float32)`` makes one), not its input;
    in fp32 the norm's ``to`` returns the tensor itself and it is the first layer's saved input
    (``LayerCoefs.tensors``), as it is in half under a LayerNorm, whose ``native_layer_norm`` saves
    its input (a derived layer's ``input_layernorm.native_layer_norm`` part: Phi-2). Only the replay
    uses it (``reserved._forward``): the forward's
    allocated peak is at the loss, once it is freed. None for a model run by its framework's own
    code (torchtitan's, litgpt's ... ``h = layer(h)`` drops it after the first layer) or split
    into pipeline stages. Found on the H200 runs: Qwen3-0.6B pure bf16 (batch 8, seq 2048), where
    its freed 32 MiB block takes the backward's cuBLAS workspace, which otherwise splits a
    logits-sized segment for good."""
    transformers_class = m.family in ("llama", "mixtral", "derived") and m.head == "causal-lm"
    if not transformers_class or t.pp > 1 or t.extra.get("framework") in OWN_MODEL_CODE or pol.stream != 2:
        return 0.0
    if lc is not None and any(name.endswith("native_layer_norm") for name, _a, _b in lc.parts):
        return 0.0                                    # the first layer's LayerNorm saves it
    sp = t.tp if t.sequence_parallel else 1
    return m.hidden_size * pol.stream / sp


def _kept_and_redone(t: TrainingSpec, lc: LayerCoefs, input_tok: float, checkpointed: int, layers: int
                     ) -> tuple[tuple, tuple, bool]:
    """A layer's kept bytes and its recomputation's (``_recompute``; activation offloading moves the
    kept ones to the host, ``_offloaded``), and whether the top layer is checkpointed: the recompute
    transient belongs to the top layer's backward moment only then; otherwise it comes later, when
    the layers above it have freed more than it adds."""
    kept, redo = _recompute(t, lc, input_tok, checkpointed / layers)
    if t.offload_activations:
        kept, redo = _offloaded(kept, redo, input_tok)
    top_recomputed = t.recompute not in ("full", "op") or layers % t.recompute_every == 0
    return kept, (redo if top_recomputed else (0.0, 0.0)), top_recomputed


def _output_cache(t: TrainingSpec, lc: LayerCoefs) -> dict[str, float]:
    """The ``Quantities`` fields of the KV cache the model output references (per token): what it
    holds beyond autograd's saved tensors (at micro-batch 1 apart: eager's matmul saves the cache's
    views) and the whole cache. None of it outlives the body's forward when the loop computes the
    logits chunk by chunk (``--loss-chunks N``): it takes the decoder's last hidden state,
    ``base_model(input_ids)[0]``, and drops the output with its cache before the head runs
    (``workload._chunked_output``; torchtune's and litgpt's own models build no cache)."""
    if t.loss_chunks > 1:
        return {"held_tok": 0.0, "held_b1_tok": 0.0, "cache_tok": 0.0}
    return {"held_tok": lc.held, "held_b1_tok": lc.held if lc.held_b1 is None else lc.held_b1, "cache_tok": lc.cache}


def _derived_fields(m: ModelSpec, t: TrainingSpec, stage: str) -> dict[str, float]:
    """The ``Quantities`` fields of a derived architecture's head forward (an image model's) and of
    an encoder-decoder's bottom and decoder-bottom moments."""
    if m.family != "derived":
        return {}
    out = {"head_fwd_tok": derived_head_forward(m, t, stage)}
    for i, c in enumerate(derived_top_forward(m, t, stage)):  # an encoder head's moments (none for other heads)
        out.update(zip((f"head_fwd{'2' if i else ''}_{k}" for k in ("tok", "sq", "pos", "b", "ssq")), c))
    out.update(zip(("grad_view_tok", "grad_view_pos", "grad_view_const"), derived_grad_views(m, t)))
    if m.is_encoder_decoder:
        bottom, decb = moment_activations(m, t)
        names = ("tok", "sq", "pos", "ssq")
        out.update({f"bottom_{k}": v for k, v in zip(names, bottom)})
        out.update({f"decb_{k}": v for k, v in zip(names, decb)})
        out.update({f"decemb_{k}": v for k, v in zip(names, decoder_embedding_activations(m, t))})
        out["decemb_temp_tok"] = decoder_embedding_temporaries(m, t)
    return out


def _layer_transients(t: TrainingSpec, lc: LayerCoefs, pol: Policy, gpw: float, freed: float,
                      input_tok: float, received: bool = False) -> tuple:
    """Each op's backward transient of one layer: (a per token, b per token x key, c bytes, g
    gradient bytes made by then, d per position squared, the backward moments it happens at: a bit
    mask, every layer's by default, e per token that the top layer does not add: with ``received``,
    the layer's output gradient it counts, ``LayerCoefs.incoming``, which on a pipeline stage that
    receives its output's gradient is the receive buffer, counted with the inputs:
    ``receives_output_grad``). ``gpw``: gradient bytes per weight element; ``freed``: inside
    a layer's backward the half weight copies of its later linears (back-propagated already) were
    freed with their matmuls' saved tensors, so each transient excludes them (2 bytes per element;
    frozen ones too, ``LayerCoefs.after_frozen``: found by trace, llama 8 x 512 LoRA --pp 2, bf16-amp,
    the first stage's top-layer ``MulBackward0`` +0.3% before, ``down_proj``'s copy),
    except for grouped experts, which autocast does not copy (``LayerCoefs.after_uncast``; found by
    trace: Mixtral, 2 layers, full recompute, bf16-amp, the first layer's ``gate_up`` backward:
    -3.2% before)."""
    after = lc.after or (0.0,) * len(lc.transients)
    uncast = lc.after_uncast or (0.0,) * len(lc.transients)
    ssq = lc.transients_ssq or (0.0,) * len(lc.transients)
    at = lc.transients_at or (ALL_MOMENTS,) * len(lc.transients)
    own = lc.own_cast or (0.0,) * len(lc.transients)  # (a linear's fp32 cast of its weight gradient)
    top_less = lc.incoming if (received and lc.incoming) else (0.0,) * len(lc.transients)
    # (LoRA: the frozen linears' half copies, saved by their matmuls, are freed by their backward too)
    frozen = lc.after_frozen or (0.0,) * len(lc.transients)
    trans = tuple((a, b, c - (w - u + o + z) * freed, int(w * gpw), d, k, e)
                  for (_, a, b, c), w, u, o, z, d, k, e in zip(lc.transients, after, uncast, own, frozen, ssq, at,
                                                                top_less))
    if t.recompute == "full" and t.recompute_every == 1:  # (each layer checkpointed: ENGINE_CAST's op's moment
        # stands in for it, below which it is; the position kept for ``breakdown.where_label``)
        trans = tuple(trans[i - 1] if i and name.endswith(ENGINE_CAST) else v
                      for i, ((name, *_), v) in enumerate(zip(lc.transients, trans)))
    if t.offload_activations and trans:
        trans = trans[:-1] + ((trans[-1][0] + offload_previous(input_tok, pol), *trans[-1][1:]),)
    return trans + recompute_transients(t, lc, received)


def deepspeed_leaf_held(m: ModelSpec, t: TrainingSpec, lc: LayerCoefs) -> tuple[int, int]:
    """Under DeepSpeed ZeRO-3 with the MoE block a leaf module (``_z3_leaves``): the index of the experts'
    gate/up projection's backward transient in ``lc.transients`` and the bytes of the down projection's
    weight gradient still alive then (experts x h x f in the parameter's dtype: the
    ``experts.down.backward`` transient's constant, ``layers._moe``); (-1, 0) otherwise.

    DeepSpeed v0.19.8 ``runtime/zero/stage3.py`` ``create_reduce_and_remove_grad_hooks`` (L1487-1559) puts no
    gradient hook on a leaf's parameters (``if not z3_leaf_parameter(param): wrapper(param)``, L1527) and
    "delay[s] reduce for all gradients in the leaf modules until the backward pass of the leaf module is
    done" (L1533): one ``register_full_backward_hook`` on the block (``reduce_leaf_module_grads``,
    L1538-1556) reduces them once the block's input gradient is made. Without a leaf each parameter's
    ``AccumulateGrad`` hook copies its gradient into the ipg bucket and frees it (``__add_grad_to_ipg_bucket``
    L1621-1646). transformers 5.24 runs down's ``_grouped_mm`` backward before gate/up's
    (``integrations/moe.py`` ``grouped_mm_experts_forward``), so gate/up's gradient is made beside down's.
    Found by trace: Mixtral's widths cut to 4 layers, ZeRO-3 dp 8, bf16, 1 x 512: at the top block's hook
    both experts' gradients alive (1,792 + 896 MiB); the estimate's gate/up moment had 1,736 MiB of
    temporaries (-3.9 % allocated before). The hook's own moment (the bucket's ``cat`` beside them) is not
    modelled."""
    leaves = _z3_leaves(m, t) if (deepspeed_zero(t) and t.zero == 3) else ()
    names = [name for name, *_ in lc.transients]
    if not leaves or "experts.gate_up.backward" not in names or "experts.down.backward" not in names:
        return (-1, 0)
    return names.index("experts.gate_up.backward"), int(lc.transients[names.index("experts.down.backward")][3])


def z3_leaf_grads_held(trans: tuple, held: tuple[int, int]) -> tuple:
    """The layer's transients (``_layer_transients``) with ``held`` = (index, bytes) added to that
    transient's constant bytes (``deepspeed_leaf_held``)."""
    i, nbytes = held
    if not nbytes:
        return trans
    return trans[:i] + ((trans[i][0], trans[i][1], trans[i][2] + nbytes, *trans[i][3:]),) + trans[i + 1:]


def recompute_transients(t: TrainingSpec, lc: LayerCoefs, received: bool = False) -> tuple:
    """Under full recompute (every layer checkpointed), the moments of a layer's recomputed forward
    as transients over its saved tensors (``LayerCoefs.recompute_moments``), after its backward
    ones (``breakdown.where_label`` names them): non-reentrant checkpointing recomputes the layer
    when backward first unpacks one of its saved tensors (torch/utils/checkpoint.py
    ``_checkpoint_hook.unpack_hook`` -> ``recompute_fn``), with the gradients made so far alive,
    and runs the forward up to its last pack, its Python frames holding what they hold in forward
    (peft's fp32 copy of a linear's input, the base output beside the adapter's). No weight
    gradient of the layer exists yet (g = 0), no weight copy was freed. Found by trace: Llama 8 x
    512 LoRA on all seven projections, full recompute, bf16-amp 2 x 1024: -7.4% before (the peak at
    ``down_proj``'s ``lora_B`` in the top layer's recomputation); bf16: -8.6%; with dropout 0.05
    -11.4%."""
    if t.recompute != "full" or t.recompute_every != 1 or lc.checkpointed or not lc.recompute_moments:
        return ()
    e = lc.recompute_incoming if received else 0.0
    return tuple((a, b, 0.0, 0, 0.0, ALL_MOMENTS, e) for _name, a, b, _blocks in lc.recompute_moments)


def _grads_above(m: ModelSpec, t: TrainingSpec, st: States, layers: int) -> tuple[int, int, int]:
    """(an encoder-decoder's encoder layers on this rank (0 otherwise), gradient bytes of the layers
    above the bottom layer, of those above the decoder-bottom layer): the gradients made before those
    layers' backward. The layers' own bytes where they differ (a derived encoder-decoder's decoder
    layers hold cross-attention, ``States.each_layer_grads``), else the average layer's."""
    lower = m.num_layers - m.decoder_layers if m.is_encoder_decoder and t.pp == 1 else 0
    if t.grads_freed_in_backward:
        return lower, 0, 0
    each = st.each_layer_grads if (m.family == "derived" and lower and len(st.each_layer_grads) == layers) else ()
    if each:  # (the decoder's position tables' gradients are made before the encoder's backward)
        return lower, sum(each[1:]) + st.between_grads, sum(each[lower + 1:])
    return lower, (layers - 1) * st.layer_grads, max(layers - lower - 1, 0) * st.layer_grads


def _decoder_grads(m: ModelSpec, t: TrainingSpec, st: States, layers: int) -> int:
    """Gradient bytes of an encoder-decoder's decoder layers (all of them: made by the time its
    decoder embedding runs its backward, ``moments`` ``embeddings.decoder_backward``); 0 otherwise."""
    lower = m.num_layers - m.decoder_layers if m.is_encoder_decoder and t.pp == 1 else 0
    if not lower or t.grads_freed_in_backward:
        return 0
    each = st.each_layer_grads if (m.family == "derived" and len(st.each_layer_grads) == layers) else ()
    return sum(each[lower:]) if each else (layers - lower) * st.layer_grads


def head_wgrad(m: ModelSpec, t: TrainingSpec, cast_head: int) -> int:
    """Bytes of the LM head's weight gradient as its matmul's backward makes it under autocast: in
    the half dtype (the shape of the head's half copy, ``cast_head``), then cast to the weight's
    fp32 by ``ToCopyBackward0`` while it is still referenced. The head's ``MmBackward0`` releases
    what it saved (the half copy of the weight, the input) and the logits' gradient when it returns
    (``torch/csrc/autograd`` ``Node::release_variables``), so at the cast the half gradient, the fp32
    one (the tied weight's part in autograd's input buffer, ``tied_head_grad``, or an untied head's
    ``.grad``) and the layers' activations are alive, without the logits' gradient (moment
    ``lm_head.weight_grad``). It matters where the head's weight outweighs the logits: a wide
    vocabulary and few tokens. Found by trace: Llama-3.2-1B (tied), FSDP2 dp 8, bf16-amp, 1 x 256:
    the trace's peak is this cast (``lm_head`` ``ToCopyBackward0``), 1.5% above the estimate's
    highest moment before. 0 without an autocast copy of a trainable head run in one piece (LoRA
    freezes it; a chunked, fused or compiled loss, a 4-bit head have moments of their own)."""
    return cast_head if (cast_head and is_lm(m) and not t.lora_rank and head_in_one_piece(m, t)) else 0


def head_in_one_piece(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether the LM head runs as one matmul whose ``MmBackward0`` makes its weight's gradient in the
    backward (not per loss chunk, fused into the loss, compiled or 4-bit)."""
    return (t.loss_chunks == 1 and loss_mode(m, t) in ("upcast", "half", "vocab-parallel") and not t.compile
            and not t.quantize)


def head_added_grads(m: ModelSpec, t: TrainingSpec, st: States, stage: str) -> int:
    """Bytes of the gradients the LM head's backward makes for the head side's trainable tensors (the
    final norm's, an untied head's weight; on torch's pipeline the last stage of a tied model holds its
    own copy of the table as its head, ``Quantities.pipe_head_tied``, listed before the layers), one
    copy each, in the gradient's dtype on this rank (``States.trainables``' rounded blocks).

    Each is a new tensor in every micro-batch: where ``.grad`` is undefined autograd's
    ``AccumulateGrad`` steals it as ``.grad``; where it exists (a later micro-batch of the step, or
    every one after ``zero_grad(set_to_none=False)``) it adds it in place, ``variable_grad +=
    new_grad``, and the new tensor lives beside ``.grad`` until that node has run (torch 2.13
    ``torch/csrc/autograd/functions/accumulate_grad.h`` L182-252 ``accumulateGrad``; the allocator replay's
    ``reserved._accumulated``). The moments count it at the head's ``MmBackward0`` and its autocast
    cast (``moments._head_matmul_grad``, ``_head_weight_grad``). Trace, Llama-3.2-1B cut to 4 layers
    over pp 2 (1F1B), fp32, 2 micro-batches, last stage: the 1002 MiB table's gradient made anew
    beside its ``.grad`` at the second micro-batch's ``lm_head`` ``MmBackward0`` (-4.2 % before).
    0 where the head is not back-propagated in one piece (``head_in_one_piece``), is frozen or not on
    this stage, and where FSDP, DeepSpeed ZeRO or Megatron own the gradients (their moments of their own)."""
    if not (t.pp == 1 or stage == "last") or not is_lm(m) or not head_in_one_piece(m, t):
        return 0
    if t.fsdp is not None or t.zero_stage or t.megatron_ddp or t.distributed_optimizer:
        return 0
    tied_copy = torch_pipeline(t) and t.pp > 1 and m.tied_embeddings      # (the last stage's own table)
    where = ("after", "before") if tied_copy else ("after",)
    return sum(g for w, _k, g, *_rest in st.trainables if w in where)


def _autocast_copies(m: ModelSpec, t: TrainingSpec, st: States, pol: Policy, head_here: bool,
                     stage: str = "first") -> tuple[int, int, int]:
    """(one layer's, the head's, the embedding side's) half weight copies autocast caches and the
    matmuls save, bytes (the embedding side's: a matmul before the layers, an image model's
    patch-embedding convolution, whose copy lives until the embeddings' backward).

    autocast casts each fp32 leaf weight once per forward and caches it; the matmuls save the
    copies for backward. Sharded DeepSpeed ZeRO-3 parameters are gathered per layer in the compute
    dtype and resharded after use, so no cast copies outlive their layer. FSDP under autocast
    (fp32 sharded parameters, --precision bf16-amp) is not that: the gathered fp32 weights are cast
    like any others and each matmul saves its half copy until its layer's backward, after FSDP has
    resharded the fp32 weight (resize_(0) frees only that storage). FSDP2's unsharded parameter is
    an nn.Parameter leaf, not a view (torch 2.13 _fully_shard/_fsdp_param.py init_unsharded_param),
    so autocast's cache takes it too (aten/src/ATen/autocast_mode.cpp cached_cast: fp32, requires
    grad, leaf, not a view). Found by trace on the fake group (docs/trace.md): llama-3.2-1b dp 8
    fsdp full bf16-amp was -35% against trace, the whole model's bf16 copies missing."""
    sharded = t.zero_stage == 3 and t.shard_group > 1 and t.fsdp is None
    # (a derived model's layer also keeps the copies of weight views its matmuls cast: ``derived.view_casts``)
    cast_layer = st.layer_matmul_half + derived_view_casts(m, t, stage) if pol.amp and not sharded else 0
    # the head's copies: one, or one per loss chunk for a frozen head (``head_casts``)
    cast_head = st.head_matmul_half * head_casts(m, t) if pol.amp and not sharded and head_here else 0
    cast_embed = st.embed_matmul_half if pol.amp and not sharded and (t.pp == 1 or stage == "first") else 0
    return cast_layer, cast_head, cast_embed


def loss_after_stage_forward(t: TrainingSpec, stage: str) -> bool:
    """Whether the loss runs after the autocast region the layers ran in has closed: a pipeline's last
    stage under torch's schedule, whose stage forward is an autocast region of its own and whose loss
    (the schedule's ``loss_fn``) another (``workload.PipelineTrainStep``: ``torch.autocast`` entered in
    a forward pre-hook of the stage module and left in its forward hook). Leaving the region clears
    autocast's cache (``torch/amp/autocast_mode.py`` ``__exit__``: ``torch.clear_autocast_cache()`` at the
    outermost exit, L348-349), so checkpointed layers' weight copies, which nothing saved, are gone when the loss
    runs (``cast_forward_only`` 0 there). Found by trace: llama (8 layers, h 512) --pp 2 bf16-amp full
    recompute, 2 x 1024 tokens, the last stage +2.0% before."""
    return torch_pipeline(t) and t.pp > 1 and stage == "last"


def _cast_stage_only(t: TrainingSpec, stage: str, cached: int) -> int:
    """Bytes of one checkpointed layer's half weight copies (``cached``: ``cast_layer`` under full
    recompute) that autocast's cache holds on a pipeline's last stage until the stage forward's region
    closes, before the loss (``loss_after_stage_forward``), for the allocator replay
    (``reserved._forward``); 0 elsewhere, under LoRA (frozen weights are not cached) and FSDP1's views
    (as ``cast_forward_only``), and under an interleaved schedule (not checked there: its replay
    walks (stage, micro-batch) pairs, ``reserved._pipeline_pairs``). Found by trace: Qwen2.5-1.5B --pp 2 fp16-amp
    full recompute, b4 s2048, the last stage's first forward 1.25 GiB of segments short (28 layers)."""
    if not loss_after_stage_forward(t, stage) or t.virtual_stages > 1 or t.lora_rank or fsdp1_views(t):
        return 0
    return cached


def receives_output_grad(t: TrainingSpec, stage: str) -> bool:
    """Whether the stage's backward starts from a receive buffer: under torch's pipeline schedule every
    stage but the model's last gets its output's gradient from the next (``pipeline_buffers``), and
    ``stage_backward`` hands that buffer itself to autograd (torch 2.13 ``pipelining/stage.py``
    ``_retrieve_recv_grads`` returns ``info.buffer``; ``_backward.py`` ``stage_backward``:
    ``torch.autograd.backward(stage_output_tensors, grad_tensors=output_grad_tensors)``). So the top
    layer's residual-stream gradient, which passes its last residual add unchanged into the MLP branch's
    backward, is that buffer, not a new tensor. The last rank's stages (interleaved: the model's last
    and others) are taken as not receiving. Found by trace: llama (8 layers, h 512) LoRA --pp 2 bf16-amp,
    2 x 1024 tokens, the first stage +1.3% (+3.2% with full recompute) before, its peak the top layer's
    ``MulBackward0``; without LoRA +0.68% (docs/trace.md, pipeline section, item 10)."""
    return torch_pipeline(t) and t.pp > 1 and stage != "last"


def _pipeline_terms(m: ModelSpec, t: TrainingSpec, st: States, pol: Policy, stage: str, input_tok: float,
                    lc: LayerCoefs) -> tuple[dict[str, Any], tuple[tuple[str, float, float], ...]]:
    """torch.distributed.pipelining's terms of one stage (none off it, or under Megatron's):
    the ``Quantities`` fields (``pipe_batch``, ``pipe_recv``, ``pipe_buf_tok``, ``pipe_sent_tok``,
    FSDP2's ``fsdp_pipe_top``) and what the first layer does not save beyond the inputs. A later stage's first layer saves its
    input, the receive buffer itself (the stage runs on it: torch ``stage.py``
    ``_retrieve_recv_activations``), counted with the inputs (``pipeline_buffers``). Found by trace:
    llama-3.2-1b (4 layers) --pp 2 --pp-schedule gpipe --grad-accum 8, fp32, last stage +0.7% before
    (one (b, s, h) per micro-batch in flight)."""
    count, per_tok = pipeline_buffers(m, t, pol, stage)
    # only when the layer saves its input itself (a norm on it in its dtype; a checkpointed layer's
    # input): pure bf16/fp16 Llama's RMSNorm saves its fp32 copy, a new tensor (found by trace: the
    # last rank of --pp-schedule interleaved-1f1b --precision bf16 was -1.4% before, 1F1B's -0.35%)
    input_tok = input_tok if (t.recompute in ("full", "op") or lc.input_saved > 0) else 0.0
    later = torch_pipeline(t) and stage != "first"
    # (interleaved: the first rank's other stages are fed too, ``Quantities.pipe_fed`` says how many pairs)
    fed = later or (torch_pipeline(t) and t.virtual_stages > 1)
    received = (("pipeline.received_input", input_tok, 0.0),) if (fed and input_tok) else ()
    return {"pipe_batch": int(torch_pipeline(t)), "pipe_recv": count, "pipe_buf_tok": per_tok,
            "pipe_sent_tok": per_tok if (later and t.pp_schedule == "1f1b") else 0.0,
            "fsdp_pipe_top": pipeline_top_first(t, st, stage), "pipe_kept_layer": pipeline_kept_layer(t, st),
            "pipe_head_tied": int(torch_pipeline(t) and t.pp > 1 and stage == "last" and m.tied_embeddings),
            **_interleaved_terms(m, t, st, stage, per_tok)}, received


def _interleaved_terms(m: ModelSpec, t: TrainingSpec, st: States, stage: str, per_tok: float) -> dict[str, Any]:
    """Interleaved 1F1B's ``Quantities`` fields: the rank holds ``virtual_stages`` stages (rank r:
    r, r + pp, ...; ``wrappers.PipelineRankModule``), each micro-batch's forward and backward run
    per stage in ``ScheduleInterleaved1F1B``'s order (``schedules.rank_order``), so what a rank keeps
    is one stage's layers' activations (and output, autocast copies, rotary tables) for each
    (stage, micro-batch) pair forwarded and not yet backwarded: ``pipe_units`` of them at the
    rank's first backward, ``pipe_units_later`` at most afterwards (schedules.in_flight_at_backwards).
    The last rank's peak is its head stage's backward, with one micro-batch of that stage in flight
    (its forward is followed by its backward, the loss in between) and the others its other stages'
    pairs, each holding its stage output (``pipe_out_tok``, torch ``stage.py`` ``fwd_cache``); its
    actions in order (``pipe_order``, torch's schedule only) drive the allocator replay.

    Megatron-LM's interleaved schedule (``--framework megatron``) runs its own order
    (``schedules.megatron_rank_order``; the same as torch's when the micro-batches are a multiple of
    pp) and keeps less per pair: a chunk's output is freed once sent (``deallocate_output_tensor``,
    megatron/core/pipeline_parallel/schedules.py L157-185 at 6e091e1b; ``deallocate_pipeline_outputs``
    is set by megatron/training/argument_utils.py L300), and the tensor a chunk receives is its first layer's
    input, which that layer saves (no receive buffer beside it: ``pipe_fed`` 0)."""
    if not (t.pp > 1 and t.virtual_stages > 1):
        return {}
    torch_pp = torch_pipeline(t)
    rank, v = (0 if stage == "first" else t.pp - 1), t.virtual_stages
    head = v - 1 if stage == "last" else None
    first, fed, most, grads = in_flight_at_backwards(t.pp, v, t.grad_accum, rank, head, megatron=not torch_pp)
    if not torch_pp:
        fed, most, grads = 0, (most[0], 0, most[2]), (grads[0], 0, grads[2])
    # a stage's gradients: its layers', and on the first rank's first stage the embedding's (the rest of
    # the rank's); the head stage's are never absent at the last rank's later head backward
    per_stage = st.layer_grads * (m.num_layers // (t.pp * v))
    outside = st.grads - per_stage * v

    def absent(stages: tuple[int, ...]) -> int:
        if t.grads_freed_in_backward:
            return 0
        return sum(per_stage + (outside if (u == 0 and stage == "first") else 0) for u in stages)
    return {"pipe_units": first, "pipe_units_later": most[0], "pipe_fed": fed, "pipe_fed_later": most[1],
            "pipe_units_alt": grads[0], "pipe_fed_alt": grads[1], "pipe_grads_absent_alt": absent(grads[2]),
            "pipe_grads_absent": absent(most[2]), "pipe_head_once": int(stage == "last"),
            "pipe_out_tok": per_tok if (stage == "last" and torch_pp) else 0.0, "pipe_stages": v,
            "pipe_order": rank_order(t.pp, v, t.grad_accum, rank) if (stage == "last" and torch_pp) else ()}


def _split_outer(outer: list[tuple[str, float, float]], rest_pos: float) -> tuple[float, float, float, float]:
    """The tensors outside the layers summed as (final norm / head input per token, the rest
    (embeddings, masks) per token and per token x key, per sequence position)."""
    head_tok = rest_tok = rest_sq = 0.0
    for name, tok, sq in outer:
        if name in HEAD_KEYS:
            head_tok += tok
        elif name in PER_POSITION:
            rest_pos += tok
        else:
            rest_tok, rest_sq = rest_tok + tok, rest_sq + sq
    return head_tok, rest_tok, rest_sq, rest_pos


def _recompute(t: TrainingSpec, lc: LayerCoefs, input_tok: float, share: float
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """(kept per layer, re-created while one layer is recomputed) as (per token, per token x key).
    none: everything is kept; selective (Megatron): the attention scores are recomputed; full: only
    each checkpointed layer's input is kept, and one whole layer comes back during its backward;
    op (torchtitan's per-op policy): the input and the op outputs the policy saves
    (``layers.op_checkpoint_saved``), the rest of the layer coming back during its backward. ``share``: the checkpointed share of the rank's layers (1 unless ``recompute_every`` N > 1:
    torchtitan's and torchtune's ``ac_freq``/``ac_option`` wrap a layer when its 1-based count is a
    multiple of N, torchtitan ``distributed/activation_checkpoint.py``), so the average layer keeps
    ``share`` of an input and ``1 - share`` of everything."""
    # a recomputed layer saves its input again only where it makes a copy of it: where a norm saves
    # the input itself (an fp32 stream under autocast or in fp32), that tensor is the kept input
    redo_tok = lc.tok - lc.input_saved
    if t.recompute == "full" and lc.checkpointed:
        # measured from traces with the layers checkpointed (``derived.layer_coefs``): what each
        # layer keeps is measured, and its recomputation is in its backward transients
        return (lc.tok, lc.sq), (0.0, 0.0)
    if t.recompute == "full":
        kept = (share * input_tok + (1 - share) * lc.tok, (1 - share) * lc.sq) if share < 1 else (input_tok, 0.0)
        # a layer recomputed in its backward re-creates what its own ops save, not its output (which
        # only the next layer saved): measured for derived architectures (``trace.derive``)
        return kept, ((redo_tok - lc.not_recomputed, lc.sq) if share > 0 else (0.0, 0.0))
    if t.recompute == "selective":
        return (lc.tok, 0.0), (0.0, lc.sq)
    if t.recompute == "op":
        # torchtitan's per-op policy: the input and the saved op outputs stay; in its backward the
        # layer is recomputed around them (the cached outputs are handed back, not made again), so
        # the layer then holds its input and everything it saves: redo = saved - what was kept
        return (input_tok + lc.op_tok, lc.op_sq), (redo_tok - lc.op_tok, lc.sq - lc.op_sq)
    return (lc.tok, lc.sq), (0.0, 0.0)


def _offloaded(kept: tuple[float, float], redo: tuple[float, float], input_tok: float
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """torchtune's activation offloading over full recompute (``checkpointing.OffloadActivations``):
    the checkpointed layer's input, which the checkpoint frame saves through the offloading hooks
    (torch 2.13 torch/utils/checkpoint.py L842-847, ``_CheckpointFrame.save_inputs``), leaves
    the GPU once ``max_fwd_stash_size`` (5) later tensors were packed (a Llama layer packs one, the
    final RMSNorm five, so none is left when forward ends), and comes back as a new tensor when the
    layer is recomputed in its backward: kept per layer 0, the recomputed layer holds it again."""
    return (kept[0] - input_tok, kept[1]), (redo[0] + input_tok, redo[1])


def offload_previous(input_tok: float, pol: Policy) -> float:
    """Bytes per token that the first node of a layer's backward finds still on the GPU under
    torchtune's offloading: the tensor the node before it brought back, freed only after this node
    has run (``bwd_tensor_stash``, _activation_offloading.py L263-266, L334-338): the next layer's
    input where the residual stream is half (an fp32 one is saved by the recomputed norm itself, so
    torchtune lets it go with that reference, L315-323, freed before this layer). Above the top layer
    it is the final RMSNorm's fp32 input instead (``LlamaRMSNorm``'s ``pow`` saves
    ``hidden_states.to(float32)``), which this leaves out: the top layer's moment has fewer gradients
    than the bottom one's, where the peak of a checkpointed backward falls."""
    return input_tok if pol.stream != F32 else 0.0


def _communication(t: TrainingSpec, st: States) -> tuple[int, str]:
    """Buffers that exist from model wrap: DDP's flat gradient buckets (``gradient_as_bucket_view``
    off: a copy of every gradient), or DeepSpeed ZeRO-3's gradient bucket buffer
    (``deepspeed_buckets``). Its gathered parameters live in forward and backward only
    (``deepspeed_gathered``), as FSDP's buffers (``fsdp_buffers``). FSDP's buffers live only in forward and backward (``fsdp_buffers``).
    Megatron-LM's DDP (``TrainingSpec.megatron_ddp``) has no bucket copies: its gradients are views of
    the contiguous buffer, all-reduced in place (megatron/core/distributed/param_and_grad_buffer.py
    at 6e091e1b, L672-674: ``torch.distributed.all_reduce(bucket.grad_data, ...)``)."""
    if t.dp > 1 and t.zero_stage == 0 and not t.distributed_optimizer and t.gemini is None and st.trainable \
            and not t.megatron_ddp:
        return st.grads, "communication.ddp_buckets"
    bucket = deepspeed_buckets(t)[0]   # DeepSpeed ZeRO-3's gradient bucket buffer, from engine start
    if bucket:
        return bucket, "communication.deepspeed_ipg_bucket"
    offload = deepspeed_offload_grad_buffer(t, st)
    if offload:
        return offload, "communication.deepspeed_offload_buffer"
    return 0, ""


def deepspeed_offload_grad_buffer(t: TrainingSpec, st: States) -> int:
    """Bytes of the GPU buffer DeepSpeed ZeRO-1/2 makes when it offloads the optimizer:
    ``__init__`` creates ``temp_grad_buffer_for_gpu_offload = torch.zeros(largest_param_numel,
    device=<the GPU>, dtype=self.dtype)``, the largest trainable parameter's elements in the engine's
    dtype (fp16/bf16 weights: 2 bytes), kept for the whole run (its ``temp_grad_buffer_for_cpu_offload``
    twin lives on the host); DeepSpeed v0.14.2 ``stage_1_and_2.py`` L445-478, v0.19.8 L626-661. Found
    by Giles Thomas's Qwen1.5-0.5B ZeRO-2 offload rows: the active peaks were 303-327 MiB over the
    estimate at every batch size, and Qwen1.5-0.5B's embedding (151936 x 1024) is 296.8 MiB in fp16.
    0 off DeepSpeed ZeRO-1/2 with ``offload_optimizer``."""
    if not (deepspeed_zero(t) and t.zero in (1, 2) and t.offload_optimizer and st.trainable):
        return 0
    sb = 4 if (t.weight_bytes == 4 or t.fp32_master) else t.weight_bytes   # st.largest_param's dtype
    return block_of(t, st.largest_param // sb * t.weight_bytes)           # (largest_param_numel,) fp16/bf16


def per_linear_replay(t: TrainingSpec) -> bool:
    """Whether the allocator replay (``reserved.py``) makes a layer's blocks linear by linear: each
    weight's autocast copy where its linear runs, and in backward each weight's gradient (with its
    half form under autocast) as that linear's backward makes it, from the layer's recipe
    (``LayerCoefs.linears``). Checked against trace on one GPU, DDP and pipeline stages; under FSDP,
    tensor parallelism and DeepSpeed ZeRO the gradients are unsharded or sharded buffers made
    elsewhere (``_fsdp``, DTensor shards) and the replay keeps one block per layer for the copies:
    there trace put the linear-by-linear replay further off (Llama-3.2-1B, 4 layers, bf16-amp:
    FSDP2 over 4 +12.5% against +2.5%, TP 2 with sequence parallelism -13.2% against -8.5%)."""
    return t.fsdp is None and t.tp == 1 and not t.zero_stage


def head_weight_grad_half(m: ModelSpec, t: TrainingSpec, cast_head: int) -> int:
    """Bytes of the LM head's weight gradient as its matmul's backward makes it under autocast: the
    ``mm`` of the logits' gradient and the head's input runs on autocast's half copy of the weight
    (``cast_head``, one (vocab, hidden) tensor in bf16/fp16), so its output is in that dtype, and
    autocast's ``ToCopyBackward0`` casts it to the fp32 weight's dtype afterwards (the head's gradient,
    or a tied embedding's part in its input buffer); the half gradient is freed when the cast returns
    (``torch/csrc/autograd/generated/Functions.cpp`` ``ToCopyBackward0::apply``). Used by the
    allocator replay (``reserved.py``), where its block stands between the logits' gradients and the
    fp32 one. 0 without autocast (the ``mm`` output is the gradient itself), for a frozen head (LoRA),
    a chunked loss (one such gradient per chunk: ``chunk_head_grads``), ``--compile``, and where the
    replay keeps its coarser blocks (``per_linear_replay``)."""
    if not cast_head or t.lora_rank or t.loss_chunks > 1 or t.compile or not per_linear_replay(t):
        return 0
    return cast_head


def _head_replay_fields(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> dict[str, Any]:
    """The ``Quantities`` fields only the allocator replay reads about the head: whether its backward
    makes the input's gradient first (``head_input_grad_first``) and its side's tensors one by one
    (``head_side_tensors``)."""
    return {"head_input_first": int(head_input_grad_first(m)), "head_side": head_side_tensors(m, t, pol, stage)}


def head_input_grad_first(m: ModelSpec) -> bool:
    """Whether the head's output linear has a bias, so that its backward computes the gradient of its
    input before the weight's: ``F.linear`` with a bias runs ``addmm``, whose ``AddmmBackward0`` makes
    ``mat1``'s gradient (the input's, ``grad @ weight``) first and then ``mat2``'s (the weight's,
    ``tools/autograd/derivatives.yaml`` ``addmm``: ``self``, ``mat1``, ``mat2`` in that order); without
    one it runs ``mm`` and ``MmBackward0`` makes the weight's first (torch 2.13.0, the backward's
    ``aten.mm`` calls logged under a ``TorchDispatchMode``: ``nn.Linear(8, 50)`` on a (2, 5, 8) input
    gives the (10, 8) input gradient before the (50, 8) weight gradient; with ``bias=False`` the
    other way round; trace's op stream alike). The first cuBLAS call of autograd's thread binds its
    workspace (``reserved._head_backward``), so with a bias the workspace is made before the
    (vocab, hidden) weight gradient. The heads with a bias (``spec.architectures._head``): a masked
    LM's decoder (transformers 5.24 ``models/bert/modeling_bert.py`` L494 ``nn.Linear(hidden_size,
    vocab_size, bias=True)``, run at L499), extractive QA's ``qa_outputs``, and BERT's and the
    pre-norm RoBERTa's sequence classifiers; a causal LM's ``lm_head`` and a decoder's ``score`` have none."""
    return m.head in ("masked-lm", "qa") or (m.head == "seq-cls" and m.family in ("bert", "roberta-prenorm"))


def head_casts(m: ModelSpec, t: TrainingSpec) -> int:
    """How many half copies of the LM head's weight autocast makes and the head's matmuls save. It
    caches the cast of an fp32 leaf only when it requires grad (``aten/src/ATen/autocast_mode.cpp``
    ``cached_cast``: ``arg.requires_grad() && arg.is_leaf() && !arg.is_view()``), so a trainable head
    is cast once per forward whatever the number of calls. A frozen one (LoRA) is cast at every call,
    and a loss that runs the head over ``--loss-chunks`` token chunks (torchtune's chunked output,
    litgpt's chunked half loss; ``workload._chunked_output_loss``) calls it once per chunk, each
    matmul saving its own copy for the input's gradient. Found by trace: Llama-3.2 (2 layers), LoRA,
    4 chunks, fp16-amp: -27.9% before (one 501 MiB copy counted of four)."""
    if t.loss == "chunked-nll":
        return 0   # each chunk's cast is a transient of the loss (_chunked_nll_bytes)
    frozen = bool(t.lora_rank) and "lm_head" not in (t.lora_targets or ())
    if t.loss in ("fused", "unsloth"):
        return 0   # Liger's matmuls cast the weight within the loss only: transients (fused_linear_ce_bytes)
    chunked = is_lm(m) and t.loss_chunks > 1 and loss_mode(m, t) in ("chunked", "half")
    return t.loss_chunks if (frozen and chunked) else 1


def half_embedding_output(t: TrainingSpec, pol: Policy, stage: str, input_tok: float
                          ) -> tuple[tuple[str, float, float], ...]:
    """``half_embeddings`` (TRL's bf16 embedding over fp32 norms, ``states.half_embedding_tensor``):
    what the first layer's checkpointed input keeps less than the others'. The embedding's output is
    half, so the first checkpointed layer keeps a half input (b, s, h); from that layer's MLP on the
    residual stream is fp32 as ``--precision bf16-amp`` models it: the fp32 post-attention norm's
    output (its fp32 weight times the half input, transformers 4.48.1 ``MistralRMSNorm.forward``)
    goes through bitsandbytes' ``Linear4bit``, which returns its input's dtype (bitsandbytes 0.43.3
    ``nn/modules.py`` ``Linear4bit.forward``: ``out.to(inp_dtype)``), and the half residual plus that
    fp32 output is fp32. Under full (or op) recompute of every layer, on the stage holding the first
    layer; without recompute the first layer's saved tensors are the fp32 stream's (not modelled).
    The allocator replay (``reserved.py``) keeps every layer's input at the stream's size."""
    if not t.half_embeddings or t.recompute not in ("full", "op") or t.recompute_every != 1 \
            or t.offload_activations or not (t.pp == 1 or stage == "first") or pol.stream <= 2:
        return ()
    return (("first_layer.half_input", input_tok * (1 - 2 / pol.stream), 0.0),)


def offload_stash_keeps_top_input(t: TrainingSpec) -> bool:
    """LoRA with activation offloading: whether the top layer's input stays on the GPU from the end of
    forward until that layer is recomputed. torchtune's pack hook drops a tensor from ``fwd_stash`` only
    when ``max_fwd_stash_size`` (5) later tensors big enough to offload were packed (v0.6.1
    _activation_offloading.py L133-200; trainmem.checkpointing.OffloadActivations). After the top layer's
    input only the final RMSNorm packs: its fp32 input (``pow``), the ``rsqrt`` output, both again for the
    ``mul``, and, for the weight's product, the weight (needed for the input's gradient) and, when the
    weight is trained, the normalized tensor. With LoRA the norm is frozen: its weight is the fifth pack
    and an ``nn.Parameter``, which the hook keeps on the GPU without offloading (exempt since 3ca0d309c,
    2024-10-18, torchtune v0.4.0), so only four count and the input stays; its unpack then takes it from
    the stash without a copy (the layer's recompute). Before v0.4.0 the weight was offloaded too
    (30b8519e8 L134-197: every tensor of >= 1024 B): nothing stays. Found by trace (Llama 4 x 256, LoRA r8,
    4 x 1024): its forward ended one layer input above the estimate."""
    if not (t.lora_rank and t.offload_activations):
        return False
    # (without --framework torchtune: trainmem.checkpointing's hooks, which exempt parameters as v0.6.1)
    return t.extra.get("framework") != "torchtune" or torchtune_offload_exempts_parameters(t)


def peft_offload_leaf(t: TrainingSpec, stage: str, input_tok: float) -> tuple[tuple[str, float, float], ...]:
    """LoRA with activation offloading on a transformers model: the first layer's input stays on the GPU.
    peft's ``PeftModel`` calls ``enable_input_require_grads`` (peft 0.21.2 peft_model.py L725-735), a
    forward hook on the input embeddings that makes their output require grad: a leaf, which its
    ``AccumulateGrad`` node holds until the graph is freed (``torch/csrc/autograd/functions/
    accumulate_grad.h``: ``Variable variable``), so offloading the checkpoint's copy of it frees nothing,
    and the bottom layer's recompute brings a second copy back beside it. Counted as a negative
    ``first_unsaved`` term: the first layer keeps one input (b, s, h) more, bf16 or the stream's dtype.
    torchtune's own models (``OWN_MODEL_CODE``) have no such hook: their first layer's input is
    offloaded like the others. Found by trace (Llama 4 x 256, LoRA r8, full recompute, bf16,
    4 x 1024): the bottom layer's backward peak was one layer input (2 MiB) above the estimate."""
    if not (t.lora_rank and t.offload_activations) or t.extra.get("framework") in OWN_MODEL_CODE \
            or not (t.pp == 1 or stage == "first"):
        return ()
    return (("first_layer.offload_leaf", -input_tok, 0.0),)


def _cast_first_free(m: ModelSpec, t: TrainingSpec, lc: LayerCoefs, lora_first: bool, cast: bool, stage: str) -> int:
    """Bytes of the first layer's half weight copies (bf16/fp16) that no matmul keeps, which the engine's
    per-layer copies count (``Quantities.cast_first_free``): the hand-written recipes' frozen linears on a
    LoRA model's grad-free first-layer input (``LayerCoefs.first_free_weights``, with ``lora_first``), a
    derived model's measured ones (``derived.first_free_casts``; on the stage holding the first layer)."""
    own = int(sum(lc.first_free_weights) * 2) if lora_first else 0
    return own + (derived_first_free_casts(m, t) if cast and (t.pp == 1 or stage == "first") else 0)


def first_layer_unsaved(t: TrainingSpec, lc: LayerCoefs, stage: str) -> tuple[tuple[str, float, float], ...]:
    """LoRA: the tensors the first layer does not save, because its input (the frozen embedding's
    output) requires no gradient and autograd keeps nothing for an op none of whose inputs needs one
    (``layers.Recipe.first_layer_unsaved``): the ops before the first adapter, the frozen linears on
    that input (their half weight copies: ``Quantities.cast_first_free``), an adapter dropout's mask
    on it. Without recompute, and under selective recompute less its s x s terms (which selective
    does not keep anyway): a checkpointed layer's recompute runs under its own rules; only on the
    stage holding the first layer. Found by trace (benchmarks/bench_agreement.py: Llama 2 layers,
    LoRA on q/v, +2.8%; on gate_proj alone +15.9%)."""
    if not t.lora_rank or t.recompute not in ("none", "selective") or t.offload_activations \
            or not (t.pp == 1 or stage == "first"):
        return ()
    if t.recompute == "selective":
        return tuple((name, tok, 0.0) for name, tok, _sq in lc.first_unsaved)
    return lc.first_unsaved


def pipeline_fsdp(t: TrainingSpec) -> bool:
    """Whether pipeline stages are sharded with FSDP2 and driven by torch's ``PipelineStage``
    (``--pp`` with ``--fsdp``). The schedule computes the loss with its ``loss_fn`` on the last
    stage's returned logits (torch 2.13 ``distributed/pipelining/stage.py`` ``_PipelineStageBase``
    ``forward_one_chunk`` returns the submodule's output; ``schedules.py`` ``_maybe_compute_loss``),
    outside the stage module, as a loop's ``--loss upcast`` is (``loss_outside_root``)."""
    return t.pp > 1 and t.fsdp is not None


def pipeline_top_first(t: TrainingSpec, st: States, stage: str) -> int:
    """Bytes a pipeline's first stage under FSDP2 ``full`` holds, beside its root's all-gather output
    and parameters, when its root is gathered at the start of a backward: the top layer's unsharded
    parameters (the per-parameter tensors copied out of its all-gather) and the all-gather output of
    the layer below it, prefetched (``_fsdp_param_group.py`` ``_backward_prefetch``). The first stage
    returns its top layer's output, on which both that layer's and the stage root's pre-backward hooks
    are registered (``_fsdp_state.py`` ``_register_pre_backward_hook``, the layer's first, at its
    post-forward); the layer's runs first: it gathers itself and prefetches the layer below, then the
    root's gathers the root (``pre_backward`` -> ``unshard``, ``wait_for_unshard``, whose all-gather
    output is freed after its copy-out). A stage whose output is its head's logits (the last) has the
    root's hook alone on it. The forward before each backward resharded every unit (1F1B), so this
    happens at each backward after a forward. Found by trace (hook order seen on the run): llama-3.2-1b
    cut to 4 layers, --pp 2 --dp 2 full, b 1 s 32: first stage -5.7% before. Not under sequence
    parallelism: the stage then returns its top layer's output's local shard (``DTensor.to_local``,
    ``wrappers.PipelineStageModule.forward``), a tensor of its own with the root's hook alone, so the
    root gathers first and the layer's hook runs after ``to_local``'s backward (found by trace: the
    same model --pp 2 --dp 2 --tp 2 --sequence-parallel full, b 2, s 256, bf16-amp, first stage +1.13%
    before)."""
    if not (pipeline_fsdp(t) and stage == "first" and t.fsdp_version == 2 and t.zero_stage == 3
            and t.shard_group > 1) or (t.tp > 1 and t.sequence_parallel):
        return 0
    return sum(block_of(t, x) for x in st.layer_tensors) + block_of(t, st.layer_params_full)


def pipeline_kept_layer(t: TrainingSpec, st: States) -> int:
    """Bytes of one layer's unsharded parameters (the per-parameter tensors FSDP2 copies out of its
    all-gather) that a pipeline stage under FSDP2 ``full`` keeps gathered after the layer's backward,
    through the rest of the stage's backward: ``PipelineStage`` runs every backward with
    ``set_reshard_after_backward(False)`` and reshards only after the schedule (torch 2.13
    ``pipelining/stage.py`` ``backward_maybe_with_nosync`` L843-847, ``perform_reduce_grad``
    L1164-1191; ``_fully_shard/_fsdp_param_group.py`` L603-612: ``post_backward`` reshards only when
    ``reshard_after_backward``), so at a layer's backward every layer above it on the stage is
    gathered, and at the embeddings' every layer (``moments._layers_backward``'s ``kept_layer``; found
    by trace: llama-3.2-1b cut to 4 layers, --pp 2 --dp 2 --tp 2 --fsdp full, the first stage's
    embedding backward holds the root and both layers gathered). Under ``grad-op`` the layers stay
    gathered from their forward anyway (``gathered_layer``)."""
    if not (pipeline_fsdp(t) and t.fsdp_version == 2 and t.zero_stage == 3 and t.shard_group > 1):
        return 0
    return sum(block_of(t, x) for x in st.layer_tensors)


def loss_outside_root(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether the loop computes the loss after the root module's forward has returned (``--loss
    upcast`` / ``half`` on the logits, ``workload.forward_loss``). Under FSDP2 the root's
    post-forward then has freed the last layer's all-gather output, which is otherwise kept until the
    next all-gather is waited on (torch 2.13 ``_fully_shard/_fsdp_state.py`` L333-343,
    ``_post_forward``: "free the all-gather result" when ``iter_forward_root is self``). Found by
    trace: GPT-2 FSDP2 grad-op dp 4 ``--loss half``: +1.3% before."""
    return (t.loss in ("upcast", "half") and m.head in ("causal-lm", "masked-lm") and t.pp == 1) or pipeline_fsdp(t)


def fsdp1_prefetch_after_loss(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether FSDP1 prefetches the last layer only after the loop's loss has run its backward. The
    root's pre-backward hook, which unshards the root and prefetches the next unit in backward order
    (``BACKWARD_PRE``), is registered on the tensors the root's forward returns (torch 2.13
    ``fsdp/_runtime_utils.py`` ``_register_pre_backward_hooks``, ``_pre_backward_hook`` L630-697).
    With the model's own loss among them it fires at the first op of backward, so the last layer is
    gathered while the loss's backward runs; when the loop computes ``cross_entropy`` on the
    returned logits (``--loss upcast`` / ``half``, ``loss_outside_root``) it fires once the logits'
    gradient exists, after the loss's backward. The root itself stays gathered: FSDP1 does not
    reshard the root after forward (``_post_forward_reshard``). Found by trace: Llama-3.2-1B cut to
    2 layers, bf16-amp ``--loss upcast``, +2.1% before."""
    return t.fsdp is not None and t.fsdp_version == 1 and loss_outside_root(m, t)


def root_resharded_for_loss(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether FSDP2's root unit is sharded while the loop's loss and the loss's backward run.

    ``fully_shard(model, reshard_after_forward=True)`` (trainmem's wrapper, torchtune, accelerate)
    reshards the root when its forward returns (torch 2.13 ``_fully_shard/_fsdp_state.py`` L203-207
    skip this only when ``reshard_after_forward`` is left unset; ``_fsdp_param_group.py``
    ``post_forward`` -> ``reshard``) and gathers it again in the root's pre-backward hook, which
    ``_register_pre_backward_hook`` puts on the forward's output tensors (``_fsdp_state.py``
    L434). When the model computes its own loss that output is the loss, so the root is gathered
    from the first op of backward on. When the loop computes ``cross_entropy`` on the returned
    logits (``--loss upcast`` / ``half``; ``workload.forward_loss``), the hook fires only once the
    logits' gradient exists: the loss's forward and its backward (``nll_loss_backward``,
    ``_log_softmax_backward_data``) run with the root sharded and no layer prefetched; then the
    root's all-gather output and the parameters copied out of it (kept until the next unit's
    all-gather, ``_fsdp_param_group.py`` ``wait_for_unshard``) exist beside the logits' gradient
    (``Quantities.fsdp_root_regather``; Mistral dp 8 fp32 --loss upcast: -10.6% before). FSDP1 and
    ``grad-op`` (``reshard_after_forward=False``) keep the root gathered. Found by trace on the
    fake process group (benchmarks/bench_agreement.py, the sampled grid: Qwen2 +12.6% before)."""
    return (t.fsdp is not None and t.fsdp_version == 2 and t.zero_stage == 3 and t.fsdp_gathered == "none"
            and (loss_outside_root(m, t) or pipeline_fsdp(t)))


def fsdp2_root_gathered(t: TrainingSpec) -> bool:
    """Whether FSDP2 keeps the root unit gathered from its forward to its backward (``--fsdp-gathered
    root`` / ``root-last``). Before PyTorch 2.8 ``FSDPState._lazy_init`` set the root's
    ``post_forward_mesh_info = None`` whatever ``reshard_after_forward`` the user passed ("For the
    root, do not reshard after forward since for training, the parameters would be freed and
    all-gathered immediately"); pytorch/pytorch PR #154704 (Wei Feng, "[FSDP2] respect
    reshard_after_forward=True for root model", June 2025) made ``True`` respected and PR #155319 keeps
    the root gathered only when the argument is left unset (torch 2.13 ``_fsdp_state.py`` L203-207).
    With the loop's loss on the returned logits the root's pre-backward hook fires once their gradient
    exists, and its prefetch of the last layer only then (as FSDP1's, ``fsdp1_prefetch_after_loss``)."""
    return t.fsdp is not None and t.fsdp_version == 2 and t.zero_stage == 3 and t.fsdp_gathered != "none"


def fsdp2_last_gathered(t: TrainingSpec) -> bool:
    """Whether FSDP2 keeps the last decoder layer gathered from its forward to its backward
    (``--fsdp-gathered root-last``): torchtitan's ``parallelize_llama`` passes
    ``reshard_after_forward=layer_id < len(model.layers) - 1`` ("As an optimization, do not reshard
    after forward for the last transformer block since FSDP would prefetch it immediately";
    torchtitan 83c879f18 ``torchtrain/parallelisms/parallelize_llama.py`` L219-229, 5940ddeb5
    ``torchtitan/parallelisms/parallelize_llama.py`` ``apply_fsdp``). Its parameters, unsharded bf16
    tensors copied out of the all-gather output, stay through the loss and are not gathered again
    for its backward; its post-backward reshards them."""
    return fsdp2_root_gathered(t) and t.fsdp_gathered == "root-last"


def root_regathered_at_loss(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether FSDP2 gathers its resharded root again at the first node of the loss's backward,
    before any of the loss's gradients exist: ``fully_shard(model, reshard_after_forward=True)``
    (``--fsdp full``/``hybrid``, ``wrappers.fsdp2``) reshards the root when its forward returns
    (torch 2.13 ``_fully_shard/_fsdp_state.py`` L203-207 keep it only when ``reshard_after_forward``
    is left unset; ``_post_forward`` also frees the last layer's all-gather output, L333-343), and
    when the model computes its own loss that loss is among the forward's outputs, on which
    ``_register_pre_backward_hook`` (L434) puts the root's pre-backward unshard: a tensor hook, run
    before the loss's ``NllLossBackward0``. So the root's all-gather output (its flat buffer,
    ``foreach_all_gather``) and the parameters copied out of it (``foreach_all_gather_copy_out``)
    exist together beside the log-probabilities the loss saved; the all-gather output is freed when
    the root's backward prefetch of the last layer is issued, before the loss's gradients are
    allocated (the ``cross_entropy.backward`` moment: the root and that layer's buffer). With a
    wide vocabulary and few tokens (root > the loss's backward temporaries + the layer's buffer)
    this is the backward's peak. The loop's loss (``root_resharded_for_loss``) regathers later,
    at the logits' gradient. Found by trace: Llama 2 layers (vocabulary 32000, h 2048), 2 x 512,
    FSDP2 full over 4, 2 micro-batches: -2.19% before (moment ``fsdp.root_unshard``)."""
    return (t.fsdp is not None and t.fsdp_version == 2 and t.zero_stage == 3 and t.pp == 1
            and t.fsdp_gathered == "none" and not root_resharded_for_loss(m, t))  # a root kept gathered: none


def fsdp2_split_root(t: TrainingSpec) -> bool:
    """Whether FSDP2 runs torchtitan's units since 83e694105 ("Improve reshard_after_forward logic",
    2025-07-28; ``--fsdp-gathered head``): ``apply_fsdp`` (``torchtitan/models/llama3/infra/
    parallelize.py`` L385-422 there; ``torchtitan/distributed/fsdp.py`` L251-265 at main) shards the
    token embedding as its own unit and every block with ``reshard_after_forward=True``, the final
    norm and the output head as one unit ``fully_shard([model.norm, model.output],
    reshard_after_forward=False)`` (policy "default"), and the root ``fully_shard(model)`` holds no
    parameters. So (torch 2.13 ``_fully_shard``): the embedding's all-gather output lives until the
    first layer's is waited on (``_fsdp_param_group.py`` ``wait_for_unshard`` L429-432, L477-489),
    its parameters resharded at its post-forward; the head unit stays gathered from its forward to
    its post-backward, its all-gather output freed by the root's post-forward (``_fsdp_state.py``
    L333-343), after the model's own loss but before the loop's; the head's pre-backward hook, on
    the logits (``_register_pre_backward_hook`` L434), finds it gathered and prefetches the last
    layer (``_backward_prefetch`` L795-831) once the logits' gradient exists; its post-backward,
    when the gradient of its input is made, reduce-scatters the head's gradients (the input, flat in
    the reduce dtype, kept in ``reduce_scatter_states`` until the last layer's post-backward,
    L645-657, L717-719); the first layer's pre-backward prefetches the embedding, whose pre-backward
    copies it out and whose post-backward runs in the root's final callback (its input, the token
    ids, needs no gradient: ``_root_post_backward_final_callback`` L395-420), as the old root's."""
    return fsdp2_root_gathered(t) and t.fsdp_gathered == "head"


def _split_root(m: ModelSpec, t: TrainingSpec, st: States, layer_buf: int) -> dict[str, int]:
    """``fsdp_buffers`` under ``fsdp2_split_root``: the root's terms for its two units (the root
    itself gathers nothing), bytes on one rank. Gathered in param_dtype (bf16 under ``bf16-mp``);
    reduce-scatter inputs in the reduce dtype (fp32 under ``bf16-mp``)."""
    head, emb = st.head_unit_full, st.root_full - st.head_unit_full
    return {"fsdp_root": 0, "fsdp_loss_root": head, "fsdp_root_kept": head, "fsdp_loss_buf": 0,
            "fsdp_root_regather": 0, "fsdp_root_regather_own": 0,
            # the model's own loss runs before the root's post-forward frees the head's all-gather output
            "fsdp_loss_ag": 0 if loss_outside_root(m, t) else head,
            "fsdp_emb_unit": emb, "fsdp_head_unit": head, "fsdp_head_pref": layer_buf,
            "fsdp_head_done": st.head_grads_full, "fsdp_head_shard": st.head_grads,
            "fsdp_head_rs": st.head_unit_rs, "fsdp_head_last": st.head_unit_last,
            "fsdp_root_sharded": st.root_grads - st.head_grads,
            "fsdp_root_rs": st.emb_unit_rs, "fsdp_root_last": st.emb_unit_last}


def fsdp_buffers(m: ModelSpec, t: TrainingSpec, st: States, lc: LayerCoefs) -> dict[str, int]:
    """FSDP's unsharded tensors, which exist only between a forward and the end of its backward
    (``moments`` places each), bytes on one rank in the gathered dtype (bf16 under ``bf16-mp``):

    * the root unit (``fully_shard(model)`` / FSDP1's root: the embeddings, final norm and head)
      is gathered through the model's forward, the loss included, and from the start of backward
      (the root's pre-backward hook) until its post-backward at the end of backward; its gradients
      are unsharded until then too. Left to itself FSDP does not reshard the root after forward at
      all (torch 2.13 ``_fully_shard/_fsdp_state.py`` L203-207, "For the root, do not reshard after
      forward", when ``reshard_after_forward`` is not given; FSDP1 ``_runtime_utils.py``
      ``_post_forward_reshard``: ``not state._is_root``); torchtune, accelerate and trainmem's own
      wrapper pass ``reshard_after_forward=True`` and re-gather it for backward: the same bytes at
      every moment but the end of forward;
    * with ``full`` / ``hybrid`` (reshard after forward) one layer's all-gather output per layer
      being computed and one prefetched in backward (FSDP2 ``_backward_prefetch``, FSDP1
      ``BackwardPrefetch.BACKWARD_PRE``); with ``grad-op`` the layers stay gathered
      (``Quantities.gathered_layer``) and nothing more is gathered in backward;
    * in forward FSDP2 keeps each unit's all-gather output (the flat buffer the parameters are copied
      out of) until the next unit's all-gather is waited on (``_fsdp_param_group.py``
      ``wait_for_unshard``: ``comm_ctx.all_gather_state``, "Defer free to allow for overlap of this
      copy-out with next all-gather"), so the last layer's is alive while the loss runs;
    * FSDP2 keeps the previous layer's reduce-scatter input (its gradients, flat, in the reduce
      dtype: fp32 under ``bf16-mp``) until the next layer's post-backward
      (``_fsdp_param_group.py`` ``post_backward``: ``reduce_scatter_states``, at most
      ``reduce_scatter_max_input_buffers`` = 1 kept); FSDP1 frees it when the reduce-scatter is
      issued (``_runtime_utils.py`` ``_reduce_grad``). FSDP2 before PyTorch 2.5 (pytorch/pytorch
      PR #129721, ``TrainingSpec.fsdp2_rs_on_default_stream``) made it on its reduce-scatter stream
      inside ``foreach_reduce_scatter`` and held it only until that returned (``fsdp_rs_side``: the
      same bytes, in no moment's communication buffers; the replay allocates it on that stream's
      pool, ``reserved._Fsdp.reduce``);
    * FSDP2's root post-backward, at the end of backward, reduce-scatters the root's gradients:
      ``foreach_reduce`` (``_fsdp_collectives.py``) allocates the reduce-scatter input (the root's
      gradients, flat and padded, in the reduce dtype: fp32 under ``bf16-mp``), copies them in and
      clears its list of the unsharded gradients, then allocates the output (the sharded gradients,
      counted in ``grads``). Before the copy-in, the loop ``for i, (fsdp_param, unsharded_grad) in
      enumerate(zip(fsdp_params, unsharded_grads))`` (the dim-0 check) leaves its variable bound to
      the last gradient of the list, so that one survives ``unsharded_grads.clear()`` until
      ``foreach_reduce`` returns: the root's last parameter, an untied LM head (registered after the
      body in every transformers causal LM). The layers' last is a norm's weight (small). Found by
      trace: Phi-3 (2 layers) FSDP2 dp 2 bf16-mp, full recompute: -5.2% before
      (``moments._layers_backward``, moment ``fsdp.root_reduce``).
    Found by trace on the fake process group (docs/trace.md, "FSDP2's root unit")."""
    if t.fsdp is None or t.shard_group < 2:
        return {}
    layer_buf = block_of(t, st.layer_params_full) if t.zero_stage == 3 else 0
    resharded = root_resharded_for_loss(m, t)
    return {"fsdp_root": st.root_full,
            "fsdp_layer_buf": layer_buf,
            "fsdp_loss_root": 0 if resharded else st.root_full,
            # the last layer prefetched while the loss's backward runs: not when the loop's loss runs before
            # the root's pre-backward hook (FSDP1; FSDP2 with its root gathered) or it is gathered already
            "fsdp_loss_buf": 0 if (resharded or fsdp1_prefetch_after_loss(m, t) or fsdp2_last_gathered(t)
                                   or (fsdp2_root_gathered(t) and loss_outside_root(m, t))) else layer_buf,
            "fsdp_root_regather": st.root_full if resharded else 0,
            "fsdp_root_regather_own": st.root_full if root_regathered_at_loss(m, t) else 0,
            "fsdp_loss_ag": 0 if loss_outside_root(m, t) or t.fsdp_version != 2 else block_of(t, st.layer_params_full),
            "fsdp_root_kept": st.root_full if (t.zero_stage != 3 or t.fsdp_version == 1
                                               or fsdp2_root_gathered(t)) else 0,
            # one layer's parameters, unsharded (the per-parameter tensors FSDP2 copies out)
            "fsdp_last_kept": sum(block_of(t, x) for x in st.layer_tensors) if fsdp2_last_gathered(t) else 0,
            # (none in a pipeline stage's backward: PipelineStage reduce-scatters after the schedule, fsdp_no_sync)
            "fsdp_rs_buf": st.layer_rs if t.fsdp_version == 2 and t.fsdp2_rs_on_default_stream
            and not pipeline_fsdp(t) else 0,
            "fsdp_rs_side": st.layer_rs if t.fsdp_version == 2 and not t.fsdp2_rs_on_default_stream
            and not pipeline_fsdp(t) else 0,
            "fsdp_head_full": st.head_grads_full, "fsdp_emb_full": st.emb_grads_full,
            "fsdp_ag_result": block_of(t, st.layer_params_full) if t.fsdp_version == 2 else 0,
            "fsdp2_cast_shards": t.shard_group if t.fsdp_version == 2 and t.precision == "bf16-mp" else 0,
            "fsdp_root_sharded": st.root_grads,
            "fsdp_root_rs": st.root_rs if t.fsdp_version == 2 else 0,
            "fsdp_root_last": st.root_last_grad if t.fsdp_version == 2 else 0,
            # always_wrap_policy: the head unit gathered for its backward (estimate.fsdp_wrap), which makes the
            # weight gradient, unsharded, and the input's gradient (b, s, hidden) in the compute dtype
            "fsdp1_head_unit": st.head_units_full if t.fsdp_version == 1 else 0,
            "fsdp1_head_in_tok": float(m.hidden_size * t.compute_bytes) if st.head_units_full else 0.0,
            "fsdp1_head_post": fsdp1_unit_post_backward(t, st.head_units_elems) if t.fsdp_version == 1 else 0,
            **_fsdp1_fields(t, st, lc), **(_split_root(m, t, st, layer_buf) if fsdp2_split_root(t) else {}),
            **module_units_kept(t, st)}


def module_units_kept(t: TrainingSpec, st: States) -> dict[str, int]:
    """``fsdp_buffers``' root terms under ``always_wrap_policy`` with SHARD_GRAD_OP (``estimate.fsdp_wrap``;
    nothing otherwise), bytes on one rank: no unit is resharded after its forward (torch 2.13
    ``fsdp/_runtime_utils.py`` ``_post_forward_reshard``: only the strategies that reshard after forward),
    so the embedding's and the head's units stay gathered from their forward, the head's to its own
    post-backward (while the loss and its backward run: ``fsdp_loss_root``), the embedding's to its
    post-backward at the end of backward (``fsdp_root``, in place of the gather for its backward,
    ``fsdp1_emb_units``). Found by trace: Llama-3.2-1B's shapes cut to 2 layers, FSDP1 grad-op dp 2: the
    transformer policy's units give +16.3 % at the head's flat gradient."""
    if not (st.head_units_full or st.emb_units_full) or t.fsdp != "grad-op":
        return {}
    kept = st.emb_units_full + st.head_units_full
    return {"fsdp_root": st.emb_units_full, "fsdp_loss_root": kept, "fsdp_root_kept": kept, "fsdp1_emb_units": 0}


def _fsdp1_fields(t: TrainingSpec, st: States, lc: LayerCoefs) -> dict[str, int]:
    """FSDP1's own terms of ``fsdp_buffers`` (zero under FSDP2), bytes on one rank. Under FSDP1
    (use_orig_params) the root's parameters are views of its flat parameter: the head's view
    gradient waits for ``SplitWithSizesBackward``'s cat at the embedding's backward
    (``fsdp1_flat_gradient``), also when it will be added to an accumulated .grad (no_sync). Found
    by the sampled grid: Mistral FSDP1 --grad-sync step, 2 micro-batches, -9.4% before."""
    one, unprefetched = t.fsdp_version == 1, fsdp1_unprefetched(t, lc)
    return {"fsdp1_post": fsdp1_post_backward(t, st) if one else 0,
            "fsdp1_hook": fsdp1_hook_requests(t, st) if one else (),
            "fsdp1_mp_shards": t.shard_group if one and t.precision == "bf16-mp" and not t.fsdp_offload_params else 0,
            "fsdp1_head_wait": st.head_grads_full if one else 0,
            "fsdp1_flat": fsdp1_flat_gradient(st) if one else 0,
            "fsdp1_root_views": st.root_views if one and st.root_flat else 0,
            "fsdp1_root_flat": fsdp1_root_flat_gradient(st) if one else 0,
            "fsdp1_emb_units": st.emb_units_full if one else 0,
            "fsdp1_root_post": fsdp1_root_post_backward(t, st) if one else 0,
            "fsdp1_root_cast": fsdp1_root_cast(t, st) if one else 0,
            "fsdp1_unprefetched": unprefetched, "fsdp1_held_inputs": int(fsdp1_held_inputs(t)),
            "fsdp1_adapter_units": 2 * lc.adapters if unprefetched >= 0 else 0,
            "fsdp1_init": fsdp1_lazy_init(t, st) if one else (),
            "fsdp1_root_raw": fsdp1_flat_bytes(st.root_tensors, fsdp1_elem(t), t.shard_group) if one else 0,
            "fsdp1_host_shards": t.shard_group if one and t.fsdp_offload_params else 0}


def fsdp1_elem(t: TrainingSpec) -> int:
    """Bytes per element of FSDP1's gathered flat parameter: bf16 under parameter mixed precision
    (``bf16-mp``), else the stored weights' dtype (``_fwd_bwd_param_dtype``, torch 2.13
    ``fsdp/_flat_param.py`` ``_init_param_reduce_dtypes`` L903-937)."""
    return 2 if t.precision == "bf16-mp" else t.weight_bytes


def fsdp1_flat_bytes(tensors: tuple[int, ...], elem: int, world: int) -> int:
    """Bytes of an FSDP1 unit's padded unsharded flat parameter, in the gathered dtype (``elem`` bytes
    per element), as the all-gather destination is requested (``_alloc_padded_unsharded_flat_param``,
    torch 2.13 ``fsdp/_flat_param.py`` L1395-1410: ``flat_param.numel() * world_size`` elements,
    ``init_flat_param_attributes`` L1285-1291). ``tensors``: the unit's parameters' own bytes in that
    dtype, in registration order. Under ``use_orig_params`` (trace's, ``align_addresses``, L566)
    ``_init_flat_param_and_metadata`` (L695-775) pads before each parameter to the 16-byte
    alignment (``_get_aligned_numel``: ``ALIGNMENT // unsharded_dtype_size`` elements, L2771-2776)
    and the total to a multiple of the world size (L757-775); a rank's shard is the total over the
    world size (``_get_shard``, L1122-1139). Not rounded to allocator blocks: the caller charges those."""
    if not tensors or elem <= 0:
        return 0
    aligned, total = 16 // elem, 0
    for nbytes in tensors:
        total += -total % aligned                                # padding to the parameter's aligned start
        total += nbytes // elem                                  # its elements
    total += -total % max(world, 1)                              # padding to the world size
    return total * elem


def fsdp1_lazy_init(t: TrainingSpec, st: States) -> tuple[int, ...]:
    """Bytes of each tensor FSDP1's lazy init allocates on the default stream and frees at once, in
    order, at the first forward: for the root's handle, then every other unit's (the layers'),
    ``FlatParamHandle.init_flat_param_attributes`` (torch 2.13 ``fsdp/_flat_param.py`` L1264-1301,
    called by ``_runtime_utils.py`` ``_share_state_and_init_handle_attrs`` L182, L228) makes, under
    parameter mixed precision (``bf16-mp``), the low-precision shard (``_mp_shard``, one rank's flat
    parameter in bf16), then, for a sharded strategy, the padded unsharded flat parameter in the
    gathered dtype (``_full_param_padded``, the all-gather destination: the unit's parameters times
    the ranks, bf16 under ``bf16-mp``) and, under mixed precision, its full-precision twin
    (``_full_prec_full_param_padded``, fp32), each followed by ``_free_storage``. Nothing stays
    allocated, but the largest leaves a segment of its size cached on the default stream before
    the first forward, which that forward's activations fill (found by trace: Llama-2-7B cut to 2
    layers, b2 s1024, FSDP1 dp 2 pure bf16 full fine-tuning, full recomputation: the layers' forward
    opens no segment on the default stream; the replay without this -5.95 % against trace's peak
    reserved memory, with it -0.49 %). Bytes on one rank, each tensor's own (``fsdp1_flat_bytes`` of
    the unit's parameters: ``torch.empty`` of the padded flat numel, not an allocator block; the
    2 MiB-rounded blocks opened 34 MiB segments where trace opens 32 for the wide 2-layer Llama's
    62.5 MiB root, tests/test_workspace_order.py): the root's (``st.root_tensors``), then one
    layer's (``st.layer_tensors``); every other layer's repeats it, each freed before the next of
    its size is asked for, so that the same cached blocks serve them."""
    if t.fsdp is None or t.shard_group < 2:
        return ()
    mp, elem, world = t.precision == "bf16-mp", fsdp1_elem(t), t.shard_group
    out: list[int] = []
    for tensors in (st.root_tensors, st.layer_tensors):
        full = fsdp1_flat_bytes(tensors, elem, world)            # the gathered dtype's padded flat parameter
        if full <= 0:
            continue
        if mp:                                                    # the bf16 shard (its fp32 twin is the flat param)
            out.append(full // world)
        out.append(full)
        if mp:                                                    # ... and its fp32 twin
            out.append(full * 2)
    return tuple(out)


def fsdp1_held_inputs(t: TrainingSpec) -> bool:
    """Whether FSDP1 holds every checkpointed layer's input, and the gradient autograd accumulates into
    it, until backward ends. Reentrant checkpointing (``--reentrant``: transformers 4.48.1
    ``modeling_utils.py`` L2539, ``gradient_checkpointing_enable`` defaults to ``use_reentrant=True``)
    recomputes a layer on ``detach_variable`` copies of its saved inputs, leaves that require grad, and
    ``torch.autograd.backward(outputs, args)`` accumulates the input's gradient into that leaf's ``.grad``
    (torch/utils/checkpoint.py ``CheckpointFunction.backward``). The recompute calls the layer's FSDP1
    unit; a unit whose flat parameter does not require grad (a frozen decoder layer: peft's
    ``fsdp_auto_wrap_policy`` gives the adapters units of their own, ``fsdp_lora_units="separate"``)
    registers, in ``_pre_forward``, a multi-grad hook on its inputs that require grad, to reshard after
    their gradients (torch 2.13 ``fsdp/_runtime_utils.py`` ``_register_post_backward_reshard_only_hook``
    L1473-1516, kept in ``flat_param._post_backward_hook_state``; the same in torch 2.1-2.4).
    ``register_multi_grad_hook`` keeps each input's gradient node, for a leaf its ``AccumulateGrad``
    (``autograd/graph.py`` ``_get_grad_fn_or_grad_acc`` L190-200: ``t.view_as(t).grad_fn.next_functions``),
    which references the leaf; the hook registered on the leaf closes the cycle, so the leaf, its
    storage (the layer's saved input) and its ``.grad`` live until ``_finalize_params`` removes the hook
    in the post-backward final callback (L1182-1190). At layer ``j``'s backward the ``L-1-j`` inputs above
    it and the ``L-2-j`` gradients above the one it receives are still allocated: at the bottom layer
    every layer's input and ``L-2`` gradients of the residual stream. Non-reentrant checkpointing hands
    the unit inputs with a ``grad_fn`` (no ``AccumulateGrad`` kept), and a flat parameter that requires
    grad registers no such hook; nor does a unit that runs the checkpoint inside its own forward
    (transformers 4.52 and later: ``tf_releases.checkpoint_wraps_unit``), whose inputs have a ``grad_fn``
    too; nor does torch's ``apply_activation_checkpointing`` run after FSDP1 wrapping
    (``checkpoint_wrapper``: a reentrant ``CheckpointWrapper`` inside each unit, accelerate's
    ``fsdp_activation_checkpointing``, Answer.AI's fsdp_qlora ``train.py`` L728-743 at 50efa1e): the
    unit's ``_pre_forward`` runs in the first forward only, where each input but the bottom one has a
    ``grad_fn``, and the recompute calls the wrapped layer, not the unit, so no hook sees the detached
    leaves (torch 2.13 ``distributed/algorithms/_checkpoint/checkpoint_wrapper.py`` L143-171). Checked
    on a real CPU run (tests/test_fsdp1_reentrant.py: with ``use_cache=False``, as the training loops
    run; a ``DynamicCache`` left on keeps the recompute's keys and values, and through their graph every
    detached input, which an earlier version of that test took for the hook); found by the
    fms-acceleration Mistral-7B LoRA FSDP1 rows (-8.7 % / -10.0 % before)."""
    return (t.checkpoint_reentrant and t.fsdp is not None and t.fsdp_version == 1 and t.lora_rank > 0
            and t.fsdp_lora_units == "separate" and not t.checkpoint_wrapper
            and checkpoint_wraps_unit(t.transformers_release))


def fsdp1_views(t: TrainingSpec) -> bool:
    """Whether the layers compute on views of FSDP1's unsharded flat parameter, which autocast does
    not cache. Under FSDP1 with ``use_orig_params=True`` a unit's parameters in forward are views of
    its flat parameter (torch 2.13 ``fsdp/_flat_param.py`` ``_use_unsharded_views`` L1949, the views of
    ``_get_unflat_views_aligned`` L1911-1947, set as plain tensors in forward), and autocast caches a
    cast only for a leaf that is not a view (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``:
    ``arg.requires_grad() && arg.is_leaf() && !arg.is_view()``). So a checkpointed layer's half
    weight copies die with the op that made them instead of living in the cache until forward ends
    (``cast_forward_only`` is 0). Found by the sampled grid: Llama FSDP1 grad-op, bf16-amp, full
    recompute, the output held to the next step: +2.32% at the loss before (mechanism 36)."""
    return t.fsdp is not None and t.fsdp_version == 1


def fsdp1_flat_gradient(st: States) -> int:
    """Bytes of a layer's gradients, on one rank, as FSDP1 makes its flat gradient: twice its
    unsharded gradients (``st.layer_grads_full``). Under FSDP1 with
    ``use_orig_params=True`` a unit's parameters in forward and backward are views of its unsharded
    flat parameter, made by one ``torch.split`` (torch 2.13 ``fsdp/_flat_param.py``
    ``_get_unflat_views_aligned`` L1911-1947, used by ``_use_unsharded_views`` L1949). Each view gets
    its own gradient (in the unsharded parameter's dtype: bf16 under ``bf16-mp``, fp32 under
    autocast, whose cast backward returns the fp32 view's gradient), and when the last of them
    exists autograd runs ``SplitWithSizesBackward0``, which concatenates them into the flat
    gradient (``torch.cat``) before ``AccumulateGrad`` makes it ``flat_param.grad``: the layer's
    gradients twice, at the end of its backward, with both it and the prefetched layer gathered.
    Found by trace: a 4-layer Llama (hidden 1024, vocabulary 1000) dp 2 fp32, peak at that ``cat``:
    -5.3% before."""
    return 2 * st.layer_grads_full   # the views' gradients and their concatenation


def fsdp1_root_flat_gradient(st: States) -> int:
    """Bytes of FSDP1's root flat gradient, on one rank: the root unit's unsharded gradients as one
    tensor (``st.root_flat``, the gathered dtype). The root's parameters (embeddings, final norm,
    head) are views of its flat parameter (``fsdp1_flat_gradient``), so at the end of backward,
    after the embedding's backward, ``SplitWithSizesBackward0`` concatenates their gradients
    (``torch.cat``) while every one of them (``st.root_views``: the head's, waiting since the start
    of backward, ``fsdp1_head_wait``, and the embedding's) is still referenced: the root's gradients
    twice, with the root gathered (moment ``fsdp1.root_flat_gradient``). For an untied head this is
    the end of backward's highest point, which no other moment had. Found by the sampled grid:
    Llama (untied, vocabulary 32000) FSDP1 grad-op dp 4, 2 x 512, full recompute with activation
    offloading: -2.39% before (mechanism 35)."""
    return st.root_flat


def fsdp1_unit_post_backward(t: TrainingSpec, elems: int) -> int:
    """Bytes an FSDP1 unit's post-backward hook allocates beside its flat gradient of ``elems`` elements
    (torch 2.13 ``fsdp/_runtime_utils.py`` ``_post_backward_hook`` L700-773, after ``_post_backward_reshard``):
    the flat gradient cast to the reduce dtype under ``bf16-mp`` (fp32, L754-762) and the new shard
    (``_get_reduce_scatter_tensors``: one rank's part in the reduce dtype); 0 without elements."""
    if not elems:
        return 0
    reduce = 4 if t.precision == "bf16-mp" else t.weight_bytes   # the reduce dtype: fp32, else the gradients'
    cast = block_of(t, elems * 4) if t.precision == "bf16-mp" else 0   # (elems,) fp32
    return cast + block_of(t, -(-elems // t.shard_group) * reduce)      # + the new shard


def fsdp1_root_post_backward(t: TrainingSpec, st: States) -> int:
    """Bytes FSDP1's root post-backward hook allocates beside the root's flat gradient
    (``st.root_flat``), on one rank: as a layer's (``fsdp1_post_backward``; torch 2.13
    ``fsdp/_runtime_utils.py`` ``_post_backward_hook`` L700-773), the flat gradient cast to the reduce
    dtype under ``bf16-mp`` (fp32, L754-762) and the new shard (``_get_reduce_scatter_tensors``:
    ``torch.empty_like(chunks[0])``, one rank's part in the reduce dtype). The hook runs on the root's
    ``AccumulateGrad`` after the cat of ``SplitWithSizesBackward0`` (``fsdp1_root_flat_gradient``), whose
    view gradients are freed by then. With no wrap policy (NO_WRAP) the root is the whole model. Found by
    trace: an untied Llama of 2 layers (hidden 512, vocabulary 8000), FSDP1 dp 2, NO_WRAP, bf16-mp:
    -5.1 % before (moment ``fsdp1.root_reduce_scatter``)."""
    return fsdp1_unit_post_backward(t, st.root_flat_elems)


def fsdp1_root_cast(t: TrainingSpec, st: States) -> int:
    """Bytes FSDP1's root post-backward hook asks for on the post-backward stream to cast the root's
    flat gradient to the reduce dtype under ``bf16-mp`` (bf16 gradients, fp32 reduction): one tensor of
    the root flat parameter's elements in fp32 (``st.root_flat_elems``), made before the new shard and
    freed when the hook returns (torch 2.13 ``fsdp/_runtime_utils.py`` ``_post_backward_hook`` L754-762:
    ``flat_param.grad.data = flat_param.grad.to(handle._reduce_dtype)``); 0 otherwise. Trace, Phi-3 cut
    to 2 layers, FSDP1 grad-op dp 2 bf16-mp: a 250.5 MiB block opens a segment of its own there."""
    return st.root_flat_elems * 4 if t.precision == "bf16-mp" else 0


def fsdp_no_sync(m: ModelSpec, t: TrainingSpec, st: States, stage: str) -> dict[str, int]:
    """FSDP accumulating unsharded gradients (``--grad-sync step``: every micro-batch but the last
    inside FSDP1's ``no_sync()`` or under FSDP2's ``set_requires_gradient_sync(False)``), the
    ``Quantities`` fields ``nosync_*``; none otherwise.

    * In the step's last micro-batch each unit's post-backward hook reduce-scatters its gradient,
      the accumulated unsharded one with this micro-batch's added in place, and keeps only the shard:
      FSDP1, torch 2.13 ``fsdp/_runtime_utils.py`` ``_reduce_grad`` L831-885 (``unsharded_grad =
      flat_param.grad.data; flat_param.grad = None``, the new shard from
      ``_get_reduce_scatter_tensors`` kept as ``_saved_grad_shard``); FSDP2,
      ``_fully_shard/_fsdp_param_group.py`` ``post_backward`` (``unsharded_accumulated_grad = None``
      once in the reduce-scatter's list; nothing is reduced while ``reduce_grads`` is off). So the layers already
      back-propagated hold shards at the bottom layer's and the embedding's backward, and after
      backward every gradient is a shard: the optimizer step sees shards (``grads`` counts the
      unsharded accumulation). Per layer and in all: the unsharded gradients less their shards
      (``model_states`` of the same setup synchronising every micro-batch).
    * Under SHARD_GRAD_OP a unit is not resharded in a backward that does not synchronise
      (``_should_free_in_backward`` L810-827: ``state._sync_gradients or`` a strategy that reshards
      after forward), so after every micro-batch but the last the layers and the root stay gathered
      until the next micro-batch's backward (FSDP2 reshards after every backward,
      ``reshard_after_backward``).
    Found by the sampled grid: Gemma-2 FSDP1 grad-op dp 4, 2 micro-batches, ``--grad-sync step``:
    +3.33% at the last micro-batch's embedding backward before (mechanism 33; FSDP2: +3.24%).
    Under torch's pipeline schedule no backward reduces: ``PipelineStage`` runs every micro-batch's
    with ``set_requires_gradient_sync(False)`` and reduce-scatters after the schedule (torch 2.13
    ``pipelining/stage.py`` ``backward_maybe_with_nosync`` L843-847, ``perform_reduce_grad``
    L1164-1191), so the last micro-batch's layers keep their unsharded gradients too (found by trace:
    llama-3.2-1b cut to 4 layers, --pp 2 --dp 2 --tp 2 --sequence-parallel --fsdp full, bf16-mp, the
    first stage's embedding backward, -2.5% before)."""
    if not t.accumulates_unsharded or t.shard_group < 2:
        return {}
    synced = model_states(m, replace(t, grad_sync="micro-batch"), stage)
    kept = fsdp_grad_op(t) and t.fsdp_version == 1
    # (none where the layers are no units of their own: NO_WRAP's root reduces them at the end, estimate.fsdp_wrap)
    reduced = 0 if pipeline_fsdp(t) or not st.layer_tensors else st.layer_grads - synced.layer_grads
    # FSDP2 under bf16-mp keeps the accumulated gradient in fp32 (``unsharded_accumulated_grad``) apart
    # from the parameter's ``.grad``, which each backward fills anew in bf16 and ``post_backward`` adds
    # and frees (torch 2.13 ``_fully_shard/_fsdp_param.py`` L802-821, ``_fsdp_param_group.py`` L603-612):
    # in every micro-batch a unit's new gradients live from their creation to its post-backward, the
    # root's (head, final norm) through the whole backward, as in a first micro-batch. Checked on
    # pipeline stages (found by trace: llama-3.2-1b cut to 8 layers, --pp 4 --dp 2 --fsdp full, b 1,
    # s 32, bf16-mp, the last stage -4.4% before, -0.1% after); a loop's --grad-sync step is left as it
    # was (there the same terms put a weights-dominant setup 4% over: not pinned down)
    mp_new = int(t.fsdp_version == 2 and t.precision == "bf16-mp" and pipeline_fsdp(t))
    return {"fsdp_accumulates": 1, "fsdp_mp_new": mp_new, "nosync_layer_reduce": reduced,
            "nosync_reduce": st.grads - synced.grads,
            "nosync_kept_layer": (st.layer_units_full or st.layer_params_full) if kept else 0,
            "nosync_kept_root": (st.root_full or st.emb_units_full + st.head_units_full) if kept else 0}


def fsdp1_unprefetched(t: TrainingSpec, lc: LayerCoefs) -> int:
    """FSDP1 with LoRA adapters in units of their own (peft's ``fsdp_auto_wrap_policy``): the index
    (forward order, ``LayerCoefs.transients``) of the layer's first adapted linear; -1 otherwise.
    ``BackwardPrefetch.BACKWARD_PRE`` prefetches the unit that ran its post-forward just before the
    current one (torch 2.13 ``fsdp/_runtime_utils.py`` ``_get_handle_to_prefetch`` L1597-1640,
    ``_exec_order_utils.py`` ``get_handle_to_backward_prefetch``: the previous entry of
    ``handles_post_forward_order``). The adapters' units finish their forward inside their layer's,
    so a decoder layer prefetches its own last adapter, each adapter the one before it, and the
    previous decoder layer is gathered only when the backward reaches the layer's first adapter
    (``lora_A`` of ``q_proj`` for peft's Llama targets: its pre-backward hook, before its own
    backward): the ops after that linear in forward order (attention's core, the MLP) run their
    backward with one decoder layer gathered. Found by trace:
    a 4-layer Llama (hidden 1024, vocabulary 1000) dp 2 bf16-amp LoRA r=8: +11.6% before."""
    if t.fsdp_version != 1 or not t.lora_rank or t.fsdp_lora_units != "separate" or t.zero_stage != 3:
        return -1
    return lc.first_adapter_op


def fsdp1_post_backward(t: TrainingSpec, st: States) -> int:
    """Bytes of a layer's gradients in FSDP1's post-backward hook, on one rank: its unsharded flat
    gradient (``st.layer_grads_full``, the compute dtype) and what the hook allocates beside it. torch 2.13
    ``fsdp/_runtime_utils.py`` ``_post_backward_hook`` L700-773: the layer is resharded first
    (``_post_backward_reshard``), then, when the gradient's dtype is not ``reduce_dtype``
    (``bf16-mp``: bf16 gradients, fp32 reduction), ``flat_param.grad.to(reduce_dtype)`` makes an
    fp32 copy of the whole flat gradient (L754-762) while the bf16 one stays referenced
    (``autograd_computed_grad``); ``_reduce_grad`` (L776-835) -> ``_get_reduce_scatter_tensors``
    (L838-850) allocates the new shard, ``torch.empty_like(chunks[0])``, one rank's part in the
    reduce dtype (``F.pad`` copies the flat gradient only when the world size does not divide it:
    not counted). The shard becomes ``_saved_grad_shard``; the copies are freed when the hook
    returns. FSDP2 copies every gradient into its reduce-scatter buffer instead and keeps it to the
    next layer's (``fsdp_rs_buf``). Found by trace: a 4-layer Llama (hidden 1024, vocabulary 1000)
    dp 4 bf16-mp, whose peak is this hook: -8.0% before."""
    if not st.layer_rs:
        return 0
    cast = st.layer_rs if t.precision == "bf16-mp" else 0   # the flat gradient in fp32 (reduce dtype)
    return st.layer_grads_full + cast + block_of(t, -(-st.layer_rs // t.shard_group))  # + the new shard


def fsdp1_hook_requests(t: TrainingSpec, st: States) -> tuple[tuple[int, int], ...]:
    """The tensors a layer's FSDP1 post-backward hook allocates beside its flat gradient, in order, each
    as (bytes requested, bytes charged): under ``bf16-mp`` the flat gradient's copy in the reduce dtype
    (fp32, ``flat_param.grad.to(reduce_dtype)``, torch 2.13 ``fsdp/_runtime_utils.py`` L754-762), then
    the new shard (``_get_reduce_scatter_tensors`` L890-904: ``torch.empty_like(chunks[0])``, the flat
    gradient's numel over the world size, reduce dtype). The charges are ``fsdp1_post_backward``'s terms
    (the estimate's allocated accounting, ``reserved._Replay.alloc``'s ``charge``); the requests are
    the tensors' own bytes: the flat parameter's padded elements (``fsdp1_flat_bytes``) when every
    parameter of the layer trains (its flat gradient is the whole flat parameter's), else the charges.
    The 2 MiB-rounded charges as requests opened 76+76+32 MiB post-backward segments where trace
    opens 50+26+26+64 (the wide 2-layer Llama FSDP1 dp 2 bf16-mp, tests/test_fsdp1_root_cast_replay.py)."""
    if not st.layer_rs:
        return ()
    world, mp = t.shard_group, t.precision == "bf16-mp"
    charges = (st.layer_rs if mp else 0, block_of(t, -(-st.layer_rs // world)))
    elem, reduce = fsdp1_elem(t), 4 if mp else fsdp1_elem(t)
    whole = st.layer_tensors and sum(block_of(t, x) for x in st.layer_tensors) == st.layer_grads_full
    n = fsdp1_flat_bytes(st.layer_tensors, elem, world) // elem if whole else 0   # the flat gradient's elements
    raw = (n * reduce if mp else 0, n // world * reduce) if n else charges
    return tuple((r, c) for r, c in zip(raw, charges) if c)


_INT_FIELDS = tuple(f.name for f in fields(Quantities) if f.type == "int")
_FLOAT_FIELDS = tuple(f.name for f in fields(Quantities) if f.type == "float")
_ints_of = operator.attrgetter(*_INT_FIELDS)
_floats_of = operator.attrgetter(*_FLOAT_FIELDS)


def gather(rows: list[tuple], index: np.ndarray) -> Quantities:
    """The quantities of many layouts as arrays: ``rows[index[i]]`` (from ``shape_quantities``) for
    layout ``i``, field by field (int64 byte counts, float64 per-token coefficients)."""
    ints = np.array([r[0] for r in rows], dtype=np.int64)[index]
    floats = np.array([r[1] for r in rows], dtype=np.float64)[index]
    arrays: dict[str, Any] = {k: ints[:, j] for j, k in enumerate(_INT_FIELDS)}
    arrays.update({k: floats[:, j] for j, k in enumerate(_FLOAT_FIELDS)})
    width = max(max((len(r[2]) for r in rows), default=0), 1)
    pad = (0.0, 0.0, 0.0, 0.0, 0.0, float(ALL_MOMENTS), 0.0, float(NEVER))
    tab = np.array([[tr + (0.0,) for tr in r[2]] + [pad] * (width - len(r[2])) for r in rows],
                   dtype=np.float64)[index]
    table = TransientTable(tab[:, :, 0], tab[:, :, 1], tab[:, :, 2], tab[:, :, 3].astype(np.int64),
                           tab[:, :, 7].astype(np.int64), tab[:, :, 4], tab[:, :, 5].astype(np.int64), tab[:, :, 6])
    return Quantities(**arrays, transients=table, detail=None)
