"""torchtitan's per-op selective checkpointing without autocast's weight copies (fp32, pure bf16) in the
reserved replay: the layer's backward op by op after its recomputation (``estimate/reserved/layer_backward.py``
``_uncast_by_op``), as under autocast, not one block of its worst moment. Found by the reserved column of
the sampled agreement grid (``benchmarks/bench_agreement.py --reserved``; docs/agreement.md, reserved
section, "per-op recomputation without autocast").
"""
from __future__ import annotations

import pytest

from trainmem.estimate.engine import estimate

MiB = 1 << 20
PIPE = {"grad_accum": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "recompute": "op"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_per_op_backward_without_copies_is_replayed_op_by_op(bench, monkeypatch, precision):
    # Llama (h 2048) 4 layers, pp 2 interleaved, b1 s2048: the replay asked for the layer's worst
    # backward moment as one block (51 MiB in pure bf16), beside the recomputed tensors made at once
    from trainmem import allocator
    from trainmem.estimate.moments import StepFlags, tokens
    from trainmem.estimate.quantities import quantities
    from trainmem.estimate.reserved.layer_backward import _transient
    m, t = bench.Case("llama", 1, 2048, tuple(sorted({**PIPE, "precision": precision}.items())), layers=4).specs()
    n = t.batch_size * t.seq_len
    one_block = _transient(quantities(m, t, "last"), n, n * t.seq_len)
    assert one_block > 8 * MiB
    asked: list = []
    orig = allocator.CachingAllocator.allocate

    def spy(self, nbytes, tag=None, stream=None):
        asked.append(nbytes)
        return orig(self, nbytes, tag, stream)
    monkeypatch.setattr(allocator.CachingAllocator, "allocate", spy)
    estimate(m, t, reserved=True)
    assert asked and one_block not in asked


@pytest.mark.slow
def test_per_op_pure_bf16_pipeline_reserved_against_trace(bench):
    # the grid's row: Llama 4 layers b1 s2048, dp 2, interleaved, pure bf16, op recompute: the estimate's
    # peak reserved +8.5 % above trace's before (one 250 MiB logits segment more), -0.07 % after
    from trainmem.trace.api import trace
    m, t = bench.Case("llama", 1, 2048, tuple(sorted({**PIPE, "precision": "bf16", "dp": 2}.items())),
                      layers=4).specs()
    e = estimate(m, t, reserved=True)
    tr = trace(m, training=t)
    assert abs(e.peak_reserved / tr.peak_reserved - 1) <= 0.02
