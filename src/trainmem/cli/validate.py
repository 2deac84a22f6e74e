"""`trainmem validate`: accuracy of the predictors against every fixture under validation/."""
from __future__ import annotations

import argparse
from typing import Any

from .output import print_json


def cmd_validate(a: argparse.Namespace) -> int:
    """Check every fixture; print the checks and the accuracy per framework and source, or JSON."""
    from ..validate import render, to_dict, validate
    which = [w.strip() for w in a.predictors.split(",") if w.strip()] if a.predictors else None
    cases = [c.strip() for c in a.cases.split(",") if c.strip()] if a.cases else None
    result = validate(a.dir, which, cases)
    if a.json:
        print_json(to_dict(result))
    else:
        print(render(result))
    return 0


def register(sub: Any) -> None:
    """Add ``validate`` to the ``trainmem`` command line."""
    p = sub.add_parser("validate", help="accuracy of estimate (and trace) against measured fixtures",
                       description="Run estimate (and trace) on every fixture under DIR and print each case's "
                                   "error and, per framework and per source, the median and 90th percentile "
                                   "of |error| and the count within 5%. Fixtures a predictor cannot run are "
                                   "listed as 'not run' with the reason.")
    p.add_argument("dir", nargs="?", default="validation", help="fixture directory (default: validation)")
    p.add_argument("--predictors", default="estimate", help="comma list: estimate,trace (default: estimate)")
    p.add_argument("--cases", default=None,
                   help="comma list: only fixtures whose file or case name contains one of these strings")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)
