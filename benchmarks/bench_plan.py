"""Speed of the planner and of fit: one comparable table.

Rows:
  plan      `trainmem plan llama-3.1-70b --gpus 512 --gpu h100 --seq-len 4096 --global-batch 1024`:
            enumerate, vectorised memory, step-time model, ranking, exact re-estimate of the top 5;
            layouts/s = valid layouts / wall time (target >= 200,000/s)
  memory    the estimate engine on arrays alone (estimate.engine.estimate_layouts), same layouts
  scalar    trainmem.estimate one layout at a time (what the vectorisation replaces)
  fit       `trainmem fit` searches (exponential + binary) with their estimate counts

Each timing is the median of several runs after a warm-up. Run: .venv/bin/python benchmarks/bench_plan.py
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import numpy as np  # noqa: E402

import trainmem  # noqa: E402
from trainmem.plan import fit, plan  # noqa: E402
from trainmem.plan.planner import LAYOUT_FIELDS, REC_NAMES, enumerate_layouts  # noqa: E402
from trainmem.estimate.engine import estimate_layouts  # noqa: E402
from trainmem.spec import TrainingSpec, get_gpu  # noqa: E402

MiB = 2**20


def timed(fn, runs: int) -> tuple[float, float, object]:
    """(first call, median of ``runs`` further calls, result): the first call fills the estimator's
    caches (per-setup model states); the median is the warm figure."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return first, statistics.median(ts), out


def main() -> int:
    rows: list[tuple[str, ...]] = []

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f} ms"
    m = trainmem.resolve_model("llama-3.1-70b")
    hw = get_gpu("h100")

    t1, t, r = timed(lambda: plan(m, 512, seq_len=4096, global_batch=1024, gpu="h100", top=5), 15)
    rows.append(("plan", "llama-3.1-70b, 512 x h100, seq 4096, batch 1024",
                 f"{r.valid:,} layouts ({r.fitting:,} fit)", ms(t1), ms(t), f"{r.valid / t:,.0f} layouts/s"))
    plan_rate = r.valid / t

    filters = {"zero": [0, 1, 2, 3], "rec": [0, 1, 2]}
    a, _ = enumerate_layouts(m, 512, 4096, 1024, filters)
    base = TrainingSpec(seq_len=4096)

    def memory():
        from trainmem.estimate.quantities.build import clear_cache
        clear_cache()  # every run computes the quantities of each parallel shape afresh
        return estimate_layouts(m, base, tp=a["tp"], pp=a["pp"], cp=a["cp"], dp=a["dp"], zero=a["zero"],
                                recompute=a["rec"], sequence_parallel=a["tp"] > 1, batch_size=a["b"],
                                grad_accum=a["ga"])
    t1, t, _ = timed(memory, 15)
    n = len(a["tp"])
    rows.append(("memory", "estimate_layouts (engine on arrays), same layouts", f"{n:,} layouts", ms(t1), ms(t),
                 f"{n / t:,.0f} layouts/s"))

    idx = np.random.default_rng(0).choice(n, 200, replace=False)

    def scalar():
        for i in idx:
            trainmem.estimate(m, gpu=hw, seq_len=4096, tp=int(a["tp"][i]), pp=int(a["pp"][i]), cp=int(a["cp"][i]),
                              dp=int(a["dp"][i]), zero=int(a["zero"][i]), recompute=REC_NAMES[int(a["rec"][i])],
                              batch_size=int(a["b"][i]), grad_accum=int(a["ga"][i]),
                              sequence_parallel=int(a["tp"][i]) > 1)
    t1, t, _ = timed(scalar, 3)
    rows.append(("scalar", "trainmem.estimate, 200 of those layouts", "200 layouts", ms(t1), ms(t),
                 f"{200 / t:,.0f} layouts/s"))

    bert = trainmem.resolve_model("bert-large-uncased", overrides=['architectures=["BertForSequenceClassification"]'])
    nb = dict(method="bert-notebook", gpu_memory="24GiB", context_memory=round(895.04 * MiB) + 300 * MiB,
              precision="fp32", attention="eager")
    cases = [
        ("fit batch", "llama-3.1-8b h100 seq 4096 flash+full recompute+zero3/8",
         lambda: fit("llama-3.1-8b", gpu="h100", seq_len=4096, attention="flash", recompute="full", dp=8, zero=3)),
        ("fit seq", "llama-3.1-8b h100 batch 1 flash+full recompute+zero3/8",
         lambda: fit("llama-3.1-8b", gpu="h100", batch_size=1, attention="flash", recompute="full", dp=8, zero=3)),
        ("fit batch", "bert-large seq-cls, bert-notebook, 24 GiB, seq 512", lambda: fit(bert, seq_len=512, **nb)),
        ("fit seq", "bert-large seq-cls, bert-notebook, 24 GiB, batch 16", lambda: fit(bert, batch_size=16,
                                                                                      seq_multiple=16, **nb)),
    ]
    for name, what, fn in cases:
        t1, t, res = timed(fn, 5)
        value = res.batch_size if res.search == "batch_size" else res.seq_len
        rows.append((name, what, f"answer {value}, {res.evaluations} estimates", ms(t1), ms(t),
                     f"{res.evaluations / t:,.0f} estimates/s"))

    print(f"trainmem plan/fit benchmark — python {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs")
    head = ("bench", "case", "work", "first call", "median", "throughput")
    w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print("  ".join(h.ljust(w[i]) if i < 3 else h.rjust(w[i]) for i, h in enumerate(head)))
    print("  ".join("-" * x for x in w))
    for r in rows:
        print("  ".join(c.ljust(w[i]) if i < 3 else c.rjust(w[i]) for i, c in enumerate(r)))
    target = 200_000
    print(f"plan target >= {target:,} layouts/s: {'met' if plan_rate >= target else 'NOT met'} "
          f"({plan_rate:,.0f}/s)")
    return 0 if plan_rate >= target else 1


if __name__ == "__main__":
    raise SystemExit(main())
