"""A Llama-style layer's attention on SDPA's math kernel in op order in the allocator replay
(``layers._llama_math_attention``, ``_math_group``, ``_math_kernel``; replayed by
``reserved.layer_forward._group_allocs``): the rotary embedding's temporaries, the KV cache's ``torch.cat``
copies, autocast's casts of SDPA's inputs and the kernel's own tensors (torch 2.13
``aten/src/ATen/native/transformers/attention.cpp`` ``_scaled_dot_product_attention_math``: fp32 copies of
half inputs, the (s, s) causal mask, ``repeat_interleave``'s keys and values, ``matmul``'s copy of the strided
scaled query at more than one sequence, the scores, softmax, ``attn @ v`` and its half copy). Before, the
replay made only the scores and the saved tensors, so the Mixtral-shaped fp32 real-H200 run's second forward
found room trace does not (docs/agreement.md, reserved section, ``mathattn``).
"""
from __future__ import annotations

import pytest

from trainmem.spec import TrainingSpec, resolve_model
import alloc_spy

SMALL = ["num_hidden_layers=2", "hidden_size=512", "intermediate_size=1024", "num_attention_heads=8",
         "num_key_value_heads=2", "vocab_size=1000"]


def _setup(precision: str, batch: int):
    m = resolve_model("llama-3.2-1b", overrides=SMALL)
    return m, TrainingSpec(batch_size=batch, seq_len=384, precision=precision, attention="sdpa-math")


def _around_scores(monkeypatch, fn, scores: int) -> list[int]:
    """The requests of 32 KiB and over from 20 before the first layer's scores to 4 after them."""
    seen = alloc_spy.large_requests(monkeypatch, fn, 32 * 1024)
    i = seen.index(scores)
    assert i >= 20 and seen.count(scores) >= 4                       # (a size no other tensor has)
    return seen[i - 20:i + 5]


@pytest.mark.parametrize("precision,batch", [("fp32", 2), ("bf16", 2), ("bf16-amp", 2), ("fp32", 1), ("bf16", 1)])
def test_the_replay_asks_what_trace_asks_around_the_math_kernel(monkeypatch, precision, batch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from trainmem.estimate.engine import estimate, forget_replays
    from trainmem.trace.api import trace
    m, t = _setup(precision, batch)
    scores = batch * m.num_heads * t.seq_len * t.seq_len * 4          # (b, heads, s, s) fp32
    forget_replays()                                                  # (the replay runs under the spy)
    est = _around_scores(monkeypatch, lambda: estimate(m, t, reserved=True), scores)
    tr = _around_scores(monkeypatch, lambda: trace(m, training=t), scores)
    assert est == tr


def test_the_recipe_writes_one_sequence_apart():
    """At one sequence per micro-batch the scaled query is saved where it is made; at more, ``matmul``'s
    copy of it is saved after the scaled keys (the same bytes: the events differ, not the saved tensors)."""
    from trainmem.estimate.quantities.build import quantities
    m, t = _setup("fp32", 2)
    groups = [g for g in quantities(m, t).detail.layer.fwd_groups if len(g) > 3]
    assert len(groups) == 1
    _at, temps, many, one = groups[0]
    assert many.count("s") == one.count("s") == 5                  # q, v, k, softmax, the context
    assert many != one
    assert sum(len(c) > 2 and c[3] == 1.0 for c in temps) == 1     # the scaled query: a temporary at b > 1
    assert sum(len(c) > 2 and c[2] > 0 for c in temps) == 3        # ones, tril, the fp32 mask: per (s, s)


@pytest.mark.parametrize("precision,batch", [("bf16", 2), ("bf16-amp", 1)])
def test_equal_heads_on_the_cache_s_copies(monkeypatch, precision, batch):
    """Equal key/value heads (no ``repeat_interleave``): the values' fp32 copy is saved before the scaled
    query, and only the query is copied by ``matmul`` at more than one sequence (the cache's copies are
    contiguous; trace, b2 s256 bf16)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from trainmem.estimate.engine import estimate, forget_replays
    from trainmem.trace.api import trace
    m = resolve_model("llama-3.2-1b", overrides=[o.replace("heads=2", "heads=8") for o in SMALL])
    t = TrainingSpec(batch_size=batch, seq_len=384, precision=precision, attention="sdpa-math")
    scores = batch * m.num_heads * t.seq_len * t.seq_len * 4
    forget_replays()
    est = _around_scores(monkeypatch, lambda: estimate(m, t, reserved=True), scores)
    tr = _around_scores(monkeypatch, lambda: trace(m, training=t), scores)
    assert est == tr


def test_the_cache_copies_are_held_with_the_output():
    """The KV cache's ``torch.cat`` copies live as long as the model's output (trace, the small model b2 s256
    bf16: the four freed together after the loss, before backward): the group hands them to the replay
    ("cK", ``_LayerCarry.out_refs``), which ``driver._forward`` frees with the output; they were freed with the
    rotated query at ``o_proj``."""
    from trainmem.estimate.quantities.build import quantities
    from trainmem.estimate.reserved.layer_forward import _group_allocs
    from trainmem.estimate.reserved.replay import _Replay
    m, t = _setup("bf16", 2)
    lc = quantities(m, t).detail.layer
    _at, temps, events = next(g[:3] for g in lc.fwd_groups if len(g) > 3)
    held = [int(e[1:]) for e in events if e[0] == "c"]
    kv = m.num_kv_heads * m.head_dim * 2                            # (b, s, kv heads x d) bf16 per token
    assert [temps[i] for i in held] == [(kv, 0), (kv, 0)]
    R = _Replay()
    _group_allocs(R, [1 << 20], (0, [1 << 20, 1 << 20], ("t", "c0", "t", "s", "f1")), True, None)
    assert len(R.layer.out_refs) == 1 and R.a.allocated >= 2 << 20             # the held copy and the saved tensor stay


def test_no_cache_no_held_copies():
    from trainmem.estimate.quantities.build import quantities
    m, _t = _setup("bf16", 2)
    t = TrainingSpec(batch_size=2, seq_len=384, precision="bf16", attention="sdpa-math", recompute="op")
    groups = [g for g in quantities(m, t).detail.layer.fwd_groups if len(g) > 3]
    assert groups and not any(e[0] == "h" for e in groups[0][2])
