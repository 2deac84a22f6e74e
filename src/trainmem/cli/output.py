"""Printing a report: a table (with suggestions when it does not fit) or JSON, and the exit code."""
from __future__ import annotations

import argparse
import json
from typing import Any


def emit(report: Any, a: argparse.Namespace) -> int:
    """Print ``report`` as --json or --units/--detail ask; exit code 1 when --max-fraction is
    given and the report does not fit, else 0."""
    from ..render.table import render_report
    if a.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_report(report, a.units, a.detail))
        if report.fits is False and report.method == "trainmem":
            from ..plan import suggest_for_report
            from ..render.suggestions import format_suggestions
            print()
            print(format_suggestions(suggest_for_report(report), a.units))
    if a.max_fraction is not None and report.capacity is not None and not report.fits:
        return 1
    return 0


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout."""
    print(json.dumps(data, indent=2))
