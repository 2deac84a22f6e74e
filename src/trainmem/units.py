"""Byte amounts: parsing ("40GiB", "80 GB") and labelled rendering (binary by default)."""
from __future__ import annotations

import math
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


_SIZE = re.compile(r"\s*([+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|nan|inf(?:inity)?))\s*([A-Za-z]*)\s*",
                   re.IGNORECASE)
MAX_BYTES = 1 << 64  # no device or host holds 16 EiB: anything larger is a typo (or 1e400)


def parse_bytes(text: str | int | float, what: str = "size", bare_unit: int = GiB) -> int:
    """Bytes of a size such as ``40GiB``, ``80 GB`` or ``512MiB`` (``what`` names the input in errors).

    A Python int or float is a byte count. A string without a unit (``"40"``) is read as
    ``bare_unit``, GiB by default, so ``--gpu-memory 40`` means 40 GiB, not 40 bytes; callers say so
    when :func:`is_bare_number` is true. Negative, non-finite (``nan``, ``inf``, ``1e400``) and
    absurd sizes (over 2**64 B) raise one-line TrainmemErrors."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TrainmemError(f"{what} {text!r}: write a number with a unit, e.g. 40GiB, 80GB or 512MiB")
    if isinstance(text, (int, float)):
        number, factor = float(text) if isinstance(text, float) else text, 1
    else:
        m = _SIZE.fullmatch(text)
        if not m or m.group(2).lower() not in _FACTORS:
            raise TrainmemError(f"cannot read the {what} {text!r}: write a number with a unit, e.g. 40GiB, "
                                f"80GB or 512MiB")
        number, factor = float(m.group(1)), (_FACTORS[m.group(2).lower()] if m.group(2) else bare_unit)
    if isinstance(number, float) and not math.isfinite(number):
        raise TrainmemError(f"{what} {text!r} is not a finite number: write a size such as 40GiB")
    if number < 0:
        raise TrainmemError(f"{what} {text!r} is negative: sizes must be zero or more bytes")
    value = int(round(number * factor)) if isinstance(number, float) else number * factor
    if value > MAX_BYTES:
        raise TrainmemError(f"{what} {text!r} is too large ({value:.3g} B, more than 2**64): check the unit")
    return value


def is_bare_number(text: object) -> bool:
    """True for a size string without a unit (``"40"``, ``" 1.5 "``), which :func:`parse_bytes` reads as GiB."""
    if not isinstance(text, str):
        return False
    m = _SIZE.fullmatch(text)
    return bool(m) and not m.group(2)


# Fixed units a table can be printed in (``--units``), and ``auto``: the unit chosen from the amount
# shown (binary: KiB below a MiB, MiB below a GiB, GiB below a TiB, else TiB).
UNITS = {"KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "KB": KB, "MB": MB, "GB": GB, "TB": TB}
UNIT_CHOICES = ("auto",) + tuple(UNITS)
_AUTO_LADDER = (("KiB", MiB), ("MiB", GiB), ("GiB", TiB), ("TiB", None))


def canonical_units(text: str) -> str:
    """The canonical spelling of a ``--units`` value (``gib`` -> ``GiB``, ``Auto`` -> ``auto``);
    TrainmemError naming the choices for anything else."""
    for name in UNIT_CHOICES:
        if str(text).strip().lower() == name.lower():
            return name
    raise TrainmemError(f"unknown units {text!r}: choose one of {', '.join(UNIT_CHOICES)}")


def pick_unit(units: str, largest: int | float | None = None) -> str:
    """The concrete unit a table is printed in: ``units`` itself when fixed; for ``auto`` the binary
    unit in which ``largest`` (the biggest amount the table shows, e.g. its peak) is at least 1 and
    below 1024 (KiB below a MiB, MiB below a GiB, GiB below a TiB, else TiB; GiB when unknown)."""
    units = canonical_units(units)
    if units != "auto":
        return units
    if not largest:  # unknown or nothing: the usual unit
        return "GiB"
    for name, below in _AUTO_LADDER:
        if below is None or abs(largest) < below:
            return name
    return "TiB"  # pragma: no cover - the ladder ends with TiB


def scale(units: str, largest: int | float | None = None) -> tuple[int, str]:
    """The divisor and label for a unit: ``GiB`` (2**30), ``GB`` (10**9), ``MiB``, ``MB``, ``TiB``,
    ``TB``, ``KiB``, ``KB``, or ``auto`` (chosen from ``largest`` by :func:`pick_unit`)."""
    label = pick_unit(units, largest)
    return UNITS[label], label


def number(n: int | float, div: int, digits: int = 2) -> str:
    """``n / div`` with ``digits`` decimals and thousands separators; a non-zero amount that would
    round to zero prints as ``<0.01`` (``>-0.01``) so that no non-zero row reads as nothing."""
    v = n / div
    text = f"{v:,.{digits}f}"
    if n and float(text.replace(",", "")) == 0:
        return ("<" if v > 0 else ">-") + f"{10 ** -digits:.{digits}f}"
    return text


def fmt(n: int | None, units: str = "GiB", digits: int = 2) -> str:
    """Render a byte count in the chosen unit with its label, e.g. ``21.90 GiB``; ``auto`` picks the
    unit from ``n`` itself (``512.00 MiB``, ``1.50 GiB``)."""
    if n is None:
        return "-"
    div, label = scale(units, n)
    return f"{number(n, div, digits)} {label}"


def fmt_count(n: int | float) -> str:
    """A count with a K/M/B/T suffix (powers of 1000, as parameter counts are quoted): ``1.23K``,
    ``124.4M``, ``8.03B``; 2 decimals below 10, 1 below 1000; counts under 1000 as they are."""
    if abs(n) < 1000:
        return f"{n:g}" if isinstance(n, float) else str(n)
    for suffix, div in (("K", 10**3), ("M", 10**6), ("B", 10**9), ("T", 10**12)):
        v = n / div
        text = f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
        if float(text) < 1000 or suffix == "T":
            return text + suffix
    return str(n)  # pragma: no cover
