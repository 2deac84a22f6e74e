"""Measured runs and comparisons as text: what ``trainmem measure`` adds to the common table
(per-phase bytes, the driver's view, the out-of-memory diagnosis), the lines of
``--find-max-batch``, and the side-by-side tables of ``trainmem compare``."""
from __future__ import annotations

from typing import Any

from ..units import fmt, pick_unit, scale
from .text import fit_columns, free_width, shorten, width, wrap, wrap_parts


def fmt_bytes(n: int | None, units: str) -> str:
    """Bytes with their unit label: a fixed unit as it is, ``auto`` the unit that suits the amount
    (KiB, MiB, GiB, TiB); ``-`` for None."""
    return "-" if n is None else fmt(n, units)


def _table_unit(units: str, amounts: list[int | None]) -> str:
    """One unit for a table of ``amounts``: ``units`` when fixed, else chosen from the largest."""
    return pick_unit(units, max([abs(a) for a in amounts if a is not None] or [0]) or None)


def _byte_phases(rows: list[dict[str, Any]]) -> list[str]:
    """The phases of a small run in exact bytes, with the op at each peak (shortened to fit)."""
    cells = [(f"{p['step']:>4d}", p["name"], f"{p['allocated']:,d}", f"{p['peak']:,d}",
              "-" if p["reserved"] is None else f"{p['reserved']:,d}", p.get("where") or "") for p in rows]
    w = [max([len(h)] + [len(c[i]) for c in cells])
         for i, h in enumerate(("step", "phase", "allocated", "peak", "reserved", "peak at"))]
    fixed = w[0] + 2 + w[1] + 1 + w[2] + 1 + w[3] + 1 + w[4] + 2
    ww = free_width(fixed, w[5], minimum=8)
    lines = ["", "phases in bytes (exact, with the op at each peak)",
             f"{'step':>{w[0]}s}  {'phase':{w[1]}s} {'allocated':>{w[2]}s} {'peak':>{w[3]}s} "
             f"{'reserved':>{w[4]}s}  peak at"]
    for c in cells:
        lines.append(f"{c[0]:>{w[0]}s}  {c[1]:{w[1]}s} {c[2]:>{w[2]}s} {c[3]:>{w[3]}s} {c[4]:>{w[4]}s}  "
                     f"{shorten(c[5], ww, keep='start')}".rstrip())
    return lines


def _driver_phases(rows: list[dict[str, Any]], units: str) -> list[str]:
    """The driver's view per phase (NVML): allocated, reserved, device and process use, context."""
    src = next((p.get("driver_source") for p in rows if p.get("driver_source")), "")
    units = _table_unit(units, [p.get("driver_used") for p in rows] + [p["reserved"] for p in rows])
    lines = [""] + wrap(f"driver's view per phase ({src}; context = driver − reserved)")
    heads = ("step", "phase", "allocated", "reserved", "driver used", "this process", "context")
    cells = [(str(p["step"]), p["name"], fmt_bytes(p["allocated"], units), fmt_bytes(p["reserved"], units),
              fmt_bytes(p.get("driver_used"), units), fmt_bytes(p.get("process_used"), units),
              fmt_bytes(p.get("cuda_context"), units)) for p in rows]
    # step right-aligned, the phase name left-aligned and shortened where the terminal is narrow
    return lines + _step_phase_table(heads, cells)


def _step_phase_table(heads: tuple[str, ...], cells: list[tuple[str, ...]]) -> list[str]:
    """A table whose first column is the step (right-aligned), the second the phase name (left-aligned,
    shortened to fit the terminal), the rest amounts (right-aligned): ``render.text.fit_columns``
    with the step moved to the right of its column."""
    ws = max(len(c[0]) for c in [heads] + cells)
    table = fit_columns((heads[1],) + heads[2:], [(c[1],) + c[2:] for c in cells], width() - ws - 2, left=1,
                        shrink=0, shrink_min=8)
    return [f"{s:>{ws}s}  {ln}" for s, ln in zip([heads[0]] + [c[0] for c in cells], table)]


def _oom_lines(r: Any, oom: dict[str, Any], units: str) -> list[str]:
    """The out-of-memory diagnosis: where, what was live by kind, the largest tensors, what fits."""
    units = _table_unit(units, [oom.get("allocated"), oom.get("reserved"), (oom.get("fit") or {}).get("limit")])
    lines = [""] + wrap(f"OUT OF MEMORY in {oom['phase']}: {oom['message']}")
    lines += wrap(f"  live then: allocated {fmt_bytes(oom.get('allocated'), units)}"
                  + (f", reserved {fmt_bytes(oom.get('reserved'), units)}" if oom.get("reserved") is not None
                     else "")
                  + (f"; the refused allocation {fmt_bytes(oom.get('requested'), units)}"
                     if oom.get("requested") else ""))
    kw = max(16, min(56, width() - 19))  # the kind column: 56 wide, narrower where the terminal is
    for kind, b in sorted((oom.get("by_kind") or {}).items(), key=lambda kv: -kv[1]):
        lines.append(f"    {shorten(kind, kw):{kw}s} {fmt_bytes(b, units):>14s}")
    if oom.get("largest"):
        lines.append("  largest live tensors:")
        cells = [(fmt_bytes(t["bytes"], units), t.get("category", ""), t.get("dtype", ""),
                  "x".join(str(x) for x in t.get("shape") or []) or "-",
                  t.get("name", "") + (f" (allocated in {t['allocated_in']})" if t.get("allocated_in") else ""))
                 for t in oom["largest"]]
        w = [max(len(c[i]) for c in cells) for i in range(5)]
        fixed = 4 + w[0] + 2 + w[1] + 1 + w[2] + 1 + w[3] + 1
        for c in cells:
            lines.append(f"    {c[0]:>{w[0]}s}  {c[1]:{w[1]}s} {c[2]:{w[2]}s} {c[3]:{w[3]}s} "
                         f"{shorten(c[4], free_width(fixed, w[4], minimum=8), keep='start')}".rstrip())
    fit = oom.get("fit")
    if fit:
        if fit.get("batch_size"):
            text = (f"  what would fit: micro-batch {fit['batch_size']} at sequence {r.training.seq_len} on "
                    f"{fit.get('on')} (trainmem.plan.fit, {fit.get('method')}: "
                    f"{fmt_bytes(fit.get('device_used'), units)} of {fmt_bytes(fit.get('limit'), units)})")
        elif fit.get("note"):
            text = f"  what would fit: {fit['note']}"
        else:
            text = (f"  what would fit: not even micro-batch 1 at sequence {r.training.seq_len} on "
                    f"{fit.get('on')} (trainmem.plan.fit); try `trainmem estimate ... --gpu` for suggestions")
        lines += wrap(text, indent=" " * 18)
    return lines


def measure_details(r: Any, units: str = "auto") -> str:
    """What a measured report adds to the common table: the phases in exact bytes for a run below
    1 GiB, driver figures and CUDA context per phase, the out-of-memory diagnosis, notes and files
    written; every line fits the terminal (``render.text.width``)."""
    ex = r.extra
    lines: list[str] = []
    rows = ex.get("phases") or []
    if rows and r.peak_allocated < (10**9 if units in ("GB", "MB", "TB", "KB") else 2**30):
        lines += _byte_phases(rows)
    if any("driver_used" in p for p in rows):
        lines += _driver_phases(rows, units)
    if ex.get("oom"):
        lines += _oom_lines(r, ex["oom"], units)
    if ex.get("ranks"):
        lines += rank_lines(ex, units)
    for n in ex.get("notes") or []:
        lines += wrap(f"note: {n}", indent=" " * 6)
    for f in ex.get("files") or []:
        lines.append(f"written: {f}")
    env = ex.get("environment") or {}
    dev = env.get("gpu") or f"cpu ({env.get('cpu', '')}, {env.get('threads')} threads)"
    lines += wrap_parts([f"measured on {dev}", f"torch {env.get('torch')}", f"transformers {env.get('transformers')}"]
                        + ([f"CUDA {env.get('cuda')}", f"driver {env.get('driver')}"] if env.get("gpu") else [])
                        + [f"{ex.get('steps')} step{'' if ex.get('steps') == 1 else 's'} in {ex.get('runtime_s')} s"])
    return "\n".join(lines)


def rank_lines(ex: dict[str, Any], units: str = "auto") -> list[str]:
    """One line per rank of a run on several ranks (``measure.distributed``): its peak allocated,
    reserved where known, and where the peak was; the rank the tables show is marked."""
    ranks = ex["ranks"]
    lines = ["", f"ranks: {len(ranks)} ({ex.get('wrapper') or 'torch.distributed'}); the tables above are rank "
                 f"{ex.get('rank')}, the worst"]
    for s in ranks:
        mark = "*" if s["rank"] == ex.get("rank") else " "
        parts = [f"peak allocated {fmt_bytes(s['peak_allocated'], units)}"]
        if s.get("peak_reserved") is not None:
            parts.append(f"reserved {fmt_bytes(s['peak_reserved'], units)}")
        if s.get("device_used") is not None:
            parts.append(f"device {fmt_bytes(s['device_used'], units)}")
        parts.append(f"parameters {fmt_bytes(s.get('parameters_bytes'), units)}")
        if s.get("peak_phase"):
            parts.append(f"at {s['peak_phase']}")
        if s.get("oom"):
            parts.append(f"OUT OF MEMORY in {s['oom'].get('phase')}")
        # wrap() keeps a line's leading blanks on its continuation lines: indent both kinds to column 12
        lines += wrap(f"{mark} rank {s['rank']:>3d}: " + ", ".join(parts), indent=" " * (12 if mark == "*" else 10))
    return lines


def max_batch_try(row: dict[str, Any], units: str = "GiB") -> str:
    """One try of ``--find-max-batch``: whether it ran, its peak, its runtime."""
    res = "runs" if row["ok"] else f"OOM in {row['oom_phase']}"
    return "\n".join(wrap(f"  micro-batch {row['batch_size']:>6d}: {res:28s} peak allocated "
                          f"{fmt_bytes(row['peak_allocated'], units):>14s}"
                          + (f", reserved {fmt_bytes(row['peak_reserved'], units)}"
                             if row["peak_reserved"] is not None else "")
                          + f"  ({row['runtime_s']} s)", indent=" " * 21))


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
    return scale(units, big or None)


_TITLES = {"total": "totals", "category": "at the peak", "phase": "allocated at phase end",
           "phase_peak": "peak within phase", "phase_reserved": "reserved at phase end"}


def _comparison_cells(c: Any, div: int, exact: bool) -> dict[str, list[list[str]]]:
    """Per kind of row, the cells of the comparison table: name, each source's value, then each
    other source's difference against the reference, absolute and relative."""
    r = c.ref_index
    others = [i for i in range(len(c.sources)) if i != r]

    def num(v: int | None) -> str:
        if v is None:
            return "-"
        return f"{v:,d}" if exact else f"{v / div:,.3f}"

    out: dict[str, list[list[str]]] = {}
    for kind in _TITLES:
        rows = [d for d in c.rows if d.kind == kind]
        if kind == "total":
            rows = [d for d in rows if any(v is not None for v in d.values)]
        if rows:
            out[kind] = [[d.name] + [num(v) for v in d.values]
                         + [x for i in others for x in (num(d.diff(i, r)),
                                                        "-" if d.rel(i, r) is None else f"{100 * d.rel(i, r):+.3f}%")]
                         for d in rows]
    return out


def _kept_columns(heads: list[str], w: list[int], sources: int) -> list[int]:
    """The value columns of a comparison that fit the terminal (``render.text.width``) beside a row
    name of 12: every source's values, then the differences as fit; the absolute differences (``Δ``,
    after the ``sources`` value columns, every other one) are left out first, the last first, then
    the relative ones (``Δ%``), where the row would not fit."""
    keep = list(range(len(heads)))
    for k in [*reversed(range(sources, len(heads), 2)), *reversed(range(sources + 1, len(heads), 2))]:
        if 12 + sum(w[j] + 2 for j in keep) <= width():
            break
        keep.remove(k)
    return keep


def render_comparison(c: Any, units: str = "auto", exact: bool = False) -> str:
    """One table per kind (totals, categories, phase allocated / peak / reserved), with the
    difference of each source against the reference, absolute and relative. One unit for all
    tables (``auto``: from the largest value), columns as wide as their widest cell; where a row
    would pass the terminal's width (``render.text.width``) the absolute differences are left out
    (:func:`_kept_columns`, named in a last line), then the row names shortened (their head kept);
    the numbers keep their width, in bytes with ``exact``."""
    div, label = _unit(c, units, exact)
    others = [i for i in range(len(c.sources)) if i != c.ref_index]
    m, t = c.reports[0].model, c.reports[0].training
    head = [f"trainmem compare — {getattr(m, 'name', '')}"]
    if t is not None:
        head += [t.precision, f"micro-batch {t.batch_size} × seq {t.seq_len}", t.optimizer, f"attention {t.attention}"]
    lines = wrap_parts(head) + wrap_parts([f"sources: {' | '.join(c.sources)}", f"device {c.device or '-'}",
                                           f"differences against {c.reference} (Δ = source − {c.reference})",
                                           f"values in {label}"]) + [""]
    cells = _comparison_cells(c, div, exact)
    heads = list(c.sources) + [x for i in others for x in ("Δ " + c.sources[i], "Δ% " + c.sources[i])]
    w = [max([len(h)] + [len(row[k + 1]) for rows in cells.values() for row in rows]) for k, h in enumerate(heads)]
    keep = _kept_columns(heads, w, len(c.sources))
    fixed = sum(w[k] + 2 for k in keep)
    names = max([len(_TITLES[k]) for k in cells] + [len(row[0]) for rows in cells.values() for row in rows])
    wn = free_width(fixed, names, minimum=12)
    for kind, rows in cells.items():
        lines.append(f"{shorten(_TITLES[kind], wn, keep='start'):{wn}s}"
                     + "".join(f"  {heads[k]:>{w[k]}s}" for k in keep))
        for row in rows:
            lines.append(f"{shorten(row[0], wn, keep='start'):{wn}s}"
                         + "".join(f"  {row[k + 1]:>{w[k]}s}" for k in keep))
        lines.append("")
    if len(keep) < len(heads):
        lines += wrap(f"({', '.join(h for k, h in enumerate(heads) if k not in keep)} left out on this narrow "
                      "terminal: --json has them)") + [""]
    for i in others:
        wr = c.worst_phase_rel(c.sources[i])
        if wr is not None:
            lines.append(f"{c.sources[i]} vs {c.reference}: largest phase difference {100 * wr:.3f}%")
    for n in c.notes:
        lines += wrap(f"note: {n}", indent=" " * 6)
    for s, rep in zip(c.sources, c.reports):
        for wn_ in rep.warnings:
            lines += wrap(f"warning ({s}): {wn_}", indent=" " * 6)
    return "\n".join(lines).rstrip()
