"""The gated delta net's fused kernels as trace runs them (``--mixer-kernels fused``).

transformers 5.24 decorates Qwen3.5's and Qwen3-Next's ``torch_chunk_gated_delta_rule`` and
``causal_conv1d_fn`` with ``use_kernel_func_from_hub_with_fallback(name, package)``
(``integrations/hub_kernels.py`` L990-1055): with flash-linear-attention (``fla``) and causal-conv1d
installed, the mixer (``Qwen3_5GatedDeltaNet.forward``, ``models/qwen3_5/modeling_qwen3_5.py`` L547-656;
``Qwen3NextGatedDeltaNet.forward``, ``models/qwen3_next/modeling_qwen3_next.py`` L659-767) calls
``fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)`` and
``causal_conv1d.causal_conv1d_fn(x, weight, bias, activation="silu")``. ``output_final_state`` is True in
training whenever the forward builds a cache (``use_cache``, the config's by default). The gated RMSNorm
after the rule (``Qwen3_5RMSNormGated``, ``Qwen3NextRMSNormGated``) is transformers' torch module on both
paths in 5.24 (``use_kernel_forward_from_hub("RMSNormGated")`` swaps it only for a kernelized model;
earlier modeling files took fla's ``FusedRMSNormGated`` where fla imported, so ``TrainingSpec`` refuses
``--mixer-kernels fused`` with an older ``--transformers-version``): unchanged here.

Their Triton and CUDA kernels cannot run on trace's fake tensors, so each Function here is an emulation of
the kernel's memory, as ``liger_modules`` is of Liger's: it allocates what the package's Python code
allocates (``torch.empty``, ``new_empty``, ``zeros_like``, the GVA head sums), saves exactly what its
``ctx.save_for_backward`` saves, and stands for each kernel launch (which writes into tensors already
allocated) by nothing. Values are not computed (trace's tensors have none). Sources:

* flash-linear-attention v0.5.2 (9c8e42e7, 2026-07-28; v0.5.0 is the first release with grouped value
  heads, HV > H, which transformers 5.24 relies on: it passes q and k un-repeated), the default Triton
  backend (the FlashQLA backend runs only where the ``flash_qla`` package is installed):
  ``fla/ops/gated_delta_rule/chunk.py`` ``ChunkGatedDeltaRuleFunction`` L253-392, its forward
  ``chunk_gated_delta_rule_fwd`` L33-123 and backward ``chunk_gated_delta_rule_bwd`` L126-250;
  ``fla/modules/l2norm.py`` ``l2norm_fwd`` L147-197 (y in x's dtype, rstd fp32 per row), ``l2norm_bwd``
  L200-251; ``fla/ops/utils/cumsum.py`` ``chunk_local_cumsum_scalar`` L262-296 (fp32 output, L281);
  ``fla/ops/gated_delta_rule/chunk_fwd.py`` ``chunk_gated_delta_rule_fwd_intra`` L332-425 (A in k's
  dtype, L382); ``fla/ops/gated_delta_rule/wy_fast.py`` ``recompute_w_u_fwd`` L251-290,
  ``prepare_wy_repr_bwd`` L294-343; ``fla/ops/common/chunk_delta_h.py`` ``chunk_gated_delta_rule_fwd_h``
  L675-731 (h per chunk in k's dtype, the final state fp32), ``chunk_gated_delta_rule_bwd_dhu`` L735-794;
  ``fla/ops/common/chunk_o.py`` ``chunk_fwd_o`` L531-573, ``chunk_bwd_dv_local`` L634-683,
  ``chunk_bwd_dqkwg`` L687-766; ``fla/utils/_decorators.py`` ``input_guard`` L97-150 (every tensor
  argument ``.contiguous()``, L91-94).
* causal-conv1d v1.6.1.post4 (9e4ace0b, 2026-03-10): ``causal_conv1d/causal_conv1d_interface.py``
  ``CausalConv1dFn`` L9-96; ``causal_conv1d/cpp_functions.py`` ``causal_conv1d_fwd_function`` L94-114
  (``out = empty_like(x)``), ``causal_conv1d_bwd_function`` L117-160 (dx ``empty_like(x)``, the weight's
  and bias's gradients fp32 zeros cast back to their dtype; the deterministic mode's workspaces,
  ``csrc/causal_conv1d.cpp`` L391-430, are off by default).

``fused_mixers(t)`` swaps the two module globals of each supported modeling file for these, around a step
(the forward a checkpoint recomputes included) and around each of ``trace.derive``'s traces.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch

from .errors import TrainmemError
from .spec import TrainingSpec
from .spec.kernel_paths import FUSED_MODULES
from .swaps import swapped

#: fla's chunk length (``chunk_gated_delta_rule``'s ``chunk_size`` default, chunk.py L534)
CHUNK = 64
#: ``chunk_bwd_dqkwg``'s key tile on Hopper (chunk_o.py L717-724: 128 where the device has Hopper's shared
#: memory, 64 on Ada's and Ampere's, 32 below): its fp32 partial gate gradients are (cdiv(K, BK), B, T, HV)
KEY_TILE = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _l2norm_fwd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``l2norm_fwd`` (l2norm.py L147-197): y (x's shape and dtype) and rstd (fp32, one per row)."""
    y = torch.empty_like(x)                                                          # L157
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)          # L168
    return y, rstd


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """fla's ``ChunkGatedDeltaRuleFunction`` (no initial state, no ``cu_seqlens``, g already in log space,
    beta already a sigmoid: transformers' call). q, k: (B, T, H, K); v: (B, T, HV, V); g, beta: (B, T, HV)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                output_final_state: bool, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # input_guard: a copy of each view, which its wrapper's argument list holds until forward returns
        guarded = q, k, v, g, beta = tuple(x.contiguous() for x in (q, k, v, g, beta))
        (B, T, H, K), (HV, V) = q.shape, v.shape[2:]
        q_rstd = k_rstd = None
        if l2norm:                                                       # chunk.py L281-283
            q, q_rstd = _l2norm_fwd(q)
            k, k_rstd = _l2norm_fwd(k)
        g = torch.empty_like(g, dtype=torch.float32)                     # chunk_local_cumsum (cumsum.py L281)
        A = torch.zeros(B, T, HV, CHUNK, dtype=k.dtype, device=k.device)  # kkt + solve_tril (chunk_fwd.py L382)
        w, u = k.new_empty(B, T, HV, K), torch.empty_like(v)             # recompute_w_u_fwd (wy_fast.py L269-270)
        nt = _cdiv(T, CHUNK)
        h = k.new_empty(B, nt, HV, K, V)                                 # chunk_delta_h.py L706: per chunk
        final = (k.new_zeros(B, HV, K, V, dtype=torch.float32)          # L707
                 if output_final_state else None)
        v_new = torch.empty_like(u)                                      # L709
        o = torch.empty_like(v_new)                                      # chunk_fwd_o (chunk_o.py L552)
        del w, u, h, v_new                                               # chunk_gated_delta_rule_fwd returns
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A)      # chunk.py L310-326 (beta_raw is beta)
        ctx.l2norm = l2norm
        del guarded
        return o.to(q.dtype), final                                      # L335

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, dht: Any) -> tuple[Any, ...]:
        q, q_rstd, k, k_rstd, v, g, beta, A = ctx.saved_tensors
        do = do.contiguous()                                             # input_guard
        (B, T, H, K), (HV, V) = q.shape, v.shape[2:]
        nt = _cdiv(T, CHUNK)
        w, u = k.new_empty(B, T, HV, K), torch.empty_like(v)             # recompute_w_u_fwd (chunk.py L147)
        h, v_new = k.new_empty(B, nt, HV, K, V), torch.empty_like(u)     # fwd_h again, no final state (L160)
        dv = torch.empty_like(do)                                        # chunk_bwd_dv_local (chunk_o.py L661)
        dh = q.new_empty(B, nt, HV, K, V)                                # bwd_dhu (chunk_delta_h.py L766)
        dv = torch.empty_like(dv)                                        # its dv2 (L768) replaces dv (chunk.py L202)
        dq, dk = q.new_empty(B, T, HV, K), k.new_empty(B, T, HV, K)      # chunk_bwd_dqkwg (chunk_o.py L726-729)
        dg = torch.empty(_cdiv(K, min(max(1 << (K - 1).bit_length(), 16), KEY_TILE)), *g.shape,
                         dtype=torch.float32, device=g.device)
        dw = torch.empty_like(w)
        if H != HV:                                                      # the grouped heads summed (L761-763)
            dq = dq.view(B, T, H, HV // H, K).sum(3)
            dk = dk.view(B, T, H, HV // H, K).sum(3)
        dg = dg.sum(0)                                                   # L764-765
        dk2 = k.new_empty(B, T, HV, K)                                   # prepare_wy_repr_bwd (wy_fast.py L314-317)
        dv_wy, dg2, db = torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
        if H != HV:
            dk2 = dk2.view(B, T, H, HV // H, K).sum(3)                   # L340-341
        dv = dv_wy                                                       # (the returned dv replaces bwd_dhu's)
        del dv_wy
        dk.add_(dk2)                                                     # chunk.py L244-245
        dg.add_(dg2)
        dg = torch.empty_like(dg, dtype=torch.float32)                   # reverse chunk_local_cumsum (L246)
        del w, u, h, v_new, dh, dw, dk2, dg2                             # chunk_gated_delta_rule_bwd returns
        if ctx.l2norm:                                                   # l2norm_bwd (l2norm.py L212): dx in
            dq = torch.empty_like(q)                                     # y's dtype, one after the other
            dk = torch.empty_like(k)                                     # (chunk.py L383-385)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), None, None


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = CHUNK, initial_state: Any = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` (chunk.py L395-588) as transformers calls it in training."""
    if initial_state is not None or cu_seqlens is not None:
        raise TrainmemError("--mixer-kernels fused models fla's gated delta rule in training (no initial state, "
                            "no packed sequences); drop --mixer-kernels or the packed input")
    return ChunkGatedDeltaRuleFunction.apply(query, key, value, g, beta, bool(output_final_state),
                                             bool(use_qk_l2norm_in_kernel))


class CausalConv1dFunction(torch.autograd.Function):
    """causal-conv1d's ``CausalConv1dFn`` (no seq_idx, no initial or final states). x: (B, C, T), weight
    (C, W), bias (C,) or None."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(2) != 1 and x.stride(1) != 1:                        # interface L24-25
            x = x.contiguous()
        out = torch.empty_like(x)                                        # cpp_functions.py L103 (x's layout)
        ctx.save_for_backward(x, weight, bias)                           # interface L59
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        x, weight, bias = ctx.saved_tensors
        if dout.stride(2) != 1 and dout.stride(1) != 1:                  # L70-71
            dout = dout.contiguous()
        dx = torch.empty_like(x)                                         # cpp_functions.py L133
        dweight = torch.zeros_like(weight, dtype=torch.float32).type_as(weight)   # L134, L157
        dbias = torch.zeros_like(bias, dtype=torch.float32).type_as(bias) if bias is not None else None
        return dx, dweight, dbias


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, **kwargs: Any) -> torch.Tensor:
    """causal-conv1d's ``causal_conv1d_fn`` (interface L99-129; the activation runs inside the kernel)."""
    if kwargs.get("seq_idx") is not None:
        raise TrainmemError("--mixer-kernels fused models causal-conv1d without packed sequences (seq_idx); "
                            "drop --mixer-kernels or the packed input")
    return CausalConv1dFunction.apply(x, weight, bias)


@contextlib.contextmanager
def fused_mixers(t: TrainingSpec) -> Iterator[None]:
    """Under ``--mixer-kernels fused``, each supported modeling file's ``torch_chunk_gated_delta_rule`` and
    ``causal_conv1d_fn`` are these emulations for the duration (restored after); else nothing."""
    if t.mixer_kernels != "fused":
        yield
        return
    swaps = {"torch_chunk_gated_delta_rule": chunk_gated_delta_rule, "causal_conv1d_fn": causal_conv1d_fn}
    modules = [importlib.import_module(f"transformers.models.{n}.modeling_{n}") for n in sorted(set(FUSED_MODULES.values()))]
    with swapped({(mod, name): fn for mod in modules for name, fn in swaps.items()}):
        yield
