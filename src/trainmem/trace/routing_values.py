"""Values for the tensors a mixture-of-experts router's choice decides, in a trace without data.

The trace's tensors hold no data (``meta``), so an op whose output size is a count of a tensor's values
cannot run: ``nonzero`` (and ``torch.where(mask)``), a size read back by ``.tolist()`` or ``.item()``. The
MoE blocks transformers runs through ``grouped_mm`` make none (docs/moe.md); the ones with only a per-expert
loop make them all, each from the router's top-k choice (transformers 5.24):

- DBRX, ``models/dbrx/modeling_dbrx.py`` L290-306: ``one_hot(top_k_index)``, ``nonzero()`` of the experts
  hit, then per expert ``torch.where(expert_mask[expert_idx])`` and the gather of its tokens;
- LongCat-Flash, ``models/longcat_flash/modeling_longcat_flash.py`` L185-203: the same, with
  ``int(expert_idx_tensor.item())`` and its zero-compute (identity) experts;
- JetMoE, ``models/jetmoe/modeling_jetmoe.py`` L187-195: ``zeros.scatter(1, top_k_indices, 1)``,
  ``.long().sum(0).tolist()`` as the experts' sizes, then ``inputs.split(expert_size)`` (L152).

:class:`RoutingValues` gives the trace those values. The seed is ``topk``'s indices, set to a balanced
routing: token ``t``'s ``j``-th choice is expert ``(t·k + j) mod n`` (each of the ``n`` experts gets
``⌊T·k/n⌋`` or ``⌈T·k/n⌉`` of the ``T·k`` choices, every token ``k`` distinct experts), the load the
``grouped_mm`` path's memory does not depend on and that the busiest expert's ``--moe-imbalance`` 1 means.
From there every op whose device inputs all have values is run again on the CPU on those values
(integer masks, counts, sorted indices: ``T·k`` elements, below ``CAP``); an op that fails on tensors
without data (``nonzero``) takes its output's size from that CPU result, and a host read (``.item()``,
``.tolist()``, ``.cpu()``) answers the value. Factory outputs (``zeros``, ``arange``, ...) are remembered
as recipes and made on the CPU only when an op meets them with a valued input (``one_hot``'s ``arange``,
JetMoE's ``zeros``). A write the CPU does not repeat drops the values of that storage.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

_aten = torch.ops.aten

#: the most elements a remembered value may have (a routing tensor has b·s·k or b·s·n)
CAP = 1 << 22

#: ops whose output's values do not depend on their tensor inputs' values (only shapes and dtypes)
_VALUE_FREE = frozenset(("zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full",
                         "scalar_tensor", "zeros", "ones", "full", "arange", "eye"))
#: in-place ops that overwrite every element of their first argument
_OVERWRITE = frozenset(("fill_", "zero_", "copy_"))


def _name(func: Any) -> str:
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else ""


def balanced_topk(shape: tuple[int, ...], dim: int, n: int) -> torch.Tensor:
    """Indices of shape ``shape`` (``topk``'s, ``k`` = ``shape[dim]``) over ``n`` candidates: position ``p``
    (the other dimensions flattened in order) picks ``(p·k + j) mod n`` as its ``j``-th; int64, on the CPU."""
    dim = dim % len(shape) if shape else 0
    k = shape[dim] if shape else 1
    moved = [s for i, s in enumerate(shape) if i != dim]
    rows = 1
    for s in moved:
        rows *= s
    grid = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % max(n, 1)
    return grid.reshape(*moved, k).movedim(-1, dim).contiguous() if shape else grid.reshape(())


class RoutingValues:
    """The CPU values of the trace's tensors that derive from a router's top-k choice (module docstring)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        # id(tensor) -> (weak reference, CPU value or a recipe making it, storage id)
        self._vals: dict[int, tuple[Any, Any, int]] = {}
        self._by_storage: dict[int, set[int]] = {}
        self._mutable: dict[Any, tuple[int, ...]] = {}

    # ----- the table ---------------------------------------------------------------------------
    def _set(self, t: torch.Tensor, value: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type or t.numel() > CAP:
            return
        try:
            sid = id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        key = id(t)
        self._forget(key)
        vals, by = self._vals, self._by_storage

        def gone(_: Any, key: int = key) -> None:
            entry = vals.pop(key, None)
            if entry is not None:
                by.get(entry[2], set()).discard(key)
        self._vals[key] = (weakref.ref(t, gone), value, sid)
        self._by_storage.setdefault(sid, set()).add(key)

    def _forget(self, key: int) -> None:
        entry = self._vals.pop(key, None)
        if entry is not None:
            self._by_storage.get(entry[2], set()).discard(key)

    def _drop_storage(self, t: torch.Tensor) -> None:
        try:
            sid = id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        for key in list(self._by_storage.pop(sid, ())):
            self._vals.pop(key, None)

    def _entry(self, t: Any) -> tuple[Any, Any, int] | None:
        entry = self._vals.get(id(t))
        return entry if entry is not None and entry[0]() is t else None

    def value(self, t: Any, lazy: bool = True) -> torch.Tensor | None:
        """``t``'s CPU value, or None; a recipe is made (``lazy``) or not counted."""
        entry = self._entry(t)
        if entry is None:
            return None
        v = entry[1]
        if callable(v):
            if not lazy:
                return None
            v = v()
            self._set(t, v)
        return v

    def _known(self, t: Any) -> bool:
        entry = self._entry(t)
        return entry is not None and not callable(entry[1])

    # ----- the ops -------------------------------------------------------------------------------
    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out`` its values where ``func``'s inputs have theirs (or seed ``topk``'s indices)."""
        name = _name(func)
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)
                   and a.device.type == self.device_type]
        if name == "topk" and isinstance(out, (tuple, list)) and len(out) == 2:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            src = args[0]
            n = src.size(dim) if src.dim() else 1
            self._set(out[1], balanced_topk(tuple(out[1].shape), dim, n))
            return
        valued = any(self._known(a) for a in tensors)
        small = isinstance(out, torch.Tensor) and out.numel() <= CAP
        if not valued:
            recipe = self._recipe(func, args, kwargs, tensors) if small and (
                name in _VALUE_FREE or (tensors and not self._writes(func))) else None
            if recipe is not None:
                self._set(out, recipe)
            else:
                self._drop_written(func, args)
            return
        result = self.run_on_cpu(func, args, kwargs, tensors)
        if result is None:
            self._drop_written(func, args)
            return
        self._attach(out, result)

    def _recipe(self, func: Any, args: tuple, kwargs: dict, tensors: list) -> Callable[[], Any] | None:
        """A function making ``func``'s output on the CPU from its inputs' values or recipes as they are now
        (a value-free op's inputs as zeros of their shapes), or None where an input has neither; it holds
        no device tensor (which would outlive its free)."""
        inputs: dict[int, Any] = {}
        for t in tensors:
            entry = self._entry(t)
            if entry is not None:
                inputs[id(t)] = entry[1]
            elif _name(func) in _VALUE_FREE:
                inputs[id(t)] = (tuple(t.shape), t.dtype)
            else:
                return None
        slots = {key: _Slot(key) for key in inputs}
        a_t, k_t = _substitute(args, kwargs, slots, self.device_type)

        def make() -> Any:
            sub = {}
            for key, v in inputs.items():
                sub[key] = v() if callable(v) else (torch.zeros(v[0], dtype=v[1]) if isinstance(v, tuple) else v)
            return func(*_fill(a_t, sub), **{k: _fill(v, sub) for k, v in k_t.items()})
        return make

    def _writes(self, func: Any) -> bool:
        return bool(self._written(func))

    def run_on_cpu(self, func: Any, args: tuple, kwargs: dict, tensors: list | None = None) -> Any:
        """``func`` run on the CPU values of its device inputs, or None where one has none."""
        if tensors is None:
            tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)
                       and a.device.type == self.device_type]
        name = _name(func)
        sub: dict[int, torch.Tensor] = {}
        for i, t in enumerate(tensors):
            v = self.value(t)
            if v is None:
                if name in _VALUE_FREE or (name in _OVERWRITE and i == 0 and t is args[0]):
                    v = torch.zeros(tuple(t.shape), dtype=t.dtype)
                else:
                    return None
            sub[id(t)] = v
        a, k = _substitute(args, kwargs, sub, self.device_type)
        try:
            return func(*a, **k)
        except Exception:  # noqa: BLE001 - an op the CPU does not run the same way: no value
            return None

    def _attach(self, out: Any, result: Any) -> None:
        if isinstance(out, torch.Tensor) and isinstance(result, torch.Tensor):
            if tuple(out.shape) == tuple(result.shape):
                self._set(out, result)
            else:
                self._forget(id(out))
        elif isinstance(out, (tuple, list)) and isinstance(result, (tuple, list)) and len(out) == len(result):
            for o, r in zip(out, result):
                self._attach(o, r)

    def _written(self, func: Any) -> tuple[int, ...]:
        """The positions of the arguments ``func`` writes (its schema's ``alias_info.is_write``)."""
        idx = self._mutable.get(func)
        if idx is None:
            schema = getattr(func, "_schema", None)
            idx = tuple(i for i, a in enumerate(getattr(schema, "arguments", ()))
                        if a.alias_info is not None and a.alias_info.is_write)
            self._mutable[func] = idx
        return idx

    def _drop_written(self, func: Any, args: tuple) -> None:
        """The values of every storage ``func`` writes and the CPU did not: no longer known."""
        for i in self._written(func):
            if i < len(args) and isinstance(args[i], torch.Tensor):
                self._drop_storage(args[i])

    def sized(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Outputs of an op that fails without data (``nonzero``, indexing by a boolean mask), sized by the
        op run on the CPU, or None where a value it needs is missing. Inputs without values enter as zeros
        of their shapes, one element broadcast (an activation indexed by a routing or language mask: its
        values do not size the output); the outputs get values only where every input had one. An op that
        writes its first argument (``index_put_`` by a mask) returns it, its size unchanged."""
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor) and a.device.type == self.device_type]
        if not any(self.value(t) is not None for t in tensors):
            return None
        if 0 in self._written(func):
            result = self.run_on_cpu(func, args, kwargs, tensors)
            self._drop_written(func, args) if result is None else self._attach(args[0], result)
            return args[0]
        sub = {id(t): self.value(t) for t in tensors}
        complete = all(v is not None for v in sub.values())
        sub = {id(t): sub[id(t)] if sub[id(t)] is not None else torch.zeros((), dtype=t.dtype).expand(t.shape)
               for t in tensors}
        a, k = _substitute(args, kwargs, sub, self.device_type)
        try:
            result = func(*a, **k)
        except Exception:  # noqa: BLE001 - not an op the CPU sizes this way
            return None
        out = _meta_like(result, self.device_type)
        if complete:
            self._attach(out, result)
        return out


class _Slot:
    """A recipe's placeholder for a device input (``RoutingValues._recipe``)."""

    def __init__(self, key: int) -> None:
        self.key = key


def _fill(a: Any, sub: dict[int, torch.Tensor]) -> Any:
    if isinstance(a, _Slot):
        return sub[a.key]
    if isinstance(a, (list, tuple)):
        return type(a)(_fill(x, sub) for x in a)
    return a


def _flat(args: tuple, kwargs: dict) -> list:
    out: list = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _cpu(a: Any, sub: dict[int, torch.Tensor], device_type: str) -> Any:
    if isinstance(a, torch.Tensor):
        return sub.get(id(a), a)
    if isinstance(a, torch.device) and a.type == device_type:
        return torch.device("cpu")
    if isinstance(a, (list, tuple)):
        return type(a)(_cpu(x, sub, device_type) for x in a)
    return a


def _substitute(args: tuple, kwargs: dict, sub: dict[int, torch.Tensor], device_type: str) -> tuple:
    a = tuple(_cpu(x, sub, device_type) for x in args)
    k = {key: ("cpu" if key == "device" and v is not None else _cpu(v, sub, device_type))
         for key, v in kwargs.items()}
    return a, k


def _meta_like(result: Any, device_type: str) -> Any:
    if isinstance(result, torch.Tensor):
        return _aten.empty_strided.default(tuple(result.shape), tuple(result.stride()), dtype=result.dtype,
                                           device=torch.device(device_type))
    if isinstance(result, (tuple, list)):
        return type(result)(_meta_like(r, device_type) for r in result)
    return result
