"""litgpt's own linears put into a transformers model, so that ``trace`` runs what litgpt runs.

litgpt (Lightning-AI/litgpt v0.5.13, https://github.com/Lightning-AI/litgpt/tree/v0.5.13) computes a
layer with its own modules where transformers' differ in what autograd keeps:

* ``--fused-qkv``: ``CausalSelfAttention`` has one ``qkv`` linear of ``(n_head + 2 * n_query_groups)
  * head_size`` outputs, split into q, k and v (``litgpt/model.py`` L394-398, L472-479:
  ``q, k, v = qkv.split((query_size, key_size, value_size), dim=-1)``), then each viewed as
  (B, T, heads, head_size) and transposed (L490-499). Under LoRA the linear is a ``LoRAQKVLinear``
  (``litgpt/lora.py`` L175-414): one dropout and one ``lora_A`` of ``r * n`` rows over the shared
  input for the n enabled parts, a grouped ``conv1d`` with ``lora_B``, and, when some but not all of
  q, k, v are enabled, ``zero_pad``: the delta scattered into zeros of the fused width by
  ``index_copy_`` (whose backward keeps the delta).
* ``--split-gate-up``: ``LLaMAMLP`` runs the gate and up projections as two linears, ``fc_1`` and
  ``fc_2`` (``litgpt/model.py`` L818-831: ``F.silu(self.fc_1(x)) * self.fc_2(x)``), each a
  ``LoRALinear`` under LoRA (``litgpt/lora.py`` L615-622, L88-172: its own dropout, ``lora_A``,
  ``lora_B``), where transformers' ``Phi3MLP`` has one ``gate_up_proj`` and chunks its output.

* ``--rms-norm input``: lit-gpt's ``RMSNorm`` before 6178c7cc (2023-10-24) and lightning-thunder's
  copy of lit-gpt's model (``thunder/tests/lit_gpt_model.py``) until PR2342 (2024-03-04) compute in the
  input's dtype, with no fp32 cast (``rms_norm_input_forward``), where transformers' ``LlamaRMSNorm``
  casts the input to fp32 and the normalised tensor back.

``apply(model, t)`` does this as a surgery on the built (and, with LoRA, peft-wrapped) model: each
attention's ``q_proj``/``k_proj``/``v_proj`` become parts of one fused linear (the first one called
in a forward runs it, each returns its slice, the same view litgpt's ``split`` makes), and each MLP
with a ``gate_up_proj`` becomes litgpt's MLP. The rest of the model (norms, rotary embedding, the
attention call, the loss) stays transformers'; peft's adapters on the other linears stay peft's,
whose ``Linear`` saves what litgpt's ``LoRALinear`` saves. The modules here are written from litgpt's
source, op for op where autograd keeps something.
"""
from __future__ import annotations

import contextlib
import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .errors import TrainmemError
from .spec import TrainingSpec

QKV = ("q_proj", "k_proj", "v_proj")


def apply(model: nn.Module, t: TrainingSpec) -> nn.Module:
    """``model`` with litgpt's fused q/k/v (``t.fused_qkv``) and split gate/up (``t.split_gate_up``)
    linears in place of transformers' (and of peft's adapters on them), and old lit-gpt's RMSNorm
    (``t.rms_norm`` input); unchanged without any."""
    if t.rms_norm == "input":
        _rms_norms_in_input_dtype(model)
    if not (t.fused_qkv or t.split_gate_up):
        return model
    fused = split = 0
    for module in list(model.modules()):
        if t.fused_qkv and all(hasattr(module, n) for n in QKV):
            _fuse_qkv(module)
            fused += 1
        if t.split_gate_up and hasattr(module, "gate_up_proj"):
            _split_gate_up(module)
            split += 1
    if t.fused_qkv and not fused:
        raise TrainmemError("--fused-qkv: the model has no attention with q_proj, k_proj and v_proj to fuse; "
                            "drop --fused-qkv")
    if t.split_gate_up and not split:
        raise TrainmemError("--split-gate-up: the model has no MLP with a gate_up_proj to split; drop --split-gate-up")
    return model


# ----- what a linear is made of (a plain nn.Linear, or peft's LoRA layer around one) -------------------
def _base(linear: nn.Module) -> nn.Linear:
    """The plain linear under peft's LoRA layer (``base_layer``), or the linear itself."""
    base = getattr(linear, "base_layer", linear)
    if type(base) is not nn.Linear:
        raise TrainmemError(f"--fused-qkv / --split-gate-up rebuild plain linears; this model's is a "
                            f"{type(base).__name__} (a quantized base?): use estimate")
    return base


def _adapter(linear: nn.Module) -> dict[str, Any] | None:
    """peft's adapter on ``linear`` as litgpt's LoRA arguments (rank, scaling, dropout probability,
    the adapters' dtype), or None without one."""
    lora_a = getattr(linear, "lora_A", None)
    if not lora_a or "default" not in lora_a:
        return None
    drop = linear.lora_dropout["default"]
    return {"r": linear.r["default"], "scaling": linear.scaling["default"],
            "p": drop.p if isinstance(drop, nn.Dropout) else 0.0, "dtype": lora_a["default"].weight.dtype}


def _linear(bases: list[nn.Linear], rows: int | None = None) -> nn.Linear:
    """A new ``nn.Linear`` as large as ``bases`` stacked on their outputs (or with ``rows`` outputs):
    the same input width, dtype, device, bias and ``requires_grad`` (frozen under LoRA). Its values
    are ``nn.Linear``'s own initialisation, not the bases' (trace runs on tensors without data, and
    measure's memory does not depend on the values of random weights)."""
    first = bases[0]
    out = sum(b.out_features for b in bases) if rows is None else rows
    bias = first.bias is not None
    new = nn.Linear(first.in_features, out, bias=bias, device=first.weight.device, dtype=first.weight.dtype)
    new.weight.requires_grad_(first.weight.requires_grad)
    if bias:
        new.bias.requires_grad_(first.bias.requires_grad)
    return new


def _lora_params(rows_a: int, rows_b: int, r: int, cols: int, like: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[nn.Parameter, nn.Parameter]:
    """litgpt's ``lora_A`` (rows_a, cols) and ``lora_B`` (rows_b, r) in the adapters' dtype, initialised
    as its ``reset_parameters`` does (``lora.py``: ``kaiming_uniform_(lora_A, a=sqrt(5))``, ``zeros_(lora_B)``),
    in place: a real run (measure) computes on them; on tensors without data (trace) nothing is written."""
    a = nn.Parameter(torch.empty(rows_a, cols, device=like.device, dtype=dtype))
    b = nn.Parameter(torch.empty(rows_b, r, device=like.device, dtype=dtype))
    with torch.no_grad():
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(b)
    return a, b


def _dropout(p: float) -> nn.Module:
    """``LoRALayer``'s dropout: ``nn.Dropout(p)`` when p > 0, else the identity (lora.py L80-83)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


# ----- fused q/k/v -----------------------------------------------------------------------------------
class LoRAQKVLinear(nn.Module):
    """litgpt's ``qkv`` linear (``LoRAQKVLinear`` under LoRA, a plain linear without): ``linear`` of
    q + 2 kv outputs and, with ``enable`` (q, k, v) and rank r, ``lora_A`` (r * n, h) and ``lora_B``
    (sum of the enabled widths, r) for the n enabled parts."""

    def __init__(self, linear: nn.Linear, widths: tuple[int, int, int], n_head: int, n_groups: int,
                 enable: tuple[bool, bool, bool], lora: dict[str, Any] | None) -> None:
        super().__init__()
        self.linear = linear
        self.widths = widths
        self.n_head, self.n_groups = n_head, n_groups
        self.enable = enable
        self.r = lora["r"] if lora and any(enable) else 0
        if self.r:
            self.scaling = lora["scaling"]
            self.lora_dropout = _dropout(lora["p"])
            self.qkv_shapes = [w for w, on in zip(widths, enable) if on]
            self.lora_A, self.lora_B = _lora_params(self.r * sum(enable), sum(self.qkv_shapes), self.r,
                                                    linear.in_features, linear.weight, lora["dtype"])

    def lora_ind(self) -> torch.Tensor:
        """The fused output's columns of the enabled parts (int64; litgpt L264-286 keeps them as a
        non-persistent buffer made at the first forward and returns a clone)."""
        if not hasattr(self, "_lora_ind"):
            starts = (0, self.widths[0], self.widths[0] + self.widths[1])
            ind = [i for s, w, on in zip(starts, self.widths, self.enable) if on for i in range(s, s + w)]
            self.register_buffer("_lora_ind", torch.tensor(ind, device=self.linear.weight.device), persistent=False)
        return self._lora_ind.clone()

    def zero_pad(self, x: torch.Tensor) -> torch.Tensor:
        """L288-326: with some of q, k, v disabled, the delta (B, T, enabled widths) scattered into
        zeros (B, T, fused width) by ``index_copy_``, whose backward keeps ``source`` (the delta)."""
        if all(self.enable):
            return x
        result = x.new_zeros(*x.shape[:-1], self.linear.out_features)  # (B, T, q + 2 kv), x's dtype
        return result.index_copy_(dim=-1, index=self.lora_ind(), source=x)

    def conv1d(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """L328-362: one grouped convolution when every part has the same width (n_head equal to the
        query groups), else one per enabled part, concatenated."""
        n = sum(self.enable)
        if self.n_head == self.n_groups:
            return F.conv1d(x, weight, groups=n)  # (B, enabled widths, T)
        parts = zip(x.chunk(n, dim=1), weight.split(self.qkv_shapes))  # views: (B, r, T), (width, r, 1)
        return torch.cat([F.conv1d(a, b) for a, b in parts], dim=1)  # (B, enabled widths, T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """L381-414: the frozen linear's output plus the scaled, zero-padded LoRA delta."""
        pretrained = self.linear(x)  # (B, T, q + 2 kv)
        if not self.r:
            return pretrained
        after_a = F.linear(self.lora_dropout(x), self.lora_A)  # (B, T, r * n); saved by conv1d
        after_b = self.conv1d(after_a.transpose(-2, -1), self.lora_B.unsqueeze(-1)).transpose(-2, -1)
        lora = self.zero_pad(after_b) * self.scaling  # (B, T, q + 2 kv)
        return pretrained + lora


class _QKVPart(nn.Module):
    """``q_proj``, ``k_proj`` or ``v_proj`` of an attention whose q, k and v come from one fused
    linear: the first part called in a forward runs the fused linear and splits its output as litgpt
    does (``qkv.split((query_size, key_size, value_size), dim=-1)``: views), each part returns its
    own slice, and the parts forget them once taken (nothing outlives the forward here)."""

    def __init__(self, index: int, owner: nn.Module) -> None:
        super().__init__()
        self.index = index
        self.__dict__["_owner"] = owner  # the attention, not registered again as a child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._owner.__dict__.setdefault("_qkv_parts", {})
        if not parts:
            fused = self._owner.qkv(x)  # (B, T, q + 2 kv)
            parts.update(enumerate(fused.split(self._owner.qkv.widths, dim=-1)))  # q, k, v: views of it
        return parts.pop(self.index)


def _fuse_qkv(attn: nn.Module) -> None:
    """Replace ``attn``'s q_proj, k_proj and v_proj (peft-wrapped or not) with litgpt's fused linear
    and three parts of it."""
    linears = [getattr(attn, n) for n in QKV]
    bases = [_base(m) for m in linears]
    adapters = [_adapter(m) for m in linears]
    lora = next((a for a in adapters if a), None)
    head = _head_dim(attn, bases)
    widths = tuple(b.out_features for b in bases)
    attn.qkv = LoRAQKVLinear(_linear(bases), widths, widths[0] // head, widths[1] // head,
                             tuple(a is not None for a in adapters), lora)
    for i, name in enumerate(QKV):
        delattr(attn, name)
        setattr(attn, name, _QKVPart(i, attn))


def _head_dim(attn: nn.Module, bases: list[nn.Linear]) -> int:
    """The attention's head size (``head_dim``; else the query width over the heads)."""
    head = getattr(attn, "head_dim", None)
    if head is None:
        config = getattr(attn, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if not heads:
            raise TrainmemError(f"--fused-qkv: cannot read the head size of {type(attn).__name__}; use estimate")
        head = bases[0].out_features // heads
    return int(head)


# ----- split gate / up -------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """litgpt's ``LoRALinear`` (lora.py L88-172): ``linear`` and, with rank r, ``lora_A`` (r, in) and
    ``lora_B`` (out, r); forward ``linear(x) + (dropout(x) @ A.T @ B.T) * scaling`` (L164-172)."""

    def __init__(self, linear: nn.Linear, lora: dict[str, Any] | None) -> None:
        super().__init__()
        self.linear = linear
        self.r = lora["r"] if lora else 0
        if self.r:
            self.scaling = lora["scaling"]
            self.lora_dropout = _dropout(lora["p"])
            self.lora_A, self.lora_B = _lora_params(self.r, linear.out_features, self.r, linear.in_features,
                                                    linear.weight, lora["dtype"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pretrained = self.linear(x)  # (B, T, out)
        if not self.r:
            return pretrained
        lora = (self.lora_dropout(x) @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)) * self.scaling
        return pretrained + lora


def litgpt_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """litgpt's ``LLaMAMLP.forward`` (model.py L827-831) over transformers' ``down_proj`` (kept, with
    its peft adapter if any) and activation: ``down_proj(act(fc_1(x)) * fc_2(x))``."""
    x_fc_1 = self.fc_1(x)  # (B, T, ffn): the gate, saved by the activation
    x_fc_2 = self.fc_2(x)  # (B, T, ffn): the up projection, saved by the product
    return self.down_proj(self.activation_fn(x_fc_1) * x_fc_2)


def _split_gate_up(mlp: nn.Module) -> None:
    """Turn ``mlp`` (a transformers MLP with ``gate_up_proj``, ``down_proj`` and ``activation_fn``,
    Phi3MLP's shape) into litgpt's ``LLaMAMLP``, in place: ``fc_1`` the gate half of the fused
    linear and ``fc_2`` the up half (Phi3MLP: ``gate, up_states = up_states.chunk(2, dim=-1)``;
    litgpt's scripts/convert_hf_checkpoint.py splits the checkpoint's ``gate_up_proj`` the same way),
    each a ``LoRALinear`` with its own adapter when peft put one on ``gate_up_proj``."""
    if not (hasattr(mlp, "down_proj") and hasattr(mlp, "activation_fn")):
        raise TrainmemError(f"--split-gate-up: {type(mlp).__name__} is not a gate_up_proj / down_proj MLP "
                            "trainmem can rewrite; use estimate")
    fused = mlp.gate_up_proj
    base, lora = _base(fused), _adapter(fused)
    half = base.out_features // 2
    del mlp.gate_up_proj
    mlp.fc_1 = LoRALinear(_linear([base], rows=half), lora)
    mlp.fc_2 = LoRALinear(_linear([base], rows=half), lora)
    mlp.forward = types.MethodType(litgpt_mlp_forward, mlp)


# ----- old lit-gpt's RMSNorm (--rms-norm input) ------------------------------------------------------
def rms_norm_input_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lit-gpt's ``RMSNorm.forward`` before 6178c7cc (``lit_gpt/rmsnorm.py`` L17-21 at 8641822, 2023-10-16),
    as lightning-thunder's ``thunder/tests/lit_gpt_model.py`` L116-120 has it at 07da9a31b (2024-02-27),
    over a transformers RMSNorm's ``weight`` and ``variance_epsilon``: everything in x's dtype."""
    norm_x = torch.mean(x * x, dim=-1, keepdim=True)  # (..., 1), x's dtype
    x_normed = x * torch.rsqrt(norm_x + self.variance_epsilon)  # saves x and rsqrt's output
    return self.weight * x_normed  # saves x_normed for the weight's gradient


def _rms_norms_in_input_dtype(model: nn.Module) -> None:
    """Every transformers RMSNorm of ``model`` (a ``weight`` and a ``variance_epsilon``, LlamaRMSNorm's
    attributes) computes as ``rms_norm_input_forward``; refused when the model has none."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    if not norms or not all(hasattr(m, "weight") and hasattr(m, "variance_epsilon") for m in norms):
        raise TrainmemError("--rms-norm input rewrites transformers' LlamaRMSNorm (weight, variance_epsilon); "
                            "this model has other norms: use estimate, or drop --rms-norm")
    for m in norms:
        m.forward = types.MethodType(rms_norm_input_forward, m)


# ----- litgpt's SDPA call (--attention-call repeat-kv) --------------------------------------------------
def litgpt_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any, None, bool, bool]:
    """``--attention-call repeat-kv``: the SDPA call of litgpt's ``CausalSelfAttention.forward`` in
    training, made from transformers' tensors. litgpt (lit-gpt 50b1974b, 2023-10-24, to litgpt 0.5.x,
    ``litgpt/model.py``: ``if n_query_groups != n_head and (input_pos is None or n_query_groups != 1)``)
    expands k and v (b, groups, 1, s, d) to (b, groups, q_per_kv, s, d) and ``reshape``s them to
    (b, heads, s, d), which copies them (an expanded view is not viewable as one head dimension), then
    calls ``scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)`` (its ``mask`` is
    None without a KV cache). Each key/value head is repeated for its group's consecutive query heads,
    the order transformers' ``repeat_kv`` has. Returns (k, v, mask, is_causal, enable_gqa): the copies
    (b, heads, s, d) in k's and v's dtype, no mask (transformers' causal mask for an unpadded batch is
    the one ``is_causal`` builds), causal, no enable_gqa."""
    heads = q.shape[-3]

    def repeated(x: torch.Tensor) -> torch.Tensor:
        b, g, s, d = x.shape
        if g == heads:
            return x
        return x[:, :, None].expand(b, g, heads // g, s, d).reshape(b, heads, s, d)  # (b, heads, s, d) copy

    return repeated(k), repeated(v), None, True, False


class LitgptAttentionCall(TorchFunctionMode):
    """``--attention-call repeat-kv`` on a real device (measure) or the CPU (trace --device cpu): each
    ``F.scaled_dot_product_attention`` transformers' attention makes is rewritten to litgpt's call
    (``litgpt_call``), as trace's CUDA emulation rewrites it (``trace.cuda.CudaEmulation._sdpa``). Under
    autocast q, k and v are first cast to its dtype, which autocast would do at SDPA itself (an op of its
    lower-precision list: ``aten/src/ATen/autocast_mode.cpp``, ``scaled_dot_product_attention`` under
    ``KERNEL_CUDA(..., lower_precision_fp)``), so the copies are made in the half dtype, as litgpt's
    half q, k, v are (its ``apply_rope`` returns the input's dtype) and as the emulation makes them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = dict(zip(names, args), **kwargs)
        q, k, v = given["query"], given["key"], given["value"]
        kind = q.device.type
        if torch.is_autocast_enabled(kind):
            low = torch.get_autocast_dtype(kind)
            q, k, v = (x.to(low) if x.is_floating_point() and x.dtype == torch.float32 else x for x in (q, k, v))
        k, v, mask, causal, gqa = litgpt_call(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=given.get("dropout_p", 0.0),
                                              is_causal=causal, scale=given.get("scale"), enable_gqa=gqa)


def attention_call(t: TrainingSpec) -> Any:
    """The context a real (or CPU-traced) step runs in for ``t.attention_call``: ``LitgptAttentionCall``
    for ``repeat-kv``, a no-op context for the model's own call."""
    return LitgptAttentionCall() if t.attention_call == "repeat-kv" else contextlib.nullcontext()
