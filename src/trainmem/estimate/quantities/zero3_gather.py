"""DeepSpeed ZeRO-3's gathered parameters: the gather zones and events over the coordinator's order,
the leaf modules, ``zero3_linear_wrap``'s kept weights, the embedding's and layers' gathers and
coalesced outputs, a leaf block's held expert gradients."""
from __future__ import annotations

from ...spec.model import ModelSpec
from ...spec.training import TrainingSpec
from ..layers import LayerCoefs
from ..states import States
from .model_facts import _head_weight_numel, block_of, is_lm
from .zero_partition import _partial_layout, deepspeed_zero


def deepspeed_gathered(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """DeepSpeed ZeRO-3's gathered (whole) parameters in the engine's dtype: (at the top layer's
    backward, in the rest of backward); (0, 0) off ZeRO-3 over several ranks. None at the optimizer
    step: ``step`` starts by releasing every parameter (``stage3.py`` ``_partition_all_parameters``).
    Where the coordinator's replay applies (``deepspeed_gather_zones``: an LM, no pipeline stages,
    recompute none, selective or full) its top-layer and lower-layer maxima; else the rule below, which neglects
    the prefetcher's passes over gathered entries (so the layers kept past the reuse distance) and
    the live-parameter limit.

    ZeRO-3 gathers a submodule's own parameters when its forward or backward hook fires and
    releases them after it, except a parameter that comes up again within the next
    ``stage3_max_reuse_distance`` parameter elements of the module order recorded in the first
    step (``partitioned_param_coordinator.py`` ``__params_to_release`` L524-554, at 38327e0). So at
    the end of forward the LM head stays (its backward comes next; a tied embedding is the head),
    and so do the top K layers: between a layer's forward and its next use run the head's forward
    and backward (2 x head elements) and, for each layer above it, that layer's backward and, under
    full recompute, its recomputed forward first: the j-th layer from the top (j = 0, 1, ...) stays
    while 2 head + c j layer < the distance (c = 2, or 3 recomputed). Beside them the module being
    computed (at most a layer, or an untied embedding) and the prefetch
    (``stage3_prefetch_bucket_size`` elements gathered ahead, L285-418): parameters taken from the
    queue of the recorded order that are not gathered yet (``fetch_sub_module``: ``ds_status ==
    NOT_AVAILABLE``, DeepSpeed v0.19.8 ``partitioned_param_coordinator.py`` L451-485), so at most
    the model's parameters not already counted as gathered. The kept layers are
    released as backward passes them, so below the top only the current module and the prefetch
    are gathered. Modules within a layer are taken as the layer (their offsets in it neglected)."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1):
        return 0, 0
    zones = deepspeed_gather_zones(m, t, st)
    if zones is not None:
        return zones[2], zones[3]
    wb = t.weight_bytes
    layer = st.layer_params_full                            # one layer's weights, whole, engine dtype
    layer_n = layer // wb
    head_n = _head_weight_numel(m, t.tp) if is_lm(m) else 0  # (vocab, hidden) elements
    emb_n = 0 if m.tied_embeddings else next((-(-p.numel // t.tp) for p in m.parameter_tensors()
                                               if p.role == "embedding"), 0)
    dist = t.ds_reuse_distance
    c = 3 if t.recompute == "full" else 2
    layers = m.num_layers // t.pp
    k = min(layers, -(-(dist - 2 * head_n) // (c * layer_n))) if (layer_n and dist > 2 * head_n) else 0
    total_n = sum(-(-p.numel // t.tp) for p in m.parameter_tensors()) // t.pp  # the stage's parameters

    def prefetch(gathered_n: int) -> int:
        """(up to stage3_prefetch_bucket_size,) gathered ahead: only parameters not gathered yet"""
        return block_of(t, min(t.ds_prefetch, max(0, total_n - gathered_n)) * wb)
    current_n = max(layer_n, emb_n)
    current = max(layer, block_of(t, emb_n * wb))
    head = block_of(t, head_n * wb) if dist > 0 else 0
    kept_n = (head_n if dist > 0 else 0) + max(k, 1) * layer_n
    # the kept layers' matmul weights are the storage autograd holds under torch's F.linear (counted
    # with the layers' activations: deepspeed_linear_kept); their norms are neglected
    kept_layers = 0 if deepspeed_linear_kept(m, t) else max(k, 1) * layer
    return head + kept_layers + prefetch(kept_n), current + prefetch(current_n)


def deepspeed_gathered_head(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes DeepSpeed ZeRO-3 holds gathered (engine's dtype) from the end of forward through the
    LM head's backward (the loss's moments): the replay's (``deepspeed_gather_zones``), else the
    rule's top (``deepspeed_gathered``); 0 off ZeRO-3 over several ranks."""
    zones = deepspeed_gather_zones(m, t, st)
    return deepspeed_gathered(m, t, st)[0] if zones is None else zones[1]


def deepspeed_gathered_forward(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """Bytes DeepSpeed ZeRO-3 holds gathered (engine's dtype) at the top layer's forward from the
    second step on, a prefetch's flat all-gather output included: the replay's
    (``deepspeed_gather_zones``), else the rule's top and ``deepspeed_coalesced``."""
    zones = deepspeed_gather_zones(m, t, st)
    if zones is None:
        return deepspeed_gathered(m, t, st)[0] + deepspeed_coalesced(m, t)
    return zones[0]


def deepspeed_gather_zones(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int, int, int] | None:
    """Bytes DeepSpeed ZeRO-3 holds gathered (whole parameters and the flat all-gather buffers,
    the engine's dtype) at most in the top layer's forward, from forward's end through the head's
    backward, in the top layer's backward and in the other layers' backward (with the flat ``cat`` of
    a gradient bucket reduced there), from the second step on: the coordinator
    replayed over the model's module order (``zero3_replay.gathered_zones``; the same code at
    DeepSpeed v0.14.2 and v0.19.8, ``partitioned_param_coordinator.py`` v0.19.8 L353-490, L634-664).
    The prefetcher pops queue entries of parameters gathered already without counting them, so it
    runs ahead until ``stage3_max_live_parameters`` (1e9 elements) are gathered, and each entry it
    passes marks its parameter as fetched for that later use, which its module's release then keeps:
    at forward's end the head and the layers below it up to that count stay gathered into backward.
    None where the replay does not apply (the rule in ``deepspeed_gathered`` then): off ZeRO-3 over
    several ranks, a model without an LM head, pipeline stages, ``--recompute op`` (refused with ZeRO-3
    anyway), or mixture-of-experts layers whose experts a step calls only when routed to (``_z3_leaves``).
    Mixture-of-experts blocks: one fetch of the block where DeepSpeed makes it a leaf module, else its
    router and fused experts in turn (``_z3_leaves``). ``--recompute selective`` recomputes the
    attention core, which holds no parameters: the order is none's.
    Found by trace (DeepSpeed 0.19.8): Giles Thomas's Llama-3-8B ZeRO-3 setup cut to 6 layers, dp 8,
    one token: at the second step's backward start the head, layers 5 and 4 and layer 3's down_proj
    gathered, and at layer 4's MLP the embedding and layer 0's q/k/v in one flat all-gather (1,050 MiB)."""
    args = _gather_order_args(m, t)
    if args is None:
        return None
    from ..zero3_replay import gathered_zones
    bucket = t.ds_reduce_bucket if (st.trainable > 0 and not _partial_layout(m, t, st)) else 0      # the reductions' cats with every parameter trainable
    params, head, tied, leaves, views = args
    return gathered_zones(params, head, tied, t.recompute == "full", t.ds_reuse_distance, t.ds_prefetch,
                          DS_MAX_LIVE, deepspeed_linear_kept(m, t) > 0, bucket, t.weight_bytes,
                          bool(t.expandable_segments), leaves, views)


def _gather_order_args(m: ModelSpec, t: TrainingSpec) -> tuple | None:
    """``zero3_replay.module_order``'s inputs from the spec: each parameter (name, whole elements on this
    rank, layer), the untied head's module or the tied table's index, the ZeRO-3 leaf modules' paths
    (``_z3_leaves``), the parameters whose forward storage a saved view holds (``zero3_replay.view_held``);
    None where the replay does not apply (``deepspeed_gather_zones``)."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1) or not is_lm(m) or t.pp > 1:
        return None
    if t.recompute not in ("none", "full", "selective"):
        return None   # selective: Megatron's attention core, recomputed without parameters: none's order
    tensors = m.parameter_tensors()
    leaves = _z3_leaves(m, t)
    if leaves is None:
        return None   # experts as modules skipped when no token routes to them: the recorded order varies
    params = tuple((p.name, -(-p.numel // t.tp), p.layer) for p in tensors)   # (name, whole elements, layer)
    last = tensors[-1] if tensors else None                # an untied head: the last tensor, outside the layers
    untied = not m.tied_embeddings and last is not None and last.layer is None and last.role == "linear"
    head = ".".join(last.name.split(".")[:-1]) if untied else None
    tied = None if untied else next((i for i, p in enumerate(tensors) if p.role == "embedding"), None)
    if head is None and tied is None:
        return None
    from ..zero3_replay import view_held
    return params, head, tied, leaves, view_held(tuple(p.role for p in tensors))


#: DeepSpeed's default ZeRO-3 leaf modules (``zero_optimization.leaf_module.classes``), by transformers
#: model type: ``runtime/zero/leaf_module_config.py`` ``DEFAULT_LEAF_MODULE_CLASSES`` (v0.19.8 L11-15;
#: added in v0.18.0, #7604 "Improve leaf module interface", 7d9a2f2), applied to every model the engine
#: wraps (``engine.py`` ``_configure_distributed_model`` L2076 ``apply_zero_leaf_module_config``)
DS_DEFAULT_LEAF_TYPES = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
                         "qwen3_moe": "Qwen3MoeSparseMoeBlock"}


def _z3_leaves(m: ModelSpec, t: TrainingSpec) -> tuple[str, ...] | None:
    """The module paths ZeRO-3 fetches as leaf modules (one fetch of every parameter under them, no
    hooks below: ``zero3_replay._path``), () for none; None where the recorded module order varies step
    to step. A mixture-of-experts block (the module holding ``experts``) is a leaf under DeepSpeed
    >= 0.18.0 for the model types it lists by default (``DS_DEFAULT_LEAF_TYPES``). Elsewhere its router
    and experts are fetched as modules of their own, each in every step: transformers >= 5 holds a
    layer's experts as fused 3-D parameters of one module that the block always calls (5.24
    ``modeling_mixtral.py`` ``MixtralExperts`` L56-93, ``MixtralSparseMoeBlock.forward`` L122-131), so the
    order is the same each step. Before 5, each expert is a module of its own that the block calls only
    when a token routes to it (4.x ``MixtralSparseMoeBlock.forward``: ``expert_hitted =
    torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()``, ``for expert_idx in expert_hitted:
    expert_layer = self.experts[expert_idx]``): the order changes, and DeepSpeed drops its trace
    (v0.19.8 ``partitioned_param_coordinator.py`` ``trace_prologue`` L202-219, ``_invalidate_trace``): None."""
    experts = [p.name for p in m.parameter_tensors() if p.role == "expert"]
    if not experts:
        return ()
    if t.deepspeed_release() >= (0, 18, 0) and m.model_type in DS_DEFAULT_LEAF_TYPES:
        return tuple(dict.fromkeys(n.rsplit(".experts.", 1)[0] for n in experts if ".experts." in n))
    tf = t.transformers_release
    return () if tf is None or tf >= (5,) else None


def deepspeed_gather_events(m: ModelSpec, t: TrainingSpec, st: States) -> tuple:
    """DeepSpeed ZeRO-3's gathered storage made and freed at each module fetch of the recorded order, for
    the run's first step and the steps after it (``zero3_replay.gather_events``: elements, the engine's
    dtype) and the gradient buckets' flat ``cat`` at each backward hook that reduces one (``reduce_cats``),
    which the reserved replay runs through the allocator (``reserved.zero_gather._Zero3Replay``); () where
    the coordinator's replay does not apply (``deepspeed_gather_zones``)."""
    args = _gather_order_args(m, t)
    if args is None:
        return ()
    from ..zero3_replay import gather_events
    bucket = t.ds_reduce_bucket if (st.trainable > 0 and not _partial_layout(m, t, st)) else 0   # with every parameter trainable
    params, head, tied, leaves, views = args
    return gather_events(params, head, tied, t.recompute == "full", t.ds_reuse_distance, t.ds_prefetch,
                         DS_MAX_LIVE, bucket, leaves, views, _frozen_embedding(m, t, st))


def _frozen_embedding(m: ModelSpec, t: TrainingSpec, st: States) -> frozenset:
    """The word embedding's parameter index where its module's backward never runs
    (``zero3_replay.without_backward``): nothing trainable before the layers (LoRA leaves the table
    frozen, and its input is token ids) and no recomputation (peft's gradient checkpointing makes the
    embedding's output require grad, ``enable_input_require_grads``); empty elsewhere."""
    if t.recompute != "none" or any(w == "before" for (w, *_rest) in st.trainables):
        return frozenset()
    emb = next((i for i, p in enumerate(m.parameter_tensors()) if p.role == "embedding"), None)
    return frozenset() if emb is None else frozenset({emb})


def deepspeed_linear_wrap(t: TrainingSpec) -> bool:
    """Whether DeepSpeed ZeRO-3 runs ``F.linear`` as its ``zero3_linear_wrap`` (``LinearFunctionForZeroStage3``,
    ``zero/linear.py``): under ``zero.Init``, and for a model built outside it from v0.19.4
    (``TrainingSpec.ds_linear_keeps_gathered`` says when not). Its backward computes the input's gradient
    first, ``grad_output.matmul(weight)``, then the weight's (v0.19.8 ``zero/linear.py`` L125-134), so the
    first cuBLAS call of autograd's thread, which binds that thread's workspace, is the input gradient's,
    before the head's weight gradient exists (``reserved.loss_backward._head_backward``)."""
    return deepspeed_zero(t) and t.zero == 3 and t.gemini is None and not t.ds_linear_keeps_gathered


def deepspeed_linear_kept(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of one layer's matmul weights, whole, in the engine's dtype, that autograd keeps gathered
    from the layer's forward to its backward under DeepSpeed ZeRO-3 with torch's own ``F.linear``
    (``TrainingSpec.ds_linear_keeps_gathered``: a model built outside ``zero.Init``, DeepSpeed up to
    0.19.1); 0 otherwise, on one rank (there a gathered parameter is its partition itself:
    ``_no_gather_coalesced``, v0.14.2 L769-779, ``NoGatherHandle``: ``param.data = ds_tensor.data``),
    or under full recompute (a checkpointed layer's forward saves nothing under ``no_grad``; the
    second copy its recomputed forward keeps through that layer's backward is neglected).

    ``F.linear`` on a (b, s, h) input is ``matmul(input, weight.t())`` (ATen ``linear``), whose
    ``MmBackward`` saves ``mat2``, the transposed weight: a view of the gathered storage, not the
    parameter. After the module's forward ZeRO-3 releases the parameter (``free_param``, v0.14.2
    ``partition_parameters.py`` L279-289: ``param.data = torch.empty(0)``), which frees nothing while
    the view holds the storage; it goes when the linear's backward has run, after ZeRO-3 gathered the
    parameter again (a new tensor) for that backward. ``zero3_linear_wrap`` saves the parameter
    itself, whose storage ``free_param`` does swap out (DeepSpeed #8189: "the standard Linear
    implementation can retain the gathered weight storage until backward completes"). The layers ZeRO-3
    keeps gathered anyway (``deepspeed_gathered``'s reuse distance) are the same storage, counted here.
    Found by Giles Thomas's Llama-3-8B ZeRO-3 rows over 8 GPUs (no ``zero.Init``, DeepSpeed 0.14.2): at
    1001 and 2001 tokens the worst rank was the estimate plus 14,953 / 14,963 MiB at the loss, and 32
    layers' matmul weights in fp16 are 13,312 MiB (the head's 1,002 counted already as kept)."""
    if not (t.ds_linear_keeps_gathered and t.shard_group > 1 and t.recompute != "full"):
        return 0
    layer = [p for p in m.parameter_tensors() if p.layer == 0 and p.is_matmul]
    return sum(block_of(t, -(-p.numel // t.tp) * t.weight_bytes) for p in layer)   # (out, in) per weight


def deepspeed_gathered_embedding(m: ModelSpec, t: TrainingSpec) -> int:
    """DeepSpeed ZeRO-3's gathered parameters at the input embedding's backward, the last module of
    backward (0 off ZeRO-3 over several ranks, or without an embedding): its pre-backward hook
    fetches the module's own parameters whole (v0.19.8 ``parameter_offload.py``
    ``_pre_backward_module_hook`` L410 -> ``pre_sub_module_backward_function`` L573 ->
    ``fetch_sub_module``), a tied table too, since the head's backward released it (it is gathered for
    the embedding module as for any other: ``deepspeed_gathered`` counted none for a tied one); and no
    prefetch is in flight, since no module of the recorded order comes after it
    (``partitioned_param_coordinator.py`` L451-485). Found by trace: Llama-3.2-1B (tied, vocabulary
    128256) cut to 2 layers, ZeRO-3 dp 4 bf16: the step's peak, at the embedding's backward, holds the
    whole table gathered (501 MiB) and no prefetch; the estimate read -6.5% with a layer and a
    prefetch bucket there."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1):
        return 0
    emb = next((-(-p.numel // t.tp) for p in m.parameter_tensors() if p.role == "embedding"), 0)
    return block_of(t, emb * t.weight_bytes) if emb else 0


def deepspeed_coalesced(m: ModelSpec, t: TrainingSpec) -> int:
    """DeepSpeed ZeRO-3's coalesced all-gather output of the prefetch in flight at the top layer's
    forward, beside the parameters built from it (steps after the first); 0 off ZeRO-3 over several
    ranks or without prefetch. A prefetch takes parameters of the order recorded in the first step
    (none before that trace is complete) that are not gathered yet, up to ``stage3_prefetch_bucket_size``
    elements (DeepSpeed v0.19.8 ``partitioned_param_coordinator.py`` L451-480), and gathers them with one
    ``all_gather_coalesced`` (L582-613: one handle, registered in ``__inflight_param_registry`` for each
    of them), whose output is one flat tensor of their partitions (``partition_parameters.py``
    ``_all_gather_dtype`` L1329-1350: ``partitions`` are views of it). The first of them fetched waits
    on the handle, which builds every parameter of the group by ``torch.cat`` of its pieces
    (``AllGatherCoalescedHandle.wait`` L761-803) while ``self.partitions`` still views the flat tensor;
    it lives until the last of the group is popped from the registry (coordinator L407-411). The root
    module's fetch (no parameters of its own) starts the step's first prefetch, so a stage within the
    bucket is one group, alive from the embedding's forward to the last module's (the final norm):
    the stage's parameters, up to the bucket, in the engine's dtype. Found by trace: a Llama of 8
    layers (hidden 512, vocab 8192) ZeRO-3 dp 4 bf16, 1 x 128: the second step's forward peak at the
    top layer's MLP holds the model gathered twice; the estimate read -2.8% without it."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1) or t.ds_prefetch <= 0:
        return 0
    total_n = sum(-(-p.numel // t.tp) for p in m.parameter_tensors()) // t.pp  # the stage's parameters
    return block_of(t, min(t.ds_prefetch, total_n) * t.weight_bytes)


def deepspeed_embedding_kept(m: ModelSpec, t: TrainingSpec, st: States) -> bool:
    """Whether DeepSpeed ZeRO-3, once its module order is recorded (from the run's second forward on:
    ``reset_step`` at each forward's start completes the trace, v0.19.8 ``parameter_offload.py`` L304-306,
    ``partitioned_param_coordinator.py`` L251-270), keeps the input embedding's table gathered from its
    forward to its backward. A module's parameters are not released if they come up again in the
    modules of the recorded order within ``stage3_max_reuse_distance`` elements after it (``__params_to_release``
    L634-664: the traversal stops once the elements it passed reach the distance). Between the
    embedding's uses come: a tied table (the head's weight), the layers' forward, then (after the
    head's forward and backward, which use it) the layers' backward, recomputed forward first under
    full recompute; an untied one, the layers' forward, the head's forward and backward, the layers'
    backward. (The final norm's elements are neglected.)"""
    if not deepspeed_gathered_embedding(m, t) or not is_lm(m):
        return False
    layer_n = st.layer_params_full // t.weight_bytes
    layers = m.num_layers // t.pp
    back = (2 if t.recompute == "full" else 1) * layers * layer_n      # the layers' backward (recomputed)
    if m.tied_embeddings:
        return max(layers * layer_n, back) < t.ds_reuse_distance
    return layers * layer_n + 2 * _head_weight_numel(m, t.tp) + back < t.ds_reuse_distance


#: DeepSpeed ZeRO-3's ``stage3_max_live_parameters`` (DeepSpeed v0.19.8 ``runtime/zero/config.py`` L245:
#: 1e9 elements; not an option here, and trace's engine runs with this default too)
DS_MAX_LIVE = 1_000_000_000


def deepspeed_layer_params(m: ModelSpec, t: TrainingSpec) -> tuple[int, ...]:
    """Elements of each of one layer's parameters, whole, in the order the layer's modules run (norm
    before attention, attention before the MLP; () off ZeRO-3 over several ranks). ZeRO-3 gathers a
    module's own parameters at its forward and backward hooks (v0.19.8
    ``partitioned_param_coordinator.py`` ``fetch_sub_module`` L340-381); each whole parameter is a
    tensor of its own in the engine's dtype (``partition_parameters.py`` ``_allgather_params_coalesced``,
    or built by ``torch.cat`` from a prefetch's flat output: ``AllGatherCoalescedHandle.wait``
    L761-803), on the all-gather stream under ``overlap_comm`` (coordinator L400)."""
    if not (deepspeed_zero(t) and t.zero == 3 and t.shard_group > 1):
        return ()
    layer = sorted((p for p in m.parameter_tensors() if p.layer == 0),   # (stable: registration order within)
                   key=lambda p: (0 if "input_layernorm" in p.module else 1 if "attn" in p.module else
                                  2 if "post_attention" in p.module else 3))
    return tuple(-(-p.numel // t.tp) for p in layer)


def deepspeed_layers_kept(m: ModelSpec, t: TrainingSpec, st: States) -> int:
    """The top layers whose gathered parameters ZeRO-3 keeps from their forward to their backward once
    its module order is recorded: those whose next use comes within ``stage3_max_reuse_distance``
    elements (``__params_to_release`` L634-664; the count ``deepspeed_gathered`` takes)."""
    if not deepspeed_layer_params(m, t):
        return 0
    layer_n = st.layer_params_full // t.weight_bytes
    head_n = _head_weight_numel(m, t.tp) if is_lm(m) else 0
    c, dist, layers = (3 if t.recompute == "full" else 2), t.ds_reuse_distance, m.num_layers // t.pp
    return min(layers, -(-(dist - 2 * head_n) // (c * layer_n))) if (layer_n and dist > 2 * head_n) else 0


def deepspeed_leaf_held(m: ModelSpec, t: TrainingSpec, lc: LayerCoefs) -> tuple[int, int]:
    """Under DeepSpeed ZeRO-3 with the MoE block a leaf module (``_z3_leaves``): the index of the experts'
    gate/up projection's backward transient in ``lc.transients`` and the bytes of the down projection's
    weight gradient still alive then (experts x h x f in the parameter's dtype: the
    ``experts.down.backward`` transient's constant, ``layers._moe``); (-1, 0) otherwise.

    DeepSpeed v0.19.8 ``runtime/zero/stage3.py`` ``create_reduce_and_remove_grad_hooks`` (L1487-1559) puts no
    gradient hook on a leaf's parameters (``if not z3_leaf_parameter(param): wrapper(param)``, L1527) and
    "delay[s] reduce for all gradients in the leaf modules until the backward pass of the leaf module is
    done" (L1533): one ``register_full_backward_hook`` on the block (``reduce_leaf_module_grads``,
    L1538-1556) reduces them once the block's input gradient is made. Without a leaf each parameter's
    ``AccumulateGrad`` hook copies its gradient into the ipg bucket and frees it (``__add_grad_to_ipg_bucket``
    L1621-1646). transformers 5.24 runs down's ``_grouped_mm`` backward before gate/up's
    (``integrations/moe.py`` ``grouped_mm_experts_forward``), so gate/up's gradient is made beside down's.
    Found by trace: Mixtral's widths cut to 4 layers, ZeRO-3 dp 8, bf16, 1 x 512: at the top block's hook
    both experts' gradients alive (1,792 + 896 MiB); the estimate's gate/up moment had 1,736 MiB of
    temporaries (-3.9 % allocated before). The hook's own moment (the bucket's ``cat`` beside them) is not
    modelled."""
    leaves = _z3_leaves(m, t) if (deepspeed_zero(t) and t.zero == 3) else ()
    names = [name for name, *_ in lc.transients]
    if not leaves or "experts.gate_up.backward" not in names or "experts.down.backward" not in names:
        return (-1, 0)
    return names.index("experts.gate_up.backward"), int(lc.transients[names.index("experts.down.backward")][3])


def z3_leaf_grads_held(trans: tuple, held: tuple[int, int]) -> tuple:
    """The layer's transients (``_layer_transients``) with ``held`` = (index, bytes) added to that
    transient's constant bytes (``deepspeed_leaf_held``)."""
    i, nbytes = held
    if not nbytes:
        return trans
    return trans[:i] + ((trans[i][0], trans[i][1], trans[i][2] + nbytes, *trans[i][3:]),) + trans[i + 1:]
