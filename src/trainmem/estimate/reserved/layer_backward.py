"""A layer's backward in the replay: recomputation, its worst transient or its ops one by one (a
grouped-experts block's too, each op's saved tensors found from the block's forward group and its ops'
backward moments), each linear's weight gradient, a derived layer's recorded backward, FSDP1's early
view gradients."""
from __future__ import annotations

from typing import Any

from ...allocator_rules import block_bytes
from ..group_events import Bwd, Fwd, index
from ..layers import HALF
from ..moments import best_transient
from ..quantities import Quantities
from .fsdp import _Fsdp, _fsdp1_reduce, _fsdp1_whole, _unit_grads
from .layer_forward import (_Kept, _op_recomputed, _op_written, _per_linear, _recompute_casts, _redo_per_linear,
                            _saved_and_casts, _sequence_forward)
from .optimizer import _grad_of
from .replay import _placed, _Replay, _Step


def _linears_backward(R: _Replay, s: _Step, q: Quantities, kept: _Kept, where: tuple[str, ...], oib: bool) -> set:
    """Each linear's weight gradient, last linear first, as autograd makes it. Without autocast the
    ``mm`` output is the gradient, which ``AccumulateGrad`` keeps as ``.grad``. Under autocast ``mm``
    gives it in the compute dtype (the shape of the half copy), the copy is freed (its last reader),
    then autocast's ``ToCopyBackward0`` casts the gradient to the fp32 weight's dtype (the ``.grad``)
    and the half one is freed (``torch/csrc/autograd/generated/Functions.cpp``
    ``ToCopyBackward0::apply``; trace shows this order for every linear). The gradient is the layer's
    trainable tensor of that size (``States.trainables`` lists tensors, not linears; a sharded one
    matches none and is made with the layer's others). Returns the trainable indices whose gradient
    was made (the layer's others, its norms, follow in ``_layer_backward``)."""
    st = q.detail.states
    linears = q.detail.layer.linears
    copies = list(kept.casts or [None] * len(linears))
    pending = list(_placed(st.trainables, where))
    made: set = set()
    for i in reversed(range(len(linears))):
        lin = (i, copies, pending, made)
        half = _linear_grad(R, s, q, lin, oib, cast=True)          # mm's, compute dtype; the copy freed
        _linear_grad(R, s, q, lin, oib, cast=False)                # the weight's .grad, its dtype
        R.free(half)
    kept.casts = []
    return made


def _layer_backward(R: _Replay, s: _Step, q: Quantities, fs: _Fsdp, parts: list[int], kept: list, i: int,
                    n: int, nsq: int, recompute: str, oib: bool, below: list | None = None) -> None:
    """One layer's backward: recompute, the largest transient (a derived layer whose backward is recorded:
    its tensors as recorded, ``_recorded_backward``, which frees its saved tensors and ``below``'s, the layer
    below's, where the trace did), the gradients, then its tensors freed."""
    st = q.detail.states
    if fs.grad_op and fs.gathered:                                # grad-op: gathered since its forward; the
        params = fs.gathered.pop()                                # pre-backward unshard finds it so
    elif fs.last:                                                 # kept gathered since its forward
        params, fs.last = fs.last, []
    else:  # FSDP: gathered again (FSDP2: and the layer below prefetched)
        params = fs.unshard_backward(R, q.fsdp_layer_buf, st.layer_tensors, prefetch=i > 0, raw=q.fsdp1_layer_raw)
    per_linear = _per_linear(q, kept, recompute)                  # the weights' gradients linear by linear
    if recompute == "full" and _recompute_casts(q):               # the checkpointed forward again, with
        redo = _sequence_forward(R, q, parts, keep=True) if getattr(parts, "events", ()) else \
            _saved_and_casts(R, q, parts, inputs=False)           # autocast's weight copies at its linears
        R.frees([h for _at, h in R.carry])                        # (no next layer nor loss follows a recomputed one)
        R.carry = []
        kept, per_linear = _Kept(list(kept), redo.casts), _redo_per_linear(q)
    elif _op_written(parts, recompute) is not None and (_recompute_casts(q) or _uncast_by_op(q, parts)):  # per-op:
        grad_in = _incoming_first(R, q, parts, n)                 # the incoming gradient, there already
        redo = _saved_and_casts(R, q, _op_recomputed(q, parts), inputs=False,  # recomputed with its copies
                                held_in=True)                     # and the norms' outputs its linears read
        kept, per_linear = _Kept(list(kept), redo.casts), _redo_per_linear(q)
        R.layer.grad_in = grad_in
    else:
        redo = R.allocs(parts, one=getattr(parts, "whole", True)) if recompute != "none" else []  # forward again
    R.frees(R.allocs(_recompute_blocks(q, n, nsq)))               # ... its frames' own tensors meanwhile
    flat1 = bool(st.layer_grads_full and not fs.v2 and q.fsdp1_post)  # FSDP1: views, flat gradient, hook
    early = _fsdp1_early_views(q, st, n, nsq) if flat1 and not per_linear else None
    views = R.allocs(st.layer_tensors[j] for j in early) if early else []  # made by the worst moment
    where = ("layer", f"layer{i}")
    pre: set = set()
    held: list = []
    unsharded = _fsdp2_unsharded(st, fs)                          # FSDP2's gradients, by tensor
    recorded = _recorded(q, parts, recompute, flat1 or bool(st.layer_grads_full))
    if recorded or not (per_linear and _by_op(q, parts, recompute, flat1)):  # not op by op: its moments count
        R.free(R.layer.resid_grad)                                # the incoming gradient (the final norm's,
        R.layer.resid_grad = None                                 # ``loss_backward._final_norm_backward``)
    if recorded:                                                  # a derived layer, tensor by tensor
        pre, tr, per_linear = _recorded_backward(R, s, q, (parts.bwd, kept, below), where, oib), None, False
    elif per_linear and _by_op(q, parts, recompute, flat1):  # a hand-written layer, op by op
        saved = kept if recompute == "none" else redo             # its saved tensors in save order
        pre, tr, per_linear = _op_backward(R, s, q, (kept, saved), (n, nsq), where, oib), None, False
    elif not per_linear and _moe_by_op(q, parts, flat1 or bool(st.layer_grads_full and unsharded is None)):
        pre = _moe_backward(R, s, q, (redo if recompute != "none" else kept, parts), (n, nsq), where, oib,
                            unsharded)                            # grouped experts op by op,
        tr = R.alloc(_transient_before_moe(q, n, nsq), one=False)  # then the rest's worst moment, one block
    else:  # the worst backward moment as one block: several tensors (not netted, ``_Replay.alloc``)
        held_b = [] if per_linear else _leaf_held(q, n, nsq)      # a ZeRO-3 leaf MoE block: down's gradient,
        held = R.allocs(held_b)                                   # its own tensor, made first
        tr = R.alloc(_activation_transient(q, n, nsq) if per_linear else _transient(q, n, nsq) - sum(held_b),
                     one=False)
    if flat1 and _fsdp1_whole(q, st):                             # every op of the layer ran before the
        R.frees([tr] + redo)                                      # cat: their tensors freed by then
        tr, redo = None, []
        params = _fsdp1_reduce(R, q, st, params, fs, views, early or [])
    elif flat1:
        params = _fsdp1_reduce(R, q, st, params, fs)
    elif st.layer_grads_full and fs.v2:                           # FSDP2: the unsharded gradients made, the
        full = [unsharded.pop(j) if j in unsharded else R.alloc(x) for j, x in enumerate(st.layer_tensors)] \
            if unsharded is not None else R.allocs(st.layer_tensors) if st.layer_tensors \
            else [R.alloc(st.layer_grads_full, one=False)]        # (some made by _moe_backward)
        R.frees([tr] + redo + kept + kept.casts)                  # layer's backward done, its tensors freed;
        tr, redo, kept = None, [], _Kept([])                      # then its post-backward hook
        fs.post_backward(R, params, full, q.fsdp_rs_buf or q.fsdp_rs_side or st.layer_grads_full)
        params = []
    elif st.layer_grads_full:                                     # FSDP1 without a hook of its own
        fs.reduce(R, [R.alloc(st.layer_grads_full)], q.fsdp_rs_buf or st.layer_grads_full)
    made = _linears_backward(R, s, q, kept, where, oib) if per_linear else pre
    _unit_grads(R, s, fs, st.trainables, where, oib, made)
    fs.reduced(R)                                                 # FSDP2 < 2.5: its reduce-scatter input dropped
    R.free(tr)
    R.frees(held)
    fs.reshard(R, params)                                         # FSDP1 without its reduce hook (no_sync)
    R.frees(redo)
    R.frees(kept + kept.casts)


def _by_op(q: Quantities, parts: Any, recompute: str, flat1: bool) -> bool:
    """Whether a hand-written layer's backward is replayed op by op (``_op_backward``): its recipe
    (``_Parts.whole``: the layer's saved tensors listed one by one) lists each backward op's tensors
    (``LayerCoefs.moment_blocks``, one per backward transient), without recomputation, FSDP's flat
    gradients or DeepSpeed's recorded fetches (the replay's one block stays there). Called where
    ``_per_linear`` holds (one GPU, DDP, pipeline stages: ``quantities.head_moments.per_linear_replay``).

    Also under torchtitan's per-op policy where the first forward was replayed tensor by tensor
    (``_op_written``, ``_op_forward``) and the copies linear by linear (``_recompute_casts``, as
    ``_layer_backward`` replays a fully recomputed layer): the layer's recomputation runs when
    backward first unpacks one of its tensors, remaking its saved tensors and, under its own
    autocast context, the weight copies its matmuls save (torch 2.13 ``utils/checkpoint.py``
    ``_checkpoint_hook.unpack_hook`` -> ``recompute_fn``), then its nodes run as a layer's without
    recomputation do (each MLP weight's fp32 gradient right after its half one, as trace makes them;
    one block of its worst moment made them in a row: tests/test_op_forward_replay.py). Against
    trace, Llama-3.2 shapes (2 layers, b8 s256, bf16-amp, Adam, for-loop) with the causal-LM head
    side replayed tensor by tensor: -0.19 % on the peak reserved memory, +11.6 % with the one block
    (its holes in the 16-32 MiB segments sent an Adam state into the freed 502 MiB head-copy segment
    the second step needs; docs/agreement.md, reserved section, ``bwlay``)."""
    lc = q.detail.layer
    by_op = recompute == "none" or _op_written(parts, recompute) is not None
    return (by_op and bool(lc.moment_blocks) and getattr(parts, "whole", False)
            and len(lc.moment_blocks) == len(_backward_ops(q))
            and not flat1 and not q.detail.states.layer_grads_full and not q.ds_events)


def _uncast_by_op(q: Quantities, parts: Any) -> bool:
    """Under torchtitan's per-op policy without autocast's weight copies (fp32, pure bf16/fp16, FSDP's
    mixed precision: ``q.cast_layer`` 0), whether the layer's backward is replayed op by op
    (``_by_op``, ``_op_backward``) after its recomputation, as ``_layer_backward`` replays it under
    autocast: nothing of the op-by-op replay needs the copies (``_op_backward`` takes none per linear),
    the recomputation remakes the layer's saved tensors but the policy's (``_op_recomputed``) and the
    weights' gradients are made at their linears' moments (``_linear_grad``). The one block of the
    layer's worst moment made every tensor of its backward at once, a 102 MiB block with the recomputed
    tensors beside it on Llama (h 2048) b8 s256 fp32, where trace frees each op's before the next:
    against trace its last pipeline rank opened a 44 MiB and a 250 MiB segment more in the first
    backward (``--pp 2`` interleaved, fp32, op recompute, AdamW-8bit: +15.8 -> +7.2 % on the peak
    reserved memory). Not where ``_by_op`` refuses (FSDP's flat or unsharded gradients, DeepSpeed's
    recorded fetches): there the one block stays, weights' gradients as before."""
    return not q.cast_layer and _by_op(q, parts, "op", False)


def _op_groups(lc: Any) -> tuple[list, list]:
    """``lc.moment_blocks`` grouped by op (the consecutive moments of one linear: its ``mm`` and its
    ``ToCopyBackward0``), in recorded order, and each group's first moment's index."""
    groups: list = []
    starts: list = []
    for i, m in enumerate(lc.moment_blocks):
        if groups and m[1] >= 0 and groups[-1][0][1] == m[1]:
            groups[-1].append(m)
        else:
            groups.append([m])
            starts.append(i)
    return groups, starts


def _op_backward(R: _Replay, s: _Step, q: Quantities, ks: tuple, nb: tuple[int, int], where: tuple[str, ...],
                 oib: bool) -> set:
    """A hand-written layer's backward op by op, last op first (autograd runs a layer's nodes in
    reverse of its forward, torch 2.13 ``torch/csrc/autograd/engine.cpp`` ``Engine::thread_main``:
    the ready queue orders nodes by ``sequence_nr``, the latest first), instead of one block of its
    worst moment: each op's backward tensors (``LayerCoefs.moment_blocks``, ``Recipe.transient``'s
    ``ts``: a linear's output and input gradients in the compute dtype, ``derivatives.yaml`` ``mm``
    ``self: mm_mat1_backward``; eager attention's fp32 ``_softmax_backward_data`` output and the
    scores' gradient; SDPA's grad_q/k/v and its fp32 scratch), each its own block, freed before the
    next op's. A linear's weight gradient is made inside its backward, beside its moment's tensors
    (``_linear_grad``, as ``_linears_backward`` makes it: under autocast ``mm``'s half gradient, the
    weight copy freed, then ``ToCopyBackward0``'s fp32 ``.grad`` at the linear's second moment). The
    saved tensors of the ops back-propagated already are freed before each op's tensors
    (``_release_saved``, ``Node::release_variables``; those left at the layer's end as before).
    Where a residual branch's dropout makes the branch's output gradient a tensor of its own
    (``LayerCoefs.resid_grad``: GPT-2), the residual stream's gradient is held beside every op of the
    layer, as one block: ``AddBackward0`` hands the layer's output gradient to both the branch and
    the residual path, where it waits in the input buffer of the node below
    (``torch/csrc/autograd/input_buffer.h`` L4-6) until the branch's gradient arrives through the
    norm's backward; their sum is then held through the attention branch the same way (transformers
    5.24 ``models/gpt2/modeling_gpt2.py`` L285, L310: ``hidden_states = residual + ...``). A moment
    that counts it (``LayerCoefs.incoming``) does not make it again (``_moment_sizes``). Without it
    and with the saved tensors released, GPT-2 b1 s2048 fp32 loss upcast ga 2 was +15.1 % over trace's
    peak reserved memory (``mlp.c_proj``'s 9 MiB weight gradient found the 6 MiB hole trace fills
    with it, and a later one went into a logits segment), 0.00 % with it, every segment equal.
    Against trace on the agreement grid: beyond 5 % 64 -> 62 of 409 (GPT-2 b1 s1024 +10.66 ->
    -0.69 %, b1 s2048 fp32 ga 2 +14.34 -> -0.79 %, Mistral b4 s512 eager dp 4 Adafactor +8.48 ->
    +1.06 %; Mistral b2 s512 eager pp 2 ga 2 +1.05 -> -9.11 %, its last stage's second micro-batch
    head cast placed in a logits segment trace finds split; docs/agreement.md, reserved section,
    2026-11-26 ``bert``). An earlier attempt at freeing each op's tensors where its node ran moved
    27 rows, 14 further (docs/validation.md ``reslbw``). ``ks``: (what the layer kept, its saved tensors
    in save order: the kept ones without recomputation, the remade ones under the per-op policy, whose
    kept list starts with the layer's output). The remade ones, indexed as the kept ones would be (the
    policy's cached ones None: released with ``kept`` at the layer's end), stand in the backward groups
    (``_covered``, ``_run_group``'s "sK") and before ``_mm_moment`` as the kept ones do without
    recomputation, and the first group takes the incoming gradient made before the recomputation
    (``_incoming_first``). Before, a recomputed layer's ops were replayed moment by moment (the MLP's
    three (b, s, f) gradients at once, each linear's input gradient before its weight's, the weight
    copy freed between them): against trace, Llama-3.2 (GQA) b1 s2048 bf16-amp per-op +10.70 -> -0.01 %,
    b8 s256 Adam for-loop +11.79 -> -0.00 %, Mistral b1 s2048 fp16-amp +10.20 -> -0.04 %; three rows whose
    layout already differed from trace's moved away (docs/agreement.md, reserved section, ``opbwd``).
    ``nb``: (tokens, tokens x keys). Returns the trainable indices whose gradient was made."""
    (lc, st), n, (kept, saved) = (q.detail.layer, q.detail.states), nb[0], ks
    pending, made = list(_placed(st.trainables, where)), set()
    copies = list(kept.casts) or [None] * len(lc.linears)
    groups, starts = _op_groups(lc)
    resid, R.layer.resid_grad = R.layer.resid_grad, None          # made by the final norm's backward, or
    if resid is None and lc.resid_grad:                           # (b, s, h), the stream's dtype, made here
        resid = R.alloc(int(lc.resid_grad * n))
    carry, R.layer.grad_in = [h for h in (R.layer.grad_in,) if h is not None], None  # (``_incoming_first``)
    ctx = (saved, n, lambda j, e: _group_grad(R, s, q, (j, copies, pending, made), oib, e), carry, [])
    for group, start in reversed(list(zip(groups, starts))):
        if _covered(R, lc, (start, starts), ctx):                 # the op's tensors in op order
            continue
        _release_saved(R, saved, lc.moment_saved, start, len(lc.tensors))
        half = None
        for k, (blocks, lin) in enumerate(group):
            sizes = _moment_sizes(lc, start + k, blocks, nb, resid is not None)  # (b, s, width) each
            if lin >= 0 and k == 0 and lin in lc.mm_linears and resid is None and len(sizes) >= 2:
                hs, half = _mm_moment(R, sizes, lambda: _linear_grad(R, s, q, (lin, copies, pending, made), oib,
                                                                     cast=len(group) > 1, keep=True))
                ctx[2](lin, Bwd.DROP_COPY)                         # its weight copy released: the node ran
                R.frees(hs)
                continue
            hs = R.allocs(sizes)
            if lin >= 0 and k == 0:                                # mm: the weight gradient (half under autocast)
                half = _linear_grad(R, s, q, (lin, copies, pending, made), oib, cast=len(group) > 1)
            elif lin >= 0:                                         # ToCopyBackward0: its fp32 .grad
                _linear_grad(R, s, q, (lin, copies, pending, made), oib, cast=False)
                R.free(half)
                half = None
            R.frees(hs)
        R.free(half)
        _group_backward(R, lc, start, ctx)
    R.frees(ctx[3] + ctx[4])                                       # (a carried block no group took)
    R.free(resid)
    R.frees(copies)
    kept.casts = []
    return made


def _incoming_first(R: _Replay, q: Quantities, parts: Any, n: int) -> int | None:
    """Under the per-op policy, the layer's incoming gradient (the first block its first backward group
    takes, "u": ``_op_backward``'s first, the last op's, a Llama MLP's ``_swiglu_backward``), made before
    the layer's recomputation, as autograd made it: the final norm's (or the layer above's) backward
    ran before this layer's first node unpacks a saved tensor and so triggers the recomputation (torch
    2.13 ``utils/checkpoint.py`` ``_checkpoint_hook.unpack_hook``). Trace, Llama-3.2 (h 2048) b1 s2048
    bf16-amp: the 16 MiB fp32 gradient is made by the final RMSNorm's ``PowBackward0`` before the top
    layer's recomputation, and lives on to its post-attention norm's backward; the replay made it after
    the recomputation, in a logits segment. None where ``_op_backward`` will not run a group first."""
    lc = q.detail.layer
    if not (_redo_per_linear(q) and _by_op(q, parts, "op", False) and lc.moment_blocks):
        return None
    last = len(lc.moment_blocks) - 1
    g = next((g for g in lc.bwd_groups if g[4] and g[0] <= last < g[0] + g[4]), None)
    if g is None or not g[3] or g[3][0] != Bwd.TAKE or not g[2]:
        return None
    a, b = g[2][0]                                                # (b, s, h), the stream's dtype
    return R.alloc(int(a * n + b * n)) if a or b else None


def _covered(R: _Replay, lc: Any, at: tuple, ctx: tuple) -> bool:
    """Whether the op whose first moment is ``at[0]`` lies in a backward group that replaces its ops' moments
    (``LayerCoefs.bwd_groups`` with a cover: Llama's SwiGLU MLP, ``layers._swiglu_backward``): the group
    is replayed once, where ``_op_backward`` reaches its last op (``at[1]``: each op's first moment),
    then, at its first op, the groups that follow it (its norm's, ``_group_backward``)."""
    start, starts = at
    for g in lc.bwd_groups:
        first, cover = g[0], g[4]
        if cover and first <= start < first + cover:
            if start == max(x for x in starts if first <= x < first + cover):
                _run_group(R, g, ctx)
            if start == first:
                _group_backward(R, lc, start, ctx)
            return True
    return False


def _group_backward(R: _Replay, lc: Any, start: int, ctx: tuple) -> None:
    """The backward groups without a cover (``LayerCoefs.bwd_groups``, ``layers.Recipe.backward_group``:
    Llama's RMSNorm, ``layers._rms_norm_backward_half``) of the op before the one whose first moment is
    ``start``: once that op's nodes have run (``_op_backward``, last op first), ``_run_group``."""
    for g in lc.bwd_groups:
        if g[0] == start and not g[4]:
            _run_group(R, g, ctx)


def _run_group(R: _Replay, g: tuple, ctx: tuple) -> None:
    """One backward group's tensors in op order (codes ``group_events.Bwd``): each (b, s, width) block made ("t"), freed ("fK"), the
    layer's saved tensors released ("sK": ``kept``'s, from the group's base, set to None so that
    ``_release_saved`` and the layer's end skip them) and linear K's weight gradient made ("wK", ``grad``:
    ``_group_grad``: "hK" its half one under autocast, as the next block, "xK" its half weight copy freed), a block kept for a later group ("cK": ``ctx``'s carry) and taken there as the next
    block ("u"; made where none is carried); the residual stream's gradient kept past the attention
    branch ("kK", ``stream``) and taken by the input norm's group as its next block ("r"; made where none
    is kept: ``layers._norm_stream_events``); its blocks left are freed at the end. ``ctx``: (``kept``, the micro-batch's
    tokens, ``grad``, the carry, the stream's kept gradient)."""
    kept, n, grad, carry, stream = ctx
    _at, base, temps, events, _cover = g
    made: list = []
    for e in events:
        if e in (Bwd.TEMP, Bwd.TAKE, Bwd.TAKE_STREAM):
            a, b = temps[len(made)]
            have = carry if e == Bwd.TAKE else stream if e == Bwd.TAKE_STREAM else []
            made.append(have.pop(0) if have else R.alloc(int(a * n + b * n)) if a or b else None)
        elif e[0] in (Bwd.CARRY, Bwd.KEEP_STREAM):
            (carry if e[0] == Bwd.CARRY else stream).append(made[index(e)])
            made[index(e)] = None
        elif e[0] == Bwd.FREE:
            R.free(made[index(e)])
            made[index(e)] = None
        elif e[0] in (Bwd.WEIGHT_GRAD, Bwd.DROP_COPY):
            grad(index(e), e[0])
        elif e[0] == Bwd.HALF_GRAD:
            made.append(grad(index(e), Bwd.HALF_GRAD))
        elif 0 <= base + index(e) < len(kept):                    # Bwd.RELEASE
            R.free(kept[base + index(e)])
            kept[base + index(e)] = None
    R.frees([h for h in made if h is not None])


def _group_grad(R: _Replay, s: _Step, q: Quantities, lin: tuple, oib: bool, e: str) -> int | None:
    """A backward group's weight-gradient event (``_run_group``) for linear ``lin[0]`` (``_linear_grad``'s
    ``lin``): "w" its ``.grad`` (``_linear_grad``, the weight's dtype), "h" under autocast ``mm``'s half
    gradient (returned; the caller frees it after ``ToCopyBackward0``), "x" its half weight copy freed
    (``MmBackward0`` releasing it once it has run, after the input's gradient is made)."""
    i, copies, _pending, _made = lin
    if e == Bwd.HALF_GRAD:
        _pos, w, gbytes = q.detail.layer.linears[i]
        return R.alloc(round(w) * HALF) if gbytes else None
    if e == Bwd.DROP_COPY:
        R.free(copies[i])
        copies[i] = None
        return None
    return _linear_grad(R, s, q, lin, oib, cast=False)


def _mm_moment(R: _Replay, sizes: list[int], grad: Any) -> tuple[list, Any]:
    """A bias-free linear's ``MmBackward0`` moment in ``_op_backward``: its output's gradient and any other
    tensor of the moment first (``sizes[0]``, ``sizes[2:]``), then the weight's gradient (``grad()``, the
    caller's ``_linear_grad``; returned), then the input's (``sizes[1]``, (b, s, in) in the matmul's
    dtype). ``linear`` on a 3-D input folds it into ``mm(input, weight.t())`` (torch 2.13
    ``aten/src/ATen/native/LinearAlgebra.cpp`` ``_matmul_impl``); its node makes ``mat2``'s gradient
    (``mm_mat2_backward``: ``self.t().mm(grad)``, the weight's) before ``self``'s (``mm_mat1_backward``:
    ``grad.mm(mat2.t())``) (``tools/autograd/derivatives.yaml`` ``mm``): trace (the real node on fake tensors),
    a Llama (h 1024, f 2816) b2 s512 pure bf16 asks ``up_proj``'s 5.5 MiB (f, h) weight gradient before its
    2 MiB input gradient, as for the causal-LM head (``loss_backward._final_norm_backward``). A biased
    linear (``addmm``) makes the input's first: the moment's order (``LayerCoefs.mm_linears``). The
    generated node computes its outputs in the sorted order of their names (torchgen
    ``packaged/autograd/load_derivatives.py`` L585, ``for raw_names in sorted(defn.keys())``: ``mat2``
    before ``self``) and releases its saved tensors, the half weight copy among them, only once both are
    made (the caller frees the copy after this: ``_linear_grad``'s ``keep``)."""
    hs = R.allocs([sizes[0]] + sizes[2:])
    made = grad()
    return hs + [R.alloc(sizes[1])], made


def _moment_sizes(lc: Any, i: int, blocks: tuple, nb: tuple[int, int], held: bool) -> list[int]:
    """Bytes of the tensors of the layer's ``i``-th backward moment (``LayerCoefs.moment_blocks``: (per
    token, per token x key) each, its dtype) at ``nb`` (tokens, tokens x keys), less the layer's output
    gradient it counts (``LayerCoefs.incoming``) where ``_op_backward`` holds the residual stream's
    gradient through the whole layer (``held``; ``LayerCoefs.resid_grad``): that tensor is the held one."""
    n, nsq = nb
    sizes = [int(a * n + b * nsq) for a, b in blocks]
    inc = int(lc.incoming[i] * n) if held and i < len(lc.incoming) else 0
    if inc and inc in sizes:
        sizes.remove(inc)
    return sizes


#: the backward ops of ``layers._moe`` (grouped experts), in forward order
_MOE_OPS = ("experts.gate_up.backward", "experts.act.backward", "experts.down.backward", "experts.combine.backward")


def _fsdp2_unsharded(st: Any, fs: _Fsdp) -> dict | None:
    """FSDP2: an empty map for the unsharded gradients ``_moe_backward`` makes (tensor index -> handle),
    where the layer's unsharded tensors (``States.layer_tensors``) are its gradients, every parameter
    training (their bytes sum to ``layer_grads_full``); else None."""
    whole = bool(st.layer_grads_full and fs.v2 and st.layer_tensors and sum(st.layer_tensors) == st.layer_grads_full)
    return {} if whole else None


def _moe_by_op(q: Quantities, parts: Any, flat: bool) -> bool:
    """Whether a layer's grouped-experts block is replayed op by op (``_moe_backward``): its recipe
    lists the block's four backward ops last (``layers._moe``) with their tensors
    (``LayerCoefs.moment_blocks``) and its saved tensors are known (``_moe_saved``, one tensor each),
    outside FSDP's flat gradients and DeepSpeed's recorded fetches (whose hooks the replay places
    around one block)."""
    ops = _backward_ops(q)
    return (_moe_saved(q, parts) is not None and len(q.detail.layer.moment_blocks) == len(ops)
            and getattr(parts, "whole", False) and not flat and not q.ds_events)


def _moe_saved(q: Quantities, parts: Any) -> tuple | None:
    """Where a grouped-experts block's saved tensors lie among the layer's (``_moe_backward``): where its
    forward group starts (``_Parts.groups``; ``layers._moe_forward_events``, ``Recipe.group_ahead``: the
    gathered rows when the experts train, else gate/up's output), then, for each op of ``_MOE_OPS``, how
    many tensors the layer had saved at its backward moment (``LayerCoefs.moment_saved``), the last of
    them where the group ends. Op ``k``'s own saved tensors, which autograd releases once its node has
    run, lie from the returned tuple's ``k``-th entry to its next: with trained experts the rows (gate/up's),
    gate/up's output and SwiGLU's activation (SwiGLU's), the product (down's), down's output (the routing
    multiply's); with frozen ones, none (gate/up's, down's), gate/up's output and the activation
    (SwiGLU's), down's output (the routing multiply's) (transformers 5.24 ``integrations/moe.py``
    L424-537; ``derivatives.yaml`` ``_grouped_mm``). None where the recipe does not list the block's
    four ops last or no forward group of the layer ends where the block's saved tensors do."""
    lc = q.detail.layer
    last = len(_backward_ops(q))
    first = last - len(_MOE_OPS)
    if first < 0 or tuple(t[0] for t in lc.transients[first:last]) != _MOE_OPS or len(lc.moment_saved) < last:
        return None
    counts = tuple(lc.moment_saved[first:last])                   # saved by each op's backward moment
    at = next((g[0] for g in getattr(parts, "groups", []) if g[0] <= counts[0]
               and g[0] + g[2].count(Fwd.SAVED) == counts[-1]), None)
    return None if at is None else (at,) + counts


def _moe_backward(R: _Replay, s: _Step, q: Quantities, saved: tuple, nb: tuple[int, int], where: tuple[str, ...],
                  oib: bool, unsharded: dict | None = None) -> set:
    """A grouped-experts block's backward op by op, last op first (as ``_op_backward``: autograd runs
    the layer's nodes in reverse of its forward): each op's backward tensors (``LayerCoefs.moment_blocks``:
    combine's fp32 gradients, down's input and output gradients, SwiGLU's, gate/up's), each its own
    block, freed before the next op's; down's and gate/up's weight gradients made inside their
    ``_grouped_mm`` backward (the op's constant, ``Recipe.transient``'s ``const``: the trainable of
    that size, ``_grad_of``); and after each op the block's saved tensors that it alone read freed
    (autograd releases a node's saved variables once it has run, torch 2.13
    ``torch/csrc/autograd/engine.cpp`` ``call_function`` -> ``Node::release_variables``): down's
    output after the routing multiply's backward, the product after down's, gate/up's output and the
    activation after SwiGLU's, the gathered rows after gate/up's (transformers 5.24
    ``integrations/moe.py`` L424-537; ``_moe_saved``). The one block of the layer's worst moment
    counted each expert gradient twice (the op's constant, then ``_unit_grads``) beside every saved
    tensor of the block: a Mixtral-shaped layer (b1 s2048, bf16-amp) 336 MiB of gradients and 240
    MiB of released tensors above trace at gate/up's backward. ``saved``: (the layer's saved handles,
    one per part: its kept tensors, or its recomputed ones; the parts); ``nb``: (tokens, tokens x keys).
    ``unsharded`` (FSDP2): the weight gradients are the unsharded parameters' (``States.layer_tensors``,
    the gathered dtype), fresh each backward (the post-backward hook reduce-scatters and frees them,
    ``_fully_shard/_fsdp_param_group.py`` ``post_backward``): their handles go there by tensor index,
    for ``_layer_backward`` to hand to the hook with the layer's others. Returns the trainable indices
    whose gradient was made (the layer's others follow in ``_layer_backward``)."""
    handles, parts = saved
    bounds = _moe_saved(q, parts)                                 # each op's saved tensors: bounds[k]:bounds[k + 1]
    st = q.detail.states
    ops = _backward_ops(q)
    first = len(ops) - len(_MOE_OPS)
    pending, made = list(_placed(st.trainables, where)), set()
    for k in reversed(range(len(_MOE_OPS))):
        blocks, _lin = q.detail.layer.moment_blocks[first + k]
        hs = R.allocs([int(a * nb[0] + b * nb[1]) for a, b in blocks])  # (S, width) each, its dtype
        want = block_bytes(round(ops[first + k][2]), q.expandable) if ops[first + k][2] > 0 else 0
        if unsharded is not None:                                 # FSDP2: the unsharded parameter's
            u = next((u for u, x in enumerate(st.layer_tensors) if want and u not in unsharded
                      and block_bytes(x, q.expandable) == want), None)
            if u is not None:
                unsharded[u] = R.alloc(st.layer_tensors[u])
        j = None if unsharded is not None else next((j for j in pending if want and st.trainables[j][2] == want), None)
        if j is not None:                                         # the op's weight gradient
            pending.remove(j)
            made.add(j)
            hs.append(_expert_grad(R, s, st.trainables, j, oib))
        R.frees(hs)
        for x in range(bounds[k], min(bounds[k + 1], len(handles))):  # its saved tensors released
            R.free(handles[x])
            handles[x] = None
    return made


def _expert_grad(R: _Replay, s: _Step, trainables: tuple, j: int, oib: bool) -> int | None:
    """The weight gradient a grouped-experts ``_grouped_mm`` backward makes (``_moe_backward``): stolen as
    ``.grad`` where none exists (``_grad_of``; None returned); where it exists (a later micro-batch, or
    ``zero_grad(set_to_none=False)``) ``AccumulateGrad`` adds it in place (torch 2.13
    ``csrc/autograd/functions/accumulate_grad.h`` ``accumulateGrad``: ``variable_grad += new_grad``), so
    it is a tensor of its own until its node has run: returned, for the caller to free after the op
    (as ``optimizer._accumulated`` for the head's). Trace, Mixtral-shaped b2 s512 fp32 with two
    micro-batches: the second's gate/up gradient opens a 224 MiB segment."""
    _w, k, g, _sts, _m = trainables[j]
    copy = s.made.get(j, 0) if _w == "layer" else 0
    if copy >= k or s.grads.get((j, copy)) is not None:
        return R.alloc(g)
    _grad_of(R, s, trainables, j, oib)
    return None


def _transient_before_moe(q: Quantities, n: int, nsq: int) -> int:
    """``_transient`` over the layer's ops before its grouped-experts block (``_moe_backward`` replays
    the block's own): the worst moment among them, less the later linears' gradients, one block."""
    ops = _backward_ops(q)
    _idx, value, grads = best_transient(ops[:len(ops) - len(_MOE_OPS)], n, nsq)
    return max(0, value - grads)


def _release_saved(R: _Replay, kept: _Kept, saved: tuple, start: int, total: int) -> None:
    """Before the backward of the op whose first moment is ``start``: the layer's saved tensors made
    after that moment (``LayerCoefs.moment_saved``, in save order, the first ones of ``kept``) belong
    to ops back-propagated already, whose nodes released them once they ran (torch 2.13
    ``csrc/autograd/engine.cpp`` ``call_function`` -> ``Node::release_variables`` unless
    ``retain_graph``); a tensor several ops saved counts from its first save, so it lives until the
    earliest of them has run. Freed here and dropped from ``kept``. Up to the layer's last saved tensor
    (``total``, ``len(LayerCoefs.tensors)``; ``kept`` may hold more: autocast's copies as one block), not
    the last moment's count: a tensor saved after the layer's last moment belongs to an op whose backward
    has no moment of its own and ran first, GPT-2's MLP dropout mask (``native_dropout_backward(grad,
    mask, scale)``, torch 2.13 ``tools/autograd/derivatives.yaml`` ``native_dropout``), released before
    ``mlp.c_proj``'s backward (trace, GPT-2 b1 s2048 fp32: the 1.5 MiB mask freed before ``c_proj``'s input
    gradient is made); the replay kept it to the layer's end."""
    if start >= len(saved):
        return
    for i in range(saved[start], min(len(kept), total)):
        R.free(kept[i])
        kept[i] = None


def _linear_grad(R: _Replay, s: _Step, q: Quantities, lin: tuple, oib: bool, cast: bool,
                 keep: bool = False) -> int | None:
    """One linear's weight gradient in ``_op_backward`` (``_linears_backward``' step): ``cast``: under
    autocast ``mm`` makes it in the compute dtype (returned, freed after ``ToCopyBackward0``) and its
    half weight copy is freed (``keep``: left to the caller, ``_mm_moment``); else the ``.grad`` itself,
    the trainable of its size (``_grad_of``).
    ``lin``: (its index in ``LayerCoefs.linears``, the copies, the pending and made trainables)."""
    i, copies, pending, made = lin
    st = q.detail.states
    _pos, w, gbytes = q.detail.layer.linears[i]
    if cast:
        half = R.alloc(round(w) * HALF) if (copies[i] is not None and gbytes) else None
        if not keep:
            R.free(copies[i])
            copies[i] = None
        return half
    R.free(copies[i])
    copies[i] = None
    want = block_bytes(round(w) * gbytes, q.expandable)            # the weight's .grad, its dtype
    j = next((j for j in pending if gbytes and st.trainables[j][2] == want), None)
    if j is not None:
        pending.remove(j)
        made.add(j)
        _grad_of(R, s, st.trainables, j, oib)
    return None


def _recorded(q: Quantities, parts: Any, recompute: str, fsdp: bool) -> bool:
    """Whether a layer's backward is replayed as its derivation recorded it (``_recorded_backward``): a
    derived layer whose coefficients hold its backward (``_Parts.bwd``), without recomputation (the record
    is of a layer that saved its tensors), outside FSDP (whose gradient hooks the replay places around one
    block) and DeepSpeed ZeRO-3's recorded fetches."""
    return recompute == "none" and getattr(parts, "bwd", None) is not None and not fsdp and not q.ds_events


def _recorded_backward(R: _Replay, s: _Step, q: Quantities, layer: tuple, where: tuple[str, ...], oib: bool) -> set:
    """A derived layer's backward as the trace ran it (``_BackwardRecord``, ``trace.derive.
    _layer_backward_sequence``: every allocation and free of its window, in order): each backward tensor
    made ("t") and freed ("fK"), the gradients the layer above left freed ("iK", ``R.bcarry``; at the top,
    where none is left, they are made first: the final norm's backward made them), its saved tensors
    ("sK"), the layer below's ("pK": ``below``, its input kept here) and its autocast weight copies ("wK",
    where the replay made them linear by linear) freed where autograd released them, and each parameter
    gradient ("g") made where ``AccumulateGrad`` ran, as the trainable of its size (``_grad_of``; the
    layer's others follow in ``_layer_backward``). Its tensors alive at the end go to ``R.bcarry``, for
    the layer below. ``layer``: (the record, the layer's kept handles, the layer below's or None). Returns
    the trainable indices whose gradient was made."""
    rec, kept, below = layer
    st = q.detail.states
    ins = R.bcarry or R.allocs(rec.ins)
    R.bcarry = []
    live: dict[int, Any] = {}                                     # this layer's tensor index -> handle
    made: set = set()
    pending = list(_placed(st.trainables, where))
    grads = iter(rec.grads)
    handles = (live, ins, kept, below or [], getattr(kept, "casts", []))
    for e in rec.events:
        if e == "t":
            k = len(live)                                         # (a freed one stays, as ``_GONE``)
            live[k] = R.alloc(rec.temps[k]) if k < len(rec.temps) else None
        elif e == "g":
            want = block_bytes(next(grads, 0), q.expandable)      # the .grad, its dtype
            j = next((j for j in pending if st.trainables[j][2] == want), None)
            if j is not None:
                pending.remove(j)
                made.add(j)
                _grad_of(R, s, st.trainables, j, oib)
        else:
            _recorded_free(R, e, handles)
    R.bcarry = [h for h in (live.pop(k, None) for k in rec.out) if h is not _GONE]
    R.frees([h for h in live.values() if h is not _GONE] + ins)
    return made


#: a recorded backward tensor already freed (``_recorded_backward``: kept in ``live`` so indices stay dense)
_GONE = object()


def _recorded_free(R: _Replay, e: str, handles: tuple) -> None:
    """One free event of a recorded backward (``_recorded_backward``): "fK" the layer's K-th tensor, "iK"
    the K-th the layer above left, "sK" / "pK" the K-th saved tensor of the layer / the layer below, "wK"
    the K-th weight copy (each taken out of its list so it is freed once)."""
    live, ins, kept, below, casts = handles
    k = int(e[1:])
    if e[0] == "f":
        h = live.get(k)
        live[k] = _GONE
        R.free(None if h is _GONE else h)
        return
    where = {"i": ins, "s": kept, "p": below, "w": casts}.get(e[0])
    if where is not None and k < len(where):
        R.free(where[k])
        where[k] = None


def _transient(q: Quantities, n: int, nsq: int) -> int:
    """Bytes of a layer's worst backward moment above its saved tensors, less the gradients of its
    later linears (made by then, replayed as gradients): one block."""
    _idx, value, grads = best_transient(_backward_ops(q), n, nsq)
    return max(0, value - grads)


def _leaf_held(q: Quantities, n: int, nsq: int) -> list[int]:
    """The down projection's weight gradient of a ZeRO-3 leaf MoE block, alive at gate/up's backward
    (``quantities.zero3_gather.deepspeed_leaf_held``), as its own block where that is the layer's worst moment: down's
    ``_grouped_mm`` backward made it before gate/up's gradient (DeepSpeed v0.19.8 ``stage3.py`` L1533:
    a leaf's gradients are reduced at the block's backward hook)."""
    i, nbytes = q.ds_leaf_held
    if not nbytes or best_transient(_backward_ops(q), n, nsq)[0] != i:
        return []
    return [nbytes]


def _backward_ops(q: Quantities) -> tuple:
    """The layer's backward-op transients, less the moments of its recomputed forward
    (``quantities.layer_moments.recompute_transients``, last in ``q.transients``): those are the forward's own
    tensors, one block each (``_recompute_blocks``), not one block."""
    return q.transients[:len(q.transients) - q.detail.recompute_ops]


def _recompute_blocks(q: Quantities, n: int, nsq: int) -> list[int]:
    """The blocks of the unsaved tensors a layer's recomputed forward holds at its largest moment
    (``LayerCoefs.recompute_moments``: the linear's input, peft's cast copy, the base output...),
    each its own tensor; none without those moments (``quantities.layer_moments.recompute_transients``)."""
    if not q.detail.recompute_ops:
        return []
    i, _v, _g = best_transient(q.transients[-q.detail.recompute_ops:], n, nsq)
    blocks = q.detail.layer.recompute_moments[i][3]
    return [int(a * n + b * nsq) for a, b in blocks if int(a * n + b * nsq) > 0]


def _activation_transient(q: Quantities, n: int, nsq: int) -> int:
    """``_transient`` without its constant bytes, where the replay makes each linear's weight
    gradients and frees its weight copy itself (``_linears_backward``): the constant of an op's
    transient is its own weight's gradients less the copies of the linears after it
    (``quantities.layer_moments._layer_transients``); what is left, per token and per token x key, is the
    gradients of the activations in flight, one block."""
    return max([0] + [int(a * n + b * nsq) for a, b, *_rest in _backward_ops(q)])


def _fsdp1_early_views(q: Quantities, st: Any, n: int, nsq: int) -> list[int]:
    """The indices in ``st.layer_tensors`` of the view gradients an FSDP1 layer's backward has made by
    its worst moment (``best_transient``: the gradients of the linears after that op, which
    ``_transient`` leaves out), last linear first: each ``mm``'s weight gradient (the view's shape,
    its dtype: ``LayerCoefs.linears`` ``(position, weight elements, gradient bytes per element)``)
    waits in ``SplitWithSizesBackward0``'s input buffer until the last view's arrives (autograd
    ``engine.cpp`` ``InputBuffer``). Matched by size; stops at the first linear without a view of its
    size (a flat parameter of another dtype), so that no view is counted twice. Empty unless every
    parameter of the layer trains (``_fsdp1_whole``)."""
    if not _fsdp1_whole(q, st):
        return []
    _i, _v, left = best_transient(_backward_ops(q), n, nsq)        # bytes of the later linears' gradients
    pending = list(range(len(st.layer_tensors)))
    early: list[int] = []
    for _pos, w, gbytes in reversed(q.detail.layer.linears):
        nbytes = round(w) * gbytes                                # one weight's gradient, its dtype
        j = next((j for j in reversed(pending) if st.layer_tensors[j] == nbytes), None)
        if not gbytes or nbytes > left or j is None:
            break
        pending.remove(j)
        early.append(j)
        left -= nbytes
    return early
