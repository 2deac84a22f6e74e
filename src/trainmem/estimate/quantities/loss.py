"""The loss's bytes: which loss a run computes (``loss_mode``), its bytes per logit (``loss_bytes``) in
one piece or the release's upcast, the fp32 logits the replay makes, TRL's chunked NLL's fields."""
from __future__ import annotations

from ...spec.model import ModelSpec
from ...spec.tf_releases import causal_lm_loss
from ...spec.training import CHUNKED_NLL_TOKENS, TrainingSpec
from ..derived import logits_bytes as derived_logits_bytes, loss_upcasts as derived_loss_upcasts
from ..layers import Policy
from ..states import torch_pipeline
from .loss_kinds import (LossBytes, _chunked_nll_bytes, _compiled_chunked_loss_bytes, _compiled_fp32_loss_bytes,
                         _compiled_loss_bytes, _eager_loss_bytes, _unsloth_loss_bytes, _vocab_parallel_bytes,
                         fused_linear_ce_bytes, fused_linear_ce_parts, torchtune_compiles_whole_loss)
from .model_facts import F32, _head_weight_numel, is_lm, loss_upcasts


    #                         dtype of a loss run in it without autocast (pure bf16/fp16: _eager_loss_bytes)


def loss_mode(m: ModelSpec, t: TrainingSpec) -> str:
    """The loss a run computes: ``t.loss``, else the model's own: transformers' causal-LM heads call
    ``ForCausalLMLoss`` (upcast); nanoGPT and transformers' masked-LM heads ``F.cross_entropy`` on
    the logits as they are (half)."""
    if t.loss is not None:
        return t.loss
    if release_loss(m, t) == "shift-half":
        return "half"
    measured = derived_loss_upcasts(m, t)  # a derived model's own loss, as traced (None: not measured)
    return "upcast" if (loss_upcasts(m) if measured is None else measured) else "half"


def release_loss(m: ModelSpec, t: TrainingSpec) -> str:
    """How the model's own causal-LM loss treats the logits in the run's transformers release
    (``spec.tf_releases.causal_lm_loss``: "labels", "loss-fp32-shift", "forward-fp32" or
    "shift-half"); "labels" when the loop computes the loss (``--loss`` given)."""
    if t.loss is not None or t.transformers_version is None:
        return "labels"
    return causal_lm_loss(m, t.transformers_release)


def loss_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy) -> LossBytes:
    """The loss's tensors. The loop holds the output's logits unless it keeps only the loss.

    * upcast: transformers ``loss_utils.ForCausalLMLoss``: ``logits.float()`` (an fp32 copy freed
      after the loss), ``cross_entropy`` -> ``log_softmax`` saves fp32 log-probabilities; backward
      starts with ``nll_loss_backward`` and ``_log_softmax_backward_data``, one fp32 tensor each.
    * half: ``F.cross_entropy`` on half logits under autocast: ``cross_entropy_loss`` has no
      autocast rule, so ``log_softmax`` keeps the half dtype and ``nll_loss`` (autocast fp32 list)
      saves an fp32 copy; backward starts with one fp32 gradient. Pure half: all half. With
      ``loss_chunks`` N > 1, litgpt's chunked head and loss (``model(x, lm_head_chunk_size=128)``
      returns the head's output per chunk of the sequence, litgpt/model.py ``GPT.forward``;
      ``chunked_cross_entropy`` in litgpt/utils.py runs ``F.cross_entropy`` on each half chunk
      and sums): every chunk's log-probabilities are saved, the backward gradients exist for one
      chunk at a time.
    * chunked: torchtune ``modules/loss/ce_chunked_output_loss.py`` (``CEWithChunkedOutputLoss``):
      the model returns the output projection of each of ``num_output_chunks`` token chunks (all
      kept in a list, half), the loss upcasts one chunk at a time (``logits.float()``) and its
      ``log_softmax`` saves that chunk's fp32 log-probabilities: all chunks' are saved, the fp32
      copy and the two backward gradients exist for one chunk at a time (autograd runs the
      chunks' branches one after another, the last first).
    * fused: Liger-Kernel ``ops/fused_linear_cross_entropy.py`` (``fused_linear_cross_entropy_forward``):
      no logits output; forward allocates ``grad_input`` (tokens x hidden, the input's dtype),
      ``grad_weight`` (the head weight's shape and dtype) and an fp32 ``loss_1d`` per token, all
      saved for backward, and one logits chunk of ``next_power_of_2(ceil(BT / ceil(V / H)))``
      tokens at a time; backward returns the saved gradients (no new tensors when the loss's
      gradient is 1).
    * loss parallel (upcast, PyTorch's tensor parallelism, ``states.dtensor_tp``): :func:`_loss_parallel_bytes`.
    * ``torch.compile`` with the model's own upcast loss (transformers' ``ForCausalLMLoss``,
      ``--loss`` not given): :func:`_compiled_loss_bytes`.
      A loss the loop computes from the logits (``--loss upcast|half``) runs eagerly outside the
      compiled call (trace/compiled.py): the eager formulas (the KV cache's zero gradients are
      added in ``_build``).
    Classifier heads: fp32 loss tensors of (b, labels).
    """
    # the loop's reference to the output keeps them; on a pipeline's last stage (the only one with a
    # loss) torch's PipelineStage keeps the logits in ``fwd_cache`` until the micro-batch's backward
    # has run (stage.py ``backward_one_chunk``: ``stage_output`` is popped and held through it), as a
    # loop holding its output until backward ends would (Kept). Found by trace: llama-3.2-1b (4
    # layers) --pp 2, fp32, last stage -7.7% before
    held = pol.half if (t.hold_output != "loss" or torch_pipeline(t)) else 0
    b = _loss_in_one_piece(m, t, pol, held)
    kind = release_loss(m, t)
    if kind in ("forward-fp32", "loss-fp32-shift"):
        b = _release_upcast_bytes(b, pol, kind)
    if (t.loss_shift == "logits" or kind == "shift-half") and is_lm(m):
        # ``logits[..., :-1, :].contiguous()`` on the half logits (ColossalAI's GPTLMLoss, older
        # transformers models before ForCausalLMLoss shifted the labels instead, 4.49, many
        # hand-written loops): a half copy, alive while log_softmax runs (neither slice nor contiguous saves it
        # for backward; SliceBackward's zero-filled gradient comes after log_softmax's has freed the
        # log-probabilities, so backward's peak does not change)
        b = b._replace(forward=b.forward + pol.half)
    if t.softmax_saves_input and is_lm(m):
        b = _log_softmax_keeps_input(b, t, pol, loss_mode(m, t), kind == "shift-half")
    return b


def fp32_logits_replay(m: ModelSpec, t: TrainingSpec, pol: Policy, b: LossBytes) -> bool:
    """Whether the allocator replay makes the ``forward-fp32`` loss (``_release_upcast_bytes``) tensor by
    tensor (``reserved.loss_forward._fp32_logits_forward`` / ``_backward``) rather than as the sums ``loss_bytes``
    gives the moments: the causal-LM loss of a transformers release whose forward upcasts the half
    logits (Qwen2 4.37-4.44, Llama 4.31-4.45, ... ``spec.tf_releases.causal_lm_loss``), one piece (no
    chunks, no ``--cast-output``, no shifted half copy, PyTorch >= 1.11), one tensor-parallel rank."""
    return (is_lm(m) and release_loss(m, t) == "forward-fp32" and pol.half != F32 and t.loss_chunks <= 1
            and not b.cast and not b.saves_out and t.loss_shift != "logits" and not t.softmax_saves_input
            and t.tp == 1)


def _release_upcast_bytes(b: LossBytes, pol: Policy, kind: str) -> LossBytes:
    """The model's own upcast loss (``b``: the installed ``ForCausalLMLoss``, which shifts the labels)
    as an older transformers release computes it (``spec.tf_releases``), per logit element:

    * ``loss-fp32-shift`` (4.46-4.48 ``ForCausalLMLoss``): besides the fp32 copy of the half logits
      (``logits = logits.float()``, a local alive until the loss returns; none when they are fp32),
      ``shift_logits = logits[..., :-1, :].contiguous()`` is a second fp32 tensor, alive while
      ``cross_entropy`` runs: ``forward`` + 4 B. The saved fp32 log-probabilities and the backward's
      two fp32 gradients are as before (one token fewer); ``SliceBackward``'s zero-filled fp32 gradient
      comes after the log-probabilities are freed.
    * ``forward-fp32`` (Llama 4.31-4.45, Mistral to 4.47, ...): the model's forward upcasts
      (``logits = logits.float()``) and returns the fp32 tensor; its half output is freed by the
      upcast (rebound or a temporary). While the loss runs, the fp32 logits and their fp32 shifted
      copy are alive: counted as the half output (``out``, as the gradient handed back to the head
      is half again after ``ToCopyBackward``) plus ``forward`` = 4 - 2 + 4 B (4 B with fp32 logits,
      whose ``.float()`` is the tensor itself). A loop that holds the output holds fp32 logits
      (``held`` 4 B)."""
    half = pol.half
    if kind == "loss-fp32-shift":
        return b._replace(forward=b.forward + F32)   # (b, s - 1, vocab) fp32: the shifted copy
    upcast = F32 - half if half != F32 else 0        # the fp32 logits in place of the half output
    return b._replace(held=F32 if b.held else 0, forward=upcast + F32)


def _log_softmax_keeps_input(b: LossBytes, t: TrainingSpec, pol: Policy, mode: str,
                             shifted: bool = False) -> LossBytes:
    """PyTorch < 1.11 (``spec.releases``): ``LogSoftmaxBackward`` saves the tensor ``log_softmax``
    read until the loss's backward, per logit element: the fp32 copy of an upcast loss under
    autocast or in pure half (moved from the forward-only bytes to the saved ones); else the
    shifted half copy (``loss_shift logits``); else the logits themselves, which stay alive when the
    loop does not hold them anyway (``held``). Chunked and fused losses are refused for these
    releases (``releases.torch_problems``)."""
    if mode == "upcast" and pol.half != F32:
        return b._replace(saved=b.saved + F32, forward=b.forward - F32)   # the .float() copy, fp32
    if t.loss_shift == "logits" or shifted:
        return b._replace(saved=b.saved + pol.half, forward=b.forward - pol.half)  # the shifted copy
    return b if b.held else b._replace(saved=b.saved + b.out)   # the logits, in their dtype


def _loss_in_one_piece(m: ModelSpec, t: TrainingSpec, pol: Policy, held: int) -> LossBytes:
    """``loss_bytes`` before the logits are shifted (see there)."""
    if not is_lm(m):
        return LossBytes(held, pol.half, F32, F32, 2 * F32)
    mode, half = loss_mode(m, t), pol.half
    if mode == "chunked-nll":
        return _chunked_nll_bytes(m, t, pol)
    if m.family == "derived" and m.is_encoder_decoder and half != F32 and derived_logits_bytes(m, t) == F32:
        # fp32 logits under autocast (BART: ``lm_logits = self.lm_head(outputs[0]) +
        # self.final_logits_bias``, a half output plus an fp32 buffer, promoted; measured by the
        # derivation): CrossEntropyLoss's log_softmax saves fp32 log-probabilities, nll_loss needs no
        # copy; backward starts with two fp32 gradients
        return LossBytes(F32 if held else 0, F32, F32, 0, 2 * F32)
    if mode == "fused":
        return fused_linear_ce_bytes(m, t, pol)
    if mode == "unsloth":
        return _unsloth_loss_bytes(m, pol)
    if mode == "chunked" and t.compile:
        return _compiled_chunked_loss_bytes(held, half)
    if mode == "upcast" and t.cast_output and torchtune_compiles_whole_loss(t):
        return _compiled_fp32_loss_bytes(held, half)
    if mode == "chunked":
        return LossBytes(held, half, F32, forward_chunk=F32 if half != F32 else 0, backward_chunk=2 * F32)
    if mode == "vocab-parallel":
        return _vocab_parallel_bytes(held, half, _head_weight_numel(m, t.tp) * t.weight_bytes)
    if t.compile and t.loss is None and mode == "upcast":
        return _compiled_loss_bytes(m, t, held, half)
    if t.compile and t.loss is None:
        # a model's own loss on half logits (nanoGPT's F.cross_entropy), fused by inductor; trace
        # --compile cannot run nanoGPT (it needs a step_fn), so this is not read off a partition:
        # no fp32 copy in forward, one fp32 logits gradient in backward (the layers warn, too)
        return LossBytes(held, half, F32, 0, F32)
    if t.compile:   # the loop's loss, eager, on the compiled model's outputs
        return _eager_loss_bytes(m, t, pol, held, mode, half)
    return _eager_loss_bytes(m, t, pol, held, mode, half)


def _chunked_nll_fields(m: ModelSpec, t: TrainingSpec, pol: Policy, loss: LossBytes, head_here: bool) -> dict:
    """``Quantities``' fields of TRL's chunked_nll (``_chunked_nll_bytes``): its chunk of tokens, the
    matmul moment's and the backward's constants, and the gathered hidden states' gradient per token,
    alive from the second chunk's backward on (the first, a partial chunk, has none yet)."""
    if head_here and loss_mode(m, t) == "vocab-parallel" and loss.backward_const:
        # fp32 logits: the head's weight gradient and its input's (b, s, h) fp32 gradient (_vocab_parallel_bytes)
        return dict(loss_backward_const=loss.backward_const, loss_backward_tok=float(m.hidden_size * F32))
    if head_here and loss_mode(m, t) == "fused":   # Liger's (V, H) tensors beside a chunk's logits
        first, cached, mm, flt, chunk = fused_linear_ce_parts(m, t, pol)
        return dict(loss_matmul_const=loss.matmul_const, loss_matmul_chunk=loss.matmul_chunk,
                    loss_chunk_const=loss.chunk_const, fused_parts=(first, cached, mm, flt, chunk, pol.half))
    if head_here and loss_mode(m, t) == "unsloth":   # the compiled chunk's (N, h) gradient (_unsloth_loss_bytes)
        return dict(loss_chunk_tok=float(m.hidden_size * pol.half), unsloth_loss=1)
    if not (head_here and loss_mode(m, t) == "chunked-nll"):
        return {}
    return dict(loss_backward_tok=float(m.hidden_size * pol.stream), loss_chunk_tokens=CHUNKED_NLL_TOKENS,
                loss_matmul_const=loss.matmul_const, loss_matmul_chunk=loss.matmul_chunk,
                loss_backward_const=loss.backward_const, loss_backward_more=loss.backward_more)
