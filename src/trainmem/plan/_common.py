"""Shared by fit, sweep, suggest and plan: one resolved model + hardware, many training setups."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Callable, Iterable

from ..errors import TrainmemError
from ..report import MemoryReport
from ..spec.hardware import Hardware, catalogue
from ..spec.model import ModelSpec
from ..spec.resolve import OPTIONS, TRAINING_FIELDS, Resolved, resolve

BYS = ("estimate", "trace")


def _trace_function() -> Callable[..., MemoryReport]:
    """``trainmem.trace.api.trace``, or a clear error while the tracer does not exist yet."""
    from importlib import import_module
    try:
        api = import_module("trainmem.trace.api")
    except ImportError as e:
        raise TrainmemError("--by trace needs the tracer (trainmem.trace.api), which is not available in this "
                            f"installation ({e}); use --by estimate") from None
    fn = getattr(api, "trace", None)
    if not callable(fn):
        raise TrainmemError("--by trace: trainmem.trace.api has no trace(model, **options) function; "
                            "use --by estimate")
    return fn


def refuse_varying_lengths(options: dict[str, Any]) -> None:
    """fit, sweep and plan vary the batch and the sequence and evaluate layouts as arrays
    (``estimate_layouts``), whose micro-batches are of one length: ``--min-seq-len`` and
    ``--later-seq-len`` are refused there (suggestions, which re-estimate one setup at a time, keep them)."""
    for key in ("min_seq_len", "later_seq_len"):
        value, flag = options.get(key), "--" + key.replace("_", "-")
        if value is not None:
            raise TrainmemError(f"{flag} {value}: fit, sweep and plan vary the batch and sequence of one setup, "
                                f"whose micro-batches they take to be of one length; {flag} is modelled by "
                                "estimate and trace: drop it")



def refuse_one_stage(options: dict[str, Any], command: str) -> None:
    """A run fits only when every rank fits, and under pipeline parallelism the ranks of different
    stages hold different memory (``estimate.schedules``): ``fit`` and ``plan`` judge a setup by
    its worst stage. ``--pp-stage first|last`` reads one stage's rank, which is how a log from
    that rank is compared (Megatron-LM logs the last stage's rank); judging a fit by it would
    call a job that fails on another stage a fit, so it is refused there."""
    stage = options.get("pp_stage")
    if stage is not None and stage != "worst":
        raise TrainmemError(f"{command} --pp-stage {stage}: a run fits only when its worst pipeline stage fits, "
                            f"which {command} checks; --pp-stage reads one stage's rank: use estimate or sweep "
                            "for that, or drop it")

class Evaluator:
    """Evaluates one model on one GPU under varying training options, resolving the inputs once.

    ``options`` are the API's keyword options (those of ``trainmem.estimate``, see
    ``trainmem.spec.resolve``); ``model`` may be a ``Resolved``. ``by``: ``estimate`` (formulas)
    or ``trace`` (the fake-tensor tracer, when installed; options ``resolve`` does not know, such
    as ``device``, go to the tracer). ``report(**changes)`` varies the training setup with
    ``Resolved.replace``. ``options`` keeps the training options given (None left out). ``replay``:
    estimates replay the step through the caching allocator for peak reserved (False where only the
    fit verdict is read: it counts allocated + 1/32 + context, ``MemoryReport.device_peak``).
    """

    def __init__(self, model: Any, by: str = "estimate", replay: bool = True, **options: Any):
        if by not in BYS:
            raise TrainmemError(f"--by {by!r} is not one of: {', '.join(BYS)}")
        self.by = by
        self.replay = replay
        self._fn = _trace_function() if by == "trace" else None
        self.trace_options = {k: v for k, v in options.items() if k not in OPTIONS} if by == "trace" else {}
        self.resolved: Resolved = resolve(model, **{k: v for k, v in options.items() if k not in self.trace_options})
        self.options = {k: v for k, v in options.items() if k in TRAINING_FIELDS and v is not None}
        self.calls = 0

    @property
    def model(self) -> ModelSpec:
        """The resolved model."""
        return self.resolved.model

    @property
    def hardware(self) -> Hardware | None:
        """The resolved GPU (None without one)."""
        return self.resolved.hardware

    @property
    def max_fraction(self) -> float:
        """The fraction of the GPU the peak may take."""
        return self.resolved.max_fraction

    @property
    def method(self) -> str:
        """The estimate method."""
        return self.resolved.method

    @property
    def limit(self) -> int | None:
        """Bytes the peak may take: ``max_fraction`` of the GPU (None without a GPU)."""
        return self.resolved.limit

    def report(self, **changes: Any) -> MemoryReport:
        """The report for the base setup with the training ``changes`` applied (a change to None
        restores the default; TrainmemError on bad input)."""
        self.calls += 1
        r = self.resolved.replace(**changes)
        if self._fn is not None:
            from ..estimate.api import attach_hardware
            rep = self._fn(r, **self.trace_options)
            return rep if rep.capacity is not None or r.hardware is None else \
                attach_hardware(rep, r.hardware, r.max_fraction)
        from ..estimate.api import estimate_resolved
        return estimate_resolved(r, self.replay)


def gpu_extras(hw: Hardware | None) -> dict[str, float]:
    """Planner facts of a GPU beyond ``Hardware``: GPUs per node and per-GPU inter-node bandwidth."""
    d = {"gpus_per_node": 8, "internode_gbs": 25.0}
    if hw is not None and hw.name in catalogue():
        v = catalogue()[hw.name]
        d["gpus_per_node"] = int(v.get("gpus_per_node", 8))
        d["internode_gbs"] = float(v.get("internode_gbs", 25.0))
    return d


def hardware_with_speeds(hw: Hardware) -> Hardware:
    """A custom GPU (``--gpu-memory`` alone) has no speeds; the planner assumes an A100's."""
    if hw.bf16_tflops > 0 and hw.interconnect_gbs > 0:
        return hw
    return replace(hw, bf16_tflops=hw.bf16_tflops or 312.0, interconnect_gbs=hw.interconnect_gbs or 300.0,
                   bandwidth_gbs=hw.bandwidth_gbs or 2039.0)


_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


def parse_int_list(text: str | int | Iterable[int], what: str = "value") -> list[int]:
    """``"1,2,4"``, ``"128:4096:128"`` (start:stop:step, stop included), or a mix ``"1,2,8:32:8"``;
    sorted, duplicates removed, every value positive."""
    if isinstance(text, int) and not isinstance(text, bool):
        vals = [text]
    elif isinstance(text, str):
        vals = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            m = _RANGE.match(part)
            if m:
                a, b, c = int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)
                if c <= 0 or b < a:
                    raise TrainmemError(f"{what} range {part!r}: write START:STOP[:STEP] with START <= STOP and "
                                        f"STEP > 0, e.g. 128:4096:128")
                if (b - a) // c > 100_000:
                    raise TrainmemError(f"{what} range {part!r} has more than 100,000 values")
                vals.extend(range(a, b + 1, c))
            else:
                try:
                    vals.append(int(part))
                except ValueError:
                    raise TrainmemError(f"{what} {part!r} is not an integer or a START:STOP[:STEP] range "
                                        f"(e.g. 1,2,4 or 128:4096:128)") from None
    else:
        vals = [int(v) for v in text]
    if not vals:
        raise TrainmemError(f"no {what} given")
    bad = [v for v in vals if v <= 0]
    if bad:
        raise TrainmemError(f"{what} {bad[0]} must be a positive integer")
    return sorted(set(vals))


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return small + large[::-1]
