"""`trainmem calibrate` as text: the plan (what would be measured) and a measured profile."""
from __future__ import annotations

import textwrap
from typing import Any

from .text import width, wrap


def render_plan(items: list[dict[str, Any]], reason: str, out: str) -> str:
    """What ``trainmem calibrate`` measures on a GPU, item by item, and why nothing was measured here;
    every line wrapped to the terminal's width (``render.text.width``)."""
    w = width()
    lines = [*wrap(f"trainmem calibrate — nothing measured: {reason}", w),
             "On a CUDA GPU it measures, each item in its own fresh process",
             "(python -m trainmem.measure.calibrate --item NAME, one JSON line each):", ""]
    for it in items:
        env = " ".join(f"{k}={v}" for k, v in it["environment"].items())
        lines += wrap(f"  {it['item']}{'  [' + env + ']' if env else ''}", w, indent="    ")
        lines += wrap(f"    what: {it['what']}", w)
        if it["values"]:
            lines += wrap(f"    values (bytes): {', '.join(it['values'])}", w)
        lines += wrap(f"    how: {it['how']}", w)
    lines += ["", *wrap(f"It writes the profile to {out} (--out FILE);", w),
              *wrap("`trainmem estimate MODEL --gpu NAME --calibration FILE` then uses its context and cuBLAS "
                    "workspace.", w)]
    return "\n".join(lines)


def render_profile(profile: dict[str, Any], path: str) -> str:
    """A measured profile: the GPU and versions, every value in MiB and bytes (null: its reason),
    what estimate will use, and where the file is; the note column takes what the terminal's width
    (``render.text.width``) leaves, wrapping under itself."""
    cc = profile.get("compute_capability") or ["?", "?"]
    w = width()
    kw = max([len("value")] + [len(k) for k in profile["values"]])   # the value names' column
    lead = kw + 1 + 10 + 1 + 16 + 2                                   # where the note starts
    nw = max(12, w - lead)
    lines = [*wrap(f"trainmem calibrate — {profile['gpu']} (sm{cc[0]}{cc[1]}, {profile.get('total_memory') or 0:,} B)",
                   w),
             *wrap(f"driver {profile.get('driver')} · CUDA {profile.get('cuda')} · torch {profile.get('torch')} · "
                   f"{profile.get('date')}", w), "", f"{'value':{kw}s} {'MiB':>10s} {'bytes':>16s}  note"]
    reasons = profile.get("reasons", {})
    for k, v in profile["values"].items():
        note = "" if v is not None else reasons.get(k, "")
        if k == "context":
            note = f"used by estimate (from {reasons.get('context_from', '?')})" if v is not None else note
        if k == "cublas_workspace" and v is not None:
            note = "used by estimate and trace (per handle)"
        shown = ("-", "null") if v is None else (f"{v / 2**20:.2f}", f"{v:,}")
        notes = textwrap.wrap(note, nw) or [""]
        lines.append(f"{k:{kw}s} {shown[0]:>10s} {shown[1]:>16s}  {notes[0]}".rstrip())
        lines += [f"{'':{lead}s}{n}" for n in notes[1:]]
    failed = [r for r in profile.get("items", {}).values() if not r.get("ok")]
    for r in failed:
        lines += wrap(f"item {r.get('item')} failed: {r.get('reason')}", w)
    lines += ["", *wrap(f"written: {path}", w), "use it:",
              *wrap(f"  trainmem estimate MODEL --gpu \"{profile['gpu']}\" --calibration {path}", w)]
    return "\n".join(lines)
