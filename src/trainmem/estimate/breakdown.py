"""The peak moment as named components, and the phases, for one layout's report."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..report import Category
from ..report import Component, Phase
from ..spec.hardware import CUBLAS_WORKSPACE
from ..spec.training import TrainingSpec
from .moments import MIDDLE, PARTS, Moment, Tokens, _held_inputs, middle_index
from .quantities import HEAD_KEYS, PER_POSITION, Quantities, is_lm, loss_mode, loss_upcasts

MIDDLE_NAMES = frozenset(name for name, _k, _n in MIDDLE)  # FSDP's moments of the layers in between

# the categories as plain strings (an Enum attribute lookup costs a descriptor call per component)
PARAMETERS, BUFFERS, MASTER = Category.PARAMETERS.value, Category.BUFFERS.value, Category.MASTER_WEIGHTS.value
GRADIENTS, STATES = Category.GRADIENTS.value, Category.OPTIMIZER_STATES.value
ACTIVATIONS, LOGITS, INPUTS = Category.ACTIVATIONS.value, Category.LOGITS.value, Category.INPUTS.value
WORKSPACE, COMMUNICATION = Category.WORKSPACE.value, Category.COMMUNICATION.value
TEMPORARIES = Category.TEMPORARIES.value
HALF_NAMES = {"bf16-amp": "bf16", "fp16-amp": "fp16", "bf16": "bf16", "fp16": "fp16", "bf16-mp": "bf16"}


def phase_label(phase: str, micro: int, ga: int) -> str:
    """``forward``/``backward`` with the micro-step under accumulation (``.micro1``, ``.micro2-N``)."""
    if ga == 1 or phase not in ("forward", "backward"):
        return phase
    return f"{phase}.micro1" if micro == 0 else f"{phase}.micro2-{ga}"


def where_label(mo: Moment, q: Quantities, tk: Tokens) -> str:
    """Where a moment happens, with the layer index and the op whose backward runs."""
    middle = {name: middle_index(name, q.layers) for name, _k, _n in MIDDLE}  # FSDP's layers in between
    if mo.where not in ("layer.top", "layer.bottom", "layer.decoder_bottom", *middle):
        return mo.where
    i = {"layer.top": tk.top[0], "layer.bottom": tk.bottom[0]}.get(
        mo.where, tk.transient_index if mo.where in middle else tk.decoder_bottom[0])
    ops = q.detail.layer.transients + q.detail.layer.recompute_moments  # (quantities.layer_moments.recompute_transients)
    op = ops[i][0] if 0 <= i < len(ops) else "backward"
    index = {"layer.top": q.layers - 1, "layer.bottom": 0, **middle}.get(mo.where, q.lower_layers)
    return f"layer[{index}].{op or 'backward'}"


def phases(moments: list[Moment], totals: list[int], ends: list[tuple], ga: int) -> list[Phase]:
    """Each phase's allocated bytes at its end and its peak: the largest moment inside it, or the
    bytes it starts with (the previous phase's end) when nothing inside goes higher, as
    ``torch.cuda.max_memory_allocated()`` reads it after ``reset_peak_memory_stats()`` at the phase's
    start (zero_grad's peak is the step's end, before the gradients go). ``walk`` lists a phase's
    moments just before its end, so one pass pairs them."""
    out, i, n = [], 0, len(moments)
    start: Any = 0
    for phase, micro, step, alloc in ends:
        top = max(alloc, start)
        start = alloc
        while i < n:
            mo = moments[i]
            if mo.phase != phase or mo.micro != micro or mo.step != step:
                break
            if totals[i] > top:
                top = totals[i]
            i += 1
        label = phase if ga == 1 or phase not in ("forward", "backward") else phase_label(phase, micro, ga)
        out.append(Phase(label, step, alloc, top))
    return out


def _weights_formula(st: Any, t: TrainingSpec) -> str:
    """What the parameters component counts: the weights as stored, 4-bit linears by their library's layout."""
    formula = "sum over tensors of block(numel/tp [/dp under ZeRO-3] x bytes)"
    if t.gemini is not None:
        formula = "ColossalAI Gemini: block(chunk_size x 2) per fp16 chunk this rank owns (chunk i on rank i % dp)"
    if st.quantized and t.quantize_via == "torchao":
        formula += (f"; of it {st.quantized:,} B of torchao NF4Tensor linears: block(numel/2) uint8 codes + int8 "
                    "scaler per 64 + bf16 factor per 256 scalers (torchao < 0.3: per scaler) + bf16 mean + "
                    "16-entry bf16 table each")
    elif st.quantized:
        formula += (f"; of it {st.quantized:,} B of bitsandbytes {t.quantize} linears: block(numel/2) uint8 codes + "
                    "absmax per 64 (fp32, or uint8 + fp32 per 256 blocks with -dq) + a 16-entry fp32 code each")
    return formula


def components(q: Quantities, tk: Tokens, mo: Moment, t: TrainingSpec, n: int, nsq: int, m: Any,
               handle_ws: int = CUBLAS_WORKSPACE, kept: tuple = (0, 0, 0), pipe: tuple = (0, 0)) -> list[Component]:
    """The bytes alive at the peak moment ``mo``, by name and category (``handle_ws``: one cuBLAS
    handle's workspace; ``kept``: Transformer Engine's workspace and Megatron's global buffer,
    ``megatron_buffers.kept_buffers``, in the moment's workspace part; ``pipe``: the pipeline inputs and
    the step's batches Megatron keeps after backward, ``megatron_buffers.pipeline_inputs_kept`` and
    ``rerun_batches_kept``, in the activations and inputs of the optimizer step's moments)."""
    st = q.detail.states
    parts = dict(zip(PARTS, mo.parts))
    half = HALF_NAMES.get(t.precision, "fp32")
    wdt = "fp32" if t.weight_bytes == 4 else half
    out = [Component("parameters", PARAMETERS, st.weights, wdt if not st.quantized else None, _weights_formula(st, t),
                     True),
           Component("buffers", BUFFERS, st.buffers, None, "registered buffers (position ids, rotary, masks)",
                     True)]
    if st.master:
        out.append(Component("master_weights", MASTER, st.master, "fp32",
                             ("DeepSpeed ZeRO's fp32 clone of the rank's fp32 weight partition" if t.ds_fp32_clone
                              else "fp32 copy of half weights, sharded over the ZeRO group") if t.gemini is None else
                             "ColossalAI Gemini: block(chunk_size x 4) per fp32 chunk this rank owns", True))
    if parts["gradients"]:
        out.append(Component("gradients", GRADIENTS, parts["gradients"], "fp32" if t.main_grad_bytes else wdt,
                             "gradients alive at the peak [/dp under ZeRO-2/3]", True))
    if parts["optimizer_states"]:
        out.append(Component("optimizer_states", STATES, parts["optimizer_states"], None,
                             f"{t.optimizer} states of trainable tensors [/dp under ZeRO>=1]", True))
    held = _held_inputs_component(q, tk, mo, "fp32" if t.weight_bytes == 4 else half, pipe[0])  # (stream dtype)
    out += held
    held = sum(c.bytes for c in held)
    if parts["activations"] - held:
        # FSDP's moments of a layer below the top one (moments.MIDDLE): the layers up to it are alive
        alive = middle_index(mo.where, q.layers) + 1 if mo.where in MIDDLE_NAMES else None
        out += activations(q, tk, parts["activations"] - held, t, n, nsq, half, alive)
    if parts["logits"]:
        out += _logits(mo, m, half, loss_mode(m, t) if is_lm(m) else "")
    saved = int(pipe[1]) if mo.phase == "optimizer_step" else 0
    if saved:
        out.append(Component("inputs.megatron_saved_batches", INPUTS, saved, None, "Megatron 0.18's "
                             "RerunDataIterator: the step's micro-batches moved to the GPU in its saved dicts"))
    if parts["inputs"] - saved:  # (none yet at the model's load: DeepSpeed's whole-model load can be the peak)
        image = getattr(m, "is_image", False)  # pixel values in the weights' dtype, int64 labels
        speech = getattr(m, "is_speech_seq2seq", False)  # log-mel features in the weights' dtype
        out.append(Component("inputs", INPUTS, parts["inputs"] - saved, None if image or speech else "int64",
                             "pixel_values and labels" if image else "input_features and labels" if speech
                             else "input_ids and labels"))
    out += _workspaces(parts["workspace"], handle_ws, kept)
    comm = q.fixed - st.weights - st.buffers - st.master
    if comm:
        out.append(Component(q.detail.comm_name, COMMUNICATION, comm, None,
                             "DDP buckets / ZeRO-3 gathered layers / DeepSpeed ZeRO-3's gradient bucket buffer", True))
    if parts["communication"] and t.gemini is not None:  # quantities.build.gemini_fields
        out.append(Component("communication.gemini_chunks", COMMUNICATION, parts["communication"], wdt,
                             "ColossalAI Gemini: other ranks' fp16 chunks gathered for the layer in backward "
                             "(chunk_size x 2 each) + the gradient hook's gradient and grad / dp of its largest "
                             "parameter", True))
    elif parts["communication"] and t.fsdp is None:  # DeepSpeed ZeRO-1/2 (quantities.zero_partition.deepspeed_buckets)
        out.append(Component("communication.deepspeed_buckets", COMMUNICATION, parts["communication"], wdt,
                             f"DeepSpeed ZeRO-{t.zero}: {parts['communication'] // max(q.ds_bucket, 1)} gradient "
                             f"bucket buffer(s) of reduce_bucket_size {t.ds_reduce_bucket:,} elements, through backward",
                             True))
    elif parts["communication"]:
        out.append(Component("communication.fsdp_unsharded", COMMUNICATION, parts["communication"],
                             "bf16" if t.precision == "bf16-mp" else wdt,
                             "FSDP: the root unit gathered from forward to the end of backward, the layers "
                             "gathered and prefetched, the previous layer's reduce-scatter input", True))
    temp = parts["temporaries"]
    if mo.phase.startswith("forward") and mo.where == "cross_entropy" and q.cast_forward_only:
        # the forward moment's transient holds autocast's cache of the layers' half weight copies
        # (moments._micro_step), kept until forward ends under full recompute: named as what it is
        cast = min(q.cast_forward_only, temp)
        out.append(Component("activations.autocast_weight_copies.layers", ACTIVATIONS, cast, half,
                             "half copies of matmul weights autocast caches until forward ends (layers checkpointed)"))
        temp -= cast
    if temp > 0:
        out.append(Component(f"temporaries.{where_label(mo, q, tk)}", TEMPORARIES, temp, None,
                             "tensors alive only at the peak moment"))
    elif temp < 0:
        _net_released(out, temp)
    return out


def _workspaces(total: int, handle_ws: int, kept: tuple) -> list[Component]:
    """The moment's workspace part split by owner: PyTorch's cuBLAS handles, Transformer Engine's
    GEMM workspace and Megatron's global buffer (``kept``: ``megatron_buffers.kept_buffers``)."""
    te, buf, *rest = (int(x) for x in kept)
    uns, wbuf = (rest + [0, 0])[:2]
    out = []
    if total - te - buf - uns - wbuf:
        out.append(Component("workspace.cublas", WORKSPACE, total - te - buf - uns - wbuf, None,
                             f"{handle_ws:,} B per cuBLAS handle: forward thread and autograd thread", True))
    if te:
        out.append(Component("workspace.transformer_engine", WORKSPACE, te, "uint8",
                             "Transformer Engine's GEMM workspace (get_cublas_workspace: 32 MiB + 1 KiB on sm90+, "
                             "else 4 MiB), kept from the first forward", True))
    if buf:
        out.append(Component("workspace.megatron_global_buffer", WORKSPACE, buf, None,
                             "Megatron's _GLOBAL_MEMORY_BUFFER: local attention's baddbmm input [b*heads/tp, s, s] "
                             "and sequence-parallel all-gathers [s/cp, b, h], the larger per dtype, kept", True))
    if uns:
        out.append(Component("workspace.unsloth_gc_buffer", WORKSPACE, uns, None,
                             "Unsloth's gradient-checkpointing GPU buffer (unsloth_zoo GPU_BUFFERS): one offloaded "
                             "layer input (b, s, h), at least 2 MiB, kept; the recomputed layer's input", True))
    if wbuf:
        out.append(Component("workspace.unsloth_dequant_buffer", WORKSPACE, wbuf, None,
                             "Unsloth's global dequantization buffers (WEIGHT_BUFFER, ABSMAX_BUFFER): the largest "
                             "4-bit weight in half and its blocks' fp32 absmax, kept", True))
    return out


def _held_inputs_component(q: Quantities, tk: Tokens, mo: Moment, stream: str, pipe: int) -> list[Component]:
    """Layer inputs (and their gradients) the moment's activations hold outside the layers' saved
    tensors: Megatron's pipeline inputs after backward (``pipe``: ``megatron_buffers.pipeline_inputs_kept``,
    the optimizer step's only activations) or FSDP1's under reentrant checkpointing (:func:`_fsdp1_held`),
    in the residual stream's dtype ``stream``."""
    if pipe and mo.phase == "optimizer_step":
        return [Component("activations.pipeline_inputs_kept", ACTIVATIONS, int(pipe), stream,
                          "Megatron's pipeline: each model chunk's last received input [s, b, h] and its .grad, "
                          "kept by set_input_tensor after backward")]
    held = _fsdp1_held(q, tk, mo)
    if not held:
        return []
    return [Component("activations.fsdp1_held_inputs", ACTIVATIONS, held, stream,
                      "FSDP1 under reentrant checkpointing: the inputs of the layers above and their "
                      "gradients, held by the reshard-only hooks until backward ends")]


def _fsdp1_held(q: Quantities, tk: Tokens, mo: Moment) -> int:
    """The part of the moment's activations FSDP1's reshard-only hooks hold under reentrant
    checkpointing (``moments._held_inputs``; zero elsewhere)."""
    below = {"layer.bottom": 1, "embeddings.backward": 0}.get(mo.where)
    if mo.where in MIDDLE_NAMES:
        below = middle_index(mo.where, q.layers) + 1
    if below is None or not q.fsdp1_held_inputs:
        return 0
    return int(_held_inputs(q, tk.layers - tk.others_layers, below))


def _net_released(out: list, temp: int) -> None:
    """A layer's backward transient below zero (``moments.tokens``: the half weight copies its later
    linears released outweigh what the op holds) is taken off the activations listed, the autocast
    weight copies first, so that every component stays a non-negative amount and the sum the peak."""
    order = sorted((i for i, c in enumerate(out) if c.category == ACTIVATIONS and c.bytes > 0),
                   key=lambda i: (not out[i].name.startswith("activations.autocast_weight_copies"), -out[i].bytes))
    for i in order:
        take = min(out[i].bytes, -temp)
        out[i] = replace(out[i], bytes=out[i].bytes - take)
        temp += take
        if not temp:
            return


def activations(q: Quantities, tk: Tokens, at_peak: int, t: TrainingSpec, n: int, nsq: int,
                half: str, alive: int | None = None) -> list[Component]:
    """The activations alive at the peak by name where known (``_named_layers``; ``alive``: at FSDP's
    backward of a layer below the top one, the lowest layers alive), else what remains of them."""
    named = _named_layers(q, tk, at_peak, alive)
    if named is None:
        return [Component("activations.remaining", ACTIVATIONS, at_peak, None,
                          "activations of the layers not yet back-propagated at the peak")]
    complete, headless, alive = named
    listed = []
    for name, tok, sq in sorted(q.detail.outer):
        v = int(tok * (n // max(t.batch_size, 1)) if name in PER_POSITION else tok * n + sq * nsq)
        if v and (complete or name not in HEAD_KEYS):
            units = tk.head_units if name in HEAD_KEYS else tk.inflight  # (interleaved: one head micro-batch)
            listed.append(Component(f"activations.{name}", ACTIVATIONS, v * units, None,
                                    "embedding / head tensors saved for backward"))
    if tk.stage_out:
        listed.append(Component("activations.pipeline.stage_output", ACTIVATIONS, int(tk.stage_out), None,
                                "outputs of the rank's other stages' micro-batches in flight (fwd_cache)"))
    # under torch's pipeline schedule each micro-batch in flight has its own autocast copies (moments.tokens)
    per_forward = tk.inflight if q.pipe_batch else 1
    listed += _shared(q, tk, t, n, per_forward, half)
    if q.cast_head and complete and not headless:
        per_forward = 1 if q.pipe_head_once else per_forward
        listed.append(Component("activations.autocast_weight_copies.head", ACTIVATIONS, q.cast_head * per_forward,
                                half, "half copy of the LM head weight saved by its matmul"))
    per_rank = alive * tk.inflight  # the layers whose tensors are alive (all of them but at a middle moment)
    # a later pipeline stage's first layer saves the receive buffer, counted with the inputs
    received = int(q.detail.received_tok * n) * tk.fed
    # the first layer's half input under --half-embeddings (quantities.head_moments.half_embedding_output)
    half_first = int(q.detail.half_input_tok * n) * tk.fed
    if t.recompute == "full" and t.recompute_every > 1:
        listed.append(Component("activations.layers.kept", ACTIVATIONS, tk.layer * per_rank, None,
                                f"every {t.recompute_every}th layer keeps only its input, the others everything"))
    elif t.recompute in ("full", "op"):
        stream = "fp32" if t.weight_bytes == 4 else half  # the residual stream's dtype
        inputs = int(q.detail.input_tok * n) if t.recompute == "op" else tk.layer
        if inputs * per_rank - received:  # none with --offload-activations: the inputs are in CPU memory
            listed.append(Component("activations.layers.checkpointed_inputs", ACTIVATIONS,
                                    inputs * per_rank - received - half_first, stream,
                                    f"{t.recompute} recompute keeps each layer's input"
                                    + (" (the first layer's half)" if half_first else "")))
        if tk.layer - inputs:
            listed.append(Component("activations.layers.op_saved", ACTIVATIONS, (tk.layer - inputs) * per_rank, None,
                                    "outputs torchtitan's per-op policy saves: every other matmul, the SDPA kernel"))
    else:
        first = {}  # LoRA: what the first layer does not save (quantities.layer_moments.first_layer_unsaved)
        if q.first_unsaved_tok - q.detail.received_tok or q.first_unsaved_sq:
            for name, a, b in q.detail.layer.first_unsaved:
                # per token x key terms are the core attention's, which selective recompute does not keep
                sq = 0 if t.recompute == "selective" else b * nsq
                first[name] = first.get(name, 0) + int(a * n + sq) * tk.inflight
        left = received  # the layer's first op saves its input: taken off the first parts that hold it
        for name, a, b in q.detail.layer.parts:
            v = (int(a * n) + (0 if t.recompute == "selective" else int(b * nsq))) * per_rank - first.get(name, 0)
            take = min(left, max(v, 0))
            first[name], left = first.get(name, 0) + take, left - take
        for name, a, b in q.detail.layer.parts:
            v = int(a * n) + (0 if t.recompute == "selective" else int(b * nsq))
            if v * per_rank - first.get(name, 0):
                listed.append(Component(f"activations.layers.{name}", ACTIVATIONS, v * per_rank - first.get(name, 0), None,
                                        "saved per layer x layers on this rank x micro-batches in flight"))
    if q.cast_layer and not q.cast_checkpointed:
        listed.append(Component("activations.autocast_weight_copies.layers", ACTIVATIONS,
                                (q.cast_layer * alive - q.cast_first_free) * per_forward, half,
                                "half copies of matmul weights cast by autocast, saved for backward"))
    if q.gathered_layer:
        listed.append(Component("communication.fsdp_gathered_layers", COMMUNICATION,
                                q.gathered_layer * (q.layers * q.pipe_stages if q.pipe_batch else alive),
                                "bf16" if t.precision == "bf16-mp" else None,
                                "FSDP grad-op: every layer's weights gathered at its forward, kept until its "
                                "backward (reshard_after_forward=False)"))
    if q.ds_linear_kept:
        listed.append(Component("communication.deepspeed_linear_kept", COMMUNICATION, q.ds_linear_kept * alive, None,
                                "DeepSpeed ZeRO-3 with torch's F.linear: each layer's gathered matmul weights, "
                                "kept by autograd's saved views from its forward to its backward"))
    diff = at_peak - sum(c.bytes for c in listed)
    if diff:
        listed.append(Component("activations.rounding", ACTIVATIONS, diff, None, "integer rounding"))
    return listed


def _shared(q: Quantities, tk: Tokens, t: TrainingSpec, n: int, per_forward: int, half: str) -> list[Component]:
    """The embedding side's tensors shared by the micro-batch: a derived architecture's sized by the
    sequence alone or its square, and the patch embedding's half weight copy."""
    out = []
    pos = int(q.outer_rest_pos * (n // max(t.batch_size, 1))) - sum(
        int(tok * (n // max(t.batch_size, 1))) for name, tok, _ in q.detail.outer if name in PER_POSITION)
    if pos:  # derived architectures: tensors sized by the sequence alone (rotary tables, caches)
        out.append(Component("activations.derived.per_position", ACTIVATIONS, pos * tk.inflight, None,
                             "tensors sized by the sequence, shared by the micro-batch"))
    ssq = int(q.outer_rest_ssq * (n // max(t.batch_size, 1)) ** 2)
    if ssq:  # encoder-decoders: T5's (s, s) position buckets and its per-layer (1, heads, s, s) bias
        out.append(Component("activations.derived.per_position_squared", ACTIVATIONS, ssq * tk.inflight, None,
                             "tensors sized by the sequence squared, shared by the micro-batch"))
    per_sample = int(q.outer_rest_b * max(t.batch_size, 1) + q.outer_rest_const)
    if per_sample:  # derived encoder heads: a classifier's pooled output, DeBERTa's relative-position repeats
        out.append(Component("activations.derived.per_sample", ACTIVATIONS, per_sample * tk.inflight, None,
                             "tensors sized by the batch alone or by neither batch nor sequence"))
    if q.cast_embed:  # (quantities.head_moments._autocast_copies)
        out.append(Component("activations.autocast_weight_copies.embeddings", ACTIVATIONS, q.cast_embed * per_forward,
                             half, "half copy of the patch-embedding weight, saved by its convolution"))
    return out


def _named_layers(q: Quantities, tk: Tokens, at_peak: int, alive: int | None) -> tuple[bool, bool, int] | None:
    """Whether ``activations`` can name the tensors alive at the peak: (all of them, all but the
    head's half weight copy, how many layers' tensors), or None when only their total is known.
    All are alive at the end of forward and at the loss's backward; at the head's weight gradient
    its matmul has released the half copy (``quantities.head_moments.head_wgrad``); at the top layer's backward
    every layer's are; at FSDP's backward of a layer below it, the ``alive`` lowest layers'."""
    headless = bool(q.head_wgrad) and at_peak == tk.all_acts - q.cast_head
    complete = at_peak == tk.all_acts or headless
    own = tk.layers - tk.others_layers
    some = alive is not None and at_peak == own * alive // q.layers + tk.others_layers + tk.others_head + tk.outer_rest
    if not (complete or some or at_peak == tk.layers + tk.outer_rest):
        return None
    return complete, headless, alive if some else q.layers


def _logits(mo: Moment, m: Any, half: str, mode: str) -> list[Component]:
    held, kv, logp, graph = mo.logit_parts
    out = []
    if mode == "chunked-nll" and logp:  # TRL's chunked_nll saves no log-probabilities
        out.append(Component("logits.chunked_nll_saved", LOGITS, logp, None,
                             "TRL's chunked_nll: the labelled tokens' hidden states gathered to the front, their "
                             "labels and the gather's int64 indices, kept for the checkpointed chunks"))
        logp = 0
    if mode == "unsloth" and logp:  # Unsloth's fused loss keeps the input gradient it computed in forward
        out.append(Component("logits.fused_loss_gradients", LOGITS, logp, None,
                             "Unsloth's fused loss: the head input's gradient (b, s, h), computed in forward "
                             "chunk by chunk and saved for backward"))
        logp = 0
    if mode == "fused" and logp:  # Liger keeps the gradients it computed in forward, not log-probabilities
        out.append(Component("logits.fused_loss_gradients", LOGITS, logp, None,
                             "fused linear cross-entropy: input and head-weight gradients and the fp32 loss per "
                             "token, computed in forward and saved for backward"))
        logp = 0
    if held:
        out.append(Component("logits.logits", LOGITS, held, half,
                             "b x s x vocab / tp in the matmul dtype: the model output's (and the previous "
                             "step's while the loop keeps it)"))
    if logp:
        out.append(Component("logits.log_probs", LOGITS, logp, "fp32" if loss_upcasts(m) and mode != "half" else None,
                             "log-softmax saved by cross-entropy (and nll_loss's fp32 copy under autocast)"))
    if kv:
        out.append(Component("activations.kv_cache", ACTIVATIONS, kv, None,
                             "KV-cache tensors the model output holds beyond what autograd saves (the fp32 keys "
                             "under autocast; an older release's own keys and values where attention copies "
                             "them), and the layers' whole cache once their backward has run"))
    if graph:
        out.append(Component("activations.bnb_matmul4bit_inputs", ACTIVATIONS, graph, half,
                             "inputs of the 4-bit linears that bitsandbytes < 0.43.2 MatMul4Bit keeps on its "
                             "autograd node (ctx.tensors), alive until the graph is freed: the other layers' "
                             "during backward, the previous micro-batch's while the loop keeps its loss"))
    return out
