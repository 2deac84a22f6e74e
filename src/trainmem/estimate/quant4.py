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

torchao's ``NF4Tensor`` (``quantize_via="torchao"``: torchtune's QLoRA builders, ``LoRALinear(...,
quantize_base=True)`` and ``FrozenNF4Linear``, ``to_nf4(weight)`` with block_size 64 and
scaler_block_size 256; every linear of the decoder layers, not the embedding or the output head
unless ``apply_lora_to_output``). Sources: pytorch/ao ``torchao/dtypes/nf4tensor.py`` at v0.1 (the
release torchtune 0.1.x pins) and v0.3.0, unchanged in what is counted here up to 0.18.0
(``torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py``):

* ``NF4Tensor.from_tensor`` (v0.1 L220-290): ``nf4``, the 16-entry lookup table in the weight's dtype
  (bf16: 32 B, a new tensor per weight); ``double_quantize_scalers`` (L292-348): ``scaler_mean``, the
  0-dim mean of the per-64-block absmax (bf16), ``quantized_scalers``, one int8 per 64-element block,
  and ``quantization_factor``, one bf16 per 256 blocks, but before torchao 0.3 a strided view
  (``quantization_factor[:, 0]``) of the ``256 / (2 * scaler_absmax)`` it computed from the expanded
  absmax, which keeps that whole ``n_blocks``-element bf16 storage (v0.1 L343-347; v0.3.0 L602 adds
  ``.contiguous()``); ``convert_to_norm_float_weight``: ``quantized_data``, two 4-bit codes per uint8
  (``numel // 2``). Checked on a real ``to_nf4`` on CPU (torchao 0.18.0: ``tests/test_quant4_torchao.py``).
* ``LinearNF4`` (v0.1 L557-574, v0.3.0 L865-876): forward ``F.linear(input, weight.to(input.dtype))``
  saves only the NF4 weight (the parameter itself); backward ``grad_output @ weight.to(dtype)``.
  ``.to`` dispatches to ``get_original_weight`` (v0.1 L409-435, v0.3.0 L668-694), which holds in its locals, until it
  returns, both nibble planes as int64 (``(quantized_data >> 4).to(torch.long)``: 8 B per half
  element, 4 B per element each), both looked-up halves (``nf4[codes]``, 1 B per element each) and
  both scaled halves (1 B per element each), and then stacks them into the bf16 weight (2 B per
  element) and the dequantized scalers (``dequantize_scalers``, bf16 per block): 14.03 B per element
  at once (``DEQUANT_SCRATCH`` + the weight), of which the weight alone outlives the call and meets
  the matmul's output. Measured on CPU (``tests/test_quant4_torchao.py``): ``get_original_weight`` of
  a (1024, 2816) weight peaks at 40,460,288 B = 14.03125 B per element, with torchao 0.18.0 and with
  the v0.1 and v0.3.0 sources alike. Under ``torch.compile`` inductor fuses that chain of
  pointwise ops and gathers into the kernel that writes the weight: no scratch (not measured).
"""
from __future__ import annotations

from typing import Any

BLOCKSIZE = 64          # quantize_4bit's default blocksize (functional.py L917-918)
NESTED_BLOCKSIZE = 256  # double quantization of the absmax (functional.py L940)
CODE_BYTES = 16 * 4     # get_4bit_type: 16 fp32 entries, a new tensor per quantized weight
NF4_BLOCK = 64          # torchtune's to_nf4(weight) block_size (torchao to_nf4 default)
NF4_SCALER_BLOCK = 256  # ... and scaler_block_size
NF4_TABLE_BYTES = 16 * 2  # the nf4 lookup table: 16 entries in the weight's dtype (bf16)
#: get_original_weight's locals beside the bf16 weight it returns, bytes per weight element: two int64
#: nibble planes (4 + 4), two looked-up and two scaled bf16 halves (1 + 1 + 1 + 1) and the dequantized
#: scalers (one bf16 per 64 elements: 2 / 64)
DEQUANT_SCRATCH = 12 + 2 / NF4_BLOCK


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


def torchao_storage(numel: int, full_factor: bool) -> tuple[int, ...]:
    """Bytes of each device tensor one torchao ``NF4Tensor`` of ``numel`` bf16 elements keeps, in
    allocation order (before the allocator's rounding): the nf4 table (16 bf16), ``scaler_mean``
    (0-dim bf16), ``quantization_factor`` (one bf16 per 256 blocks; ``full_factor``, torchao < 0.3:
    the whole ``n_blocks`` bf16 storage it is a view of, allocated before ``quantized_scalers``),
    ``quantized_scalers`` (int8 per 64-block), ``quantized_data`` (``numel // 2`` uint8); torchao
    ``nf4tensor.py`` v0.1 L220-347, v0.3.0 L477-604 (see the module doc)."""
    blocks = numel // NF4_BLOCK
    factor = blocks * 2 if full_factor else blocks // NF4_SCALER_BLOCK * 2
    if full_factor:
        return (NF4_TABLE_BYTES, 2, factor, blocks, numel // 2)
    return (NF4_TABLE_BYTES, 2, blocks, factor, numel // 2)


def fsdp_packed_bytes(numel: int, t: Any) -> int:
    """Bytes of one 4-bit weight's packed codes as FSDP1 flattens, shards and all-gathers them
    (bitsandbytes >= 0.43 with ``quant_storage`` the model's dtype, as Answer.AI's fsdp_qlora
    ``replace_linear(..., Linear4bit, quant_type='nf4', quant_storage=torch_dtype)`` (train.py at
    50efa1e) and transformers' ``BitsAndBytesConfig(bnb_4bit_quant_storage=...)`` set it).
    ``quantize_4bit`` allocates ``torch.zeros(((n + 1) // mod, 1), dtype=quant_storage)`` with ``mod =
    dtype2bytes[quant_storage] * 2`` (bitsandbytes 0.43.0 ``functional.py`` L985-986): two 4-bit codes
    per byte whatever the storage dtype (bf16: ``(n + 1) // 4`` elements of 2 B), so a dtype FSDP1 can
    put in one flat parameter with the bf16 norms. The quant state (absmax, nested absmax, offset,
    code) is no parameter: it stays an attribute of the ``Linear4bit`` (``module.quant_state``, set by
    ``Params4bit._quantize``, ``nn/modules.py`` L278-292), whole on every rank (fsdp_qlora's
    ``load_and_quantize`` quantizes each weight on every rank, then moves only the codes to the CPU or
    meta device), and ``Linear4bit.forward`` re-attaches it to the gathered view (L405-416)."""
    storage = 4 if t.weight_bytes == 4 else 2  # bytes of one quant_storage element (fp32, or bf16/fp16)
    return (numel + 1) // (storage * 2) * storage


def weight_storage(numel: int, t: Any) -> tuple[int, ...]:
    """The device tensors of one 4-bit weight under ``t``: torchao's NF4Tensor (``quantize_via``
    torchao) or bitsandbytes' packed codes and quant state."""
    if t.quantize_via == "torchao":
        return torchao_storage(numel, t.torchao_release() < (0, 3))
    return storage_tensors(numel, t.quantize.endswith("-dq"))


def dequant_scratch(t: Any) -> float:
    """Bytes per weight element that exist only while a 4-bit weight is dequantized, beside the
    dequantized weight (``dequant_dtypes``) and before its matmul's output: torchao's
    ``get_original_weight`` locals (``DEQUANT_SCRATCH``) in eager mode; 0 under ``--compile``
    (fused) and for bitsandbytes (``dequantize_4bit`` writes the weight in one kernel)."""
    return DEQUANT_SCRATCH if t.quantize_via == "torchao" and not t.compile else 0


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
    when the dtypes differ (fp16 state, bf16 compute is a copy of the same size). torchao's
    ``get_original_weight`` returns the weight's own dtype (bf16, which torchtune computes in):
    ``.to`` makes no copy."""
    half = "fp16" if t.precision in ("fp16", "fp16-amp") else "bf16"
    compute = "fp32" if t.precision == "fp32" else half
    if t.quantize_via == "fabric":
        state = "fp16"
    elif t.quantize_via == "torchao":
        state = "bf16"
    else:
        state = "fp32" if t.weight_bytes == 4 else half
    size = {"fp32": 4, "bf16": 2, "fp16": 2}
    return size[state], (0 if state == compute else size[compute])


# ----- the build of torchtune 0.1's QLoRA model on the GPU with torchao 0.1 ---------------------------
#
# torchtune v0.1.0 builds the model on the device in bf16 (recipes/lora_finetune_single_device.py
# L254-255), one template layer that ``TransformerDecoder`` deep-copies ``num_layers`` times
# (torchtune/modules/transformer.py L81-93, L137), then copies the checkpoint in with
# ``load_state_dict`` (L267). An NF4 weight is made three times on the GPU: by ``LoRALinear``
# (``to_nf4(linear.weight)`` of a new bf16 ``nn.Linear``, torchtune/modules/peft/lora.py
# ``_create_weight_and_bias``), by the deep copy (torchtune/utils/_register_nf4_dispatch_ops.py L11-20:
# ``clone`` is ``to_nf4(weight.get_original_weight())``) and by the load (L23-42: ``copy_`` is
# ``to_nf4(src.to(device))`` whose tensors replace the old ones). torchao 0.1's ``to_nf4`` compares
# every element with the 16 NF4 values at once (nf4tensor.py v0.1 L438-446 ``quantize_tensor_nearest``:
# two [numel, 16] bf16 tensors); torchao 0.2 does it in chunks of 2^20 elements (``CHUNK_SIZE``). The
# caching allocator keeps the segments of those transients (the recipe never calls ``empty_cache``),
# which sets the reserved memory of the model init and of the training after it.


class _Events:
    """Alloc/free events of a sequence of tensors: ``("a", id, bytes)`` and ``("f", id)``."""

    def __init__(self) -> None:
        self.ev: list[tuple] = []
        self.n = 0

    def a(self, nbytes: float) -> int:
        self.n += 1
        self.ev.append(("a", self.n, int(nbytes)))
        return self.n

    def f(self, *ids: int) -> None:
        self.ev.extend(("f", i) for i in ids)

    def absmax(self, n: int, block: int, elem: int) -> int:
        """``get_block_absmax`` (v0.1 L133-150): ``blocks.abs()``, then ``.max(dim=1)``'s values and
        int64 indices (the indices and the abs freed); the values (``elem`` bytes each) returned."""
        ab = self.a(n * elem)
        vals, idx = self.a(n // block * elem), self.a(n // block * 8)
        self.f(ab, idx)
        return vals

    def to_nf4(self, n: int) -> list[int]:
        """torchao 0.1 ``to_nf4`` of a bf16 weight of ``n`` elements (v0.1 ``from_tensor`` L220-290,
        ``double_quantize_scalers`` L292-348, ``convert_to_norm_float_weight`` L378-407); returns the
        kept tensors (table, mean, factor, int8 scalers, packed codes). Checked event by event
        against the v0.1 source run on CPU (tests/test_quant4_torchao.py)."""
        b = n // NF4_BLOCK
        table = self.a(NF4_TABLE_BYTES)                    # nf4 = torch.tensor([...], bf16)
        s1 = self.absmax(n, NF4_BLOCK, 2)                  # scalers_1 (bf16 per block)
        mean = self.a(2)                                   # scalers_1.mean()
        s2 = self.a(b * 2)                                 # scalers_1 - mean
        self.f(s1)
        sabs = self.absmax(b, NF4_SCALER_BLOCK, 2)         # scaler_absmax
        two, rec = self.a(b * 2), self.a(b * 2)            # 2 * expanded absmax, its reciprocal
        factor = self.a(b * 2)                             # 256 / (...): b bf16, kept behind [:, 0]
        self.f(two, rec)
        mul = self.a(b * 2)                                # scaler_blocks * quantization_factor
        rnd = self.a(b * 2)                                # .round()
        self.f(mul)
        clamp = self.a(b * 2)                              # .clamp(-128, 127)
        self.f(rnd)
        scalers = self.a(b)                                # .flatten().to(torch.int8)
        self.f(s2, sabs, clamp)
        blockmax = self.absmax(n, NF4_BLOCK, 2)            # convert_to_norm_float_weight's scalers
        scaled = self.a(n * 2)                             # blocks / scales
        sub = self.a(n * 32)                               # value.unsqueeze(-1) - nf4: [n, 16] bf16
        ab = self.a(n * 32)                                # .abs()
        self.f(sub)
        mins, idx = self.a(n * 2), self.a(n * 8)           # .min(dim=-1): values, int64 indices
        self.f(ab, mins)
        shl = self.a(n // 2 * 8)                           # quantized_blocks[::2] << 4 (int64)
        orr = self.a(n // 2 * 8)                           # | quantized_blocks[1::2]
        self.f(shl)
        packed = self.a(n // 2)                            # .to(torch.uint8)
        self.f(blockmax, scaled, idx, orr)
        return [table, mean, factor, scalers, packed]

    def original_weight(self, n: int) -> int:
        """``get_original_weight`` (v0.1 L409-435): the bf16 weight; its locals freed on return."""
        b = n // NF4_BLOCK
        sh = self.a(n // 2)                                # quantized_data >> 4 (uint8)
        first = self.a(n // 2 * 8)                         # .to(torch.long)
        self.f(sh)
        an = self.a(n // 2)                                # quantized_data & 0b1111
        second = self.a(n // 2 * 8)
        self.f(an)
        d1, d2 = self.a(n), self.a(n)                      # nf4[first], nf4[second]: n/2 bf16 each
        div = self.a(b * 2)                                # dequantize_scalers: int8 / factor
        sc = self.a(b * 2)                                 # ... + scaler_mean
        self.f(div)
        r1 = self.a(n)                                     # repeated.flatten(): n/2 bf16
        m1 = self.a(n)                                     # dequantized_first * repeated
        self.f(r1)
        r2 = self.a(n)
        m2 = self.a(n)
        self.f(r2)
        w = self.a(n * 2)                                  # torch.stack(...): the bf16 weight
        self.f(first, second, d1, d2, sc, m1, m2)
        return w


def torchtune_v01_build(m: Any, t: Any) -> tuple[tuple, ...]:
    """The alloc/free events of torchtune 0.1's QLoRA model build and checkpoint load on the GPU with
    torchao 0.1 (see above), in order: the template layer (``lora_llama2``: the attention's
    projections q, k, v, output, its RoPE module, the MLP's w1 (gate), w2 (down), w3 (up), the two
    norms), the token embedding, the output projection, the ``num_layers`` deep copies, the final
    norm, the template freed, then ``load_state_dict`` re-quantizing every NF4 weight from a bf16
    copy of the checkpoint's on the device. LoRA adapters in bf16 (``lora_dtype`` half); the layers'
    own RoPE caches where ``layer_rope_cache`` says so. What is kept at the end is the model."""
    from .states import default_lora_targets
    e = _Events()
    layer0 = {p.module: p for p in m.parameter_tensors() if p.layer == 0}
    targets = set(t.lora_targets or default_lora_targets(m))
    lora_b = 2 if t.lora_dtype == "half" else 4
    order = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "gate_proj", "down_proj", "up_proj",
             "input_layernorm", "post_attention_layernorm")

    def rope() -> list[int]:
        if t.layer_rope_cache is None:
            return []
        return [e.a(64 * 4), e.a(t.layer_rope_cache * 64 * 2 * 4)]   # theta [64], cache [len, 64, 2] fp32

    def module(name: str, make) -> list[int]:
        if name == "rope":
            return rope()
        p = layer0[name]
        kept = make(p) if is_quantized(p, t) else [e.a(p.numel * 2)]
        if p.module in targets and p.role == "linear":
            out, inp = p.shape
            kept += [e.a(t.lora_rank * inp * lora_b), e.a(out * t.lora_rank * lora_b)]
        return kept

    def build(p) -> list[int]:
        w = e.a(p.numel * 2)                               # nn.Linear's bf16 weight
        kept = e.to_nf4(p.numel)
        e.f(w)                                             # the nn.Linear dropped on return
        return kept

    def clone(p) -> list[int]:
        w = e.original_weight(p.numel)
        kept = e.to_nf4(p.numel)
        e.f(w)
        return kept

    template = [module(n, build) for n in order]
    outer = {p.name: p for p in m.parameter_tensors() if p.layer is None}
    emb = [e.a(p.numel * 2) for p in outer.values() if p.role == "embedding"]
    head = [e.a(p.numel * 2) for p in outer.values() if p.role == "linear"]
    copies = [[module(n, clone) for n in order] for _ in range(m.num_layers)]
    final = [e.a(p.numel * 2) for p in outer.values() if p.role == "norm"]
    e.f(*(i for ids in template for i in ids))
    for layer in copies:                                   # load_state_dict: copy_ of each NF4 weight
        for name, ids in zip(order, layer):
            p = layer0.get(name)
            if p is None or not is_quantized(p, t):
                continue
            src = e.a(p.numel * 2)                         # the checkpoint's bf16 tensor .to(device)
            new = e.to_nf4(p.numel)
            e.f(src, *ids[:5])                             # the old tensors replaced
            ids[:5] = new
    del emb, head, final
    return tuple(e.ev)


def builds_on_device(t: Any) -> bool:
    """Whether the run's model build is replayed (``torchtune_v01_build``): torchao's NF4 under
    torchao < 0.2 (unchunked ``to_nf4``), as torchtune 0.1.x ran it; or torchtune's bf16 build of a
    template layer deep-copied on the GPU (``spec.frameworks.torchtune_builds_template_on_device``),
    whose freed template stays cached: Llama-2-7B LoRA q, v rank 8 at v0.1.0 reaches 13.96 GB
    allocated and reserves 13.98 GB at model init, as torchtune printed (QLoRA tutorial, ff594c231)."""
    from ..spec.frameworks import torchtune_builds_template_on_device
    if torchtune_builds_template_on_device(t):
        return True
    return bool(t.quantize) and t.quantize_via == "torchao" and t.torchao_release() < (0, 2)
