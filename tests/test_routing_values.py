"""The values a MoE router's top-k choice decides, in a trace without data (``trace.routing_values``): a
balanced routing, and the per-expert loops sized from it (DBRX, JetMoE, LongCat-Flash)."""
from __future__ import annotations

import pytest
import torch

import trainmem
from trainmem.allocator import ExactAllocator
from trainmem.trace.cuda import EMULATED
from trainmem.trace.routing_values import balanced_topk
from trainmem.trace.tracker import Tracker

from conftest import load_benchmark

bench = load_benchmark("bench_architectures")
SETUP = dict(batch_size=2, seq_len=64, precision="bf16-amp")


@pytest.mark.parametrize("tokens,k,n", [(7, 2, 4), (128, 2, 6), (5, 3, 3), (64, 8, 64)])
def test_balanced_topk_spreads_the_choices_evenly_and_distinctly(tokens, k, n):
    idx = balanced_topk((tokens, k), -1, n)
    assert idx.shape == (tokens, k) and idx.dtype == torch.int64
    counts = torch.bincount(idx.flatten(), minlength=n)
    assert counts.max() - counts.min() <= 1 and counts.sum() == tokens * k
    assert all(len(set(row.tolist())) == k for row in idx)  # k distinct experts per token


def test_balanced_topk_along_another_dimension():
    idx = balanced_topk((3, 2, 5), 1, 4)  # topk over dim 1 of a (3, n, 5) input
    assert idx.shape == (3, 2, 5)
    assert sorted(torch.bincount(idx.flatten(), minlength=4).tolist()) == [7, 7, 8, 8]


def _loop(hidden: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor, k: int) -> list[int]:
    """DBRX's expert loop (transformers 5.24 ``models/dbrx/modeling_dbrx.py`` L290-306): the rows each expert
    gets, from ``nonzero`` of the experts hit and ``torch.where`` of each one's mask."""
    e = logits.shape[-1]
    _, top = torch.topk(logits, k, dim=-1)
    mask = torch.nn.functional.one_hot(top, num_classes=e + 1).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    rows = []
    for expert in hit:
        _, tok = torch.where(mask[expert[0]])
        out = hidden[tok] @ weight[int(expert[0].item())]
        rows.append(out.shape[0])
    return rows


def test_a_per_expert_loop_on_tensors_without_data_gets_the_balanced_rows():
    tracker = Tracker(ExactAllocator(), device_type=EMULATED)
    hidden = torch.empty(30, 8, device=EMULATED)
    logits = torch.empty(30, 4, device=EMULATED)
    weight = torch.empty(4, 8, 8, device=EMULATED)
    with tracker:
        rows = _loop(hidden, logits, weight, 2)
    assert rows == [15, 15, 15, 15]  # 30 tokens x top-2 over 4 experts, every expert hit
    assert tracker.peak > 0


def test_split_sizes_read_back_by_tolist_are_the_counts():
    """JetMoE's ``zeros.scatter(1, top_k_indices, 1).long().sum(0).tolist()`` (``modeling_jetmoe.py`` L187-195)."""
    from trainmem.trace.cuda import CudaEmulation
    tracker = Tracker(ExactAllocator(), device_type=EMULATED)
    with CudaEmulation(tracker), tracker:
        logits = torch.empty(10, 3, device=EMULATED)
        _, top = logits.topk(2, dim=1)
        gates = torch.zeros(10, 3, device=EMULATED).scatter(1, top, 1)
        sizes = gates.long().sum(0).tolist()
        parts = torch.empty(20, 4, device=EMULATED).split(sizes, dim=0)
    assert sizes == [7, 7, 6] and [p.shape[0] for p in parts] == sizes


def test_the_weight_slices_autocast_casts_are_counted_as_weight_copies():
    """DBRX multiplies by each expert's slice, cast at every call (a view: autocast's cache takes none): the
    derivation measures those copies apart (``derived.view_casts``), not as activations of the constant left out."""
    from trainmem.estimate.derived import view_casts
    r = trainmem.resolve(bench.tiny_config("dbrx"), **SETUP)
    tr = trainmem.trace(r)
    traced = sum(c.bytes for c in tr.components if c.name.endswith("autocast_weight_view"))
    assert traced > 0
    assert view_casts(r.model, r.training, "first") * r.model.num_layers == traced


def test_a_view_of_the_whole_weight_is_the_copy_the_engine_counts():
    """Falcon's ``x @ self.weight.T`` casts a view of the whole weight at every call: the same bytes as the
    cached copy the engine counts for it (``layer_matmul_half``), so no weight-slice copy is added (+0.44 % with)."""
    from trainmem.estimate.derived import view_casts
    r = trainmem.resolve(bench.tiny_config("falcon"), **SETUP)
    assert view_casts(r.model, r.training, "first") == 0
    est, tr = trainmem.estimate(r), trainmem.trace(r)
    assert abs(est.peak_allocated - tr.peak_allocated) < 0.001 * tr.peak_allocated
