"""``fit``: the largest micro-batch (or the longest sequence) that fits a GPU.

Memory is monotone in the micro-batch and in the sequence length (every activation term has a
non-negative coefficient in b·s and b·s²), so the answer is found exactly by bracketing: the
sizes 1, 2, 4, ... steps, then the sizes between the last that fits and the first that does not.
With the default method the estimate engine evaluates each round's sizes at once, on arrays
(``estimate.engine.estimate_layouts``: 21 powers of two, then rounds of up to 1,024 sizes); with
other methods and with ``--by trace`` one size at a time (an exponential then a binary search,
about 2·log2(answer) estimates). Either way the answer and the first size that does not fit are
then estimated as full reports.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import TrainmemError
from ..progress import progress
from ..report import MemoryReport
from ..spec.hardware import handle_workspace
from ..spec.resolve import TRAINING_DEFAULTS, Resolved
from ._common import Evaluator, refuse_one_stage, refuse_varying_lengths
from .suggest import Suggestion, suggest_for

BATCH_CAP = 1 << 20   # largest micro-batch the search tries
SEQ_CAP = 1 << 22     # longest sequence tried when the model has no learned-position limit


@dataclass
class FitResult:
    """The answer of ``fit``: the searched size and the memory at it.

    ``search`` is ``"batch_size"`` or ``"seq_len"``. When nothing fits (not even one step of the
    search), ``fits`` is False, the searched value is None and ``report`` is the smallest size
    tried, with ``suggestions`` for making it fit. ``limited_by`` says what stopped the search:
    ``memory``, ``max_positions`` (learned positions) or ``search_cap``.
    """

    model: str
    gpu: str
    capacity: int
    limit: int
    search: str
    batch_size: int | None
    seq_len: int | None
    fits: bool
    peak_allocated: int
    device_used: int
    margin: int
    limited_by: str
    step: int
    evaluations: int
    method: str
    report: MemoryReport = field(repr=False)
    next_value: int | None = None              # first size that does not fit (None when capped)
    next_device_used: int | None = None
    suggestions: list[Suggestion] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The answer as JSON-ready data (what ``trainmem fit --json`` prints)."""
        return {"batch_size": self.batch_size, "seq_len": self.seq_len, "peak_allocated": self.peak_allocated,
                "device_used": self.device_used, "margin": self.margin, "fits": self.fits,
                "search": self.search, "step": self.step, "limited_by": self.limited_by, "model": self.model,
                "gpu": self.gpu, "capacity": self.capacity, "limit": self.limit, "method": self.method,
                "next": None if self.next_value is None else {self.search: self.next_value,
                                                              "device_used": self.next_device_used},
                "evaluations": self.evaluations,
                "suggestions": [s.to_dict() for s in self.suggestions]}


def search_max(fits, k_max: int) -> tuple[int, int | None]:
    """Largest k in [1, k_max] with ``fits(k)`` true, for ``fits`` monotone (true then false).

    Returns (k, first failing k or None); k = 0 when ``fits(1)`` is false. Exponential search from
    1 by doubling, then binary search in the bracket.
    """
    lo, hi = 0, None
    k = 1
    while True:
        kk = min(k, k_max)
        if fits(kk):
            lo = kk
            if kk == k_max:
                break
            k *= 2
        else:
            hi = kk
            break
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    return lo, hi


def search_max_many(fits_many, k_max: int, width: int = 1024) -> tuple[int, int | None, int]:
    """``search_max`` with ``fits_many(ks)`` answering for an array of sizes at once: the powers
    of two up to ``k_max``, then rounds of up to ``width`` evenly spread sizes inside the bracket.
    Returns (k, first failing k or None, sizes evaluated)."""
    ks = np.unique(np.minimum(1 << np.arange(k_max.bit_length() + 1), k_max))
    ok = fits_many(ks)
    evaluated = len(ks)
    if ok.all():
        return k_max, None, evaluated
    bad = int(np.argmin(ok))              # the first size that does not fit
    lo, hi = (int(ks[bad - 1]) if bad else 0), int(ks[bad])
    while hi - lo > 1:
        cand = np.unique(np.linspace(lo + 1, hi - 1, min(width, hi - lo - 1)).astype(np.int64))
        ok = fits_many(cand)
        evaluated += len(cand)
        if ok.any():
            lo = int(cand[ok].max())
        if not ok.all():
            hi = int(cand[~ok].min())
    return lo, hi, evaluated


def fit(model: Any, gpu: Any = None, by: str = "estimate", seq_multiple: int = 128, suggestions: bool = True,
        **options: Any) -> FitResult:
    """The largest micro-batch (``seq_len`` given) or the longest sequence (``batch_size`` given,
    in multiples of ``seq_multiple``) that fits ``gpu``.

    ``options`` are those of ``trainmem.estimate`` (method, precision, zero, tp, recompute,
    gpu_memory, context_memory, max_fraction, ...); ``model`` may be a ``Resolved``. The inputs
    are resolved once; every probe replaces the searched field (``Resolved.replace``). The
    sequence step is the least common multiple of ``seq_multiple`` and what the layout needs
    (``cp``; ``tp`` under sequence parallelism). ``by="trace"`` uses the tracer
    (``trainmem.trace.api``) instead of the formulas.
    """
    refuse_varying_lengths(options)
    refuse_one_stage(options, "fit")
    seq_len, batch_size = options.pop("seq_len", None), options.pop("batch_size", None)
    if seq_len is not None and batch_size is not None:
        raise TrainmemError("fit searches one size: give seq_len (to find the largest micro-batch) or "
                            "batch_size (to find the longest sequence), not both")
    if not isinstance(seq_multiple, int) or seq_multiple <= 0:
        raise TrainmemError(f"--seq-multiple must be a positive integer, got {seq_multiple!r}")
    if seq_len is None and batch_size is None:
        # an image model's sequence is its image size's patches (--image-size), a speech seq2seq model's its
        # encoder's fixed positions (Whisper): the micro-batch is searched
        ev = Evaluator(model, by=by, gpu=gpu, **options)
        if not (ev.model.is_image or ev.model.is_speech_seq2seq):
            raise TrainmemError("fit needs --seq-len N (to find the largest micro-batch) or --batch-size N "
                                "(to find the longest sequence)")
        search, step, fixed, k_max, cap_reason = "batch_size", 1, {}, BATCH_CAP, "search_cap"
    elif seq_len is not None:
        ev = Evaluator(model, by=by, gpu=gpu, seq_len=seq_len, **options)
        search, step, fixed, k_max, cap_reason = "batch_size", 1, {"seq_len": seq_len}, BATCH_CAP, "search_cap"
    else:
        from ..spec.resolve import model_of
        # the model alone (no setup checks), resolved once: the Evaluator takes it (its overrides and task applied)
        fixed_model = model.model if isinstance(model, Resolved) else model_of(model, options)
        if not isinstance(model, Resolved):
            model, options = fixed_model, {k: v for k, v in options.items() if k not in ("set", "overrides", "task")}
        if fixed_model.is_image or fixed_model.is_speech_seq2seq:
            raise TrainmemError(f"fit --batch-size {batch_size}: {fixed_model.name}'s sequence is fixed (its "
                                f"{'image size' if fixed_model.is_image else 'encoder length'}), there is no longer "
                                f"one to search: drop --batch-size to search the micro-batch")
        step = math.lcm(seq_multiple, *_seq_divisors(model, options))
        ev = Evaluator(model, by=by, gpu=gpu, batch_size=batch_size, seq_len=step, **options)
        search, fixed, m = "seq_len", {"batch_size": batch_size}, ev.model
        if m.learned_positions:
            k_max, cap_reason = m.max_positions // step, "max_positions"
        else:
            k_max, cap_reason = SEQ_CAP // step, "search_cap"
    if ev.hardware is None:
        raise TrainmemError("fit needs a GPU: give --gpu NAME or --gpu-memory SIZE")
    return _search(ev, by, search, step, fixed, k_max, cap_reason, suggestions)


def _seq_divisors(model: Any, options: dict[str, Any]) -> tuple[int, int]:
    """What every searched sequence length must be a multiple of: ``cp``, and ``tp`` under sequence
    parallelism, read from the options (over ``training=`` or a ``Resolved`` model's setup)."""
    base = options.get("training") or (model.training if isinstance(model, Resolved) else None)

    def given(key: str) -> Any:
        """The option ``key``: given, else the base setup's, else TrainingSpec's default."""
        v = options.get(key)
        return v if v is not None else getattr(base, key) if base is not None else TRAINING_DEFAULTS[key]

    return int(given("cp")), int(given("tp")) if given("sequence_parallel") else 1


def _search(ev: Evaluator, by: str, search: str, step: int, fixed: dict[str, int], k_max: int, cap_reason: str,
            suggestions: bool) -> FitResult:
    """Search the largest ``k`` whose size ``k * step`` fits, replacing ``search`` in the resolved
    setup for every probe, and describe the answer."""
    limit = ev.limit
    assert limit is not None and ev.hardware is not None
    cache: dict[int, MemoryReport] = {}

    def fits(k: int) -> bool:
        """Whether size ``k * step`` fits (each size estimated once)."""
        if k not in cache:
            cache[k] = ev.report(**{search: k * step})
        return cache[k].device_peak <= limit

    if by == "estimate" and ev.method == "trainmem":
        k, first_bad, evaluated = search_max_many(_fits_many(ev, search, step, limit), k_max)
        for size in (k or 1, first_bad):   # full reports of the answer and the first size that fails
            if size is not None:
                fits(size)
    else:  # one report per size: by trace a counter on stderr (trainmem.progress; the CLI enables it)
        with progress(None, f"fit --by {by}", None if by == "trace" else False) as bar:
            def tried(size: int) -> bool:
                """``fits(size)``, counted on the progress bar."""
                bar.describe(f"{search} {size * step}")
                ok_ = fits(size)
                bar.update(1)
                return ok_
            k, first_bad = search_max(tried, k_max)
        evaluated = len(cache)
    ok = k > 0
    rep = cache[k if ok else 1]
    sugg: list[Suggestion] = []
    if not ok and suggestions:
        sugg = suggest_for(ev, rep, **fixed, **{search: step})
    bad_rep = cache.get(first_bad) if first_bad is not None else None
    found = k * step if ok else None
    return FitResult(
        model=ev.model.name, gpu=ev.hardware.name, capacity=ev.hardware.capacity, limit=limit, search=search,
        batch_size=found if search == "batch_size" else fixed["batch_size"],
        seq_len=found if search == "seq_len" else fixed.get("seq_len", rep.training.seq_len),
        fits=ok, peak_allocated=rep.peak_allocated, device_used=rep.device_peak, margin=limit - rep.device_peak,
        limited_by="memory" if first_bad is not None else cap_reason, step=step, evaluations=evaluated,
        method=ev.method if by == "estimate" else "trace", report=rep,
        next_value=None if first_bad is None else first_bad * step,
        next_device_used=None if bad_rep is None else bad_rep.device_peak, suggestions=sugg)


def _fits_many(ev: Evaluator, search: str, step: int, limit: int):
    """Whether each of an array of sizes ``k * step`` fits, from the estimate engine on arrays (the
    same bytes as ``trainmem.estimate``; device memory = reserved + the GPU's context)."""
    from ..estimate.engine import estimate_layouts
    base, context = ev.resolved.training, ev.hardware.context

    def fits_many(ks: np.ndarray) -> np.ndarray:
        out = estimate_layouts(ev.model, base, handle_workspace(ev.hardware, base), ev.hardware.capability,
                               ev.hardware.capacity - ev.hardware.context, **{search: ks * step})
        return out["peak_reserved"] + context <= limit
    return fits_many
