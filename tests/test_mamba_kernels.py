"""``--mixer-kernels fused``: mamba-ssm's fused Mamba / Mamba-2 mixer Functions as trace emulates them
(``trainmem.mamba_kernels``).

- Each emulated Function saves for backward what mamba-ssm's saves (v2.2.6.post3: ``MambaInnerFn`` L275-277,
  ``MambaSplitConv1dScanCombinedFn`` L835-836): shapes and dtypes under bf16 autocast, and returns a gradient
  of each input's shape.
- The option is refused in one line for a model without a modelled fused path and by measure where the
  packages do not import; the report says which path is modelled.
- The derived estimate under it agrees with trace under it (slow).
- A hybrid whose model builds its cache in training skips the fused function, as transformers does (slow).
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import trainmem
from trainmem import mamba_kernels
from trainmem.errors import TrainmemError
from trainmem.spec.kernel_paths import fused_path_problem, measured_path_note, reference_path_note

warnings.filterwarnings("ignore")


def _saved(fn, *args):
    """The (shape, dtype) of every tensor ``fn(*args)`` saves for backward, the output, and the input gradients."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*args)
    grads = torch.autograd.grad(out.float().sum(), [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad])
    return saved, out, grads


def test_mamba_inner_saves_what_mamba_ssm_saves():
    b, d, length, n, r, hidden, w = 2, 8, 16, 4, 2, 6, 4
    p = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    xz = torch.randn(b, length, 2 * d).to(torch.bfloat16).requires_grad_().transpose(1, 2)  # in_proj(h).transpose
    args = (xz, p(d, 1, w), p(d), p(r + 2 * n, d), p(d, r), p(hidden, d), None, p(d, n), p(d), p(d))
    saved, out, grads = _saved(lambda *a: mamba_kernels.mamba_inner_fn(*a[:8], None, None, a[8], delta_bias=a[9]), *args)
    bf, f32 = torch.bfloat16, torch.float32
    assert saved == [((b, 2 * d, length), bf),                 # xz, made contiguous (L206-207)
                     ((d, w), f32), ((d,), f32),               # conv weight "d 1 w -> d w", bias
                     ((b * length, r + 2 * n), bf),            # x_dbl
                     ((r + 2 * n, d), bf), ((d, r), bf), ((hidden, d), bf),   # weights in the autocast dtype
                     ((d, n), f32), ((b, 1, n, length), bf), ((b, 1, n, length), bf),   # A, B, C
                     ((d,), f32), ((d,), f32),                 # D, delta_bias
                     ((b, d, math.ceil(length / 2048), 2 * n), f32),   # the scan's intermediates
                     ((b, d, length), bf)]                     # out (conv1d_out and delta recomputed: lvl 1)
    assert out.shape == (b, length, hidden) and out.dtype == bf
    assert [g.shape for g in grads] == [a.shape for a in args if a is not None]


@pytest.mark.parametrize("gated_norm", [True, False], ids=["rmsnorm", "z-gate"])
def test_split_conv1d_scan_saves_what_mamba_ssm_saves(gated_norm):
    b, length, h, hd, g, n, hidden, chunk = 2, 24, 4, 8, 2, 4, 6, 16
    dim, conv = h * hd, h * hd + 2 * g * n
    p = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    zxbcdt = torch.randn(b, length, 2 * dim + 2 * g * n + h).to(torch.bfloat16).requires_grad_()
    args = (zxbcdt, p(conv, 4), p(conv), p(h), p(h), p(h), p(dim) if gated_norm else None, p(hidden, dim), None)
    fn = lambda z, cw, cb, dtb, A, D, nw, ow, ob: mamba_kernels.split_conv1d_scan_combined(  # noqa: E731
        z, cw, cb, dtb, A, D, chunk, rmsnorm_weight=nw, outproj_weight=ow, outproj_bias=ob, headdim=hd, ngroups=g)
    saved, out, grads = _saved(fn, *args)
    bf, f32 = torch.bfloat16, torch.float32
    norm = [((dim,), f32), ((g * b * length,), f32)] if gated_norm else []   # rmsnorm weight, fp32 rstd
    assert saved == [((b, length, 2 * dim + 2 * g * n + h), bf),   # zxbcdt, the in-projection's output
                     ((conv, 4), f32), ((conv,), f32),             # conv weight, bias
                     ((b, length, h, hd), bf),                     # out_x: the scan's output
                     ((h,), f32), ((h,), f32), ((h,), f32),        # A, D, dt_bias
                     *norm, ((hidden, dim), bf)]                   # the out-projection's weight, autocast
    assert out.shape == (b, length, hidden) and out.dtype == bf
    assert [gr.shape for gr in grads] == [a.shape for a in args if a is not None]


def test_fused_path_is_refused_or_named():
    assert fused_path_problem("mamba") is None and fused_path_problem("granitemoehybrid") is None
    assert "--mixer-kernels fused" in fused_path_problem("jamba") and "drop it" in fused_path_problem("llama")
    assert "fused-kernel path" in reference_path_note("nemotron_h", "fused")
    assert "mamba_split_conv1d_scan_combined" in reference_path_note("mamba2", "fused")
    assert "reference PyTorch path" in reference_path_note("mamba2")
    with pytest.raises(TrainmemError, match="do not import here"):
        measured_path_note("mamba2", "fused", installed=False, on_cuda=True)
    assert "fused-kernel path" in measured_path_note("mamba2", "reference", installed=True, on_cuda=True)
    assert measured_path_note("llama", "reference", installed=False, on_cuda=True) == ""


def test_option_is_refused_for_a_model_without_a_fused_path():
    with pytest.raises(TrainmemError, match="--mixer-kernels fused") as e:
        trainmem.estimate("llama-3.2-1b", batch_size=1, seq_len=64, mixer_kernels="fused")
    assert "\n" not in str(e.value)
    with pytest.raises(TrainmemError, match="--mixer-kernels"):
        trainmem.estimate("llama-3.2-1b", batch_size=1, seq_len=64, mixer_kernels="triton")


#: Mamba-2 (hidden 64, 2 layers, 4 heads of 32, state 16, chunk 32) and Mamba (hidden 32, 2 layers, state 8)
MAMBA2 = dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], hidden_size=64, num_hidden_layers=2,
              vocab_size=1000, num_heads=4, head_dim=32, n_groups=1, state_size=16, chunk_size=32)
MAMBA = dict(model_type="mamba", architectures=["MambaForCausalLM"], hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, vocab_size=1000, state_size=8, time_step_rank=4)


@pytest.mark.parametrize("cfg", [MAMBA, MAMBA2], ids=["mamba", "mamba2"])
def test_fused_trace_keeps_less_and_says_so(cfg):
    """The fused Functions keep no per-step states (Mamba) or chunk tensors (Mamba-2) between forward and
    backward: the trace's peak falls, and the report names the path."""
    runs = {k: trainmem.trace(cfg, batch_size=2, seq_len=64, precision="bf16-amp", mixer_kernels=k)
            for k in ("reference", "fused")}
    assert runs["fused"].peak_allocated < runs["reference"].peak_allocated
    assert runs["fused"].training.mixer_kernels == "fused"
    assert any("fused-kernel path" in w for w in runs["fused"].warnings)
    assert any("reference PyTorch path" in w for w in runs["reference"].warnings)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [MAMBA, MAMBA2], ids=["mamba", "mamba2"])
def test_fused_estimate_is_derived_under_the_fused_path(cfg):
    """The coefficients are traced with the emulated Functions (their own cache key): estimate meets trace."""
    kw = dict(batch_size=2, seq_len=256, precision="bf16-amp", mixer_kernels="fused")
    est, tr = trainmem.estimate(cfg, **kw), trainmem.trace(cfg, **kw)
    ref = trainmem.estimate(cfg, **dict(kw, mixer_kernels="reference"))
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.015
    assert est.peak_allocated < ref.peak_allocated


#: Granite 4.0-H (hidden 64, a Mamba-2 layer and an attention layer, 4 experts; use_cache on by default)
GRANITE_H = dict(model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 vocab_size=1000, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                 layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16,
                 mamba_chunk_size=32)


@pytest.mark.slow
def test_hybrid_with_a_training_cache_skips_the_fused_function():
    """Granite 4.0-H's model builds its cache in training when use_cache is on (the config's), and its mixer
    calls the fused function only without one: fused traces as the reference path, and says so; with
    --use-cache false the fused Function runs."""
    kw = dict(batch_size=2, seq_len=64, precision="bf16-amp")
    ref = trainmem.trace(GRANITE_H, mixer_kernels="reference", **kw)
    cached = trainmem.trace(GRANITE_H, mixer_kernels="fused", **kw)
    fused = trainmem.trace(GRANITE_H, mixer_kernels="fused", use_cache=False, **kw)
    assert cached.peak_allocated == ref.peak_allocated
    assert any("run the reference PyTorch path all the same" in w for w in cached.warnings)
    assert fused.peak_allocated < trainmem.trace(GRANITE_H, mixer_kernels="reference", use_cache=False, **kw).peak_allocated
    assert any("fused-kernel path" in w for w in fused.warnings)


def test_measure_refuses_a_fused_path_the_packages_cannot_run():
    """measure runs what the installed packages decide: without mamba-ssm (this machine) fused is refused."""
    from trainmem.measure.runner import measure
    with pytest.raises(TrainmemError, match="--mixer-kernels fused: measure") as e:
        measure(MAMBA, device="cpu", batch_size=1, seq_len=16, mixer_kernels="fused")
    assert "\n" not in str(e.value)


def test_coefficients_are_keyed_by_the_path_traced():
    """The derived coefficients' cache key carries the fused path where it is traced, and not where the model's
    training cache makes the mixers skip it (they trace the reference path: its coefficients are shared)."""
    from trainmem.estimate import derived
    from trainmem.spec.config import spec_from_config
    from trainmem.spec.training import TrainingSpec
    m, hybrid = spec_from_config(MAMBA2), spec_from_config(GRANITE_H)
    t = {k: TrainingSpec(batch_size=2, seq_len=64, mixer_kernels=k) for k in ("reference", "fused")}
    no_cache = {k: TrainingSpec(batch_size=2, seq_len=64, mixer_kernels=k, use_cache=False) for k in t}
    assert derived.key(m, t["fused"]) != derived.key(m, t["reference"])
    assert derived.key(hybrid, t["fused"]) == derived.key(hybrid, t["reference"])
    assert derived.key(hybrid, no_cache["fused"]) != derived.key(hybrid, no_cache["reference"])
