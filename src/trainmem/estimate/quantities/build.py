"""The builder: ``quantities(m, t, stage)`` (cached), ``shape_quantities`` over parallel shapes,
``clear_cache``, and ``_build`` with its field groups (loss, tied head, preference, derived layers,
communication, Gemini)."""
from __future__ import annotations

import operator
from dataclasses import fields, replace
from typing import Any

from ...errors import TrainmemError
from ...spec.frameworks import caps_hidden_not_logits, torchtune_loop_shifts_fp32_logits
from ...spec.model import ModelSpec
from ...spec.training import RECOMPUTE, TrainingSpec
from .. import unsloth
from ..cache import BoundedCache
from ..derived import (batch1 as derived_batch1, decoder_embedding_activations, decoder_embedding_temporaries,
                       decoder_ratio, grad_views as derived_grad_views, head_during_loss as derived_head_loss,
                       head_forward as derived_head_forward, moment_activations, outer as derived_outer,
                       outer_const as derived_outer_const, outer_per_sample as derived_outer_per_sample,
                       outer_ssq as derived_outer_ssq, point_at, regime as derived_regime,
                       top_forward as derived_top_forward, clear_lookups)
from ..gemini import model_gemini
from ..layers import LayerCoefs, Policy
from ..states import States, block_bytes, fsdp_grad_op, model_states, torch_pipeline
from .fsdp1 import fsdp1_views
from .fsdp_root import fsdp_buffers, fsdp_no_sync
from .head_grads import (chunk_head_grads, compiled_tied_grads, emb_accumulated, emb_upcast, head_dequant_bytes,
                         softcap_saved, tied_head_grad, tied_head_grad_raw, tied_replicated_grad, torchtune_cap_bytes, whole_model_compiled)
from .head_moments import (_autocast_copies, head_pre_cast, _head_replay_fields, bert_embeddings, bert_top_forward,
                           final_norm_backward, final_norm_forward, half_embedding_output, head_added_fields, head_weight_grad_half,
                           gpt2_embeddings, head_wgrad, held_embeddings, lookup_first,
                           per_linear_casts, per_linear_replay)
from .layer_moments import (_cast_first_free, _decoder_grads, _grads_above, _kept_and_redone, _layer_transients,
                            _split_outer, first_layer_unsaved, peft_offload_leaf, recompute_transients)
from .layer_terms import _stage_layer, litgpt_terms
from .loss import _chunked_nll_fields, fp32_logits_replay, loss_bytes, loss_mode
from .loss_kinds import LossBytes
from .model_facts import (_head_is_lora_target, classifier_width, input_bytes, is_lm, kv_cache, trainer_cp_inputs,
                          vlm_pixel_bytes)
from .optimizer_step import (_galore_fields, adafactor_loop, foreach_groups, oib_update_bytes, step_lingers,
                             tp_grad_redistributions)
from .outer import head_during_loss, outer_tensors
from .pipeline import _cast_stage_only, _inflight, _pipeline_terms, loss_after_stage_forward, receives_output_grad
from .record import Detail, Quantities, _floats_of, _ints_of
from .zero3_gather import deepspeed_leaf_held, z3_leaf_grads_held
from .zero_offload import deepspeed_offload_clone, deepspeed_offload_grad_buffer
from .zero_partition import deepspeed_buckets, deepspeed_flat_on_gpu, grads_from_wrap
from .zero_step import _deepspeed_fields, deepspeed_fp32_convert


def _embeddings_held(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> dict[str, float]:
    """The embedding outputs the base model holds in forward, unsaved (``held_embeddings``; GPT-2's
    token and position embeddings and their sum, ``gpt2_embeddings``), for the replay's ``_forward``.
    GPT-2's only without recomputation, where the replay makes the layers' forward in op order around
    them (``reserved.layer_forward._saved_and_casts``); a checkpointed layer's first forward is replayed
    as blocks made and freed together, where their placement is luck: against trace, FSDP1 dp 4 b8 s256
    full recompute +24.4 -> +0.7 %, b2 s1024 op +22.2 -> +1.3 %, but tests/test_half_loss_replay.py's
    b8 s256 op -0.0 -> -15.9 % (its step-2 forward's small blocks fill another segment than trace's).
    Also under full recomputation where the checkpointed first forward is written tensor by tensor
    (``lc.nograd_events``: ``nograd.gpt2_block``), which the replay makes around them in op order with
    the first layer's input (``reserved.driver._gpt2_dropout_input``): the grid's FSDP1 b8 s256 row +24.4 ->
    -0.02 %, b1 s1024 AdamW 8-bit 0.00 -> 0.00 % (-1.86 % written without them). With them BERT's
    embeddings module's tensors (``bert_embeddings``), which the replay makes where the bottom
    checkpoint keeps their output (``reserved.driver._bert_embeddings_saved``)."""
    written = t.recompute == "full" and bool(lc.nograd_events)    # (its first forward tensor by tensor)
    tok, pos, summed = gpt2_embeddings(m, t, pol) if t.recompute == "none" or written else (0.0, 0.0, 0.0)
    bert = bert_embeddings(m, t, pol)                             # BERT's embeddings module, tensor by tensor
    return dict(embeds_tok=tok or held_embeddings(m, t, pol, lc), embeds_pos=pos, embeds_sum_tok=summed,
                bert_emb_tok=bert[0], bert_mask_tok=bert[1], embeds_first=lookup_first(m, t))


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
    clear_lookups()


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
        cast_layer=cast_layer, cast_head=cast_head, cast_embed=cast_embed, cast_head_pre=head_pre_cast(st, cast_head), cast_checkpointed=cast_layer * checkpointed, head_wgrad=head_wgrad(m, t, cast_head),
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
        linear_replay=int(per_linear_replay(t)), linear_casts=int(per_linear_casts(t)), oib_mid=oib_mid, oib_end=oib_end, **_deepspeed_fields(m, t, st),
        **gemini_fields(m, t), step_adafactor=adafactor_loop(t, st),
        step_redistribute=tp_grad_redistributions(m, t), **_tied_fields(m, t, pol),
        emb_grad=emb_accumulated(m, t, stage), **head_added_fields(m, t, st, stage, oib), emb_upcast=emb_upcast(m, t, stage), softcap_saved=softcap_saved(m, loss.out, t) if head_here else 0,
        chunk_head_grads=chunk_head_grads(m, t, pol) if head_here else 0, ds_leaf_held=deepspeed_leaf_held(m, t, lc),
        transients=z3_leaf_grads_held(trans, deepspeed_leaf_held(m, t, lc)),
        fwd_temp=int(lc.fwd_const), fwd_temp_tok=lc.fwd_tok, fwd_scratch=int(lc.fwd_scratch), head_wgrad_half=head_weight_grad_half(m, t, cast_head - head_pre_cast(st, cast_head)),
        **_head_dequant_fields(m, t, head_here), **_head_replay_fields(m, t, pol, stage),
        **_graph_held(t, lc.graph_held, checkpointed, layers), **fsdp,
        **_derived_outer_fields(m, t, stage),
        lower_layers=lower, above_bottom=above_bottom, above_decoder_bottom=above_decoder_bottom,
        decoder_grads=_decoder_grads(m, t, st, layers),
        input_tok=input_bytes(m, t)[0], input_sample=input_bytes(m, t)[1], expandable=int(t.expandable_segments),
        ddp_side=int(t.ddp_init_stream == "side"), ddp_cap=int(round((t.ddp_bucket_mb or 0) * 2**20)),
        input_pixels=vlm_pixel_bytes(m, t),
        trainer_cp=trainer_cp_inputs(m, t), **_embeddings_held(m, t, pol, lc),
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
            "tied_compiled": tied[1] if compiled else 0, "tied_final": tied_head_grad(m, t) if compiled else 0,
            "tied_raw": 0 if compiled else tied_head_grad_raw(m, t)}


def _preference_fields(m: ModelSpec, t: TrainingSpec) -> dict[str, int]:
    """What the reserved replay reads of ``--loss logps`` (its backward) and ``--trainer dpo`` (the
    reference forward and metrics after the log-probs: ``estimate.preference``, ``reserved.loss_forward._dpo_after_logps``)."""
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
