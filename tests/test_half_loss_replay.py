"""The reserved replay's backward of ``--loss half`` under autocast (``reserved.loss_backward._half_logps_backward``):
``NllLossBackward0``'s fp32 gradient, ``ToCopyBackward0``'s half copy of it, then
``_log_softmax_backward_data``'s half gradient of the logits, the saved half log-probabilities freed
after it, as trace's op stream runs them.

The case is the agreement grid's GPT-2 row ``gpt2 8x256 loss=half optimizer_impl=fused recompute=op``
(docs/agreement_grid.json), whose estimate read -16.3 % under trace's peak reserved memory (2029.6
against 2424.0 MiB) with the allocated peaks within 0.1 %: the replay made one half logits-sized
tensor in the loss backward where trace makes two, so the head's fp32 weight gradient went to a 198 MiB
half-logits segment instead of a 394 MiB fp32 one, the Adam states followed, and the second step's
fp32 logits found room that trace does not (docs/validation.md, `resop`).
"""
from __future__ import annotations

import trainmem
from trainmem.trace.api import trace
import alloc_spy

# GPT-2 small's widths, two layers: (8 x 256) x 50257 logits are 196.3 MiB in bf16, 392.6 MiB in fp32,
# and the tied (50257, 768) fp32 embedding's gradient is 147.2 MiB
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_head": 4, "n_layer": 2,
        "n_positions": 1024, "vocab_size": 50257, "n_inner": None, "activation_function": "gelu_new"}
KW = dict(batch_size=8, seq_len=256, precision="bf16-amp", loss="half", optimizer_impl="fused", recompute="op",
          use_cache=False)
MIB = 2**20


def _large_requests(monkeypatch, run) -> list[int]:
    """Sizes (MiB, rounded) of the requests of 190 MiB and over (the logits-sized tensors) that the
    caching allocator gets while ``run()`` runs, up to the first one of 140-150 MiB (the head's
    weight gradient in fp32: the loss's backward is over); the replay's and trace's allocator is the
    same ``trainmem.allocator.CachingAllocator``."""
    seen: list[int] = []
    done = []

    def note(nbytes, stream):
        if not done and 140 * MIB <= nbytes <= 150 * MIB and seen:
            done.append(True)
        elif not done and nbytes >= 190 * MIB:
            seen.append(round(nbytes / MIB))
    alloc_spy.requests(monkeypatch, run, note)
    return seen


def test_half_loss_backward_node_by_node(monkeypatch, one_torch_thread):
    """The first step's logits-sized requests in trace's order (the half logits, log_softmax's half
    output, nll_loss's fp32 copy; backward: the fp32 gradient, the half copy, the half logits'
    gradient), and the peak reserved memory within 1 % of trace's (-16.3 % before); allocated within 0.5 %."""
    reports = {}
    ours = _large_requests(monkeypatch, lambda: reports.setdefault("e", trainmem.estimate(GPT2, **KW)))
    theirs = _large_requests(monkeypatch, lambda: reports.setdefault("t", trace(GPT2, **KW)))
    assert theirs == [196, 196, 393, 393, 196, 196]
    assert ours == theirs
    e, t = reports["e"], reports["t"]
    assert abs(e.peak_reserved / t.peak_reserved - 1) < 0.01
    assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.005
