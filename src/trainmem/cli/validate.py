"""`trainmem validate`: accuracy of the predictors against every fixture under validation/."""
from __future__ import annotations

import argparse
import math
from typing import Any

from .output import print_json


def _percent(text: str) -> float:
    """A tolerance in percent ("5" or "5%") as a fraction."""
    t = text.strip().removesuffix("%").strip()
    try:
        v = float(t)
    except ValueError:
        v = float("nan")
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a percentage such as 5 or 2.5%")
    return v / 100


def cmd_validate(a: argparse.Namespace) -> int:
    """Check every fixture; print the checks and the accuracy per framework and source, or JSON.
    Exit 1 when nothing was checked or a check exceeds --tolerance, else 0."""
    from ..validate import exceeding, render, to_dict, validate, verdict
    which = [w.strip() for w in a.predictors.split(",") if w.strip()] if a.predictors else None
    cases = [c.strip() for c in a.cases.split(",") if c.strip()] if a.cases else None
    result = validate(a.dir, which, cases)
    code, why = verdict(result, a.tolerance)
    if a.json:
        over = exceeding(result, a.tolerance) if a.tolerance is not None else []
        print_json(dict(to_dict(result), tolerance=a.tolerance, exceeding=len(over), verdict=why))
    else:
        print(render(result))
        print(f"\n{'FAIL' if code else 'OK'}: {why}")
    return code


def register(sub: Any) -> None:
    """Add ``validate`` to the ``trainmem`` command line."""
    p = sub.add_parser("validate", help="accuracy of estimate (and trace) against measured fixtures",
                       description="Run estimate (and trace) on every fixture under DIR and print each case's "
                                   "error and, per framework and per source, the median and 90th percentile "
                                   "of |error| and the count within 5%. Fixtures a predictor cannot run are "
                                   "listed as 'not run' with the reason.")
    p.add_argument("dir", nargs="?", default=None,
                   help="fixture directory (default: the repository's validation/, from any working directory)")
    p.add_argument("--predictors", default="estimate", help="comma list: estimate,trace (default: estimate)")
    p.add_argument("--cases", default=None,
                   help="comma list: only fixtures whose file or case name contains one of these strings")
    p.add_argument("--tolerance", type=_percent, default=None, metavar="PCT",
                   help="exit 1 when any check's |error| exceeds PCT percent (e.g. 5 or 5%%); it always exits 1 "
                        "when nothing was checked")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)
