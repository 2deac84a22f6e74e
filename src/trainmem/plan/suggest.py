"""What single change would make a setup fit: each one estimated, sorted by its cost to the user.

``suggest(model, **options)`` takes the options of ``trainmem.estimate`` and returns one
``Suggestion`` per applicable change that lowers the peak, each with the memory it leads to.
Order: changes that keep the training semantics first, by their rough slowdown (``slowdown``, a
fraction of step time), then those that change what is trained (``changes_semantics``), likewise.
The slowdown figures are rules of thumb, documented in docs/plan.md:

================================  ========  =====================================================
change                            slowdown  why
================================  ========  =====================================================
flash attention                   0         no s x s scores; usually faster than eager/sdpa-math
chunked cross-entropy             0.01      the head runs chunk by chunk
ZeRO stage 1 / 2                  0 / 0.01  same communication volume as DDP (stage 2: per
                                            micro-batch reduce-scatter)
selective recompute               0.03      re-runs the attention core in backward
halve micro-batch, double accum.  0.05      smaller matmuls, same tokens per step
TP x 2                            0.10      per-layer all-reduces; twice the GPUs per replica
ZeRO stage 3                      0.15      parameters gathered in forward and backward
full recompute                    0.33      one more forward of every layer
optimizer in backward             0         semantics: no global-norm clipping, no accumulation
8-bit Adam                        0         semantics: quantised optimizer states
LoRA (r = 16)                     -0.2      semantics: trains adapters, not the model
================================  ========  =====================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import TrainmemError
from ..render.suggestions import format_suggestions  # noqa: F401  (re-exported: trainmem.plan)
from ..report import MemoryReport
from ._common import Evaluator


@dataclass
class Suggestion:
    """One change to the setup and the memory it leads to."""

    name: str                  # short id: "flash-attention", "zero-2", ...
    title: str                 # what changes, e.g. "attention sdpa -> flash"
    change: dict[str, Any]     # the options that change (the API's names)
    cost: str                  # what it costs, in words
    slowdown: float            # rough fraction of step time it adds (ordering key)
    changes_semantics: bool    # True when the training itself changes (not only its speed)
    peak_allocated: int
    device_used: int | None
    margin: int | None
    fits: bool | None
    saved: int                 # bytes of device memory (or allocated, without a GPU) saved
    note: str = ""
    report: MemoryReport | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "change": dict(self.change), "cost": self.cost,
                "slowdown": self.slowdown, "changes_semantics": self.changes_semantics,
                "peak_allocated": self.peak_allocated, "device_used": self.device_used,
                "margin": self.margin, "fits": self.fits, "saved": self.saved, "note": self.note}


def _candidates(ev: Evaluator, base: MemoryReport) -> list[tuple[str, str, dict[str, Any], str, float, bool, str]]:
    """(name, title, change, cost, slowdown, changes_semantics, note) of every applicable change."""
    t, m = base.training, ev.model
    out: list[tuple[str, str, dict[str, Any], str, float, bool, str]] = []
    lm = m.head in ("causal-lm", "masked-lm")
    if t.attention != "flash" and t.precision != "fp32":
        out.append(("flash-attention", f"attention {t.attention} -> flash", {"attention": "flash"},
                    "none (usually faster)", 0.0, False, ""))
    if lm and t.loss_chunks == 1:
        out.append(("chunked-cross-entropy", "loss_chunks 1 -> 8 (chunked cross-entropy)", {"loss_chunks": 8},
                    "≈1% (the head runs in chunks)", 0.01, False,
                    "fused/chunked linear-cross-entropy (e.g. Liger, torchtune's chunked loss)"))
    if t.shard_group > 1 and t.fsdp is None and t.zero < 3 and not t.distributed_optimizer:
        z = t.zero + 1
        if not (t.pp > 1 and z >= 2):
            cost = {1: "none (same communication volume as DDP)",
                    2: "≈1% (gradients reduce-scattered every micro-batch)",
                    3: "≈15% (parameters all-gathered in forward and backward: 1.5x DDP traffic)"}[z]
            out.append((f"zero-{z}", f"ZeRO stage {t.zero} -> {z}", {"zero": z}, cost,
                        {1: 0.0, 2: 0.01, 3: 0.15}[z], False, ""))
    if t.recompute == "none":
        out.append(("recompute-selective", "recompute none -> selective", {"recompute": "selective"},
                    "≈3% (attention core re-run in backward)", 0.03, False, ""))
    if t.batch_size > 1 and not t.optimizer_in_backward:
        b2 = t.batch_size // 2 if t.batch_size % 2 == 0 else 1
        ga2 = t.grad_accum * (t.batch_size // b2)
        out.append(("halve-micro-batch", f"micro-batch {t.batch_size} -> {b2}, grad-accum {t.grad_accum} -> {ga2}",
                    {"batch_size": b2, "grad_accum": ga2}, "≈5% (smaller matmuls; same tokens per step)",
                    0.05, False, ""))
    tp2 = 2 * t.tp
    if m.num_heads % tp2 == 0 and (m.num_kv_heads % tp2 == 0 or tp2 % m.num_kv_heads == 0):
        out.append(("tp-x2", f"tensor parallel {t.tp} -> {tp2}", {"tp": tp2},
                    "≈10% (all-reduces in every layer) and twice the GPUs per replica", 0.10, False,
                    "keep the GPU count by halving the data-parallel size"))
    if t.recompute != "full":
        out.append(("recompute-full", f"recompute {t.recompute} -> full", {"recompute": "full"},
                    "≈33% (one more forward of every layer)", 0.33, False, ""))
    if not t.optimizer_in_backward and t.grad_accum == 1 and t.optimizer != "sgd":
        out.append(("optimizer-in-backward", "optimizer step inside backward", {"optimizer_in_backward": True},
                    "none", 0.0, True,
                    "each gradient is applied and freed at once: no clipping by the global gradient norm, "
                    "no gradient accumulation"))
    if t.optimizer in ("adam", "adamw"):
        out.append(("adamw-8bit", f"optimizer {t.optimizer} -> adamw-8bit (bitsandbytes)",
                    {"optimizer": "adamw-8bit", "optimizer_impl": None}, "none", 0.0, True,
                    "block-wise quantised moments: close to AdamW, not identical"))
    if not t.lora_rank:
        out.append(("lora", "LoRA adapters, rank 16", {"lora_rank": 16}, "faster steps", -0.2, True,
                    "trains low-rank adapters on the frozen model: a different training"))
    return out


def suggest(model: Any, base: MemoryReport | None = None, by: str = "estimate", **options: Any) -> list[Suggestion]:
    """Every single change that lowers the memory of ``model`` trained with ``options``, estimated.

    ``options`` are those of ``trainmem.estimate`` (give ``gpu`` or ``gpu_memory`` to learn which
    changes fit). Returns the changes that save memory, cheapest first: those that keep the
    training semantics by rough slowdown, then those that change it. ``base`` may pass the report
    already computed for ``options``.
    """
    ev = Evaluator(model, by=by, **options)
    return suggest_for(ev, base)


def suggest_for_report(report: MemoryReport) -> list[Suggestion]:
    """``suggest`` for the setup a report was made from (its model, training, GPU and method): the
    hook ``trainmem estimate --gpu`` calls when the setup does not fit, e.g.
    ``if r.fits is False: print(format_suggestions(suggest_for_report(r)))``."""
    if report.model is None or report.training is None:
        raise TrainmemError("this report does not carry its model and training setup")
    opts = {k: v for k, v in report.training.to_dict().items() if v is not None}
    ev = Evaluator(report.model, method=report.method or "trainmem", gpu=report.hardware,
                   max_fraction=report.max_fraction, **opts)
    return suggest_for(ev, report)


def suggest_for(ev: Evaluator, base: MemoryReport | None = None, **changes: Any) -> list[Suggestion]:
    """``suggest`` on an :class:`Evaluator` (with ``changes`` applied to its options)."""
    base = base if base is not None else ev.report(**changes)
    base_used = base.device_peak
    out: list[Suggestion] = []
    for name, title, change, cost, slow, sem, note in _candidates(ev, base):
        try:
            r = ev.report(**{**changes, **change})
        except TrainmemError:
            continue  # not applicable to this model or setup (divisibility, precision, ...)
        saved = base_used - r.device_peak
        if saved <= 0:
            continue
        out.append(Suggestion(name, title, change, cost, slow, sem, r.peak_allocated, r.device_used, r.margin,
                              r.fits, saved, note, r))
    out.sort(key=lambda s: (s.changes_semantics, s.slowdown, -s.saved))
    return out
