"""`trainmem trace`: run the real training step on fake tensors (imports torch only when run)."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import TrainmemError
from .options import add_model_and_training, require_gpu_for_max_fraction, training_options
from .output import emit, say


def cmd_trace(a: argparse.Namespace) -> int:
    """Trace one setup; print the report, the largest tensors and (optionally) a timeline plot.
    Exit 1 when the GPU given is too small (a simulated out of memory with --simulate-oom included)."""
    try:
        import transformers
        transformers.logging.set_verbosity_error()
        from ..trace.api import trace
    except ImportError as e:
        raise TrainmemError(f"trace needs torch and transformers ({e.name} is missing): "
                            f"pip install 'trainmem[trace]'") from None
    require_gpu_for_max_fraction(a)
    if a.steps <= 0:
        raise TrainmemError(f"--steps must be a positive integer, got {a.steps}")
    if a.timeline:
        from ..paths import check_file
        from ..render.plots import check_path
        check_path(a.timeline)
        check_file(a.timeline, "--timeline")
    opts = training_options(a)
    opts.pop("optimizer_bucket_mb", None)
    r = trace(a.model, steps=a.steps, device=a.device, gpu=a.gpu, gpu_memory=a.gpu_memory,
              context_memory=a.context_memory, calibration=a.calibration, max_fraction=a.max_fraction,
              set=a.set or None, simulate_oom=a.simulate_oom, **opts)
    code = emit(r, a)
    if not a.json:
        from ..render.trace import largest_tensors, rank_lines
        text = largest_tensors(r.extra.get("largest_tensors") or [], a.units, a.largest, a.detail)
        if text:
            print()
            print(text)
        for line in rank_lines(r.extra, a.units):
            print(line)
    if a.timeline:
        from ..render.plots import plot_timeline
        plot_timeline(r, a.timeline, a.units)
        if not a.json:
            say(f"\ntimeline written to {a.timeline}")
    # a step stopped by the simulated out-of-memory did not fit, whatever its partial peak says
    simulated_oom = bool(r.extra.get("simulated_oom"))
    return 1 if simulated_oom else code


def register(sub: Any) -> None:
    """Add ``trace`` to the ``trainmem`` command line."""
    p = sub.add_parser("trace", help="run the real training step on fake tensors and account for every allocation")
    add_model_and_training(p)
    p.add_argument("--steps", type=int, default=2, help="training steps to run (default 2)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: emulate a GPU (default); cpu: trace for the CPU, byte-exact")
    p.add_argument("--timeline", default=None, metavar="FILE.png|.svg",
                   help="plot allocated/reserved over the step, stacked by category")
    p.add_argument("--largest", type=int, default=10, help="largest live tensors to list at the peak")
    p.add_argument("--simulate-oom", action="store_true",
                   help="limit the simulated device to the GPU's capacity (needs --gpu)")
    p.set_defaults(func=cmd_trace)
