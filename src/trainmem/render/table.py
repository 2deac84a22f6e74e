"""Plain-text tables of MemoryReports (units chosen only here, always labelled)."""
from __future__ import annotations

from typing import Any

from ..report import CATEGORIES, MemoryReport
from ..units import fmt, scale


_DT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "int64", "bool": "bool",
       "uint8": "uint8", "uint64": "uint64"}


def _setup_line(r: MemoryReport) -> str:
    t, m = r.training, r.model
    if t is None or m is None:
        return ""
    par = []
    for k in ("dp", "tp", "pp", "cp"):
        v = getattr(t, k)
        if v > 1:
            par.append(f"{k}={v}")
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
    fw = (t.extra or {}).get("framework")
    if fw:  # the preset first: the options after it are what it (and the user) set
        version = t.extra.get("framework_version")
        fw = f" · framework {fw}" + (f" {version}" if version else "")
    return (f"{m.name} ({m.num_params / 1e9:.2f}B params){fw or ''} · {t.precision} · micro-batch {t.batch_size} × "
            f"seq {t.seq_len} · grad-accum {t.grad_accum} · {t.optimizer} · attention {t.attention}"
            + (" · " + " ".join(par) if par else "") + (" · " + " · ".join(extras) if extras else ""))


_SHOWN = {"batch_size", "seq_len", "grad_accum", "precision", "optimizer", "attention", "dp", "tp", "pp", "cp",
          "zero", "fsdp", "recompute", "lora_rank", "optimizer_in_backward", "keep_logits", "extra"}


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
        elif isinstance(v, bool):
            out.append(flag)
        else:
            out.append(f"{flag}={','.join(v) if isinstance(v, list) else v}")
    return out


def render_report(r: MemoryReport, units: str = "GiB", detail: bool = False) -> str:
    """The default view: components by category (or each component with ``detail``), the peak,
    device memory and fit, then the phases of the step."""
    div, label = scale(units)
    lines = [f"trainmem {r.source} — method {r.method or r.source}", _setup_line(r), ""]
    lines.append(f"{'component at the peak':44s} {'dtype':>6s} {label:>10s} {'share':>6s}")
    total = sum(c.bytes for c in r.components) or 1
    if detail:
        rows = [(c.name, c.dtype or "", c.bytes) for c in r.components]
    else:
        by = {}
        dt = {}
        for c in r.components:
            by[c.category] = by.get(c.category, 0) + c.bytes
            dt.setdefault(c.category, set()).add(c.dtype or "")
        rows = []
        for k in CATEGORIES:
            if k in by:
                names = sorted({_DT.get(x, x) for x in dt[k] if x})
                rows.append((k, "/".join(names) if len(names) <= 2 else "mixed", by[k]))
    for name, dtype, b in rows:
        lines.append(f"{name:44s} {dtype:>6s} {b / div:10.2f} {100 * b / total:5.1f}%")
    lines.append("")
    lines.append(f"{'peak allocated':30s} {fmt(r.peak_allocated, units):>14s}   at {r.peak_phase}"
                 + (f" ({r.peak_where})" if r.peak_where else ""))
    if r.peak_reserved is not None:
        lines.append(f"{'peak reserved':30s} {fmt(r.peak_reserved, units):>14s}")
    if r.device_used is not None:
        lines.append(f"{'device memory (reserved+ctx)':30s} {fmt(r.device_used, units):>14s}")
    if r.capacity is not None:
        hw = r.hardware
        name = getattr(hw, "name", "GPU")
        cap = fmt(r.capacity, units)
        limit = "" if r.max_fraction >= 1 else f" × {r.max_fraction:g}"
        verdict = "FITS" if r.fits else "DOES NOT FIT"
        m = r.margin
        lines.append(f"{'GPU ' + name:30s} {cap:>14s}{limit}   {verdict}: "
                     f"{fmt(abs(m), units)} {'free' if m >= 0 else 'short'}")
    for w in r.warnings:
        lines.append(f"warning: {w}")
    if r.phases:
        lines.append("")
        lines.append(f"{'step':>4s}  {'phase':24s} {'allocated':>12s} {'peak':>12s}" +
                     (f" {'reserved':>12s}" if any(p.reserved is not None for p in r.phases) else ""))
        for p in r.phases:
            row = f"{p.step:>4d}  {p.name:24s} {p.allocated / div:12.2f} {p.peak / div:12.2f}"
            if p.reserved is not None:
                row += f" {p.reserved / div:12.2f}"
            lines.append(row)
        lines.append(f"      (values in {label})")
    return "\n".join(x for x in lines if x is not None)
