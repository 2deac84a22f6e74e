"""PyTorch's own FSDP2 memory tracker on the setup ``trace`` runs: the reference it is checked against.

:func:`fsdp_mem_tracker` runs ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (torch
2.13 ``torch/distributed/_tools/fsdp2_mem_tracker.py``, a ``TorchDispatchMode`` over
``mem_tracker.MemTracker``) on the same model, the same FSDP2 wrapping, the same training step and
the same fake process group as ``trace(model, dp=N, fsdp=...)``, on trainmem's emulated GPU, with
trainmem's tracker and allocator simulation left out. It returns the tracker's peak snapshot of
the emulated device: bytes per ``_FSDPRefType`` ("Sharded Param", "Unsharded Param", "All
Gather", "Reduce Scatter", "Activation", "Temp", "OptState", ...) and "Total".

What differs on purpose between the two (``docs/trace.md``, "FSDP2 against FSDPMemTracker"):

* FSDPMemTracker counts tensor storages; trace counts allocator blocks: each request rounded up to
  512 B (``_WeakRefInfo._calculate_mem_consumed`` rounds only on a ``cuda`` device, and the emulated
  GPU is ``meta``), and a large block's unsplit remainder;
* trace adds what no tensor stands for: the cuBLAS workspace of the forward thread and of autograd's
  (``CublasHandlePool.cpp``; FSDPMemTracker's own GPU tests allocate it before measuring and
  subtract it, ``test/distributed/_tools/test_fsdp2_mem_tracker.py`` ``_init_cublas_workspace``)
  and in-kernel scratch (flash attention's backward);
* FSDPMemTracker's peak is the largest tensor total after any op; trace's is the largest block total,
  which can fall on another op when rounding reorders two nearly equal moments.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import TrainmemError
from ..spec.resolve import resolve
from .. import litgpt_modules
from ..workload import TrainStep, apply_lora, hf_factory
from ..wrappers import fsdp2, mesh
from . import distributed as _dist
from .cuda import _patched

_aten = torch.ops.aten


class _CleanBatch(TorchDispatchMode):
    """Answer data-dependent reads of tensors without data as trace's tracker does (``all()`` True,
    other booleans False, numbers 1), so the model's Python control flow takes the same branches."""

    def __init__(self) -> None:
        super().__init__()
        self._all: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _dist_types(types):
            return NotImplemented
        if func is _aten._local_scalar_dense.default and args[0].device.type == "meta":
            t = args[0]
            if t.dtype == torch.bool:
                return id(t.untyped_storage()) in self._all
            return 1.0 if t.is_floating_point() else 1
        out = func(*args, **(kwargs or {}))
        if func in (_aten.all.default, _aten.all.dim) and isinstance(out, torch.Tensor):
            if len(self._all) > 64:
                self._all.clear()
            self._all.add(id(out.untyped_storage()))
        return out


def _dist_types(types: Any) -> bool:
    from torch.distributed.tensor import DTensor
    return any(issubclass(t, DTensor) for t in types)


def fsdp_mem_tracker(model: Any, steps: int = 2, **options: Any) -> dict[str, int]:
    """FSDPMemTracker's peak snapshot (bytes per reference type, and "Total") of rank 0 of
    ``trace(model, steps, **options)`` with ``fsdp`` set: the same model, FSDP2 units, step and fake
    group. ``reset_mod_stats()`` is called before each forward, as FSDPMemTracker's tests do between
    iterations (it refuses to see the root run twice otherwise); its peak is kept."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from .api import TRACED_MICRO_BATCHES, _cast, _device
    r = resolve(model, **options)
    spec, t = r.model, r.training
    if t.fsdp is None:
        raise TrainmemError("fsdp_mem_tracker compares FSDP2 setups: give fsdp='full' or 'grad-op' and dp")
    _dist.check(t, spec, "cuda")
    dev = _device(True, r.hardware, t, False, None, None, None, None, False)
    with dev.env, dev.emulation, _dist.fake_group(t.dp), _patched(_dist.patches(dev.tracker)):
        with dev.build_ctx:
            module = hf_factory(spec, t)()
            _cast(module, spec, t)
            module = litgpt_modules.apply(apply_lora(module, spec, t), t)
        fsdp2(module, spec, t, mesh(t, "cuda")["dp"])
        module.train()
        fmt: Any = None

        def on_phase(name: str, step: int, micro: int | None) -> None:
            if name == "backward":
                fmt.reset_mod_stats()  # the next forward runs the root again

        step = TrainStep(module, spec, t, "cuda", on_phase=on_phase)
        step.micro_batches = min(step.micro_batches, TRACED_MICRO_BATCHES)  # as trace runs them
        fmt = FSDPMemTracker(module, step.optimizer)
        with _CleanBatch(), fmt:
            for i in range(1, steps + 1):
                step(i)
        peak = fmt.get_tracker_snapshot("peak").get(torch.device("meta"), {})
    return {getattr(k, "value", k): int(v) for k, v in peak.items()}
