"""Small helpers shared by the formula methods."""
from __future__ import annotations

from typing import Iterable

from ..report import Component, MemoryReport, Phase


def simple_report(method: str, model, training, components: Iterable[Component],
                  peak_allocated: int | None = None, phases: Iterable[Phase] | None = None,
                  peak_phase: str = "backward_peak", peak_where: str = "",
                  warnings: Iterable[str] = ()) -> MemoryReport:
    """A MemoryReport for a method that only knows its components and (optionally) a peak.

    Without ``peak_allocated`` the peak is the sum of all components. Without ``phases`` a
    single phase ``peak_phase`` of step 1 carries that peak.
    """
    comps = list(components)
    peak = sum(c.bytes for c in comps) if peak_allocated is None else int(peak_allocated)
    ph = list(phases) if phases is not None else [Phase(peak_phase, 1, peak, peak)]
    return MemoryReport(source="estimate", method=method, components=comps, phases=ph,
                        peak_allocated=peak, peak_phase=peak_phase, peak_where=peak_where,
                        model=model, training=training, warnings=list(warnings))
