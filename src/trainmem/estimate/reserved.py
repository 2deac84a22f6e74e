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
  parameters, the tensors autograd saves (``LayerCoefs.parts``, one block per named part) or, under
  recomputation, the kept input with the layer's tensors made and freed again; the head's input, the
  logits, the loss's transient and saved tensors; backward: the loss gradients, the head's gradients,
  per layer (last first) the recomputed tensors, the largest backward transient, the gradients of the
  layer's tensors, FSDP's unsharded gradients; the embeddings' gradients;
* the optimizer step: the states of every trainable tensor at the first step (``torch.optim``'s lazy
  ``_init_group``), then the step's temporaries as per-tensor blocks; ``zero_grad(set_to_none=True)``
  frees the gradients.

Two steps are replayed with up to two micro-batches each, as the moments are (``moments.py``). The
result is the reserved-minus-allocated gap at the end, added to the estimate's own allocated peak:
the replay is coarser than the moments (a named part is one block, transients are one block), so its
allocated peak is not the estimate's, but the segments it leaves behind are those of tensors of the
estimate's sizes in the step's order. Used for one layout at a time (``estimate``); the layout arrays
of the planner keep the 1/32 rule (``allocator_rules.reserved_overhead``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..allocator import CachingAllocator
from .moments import StepFlags, Tokens, best_transient
from .quantities import Quantities


@dataclass
class _Replay:
    """The simulated allocator and the handles of what is alive."""

    a: CachingAllocator = field(default_factory=CachingAllocator)

    def alloc(self, nbytes: Any) -> int | None:
        return self.a.allocate(int(nbytes)) if nbytes > 0 else None

    def allocs(self, sizes: Any) -> list:
        return [self.alloc(x) for x in sizes]

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
    states: list = field(default_factory=list)   # optimizer-state handles (created by the first step)
    held: list = field(default_factory=list)     # the model output the loop keeps (hold "step")


def reserved_gap(q: Quantities, flags: StepFlags, tk: Tokens, n: int, nsq: int, b: int, ga: int,
                 recompute: str) -> int:
    """Bytes reserved but not allocated at the end of two replayed steps (the allocator's cache)."""
    st = q.detail.states
    R = _Replay()
    R.allocs(st.load)                                                   # weights and buffers, load order
    R.allocs(m for (_w, k, _g, _s, m) in st.trainables for _ in range(k) if m)  # fp32 master copies
    s = _Step()
    if flags.grads_persistent:                                          # Megatron main-grad buffers
        _make_grads(R, s, st.trainables, lambda w: True)
    for step in (1, 2):
        for _micro in range(min(ga, 2)):
            _micro_step(R, s, q, flags, tk, n, nsq, recompute, b)
        _optimizer_step(R, s, q, flags, step)
    return max(0, R.a.peak_reserved - R.a.peak_allocated)


def _logit_tensors(total: int, per_elem: int, elems: int) -> list[int]:
    """A logits-sized term as the tensors it is made of: ``per_elem`` bytes per logit element are
    fp32 tensors (4 B each) and at most one half tensor (2 B), each of ``elems`` elements (the loss
    keeps whole logits-sized tensors: the fp32 upcast, log-probabilities, their gradients); what is
    left of ``total`` (a chunk's tensors, per-token terms) is one more block."""
    per_elem = int(per_elem)
    sizes = [elems * 4] * (per_elem // 4) + [elems * 2] * ((per_elem % 4) // 2) + [elems] * (per_elem % 2)
    rest = int(total) - sum(sizes)
    return sizes + [rest] if rest > 0 else sizes


def _layer_parts(q: Quantities, n: int, nsq: int) -> list[int]:
    """Bytes of each named part one layer saves for backward (``LayerCoefs.parts``), one block each."""
    return [int(a * n + b * nsq) for _name, a, b in q.detail.layer.parts]


def _micro_step(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, n: int, nsq: int,
                recompute: str, b: int) -> None:
    """One micro-batch's forward and backward."""
    inputs = R.alloc(tk.inputs)                                   # int64 ids and labels
    root = R.alloc(q.fsdp_root)                                   # FSDP: the root unit gathered
    emb = R.alloc(tk.outer_rest)                                  # embeddings' saved tensors
    parts = _layer_parts(q, n, nsq)
    kept = [_layer_forward(R, q, parts, tk, recompute) for _ in range(q.layers)]
    head_in = R.alloc(tk.outer_head)                              # final norm output / head input
    cast_head = R.alloc(q.cast_head)                              # autocast's half copy of the head
    full = n * q.logit_width // q.tp if flags.lm else b * q.logit_width   # logit elements
    out = R.allocs(_logit_tensors(tk.out_logits, q.logits_out, full))     # (b, s, vocab) logits
    R.frees(s.held)                                               # the previous step's output, replaced
    s.held = []
    fwd = R.allocs(_logit_tensors(tk.loss_forward, q.loss_forward, full))  # the loss's fp32 copy, transient
    saved = R.allocs(_logit_tensors(tk.loss_saved, q.loss_saved, full))    # log-probabilities saved
    R.frees(fwd)
    if flags.hold == "loss":
        R.frees(out)
    lb = R.allocs(_logit_tensors(tk.loss_backward, q.loss_backward, full))  # gradients of the logits
    R.frees(saved)
    _make_grads(R, s, q.detail.states.trainables, lambda w: w == "after", flags.oib)   # head, final norm
    R.frees(lb + [head_in, cast_head])
    for i in reversed(range(q.layers)):
        _layer_backward(R, s, q, parts, kept[i], i, n, nsq, recompute, flags.oib)
    _make_grads(R, s, q.detail.states.trainables, lambda w: w == "before", flags.oib)  # embeddings
    R.frees([emb, root, inputs])
    if flags.hold == "step":
        s.held = out
    elif flags.hold == "backward":
        R.frees(out)


def _layer_forward(R: _Replay, q: Quantities, parts: list[int], tk: Tokens, recompute: str) -> list:
    """One layer's forward: what it keeps for backward (a list of handles)."""
    buf = R.alloc(q.fsdp_layer_buf)                               # FSDP: this layer's gathered weights
    if recompute == "none":
        kept = R.allocs(parts) + [R.alloc(q.cast_layer)]          # saved tensors + autocast weight copies
    else:
        kept = [R.alloc(tk.layer)]                                # the checkpoint's kept tensors
        R.frees(R.allocs(parts))                                  # made and freed in the no-grad forward
    R.free(buf)
    return kept


def _layer_backward(R: _Replay, s: _Step, q: Quantities, parts: list[int], kept: list, i: int, n: int,
                    nsq: int, recompute: str, oib: bool) -> None:
    """One layer's backward: recompute, the largest transient, the gradients, then its tensors freed."""
    buf = R.alloc(q.fsdp_layer_buf)                               # FSDP: gathered again for backward
    redo = R.allocs(parts) if recompute != "none" else []         # the checkpointed forward again
    _idx, value, grads = best_transient(q.transients, n, nsq)
    tr = R.alloc(max(0, value - grads))                           # grad_out, grad_in of the worst op
    full = R.alloc(q.detail.states.layer_grads_full)              # FSDP: unsharded gradients
    _make_grads(R, s, q.detail.states.trainables, lambda w: w == "layer" or w == f"layer{i}", oib)
    rs = R.alloc(q.fsdp_rs_buf)                                   # FSDP: the reduce-scatter input
    R.frees([tr, full, rs, buf])
    R.frees(redo)
    R.frees(kept)


def _make_grads(R: _Replay, s: _Step, trainables: tuple, pick: Any, oib: bool = False) -> None:
    """Allocate the gradients of the trainable tensors ``pick(where)`` selects that do not exist yet
    (one copy of a per-layer tensor per call: the layer being back-propagated). ``oib``: the optimizer
    steps inside backward and a hook frees each gradient at once (``optim/in_backward.py``)."""
    for j, (where, k, g, _sts, _m) in enumerate(trainables):
        if not pick(where):
            continue
        copy = sum(1 for key in s.grads if key[0] == j) if where == "layer" else 0
        if where == "layer" and copy >= k:
            continue
        if (j, copy) not in s.grads:
            s.grads[(j, copy)] = R.alloc(g)
            if oib:
                R.free(s.grads[(j, copy)])
                s.grads[(j, copy)] = None


def _optimizer_step(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, step: int) -> None:
    """``optimizer.step()``: states at the first step, temporaries, then ``zero_grad``."""
    st = q.detail.states
    if step == 1:
        s.states = [R.alloc(x) for (_w, k, _g, sts, _m) in st.trainables for _ in range(k) for x in sts]
    temps, left = [], q.step_temp
    for (_w, k, g, _sts, _m) in st.trainables:                   # per-tensor temporaries, in order
        for _ in range(k):
            if left <= 0:
                break
            temps.append(R.alloc(min(g, left)))
            left -= g
    R.frees(temps)
    if flags.oib or not (flags.zeros or flags.grads_persistent):  # zero_grad(set_to_none=True)
        R.frees(list(s.grads.values()))
        s.grads = {}
