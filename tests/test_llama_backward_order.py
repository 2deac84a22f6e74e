"""A Llama decoder layer's backward in the allocator replay in trace's op order, without recomputation (pure
bf16, fp32, and under bf16 autocast with its half weight gradients, weight copies and casts back): the SwiGLU MLP's nodes (transformers 5.24.0 ``models/llama/modeling_llama.py`` ``LlamaMLP``:
down's ``MmBackward0``, the product's ``MulBackward0``, up's, ``SiluBackward0``, gate's, the two input
gradients summed) and the post-attention RMSNorm's (L62-67: ``MulBackward0`` of the weight's product,
``ToCopyBackward0``, ``MulBackward0`` of ``hidden * rsqrt``, ``MeanBackward0``, ``PowBackward0``, the
input's gradients summed and, in half, cast back, then added to the residual stream's), each tensor made,
freed and released where autograd does (``layers._swiglu_backward``, ``layers._rms_norm_backward_half``,
``layers._rms_norm_backward_fp32``, ``layers._swiglu_backward_autocast``; ``reserved.layer_backward._run_group``). Before, the replay made each
op's moment as one set of blocks (the MLP product's three (b, s, f) gradients at once, each linear's input
gradient before its weight's) and nothing for the norm: on the top layer of a 2-layer Llama (h 1024,
f 2816) b2 s512 its requests and frees from down's weight gradient to the norm's input gradient differed
from trace's at the first request (docs/agreement.md, reserved section, 2026-11-26 ``bwdop``)."""
from __future__ import annotations

import pytest

from test_fsdp_grad_op_replay import WIDE

KW = dict(batch_size=2, seq_len=512, use_cache=False)
WS = 8 * 2**20 + 128 * 2**10                                    # the cuBLAS workspace (8.125 MiB)


def _signed(monkeypatch, run) -> list[int]:
    """Every request (bytes as the allocator charges them, ``block_bytes``) and free (negative) of 1 MiB
    and over while ``run()`` runs."""
    from trainmem import allocator
    from trainmem.allocator_rules import block_bytes
    from alloc_spy import requests
    seen: list[int] = []
    free = allocator.CachingAllocator.free

    def spy_free(self, handle):
        if handle in self._live and self._live[handle].requested >= 1 << 20:
            seen.append(-block_bytes(self._live[handle].requested))
        return free(self, handle)
    monkeypatch.setattr(allocator.CachingAllocator, "free", spy_free)
    requests(monkeypatch, run, lambda n, _s: seen.append(block_bytes(n)) if n >= 1 << 20 else None)
    return seen


def _mlp_backward(events: list[int], wf: int, n: int) -> list[int]:
    """``n`` events from the first request of the MLP weights' size (down's weight gradient) after the
    backward's workspace (the first after the loss freed a block of 15 MiB or more)."""
    loss = next(i for i, x in enumerate(events) if x <= -15 * 2**20)
    ws = events.index(WS, loss)
    first = events.index(wf, ws)
    return events[first:first + n]


def _want(precision: str) -> tuple[int, list[int]]:
    """The MLP's and the post-attention norm's events, written from the code (shapes from the config)."""
    from trainmem.allocator_rules import block_bytes
    e = 4 if precision == "fp32" else 2                          # the compute dtype's bytes
    tok, h, f = 2 * 512, WIDE["hidden_size"], WIDE["intermediate_size"]
    wf, af, ah, f32 = (block_bytes(x) for x in (f * h * e, tok * f * e, tok * h * e, tok * h * 4))
    if precision == "bf16-amp":
        return _want_autocast(wf, af, ah, f32, block_bytes(f * h * 4))
    mlp = [wf, af, -af,                                          # down: weight's, the product's gradient; product
           af, af, -af, -af, -af,                                # mul: up's and SiLU's; product's, silu, up
           wf, ah, -af, af, -af, -af,                            # up: weight's, input's; silu_backward; gate_out
           wf, ah, -af, -ah, ah, -ah, -ah]                       # gate: weight's, input's; the norm's out; the sum
    if e == 2:
        norm = [ah, ah, -ah, -ah, -ah, f32, -ah, f32, f32, -f32, -f32,  # weight's mul; to fp32; hidden * rsqrt
                f32, f32, f32, f32, -f32, -f32, -f32, -f32,     # mean's div, pow's three; the fp32 input
                f32, -f32, -f32, ah, -f32, ah, -ah, -ah]         # summed, cast back, added to the residual's
    else:                                                        # ... the residual's added first
        norm = _norm_fp32(f32)
    return wf, mlp + norm


def _norm_fp32(f32: int) -> list[int]:
    """The fp32 RMSNorm's backward events (the fp32 stream's, with or without autocast)."""
    return [f32, f32, -f32, -f32, -f32, f32, f32, -f32, -f32, f32, -f32, -f32,
            f32, f32, f32, f32, -f32, -f32, -f32, -f32, f32, -f32, -f32]


def _want_autocast(wf: int, af: int, ah: int, f32: int, w32: int) -> tuple[int, list[int]]:
    """Under bf16 autocast, from down's half weight gradient: each linear's half weight gradient and input
    gradient, the node's input, half weight copy and saved input released, the fp32 ``.grad`` cast, the
    half one freed, the input gradient cast back to the fp32 stream's dtype (gate's and up's)."""
    mlp = [wf, af, -ah, -af, -wf, w32, -wf,                      # down (its output's half cast freed first)
           af, af, -af, -af, -af,                                # mul
           wf, ah, -af, -wf, -ah, w32, -wf, f32, -ah,            # up: its input's cast back to fp32
           af, -af, -af,                                         # silu_backward
           wf, ah, -af, -wf, -ah, w32, -wf, f32, -ah,            # gate
           f32, -f32, -f32]                                      # the two input gradients summed
    return wf, mlp + _norm_fp32(f32)


@pytest.mark.parametrize("precision", ["bf16", "fp32", "bf16-amp"])
def test_the_replay_asks_what_the_llama_backward_makes(monkeypatch, precision):
    """Without trace: the replay's requests and frees follow the layer's backward node by node."""
    import trainmem
    wf, want = _want(precision)
    got = _mlp_backward(_signed(monkeypatch, lambda: trainmem.estimate(WIDE, precision=precision, **KW)), wf,
                        len(want))
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp32", "bf16-amp"])
def test_the_replay_asks_what_trace_asks_in_backward(monkeypatch, one_torch_thread, precision):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import trainmem
    from trainmem.trace.api import trace
    wf, want = _want(precision)
    theirs = _mlp_backward(_signed(monkeypatch, lambda: trace(WIDE, precision=precision, **KW)), wf, len(want))
    ours = _mlp_backward(_signed(monkeypatch, lambda: trainmem.estimate(WIDE, precision=precision, **KW)), wf,
                         len(want))
    assert theirs == want
    assert ours == theirs


def test_op_recompute_replays_down_proj_as_its_node_runs(monkeypatch):
    """Under torchtitan's per-op policy with bf16 autocast (a recomputed layer, replayed op by op): down's
    ``MmBackward0`` makes the weight's half gradient, then the input's (``derivatives.yaml`` ``mm``: the
    generated node computes its outputs in sorted name order, ``mat2`` before ``self``, torchgen
    ``load_derivatives.py`` L585), then releases its saved product, half weight copy and incoming half
    gradient; ``ToCopyBackward0`` casts the weight's gradient to the fp32 ``.grad`` and the half one is
    freed. Trace (b2 s256, below) shows this; before, the replay made the input's gradient first, freed
    the weight copy between the two and made the input's gradient again at the cast."""
    import trainmem
    from trainmem.allocator_rules import block_bytes
    kw = dict(batch_size=2, seq_len=256, use_cache=False, precision="bf16-amp", recompute="op")
    tok, h, f = 2 * 256, WIDE["hidden_size"], WIDE["intermediate_size"]
    wf, af, ah, w32 = (block_bytes(x) for x in (f * h * 2, tok * f * 2, tok * h * 2, f * h * 4))
    got = _signed(monkeypatch, lambda: trainmem.estimate(WIDE, **kw))
    loss = next(i for i, x in enumerate(got) if x <= -15 * 2**20)
    k = got.index(w32, got.index(WS, loss))                        # down's fp32 .grad, the top layer's first
    assert got[k - 5:k - 3] == [wf, af]                           # half weight gradient, then the input's
    assert sorted(got[k - 3:k]) == sorted([-af, -wf, -ah])         # the node's saved and input tensors freed
    assert got[k + 1] == -wf                                       # the half gradient, after the cast
