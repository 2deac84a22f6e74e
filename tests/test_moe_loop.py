"""Mixtral's experts as transformers 4.x runs them: a loop over ``nn.Linear`` experts (layers._moe_loop).

Before 5.0 ``MixtralSparseMoeBlock`` holds a ``ModuleList`` of ``MixtralBlockSparseTop2MLP`` and runs the
experts one after another (4.48.0 ``models/mixtral/modeling_mixtral.py`` L112-150), so backward, too,
runs one expert's rows at a time; 5.x's grouped experts run all ``b*s*top_k`` rows at once. The
estimate follows the run's release (``--transformers-version``, ``spec.tf_releases.moe_expert_loop``).
"""
import pytest
import torch
import torch.nn.functional as F

import trainmem
from trainmem.estimate.layers import Builder, Policy, T, _moe_loop
from trainmem.measure.live import LiveBytes
from trainmem.spec import resolve_model
from trainmem.spec.tf_releases import moe_expert_loop

H, FF, E, K, TOKENS = 64, 160, 4, 2, 128


class LoopBlock(torch.nn.Module):
    """The op sequence of transformers 4.48's ``MixtralSparseMoeBlock.forward`` (L112-150) with
    ``MixtralBlockSparseTop2MLP`` (L67-82), the experts frozen as under LoRA on the attention or
    trained, the router (frozen) fixed to an even spread (token t to experts t % E and (t + 1) % E)."""

    def __init__(self, trained: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = lambda o, i: (torch.randn(o, i, generator=g, dtype=torch.bfloat16) / i ** 0.5  # noqa: E731
                          ).requires_grad_(trained)
        self.w1, self.w3, self.w2 = ([w(FF, H) for _ in range(E)], [w(FF, H) for _ in range(E)],
                                     [w(H, FF) for _ in range(E)])
        self.gate = w(E, H).detach()

    def forward(self, x):
        t = torch.arange(x.shape[0])
        logits = F.linear(x, self.gate)
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        pick = torch.stack([t % E, (t + 1) % E], 1)
        top, chosen = probs.gather(1, pick).topk(K, dim=-1)
        chosen = pick.gather(1, chosen)
        top /= top.sum(dim=-1, keepdim=True)
        weights = top.to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            idx, top_x = torch.where(mask[e])
            rows = x[None, top_x].reshape(-1, H)
            y = F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e])
            out.index_add_(0, top_x, (y * weights[top_x, idx, None]).to(x.dtype))
        return out


def _recipe(trained: bool):
    """(saved bytes, the backward's highest moment over them) of ``_moe_loop``; trained: less the
    router's input its linear saves (the replica's router is frozen), with the weight gradients made
    by then (bf16, the later linears' and the op's own, ``const``)."""
    B = Builder(Policy.of("bf16"), False, lora=() if trained else (("q_proj", 16, 1),))
    B.r.adapter_seen = True           # (LoRA) the adapters (attention) come before the block
    _moe_loop(B, T(H, 0, 2, "src"), H, FF, E, K)
    tok, _, _ = B.r.coefficients()
    excess = max((a + st - tok) * TOKENS + c + (B.r.weights - w) * 2
                 for _, a, _b, c, st, _s, w, _u in B.r.transients)
    return tok * TOKENS - (H * 2 * TOKENS if trained else 0), excess


@pytest.mark.parametrize("trained", [False, True])
def test_loop_recipe_counts_the_real_blocks_saved_tensors_and_backward_peak(trained):
    block = LoopBlock(trained)
    x = torch.randn(TOKENS, H, dtype=torch.bfloat16, requires_grad=True) * 1   # a non-leaf, as a layer's
    with LiveBytes() as live:
        out = block(x)
        after_forward = live.current - out.numel() * 2                    # less the block's output
        grad = torch.randn_like(out)                                        # the layer output's gradient
        live.reset_peak()
        start = live.current - grad.numel() * 2
        out.backward(grad)
        peak = live.peak - start
    saved, excess = _recipe(trained)
    # less this router's own int64 pick (gather's index; transformers' router has none)
    assert after_forward - 2 * TOKENS * 8 == saved
    assert peak == excess


def test_loop_backward_holds_one_experts_rows():
    """The busiest backward moment is one expert's SwiGLU backward: 3 (rows, f) gradients of
    ``top_k / E`` rows per token, where 5.x's grouped experts hold ``top_k`` rows per token."""
    B = Builder(Policy.of("bf16"), False)
    _moe_loop(B, T(H, 0, 2, "src"), H, FF, E, K)
    acts = [a for name, a, *_ in B.r.transients if name == "experts.act.backward"]
    assert len(acts) == E
    # 3 n f products, the layer output's gradient, the routing weights' and (but the first) the input's
    assert acts[-1] == (3 * K / E * FF + H + K) * 2
    assert acts[0] == acts[-1] + H * 2


@pytest.mark.parametrize("version, loop", [("4.36.0", True), ("4.48.1", True), ("4.57", True), ("5.0", False),
                                           (None, False)])
def test_release_rule(version, loop):
    from trainmem.spec.tf_releases import parse_transformers_version
    v = parse_transformers_version(version) if version else None
    assert moe_expert_loop(resolve_model("mixtral-8x7b"), v) is loop
    assert moe_expert_loop(resolve_model("mistral-7b"), v) is False


FMS = dict(seq_len=4096, precision="bf16", optimizer="adamw", recompute="full", attention="flash",
           gpu="a100-80gb", lora_rank=16, lora_targets="q_proj,k_proj,v_proj,o_proj", lora_dropout=0.1, dp=2,
           fsdp="full", fsdp_version=1, transformers_version="4.48.1")


@pytest.mark.parametrize("batch, measured", [(2, 57554708992), (4, 64851605504)])
def test_published_fms_mixtral_lora_fsdp1_rows(batch, measured):
    """fms-acceleration a100_80gb.csv at 24bdadb (validation/published/hf_fms_mixtral8x7b_lora_g2_b*.json):
    transformers 4.48.1's expert loop; 5.x's grouped experts read +1.5 % / +2.7 % there."""
    r = trainmem.estimate("mixtral-8x7b", batch_size=batch, **FMS)
    assert abs(r.peak_allocated / measured - 1) < 0.01
    assert r.peak_where == "layer[0].experts.act.backward"
