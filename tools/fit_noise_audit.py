"""Audit: does the estimate jump when a derived architecture's fitted coefficients carry float noise?

A derived architecture's coefficients (``trainmem.estimate.derived``) are least-squares fits of traced
points (``trainmem.trace.derive``): 8195.99999999 where the traced bytes per token are 8196, and the
noise differs between machines and caches. A sound estimate moves by about as much as the noise (a
byte); a comparison of sizes computed from fitted floats (``==`` between sizes, ``int()`` at a
boundary, ``rest < 0``) makes it jump instead. This script perturbs every float of every derived
coefficient set as the engine receives it from storage or a derivation (``Hook``: ``derived.read_cached``
and ``trace.derive.derive_coefficients`` wrapped), in each of four ways, separately:

* ``rel+`` / ``rel-``: x * (1 + 1e-9) / x * (1 - 1e-9);
* ``abs+`` / ``abs-``: x + 1e-6 / x - 1e-6 on the floats within 1e-3 of an integer;

and re-runs the estimate (peak allocated, and reserved: ``engine.estimate(m, t, reserved=True)``) on
(a) the agreement grid's stored rows of the derived family (``benchmarks/bench_agreement.py``'s
``stored_rows`` of ``docs/agreement_grid.json``; ``--grid-only``) and (b) the validation fixtures
under ``validation/published`` and ``validation/measured`` whose estimate reads derived coefficients
(``--fixtures-only``). A row whose peak moves by more than ``--tolerance`` (default 0.1 %) under a
perturbation is printed: each is a discontinuity.

Run from the repository root (coefficients not shipped are derived, seconds each, into a fresh
cache unless ``TRAINMEM_CACHE`` is set; perturbed sets are never written, the wrapper copies them):

    PYTHONPATH=src .venv/bin/python tools/fit_noise_audit.py [--grid-only | --fixtures-only] [--json OUT]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
MODES = ("rel+", "rel-", "abs+", "abs-")


def perturb(doc: Any, mode: str) -> Any:
    """A copy of ``doc`` with every float (not bools, not ints) moved as ``mode`` says (``MODES``)."""
    if isinstance(doc, dict):
        return {k: perturb(v, mode) for k, v in doc.items()}
    if isinstance(doc, list):
        return [perturb(v, mode) for v in doc]
    if isinstance(doc, tuple):
        return tuple(perturb(v, mode) for v in doc)
    if not isinstance(doc, float):
        return doc
    if mode in ("rel+", "rel-"):
        return doc * (1 + (1e-9 if mode == "rel+" else -1e-9))
    if abs(doc - round(doc)) <= 1e-3:
        return doc + (1e-6 if mode == "abs+" else -1e-6)
    return doc


class Hook:
    """Perturbs (``mode``; None: not) every derived coefficient set where the engine receives it: as
    ``derived._stored`` reads it (``derived.read_cached``: shipped or from the user cache) and as
    ``trace.derive.derive_coefficients`` returns it; ``touched`` counts the sets handed out."""

    def __init__(self) -> None:
        from trainmem.estimate import derived
        self.derived, self.mode, self.touched = derived, None, 0
        derived.read_cached = self._wrap(derived.read_cached)
        try:
            from trainmem.trace import derive
        except ImportError:  # (no torch: the shipped and cached sets alone)
            return
        derive.derive_coefficients = self._wrap(derive.derive_coefficients)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kw: Any) -> Any:
            self.touched += 1
            doc = fn(*args, **kw)
            return doc if self.mode is None or doc is None else perturb(doc, self.mode)
        return wrapped

    def set(self, mode: str | None) -> None:
        """Perturb by ``mode`` from now on, the engine's memos of earlier sets forgotten."""
        from trainmem.estimate import engine
        from trainmem.estimate.quantities.build import clear_cache
        self.mode = mode
        clear_cache()
        engine.forget_replays()
        for memo in (self.derived._coefficients, self.derived._at_point):
            memo.cache_clear()
        self.derived._AT_RATIO.clear()


def grid_cases() -> dict[str, Callable[[], tuple[int, int]]]:
    """The derived family's stored agreement-grid rows: name -> () -> (peak reserved, peak allocated)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_agreement import stored_rows
    from trainmem.estimate.engine import estimate
    out = {}
    for name, r in stored_rows(ROOT / "docs" / "agreement_grid.json").items():
        m, t = r.setup.specs()
        if m.family != "derived":
            continue

        def run(m=m, t=t) -> tuple[int, int]:
            e = estimate(m, t, reserved=True)
            return e.peak_reserved, e.peak_allocated
        out["grid " + name] = run
    return out


def fixture_cases(hook: Hook) -> dict[str, Callable[[], tuple[int, ...]]]:
    """The validation fixtures whose estimate reads derived coefficients: name -> () -> each measured
    quantity's predicted bytes (``validate.predicted_value``), in the fixture's order."""
    from trainmem import validate as v
    from trainmem.estimate.api import estimate
    out = {}
    for folder in ("published", "measured"):
        for fx in v.load_fixtures(str(ROOT / "validation" / folder)):
            def run(fx=fx) -> tuple[int, ...]:
                rep = v._predict(estimate, fx)
                return tuple(v.predicted_value(rep, item) or 0 for item in fx["measured"])
            hook.set(None)  # (the memos forgotten: a set read before is read again)
            before = hook.touched
            try:
                run()
            except Exception:  # a fixture the estimate refuses is no check (``validate`` lists it apart)
                continue
            if hook.touched > before:
                out[f"{folder} {os.path.basename(fx['_path'])}"] = run
    return out


def audit(cases: dict[str, Callable[[], tuple[int, ...]]], hook: Hook, tolerance: float) -> dict[str, Any]:
    """Each case's values unperturbed and under each mode; the moves beyond ``tolerance`` (relative)."""
    hook.set(None)
    base = {name: run() for name, run in cases.items()}
    moves = []
    for mode in MODES:
        hook.set(mode)
        for name, run in cases.items():
            got = run()
            for i, (x, y) in enumerate(zip(base[name], got)):
                rel = (y - x) / x if x else float(y != 0)
                if abs(rel) > tolerance:
                    moves.append({"case": name, "mode": mode, "value": i, "base": x, "perturbed": y, "rel": rel})
    hook.set(None)
    return {"cases": len(cases), "base": base, "moves": moves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid-only", action="store_true")
    ap.add_argument("--fixtures-only", action="store_true")
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--json", help="write the cases' values and the moves to this file")
    a = ap.parse_args()
    os.environ.setdefault("TRAINMEM_CACHE", tempfile.mkdtemp(prefix="trainmem-noise-"))
    hook = Hook()
    cases: dict[str, Callable[[], tuple[int, ...]]] = {}
    if not a.fixtures_only:
        cases.update(grid_cases())
    if not a.grid_only:
        cases.update(fixture_cases(hook))
    res = audit(cases, hook, a.tolerance)
    moved = sorted({mv["case"] for mv in res["moves"]})
    print(f"{res['cases']} cases, {len(moved)} moved beyond {a.tolerance:.2%} under a perturbation")
    for mv in sorted(res["moves"], key=lambda mv: -abs(mv["rel"])):
        what = ("reserved", "allocated")[mv["value"]] if mv["case"].startswith("grid ") else f"quantity {mv['value']}"
        print(f"  {mv['rel']:+8.3%}  {mv['mode']:4}  {what:10}  {mv['case']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
