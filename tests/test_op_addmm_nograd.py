"""Torchtitan's per-op policy on a layer whose q/k/v linears have a bias (Qwen2): ``at::linear`` runs them
as ``addmm``, which the policy does not count (only ``aten.mm``), so the written first forward
(``estimate/nograd.py``) marks the outputs of o, up (the 1st and 3rd ``mm``) and the fused SDPA kernel's
as kept, as the layer's recipe does (``layers.op_checkpoint_saved``). It marked q, v, SDPA, gate and down,
the recipe's list disagreed, ``reserved.layer_forward._op_written`` refused the written sequence and the
replay made each layer's tensors at once (the MLP's four 19 MiB tensors together where trace frees one
first), opening two 20 MiB segments more than trace: on the grid's Qwen2.5-0.5B row (2 layers, b2 s1024,
FSDP2 over 2, bf16-mp, per-op recompute) the second step found a free 1,188 MiB segment split for a 19 MiB
tensor in trace only and trace opened a fourth, -16.96 % on the peak reserved memory against trace.

The first linear's output stays where the forward thread's cuBLAS workspace is made (``NoGradSeq.mm0``,
``LayerCoefs.nograd_mm0``), biased or not: ``addmm`` takes the handle as ``mm`` does. Counting only the
``mm`` outputs moved it from q_proj's to o_proj's, after eager attention's scores, and every later block
of the first 520 MiB segment with it: on the grid's Qwen2.5-0.5B row (b2 s512, eager, FSDP1 grad-op over 4,
half loss, per-op recompute) the second step's forward then left a 260.5 MiB free tail in the second
298 MiB segment (trace: 234.4 MiB), the head's 259.66 MiB half weight copy went there instead of the first
520 MiB segment, the first of the loss's 296.75 MiB tensors fit there and the second 593.5 MiB one found a
segment free where trace opens one more: -13.57 % on the peak reserved memory against trace.
"""
from __future__ import annotations

import pytest

from trainmem.estimate.nograd import NoGradLayer, llama_layer


def test_biased_linears_are_not_counted_as_mm():
    """Of a Qwen2 layer's seven linears the four bias-free ones (o, gate, up, down) are ``aten.mm``;
    the policy keeps the 1st and 3rd (o's and up's outputs) and the SDPA output."""
    L = NoGradLayer(h=64, q=64, kv=16, f=160, stream=2, half=2, weight=2,
                    addmm=("k_proj", "q_proj", "v_proj"))  # model_facts.biased_linears
    S = llama_layer(L)
    assert len(S.mm) == 4 and len(S.sdpa) == 1
    widths = sorted(S.sizes[i] for i in S.op_kept())              # bytes per token, bf16
    assert widths == sorted([64 * 2, 64 * 2, 160 * 2])             # SDPA's, o's, up's
    assert S.mm0 >= 0 and S.mm0 < min(S.mm)                        # q_proj's addmm output, before o's


def test_first_linear_is_the_first_mm_without_biases():
    """Without biases the first linear's output is the first ``mm``'s (Llama: q_proj's, the policy's first kept)."""
    S = llama_layer(NoGradLayer(h=64, q=64, kv=16, f=160, stream=2, half=2, weight=2))
    assert S.mm0 == S.mm[0] == min(S.op_kept())


def test_fsdp1_qwen2_eager_op_recompute_peak_reserved(bench, one_torch_thread):
    """The grid's row: the estimate's peak reserved memory within 1 % of trace's (-13.57 % before)."""
    from trainmem.estimate.engine import estimate
    from trainmem.trace.api import trace
    m, t = bench.Case("qwen2", 2, 512, (("attention", "eager"), ("dp", 4), ("fsdp", "grad-op"),
                                        ("fsdp_version", 1), ("loss", "half"), ("recompute", "op"))).specs()
    e, tr = estimate(m, t, reserved=True), trace(m, training=t)
    assert abs(e.peak_reserved / tr.peak_reserved - 1) < 0.01


def test_fsdp2_qwen2_op_recompute_peak_reserved(bench, one_torch_thread):
    """The grid's row: the estimate's peak reserved memory within 1 % of trace's (-16.96 % before)."""
    from trainmem.estimate.engine import estimate
    from trainmem.trace.api import trace
    m, t = bench.Case("qwen2", 2, 1024, (("dp", 2), ("fsdp", "full"), ("precision", "bf16-mp"),
                                         ("recompute", "op")), 2).specs()
    e, tr = estimate(m, t, reserved=True), trace(m, training=t)
    assert abs(e.peak_reserved / tr.peak_reserved - 1) < 0.01
