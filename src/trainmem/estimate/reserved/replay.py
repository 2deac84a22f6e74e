"""The replay's allocator and step state: ``_Replay`` (the caching allocator simulator with the
estimate's own allocated count), ``_Step`` (one step's gradients), the side streams' pool ids and
small helpers every part of the replay uses."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ...allocator import CachingAllocator
from ...allocator_rules import block_bytes

if TYPE_CHECKING:   # (used in annotations only; a run-time import would close a cycle)
    from .fsdp import _Fsdp1Lag


@dataclass
class _LayerCarry:
    """What one call of the layer passes leaves for a later one (``_Replay.layer``): handles of tensors a
    layer's forward or backward made that another layer, a later forward group of the same layer, or the
    head side frees or takes. Each field says who sets it and who reads it."""

    # the layer's output, the next layer's input: set by ``layer_forward._resid_tail``; taken by the next
    # layer's forward group (``layer_forward._layer_input``, events "i" / "j") or, for the top layer, by
    # ``driver._top_output`` as the final norm's input
    resid: Any = None
    # the residual stream's gradient the final norm's backward made: set by ``loss_backward._final_norm_backward``;
    # taken by the top layer's backward (``layer_backward._layer_backward``, ``_op_backward``)
    resid_grad: int | None = None
    # a recomputed layer's incoming gradient, made before its recomputation: set by
    # ``layer_backward._layer_backward`` (``_incoming_first``); taken by ``_op_backward``'s first group ("u")
    grad_in: Any = None
    # the layer's unsaved input (event "j"): appended by ``layer_forward._group_allocs``; freed by
    # ``layer_forward._layer_forward`` once the layer's module hooks have run
    resid_in: list = field(default_factory=list)
    # the cuBLAS workspace's call a forward group makes (event "w"): set by ``layer_forward._group_workspace``;
    # taken by ``_group_allocs`` at the event, else by ``_group_workspace`` at the layer's end
    ws_here: Any = None
    # a forward group's tensors held past it (event "hK"): appended by ``_group_allocs``; freed by a later
    # group's "H" event (``_group_allocs``)
    attn_held: list = field(default_factory=list)
    # tensors the model output references, its KV cache (event "cK"): appended by ``_group_allocs``; freed with
    # the output (``driver._forward``), by ``driver._top_output`` on a stage without the head, and by
    # ``layer_forward._saved_and_casts`` after a recomputation
    out_refs: list = field(default_factory=list)


@dataclass
class _Replay:
    """The simulated allocator and the handles of what is alive.

    Its allocated peak is counted as the estimate counts memory (``net``): each block allocated after
    the load at what a fresh request of its size is charged (``block_bytes``), not at the block it got.
    A large block is split only when more than 1 MiB would remain (``DeviceCachingAllocator::
    should_split``, c10/cuda/CUDACachingAllocator.cpp, PyTorch 2.1 to 2.13), so a request served from a
    cached block or a segment's tail up to 1 MiB larger takes all of it, and ``memory_allocated()``
    counts the block (``malloc``: ``allocated_bytes`` grows by ``block->size``): up to 1 MiB per tensor
    that depends on where it lands, which only the replay knows. The estimate's allocated peak charges
    gradients, states and activations at ``block_bytes`` of their own size (the weights at their load
    placement, ``allocator_rules.placed_bytes``, as the replay's load), so the gap the replay reports
    (reserved minus the net peak) carries that placement excess into the reserved estimate.

    Only a block that is one real tensor is netted (``alloc``'s ``one``): gradients, states, logits, the
    hand-written layers' saved tensors (``LayerCoefs.tensors``: each a tensor autograd saves). A block
    that stands for several smaller tensors (a derived layer's saved bytes summed by module and op,
    ``LayerCoefs.parts``; a backward moment's transient; autocast's weight copies as one block) has no
    placement of its own: each tensor it stands for lands where it fits, so its "excess" is an
    artefact of the sum and is counted as allocated, as before the netting (Qwen3-Next's point-derived
    layers, against trace: reserved +4.05% netting every block).
    """

    a: CachingAllocator = field(default_factory=CachingAllocator)
    # (phase label, step) -> (reserved bytes at its end, the replay's net allocated peak so far)
    marks: dict = field(default_factory=dict)
    # the net allocated and reserved peaks before the last ``empty_cache`` (DeepSpeed's ``defragment``): the
    # allocator's own peaks restart there, so that a phase's marks are those since the cache was emptied
    before: tuple = (0, 0)
    emptied: bool = False  # the cache was emptied since the last mark
    lag: "_Fsdp1Lag | None" = None   # FSDP1: frees awaiting other streams, released by its rate limiter
    carry: list = field(default_factory=list)  # a derived layer's late frees: (J, handle), ``_sequence_forward``
    bcarry: list = field(default_factory=list)  # a derived layer's backward tensors left to the next (``_recorded_backward``)
    layer: "_LayerCarry" = field(default_factory=lambda: _LayerCarry())  # what one layer's pass leaves the next
    loaded: bool = False   # the load is replayed (its blocks' placement is in the estimate's weights)
    excess: dict = field(default_factory=dict)  # handle -> bytes its block exceeds ``block_bytes`` of its request
    over: int = 0          # the sum of ``excess`` over the live blocks
    net_peak: int = 0      # the highest ``allocated - over`` since the cache was last emptied

    def mark(self, label: str, step: int) -> None:
        self.marks[(label, step)] = (self.a.reserved, self.net_peak, self.emptied)
        self.emptied = False
        self.loaded = self.loaded or label == "model_loaded"

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: the segments with no live block are released; the peaks so far
        are kept aside (``peaks``) and the allocator's restart from what is allocated now."""
        self.before = self.peaks()
        self.a.empty_cache()
        self.a.reset_peak()
        self.net_peak = self.a.allocated - self.over
        self.emptied = True

    def peaks(self) -> tuple[int, int]:
        """The net allocated and the reserved peaks of the whole replay."""
        return max(self.before[0], self.net_peak), max(self.before[1], self.a.peak_reserved)

    def alloc(self, nbytes: Any, stream: int = 0, one: bool = True, charge: int = 0) -> int | None:
        """A block of ``nbytes`` on ``stream``; ``one``: it is one real tensor, whose placement excess
        is netted out of the allocated peak (else several tensors' sum: not netted). ``charge``: the
        block the estimate's allocated peak charges this tensor (``block_bytes`` of its own bytes,
        ``States.trainables``' gradients and states), where ``nbytes`` is the tensor's own size: the
        block it gets is netted to ``charge`` either way, so the net peak counts it as the estimate
        does. Such a request may get less than its charge: a tensor of 31.25 MiB alone opens a 32 MiB
        segment whose 0.75 MiB remainder is not split, but from a larger cached free block it is cut
        to its 512-rounded size and the next tensor fits behind it (c10/cuda/CUDACachingAllocator.cpp,
        torch 2.1 to 2.13: ``get_allocation_size``'s ``return kRoundLarge * ((size + kRoundLarge - 1)
        / kRoundLarge);`` for a request of 10 MiB or more, ``should_split``'s ``return (size <
        CUDAAllocatorConfig::max_split_size()) && (remaining > kSmallSize);`` for the large pool,
        ``kSmallSize`` = 1 MiB; ``allocator_rules.block_bytes``)."""
        if nbytes <= 0:
            return None
        h = self.a.allocate(int(nbytes), stream=stream)
        if self.loaded and one and charge:   # netted to the charge, either way (the block may be smaller)
            extra = self.a.block_size(h) - charge
            if extra:
                self.excess[h] = extra
                self.over += extra
        elif self.loaded and one:  # the block beyond a fresh request's charge (bytes; 0 where it was split to size)
            extra = self.a.block_size(h) - block_bytes(int(nbytes), self.a.expandable_segments)
            if extra > 0:
                self.excess[h] = extra
                self.over += extra
        self.net_peak = max(self.net_peak, self.a.allocated - self.over)
        return h

    def allocs(self, sizes: Any, stream: int = 0, one: bool = True) -> list:
        return [self.alloc(x, stream, one) for x in sizes]

    def free(self, h: int | None) -> None:
        if h is not None:
            self.unlive(h)
            self.a.free(h)

    def unlive(self, h: int) -> None:
        """Forget the placement excess of ``h``'s block, which stops being allocated."""
        self.over -= self.excess.pop(h, 0)

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
    ao_events: tuple = ()                        # torchao: each trainable's compiled-step buffers (States)
    lomo: Any = None                             # LOMO: the gradient its next hook updates (handle, bytes, states)
    hook_frees: bool = False                     # DeepSpeed ZeRO-1/2: a hook copies each gradient away and frees it
    grad_rank_raw: tuple = ()                    # each trainable's gradient bytes on this rank, unrounded
    grad_shard_raw: tuple = ()                   # ... its shard's, where they accumulate unsharded (no_sync)
    forwards: int = 0                            # micro-batch forwards begun (DeepSpeed ZeRO-3 records its order in the first)
    ddp: Any = None                              # DDP: its first iteration's one bucket, until rebuilt (``_ddp_init``)
    ga: int = 1                                  # micro-batches per step
    recv: Any = None                             # torch's pipeline stage: its receive buffers, once made (``_batch_in``)
    sent: Any = None                             # ... a later 1F1B stage: the input gradient its send ops hold (``_sent_grad``)
    unsharded: dict = field(default_factory=dict)  # FSDP1 no_sync: each unit's (``where``) accumulated flat gradient

    def workspace(self, R: "_Replay", thread: int) -> None:
        """The cuBLAS workspace of the forward (0) or the autograd (1) thread, at its first matmul
        (kept: PyTorch caches one per handle and stream, ``CUDABlas.cpp`` ``getCUDABlasLtWorkspace``)."""
        if len(self.workspaces) == thread and self.handle_ws:
            self.workspaces.append(R.alloc(self.handle_ws))


def _replay_build(R: "_Replay", events: tuple) -> None:
    """The build's alloc/free events in order (``States.build``, quant4.torchtune_v01_build,
    states.zero3_whole_load): what they keep is the model, the segments of their transients stay
    cached unless an ``("e",)`` event empties the cache (DeepSpeed's ``defragment``)."""
    live: dict[int, Any] = {}
    for ev in events:
        if ev[0] == "a":
            live[ev[1]] = R.alloc(ev[2])
        elif ev[0] == "e":
            R.empty_cache()
        else:
            R.free(live.pop(ev[1]))


#: the side streams of PyTorch FSDP, and DeepSpeed ZeRO-3's all-gather stream (``partitioned_param_coordinator.py``
#: L400, L606: its fetches allocate under ``stream(__allgather_stream)``, ``parameter_offload.py`` L195-196
#: under ``overlap_comm``) as GATHER_STREAM (ids of the replay's allocator pools; 0 is the default stream)
GATHER_STREAM, GRAD_STREAM = 1, 2


@lru_cache(maxsize=256)
def _placed(trainables: tuple, where: tuple[str, ...]) -> tuple[int, ...]:
    """Indices of the trainable tensors placed at one of ``where``."""
    return tuple(j for j, item in enumerate(trainables) if item[0] in where)


def _scaled(sizes: list[int], total: int) -> list[int]:
    """``sizes`` scaled to sum to ``total`` (their proportions kept)."""
    whole = sum(sizes)
    return [x * total // whole for x in sizes] if whole > 0 and total > 0 else []
