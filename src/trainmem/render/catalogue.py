"""The model and GPU catalogues as plain-text tables (`trainmem models`, `trainmem gpus`)."""
from __future__ import annotations

from typing import Any


def render_models(rows: list[dict[str, Any]]) -> str:
    """One line per catalogue model: family, head, parameters and shape."""
    lines = [f"{'name':18s} {'family':15s} {'head':10s} {'params':>16s} {'layers':>6s} {'hidden':>6s} "
             f"{'heads':>5s} {'kv':>4s} {'vocab':>7s}"]
    for r in rows:
        lines.append(f"{r['name']:18s} {r['family']:15s} {r['head']:10s} {r['params']:>16,d} {r['layers']:>6d} "
                     f"{r['hidden']:>6d} {r['heads']:>5d} {r['kv_heads']:>4d} {r['vocab']:>7d}")
    return "\n".join(lines)


def render_gpus(rows: list[dict[str, Any]]) -> str:
    """One line per catalogue GPU: exact capacity, assumed context, bf16 throughput."""
    lines = [f"{'name':16s} {'label':30s} {'capacity (bytes)':>18s} {'GiB':>8s} {'context':>9s} {'bf16 TF/s':>9s}"]
    for r in rows:
        lines.append(f"{r['name']:16s} {r['label']:30s} {r['capacity_bytes']:>18,d} "
                     f"{r['capacity_bytes'] / 2**30:8.2f} {r['context_bytes'] / 2**20:6.0f}MiB "
                     f"{r['bf16_tflops']:9.0f}")
    lines.append("capacity = total memory as NVML/nvidia-smi reports it; context = assumed memory taken before "
                 "training (override with --context-memory)")
    return "\n".join(lines)
