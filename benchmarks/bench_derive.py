"""Speed of derived coefficients (any architecture): deriving them, and estimating with them.

    .venv/bin/python benchmarks/bench_derive.py

1. derive: the coefficients of a 70B-class config from nothing (an empty cache; the profile is
   built too), timed after torch and transformers are imported (their import is reported apart).
   Llama-3.1-70B and Qwen2.5-72B are read as derived architectures (their hand formulas bypassed),
   DeepSeek-V3 (671B, layers of two kinds) as what it is. Target: under 10 s each (2 cores).
2. estimate: estimates per second with cached coefficients against the hand formulas on the same
   config, over 2,000 (batch, sequence) setups with the engine's quantities cached per setup as
   in a sweep. Target: as fast as the hand formulas (within 10%).
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
import time

os.environ["TRAINMEM_CACHE"] = tempfile.mkdtemp(prefix="trainmem-bench-derive-")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import trainmem  # noqa: E402
from trainmem.estimate import derived, engine  # noqa: E402
from trainmem.spec import load_config  # noqa: E402
from trainmem.spec.resolve import resolve  # noqa: E402

TARGET_DERIVE_S = 10.0


def as_derived(name: str) -> dict:
    return dict(load_config(name)[1], _trainmem={"family": "derived"})


def bench_derive() -> bool:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from trainmem.trace import derive  # noqa: F401
    print(f"import torch + transformers + trainmem.trace: {time.perf_counter() - t0:.1f} s")
    ok = True
    for label, model in [("llama-3.1-70b (derived)", as_derived("llama-3.1-70b")),
                         ("qwen2.5-72b (derived)", as_derived("qwen2.5-72b")),
                         ("deepseek-v3 (671B, 2 layer kinds)", "deepseek-v3")]:
        r = resolve(model, precision="bf16-amp", attention="sdpa", seq_len=4096, recompute="none")
        t0 = time.perf_counter()
        from trainmem.trace.derive import derive_coefficients
        derive_coefficients(r.model, derived._canonical(r.training), derived.regime(r.model, r.training))
        dt = time.perf_counter() - t0
        ok &= dt < TARGET_DERIVE_S
        print(f"derive {label:36s} {dt:6.2f} s   target < {TARGET_DERIVE_S:.0f} s  "
              f"{'ok' if dt < TARGET_DERIVE_S else 'MISSED'}")
    return ok


def bench_estimate() -> bool:
    rng = random.Random(0)
    setups = [(rng.choice((1, 2, 4, 8)), rng.choice((1024, 2048, 4096, 8192))) for _ in range(2000)]
    rates = {}
    for label, model in [("hand formulas", "llama-3.1-70b"), ("derived", as_derived("llama-3.1-70b"))]:
        base = resolve(model, precision="bf16-amp", seq_len=4096)
        specs = [base.replace(batch_size=b, seq_len=s) for b, s in setups]
        engine.estimate(base.model, base.training)  # derive / load once
        t0 = time.perf_counter()
        for r in specs:
            engine.estimate(r.model, r.training)
        rates[label] = len(specs) / (time.perf_counter() - t0)
        print(f"estimate ({label:13s}) {rates[label]:8,.0f} /s")
    ok = rates["derived"] >= 0.9 * rates["hand formulas"]
    print(f"derived / hand: {rates['derived'] / rates['hand formulas']:.2f}  target >= 0.9  {'ok' if ok else 'MISSED'}")
    return ok


if __name__ == "__main__":
    print(f"cores: {os.cpu_count()}  python {sys.version.split()[0]}")
    good = bench_derive() & bench_estimate()
    sys.exit(0 if good else 1)
