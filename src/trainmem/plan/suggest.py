"""What would make a setup fit: each change re-estimated with the engine, sorted by its cost.

``suggest(model, **options)`` takes the options of ``trainmem.estimate`` and returns one
``Suggestion`` per applicable change that lowers the device memory, each with the report it leads
to (peak, device memory, margin, fits), cheapest first. When no single change fits, one more,
``combined``, stacks the cheapest changes until the setup fits (or as far as they go).

The cost (``Suggestion.order``) is one number in "fraction of step time" units: the slowdown a
change adds, plus a stated penalty where it changes what is trained (numerics or method) or needs
hardware the user may not have. The figures are rules of thumb, not measurements; their reasons:

==============================  =====  ================================================================
change                          cost   why
==============================  =====  ================================================================
flash attention                 0      no s x s scores; faster than eager/math (Dao et al. 2022,
                                       "FlashAttention", arXiv:2205.14135)
ZeRO-1 (dp > 1)                 0      same communication volume as DDP (Rajbhandari et al. 2020,
                                       "ZeRO", arXiv:1910.02054, section 7)
chunked cross-entropy           0.01   the LM head runs chunk by chunk
ZeRO-2 (dp > 1)                 0.01   gradients reduce-scattered every micro-batch (same volume)
selective recompute             0.03   re-runs the attention core only: Korthikanti et al. 2022,
                                       "Reducing Activation Recomputation" (arXiv:2205.05198) cut
                                       full recompute's overhead by over 90%
smaller micro-batch, more       0.02   per halving while a micro-batch keeps >= 4096 tokens, 0.10 per
grad accumulation                      halving below (matmuls over few rows run far from peak); the
                                       same sequences per step, so the same training
8-bit optimizer states          0.05   no slowdown; block-wise quantised moments match 32-bit Adam on
                                       the paper's benchmarks (Dettmers et al. 2022, "8-bit Optimizers
                                       via Block-wise Quantization", arXiv:2110.02861): a small risk
fp32 -> bf16 autocast           0.05   faster; the standard mixed precision (Micikevicius et al. 2018,
                                       "Mixed Precision Training", arXiv:1710.03740)
TP x 2, dp halved (same GPUs)   0.10   per-layer all-reduces on the critical path
per-op recompute                0.17   torchtitan's per-op policy (--recompute op) re-runs every
                                       second matmul and the elementwise ops, saves attention: about
                                       half of full recompute's extra forward
ZeRO-3 (dp > 1)                 0.15   parameters gathered in forward and backward: 1.5x DDP traffic
full recompute                  0.33   one more forward of every layer: forward is ~1/3 of the
                                       forward + backward FLOPs (Chen et al. 2016, arXiv:1604.06174)
pure bf16                       0.40   faster, but without an fp32 master copy small updates round
                                       away; Rae et al. 2021 (Gopher, arXiv:2112.11446, appendix C.2)
                                       found the fp32 copy necessary: a quality risk priced above
                                       full recompute's known slowdown
optimizer in backward           0.45   no global-norm gradient clipping, no accumulation
optimizer CPU offload           0.50   the optimizer step on the CPU and every gradient and
                                       parameter over PCIe each step (Ren et al. 2021,
                                       "ZeRO-Offload", arXiv:2101.06840); needs host memory
TP x 2 with more GPUs           1.10   twice the GPUs per replica (1.0) plus TP's all-reduces
more GPUs (sharding)            f - 1  f x the GPUs (the extra GPUs as a fraction of those in use),
                                       model states sharded over them (ZeRO-3, or ZeRO-1 with pp > 1)
LoRA (r = 16)                   5      trains adapters on a frozen model: a different training
==============================  =====  ================================================================

So: cheaper changes of the same training first, then numerics, then more hardware, then a
different training. Changes of one ``family`` (recompute levels, micro-batch sizes, ZeRO stages,
GPU counts) are alternatives; the fitting view keeps the cheapest that fits. Data parallelism is
never reduced below its given size except to keep the GPU count under TP x 2 (dp even).
"""
from __future__ import annotations

import math
from itertools import combinations
from dataclasses import dataclass, field
from typing import Any

from ..errors import TrainmemError
from ..render.suggestions import format_suggestions  # noqa: F401  (re-exported: trainmem.plan)
from ..report import MemoryReport
from ..spec.layout import tp_problems
from ._common import Evaluator, divisors

#: GPUs without bf16 tensor cores (spec/gpus.json: "fp16 for V100 and T4"): no bf16 suggestions there
NO_BF16 = ("t4", "v100")
MORE_GPU_FACTORS = (2, 4, 8, 16, 32, 64)


@dataclass
class Suggestion:
    """One change to the setup and the memory it leads to."""

    name: str                  # short id: "flash-attention", "zero-2", ...
    title: str                 # what changes, e.g. "attention sdpa -> flash"
    change: dict[str, Any]     # the options that change (the API's names)
    cost: str                  # what it costs, in words
    slowdown: float            # rough fraction of step time it adds
    changes_semantics: bool    # True when the training itself changes (not only its speed)
    peak_allocated: int
    device_used: int | None
    margin: int | None
    fits: bool | None
    saved: int                 # bytes of device memory (or allocated, without a GPU) saved
    note: str = ""
    report: MemoryReport | None = field(default=None, repr=False)
    order: float = 0.0         # the cost used for sorting (slowdown + penalty, see the module doc)
    family: str = ""           # alternatives of one kind ("recompute", "micro-batch", ...)
    parts: list["Suggestion"] = field(default_factory=list, repr=False)  # the changes ``combined`` stacks

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "change": dict(self.change), "cost": self.cost,
                "slowdown": self.slowdown, "changes_semantics": self.changes_semantics,
                "peak_allocated": self.peak_allocated, "device_used": self.device_used,
                "margin": self.margin, "fits": self.fits, "saved": self.saved, "note": self.note,
                "order": self.order, "family": self.family, "parts": [p.name for p in self.parts]}


@dataclass(frozen=True)
class _Cand:
    """A change before it is estimated."""

    name: str
    family: str
    title: str
    change: dict[str, Any]
    cost: str
    slowdown: float
    order: float
    semantics: bool = False
    note: str = ""


def _free_and_time(ev: Evaluator, t: Any) -> list[_Cand]:
    """Changes that keep the training and the GPUs, costing at most time."""
    m, out = ev.model, []
    if t.attention != "flash" and t.precision != "fp32":
        out.append(_Cand("flash-attention", "attention", f"attention {t.attention} -> flash", {"attention": "flash"},
                         "none (usually faster)", 0.0, 0.0))
    if m.head in ("causal-lm", "masked-lm") and t.loss_chunks == 1:
        out.append(_Cand("chunked-cross-entropy", "loss", "loss_chunks 1 -> 8 (chunked cross-entropy)",
                         {"loss_chunks": 8}, "≈1% (the head runs in chunks)", 0.01, 0.01,
                         note="chunked or fused linear-cross-entropy (torchtune, Liger)"))
    if t.shard_group > 1 and t.fsdp is None and not t.distributed_optimizer:
        for z, cost, slow in ((1, "none (DDP's communication volume)", 0.0),
                              (2, "≈1% (gradients reduce-scattered every micro-batch)", 0.01),
                              (3, "≈15% (parameters gathered in forward and backward)", 0.15)):
            if z > t.zero and not (t.pp > 1 and z >= 2):
                out.append(_Cand(f"zero-{z}", "zero", f"ZeRO stage {t.zero} -> {z}", {"zero": z}, cost, slow, slow))
    if t.ds_whole_load:  # DeepSpeed ZeRO-3 of a model built whole (TrainingSpec.ds_whole_load)
        out.append(_Cand("zero-init", "zero-init", "--zero-init on (deepspeed.zero.Init)",
                         {"zero_init": "on"}, "none (each parameter partitioned as it is built)", 0.0, 0.0))
    if t.recompute == "none":
        out.append(_Cand("recompute-selective", "recompute", "recompute none -> selective",
                         {"recompute": "selective"}, "≈3% (attention core re-run in backward)", 0.03, 0.03))
    if t.recompute in ("none", "selective") and _op_recompute_applies(m, t):
        out.append(_Cand("recompute-op", "recompute", f"recompute {t.recompute} -> op (torchtitan per-op)",
                         {"recompute": "op"}, "≈17% (every second matmul and the elementwise ops re-run)",
                         0.17, 0.17))
    if t.recompute != "full":
        out.append(_Cand("recompute-full", "recompute", f"recompute {t.recompute} -> full", {"recompute": "full"},
                         "≈33% (one more forward of every layer)", 0.33, 0.33))
    out += _micro_batches(t)
    tp2 = 2 * t.tp
    if not tp_problems(m, tp2) and t.dp % 2 == 0:
        out.append(_Cand("tp-x2", "tp", f"tensor parallel {t.tp} -> {tp2}, data parallel {t.dp} -> {t.dp // 2}",
                         {"tp": tp2, "dp": t.dp // 2}, "≈10% (all-reduces in every layer); same GPU count",
                         0.10, 0.10))
    return out


def _op_recompute_applies(m: Any, t: Any) -> bool:
    """Whether ``--recompute op`` is a setup trainmem models here (``TrainingSpec._check_recompute``,
    ``training.check_against``)."""
    return m.family != "derived" and not (t.lora_rank or t.quantize or t.tp > 1 or t.offload_activations)


def _micro_batches(t: Any) -> list[_Cand]:
    """Smaller micro-batches with more accumulation: the same sequences per optimizer step."""
    if t.batch_size == 1 or t.optimizer_in_backward:
        return []
    out, total, tokens = [], t.batch_size * t.grad_accum, t.seq_len // t.cp
    for b2 in sorted((d for d in divisors(total) if d < t.batch_size), reverse=True):
        halvings = math.log2(t.batch_size / b2)
        big = min(halvings, max(0.0, math.log2(t.batch_size * tokens / 4096)))  # halvings above 4096 tokens
        slow = round(0.02 * big + 0.10 * (halvings - big), 3)
        out.append(_Cand(f"micro-batch-{b2}", "micro-batch",
                         f"micro-batch {t.batch_size} -> {b2}, grad-accum {t.grad_accum} -> {total // b2}",
                         {"batch_size": b2, "grad_accum": total // b2},
                         f"≈{100 * slow:.0f}% (smaller matmuls; same sequences per step)", slow, slow))
    return out


def _numerics(ev: Evaluator, t: Any, base: MemoryReport) -> list[_Cand]:
    """Changes of precision, optimizer or where its states live."""
    out = []
    hw = ev.hardware
    bf16_ok = hw is None or not hw.name.startswith(NO_BF16)
    if t.optimizer in ("adam", "adamw"):
        out.append(_Cand("adamw-8bit", "optimizer", f"optimizer {t.optimizer} -> adamw-8bit (bitsandbytes)",
                         {"optimizer": "adamw-8bit", "optimizer_impl": None}, "none (quantised moments)", 0.0, 0.05,
                         True, "block-wise quantised moments: close to AdamW, not identical"))
    if t.precision == "fp32" and bf16_ok:
        out.append(_Cand("bf16-amp", "precision", "precision fp32 -> bf16-amp (autocast)", {"precision": "bf16-amp"},
                         "faster; bf16 matmuls", 0.0, 0.05, True, "fp32 weights and optimizer states are kept"))
    if t.precision in ("fp32", "fp16-amp", "bf16-amp") and bf16_ok:
        out.append(_Cand("pure-bf16", "precision", f"precision {t.precision} -> bf16 (pure bf16)",
                         {"precision": "bf16"}, "faster; small updates may round away", 0.0, 0.40, True,
                         "bf16 weights, gradients, states; an fp32 master only where the framework keeps one"))
    if not t.optimizer_in_backward and t.grad_accum == 1 and t.optimizer != "sgd":
        out.append(_Cand("optimizer-in-backward", "optimizer-in-backward", "optimizer step inside backward",
                         {"optimizer_in_backward": True}, "none", 0.0, 0.45, True,
                         "each gradient is applied and freed at once: no clipping by the global gradient norm, "
                         "no gradient accumulation"))
    if not t.offload_optimizer:
        cats = base.by_category()
        host = cats.get("master_weights", 0) + cats.get("optimizer_states", 0)
        out.append(_Cand("offload-optimizer", "offload", "optimizer offload to CPU (ZeRO-Offload)",
                         {"offload_optimizer": True}, "≈50% (optimizer step on the CPU, PCIe traffic)", 0.5, 0.5,
                         False, f"DeepSpeed offload_optimizer: cpu; states and fp32 master in host memory "
                                f"(≈{host / 2**30:.1f} GiB per GPU)"))
    return out


def _more_gpus(ev: Evaluator, t: Any) -> list[_Cand]:
    """Changes that need more GPUs (never a smaller data-parallel group), and LoRA."""
    out = []
    tp2 = 2 * t.tp
    if not tp_problems(ev.model, tp2) and t.dp % 2:
        out.append(_Cand("tp-x2-more-gpus", "tp", f"tensor parallel {t.tp} -> {tp2} (twice the GPUs)", {"tp": tp2},
                         "twice the GPUs per replica; ≈10% (all-reduces in every layer)", 0.10, 1.10))
    zero = {} if t.fsdp is not None or t.distributed_optimizer else {"zero": max(t.zero, 1 if t.pp > 1 else 3)}
    how = f"ZeRO-{zero['zero']}" if zero else ("FSDP" if t.fsdp else "the distributed optimizer")
    extra = 0.15 if zero.get("zero") == 3 and t.zero < 3 else 0.0   # ZeRO-3's gathers (table above)
    for f in MORE_GPU_FACTORS:
        note = f"the global batch grows {f}x" + (f" (or divide the accumulation by {f})" if t.grad_accum % f == 0 else "")
        out.append(_Cand(f"more-gpus-{f}", "more-gpus", f"{f}x the GPUs: dp {t.dp} -> {t.dp * f}, {how}",
                         {"dp": t.dp * f, **zero}, f"{f}x the GPUs", extra, f - 1 + extra, False, note))
    if not t.lora_rank:
        out.append(_Cand("lora", "lora", "LoRA adapters, rank 16", {"lora_rank": 16}, "a different training", -0.2,
                         5.0, True, "trains low-rank adapters; the model stays frozen"))
    return out


def _candidates(ev: Evaluator, base: MemoryReport) -> list[_Cand]:
    """Every applicable change, unsorted."""
    t = base.training
    return _free_and_time(ev, t) + _numerics(ev, t, base) + _more_gpus(ev, t)


def suggest(model: Any, base: MemoryReport | None = None, by: str = "estimate", **options: Any) -> list[Suggestion]:
    """Every change that lowers the memory of ``model`` trained with ``options``, each estimated.

    ``options`` are those of ``trainmem.estimate`` (give ``gpu`` or ``gpu_memory`` to learn which
    changes fit). Returns the changes that save memory, cheapest first by the documented cost
    (module docstring), then a ``combined`` one when the setup does not fit its GPU and several
    changes together fit more cheaply than any single one (or none fits alone).
    ``base`` may pass the report already computed for ``options``.
    """
    ev = Evaluator(model, by=by, replay=False, **options)  # verdicts only: no allocator replay
    return suggest_for(ev, base)


def suggest_for_report(report: MemoryReport) -> list[Suggestion]:
    """``suggest`` for the setup a report was made from (its model, training, GPU and method): the
    hook ``trainmem estimate --gpu`` calls when the setup does not fit, e.g.
    ``if r.fits is False: print(format_suggestions(suggest_for_report(r)))``."""
    if report.model is None or report.training is None:
        raise TrainmemError("this report does not carry its model and training setup")
    opts = {k: v for k, v in report.training.to_dict().items() if v is not None}
    # the suggestions compare fit verdicts (device_peak: allocated + 1/32 + context): no allocator replay
    ev = Evaluator(report.model, method=report.method or "trainmem", gpu=report.hardware,
                   max_fraction=report.max_fraction, replay=False, **opts)
    return suggest_for(ev, report)


def _estimate(ev: Evaluator, base: MemoryReport, c: _Cand, changes: dict[str, Any]) -> Suggestion | None:
    """The suggestion ``c`` re-estimated, or None when it does not apply."""
    try:
        r = ev.report(**{**changes, **c.change})
    except TrainmemError:
        return None  # not applicable to this model or setup (divisibility, precision, ...)
    saved = base.device_peak - r.device_peak
    return Suggestion(c.name, c.title, dict(c.change), c.cost, c.slowdown, c.semantics, r.peak_allocated,
                      r.device_peak, r.margin, r.fits, saved, c.note, r, c.order, c.family)


def suggest_for(ev: Evaluator, base: MemoryReport | None = None, **changes: Any) -> list[Suggestion]:
    """``suggest`` on an :class:`Evaluator` (with ``changes`` applied to its options)."""
    base = base if base is not None else ev.report(**changes)
    every = [s for c in _candidates(ev, base) for s in [_estimate(ev, base, c, changes)] if s is not None]
    every.sort(key=lambda s: (s.order, s.changes_semantics, -s.saved))
    out = [s for s in every if s.saved > 0]   # what saves nothing at today's peak may help in a combination
    if base.fits is False:
        both = combine(ev, base, every, changes)
        best = min((s.order for s in out if s.fits), default=math.inf)
        if both is not None and len(both.parts) > 1 and (not both.fits or both.order < best):
            out.append(both)
    return out


def _cheapest_subset(picked: dict[str, Suggestion], run: Any, fitting: MemoryReport
                     ) -> tuple[dict[str, Suggestion], MemoryReport]:
    """The subset of the ``picked`` families (at most 2**8 of them tried, by total cost) that is
    cheapest and still fits; ``picked`` itself (which fits, as ``fitting``) when none is smaller."""
    fams = sorted(picked, key=lambda f: picked[f].order)[:8]
    rest = {f: picked[f] for f in picked if f not in fams}
    subsets = sorted((c for k in range(1, len(fams)) for c in combinations(fams, k)),
                     key=lambda c: sum(picked[f].order for f in c))
    for c in subsets:
        trial = {**rest, **{f: picked[f] for f in c}}
        r = run(trial)
        if r is not None and r.fits:
            return trial, r
    return picked, fitting


def combine(ev: Evaluator, base: MemoryReport, singles: list[Suggestion], changes: dict[str, Any]
            ) -> Suggestion | None:
    """Several changes together: the single changes (not LoRA, a different training) stacked in
    cost order, each kept when it lowers the memory further (one per family, a later member of a
    family replacing the earlier; two passes, since a change can only help once another moved the
    peak), until the setup fits; then the cheapest subset of those
    families that still fits, each family moved to its cheapest member that keeps it fitting.
    Every step is a full re-estimate; when even all of them do not fit, the closest stack."""
    picked: dict[str, Suggestion] = {}

    def merged(sel: dict[str, Suggestion]) -> dict[str, Any]:
        out = dict(changes)
        for s in sorted(sel.values(), key=lambda s: s.order):
            out.update(s.change)
        return out

    def run(sel: dict[str, Suggestion]) -> MemoryReport | None:
        try:
            return ev.report(**merged(sel))
        except TrainmemError:
            return None

    cur = base
    for _ in range(2):  # greedy, cheapest first; twice, as the peak moves (states, then activations)
        for s in singles:
            taken = {k for f, p in picked.items() if f != s.family for k in p.change}
            if s.family == "lora" or cur.fits or taken & set(s.change) or picked.get(s.family) is s:
                continue  # LoRA is another training; a change of an option another family set would contradict it
            r = run({**picked, s.family: s})
            if r is not None and r.device_peak < cur.device_peak:
                picked[s.family], cur = s, r
    if not picked:
        return None
    if cur.fits:
        picked, cur = _cheapest_subset(picked, run, cur)
        for fam in sorted(picked, key=lambda f: -picked[f].order):
            for alt in [s for s in singles if s.family == fam and s.order < picked[fam].order]:
                r = run({**picked, fam: alt})
                if r is not None and r.fits:
                    picked, cur = {**picked, fam: alt}, r
                    break
    parts = sorted(picked.values(), key=lambda s: s.order)
    change = {k: v for s in parts for k, v in s.change.items()}
    return Suggestion("combined", " + ".join(s.title for s in parts), change, "; ".join(s.cost for s in parts),
                      sum(s.slowdown for s in parts), any(s.changes_semantics for s in parts), cur.peak_allocated,
                      cur.device_peak, cur.margin, cur.fits, base.device_peak - cur.device_peak,
                      "these changes together " + ("fit" if cur.fits else "still do not fit"), cur,
                      sum(s.order for s in parts), "combined", parts)
