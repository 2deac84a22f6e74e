"""torchtitan's rotary embedding put into transformers' Llama, so that ``trace`` runs what torchtitan runs.

torchtitan's Llama (torchtrain ``torchtrain/models/llama/model.py`` ``apply_rotary_emb``, as at
pytorch/torchtitan@010d71a71, the torchtrain code of spring 2024, and unchanged in name and body in
torchtitan's ``models/llama/model.py`` / ``models/llama3/model/model.py`` through 2025) rotates q and
k as complex numbers::

    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))   # fp32 copy of q
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))   # fp32 copy of k
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)                        # a view of a buffer
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)                  # complex64 product
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)                            # back to bf16

where transformers' ``apply_rotary_pos_emb`` computes ``q * cos + rotate_half(q) * sin`` in the
projections' dtype. Autograd keeps the same tensors either way (torchtitan's ``mul`` saves only
``freqs_cis``, which needs no gradient; transformers' saves ``cos`` and ``sin``), so the allocated
peak does not move, but the temporaries differ: per q (and k) an fp32 copy and a complex64 product,
each twice the bf16 tensor (b, s, heads, head_dim), made and freed in the layer's forward and again
in a checkpoint's recompute. Their sizes decide which holes the caching allocator leaves between
the tensors a layer keeps: trace of torchtitan PR #165's Llama-2-7B FSDP2 rows (8 x 2048 tokens
over 8 ranks, torch 2.13): max reserved +3.8 % under full recomputation, -2.1 % under the per-op
policy (docs/frameworks.md, "torchtitan's rotary embedding").

``rope(model, t)`` swaps the rotary function of transformers' Llama modeling file while the step runs
under ``--framework torchtitan`` (the attention's forward reads the module global at each call, also
in a checkpoint's recompute). Only Llama: torchtitan's Qwen3 rotates with cos/sin as transformers
does (``rope_cache``, ``apply_rotary_emb_cos_sin``). The pairing of q's elements (adjacent in
torchtitan, halves in transformers) differs with the checkpoint's layout, not in memory; the
complex frequencies are made once per forward from transformers' cos/sin and shared by the layers,
as torchtitan's layers share views of its ``freqs_cis`` buffer (``_freqs_cis``).
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from .spec import TrainingSpec
from .swaps import swapped

#: the modeling file whose rotary function torchtitan's replaces (its Llama's)
LLAMA_MODELING = "transformers.models.llama.modeling_llama"


def _freqs_cis(cache: dict, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``freqs_cis[0:seqlen]``: (s, head_dim / 2) complex64, cos + i sin of the angles
    (``precompute_freqs_cis``: ``torch.polar(ones, freqs)``), from transformers' cos/sin ((b, s,
    head_dim), the angles repeated over the two halves, made once per model forward and handed to
    every layer): made once per cos tensor, so every layer's product (and a checkpoint's recompute,
    which gets the same cos) shares one, as torchtitan's layers share views of its buffer. ``cache``
    holds only the latest (a weak reference to its cos) and is cleared when the step ends (``rope``)."""
    ref = cache.get("cos")
    if ref is None or ref() is not cos:
        half = cos.shape[-1] // 2
        with torch.no_grad():
            cache["freqs"] = torch.complex(cos[0, :, :half].float(), sin[0, :, :half].float())
        cache["cos"] = weakref.ref(cos)
    return cache["freqs"]


def rotary(cache: dict) -> Any:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)`` as torchtitan's ``apply_rotary_emb``
    computes it, on transformers' (b, heads, s, head_dim) q and k (``unsqueeze_dim`` 1), in its
    order (torchtrain ``models/llama/model.py`` L148-153 at pytorch/torchtitan@83c879f18^; v0.2.2
    ``torchtitan/models/llama3/model/model.py`` L164-169 the same): both fp32
    copies, then both complex64 products, then both casts back, every copy and product alive until
    it returns (they decide which cached blocks the next tensors reuse)."""
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = _freqs_cis(cache, cos, sin).unsqueeze(0)          # (1, s, d/2), then broadcast
        if unsqueeze_dim == 1:
            freqs = freqs.unsqueeze(1)                            # (1, 1, s, d/2)
        xq_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))  # fp32 copies, complex views
        xk_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        xq_out = torch.view_as_real(xq_ * freqs).flatten(-2)      # complex64 products
        xk_out = torch.view_as_real(xk_ * freqs).flatten(-2)
        return xq_out.type_as(q), xk_out.type_as(k)               # back to the projections' dtype
    return apply


@contextlib.contextmanager
def rope(model: nn.Module, t: TrainingSpec) -> Iterator[None]:
    """``--framework torchtitan`` on a transformers Llama: its modeling file's ``apply_rotary_pos_emb``
    is torchtitan's complex rotation (``rotary``) while the step runs; a no-op otherwise (other
    frameworks, other architectures, ``--liger``, whose own RoPE kernel then runs)."""
    f = sys.modules.get(LLAMA_MODELING)
    uses = f is not None and any(type(m).__module__ == LLAMA_MODELING for m in model.modules())
    if t.extra.get("framework") != "torchtitan" or t.liger or not uses:
        yield
        return
    cache: dict = {}
    try:
        with swapped({(f, "apply_rotary_pos_emb"): rotary(cache)}):
            yield
    finally:
        cache.clear()
