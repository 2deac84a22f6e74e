"""The head side's backward in the replay: the loss's gradients, the logits' gradient, the head's
weight gradient (whole or per loss chunk)."""
from __future__ import annotations

import copy
from typing import Any

from ..layers import F32, HALF
from ..moments import StepFlags, Tokens
from ..quantities import HEAD_SAVED, Quantities
from .fsdp import _fsdp, _root_resharded, _unsharded_head, root_raw
from .loss_forward import _logit_allocs, _logit_tensors
from .optimizer import _accumulated, _make_grads, _tied_request
from .parts import _Forward
from .replay import _Replay, _Step


def _softcap_backward(R: _Replay, q: Quantities, f: _Forward, dlogits: list) -> list:
    """The soft-cap's backward on the whole logits' gradient (``_softcapped_logits``, one chunk), node by
    node (each node's input gradient goes as it returns: ``torch/csrc/autograd/engine.cpp``
    ``call_function`` moves the inputs in): ``MulBackward0`` (``grad * cap``), ``TanhBackward0``
    (``tanh_backward(grad, result)``, then its saved output released), ``DivBackward0`` (``grad / cap``),
    three logits-sized tensors in the head's dtype; the last is what the head's backward reads. Found
    by trace: Gemma-2 (2 layers) b4 s512 fp32 LoRA: ``mul``, ``tanh_backward``, ``div`` after
    ``_log_softmax_backward_data``. A chunked loss's tanh outputs go with the head's (``f.head``)."""
    if f.chunks != 1 or not f.capped:
        f.head += f.capped
        f.capped = []
        return dlogits
    size = f.full * q.softcap_saved                               # (b, s, vocab) in the head's dtype
    product = R.alloc(size)                                       # MulBackward0: grad * cap
    R.frees(dlogits)
    grad = R.alloc(size)                                          # TanhBackward0: tanh_backward(grad, result)
    R.free(product)
    R.frees(f.capped)
    f.capped = []
    quotient = R.alloc(size)                                      # DivBackward0: grad / cap
    R.free(grad)
    return [quotient]


def _fp32_logits_backward(R: _Replay, q: Quantities, f: _Forward) -> list:
    """Its backward (torch ``FunctionsManual.cpp``, ``tools/autograd/derivatives.yaml``): ``nll_loss_backward``'s
    zero-filled fp32 gradient and ``_log_softmax_backward_data``'s, then the first and the saved
    log-probabilities freed (the node's input and saved variables); ``SliceBackward0``'s
    ``slice_backward`` makes a zero-filled fp32 gradient of the whole logits and copies the shifted one
    in (``CloneBackward0``, ``ViewBackward0`` make none), which is then freed; ``ToCopyBackward0`` casts
    it to the head's dtype (returned, the logits' gradient the head reads) and the fp32 one is freed."""
    nll = R.alloc(f.shifted * F32)                                  # (b*(s-1), vocab) fp32
    lsm = R.alloc(f.shifted * F32)                                # (b*(s-1), vocab) fp32
    R.free(nll)
    R.frees(f.saved)
    f.saved = []
    whole = R.alloc(f.full * F32)                                 # (b, s, vocab) fp32, zeros
    R.free(lsm)
    dlogits = R.alloc(f.full * q.logits_out)                      # (b, s, vocab) in the head's dtype
    R.free(whole)
    return [dlogits]


def _chunked_nll_backward(R: _Replay, q: Quantities, tk: Tokens) -> list:
    """TRL's chunked_nll backward: the gathered hidden states' gradient, then a chunk's recompute (the
    head-weight copy its matmul saves and the logits-chunk tensors)."""
    grad = int(q.loss_backward_tok * int(tk.tokens))
    rest = int(tk.loss_backward) - grad - q.loss_backward_const      # the chunk's tensors, one block
    return R.allocs([grad, q.loss_backward_const]) + [R.alloc(rest, one=False)]


def _cast_chunks_backward(R: _Replay, q: Quantities, f: _Forward) -> list:
    """The backward of a chunked loss on Fabric's fp32 copies of the head's chunks (``--cast-output``,
    ``quantities.loss_kinds._cast_output_loss_bytes``), chunk by chunk as autograd runs them, the last first:
    ``nll_loss_backward``'s and ``_log_softmax_backward_data``'s fp32 gradients, the first freed with
    the chunk's saved log-probabilities, the second kept until the copy's own backward, which runs
    after every chunk's loss and casts it to the head's dtype (the gradients returned)."""
    part = -(-f.full // f.chunks)                                 # logit elements of one chunk
    pending = []
    saved = list(f.saved)
    for _c in range(f.chunks):
        g1, g2 = R.alloc(part * 4), R.alloc(part * 4)             # fp32, one chunk
        R.free(g1)
        if saved:
            R.free(saved.pop())
        pending.append(g2)
    R.frees(saved)
    out = []
    for g in pending:                                             # ToCopyBackward: to the head's dtype
        out.append(R.alloc(part * q.logits_out))
        R.free(g)
    return out


def _logps_backward(R: _Replay, f: _Forward, n: int, nsq: int) -> Any:
    """``--loss logps``'s backward (``quantities.loss_kinds._logps_bytes``) tensor by tensor, as autograd runs it: each
    sequence's ``LogsumexpBackward`` (``grad * (self - result).exp()``: three (s - 1, vocab) fp32
    tensors, the first two freed as the expression ends, the third waiting in ``UnbindBackward``'s input
    buffer), ``UnbindBackward``'s stack of them, ``GatherBackward``'s zero-filled tensor and out-of-place
    ``scatter_add`` (the saved fp32 logits freed with the node), the sum accumulated into the stacked
    gradient (autograd's ``InputBuffer`` adds in place into a buffer it alone holds), then
    ``SliceBackward``'s zero-filled (b, s, vocab) fp32 gradient. Returns that gradient's handle."""
    s = nsq // n                                                  # tokens per sequence
    b, vocab = n // s, f.full // n
    row = (s - 1) * vocab * 4                                     # one shifted sequence's logits, fp32
    rows = []
    for _ in range(b):
        temps = R.allocs([row, row])
        rows.append(R.alloc(row))
        R.frees(temps)
    stacked = R.alloc(b * row)
    R.frees(rows)
    zeros, scattered = R.alloc(b * row), R.alloc(b * row)
    R.frees([zeros] + f.saved)
    R.free(scattered)                                             # added into ``stacked`` in place
    full = R.alloc(f.full * 4)                                    # SliceBackward: (b, s, vocab) fp32
    R.free(stacked)
    return full


def _loss_gradient(R: _Replay, q: Quantities, tk: Tokens, f: _Forward, n: int, nsq: int, head: bool) -> list:
    """The loss's backward (``head``; a pipeline stage without the head has none) and the root's
    pre-backward hook, in the order they run. FSDP2 with its root resharded after forward gathers it
    again at the logits' gradient when the loop computes the loss (``q.fsdp_root_regather``). FSDP1's
    root pre-backward hook (torch 2.13 ``fsdp/_runtime_utils.py``: ``_register_pre_backward_hooks``
    puts it on every tensor the root's forward returns; ``_pre_backward_hook`` L630-697 runs once per
    handle and, ``BackwardPrefetch.BACKWARD_PRE``, ``_prefetch_handle`` L1208-1235 unshards the top
    layer; the same hook in the 2.x releases) fires at the first
    of those gradients: with the model's own loss among the outputs (transformers' ``labels=``) that
    is the loss's, before ``nll_loss_backward``, so the top layer's flat parameter is gathered through
    the loss's backward (``q.fsdp_loss_buf``, ``quantities.fsdp_root.fsdp1_prefetch_after_loss``, as the
    moments count it); with the loop's ``cross_entropy`` on the returned logits, at the logits'
    gradient, after it. FSDP2's root (one unit with the head, its forward's outputs hooked the same
    way: torch 2.13 ``_fully_shard/_fsdp_state.py`` ``_register_pre_backward_hook``, ``_pre_backward``
    L381-392) runs ``FSDPParamGroup.pre_backward`` (``_fsdp_param_group.py`` L576-585), whose
    ``_backward_prefetch`` issues the top layer's all-gather: its flat output is alive through the
    loss's backward and copied out at the layer's own pre-backward (``_Fsdp.unshard_backward``). Not
    under torchtitan's split root (``q.fsdp_head_pref``: the head unit's hook, at the logits'
    gradient). Found by trace: Llama-2-7B FSDP1 full shard dp 2, LoRA r64, b10 s2048, transformers
    4.37.2's loss, the top layer's 0.38 GiB flat parameter live at ``LogSoftmaxBackward0`` in trace,
    not in the replay; FSDP2 on a 2-layer Llama the same (docs/validation.md, nineteenth session)."""
    st = q.detail.states
    early = q.fsdp_loss_buf > 0 and not q.fsdp_head_pref          # the model's own loss, one root unit
    if early and f.fs.v2 and f.fs.prefetched is None:             # FSDP2: the top layer's all-gather output
        f.fs.prefetched = f.fs.gather_output(R, q.fsdp_layer_buf)
    elif early:
        f.fs.root_pre_backward(R, q.fsdp_layer_buf, q.fsdp1_layer_raw)   # FSDP1: the top layer prefetched first
    dlogits = _loss_backward(R, q, tk, f, n, nsq) if head else []
    if _root_resharded(q, f.fs) and q.fsdp_root_regather:         # ... the logits (a loss outside the model)
        f.root = f.fs.unshard(R, q.fsdp_root, st.root_tensors, backward=True, raw=root_raw(q, f.fs)[0])
    if not early:
        f.fs.root_pre_backward(R, q.fsdp_layer_buf, q.fsdp1_layer_raw)   # FSDP1: the top layer prefetched
    return dlogits


def _loss_backward(R: _Replay, q: Quantities, tk: Tokens, f: _Forward, n: int, nsq: int) -> list:
    """The loss's backward down to the logits' gradient in the head's dtype (the blocks it returns)."""
    if q.logits_cast and f.chunks > 1:
        return _cast_chunks_backward(R, q, f)
    if q.loss_logps:
        full = _logps_backward(R, f, n, nsq)
        # ToCopyBackward: the fp32 logits' gradient cast to the head's dtype (fp32 logits: it is that gradient)
        if not q.logits_cast:
            return [full]
        dlogits = _logit_allocs(R, _logit_tensors(tk.logits_grad, q.logits_out, f.full))
        R.free(full)
        return dlogits
    if q.loss_fp32_logits or q.loss_tt_shift:
        return _fp32_logits_backward(R, q, f)
    sizes = [] if q.loss_chunk_tokens else _logit_tensors(tk.loss_backward, q.loss_backward, f.full, f.chunks,
                                                          q.loss_elem)
    per_chunk = _chunk_ce_parts(q, f, sizes)
    if per_chunk:                                                 # a chunked cross-entropy: chunk by chunk
        return _chunk_ce_backward(R, f, per_chunk)
    lb = _chunked_nll_backward(R, q, tk) if q.loss_chunk_tokens else _logit_allocs(R, sizes)  # its backward
    if _half_logps(q, f):                                         # log_softmax on half logits under autocast
        return _half_logps_backward(R, q, f, lb)
    R.frees(f.saved)
    if _copied_from_last(q, f, lb, sizes):                        # the loss's earlier backward tensors are
        R.frees(lb[:-1])                                          # gone before ToCopyBackward0 runs
        lb = lb[-1:]
    dlogits = _logits_gradient(R, q, tk, f, lb, sizes)            # in the head's dtype
    R.frees(lb)
    return dlogits


def _chunk_ce_parts(q: Quantities, f: _Forward, sizes: list) -> tuple:
    """Where the loss is a cross-entropy over half logits in ``f.chunks`` chunks, each upcast to fp32
    and its fp32 log-probabilities saved (``f.saved``: one tensor per chunk; torchtune's
    ``CEWithChunkedOutputLoss``, litgpt's ``chunked_cross_entropy``: ``F.cross_entropy(chunk.float(),
    ...)`` per chunk), and the loss's backward tensors are one chunk's two fp32 gradients (``sizes``: one
    block of them, ``quantities.loss_kinds``): (one chunk's fp32 bytes, its half bytes) for
    ``_chunk_ce_backward``; () elsewhere."""
    part = -(-f.full // max(1, f.chunks))                         # logit elements of one chunk
    if (f.chunks < 2 or q.loss_chunk_tokens or q.logits_cast or q.loss_saves_out or q.loss_elem != F32
            or q.loss_backward != 0 or q.logits_out != HALF or q.loss_saved != F32 or len(f.saved) != f.chunks
            or len(sizes) != 1 or getattr(sizes, "whole", 1) != 0 or sizes[0] != 2 * part * F32):
        return ()
    return part * F32, part * HALF


def _chunk_ce_backward(R: _Replay, f: _Forward, per_chunk: tuple) -> list:
    """A chunked cross-entropy's backward chunk by chunk, the last chunk's first (as trace's op stream
    runs them): ``NllLossBackward0``'s fp32 gradient, then
    ``LogSoftmaxBackward0``'s (``_log_softmax_backward_data``), the first freed and the chunk's saved
    log-probabilities released with that node (torch 2.13 ``engine.cpp`` ``evaluate_function``:
    ``fn.release_variables()``), then ``ToCopyBackward0``'s copy in the logits' half dtype (the chunk's
    gradient, which the head's backward reads), the fp32 one freed. Before, one block of a chunk's two
    fp32 gradients and all the saved log-probabilities freed at once: trace of Llama-3.2 (2 layers)
    b1 s1024 eager pure bf16, 4 chunks, has no such 250.5 MiB block, and the replay's opened a segment
    of its own (peak reserved -7.02 -> -0.15 % of trace's; tests/test_chunked_loss_replay.py). Returns
    the chunks' half gradients in the order made (``_chunk_head_backward`` reads them so)."""
    fp32, half = per_chunk
    out = []
    for i in reversed(range(f.chunks)):
        nll = R.alloc(fp32)                                       # (chunk tokens, vocab) fp32
        lsm = R.alloc(fp32)                                       # (chunk tokens, vocab) fp32
        R.free(nll)
        R.free(f.saved[i])                                        # its fp32 log-probabilities
        out.append(R.alloc(half))                                 # (chunk tokens, vocab) half
        R.free(lsm)
    f.saved = []
    return out


def _half_logps(q: Quantities, f: _Forward) -> bool:
    """Whether the loss is ``F.cross_entropy`` on whole half logits under autocast (``--loss half``,
    ``quantities.loss_kinds._eager_loss_bytes``: ``LossBytes(held, half, half + F32, 0, F32)``): ``log_softmax``
    (no autocast rule) saved its half output, ``nll_loss`` (autocast's fp32 list) an fp32 copy of it
    (``f.saved``: half first, ``_logit_tensors(half_first=True)``), and backward starts with
    ``nll_loss_backward``'s one fp32 gradient."""
    return (f.chunks == 1 and not q.loss_chunk_tokens and not q.logits_cast and not q.loss_saves_out
            and q.loss_forward == 0 and q.loss_elem == F32 and q.logits_out == HALF
            and q.loss_saved == HALF + F32 and q.loss_backward == F32 and len(f.saved) >= 2)


def _half_logps_backward(R: _Replay, q: Quantities, f: _Forward, lb: list) -> list:
    """The backward of ``_half_logps``' loss, node by node, down to the logits' gradient (returned).
    Autograd runs ``NllLossBackward0`` (its output: ``lb``, (b*s, vocab) fp32), which releases its saved
    fp32 copy (``torch/csrc/autograd/engine.cpp`` ``evaluate_function``: ``fn.release_variables()``,
    as ``_copied_from_last`` reads it); then ``ToCopyBackward0`` casts that gradient to the logits' half
    dtype (a new (b*s, vocab) half tensor; the fp32 gradient, its only input, goes when it returns);
    then ``LogSoftmaxBackward0`` runs ``_log_softmax_backward_data(grad, output)`` on the half copy
    and the saved half log-probabilities (torch 2.13 ``tools/autograd/derivatives.yaml``
    ``_log_softmax``: ``self: _log_softmax_backward_data(grad, result, dim, self.scalar_type())``),
    making the logits' gradient, a third (b*s, vocab) half tensor, before both of its inputs go. So
    two half logits-sized tensors and the gradient are alive together, where one tensor (the
    gradient, ``_logits_gradient``) was replayed, with the log-probabilities freed first. Found by
    trace: GPT-2 b8 s256 ``--loss half``, bf16 autocast, the op stream ``nll_loss_backward``,
    ``_to_copy``, ``_log_softmax_backward_data``, then two frees (docs/validation.md, `resop`)."""
    logps, rest = f.saved[0], f.saved[1:]
    f.saved = []
    R.frees(rest)                                                 # nll_loss's fp32 copy (and per-token terms)
    copy = R.alloc(f.full * q.logits_out)                         # ToCopyBackward0: (b*s, vocab) half
    R.frees(lb)                                                   # nll_loss_backward's fp32 gradient
    dlogits = [R.alloc(f.full * q.logits_out)]                    # _log_softmax_backward_data: (b*s, vocab) half
    R.free(copy)
    R.free(logps)                                                 # log_softmax's saved half output
    return dlogits


def _copied_from_last(q: Quantities, f: _Forward, lb: list, sizes: list[int]) -> bool:
    """Whether the logits' gradient is ``ToCopyBackward0``'s copy of the last of the loss's backward
    tensors ``lb`` alone (each a whole tensor, one chunk): then the others, ``nll_loss_backward``'s
    output, are freed before the copy is made. Autograd's engine moves a node's inputs into its
    ``apply`` (``torch/csrc/autograd/engine.cpp`` ``call_function``: ``outputs = fn(std::move(inputs))``,
    then ``evaluate_function`` calls ``fn.release_variables()`` unless the graph is kept; read at
    pytorch/pytorch e1253a9, the same structure in 2.x, line numbers at 2.13 not checked), so
    ``NllLossBackward0``'s output, ``LogSoftmaxBackward0``'s input, goes when that node returns, with
    the forward's saved log-probabilities, before ``ToCopyBackward0`` runs on
    ``_log_softmax_backward_data``'s output. Found on the tied ZeRO-3 toy of tests/test_zero_init.py
    (trace's allocator log: free, free, then the copy; docs/validation.md `z3seg`)."""
    size = f.full * q.logits_out
    popped = q.loss_forward == 0 and f.chunks == 1 and not q.logits_cast and size in sizes
    return not popped and f.chunks == 1 and len(lb) > 1 and getattr(sizes, "whole", len(sizes)) == len(sizes)


def _logits_gradient(R: _Replay, q: Quantities, tk: Tokens, f: _Forward, lb: list, sizes: list[int]) -> list:
    """The logits' gradient that the head's backward reads. After the loss's fp32 upcast it is
    ``ToCopyBackward0``'s copy in the head's dtype, a new tensor. Where the loss made no copy
    (``q.loss_forward`` 0: fp32 logits, whose ``logits.float()`` returns the tensor itself) the
    loss's last backward tensor, ``_log_softmax_backward_data``'s, is that gradient: it is taken out
    of ``lb`` (the loss's backward tensors of ``sizes`` bytes, freed by the caller) and kept."""
    size = f.full * q.logits_out                                  # one logits-sized tensor, head's dtype
    if q.loss_forward == 0 and f.chunks == 1 and not q.logits_cast and size in sizes:
        k = len(sizes) - 1 - sizes[::-1].index(size)
        return [lb.pop(k)]
    return _logit_allocs(R, _logit_tensors(tk.logits_grad, q.logits_out, f.full, f.chunks))


def _head_backward(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, f: _Forward, dlogits: list,
                   n: int = 0) -> tuple:
    """The head's matmuls' backward: the weight's gradient (under autocast first in the compute dtype,
    ``quantities.head_moments.head_weight_grad_half``, then cast to fp32 once the logits' gradient, the head's
    input and its half copy are freed), the cuBLAS workspace of autograd's thread at its first
    matmul: after the weight's gradient (or its half copy) under torch's own bias-free linear
    (``MmBackward0``), before it under a head with a bias (``AddmmBackward0``: the input's gradient
    first, ``quantities.head_moments.head_input_grad_first``; BERT's masked-LM decoder) and under DeepSpeed
    ZeRO-3's ``zero3_linear_wrap``, whose backward runs the input's gradient matmul first
    (``quantities.zero3_gather.deepspeed_linear_wrap``; v0.19.8 ``zero/linear.py`` L125-134). The gradient is a
    tied head's part, waiting in the embedding's input buffer (``q.tied_grad``), FSDP's unsharded
    head gradients, or, outside FSDP, the ``.grad`` of an untied head, made here with the final
    norm's (autograd's order: the head is back-propagated first). A masked LM's transform
    (``q.head_chain``) is back-propagated node by node after the decoder (``_head_chain``), its input
    gradient made before the workspace, its other gradients at its dense's node. Returns (FSDP's
    unsharded head gradients, the tied part). ``n``: the micro-batch's tokens on this rank (``Tokens.tokens``)."""
    st = q.detail.states
    chain = q.head_chain if not (q.chunk_head_grads or q.ds_events) else ()   # a masked LM's nodes (_head_chain)
    gin = R.alloc(int(chain[0][0] * n)) if chain else None  # the decoder's input gradient, (b, s, h)
    if q.ds_linear_wrap or q.head_input_first:                    # grad_output.matmul(weight) first: the
        s.workspace(R, 1)                                         # workspace before the weight's gradient
    half = R.alloc(q.head_wgrad_half)                             # (vocab, hidden) in the compute dtype
    # DeepSpeed ZeRO-3: the untied head's whole weight gradient, (vocab, hidden) in the engine's dtype, as
    # its ``MmBackward0`` makes it, until the head's backward ends (``quantities.zero_partition.deepspeed_head_wgrad``)
    wgrad = R.alloc(q.ds_head_wgrad) if q.ds_events else None

    where = ("after", "before") if q.pipe_head_tied else ("after",)  # (a pipeline's last stage: its tied copy)
    added: list = []                                              # gradients made to be added to a ``.grad``

    def own() -> None:                                            # an untied head's, the final norm's
        if not _fsdp(q):
            added.extend(_accumulated(R, s, st.trainables, where))
            _make_grads(R, s, st.trainables, where, flags.oib)

    def gradients() -> tuple:
        head_full = _unsharded_head(R, f.fs, st)                  # FSDP: the head's unsharded gradients
        tied = _tied_request(R, q)                                # a tied head's, until the embedding's
        if not chain:                                             # (a masked LM's: at its dense's node)
            own()
        return head_full, tied

    if q.chunk_head_grads:                                        # a chunked loss: the head's backward per chunk
        made = _chunk_head_backward(R, s, q, f, dlogits, gradients)
        R.frees(added)
        return made
    made = gradients() if half is None else None                  # the matmul's output is the gradient
    s.workspace(R, 1)                                             # after the head's first backward matmul
    #                                                               (already made under ``ds_linear_wrap``, a bias)
    norm = _norm_saved(q, f, n)                                   # the final norm's saved tensors, and the
    dx = R.alloc(R.a.requested_size(f.head[len(norm)])) if norm else None  # head input's gradient (its dtype)
    if chain:                                                     # the decoder's node has run: its incoming
        R.frees(dlogits)                                          # gradient dropped, then the transform's nodes
        dlogits = []
        _head_chain(R, chain, (f, n), gin, own)
    R.frees(dlogits + [h for h in f.head if h not in norm])
    R.free(wgrad)
    if half is not None:
        made = gradients()                                        # ToCopyBackward0: the fp32 cast
        R.free(half)
    R.frees(added)                                                # added in place into ``.grad``, released
    if norm:
        _final_norm_backward(R, q, dx, norm, n)
    return made


def _head_chain(R: _Replay, chain: tuple, ft: tuple, gin: int | None, own: Any) -> None:
    """A masked LM's head backward after its decoder's matmuls, node by node (``Quantities.head_chain``,
    ``quantities.outer.mlm_head_grad_chain``): each node's saved tensors released once it has run (their
    places among ``f.head``, the head side's saved tensors in forward order; each set to None there),
    then the next node makes its input gradient ((b, s, h)) and the one it read is dropped; the dense's
    node makes its weight's gradient after its input's (``AddmmBackward0``: ``mat1`` before ``mat2``),
    with the transform's others (``own``). The last input gradient, the top layer's output gradient,
    is freed as the layer's backward begins: its first moment makes that tensor itself
    (``layer_backward._op_backward``). ``gin``: the decoder's input gradient, made before autograd's
    workspace (``head_input_grad_first``). ``ft``: (the forward's ``_Forward``, the micro-batch's tokens)."""
    f, tokens = ft
    for k, (nbytes, released) in enumerate(chain):
        if k:
            made = R.alloc(int(nbytes * tokens))                # this node's input gradient
            if k == len(chain) - 1:
                own()                                             # the dense's weight gradient, after
            R.free(gin)                                           # the node's incoming gradient dropped
            gin = made
        for i in released:                                        # Node::release_variables
            if i < len(f.head):
                R.free(f.head[i])
                f.head[i] = None
    R.free(gin)


def _norm_saved(q: Quantities, f: _Forward, n: int) -> list:
    """The handles of the final norm's saved tensors among the head side's (``f.head``, whose first
    ones are ``_head_side``'s saved tensors in forward order: the norm's, then the head's input, the
    last of them, ``quantities.outer.causal_lm_head_tensors``), where the layers below hold the residual
    stream's gradient as one block (``LayerCoefs.resid_grad``: GPT-2), which the final norm's backward
    makes (``_final_norm_backward``); [] elsewhere (the norm's tensors freed with the head's, as before)."""
    k = sum(1 for _x, held in q.head_side if held == HEAD_SAVED)
    lc = q.detail.layer
    if not (n and lc.resid_grad and k >= 2 and len(f.head) >= k + 1) or q.chunk_head_grads or q.ds_events:
        return []
    return list(f.head[:k - 1])


def _final_norm_backward(R: _Replay, q: Quantities, dx: int | None, norm: list, n: int) -> None:
    """The head input's gradient ``dx`` (``mm``'s ``grad.mm(mat2.t())``, made after the weight's gradient
    and autograd's workspace, in the matmul's dtype: derivatives.yaml ``mm``) back to the final norm:
    under autocast ``ToCopyBackward0`` casts it to the stream's dtype (fp32), a new tensor, ``dx`` freed;
    then the norm's backward (``NativeLayerNormBackward0``: ``native_layer_norm_backward``, torch 2.13
    ``aten/src/ATen/native/layer_norm.cpp``) makes its input's gradient, (b, s, h) in the stream's dtype,
    the residual stream's gradient that the top layer's backward holds (``R.layer.resid_grad``, taken by
    ``layer_backward._op_backward``), and only then releases its saved input, mean and rstd (``norm``:
    ``Node::release_variables`` after it ran, torch 2.13 ``csrc/autograd/engine.cpp``). Trace, GPT-2
    (2 layers) b1 s1024 bf16-amp: the 1.5 MiB bf16 ``mm`` output, the 147 MiB fp32 tied weight
    gradient, the 3 MiB fp32 copy, the norm's 3 MiB output, then the 3 MiB saved input freed; the
    replay freed the saved input with the head's, before the weight's cast, and made the residual
    gradient where the top layer's backward starts, in the hole the saved input left."""
    resid = int(q.detail.layer.resid_grad * n)                    # (b, s, h), the stream's dtype
    if dx is not None and R.a.requested_size(dx) != resid:        # ToCopyBackward0: autocast's cast back
        cast = R.alloc(resid)
        R.free(dx)
        dx = cast
    R.layer.resid_grad = R.alloc(resid)                           # the norm's input gradient
    R.free(dx)
    R.frees(norm)


def _chunk_head_backward(R: _Replay, s: _Step, q: Quantities, f: _Forward, dlogits: list, gradients: Any) -> tuple:
    """The head's backward under a chunked loss (``--loss-chunks``: torchtune's chunked output, litgpt's
    chunked half loss), one matmul backward per chunk, each making a weight gradient of the whole head
    ((vocab, hidden) in the matmul's dtype: the half copy's under autocast; ``quantities.head_grads.chunk_head_grads``,
    bytes of three of them). Autograd's engine runs every chunk's loss backward first, then the head's
    backward consumes the chunks' logits gradients one by one (each chunk's tensors are every
    ``f.chunks``-th of ``dlogits``, as ``_logit_tensors`` orders them; freed when its node has run):

    * chunk 1: its weight gradient, the cuBLAS workspace of autograd's thread (its first matmul);
    * chunk 2: its weight gradient, then ``InputBuffer::accumulate`` adds the two **out of place**
      (the first is ``TBackward0``'s view, ``can_accumulate_inplace`` refuses: torch 2.13
      ``torch/csrc/autograd/input_buffer.cpp``), so both chunk gradients and their sum exist, then the
      two are freed; without autocast the sum is what ``AccumulateGrad`` steals as ``.grad`` (or a
      tied head's part waiting in the embedding's input buffer): ``gradients``;
    * every later chunk: its weight gradient, added into the sum in place, freed;
    * then the head's input and half copy go, and under autocast ``ToCopyBackward0`` casts the sum to
      the fp32 gradient (``gradients``) before the sum is freed.

    Trace's allocator log on Llama (2 layers, h 2048, vocab 32000) 2 x 1024, fp16-amp, 8 chunks shows
    the three 125 MiB half gradients at once and then the 250 MiB fp32 one: before this sequence the
    replay made only the fp32 gradient, and its reserved peak was -14.1% of trace's. (Trace's dispatch
    adds every later chunk out of place as well, ``trace/cuda_kernels.py``; that cycles through the
    same three blocks.) Returns what ``gradients`` returns."""
    one = q.chunk_head_grads // 3                                  # one chunk's weight gradient (bytes)
    k = max(2, int(f.chunks))
    whole = len(dlogits) // k * k                                 # (after them one block of the rest, if any)
    per = [[h for j, h in enumerate(dlogits[:whole]) if j % k == i] for i in range(k)]
    rest = list(dlogits[whole:])
    autocast = bool(q.cast_head)                                  # the matmuls ran on autocast's half copy
    total = made = None
    for i in range(k):
        g = R.alloc(one)                                          # this chunk's weight gradient
        if i == 0:
            s.workspace(R, 1)                                     # autograd's first matmul
        R.frees(per[i])                                           # the chunk's logits gradient consumed
        if i == 0:
            first = g
            continue
        if i == 1:                                                # the out-of-place add
            if autocast:
                total = R.alloc(one)
            else:
                made = gradients()
            R.frees([first, g])
            continue
        R.free(g)                                                 # added in place
    R.frees(rest + f.head)
    if autocast:
        made = gradients()                                        # ToCopyBackward0: the fp32 cast
        R.free(total)
    return made
