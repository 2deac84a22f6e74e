"""Where a CUDA run allocates differently from trace's dispatch-mode run of the same code.

trace runs the real PyTorch code, but on ``meta`` tensors and under a ``TorchDispatchMode`` (the
:class:`~trainmem.trace.tracker.Tracker`). ``at::isTensorSubclassLike``
(aten/src/ATen/TensorSubclassLikeUtils.h) is then true for every tensor: while a Python dispatch
mode is active (``c10::impl::dispatch_mode_enabled()``) and for any meta tensor
(``BackendComponent::MetaBit`` is in ``kTensorSubclassLike``). C++ code that checks it takes an
out-of-place path in trace where a plain CUDA tensor takes an in-place one. Modelled here:
``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp) adds its
mask with ``attn = attn.add(*attn_mask)`` on a subclass and ``attn.add_(*attn_mask)`` otherwise.
The out-of-place sum replaces the matmul's scores, which die at once, so the CUDA run writes into
the scores' block where trace allocates a second one; :func:`adoptable` recognises the op and the
tracker lets the sum take over the scores' block when the next thing that happens is their free
(``Tracker.cpp_inplace``).

Found, and not modelled yet (docs/trace.md, "The allocator against the H200 runs"):

* ``InputBuffer`` accumulation (torch/csrc/autograd/input_buffer.cpp ``accumulate``): a gradient
  reaching an input that already holds one is added with ``old_var.add_(var)`` when
  ``can_accumulate_inplace(old_var)`` (a plain, non-overlapping dense tensor whose last reference
  the buffer holds) and ``!isTensorSubclassLike(var)``, else ``buffer[pos] = old_var + var``: every
  fan-out point of the forward (residual stream, q/k/v input, a tied embedding) is summed in place
  on CUDA and out of place in trace. Modelled (commit d199423), it lowers trace's backward peak of a
  tied-embedding model by one embedding gradient, which the estimate's reserved replay does not
  model yet (tests/test_reserved_replay.py).
* ``index_backward`` and ``value_selecting_reduction_backward`` (torch/csrc/autograd/
  FunctionsManual.cpp): ``index_put``/``scatter`` on a subclass, ``_index_put_impl_``/``scatter_``
  in place otherwise.
* Temporaries of ``CompositeExplicitAutograd`` kernels, which run below the Python dispatch key
  where no mode sees them: ``_safe_softmax`` (attention.cpp) makes a softmax output, an ``eq`` mask
  and an ``all`` row mask before its ``where`` result.

Each is what CUDA runs, yet modelling the last two moved the H200 fixtures' reserved away from the
measurements (mixtral-small rc-full 0.00 % to -9.3 %; fp32 -1.08 % to -8.9 %), so something else
still differs there.
"""
from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

#: functional ops that C++ code runs in place on a plain CUDA tensor (see the module docstring)
SUBCLASS_FUNCTIONAL = frozenset({aten.add.Tensor})


def _dense(t: torch.Tensor) -> bool:
    """``TensorImpl::is_non_overlapping_and_dense`` (a permutation of a contiguous layout)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    return bool(is_non_overlapping_and_dense_or_false(t))


def adoptable(func: Any, args: tuple, kwargs: dict, out: Any) -> torch.Tensor | None:
    """The input whose block ``out`` takes on CUDA if that input dies at once, or None.

    ``func`` must be one of :data:`SUBCLASS_FUNCTIONAL`; the caller checks the context (inside
    the math SDPA kernel). ``add_`` writes into its first argument, so ``out`` must have its shape,
    dtype and storage size (the other operand broadcasts into it: the kernel's (L, S) mask), the
    first argument must be non-overlapping and dense and not share its storage with the other, and
    ``alpha`` must be the default."""
    if func not in SUBCLASS_FUNCTIONAL or not args or not isinstance(out, torch.Tensor):
        return None
    a = args[0]
    if not isinstance(a, torch.Tensor) or a.shape != out.shape or a.dtype != out.dtype:
        return None
    other = args[1] if len(args) > 1 else None
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if not isinstance(other, torch.Tensor) or alpha != 1:      # other broadcasts into a's shape
        return None
    if not _dense(a):
        return None
    if other.device == a.device and id(other.untyped_storage()) == id(a.untyped_storage()):
        return None                     # one storage twice (``h + h``): not the last reference
    try:
        if a.untyped_storage().nbytes() != out.untyped_storage().nbytes():
            return None
    except (RuntimeError, NotImplementedError):
        return None
    return a
