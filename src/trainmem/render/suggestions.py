"""Suggestions (``trainmem.plan.suggest``) as plain text: what makes a setup fit, cheapest first; the
free-text lines (costs, notes, a combination's parts) wrap to the terminal's width and the change
column is shortened to it (``render.text.width``)."""
from __future__ import annotations

from typing import Any, Sequence

from ..units import fmt, pick_unit
from .text import shorten, width, wrap


_FIXED = 2 + 2 + 1 + 11 + 1 + 11 + 1 + 11 + 1 + 4  # a row but its change column: number, amounts, fits


def _change_width() -> int:
    """The change column: 48 wide, narrower where the terminal is (never below 16)."""
    return max(16, min(48, width() - _FIXED))


def _row(i: Any, s: Any, units: str) -> list[str]:
    """A suggestion as a table row (peak allocated, device memory, margin, fits) and its cost line;
    the change shortened to the change column (its head kept), the cost and note wrapped."""
    used = s.device_used if s.device_used is not None else s.peak_allocated
    margin = "-" if s.margin is None else fmt(s.margin, units)
    fits = "-" if s.fits is None else ("yes" if s.fits else "no")
    sem = " [changes training]" if s.changes_semantics else ""
    cw = _change_width()
    lines = [f"{str(i):>2s}  {shorten(s.title, cw, keep='start'):{cw}s} {fmt(s.peak_allocated, units):>11s} "
             f"{fmt(used, units):>11s} {margin:>11s} {fits:>4s}"] + wrap(f"{'':4s}cost: {s.cost}{sem}")
    if s.note:
        lines += wrap(f"{'':4s}{s.note}")
    return lines


def _head() -> str:
    cw = _change_width()
    return f"{'#':>2s}  {'change':{cw}s} {'peak alloc':>11s} {'device':>11s} {'margin':>11s} {'fits':>4s}"


def _combined(c: Any, units: str, alone: bool) -> list[str]:
    """The ``combined`` suggestion: its parts, one per line, and what they lead to together."""
    if not c.fits:
        head = "no single change makes it fit, and even these together do not:"
    else:
        head = ("no single change makes it fit; these together do:" if not alone else
                "cheapest: these changes together fit:")
    lines = [head]
    for p in c.parts:
        lines += wrap(f"  - {p.title}: {p.cost}{' [changes training]' if p.changes_semantics else ''}")
    lines += wrap(f"  => peak allocated {fmt(c.peak_allocated, units)}, device {fmt(c.device_used, units)}, "
                  f"margin {fmt(c.margin, units)}")
    return lines


def format_suggestions(suggestions: Sequence[Any], units: str = "GiB", detail: bool = False) -> str:
    """The text `estimate --gpu` and `fit` print when a setup does not fit.

    Without ``detail``: only the changes that make it fit, the cheapest of each family (e.g. the
    cheapest recompute level that fits), cheapest first; when none fits alone, the ``combined``
    suggestion. With ``detail`` (or without a GPU, when nothing can be judged): every change that
    lowers the memory, with what each leads to.
    """
    singles = [s for s in suggestions if s.name != "combined"]
    combined = next((s for s in suggestions if s.name == "combined"), None)
    # one unit for the list, from the largest amount it shows
    units = pick_unit(units, max([abs(s.device_used or s.peak_allocated or 0) for s in suggestions] or [0]) or None)
    if not singles:
        return "no single change lowers the memory of this setup"
    if detail or all(s.fits is None for s in singles):
        lines = ["every change that lowers the memory, cheapest first (each re-estimated):", _head()]
        for i, s in enumerate(singles, 1):
            lines += _row(i, s, units)
        return "\n".join(lines + ([""] + _combined(combined, units, False) if combined else []))
    shown, families = [], set()
    for s in singles:
        if s.fits and s.family not in families:
            shown.append(s)
            families.add(s.family)
    rest = len(singles) - len(shown)
    more = f"{rest} more change{'s' if rest != 1 else ''} lower the memory" if rest else ""
    if shown:
        lines = _combined(combined, units, True) + [""] if combined else []
        lines += ["single changes that make it fit, cheapest first (each re-estimated):", _head()]
        for i, s in enumerate(shown, 1):
            lines += _row(i, s, units)
        if more:
            lines += wrap(f"({more}: --detail lists them)")
        return "\n".join(lines)
    lines = _combined(combined, units, False) if combined else ["no single change makes it fit"]
    return "\n".join(lines + wrap(f"({more}, none enough alone: --detail lists them)"))
