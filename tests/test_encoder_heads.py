"""Derived estimates of encoder heads: masked LM, sequence classification and question answering on
architectures without hand-written formulas (DistilBERT, DeBERTa-v2, ModernBERT, RoBERTa), checked against a
trace of the same setup (the real model, all its layers, two steps with the optimizer).

Under ``expandable_segments`` (as tests/test_encdec_vit.py): the default allocator's unsplit block
remainders (the 1.125 MiB half copies of a 768-wide weight in 2 MiB blocks) are the allocator's,
not the coefficients'; the default allocator's table is in the session report.
"""
from __future__ import annotations

import warnings

import pytest
from transformers import DebertaV2Config, DistilBertConfig, ModernBertConfig, RobertaConfig

import trainmem
from trainmem.estimate import derived
from trainmem.spec.resolve import resolve

from test_cli import ERROR_PREFIX, run_cli

warnings.filterwarnings("ignore")

DISTILBERT = DistilBertConfig(dim=256, hidden_dim=1024, n_layers=3, n_heads=4, vocab_size=4000).to_dict()
#: deberta-v3-base's attention (relative, 256 buckets, shared keys, p2c|c2p, LayerNorm'd relative
#: embeddings), narrower, 3 layers
DEBERTA = DebertaV2Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
                          vocab_size=4000, relative_attention=True, position_buckets=256, norm_rel_ebd="layer_norm",
                          share_att_key=True, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                          position_biased_input=False, type_vocab_size=0, max_position_embeddings=512).to_dict()
#: ModernBERT with one global and two local (sliding-window) layers
MODERNBERT = ModernBertConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                              vocab_size=4000, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2).to_dict()
#: roberta-base's layout (absolute positions offset past the padding index, one token type), narrower, 3 layers
ROBERTA = RobertaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
                        vocab_size=4000, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2).to_dict()
MODELS = {"distilbert": DISTILBERT, "deberta": DEBERTA, "modernbert": MODERNBERT, "roberta": ROBERTA}
TASKS = ("masked-lm", "sequence-classification", "question-answering")
TOLERANCE = 0.01


def _error(name: str, task: str, **setup) -> float:
    setup = dict(dict(batch_size=4, seq_len=256, precision="bf16-amp", expandable_segments=True), **setup)
    est = trainmem.estimate(MODELS[name], task=task, **setup).peak_allocated
    tr = trainmem.trace(MODELS[name], task=task, **setup).peak_allocated
    return est / tr - 1


QUICK = [("distilbert", "sequence-classification"), ("deberta", "question-answering"), ("modernbert", "masked-lm"),
         ("roberta", "masked-lm")]


@pytest.mark.parametrize("name,task", QUICK)
def test_encoder_head_agrees_with_trace(name, task):
    assert abs(_error(name, task)) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("name,task,precision", [(n, t, p) for n in MODELS for t in TASKS
                                                 for p in ("fp32", "fp16-amp", "bf16-amp")
                                                 if not (n == "deberta" and t == "sequence-classification")])
def test_encoder_heads_grid(name, task, precision):
    assert abs(_error(name, task, precision=precision)) <= TOLERANCE
    assert abs(_error(name, task, precision=precision, batch_size=8, seq_len=128)) <= TOLERANCE


#: each model's attention query and value projections (peft has no default targets for DistilBERT)
LORA_TARGETS = {"distilbert": ["q_lin", "v_lin"], "deberta": ["query_proj", "value_proj"], "modernbert": ["Wqkv"],
                "roberta": ["query", "value"]}


@pytest.mark.slow
@pytest.mark.parametrize("name,task", [(n, t) for n in MODELS for t in ("masked-lm", "question-answering")])
def test_encoder_head_lora_agrees_with_trace(name, task):
    """LoRA: the frozen weights' half copies (uncached by autocast, saved by their matmuls; a frozen
    tied head's too) are the engine's, not the fitted constant's (+2.3% on DistilBERT's masked LM before)."""
    assert abs(_error(name, task, lora_rank=16, lora_targets=LORA_TARGETS[name])) <= TOLERANCE


@pytest.mark.parametrize("name,setup", [("distilbert", dict(recompute="full")), ("modernbert", dict(recompute="full")),
                                        ("deberta", dict(batch_size=1, seq_len=512)),
                                        ("modernbert", dict(grad_accum=2))])
def test_encoder_head_recompute_batch1_accumulation(name, setup):
    """Full recompute (the layers keep their inputs; the top forward moment is not counted), micro-
    batch 1 (its own fit, whose constant holds DeBERTa's per-sample bytes) and accumulation."""
    assert abs(_error(name, "question-answering", **setup)) <= TOLERANCE


def test_deberta_full_recompute_refused_in_one_line():
    from trainmem.errors import TrainmemError
    with pytest.raises(TrainmemError, match="--recompute full on DeBERTa-v2"):
        trainmem.estimate(DEBERTA, task="masked-lm", batch_size=4, seq_len=256, recompute="full")


def test_masked_lm_loss_upcast_is_traced():
    """ModernBERT's masked LM calls transformers' ``ForMaskedLMLoss`` (``logits.float()``), DistilBERT's
    ``CrossEntropyLoss()`` on the half logits: the derivation records which (the estimate's log-
    probabilities are fp32 or half accordingly)."""
    for name, upcast in (("modernbert", True), ("distilbert", False)):
        r = resolve(MODELS[name], task="masked-lm", batch_size=4, seq_len=256, precision="bf16-amp")
        assert derived.loss_upcasts(r.model, r.training) is upcast


def test_deberta_keeps_per_sample_and_per_pair_bytes():
    """DeBERTa-v2's layers save (b x heads, 2 x buckets, head_dim) repeats of the relative position
    projections (per sample) and clamp (1, s, s) indices (per position pair): both fitted."""
    r = resolve(MODELS["deberta"], task="masked-lm", batch_size=4, seq_len=256, precision="bf16-amp")
    doc = derived.coefficients(r.model, r.training)
    kind = doc["layer_kinds"][0]
    assert doc["per_sample"][f"kind.{kind}"] > 0 and doc["ssq"][f"kind.{kind}"] > 0
    assert derived.outer_ssq(r.model, r.training, "first") > 0


def test_classifier_forward_peak_is_the_top_layer():
    """A sequence classifier has no vocabulary-sized loss: its step peaks in the top layer's forward,
    which the estimate now has (``head.forward``) instead of the last layer's backward."""
    rep = trainmem.estimate(DISTILBERT, task="sequence-classification", batch_size=4, seq_len=256,
                            precision="bf16-amp", expandable_segments=True)
    assert rep.peak_phase.startswith("forward") and "head.forward" in rep.peak_where


def test_deberta_classifier_without_a_problem_type_is_single_label_with_a_note():
    """DeBERTa-v2's classifier without a problem_type picks its labelled rows with ``nonzero()`` (data-
    dependent: not traceable): it is estimated and traced as single_label_classification (every row
    labelled), with a note saying so; the result is the explicit problem_type's, within the tolerance of
    the trace."""
    setup = dict(task="sequence-classification", batch_size=4, seq_len=256, precision="bf16-amp",
                 expandable_segments=True)
    plain = trainmem.estimate(DEBERTA, **setup)
    assert any("without a problem_type" in w for w in plain.warnings)
    cfg = dict(DEBERTA, problem_type="single_label_classification")
    est, tr = trainmem.estimate(cfg, **setup), trainmem.trace(DEBERTA, **setup)
    assert plain.peak_allocated == est.peak_allocated
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= TOLERANCE


@pytest.mark.parametrize("argv,names", [
    (["--task", "masked-lm"], "albert_layer_groups"),
    (["--task", "sequence-classification"], "num_hidden_groups=1"),
])
def test_albert_shared_layers_refused_in_one_line(capsys, tmp_path, argv, names):
    import json
    from transformers import AlbertConfig
    path = tmp_path / "config.json"
    path.write_text(json.dumps(AlbertConfig(num_hidden_layers=4).to_dict()))
    for command in ("estimate", "trace"):
        code, out, err = run_cli(capsys, command, str(path), *argv)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and names in lines[0], err
