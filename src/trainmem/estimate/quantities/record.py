"""The ``Quantities`` dataclass: every byte count the engine and the replay read (``Detail``: what the
breakdown needs beyond numbers), the backward transients of many layouts (``TransientTable``), and
``gather``: the quantities of many layouts as arrays."""
from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..elementwise import NEVER
from ..layers import ALL_MOMENTS, LayerCoefs
from ..states import States


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
    loss_tt_shift: int = 0  # 1: torchtune < 0.3's loop shifts the fp32 logits and keeps the copy (``reserved.loss_forward._torchtune_loop_loss``)
    loss_logps: int = 0    # 1: --loss logps, TRL's selective_log_softmax (reserved/ replays its backward)
    dpo_reference: int = 0  # --trainer dpo: 1 when a reference forward runs after the policy's log-probs
    dpo_metrics: int = 0    # --trainer dpo: 1, _compute_loss's metrics (both replayed by reserved/)
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
    #                             input, 1/that of the output, is a copy: reserved.fsdp._Fsdp.unshard)
    fsdp_root_sharded: int = 0  # of ``grads``: the root's sharded gradients (after the root's reduce-scatter)
    fsdp_root_rs: int = 0     # FSDP2: the root's reduce-scatter input, at its post-backward (end of backward)
    fsdp_root_last: int = 0   # ... and the root's last unsharded gradient, alive until the reduce returns
    fsdp2_root_raw: tuple = (0, 0)  # FSDP2: the root's all-gather output and reduce-scatter input as requested
    #                                 (unrounded bytes; reserved.fsdp.root_raw), 0 each where unknown
    fsdp1_post: int = 0       # FSDP1: a layer's gradients in its post-backward hook (fsdp1_post_backward)
    fsdp1_head_wait: int = 0  # FSDP1: the head's unsharded gradient, waiting for the root's flat gradient
    fsdp1_flat: int = 0       # FSDP1: a layer's gradients as its flat gradient is made (fsdp1_flat_gradient)
    fsdp1_init: tuple = ()    # FSDP1: the buffers its lazy init allocates and frees, in order (fsdp1_lazy_init)
    fsdp1_root_raw: int = 0   # FSDP1: the root's padded unsharded flat parameter as requested (fsdp1_flat_bytes)
    fsdp1_layer_raw: int = 0  # FSDP1: a layer's padded unsharded flat parameter as requested (fsdp1_flat_bytes)
    fsdp1_mp_shards: int = 0  # FSDP1 under bf16-mp: the ranks a unit is sharded over (its low-precision shard, reserved.fsdp._Fsdp.unshard)
    fsdp1_hook: tuple = ()    # FSDP1: a layer's post-backward hook's tensors, (request, charge) each (fsdp1_hook_requests)
    fsdp1_unlimited: int = 0  # 1: FSDP1 without its rate limiter (limit_all_gathers=False), units resharded (fsdp1_unlimited)
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
    #                               copied to the device before each all-gather: reserved.fsdp._Fsdp.unshard); 0 off
    fsdp1_held_inputs: int = 0    # 1 where FSDP1's reshard-only hooks hold every layer's input and its gradient
    #                               to the end of backward (reentrant checkpointing, frozen layer units)
    fsdp1_adapter_units: int = 0  # FSDP1, LoRA units of their own: a layer's adapter units (lora_A, lora_B each),
    #                               each unsharded and resharded through FSDP1's rate limiter (reserved.fsdp._Fsdp)
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
    embeds_pos: float = 0.0  # GPT-2: ... and its position embeddings' (1, s, h), per position (gpt2_embeddings)
    embeds_sum_tok: float = 0.0  # GPT-2: their sum, freed once the embeddings' dropout has made its output
    bert_emb_tok: float = 0.0  # BERT: each (b, s, h) tensor of its embeddings module, per token (bert_embeddings)
    bert_mask_tok: float = 0.0  # ... and its dropout's bool mask, per token (0: no dropout)
    embeds_first: int = 0  # 1: the bottom checkpoint's kept input, the lookup's output, made before the mask (lookup_first)
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
    step_redistribute: tuple = ()  # a foreach Adam's clones of a replicated TP gradient's chunk (``tp_grad_redistributions``)
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
    #                           bytes per gradient element (0 off ZeRO-3 on the device; ``reserved.zero_step._zero3_step``)
    ds_offload_steps: tuple = ()  # ZeRO-1/2 offloading the optimizer: each of rank 0's gradients' float64 norm
    #                               copy, inf/NaN check and fp32 copy for the host at the boundary, raw bytes of
    #                               each step's tensors (``deepspeed_offload_epilogue``, ``reserved.zero_step._offload_epilogue``)
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
    # (schedules.rank_order), which the allocator replay walks (reserved.driver._pipeline_pairs); () elsewhere
    pipe_order: tuple = ()
    # 1: torch's pipeline, the last stage of a tied model: its head is its own copy of the embedding table
    # (``states._Rank.holds``, listed before the layers), whose gradient the head's backward makes
    pipe_head_tied: int = 0
    # the head side's gradients its backward makes, one copy each (``head_added_grads``): beside an existing
    # ``.grad`` until AccumulateGrad adds them (a later micro-batch, ``zero_grad(set_to_none=False)``); read by
    # the head's own moments
    head_added: int = 0
    # ``head_added`` on torch's pipeline's tied last stage (its own table's gradient among them), else 0: read by
    # the layers' backward moments (``head_moments.head_added_fields``)
    pipe_tied_added: int = 0
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
    cast_head_pre: int = 0  # of ``cast_head``: a masked LM's transform dense's copy, made at that linear (``head_pre_cast``)
    # checkpointed layers' autocast weight copies: none saved. autocast caches the cast of a leaf that
    # requires grad until forward ends (``cast_forward_only``); a frozen one (LoRA's base weights) is
    # not cached (``autocast_mode.cpp`` ``cached_cast``), so its copy dies with the checkpointed op
    cast_checkpointed: int = 0
    # LoRA: what the first layer does not save (its input needs no gradient; ``first_layer_unsaved``)
    first_unsaved_tok: float = 0.0
    first_unsaved_sq: float = 0.0
    cast_first_free: int = 0  # ... and the half weight copies of its frozen linears on that input
    tied_replicated: int = 0  # DTensor TP: the tied embedding's whole-vocabulary gradient at its backward
    tied_raw: int = 0    # ``tied_grad`` as the tensor's own bytes, unrounded (head_grads.tied_head_grad_raw); 0 unknown
    emb_grad: int = 0      # an untied embedding's new gradient, added to the accumulated .grad (emb_accumulated)
    emb_upcast: int = 0    # ... and in a step's first micro-batch, beside its fp32 copy (FSDP2 bf16-mp, emb_upcast)
    chunk_head_grads: int = 0  # chunked output loss: the head's per-chunk weight gradients being summed
    # autocast, a trainable head: its weight gradient in the compute dtype (``head_weight_grad_half``)
    head_wgrad_half: int = 0
    # 1: the head's output linear has a bias, so its backward computes the input's gradient before the
    # weight's (``head_input_grad_first``; the replay's autograd workspace comes between them)
    head_input_first: int = 0
    head_side: tuple = ()  # bytes per token of each head-side saved tensor, in order (``head_side_tensors``)
    # a masked LM's head backward node by node: (input gradient bytes per token, saved places released) (``mlm_head_grad_chain``)
    head_chain: tuple = ()
    linear_replay: int = 0  # 1: the allocator replay makes each linear's blocks in turn (``per_linear_replay``)
    linear_casts: int = 0   # 1: ... only its autocast weight copies, in forward (``per_linear_casts``: FSDP2)
    # ... and the bytes per logit element a final soft-cap's tanh saves (part of the derived head side),
    # freed chunk by chunk before that chunk's head backward (``softcap_saved``)
    softcap_saved: int = 0
    expandable: int = 0  # 1: the allocator runs with expandable segments (TrainingSpec.expandable_segments)
    ddp_side: int = 0    # 1: DDP built on a side stream (TrainingSpec.ddp_init_stream, reserved.ddp._ddp_side_stream)
    ddp_cap: int = 0     # bytes of DDP's bucket_cap_mb where passed (TrainingSpec.ddp_bucket_mb); 0: torch's default
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
