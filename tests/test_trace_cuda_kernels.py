"""CUDA's in-place paths that trace's dispatch mode turns out of place (``trace.cuda_kernels``).

Under a Python dispatch mode, and for meta tensors, ``at::isTensorSubclassLike`` is true: the math
SDPA kernel then adds its mask out of place (attention.cpp), where CUDA runs ``attn.add_``; the
tracker lets the sum take over the scores' block. The autograd engine's ``InputBuffer`` takes the
same branch (``old_var + var`` for ``old_var.add_(var)``, input_buffer.cpp): seen here, not modelled.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainmem.allocator import CachingAllocator
from trainmem.trace.cuda import CudaEmulation
from trainmem.trace.tracker import Tracker

MiB = 1 << 20


def _run(fn, emulate: bool = True) -> tuple[Tracker, CachingAllocator]:
    alloc = CachingAllocator()
    tracker = Tracker(alloc, device_type="meta", emulate_cuda_kernels=emulate)
    with tracker:
        fn(tracker)
    tracker.finish()
    return tracker, alloc


def _adds(tracker: Tracker) -> list:
    return [r for r in tracker.records if r.op == "add.Tensor" and r.phase != "forward"]


def test_the_dispatch_mode_makes_the_engine_accumulate_out_of_place():
    """The premise, seen from a bare dispatch mode: the accumulation arrives as ``add.Tensor``."""
    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, device="meta", requires_grad=True)
    with Log():
        h = x * 2
        ((h * 3).sum() + (h * 4).sum()).backward()
    assert torch.ops.aten.add.Tensor in ops and torch.ops.aten.add_.Tensor not in ops


def _python_add(tracker: Tracker) -> None:
    x = torch.randn(1024, 1024, device="meta")
    y = torch.randn(1024, 1024, device="meta")
    x = x * 2
    x = x + y                                  # Python: out of place on CUDA too, the old x dies after


def test_an_add_outside_the_math_kernel_stays_out_of_place():
    tracker, alloc = _run(_python_add)
    plain, plain_alloc = _run(_python_add, emulate=False)
    assert alloc.stats.num_allocs == plain_alloc.stats.num_allocs
    assert alloc.peak_allocated == plain_alloc.peak_allocated


def _math_sdpa(tracker: Tracker) -> None:
    emu = CudaEmulation(tracker, attention_backend="math", capability=(9, 0))
    q, k, v = (torch.randn(1, 4, 512, 64, device="meta", requires_grad=True) for _ in range(3))
    with emu:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_math_sdpa_adds_its_mask_in_place():
    """attention.cpp: ``attn.add_(*attn_mask)`` on a plain tensor: the (1, 4, 512, 512) fp32 scores
    (4 MiB) of the matmul are the ones the mask is added to, no second block."""
    tracker, alloc = _run(_math_sdpa)
    plain, plain_alloc = _run(_math_sdpa, emulate=False)
    scores = [r for r in tracker.records if r.nbytes == 4 * MiB and r.op in ("bmm", "add.Tensor")]
    assert [r.op for r in scores] == ["bmm", "add.Tensor"]
    assert scores[0].free_event == scores[1].alloc_event - 1 and scores[0].handle is None
    assert plain_alloc.stats.num_allocs - alloc.stats.num_allocs == 1
