"""The divisibility rules a parallel layout must meet, in one place.

``layout_problems`` lists what is wrong with a (tp, pp, cp, sequence) choice for a model.
``spec.training.check_against`` raises the first problem as an error; the planner
(``plan.planner.enumerate_layouts``) uses the same list to reject layouts with a reason.

The rules: tensor parallelism splits attention heads and the key/value heads into whole heads per
rank (Megatron-LM ``megatron/core/transformer/attention.py``, ``Attention.__init__``:
``divide(num_attention_heads, world_size)`` and ``divide(num_query_groups, world_size)``, where
``divide`` asserts divisibility; torchtitan's colwise-sharded ``wk``/``wv`` are viewed as
``(bs, seq, -1, head_dim)`` per rank, so a TP size above the KV heads would split a head) and the
MLP's intermediate size; pipeline stages hold whole layers; context
parallelism splits the sequence; sequence parallelism splits each rank's local sequence over TP.
Expert parallelism (``ep_problems``) gives each rank whole experts and is carved out of the
data-parallel ranks that shard the states: transformers 5.23 ``DistributedConfig._validate_mesh_config``
(src/transformers/distributed/configuration_utils.py: "`ep_size` must be a multiple of `tp_size`",
"`ep_size` must divide `fsdp_size * tp_size`"; ``MoEParamShard.shard_param`` in
distributed/expert_parallel.py: "Cannot evenly shard {E} experts across {ep} expert-parallel ranks")
and torchtitan's ``ParallelDims._validate`` (torchtitan/distributed/parallel_dims.py, ETP=1:
``ep % (cp * tp) == 0 and (dp_shard * cp * tp) % ep == 0``) agree, and Megatron-LM, which also
runs EP under plain data parallelism, asks ``world_size % (etp * ep * pp) == 0``
(megatron/core/parallel_state.py ``initialize_model_parallel``: ``expert_data_parallel_size =
world_size // expert_tensor_model_pipeline_parallel_size``): with tp = pp = cp = 1 (the only EP
layouts trainmem models), ep divides the experts and the data-parallel (sharding) group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One broken rule: the option (``tp``, ``pp``, ``cp``), its value, and what it breaks."""

    option: str
    value: int
    reason: str     # e.g. "does not divide the 32 attention heads"
    fix: str        # e.g. "choose a TP size that divides 32"
    of_model: bool = True  # a rule about the model's shape (else about the sequence)

    @property
    def label(self) -> str:
        return f"{self.option}={self.value}"

    def message(self, model_name: str) -> str:
        """The one-line error a user sees."""
        where = f" of {model_name}" if self.of_model else ""
        return f"--{self.option} {self.value} {self.reason}{where}; {self.fix}"


def tp_problems(model: Any, tp: int) -> list[Problem]:
    """Why ``tp`` cannot split ``model``'s heads, key/value heads or MLP (empty when it can)."""
    out = []
    if tp > 1 and getattr(model, "family", "") == "derived":
        # its activations come from one-GPU traces (estimate/derived.py): no TP-sharded layer to trace
        return [Problem("tp", tp, "is not modelled for an architecture without hand-written formulas",
                        "use --tp 1 (data parallelism, ZeRO/FSDP and pipelines are modelled)")]
    if model.num_heads % tp:
        out.append(Problem("tp", tp, f"does not divide the {model.num_heads} attention heads",
                           f"choose a TP size that divides {model.num_heads}"))
    if tp > model.num_kv_heads:
        out.append(Problem("tp", tp, f"exceeds the {model.num_kv_heads} key/value heads (each TP rank needs "
                                     "whole KV heads)", f"choose a TP size that divides {model.num_kv_heads}"))
    elif model.num_kv_heads % tp:
        out.append(Problem("tp", tp, f"cannot split the {model.num_kv_heads} key/value heads evenly",
                           f"choose a TP size that divides {model.num_kv_heads}"))
    if model.ffn_size % tp:
        out.append(Problem("tp", tp, f"does not divide the MLP size {model.ffn_size}",
                           "choose a TP size that divides it"))
    return out


def pp_problems(model: Any, pp: int) -> list[Problem]:
    """Why ``pp`` stages cannot hold ``model``'s layers evenly."""
    if model.num_layers % pp:
        return [Problem("pp", pp, f"does not divide the {model.num_layers} layers",
                        f"choose a PP size that divides {model.num_layers}")]
    return []


def cp_problems(model: Any, cp: int) -> list[Problem]:
    """Why ``model`` cannot be estimated with context parallelism (its activations are derived
    from one-GPU traces, estimate/derived.py)."""
    if cp > 1 and getattr(model, "family", "") == "derived":
        return [Problem("cp", cp, "is not modelled for an architecture without hand-written formulas",
                        "use --cp 1")]
    return []


def ep_problems(model: Any, ep: int, dp: int = 1, shard_group: int | None = None) -> list[Problem]:
    """Why ``ep`` ranks cannot split ``model``'s experts: a model without experts, a derived
    architecture (its activations are fitted from one-GPU traces), experts or the data-parallel
    group (``shard_group``: the ranks the states are sharded over, a node under hybrid FSDP) that
    ``ep`` does not divide. See the module doc for the sources."""
    if ep == 1:
        return []
    experts = getattr(model, "num_experts", 0)
    if not experts:
        return [Problem("ep", ep, "needs a mixture-of-experts model, not the dense layers", "use --ep 1")]
    if getattr(model, "family", "") == "derived":
        return [Problem("ep", ep, "is not modelled for the trace-fitted MoE layers",
                        "use --ep 1 (their activations come from one-GPU traces, with no all-to-all dispatch)")]
    out = []
    if experts % ep:
        out.append(Problem("ep", ep, f"does not divide the {experts} experts per layer",
                           f"choose an EP size that divides {experts}"))
    group = dp if shard_group is None else shard_group
    if group % ep:
        hybrid = group != dp
        what = "ranks of the FSDP sharding group (--fsdp hybrid: a node)" if hybrid else "data-parallel ranks"
        fix = (f"choose a node size (fsdp_node_size) that is a multiple of {ep}" if hybrid
               else f"choose --dp a multiple of {ep}")
        out.append(Problem("ep", ep, f"does not divide the {group} {what}: expert parallelism is carved out of "
                           "them (transformers' DistributedConfig, torchtitan's ParallelDims)", fix, of_model=False))
    return out


def sequence_problems(seq_len: int, tp: int, cp: int, sequence_parallel: bool) -> list[Problem]:
    """Why the sequence cannot be split over ``cp`` ranks and, with sequence parallelism, over ``tp``."""
    if seq_len % cp:
        return [Problem("cp", cp, f"does not divide the sequence length {seq_len}",
                        f"choose a CP size that divides {seq_len}", of_model=False)]
    local = seq_len // cp
    if sequence_parallel and local % tp:
        return [Problem("tp", tp, f"does not divide the local sequence {local} (sequence parallelism)",
                        f"choose a TP size that divides {local}, or drop --sequence-parallel", of_model=False)]
    return []


def layout_problems(model: Any, tp: int = 1, pp: int = 1, cp: int = 1, seq_len: int | None = None,
                    sequence_parallel: bool = False, ep: int = 1, dp: int = 1,
                    shard_group: int | None = None) -> list[Problem]:
    """Every divisibility rule ``model`` and the layout break, tensor parallelism first."""
    out = tp_problems(model, tp) + pp_problems(model, pp) + cp_problems(model, cp) + \
        ep_problems(model, ep, dp, shard_group)
    if seq_len is not None:
        out += sequence_problems(seq_len, tp, cp, sequence_parallel)
    return out
