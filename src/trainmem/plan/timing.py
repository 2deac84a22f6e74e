"""A documented step-time model that ranks parallel layouts (not a performance predictor).

For a step of ``G`` sequences of ``s`` tokens on ``N`` GPUs (``dp x tp x pp x cp``), micro-batch
``b``, ``m = G / (dp·b)`` micro-batches per step, per GPU:

compute
    model FLOPs = 3 x forward FLOPs x tokens (forward + backward twice the forward), forward FLOPs
    per token = 2 x (matmul parameters a token passes through: the layers' linear weights (MoE:
    top-k of the experts) and the LM head) + 4·s·(heads·head_dim) per layer (Q·Kᵀ and P·V, counted
    over the full s x s square). Recompute adds forward FLOPs again: full = every layer's forward,
    selective = the attention core (the 4·s·q term). Time = FLOPs / (N x bf16 peak x MFU), MFU
    assumed (default 0.5).
pipeline bubble
    1F1B keeps each stage idle for (pp-1) of (m+pp-1) slots: compute x (pp-1)/m extra, i.e. a
    bubble fraction (pp-1)/(m+pp-1) of the pipelined time.
tensor parallel
    Megatron layers with sequence parallelism: per layer and micro-batch 4 collectives (2 forward,
    2 backward; 2 more with full recompute) of b·(s/cp)·h activations in the compute dtype, each
    moving 2·(tp-1)/tp of it per GPU (ring), over NVLink when tp <= GPUs per node, else the network.
context parallel
    ring attention: each layer passes the rank's K and V blocks around the ring, cp-1 hops per
    micro-batch in forward and twice that in backward (K, V and their gradients), +1 forward with
    full recompute; bandwidth as above for tp·cp GPUs.
data parallel / ZeRO
    Ψ = parameters on a rank (after TP and PP), f = (dp-1)/dp, gradient bytes g, weight bytes w.
    DDP and ZeRO-1: one all-reduce of the gradients per step, 2·f·Ψ·g, hidden behind the last
    micro-batch's backward (DDP buckets; the other micro-batches skip the sync). ZeRO-2: a
    reduce-scatter per micro-batch (f·Ψ·g, hidden behind that backward) + an all-gather of the
    updated parameters (f·Ψ·w, exposed). ZeRO-3: per micro-batch two parameter all-gathers
    (forward, backward) and a gradient reduce-scatter, f·Ψ·(2w + g), prefetched behind that
    micro-batch's compute. Only the part that outlasts the compute it hides behind counts.
    Over NVLink when tp·cp·dp <= GPUs per node, else the network (one NIC per GPU).
latency
    every collective also costs a fixed 10 µs within a node, 30 µs across nodes: TP's and CP's per
    layer and micro-batch, and ZeRO-2's (one) and ZeRO-3's (three) per layer and micro-batch,
    which prefetching does not hide. This is what separates ZeRO stages whose traffic hides.
pipeline parallel
    per micro-batch, each stage sends its output forward and receives a gradient back:
    2·m·b·(s/cp)·h/tp bytes in the compute dtype, over the network when a stage spans a node.

Tensor-, context- and pipeline-parallel communication is assumed not to overlap with compute
(Megatron's TP collectives sit on the critical path): absolute times are pessimistic, but each term
grows with the traffic a layout adds, which is what the ranking needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..spec.hardware import Hardware
from ..spec.model import ModelSpec
from ..spec.training import TrainingSpec

LATENCY_INTRA = 10e-6   # seconds per collective within a node
LATENCY_INTER = 30e-6   # seconds per collective across nodes
TERMS = ("compute", "recompute", "bubble", "tp_comm", "cp_comm", "dp_comm", "pp_comm")
TERM_WORDS = {"compute": "compute", "recompute": "recomputation", "bubble": "pipeline bubble",
              "tp_comm": "tensor-parallel communication", "cp_comm": "context-parallel communication",
              "dp_comm": "data-parallel/ZeRO communication", "pp_comm": "pipeline communication"}


@dataclass(frozen=True)
class Speeds:
    """The hardware figures the model uses (bytes/s and FLOP/s)."""

    peak_flops: float
    intra_bw: float
    inter_bw: float
    gpus_per_node: int
    mfu: float

    @staticmethod
    def of(hw: Hardware, gpus_per_node: int, internode_gbs: float, mfu: float) -> "Speeds":
        return Speeds(hw.bf16_tflops * 1e12, hw.interconnect_gbs * 1e9, internode_gbs * 1e9, gpus_per_node, mfu)


@lru_cache(maxsize=64)
def matmul_elements(m: ModelSpec) -> tuple[int, int]:
    """Matmul weight elements a token meets: (in one layer, with an MoE layer's experts weighted by
    top-k / experts; in the head, a tied embedding counted when it is the LM head)."""
    layer = head = 0
    for p in m.first_layer_and_outer_tensors:
        if p.layer == 0 and p.is_matmul:
            routed = p.role == "expert" and m.num_experts
            layer += p.numel * m.experts_top_k // m.num_experts if routed else p.numel
        elif p.layer is None and p.is_matmul:
            head += p.numel
    emb = [p for p in m.parameter_tensors() if p.role == "embedding"]
    if m.tied_embeddings and m.head in ("causal-lm", "masked-lm") and emb:
        head += emb[0].numel
    return layer, head


def flops_per_token(m: ModelSpec, seq: int) -> tuple[float, float, float]:
    """(forward FLOPs per token, of which the layers' dense matmuls, of which attention scores)."""
    layer_matmul, head_matmul = matmul_elements(m)
    dense_layers = 2.0 * layer_matmul * m.num_layers
    head = 2.0 * head_matmul
    attn = 4.0 * seq * m.q_size * m.num_layers
    return dense_layers + head + attn, dense_layers, attn


def step_times(m: ModelSpec, base: TrainingSpec, sp: Speeds, seq: int, global_batch: int, n_gpus: int,
               tp, pp, cp, dp, zero, rec, b, ga, params_rank) -> dict[str, np.ndarray]:
    """Seconds per optimizer step of each layout, by term (``TERMS``) and ``total``; also
    ``model_flops`` (per step, whole cluster, without recompute)."""
    tp, pp, cp, dp, zero, rec, b, ga = (np.asarray(x, dtype=np.float64) for x in (tp, pp, cp, dp, zero, rec, b, ga))
    psi = np.asarray(params_rank, dtype=np.float64)
    fwd, dense, attn = flops_per_token(m, seq)
    tokens = float(global_batch) * seq
    model_flops = 3.0 * fwd * tokens
    rate = n_gpus * sp.peak_flops * sp.mfu
    compute = np.full(tp.shape, model_flops / rate)
    recompute = np.where(rec == 2, (dense + attn) * tokens / rate, np.where(rec == 1, attn * tokens / rate, 0.0))
    bubble = (compute + recompute) * (pp - 1) / ga
    act = 2.0 if base.precision != "fp32" else 4.0
    gbytes = float(base.weight_bytes)
    wbytes = float(base.weight_bytes)
    node = sp.gpus_per_node
    layers = m.num_layers / pp
    tokens_mb = b * seq / cp
    # tensor parallel
    bw_tp = np.where(tp <= node, sp.intra_bw, sp.inter_bw)
    n_coll = 4.0 + np.where(rec == 2, 2.0, 0.0)
    tp_vol = ga * layers * n_coll * 2.0 * (tp - 1) / tp * tokens_mb * m.hidden_size * act
    lat_tp = np.where(tp <= node, LATENCY_INTRA, LATENCY_INTER)
    tp_comm = tp_vol / bw_tp + np.where(tp > 1, ga * layers * n_coll * lat_tp, 0.0)
    # context parallel (ring attention): K and V blocks of this rank's kv heads
    kv_local = m.kv_size / tp  # TP splits whole KV heads (spec.layout.tp_problems)
    bw_cp = np.where(tp * cp <= node, sp.intra_bw, sp.inter_bw)
    hops = (3.0 + np.where(rec == 2, 1.0, 0.0)) * (cp - 1)
    lat_cp = np.where(tp * cp <= node, LATENCY_INTRA, LATENCY_INTER)
    cp_comm = ga * layers * hops * (2.0 * tokens_mb * kv_local * act / bw_cp + lat_cp)
    # data parallel / ZeRO: the traffic hides behind the compute it follows (DDP buckets during the
    # last micro-batch's backward, ZeRO-2 reduce-scatters during each backward, ZeRO-3 prefetched
    # gathers during each micro-batch); what is left over is exposed
    f = (dp - 1) / dp
    bw_dp = np.where(tp * cp * dp <= node, sp.intra_bw, sp.inter_bw)
    mb_compute = (compute + recompute) / ga
    mb_backward = (2.0 / 3.0) * compute / ga + recompute / ga
    grads_t = f * psi * gbytes / bw_dp
    dp_comm = np.select(
        [zero <= 1, zero == 2],
        [np.maximum(0.0, 2.0 * grads_t - mb_backward),
         ga * np.maximum(0.0, grads_t - mb_backward) + f * psi * wbytes / bw_dp],
        ga * np.maximum(0.0, f * psi * (2.0 * wbytes + gbytes) / bw_dp - mb_compute))
    # ZeRO-2/3 launch collectives every micro-batch, per layer: their latency is not hidden
    lat_dp = np.where(tp * cp * dp <= node, LATENCY_INTRA, LATENCY_INTER)
    dp_comm = dp_comm + np.where(dp > 1, np.select([zero == 2, zero == 3], [1.0, 3.0], 0.0), 0.0) * ga * layers * lat_dp
    # pipeline
    bw_pp = np.where(tp * cp * dp >= node, sp.inter_bw, sp.intra_bw)
    pp_comm = np.where(pp > 1, 2.0 * ga * tokens_mb * m.hidden_size / tp * act / bw_pp, 0.0)
    out = dict(compute=compute, recompute=recompute, bubble=bubble, tp_comm=tp_comm, cp_comm=cp_comm,
               dp_comm=dp_comm, pp_comm=pp_comm)
    out["total"] = sum(out[k] for k in TERMS)
    out["model_flops"] = np.full(tp.shape, model_flops)
    return out
