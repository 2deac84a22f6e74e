"""torch.distributed.pipelining's interleaved 1F1B order, without torch: which of a rank's stages
runs which micro-batch's forward or backward, and so how many (stage, micro-batch) pairs a rank
keeps in flight at its backwards.

``rank_order`` follows torch 2.13 ``distributed/pipelining/schedules.py``:
``ScheduleInterleaved1F1B.__init__`` (``number_of_rounds = max(1, M // pp)``,
``microbatches_per_round = M // number_of_rounds``), ``_calculate_single_rank_operations``
(``forward_stage_index`` / ``backward_stage_index``), ``_get_warmup_ops`` (``multiply_factor=2``)
and ``_get_1f1b_rank_ops`` (warm-up forwards, then one forward and one full backward each op, then
the cool-down backwards). The ``None`` padding of ``_get_1f1b_rank_ops`` only waits for other ranks:
dropped here, as it changes no rank's own order. ``_PipelineScheduleRuntime._step_microbatches``
runs a rank's actions in this order; a stage keeps a micro-batch's output and autograd graph from
its forward to its backward (``stage.py`` ``forward_one_chunk`` / ``backward_one_chunk``)."""
from __future__ import annotations

import functools

FORWARD, BACKWARD = "F", "B"


def _warmup_ops(rank: int, local: int, per_round: int, pp: int, micro: int) -> int:
    """``_get_warmup_ops`` with ``multiply_factor=2`` (interleaved 1F1B)."""
    return min((local - 1) * per_round + 2 * (pp - 1 - rank), micro * local)


@functools.lru_cache(maxsize=256)
def rank_order(pp: int, local: int, micro: int, rank: int) -> tuple[tuple[str, int, int], ...]:
    """The compute actions of ``rank`` in order: (``F`` or ``B``, local stage index v (global stage
    ``v * pp + rank``), micro-batch)."""
    per_round = micro // max(1, micro // pp)
    warmup = _warmup_ops(rank, local, per_round, pp, micro)
    ops = local * micro
    fwd_bwd = ops - warmup

    def fwd_stage(step: int) -> int:
        return (step // per_round) % local

    def bwd_stage(step: int) -> int:
        return local - 1 - ((step - warmup) // per_round) % local

    fwd_mb: dict[int, int] = {}
    bwd_mb: dict[int, int] = {}
    out: list[tuple[str, int, int]] = []

    def add(kind: str, v: int, counter: dict[int, int]) -> None:
        out.append((kind, v, counter.get(v, 0)))
        counter[v] = counter.get(v, 0) + 1

    for op in range(warmup + fwd_bwd + warmup):  # cooldown_ops == warmup_ops
        if op < warmup + fwd_bwd:
            add(FORWARD, fwd_stage(op), fwd_mb)
        if op >= warmup:
            add(BACKWARD, bwd_stage(op), bwd_mb)
    return tuple(out)


def in_flight_at_backwards(pp: int, local: int, micro: int, rank: int,
                           stage: int | None = None) -> tuple[int, int, int, int]:
    """(pairs in flight at the rank's first backward, the most at any later backward, and of each
    count the pairs not of the model's first stage, whose first layer saved the receive buffer): the
    (stage, micro-batch) pairs forwarded and not yet backwarded, the one being backwarded included.
    ``stage``: only the backwards of that local stage count (the last rank's head stage, whose
    backward also holds the logits)."""
    alive: set[tuple[int, int]] = set()
    counts: list[tuple[int, int]] = []
    for kind, v, mb in rank_order(pp, local, micro, rank):
        if kind == FORWARD:
            alive.add((v, mb))
            continue
        if stage is None or v == stage:
            fed = sum(1 for u, _ in alive if u > 0 or rank > 0)
            counts.append((len(alive), fed))
        alive.discard((v, mb))
    later = max(counts[1:], default=counts[0])
    return counts[0][0], later[0], counts[0][1], later[1]
