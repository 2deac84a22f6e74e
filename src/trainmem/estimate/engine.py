"""The default method (``--method trainmem``): component-by-component memory of one GPU.

It combines
  * model states per tensor with allocator rounding (``states.py``),
  * per-layer saved activations op by op in the dtype PyTorch stores (``layers.py``),
  * embeddings, final norm, LM head and cross-entropy (HF ``ForCausalLMLoss``: ``logits.float()``
    then ``F.cross_entropy``; fp32 log-probabilities saved; gradients of the log-probabilities and
    of the logits at the start of backward),
  * the autocast cache of half-precision weight copies (kept alive by the matmuls that saved them),
  * cuBLAS workspaces (8,519,680 B per handle: one for the forward thread, one for autograd's),
  * DDP buckets / ZeRO-3 gathered layers, pipeline in-flight micro-batches (1F1B),
and walks the training step phase by phase (first step and steady state) to find the peak.
"""
from __future__ import annotations

from functools import lru_cache

from ..report import Component, MemoryReport, Phase
from ..spec.model import ModelSpec
from ..spec.training import TrainingSpec
from .layers import LayerKey, layer_coefficients, Policy
from .states import States, model_states, block_bytes, default_lora_targets

from ..spec.hardware import CUBLAS_WORKSPACE  # 8,519,680 B per handle
F32 = 4


def _act_impl(m: ModelSpec) -> str:
    cfg = m.config or {}
    a = str(cfg.get("activation_function") or cfg.get("hidden_act") or "gelu").lower()
    if m.family == "nanogpt":
        return "gelu"  # nn.GELU(): fused
    return "gelu_new" if a == "gelu_new" else "gelu"


def _layer_key(m: ModelSpec, t: TrainingSpec) -> LayerKey:
    lora = ()
    if t.lora_rank:
        targets = set(t.lora_targets or default_lora_targets(m))
        lora = tuple((p.module, t.lora_rank, 1) for p in m.parameter_tensors()
                     if p.layer == 0 and p.is_matmul and p.module in targets)
    attn = t.attention
    return LayerKey(m.family, _act_impl(m), t.precision, attn, t.dropout, m.hidden_dropout,
                    m.attention_dropout, m.hidden_size, m.ffn_size, m.q_size, m.kv_size, m.num_heads,
                    m.num_kv_heads, m.head_dim, t.tp, t.sequence_parallel, m.num_experts,
                    m.experts_top_k, m.pre_norm, lora, _kv_cache(m, t))


def _kv_cache(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether the forward builds a KV cache: transformers' decoder models create a
    ``DynamicCache`` whenever ``config.use_cache`` (default True) is set, in training too, except
    under gradient checkpointing (``merge_with_config_defaults`` turns it off); its ``torch.cat``
    copies of each layer's keys and values are what attention then consumes. Megatron-style
    tensor/pipeline/context parallel code has no such cache."""
    if t.recompute == "full" or t.tp * t.pp * t.cp > 1:
        return False
    return _kv_cache_model(m)


def _kv_cache_model(m: ModelSpec) -> bool:
    """The model side of ``_kv_cache``: a transformers decoder with ``use_cache`` on."""
    if m.head != "causal-lm" or m.family == "nanogpt":
        return False
    return bool((m.config or {}).get("use_cache", True))


def _tied_head_grad(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of the LM head's gradient contribution to a tied input embedding.

    The head and the embedding feed one ``AccumulateGrad`` node, so autograd's input buffer holds
    the head's gradient (the weight's dtype) from the head's backward until the embedding's, when
    ``InputBuffer::accumulate`` adds the embedding's gradient out of place (the head's gradient is
    a transposed view whose storage is shared, so it cannot be reused): head part, embedding part
    and their sum are alive together, then the sum becomes ``.grad``."""
    if not (m.tied_embeddings and m.head in ("causal-lm", "masked-lm")) or t.lora_rank or t.pp > 1:
        return 0
    return _embedding_block(m, t.tp, t.weight_bytes)


@lru_cache(maxsize=1024)
def _embedding_block(m: ModelSpec, tp: int, nbytes: int) -> int:
    emb = next((p for p in m.parameter_tensors() if p.role == "embedding"), None)
    return block_bytes(-(-emb.numel // tp) * nbytes) if emb is not None else 0


def _embedding_and_head(m: ModelSpec, t: TrainingSpec, pol: Policy, n: int, stage: str) -> dict[str, int]:
    """Activations outside the layers (bytes), by name, for one micro-batch on this rank."""
    h, v, tp = m.hidden_size, m.vocab_size, t.tp
    sp = tp if t.sequence_parallel else 1
    drop = t.dropout
    out: dict[str, int] = {}
    first = t.pp == 1 or stage == "first"
    last = t.pp == 1 or stage == "last"
    if first:
        out["inputs_embeds"] = 0
        if m.family in ("gpt2", "nanogpt", "roberta-prenorm") and drop and m.hidden_dropout > 0:
            out["embeddings.dropout.mask"] = n * h // sp
        if m.family == "bert":
            out["embeddings.LayerNorm"] = n * h * pol.stream // sp + 8 * n // sp
            if drop and m.hidden_dropout > 0:
                out["embeddings.dropout.mask"] = n * h // sp
        if m.position == "rotary":
            # cos and sin (b, s, head_dim) in the residual dtype, shared by every layer's rotary mul
            out["rotary.cos_sin"] = 2 * n * m.head_dim * pol.stream
        if t.recompute == "full" and t.attention == "eager" and m.head == "causal-lm" and m.family != "nanogpt":
            # transformers' eager attention adds a 4-D float causal mask (b, 1, s, s) in the
            # embeddings' dtype; checkpointed layers keep it as an input until the first layer's
            # backward (without recompute it dies with the base model's forward)
            out["causal_mask"] = n * t.seq_len * pol.stream
    if not last:
        return out
    # the last layer's output / final norm feeding the head
    if m.final_norm and m.family != "bert":
        if m.norm == "rmsnorm":
            out["final_norm"] = n * h * (F32 + pol.stream) // sp + 4 * n // sp if pol.stream == 4 else \
                n * h * (F32 + 2) // sp + 4 * n // sp
        else:
            out["final_norm"] = n * h * pol.stream // sp + 8 * n // sp
    if m.head == "causal-lm" or m.head == "masked-lm":
        if m.head == "masked-lm":
            # transform: dense (saves its input) + activation + LayerNorm, then the decoder
            out["mlm.transform"] = n * h * (pol.half + pol.half + pol.stream) + 8 * n
            out["lm_head.input"] = n * h * pol.half
        else:
            # lm_head saves its input: a half cast under autocast, else the final norm output itself
            out["lm_head.input"] = n * h * pol.half if (pol.amp or m.norm == "rmsnorm" and not pol.amp
                                                        and pol.stream == 2) else n * h * pol.stream
    elif m.head == "seq-cls":
        # BERT pooler takes hidden[:, 0]; the view keeps the last layer's output storage alive
        out["pooler.input"] = n * h * pol.stream if m.family == "bert" else n * h * pol.half
    return out


def _logits(m: ModelSpec, t: TrainingSpec, pol: Policy, n: int, b: int) -> tuple[int, int, int, int]:
    """(held logits, saved by the loss, forward transient, backward transient) in bytes.

    The head returns logits in the matmul dtype; the training loop holds them through backward
    (``outputs = model(...)``) unless ``keep_logits`` is off (``loss = model(...).loss``).

    * Hugging Face ``ForCausalLMLoss`` upcasts first (``logits.float()``: an fp32 copy freed after
      the loss); ``cross_entropy`` -> ``log_softmax(x, dtype=fp32)`` saves fp32 log-probabilities.
      At the start of backward ``nll_loss_backward`` and ``_log_softmax_backward_data`` each make an
      fp32 tensor of the logits' size, alive together with the saved log-probabilities.
    * ``F.cross_entropy`` on half logits under autocast (nanoGPT, transformers' masked-LM heads):
      ``cross_entropy_loss`` has no autocast rule and calls ``log_softmax`` with the input's dtype,
      so the log-probabilities stay half; ``nll_loss`` (autocast fp32 list) casts them to an fp32
      copy that it saves. Backward starts with one fp32 gradient (then a half one). This is seed
      001's "+4 N_l" at the peak. In pure half precision the same loss is half throughout.
    * Under ``torch.compile`` inductor fuses the loss and its backward: no fp32 copy in forward and
      one fp32 logits gradient in backward.

    Vocabulary-parallel (TP) divides all of them by ``tp``. Chunked cross-entropy (``loss_chunks``
    > 1, as fused linear-cross-entropy kernels do) leaves one chunk of ceil(n / chunks) tokens of
    each of these tensors alive at a time.
    """
    if m.head not in ("causal-lm", "masked-lm"):
        k = m.num_labels
        return (b * k * pol.half if t.keep_logits else 0), b * k * F32, b * k * F32, 2 * b * k * F32
    nl = -(-n // t.loss_chunks) * m.vocab_size // t.tp
    held = nl * pol.half if t.keep_logits else 0
    if t.compile:
        return held, nl * F32, 0, nl * F32
    if not _loss_upcasts(m) and pol.half != F32:
        # the loss sees the logits in the matmul dtype (masked-LM heads, nanoGPT)
        if pol.amp:
            return held, nl * (pol.half + F32), 0, nl * F32
        # pure half: log_softmax, nll_loss and both gradients stay half
        return held, nl * pol.half, 0, 2 * nl * pol.half
    fwd = nl * F32 if pol.half != F32 else 0  # the .float() copy alive while log_softmax runs
    return held, nl * F32, fwd, 2 * nl * F32


def _output_logits(m: ModelSpec, t: TrainingSpec, pol: Policy, n: int, b: int) -> int:
    """Bytes of the logits the head returns (one loss chunk of them with chunked cross-entropy):
    alive while the loss is computed, kept or not."""
    if m.head not in ("causal-lm", "masked-lm"):
        return b * m.num_labels * pol.half
    return -(-n // t.loss_chunks) * m.vocab_size // t.tp * pol.half


def _loss_upcasts(m: ModelSpec) -> bool:
    """Whether the model's loss upcasts half logits to fp32 first.

    transformers' causal-LM heads call ``ForCausalLMLoss`` (``logits.float()``). Its masked-LM heads
    (``BertForMaskedLM``, ``XLMRobertaXLForMaskedLM``) call ``CrossEntropyLoss()`` on the logits
    as they are, and so does nanoGPT (``F.cross_entropy``): in pure bf16 the log-probabilities and
    both loss gradients stay bf16; under autocast ``cross_entropy`` has no autocast rule, so
    ``log_softmax`` keeps the half dtype and ``nll_loss`` (fp32 list) saves an fp32 copy.
    """
    return m.head == "causal-lm" and m.family != "nanogpt"


def _inputs(m: ModelSpec, n: int, b: int) -> int:
    """input_ids and labels as int64 (8 B each element)."""
    labels = b if m.head == "seq-cls" else n
    return block_bytes(n * 8) + block_bytes(labels * 8)


def _tmp_copies(t: TrainingSpec, per_parameter: bool) -> int | None:
    """State-sized temporaries one optimizer step makes per tensor (None: the whole group's worth)."""
    if t.optimizer == "sgd" or t.impl == "fused" or t.optimizer == "adamw-8bit" or t.offload_optimizer:
        return 0
    if t.impl == "foreach":
        return 1 if per_parameter else None
    return 2


def step_temporaries(t: TrainingSpec, st: States) -> int:
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
    k = _tmp_copies(t, t.optimizer_in_backward)
    if k is None:
        return st.foreach_group
    return k * block_bytes(st.largest_param)


def _oib_update_bytes(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """Optimizer-in-backward: the gradient of one parameter plus its update's temporaries, alive
    together inside its post-accumulate-grad hook (the gradient is freed right after). Returns the
    largest such amount among tensors updated while activations are alive (all but the input
    embeddings, e.g. an untied LM head right after the loss) and among all (the embeddings, whose
    gradients complete last). Sharded (ZeRO/FSDP2) tensors update their shard."""
    k = _tmp_copies(t, True) or 0
    half_master = t.precision in ("bf16", "fp16") and (t.zero_stage >= 1 or t.distributed_optimizer)
    sb = 4 if (t.weight_bytes == 4 or half_master) else t.weight_bytes
    gb = 4 if t.distributed_optimizer else t.weight_bytes
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
        return block_bytes(n * gb) + k * block_bytes(n * sb)
    return one(n_mid), one(n_all)


def estimate(m: ModelSpec, t: TrainingSpec) -> MemoryReport:
    """Estimate one GPU's training memory for model ``m`` trained as ``t`` (worst pipeline stage)."""
    if t.pp > 1:
        a = _estimate_stage(m, t, "first")
        z = _estimate_stage(m, t, "last")
        return a if a.peak_allocated >= z.peak_allocated else z
    return _estimate_stage(m, t, "first")


def _estimate_stage(m: ModelSpec, t: TrainingSpec, stage: str) -> MemoryReport:
    pol = Policy.of(t.precision)
    st: States = model_states(m, t, stage)
    b = t.batch_size
    s_local = t.seq_len // t.cp
    n = b * s_local
    nsq = b * s_local * t.seq_len  # query tokens on this rank x keys (context parallel sees all keys)
    layers = m.num_layers // t.pp
    inflight = 1
    if t.pp > 1 and stage == "first":
        inflight = min(t.pp, t.grad_accum) if t.num_microbatches_in_flight is None else t.num_microbatches_in_flight

    lc = layer_coefficients(_layer_key(m, t))
    per_layer_full = lc.bytes(n, nsq)
    # gradient bytes per weight element of a layer: the later linears' gradients exist while an
    # op's backward runs (none with optimizer-in-backward: each is freed in its hook)
    gpw = st.layer_grads / lc.weights if (lc.weights and not t.optimizer_in_backward) else 0.0
    tname, ttrans, tgrads = lc.transient_parts(n, nsq, gpw)
    sp = t.tp if t.sequence_parallel else 1
    layer_input = n * m.hidden_size * pol.stream // sp
    if t.recompute == "full":
        per_layer = layer_input
        recompute_extra = per_layer_full  # one layer re-run during backward
    elif t.recompute == "selective":
        per_layer = int(lc.tok * n)
        recompute_extra = int(lc.sq * nsq)
    else:
        per_layer = per_layer_full
        recompute_extra = 0

    eh = _embedding_and_head(m, t, pol, n, stage)
    held, logp, ce_fwd, ce_bwd = (0, 0, 0, 0)
    out_logits = 0
    if t.pp == 1 or stage == "last":
        held, logp, ce_fwd, ce_bwd = _logits(m, t, pol, n, b)
        out_logits = _output_logits(m, t, pol, n, b)
    # autocast casts each fp32 leaf weight once per forward and caches it; the matmuls save the
    # copies for backward. Sharded ZeRO-3/FSDP parameters are gathered per layer in the compute
    # dtype (FSDP MixedPrecision) and resharded after use, so no cast copies outlive their layer.
    sharded = t.zero_stage == 3 and t.shard_group > 1
    cache_layer = st.layer_matmul_half if pol.amp and not sharded else 0
    cache_head = st.head_matmul_half if pol.amp and not sharded and (t.pp == 1 or stage == "last") else 0

    layer_acts = per_layer * layers * inflight
    # tensors the model output holds without autograd saving them (the fp32 KV-cache keys under
    # autocast): alive while the forward computes the loss, and as long as the loop keeps the output
    kv_held = int(lc.held * n) * layers * inflight
    # the whole KV cache: once a layer's backward has released what attention saved, the cache of a
    # kept output still references it
    kv_layer_saved = int(lc.cache * n) - int(lc.held * n)
    kv_all = kv_held + kv_layer_saved * layers * inflight
    tied_g = _tied_head_grad(m, t)
    inputs = _inputs(m, n, b)
    ws = CUBLAS_WORKSPACE
    gacc = t.grad_accum

    # persistent pieces that exist from load
    comm, comm_name = 0, ""
    if t.dp > 1 and t.zero_stage == 0 and not t.distributed_optimizer and st.trainable:
        comm, comm_name = st.grads, "communication.ddp_buckets"  # flat buckets, gradient_as_bucket_view=False
    elif t.zero_stage == 3 and t.shard_group > 1:
        comm, comm_name = 2 * st.layer_params_full, "communication.zero3_gathered_layers"  # current + prefetched
    grads_persistent = t.distributed_optimizer  # Megatron main-grad buffers live from model wrap

    opt_tmp = step_temporaries(t, st)
    # optimizer-in-backward: one parameter's gradient + its update's temporaries, while activations
    # are alive (any tensor but the input embeddings) and at the end of backward (the embeddings)
    oib_mid, oib_end = _oib_update_bytes(m, t, st) if t.optimizer_in_backward else (0, 0)

    states = st.optimizer + st.step_tensors
    grads = 0 if t.optimizer_in_backward else st.grads
    layer_g = 0 if t.optimizer_in_backward else st.layer_grads
    head_g = 0 if t.optimizer_in_backward else st.head_grads
    head_keys = ("final_norm", "lm_head.input", "mlm.transform", "pooler.input")
    eh_head = sum(v for k, v in eh.items() if k in head_keys)
    eh_rest = sum(v for k, v in eh.items() if k not in head_keys) * inflight
    static = {"parameters": st.weights, "buffers": st.buffers, "master_weights": st.master, comm_name or "comm": comm}
    acts_layers = layer_acts + cache_layer * layers
    # Under full recompute the checkpointed layers save no weight casts for backward: autocast's
    # cache holds them until autocast exits (end of forward); backward re-casts one layer at a time.
    fwd_cache_only = cache_layer * layers if t.recompute == "full" else 0
    if fwd_cache_only:
        acts_layers = layer_acts
        recompute_extra += cache_layer

    # Moments of the step: (phase, step, where, parts) with parts in the order of KEYS; the
    # report's peak is the largest moment and its breakdown becomes the components. The "logits"
    # part is itself (logits, KV-cache keys, log-probabilities), kept apart in ``ldet``.
    KEYS = ("gradients", "optimizer_states", "inputs", "workspace", "activations", "logits", "temporaries")
    fixed = st.weights + st.buffers + st.master + comm
    moments: list[tuple[str, int, str, tuple[int, ...]]] = []
    ldet: list[tuple[int, int, int]] = []
    ends: list[tuple[str, int, int]] = []
    phase_peak: dict[tuple[str, int], int] = {}
    best_total, best_i = -1, 0

    def mom(phase: str, step: int, where: str, parts: tuple[int, ...], ld: tuple[int, int, int] = (0, 0, 0)
            ) -> None:
        nonlocal best_total, best_i
        parts = parts[:5] + (sum(ld),) + parts[5:]
        tot = fixed + sum(parts)
        moments.append((phase, step, where, parts))
        ldet.append(ld)
        key = (phase, step)
        if tot > phase_peak.get(key, -1):
            phase_peak[key] = tot
        if tot > best_total:
            best_total, best_i = tot, len(moments) - 1

    g_loaded = grads if grads_persistent else 0
    mom("model_loaded", 0, "model.to(device)", (g_loaded, 0, 0, 0, 0, 0))
    ends.append(("model_loaded", 0, fixed + g_loaded))
    all_acts = acts_layers + eh_rest + eh_head * inflight + cache_head
    acts_after_head = acts_layers + eh_rest
    acts_low = acts_layers // layers + eh_rest
    tmp = max(0, ttrans - tgrads + recompute_extra)
    layer_tag_top = f"layer[{layers - 1}].{tname or 'backward'}"
    layer_tag_low = f"layer[0].{tname or 'backward'}"
    oib = t.optimizer_in_backward
    grads_end = 0 if oib else grads
    # The loop's reference to the model output (``outputs = model(...)``, keep_logits) holds its
    # logits (and KV cache) until the next forward has returned and the name is rebound.
    kh, kkv = held, (kv_held if t.keep_logits else 0)
    kall = kv_all if t.keep_logits else 0
    keep = (kh, kkv, 0)                                   # the layers' saved cache tensors still alive
    keep_low = (kh, kkv + (kv_layer_saved * (layers - 1) * inflight if t.keep_logits else 0), 0)
    keep_end = (kh, kall, 0)                              # after backward: the whole cache
    for step in (1, 2):
        opt_now = states if step > 1 else 0
        ws_now = 0 if step == 1 else 2 * ws
        for micro in range(min(gacc, 2)):  # micro-steps 2..N repeat micro-step 2
            tag = "" if gacc == 1 else (".micro1" if micro == 0 else f".micro2-{gacc}")
            fwd, bwd = "forward" + tag, "backward" + tag
            g0 = grads if (micro > 0 or grads_persistent) else 0
            ws_f = max(ws_now, ws)
            prev = (kh, kall) if (step > 1 or micro > 0) else (0, 0)
            # while the loss is computed, this forward's logits and KV cache exist too
            mom(fwd, step, "cross_entropy", (g0, opt_now, inputs, ws_f, all_acts, ce_fwd + fwd_cache_only),
                (prev[0] + out_logits, prev[1] + kv_held, logp))
            ends.append((fwd, step, fixed + g0 + opt_now + inputs + ws_f + all_acts + kh + kkv + logp))
            ws_b = 2 * ws
            mom(bwd, step, "cross_entropy.backward", (g0, opt_now, inputs, ws_b, all_acts, ce_bwd), (kh, kkv, logp))
            g_lyr = 0 if g0 else tgrads  # the later linears' gradients of the layer in backward
            g_head = g0 + (0 if g0 else head_g) + g_lyr
            opt_mid = states if (opt_now == 0 and oib) else opt_now  # states appear in the first backward
            # a tied head's gradient waits in autograd's input buffer until the embedding's backward
            t_mid = max(tmp, oib_mid) + tied_g
            mom(bwd, step, layer_tag_top, (g_head, opt_mid, inputs, ws_b, acts_after_head, t_mid), keep)
            if layers > 1:
                g_low = g0 + (0 if g0 else head_g + (layers - 1) * layer_g) + g_lyr
                mom(bwd, step, layer_tag_low, (g_low, opt_mid, inputs, ws_b, acts_low, t_mid), keep_low)
            if tied_g:
                # the embedding's gradient and the out-of-place sum join the head's part; the sum
                # then becomes .grad (or is added into an existing one)
                t_emb = 2 * tied_g + (tied_g if (g0 or oib) else 0)
                mom(bwd, step, "embeddings.backward", (grads_end, opt_mid, inputs, ws_b, 0, t_emb), keep_end)
            opt_end = states if (oib or opt_now) else 0
            mom(bwd, step, "backward.end", (grads_end, opt_end, inputs, ws_b, 0, oib_end), keep_end)
            ends.append((bwd, step, fixed + grads_end + opt_end + inputs + ws_b + kh + kall))
            ws_now = ws_b
            opt_now = opt_end
        after = fixed + grads_end + states + inputs + 2 * ws + kh + kall
        if not oib:
            mom("optimizer_step", step, "optimizer.step", (grads_end, states, inputs, 2 * ws, 0, opt_tmp),
                keep_end)
            ends.append(("optimizer_step", step, after))
        ends.append(("zero_grad", step, after - grads_end + (grads if grads_persistent else 0)))

    phases = [Phase(name, step, alloc, max(alloc, phase_peak.get((name, step), alloc)))
              for name, step, alloc in ends]
    peak_m = moments[best_i]
    peak_ld = ldet[best_i]
    peak = best_total
    bd = dict(zip(KEYS, peak_m[3]))

    half_name = {"bf16-amp": "bf16", "fp16-amp": "fp16", "bf16": "bf16", "fp16": "fp16"}.get(t.precision, "fp32")
    wdt = "fp32" if t.weight_bytes == 4 else half_name
    comps = [
        Component("parameters", "parameters", st.weights, wdt,
                  "sum over tensors of block(numel/tp [/dp under ZeRO-3] x bytes)", True),
        Component("buffers", "buffers", st.buffers, None, "registered buffers (position ids, rotary, masks)", True),
    ]
    if st.master:
        comps.append(Component("master_weights", "master_weights", st.master, "fp32",
                               "fp32 copy of half weights, sharded over the ZeRO group", True))
    if bd.get("gradients"):
        comps.append(Component("gradients", "gradients", bd["gradients"], "fp32" if t.distributed_optimizer else wdt,
                               "gradients alive at the peak [/dp under ZeRO-2/3]", True))
    if bd.get("optimizer_states"):
        comps.append(Component("optimizer_states", "optimizer_states", bd["optimizer_states"], None,
                               f"{t.optimizer} states of trainable tensors [/dp under ZeRO>=1]", True))
    acts_at_peak = bd.get("activations", 0)
    if acts_at_peak:
        full_acts = acts_layers + eh_rest + eh_head * inflight + cache_head
        listed = []
        if acts_at_peak == full_acts or acts_at_peak == acts_layers + eh_rest:
            for k, v in sorted(eh.items()):
                if v and (acts_at_peak == full_acts or k not in head_keys):
                    listed.append(Component(f"activations.{k}", "activations", v * inflight, None,
                                            "embedding / head tensors saved for backward"))
            if cache_head and acts_at_peak == full_acts:
                listed.append(Component("activations.autocast_weight_copies.head", "activations", cache_head,
                                        half_name, "half copy of the LM head weight saved by its matmul"))
            nl = layers * inflight
            for name, a, bq in lc.parts:
                if t.recompute == "full":
                    break
                val = int(a * n) + (0 if t.recompute == "selective" else int(bq * nsq))
                if val:
                    listed.append(Component(f"activations.layers.{name}", "activations", val * nl, None,
                                            "saved per layer x layers on this rank x micro-batches in flight"))
            if t.recompute == "full":
                listed.append(Component("activations.layers.checkpointed_inputs", "activations",
                                        layer_input * nl, "fp32" if pol.stream == 4 else half_name,
                                        "full recompute keeps each layer's input"))
            if cache_layer and not fwd_cache_only:
                listed.append(Component("activations.autocast_weight_copies.layers", "activations",
                                        cache_layer * layers, half_name,
                                        "half copies of matmul weights cast by autocast, saved for backward"))
            diff = acts_at_peak - sum(c.bytes for c in listed)
            if diff:
                listed.append(Component("activations.rounding", "activations", diff, None, "integer rounding"))
        else:
            listed.append(Component("activations.remaining", "activations", acts_at_peak, None,
                                    "activations of the layers not yet back-propagated at the peak"))
        comps += listed
    if bd.get("logits"):
        hl, kvp, lp = peak_ld
        if hl:
            comps.append(Component("logits.logits", "logits", hl, half_name if pol.half == 2 else "fp32",
                                   "b x s x vocab / tp in the matmul dtype: the model output's (and the "
                                   "previous step's while the loop keeps it)"))
        if lp:
            comps.append(Component("logits.log_probs", "logits", lp, "fp32" if _loss_upcasts(m) else None,
                                   "log-softmax saved by cross-entropy (and nll_loss's fp32 copy under autocast)"))
        if kvp:
            comps.append(Component("activations.kv_cache", "activations", kvp, "fp32",
                                   "KV-cache copies of the keys held by the model output (not saved by autograd)"))
    comps.append(Component("inputs", "inputs", inputs, "int64", "input_ids and labels"))
    if bd.get("workspace"):
        comps.append(Component("workspace.cublas", "workspace", bd["workspace"], None,
                               "8,519,680 B per cuBLAS handle: forward thread and autograd thread", True))
    if comm:
        comps.append(Component(comm_name, "communication", comm, None, "DDP buckets / ZeRO-3 gathered layers", True))
    if bd.get("temporaries"):
        comps.append(Component(f"temporaries.{peak_m[2]}", "temporaries", bd["temporaries"], None,
                               "tensors alive only at the peak moment"))

    rep = MemoryReport(source="estimate", method="trainmem", components=comps, phases=phases,
                       peak_allocated=peak, peak_phase=f"{peak_m[0]}@{peak_m[1]}", peak_where=peak_m[2],
                       model=m, training=t)
    rep.extra["pipeline_stage"] = stage if t.pp > 1 else None
    rep.extra["activations_per_layer"] = per_layer
    return rep
