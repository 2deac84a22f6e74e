"""PyTorch FSDP in the replay: its streams, a micro-batch's unsharded parameters and gradients
(``_Fsdp``), the root unit's reduce input, FSDP1's flat gradient at a layer's end and its rate
limiter's pending frees (``_Fsdp1Lag``)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ...allocator_rules import block_bytes
from ..quantities import Quantities
from .optimizer import _flat_grads, _make_grads
from .replay import GATHER_STREAM, GRAD_STREAM, _placed, _Replay, _Step


def _fsdp1_load(q: Quantities, st: Any) -> tuple:
    """Bytes of the tensors the load leaves on the device, in order (``States.load``); under FSDP1 with
    its layers units of their own (``fsdp1_post``) each unit's stored shard is one tensor: the root's
    (the parameters before and after the layers, ``load_split``), then each layer's. ``FlatParamHandle``
    flattens a unit's parameters into one ``FlatParameter`` and keeps only this rank's chunk of it,
    ``_get_shard``'s ``chunk.clone()`` (torch 2.13 ``fsdp/_flat_param.py`` ``shard`` L945-975,
    ``_get_shard`` L1122-1139): the unit's shard elements once (its padding, under a rank's share of
    the alignment, not counted). Trace (Phi-3 cut to 2 layers, FSDP1 dp 4) makes a 62.63 MiB root
    shard and two 12.25 MiB layer shards where the per-tensor shards took two 32 MiB and two 20 MiB
    segments. Left per tensor: LoRA adapters, embeddings or the head in units of their own, parameter
    offload (host shards), layers that differ; and the buffers (``_fsdp1_load_buffers``)."""
    nb, nl, na = st.load_split or (0, 0, 0)
    layers = st.load[nb:len(st.load) - na]
    if not (q.fsdp1_post > 0 and nl and len(layers) == nl * q.layers and not (
            q.fsdp1_adapter_units or q.fsdp1_emb_units or q.fsdp1_head_unit or q.fsdp1_host_shards)):
        return st.load
    flags = st.load_buffer or (False,) * len(st.load)
    params = tuple(0 if b else x for x, b in zip(st.load, flags))   # the buffers left out of the flat sums
    root = sum(params[:nb]) + sum(params[len(params) - na:])          # (embeddings, final norm, head) shard
    each = tuple(sum(params[nb + i * nl:nb + (i + 1) * nl]) for i in range(q.layers))   # each layer's
    return (root,) + each + _fsdp1_load_buffers(st)


def _fsdp1_load_buffers(st: Any) -> tuple:
    """Bytes of each registered buffer in ``States.load`` (``load_buffer``), in load order: FSDP1
    flattens a unit's parameters, not its buffers (torch 2.13 ``fsdp/_init_utils.py``
    ``_init_param_handle_from_module`` L563-640 hands ``_get_orig_params`` to ``FlatParamHandle``), so
    each stays a tensor of its own, after the shards as trace loads them (Llama's rotary
    ``inv_freq`` and ``original_inv_freq``, 128 B each, after the root's and the layers' shards)."""
    return tuple(x for x, b in zip(st.load, st.load_buffer) if b)


def _unsharded_grads(R: _Replay, fs: "_Fsdp", charge: int, raw: int) -> int | None:
    """FSDP's unsharded gradients of the final norm and head, or of an untied input embedding, one
    block charged ``charge``, their ``block_bytes`` as the estimate counts them (``_Replay.alloc``),
    requested at the tensors' own bytes ``raw`` (elements x the gathered dtype; a (vocab, hidden) fp32
    gradient's 125.25 MiB), as the head's matmul backward and ``AccumulateGrad`` ask the allocator for
    them; the rounded request (126 MiB: ``block_bytes`` charges a request of 10 MiB or more its whole
    segment only when it opens one) does not fit a 125.25 MiB block an earlier micro-batch left cached
    where trace's does (Phi-3 cut to 2 layers, FSDP1 dp 4, two micro-batches, ``--grad-sync step``: the
    replay opened 126 and 252 MiB segments in step 2, trace none). FSDP2 too, now that its root's
    post-backward reshards before it reduces (``driver._root_reduce``) and keeps the head's gradient
    past ``foreach_reduce``'s output (``_Fsdp.reduce``'s ``last``): before that, these requests had
    moved two grid rows 10-12 points off (a re-gathered 125.25 MiB root parameter took the 252 MiB
    segment the root's reduce-scatter input needed); with it, Mistral b8 s256 FSDP2 +9.14 -> +0.06 %.
    The head side tensor by tensor there (``_unsharded_head``)."""
    if charge <= 0:
        return None
    return R.alloc(raw, charge=charge) if raw > 0 else R.alloc(charge)


def _unsharded_head(R: _Replay, fs: "_Fsdp", st: Any) -> list:
    """The final norm's and head's unsharded gradients (``_unsharded_grads``), in registration order.
    FSDP2: each its own tensor (``States.head_grads_each``), each requested at its own bytes and charged
    its block: autograd makes each parameter's ``.grad`` (the unsharded parameters are separate
    ``nn.Parameter`` leaves, torch 2.13 ``_fully_shard/_fsdp_param.py`` L677-678), so the head's
    (vocab, hidden) gradient is a tensor of its own. One block of the two, 62.63 MiB for Phi-3's bf16
    (32064, 1024) head and (1024,) norm, did not fit the 62.62 MiB block trace's head gradient reuses in
    step 2 (Phi-3 (2 layers) b1 s2048 FSDP2 dp 2 bf16-mp, full recomputation: -15.7 % with the
    root's post-backward in torch's order, -0.8 % tensor by tensor). FSDP1: one block (its views)."""
    each = st.head_grads_each
    if st.head_grads_full <= 0:
        return []
    if not (fs.v2 and each and sum(each) == st.head_grads_raw):
        return [_unsharded_grads(R, fs, st.head_grads_full, st.head_grads_raw)]
    made = [R.alloc(x, charge=block_bytes(x, R.a.expandable_segments)) for x in reversed(each)]  # head first
    return made[::-1]


def _root_reduce_input(q: Quantities, fs: "_Fsdp") -> int:
    """Bytes of the root unit's reduce input at the end of backward, made while its unsharded gradients
    (``_Fsdp.reduce``'s ``grads``) are alive: FSDP2's flat reduce-scatter input (``fsdp_root_rs``, else
    the unsharded gradients in the reduce dtype); FSDP1's flat gradient, ``SplitWithSizesBackward0``'s
    ``torch.cat`` of the root's view gradients (``quantities.fsdp1.fsdp1_root_flat_gradient``: the whole root
    flat parameter, also where a tied head's gradient is the embedding's, whose ``head_grads_full`` and
    ``emb_grads_full`` are 0: trace, Gemma-2 FSDP1 dp 4, makes the 2,250 MiB cat after the tied sum,
    torch 2.13 ``fsdp/_flat_param.py`` ``_use_unsharded_views`` L1900-1960 makes the root's parameters
    views of the flat parameter)."""
    st = q.detail.states
    if not fs.v2 and q.fsdp1_root_flat:
        return q.fsdp1_root_flat
    return q.fsdp_root_rs or (st.head_grads_full + st.emb_grads_full) * fs.rs_factor(q)


def root_raw(q: Quantities, fs: "_Fsdp") -> tuple[int, int]:
    """FSDP2's root all-gather output and reduce-scatter input as torch requests them (0 each where
    not known, or not FSDP2's flat ``fsdp_root_rs``): one flat tensor each, every parameter padded
    along dim 0 to the shard count (torch 2.13 ``_fully_shard/_fsdp_collectives.py``
    ``foreach_all_gather``: ``all_gather_output = torch.empty((all_gather_input_numel * world_size,))``;
    ``foreach_reduce``: ``reduce_scatter_input = torch.empty((reduce_scatter_input_numel,))`` of the
    ``_get_dim0_padded_size`` sizes), unrounded. The charges stay ``fsdp_root`` and ``fsdp_root_rs``,
    the sums of the tensors' blocks (``_Replay.alloc``: the allocated peak does not move). Asking those
    sums instead asked up to 2 MiB more per tensor: trace, Qwen2 (vocabulary 151,936, h 896) FSDP2
    dp 2 bf16-mp, gathers its root in 272,271,104 B (259.66 MiB) from a 136,135,552 B bf16 input, a
    130 MiB segment; the replay's 130.0 MiB input opened a 132 MiB one."""
    if not fs.v2:
        return 0, fsdp1_root_grad_raw(q, fs)
    ag, rs = q.fsdp2_root_raw
    ag = ag if 0 < ag <= q.fsdp_root else 0                      # (never above the blocks charged)
    return ag, (rs if 0 < rs <= q.fsdp_root_rs and _root_reduce_input(q, fs) == q.fsdp_root_rs else 0)


def fsdp1_root_grad_raw(q: Quantities, fs: "_Fsdp") -> int:
    """FSDP1's root flat gradient as autograd requests it (0 where not known): ``SplitWithSizesBackward0``'s
    ``torch.cat`` of the root's view gradients (``_root_reduce_input``, ``Quantities.fsdp1_root_flat``) is
    the padded unsharded flat parameter's shape in its dtype, the all-gather destination's bytes
    (``Quantities.fsdp1_root_raw``, ``quantities.fsdp1.fsdp1_flat_bytes``; torch 2.13 ``fsdp/_flat_param.py``
    ``_use_unsharded_views`` L1900-1960 splits the views from the flat parameter by ``_numels_with_padding``,
    so the cat covers the padding too), unrounded; charged ``fsdp1_root_flat`` (the allocated peak does not
    move). Trace, Mistral cut to 2 layers (hidden 1024, vocabulary 32000) FSDP1 dp 4 pure bf16: the root's
    flat gradient is 131,074,048 B (125.002 MiB), which the replay had asked as its 126 MiB block."""
    raw = q.fsdp1_root_raw
    if fs.v2 or not q.fsdp1_root_flat or _root_reduce_input(q, fs) != q.fsdp1_root_flat:
        return 0
    return raw if 0 < raw <= q.fsdp1_root_flat else 0


def _root_resharded(q: Quantities, fs: "_Fsdp") -> bool:
    """FSDP2 reshards the root unit when its forward returns and gathers it again at its pre-backward
    (``quantities.fsdp_root.root_resharded_for_loss``): under ``--fsdp full``/``hybrid``, not grad-op."""
    return fs.v2 and q.fsdp_root > 0 and not q.fsdp_root_kept


def _fsdp(q: Quantities) -> bool:
    """Whether FSDP wraps the model (its units gathered and reduce-scattered)."""
    return q.fsdp_root > 0 or q.fsdp_layer_buf > 0


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
    held: int | None = None    # FSDP2: the root's last unsharded gradient, until ``foreach_reduce`` returns (``reduce``)

    @property
    def grad_stream(self) -> int:
        return self.streams[1]

    def unshard(self, R: _Replay, flat: int, tensors: tuple[int, ...], backward: bool = False,
                raw: int = 0) -> list:
        """A unit gathered: FSDP1's flat parameter, requested at ``raw`` bytes where given (its padded
        flat numel, ``quantities.fsdp1.fsdp1_flat_bytes``) and charged ``flat``, the block the estimate counts
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
        ag = self.gather_output(R, flat, raw)                     # the all-gather output, flat
        R.free(self.ag)
        self.ag = ag
        params = R.allocs(tensors)                                # each parameter copied out
        if backward:
            R.free(self.ag)
            self.ag = None
        return params

    def gather_output(self, R: _Replay, nbytes: int, raw: int = 0) -> int | None:
        """FSDP2's flat all-gather output of ``nbytes`` on the all-gather stream. Under bf16-mp each
        parameter's shard is first cast to bf16 into one flat all-gather input there, dropped once copied
        in (torch 2.13 ``_fully_shard/_fsdp_collectives.py`` ``foreach_all_gather`` L336-361:
        ``_get_param_all_gather_inputs`` L382-427, ``flat_foreach_copy_input = torch.empty(...,
        dtype=param_dtype)`` when ``use_foreach_copy``, i.e. a ``param_dtype`` differing from the stored
        one; ``del param_all_gather_inputs`` after ``all_gather_copy_in``): the output's size over the ranks.
        Trace, Phi-3 FSDP2 dp 2 bf16-mp: the root's gather opens a 64 MiB segment for it. ``raw``: the
        output's bytes as requested where known (``root_raw``), charged ``nbytes``."""
        want = raw or nbytes
        cast = R.alloc(-(-want // self.cast_shards), self.streams[0], one=False) if self.cast_shards else None
        out = R.alloc(want, self.streams[0], charge=nbytes if raw else 0)
        R.free(cast)
        return out

    def unshard_backward(self, R: _Replay, flat: int, tensors: tuple[int, ...], prefetch: bool,
                         raw: int = 0) -> list:
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
        first adapter's pre-backward (``quantities.fsdp1.fsdp1_unprefetched``), after the adapters ran their
        forward again in the recomputation and the later adapters their backward (``adapter_units``:
        found by trace, Llama-2-7B cut to 2 layers, FSDP1 dp 2 LoRA r64, Answer.AI's setup: trace opens
        no segment for that gather, the replay opened one of a layer's size before). ``raw``: FSDP1's
        flat parameter as requested (``unshard``)."""
        if flat > 0 and not self.v2 and self.lag is not None:
            params = [self.prefetched] if self.prefetched is not None else self.unshard(R, flat, tensors, raw=raw)
            self.prefetched = None
            self.adapter_units(R, self.adapters * self.recomputed + self.adapters - 1)
            if prefetch:
                self.prefetched = self.unshard(R, flat, tensors, raw=raw)[0]   # the lower layer's flat parameter
            return params
        if flat <= 0 or not self.v2 or not tensors:
            return self.unshard(R, flat, tensors, backward=True, raw=raw)
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

    def root_pre_backward(self, R: _Replay, flat: int, raw: int = 0) -> None:
        """FSDP1's root pre-backward hook, once the loss's gradient reaches the root's output: its
        ``_unshard`` (already gathered: only the limiter's dequeue and wait) and the top layer's
        ``BACKWARD_PRE`` prefetch (``_runtime_utils.py`` L672-694, L1208-1235), its flat parameter
        requested at ``raw`` bytes where given (``unshard``)."""
        if self.v2 or self.lag is None or flat <= 0:
            return
        self.lag.wait(R)
        self.prefetched = self.unshard(R, flat, (), raw=raw)[0]

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

    def reduce(self, R: _Replay, grads: list, rs_bytes: int, cast: int = 0, raw: int = 0,
               last: int | None = None) -> None:
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
        (``quantities.fsdp1.fsdp1_root_cast``), freed once the new shard is made (``reduced``). ``raw``:
        the input's bytes as requested where known (``root_raw``), charged ``rs_bytes``. ``last``: FSDP2,
        the handle among ``grads`` of the unit's last parameter's gradient, which ``foreach_reduce``'s
        dim-0 loop variable still references after ``unsharded_grads.clear()``, until it returns (torch 2.13
        ``_fsdp_collectives.py`` L580-590 ``for i, (fsdp_param, unsharded_grad) in enumerate(...)``, L606
        ``clear``, L612 the output allocated): kept past the sharded output (``reduced``), as the
        estimate's ``fsdp.root_reduce`` moment counts it (``Quantities.fsdp_root_last``). Passed for the
        root, whose last parameter is an untied head; a layer's last is a norm's (small, not replayed)."""
        if self.v2:                                               # the upper unit's input popped first
            R.free(self.rs)                                       # (``post_backward``: the root's too)
            self.rs = None
        rs = R.alloc(raw or rs_bytes, self.grad_stream if self.rs_side else 0, charge=rs_bytes if raw else 0)
        held = last if self.v2 and last in grads else None
        R.frees([g for g in grads if g is not held or held is None])
        self.held = held
        if self.no_sync:                                          # FSDP1's root inside no_sync: its flat
            self.flat = rs                                        # gradient kept (``_fsdp1_no_sync``)
        elif self.v2:
            self.rs = rs
        else:
            self.cast = R.alloc(cast, self.grad_stream) if cast else None   # (before the new shard)
            self.recorded(R, rs)                                  # the root's flat gradient

    def reduced(self, R: _Replay) -> None:
        """FSDP2 before PyTorch 2.5: ``foreach_reduce_scatter`` returns, once the sharded gradients are
        made, and its reduce-scatter input is freed (``reduce``); FSDP1's root hook returns and its
        flat gradient's fp32 copy is freed; FSDP2's ``foreach_reduce`` returns and the last gradient
        its loop variable held is freed (``reduce``'s ``last``)."""
        if self.rs_side:
            R.free(self.rs)
            self.rs = None
        R.frees([self.cast, self.held])
        self.cast = self.held = None

    def recorded(self, R: _Replay, handle: int | None) -> None:
        """FSDP1 drops autograd's flat gradient once its post-backward hook returns, after
        ``record_stream`` on the post-backward stream that reduce-scatters it (torch 2.13
        ``fsdp/_runtime_utils.py`` ``_post_backward_hook`` L770-775; torch 2.0 the same,
        ``unsharded_grad_data.record_stream(state._streams["post_backward"])``). Without the rate
        limiter the block stays pending until the host's next synchronization (``_Fsdp1Lag``);
        with it, freed at once (not modelled, ``_Fsdp1Lag``)."""
        if self.lag is not None and not self.v2 and not self.lag.limited:
            self.lag.defer(R, handle, self.lag.now)
        else:
            R.free(handle)

    def done(self, R: _Replay) -> None:
        R.frees([self.ag, self.rs, self.prefetched])
        self.ag = self.rs = self.prefetched = None


def _fsdp1_whole(q: Quantities, st: Any) -> bool:
    """Whether every parameter of an FSDP1 layer trains: its gradients are the views' of its flat
    parameter (``st.layer_tensors``), which ``SplitWithSizesBackward0`` concatenates after the last of
    them is made, the end of the layer's backward (``quantities.fsdp1.fsdp1_flat_gradient``)."""
    return bool(st.layer_tensors) and \
        sum(block_bytes(x, q.expandable) for x in st.layer_tensors) == st.layer_grads_full


def _fsdp1_reduce(R: _Replay, q: Quantities, st: Any, params: list, fs: "_Fsdp", made: list | None = None,
                  early: list[int] | None = None) -> list:
    """The end of an FSDP1 layer's backward (``quantities.fsdp1.fsdp1_flat_gradient``,
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
    fs.recorded(R, flat)                                          # recorded on the post-backward stream
    R.frees(hook)
    return []


def _fsdp1_no_sync(q: Quantities, suffix: str) -> bool:
    """Whether FSDP1 runs this micro-batch's backward inside ``no_sync()`` (``--grad-sync step``,
    ``quantities.fsdp_root.fsdp_no_sync``: every micro-batch but the step's last; the replay's first of two,
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
    code leave on; off before PyTorch 2.1 or where given, ``_Fsdp1Lag.limited``) resharding its layers
    (``--fsdp full``/``hybrid``)."""
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
    ``record_stream``: neither is a pending free.

    Without the rate limiter (``limited`` False: ``limit_all_gathers=False``, PyTorch < 2.1's default,
    ``quantities.fsdp1.fsdp1_unlimited``) FSDP1 records no free event and never waits (torch 2.0
    ``fsdp/_runtime_utils.py`` ``_unshard``/``_reshard``: both under ``if state.limit_all_gathers``), and
    nothing else in its step makes the host wait for the GPU: ``_wait_for_computation_stream``, the
    pre-forward's and the final callback's ``wait_stream`` are waits of one stream on another, the
    final callback's ``synchronize`` runs only under parameter offload. The worst case that code
    allows is then a GPU that has run nothing the host did not wait for: every gathered flat parameter
    and, in that mode, every flat gradient recorded on the post-backward stream (``_Fsdp.recorded``)
    stays pending until the host's next synchronization, the batch's blocking copy at the next
    micro-batch (``synchronize``; the published ViT-L run's loop syncs there too, torchmetrics'
    ``Accuracy.update`` after each step: ``_multiclass_stat_scores_tensor_validation``'s
    ``len(torch.unique(target))`` copies a count to the host). The caching allocator's own bound, its
    ``synchronize_and_free_events`` before a cudaMalloc retry, is ``allocator.CachingAllocator``'s
    device capacity. Not modelled: the CUDA driver's launch-queue depth, which blocks a host far enough
    ahead (a property of the driver, not of this code), and the padded reduce-scatter input's copy
    that FSDP1 of 2.0 made with ``F.pad`` whatever the padding. Found by Raschka's ViT-L/16 FSDP1 x4
    run on the PyTorch 2.1 nightly of 2023-06-23 (validation/published/memopt_08_vit_l16_fp32_fsdp4_ac_b64.json):
    with the limiter's bound -39.4 % on peak reserved, with this one -2.8 %."""

    limited: bool = True                           # ``limit_all_gathers``; False: no rate limiter (above)
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
        ``malloc`` finds every free made before it released. Without the limiter, nothing."""
        if self.limited and len(self.queue) >= 2:
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
