"""FSDP1 full fine-tuning in the reserved replay: the end of a layer's backward and the lazy init.

Found by Llama-2-7B cut to 2 layers, b2 s1024, pure bf16, full reentrant recomputation, flash SDPA,
FSDP1 dp 2 full fine-tuning, against trace's peak reserved memory: -11.03 % (after the no-grad
replay of ``estimate/nograd.py``), -5.95 % once the layer's recomputed tensors and its transient are
freed before the flat gradient's ``cat`` (``reserved._fsdp1_reduce``), -0.49 % with FSDP1's lazy init
(``quantities.fsdp1_lazy_init``). Its LoRA r64 twin: -5.41 % -> -4.29 %.
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.estimate.quantities import quantities
from trainmem.estimate.reserved import _fsdp1_early_views
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
    """``init_flat_param_attributes``: the padded unsharded flat parameter of the root and of a layer;
    under parameter mixed precision first the bf16 shard and then the fp32 twin as well."""
    q = _q(precision=precision)
    st = q.detail.states
    init = q.fsdp1_init
    assert len(init) == 2 * per_unit
    root, layer = init[:per_unit], init[per_unit:]
    assert max(root) >= st.root_full and max(layer) >= st.layer_params_full
    if per_unit == 3:
        assert root[0] < root[1] < root[2] and layer[2] >= 2 * st.layer_params_full
    assert _q(fsdp_version=2).fsdp1_init == ()
