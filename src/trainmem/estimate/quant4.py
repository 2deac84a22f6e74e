"""bitsandbytes 4-bit (NF4 / FP4) base weights: which linears are quantized, the tensors each one
stores, and the dequantized copy its forward and backward make.

Sources (bitsandbytes at tag 0.42.0, the release litgpt pins, and at main 95f9af30; line numbers
at main unless said):

* ``functional.py`` ``quantize_4bit`` (L884-963): blocksize 64 (L917-918); the CUDA op
  (``backends/cuda/ops.py`` L384-392) allocates the packed weight, ``(n + 1) // 2`` uint8 elements
  (two 4-bit codes per byte, ``quant_storage`` uint8), and ``absmax``, one fp32 per block of 64;
  ``code = get_4bit_type(quant_type, device=A.device)`` (L936) builds a new 16-entry fp32 table on
  the device per call (L772-857: ``torch.tensor(data, device=device)``). With double quantization
  (``compress_statistics``, L938-949) ``offset = _absmax.mean()`` (a 0-dim fp32 tensor) is kept and
  ``quantize_blockwise(_absmax - offset, blocksize=256)`` replaces the fp32 absmax by one uint8 per
  block (``ops.py`` L311, ``torch.empty_like(A, dtype=torch.uint8)``) plus one fp32 absmax per 256
  blocks (``ops.py`` L310); its 256-entry code is the module-wide cached ``name2qmap["dynamic"]``
  (L736-737), one per process, not per weight. The fp32 absmax is deleted (L941).
* ``nn/modules.py`` ``Params4bit._quantize`` (L381-394): the weight is replaced by the packed tensor
  and the quant state; its ``dtype`` is the dtype of the tensor quantized.
* ``autograd/_functions.py`` ``MatMul4Bit`` (0.42.0 L494-548): forward
  ``F.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)`` (L516): the weight
  dequantized in the quant state's dtype, then cast to the compute dtype when that differs, is a
  transient of the layer's forward; backward ``torch.matmul(grad_output,
  F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t())`` (L546) makes it again. It saves
  ``ctx.tensors = (A, B)`` before 0.43.2 (L522-523) and ``(None, B)`` since (main L357-358):
  ``TrainingSpec.bnb_saves_input``. bitsandbytes >= 0.50 may run a fused ``gemm_4bit`` kernel
  without the dequantized copy for small token counts on some GPUs (``backends/cuda/ops.py``
  ``_gemm_4bit_use_custom_cuda``, M <= 1536); that heuristic is not modelled.

Which linears: transformers' ``replace_with_bnb_linear`` converts every ``nn.Linear``/``Conv1D``
except ``get_keys_to_not_convert(model)`` (the output embedding ``lm_head``, tied weights and the
last module; ``integrations/bitsandbytes.py``), so embeddings, norms and the head keep their dtype.
Lightning Fabric's ``BitsandbytesPrecision`` as litgpt runs it (``finetune/lora.py``:
``BitsandbytesPrecision(quantize[4:], dtype)``, no ``ignore_modules``) replaces every
``nn.Linear`` including ``lm_head`` (``fabric/plugins/precision/bitsandbytes.py``
``_convert_layers``) and quantizes from ``weight.to(dtype=torch.half)`` (``_Linear4bit.quantize``),
so its quant state is fp16 and each dequantized weight is cast to the bf16 compute dtype.
"""
from __future__ import annotations

from typing import Any

BLOCKSIZE = 64          # quantize_4bit's default blocksize (functional.py L917-918)
NESTED_BLOCKSIZE = 256  # double quantization of the absmax (functional.py L940)
CODE_BYTES = 16 * 4     # get_4bit_type: 16 fp32 entries, a new tensor per quantized weight


def storage_tensors(numel: int, double_quant: bool) -> tuple[int, ...]:
    """Bytes of each device tensor one 4-bit weight of ``numel`` elements keeps, in allocation
    order (before the caching allocator's rounding): the packed uint8 codes (``(numel + 1) // 2``),
    then the fp32 absmax per 64-element block, or with double quantization the fp32 ``offset`` (0-dim),
    the uint8 absmax per block and the fp32 absmax per 256 blocks; then the 16-entry fp32 code
    (bitsandbytes ``functional.quantize_4bit`` L929-958, ``backends/cuda/ops.py`` L384-392, L310-311)."""
    packed = (numel + 1) // 2
    blocks = -(-numel // BLOCKSIZE)
    if not double_quant:
        return (packed, blocks * 4, CODE_BYTES)
    return (packed, 4, blocks, -(-blocks // NESTED_BLOCKSIZE) * 4, CODE_BYTES)


def is_quantized(p: Any, t: Any) -> bool:
    """Whether parameter ``p`` (``spec.model.ParamTensor``) is stored in 4 bits under ``t``: the
    linears' weights inside the layers (not embeddings, norms, biases or MoE routers/experts), and
    the LM head's only when Fabric converts it (``quantize_via="fabric"``, see the module doc)."""
    if not t.quantize or p.role != "linear":
        return False
    return p.layer is not None or t.quantize_via == "fabric"


def dequant_dtypes(t: Any) -> tuple[int, int]:
    """(bytes per element of ``dequantize_4bit``'s output, of the cast to the compute dtype or 0
    when none is made). The output has the quant state's dtype: fp16 under Fabric (it quantizes
    an fp16 copy), else the weights' dtype as loaded (``Params4bit._quantize`` keeps it). The
    compute dtype is the matmul's (bf16/fp16, fp32 in fp32 training); ``.to(A.dtype)`` copies only
    when the dtypes differ (fp16 state, bf16 compute is a copy of the same size)."""
    half = "fp16" if t.precision in ("fp16", "fp16-amp") else "bf16"
    compute = "fp32" if t.precision == "fp32" else half
    if t.quantize_via == "fabric":
        state = "fp16"
    else:
        state = "fp32" if t.weight_bytes == 4 else half
    size = {"fp32": 4, "bf16": 2, "fp16": 2}
    return size[state], (0 if state == compute else size[compute])
