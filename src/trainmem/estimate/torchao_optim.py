"""torchao's low-bit AdamW optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``): what their states
hold on the device and what one step allocates and frees, per parameter tensor.

Sources: torchao 0.18.0 ``torchao/optim/adam.py``, ``subclass_8bit.py``, ``subclass_4bit.py``,
``subclass_fp8.py``, ``quant_utils.py`` (the same code sits in ``torchao/prototype/low_bit_optim/``
before 0.10). Modelled from 0.7.0 on: the 8-bit and FP8 block shrank from 2048 to 256 in 0.6.0 (ao
commit 728d6290d) and the step computes in fp32 explicitly since 0.7.0 (afc0a0262, "Upcast
everything to FP32"), whose step is the one measured here.

States (``_AdamBase._new_buffer``, adam.py L71-98): a tensor of at least 4096 elements whose element
count the block size divides gets a quantized state subclass for ``exp_avg`` (signed map) and
``exp_avg_sq`` (unsigned map); any other tensor ``torch.zeros_like(p)`` twice (the parameter's
dtype and shape). Under FSDP2 the test reads the local shard (``p.to_local()``). The subclass
tensors (``OptimStateXbit.zeros``):
  * 8-bit: ``codes`` uint8 of p's shape, ``scale`` fp32 ``numel // block`` (one per block), ``qmap``
    fp32 256 values (``torch.tensor(qmap_list, device=device)``: one per state tensor, not shared);
  * 4-bit: ``codes`` uint8 ``numel // 2`` (two codes per byte), ``scale`` fp32 per block, ``qmap``
    fp32 16 values;
  * FP8: ``codes`` float8_e4m3fn of p's shape, ``scale`` fp32 per block, no map.
``state["step"]`` is ``torch.tensor(0.0)`` and the group's ``lr`` a tensor, both on the host.

The step (adam.py L100-159) loops over the parameters and runs ``torch.compile(single_param_adam,
fullgraph=True, dynamic=False)`` on each: one inductor graph per tensor, so its buffers live only
while that tensor updates and the largest tensor sets the peak. The buffers are read off the code
inductor generates for the real optimizer (tests/test_torchao_optim.py compiles it on the CPU and
compares): the dequantized fp32 moments ``exp_avg_f32``/``exp_avg_sq_f32`` are realized as
(blocks, block) buffers because the quantizer's binary search reads them many times, plus the two
new fp32 scales; the 4-bit step first unpacks each state's codes into two uint8 halves of
``numel // 2`` (``codes >> 4``, ``codes & 0b1111``: subclass_4bit.py ``dequantize``), then keeps
the int64 codes of the binary search (``quantize_4bit_with_qmap``) of both states beside the fp32
moments; FP8's casts fuse, only the two scales remain; a plain (unquantized) state's step
allocates nothing. These are inductor's CPU kernels (torch 2.13); the CUDA backend's fusion may
keep fewer buffers.
"""
from __future__ import annotations

from typing import Callable

#: trainmem's names -> (code bits: 8, 4 or "fp8", torchao's default block size, qmap values per state)
TORCHAO_LAYOUTS = {"adamw-torchao-8bit": (8, 256, 256), "adamw-torchao-4bit": (4, 128, 16),
                   "adamw-torchao-fp8": ("fp8", 256, 0)}
#: torchao's classes for them (``torchao.optim`` from 0.10, ``torchao.prototype.low_bit_optim`` before)
TORCHAO_CLASSES = {"adamw-torchao-8bit": "AdamW8bit", "adamw-torchao-4bit": "AdamW4bit",
                   "adamw-torchao-fp8": "AdamWFp8"}
MIN_QUANT_SIZE = 4096  # adam.py L80: "follow bitsandbytes, only quantize tensors >= 4096 values"


def default_block(optimizer: str) -> int:
    """torchao's default ``block_size`` of the class (adam.py: 256 for AdamW8bit and AdamWFp8, 128
    for AdamW4bit)."""
    return TORCHAO_LAYOUTS[optimizer][1]


def quantized(numel: int, block: int) -> bool:
    """``_new_buffer``'s test (adam.py L80): at least 4096 elements and a whole number of blocks."""
    return numel >= MIN_QUANT_SIZE and numel % block == 0


def state_tensors(optimizer: str, numel: int, pbytes: int, block: int) -> tuple[int, ...]:
    """Bytes of each device tensor of one parameter's two states, unrounded: per state ``codes``,
    ``scale`` (fp32 per block) and ``qmap`` (fp32, 8-bit 256 / 4-bit 16 values; FP8 has none), or
    ``zeros_like(p)`` (``pbytes`` per element) when the tensor is not quantized."""
    if not quantized(numel, block):
        return (numel * pbytes, numel * pbytes)      # exp_avg, exp_avg_sq: p's dtype and shape
    bits, _, qmap = TORCHAO_LAYOUTS[optimizer]
    codes = numel // 2 if bits == 4 else numel       # uint8 (4-bit: two per byte) / float8_e4m3fn
    one = (codes, numel // block * 4) + ((qmap * 4,) if qmap else ())
    return one + one


def step_events(optimizer: str, numel: int, block: int) -> tuple[int, ...]:
    """The compiled step's buffers for one tensor, in order: a positive number allocates that many
    bytes, a negative one frees an earlier buffer of that size; all that remain are freed when the
    graph returns. Read off inductor's code for ``single_param_adam`` (see the module docstring)."""
    if not quantized(numel, block):
        return ()
    blocks = numel // block
    bits = TORCHAO_LAYOUTS[optimizer][0]
    if bits == "fp8":
        return (blocks * 4, blocks * 4)                                   # the new scales, fp32
    if bits == 8:
        return (blocks * 4, blocks * 4, numel * 4, numel * 4)            # scales; exp_avg(_sq)_f32
    half = numel // 2
    return (half, half, -half, -half,                                     # unpacked codes (uint8), reused
            blocks * 4, blocks * 4, numel * 4, numel * 4, numel * 8, numel * 8)  # scales, fp32 moments, int64 codes


def step_peak(optimizer: str, numel: int, block: int, rounded: Callable[[int], int]) -> int:
    """The highest sum of ``step_events`` alive at once, each buffer rounded by ``rounded`` (the
    caching allocator's block)."""
    live = peak = 0
    for e in step_events(optimizer, numel, block):
        live += rounded(e) if e > 0 else -rounded(-e)
        peak = max(peak, live)
    return peak
