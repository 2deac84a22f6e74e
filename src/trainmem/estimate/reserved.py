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
* each micro-batch: the input batch; forward: the base model's unsaved embedding output
  (``quantities.held_embeddings``, freed before the head), the embeddings' saved tensors, per layer
  FSDP's gathered parameters, the tensors autograd saves (``LayerCoefs.tensors``, one block each)
  with autocast's half copy of each linear's weight made between them where its linear runs
  (``LayerCoefs.linears``) and the fp32 input it casts and does not save alive until then
  (``LayerCoefs.linear_inputs``) or, under recomputation, the kept input with the layer's tensors made and
  freed again (under full recomputation with autocast one after another, the copies kept in
  autocast's cache until the loss: ``_checkpointed``); the head side's tensors (a masked LM's one by
  one, ``quantities.head_side_tensors``), the head's half copy, the logits,
  the loss's transient and saved tensors; backward: the loss
  gradients, the head's weight gradient (under autocast its half form first), a tied head's part,
  the untied head's and final norm's gradients, per layer (last first) the recomputed tensors, the
  largest backward transient (a derived layer whose derivation recorded its backward, without
  recomputation: that record's tensors, frees and gradients in order, ``_recorded_backward``), each
  linear's weight gradient as its backward makes it (under
  autocast: half gradient, copy freed, fp32 ``.grad``), the layer's other gradients, FSDP's
  unsharded gradients; the embeddings' gradients (a tied one: its own part and the sum);
* FSDP under SHARD_GRAD_OP (``--fsdp grad-op``): each layer gathered at its forward and kept gathered
  until its post-backward (``_layer_gather``); FSDP's sharded gradients: one flat reduce-scatter
  output per unit on its stream, made again and dropped where the gradients exist (``_flat_grads``);
  FSDP2 under bf16-mp: the flat bf16 all-gather input before each output (``_Fsdp.gather_output``);
  FSDP1's root flat gradient at the end of backward (``_root_reduce_input``), a tied head's
  out-of-place sum before it (and FSDP2's, the root resharded or not);
* FSDP1: each gathered flat parameter freed pending until the GPU passes its free, as far behind as
  FSDP1's rate limiter lets the GPU be (``_Fsdp1Lag``), and the backward prefetch of the layer below
  (the top layer's by the root's pre-backward hook, before the model's own loss's backward:
  ``_loss_gradient``);
  FSDP2 before PyTorch 2.5: each reduce-scatter input on the reduce-scatter stream, freed when the
  reduce returns (``_Fsdp.reduce``);
* DeepSpeed ZeRO-3: where the coordinator's replay applies (``quantities.deepspeed_gather_events``),
  every parameter gathered, every prefetch's flat output and the members built from it, and each
  release, in the replay's order around the compute, each gradient bucket's flat ``cat`` at the hook
  that reduces it (``_Zero3Replay``), and the untied head's whole weight gradient at its backward; elsewhere the embedding's table gathered on its all-gather stream
  at its forward and backward (kept between them once its module order is recorded), the layers'
  parameters gathered there one at a time in the first step and by the prefetch's flat outputs after
  it (``_Zero3Fetch``),
  each bucket's flat reduction input on its reduce stream, its step's float64 norm copies, flat fp32
  gradient and flat states (``_zero3_step``);
* DDP: its construction's broadcast copies and first bucket, its rebuilt buckets at the forward after
  the first reducing backward (``_ddp_init``, ``_ddp_rebuild``; under an interleaved pipeline schedule
  one DDP per virtual stage, ``_DdpStages``); torch's pipeline stage's receive buffers, made once
  (``recv_buffers``); a gradient added into an existing ``.grad`` as a tensor of its own (``_accumulated``);
* the optimizer step: the states of every trainable tensor at the first step, in parameter order
  (``torch.optim``'s lazy ``_init_group``), then the step's temporaries as per-tensor blocks;
  ``zero_grad(set_to_none=True)`` frees the gradients.

Two steps are replayed with up to two micro-batches each, as the moments are (``moments.py``). The
result is the reserved-minus-allocated gap at the end, added to the estimate's own allocated peak,
with the replay's allocated peak counted as the estimate counts it: each block allocated after the
load at ``block_bytes`` of its request, not at the unsplit block it got (``_Replay``: a large block
is split only when more than 1 MiB would remain, so a 1.125 MiB gradient landing in a 2 MiB tail
takes all of it, and ``memory_allocated`` counts that; the excess stays in the gap);
the replay is coarser than the moments (a backward transient is one block, Megatron's selective policy's kept tensors are scaled), so its
allocated peak is not the estimate's, but the segments it leaves behind are those of tensors of the
estimate's sizes in the step's order. With ``TrainingSpec.expandable_segments`` the simulator runs in
that mode (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: one segment per pool grown by mapping
pages, every block split to its request; ``trainmem.allocator``). Used for one layout at a time
(``estimate``); the layout arrays of the planner keep the 1/32 rule (``allocator_rules.reserved_overhead``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..allocator import CachingAllocator
from ..allocator_rules import SMALL_SIZE, block_bytes
from .layers import F32, HALF
from .moments import StepFlags, Tokens, _logit_sizes, best_transient, label_tokens
from .quantities import (HEAD_LOGITS, HEAD_LOSS, HEAD_NEXT, HEAD_NEXT2, HEAD_SAVED, PARTITION_BOTTOM, PARTITION_EMBEDDING,
                         PARTITION_TOP, Quantities)
from .schedules import FORWARD
from .states import parameter_order as _parameter_order


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


def reserved_gap(q: Quantities, flags: StepFlags, tk: Tokens, n: int, nsq: int, b: int, ga: int,
                 recompute: str, temp_copies: int | None, handle_ws: int = 0,
                 varying: list | None = None) -> tuple[int, dict]:
    """Bytes reserved but not allocated at the end of two replayed steps (the allocator's cache),
    and at the end of each phase, by (phase label, step) as ``breakdown.phases`` labels them, the
    replay's reserved bytes, its allocated peak so far (since the cache was last emptied) and whether
    the cache was emptied in the phase. ``varying`` (``--min-seq-len``): more
    steps replayed after those two, each a list of micro-batches as (Tokens, tokens, token x key
    pairs) at its own padded length, with its quantities first (``_varying_steps``)."""
    st = q.detail.states
    # the allocator in the run's mode: expandable segments map pages into one segment per pool and split
    # every block (``allocator.CachingAllocator(expandable_segments=True)``), the default cudaMallocs segments
    R = _Replay(CachingAllocator(expandable_segments=bool(q.expandable)),
                lag=_Fsdp1Lag() if _fsdp1_limited(q) else None)
    if st.build:                                                        # the model built on the device
        _replay_build(R, st.build)
    elif st.fsdp_init:                                                  # FSDP1's wrap of rank 0's CPU model,
        _replay_build(R, st.fsdp_init)                                  # unit by unit (fsdp_init); the loop's
        R.net_peak = R.a.allocated - R.over                             # allocated peak starts after it
    else:
        loaded = R.allocs(_fsdp1_load(q, st))                           # weights and buffers, load order
        if q.ds_flat_group:                                             # DeepSpeed ZeRO-1/2 (v0.19.0+): the flat
            R.alloc(q.ds_flat_group)                                    # group made beside the parameters, whose
            if q.ds_flat_frees:                                         # own blocks it frees (deepspeed_flat_on_gpu;
                R.frees(loaded)                                         # the buffers' blocks with them: small pool)
    if q.ds_fp32_convert or q.ds_fp32_group:                          # DeepSpeed ZeRO-3: flat fp32 masters
        _zero3_masters(R, q, st)
    elif q.ds_flat12:                                                   # DeepSpeed ZeRO-1/2: one flat master
        _zero12_master(R, q, st)
    elif st.master:                                                     # fp32 master copies (not offloaded)
        R.allocs(m for (_w, k, _g, _s, m) in st.trainables for _ in range(k) if m)
    if q.ds_bucket and not q.ds_backward_buf:                         # DeepSpeed ZeRO-3's bucket, from engine start
        R.alloc(q.ds_bucket)
    s = _Step(handle_ws=handle_ws, ao_events=st.torchao_events, hook_frees=bool(q.ds_hook_part),
              grad_rank_raw=st.grad_rank_raw, grad_shard_raw=st.grad_shard_raw)
    if q.ds_init_grads:                                                # ... its flat gradient partitions
        _zero3_flat_grads(R, s, q.ds_init_grads, st.trainables)
    if q.ds_offload_clone:                                             # DeepSpeed ZeRO-1/2 offloading (v0.18.3+): the
        R.free(R.alloc(q.ds_offload_clone))                            # partition's half clone, copied to the host
    if q.ds_offload_buf:                                               # DeepSpeed ZeRO-1/2 offloading: its GPU
        R.alloc(q.ds_offload_buf)                                      # gradient buffer, from engine init
    for sizes in st.gathered:                                          # DeepSpeed ZeRO-3's init gathers each
        R.frees(R.allocs(sizes))                                       # parameter in turn (states.ds_init_gathers)
    if flags.states_at_init and st.optimizer:                          # torch Adagrad: states from its constructor
        s.states = _allocate_states(R, st)
    if q.ddp_side:                                                     # DDP built on a side stream (Lightning)
        _ddp_side_stream(R, st)
    elif q.detail.comm_name == "communication.ddp_buckets" and flags.pipe_out != "interleaved":
        s.ddp = _ddp_init(R, st)                                       # DDP built on the default stream
    elif q.detail.comm_name == "communication.ddp_buckets":            # one DDP per virtual stage
        s.ddp = _DdpStages.init(R, st, q.pipe_stages, q.pipe_head_once > 0)   # (the last rank's or the first's)
    R.mark("model_loaded", 0)
    if flags.grads_persistent or q.grads_loaded:                        # Megatron main grads, DeepSpeed ZeRO-3's
        for _ in range(max((k for _w, k, *_r in st.trainables), default=0)):
            _make_grads(R, s, st.trainables, tuple({w for w, *_r in st.trainables}))
    for step in (1, 2):
        s.step = step
        _micro_batches(R, s, q, flags, tk, n, nsq, recompute, b, ga)
        _optimizer_step(R, s, q, flags, step, temp_copies)
    _varying_steps(R, s, q, flags, varying or [], recompute, b, temp_copies)
    peak_allocated, peak_reserved = R.peaks()
    return max(0, peak_reserved - peak_allocated), R.marks


#: the pool of the side stream Lightning's DDPStrategy builds DDP on (``_ddp_side_stream``)
DDP_INIT_STREAM = 3
#: ``DistributedDataParallel.broadcast_bucket_size`` (torch 2.13 ``nn/parallel/distributed.py`` L1020; 2.0 the same)
DDP_BROADCAST_BYTES = 250 * 1024 * 1024


def _fsdp1_load(q: Quantities, st: Any) -> tuple:
    """Bytes of the tensors the load leaves on the device, in order (``States.load``); under FSDP1 with
    its layers units of their own (``fsdp1_post``) each unit's stored shard is one tensor: the root's
    (the tensors before and after the layers, ``load_split``), then each layer's. ``FlatParamHandle``
    flattens a unit's parameters into one ``FlatParameter`` and keeps only this rank's chunk of it,
    ``_get_shard``'s ``chunk.clone()`` (torch 2.13 ``fsdp/_flat_param.py`` ``shard`` L945-975,
    ``_get_shard`` L1122-1139): the unit's shard elements once (its padding, under a rank's share of
    the alignment, not counted). Trace (Phi-3 cut to 2 layers, FSDP1 dp 4) makes a 62.63 MiB root
    shard and two 12.25 MiB layer shards where the per-tensor shards took two 32 MiB and two 20 MiB
    segments. The root's sum also holds the model's buffers loaded after the layers (rotary frequencies:
    a few hundred bytes), which stay tensors of their own. Left per tensor: LoRA adapters, embeddings or
    the head in units of their own, parameter offload (host shards), layers that differ."""
    nb, nl, na = st.load_split or (0, 0, 0)
    layers = st.load[nb:len(st.load) - na]
    if not (q.fsdp1_post > 0 and nl and len(layers) == nl * q.layers and not (
            q.fsdp1_adapter_units or q.fsdp1_emb_units or q.fsdp1_head_unit or q.fsdp1_host_shards)):
        return st.load
    root = sum(st.load[:nb]) + sum(st.load[len(st.load) - na:])    # (embeddings, final norm, head) shard
    return (root,) + tuple(sum(layers[i * nl:(i + 1) * nl]) for i in range(q.layers))   # each layer's


def _ddp_side_stream(R: _Replay, st: Any) -> None:
    """DDP built inside ``torch.cuda.stream(torch.cuda.Stream())`` (Lightning's DDPStrategy,
    ``wrappers.ddp``): its construction allocates on that stream, whose pool nothing else uses again
    (the caching allocator reuses a block only on the stream that allocated it, ``allocator.py``
    "Streams"), so those segments stay reserved and idle for the whole run. They are
    ``_sync_module_states``' broadcast of the weights and buffers (torch 2.13 ``distributed/utils.py``
    L289-327 -> comm.cpp ``broadcast_coalesced``: each chunk's flat copy, at most two in flight, the
    older freed before the next is made; ``flat_copies``) and the first iteration's one bucket of
    every gradient (``sys.maxsize`` bucket limit while ``find_unused_parameters`` is off,
    ``nn/parallel/distributed.py`` L128-162; 2.0's ``_ddp_init_helper`` the same), made after them on the
    same stream and freed when the second step's ``_pre_forward`` rebuilds the buckets on the default
    stream (reducer.cpp ``rebuild_buckets`` -> ``initialize_buckets``: ``buckets_.clear()`` first). The
    rebuilt buckets are the ``communication.ddp_buckets`` component, outside this replay."""
    live: list = []
    for nbytes in flat_copies(st.load, DDP_BROADCAST_BYTES):
        if len(live) == 2:                                                 # max_in_flight = 2 (comm.cpp)
            R.free(live.pop(0))
        live.append(R.alloc(nbytes, DDP_INIT_STREAM))
    R.frees(live)
    R.free(R.alloc(st.grads, DDP_INIT_STREAM))                            # the first iteration's bucket


#: DDP's bucket limits once rebuilt: ``dist._DEFAULT_FIRST_BUCKET_BYTES`` for the first bucket, then
#: ``bucket_cap_mb`` (default 25; torch 2.13 ``nn/parallel/distributed.py``; reducer.cpp ``rebuild_buckets``)
DDP_FIRST_BUCKET, DDP_BUCKET_CAP = 1024 * 1024, 25 * 1024 * 1024


def flat_copies(sizes: Any, cap: int) -> list[int]:
    """Bytes of the flat copies ``dist._broadcast_coalesced`` makes of tensors of ``sizes`` bytes (in
    order), without the buckets of a single tensor: ``compute_bucket_assignment_by_size`` fills a
    bucket until it holds at least ``cap`` bytes and then starts the next (reducer.cpp; the tensors are
    of one dtype here: the weights and buffers in their load order), and comm.cpp's
    ``BroadcastWork`` flattens each bucket with ``torch::utils::flatten_dense_tensors``, which returns
    ``tensors[0].contiguous().view({-1})`` for one tensor (torch/csrc/utils/tensor_flatten.h) and
    ``at::cat`` of them otherwise, so only a bucket of several tensors is a new tensor. Trace's
    allocator log of DDP on Llama (2 layers, h 2048) shows no copy of the 250 MiB embedding that
    fills the first bucket alone, then the 257 and 379 MiB flat copies of the rest."""
    out, cur, n = [], 0, 0
    for x in sizes:
        cur, n = cur + int(x), n + 1
        if cur >= cap:
            out += [cur] if n > 1 else []
            cur, n = 0, 0
    return out + ([cur] if n > 1 else [])


def ddp_buckets(sizes: Any, limits: tuple[int, int] = (DDP_FIRST_BUCKET, DDP_BUCKET_CAP)) -> list[int]:
    """Bytes of DDP's rebuilt gradient buckets for gradients of ``sizes`` bytes in the order autograd
    made them: reducer.cpp ``compute_bucket_assignment_by_size`` closes a bucket once it holds at least
    its limit (the first ``limits[0]``, every later one ``limits[1]``), and ``initialize_buckets`` gives
    each its own flat tensor (``gradient_as_bucket_view`` off: a copy of every gradient)."""
    out, cur, limit = [], 0, limits[0]
    for x in sizes:
        cur += int(x)
        if cur >= limit:
            out.append(cur)
            cur, limit = 0, limits[1]
    return out + ([cur] if cur else [])


def _ddp_init(R: _Replay, st: Any) -> int | None:
    """``DistributedDataParallel(model)`` on the default stream: ``_sync_module_states``' broadcast of
    the weights and buffers (each flat copy of several tensors, at most two in flight, the older freed
    before the next is made: torch 2.13 ``distributed/utils.py`` L289-327 -> comm.cpp
    ``broadcast_coalesced``; ``flat_copies``), then the first iteration's one bucket of every gradient
    (``bucket_size_limits = [sys.maxsize]`` while ``find_unused_parameters`` is off,
    ``nn/parallel/distributed.py`` ``_ddp_init_helper``), returned: it lives until the buckets are
    rebuilt (``_ddp_rebuild``). Their segments stay reserved and are the load's: trace of Llama
    (2 layers, h 2048) 2 x 512 DDP over 2 ranks reserves 2420 MiB at load for 1778 MiB allocated, where
    the replay had 1786 MiB (peak reserved -1.44%). The estimate's allocated memory counts the buckets
    (``communication.ddp_buckets``) from the load on; the replay now holds them too. Under an
    interleaved pipeline schedule the rank wraps each of its virtual stages in a DDP of its own (each
    stage's copies and bucket apart: trace's 221.5 and 96.5 MiB segments on a 4-layer Llama):
    ``_DdpStages``."""
    live: list = []
    for nbytes in flat_copies(st.load, DDP_BROADCAST_BYTES):
        if len(live) == 2:                                                 # max_in_flight = 2 (comm.cpp)
            R.free(live.pop(0))
        live.append(R.alloc(nbytes))
    R.frees(live)
    return R.alloc(st.grads)


def _ddp_rebuild(R: _Replay, s: _Step, st: Any) -> None:
    """DDP's ``_pre_forward`` after the first backward that reduced (every micro-batch's outside a
    pipeline; under torch's pipeline schedules only the last micro-batch's runs outside ``no_sync``
    (``distributed/pipelining/stage.py`` ``backward_maybe_with_nosync``), so the next step's first
    forward): ``rebuild_buckets`` -> ``initialize_buckets`` clears the first iteration's bucket, then
    makes one flat tensor per bucket in the order the gradients were ready (``ddp_buckets`` over the
    gradients in reverse parameter order: the head's first, the embedding's last), kept for the run.
    Trace: 250, 43.01, 43, 43, 32.01, 32, ... 250.01 MiB on that Llama."""
    R.free(s.ddp)
    s.ddp = None
    grads = [st.trainables[j][2] for j in _parameter_order(st.trainables)]
    R.allocs(ddp_buckets(grads[::-1]))


def stage_loads(st: Any, v: int, last: bool = False) -> list[tuple[int, ...]] | None:
    """``States.load`` cut into a pipeline rank's ``v`` virtual stages, in the order the rank holds them
    (``wrappers.PipelineRankModule``: stage r, r + pp, ...): the rank's layers dealt out evenly, the
    tensors before the layers with its first stage (the first rank's embedding), those after them with
    its last (the last rank's final norm and head). On the ``last`` rank the tensors the states list
    before the layers are a tied head's table (``States.load`` lists it as the embedding's), which its
    last stage registers after its layers and norm (``lm_head``): they go there, last. None where
    ``load_split`` does not describe ``load`` (layers that differ)."""
    if not st.load_split or v < 1:
        return None
    nb, nl, na = st.load_split
    k = (len(st.load) - nb - na) // nl if nl else 0
    if not nl or k % v or nb + nl * k + na != len(st.load):
        return None
    per = k // v * nl                                                      # one stage's layers' tensors
    body = st.load[nb:nb + nl * k]
    out = [tuple(body[u * per:(u + 1) * per]) for u in range(v)]
    out[-1] = out[-1] + tuple(st.load[nb + nl * k:])
    if last:
        out[-1] = out[-1] + tuple(st.load[:nb])
    else:
        out[0] = tuple(st.load[:nb]) + out[0]
    return out


def stage_grads(trainables: tuple, v: int, last: bool = False, raw: tuple = ()) -> list[list[int]]:
    """Gradient bytes of each of a pipeline rank's ``v`` virtual stages, each in ``model.parameters()``
    order (``states.parameter_order``): the trainables before the layers with the first stage (on the
    ``last`` rank: a tied head's, with the last stage after the rest, as ``stage_loads``), each
    layer's with the stage holding that layer (the rank's layers dealt out evenly), those after the
    layers with the last stage. ``raw``: each trainable's gradient bytes unrounded (``States.grad_raw``,
    what a flat bucket holds), used where given."""
    if len(raw) == len(trainables):
        trainables = tuple((w, k, g, *r) for (w, k, _g, *r), g in zip(trainables, raw))
    layers = max((k for w, k, *_r in trainables if w == "layer"), default=0)
    layers = max([layers] + [int(w[5:]) + 1 for w, *_r in trainables if w.startswith("layer") and w != "layer"])
    per = max(1, layers // v)
    out: list[list[int]] = [[] for _ in range(v)]
    before = [g for w, _k, g, *_r in trainables if w == "before"]
    out[0] += [] if last else before
    for i in range(layers):
        u = min(v - 1, i // per)
        out[u] += [g for w, k, g, *_r in trainables if w == "layer" and i < k]
        out[u] += [g for w, _k, g, *_r in trainables if w == f"layer{i}"]
    out[-1] += [g for w, _k, g, *_r in trainables if w == "after"] + (before if last else [])
    return out


@dataclass
class _DdpStages:
    """An interleaved pipeline rank's DDP modules, one per virtual stage (trace wraps each stage of
    ``PipelineRankModule.stages`` in its own ``DistributedDataParallel``, ``trace/distributed.py``
    ``wrap_loaded``; torchtitan's ``parallelize_llama`` applies data parallelism to each model part
    alike): each has its own reducer, so its own ``_sync_module_states`` broadcast copies and first
    iteration's bucket at construction (``_ddp_init``, over that stage's tensors only), and rebuilds
    its own buckets at its own first forward after a reducing backward (``_ddp_rebuild``; under
    torch's schedules the last micro-batch's backward, ``stage.py`` ``backward_maybe_with_nosync``,
    so at the next step's first forward of that stage). Trace of a 4-layer Llama-3.2 over pp 2 x dp 2,
    last rank: stage 1's 232.02 MiB copy and bucket, then stage 3's 1234.02 MiB (its layer, final norm
    and tied head) copy and bucket; at step 2 each stage's rebuilt buckets at its first forward."""

    first: list          # each stage's first-iteration bucket (handle), None once rebuilt
    grads: list          # each stage's gradient bytes in parameter order

    @classmethod
    def init(cls, R: _Replay, st: Any, v: int, last: bool) -> "_DdpStages | None":
        loads = stage_loads(st, v, last)
        if loads is None:
            return None
        grads = stage_grads(st.trainables, v, last, st.grad_raw)
        first = []
        for load, g in zip(loads, grads):                                  # DDP(stage) in the rank's order
            live: list = []
            for nbytes in flat_copies(load, DDP_BROADCAST_BYTES):
                if len(live) == 2:                                         # max_in_flight = 2 (comm.cpp)
                    R.free(live.pop(0))
                live.append(R.alloc(nbytes))
            R.frees(live)
            first.append(R.alloc(sum(g)))                                  # one bucket of the stage's gradients
        return cls(first, grads)

    def rebuild(self, R: _Replay, stage: int | None) -> None:
        """Stage ``stage``'s ``_pre_forward`` rebuild (None: every stage's not yet rebuilt, the rank's
        forward replayed as one): its first bucket freed, then its rebuilt buckets (``ddp_buckets``
        over its gradients in reverse parameter order)."""
        for u in range(len(self.first)) if stage is None else (stage,):
            if self.first[u] is None:
                continue
            R.free(self.first[u])
            self.first[u] = None
            R.allocs(ddp_buckets(self.grads[u][::-1]))


def _zero3_masters(R: _Replay, q: Quantities, st: Any) -> None:
    """DeepSpeed ZeRO-3's fp32 master partitions as ``_create_fp32_partitions`` makes them: per
    sub-group, in order, an fp32 copy of the half flat partition (a half engine's; an fp32 engine's flat
    partition is its own fp32 copy, ``quantities.deepspeed_fp32_group``) and its ``clone()`` (the
    master, one flat tensor), the copy freed when the next sub-group's replaces it and the last at
    the end (``quantities.deepspeed_fp32_convert``). The sub-groups hold at most the largest's
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
    """DeepSpeed ZeRO-1/2's fp32 master of this rank's partition (``quantities.deepspeed_flat12``), one
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


def _tied_embedding_sum(R: _Replay, s: "_Step", q: Quantities, flags: StepFlags, tied: int | None) -> None:
    """A tied embedding's backward outside FSDP: its own gradient, then autograd's InputBuffer adds it to
    the head's (``tied``) out of place, the sum is ``.grad`` (``quantities.tied_head_grad``). Under
    DeepSpeed ZeRO-3 the sum is a new tensor, copied to its bucket; where ZeRO-1/2's hooks reduce
    (``quantities.deepspeed_hook_partition``) the sum, larger than a bucket, waits for the epilogue's
    reduction (``_zero12_epilogue``; ``extra_large_param_to_reduce``, v0.19.8 ``stage_1_and_2.py``
    L1444-1449). Returns None (the head's part is freed)."""
    trainables = q.detail.states.trainables
    whole = R.alloc(q.tied_replicated)                  # DTensor TP: the whole table first (tied_replicated_grad)
    emb_out = R.alloc(q.tied_grad)                      # then this rank's rows
    added = _accumulated(R, s, trainables, ("before",))  # the sum added into an existing .grad: a temporary
    if q.ds_keeps_sum:                                  # ZeRO-2, no contiguous gradients: the sum is rank 0's
        _sum_as_embedding_grad(s, trainables)           # .grad, whole, not its partition's share
    _make_grads(R, s, trainables, ("before",), flags.oib)
    acc = R.alloc(q.tied_grad) if q.ds_init_grads or q.ds_hook_part or q.ds_keeps_sum else None
    if q.ds_hook_part or (q.ds_keeps_sum and ("embedding_sum", 0) not in s.grads):  # (kept: a later micro-
        s.grads[("embedding_sum", 0)], acc = acc, None  # batch's sum is added into it in place and freed)
    R.frees([tied, emb_out, acc] + added + [whole])
    return None


def _sum_as_embedding_grad(s: "_Step", trainables: tuple) -> None:
    """Mark the word embedding's gradient (the largest trainable placed before the layers) as made, so
    that the tied sum kept whole stands for it (``quantities.deepspeed_keeps_tied_sum``)."""
    before = [j for j in _placed(trainables, ("before",)) if (j, 0) not in s.grads]
    if before:
        s.grads[(max(before, key=lambda j: trainables[j][2]), 0)] = None


def _zero12_at(R: _Replay, s: "_Step", q: Quantities, layer: int | None) -> None:
    """DeepSpeed ZeRO-1/2's ``grads_in_partition`` made by a hook at the backward moment
    ``quantities.deepspeed_partition_from`` finds (``ds_hook_at``): the top layer's, the bottom layer's
    (``layer`` its index) or, ``layer`` None, before the word embedding's."""
    at = {PARTITION_EMBEDDING} if layer is None else \
        ({PARTITION_TOP} if layer == q.layers - 1 else set()) | ({PARTITION_BOTTOM} if layer == 0 else set())
    if q.ds_hook_part and q.ds_hook_at in at:
        _zero12_partition(R, s, q)


def _zero12_epilogue(R: _Replay, s: "_Step", q: Quantities, suffix: str) -> None:
    """DeepSpeed ZeRO-1/2's backward epilogue at the accumulation boundary (not after the first of two
    micro-batches, ``suffix``) where it makes rank 0's ``grads_in_partition``
    (``quantities.deepspeed_epilogue_partition``; ``deepspeed_hook_partition`` where no hook in backward
    did): the buffer first, then every parameter's own gradient freed (copied into it or into the bucket
    buffers, and ``.grad`` cleared); the buffer stands for the gradients until the step drops it after
    its fp32 cast (``_zero12_step``)."""
    if not (q.ds_epilogue_part or q.ds_hook_part) or suffix == ".micro1":
        return
    stream = GRAD_STREAM if q.ds_reduce_side else 0               # the last bucket's reduction: its flat
    R.frees([R.alloc(n, stream) for n in q.ds_epilogue_cats])     # copies (quantities.deepspeed_epilogue_cats)
    _zero12_partition(R, s, q)
    part = s.grads.pop(("grads_in_partition", 0))
    R.frees(list(s.grads.values()))
    s.grads = {("grads_in_partition", 0): part}         # (``s.made`` kept: no gradient is made again)


def _zero12_partition(R: _Replay, s: "_Step", q: Quantities) -> None:
    """DeepSpeed ZeRO-1/2's ``grads_in_partition`` (whole parameters overlapping rank 0's partition, the
    gradient dtype), made once per step by the first copy into it (``copy_grads_in_partition``), on the
    reduction stream under ``overlap_comm`` (``quantities.deepspeed_hook_partition``)."""
    if q.ds_hook_part or q.ds_epilogue_part:
        if ("grads_in_partition", 0) not in s.grads:
            stream = GRAD_STREAM if q.ds_reduce_side else 0
            s.grads[("grads_in_partition", 0)] = R.alloc(q.ds_hook_part or q.ds_epilogue_part, stream)


def _zero12_step(R: _Replay, s: "_Step", q: Quantities, st: Any, first: bool) -> None:
    """DeepSpeed ZeRO-1/2's ``step`` on the GPU for one flat group (v0.19.8 ``stage_1_and_2.py``
    L3106-3139; v0.14.2 L1870-1905): the partition's gradients flattened (``ds_step_flat``, gradient
    dtype; none where rank 0's partition is one piece, ``quantities.deepspeed_partition_one_piece``) and
    cast to the fp32 partition's dtype (``ds_step_fp32``, L3118), the flat copy freed, and the parameters'
    gradients dropped (``free_grad_in_param_list``: those outside the partition before the flatten, L3100,
    those in it after the cast, L3128; both here after the cast); then ``_optimizer_step`` runs the
    torch optimizer on the one flat fp32 parameter, whose states are made there at the first step (``first``), lazily, as ``zeros_like`` of it: one flat block per state kind
    after the fp32 gradient, not per tensor at the step's start (trace, 2-layer Qwen3 ZeRO-2 over 4
    ranks). Its temporaries are each of the flat partition's size (for-loop Adam's ``sqrt`` and quotient,
    foreach's one per tensor: ``quantities.step_temporaries``), separate blocks; then the fp32 gradient
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


def _zero3_step(R: _Replay, s: "_Step", q: Quantities, order: list, first: bool) -> None:
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
    a per-layer item once per layer, so its copies are not counted again here)."""
    for tr in order:                                            # the norm: (partition,) float64, one by one
        elems = tr[2] // q.ds_norm_fp64 if q.ds_norm_fp64 else 0
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
        fp32 = R.alloc(q.ds_step_fp32 * n // largest)
        R.free(flat)
        if first:                                                # the states: zeros_like(fp32 partition)
            s.states += [R.alloc(sizes[j]) for sizes in per_kind if j < len(sizes)]
        R.free(R.alloc((q.step_temp - q.ds_step_fp32 - q.ds_step_flat) * n // largest, one=False))  # the optimizer's
        R.free(fp32)


def _cut(total: int, largest: int) -> list[int]:
    """``total`` elements in pieces of ``largest``, the last the rest."""
    return [min(largest, total - i) for i in range(0, total, largest)] if total > 0 else []

def _zero3_flat_grads(R: _Replay, s: "_Step", nbytes: int, trainables: tuple) -> None:
    """DeepSpeed ZeRO-3's gradient partition buffer (``quantities.deepspeed_init_grads``): one block,
    made in the optimizer's ``__init__`` before its gathers; every trainable tensor's gradient is a
    view of it (made: ``_make_grads`` allocates none, ``zero_grad`` frees none)."""
    R.alloc(nbytes)
    for j, (_w, k, *_r) in enumerate(trainables):
        s.made[j] = k
        s.grads.update({(j, c): None for c in range(k)})


def _zero3_sub_groups(q: Quantities) -> list[int]:
    """Elements of each of DeepSpeed ZeRO-3's flat fp32 partitions on this rank, in order: the largest
    sub-group's (``quantities.deepspeed_group_elems``, block-rounded) each, the last the rest of the
    rank's partition (``quantities.deepspeed_partition_elems``)."""
    largest, left = q.ds_fp32_convert // 4 or q.ds_fp32_group, q.ds_partition
    out = []
    while largest > 0 and left > 0:
        out.append(min(left, largest))
        left -= out[-1]
    return out


def _varying_steps(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, steps: list, recompute: str, b: int,
                   temp_copies: int | None) -> None:
    """``--min-seq-len``: steps after the first two whose micro-batches are padded to lengths that
    change every micro-batch, each micro-batch's forward and backward at its own sizes (one stage,
    one micro-batch in flight: ``TrainingSpec`` refuses the option under a pipeline), then the
    optimizer step. Each length's tensors are requests of another size, so the blocks an earlier,
    longer micro-batch left cached are split by a shorter one (``get_free_block`` best fit,
    ``shouldSplit``) and a later longer one may need a fresh segment: reserved memory grows."""
    for k, micro in enumerate(steps):
        s.step = 3 + k
        for ql, tk, n, nsq in micro:   # the quantities at that length (a derived model's may differ)
            parts = _layer_parts(ql, n, nsq)
            full = label_tokens(ql, n) * ql.logit_width // ql.tp if flags.lm else b * ql.logit_width
            f = _forward(R, s, ql, flags, tk, parts, recompute, full, ".varying", b)
            _backward(R, s, ql, flags, tk, f, parts, n, nsq, recompute, ".varying")
        _optimizer_step(R, s, q, flags, s.step, temp_copies)


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
    (``quantities._eager_loss_bytes``; trace's op stream: ``_log_softmax`` then ``_to_copy``)."""
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


class _Parts(list):
    """Bytes of each tensor one layer saves for backward, in order; ``forward_only``: those it makes
    and frees in its forward (``LayerCoefs.fwd_free``). ``whole``: each is one tensor (else a derived
    layer's saved bytes by module and op, several tensors each: ``_layer_parts``)."""

    inputs: list = []   # per linear: (bytes of the input it reads unsaved, shared with the next) (``LayerCoefs.linear_inputs``)
    nograd_op: tuple = ()   # of ``nograd``, the temporaries torchtitan's per-op policy keeps (``LayerCoefs.nograd_op``)

    def __init__(self, saved: Any, forward_only: list[int], op: list[int] | None = None,
                 temps: list[int] | None = None, events: tuple[str, ...] = (),
                 nograd: list[int] | None = None, nograd_events: tuple[str, ...] = (), whole: bool = True,
                 bwd: "_BackwardRecord | None" = None, attn: tuple = (-1, [], ())) -> None:
        super().__init__(saved)
        self.attn = attn          # eager attention's forward temporaries (at, bytes, events): ``_attn_allocs``
        self.bwd = bwd            # a derived layer's recorded backward (``_recorded_backward``)
        self.whole = whole
        self.forward_only = forward_only
        self.op = op or []     # the op outputs torchtitan's per-op policy keeps (``LayerCoefs.op_tensors``)
        self.temps = temps or []  # a derived layer's forward temporaries (``LayerCoefs.fwd_temps``)
        self.events = events      # ... and the order of its forward (``LayerCoefs.fwd_events``)
        # a hand-written layer's checkpointed first forward (``LayerCoefs.nograd_temps``, ``nograd_events``)
        self.nograd = nograd or []
        self.nograd_events = nograd_events


def _layer_parts(q: Quantities, n: int, nsq: int) -> _Parts:
    """Bytes of each tensor one layer saves for backward, in the order it saves them
    (``LayerCoefs.tensors``: the hand-written recipes' saved tensors, a derived layer's where its
    derivation recorded them one by one, ``trace.derive._layer_sequence``). Else a derived layer's named
    parts, one block each: the saved bytes of a module and op summed over its tensors (and averaged
    over the layer kinds of a model that mixes them, ``derived.layer_coefs``), so not ``whole``."""
    lc = q.detail.layer
    p = _Parts((int(a * n + b * nsq) for a, b in (lc.tensors or [(a, b) for _name, a, b in lc.parts])),
                  [int(a * n + b * nsq) for a, b in lc.fwd_free],
                  [int(a * n + b * nsq) for a, b in lc.op_tensors],
                  [int(a * n + b * nsq) for a, b in lc.fwd_temps], lc.fwd_events,
                  [int(a * n + c) for a, c in zip(lc.nograd_temps, lc.nograd_const or [0.0] * len(lc.nograd_temps))],
                  lc.nograd_events, whole=bool(lc.tensors), bwd=_backward_record(lc, n, nsq),
                  attn=(lc.attn_at if lc.tensors else -1, [int(a * n + b * nsq) for a, b in lc.attn_temps],
                        lc.attn_events))
    p.inputs = [(int(a * n + b * nsq), shared) for a, b, shared in lc.linear_inputs]   # (``_saved_and_casts``)
    p.nograd_op = tuple(lc.nograd_op)                             # (``_op_forward``)
    return p


@dataclass
class _BackwardRecord:
    """A derived layer's backward as its derivation recorded it (``LayerCoefs.bwd_events``,
    ``trace.derive._layer_backward_sequence``), at one setup's sizes: the bytes of each tensor it makes,
    of those the layer above leaves to it, of each parameter gradient, the events, and which of its
    tensors it leaves to the layer below."""

    temps: list
    ins: list
    grads: tuple
    events: tuple
    out: tuple


def _backward_record(lc: Any, n: int, nsq: int) -> "_BackwardRecord | None":
    """``LayerCoefs``' recorded backward at ``n`` tokens and ``nsq`` tokens x keys: each tensor's bytes from
    its terms (``trace.derive.BACKWARD_TERMS``: per token n = b*s, per position s = nsq / n, per token x key,
    constant, per sample b = n / s, per position pair s^2); None where the coefficients lack one."""
    if not lc.bwd_events or n <= 0:
        return None
    s = nsq / n
    basis = (n, s, nsq, 1.0, n / s if s else 0.0, s * s)

    def sizes(coefs: tuple) -> list:
        return [max(0, round(sum(c * x for c, x in zip(cs, basis)))) for cs in coefs]
    return _BackwardRecord(sizes(lc.bwd_temps), sizes(lc.bwd_ins), lc.bwd_grads, lc.bwd_events, lc.bwd_out)


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
    gathered: Any = None                         # ZeRO-3: the embedding's table kept gathered since its forward
    shifted: int = 0                             # logit elements of the shifted logits (``_fp32_logits_forward``)
    z3: "_Zero3Fetch | None" = None              # ZeRO-3: the layers' gathered parameters (``_Zero3Fetch``)
    capped: list = field(default_factory=list)   # a soft-capped head's saved tanh outputs (``_softcapped_logits``)


def _forward(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, parts: list[int],
             recompute: str, full: int, suffix: str, seqs: int = 1, head: bool = True,
             stage: int | None = None) -> _Forward:
    """One micro-batch's forward, the loss included (``seqs``: its sequences, read by ``--trainer dpo``'s
    moments after the loss, ``_dpo_after_logps``); ``head`` False: a pipeline stage without the head
    (an interleaved schedule's other stages, ``_pipeline_pairs``): its layers and output only; ``stage``:
    the rank's virtual stage run (``_pipeline_pairs``; None: all of them, or no interleaved schedule)."""
    st = q.detail.states
    inputs = _batch_in(R, s, q, tk)
    if isinstance(s.ddp, _DdpStages) and s.step > 1:              # an interleaved rank's stage's DDP
        s.ddp.rebuild(R, stage)
    elif s.ddp is not None and (s.step > 1 or (s.forwards and not flags.pipe_out)):
        _ddp_rebuild(R, s, st)                                    # DDP's _pre_forward rebuilds its buckets
    fs = _Fsdp(q.fsdp_ag_result > 0, _fsdp_streams(q), lag=R.lag, rs_side=q.fsdp_rs_side > 0,
               adapters=q.fsdp1_adapter_units, recomputed=recompute != "none", host=q.fsdp1_host_shards,
               grad_op=q.gathered_layer > 0, cast_shards=q.fsdp2_cast_shards, mp_shards=q.fsdp1_mp_shards,
               no_sync=_fsdp1_no_sync(q, suffix))
    root = fs.unshard(R, q.fsdp_root, st.root_tensors, raw=q.fsdp1_root_raw)  # FSDP: the root unit gathered
    # torchtitan's split root (quantities.fsdp2_split_root): the embedding unit gathered, resharded
    # by its post-forward (its all-gather output kept until the first layer's copy-out)
    fs.reshard(R, fs.unshard(R, q.fsdp_emb_unit, _emb_unit_tensors(st)))
    # ZeRO-3: the embedding's table gathered on the all-gather stream (``_zero3_gathered``); once the
    # module order is recorded it may stay gathered until its backward (quantities.deepspeed_embedding_kept)
    s.forwards += 1
    z3 = _Zero3Replay(R, q, recorded=s.forwards > 1) if q.ds_events else None   # the root's, the embedding's fetches
    gathered = R.alloc(q.ds_gathered_emb, GATHER_STREAM * q.ds_streams) if z3 is None else None
    embeds = R.alloc(int(q.embeds_tok * tk.tokens))              # the base model's inputs_embeds, unsaved
    if not (q.ds_emb_kept and s.forwards > 1):                   # released after the embedding's forward
        R.free(gathered)
        gathered = None
    emb = R.alloc(tk.outer_rest, one=False)                       # embeddings' saved tensors, one block
    cached: list = []                                             # autocast's weight cache (checkpointed layers)
    z3 = z3 or _Zero3Fetch(R, q, recorded=s.forwards > 1)        # ZeRO-3: the layers' gathers (the embedding's
    kept = []                                                     # fetch starts the first layer's prefetch)
    for i in range(q.layers):
        z3.forward(R, i)
        kept.append(_layer_forward(R, q, fs, parts, tk, recompute, keep=(i == q.layers - 1 and q.fsdp_last_kept > 0),
                                   cached=cached, s=s))
    s.workspace(R, 0)                                             # no layer here: the head's matmul
    R.frees([h for at, h in R.carry if at != LATE])               # the top layer's late frees (a derived layer)
    R.carry = [(at, h) for at, h in R.carry if at == LATE]
    if not head:
        return _stage_output(R, s, q, tk, _Forward(inputs, fs, root, emb, kept, [], [], [], 0, 1, gathered, 0, z3),
                             cached, suffix)
    z3.forward_end(R)                                             # ZeRO-3: the final norm's and the head's fetches
    # a chunked loss: one tensor per chunk, at most one chunk per token (more are not made: setup_warnings)
    chunks = max(1, min(int(q.logit_chunks), int(tk.tokens))) if q.liger_factor == 0 else 1
    root = root + fs.unshard(R, q.fsdp_head_unit, st.head_unit_tensors)  # split root: [norm, head] kept
    capped = _softcap_bytes(q, tk, full, chunks)                  # a soft-capped head's tanh outputs, apart
    head, late, body = _head_side(R, q, tk, capped)               # the final norm's tensors, the head's input
    R.free(embeds)                                                # the base model returns (held_embeddings)
    head.append(R.alloc(q.cast_head))                             # autocast's half copy of the head
    out, saved_tanh = _softcapped_logits(R, q, tk, full, chunks) if capped else (
        _logit_allocs(R, _logit_tensors(tk.out_logits, q.logits_out, full, chunks)), [])  # (b, s, vocab) logits
    R.frees(late)                                                 # the head's input, once its matmul has run
    if isinstance(z3, _Zero3Replay):                              # ZeRO-3: the head's module has returned, its
        z3.settle(R)                                              # post-forward hook releases before the loss
    if q.logits_cast:  # --cast-output: Fabric's fp32 copies, made while the half output is alive
        cast = _logit_allocs(R, _logit_tensors(tk.cast_logits, q.logits_cast, full, chunks))
        R.frees(out)
        out = cast
    if q.cast_stage_only:                                         # a pipeline's last stage: its forward's autocast
        cached = R.frees(cached) or []                            # region closes before the loss (Quantities.cast_stage_only)
    R.frees(s.held)                                               # the previous step's output, replaced
    s.held = []
    fwd, saved, out = _loss_forward(R, q, tk, flags, out, full, chunks, seqs, sum(map(R.a.block_size, body)))
    fwd += body                                                   # the body's output, held until the loss returns
    if q.dpo_metrics:                                             # DPOTrainer's reference forward and metrics
        _dpo_after_logps(R, q, full, seqs)
    R.frees([h for _at, h in R.carry])                            # derived layers' tensors the loss frees
    R.carry = []
    R.frees(fwd)
    R.frees(cached)                                               # autocast exits: its cache cleared
    if flags.hold == "loss" and not flags.pipe_out:               # (a pipeline stage's fwd_cache keeps it:
        R.frees(out)                                              # moments.pipeline_output)
        out = []
    root = _forward_end(R, s, q, fs, root, suffix)
    return _Forward(inputs, fs, root, emb, kept, head, out, saved, full, chunks, gathered, _shifted(q, full, seqs), z3,
                    saved_tanh)


def _head_side(R: _Replay, q: Quantities, tk: Tokens, capped: int = 0) -> tuple[list, list, list]:
    """The head side's saved tensors (``tk.outer_head`` bytes) and, apart, those freed once the logits
    are made and those the model's forward holds until its loss returns. One block each where the
    estimate knows them one by one (``quantities.head_side_tensors``: a masked LM's transform and
    decoder input, with autocast's forward-only copies; a causal LM's final norm and head input,
    ``quantities.causal_lm_head_tensors``), what is left of ``tk.outer_head`` beside the saved ones as
    one more; else one block (several tensors). ``capped``: bytes of a soft-capped head's tanh outputs
    among ``tk.outer_head``, made with the logits (``_softcapped_logits``), not here."""
    sizes = [(int(x * tk.tokens), held) for x, held in q.head_side]
    rest = int(tk.outer_head) - capped - sum(x for x, held in sizes if held == HEAD_SAVED)
    if not sizes or rest < 0:
        return [R.alloc(int(tk.outer_head) - capped, one=False)], [], []
    lists: dict[int, list] = {HEAD_SAVED: [], HEAD_LOGITS: [], HEAD_LOSS: []}
    temps: list = []                                              # [handle, tensors made before it is freed]
    for nbytes, held in sizes:
        h = R.alloc(nbytes)
        for temp in temps:
            temp[1] -= 1
        R.frees([temp[0] for temp in temps if temp[1] == 0])
        temps = [temp for temp in temps if temp[1] > 0]
        if held in (HEAD_NEXT, HEAD_NEXT2):
            temps.append([h, 1 if held == HEAD_NEXT else 2])
        lists.get(held, []).append(h)
    R.frees([temp[0] for temp in temps])
    return lists[HEAD_SAVED] + [R.alloc(rest, one=False)], lists[HEAD_LOGITS], lists[HEAD_LOSS]


def _softcap_bytes(q: Quantities, tk: Tokens, full: int, chunks: int) -> int:
    """Bytes of a soft-capped head's saved tanh outputs (``quantities.softcap_saved`` per logit element,
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


def _forward_end(R: _Replay, s: _Step, q: Quantities, fs: "_Fsdp", root: list, suffix: str) -> list:
    """A forward's return: FSDP2's root resharded and its last all-gather output freed; the phase
    marked. Returns the root's handles still held."""
    if _root_resharded(q, fs):                                    # FSDP2 reshards the root after its forward
        R.frees(root)
        root = []
    if fs.v2:                                                     # ... and frees the last all-gather output
        R.free(fs.ag)                                             # (``_fsdp_state.py`` ``_post_forward``)
        fs.ag = None
    R.mark("forward" + suffix, s.step)
    return root


def _stage_output(R: _Replay, s: _Step, q: Quantities, tk: Tokens, f: _Forward, cached: list,
                  suffix: str) -> _Forward:
    """The end of a pipeline pair's forward on a stage without the head (``_forward``'s ``head``
    False): the stage's output, the top layer's (b, s, h) hidden states in the layers' dtype
    (``q.pipe_out_tok`` bytes per token, ``quantities._interleaved_terms``), which the stage keeps
    in ``fwd_cache`` until the pair's backward (torch 2.13 ``pipelining/stage.py`` L904-916,
    L962-967; ``schedules.py`` L2530 binds it to a local of ``_perform_action``, gone as the action
    returns); autocast's weight cache cleared as the stage's forward returns. No final norm, head,
    logits or loss."""
    R.frees([h for _at, h in R.carry])                            # a derived layer's late frees
    R.carry = []
    f.out = [R.alloc(int(q.pipe_out_tok * tk.tokens))]            # (b, s, h): the stage's output
    R.frees(cached)                                               # autocast exits: its cache cleared
    f.root = _forward_end(R, s, q, f.fs, f.root, suffix)
    return f


def _loss_forward(R: _Replay, q: Quantities, tk: Tokens, flags: StepFlags, out: list, full: int, chunks: int,
                  seqs: int, held: int = 0) -> tuple[list, list, list]:
    """The loss's forward on the logits ``out``: its transient tensors (``fwd``), what it saves for backward
    (``saved``), and the logits still held apart from those (``out``, emptied where the loss saves them).
    ``held``: bytes of the body's output the model's forward holds through its loss, made already with
    the head side (``_head_side``); ``tk.loss_forward`` counts it (``q.head_loss_tok`` per token)."""
    if q.loss_chunk_tokens:   # TRL's chunked_nll: its tensors one by one (quantities._chunked_nll_bytes)
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
        fwd = _logit_allocs(R, _logit_tensors(tk.loss_forward - made, q.loss_forward, full, chunks))  # fp32 copy, transient
        if q.loss_saves_out:   # the loss saves the output itself (its per-token tensors are new)
            saved = out + R.allocs([int(tk.loss_saved) - full * q.loss_saved], one=False)  # per-token
            out = []
        else:
            saved = _logit_allocs(R, _logit_tensors(tk.loss_saved, q.loss_saved, full, chunks, q.loss_elem,
                                                    half_first=True))  # logps (half), then nll_loss's fp32 copy
    return fwd, saved, out


def _batch_in(R: _Replay, s: _Step, q: Quantities, tk: Tokens) -> int | None:
    """A micro-batch's start: its int64 ids and labels copied to the device (a blocking copy, which
    FSDP1's rate limiter sees: ``_Fsdp1Lag.synchronize``); before the run's first forward, FSDP1's
    lazy init, which allocates and frees each unit's buffers on the default stream in turn
    (``quantities.fsdp1_lazy_init``), leaving the largest one's segment cached. Returns the batch's
    handle."""
    if R.lag is not None:                                         # the batch's blocking host-to-device copy
        R.lag.synchronize(R)
    recv = recv_buffers(q, tk.tokens, s.ga)
    if recv and s.recv is None:                                   # torch's pipeline: the stage's receive buffers
        s.recv = R.allocs(recv)
    inputs = R.alloc(int(tk.inputs) - sum(recv), one=False)       # int64 ids and labels, one block
    if s.forwards == 0:                                           # FSDP1's ``_lazy_init``
        for nbytes in q.fsdp1_init:
            R.free(R.alloc(nbytes))
    return inputs


def recv_buffers(q: Quantities, n: Any, ga: int) -> list[int]:
    """Bytes of each receive buffer of a stage of torch's pipeline schedule (``q.pipe_recv`` per
    micro-batch, ``q.pipe_buf_tok`` bytes per token each: ``quantities.pipeline_buffers``, which the
    estimate counts among the inputs, ``moments._input_blocks``). Each is a tensor of its own, made by
    the stage's infrastructure before its first micro-batch and kept for the run: torch 2.13
    ``distributed/pipelining/stage.py`` ``_prepare_forward_infra`` L2266-2273 (a non-first stage's
    activation buffer per chunk, ``_make_tensor_from_meta``) and ``_create_grad_recv_info`` L2306-2313 (a
    non-last stage's output-gradient buffer per chunk). Trace's last rank of a 4-layer Llama
    interleaved over pp 2, 4 micro-batches of 4 x 512: twelve 16 MiB tensors after DDP's construction,
    where the replay made one 192 MiB block at every forward of a (stage, micro-batch) pair."""
    if not (q.pipe_recv and q.pipe_buf_tok):
        return []
    one = block_bytes(int(q.pipe_buf_tok * n), q.expandable)      # (b, s, h) in the stage's dtype
    return [one] * int(q.pipe_recv * ga)


def _shifted(q: Quantities, full: int, seqs: int) -> int:
    """Logit elements of ``logits[..., :-1, :]``: one row fewer per sequence."""
    return max(0, full - seqs * (q.logit_width // q.tp))


def _fp32_logits_forward(R: _Replay, q: Quantities, tk: Tokens, out: list, full: int, seqs: int) -> list:
    """The causal-LM loss of a release whose model forward upcasts (``quantities.fp32_logits_replay``;
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


def _emb_unit_tensors(st: Any) -> tuple[int, ...]:
    """The embedding unit's parameters under torchtitan's split root: the root's tensors before the
    [norm, head] unit's (``States.head_unit_tensors``)."""
    return st.root_tensors[:len(st.root_tensors) - len(st.head_unit_tensors)]


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
    """Unsloth's fused loss forward (``quantities._unsloth_loss_bytes``) as it allocates: the final norm's
    output (held by ``CausalLM_fast_forward`` until the loss returns), the shifted int64 labels, then
    ``grad_inputs`` (saved), then per chunk the compiled function's one memory-planning pool (the chunk's
    logits and its (tokens, h) gradient), freed as it returns; later chunks reuse its block. Returns
    (transients freed as the loss returns, saved)."""
    n = int(tk.tokens)
    _nl, _full, chunk = _logit_sizes(q, flags, n, 1)
    chunk = int(chunk)
    hidden = R.alloc(int((q.head_loss_tok - 8) * n))
    labels = R.alloc(8 * n)
    saved = R.allocs([int(q.loss_saved_tok) * n])
    pool = R.alloc(chunk * int(q.loss_forward_chunk) + int(chunk // max(int(q.logit_width), 1) * q.loss_chunk_tok))
    R.free(pool)
    return [hidden, labels], saved


def _fused_forward(R: _Replay, q: Quantities, tk: Tokens, flags: StepFlags) -> tuple[list, list]:
    """Liger's fused linear cross-entropy forward (``quantities.fused_linear_ce_bytes``) as it allocates,
    in Liger's order (ops/fused_linear_cross_entropy.py v0.6.4 L55-225): the final norm's output (held by
    ``lce_forward`` until the loss returns), then ``grad_input``, ``grad_weight`` and ``loss_1d`` (saved),
    then per chunk: autocast's copy of ``weight.t()`` and the chunk's logits (the copy freed as the matmul
    returns, the previous chunk's logits as the name is rebound), the cached copy of ``weight`` (first
    chunk), before 0.6.2 under autocast the logits' fp32 copy, from 0.6.2 the weight gradient's ``mm``
    output and its ``.float()`` (the ``mm`` output freed first). Two chunks are replayed: later ones
    repeat the second's blocks. Returns (transients freed as the loss returns, saved)."""
    first, cached, mm, flt, per_elem, half = q.fused_parts
    n = int(tk.tokens)
    _nl, _full, chunk = _logit_sizes(q, flags, n, 1)
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


def _chunked_nll_backward(R: _Replay, q: Quantities, tk: Tokens) -> list:
    """TRL's chunked_nll backward: the gathered hidden states' gradient, then a chunk's recompute (the
    head-weight copy its matmul saves and the logits-chunk tensors)."""
    grad = int(q.loss_backward_tok * int(tk.tokens))
    rest = int(tk.loss_backward) - grad - q.loss_backward_const      # the chunk's tensors, one block
    return R.allocs([grad, q.loss_backward_const]) + [R.alloc(rest, one=False)]


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


def _logps_backward(R: _Replay, f: _Forward, n: int, nsq: int) -> Any:
    """``--loss logps``'s backward (``quantities._logps_bytes``) tensor by tensor, as autograd runs it: each
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


def _root_reduce_input(q: Quantities, fs: "_Fsdp") -> int:
    """Bytes of the root unit's reduce input at the end of backward, made while its unsharded gradients
    (``_Fsdp.reduce``'s ``grads``) are alive: FSDP2's flat reduce-scatter input (``fsdp_root_rs``, else
    the unsharded gradients in the reduce dtype); FSDP1's flat gradient, ``SplitWithSizesBackward0``'s
    ``torch.cat`` of the root's view gradients (``quantities.fsdp1_root_flat_gradient``: the whole root
    flat parameter, also where a tied head's gradient is the embedding's, whose ``head_grads_full`` and
    ``emb_grads_full`` are 0: trace, Gemma-2 FSDP1 dp 4, makes the 2,250 MiB cat after the tied sum,
    torch 2.13 ``fsdp/_flat_param.py`` ``_use_unsharded_views`` L1900-1960 makes the root's parameters
    views of the flat parameter)."""
    st = q.detail.states
    if not fs.v2 and q.fsdp1_root_flat:
        return q.fsdp1_root_flat
    return q.fsdp_root_rs or (st.head_grads_full + st.emb_grads_full) * fs.rs_factor(q)


def _root_resharded(q: Quantities, fs: "_Fsdp") -> bool:
    """FSDP2 reshards the root unit when its forward returns and gathers it again at its pre-backward
    (``quantities.root_resharded_for_loss``): under ``--fsdp full``/``hybrid``, not grad-op."""
    return fs.v2 and q.fsdp_root > 0 and not q.fsdp_root_kept


def _ds_buckets(R: _Replay, q: Quantities, at_start: bool) -> list:
    """DeepSpeed ZeRO-1/2's gradient buckets (``quantities.deepspeed_buckets``), made where the release makes
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


def _backward(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, f: _Forward, parts: list[int],
              n: int, nsq: int, recompute: str, suffix: str, head: bool = True) -> None:
    """One micro-batch's backward, from the loss to the embeddings (``head`` False: a pipeline
    stage without the head, from its output's gradient, ``_pipeline_pairs``)."""
    st = q.detail.states
    buckets = _ds_buckets(R, q, at_start=True)                     # DeepSpeed ZeRO-1/2 before v0.18.3
    if _root_resharded(q, f.fs) and not q.fsdp_root_regather:     # the root's pre-backward: the loss is its output
        f.root = f.fs.unshard(R, q.fsdp_root, st.root_tensors, backward=True)
    if isinstance(f.z3, _Zero3Replay):                            # ZeRO-3: the root's pre-backward (the loss
        f.z3.backward_root(R)                                     # is its output), then the loss's backward,
    dlogits = _softcap_backward(R, q, f, _loss_gradient(R, q, tk, f, n, nsq, head))
    if isinstance(f.z3, _Zero3Replay):                            # then the head's, the base model's and the
        f.z3.backward_start(R)                                    # final norm's at their outputs' gradients
    if q.fsdp_head_pref:                                          # split root: the head's pre-backward
        f.fs.prefetched = f.fs.gather_output(R, q.fsdp_head_pref)  # prefetches the top layer
    head_full, tied = _head_backward(R, s, q, flags, f, dlogits) if head else (None, None)
    buckets += _ds_buckets(R, q, at_start=False)                  # ... from v0.18.3, at the first hook
    if q.ds_head_check and suffix != ".micro1":                   # DeepSpeed ZeRO-1/2 offloaded: the untied
        R.free(R.alloc(q.ds_head_check))                          # head's inf/NaN check (its bucket reduced at
    #                                                               the next hook: deepspeed_offload_check_head)
    if q.fsdp_head_unit:                                          # ... and its post-backward reduces the
        f.fs.post_backward(R, f.root, [head_full], q.fsdp_head_rs)  # head's gradients (fsdp2_split_root)
        _make_grads(R, s, st.trainables, ("after",), flags.oib, f.fs.grad_stream, flat=f.fs.grad_stream > 0)
        head_full, f.root = None, []
        f.fs.below_first = q.fsdp_emb_unit                        # the first layer prefetches the embedding
    for i in reversed(range(q.layers)):
        _zero12_at(R, s, q, i)                                    # DeepSpeed ZeRO-1/2: made by a hook here?
        if isinstance(f.z3, _Zero3Replay):                        # ZeRO-3: the layer's backward fetches
            f.z3.before(R, i)
        _layer_backward(R, s, q, f.fs, parts, f.kept[i], i, n, nsq, recompute, flags.oib,
                        below=f.kept[i - 1] if i > 0 else None)
        if f.z3 is not None:
            f.z3.backward(R, i)                                   # ZeRO-3: the layer's parameters released
    R.frees(R.bcarry)                                             # the bottom layer's input gradient, which
    R.bcarry = []                                                 # the embedding's backward reads
    if q.fsdp_emb_unit:                                           # split root: the embedding's pre-backward
        f.fs.below_first = 0
        f.root = f.fs.unshard_backward(R, q.fsdp_emb_unit, _emb_unit_tensors(st), prefetch=False)
    gathered = f.gathered if f.gathered is not None or q.ds_events else R.alloc(q.ds_gathered_emb,
                                                                                GATHER_STREAM * q.ds_streams)
    if isinstance(f.z3, _Zero3Replay):                            # the embedding's backward fetch
        f.z3.embedding(R)
    # the embedding gathered whole at its backward (on the all-gather stream), unless kept since its forward
    _zero12_at(R, s, q, None)                                     # ... or before the word embedding's
    emb_full, acc = R.alloc(st.emb_grads_full), []                # FSDP: the embedding's unsharded gradient
    if tied is not None and not _fsdp(q):                         # the embedding's own gradient added to
        tied = _tied_embedding_sum(R, s, q, flags, tied)          # the head's
    if tied is not None and (f.fs.v2 or q.fsdp1_root_flat):      # FSDP, a tied head: the embedding's own
        emb_out = R.alloc(q.tied_grad)                            # gradient, then autograd's InputBuffer adds
        acc = [R.alloc(q.tied_grad)]                              # it to the head's into a new tensor, the
        R.frees([tied, emb_out])                                  # unsharded gradient reduce-scattered (FSDP2's
        #                                                           root resharded after forward or kept gathered:
        #                                                           grad-op, trace's Gemma-2 b4 s512 dp 4); FSDP1's
        tied = None                                               # view gradient, concatenated below
        emb_full, acc = (acc[0], []) if emb_full is None else (emb_full, acc)   # (beside the other embeddings')
    f.fs.reduce(R, [head_full, emb_full] + acc, _root_reduce_input(q, f.fs), q.fsdp1_root_cast)
    _unit_grads(R, s, f.fs, st.trainables, ("before",) if q.fsdp_head_unit else ("after", "before"),
                flags.oib)                                        # head, norm, embeddings
    f.fs.reduced(R)                                               # torch < 2.5: the input dropped on return
    if suffix != ".micro1":                                       # ZeRO-1/2 offloading, at the boundary:
        _offload_epilogue(R, q)                                   # each of rank 0's gradients' copies
    for cat in q.ds_reduce_cats[-1:] if q.ds_events else q.ds_reduce_cats:  # ZeRO-3's buckets reduced, each a
        R.free(R.alloc(cat, GRAD_STREAM * q.ds_streams))          # flat cat (quantities.deepspeed_reduce_cats;
    #                                                               with ``ds_events`` the last, the others at their hooks)
    R.free(gathered)                                              # ... and every parameter released
    if isinstance(f.z3, _Zero3Replay):
        f.z3.done(R)
    _zero12_epilogue(R, s, q, suffix)                             # DeepSpeed ZeRO-1/2: grads_in_partition
    R.frees([tied, f.emb, f.inputs] + buckets)
    f.fs.reshard(R, f.root)                                       # the root's post-backward
    f.fs.done(R)
    if s.lomo is not None:                                        # LOMO's fused_backward: the last hook call
        _lomo_update(R, *s.lomo, flags.oib)
        s.lomo = None
    R.mark("backward" + suffix, s.step)
    if flags.hold == "step" or flags.pipe_out == "1f1b":          # Schedule1F1B's ``output``: to the next
        s.held = f.out                                            # forward (moments.pipeline_output)
    elif flags.hold == "backward" or flags.pipe_out:
        R.frees(f.out)


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
    the loss's backward (``q.fsdp_loss_buf``, ``quantities.fsdp1_prefetch_after_loss``, as the
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
        f.fs.root_pre_backward(R, q.fsdp_layer_buf)               # FSDP1: the top layer prefetched first
    dlogits = _loss_backward(R, q, tk, f, n, nsq) if head else []
    if _root_resharded(q, f.fs) and q.fsdp_root_regather:         # ... the logits (a loss outside the model)
        f.root = f.fs.unshard(R, q.fsdp_root, st.root_tensors, backward=True)
    if not early:
        f.fs.root_pre_backward(R, q.fsdp_layer_buf)               # FSDP1: the top layer prefetched
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


def _half_logps(q: Quantities, f: _Forward) -> bool:
    """Whether the loss is ``F.cross_entropy`` on whole half logits under autocast (``--loss half``,
    ``quantities._eager_loss_bytes``: ``LossBytes(held, half, half + F32, 0, F32)``): ``log_softmax``
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


def _offload_epilogue(R: _Replay, q: Quantities) -> None:
    """DeepSpeed ZeRO-1/2 offloading the optimizer, at the boundary's reduction: each of rank 0's
    gradients, in the order backward made them, gets its float64 norm copy, then (up to v0.19.5) the
    elementwise inf/NaN check's fp32 copy, three bool tensors and second fp32 tensor, then the fp32 copy
    for the host, each step's tensors freed before the next (``quantities.deepspeed_offload_steps``,
    ``deepspeed_offload_epilogue``: v0.14.2 ``stage_1_and_2.py`` L1320-1334)."""
    for step in q.ds_offload_steps:
        R.frees(R.allocs(list(step)))


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


def _fsdp(q: Quantities) -> bool:
    """Whether FSDP wraps the model (its units gathered and reduce-scattered)."""
    return q.fsdp_root > 0 or q.fsdp_layer_buf > 0


def _head_backward(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, f: _Forward, dlogits: list) -> tuple:
    """The head's matmuls' backward: the weight's gradient (under autocast first in the compute dtype,
    ``quantities.head_weight_grad_half``, then cast to fp32 once the logits' gradient, the head's
    input and its half copy are freed), the cuBLAS workspace of autograd's thread at its first
    matmul: after the weight's gradient (or its half copy) under torch's own bias-free linear
    (``MmBackward0``), before it under a head with a bias (``AddmmBackward0``: the input's gradient
    first, ``quantities.head_input_grad_first``; BERT's masked-LM decoder) and under DeepSpeed
    ZeRO-3's ``zero3_linear_wrap``, whose backward runs the input's gradient matmul first
    (``quantities.deepspeed_linear_wrap``; v0.19.8 ``zero/linear.py`` L125-134). The gradient is a
    tied head's part, waiting in the embedding's input buffer (``q.tied_grad``), FSDP's unsharded
    head gradients, or, outside FSDP, the ``.grad`` of an untied head, made here with the final
    norm's (autograd's order: the head is back-propagated first). Returns (FSDP's unsharded head
    gradients, the tied part)."""
    st = q.detail.states
    if q.ds_linear_wrap or q.head_input_first:                    # grad_output.matmul(weight) first: the
        s.workspace(R, 1)                                         # workspace before the weight's gradient
    half = R.alloc(q.head_wgrad_half)                             # (vocab, hidden) in the compute dtype
    # DeepSpeed ZeRO-3: the untied head's whole weight gradient, (vocab, hidden) in the engine's dtype, as
    # its ``MmBackward0`` makes it, until the head's backward ends (``quantities.deepspeed_head_wgrad``)
    wgrad = R.alloc(q.ds_head_wgrad) if q.ds_events else None

    where = ("after", "before") if q.pipe_head_tied else ("after",)  # (a pipeline's last stage: its tied copy)
    added: list = []                                              # gradients made to be added to a ``.grad``

    def gradients() -> tuple:
        head_full = R.alloc(st.head_grads_full)                   # FSDP: the head's unsharded gradients
        tied = R.alloc(q.tied_grad)                               # a tied head's, until the embedding's
        if not _fsdp(q):
            added.extend(_accumulated(R, s, st.trainables, where))
            _make_grads(R, s, st.trainables, where, flags.oib)    # an untied head's, the final norm's
        return head_full, tied

    if q.chunk_head_grads:                                        # a chunked loss: the head's backward per chunk
        made = _chunk_head_backward(R, s, q, f, dlogits, gradients)
        R.frees(added)
        return made
    made = gradients() if half is None else None                  # the matmul's output is the gradient
    s.workspace(R, 1)                                             # after the head's first backward matmul
    #                                                               (already made under ``ds_linear_wrap``, a bias)
    R.frees(dlogits + f.head)
    R.free(wgrad)
    if half is not None:
        made = gradients()                                        # ToCopyBackward0: the fp32 cast
        R.free(half)
    R.frees(added)                                                # added in place into ``.grad``, released
    return made


def _chunk_head_backward(R: _Replay, s: _Step, q: Quantities, f: _Forward, dlogits: list, gradients: Any) -> tuple:
    """The head's backward under a chunked loss (``--loss-chunks``: torchtune's chunked output, litgpt's
    chunked half loss), one matmul backward per chunk, each making a weight gradient of the whole head
    ((vocab, hidden) in the matmul's dtype: the half copy's under autocast; ``quantities.chunk_head_grads``,
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


def _micro_batches(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, n: int, nsq: int,
                   recompute: str, b: int, ga: int) -> None:
    """A step's micro-batches: each forward, then its backward once ``tk.inflight`` forwards are in
    flight (1: one after the other; a pipeline stage under 1F1B: min(pp, grad_accum) on the first
    stage, every micro-batch under GPipe, ``moments.tokens``), the rest drained at the end. Up to
    one micro-batch more than are in flight is replayed (two without a pipeline)."""
    parts = _layer_parts(q, n, nsq)
    s.ga = ga
    full = label_tokens(q, n) * q.logit_width // q.tp if flags.lm else b * q.logit_width   # logit elements
    if q.pipe_order:                                              # an interleaved schedule's last rank
        return _pipeline_pairs(R, s, q, flags, tk, (n, nsq, b), parts, recompute, full, ga)
    inflight = max(1, int(tk.inflight))
    pending: list = []
    for micro in range(min(ga, inflight + 1)):
        suffix = "" if ga == 1 else (".micro1" if micro == 0 else f".micro2-{ga}")
        pending.append((_forward(R, s, q, flags, tk, parts, recompute, full, suffix, b), suffix))
        if len(pending) >= inflight:
            f, sfx = pending.pop(0)
            _backward(R, s, q, flags, tk, f, parts, n, nsq, recompute, sfx)
    for f, sfx in pending:
        _backward(R, s, q, flags, tk, f, parts, n, nsq, recompute, sfx)
    if flags.pipe_out:                                            # the schedule's step returns: its last
        R.frees(s.held)                                           # output freed (moments.pipeline_output)
        s.held = []


def _pipeline_pairs(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, shape: tuple,
                    parts: list[int], recompute: str, full: int, ga: int) -> None:
    """A step of an interleaved pipeline schedule on the last rank: its (stage, micro-batch) pairs'
    forwards and backwards in the rank's order (``q.pipe_order``, ``schedules.rank_order``: torch
    2.13 ``_PipelineScheduleRuntime._step_microbatches`` runs them so, L2407-2600). Only the pairs
    of its last local stage, the model's last, run the final norm, head and loss
    (``_maybe_compute_loss``: ``stage.is_last``, L299-304) and keep the logits; the others keep their
    stage output (``_stage_output``). Each pair's output, the logits included, is freed as its
    backward ends (``fwd_cache`` popped, ``moments.pipeline_output``). ``shape``: (tokens, token x
    key pairs, micro-batch)."""
    n, nsq, b = shape
    top = max(v for _kind, v, _mb in q.pipe_order)                # the head's local stage
    alive: dict = {}
    for kind, v, mb in q.pipe_order:
        suffix = "" if ga == 1 else (".micro1" if mb == 0 else f".micro2-{ga}")
        if kind == FORWARD:
            alive[v, mb] = _forward(R, s, q, flags, tk, parts, recompute, full, suffix, b, head=v == top, stage=v)
        else:
            _backward(R, s, q, flags, tk, alive.pop((v, mb)), parts, n, nsq, recompute, suffix, head=v == top)


#: the side streams of PyTorch FSDP, and DeepSpeed ZeRO-3's all-gather stream (``partitioned_param_coordinator.py``
#: L400, L606: its fetches allocate under ``stream(__allgather_stream)``, ``parameter_offload.py`` L195-196
#: under ``overlap_comm``) as GATHER_STREAM (ids of the replay's allocator pools; 0 is the default stream)
GATHER_STREAM, GRAD_STREAM = 1, 2
#: FSDP1's pre-unshard stream: under parameter offload ``pre_unshard`` copies the unit's host shard to the
#: device on it (torch 2.13 ``fsdp/_runtime_utils.py`` ``_init_streams`` L267-269: a stream of its own "for CPU
#: offloading (H2D copy)"; ``_unshard`` L293-294; ``_flat_param.py`` L1335-1338)
PRE_UNSHARD_STREAM = 4


def _fsdp_streams(q: Quantities) -> tuple[int, int]:
    """Where PyTorch FSDP allocates its buffers: the caching allocator keeps a pool per stream and
    reuses a block only on the stream that allocated it (``allocator.py``, "Streams"). FSDP2 makes
    the all-gather output on its all-gather copy-in stream (torch 2.13
    ``_fully_shard/_fsdp_collectives.py`` ``foreach_all_gather``: ``all_gather_comm.allocate`` inside
    ``device_handle.stream(all_gather_copy_in_stream)``) and the reduce-scatter output, which the
    sharded gradients are views of, on its reduce-scatter stream (``foreach_reduce``: ``reduce_output``
    inside ``device_handle.stream(reduce_scatter_stream)``; the input is made on the current
    stream before it, from PyTorch 2.5: before, on the reduce-scatter stream too, ``_Fsdp.reduce``).
    FSDP1 unshards its flat parameter on its unshard stream and makes the reduce dtype's copy and
    the new gradient shard on its post-backward stream (``fsdp/_runtime_utils.py`` ``_unshard``,
    ``_post_backward_hook``). Found by the torchtitan benchmark (Llama 3.1 8B, FSDP2
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
    prefetched: int | None = None  # in backward, the lower layer's all-gather output, issued by the prefetch
    last: list = field(default_factory=list)  # the last layer's parameters, kept gathered (--fsdp-gathered root-last)
    lag: "_Fsdp1Lag | None" = None  # FSDP1's rate limiter and its pending frees (``_fsdp1_limited``)
    rs_side: bool = False      # FSDP2 before PyTorch 2.5: the reduce-scatter input on the gradient stream (``reduce``)
    below_first: int = 0       # split root: the embedding unit's all-gather output, the first layer's prefetch
    adapters: int = 0          # FSDP1, LoRA units of their own: a layer's adapter units (``adapter_units``)
    recomputed: bool = False   # ... whose forward runs again in the layer's recomputation
    host: int = 0              # FSDP1 parameter offload: the ranks a unit is sharded over (``fsdp1_host_shards``)
    cast_shards: int = 0       # FSDP2 under bf16-mp: the ranks a unit is sharded over (``unshard``'s cast input)
    grad_op: bool = False      # SHARD_GRAD_OP / reshard_after_forward=False: each layer kept gathered (``gathered``)
    gathered: list = field(default_factory=list)  # grad-op: each layer's gathered parameters, bottom first
    no_sync: bool = False      # FSDP1 inside ``no_sync()``: each unit's flat gradient kept unsharded (``_fsdp1_no_sync``)
    flat: int | None = None    # ... the unit's flat gradient just kept, claimed as its ``.grad`` by ``_unit_grads``
    mp_shards: int = 0         # FSDP1 under bf16-mp: the ranks a unit is sharded over (``unshard``'s low-precision shard)
    cast: int | None = None    # FSDP1's root hook: its flat gradient's fp32 copy, until the hook returns (``reduce``)

    @property
    def grad_stream(self) -> int:
        return self.streams[1]

    def unshard(self, R: _Replay, flat: int, tensors: tuple[int, ...], backward: bool = False,
                raw: int = 0) -> list:
        """A unit gathered: FSDP1's flat parameter, requested at ``raw`` bytes where given (its padded
        flat numel, ``quantities.fsdp1_flat_bytes``) and charged ``flat``, the block the estimate counts
        (``_Replay.alloc``); FSDP2's flat all-gather output and each parameter copied out of it. FSDP1
        under bf16-mp (``mp_shards``) first casts the rank's shard to bf16 on the pre-unshard stream, the
        all-gather's input, freed after it (torch 2.13 ``fsdp/_runtime_utils.py`` ``_unshard`` L293-307:
        ``pre_unshard`` before the rate limiter; ``fsdp/_flat_param.py`` ``_use_low_precision_shard``
        L1342-1357, ``post_unshard`` L1523-1530): trace, the wide 2-layer Llama FSDP1 dp 2 bf16-mp,
        opens a 16 MiB segment on that stream for the root's 15.6 MiB. In forward the output is freed at the next unit's copy-out
        (``comm_ctx.all_gather_state``), in backward right after its own (torch 2.13
        ``_fsdp_param_group.py`` ``wait_for_unshard``)."""
        if flat <= 0:
            return []
        if not self.v2 or not tensors:
            low = R.alloc((raw or flat) // self.mp_shards, PRE_UNSHARD_STREAM) if self.mp_shards else None
            if self.lag is not None and not self.v2:              # FSDP1's ``_unshard``: the rate limiter
                self.lag.wait(R)
            # offload: the host shard copied in on the pre-unshard stream, the all-gather's input, dropped
            # once the flat parameter uses the unsharded buffer (``FlatParamHandle.unshard`` L1381-1383)
            copy = R.alloc(-(-flat // self.host), PRE_UNSHARD_STREAM) if self.host else None
            out = [R.alloc(raw or flat, self.streams[0], charge=flat if raw else 0)]  # FSDP1's unsharded flat parameter
            R.frees([copy, low])
            return out
        ag = self.gather_output(R, flat)                          # the all-gather output, flat
        R.free(self.ag)
        self.ag = ag
        params = R.allocs(tensors)                                # each parameter copied out
        if backward:
            R.free(self.ag)
            self.ag = None
        return params

    def gather_output(self, R: _Replay, nbytes: int) -> int | None:
        """FSDP2's flat all-gather output of ``nbytes`` on the all-gather stream. Under bf16-mp each
        parameter's shard is first cast to bf16 into one flat all-gather input there, dropped once copied
        in (torch 2.13 ``_fully_shard/_fsdp_collectives.py`` ``foreach_all_gather`` L336-361:
        ``_get_param_all_gather_inputs`` L382-427, ``flat_foreach_copy_input = torch.empty(...,
        dtype=param_dtype)`` when ``use_foreach_copy``, i.e. a ``param_dtype`` differing from the stored
        one; ``del param_all_gather_inputs`` after ``all_gather_copy_in``): the output's size over the ranks.
        Trace, Phi-3 FSDP2 dp 2 bf16-mp: the root's gather opens a 64 MiB segment for it."""
        cast = R.alloc(-(-nbytes // self.cast_shards), self.streams[0], one=False) if self.cast_shards else None
        out = R.alloc(nbytes, self.streams[0])
        R.free(cast)
        return out

    def unshard_backward(self, R: _Replay, flat: int, tensors: tuple[int, ...], prefetch: bool) -> list:
        """A layer gathered in backward. FSDP2 (torch 2.13 ``_fsdp_param_group.py``): its
        ``pre_backward`` (L576-586) copies its parameters out of the all-gather output that the
        upper layer's backward prefetch allocated (the top layer's: allocated here), frees that
        output (``wait_for_unshard`` L487-489), then ``_backward_prefetch`` (L795-831) allocates the
        lower layer's (``prefetch``; none below the bottom layer), alive through this layer's
        backward (``moments._fsdp_middle_layers``). FSDP1 with its rate limiter (``_fsdp1_limited``):
        ``_pre_backward_hook`` (torch 2.13 ``fsdp/_runtime_utils.py`` L672-694) uses the flat parameter
        the upper layer prefetched and, ``BackwardPrefetch.BACKWARD_PRE``, unshards the lower layer
        (``_prefetch_handle`` L1208-1235: ``_unshard``, its limiter wait first); otherwise ``unshard``.
        With LoRA units of their own (``adapters``) the lower layer is prefetched only at the layer's
        first adapter's pre-backward (``quantities.fsdp1_unprefetched``), after the adapters ran their
        forward again in the recomputation and the later adapters their backward (``adapter_units``:
        found by trace, Llama-2-7B cut to 2 layers, FSDP1 dp 2 LoRA r64, Answer.AI's setup: trace opens
        no segment for that gather, the replay opened one of a layer's size before)."""
        if flat > 0 and not self.v2 and self.lag is not None:
            params = [self.prefetched] if self.prefetched is not None else self.unshard(R, flat, tensors)
            self.prefetched = None
            self.adapter_units(R, self.adapters * self.recomputed + self.adapters - 1)
            if prefetch:
                self.prefetched = self.unshard(R, flat, tensors)[0]   # the lower layer's flat parameter
            return params
        if flat <= 0 or not self.v2 or not tensors:
            return self.unshard(R, flat, tensors, backward=True)
        ag = self.prefetched if self.prefetched is not None else self.gather_output(R, flat)
        self.prefetched = None
        params = R.allocs(tensors)                                # each parameter copied out
        R.free(ag)
        if prefetch or self.below_first:                          # the lower layer's all-gather output
            self.prefetched = self.gather_output(R, flat if prefetch else self.below_first)
        return params

    def adapter_units(self, R: _Replay, count: int) -> None:
        """``count`` of a layer's LoRA adapter units (peft's ``fsdp_auto_wrap_policy``: each ``lora_A``
        and ``lora_B`` a unit of its own), each gathered and resharded. Their flat parameters are a
        rank's share of a (rank, width) adapter (small-pool blocks, not replayed), but each ``_unshard``
        runs the rate limiter (a wait once two free events are queued) and each ``_reshard`` records a
        free event (torch 2.13 ``fsdp/_runtime_utils.py`` ``_unshard`` L277-307, ``_reshard`` L310-330):
        they advance the queue, so the CPU waits for the events of the layer units resharded before
        them and those units' flat parameters are reusable sooner (``_Fsdp1Lag``)."""
        if self.lag is None or self.v2:
            return
        for _ in range(max(0, count)):
            self.lag.wait(R)
            self.lag.event()

    def root_pre_backward(self, R: _Replay, flat: int) -> None:
        """FSDP1's root pre-backward hook, once the loss's gradient reaches the root's output: its
        ``_unshard`` (already gathered: only the limiter's dequeue and wait) and the top layer's
        ``BACKWARD_PRE`` prefetch (``_runtime_utils.py`` L672-694, L1208-1235)."""
        if self.v2 or self.lag is None or flat <= 0:
            return
        self.lag.wait(R)
        self.prefetched = self.unshard(R, flat, ())[0]

    def reshard(self, R: _Replay, params: list) -> None:
        """A unit resharded: its gathered parameters freed. FSDP1 (``_reshard``, torch 2.13
        ``_runtime_utils.py`` L310-330) frees the flat parameter after ``record_stream`` on the
        current stream (``_flat_param.py`` ``_free_unsharded_flat_param`` L1807-1821: allocated on
        the unshard stream, read by the default stream), then records the limiter's free event
        there: the block is reusable once the GPU has run the default stream to this point."""
        if self.v2 or self.lag is None or not params:
            R.frees(params)
            return
        t = self.lag.event()
        for h in params:
            self.lag.defer(R, h, t)

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
        rs = q.fsdp_rs_buf or q.fsdp_rs_side
        return max(1, round(rs / full)) if rs and full else 1

    def reduce(self, R: _Replay, grads: list, rs_bytes: int, cast: int = 0) -> None:
        """The reduce-scatter input: the unsharded gradients copied into one flat buffer in the reduce
        dtype, then freed. FSDP1 frees it when the collective is issued. FSDP2 from PyTorch 2.5 makes it
        on the default stream and keeps it until the next unit's ``post_backward``
        (``reduce_scatter_states``), which pops it before it makes its own (torch 2.13
        ``_fsdp_param_group.py`` ``post_backward`` L647-658, ``reduce_scatter_max_input_buffers`` 1): the
        root's too, whose reduce ``_backward`` makes here (trace, Llama-3.2-1B cut to 2 layers, FSDP2
        bf16-mp: the root's 1,002 MiB fp32 input reuses its segment, the replay's had the bottom layer's
        232 MiB input in it and opened another: +14.7 % before). FSDP2 before 2.5 (``rs_side``; pytorch/pytorch PR #129721 moved
        it, ``spec.releases.fsdp2_rs_on_default_stream``) made it on its reduce-scatter stream:
        ``foreach_reduce_scatter`` (pytorch/pytorch@01d66d21f38a
        ``torch/distributed/_composable/fsdp/_fsdp_collectives.py``; the same in the ``foreach_reduce``
        of June 2024) runs ``reduce_scatter_input = torch.empty(...)`` and the copy-in inside
        ``with torch.cuda.stream(reduce_scatter_stream):``, clears the unsharded gradients, allocates
        the output there too (``reduce_scatter_input.new_empty``: the sharded gradients, made by
        ``_make_grads`` on that stream) and drops its last reference to the input when it returns;
        ``post_backward`` keeps nothing of it (pytorch/pytorch@012c62d62004 ``_fsdp_param_group.py``
        ``post_backward``: ``self._reduce_scatter_view_out_event = foreach_reduce_scatter(...)``).
        The process group stashes the input during the collective, not past its ``wait`` (``async_op``
        False: ``WorkNCCL::synchronizeStreams`` clears ``stashed_for_allocator_safety_``), so the block
        returns to the reduce-scatter stream's pool at once, where the next unit's input reuses it:
        one layer's input held in that pool beside the default stream's (``reduced``). ``cast``: FSDP1's
        root hook copies its flat gradient to the reduce dtype on the post-backward stream first
        (``quantities.fsdp1_root_cast``), freed once the new shard is made (``reduced``)."""
        if self.v2:                                               # the upper unit's input popped first
            R.free(self.rs)                                       # (``post_backward``: the root's too)
            self.rs = None
        rs = R.alloc(rs_bytes, self.grad_stream if self.rs_side else 0)  # the unsharded gradients, flat
        R.frees(grads)
        if self.no_sync:                                          # FSDP1's root inside no_sync: its flat
            self.flat = rs                                        # gradient kept (``_fsdp1_no_sync``)
        elif self.v2:
            self.rs = rs
        else:
            self.cast = R.alloc(cast, self.grad_stream) if cast else None   # (before the new shard)
            R.free(rs)

    def reduced(self, R: _Replay) -> None:
        """FSDP2 before PyTorch 2.5: ``foreach_reduce_scatter`` returns, once the sharded gradients are
        made, and its reduce-scatter input is freed (``reduce``); FSDP1's root hook returns and its
        flat gradient's fp32 copy is freed."""
        if self.rs_side:
            R.free(self.rs)
            self.rs = None
        R.free(self.cast)
        self.cast = None

    def done(self, R: _Replay) -> None:
        R.frees([self.ag, self.rs, self.prefetched])
        self.ag = self.rs = self.prefetched = None


class _Zero3Fetch:
    """DeepSpeed ZeRO-3's gathers of the layers' parameters (``quantities.deepspeed_layer_params``) on the
    all-gather stream, one micro-batch's forward and backward (nothing off ZeRO-3 over several ranks),
    where the coordinator's replay does not apply (``_Zero3Replay`` where it does).

    Before the module order is recorded (the run's first forward: ``is_complete_trace``, v0.19.8
    ``partitioned_param_coordinator.py`` L417-420) each module fetches its own parameters, each a
    whole tensor, and releases them after its forward (``release_sub_module`` L502-507: every parameter
    of the module while the trace is incomplete), and so again at its backward: one parameter alive at
    a time. Once it is recorded, each module's fetch also starts a prefetch (L451-480): parameters of
    the recorded order not gathered yet, whole, until they reach min(stage3_prefetch_bucket_size,
    stage3_max_live_parameters - the elements gathered or in flight) (``__n_available_params``: up at
    each all-gather L593, down at each release L630), gathered as one flat ``all_gather_coalesced``
    output (``partition_parameters.py`` ``_all_gather_dtype`` L1329-1350); the first of them fetched
    waits on the handle, which builds every parameter of the group by ``torch.cat``
    (``AllGatherCoalescedHandle.wait`` L761-803), and the flat output goes when the last of them is
    popped from ``__inflight_param_registry`` (coordinator L407-411). A layer's module and each of its
    parameters' modules fetch (modules without parameters of their own, attention and MLP, are left
    out), so the prefetch runs ahead up to the live-parameter limit: on Llama-3.2-1B cut to 2 layers
    (ZeRO-3 dp 4 bf16, one layer per group) trace's second forward holds both layers' flat outputs
    (116 MiB each) when the first layer's parameters are built. The top ``ds_layers_kept`` layers keep
    their parameters until their backward (``__params_to_release`` L634-664); the others are released
    after their forward and gathered again, one at a time, at their backward (the backward's prefetch
    is not replayed); the final norm and the head are left out."""

    def __init__(self, R: _Replay, q: Quantities, recorded: bool) -> None:
        self.numels, self.k = q.ds_layer_params, len(q.ds_layer_params)
        self.wb, self.stream = q.ds_param_bytes, GATHER_STREAM * q.ds_streams
        self.bucket = q.ds_prefetch if recorded else 0
        self.max_live, self.total = q.ds_max_live, q.layers * self.k
        self.kept_from = q.layers - q.ds_layers_kept if recorded else q.layers
        self.group_of: dict = {}  # parameter index -> its group
        self.flats: dict = {}     # group -> [flat handle, its parameters not yet fetched, (start, stop)]
        self.built: dict = {}     # parameter index -> handle, built from a flat output, not yet fetched
        self.held: dict = {}      # layer -> its parameters' handles, kept until its backward
        self.queue = 0            # the next parameter of the recorded order not yet taken
        self.avail = q.ds_emb_numel  # the embedding, fetched
        if self.k:
            self._prefetch(R)     # the embedding's fetch: the first group
        if not (q.ds_emb_kept and recorded):
            self.avail -= q.ds_emb_numel  # ... released after its forward

    def _numel(self, idx: int) -> int:
        return self.numels[idx % self.k]

    def _prefetch(self, R: _Replay) -> None:
        """One module's fetch: the next group's flat output, (n,) engine dtype."""
        most = min(self.bucket, self.max_live - self.avail)
        start, n = self.queue, 0
        while self.queue < self.total and n < most:
            n += self._numel(self.queue)
            self.queue += 1
        if n:
            g = len(self.flats)                                   # groups are never removed from flats
            self.group_of.update({j: g for j in range(start, self.queue)})
            self.flats[g] = [R.alloc(n * self.wb, self.stream), self.queue - start, (start, self.queue)]
            self.avail += n

    def _fetch(self, R: _Replay, idx: int) -> Any:
        """The parameter ``idx`` of the layers gathered: from its group's flat output, or on its own."""
        g = self.group_of.pop(idx, None)
        if g is None:                                             # not prefetched: fetched now
            self.queue = max(self.queue, idx + 1)
            self.avail += self._numel(idx)
            return R.alloc(self._numel(idx) * self.wb, self.stream)
        flat = self.flats[g]
        if idx not in self.built:                                 # the handle's wait: the group's parameters
            a, b = flat[2]                                        # built, each (numel,) by torch.cat
            self.built.update({j: R.alloc(self._numel(j) * self.wb, self.stream) for j in range(a, b)})
        flat[1] -= 1
        if flat[1] == 0:                                          # the last of the group popped
            R.free(flat[0])
        return self.built.pop(idx)

    def forward_end(self, R: _Replay) -> None:
        """The final norm and the head: left out."""

    def forward(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s forward: its module's fetch, then each parameter's module's."""
        if not self.k:
            return
        self._prefetch(R)
        for j in range(self.k):
            h = self._fetch(R, i * self.k + j)
            self._prefetch(R)
            if i >= self.kept_from:
                self.held.setdefault(i, []).append(h)
            else:
                R.free(h)                                         # released after its module's forward
                self.avail -= self._numel(j)

    def backward(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s backward (called after it): its kept parameters released, or each gathered and
        released in turn."""
        if i in self.held:
            R.frees(self.held.pop(i))
        elif self.k:
            for n in self.numels:
                R.free(R.alloc(n * self.wb, self.stream))


class _Zero3Replay:
    """DeepSpeed ZeRO-3's gathered parameters as the coordinator's replay makes and frees them
    (``quantities.deepspeed_gather_events``, ``zero3_replay.events``), one micro-batch's forward and
    backward: every module fetch of the recorded order in turn, the parameters gathered alone, the
    prefetches' flat outputs, the members built from them and each release, each its own block of the
    engine's dtype on the all-gather stream (the ``torch.cat`` of ``AllGatherCoalescedHandle.wait`` runs
    in ``fetch_sub_module``'s stream context, v0.19.8 ``partitioned_param_coordinator.py`` L400). The
    replay's modules run in stretches around the compute the reserved replay knows: the root's and the
    embedding's forward fetches before the embedding, a layer's before its forward (``forward``), the
    final norm's and the head's before the head's, backward's first modules (root, head, base model,
    final norm) before the loss's backward (``backward_start``), a layer's backward fetches (under full
    recompute its forward's again among them) before its backward (``before``), the embedding's backward
    fetch last (``embedding``); each stretch's fetches in order, a module's releases before the next module with
    parameters is fetched (it has run by then), the last one's once the stretch's compute is done
    (``settle``). The run's first forward and backward, before the order is recorded, gather each
    module's own parameters and release them after it; what is still gathered at the end is released
    by the step (``done``)."""

    def __init__(self, R: _Replay, q: Quantities, recorded: bool) -> None:
        self.uses = q.ds_events[1 if recorded else 0]
        self.wb, self.stream = q.ds_param_bytes, GATHER_STREAM * q.ds_streams
        self.pos = 0
        self.live: dict = {}      # key (a parameter's index, or minus a group's number) -> its handle
        self.pending: list = []   # handles released by the stretch's modules, freed once its compute is done
        # under torch's F.linear (``quantities.deepspeed_linear_kept``) a layer's weights released in its
        # forward stay alive in what autograd saved until that layer's backward: layer -> their handles
        self.keep = q.ds_linear_kept > 0
        self.saved: dict = {}
        self.cats: list = []      # the stretch's gradient-bucket reductions: elements of each flat ``cat``
        self.grad_stream = GRAD_STREAM * q.ds_streams
        self._run(R, lambda fwd, layer: fwd and layer is None)   # the root's and the embedding's forward

    def _apply(self, R: _Replay, events: tuple, later: bool, hold: int | None = None,
               layer: int | None = None) -> None:
        for sign, key, numel in events:
            if sign > 0:
                self.live[key] = R.alloc(numel * self.wb, self.stream)   # (numel,) engine dtype
            elif hold is not None or sign == -2:                  # -2: a saved view holds it (view_held)
                self.saved.setdefault(hold if hold is not None else layer, []).append(self.live.pop(key, None))
            elif later:
                self.pending.append(self.live.pop(key, None))
            else:
                R.free(self.live.pop(key, None))

    def _run(self, R: _Replay, take) -> None:
        """Run the uses from here on while ``take(forward, layer)`` holds: their fetches, and their
        releases (a flat output's free at a fetch at once; a parameter's once its module has run: at
        the next fetch of a module with parameters of its own, or after the stretch's compute)."""
        while self.pos < len(self.uses) and take(*self.uses[self.pos][:2]):
            fwd, layer, own, fetch, release, cat = self.uses[self.pos]
            self.cats.append(cat)
            if own:                                               # the modules before it have run
                self.settle(R)
            self._apply(R, fetch, later=False)
            self._apply(R, release, later=True, hold=layer if (self.keep and fwd) else None, layer=layer)
            self.pos += 1

    def settle(self, R: _Replay) -> None:
        """The stretch's compute done: its gradient buckets reduced, each a flat ``cat`` of the gradients
        in their dtype made and freed on the reduce stream (``quantities.deepspeed_reduce_cats``), and the
        parameters its modules released freed."""
        for n in self.cats:
            R.free(R.alloc(n * self.wb, self.grad_stream))        # (n,) gradient dtype
        self.cats = []
        R.frees(self.pending)
        self.pending = []

    def forward(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s forward fetches (its module's and its children's)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: fwd and layer == i)

    def forward_end(self, R: _Replay) -> None:
        """The final norm's and the head's forward fetches."""
        self.settle(R)
        self._run(R, lambda fwd, layer: fwd and layer is None)

    def backward_root(self, R: _Replay) -> None:
        """Backward's first module use, the root's: its pre-backward hook runs at the gradient of the
        root's output, the loss, before the loss's backward (DeepSpeed v0.19.8 ``parameter_offload.py``
        ``_register_deepspeed_module`` puts ``PreBackwardFunctionForModule`` on each module's outputs;
        under a recorded order its fetch prefetches what comes next)."""
        self.settle(R)
        first = [True]

        def take(fwd: bool, layer: int | None) -> bool:
            ok, first[0] = first[0] and not fwd and layer is None, False
            return ok
        self._run(R, take)

    def backward_start(self, R: _Replay) -> None:
        """Backward's next modules' fetches (the head, the base model, the final norm): at their outputs'
        gradients, the head's once the loss's backward has made the logits' (in the run's first backward,
        each module's own parameters gathered there; trace, Llama GQA ZeRO-3 LoRA: the head's 501 MiB
        gathered after the loss's fp32 gradients are freed)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: layer is None)

    def before(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s backward fetches (under full recompute its forward's again among them)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: layer == i)

    def backward(self, R: _Replay, i: int) -> None:
        """After layer ``i``'s backward: its modules' releases, and the weights its forward saved."""
        self.settle(R)
        R.frees(self.saved.pop(i, []))

    def embedding(self, R: _Replay) -> None:
        """The embedding's backward fetch (the last module's)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: True)

    def done(self, R: _Replay) -> None:
        """Every parameter still gathered released (by the step's ``_partition_all_parameters``)."""
        self.settle(R)
        R.frees(list(self.live.values()) + [h for hs in self.saved.values() for h in hs])
        self.live, self.saved = {}, {}


def _layer_forward(R: _Replay, q: Quantities, fs: _Fsdp, parts: _Parts, tk: Tokens, recompute: str,
                   keep: bool = False, cached: list | None = None, s: _Step | None = None) -> list:
    """One layer's forward: what it keeps for backward (a list of handles). ``keep``: its gathered
    parameters stay until its backward (``quantities.fsdp2_last_gathered``); ``cached``: where a
    checkpointed layer's autocast weight copies go, freed when the forward ends (``_checkpointed``).

    ``s``: the forward thread's cuBLAS workspace (``_Step.workspace``, made once per step's first
    matmul) is made here, once the layer is gathered (FSDP's unshard before it; DeepSpeed ZeRO-3's
    fetch, ``_forward``'s ``z3.forward``, too): the first matmul is the first layer's first linear
    (transformers ``LlamaDecoderLayer.forward`` L299 ``self_attn`` -> ``q_proj``), which runs in
    the layer's forward, after FSDP2's pre-forward all-gather and copy-out (torch 2.13
    ``_fully_shard/_fsdp_state.py`` ``_pre_forward`` -> ``_fsdp_param_group.py`` ``unshard``,
    ``wait_for_unshard``) and before any of its LoRA adapters' own FSDP1 units gather (peft 0.21.2
    ``tuners/lora/layer.py`` ``Linear.forward`` L1088 ``result = self.base_layer(x)`` first). It
    was made before the first layer's gather: against trace, a wide 2-layer Llama (b4 s512 vocab
    8000, dp 2, FSDP2 full shard, full recomputation) +11.3 % -> +1.6 % on the peak reserved memory
    (the workspace's segment took the copied-out weights trace places elsewhere, and by the second
    step the top layer's kept output sat in a free fp32-logits segment, so the loss backward opened
    a fourth; docs/validation.md ``ckout``, tests/test_workspace_order.py)."""
    params = fs.unshard(R, _layer_gather(q, fs), q.detail.states.layer_tensors)  # FSDP: this layer gathered
    ws = _first_mm_workspace(R, s, fs, parts, recompute)          # made at the first matmul's output, where written
    if s is not None and ws is None:
        s.workspace(R, 0)                                         # the first layer's first matmul
    fs.adapter_units(R, fs.adapters)                              # FSDP1: its LoRA units' forward
    if recompute == "none" and parts.events:                      # a derived layer, tensor by tensor
        kept = _sequence_forward(R, q, parts, keep=True)
    elif recompute == "none":
        kept = _saved_and_casts(R, q, parts)                      # saved tensors + autocast weight copies
        R.frees(R.allocs(parts.forward_only))                     # what the forward makes and frees
    else:
        late: list = []                                           # alive when the output is made
        op = _op_forward(R, q, parts, tk.layer, recompute, late, ws)  # per-op: tensor by tensor, where written so
        if op is not None:
            (cached if cached is not None else []).extend(op.casts)
            kept = _Kept(list(op))
        else:
            (cached if cached is not None else []).extend(_checkpointed(R, q, parts, recompute, late))  # no-grad
            kept = _Kept(R.allocs(_kept_blocks(parts, tk.layer, recompute),  # what the checkpoint keeps
                                  one=_kept_whole(parts, tk.layer, recompute)))
        R.frees(late)
    if q.ds_linear_kept and recompute != "full" and not q.ds_events:  # DeepSpeed ZeRO-3 under F.linear: the
        # gathered weights its saved views keep, made on the all-gather stream under overlap_comm (the
        # ``torch.cat`` of ``AllGatherCoalescedHandle.wait`` in ``fetch_sub_module``'s stream context)
        kept.append(R.alloc(q.ds_linear_kept, GATHER_STREAM * q.ds_streams))  # (quantities.deepspeed_linear_kept)
    if fs.grad_op:
        fs.gathered.append(params)                                # grad-op: kept until its post-backward
    elif keep:
        fs.last = params                                          # not resharded after forward
    else:
        fs.reshard(R, params)                                     # resharded after forward
    return kept


def _layer_gather(q: Quantities, fs: _Fsdp) -> int:
    """Bytes of one layer's unshard in forward (``_Fsdp.unshard``'s ``flat``): the all-gather buffer
    under full / hybrid sharding (``fsdp_layer_buf``); under SHARD_GRAD_OP (FSDP2
    ``reshard_after_forward=False``), where ``fsdp_layer_buf`` is 0 because nothing more is gathered in
    backward, the same unshard at the layer's forward: FSDP2's flat all-gather output
    (``fsdp_ag_result``, the parameters then copied out of it), FSDP1's unsharded flat parameter
    (``gathered_layer``). torch 2.13 ``fsdp/_runtime_utils.py`` ``_pre_forward_unshard`` L440-460
    unshards every strategy; ``_post_forward_reshard`` L478-497 reshards only
    ``RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES`` (not SHARD_GRAD_OP); ``_fully_shard/_fsdp_param_group.py``
    ``post_forward`` reshards only with ``reshard_after_forward``. They stay gathered until the layer's
    post-backward reshards it (``_layer_backward``)."""
    if q.fsdp_layer_buf > 0 or not fs.grad_op:
        return q.fsdp_layer_buf
    return q.fsdp_ag_result if fs.v2 else q.gathered_layer


def _checkpointed(R: _Replay, q: Quantities, parts: list[int], recompute: str, late: list | None = None) -> list:
    """A checkpointed layer's first forward. Nothing is saved, so each tensor lives only as long as
    the layer's code holds it. A hand-written layer whose forward is written tensor by tensor
    (``parts.nograd``, ``estimate/nograd.py``) is replayed so (``_nograd_forward``, under autocast
    with its weight copies, kept as below), the tensors alive when its output is made handed to
    ``late``, freed once the caller has made it. Else, under
    autocast with the copies replayed linear by linear (``_forward_casts``), as a chain, each of
    the layer's tensors freed once the next is made, each linear's half weight copy, made where the
    linear runs, staying in autocast's cache until the autocast context around the model's
    forward exits after the loss (``autocast_mode.cpp`` ``cached_cast`` caches a leaf fp32 weight
    that requires grad while grad mode is on, which non-reentrant checkpointing leaves on;
    ``torch.autocast.__exit__`` calls ``torch.clear_autocast_cache()``; trace, Llama-3.2-1B
    bf16-amp with full recompute: every layer's copies are freed together after the loss).
    Elsewhere (not full recomputation, or no copies to cache: ``_forward_casts``) its tensors
    are made and freed together. Returns the copies, to be freed when the forward ends."""
    casts = _forward_casts(q) if recompute == "full" else None
    if recompute == "full" and getattr(parts, "events", ()):      # a derived layer, tensor by tensor
        return _sequence_forward(R, q, parts, keep=False, casts=casts or False).casts
    if recompute == "full" and getattr(parts, "nograd_events", ()):  # a hand-written layer, tensor by tensor
        return _nograd_forward(R, parts, late if late is not None else [], casts)
    one = getattr(parts, "whole", True)
    if casts is None:
        R.frees(R.allocs(parts, one=one))
        return []
    copies: list = []
    prev: list = [None]
    done = 0
    for (pos, _w, _g), nbytes in zip(q.detail.layer.linears, casts):
        _chain(R, list(parts[done:pos]), prev, one)
        done = max(done, pos)
        copies.append(R.alloc(nbytes))                            # (out, in) in bf16/fp16, cached
    _chain(R, list(parts[done:]), prev, one)
    R.free(prev[0])
    return copies


def _first_mm_workspace(R: _Replay, s: "_Step | None", fs: "_Fsdp", parts: Any, recompute: str) -> Any:
    """Where a layer's first forward is replayed tensor by tensor (``_op_forward``), the forward
    thread's cuBLAS workspace is made inside its first matmul, after the matmul's output: ``at::mm``
    allocates its result, then ``at::cuda::blas::gemm`` takes the handle, whose workspace the caching
    allocator gives at its first use (torch 2.13 ``aten/src/ATen/native/cuda/Blas.cpp``
    ``addmm_out_cuda_impl``, ``CUDABlas.cpp`` ``getCUDABlasLtWorkspace``; trace, Mistral-shaped b4
    s512 bf16-amp: q_proj's input cast, weight copy, output, then the 8.125 MiB workspace). Returns
    the call that makes it (``_Step.workspace``), for ``_nograd_forward`` at that output; None
    elsewhere (made before the layer, ``_layer_forward``), and where FSDP1 gathers LoRA units first."""
    if s is None or fs.adapters or _op_written(parts, recompute) is None or s.workspaces or not s.handle_ws:
        return None
    return lambda: s.workspace(R, 0)


def _op_forward(R: _Replay, q: Quantities, parts: _Parts, layer: int, recompute: str, late: list,
                ws: Any = None) -> "_Kept | None":
    """A layer's first forward under torchtitan's per-op selective checkpointing, in its code's order
    (``_nograd_forward``, where the layer is written tensor by tensor: ``parts.nograd_events``): the
    checkpoint is non-reentrant, so grad mode stays on and its pack hook keeps nothing but what the
    policy marks ``MUST_SAVE`` (torch 2.13 ``utils/checkpoint.py`` ``_checkpoint_hook``,
    ``_CachingTorchDispatchMode``: the op's output stored as it is made, no copy). So every tensor
    lives as the no-grad forward's does except the policy's outputs (``parts.nograd_op``: the odd
    ``aten.mm`` and the fused SDPA kernel's), kept from where their op runs, and autocast caches each
    linear's half weight copy where the linear runs until autocast exits after the loss (grad mode
    on: ``autocast_mode.cpp`` ``cached_cast``, as ``_checkpointed`` says for full recomputation;
    ``_forward_casts``). Returns what the layer keeps (its output, made at "o" as ``_kept_blocks``'
    input block, then the policy's outputs) with the copies as ``casts``; None where the layer is
    not written so or its policy outputs are not the recipe's (``parts.op``), and the replay makes
    the layer's tensors at once, the policy's outputs after them, without copies (``_checkpointed``).
    Against trace, Llama-3.2 shapes (2 layers, b8 s256, bf16-amp, Adam, for-loop) under --recompute
    op: the replay's first forward opened 7 segments of 32 MiB to trace's 12 (no 32 MiB MLP weight
    copies, the gate's output made after the layer's tensors were freed); now 12, and the first
    step's reserved peak 8522 MiB to trace's 8496 (9400 before; tests/test_op_forward_replay.py).
    Its second step opened a 1002 MiB segment more while the backward was one block (``_by_op``
    now replays it op by op; docs/agreement.md, reserved section, ``bwlay``)."""
    op = list(getattr(parts, "op", []))
    rest = _op_written(parts, recompute)
    if rest is None or layer < sum(op):
        return None
    held: list = []
    copies = _nograd_forward(R, parts, late, _forward_casts(q), held=held, ws=ws)
    out = R.alloc(layer - sum(op))                                # the layer's output, which the checkpoint keeps
    return _Kept([out] + held + R.allocs(rest), copies)


def _op_recomputed(q: Quantities, parts: _Parts) -> _Parts:
    """A layer's saved tensors as its recomputation under the per-op policy remakes them: those the
    policy kept (``LayerCoefs.op_saved``) taken from its cache, 0 bytes (their positions kept, for
    ``_saved_and_casts``' linears)."""
    cached = set(q.detail.layer.op_saved)
    redo = copy.copy(parts)
    redo[:] = [0 if i in cached else x for i, x in enumerate(parts)]
    return redo


def _op_written(parts: Any, recompute: str) -> list[int] | None:
    """Under torchtitan's per-op policy, where the layer's forward is written tensor by tensor
    (``parts.nograd_events``) with the policy's outputs marked (``parts.nograd_op``): of those
    outputs as the recipe counts them (``parts.op``), the ones the written sequence leaves out
    (tensors of one element per row, the fused SDPA kernel's logsumexp: small-pool blocks apart from
    the layer's large ones). None elsewhere, or where a written one is not among the recipe's or a
    left-out one is large (the two do not describe the same layer)."""
    keep = getattr(parts, "nograd_op", ())
    if recompute != "op" or not keep or not getattr(parts, "nograd_events", ()):
        return None
    rest = sorted(getattr(parts, "op", []))
    for x in (int(parts.nograd[i]) for i in keep):
        if x not in rest:
            return None
        rest.remove(x)
    return rest if all(x <= SMALL_SIZE for x in rest) else None


def _nograd_forward(R: _Replay, parts: _Parts, late: list, casts: list | None = None,
                    held: list | None = None, ws: Any = None) -> list:
    """A hand-written layer's checkpointed first forward in its code's order (``LayerCoefs.nograd_events``,
    ``estimate/nograd.py``): "t" makes the next temporary, "fK" frees the K-th; at "o" (the layer's
    output, which the caller makes as what the checkpoint keeps) the temporaries still alive go to
    ``late``. Against trace, Llama-2-7B cut to 2 layers, b2 s1024, pure bf16, full recomputation
    (``compare --trace``), peak reserved: LoRA r64 +7.27 % -> -0.04 % (all of the layer's tensors made
    at once before), full fine-tuning -0.17 % -> -1.13 % (reentrant), +3.59 % -> +3.08 % (not).
    Under autocast "c" makes the next linear's half weight copy, kept in autocast's cache (returned,
    freed when the forward ends, as ``_checkpointed``'s chain keeps them) where the replay makes the
    copies linear by linear (``casts``, ``_forward_casts``); else the forward caches none. ``held``
    (per-op checkpointing, ``_op_forward``): the temporaries of ``parts.nograd_op`` are moved there
    as they are made, never freed here."""
    live: dict[int, Any] = {}                                     # temporary's index -> handle
    made = 0
    sizes = iter(casts or [])
    copies: list = []
    keep = set(getattr(parts, "nograd_op", ())) if held is not None else set()
    for e in parts.nograd_events:
        if e == "t":
            live[made] = R.alloc(parts.nograd[made])
            if made in keep:                                      # ``held``: kept by the per-op policy
                held.append(live.pop(made))                       # (``_op_forward``)
            if ws is not None and made == min(keep):              # the first matmul's output (q_proj's):
                ws()                                              # its workspace (``_first_mm_workspace``)
            made += 1
        elif e == "c":
            nbytes = next(sizes, None)
            if casts is not None and nbytes is not None:
                copies.append(R.alloc(nbytes))                    # (out, in) in bf16/fp16, cached
        elif e == "o":
            break
        else:
            R.free(live.pop(int(e[1:]), None))
    late.extend(live.values())
    return copies


def _sequence_forward(R: _Replay, q: Quantities, parts: _Parts, keep: bool, casts: bool | list = True) -> "_Kept":
    """A derived layer's forward in the order its traced forward made and freed its tensors
    (``LayerCoefs.fwd_events``, ``trace.derive._layer_sequence``): each saved tensor, each temporary
    (freed where the trace freed it: ``_Temps``) and each linear's autocast weight copy where it was
    cast (``_linear_casts``; else, under autocast, one block after them, as ``_saved_and_casts``).
    ``keep``: the saved tensors are kept for backward; else (a checkpointed first forward, which
    saves nothing: torch 2.13 ``utils/checkpoint.py`` ``_checkpoint_hook`` L1153-1163) each lives
    until its last consumer has run, where the record has it ("uK", ``trace.derive._last_reads``:
    against trace, a cut Qwen3-32B under FSDP2 with full recomputation, docs/validation.md ``lastuse``),
    else (a record derived before COEF_VERSION 19) they are chained as ``_checkpointed`` chains them,
    each freed once the next is made; the copies are kept only where ``casts`` (autocast's cache:
    their sizes, ``_forward_casts``)."""
    sizes = casts if isinstance(casts, list) else _linear_casts(q) if casts else None
    saved, copies, temps = iter(parts), iter(sizes or []), _Temps(parts.temps)
    handles: list = []
    made: list = []
    prev: list = [None]
    reads: dict | None = None if keep or not any(e[0] == "u" for e in parts.events) else {}  # K -> handle
    carry, done = R.carry, 0                                      # the layer before's late frees
    R.carry = []
    for e in parts.events:
        carry = _late_frees(R, carry, done)
        done += e in ("s", "c", "t")
        if e == "s" and reads is not None:
            reads[len(reads)] = R.alloc(next(saved))        # (freed ones stay as None)
        elif e == "s":
            _saved(R, next(saved), keep, handles, prev)
        elif e[0] == "u" and reads is not None:
            R.free(reads.get(int(e[1:])))                         # its last consumer has run
            reads[int(e[1:])] = None
        elif e == "c" and sizes is not None:
            made.append(R.alloc(next(copies)))                    # (out, in) in bf16/fp16
        elif e != "c":
            temps.event(R, e)
    for x in saved:   # tensors the traced layer did not save, added for the run's release or framework
        _saved(R, x, keep, handles, prev)  # (``quantities.derived_clamp``, ``litgpt_terms``): after the traced ones
    R.carry += [(at, h) for at, h in carry if at == LATE]          # (kept to the loss)
    R.frees([h for at, h in carry if at != LATE] + list(temps.live.values())
            + [h for h in (reads or {}).values() if h is not None])
    R.free(prev[0])
    if keep and sizes is None and q.cast_layer:
        made.append(R.alloc(q.cast_layer, one=False))             # the copies as one block (``_saved_and_casts``)
    return _Kept(handles, made) if sizes is not None else _Kept(handles + made)


def _saved(R: _Replay, nbytes: int, keep: bool, handles: list, prev: list) -> None:
    """One of a derived layer's saved tensors: kept (``handles``), or chained (``_chain``)."""
    if keep:
        handles.append(R.alloc(nbytes))
    else:
        _chain(R, [nbytes], prev)


@dataclass
class _Temps:
    """A derived layer's temporaries while its forward runs (``_sequence_forward``): "t" makes the
    next, "fK" frees the K-th, "dK@J" hands the K-th to the next layer, which frees it once J of its
    tensors are made (``_late_frees``; "end": by the loss, ``LATE``)."""

    sizes: list
    live: dict = field(default_factory=dict)   # temporary's index -> handle
    made: int = 0

    def event(self, R: _Replay, e: str) -> None:
        if e == "t":
            self.live[self.made] = R.alloc(self.sizes[self.made])
            self.made += 1
        elif e.startswith("f"):
            R.free(self.live.pop(int(e[1:]), None))
        elif e.startswith("d"):
            k, at = e[1:].split("@")
            R.carry.append((LATE if at == "end" else int(at), self.live.pop(int(k), None)))


#: a derived layer's temporary freed after the layers (``dK@end``): by the loss (``_forward``)
LATE = 1 << 62


def _late_frees(R: _Replay, carry: list, done: int) -> list:
    """Free the layer before's temporaries whose time has come (``done`` of this layer's tensors
    made: a ``dK@J`` event with J <= done); returns those still waiting."""
    R.frees([h for at, h in carry if at <= done])
    return [(at, h) for at, h in carry if at > done]


def _chain(R: _Replay, sizes: list[int], prev: list, one: bool = True) -> None:
    """Tensors made one after another, each freeing the one before (``prev[0]``: the last alive;
    ``one``: each block is one tensor, ``_Replay.alloc``)."""
    for x in sizes:
        h = R.alloc(x, one=one)
        R.free(prev[0])
        prev[0] = h


def _recompute_casts(q: Quantities) -> bool:
    """Whether a fully recomputed layer's autocast weight copies are replayed linear by linear: in
    its first forward (``_checkpointed``) and again in its recomputed forward, whose backward then
    makes each weight's gradient as a layer without recomputation does (``_linears_backward``).
    Where the replay follows the layer's linears under autocast (``_linear_casts``) and the forward
    caches the copies (``q.cast_forward_only``, or ``q.cast_stage_only`` on a pipeline's last stage:
    not under LoRA, whose frozen weights autocast does not cache)."""
    return bool(q.cast_forward_only or q.cast_stage_only) and _linear_casts(q) is not None


class _Kept(list):
    """Handles of what one layer keeps for its backward; ``casts``: autocast's half copies of its
    linears' weights, one handle per linear in forward order (``_linear_casts``), kept apart so that
    each linear's backward frees its own."""

    def __init__(self, handles: list, casts: list | None = None) -> None:
        super().__init__(handles)
        self.casts = casts or []


def _forward_casts(q: Quantities) -> list[int] | None:
    """Bytes of autocast's half copy of each linear's weight in one layer, in forward order, as a fully
    recomputed layer's first forward caches them (``_checkpointed``): wherever the forward caches the
    copies (``q.cast_forward_only``, or ``q.cast_stage_only`` on a pipeline's last stage) and the
    layer's recipe lists the linears autocast copies (``LayerCoefs.linears``; their sizes summing to
    ``q.cast_layer``). Unlike ``_linear_casts`` this does not need ``_linear_replay``: that gate is
    for the backward's weight gradients, which FSDP, TP and ZeRO make elsewhere, while the cache is
    the same under them. FSDP2's unsharded parameter is an ``nn.Parameter`` leaf requiring grad
    (torch 2.13 ``_fully_shard/_fsdp_param.py`` ``init_unsharded_param``), so ``cached_cast`` keeps
    its bf16 copy (``aten/src/ATen/autocast_mode.cpp``: fp32, requires grad, leaf, not a view)
    after ``reshard`` frees the unsharded weight, until autocast exits after the loss. Without them
    the replay of Llama-3.1-8B FSDP2 over 8, b2 s4096, full recomputation missed 32 layers' copies
    (416 MiB each, 13 GiB) at the loss, its peak allocated 33.0 against trace's 44.2 GiB
    (docs/validation.md ``runex``). None where the forward does not cache them."""
    lc = q.detail.layer
    if not (q.cast_forward_only or q.cast_stage_only) or not q.cast_layer or not lc.linears or lc.after_uncast:
        return None
    casts = [round(w) * HALF for _pos, w, _g in lc.linears]      # (out, in) each, bf16/fp16
    return casts if sum(casts) == q.cast_layer else None


def _linear_casts(q: Quantities) -> list[int] | None:
    """Bytes of autocast's half copy of each linear's weight in one layer, in forward order.
    ``cached_cast`` casts an fp32 weight at its linear's first call, after the linear's input is cast
    (``F.linear`` under autocast: ``at::linear`` is on the lower-precision list, its arguments cast
    in order), one tensor per weight, and the matmul saves it for the input's gradient
    (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``; ``derivatives.yaml`` ``mm``: ``mat2`` saved
    when ``self`` requires grad). From the layer's recipe (``LayerCoefs.linears``); None without
    autocast copies, where the replay keeps one block for them (``_linear_replay``), or where the
    recipe's linears are not the tensors autocast copies (a derived architecture has no recipe: its
    copies are one block)."""
    if not q.cast_layer or not _linear_replay(q):
        return None
    casts = [round(w) * HALF for _pos, w, _g in q.detail.layer.linears]
    return casts if sum(casts) == q.cast_layer else None


def _saved_and_casts(R: _Replay, q: Quantities, parts: list[int], inputs: bool = True) -> _Kept:
    """One layer's forward without recomputation: the tensors it saves, in order, with autocast's
    weight copies made between them at their linears (``_linear_casts``; else one block after them).
    A linear's fp32 input that autocast casts and does not save (``layers.linear_inputs``: a norm's
    output, GPT-2's GELU output) is alive from before its saved half cast (the last tensor saved
    before the linear) until the weight of the last linear reading it is cast, where its matmul
    runs. Without it the replay of GPT-2 (2 layers, b1 s1024, bf16-amp) lacked the fp32 GELU output
    (12 MiB) beside ``c_proj``'s weight copy, so trace's 20 MiB segment for that copy, which later
    holds autograd's cuBLAS workspace, was never opened and the workspace split a logits segment for
    good: +18.5 % over trace's peak reserved memory (docs/agreement.md, reserved section).
    ``inputs`` False: a checkpointed layer's recomputation in backward (``_layer_backward``), whose
    frames' unsaved tensors, these inputs among them, are replayed apart (``_recompute_blocks``:
    ``LayerCoefs.recompute_moments``); replayed here too they took the segment that trace's
    recomputation leaves to the loss (Llama b1 s1024, offloaded activations, ga 2: +0.56 -> +6.25 %)."""
    casts = _linear_casts(q)
    one = getattr(parts, "whole", True)                           # (a derived layer's parts: several tensors)
    if casts is None:                                             # the copies as one block: several tensors
        return _Kept(_attn_allocs(R, parts, 0, len(parts), one) + [R.alloc(q.cast_layer, one=False)])
    handles: list = []
    copies: list = []
    done = 0
    held = None                                                   # the unsaved fp32 input being read
    unsaved = getattr(parts, "inputs", []) if inputs else []
    for i, ((pos, _w, _g), nbytes) in enumerate(zip(q.detail.layer.linears, casts)):
        size, shared = unsaved[i] if i < len(unsaved) else (0, 0)
        if size and held is None:                                 # made before its half cast, the last saved
            cut = max(done, pos - 1)
            handles += _attn_allocs(R, parts, done, cut, one)
            done = cut
            held = R.alloc(size)
        handles += _attn_allocs(R, parts, done, pos, one)         # saved before this linear's weight cast
        done = max(done, pos)
        copies.append(R.alloc(nbytes))                            # (out, in) in bf16/fp16
        if held is not None and not shared:                       # its last linear has run
            R.free(held)
            held = None
    R.free(held)
    return _Kept(handles + _attn_allocs(R, parts, done, len(parts), one), copies)


def _attn_allocs(R: _Replay, parts: list[int], lo: int, hi: int, one: bool) -> list:
    """The saved tensors ``parts[lo:hi]`` (handles), with eager attention's forward temporaries made and
    freed among them in op order where the layer's recipe writes them (``_Parts.attn``: before the
    ``at``-th saved tensor, ``layers.Builder._eager_forward``: "t" makes the next temporary, "fK" frees
    the K-th, "s" makes the next saved tensor). Trace makes them so (transformers 5.24.0
    ``eager_attention_forward``: the scores, scaled and masked, softmax's fp32 copy of bf16 scores);
    without them a pure-bf16 Qwen2 (b2 s1024, dp 4) opened one fp32 softmax block per layer where trace
    opened two (docs/validation.md ``reslayer``)."""
    at, temps, events = getattr(parts, "attn", (-1, [], ()))
    if not lo <= at < hi or at + events.count("s") > hi:
        return R.allocs(parts[lo:hi], one=one)
    handles = R.allocs(parts[lo:at], one=one)
    live: dict[int, Any] = {}                                     # temporary's index -> handle
    made, nxt = 0, at
    for e in events:
        if e == "t":
            live[made] = R.alloc(temps[made])                     # (b, heads, s, s)
            made += 1
        elif e == "s":
            handles.append(R.alloc(parts[nxt], one=one))          # softmax's output, its half copy
            nxt += 1
        else:
            R.free(live.pop(int(e[1:]), None))
    R.frees(list(live.values()))
    return handles + R.allocs(parts[nxt:hi], one=one)


def _per_linear(q: Quantities, kept: _Kept, recompute: str) -> bool:
    """Whether a layer's backward is replayed linear by linear (``_linears_backward``): without
    recomputation, where ``_linear_replay`` allows it and, under autocast, the weight copies are
    the replay's blocks."""
    return _linear_replay(q) and recompute == "none" and (bool(kept.casts) or not q.cast_layer)


def _linear_replay(q: Quantities) -> bool:
    """Whether the replay follows the layer's linears (``quantities.per_linear_replay``, and the
    recipe lists them: ``LayerCoefs.linears``). Not for a layer with grouped experts
    (``LayerCoefs.after_uncast``): their weight gradients are no linears of the recipe and are made
    inside the experts' backward, which the replay does not place among the linears' (Mixtral-shaped,
    1 layer, 4 experts, against trace with one block and linear by linear: pure bf16 +1.2% and
    +7.2%, bf16-amp +5.5% and +0.3%; neither places the experts' gradients where trace does)."""
    lc = q.detail.layer
    return bool(q.linear_replay) and bool(lc.linears) and not lc.after_uncast


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


def _kept_whole(parts: list[int], kept: int, recompute: str) -> bool:
    """Whether each of ``_kept_blocks``' blocks is one tensor: the input, the per-op policy's outputs
    (where the layer's parts are tensors, ``_Parts.whole``); not the shares of Megatron's selective
    recomputation, each a fraction of a saved tensor."""
    if recompute == "full" or sum(parts) <= 0:
        return True
    op = getattr(parts, "op", [])
    return recompute == "op" and bool(op) and kept >= sum(op)


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
        params = fs.unshard_backward(R, q.fsdp_layer_buf, st.layer_tensors, prefetch=i > 0)
    per_linear = _per_linear(q, kept, recompute)                  # the weights' gradients linear by linear
    if recompute == "full" and _recompute_casts(q):               # the checkpointed forward again, with
        redo = _sequence_forward(R, q, parts, keep=True) if getattr(parts, "events", ()) else \
            _saved_and_casts(R, q, parts, inputs=False)           # autocast's weight copies at its linears
        R.frees([h for _at, h in R.carry])                        # (no next layer nor loss follows a recomputed one)
        R.carry = []
        kept, per_linear = _Kept(list(kept), redo.casts), True
    elif _op_written(parts, recompute) is not None and _recompute_casts(q):  # per-op policy (``_by_op``):
        redo = _saved_and_casts(R, q, _op_recomputed(q, parts), inputs=False)  # recomputed with its copies
        kept, per_linear = _Kept(list(kept), redo.casts), True
    else:
        redo = R.allocs(parts, one=getattr(parts, "whole", True)) if recompute != "none" else []  # forward again
    R.frees(R.allocs(_recompute_blocks(q, n, nsq)))               # ... its frames' own tensors meanwhile
    flat1 = bool(st.layer_grads_full and not fs.v2 and q.fsdp1_post)  # FSDP1: views, flat gradient, hook
    early = _fsdp1_early_views(q, st, n, nsq) if flat1 and not per_linear else None
    views = R.allocs(st.layer_tensors[j] for j in early) if early else []  # made by the worst moment
    where = ("layer", f"layer{i}")
    pre: set = set()
    held: list = []
    if _recorded(q, parts, recompute, flat1 or bool(st.layer_grads_full)):  # a derived layer, tensor by tensor
        pre, tr, per_linear = _recorded_backward(R, s, q, (parts.bwd, kept, below), where, oib), None, False
    elif per_linear and _by_op(q, parts, recompute, flat1):  # a hand-written layer, op by op
        pre, tr, per_linear = _op_backward(R, s, q, kept, (n, nsq), where, oib), None, False
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
        full = R.allocs(st.layer_tensors) if st.layer_tensors else [R.alloc(st.layer_grads_full, one=False)]
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
    ``_per_linear`` holds (one GPU, DDP, pipeline stages: ``quantities.per_linear_replay``).

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


def _op_backward(R: _Replay, s: _Step, q: Quantities, kept: _Kept, nb: tuple[int, int], where: tuple[str, ...],
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
    layer's saved tensors stay until the layer's end, as in the one-block replay: freeing each op's
    where its node ran (``Node::release_variables``) put the grid further from trace (27 rows moved,
    13 closer, 14 further; within 5 % 313 -> 308 of 409; docs/validation.md ``reslbw``), for a reason
    not found. ``nb``: (tokens, tokens x keys). Returns the trainable indices whose gradient was made."""
    lc, st = q.detail.layer, q.detail.states
    n, nsq = nb
    pending, made = list(_placed(st.trainables, where)), set()
    copies = list(kept.casts) or [None] * len(lc.linears)
    groups: list = []                                              # one op's moments, in recorded order
    for m in lc.moment_blocks:
        if groups and m[1] >= 0 and groups[-1][0][1] == m[1]:
            groups[-1].append(m)
        else:
            groups.append([m])
    for group in reversed(groups):
        half = None
        for k, (blocks, lin) in enumerate(group):
            hs = R.allocs([int(a * n + b * nsq) for a, b in blocks])  # (b, s, width) each, its dtype
            if lin >= 0 and k == 0:                                # mm: the weight gradient (half under autocast)
                half = _linear_grad(R, s, q, (lin, copies, pending, made), oib, cast=len(group) > 1)
            elif lin >= 0:                                         # ToCopyBackward0: its fp32 .grad
                _linear_grad(R, s, q, (lin, copies, pending, made), oib, cast=False)
                R.free(half)
                half = None
            R.frees(hs)
        R.free(half)
    R.frees(copies)
    kept.casts = []
    return made


def _linear_grad(R: _Replay, s: _Step, q: Quantities, lin: tuple, oib: bool, cast: bool) -> int | None:
    """One linear's weight gradient in ``_op_backward`` (``_linears_backward``' step): ``cast``: under
    autocast ``mm`` makes it in the compute dtype (returned, freed after ``ToCopyBackward0``) and its
    half weight copy is freed; else the ``.grad`` itself, the trainable of its size (``_grad_of``).
    ``lin``: (its index in ``LayerCoefs.linears``, the copies, the pending and made trainables)."""
    i, copies, pending, made = lin
    st = q.detail.states
    _pos, w, gbytes = q.detail.layer.linears[i]
    if cast:
        half = R.alloc(round(w) * HALF) if (copies[i] is not None and gbytes) else None
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
    (``quantities.deepspeed_leaf_held``), as its own block where that is the layer's worst moment: down's
    ``_grouped_mm`` backward made it before gate/up's gradient (DeepSpeed v0.19.8 ``stage3.py`` L1533:
    a leaf's gradients are reduced at the block's backward hook)."""
    i, nbytes = q.ds_leaf_held
    if not nbytes or best_transient(_backward_ops(q), n, nsq)[0] != i:
        return []
    return [nbytes]


def _backward_ops(q: Quantities) -> tuple:
    """The layer's backward-op transients, less the moments of its recomputed forward
    (``quantities.recompute_transients``, last in ``q.transients``): those are the forward's own
    tensors, one block each (``_recompute_blocks``), not one block."""
    return q.transients[:len(q.transients) - q.detail.recompute_ops]


def _recompute_blocks(q: Quantities, n: int, nsq: int) -> list[int]:
    """The blocks of the unsaved tensors a layer's recomputed forward holds at its largest moment
    (``LayerCoefs.recompute_moments``: the linear's input, peft's cast copy, the base output...),
    each its own tensor; none without those moments (``quantities.recompute_transients``)."""
    if not q.detail.recompute_ops:
        return []
    i, _v, _g = best_transient(q.transients[-q.detail.recompute_ops:], n, nsq)
    blocks = q.detail.layer.recompute_moments[i][3]
    return [int(a * n + b * nsq) for a, b in blocks if int(a * n + b * nsq) > 0]


def _activation_transient(q: Quantities, n: int, nsq: int) -> int:
    """``_transient`` without its constant bytes, where the replay makes each linear's weight
    gradients and frees its weight copy itself (``_linears_backward``): the constant of an op's
    transient is its own weight's gradients less the copies of the linears after it
    (``quantities._layer_transients``); what is left, per token and per token x key, is the
    gradients of the activations in flight, one block."""
    return max([0] + [int(a * n + b * nsq) for a, b, *_rest in _backward_ops(q)])


def _fsdp1_whole(q: Quantities, st: Any) -> bool:
    """Whether every parameter of an FSDP1 layer trains: its gradients are the views' of its flat
    parameter (``st.layer_tensors``), which ``SplitWithSizesBackward0`` concatenates after the last of
    them is made, the end of the layer's backward (``quantities.fsdp1_flat_gradient``)."""
    return bool(st.layer_tensors) and \
        sum(block_bytes(x, q.expandable) for x in st.layer_tensors) == st.layer_grads_full


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


def _fsdp1_reduce(R: _Replay, q: Quantities, st: Any, params: list, fs: "_Fsdp", made: list | None = None,
                  early: list[int] | None = None) -> list:
    """The end of an FSDP1 layer's backward (``quantities.fsdp1_flat_gradient``,
    ``fsdp1_post_backward``): each parameter view's gradient, when every parameter of the layer trains
    (``_fsdp1_whole``; those of ``early`` already ``made`` by the layer's worst moment,
    ``_fsdp1_early_views``; else the adapters' as one block), concatenated into the flat gradient;
    then the post-backward hook reshards the layer (its gathered parameters freed, ``_Fsdp.reshard``)
    and allocates the reduce dtype's copy and the new shard beside the flat gradient, all freed when
    it returns (the shard stands for the sharded gradients ``_make_grads`` allocates next; torch 2.13
    ``fsdp/_runtime_utils.py`` ``_post_backward_hook``: ``_post_backward_reshard`` before
    ``_reduce_grad``, whose ``padded_unsharded_grad`` and ``new_sharded_grad`` are made on the
    post-backward stream). The flat gradient is asked for at the unit's parameter bytes
    (``st.layer_tensors``' sum, trace's request; ``layer_grads_full`` sums each view's allocator block:
    Phi-3's 49.01 MiB layer asked 50.01 MiB, and the kept flat gradients of ``no_sync`` then fell into
    other holes than trace's). Returns the gathered parameters left to free."""
    early = early or []
    if _fsdp1_whole(q, st):
        rest = [x for j, x in enumerate(st.layer_tensors) if j not in early]
        views = list(made or []) + R.allocs(rest)
    else:
        views = [R.alloc(st.layer_grads_full, one=False)]            # (several)
    # SplitWithSizesBackward's cat: one tensor of the flat parameter's elements (its own bytes, not its views' blocks)
    flat = R.alloc(sum(st.layer_tensors) if _fsdp1_whole(q, st) else st.layer_grads_full)
    R.frees(views)
    fs.reshard(R, params)                                         # _post_backward_reshard
    if fs.no_sync:                                                # no_sync: the hook returns here, the flat
        fs.flat = flat                                            # gradient stays ``flat_param.grad``
        return []
    hook = [R.alloc(r, GRAD_STREAM, charge=c) for r, c in q.fsdp1_hook]  # the reduce dtype's copy, the shard
    R.frees([flat] + hook)
    return []


def _fsdp1_no_sync(q: Quantities, suffix: str) -> bool:
    """Whether FSDP1 runs this micro-batch's backward inside ``no_sync()`` (``--grad-sync step``,
    ``quantities.fsdp_no_sync``: every micro-batch but the step's last; the replay's first of two,
    ``.micro1``). Its post-backward hook reshards the unit and returns before ``_reduce_grad``
    (torch 2.13 ``fsdp/_runtime_utils.py`` ``_post_backward_hook`` L742-746: ``if not
    state._sync_gradients: ... return``): the flat gradient ``SplitWithSizesBackward0`` made on the
    default stream stays ``flat_param.grad``, unsharded, with no reduce dtype copy nor new shard on the
    post-backward stream (``_unit_grads``)."""
    return bool(q.fsdp_accumulates) and q.fsdp_ag_result <= 0 and _fsdp(q) and suffix == ".micro1"


def _unit_grads(R: _Replay, s: _Step, fs: "_Fsdp", trainables: tuple, where: tuple[str, ...], oib: bool,
                made: set | frozenset = frozenset()) -> None:
    """The gradients of an FSDP unit's (or, without FSDP, the placed tensors') trainable tensors at the
    end of its backward (``_make_grads``). FSDP1 inside ``no_sync()`` (``_fsdp1_no_sync``): the flat
    gradient the unit just kept (``_Fsdp.flat``, on the default stream, unsharded) is its ``.grad``
    until the step's last micro-batch. There ``AccumulateGrad`` adds the new flat gradient into it in
    place and the post-backward hook's ``_reduce_grad`` (torch 2.13 ``fsdp/_runtime_utils.py``
    L831-885: ``unsharded_grad = flat_param.grad.data; flat_param.grad = None``) reduce-scatters it
    into the new shard, made on the post-backward stream and kept as ``_saved_grad_shard``
    (``_get_reduce_scatter_tensors`` L888-903, ``_accumulate_sharded_grad`` L906-929): the unit's
    sharded gradient (``States.grad_shard_raw``; ``grad_rank_raw`` holds the unsharded accumulation's),
    and the accumulated unsharded gradient is dropped when the hook returns."""
    if fs.flat is not None:                                       # inside no_sync: kept as ``.grad``
        s.unsharded[where], fs.flat = fs.flat, None
        return
    kept = s.unsharded.pop(where, None)
    if kept is None:
        _make_grads(R, s, trainables, where, oib, fs.grad_stream, made, flat=fs.grad_stream > 0)
        return
    _flat_grads(R, s, trainables, [j for j in _placed(trainables, where) if j not in made], fs.grad_stream,
                shard=True)                                       # the new shard, (numel / world,) reduce dtype
    R.free(kept)                                                  # the accumulated unsharded gradient


def _fsdp1_limited(q: Quantities) -> bool:
    """Whether the replay models FSDP1's rate limiter and the frees that wait for the default stream
    (``_Fsdp1Lag``): FSDP1 (``FullyShardedDataParallel``, whose ``limit_all_gathers`` defaults to True
    and which trainmem's wrapper, Lightning's ``FSDPStrategy`` and torchtitan's and torchtune's FSDP1
    code leave on) resharding its layers (``--fsdp full``/``hybrid``)."""
    return _fsdp(q) and q.fsdp_ag_result == 0 and q.fsdp_layer_buf > 0


@dataclass
class _Fsdp1Lag:
    """How far the GPU may lag behind the CPU under FSDP1, and the frees that wait for it.

    FSDP1 frees a unit's gathered flat parameter, allocated on its unshard stream, after
    ``record_stream`` on the current stream, the default stream that computed with it (torch 2.13
    ``fsdp/_flat_param.py`` ``_free_unsharded_flat_param`` L1807-1821, "Do not free the memory until
    all ops in the current stream finish"). The caching allocator keeps such a block out of its pool
    until a later ``malloc`` finds the recorded event complete (``allocator.CachingAllocator.free_pending``),
    so it is reusable only once the GPU has run the default stream past the free. How far the CPU
    runs ahead is bounded by FSDP1's rate limiter, with no timing constant: every ``_reshard`` records
    a free event on the default stream right after that free, and every ``_unshard`` dequeues the
    oldest once two are queued and waits for it on the CPU (``_runtime_utils.py`` ``_unshard``
    L277-307, ``_reshard`` L310-330; ``_limiter_utils.py`` ``_FreeEventQueue``: at most 2). The
    replay takes the worst case that code allows: the GPU has done exactly what the CPU waited for.
    So a unit's all-gather finds the unit freed two reshards earlier reusable and the one freed just
    before still pending: in forward two flat parameters per layer slot, in backward three (the one
    in use, the lower layer's prefetched by ``BACKWARD_PRE``, the upper layer's pending).

    Not modelled, as the code bounds no lag for them or they are not replayed: autograd's flat
    gradient, recorded on the post-backward stream (``_post_backward_hook`` L770-775), is reusable
    only once that stream has reduce-scattered it, which the default stream waits for only at the
    end of backward (before PyTorch 2.8 indirectly, through the process group's single NCCL stream
    that also runs the later all-gathers; from 2.8 a synchronous collective runs on the current
    stream, pytorch/pytorch PR #150398); the low-precision shard (``_free_low_precision_sharded_param``,
    1/world of a layer, not replayed). The process group's collectives record nothing: with
    ``async_op=False`` ``_allgather_base`` and ``_reduce_scatter_base`` stash their tensors instead of
    ``recordStream`` (``avoidRecordStreams = avoidRecordStreams_ || (!opts.asyncOp)`` in
    ProcessGroupNCCL.cpp since late 2023, "added for libraries like FSDP"), and FSDP2 calls no
    ``record_stream``: neither is a pending free."""

    queue: list = field(default_factory=list)      # ticks of the queued free events (``_FreeEventQueue``)
    now: int = 0                                   # free events recorded so far
    done: int = 0                                  # the last one the CPU waited for
    pending: list = field(default_factory=list)    # (tick of the free, allocator token)

    def event(self) -> int:
        """``_reshard``'s free event, recorded on the default stream and queued: its tick."""
        self.now += 1
        self.queue.append(self.now)
        return self.now

    def wait(self, R: _Replay) -> None:
        """``_unshard``'s limiter: with two free events queued, the CPU waits for the oldest; the next
        ``malloc`` finds every free made before it released."""
        if len(self.queue) >= 2:
            self.done = max(self.done, self.queue.pop(0))
            self._release(R, self.done)

    def defer(self, R: _Replay, handle: int | None, tick: int) -> None:
        """Free ``handle`` pending until the default stream passes ``tick``."""
        if handle is not None:
            R.unlive(handle)
            self.pending.append((tick, R.a.free_pending(handle)))

    def synchronize(self, R: _Replay) -> None:
        """The host waits for the GPU: a blocking copy of the batch to the device (``copy_`` with
        ``non_blocking=False`` synchronizes the stream, ATen ``native/cuda/Copy.cu``)."""
        self.done = self.now
        self._release(R, self.now)

    def _release(self, R: _Replay, upto: int) -> None:
        for _tick, token in [p for p in self.pending if p[0] <= upto]:
            R.a.release(token)
        self.pending = [p for p in self.pending if p[0] > upto]


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


def _accumulated(R: _Replay, s: _Step, trainables: tuple, where: tuple[str, ...]) -> list:
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
        if s.grads.get((j, 0)) is not None:
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
    s.grads[(j, copy)] = R.alloc(g, stream)
    if isinstance(oib, tuple) and oib:                 # LOMO / AdaLomo: the next hook (this gradient's
        if s.lomo is not None:                         # parameter's) updates the one accumulated before
            _lomo_update(R, *s.lomo, oib)
        s.lomo = (s.grads[(j, copy)], g, _sts)
        s.grads[(j, copy)] = None
    elif oib or s.hook_frees:                          # (DeepSpeed ZeRO-1/2: copied into the bucket buffer,
        if oib and s.ao_events:  # torchao's compiled step in the hook, beside the gradient (``_torchao_graph``)
            _torchao_graph(R, s.ao_events[j])             # ``quantities.deepspeed_hook_partition``)
        R.free(s.grads[(j, copy)])
        s.grads[(j, copy)] = None


def _lomo_update(R: _Replay, grad: int | None, g: int, factors: tuple, lomo: tuple) -> None:
    """One parameter's update in lomo_optim's hook (``quantities.lomo_temporaries``), its gradient
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


@lru_cache(maxsize=256)
def _placed(trainables: tuple, where: tuple[str, ...]) -> tuple[int, ...]:
    """Indices of the trainable tensors placed at one of ``where``."""
    return tuple(j for j, item in enumerate(trainables) if item[0] in where)


def _scaled(sizes: list[int], total: int) -> list[int]:
    """``sizes`` scaled to sum to ``total`` (their proportions kept)."""
    whole = sum(sizes)
    return [x * total // whole for x in sizes] if whole > 0 and total > 0 else []


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


def _adafactor_step(R: _Replay, s: _Step, st: Any, loop: tuple, lazy: bool) -> None:
    """transformers' ``Adafactor.step`` (transformers 5.24.0 ``optimization.py`` L1203-1287), one
    tensor at a time in parameter order, each allocation in its op order (``quantities.adafactor_loop``
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
        R.free(g32)
        g32 = R.alloc(half) if half else None                    # grad.float() (half gradients)
        if lazy:
            s.states += [R.alloc(x) for x in st.trainables[j][3]]
        R.free(p32)
        p32 = R.alloc(half) if half else None                    # p.float() (half weights)
        sq = R.alloc(f)                                          # grad**2
        new = R.alloc(f)                                         # ... + eps
        R.frees([sq, upd])
        if row:                                                  # factored: the means, then _approx_sq_grad
            R.free(R.alloc(row))
            R.free(R.alloc(col))
            factors = [R.alloc(row), R.alloc(col)]
            upd = R.alloc(f)                                     # torch.mul(r_factor, c_factor)
            R.frees(factors)
        else:
            upd = R.alloc(f)                                     # exp_avg_sq.rsqrt()
        R.free(new)
        R.free(R.alloc(f))                                       # -update
    R.frees([g32, p32, upd])


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
    state-sized temporary per tensor of the group, all alive at once (``quantities.step_temporaries``);
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
        _zero3_step(R, s, q, order, bool(lazy))
    elif q.ds_flat12:                                            # DeepSpeed ZeRO-1/2: one flat group, its states
        _zero12_step(R, s, q, st, bool(lazy))                    # made inside the first step
    elif q.ds_step_fp32:                                         # DeepSpeed: one flat fp32 partition per group
        flat, fp32 = R.alloc(q.ds_step_flat), R.alloc(q.ds_step_fp32)   # the cast: flat copy, then fp32
        R.free(flat)
        R.free(R.alloc(q.step_temp - q.ds_step_fp32 - q.ds_step_flat, one=False))  # the optimizer's own temporaries
        R.free(fp32)
    elif temp_copies is None:                                    # foreach: the whole group's at once, each
        k = max(1, q.step_groups)                                # temporary per tensor as its own list (Adagrad 2)
        R.frees([b for _ in range(k) for b in R.allocs(_scaled(sizes, q.step_temp // k))])
    elif q.step_adafactor:                                       # transformers' Adafactor, in its op order
        _adafactor_step(R, s, st, q.step_adafactor, bool(lazy))
    elif q.step_linger and temp_copies and sizes:               # a loop whose last temporary lingers: the
        prev = None                                              # previous tensor's until the next's exist
        for x in sizes:                                          # (quantities.loop_pair_bytes)
            made = R.allocs([x] * temp_copies)
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
        R.frees(list(s.grads.values()))
        s.grads, s.made = {}, {}
    R.mark("zero_grad", step)
