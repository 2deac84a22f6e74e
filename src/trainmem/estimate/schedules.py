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


@functools.lru_cache(maxsize=256)
def megatron_rank_order(pp: int, local: int, micro: int, rank: int) -> tuple[tuple[str, int, int], ...]:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``,
    megatron/core/pipeline_parallel/schedules.py at 6e091e1b) as the actions of ``rank``, in the same
    form as :func:`rank_order`. Its table (``get_schedule_table``, L874-901) runs the micro-batches in
    groups of ``microbatch_group_size_per_vp_stage`` (its default: pp), every model chunk of a group in
    turn; ``get_pp_rank_microbatches`` (L814-871) gives ``(pp - rank - 1) * 2 + (chunks - 1) * group``
    warm-up forwards (all of them when that reaches chunks x micro-batches: forwards first, then
    backwards); then each step one forward (virtual micro-batch ``k + warmup``) and one backward
    (``k``), whose chunk is the table's reversed (``get_model_chunk_id(k, forward=False)``, L1144-1149)
    and whose micro-batch is that chunk's oldest in flight (``input_tensors[chunk].pop(0)``); then the
    cool-down backwards. Micro-batches fewer than pp are refused (``ValueError``, L1060-1068)."""
    group = pp
    table: list[tuple[int, int]] = []   # (micro-batch, chunk) of each virtual micro-batch, forward order
    for lo in range(0, micro, group):
        hi = micro if lo + group >= micro else lo + group
        table.extend((mb, c) for c in range(local) for mb in range(lo, hi))
    total = micro * local
    warmup = min((pp - rank - 1) * 2 + (local - 1) * group, total)
    pending: dict[int, list[int]] = {}
    out: list[tuple[str, int, int]] = []

    def forward(k: int) -> None:
        mb, c = table[k]
        pending.setdefault(c, []).append(mb)
        out.append((FORWARD, c, mb))

    def backward(k: int) -> None:
        c = local - 1 - table[k][1]
        out.append((BACKWARD, c, pending[c].pop(0)))

    for k in range(warmup):
        forward(k)
    for k in range(total - warmup):
        forward(k + warmup)
        backward(k)
    for k in range(total - warmup, total):
        backward(k)
    return tuple(out)


def in_flight_at_backwards(pp: int, local: int, micro: int, rank: int,
                           stage: int | None = None, megatron: bool = False) -> tuple[int, int, tuple, tuple]:
    """The rank's backwards as the estimate's moments: (pairs in flight at its first backward, of
    them the pairs not of the model's first stage, whose first layer saved the receive buffer; then
    two later backwards as (pairs, of them fed by a receive buffer, the local stages with no
    gradient yet): the one with the most pairs and the one with the most gradients). Pairs
    in flight: the (stage, micro-batch) pairs forwarded and not yet backwarded, the one being
    backwarded included. Ties go to the most stages whose gradients exist, resp. the most pairs (each
    stage's are created by its first backward; a stage being backwarded for the first time counts
    as without); the estimate keeps the larger of the two (``moments.tokens``). ``stage``: only
    the backwards of that local stage count (the last rank's head stage, whose backward also holds
    the logits). ``megatron``: Megatron-LM's order (:func:`megatron_rank_order`), else torch's."""
    alive: set[tuple[int, int]] = set()
    done: set[int] = set()
    counts: list[tuple[int, int, int, tuple[int, ...]]] = []
    for kind, v, mb in (megatron_rank_order if megatron else rank_order)(pp, local, micro, rank):
        if kind == FORWARD:
            alive.add((v, mb))
            continue
        if stage is None or v == stage:
            fed = sum(1 for u, _ in alive if u > 0 or rank > 0)
            counts.append((len(alive), len(done), fed, tuple(u for u in range(local) if u not in done)))
        alive.discard((v, mb))
        done.add(v)
    first = counts[0]
    most = max(counts[1:], default=first, key=lambda c: c[:2])                   # the most pairs ...
    grads = max(counts[1:], default=first, key=lambda c: (c[1], c[0]))           # ... the most gradients
    return first[0], first[2], (most[0], most[2], most[3]), (grads[0], grads[2], grads[3])
