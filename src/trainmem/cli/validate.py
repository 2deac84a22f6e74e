"""`trainmem validate`: accuracy of the predictors against every fixture under validation/."""
from __future__ import annotations

import argparse
from typing import Any

from .output import print_json


def cmd_validate(a: argparse.Namespace) -> int:
    """Check every fixture; print the checks as a table or JSON."""
    from ..validate import render, run, summary
    which = [w.strip() for w in a.predictors.split(",")] if a.predictors else None
    checks = run(a.dir, which)
    if a.json:
        print_json({"checks": [dict(case=c.case, predictor=c.predictor, quantity=c.quantity, measured=c.measured,
                                    predicted=c.predicted, error=c.error) for c in checks],
                    "summary": summary(checks)})
    else:
        print(render(checks))
    return 0


def register(sub: Any) -> None:
    """Add ``validate`` to the ``trainmem`` command line."""
    p = sub.add_parser("validate", help="accuracy of estimate (and trace) against measured fixtures")
    p.add_argument("dir", nargs="?", default="validation", help="fixture directory (default: validation)")
    p.add_argument("--predictors", default="estimate", help="comma list: estimate,trace")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)
