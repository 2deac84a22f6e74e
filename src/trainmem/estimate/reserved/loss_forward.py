"""The head side's forward in the replay: the logits and the loss's transient and saved tensors (fp32
logits, torchtune's loop, chunked NLL, Unsloth's and fused losses, DPO's log-probabilities)."""
from __future__ import annotations

import copy

from ..layers import F32, HALF
from ..moments import StepFlags, Tokens, logit_sizes
from ..quantities import HEAD_LOGITS, HEAD_LOSS, HEAD_NEXT, HEAD_NEXT2, HEAD_SAVED, Quantities
from .replay import _Replay


def _logit_tensors(total: int, per_elem: int, elems: int, chunks: int = 1, elem: int = 4,
                   half_first: bool = False) -> list[int]:
    """A logits-sized term as the tensors it is made of: ``per_elem`` bytes per logit element are
    tensors of ``elem`` bytes per element (fp32, or the half dtype of a loss run in it without
    autocast: ``LossBytes.elem``, where ``nll_loss_backward`` and ``_log_softmax_backward_data`` make
    two half tensors, not one fp32-sized block) and at most one half tensor (2 B), each of ``elems``
    elements (the loss keeps whole logits-sized tensors: the fp32 upcast, log-probabilities, their
    gradients), or ``chunks`` tensors each under a chunked loss (torchtune's ``CEWithChunkedOutputLoss``
    and litgpt's ``chunked_cross_entropy`` keep a list of per-chunk logits); what is left of ``total``
    (one chunk's transient tensors, per-token terms) is one more block, several tensors
    (``_Sizes.whole`` counts the whole tensors before it; ``_logit_allocs``). The fp32 tensors come
    first, unless ``half_first``: the loss's saved tensors on half logits under autocast, where
    ``log_softmax`` (no autocast rule) saves its half output before ``nll_loss`` (autocast's fp32
    list, ``aten/src/ATen/autocast_mode.cpp``) casts it to fp32 and saves the copy
    (``quantities.loss_kinds._eager_loss_bytes``; trace's op stream: ``_log_softmax`` then ``_to_copy``)."""
    per_elem, part = int(per_elem), -(-elems // chunks)
    if elem != 4:
        sizes = [part * elem] * (chunks * (per_elem // elem))
        rest = int(total) - elems * (per_elem // elem) * elem
    else:
        fp32, half = [part * 4] * (chunks * (per_elem // 4)), [part * 2] * (chunks * ((per_elem % 4) // 2))
        sizes = half + fp32 if half_first else fp32 + half
        sizes += [part] * (chunks * (per_elem % 2))
        rest = int(total) - elems * per_elem
    return _Sizes(sizes + [rest] if rest > 0 else sizes, len(sizes))


class _Sizes(list):
    """Block sizes of which the first ``whole`` are one tensor each, the rest a sum of several."""

    def __init__(self, sizes: list[int], whole: int) -> None:
        super().__init__(sizes)
        self.whole = whole


def _logit_allocs(R: _Replay, sizes: list[int]) -> list:
    """``_logit_tensors``' blocks: the whole tensors netted of their placement excess, the rest
    (several tensors' sum) not (``_Replay.alloc``)."""
    whole = getattr(sizes, "whole", len(sizes))
    return R.allocs(sizes[:whole]) + R.allocs(sizes[whole:], one=False)


def _head_side(R: _Replay, q: Quantities, tk: Tokens, capped: int = 0, top: int | None = None,
               rebound: list | None = None) -> tuple[list, list, list]:
    """The head side's saved tensors (``tk.outer_head`` bytes) and, apart, those freed once the logits
    are made and those the model's forward holds until its loss returns. One block each where the
    estimate knows them one by one (``quantities.outer.head_side_tensors``: a masked LM's transform and
    decoder input, with autocast's forward-only copies; a causal LM's final norm and head input,
    ``quantities.outer.causal_lm_head_tensors``), what is left of ``tk.outer_head`` beside the saved ones as
    one more; else one block (several tensors). ``capped``: bytes of a soft-capped head's tanh outputs
    among ``tk.outer_head``, made with the logits (``_softcapped_logits``), not here. ``top``: the top
    layer's output, made (on a fed pipeline stage, ``driver._fed_top_output``; under checkpoints that keep
    their inputs, ``driver._layers``): the norm's input (``_fed_norm_input``). ``rebound``: what the top layer's frames hold until it returns its output,
    the final norm's saved input, the first tensor here (``layer_forward._layer_end``): freed once that
    is made (by the caller where the head side is one block)."""
    sizes = [(int(x * tk.tokens), held) for x, held in q.head_side]
    rest = int(tk.outer_head) - capped - sum(x for x, held in sizes if held == HEAD_SAVED)
    if -int(tk.tokens) <= rest < 0:  # a derived head's fitted bytes per token a hair under the exact sum
        rest = 0                      # (8195.99999 x tokens, truncated): within the byte per token it is checked to
    if not sizes or rest < 0:
        side = [R.alloc(int(tk.outer_head) - capped, one=False)]
        R.free(top)
        return side + _pre_cast(R, q), [], []
    lists: dict[int, list] = {HEAD_SAVED: [], HEAD_LOGITS: [], HEAD_LOSS: []}
    temps: list = []                                              # [handle, tensors made before it is freed]
    pre: list = []                                                # the transform dense's weight copy
    for i, (nbytes, held) in enumerate(sizes):
        h, top = _fed_norm_input(R, nbytes, held, top, i)
        pre = _pre_cast(R, q) if i == 0 else pre                  # (after the dense's half input)
        if rebound:                                               # (after the first)
            R.frees(rebound)
            rebound.clear()
        for temp in temps:
            temp[1] -= 1
        R.frees([temp[0] for temp in temps if temp[1] == 0])
        temps = [temp for temp in temps if temp[1] > 0]
        if held in (HEAD_NEXT, HEAD_NEXT2):
            temps.append([h, 1 if held == HEAD_NEXT else 2])
        lists.get(held, []).append(h)
    R.frees([temp[0] for temp in temps])
    R.free(top)                                                   # (a half stream's: once the norm returns)
    return lists[HEAD_SAVED] + [R.alloc(rest, one=False)] + pre, lists[HEAD_LOGITS], lists[HEAD_LOSS]


def _pre_cast(R: _Replay, q: Quantities) -> list:
    """autocast's half copy of a masked LM's transform dense (``q.cast_head_pre``,
    ``quantities.head_moments.head_pre_cast``), made as that linear runs: after its cast input
    (``cached_cast`` casts the linear's arguments in order, the input's first: trace's op stream,
    BERT b8 s256 bf16-amp, the 3 MiB half input before the 1.125 MiB weight copy), saved for its
    backward. Listed after the head side's saved tensors, whose places ``Quantities.head_chain``
    names. [] where there is none."""
    return [R.alloc(q.cast_head_pre)] if q.cast_head_pre else []


def _fed_norm_input(R: _Replay, nbytes: int, held: int, top: int | None, i: int = 0) -> tuple[int | None, int | None]:
    """One of the head side's tensors (``_head_side``), and what is left of ``top``, the top layer's
    output on a fed pipeline stage (``driver._fed_top_output``) or under checkpoints that keep their
    inputs (``driver._layers``); None elsewhere. In an fp32 stream the
    final norm's first saved tensor is its input itself (``to(torch.float32)`` returns it:
    ``quantities.outer.rmsnorm_head_tensors``), so ``top`` is that tensor, not a new block; in a half
    stream it is an fp32 copy and ``top`` lives on until the norm returns (``LlamaModel.forward``'s
    ``hidden_states`` holds it: transformers 5.24 ``models/llama/modeling_llama.py`` L404), freed
    after the side's tensors (``_head_side``). Only the side's first tensor (``i`` 0) is the norm's input:
    in a half stream a later one of the input's size (the normed half cast) is a tensor of its own."""
    if top is not None and i == 0 and held == HEAD_SAVED and R.a.requested_size(top) == nbytes:
        return top, None
    return R.alloc(nbytes), top


def _softcap_bytes(q: Quantities, tk: Tokens, full: int, chunks: int) -> int:
    """Bytes of a soft-capped head's saved tanh outputs (``quantities.head_grads.softcap_saved`` per logit element,
    one logits-sized tensor per chunk), which the head side counts (a derivation measures them there),
    where the replay makes them with the logits (``_softcapped_logits``): 0 without a final logit
    soft-cap, under a loss that makes its own logits (Liger's, TRL's, Unsloth's), where the logits are
    not whole tensors of the head's dtype, or where the head side is smaller."""
    if not q.softcap_saved or q.fused_parts or q.loss_chunk_tokens or q.unsloth_loss or q.liger_factor:
        return 0
    sizes = _logit_tensors(tk.out_logits, q.logits_out, full, chunks)
    nbytes = full * q.softcap_saved
    whole = sizes[:sizes.whole]
    ok = len(whole) == chunks and q.softcap_saved == q.logits_out and int(tk.outer_head) >= nbytes
    return nbytes if ok else 0


def _softcapped_logits(R: _Replay, q: Quantities, tk: Tokens, full: int, chunks: int) -> tuple[list, list]:
    """The logits of a head whose forward soft-caps them, chunk by chunk (one chunk: the whole logits),
    each op out of place (transformers 5.24 ``models/gemma2/modeling_gemma2.py`` L519-523,
    ``Gemma2ForCausalLM.forward``: ``logits = self.lm_head(...)``, ``logits = logits / cap``, ``logits =
    torch.tanh(logits)``, ``logits = logits * cap``): the head's output, its quotient (the output freed as
    the name is rebound), ``tanh``'s output (saved: derivatives.yaml ``tanh``: ``tanh_backward(grad,
    result)``; the quotient freed), the product (the logits). A chunked loss caps each chunk in
    ``workload._softcap``, whose argument, the chunk's head output, lives until the product is made. The
    division and the scalar product save nothing. Returns (the logits, the saved tanh outputs)."""
    sizes = _logit_tensors(tk.out_logits, q.logits_out, full, chunks)
    out: list = []
    saved: list = []
    for part in sizes[:sizes.whole]:
        head = R.alloc(part)                                      # lm_head's output, the head's dtype
        quotient = R.alloc(part)                                  # logits / cap
        if chunks == 1:
            R.free(head)                                          # ``logits`` rebound
        saved.append(R.alloc(part))                               # tanh: saved for its backward
        R.free(quotient)
        out.append(R.alloc(part))                                 # * cap: the logits
        if chunks > 1:
            R.free(head)                                          # ``_softcap`` returns
    return out + R.allocs(sizes[sizes.whole:], one=False), saved


def _loss_forward(R: _Replay, q: Quantities, tk: Tokens, flags: StepFlags, out: list, full: int, chunks: int,
                  seqs: int, held: int = 0) -> tuple[list, list, list]:
    """The loss's forward on the logits ``out``: its transient tensors (``fwd``), what it saves for backward
    (``saved``), and the logits still held apart from those (``out``, emptied where the loss saves them).
    ``held``: bytes of the body's output the model's forward holds through its loss, made already with
    the head side (``_head_side``); ``tk.loss_forward`` counts it (``q.head_loss_tok`` per token)."""
    if q.loss_chunk_tokens:   # TRL's chunked_nll: its tensors one by one (quantities.loss_kinds._chunked_nll_bytes)
        fwd, saved = _chunked_nll_forward(R, q, tk)
    elif q.fused_parts:       # Liger's fused linear cross-entropy: its tensors one by one
        fwd, saved = _fused_forward(R, q, tk, flags)
    elif q.unsloth_loss:      # Unsloth's fused loss: its tensors one by one
        fwd, saved = _unsloth_forward(R, q, tk, flags)
    elif q.loss_fp32_logits:  # an older release's forward: fp32 logits returned, shifted, then the loss
        fwd, saved = [], _fp32_logits_forward(R, q, tk, out, full, seqs)
    elif q.loss_tt_shift:     # torchtune < 0.3's loop: the shifted fp32 copy kept, the loss on its transpose
        fwd, saved = [], _torchtune_loop_loss(R, q, tk, out, full, seqs)
    else:
        made = min(held, int(q.head_loss_tok * tk.tokens))
        fwd = _logit_tensors(tk.loss_forward - made, q.loss_forward, full, chunks)  # fp32 copy, transient
        saved = _logit_tensors(tk.loss_saved, q.loss_saved, full, chunks, q.loss_elem, half_first=True)
        if _chunk_ce(q, fwd, saved, full, chunks):                  # a chunked cross-entropy, chunk by chunk
            return [], _chunk_ce_forward(R, saved, chunks), out
        fwd = _logit_allocs(R, fwd)
        if q.loss_saves_out:   # the loss saves the output itself (its per-token tensors are new)
            saved = out + R.allocs([int(tk.loss_saved) - full * q.loss_saved], one=False)  # per-token
            out = []
        else:
            saved = _logit_allocs(R, _logit_tensors(tk.loss_saved, q.loss_saved, full, chunks, q.loss_elem,
                                                    half_first=True))  # logps (half), then nll_loss's fp32 copy
    return fwd, saved, out


def _chunk_ce(q: Quantities, fwd: list, saved: list, full: int, chunks: int) -> bool:
    """Whether the loss is a cross-entropy over half logits in ``chunks`` chunks, each upcast to fp32 and
    its fp32 log-probabilities saved (torchtune's ``CEWithChunkedOutputLoss``, litgpt's
    ``chunked_cross_entropy``: ``F.cross_entropy(chunk.float(), ...)`` per chunk): the forward's transient
    is one chunk's fp32 copy (``fwd``, one block) and the saved tensors one fp32 tensor per chunk
    (``saved``), as ``loss_backward._chunk_ce_parts`` reads them in backward."""
    part = -(-full // max(1, chunks)) * F32                       # one chunk's logits in fp32
    return (chunks > 1 and not q.loss_saves_out and q.loss_elem == F32 and q.loss_saved == F32
            and q.logits_out == HALF and list(fwd) == [part] and getattr(fwd, "whole", 1) == 0
            and list(saved) == [part] * chunks and getattr(saved, "whole", 0) == chunks)


def _chunk_ce_forward(R: _Replay, saved: list, chunks: int) -> list:
    """``_chunk_ce``'s forward chunk by chunk: the chunk's fp32 copy (``_to_copy``), its log-probabilities
    (``_log_softmax``, saved), the copy freed as the chunk's loss returns, as trace's op stream runs them
    (Llama-3.2 cut to 2 layers, b1 s1024 pure bf16, 4 chunks: each copy takes the block the one before
    freed). Before, one copy was made before every chunk's log-probabilities and freed after the loss.
    Returns the saved log-probabilities, one handle per chunk."""
    out = []
    for x in saved[:chunks]:
        copy = R.alloc(x)                                         # (chunk tokens, vocab) fp32
        out.append(R.alloc(x))                                    # its log-probabilities, fp32
        R.free(copy)
    return out


def _shifted(q: Quantities, full: int, seqs: int) -> int:
    """Logit elements of ``logits[..., :-1, :]``: one row fewer per sequence."""
    return max(0, full - seqs * (q.logit_width // q.tp))


def _fp32_logits_forward(R: _Replay, q: Quantities, tk: Tokens, out: list, full: int, seqs: int) -> list:
    """The causal-LM loss of a release whose model forward upcasts (``quantities.loss.fp32_logits_replay``;
    transformers 4.40.0 ``modeling_qwen2.py`` L1183-1200): ``logits = logits.float()`` rebinds the name,
    so the half output (``out``, 2 B per element) is freed once its fp32 copy exists; ``shift_logits =
    logits[..., :-1, :].contiguous()`` is a second fp32 tensor of one row fewer per sequence, freed when
    forward returns; ``CrossEntropyLoss`` -> ``log_softmax`` saves its fp32 output (what
    ``tk.loss_saved`` holds beyond it, per-token terms, one block more). The fp32 logits take the half
    output's place in ``out`` (the model's output, freed where the loop drops it). Returns the saved."""
    shifted = _shifted(q, full, seqs)
    logits = R.alloc(full * F32)                                  # (b, s, vocab) fp32
    R.frees(out)
    out[:] = [logits]
    shift = R.alloc(shifted * F32)                                # (b, s - 1, vocab) fp32, contiguous
    saved = [R.alloc(shifted * F32), R.alloc(int(tk.loss_saved) - shifted * F32)]  # log-probabilities
    R.free(shift)
    return saved


def _torchtune_loop_loss(R: _Replay, q: Quantities, tk: Tokens, out: list, full: int, seqs: int) -> list:
    """torchtune < 0.3's loss (``spec.frameworks.torchtune_loop_shifts_fp32_logits``), tensor by tensor, from
    the decoder's fp32 output (``out``, ``--cast-output``'s copy: the half output is already freed):
    ``logits[..., :-1, :].contiguous()`` is a (b, s - 1, vocab) fp32 copy, and rebinding ``logits`` to it
    frees the output; ``nn.CrossEntropyLoss`` on its transpose runs ``log_softmax`` over dim 1, whose
    CUDA kernel first makes a contiguous copy of that transposed input (aten/src/ATen/native/cuda/
    SoftMax.cu ``host_softmax``: ``input_.contiguous()``), saves its fp32 output and frees the copy when
    it returns. The shifted copy takes the output's place in ``out`` (held until the next forward
    returns, ``--hold-output step``). Its backward is ``_fp32_logits_backward``'s (``nll_loss2d``'s and
    ``log_softmax``'s fp32 gradients, ``slice_backward``'s zero-filled one of the whole logits,
    ``ToCopyBackward0``'s cast to the head's dtype). Returns the loss's saved tensors."""
    shifted = _shifted(q, full, seqs)
    shift = R.alloc(shifted * F32)                                # (b, s - 1, vocab) fp32, contiguous
    R.frees(out)                                                  # the fp32 output, unreferenced
    out[:] = [shift]
    copy = R.alloc(shifted * F32)                                 # log_softmax's contiguous input
    saved = [R.alloc(shifted * F32), R.alloc(int(tk.loss_saved) - shifted * F32)]  # log-probabilities
    R.free(copy)
    return saved


def _chunked_nll_forward(R: _Replay, q: Quantities, tk: Tokens) -> tuple[list, list]:
    """TRL's chunked_nll forward: the final norm's output (kept until the loss returns), the gathered
    hidden states, labels and indices (saved), then one chunk's transients (its head-weight copy and
    logits-chunk tensors). Returns (transients, saved)."""
    n = int(tk.tokens)
    last = R.alloc(int(q.head_loss_tok * n))
    saved = R.allocs([int(q.loss_saved_tok - 16) * n, 8 * n, 8 * n])
    rest = int(tk.loss_forward) - int(q.head_loss_tok * n) - q.loss_backward_const
    chunk = [R.alloc(q.loss_backward_const), R.alloc(rest, one=False)]  # the copy; the chunk's tensors
    R.frees(chunk)
    return [last], saved


def _unsloth_forward(R: _Replay, q: Quantities, tk: Tokens, flags: StepFlags) -> tuple[list, list]:
    """Unsloth's fused loss forward (``quantities.loss_kinds._unsloth_loss_bytes``) as it allocates: the final norm's
    output (held by ``CausalLM_fast_forward`` until the loss returns), the shifted int64 labels, then
    ``grad_inputs`` (saved), then per chunk the compiled function's one memory-planning pool (the chunk's
    logits and its (tokens, h) gradient), freed as it returns; later chunks reuse its block. Returns
    (transients freed as the loss returns, saved)."""
    n = int(tk.tokens)
    _nl, _full, chunk = logit_sizes(q, flags, n, 1)
    chunk = int(chunk)
    hidden = R.alloc(int((q.head_loss_tok - 8) * n))
    labels = R.alloc(8 * n)
    saved = R.allocs([int(q.loss_saved_tok) * n])
    pool = R.alloc(chunk * int(q.loss_forward_chunk) + int(chunk // max(int(q.logit_width), 1) * q.loss_chunk_tok))
    R.free(pool)
    return [hidden, labels], saved


def _fused_forward(R: _Replay, q: Quantities, tk: Tokens, flags: StepFlags) -> tuple[list, list]:
    """Liger's fused linear cross-entropy forward (``quantities.loss_kinds.fused_linear_ce_bytes``) as it allocates,
    in Liger's order (ops/fused_linear_cross_entropy.py v0.6.4 L55-225): the final norm's output (held by
    ``lce_forward`` until the loss returns), then ``grad_input``, ``grad_weight`` and ``loss_1d`` (saved),
    then per chunk: autocast's copy of ``weight.t()`` and the chunk's logits (the copy freed as the matmul
    returns, the previous chunk's logits as the name is rebound), the cached copy of ``weight`` (first
    chunk), before 0.6.2 under autocast the logits' fp32 copy, from 0.6.2 the weight gradient's ``mm``
    output and its ``.float()`` (the ``mm`` output freed first). Two chunks are replayed: later ones
    repeat the second's blocks. Returns (transients freed as the loss returns, saved)."""
    first, cached, mm, flt, per_elem, half = q.fused_parts
    n = int(tk.tokens)
    _nl, _full, chunk = logit_sizes(q, flags, n, 1)
    chunk = int(chunk)
    last = R.alloc(int(q.head_loss_tok * n))
    saved = R.allocs([int(q.loss_saved_tok - 4) * n, int(q.loss_saved_const), 4 * n])
    kept, prev = [], []
    for i in range(2 if int(_nl) > chunk // max(1, int(q.logit_width)) else 1):
        cast = R.alloc(first)
        cur = R.alloc(chunk * half)
        R.free(cast)
        R.frees(prev)
        if i == 0:
            kept = [R.alloc(cached)]
        extra = R.allocs([chunk * per_elem]) if per_elem else []
        grad_mm = R.alloc(mm)
        grad_f = R.alloc(flt)
        R.frees([grad_mm, grad_f] + extra)
        prev = [cur]
    R.frees(prev)
    return [last] + kept, saved


def _dpo_after_logps(R: _Replay, q: Quantities, full: int, b: int) -> None:
    """``--trainer dpo``'s tensors between the policy's log-probs and the end of ``_compute_loss``
    (``estimate.preference.after_logps``), one by one: the reference head's weight copy and half logits, their fp32 copy
    (the half freed), one sequence's ``logsumexp`` temporary; the metrics' reshape copy of the shifted
    logits and each entropy chunk's log_softmax, exp and product (128 rows; ``logps`` rebound, so the
    previous chunk's is freed after the next one's is made), the chosen and the rejected
    completions' index copies; then the reference's logits, freed as ``_compute_loss`` returns. ``b``:
    sequences (2B), ``full``: logit elements."""
    vocab = q.logit_width
    seq = full // (b * vocab)
    row = (seq - 1) * vocab * 4                                   # one shifted sequence's logits, fp32
    ref = None
    if q.dpo_reference:
        # autocast's uncached half copy of the frozen head weight during the matmul: the size of the
        # policy's copy (``q.cast_head``: one, under --loss logps), none with half weights
        weight = R.alloc(q.cast_head) if q.cast_head else None
        half = R.alloc(full * q.logits_out) if q.logits_cast else None
        R.free(weight)
        ref = R.alloc(full * 4)
        R.free(half)
        R.free(R.alloc(row))
    copy = R.alloc(b * row)
    logps = None
    for first in range(0, b * (seq - 1), 128):   # entropy_from_logits' chunks of 128 rows
        size = min(128, b * (seq - 1) - first) * vocab * 4
        new = R.alloc(size)                      # log_softmax, then the name rebound: the last chunk's freed
        R.free(logps)
        logps = new
        R.frees(R.allocs([size, size]))          # exp and the product, freed as the statement ends
    R.frees([logps, copy])
    for _half in range(2):
        R.free(R.alloc(b // 2 * row))
    R.free(ref)
