"""``trainmem measure`` and ``trainmem compare`` (registered by ``trainmem.cli``).

Importing this module must not import torch: the CLI imports it at startup. Everything that
needs torch is imported inside the command functions.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from ..errors import TrainmemError


def _device(text: str) -> str:
    t = text.strip().lower()
    if t in ("cpu", "cuda") or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise argparse.ArgumentTypeError(f"{text!r}: use cpu, cuda or cuda:N")


def _quiet_transformers() -> None:
    try:
        import transformers
    except ImportError as e:
        raise TrainmemError(f"measure needs torch and transformers ({e.name} is missing): "
                            f"pip install 'trainmem[trace]'") from None
    transformers.logging.set_verbosity_error()


def _options(a: argparse.Namespace) -> dict[str, Any]:
    from ..cli import training_options
    opts = training_options(a)
    opts.pop("optimizer_bucket_mb", None)
    return opts


def _fmt_bytes(n: int | None, units: str) -> str:
    from ..units import fmt
    if n is None:
        return "-"
    if abs(n) < 2**30 and units == "GiB":
        return f"{n / 2**20:,.2f} MiB"
    if abs(n) < 10**9 and units == "GB":
        return f"{n / 10**6:,.2f} MB"
    return fmt(n, units)


def measure_details(r: Any, units: str = "GiB") -> str:
    """What a measured report adds to the common table: driver figures and CUDA context per phase,
    the out-of-memory diagnosis, notes and files written."""
    ex = r.extra
    lines: list[str] = []
    rows = ex.get("phases") or []
    if rows and r.peak_allocated < (2**30 if units == "GiB" else 10**9):
        lines.append("")
        lines.append("phases in bytes (the table above rounds small runs away)")
        lines.append(f"{'step':>4s}  {'phase':24s} {'allocated':>16s} {'peak':>16s} {'reserved':>16s}  peak at")
        for p in rows:
            res = "-" if p["reserved"] is None else f"{p['reserved']:,d}"
            lines.append(f"{p['step']:>4d}  {p['name']:24s} {p['allocated']:>16,d} {p['peak']:>16,d} {res:>16s}  "
                         f"{p.get('where', '')}")
    if any("driver_used" in p for p in rows):
        src = next((p.get("driver_source") for p in rows if p.get("driver_source")), "")
        lines.append("")
        lines.append(f"driver's view per phase ({src}; context = driver − reserved)")
        lines.append(f"{'step':>4s}  {'phase':24s} {'allocated':>14s} {'reserved':>14s} {'driver used':>14s} "
                     f"{'this process':>14s} {'context':>14s}")
        for p in rows:
            lines.append(f"{p['step']:>4d}  {p['name']:24s} {_fmt_bytes(p['allocated'], units):>14s} "
                         f"{_fmt_bytes(p['reserved'], units):>14s} {_fmt_bytes(p.get('driver_used'), units):>14s} "
                         f"{_fmt_bytes(p.get('process_used'), units):>14s} "
                         f"{_fmt_bytes(p.get('cuda_context'), units):>14s}")
    oom = ex.get("oom")
    if oom:
        lines.append("")
        lines.append(f"OUT OF MEMORY in {oom['phase']}: {oom['message']}")
        lines.append(f"  live then: allocated {_fmt_bytes(oom.get('allocated'), units)}"
                     + (f", reserved {_fmt_bytes(oom.get('reserved'), units)}" if oom.get("reserved") is not None
                        else "")
                     + (f"; the refused allocation {_fmt_bytes(oom.get('requested'), units)}"
                        if oom.get("requested") else ""))
        for kind, b in sorted((oom.get("by_kind") or {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"    {kind:56s} {_fmt_bytes(b, units):>14s}")
        if oom.get("largest"):
            lines.append("  largest live tensors:")
            for t in oom["largest"]:
                shape = "x".join(str(x) for x in t.get("shape") or []) or "-"
                where = f" (allocated in {t['allocated_in']})" if t.get("allocated_in") else ""
                lines.append(f"    {_fmt_bytes(t['bytes'], units):>14s}  {t.get('category', ''):24s} "
                             f"{t.get('dtype', ''):9s} {shape:20s} {t.get('name', '')[:60]}{where}")
        fit = oom.get("fit")
        if fit:
            if fit.get("batch_size"):
                lines.append(f"  what would fit: micro-batch {fit['batch_size']} at sequence "
                             f"{r.training.seq_len} on {fit.get('on')} (trainmem.plan.fit, {fit.get('method')}: "
                             f"{_fmt_bytes(fit.get('device_used'), units)} of {_fmt_bytes(fit.get('limit'), units)})")
            elif fit.get("note"):
                lines.append(f"  what would fit: {fit['note']}")
            else:
                lines.append(f"  what would fit: not even micro-batch 1 at sequence {r.training.seq_len} on "
                             f"{fit.get('on')} (trainmem.plan.fit); try `trainmem estimate ... --gpu` for suggestions")
    for n in ex.get("notes") or []:
        lines.append(f"note: {n}")
    for f in ex.get("files") or []:
        lines.append(f"written: {f}")
    env = ex.get("environment") or {}
    dev = env.get("gpu") or f"cpu ({env.get('cpu', '')}, {env.get('threads')} threads)"
    lines.append(f"measured on {dev} · torch {env.get('torch')} · transformers {env.get('transformers')}"
                 + (f" · CUDA {env.get('cuda')} · driver {env.get('driver')}" if env.get("gpu") else "")
                 + f" · {ex.get('steps')} step{'' if ex.get('steps') == 1 else 's'} in {ex.get('runtime_s')} s")
    return "\n".join(lines)


def command_line(a: argparse.Namespace) -> str:
    """The command that reproduces a parsed ``measure`` run: every option that differs from its
    default, in the parser's order."""
    p: argparse.ArgumentParser = a._parser
    words = ["trainmem", "measure", a.model]
    for act in p._actions:
        if not act.option_strings or act.dest in ("help", "model"):
            continue
        v = getattr(a, act.dest, None)
        if v is None or v == act.default:
            continue
        flag = act.option_strings[-1] if act.option_strings[-1].startswith("--") else act.option_strings[0]
        if isinstance(act, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(act, argparse._AppendAction):
            for x in v:
                words += [flag, str(x)]
        else:
            words += [flag, str(v)]
    return " ".join(shlex.quote(w) for w in words)


def _check_common(a: argparse.Namespace) -> None:
    if a.max_fraction is not None and a.gpu is None and a.gpu_memory is None and not a.device.startswith("cuda") \
            and getattr(a, "memory_limit", None) is None:
        raise TrainmemError("--max-fraction needs a memory to compare with: --gpu NAME, --gpu-memory SIZE, "
                            "--memory-limit SIZE or --device cuda")


def cmd_measure(a: argparse.Namespace) -> int:
    _check_common(a)
    if a.find_max_batch:
        bad = [f for f, v in (("--snapshot", a.snapshot), ("--html", a.html), ("--profile", a.profile),
                              ("--save-fixture", a.save_fixture)) if v]
        if bad:
            raise TrainmemError(f"--find-max-batch runs many tries; it does not take {', '.join(bad)}")
        return _find_max_batch(a)
    if a.save_fixture and not a.save_fixture.endswith(".json"):
        raise TrainmemError(f"--save-fixture {a.save_fixture}: a fixture is a .json file")
    _quiet_transformers()
    from ..cli import _emit
    from .runner import fixture, measure
    r = measure(a.model, a.steps, device=a.device, overrides=a.set or None, gpu=a.gpu, gpu_memory=a.gpu_memory,
                context_memory=a.context_memory, max_fraction=a.max_fraction, memory_limit=a.memory_limit,
                snapshot=a.snapshot, html=a.html, profile=a.profile, largest=a.largest, seed=a.seed,
                empty_cache=a.empty_cache, predict_by=a.predict_by, **_options(a))
    code = _emit(r, a)
    if not a.json:
        print(measure_details(r, a.units))
    if a.save_fixture:
        if r.extra.get("oom"):
            sys.stderr.write("trainmem: no fixture written: the run ran out of memory\n")
        else:
            fx = fixture(r, command=command_line(a), name=a.fixture_name)
            with open(a.save_fixture, "w", encoding="utf-8") as f:
                json.dump(fx, f, indent=2)
                f.write("\n")
            if not a.json:
                print(f"fixture written: {a.save_fixture} ({len(fx['measured'])} quantities; "
                      f"`trainmem validate DIR` reads it)")
    return 1 if r.extra.get("oom") else code


def _find_max_batch(a: argparse.Namespace) -> int:
    _quiet_transformers()
    from .runner import find_max_batch
    opts = _options(a)
    opts.pop("batch_size", None)

    def show(row: dict[str, Any]) -> None:
        if a.json:
            return
        res = "runs" if row["ok"] else f"OOM in {row['oom_phase']}"
        print(f"  micro-batch {row['batch_size']:>6d}: {res:28s} peak allocated "
              f"{_fmt_bytes(row['peak_allocated'], a.units):>14s}"
              + (f", reserved {_fmt_bytes(row['peak_reserved'], a.units)}" if row["peak_reserved"] is not None else "")
              + f"  ({row['runtime_s']} s)", flush=True)

    if not a.json:
        lim = f", limit {_fmt_bytes(_limit_bytes(a.memory_limit), a.units)}" if a.memory_limit else ""
        print(f"trainmem measure --find-max-batch — {a.model} on {a.device}{lim}, sequence {a.seq_len}, "
              f"{a.steps} step(s) per try")
    res = find_max_batch(a.model, device=a.device, steps=a.steps, memory_limit=a.memory_limit,
                         batch_cap=a.batch_cap, gpu=a.gpu, gpu_memory=a.gpu_memory,
                         context_memory=a.context_memory, overrides=a.set or None, on_try=show,
                         predict_by=a.predict_by, **opts)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        if res["measured_max"]:
            tail = (f" (micro-batch {res['first_failing']} runs out of memory)" if res["first_failing"]
                    else f" (stopped at the cap {res['batch_cap']}, not by memory)")
            print(f"largest micro-batch that runs: {res['measured_max']}{tail}")
        else:
            print("not even micro-batch 1 runs")
        p = res["prediction"]
        if p.get("batch_size") is not None:
            print(f"predicted by trainmem.plan.fit ({p.get('method')}, on {p.get('on')}): {p['batch_size']}")
        else:
            print(f"predicted by trainmem.plan.fit: {p.get('note') or 'nothing fits'}")
    return 0 if res["measured_max"] else 1


def _limit_bytes(text: str) -> int:
    from ..units import parse_bytes
    return parse_bytes(text)


def cmd_compare(a: argparse.Namespace) -> int:
    _check_common(a)
    if a.trace or a.measure:
        _quiet_transformers()
    from .compare import compare_sources, render_comparison
    if a.reference and a.reference != "estimate" and not getattr(a, a.reference):
        raise TrainmemError(f"--reference {a.reference} needs --{a.reference}")
    c = compare_sources(a.model, trace=a.trace, measure=a.measure, device=a.device, steps=a.steps, method=a.method,
                        reference=a.reference, overrides=a.set or None, gpu=a.gpu, gpu_memory=a.gpu_memory,
                        context_memory=a.context_memory, max_fraction=a.max_fraction, **_options(a))
    if a.json:
        print(json.dumps(c.to_dict(), indent=2))
    else:
        print(render_comparison(c, a.units, a.bytes))
    return 0


def register(sub: Any) -> None:
    from ..cli import _positive_int, add_model_and_training
    p = sub.add_parser("measure", help="run real training steps (random weights) and record memory per phase")
    add_model_and_training(p)
    p.add_argument("--device", type=_device, default="cuda",
                   help="cuda (the CUDA caching allocator, default), cuda:N, or cpu (real tensors counted by "
                        "LiveBytes)")
    p.add_argument("--steps", type=_positive_int, default=2, help="training steps to run (default 2)")
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="fail allocations beyond SIZE with OutOfMemoryError (CPU: LiveBytes budget; CUDA: "
                        "torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--snapshot", default=None, metavar="FILE.pickle",
                   help="CUDA: save torch.cuda.memory._snapshot() with the allocation history (pytorch.org/memory_viz)")
    p.add_argument("--html", default=None, metavar="FILE.html",
                   help="CUDA: save the snapshot's torch.cuda._memory_viz trace_plot page")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler chrome trace (JSON, open in Perfetto) into DIR")
    p.add_argument("--find-max-batch", action="store_true",
                   help="probe the largest micro-batch that runs (doubling, then bisection; fresh model each try)")
    p.add_argument("--batch-cap", type=_positive_int, default=4096, metavar="N",
                   help="--find-max-batch stops at N (default 4096)")
    p.add_argument("--save-fixture", default=None, metavar="FILE.json",
                   help="write the run as a validation fixture (validation/measured/, read by `trainmem validate`)")
    p.add_argument("--fixture-name", default=None, metavar="TEXT", help="the fixture's name")
    p.add_argument("--predict-by", choices=("auto", "estimate", "trace"), default="auto",
                   help="predictor trainmem.plan.fit uses for the largest micro-batch (after an out-of-memory error "
                        "and beside --find-max-batch); auto: trace on the CPU, estimate on CUDA")
    p.add_argument("--largest", type=_positive_int, default=10, help="live tensors to list on out of memory")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model")
    p.add_argument("--empty-cache", action="store_true",
                   help="gc.collect() + torch.cuda.empty_cache() after reading each phase (as seed 003's notebook)")
    p.set_defaults(func=cmd_measure, _parser=p)
    c = sub.add_parser("compare", help="estimate | trace | measure side by side, per category and per phase")
    add_model_and_training(c)
    from ..estimate.methods import METHODS
    c.add_argument("--method", choices=list(METHODS), default="trainmem", help="formula set of the estimate")
    c.add_argument("--trace", action="store_true", help="add the tracer (fake tensors, on --device)")
    c.add_argument("--measure", action="store_true", help="add a measured run (real tensors, on --device)")
    c.add_argument("--device", type=_device, default="cuda",
                   help="device for --trace (cuda: emulated GPU; cpu) and --measure (cuda, cuda:N, cpu)")
    c.add_argument("--steps", type=_positive_int, default=2, help="training steps traced / measured (default 2)")
    c.add_argument("--reference", choices=("estimate", "trace", "measure"), default=None,
                   help="source the differences are taken against (default: measure, else trace, else estimate)")
    c.add_argument("--bytes", action="store_true", help="exact byte counts instead of MiB/GiB")
    c.set_defaults(func=cmd_compare)
