"""Shared by the --compile tests: what a partitioned forward graph saves for its backward."""
from __future__ import annotations

import operator

import torch

import trainmem.trace.compiled as compiled


def saved_bases(fw: torch.fx.GraphModule, user_outputs: int) -> list[tuple[torch.fx.Node, torch.Tensor]]:
    """(node, value) of the distinct storages the partitioned forward returns for the backward (its
    outputs after the user's), each view followed to the tensor it views; graph inputs (parameters,
    the batch) and host values (the RNG state of a recomputed random op) left out."""
    outs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    seen, found = set(), []
    for n in outs[user_outputs:]:
        if not isinstance(n, torch.fx.Node):
            continue
        base = n
        while base.op == "call_function" and (compiled._packet(base) in compiled._VIEWS
                                              or base.target is operator.getitem) \
                and isinstance(base.args[0], torch.fx.Node) \
                and not isinstance(base.args[0].meta.get("val"), (tuple, list)):
            base = base.args[0]
        if base.op == "placeholder" or base in seen:
            continue
        seen.add(base)
        v = base.meta.get("val")
        if isinstance(v, torch.Tensor):
            found.append((base, v))
    return found
