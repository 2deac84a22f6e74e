"""`trainmem estimate`, `trainmem models`, `trainmem gpus`."""
from __future__ import annotations

import argparse
from typing import Any

from .options import add_model_and_training, require_gpu_for_max_fraction, training_options
from .output import emit, print_json


def cmd_estimate(a: argparse.Namespace) -> int:
    """Closed-form estimate of one setup."""
    from ..estimate.api import estimate
    require_gpu_for_max_fraction(a)
    r = estimate(a.model, method=a.method, set=a.set, gpu=a.gpu, gpu_memory=a.gpu_memory,
                 context_memory=a.context_memory, calibration=a.calibration, max_fraction=a.max_fraction,
                 **training_options(a))
    return emit(r, a)


def cmd_models(a: argparse.Namespace) -> int:
    """The bundled model catalogue."""
    from ..render.catalogue import render_models
    from ..spec.config import catalogue_names, resolve_model
    rows = []
    for n in catalogue_names():
        m = resolve_model(n)
        rows.append({"name": n, "family": m.family, "head": m.head, "params": m.num_params,
                     "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
                     "kv_heads": m.num_kv_heads, "vocab": m.vocab_size, "experts": m.num_experts})
    if a.json:
        print_json(rows)
    else:
        print(render_models(rows))
    return 0


def cmd_gpus(a: argparse.Namespace) -> int:
    """The GPU catalogue with exact capacities."""
    from ..render.catalogue import render_gpus
    from ..spec.hardware import catalogue_table
    rows = catalogue_table()
    if a.json:
        print_json(rows)
    else:
        print(render_gpus(rows))
    return 0


def register(sub: Any) -> None:
    """Add ``estimate``, ``models`` and ``gpus`` to the ``trainmem`` command line."""
    e = sub.add_parser("estimate", help="closed-form estimate from the model's hyperparameters")
    add_model_and_training(e)
    from ..estimate.methods import METHODS
    e.add_argument("--method", choices=list(METHODS), default="trainmem", help="formula set")
    e.set_defaults(func=cmd_estimate)
    m = sub.add_parser("models", help="list the bundled model catalogue")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)
    g = sub.add_parser("gpus", help="list the GPU catalogue with exact capacities in bytes")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gpus)
