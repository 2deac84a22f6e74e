"""The model and GPU catalogues as plain-text tables (`trainmem models`, `trainmem gpus`)."""
from __future__ import annotations

from typing import Any


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
    return "\n".join(lines)


def render_gpus(rows: list[dict[str, Any]]) -> str:
    """One line per catalogue GPU (exact capacity, assumed context, bf16 throughput), then an
    indented line with every other name ``--gpu`` accepts for it (aliases, nvidia-smi names)."""
    lines = [f"{'name':16s} {'label':34s} {'capacity (bytes)':>18s} {'GiB':>7s} {'context':>9s} {'bf16 TF/s':>9s}"]
    for r in rows:
        lines.append(f"{r['name']:16s} {r['label'][:34]:34s} {r['capacity_bytes']:>18,d} "
                     f"{r['capacity_bytes'] / 2**30:7.2f} {r['context_bytes'] / 2**20:6.0f}MiB "
                     f"{r['bf16_tflops']:9.0f}")
        if r.get("aliases"):
            lines.append(f"{'':16s} also: {', '.join(r['aliases'])}")
    lines += ["capacity: total memory as NVML/nvidia-smi reports it (`trainmem gpus --json`: each one's source)",
              "context: assumed memory taken before training (override with --context-memory)",
              "--gpu takes a name, an alias or an nvidia-smi name; a family with several sizes (a100, v100,",
              "gh200) is ambiguous: name the card; --gpu auto reads the local GPU through NVML"]
    return "\n".join(lines)
