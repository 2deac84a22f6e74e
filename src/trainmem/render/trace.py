"""What a traced report adds to the common table: the largest live tensors at the peak."""
from __future__ import annotations

from typing import Any

from ..units import scale


def largest_tensors(rows: list[dict[str, Any]], units: str = "GiB", top: int = 10) -> str:
    """The ``top`` largest live tensors at the peak (a trace report's ``extra["largest_tensors"]``);
    empty when there are none."""
    if not rows:
        return ""
    div, label = scale(units)
    lines = [f"largest live tensors at the peak ({label})"]
    for row in rows[:top]:
        shape = "x".join(str(x) for x in row["shape"])
        lines.append(f"  {row['block'] / div:9.3f}  {row['category']:16s} {row['dtype']:9s} {shape:22s} "
                     f"{row['module'][:40]:40s} {row['op']}")
    return "\n".join(lines)
