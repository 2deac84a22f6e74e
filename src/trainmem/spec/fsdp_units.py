"""Which modules FSDP1's ``size_based_auto_wrap_policy`` makes units of, from a model's parameter counts.

torch 2.13 ``torch/distributed/fsdp/wrap.py``: ``_wrap_utils._auto_wrap`` calls ``_recursive_wrap`` on
the root with ``only_wrap_children=True`` (``FullyShardedDataParallel`` wraps the root itself).
``_recursive_wrap`` (L488-560) counts a module's parameters (``nonwrapped_numel``), descends into its
children only when the policy says so with ``recurse=True``, and then wraps the module when the
policy accepts the ``remainder`` (its parameters not already in a child's unit) with ``recurse=False``.
``size_based_auto_wrap_policy`` (L341-397) answers both with ``nonwrapped_numel >= min_num_params``,
never wrapping an ``nn.ModuleList`` / ``nn.ModuleDict`` (``EXCLUDE_WRAP_MODULES``) and never descending
into ``nn.MultiheadAttention`` (``FORCE_LEAF_MODULES``, which no transformers LM uses).

The module tree is read off the parameter names of ``ModelSpec.parameter_tensors`` (transformers'
names under the base model): a parameter's module is its name without the last component, a
``ModuleList`` is a module whose children are numbered, and the causal-LM class holds the base model
(``model`` / ``transformer``: every tensor but the head's) and ``lm_head`` (``LlamaForCausalLM``,
``GPT2LMHeadModel``: ``self.model`` / ``self.transformer`` then ``self.lm_head``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the base model, as a node of the tree (its name does not appear in ModelSpec's tensor names)
BODY = "<base model>"


@dataclass
class _Node:
    own: int = 0                                 # parameters held by the module itself
    children: dict[str, "_Node"] = field(default_factory=dict)

    def total(self) -> int:
        return self.own + sum(c.total() for c in self.children.values())

    def is_list(self) -> bool:
        return bool(self.children) and all(k.isdigit() for k in self.children)


def module_tree(tensors: Any) -> _Node:
    """The causal LM's module tree: the root holds the base model (``BODY``) and ``lm_head``."""
    root = _Node()
    for p in tensors:
        path = p.name.split(".")[:-1]
        node = root if path[:1] == ["lm_head"] else root.children.setdefault(BODY, _Node())
        for part in path:
            node = node.children.setdefault(part, _Node())
        node.own += p.numel
    return root


def size_units(tensors: Any, min_num_params: int) -> list[str]:
    """The modules ``size_based_auto_wrap_policy(min_num_params=...)`` wraps, as dotted paths from the
    root (``<base model>.layers.3``), in registration order, children before their parent."""
    units: list[str] = []

    def wrap(node: _Node, path: str, only_children: bool) -> int:
        total = node.total()
        if total < min_num_params:                      # policy(recurse=True) is False: not descended
            return 0
        wrapped = sum(wrap(c, f"{path}.{k}" if path else k, False) for k, c in node.children.items())
        if not only_children and total - wrapped >= min_num_params and not node.is_list():
            units.append(path)
            return total
        return wrapped

    wrap(module_tree(tensors), "", True)
    return units


def size_policy_layout(model: Any, min_num_params: int) -> str:
    """What the size policy's units amount to for ``model``: ``"transformer"`` (each decoder layer a
    unit, the rest in the root), ``"none"`` (nothing wrapped: the root holds the whole model), or
    ``""`` (some other set of units)."""
    tensors = model.parameter_tensors()
    units = size_units(tensors, min_num_params)
    if not units:
        return "none"
    layers = {_layer_path(p.name) for p in tensors if p.layer is not None}
    return "transformer" if set(units) == layers else ""


def _layer_path(name: str) -> str:
    """``<base model>.layers.3`` for ``layers.3.mlp.up_proj.weight``: a decoder layer's module."""
    parts = name.split(".")
    i = next(j for j, x in enumerate(parts) if x.isdigit())
    return ".".join([BODY] + parts[:i + 1])


def transformer_range(model: Any) -> tuple[int, int]:
    """``(lo, hi)``: the ``min_num_params`` values in ``lo..hi`` make each decoder layer a unit and
    nothing else (``lo > hi`` when none does): a layer is wrapped once its parameters reach the
    threshold, unless one of its children does first or some module outside the layers (an embedding,
    the head, the base model's remainder) reaches it too."""
    tensors = model.parameter_tensors()
    tree = module_tree(tensors)
    body = tree.children.get(BODY, _Node())
    layer_list = next((c for c in _walk(body) if c.is_list()), None)
    if layer_list is None:
        return 1, 0
    layers = list(layer_list.children.values())
    hi = min(x.total() for x in layers)
    inner = max((c.total() for x in layers for c in x.children.values()), default=0)
    # outside the layers: the head beside the base model, and the base model's remainder (embeddings,
    # final norm), which is at least any one of its modules outside the layers
    outside = [c.total() for c in tree.children.values() if c is not body]
    return max([inner, body.total() - layer_list.total(), *outside]) + 1, hi


def _walk(node: _Node) -> list[_Node]:
    out = [node]
    for c in node.children.values():
        out += _walk(c)
    return out
