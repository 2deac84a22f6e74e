"""``--fsdp-gathered head``: torchtitan's FSDP2 units since July 2025 (commit 83e694105).

``apply_fsdp`` shards the token embedding as its own unit and every block with
``reshard_after_forward=True``, the final norm and the output head as one unit kept gathered
(``fully_shard([norm, output], reshard_after_forward=False)``), and the root ``fully_shard(model)``
holds no parameters. trace wraps the real model the same way (``wrappers._fsdp2_split``); the estimate
models the units' moments (``quantities.fsdp_root.fsdp2_split_root``). Checked on a Llama cut to four layers
with an untied head, FSDP2 over two ranks of the fake process group."""
from __future__ import annotations

import pytest

from trainmem.errors import TrainmemError
from trainmem.spec.training import TrainingSpec

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem import estimate, trace  # noqa: E402

UNTIED = {"num_hidden_layers": 4, "tie_word_embeddings": False}
BASE = dict(batch_size=2, seq_len=256, precision="bf16-mp", fsdp="full", dp=2, set=UNTIED, gpu="h100",
            fsdp_gathered="head")
#: torchtitan's loop of 2024: fp32 logits from the model, the loss on them, the output held a step
TORCHTITAN_2024 = dict(loss="half", cast_output=True, hold_output="step")


def _both(**options):
    return estimate("llama-3.2-1b", **options), trace("llama-3.2-1b", **options)


@pytest.mark.parametrize("loop", [dict(loss="upcast"), {}, TORCHTITAN_2024], ids=["upcast", "own-loss", "titan-2024"])
@pytest.mark.parametrize("recompute", ["full", "none"])
def test_estimate_agrees_with_trace(loop, recompute):
    """The peak is the embedding unit's post-backward (its fp32 reduce-scatter input, the table's
    gradient beside it: ``fsdp.root_reduce``); every step's phases agree too."""
    e, t = _both(**BASE, **loop, recompute=recompute)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.005)
    for pe, pt in zip(e.phases, t.phases, strict=True):
        assert pe.peak == pytest.approx(pt.peak, rel=0.005), pe.name


@pytest.mark.parametrize("options", [dict(grad_accum=2), dict(set={**UNTIED, "vocab_size": 2000}),
                                     dict(batch_size=4, seq_len=1024), dict(dp=4)],
                         ids=["accumulation", "narrow-vocab", "long", "dp4"])
def test_other_peaks_agree(options):
    """Accumulation (the peak: the head unit's post-backward in the second micro-batch, its
    reduce-scatter output beside the accumulated shards), a narrow vocabulary (the optimizer step),
    4 x 1024 tokens (the loss's backward) and four ranks."""
    e, t = _both(**{**BASE, "loss": "upcast", "recompute": "full", **options})
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.005)


def test_head_unit_stays_gathered_through_the_loss():
    """At the loss's backward (the peak with 4 x 1024 tokens, no recompute) the old root was
    resharded; the [norm, head] unit stays gathered: estimate and trace both grow by its bf16
    parameters, within 1 % (the allocator's 2 MiB rounding of the head's block)."""
    opts = {**BASE, "loss": "upcast", "recompute": "none", "batch_size": 4, "seq_len": 1024}
    vocab, hidden = 128256, 2048                                # Llama-3.2-1B's head and final norm
    head_unit = (vocab * hidden + hidden) * 2
    split, root = _both(**opts), _both(**{**opts, "fsdp_gathered": "none"})
    for i in (0, 1):                                            # estimate, trace
        assert split[i].peak_where.startswith(("cross_entropy.backward", "<top level> (LogSoftmaxBackward0)"))
        assert split[i].peak_allocated - root[i].peak_allocated == pytest.approx(head_unit, rel=0.01)


def test_refused_where_not_modelled():
    with pytest.raises(TrainmemError, match="ties its head"):
        estimate("llama-3.2-1b", **{**BASE, "set": {"num_hidden_layers": 2}})
    with pytest.raises(TrainmemError, match="--fsdp-gathered head"):
        TrainingSpec(fsdp="grad-op", dp=2, fsdp_gathered="head")
    with pytest.raises(TrainmemError, match="--lora-rank"):
        TrainingSpec(fsdp="full", dp=2, lora_rank=16, fsdp_gathered="head")


def test_torchtitan_preset_splits_an_untied_models_root():
    """torchtitan 0.2.x's ``apply_fsdp`` (from 83e694105): the preset sets ``head`` for FSDP2 on an
    untied model, not on a tied one, not without sharding; an explicit choice wins."""
    def gathered(model, **options):
        return estimate(model, framework="torchtitan", batch_size=1, seq_len=128,
                        **options).training.fsdp_gathered
    assert gathered("llama-3.2-1b", dp=2, set=UNTIED) == "head"
    assert gathered("llama-3.2-1b", dp=2, set={"num_hidden_layers": 4}) == "none"     # tied
    assert gathered("llama-3.2-1b", set=UNTIED) == "none"                              # one GPU
    assert gathered("llama-3.2-1b", dp=2, set=UNTIED, fsdp_gathered="root-last") == "root-last"
