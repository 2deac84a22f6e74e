"""Where a CUDA run allocates differently from trace's dispatch-mode run of the same code.

trace runs the real PyTorch code, but on ``meta`` tensors and under a ``TorchDispatchMode`` (the
:class:`~trainmem.trace.tracker.Tracker`). Two things then differ from a plain CUDA run, and both
change which blocks the caching allocator hands out (so the reserved memory), some also the peak:

**Tensor-subclass-like branches.** ``at::isTensorSubclassLike`` (aten/src/ATen/TensorSubclassLikeUtils.h)
is true for every tensor while a Python dispatch mode is active (``c10::impl::dispatch_mode_enabled()``)
and for every meta tensor (``BackendComponent::MetaBit`` is in ``kTensorSubclassLike``). C++ code
that checks it takes an out-of-place path there and an in-place one on a plain CUDA tensor:

* ``InputBuffer`` accumulation (torch/csrc/autograd/input_buffer.cpp ``accumulate``): a gradient
  that reaches an input already holding one is added with ``old_var.add_(var)`` when
  ``can_accumulate_inplace(old_var)`` (a plain, non-overlapping dense tensor that the buffer holds
  the last reference to, tensor and storage) and ``!isTensorSubclassLike(var)``; else
  ``buffer[pos] = old_var + var``. Every fan-out point of the forward (the residual stream, the
  normalised input of the q/k/v projections, ...) accumulates so in the backward.
* ``index_backward`` (torch/csrc/autograd/FunctionsManual.cpp): ``zeros_like_self.index_put(...)``
  on a subclass, ``at::_index_put_impl_(zeros_like_self, ...)`` (in place) otherwise.
* ``value_selecting_reduction_backward`` (same file; ``topk``, ``sort``, ``max.dim`` backward):
  ``grad_in.scatter(...)`` on a subclass, ``grad_in.scatter_(...)`` otherwise.
* ``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp):
  ``attn = attn.add(*attn_mask)`` on a subclass, ``attn.add_(*attn_mask)`` otherwise.

In each case the out-of-place result replaces a tensor that dies at once, so the CUDA run writes
into that tensor's block while trace allocates a second one. :func:`adoptable` recognises such an
op; the tracker then lets the result take over the dying tensor's block when (and only when) the
next thing that happens is that tensor's free, which is exactly the "last reference" condition of
``can_accumulate_inplace`` (anything else holding it would keep it alive).

**Temporaries a dispatch mode cannot see.** A ``CompositeExplicitAutograd`` kernel runs its ATen
ops below the Python dispatch key, so the mode sees the op and its result but none of its
temporaries. ``_safe_softmax`` (attention.cpp; the math SDPA kernel's softmax) makes a softmax
output, an ``eq`` mask and an ``all`` row mask before its result (``where``), then frees them:
:func:`safe_softmax` runs the same ops in the same order, each allocation seen.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Callable

import torch

aten = torch.ops.aten

#: functional ops that C++ code runs in place on a plain CUDA tensor (see the module docstring)
SUBCLASS_FUNCTIONAL = frozenset({aten.add.Tensor, aten.index_put.default, aten.scatter.src})

#: Python frames between the engine's C++ and a dispatch mode's handler that are not the caller
_WRAPPER_FILES = ("torch/_dynamo/", "torch/_compile.py", "torch/utils/_python_dispatch.py",
                  "trainmem/trace/tracker.py", "trainmem/trace/fsdp_tracker.py", "trainmem/trace/cuda_kernels.py")


def _dense(t: torch.Tensor) -> bool:
    """``TensorImpl::is_non_overlapping_and_dense`` (a permutation of a contiguous layout)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    return bool(is_non_overlapping_and_dense_or_false(t))


def issued_by_autograd_engine() -> bool:
    """Whether the op being dispatched was issued by C++ inside autograd's engine (an
    ``InputBuffer`` accumulation or a derivative formula), not by Python code (a custom
    ``autograd.Function``'s backward, a recomputed forward): the nearest Python frame is the one
    that entered the engine (torch/autograd/graph.py ``_engine_run_backward``)."""
    f = sys._getframe(1)
    while f is not None and any(w in f.f_code.co_filename.replace("\\", "/") for w in _WRAPPER_FILES):
        f = f.f_back
    return f is not None and f.f_code.co_name == "_engine_run_backward"


def adoptable(func: Any, args: tuple, kwargs: dict, out: Any) -> torch.Tensor | None:
    """The input whose block ``out`` takes on CUDA if that input dies at once, or None.

    ``func`` must be one of :data:`SUBCLASS_FUNCTIONAL`; the caller checks the context (the
    autograd engine's C++, or the math SDPA kernel). The in-place variant writes into its first
    argument, so ``out`` must have its shape, dtype and storage size (the other operand broadcasts
    into it: the math SDPA kernel's (L, S) mask), and the first argument must be non-overlapping and
    dense (``can_accumulate_inplace``); ``add`` with the default ``alpha``."""
    if func not in SUBCLASS_FUNCTIONAL or not args or not isinstance(out, torch.Tensor):
        return None
    a = args[0]
    if not isinstance(a, torch.Tensor) or a.shape != out.shape or a.dtype != out.dtype:
        return None
    if func is aten.add.Tensor:
        other = args[1] if len(args) > 1 else None
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        if not isinstance(other, torch.Tensor) or alpha != 1:   # other broadcasts into a's shape
            return None
    if not _dense(a):
        return None
    try:
        if a.untyped_storage().nbytes() != out.untyped_storage().nbytes():
            return None
    except (RuntimeError, NotImplementedError):
        return None
    return a


def safe_softmax(register: Callable[[Any, torch.Tensor], Any], x: torch.Tensor, dim: int,
                 dtype: Any = None) -> torch.Tensor | None:
    """``_safe_softmax`` as its ``CompositeExplicitAutograd`` kernel runs on CUDA
    (aten/src/ATen/native/transformers/attention.cpp ``_safe_softmax``)::

        auto out = at::softmax(self, dim, dtype);
        const auto neg_inf = at::scalar_tensor(-inf, out.options());
        const auto masked = self.eq(neg_inf);
        const auto masked_rows = all(masked, dim, true);
        const auto zero = at::scalar_tensor(0.0, out.options());
        return at::where(masked_rows, zero, out);

    with each tensor passed to ``register`` as it is made; the temporaries are then dropped in
    the order C++ destroys the locals (reverse declaration). For ``x`` of shape (b, h, L, S):
    ``out`` (b, h, L, S) in x's dtype, ``masked`` (b, h, L, S) bool, ``masked_rows`` (b, h, L, 1)
    bool, two 0-dim scalars, the result (b, h, L, S). Returns None (the op then runs as it is)
    when ``dtype`` asks for a conversion, which ``at::softmax`` makes in ways not modelled here."""
    if dtype is not None and dtype != x.dtype:
        return None
    out = aten._softmax.default(x, dim, False)            # at::softmax -> _softmax(self, dim, false)
    register(aten._softmax.default, out)
    neg_inf = aten.scalar_tensor.default(-math.inf, dtype=out.dtype, device=out.device)
    register(aten.scalar_tensor.default, neg_inf)
    masked = aten.eq.Tensor(x, neg_inf)
    register(aten.eq.Tensor, masked)
    masked_rows = aten.all.dim(masked, dim, True)
    register(aten.all.dim, masked_rows)
    zero = aten.scalar_tensor.default(0.0, dtype=out.dtype, device=out.device)
    register(aten.scalar_tensor.default, zero)
    result = aten.where.self(masked_rows, zero, out)
    register(aten._safe_softmax.default, result)         # the op's result, named after it
    del zero, masked_rows, masked, neg_inf, out           # destroyed in reverse declaration order
    return result
