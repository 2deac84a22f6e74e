"""torchao's low-bit AdamW (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) emulated on tensors without
data, for ``trace``.

torchao's step is ``torch.compile(single_param_adam)`` per parameter (torchao 0.18.0
``torchao/optim/adam.py`` L100-159), which cannot run on the fake CUDA tensors ``trace`` uses. What
matters for memory is which device tensors the states are and which buffers the compiled graph
allocates and frees; this class allocates exactly those (``estimate.torchao_optim``: the states of
``_new_buffer`` and ``OptimStateXbit.zeros``, the step's buffers read off inductor's code for the
real optimizer) with ordinary PyTorch ops the tracker sees, and updates the states and the
parameter in place, as the compiled graph writes its mutated inputs back.
tests/test_torchao_optim.py compares both against the real torchao on the CPU.

``measure`` runs the real torchao; nothing here is used on a real GPU.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .estimate import torchao_optim

#: the codes' dtype of each layout (subclass_8bit/4bit.py: uint8; subclass_fp8.py: float8_e4m3fn)
_CODES = {8: torch.uint8, 4: torch.uint8, "fp8": torch.float8_e4m3fn}


class LowBitAdamW(torch.optim.Optimizer):
    """torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` as they allocate (``optimizer``: the
    trainmem name, ``block_size`` as torchao takes it). States, per parameter at its first step:
    ``step`` a host scalar, then ``exp_avg`` and ``exp_avg_sq`` (``_new_buffer``), each either
    ``zeros_like(p)`` or the subclass's tensors, kept here as ``<name>``, ``<name>.scale`` and
    ``<name>.qmap`` (the codes, the fp32 scale per block, the fp32 map made on the device for every
    state: ``torch.tensor(qmap_list, device=device)``)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, optimizer: str = "adamw-torchao-8bit",
                 block_size: int | None = None) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.name = optimizer
        self.block_size = block_size or torchao_optim.default_block(optimizer)

    def _new_buffer(self, p: torch.Tensor, state: dict, key: str) -> None:
        """``_AdamBase._new_buffer`` (adam.py L71-98) and ``OptimStateXbit.zeros``."""
        n = p.numel()
        if not torchao_optim.quantized(n, self.block_size):
            state[key] = torch.zeros_like(p)                                       # p's dtype and shape
            return
        bits, _, qmap = torchao_optim.TORCHAO_LAYOUTS[self.name]
        shape = (n // 2,) if bits == 4 else p.shape                                # 4-bit: flat, two per byte
        state[key] = torch.zeros(shape, dtype=_CODES[bits], device=p.device)       # codes
        state[key + ".scale"] = torch.zeros(n // self.block_size, dtype=torch.float32, device=p.device)
        if qmap:
            state[key + ".qmap"] = torch.zeros(qmap, dtype=torch.float32).to(p.device)  # built on the host, moved

    def _compiled_step(self, p: torch.Tensor, state: dict, lr: float, wd: float) -> None:
        """One ``single_param_adam`` graph: its buffers (``torchao_optim.step_events``) allocated and
        freed in inductor's order, the states and the parameter written in place."""
        live: list[torch.Tensor] = []
        for e in torchao_optim.step_events(self.name, p.numel(), self.block_size):
            if e > 0:
                live.append(torch.empty(e, dtype=torch.uint8, device=p.device))
            else:
                live.remove(next(b for b in live if b.numel() == -e))
        for key in ("exp_avg", "exp_avg_sq"):
            if state[key].dtype == p.dtype:
                state[key].copy_(p.grad)
        p.mul_(1.0 - lr * wd).add_(p.grad, alpha=-lr)
        del live

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``_AdamBase.step``: each parameter with a gradient, its states at its first step, then its
        compiled update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)                              # host fp32 scalar
                    self._new_buffer(p, state, "exp_avg")
                    self._new_buffer(p, state, "exp_avg_sq")
                state["step"] += 1
                self._compiled_step(p, state, group["lr"], group["weight_decay"])
        return loss


def optimizer_class(name: str, block_size: int) -> tuple[type, dict[str, Any]]:
    """The emulated class and its keyword arguments for a trainmem torchao optimizer name."""
    return LowBitAdamW, {"optimizer": name, "block_size": block_size}
