"""FSDP1's units under the auto-wrap policy users set (``--fsdp-auto-wrap-policy``), as ``States``.

``states._model_states`` counts FSDP's unsharded tensors for the transformer policy: one unit per
decoder layer (``layer_*``: gathered around its forward and its backward, its gradient flattened
and reduce-scattered at its post-backward) and the root unit (``root_*``: the embeddings, final norm
and head, kept gathered from forward to the end of backward, its gradients unsharded until then).
The other policies move parameters between those two kinds of unit (torch 2.13
``torch/distributed/fsdp/wrap.py`` ``_recursive_wrap`` L488-560, called with
``only_wrap_children=True`` on the root by ``_wrap_utils.py`` ``_auto_wrap``; ``FullyShardedDataParallel``
itself wraps the root):

* ``none`` (no policy: accelerate's NO_WRAP): the root is the only unit, one flat parameter of the
  whole model. FSDP1 does not reshard the root after forward (``_runtime_utils.py``
  ``_post_forward_reshard``: ``free_unsharded_flat_param = not state._is_root and ...``), so the
  whole model is gathered from the start of forward to the root's post-backward at the end of
  backward, and every parameter's gradient (a view of the flat parameter, ``_flat_param.py``
  ``_use_unsharded_views``) waits for ``SplitWithSizesBackward0``'s cat into the flat gradient at the
  end of backward (``quantities.fsdp1.fsdp1_root_flat_gradient``).
* ``module`` (``always_wrap_policy``, L117: every module is a unit): each module that holds
  parameters (a linear, a norm, the embedding, the head) is its own unit, gathered only around its
  own forward and backward (a non-root unit is resharded after forward); the root holds no
  parameter. So nothing stays gathered between forward and backward, and the unit gathered in a
  layer is one module, the layer's largest (with ``BackwardPrefetch.BACKWARD_PRE`` the next one in
  backward order beside it: counted as the largest too, an upper bound of a few MiB). The head's
  unsharded gradient is reduce-scattered by its own post-backward, not kept to the end of backward:
  while its backward runs the head is gathered again beside its weight gradient, its input's and the
  logits' (``head_units_full``; ``moments._fsdp1_head_unit``), and for its forward; the embedding
  units, the last of backward, are gathered again for their backward and their gradient views
  concatenated into their flat gradient there (``emb_units_full``, ``root_views``, ``root_flat``: the
  old root's end-of-backward moment, with the embeddings alone). Under SHARD_GRAD_OP every unit stays
  gathered from its forward to its backward (``_post_forward_reshard`` reshards only
  FULL_SHARD's units): each layer's modules together (``layer_units_full``), the embedding to the end
  of backward and the head to its own post-backward (``quantities.fsdp1.module_units_kept``).
* ``size`` (``size_based_auto_wrap_policy``): the units torch's recursion makes from the model's
  parameter counts (``spec.fsdp_units``); modelled where they are one unit per decoder layer (the
  transformer policy's) or none (NO_WRAP's), refused otherwise.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..allocator_rules import block_bytes
from ..errors import TrainmemError
from ..spec.fsdp_units import BODY, size_policy_layout, size_units, transformer_range
from ..spec.model import ModelSpec
from ..spec.training import TrainingSpec


def module_of(name: str) -> str:
    """The module a parameter belongs to: its name without the last component (``layers.0.mlp.up_proj``)."""
    return name.rsplit(".", 1)[0]


def largest_module(tensors: Any, layer: int, gather: int) -> list[Any]:
    """The parameter tensors of layer ``layer``'s largest module (bytes gathered at ``gather`` bytes per
    element), in registration order: ``always_wrap_policy``'s largest unit inside a decoder layer."""
    by_module: dict[str, list[Any]] = {}
    for p in tensors:
        if p.layer == layer:
            by_module.setdefault(module_of(p.name), []).append(p)
    return max(by_module.values(), key=lambda ps: sum(p.numel * gather for p in ps), default=[])


def per_module_units(st: Any, tensors: Any, layer: int, gather: int, reduce: int, trainable: bool,
                     expandable: bool) -> Any:
    """``States`` under ``always_wrap_policy``: the root holds nothing (no root gathered, no root
    gradient waiting for a flat gradient); a layer's unit is its largest module: its unsharded
    parameters (``layer_params_full``, ``layer_tensors``: gathered dtype), its unsharded gradients
    (``layer_grads_full``: one block per tensor, gathered dtype) and its flat reduce-scatter input
    (``layer_rs``: its elements in the reduce dtype) when trainable."""
    unit = largest_module(tensors, layer, gather)
    full = [p.numel * gather for p in unit]
    grads = sum(block_bytes(x, expandable) for x in full) if trainable else 0
    elems = sum(p.numel for p in unit)
    # the embedding units (the tensors before the layers) end backward: gathered at their pre-backward,
    # each gradient a view of its flat parameter concatenated into the flat gradient (as the old root's)
    before = st.root_tensors[:len(st.root_tensors) - len(st.head_unit_tensors)]
    emb = sum(block_bytes(x, expandable) for x in before)
    emb_grads = emb if trainable else 0
    return replace(st, root_full=0, root_tensors=(), head_unit_full=0, head_unit_tensors=(), head_grads_full=0,
                   emb_units_full=emb, head_units_full=sum(block_bytes(x, expandable) for x in st.head_unit_tensors),
                   layer_units_full=st.layer_params_full,
                   head_units_elems=sum(x // gather for x in st.head_unit_tensors) if trainable else 0,
                   root_views=emb_grads, root_flat=emb_grads, root_rs=0, root_last_grad=0,
                   root_flat_elems=sum(x // gather for x in before) if trainable else 0,
                   root_grads=st.root_grads - st.head_grads,  # the head's shard is made at its own post-backward
                   layer_params_full=sum(full), layer_tensors=tuple(full), layer_grads_full=grads,
                   layer_rs=block_bytes(elems * reduce, expandable) if (trainable and elems) else 0)


def one_root_unit(st: Any, per_stage: int, layer_elems: int, gather: int, root_flat_bytes: int,
                  expandable: bool) -> Any:
    """``States`` without a policy (NO_WRAP): every decoder layer's tensors join the root unit. The
    root gathered is the whole model (``root_tensors``: before the layers, each layer's, after them);
    its gradients, all unsharded, wait as views for the flat gradient (``root_views``) made at the end
    of backward (``root_flat``: the whole model's ``layer_elems`` x layers + the root's own, in the
    gathered dtype); no layer unit is gathered or reduce-scattered on its own. ``root_grads`` (the
    sharded gradients the root's post-backward makes) becomes every gradient on the rank."""
    n_after = len(st.head_unit_tensors)
    before = st.root_tensors[:len(st.root_tensors) - n_after]
    layers = st.layer_tensors * per_stage
    flat = root_flat_bytes + per_stage * layer_elems * gather
    return replace(st, root_full=st.root_full + per_stage * sum(block_bytes(x, expandable) for x in st.layer_tensors),
                   root_tensors=before + layers + st.head_unit_tensors,
                   root_views=st.root_views + per_stage * st.layer_grads_full,
                   root_flat=block_bytes(flat, expandable) if flat else 0, root_grads=st.grads,
                   root_flat_elems=flat // gather,
                   layer_params_full=0, layer_tensors=(), layer_grads_full=0, layer_rs=0)


def wrap_policy_states(m: ModelSpec, t: TrainingSpec, st: Any, r: Any, acc: Any, tensors: Any) -> Any:
    """``st`` with FSDP1's units of ``t.fsdp_auto_wrap_policy`` (``st`` itself for the transformer
    policy or without FSDP over several ranks). ``tensors``: the rank's parameter tensors as
    ``_base_tensors`` counts them (one layer standing for each); ``acc``: its running sums."""
    policy = t.fsdp_auto_wrap_policy
    if policy == "size" and r.fsdp_unsharded:
        policy = size_policy_for_estimate(m, t.fsdp_min_params)
    if policy == "transformer" or not r.fsdp_unsharded:
        return st
    if not m.uniform_layers or m.is_moe:  # (one layer stands for every layer)
        raise TrainmemError(f"--fsdp-auto-wrap-policy {t.fsdp_auto_wrap_policy}: the estimate models it for models whose "
                            f"decoder layers are alike and dense; {m.name} is not one: use trace, or "
                            "--fsdp-auto-wrap-policy transformer")
    reduce = 4 if t.precision == "bf16-mp" else r.gather
    if policy == "module":
        return per_module_units(st, tensors, r.lo, r.gather, reduce, not t.lora_rank, r.expandable)
    if policy == "none":
        return one_root_unit(st, r.per_stage, acc.layer_elems, r.gather, acc.root_flat_bytes, r.expandable)
    raise AssertionError(policy)


def size_policy_for_estimate(m: ModelSpec, n: int) -> str:
    """The policy the size-based one amounts to on ``m`` (``spec.fsdp_units.size_policy_layout``): one
    unit per decoder layer (transformer) or none; other unit sets (a layer's MLP alone, the base
    model as one unit beside the head, ...) are refused with the units found and the range of
    ``min_num_params`` that gives one unit per layer."""
    layout = size_policy_layout(m, n)
    if layout:
        return layout
    names = [u.replace(BODY + ".", "").replace(BODY, "the base model") for u in size_units(m.parameter_tensors(), n)]
    lo, hi = transformer_range(m)
    fix = (f"--fsdp-min-num-params from {lo} to {hi} (one unit per decoder layer), " if lo <= hi else "")
    raise TrainmemError(f"--fsdp-auto-wrap-policy size --fsdp-min-num-params {n} makes {len(names)} FSDP1 units of "
                        f"{m.name} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}), which the estimate "
                        f"does not model (one unit per decoder layer, or none): use trace, {fix}or a policy of "
                        "--fsdp-auto-wrap-policy transformer, module or none")
