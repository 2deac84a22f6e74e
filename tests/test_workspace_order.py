"""Where the reserved replay makes the forward thread's cuBLAS workspace: at the first layer's first
matmul, after that layer's FSDP all-gather and copy-out (``reserved.layer_forward._layer_forward``), not before
the gather.

The case is the one docs/validation.md's nineteenth-session ``logits`` section left: FSDP2 full
shard over 2 ranks, a wide 2-layer Llama (b4 s512, vocab 8000) with the model's own loss and full
recomputation, whose estimate read +11.3 % over trace's peak reserved memory (596.8 against 536.0
MiB) with the allocated peaks within 0.6 %: a fourth 62.5 MiB fp32-logits segment in the second
step's loss backward. The workspace (8.125 MiB, its own 20 MiB segment) was made before layer 0's
all-gather, so its segment took the copied-out weights that trace places elsewhere, and the two
layouts parted from there (``ckout`` branch, docs/validation.md).
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.trace.api import trace
import alloc_spy

# a wide 2-layer Llama: its fp32 logits (4 x 512 x 8000 x 4 B = 62.5 MiB) and its top layer's flat
# parameter (24.5 MiB gathered) both matter (tests/test_fp32_logits_replay.py's WIDE)
WIDE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 2,
        "vocab_size": 8000, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "silu"}
BASE = dict(batch_size=4, seq_len=512, precision="bf16", use_cache=False, recompute="full")


def _segments_opened(monkeypatch, run) -> list[int]:
    """The sizes of the large segments the caching allocator opens on the default stream (in order)
    while ``run()`` runs, both the replay's and trace's being ``trainmem.allocator.CachingAllocator``
    (not the all-gather stream's: the root's gather, 31.25 MiB in trace, is a little over 32 MiB in
    the estimate's flat buffer, so its segment is 2 MiB apart, before and after)."""
    from trainmem.allocator_rules import segment_size
    opened: list[int] = []

    def note(pool, size):
        if not pool.small and pool.stream == 0:
            opened.append(segment_size(size))
    alloc_spy.segments(monkeypatch, run, note)
    return opened


def test_fsdp2_workspace_after_the_first_layers_gather(monkeypatch, one_torch_thread):
    """FSDP2, full recomputation: the replay opens trace's large segments in trace's order through
    the first step's forward (up to its three logits segments), and its peak reserved memory is
    trace's within 2 % (+11.3 % before); the allocated peaks within 0.5 %."""
    kw = dict(BASE, dp=2, fsdp="full", fsdp_version=2)
    reports = {}
    ours = _segments_opened(monkeypatch, lambda: reports.setdefault("e", trainmem.estimate(WIDE, **kw)))
    theirs = _segments_opened(monkeypatch, lambda: reports.setdefault("t", trace(WIDE, **kw)))
    logits = 3 * [64 * 2**20]                       # the fp32 logits, the shifted copy, the gradient
    end = next(i for i in range(len(theirs)) if theirs[i:i + 3] == logits) + 3
    assert ours[:end] == theirs[:end]
    e, t = reports["e"], reports["t"]
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.005)
    assert e.peak_reserved == pytest.approx(t.peak_reserved, rel=0.02)


#: measured on head (2026-11-26): +3.0 % since the causal LM's head side is replayed tensor by tensor
#: (``quantities.outer.causal_lm_head_tensors``); the replay's first step is in lockstep with trace through the
#: head (the final norm's 8, 8, 8, 4, 4 MiB tensors in the same segments, 158 MiB reserved, 148.3 MiB
#: allocated at the logits), then the first optimizer step opens segments for 5.5, 2, 5.5 and 16 MiB
#: requests where trace opens them for 5.5, 5.5 and 15.625 MiB (the replay requests the 8000 x 1024 bf16
#: states at 16 MiB, ``block_bytes``): one 20 MiB segment more. Before, the head side as one 20 MiB block
#: left holes that happened to absorb that difference (662 = 662 MiB).
ONE_GPU_STATES = "first optimizer step's states placed differently (+3.0 %); the head side matches trace"


@pytest.mark.parametrize("setup", [
    pytest.param({}, marks=pytest.mark.xfail(strict=True, reason=ONE_GPU_STATES)),
    dict(dp=2, fsdp="full", fsdp_version=1)], ids=["one-gpu", "fsdp1"])
def test_workspace_order_elsewhere(one_torch_thread, setup):
    """The same model on one GPU (where nothing comes between the embedding and the first layer's
    first matmul, so the order is unchanged) and under FSDP1: peak reserved within 2 % of trace's."""
    kw = dict(BASE, **setup)
    e, t = trainmem.estimate(WIDE, **kw), trace(WIDE, **kw)
    assert e.peak_reserved == pytest.approx(t.peak_reserved, rel=0.02)
