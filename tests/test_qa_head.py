"""Extractive question answering (``*ForQuestionAnswering``, ModelSpec head ``qa``): ``qa_outputs``,
Linear(h, 2), on every token's encoder output, and two cross-entropies over the sequence's
positions. The estimate is checked against trace of transformers' own class on fake tensors, and
the parameters against the class built from the same config."""
from __future__ import annotations

import pytest

import trainmem
from trainmem.spec.resolve import resolve

BERT_QA = {"architectures": ["BertForQuestionAnswering"], "model_type": "bert", "hidden_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 1024, "vocab_size": 2048,
           "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
SMALL = dict(batch_size=4, seq_len=256, optimizer="adamw")


def test_qa_head_from_architectures_and_task():
    m = resolve(BERT_QA, **SMALL).model
    assert m.head == "qa"
    names = {p.name for p in m.parameter_tensors()}
    assert {"qa_outputs.weight", "qa_outputs.bias"} <= names
    assert not any(n.startswith("pooler.") for n in names)  # BertModel(add_pooling_layer=False)
    task = trainmem.resolve_model({**BERT_QA, "architectures": ["BertForMaskedLM"]}, task="question-answering")
    assert task.head == "qa" and task.architecture == "BertForQuestionAnswering"


def test_qa_parameters_match_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(**{k: v for k, v in BERT_QA.items() if k not in ("architectures", "model_type")})
    model = transformers.BertForQuestionAnswering(cfg)
    assert resolve(BERT_QA, **SMALL).model.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_qa_estimate_agrees_with_trace(precision, one_torch_thread):
    """The head saves its (b, s, h) input and makes (b, s, 2) logits: estimate within 0.5 % of
    trace of ``BertForQuestionAnswering`` (its loss, two cross-entropies of (b, s) logits, included)."""
    kw = dict(SMALL, precision=precision)
    t, e = trainmem.trace(BERT_QA, **kw), trainmem.estimate(BERT_QA, **kw)
    assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.005


def test_published_cscs_bert_squad_zero1():
    """The CSCS BERT-base SQuAD run (DeepSpeed ZeRO-1 fp16, micro-batch 64 x 384 on 8 P100s): the
    log's MaxMemAllocated 15.06 GiB, within 1 % (validation/published)."""
    import json
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "validation", "published",
                        "deepspeed_cscs_bert_base_squad_zero1_b64.json")
    fx = json.load(open(path, encoding="utf-8"))
    r = trainmem.estimate(fx["model"], **fx["setup"])
    assert r.model.head == "qa"
    assert abs(r.peak_allocated / (15.06 * 2**30) - 1) < 0.01
