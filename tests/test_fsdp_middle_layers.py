"""FSDP's backward of the layers below the top one (estimate.moments._fsdp_middle_layers, moments
``layer.below_top`` / ``layer.above_bottom``; docs/agreement.md mechanism 43) and the LM head's weight
gradient cast under autocast (moment ``lm_head.weight_grad``, quantities.head_moments.head_wgrad; mechanism 44),
with a linear's backward under autocast in two moments (layers.Builder._linear_backward; mechanism
45), each checked against trace on the fake process group.

Below the top layer FSDP2 holds, while a layer's backward computes, its own unsharded parameters,
the lower layer's all-gather output (the backward prefetch), the upper layer's reduce-scatter input
and the shards of the layers above; the top layer has no reduce-scatter input before it and the
bottom layer prefetches nothing, so with small activations per layer (recomputation, few tokens)
the peak is in the second layer from the top or from the bottom. Before these moments the
estimate was 3.6% to 13.9% under trace on the fast setups below (the ``before`` column)."""
from __future__ import annotations

import re
from collections import defaultdict

import pytest

from trainmem import estimate
from trainmem.trace.api import trace

# Llama-2-7B's layer cut to hidden 1024 and 4 layers, a 1000-token vocabulary: the layers' weights,
# not the loss, set the peak; FSDP over 8 ranks, 2 x 512 tokens
SMALL = ["num_hidden_layers=4", "hidden_size=1024", "intermediate_size=2752", "num_attention_heads=8",
         "num_key_value_heads=8", "vocab_size=1000"]
BASE = dict(set=SMALL, batch_size=2, seq_len=512, fsdp="full", dp=8)


def _categories(rep) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for c in rep.components:
        out[getattr(c.category, "value", c.category)] += c.bytes
    return out


# (options, the layer both peak in, tolerance on the peak); estimate / trace - 1 before -> after:
CASES = [
    (dict(recompute="full", precision="bf16-mp"), 1, 0.005),               # -7.40% -> -0.06%
    (dict(recompute="full", precision="bf16"), 1, 0.005),                  # -11.44% -> -0.25%
    (dict(recompute="none", precision="bf16-mp"), 2, 0.01),                # -3.15% -> -0.70%
    (dict(recompute="op", precision="bf16-mp"), 2, 0.01),                  # -13.87% -> -0.88%
    (dict(recompute="full", precision="bf16-mp", dp=2), 1, 0.005),         # -0.62% -> -0.25%
    (dict(recompute="full", precision="bf16-mp", fsdp="grad-op"), 2, 0.005),  # -9.97% -> -0.44%
    (dict(recompute="full", precision="bf16", dp=4, grad_accum=2), 2, 0.01),  # -8.85% -> -0.54%
    (dict(recompute="full", precision="bf16-mp", fsdp_version=1), 1, 0.005),  # FSDP1: -3.58% -> 0.00%
    # bf16-amp: with mechanism 45 (a linear's backward under autocast in two moments); +0.90% without it
    (dict(recompute="full", precision="bf16-amp"), 1, 0.005),              # -11.78% -> -0.03%
    (dict(recompute="full", precision="bf16-amp", fsdp_version=1), 1, 0.005),  # FSDP1: -0.46% -> -0.24%
]


@pytest.mark.parametrize("options,layer,tol", CASES,
                         ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else None)
def test_fsdp_backward_below_the_top_layer(options, layer, tol):
    """The peak in the backward of a layer between the top and the bottom one, in both, within
    ``tol``; the components at it by category as trace's (FSDP's buffers, gradients, states)."""
    opts = {**BASE, **options}
    e, r = estimate("llama-2-7b", **opts), trace("llama-2-7b", **opts)
    assert e.peak_allocated == pytest.approx(r.peak_allocated, rel=tol)
    assert e.peak_where.startswith(f"layer[{layer}].") and re.search(rf"\blayers\.{layer}\b", r.peak_where)
    ce, cr = _categories(e), _categories(r)
    # the root, this layer's parameters, the lower layer's all-gather output, the upper layer's
    # reduce-scatter input (FSDP2): trace's communication.fsdp_* at its peak, to the byte here
    for cat in ("communication", "optimizer_states", "parameters"):
        assert ce[cat] == pytest.approx(cr[cat], rel=0.005, abs=1 << 20), cat
    # the head's unsharded gradient, the shards of the layers above, the layer's later linears'
    # gradients; where trace names them otherwise (FSDP1's view gradients are temporaries to it)
    # gradients and the transients are compared together
    rest = ("activations", "temporaries")
    if options.get("fsdp_version") == 1:
        rest += ("gradients",)
    else:
        assert ce["gradients"] == pytest.approx(cr["gradients"], rel=0.005, abs=1 << 20)
    # trace counts a recomputed layer's tensors as activations, the estimate as its transient
    assert sum(ce[c] for c in rest) == pytest.approx(sum(cr[c] for c in rest), rel=0.05)


def test_named_activations_at_a_layer_below_the_top():
    """The breakdown names the saved tensors of the layers still alive at a middle layer's moment
    (``breakdown._named_layers``): three of the four layers at ``layer[2]``, not one remainder."""
    e = estimate("llama-2-7b", **BASE, recompute="none", precision="bf16-mp")
    names = {c.name: c.bytes for c in e.components}
    assert e.peak_where.startswith("layer[2].") and "activations.remaining" not in names
    # SwiGLU's product, (b, s, ffn) bf16, saved by down_proj: layers 0, 1 and 2
    assert names["activations.layers.mlp.act_product"] == 3 * 2 * 512 * 2752 * 2


def test_lm_head_weight_gradient_cast_under_autocast():
    """Llama-3.2-1B (tied, vocabulary 128256), FSDP2 dp 8, bf16-amp, 1 x 256: the head's half weight
    gradient and its fp32 cast (ToCopyBackward0) with every layer's activations and the root
    gathered are the step's peak in trace; the estimate had no such moment (-1.55% before)."""
    opts = dict(batch_size=1, seq_len=256, dp=8, fsdp="full", precision="bf16-amp")
    e, r = estimate("llama-3.2-1b", **opts), trace("llama-3.2-1b", **opts)
    assert e.peak_where == "lm_head.weight_grad" and r.peak_where.startswith("lm_head (ToCopyBackward0)")
    assert e.peak_allocated == pytest.approx(r.peak_allocated, rel=0.001)
    temp = {c.name: c.bytes for c in e.components}["temporaries.lm_head.weight_grad"]
    assert temp == 128256 * 2048 * (2 + 4)  # the (vocab, hidden) gradient in bf16 and in fp32


# Llama-2-7B cut to 4 layers, FSDP 8, 2 x 2048 (the setups of docs/agreement.md mechanism 43)
LLAMA7 = dict(set=["num_hidden_layers=4"], batch_size=2, seq_len=2048, fsdp="full", dp=8)


@pytest.mark.slow
@pytest.mark.parametrize("options,tol", [
    (dict(recompute="full"), 0.005),                              # -5.00% -> +0.21%
    (dict(recompute="full", precision="bf16-mp"), 0.005),         # -5.95% -> +0.29%
    (dict(recompute="op", precision="bf16-mp"), 0.005),           # -7.69% -> +0.25%
    (dict(recompute="full", precision="bf16"), 0.005),            # -9.51% -> +0.04%
    (dict(recompute="full", dp=2), 0.005),                        # -3.19% -> 0.00%
    (dict(recompute="op", dp=2), 0.005),                          # -2.45% -> 0.00%
    (dict(recompute="full", fsdp_version=1), 0.005),              # FSDP1: -0.09% -> +0.13%
    (dict(recompute="op", fsdp_version=1), 0.01),                 # FSDP1: +0.84% -> +0.08% (peak at the top)
], ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else None)
def test_llama2_7b_four_layers(options, tol):
    opts = {**LLAMA7, **options}
    e, r = estimate("llama-2-7b", **opts), trace("llama-2-7b", **opts)
    assert e.peak_allocated == pytest.approx(r.peak_allocated, rel=tol)
    assert e.peak_where.split(".")[0] in ("layer[1]", "layer[2]", "layer[3]") and "model.layers." in r.peak_where
    assert e.peak_where[6] == r.peak_where.split("model.layers.")[1][0]  # the same layer
