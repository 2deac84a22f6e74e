"""The model and GPU catalogues as plain-text tables (`trainmem models`, `trainmem gpus`)."""
from __future__ import annotations

from typing import Any

from ..units import fmt_count
from .text import fit_columns, width, wrap

#: the widest family cell (a longer family name, ``roberta-prenorm``, ends in "…"; ``--json`` has it whole)
FAMILY_WIDTH = 8


def render_models(rows: list[dict[str, Any]]) -> str:
    """One line per catalogue model: family, head, parameters and shape."""
    # columns as wide as their widest cell, so that the longest names still fit the terminal
    rows = [dict(r, family=r["family"] if len(r["family"]) <= FAMILY_WIDTH else r["family"][:FAMILY_WIDTH - 1] + "…")
            for r in rows]
    w = {k: max([len(h)] + [len(f"{r[k]:,d}" if k == "params" else str(r[k])) for r in rows])
         for k, h in (("name", "name"), ("family", "family"), ("head", "head"), ("params", "params"),
                      ("vocab", "vocab"))}
    lines = [f"{'name':{w['name']}s} {'family':{w['family']}s} {'head':{w['head']}s} {'params':>{w['params']}s} "
             f"{'layer':>5s} {'hidden':>6s} {'heads':>5s} {'kv':>4s} {'vocab':>{w['vocab']}s}"]
    for r in rows:
        lines.append(f"{r['name']:{w['name']}s} {r['family']:{w['family']}s} {r['head']:{w['head']}s} "
                     f"{r['params']:>{w['params']},d} {r['layers']:>5d} {r['hidden']:>6d} {r['heads']:>5d} "
                     f"{r['kv_heads']:>4d} {r['vocab']:>{w['vocab']}d}")
    if len(lines[0]) <= width():
        return "\n".join(lines)
    return "\n".join(_narrow_models(rows))


def _narrow_models(rows: list[dict[str, Any]]) -> list[str]:
    """The model table on a terminal too narrow for it: parameters scaled (``8.03B``; exact in
    ``--json``), then the family, vocabulary, KV-head and head columns left out as needed, the name
    shortened last (``render.text.fit_columns``)."""
    heads = ("name", "family", "head", "params", "layer", "hidden", "heads", "kv", "vocab")
    cells = [(r["name"], r["family"], r["head"], fmt_count(r["params"]), str(r["layers"]), str(r["hidden"]),
              str(r["heads"]), str(r["kv_heads"]), str(r["vocab"])) for r in rows]
    return fit_columns(heads, cells, left=3, shrink=0, shrink_min=26, optional=(1, 8, 7, 6))


def render_gpus(rows: list[dict[str, Any]]) -> str:
    """One line per catalogue GPU (exact capacity, assumed context, bf16 throughput), then an
    indented line with every other name ``--gpu`` accepts for it (aliases, nvidia-smi names). The
    columns as wide as their widest cell (``render.text.fit_columns``): on a narrow terminal the
    label is shortened, then the throughput and context columns left out."""
    heads = ("name", "label", "capacity (bytes)", "GiB", "context", "bf16 TF/s")
    cells = [(r["name"], r["label"], f"{r['capacity_bytes']:,d}", f"{r['capacity_bytes'] / 2**30:.2f}",
              f"{r['context_bytes'] / 2**20:.0f}MiB", f"{r['bf16_tflops']:.0f}") for r in rows]
    table = fit_columns(heads, cells, left=2, shrink=1, shrink_min=16, optional=(5, 4))
    lines, k = table[:1], 1
    pad = " " * (max(len(c[0]) for c in cells + [heads]) + 1)  # under the label
    for r in rows:  # each GPU's row, then the other names --gpu accepts for it
        lines.append(table[k])
        k += 1
        if r.get("aliases"):
            lines += wrap(f"{pad}also: {', '.join(r['aliases'])}")
    lines += table[k:]  # the columns left out, if any
    for note in ("capacity: total memory as NVML/nvidia-smi reports it (`trainmem gpus --json`: each one's source)",
                 "context: assumed memory taken before training (override with --context-memory)",
                 "--gpu takes a name, an alias or an nvidia-smi name; a family with several sizes (a100, v100, "
                 "gh200) is ambiguous: name the card; --gpu auto reads the local GPU through NVML"):
        lines += wrap(note)
    return "\n".join(lines)
