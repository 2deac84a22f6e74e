"""A linear's fp32 input that autocast casts and does not save, alive in the reserved replay while the
linear runs (``layers.linear_inputs``, ``reserved.layer_forward._saved_and_casts``).

The agreement grid's simplest row, GPT-2 (2 layers, n_embd 768, full vocabulary) b1 s1024 under
bf16 autocast with nothing else set, read +18.5 % over trace's peak reserved memory (2063.6 against
1742.0 MiB) with the allocated peaks within 0.5 %. GPT-2's GELU (``NewGELUActivation``) returns
fp32 under autocast, and ``GPT2MLP.forward`` holds that (b, s, 4h) output while ``c_proj`` casts its
weight; the replay, which made only the saved half cast, never opened trace's 20 MiB segment for the
weight copy. That segment later takes autograd's cuBLAS workspace in trace; in the replay the
workspace split a logits segment for good, the tied embedding's summed gradient then opened a
148 MiB segment and the second step's loss a third logits one.
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.trace.api import trace
import alloc_spy

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_head": 12, "n_layer": 2,
        "vocab_size": 50257, "n_positions": 1024, "activation_function": "gelu_new"}
KW = dict(batch_size=1, seq_len=1024, precision="bf16-amp")


def _large_segments(monkeypatch, run) -> list[int]:
    """The sizes of the segments of 64 MiB and over the caching allocator opens while ``run()`` runs,
    in order (both the replay's and trace's being ``trainmem.allocator.CachingAllocator``)."""
    from trainmem.allocator_rules import segment_size
    opened: list[int] = []

    def note(pool, size):
        if segment_size(size) >= 64 * 2**20:
            opened.append(segment_size(size))
    alloc_spy.segments(monkeypatch, run, note)
    return opened


def test_gpt2_amp_replay_opens_traces_segments(monkeypatch, one_torch_thread):
    """GPT-2 bf16-amp: the replay opens trace's large segments in trace's order over both steps
    (the head's half weight, the logits, the tied gradient's and the optimizer's), and its peak
    reserved memory is trace's within 2 % (+18.5 % before); the allocated peaks within 1 %."""
    reports = {}
    ours = _large_segments(monkeypatch, lambda: reports.setdefault("e", trainmem.estimate(GPT2, **KW)))
    theirs = _large_segments(monkeypatch, lambda: reports.setdefault("t", trace(GPT2, **KW)))
    assert len(theirs) >= 8
    assert ours == theirs
    e, t = reports["e"], reports["t"]
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01)
    assert e.peak_reserved == pytest.approx(t.peak_reserved, rel=0.02)


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 5504,
         "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 2, "vocab_size": 32000,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_not_twice_in_the_recomputation(one_torch_thread):
    """A checkpointed layer's recomputed forward: its frames' unsaved tensors are replayed by
    ``_recompute_blocks``, not again at the linears (the agreement grid's Llama b1 s1024 bf16-amp,
    offloaded activations, full recomputation, two micro-batches: +6.25 % with them, +0.56 % without)."""
    kw = dict(batch_size=1, seq_len=1024, precision="bf16-amp", recompute="full", offload_activations=True,
              grad_accum=2)
    e, t = trainmem.estimate(LLAMA, **kw), trace(LLAMA, **kw)
    assert e.peak_reserved == pytest.approx(t.peak_reserved, rel=0.02)


def test_no_unsaved_input_without_autocast():
    """In fp32 every linear saves its input itself: no entry (the replay is unchanged there); under
    autocast GPT-2's ``c_attn``, ``c_fc`` and ``mlp.c_proj`` read an unsaved fp32 input (the
    LayerNorms' outputs, h per token, and the GELU output, 4h per token: fp32 bytes), the attention's
    ``c_proj`` its saved half input."""
    from trainmem.estimate.layers import layer_coefficients
    from trainmem.estimate.quantities.model_facts import layer_key
    from trainmem.spec import TrainingSpec, resolve_model
    m = resolve_model("gpt2", overrides=["n_layer=2"])
    fp32 = layer_coefficients(layer_key(m, TrainingSpec(batch_size=1, seq_len=64, precision="fp32")))
    amp = layer_coefficients(layer_key(m, TrainingSpec(batch_size=1, seq_len=64, precision="bf16-amp")))
    assert fp32.linear_inputs == ()
    assert [(a, b) for a, b, _ in amp.linear_inputs] == [(768 * 4, 0.0), (0.0, 0.0), (768 * 4, 0.0),
                                                         (4 * 768 * 4, 0.0)]
