"""DeepSpeed ZeRO-3's ``defragment`` at the stage-3 optimizer's init moves only the partitions of the
parameters it optimizes into its flat buffer (v0.19.8 ``stage3.py`` L440-443 ``trainable_param_groups`` ->
``_create_fp16_partitions_with_defragmentation`` L913-973, ``_get_parameter_partitions`` L1020-1021;
``zero/utils.py`` ``defragment`` L215-243): a frozen parameter's partition (LoRA's base weights) stays where
it was (``states._defragmented``). And the reserved replay's ZeRO-3 module order around the head
(``reserved.zero_gather._Zero3Replay``): the head's parameters released as its forward returns, before the loss, and,
in backward, gathered at the logits' gradient, after the loss's backward.

Found by the agreement grid's row ``llama-gqa 1x1024 contiguous_gradients=False dp=2 grad_accum=2
hold_output=step lora_dropout=0.05 lora_rank=64 optimizer=sgd-momentum overlap_comm=False precision=bf16
reduce_bucket_size=1000000 zero=3``: the replay freed every partition and emptied the cache to 0 where
trace keeps 898 MiB reserved around the frozen partitions."""
from __future__ import annotations

import pytest

from trainmem.estimate.states import zero3_init_build, zero3_whole_load
import alloc_spy

LOAD = [("a.weight", 400), ("a.bias", 40), ("buf", 8), ("b.weight", 400)]
WHOLE = {"a.weight": 800, "a.bias": 80, "b.weight": 800}


@pytest.mark.parametrize("build", [zero3_whole_load, zero3_init_build])
def test_only_trained_partitions_are_defragmented(build):
    """Every parameter is partitioned (its partition at len(load) + i); ``defragment`` frees the trained
    ones' partitions only, empties the cache and allocates their sum as the flat buffer; with no
    ``trained`` set every parameter is moved, as before."""
    n = len(LOAD)
    events, _peak = build(LOAD, WHOLE, lambda b: b, {"b.weight"})
    e = events.index(("e",))
    assert events[e - 1] == ("f", n + 3) and ("f", n) not in events[e - 3:e]
    assert events[e + 1] == ("a", 2 * n, 400)
    events, _peak = build(LOAD, WHOLE, lambda b: b)
    e = events.index(("e",))
    assert {ev for ev in events[e - 3:e]} == {("f", n), ("f", n + 1), ("f", n + 3)}
    assert events[e + 1] == ("a", 2 * n, 840)
    events, _peak = build(LOAD, WHOLE, lambda b: b, set())          # LoRA: the base all frozen
    e = events.index(("e",))
    assert events[e - 1][0] != "f" or events[e - 1][1] < n
    assert events[e + 1] == ("a", 2 * n, 0)


ROW = dict(batch_size=1, seq_len=1024, contiguous_gradients=False, dp=2, grad_accum=2, hold_output="step",
           lora_dropout=0.05, lora_rank=64, optimizer="sgd-momentum", overlap_comm=False, precision="bf16",
           reduce_bucket_size=1000000, zero=3)


@pytest.mark.slow
def test_head_fetches_in_trace_order(monkeypatch, one_torch_thread):
    """The grid row's first requests of 240 MiB and over (the tied 501 MiB table gathered, 250.5 MiB
    partitions and bf16 logits, 501 MiB fp32 loss tensors) in trace's order through the first
    micro-batch's head backward: the head's backward fetch after the logits' gradient."""
    import sys
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from bench_agreement import Case
    from trainmem.estimate import engine
    from trainmem.trace.api import trace
    opts = tuple(sorted((k, v) for k, v in ROW.items() if k not in ("batch_size", "seq_len")))
    m, t = Case("llama-gqa", 1, 1024, opts, 2).specs()

    def requests(run) -> list[float]:
        seen: list[float] = []

        def note(nbytes, stream):
            if nbytes >= 240 * 2**20:
                seen.append(round(nbytes / 2**20, 1))
        alloc_spy.requests(monkeypatch, run, note)
        return seen
    engine.forget_replays()
    ours = requests(lambda: engine.estimate(m, t, reserved=True))
    theirs = requests(lambda: trace(m, training=t))
    assert ours[:11] == theirs[:11]
