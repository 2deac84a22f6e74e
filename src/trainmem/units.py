"""Byte amounts: parsing ("40GiB", "80 GB") and labelled rendering (binary by default)."""
from __future__ import annotations

import re

from .errors import TrainmemError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12

_FACTORS = {
    "b": 1, "": 1,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,  # bare letters: binary, as nvidia-smi and torch mean them
}
UNIT_SYSTEMS = ("GiB", "GB")


def parse_bytes(text: str | int | float) -> int:
    """Parse a size such as ``40GiB``, ``80 GB``, ``512MiB`` or a plain byte count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _FACTORS:
            raise TrainmemError(
                f"cannot read the size {text!r}: write a number with a unit, e.g. 40GiB, 80GB or 512MiB")
        value = int(round(float(m.group(1)) * _FACTORS[m.group(2).lower()]))
    if value < 0:
        raise TrainmemError(f"size {text!r} is negative: sizes must be zero or more bytes")
    return value


def scale(units: str) -> tuple[int, str]:
    """The divisor and label for a unit system: ``GiB`` (2**30, default) or ``GB`` (10**9)."""
    if units == "GiB":
        return GiB, "GiB"
    if units == "GB":
        return GB, "GB"
    raise TrainmemError(f"unknown units {units!r}: choose GiB or GB")


def fmt(n: int | None, units: str = "GiB", digits: int = 2) -> str:
    """Render a byte count in the chosen unit system with its label, e.g. ``21.90 GiB``."""
    if n is None:
        return "-"
    div, label = scale(units)
    return f"{n / div:,.{digits}f} {label}"
