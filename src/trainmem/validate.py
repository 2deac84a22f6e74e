"""Accuracy of trainmem's predictions against measured runs (fixtures under ``validation/``).

A fixture is a JSON file: ``model`` (+ optional ``overrides``), ``setup`` (estimate options),
``source`` (where the numbers come from) and ``measured``: a list of quantities, each with its value
in ``bytes``, ``mib`` or ``gib``. A quantity is ``peak_allocated``, ``peak_reserved``,
``device_used`` or ``phase:NAME@STEP:FIELD`` (FIELD = allocated | peak | reserved).
Measured runs of our own (``validation/measured/``) also carry GPU, driver, CUDA, torch and
transformers versions and the exact command; published ones (``validation/published/``) their
source.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from .errors import TrainmemError
from .report import MemoryReport

UNITS = {"bytes": 1, "mib": 2**20, "gib": 2**30}


@dataclass(frozen=True)
class Check:
    case: str
    predictor: str
    quantity: str
    measured: int
    predicted: int | None

    @property
    def error(self) -> float | None:
        """Relative error (predicted - measured) / measured; None without a prediction or a measurement."""
        if self.predicted is None or self.measured == 0:
            return None
        return (self.predicted - self.measured) / self.measured


def load_fixtures(root: str) -> list[dict[str, Any]]:
    """Every ``*.json`` fixture under ``root`` (recursively), each with its path."""
    if not os.path.isdir(root):
        raise TrainmemError(f"no validation directory {root!r}: run from the repository root or pass DIR")
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            try:
                fx = json.load(f)
            except json.JSONDecodeError as e:
                raise TrainmemError(f"malformed fixture {path}: {e.msg} at line {e.lineno}") from None
        for key in ("model", "setup", "measured"):
            if key not in fx:
                raise TrainmemError(f"fixture {path} lacks {key!r}")
        fx["_path"] = path
        out.append(fx)
    return out


def _value(item: dict[str, Any]) -> int:
    """A measured quantity's value in bytes, from its bytes, mib or gib field."""
    for unit, factor in UNITS.items():
        if unit in item:
            return int(round(item[unit] * factor))
    raise TrainmemError(f"measured quantity {item.get('quantity')!r} has no bytes/mib/gib value")


def quantity(report: MemoryReport, q: str) -> int | None:
    """The value a report gives for a fixture quantity (None where the report lacks it)."""
    if q in ("peak_allocated", "peak_reserved", "device_used"):
        return getattr(report, q)
    if q.startswith("phase:"):
        _, what, field = q.split(":")
        name, step = what.rsplit("@", 1)
        try:
            return getattr(report.phase(name, int(step)), field)
        except KeyError:
            return None
    raise TrainmemError(f"unknown fixture quantity {q!r}")


def predictors() -> dict[str, Callable[..., MemoryReport]]:
    """The predictors to validate: estimate always, trace when its API is importable."""
    from .estimate.api import estimate
    out: dict[str, Callable[..., MemoryReport]] = {"estimate": estimate}
    try:
        from .trace.api import trace  # noqa: F401
        out["trace"] = trace
    except ImportError:
        pass
    return out


def run(root: str = "validation", which: list[str] | None = None) -> list[Check]:
    """Predict every fixture with each predictor and pair it with the measured values."""
    preds = predictors()
    if which:
        unknown = [w for w in which if w not in preds]
        if unknown:
            raise TrainmemError(f"unknown or unavailable predictor(s): {', '.join(unknown)} "
                                f"(available: {', '.join(preds)})")
        preds = {k: v for k, v in preds.items() if k in which}
    checks: list[Check] = []
    skipped.clear()
    for fx in load_fixtures(root):
        for pname, fn in preds.items():
            opts = dict(fx["setup"])
            if fx.get("overrides"):
                opts["set"] = fx["overrides"]  # every predictor takes the API's options (trainmem.spec.resolve)
            try:
                report = fn(fx["model"], **opts)
            except TrainmemError as e:  # a predictor that cannot run this case (e.g. trace of nanoGPT)
                skipped.append(f"{pname} skipped {fx.get('name', fx['_path'])}: {e}")
                continue
            for item in fx["measured"]:
                checks.append(Check(fx.get("name", fx["_path"]), pname, item["quantity"], _value(item),
                                    quantity(report, item["quantity"])))
    return checks


skipped: list[str] = []  # why a predictor did not run a fixture, from the last run()


def summary(checks: list[Check]) -> dict[str, dict[str, float]]:
    """Median and max absolute relative error per predictor (quantities the predictor gives)."""
    out: dict[str, dict[str, float]] = {}
    for p in sorted({c.predictor for c in checks}):
        errs = [abs(c.error) for c in checks if c.predictor == p and c.error is not None]
        if errs:
            out[p] = {"n": len(errs), "median": statistics.median(errs), "max": max(errs)}
    return out


def render(checks: list[Check]) -> str:
    """A plain-text table of every check, the skipped predictors and the summary per predictor."""
    lines = [f"{'case':52s} {'predictor':9s} {'quantity':34s} {'measured MiB':>13s} {'predicted MiB':>13s} {'error':>8s}"]
    for c in checks:
        pred = "-" if c.predicted is None else f"{c.predicted / 2**20:13.2f}"
        err = "-" if c.error is None else f"{100 * c.error:+7.2f}%"
        lines.append(f"{c.case[:52]:52s} {c.predictor:9s} {c.quantity[:34]:34s} {c.measured / 2**20:13.2f} {pred:>13s} {err:>8s}")
    lines.append("")
    lines.extend(skipped)
    for p, s in summary(checks).items():
        lines.append(f"{p}: {int(s['n'])} quantities, median |error| {100 * s['median']:.3f}%, max {100 * s['max']:.3f}%")
    return "\n".join(lines)
