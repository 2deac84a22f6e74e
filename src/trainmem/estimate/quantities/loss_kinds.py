"""Each loss implementation's bytes per logit (``LossBytes``): eager cross entropy, the cast output,
TRL's log-probabilities, fused linear cross entropy, Unsloth's fused loss, torchtune's compiled
losses, Megatron-LM's vocabulary-parallel and torch's loss-parallel ones, TRL's chunked NLL."""
from __future__ import annotations

from typing import NamedTuple

from ...errors import TrainmemError
from ...spec.model import ModelSpec
from ...spec.training import CHUNKED_NLL_TOKENS, TrainingSpec, chunked_nll_problem
from ..layers import HALF, Policy
from ..states import dtensor_tp
from .model_facts import F32, _head_weight_numel, block_of


class LossBytes(NamedTuple):
    """Bytes of the loss per logit element (of the whole micro-batch, or of one chunk), per token and
    in total; see ``loss_bytes``."""

    held: int = 0           # the output the loop keeps (0: only the loss)
    out: int = 0            # the head's output, alive while the loss runs
    saved: int = 0          # saved for backward by the loss
    forward: int = 0        # alive only while the loss is computed
    backward: int = 0       # alive at the start of backward
    forward_chunk: int = 0  # per element of one chunk: alive while that chunk's loss is computed
    backward_chunk: int = 0  # per element of one chunk: its backward
    saved_tok: int = 0      # per token, saved (Liger: the input gradient in the compute dtype, fp32 loss)
    saved_const: int = 0    # in total, saved (Liger: the head weight's gradient)
    cast: int = 0           # the fp32 copy a wrapper makes of the head's output as forward returns (--cast-output)
    matmul_const: int = 0   # chunked-nll: alive at a chunk's head matmul, whatever the chunk (the weight's copy)
    chunk_const: int = 0    # fused: alive beside ``forward_chunk``'s tensors, whatever the chunk (weight copies)
    matmul_chunk: int = 0   # ... per element of the chunk's logits then
    backward_const: int = 0  # chunked-nll: alive through a chunk's backward whatever the chunk (the weight's copy)
    backward_more: int = 0  # chunked-nll, a trained head: more in backward when there are several chunks
    saves_out: int = 0      # 1: ``saved`` is the tensor the loss reads (the output, or its --cast-output copy)
    elem: int = F32         # bytes per element of the loss's own logits-sized tensors: fp32, or the half


def fused_linear_ce_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy) -> LossBytes:
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` (``--loss fused``, ``--liger``):
    ``fused_linear_cross_entropy_forward`` (ops/fused_linear_cross_entropy.py, v0.6.4 L16-228,
    v0.5.10 L16-155, v0.8.2 L21-300) computes the loss and both gradients in forward, over chunks of
    ``next_power_of_2(ceil(BT / ceil(V / H)))`` tokens (``Quantities.liger_factor``), and
    ``ctx.save_for_backward(grad_input, grad_weight, grad_bias)`` keeps them (v0.6.4 L340-344):

    * per token: ``grad_input = torch.zeros_like(_input)`` in the input's dtype, the final norm's
      output (the residual stream's dtype: fp32 under autocast, whose RMSNorm output is fp32;
      ``amp_custom_fwd`` is ``torch.amp.custom_fwd`` without ``cast_inputs``, ops/utils.py L74-84:
      autocast stays on and nothing is cast), and ``loss_1d``, fp32 (L55, L69);
    * in total: ``grad_weight = torch.zeros_like(weight)`` in the weight's dtype (None for a frozen
      head, L58-63; ``accum_dtype`` is not set by the HF patches);
    * per chunk, in forward: ``logits_chunk = _input_chunk @ weight.t()`` (chunk, V) in the matmul
      dtype, which the Triton kernel overwrites with its gradient (L96, L126-168), then
      ``grad_input[chunk] = grad_logits_chunk @ weight`` and the weight gradient's accumulation
      (``_fused_weight_grad_bytes``).

    Under autocast each matmul casts the fp32 weight: ``weight.t()`` is a view, which autocast never
    caches (aten/src/ATen/autocast_mode.cpp ``cached_cast``: fp32 leaves that require grad, not
    views), so the first matmul of every chunk makes a (V, H) half copy and frees it; ``weight`` in
    the second is cached from the first chunk on, until the autocast region ends with the loss
    (nothing saves it: no copy outlives the forward, ``head_casts``). A frozen head's weight is
    cast anew by both. The moments: the first matmul, with the cached copy and the uncached one
    (``matmul_const``), beside two chunks' logits (the previous chunk's, still bound to
    ``logits_chunk`` / ``grad_logits_chunk`` while the loop's next matmul makes the new one); the
    weight gradient's, with the cached copy (``chunk_const``), beside one."""
    half, h = pol.half, m.hidden_size
    head = _head_weight_numel(m, t.tp)
    grad_w = 0 if t.lora_rank else head * t.weight_bytes
    first, cached, mm, flt, chunk = fused_linear_ce_parts(m, t, pol)
    return LossBytes(saved_tok=h * max(pol.stream, half) + F32, saved_const=grad_w,
                     forward_chunk=half + chunk, chunk_const=cached + mm + flt,
                     matmul_const=cached + first, matmul_chunk=2 * half)


def _unsloth_loss_bytes(m: ModelSpec, pol: Policy) -> LossBytes:
    """unsloth_zoo's ``UnslothFusedLoss`` (``--loss unsloth``; ``unsloth_fused_ce_loss``, which Unsloth's
    ``CausalLM_fast_forward`` calls whenever labels are given and ``UNSLOTH_RETURN_LOGITS`` is not set
    (its ``bsz * q_len <= 1024`` branch sets ``RETURN_LOGITS = False`` too): unsloth 2026.3.5
    ``models/llama.py`` L1521-1556; unsloth_zoo 2026.3.4 ``fused_losses/cross_entropy_loss.py``
    L162-430). No logits leave the model (``logits = EMPTY_LOGITS``). Its forward:

    * ``grad_inputs = torch.empty_like(hidden_states)`` (L217), the final norm's (b, s, h) output's
      dtype, saved for backward (``ctx.save_for_backward(grad_inputs, grad_lm_head, ...)``, L416:
      the head is frozen under LoRA, so ``grad_lm_head`` is None); backward returns it as it is (L422-428);
    * the shifted labels, ``torch.empty_like(labels)`` (int64 per token, L194), alive until forward
      returns (``head_during_loss``);
    * per chunk of ``torch.chunk(hidden_states.view(-1, hd), n_chunks)`` (L230-232), the
      ``torch.compile``'d ``accumulate_chunk`` (``torch.func.grad_and_value`` of
      ``compute_fused_ce_loss``: the head's matmul, ``.float()``, ``cross_entropy``, and their
      gradient in one graph). Inductor's wrapper for it (torch 2.13, unsloth_zoo's compile options:
      ``memory_planning=True``; read off the code it generates for that function on the CPU,
      tests/test_unsloth.py) allocates one pool of ``align(2·N·V) + max(2·N·h, 12·N)`` bytes:
      the chunk's bf16 logits, which the fused kernel (log_softmax, nll_loss and their backward, the
      fp32 upcast folded in) overwrites with their gradient (``buf5 = buf0; # reuse``), and the
      ``mm`` of that gradient with the head's weight, (N, h), copied into ``grad_inputs``. No fp32
      logits-sized tensor exists. Per logit element of a chunk: the half logits
      (``forward_chunk``); per token of a chunk: the (N, h) gradient (``Quantities.loss_chunk_tok``).

    ``n_chunks``: ``get_chunk_size`` (L153-160) from half the GPU's free memory at the first call
    (cached): ``max(4·round(tokens·V / (free / 2)), 1)`` chunks, one whenever the fp32 logits
    (tokens·V·4 B) are smaller than the free memory; ``--loss-chunks N`` is
    ``UNSLOTH_CE_LOSS_N_CHUNKS=N`` (default 1)."""
    half = pol.half
    return LossBytes(saved_tok=m.hidden_size * max(pol.stream, half), forward_chunk=half)


def fused_linear_ce_parts(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[int, int, int, int, int]:
    """The transient tensors of Liger's fused linear cross-entropy forward (``fused_linear_ce_bytes``),
    for the allocator replay (``reserved.loss_forward._fused_forward``): bytes of autocast's uncached (V, H) half copy
    of ``weight.t()`` (each chunk's first matmul), of its cached copy of ``weight`` (a trained head under
    autocast), of the weight-gradient ``mm``'s (V, H) output and of its ``.float()`` copy, and per logit
    element of a chunk the fp32 copy of the logits before 0.6.2 under autocast."""
    head = _head_weight_numel(m, t.tp)
    trained = not t.lora_rank
    first = head * HALF if pol.amp else 0                          # weight.t()'s uncached half copy
    cached = head * HALF if (pol.amp and trained) else 0          # the cached half weight (second matmul)
    chunk, mm, flt = _fused_weight_grad_bytes(t, pol, head, trained)
    return first, cached, mm, flt, chunk


def _fused_weight_grad_bytes(t: TrainingSpec, pol: Policy, head: int, trained: bool) -> tuple[int, int, int]:
    """How Liger's fused linear cross-entropy adds a chunk's weight gradient to ``grad_weight``, by
    release (``TrainingSpec.liger_version``): (bytes per element of the chunk's logits, bytes of the
    ``mm`` output, bytes of its ``.float()`` copy) alive beside the chunk's logits then.

    * before 0.6.2: ``torch.addmm(input=grad_weight, mat1=logits_chunk.t().to(_input_chunk.dtype),
      mat2=_input_chunk, out=grad_weight)`` in place (v0.5.10 L127-135, v0.3.0 L122-129): no (V, H)
      tensor; under autocast the fp32 input makes ``.to()`` an fp32 copy of the chunk's logits;
    * 0.6.2 to 0.8.0: ``grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()``
      (v0.6.2 L134, v0.6.4 L198, v0.7.0 L199; commit 2845fe83 "Add accum_dtype option", 2025-07-30): a (V, H)
      tensor in the matmul dtype and its fp32 copy (the same tensor in fp32 training);
    * from 0.8.1: ``torch.addmm(grad_weight, grad_logits_t, input_chunk, out_dtype=torch.float32,
      out=grad_weight)`` when grad_weight is fp32 and the logits half on a CUDA device of compute
      capability >= 8 (autocast over fp32 weights; v0.8.2 L233-257, commit c9fc646f), else the
      0.6.2 path (pure bf16: a bf16 grad_weight). The input chunk's half cast it makes is (chunk, H),
      left out beside the (chunk, V) logits."""
    if not trained:
        return 0, 0, 0
    v = t.liger_release()
    if v < (0, 6, 2):
        return (F32 if pol.amp else 0), 0, 0
    if v >= (0, 8, 1) and pol.amp:
        return 0, 0, 0
    return 0, head * pol.half, (head * F32 if pol.half != F32 else 0)   # (fp32: .float() is the tensor itself)


def torchtune_compiles_whole_loss(t: TrainingSpec) -> bool:
    """Whether torchtune's recipe runs a loss other than ``CEWithChunkedOutputLoss`` compiled under
    ``compile: True``. ``training.compile_loss`` compiles such a loss by returning a new module,
    ``loss = torch.compile(loss, backend=backend)`` (torchtune/training/_compile.py L80-82 at
    1814feb17); only the chunked loss is patched in place (``loss.compute_cross_entropy =
    torch.compile(...)``, L74-77). ``lora_finetune_single_device`` keeps the returned module
    (``self._loss_fn = training.compile_loss(self._loss_fn)``, recipes/lora_finetune_single_device.py
    L296), but ``full_finetune_single_device`` (L292), ``full_finetune_distributed`` (L299) and
    ``lora_finetune_distributed`` (L302) call ``training.compile_loss(self._loss_fn)`` and drop what it
    returns (unchanged at torchtune main bd2a0fc7c, 2026-04-23): their ``nn.CrossEntropyLoss`` runs eagerly on the
    compiled layers' output. The single-device LoRA recipe is told apart by ``--lora-rank`` without
    FSDP."""
    return t.compile and t.extra.get("framework") == "torchtune" and bool(t.lora_rank) and t.fsdp is None


def _compiled_chunked_loss_bytes(held: int, half: int) -> LossBytes:
    """torchtune's ``CEWithChunkedOutputLoss`` under ``compile: True``: ``training.compile_loss``
    compiles only ``compute_cross_entropy`` (``F.cross_entropy(logits.float(), labels,
    reduction="sum")`` on one chunk; torchtune/training/_compile.py L58-82 and
    torchtune/modules/loss/ce_chunked_output_loss.py L35-43 at 1814feb17), called once per chunk.
    Inductor's decompositions turn ``log_softmax`` + ``nll_loss`` into ``amax``, ``exp``, ``sum``,
    ``log`` and a ``gather``, and its min-cut partition (``min_cut_rematerialization_partition``,
    ``compiler="inductor"``) saves the chunk's half logits themselves (the graph input), its labels
    (int64, the ``reshape(-1)`` copy of a column chunk) and the per-row fp32 ``amax`` and ``log``,
    recomputing the fp32 log-probabilities in backward: no fp32 tensor of the chunk is saved, and
    the fused kernels materialize none in forward. The backward kernel writes the chunk's gradient
    in the logits' dtype directly (the upcast's ``convert_element_type`` fused), freeing the saved
    chunk after. Per logit element: the output (``half``), saved as it is (``saves_out``: counted
    once while the loss runs), one chunk's half gradient in backward; per token 16 B saved (read off
    the installed torch's partition of that function, ``tests/test_torchtune_flags.py``)."""
    return LossBytes(held, half, half, backward_chunk=half, saved_tok=2 * F32 + 8, saves_out=1)


def _compiled_fp32_loss_bytes(held: int, half: int) -> LossBytes:
    """torchtune's ``nn.CrossEntropyLoss`` under ``compile: True`` on the fp32 logits its decoder
    returns (``F.linear(h, tok_embeddings.weight).float()`` outside the compiled layers,
    torchtune/modules/transformer.py L937 at 1814feb17; ``--cast-output``), in the recipe that keeps
    ``compile_loss``'s compiled module (``torchtune_compiles_whole_loss``: the LoRA single-device
    one; the full-finetune recipes run the loss eagerly): the whole loss module is compiled
    (torchtune/training/_compile.py L58-82), and inductor's
    partition saves its fp32 input itself, the fp32 logits, with per-row fp32 ``amax`` and ``log``
    (as in ``_compiled_chunked_loss_bytes``; the labels are a view of the batch's). The forward
    kernels materialize no logits-sized tensor; the backward kernel writes one fp32 gradient, the
    saved logits then freed, and the decoder's ``ToCopyBackward`` casts it to the head's dtype.
    Per logit element: the half output and its fp32 copy as forward returns (``cast``), the copy
    saved as it is (``saves_out``: the tensor the loss reads), 4 B in backward; per token 8 B."""
    kept = F32 if held else 0
    cast = F32 if half != F32 else 0
    return LossBytes(kept, half, F32, 0, F32, saved_tok=2 * F32, cast=cast, saves_out=1)


def _vocab_parallel_bytes(held: int, half: int, head_grad: int) -> LossBytes:
    """Megatron-LM's ``_VocabParallelCrossEntropy`` (megatron/core/tensor_parallel/cross_entropy.py at
    6e091e1b, L122-216; ``GPTModel.compute_language_model_loss`` runs it on the output layer's
    (s, b, vocab / tp) logits), per logit element of this rank:

    * forward: ``calculate_logits_max`` makes one fp32 copy (``vocab_parallel_logits.float()``, L28;
      none when the logits are fp32), which every later step overwrites in place: ``-= logits_max``
      (L45), ``torch.exp(..., out=exp_logits)`` (L64-65), ``exp_logits.div_(sum_exp_logits)`` (L80):
      the half logits and that copy are alive together, nothing more;
    * saved: the copy, now the softmax (``ctx.save_for_backward(exp_logits, ...)``, L187), fp32;
    * backward: the gradient is the saved softmax itself (``grad_input = softmax``, L91; updated in
      place, L114-117, returned L216), returned in fp32 for the half logits, so autograd's engine casts it to their
      dtype (``validate_outputs``) while it is alive: one half tensor more (none for fp32 logits).
    With fp32 logits ``.float()`` returns them as they are: the logits become the softmax, counted
    once (``forward`` takes back the saved bytes ``out`` already holds), and the gradient handed to the
    head is that fp32 tensor itself, alive while the head's matmul backward makes its weight gradient
    (``head_grad``, the head weight's bytes on this rank) and its input's gradient (fp32, per token,
    ``_chunked_nll_fields``): that moment is the loss's backward peak (found by trace: GPT-2 and Llama,
    2 layers, fp32, -7% and -8% before). The other per-token terms (int64 targets, fp32 maxima, sums
    and losses) are left out, as for the other losses."""
    if half == F32:
        return LossBytes(held, F32, F32, -F32, 0, backward_const=head_grad)
    return LossBytes(held, half, F32, 0, half)


def _chunked_nll_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy) -> LossBytes:
    """TRL's ``loss_type="chunked_nll"`` over a frozen head (trl v1.9.0 trl/trainer/sft_trainer.py
    L99-378; run by ``workload._patch_chunked_nll``). No logits of the micro-batch exist; per token it
    saves the labelled tokens' hidden states gathered to the front (``hidden[order]``, the residual
    stream's dtype), their labels and the gather's int64 indices (``IndexBackward`` keeps them); the
    chunks (``CHUNKED_NLL_TOKENS`` tokens, ``torch.utils.checkpoint``) keep nothing. ``_chunk`` computes
    ``h.float() @ w.float().t()``: under autocast the frozen fp32 weight is cast to the half dtype at
    every call (not cached: it requires no grad), in pure half ``w.float()`` is an fp32 copy, in fp32
    nothing is copied. A chunk's forward peaks either at the matmul (the weight's copy, the chunk's
    hidden cast and its logits, half under autocast, else fp32) or when ``log_p.exp() * log_p`` is made
    (the logits, log_softmax's fp32 output, exp and the product; under autocast also log_softmax's
    fp32 copy of the half logits, freed before): 2 + 4 + 4 + 4 bytes per logit under autocast, 16
    otherwise. Its backward first recomputes it, the matmul saving the weight's copy for the hidden
    states' gradient: the weight's copy and the same four tensors at once, beside the gradient of the
    gathered hidden states (``loss_backward_tok``). The final norm's output, kept by TRL's forward
    until the loss returns, is ``head_during_loss``."""
    problem = chunked_nll_problem(m, bool(t.quantize) and t.quantize_via == "fabric")
    if problem:
        raise TrainmemError(f"--loss chunked-nll (TRL's chunked_nll): {problem}, which the estimate does not "
                            "model: use trainmem trace, or drop --loss chunked-nll for the model's own loss over the "
                            "whole logits (an upper bound)")
    half = pol.half
    w = m.vocab_size * m.hidden_size   # the head weight's elements
    copy = half if pol.amp else (F32 if half != F32 else 0)   # the weight's copy per matmul, bytes per element
    logit = half if pol.amp else F32
    per_logit = logit + 3 * F32
    weight = int(block_of(t, w * copy)) if copy else 0   # the copy's block (the default allocator's unsplit remainder)
    frozen = LossBytes(saved_tok=m.hidden_size * pol.stream + 8 + 8, forward_chunk=per_logit,
                       backward_chunk=per_logit, matmul_const=weight + CHUNKED_NLL_TOKENS * m.hidden_size * logit,
                       matmul_chunk=logit, backward_const=weight)
    if t.lora_rank and "lm_head" not in (t.lora_targets or ()):
        return frozen
    return _chunked_nll_trained(frozen, w, weight, pol)


def _chunked_nll_trained(frozen: LossBytes, w: int, weight: int, pol: Policy) -> LossBytes:
    """``_chunked_nll_bytes`` over a trained head (full fine-tuning; ``frozen``: the same over a frozen
    one, ``w`` the head weight's elements, ``weight`` its copy's block). The forward is the frozen
    head's: ``w.float().t()`` is a view, which autocast does not cache. In backward each chunk's
    matmul makes the weight's gradient in its copy's dtype (the copy, saved by the matmul, freed
    then), ``ToCopyBackward`` casts it to the weight's dtype and autograd's input buffer for the
    weight sums it with the earlier chunks' out of place (a transposed gradient): from the second
    chunk on the buffer, the new gradient and their sum, three weight-sized tensors in the weight's
    dtype (``backward_more`` adds them). The largest of these moments, per precision: under autocast
    the half gradient with its fp32 cast (one chunk), the sum (several: 3 x fp32); in pure half the
    fp32 copy with its fp32 gradient and the chunk's fp32 logits gradient, plus the half buffer when
    there are several; in fp32 the gradient (one), the sum (several). The chunk's other logits-sized
    tensors are freed by then (they are smaller than the weight once the hidden size passes ~700)."""
    if pol.amp:
        single, several, chunk = w * (pol.half + F32), 3 * w * F32, 0
    elif weight:
        single, several, chunk = weight + w * F32, weight + w * F32 + w * pol.half, F32
    else:
        single, several, chunk = w * F32, 3 * w * F32, 0
    return frozen._replace(backward_chunk=chunk, backward_const=single, backward_more=several - single)


def _eager_loss_bytes(m: ModelSpec, t: TrainingSpec, pol: Policy, held: int, mode: str, half: int) -> LossBytes:
    """The upcast / half loss run eagerly (``loss_bytes``)."""
    if t.cast_output:
        return _cast_output_loss_bytes(t, held, half)
    if dtensor_tp(t) and mode in ("upcast", "half"):
        return _loss_parallel_bytes(held, half, mode == "half", pol.amp)
    if mode == "half" and half != F32:
        if t.loss_chunks > 1:  # litgpt: each chunk's loss backward in turn
            if pol.amp:
                return LossBytes(held, half, half + F32, backward_chunk=F32)
            return LossBytes(held, half, half, backward_chunk=2 * half, elem=half)
        if pol.amp:
            return LossBytes(held, half, half + F32, 0, F32)
        # pure half: log_softmax's output (saved) and, in backward, nll_loss_backward's and
        # _log_softmax_backward_data's gradients, each a (b*s, vocab) tensor in the logits' half dtype
        return LossBytes(held, half, half, 0, 2 * half, elem=half)
    if mode == "half" and t.loss_chunks > 1:  # fp32 logits, litgpt's chunked loss: one chunk's gradients at a time
        return LossBytes(held, F32, F32, backward_chunk=2 * F32)
    return LossBytes(held, half, F32, F32 if half != F32 else 0, 2 * F32)


def _cast_output_loss_bytes(t: TrainingSpec, held: int, half: int) -> LossBytes:
    """The loss on the fp32 copy of the logits that Lightning Fabric hands the loop (``--cast-output``).

    ``_FabricModule.forward`` ends with ``output = precision.convert_output(output)``, and every
    precision plugin a half run uses (``HalfPrecision`` for bf16-true, ``MixedPrecision``,
    ``FSDPPrecision``, ``BitsandbytesPrecision``) converts each floating tensor of the output, a list
    of chunks included, with ``tensor.to(torch.get_default_dtype())`` (lightning 2.4.0
    ``fabric/wrappers.py`` L135-146, ``fabric/plugins/precision/half.py`` L61-62,
    ``bitsandbytes.py`` L155-156, ``fsdp.py`` L121-122; the same at Lightning master of 2023-09,
    https://github.com/Lightning-AI/pytorch-lightning/blob/master/src/lightning/fabric/wrappers.py).
    So the head's half output (``out``, per element: 2 B) and its fp32 copy (``cast``: 4 B) both
    exist as forward returns; the half one is then unreferenced (``ToCopyBackward`` saves no tensor)
    and the loop keeps the fp32 one (``held``: 4 B). litgpt's loop (``finetune/lora.py``: ``logits =
    model(input_ids, lm_head_chunk_size=128)``, then ``chunked_cross_entropy(logits, ...)``) rebinds
    ``logits`` before its loss, so the previous micro-batch's copy is freed before the loss runs
    (``moments._micro_step``). ``F.cross_entropy`` on fp32 logits: ``log_softmax`` saves fp32
    log-probabilities (4 B; no autocast copy: the input is fp32 already); backward starts with
    ``nll_loss_backward``'s and ``_log_softmax_backward_data``'s fp32 gradients (8 B), one chunk at
    a time under litgpt's chunked loss (``utils.py`` ``chunked_cross_entropy``: one
    ``cross_entropy(reduction="none")`` per chunk), each chunk's gradient cast back to the head's
    dtype by ``ToCopyBackward``. Not counted: the copy ``reshape`` makes of the last chunk when
    litgpt slices it (``logits[-1][..., :-1, :]``) with a micro-batch above 1, alive until the loss
    returns (4 B per element of one chunk, below the backward's 8). With fp32 logits (``--precision
    fp32``) ``.to(fp32)`` returns the tensor itself: nothing is cast, the loop's rebinding stays."""
    kept = F32 if held else 0  # the loop's fp32 copy (fp32 logits: the output itself, nothing cast)
    cast = F32 if half != F32 else 0
    if t.loss == "logps":
        return _logps_bytes(kept, half, cast)
    if t.loss_chunks > 1:
        return LossBytes(kept, half, F32, backward_chunk=2 * F32, cast=cast)
    return LossBytes(kept, half, F32, 0, 2 * F32, cast=cast)


def _logps_bytes(kept: int, half: int, cast: int) -> LossBytes:
    """``--loss logps`` (under ``--cast-output``): TRL's ``selective_log_softmax`` on the shifted fp32
    logits (trl/trainer/utils.py L506-510 at v1.9.0: ``torch.gather(logits, -1, index)``, then
    ``torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])``), per logit element:

    * saved: the fp32 logits themselves (``saves_out``: the cast copy the loss reads), which
      ``GatherBackward`` (``gather_backward(grad, self, ...)``, derivatives.yaml) and each
      ``LogsumexpBackward`` save; forward makes one sequence's ``(self - maxes).exp_()`` at a time
      (ATen ReduceOps.cpp ``logsumexp_out_impl``), per element of the whole logits nothing;
    * backward: autograd runs the later-made nodes first: each sequence's ``LogsumexpBackward``
      (``grad * (self - result).exp()``, FunctionsManual.cpp ``logsumexp_backward``) into
      ``UnbindBackward``'s input buffer (the loop iterates ``logits``, ``Tensor.__iter__`` =
      ``unbind(0)``), which stacks them (4 B), then ``GatherBackward``: ``grad.new_zeros(sizes)
      .scatter_add(dim, index, grad)``, a zero-filled tensor and the out-of-place result (4 + 4 B),
      beside the stacked gradient and the saved logits: 12 B at the start of backward (the shifted
      (s - 1) tokens counted as s). ``SliceBackward``'s (b, s, vocab) zero-filled gradient comes after
      the gather's has been added to the stacked one and freed (8 B), then ``ToCopyBackward``'s half one."""
    return LossBytes(kept, half, F32, 0, 3 * F32, cast=cast, saves_out=1)


def _compiled_loss_bytes(m: ModelSpec, t: TrainingSpec, held: int, half: int) -> LossBytes:
    """The model's own causal-LM loss inside ``torch.compile(model)`` (the graph trace --compile
    runs: AOTAutograd's joint graph with inductor's decompositions, split by inductor's
    ``partition_fn``, ``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``).

    * Forward: inductor's decomposition of ``_log_softmax`` (``torch/_decomp/decompositions.py``
      ``_log_softmax``: ``x - amax(x) - log(sum(exp(x - amax)))``, computed in fp32 from the half
      logits that ``ForCausalLMLoss``'s ``logits.float()`` upcasts) and of ``nll_loss_forward``
      (a gather of one log-probability per token) are pointwise ops and reductions: no
      (tokens, vocab) tensor is written but the head's output. The min cut saves, besides it, the
      per-token ``amax`` and ``log(sum(exp))`` (fp32, (tokens, 1) each) and the labels shifted by
      ``ForCausalLMLoss`` (``F.pad(labels, (0, 1), value=-100)``: int64, (b, s + 1)): 16 bytes per
      token. The logits (half, (b, s, vocab)) are saved too: they are the loop's output when it
      holds it (counted there: ``held``), else saved for backward only.
    * Backward: AOTAutograd's ``CompiledFunction`` is an autograd function, which materializes a
      zero gradient for every output the loss does not reach (``torch/_functorch/_aot_autograd/
      runtime_wrappers.py``: tangents of unused outputs are ``zeros_like``): the logits' (half) and
      every KV-cache tensor's (``Quantities.loss_backward_tok``, set in ``_build``). The loss's backward (``_log_softmax_backward_data``
      and ``nll_loss_backward`` decomposed: ``grad - exp(x - amax - log) * sum(grad)`` with the
      ``where`` inductor's joint-graph pass makes of the scatter) is fused into one kernel that reads
      the saved logits and the zero tangent and writes the logits' gradient in the logits' dtype.
      Trace's graph runner frees the saved logits at the fused chain's first read (their last use
      in the graph, node ``convert_element_type`` of the logits) and the tangent after the ``add``
      that writes the gradient: at the start of backward the saved logits and the zero tangent
      are alive (one half logits-sized tensor on top of the saved ones); the gradient then
      replaces the saved logits. When the loop holds the output (``--hold-output step|backward``)
      the logits outlive the graph's read, and the gradient comes on top: two half tensors.
    Checked against trace --compile (tests/test_estimate_compile.py).
    """
    saved = 0 if held else half  # the logits: the held output, else saved for the backward only
    # backward: the zero tangent (half), and the gradient (half) when the held logits outlive the read
    return LossBytes(held, half if held else 0, saved, 0, (2 if held else 1) * half, saved_tok=2 * F32 + 8)


def _loss_parallel_bytes(held: int, half: int, on_half: bool, amp: bool) -> LossBytes:
    """The loss on vocabulary-sharded logits under ``loss_parallel()`` (PyTorch's tensor parallelism:
    the head's logits are (b, s, vocab / tp) DTensors, ``trainmem.wrappers.parallel_loss``). Its
    handlers replace the fused CUDA kernels with decompositions (torch 2.13
    ``torch/distributed/tensor/parallel/loss.py``), each tensor (b, s, vocab / tp):

    * forward, ``_log_softmax`` (L197-221): the input in fp32 (``logits.float()`` for ``upcast``;
      ``x.to(computation_dtype)``, fp32, of half logits for ``half``; none when they are fp32),
      ``shifted = x - x_max`` and ``torch.exp(shifted)`` are alive together; ``result = shifted -
      logsumexp`` replaces the exponentials and is cast back to half logits' dtype (``result.to(
      result_dtype)``): three fp32 tensors, and the half result, at the most;
    * saved: the log-probabilities (fp32 for ``upcast``; half for ``half``, plus the fp32 copy
      autocast makes for ``nll_loss``, an fp32-list op);
    * backward, ``_nll_loss_and_log_softmax_backward`` (L451-518), which does the log-softmax's
      backward too, in the saved log-probabilities' dtype: ``grad_input = torch.zeros_like(x)``,
      ``torch.exp(x)`` and their sum, then the product with the gradient replaces the exponentials:
      three tensors (the native kernels make two, ``nll_loss_backward``'s and
      ``_log_softmax_backward_data``'s)."""
    if not on_half or half == F32:
        copy = F32 if half != F32 else 0   # logits.float(): a copy of half logits, fp32 ones returned as they are
        return LossBytes(held, half, F32, copy + F32, 3 * F32)
    if amp:
        return LossBytes(held, half, half + F32, 2 * F32, 3 * F32)
    return LossBytes(held, half, half, 3 * F32, 3 * half)
