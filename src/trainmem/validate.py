"""Accuracy of trainmem's predictions against measured runs (fixtures under ``validation/``).

A fixture is a JSON file: ``model`` (a catalogue name or a config dict, + optional ``overrides``),
``setup`` (estimate options, the API's keyword names) and ``measured``: a list of quantities, each
with its value in ``bytes``, ``mib`` or ``gib``. A quantity is ``peak_allocated``,
``peak_active``, ``peak_reserved``, ``device_used`` or ``phase:NAME@STEP:FIELD`` (FIELD =
allocated | peak | reserved). ``peak_active`` is ``torch.cuda.memory_stats()["active_bytes.all.peak"]``
(torchtune's ``peak_memory_active``), predicted by the allocated peak (:func:`quantity`).
A measured item may carry ``baseline_bytes``: the published figure is the quantity minus a value the
run read before it built anything (PEFT's MetaMathQA benchmark subtracts ``init_accelerator()``'s
2 MiB reservation from every figure), so the prediction is compared after subtracting the same
bytes (:func:`predicted_value`).

Published fixtures (``validation/published/``) also say where the numbers come from: ``source``
(author, title, ``url``, ``where`` in the text), ``framework`` and ``framework_version``, ``gpu``,
``metric`` (what the published number is and which trainmem quantity it maps to) and
``setup_note`` (how the framework's defaults were mapped to trainmem's options). Runs of our own
(``validation/measured/``, written by ``trainmem measure --save-fixture``) carry the GPU, driver,
CUDA, torch and transformers versions and the command instead.

:func:`validate` runs every predictor on every fixture; a fixture a predictor cannot run is listed
as not run, with the reason (never an exception). Each case is scored on its *primary* quantity (its
first peak quantity, else its first quantity); :func:`summary` gives, per predictor, the median and
90th percentile of |error| and the count within 5 %, overall, per framework and per source.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import TrainmemError
from .report import MemoryReport
from .render.text import shorten, width, wrap

UNITS = {"bytes": 1, "mib": 2**20, "gib": 2**30}
PEAKS = ("peak_allocated", "peak_active", "peak_reserved", "device_used")
PHASE_FIELDS = ("allocated", "peak", "reserved")
WITHIN = 0.05  # the "close" band of the summary: |error| <= 5 %
CAMPAIGNS = "campaigns"  # the folder of campaign files under a validation root: not fixtures


@dataclass(frozen=True)
class Check:
    """One measured quantity of one case, and what one predictor says of it."""

    case: str
    predictor: str
    quantity: str
    measured: int
    predicted: int | None
    framework: str = ""
    source: str = ""
    primary: bool = True

    @property
    def error(self) -> float | None:
        """Relative error (predicted - measured) / measured; None without a prediction or a measurement."""
        if self.predicted is None or self.measured == 0:
            return None
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class NotRun:
    """A predictor that could not run a fixture, and why."""

    case: str
    predictor: str
    reason: str


@dataclass
class Validation:
    """The result of :func:`validate`: every check, the runs that did not happen, the fixtures."""

    checks: list[Check] = field(default_factory=list)
    not_run: list[NotRun] = field(default_factory=list)
    fixtures: list[dict[str, Any]] = field(default_factory=list)


def _check_quantity(q: Any, path: str) -> None:
    """Raise a TrainmemError unless ``q`` is a quantity :func:`quantity` knows."""
    if q in PEAKS:
        return
    parts = q.split(":") if isinstance(q, str) else []
    if len(parts) == 3 and parts[0] == "phase" and "@" in parts[1] and parts[2] in PHASE_FIELDS:
        name, step = parts[1].rsplit("@", 1)
        if name and step.isdigit():
            return
    raise TrainmemError(f"fixture {path}: unknown quantity {q!r} (use {', '.join(PEAKS)} or "
                        f"phase:NAME@STEP:allocated|peak|reserved)")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _check_fixture(fx: dict[str, Any], path: str) -> None:
    """The keys every fixture needs, with their types, and measured items with a known quantity
    and a finite non-negative number in bytes, mib or gib."""
    for key in ("model", "setup", "measured"):
        if key not in fx:
            raise TrainmemError(f"fixture {path} lacks {key!r}")
    if not isinstance(fx["model"], (str, dict)) or not fx["model"]:
        raise TrainmemError(f"fixture {path}: 'model' must be a catalogue name, a path or a config object")
    ov = fx.get("overrides")
    if ov is not None and not (isinstance(ov, dict) or (isinstance(ov, list) and all(isinstance(o, str) for o in ov))):
        raise TrainmemError(f"fixture {path}: 'overrides' must be a list of \"key=value\" strings or an object")
    if not isinstance(fx["setup"], dict):
        raise TrainmemError(f"fixture {path}: 'setup' must be an object of estimate options")
    if not isinstance(fx["measured"], list) or not fx["measured"]:
        raise TrainmemError(f"fixture {path}: 'measured' must be a non-empty list")
    for item in fx["measured"]:
        if not isinstance(item, dict) or "quantity" not in item:
            raise TrainmemError(f"fixture {path}: every measured item needs a 'quantity'")
        _check_quantity(item["quantity"], path)
        units = [u for u in UNITS if u in item]
        if not units:
            raise TrainmemError(f"fixture {path}: measured {item['quantity']!r} has no bytes/mib/gib value")
        if not _is_number(item[units[0]]):
            raise TrainmemError(f"fixture {path}: measured {item['quantity']!r}: {units[0]} must be a non-negative "
                                f"number, got {item[units[0]]!r}")
        if "baseline_bytes" in item and not _is_number(item["baseline_bytes"]):
            raise TrainmemError(f"fixture {path}: measured {item['quantity']!r}: baseline_bytes must be a "
                                f"non-negative number of bytes, got {item['baseline_bytes']!r}")


def default_root() -> str:
    """The repository's ``validation/`` folder, found from this file (``src/trainmem/validate.py``
    -> ``validation/``), not from the working directory."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "validation")


def _read_fixture(path: str) -> Any:
    """The JSON of one fixture file; a one-line TrainmemError naming the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TrainmemError(f"malformed fixture {path}: {e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError as e:
        raise TrainmemError(f"malformed fixture {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise TrainmemError(f"cannot read fixture {path}: {e.strerror or e}") from None


def fixture_model(model: Any, path: str) -> Any:
    """A fixture's ``model`` as the predictors take it: a local path (not a catalogue name or hub id)
    is relative to the fixture file's folder, as ``trainmem measure --save-fixture`` writes it."""
    from .spec.config import catalogue_names
    if not isinstance(model, str) or os.path.isabs(model) or model.strip().lower() in catalogue_names():
        return model
    local = os.path.join(os.path.dirname(os.path.abspath(path)), model)
    return local if (os.path.exists(local) or model.startswith(".")) else model


def load_fixtures(root: str | None = None) -> list[dict[str, Any]]:
    """Every ``*.json`` fixture under ``root`` (recursively, except in ``campaigns/`` folders, which
    hold campaign files; default :func:`default_root`), each with
    its path, checked, and its ``model`` path resolved against its folder (:func:`fixture_model`)."""
    root = default_root() if root is None else root
    if not os.path.isdir(root):
        raise TrainmemError(f"no validation directory {root!r}: pass DIR, a folder of fixture .json files")
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
        if CAMPAIGNS in os.path.relpath(path, root).split(os.sep)[:-1]:
            continue  # a campaign file (trainmem.measure.campaign) is a grid of runs, not a fixture
        fx = _read_fixture(path)
        if not isinstance(fx, dict):
            raise TrainmemError(f"malformed fixture {path}: not a JSON object")
        _check_fixture(fx, path)
        fx["_path"] = path
        fx["model"] = fixture_model(fx["model"], path)
        out.append(fx)
    return out


def case_name(fx: dict[str, Any]) -> str:
    """The fixture's name, else its path."""
    return str(fx.get("name") or fx["_path"])


def source_url(fx: dict[str, Any]) -> str | None:
    """The URL of the fixture's source: ``source.url``, else the first http(s) word of a string source."""
    src = fx.get("source")
    if isinstance(src, dict):
        return src.get("url")
    if isinstance(src, str):
        for word in src.replace(",", " ").split():
            if word.startswith(("http://", "https://")):
                return word.rstrip(":;.)")
    return None


def source_label(fx: dict[str, Any]) -> str:
    """A short label for grouping by source: its ``label``, else author and title, the string source,
    else the fixture kind."""
    src = fx.get("source")
    if isinstance(src, dict):
        return str(src.get("label") or f"{src.get('author', '?')}: {src.get('title', source_url(fx) or '?')}")
    if isinstance(src, str):
        return src.split(",")[0].split(": ")[0]
    return "measured: " + str(fx.get("device") or "trainmem measure")


def framework(fx: dict[str, Any]) -> str:
    """The framework the measurement was taken with ("trainmem measure" for our own runs)."""
    return str(fx.get("framework") or ("trainmem measure" if "environment" in fx else "unknown"))


def describe(fx: dict[str, Any]) -> dict[str, Any]:
    """What a fixture says about itself: name, source URL and label, framework, GPU, metric."""
    return {"case": case_name(fx), "path": fx["_path"], "source_url": source_url(fx),
            "source": source_label(fx), "framework": framework(fx),
            "framework_version": fx.get("framework_version"), "gpu": fx.get("gpu"),
            "metric": fx.get("metric"), "quantities": [m["quantity"] for m in fx["measured"]]}


def primary_quantity(fx: dict[str, Any]) -> str:
    """The quantity a case is scored on: its first peak quantity, else its first quantity."""
    for item in fx["measured"]:
        if item["quantity"] in PEAKS:
            return item["quantity"]
    return fx["measured"][0]["quantity"]


def _value(item: dict[str, Any]) -> int:
    """A measured quantity's value in bytes, from its bytes, mib or gib field."""
    for unit, factor in UNITS.items():
        if unit in item:
            return int(round(item[unit] * factor))
    raise TrainmemError(f"measured quantity {item.get('quantity')!r} has no bytes/mib/gib value")


def active_peak(report: MemoryReport) -> int:
    """The peak of ``active_bytes.all`` (torchtune's ``peak_memory_active``): the allocated peak.
    The caching allocator counts a block in ``allocated_bytes`` and ``active_bytes`` from the same
    ``malloc`` (``c10/cuda/CUDACachingAllocator.cpp`` ``alloc_found_block``: both ``+= block->size``);
    ``free`` subtracts it from ``allocated_bytes`` at once and from ``active_bytes`` only when the
    block goes back to the pool, which waits for the events of a pending ``record_stream`` use
    (``insert_events`` / ``process_events``). Without such uses the two peaks are the same bytes;
    with them (torchtune's ``OffloadActivations`` with streams calls ``record_stream`` on the
    tensors it brings back in backward; DeepSpeed ZeRO-3 records each gathered parameter on the
    default stream and each gradient on its reduce stream before freeing them, v0.14.2
    ``partition_parameters.py`` L278-289, ``stage3.py`` L1240-1243, L1470-1472) the active peak can
    exceed the allocated one by the blocks whose events are pending, which neither estimate nor trace
    models: how many are pending is how far the GPU lags the host (docs/validation.md, Giles Thomas's
    Llama-3-8B ZeRO-3 rows: 0.6-4.8 GiB over the estimate, varying by rank and length)."""
    return report.peak_allocated


def quantity(report: MemoryReport, q: str) -> int | None:
    """The value a report gives for a fixture quantity (None where the report lacks it)."""
    if q == "peak_active":
        return active_peak(report)
    if q in PEAKS:
        return getattr(report, q)
    if q.startswith("phase:"):
        _, what, fld = q.split(":")
        name, step = what.rsplit("@", 1)
        try:
            return getattr(report.phase(name, int(step)), fld)
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


def _chosen(which: list[str] | None) -> dict[str, Callable[..., MemoryReport]]:
    preds = predictors()
    if not which:
        return preds
    unknown = [w for w in which if w not in preds]
    if unknown:
        raise TrainmemError(f"unknown or unavailable predictor(s): {', '.join(unknown)} "
                            f"(available: {', '.join(preds)})")
    return {k: v for k, v in preds.items() if k in which}


def predicted_value(report: MemoryReport, item: dict[str, Any]) -> int | None:
    """What a report predicts for one measured item: :func:`quantity` less the item's
    ``baseline_bytes`` (0 when absent), the bytes the published figure already had subtracted."""
    value = quantity(report, item["quantity"])
    if value is None:
        return None
    return value - int(round(item.get("baseline_bytes", 0)))


def _predict(fn: Callable[..., MemoryReport], fx: dict[str, Any]) -> MemoryReport:
    """One predictor's report for a fixture (every predictor takes the API's options)."""
    opts = dict(fx["setup"])
    if fx.get("overrides"):
        opts["set"] = fx["overrides"]
    if fx.get("device") == "cpu" and getattr(fn, "__name__", "") == "trace":
        opts["device"] = "cpu"  # a run measured on the CPU is traced on the CPU (no CUDA kernels, no workspaces)
    if getattr(fn, "__name__", "") == "estimate":
        opts.update(_run_releases(fx, opts))
    return fn(fx["model"], **opts)


def _run_releases(fx: dict[str, Any], opts: dict[str, Any]) -> dict[str, str]:
    """The transformers and PyTorch releases a ``trainmem measure`` fixture ran (its ``environment``),
    for the estimate, which models a release's code (``spec.tf_releases``, ``spec.releases``); the
    setup's own wins. trace runs the installed code, whatever the fixture ran."""
    env = fx.get("environment") or {}
    out = {}
    if env.get("transformers") and "transformers_version" not in opts:
        out["transformers_version"] = str(env["transformers"])
    if env.get("torch") and "torch_version" not in opts:
        out["torch_version"] = str(env["torch"])
    return out


def _reason(e: BaseException) -> str:
    """One line saying why a predictor could not run a fixture."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return msg if isinstance(e, TrainmemError) else f"{type(e).__name__}: {msg}"


def _checks_of(fx: dict[str, Any], pname: str, report: MemoryReport) -> list[Check]:
    primary = primary_quantity(fx)
    name, fw, src = case_name(fx), framework(fx), source_label(fx)
    return [Check(name, pname, item["quantity"], _value(item), predicted_value(report, item), fw, src,
                  item["quantity"] == primary) for item in fx["measured"]]


def validate(root: str | None = None, which: list[str] | None = None,
             cases: list[str] | None = None) -> Validation:
    """Predict every fixture under ``root`` (default: the repository's ``validation/``, from any
    working directory) or the ``cases`` whose file name or case name contains one of the given
    strings, with each predictor, and pair it with the measured values."""
    preds = _chosen(which)
    fixtures = load_fixtures(root)
    if cases:
        fixtures = [fx for fx in fixtures
                    if any(c in os.path.basename(fx["_path"]) or c in case_name(fx) for c in cases)]
    out = Validation(fixtures=fixtures)
    for fx in fixtures:
        for pname, fn in preds.items():
            try:
                report = _predict(fn, fx)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # a predictor that cannot run this case: listed, never raised
                out.not_run.append(NotRun(case_name(fx), pname, _reason(e)))
                continue
            out.checks.extend(_checks_of(fx, pname, report))
    return out


def exceeding(v: Validation, tolerance: float) -> list[Check]:
    """The checks whose |relative error| is above ``tolerance`` (a fraction: 0.05 = 5 %), every
    measured quantity of every case counted."""
    return [c for c in v.checks if c.error is not None and abs(c.error) > tolerance]


def verdict(v: Validation, tolerance: float | None = None) -> tuple[int, str]:
    """The exit status of a validation and its one-line reason: 1 when nothing was checked (no
    fixture, none selected, or no predictor could run one) or a check exceeds ``tolerance``, else 0."""
    scored = [c for c in v.checks if c.error is not None]
    if not scored:
        why = ("no fixture found (or none matched --cases)" if not v.fixtures else
               f"no predictor could run any of the {len(v.fixtures)} fixture(s)")
        return 1, f"nothing checked: {why}"
    if tolerance is not None:
        bad = exceeding(v, tolerance)
        if bad:
            worst = max(bad, key=lambda c: abs(c.error or 0))
            return 1, (f"{len(bad)} of {len(scored)} check(s) exceed the tolerance of {100 * tolerance:g}%: worst "
                       f"{worst.predictor} on {worst.case} ({worst.quantity}) {_fmt_err(worst.error)}")
        return 0, f"all {len(scored)} check(s) within the tolerance of {100 * tolerance:g}%"
    return 0, f"{len(scored)} check(s)"


def run(root: str | None = None, which: list[str] | None = None) -> list[Check]:
    """Every check of :func:`validate` (the runs that did not happen are in ``validate().not_run``)."""
    return validate(root, which).checks


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of ``values``, interpolating linearly between ranks."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats(errors: list[float]) -> dict[str, float]:
    """n, median and 90th percentile of |error|, the count within 5 %, the max |error| and the median
    signed error (bias) of a list of relative errors."""
    absolute = [abs(e) for e in errors]
    return {"n": len(errors), "median": percentile(absolute, 50), "p90": percentile(absolute, 90),
            "within_5pct": sum(a <= WITHIN for a in absolute), "max": max(absolute),
            "bias": percentile(errors, 50)}


def _grouped(checks: list[Check], key: Callable[[Check], str]) -> dict[str, dict[str, float]]:
    groups: dict[str, list[float]] = {}
    for c in checks:
        groups.setdefault(key(c), []).append(c.error)  # type: ignore[arg-type]
    return {k: stats(v) for k, v in sorted(groups.items())}


def summary(checks: list[Check]) -> dict[str, dict[str, Any]]:
    """Per predictor: ``overall``, ``frameworks`` and ``sources`` statistics (:func:`stats`) of the
    cases' primary quantities, and ``quantities``: the same over every measured quantity."""
    out: dict[str, dict[str, Any]] = {}
    for p in sorted({c.predictor for c in checks}):
        scored = [c for c in checks if c.predictor == p and c.error is not None]
        primary = [c for c in scored if c.primary]
        if not primary:
            continue
        out[p] = {"overall": stats([c.error for c in primary]),  # type: ignore[misc]
                  "frameworks": _grouped(primary, lambda c: c.framework),
                  "sources": _grouped(primary, lambda c: c.source),
                  "quantities": stats([c.error for c in scored]),  # type: ignore[misc]
                  "peaks": {q: stats([c.error for c in scored if c.quantity == q])  # type: ignore[misc]
                            for q in PEAKS if any(c.quantity == q for c in scored)}}
    return out


def to_dict(v: Validation) -> dict[str, Any]:
    """The JSON form of a validation: checks, cases with their description, summary, not run."""
    return {"fixtures": len(v.fixtures),
            "cases": [describe(fx) for fx in v.fixtures],
            "checks": [dict(case=c.case, predictor=c.predictor, quantity=c.quantity, measured=c.measured,
                            predicted=c.predicted, error=c.error, framework=c.framework, source=c.source,
                            primary=c.primary) for c in v.checks],
            "summary": summary(v.checks),
            "not_run": [dict(case=n.case, predictor=n.predictor, reason=n.reason) for n in v.not_run]}


def _fmt_err(e: float | None) -> str:
    return "-" if e is None else f"{100 * e:+.2f}%"


def _check_rows(v: Validation, preds: list[str]) -> list[str]:
    """One line per (case, quantity) under a line naming its framework: the measured value and each
    predictor's value and error; the case and quantity columns shortened so a line fits the terminal
    (:func:`render.text.width`)."""
    by_key: dict[tuple[str, str], dict[str, Check]] = {}
    order: list[tuple[str, str, str]] = []
    for c in v.checks:
        key = (c.case, c.quantity)
        if key not in by_key:
            by_key[key] = {}
            order.append((c.framework, c.case, c.quantity))
        by_key[key][c.predictor] = c
    w = width()                                          # the terminal's (render.text.width)
    fixed = 2 + 1 + 12 + 22 * len(preds)                 # indent, measured, each predictor's value and error
    qw = max(12, min(22, (w - fixed) // 2))              # quantity column: half of what is left, at most 22
    cw = max(16, w - fixed - qw - 2)                     # case column: the rest (one column spare)
    head = f"  {'case':{cw}s} {'quantity':{qw}s} {'measured MiB':>12s}"
    head += "".join(f" {p + ' MiB':>12s} {'error':>8s}" for p in preds)
    lines = [head]
    last_fw = None
    for fw, case, q in sorted(order, key=lambda t: (t[0].lower(), t[1].lower())):
        if fw != last_fw:
            lines.append(fw)
            last_fw = fw
        row = by_key[(case, q)]
        any_c = next(iter(row.values()))
        line = f"  {shorten(case, cw, 'start'):{cw}s} {shorten(q, qw, 'start'):{qw}s} {any_c.measured / 2**20:12.1f}"
        for p in preds:
            c = row.get(p)
            pred = "-" if c is None or c.predicted is None else f"{c.predicted / 2**20:.1f}"
            line += f" {pred:>12s} {_fmt_err(c.error if c else None):>8s}"
        lines.append(line)
    return lines


_STATS_HEAD = (f"{'cases':>5s} {'median|err|':>11s} {'p90|err|':>9s} {'within 5%':>9s} {'max|err|':>9s} "
               f"{'bias':>8s}")  # 56 columns, the width of :func:`_stats_cells`


def _stats_cells(st: dict[str, float]) -> str:
    """One row's statistics (:func:`stats`): cases, median, p90, within 5 %, max, bias; 56 columns."""
    return (f"{int(st['n']):5d} {100 * st['median']:10.2f}% {100 * st['p90']:8.2f}% "
            f"{int(st['within_5pct']):4d}/{int(st['n']):<4d} {100 * st['max']:8.2f}% {_fmt_err(st['bias']):>8s}")


def _per_predictor(s: dict[str, dict[str, Any]], rows: Any, name_min: int) -> "list[str] | None":
    """With several predictors on a terminal too narrow for a predictor column beside a name column
    of ``name_min``: one table per predictor, each under its name; else None (one table)."""
    if len(s) < 2 or name_min + 1 + 10 + len(_STATS_HEAD) <= width():
        return None
    lines: list[str] = []
    for p, ps in s.items():
        lines += [f"predictor {p}:"] + rows({p: ps})
    return lines


def _summary_rows(s: dict[str, dict[str, Any]], group: str) -> list[str]:
    """The summary table of one grouping (``frameworks`` or ``sources``) plus the overall row; the
    predictor column only when there is more than one (one table per predictor where the terminal
    is too narrow for it), the name column what is left of the terminal's width
    (:func:`render.text.width`)."""
    split = _per_predictor(s, lambda one: _summary_rows(one, group), 10)
    if split is not None:
        return split
    title = "framework" if group == "frameworks" else "source"
    many = len(s) > 1
    nw = max(10, width() - 3 - len(_STATS_HEAD) - (10 if many else 0))  # name, a space, 2 spare
    lines = [f"{title:{nw}s} " + (f"{'predictor':9s} " if many else "") + _STATS_HEAD]
    keys = sorted({k for p in s.values() for k in p[group]}, key=str.lower) + ["ALL CASES"]
    for k in keys:
        for p, ps in s.items():
            st = ps["overall"] if k == "ALL CASES" else ps[group].get(k)
            if st is None:
                continue
            lines.append(f"{shorten(k, nw, 'start'):{nw}s} " + (f"{p:9s} " if many else "") + _stats_cells(st))
    return lines


def _peak_rows(s: dict[str, dict[str, Any]]) -> list[str]:
    """Peak allocated, peak reserved and device used (reserved + context, the driver's figure),
    each scored separately per predictor (a predictor column when there are several, one table per
    predictor where the terminal is too narrow for it)."""
    qw = max(len(q) for q in ("quantity",) + PEAKS)
    split = _per_predictor(s, _peak_rows, qw)
    if split is not None:
        return split
    many = len(s) > 1
    lines = [f"{'quantity':{qw}s} " + (f"{'predictor':9s} " if many else "") + _STATS_HEAD]
    for q in PEAKS:
        for p, ps in s.items():
            st = ps.get("peaks", {}).get(q)
            if st is None:
                continue
            lines.append(f"{q:{qw}s} " + (f"{p:9s} " if many else "") + _stats_cells(st))
    return lines


def render(v: "Validation | list[Check]") -> str:
    """Plain text: every check, the runs that did not happen, and the summaries per framework and per
    source (cases scored on their primary quantity)."""
    if isinstance(v, list):  # the old call with a list of checks
        v = Validation(checks=v)
    preds = sorted({c.predictor for c in v.checks} | {n.predictor for n in v.not_run})
    lines = _check_rows(v, preds)
    if v.not_run:
        lines.append("")
        for n in v.not_run:
            lines += wrap(f"not run: {n.predictor} on {n.case}: {n.reason}")
    s = summary(v.checks)
    if s:
        lines += ["", "accuracy per framework (each case scored on its primary quantity;",
                  "|err| = |predicted - measured| / measured)"]
        lines += _summary_rows(s, "frameworks")
        lines += ["", "accuracy per source"]
        lines += _summary_rows(s, "sources")
        lines += ["", "accuracy per peak quantity (every case that measured it)"]
        lines += _peak_rows(s)
        for p, ps in s.items():
            q = ps["quantities"]
            lines.append(f"{p}: {len({c.case for c in v.checks if c.predictor == p})} cases, "
                         f"{int(q['n'])} quantities, median |error| {100 * q['median']:.3f}%, "
                         f"max {100 * q['max']:.3f}%")
    return "\n".join(lines)
