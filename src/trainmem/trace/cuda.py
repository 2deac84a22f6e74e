"""Run CUDA training code on a machine without a GPU, with CUDA's memory behaviour.

PyTorch cannot run autograd on tensors that claim to live on ``cuda`` when it was built without
CUDA (autograd asks the CUDA device guard for a stream). So the tensors of an emulated GPU live on
the ``meta`` device — they have storages of the right size and no data — and :class:`CudaEmulation`
(a ``TorchFunctionMode``) makes the program behave as it would on CUDA:

* **Device.** ``device="cuda"`` arguments, ``.to("cuda")`` and ``.cuda()`` go to ``meta``;
  ``torch.cuda.is_available()`` is True; ``torch.cuda.memory_allocated()`` and friends answer from
  the allocator simulation; ``.cpu()``, ``.item()`` and ``.tolist()`` of a device tensor give zeros
  (the data does not exist; code that branches on it sees zeros).
* **Autocast.** ``torch.autocast("cuda", ...)`` sets the usual autocast state; the CUDA policy is
  applied here, per op, as ``aten/src/ATen/autocast_mode.cpp`` lists it (the set of ops with an
  ``AutocastCUDA`` kernel is read from this PyTorch build): matmul-like ops in half precision, with
  the cast of fp32 leaf weights cached until the outermost autocast region exits; layer_norm,
  rms_norm, losses, exp/log/pow ... in fp32; softmax, log_softmax, sum, cumsum ... with an fp32
  ``dtype``; addcmul, cat-free "promote" ops to the widest type. ``cross_entropy`` has no CUDA
  autocast kernel: it runs log_softmax in the input's (half) dtype and its inner ``nll_loss`` casts
  that to fp32 — both are kept for backward, as on a GPU.
* **Dropout.** Out-of-place dropout with 0 < p < 1 runs CUDA's fused ``native_dropout``, which keeps
  a 1-byte bool mask (the CPU/meta path keeps a float mask).
* **Scaled dot-product attention.** The CUDA backend is chosen as PyTorch 2.13's dispatcher does
  (``select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: its priority
  order, cuDNN first on sm90/sm10x, and each backend's checks on the tensors; docs/attention.md)
  and the CUDA branch of ``scaled_dot_product_attention`` (attention.cpp) runs, so autograd saves
  what it saves on a GPU: flash pads head_dim to a multiple of 8 and keeps the padded copies,
  flash / cuDNN / memory-efficient keep q, k, v, output and logsumexp. ``attention_backend`` pins
  one (``sdpa_kernel``); a pin PyTorch would refuse is a ``TrainmemError``.
* **Optimizers.** ``foreach`` (and ``fused``) implementations are available for device tensors, so
  ``torch.optim`` defaults to foreach as it does on CUDA.
* **cuBLAS workspace** and in-kernel scratch buffers are added by the tracker (``Tracker``).
"""
from __future__ import annotations

import contextlib
import math
import itertools
import functools
import types
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from trainmem.estimate.layers import CUDNN_VERSION
from trainmem.litgpt_modules import litgpt_call  # noqa: F401 (the call the emulation rewrites SDPA to)

EMULATED = "meta"  # the device type that stands for the emulated GPU

# ----- CUDA autocast policy (aten/src/ATen/autocast_mode.cpp), by Python-level function name -----
LOWER_PRECISION = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "addmv", "addr", "baddbmm",
    "addbmm", "mv", "einsum", "chain_matmul", "multi_dot", "vecdot", "conv1d", "conv2d", "conv3d",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_convolution", "convolution",
    "_scaled_dot_product_flash_attention",
})
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "__rdiv__", "__rtruediv__", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
})
SET_OPT_DTYPE = frozenset({
    "prod", "softmax", "log_softmax", "softmin", "cumprod", "cumsum", "vector_norm", "matrix_norm", "sum",
    "norm",
})
PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sample", "index_put",
    "tensordot", "scatter_add",
})
BANNED = frozenset({"binary_cross_entropy"})

def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


def _is_cpu_device(d: Any) -> bool:
    return d == "cpu" if isinstance(d, str) else isinstance(d, torch.device) and d.type == "cpu"


def _is_meta_device(d: Any) -> bool:
    return d == "meta" if isinstance(d, str) else isinstance(d, torch.device) and d.type == "meta"


def _map_device(d: Any) -> Any:
    return EMULATED if _is_cuda_device(d) else d


def _eligible(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == EMULATED and t.is_floating_point()
            and t.dtype is not torch.float64)


class _DeviceProperties(types.SimpleNamespace):
    pass


class CudaEmulation(TorchFunctionMode):
    """Make code written for CUDA run on ``meta`` tensors with CUDA's dtype and kernel choices."""

    def __init__(self, tracker: Any = None, *, attention_backend: str | None = None,
                 capability: tuple[int, int] = (8, 0), attention_flag: str | None = None,
                 attention_call: str = "model", math_upcast: bool = True) -> None:
        """``attention_flag``: the ``--attention`` value that pinned the backend, named in refusals;
        ``attention_call``: ``repeat-kv`` calls SDPA as litgpt does (``litgpt_call``);
        ``math_upcast`` False: the math kernel as before PyTorch 2.5 (``math_in_input_dtype``), for
        the derived coefficients of an older ``--torch-version`` (trace itself runs the installed one)."""
        super().__init__()
        self.attention_call = attention_call
        self.math_upcast = math_upcast
        if attention_backend not in (None, "flash", "efficient", "math", "cudnn"):
            raise ValueError(f"attention_backend {attention_backend!r}: use flash, efficient, math, cudnn or None")
        self.tracker = tracker
        self.attention_backend = attention_backend
        self.attention_flag = attention_flag or (f"sdpa-{attention_backend}" if attention_backend else None)
        self.capability = capability
        self._cast_cache: dict[int, tuple[Any, torch.Tensor]] = {}
        self.sdpa_choices: dict[str, int] = {}
        self.host_reads = 0
        # whether a ``device="meta"`` the program gives itself is the real meta device (no memory), as
        # DeepSpeed's ZeRO-1/2 layout tensors (``trace.deepspeed_engine``), rather than the emulated GPU
        self.explicit_meta_uncounted = False
        # a ``FakeTensorMode`` in which host (``device="cpu"``) tensors are made without data while set
        # (DeepSpeed's ZeRO-Offload host buffers: ``trace.deepspeed_engine.host_buffers``); None: real ones
        self.fake_host: Any = None

    # ----- dispatch --------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if "device" in kwargs:
            if self.explicit_meta_uncounted and _is_meta_device(kwargs["device"]) and self.tracker is not None:
                # a tensor the program itself asks for on ``meta`` (shapes only: no memory on a GPU)
                with self.tracker.paused():
                    return func(*args, **kwargs)
            if self.fake_host is not None and _is_cpu_device(kwargs["device"]):
                return self._fake_host(func, args, kwargs)
            kwargs["device"] = _map_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "to" or name == "_to":
            args = tuple(_map_device(a) for a in args)
        elif name == "cuda":
            return args[0].to(EMULATED, non_blocking=kwargs.get("non_blocking", False))
        elif name in ("cpu", "numpy", "tolist", "item", "pin_memory") and args \
                and isinstance(args[0], torch.Tensor) and args[0].device.type == EMULATED \
                and not getattr(self.tracker, "_suspended", False):
            # (while trace --compile captures a graph, a read reaches the tracker, which answers
            # it as in the eager step)
            return self._host_read(name, args[0])
        elif name == "pin_memory":
            return args[0]
        if torch.is_autocast_enabled("cuda"):
            return self._autocast(func, name, args, kwargs)
        if name == "dropout":
            return self._dropout(func, args, kwargs)
        if name == "scaled_dot_product_attention":
            return self._sdpa(args, kwargs, None)
        if name == "_grouped_mm":
            return self._grouped_mm(func, args, kwargs)
        return func(*args, **kwargs)

    def _fake_host(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A host tensor the program makes (``device="cpu"``) while :attr:`fake_host` is set: a fake CPU
        tensor (shape, dtype, device, no data), so that host buffers of a GPU's size take no host memory."""
        paused = self.tracker.paused() if self.tracker is not None else contextlib.nullcontext()
        with paused, self.fake_host:
            return func(*args, **kwargs)

    def _host_read(self, name: str, t: torch.Tensor) -> Any:
        if name == "item" and t.dim() == 0 and self.tracker is not None and self.tracker.asserted(t):
            return True  # a torch._check_tensor_all holds (Tracker.asserted)
        known = self.tracker.routing.value(t) if hasattr(self.tracker, "routing") else None
        if known is not None:  # a value a MoE router's choice decides (trace.routing_values)
            return known.clone() if name == "cpu" else (t if name == "pin_memory" else getattr(known, name)())
        self.host_reads += 1
        if name == "tolist" and t.dim() and not t.is_floating_point() \
                and hasattr(self.tracker, "note_value_read"):
            self.tracker.note_value_read(".tolist()")
        host = torch.zeros(t.shape, dtype=t.dtype, device="cpu")
        if name == "cpu":
            return host
        if name == "pin_memory":
            return t
        return getattr(host, name)()

    # ----- autocast ----------------------------------------------------------------------------------
    def clear_cache(self) -> None:
        self._cast_cache.clear()

    def _cast(self, t: Any, dtype: torch.dtype, lower: torch.dtype) -> Any:
        if isinstance(t, (list, tuple)):
            return type(t)(self._cast(x, dtype, lower) for x in t)
        if not _eligible(t) or t.dtype == dtype:
            return t
        if (dtype == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                and not t._is_view() and torch.is_autocast_cache_enabled()):
            hit = self._cast_cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            ctx = self.tracker.label("autocast_weight_cache") if self.tracker else contextlib.nullcontext()
            with ctx:
                out = t.to(dtype)
            self._cast_cache[id(t)] = (_weak(t), out)
            return out
        # a slice of a trained weight (a per-expert loop's ``weight[e]``: DBRX, JetMoE, LongCat-Flash) is cast
        # at every call, uncached (``cached_cast``: not a leaf); its copy is a weight's, not an activation's. A view
        # of the whole weight (Falcon's ``x @ self.weight.T``) copies what the engine counts as the weight's
        # cached copy (``states``' ``layer_matmul_half``), so it stays an ``autocast_cast``
        base = t._base if t._is_view() else None
        view = base is not None and base.is_leaf and base.requires_grad and dtype == lower \
            and t.numel() < base.numel()
        ctx = self.tracker.label("autocast_weight_view" if view else "autocast_cast") if self.tracker \
            else contextlib.nullcontext()
        with ctx:
            return t.to(dtype)

    def _autocast(self, func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
        lower = torch.get_autocast_dtype("cuda")
        if name in BANNED:
            raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
                               "autocast (CUDA); use binary_cross_entropy_with_logits")
        if name == "scaled_dot_product_attention":
            return self._sdpa(args, kwargs, lower)
        if name == "dropout":
            return self._dropout(func, args, kwargs)
        if kwargs.get("out") is not None:
            # autocast's kernels are registered for the functional overloads only (aten/src/ATen/
            # autocast_mode.cpp ``KERNEL_CUDA(addmm, lower_precision_fp)`` registers ``aten::addmm``, not
            # ``addmm.out``): an ``out=`` call runs on its operands as they are (Liger-Kernel < 0.6.2's
            # ``torch.addmm(..., out=grad_weight)``, liger_modules._add_weight_grad)
            return func(*args, **kwargs)
        if name == "cross_entropy":
            return self._cross_entropy(func, args, kwargs, lower)
        if name == "_grouped_mm":  # no autocast kernel
            return self._grouped_mm(func, args, kwargs)
        if name in LOWER_PRECISION:
            args = tuple(self._cast(a, lower, lower) for a in args)
            kwargs = {k: self._cast(v, lower, lower) for k, v in kwargs.items()}
        elif name in FP32:
            args = tuple(self._cast(a, torch.float32, lower) for a in args)
            kwargs = {k: self._cast(v, torch.float32, lower) for k, v in kwargs.items()}
        elif name in SET_OPT_DTYPE:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if _eligible(first) and kwargs.get("dtype") is None and not self._positional_dtype(func, name, args):
                kwargs["dtype"] = torch.float32
        elif name in PROMOTE:
            flat = [a for a in _flatten(list(args) + list(kwargs.values())) if _eligible(a)]
            if flat:
                widest = functools.reduce(torch.promote_types, [a.dtype for a in flat])
                args = tuple(self._cast(a, widest, lower) for a in args)
                kwargs = {k: self._cast(v, widest, lower) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    @staticmethod
    def _positional_dtype(func: Callable, name: str, args: tuple) -> bool:
        """True when the call already passes a dtype positionally."""
        if name in ("softmax", "log_softmax", "softmin"):
            pos = 3 if getattr(func, "__module__", "") == "torch.nn.functional" else 2
            return len(args) > pos and args[pos] is not None
        if name in ("cumsum", "cumprod"):
            return len(args) > 2 and args[2] is not None
        return False

    # ----- special ops ---------------------------------------------------------------------------------
    def _dropout(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        sig = _bind(func, args, kwargs, ("input", "p", "training", "inplace"), (None, 0.5, True, False))
        x, p, training, inplace = sig["input"], sig["p"], sig["training"], sig["inplace"]
        if (isinstance(x, torch.Tensor) and x.device.type == EMULATED and training and not inplace
                and 0.0 < p < 1.0 and x.numel() > 0):
            # CUDA's at::dropout takes the fused kernel: output + bool mask saved for backward
            return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)

    def _cross_entropy(self, func: Callable, args: tuple, kwargs: dict, lower: torch.dtype) -> Any:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                 "label_smoothing")
        sig = _bind(func, args, kwargs, names, (None, None, None, None, -100, None, "mean", 0.0))
        x, target = sig["input"], sig["target"]
        if (not _eligible(x) or sig["label_smoothing"] or sig["size_average"] is not None
                or sig["reduce"] is not None or not isinstance(target, torch.Tensor)
                or target.is_floating_point()):
            return func(*args, **kwargs)
        # at::cross_entropy_loss is not on CUDA's autocast list: log_softmax keeps the input dtype
        # and nll_loss (fp32 list) casts its input to fp32; autograd keeps both.
        class_dim = 0 if x.dim() == 1 else 1
        lsm = torch.log_softmax(x, class_dim, dtype=x.dtype)
        weight = sig["weight"]
        lsm32 = self._cast(lsm, torch.float32, lower)
        if weight is not None:
            weight = self._cast(weight, torch.float32, lower)
        return torch.nn.functional.nll_loss(lsm32, target, weight, ignore_index=sig["ignore_index"],
                                            reduction=sig["reduction"])

    def _grouped_mm(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``torch._grouped_mm`` outside bf16 (fp32 or fp16 experts, e.g. a MoE trained in fp32 or
        under autocast with fp32 weights). On CUDA ``_grouped_mm_cuda`` takes its CUTLASS kernel for
        bf16 only and otherwise ``_grouped_mm_fallback`` (one ``mm_out`` per group into the output);
        the meta kernel of this PyTorch build accepts bf16 only. Same output and autograd record
        (``GroupedMmBackward0`` saves both operands; backward makes one gradient per operand)."""
        sig = _bind(None, args, kwargs, ("mat_a", "mat_b", "offs", "bias", "out_dtype"), (None,) * 5)
        a, b = sig["mat_a"], sig["mat_b"]
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device.type == EMULATED) \
                or (a.dtype == b.dtype == torch.bfloat16 and sig["out_dtype"] in (None, torch.bfloat16)):
            return func(*args, **kwargs)
        return _GroupedMMFallback.apply(a, b, sig["offs"], sig["bias"], sig["out_dtype"])

    def _sdpa(self, args: tuple, kwargs: dict, lower: torch.dtype | None) -> Any:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        sig = _bind(None, args, kwargs, names, (None, None, None, None, 0.0, False, None, False))
        q, k, v, mask = sig["query"], sig["key"], sig["value"], sig["attn_mask"]
        if lower is not None:
            q, k, v = (self._cast(t, lower, lower) for t in (q, k, v))
            if isinstance(mask, torch.Tensor) and mask.is_floating_point():
                mask = self._cast(mask, lower, lower)
        p, causal, scale, gqa = sig["dropout_p"], sig["is_causal"], sig["scale"], sig["enable_gqa"]
        if not (isinstance(q, torch.Tensor) and q.device.type == EMULATED):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=scale, enable_gqa=gqa)
        if self.attention_call == "repeat-kv":
            k, v, mask, causal, gqa = litgpt_call(q, k, v)
        backend = self._choose_backend(q, k, v, mask, p, causal, gqa)
        if backend == "math" and type(q).__name__ == "DTensor":
            # context parallelism (``wrappers.context_parallel``) hands SDPA sequence-sharded DTensors; its
            # handler runs the fused kernels only (torch 2.13 _context_parallel/_attention.py _sdpa_handler)
            from ..errors import TrainmemError
            raise TrainmemError("--cp: SDPA picks the math kernel for these inputs, which PyTorch's ring attention "
                                "does not run (flash, memory-efficient and cuDNN only); use --precision bf16-amp or "
                                "bf16, or --attention sdpa-efficient")
        self.sdpa_choices[backend] = self.sdpa_choices.get(backend, 0) + 1
        return self._run_sdpa(backend, q, k, v, mask, p, causal, scale, gqa)

    def _run_sdpa(self, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                  p: float, causal: bool, scale: Any, gqa: bool) -> torch.Tensor:
        """The CUDA branch of ``at::native::scaled_dot_product_attention`` (attention.cpp) for
        ``backend``: the same ops, so autograd saves what it saves on a GPU."""
        aten = torch.ops.aten
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if backend == "flash":
            return _flash_padded(q, k, v, p, causal, scale)
        if backend == "cudnn":
            mask = _additive_mask(mask, q.dtype, -65504.0)  # convert_boolean_attn_mask_cudnn
            return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, lse, p, causal, False, scale=scale)[0]
        if backend == "efficient":
            mask = _additive_mask(mask, q.dtype, float("-inf"))
            if mask is not None:
                mask = _preprocess_mask(mask, q, k)
            return aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, p, causal, scale=scale)[0]
        if not self.math_upcast and q.dtype in (torch.float16, torch.bfloat16):
            return math_in_input_dtype(q, k, v, mask, p, causal, scale, gqa)
        # its ``attn.add_(*attn_mask)`` runs out of place under a dispatch mode (trace.cuda_kernels)
        inplace = self.tracker.cpp_inplace() if self.tracker is not None else contextlib.nullcontext()
        with inplace:
            return aten._scaled_dot_product_attention_math(q, k, v, mask, p, causal, None, scale=scale,
                                                           enable_gqa=gqa)[0]

    def _priority(self) -> list[str]:
        """``priority_order`` (cuda/sdp_utils.cpp): the global order (``torch._C._get_sdp_priority_order``,
        flash, efficient, math, cudnn unless changed), with cuDNN moved first where
        ``check_prefer_cudnn_attention`` holds: cuDNN > 9.15.0 on sm90 / sm10x (CUDA 13 builds; the
        torch 2.13 wheels ship cuDNN 9.20)."""
        names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
        order = [names[i] for i in torch._C._get_sdp_priority_order() if i in names]
        if order == ["flash", "efficient", "math", "cudnn"] and self.capability[0] in (9, 10) \
                and CUDNN_VERSION > 91500:
            order = ["cudnn", "flash", "efficient", "math"]
        return order

    def _choose_backend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, p: float,
                        causal: bool, gqa: bool) -> str:
        """``select_sdp_backend``: the first backend of ``_priority`` that is enabled
        (``torch.backends.cuda.enable_*_sdp``, ``sdpa_kernel``; ``attention_backend`` enables only
        that one) and whose checks pass; none: PyTorch's "No available kernel" error."""
        reasons = self.sdpa_refusals(q, k, v, mask, p, causal, gqa)
        if self.attention_backend is not None:
            why = reasons[self.attention_backend]
            if why:
                from trainmem.errors import TrainmemError
                how = (" (trainmem runs flash_attention_2 as SDPA's flash kernel, on the model's SDPA call)"
                       if self.attention_flag == "flash" else "")
                raise TrainmemError(f"--attention {self.attention_flag}{how}: PyTorch refuses this call: {why}; "
                                    "use --attention sdpa to let it choose")
            return self.attention_backend
        cuda = torch.backends.cuda
        enabled = {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled(),
                   "math": cuda.math_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled()}
        for backend in self._priority():
            if enabled[backend] and not reasons[backend]:
                return backend
        detail = "; ".join(f"{b}: {why or 'disabled'}" for b, why in reasons.items())
        raise RuntimeError(f"No available kernel. Aborting execution. ({detail})")

    def sdpa_refusals(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None,
                      dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> dict[str, str]:
        """Why each CUDA backend refuses these inputs on the emulated GPU ("" where it accepts)."""
        return {"flash": self._flash_refusal(q, k, v, mask, dropout_p, is_causal, enable_gqa),
                "efficient": self._efficient_refusal(q, k, v, enable_gqa),
                "math": "",
                "cudnn": self._cudnn_refusal(q, k, v, dropout_p, enable_gqa)}

    def _sm(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    def _flash_refusal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, p: float,
                       causal: bool, gqa: bool) -> str:
        """``can_use_flash_attention`` (cuda/sdp_utils.cpp) for dense inputs."""
        cap, d = self.capability, q.shape[-1]
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return "flash attention needs 4-D query, key and value (check_tensor_shapes)"
        if mask is not None:
            return "flash attention takes no attn_mask (check_for_attn_mask)"
        if not (k.shape[-1] == d == v.shape[-1] and d <= 256):
            return f"flash attention needs head_dim <= 256 and equal for q, k, v (check_head_dim_size_flash), got {d}"
        if not (8, 0) <= cap <= (12, 1):
            return f"flash attention needs sm80..sm121, not {self._sm()}"
        if ((8, 6) <= cap <= (8, 9) or cap >= (12, 0)) and (q.requires_grad or k.requires_grad or v.requires_grad) \
                and (192 < d <= 224 or (d > 224 and p > 0)):
            return f"flash attention cannot train head_dim {d} on {self._sm()}"
        if causal and q.shape[-2] != k.shape[-2]:
            return "flash attention takes is_causal only with seqlen_q == seqlen_k"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"flash attention takes fp16/bf16 only (check_dtypes_flash_attention), not {_dtype_name(q)}"
        return _dense_refusal("flash attention", q, k, v, gqa, ignore_singleton=True)

    def _efficient_refusal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> str:
        """``can_use_mem_efficient_attention`` (cuda/sdp_utils.cpp) for dense inputs; PyTorch 2.13
        builds its head-count check without GQA."""
        cap, d = self.capability, q.shape[-1]
        if not (5, 0) <= cap <= (12, 1):
            return f"memory-efficient attention needs sm50..sm121, not {self._sm()}"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return "memory-efficient attention needs 4-D query, key and value (check_tensor_shapes)"
        half = q.dtype in (torch.float16, torch.bfloat16)
        # minimum_gemm_alignment: 4 on sm80+ (else 1), 128 bits (8 halves, 4 floats) with tensor cores
        # (sm80+, or fp16/bf16 on sm7x)
        align = 8 if half and cap >= (7, 0) else (4 if cap >= (8, 0) else 1)
        if k.shape[-1] != d or d % align or v.shape[-1] % align:
            return (f"memory-efficient attention needs head_dim divisible by {align} in {_dtype_name(q)} "
                    f"(check_head_dim_size_mem_efficient), got {d}")
        if cap >= (8, 0) and any(t.storage_offset() % align for t in (q, k, v)):
            return ("memory-efficient attention needs q, k, v storage offsets aligned "
                    "(check_data_ptr_alignment_mem_efficient)")
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or \
                (q.dtype == torch.bfloat16 and cap < (8, 0)):
            return f"memory-efficient attention does not take {_dtype_name(q)} here"
        return _dense_refusal("memory-efficient attention", q, k, v, gqa, ignore_singleton=False, supports_gqa=False)

    def _cudnn_refusal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, gqa: bool) -> str:
        """``can_use_cudnn_attention`` (cuda/sdp_utils.cpp) for dense inputs, cuDNN ``CUDNN_VERSION``."""
        cap = self.capability
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            return "cuDNN attention is not deterministic (check_cudnn_deterministic)"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return "cuDNN attention needs 4-D query, key and value (check_tensor_shapes)"
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"cuDNN attention takes fp16/bf16 only (check_dtypes_low_precision), not {_dtype_name(q)}"
        if not (8, 0) <= cap <= (12, 1):
            return f"cuDNN attention needs sm80..sm121, not {self._sm()}"
        if p * 16 != int(p * 16):
            return ("cuDNN attention needs a dropout probability that is a multiple of 1/16 (check_cudnn_dropout), "
                    f"got {p:g}")
        why = _dense_refusal("cuDNN attention", q, k, v, gqa, ignore_singleton=True, same_kv_heads=False)
        if why:
            return why
        limit = 256 if (cap[0] in (9, 10) and CUDNN_VERSION > 92200) else 128
        d_qk, d_v = q.shape[-1], v.shape[-1]
        if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
            return (f"cuDNN attention (cuDNN {CUDNN_VERSION // 10000}.{CUDNN_VERSION // 100 % 100}) needs head_dim "
                    f"a multiple of 8 and <= {limit} (check_cudnn_tensor_shapes), got {d_qk}")
        if q.shape[0] > 65535 or q.shape[1] > 65535 or k.shape[-2] == 1 or (p > 0 and q.shape[-2] == 1):
            return "cuDNN attention does not take these sizes (check_cudnn_tensor_shapes)"
        return ""


def math_in_input_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, p: float, causal: bool,
                       scale: Any, gqa: bool) -> torch.Tensor:
    """SDPA's math kernel before PyTorch 2.5, which computed half inputs in their own dtype
    (pytorch/pytorch PR #128922 added the fp32 upcast, first in 2.5.0): the ops of
    ``_scaled_dot_product_attention_math`` in aten/src/ATen/native/transformers/attention.cpp at
    pytorch/pytorch 008887dc (the 2.1 line), so autograd saves what it saved there. ``enable_gqa``
    did not exist before 2.5; a grouped call is run as its math kernel runs it since (K/V
    ``repeat_interleave``d to the query's heads)."""
    if gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))  # sqrt of the scale
    query = q * root
    if causal:  # ones(L, S, bool).tril(), made additive (convert_boolean_attn_mask)
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    mask = _additive_mask(mask, q.dtype, float("-inf"))
    attn = torch.matmul(query, k.transpose(-2, -1) * root)
    if mask is not None:
        attn.add_(mask)
    attn = torch.softmax(attn, -1)
    if p > 0:  # at::dropout -> native_dropout on CUDA
        attn = torch.native_dropout(attn, p, True)[0]
    return torch.matmul(attn, v)


def _dtype_name(t: torch.Tensor) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(t.dtype, str(t.dtype))


def _dense_refusal(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, *,
                   ignore_singleton: bool, same_kv_heads: bool = True, supports_gqa: bool = True) -> str:
    """sdp_utils_cpp.h's dense checks: check_batch_size_and_num_heads_dense (GQA only with
    ``enable_gqa`` where the kernel supports it), check_nonzero_sequence_lengths_dense,
    check_last_dim_stride_equals_1_dense."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return f"{kernel} needs query, key and value with the same batch size"
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if not (hq == hk == hv):
        if gqa and not supports_gqa:
            return (f"{kernel} in PyTorch 2.13 takes no grouped-query attention (q and k/v head counts "
                    f"differ: {hq}, {hk}, {hv}; transformers passes enable_gqa)")
        if not gqa:
            return f"{kernel} needs the same number of heads in q, k, v ({hq}, {hk}, {hv}) without enable_gqa"
        if (same_kv_heads and hk != hv) or hq % hk or hq % hv:
            return f"{kernel} needs k/v heads that divide the query heads ({hq}, {hk}, {hv})"
    if 0 in (q.shape[-2], k.shape[-2]):
        return f"{kernel} needs nonzero sequence lengths"
    for t in (q, k, v):
        if t.stride(-1) != 1 and not (ignore_singleton and t.shape[-1] == 1):
            return f"{kernel} needs the last dimension of q, k, v contiguous (stride 1)"
    return ""


def _flash_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, causal: bool,
                  scale: Any) -> torch.Tensor:
    """The flash branch of ``scaled_dot_product_attention`` (attention.cpp): ``pad_last_dim<8, false>``
    pads q, k, v to a head_dim multiple of 8 (``at::pad``: new tensors, which the kernel saves), the
    scale comes from the original head_dim, and ``post_process_flash_output`` slices the output."""
    d = q.shape[-1]
    if d % 8:
        pad = (0, 8 - d % 8)
        q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
    og_scale = scale if scale is not None else 1.0 / d ** 0.5
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=og_scale)[0]
    return out[..., :d] if out.shape[-1] != d else out


def _additive_mask(mask: Any, dtype: torch.dtype, fill: float) -> Any:
    """``convert_boolean_attn_mask`` (attention.cpp): a boolean mask becomes an additive one."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask.logical_not(), fill)
    return mask


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask`` (attention.cpp): memory-efficient attention wants the bias's strides
    aligned to 8 (else ``pad_bias<8>`` pads the last dim and slices it back), expanded to (b, h, L, S)."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        last = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _grouped_mm_out(a: torch.Tensor, b: torch.Tensor, offs: Any, dtype: torch.dtype) -> torch.Tensor:
    """The output ``create_grouped_gemm_output_tensor`` makes on CUDA (rows padded to 16 bytes)."""
    if a.dim() == 2:
        size = [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    else:
        size = [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]
    align = 16 // dtype.itemsize
    padded = -(-size[-1] // align) * align
    stride = [size[1] * padded, padded, 1] if (a.dim() == 2) == (b.dim() == 2) else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=a.device)


class _GroupedMMFallback(torch.autograd.Function):
    """``_grouped_mm`` as CUDA's fallback runs it, for dtypes the meta kernel refuses."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, offs: Any, bias: Any, out_dtype: Any) -> torch.Tensor:
        # GroupedMmBackward0 saves each operand only for the other's gradient (derivatives.yaml,
        # ``_grouped_mm``: ``self`` from ``mat2``, ``mat2`` from ``self``): frozen experts (LoRA) keep
        # no input rows
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
        ctx.a_dtype, ctx.b_layout = a.dtype, (b.size(), b.stride(), b.dtype, b.device)
        ctx.offs = offs
        ctx.bias = None if bias is None else (bias.shape, bias.dtype)
        out = _grouped_mm_out(a, b, offs, out_dtype or a.dtype)
        if bias is not None:
            out.add_(bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:   # _grouped_mm(grad, mat_b^T, offs): an output of mat_a's shape
            ga = _grouped_mm_out(grad, b.transpose(-2, -1), ctx.offs, ctx.a_dtype)
        if ctx.needs_input_grad[1]:   # laid out as mat_b is (as mm's mat2 gradient), so that a
            # transposed weight's gradient comes back in the parameter's own layout
            size, stride, dtype, device = ctx.b_layout
            gb = torch.empty_strided(size, stride, dtype=dtype, device=device)
        gbias = None
        if ctx.needs_input_grad[3] and ctx.bias is not None:
            gbias = torch.empty(ctx.bias[0], dtype=ctx.bias[1], device=grad.device)
        return ga, gb, None, gbias, None


def _memory_stats(allocator: Any) -> dict[str, int]:
    """The keys of ``torch.cuda.memory_stats()`` that the simulation knows."""
    s = allocator.stats
    return {
        "allocated_bytes.all.current": s.allocated, "allocated_bytes.all.peak": s.peak_allocated,
        "reserved_bytes.all.current": s.reserved, "reserved_bytes.all.peak": s.peak_reserved,
        "requested_bytes.all.current": s.requested, "requested_bytes.all.peak": s.peak_requested,
        "active.all.current": s.active_blocks, "allocation.all.allocated": s.num_allocs,
        "allocation.all.freed": s.num_frees, "segment.all.current": allocator.num_segments,
        "num_alloc_retries": s.num_alloc_retries, "num_ooms": s.num_ooms,
        "num_device_alloc": s.num_device_alloc, "num_device_free": s.num_device_free,
    }


def _under(mode: TorchFunctionMode, fn: Callable) -> Callable:
    """``fn`` run with ``mode`` on the function-mode stack (pushed only where it is missing)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if any(m is mode for m in torch.overrides._get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        torch._C._push_on_torch_function_stack(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._pop_torch_function_stack()
    return run


def _weak(t: torch.Tensor) -> Callable[[], Any]:
    import weakref
    try:
        return weakref.ref(t)
    except TypeError:
        return lambda: t


def _flatten(xs: list) -> Iterator[Any]:
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flatten(list(x))
        else:
            yield x


def _bind(func: Callable | None, args: tuple, kwargs: dict, names: tuple, defaults: tuple) -> dict[str, Any]:
    out = dict(zip(names, defaults))
    for n, a in zip(names, args):
        out[n] = a
    for n, a in kwargs.items():
        if n in out:
            out[n] = a
    return out


# ----- torch.cuda and friends ---------------------------------------------------------------------
class _Stream:
    """A CUDA stream (and context manager) that does nothing: the emulation has one timeline."""

    def __init__(self, *a: Any, **k: Any) -> None:
        self.device = torch.device("cuda", 0)

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *a: Any) -> None:
        pass

    def wait_event(self, *a: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_Event":
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *a: Any) -> None:
        pass


def _stream_patches(allocator: Any) -> dict[tuple[Any, str], Any]:
    """``torch.cuda``'s streams, each with an id the allocator keys its pools by: inside
    ``torch.cuda.stream(s)`` (or ``with s:``) the allocator's ``current_stream`` is ``s``'s, so what
    FSDP2 allocates on its all-gather and reduce-scatter streams is cached in those streams' pools,
    as the caching allocator does (``allocator.py``, "Streams"). Work still runs on one timeline:
    waits and events do nothing."""
    ids = itertools.count(1)
    streams: dict[int, _Stream] = {}

    class Stream(_Stream):
        def __init__(self, *a: Any, _id: int | None = None, **k: Any) -> None:
            super().__init__()
            self.stream_id = next(ids) if _id is None else _id
            streams[self.stream_id] = self

        def __enter__(self) -> "_Stream":
            self._outer = allocator.current_stream
            allocator.current_stream = self.stream_id
            return self

        def __exit__(self, *a: Any) -> None:
            allocator.current_stream = self._outer

    default = Stream(_id=0)

    @contextlib.contextmanager
    def stream(s: Any) -> Any:
        if s is None or not hasattr(s, "stream_id"):
            yield
            return
        outer = allocator.current_stream
        allocator.current_stream = s.stream_id
        try:
            yield
        finally:
            allocator.current_stream = outer

    def set_stream(s: Any) -> None:
        allocator.current_stream = getattr(s, "stream_id", 0)

    return {
        (torch.cuda, "current_stream"): lambda *a, **k: streams.get(allocator.current_stream, default),
        (torch.cuda, "default_stream"): lambda *a, **k: default,
        (torch.cuda, "Stream"): Stream,
        (torch.cuda, "stream"): stream,
        (torch.cuda, "set_stream"): set_stream,
    }


class _Event(_Stream):
    """A CUDA event that records nothing and measures zero time."""

    def record(self, *a: Any) -> None:
        pass

    def wait(self, *a: Any) -> None:
        pass

    def elapsed_time(self, *a: Any) -> float:
        return 0.0


def _event_class(allocator: Any) -> type:
    """``torch.cuda.Event`` over the allocator's pending frees (``CachingAllocator.free_pending``:
    blocks freed while the default stream may still read them, ``Tracker.record_stream``). The
    emulation has one timeline and the GPU is taken to lag as far behind the CPU as the code allows:
    an event recorded on it completes only when the CPU waits for it (``synchronize``), and then
    every pending free made before its ``record`` is done (the next ``malloc`` finds it so). This is
    FSDP1's rate limiter, which records a free event after each reshard and waits on the CPU for
    the oldest of two (``fsdp/_runtime_utils.py`` ``_reshard``, ``_unshard``)."""

    class Event(_Event):
        tick = 0

        def record(self, *a: Any) -> None:
            self.tick = getattr(allocator, "pending_tick", 0)

        def synchronize(self) -> None:
            release = getattr(allocator, "release_upto", None)
            if release is not None:
                release(self.tick)

    return Event


def _synchronize(allocator: Any) -> Callable[..., None]:
    """``torch.cuda.synchronize``: the host waits for the GPU, every pending free is done."""
    def synchronize(*a: Any, **k: Any) -> None:
        release = getattr(allocator, "release_all", None)
        if release is not None:
            release()
    return synchronize


def _torch_cuda_patches(allocator: Any, capability: tuple[int, int], cap: int,
                        name: str) -> dict[tuple[Any, str], Any]:
    """``torch.cuda``'s device queries, memory statistics (from ``allocator``), RNG and streams."""
    props = _DeviceProperties(name=name, major=capability[0], minor=capability[1], total_memory=cap,
                              multi_processor_count=132, is_integrated=False, is_multi_gpu_board=False)
    return {
        (torch.cuda, "is_available"): lambda: True,
        (torch.cuda, "is_initialized"): lambda: True,
        (torch.cuda, "_lazy_init"): lambda: None,
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "set_device"): lambda *a, **k: None,
        (torch.cuda, "synchronize"): _synchronize(allocator),
        (torch.cuda, "is_bf16_supported"): lambda *a, **k: capability >= (8, 0),
        (torch.cuda, "get_device_capability"): lambda *a, **k: capability,
        (torch.cuda, "get_device_name"): lambda *a, **k: name,
        (torch.cuda, "get_device_properties"): lambda *a, **k: props,
        (torch.cuda, "memory_allocated"): lambda *a, **k: allocator.allocated,
        (torch.cuda, "max_memory_allocated"): lambda *a, **k: allocator.peak_allocated,
        (torch.cuda, "memory_reserved"): lambda *a, **k: allocator.reserved,
        (torch.cuda, "max_memory_reserved"): lambda *a, **k: allocator.peak_reserved,
        (torch.cuda, "reset_peak_memory_stats"): lambda *a, **k: allocator.reset_peak(),
        (torch.cuda, "reset_max_memory_allocated"): lambda *a, **k: allocator.reset_peak(),
        (torch.cuda, "empty_cache"): lambda *a, **k: allocator.empty_cache(),
        (torch.cuda, "memory_stats"): lambda *a, **k: _memory_stats(allocator),
        (torch.cuda, "mem_get_info"): lambda *a, **k: (cap - allocator.reserved, cap),
        (torch.cuda, "manual_seed"): lambda *a, **k: None,
        (torch.cuda, "manual_seed_all"): lambda *a, **k: None,
        (torch.cuda, "seed"): lambda *a, **k: None,
        (torch.cuda, "get_rng_state"): lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
        (torch.cuda, "set_rng_state"): lambda *a, **k: None,
        (torch.cuda, "get_rng_state_all"): lambda *a, **k: [torch.zeros(16, dtype=torch.uint8)],
        (torch.cuda, "set_rng_state_all"): lambda *a, **k: None,
        (torch.cuda, "Event"): _event_class(allocator),
        (torch.cuda, "device"): lambda *a, **k: contextlib.nullcontext(),
        **_stream_patches(allocator),
    }


def _device_check_patches() -> dict[tuple[Any, str], Any]:
    """Optimizers' foreach / fused / capturable device lists and checkpoint's device inference
    accept the emulated device, so they take their CUDA paths."""
    import torch.optim.optimizer as _opt
    import torch.utils._foreach_utils as _fe
    import torch.utils.checkpoint as _ckpt

    patches: dict[tuple[Any, str], Any] = {}
    foreach_devices = _fe._get_foreach_kernels_supported_devices
    fused_devices = _fe._get_fused_kernels_supported_devices
    patches[(_opt, "_get_foreach_kernels_supported_devices")] = lambda: foreach_devices() + [EMULATED]
    patches[(_opt, "_get_fused_kernels_supported_devices")] = lambda: fused_devices() + [EMULATED]
    patches[(_fe, "_get_foreach_kernels_supported_devices")] = lambda: foreach_devices() + [EMULATED]
    patches[(_fe, "_get_fused_kernels_supported_devices")] = lambda: fused_devices() + [EMULATED]
    if hasattr(_opt, "_get_capturable_supported_devices"):
        cap_devices = _opt._get_capturable_supported_devices
        patches[(_opt, "_get_capturable_supported_devices")] = (
            lambda supports_xla=True: cap_devices(supports_xla) + [EMULATED])
    infer = getattr(_ckpt, "_infer_device_type", None)
    if infer is not None:
        patches[(_ckpt, "_infer_device_type")] = lambda *a: (lambda d: "cuda" if d == EMULATED else d)(infer(*a))
    return patches


def _record_stream_patches(tracker: Any) -> dict[tuple[Any, str], Any]:
    """FSDP1's ``_no_dispatch_record_stream`` (``fsdp/_common_utils.py``, imported by
    ``_flat_param.py`` and ``_runtime_utils.py``) returns at once for a ``meta`` tensor; here it tells
    the tracker (``Tracker.record_stream``), so that the free that follows waits as the caching
    allocator makes it wait."""
    patches: dict[tuple[Any, str], Any] = {}
    try:
        import torch.distributed.fsdp._flat_param as _fp
        import torch.distributed.fsdp._runtime_utils as _ru
    except ImportError:  # a torch built without distributed
        return patches
    for mod in (_fp, _ru):
        if hasattr(mod, "_no_dispatch_record_stream"):
            patches[(mod, "_no_dispatch_record_stream")] = tracker.record_stream
    record = torch.Tensor.record_stream

    def tensor_record_stream(self: torch.Tensor, stream: Any) -> None:
        # an emulated tensor's ``record_stream`` (DeepSpeed ZeRO-3 records each gradient on the current
        # stream, deepspeed/runtime/zero/stage3.py ``__add_grad_to_ipg_bucket``): the emulated streams are
        # no ``torch.Stream``, which the C++ method takes
        if self.device.type == EMULATED:
            return tracker.record_stream(self, stream)
        return record(self, stream)
    patches[(torch.Tensor, "record_stream")] = tensor_record_stream
    return patches


def _emulation_patches(emulation: CudaEmulation | None) -> dict[tuple[Any, str], Any]:
    """``torch.clear_autocast_cache`` also clears the emulation's weight-cast cache; Python that
    runs inside backward runs under the emulation."""
    patches: dict[tuple[Any, str], Any] = {}
    orig_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        orig_clear()
        if emulation is not None:
            emulation.clear_cache()

    patches[(torch, "clear_autocast_cache")] = clear_autocast_cache
    if emulation is not None and emulation.tracker is not None:
        patches.update(_record_stream_patches(emulation.tracker))
    if emulation is not None:
        # The autograd engine does not carry TorchFunctionModes into backward, yet Python runs there:
        # activation-checkpoint recomputation (a saved-tensor unpack hook or a custom Function's
        # backward). Run those under the emulation too.
        import torch.autograd.function as _fn
        import torch.autograd.graph as _graph

        hooks_init = _graph.saved_tensors_hooks.__init__
        backward_apply = _fn.BackwardCFunction.apply

        def init(self: Any, pack_hook: Callable, unpack_hook: Callable) -> None:
            hooks_init(self, pack_hook, _under(emulation, unpack_hook))

        def apply(self: Any, *args: Any) -> Any:
            return _under(emulation, backward_apply)(self, *args)

        patches[(_graph.saved_tensors_hooks, "__init__")] = init
        patches[(_fn.BackwardCFunction, "apply")] = apply
        # tensor hooks and engine callbacks (FSDP2's pre-backward unshard and its end-of-backward
        # callback, torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``_register_pre_backward_hook``
        # and ``_root_pre_forward``'s ``queue_callback``) allocate with ``device="cuda"`` too
        register_hook = torch.Tensor.register_hook

        def tensor_register_hook(self: Any, hook: Callable) -> Any:
            return register_hook(self, _under(emulation, hook))

        register_post_accumulate = torch.Tensor.register_post_accumulate_grad_hook

        def tensor_post_accumulate_hook(self: Any, hook: Callable) -> Any:
            # (DeepSpeed ZeRO 1/2's gradient hooks, deepspeed/utils/torch.py ``register_grad_hook``,
            # fill buckets made with ``device=get_accelerator().current_device_name()``)
            return register_post_accumulate(self, _under(emulation, hook))

        from torch.autograd.variable import Variable
        patches[(torch.Tensor, "register_hook")] = tensor_register_hook
        patches[(torch.Tensor, "register_post_accumulate_grad_hook")] = tensor_post_accumulate_hook
        patches[(Variable, "_execution_engine")] = _EngineUnder(Variable._execution_engine, emulation)
    return patches


class _EngineUnder:
    """The autograd engine (``Variable._execution_engine``) whose ``queue_callback`` runs the
    callback under the emulation; everything else is the engine's own."""

    def __init__(self, engine: Any, emulation: CudaEmulation) -> None:
        self._engine, self._emulation = engine, emulation

    def queue_callback(self, callback: Callable) -> Any:
        return self._engine.queue_callback(_under(self._emulation, callback))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@contextlib.contextmanager
def _patched(patches: dict[tuple[Any, str], Any]) -> Iterator[None]:
    """Set each (object, attribute) to its value; restore (or delete) the originals on exit."""
    saved = {}
    for (obj, attr), val in patches.items():
        saved[(obj, attr)] = vars(obj).get(attr, _MISSING)
        setattr(obj, attr, val)
    try:
        yield
    finally:
        for (obj, attr), val in saved.items():
            if val is _MISSING:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, val)


def _autocast_patches() -> dict[tuple[Any, str], Any]:
    """Autocast queried or entered by the device type of a tensor (``x.device.type``): on the emulated GPU
    that is ``meta``, which stands for ``cuda``. ``torch.get_autocast_dtype`` raises for it
    (``unsupported scalarType``: NVIDIA Nemotron's ``NemotronLayerNorm1P``, transformers 5.24
    ``models/nemotron/modeling_nemotron.py`` L54-59 and L75-80, casts its arguments to the autocast dtype and
    runs ``F.layer_norm`` with autocast off), ``torch.is_autocast_enabled("meta")`` is False, and
    transformers' ``maybe_autocast`` (``utils/generic.py`` L228-253) returns a no-op for ``meta``: a
    model's "autocast off" block (the rotary embeddings' fp32 ``inv_freq @ position_ids``, that layer norm)
    would run under CUDA autocast. Each answers for ``cuda``, as on the GPU."""
    import sys

    def cuda(d: Any) -> Any:
        return "cuda" if d == EMULATED else d
    dtype_of, enabled = torch.get_autocast_dtype, torch.is_autocast_enabled
    patches: dict[tuple[Any, str], Any] = {
        (torch, "get_autocast_dtype"): lambda device_type: dtype_of(cuda(device_type)),
        (torch, "is_autocast_enabled"): lambda *a: enabled(*(cuda(x) for x in a)),
    }
    generic = sys.modules.get("transformers.utils.generic")
    original = getattr(generic, "maybe_autocast", None)
    if original is None:
        return patches

    def maybe_autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return original(cuda(device_type), *args, **kwargs)
    for name, mod in list(sys.modules.items()):
        if name.startswith("transformers") and getattr(mod, "maybe_autocast", None) is original:
            patches[(mod, "maybe_autocast")] = maybe_autocast
    return patches


@contextlib.contextmanager
def cuda_environment(allocator: Any, *, capability: tuple[int, int] = (8, 0), capacity: int | None = None,
                     name: str = "trainmem emulated GPU", emulation: CudaEmulation | None = None) -> Iterator[None]:
    """Patch ``torch.cuda`` (and the optimizer device checks) so CUDA code takes its CUDA paths."""
    cap = capacity or 80 * 1024 ** 3
    patches = _torch_cuda_patches(allocator, capability, cap, name)
    patches.update(_device_check_patches())
    patches.update(_emulation_patches(emulation))
    patches.update(_autocast_patches())
    with _patched(patches):
        yield


_MISSING = object()
