"""`trainmem validate`: accuracy of the predictors against every fixture under validation/."""
from __future__ import annotations

import argparse
import math
from typing import Any

from .options import device_choice, positive_int
from .output import print_json, say


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
    Exit 1 when nothing was checked or a check exceeds --tolerance, else 0. With --campaign: run
    the campaign's measurements instead; with --fixtures-from: turn results into fixtures."""
    if a.campaign:
        return _campaign(a)
    if a.fixtures_from:
        return _fixtures(a.fixtures_from, a.into, a.json)
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
        say(f"\n{'FAIL' if code else 'OK'}: {why}")
    return code


def _default_results(campaign: str) -> str:
    """validation/measured/<campaign file's name>.jsonl in the repository."""
    import os
    from ..validate import default_root
    stem = os.path.splitext(os.path.basename(campaign))[0]
    return os.path.join(default_root(), "measured", stem + ".jsonl")


def _run_line(i: int, n: int, rec: dict[str, Any]) -> None:
    """One line on stderr per finished run: where, which, how it ended, its peak and wall time."""
    import sys
    peak = rec.get("peak_allocated")
    what = f"peak allocated {peak / 2**20:,.1f} MiB" if isinstance(peak, int) else (rec.get("message") or "")[:60]
    sys.stderr.write(f"[{i}/{n}] {rec['id']}: {rec['status']}, {what} ({rec.get('wall_s', 0):.1f} s)\n")
    sys.stderr.flush()


def _campaign(a: argparse.Namespace) -> int:
    """Run a campaign until it is done or its budget is spent; write fixtures of what finished."""
    import os
    from ..measure.campaign import fixtures_from_results, read_results, run_campaign, summarize
    if a.dry_run:
        return _dry_run(a)
    results = a.results or _default_results(a.campaign)
    if a.results is None:  # the repository's validation/measured/ (git keeps no empty folder)
        os.makedirs(os.path.dirname(results), exist_ok=True)
    prog = run_campaign(a.campaign, results, budget_s=a.budget_s, run_timeout=a.run_timeout, device=a.device,
                        limit=a.limit, on_run=_run_line)
    records = read_results(results)
    d = dict(prog.to_dict(), results=results, statuses=summarize(records))
    if a.into and any(r.get("status") == "ok" for r in records):
        d["fixtures"] = len(fixtures_from_results(results, a.into, prog.name))
    if a.json:
        print_json(d)
    else:
        how = ("stopped at the time budget: run the same command again to resume" if prog.stopped_by_budget
               else "every run done" if not prog.left else f"stopped after {len(prog.ran)} run(s) (--limit)")
        say(f"campaign {prog.name}: {len(prog.ran)} run(s) now, {prog.done_before + len(prog.ran)}/{prog.total} "
            f"done, {prog.left} left; {how}")
        say(f"results: {results} ({', '.join(f'{k} {v}' for k, v in d['statuses'].items())})")
        if "fixtures" in d:
            say(f"fixtures: {d['fixtures']} written to {a.into}")
    return 0


def _dry_run(a: argparse.Namespace) -> int:
    """List the campaign's runs in order, each checked as measure would check it; exit 2 when one
    would be refused (one line each on stderr)."""
    import sys
    from ..measure.campaign import check_run, load_campaign, read_results
    name, runs = load_campaign(a.campaign, a.device)
    done = {r["id"] for r in read_results(a.results or _default_results(a.campaign))}
    bad = 0
    rows = []
    for i, run in enumerate(runs, 1):
        why = check_run(run)
        bad += why is not None
        rows.append({"n": i, "id": run.id, "done": run.id in done, "refused": why, "command": run.command()})
        if why:
            sys.stderr.write(f"trainmem: run {run.id} would be refused: {why}\n")
    if a.json:
        print_json({"campaign": name, "runs": rows})
    else:
        from ..render.text import shorten, width
        for r in rows:  # the id shortened (its head kept) to the terminal's width
            print(f"{r['n']:3d} {'done' if r['done'] else 'todo'} {shorten(r['id'], width() - 9, keep='start')}")
        say(f"campaign {name}: {len(runs)} runs, {sum(r['done'] for r in rows)} done, {bad} would be refused")
    return 2 if bad else 0


def _fixtures(results: str, into: str | None, as_json: bool) -> int:
    """Turn a campaign's results into fixtures."""
    import os
    from ..measure.campaign import fixtures_from_results
    from ..validate import default_root
    into = into or os.path.join(default_root(), "measured")
    paths = fixtures_from_results(results, into)
    if as_json:
        print_json({"results": results, "into": into, "fixtures": paths})
    else:
        say(f"{len(paths)} fixture(s) written to {into}")
    return 0


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds")
    return v


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
    c = p.add_argument_group("measuring a campaign (make gpu-validate)")
    c.add_argument("--campaign", default=None, metavar="FILE",
                   help="run the real training runs of a campaign file, one subprocess each, appending each "
                        "finished run to --results; resumes where a previous call stopped")
    c.add_argument("--results", default=None, metavar="FILE.jsonl",
                   help="the campaign's results (default: validation/measured/<campaign name>.jsonl)")
    c.add_argument("--budget-s", type=_positive, default=540.0, metavar="S",
                   help="stop cleanly before S seconds have passed (default 540)")
    c.add_argument("--run-timeout", type=_positive, default=120.0, metavar="S",
                   help="a run that takes longer is killed and recorded as timeout (default 120)")
    c.add_argument("--device", type=device_choice, default=None,
                   help="run on this device instead of the campaign's (cuda, cuda:N, cpu)")
    c.add_argument("--dry-run", action="store_true",
                   help="list the campaign's runs in order and check each as measure would, running nothing")
    c.add_argument("--limit", type=positive_int, default=None, metavar="N", help="run at most N runs in this call")
    c.add_argument("--fixtures-from", default=None, metavar="FILE.jsonl",
                   help="write one fixture per finished run of a campaign's results (to --into)")
    c.add_argument("--into", default=None, metavar="DIR",
                   help="the fixtures' folder (default for --fixtures-from: validation/measured/; with --campaign "
                        "fixtures are written only when --into is given)")
    p.set_defaults(func=cmd_validate)
