"""bitsandbytes emulated on tensors without data, for ``trace``: the 8-bit and paged optimizers, a
Lion optimizer, and 4-bit (NF4/FP4) base linears with their matmul.

bitsandbytes runs CUDA kernels; ``trace`` runs the real training step on ``meta`` tensors with CUDA
emulated, where those kernels cannot run. What matters for memory is which device tensors each
piece allocates and frees, and in what dtype and shape; this module allocates exactly those, with
ordinary PyTorch ops the tracker sees, and runs in-place elementwise updates where the kernels
update in place. Sources are bitsandbytes (https://github.com/bitsandbytes-foundation/bitsandbytes,
line numbers at main 95f9af30 unless a tag is named), lion-pytorch
(https://github.com/lucidrains/lion-pytorch, ``lion_pytorch/lion_pytorch.py``), peft 0.21
(``peft/tuners/lora/bnb.py``) and Lightning Fabric (``lightning/fabric/plugins/precision/bitsandbytes.py``).

``measure`` runs the real bitsandbytes; nothing here is used on a real GPU.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .estimate.quant4 import BLOCKSIZE, NESTED_BLOCKSIZE
from .estimate.states import BNB_LAYOUTS, MIN_8BIT_SIZE, PAGED_MIN

QMAP_ENTRIES = 256  # F.create_dynamic_map: 256 fp32 values (functional.py)
CODE_ENTRIES = 16   # get_4bit_type: the 16 NF4/FP4 values (functional.py)


# ----- paged memory ----------------------------------------------------------------------------
def paged_zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``F.get_paged`` + ``F.fill(buff, 0)`` (bitsandbytes ``functional.py``): a tensor in CUDA
    unified memory (``cudaMallocManaged``), which PyTorch's caching allocator never sees. The
    tracker's modes stand for that allocator, so the tensor is made outside them; like
    bitsandbytes it is marked ``is_paged``, which the tracker reads to leave its later in-place
    updates uncounted. On the CPU there is no paging: bitsandbytes falls back to ``zeros_like``
    (``get_state_buffer`` L375-382)."""
    if device.type == "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        out = torch.empty(shape, dtype=dtype, device=device)
    out.is_paged = True  # type: ignore[attr-defined]
    return out


# ----- 8-bit and paged optimizers --------------------------------------------------------------
class Adam2State(torch.optim.Optimizer):
    """bitsandbytes ``Optimizer2State`` for Adam/AdamW (``AdamW8bit``: ``optim_bits=8``;
    ``PagedAdamW8bit``: 8 and paged; ``PagedAdamW``: 32 and paged), as it allocates.

    ``init_state`` (L492-532), at a parameter's first step: fp32 ``state1``/``state2`` of the
    parameter's shape when ``optim_bits`` is 32 or the parameter has fewer than ``min_8bit_size``
    (4096) elements; else uint8 ``state1``/``state2`` of its shape, the two shared 256-entry fp32
    maps moved to the device once per optimizer (``name2qmap``, L513-516), and fp32 ``absmax1``/
    ``absmax2`` of ceil(n / blocksize) (256 since 0.44.0, 2048 before). ``get_state_buffer``
    (L374-390) pages ``state1``/``state2`` when the optimizer is paged and the parameter has at least
    1e5 elements; absmax and the maps are ordinary device tensors. ``percentile_clipping`` (100 by
    default until 0.49, removed in 0.50) and ``max_unorm`` (0.0) allocate nothing at their defaults.

    ``update_step`` (L534-590) calls ``F.optimizer_update_32bit`` or
    ``F.optimizer_update_8bit_blockwise``: one fused kernel that reads the gradient and writes the
    states, absmax and the parameter in place (``backends/cuda/ops.py``: the op returns nothing and
    allocates no output). The emulation runs in-place elementwise updates of the same tensors,
    which allocate nothing either.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, optim_bits: int = 8, is_paged: bool = False,
                 blocksize: int = 256, min_8bit_size: int = MIN_8BIT_SIZE) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.optim_bits, self.is_paged = optim_bits, is_paged
        self.blocksize, self.min_8bit_size = blocksize, min_8bit_size
        self.name2qmap: dict[str, torch.Tensor] = {}

    def _state_buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``get_state_buffer``: paged from 1e5 elements on a paged optimizer, else ``zeros_like``."""
        if self.is_paged and p.numel() >= PAGED_MIN:
            return paged_zeros(p.shape, dtype, p.device)
        return torch.zeros_like(p, dtype=dtype)

    def _init_state(self, p: torch.Tensor) -> None:
        """``Optimizer2State.init_state`` (L492-532), tensors in its order."""
        state = self.state[p]
        state["step"] = 0
        if self.optim_bits == 32 or p.numel() < self.min_8bit_size:
            state["state1"] = self._state_buffer(p, torch.float32)  # fp32, p's shape
            state["state2"] = self._state_buffer(p, torch.float32)  # fp32, p's shape
            return
        if "dynamic" not in self.name2qmap:
            # fill_qmap: create_dynamic_map(signed=True / False) on the host, then .to(p.device) once
            self.name2qmap["dynamic"] = torch.zeros(QMAP_ENTRIES, dtype=torch.float32).to(p.device)
            self.name2qmap["udynamic"] = torch.zeros(QMAP_ENTRIES, dtype=torch.float32).to(p.device)
        blocks = -(-p.numel() // self.blocksize)
        state["state1"] = self._state_buffer(p, torch.uint8)   # uint8, p's shape
        state["qmap1"] = self.name2qmap["dynamic"]              # shared 256 fp32
        state["state2"] = self._state_buffer(p, torch.uint8)   # uint8, p's shape
        state["qmap2"] = self.name2qmap["udynamic"]             # shared 256 fp32
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)  # fp32 per block
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)  # fp32 per block

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``Optimizer8bit.step`` (L305-341): each parameter with a gradient, its state created at
        its first step, then its in-place update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if len(self.state[p]) == 0:
                    self._init_state(p)
                state = self.state[p]
                state["step"] += 1
                g = p.grad
                # the fused kernel: the states from the gradient, then the parameter, all in place
                state["state1"].copy_(g)
                state["state2"].copy_(g)
                if "absmax1" in state:
                    state["absmax1"].fill_(1.0)
                    state["absmax2"].fill_(1.0)
                p.mul_(1.0 - lr * wd).add_(g, alpha=-lr)
        return loss


class OtherState(Adam2State):
    """bitsandbytes' Lion and RMSprop (``Optimizer1State``) and AdEMAMix (an ``Optimizer2State`` with
    a double first state), as they allocate; the step as ``Adam2State``'s (one in-place kernel).

    ``Optimizer1State.init_state`` (``optim/optimizer.py`` L664-690 at 95f9af30): an fp32 ``state1``
    of the parameter's shape when ``optim_bits`` is 32 or under ``min_8bit_size``; else the signed map
    moved to the device once (``name2qmap["dynamic"]``), a uint8 ``state1`` and an fp32 ``absmax1``
    per block. ``AdEMAMix.init_state`` (``optim/ademamix.py`` L139-173): 8-bit: both maps moved,
    ``absmax1`` (2, blocks) and ``absmax2`` (blocks) in fp32; then ``state1`` of shape (2, *p.shape)
    (``_get_state_double_buffer``, paged from 1e5 elements of p) and ``state2`` of p's shape, uint8 or
    fp32. ``double``: AdEMAMix."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, *, optim_bits: int = 8, is_paged: bool = False,
                 blocksize: int = 256, double: bool = False) -> None:
        super().__init__(params, lr, weight_decay=0.0, optim_bits=optim_bits, is_paged=is_paged, blocksize=blocksize)
        self.double = double

    def _double_buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``_get_state_double_buffer``: (2, *p.shape), paged from 1e5 elements of p on a paged optimizer."""
        if self.is_paged and p.numel() >= PAGED_MIN:
            return paged_zeros(torch.Size((2, *p.shape)), dtype, p.device)
        return torch.zeros((2, *p.shape), dtype=dtype, device=p.device)

    def _qmap(self, name: str, p: torch.Tensor) -> torch.Tensor:
        if name not in self.name2qmap:  # fill_qmap on the host, then .to(p.device) once
            self.name2qmap[name] = torch.zeros(QMAP_ENTRIES, dtype=torch.float32).to(p.device)
        return self.name2qmap[name]

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = 0
        eight = self.optim_bits == 8 and p.numel() >= self.min_8bit_size
        dtype = torch.uint8 if eight else torch.float32
        blocks = -(-p.numel() // self.blocksize)
        if not self.double:
            if eight:
                state["qmap1"] = self._qmap("dynamic", p)                        # shared 256 fp32
            state["state1"] = self._state_buffer(p, dtype)                       # p's shape
            if eight:
                state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
            return
        if eight:
            state["qmap1"], state["qmap2"] = self._qmap("dynamic", p), self._qmap("udynamic", p)
            state["absmax1"] = torch.zeros((2, blocks), dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["state1"] = self._double_buffer(p, dtype)                          # (2, *p.shape)
        state["state2"] = self._state_buffer(p, dtype)                           # p's shape

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``Optimizer8bit.step``: the states at a parameter's first step, then the in-place kernel."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if len(self.state[p]) == 0:
                    self._init_state(p)
                state = self.state[p]
                state["step"] += 1
                for key in ("state1", "state2"):
                    if key in state:
                        state[key].copy_(p.grad.expand_as(state[key]))
                p.add_(p.grad, alpha=-group["lr"])
        return loss


class Lion(torch.optim.Optimizer):
    """lion-pytorch's ``Lion`` (``lion_pytorch/lion_pytorch.py``), step for step: a loop over the
    parameters with a gradient; at the first step ``state['exp_avg'] = torch.zeros_like(p)`` (the
    parameter's dtype); ``update_fn``: ``p.data.mul_(1 - lr * wd)``, ``update =
    exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()`` (the clone, then the sum:
    two parameter-sized temporaries, the clone freed once the sum exists), ``p.add_(update,
    alpha=-lr)``, ``exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)  # p's dtype and shape
                exp_avg, grad = state["exp_avg"], p.grad
                p.data.mul_(1.0 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)
                del update
        return loss


def optimizer_class(name: str, blocksize: int) -> tuple[type, dict[str, Any]]:
    """The emulated class and keyword arguments of a trainmem optimizer name that bitsandbytes or
    lion-pytorch implements (None for the others): Lion, RMSprop and AdEMAMix are ``OtherState``.
    bitsandbytes' AdamW8bit/PagedAdamW8bit/PagedAdamW
    default to ``weight_decay=1e-2`` (``optim/adamw.py``)."""
    if name == "adamw-8bit":
        return Adam2State, {"optim_bits": 8, "is_paged": False, "blocksize": blocksize}
    if name == "paged-adamw-8bit":
        return Adam2State, {"optim_bits": 8, "is_paged": True, "blocksize": blocksize}
    if name == "paged-adamw":
        return Adam2State, {"optim_bits": 32, "is_paged": True, "blocksize": blocksize}
    if name == "lion":
        return Lion, {}
    mults, bits, paged = BNB_LAYOUTS[name]
    return OtherState, {"optim_bits": bits, "is_paged": paged, "blocksize": blocksize, "double": mults[0] == 2}


# ----- 4-bit base weights ----------------------------------------------------------------------
class QuantState:
    """``F.QuantState`` of one 4-bit weight (``functional.py``): the tensors it keeps on the device
    live on the module (see ``Linear4bit``); this holds the rest."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, nested: bool) -> None:
        self.shape, self.dtype, self.nested = shape, dtype, nested


class Linear4bit(torch.nn.Linear):
    """bitsandbytes ``nn.Linear4bit`` after ``Params4bit._quantize``: the weight replaced by its packed
    4-bit codes and quant state (``functional.quantize_4bit``, L884-963; ``backends/cuda/ops.py``
    L384-392, L310-311).

    Device tensors, registered as frozen parameters so that the model load counts them (bitsandbytes
    keeps the quant state on the ``Params4bit``, moved with it), in the order of
    ``estimate.quant4.storage_tensors``:
      * ``weight``: uint8 ``((n + 1) // 2, 1)``, two codes per byte;
      * without double quantization ``absmax``: fp32, one per 64-element block;
      * with it (``compress_statistics``): ``offset`` (fp32, 0-dim, ``absmax.mean()``), ``absmax``
        uint8 per 64-block (``quantize_blockwise(absmax - offset, blocksize=256)``) and
        ``absmax2`` fp32 per 256 blocks; the 256-entry ``state2.code`` is the module-wide cached
        ``name2qmap["dynamic"]`` (one per process: ``shared_code``);
      * ``code``: the 16 fp32 values ``get_4bit_type`` builds on the device for every weight.
    The bias, if any, stays in its dtype (``nn.Linear4bit`` casts it in forward).
    """

    def __init__(self, linear: torch.nn.Linear, state_dtype: torch.dtype, compute_dtype: torch.dtype | None,
                 double_quant: bool, keep_compute_dtype: bool, saves_input: bool,
                 shared_code: Callable[[torch.device], torch.Tensor]) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        n = self.in_features * self.out_features
        dev = linear.weight.device
        blocks = -(-n // BLOCKSIZE)

        def frozen(shape: tuple[int, ...], dtype: torch.dtype) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=dev), requires_grad=False)

        self.weight = frozen(((n + 1) // 2, 1), torch.uint8)  # packed codes, uint8
        if double_quant:
            self.offset = frozen((), torch.float32)                                       # fp32 scalar
            self.absmax = frozen((blocks,), torch.uint8)                                   # uint8 per 64
            self.absmax2 = frozen((-(-blocks // NESTED_BLOCKSIZE),), torch.float32)        # fp32 per 256 blocks
        else:
            self.absmax = frozen((blocks,), torch.float32)                                 # fp32 per 64
        self.code = frozen((CODE_ENTRIES,), torch.float32)                                 # fp32, 16 values
        self.bias = linear.bias
        self.quant_state = QuantState((self.out_features, self.in_features), state_dtype, double_quant)
        self.compute_dtype = compute_dtype
        # bitsandbytes >= 0.48.0 keeps a compute dtype given at construction
        # (``self.compute_type_is_set = compute_dtype is not None``, nn/modules.py L488 at 0.49.0);
        # before, the first forward's input dtype replaces it when it is fp32 or bf16 (L211, L213-217 at 0.42.0)
        self.compute_type_is_set = keep_compute_dtype and compute_dtype is not None
        self.saves_input = saves_input
        self._shared_code = shared_code

    def set_compute_type(self, x: torch.Tensor) -> None:
        """``Linear4bit.set_compute_type`` (nn/modules.py L213-227 at 0.42.0): an fp32 or bf16 input
        becomes the compute dtype; an fp16 input keeps the one given."""
        if x.dtype in (torch.float32, torch.bfloat16):
            self.compute_dtype = x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``Linear4bit.forward`` (nn/modules.py L240-260 at 0.42.0, L527-555 at 0.49.0): the bias cast
        to the input dtype in place, the input to the compute dtype, ``matmul_4bit``, the output
        back to the input's dtype."""
        if self.bias is not None and self.bias.dtype != x.dtype:
            self.bias.data = self.bias.data.to(x.dtype)
        if not self.compute_type_is_set:
            self.set_compute_type(x)
            self.compute_type_is_set = True
        inp_dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return MatMul4Bit.apply(x, self.weight, bias, self).to(inp_dtype)

    def dequantize(self, device: torch.device) -> torch.Tensor:
        """``F.dequantize_4bit`` (functional.py L979-1053 at 0.42.0): with double quantization the
        fp32 absmax first (``dequantize_blockwise(absmax, state2)``, then ``absmax += offset`` in
        place, L1019-1024), then ``out = torch.empty(shape, dtype=quant_state.dtype)`` (L1026)
        filled by the kernel; the absmax is freed when it returns. Returns ``out`` (out_features,
        in_features)."""
        qs = self.quant_state
        absmax = None
        if qs.nested:
            self._shared_code(device)  # state2.code, cached once per process
            absmax = torch.empty(self.absmax.shape, dtype=torch.float32, device=device)  # fp32 per 64-block
            absmax.copy_(self.absmax)
            absmax += self.offset
        out = torch.empty(qs.shape, dtype=qs.dtype, device=device)  # the dequantized weight
        del absmax
        return out


class MatMul4Bit(torch.autograd.Function):
    """bitsandbytes ``autograd/_functions.py`` ``MatMul4Bit`` (L494-548 at 0.42.0; L299-346 at
    0.49.0): forward ``F.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)`` -- the
    dequantized weight in the quant state's dtype, its cast to A's dtype when they differ, both
    freed when forward returns; it keeps the packed weight and the quant state, and before 0.43.2
    also its input A (``ctx.tensors = (A, B)``, L522-523 at 0.42.0; ``(None, B)`` since). Backward
    ``torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t())``
    (L546 at 0.42.0): the weight dequantized again.

    ``ctx.tensors`` is a plain attribute, not ``save_for_backward``: autograd does not release it
    when the node's backward has run, so A lives as long as the graph does -- through the whole
    backward (not freed layer by layer as saved tensors are) and after it for as long as the loop
    references the loss or the output (to the next forward's end in a loop that reassigns
    ``loss``/``logits``). The emulation keeps A the same way; it also passes A to
    ``save_for_backward`` only so that the tracker names it an activation (same storage, no bytes)."""

    @staticmethod
    def forward(ctx: Any, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, module: Linear4bit
                ) -> torch.Tensor:
        ctx.module = module
        ctx.dtype_bias = None if bias is None else bias.dtype
        output = torch.nn.functional.linear(A, module.dequantize(A.device).to(A.dtype), bias)
        if module.saves_input and any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, B)    # bitsandbytes < 0.43.2: held by the node until the graph is freed
            ctx.save_for_backward(A)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        req_a, _, req_bias, _ = ctx.needs_input_grad
        grad_a = grad_bias = None
        if req_bias:
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)
        if req_a:
            grad_a = torch.matmul(grad_output, ctx.module.dequantize(grad_output.device).to(grad_output.dtype))
        return grad_a, None, grad_bias, None


class _SharedCode:
    """``functional.name2qmap["dynamic"]``: the 256-entry fp32 map of double quantization, moved to
    the device at the first ``quantize_blockwise`` and cached for the process (L736-737)."""

    def __init__(self) -> None:
        self.code: torch.Tensor | None = None

    def __call__(self, device: torch.device) -> torch.Tensor:
        if self.code is None:
            self.code = torch.zeros(QMAP_ENTRIES, dtype=torch.float32).to(device)
        return self.code


def quantized_names(model: torch.nn.Module, via: str) -> list[str]:
    """The ``nn.Linear`` modules replaced by 4-bit ones. Lightning Fabric's ``_convert_layers``
    (``BitsandbytesPrecision`` as litgpt builds it, no ``ignore_modules``) replaces every one;
    transformers' ``replace_with_bnb_linear`` all but ``get_keys_to_not_convert(model)``: the output
    embedding (``lm_head``) and the model's last module (``integrations/bitsandbytes.py``). A head
    tied to the input embedding stays the embedding in both (trainmem's estimate counts no separate
    head tensor for tied models).

    Which modules count as linears differs: Fabric's ``_convert_layers`` tests ``isinstance(child,
    torch.nn.Linear)`` (lightning ``fabric/plugins/precision/bitsandbytes.py`` L274 at 2.1.0, L418 at 2.4.0), so a
    subclass such as transformers' ``FalconLinear`` is replaced too (the run itself, litgpt's model,
    has plain ``nn.Linear``); transformers 5.x tests ``type(module) is nn.Linear`` (and ``Conv1D``,
    not emulated here: ``integrations/bitsandbytes.py`` ``replace_with_bnb_linear`` L189 at 5.24), so
    it leaves a subclass in 16 bits. An emulated ``Linear4bit`` (itself an ``nn.Linear``) is not
    replaced again."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    if via == "fabric":
        names = [n for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not isinstance(m, Linear4bit)]
    else:
        names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    last = [n for n, _ in model.named_modules()][-1]
    keep = []
    for n in names:
        m = model.get_submodule(n)
        if m is out_emb and (tied or via != "fabric"):
            continue
        if via != "fabric" and n == last:
            continue
        keep.append(n)
    return keep


def quantize_linears(model: torch.nn.Module, quant: str, via: str, precision: str, saves_input: bool,
                     keep_compute_dtype: bool) -> torch.nn.Module:
    """Replace the model's linears by emulated ``Linear4bit`` (``quant``: nf4, fp4, nf4-dq, fp4-dq;
    the quant type changes only the 16 code values, not any size).

    The quant state's dtype is the dtype of the tensor quantized (``QuantState(dtype=A.dtype)``):
    Fabric quantizes ``weight.contiguous().to(device="cuda", dtype=torch.half)`` (fp16) and sets
    ``compute_dtype`` to its dtype with ``compute_type_is_set = False`` (``convert_module``), so the
    first input's dtype decides; transformers quantizes the weight as loaded (the model's dtype
    here) with ``bnb_4bit_compute_dtype`` (the half dtype of a mixed-precision run, as QLoRA recipes
    set it; fp32 in fp32 training)."""
    half = torch.float16 if precision in ("fp16", "fp16-amp") else torch.bfloat16
    code = _SharedCode()
    for name in quantized_names(model, via):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if via == "fabric":
            state_dtype, compute, keep = torch.float16, half, False
        else:
            state_dtype = linear.weight.dtype
            compute, keep = (torch.float32 if precision == "fp32" else half), keep_compute_dtype
        new = Linear4bit(linear, state_dtype, compute, quant.endswith("-dq"), keep, saves_input, code)
        setattr(parent, child, new)
    return model


def lora_layer_class() -> type:
    """peft's LoRA layer over a bitsandbytes 4-bit linear (``peft/tuners/lora/bnb.py`` ``Linear4bit``),
    as a custom LoRA module for the emulated ``Linear4bit`` (peft dispatches its own class only when
    bitsandbytes is installed). Its forward differs from peft's plain ``Linear``: the base output is
    cloned ("As per Tim Dettmers, for 4bit, we need to defensively clone here"), and the input is
    cast to the adapter's dtype only outside autocast (``requires_conversion = not
    torch.is_autocast_enabled()``), the adapter's output cast back to the base output's dtype."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    class Lora4bit(LoraLinear):
        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            result = result.clone()
            for active in self.active_adapters:
                if active not in self.lora_A.keys():
                    continue
                lora_a, lora_b = self.lora_A[active], self.lora_B[active]
                dropout, scaling = self.lora_dropout[active], self.scaling[active]
                conversion = not torch.is_autocast_enabled()
                if conversion:
                    expected = result.dtype
                    x = self._cast_input_dtype(x, lora_a.weight.dtype)
                output = lora_b(lora_a(dropout(x))) * scaling
                if conversion:
                    output = output.to(expected)
                result = result + output
            return result

    return Lora4bit
