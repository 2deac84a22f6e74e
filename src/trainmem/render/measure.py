"""Measured runs and comparisons as text: what ``trainmem measure`` adds to the common table
(per-phase bytes, the driver's view, the out-of-memory diagnosis), the lines of
``--find-max-batch``, and the side-by-side tables of ``trainmem compare``."""
from __future__ import annotations

from typing import Any

from ..units import fmt


def fmt_bytes(n: int | None, units: str) -> str:
    """Bytes in the unit system, in MiB (MB) below a GiB (GB): measured runs are often small."""
    if n is None:
        return "-"
    if abs(n) < 2**30 and units == "GiB":
        return f"{n / 2**20:,.2f} MiB"
    if abs(n) < 10**9 and units == "GB":
        return f"{n / 10**6:,.2f} MB"
    return fmt(n, units)


def measure_details(r: Any, units: str = "GiB") -> str:
    """What a measured report adds to the common table: driver figures and CUDA context per phase,
    the out-of-memory diagnosis, notes and files written."""
    ex = r.extra
    lines: list[str] = []
    rows = ex.get("phases") or []
    if rows and r.peak_allocated < (2**30 if units == "GiB" else 10**9):
        lines.append("")
        lines.append("phases in bytes (the table above rounds small runs away)")
        lines.append(f"{'step':>4s}  {'phase':24s} {'allocated':>16s} {'peak':>16s} {'reserved':>16s}  peak at")
        for p in rows:
            res = "-" if p["reserved"] is None else f"{p['reserved']:,d}"
            lines.append(f"{p['step']:>4d}  {p['name']:24s} {p['allocated']:>16,d} {p['peak']:>16,d} {res:>16s}  "
                         f"{p.get('where', '')}")
    if any("driver_used" in p for p in rows):
        src = next((p.get("driver_source") for p in rows if p.get("driver_source")), "")
        lines.append("")
        lines.append(f"driver's view per phase ({src}; context = driver − reserved)")
        lines.append(f"{'step':>4s}  {'phase':24s} {'allocated':>14s} {'reserved':>14s} {'driver used':>14s} "
                     f"{'this process':>14s} {'context':>14s}")
        for p in rows:
            lines.append(f"{p['step']:>4d}  {p['name']:24s} {fmt_bytes(p['allocated'], units):>14s} "
                         f"{fmt_bytes(p['reserved'], units):>14s} {fmt_bytes(p.get('driver_used'), units):>14s} "
                         f"{fmt_bytes(p.get('process_used'), units):>14s} "
                         f"{fmt_bytes(p.get('cuda_context'), units):>14s}")
    oom = ex.get("oom")
    if oom:
        lines.append("")
        lines.append(f"OUT OF MEMORY in {oom['phase']}: {oom['message']}")
        lines.append(f"  live then: allocated {fmt_bytes(oom.get('allocated'), units)}"
                     + (f", reserved {fmt_bytes(oom.get('reserved'), units)}" if oom.get("reserved") is not None
                        else "")
                     + (f"; the refused allocation {fmt_bytes(oom.get('requested'), units)}"
                        if oom.get("requested") else ""))
        for kind, b in sorted((oom.get("by_kind") or {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"    {kind:56s} {fmt_bytes(b, units):>14s}")
        if oom.get("largest"):
            lines.append("  largest live tensors:")
            for t in oom["largest"]:
                shape = "x".join(str(x) for x in t.get("shape") or []) or "-"
                where = f" (allocated in {t['allocated_in']})" if t.get("allocated_in") else ""
                lines.append(f"    {fmt_bytes(t['bytes'], units):>14s}  {t.get('category', ''):24s} "
                             f"{t.get('dtype', ''):9s} {shape:20s} {t.get('name', '')[:60]}{where}")
        fit = oom.get("fit")
        if fit:
            if fit.get("batch_size"):
                lines.append(f"  what would fit: micro-batch {fit['batch_size']} at sequence "
                             f"{r.training.seq_len} on {fit.get('on')} (trainmem.plan.fit, {fit.get('method')}: "
                             f"{fmt_bytes(fit.get('device_used'), units)} of {fmt_bytes(fit.get('limit'), units)})")
            elif fit.get("note"):
                lines.append(f"  what would fit: {fit['note']}")
            else:
                lines.append(f"  what would fit: not even micro-batch 1 at sequence {r.training.seq_len} on "
                             f"{fit.get('on')} (trainmem.plan.fit); try `trainmem estimate ... --gpu` for suggestions")
    for n in ex.get("notes") or []:
        lines.append(f"note: {n}")
    for f in ex.get("files") or []:
        lines.append(f"written: {f}")
    env = ex.get("environment") or {}
    dev = env.get("gpu") or f"cpu ({env.get('cpu', '')}, {env.get('threads')} threads)"
    lines.append(f"measured on {dev} · torch {env.get('torch')} · transformers {env.get('transformers')}"
                 + (f" · CUDA {env.get('cuda')} · driver {env.get('driver')}" if env.get("gpu") else "")
                 + f" · {ex.get('steps')} step{'' if ex.get('steps') == 1 else 's'} in {ex.get('runtime_s')} s")
    return "\n".join(lines)


def max_batch_try(row: dict[str, Any], units: str = "GiB") -> str:
    """One try of ``--find-max-batch``: whether it ran, its peak, its runtime."""
    res = "runs" if row["ok"] else f"OOM in {row['oom_phase']}"
    return (f"  micro-batch {row['batch_size']:>6d}: {res:28s} peak allocated "
            f"{fmt_bytes(row['peak_allocated'], units):>14s}"
            + (f", reserved {fmt_bytes(row['peak_reserved'], units)}" if row["peak_reserved"] is not None else "")
            + f"  ({row['runtime_s']} s)")


def max_batch_summary(res: dict[str, Any]) -> str:
    """The outcome of ``find_max_batch``: the largest micro-batch that ran, and the prediction."""
    lines = []
    if res["measured_max"]:
        tail = (f" (micro-batch {res['first_failing']} runs out of memory)" if res["first_failing"]
                else f" (stopped at the cap {res['batch_cap']}, not by memory)")
        lines.append(f"largest micro-batch that runs: {res['measured_max']}{tail}")
    else:
        lines.append("not even micro-batch 1 runs")
    p = res["prediction"]
    if p.get("batch_size") is not None:
        lines.append(f"predicted by trainmem.plan.fit ({p.get('method')}, on {p.get('on')}): {p['batch_size']}")
    else:
        lines.append(f"predicted by trainmem.plan.fit: {p.get('note') or 'nothing fits'}")
    return "\n".join(lines)


def _unit(c: Any, units: str, exact: bool) -> tuple[int, str]:
    if exact:
        return 1, "B"
    big = max([abs(v) for d in c.rows for v in d.values if v is not None] or [0])
    if units == "GB":
        return (10**9, "GB") if big >= 10**9 else (10**6, "MB")
    return (2**30, "GiB") if big >= 2**30 else (2**20, "MiB")


def render_comparison(c: Any, units: str = "GiB", exact: bool = False) -> str:
    """One table per kind (totals, categories, phase allocated / peak / reserved), with the
    difference of each source against the reference, absolute and relative."""
    div, label = _unit(c, units, exact)
    r = c.ref_index
    others = [i for i in range(len(c.sources)) if i != r]
    width = 16 if exact else 12
    m = c.reports[0].model
    t = c.reports[0].training
    head = f"trainmem compare — {getattr(m, 'name', '')}"
    if t is not None:
        head += (f" · {t.precision} · micro-batch {t.batch_size} × seq {t.seq_len} · {t.optimizer} · "
                 f"attention {t.attention}")
    lines = [head, f"sources: {' | '.join(c.sources)} · device {c.device or '-'} · differences against "
                   f"{c.reference} (Δ = source − {c.reference}) · values in {label}", ""]

    def num(v: int | None) -> str:
        if v is None:
            return "-"
        return f"{v:,d}" if exact else f"{v / div:,.3f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.3f}%"

    cols = "".join(f" {s:>{width}s}" for s in c.sources)
    cols += "".join(f" {'Δ ' + c.sources[i]:>{width}s} {'Δ% ' + c.sources[i]:>11s}" for i in others)
    titles = {"total": "totals", "category": "by category at the peak",
              "phase": "phases: allocated at the end", "phase_peak": "phases: peak within",
              "phase_reserved": "phases: reserved at the end"}
    for kind, title in titles.items():
        rows = [d for d in c.rows if d.kind == kind]
        if kind == "total":
            rows = [d for d in rows if any(v is not None for v in d.values)]
        if not rows:
            continue
        lines.append(f"{title:28s}{cols}")
        for d in rows:
            row = f"{d.name[:28]:28s}" + "".join(f" {num(v):>{width}s}" for v in d.values)
            row += "".join(f" {num(d.diff(i, r)):>{width}s} {pct(d.rel(i, r)):>11s}" for i in others)
            lines.append(row)
        lines.append("")
    for i in others:
        w = c.worst_phase_rel(c.sources[i])
        if w is not None:
            lines.append(f"{c.sources[i]} vs {c.reference}: largest phase difference {100 * w:.3f}%")
    for n in c.notes:
        lines.append(f"note: {n}")
    for s, rep in zip(c.sources, c.reports):
        for w in rep.warnings:
            lines.append(f"warning ({s}): {w}")
    return "\n".join(lines).rstrip()
