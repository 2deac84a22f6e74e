"""``trainmem compare``: estimate | trace | measure of one setup, side by side.

Rows come from :func:`trainmem.report.compare` (totals, categories at the peak, the allocated
memory at the end of each phase), plus the peak of each phase and, where known, its reserved
memory. Every row carries the absolute and the relative difference of each source against a
reference (by default the most real source present: measure, else trace).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import TrainmemError
from ..report import Difference, MemoryReport, compare

SOURCES = ("estimate", "trace", "measure")


@dataclass
class Comparison:
    sources: list[str]
    reports: list[MemoryReport]
    rows: list[Difference]
    reference: str
    device: str
    notes: list[str] = field(default_factory=list)

    @property
    def ref_index(self) -> int:
        return self.sources.index(self.reference)

    def worst_phase_rel(self, source: str) -> float | None:
        """Largest |relative difference| of ``source`` against the reference over the phase rows
        (allocated and peak)."""
        i, r = self.sources.index(source), self.ref_index
        rels = [abs(x) for d in self.rows if d.kind in ("phase", "phase_peak")
                for x in [d.rel(i, r)] if x is not None]
        return max(rels) if rels else None

    def to_dict(self) -> dict[str, Any]:
        r = self.ref_index
        rows = []
        for d in self.rows:
            rows.append({"kind": d.kind, "name": d.name,
                         "values": dict(zip(self.sources, d.values)),
                         "diff": {s: d.diff(i, r) for i, s in enumerate(self.sources) if i != r},
                         "rel": {s: d.rel(i, r) for i, s in enumerate(self.sources) if i != r}})
        return {
            "model": getattr(self.reports[0].model, "name", None),
            "device": self.device,
            "sources": self.sources,
            "reference": self.reference,
            "reports": {s: {"method": rep.method, "peak_allocated": rep.peak_allocated,
                            "peak_reserved": rep.peak_reserved, "device_used": rep.device_used,
                            "peak_phase": rep.peak_phase, "warnings": rep.warnings}
                        for s, rep in zip(self.sources, self.reports)},
            "worst_phase_rel": {s: self.worst_phase_rel(s) for s in self.sources if s != self.reference},
            "rows": rows,
            "notes": self.notes,
        }


def _phase_rows(reports: list[MemoryReport], what: str, kind: str) -> list[Difference]:
    keys: list[tuple[str, int]] = []
    for rep in reports:
        for p in rep.phases:
            if (p.name, p.step) not in keys:
                keys.append((p.name, p.step))
    rows = []
    for name, step in keys:
        vals: list[int | None] = []
        for rep in reports:
            try:
                vals.append(getattr(rep.phase(name, step), what))
            except KeyError:
                vals.append(None)
        if any(v is not None for v in vals):
            rows.append(Difference(kind, f"{name}@{step}", tuple(vals)))
    return rows


def compare_reports(named: list[tuple[str, MemoryReport]], reference: str | None = None,
                    device: str = "") -> Comparison:
    """Side-by-side rows of already computed reports ``[(source name, report), ...]``."""
    if not named:
        raise TrainmemError("nothing to compare")
    sources = [n for n, _ in named]
    reports = [r for _, r in named]
    if reference is None:
        reference = sources[-1]
    if reference not in sources:
        raise TrainmemError(f"--reference {reference}: not among the compared sources ({', '.join(sources)})")
    rows = compare(reports)
    rows += _phase_rows(reports, "peak", "phase_peak")
    reserved = _phase_rows(reports, "reserved", "phase_reserved")
    rows += [d for d in reserved if sum(v is not None for v in d.values) >= 1 and any(d.values)]
    notes = []
    if "measure" in sources and any(s in sources for s in ("estimate", "trace")):
        notes.append("measure names parameters, buffers, gradients, optimizer states and the batch exactly; the "
                     "rest of its peak is one 'activations' amount, which trace splits into activations, logits "
                     "and temporaries: compare that amount with their sum")
    if device == "cpu" and "estimate" in sources:
        notes.append("estimate models a CUDA GPU (cuBLAS workspaces, CUDA kernels' saved tensors): against a CPU "
                     "trace or measurement it differs by design")
    return Comparison(sources, reports, rows, reference, device, notes)


def compare_sources(model: Any, *, trace: bool = False, measure: bool = False, device: str = "cuda",
                    steps: int = 2, method: str = "trainmem", reference: str | None = None,
                    overrides: Any = None, gpu: Any = None, gpu_memory: Any = None, context_memory: Any = None,
                    max_fraction: float | None = None, **options: Any) -> Comparison:
    """Estimate (always), trace and measure (when asked) one setup and put them side by side."""
    from ..estimate.api import estimate
    if overrides is None:
        overrides = options.pop("set", None)
    named: list[tuple[str, MemoryReport]] = []
    named.append(("estimate", estimate(model, method=method, set=overrides, gpu=gpu, gpu_memory=gpu_memory,
                                       context_memory=context_memory, max_fraction=max_fraction, **options)))
    kind = "cpu" if str(device).startswith("cpu") else "cuda"
    if trace:
        from ..spec.hardware import get_gpu
        from ..trace.api import trace as run_trace
        hw = get_gpu(gpu, gpu_memory, context_memory) if (gpu is not None or gpu_memory is not None) else None
        topts = {k: v for k, v in options.items() if k != "optimizer_bucket_mb"}
        named.append(("trace", run_trace(model, steps=steps, device=kind, hardware=hw, overrides=overrides or None,
                                         **topts)))
    if measure:
        from .runner import measure as run_measure
        named.append(("measure", run_measure(model, steps, device=device, overrides=overrides or None, gpu=gpu,
                                             gpu_memory=gpu_memory, context_memory=context_memory,
                                             max_fraction=max_fraction, **options)))
    return compare_reports(named, reference, kind)


def _unit(c: Comparison, units: str, exact: bool) -> tuple[int, str]:
    if exact:
        return 1, "B"
    big = max([abs(v) for d in c.rows for v in d.values if v is not None] or [0])
    if units == "GB":
        return (10**9, "GB") if big >= 10**9 else (10**6, "MB")
    return (2**30, "GiB") if big >= 2**30 else (2**20, "MiB")


def render_comparison(c: Comparison, units: str = "GiB", exact: bool = False) -> str:
    """One table per kind (totals, categories, phase allocated / peak / reserved), with the
    difference of each source against the reference, absolute and relative."""
    div, label = _unit(c, units, exact)
    r = c.ref_index
    others = [i for i in range(len(c.sources)) if i != r]
    width = 16 if exact else 12
    m = c.reports[0].model
    t = c.reports[0].training
    head = f"trainmem compare — {getattr(m, 'name', '')}"
    if t is not None:
        head += (f" · {t.precision} · micro-batch {t.batch_size} × seq {t.seq_len} · {t.optimizer} · "
                 f"attention {t.attention}")
    lines = [head, f"sources: {' | '.join(c.sources)} · device {c.device or '-'} · differences against "
                   f"{c.reference} (Δ = source − {c.reference}) · values in {label}", ""]

    def num(v: int | None) -> str:
        if v is None:
            return "-"
        return f"{v:,d}" if exact else f"{v / div:,.3f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.3f}%"

    cols = "".join(f" {s:>{width}s}" for s in c.sources)
    cols += "".join(f" {'Δ ' + c.sources[i]:>{width}s} {'Δ% ' + c.sources[i]:>11s}" for i in others)
    titles = {"total": "totals", "category": "by category at the peak",
              "phase": "phases: allocated at the end", "phase_peak": "phases: peak within",
              "phase_reserved": "phases: reserved at the end"}
    for kind, title in titles.items():
        rows = [d for d in c.rows if d.kind == kind]
        if kind == "total":
            rows = [d for d in rows if any(v is not None for v in d.values)]
        if not rows:
            continue
        lines.append(f"{title:28s}{cols}")
        for d in rows:
            row = f"{d.name[:28]:28s}" + "".join(f" {num(v):>{width}s}" for v in d.values)
            row += "".join(f" {num(d.diff(i, r)):>{width}s} {pct(d.rel(i, r)):>11s}" for i in others)
            lines.append(row)
        lines.append("")
    for i in others:
        w = c.worst_phase_rel(c.sources[i])
        if w is not None:
            lines.append(f"{c.sources[i]} vs {c.reference}: largest phase difference {100 * w:.3f}%")
    for n in c.notes:
        lines.append(f"note: {n}")
    for s, rep in zip(c.sources, c.reports):
        for w in rep.warnings:
            lines.append(f"warning ({s}): {w}")
    return "\n".join(lines).rstrip()
