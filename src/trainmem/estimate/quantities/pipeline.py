"""Pipeline parallelism: the receive and send buffers, the micro-batches in flight, interleaved
1F1B's terms, the loss after a stage's forward, FSDP under a pipeline's stage."""
from __future__ import annotations

from typing import Any

from ...spec.model import ModelSpec
from ...spec.training import TrainingSpec
from ..layers import LayerCoefs, Policy
from ..schedules import in_flight_at_backwards, rank_order
from ..states import States, torch_pipeline
from .fsdp1 import fsdp1_views
from .model_facts import GPIPE_INFLIGHT, block_of


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
    (``reserved.driver._forward``); 0 elsewhere, under LoRA (frozen weights are not cached) and FSDP1's views
    (as ``cast_forward_only``), and under an interleaved schedule (not checked there: its replay
    walks (stage, micro-batch) pairs, ``reserved.driver._pipeline_pairs``). Found by trace: Qwen2.5-1.5B --pp 2 fp16-amp
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
