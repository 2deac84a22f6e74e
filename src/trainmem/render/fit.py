"""A fit result (``trainmem.plan.fit``) as text: what fits and the margin left, or what would make
it fit."""
from __future__ import annotations

from typing import Any

from ..units import fmt, pick_unit
from .suggestions import format_suggestions
from .text import wrap

_WORD = {"batch_size": "micro-batch", "seq_len": "sequence length"}


def render_fit(r: Any, units: str = "GiB", detail: bool = False) -> str:
    """The text `trainmem fit` prints for a :class:`trainmem.plan.FitResult` (``detail``: every
    suggestion, not only those that make it fit); each line wrapped to the terminal's width
    (``render.text.width``), continuation lines indented."""
    u = pick_unit(units, r.capacity)  # one unit for the whole answer, from the GPU's size
    what = "largest micro-batch" if r.search == "batch_size" else f"longest sequence (multiple of {r.step})"
    fixed = f"sequence {r.seq_len}" if r.search == "batch_size" else f"micro-batch {r.batch_size}"
    lines = [f"trainmem fit — {r.model} on {r.gpu} ({fmt(r.capacity, u)}"
             + ("" if r.limit == r.capacity else f", limit {fmt(r.limit, u)}") + f") · method {r.method}"]
    value = r.batch_size if r.search == "batch_size" else r.seq_len
    if r.fits:
        lines.append(f"{what} at {fixed}: {value}")
        lines.append(f"  device memory {fmt(r.device_used, u)} (peak allocated {fmt(r.peak_allocated, u)}), "
                     f"margin {fmt(r.margin, u)}")
        if r.next_value is not None:
            lines.append(f"  {_WORD[r.search]} {r.next_value} would need {fmt(r.next_device_used, u)} "
                         f"({fmt(r.next_device_used - r.limit, u)} over)")
        else:
            why = "the model's learned positions" if r.limited_by == "max_positions" else "the search cap"
            lines.append(f"  stopped by {why}, not by memory")
    else:
        first = 1 if r.search == "batch_size" else r.step
        lines.append(f"NOTHING FITS: {_WORD[r.search]} {first} at {fixed} needs {fmt(r.device_used, u)} "
                     f"({fmt(-r.margin, u)} over)")
    text = [x for ln in lines for x in wrap(ln, indent="    ")]
    if not r.fits:  # a table of its own, each line already fitted (render.suggestions)
        text.append(format_suggestions(r.suggestions, u, detail=detail))
    return "\n".join(text + [f"  ({r.evaluations} estimates)"])
