"""A masked LM's head under autocast: the allocator replay asks one half weight copy per linear, at the
linear that casts it (``quantities.head_moments.head_pre_cast``, ``reserved.loss_forward._pre_cast``).

autocast's ``cached_cast`` makes one copy per fp32 weight when the op that reads it runs
(torch 2.13 ``aten/src/ATen/autocast_mode.cpp``): BERT's ``BertPredictionHeadTransform.dense`` first,
then the decoder (transformers 5.24 ``models/bert/modeling_bert.py`` L480-500). The replay asked the
two as one (hidden^2 + vocab x hidden) half block at the decoder; trace asks the (768, 768) copy
(1.125 MiB) at the dense and the (30522, 768) one (44.71 MiB) at the decoder.
"""
from __future__ import annotations

from alloc_spy import large_requests

import trainmem
from trainmem.trace.api import trace

BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 768, "intermediate_size": 3072,
        "num_attention_heads": 12, "num_hidden_layers": 2, "vocab_size": 30522, "max_position_embeddings": 4096,
        "type_vocab_size": 2}
KW = dict(batch_size=8, seq_len=256, precision="bf16-amp", attention="eager")
DENSE, DECODER = 768 * 768 * 2, 30522 * 768 * 2          # the half copies' bytes (bf16)


def test_mlm_head_copies_one_request_per_linear(monkeypatch, one_torch_thread):
    """The replay asks the decoder's copy alone, as trace does, and never the two copies' sum."""
    est = large_requests(monkeypatch, lambda: trainmem.estimate(BERT, **KW), DENSE)
    tr = large_requests(monkeypatch, lambda: trace(BERT, **KW), DENSE)
    assert DECODER in tr and DENSE + DECODER not in tr
    assert DECODER in est
    assert DENSE + DECODER not in est


def test_dense_copy_made_before_the_decoder_input(monkeypatch):
    """The dense's copy is asked after the transform's half input and before the decoder's copy:
    the request before the decoder's copy's last (b, s, h) half input is the dense's (1.125 MiB)
    only where the transform runs first."""
    est = large_requests(monkeypatch, lambda: trainmem.estimate(BERT, **KW), DENSE)
    i = est.index(DECODER)
    half_in = 8 * 256 * 768 * 2                           # (b, s, h) bf16
    j = max(k for k in range(i) if est[k] == DENSE)
    assert est[j - 1] == half_in                          # the dense's half input, then its copy
    assert all(x != DENSE for x in est[j + 1:i])          # no other 768x768 copy until the decoder's
