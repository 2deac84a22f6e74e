"""The layers' saved tensors and transients at the backward moments: recomputation and activation
offload, the transients' table rows, the gradients above a layer, the outer tensors by moment,
what the first layer does not save, PEFT's and the offload stash's kept inputs."""
from __future__ import annotations

from ...spec.frameworks import OWN_MODEL_CODE, torchtune_offload_exempts_parameters
from ...spec.model import ModelSpec
from ...spec.training import TrainingSpec
from ..derived import first_free_casts as derived_first_free_casts
from ..layers import ALL_MOMENTS, LayerCoefs, Policy
from ..states import States
from .model_facts import ENGINE_CAST, F32, HEAD_KEYS, PER_POSITION


def _kept_and_redone(t: TrainingSpec, lc: LayerCoefs, input_tok: float, checkpointed: int, layers: int
                     ) -> tuple[tuple, tuple, bool]:
    """A layer's kept bytes and its recomputation's (``_recompute``; activation offloading moves the
    kept ones to the host, ``_offloaded``), and whether the top layer is checkpointed: the recompute
    transient belongs to the top layer's backward moment only then; otherwise it comes later, when
    the layers above it have freed more than it adds."""
    kept, redo = _recompute(t, lc, input_tok, checkpointed / layers)
    if t.offload_activations:
        kept, redo = _offloaded(kept, redo, input_tok)
    top_recomputed = t.recompute not in ("full", "op") or layers % t.recompute_every == 0
    return kept, (redo if top_recomputed else (0.0, 0.0)), top_recomputed


def _layer_transients(t: TrainingSpec, lc: LayerCoefs, pol: Policy, gpw: float, freed: float,
                      input_tok: float, received: bool = False) -> tuple:
    """Each op's backward transient of one layer: (a per token, b per token x key, c bytes, g
    gradient bytes made by then, d per position squared, the backward moments it happens at: a bit
    mask, every layer's by default, e per token that the top layer does not add: with ``received``,
    the layer's output gradient it counts, ``LayerCoefs.incoming``, which on a pipeline stage that
    receives its output's gradient is the receive buffer, counted with the inputs:
    ``receives_output_grad``). ``gpw``: gradient bytes per weight element; ``freed``: inside
    a layer's backward the half weight copies of its later linears (back-propagated already) were
    freed with their matmuls' saved tensors, so each transient excludes them (2 bytes per element;
    frozen ones too, ``LayerCoefs.after_frozen``: found by trace, llama 8 x 512 LoRA --pp 2, bf16-amp,
    the first stage's top-layer ``MulBackward0`` +0.3% before, ``down_proj``'s copy),
    except for grouped experts, which autocast does not copy (``LayerCoefs.after_uncast``; found by
    trace: Mixtral, 2 layers, full recompute, bf16-amp, the first layer's ``gate_up`` backward:
    -3.2% before)."""
    after = lc.after or (0.0,) * len(lc.transients)
    uncast = lc.after_uncast or (0.0,) * len(lc.transients)
    ssq = lc.transients_ssq or (0.0,) * len(lc.transients)
    at = lc.transients_at or (ALL_MOMENTS,) * len(lc.transients)
    own = lc.own_cast or (0.0,) * len(lc.transients)  # (a linear's fp32 cast of its weight gradient)
    top_less = lc.incoming if (received and lc.incoming) else (0.0,) * len(lc.transients)
    # (LoRA: the frozen linears' half copies, saved by their matmuls, are freed by their backward too)
    frozen = lc.after_frozen or (0.0,) * len(lc.transients)
    trans = tuple((a, b, c - (w - u + o + z) * freed, int(w * gpw), d, k, e)
                  for (_, a, b, c), w, u, o, z, d, k, e in zip(lc.transients, after, uncast, own, frozen, ssq, at,
                                                                top_less))
    if t.recompute == "full" and t.recompute_every == 1:  # (each layer checkpointed: ENGINE_CAST's op's moment
        # stands in for it, below which it is; the position kept for ``breakdown.where_label``)
        trans = tuple(trans[i - 1] if i and name.endswith(ENGINE_CAST) else v
                      for i, ((name, *_), v) in enumerate(zip(lc.transients, trans)))
    if t.offload_activations and trans:
        trans = trans[:-1] + ((trans[-1][0] + offload_previous(input_tok, pol), *trans[-1][1:]),)
    return trans + recompute_transients(t, lc, received)


def recompute_transients(t: TrainingSpec, lc: LayerCoefs, received: bool = False) -> tuple:
    """Under full recompute (every layer checkpointed), the moments of a layer's recomputed forward
    as transients over its saved tensors (``LayerCoefs.recompute_moments``), after its backward
    ones (``breakdown.where_label`` names them): non-reentrant checkpointing recomputes the layer
    when backward first unpacks one of its saved tensors (torch/utils/checkpoint.py
    ``_checkpoint_hook.unpack_hook`` -> ``recompute_fn``), with the gradients made so far alive,
    and runs the forward up to its last pack, its Python frames holding what they hold in forward
    (peft's fp32 copy of a linear's input, the base output beside the adapter's). No weight
    gradient of the layer exists yet (g = 0), no weight copy was freed. Found by trace: Llama 8 x
    512 LoRA on all seven projections, full recompute, bf16-amp 2 x 1024: -7.4% before (the peak at
    ``down_proj``'s ``lora_B`` in the top layer's recomputation); bf16: -8.6%; with dropout 0.05
    -11.4%."""
    if t.recompute != "full" or t.recompute_every != 1 or lc.checkpointed or not lc.recompute_moments:
        return ()
    e = lc.recompute_incoming if received else 0.0
    return tuple((a, b, 0.0, 0, 0.0, ALL_MOMENTS, e) for _name, a, b, _blocks in lc.recompute_moments)


def _grads_above(m: ModelSpec, t: TrainingSpec, st: States, layers: int) -> tuple[int, int, int]:
    """(an encoder-decoder's encoder layers on this rank (0 otherwise), gradient bytes of the layers
    above the bottom layer, of those above the decoder-bottom layer): the gradients made before those
    layers' backward. The layers' own bytes where they differ (a derived encoder-decoder's decoder
    layers hold cross-attention, ``States.each_layer_grads``), else the average layer's."""
    lower = m.num_layers - m.decoder_layers if m.is_encoder_decoder and t.pp == 1 else 0
    if t.grads_freed_in_backward:
        return lower, 0, 0
    each = st.each_layer_grads if (m.family == "derived" and lower and len(st.each_layer_grads) == layers) else ()
    if each:  # (the decoder's position tables' gradients are made before the encoder's backward)
        return lower, sum(each[1:]) + st.between_grads, sum(each[lower + 1:])
    return lower, (layers - 1) * st.layer_grads, max(layers - lower - 1, 0) * st.layer_grads


def _decoder_grads(m: ModelSpec, t: TrainingSpec, st: States, layers: int) -> int:
    """Gradient bytes of an encoder-decoder's decoder layers (all of them: made by the time its
    decoder embedding runs its backward, ``moments`` ``embeddings.decoder_backward``); 0 otherwise."""
    lower = m.num_layers - m.decoder_layers if m.is_encoder_decoder and t.pp == 1 else 0
    if not lower or t.grads_freed_in_backward:
        return 0
    each = st.each_layer_grads if (m.family == "derived" and len(st.each_layer_grads) == layers) else ()
    return sum(each[lower:]) if each else (layers - lower) * st.layer_grads


def _split_outer(outer: list[tuple[str, float, float]], rest_pos: float) -> tuple[float, float, float, float]:
    """The tensors outside the layers summed as (final norm / head input per token, the rest
    (embeddings, masks) per token and per token x key, per sequence position)."""
    head_tok = rest_tok = rest_sq = 0.0
    for name, tok, sq in outer:
        if name in HEAD_KEYS:
            head_tok += tok
        elif name in PER_POSITION:
            rest_pos += tok
        else:
            rest_tok, rest_sq = rest_tok + tok, rest_sq + sq
    return head_tok, rest_tok, rest_sq, rest_pos


def _recompute(t: TrainingSpec, lc: LayerCoefs, input_tok: float, share: float
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """(kept per layer, re-created while one layer is recomputed) as (per token, per token x key).
    none: everything is kept; selective (Megatron): the attention scores are recomputed; full: only
    each checkpointed layer's input is kept, and one whole layer comes back during its backward;
    op (torchtitan's per-op policy): the input and the op outputs the policy saves
    (``layers.op_checkpoint_saved``), the rest of the layer coming back during its backward. ``share``: the checkpointed share of the rank's layers (1 unless ``recompute_every`` N > 1:
    torchtitan's and torchtune's ``ac_freq``/``ac_option`` wrap a layer when its 1-based count is a
    multiple of N, torchtitan ``distributed/activation_checkpoint.py``), so the average layer keeps
    ``share`` of an input and ``1 - share`` of everything."""
    # a recomputed layer saves its input again only where it makes a copy of it: where a norm saves
    # the input itself (an fp32 stream under autocast or in fp32), that tensor is the kept input
    redo_tok = lc.tok - lc.input_saved
    if t.recompute == "full" and lc.checkpointed:
        # measured from traces with the layers checkpointed (``derived.layer_coefs``): what each
        # layer keeps is measured, and its recomputation is in its backward transients
        return (lc.tok, lc.sq), (0.0, 0.0)
    if t.recompute == "full":
        kept = (share * input_tok + (1 - share) * lc.tok, (1 - share) * lc.sq) if share < 1 else (input_tok, 0.0)
        # a layer recomputed in its backward re-creates what its own ops save, not its output (which
        # only the next layer saved): measured for derived architectures (``trace.derive``)
        return kept, ((redo_tok - lc.not_recomputed, lc.sq) if share > 0 else (0.0, 0.0))
    if t.recompute == "selective":
        return (lc.tok, 0.0), (0.0, lc.sq)
    if t.recompute == "op":
        # torchtitan's per-op policy: the input and the saved op outputs stay; in its backward the
        # layer is recomputed around them (the cached outputs are handed back, not made again), so
        # the layer then holds its input and everything it saves: redo = saved - what was kept
        return (input_tok + lc.op_tok, lc.op_sq), (redo_tok - lc.op_tok, lc.sq - lc.op_sq)
    return (lc.tok, lc.sq), (0.0, 0.0)


def _offloaded(kept: tuple[float, float], redo: tuple[float, float], input_tok: float
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """torchtune's activation offloading over full recompute (``checkpointing.OffloadActivations``):
    the checkpointed layer's input, which the checkpoint frame saves through the offloading hooks
    (torch 2.13 torch/utils/checkpoint.py L842-847, ``_CheckpointFrame.save_inputs``), leaves
    the GPU once ``max_fwd_stash_size`` (5) later tensors were packed (a Llama layer packs one, the
    final RMSNorm five, so none is left when forward ends), and comes back as a new tensor when the
    layer is recomputed in its backward: kept per layer 0, the recomputed layer holds it again."""
    return (kept[0] - input_tok, kept[1]), (redo[0] + input_tok, redo[1])


def offload_previous(input_tok: float, pol: Policy) -> float:
    """Bytes per token that the first node of a layer's backward finds still on the GPU under
    torchtune's offloading: the tensor the node before it brought back, freed only after this node
    has run (``bwd_tensor_stash``, _activation_offloading.py L263-266, L334-338): the next layer's
    input where the residual stream is half (an fp32 one is saved by the recomputed norm itself, so
    torchtune lets it go with that reference, L315-323, freed before this layer). Above the top layer
    it is the final RMSNorm's fp32 input instead (``LlamaRMSNorm``'s ``pow`` saves
    ``hidden_states.to(float32)``), which this leaves out: the top layer's moment has fewer gradients
    than the bottom one's, where the peak of a checkpointed backward falls."""
    return input_tok if pol.stream != F32 else 0.0


def offload_stash_keeps_top_input(t: TrainingSpec) -> bool:
    """LoRA with activation offloading: whether the top layer's input stays on the GPU from the end of
    forward until that layer is recomputed. torchtune's pack hook drops a tensor from ``fwd_stash`` only
    when ``max_fwd_stash_size`` (5) later tensors big enough to offload were packed (v0.6.1
    _activation_offloading.py L133-200; trainmem.checkpointing.OffloadActivations). After the top layer's
    input only the final RMSNorm packs: its fp32 input (``pow``), the ``rsqrt`` output, both again for the
    ``mul``, and, for the weight's product, the weight (needed for the input's gradient) and, when the
    weight is trained, the normalized tensor. With LoRA the norm is frozen: its weight is the fifth pack
    and an ``nn.Parameter``, which the hook keeps on the GPU without offloading (exempt since 3ca0d309c,
    2024-10-18, torchtune v0.4.0), so only four count and the input stays; its unpack then takes it from
    the stash without a copy (the layer's recompute). Before v0.4.0 the weight was offloaded too
    (30b8519e8 L134-197: every tensor of >= 1024 B): nothing stays. Found by trace (Llama 4 x 256, LoRA r8,
    4 x 1024): its forward ended one layer input above the estimate."""
    if not (t.lora_rank and t.offload_activations):
        return False
    # (without --framework torchtune: trainmem.checkpointing's hooks, which exempt parameters as v0.6.1)
    return t.extra.get("framework") != "torchtune" or torchtune_offload_exempts_parameters(t)


def peft_offload_leaf(t: TrainingSpec, stage: str, input_tok: float) -> tuple[tuple[str, float, float], ...]:
    """LoRA with activation offloading on a transformers model: the first layer's input stays on the GPU.
    peft's ``PeftModel`` calls ``enable_input_require_grads`` (peft 0.21.2 peft_model.py L725-735), a
    forward hook on the input embeddings that makes their output require grad: a leaf, which its
    ``AccumulateGrad`` node holds until the graph is freed (``torch/csrc/autograd/functions/
    accumulate_grad.h``: ``Variable variable``), so offloading the checkpoint's copy of it frees nothing,
    and the bottom layer's recompute brings a second copy back beside it. Counted as a negative
    ``first_unsaved`` term: the first layer keeps one input (b, s, h) more, bf16 or the stream's dtype.
    torchtune's own models (``OWN_MODEL_CODE``) have no such hook: their first layer's input is
    offloaded like the others. Found by trace (Llama 4 x 256, LoRA r8, full recompute, bf16,
    4 x 1024): the bottom layer's backward peak was one layer input (2 MiB) above the estimate."""
    if not (t.lora_rank and t.offload_activations) or t.extra.get("framework") in OWN_MODEL_CODE \
            or not (t.pp == 1 or stage == "first"):
        return ()
    return (("first_layer.offload_leaf", -input_tok, 0.0),)


def _cast_first_free(m: ModelSpec, t: TrainingSpec, lc: LayerCoefs, lora_first: bool, cast: bool, stage: str) -> int:
    """Bytes of the first layer's half weight copies (bf16/fp16) that no matmul keeps, which the engine's
    per-layer copies count (``Quantities.cast_first_free``): the hand-written recipes' frozen linears on a
    LoRA model's grad-free first-layer input (``LayerCoefs.first_free_weights``, with ``lora_first``), a
    derived model's measured ones (``derived.first_free_casts``; on the stage holding the first layer)."""
    own = int(sum(lc.first_free_weights) * 2) if lora_first else 0
    return own + (derived_first_free_casts(m, t) if cast and (t.pp == 1 or stage == "first") else 0)


def first_layer_unsaved(t: TrainingSpec, lc: LayerCoefs, stage: str) -> tuple[tuple[str, float, float], ...]:
    """LoRA: the tensors the first layer does not save, because its input (the frozen embedding's
    output) requires no gradient and autograd keeps nothing for an op none of whose inputs needs one
    (``layers.Recipe.first_layer_unsaved``): the ops before the first adapter, the frozen linears on
    that input (their half weight copies: ``Quantities.cast_first_free``), an adapter dropout's mask
    on it. Without recompute, and under selective recompute less its s x s terms (which selective
    does not keep anyway): a checkpointed layer's recompute runs under its own rules; only on the
    stage holding the first layer. Found by trace (benchmarks/bench_agreement.py: Llama 2 layers,
    LoRA on q/v, +2.8%; on gate_proj alone +15.9%)."""
    if not t.lora_rank or t.recompute not in ("none", "selective") or t.offload_activations \
            or not (t.pp == 1 or stage == "first"):
        return ()
    if t.recompute == "selective":
        return tuple((name, tok, 0.0) for name, tok, _sq in lc.first_unsaved)
    return lc.first_unsaved
