"""What a traced report adds to the common table: the largest live tensors at the peak, and the
ranks of a data-parallel trace."""
from __future__ import annotations

from typing import Any

from ..units import fmt, number, scale
from .text import free_width, shorten, width, wrap


def largest_tensors(rows: list[dict[str, Any]], units: str = "auto", top: int = 10, detail: bool = False) -> str:
    """The ``top`` largest live tensors at the peak (a trace report's ``extra["largest_tensors"]``);
    empty when there are none. One unit for the table (``auto``: from the largest tensor); each
    column as wide as its widest cell; without ``detail`` the module column is shortened (its
    tail kept), then the op column (its head kept), so that every line fits the terminal
    (:func:`render.text.width`)."""
    if not rows:
        return ""
    rows = rows[:top]
    div, label = scale(units, max(row["block"] for row in rows))
    cells = [(number(row["block"], div, 3), row["category"], row["dtype"], "x".join(str(x) for x in row["shape"]),
              row.get("module") or "-", row.get("op") or "") for row in rows]
    heads = ("size", "category", "dtype", "shape", "module", "op")
    w = [max([len(heads[i])] + [len(c[i]) for c in cells]) for i in range(6)]
    prefix = 2 + w[0] + 2 + w[1] + 1 + w[2] + 1 + w[3] + 1
    room = width() - prefix - 1  # the module and op columns together
    wm = w[4] if detail else _module_width(room, w[4], w[5])
    lines = [f"largest live tensors at the peak ({label})",
             f"  {label:>{w[0]}s}  {'category':{w[1]}s} {'dtype':{w[2]}s} {'shape':{w[3]}s} {'module':{wm}s} op"]
    for size, cat, dtype, shape, module, op in cells:
        op = op if detail else shorten(op, max(1, room - wm), keep="start")
        lines.append(f"  {size:>{w[0]}s}  {cat:{w[1]}s} {dtype:{w[2]}s} {shape:{w[3]}s} "
                     f"{shorten(module, wm) if not detail else module:{wm}s} {op}".rstrip())
    return "\n".join(lines)


def _module_width(room: int, module: int, op: int) -> int:
    """The module column's width when ``room`` columns hold it and the op column (widest cells
    ``module`` and ``op``): it yields to the op down to 16 columns, then, on a narrow terminal, the
    op keeps 8 and the module shrinks down to 8."""
    wm = free_width(op, module, minimum=min(module, 16), width=room)
    if room - wm < min(op, 8):
        wm = max(min(module, 8), room - min(op, 8))
    return wm


def rank_lines(extra: dict[str, Any], units: str = "auto") -> list[str]:
    """The ranks of a data-parallel trace (``extra["ranks"]``, ``trace.distributed.rank_entries``):
    the traced ranks' peaks (a pipeline's first and last stages), then one line for the ranks that were
    not traced and why."""
    ranks = extra.get("ranks") or []
    if not ranks:
        return []
    traced = [s for s in ranks if s.get("traced")]
    lines = ["", f"ranks: {len(ranks)} ({extra.get('wrapper') or 'torch.distributed'}, fake process group); "
                 f"the tables above are rank {extra.get('rank', 0)}"]
    for s in traced:
        parts = [f"peak allocated {fmt(s['peak_allocated'], units)}"]
        if s.get("peak_reserved") is not None:
            parts.append(f"reserved {fmt(s['peak_reserved'], units)}")
        parts.append(f"parameters {fmt(s.get('parameters_bytes'), units)}")
        if s.get("peak_phase"):
            parts.append(f"at {s['peak_phase']}")
        lines += wrap(f"* rank {s['rank']:>3d}: traced, " + ", ".join(parts), indent=" " * 12)
    groups: dict[str | None, list[int]] = {}  # the ranks not traced, by reason (pipeline: middle stages, TP ranks)
    for s in ranks:
        if not s.get("traced"):
            groups.setdefault(s.get("not_traced"), []).append(s["rank"])
    src = traced[0]["rank"] if traced else 0
    for why, rest in groups.items():
        lines += wrap(f"  ranks {_span(rest)}: not traced, {why}" if why else
                      f"  ranks {_span(rest)}: not traced, the same program on shards no larger than rank 0's "
                      f"(in --json, copies of rank {src} marked traced: false)", indent=" " * 10)
    return lines


def _span(ranks: list[int]) -> str:
    """Sorted ranks as runs: ``1-7, 9-15``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
