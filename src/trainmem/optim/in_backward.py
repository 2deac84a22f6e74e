"""Optimizer step inside the backward pass: each parameter is updated, and its gradient freed,
as soon as its gradient is complete.

A standard step keeps every gradient alive until ``optimizer.step()``; at the end of backward
the memory holds weights + all gradients + optimizer states (+ the step's temporaries). Stepping
each parameter from a ``register_post_accumulate_grad_hook`` and setting ``p.grad = None`` right
away means at most a parameter's worth of gradient exists at a time (Lightning AI, "Faster
PyTorch Training by Reducing Peak Memory (combining backward pass + optimizer step)",
https://lightning.ai/pages/community/tutorial/faster-pytorch-training-by-reducing-peak-memory/:
20-40 % lower peaks). See docs/optimizer-in-backward.md for measurements and when not to use it.

    opt = optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)  # any scheduler
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()      # parameters are updated here, gradients freed
        opt.step()           # updates nothing: closes the iteration (required, see below)
        opt.zero_grad()      # no-op: the gradients are already gone
        sched.step()
    opt.remove()             # or use ``with optimizer_in_backward(...) as opt:``

``OptimizerInBackward`` is a ``torch.optim.Optimizer``: its ``param_groups`` are the single
source of hyper-parameters (schedulers and manual ``group["lr"] = ...`` edits reach every
per-parameter optimizer at its next update), and ``state_dict()`` has exactly the format of one
standard optimizer of the same class over the same parameters, so checkpoints move freely
between the two.

What cannot work, and fails loudly instead of silently:
* gradient accumulation: a second backward before ``step()`` would update the parameters again
  with a single micro-batch's gradient -> ``GradientAccumulationError``;
* global-norm gradient clipping: the gradients never coexist -> ``clip_grad_norm_`` raises
  (``clip_grad_value=`` clips each gradient inside the hook instead);
* closures that run backward more than once (LBFGS), DDP / FSDP1-wrapped modules (their
  gradient reduction is not finished when the hook fires) -> errors at construction / step.

FSDP2 (``fully_shard``): parameters are DTensor shards; FSDP2 reduce-scatters each gradient and
then calls the sharded parameter's post-accumulate-grad hooks itself
(``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``), so the same
hooks step each shard with its reduced gradient. The hooks only use ``p.grad`` and the optimizer's
in-place updates; they never touch ``p.data``, so FSDP2's views stay valid.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.optim import Optimizer

__all__ = ["OptimizerInBackward", "optimizer_in_backward", "GradientAccumulationError",
           "GlobalClipError"]

ACCUM_HINT = ("optimizer-in-backward cannot accumulate gradients: the update runs inside "
              "backward and the gradient is freed at once. Use grad_accum=1 (one backward per "
              "step) or a standard optimizer (loss.backward() x N; optimizer.step()).")


class GradientAccumulationError(RuntimeError):
    """A parameter received a second gradient before ``step()`` closed the iteration."""


class GlobalClipError(RuntimeError):
    """Global-norm gradient clipping asked of an optimizer-in-backward."""


def _unwrap(params: Any) -> Any:
    if isinstance(params, torch.nn.Module):
        name = type(params).__name__
        if name in ("DistributedDataParallel", "FullyShardedDataParallel"):
            raise TypeError(
                f"optimizer_in_backward does not work with {name}: its gradient reduction is not "
                "finished when the per-parameter hook fires. Use FSDP2 (torch.distributed.fsdp."
                "fully_shard), which reduce-scatters before calling the hooks, or a standard optimizer.")
        return [p for p in params.parameters() if p.requires_grad]
    return params


def _flat(params: list) -> Iterator[torch.Tensor]:
    for x in params:
        if isinstance(x, dict):
            ps = x["params"]
            yield from ([ps] if isinstance(ps, torch.Tensor) else ps)
        else:
            yield x


class _StateView(Mapping):
    """``opt.state[p]``: the per-parameter optimizers' states, read through one mapping."""

    def __init__(self, owner: "OptimizerInBackward") -> None:
        self._owner = owner

    def __getitem__(self, p: torch.Tensor) -> dict:
        o = self._owner._optimizer_of(p)
        if p not in o.state:
            raise KeyError(p)
        return o.state[p]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for o in self._owner.optimizers:
            p = o.param_groups[0]["params"][0]
            if o.state.get(p):
                yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)


class OptimizerInBackward(Optimizer):
    """One ``optimizer_cls`` per parameter, stepped from that parameter's
    post-accumulate-grad hook, which then frees the gradient.

    ``params``: a module (its trainable parameters), an iterable of parameters, or parameter
    groups (dicts) as for any optimizer. ``clip_grad_value``: clamp each gradient to
    [-v, v] before its update (the per-parameter clipping that does work here).
    ``**kwargs``: the optimizer's options (lr, betas, weight_decay, foreach, fused, ...).
    """

    def __init__(self, params: Any, optimizer_cls: type[Optimizer], *,
                 clip_grad_value: float | None = None, **kwargs: Any) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
        if clip_grad_value is not None and clip_grad_value <= 0:
            raise ValueError(f"clip_grad_value must be positive, got {clip_grad_value}")
        self.optimizer_cls = optimizer_cls
        self.kwargs = dict(kwargs)
        self.clip_grad_value = clip_grad_value
        self.optimizers: list[Optimizer] = []
        self._index: dict[int, int] = {}       # id(param) -> index in self.optimizers
        self._group_of: list[dict] = []        # index -> its group in self.param_groups
        self._handles: list[Any] = []
        self._pending: set[int] = set()        # parameters updated since the last step()
        self.updates = 0                       # per-parameter updates done in backward
        self.iterations = 0                    # step() calls
        params = list(_unwrap(params))
        first = next((t for t in _flat(params)), None)
        if first is None:
            raise ValueError("optimizer got an empty parameter list")
        # the class's full defaults, from a one-element stand-in of the first parameter's kind
        probe = optimizer_cls([torch.zeros(1, dtype=first.dtype, device=first.device, requires_grad=True)],
                              **kwargs)
        super().__init__(params, dict(probe.defaults))

    # ``Optimizer.__init__`` assigns ``self.state``; states live in the per-parameter optimizers
    @property
    def state(self) -> Mapping:  # type: ignore[override]
        return _StateView(self)

    @state.setter
    def state(self, value: Any) -> None:
        pass

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: validated and completed as by ``Optimizer``, then one optimizer and one
        hook per parameter."""
        own = {k: v for k, v in param_group.items() if k != "params"}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            o = self.optimizer_cls([p], **{**self.kwargs, **own})
            self._index[id(p)] = len(self.optimizers)
            self.optimizers.append(o)
            self._group_of.append(group)
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    # ----- the hook --------------------------------------------------------------------------
    def _optimizer_of(self, p: torch.Tensor) -> Optimizer:
        try:
            return self.optimizers[self._index[id(p)]]
        except KeyError:
            raise KeyError("parameter not managed by this OptimizerInBackward") from None

    def _hook(self, p: torch.Tensor) -> None:
        i = self._index[id(p)]
        if p.grad is None:
            return
        if i in self._pending:
            p.grad = None  # nothing of the refused backward survives to pollute a later update
            raise GradientAccumulationError(
                "a parameter received a second gradient before opt.step() closed the iteration "
                "(backward ran twice without a step). " + ACCUM_HINT + " If this backward is a new "
                "iteration, call opt.step() after each backward: it updates nothing, it marks the end "
                "of the iteration.")
        if self.clip_grad_value is not None:
            p.grad.clamp_(-self.clip_grad_value, self.clip_grad_value)
        o = self.optimizers[i]
        og = o.param_groups[0]
        for k, v in self._group_of[i].items():  # param_groups are the source of truth
            if k != "params":
                og[k] = v
        o.step()
        p.grad = None
        self._pending.add(i)
        self.updates += 1

    # ----- the Optimizer interface -------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Close the iteration. The parameters were updated during backward; nothing is updated
        here. A ``closure`` is run once (its backward does the update)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._pending.clear()
        self.iterations += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: each gradient was freed right after its parameter's update."""

    def clip_grad_norm_(self, *args: Any, **kwargs: Any) -> None:
        """Always raises: a global norm needs every gradient at once, and here no two coexist."""
        raise GlobalClipError(
            "global-norm gradient clipping cannot work with optimizer-in-backward: each gradient is "
            "used and freed before the next one exists, so no global norm is ever available. Clip "
            "per parameter with clip_grad_value (optimizer_in_backward(..., clip_grad_value=1.0), "
            "like torch.nn.utils.clip_grad_value_), or use a standard optimizer.")

    clip_grad_norm = clip_grad_norm_

    def remove(self) -> None:
        """Detach every hook: later backwards leave gradients in ``.grad`` and update nothing."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> "OptimizerInBackward":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    # ----- checkpoints -----------------------------------------------------------------------
    def _params(self) -> Iterator[tuple[int, dict, torch.Tensor]]:
        n = 0
        for g in self.param_groups:
            for p in g["params"]:
                yield n, g, p
                n += 1

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The state dict one ``optimizer_cls(params)`` would produce: ``state`` keyed by the
        parameter's index across the groups, ``param_groups`` with index lists."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = []
            groups.append(packed)
        gi = {id(g): k for k, g in enumerate(self.param_groups)}
        for n, g, p in self._params():
            groups[gi[id(g)]]["params"].append(n)
            st = self._optimizer_of(p).state.get(p)
            if st:
                state[n] = st
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict from ``state_dict()`` or from a standard optimizer of the same class
        over the same parameters in the same order."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved)} parameter groups, this optimizer "
                             f"has {len(self.param_groups)}")
        for sg, g in zip(saved, self.param_groups):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match "
                                 "the size of this optimizer's group")
        states = state_dict["state"]
        for sg, g in zip(saved, self.param_groups):
            hyper = {k: v for k, v in sg.items() if k != "params"}
            g.update(hyper)
            for idx, p in zip(sg["params"], g["params"]):
                st = states.get(idx, states.get(str(idx)))
                self._optimizer_of(p).load_state_dict(
                    {"state": {0: st} if st else {}, "param_groups": [dict(hyper, params=[0])]})

    def __repr__(self) -> str:
        return (f"OptimizerInBackward({self.optimizer_cls.__name__}, {len(self.optimizers)} parameters, "
                f"{len(self.param_groups)} group(s), hooks {'on' if self.active else 'removed'})")


def optimizer_in_backward(params: Any, optimizer_cls: type[Optimizer], *,
                          clip_grad_value: float | None = None, **kwargs: Any) -> OptimizerInBackward:
    """Run ``optimizer_cls`` inside backward, one instance per parameter (see the module docs).

    ``params``: a module (its trainable parameters), parameters, or parameter groups. Returns an
    ``OptimizerInBackward``; as a context manager it removes its hooks on exit::

        with optimizer_in_backward(model, torch.optim.AdamW, lr=1e-3) as opt:
            for batch in loader:            # the existing loop, unchanged
                loss_fn(model(batch)).backward()
                opt.step()
                opt.zero_grad()
    """
    return OptimizerInBackward(params, optimizer_cls, clip_grad_value=clip_grad_value, **kwargs)
