"""``--trainer dpo``: TRL's DPOTrainer step (``spec/preference.py``) as the engine's step plus the reference.

The policy's side is the engine's step on 2B sequences whose fp32 logits (accelerate's
``convert_outputs_to_fp32``, the cast-output moment) are saved for backward by the log-probs' loss,
``--loss logps --cast-output`` (TRL's ``selective_log_softmax``: ``quantities.loss_kinds._logps_bytes``). To it
this module adds:

* the reference model's weights (``--ref-model copy``): a frozen copy of the parameters in their
  dtype, no gradients or optimizer states (``reference_weights``);
* the moments between the policy's log-probs and the end of ``_compute_loss``, on top of what the
  forward leaves (its phase's allocated memory): the reference forward's fp32 logits, the metrics'
  copies (``after_logps``).
"""
from __future__ import annotations

from dataclasses import replace

from ..report import Component, MemoryReport
from ..spec.frameworks import trl_metric_bytes
from ..spec.model import ModelSpec
from ..spec.preference import ref_model_of
from ..spec.training import TrainingSpec

F32 = 4
#: the ``TrainingSpec.extra`` key of ``policy_spec``'s setup: the engine runs it as its own step (keeping
#: ``trainer`` and ``ref_model``, which key its quantities: ``quantities.build._preference_fields``, read by the
#: reserved replay)
POLICY = "dpo_policy_step"


def policy_spec(t: TrainingSpec) -> TrainingSpec:
    """The engine's step of a DPO micro-batch: 2B sequences (``DataCollatorForPreference`` stacks the
    chosen and the rejected ones), the log-probs read from the fp32 logits cast as the forward returns
    (``--loss logps --cast-output``), marked as the policy's step (``POLICY``)."""
    return replace(t, batch_size=2 * t.batch_size, loss="logps", cast_output=True,
                   extra={**t.extra, POLICY: True})


def reference_weights(rep: MemoryReport, t: TrainingSpec) -> int:
    """Bytes of the reference's weights: with ``--ref-model copy`` the model's parameters and buffers once more
    (each tensor as the policy's, in its dtype, rounded as the allocator rounds it: the engine's
    ``parameters`` component; TRL's ``create_model_from_path`` loads the same checkpoint with the same
    ``model_init_kwargs``, dpo_trainer.py L899-908 at v1.9.0); 0 for ``none`` (the policy with its
    adapters disabled) and ``precomputed`` (``self.ref_model = None``, L893-898)."""
    if ref_model_of(t) != "copy":
        return 0
    return sum(c.bytes for c in rep.components if c.name in ("parameters", "buffers"))


def after_logps(m: ModelSpec, t: TrainingSpec, half: int) -> tuple[int, str]:
    """The most bytes ``_compute_loss`` holds beyond what the policy's forward and log-probs leave
    (dpo_trainer.py L1364-1655 at v1.9.0), and where. Per logit element of the 2B x s x vocab logits:

    * the reference's head: autocast's half copy of its weight (``reference_head_cast``) while the matmul
      makes the half logits; then the half logits and their fp32 copy (``convert_outputs_to_fp32``; fp32
      logits are not copied), then its fp32 logits, which ``ref_outputs`` keeps to the end of the
      function, and one ``logsumexp``'s (s - 1, vocab) fp32 temporary (``selective_log_softmax``'s loop);
    * the metrics: beside those, ``entropy_from_logits``' reshape copy of the shifted policy logits
      (2B x (s - 1) x vocab, fp32: the shifted view is not contiguous), then 128 rows' log_softmax, exp
      and product (``spec.frameworks.trl_metric_bytes``); ``chosen_logits[chosen_mask.bool()]``'s copy
      after it is at most half of that copy.
    ``half``: bytes per element of the head's output (4 when the logits are fp32). ``precomputed``:
    no reference forward, only the metrics."""
    b, s, v = 2 * t.batch_size, t.seq_len, m.vocab_size
    full = b * s * v
    ref = ref_model_of(t) != "precomputed"
    held = F32 * full if ref else 0                            # ref_outputs.logits, fp32
    moments = {"metrics.entropy": held + trl_metric_bytes(b, s, v, F32, None) - F32 * full}
    if ref:
        cast = half * full if half != F32 else 0                # the reference's half logits
        moments["reference.head"] = reference_head_cast(m, t) + cast
        moments["reference.logits.cast"] = cast + held
        moments["reference.logsumexp"] = held + (s - 1) * v * F32
    where = max(moments, key=lambda k: moments[k])
    return moments[where], where


def reference_head_cast(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of autocast's half copy of the reference's head weight (vocab x hidden) under mixed
    precision (fp32 weights): a frozen weight's cast is not cached (``aten/src/ATen/autocast_mode.cpp``
    ``cached_cast`` caches only leaves that require grad) and no grad mode saves it, so it lives for the
    head's matmul only; 0 with half weights (nothing cast)."""
    return m.vocab_size * m.hidden_size * 2 if t.precision in ("bf16-amp", "fp16-amp") else 0


def estimate_dpo(m: ModelSpec, t: TrainingSpec, engine_estimate, **kw) -> MemoryReport:
    """The DPO step's report: the engine's (``policy_spec``) with the reference's weights in every
    phase and, where ``after_logps`` holds more than a forward phase's peak, that moment."""
    rep = engine_estimate(m, policy_spec(t), **kw)
    ref = reference_weights(rep, t)
    half = F32 if t.precision == "fp32" else 2
    extra, where = after_logps(m, t, half)
    for p in rep.phases:
        p.allocated += ref
        p.peak += ref
        p.reserved = None if p.reserved is None else p.reserved + ref
        if p.name.startswith("forward") and p.allocated + extra > p.peak:
            p.peak, p.where = p.allocated + extra, where
    top = max(rep.phases, key=lambda p: p.peak)
    if top.peak > rep.peak_allocated + ref and top.where == where:
        _forward_peak(rep, t, top, ref)
    rep.peak_allocated = max(rep.peak_allocated + ref, top.peak)
    # (the engine's moment of a loss's first backward nodes: here GatherBackward's, quantities.loss_kinds._logps_bytes)
    rep.peak_where = rep.peak_where.replace("cross_entropy.backward", "log_probs.backward")
    if ref:
        rep.components.insert(1, Component("reference_model", "parameters", ref, None,
                                           "a frozen copy of the parameters (TRL's ref_model, --ref-model copy)",
                                           True))
    if rep.peak_reserved is not None:
        rep.peak_reserved = max(rep.peak_reserved + ref, rep.peak_allocated)
    rep.training = t
    return rep


def _forward_peak(rep: MemoryReport, t: TrainingSpec, top, ref: int) -> None:
    """``rep``'s peak at ``top``, a forward phase whose ``after_logps`` moment is the step's largest: the
    components alive then (the states, inputs and workspaces; the gradients only when zero_grad keeps
    them) and the rest as one component of that moment (``ref``: the reference's weights, added after)."""
    rep.peak_phase, rep.peak_where = f"{top.name}@{top.step}", top.where
    rep.components = [c for c in rep.components if c.category in _AT_FORWARD
                      or (c.category == "gradients" and t.zero_grad == "zeros")]
    rest = max(0, top.peak - ref - sum(c.bytes for c in rep.components))
    rep.components.append(Component(f"dpo.{top.where}", "temporaries", rest, "fp32",
                                    "the policy's saved activations and fp32 logits, the reference's fp32 "
                                    "logits and the metrics' copies (estimate/preference.py after_logps)"))


def estimate_reward(m: ModelSpec, t: TrainingSpec, engine_estimate, **kw) -> MemoryReport:
    """TRL's RewardTrainer step (``spec.preference._reward_problem``): the engine's step of the
    sequence-classification model on the 2B chosen and rejected sequences. Its loss, ``-logsigmoid`` of
    the (B,) score differences, and the metrics read (2B, 1) scores: bytes, not counted apart (the
    engine counts the model's own loss on (2B, 1) logits, as small)."""
    rep = engine_estimate(m, replace(t, batch_size=2 * t.batch_size, trainer=None), **kw)
    rep.training = t
    return rep


#: the categories alive at a forward moment of a step (gradients only when zero_grad keeps them)
_AT_FORWARD = ("parameters", "buffers", "optimizer_states", "workspace", "inputs")
