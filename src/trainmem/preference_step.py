"""TRL's ``DPOTrainer`` step (``--trainer dpo``) for ``trace`` and ``measure``: ``DPOTrainStep``.

The step is ``TrainStep``'s (the HF Trainer's ``training_step``: forward and loss under autocast,
``loss.detach()`` kept, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``) with TRL's
``DPOTrainer._compute_loss`` (trl/trainer/dpo_trainer.py L1329-1655 at v1.9.0) as the forward and
loss, run on the 2B sequences of B pairs. trl is not a dependency: the small functions the loss calls
are copied here with their source (``selective_log_softmax``, ``entropy_from_logits``: trl/trainer/
utils.py L479-560 at v1.9.0). What each tensor costs is modelled by ``estimate/preference.py``.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from .spec import ModelSpec, TrainingSpec
from .spec.preference import ref_model_of
from .workload import TrainStep, model_batch, unwrapped

#: the reference copy's name under the policy (registered so that loading the model loads it, frozen)
REF_ATTR = "trainmem_ref_model"
#: ``DPOConfig.beta`` (dpo_config.py at v1.9.0): the sigmoid loss's temperature (no effect on memory)
BETA = 0.1


def add_reference(model: torch.nn.Module, t: TrainingSpec) -> torch.nn.Module:
    """``--ref-model copy``: a frozen copy of the model (its weights in the model's dtype, no gradients),
    registered under it as ``REF_ATTR`` so that it is loaded with it, as TRL loads its reference at
    ``DPOTrainer.__init__`` (``create_model_from_path``, dpo_trainer.py L899-908 at v1.9.0) and accelerate
    puts it on the device (``prepare_model(evaluation_mode=True)``, L930-936). Made before LoRA wraps
    the model (an explicit reference is the base model). Other setups: ``model`` unchanged."""
    if ref_model_of(t) != "copy":
        return model
    ref = copy.deepcopy(model).requires_grad_(False)
    model.add_module(REF_ATTR, ref)
    return model


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL's ``selective_log_softmax`` (trl/trainer/utils.py L479-523 at v1.9.0), copied: fp32 logits
    gather the labels' logits and take one ``logsumexp`` per sequence (a loop "to reduce peak mem
    consumption", each one's (s, vocab) temporary freed before the next); half logits run
    ``log_softmax`` per sequence and gather."""
    squeeze = index.ndim == logits.ndim - 1
    if squeeze:
        index = index.unsqueeze(-1)
    if logits.dtype in [torch.float32, torch.float64]:
        selected_logits = torch.gather(logits, dim=-1, index=index)
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        per_token_logps = selected_logits - logsumexp_values.unsqueeze(-1)
    else:
        rows = []
        for row_logits, row_labels in zip(logits, index, strict=True):
            row_logps = F.log_softmax(row_logits, dim=-1)
            rows.append(row_logps.gather(dim=-1, index=row_labels))
        per_token_logps = torch.stack(rows)
    if squeeze:
        per_token_logps = per_token_logps.squeeze(-1)
    return per_token_logps


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """TRL's ``entropy_from_logits`` (trl/trainer/utils.py L526-560 at v1.9.0), copied: the logits
    flattened to (N, vocab) (``reshape``: a copy of a non-contiguous view), then ``log_softmax``,
    ``exp`` and their product on ``chunk_size`` rows at a time."""
    original_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    entropies = []
    for chunk in flat_logits.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        entropies.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(entropies, dim=0).reshape(original_shape)


class DPOTrainStep(TrainStep):
    """``TrainStep`` with TRL's DPO forward and loss on 2B sequences (``_compute_loss``)."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, t: TrainingSpec, device: str, **kw: Any) -> None:
        super().__init__(model, spec, t, device, **kw)
        self.ref = getattr(unwrapped(model), REF_ATTR, None)
        if self.ref is not None:
            self.ref.eval()   # from_pretrained returns it in eval mode; the Trainer trains only the policy

    def batch(self, length: int | None = None) -> dict[str, Any]:
        """``DataCollatorForPreference``'s batch (dpo_trainer.py L152-300 at v1.9.0): the B prompt + chosen
        sequences then the B prompt + rejected ones, (2B, seq_len) ``input_ids`` and a ``completion_mask``
        (every token a completion token here: the most the mask can select; no padding, so no attention
        mask is built)."""
        t = self.training
        two = replace(t, batch_size=2 * t.batch_size, trainer=None, ref_model=None)
        self.batches_made += 1
        ids = model_batch(self.spec, two, self.device)["input_ids"]
        return {"input_ids": ids, "completion_mask": torch.ones_like(ids)}

    def reference(self) -> Any:
        """The reference forward's model and context: the frozen copy, or the policy with its adapters
        disabled (PEFT: ``use_adapter(model, None)`` -> ``model.disable_adapter()``, dpo_trainer.py
        L1374-1380 and utils.py L1200-1235 at v1.9.0)."""
        if self.ref is not None:
            return self.ref, contextlib.nullcontext()
        inner = unwrapped(self.model)   # the Trainer's ``self.model``: not the DDP wrapper (model_wrapped)
        return inner, inner.disable_adapter()

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """``DPOTrainer._compute_loss`` (dpo_trainer.py L1329-1655 at v1.9.0), sigmoid loss."""
        ids, mask = batch["input_ids"], batch["completion_mask"]
        outputs = self.model(input_ids=ids, use_cache=False)
        outputs["logits"] = logits = _fp32_output(outputs.logits, self.amp)   # (the half logits dropped)
        shift_logits, shift_labels, shift_mask = logits[..., :-1, :], ids[..., 1:], mask[..., 1:]
        per_token_logps = selective_log_softmax(shift_logits, shift_labels)
        per_token_logps = per_token_logps.masked_fill(shift_mask == 0, 0.0)
        chosen_logps, rejected_logps = per_token_logps.sum(dim=1).chunk(2, dim=0)
        ref_outputs, ref_chosen, ref_rejected = self._reference_logps(ids, shift_labels, shift_mask)
        delta = (chosen_logps - ref_chosen) - (rejected_logps - ref_rejected)
        loss = -F.logsigmoid(BETA * delta).mean()
        _metrics(shift_logits, shift_labels, shift_mask)
        del ref_outputs   # ``_compute_loss`` returns: its locals go
        return outputs, loss

    def _reference_logps(self, ids: torch.Tensor, shift_labels: torch.Tensor,
                         shift_mask: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The reference's summed log-probs of the chosen and rejected halves under ``torch.no_grad()``
        (dpo_trainer.py L1364-1392 at v1.9.0), and its output, which ``_compute_loss`` keeps to the end;
        ``--ref-model precomputed``: zeros read from the batch (no forward)."""
        if ref_model_of(self.training) == "precomputed":
            zeros = torch.zeros(ids.shape[0] // 2, device=ids.device)
            return None, zeros, zeros
        model, ctx = self.reference()
        with torch.no_grad(), ctx:
            ref_outputs = model(input_ids=ids, use_cache=False)
            ref_outputs["logits"] = _fp32_output(ref_outputs.logits, self.amp)
            ref_logps = selective_log_softmax(ref_outputs.logits[..., :-1, :], shift_labels)
            ref_logps = ref_logps.masked_fill(shift_mask == 0, 0.0).sum(dim=1)
        chosen, rejected = ref_logps.chunk(2, dim=0)
        return ref_outputs, chosen, rejected


def _fp32_output(logits: torch.Tensor, amp: Any = None) -> torch.Tensor:
    """accelerate's ``convert_outputs_to_fp32`` around a model forward under mixed precision (TRL's
    ``bf16=True`` default; accelerate ``accelerator.py`` ``prepare_model``, ``utils/operations.py``
    ``convert_to_fp32``): a half output comes back as an fp32 copy. Pure half weights run under the
    same autocast in TRL, so any half logits are cast; fp32 ones are returned as they are."""
    return logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits


def _metrics(shift_logits: torch.Tensor, shift_labels: torch.Tensor, shift_mask: torch.Tensor) -> None:
    """``_compute_loss``'s metrics under no grad (dpo_trainer.py L1571-1655 at v1.9.0): the entropy of the
    shifted logits (``entropy_from_logits``: a reshape copy, 128 rows at a time), the chosen and rejected
    logits' mean over their completion tokens (``chosen_logits[chosen_mask.bool()]``: a copy of those
    rows; here every token is one, ``index_select`` of all of them, since boolean indexing needs the
    data) and the chosen token accuracy (``argmax``)."""
    with torch.no_grad():
        logits = shift_logits.detach()
        (entropy_from_logits(logits) * shift_mask).sum()
        chosen, rejected = logits.chunk(2, dim=0)
        b, s = chosen.shape[:2]
        # the indices ``nonzero`` makes of a mask that selects every token: (sequence, position) pairs
        seq = torch.arange(b, device=chosen.device).repeat_interleave(s)
        pos = torch.arange(s, device=chosen.device).repeat(b)
        for half in (chosen, rejected):
            half[seq, pos].mean(-1).sum()
        (chosen.argmax(dim=-1) == shift_labels[: len(shift_labels) // 2]).sum()


class RewardTrainStep(TrainStep):
    """``TrainStep`` with TRL's ``RewardTrainer.compute_loss`` (trl/trainer/reward_trainer.py L739-778 at
    v1.9.0) on the 2B chosen and rejected sequences of B pairs."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, t: TrainingSpec, device: str, **kw: Any) -> None:
        super().__init__(model, spec, t, device, **kw)
        config = unwrapped(model).config
        if config.pad_token_id is None:  # TRL sets it from the tokenizer (reward_trainer.py L547-548)
            config.pad_token_id = 0

    def batch(self, length: int | None = None) -> dict[str, Any]:
        """``DataCollatorForPreference``'s batch (reward_trainer.py L198-223 at v1.9.0): the B chosen then the
        B rejected sequences, (2B, seq_len) ``input_ids`` (no padding: no attention mask is built)."""
        t = self.training
        self.batches_made += 1
        two = replace(t, batch_size=2 * t.batch_size, trainer=None)
        return {"input_ids": model_batch(self.spec, two, self.device)["input_ids"]}

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """The scores of the 2B sequences (fp32 under accelerate's ``convert_outputs_to_fp32``), the
        pairwise ``-logsigmoid`` loss and the metrics under no grad."""
        outputs = self.model(input_ids=batch["input_ids"], use_cache=False)
        outputs["logits"] = _fp32_output(outputs.logits)
        chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
        loss = -F.logsigmoid(chosen - rejected).mean()
        with torch.no_grad():
            outputs.logits.min(), outputs.logits.mean(), outputs.logits.max()
            (chosen > rejected).float().mean(), (chosen - rejected).mean()
        return outputs, loss
