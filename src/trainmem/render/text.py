"""Text layout shared by the renderers: every line fits the terminal's width (:func:`width`, read
when a table is rendered; free text wraps with its continuation lines indented; a table drops or
shortens its widest free-text column unless the caller asks for everything), and columns are as
wide as their widest cell."""
from __future__ import annotations

import os
import shutil
import sys
import textwrap
from typing import Sequence

PIPED = 100  # the width of output that goes to a pipe or a file (scripts and docs see the same lines)
FLOOR = 72   # narrower terminals get lines of this width (wrapped by the terminal) rather than garbled tables
CAP = 160    # wider terminals get lines of at most this width (longer table rows read badly)
INDENT = "  "


def width() -> int:
    """The width every table and message fits, read now (not at import: ``COLUMNS`` set by a user
    or a test afterwards counts). On a terminal, or wherever ``COLUMNS`` is set: the terminal's
    columns (Python's ``shutil.get_terminal_size``: ``COLUMNS`` first, then the size of
    ``sys.__stdout__``'s terminal, else 100), kept within [``FLOOR``, ``CAP``]. Output piped to
    another program or a file (stdout not a terminal) without ``COLUMNS``: ``PIPED`` (100)."""
    if "COLUMNS" not in os.environ and not _isatty():
        return PIPED
    return max(FLOOR, min(CAP, shutil.get_terminal_size(fallback=(PIPED, 24)).columns))


def _isatty() -> bool:
    try:
        return bool(sys.stdout.isatty())
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


def wrap(text: str, width: int | None = None, indent: str = INDENT) -> list[str]:
    """``text`` as lines of at most ``width`` characters (default: :func:`width`), words kept whole
    where they fit, the continuation lines indented by ``indent`` (Python's ``textwrap``)."""
    width = _resolve(width)
    if len(text) <= width:
        return [text]
    lead = text[:len(text) - len(text.lstrip())]
    return textwrap.wrap(text, width=width, subsequent_indent=lead + indent, break_long_words=True,
                         break_on_hyphens=False) or [text]


def _resolve(w: int | None) -> int:
    """``w``, or the terminal's width (:func:`width`) when None."""
    return width() if w is None else w


def wrap_parts(parts: Sequence[str], sep: str = " · ", width: int | None = None,
               indent: str = INDENT) -> list[str]:
    """Join ``parts`` with ``sep`` into lines of at most ``width`` characters, breaking only between
    parts (a line that breaks ends with the separator's mark, the next starts indented); a part
    longer than a line is wrapped by :func:`wrap`; ``width`` by default :func:`width`."""
    width = _resolve(width)
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


def free_width(fixed: int, widest: int, minimum: int = 12, width: int | None = None) -> int:
    """How wide a free-text column may be so that a row of ``fixed`` other characters fits ``width``
    (never below ``minimum``, never wider than its widest cell ``widest``; ``width`` by default
    :func:`width`)."""
    return max(minimum, min(widest, _resolve(width) - fixed))


def fit_columns(heads: Sequence[str], rows: Sequence[Sequence[str]], width: int | None = None, left: int = 1,
                shrink: int | None = None, shrink_min: int = 12, optional: Sequence[int] = ()) -> list[str]:
    """A table of ``rows`` under ``heads``, each column as wide as its widest cell, one space apart;
    the first ``left`` columns left-aligned (names), the rest right-aligned (numbers keep their
    width). Where the row passes ``width`` (default :func:`width`): the free-text column ``shrink``
    narrows (its cells shortened, their head kept) down to ``shrink_min``, then the ``optional``
    columns are left out in the order given (a last line names them: ``--json`` has them), then
    ``shrink`` narrows further, to 4."""
    w = _resolve(width)
    n = len(heads)
    widths = [max([len(heads[k])] + [len(r[k]) for r in rows]) for k in range(n)]
    keep = list(range(n))

    def others() -> int:  # the kept columns but ``shrink``, and every separator
        return sum(widths[k] for k in keep if k != shrink) + len(keep) - 1

    floor = 0 if shrink is None else min(widths[shrink], shrink_min)
    for k in optional:
        if others() + floor <= w:
            break
        keep.remove(k)
    if shrink is not None:
        widths[shrink] = max(min(widths[shrink], 4), min(widths[shrink], w - others()))

    def line(cells: Sequence[str]) -> str:
        out = [shorten(cells[k], widths[k], keep="start") if k == shrink else cells[k] for k in keep]
        return " ".join(f"{c:{widths[k]}s}" if k < left else f"{c:>{widths[k]}s}" for c, k in zip(out, keep)).rstrip()

    lines = [line(heads)] + [line(r) for r in rows]
    left_out = [heads[k] for k in range(n) if k not in keep]
    if left_out:
        lines += wrap(f"({', '.join(left_out)} left out on this narrow terminal: --json has them)", w)
    return lines
