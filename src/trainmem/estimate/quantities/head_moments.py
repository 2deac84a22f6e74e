"""The final norm and the head around the loss: the norm's forward and backward tensors, BERT's top,
the held embeddings, the head's weight gradient and casts, autocast's copies, the head's replay
order, the half embedding output."""
from __future__ import annotations

from typing import Any

from ...spec.frameworks import OWN_MODEL_CODE
from ...spec.model import ModelSpec
from ...spec.training import TrainingSpec
from ..derived import view_casts as derived_view_casts
from ..layers import LayerCoefs, Policy
from ..states import States, torch_pipeline
from .loss import loss_mode
from .model_facts import F32, is_lm
from .outer import head_side_tensors, mlm_head_grad_chain


def _classifier_rms_norm(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether the model is a transformers decoder's classifier or question-answering head after
    transformers' own RMSNorm (``final_norm_forward``, ``final_norm_backward``): not under
    ``--compile`` (fused kernels), tensor or pipeline parallelism (the norm sharded or another
    rank's) or a framework's own model code."""
    return m.head in ("seq-cls", "qa") and m.family in ("llama", "mixtral") and m.final_norm \
        and m.norm == "rmsnorm" and not t.compile and t.tp == 1 and t.pp == 1 \
        and t.extra.get("framework") not in OWN_MODEL_CODE


def final_norm_forward(m: ModelSpec, t: TrainingSpec, pol: Policy) -> float:
    """Bytes per token alive at the final RMSNorm's last forward op beyond the saved tensors, for a
    decoder's classifier or question-answering head (``_classifier_rms_norm``), whose forward has no
    vocabulary-sized loss after it to peak at.

    transformers 5.24 ``models/llama/modeling_llama.py`` L62-67: ``self.weight *
    hidden_states.to(input_dtype)`` allocates its output while the norm's input (the caller's
    ``hidden_states``, L404 ``hidden_states = self.norm(hidden_states)``) and its local fp32
    ``x32 * rsqrt(...)`` product are still referenced. In a half residual dtype (pure bf16/fp16)
    those are tensors of their own: the input (h, half), the fp32 product (h x 4), and the base
    model's ``inputs_embeds`` (``held_embeddings``, L372 and L390: h, half); the output is the head's saved input
    (``_head_side``), counted. In an fp32 residual (fp32, autocast) ``to(float32)`` and
    ``to(input_dtype)`` return their input, so the input and product are the norm's saved tensors;
    the output (h x 4) is new, and under autocast the head saves its half cast instead, made only
    after (counted in the saved tensors but not yet there). Found by trace: Llama (2 layers, hidden
    256) question answering, pure bf16, 4 x 256: forward -4.6% before. 0 under LoRA (the frozen
    norm's multiply saves nothing, so its operand is one more frame-held tensor: not modelled)."""
    if not _classifier_rms_norm(m, t) or t.lora_rank:
        return 0.0
    h = m.hidden_size
    if pol.stream != F32:
        return float(h * pol.stream + h * F32 + h * pol.stream)
    return float(h * F32 - h * pol.half)


def bert_top_forward(m: ModelSpec, t: TrainingSpec, pol: Policy) -> float:
    """Bytes per token alive at the last BERT layer's output LayerNorm (the forward's peak for a
    classifier or question-answering head, which has no vocabulary-sized loss after it) beyond the
    saved tensors (transformers 5.24 ``models/bert/modeling_bert.py``):

    * ``BertOutput.forward`` L349-352: its local ``hidden_states``, the dropout's output (the dense
      output without dropout), (b, s, h) in the matmul dtype, is referenced while ``self.LayerNorm(
      hidden_states + input_tensor)`` runs; the LayerNorm's output (residual dtype) is new. The head
      saves that output itself (``pooler.input``; under autocast a per-sample cast, and the output is
      extra) or, for question answering, its half cast made later (``qa_outputs.input``), counted in
      the saved tensors.
    * Under autocast the linears save half casts, so fp32 (b, s, h) tensors that only Python frames
      hold are extra: ``BertModel.forward``'s ``embedding_output`` (L657, until it returns),
      ``BertEncoder.forward``'s ``hidden_states`` (L439-440: the last layer's input, another tensor
      with two layers or more) and ``BertLayer.feed_forward_chunk``'s ``attention_output`` (L417-419).
      In fp32 / pure half those are the q/k/v and ``intermediate.dense`` inputs, saved already.

    Found by trace: BERT (2 layers, hidden 64) question answering, bf16-amp, 4 x 256: the step's
    peak is this forward moment, -2.2% before. 0 for other heads and families, under recompute (a
    checkpointed layer saves nothing in forward), LoRA (frozen linears save no input), --compile,
    tensor or pipeline parallelism, and a framework's own model code."""
    if m.head not in ("seq-cls", "qa") or m.family != "bert" or t.recompute not in (None, "none") \
            or t.lora_rank or t.compile or t.tp > 1 or t.pp > 1 or t.extra.get("framework") in OWN_MODEL_CODE:
        return 0.0
    h = m.hidden_size
    out = h * pol.half + h * pol.stream       # the dropout's output (half), the LayerNorm's output
    out -= h * (pol.half if m.head == "qa" else 0 if pol.amp else pol.stream)   # the head's input, counted
    if pol.amp:  # embedding_output, the last layer's input (two layers or more), attention_output
        out += h * pol.stream * ((2 if m.num_layers > 1 else 1) + 1)
    return float(out)


def final_norm_backward(m: ModelSpec, t: TrainingSpec, pol: Policy) -> float:
    """Bytes per token alive at the final RMSNorm's backward beyond the saved tensors, for a decoder's
    classifier or question-answering head (``*ForSequenceClassification``, ``*ForQuestionAnswering``),
    whose backward reaches the norm with every layer's saved tensors still alive and no vocabulary-
    sized loss before it (a causal LM's cross-entropy backward is its peak instead).

    transformers 5.24 ``models/llama/modeling_llama.py`` L62-67, ``LlamaRMSNorm.forward``:
    ``x32 = hidden_states.to(torch.float32)``; ``variance = x32.pow(2).mean(-1, keepdim=True)``;
    ``x32 * torch.rsqrt(variance + eps)``; ``self.weight * normed.to(input_dtype)``. Backward, in
    autograd's order: the weight's ``MulBackward0`` (then ``normed``, saved only for the weight's
    gradient, is freed: ``_head_side`` counts it); the multiply by ``rsqrt``'s, which hands x32 its
    first gradient (b, s, h) fp32, held in autograd's input buffer until the second arrives;
    ``RsqrtBackward0`` and ``MeanBackward0``, whose ``sum_backward(...) / numel`` (PyTorch
    ``tools/autograd/derivatives.yaml`` ``mean.dim``, ``FunctionsManual.cpp`` ``mean_backward``)
    materialises (b, s, h) fp32; then ``PowBackward0``, ``pow_backward``: ``grad * (exponent *
    self.pow(exponent - 1))`` (``FunctionsManual.cpp``), three more (b, s, h) fp32 tensors alive
    together within the expression: five in all (fp32, h each per token), beside x32 (saved by
    ``pow`` and the multiply). By then the head's saved input (``qa_outputs.input`` /
    ``pooler.input`` in ``_head_side``, (b, s, h) in the matmul dtype) was released by its ``mm``'s
    backward. The head's and the norm's weight gradients ((num_labels + 1) x h elements) are left
    out. Found by trace: Llama (2 layers, hidden 256) question answering, pure bf16, 4 x 256, whose
    peak is the final norm's ``PowBackward0``: -0.8% before.

    0 where ``_classifier_rms_norm`` does not hold."""
    if not _classifier_rms_norm(m, t):
        return 0.0
    h = m.hidden_size
    normed = 0 if t.lora_rank else h * pol.stream   # frozen (LoRA): never saved (``_head_side``)
    head_input = h * pol.half                       # qa_outputs / score saves its input (``_head_side``)
    return float(5 * h * F32 - normed - head_input)


def held_embeddings(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs | None = None) -> float:
    """Bytes per token of the embedding output (b, s, h) that a transformers decoder's base model
    holds in forward although autograd saves none of it: ``XModel.forward`` binds it to its local
    ``inputs_embeds``, starts the layers from ``hidden_states = inputs_embeds`` and rebinds only
    ``hidden_states``, so the tensor is freed when the base model returns, after the final norm and
    before the head's matmul (transformers 5.24 ``models/qwen3/modeling_qwen3.py`` L375, L403, L418;
    ``models/llama/modeling_llama.py`` the same, every model built on its template). Counted where
    nothing else holds it: in a half residual dtype (pure bf16 / fp16), where the first layer's
    RMSNorm saves its own fp32 copy (``hidden_states.to(torch.float32)`` makes one), not its input;
    in fp32 the norm's ``to`` returns the tensor itself and it is the first layer's saved input
    (``LayerCoefs.tensors``), as it is in half under a LayerNorm, whose ``native_layer_norm`` saves
    its input (a derived layer's ``input_layernorm.native_layer_norm`` part: Phi-2). Only the replay
    uses it (``reserved.driver._forward``): the forward's
    allocated peak is at the loss, once it is freed. None for a model run by its framework's own
    code (torchtitan's, litgpt's ... ``h = layer(h)`` drops it after the first layer) or split
    into pipeline stages. Found on the H200 runs: Qwen3-0.6B pure bf16 (batch 8, seq 2048), where
    its freed 32 MiB block takes the backward's cuBLAS workspace, which otherwise splits a
    logits-sized segment for good."""
    transformers_class = m.family in ("llama", "mixtral", "derived") and m.head == "causal-lm"
    if not transformers_class or t.pp > 1 or t.extra.get("framework") in OWN_MODEL_CODE or pol.stream != 2:
        return 0.0
    if lc is not None and any(name.endswith("native_layer_norm") for name, _a, _b in lc.parts):
        return 0.0                                    # the first layer's LayerNorm saves it
    sp = t.tp if t.sequence_parallel else 1
    return m.hidden_size * pol.stream / sp


#: transformers 5.24.0 model types whose base model's ``forward`` binds ``inputs_embeds = self.embed_tokens(
#: input_ids)`` before it builds the causal mask and the rotary tables and starts the layers from ``hidden_states =
#: inputs_embeds`` (read in the installed sources: ``models/llama/modeling_llama.py`` L372, L382, L390-391;
#: ``mistral`` L345, L356, L364-365; ``qwen2`` L350, L372, L379; ``mixtral`` L437, L445, L454; ``qwen3`` L375,
#: L397, L404; ``phi3`` L376, L387, L396; ``gemma2`` L410 (its scaled embedding module), L432, L438)
LOOKUP_FIRST_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen3", "phi3", "gemma2")


def lookup_first(m: ModelSpec, t: TrainingSpec) -> int:
    """1 where the bottom checkpoint's kept input, the embedding lookup's output ``inputs_embeds`` (b, s, h, in
    the embedding's dtype), is made before the base model's other embeddings-side tensors (``outer_rest``: the
    4-D causal mask, the rotary cos/sin tables), for the allocator replay (``reserved.driver._looked_up``):
    transformers' Llama template (``LOOKUP_FIRST_TYPES``); 0 elsewhere (BERT's and GPT-2's embeddings modules
    end in their sum's dropout, made after their saved tensors; a pipeline stage; context parallelism; a
    framework's own model code). Trace, Mistral cut to 2 layers (hidden 1024), FSDP1 dp 4 bf16 full recompute b2 s1024: the
    4 MiB ``embedding`` output, then the 4 MiB mask, then the rotary tables (0.25 MiB each)."""
    if m.model_type not in LOOKUP_FIRST_TYPES or t.pp > 1 or t.cp > 1 or t.extra.get("framework") in OWN_MODEL_CODE:
        return 0
    return 1


def gpt2_embeddings(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[float, float, float]:
    """The embedding outputs transformers' GPT-2 holds in forward although autograd saves none of them,
    for the allocator replay (``reserved.driver._forward``): ``GPT2Model.forward`` binds ``inputs_embeds
    = self.wte(input_ids)`` (b, s, h) and ``position_embeds = self.wpe(position_ids)`` (1, s, h: the
    position ids are ``arange(s)`` of the sequence) to locals that live until it returns, after
    ``ln_f``; their sum ``hidden_states`` is rebound by ``self.drop`` (a temporary, freed once the
    dropout's output exists) or, without dropout, is the first layer's input (its LayerNorm saves it)
    (transformers 5.24.0 ``models/gpt2/modeling_gpt2.py`` L569-577, L603, L624). All in the
    embeddings' dtype (the residual stream's). Returns (bytes per token of ``inputs_embeds``, bytes
    per position of ``position_embeds``, bytes per token of the sum where it is a temporary); zeros
    for another model, a pipeline stage or a model run by its framework's own code (nanoGPT's
    ``GPT.forward`` keeps its ``tok_emb``, ``pos_emb`` through the loss: not written). Trace, GPT-2
    b1 s2048 fp32: ``embedding`` 6, ``embedding`` 6, ``add`` 6 MiB, ``native_dropout`` 6, the sum freed."""
    if m.family != "gpt2" or t.pp > 1 or t.extra.get("framework") in OWN_MODEL_CODE:
        return (0.0, 0.0, 0.0)
    sp = t.tp if t.sequence_parallel else 1
    h = m.hidden_size * pol.stream / sp
    return (h, h, h if (t.dropout and m.hidden_dropout > 0) else 0.0)


def bert_embeddings(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[float, float]:
    """BERT's embeddings module tensor by tensor, for the allocator replay (``reserved.driver._bert_embeddings``):
    transformers 5.24.0 ``models/bert/modeling_bert.py`` ``BertEmbeddings.forward`` L100-109 binds
    ``inputs_embeds = self.word_embeddings(input_ids)`` and ``token_type_embeddings`` (b, s, h), their sum
    ``embeddings`` (rebound, so freed, by the next sum), ``position_embeddings`` (1, s, h: the buffered
    ``position_ids`` of the sequence), the second sum (saved by ``native_layer_norm``), the LayerNorm's output
    (freed when the dropout's output rebinds it) and ``native_dropout``'s output then its bool mask (saved);
    the three embedding outputs are locals that live until the module returns. All in the embeddings'
    dtype (the residual stream's, ``pol.stream``; autocast runs ``layer_norm`` in fp32 on the fp32 sum), the
    mask one byte per element; no mask where the dropout probability is 0 (torch 2.13
    ``aten/src/ATen/native/Dropout.cpp`` ``dropout``: ``is_fused_kernel_acceptable`` needs p > 0, and
    ``_dropout`` returns its input). Returns (bytes per token of a (b, s, h) tensor, bytes per token of the
    mask); zeros for another model or a pipeline stage. Trace, BERT-base cut to 2 layers, b2 s1024 fp32:
    ``embedding`` 6, ``embedding`` 6, ``add`` 6, ``embedding`` 3, ``add`` 6, ``native_layer_norm`` 6,
    ``native_dropout`` 6 and 1.5 MiB."""
    if m.family != "bert" or t.pp > 1 or t.extra.get("framework") in OWN_MODEL_CODE:
        return (0.0, 0.0)
    sp = t.tp if t.sequence_parallel else 1
    h = m.hidden_size / sp
    return (h * pol.stream, h if (t.dropout and m.hidden_dropout > 0) else 0.0)


def head_wgrad(m: ModelSpec, t: TrainingSpec, cast_head: int) -> int:
    """Bytes of the LM head's weight gradient as its matmul's backward makes it under autocast: in
    the half dtype (the shape of the head's half copy, ``cast_head``), then cast to the weight's
    fp32 by ``ToCopyBackward0`` while it is still referenced. The head's ``MmBackward0`` releases
    what it saved (the half copy of the weight, the input) and the logits' gradient when it returns
    (``torch/csrc/autograd`` ``Node::release_variables``), so at the cast the half gradient, the fp32
    one (the tied weight's part in autograd's input buffer, ``tied_head_grad``, or an untied head's
    ``.grad``) and the layers' activations are alive, without the logits' gradient (moment
    ``lm_head.weight_grad``). It matters where the head's weight outweighs the logits: a wide
    vocabulary and few tokens. Found by trace: Llama-3.2-1B (tied), FSDP2 dp 8, bf16-amp, 1 x 256:
    the trace's peak is this cast (``lm_head`` ``ToCopyBackward0``), 1.5% above the estimate's
    highest moment before. 0 without an autocast copy of a trainable head run in one piece (LoRA
    freezes it; a chunked, fused or compiled loss, a 4-bit head have moments of their own)."""
    return cast_head if (cast_head and is_lm(m) and not t.lora_rank and head_in_one_piece(m, t)) else 0


def head_in_one_piece(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether the LM head runs as one matmul whose ``MmBackward0`` makes its weight's gradient in the
    backward (not per loss chunk, fused into the loss, compiled or 4-bit)."""
    return (t.loss_chunks == 1 and loss_mode(m, t) in ("upcast", "half", "vocab-parallel") and not t.compile
            and not t.quantize)


def head_added_grads(m: ModelSpec, t: TrainingSpec, st: States, stage: str) -> int:
    """Bytes of the gradients the LM head's backward makes for the head side's trainable tensors (the
    final norm's, an untied head's weight; on torch's pipeline the last stage of a tied model holds its
    own copy of the table as its head, ``Quantities.pipe_head_tied``, listed before the layers), one
    copy each, in the gradient's dtype on this rank (``States.trainables``' rounded blocks).

    Each is a new tensor in every micro-batch: where ``.grad`` is undefined autograd's
    ``AccumulateGrad`` steals it as ``.grad``; where it exists (a later micro-batch of the step, or
    every one after ``zero_grad(set_to_none=False)``) it adds it in place, ``variable_grad +=
    new_grad``, and the new tensor lives beside ``.grad`` until that node has run (torch 2.13
    ``torch/csrc/autograd/functions/accumulate_grad.h`` L182-252 ``accumulateGrad``; the allocator replay's
    ``reserved.optimizer._accumulated``). The moments count it at the head's ``MmBackward0`` and its autocast
    cast (``moments._head_matmul_grad``, ``_head_weight_grad``). Trace, Llama-3.2-1B cut to 4 layers
    over pp 2 (1F1B), fp32, 2 micro-batches, last stage: the 1002 MiB table's gradient made anew
    beside its ``.grad`` at the second micro-batch's ``lm_head`` ``MmBackward0`` (-4.2 % before).
    0 where the head is not back-propagated in one piece (``head_in_one_piece``), is frozen or not on
    this stage, and where FSDP, DeepSpeed ZeRO or Megatron own the gradients (their moments of their own)."""
    if not (t.pp == 1 or stage == "last") or not is_lm(m) or not head_in_one_piece(m, t):
        return 0
    if t.fsdp is not None or t.zero_stage or t.megatron_ddp or t.distributed_optimizer:
        return 0
    where = ("after", "before") if _tied_head_copy(m, t) else ("after",)   # (the last stage's own table)
    return sum(g for w, _k, g, *_rest in st.trainables if w in where)


def _tied_head_copy(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether torch's pipeline gives a tied model's last stage its own copy of the table as its head
    (``Quantities.pipe_head_tied`` on that stage)."""
    return torch_pipeline(t) and t.pp > 1 and m.tied_embeddings


def head_added_fields(m: ModelSpec, t: TrainingSpec, st: States, stage: str, oib: bool) -> dict[str, int]:
    """``Quantities.head_added`` (``head_added_grads``, read by the head's own moments: the head's
    ``MmBackward0`` and its weight gradient's cast, ``moments._head_matmul_grad``, ``_head_weight_grad``)
    and ``Quantities.pipe_tied_added``: the same bytes on torch's pipeline's tied last stage alone (its
    own table's gradient among them), read by the layers' backward moments, which hold it beside the
    head's gradients there (``moments`` ``head_grads``); 0 elsewhere, where a tied head's gradient waits
    in autograd's input buffer instead (``tied_grad``). None under ``--optimizer-in-backward`` (each
    gradient freed by its own hook)."""
    added = 0 if oib else head_added_grads(m, t, st, stage)
    return {"head_added": added, "pipe_tied_added": added if _tied_head_copy(m, t) else 0}


def _autocast_copies(m: ModelSpec, t: TrainingSpec, st: States, pol: Policy, head_here: bool,
                     stage: str = "first") -> tuple[int, int, int]:
    """(one layer's, the head's, the embedding side's) half weight copies autocast caches and the
    matmuls save, bytes (the embedding side's: a matmul before the layers, an image model's
    patch-embedding convolution, whose copy lives until the embeddings' backward).

    autocast casts each fp32 leaf weight once per forward and caches it; the matmuls save the
    copies for backward. Sharded DeepSpeed ZeRO-3 parameters are gathered per layer in the compute
    dtype and resharded after use, so no cast copies outlive their layer. FSDP under autocast
    (fp32 sharded parameters, --precision bf16-amp) is not that: the gathered fp32 weights are cast
    like any others and each matmul saves its half copy until its layer's backward, after FSDP has
    resharded the fp32 weight (resize_(0) frees only that storage). FSDP2's unsharded parameter is
    an nn.Parameter leaf, not a view (torch 2.13 _fully_shard/_fsdp_param.py init_unsharded_param),
    so autocast's cache takes it too (aten/src/ATen/autocast_mode.cpp cached_cast: fp32, requires
    grad, leaf, not a view). Found by trace on the fake group (docs/trace.md): llama-3.2-1b dp 8
    fsdp full bf16-amp was -35% against trace, the whole model's bf16 copies missing."""
    sharded = t.zero_stage == 3 and t.shard_group > 1 and t.fsdp is None
    # (a derived model's layer also keeps the copies of weight views its matmuls cast: ``derived.view_casts``)
    cast_layer = st.layer_matmul_half + derived_view_casts(m, t, stage) if pol.amp and not sharded else 0
    # the head's copies: one, or one per loss chunk for a frozen head (``head_casts``)
    cast_head = st.head_matmul_half * head_casts(m, t) if pol.amp and not sharded and head_here else 0
    cast_embed = st.embed_matmul_half if pol.amp and not sharded and (t.pp == 1 or stage == "first") else 0
    return cast_layer, cast_head, cast_embed


def head_pre_cast(st: States, cast_head: int) -> int:
    """Bytes of ``cast_head`` that a masked LM's transform casts before the decoder: its dense's
    (hidden, hidden) half copy (``States.head_pre_half``), which autocast makes when that linear
    runs, one request of its own (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``: a copy per
    weight; transformers 5.24 ``models/bert/modeling_bert.py`` L480-484 ``dense`` first in
    ``BertPredictionHeadTransform.forward``, the decoder at L499). The allocator replay makes it
    there (``reserved.loss_forward._head_side``) and the rest of ``cast_head``, the decoder's
    (vocab, hidden) copy, at the decoder. Found by trace: BERT b8 s256 bf16-amp, trace asks 1.125 MiB
    and then 44.71 MiB where the replay asked one 45.83 MiB block. 0 without autocast copies of the
    head, and where the head is cast more than once (``head_casts``: not a masked LM's)."""
    return st.head_pre_half if cast_head == st.head_matmul_half else 0


def per_linear_replay(t: TrainingSpec) -> bool:
    """Whether the allocator replay (``reserved/``) makes a layer's blocks linear by linear: each
    weight's autocast copy where its linear runs, and in backward each weight's gradient (with its
    half form under autocast) as that linear's backward makes it, from the layer's recipe
    (``LayerCoefs.linears``). Checked against trace on one GPU, DDP and pipeline stages; under FSDP,
    tensor parallelism and DeepSpeed ZeRO the gradients are unsharded or sharded buffers made
    elsewhere (``_fsdp``, DTensor shards) and the replay keeps one block per layer for the copies:
    there trace put the linear-by-linear replay further off (Llama-3.2-1B, 4 layers, bf16-amp:
    FSDP2 over 4 +12.5% against +2.5%, TP 2 with sequence parallelism -13.2% against -8.5%).
    DeepSpeed ZeRO-1 is replayed linear by linear too (``zero1_per_linear``)."""
    return t.fsdp is None and t.tp == 1 and (not t.zero_stage or zero1_per_linear(t))


def per_linear_casts(t: TrainingSpec) -> bool:
    """Whether the allocator replay makes autocast's weight copies linear by linear in a layer's
    forward although ``per_linear_replay`` is off: FSDP2 (``reserved.layer_forward._fsdp2_casts``,
    torch 2.13 ``_fully_shard/_fsdp_param.py`` L677-678: the unsharded weight is a leaf that autocast
    caches a copy of at its linear). Not FSDP1 (flat parameters' views, not checked against trace)
    nor LoRA, whose frozen weights autocast does not cache (``requires_grad`` False): the grid's two
    LoRA FSDP2 rows with other mismatches moved further off with it (Mixtral b2 s512 +5.38 -> +10.35 %,
    BERT b1 s1024 -12.46 -> -13.31 %; Mistral's two 0.5 points nearer)."""
    return t.fsdp is not None and t.fsdp_version == 2 and t.tp == 1 and not t.lora_rank


def zero1_per_linear(t: TrainingSpec) -> bool:
    """Whether a DeepSpeed ZeRO-1 run's layers are replayed linear by linear (``per_linear_replay``).
    Stage 1 leaves autograd's gradients whole: each weight's ``.grad`` is its ``mm``'s output as on
    one GPU, and where the engine registers its gradient hooks (``overlap_comm`` or
    ``contiguous_gradients``: deepspeed 0.19.8 ``runtime/zero/stage_1_and_2.py`` L713-715
    ``create_gradient_handling_hooks``) each is copied into the reduce bucket and dropped right
    after it is made (``reduce_independent_p_g_buckets_and_remove_grads``, L1414-1457; the replay's
    ``_Step.hook_frees``), which the linear-by-linear replay places where that linear's backward
    runs. Against trace, Mistral (hidden 1024, 2 layers) b1 s2048 math SDPA fp16 Adam ZeRO-1 over 2
    with overlap_comm, peak reserved: +11.3 % with one block per layer's backward (a 436 MiB block
    that opened segments of its own), -0.8 % linear by linear. Not stage 2 (its partitioned
    gradients' hooks: not checked against trace) nor 3."""
    return t.zero_stage == 1


def head_weight_grad_half(m: ModelSpec, t: TrainingSpec, cast_head: int) -> int:
    """Bytes of the LM head's weight gradient as its matmul's backward makes it under autocast: the
    ``mm`` of the logits' gradient and the head's input runs on autocast's half copy of the weight
    (``cast_head``, one (vocab, hidden) tensor in bf16/fp16), so its output is in that dtype, and
    autocast's ``ToCopyBackward0`` casts it to the fp32 weight's dtype afterwards (the head's gradient,
    or a tied embedding's part in its input buffer); the half gradient is freed when the cast returns
    (``torch/csrc/autograd/generated/Functions.cpp`` ``ToCopyBackward0::apply``). Used by the
    allocator replay (``reserved/``), where its block stands between the logits' gradients and the
    fp32 one. 0 without autocast (the ``mm`` output is the gradient itself), for a frozen head (LoRA),
    a chunked loss (one such gradient per chunk: ``chunk_head_grads``), ``--compile``, and where the
    replay keeps its coarser blocks (``per_linear_replay``), but for FSDP2's (``per_linear_casts``:
    the head's autocast copy is of its unsharded weight, a leaf, as on one GPU): trace makes the
    (151936, 896) bf16 gradient (259.66 MiB) before the fp32 one there (Qwen2.5-0.5B b8 s256 FSDP2
    grad-op over 4); the grid's rows do not move with it. A masked LM's: its decoder's, ``cast_head``
    less the transform dense's copy (``head_pre_cast``: trace makes the (30522, 768) bf16 gradient,
    44.71 MiB, for BERT's decoder, not one with the dense's 1.125 MiB)."""
    if not cast_head or t.lora_rank or t.loss_chunks > 1 or t.compile:
        return 0
    if not (per_linear_replay(t) or per_linear_casts(t)):
        return 0
    return cast_head


def _head_replay_fields(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> dict[str, Any]:
    """The ``Quantities`` fields only the allocator replay reads about the head: whether its backward
    makes the input's gradient first (``head_input_grad_first``), its side's tensors one by one
    (``head_side_tensors``) and a masked LM's backward node by node (``mlm_head_grad_chain``)."""
    return {"head_input_first": int(head_input_grad_first(m)), "head_side": head_side_tensors(m, t, pol, stage),
            "head_chain": mlm_head_grad_chain(m, t, pol, stage)}


def head_input_grad_first(m: ModelSpec) -> bool:
    """Whether the head's output linear has a bias, so that its backward computes the gradient of its
    input before the weight's: ``F.linear`` with a bias runs ``addmm``, whose ``AddmmBackward0`` makes
    ``mat1``'s gradient (the input's, ``grad @ weight``) first and then ``mat2``'s (the weight's,
    ``tools/autograd/derivatives.yaml`` ``addmm``: ``self``, ``mat1``, ``mat2`` in that order); without
    one it runs ``mm`` and ``MmBackward0`` makes the weight's first (torch 2.13.0, the backward's
    ``aten.mm`` calls logged under a ``TorchDispatchMode``: ``nn.Linear(8, 50)`` on a (2, 5, 8) input
    gives the (10, 8) input gradient before the (50, 8) weight gradient; with ``bias=False`` the
    other way round; trace's op stream alike). The first cuBLAS call of autograd's thread binds its
    workspace (``reserved.loss_backward._head_backward``), so with a bias the workspace is made before the
    (vocab, hidden) weight gradient. The heads with a bias (``spec.architectures._head``): a masked
    LM's decoder (transformers 5.24 ``models/bert/modeling_bert.py`` L494 ``nn.Linear(hidden_size,
    vocab_size, bias=True)``, run at L499), extractive QA's ``qa_outputs``, and BERT's and the
    pre-norm RoBERTa's sequence classifiers; a causal LM's ``lm_head`` and a decoder's ``score`` have none."""
    return m.head in ("masked-lm", "qa") or (m.head == "seq-cls" and m.family in ("bert", "roberta-prenorm"))


def head_casts(m: ModelSpec, t: TrainingSpec) -> int:
    """How many half copies of the LM head's weight autocast makes and the head's matmuls save. It
    caches the cast of an fp32 leaf only when it requires grad (``aten/src/ATen/autocast_mode.cpp``
    ``cached_cast``: ``arg.requires_grad() && arg.is_leaf() && !arg.is_view()``), so a trainable head
    is cast once per forward whatever the number of calls. A frozen one (LoRA) is cast at every call,
    and a loss that runs the head over ``--loss-chunks`` token chunks (torchtune's chunked output,
    litgpt's chunked half loss; ``workload._chunked_output_loss``) calls it once per chunk, each
    matmul saving its own copy for the input's gradient. Found by trace: Llama-3.2 (2 layers), LoRA,
    4 chunks, fp16-amp: -27.9% before (one 501 MiB copy counted of four)."""
    if t.loss == "chunked-nll":
        return 0   # each chunk's cast is a transient of the loss (_chunked_nll_bytes)
    frozen = bool(t.lora_rank) and "lm_head" not in (t.lora_targets or ())
    if t.loss in ("fused", "unsloth"):
        return 0   # Liger's matmuls cast the weight within the loss only: transients (fused_linear_ce_bytes)
    chunked = is_lm(m) and t.loss_chunks > 1 and loss_mode(m, t) in ("chunked", "half")
    return t.loss_chunks if (frozen and chunked) else 1


def half_embedding_output(t: TrainingSpec, pol: Policy, stage: str, input_tok: float
                          ) -> tuple[tuple[str, float, float], ...]:
    """``half_embeddings`` (TRL's bf16 embedding over fp32 norms, ``states.half_embedding_tensor``):
    what the first layer's checkpointed input keeps less than the others'. The embedding's output is
    half, so the first checkpointed layer keeps a half input (b, s, h); from that layer's MLP on the
    residual stream is fp32 as ``--precision bf16-amp`` models it: the fp32 post-attention norm's
    output (its fp32 weight times the half input, transformers 4.48.1 ``MistralRMSNorm.forward``)
    goes through bitsandbytes' ``Linear4bit``, which returns its input's dtype (bitsandbytes 0.43.3
    ``nn/modules.py`` ``Linear4bit.forward``: ``out.to(inp_dtype)``), and the half residual plus that
    fp32 output is fp32. Under full (or op) recompute of every layer, on the stage holding the first
    layer; without recompute the first layer's saved tensors are the fp32 stream's (not modelled).
    The allocator replay (``reserved/``) keeps every layer's input at the stream's size."""
    if not t.half_embeddings or t.recompute not in ("full", "op") or t.recompute_every != 1 \
            or t.offload_activations or not (t.pp == 1 or stage == "first") or pol.stream <= 2:
        return ()
    return (("first_layer.half_input", input_tok * (1 - 2 / pol.stream), 0.0),)
