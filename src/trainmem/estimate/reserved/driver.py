"""The replay's driver: ``reserved_gap`` (the load, two steps of micro-batches, the gap at the end),
the steps of varying lengths, micro-batches and a pipeline rank's (stage, micro-batch) order, and a
micro-batch's forward and backward over the whole model."""
from __future__ import annotations

from typing import Any

from ...allocator import CachingAllocator
from ..moments import StepFlags, Tokens, label_tokens
from ..quantities import Quantities
from ..schedules import FORWARD
from .ddp import _ddp_init, _ddp_rebuild, _ddp_side_stream, _DdpStages, ddp_limits, recv_buffers
from .fsdp import (_Fsdp, _fsdp, _fsdp1_limited, _fsdp1_load, _fsdp1_no_sync, _Fsdp1Lag, _fsdp_streams,
                   _root_reduce_input, _root_resharded, _unit_grads, _unsharded_grads, root_raw)
from .layer_backward import _layer_backward
from .layer_forward import LATE, _kept_blocks, _kept_whole, _layer_forward
from .loss_backward import _head_backward, _loss_gradient, _softcap_backward
from .loss_forward import (_dpo_after_logps, _head_side, _logit_allocs, _logit_tensors, _loss_forward, _shifted,
                           _softcap_bytes, _softcapped_logits)
from .optimizer import (_allocate_states, _lomo_update, _make_grads, _optimizer_step, _tied_embedding_sum,
                        _tied_request)
from .parts import _Forward, _layer_parts
from .replay import GATHER_STREAM, GRAD_STREAM, _Replay, _replay_build, _Step
from .zero_gather import _Zero3Fetch, _Zero3Replay
from .zero_step import (_ds_buckets, _offload_epilogue, _zero12_at, _zero12_epilogue, _zero12_master, _zero3_flat_grads,
                        _zero3_masters)


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
                lag=_Fsdp1Lag(limited=not q.fsdp1_unlimited) if _fsdp1_limited(q) else None)
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
        s.ddp = _DdpStages.init(R, st, q.pipe_stages, q.pipe_head_once > 0,    # (the last rank's or the first's;
                                ddp_limits(q))                         # bucket_cap_mb, where passed)
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


def _forward_fsdp(R: _Replay, q: Quantities, recompute: str, suffix: str) -> _Fsdp:
    """The micro-batch's FSDP state (``_Fsdp``: which units are gathered, resharded, reduced, and on which stream)."""
    return _Fsdp(q.fsdp_ag_result > 0, _fsdp_streams(q), lag=R.lag, rs_side=q.fsdp_rs_side > 0,
                 adapters=q.fsdp1_adapter_units, recomputed=recompute != "none", host=q.fsdp1_host_shards,
                 grad_op=q.gathered_layer > 0, cast_shards=q.fsdp2_cast_shards, mp_shards=q.fsdp1_mp_shards,
                 no_sync=_fsdp1_no_sync(q, suffix))


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
        _ddp_rebuild(R, s, st, ddp_limits(q))                     # DDP's _pre_forward rebuilds its buckets
    fs = _forward_fsdp(R, q, recompute, suffix)
    root = fs.unshard(R, q.fsdp_root, st.root_tensors, raw=q.fsdp1_root_raw or root_raw(q, fs)[0])  # FSDP: the root
    # torchtitan's split root (quantities.fsdp_root.fsdp2_split_root): the embedding unit gathered, resharded
    # by its post-forward (its all-gather output kept until the first layer's copy-out)
    fs.reshard(R, fs.unshard(R, q.fsdp_emb_unit, _emb_unit_tensors(st)))
    # ZeRO-3: the embedding's table gathered on the all-gather stream (``_zero3_gathered``); once the
    # module order is recorded it may stay gathered until its backward (quantities.zero3_gather.deepspeed_embedding_kept)
    s.forwards += 1
    z3 = _Zero3Replay(R, q, recorded=s.forwards > 1) if q.ds_events else None   # the root's, the embedding's fetches
    gathered = R.alloc(q.ds_gathered_emb, GATHER_STREAM * q.ds_streams) if z3 is None else None
    first = _checkpoint_input(q, parts, tk, recompute)            # the bottom checkpoint's input (bytes, layout):
    looked = _looked_up(R, first)                                 # (the Llama template's, made first)
    embeds, rebound = _held_embeddings(R, q, tk, seqs, first)     # inputs_embeds kept to its backward, else held
    if not (q.ds_emb_kept and s.forwards > 1):                   # released after the embedding's forward
        R.free(gathered)
        gathered = None
    emb, below = _embeddings_saved(R, q, tk, seqs, first, looked, rebound)  # saved tensors, the kept input
    cached: list = []                                             # autocast's weight cache (checkpointed layers)
    z3 = z3 or _Zero3Fetch(R, q, recorded=s.forwards > 1)        # ZeRO-3: the layers' gathers (the embedding's
    kept, top = _layers(R, s, q, (fs, z3), parts, tk, recompute, cached, rebound, below)  # (its fetch starts
    if q.fsdp_head_unit or q.ds_events or not head:               # the first layer's prefetch; the head's unit
        rebound = R.frees(rebound) or []                          # first, or no head: the top layer's go with it)
    s.workspace(R, 0)                                             # no layer here: the head's matmul
    R.frees([h for at, h in R.carry if at != LATE])               # the top layer's late frees (a derived layer)
    R.carry = [(at, h) for at, h in R.carry if at == LATE]
    top = _top_output(R, q, tk, kept, recompute, head, top)       # the top layer's output, where made apart
    if not head:
        return _stage_output(R, s, q, tk, _Forward(inputs, fs, root, emb, kept, [], [], [], 0, 1, gathered, 0, z3),
                             cached, suffix, top)
    z3.forward_end(R)                                             # ZeRO-3: the final norm's and the head's fetches
    # a chunked loss: one tensor per chunk, at most one chunk per token (more are not made: setup_warnings)
    chunks = max(1, min(int(q.logit_chunks), int(tk.tokens))) if q.liger_factor == 0 else 1
    root = root + fs.unshard(R, q.fsdp_head_unit, st.head_unit_tensors)  # split root: [norm, head] kept
    capped = _softcap_bytes(q, tk, full, chunks)                  # a soft-capped head's tanh outputs, apart
    head, late, body = _head_side(R, q, tk, capped, top, rebound)  # the final norm's tensors, the head's input
    R.frees(rebound)                                              # (a head side of one block: after it)
    R.frees(embeds)                                               # the base model returns (held_embeddings)
    head.append(R.alloc(q.cast_head - q.cast_head_pre))           # autocast's half copy of the head (a transform's: _head_side)
    out, saved_tanh = _softcapped_logits(R, q, tk, full, chunks) if capped else (
        _logit_allocs(R, _logit_tensors(tk.out_logits, q.logits_out, full, chunks)), [])  # (b, s, vocab) logits
    R.frees(late)                                                 # the head's input, once its matmul has run
    if isinstance(z3, _Zero3Replay):                              # ZeRO-3: the head's module has returned, its
        z3.settle(R)                                              # post-forward hook releases before the loss
    root = _root_returned(R, q, fs, root)                         # FSDP2, the loop's loss: the root resharded
    if q.logits_cast:  # --cast-output: Fabric's fp32 copies, made while the half output is alive
        cast = _logit_allocs(R, _logit_tensors(tk.cast_logits, q.logits_cast, full, chunks))
        R.frees(out)
        out = cast
    if q.cast_stage_only:                                         # a pipeline's last stage: its forward's autocast
        cached = R.frees(cached) or []                            # region closes before the loss (Quantities.cast_stage_only)
    R.frees(s.held)                                               # the previous step's output, replaced
    s.held = []
    fwd, saved, out = _loss_forward(R, q, tk, flags, out, full, chunks, seqs, sum(map(R.a.block_size, body)))
    out, R.layer.out_refs = list(out) + R.layer.out_refs, []      # the output's KV cache (layer_forward "cK")
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


def _layers(R: _Replay, s: _Step, q: Quantities, units: tuple, parts: list[int], tk: Tokens, recompute: str,
            cached: list, rebound: list, below: int | None = None) -> tuple[list, int | None]:
    """Each layer's forward (``_layer_forward``; ``units``: FSDP's and ZeRO-3's, ``_Fsdp``, ``_Zero3Fetch``),
    what each keeps for backward; ``rebound``: what the caller's frames free once the next layer's input
    exists, handed from layer to layer (``layer_forward._layer_end``). Returns them and the top layer's
    output where the checkpoints keep their inputs (``below``: the bottom layer's, ``_checkpoint_input``),
    else None.

    A checkpointed layer keeps its input (torch 2.13 ``utils/checkpoint.py`` ``_checkpoint_hook``: the
    pack hook saves the inputs the recomputation reads), which exists before the layer runs: the
    embedding's output for the bottom layer (transformers 5.24 ``models/llama/modeling_llama.py``
    ``LlamaModel.forward`` L390-402: ``hidden_states = inputs_embeds`` then each decoder layer on it),
    the layer below's output for the others. ``_layer_forward`` makes that block at the layer's own
    output (``_kept_blocks``' first), so where ``below`` is given each layer keeps the block made before
    it and hands its own output to the layer above; the top layer's output is the final norm's input
    (``loss_forward._fed_norm_input``). The same tensors, made earlier: trace, Mistral cut to 2 layers
    (h 1024) b4 s512 fp32 under --recompute op keeps the embedding's 8 MiB output where the replay's
    first layer put its first temporaries in that block."""
    fs, z3 = units
    kept = []
    for i in range(q.layers):
        z3.forward(R, i)
        k = _layer_forward(R, q, fs, parts, tk, recompute, keep=(i == q.layers - 1 and q.fsdp_last_kept > 0),
                           cached=cached, s=s, rebound=rebound)
        if below is not None:                                     # keeps its input; its output the next's
            k[0], below = below, k[0]
        kept.append(k)
    return kept, below


#: where the embeddings make the bottom checkpoint's kept input (``_checkpoint_input``'s layout, the one
#: difference between the families): the lookup's output, first (the Llama template, ``_looked_up``); BERT's
#: dropout output, its embeddings module tensor by tensor (``_bert_embeddings_saved``); GPT-2's dropout output,
#: after the held embeddings and their sum, which it frees (``_gpt2_dropout_input``); else after the embeddings'
#: saved tensors as one block
_LOOKUP, _BERT, _GPT2, _AFTER_SAVED = "lookup", "bert", "gpt2", "after saved"


def _checkpoint_input(q: Quantities, parts: Any, tk: Tokens, recompute: str) -> tuple[int, str]:
    """Bytes of a checkpointed layer's kept input where ``_forward`` makes it before the bottom layer (``_layers``'
    ``below``), and where the embeddings make it (``_LOOKUP``, ``_BERT``, ``_GPT2``, ``_AFTER_SAVED``); (0, "")
    where none. GPT-2 under full recomputation with its first forward written tensor by tensor
    (``_gpt2_dropout_input``): the layer's (b, s, h) input. Elsewhere, under full recomputation or torchtitan's
    per-op policy when the first block the layer keeps is its input alone (``layer_forward._kept_blocks``,
    ``_kept_whole``), on one device or a data-parallel rank whose final norm the head side lists tensor by
    tensor (``Quantities.head_side``, which reads the top layer's output); none elsewhere (a pipeline stage's
    input is received, ``_fed_top_output``; a head side of one block; GPT-2's held embeddings otherwise,
    whose first layer's input is their sum's dropout, made after them: ``_held_embeddings``)."""
    if recompute == "full" and getattr(parts, "nograd_events", ()) and q.embeds_pos and tk.layer:
        return int(tk.layer), _GPT2
    piped = q.pp_inflight > 1 or q.pipe_recv > 0 or q.pipe_stages > 1
    if recompute not in ("full", "op") or not q.head_side or piped or q.embeds_pos or q.embeds_sum_tok:
        return 0, ""
    if not _kept_whole(parts, tk.layer, recompute):
        return 0, ""
    first = _kept_blocks(parts, tk.layer, recompute)[0]
    if not first:
        return 0, ""
    n, _mask, rest = _bert_embedding_bytes(q, tk)
    return first, _LOOKUP if q.embeds_first else _BERT if n and first == n and rest >= 0 else _AFTER_SAVED


def _looked_up(R: _Replay, first: tuple[int, str]) -> int | None:
    """The bottom checkpoint's kept input (``first``: its bytes and layout, ``_checkpoint_input``) where it is
    the embedding lookup's output made before the base model's mask and rotary tables (``_LOOKUP``:
    ``Quantities.embeds_first``, ``quantities.head_moments.lookup_first``: transformers 5.24.0
    ``models/mistral/modeling_mistral.py`` ``MistralModel.forward`` L345 ``inputs_embeds =
    self.embed_tokens(input_ids)``, L356 the causal mask, L365 the rotary tables; the Llama template): made
    here, first; None elsewhere (``_embeddings_saved`` makes it after the embeddings' saved tensors). Trace,
    Llama (hidden 1024) b2 s1024 bf16 full recomputation: the 4 MiB embedding output, then the 4 MiB mask
    (tests/test_lookup_first_replay.py); the replay had the mask's block first."""
    nbytes, layout = first
    return R.alloc(nbytes) if layout == _LOOKUP else None


def _mask_and_tables(R: _Replay, q: Quantities, tk: Tokens, seqs: int) -> list:
    """The Llama template's embeddings-side tensors after its kept input (``_looked_up``): the 4-D causal
    mask (``Quantities.outer_rest_sq`` per token x key: (b, 1, s, s) in the model's dtype; transformers 5.24.0
    ``models/llama/modeling_llama.py`` L382 ``create_causal_mask``) as one tensor, then the rest of
    ``outer_rest`` (the rotary cos/sin tables, L391, (1, s, head_dim) each: a small-pool block at these
    lengths) as another. One block of both, the replay had put a 4.25 MiB block where trace has the 4 MiB
    mask: grid llama 4x512 eager --loss half per-op recomputation +5.29 -> -0.35 % of trace's reserved.
    The sequence is the micro-batch's tokens over its ``seqs`` sequences (``lookup_first`` excludes
    context parallelism, whose keys are not the rank's tokens)."""
    rest = int(tk.outer_rest)
    nsq = int(tk.tokens) * (int(tk.tokens) // max(seqs, 1))       # b x s x s token-key pairs
    mask = min(int(q.outer_rest_sq * nsq), rest)
    return [R.alloc(mask), R.alloc(rest - mask, one=False)]


def _embeddings_saved(R: _Replay, q: Quantities, tk: Tokens, seqs: int, first: tuple[int, str],
                      looked: int | None, rebound: list) -> tuple[list, int | None]:
    """The embeddings' saved tensors and, where the bottom checkpoint keeps it (``first``: its bytes and
    layout, ``_checkpoint_input``), that input, made where the family's embeddings make it: the Llama
    template's mask and tables after it (``looked``, made first: ``_mask_and_tables``), BERT's embeddings
    module tensor by tensor (``_bert_embeddings_saved``), GPT-2's dropout output after the one saved block
    (``_gpt2_dropout_input``, ``rebound``: their sum, freed), else after the one saved block
    (``tk.outer_rest``: several tensors). Returns the saved tensors and the kept input."""
    nbytes, layout = first
    if layout == _LOOKUP:
        return _mask_and_tables(R, q, tk, seqs), looked
    if layout == _BERT:
        return _bert_embeddings_saved(R, q, tk, seqs, nbytes)
    saved = [R.alloc(tk.outer_rest, one=False)]
    if layout == _GPT2:
        return saved, _gpt2_dropout_input(R, nbytes, rebound)
    return saved, (R.alloc(nbytes) if nbytes else None)


def _bert_embedding_bytes(q: Quantities, tk: Tokens) -> tuple[int, int, int]:
    """Bytes of BERT's embeddings tensors (``quantities.head_moments.bert_embeddings``): one (b, s, h) tensor
    in the embeddings' dtype, the dropout's (b, s, h) bool mask, and the rest of ``tk.outer_rest`` (the
    LayerNorm's (b, s) mean and rstd, ...); (0, 0, rest) for another model."""
    n = int(q.bert_emb_tok * tk.tokens)                           # (b, s, h) in the embeddings' dtype
    mask = int(q.bert_mask_tok * tk.tokens)                       # (b, s, h) bool
    return n, mask, int(tk.outer_rest) - n - mask


def _bert_embeddings_saved(R: _Replay, q: Quantities, tk: Tokens, seqs: int, first: int) -> tuple[list, int]:
    """BERT's embeddings module tensor by tensor with the bottom checkpoint's kept input (``first`` bytes,
    ``_checkpoint_input``'s ``_BERT``; ``quantities.head_moments.bert_embeddings``; ``BertEmbeddings.forward``,
    transformers 5.24.0 ``models/bert/modeling_bert.py`` L100-109): the word and token-type embeddings
    (b, s, h), their sum, the position embeddings (1, s, h), the second sum (the LayerNorm's saved input), the
    LayerNorm's output, its mean and rstd (with what else ``outer_rest`` lists, one block), the dropout's
    output (the kept input) and mask (saved), the LayerNorm's output freed, the three embeddings freed on
    return. Made as two blocks, the 7.5 MiB saved one and the kept input, trace's BERT b2 s1024 fp32 full
    recompute opened one 20 MiB segment more in the first forward and, in step 2, one 240 MiB logits segment
    fewer (peak -13.4 % of trace's); tensor by tensor, every segment is trace's. Returns the saved tensors
    and the kept input."""
    n, mask, rest = _bert_embedding_bytes(q, tk)
    word, types = R.alloc(n), R.alloc(n)
    summed = R.alloc(n)
    pos = R.alloc(n // max(seqs, 1))                              # (1, s, h)
    saved = [R.alloc(n)]                                          # the second sum, the LayerNorm's input
    R.free(summed)                                                # (the first, rebound)
    normed = R.alloc(n) if mask else None                         # without dropout, the kept input itself
    saved.append(R.alloc(rest, one=False))
    below = R.alloc(first)                                        # the dropout's output
    saved.append(R.alloc(mask))
    R.frees([normed, word, types, pos])
    return saved, below


def _gpt2_dropout_input(R: _Replay, nbytes: int, rebound: list) -> int:
    """GPT-2's first layer's input under full recomputation (``_checkpoint_input``'s ``_GPT2``), where its
    checkpointed first forward is written tensor by tensor (``parts.nograd_events``, ``nograd.gpt2_block``) and
    the embeddings' tensors are made (``_held_embeddings``): the embeddings' dropout output (``nbytes``: (b, s,
    h), the stream's dtype), which the checkpoint keeps until the layer's backward, made after the embeddings'
    saved block, before the layer's gather, and their sum freed (``rebound``; transformers 5.24
    ``models/gpt2/modeling_gpt2.py`` L603 ``hidden_states = self.drop(hidden_states)``). Unlike the other
    families' kept input it is not ``inputs_embeds``, which the base model holds apart (``_held_embeddings``).
    The replay otherwise makes each checkpointed layer's kept block at its end, the next one's input
    (``_fed_top_output``), so the bottom layer's input was none of its blocks and the top layer's output
    was one beside the final norm's saved input: here it is ``_layers``' ``below``, so that each layer's
    kept entry holds its own input, and ``_forward`` hands the top layer's output to the head side as the
    norm's input (``loss_forward._fed_norm_input``), freed by the norm's backward
    (``loss_backward._final_norm_backward``). Trace, GPT-2 b1 s1024 pure bf16, full recomputation:
    ``embedding`` 1.5, ``embedding`` 1.5, ``add`` 1.5, ``native_dropout`` 1.5 MiB, the sum freed, then
    ``ln_1``. Returns that input's handle."""
    inp = R.alloc(nbytes)                                         # (b, s, h), the stream's dtype
    R.frees(rebound)
    rebound.clear()
    return inp


def _held_embeddings(R: _Replay, q: Quantities, tk: Tokens, seqs: int, first: tuple[int, str] = (0, "")
                     ) -> tuple[list, list]:
    """The embedding outputs the base model holds, unsaved, until it returns (``held_embeddings``; GPT-2's
    ``inputs_embeds`` and ``position_embeds``, one (1, s, h) for the ``seqs`` sequences,
    ``gpt2_embeddings``), and the tensors freed once the first layer's input exists (GPT-2: their sum,
    rebound by the embeddings' dropout, whose output the first layer saves first: ``_layer_forward``'s
    ``rebound``). ``first``: the bottom checkpoint's kept input (``_checkpoint_input``), which but for GPT-2's
    (its embeddings' dropout output) is ``inputs_embeds``, made by the caller: not made again here."""
    kept = first[0] > 0 and first[1] != _GPT2
    held = [R.alloc(int(q.embeds_tok * tk.tokens)) if not kept else None,
            R.alloc(int(q.embeds_pos * (tk.tokens // max(seqs, 1))))]
    summed = R.alloc(int(q.embeds_sum_tok * tk.tokens))           # None where there is none (not GPT-2):
    return held, [summed] if summed is not None else []           # nothing then waits for the first input


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


def _root_returned(R: _Replay, q: Quantities, fs: "_Fsdp", root: list) -> list:
    """FSDP2's root post-forward where the loop computes the loss on the returned logits (``--loss
    upcast`` / ``half``, ``quantities.fsdp_root.root_resharded_for_loss``: ``fsdp_root_regather``): the
    root's forward returns with the logits, so ``_post_forward`` reshards the root (its parameters copied
    out of the all-gather, freed) and frees the last all-gather output before the loss's forward runs
    (torch 2.13 ``_fully_shard/_fsdp_state.py`` ``_post_forward`` L324-343, ``_fsdp_param_group.py``
    ``post_forward`` -> ``reshard``). Trace (Mistral cut to 2 layers, FSDP2 dp 4, LoRA r8, fp16-amp,
    ``--loss half``, b1 s2048): the root's two 125 MiB fp32 parameters are free when the loss asks for its
    second 125 MiB tensor, which the replay, freeing them after the loss (``_forward_end``), gave a 126
    MiB segment of its own. Returns the root's handles still held."""
    if not (q.fsdp_root_regather and _root_resharded(q, fs)):
        return root
    R.frees(root)
    R.free(fs.ag)
    fs.ag = None
    return []


def _stage_output(R: _Replay, s: _Step, q: Quantities, tk: Tokens, f: _Forward, cached: list,
                  suffix: str, top: int | None = None) -> _Forward:
    """The end of a pipeline pair's forward on a stage without the head (``_forward``'s ``head``
    False): the stage's output, the top layer's (b, s, h) hidden states in the layers' dtype
    (``q.pipe_out_tok`` bytes per token, ``quantities.pipeline._interleaved_terms``), which the stage keeps
    in ``fwd_cache`` until the pair's backward (torch 2.13 ``pipelining/stage.py`` L904-916,
    L962-967; ``schedules.py`` L2530 binds it to a local of ``_perform_action``, gone as the action
    returns); autocast's weight cache cleared as the stage's forward returns. No final norm, head,
    logits or loss. ``top``: on a fed stage, the top layer's output already made (``_fed_top_output``),
    which is that output when it is its size."""
    R.frees([h for _at, h in R.carry])                            # a derived layer's late frees
    R.carry = []
    nbytes = int(q.pipe_out_tok * tk.tokens)
    if top is not None and R.a.requested_size(top) == nbytes:
        f.out = [top]                                             # (b, s, h): the top layer's output itself
    else:
        f.out = [R.alloc(nbytes)]                                 # (b, s, h): the stage's output
        R.free(top)
    R.frees(cached)                                               # autocast exits: its cache cleared
    f.root = _forward_end(R, s, q, f.fs, f.root, suffix)
    return f


def _top_output(R: _Replay, q: Quantities, tk: Tokens, kept: list, recompute: str, head: bool,
                top: int | None = None) -> int | None:
    """The top layer's output for the final norm (``loss_forward._head_side``) or the stage's output
    (``_stage_output``): on a fed stage taken out of what that layer keeps (``_fed_top_output``), else as the
    layer's forward made it (``layer_forward._resid_tail``, ``_LayerCarry.resid``), or ``top``, where the
    checkpoints keep their inputs (``_layers``' ``below``); None where none. Without
    the head (a pipeline stage's forward) no model output references the layers' KV cache tensors
    (``_LayerCarry.out_refs``): freed here."""
    top = top if top is not None else _fed_top_output(R, q, tk, kept, recompute)
    top, R.layer.resid = R.layer.resid if R.layer.resid is not None else top, None
    if not head:
        R.layer.out_refs = R.frees(R.layer.out_refs) or []
    return top


def _fed_top_output(R: _Replay, q: Quantities, tk: Tokens, kept: list, recompute: str) -> int | None:
    """On a pipeline stage fed its input (every stage of torch's schedule but the model's first), the
    handle of the top layer's output, taken out of what that layer keeps; None elsewhere.

    A checkpointed layer (full or per-op recomputation) keeps its input, which the replay makes as the
    first of its kept blocks at the layer's end (``layer_forward._op_forward``, ``_kept_blocks``): so
    each layer's block is the next one's input, made where the real one is, and the top layer's is the
    final norm's input. On a fed stage the bottom layer's input is the receive buffer
    (``stage.py`` ``_retrieve_recv_activations`` hands the buffer itself to the stage module; the
    replay holds it from the first forward, ``_batch_in``), which the estimate counts once
    (``quantities.pipeline._pipeline_terms``: ``pipeline.received_input``), so one block of the layers'
    is not a tensor of the stage's: the top layer's output is one tensor, which the stage's
    ``fwd_cache`` keeps as its output until the micro-batch's backward (torch 2.13
    ``pipelining/stage.py`` L913-916) and, on the head's stage, the final norm reads (transformers 5.24
    ``models/llama/modeling_llama.py`` L404 ``hidden_states = self.norm(hidden_states)``), where the
    replay made it again (``_stage_output``, ``loss_forward._head_side``). Taken only where that block
    is the received input's size (``Detail.received_tok``), on the last rank of an interleaved
    schedule (its replayed (stage, micro-batch) pairs are all fed) or on a stage of another schedule
    with a head. Found by the agreement grid: llama (4 layers, h 2048) b8 s256 --pp 2
    interleaved-1f1b fp32 op recompute, the replay's allocated 16 MiB over trace's after each pair's
    forward (one block per pair in flight, 51 MiB at its peak)."""
    fed = int(q.detail.received_tok * tk.tokens)
    if not fed or recompute not in ("full", "op") or not kept or not kept[-1]:
        return None
    if not (q.pipe_order or (q.pipe_stages <= 1 and tk.outer_head)):
        return None
    return kept[-1].pop(0) if R.a.requested_size(kept[-1][0]) == fed else None


def _batch_in(R: _Replay, s: _Step, q: Quantities, tk: Tokens) -> int | None:
    """A micro-batch's start: its int64 ids and labels copied to the device (a blocking copy, which
    FSDP1's rate limiter sees: ``_Fsdp1Lag.synchronize``); before the run's first forward, FSDP1's
    lazy init, which allocates and frees each unit's buffers on the default stream in turn
    (``quantities.fsdp1.fsdp1_lazy_init``), leaving the largest one's segment cached. Returns the batch's
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


def _emb_unit_tensors(st: Any) -> tuple[int, ...]:
    """The embedding unit's parameters under torchtitan's split root: the root's tensors before the
    [norm, head] unit's (``States.head_unit_tensors``)."""
    return st.root_tensors[:len(st.root_tensors) - len(st.head_unit_tensors)]


def _backward(R: _Replay, s: _Step, q: Quantities, flags: StepFlags, tk: Tokens, f: _Forward, parts: list[int],
              n: int, nsq: int, recompute: str, suffix: str, head: bool = True) -> None:
    """One micro-batch's backward, from the loss to the embeddings (``head`` False: a pipeline
    stage without the head, from its output's gradient, ``_pipeline_pairs``)."""
    st = q.detail.states
    buckets = _ds_buckets(R, q, at_start=True)                     # DeepSpeed ZeRO-1/2 before v0.18.3
    if _root_resharded(q, f.fs) and not q.fsdp_root_regather:     # the root's pre-backward: the loss is its output
        f.root = f.fs.unshard(R, q.fsdp_root, st.root_tensors, backward=True, raw=root_raw(q, f.fs)[0])
    if isinstance(f.z3, _Zero3Replay):                            # ZeRO-3: the root's pre-backward (the loss
        f.z3.backward_root(R)                                     # is its output), then the loss's backward,
    dlogits = _softcap_backward(R, q, f, _loss_gradient(R, q, tk, f, n, nsq, head))
    if isinstance(f.z3, _Zero3Replay):                            # then the head's, the base model's and the
        f.z3.backward_start(R)                                    # final norm's at their outputs' gradients
    if q.fsdp_head_pref:                                          # split root: the head's pre-backward
        f.fs.prefetched = f.fs.gather_output(R, q.fsdp_head_pref)  # prefetches the top layer
    head_full, tied = _head_backward(R, s, q, flags, f, dlogits, n) if head else ([], None)
    buckets += _ds_buckets(R, q, at_start=False)                  # ... from v0.18.3, at the first hook
    if q.ds_head_check and suffix != ".micro1":                   # DeepSpeed ZeRO-1/2 offloaded: the untied
        R.free(R.alloc(q.ds_head_check))                          # head's inf/NaN check (its bucket reduced at
    #                                                               the next hook: deepspeed_offload_check_head)
    if q.fsdp_head_unit:                                          # ... and its post-backward reduces the
        f.fs.post_backward(R, f.root, head_full, q.fsdp_head_rs)  # head's gradients (fsdp2_split_root)
        _make_grads(R, s, st.trainables, ("after",), flags.oib, f.fs.grad_stream, flat=f.fs.grad_stream > 0)
        head_full, f.root = [], []
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
    _sent_grad(R, s, q, tk)                                       # a later 1F1B stage's: held to send
    if q.fsdp_emb_unit:                                           # split root: the embedding's pre-backward
        f.fs.below_first = 0
        f.root = f.fs.unshard_backward(R, q.fsdp_emb_unit, _emb_unit_tensors(st), prefetch=False)
    gathered = f.gathered if f.gathered is not None or q.ds_events else R.alloc(q.ds_gathered_emb,
                                                                                GATHER_STREAM * q.ds_streams)
    if isinstance(f.z3, _Zero3Replay):                            # the embedding's backward fetch
        f.z3.embedding(R)
    # the embedding gathered whole at its backward (on the all-gather stream), unless kept since its forward
    _zero12_at(R, s, q, None)                                     # ... or before the word embedding's
    emb_full, acc = _unsharded_grads(R, f.fs, st.emb_grads_full, st.emb_grads_raw), []  # FSDP: unsharded
    if tied is not None and not _fsdp(q):                         # the embedding's own gradient added to
        tied = _tied_embedding_sum(R, s, q, flags, tied)          # the head's
    if tied is not None and (f.fs.v2 or q.fsdp1_root_flat):      # FSDP, a tied head: the embedding's own
        emb_out = _tied_request(R, q)                             # gradient, then autograd's InputBuffer adds
        acc = [_tied_request(R, q)]                               # it to the head's into a new tensor, the
        R.frees([tied, emb_out])                                  # unsharded gradient reduce-scattered (FSDP2's
        #                                                           root resharded after forward or kept gathered:
        #                                                           grad-op, trace's Gemma-2 b4 s512 dp 4); FSDP1's
        tied = None                                               # view gradient, concatenated below
        emb_full, acc = (acc[0], []) if emb_full is None else (emb_full, acc)   # (beside the other embeddings')
    _root_reduce(R, q, f, head_full, [emb_full] + acc)           # the root's post-backward
    _unit_grads(R, s, f.fs, st.trainables, ("before",) if q.fsdp_head_unit else ("after", "before"),
                flags.oib)                                        # head, norm, embeddings
    f.fs.reduced(R)                                               # torch < 2.5: the input dropped on return
    if suffix != ".micro1":                                       # ZeRO-1/2 offloading, at the boundary:
        _offload_epilogue(R, q)                                   # each of rank 0's gradients' copies
    for cat in q.ds_reduce_cats[-1:] if q.ds_events else q.ds_reduce_cats:  # ZeRO-3's buckets reduced, each a
        R.free(R.alloc(cat, GRAD_STREAM * q.ds_streams))          # flat cat (quantities.zero_step.deepspeed_reduce_cats;
    #                                                               with ``ds_events`` the last, the others at their hooks)
    R.free(gathered)                                              # ... and every parameter released
    if isinstance(f.z3, _Zero3Replay):
        f.z3.done(R)
    _zero12_epilogue(R, s, q, suffix)                             # DeepSpeed ZeRO-1/2: grads_in_partition
    R.frees([tied, f.inputs] + f.emb + buckets)
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


def _root_reduce(R: _Replay, q: Quantities, f: _Forward, head: list, others: list) -> None:
    """The root's post-backward reduce of its unsharded gradients (``head``: the final norm's and head's,
    in registration order; ``others``: the embeddings'). FSDP2 reshards the root first (its gathered
    parameters freed: torch 2.13 ``_fsdp_param_group.py`` ``post_backward`` L637-638, before
    ``foreach_reduce`` at L688), and the head's gradient, the root's last parameter's, outlives the
    sharded output (``_Fsdp.reduce``'s ``last``); FSDP1 reduces first (``_Fsdp.reshard`` at the end of
    ``_backward``)."""
    if f.fs.v2:
        f.fs.reshard(R, f.root)
        f.root = []
    f.fs.reduce(R, head + others, _root_reduce_input(q, f.fs), q.fsdp1_root_cast, root_raw(q, f.fs)[1],
                last=head[-1] if head and q.fsdp_root_last else None)


def _sent_grad(R: _Replay, s: _Step, q: Quantities, tk: Tokens) -> None:
    """A later stage under ``Schedule1F1B``: the gradient of its input, (b, s, h) in the residual
    stream's dtype (``Quantities.pipe_sent_tok``), made by its bottom layer's backward and held by the
    list of send ops until the next micro-batch's backward has run: ``backward_one_chunk`` leaves it in
    ``bwd_cache`` (``_backward.py`` ``stage_backward`` sets the input's ``.grad`` to None after reading
    it, L440-450), ``get_bwd_send_ops`` pops it into the ops bound to ``bwd_sends``, which is rebound
    only after the next backward (torch 2.13 ``pipelining/schedules.py`` L1108-1127 in
    ``Schedule1F1B._step_microbatches``; the last one held until the step returns, L1145-1168). The
    estimate counts it (``moments.tokens``' ``sent``); the replay made and freed it inside the layer's
    backward. Here it is made as the layers' backward ends and the previous micro-batch's freed;
    ``_micro_batches`` frees the last. Found by trace: llama (2 layers, h 2048) b8 s256 --pp 2
    --grad-accum 3 bf16-amp op recompute AdamW-8bit, the last stage's loss 12 MiB more allocated than
    the replay's in the last micro-batch once the replay no longer counted the top layer's output
    twice (``_fed_top_output``)."""
    nbytes = int(q.pipe_sent_tok * tk.tokens)
    if nbytes <= 0:
        return
    made = R.alloc(nbytes)
    R.free(s.sent)
    s.sent = made


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
    R.free(s.sent)                                                # ... and its last send ops (``_sent_grad``)
    s.sent = None


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
