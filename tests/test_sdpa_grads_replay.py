"""A fused SDPA kernel's backward in the replay: the output's gradient and the kernel's dq, dk, dv
as four tensors (``layers._sdpa_grads``), then its scratch, where one block of their sum stood for them.

torch 2.13 ``flash_attn/flash_api.cpp`` ``mha_bwd`` allocates dq, dk, dv (``empty_like`` of q, k, v)
before ``softmax_d`` and the fp32 ``dq_accum``; trace on BERT-base
b8 s256 pure bf16 makes three 3 MiB tensors and a 6 MiB one beside the 3 MiB output gradient, where the
replay made one 12 MiB block.
"""
from __future__ import annotations

import pytest

from trainmem.estimate.layers import layer_coefficients
from trainmem.estimate.quantities.model_facts import layer_key
from trainmem.spec.resolve import resolve


@pytest.mark.parametrize("model,attention,name", [("bert-base-uncased", "sdpa", "attn.flash.backward"),
                                                  ("llama-3.2-1b", "sdpa", "attn.flash.backward")])
def test_fused_backward_moment_lists_each_gradient(model, attention, name):
    """The kernel's backward moment (``LayerCoefs.moment_blocks``) lists the output's gradient, then dq,
    dk and dv, each its own block of the query's / the keys' width in the half dtype (per token), then
    the fp32 ``softmax_d`` (one per head) and ``dq_accum``; the moment's bytes are those of one block
    of their sum before."""
    r = resolve(model, precision="bf16", attention=attention, set=["num_hidden_layers=2"])
    k = layer_key(r.model, r.training)
    lc = layer_coefficients(k)
    names = [t[0] for t in lc.transients]
    blocks, lin = lc.moment_blocks[names.index(name)]
    q, kv = k.heads * k.head_dim * 2, k.kv_heads * k.head_dim * 2   # bytes per token, bf16
    assert lin == -1
    assert [b for b, _sq in blocks[:4]] == [q, q, kv, kv]
    assert blocks[4] == (k.heads * 4, 0)                            # softmax_d, fp32 per head and token
