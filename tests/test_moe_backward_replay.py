"""A grouped-experts MoE block's backward in the allocator replay op by op (``reserved.layer_backward._moe_backward``):
each op's tensors as their own blocks, down's and gate/up's weight gradients made inside their
``_grouped_mm`` backward (an accumulated one a tensor of its own), and the block's saved tensors freed as
autograd releases them. The one block of the layer's worst moment counted gate/up's gradient twice (the
op's constant, then the layer's gradients) beside every saved tensor of the block.
"""
from __future__ import annotations

import pytest

from trainmem.spec import TrainingSpec, resolve_model
import alloc_spy

#: the agreement grid's Mixtral shape (benchmarks/bench_agreement.py ``FAMILIES["mixtral"]``)
OVERRIDES = ["num_hidden_layers=2", "hidden_size=1024", "intermediate_size=3584", "num_attention_heads=16",
             "num_key_value_heads=4"]
E, H, F = 8, 1024, 3584


def _setup(**kw):
    opts = dict(batch_size=1, seq_len=1024, precision="fp32", optimizer="sgd")
    opts.update(kw)
    return resolve_model("mixtral-8x7b", overrides=OVERRIDES), TrainingSpec(**opts)


def _asked(monkeypatch, fn, sizes: set) -> list:
    """The requests of one of ``sizes`` (bytes) the allocator gets while ``fn()`` runs, in order."""
    asked: list = []
    alloc_spy.requests(monkeypatch, fn, lambda nbytes, stream: asked.append(nbytes))
    return [x for x in asked if x in sizes]


def _sizes(t: TrainingSpec) -> tuple:
    S = 2 * t.batch_size * t.seq_len                              # top-2 rows
    return S * H * 4, S * F * 4, 2 * S * F * 4, E * F * H * 4, 2 * E * F * H * 4


def test_the_replay_makes_the_experts_backward_op_by_op(monkeypatch):
    from trainmem.estimate.engine import estimate, forget_replays
    m, t = _setup()
    rows, act, up, down_w, up_w = _sizes(t)
    forget_replays()                                            # (the replay runs under the spy)
    got = _asked(monkeypatch, lambda: estimate(m, t, reserved=True), {rows, act, up, down_w, up_w})
    # combine (three fp32 gradients and the cast), down (output and input gradients, its weight's),
    # SwiGLU (three), gate/up (its output's and input's gradients, its weight's)
    layer = [rows] * 5 + [act, down_w] + [act] * 3 + [up, rows, up_w]
    i = got.index(up_w, 4)                                      # (after the load's weights)
    assert got[i - len(layer) + 1:i + 1] == layer, got          # before: one block of 112 MiB, then the gradients


@pytest.mark.slow
def test_the_replay_asks_what_trace_asks(monkeypatch):
    """Every request of the block's (S, f) and (S, 2f) sizes and its weights' (the load's, the gradients),
    the whole run (two steps), in trace's order; and a second micro-batch's accumulated expert gradients
    (a tensor of their own); under FSDP2 the unsharded gradients made there too (each a tensor of its
    own, handed to the post-backward hook with the layer's others). (The (S, h) rows are left out: at b1 s512 they are the size of an (h, h)
    weight, whose gradient a second micro-batch also accumulates.)"""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from trainmem.estimate.engine import estimate, forget_replays
    from trainmem.trace.api import trace
    for kw in ({}, {"grad_accum": 2, "batch_size": 1, "seq_len": 512}, {"dp": 2, "fsdp": "full"}):
        m, t = _setup(**kw)
        sizes = set(_sizes(t)[1:])
        forget_replays()
        est = _asked(monkeypatch, lambda: estimate(m, t, reserved=True), sizes)
        tr = _asked(monkeypatch, lambda: trace(m, training=t), sizes)
        assert est == tr, (kw, est, tr)
