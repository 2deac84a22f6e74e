"""The reserved replay keeps autocast's cached half weight copies through a fully recomputed forward
under FSDP2 (``reserved.layer_forward._forward_casts``, ``_checkpointed``).

``cached_cast`` (``aten/src/ATen/autocast_mode.cpp``) caches the bf16 copy of an fp32 leaf weight that
requires grad until the outermost autocast exits after the loss; FSDP2's unsharded parameters are such
leaves, so every layer's copies outlive its reshard. The replay made them only where it replays the
backward linear by linear (``quantities.head_moments.per_linear_replay``: not under FSDP, TP or ZeRO), so under
FSDP2 its forward lacked them: ``make run``'s Llama-3.1-8B (FSDP2 over 8, b2 s4096, full
recomputation) read 54.56 against trace's 58.55 GiB peak reserved, its replay's allocated peak 33.0
against 44.2 GiB (docs/validation.md, ``runex``).
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.estimate import engine, reserved
from trainmem.trace.api import trace

from known_miss import still_off
from test_workspace_order import WIDE

# 4 layers: 4 x 25 MiB of cached copies (bf16 q, k, v, o 2 MiB each, gate, up, down 5.5 MiB each)
DEEP = dict(WIDE, num_hidden_layers=4)
KW = dict(batch_size=4, seq_len=512, precision="bf16-amp", use_cache=False, recompute="full",
          dp=2, fsdp="full", fsdp_version=2)


def test_fsdp2_full_recompute_keeps_the_forward_cast_cache(monkeypatch, one_torch_thread):
    """bf16-amp, FSDP2 over 2, full recomputation: the replay's allocated peak through step 1's forward
    is trace's within 1 % (-17 % without the copies)."""
    marks: dict = {}
    gap = engine.reserved_gap

    def spy(*a, **k):
        out = gap(*a, **k)
        marks.update(out[1])
        return out
    monkeypatch.setattr(engine, "reserved_gap", spy)   # (the name the engine calls, bound at its import)
    trainmem.estimate(DEEP, **KW)
    t = trace(DEEP, **KW)
    forward = next(p for p in t.phases if (p.name, p.step) == ("forward", 1))
    assert marks[("forward", 1)][1] == pytest.approx(forward.peak, rel=0.01)


def test_fsdp2_full_recompute_peak_reserved_is_traces(one_torch_thread):
    """The same setup's peak reserved memory: trace's within 2 % (-8.7 % before the cast cache; -2.6 %,
    a strict xfail, after the twentieth session's flat reduce-scatter outputs; -1.8 % measured
    2026-11-26 after the twenty-first session's FSDP and head-side replay fixes). A strict known miss at
    -3.89 % since the twenty-fourth session's ``gradop`` merge (c8003d9c, bisected): FSDP2's weight copies
    made at their own linears in the first forward (``layer_forward._fsdp2_casts``), which brought the
    grid's FSDP2 rows nearer (Qwen2 grad-op +18.27 -> -0.15 %, Mistral full recompute +9.14 -> +0.06 %),
    leave this 4-layer full-recompute setup further (-1.80 % with ``_fsdp2_casts`` off); not yet found
    why (``tools/alloc_log.py``'s method on this setup is the next step)."""
    e = trainmem.estimate(DEEP, **KW)
    t = trace(DEEP, **KW)
    err = e.peak_reserved / t.peak_reserved - 1
    if abs(err) > 0.02:
        still_off(err, 0.02, "FSDP2's forward weight copies per linear under full recomputation (gradop, "
                  "c8003d9c): -1.80 % before", at=-0.0389)
    assert e.peak_reserved == pytest.approx(t.peak_reserved, rel=0.02)


def test_forward_casts_are_the_recipes_linears():
    """Under FSDP2 the copies' sizes are the layer's linears in forward order, bf16 (out x in x 2 B),
    summing to the layer's cast bytes, made linear by linear in forward; the backward's linear-by-linear
    gate stays off there."""
    from trainmem.estimate.quantities.build import quantities
    from trainmem.spec import TrainingSpec, resolve_model
    q = quantities(resolve_model(DEEP), TrainingSpec(**{k: v for k, v in KW.items()}))
    casts = reserved.layer_forward._forward_casts(q)
    h, f = WIDE["hidden_size"], WIDE["intermediate_size"]
    assert casts == [h * h * 2] * 4 + [f * h * 2] * 3
    assert sum(casts) == q.cast_layer
    # the forward makes each copy at its linear under FSDP2 (``_fsdp2_casts``, the unsharded weight a leaf);
    # the backward's weights' gradients stay FSDP2's, not linear by linear (``_linear_replay`` off)
    assert reserved.layer_forward._linear_casts(q) == casts
    assert not reserved.layer_forward._linear_replay(q)
