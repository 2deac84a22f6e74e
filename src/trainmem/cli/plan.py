"""`trainmem fit`, `trainmem sweep` and `trainmem plan`."""
from __future__ import annotations

import argparse
from typing import Any

from .options import (ACCUM_FLAGS, BATCH_FLAGS, SEQ_FLAGS, add_model_and_training, fraction, positive_int,
                      training_options)
from .output import print_json, say, warn_pointless

_LAYOUT_KEYS = ("batch_size", "seq_len", "grad_accum", "dp", "tp", "pp", "cp", "zero", "recompute",
                "sequence_parallel")


def _methods() -> list[str]:
    from ..estimate.methods import METHODS
    return list(METHODS)


def _hardware(a: argparse.Namespace) -> dict[str, Any]:
    return dict(gpu=a.gpu, gpu_memory=a.gpu_memory, context_memory=a.context_memory, calibration=a.calibration,
                max_fraction=a.max_fraction, method=a.method, set=a.set)


def _has(p: argparse.ArgumentParser, flag: str) -> bool:
    return any(flag in a.option_strings for a in p._actions)


def _common(p: argparse.ArgumentParser) -> None:
    if not _has(p, "--method"):
        p.add_argument("--method", choices=_methods(), default="trainmem", help="formula set (default: trainmem)")
    if not _has(p, "--loss-chunks"):  # until the shared training flags carry it
        p.add_argument("--loss-chunks", type=positive_int, default=1, metavar="N",
                       help="chunked cross-entropy: run the LM head and loss in N chunks of the tokens")


def cmd_fit(a: argparse.Namespace) -> int:
    """The largest micro-batch (or longest sequence) that fits; exit 1 when nothing does."""
    from ..plan.fit import fit
    opts = training_options(a)
    opts["loss_chunks"] = a.loss_chunks
    hw = _hardware(a)
    gpu = hw.pop("gpu")
    r = fit(a.model, gpu=gpu, by=a.by, seq_multiple=a.seq_multiple, **hw, **opts)
    warn_pointless(r.report.training)
    if a.json:
        print_json(r.to_dict())
    else:
        from ..render.fit import render_fit
        print(render_fit(r, a.units, detail=getattr(a, "detail", False)))
    return 0 if r.fits else 1


def cmd_sweep(a: argparse.Namespace) -> int:
    """Reports over a grid of micro-batch sizes and sequence lengths, and their plots; the exit
    code of ``sweep_exit_code``."""
    from ..plan.sweep import sweep
    opts = training_options(a)
    opts["loss_chunks"] = a.loss_chunks
    for k in ("batch_size", "seq_len"):
        opts.pop(k, None)
    r = sweep(a.model, a.batch_size, a.seq_len, by=a.by, **_hardware(a), **opts)
    first = next((c.report for row in r.cells for c in row if c.report is not None), None)
    warn_pointless(first.training if first is not None else None)
    written = []
    if a.plot:
        from ..render.plots import plot_sweep
        for spec in a.plot:
            kind, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
            data = plot_sweep(r, path, kind=kind or None, over=a.stack_over, units=a.units)
            written.append((data["kind"], path))
    if a.json:
        d = r.to_dict()
        d["plots"] = [{"kind": k, "path": p} for k, p in written]
        print_json(d)
    else:
        print(r.render(a.units))
        for k, p in written:
            say(f"wrote {k} plot: {p}")
    return sweep_exit_code(r)


def sweep_exit_code(r: Any) -> int:
    """0 when the sweep answered for no GPU or some cell fits (within --max-fraction); 1 when a GPU
    was given and no cell fits. (A grid with no valid cell is an error, exit 2, raised by sweep.)"""
    if r.capacity is None:
        return 0
    return 0 if any(c.fits for row in r.cells for c in row) else 1


def cmd_plan(a: argparse.Namespace) -> int:
    """The parallel layouts of a cluster that fit, ranked by step time; exit 1 when none does."""
    from ..plan import plan  # TrainmemError without numpy
    opts = training_options(a)
    for k in _LAYOUT_KEYS:
        opts.pop(k, None)
    opts["loss_chunks"] = a.loss_chunks
    hw = _hardware(a)
    gpu = hw.pop("gpu")
    r = plan(a.model, a.gpus, seq_len=a.seq_len, global_batch=a.global_batch, gpu=gpu, top=a.top, mfu=a.mfu,
             internode_gbs=a.internode_gbs, gpus_per_node=a.gpus_per_node, tp=a.tp, pp=a.pp, cp=a.cp, dp=a.dp,
             zero=a.zero, recompute=a.recompute, batch_size=a.batch_size, grad_accum=a.grad_accum,
             all_layouts=a.all, **hw, **opts)
    if a.json:
        print_json(r.to_dict())
    else:
        print(r.render(a.units, a.explain))
    return 0 if r.top else 1


def _register_fit(sub: Any) -> None:
    f = sub.add_parser("fit", help="largest micro-batch (or longest sequence) that fits a GPU",
                       description="With --seq-len: the largest micro-batch that fits. With --batch-size (and no "
                                   "--seq-len): the longest sequence, a multiple of --seq-multiple. Exact search "
                                   "over the estimator; prints the margin left, or what would make it fit.")
    add_model_and_training(f)
    f.set_defaults(batch_size=None, seq_len=None, func=cmd_fit)
    _common(f)
    f.add_argument("--seq-multiple", type=positive_int, default=128, metavar="N",
                   help="sequence lengths tried are multiples of N (default 128)")
    f.add_argument("--by", choices=("estimate", "trace"), default="estimate",
                   help="estimate (formulas, default) or trace (the fake-tensor tracer)")


def _register_sweep(sub: Any) -> None:
    s = sub.add_parser("sweep", help="memory over a grid of micro-batch sizes and sequence lengths (and plots)",
                       conflict_handler="resolve",
                       description="Estimate every (micro-batch, sequence length) pair; --plot draws a heatmap "
                                   "(fits / does not fit) or stacked bars by component category.")
    add_model_and_training(s)
    _common(s)
    s.add_argument(*BATCH_FLAGS, dest="batch_size", default="1", metavar="LIST",
                   help="micro-batch sizes: 1,2,4 or START:STOP[:STEP] (default 1)")
    s.add_argument(*SEQ_FLAGS, dest="seq_len", default=None, metavar="LIST",
                   help="sequence lengths: 512,1024 or 128:4096:128 (default 2048, or the model's learned "
                        "positions when fewer)")
    s.add_argument("--plot", action="append", default=[], metavar="[KIND=]PATH",
                   help="write a plot (.png or .svg); KIND heatmap or stacked, else guessed from the file "
                        "name and the grid (repeatable)")
    s.add_argument("--stack-over", choices=("batch", "seq"), default=None,
                   help="x axis of the stacked bars (default: the longer axis of the grid)")
    s.add_argument("--by", choices=("estimate", "trace"), default="estimate")
    s.set_defaults(func=cmd_sweep)


def _register_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="every parallel layout of a cluster that fits, ranked by step time",
                       conflict_handler="resolve",
                       description="Enumerate dp x tp x pp x cp, ZeRO stage, recompute, micro-batch and gradient "
                                   "accumulation for --gpus GPUs and --global-batch sequences; keep those that fit; "
                                   "rank them by the step-time model of docs/plan.md.")
    add_model_and_training(p)
    _common(p)
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs in the cluster")
    p.add_argument("--global-batch", type=positive_int, required=True, metavar="N",
                   help="sequences per optimizer step (dp x micro-batch x accumulation)")
    for k, what in (("tp", "tensor-parallel"), ("pp", "pipeline-parallel"), ("cp", "context-parallel"),
                    ("dp", "data-parallel")):
        p.add_argument(f"--{k}", default=None, metavar="LIST", help=f"only these {what} sizes, e.g. 1,2,4")
    p.add_argument("--zero", default=None, metavar="LIST", help="only these ZeRO stages, e.g. 1,2,3")
    p.add_argument("--recompute", default=None, metavar="LIST", help="only these, e.g. none,full")
    p.add_argument(*BATCH_FLAGS, dest="batch_size", default=None, metavar="LIST", help="only these micro-batch sizes")
    p.add_argument(*ACCUM_FLAGS, dest="grad_accum", default=None, metavar="LIST", help="only these accumulation counts")
    p.add_argument("--top", type=positive_int, default=5, help="layouts to show (default 5)")
    p.add_argument("--explain", action="store_true", help="why the other layouts were rejected")
    p.add_argument("--all", action="store_true", help="list every valid layout, fitting or not")
    p.add_argument("--mfu", type=fraction, default=0.5, help="assumed model FLOPs utilisation (default 0.5)")
    p.add_argument("--internode-gbs", type=float, default=None, metavar="GB/s",
                   help="per-GPU network bandwidth between nodes (default: the GPU catalogue's)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="N",
                   help="GPUs sharing NVLink/xGMI (default: the GPU catalogue's, usually 8)")
    p.set_defaults(func=cmd_plan)


def register(sub: Any) -> None:
    """Add ``fit``, ``sweep`` and ``plan`` to the ``trainmem`` command line."""
    _register_fit(sub)
    _register_sweep(sub)
    _register_plan(sub)
