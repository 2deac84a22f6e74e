"""Why a cluster has no valid parallel layout: one line naming the rules that rejected every shape.

``plan`` enumerates the dp x tp x pp x cp shapes of a GPU count (``planner.enumerate_layouts``).
When none is left, the setup is impossible (bad input, exit 2), not a memory problem: this module
walks the same shapes and names, for each, the first rule it breaks, in the order
``enumerate_layouts`` applies them: the user's ``--tp/--pp/--cp/--dp`` lists, the divisibility
rules of ``spec.layout`` (all of a TP size's problems at once), the global batch and dp, then the
layout-level rules (``--batch-size``/``--grad-accum`` lists; ZeRO needs dp > 1 and, with
pipeline parallelism, stage 1 at most). Rejected shapes are counted per reason, and the nearest
GPU counts that do have a valid layout are named.
"""
from __future__ import annotations

from typing import Any, Iterator

from ..spec.layout import cp_problems, pp_problems, sequence_problems, tp_problems
from ._common import divisors

LAYOUT_KEYS = ("tp", "pp", "cp", "dp")


def _ints(vals: list[int]) -> str:
    return ",".join(str(v) for v in vals)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def shapes(n_gpus: int) -> Iterator[tuple[int, int, int, int]]:
    """Every (tp, pp, cp, dp) whose product is ``n_gpus``."""
    for tp in divisors(n_gpus):
        for pp in divisors(n_gpus // tp):
            for cp in divisors(n_gpus // tp // pp):
                yield tp, pp, cp, n_gpus // tp // pp // cp


def _layout_reason(pp: int, dp: int, global_batch: int, filters: dict[str, Any]) -> str | None:
    """Why no (micro-batch, accumulation, ZeRO, recompute) of a valid shape is left, or None."""
    f_b, f_ga = filters.get("b"), filters.get("ga")
    per_rank = global_batch // dp
    if not any((f_b is None or b in f_b) and (f_ga is None or per_rank // b in f_ga) for b in divisors(per_rank)):
        lists = " and ".join(f"--{k} {_ints(v)}" for k, v in (("batch-size", f_b), ("grad-accum", f_ga)) if v)
        return f"{lists}: no micro-batch x accumulation in the list makes the global batch / dp sequences per rank"
    zs = filters.get("zero", [0, 1, 2, 3])
    if dp == 1 and all(z > 0 for z in zs):
        return f"--zero {_ints(zs)} needs dp > 1 (ZeRO over one rank is plain training; add 0)"
    if pp > 1 and all(z >= 2 or (dp == 1 and z > 0) for z in zs):
        return "ZeRO-2/3 do not combine with pipeline parallelism (DeepSpeed: ZeRO-1 at most with pp > 1)"
    return None


def shape_reason(m: Any, tp: int, pp: int, cp: int, dp: int, seq: int, global_batch: int,
                 filters: dict[str, Any]) -> str | None:
    """The first rule the shape (tp, pp, cp, dp) breaks, as a phrase, or None when some layout of
    it is valid. The order is ``planner.enumerate_layouts``'s."""
    for key, v in zip(LAYOUT_KEYS, (tp, pp, cp, dp)):
        f = filters.get(key)
        if f is not None and v not in f:
            return f"excluded by --{key} {_ints(f)}"
    bad = tp_problems(m, tp)
    if bad:
        return f"tp={tp} " + _and([p.reason for p in bad])
    bad = (tp_problems(m, tp, cp) if cp > 1 else []) + pp_problems(m, pp) + cp_problems(m, cp) + \
        sequence_problems(seq, tp, cp, sequence_parallel=tp > 1)
    if bad:
        return f"{bad[0].label} {bad[0].reason}"
    if global_batch % dp:
        return f"dp={dp} does not divide the global batch of {global_batch} sequences"
    return _layout_reason(pp, dp, global_batch, filters)


def has_valid_layout(m: Any, n_gpus: int, seq: int, global_batch: int, filters: dict[str, Any]) -> bool:
    """Whether some layout of ``n_gpus`` GPUs breaks no rule."""
    return any(shape_reason(m, *s, seq, global_batch, filters) is None for s in shapes(n_gpus))


def _filter_value_problems(m: Any, n_gpus: int, seq: int, global_batch: int, filters: dict[str, Any]) -> list[str]:
    """What is wrong with each value the user listed in ``--tp/--pp/--cp/--dp`` on its own."""
    out = []
    for key in LAYOUT_KEYS:
        for v in filters.get(key) or ():
            why = [f"does not divide the {n_gpus} GPUs"] if n_gpus % v else []
            if key == "tp":
                why += [p.reason for p in tp_problems(m, v)]
            elif key == "pp":
                why += [p.reason for p in pp_problems(m, v)]
            elif key == "cp":
                why += [p.reason for p in cp_problems(m, v) + sequence_problems(seq, 1, v, False)]
            elif global_batch % v:
                why.append(f"does not divide the global batch of {global_batch} sequences")
            if why:
                out.append(f"--{key} {v} " + _and(why))
    return out


def nearest_valid(m: Any, n_gpus: int, seq: int, global_batch: int, filters: dict[str, Any],
                  reach: int = 256) -> list[int]:
    """The nearest GPU counts below and above ``n_gpus`` (within ``reach``, and at most twice
    ``n_gpus``) that have a valid layout."""
    below = next((n for n in range(n_gpus - 1, max(0, n_gpus - reach), -1)
                  if has_valid_layout(m, n, seq, global_batch, filters)), None)
    above = next((n for n in range(n_gpus + 1, min(2 * n_gpus, n_gpus + reach) + 1)
                  if has_valid_layout(m, n, seq, global_batch, filters)), None)
    return [n for n in (below, above) if n is not None]


def no_layout_message(m: Any, n_gpus: int, seq: int, global_batch: int, filters: dict[str, Any],
                      top: int = 4) -> str:
    """One line: why no layout of ``model`` on ``n_gpus`` GPUs is valid: the listed values' own
    problems, the most frequent rejection reasons with their shape counts, and nearby GPU counts
    that have a valid layout."""
    counts: dict[str, int] = {}
    for s in shapes(n_gpus):
        why = shape_reason(m, *s, seq, global_batch, filters)
        if why is not None:
            counts[why] = counts.get(why, 0) + 1
    parts = _filter_value_problems(m, n_gpus, seq, global_batch, filters)
    order = ("tp=", "pp=", "cp=", "dp=")   # ties: the rules in the planner's order
    ranked = sorted(counts.items(), key=lambda kv: (kv[0].startswith("excluded by"), -kv[1],
                                                    next((i for i, p in enumerate(order) if kv[0].startswith(p)), 4)))
    for why, k in ranked[:top]:
        shapes_k = f"{k} shape{'s' if k != 1 else ''}"
        parts.append(f"{shapes_k} {why}" if why.startswith("excluded by") else f"{why} ({shapes_k} rejected)")
    if len(ranked) > top:
        parts.append(f"{sum(k for _, k in ranked[top:])} shapes for {len(ranked) - top} other reasons")
    near = nearest_valid(m, n_gpus, seq, global_batch, filters)
    fix = (f"GPU counts with a valid layout nearby: {', '.join(map(str, near))}" if near else
           "change the listed sizes, the global batch or the sequence length")
    gpus = f"{n_gpus} GPU{'s' if n_gpus != 1 else ''}"
    return (f"no valid layout of {m.name} on {gpus} (global batch {global_batch}, sequence {seq}): "
            + "; ".join(parts) + f"; {fix}")
