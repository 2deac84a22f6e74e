"""Unsloth's offloaded gradient checkpointing (``--unsloth-gc``; ``--framework unsloth``).

``FastLanguageModel.get_peft_model(..., use_gradient_checkpointing="unsloth")`` (its default:
unsloth 2026.3.5 ``models/llama.py`` L2743) patches torch's reentrant checkpoint with unsloth_zoo's
``UnslothCheckpointFunction`` (``patch_unsloth_smart_gradient_checkpointing``, unsloth_zoo 2026.3.4
``unsloth_zoo/gradient_checkpointing.py`` L792-810; ``unsloth_checkpoint`` forces
``use_reentrant=True``, L758-761), for ``max_seq_length >= 512`` (``apply_unsloth_gradient_checkpointing``,
unsloth ``models/_utils.py`` L191-222; shorter maxima get torch's checkpoint, ``--no-unsloth-gc --recompute full
--reentrant``). What it keeps on the GPU (line numbers: unsloth_zoo 2026.3.4, commit 38f4871f):

* one GPU buffer per device, ``torch.empty(2*256*2048, dtype)`` at patch time (L355), grown with
  ``GPU_BUFFER.resize_(new_size)`` to the largest offloaded input (L466): the model dtype (bf16 or
  fp16, ``initialize_unsloth_gradient_checkpointing(dtype)``), kept to the end of the run;
* a layer's input (``args[0]``, the (b, s, h) hidden states) is copied to a pinned CPU buffer on a
  side stream (L472) and not saved (``tensor_inputs.append(None)``, L476) when it has more than
  ``MINIMUM_SIZE = 2 MiB / dtype bytes`` elements (L372-373, L438) and it is not the last
  checkpointed layer (``CURRENT_GC_INDEX != LAST_GC_INDEX``) or this is the first forward
  (``FIRST_PASS``, L438; ``LAST_GC_INDEX`` counts the first forward's layers, L424-428): from the
  second step on the top layer saves its input on the GPU, as torch's checkpoint does (L495);
* in backward the CPU copy is brought back into the GPU buffer (``buffer.copy_(x)``, L526-532) and
  the layer recomputed on ``buffer.detach()`` (L583-585): no new tensor for the input.

So per step the GPU holds, beyond torch's reentrant checkpointing without the layers' inputs: the
buffer ((b, s, h) model dtype, at least 2 MiB) from the first forward on, and the top layer's input
until that layer's backward. The recomputed layer's input is the buffer. Inputs at or below the
threshold (b·s·h <= 1 Mi elements in bf16) stay saved as torch's checkpoint saves them.
"""
from __future__ import annotations

from typing import Any

#: elements of the GPU buffer made at patch time (``torch.empty(2*256*2048, ...)``, L355)
INITIAL_GPU_BUFFER = 2 * 256 * 2048
#: bytes of a layer input at or below which it is not offloaded (``MINIMUM_SIZE = 2 * 1024 * 1024 //
#: n_bytes`` elements, L372-373)
MINIMUM_BYTES = 2 * 1024 * 1024


def offloads(hidden: int, stream_bytes: int, tokens: int) -> bool:
    """Whether a layer input of ``tokens`` x ``hidden`` elements (``stream_bytes`` each: the model
    dtype) is offloaded: ``new_size > MINIMUM_SIZE`` (strictly, L438)."""
    return tokens * hidden > MINIMUM_BYTES // stream_bytes


def gpu_buffer_bytes(hidden: int, stream_bytes: int, tokens: Any) -> Any:
    """Bytes of the persistent GPU buffer: its initial 1 Mi elements, grown to one offloaded layer
    input, (b, s, h) in the model dtype (``resize_`` only when larger, L466)."""
    need = tokens * hidden
    grown = need > MINIMUM_BYTES // stream_bytes
    return (need * grown + INITIAL_GPU_BUFFER * (1 - grown) if hasattr(need, "shape")
            else (need if grown else INITIAL_GPU_BUFFER)) * stream_bytes


def weight_buffer_bytes(m: Any, t: Any) -> int:
    """Unsloth's global dequantization buffer (``--unsloth-kernels`` over 4-bit weights): its
    ``matmul_lora`` dequantizes each 4-bit weight with ``fast_dequantize(W, W_quant,
    use_global_buffer=True)`` (unsloth 2026.3.5 ``kernels/utils.py`` L1034, L503-530): one
    ``WEIGHT_BUFFER`` in the quant state's dtype (the compute dtype, half) and one fp32
    ``ABSMAX_BUFFER`` per device, made at the first call and grown with ``resize_`` to the largest
    weight (and its 64-element blocks' absmax), kept for the run. Bytes: the largest 4-bit weight x
    (half + 4/64)."""
    from .quant4 import is_quantized
    if not (t.unsloth_kernels and t.quantize):
        return 0
    largest = max((p.numel for p in m.parameter_tensors() if is_quantized(p, t)), default=0)
    half = 4 if t.precision == "fp32" else 2
    return largest * half + -(-largest // 64) * 4


def kept_per_layer(kept: tuple[float, float], input_tok: float, layers: int) -> tuple[float, float]:
    """A checkpointed layer's kept bytes (per token, per token x key) when the inputs are offloaded:
    none of the layers' inputs but the top one's, which stays from the second step on (spread over
    the ``layers`` here: the engine's layers are alike, so the top layer's backward and the moments
    before it count it whole; the bottom layer's backward counts ``input_tok / layers`` of it, which
    is freed by then). The recomputed layer's input is the buffer (``gpu_buffer_bytes``, counted
    from the first forward on), so its recomputation adds none."""
    return kept[0] - input_tok + input_tok / layers, kept[1]
