"""Text layout shared by the renderers: every line fits a terminal of ``WIDTH`` columns (free text
wraps with its continuation lines indented; a table drops or shortens its widest free-text column
unless the caller asks for everything), and columns are as wide as their widest cell."""
from __future__ import annotations

import textwrap
from typing import Sequence

WIDTH = 100  # the terminal width every table and message fits (a common minimum; issue 14)
INDENT = "  "


def wrap(text: str, width: int = WIDTH, indent: str = INDENT) -> list[str]:
    """``text`` as lines of at most ``width`` characters, words kept whole where they fit, the
    continuation lines indented by ``indent`` (Python's ``textwrap``)."""
    if len(text) <= width:
        return [text]
    lead = text[:len(text) - len(text.lstrip())]
    return textwrap.wrap(text, width=width, subsequent_indent=lead + indent, break_long_words=True,
                         break_on_hyphens=False) or [text]


def wrap_parts(parts: Sequence[str], sep: str = " · ", width: int = WIDTH, indent: str = INDENT) -> list[str]:
    """Join ``parts`` with ``sep`` into lines of at most ``width`` characters, breaking only between
    parts (a line that breaks ends with the separator's mark, the next starts indented); a part
    longer than a line is wrapped by :func:`wrap`."""
    lines: list[str] = []
    cur = ""
    for p in parts:
        if not p:
            continue
        if not cur:
            cur = (indent if lines else "") + p
        elif len(cur) + len(sep) + len(p) + len(sep.rstrip()) <= width:  # room left for the break's mark
            cur += sep + p
        else:
            lines.append(cur + sep.rstrip())
            cur = indent + p
    if cur:
        lines.append(cur)
    out: list[str] = []
    for ln in lines:
        out += wrap(ln, width, indent)
    return out


def shorten(text: str, width: int, keep: str = "end") -> str:
    """``text`` cut to ``width`` characters with an ellipsis: ``keep="end"`` keeps its tail (module
    paths: the last names say most), ``"start"`` its head."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    return "…" + text[len(text) - width + 1:] if keep == "end" else text[:width - 1] + "…"


def free_width(fixed: int, widest: int, minimum: int = 12, width: int = WIDTH) -> int:
    """How wide a free-text column may be so that a row of ``fixed`` other characters fits ``width``
    (never below ``minimum``, never wider than its widest cell ``widest``)."""
    return max(minimum, min(widest, width - fixed))
