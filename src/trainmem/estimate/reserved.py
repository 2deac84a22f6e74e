"""Reserved memory of an estimate: the step's allocations and frees replayed through the allocator.

``torch.cuda.max_memory_reserved()`` exceeds the allocated peak by what the caching allocator holds
in cached blocks that the peak's requests could not use: a block freed earlier is split by smaller
requests and a later large request needs a fresh segment (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``:
``get_free_block`` takes the smallest cached block that fits, ``shouldSplit`` splits a large block when
more than 1 MiB remains, ``alloc_block`` calls ``cudaMalloc`` otherwise; a freed block stays
reserved). A fixed fraction cannot follow that: trace measured from 3% (LoRA) to 32% (FSDP with
full recomputation) of the allocated peak. So the estimate builds its own sequence of requests, tensor
by tensor where the estimate knows the tensors and block by block where it knows only their sum, and
runs it through the same simulator as ``trace`` (``trainmem.allocator.CachingAllocator``):

* load: each weight and buffer in load order (``States.load``), an fp32 master copy per trainable
  tensor where one is kept;
* each micro-batch: the input batch; forward: the embeddings' saved tensors, per layer FSDP's gathered
  parameters, the tensors autograd saves (``LayerCoefs.tensors``, one block each) or, under
  recomputation, the kept input with the layer's tensors made and freed again; the head's input, the
  logits, the loss's transient and saved tensors; backward: the loss gradients, the head's gradients,
  per layer (last first) the recomputed tensors, the largest backward transient, the gradients of the
  layer's tensors, FSDP's unsharded gradients; the embeddings' gradients;
* the optimizer step: the states of every trainable tensor at the first step (``torch.optim``'s lazy
  ``_init_group``), then the step's temporaries as per-tensor blocks; ``zero_grad(set_to_none=True)``
  frees the gradients.

Two steps are replayed with up to two micro-batches each, as the moments are (``moments.py``). The
result is the reserved-minus-allocated gap at the end, added to the estimate's own allocated peak:
the replay is coarser than the moments (a backward transient is one block, Megatron's selective policy's kept tensors are scaled), so its
allocated peak is not the estimate's, but the segments it leaves behind are those of tensors of the
estimate's sizes in the step's order. Used for one layout at a time (``estimate``); the layout arrays
of the planner keep the 1/32 rule (``allocator_rules.reserved_overhead``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..allocator import CachingAllocator
from ..allocator_rules import block_bytes
from .moments import StepFlags, Tokens, best_transient, label_tokens
from .quantities import Quantities


@dataclass
class _Replay:
    """The simulated allocator and the handles of what is alive."""

    a: CachingAllocator = field(default_factory=CachingAllocator)
    # (phase label, step) -> (reserved bytes at its end, the replay's allocated peak so far)
    marks: dict = field(default_factory=dict)

    def mark(self, label: str, step: int) -> None:
        self.marks[(label, step)] = (self.a.reserved, self.a.peak_allocated)

    def alloc(self, nbytes: Any, stream: int = 0) -> int | None:
        return self.a.allocate(int(nbytes), stream=stream) if nbytes > 0 else None

    def allocs(self, sizes: Any, stream: int = 0) -> list:
        return [self.alloc(x, stream) for x in sizes]

    def free(self, h: int | None) -> None:
        if h is not None:
            self.a.free(h)

    def frees(self, hs: list) -> None:
        for h in hs:
            self.free(h)


@dataclass
class _Step:
    """What the replay keeps between phases: gradients, states, the held output."""

    grads: dict = field(default_factory=dict)    # (trainable index, copy) -> handle
    made: dict = field(default_factory=dict)     # trainable index -> copies with a gradient (per-layer tensors)
    states: list = field(default_factory=list)   # optimizer-state handles (created by the first step)
    held: list = field(default_factory=list)     # the model output the loop keeps (hold "step")
    step: int = 0                                # the step being replayed (1 or 2)
    handle_ws: int = 0                           # one cuBLAS handle's workspace (Hardware.handle_workspace)
    workspaces: list = field(default_factory=list)  # the forward thread's, then autograd's (kept)

    def workspace(self, R: "_Replay", thread: int) -> None:
        """The cuBLAS workspace of the forward (0) or the autograd (1) thread, at its first matmul
        (kept: PyTorch caches one per handle and stream, ``CUDABlas.cpp`` ``getCUDABlasLtWorkspace``)."""
        if len(self.workspaces) == thread and self.handle_ws:
            self.workspaces.append(R.alloc(self.handle_ws))


def reserved_gap(q: Quantities, flags: StepFlags, tk: Tokens, n: int, nsq: int, b: int, ga: int,
                 recompute: str, temp_copies: int | None, handle_ws: int = 0) -> tuple[int, dict]:
    """Bytes reserved but not allocated at the end of two replayed steps (the allocator's cache),
    and at the end of each phase, by (phase label, step) as ``breakdown.phases`` labels them, the
    replay's reserved bytes and its allocated peak so far."""
    st = q.detail.states
    R = _Replay()
    R.allocs(st.load)                                                   # weights and buffers, load order
    if st.master:                                                       # fp32 master copies (not offloaded)
        R.allocs(m for (_w, k, _g, _s, m) in st.trainables for _ in range(k) if m)
    if q.ds_bucket and not q.ds_backward_buf:                         # DeepSpeed ZeRO-3's bucket, from engine start
        R.alloc(q.ds_bucket)
    R.mark("model_loaded", 0)
    s = _Step(handle_ws=handle_ws)
    if flags.grads_persistent or q.grads_loaded:                        # Megatron main grads, DeepSpeed ZeRO-3's
        for _ in range(max((k for _w, k, *_r in st.trainables), default=0)):
            _make_grads(R, s, st.trainables, tuple({w for w, *_r in st.trainables}))
    for step in (1, 2):
        s.step = step
        _micro_batches(R, s, q, flags, tk, n, nsq, recompute, b, ga)
        _optimizer_step(R, s, q, flags, step, temp_copies)
    return max(0, R.a.peak_reserved - R.a.peak_allocated), R.marks


def _logit_tensors(total: int, per_elem: int, elems: int, chunks: int = 1) -> list[int]:
    """A logits-sized term as the tensors it is made of: ``per_elem`` bytes per logit element are
    fp32 tensors (4 B each) and at most one half tensor (2 B), each of ``elems`` elements (the loss
    keeps whole logits-sized tensors: the fp32 upcast, log-probabilities, their gradients), or
    ``chunks`` tensors each under a chunked loss (torchtune's ``CEWithChunkedOutputLoss`` and
    litgpt's ``chunked_cross_entropy`` keep a list of per-chunk logits); what is left of ``total``
    (one chunk's transient tensors, per-token terms) is one more block."""
    per_elem, part = int(per_elem), -(-elems // chunks)
    sizes = [part * 4] * (chunks * (per_elem // 4)) + [part * 2] * (chunks * ((per_elem % 4) // 2))
    sizes += [part] * (chunks * (per_elem % 2))
    rest = int(total) - elems * per_elem
    return sizes + [rest] if rest > 0 else sizes


class _Parts(list):
    """Bytes of each tensor one layer saves for backward, in order; ``forward_only``: those it makes
    and frees in its forward (``LayerCoefs.fwd_free``)."""

    def __init__(self, saved: Any, forward_only: list[int], op: list[int] | None = None) -> None:
        super().__init__(saved)
        self.forward_only = forward_only
        self.op = op or []     # the op outputs torchtitan's per-op policy keeps (``LayerCoefs.op_tensors``)


def _layer_parts(q: Quantities, n: int, nsq: int) -> _Parts:
    """Bytes of each tensor one layer saves for backward, in the order it saves them
    (``LayerCoefs.tensors``; a derived architecture's named parts, one block each)."""
    lc = q.detail.layer
    return _Parts((int(a * n + b * nsq) for a, b in (lc.tensors or [(a, b) for _name, a, b in lc.parts])),
                  [int(a * n + b * nsq) for a, b in lc.fwd_free],
                  [int(a * n + b * nsq) for a, b in lc.op_tensors])


@dataclass
class _Forward:
    """What one micro-batch's forward leaves for its backward (handles, and the logits' shape)."""

    inputs: Any
    fs: "_Fsdp"
    root: list
    emb: Any
    kept: list
    head: list                                   # the head's input and autocast copy
    out: list                                    # the logits
    saved: list                                  # what the loss saved
    full: int                                    # logit elements
    chunks: int


def _forward(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, parts: list[int],
             recompute: str, full: int, suffix: str) -> _Forward:
    """One micro-batch's forward, the loss included."""
    st = q.detail.states
    inputs = R.alloc(tk.inputs)                                   # int64 ids and labels
    fs = _Fsdp(q.fsdp_ag_result > 0, _fsdp_streams(q))
    root = fs.unshard(R, q.fsdp_root, st.root_tensors)            # FSDP: the root unit gathered
    emb = R.alloc(tk.outer_rest)                                  # embeddings' saved tensors
    s.workspace(R, 0)                                             # the first layer's first matmul
    kept = [_layer_forward(R, q, fs, parts, tk, recompute, keep=(i == q.layers - 1 and q.fsdp_last_kept > 0))
            for i in range(q.layers)]
    head = [R.alloc(tk.outer_head), R.alloc(q.cast_head)]        # head input, autocast's half copy of the head
    # a chunked loss: one tensor per chunk, at most one chunk per token (more are not made: setup_warnings)
    chunks = max(1, min(int(q.logit_chunks), int(tk.tokens))) if q.liger_factor == 0 else 1
    out = R.allocs(_logit_tensors(tk.out_logits, q.logits_out, full, chunks))  # (b, s, vocab) logits
    if q.logits_cast:  # --cast-output: Fabric's fp32 copies, made while the half output is alive
        cast = R.allocs(_logit_tensors(tk.cast_logits, q.logits_cast, full, chunks))
        R.frees(out)
        out = cast
    R.frees(s.held)                                               # the previous step's output, replaced
    s.held = []
    fwd = R.allocs(_logit_tensors(tk.loss_forward, q.loss_forward, full, chunks))  # the fp32 copy, transient
    saved = R.allocs(_logit_tensors(tk.loss_saved, q.loss_saved, full, chunks))    # log-probabilities
    R.frees(fwd)
    if flags.hold == "loss":
        R.frees(out)
        out = []
    if _root_resharded(q, fs):                                    # FSDP2 reshards the root after its forward
        R.frees(root)
        root = []
    if fs.v2:                                                     # ... and frees the last all-gather output
        R.free(fs.ag)                                             # (``_fsdp_state.py`` ``_post_forward``)
        fs.ag = None
    R.mark("forward" + suffix, s.step)
    return _Forward(inputs, fs, root, emb, kept, head, out, saved, full, chunks)


def _cast_chunks_backward(R: _Replay, q: Quantities, f: _Forward) -> list:
    """The backward of a chunked loss on Fabric's fp32 copies of the head's chunks (``--cast-output``,
    ``quantities._cast_output_loss_bytes``), chunk by chunk as autograd runs them, the last first:
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


def _root_resharded(q: Quantities, fs: "_Fsdp") -> bool:
    """FSDP2 reshards the root unit when its forward returns and gathers it again at its pre-backward
    (``quantities.root_resharded_for_loss``): under ``--fsdp full``/``hybrid``, not grad-op."""
    return fs.v2 and q.fsdp_root > 0 and not q.fsdp_root_kept


def _backward(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, f: _Forward, parts: list[int],
              n: int, nsq: int, recompute: str, suffix: str) -> None:
    """One micro-batch's backward, from the loss to the embeddings."""
    st = q.detail.states
    buckets = R.allocs([q.ds_bucket] * (q.ds_backward_buf // q.ds_bucket if q.ds_bucket else 0))  # DeepSpeed ZeRO-1/2
    if _root_resharded(q, f.fs) and not q.fsdp_root_regather:     # the root's pre-backward: the loss is its output
        f.root = f.fs.unshard(R, q.fsdp_root, st.root_tensors, backward=True)
    if q.logits_cast and f.chunks > 1:
        dlogits = _cast_chunks_backward(R, q, f)
    else:
        lb = R.allocs(_logit_tensors(tk.loss_backward, q.loss_backward, f.full, f.chunks))  # logits' gradients
        R.frees(f.saved)
        dlogits = R.allocs(_logit_tensors(tk.logits_grad, q.logits_out, f.full, f.chunks))  # in the head's dtype
        R.frees(lb)
    if _root_resharded(q, f.fs) and q.fsdp_root_regather:         # ... the logits (a loss outside the model)
        f.root = f.fs.unshard(R, q.fsdp_root, st.root_tensors, backward=True)
    head_full = R.alloc(st.head_grads_full)                       # FSDP: the head's unsharded gradients
    tied = R.alloc(q.tied_grad)                                   # a tied head's gradient, until the embedding's
    s.workspace(R, 1)                                             # after the head's first backward matmul
    R.frees(dlogits + f.head)
    for i in reversed(range(q.layers)):
        _layer_backward(R, s, q, f.fs, parts, f.kept[i], i, n, nsq, recompute, flags.oib)
    emb_full = R.alloc(st.emb_grads_full)                         # FSDP: the embedding's unsharded gradient
    if tied is not None and _root_resharded(q, f.fs):             # FSDP2, a tied head: the embedding's own
        emb_out = R.alloc(q.tied_grad)                            # gradient, then autograd's InputBuffer adds
        acc = R.alloc(q.tied_grad)                                # it to the head's into a new tensor, the
        R.frees([tied, emb_out])                                  # unsharded gradient reduce-scattered
        tied = None
        emb_full = acc if emb_full is None else emb_full
    f.fs.reduce(R, [head_full, emb_full],                         # the root's reduce-scatter input
                q.fsdp_root_rs or (st.head_grads_full + st.emb_grads_full) * f.fs.rs_factor(q))
    _make_grads(R, s, st.trainables, ("after", "before"), flags.oib, f.fs.grad_stream)  # head, norm, embeddings
    R.frees([tied, f.emb, f.inputs] + f.root + buckets)
    f.fs.done(R)
    R.mark("backward" + suffix, s.step)
    if flags.hold == "step":
        s.held = f.out
    elif flags.hold == "backward":
        R.frees(f.out)


def _micro_batches(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, n: int, nsq: int,
                   recompute: str, b: int, ga: int) -> None:
    """A step's micro-batches: each forward, then its backward once ``tk.inflight`` forwards are in
    flight (1: one after the other; a pipeline stage under 1F1B: min(pp, grad_accum) on the first
    stage, every micro-batch under GPipe, ``moments.tokens``), the rest drained at the end. Up to
    one micro-batch more than are in flight is replayed (two without a pipeline)."""
    inflight = max(1, int(tk.inflight))
    parts = _layer_parts(q, n, nsq)
    full = label_tokens(q, n) * q.logit_width // q.tp if flags.lm else b * q.logit_width   # logit elements
    pending: list = []
    for micro in range(min(ga, inflight + 1)):
        suffix = "" if ga == 1 else (".micro1" if micro == 0 else f".micro2-{ga}")
        pending.append((_forward(R, s, q, flags, tk, parts, recompute, full, suffix), suffix))
        if len(pending) >= inflight:
            f, sfx = pending.pop(0)
            _backward(R, s, q, flags, tk, f, parts, n, nsq, recompute, sfx)
    for f, sfx in pending:
        _backward(R, s, q, flags, tk, f, parts, n, nsq, recompute, sfx)


#: the side streams of PyTorch FSDP (ids of the replay's allocator pools; 0 is the default stream)
GATHER_STREAM, GRAD_STREAM = 1, 2


def _fsdp_streams(q: Quantities) -> tuple[int, int]:
    """Where PyTorch FSDP allocates its buffers: the caching allocator keeps a pool per stream and
    reuses a block only on the stream that allocated it (``allocator.py``, "Streams"). FSDP2 makes
    the all-gather output on its all-gather copy-in stream (torch 2.13
    ``_fully_shard/_fsdp_collectives.py`` ``foreach_all_gather``: ``all_gather_comm.allocate`` inside
    ``device_handle.stream(all_gather_copy_in_stream)``) and the reduce-scatter output, which the
    sharded gradients are views of, on its reduce-scatter stream (``foreach_reduce``: ``reduce_output``
    inside ``device_handle.stream(reduce_scatter_stream)``; the input is made on the current
    stream before it). FSDP1 unshards its flat parameter on its unshard stream and makes the reduce
    dtype's copy and the new gradient shard on its post-backward stream (``fsdp/_runtime_utils.py``
    ``_unshard``, ``_post_backward_hook``). Found by the torchtitan benchmark (Llama 3.1 8B, FSDP2
    over 8 H100s): trace with one pool -7.1% on max reserved, with a pool per stream +0.2%.
    DeepSpeed's streams are not modelled (0, 0)."""
    if q.fsdp_root <= 0 and q.fsdp_layer_buf <= 0:
        return (0, 0)
    return (GATHER_STREAM, GRAD_STREAM)


@dataclass
class _Fsdp:
    """FSDP's unsharded parameters and gradients over one micro-batch. FSDP2 (``v2``) all-gathers a
    unit into one flat output, copies each parameter out of it and frees the output only when the
    next unit's all-gather is waited on (torch 2.13 ``_fsdp_param_group.py`` ``wait_for_unshard``);
    its ``post_backward`` copies the unsharded gradients into one flat reduce-scatter input in the
    reduce dtype and keeps the last one until the next unit's (``reduce_scatter_states``). FSDP1's
    flat parameter is one block, and its reduce-scatter input is freed when the collective is
    issued (``_runtime_utils.py`` ``_reduce_grad``)."""

    v2: bool
    streams: tuple[int, int] = (0, 0)  # (all-gather, gradient) streams: ``_fsdp_streams``
    ag: int | None = None      # the last all-gather output (FSDP2)
    rs: int | None = None      # the last reduce-scatter input (FSDP2)
    prefetched: int | None = None  # in backward, the lower layer's all-gather output, issued by the prefetch (FSDP2)
    last: list = field(default_factory=list)  # the last layer's parameters, kept gathered (--fsdp-gathered root-last)

    @property
    def grad_stream(self) -> int:
        return self.streams[1]

    def unshard(self, R: _Replay, flat: int, tensors: tuple[int, ...], backward: bool = False) -> list:
        """A unit gathered: FSDP1's flat parameter; FSDP2's flat all-gather output and each parameter
        copied out of it. In forward the output is freed at the next unit's copy-out
        (``comm_ctx.all_gather_state``), in backward right after its own (torch 2.13
        ``_fsdp_param_group.py`` ``wait_for_unshard``)."""
        if flat <= 0:
            return []
        if not self.v2 or not tensors:
            return [R.alloc(flat, self.streams[0])]               # FSDP1's unsharded flat parameter
        ag = R.alloc(flat, self.streams[0])                       # the all-gather output, flat
        R.free(self.ag)
        self.ag = ag
        params = R.allocs(tensors)                                # each parameter copied out
        if backward:
            R.free(self.ag)
            self.ag = None
        return params

    def unshard_backward(self, R: _Replay, flat: int, tensors: tuple[int, ...], prefetch: bool) -> list:
        """A layer gathered in backward. FSDP2 (torch 2.13 ``_fsdp_param_group.py``): its
        ``pre_backward`` (L576-586) copies its parameters out of the all-gather output that the
        upper layer's backward prefetch allocated (the top layer's: allocated here), frees that
        output (``wait_for_unshard`` L487-489), then ``_backward_prefetch`` (L795-831) allocates the
        lower layer's (``prefetch``; none below the bottom layer), alive through this layer's
        backward (``moments._fsdp_middle_layers``). FSDP1: ``unshard``."""
        if flat <= 0 or not self.v2 or not tensors:
            return self.unshard(R, flat, tensors, backward=True)
        ag = self.prefetched if self.prefetched is not None else R.alloc(flat, self.streams[0])
        self.prefetched = None
        params = R.allocs(tensors)                                # each parameter copied out
        R.free(ag)
        if prefetch:
            self.prefetched = R.alloc(flat, self.streams[0])      # the lower layer's all-gather output
        return params

    def post_backward(self, R: _Replay, params: list, grads: list, rs_bytes: int) -> None:
        """FSDP2's ``post_backward`` (``_fsdp_param_group.py`` L588-719): the layer resharded (its
        parameters freed), the upper layer's reduce-scatter input popped from
        ``reduce_scatter_states`` and freed (L645-657), then ``foreach_reduce`` allocates this
        layer's input, copies the unsharded gradients in and frees them (``reduce``)."""
        R.frees(params)
        R.free(self.rs)
        self.rs = None
        self.reduce(R, grads, rs_bytes)

    @staticmethod
    def rs_factor(q: Quantities) -> int:
        """Reduce-scatter input bytes per unsharded gradient byte: 2 when fp32 reduces bf16 gradients."""
        full = q.detail.states.layer_grads_full
        return max(1, round(q.fsdp_rs_buf / full)) if q.fsdp_rs_buf and full else 1

    def reduce(self, R: _Replay, grads: list, rs_bytes: int) -> None:
        rs = R.alloc(rs_bytes)                                    # the unsharded gradients, flat
        R.frees(grads)
        if self.v2:
            R.free(self.rs)
            self.rs = rs
        else:
            R.free(rs)

    def done(self, R: _Replay) -> None:
        R.frees([self.ag, self.rs, self.prefetched])
        self.ag = self.rs = self.prefetched = None


def _layer_forward(R: _Replay, q: Quantities, fs: _Fsdp, parts: _Parts, tk: Tokens, recompute: str,
                   keep: bool = False) -> list:
    """One layer's forward: what it keeps for backward (a list of handles). ``keep``: its gathered
    parameters stay until its backward (``quantities.fsdp2_last_gathered``)."""
    params = fs.unshard(R, q.fsdp_layer_buf, q.detail.states.layer_tensors)  # FSDP: this layer gathered
    if recompute == "none":
        kept = R.allocs(parts) + [R.alloc(q.cast_layer)]          # saved tensors + autocast weight copies
        R.frees(R.allocs(parts.forward_only))                     # what the forward makes and frees
    else:
        R.frees(R.allocs(parts))                                  # made and freed in the no-grad forward
        kept = R.allocs(_kept_blocks(parts, tk.layer, recompute))  # what the checkpoint keeps
    if keep:
        fs.last = params                                          # not resharded after forward
    else:
        R.frees(params)                                           # resharded after forward
    return kept


def _kept_blocks(parts: list[int], kept: int, recompute: str) -> list[int]:
    """What a checkpointed layer keeps, as blocks: under full recomputation its input (one tensor);
    under torchtitan's per-op policy its input and each op output the policy saves, at its own size
    (``parts.op``: ``LayerCoefs.op_tensors``; a share of every saved tensor left other holes: the
    torchtitan PR #165 'SAC' rows, FSDP2 -7.0 % and FSDP1 -9.1 % against trace's reserved memory,
    tests/test_op_replay.py); under Megatron's selective recomputation a share of the saved tensors,
    each part scaled to the kept total."""
    total = sum(parts)
    if recompute == "full" or total <= 0:
        return [kept]
    op = getattr(parts, "op", [])
    if recompute == "op" and op and kept >= sum(op):
        return [kept - sum(op)] + list(op)                        # the input, then the policy's outputs
    return [p * kept // total for p in parts]


def _layer_backward(R: _Replay, s: _Step, q: Quantities, fs: _Fsdp, parts: list[int], kept: list, i: int,
                    n: int, nsq: int, recompute: str, oib: bool) -> None:
    """One layer's backward: recompute, the largest transient, the gradients, then its tensors freed."""
    st = q.detail.states
    if fs.last:                                                   # kept gathered since its forward
        params, fs.last = fs.last, []
    else:  # FSDP: gathered again (FSDP2: and the layer below prefetched)
        params = fs.unshard_backward(R, q.fsdp_layer_buf, st.layer_tensors, prefetch=i > 0)
    redo = R.allocs(parts) if recompute != "none" else []         # the checkpointed forward again
    _idx, value, grads = best_transient(q.transients, n, nsq)
    tr = R.alloc(max(0, value - grads))                           # grad_out, grad_in of the worst op
    if st.layer_grads_full and not fs.v2 and q.fsdp1_post:        # FSDP1: the flat gradient, then its hook
        params = _fsdp1_reduce(R, q, st, params)
    elif st.layer_grads_full and fs.v2:                           # FSDP2: the unsharded gradients made, the
        full = R.allocs(st.layer_tensors) if st.layer_tensors else [R.alloc(st.layer_grads_full)]
        R.frees([tr] + redo + kept)                               # layer's backward done, its tensors freed;
        tr, redo, kept = None, [], []                             # then its post-backward hook
        fs.post_backward(R, params, full, q.fsdp_rs_buf or st.layer_grads_full)
        params = []
    elif st.layer_grads_full:                                     # FSDP1 without a hook of its own
        fs.reduce(R, [R.alloc(st.layer_grads_full)], q.fsdp_rs_buf or st.layer_grads_full)
    _make_grads(R, s, st.trainables, ("layer", f"layer{i}"), oib, fs.grad_stream)
    R.frees([tr] + params)
    R.frees(redo)
    R.frees(kept)


def _fsdp1_reduce(R: _Replay, q: Quantities, st: Any, params: list) -> list:
    """The end of an FSDP1 layer's backward (``quantities.fsdp1_flat_gradient``,
    ``fsdp1_post_backward``): each parameter view's gradient, when every parameter of the layer trains
    (else the adapters' as one block), concatenated into the flat gradient; then the post-backward
    hook reshards the layer (its gathered parameters freed) and allocates the reduce dtype's copy and
    the new shard beside the flat gradient, all freed when it returns (the shard stands for the
    sharded gradients ``_make_grads`` allocates next). Returns the gathered parameters left to free."""
    whole = sum(block_bytes(x) for x in st.layer_tensors) == st.layer_grads_full
    views = R.allocs(st.layer_tensors) if whole else [R.alloc(st.layer_grads_full)]
    flat = R.alloc(st.layer_grads_full)                           # SplitWithSizesBackward's cat
    R.frees(views)
    R.frees(params)                                               # _post_backward_reshard
    hook = R.alloc(q.fsdp1_post - st.layer_grads_full, GRAD_STREAM)  # the reduce dtype's copy, the new shard
    R.frees([flat, hook])
    return []


def _make_grads(R: _Replay, s: _Step, trainables: tuple, where: tuple[str, ...], oib: bool = False,
                stream: int = 0) -> None:
    """Allocate the gradients that do not exist yet of the trainable tensors placed at one of
    ``where`` (one copy of a per-layer tensor per call: the layer being back-propagated), on
    ``stream`` (FSDP's sharded gradients: its reduce-scatter stream). ``oib``: the optimizer steps
    inside backward and a hook frees each gradient at once (``optim/in_backward.py``)."""
    for j in _placed(trainables, where):
        _w, k, g, _sts, _m = trainables[j]
        copy = s.made.get(j, 0) if _w == "layer" else 0
        if copy >= k or (j, copy) in s.grads:
            continue
        s.made[j] = copy + 1
        s.grads[(j, copy)] = R.alloc(g, stream)
        if oib:
            R.free(s.grads[(j, copy)])
            s.grads[(j, copy)] = None


@lru_cache(maxsize=256)
def _placed(trainables: tuple, where: tuple[str, ...]) -> tuple[int, ...]:
    """Indices of the trainable tensors placed at one of ``where``."""
    return tuple(j for j, item in enumerate(trainables) if item[0] in where)


def _scaled(sizes: list[int], total: int) -> list[int]:
    """``sizes`` scaled to sum to ``total`` (their proportions kept)."""
    whole = sum(sizes)
    return [x * total // whole for x in sizes] if whole > 0 and total > 0 else []


def _optimizer_step(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, step: int,
                    temp_copies: int | None) -> None:
    """``optimizer.step()``: states at the first step, temporaries, then ``zero_grad``.
    ``temp_copies``: the step's temporaries per tensor of a per-tensor loop (for-loop Adam 2,
    transformers' Adafactor 2 or 4, none for fused / in-place steps), None for a foreach step: one
    state-sized temporary per tensor of the group, all alive at once (``quantities.step_temporaries``);
    ``q.step_temp`` sets their total (the group's, or the largest tensor's ``temp_copies``)."""
    st = q.detail.states
    if step == 1 and st.optimizer:                               # lazily, unless offloaded to the host
        s.states = [R.alloc(x) for (_w, k, _g, sts, _m) in st.trainables for _ in range(k) for x in sts]
    sizes = [(sts[0] if sts else g) for (_w, k, g, sts, _m) in st.trainables for _ in range(k)]
    if q.ds_step_fp32:                                           # DeepSpeed: one flat fp32 partition per group
        flat, fp32 = R.alloc(q.ds_step_flat), R.alloc(q.ds_step_fp32)   # the cast: flat copy, then fp32
        R.free(flat)
        R.free(R.alloc(q.step_temp - q.ds_step_fp32 - q.ds_step_flat))  # the optimizer's own, on that tensor
        R.free(fp32)
    elif temp_copies is None:                                    # foreach: the whole group's at once
        R.frees(R.allocs(_scaled(sizes, q.step_temp)))
    elif temp_copies and sizes:                                  # a loop over tensors: each in turn
        per = _scaled(sizes, q.step_temp * sum(sizes) // (temp_copies * max(sizes)))
        for x in per:
            R.frees(R.allocs([x] * temp_copies))
    R.mark("optimizer_step", step)
    if flags.oib or not (flags.zeros or flags.grads_persistent or q.grads_loaded):  # zero_grad(set_to_none=True)
        R.frees(list(s.grads.values()))
        s.grads, s.made = {}, {}
    R.mark("zero_grad", step)
