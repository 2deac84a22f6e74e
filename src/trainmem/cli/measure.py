"""`trainmem measure` and `trainmem compare`.

Importing this module must not import torch: the CLI imports it at startup. Everything that
needs torch is imported inside the command functions.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from ..errors import TrainmemError
from ..paths import NotWritten, check_file, not_written
from .options import add_model_and_training, device_choice, positive_int, training_options
from .output import emit, exit_code, print_json, say


def _quiet_transformers() -> None:
    try:
        import transformers
    except ImportError as e:
        raise TrainmemError(f"measure needs torch and transformers ({e.name} is missing): "
                            f"pip install 'trainmem[trace]'") from None
    transformers.logging.set_verbosity_error()


def _options(a: argparse.Namespace) -> dict[str, Any]:
    opts = training_options(a)
    opts.pop("optimizer_bucket_mb", None)
    return opts


def _check_launcher(a: argparse.Namespace) -> None:
    """``--launcher`` / ``--nproc-per-node`` make sense together and outside a launcher; the
    single-process outputs are refused with several ranks."""
    launcher = getattr(a, "launcher", "none")
    if a.nproc_per_node is not None and launcher != "torchrun":
        raise TrainmemError("--nproc-per-node needs --launcher torchrun (inside torchrun or srun the launcher "
                            "says how many ranks there are)")
    from ..measure.distributed import launcher_env
    env = launcher_env()
    if launcher == "torchrun":
        if env is not None:
            raise TrainmemError(f"--launcher torchrun inside a launched job (rank {env['rank']} of "
                                f"{env['world_size']}, {env['launcher']}): drop --launcher, each process is a rank")
        if a.nproc_per_node is None:
            raise TrainmemError("--launcher torchrun needs --nproc-per-node N (the ranks to start on this node)")
    ranked = launcher == "torchrun" or (env is not None and env["world_size"] > 1)
    if ranked:
        bad = [f for f, v in (("--find-max-batch", a.find_max_batch), ("--save-fixture", a.save_fixture)) if v]
        if bad:
            raise TrainmemError(f"{', '.join(bad)} with several ranks is not supported yet: measure one rank's "
                                "setup on one GPU for it")


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
        if isinstance(act, argparse.BooleanOptionalAction):  # --expandable-segments / --no-expandable-segments
            words.append(act.option_strings[0 if v else 1])
        elif isinstance(act, argparse._StoreTrueAction):
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
    """Real training steps, recorded phase by phase; exit 1 on out of memory or when it does not fit
    the GPU given, 2 when an output file cannot be written (checked before the run; after it the
    measurement is printed first)."""
    _check_common(a)
    _check_launcher(a)
    if a.calibration:
        raise TrainmemError("--calibration: measure reads this GPU's context and workspaces itself; a calibration "
                            "profile is for estimate, trace, fit, sweep, plan and compare")
    if a.find_max_batch:
        bad = [f for f, v in (("--snapshot", a.snapshot), ("--html", a.html), ("--profile", a.profile),
                              ("--save-fixture", a.save_fixture)) if v]
        if bad:
            raise TrainmemError(f"--find-max-batch runs many tries; it does not take {', '.join(bad)}")
        return _find_max_batch(a)
    if a.save_fixture:
        if not a.save_fixture.endswith(".json"):
            raise TrainmemError(f"--save-fixture {a.save_fixture}: a fixture is a .json file")
        check_file(a.save_fixture, "--save-fixture")  # before the run, not after it
    _quiet_transformers()
    from ..measure.runner import measure
    from ..render.measure import measure_details
    run: Any = measure
    launched: dict[str, Any] = {}
    if a.launcher == "torchrun":  # start the ranks here (torchelastic, as torchrun --standalone)
        from ..measure.distributed import launch
        run, launched = launch, {"nproc_per_node": a.nproc_per_node}
    try:
        r, failed = run(a.model, a.steps, device=a.device, overrides=a.set or None, gpu=a.gpu,
                        gpu_memory=a.gpu_memory, context_memory=a.context_memory, max_fraction=a.max_fraction,
                        memory_limit=a.memory_limit, snapshot=a.snapshot, html=a.html, profile=a.profile,
                        largest=a.largest, seed=a.seed, empty_cache=a.empty_cache, predict_by=a.predict_by,
                        **launched, **_options(a)), None
    except NotWritten as e:  # an output file failed after the run: show the measurement, then the error
        if e.report is None:
            raise
        r, failed = e.report, str(e)
    if r.extra.get("gathered") is False:  # a rank other than 0 of a launched job: rank 0 prints for all
        return _rank_exit(0)
    code = emit(r, a)
    if not a.json:
        print(measure_details(r, a.units))
    if failed is None and a.save_fixture:
        failed = _save_fixture(r, a)
    if failed is not None:
        sys.stdout.flush()
        sys.stderr.write(f"trainmem: error: {failed}\n")
        return _rank_exit(2)
    return _rank_exit(1 if r.extra.get("oom") else code)


def _rank_exit(code: int) -> int:
    """``code``; a rank that torchrun or srun started leaves at once, its output flushed, without the
    interpreter's finalization. The distributed wrappers' DeviceMesh stays in torch's global mesh
    registry, so the process group it holds (and gloo's worker threads, which can still hold a
    finished collective's work) would be destroyed during finalization, where that can abort the
    process (SIGABRT, "terminate called without an active exception"; PyTorch PR #179291 describes
    the teardown). Seen once in CI on a rank whose measurement was already gathered."""
    from ..measure.distributed import launcher_env
    if launcher_env() is None:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _save_fixture(r: Any, a: argparse.Namespace) -> str | None:
    """Write ``r`` as the fixture ``a.save_fixture``; the error line when it cannot be written."""
    from ..measure.runner import fixture
    if r.extra.get("oom"):
        sys.stderr.write("trainmem: no fixture written: the run ran out of memory\n")
        return None
    fx = fixture(r, command=command_line(a), name=a.fixture_name, path=a.save_fixture)
    try:
        with open(a.save_fixture, "w", encoding="utf-8") as f:
            json.dump(fx, f, indent=2)
            f.write("\n")
    except OSError as e:
        return not_written(a.save_fixture, "--save-fixture", e)
    if not a.json:
        say(f"fixture written: {a.save_fixture} ({len(fx['measured'])} quantities; "
            f"`trainmem validate DIR` reads it)")
    return None


def _find_max_batch(a: argparse.Namespace) -> int:
    _quiet_transformers()
    from ..measure.runner import find_max_batch
    from ..render.measure import fmt_bytes, max_batch_summary, max_batch_try
    from ..units import parse_bytes
    opts = _options(a)
    opts.pop("batch_size", None)

    def show(row: dict[str, Any]) -> None:
        if not a.json:
            print(max_batch_try(row, a.units), flush=True)

    if not a.json:
        lim = f", limit {fmt_bytes(parse_bytes(a.memory_limit), a.units)}" if a.memory_limit else ""
        from ..spec.resolve import resolve
        seq = resolve(a.model, set=a.set or None, seq_len=a.seq_len).training.seq_len  # the model's default if none
        say(f"trainmem measure --find-max-batch — {a.model} on {a.device}{lim}, sequence {seq}, "
            f"{a.steps} step(s) per try")
    res = find_max_batch(a.model, device=a.device, steps=a.steps, memory_limit=a.memory_limit,
                         batch_cap=a.batch_cap, gpu=a.gpu, gpu_memory=a.gpu_memory,
                         context_memory=a.context_memory, overrides=a.set or None, on_try=show,
                         predict_by=a.predict_by, **opts)
    if a.json:
        print_json(res)
    else:
        print(max_batch_summary(res))
    return 0 if res["measured_max"] else 1


def cmd_compare(a: argparse.Namespace) -> int:
    """Estimate | trace | measure of one setup side by side; with a GPU, exit 1 when the reference
    source's report does not fit it."""
    _check_common(a)
    if a.trace or a.measure:
        _quiet_transformers()
    from ..measure.compare import compare_sources
    from ..render.measure import render_comparison
    if a.reference and a.reference != "estimate" and not getattr(a, a.reference):
        raise TrainmemError(f"--reference {a.reference} needs --{a.reference}")
    c = compare_sources(a.model, trace=a.trace, measure=a.measure, device=a.device, steps=a.steps, method=a.method,
                        reference=a.reference, overrides=a.set or None, gpu=a.gpu, gpu_memory=a.gpu_memory,
                        context_memory=a.context_memory, calibration=a.calibration, max_fraction=a.max_fraction,
                        **_options(a))
    ref = c.reports[c.ref_index]
    if a.json:
        print_json(dict(c.to_dict(), fits=ref.fits))
    else:
        print(render_comparison(c, a.units, a.bytes))
        if ref.capacity is not None:
            say(_verdict(ref, c.reference, a.units))
    return exit_code(ref)


def _verdict(r: Any, source: str, units: str) -> str:
    """The fit verdict of the reference source's report, in one line."""
    from ..units import fmt
    limit = "" if r.max_fraction >= 1 else f" × {r.max_fraction:g}"
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    return (f"{verdict} on {getattr(r.hardware, 'name', 'GPU')} ({fmt(r.capacity, units)}{limit}) by {source}: "
            f"{fmt(abs(r.margin), units)} {'free' if r.margin >= 0 else 'short'}")


def _register_measure(sub: Any) -> None:
    p = sub.add_parser("measure", help="run real training steps (random weights) and record memory per phase")
    add_model_and_training(p)
    p.add_argument("--device", type=device_choice, default="cuda",
                   help="cuda (the CUDA caching allocator, default), cuda:N, or cpu (real tensors counted by "
                        "LiveBytes)")
    p.add_argument("--steps", type=positive_int, default=2, help="training steps to run (default 2)")
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
    p.add_argument("--batch-cap", type=positive_int, default=4096, metavar="N",
                   help="--find-max-batch stops at N (default 4096)")
    p.add_argument("--save-fixture", default=None, metavar="FILE.json",
                   help="write the run as a validation fixture (validation/measured/, read by `trainmem validate`)")
    p.add_argument("--fixture-name", default=None, metavar="TEXT", help="the fixture's name")
    p.add_argument("--predict-by", choices=("auto", "estimate", "trace"), default="auto",
                   help="predictor trainmem.plan.fit uses for the largest micro-batch (after an out-of-memory error "
                        "and beside --find-max-batch); auto: trace on the CPU, estimate on CUDA")
    p.add_argument("--largest", type=positive_int, default=10, help="live tensors to list on out of memory")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model")
    p.add_argument("--launcher", choices=("none", "torchrun"), default="none",
                   help="torchrun: start --nproc-per-node ranks on this node (torchelastic, as torchrun --standalone) "
                        "and measure every rank through DDP / FSDP / TP; inside torchrun or srun no flag is needed")
    p.add_argument("--nproc-per-node", type=positive_int, default=None, metavar="N",
                   help="--launcher torchrun: ranks to start (= --dp × --tp)")
    p.add_argument("--empty-cache", action="store_true",
                   help="gc.collect() + torch.cuda.empty_cache() after reading each phase (as Scherrmann's BERT-large notebook does)")
    p.set_defaults(func=cmd_measure, _parser=p)


def _register_compare(sub: Any) -> None:
    c = sub.add_parser("compare", help="estimate | trace | measure side by side, per category and per phase")
    add_model_and_training(c)
    from ..estimate.methods import METHODS
    c.add_argument("--method", choices=list(METHODS), default="trainmem", help="formula set of the estimate")
    c.add_argument("--trace", action="store_true", help="add the tracer (fake tensors, on --device)")
    c.add_argument("--measure", action="store_true", help="add a measured run (real tensors, on --device)")
    c.add_argument("--device", type=device_choice, default="cuda",
                   help="device for --trace (cuda: emulated GPU; cpu) and --measure (cuda, cuda:N, cpu)")
    c.add_argument("--steps", type=positive_int, default=2, help="training steps traced / measured (default 2)")
    c.add_argument("--reference", choices=("estimate", "trace", "measure"), default=None,
                   help="source the differences are taken against (default: measure, else trace, else estimate)")
    c.add_argument("--bytes", action="store_true", help="exact byte counts instead of MiB/GiB")
    c.set_defaults(func=cmd_compare)


def register(sub: Any) -> None:
    """Add ``measure`` and ``compare`` to the ``trainmem`` command line."""
    _register_measure(sub)
    _register_compare(sub)
