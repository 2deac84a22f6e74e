"""A validation campaign: a grid of real training runs, one short subprocess per run.

``trainmem validate --campaign FILE`` (``make gpu-validate``) reads a campaign file (JSON, see
``validation/campaigns/``), expands it into runs, and runs each one that the results file does not
hold yet as ``python -m trainmem.measure.campaign RUN.json RECORD.json`` — a fresh process per run,
so a crash, a hang or an out-of-memory error in one run loses nothing else, and every run starts
from an empty caching allocator and a new CUDA context, as a training script does. Each finished
run is appended to one JSONL file at once, one record per line: the run; its status (ok, oom,
refused, error, crash or timeout); the measured report's phases (allocated, reserved, peak, peak
reserved, NVML's device and process figures, the CUDA context); the allocator's statistics
including ``num_alloc_retries``; the environment; the fixture; and the ``trainmem measure``
command that reproduces it. The campaign stops cleanly before the time budget (``budget_s``) runs
out and resumes where it stopped on the next call: a recorded run, whatever its status, is not
run again.

The campaign needs only what a GPU machine with PyTorch already has (torch, transformers, peft,
nvidia-ml-py): it runs from a source checkout (``PYTHONPATH=src``) and installs nothing; each child
gets the directory that holds this package on its ``PYTHONPATH``.

:func:`fixtures_from_results` turns the JSONL into validation fixtures (``validation/measured/``)
that ``trainmem validate`` scores estimate and trace against.

Campaign file::

    {"name": "...", "device": "cuda", "steps": 2, "gpu": "auto",
     "groups": [{"model": "gpt2", "overrides": ["n_layer=4"], "setup": {"batch_size": 8, ...},
                 "vary": [{}, {"precision": "fp32"}, {"attention": "eager"}]}, ...]}

Each group's ``setup`` is merged with each of its ``vary`` items (the campaign's ``setup``, if
any, first). Runs are ordered round-robin over the groups — every group's first variant, then
every group's second, ... — so the first minutes of a campaign already cover every model.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import TrainmemError

#: the environment variable a test sets to run children with another probe ("module:callable")
PROBE_ENV = "TRAINMEM_CAMPAIGN_PROBE"


@dataclass(frozen=True)
class Run:
    """One training run of a campaign: the model, its config overrides, the estimate options
    (``trainmem.spec.resolve``'s keyword names) and how it is measured."""

    model: str
    overrides: tuple[str, ...]
    setup: tuple[tuple[str, Any], ...]
    device: str = "cuda"
    steps: int = 2
    gpu: str | None = None
    label: str | None = None  # the group's name in ids ("open-llama-3b-shape"), else the model's

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.setup)

    @property
    def id(self) -> str:
        """A readable, stable name: the model, the options, and a hash of everything."""
        key = json.dumps([self.model, list(self.overrides), self.setup, self.device, self.steps], sort_keys=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        words = [self.label or self.model] + [f"{_short(k)}{_value_word(v)}" for k, v in self.setup]
        return "-".join(words).replace("/", "_")[:90] + "-" + digest

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "overrides": list(self.overrides), "setup": self.options,
                "device": self.device, "steps": self.steps, "gpu": self.gpu, "label": self.label}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Run":
        return Run(d["model"], tuple(d.get("overrides") or ()), tuple(sorted(d["setup"].items())),
                   d.get("device", "cuda"), int(d.get("steps", 2)), d.get("gpu"), d.get("label"))

    def command(self) -> str:
        """The ``trainmem measure`` command line of this run."""
        words = ["trainmem", "measure", self.model]
        for o in self.overrides:
            words += ["--set", o]
        for k, v in self.setup:
            flag = "--" + k.replace("_", "-")
            words += [flag] if v is True else [] if v is False else [flag, str(v)]
        if self.gpu:
            words += ["--gpu", self.gpu]
        words += ["--device", self.device, "--steps", str(self.steps)]
        return " ".join(shlex.quote(w) for w in words)


_SHORT = {"batch_size": "b", "seq_len": "s", "precision": "", "attention": "", "recompute": "rc-",
          "optimizer": "", "optimizer_impl": "", "lora_rank": "lora", "grad_accum": "ga", "zero_grad": "zg-",
          "hold_output": "hold-", "loss": "loss-"}


def _short(key: str) -> str:
    return _SHORT.get(key, key.replace("_", "") + "=")


def _value_word(v: Any) -> str:
    return "on" if v is True else "off" if v is False else str(v)


# ----- the campaign file --------------------------------------------------------------------------------
def _group_runs(group: dict[str, Any], base: dict[str, Any], defaults: dict[str, Any], path: str) -> list[Run]:
    """The runs of one group: its setup merged with each variant."""
    if not isinstance(group, dict) or not isinstance(group.get("model"), str):
        raise TrainmemError(f"campaign {path}: every group needs a \"model\" (a catalogue name)")
    overrides = group.get("overrides") or []
    vary = group.get("vary") or [{}]
    if not isinstance(overrides, list) or not isinstance(vary, list) or not all(isinstance(v, dict) for v in vary):
        raise TrainmemError(f"campaign {path}: group {group['model']!r}: \"overrides\" must be a list of "
                            "\"key=value\" strings and \"vary\" a list of objects")
    setup = {**base, **(group.get("setup") or {})}
    return [Run(group["model"], tuple(str(o) for o in overrides), tuple(sorted({**setup, **v}.items())),
                defaults["device"], defaults["steps"], defaults["gpu"], group.get("label")) for v in vary]


def _round_robin(lists: list[list[Run]]) -> list[Run]:
    """Every list's first item, then every list's second, ...; duplicates (same id) dropped."""
    out: list[Run] = []
    seen: set[str] = set()
    for i in range(max((len(x) for x in lists), default=0)):
        for x in lists:
            if i < len(x) and x[i].id not in seen:
                seen.add(x[i].id)
                out.append(x[i])
    return out


def load_campaign(path: str, device: str | None = None) -> tuple[str, list[Run]]:
    """The campaign's name and its runs in the order they are run. ``device`` overrides the file's."""
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except OSError as e:
        raise TrainmemError(f"cannot read campaign {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise TrainmemError(f"malformed campaign {path}: {e.msg} at line {e.lineno}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("groups"), list) or not spec["groups"]:
        raise TrainmemError(f"campaign {path}: needs \"groups\", a non-empty list")
    dev = device or spec.get("device", "cuda")
    defaults = {"device": dev, "steps": int(spec.get("steps", 2)),
                "gpu": None if dev == "cpu" else spec.get("gpu", "auto")}
    base = spec.get("setup") or {}
    runs = _round_robin([_group_runs(g, base, defaults, path) for g in spec["groups"]])
    return str(spec.get("name") or os.path.basename(path)), runs


def check_run(run: Run) -> str | None:
    """Why the run would be refused (its inputs resolved, measure's rules checked, and the estimate
    made, which refuses what PyTorch refuses, e.g. an SDPA backend pinned where its kernel does not
    apply), else None. Nothing is built: ``--dry-run`` catches a bad grid before a GPU is spent on it."""
    from ..estimate.api import estimate
    from ..spec.resolve import resolve
    from ..workload import check_supported
    try:
        r = resolve(run.model, set=list(run.overrides), **run.options)
        check_supported(r.training, "measure")
        estimate(r)
    except TrainmemError as e:
        return str(e)
    return None


# ----- the results file ---------------------------------------------------------------------------------
def read_results(path: str) -> list[dict[str, Any]]:
    """The records of a results file (a line that is not a complete JSON object — a run cut off
    while writing — is skipped)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("id"):
                out.append(rec)
    return out


def append_record(path: str, record: dict[str, Any]) -> None:
    """Append one record as one line and flush it to disk at once."""
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


# ----- running ------------------------------------------------------------------------------------------
@dataclass
class Progress:
    """What one call of :func:`run_campaign` did."""

    name: str
    total: int
    done_before: int
    ran: list[dict[str, Any]] = field(default_factory=list)
    stopped_by_budget: bool = False
    left: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"campaign": self.name, "runs": self.total, "done_before": self.done_before,
                "ran_now": len(self.ran), "statuses_now": summarize(self.ran),
                "left": self.left, "stopped_by_budget": self.stopped_by_budget}


def _child_env() -> dict[str, str]:
    """The child's environment: this package importable without installing it."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _run_child(run: Run, timeout: float, python: str) -> tuple[dict[str, Any] | None, str, float, bool]:
    """Run one child; its record (None when it wrote none), its stderr's tail, the wall time, and
    whether the timeout killed it."""
    with tempfile.TemporaryDirectory(prefix="trainmem-campaign-") as tmp:
        spec_path, out_path = os.path.join(tmp, "run.json"), os.path.join(tmp, "record.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(run.to_dict(), f)
        t0 = time.monotonic()
        try:
            p = subprocess.run([python, "-m", "trainmem.measure.campaign", spec_path, out_path], env=_child_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
            killed, tail = False, (p.stderr or "")[-2000:]
        except subprocess.TimeoutExpired as e:
            killed = True
            tail = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))[-2000:]
        wall = time.monotonic() - t0
        record = None
        if os.path.exists(out_path):
            with open(out_path, encoding="utf-8") as f:
                record = json.load(f)
        return record, tail, wall, killed


MIN_START_S = 10.0  # no run starts with less time left than this


def start_allowed(left: float, walls: list[float]) -> bool:
    """Start another run only when the time left holds one and a half typical runs of this call
    (the median wall time so far) and at least ``MIN_START_S``. The first run starts whenever
    ``MIN_START_S`` is left: if the budget cuts it, it is not recorded and runs on the next call."""
    typical = sorted(walls)[len(walls) // 2] if walls else 0.0
    return left >= max(MIN_START_S, 1.5 * typical)


def run_campaign(path: str, results: str, *, budget_s: float = 540, run_timeout: float = 120,
                 device: str | None = None, python: str | None = None, limit: int | None = None,
                 on_run: Callable[[int, int, dict[str, Any]], None] | None = None) -> Progress:
    """Run every run of the campaign at ``path`` that ``results`` does not hold yet, appending each
    record as it finishes, until they are done, ``limit`` runs have run, or ``budget_s`` seconds
    would be passed. A run cut short by the budget is not recorded (it runs again on resume); one
    that passes ``run_timeout`` is recorded as ``timeout``."""
    name, runs = load_campaign(path, device)
    _check_results_path(results)
    done = {r["id"] for r in read_results(results)}
    todo = [r for r in runs if r.id not in done]
    prog = Progress(name, len(runs), len(runs) - len(todo))
    t0, walls = time.monotonic(), []
    for run in todo:
        left = budget_s - (time.monotonic() - t0)
        if (limit is not None and len(prog.ran) >= limit) or not start_allowed(left, walls):
            prog.stopped_by_budget = limit is None or len(prog.ran) < limit
            break
        record, tail, wall, killed = _run_child(run, min(run_timeout, left), python or sys.executable)
        if killed and left < run_timeout:  # cut by the budget, not by the run's own limit: run it next time
            prog.stopped_by_budget = True
            break
        walls.append(wall)
        record = _finish(run, record, tail, wall, killed, run_timeout)
        append_record(results, record)
        prog.ran.append(record)
        if on_run is not None:
            on_run(prog.done_before + len(prog.ran), prog.total, record)
    prog.left = prog.total - prog.done_before - len(prog.ran)
    return prog


def _check_results_path(results: str) -> None:
    folder = os.path.dirname(os.path.abspath(results))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise TrainmemError(f"--results {results}: folder {folder} does not exist or is not writable; create it "
                            "or give another path")


def _finish(run: Run, record: dict[str, Any] | None, tail: str, wall: float, killed: bool,
            run_timeout: float) -> dict[str, Any]:
    """The record to append: the child's, else one saying it crashed or timed out."""
    if record is None:
        status = "timeout" if killed else "crash"
        why = f"ran past its {run_timeout:g} s limit" if killed else "the process ended without a record"
        record = {"status": status, "message": why, "stderr_tail": tail}
    base = run.to_dict() | {"command": run.command(), "wall_s": round(wall, 3),
                            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return base | record


# ----- one run, in its own process ----------------------------------------------------------------------
def _probe_from_env() -> Any:
    """The probe a test asks for through ``TRAINMEM_CAMPAIGN_PROBE`` ("module:callable"), else None."""
    spec = os.environ.get(PROBE_ENV)
    if not spec:
        return None
    import importlib
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)()


def measure_run(run: Run) -> dict[str, Any]:
    """Measure one run in this process; the record's status and contents (never raises)."""
    try:
        import transformers
        transformers.logging.set_verbosity_error()
        from .runner import fixture, measure

        def go(gpu: str | None) -> Any:
            return measure(run.model, run.steps, device=run.device, overrides=list(run.overrides), gpu=gpu,
                           probe=_probe_from_env(), progress_bar=False, **run.options)
        try:
            report = go(run.gpu)
        except TrainmemError as e:  # NVML could not name the GPU: judge against the device itself
            if run.gpu != "auto" or not str(e).startswith("--gpu auto"):
                raise
            report = go(None)
            report.warnings.append(f"--gpu auto failed ({e}); the device itself was used")
    except TrainmemError as e:
        return {"status": "refused", "message": str(e)}
    except Exception as e:  # anything else: recorded with its type, the campaign goes on
        import traceback
        return {"status": "error", "message": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-4000:]}
    return _record_of(run, report, fixture)


def _record_of(run: Run, report: Any, fixture: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    ex = report.extra
    rec: dict[str, Any] = {"status": "oom" if ex.get("oom") else "ok",
                           "peak_allocated": report.peak_allocated, "peak_reserved": report.peak_reserved,
                           "device_used": report.device_used, "cuda_context": ex.get("cuda_context"),
                           "phases": ex.get("phases"), "allocator": ex.get("allocator"),
                           "environment": ex.get("environment"), "notes": ex.get("notes"),
                           "warnings": list(report.warnings), "runtime_s": ex.get("runtime_s")}
    if ex.get("oom"):
        rec["oom"] = ex["oom"]
    else:
        rec["fixture"] = fixture(report, command=run.command())
    return rec


def _child_main(argv: list[str]) -> int:
    """``python -m trainmem.measure.campaign RUN.json RECORD.json``: measure the run, write the record."""
    if len(argv) != 2:
        sys.stderr.write("usage: python -m trainmem.measure.campaign RUN.json RECORD.json\n")
        return 2
    with open(argv[0], encoding="utf-8") as f:
        run = Run.from_dict(json.load(f))
    record = measure_run(run)
    tmp = argv[1] + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, default=str)
    os.replace(tmp, argv[1])
    return 0


# ----- results -> fixtures ------------------------------------------------------------------------------
def fixtures_from_results(results: str, into: str, campaign: str | None = None) -> list[str]:
    """Write one fixture file per finished run (status ok) of ``results`` into the folder ``into``
    (``<id>.json``); the paths written. A run recorded twice keeps its last record."""
    recs = {r["id"]: r for r in read_results(results) if r.get("status") == "ok" and r.get("fixture")}
    if not recs:
        raise TrainmemError(f"{results}: no finished run to turn into a fixture")
    os.makedirs(into, exist_ok=True)
    paths = []
    for rid, rec in recs.items():
        fx = dict(rec["fixture"])
        where = (fx.get("environment") or {}).get("gpu") or fx.get("device") or "?"
        fx["name"] = f"{rid} on {where}"  # unique per run: the id names every option that differs
        fx["campaign"] = {"id": rid, "results": os.path.basename(results), "name": campaign,
                          "num_alloc_retries": (rec.get("allocator") or {}).get("num_alloc_retries"),
                          "wall_s": rec.get("wall_s")}
        path = os.path.join(into, rid + ".json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(fx, f, indent=1, sort_keys=False, default=str)
            f.write("\n")
        paths.append(path)
    return paths


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How many records end in each status."""
    out: dict[str, int] = {}
    for r in records:
        out[r.get("status", "?")] = out.get(r.get("status", "?"), 0) + 1
    return out


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
