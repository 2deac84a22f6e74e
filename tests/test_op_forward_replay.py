"""A layer's first forward under torchtitan's per-op selective checkpointing (``--recompute op``),
replayed in its code's order (``reserved.layer_forward._op_forward``): the policy's outputs (odd ``aten.mm`` calls,
the fused SDPA kernel's) kept where their op runs, every other tensor freed as the code drops it, and
under autocast each linear's half weight copy cached where the linear runs (the checkpoint is
non-reentrant: grad mode stays on, ``autocast_mode.cpp`` ``cached_cast``).

Found on the agreement grid's Llama-3.2-shaped row (2 layers, b8 s256, bf16-amp, Adam, for-loop):
the replay made the layer's tensors at once, then the policy's outputs, and no weight copies, so its
first forward opened 7 segments of 32 MiB (the MLP's width and its weights' bf16 copies) to trace's 12.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import alloc_spy  # noqa: E402
from alloc_spy import segments  # noqa: E402

from trainmem import estimate, trace  # noqa: E402
from trainmem.estimate.nograd import NoGradLayer, llama_layer  # noqa: E402

MiB = 1 << 20
CUT = dict(set=["num_hidden_layers=2"], batch_size=8, seq_len=256, precision="bf16-amp", recompute="op",
           optimizer="adam", optimizer_impl="for-loop", loss="half")


def test_policy_keeps_odd_mms_and_the_sdpa_output():
    """Of a Llama layer's seven linears (q, k, v, o, gate, up, down) the 1st, 3rd, 5th and 7th
    outputs, and the fused attention's output, are what the per-op policy keeps, in the order made."""
    L = NoGradLayer(h=64, q=64, kv=16, f=160, stream=4, half=2, weight=4, amp=True)
    S = llama_layer(L)
    assert len(S.mm) == 7 and len(S.sdpa) == 1
    kept = S.op_kept()
    assert kept == sorted([S.mm[0], S.mm[2], S.mm[4], S.mm[6], S.sdpa[0]])
    widths = sorted(S.sizes[i] for i in kept)                    # bytes per token, bf16
    assert widths == sorted([64 * 2, 16 * 2, 160 * 2, 64 * 2, 64 * 2])


def _opened(monkeypatch, run) -> list[int]:
    """Sizes of the segments opened between the first two of at least 256 MiB (the tied embedding's
    table, made with the parameters, and the head's output): the first forward's layers."""
    sizes: list[int] = []

    def note(pool, size):
        sizes.append(size)
    segments(monkeypatch, run, note)
    table, logits = [i for i, s in enumerate(sizes) if s >= 256 * MiB][:2]
    return sizes[table + 1:logits]


@pytest.mark.slow
def test_first_forward_opens_trace_s_mlp_segments(monkeypatch):
    """The segments of the MLP's width (32 MiB: its bf16 gate, up and down weight copies, cached, and
    its intermediate tensors) that the two layers' first forward opens: as many as trace's."""
    est = _opened(monkeypatch, lambda: estimate("llama-3.2-1b", **CUT))
    tr = _opened(monkeypatch, lambda: trace("llama-3.2-1b", **CUT))
    assert est.count(32 * MiB) == tr.count(32 * MiB) > 6



def _backward_requests(monkeypatch, run) -> list[int]:
    """Sizes (MiB, rounded) of the requests of 32 MiB and more in the first backward's layers: between
    the 4th and 5th requests of at least 1000 MiB (the parameters' embedding table, the fp32 logits,
    their gradient, the head's weight gradient; then the embedding's gradient)."""
    seen: list[int] = []
    big = [0]

    def note(nbytes, stream):
        if nbytes >= 1000 * MiB:
            big[0] += 1
        elif big[0] == 4 and nbytes >= 32 * MiB:
            seen.append(round(nbytes / MiB))
    alloc_spy.requests(monkeypatch, run, note)
    return seen


@pytest.mark.slow
def test_backward_op_by_op_after_recomputation(monkeypatch):
    """The layer's backward under the per-op policy replayed as a layer's without recomputation
    (``reserved.layer_backward._by_op``) after its recomputation: each MLP weight's fp32 gradient (64 MiB,
    ``ToCopyBackward0``) is made right after its bf16 one (32 MiB, ``mm``), three per layer, as in
    trace; the backward as one block of its worst moment made the three fp32 ones in a row."""
    ours = _backward_requests(monkeypatch, lambda: estimate("llama-3.2-1b", **CUT))
    theirs = _backward_requests(monkeypatch, lambda: trace("llama-3.2-1b", **CUT))
    for seq in (theirs, ours):
        grads = [i for i, x in enumerate(seq) if x == 64]
        assert len(grads) == 6 and all(seq[i - 1] == 32 for i in grads), seq


def test_recomputation_takes_the_policy_outputs_from_its_cache():
    """The outputs the per-op policy keeps that the layer also saves for its backward (v_proj's, which
    SDPA saves; the attention's output and logsumexp; the gate's, which SiLU saves;
    ``LayerCoefs.op_saved``) are handed back by the policy's cache when the layer is recomputed
    (torch 2.13 ``utils/checkpoint.py`` ``_CachedTorchDispatchMode``), so the replay's recomputation
    makes them 0 bytes (``reserved.layer_forward._op_recomputed``). q_proj's output (read by the rotation, whose
    products save ``cos`` and ``sin``, not it) and down_proj's (read by the residual add) are kept by
    the policy but saved by nothing."""
    from trainmem.estimate.layers import layer_coefficients
    from trainmem.estimate.quantities.model_facts import layer_key
    from trainmem.spec.resolve import resolve
    r = resolve("llama-3.2-1b", **CUT)
    lc = layer_coefficients(layer_key(r.model, r.training))
    rest = [tuple(map(float, t)) for t in lc.op_tensors]
    for i in lc.op_saved:
        rest.remove(tuple(map(float, lc.tensors[i])))            # each one a kept output
    assert len(lc.op_saved) == 4 and rest == [(2048 * 2.0, 0.0)] * 2   # (b, s, h) bf16, per token


def _before_workspace(monkeypatch, run) -> list[float]:
    """Sizes (MiB) of the four requests of 1 MiB and more before the forward's cuBLAS workspace (the
    first request of 8-9 MiB that is not a whole number of MiB: 8.125 MiB here)."""
    seen: list[int] = []
    alloc_spy.requests(monkeypatch, run, lambda nbytes, stream: seen.append(nbytes) if nbytes >= MiB else None)
    i = next(i for i, x in enumerate(seen) if x % MiB and 8 * MiB < x < 9 * MiB)
    return [x / MiB for x in seen[i - 4:i]]


@pytest.mark.slow
def test_workspace_after_the_first_matmul_output(monkeypatch):
    """The forward thread's cuBLAS workspace is made inside q_proj's matmul, after its output (and
    autocast's input cast and weight copy before it: ``reserved.layer_forward._first_mm_workspace``), as trace makes
    it: the input norm's output (16 MiB), then 8, 8, 8 MiB. The replay made it before the layer, after
    the parameters."""
    ours = _before_workspace(monkeypatch, lambda: estimate("llama-3.2-1b", **CUT))
    theirs = _before_workspace(monkeypatch, lambda: trace("llama-3.2-1b", **CUT))
    assert theirs == [16.0, 8.0, 8.0, 8.0]
    assert ours == theirs
