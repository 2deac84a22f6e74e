"""mamba-ssm's fused Mamba and Mamba-2 mixers as trace runs them (``--mixer-kernels fused``).

With mamba-ssm and causal-conv1d installed, transformers 5.24's Mamba mixer trains through
``mamba_inner_fn`` and the Mamba-2 mixers (Mamba-2, Bamba, Falcon-H1, Granite 4.0-H, Nemotron-H,
Zamba2) through ``mamba_split_conv1d_scan_combined`` (``spec.kernel_paths.FUSED_FUNCTIONS``): one
``torch.autograd.Function`` each, whose CUDA and Triton kernels cannot run on trace's fake tensors. Each
Function here is an emulation of that Function's memory, as ``liger_modules``' are of Liger's: its
Python body is mamba-ssm's, line for line (the same ``torch`` ops, so the same copies, views and
lifetimes of locals), with each kernel wrapper replaced by the tensors it allocates (``torch.empty``,
``zeros_like``, the ``.sum``/``.to`` it runs after its launch) and the launch itself by nothing.
Values are not computed: trace's tensors have none, and transformers' reference math would allocate
what the kernels never do (Mamba's (b, d, l, n) states). Sources (mamba-ssm v2.2.6.post3, 10b5d635,
2025-10-10; causal-conv1d v1.5.2, 69e6dadc):

* ``MambaInnerFn`` (``mamba_ssm/ops/selective_scan_interface.py`` L184-370, ``checkpoint_lvl=1``, the
  default of ``mamba_inner_fn`` L373-381): saves the contiguous copy of ``xz`` (b, 2d, l), ``x_dbl``
  (b*l, r + 2n), the weights cast to the autocast dtype, ``B`` and ``C`` (b, 1, n, l), the scan's fp32
  intermediates (b, d, ceil(l / 2048), 2n) and its output ``out`` (b, d, l); recomputes the convolution
  and ``delta`` in backward. ``selective_scan_cuda.fwd``/``bwd`` (``csrc/selective_scan/selective_scan.cpp``
  L296-335, L417-491): ``out``, ``out_z`` like ``delta``/``z``; ``du``, ``ddelta``, ``out_z`` and fp32
  ``dB``, ``dC`` returned cast to ``B``'s dtype.
* ``MambaSplitConv1dScanCombinedFn`` (``mamba_ssm/ops/triton/ssd_combined.py`` L767-926) with
  ``_mamba_chunk_scan_combined_fwd``/``_bwd`` (L294-464) and the wrappers of ``ssd_chunk_state.py``
  (L674-855), ``ssd_state_passing.py`` (L194-281), ``ssd_bmm.py`` (L163-262), ``ssd_chunk_scan.py``
  (L1235-1285, L1339-1521, L1647-1677), ``ssd_combined.py`` ``_chunk_scan_chunk_state_bwd_dx`` (L232-293) and
  ``layernorm_gated.py`` (L108-153, L271-335): saves the in-projection's output ``zxbcdt``, the scan's
  output ``out_x`` (b, l, h, p), the gated RMSNorm's fp32 ``rstd`` and the out-projection's weight in the
  autocast dtype; the forward's chunk tensors (fp32 ``dA_cumsum``, ``dt`` (b, h, chunks, chunk), states,
  ``CB`` (b, chunks, g, chunk, chunk)) live only in the forward, and the backward recomputes them.
* causal-conv1d's ``causal_conv1d_fwd_function``/``causal_conv1d_bwd_function`` (``causal_conv1d/
  cpp_functions.py`` L99-160): ``out = empty_like(x)``; fp32 ``dweight``/``dbias`` cast to the weight's dtype.

``swap(model, t)`` puts the emulations in place of the modeling files' functions while a trace's step
runs (the mixers read the module global at each call, also in a checkpoint's recompute).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .errors import TrainmemError
from .spec import TrainingSpec
from .swaps import model_files, swapped

#: selective_scan_cuda's chunk of the sequence whose last state it keeps (selective_scan.cpp L307)
SCAN_CHUNK = 2048


def _autocast() -> tuple[str, torch.dtype] | None:
    """(device type, dtype) of the autocast in force, None when it is off: mamba-ssm reads CUDA's
    (``torch.is_autocast_enabled()``, ``get_autocast_gpu_dtype()``); a trace on the CPU runs CPU autocast."""
    for kind in ("cuda", "cpu"):
        if torch.is_autocast_enabled(kind):
            return kind, torch.get_autocast_dtype(kind)
    return None


@contextlib.contextmanager
def _backward_autocast(ctx: Any) -> Iterator[None]:
    """``custom_bwd``: the backward under the forward's autocast state (torch/amp/autocast_mode.py)."""
    if ctx.autocast is None:
        yield
        return
    with torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]):
        yield


def _conv1d_fwd(x: torch.Tensor) -> torch.Tensor:
    """causal-conv1d's ``causal_conv1d_fwd_function`` (cpp_functions.py L99-114): ``empty_like(x)``."""
    return torch.empty_like(x)


def _conv1d_bwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                dx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``causal_conv1d_bwd_function`` (cpp_functions.py L117-160): dx (given, else ``empty_like(x)``),
    fp32 dweight and dbias cast to the weight's and bias' dtype."""
    dx = torch.empty_like(x) if dx is None else dx
    dweight = torch.zeros_like(weight, dtype=torch.float32)
    dbias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
    dweight = dweight.type_as(weight)
    dbias = dbias.type_as(bias) if dbias is not None else None
    return dx, dweight, dbias


def _rearrange_bdl(t: torch.Tensor, d: int, b: int, length: int) -> torch.Tensor:
    """einops ``"d (b l) -> b d l"``: a reshape (a view of a contiguous (d, b*l)) and a permute."""
    return t.reshape(d, b, length).permute(1, 0, 2)


def _to_d_bl(t: torch.Tensor) -> torch.Tensor:
    """einops ``"b d l -> d (b l)"``: a permute and a reshape (a copy unless ``t`` is such a view)."""
    return t.permute(1, 0, 2).reshape(t.shape[1], -1)


def _to_bl_d(t: torch.Tensor) -> torch.Tensor:
    """einops ``"b d l -> (b l) d"``: a permute and a reshape (a copy of a contiguous (b, d, l))."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])


# ----- Mamba: MambaInnerFn ------------------------------------------------------------------------------
def _scan_fwd(delta: torch.Tensor, A: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``selective_scan_cuda.fwd`` (selective_scan.cpp L296-335): ``out`` like delta, the fp32
    intermediates (b, d, chunks of 2048, 2n), ``out_z`` like z."""
    b, d, length = delta.shape
    out = torch.empty_like(delta)
    x = torch.empty(b, d, math.ceil(length / SCAN_CHUNK), A.shape[-1] * 2, dtype=A.dtype, device=delta.device)
    out_z = torch.empty_like(z)
    return out, x, out_z


def _scan_bwd(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor | None, delta_bias: torch.Tensor | None, out: torch.Tensor,
              dz: torch.Tensor) -> tuple[Any, ...]:
    """``selective_scan_cuda.bwd`` with z and ``recompute_out_z`` (selective_scan.cpp L417-491): dz given;
    ``out_z``, ``du``, ``ddelta`` allocated; fp32 ``dB``, ``dC`` (variable B, C) returned in B's dtype."""
    out_z = torch.empty_like(out)
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dA = torch.zeros_like(A)
    dB = torch.zeros_like(B, dtype=torch.float32)
    dC = torch.zeros_like(C, dtype=torch.float32)
    dD = torch.zeros_like(D) if D is not None else None
    ddelta_bias = torch.zeros_like(delta_bias) if delta_bias is not None else None
    return du, ddelta, dA, dB.to(B.dtype), dC.to(C.dtype), dD, ddelta_bias, dz, out_z


class MambaInnerFn(torch.autograd.Function):
    """``MambaInnerFn`` with input-dependent B and C, no B/C/dt norms, ``checkpoint_lvl=1`` (the call of
    transformers' Mamba mixer): see the module docstring."""

    @staticmethod
    def forward(ctx: Any, xz: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                x_proj_weight: torch.Tensor, delta_proj_weight: torch.Tensor, out_proj_weight: torch.Tensor,
                out_proj_bias: torch.Tensor | None, A: torch.Tensor, D: torch.Tensor | None,
                delta_bias: torch.Tensor | None) -> torch.Tensor:
        ctx.autocast = _autocast()                                  # custom_fwd: backward runs under it
        L = xz.shape[-1]
        delta_rank = delta_proj_weight.shape[1]
        d_state = A.shape[-1]
        if ctx.autocast is not None:                                  # L200-205
            amp = ctx.autocast[1]
            x_proj_weight = x_proj_weight.to(dtype=amp)
            delta_proj_weight = delta_proj_weight.to(dtype=amp)
            out_proj_weight = out_proj_weight.to(dtype=amp)
            out_proj_bias = out_proj_bias.to(dtype=amp) if out_proj_bias is not None else None
        if xz.stride(-1) != 1:
            xz = xz.contiguous()                                      # L206-207: (b, 2d, l)
        conv1d_weight = conv1d_weight.squeeze(1)                      # "d 1 w -> d w"
        x, z = xz.chunk(2, dim=1)
        conv1d_out = _conv1d_fwd(x)                                   # (b, d, l)
        x_dbl = F.linear(_to_bl_d(conv1d_out), x_proj_weight)         # (b*l, r + 2n)
        delta = _rearrange_bdl(delta_proj_weight @ x_dbl[:, :delta_rank].t(), -1, xz.shape[0], L)
        B = x_dbl[:, delta_rank:delta_rank + d_state].reshape(-1, L, d_state).permute(0, 2, 1).unsqueeze(1)
        B = B.contiguous()                                            # L229: (b, 1, n, l)
        C = x_dbl[:, -d_state:].reshape(-1, L, d_state).permute(0, 2, 1).unsqueeze(1).contiguous()  # L241
        D = D.contiguous() if D is not None else None
        out, scan_intermediates, out_z = _scan_fwd(delta, A, z)      # L263-265
        ctx.out_proj_bias_is_None = out_proj_bias is None
        conv1d_out, delta = None, None                                # L273-274: recomputed in backward
        ctx.save_for_backward(xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight,
                              out_proj_weight, A, B, C, D, delta_bias, scan_intermediates, out)
        return F.linear(out_z.permute(0, 2, 1), out_proj_weight, out_proj_bias)   # L278

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        with _backward_autocast(ctx):
            return _mamba_inner_bwd(ctx, dout)


def _mamba_inner_bwd(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
    """``MambaInnerFn.backward`` (L282-370) at ``checkpoint_lvl=1``."""
    (xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight, out_proj_weight,
     A, B, C, D, delta_bias, scan_intermediates, out) = ctx.saved_tensors
    L, b, d = xz.shape[-1], xz.shape[0], xz.shape[1] // 2
    delta_rank = delta_proj_weight.shape[1]
    d_state = A.shape[-1]
    x, z = xz.chunk(2, dim=1)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    conv1d_out = _conv1d_fwd(x)                                       # L294-296 (recomputed)
    delta = _rearrange_bdl(delta_proj_weight @ x_dbl[:, :delta_rank].t(), d, b, L)   # L297-298
    dxz = torch.empty_like(xz)                                        # L320
    dx, dz = dxz.chunk(2, dim=1)
    dout = dout.reshape(-1, dout.shape[-1]).t()                       # "b l e -> e (b l)"
    dout_y = _rearrange_bdl(out_proj_weight.t() @ dout, d, b, L)      # L323
    dconv1d_out, ddelta, dA, dB, dC, dD, ddelta_bias, dz, out_z = _scan_bwd(
        conv1d_out, delta, A, B, C, D, delta_bias, out, dz)           # L324-328
    dout_proj_weight = torch.einsum("eB,dB->ed", dout, _to_d_bl(out_z))
    dout_proj_bias = dout.sum(dim=(0, 1)) if not ctx.out_proj_bias_is_None else None
    dx_dbl = torch.empty_like(x_dbl)                                  # L332
    dB = dB.squeeze(1).permute(0, 2, 1).reshape(-1, d_state).contiguous()   # L336: (b*l, n)
    dx_dbl[:, delta_rank:delta_rank + d_state] = dB
    dB = None
    dC = dC.squeeze(1).permute(0, 2, 1).reshape(-1, d_state).contiguous()   # L346
    dx_dbl[:, -d_state:] = dC
    dC = None
    ddelta = _to_d_bl(ddelta)                                         # L351
    ddelta_proj_weight = torch.einsum("dB,Br->dr", ddelta, x_dbl[:, :delta_rank])
    dx_dbl[:, :delta_rank] = torch.einsum("dB,dr->Br", ddelta, delta_proj_weight)
    dconv1d_out = _to_d_bl(dconv1d_out)                               # L354
    dx_proj_weight = torch.einsum("Br,Bd->rd", dx_dbl, _to_bl_d(conv1d_out))
    dconv1d_out = torch.addmm(dconv1d_out, x_proj_weight.t(), dx_dbl.t(), out=dconv1d_out)
    dconv1d_out = _rearrange_bdl(dconv1d_out, d, b, L)
    dx, dconv1d_weight, dconv1d_bias = _conv1d_bwd(x, conv1d_weight, conv1d_bias, dx)   # L360-362
    return (dxz, dconv1d_weight.unsqueeze(1), dconv1d_bias, dx_proj_weight, ddelta_proj_weight,
            dout_proj_weight, dout_proj_bias, dA, dD, ddelta_bias if delta_bias is not None else None)


def mamba_inner_fn(xz: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                   x_proj_weight: torch.Tensor, delta_proj_weight: torch.Tensor, out_proj_weight: torch.Tensor,
                   out_proj_bias: torch.Tensor | None, A: torch.Tensor, B: Any = None, C: Any = None,
                   D: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
                   delta_softplus: bool = True, b_rms_weight: Any = None, c_rms_weight: Any = None,
                   dt_rms_weight: Any = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ``mamba_inner_fn`` (models/mamba/modeling_mamba.py L104-125) as mamba-ssm's runs it."""
    if B is not None or C is not None or any(w is not None for w in (b_rms_weight, c_rms_weight, dt_rms_weight)):
        raise TrainmemError("--mixer-kernels fused models MambaInnerFn with input-dependent B and C and no "
                            "B/C/dt norms (transformers' Mamba mixer): drop --mixer-kernels")
    return MambaInnerFn.apply(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                              out_proj_weight, out_proj_bias, A, D, delta_bias)


# ----- Mamba-2: the SSD kernels' wrappers (mamba_ssm/ops/triton/*.py) ------------------------------------
def _sm_count(t: torch.Tensor) -> int:
    """``torch.cuda.get_device_properties(x.device).multi_processor_count``, as the wrappers read it (trace's
    CUDA emulation answers for its device); 132, an H100's, off CUDA."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.device.type == "cuda" else 132


def _chunk_cumsum_fwd(dt: torch.Tensor, nheads: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_chunk_state.py L674-697: fp32 ``dA_cumsum`` and ``dt_out``, (b, h, chunks, chunk)."""
    batch, seqlen = dt.shape[:2]
    shape = (batch, nheads, math.ceil(seqlen / chunk_size), chunk_size)
    dt_out = torch.empty(shape, device=dt.device, dtype=torch.float32)
    dA_cumsum = torch.empty(shape, device=dt.device, dtype=torch.float32)
    return dA_cumsum, dt_out


def _chunk_state_fwd(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """ssd_chunk_state.py L737-767 (``states_in_fp32``): fp32 (b, chunks, h, p, n)."""
    batch, _, nheads, headdim = x.shape
    return torch.empty((batch, dt.shape[2], nheads, headdim, B.shape[-1]), device=x.device, dtype=torch.float32)


def _state_passing_fwd(states: torch.Tensor, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """ssd_state_passing.py L194-222: ``out`` (b, chunks, h, p*n) in ``out_dtype`` (states'), fp32 final."""
    batch, nchunks, nheads, dim = states.shape
    out = torch.empty((batch, nchunks, nheads, dim), device=states.device, dtype=out_dtype or states.dtype)
    final_states = torch.empty((batch, nheads, dim), device=states.device, dtype=torch.float32)
    return out, final_states


def _bmm_chunk_fwd(a: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """ssd_bmm.py L163-208 (grouped, fp32 out): (b, chunks, g, chunk, chunk)."""
    batch, seqlen, ngroups, _ = a.shape
    if a.stride(-1) != 1 and a.stride(1) != 1:
        a = a.contiguous()
    return torch.empty((batch, math.ceil(seqlen / chunk_size), ngroups, chunk_size, chunk_size),
                       device=a.device, dtype=torch.float32)


def _bmm_chunk_bwd(a: torch.Tensor, dout: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """ssd_bmm.py L211-262 with ``out`` given: only the operands' contiguous copies (freed at return)."""
    if a.stride(-1) != 1 and a.stride(-2) != 1:
        a = a.contiguous()
    if dout.stride(-1) != 1 and dout.stride(-2) != 1:
        dout = dout.contiguous()
    if residual.stride(-1) != 1 and residual.stride(1) != 1:
        residual = residual.contiguous()
    return out


def _chunk_scan_fwd(x: torch.Tensor, z: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ssd_chunk_scan.py L1235-1285: ``out`` (b, l, h, p) in x's dtype, and ``out_x`` with z."""
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    out_x = torch.empty(x.shape, device=x.device, dtype=x.dtype) if z is not None else None
    return out, out_x


def _partial_sum(parts: torch.Tensor, dims: Any, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's fp32 partials summed over ``dims`` and cast (``dD[:n].sum(dim=(0, 1, 2)).to(D.dtype)``,
    ``ddA[..., :n].sum(dim=-1)``)."""
    return parts.sum(dim=dims).to(dtype=dtype)


def _dD_parts(D: torch.Tensor, batch: int, nchunks: int, chunk_size: int) -> torch.Tensor:
    """The fp32 partials of dD (``BLOCK_SIZE_min = 32``: ssd_chunk_scan.py L1351-1353, ssd_combined.py L248-250)."""
    return torch.empty(math.ceil(chunk_size / 32), batch, nchunks, D.shape[0], D.shape[1] if D.dim() == 2 else 1,
                       device=D.device, dtype=torch.float32)


def _reduce_dD(parts: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    dD = _partial_sum(parts, (0, 1, 2), D.dtype)
    return dD.squeeze(-1) if D.dim() == 1 else dD                    # "h 1 -> h"


def _chunk_scan_bwd_dz(x: torch.Tensor, z: torch.Tensor, dout: torch.Tensor, chunk_size: int, D: torch.Tensor,
                       dz: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """ssd_chunk_scan.py L1339-1396 (``has_ddAcs=False``, dz given, ``recompute_output``): dD's partials,
    ``outz`` and ``dout_x`` like x and dout."""
    batch, seqlen = x.shape[:2]
    parts = _dD_parts(D, batch, math.ceil(seqlen / chunk_size), chunk_size)
    outz = torch.empty_like(x)
    dout_x = torch.empty_like(dout)
    return dz, dout_x, _reduce_dD(parts, D), outz


def _chunk_scan_bwd_dstates(dout: torch.Tensor, dA_cumsum: torch.Tensor, dstate: int, dtype: torch.dtype) -> torch.Tensor:
    """ssd_chunk_scan.py L1399-1424: (b, chunks, h, p, n) in ``dtype``."""
    batch, _, nheads, headdim = dout.shape
    return torch.empty(batch, dA_cumsum.shape[2], nheads, headdim, dstate, device=dout.device, dtype=dtype)


def _state_passing_bwd(states: torch.Tensor, dout: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """ssd_state_passing.py L225-281 (``dstates_dtype`` = ``states_dtype`` = x's, no initial states):
    dstates and the converted states in ``dtype``, the fp32 ddA partials (``BLOCK_SIZE_min = 64``) summed."""
    batch, nchunks, nheads, dim = states.shape
    dstates = torch.empty_like(dout, dtype=dtype)
    states_converted = torch.empty_like(states, dtype=dtype) if dtype != states.dtype else states
    ddA_chunk_cumsum = torch.empty(batch, nheads, nchunks, math.ceil(dim / 64), dtype=torch.float32,
                                   device=states.device)
    ddA_chunk_cumsum = _partial_sum(ddA_chunk_cumsum, -1, torch.float32)
    return dstates, ddA_chunk_cumsum, None, states_converted


def _split_count(batch: int, nchunks: int, nheads: int, ngroups: int, t: torch.Tensor) -> int:
    """``nsplits`` of the dB, dC and dCB kernels (ssd_chunk_state.py L825-827, ssd_chunk_scan.py L1446-1448)."""
    ratio = nheads // ngroups
    per_program = max(min(math.ceil(batch * nchunks * nheads / _sm_count(t)), ratio), 1)
    return math.ceil(ratio / per_program)


def _grouped_grad(x: torch.Tensor, nchunks: int, chunk_size: int, ngroups: int, dstate: int) -> tuple[torch.Tensor, ...]:
    """``_chunk_state_bwd_db`` (ssd_chunk_state.py L805-855) and ``_chunk_scan_bwd_dC`` (ssd_chunk_scan.py
    L1427-1469) with B / C given: fp32 ddA (b, h, chunks, chunk) and fp32 (b, l, splits, g, n) partials
    summed over the splits."""
    batch, seqlen, nheads, _ = x.shape
    ddA = torch.empty(batch, nheads, nchunks, chunk_size, device=x.device, dtype=torch.float32)
    splits = _split_count(batch, nchunks, nheads, ngroups, x)
    grad = torch.empty(batch, seqlen, splits, ngroups, dstate, device=x.device, dtype=torch.float32)
    grad = grad.sum(2)
    return grad, ddA


def _chunk_scan_bwd_dcb(x: torch.Tensor, nchunks: int, chunk_size: int, ngroups: int) -> torch.Tensor:
    """ssd_chunk_scan.py L1472-1520 (CB not given): fp32 (b, chunks, splits, g, chunk, chunk) summed."""
    batch, _, nheads, _ = x.shape
    splits = _split_count(batch, nchunks, nheads, ngroups, x)
    dcb = torch.empty(batch, nchunks, splits, ngroups, chunk_size, chunk_size, device=x.device, dtype=torch.float32)
    return dcb.sum(2)


def _chunk_scan_bwd_ddAcs_stable(x: torch.Tensor, nchunks: int, chunk_size: int) -> torch.Tensor:
    """ssd_chunk_scan.py L1647-1677 (``BLOCK_SIZE_M_min = 32``): fp32 partials summed to (b, h, chunks, chunk)."""
    batch, _, nheads, _ = x.shape
    parts = torch.empty(batch, nheads, nchunks, math.ceil(chunk_size / 32), chunk_size, device=x.device,
                        dtype=torch.float32)
    return parts.sum(dim=3)


def _chunk_scan_chunk_state_bwd_dx(x: torch.Tensor, D: torch.Tensor, nchunks: int, chunk_size: int,
                                   dx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """ssd_combined.py L232-293 with dx given: dD's fp32 partials, an fp32 ddt (b, h, chunks, chunk)."""
    parts = _dD_parts(D, x.shape[0], nchunks, chunk_size)
    ddt = torch.empty(x.shape[0], x.shape[2], nchunks, chunk_size, device=x.device, dtype=torch.float32)
    return dx, ddt, _reduce_dD(parts, D)


def _combined_fwd(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
                  z: torch.Tensor | None) -> tuple[Any, ...]:
    """``_mamba_chunk_scan_combined_fwd`` (ssd_combined.py L294-345, no initial states)."""
    nheads, dstate = x.shape[2], B.shape[-1]
    if B.stride(-1) != 1:
        B = B.contiguous()                                            # L309-310
    if C.stride(-1) != 1:
        C = C.contiguous()
    if x.stride(-1) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    if z is not None and z.stride(-1) != 1 and z.stride(1) != 1:
        z = z.contiguous()
    dA_cumsum, dt = _chunk_cumsum_fwd(dt, nheads, chunk_size)
    states = _chunk_state_fwd(B, x, dt)
    states, final_states = _state_passing_fwd(states.flatten(-2), out_dtype=C.dtype)
    states, final_states = states.unflatten(-1, (-1, dstate)), final_states.unflatten(-1, (-1, dstate))
    CB = _bmm_chunk_fwd(C, chunk_size)
    out, out_x = _chunk_scan_fwd(x, z)
    return out, out_x, dt, dA_cumsum, states, final_states


def _combined_bwd(dout: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, chunk_size: int, D: torch.Tensor, z: torch.Tensor | None, dt_bias: torch.Tensor,
                  dx: torch.Tensor, ddt: torch.Tensor, dB: torch.Tensor, dC: torch.Tensor,
                  dz: torch.Tensor | None) -> tuple[Any, ...]:
    """``_mamba_chunk_scan_combined_bwd`` (ssd_combined.py L347-464) with dx, ddt, dB, dC (and dz) given,
    no initial or final states, ``recompute_output`` when z is given (the out-projection's input)."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dB_given, dC_given, ddt_given = dB, dC, ddt
    nchunks, ngroups, dstate = math.ceil(x.shape[1] / chunk_size), B.shape[2], B.shape[-1]
    dt_in = dt.clone()                                                # L397
    dA_cumsum, dt = _chunk_cumsum_fwd(dt_in, x.shape[2], chunk_size)
    CB = _bmm_chunk_fwd(C, chunk_size)
    states = _chunk_state_fwd(B, x, dt)
    states, _ = _state_passing_fwd(states.flatten(-2))                # fp32 (out_dtype not given)
    states = states.unflatten(-1, (-1, dstate))
    outz = None
    if z is not None:                                                 # L407-409
        dz, dout, dD, outz = _chunk_scan_bwd_dz(x, z, dout, chunk_size, D, dz)
    dstates = _chunk_scan_bwd_dstates(dout, dA_cumsum, dstate, states.dtype)
    dstates, ddA_chunk_cumsum, dinitial_states, states = _state_passing_bwd(
        states.flatten(-2), dstates.flatten(-2), x.dtype)            # L416-426
    states = states.unflatten(-1, (-1, dstate))
    dstates = dstates.unflatten(-1, (-1, dstate))
    dx, ddt, dD_from_x = _chunk_scan_chunk_state_bwd_dx(x, D, nchunks, chunk_size, dx)   # L434
    dB, ddA_next = _grouped_grad(x, nchunks, chunk_size, ngroups, dstate)      # L436
    dC, ddA_cumsum_prev = _grouped_grad(x, nchunks, chunk_size, ngroups, dstate)   # L438
    dCB = _chunk_scan_bwd_dcb(x, nchunks, chunk_size, ngroups)       # L440
    _bmm_chunk_bwd(C, dCB, residual=dB, out=dB_given)                 # L443-444
    _bmm_chunk_bwd(B, dCB.transpose(-1, -2), residual=dC, out=dC_given)
    if z is None:
        dD = dD_from_x
    ddA_cumsum_prev[..., -1] += ddA_chunk_cumsum
    ddA_prev = ddA_cumsum_prev.flip([-1]).cumsum(dim=-1).flip([-1])   # L456
    ddA = _chunk_scan_bwd_ddAcs_stable(x, nchunks, chunk_size)
    ddA += ddA_next + ddA_prev
    ddt_bias = torch.empty_like(dt_bias, dtype=torch.float32)         # _chunk_cumsum_bwd (ddt given)
    dA = torch.empty_like(A, dtype=torch.float32)
    return (dx, ddt_given, dA, dB_given, dC_given, dD, dz, ddt_bias, dinitial_states, outz)


def _layer_norm_fwd(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, None, torch.Tensor]:
    """layernorm_gated.py ``_layer_norm_fwd`` (L108-153), RMS, ``out`` not given: ``empty_like(x)`` and an
    fp32 rstd per row and group."""
    M, N = x.shape
    out = torch.empty_like(x)
    rstd = torch.empty((N // group_size * M,), dtype=torch.float32, device=x.device)
    return out, None, rstd


def _layer_norm_bwd(x: torch.Tensor, weight: torch.Tensor, group_size: int, dz: torch.Tensor,
                    out: torch.Tensor) -> tuple[Any, ...]:
    """layernorm_gated.py ``_layer_norm_bwd`` (L271-335), RMS, dz and the recomputed ``out`` given: dx like
    x and the weight's fp32 partials, ``nrow_groups`` = ceil(SMs * ceil(4 / warps) / groups) rows of N,
    summed and cast to the weight's dtype."""
    M, N = x.shape
    dx = torch.empty_like(x)
    block_n = min(65536 // x.element_size(), 1 << max(group_size - 1, 0).bit_length())
    num_warps = min(max(block_n // 256, 1), 8)
    nrow_groups = math.ceil(_sm_count(x) * math.ceil(4 / num_warps) / (N // group_size))
    _dw = torch.empty((nrow_groups, N), dtype=torch.float32, device=weight.device)
    dw = _dw.sum(0).to(weight.dtype)
    return dx, dw, None, dz, out


def _update_stride(t: torch.Tensor) -> torch.Tensor:
    """``rearrange_and_update_stride`` (ssd_combined.py L53-56, dim 2): a copy unless stride(2) % 8 == 0."""
    return t.contiguous() if t.stride(2) % 8 != 0 else t


def _split_dims(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, D: torch.Tensor, headdim: int | None,
                ngroups: int) -> tuple[int, int, int, int]:
    """(heads, head dim, d_inner, state) of the mixer, as ssd_combined.py L775-787 reads them; transformers'
    mixers project no non-SSM part (``d_nonssm`` 0)."""
    nheads, headdim = (D.shape[0], headdim) if D.dim() == 1 else D.shape
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    if zxbcdt.shape[-1] != 2 * dim + 2 * ngroups * dstate + nheads:
        raise TrainmemError("--mixer-kernels fused models mamba_split_conv1d_scan_combined without a non-SSM "
                            "part of the projection (transformers' Mamba-2 mixers): drop --mixer-kernels")
    return nheads, headdim, dim, dstate


def _conv_split(xBC: torch.Tensor, dim: int, ngroups: int, dstate: int, nheads: int) -> tuple[torch.Tensor, ...]:
    """The causal convolution of xBC (channels last) and its x, B, C views (ssd_combined.py L790-798)."""
    xBC_conv = _conv1d_fwd(_update_stride(xBC.transpose(1, 2))).transpose(1, 2)
    x, B, C = torch.split(xBC_conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    return (x.unflatten(-1, (nheads, -1)), B.unflatten(-1, (ngroups, dstate)),
            C.unflatten(-1, (ngroups, dstate)))


class SplitConv1dScanCombinedFn(torch.autograd.Function):
    """``MambaSplitConv1dScanCombinedFn`` (ssd_combined.py L767-926) without initial states, ``seq_idx`` or a
    non-SSM part, with an out-projection, its gated RMSNorm or (Falcon-H1 without ``mamba_rms_norm``) the
    scan's own z gate: see the module docstring."""

    @staticmethod
    def forward(ctx: Any, zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, chunk_size: int,
                rmsnorm_weight: torch.Tensor | None, outproj_weight: torch.Tensor,
                outproj_bias: torch.Tensor | None, headdim: int | None, ngroups: int) -> torch.Tensor:
        ctx.autocast = _autocast()
        nheads, headdim, dim, dstate = _split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
        batch, seqlen, _ = zxbcdt.shape
        z, xBC, dt = torch.split(zxbcdt, [dim, dim + ngroups * dstate * 2, nheads], dim=-1)
        x, B, C = _conv_split(xBC, dim, ngroups, dstate, nheads)     # L789-798
        z = z.unflatten(-1, (nheads, -1))
        rstd = None
        if rmsnorm_weight is None:                                    # L799-804
            out, out_x, dt_out, dA_cumsum, states, final_states = _combined_fwd(x, dt, B, C, chunk_size, z)
            out = out.flatten(-2)
        else:                                                         # L806-825
            out_x, _, dt_out, dA_cumsum, states, final_states = _combined_fwd(x, dt, B, C, chunk_size, None)
            x_rms = out_x.reshape(batch * seqlen, dim)
            z_rms = z.reshape(batch * seqlen, dim)
            rmsnorm_weight = rmsnorm_weight.contiguous()
            out, _, rstd = _layer_norm_fwd(x_rms, dim // ngroups)
            out = out.reshape(batch, seqlen, -1)
        if ctx.autocast is not None:                                  # L826-832
            amp = ctx.autocast[1]
            out, outproj_weight = out.to(amp), outproj_weight.to(amp)
            outproj_bias = outproj_bias.to(amp) if outproj_bias is not None else None
        out = F.linear(out, outproj_weight, outproj_bias)
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, rmsnorm_weight, rstd,
                              outproj_weight, outproj_bias)          # L835-836
        ctx.chunk_size, ctx.headdim, ctx.ngroups = chunk_size, headdim, ngroups
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        with _backward_autocast(ctx):
            grads = _split_conv1d_bwd(ctx, dout)
        return (*grads, None, None)


def _split_conv1d_bwd(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
    """``MambaSplitConv1dScanCombinedFn.backward`` (ssd_combined.py L849-926); the gradients of the Function's
    inputs up to ``outproj_bias``."""
    zxbcdt, conv1d_weight, conv1d_bias, out, A, D, dt_bias, rmsnorm_weight, rstd, outproj_weight, outproj_bias = \
        ctx.saved_tensors
    ngroups, headdim = ctx.ngroups, ctx.headdim
    nheads, headdim, dim, dstate = _split_dims(zxbcdt, conv1d_weight, D, headdim, ngroups)
    out_recompute = torch.empty(*out.shape[:2], dim, device=out.device, dtype=out.dtype)   # L859-861
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    x, B, C = _conv_split(xBC, dim, ngroups, dstate, nheads)         # L863-872 (recomputed)
    dzxbcdt = torch.empty_like(zxbcdt)
    dz, dxBC_given, ddt_given = torch.split(dzxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    dxBC = torch.empty_like(xBC)                                      # L875
    dx, dB, dC = torch.split(dxBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    z = z.unflatten(-1, (nheads, -1))
    dx, dB, dC = dx.unflatten(-1, (nheads, -1)), dB.unflatten(-1, (ngroups, dstate)), dC.unflatten(-1, (ngroups, dstate))
    dout_og = dout
    dout = F.linear(dout, outproj_weight.t())                         # L883-885
    dout = dout.unflatten(-1, (-1, headdim))
    if rmsnorm_weight is None:                                        # L890-895
        dz = dz.unflatten(-1, (nheads, -1))
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states, outz = _combined_bwd(
            dout, x, dt, A, B, C, ctx.chunk_size, D, z, dt_bias, dx, ddt_given, dB, dC, dz)
        out_for_linear = outz.flatten(-2)
        drmsnorm_weight = None
    else:                                                             # L896-910
        batch = dout.shape[0]
        dy_rms = dout.reshape(-1, dim)
        dz = dz.reshape(-1, dim)
        x_rms, z_rms = out.reshape(-1, dim), z.reshape(-1, dim)
        out1_recompute = out_recompute.reshape(-1, dim)
        dout, drmsnorm_weight, _, dz, *rest = _layer_norm_bwd(x_rms, rmsnorm_weight, dim // ngroups, dz, out1_recompute)
        out_for_linear = out_recompute
        dout = dout.reshape(batch, -1, nheads, headdim)
        dx, ddt, dA, dB, dC, dD, _, ddt_bias, dinitial_states, _ = _combined_bwd(
            dout, x, dt, A, B, C, ctx.chunk_size, D, None, dt_bias, dx, ddt_given, dB, dC, None)
    doutproj_weight = torch.einsum("bso,bsd->od", dout_og, out_for_linear)   # L912
    doutproj_bias = dout_og.sum(dim=(0, 1)) if outproj_bias is not None else None
    dxBC_given = dxBC_given.transpose(1, 2)
    dxBC_given_update, dweight, dbias = _conv1d_bwd(_update_stride(xBC.transpose(1, 2)), conv1d_weight,
                                                    conv1d_bias, _update_stride(dxBC_given))   # L917-920
    if dxBC_given.stride() != dxBC_given_update.stride():
        dxBC_given.copy_(dxBC_given_update)
    return dzxbcdt, dweight, dbias, ddt_bias, dA, dD, None, drmsnorm_weight, doutproj_weight, doutproj_bias


def split_conv1d_scan_combined(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                               dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, chunk_size: int,
                               initial_states: Any = None, seq_idx: Any = None, dt_limit: Any = None,
                               return_final_states: bool = False, activation: str = "silu",
                               rmsnorm_weight: torch.Tensor | None = None, rmsnorm_eps: float = 1e-6,
                               outproj_weight: torch.Tensor | None = None, outproj_bias: torch.Tensor | None = None,
                               headdim: int | None = None, ngroups: int = 1, norm_before_gate: bool = True,
                               **kwargs: Any) -> torch.Tensor:
    """transformers' ``mamba2_split_conv1d_scan_combined`` (models/mamba2/modeling_mamba2.py L170-192) as
    mamba-ssm's ``mamba_split_conv1d_scan_combined`` (ssd_combined.py L928-947) runs it."""
    if initial_states is not None or return_final_states or outproj_weight is None:
        raise TrainmemError("--mixer-kernels fused models mamba_split_conv1d_scan_combined with an out-projection, "
                            "no initial or final states (transformers' Mamba-2 training forward): drop --mixer-kernels")
    return SplitConv1dScanCombinedFn.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                           rmsnorm_weight, outproj_weight, outproj_bias, headdim, ngroups)


#: the emulation of each function named in ``spec.kernel_paths.FUSED_FUNCTIONS``
EMULATIONS = {"mamba_inner_fn": mamba_inner_fn, "mamba2_split_conv1d_scan_combined": split_conv1d_scan_combined}


@contextlib.contextmanager
def swap(model: nn.Module, t: TrainingSpec) -> Iterator[None]:
    """``--mixer-kernels fused``: the modeling files' fused function (``FUSED_FUNCTIONS``) is its emulation
    while the step runs; a no-op otherwise."""
    if t.mixer_kernels != "fused":
        yield
        return
    files = model_files(model, EMULATIONS)
    with swapped({(f, name): EMULATIONS[name] for f in files for name in EMULATIONS if hasattr(f, name)}):
        yield
