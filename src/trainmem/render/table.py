"""Plain-text tables of MemoryReports (units chosen only here, always labelled)."""
from __future__ import annotations

from typing import Any

from ..report import CATEGORIES, MemoryReport
from ..units import UNITS, fmt, fmt_count, number, pick_unit
from .text import wrap, wrap_parts


_DT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "int64", "bool": "bool",
       "uint8": "uint8", "uint64": "uint64"}


def setup_parts(r: MemoryReport) -> list[str]:
    """The setup line's parts (model and parameter count, framework, precision, shape, optimizer,
    attention, parallel layout, every other option that differs from its default); empty without
    a training setup. Parameter counts are scaled (``124.4M``, ``8.03B``): never ``0.00B``."""
    t, m = r.training, r.model
    if t is None or m is None:
        return []
    par = [f"{k}={getattr(t, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(t, k) > 1]
    if t.zero_stage:
        par.append(f"zero={t.zero_stage}" if t.fsdp is None else f"fsdp={t.fsdp}")
    extras = [f"recompute={t.recompute}"] if t.recompute != "none" else []
    if t.lora_rank:
        extras.append(f"lora r={t.lora_rank}")
    if t.optimizer_in_backward:
        extras.append("optimizer-in-backward")
    extras += _other_options(t)
    stage = r.extra.get("pipeline_stage")
    if stage:
        extras.append(f"{stage} pipeline stage shown")
    parts = [f"{m.name} ({fmt_count(m.num_params)} params)"]
    fw = (t.extra or {}).get("framework")
    if fw:  # the preset first: the options after it are what it (and the user) set
        version = t.extra.get("framework_version")
        parts.append(f"framework {fw}" + (f" {version}" if version else ""))
    batch = f"{t.batch_size} pairs ({2 * t.batch_size} seqs)" if getattr(t, "trainer", None) else t.batch_size
    parts += [t.precision, f"micro-batch {batch} × seq {t.seq_len}", f"grad-accum {t.grad_accum}",
              t.optimizer, f"attention {t.attention}"]
    if par:
        parts.append(" ".join(par))
    return parts + extras


_SHOWN = {"batch_size", "seq_len", "grad_accum", "precision", "optimizer", "attention", "dp", "tp", "pp", "cp",
          "ep", "zero", "fsdp", "recompute", "lora_rank", "optimizer_in_backward", "keep_logits", "extra"}


def _other_options(t: Any) -> list[str]:
    """Every other training option that differs from its default, as its flag would say it."""
    from ..spec.training import TrainingSpec
    default = TrainingSpec()
    out = []
    for k, v in t.to_dict().items():
        if k in _SHOWN or v == getattr(default, k, v) or (k == "lora_targets" and v is None):
            continue
        flag = k.replace("_", "-")
        if k == "dropout":
            out.append("no-dropout")
        elif k == "optimizer_impl":
            out.append(f"optimizer-impl={v}")
        elif isinstance(v, bool):  # a flag on; off where the default is on or unset (use_cache, overlap_comm)
            out.append(flag if v else f"{flag}=false")
        else:
            out.append(f"{flag}={','.join(v) if isinstance(v, list) else v}")
    return out


def report_unit(r: MemoryReport, units: str = "auto") -> str:
    """The one unit a report's table is printed in: ``units`` when fixed, else chosen from the
    largest amount the table shows (peak allocated, peak reserved, device memory)."""
    big = max([v for v in (r.peak_allocated, r.peak_reserved, r.device_used) if v is not None] or [0])
    return pick_unit(units, big or None)


def _component_rows(r: MemoryReport, unit: str, detail: bool) -> list[str]:
    """The components at the peak, by category (each component with ``detail``), in ``unit``;
    every column as wide as its widest cell, numbers right-aligned."""
    div = UNITS[unit]
    total = sum(c.bytes for c in r.components) or 1
    if detail:
        rows = [(c.name, _DT.get(c.dtype or "", c.dtype or ""), c.bytes) for c in r.components]
    else:
        by: dict[str, int] = {}
        dt: dict[str, set] = {}
        for c in r.components:
            by[c.category] = by.get(c.category, 0) + c.bytes
            dt.setdefault(c.category, set()).add(c.dtype or "")
        rows = []
        for k in CATEGORIES:
            if k in by:
                names = sorted({_DT.get(x, x) for x in dt[k] if x})
                rows.append((k, "/".join(names) if len(names) <= 2 else "mixed", by[k]))
    head = "component at the peak"
    wn = max([len(head)] + [len(n) for n, _, _ in rows])
    wd = max([len("dtype")] + [len(d) for _, d, _ in rows])
    vals = [number(b, div) for _, _, b in rows]
    wv = max([len(unit), 8] + [len(v) for v in vals])
    lines = [f"{head:{wn}s}  {'dtype':>{wd}s}  {unit:>{wv}s}  {'share':>6s}"]
    for (name, dtype, b), v in zip(rows, vals):
        lines.append(f"{name:{wn}s}  {dtype:>{wd}s}  {v:>{wv}s}  {100 * b / total:5.1f}%")
    return lines


def _summary_rows(r: MemoryReport, unit: str) -> list[str]:
    """Peak allocated / reserved, device memory and the fit verdict, the amounts right-aligned."""
    lines = wrap(f"{'peak allocated':30s} {fmt(r.peak_allocated, unit):>14s}   at {r.peak_phase}"
                 + (f" ({r.peak_where})" if r.peak_where else ""), indent=" " * 48)
    if r.peak_reserved is not None:
        lines.append(f"{'peak reserved':30s} {fmt(r.peak_reserved, unit):>14s}")
    if r.device_used is not None:
        lines.append(f"{'device memory (reserved+ctx)':30s} {fmt(r.device_used, unit):>14s}")
    if r.capacity is not None:
        name = getattr(r.hardware, "name", "GPU")
        limit = "" if r.max_fraction >= 1 else f" × {r.max_fraction:g}"
        verdict = "FITS" if r.fits else "DOES NOT FIT"
        m = r.margin
        lines += wrap(f"{'GPU ' + name:30s} {fmt(r.capacity, unit):>14s}{limit}   {verdict}: "
                      f"{fmt(abs(m), unit)} {'free' if m >= 0 else 'short'}", indent=" " * 48)
        lines += wrap(f"{'':30s} {'':>14s}   verdict on {fmt(r.device_peak, unit)} = {r.fit_basis}"
                      + (f" ({fmt(r.fit_context, unit)})" if r.fit_context else ""),
                      indent="  ")
    for w in r.warnings:
        lines += wrap(f"warning: {w}", indent=" " * 9)
    return lines


def _phase_rows(r: MemoryReport, unit: str) -> list[str]:
    """The phases of the step (allocated at the end, peak within, reserved where known) in ``unit``."""
    if not r.phases:
        return []
    div = UNITS[unit]
    res = any(p.reserved is not None for p in r.phases)
    lines = ["", f"{'step':>4s}  {'phase':24s} {'allocated':>12s} {'peak':>12s}" + (f" {'reserved':>12s}" if res else "")]
    for p in r.phases:
        row = f"{p.step:>4d}  {p.name[:24]:24s} {number(p.allocated, div):>12s} {number(p.peak, div):>12s}"
        if res:
            row += f" {'-' if p.reserved is None else number(p.reserved, div):>12s}"
        lines.append(row)
    lines.append(f"      (values in {unit})")
    return lines


def render_report(r: MemoryReport, units: str = "auto", detail: bool = False) -> str:
    """The default view: components by category (or each component with ``detail``), the peak,
    device memory and fit, then the phases of the step. One unit for the whole table
    (:func:`report_unit`), always labelled; every line fits the terminal (``render.text.width``)
    without ``detail`` (the setup line and long messages wrap, continuation lines indented)."""
    unit = report_unit(r, units)
    lines = [f"trainmem {r.source} — method {r.method or r.source}", *wrap_parts(setup_parts(r)), ""]
    lines += _component_rows(r, unit, detail)
    lines.append("")
    lines += _summary_rows(r, unit)
    lines += _phase_rows(r, unit)
    return "\n".join(lines)
