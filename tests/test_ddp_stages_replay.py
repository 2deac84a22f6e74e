"""An interleaved pipeline rank's DDP modules in the reserved replay (``estimate/reserved/``
``_DdpStages``, ``stage_loads``, ``stage_grads``), found by the reserved column of the sampled agreement
grid (``benchmarks/bench_agreement.py --reserved``; docs/agreement.md "Peak reserved on the sampled grid").

Under ``ScheduleInterleaved1F1B`` with ``--dp`` each of the rank's virtual stages is a
``DistributedDataParallel`` of its own (``trace/distributed.py`` ``wrap_loaded``), so each broadcasts
its own weights in flat copies and makes its own first-iteration bucket at construction, and rebuilds
its own buckets at its own forward of the second step. The replay made none of them: its allocated
peak fell 15.5 % short of the estimate's on a 4-layer Llama-3.2 over pp 2 x dp 2 (the buckets the
estimate counts were never allocated).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainmem.estimate.reserved.ddp import stage_grads, stage_loads

MiB = 1 << 20


def _states(before, layer, k, after):
    return SimpleNamespace(load=tuple(before) + tuple(layer) * k + tuple(after),
                           load_split=(len(before), len(layer), len(after)))


def test_the_first_rank_holds_the_embedding_in_its_first_stage():
    st = _states([1002 * MiB], [16 * MiB, 4 * MiB], 2, [])
    assert stage_loads(st, 2) == [(1002 * MiB, 16 * MiB, 4 * MiB), (16 * MiB, 4 * MiB)]


def test_the_last_rank_holds_norm_and_a_tied_head_after_its_last_stage_layers():
    # trace's last rank of Llama-3.2 (4 layers, pp 2): stage 1's layer, then stage 3's layer, norm and
    # head, whose broadcast is one flat copy of 1234.02 MiB (the head does not fill a bucket alone)
    st = _states([1002 * MiB], [16 * MiB, 4 * MiB], 2, [8192])
    assert stage_loads(st, 2, last=True) == [(16 * MiB, 4 * MiB), (16 * MiB, 4 * MiB, 8192, 1002 * MiB)]


def test_layers_that_differ_are_not_split():
    st = SimpleNamespace(load=(1, 2, 3), load_split=())
    assert stage_loads(st, 2) is None
    assert stage_loads(_states([1], [2, 3], 3, []), 2) is None        # 3 layers on 2 stages


def test_stage_grads_follow_parameter_order_and_take_unrounded_bytes():
    items = (("before", 1, 1002 * MiB, (), 0), ("layer", 2, 22 * MiB, (), 0), ("layer", 2, 8 * MiB, (), 0),
             ("after", 1, 8192, (), 0))
    assert stage_grads(items, 2) == [[1002 * MiB, 22 * MiB, 8 * MiB], [22 * MiB, 8 * MiB, 8192]]
    assert stage_grads(items, 2, last=True) == [[22 * MiB, 8 * MiB], [22 * MiB, 8 * MiB, 8192, 1002 * MiB]]
    raw = (1002 * MiB, 21 * MiB + MiB // 2, 8 * MiB, 8192)     # a 21.5 MiB gradient is a 22 MiB block alone
    assert stage_grads(items, 2, raw=raw)[0] == [1002 * MiB, 21 * MiB + MiB // 2, 8 * MiB]


@pytest.mark.parametrize("family, precision", [("llama-gqa", "bf16-amp"), ("llama", "bf16")])
def test_the_replay_holds_every_stage_s_buckets(bench, family, precision):
    options = {"dp": 2, "grad_accum": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "precision": precision}
    r = bench.compare(bench.Case(family, 1, 512, tuple(sorted(options.items())), layers=4), reserved=True)
    # the replay's allocated peak is trace's (before, the estimate's -15.5 % and -17.0 %: no DDP bucket
    # replayed; since the head's gradient added into .grad, _accumulated, the replay's meets trace's
    # 9311 MiB on Llama-3.2), and so are the estimate's allocated moments since they count that gradient
    # too (quantities.head_moments.head_added_grads: -2.7 % before, tests/test_head_added_grad.py)
    assert abs(r.estimate.extra["replay_peak_allocated"] / r.trace.peak_allocated - 1) <= 0.01
    assert abs(r.estimate.peak_allocated / r.trace.peak_allocated - 1) <= 0.01
