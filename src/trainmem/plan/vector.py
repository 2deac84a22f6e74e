"""Per-GPU memory of many parallel layouts at once (numpy), from the engine's own structure.

The default estimator (``trainmem.estimate.engine``) walks one training step and takes the largest
moment. This module evaluates the same moments for thousands of layouts in a few array operations:

* model states per rank from the parameter tensors grouped into classes (every transformer layer
  has the same tensors, so a layer's tensors stand for all of them, times the layers of the
  pipeline stage): each class's elements on a tensor-parallel rank (matmul weights and embeddings
  split over TP, norms replicated), the ZeRO sharding rules over the data-parallel group, and the
  caching allocator's block rounding, as ``estimate.states.model_states`` does per tensor (the
  engine also simulates the allocator placing the weights one after another, which can leave an
  unsplit remainder of up to 1 MiB per tensor: the planner re-estimates the layouts it shows);
* activations from ``estimate.layers.layer_coefficients`` (bytes per token and per token pair for
  each tensor-parallel size; only a few distinct ones) times b·s and b·s², the recompute policy,
  the pipeline's micro-batches in flight, and the engine's embedding/head and logits terms
  (``_embedding_and_head``, ``_logits``: plain arithmetic, evaluated on arrays);
* the step's moments (forward end with the loss, start of backward, last and first layer's
  backward, optimizer step), the largest of which is the peak, and the allocator overhead rule
  (``estimate.api.allocator_overhead``: 1/32 of the peak).

``layout_memory`` returns the ``peak_allocated`` and ``device_used`` of
``trainmem.estimate(..., method="trainmem")`` for each layout (tests/test_plan_vector.py checks a
sample: within 2%, in practice within the weights' placement remainder). Layouts it cannot
represent (LoRA, offload, FSDP modes, optimizer in backward, layers that differ) raise
``NotImplementedError`` so that the planner falls back to the scalar estimator.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from ..estimate.api import OVERHEAD_DIVISOR
from ..estimate.engine import (CUBLAS_WORKSPACE, _embedding_and_head, _layer_key, _logits, _output_logits,
                               _tied_head_grad)
from ..estimate.layers import Policy, layer_coefficients
from ..estimate.states import MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL, block_bytes
from ..spec.model import ModelSpec
from ..spec.training import TrainingSpec

I64 = np.int64
HEAD_KEYS = ("final_norm", "lm_head.input", "mlm.transform", "pooler.input")
REC_CODES = {"none": 0, "selective": 1, "full": 2}


def block_np(nbytes: np.ndarray) -> np.ndarray:
    """``estimate.states.block_bytes`` on an array: 512-byte rounding, whole 2 MiB segments above 10 MiB
    when the remainder is <= 1 MiB."""
    x = np.asarray(nbytes, dtype=I64)
    r = np.maximum(MIN_BLOCK, (x + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)
    seg = (r + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
    out = np.where((r >= MIN_LARGE_ALLOC) & (seg - r <= SMALL), seg, r)
    return np.where(x <= 0, 0, out)


def allocator_overhead(peak: np.ndarray) -> np.ndarray:
    """``estimate.api.allocator_overhead`` on an array: reserved - allocated = 1/32 of the peak."""
    return peak // OVERHEAD_DIVISOR


def group_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of equal-length integer columns: (first row index of each group, inverse),
    through one mixed-radix key (much faster than ``np.unique(axis=0)``)."""
    key = np.zeros(len(cols[0]), I64)
    for c in cols:
        c = np.asarray(c, dtype=I64)
        key = key * (int(c.max(initial=0)) + 1) + c
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)


def _ceil_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return -(-a // b)


@dataclass(frozen=True)
class Tables:
    """Parameter tensor classes of a model: layer 0's tensors (standing for every layer) and the
    tensors outside the layers, as arrays."""

    numel: np.ndarray      # elements
    split: np.ndarray      # divided over TP (not a norm or router)
    layer: np.ndarray      # a layer tensor (one per layer)
    on_first: np.ndarray   # non-layer tensor held by the first pipeline stage
    on_last: np.ndarray    # non-layer tensor held by the last pipeline stage
    matmul: np.ndarray
    emb: np.ndarray        # role == embedding
    expert: np.ndarray     # role == expert (no autocast copies: transformers' grouped_mm experts)
    mat2d: np.ndarray      # 2-D or more (adafactor factors)
    rows: np.ndarray
    cols: np.ndarray
    lead: np.ndarray       # leading dims product (experts)
    emb_numel: int         # the (first) embedding's elements (tied LM head cast)
    buffers_all: int       # buffer bytes outside per-layer ("h.N.") buffers
    buffer_layer: int      # bytes of one layer's per-layer buffers
    layer_matmul: int      # matmul elements of one layer (MoE experts weighted by top-k / experts)
    head_matmul: int       # matmul elements of the head (tied embedding counted when it is the LM head)


@lru_cache(maxsize=64)
def model_tables(m: ModelSpec) -> Tables:
    """Group ``m``'s tensors into classes; NotImplementedError when the layers are not identical."""
    tens = m.parameter_tensors()
    by_layer: dict[int, list] = {}
    rest = []
    for p in tens:
        if p.layer is None:
            rest.append(p)
        else:
            by_layer.setdefault(p.layer, []).append(p)
    sig0 = sorted((p.shape, p.role, p.module) for p in by_layer.get(0, []))
    if len(by_layer) != m.num_layers or any(sorted((p.shape, p.role, p.module) for p in v) != sig0
                                            for v in by_layer.values()):
        raise NotImplementedError(f"{m.name}: layers differ; the vectorised planner needs identical layers")
    chosen = list(by_layer.get(0, [])) + rest
    tied_names = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight")

    def arr(f, dt=I64):
        return np.array([f(p) for p in chosen], dtype=dt)

    emb = [p for p in tens if p.role == "embedding"]
    bufs_all = bufs_layer = 0
    for b in m.buffer_tensors():
        nb = {"float32": 4, "int64": 8, "bool": 1}.get(b.dtype, 0)
        if nb == 0:
            raise NotImplementedError("buffers in the model's dtype")  # none in the catalogue's families
        numel = 1
        for x in b.shape:
            numel *= x
        if b.name.startswith("h."):
            if b.name.split(".")[1] == "0":
                bufs_layer += block_bytes(numel * nb)
        else:
            bufs_all += block_bytes(numel * nb)
    lm = 0
    for p in by_layer.get(0, []):
        if p.is_matmul:
            lm += p.numel * m.experts_top_k // m.num_experts if p.role == "expert" and m.num_experts else p.numel
    hm = sum(p.numel for p in rest if p.is_matmul)
    if m.tied_embeddings and m.head in ("causal-lm", "masked-lm") and emb:
        hm += emb[0].numel
    return Tables(
        numel=arr(lambda p: p.numel), split=arr(lambda p: p.role not in ("norm", "router"), bool),
        layer=arr(lambda p: p.layer is not None, bool),
        on_first=arr(lambda p: p.layer is None and p.role == "embedding", bool),
        on_last=arr(lambda p: p.layer is None and (p.role != "embedding" or (
            m.tied_embeddings and p.name.endswith(tied_names))), bool),
        matmul=arr(lambda p: p.is_matmul, bool), emb=arr(lambda p: p.role == "embedding", bool),
        expert=arr(lambda p: p.role == "expert", bool),
        mat2d=arr(lambda p: len(p.shape) >= 2, bool),
        rows=arr(lambda p: p.shape[-2] if len(p.shape) >= 2 else 1),
        cols=arr(lambda p: p.shape[-1] if len(p.shape) >= 2 else 1),
        lead=arr(lambda p: int(np.prod(p.shape[:-2])) if len(p.shape) > 2 else 1),
        emb_numel=emb[0].numel if emb else 0, buffers_all=bufs_all, buffer_layer=bufs_layer,
        layer_matmul=lm, head_matmul=hm)


def supported(t: TrainingSpec) -> str | None:
    """Why ``t``'s non-layout settings cannot be vectorised (None when they can)."""
    if t.lora_rank:
        return "LoRA"
    if t.offload_optimizer:
        return "optimizer offload"
    if t.fsdp is not None:
        return "FSDP modes"
    if t.distributed_optimizer:
        return "the distributed optimizer"
    if t.optimizer_in_backward:
        return "optimizer in backward"
    if t.num_microbatches_in_flight is not None:
        return "a fixed number of micro-batches in flight"
    return None


def _opt_bytes(optimizer: str, sh: np.ndarray, sb: np.ndarray, tb: Tables) -> np.ndarray:
    """Optimizer state bytes (allocator-rounded) of each class shard, as ``states._state_bytes``."""
    if optimizer in ("adam", "adamw"):
        return 2 * block_np(sh * sb)
    if optimizer == "sgd":
        return np.zeros_like(sh)
    if optimizer in ("sgd-momentum", "lion"):
        return block_np(sh * sb)
    if optimizer == "adafactor":
        lead = sh // np.maximum(tb.rows * tb.cols, 1)
        two = block_np(lead * tb.rows * 4) + block_np(lead * tb.cols * 4)
        return np.where(tb.mat2d, two, block_np(sh * 4))
    if optimizer == "adamw-8bit":
        blocks = _ceil_div(sh, 2048)
        return np.where(sh < 4096, 2 * block_np(sh * 4), 2 * block_np(sh + blocks * 4))
    raise NotImplementedError(optimizer)


def states(m: ModelSpec, base: TrainingSpec, tp, pp, zero, d, last: bool) -> dict[str, np.ndarray]:
    """Model-state bytes per rank for arrays of (tp, pp, zero, shard group d) on the first (or last)
    pipeline stage: ``estimate.states.model_states`` for every combination at once."""
    tb = model_tables(m)
    tp, pp, zero, d = (np.asarray(x, dtype=I64)[:, None] for x in (tp, pp, zero, d))
    L = m.num_layers
    w = base.weight_bytes
    amp = base.amp
    n = np.where(tb.split, _ceil_div(tb.numel, tp), tb.numel)                       # (U, K)
    side = tb.on_last if last else tb.on_first
    mult = np.where(tb.layer, L // pp, np.where(pp == 1, 1, side.astype(I64)))      # (U, K)
    one_layer = np.where(tb.layer, 1, 0)
    non_layer_on = np.where(tb.layer, 0, mult)
    half_master = (base.precision in ("bf16", "fp16")) & (zero >= 1)                # (U, 1)
    gbytes = w
    sbytes = np.where((w == 4) | half_master, 4, w)
    wb = n * w
    weights = (mult * block_np(np.where(zero == 3, _ceil_div(wb, d), wb))).sum(1)
    lpf = (one_layer * wb).sum(1)
    lmh = (one_layer * (tb.matmul & ~tb.expert) * n * 2).sum(1) if amp else np.zeros(len(tp), I64)
    hmh = (non_layer_on * tb.matmul * n * 2).sum(1) if amp else np.zeros(len(tp), I64)
    g = block_np(np.where(zero >= 2, _ceil_div(n * gbytes, d), n * gbytes))
    grads = (mult * g).sum(1)
    layer_grads = (one_layer * g).sum(1)
    head_grads = (non_layer_on * ~tb.emb * g).sum(1)
    sh = np.where(zero >= 1, _ceil_div(n, d), n)
    master = (mult * np.where(half_master, block_np(sh * 4), 0)).sum(1)
    opt = (mult * _opt_bytes(base.optimizer, sh, sbytes, tb)).sum(1)
    fused = base.impl == "fused" and base.optimizer in ("adam", "adamw")
    step_t = (mult * block_bytes(4)).sum(1) if fused else np.zeros(len(tp), I64)
    largest = np.where(mult > 0, n * sbytes, 0).max(1)
    group = (mult * block_np(sh * sbytes)).sum(1)
    params_rank = (mult * n).sum(1)
    if m.tied_embeddings and amp and m.head in ("causal-lm", "masked-lm"):
        on = (pp[:, 0] == 1) | last
        hmh = hmh + np.where(on, _ceil_div(np.int64(tb.emb_numel), tp[:, 0]) * 2, 0)
    layers = L // pp[:, 0]
    buffers = tb.buffers_all + np.where(pp[:, 0] > 1, layers, L) * tb.buffer_layer
    return dict(weights=weights, buffers=buffers, master=master, grads=grads, optimizer=opt, step=step_t,
                layer_grads=layer_grads, head_grads=head_grads, lmh=lmh, hmh=hmh, largest=largest,
                group=group, lpf=lpf, params_rank=params_rank)


def _spec(base: TrainingSpec, tp: int, pp: int) -> TrainingSpec:
    return replace(base, tp=int(tp), sequence_parallel=bool(tp > 1), pp=int(pp), cp=1, dp=1, zero=0, batch_size=1,
                   grad_accum=1)


def _stage(m: ModelSpec, base: TrainingSpec, seq: int, tp, pp, cp, dp, zero, rec, b, ga, last: bool,
           context: int) -> dict[str, np.ndarray]:
    pol = Policy.of(base.precision)
    L = m.num_layers
    layers = L // pp
    s_local = seq // cp
    n = b * s_local
    nsq = n * seq
    # ---- model states, per distinct (tp, pp, zero, dp)
    first, inv = group_rows(tp, pp, zero, dp)
    st = {k: v[inv] for k, v in states(m, base, tp[first], pp[first], zero[first], dp[first], last).items()}
    # ---- activations, per distinct tp (layer coefficients) and pipeline position
    N = len(tp)
    z = np.zeros(N, I64)
    plf, ttrans, tgrads, tokp, sqp, lin, eh_head, eh_rest, kvh, kvc = (z.copy() for _ in range(10))
    held, logp, ce_fwd, ce_bwd, out_logits = (z.copy() for _ in range(5))
    stage = "last" if last else "first"
    for tpv in np.unique(tp):
        for multi in (False, True):
            grp = (tp == tpv) & ((pp > 1) == multi)
            if not grp.any():
                continue
            t = _spec(base, tpv, 2 if multi else 1)
            key = _layer_key(m, replace(t, recompute="none"))
            # transformers' KV cache exists without full recompute (and context parallelism)
            variants = [(grp & ~((rec != 2) & (cp == 1)) if key.kv_cache else grp, replace(key, kv_cache=False))]
            if key.kv_cache:
                variants.append((grp & (rec != 2) & (cp == 1), key))
            for msk, k_ in variants:
                if not msk.any():
                    continue
                lc = layer_coefficients(k_)
                nn, qq = n[msk], nsq[msk]
                plf[msk] = (lc.tok * nn + lc.sq * qq).astype(I64)
                tokp[msk] = (lc.tok * nn).astype(I64)
                sqp[msk] = (lc.sq * qq).astype(I64)
                kvh[msk] = (lc.held * nn).astype(I64)
                kvc[msk] = (lc.cache * nn).astype(I64)
                if lc.transients:
                    lg = st["layer_grads"][msk]
                    gpw = lg / lc.weights if lc.weights else np.zeros(len(nn))
                    after = lc.after or (0.0,) * len(lc.transients)
                    gs = np.array([(w * gpw).astype(I64) for w in after])
                    vals = np.array([(a * nn + c * qq + k).astype(I64) for _, a, c, k in lc.transients]) + gs
                    idx = vals.argmax(0)
                    cols = np.arange(len(nn))
                    ttrans[msk], tgrads[msk] = vals[idx, cols], gs[idx, cols]
                else:
                    ttrans[msk] = -(1 << 62)
            msk = grp
            nn, bb = n[msk], b[msk]
            sp = tpv if tpv > 1 else 1
            lin[msk] = nn * m.hidden_size * pol.stream // sp
            eh = _embedding_and_head(m, replace(t, recompute="none"), pol, nn, stage)
            eh_head[msk] = sum((np.broadcast_to(v, nn.shape) for k, v in eh.items() if k in HEAD_KEYS),
                               np.zeros_like(nn))
            eh_rest[msk] = sum((np.broadcast_to(v, nn.shape) for k, v in eh.items() if k not in HEAD_KEYS),
                               np.zeros_like(nn))
            if not multi or last:
                h_, l_, f_, k_ = _logits(m, t, pol, nn, bb)
                held[msk], logp[msk], ce_fwd[msk], ce_bwd[msk] = h_, l_, f_, k_
                out_logits[msk] = _output_logits(m, t, pol, nn, bb)
    labels = b if m.head == "seq-cls" else n
    inputs = block_np(n * 8) + block_np(labels * 8)
    head_here = (pp == 1) | bool(last)
    # autocast's cached half weight copies; none outlive their layer under ZeRO-3 (gathered per layer)
    unsharded = ~((zero == 3) & (dp > 1))
    cache_layer = np.where(unsharded, st["lmh"], 0) if pol.amp else z
    cache_head = np.where(head_here & unsharded, st["hmh"], 0) if pol.amp else z
    inflight = np.where((pp > 1) & (not last), np.minimum(pp, ga), 1)
    full = rec == 2
    if base.attention == "eager" and m.head == "causal-lm" and m.family != "nanogpt" and not last:
        # the 4-D causal mask checkpointed layers keep (engine: _embedding_and_head "causal_mask")
        eh_rest = eh_rest + np.where(full, n * seq * pol.stream, 0)
    per_layer = np.select([rec == 0, rec == 1], [plf, tokp], lin)
    rextra = np.select([rec == 0, rec == 1], [z, sqp], plf)
    layer_acts = per_layer * layers * inflight
    acts_layers = np.where(full, layer_acts, layer_acts + cache_layer * layers)
    fwd_cache_only = np.where(full, cache_layer * layers, 0)
    rextra = rextra + np.where(full, cache_layer, 0)
    comm = np.where((dp > 1) & (zero == 0), st["grads"], np.where((zero == 3) & (dp > 1), 2 * st["lpf"], 0))
    impl = base.impl
    if base.optimizer == "sgd" or impl == "fused" or base.optimizer == "adamw-8bit":
        opt_tmp = z
    elif impl == "foreach":
        opt_tmp = st["group"]
    else:
        opt_tmp = 2 * block_np(st["largest"])
    S = st["optimizer"] + st["step"]
    G = st["grads"]
    static = st["weights"] + st["buffers"] + st["master"] + comm
    ws2 = 2 * CUBLAS_WORKSPACE
    eh_rest_i = eh_rest * inflight
    acts_f = acts_layers + eh_rest_i + eh_head * inflight + cache_head
    acc = ga > 1
    g0 = np.where(acc, G, 0)
    base_b = static + S + inputs + ws2
    # the layer transient's non-gradient part, then the later linears' gradients (not when
    # accumulating: all gradients exist then)
    tmp = np.maximum(0, ttrans - tgrads + rextra)
    g_lyr = np.where(acc, 0, tgrads)
    # tensors the model output holds (the fp32 KV cache under autocast) and, when the loop keeps
    # the output, its logits and whole KV cache (engine: keep, keep_low, keep_end)
    kv_held = kvh * layers * inflight
    kv_saved = kvc - kvh
    keep = base.keep_logits
    kept = held + (kv_held if keep else 0)
    kept_low = kept + (kv_saved * (layers - 1) * inflight if keep else 0)
    kept_end = held + (kv_held + kv_saved * layers * inflight if keep else 0)
    # a tied head's gradient waits in autograd's input buffer until the embedding's backward
    tied_g = z.copy()
    for tpv in np.unique(tp):
        sel = (tp == tpv) & (pp == 1)
        if sel.any():
            tied_g[sel] = _tied_head_grad(m, _spec(base, tpv, 1))
    mo_f = base_b + G + opt_tmp + kept_end
    mo_a = base_b + g0 + acts_f + kept_end + out_logits + kv_held + logp + ce_fwd + fwd_cache_only
    mo_b = base_b + g0 + acts_f + kept + logp + ce_bwd
    mo_c = base_b + np.where(acc, G, st["head_grads"]) + g_lyr + acts_layers + eh_rest_i + kept + tmp + tied_g
    mo_d = np.where(layers > 1, base_b + np.where(acc, G, st["head_grads"] + (layers - 1) * st["layer_grads"])
                    + g_lyr + acts_layers // layers + eh_rest_i + kept_low + tmp + tied_g, -1)
    mo_e = np.where(tied_g > 0, base_b + G + kept_end + 2 * tied_g + np.where(acc, tied_g, 0), -1)
    mo_g = base_b + G + kept_end
    moments = np.stack([mo_f, mo_a, mo_b, mo_c, mo_d, mo_e, mo_g])
    which = moments.argmax(0)
    peak = moments[which, np.arange(N)]
    over = allocator_overhead(peak)
    return dict(peak_allocated=peak, peak_reserved=peak + over, device_used=peak + over + context,
                moment=which, params_rank=st["params_rank"], acts=acts_f, states=G + S + st["weights"] + st["master"])


def layout_memory(m: ModelSpec, base: TrainingSpec, seq: int, context: int, tp, pp, cp, dp, zero, rec, b, ga
                  ) -> dict[str, np.ndarray]:
    """Peak allocated, reserved and device bytes per GPU of each layout (arrays of equal length).

    ``rec``: 0 none, 1 selective, 2 full recompute. Sequence parallelism is on whenever tp > 1.
    ``context``: bytes taken before training (the GPU's CUDA context). The worst pipeline stage is
    reported, as the engine does (the first stage unless the last one peaks higher).
    """
    why = supported(base)
    if why:
        raise NotImplementedError(f"the vectorised planner does not model {why}")
    arrs = [np.asarray(x, dtype=I64) for x in (tp, pp, cp, dp, zero, rec, b, ga)]
    tp, pp, cp, dp, zero, rec, b, ga = arrs
    out = _stage(m, base, seq, tp, pp, cp, dp, zero, rec, b, ga, False, context)
    out["stage"] = np.zeros(len(tp), I64)
    sel = np.nonzero(pp > 1)[0]
    if len(sel):
        lst = _stage(m, base, seq, *(a[sel] for a in arrs), True, context)
        take = lst["peak_allocated"] > out["peak_allocated"][sel]
        rows = sel[take]
        for k in ("peak_allocated", "peak_reserved", "device_used", "moment", "acts", "states"):
            out[k][rows] = lst[k][take]
        out["stage"][rows] = 1
        out["params_rank"][sel] = np.maximum(out["params_rank"][sel], lst["params_rank"])
    return out
