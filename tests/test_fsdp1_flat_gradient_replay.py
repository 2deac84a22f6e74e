"""FSDP1 full fine-tuning in the reserved replay: the end of a layer's backward and the lazy init.

Found by Llama-2-7B cut to 2 layers, b2 s1024, pure bf16, full reentrant recomputation, flash SDPA,
FSDP1 dp 2 full fine-tuning, against trace's peak reserved memory: -11.03 % (after the no-grad
replay of ``estimate/nograd.py``), -5.95 % once the layer's recomputed tensors and its transient are
freed before the flat gradient's ``cat`` (``reserved.fsdp._fsdp1_reduce``), -0.49 % with FSDP1's lazy init
(``quantities.fsdp1.fsdp1_lazy_init``). Its LoRA r64 twin: -5.41 % -> -4.29 %.
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.estimate.quantities.build import quantities
from trainmem.estimate.reserved.layer_backward import _fsdp1_early_views
from trainmem.spec.resolve import resolve

CUT = dict(set=["num_hidden_layers=2"], batch_size=2, seq_len=1024, precision="bf16", recompute="full",
           attention="flash", use_cache=False, reentrant=True, dp=2, fsdp="full", fsdp_version=1)


def test_full_finetuning_follows_trace():
    """The replay's allocated peak is the flat gradient's ``cat`` (the layer's views and the cat,
    its other tensors freed), and the forward's activations fill the segment the lazy init cached."""
    est = trainmem.estimate("llama-2-7b", gpu="a100-80gb", **CUT)
    tr = trainmem.trace("llama-2-7b", gpu="a100-80gb", **CUT)
    assert est.peak_allocated == pytest.approx(tr.peak_allocated, rel=0.015)
    assert est.peak_reserved == pytest.approx(tr.peak_reserved, rel=0.015)


def _q(**kw):
    r = resolve("llama-2-7b", **{**CUT, **kw})
    return quantities(r.model, r.training)


def test_early_views_are_the_later_linears_gradients():
    """By the layer's worst backward moment only the linears after it have their weight gradient:
    each early view is a linear's gradient, last linear first, and fewer than all of them."""
    q = _q()
    st = q.detail.states
    n, nsq = 2 * 1024, 2 * 1024 * 1024
    early = _fsdp1_early_views(q, st, n, nsq)
    grads = [round(w) * g for _p, w, g in q.detail.layer.linears]
    assert 0 < len(early) < len(grads)
    assert [st.layer_tensors[j] for j in early] == grads[::-1][:len(early)]
    assert _fsdp1_early_views(_q(lora_rank=8), _q(lora_rank=8).detail.states, n, nsq) == []


@pytest.mark.parametrize("precision,per_unit", [("bf16", 1), ("bf16-mp", 3)])
def test_lazy_init_buffers(precision, per_unit):
    """``init_flat_param_attributes``: the padded unsharded flat parameter of the root and of a layer,
    at its own bytes (not an allocator block); under parameter mixed precision first the bf16 shard
    and then the fp32 twin as well."""
    q = _q(precision=precision)
    st = q.detail.states
    init = q.fsdp1_init
    assert len(init) == 2 * per_unit
    root, layer = init[:per_unit], init[per_unit:]
    full = root[per_unit // 2]
    assert full == q.fsdp1_root_raw and sum(st.root_tensors) <= full < sum(st.root_tensors) + 16 * len(st.root_tensors)
    assert sum(st.layer_tensors) <= layer[per_unit // 2] <= st.layer_params_full
    if per_unit == 3:
        assert root == (full // 2, full, 2 * full)
    assert _q(fsdp_version=2).fsdp1_init == ()


def test_flat_bytes_pads_each_parameter_to_16_bytes_and_the_total_to_the_world():
    """``_init_flat_param_and_metadata``: a parameter starts at a 16-byte aligned element (8 bf16
    elements), the total is padded to a multiple of the world size; the bytes are the elements'."""
    from trainmem.estimate.quantities.fsdp1 import fsdp1_flat_bytes
    assert fsdp1_flat_bytes((6, 16), 2, 1) == 32            # 3 elements, 5 of padding, then 8
    assert fsdp1_flat_bytes((6, 6), 2, 4) == 2 * 12         # 3 + 5 + 3 elements = 11, padded to 12
    assert fsdp1_flat_bytes((4, 4), 4, 2) == 24             # fp32 (4 elements aligned): 1 + 3 + 1 = 5, padded to 6
    assert fsdp1_flat_bytes((), 2, 2) == 0
