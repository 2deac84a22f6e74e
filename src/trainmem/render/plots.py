"""Plots of a sweep (matplotlib, Agg backend: no display needed): a fits/does-not-fit heatmap over
micro-batch x sequence length, and stacked bars of the memory by component category with the GPU's
limit as a dashed line (after Moritz Scherrmann's BERT-large notebook,
https://moritzscherrmann.com/blog/2024/GPU-Memory_BERT/). PNG or SVG, chosen by the file extension.

Every function returns the data it drew (values in the plot's unit), so tests and scripts can
check the picture without reading pixels.
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import TrainmemError
from ..report import CATEGORIES
from ..units import scale

FORMATS = (".png", ".svg")
MAX_PANELS = 6
OTHER = "other"
FIT_COLOUR, NOFIT_COLOUR, NA_COLOUR = "#a8e6a1", "#f4a6a6", "#dddddd"
CATEGORY_LABELS = {
    "parameters": "parameters", "master_weights": "master weights", "gradients": "gradients",
    "optimizer_states": "optimizer states", "activations": "activations", "logits": "logits & loss",
    "inputs": "inputs", "buffers": "buffers", "workspace": "cuBLAS workspace", "temporaries": "temporaries",
    "communication": "communication buffers", "cuda_context": "CUDA context & other processes",
    "allocator_overhead": "allocator cache", OTHER: "other (peak not itemised by the method)",
}


def _figure(width: float, height: float):
    try:
        from matplotlib.figure import Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise TrainmemError("plots need matplotlib: pip install 'trainmem[plot]'") from None
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def check_path(path: str) -> str:
    """The extension of a plot file name (.png or .svg); TrainmemError for any other."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in FORMATS:
        raise TrainmemError(f"cannot write a plot to {path!r}: name it .png or .svg")
    return ext


def _save(fig, path: str) -> None:
    ext = check_path(path)
    fig.tight_layout()
    try:
        fig.savefig(path, format=ext[1:])
    except OSError as e:
        raise TrainmemError(f"cannot write {path!r}: {e.strerror or e}") from None


def _colours() -> dict[str, Any]:
    from matplotlib import colormaps
    cmap = colormaps["tab20"]
    return {c: cmap(i % 20) for i, c in enumerate(CATEGORIES)}


def _title(sweep, what: str) -> str:
    import textwrap
    on = f" on {sweep.gpu}" if sweep.gpu else ""
    return "\n".join(textwrap.wrap(f"{sweep.model}{on}: {what} (method {sweep.method})", 64))


def plot_heatmap(sweep, path: str, units: str = "GiB", title: str | None = None) -> dict[str, Any]:
    """Cells coloured by fit (green) or not (red) over micro-batch (rows) x sequence length
    (columns), each with its device memory printed. Returns {kind, path, units, batch_sizes,
    seq_lens, values (rows of floats or None), fits (rows of bools or None), limit}."""
    check_path(path)
    div, label = scale(units)
    rows, cols = len(sweep.batch_sizes), len(sweep.seq_lens)
    values = [[None if v is None else v / div for v in row] for row in sweep.grid()]
    fits = sweep.fits_grid()
    limit = None if sweep.limit is None else sweep.limit / div
    fig = _figure(min(2.0 + 0.8 * cols, 40), min(1.8 + 0.55 * rows, 30))
    ax = fig.add_subplot(1, 1, 1)
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    size = 9 if cols <= 12 else (7 if cols <= 24 else 5)
    # one mesh for the cells (0 n/a, 1 does not fit, 2 fits); the smallest micro-batch on top, as in Scherrmann's notebook
    codes = [[0 if values[i][j] is None else (2 if fits[i][j] in (True, None) else 1) for j in range(cols)]
             for i in reversed(range(rows))]
    ax.pcolormesh(range(cols + 1), range(rows + 1), codes, cmap=ListedColormap([NA_COLOUR, NOFIT_COLOUR, FIT_COLOUR]),
                  vmin=0, vmax=2, edgecolors="black", linewidth=0.5)
    for i in range(rows):
        y = rows - 1 - i
        for j in range(cols):
            v = values[i][j]
            ax.text(j + 0.5, y + 0.5, "n/a" if v is None else f"{v:.1f}", ha="center", va="center", fontsize=size)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_xticks([j + 0.5 for j in range(cols)])
    ax.set_xticklabels([str(s) for s in sweep.seq_lens], rotation=90 if cols > 12 else 0, fontsize=size + 1)
    ax.set_yticks([i + 0.5 for i in range(rows)])
    ax.set_yticklabels([str(b) for b in reversed(sweep.batch_sizes)])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("micro-batch size")
    lim = f"limit {limit:.2f} {label}" if limit is not None else "no GPU given"
    ax.set_title(title or _title(sweep, f"device memory per GPU in {label} ({lim})"), fontsize=10)
    handles = [Patch(facecolor=FIT_COLOUR, edgecolor="black", label="fits"),
               Patch(facecolor=NOFIT_COLOUR, edgecolor="black", label="does not fit")]
    if any(v is None for row in values for v in row):
        handles.append(Patch(facecolor=NA_COLOUR, edgecolor="black", label="n/a (invalid setup)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    _save(fig, path)
    return {"kind": "heatmap", "path": str(path), "units": label, "batch_sizes": list(sweep.batch_sizes),
            "seq_lens": list(sweep.seq_lens), "values": values, "fits": fits, "limit": limit}


def plot_stacked(sweep, path: str, over: str | None = None, units: str = "GiB", title: str | None = None
                 ) -> dict[str, Any]:
    """Stacked bars of each cell's memory by component category, over micro-batch size or sequence
    length (``over``: "batch" or "seq"; default the longer axis), one panel per value of the other
    axis (at most 6), the GPU's limit as a dashed line. Returns {kind, path, units, over, x,
    categories, panels: [{fixed, values: {category: [floats]}, totals}], limit}."""
    check_path(path)
    if over is None:
        over = "seq" if len(sweep.seq_lens) > len(sweep.batch_sizes) else "batch"
    if over not in ("batch", "seq"):
        raise TrainmemError(f"stacked bars go over 'batch' or 'seq', not {over!r}")
    div, label = scale(units)
    xs = sweep.batch_sizes if over == "batch" else sweep.seq_lens
    fixed_vals = sweep.seq_lens if over == "batch" else sweep.batch_sizes
    if len(fixed_vals) > MAX_PANELS:
        other = "sequence lengths" if over == "batch" else "micro-batch sizes"
        raise TrainmemError(f"stacked bars draw one panel per value of the other axis: give at most {MAX_PANELS} "
                            f"{other} (got {len(fixed_vals)}), or use a heatmap")
    cats = sweep.categories()
    colours = _colours()
    limit = None if sweep.limit is None else sweep.limit / div
    panels = []
    n = len(fixed_vals)
    fig = _figure(min(3.0 + 0.35 * len(xs), 30), 3.6 * n + 0.8)
    for k, fv in enumerate(fixed_vals):
        ax = fig.add_subplot(n, 1, k + 1)
        cells = [sweep.cell(x, fv) if over == "batch" else sweep.cell(fv, x) for x in xs]
        vals = {c: [cell.categories().get(c, 0) / div for cell in cells] for c in cats}
        totals = [None if cell.report is None else cell.device_used / div for cell in cells]
        # a method whose components describe another moment than its peak (bert-notebook when the
        # optimizer step peaks) leaves part of the device memory unitemised: shown as "other"
        other = [max(0.0, t - sum(vals[c][j] for c in cats)) if t is not None else 0.0
                 for j, t in enumerate(totals)]
        if any(o > 1e-9 * max(1.0, t or 0) for o, t in zip(other, totals)):
            vals[OTHER] = other
        pos = list(range(len(xs)))
        bottom = [0.0] * len(xs)
        for c in cats + ([OTHER] if OTHER in vals else []):
            ax.bar(pos, vals[c], bottom=bottom, color=colours.get(c, "#bbbbbb"), label=CATEGORY_LABELS.get(c, c),
                   width=0.8, hatch="//" if c == OTHER else None)
            bottom = [b + v for b, v in zip(bottom, vals[c])]
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", linewidth=1.2,
                       label=f"GPU limit {limit:.2f} {label}" + (f" ({sweep.gpu})" if sweep.gpu else ""))
        ax.set_xticks(pos)
        ax.set_xticklabels([str(x) for x in xs], rotation=90 if len(xs) > 16 else 0, fontsize=8)
        ax.set_xlabel("micro-batch size" if over == "batch" else "sequence length (tokens)")
        ax.set_ylabel(f"memory per GPU ({label})")
        fixed_name = f"sequence length {fv}" if over == "batch" else f"micro-batch {fv}"
        ax.set_title(title or _title(sweep, f"memory by component, {fixed_name}"), fontsize=10)
        if k == 0:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        panels.append({"fixed": fv, "values": vals, "totals": totals})
    _save(fig, path)
    return {"kind": "stacked", "path": str(path), "units": label, "over": over, "x": list(xs),
            "categories": cats + ([OTHER] if any(OTHER in p["values"] for p in panels) else []),
            "panels": panels, "limit": limit}


def plot_sweep(sweep, path: str, kind: str | None = None, over: str | None = None, units: str = "GiB"
               ) -> dict[str, Any]:
    """Draw ``sweep`` to ``path``: ``kind`` "heatmap" or "stacked"; without it, a file name that
    says heatmap or stacked/bars decides, else a 2-D grid gets a heatmap and a 1-D one bars."""
    if kind is None:
        stem = os.path.basename(str(path)).lower()
        if "heat" in stem:
            kind = "heatmap"
        elif "stack" in stem or "bar" in stem:
            kind = "stacked"
        else:
            kind = "heatmap" if len(sweep.batch_sizes) > 1 and len(sweep.seq_lens) > 1 else "stacked"
    if kind == "heatmap":
        return plot_heatmap(sweep, path, units)
    if kind in ("stacked", "bars"):
        return plot_stacked(sweep, path, over, units)
    raise TrainmemError(f"plot kind {kind!r} is not one of: heatmap, stacked")


def plot_timeline(report, path: str, units: str = "GiB", title: str | None = None) -> dict[str, Any]:
    """Allocated memory over the traced step, stacked by category, reserved as a line, phases marked.

    Uses ``report.extra["timeline"]`` ([event, allocated, reserved, {category: bytes}]) and
    ``report.extra["phase_events"]`` from ``trainmem.trace``. Returns the data drawn."""
    check_path(path)
    tl = report.extra.get("timeline") or []
    if not tl:
        raise TrainmemError("this report has no timeline: --timeline needs `trainmem trace`")
    div, label = scale(units)
    events = [row[0] for row in tl]
    cats = [c for c in CATEGORIES if any(c in row[3] for row in tl)]
    series = {c: [row[3].get(c, 0) / div for row in tl] for c in cats}
    reserved = [None if row[2] is None else row[2] / div for row in tl]
    fig = _figure(11, 5)
    ax = fig.add_subplot(1, 1, 1)
    colours = _colours()
    ax.stackplot(events, [series[c] for c in cats], labels=[CATEGORY_LABELS.get(c, c) for c in cats],
                 colors=[colours[c] for c in cats], alpha=0.85)
    if any(r is not None for r in reserved):
        ax.plot(events, [r if r is not None else float("nan") for r in reserved], color="black",
                linewidth=1.2, label="reserved")
    phases = report.extra.get("phase_events") or []
    top = max(max(row[1] for row in tl), max((r or 0) for r in [row[2] for row in tl])) / div
    for name, step, start, _end in phases:
        ax.axvline(start, color="grey", linestyle=":", linewidth=0.8)
        ax.text(start, top * 1.02, f"{name.split('.')[0]} {step}", rotation=90, fontsize=7, va="bottom",
                clip_on=False)
    ax.set_xlabel("allocation event")
    ax.set_ylabel(f"memory ({label})")
    m = getattr(report.model, "name", "model")
    ax.set_title(title or f"{m}: allocated memory over the step by category (trace)", pad=48)
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    _save(fig, path)
    return {"events": events, "series": series, "reserved": reserved, "phases": phases}
