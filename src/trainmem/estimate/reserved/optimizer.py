"""Gradients and the optimizer in the replay: each trainable tensor's gradient as backward makes it,
FSDP's flat sharded gradients, a gradient added into an existing ``.grad``, a tied embedding's sum;
the optimizer's states in parameter order at the first step, its step's temporaries, transformers'
Adafactor tensor by tensor, torchao's compiled step graph, LOMO's update inside backward, ``zero_grad``."""
from __future__ import annotations

import copy
from typing import Any

from ...allocator_rules import block_bytes
from ..moments import StepFlags
from ..quantities import Quantities
from ..states import parameter_order as _parameter_order
from .replay import _placed, _Replay, _scaled, _Step
from .zero_step import _zero12_step, _zero3_step


def _tied_embedding_sum(R: _Replay, s: "_Step", q: Quantities, flags: StepFlags, tied: int | None) -> None:
    """A tied embedding's backward outside FSDP: its own gradient, then autograd's InputBuffer adds it to
    the head's (``tied``) out of place, the sum is ``.grad`` (``quantities.head_grads.tied_head_grad``). Under
    DeepSpeed ZeRO-3 the sum is a new tensor, copied to its bucket; where ZeRO-1/2's hooks reduce
    (``quantities.zero_partition.deepspeed_hook_partition``) the sum, larger than a bucket, waits for the epilogue's
    reduction (``_zero12_epilogue``; ``extra_large_param_to_reduce``, v0.19.8 ``stage_1_and_2.py``
    L1444-1449). Returns None (the head's part is freed)."""
    trainables = q.detail.states.trainables
    whole = R.alloc(q.tied_replicated)                  # DTensor TP: the whole table first (tied_replicated_grad)
    word = _embedding_grads_first(R, s, trainables, flags.oib)  # the position / token-type tables' first
    emb_out = _tied_request(R, q)                       # then this rank's rows
    added = _accumulated(R, s, trainables, ("before",), only=word)  # the sum added into an existing .grad
    if q.ds_keeps_sum:                                  # ZeRO-2, no contiguous gradients: the sum is rank 0's
        _sum_as_embedding_grad(s, trainables)           # .grad, whole, not its partition's share
    _make_grads(R, s, trainables, ("before",), flags.oib)
    acc = R.alloc(q.tied_grad) if q.ds_init_grads or q.ds_hook_part or q.ds_keeps_sum else None
    if q.ds_hook_part or (q.ds_keeps_sum and ("embedding_sum", 0) not in s.grads):  # (kept: a later micro-
        s.grads[("embedding_sum", 0)], acc = acc, None  # batch's sum is added into it in place and freed)
    R.frees([tied, emb_out, acc] + added + [whole])
    return None


def _tied_request(R: _Replay, q: Quantities) -> int | None:
    """A tied table's gradient part (``q.tied_grad``): the head's (``loss_backward._head_backward``) or the
    embedding's own (``_tied_embedding_sum``), requested at its own bytes (``q.tied_raw``: the (vocab,
    hidden) ``mm`` or ``embedding_dense_backward`` output) and charged the block (``_Replay.alloc``: the
    allocated peak does not move), as ``_grad_request`` asks the sum's ``.grad``: trace, GPT-2 (2 layers)
    b1 s1024 bf16-amp full recomputation asks 147.24 MiB for the head's part, where the replay asked
    148 MiB, and with the sum at its own bytes and the parts at their blocks lost a 198 MiB segment
    (-10.8 %). (From branch ``qwen`` f1eef9f5.) Under FSDP (``driver._backward``) the embedding's own
    part and the out-of-place sum are requested so too: trace asks 519.31 MiB for each (Qwen2.5-0.5B's
    (151936, 896) fp32 table, FSDP2 grad-op), where the replay asked 520 MiB, which no 519.31 MiB block
    an earlier step left cached can hold."""
    raw = q.tied_raw
    return R.alloc(raw, charge=q.tied_grad) if 0 < raw <= q.tied_grad else R.alloc(q.tied_grad)


def _embedding_grads_first(R: _Replay, s: _Step, trainables: tuple, oib: bool) -> int | None:
    """The gradients of the tensors before the layers other than the word embedding (the largest, as in
    ``_sum_as_embedding_grad``), made before the word embedding's own (``embedding_dense_backward``'s
    output, a table of the word embedding's size). Autograd's engine runs the ready node of the highest
    sequence number first (torch 2.13 ``csrc/autograd/engine.h`` L91-106 ``CompareNodeTaskTime``), and the
    embeddings' forward makes the word lookup first: transformers 5.24 ``models/bert/modeling_bert.py``
    L100-105 (word, token-type, their sum, position, the sum) runs the embeddings' LayerNorm's backward,
    then the position table's (``max_position_embeddings`` x hidden, the weights' dtype), the token
    type's, then the word's; GPT-2 (``models/gpt2/modeling_gpt2.py`` L569-577, ``wte`` then ``wpe``) the position
    table's first as well. A gradient added into an existing ``.grad`` (``_accumulated``) is a temporary
    freed once its ``AccumulateGrad`` has run, before the next table's. Returns the word embedding's index."""
    before = _placed(trainables, ("before",))
    word = max(before, key=lambda j: trainables[j][2], default=None)
    for j in before:
        if j == word:
            continue
        if s.grads.get((j, 0)) is not None:
            R.free(R.alloc(trainables[j][2]))           # added into .grad in place, then dropped
        else:
            _grad_of(R, s, trainables, j, oib)
    return word


def _sum_as_embedding_grad(s: "_Step", trainables: tuple) -> None:
    """Mark the word embedding's gradient (the largest trainable placed before the layers) as made, so
    that the tied sum kept whole stands for it (``quantities.zero_partition.deepspeed_keeps_tied_sum``)."""
    before = [j for j in _placed(trainables, ("before",)) if (j, 0) not in s.grads]
    if before:
        s.grads[(max(before, key=lambda j: trainables[j][2]), 0)] = None


def _make_grads(R: _Replay, s: _Step, trainables: tuple, where: tuple[str, ...], oib: bool = False,
                stream: int = 0, made: set | frozenset = frozenset(), flat: bool = False) -> None:
    """Allocate the gradients that do not exist yet of the trainable tensors placed at one of
    ``where`` (one copy of a per-layer tensor per call: the layer being back-propagated; ``made``:
    those whose copy this layer made already), on ``stream`` (FSDP's sharded gradients: its
    reduce-scatter stream); ``flat``: FSDP's, one block per unit (``_flat_grads``)."""
    if flat and not oib:
        _flat_grads(R, s, trainables, [j for j in _placed(trainables, where) if j not in made], stream)
        return
    for j in _placed(trainables, where):
        if j not in made:
            _grad_of(R, s, trainables, j, oib, stream)


def _accumulated(R: _Replay, s: _Step, trainables: tuple, where: tuple[str, ...], only: int | None = None) -> list:
    """The new gradients of the tensors placed at one of ``where`` (one copy each: the head's, the final
    norm's) whose ``.grad`` already exists (a later micro-batch, or ``zero_grad(set_to_none=False)``):
    autograd's ``AccumulateGrad`` adds such a gradient into ``.grad`` in place (torch 2.13
    ``csrc/autograd/functions/accumulate_grad.h`` ``accumulateGrad``: ``variable_grad += new_grad`` when
    grad mode is off), so the backward op's output is a tensor of the gradient's size that lives
    until its node has run; only where ``.grad`` is undefined is that output stolen as ``.grad``.
    Trace, 4-layer Llama-3.2 over pp 2 (1F1B), last stage, 4 micro-batches: the head's 1002 MiB
    ``mm`` output made and freed again in each of micro-batches 2 to 4. Returns their handles."""
    out = []
    for j in _placed(trainables, where):
        if s.grads.get((j, 0)) is not None and only in (None, j):
            out.append(R.alloc(trainables[j][2]))
    return out


def _flat_grads(R: _Replay, s: _Step, trainables: tuple, js: list[int], stream: int, shard: bool = False) -> None:
    """FSDP2's sharded gradients of one unit (trainable tensors ``js``): ``foreach_reduce`` allocates
    one flat reduce-scatter output for the whole unit on its reduce-scatter stream and the sharded
    gradients are views of it (torch 2.13 ``_fully_shard/_fsdp_collectives.py`` ``foreach_reduce``:
    ``reduce_output = reduce_scatter_input.new_empty((reduce_scatter_output_numel,))`` inside the
    reduce-scatter stream's context, ``_get_sharded_grads`` / ``torch.as_strided`` views): one block,
    freed when every view is (``zero_grad(set_to_none=True)`` frees them together; the block is
    kept under the first tensor's key, the others' None). Where the unit's gradients exist already
    (``zero_grad(set_to_none=False)``, an earlier micro-batch's), the new output is made all the same
    and added into them (``sharded_param.grad._local_tensor += new_sharded_grad``), then dropped.
    Trace (Phi-3 FSDP2 bf16-mp, ``--zero-grad zeros``) opens a segment of a layer's flat output in
    the second step's backward, which per-tensor gradients that already exist did not. FSDP1 the same
    on its post-backward stream: ``_reduce_grad``'s ``new_sharded_grad`` (``fsdp/_runtime_utils.py``
    ``_get_reduce_scatter_tensors``) becomes the flat parameter's ``_saved_grad_shard``, or is added
    into it (``_accumulate_sharded_grad``), and the original parameters' gradients are views of it
    (``use_orig_params``); a layer's LoRA units of their own are counted in their layer's block (small).
    Trace, the wide 2-layer Llama FSDP1 dp 2 ``--zero-grad zeros``: -2.6 % -> +0.2 % on peak reserved.
    ``shard``: the last micro-batch's shard after FSDP1's ``no_sync`` (``States.grad_shard_raw``, ``_unit_grads``)."""
    new, total = [], 0
    for j in js:
        _w, k, g, _sts, _m = trainables[j]
        copy = s.made.get(j, 0) if _w == "layer" else 0
        raw = s.grad_shard_raw if shard else s.grad_rank_raw      # its own bytes: the output is one block
        total += raw[j] if j < len(raw) else g
        if copy < k and (j, copy) not in s.grads:
            new.append((j, copy))
    if not new:                                                   # accumulated into: made and dropped
        R.free(R.alloc(total, stream, one=False))
        return
    h = R.alloc(total, stream)                                    # (unit's shard numel,) reduce dtype
    for n, (j, copy) in enumerate(new):
        s.made[j] = copy + 1
        s.grads[(j, copy)] = h if n == 0 else None


def _grad_of(R: _Replay, s: _Step, trainables: tuple, j: int, oib: bool = False, stream: int = 0) -> None:
    """The gradient of trainable tensor ``j`` (its next copy, for a per-layer tensor), unless it
    exists. ``oib``: the optimizer steps inside backward and a hook frees it at once
    (``optim/in_backward.py``)."""
    _w, k, g, _sts, _m = trainables[j]
    copy = s.made.get(j, 0) if _w == "layer" else 0
    if copy >= k or (j, copy) in s.grads:
        return
    s.made[j] = copy + 1
    raw = _grad_request(R, s, j, g) if _w != "layer" else g       # (the layers' at their blocks: _grad_request)
    s.grads[(j, copy)] = R.alloc(raw, stream, charge=g)
    if isinstance(oib, tuple) and oib:                 # LOMO / AdaLomo: the next hook (this gradient's
        if s.lomo is not None:                         # parameter's) updates the one accumulated before
            _lomo_update(R, *s.lomo, oib)
        s.lomo = (s.grads[(j, copy)], g, _sts)
        s.grads[(j, copy)] = None
    elif oib or s.hook_frees:                          # (DeepSpeed ZeRO-1/2: copied into the bucket buffer,
        if oib and s.ao_events:  # torchao's compiled step in the hook, beside the gradient (``_torchao_graph``)
            _torchao_graph(R, s.ao_events[j])             # ``quantities.zero_partition.deepspeed_hook_partition``)
        R.free(s.grads[(j, copy)])
        s.grads[(j, copy)] = None


def _grad_request(R: _Replay, s: _Step, j: int, g: int) -> int:
    """The bytes trainable ``j``'s gradient requests: its own bytes on this rank (``States.grad_rank_raw``),
    not the block ``g`` a fresh request is charged (``States.trainables``), which ``_Replay.alloc``'s
    ``charge`` nets it to. Autograd makes the gradient at its parameter's size (torch 2.13
    ``csrc/autograd/functions/accumulate_grad.h`` ``accumulateGrad``: the incoming gradient is stolen as
    ``.grad``; the backward op's output is ``at::empty`` of the parameter's shape and dtype), and the
    allocator rounds only that to 512 B (c10/cuda/CUDACachingAllocator.cpp ``round_size``). The two differ
    where the gradient is 10 MiB or more and within 1 MiB below a multiple of 2 MiB
    (``allocator_rules.block_bytes``): from a larger cached free block it is split to its own size and
    the next request fits behind it. Trace, Mistral cut to 2 layers (h 1024, vocab 32000, fp32): the
    head's gradient asks 125 MiB (131072000 B), where the replay asked 126 MiB and so could not take a
    free 125.x MiB block. Falls back to ``g`` where the raw size is not known or is not this block's
    (a shard's where the whole gradient is made, FSDP1's re-partitioned units). ``_grad_of`` asks it for
    the tensors outside the layers only (embeddings, final norm, head): requested so, the layers'
    gradients moved Phi-2's (12 layers, b4 s2048 bf16-amp, full recompute; tests/test_derived_replay.py)
    reserved peak from +0.43 % to +2.7 % of trace's, its 25 MiB gradients split from blocks the
    replay's recomputation (one block per moment) holds apart from trace's; not resolved."""
    raw = s.grad_rank_raw[j] if j < len(s.grad_rank_raw) else 0
    return raw if raw > 0 and block_bytes(raw, R.a.expandable_segments) == g else g


def _lomo_update(R: _Replay, grad: int | None, g: int, factors: tuple, lomo: tuple) -> None:
    """One parameter's update in lomo_optim's hook (``quantities.optimizer_step.lomo_temporaries``), its gradient
    ``grad`` (``g`` bytes) freed: ``grad_fp32`` (a copy of a half gradient, which is then freed; an
    fp32 one is the gradient itself, freed at the end), AdaLomo's ``grad**2`` and ``+ eps``, its row
    and column factors (the size of its states, ``factors``) and their product, then ``p_fp32`` (a
    copy of half weights)."""
    optimizer, w = lomo
    f = g * 4 // w                                         # one fp32 tensor of the parameter's size
    made = []
    if w != 4:
        made.append(R.alloc(f))                            # grad_fp32; p.grad = None frees the gradient
        R.free(grad)
        grad = None
    if optimizer == "adalomo":
        sq, upd = R.alloc(f), R.alloc(f)                   # grad_fp32**2, + eps
        R.free(sq)
        parts = R.allocs(list(factors)) if len(factors) == 2 else []
        made.append(R.alloc(f))                            # torch.mul(r_factor, c_factor)
        R.frees(parts + [upd])
    if w != 4:
        made.append(R.alloc(f))                            # p_fp32
    R.frees(made + [grad])


def _allocate_states(R: _Replay, st: Any) -> list:
    """The optimizer states of every trainable tensor, in parameter order, each requested at its own
    bytes and charged its block (``_state_requests``)."""
    return [R.alloc(x, charge=b) for j in _parameter_order(st.trainables)
            for x, b in zip(_state_requests(R, st, j), st.trainables[j][3])]


def _state_requests(R: _Replay, st: Any, j: int) -> tuple:
    """The bytes trainable ``j``'s optimizer states request: their tensors' own bytes
    (``States.state_raw``), not the blocks a fresh request is charged (``States.trainables``), which
    ``_Replay.alloc``'s ``charge`` nets them to. The two differ where a request of 10 MiB or more is
    within 1 MiB below a multiple of 2 MiB (``allocator_rules.block_bytes``): served from a larger
    cached free block it is split to its own size (``_Replay.alloc``), so the next request fits behind
    it: trace requests each state at its own bytes (``torch.zeros_like(p)``, torch 2.13
    ``optim/adam.py`` ``_init_group``), e.g. a bf16 8000 x 1024 embedding's two AdamW states at 15.625 MiB,
    where the replay asked 16 MiB. Falls back to the blocks where the raw sizes are not known or were re-partitioned after they were
    counted (FSDP1's wrap policy: ``block_bytes`` of a raw size no longer its block)."""
    sts = st.trainables[j][3]
    raw = st.state_raw[j] if j < len(st.state_raw) else ()
    mode = R.a.expandable_segments
    if len(raw) != len(sts) or any(block_bytes(x, mode) != b and x != b for x, b in zip(raw, sts)):
        return sts
    return raw


def _redistributed_grads(R: _Replay, chunks: tuple) -> None:
    """A foreach Adam's redistributions of each replicated TP gradient to its states' ``Shard(0)``
    (``quantities.optimizer_step.tp_grad_redistributions``): ``_foreach_lerp_``'s clone of the chunk, made
    and freed, then ``_foreach_addcmul_``'s two, alive together, freed when it returns."""
    for nbytes in chunks:
        R.free(R.alloc(nbytes))
        R.frees([R.alloc(nbytes), R.alloc(nbytes)])


def _foreach_temps(R: _Replay, st: Any, sizes: list[int], total: int) -> list:
    """One list of a foreach step's temporaries (``total`` bytes over the group, ``sizes`` the blocks of
    each tensor's first state, in parameter order): where the list is one state-sized tensor per
    tensor (``total`` is their sum), each is requested at that state's own bytes (``_state_requests``)
    and charged its block, as ``_allocate_states`` requests the states: torch 2.13 ``optim/adam.py``
    ``_multi_tensor_adam`` makes ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``, one
    tensor of each state's shape and dtype, which the allocator rounds to 512 B only
    (c10/cuda/CUDACachingAllocator.cpp ``round_size``). Trace, Mistral cut to 2 layers (h 1024, vocab
    32000, fp32 states): the embedding's and the head's ``sqrt`` ask 125 MiB (131072000 B) each, where
    the replay asked their 126 MiB blocks. Otherwise the blocks scaled to ``total`` (``_scaled``)."""
    per = _scaled(sizes, total)
    if per != sizes or len(_parameter_order(st.trainables)) != len(sizes):
        return R.allocs(per)
    return [R.alloc(r, charge=x) for r, x in zip(_loop_requests(R, st, sizes), sizes)]


def _loop_requests(R: _Replay, st: Any, sizes: list[int]) -> list[int]:
    """The bytes each temporary of a per-tensor loop requests (``sizes``: the blocks of each tensor's
    first state, in parameter order): that state's own bytes (``_state_requests``), charged its block
    by the caller; ``_foreach_temps`` requests a foreach step's the same way. torch 2.13 ``optim/adam.py``
    ``_single_tensor_adam`` L544 ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``:
    ``sqrt`` and the quotient are tensors of the state's shape and dtype, which the allocator rounds to
    512 B only (c10/cuda/CUDACachingAllocator.cpp ``round_size``). Trace, Llama cut to 2 layers
    (h 2048, vocab 32000, TP 2, fp32): the (16000, 2048) embedding's and head's ask 125 MiB (131072000 B)
    each, where the replay asked their 126 MiB blocks. A tensor without states: its block."""
    order = _parameter_order(st.trainables)
    if len(order) != len(sizes):
        return list(sizes)
    return [(_state_requests(R, st, j) or (x,))[0] for j, x in zip(order, sizes)]


def _dropped_lists(lists: list[list]) -> list:
    """The order a foreach step's temporary lists free their tensors when the step drops them: CPython's
    ``list_dealloc`` decrements its items from the last to the first (CPython 3.11, the venv's, ``Objects/listobject.c``
    ``list_dealloc``: ``i = Py_SIZE(op); while (--i >= 0) Py_XDECREF(op->ob_item[i]);``), so each list
    (torch 2.13 ``optim/adam.py`` ``_multi_tensor_adam``'s ``exp_avg_sq_sqrt``) frees its last tensor
    first; the lists in the order made. Trace, GPT-2 (2 layers) b1 s1024 bf16-amp full recomputation,
    foreach AdamW: ``sqrt``'s 9, 9, 2.25, 6.75 MiB ... then 12 and the 147.24 MiB embedding's, where the
    replay freed the embedding's first."""
    return [h for hs in lists for h in reversed(hs)]


def _zero_grad_order(s: _Step, st: Any) -> list:
    """The ``.grad`` handles in the order ``zero_grad(set_to_none=True)`` drops them: parameter by parameter
    in each group's order (torch 2.13 ``optim/optimizer.py`` ``Optimizer.zero_grad``: ``for group in
    self.param_groups: for p in group["params"]: ... p.grad = None``), the model's parameter order
    (``states.parameter_order``; a per-layer item's n-th occurrence its n-th copy), not the order backward
    made them; handles the order does not name (a tied sum, ...) after, as made. Trace, GPT-2 (2 layers) b1
    s1024 bf16-amp full recomputation: the tied table's 147.24 MiB ``.grad`` freed first, then ``c_attn``'s,
    where the replay freed the head side's last."""
    seen: dict[int, int] = {}
    keys = []
    for j in _parameter_order(st.trainables):
        keys.append((j, seen.get(j, 0)))
        seen[j] = seen.get(j, 0) + 1
    named = [k for k in keys if k in s.grads]
    return [s.grads[k] for k in named] + [h for k, h in s.grads.items() if k not in set(named)]


def _adafactor_step(R: _Replay, s: _Step, st: Any, loop: tuple, lazy: bool) -> None:
    """transformers' ``Adafactor.step`` (transformers 5.24.0 ``optimization.py`` L1203-1287), one
    tensor at a time in parameter order, each allocation in its op order (``quantities.optimizer_step.adafactor_loop``
    gives the sizes). Per tensor: ``grad = p.grad`` drops the previous tensor's fp32 copy of a half
    gradient, ``grad.float()`` makes this one's (L1217-1219); at the first step its states, made here
    and not before the loop (L1228-1239: ``torch.zeros(grad_shape[:-1]).to(grad)`` and the column
    vector when factored, else ``zeros_like(grad)``); ``p_data_fp32 = p`` drops the previous weight
    copy and ``p.float()`` makes this one's (L1249-1251); ``update = (grad**2) + group["eps"][0]``:
    the square and the sum, the square freed, then the previous tensor's ``update`` freed by the
    rebinding (L1258); factored: ``update.mean(dim=-1)`` and ``(dim=-2)`` each made and freed by
    ``add_`` (L1263-1264), ``_approx_sq_grad``'s ``r_factor`` and ``c_factor`` and their product
    ``torch.mul`` (L1195-1200), the factors freed on return and the sum by the rebinding (L1267);
    a vector: ``exp_avg_sq.rsqrt()`` (L1273); ``p_data_fp32.add_(-update)``: ``-update`` made and
    freed (L1284). The last tensor's copies and ``update`` go when ``step`` returns. Scalars
    (``_rms``'s norm, the clip) are not replayed (512 B blocks of the small pool). The trace of
    Qwen3 (2 layers, b2 s512) shows this order: the embedding's ``update`` lives until the first
    layer tensor's square and sum exist."""
    g32 = p32 = upd = None                                       # the loop's locals from the previous tensor
    for j in _parameter_order(st.trainables):
        f, half, row, col = loop[j]
        one = _fp32_request(R, st, j, f)                         # (shape,) fp32 at its own bytes, charged f
        R.free(g32)
        g32 = one() if half else None                            # grad.float() (half gradients)
        if lazy:
            s.states += [R.alloc(x, charge=b) for x, b in zip(_state_requests(R, st, j), st.trainables[j][3])]
        R.free(p32)
        p32 = one() if half else None                            # p.float() (half weights)
        sq = one()                                               # grad**2
        new = one()                                              # ... + eps
        R.frees([sq, upd])
        if row:                                                  # factored: the means, then _approx_sq_grad
            R.free(R.alloc(row))
            R.free(R.alloc(col))
            factors = [R.alloc(row), R.alloc(col)]
            upd = one()                                          # torch.mul(r_factor, c_factor)
            R.frees(factors)
        else:
            upd = one()                                          # exp_avg_sq.rsqrt()
        R.free(new)
        R.free(one())                                            # -update
    R.frees([g32, p32, upd])


def _fp32_request(R: _Replay, st: Any, j: int, f: int) -> Any:
    """A call making one fp32 tensor of trainable ``j``'s shape in transformers' Adafactor step
    (``quantities.optimizer_step.adafactor_loop``'s ``f``, the block a fresh request of it is charged):
    requested at its own bytes, ``4 * numel`` (``States.trainable_elems``), and charged ``f``, as
    ``_state_requests`` requests the states: ``grad**2``, ``torch.mul(r_factor, c_factor)``, ``-update``
    and the ``float()`` copies are tensors of the parameter's shape (transformers 5.24.0
    ``optimization.py`` L1217-1284), which the allocator rounds to 512 B only (c10/cuda/
    CUDACachingAllocator.cpp ``round_size``), and from a larger cached free block it is split to that
    size. Trace, Mistral cut to 2 layers (h 1024, vocab 32000) b4 s512 pure bf16, eager, dp 4: the
    embedding's and head's fp32 copies and temporaries ask 125 MiB (131072000 B), the replay asked
    their 126 MiB blocks (peak reserved +8.48 -> +1.06 % of trace's; tests/test_adafactor_raw_replay.py).
    ``f`` itself where the elements are not known or their fp32 bytes are not that block's."""
    n = st.trainable_elems[j] if j < len(st.trainable_elems) else 0
    raw = 4 * n if n > 0 and block_bytes(4 * n, R.a.expandable_segments) == f else f
    return lambda: R.alloc(raw, charge=f)


def _torchao_graph(R: _Replay, events: tuple) -> None:
    """One tensor's ``single_param_adam`` graph (``torchao_optim.step_events``): its buffers allocated
    and freed in inductor's order, the rest freed when it returns."""
    live: list = []
    for e in events:
        if e > 0:
            live.append((e, R.alloc(e)))
        else:
            k = next(i for i, (size, _h) in enumerate(live) if size == -e)
            R.free(live.pop(k)[1])
    R.frees([h for _size, h in live])


def _optimizer_step(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, step: int,
                    temp_copies: int | None) -> None:
    """``optimizer.step()``: states at the first step, temporaries, then ``zero_grad``.
    ``temp_copies``: the step's temporaries per tensor of a per-tensor loop (for-loop Adam 2,
    transformers' Adafactor 2 or 4, none for fused / in-place steps), None for a foreach step: one
    state-sized temporary per tensor of the group, all alive at once (``quantities.optimizer_step.step_temporaries``);
    ``q.step_temp`` sets their total (the group's, or the largest tensor's ``temp_copies``)."""
    st = q.detail.states
    order = [st.trainables[j] for j in _parameter_order(st.trainables)]
    lazy = step == 1 and st.optimizer and not flags.states_at_init   # lazily, unless offloaded to the host
    zero3 = bool(q.ds_norm_fp64 and q.ds_step_fp32)              # DeepSpeed ZeRO-3 on the device
    if lazy and not zero3 and not q.ds_flat12 and not q.step_adafactor:   # (Adafactor: tensor by tensor)
        s.states = _allocate_states(R, st)
    sizes = [(sts[0] if sts else g) for (_w, _k, g, sts, _m) in order]
    if q.ds_norm_temp:                                           # DeepSpeed ZeRO-1/2: the norm's float64 piece
        R.free(R.alloc(q.ds_norm_temp))
    if zero3:                                                    # DeepSpeed ZeRO-3: per flat sub-group
        raw = st.grad_rank_raw
        _zero3_step(R, s, q, order, bool(lazy), tuple(raw[j] for j in _parameter_order(st.trainables))
                    if len(raw) == len(st.trainables) else ())
    elif q.ds_flat12:                                            # DeepSpeed ZeRO-1/2: one flat group, its states
        _zero12_step(R, s, q, st, bool(lazy))                    # made inside the first step
    elif q.ds_step_fp32:                                         # DeepSpeed: one flat fp32 partition per group
        flat, fp32 = R.alloc(q.ds_step_flat), R.alloc(q.ds_step_fp32)   # the cast: flat copy, then fp32
        R.free(flat)
        R.free(R.alloc(q.step_temp - q.ds_step_fp32 - q.ds_step_flat, one=False))  # the optimizer's own temporaries
        R.free(fp32)
    elif temp_copies is None:                                    # foreach: the whole group's at once, each
        _redistributed_grads(R, q.step_redistribute)             # (a replicated TP gradient's clones first)
        k = max(1, q.step_groups)                                # temporary per tensor as its own list (Adagrad 2)
        R.frees(_dropped_lists([_foreach_temps(R, st, sizes, q.step_temp // k) for _ in range(k)]))
    elif q.step_adafactor:                                       # transformers' Adafactor, in its op order
        _adafactor_step(R, s, st, q.step_adafactor, bool(lazy))
    elif q.step_linger and temp_copies and sizes:               # a loop whose last temporary lingers: the
        prev = None                                              # previous tensor's until the next's exist
        for x, raw in zip(sizes, _loop_requests(R, st, sizes)):  # (quantities.optimizer_step.loop_pair_bytes)
            made = [R.alloc(raw, charge=x) for _ in range(temp_copies)]
            R.frees(made[:-1])                                   # the expression's own, then the local rebound
            if prev is not None:
                R.free(prev)
            prev = made[-1]
        R.free(prev)
    elif q.step_events:                                          # GaLore: its step's own allocations and frees
        made = {}                                                # (galore.step_replay); what it keeps (a new
        events = q.step_events_first if step == 1 else q.step_events  # projector, ...) replaces what
        for ev in events:                                        # existed: freed
            if ev[0] == "a":                                     # at the end
                made[ev[1]] = R.alloc(ev[2])
            else:
                R.free(made.pop(ev[1]))
        R.frees(list(made.values()))
    elif temp_copies and sizes:                                  # a loop over tensors: each in turn
        per = _scaled(sizes, q.step_temp * sum(sizes) // (temp_copies * max(sizes)))
        for x in per:
            R.frees(R.allocs([x] * temp_copies))
    if q.ds_offload_upload:                                      # DeepSpeed ZeRO-1/2 offloaded (before v0.17.0): the
        R.free(R.alloc(q.ds_offload_upload))                     # fp32 partition copied back for the half cast
    if st.torchao_events and not flags.oib:                      # torchao: one compiled graph per tensor, in order
        for j in _parameter_order(st.trainables):
            _torchao_graph(R, st.torchao_events[j])
    R.mark("optimizer_step", step)
    if flags.oib or not (flags.zeros or flags.grads_persistent or q.grads_loaded):  # zero_grad(set_to_none=True)
        R.frees(_zero_grad_order(s, st))
        s.grads, s.made = {}, {}
    R.mark("zero_grad", step)
