"""Suggestions (``trainmem.plan.suggest``) as a plain-text table."""
from __future__ import annotations

from typing import Any, Sequence

from ..units import fmt


def format_suggestions(suggestions: Sequence[Any], units: str = "GiB") -> str:
    """A plain-text table of suggestions (what `estimate --gpu` and `fit` print when short)."""
    if not suggestions:
        return "no single change lowers the memory of this setup"
    lines = [f"{'#':>2s}  {'change':52s} {'device':>12s} {'saves':>12s} {'fits':>5s}  cost"]
    for i, s in enumerate(suggestions, 1):
        used = s.device_used if s.device_used is not None else s.peak_allocated
        fits = "-" if s.fits is None else ("yes" if s.fits else "no")
        sem = " [changes training]" if s.changes_semantics else ""
        lines.append(f"{i:>2d}  {s.title[:52]:52s} {fmt(used, units):>12s} {fmt(s.saved, units):>12s} {fits:>5s}  "
                     f"{s.cost}{sem}")
        if s.note:
            lines.append(f"{'':4s}{s.note}")
    return "\n".join(lines)
