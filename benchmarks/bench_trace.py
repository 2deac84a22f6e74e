"""Speed and host memory of ``trace`` on full-size models, each case in a fresh process:

* ``7b``: Llama-2-7B, one sequence of 4096 tokens, bf16 autocast, AdamW, two training steps on one
  emulated GPU; target < 60 s;
* ``70b-fsdp64`` and ``70b-fsdp64-recompute``: Llama-3.1-70B under FSDP2 over 64 ranks of a fake
  process group (rank 0 traced), 8192 tokens, bf16 autocast, without and with full recompute
  (``trainmem trace llama-3.1-70b --fsdp full --dp 64 --seq-len 8192 --batch-size 1``); target
  < 20 s (issue 11);
* ``405b-tp8-fsdp8``: Llama-3.1-405B, tensor parallel 8 x FSDP2 over 8, sequence parallel, 8192
  tokens, bf16-mp, full recompute: one rank holding all 126 layers, a harder case than the issue's;
* ``405b-tp8-pp14``: Llama-3.1-405B, tensor parallel 8 x pipeline 14 (Schedule1F1B, 14
  micro-batches), 8192 tokens, bf16 autocast, full recompute: the first and the last stage traced.
  Issue 11 names TP 8 x PP 16 x DP 8; PP 16 does not divide the 126 layers evenly, so this was the
  nearest layout it ran before torchtitan's weighted split;
* ``405b-tp8-pp16-dp8``: the issue's layout, Llama-3.1-405B, tensor parallel 8 (sequence parallel) x
  pipeline 16 x FSDP2 full over 8 on a (pp, dp, tp) mesh of 1024 fake ranks, torchtitan's stage split
  (embeddings and head one layer each: 7, 8 x 14, 7 layers), Schedule1F1B over 16 micro-batches
  (``--grad-sync step``, as PipelineStage runs FSDP2), 8192 tokens, bf16-mp (torchtitan's FSDP
  mixed precision), full recompute (torchtitan's 405B config): stages 0, 1 and 15 traced, each a
  rank of its own; target < 60 s for the worst rank's trace (``rank_s``: each traced rank's own
  wall and CPU time), < 4 GB.

    .venv/bin/python benchmarks/bench_trace.py                    # every case, one table each
    .venv/bin/python benchmarks/bench_trace.py --case 7b --profile  # one case and cProfile's hot spots

Targets on the 2-core development machine: the wall times above and < 4 GB peak host memory. The
trace holds no data (tensors live on the ``meta`` device), so host memory is the interpreter,
torch, transformers and the tracker's records; time goes into the Python work per ATen op
(dispatch mode, allocator simulation, weakref finalizers). Host memory is the process's peak
resident set (``resource.getrusage``, ``ru_maxrss``) — measured in a fresh process, since the peak
of the benchmark's own process would include whatever ran before it — and the peak of Python
allocations during the trace (``tracemalloc``, optional: it slows the run down).

The table also prints the trace's own result (peak allocated, reserved, where) next to
``estimate`` for the same setup.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import resource
import subprocess
import sys
import time

#: case -> (model, setup, wall-time target in seconds)
CASES = {
    "7b": ("llama-2-7b", dict(batch_size=1, seq_len=4096, precision="bf16-amp", optimizer="adamw"), 60.0),
    "70b-fsdp64": ("llama-3.1-70b", dict(batch_size=1, seq_len=8192, precision="bf16-amp", fsdp="full", dp=64),
                   20.0),
    "70b-fsdp64-recompute": ("llama-3.1-70b", dict(batch_size=1, seq_len=8192, precision="bf16-amp", fsdp="full",
                                                   dp=64, recompute="full"), 20.0),
    "405b-tp8-fsdp8": ("llama-3.1-405b", dict(batch_size=1, seq_len=8192, precision="bf16-mp", fsdp="full", dp=8,
                                              tp=8, sequence_parallel=True, recompute="full"), 60.0),
    "405b-tp8-pp14": ("llama-3.1-405b", dict(batch_size=1, seq_len=8192, precision="bf16-amp", tp=8, pp=14,
                                             grad_accum=14, recompute="full"), 60.0),
    "405b-tp8-pp16-dp8": ("llama-3.1-405b", dict(batch_size=1, seq_len=8192, precision="bf16-mp", tp=8, pp=16,
                                                 dp=8, fsdp="full", grad_sync="step", sequence_parallel=True,
                                                 grad_accum=16, recompute="full", pp_first_stage_less_layers=1,
                                                 pp_last_stage_less_layers=1), 60.0),
}
MODEL, SETUP, TARGET_S = CASES["7b"]
STEPS = 2
TARGET_RSS = 4 * 10 ** 9
GiB = 2 ** 30


def run_once(trace_malloc: bool = False, profile: bool = False, case: str = "7b") -> dict:
    """One trace of ``case`` in this process; returns timings, memory and the report's numbers."""
    model, setup, _ = CASES[case]
    t0 = time.perf_counter()
    import torch  # noqa: F401  (import cost reported separately)
    import transformers  # noqa: F401
    from trainmem.estimate.engine import estimate
    from trainmem.spec import TrainingSpec, resolve_model
    from trainmem.trace.api import trace
    t_import = time.perf_counter() - t0
    if trace_malloc:
        import tracemalloc
        tracemalloc.start()
    prof = cProfile.Profile() if profile else None
    ranks = _time_ranks()
    t1 = time.perf_counter()
    if prof:
        prof.enable()
    report = trace(model, steps=STEPS, **setup)
    if prof:
        prof.disable()
    t_trace = time.perf_counter() - t1
    py_peak = None
    if trace_malloc:
        import tracemalloc
        py_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    est = estimate(resolve_model(model), TrainingSpec(**setup, keep_logits=False))
    out = {
        "import_s": t_import, "trace_s": t_trace, "wall_s": time.perf_counter() - t0,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "tracemalloc_peak": py_peak,
        "peak_allocated": report.peak_allocated, "peak_reserved": report.peak_reserved,
        "peak_phase": report.peak_phase, "peak_where": report.peak_where,
        "events": report.extra["events"], "ops": report.extra["ops"],
        "estimate_peak": est.peak_allocated, "estimate_stage": est.extra.get("pipeline_stage"),
        "cpu_s": sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), "rank_s": ranks,
        "worst_rank": report.extra.get("rank"), "traced_ranks": report.extra.get("traced_ranks"),
        "rank_peaks": {e["rank"]: e["peak_allocated"] for e in report.extra.get("ranks", []) if e.get("traced")},
    }
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
    return out


def _time_ranks() -> dict:
    """{rank: (wall s, CPU s)} of each rank ``trace`` traces (``trace.api._trace_rank``: the model
    built, sharded or cut, and the steps run, on that rank's own emulated GPU), filled as they run."""
    from trainmem.trace import api
    times: dict = {}
    orig = api._trace_rank

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        rank = args[-2]
        w, c = time.perf_counter(), time.process_time()
        try:
            return orig(*args, **kwargs)
        finally:
            times[rank] = (time.perf_counter() - w, time.process_time() - c)
    api._trace_rank = timed
    return times


def fresh_process(trace_malloc: bool, profile: bool, case: str) -> dict:
    """Run ``run_once`` in a new interpreter so that ``ru_maxrss`` is this trace's own peak."""
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--case", case]
    if trace_malloc:
        cmd.append("--tracemalloc")
    if profile:
        cmd.append("--profile")
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append", help="run only this case (repeatable)")
    ap.add_argument("--profile", action="store_true", help="cProfile the trace and print the hot spots")
    ap.add_argument("--tracemalloc", action="store_true", help="also the peak of Python allocations (slower)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(run_once(a.tracemalloc, a.profile, (a.case or ["7b"])[0])))
        return 0
    ok = True
    for case in a.case or list(CASES):
        ok = report_case(case, fresh_process(a.tracemalloc, a.profile, case)) and ok
    return 0 if ok else 1


def report_case(case: str, r: dict) -> bool:
    """Print one case's table; whether it met its targets."""
    model, setup, target_s = CASES[case]
    ok_t = r["wall_s"] < target_s
    ok_m = r["maxrss"] < TARGET_RSS
    layout = ", ".join(f"{k} {v}" for k, v in setup.items() if k not in ("batch_size", "seq_len", "precision"))
    print(f"\n[{case}] trace {model}, batch {setup['batch_size']} x seq {setup['seq_len']}, {setup['precision']}, "
          f"{layout}, {STEPS} steps — Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'quantity':44s} {'value':>14s}  target")
    print(f"{'imports (torch, transformers, trainmem)':44s} {r['import_s']:12.2f} s")
    print(f"{'trace (build model, 2 steps, report)':44s} {r['trace_s']:12.2f} s")
    if len(r.get("rank_s") or {}) > 1:  # a pipeline: the target is the worst rank's own trace
        worst = str(r["worst_rank"])
        ok_t = r["rank_s"][worst][0] < target_s
        for rank, (w, c) in sorted(r["rank_s"].items(), key=lambda x: int(x[0])):
            mark = f"< {target_s:.0f} s {'ok' if ok_t else 'MISSED'} (the worst)" if rank == worst else ""
            print(f"{f'rank {rank}: wall / CPU, peak':44s} {w:8.2f} / {c:.2f} s, "
                  f"{r['rank_peaks'][rank] / GiB:.2f} GiB {mark}")
        print(f"{'wall time in the process':44s} {r['wall_s']:12.2f} s")
    else:
        print(f"{'wall time in the process':44s} {r['wall_s']:12.2f} s  < {target_s:.0f} s "
              f"{'ok' if ok_t else 'MISSED'}")
    print(f"{'CPU time in the process (user + system)':44s} {r['cpu_s']:12.2f} s  (load average "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'peak resident memory (ru_maxrss)':44s} {r['maxrss'] / 1e9:12.2f} GB < {TARGET_RSS / 1e9:.0f} GB "
          f"{'ok' if ok_m else 'MISSED'}")
    if r["tracemalloc_peak"] is not None:
        print(f"{'peak Python allocations (tracemalloc)':44s} {r['tracemalloc_peak'] / 1e6:12.1f} MB")
    print(f"{'ATen ops seen / allocator events':44s} {r['ops']:>8,d} / {r['events']:,d}")
    print(f"{'traced peak allocated':44s} {r['peak_allocated'] / GiB:12.2f} GiB at {r['peak_phase']}: "
          f"{r['peak_where']}")
    print(f"{'traced peak reserved':44s} {r['peak_reserved'] / GiB:12.2f} GiB")
    print(f"{'estimate (same setup, keep_logits=False)':44s} {r['estimate_peak'] / GiB:12.2f} GiB "
          f"({100 * (r['estimate_peak'] / r['peak_allocated'] - 1):+.2f}%)"
          + (f", its worst stage {r['estimate_stage']}" if r.get("estimate_stage") else ""))
    if r.get("profile"):
        print("\n--- cProfile of the trace (sorted by own time) ---")
        print(r["profile"])
    return ok_t and ok_m


if __name__ == "__main__":
    sys.exit(main())
