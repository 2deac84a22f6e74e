"""GaLore's optimizers as the HF Trainer builds them, for ``trace`` (and ``measure``).

``galore_optimizer`` makes what transformers 5.24.0 ``trainer_optimizer.py`` ``_setup_low_rank_optimizer``
(L101-193) makes: the weights of the matched ``nn.Linear`` modules in a group with GaLore's options,
every other parameter in a plain group of the same class; layerwise, one optimizer per parameter,
stepped and ``zero_grad``'d from its ``register_post_accumulate_grad_hook``, behind a no-op optimizer
(``LayerWiseDummyOptimizer``).

The classes are galore_torch's own when it is installed; otherwise ``GaLoreAdamW``, ``GaLoreAdafactor``
and ``GaLoreProjector`` below, which make the same tensors in the same order (galore_torch 1.0:
``galore_projector.py``, ``adamw.py``, ``adafactor.py``, github:jiaweizzhao/GaLore; only the
allocating statements are kept: checked against the real classes with LiveBytes, tests/test_galore.py).
GaLoreAdamW8bit steps bitsandbytes' CUDA kernels through ``Optimizer2State`` internals: measured (the
real class), not traced. APOLLO is traced with ``APOLLOAdamW`` below always (the real class's norm
limiter needs a tensor's value).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .errors import TrainmemError
from .spec.galore import is_target


class GaLoreProjector:
    """galore_projector.py: ``project`` / ``project_back`` and the SVD every ``update_proj_gap`` steps."""

    def __init__(self, rank: int, update_proj_gap: int = 200, scale: float = 1.0, proj_type: str = "std") -> None:
        self.rank, self.update_proj_gap, self.scale, self.proj_type = rank, update_proj_gap, scale, proj_type
        self.ortho_matrix: Any = None

    def _side(self, g: torch.Tensor) -> str:
        tall = g.shape[0] >= g.shape[1]
        return {"std": "right" if tall else "left", "reverse_std": "left" if tall else "right"}.get(
            self.proj_type, self.proj_type)

    def project(self, g: torch.Tensor, it: int) -> torch.Tensor:
        side = self._side(g)
        if self.ortho_matrix is None or it % self.update_proj_gap == 0:
            self.ortho_matrix = self.get_orthogonal_matrix(g, self.rank, side)
        if side == "right":
            return torch.matmul(g, self.ortho_matrix.t())
        if side == "left":
            return torch.matmul(self.ortho_matrix.t(), g)
        return torch.matmul(self.ortho_matrix[0].t(), g) @ self.ortho_matrix[1].t()

    def project_back(self, low: torch.Tensor) -> torch.Tensor:
        if self.proj_type == "std":
            full = torch.matmul(low, self.ortho_matrix) if low.shape[0] >= low.shape[1] \
                else torch.matmul(self.ortho_matrix, low)
        elif self.proj_type == "reverse_std":
            full = torch.matmul(self.ortho_matrix, low) if low.shape[0] <= low.shape[1] \
                else torch.matmul(low, self.ortho_matrix)
        elif self.proj_type == "right":
            full = torch.matmul(low, self.ortho_matrix)
        elif self.proj_type == "left":
            full = torch.matmul(self.ortho_matrix, low)
        else:
            full = torch.matmul(self.ortho_matrix[0], low) @ self.ortho_matrix[1]
        return full * self.scale

    @staticmethod
    def get_orthogonal_matrix(weights: torch.Tensor, rank: int, side: str) -> Any:
        """L71-107: the SVD of the fp32 matrix; a half one's factors cast back (new tensors), an fp32
        one's returned as views of U / Vh."""
        float_data = weights.data.dtype == torch.float
        dtype = weights.data.dtype
        matrix = weights.data if float_data else weights.data.float()
        U, s, Vh = torch.linalg.svd(matrix, full_matrices=False)
        if side == "right":
            A = U[:, :rank] @ torch.diag(s[:rank])  # noqa: F841 (computed and dropped, as the original does)
            B = Vh[:rank, :]
            return B if float_data else B.type(dtype)
        if side == "left":
            A = U[:, :rank]
            B = torch.diag(s[:rank]) @ Vh[:rank, :]  # noqa: F841
            return A if float_data else A.type(dtype)
        A, B = U[:, :rank], Vh[:rank, :]
        return [A, B] if float_data else [A.type(dtype), B.type(dtype)]


class GaLoreAdamW(torch.optim.Optimizer):
    """adamw.py (transformers' old AdamW with GaLore's projection): a loop over tensors."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, correct_bias: bool = True, **_: Any) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "correct_bias": correct_bias})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                state.setdefault("step", 0)
                if "rank" in group:
                    if "projector" not in state:
                        state["projector"] = GaLoreProjector(group["rank"], group["update_proj_gap"], group["scale"],
                                                             group["proj_type"])
                    grad = state["projector"].project(grad, state["step"])
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(grad)
                    state["exp_avg_sq"] = torch.zeros_like(grad)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size *= math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                norm_grad = exp_avg / denom
                if "rank" in group:
                    norm_grad = state["projector"].project_back(norm_grad)
                p.add_(norm_grad, alpha=-step_size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])
        return None


class GaLoreAdafactor(torch.optim.Optimizer):
    """adafactor.py (transformers' Adafactor with GaLore's projection), beta1 None: no first moment."""

    def __init__(self, params: Any, lr: float | None = None, eps: tuple[float, float] = (1e-30, 1e-3),
                 clip_threshold: float = 1.0, decay_rate: float = -0.8, beta1: float | None = None,
                 weight_decay: float = 0.0, scale_parameter: bool = True, relative_step: bool = True,
                 warmup_init: bool = False) -> None:
        if lr is not None and relative_step:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        if beta1 is not None:
            raise TrainmemError("GaLoreAdafactor with beta1 (a first moment) is not modelled")
        super().__init__(params, {"lr": lr, "eps": eps, "clip_threshold": clip_threshold, "decay_rate": decay_rate,
                                  "beta1": beta1, "weight_decay": weight_decay, "scale_parameter": scale_parameter,
                                  "relative_step": relative_step, "warmup_init": warmup_init})

    @staticmethod
    def _rms(t: torch.Tensor) -> torch.Tensor:
        return t.norm(2) / (t.numel() ** 0.5)

    @staticmethod
    def _approx_sq_grad(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        c_factor = col.unsqueeze(-2).rsqrt()
        return torch.mul(r_factor, c_factor)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.dtype in (torch.float16, torch.bfloat16):
                    grad = grad.float()
                state = self.state[p]
                state.setdefault("step", 0)
                if "rank" in group:
                    if "projector" not in state:
                        state["projector"] = GaLoreProjector(group["rank"], group["update_proj_gap"], group["scale"],
                                                             group["proj_type"])
                    grad = state["projector"].project(grad, state["step"])
                shape = grad.shape
                factored = len(shape) >= 2
                if "RMS" not in state:
                    state["step"] = 0
                    if factored:
                        state["exp_avg_sq_row"] = torch.zeros(shape[:-1]).to(grad)
                        state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:]).to(grad)
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)
                    state["RMS"] = 0
                p32 = p
                if p.dtype in (torch.float16, torch.bfloat16):
                    p32 = p32.float()
                state["step"] += 1
                state["RMS"] = self._rms(p32)
                lr = group["lr"]  # relative_step False (the HF Trainer's galore_adafactor)
                beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
                update = (grad ** 2) + group["eps"][0]
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    update = self._approx_sq_grad(row, col)
                    update.mul_(grad)
                else:
                    sq = state["exp_avg_sq"]
                    sq.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = sq.rsqrt().mul_(grad)
                update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                if "rank" in group:
                    update = state["projector"].project_back(update)
                if group["weight_decay"] != 0:
                    p32.add_(p32, alpha=-group["weight_decay"] * lr)
                p32.add_(-update)
                if p.dtype in (torch.float16, torch.bfloat16):
                    p.copy_(p32)
        return None


class RandomProjector(GaLoreProjector):
    """apollo_torch 1.0.3 ``GradientProjector`` (random_projector.py, proj_type std): a random (r, n) /
    (m, r) matrix from ``stable_randn`` (fp32; its seeded generator makes no tensor and is left out),
    ``/ sqrt(rank)``, cast to a half gradient's dtype (after a ``.float()`` copy of the gradient)."""

    @staticmethod
    def get_orthogonal_matrix(weights: torch.Tensor, rank: int, side: str) -> Any:
        float_data = weights.data.dtype == torch.float
        matrix = weights.data if float_data else weights.data.float()
        shape = (matrix.shape[0], rank) if side == "left" else (rank, matrix.shape[1])
        proj = torch.randn(shape, device=matrix.device, dtype=matrix.dtype) / math.sqrt(rank)
        return proj if float_data else proj.type(weights.data.dtype)

    def project_back(self, low: torch.Tensor) -> torch.Tensor:  # (APOLLO never projects back)
        raise NotImplementedError


class APOLLOAdamW(GaLoreAdamW):
    """apollo_torch 1.0.3 ``APOLLOAdamW`` (apollo.py L118-180) at the HF Trainer's proj=random,
    scale_type=channel: GaLore's AdamW on the projected gradient, then the channel-scaled full gradient
    and the norm-growth limiter. The limiter is taken as a tensor (the norm grew by over 1 %: the
    larger path, which the estimate counts); the real class decides it from the tensor's value, which
    fake tensors cannot give."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                state.setdefault("step", 0)
                if "rank" in group:
                    norm_dim = 0 if grad.shape[0] < grad.shape[1] else 1
                    if "projector" not in state:
                        state["projector"] = RandomProjector(group["rank"], group["update_proj_gap"],
                                                             group["scale"], group["proj_type"])
                    grad = state["projector"].project(grad, state["step"])
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(grad)
                    state["exp_avg_sq"] = torch.zeros_like(grad)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                norm_grad = exp_avg / denom
                if "rank" in group:
                    factor = torch.norm(norm_grad, dim=norm_dim) / (torch.norm(grad, dim=norm_dim) + 1e-8)
                    if norm_dim == 1:
                        factor = factor.unsqueeze(1)
                    scaled_grad = p.grad * factor
                    if "scaled_grad" in state:
                        scaled_grad_norm = torch.norm(scaled_grad)
                        limiter = (scaled_grad_norm / (state["scaled_grad"] + 1e-8)) / 1.01
                        scaled_grad = scaled_grad / limiter
                        state["scaled_grad"] = scaled_grad_norm / limiter
                    else:
                        state["scaled_grad"] = torch.norm(scaled_grad)
                    norm_grad = scaled_grad
                    norm_grad *= math.sqrt(group["scale"])
                p.add_(norm_grad, alpha=-group["lr"])
        return None


class _LayerWise(torch.optim.Optimizer):
    """transformers' ``LayerWiseDummyOptimizer``: ``step`` and ``zero_grad`` do nothing (the hooks did)."""

    def __init__(self, params: Any, optimizers: dict) -> None:
        self.optimizer_dict = optimizers
        super().__init__(params, {"lr": 0.0})

    def step(self, closure: Any = None) -> Any:  # noqa: D102
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        pass


def _classes(optimizer: str, emulate: bool) -> tuple[type, dict[str, Any]]:
    """galore_torch's class when installed, else (``emulate``: trace) the one above, and the Trainer's
    extra arguments."""
    if optimizer == "apollo-adamw":
        if emulate:  # the real class's limiter is Python control flow on a tensor's value (apollo.py L160-166)
            return APOLLOAdamW, {}
        try:
            import apollo_torch
        except ImportError:
            raise TrainmemError("--optimizer apollo-adamw needs apollo_torch to measure: pip install apollo-torch") \
                from None
        return apollo_torch.APOLLOAdamW, {}
    if optimizer == "galore-adamw-8bit" and emulate:
        raise TrainmemError("--optimizer galore-adamw-8bit is not traced: GaLoreAdamW8bit steps bitsandbytes' CUDA "
                            "kernels through Optimizer2State's internals; use trainmem estimate (or measure)")
    try:
        import galore_torch
        cls = {"galore-adafactor": galore_torch.GaLoreAdafactor, "galore-adamw": galore_torch.GaLoreAdamW,
               "galore-adamw-8bit": galore_torch.GaLoreAdamW8bit}[optimizer]
    except ImportError:
        if not emulate:
            raise TrainmemError(f"--optimizer {optimizer} needs galore_torch to measure: pip install galore-torch") \
                from None
        cls = GaLoreAdafactor if optimizer == "galore-adafactor" else GaLoreAdamW
    extra = {"scale_parameter": False, "relative_step": False} if optimizer == "galore-adafactor" else {}
    return cls, extra


def galore_optimizer(model: torch.nn.Module, t: Any, lr: float = 1e-4, emulate: bool = True) -> torch.optim.Optimizer:
    """The HF Trainer's GaLore optimizer over ``model`` (``_setup_low_rank_optimizer``), layerwise under
    ``--optimizer-in-backward``."""
    cls, extra = _classes(t.optimizer, emulate)
    targets = {name + ".weight" for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and is_target(t.optim_target_modules, name)}
    if not targets:
        raise TrainmemError(f"--optim-target-modules {t.optim_target_modules}: no nn.Linear module matches "
                            "(the HF Trainer raises \"No target modules found\")")
    named = [(n, p) for n, p in model.named_parameters()]
    kw = dict(t.galore_options())
    groups = [{"params": [p for n, p in named if n not in targets]},
              {"params": [p for n, p in named if n in targets], **kw}]
    if not t.optimizer_in_backward:
        return cls(groups, lr=lr, **extra)
    per = {p: cls([{"params": [p], **(kw if n in targets else {})}], lr=lr, **extra) for n, p in named}

    def hook(param: torch.Tensor) -> None:  # trainer_optimizer.py L175-178
        if param.grad is not None:
            per[param].step()
            per[param].zero_grad()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(hook)
    return _LayerWise(groups, per)


# ----- LOMO / AdaLomo ---------------------------------------------------------------------------------
class Lomo(torch.optim.Optimizer):
    """lomo_optim 0.1.1 ``lomo.py`` as the HF Trainer builds it (``Lomo(model, lr)``: no clipping, no
    weight decay, a bf16/fp32 loss: no loss scaler): a ``register_hook`` on every trainable parameter
    runs ``fuse_update`` (L96-140), which updates, in place, each parameter whose gradient was
    accumulated since, and frees that gradient; ``fused_backward`` (L195-223) is ``loss.backward()``
    and one last call. Only the allocating statements are kept (tests/test_lomo.py)."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        self.model, self.lr = model, lr
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(self.grad_func)
        super().__init__(model.parameters(), {"lr": lr})

    def _update(self, n: str, p: torch.Tensor, grad_fp32: torch.Tensor) -> None:
        p_fp32 = p.data.to(torch.float32)
        p_fp32.add_(grad_fp32, alpha=-self.lr)
        p.data.copy_(p_fp32)

    def grad_func(self, x: Any) -> Any:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if p.requires_grad and p.grad is not None:
                    grad_fp32 = p.grad.to(torch.float32)
                    p.grad = None
                    self._update(n, p, grad_fp32)
        return x

    def fused_backward(self, loss: torch.Tensor, lr: float) -> None:
        self.lr = lr
        loss.backward()
        self.grad_func(0)

    def step(self, closure: Any = None) -> Any:  # accelerate's AcceleratedOptimizer.step: a no-op for LOMO
        return None


class AdaLomo(Lomo):
    """lomo_optim 0.1.1 ``adalomo.py``: fp32 factored second moments made in the constructor (L96-118),
    ``loss_scale`` 2**10 (the loss multiplied in ``fused_backward``, each fp32 gradient divided), and
    Adafactor's factored update (L143-205)."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3, loss_scale: float = 2 ** 10) -> None:
        self.loss_scale, self.eps, self.step_num, self.decay_rate = loss_scale, (1e-30, 1e-3), 0, -0.8
        self.exp_avg_sq, self.exp_avg_sq_row, self.exp_avg_sq_col = {}, {}, {}
        dev = next(model.parameters()).device
        for n, p in model.named_parameters():
            if len(p.data.shape) == 1:
                self.exp_avg_sq[n] = torch.zeros(p.data.shape[0], dtype=torch.float32).to(dev)
            else:
                self.exp_avg_sq_row[n] = torch.zeros(p.data.shape[0], dtype=torch.float32).to(dev)
                self.exp_avg_sq_col[n] = torch.zeros(p.data.shape[1], dtype=torch.float32).to(dev)
        super().__init__(model, lr)

    def _update(self, n: str, p: torch.Tensor, grad_fp32: torch.Tensor) -> None:
        grad_fp32.div_(self.loss_scale)
        beta2t = 1.0 - math.pow(max(self.step_num, 1), self.decay_rate)
        update = (grad_fp32 ** 2) + self.eps[0]
        if len(p.data.shape) > 1:
            self.exp_avg_sq_row[n].mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
            self.exp_avg_sq_col[n].mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
            update = GaLoreAdafactor._approx_sq_grad(self.exp_avg_sq_row[n], self.exp_avg_sq_col[n])
            update.mul_(grad_fp32)
        else:
            self.exp_avg_sq[n].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
            update = self.exp_avg_sq[n].rsqrt().mul_(grad_fp32)
        update.div_((GaLoreAdafactor._rms(update) / 1.0).clamp_(min=1.0))
        p_fp32 = p.data.to(torch.float32)
        p_rms = torch.norm(p_fp32, 2.0) / math.sqrt(p.numel())
        p_fp32.add_(update, alpha=-self.lr * max(self.eps[1], float(p_rms)))
        p.data.copy_(p_fp32)

    def fused_backward(self, loss: torch.Tensor, lr: float) -> None:
        self.lr = lr
        (loss * self.loss_scale).backward()
        self.grad_func(0)
        self.step_num += 1


def lomo_optimizer(model: torch.nn.Module, t: Any, lr: float = 1e-4, emulate: bool = True) -> Any:
    """The HF Trainer's ``lomo`` / ``adalomo`` (``trainer_optimizer.py`` ``_get_lomo_optimizer``:
    ``Lomo(model, lr=...)``): lomo_optim's classes when installed, else (``emulate``) the ones above."""
    try:
        import lomo_optim
        return (lomo_optim.AdaLomo if t.optimizer == "adalomo" else lomo_optim.Lomo)(model, lr=lr)
    except ImportError:
        if not emulate:
            raise TrainmemError(f"--optimizer {t.optimizer} needs lomo_optim to measure: pip install lomo-optim") \
                from None
    return (AdaLomo if t.optimizer == "adalomo" else Lomo)(model, lr=lr)
