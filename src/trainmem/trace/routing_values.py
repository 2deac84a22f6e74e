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
From there every op whose device inputs all have values (or recipes) gets a recipe of its output: the same
op, run on the CPU on those values when a value is first asked for (integer masks, counts, sorted indices:
``T·k`` or ``T·n`` elements, at most ``CAP``). An op that fails on tensors without data (``nonzero``, indexing
by a mask) takes its output's size from the op run on the CPU then, and a host read (``.item()``,
``.tolist()``, ``.cpu()``) answers the value. Factory outputs (``zeros``, ``arange``, ...) get recipes too
(``one_hot``'s ``arange``, JetMoE's ``zeros``). So nothing runs on the CPU where no value is read (the
``grouped_mm`` experts' routing: Qwen3-30B-A3B's trace at 2 x 4096, 7 s, as without). A recipe takes its inputs
as they are when its op runs (an in-place op writes a copy); a write drops the recipes of the storage it
writes (its views').
"""
from __future__ import annotations

import weakref
from typing import Any

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

    def value(self, t: Any) -> torch.Tensor | None:
        """``t``'s CPU value (made now from its recipe), or None."""
        entry = self._entry(t)
        if entry is None:
            return None
        v = entry[1]
        if callable(v):
            try:
                v = v()
            except RecursionError:  # (a chain of recipes too long to make)
                v = None
            if not isinstance(v, torch.Tensor):
                self._forget(id(t))
                return None
            self._set(t, v)
        return v

    # ----- the ops -------------------------------------------------------------------------------
    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out`` a recipe of its values where ``func``'s inputs have values or recipes (or seed
        ``topk``'s indices); drop what ``func`` writes otherwise."""
        name = _name(func)
        tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)
                   and a.device.type == self.device_type]
        if name == "topk" and isinstance(out, (tuple, list)) and len(out) == 2:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            src = args[0]
            n = src.size(dim) if src.dim() else 1
            self._set(out[1], balanced_topk(tuple(out[1].shape), dim, n))
            return
        recipe = None
        if name in _VALUE_FREE or any(self._entry(t) is not None for t in tensors):
            recipe = self._recipe(func, args, kwargs, tensors)
        written = self._written(func)
        for i in written:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                self._drop_storage(args[i])  # (its views' recipes hold its values before this write)
        if recipe is None:
            return
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.numel() <= CAP:
                self._set(o, recipe if not isinstance(out, (tuple, list)) else _Part(recipe, i))

    def _recipe(self, func: Any, args: tuple, kwargs: dict, tensors: list) -> "_Recipe | None":
        """``func``'s outputs made on the CPU from its inputs' values or recipes as they are now (a value-free
        op's inputs, and the first argument an op overwrites, as zeros of their shapes), or None where an
        input has neither; it holds no device tensor (which would outlive its free)."""
        name = _name(func)
        inputs: dict[int, Any] = {}
        for i, t in enumerate(tensors):
            entry = self._entry(t)
            if entry is not None:
                inputs[id(t)] = entry[1]
            elif name in _VALUE_FREE or (name in _OVERWRITE and i == 0 and args and t is args[0]):
                inputs[id(t)] = (tuple(t.shape), t.dtype)
            else:
                return None
        slots = {key: _Slot(key) for key in inputs}
        a_t, k_t = _substitute(args, kwargs, slots, self.device_type)
        first = id(args[0]) if args and isinstance(args[0], torch.Tensor) and self._written(func) else None
        return _Recipe(func, a_t, k_t, inputs, first)

    def run_on_cpu(self, func: Any, args: tuple, kwargs: dict, tensors: list | None = None) -> Any:
        """``func`` run now on the CPU values of its device inputs, or None where one has none."""
        if tensors is None:
            tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)
                       and a.device.type == self.device_type]
        recipe = self._recipe(func, args, kwargs, tensors)
        return recipe() if recipe is not None else None

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
            self.after(func, args, kwargs, args[0])
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


class _Recipe:
    """A value made on the CPU when first asked for: ``func`` on its inputs' values as they were when it ran
    (an op that writes its first argument writes a copy of it), made once."""

    __slots__ = ("func", "args", "kwargs", "inputs", "first", "done", "result")

    def __init__(self, func: Any, args: tuple, kwargs: dict, inputs: dict[int, Any], first: int | None) -> None:
        self.func, self.args, self.kwargs, self.inputs, self.first = func, args, kwargs, inputs, first
        self.done, self.result = False, None

    def __call__(self) -> Any:
        if not self.done:
            self.done = True
            sub: dict[int, Any] = {}
            for key, v in self.inputs.items():
                v = v() if callable(v) else (torch.zeros(v[0], dtype=v[1]) if isinstance(v, tuple) else v)
                if v is None:
                    return None
                sub[key] = v.clone() if key == self.first else v
            try:
                self.result = self.func(*_fill(self.args, sub), **{k: _fill(v, sub) for k, v in self.kwargs.items()})
            except Exception:  # noqa: BLE001 - an op the CPU does not run the same way: no value
                self.result = None
            self.inputs = {}  # (made: what it was made from is no longer needed)
        return self.result


class _Part:
    """Output ``i`` of a recipe of several outputs (``sort``'s values and indices)."""

    __slots__ = ("recipe", "i")

    def __init__(self, recipe: _Recipe, i: int) -> None:
        self.recipe, self.i = recipe, i

    def __call__(self) -> Any:
        r = self.recipe()
        return r[self.i] if isinstance(r, (tuple, list)) and len(r) > self.i else None


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
