"""``--trainer dpo`` and ``--trainer reward``: TRL's DPOTrainer and RewardTrainer steps (spec/preference.py). The estimate (estimate/preference.py over
the engine, ``--loss logps``'s backward in quantities.loss_kinds._logps_bytes) is checked against trace, which runs
the step (preference_step.DPOTrainStep: the policy forward on 2B sequences, accelerate's fp32 cast,
``selective_log_softmax``, the reference forward under no_grad, the metrics, backward) on a
transformers Llama cut to two layers, and the copied TRL functions against TRL's own where it is
installed."""
from __future__ import annotations

import pytest

from trainmem.errors import TrainmemError

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from trainmem import estimate, trace  # noqa: E402
from trainmem.preference_step import entropy_from_logits, selective_log_softmax  # noqa: E402

BASE = dict(seq_len=256, attention="sdpa", set={"num_hidden_layers": 2}, gpu="a100-40gb", trainer="dpo")
MIB = 2**20


def _both(model: str = "llama-3.2-1b", **options):
    o = {**BASE, **options}
    return estimate(model, **o), trace(model, **o)


@pytest.mark.parametrize("extra", [
    dict(batch_size=1, lora_rank=8, precision="bf16-amp"),
    dict(batch_size=2, lora_rank=8, precision="bf16-amp", ref_model="precomputed"),
    dict(batch_size=1, lora_rank=8, precision="bf16"),
    dict(batch_size=1, lora_rank=8, precision="fp32"),
    dict(batch_size=2, lora_rank=8, precision="bf16-amp", recompute="full"),
    dict(batch_size=1, precision="bf16-amp"),
    dict(batch_size=1, precision="bf16", grad_accum=2),
    dict(batch_size=2, lora_rank=8, precision="bf16-amp", dp=2),
], ids=["lora", "lora-precomputed-b2", "lora-bf16", "lora-fp32", "lora-recompute", "full-copy", "full-bf16-accum",
        "lora-ddp"])
def test_estimate_agrees_with_trace(extra):
    e, t = _both(**extra)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.004)
    # every phase's end, the reference's weights included (the plain step's fp32 LoRA forward already ends
    # 4 MiB, 0.21%, above trace's here: --loss upcast without --trainer)
    for pe, pt in zip(e.phases, t.phases):
        assert pe.allocated == pytest.approx(pt.allocated, rel=0.0025, abs=2 * MIB), (pe.name, pe.step)


def test_the_log_probs_backward_is_the_lora_peak():
    """With the adapters alone trained, the peak is GatherBackward's: beside the saved fp32 logits, the
    stacked logsumexp gradient, the gather's zero-filled tensor and its out-of-place scatter_add (12 B per
    logit element), 4 B per element more than the plain step's upcast cross-entropy backward."""
    e, t = _both(batch_size=1, lora_rank=8, precision="bf16-amp")
    assert e.peak_where == "log_probs.backward" and "GatherBackward0" in t.peak_where
    sft = trace("llama-3.2-1b", **{**BASE, "trainer": None, "batch_size": 2, "lora_rank": 8,
                                   "precision": "bf16-amp", "loss": "upcast", "cast_output": True})
    logits = 2 * 256 * 128256 * 4   # 2B x s x vocab, fp32
    assert t.peak_allocated - sft.peak_allocated == pytest.approx(logits, rel=0.02)


@pytest.mark.parametrize("extra", [dict(batch_size=1, lora_rank=8), dict(batch_size=2, lora_rank=8, ref_model="precomputed"),
                                   dict(batch_size=1)], ids=["lora", "lora-precomputed", "full-copy"])
def test_reserved_replay_agrees_with_trace(extra):
    """The reserved replay (estimate/reserved/loss_forward.py ``_dpo_after_logps``, ``_logps_backward``): the reference
    head's uncached weight copy, its logits, the metrics' copies and the log-probs' backward tensor by
    tensor; without the head's copy the replay missed the segment trace's second step adds (-6.7%)."""
    e, t = _both(**extra, precision="bf16-amp")
    assert e.peak_reserved == pytest.approx(t.peak_reserved, rel=0.01)


def test_the_metrics_moment_is_gpt2s_lora_peak():
    """GPT-2 with adapters and recompute: the peak is in ``_compute_loss``'s metrics, where the
    reference's fp32 logits, the policy's and ``entropy_from_logits``' reshape copy and chunks are alive
    (estimate: ``after_logps``; trace: the entropy chunk's product)."""
    e, t = _both("gpt2", batch_size=1, seq_len=128, lora_rank=8, precision="bf16-amp", recompute="full")
    assert e.peak_where == "metrics.entropy" and "mul.Tensor" in t.peak_where
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01)


def test_the_reference_copy_is_one_more_set_of_weights():
    opts = dict(batch_size=1, precision="bf16-amp")
    copy, pre = _both(**opts), _both(**opts, ref_model="precomputed")
    for e, t in (copy, pre):
        assert e.phases[0].allocated == t.phases[0].allocated   # model_loaded
    weights = pre[0].phases[0].allocated
    assert copy[0].phases[0].allocated == 2 * weights
    assert copy[1].phases[0].allocated == 2 * weights
    ref = next(c for c in copy[0].components if c.name == "reference_model")
    assert ref.bytes == weights


def test_logps_loss_agrees_with_trace():
    """``--loss logps --cast-output`` on the plain step: the policy's log-probs alone."""
    opts = dict(BASE, trainer=None, batch_size=2, lora_rank=8, precision="bf16-amp", loss="logps", cast_output=True)
    e, t = estimate("llama-3.2-1b", **opts), trace("llama-3.2-1b", **opts)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.004)


def test_pairs_are_twice_the_sequences():
    """``--batch-size`` counts pairs: the policy's step is the plain one on 2B sequences."""
    dpo = estimate("llama-3.2-1b", **BASE, batch_size=2, lora_rank=8, ref_model="precomputed")
    plain = estimate("llama-3.2-1b", **{**BASE, "trainer": None}, batch_size=4, lora_rank=8, loss="logps",
                     cast_output=True)
    assert dpo.peak_allocated >= plain.peak_allocated
    assert dpo.phases[-1].allocated == plain.phases[-1].allocated


def test_trl_preset_defaults():
    """``--framework trl --trainer dpo``: no chunked_nll loss (the preset's SFT default); the reference is
    TRL's pick: disabled adapters with LoRA, a copy without."""
    lora = estimate("llama-3.2-1b", framework="trl", trainer="dpo", lora_rank=16, batch_size=1)
    full = estimate("llama-3.2-1b", framework="trl", trainer="dpo", batch_size=1)
    assert lora.training.loss is None and lora.training.seq_len == 1024
    assert not any(c.name == "reference_model" for c in lora.components)
    assert any(c.name == "reference_model" for c in full.components)


@pytest.mark.parametrize("options, words", [
    (dict(ref_model="none"), "--ref-model none"),
    (dict(trainer=None, ref_model="copy"), "--trainer dpo"),
    (dict(trainer="reward"), "--task sequence-classification --set num_labels=1"),
    (dict(trainer="kto"), "--trainer 'kto'"),
    (dict(tp=2, dp=2), "--tp 2"),
    (dict(zero=2, dp=2), "--zero 2"),
    (dict(loss="upcast"), "--loss upcast"),
    (dict(liger=True), "--liger"),
    (dict(framework="trl", framework_version="0.28"), "before 0.29"),
    (dict(method="eleuther"), "--method eleuther"),
])
def test_refused_in_one_line(options, words):
    with pytest.raises(TrainmemError) as err:
        estimate("llama-3.2-1b", **{"trainer": "dpo", "batch_size": 1, **options})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_loss_logps_needs_cast_output():
    with pytest.raises(TrainmemError, match="--cast-output"):
        estimate("llama-3.2-1b", loss="logps")


def test_copied_functions_match_the_naive_math():
    """``selective_log_softmax`` is ``log_softmax`` then ``gather`` (its docstring's equivalence), in fp32
    and bf16; ``entropy_from_logits`` is the softmax entropy, chunk by chunk."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 200, 50, generator=g)
    index = torch.randint(0, 50, (3, 200), generator=g)
    naive = logits.log_softmax(-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, index), naive, atol=1e-5)
    half = selective_log_softmax(logits.bfloat16(), index)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), naive, atol=0.1)
    p = logits.softmax(-1)
    assert torch.allclose(entropy_from_logits(logits), -(p * p.log()).sum(-1), atol=1e-5)


def test_copied_functions_are_trls():
    """Against TRL's own functions on the CPU (where trl is installed)."""
    utils = pytest.importorskip("trl.trainer.utils")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, 300, generator=g)
    index = torch.randint(0, 300, (4, 64), generator=g)
    assert torch.equal(selective_log_softmax(logits, index), utils.selective_log_softmax(logits, index))
    assert torch.equal(entropy_from_logits(logits[:, :-1]), utils.entropy_from_logits(logits[:, :-1]))


REWARD = dict(task="sequence-classification", set={"num_hidden_layers": 2, "num_labels": 1}, seq_len=256,
              gpu="a100-40gb", trainer="reward")


@pytest.mark.parametrize("extra", [dict(batch_size=2, precision="bf16-amp"),
                                   dict(batch_size=2, precision="bf16-amp", lora_rank=8),
                                   dict(batch_size=1, precision="bf16", recompute="full", grad_accum=2)],
                         ids=["full", "lora", "bf16-recompute-accum"])
def test_reward_estimate_agrees_with_trace(extra):
    """RewardTrainer: the sequence-classification model on 2B sequences, its (2B, 1) scores' loss."""
    o = {**REWARD, **extra}
    e, t = estimate("llama-3.2-1b", **o), trace("llama-3.2-1b", **o)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.002)
    plain = estimate("llama-3.2-1b", **{**o, "trainer": None, "batch_size": 2 * o["batch_size"]})
    assert e.peak_allocated == plain.peak_allocated   # B pairs: the plain step's 2B sequences


def test_reward_refuses_a_reference():
    with pytest.raises(TrainmemError, match="RewardTrainer has none"):
        estimate("llama-3.2-1b", **REWARD, batch_size=1, ref_model="copy")


@pytest.mark.parametrize("trainer, extra", [("dpo", {}), ("dpo", {"ref_model": "precomputed"}),
                                            ("reward", {"task": "sequence-classification"})])
def test_measure_runs_the_same_step_as_trace(trainer, extra):
    """measure (real tensors, real data) runs the step trace runs: on the CPU their byte counts agree
    exactly (trace --device cpu counts the same tensors as they are created)."""
    from trainmem.measure.runner import measure
    tiny = ["n_layer=2", "n_embd=64", "n_head=4", "vocab_size=1000", "n_positions=128"]
    if trainer == "reward":
        tiny = tiny + ["num_labels=1", "pad_token_id=0"]
    o = dict(set=tiny, batch_size=2, seq_len=64, precision="fp32", trainer=trainer, **extra)
    m, t = measure("gpt2", device="cpu", **o), trace("gpt2", device="cpu", **o)
    assert m.peak_allocated == t.peak_allocated
    plain = trace("gpt2", device="cpu", **{**o, "trainer": None, "batch_size": 4, "ref_model": None})
    assert (t.peak_allocated > plain.peak_allocated) == (trainer == "dpo")
