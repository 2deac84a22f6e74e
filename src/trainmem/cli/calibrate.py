"""`trainmem calibrate`: measure this GPU's memory outside PyTorch's tensors and write a profile
for ``--calibration FILE`` (torch is imported only by the measurements' own processes)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import TrainmemError
from .output import print_json


def _items(text: str | None) -> list[str] | None:
    """``--items a,b``: the item names (checked by ``calibrate``), None for all."""
    if text is None:
        return None
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise TrainmemError("--items: give item names separated by commas (`trainmem calibrate --plan` lists them)")
    return names


def _progress(quiet: bool) -> Any:
    """A callback printing one line per finished item on stderr (nothing when ``quiet``)."""
    def show(result: dict[str, Any]) -> None:
        if not quiet and not result.get("refused"):
            state = "ok" if result.get("ok") else ("refused" if result.get("refused") else "failed")
            why = f": {result.get('reason')}" if result.get("reason") else ""
            sys.stderr.write(f"calibrate: {result.get('item')} {state}{why}\n")
    return show


def cmd_calibrate(a: argparse.Namespace) -> int:
    """Measure and write the profile on a GPU; without one (or with --plan) print what it would
    measure and exit 0."""
    from ..measure.calibrate import calibrate, default_out, plan, write_profile
    from ..render.calibrate import render_profile
    items = _items(a.items)
    if a.out:
        from ..paths import check_file
        check_file(a.out, "--out")
    if a.plan:
        return _print_plan(a, plan(), "--plan given", a.out or default_out())
    command = "trainmem calibrate" + (f" --out {a.out}" if a.out else "") + (f" --items {a.items}" if a.items else "")
    written: list[str] = []

    def write(partial: dict[str, Any]) -> None:  # after every item: a run stopped from outside keeps its figures
        written[:] = [write_profile(a.out or default_out(partial), partial)]

    profile, results = calibrate(items, on_result=_progress(a.json), command=command, write=write)
    if profile is None:
        gpu = results["gpu"]
        if not gpu.get("refused"):
            raise TrainmemError(f"calibrate: the gpu item failed ({gpu.get('reason')}); nothing written")
        return _print_plan(a, plan(), str(gpu.get("reason")), a.out or default_out())
    out = write_profile(a.out or default_out(profile), profile)
    if a.json:
        print_json({"measured": True, "out": out, "profile": profile})
    else:
        print(render_profile(profile, out))
    return 0


def _print_plan(a: argparse.Namespace, items: list[dict[str, Any]], reason: str, out: str) -> int:
    from ..render.calibrate import render_plan
    if a.json:
        print_json({"measured": False, "reason": reason, "out": out, "plan": items})
    else:
        print(render_plan(items, reason, out))
    return 0


def register(sub: Any) -> None:
    """Add ``calibrate`` to the ``trainmem`` command line."""
    p = sub.add_parser("calibrate", help="measure this GPU's memory outside PyTorch's tensors (CUDA context, "
                                         "cuBLAS workspaces, ...) into a profile for --calibration",
                       description="Measure, each in its own process, the CUDA context (lazy and eager module "
                                   "loading, after a small training step), cuBLAS/cuBLASLt workspaces per handle "
                                   "and stream, cuDNN and SDPA transient memory, and NCCL buffers when two GPUs "
                                   "are visible; write them as a profile keyed by GPU, driver, CUDA and torch "
                                   "versions. Without a CUDA GPU: print what it would measure and exit 0.")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where to write the profile (default: the user cache, $TRAINMEM_CACHE/calibration/GPU.json)")
    p.add_argument("--items", default=None, metavar="A,B",
                   help="measure only these items (the gpu item always runs); --plan lists them")
    p.add_argument("--plan", action="store_true", help="print what would be measured and how; measure nothing")
    p.add_argument("--json", action="store_true", help="print the result (or the plan) as JSON")
    p.set_defaults(func=cmd_calibrate)
