"""Tracer vs reality on the CPU: ``trace(..., device="cpu")`` against a real CPU run.

The real run executes the same program (transformers model from the same config, the same
training step, 2 steps of AdamW) on real CPU tensors under ``torch.profiler`` with
``profile_memory=True``; its allocator events are replayed (cumulative sum of their signed byte
counts, in time order) to get the peak. The tracer never computes anything: it runs the program on
FakeTensors and sums storage sizes. Tiny GPT-2, BERT (masked LM) and Llama-like (GQA, SwiGLU,
RMSNorm, rotary) configs: 2 layers, hidden 64, 4 heads, vocab 1000, batch 4 x 64, fp32, dropout as
configured (GPT-2 and BERT 0.1: the CPU dropout keeps a float mask).
"""
from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import trainmem
from trainmem.spec import TrainingSpec
from trainmem.trace.api import _hf_factory, _hf_step, trace

CONFIGS = {
    "gpt2": ("gpt2", ["n_layer=2", "n_embd=64", "n_head=4", "vocab_size=1000", "n_positions=128"]),
    "bert": ("bert-large-uncased", ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4",
                                    "intermediate_size=256", "vocab_size=1000", 'architectures=["BertForMaskedLM"]']),
    "llama": ("llama-3.1-8b", ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4",
                               "num_key_value_heads=2", "intermediate_size=256", "vocab_size=1000", "head_dim=16"]),
}


def _real_cpu_peak(spec, training, steps=2) -> int:
    """Peak of a real CPU run, from the profiler's memory events (independent of the tracer)."""
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = _hf_factory(spec, training)()
        model.train()
        _, step = _hf_step(model, spec, training, "cpu")
        for i in range(1, steps + 1):
            step(i)
        del model, step
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    assert events, "the profiler recorded no allocations"
    return peak


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_trace_matches_real_cpu_run(name, attention):
    model, overrides = CONFIGS[name]
    spec = trainmem.resolve_model(model, overrides=overrides)
    training = TrainingSpec(batch_size=4, seq_len=64, precision="fp32", attention=attention)
    t0 = time.perf_counter()
    report = trace(spec, device="cpu", training=training)
    elapsed = time.perf_counter() - t0
    real = _real_cpu_peak(spec, training)
    rel = (report.peak_allocated - real) / real
    print(f"\n{name}/{attention}: trace peak {report.peak_allocated:,} B, real {real:,} B ({rel:+.4%}), "
          f"trace {elapsed:.1f}s, at {report.peak_phase}: {report.peak_where}")
    assert abs(rel) < 0.005
    assert report.peak_reserved is None and report.extra["device"] == "cpu"
    assert report.phase("zero_grad", 2).allocated <= report.phase("optimizer_step", 2).allocated
