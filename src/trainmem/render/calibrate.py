"""`trainmem calibrate` as text: the plan (what would be measured) and a measured profile."""
from __future__ import annotations

import textwrap
from typing import Any


def render_plan(items: list[dict[str, Any]], reason: str, out: str) -> str:
    """What ``trainmem calibrate`` measures on a GPU, item by item, and why nothing was measured here."""
    lines = [f"trainmem calibrate — nothing measured: {reason}",
             "On a CUDA GPU it measures, each item in its own fresh process",
             "(python -m trainmem.measure.calibrate --item NAME, one JSON line each):", ""]
    for it in items:
        env = " ".join(f"{k}={v}" for k, v in it["environment"].items())
        lines.append(f"  {it['item']}{'  [' + env + ']' if env else ''}")
        lines += textwrap.wrap(f"what: {it['what']}", 96, initial_indent="    ", subsequent_indent="      ")
        if it["values"]:
            lines += textwrap.wrap(f"values (bytes): {', '.join(it['values'])}", 96, initial_indent="    ",
                                   subsequent_indent="      ")
        lines += textwrap.wrap(f"how: {it['how']}", 96, initial_indent="    ", subsequent_indent="      ")
    lines += ["", f"It writes the profile to {out} (--out FILE);",
              "`trainmem estimate MODEL --gpu NAME --calibration FILE` then uses its context and cuBLAS workspace."]
    return "\n".join(lines)


def render_profile(profile: dict[str, Any], path: str) -> str:
    """A measured profile: the GPU and versions, every value in MiB and bytes (null: its reason),
    what estimate will use, and where the file is."""
    cc = profile.get("compute_capability") or ["?", "?"]
    lines = [f"trainmem calibrate — {profile['gpu']} (sm{cc[0]}{cc[1]}, {profile.get('total_memory') or 0:,} B)",
             f"driver {profile.get('driver')} · CUDA {profile.get('cuda')} · torch {profile.get('torch')} · "
             f"{profile.get('date')}", "", f"{'value':32s} {'MiB':>10s} {'bytes':>16s}  note"]
    reasons = profile.get("reasons", {})
    for k, v in profile["values"].items():
        note = "" if v is not None else reasons.get(k, "")
        if k == "context":
            note = f"used by estimate (from {reasons.get('context_from', '?')})" if v is not None else note
        if k == "cublas_workspace" and v is not None:
            note = "used by estimate and trace (per handle)"
        shown = ("-", "null") if v is None else (f"{v / 2**20:.2f}", f"{v:,}")
        notes = textwrap.wrap(note, 38) or [""]
        lines.append(f"{k:32s} {shown[0]:>10s} {shown[1]:>16s}  {notes[0]}".rstrip())
        lines += [f"{'':61s} {n}" for n in notes[1:]]
    failed = [r for r in profile.get("items", {}).values() if not r.get("ok")]
    for r in failed:
        lines += textwrap.wrap(f"item {r.get('item')} failed: {r.get('reason')}", 100, subsequent_indent="  ")
    lines += ["", f"written: {path}", "use it:",
              f"  trainmem estimate MODEL --gpu \"{profile['gpu']}\" --calibration {path}"]
    return "\n".join(lines)
