"""DeepSpeed ZeRO's side of the replay outside the layers: the fp32 master partitions at the load,
ZeRO-1/2's gradient partitions, buckets and step, ZeRO-3's flat gradients, sub-groups and step, the
offloaded step's epilogue."""
from __future__ import annotations

import copy
from typing import Any

from ..quantities import PARTITION_BOTTOM, PARTITION_EMBEDDING, PARTITION_TOP, Quantities
from .replay import GRAD_STREAM, _Replay, _scaled, _Step


def _zero3_masters(R: _Replay, q: Quantities, st: Any) -> None:
    """DeepSpeed ZeRO-3's fp32 master partitions as ``_create_fp32_partitions`` makes them: per
    sub-group, in order, an fp32 copy of the half flat partition (a half engine's; an fp32 engine's flat
    partition is its own fp32 copy, ``quantities.zero_step.deepspeed_fp32_group``) and its ``clone()`` (the
    master, one flat tensor), the copy freed when the next sub-group's replaces it and the last at
    the end (``quantities.zero_step.deepspeed_fp32_convert``). The sub-groups hold at most the largest's
    elements (``deepspeed_group_elems``) each, the last the rest (``_zero3_sub_groups``)."""
    convert = bool(q.ds_fp32_convert)
    copy = None
    for n in _zero3_sub_groups(q):
        new = R.alloc(n * 4) if convert else None   # converted = flat.to(device, dtype=float32)
        R.free(copy)
        copy = new
        R.alloc(n * 4)                         # converted.clone(): the sub-group's master
    R.free(copy)


def _zero12_master(R: _Replay, q: Quantities, st: Any) -> None:
    """DeepSpeed ZeRO-1/2's fp32 master of this rank's partition (``quantities.zero_partition.deepspeed_flat12``), one
    flat tensor: ``parallel_partitioned_bit16_groups[i][partition_id].detach().clone().to(device,
    fp32)`` (v0.19.8 ``stage_1_and_2.py`` L560-561; v0.14.2 L393-394 ``.clone().float()``): the clone,
    (n,) in the weights' half dtype (``ds_clone12``; none for fp32 weights, whose clone is the
    master), then its fp32 cast, the clone freed; then ``initialize_optimizer_states`` (v0.19.8
    L934-951, v0.14.2 L671-690) sets a ``torch.zeros`` (n,) fp32 gradient on it and drops it again
    (``ds_step_fp32``, the partition's fp32 bytes). Its states are made by the first step
    (``_zero12_step``)."""
    n = q.ds_flat12                                   # the partition's elements (exact: the allocator
    clone = R.alloc(n * q.ds_param_bytes if q.ds_clone12 else 0)  # rounds each request itself)
    R.alloc(n * 4)                                    # (n,) fp32: the master, kept
    R.free(clone)                                     # (the bf16/fp16 clone of the partition)
    R.free(R.alloc(n * 4))                            # (n,) fp32 zeros, the init's gradient


def _zero12_at(R: _Replay, s: "_Step", q: Quantities, layer: int | None) -> None:
    """DeepSpeed ZeRO-1/2's ``grads_in_partition`` made by a hook at the backward moment
    ``quantities.zero_partition.deepspeed_partition_from`` finds (``ds_hook_at``): the top layer's, the bottom layer's
    (``layer`` its index) or, ``layer`` None, before the word embedding's."""
    at = {PARTITION_EMBEDDING} if layer is None else \
        ({PARTITION_TOP} if layer == q.layers - 1 else set()) | ({PARTITION_BOTTOM} if layer == 0 else set())
    if q.ds_hook_part and q.ds_hook_at in at:
        _zero12_partition(R, s, q)


def _zero12_epilogue(R: _Replay, s: "_Step", q: Quantities, suffix: str) -> None:
    """DeepSpeed ZeRO-1/2's backward epilogue at the accumulation boundary (not after the first of two
    micro-batches, ``suffix``) where it makes rank 0's ``grads_in_partition``
    (``quantities.zero_partition.deepspeed_epilogue_partition``; ``deepspeed_hook_partition`` where no hook in backward
    did): the buffer first, then every parameter's own gradient freed (copied into it or into the bucket
    buffers, and ``.grad`` cleared); the buffer stands for the gradients until the step drops it after
    its fp32 cast (``_zero12_step``)."""
    if not (q.ds_epilogue_part or q.ds_hook_part) or suffix == ".micro1":
        return
    stream = GRAD_STREAM if q.ds_reduce_side else 0               # the last bucket's reduction: its flat
    R.frees([R.alloc(n, stream) for n in q.ds_epilogue_cats])     # copies (quantities.zero_partition.deepspeed_epilogue_cats)
    _zero12_partition(R, s, q)
    part = s.grads.pop(("grads_in_partition", 0))
    R.frees(list(s.grads.values()))
    s.grads = {("grads_in_partition", 0): part}         # (``s.made`` kept: no gradient is made again)


def _zero12_partition(R: _Replay, s: "_Step", q: Quantities) -> None:
    """DeepSpeed ZeRO-1/2's ``grads_in_partition`` (whole parameters overlapping rank 0's partition, the
    gradient dtype), made once per step by the first copy into it (``copy_grads_in_partition``), on the
    reduction stream under ``overlap_comm`` (``quantities.zero_partition.deepspeed_hook_partition``)."""
    if q.ds_hook_part or q.ds_epilogue_part:
        if ("grads_in_partition", 0) not in s.grads:
            stream = GRAD_STREAM if q.ds_reduce_side else 0
            s.grads[("grads_in_partition", 0)] = R.alloc(q.ds_hook_part or q.ds_epilogue_part, stream)


def _zero12_step(R: _Replay, s: "_Step", q: Quantities, st: Any, first: bool) -> None:
    """DeepSpeed ZeRO-1/2's ``step`` on the GPU for one flat group (v0.19.8 ``stage_1_and_2.py``
    L3106-3139; v0.14.2 L1870-1905): the partition's gradients flattened (``ds_step_flat``, gradient
    dtype; none where rank 0's partition is one piece, ``quantities.zero_step.deepspeed_partition_one_piece``) and
    cast to the fp32 partition's dtype (``ds_step_fp32``, L3118), the flat copy freed, and the parameters'
    gradients dropped (``free_grad_in_param_list``: those outside the partition before the flatten, L3100,
    those in it after the cast, L3128; both here after the cast); then ``_optimizer_step`` runs the
    torch optimizer on the one flat fp32 parameter, whose states are made there at the first step (``first``), lazily, as ``zeros_like`` of it: one flat block per state kind
    after the fp32 gradient, not per tensor at the step's start (trace, 2-layer Qwen3 ZeRO-2 over 4
    ranks). Its temporaries are each of the flat partition's size (for-loop Adam's ``sqrt`` and quotient,
    foreach's one per tensor: ``quantities.optimizer_step.step_temporaries``), separate blocks; then the fp32 gradient
    is dropped."""
    n = q.ds_flat12                                                 # (n,) each, exact bytes
    flat = R.alloc(n * q.ds_param_bytes if q.ds_step_flat else 0)   # the cast: flat copy, then fp32
    fp32 = R.alloc(n * 4)
    R.free(flat)
    R.frees(list(s.grads.values()))                                 # free_grad_in_param_list: every .grad
    s.grads, s.made = {}, {}                                        # dropped before the optimizer runs
    if first:                                                       # zeros_like(fp32 partition) per kind
        kinds = max((len(sts) for (_w, _k, _g, sts, _m) in st.trainables), default=0)
        s.states = [R.alloc(sum(k * sts[i] for (_w, k, _g, sts, _m) in st.trainables if len(sts) > i))
                    for i in range(kinds)]
    rest = q.step_temp - q.ds_step_fp32 - q.ds_step_flat            # the optimizer's own temporaries,
    R.frees(R.allocs([n * 4] * (rest // q.ds_step_fp32)))           # each (n,) fp32
    R.free(fp32)


def _zero3_step(R: _Replay, s: "_Step", q: Quantities, order: list, first: bool, raw: tuple = ()) -> None:
    """DeepSpeed ZeRO-3's ``step`` on the device (v0.19.8 ``stage3.py``; v0.14.2 alike). ``_get_norm_groups``
    (L2579) -> ``get_grad_norm_direct`` takes each parameter's gradient partition in turn, copied to
    ``get_norm_dtype()`` (float64 where the device has it, ``zero/utils.py`` L59-63) for its
    ``.norm`` (L2454-2457): one float64 copy at a time, the largest the embedding's partition (its
    norm, 8 B, is not replayed). Then per sub-group (L2905-2925; ``_zero3_sub_groups``, the masters'
    cut): ``_prepare_fp32_grad_for_sub_group`` flattens the partition (``cat``, gradient dtype) and
    casts it to fp32 (L2683-2700), the flat copy freed; ``_optimizer_step`` steps the torch optimizer on
    the sub-group's one fp32 partition (L1235-1261), whose states are made lazily at the first step
    (``first``) as ``zeros_like`` of it (one flat tensor per state kind and sub-group, after the fp32
    gradient: not per tensor at the step's start; found by trace on Qwen1.5-0.5B over one rank, Giles
    Thomas's rows); ``_release_sub_group`` then drops the fp32 gradient (L2731-2736). ``order``: the
    trainables (``States.trainables`` items) in parameter order, one per tensor (``states.parameter_order``:
    a per-layer item once per layer, so its copies are not counted again here); ``raw``: each one's
    gradient partition in bytes, unrounded (``States.grad_rank_raw`` in that order; () where not known)."""
    for elems in _zero3_norm_elems(q, order, raw):                # the norm: (partition,) float64, one by one
        if elems:
            R.free(R.alloc(elems * 8))
    groups = _zero3_sub_groups(q) or _cut(sum(tr[2] // max(1, q.ds_norm_fp64) for tr in order),
                                          max(1, q.ds_step_fp32 // 4))
    kinds = max((len(sts) for (_w, _k, _g, sts, _m) in order), default=0)
    per_kind = [_scaled(groups, sum(sts[i] for (_w, _k, _g, sts, _m) in order if len(sts) > i))
                for i in range(kinds)]
    largest = max(groups, default=1)
    for j, n in enumerate(groups):
        flat = R.alloc(q.ds_step_flat * n // largest)            # (n,) gradient dtype, then (n,) fp32
        fp32 = R.alloc(n * 4, charge=q.ds_step_fp32 * n // largest)
        R.free(flat)
        if first:                                                # the states: zeros_like(fp32 partition)
            s.states += [R.alloc(sizes[j]) for sizes in per_kind if j < len(sizes)]
        R.frees(_zero3_step_temps(R, q, n, largest))             # the optimizer's own
        R.free(fp32)


def _zero3_norm_elems(q: Quantities, order: list, raw: tuple) -> list[int]:
    """Elements of each gradient partition ``get_grad_norm_direct`` copies to float64, in parameter
    order (``_zero3_step``): the partition's own bytes on this rank (``raw``, DeepSpeed's
    ``ceil(numel / world)`` elements) over the gradient's element size (``q.ds_norm_fp64``), not its
    block's: a (32000, 1024) bf16 embedding's partition over 2 ranks is 31.25 MiB (block 32), its
    float64 copy 125 MiB, which fits a free 125 MiB block where 128 MiB did not (trace, Mistral
    b2 s512 ZeRO-3 over 2). The block where the raw bytes are not known."""
    if not q.ds_norm_fp64:
        return []
    raw = raw if len(raw) == len(order) else (0,) * len(order)
    return [(r or tr[2]) // q.ds_norm_fp64 for tr, r in zip(order, raw)]


def _zero3_step_temps(R: _Replay, q: Quantities, n: int, largest: int) -> list:
    """The torch optimizer's own temporaries in ZeRO-3's step on a sub-group of ``n`` elements (e.g.
    ``_multi_tensor_adam``'s ``torch._foreach_sqrt`` of the fp32 partition's ``exp_avg_sq``, torch 2.13
    ``optim/adam.py`` L790): where they are whole fp32 partitions (``q.step_temp`` less the fp32 and
    flat copies, a multiple of ``q.ds_step_fp32``), each asks ``n`` x 4 bytes, charged its block;
    else one block of their bytes, scaled to the sub-group (several tensors)."""
    rest = q.step_temp - q.ds_step_fp32 - q.ds_step_flat
    if q.ds_step_fp32 and rest > 0 and rest % q.ds_step_fp32 == 0:
        return [R.alloc(n * 4, charge=q.ds_step_fp32 * n // largest) for _ in range(rest // q.ds_step_fp32)]
    return [R.alloc(rest * n // largest, one=False)]


def _cut(total: int, largest: int) -> list[int]:
    """``total`` elements in pieces of ``largest``, the last the rest."""
    return [min(largest, total - i) for i in range(0, total, largest)] if total > 0 else []


def _zero3_flat_grads(R: _Replay, s: "_Step", nbytes: int, trainables: tuple) -> None:
    """DeepSpeed ZeRO-3's gradient partition buffer (``quantities.zero_step.deepspeed_init_grads``): one block,
    made in the optimizer's ``__init__`` before its gathers; every trainable tensor's gradient is a
    view of it (made: ``_make_grads`` allocates none, ``zero_grad`` frees none)."""
    R.alloc(nbytes)
    for j, (_w, k, *_r) in enumerate(trainables):
        s.made[j] = k
        s.grads.update({(j, c): None for c in range(k)})


def _zero3_sub_groups(q: Quantities) -> list[int]:
    """Elements of each of DeepSpeed ZeRO-3's flat fp32 partitions on this rank, in order: the largest
    sub-group's (``quantities.zero_step.deepspeed_group_elems``, block-rounded) each, the last the rest of the
    rank's partition (``quantities.zero_step.deepspeed_partition_elems``)."""
    largest, left = q.ds_fp32_convert // 4 or q.ds_fp32_group, q.ds_partition
    out = []
    while largest > 0 and left > 0:
        out.append(min(left, largest))
        left -= out[-1]
    return out


def _ds_buckets(R: _Replay, q: Quantities, at_start: bool) -> list:
    """DeepSpeed ZeRO-1/2's gradient buckets (``quantities.zero_partition.deepspeed_buckets``), made where the release makes
    them: when backward starts before v0.18.3 (``ds_loss_buf``: ``backward`` L2046-2061 at v0.16.4, beside
    the loss's backward), since at the first gradient's hook (``process_gradients`` -> ``setup_buckets``,
    v0.19.8 ``stage_1_and_2.py`` L2287, L3256-3281: an untied head's weight, or a tied head's final norm),
    after the loss's and the head's backward, so the loss's gradients meet the holes the logits left without
    the buckets in them (found by trace: DeepSpeed 0.19.8 on Qwen1.5-0.5B ZeRO-2 offload b2, its loss's
    second fp32 gradient mapped 2,380 MiB where the replay had put the bucket and reused a hole; the
    reserved peak 8,808 -> 9,762 MiB against trace's 9,764 with the flat group made on the host).
    ``at_start``: the call at backward's start (else after the head's backward); [] where the other makes them."""
    if bool(q.ds_loss_buf) != at_start:
        return []
    return R.allocs([q.ds_bucket] * (q.ds_backward_buf // q.ds_bucket if q.ds_bucket else 0))


def _offload_epilogue(R: _Replay, q: Quantities) -> None:
    """DeepSpeed ZeRO-1/2 offloading the optimizer, at the boundary's reduction: each of rank 0's
    gradients, in the order backward made them, gets its float64 norm copy, then (up to v0.19.5) the
    elementwise inf/NaN check's fp32 copy, three bool tensors and second fp32 tensor, then the fp32 copy
    for the host, each step's tensors freed before the next (``quantities.zero_offload.deepspeed_offload_steps``,
    ``deepspeed_offload_epilogue``: v0.14.2 ``stage_1_and_2.py`` L1320-1334)."""
    for step in q.ds_offload_steps:
        R.frees(R.allocs(list(step)))
