"""``--trainer dpo``: TRL's ``DPOTrainer`` step (trl 1.9.0), and ``--ref-model``, where its reference comes from.

A DPO micro-batch of ``--batch-size`` B pairs (``per_device_train_batch_size``) is 2B sequences: TRL's
``DataCollatorForPreference`` stacks the B chosen and the B rejected completions, each after its prompt,
padded to the longest (``max_length`` 1024 truncates them; trl/trainer/dpo_trainer.py L152-300 at
v1.9.0), so ``--seq-len`` is that padded prompt + completion length. ``_compute_loss`` (L1329-1655) runs:

1. the policy forward on the 2B sequences (``use_cache=False``); under ``bf16=True`` (TRL's default)
   accelerate's ``convert_outputs_to_fp32`` hands back fp32 logits;
2. ``selective_log_softmax`` on the shifted fp32 logits (trl/trainer/utils.py L479-523): a ``gather``
   and one ``logsumexp`` per sequence, which saves the logits for backward;
3. the reference forward on the same batch under ``torch.no_grad()`` (L1364-1392): the frozen copy
   (``--ref-model copy``, TRL's ``create_model_from_path`` when no ``ref_model`` is given without PEFT,
   L893-910), or the policy with its adapters disabled (``--ref-model none``: PEFT, ``use_adapter``),
   then ``selective_log_softmax`` on its fp32 logits; ``precompute_ref_log_probs=True``
   (``--ref-model precomputed``) reads them from the batch: no reference forward, no reference model;
4. the sigmoid loss on (B,) log-ratios, and metrics under no grad: ``entropy_from_logits`` on the
   shifted policy logits (a reshape copy, then 128 rows at a time), the chosen logits' mean, argmax;
   ``ref_outputs`` stays referenced until ``_compute_loss`` returns;
5. the Trainer's ``backward``, ``optimizer.step()``, ``model.zero_grad()``, as SFT.

Not modelled (refused in one line): loss types other than ``sigmoid``, ``hinge``, ``ipo`` and the
others computed from the (B,) log-ratios alone (``use_weighting``'s logsumexp of 2x logits, Liger's
fused DPO loss), DeepSpeed/FSDP preparation of the reference model and any model parallelism.
"""
from __future__ import annotations

from typing import Any

#: the ``--trainer`` step kinds besides the plain (SFT) one: TRL's DPOTrainer and RewardTrainer
TRAINERS = ("dpo", "reward")
#: ``--ref-model``: the frozen copy TRL loads, the policy with its adapters disabled (PEFT), or log-probs
#: computed before training (``precompute_ref_log_probs=True``)
REF_MODELS = ("copy", "none", "precomputed")


def ref_model_of(t: Any) -> str | None:
    """The reference a DPO run uses: ``--ref-model`` when given, else TRL's pick (dpo_trainer.py L893-898
    at v1.9.0): a PEFT model (``--lora-rank``) disables its adapters (``none``), a full model loads a
    frozen copy (``copy``). None outside ``--trainer dpo``."""
    if t.trainer != "dpo":
        return None
    if t.ref_model is not None:
        return t.ref_model
    return "none" if t.lora_rank else "copy"


def preference_problem(t: Any) -> str | None:
    """Why a TrainingSpec's ``--trainer`` / ``--ref-model`` cannot be modelled (None: it can)."""
    if t.trainer is None:
        return "--ref-model is DPOTrainer's reference: give --trainer dpo, or drop --ref-model" \
            if t.ref_model is not None else None
    if t.trainer not in TRAINERS:
        return f"--trainer {t.trainer!r} is not one of: {', '.join(TRAINERS)}"
    if t.trainer == "reward":
        return _reward_problem(t)
    if t.ref_model is not None and t.ref_model not in REF_MODELS:
        return f"--ref-model {t.ref_model!r} is not one of: {', '.join(REF_MODELS)}"
    if ref_model_of(t) == "none" and not t.lora_rank:
        return ("--ref-model none is the policy with its LoRA adapters disabled (TRL's PEFT path); without "
                "--lora-rank TRL loads a frozen copy: use --ref-model copy (or precomputed)")
    bad = [f"--{k.replace('_', '-')} {getattr(t, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(t, k) != 1]
    bad += ["--fsdp"] * (t.fsdp is not None) + [f"--zero {t.zero}"] * bool(t.zero) + ["--gemini"] * bool(t.gemini)
    bad += ["--compile"] * t.compile + ["--liger"] * t.liger + ["--quantize"] * bool(t.quantize)
    bad += ["--optimizer-in-backward"] * t.optimizer_in_backward + ["--offload-activations"] * t.offload_activations
    # (the policy's own log-probs are --loss logps --cast-output: estimate.preference.policy_spec; accepted)
    policy = t.loss == "logps" and t.cast_output
    bad += [f"--hold-output {t.hold_output}"] * (t.hold_output != "loss") + ["--cast-output"] * (t.cast_output
                                                                                              and not policy)
    bad += [f"--loss {t.loss}"] * (t.loss is not None and not policy)
    bad += [f"--loss-chunks {t.loss_chunks}"] * (t.loss_chunks > 1)
    bad += ["--later-seq-len"] * (t.later_seq_len is not None) + ["--min-seq-len"] * (t.min_seq_len is not None)
    if bad:
        return (f"--trainer dpo is modelled on one GPU or DDP with TRL's own step (the sigmoid-family losses); "
                f"not modelled: {', '.join(bad)}")
    return None


def _reward_problem(t: Any) -> str | None:
    """``--trainer reward``: TRL's RewardTrainer (trl/trainer/reward_trainer.py L739-778 at v1.9.0) runs the
    sequence-classification model on the B chosen and the B rejected sequences
    (``DataCollatorForPreference``, L198-223) and takes ``-logsigmoid(chosen - rejected)`` of its (2B, 1)
    scores: the plain step on 2B sequences, with the model's head and no loss of the loop's own."""
    if t.ref_model is not None:
        return "--ref-model is DPOTrainer's reference; RewardTrainer has none: drop --ref-model"
    bad = [f"--loss {t.loss}"] * (t.loss is not None) + [f"--loss-chunks {t.loss_chunks}"] * (t.loss_chunks > 1)
    bad += ["--cast-output"] * t.cast_output + [f"--hold-output {t.hold_output}"] * (t.hold_output != "loss")
    bad += [f"--pp {t.pp}"] * (t.pp > 1) + ["--liger"] * t.liger
    bad += ["--later-seq-len"] * (t.later_seq_len is not None) + ["--min-seq-len"] * (t.min_seq_len is not None)
    if bad:
        return f"--trainer reward runs TRL's RewardTrainer step (its scores' loss); not modelled: {', '.join(bad)}"
    return None
