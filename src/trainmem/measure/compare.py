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
from ..render.measure import render_comparison  # noqa: F401  (re-exported: trainmem.measure.render_comparison)
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
    """Estimate (always), trace and measure (when asked) one setup and put them side by side: the
    inputs are resolved once (``spec.resolve``) and the same ``Resolved`` goes to each source."""
    from ..estimate.api import estimate
    from ..spec.resolve import resolve
    if overrides is None:
        overrides = options.pop("set", None)
    r = resolve(model, method=method, set=overrides, gpu=gpu, gpu_memory=gpu_memory, context_memory=context_memory,
                max_fraction=max_fraction, **options)
    named: list[tuple[str, MemoryReport]] = [("estimate", estimate(r))]
    kind = "cpu" if str(device).startswith("cpu") else "cuda"
    if trace:
        from ..trace.api import trace as run_trace
        named.append(("trace", run_trace(r, steps=steps, device=kind)))
    if measure:
        from .runner import measure as run_measure
        named.append(("measure", run_measure(r, steps, device=device)))
    return compare_reports(named, reference, kind)
