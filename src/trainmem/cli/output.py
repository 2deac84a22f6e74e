"""Printing a report: a table (with suggestions when it does not fit) or JSON, and the exit code."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any


def emit(report: Any, a: argparse.Namespace) -> int:
    """Print ``report`` as --json or --units/--detail ask; the exit code (:func:`exit_code`)."""
    from ..render.table import render_report
    pointless = warn_pointless(report.training)
    if a.json:
        d = report.to_dict()
        if report.method == "trainmem" and report.capacity is not None:  # what would make it fit (none when it fits)
            d["suggestions"] = [s.to_dict() for s in _suggestions(report)]
        print(json.dumps(d, indent=2))
    else:
        shown = dataclasses.replace(report, warnings=[w for w in report.warnings if w not in pointless]
                                    + report.verdict_warnings())
        print(render_report(shown, a.units, a.detail))
        if report.fits is False and report.method == "trainmem":
            from ..render.suggestions import format_suggestions
            print()
            print(format_suggestions(_suggestions(report), a.units, detail=a.detail))
    return exit_code(report)


def warn_pointless(training: Any) -> list[str]:
    """Print each legal but pointless choice of ``training`` (``spec.training.setup_warnings``) as one
    ``trainmem: warning:`` line on stderr; the lines printed (the JSON report keeps them too)."""
    if training is None:
        return []
    from ..spec.training import setup_warnings
    lines = setup_warnings(training)
    for w in lines:
        sys.stderr.write(f"trainmem: warning: {w}\n")
    return lines


def _suggestions(report: Any) -> list[Any]:
    """``plan.suggest_for_report`` when the report does not fit its GPU, else none."""
    if report.fits is not False:
        return []
    from ..plan import suggest_for_report
    return suggest_for_report(report)


def exit_code(report: Any) -> int:
    """The one exit rule of every command that answers for a GPU: 1 when a GPU (``--gpu``,
    ``--gpu-memory``, a measured device) was given and the report does not fit it (within
    ``--max-fraction``), else 0 (fits, or no GPU to judge). Bad input is 2, raised elsewhere."""
    return 1 if report.capacity is not None and report.fits is False else 0


def say(text: str) -> None:
    """Print a free-text line on stdout wrapped to the terminal's width (``render.text.width``), its
    continuation lines indented. (Errors and warnings on stderr stay one line each: scripts read them
    by their ``trainmem: error:`` / ``trainmem: warning:`` prefix.)"""
    from ..render.text import wrap
    lead = text[:len(text) - len(text.lstrip("\n"))]  # a blank line asked for before it
    print(lead + "\n".join(wrap(text[len(lead):])))


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout."""
    print(json.dumps(data, indent=2))
