"""`trainmem plan` as text (``trainmem.plan.planner.PlanResult``): the setup and the step-time
model, the ranked layouts, why the best beat the next, and with ``explain`` why the rest were
rejected. Every line fits the terminal (``render.text.width``): free text wraps, continuation lines
indented; the layout table keeps its fixed columns where they fit (98 columns) and on a narrower
terminal packs its columns to their widest cell (the unit moved to the heading), leaving out the
last derived columns (MFU, then tokens/s per GPU: both follow from the step time) that still do not
fit, and saying so."""
from __future__ import annotations

from typing import Any

from ..units import fmt, scale
from .text import fit_columns, width, wrap

#: the layout table's columns: heading, then the cell of a layout ``x`` (``div``: bytes per unit)
_COLUMNS = (("rank", None), ("dp", lambda x, div: f"{x.dp:d}"), ("tp", lambda x, div: f"{x.tp:d}"),
            ("pp", lambda x, div: f"{x.pp:d}"), ("cp", lambda x, div: f"{x.cp:d}"),
            ("zero", lambda x, div: f"{x.zero:d}"), ("recompute", lambda x, div: x.recompute),
            ("micro", lambda x, div: f"{x.micro_batch:d}"), ("accum", lambda x, div: f"{x.grad_accum:d}"),
            ("{label}/GPU", lambda x, div: f"{x.device_used / div:.2f}"),
            ("margin", lambda x, div: f"{x.margin / div:.2f}"), ("step s", lambda x, div: f"{x.step_time:.3f}"),
            ("tok/s/GPU", lambda x, div: f"{x.tokens_per_s_per_gpu:.0f}"), ("MFU", lambda x, div: f"{100 * x.mfu:.0f}%"))
_OPTIONAL = 2  # the last columns that a narrow terminal may leave out (MFU, tok/s/GPU)

_HEAD = (f"{'rank':>4s} {'dp':>4s} {'tp':>3s} {'pp':>3s} {'cp':>3s} {'zero':>4s} {'recompute':>9s} "
         f"{'micro':>5s} {'accum':>5s} {'memory/GPU':>12s} {'margin':>11s} {'step s':>9s} {'tok/s/GPU':>10s} "
         f"{'MFU':>5s}")  # the fixed columns: 98 wide


def _fixed_row(i: Any, x: Any, div: int, label: str) -> str:
    """A layout in the fixed columns of :data:`_HEAD` (the unit in each amount's cell)."""
    return (f"{str(i):>4s} {x.dp:>4d} {x.tp:>3d} {x.pp:>3d} {x.cp:>3d} {x.zero:>4d} {x.recompute:>9s} "
            f"{x.micro_batch:>5d} {x.grad_accum:>5d} {x.device_used / div:>8.2f} {label} "
            f"{x.margin / div:>7.2f} {label} {x.step_time:>9.3f} {x.tokens_per_s_per_gpu:>10.0f} "
            f"{100 * x.mfu:>4.0f}%")


def layout_table(rows: list[tuple[Any, Any]], div: int, label: str) -> list[str]:
    """The table of ``rows`` (rank shown, layout): the fixed columns of :data:`_HEAD` where the
    terminal is wide enough, else :func:`_packed_table`."""
    if len(_HEAD) <= width():
        return [_HEAD] + [_fixed_row(i, x, div, label) for i, x in rows]
    return _packed_table(rows, div, label, width())


def _packed_table(rows: list[tuple[Any, Any]], div: int, label: str, w: int) -> list[str]:
    """The layout table with each column as wide as its widest cell (numbers right-aligned, the
    amounts' unit in their heading: ``render.text.fit_columns``); the optional last columns that do
    not fit ``w`` are left out and named in a last line."""
    heads = [h.format(label=label) for h, _ in _COLUMNS]
    cells = [[str(i)] + [f(x, div) for _, f in _COLUMNS[1:]] for i, x in rows]
    n = len(heads)
    return fit_columns(heads, cells, w, left=0, optional=range(n - 1, n - 1 - _OPTIONAL, -1))


def _head_lines(r: Any, units: str) -> list[str]:
    """The setup, the layout counts and the step-time model's assumptions."""
    a = r.assumptions
    return [f"trainmem plan — {r.model} on {r.gpus} x {r.gpu} ({fmt(r.capacity, units)}"
            + ("" if r.limit == r.capacity else f", limit {fmt(r.limit, units)}")
            + f") · seq {r.seq_len} · global batch {r.global_batch} sequences · method {r.method}",
            f"layouts: {r.considered:,} considered, {r.valid:,} valid, {r.fitting:,} fit"
            + (f"; {r.shapes_rejected:,} parallel shapes not allowed" if r.shapes_rejected else "")
            + f" ({r.elapsed_s * 1000:.0f} ms{'' if r.vectorised else ', estimated one by one'})",
            f"step-time model: MFU {a['mfu']:g} of {a['bf16_tflops']:g} TFLOP/s, "
            f"NVLink {a['interconnect_gbs']:g} GB/s within {a['gpus_per_node']} GPUs, "
            f"network {a['internode_gbs']:g} GB/s per GPU, DP traffic overlapped (docs/plan.md)", ""]


def _nothing_fits(r: Any, units: str) -> list[str]:
    """No layout fits: the smallest cluster that would, and the closest shape on this one."""
    lines = [f"NOTHING FITS: none of the {r.valid:,} valid layouts fits {r.gpus} x {r.gpu}."]
    if r.smallest_cluster:
        x = r.smallest_layout
        lines.append(f"smallest cluster that fits: {r.smallest_cluster:,} x {r.gpu} — e.g. {x.label()}, "
                     f"{fmt(x.device_used, units)} per GPU ({r.cluster_note})")
    elif r.cluster_note:
        lines.append(r.cluster_note)
    closest = sorted(r.shapes, key=lambda s: s["min_device_used"])
    if closest:
        s = closest[0]
        lines.append(f"closest on {r.gpus} GPU{'s' if r.gpus != 1 else ''}: "
                     f"dp={s['dp']} tp={s['tp']} pp={s['pp']} cp={s['cp']} "
                     f"zero={s['min_at']['zero']} recompute={s['min_at']['recompute']} "
                     f"micro-batch={s['min_at']['micro_batch']}: {fmt(s['min_device_used'], units)}, "
                     f"{fmt(s['min_device_used'] - r.limit, units)} over")
    return lines


def _explain(r: Any, units: str) -> list[str]:
    """Why the other layouts were rejected: shapes not allowed, memory, slower; then per shape."""
    lines = ["", "why the other layouts were rejected:"]
    for what, reason, n, unit in r.rejected:
        lines.append(f"  not allowed   {what}: {reason} ({n:,} {unit if n != 1 else unit[:-1]})")
    over = r.valid - r.fitting
    if over:
        lines.append(f"  memory        {over:,} valid layouts need more than {fmt(r.limit, units)} per GPU")
    slower = r.fitting - len(r.top)
    if slower > 0:
        lines.append(f"  slower        {slower:,} fitting layouts have a longer modelled step than #{len(r.top)}")
    lines += ["", "by parallel shape (dp x tp x pp x cp):"]
    for s in r.shapes[:60]:
        shape = f"dp={s['dp']:<4d} tp={s['tp']:<3d} pp={s['pp']:<3d} cp={s['cp']:<3d}"
        if s["fitting"]:
            lines.append(f"  {shape} {s['fitting']:>4d}/{s['layouts']:<4d} fit; best rank {s['best_rank']:,} "
                         f"({s['best_step_time']:.3f} s/step)")
        else:
            lines.append(f"  {shape}    0/{s['layouts']:<4d} fit; smallest {fmt(s['min_device_used'], units)} "
                         f"(zero={s['min_at']['zero']}, recompute={s['min_at']['recompute']}, micro-batch "
                         f"{s['min_at']['micro_batch']}) is {fmt(s['min_device_used'] - r.limit, units)} over")
    if len(r.shapes) > 60:
        lines.append(f"  ... {len(r.shapes) - 60} more shapes (--json lists them all)")
    return lines


def render_plan(r: Any, units: str = "GiB", explain: bool = False) -> str:
    """The text `trainmem plan` prints for a ``PlanResult``: free-text lines wrapped to the
    terminal (continuation lines indented by four), the layout tables fitted by :func:`layout_table`."""
    div, label = scale(units)
    text = [x for ln in _head_lines(r, units) for x in wrap(ln, indent="    ")]
    lines: list[str] = []
    if r.top:
        if not r.rows:
            text += layout_table(list(enumerate(r.top, 1)), div, label)
        if len(r.top) > 1:
            lines += ["", "why the best beat the next:"]
            lines += [f"  #{i} vs #{i + 1}: {x.why}" for i, x in enumerate(r.top[:-1], 1)]
    else:
        lines += _nothing_fits(r, units)
    text += [x for ln in lines for x in wrap(ln, indent="    ")]
    if r.rows:
        text += [""] + wrap("all valid layouts (fitting ones by rank, then the rest by memory; - = does not fit):")
        ranks = iter(range(1, len(r.rows) + 1))
        text += layout_table([(next(ranks) if x.fits else "-", x) for x in r.rows], div, label)
    if explain:
        text += [x for ln in _explain(r, units) for x in wrap(ln, indent="    ")]
    return "\n".join(text)
