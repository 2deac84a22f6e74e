"""FSDP2's root post-backward in the reserved replay, in torch 2.13's order: the root resharded (its
unsharded parameters freed) before ``foreach_reduce`` allocates the reduce-scatter input
(``_fsdp_param_group.py`` L637-638 before L688), the unsharded gradients freed by
``unsharded_grads.clear()`` but the last one, which the dim-0 loop's variable holds until
``foreach_reduce`` returns, after the sharded output is allocated (``_fsdp_collectives.py`` L580-612;
``reserved.fsdp._Fsdp.reduce``'s ``last``), and the head side's unsharded gradients made tensor by
tensor, at their own bytes (``reserved.fsdp._unsharded_head``). The replay freed the root's parameters
after its reduce, every gradient at the copy-in, and asked one 62.63 MiB block for Phi-3's head and
norm gradients: the agreement grid's Phi-3 (2 layers) b1 s2048 FSDP2 dp 2 bf16-mp full recomputation
row read -4.49 % of trace's peak reserved memory, -0.78 % now (Mistral b8 s256 FSDP2 +9.14 -> +0.06 %).
"""
from __future__ import annotations

import pytest

import alloc_spy
from trainmem.spec import TrainingSpec, resolve_model
from conftest import estimate_patched

MiB = 2**20
# the agreement grid's Phi-3 family (benchmarks/bench_agreement.py GRID_FAMILIES)
PHI3 = ("phi-3-mini", ["num_hidden_layers=2", "hidden_size=1024", "intermediate_size=2816",
                       "num_attention_heads=16", "num_key_value_heads=16"])
KW = dict(batch_size=1, seq_len=2048, dp=2, fsdp="full", loss="half", optimizer_impl="fused",
          precision="bf16-mp", recompute="full")
HEAD = 32064 * 1024 * 2          # the head's (and the embedding's) unsharded bf16 weight or gradient


def _setup():
    return resolve_model(PHI3[0], overrides=PHI3[1]), TrainingSpec(**KW)


def _around_root_reduce(monkeypatch) -> list[tuple[int, int]]:
    """The replay's events of 40 MiB and over from three before the root's first reduce-scatter input
    request (the root's fp32 gradients, flat: 250.5 MiB) to four after it."""
    m, t = _setup()
    events = alloc_spy.signed_events(monkeypatch, lambda: estimate_patched(monkeypatch, m, t, []))
    big = [(sign, n) for sign, n in events if n >= 40 * MiB]
    j = next(i for i, (sign, n) in enumerate(big) if sign > 0 and 250 * MiB <= n < 251 * MiB)
    return big[j - 3:j + 5]


def test_root_resharded_before_its_reduce(monkeypatch, one_torch_thread):
    """The root's two unsharded bf16 parameters (embedding, head) freed before its reduce-scatter input
    is asked for."""
    window = _around_root_reduce(monkeypatch)
    assert window[0] == (-1, HEAD) and window[1] == (-1, HEAD)


def test_last_gradient_held_past_the_output(monkeypatch, one_torch_thread):
    """After the input: the embedding's gradient freed (``clear``), the sharded output (125.25 MiB, fp32)
    asked for, then the head's gradient freed (the loop variable's), then the input (kept as
    ``reduce_scatter_states`` until the next step's first post-backward; the optimizer step frees the
    replay's here)."""
    window = _around_root_reduce(monkeypatch)
    assert window[4] == (-1, HEAD)
    assert window[5][0] > 0 and 125 * MiB <= window[5][1] < 126 * MiB
    assert window[6] == (-1, HEAD)


def test_grid_row_peak_reserved_as_traces(one_torch_thread):
    """The grid's row within 1.5 % of trace's peak reserved memory (-4.49 % before)."""
    from trainmem.estimate.engine import estimate
    from trainmem.trace.api import trace
    m, t = _setup()
    e, tr = estimate(m, t, reserved=True), trace(m, training=t)
    assert e.peak_reserved == pytest.approx(tr.peak_reserved, rel=0.015)
