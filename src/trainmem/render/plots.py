"""Plots of a sweep (matplotlib, Agg backend: no display needed): a fits/does-not-fit heatmap over
micro-batch x sequence length, and stacked bars of the memory by component category with the GPU's
limit as a dashed line (after Moritz Scherrmann's BERT-large notebook,
https://moritzscherrmann.com/blog/2024/GPU-Memory_BERT/). PNG or SVG, chosen by the file extension.

Every function returns the data it drew (values in the plot's unit) and the matplotlib figure,
so tests and scripts can check the picture without reading pixels. Every plot names the model,
the setup and the unit (a figure title and subtitle wrapped to the figure's width, placed by
matplotlib's constrained layout so nothing is clipped; the memory axis labelled with its unit).
"""
from __future__ import annotations

import os
import textwrap
from typing import Any

from ..errors import TrainmemError
from ..report import CATEGORIES
from ..units import scale
from .table import setup_parts

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


NO_MATPLOTLIB = "plotting needs matplotlib: pip install 'trainmem[plot]'"
LABEL_PAD_PX = 2  # phase labels of the timeline are at least this far apart (pixels)


def require_matplotlib() -> None:
    """TrainmemError with one line saying how to install matplotlib when it cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        raise TrainmemError(NO_MATPLOTLIB) from None


def _figure(width: float, height: float):
    """An Agg figure (no display needed) under matplotlib's constrained layout, which places the
    titles, labels and legends so that none is clipped (matplotlib's "Constrained layout guide")."""
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def check_path(path: str) -> str:
    """The extension of a plot file name (.png or .svg); TrainmemError for any other name, or
    when matplotlib is not installed (checked before any work is done)."""
    ext = os.path.splitext(str(path))[1].lower()
    if ext not in FORMATS:
        raise TrainmemError(f"cannot write a plot to {path!r}: name it .png or .svg")
    require_matplotlib()
    return ext


def _save(fig, path: str) -> None:
    ext = check_path(path)
    try:
        fig.savefig(path, format=ext[1:])
    except OSError as e:
        raise TrainmemError(f"cannot write {path!r}: {e.strerror or e}") from None


def _colours() -> dict[str, Any]:
    from matplotlib import colormaps
    cmap = colormaps["tab20"]
    return {c: cmap(i % 20) for i, c in enumerate(CATEGORIES)}


def _headline(fig, title: str, subtitle: str = "", size: float = 10) -> None:
    """The figure's title and a smaller-print subtitle line, each wrapped to the figure's width
    (about 0.6 em per character), as the figure's suptitle: constrained layout keeps it whole."""
    chars = max(30, int(fig.get_figwidth() * 72 / (size * 0.6)))
    lines = textwrap.wrap(title, chars) + textwrap.wrap(subtitle, int(chars * 1.1))
    fig.suptitle("\n".join(lines), fontsize=size)


def _setup_text(report, vary_shape: bool) -> str:
    """The setup of a report as the table's setup line says it (precision, optimizer, layout, ...),
    without the micro-batch and sequence when the plot varies them."""
    if report is None:
        return ""
    parts = setup_parts(report)[1:]  # the model is in the title
    return " · ".join(p for p in parts if not (vary_shape and p.startswith("micro-batch")))


def _first_report(sweep):
    return next((c.report for row in sweep.cells for c in row if c.report is not None), None)


def _title(sweep, what: str) -> tuple[str, str]:
    """A sweep plot's title (model, GPU, what is drawn) and subtitle (the setup and the method)."""
    on = f" on {sweep.gpu}" if sweep.gpu else ""
    setup = _setup_text(_first_report(sweep), vary_shape=True)
    return f"{sweep.model}{on}: {what}", (setup + " · " if setup else "") + f"method {sweep.method}"


def _largest(sweep) -> int | None:
    return max([c.device_used or 0 for row in sweep.cells for c in row] + [sweep.limit or 0]) or None


def plot_heatmap(sweep, path: str, units: str = "auto", title: str | None = None) -> dict[str, Any]:
    """Cells coloured by fit (green) or not (red) over micro-batch (rows) x sequence length
    (columns), each with its device memory printed. Returns {kind, path, units, batch_sizes,
    seq_lens, values (rows of floats or None), fits (rows of bools or None), limit, figure}."""
    check_path(path)
    div, label = scale(units, _largest(sweep))
    rows, cols = len(sweep.batch_sizes), len(sweep.seq_lens)
    values = [[None if v is None else v / div for v in row] for row in sweep.grid()]
    fits = sweep.fits_grid()
    limit = None if sweep.limit is None else sweep.limit / div
    fig = _figure(min(4.5 + 0.8 * cols, 40), min(2.6 + 0.55 * rows, 30))
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
    head, sub = _title(sweep, f"device memory per GPU in {label} ({lim})")
    _headline(fig, title or head, sub)
    handles = [Patch(facecolor=FIT_COLOUR, edgecolor="black", label="fits"),
               Patch(facecolor=NOFIT_COLOUR, edgecolor="black", label="does not fit")]
    if any(v is None for row in values for v in row):
        handles.append(Patch(facecolor=NA_COLOUR, edgecolor="black", label="n/a (invalid setup)"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    _save(fig, path)
    return {"kind": "heatmap", "path": str(path), "units": label, "batch_sizes": list(sweep.batch_sizes),
            "seq_lens": list(sweep.seq_lens), "values": values, "fits": fits, "limit": limit, "figure": fig}


def _stack_panel(ax, sweep, over: str, xs: list[int], fv: int, div: int, cats: list[str]) -> dict[str, Any]:
    """One panel of stacked bars (the cells at ``fv`` on the other axis); its values and totals."""
    colours = _colours()
    cells = [sweep.cell(x, fv) if over == "batch" else sweep.cell(fv, x) for x in xs]
    vals = {c: [cell.categories().get(c, 0) / div for cell in cells] for c in cats}
    totals = [None if cell.report is None else cell.device_used / div for cell in cells]
    # a method whose components describe another moment than its peak (bert-notebook when the
    # optimizer step peaks) leaves part of the device memory unitemised: shown as "other"
    other = [max(0.0, t - sum(vals[c][j] for c in cats)) if t is not None else 0.0 for j, t in enumerate(totals)]
    if any(o > 1e-9 * max(1.0, t or 0) for o, t in zip(other, totals)):
        vals[OTHER] = other
    pos = list(range(len(xs)))
    bottom = [0.0] * len(xs)
    for c in cats + ([OTHER] if OTHER in vals else []):
        ax.bar(pos, vals[c], bottom=bottom, color=colours.get(c, "#bbbbbb"), label=CATEGORY_LABELS.get(c, c),
               width=0.8, hatch="//" if c == OTHER else None)
        bottom = [b + v for b, v in zip(bottom, vals[c])]
    ax.set_xticks(pos)
    ax.set_xticklabels([str(x) for x in xs], rotation=90 if len(xs) > 16 else 0, fontsize=8)
    ax.set_title(f"sequence length {fv}" if over == "batch" else f"micro-batch {fv}", fontsize=9)
    return {"fixed": fv, "values": vals, "totals": totals}


def plot_stacked(sweep, path: str, over: str | None = None, units: str = "auto", title: str | None = None
                 ) -> dict[str, Any]:
    """Stacked bars of each cell's memory by component category, over micro-batch size or sequence
    length (``over``: "batch" or "seq"; default the longer axis), one panel per value of the other
    axis (at most 6, two columns, one shared memory axis so that panels compare), the GPU's limit
    as a dashed line. Returns {kind, path, units, over, x, categories, panels: [{fixed, values:
    {category: [floats]}, totals}], limit, figure}."""
    check_path(path)
    if over is None:
        over = "seq" if len(sweep.seq_lens) > len(sweep.batch_sizes) else "batch"
    if over not in ("batch", "seq"):
        raise TrainmemError(f"stacked bars go over 'batch' or 'seq', not {over!r}")
    div, label = scale(units, _largest(sweep))
    xs = sweep.batch_sizes if over == "batch" else sweep.seq_lens
    fixed_vals = sweep.seq_lens if over == "batch" else sweep.batch_sizes
    if len(fixed_vals) > MAX_PANELS:
        other = "sequence lengths" if over == "batch" else "micro-batch sizes"
        raise TrainmemError(f"stacked bars draw one panel per value of the other axis: give at most {MAX_PANELS} "
                            f"{other} (got {len(fixed_vals)}), or use a heatmap")
    cats = sweep.categories()
    limit = None if sweep.limit is None else sweep.limit / div
    n = len(fixed_vals)
    ncols = 1 if n == 1 else 2
    nrows = (n + ncols - 1) // ncols
    fig = _figure(ncols * min(2.6 + 0.35 * len(xs), 15) + 2.8, 2.9 * nrows + 1.3)
    axes = fig.subplots(nrows, ncols, sharey=True, squeeze=False)
    panels = []
    for k, fv in enumerate(fixed_vals):
        ax = axes[k // ncols][k % ncols]
        panels.append(_stack_panel(ax, sweep, over, xs, fv, div, cats))
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", linewidth=1.2,
                       label=f"GPU limit {limit:.2f} {label}" + (f" ({sweep.gpu})" if sweep.gpu else ""))
        if k % ncols == 0:
            ax.set_ylabel(f"memory per GPU ({label})")
        if k // ncols == nrows - 1 or k + ncols >= n:
            ax.set_xlabel("micro-batch size" if over == "batch" else "sequence length (tokens)")
    for k in range(n, nrows * ncols):
        fig.delaxes(axes[k // ncols][k % ncols])
    handles, labels = axes[0][0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: (not labels[i].startswith("GPU limit"), -i))  # limit, then top bar down
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside right upper", fontsize=8)
    head, sub = _title(sweep, f"memory by component over the {'micro-batch' if over == 'batch' else 'sequence length'}"
                              f" ({label})")
    _headline(fig, title or head, sub)
    _save(fig, path)
    return {"kind": "stacked", "path": str(path), "units": label, "over": over, "x": list(xs),
            "categories": cats + ([OTHER] if any(OTHER in p["values"] for p in panels) else []),
            "panels": panels, "limit": limit, "figure": fig}


def plot_sweep(sweep, path: str, kind: str | None = None, over: str | None = None, units: str = "auto"
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


def overlapping(boxes: list[Any], pad: float = 0.0) -> list[tuple[int, int]]:
    """The pairs of indices of ``boxes`` (matplotlib ``Bbox``es, e.g. ``text.get_window_extent``)
    that overlap or come closer than ``pad`` pixels."""
    out = []
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            a, b = boxes[i], boxes[j]
            if a.x0 < b.x1 + pad and b.x0 < a.x1 + pad and a.y0 < b.y1 + pad and b.y0 < a.y1 + pad:
                out.append((i, j))
    return out


def _phase_labels(fig, ax, phases: list[Any]) -> list[Any]:
    """Label each phase's start above the axes, each on the lowest row where it overlaps no label
    already placed (measured with the renderer's text extents); returns the text artists. The
    layout is computed first and the labels re-placed if the layout moved them (twice at most)."""
    from matplotlib.transforms import blended_transform_factory
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    texts: list[Any] = []
    for _ in range(3):
        for t in texts:
            t.remove()
        texts = []
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes: list[Any] = []
        for name, step, start, _end in phases:
            for level in range(len(phases) + 1):
                t = ax.annotate(f"{name.split('.')[0]} {step}", xy=(start, 1.0), xycoords=trans,
                                xytext=(1, 3 + 10 * level), textcoords="offset points", fontsize=7,
                                ha="left", va="bottom", annotation_clip=False)
                bb = t.get_window_extent(renderer)
                if not overlapping(boxes + [bb], LABEL_PAD_PX) or level == len(phases):
                    boxes.append(bb)
                    texts.append(t)
                    break
                t.remove()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        if not overlapping([t.get_window_extent(renderer) for t in texts]):
            break
    return texts


def plot_timeline(report, path: str, units: str = "auto", title: str | None = None) -> dict[str, Any]:
    """Allocated memory over the traced step, stacked by category, reserved as a line, phases marked
    (labels placed so that none overlaps another).

    Uses ``report.extra["timeline"]`` ([event, allocated, reserved, {category: bytes}]) and
    ``report.extra["phase_events"]`` from ``trainmem.trace``. Returns the data drawn, the phase
    label artists and the figure."""
    check_path(path)
    tl = report.extra.get("timeline") or []
    if not tl:
        raise TrainmemError("this report has no timeline: --timeline needs `trainmem trace`")
    top_b = max(max(row[1] for row in tl), max((row[2] or 0) for row in tl))
    div, label = scale(units, top_b or None)
    events = [row[0] for row in tl]
    cats = [c for c in CATEGORIES if any(c in row[3] for row in tl)]
    series = {c: [row[3].get(c, 0) / div for row in tl] for c in cats}
    reserved = [None if row[2] is None else row[2] / div for row in tl]
    fig = _figure(11, 5.4)
    ax = fig.add_subplot(1, 1, 1)
    colours = _colours()
    ax.stackplot(events, [series[c] for c in cats], labels=[CATEGORY_LABELS.get(c, c) for c in cats],
                 colors=[colours[c] for c in cats], alpha=0.85)
    if any(r is not None for r in reserved):
        ax.plot(events, [r if r is not None else float("nan") for r in reserved], color="black",
                linewidth=1.2, label="reserved")
    phases = report.extra.get("phase_events") or []
    for _name, _step, start, _end in phases:
        ax.axvline(start, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlim(min(events), max(events))
    ax.set_ylim(0, top_b / div * 1.05)
    ax.set_xlabel("allocation event")
    ax.set_ylabel(f"memory ({label})")
    parts = setup_parts(report)
    m = parts[0] if parts else getattr(report.model, "name", "model")
    gpu = getattr(report.hardware, "name", None)
    sub = " · ".join(x for x in (_setup_text(report, vary_shape=False), f"on {gpu}" if gpu else "") if x)
    _headline(fig, title or f"{m}: allocated memory over the training step by category "
                            f"({report.source}, {label})", sub)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="outside right upper", fontsize=8)
    texts = _phase_labels(fig, ax, phases)
    _save(fig, path)
    return {"events": events, "series": series, "reserved": reserved, "phases": phases, "units": label,
            "labels": texts, "figure": fig}
