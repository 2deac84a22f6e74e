"""Liger-Kernel's autograd Functions as trace runs them (``--liger``, ``--loss fused``).

Liger-Kernel (linkedin/Liger-Kernel, https://github.com/linkedin/Liger-Kernel) replaces transformers'
modules with Triton kernels wrapped in ``torch.autograd.Function``s. Triton cannot run on trace's fake
tensors, so each Function here is an emulation of the kernel's memory, as trace's CUDA emulation is
of CUDA's kernels: it allocates what Liger's Python code allocates (``torch.empty``, ``zeros_like``,
the matmuls of the fused loss), saves exactly what its ``ctx.save_for_backward`` saves, and stands
for each Triton launch (which writes into tensors already allocated and allocates nothing) by
nothing. Values are not computed (trace's tensors have none). Sources, at v0.6.4 (0a627007,
2025-11-21) unless a release is named:

* ``LigerRMSNormFunction`` (``ops/rms_norm.py`` L527-580; ``rms_norm_forward`` L373-438,
  ``rms_norm_backward`` L441-524): saves ``(X, W, RSTD)``, RSTD fp32 per row; backward's dX is dY
  itself (in_place, the Llama patch's default), dW the sum of (sm_count, h) fp32 partials.
* ``LigerSiLUMulFunction`` (``ops/swiglu.py`` L60-118): saves ``(a, b)``; ``c = empty_like(a)``;
  backward writes da, db over a, b and returns them.
* ``LigerRopeFunction`` (``ops/rope.py`` L115-239): in place on q and k (their (b, s, heads, d)
  storage, ``contiguous()`` a no-op on a projection's output), saves ``(cos, sin)``; backward
  transposes dq, dk to (b, s, heads, d) and makes them contiguous (a copy when they are not).
* ``LigerFusedLinearCrossEntropyFunction`` (``ops/fused_linear_cross_entropy.py`` L16-228,
  L231-276, L278-370): the loss and both gradients in forward over chunks of
  ``next_power_of_2(ceil(BT / ceil(V / H)))`` tokens, the weight gradient accumulated as the
  release does (``TrainingSpec.liger_version``: addmm in place before 0.6.2, ``+= mm(...).float()``
  from 0.6.2, addmm with ``out_dtype=float32`` from 0.8.1 for an fp32 gradient of half logits);
  saves ``(grad_input, grad_weight)``; backward scales them in place and returns them.

``apply(model, t)`` patches the built model's instance as ``_apply_liger_kernel_to_instance`` /
``apply_liger_kernel_to_llama(model=...)`` does (``transformers/monkey_patch.py`` L219-295): each
RMSNorm's and MLP's ``forward`` and, for ``--loss fused``, the causal LM's ``forward``
(``lce_forward``, ``transformers/model/llama.py``); RoPE is a module global of the modeling file
(``modeling_llama.apply_rotary_pos_emb = liger_rotary_pos_emb``), patched by ``rope(t)`` around a
step only.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .errors import TrainmemError
from .spec import TrainingSpec
from .swaps import model_files, swapped

IGNORE_INDEX = -100


# ----- RMSNorm ------------------------------------------------------------------------------------------
class RMSNormFunction(torch.autograd.Function):
    """``LigerRMSNormFunction`` (casting_mode llama, in_place=True): see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])                     # ensure_contiguous; X.view(-1, dim)
        y = torch.empty((x2.shape[0], x2.shape[1]), dtype=x.dtype, device=x.device)   # L386
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)         # L389-390
        ctx.save_for_backward(x2, w, rstd)                          # L563
        return y.view(*shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x2, w, rstd = ctx.saved_tensors
        dy = dy.contiguous()
        # (sm_count, h) fp32 partials (L454; one row here: the device's SM count is not modelled, a few MiB)
        partial = torch.empty((1, x2.shape[1]), dtype=torch.float32, device=w.device)
        dw = partial.sum(dim=0).to(w.dtype)                         # L522
        return dy, dw                                               # dX = dY (in place, L461-462)


def rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LigerRMSNorm.forward`` (transformers/rms_norm.py L32-41) over a transformers RMSNorm's weight."""
    return RMSNormFunction.apply(hidden_states, self.weight)


# ----- SwiGLU -------------------------------------------------------------------------------------------
class SiLUMulFunction(torch.autograd.Function):
    """``LigerSiLUMulFunction``: see the module docstring."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = torch.empty_like(a)                                     # swiglu_forward L66
        ctx.save_for_backward(a, b)                                 # L108
        return c

    @staticmethod
    def backward(ctx: Any, dc: torch.Tensor) -> tuple[Any, ...]:
        a, b = ctx.saved_tensors
        dc.contiguous()  # (ensure_contiguous: a no-op on down_proj's input gradient)
        return a, b      # the kernel wrote da and db over a and b (swiglu_backward L83-100)


def swiglu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LigerSwiGLUMLP.forward`` (transformers/swiglu.py L18-19) over a transformers MLP's linears."""
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


# ----- RoPE ---------------------------------------------------------------------------------------------
class RopeFunction(torch.autograd.Function):
    """``LigerRopeFunction``: see the module docstring."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()   # rope_forward L118-132
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)                                         # L226
        return q.transpose(1, 2), k.transpose(1, 2)                             # rotated in place

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> tuple[Any, ...]:
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()   # rope_backward L162-177
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   position_ids: Any = None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``liger_rotary_pos_emb`` (transformers/rope.py): ``LigerRopeFunction.apply(q, k, cos, sin)``."""
    return RopeFunction.apply(q, k, cos, sin)


# ----- fused linear cross-entropy ----------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction`` (reduction "sum" or "mean", no bias, no softcap):
    see the module docstring. ``release``: the Liger-Kernel release, (major, minor, patch)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                release: tuple[int, ...]) -> torch.Tensor:
        bt, h = x.shape
        v = weight.shape[0]
        inc_factor = -(-v // h)                                     # triton.cdiv(V, H), L51
        chunk = _next_pow2(-(-bt // inc_factor))                    # L52
        grad_input = torch.zeros_like(x)                            # L55
        trains = weight.requires_grad and x.requires_grad
        grad_weight = torch.zeros_like(weight) if trains else None  # L58-60 (accum_dtype None)
        loss_1d = torch.zeros(bt, dtype=torch.float32, device=x.device)     # L69
        mask = target != IGNORE_INDEX                               # L74 (.sum().item(): a host number)
        del mask
        for start in range(0, bt, chunk):
            x_chunk = x[start:start + chunk]
            logits = (x_chunk @ weight.t()).contiguous()            # L96, L140
            target[start:start + chunk].contiguous()
            # liger_cross_entropy_kernel: the loss into loss_1d, the logits' gradient over the logits
            grad_input[start:start + chunk] = logits @ weight       # L195
            if grad_weight is not None:
                _add_weight_grad(grad_weight, logits, x_chunk, release)
        loss = torch.sum(loss_1d)                                   # L219
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)              # L225
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        grad_input, grad_weight = ctx.saved_tensors
        # element_mul_kernel scales both in place when grad_output != 1 (L231-276): nothing allocated
        return grad_input, grad_weight, None, None


def _add_weight_grad(grad_weight: torch.Tensor, logits: torch.Tensor, x_chunk: torch.Tensor,
                     release: tuple[int, ...]) -> None:
    """One chunk's weight gradient added as the release does (``estimate.quantities.loss_kinds._fused_weight_grad_bytes``)."""
    if release < (0, 6, 2):          # v0.5.10 L127-135
        torch.addmm(grad_weight, logits.t().to(x_chunk.dtype), x_chunk, out=grad_weight)
    elif release >= (0, 8, 1) and grad_weight.dtype == torch.float32 and logits.dtype in (torch.float16,
                                                                                        torch.bfloat16):
        # v0.8.2 L233-257: addmm into the fp32 gradient, out_dtype float32 (the input cast to the logits' dtype)
        # (written into grad_weight: nothing allocated but the input's cast; no CPU kernel has out_dtype)
        x_chunk.to(logits.dtype)
    else:                            # v0.6.2 L134, v0.6.4 L198 .. v0.8.0; v0.8.1+ otherwise
        grad_weight += torch.mm(logits.t(), x_chunk).float()


def lce_forward(self: nn.Module, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
    """``lce_forward`` (transformers/model/llama.py at v0.6.4) in training with labels: the decoder,
    then ``LigerForCausalLMLoss`` (transformers/model/loss_utils.py): labels padded with -100 and
    shifted (``F.pad(labels, (0, 1))[..., 1:].contiguous()``), the hidden states viewed as (b*s, h),
    and the fused loss on ``lm_head.weight``; no logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden = outputs[0][:, slice(0, None), :]                    # kept_hidden_states (logits_to_keep 0)
    padded = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    shift_labels = padded[..., 1:].contiguous()
    del padded
    h = self.config.hidden_size
    loss = FusedLinearCrossEntropyFunction.apply(hidden.reshape(-1, h), self.lm_head.weight,
                                                 shift_labels.view(-1), self._trainmem_liger_release)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values)


# ----- the patch ----------------------------------------------------------------------------------------
def apply(model: nn.Module, t: TrainingSpec) -> nn.Module:
    """``model`` (a transformers Llama-style causal LM, before peft) patched as Liger's instance patch
    does: with ``--liger`` its RMSNorms and MLPs; with ``--loss fused`` (``--liger``'s default) its
    forward. Unchanged otherwise."""
    if t.liger:
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
        mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
        if not norms or not mlps or not all(hasattr(m, "gate_proj") and hasattr(m, "up_proj") for m in mlps):
            raise TrainmemError("--liger patches a Llama-style model's RMSNorms and SwiGLU MLPs; this model has "
                                "none: drop --liger")
        for m in norms:
            m.forward = types.MethodType(rms_norm_forward, m)
        for m in mlps:
            m.forward = types.MethodType(swiglu_mlp_forward, m)
    if t.loss == "fused":
        if not (hasattr(model, "lm_head") and hasattr(model, "model") and hasattr(model.config, "hidden_size")):
            raise TrainmemError(f"--loss fused: trace runs Liger's lce_forward of a Llama-style causal LM (its "
                                f"model.model and lm_head); {type(model).__name__} is not one: use estimate")
        model._trainmem_liger_release = t.liger_release()
        model.forward = types.MethodType(lce_forward, model)
    return model


@contextlib.contextmanager
def rope(model: nn.Module, t: TrainingSpec) -> Iterator[None]:
    """``--liger``: the modeling files' ``apply_rotary_pos_emb`` is Liger's while the step runs (the
    attention's forward reads the module global at each call, also in a checkpoint's recompute)."""
    if not t.liger:
        yield
        return
    files = model_files(model, ("apply_rotary_pos_emb",))
    with swapped({(f, "apply_rotary_pos_emb"): rotary_pos_emb for f in files}):
        yield
