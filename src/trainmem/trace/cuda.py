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
* **Scaled dot-product attention.** The CUDA backend is chosen as PyTorch does (flash attention for
  fp16/bf16 without an explicit mask and head_dim <= 256, else memory-efficient attention, else the
  math path) and that backend's op runs, so autograd saves what it saves on a GPU (flash: output
  and logsumexp). ``attention_backend`` forces one.
* **Optimizers.** ``foreach`` (and ``fused``) implementations are available for device tensors, so
  ``torch.optim`` defaults to foreach as it does on CUDA.
* **cuBLAS workspace** and in-kernel scratch buffers are added by the tracker (``Tracker``).
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

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
                 capability: tuple[int, int] = (8, 0)) -> None:
        super().__init__()
        if attention_backend not in (None, "flash", "efficient", "math"):
            raise ValueError(f"attention_backend {attention_backend!r}: use flash, efficient, math or None")
        self.tracker = tracker
        self.attention_backend = attention_backend
        self.capability = capability
        self._cast_cache: dict[int, tuple[Any, torch.Tensor]] = {}
        self.sdpa_choices: dict[str, int] = {}
        self.host_reads = 0

    # ----- dispatch --------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "to" or name == "_to":
            args = tuple(_map_device(a) for a in args)
        elif name == "cuda":
            return args[0].to(EMULATED, non_blocking=kwargs.get("non_blocking", False))
        elif name in ("cpu", "numpy", "tolist", "item", "pin_memory") and args \
                and isinstance(args[0], torch.Tensor) and args[0].device.type == EMULATED:
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

    def _host_read(self, name: str, t: torch.Tensor) -> Any:
        self.host_reads += 1
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
        ctx = self.tracker.label("autocast_cast") if self.tracker else contextlib.nullcontext()
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
        backend = self.attention_backend or self._choose_backend(q, k, v, mask, gqa)
        if backend == "flash" and not self._flash_ok(q, k, v, mask, gqa):
            backend = "efficient" if self._efficient_ok(q, k, v, gqa) else "math"
        if backend == "efficient" and not self._efficient_ok(q, k, v, gqa):
            backend = "math"
        self.sdpa_choices[backend] = self.sdpa_choices.get(backend, 0) + 1
        aten = torch.ops.aten
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
        if backend == "efficient":
            need_lse = q.requires_grad or k.requires_grad or v.requires_grad
            if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
                # the CUDA path turns a boolean mask into an additive one first
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                    mask.logical_not(), float("-inf"))
            return aten._scaled_dot_product_efficient_attention(q, k, v, mask, need_lse, p, causal,
                                                                 scale=scale)[0]
        return aten._scaled_dot_product_attention_math(q, k, v, mask, p, causal, None, scale=scale,
                                                       enable_gqa=gqa)[0]

    def _choose_backend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, gqa: bool) -> str:
        # respects torch.backends.cuda.enable_*_sdp / torch.nn.attention.sdpa_kernel restrictions
        cuda = torch.backends.cuda
        if cuda.flash_sdp_enabled() and self._flash_ok(q, k, v, mask, gqa):
            return "flash"
        if cuda.mem_efficient_sdp_enabled() and self._efficient_ok(q, k, v, gqa):
            return "efficient"
        return "math"

    def _flash_ok(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, gqa: bool) -> bool:
        d = q.shape[-1]
        return (q.dim() == 4 and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
                and v.dtype == q.dtype and mask is None and d <= 256 and d % 8 == 0 and v.shape[-1] == d
                and (q.shape[1] == k.shape[1] or gqa) and self.capability >= (8, 0))

    def _efficient_ok(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
        d = q.shape[-1]
        align = 4 if q.dtype == torch.float32 else 8
        return (q.dim() == 4 and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and d % align == 0 and v.shape[-1] % align == 0 and q.shape[1] == k.shape[1] and not gqa)


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
        ctx.save_for_backward(a, b)
        ctx.offs = offs
        ctx.bias = None if bias is None else (bias.shape, bias.dtype)
        out = _grouped_mm_out(a, b, offs, out_dtype or a.dtype)
        if bias is not None:
            out.add_(bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:   # _grouped_mm(grad, mat_b^T, offs): an output of mat_a's shape
            ga = _grouped_mm_out(grad, b.transpose(-2, -1), ctx.offs, a.dtype)
        if ctx.needs_input_grad[1]:   # laid out as mat_b is (as mm's mat2 gradient), so that a
            # transposed weight's gradient comes back in the parameter's own layout
            gb = torch.empty_strided(b.size(), b.stride(), dtype=b.dtype, device=b.device)
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

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *a: Any) -> None:
        pass


class _Event(_Stream):
    """A CUDA event that records nothing and measures zero time."""

    def record(self, *a: Any) -> None:
        pass

    def elapsed_time(self, *a: Any) -> float:
        return 0.0


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
        (torch.cuda, "synchronize"): lambda *a, **k: None,
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
        (torch.cuda, "current_stream"): lambda *a, **k: _Stream(),
        (torch.cuda, "default_stream"): lambda *a, **k: _Stream(),
        (torch.cuda, "Stream"): _Stream,
        (torch.cuda, "Event"): _Event,
        (torch.cuda, "stream"): lambda *a, **k: contextlib.nullcontext(),
        (torch.cuda, "device"): lambda *a, **k: contextlib.nullcontext(),
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
    return patches


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


@contextlib.contextmanager
def cuda_environment(allocator: Any, *, capability: tuple[int, int] = (8, 0), capacity: int | None = None,
                     name: str = "trainmem emulated GPU", emulation: CudaEmulation | None = None) -> Iterator[None]:
    """Patch ``torch.cuda`` (and the optimizer device checks) so CUDA code takes its CUDA paths."""
    cap = capacity or 80 * 1024 ** 3
    patches = _torch_cuda_patches(allocator, capability, cap, name)
    patches.update(_device_check_patches())
    patches.update(_emulation_patches(emulation))
    with _patched(patches):
        yield


_MISSING = object()
