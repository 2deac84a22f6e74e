"""``--mixer-kernels fused``: Qwen3.5's and Qwen3-Next's gated delta net under flash-linear-attention's and
causal-conv1d's Functions (trainmem.fla_modules). The checks: the emulated Functions save what the packages'
``ctx.save_for_backward`` saves (shapes, dtypes, fla's fp32 tensors) and return gradients of their inputs'
shapes and dtypes; trace runs them in the mixer (the step keeps less than the reference path's); the
estimate's coefficients derived under the fused path agree with trace; other models and --compile
refuse the option in one line."""
from __future__ import annotations

import warnings

import pytest
import torch

import trainmem
from trainmem import fla_modules
from trainmem.spec.kernel_paths import reference_path_note

warnings.filterwarnings("ignore")

#: Qwen3.5's text model (hidden 128, 4 layers: three linear-attention and one full; 2 key heads, 4 value heads:
#: fla's grouped value heads) and Qwen3-Next (hidden 256, 4 layers, 4 experts) at small sizes, as the
#: point-derivation tests build them
from test_pointderive import QWEN35, QWEN3_NEXT  # noqa: E402
SETUP = dict(batch_size=2, seq_len=512, precision="bf16-amp")


def _mixer_inputs(b: int = 2, t: int = 100, h: int = 2, hv: int = 4, k: int = 32, v: int = 16):
    """q, k, v as the mixer hands them over: views of the conv output's (B, T, C) transpose; g fp32, beta bf16."""
    c = 2 * h * k + hv * v
    conv = torch.randn(b, c, t, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()   # (B, T, C), a view
    q, kk, vv = torch.split(conv, [h * k, h * k, hv * v], dim=-1)
    q, kk, vv = q.reshape(b, t, h, k), kk.reshape(b, t, h, k), vv.reshape(b, t, hv, v)
    g = torch.randn(b, t, hv, dtype=torch.float32, requires_grad=True)
    beta = torch.rand(b, t, hv, dtype=torch.bfloat16, requires_grad=True)
    return conv, q, kk, vv, g, beta


def test_chunk_rule_saves_what_fla_saves():
    """chunk.py L310-326 at v0.5.2: the l2-normalised q and k (their dtype) with fp32 rstd per row, a
    contiguous copy of v, the fp32 chunk-local cumsum of g, beta, and A (B, T, HV, 64) in k's dtype."""
    conv, q, k, v, g, beta = _mixer_inputs()
    o, final = fla_modules.ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, True, True)
    saved = o.grad_fn.saved_tensors
    shapes = [(tuple(s.shape), s.dtype) for s in saved]
    bf, f32 = torch.bfloat16, torch.float32
    assert shapes == [((2, 100, 2, 32), bf), ((2, 100, 2), f32), ((2, 100, 2, 32), bf), ((2, 100, 2), f32),
                      ((2, 100, 4, 16), bf), ((2, 100, 4), f32), ((2, 100, 4), bf), ((2, 100, 4, 64), bf)]
    assert saved[4].is_contiguous() and not v.is_contiguous()  # input_guard's copy of the view
    assert saved[6] is beta or saved[6].data_ptr() == beta.data_ptr()  # beta kept itself (already contiguous)
    assert (o.shape, o.dtype) == ((2, 100, 4, 16), bf)
    assert (tuple(final.shape), final.dtype) == ((2, 4, 32, 16), f32)  # the recurrent state, fp32 (fwd_h L707)


def test_chunk_rule_without_final_state_or_l2norm():
    _, q, k, v, g, beta = _mixer_inputs()
    o, final = fla_modules.ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, False, False)
    saved = o.grad_fn.saved_tensors
    assert final is None and saved[1] is None and saved[3] is None   # no rstd without the in-kernel l2norm


def test_chunk_rule_gradients_have_their_inputs_shapes_and_dtypes():
    """The backward returns dq, dk over the key heads (GVA's sums, chunk_o.py L761-763, wy_fast.py L340-341),
    dv, dg in g's fp32 and db in beta's dtype: they reach the mixer's own tensors."""
    conv, q, k, v, g, beta = _mixer_inputs()
    o, final = fla_modules.ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, True, True)
    o.float().sum().backward()
    assert conv.grad.shape == conv.shape and conv.grad.dtype == conv.dtype
    assert (g.grad.dtype, beta.grad.dtype) == (torch.float32, torch.bfloat16)


def test_causal_conv1d_saves_its_input_and_keeps_the_layout():
    """CausalConv1dFn (interface L24-59 at v1.6.1.post4): a channel-last input (the mixer's transposed
    projection) is not copied, the output has its layout (``empty_like``), and (x, weight, bias) are saved;
    the weight's gradient comes back in the weight's dtype."""
    x = torch.randn(2, 100, 48, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()   # (B, C, T), stride(1) == 1
    w = torch.randn(48, 1, 4, requires_grad=True)                                       # nn.Conv1d's fp32 weight
    out = fla_modules.causal_conv1d_fn(x, w.squeeze(1), None, activation="silu")
    assert out.stride() == x.stride() and out.dtype == x.dtype
    saved = out.grad_fn.saved_tensors
    assert saved[0].data_ptr() == x.data_ptr() and saved[1].shape == (48, 4) and saved[2] is None
    out.float().sum().backward()
    assert x.grad.shape == x.shape and w.grad.dtype == torch.float32


def test_fused_mixers_swaps_and_restores_the_modeling_functions():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
    before = mq.torch_chunk_gated_delta_rule, mq.causal_conv1d_fn
    t = trainmem.resolve(QWEN35, mixer_kernels="fused", **SETUP).training
    with fla_modules.fused_mixers(t):
        assert (mq.torch_chunk_gated_delta_rule, mq.causal_conv1d_fn) == (fla_modules.chunk_gated_delta_rule,
                                                                           fla_modules.causal_conv1d_fn)
    assert (mq.torch_chunk_gated_delta_rule, mq.causal_conv1d_fn) == before


def test_trace_runs_the_fused_mixer_and_says_so():
    ref = trainmem.trace(QWEN35, **SETUP)
    fused = trainmem.trace(QWEN35, mixer_kernels="fused", **SETUP)
    # the reference path keeps fp32 copies of q, k, v and per-chunk fp32 products; fla keeps half q, k, v
    assert fused.peak_allocated < ref.peak_allocated
    assert fused.training.mixer_kernels == "fused"
    assert reference_path_note("qwen3_5_text", "fused") in fused.warnings
    assert reference_path_note("qwen3_5_text") in ref.warnings
    assert "give --mixer-kernels fused" in reference_path_note("qwen3_5_text")
    assert "give --mixer-kernels fused" in reference_path_note("mamba2")  # (mamba-ssm's path: trainmem.mamba_kernels)
    assert "not modelled" in reference_path_note("kimi_linear")  # (other flash-linear-attention kernels)


@pytest.mark.parametrize("cfg", [QWEN35, pytest.param(QWEN3_NEXT, marks=pytest.mark.slow)], ids=["qwen3_5", "qwen3_next"])
def test_fused_estimate_agrees_with_trace(cfg):
    est = trainmem.estimate(cfg, mixer_kernels="fused", **SETUP)
    tr = trainmem.trace(cfg, mixer_kernels="fused", **SETUP)
    ref = trainmem.estimate(cfg, **SETUP)
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.01
    assert est.peak_allocated < ref.peak_allocated  # coefficients derived under the fused path, keyed apart
    assert any("--mixer-kernels fused" in w for w in est.warnings)


@pytest.mark.parametrize("model, options, names", [
    ("llama-3.2-1b", {}, "--mixer-kernels fused: llama has no state-space mixer"),
    (QWEN35, {"compile": True}, "--mixer-kernels fused is modelled in eager steps"),
    (QWEN35, {"mixer_kernels": "triton"}, "--mixer-kernels"),
    (QWEN35, {"transformers_version": "5.20.0"}, "modelled on transformers 5.24's gated delta net"),
])
def test_refused_in_one_line(model, options, names):
    opts = {"mixer_kernels": "fused", **SETUP, **options}
    with pytest.raises(trainmem.TrainmemError) as e:
        trainmem.estimate(model, **opts)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_measure_runs_what_is_installed():
    """measure takes the path the installed packages decide (transformers calls fla's rule when it imports):
    --mixer-kernels fused is refused in one line where flash-linear-attention and causal-conv1d do not import."""
    from trainmem.spec.kernel_paths import measured_path_note
    with pytest.raises(trainmem.TrainmemError, match="--mixer-kernels fused: measure runs the path the installed"):
        measured_path_note("qwen3_5_text", "fused", installed=False, on_cuda=True)
    assert "fused-kernel path" in measured_path_note("qwen3_next", "fused", installed=True, on_cuda=True)


def test_derived_key_names_the_fused_path():
    from trainmem.estimate import derived
    ref = trainmem.resolve(QWEN35, **SETUP)
    fused = trainmem.resolve(QWEN35, mixer_kernels="fused", **SETUP)
    assert derived.key(fused.model, fused.training) != derived.key(ref.model, ref.training)
