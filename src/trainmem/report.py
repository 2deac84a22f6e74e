"""MemoryReport: the one value every estimator, tracer and measurement returns.

All amounts are integer bytes. Units are chosen only when rendering. ``to_dict()`` is the stable
JSON contract (``--json``): fields are added freely, never renamed or removed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from .allocator_rules import reserved_overhead

class Category(str, Enum):
    """What a component's bytes are, in the order tables list them. A ``str`` enum: equal to its
    name as a plain string, which is what JSON carries."""

    PARAMETERS = "parameters"
    MASTER_WEIGHTS = "master_weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    LOGITS = "logits"
    INPUTS = "inputs"
    BUFFERS = "buffers"
    WORKSPACE = "workspace"
    TEMPORARIES = "temporaries"
    COMMUNICATION = "communication"
    CUDA_CONTEXT = "cuda_context"
    ALLOCATOR_OVERHEAD = "allocator_overhead"

    def __str__(self) -> str:
        return self.value


CATEGORIES = tuple(c.value for c in Category)

PHASE_NAMES = (
    "model_loaded",
    "forward",
    "backward_peak",
    "backward",
    "optimizer_step",
    "zero_grad",
)


_CATEGORY_SET = frozenset(CATEGORIES)


@dataclass(slots=True)
class Component:
    """A named amount of memory on one GPU.

    ``name`` may nest with dots under its category (``activations.layer.attention.scores``).
    ``dtype`` and ``formula`` say what was counted and where the number comes from.
    ``persistent`` is True for memory that lives across steps (weights, states, workspaces);
    transient components (activations, logits, temporaries) live within a step.
    """

    name: str
    category: str
    bytes: int
    dtype: str | None = None
    formula: str = ""
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.category not in _CATEGORY_SET:
            raise ValueError(f"unknown component category {self.category!r}")
        if type(self.category) is not str:  # a Category member: keep the plain string
            self.category = self.category.value

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "category": self.category, "bytes": int(self.bytes)}
        if self.dtype:
            d["dtype"] = self.dtype
        if self.formula:
            d["formula"] = self.formula
        return d


@dataclass(slots=True)
class Phase:
    """Memory at a point of the training step.

    ``allocated`` is the allocated memory at the end of the phase; ``peak`` the highest
    allocated memory reached during it; ``reserved`` the allocator's reserved memory where the
    source knows it. ``step`` counts from 1; step 1 differs from the steady state because
    optimizer states and cuBLAS workspaces first appear in it.
    """

    name: str
    step: int
    allocated: int
    peak: int
    reserved: int | None = None
    where: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "step": self.step, "allocated": int(self.allocated),
                             "peak": int(self.peak),
                             "reserved": None if self.reserved is None else int(self.reserved)}
        if self.where:
            d["where"] = self.where
        return d


@dataclass
class MemoryReport:
    """Training memory of one GPU (the worst rank where ranks differ)."""

    source: str
    components: list[Component]
    phases: list[Phase]
    peak_allocated: int
    peak_reserved: int | None = None
    device_used: int | None = None
    peak_phase: str = ""
    peak_where: str = ""
    capacity: int | None = None
    max_fraction: float = 1.0
    method: str = ""
    model: Any = None
    training: Any = None
    hardware: Any = None
    warnings: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    # ----- derived -------------------------------------------------------------------------
    @property
    def device_peak(self) -> int:
        """What the fit verdict counts against the GPU, by one rule for every source.

        A measurement counts what the device really held (``device_used``: reserved + CUDA context,
        else reserved, else allocated); so does a published method's estimate (its own figure). A
        trace and a trainmem estimate count their peak allocated plus a 1/32 margin
        (``allocator_rules.reserved_overhead``) plus the GPU's context, so the two reach the same
        verdict whenever they agree on the allocated peak: the caching allocator frees its cached
        blocks and retries before it reports out-of-memory (``CUDACachingAllocator.cpp``
        ``release_cached_blocks`` in ``malloc``), so the reserved high-water mark of a run with room
        to spare is not what a full GPU must hold. Their allocator simulations (trace block by block,
        the estimate on its replayed step, ``estimate/reserved/``) are still reported
        (``peak_reserved``, ``device_used``) and a disagreement with the verdict becomes a warning
        (``verdict_warnings``); a trace that stopped at a simulated out-of-memory
        (``extra["simulated_oom"]``) counts what the simulation needed there. ``fit_basis`` says
        which rule applied.
        """
        if not self._margin_rule:
            if self.device_used is not None:
                return self.device_used
            return self.peak_reserved if self.peak_reserved is not None else self.peak_allocated
        return int(self.peak_allocated + reserved_overhead(self.peak_allocated) + self.fit_context)

    @property
    def _margin_rule(self) -> bool:
        """Whether the verdict applies the estimate's margin rule to this report's allocated peak: a
        trace of the emulated GPU that ran to the end (a CPU trace has no caching allocator and no
        context; a simulated out-of-memory counts what the simulation needed)."""
        if self.source == "estimate":
            return self.method in ("", "trainmem")
        return (self.source == "trace" and self.extra.get("device") != "cpu"
                and not self.extra.get("simulated_oom"))

    @property
    def fit_context(self) -> int:
        """The CUDA context bytes the margin rule adds (trace, and the trainmem estimate whose device
        memory already holds it); 0 where the verdict counts a measured or method's own figure."""
        return int(getattr(self.hardware, "context", 0) or 0) if self._margin_rule else 0

    @property
    def fit_basis(self) -> str:
        """The rule ``device_peak`` (and so ``fits``/``margin``) used, in words."""
        if self.source == "measure":
            if self.device_used is None:
                return "measured peak " + ("reserved" if self.peak_reserved is not None else "allocated")
            return "measured device memory (reserved + CUDA context)"
        if self.source == "trace" and not self._margin_rule:
            return ("the allocator simulation's out-of-memory (reserved + the failed request + context)"
                    if self.extra.get("simulated_oom") else "traced peak allocated on the CPU (no caching allocator)")
        if self.source == "estimate" and self.method not in ("", "trainmem"):
            return f"device memory as the {self.method} method counts it"
        return "peak allocated + 1/32 allocator margin" + (" + CUDA context" if self.fit_context else "")

    def verdict_warnings(self) -> list[str]:
        """One line when the allocator simulation (trace's, or the estimate's replay) disagrees with
        the verdict's reserved model."""
        if not self._margin_rule or self.capacity is None or self.device_used is None:
            return []
        limit = self.max_fraction * self.capacity
        if (self.device_used <= limit) == (self.device_peak <= limit):
            return []
        verdict = "fits" if self.device_peak <= limit else "does not fit"
        sim = "does not fit" if self.device_used > limit else "fits"
        return [f"the verdict ({verdict}) assumes a 1/32 allocator margin; the block-by-block allocator "
                f"simulation reserves {self.peak_reserved - self.peak_allocated:,} B over allocated and {sim}"]

    @property
    def fits(self) -> bool | None:
        """True when the peak device memory is within ``max_fraction`` of the GPU's capacity."""
        if self.capacity is None:
            return None
        return self.device_peak <= self.max_fraction * self.capacity

    @property
    def margin(self) -> int | None:
        """Bytes left on the GPU at the peak (negative when it does not fit)."""
        if self.capacity is None:
            return None
        return int(self.max_fraction * self.capacity) - self.device_peak

    def by_category(self) -> dict[str, int]:
        """Sum of components per category, in ``CATEGORIES`` order (zero categories omitted)."""
        out: dict[str, int] = {}
        for c in self.components:
            out[c.category] = out.get(c.category, 0) + c.bytes
        return {k: out[k] for k in CATEGORIES if k in out}

    def component(self, name: str) -> int:
        """Bytes of the component ``name`` plus every component nested under it."""
        return sum(c.bytes for c in self.components
                   if c.name == name or c.name.startswith(name + "."))

    def phase(self, name: str, step: int | None = None) -> Phase:
        """The phase called ``name`` (of ``step``, else the last step that has it)."""
        found = [p for p in self.phases if p.name == name and (step is None or p.step == step)]
        if not found:
            raise KeyError(f"no phase {name!r}" + (f" in step {step}" if step else ""))
        return found[-1]

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON contract (docs/design.md: fields are added, never renamed or removed)."""
        d: dict[str, Any] = {
            "source": self.source,
            "method": self.method,
            "peak_allocated": int(self.peak_allocated),
            "peak_reserved": None if self.peak_reserved is None else int(self.peak_reserved),
            "device_used": None if self.device_used is None else int(self.device_used),
            "peak_phase": self.peak_phase,
            "peak_where": self.peak_where,
            "capacity": self.capacity,
            "max_fraction": self.max_fraction,
            "fits": self.fits,
            "margin": self.margin,
            "fit_basis": self.fit_basis if self.capacity is not None else None,
            "components": [c.to_dict() for c in self.components],
            "phases": [p.to_dict() for p in self.phases],
            "warnings": list(self.warnings),
        }
        if self.model is not None and hasattr(self.model, "summary"):
            d["model"] = self.model.summary()
        if self.training is not None and hasattr(self.training, "to_dict"):
            d["training"] = self.training.to_dict()
            extra = getattr(self.training, "extra", None) or {}
            if extra.get("framework"):  # the preset the setup came from (spec/frameworks.py)
                d["training"]["framework"] = extra["framework"]
                d["training"]["framework_version"] = extra.get("framework_version")
        if self.hardware is not None and hasattr(self.hardware, "to_dict"):
            d["hardware"] = self.hardware.to_dict()
        if self.extra:
            d["extra"] = self.extra
        if self.extra.get("ranks") is not None:  # several ranks measured: one summary per rank, at the top
            d["ranks"] = self.extra["ranks"]
        return d


@dataclass(frozen=True)
class Difference:
    """One row of a comparison: the same quantity from several reports."""

    kind: str  # "category" | "component" | "phase" | "total"
    name: str
    values: tuple[int | None, ...]

    def diff(self, i: int, ref: int = 0) -> int | None:
        a, b = self.values[i], self.values[ref]
        return None if a is None or b is None else a - b

    def rel(self, i: int, ref: int = 0) -> float | None:
        a, b = self.values[i], self.values[ref]
        if a is None or b is None or b == 0:
            return None
        return (a - b) / b


def compare(reports: Iterable[MemoryReport]) -> list[Difference]:
    """Put reports side by side: totals, categories, and phases matched by (name, step)."""
    reps = list(reports)
    rows: list[Difference] = [
        Difference("total", "peak_allocated", tuple(r.peak_allocated for r in reps)),
        Difference("total", "peak_reserved", tuple(r.peak_reserved for r in reps)),
        Difference("total", "device_used", tuple(r.device_used for r in reps)),
    ]
    cats = [r.by_category() for r in reps]
    for cat in CATEGORIES:
        if any(cat in c for c in cats):
            rows.append(Difference("category", cat, tuple(c.get(cat) for c in cats)))
    keys: list[tuple[str, int]] = []
    for r in reps:
        for p in r.phases:
            if (p.name, p.step) not in keys:
                keys.append((p.name, p.step))
    for name, step in keys:
        vals = []
        for r in reps:
            try:
                vals.append(r.phase(name, step).allocated)
            except KeyError:
                vals.append(None)
        rows.append(Difference("phase", f"{name}@{step}", tuple(vals)))
    return rows
