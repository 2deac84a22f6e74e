"""The reserved replay of the LM head's backward under a chunked loss (``--loss-chunks``;
``estimate/reserved/loss_backward.py`` ``_chunk_head_backward``), found by the reserved column of the sampled
agreement grid (``benchmarks/bench_agreement.py --reserved``, docs/agreement.md "Peak reserved").

The head runs once per chunk, and each chunk's matmul backward makes a weight gradient of the whole
head; the first two meet in an out-of-place add, so two chunk gradients and their sum exist at once
(``quantities.head_grads.chunk_head_grads``, which the allocated moments already count). The replay made only the
final gradient, so it neither reserved the three blocks nor reached the moments' allocated peak.
Before -> after, estimate / trace - 1 of peak reserved: GPT-2 (2 layers) 2 x 512, bf16-amp, 8 chunks
-11.62% -> +0.53%; Gemma-2 (2 layers) 2 x 1024, pure bf16, 4 chunks -> +19.62% -> +0.01%.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _row(bench, family, shape, **options):
    b, s = shape
    return bench.compare(bench.Case(family, b, s, tuple(sorted(options.items()))), reserved=True)


@pytest.mark.parametrize("family, shape, options", [
    # autocast: the chunk gradients in bf16, their sum cast to the fp32 .grad at the end
    ("gpt2", (2, 512), {"loss": "chunked", "loss_chunks": 8}),
    # pure bf16, tied head: the sum is the gradient that waits in the embedding's input buffer
    ("gemma2", (2, 1024), {"loss": "half", "loss_chunks": 4, "optimizer": "paged-adamw-8bit",
                           "precision": "bf16"}),
])
def test_chunked_head_backward_reserves_as_trace(bench, family, shape, options):
    r = _row(bench, family, shape, **options)
    assert abs(r.diff) <= 0.02                       # the allocated peak agrees (as before)
    assert abs(r.reserved_diff) <= 0.02, r.reserved_diff


def test_replay_reaches_the_chunk_sum_moment():
    """The replay's allocated peak (``extra["replay_peak_allocated"]``) is the moments' at
    ``lm_head.backward.sum`` (three chunk gradients of the tied head alive, pure bf16), within the few
    KiB the replay's small blocks differ by: before, the replay never held them and peaked 11.6%
    lower, so the gap it reported stood on a peak the step does not have."""
    from trainmem.estimate.engine import estimate
    from trainmem.spec import TrainingSpec, resolve_model
    m = resolve_model("llama-3.2-1b", overrides=["num_hidden_layers=2"])
    t = TrainingSpec(batch_size=1, seq_len=1024, precision="bf16", attention="eager", loss="chunked",
                     loss_chunks=4)
    rep = estimate(m, t, reserved=True)
    assert rep.peak_where == "lm_head.backward.sum"
    assert rep.extra["replay_peak_allocated"] == pytest.approx(rep.peak_allocated, rel=1e-4)
