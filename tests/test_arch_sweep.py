"""Architectures of transformers' causal-LM list (benchmarks/bench_architectures.py, docs/architectures.md):
the generic causes the sweep found, each on a tiny config of the type."""
from __future__ import annotations

import warnings

import pytest

import trainmem

from conftest import load_benchmark

bench = load_benchmark("bench_architectures")
SETUP = dict(batch_size=2, seq_len=64, precision="bf16-amp")



def test_decoder_only_class_of_an_encoder_decoder_family_trains_no_cross_attention():
    """BartForCausalLM runs no encoder_attn without encoder_hidden_states: those parameters get no
    gradient and no optimizer state, in the estimate as in the trace."""
    cfg = bench.tiny_config("bart")
    r = trainmem.resolve(cfg, **SETUP)
    unused = [p for p in r.model.parameter_tensors() if p.role == "unused"]
    assert unused and all("encoder_attn" in p.name for p in unused)
    est, tr = trainmem.estimate(r), trainmem.trace(r)
    # the trace reports each state's bytes, the estimate each in 512 B blocks: they differ by the rounding alone
    trained = [p for p in r.model.parameter_tensors() if p.role != "unused"]
    rounding = sum(-(-p.numel * 4 // 512) * 512 - p.numel * 4 for p in trained)
    assert est.component("optimizer_states") - tr.component("optimizer_states") == 2 * rounding


def test_fuyu_text_step_leaves_its_vision_embedding_untrained():
    cfg = bench.tiny_config("fuyu")
    r = trainmem.resolve(cfg, **SETUP)
    assert {p.name for p in r.model.parameter_tensors() if p.role == "unused"} == \
        {"model.vision_embed_tokens.weight", "model.vision_embed_tokens.bias"}


@pytest.mark.parametrize("model_type", ["mixtral", "llama"])
def test_every_parameter_of_a_decoder_trains(model_type):
    """A MoE's experts and routers are never marked untrained by the meta step (its routing of meta
    tokens is no real routing), nor is any parameter of a plain decoder."""
    r = trainmem.resolve(bench.tiny_config(model_type), **SETUP)
    assert not [p.name for p in r.model.parameter_tensors() if p.role == "unused"]


@pytest.mark.slow
def test_sweep_a_handful_of_types():
    rows = bench.sweep(["llama", "gpt2", "bart", "mixtral", "deepseek_v3"], timeout=120)
    assert [r["status"] for r in rows] == ["OK"] * 5
    assert all(abs(r["peak_pct"]) < 3 for r in rows)


def test_dsa_indexer_gets_no_gradient_and_its_scores_set_the_forward_peak():
    """DeepSeek-V3.2's DSA indexer runs under no_grad (its parameters get no gradient, no optimizer state)
    and its (b, index_n_heads, s, s) fp32 scores inside the top layer's forward are the step's peak: the
    derived decoder measures its top layer's forward moments (trace.derive._decoder_top). Before: -68%
    at sequence 512 (the forward peak taken at the loss, the indexer's states counted)."""
    cfg = bench.tiny_config("deepseek_v32")
    r = trainmem.resolve(cfg, batch_size=2, seq_len=512, precision="bf16-amp")
    unused = {p.name for p in r.model.parameter_tensors() if p.role == "unused"}
    assert unused and all(".indexer." in n for n in unused)
    est, tr = trainmem.estimate(r), trainmem.trace(r)
    assert "indexer" in tr.peak_where
    assert abs(est.peak_allocated / tr.peak_allocated - 1) < 0.03


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_the_cache_the_output_holds_is_counted_once_at_the_top_forward(model_type):
    """The linear-attention layers' cache states die with the output (``del out``, inside the traced
    forward phase), so the measured top-forward moment (``trace.derive._top_forward``) holds them, and
    the engine's moment adds every layer's cache again (``kv_held``): ``derived.top_forward`` takes
    them off. Before: +4.11% and +2.15% (the sweep's config, 2 x 128), its peak 30.4 MiB too high."""
    r = trainmem.resolve(bench.tiny_config(model_type), batch_size=2, seq_len=128, precision="bf16-amp")
    est, tr = trainmem.estimate(r), trainmem.trace(r)
    assert abs(est.peak_allocated / tr.peak_allocated - 1) < 0.01
