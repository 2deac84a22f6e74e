"""A layer's forward in the replay: its saved tensors with autocast's weight copies between them,
eager attention's temporaries and the other forward groups' a recipe writes in op order
(``LayerCoefs.fwd_groups``: GPT-2's GELU, Llama's RMSNorm and rotary embedding, a grouped-experts MoE
block's, attention on the math SDPA kernel), FSDP grad-op's gather, checkpointed and recorded forwards, the recomputation's tensors and casts."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ...allocator_rules import SMALL_SIZE
from ..group_events import Fwd, index
from ..layers import HALF
from ..moments import Tokens
from ..quantities import Quantities
from .fsdp import _Fsdp
from .parts import _Parts
from .replay import GATHER_STREAM, _Replay, _Step


def _layer_forward(R: _Replay, q: Quantities, fs: _Fsdp, parts: _Parts, tk: Tokens, recompute: str,
                   keep: bool = False, cached: list | None = None, s: _Step | None = None,
                   rebound: list | None = None) -> list:
    """One layer's forward: what it keeps for backward (a list of handles). ``keep``: its gathered
    parameters stay until its backward (``quantities.fsdp_root.fsdp2_last_gathered``); ``cached``: where a
    checkpointed layer's autocast weight copies go, freed when the forward ends (``_checkpointed``).

    ``rebound``: tensors freed once the layer's input exists (made before its unshard, by the caller's
    frame: ``_input_first``; GPT-2's embeddings' dropout or the block below), else before the layer.
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
    first = _input_first(R, parts, getattr(parts, "whole", True), rebound) \
        if recompute == "none" and not parts.events else None     # its input, made by the caller's frame
    flat = _layer_gather(q, fs)                                   # FSDP: this layer gathered (FSDP1: its flat
    params = fs.unshard(R, flat, q.detail.states.layer_tensors,   # parameter requested unrounded)
                        raw=q.fsdp1_layer_raw if flat == q.fsdp_layer_buf else 0)
    ws = _first_mm_workspace(R, s, fs, parts, recompute)          # made at the first matmul's output, where written
    mm_ws = _saved_mm_workspace(R, s, fs, parts, recompute)          # ... or in a hand-written layer's saved tensors
    if s is not None and ws is None and mm_ws is None:
        s.workspace(R, 0)                                         # the first layer's first matmul
    fs.adapter_units(R, fs.adapters)                              # FSDP1: its LoRA units' forward
    if rebound and (recompute != "none" or parts.events):         # (made apart from its saved tensors)
        R.frees(rebound)
        rebound.clear()
    if recompute == "none" and parts.events:                      # a derived layer, tensor by tensor
        kept = _sequence_forward(R, q, parts, keep=True)
    elif recompute == "none":
        kept = _saved_and_casts(R, q, parts, ws=mm_ws, rebound=rebound, first=first)  # saved tensors + autocast copies
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
        kept.append(R.alloc(q.ds_linear_kept, GATHER_STREAM * q.ds_streams))  # (quantities.zero3_gather.deepspeed_linear_kept)
    if fs.grad_op:
        fs.gathered.append(params)                                # grad-op: kept until its post-backward
    elif keep:
        fs.last = params                                          # not resharded after forward
    else:
        fs.reshard(R, params)                                     # resharded after forward
    R.frees(R.layer.resid_in)                                     # its unsaved input, held by the module call
    R.layer.resid_in.clear()                                      # until its hooks have run (``_group_allocs``)
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


def _saved_mm_workspace(R: _Replay, s: "_Step | None", fs: "_Fsdp", parts: Any, recompute: str) -> Any:
    """Where a hand-written layer's forward is replayed from its saved tensors (``_saved_and_casts``:
    no recomputation, not a derived layer), the forward thread's cuBLAS workspace is made at its first
    matmul too (``_first_mm_workspace``), once the tensors saved before it and its output, where saved,
    exist (``_Parts.ws_at``, ``layers.first_matmul_at``). Trace, GPT-2 b1 s2048 fp32: the embeddings'
    outputs, their sum, the dropout's output, ``ln_1``'s, ``c_attn``'s ``addmm`` output (saved by the
    flash kernel), then the 8.125 MiB workspace. Returns the call that makes it (``_Step.workspace``);
    None elsewhere (made before the layer) and where FSDP1 gathers LoRA units first."""
    if s is None or fs.adapters or recompute != "none" or getattr(parts, "events", ()) or s.workspaces \
            or not s.handle_ws or getattr(parts, "ws_at", -1) < 0:
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
    policy kept (``LayerCoefs.op_saved``) taken from its cache, and the layer's input (a group's
    ``Fwd.INPUT``), which the checkpoint saved itself and hands back, 0 bytes (their positions kept,
    for ``_saved_and_casts``' linears). The recomputation reads the input the checkpoint saved (torch
    2.13 ``utils/checkpoint.py`` L842-852 ``_CheckpointFrame.save_inputs``, ``get_inputs``; L1657-1688
    ``recompute_fn``: ``fn(*args)`` on the unpacked inputs, no copy; transformers 5.24.0
    ``models/llama/modeling_llama.py`` L296-297: ``residual = hidden_states``, the input norm reads it).
    The replay made it again, a 16 MiB fp32 block per layer beside the layer below's output, which is
    that input: Mistral b1 s1024 dp 2 fp32 Lion +5.43 -> -0.90 %, Llama b8 s256 pp 2 ga 3 AdamW-8bit
    +10.24 -> -0.08 % against trace's peak reserved memory (docs/agreement.md, reserved section, ``opin``)."""
    cached = set(q.detail.layer.op_saved) | set(_input_index(parts))
    redo = copy.copy(parts)
    redo[:] = [0 if i in cached else x for i, x in enumerate(parts)]    # bytes; 0: no request
    redo.groups = [(at, temps, tuple(Fwd.SAVED if e == Fwd.INPUT else e for e in events))
                   for at, temps, events in getattr(parts, "groups", [])]  # (the layer below's output not taken)
    return redo


def _input_index(parts: Any) -> list[int]:
    """Where the layer's input lies among its saved tensors: the position of each group's ``Fwd.INPUT``
    (``_group_allocs``), counting that group's saved tensors before it."""
    out: list[int] = []
    for at, _temps, events in getattr(parts, "groups", []):
        saved = [e for e in events if e in (Fwd.SAVED, Fwd.INPUT)]
        out += [at + k for k, e in enumerate(saved) if e == Fwd.INPUT]
    return out


def _op_written(parts: Any, recompute: str) -> list[int] | None:
    """Under torchtitan's per-op policy, where the layer's forward is written tensor by tensor
    (``parts.nograd_events``) with the policy's outputs marked (``parts.nograd_op``): of those
    outputs as the recipe counts them (``parts.op``), the ones the written sequence leaves out
    (tensors of one element per row, the fused SDPA kernel's logsumexp: small-pool blocks apart from
    the layer's large ones). None elsewhere, or where a written one is not among the recipe's or a
    left-out one is large (the two do not describe the same layer). The policy may keep nothing of a
    written layer: BERT with eager attention (biased linears run ``addmm``, its matmuls ``bmm``, neither
    on torchtitan's list), whose first forward is then replayed in its code's order too, its output
    the only block kept (before, its tensors at once: BERT-base b4 s512 bf16-amp eager AdamW per-op,
    -5.10 -> -0.07 % against trace's peak reserved memory)."""
    keep = getattr(parts, "nograd_op", ())
    if recompute != "op" or not getattr(parts, "nograd_events", ()):
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
    mm0 = getattr(parts, "nograd_mm0", -1)
    mm0 = mm0 if mm0 >= 0 else min(keep, default=0)               # (Llama's: q_proj's, the first kept)
    for e in parts.nograd_events:
        if e == "t":
            live[made] = R.alloc(parts.nograd[made])
            if made in keep:                                      # ``held``: kept by the per-op policy
                held.append(live.pop(made))                       # (``_op_forward``)
            if ws is not None and made == mm0:                    # the first matmul's output (q_proj's,
                ws()                                              # BERT's query): its workspace (``_first_mm_workspace``)
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
        _saved(R, x, keep, handles, prev)  # (``quantities.layer_terms.derived_clamp``, ``litgpt_terms``): after the traced ones
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
    autocast copies, where the replay keeps one block for them (neither ``_linear_replay`` nor, in
    forward only, FSDP2's ``_fsdp2_casts``), or where the
    recipe's linears are not the tensors autocast copies (a derived architecture has no recipe: its
    copies are one block)."""
    if not q.cast_layer or not (_linear_replay(q) or _fsdp2_casts(q)):
        return None
    casts = [round(w) * HALF for _pos, w, _g in q.detail.layer.linears]
    return casts if sum(casts) == q.cast_layer else None


def _saved_and_casts(R: _Replay, q: Quantities, parts: list[int], inputs: bool = True, ws: Any = None,
                     rebound: list | None = None, first: tuple | None = None, held_in: bool = False) -> _Kept:
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
    recomputation leaves to the loss (Llama b1 s1024, offloaded activations, ga 2: +0.56 -> +6.25 %).
    ``ws``: the cuBLAS workspace's call, made at the first matmul (``_saved_mm_workspace``); ``first``:
    the first saved tensor, the layer's input, made already (``_input_first``: its handles, how many);
    ``rebound``: where the tensors its frames hold until it returns go (``_layer_end``). ``held_in``: a
    recomputation under the per-op policy, which replays those held inputs here all the same (the norms'
    fp32 (b, s, h) outputs, transformers 5.24.0 ``models/llama/modeling_llama.py`` L67, remade as the
    first forward made them; ``_recompute_blocks`` has no moments of that recomputation to replay them
    from). Without them, once the layer's input was not made again (``_op_recomputed``), Llama-3.2 GQA
    b1 s2048 bf16-amp half loss went -0.01 -> +10.70 % against trace's peak reserved memory."""
    casts = _linear_casts(q)
    one = getattr(parts, "whole", True)                           # (a derived layer's parts: several tensors)
    ws = _group_workspace(R, parts, ws)                           # (made in a group, after its first matmul's output)
    at = getattr(parts, "ws_at", -1) if ws is not None else -1
    end: list = []                                                # held until the layer returns ("eK")
    pending: list = []                                            # (saved index, held input) released after it

    def saved(lo: int, hi: int, after: list | None = None) -> list:
        return _released_allocs(R, parts, (lo, hi), one, (after, end), pending)
    handles, done = first or ([], 0)
    if casts is None:                                             # the copies as one block: several tensors
        handles += saved(done, max(at, done))
        if ws is not None:
            ws()                                                  # the first matmul's workspace
        handles += saved(max(at, done), len(parts)) + [R.alloc(q.cast_layer, one=False)]
        _group_workspace(R, parts, None)
        if inputs:
            _resid_tail(R, parts, end)
        return _Kept(handles + _layer_end(R, end, rebound))
    copies: list = []
    held = None                                                   # the unsaved fp32 input being read
    unsaved = getattr(parts, "inputs", []) if inputs or held_in else []
    for i, ((pos, _w, _g), nbytes) in enumerate(zip(q.detail.layer.linears, casts)):
        size, shared = unsaved[i] if i < len(unsaved) else (0, 0)
        if size and held is None:                                 # made before its half cast, the last saved
            cut = max(done, pos - 1)
            after: list = []                                      # a group's inputs freed once it is made
            handles += saved(done, cut, after)
            done = cut
            held = R.alloc(size)
            R.frees(after)
        handles += saved(done, pos)                               # saved before this linear's weight cast
        done = max(done, pos)
        copies.append(R.alloc(nbytes))                            # (out, in) in bf16/fp16
        if i == 0 and ws is not None:                             # the first matmul: its output where saved,
            handles += saved(done, max(done, at))                 # then its workspace
            done = max(done, at)
            ws()
        if held is not None and not shared:                       # its last linear has run
            _release(R, held, (getattr(parts, "release", []) or [-1] * (i + 1))[i], pending, end)
            held = None
    R.free(held)
    handles += saved(done, len(parts))
    R.frees([h for _k, h in pending])
    _group_workspace(R, parts, None)
    if inputs:                                                    # (not a recomputation in backward)
        _resid_tail(R, parts, end)                                # down_proj's output, the layer's
    else:                                                         # (no model output references a recomputed
        R.frees(R.layer.out_refs)                                 # layer's cache tensors: ``_group_allocs``'s "cK")
        R.layer.out_refs.clear()
    return _Kept(handles + _layer_end(R, end, rebound), copies)


def _release(R: _Replay, held: Any, at: int, pending: list, end: list) -> None:
    """A linear's held unsaved input, once the linear has run: freed now (``at`` -1), at the layer's end
    (-2), or once the saved tensor ``at`` exists (``pending``; ``LayerCoefs.input_release``)."""
    if at == -1:
        R.free(held)
    elif at == -2:
        end.append(held)
    else:
        pending.append((at, held))


def _released_allocs(R: _Replay, parts: list[int], span: tuple, one: bool, lists: tuple, pending: list) -> list:
    """``_attn_allocs`` of ``parts[lo:hi]`` (``span``; ``lists``: its ``after``, ``end``), each held input in
    ``pending`` freed once the saved tensor it waits for is made."""
    lo, hi = span
    out: list = []
    for at, h in sorted(pending, key=lambda p: p[0]):
        if lo <= at < hi:
            out += _attn_allocs(R, parts, lo, at + 1, one, *lists)
            R.free(h)
            pending.remove((at, h))
            lo = at + 1
    return out + _attn_allocs(R, parts, lo, hi, one, *lists)


def _layer_end(R: _Replay, end: list, rebound: list | None) -> list:
    """What a layer's frames hold until it returns (``end``): handed to ``rebound``, freed once the next
    layer's input exists (``_input_first``; GPT-2's residual branches' dropout outputs, held by
    ``GPT2Block.forward`` until it returns its output, the next layer's input), else freed now."""
    if rebound is not None:
        rebound.extend(end)
    else:
        R.frees(end)
    return []


def _input_first(R: _Replay, parts: list[int], one: bool, rebound: list | None) -> tuple[list, int]:
    """Where tensors wait to be freed once the layer's input exists (``rebound``), its first saved tensor
    (the input a LayerNorm saves: GPT-2's ``ln_1``) made and they freed: (its handle, 1); else ([], 0).
    The caller's frame makes it before the layer is called, so before an FSDP unshard of the layer
    (trace, GPT-2 b1 s2048 FSDP2 dp 2: ``native_dropout``'s output, then the layer's all-gather)."""
    if not rebound or not len(parts) or any(g[0] == 0 for g in [getattr(parts, "attn", (-1,))] + list(getattr(parts, "groups", []))):
        return [], 0
    first = R.allocs(parts[:1], one=one)
    R.frees(rebound)
    rebound.clear()
    return first, 1


def _attn_allocs(R: _Replay, parts: list[int], lo: int, hi: int, one: bool, after: list | None = None,
                 end: list | None = None) -> list:
    """The saved tensors ``parts[lo:hi]`` (handles), with the forward temporaries of eager attention
    (``_Parts.attn``) and of the other groups a recipe writes in op order (``_Parts.groups``: GPT-2's
    GELU, ``layers._gelu_new_forward``; Llama's RMSNorm and rotary embedding; a grouped-experts MoE
    block's, ``layers._moe_forward_events``) made and freed among them (``_group_allocs``). A group whose
    saved tensors do not all lie in ``parts[lo:hi]`` is left out: its saved tensors are made alone.
    ``after``: where a group's "gK" temporaries go, freed by the caller once it has made the group's
    output (else freed at the group's end); ``end``: its "eK" temporaries, freed at the layer's end."""
    groups = sorted(g for g in [getattr(parts, "attn", (-1, [], ()))] + list(getattr(parts, "groups", []))
                    if lo <= g[0] < hi and g[0] + _group_saved(g[2]) <= hi)
    handles: list = []
    nxt = lo
    for at, temps, events in groups:
        handles += R.allocs(parts[nxt:at], one=one)
        later: list = []                                          # "nK": freed once the next saved tensor exists
        handles += _group_allocs(R, parts, (at, temps, events), one, after, (end, later))
        nxt = at + _group_saved(events)
        if later and nxt < hi:
            handles += R.allocs(parts[nxt:nxt + 1], one=one)
            nxt += 1
        R.frees(later)
    return handles + R.allocs(parts[nxt:hi], one=one)


def _group_allocs(R: _Replay, parts: list[int], group: tuple, one: bool, after: list | None,
                  ends: tuple = (None, None)) -> list:
    """One group of forward temporaries (``at``, bytes, events) made and freed among the saved tensors
    from ``parts[at]`` on, in op order where the layer's recipe writes them (``layers.Builder._eager_forward``,
    ``Recipe.forward_group``, codes ``group_events.Fwd``: "t" makes the next temporary, "fK" frees the K-th, "s" makes the next saved
    tensor, "gK" hands the K-th to ``after``, "eK" to ``end``, "nK" to ``later``, which the caller frees
    once it has made the next saved tensor (BERT's branch dropout output, ``layers._bert_branch_end``);
    "cK" to ``_LayerCarry.out_refs``, what the model output references (its KV cache: ``driver._forward`` frees it
    with the output), "hK" to ``_LayerCarry.attn_held`` until the next "H"; without the list, freed at the group's end; ``ends``: (``end``, ``later``)). Eager attention: trace makes them so (transformers 5.24.0
    ``eager_attention_forward``: the scores, scaled and masked, softmax's fp32 copy of bf16 scores);
    without them a pure-bf16 Qwen2 (b2 s1024, dp 4) opened one fp32 softmax block per layer where trace
    opened two (docs/validation.md ``reslayer``). Grouped experts: trace makes them so too (transformers
    5.24 ``integrations/moe.py`` L424-537: the gathered rows and SwiGLU product of frozen experts, the fp32
    weighted rows and their permuted copy); without them a Mixtral-shaped LoRA run (b4 s512, fp32) opened
    one (S, f) segment per layer fewer than trace, whose second step then opened a fourth logits-sized
    segment the replay did not (-10.4 % on the peak reserved memory). Returns the saved tensors' handles."""
    at, temps, events = group
    end, later = ends
    handles: list = []
    live: dict[int, Any] = {}                                     # temporary's index -> handle
    made, nxt = 0, at
    for e in events:
        if e == Fwd.TEMP:
            live[made] = R.alloc(temps[made])                     # (b, heads, s, s); experts' (S, h), (S, f), (T, h)
            made += 1
        elif e == Fwd.SAVED:
            handles.append(R.alloc(parts[nxt], one=one))          # softmax's output, its half copy; experts' rows...
            nxt += 1
        elif e == Fwd.INPUT:                                      # the layer's input, saved: the layer
            handles.append(_layer_input(R) or R.alloc(parts[nxt], one=one))  # below's output, else made
            nxt += 1
        elif e[0] == Fwd.HOLD:                                    # held past the group: freed at the next "H"
            R.layer.attn_held.append(live.pop(index(e), None))
        elif e[0] == Fwd.OUT_REF:                                 # referenced by the model output (its KV
            R.layer.out_refs.append(live.pop(index(e), None))     # cache): freed with it (``driver._forward``)
        elif e == Fwd.DROP_HELD:                                  # (``layers._llama_rotary_held``)
            R.frees(R.layer.attn_held)
            R.layer.attn_held.clear()
        elif e == Fwd.WORKSPACE:                                  # the first matmul's cuBLAS workspace,
            ws, R.layer.ws_here = R.layer.ws_here, None           # after its output (``_saved_and_casts``)
            if ws is not None:
                ws()
        elif e == Fwd.INPUT_TEMP:                                 # ... unsaved: the layer below's output
            R.layer.resid_in.append(_layer_input(R))              # (the first layer's: the embeddings'),
            made += 1                                             # freed after the layer's hooks
        elif e[0] == Fwd.AFTER and after is not None:
            after.append(live.pop(index(e), None))
        elif e[0] == Fwd.END and end is not None:
            end.append(live.pop(index(e), None))
        elif e[0] == Fwd.NEXT_SAVED and later is not None:
            later.append(live.pop(index(e), None))
        else:                                                     # Fwd.FREE (and a hand-off without its list)
            R.free(live.pop(index(e), None))
    R.frees(list(live.values()))
    return handles


def _group_workspace(R: _Replay, parts: Any, ws: Any) -> Any:
    """Where one of the layer's forward groups makes the first matmul's output and marks its cuBLAS
    workspace ("w": the Llama layer's ``q_proj``, ``layers._llama_rotary_group``), ``ws`` (``_saved_mm_workspace``'s
    call) is left to it (``_LayerCarry.ws_here``, taken by ``_group_allocs``) and None returned; else ``ws``.
    ``ws`` None (the layer's end): a call the group did not take is made now, and cleared."""
    if ws is None:
        left, R.layer.ws_here = R.layer.ws_here, None
        if left is not None:
            left()
        return None
    if any(Fwd.WORKSPACE in events for _at, _t, events in getattr(parts, "groups", [])):
        R.layer.ws_here = ws
        return None
    return ws


def _group_saved(events: Any) -> int:
    """How many saved tensors a forward group makes (``_group_allocs``: "s", and "i", the layer's input)."""
    return events.count(Fwd.SAVED) + events.count(Fwd.INPUT)


def _layer_input(R: _Replay) -> Any:
    """The layer's input as the layer below made it (``_resid_tail``; ``_LayerCarry.resid``), taken; None where
    no layer made it (the first layer: the embeddings' output, or the layer below does not write it)."""
    h, R.layer.resid = R.layer.resid, None
    return h


def _resid_tail(R: _Replay, parts: Any, end: list) -> None:
    """A layer whose residual stream is written in op order (``_Parts.tail``: ``LayerCoefs.resid_tail``), at
    its forward's end: ``down_proj``'s output (compute dtype), then the second residual add, the layer's
    output (the stream's dtype, ``_LayerCarry.resid``: the next layer's input, or the final norm's), after
    which ``down_proj``'s output and what the layer's frames hold until it returns (``end``: the first
    add's output, in a half stream) are freed (transformers 5.24.0
    ``models/llama/modeling_llama.py`` ``LlamaDecoderLayer.forward`` L313-315 and ``LlamaModel.forward``
    L393-394 rebinding ``hidden_states``; trace, a 2-layer Llama (h 1024) b4 s512 pure bf16: 4 MiB
    ``down_proj``, 4 MiB add, then 4 MiB x3 freed, before the next layer's or the final norm's tensors;
    the third, the layer's unsaved input, only once its module's forward hooks have run, ``_layer_forward``:
    under FSDP2 after its reshard). Elsewhere nothing."""
    tail = getattr(parts, "tail", [])
    if not tail:
        return
    down = R.alloc(tail[0])                                       # (b, s, h) compute dtype
    R.layer.resid = R.alloc(tail[1])                              # (b, s, h) the stream's dtype
    R.free(down)
    R.frees(end)
    end.clear()


def _per_linear(q: Quantities, kept: _Kept, recompute: str) -> bool:
    """Whether a layer's backward is replayed linear by linear (``_linears_backward``): without
    recomputation, where ``_linear_replay`` allows it and, under autocast, the weight copies are
    the replay's blocks."""
    return _linear_replay(q) and recompute == "none" and (bool(kept.casts) or not q.cast_layer)


def _linear_replay(q: Quantities) -> bool:
    """Whether the replay follows the layer's linears (``quantities.head_moments.per_linear_replay``, and the
    recipe lists them: ``LayerCoefs.linears``). Not for a layer with grouped experts
    (``LayerCoefs.after_uncast``): their weight gradients are no linears of the recipe and are made
    inside the experts' backward, which the replay does not place among the linears' (Mixtral-shaped,
    1 layer, 4 experts, against trace with one block and linear by linear: pure bf16 +1.2% and
    +7.2%, bf16-amp +5.5% and +0.3%; neither places the experts' gradients where trace does)."""
    lc = q.detail.layer
    return bool(q.linear_replay) and bool(lc.linears) and not lc.after_uncast


def _fsdp2_casts(q: Quantities) -> bool:
    """FSDP2 with autocast (``quantities.head_moments.per_linear_casts``): each linear's weight copy made
    at its linear in forward (``_linear_casts``), where the rest of the layer's backward keeps its one
    block and FSDP2's unsharded gradients (``_linear_replay`` stays off). The unsharded parameter is an
    ``nn.Parameter`` leaf with the sharded one's ``requires_grad`` (torch 2.13
    ``distributed/fsdp/_fully_shard/_fsdp_param.py`` L677-678, ``init_unsharded_param``), so
    ``cached_cast`` copies each weight at its linear's first call and keeps it, as on one GPU
    (``aten/src/ATen/autocast_mode.cpp``). With the copies as one block after the layer's saved
    tensors, against trace, Qwen2.5-0.5B (2 layers) b8 s256 math SDPA bf16-amp FSDP2 grad-op over 4:
    trace's 20 MiB segment freed by the head's backward, where autograd's cuBLAS workspace goes, held
    the replay's last layer's tensors instead, so the workspace split a 1,188 MiB logits segment, the
    root's exp_avg and exp_avg_sq joined it, and the second step opened another (+18.27 %, -0.15 %
    linear by linear); GPT-2 b1 s2048 FSDP2 full over 2 +14.79 -> -0.00 %."""
    lc = q.detail.layer
    return bool(q.linear_casts) and bool(lc.linears) and not lc.after_uncast


def _redo_per_linear(q: Quantities) -> bool:
    """Whether a recomputed layer whose copies the recomputation remade linear by linear
    (``_recompute_casts``) is back-propagated linear by linear (``_linears_backward``): yes, but where
    only the forward's copies are (``_fsdp2_casts``): FSDP2's unsharded gradients are made with its
    post-backward (``layer_backward._layer_backward``), and ``_linears_backward`` would look for each
    weight's gradient among the sharded ones. Without this the grid's four FSDP2 Qwen3 rows under full
    recomputation moved 0.2-0.3 points off trace's peak reserved memory (16-24 MiB)."""
    return _linear_replay(q) or not _fsdp2_casts(q)


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
