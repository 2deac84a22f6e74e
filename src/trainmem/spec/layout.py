"""The divisibility rules a parallel layout must meet, in one place.

``layout_problems`` lists what is wrong with a (tp, pp, cp, sequence) choice for a model.
``spec.training.check_against`` raises the first problem as an error; the planner
(``plan.planner.enumerate_layouts``) uses the same list to reject layouts with a reason.

The rules: tensor parallelism splits attention heads and the key/value heads into whole heads per
rank (Megatron-LM ``megatron/core/transformer/attention.py``, ``Attention.__init__``:
``divide(num_attention_heads, world_size)`` and ``divide(num_query_groups, world_size)``, where
``divide`` asserts divisibility; torchtitan's colwise-sharded ``wk``/``wv`` are viewed as
``(bs, seq, -1, head_dim)`` per rank, so a TP size above the KV heads would split a head) and the
MLP's intermediate size; pipeline stages hold whole layers (evenly, or
torchtitan's weighted split: ``stage_layer_counts``); context
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

from .config import HAND_TWINS, tensor_parallel_twin


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


def tp_problems(model: Any, tp: int, cp: int = 1) -> list[Problem]:
    """Why ``tp`` cannot split ``model``'s heads, key/value heads or MLP (empty when it can). A
    derived model with a hand-written twin (Qwen3, ``spec.config.tensor_parallel_twin``) is checked
    as the twin the estimate runs under ``tp`` (and ``cp``: the twin is used without context
    parallelism only)."""
    out = []
    model = tensor_parallel_twin(model, tp, cp) if tp > 1 else model
    if tp > 1 and getattr(model, "family", "") == "derived":
        # its activations come from one-GPU traces (estimate/derived.py): no TP-sharded layer to trace
        twin = " (Qwen3's hand-written twin is modelled without --cp)" if model.model_type in HAND_TWINS else ""
        return [Problem("tp", tp, "is not modelled for an architecture without hand-written formulas" + twin,
                        "its activations are fitted from one-GPU traces, which hold no tensor-parallel layer; use "
                        "--tp 1 (data parallelism, ZeRO/FSDP and pipelines are modelled)")]
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


def pp_problems(model: Any, pp: int, first_less: int = 0, last_less: int = 0) -> list[Problem]:
    """Why ``pp`` stages cannot hold ``model``'s layers: evenly (``first_less = last_less = 0``,
    today's rule: ``pp`` divides the layers), or split as torchtitan splits them when the embeddings
    and the head count as ``first_less`` and ``last_less`` layers (:func:`stage_layer_counts`, whose
    refusals are torchtitan's ``ValueError`` checks)."""
    if pp == 1:
        return []
    if not (first_less or last_less):
        if model.num_layers % pp:
            return [Problem("pp", pp, f"does not divide the {model.num_layers} layers",
                            f"choose a PP size that divides {model.num_layers}, or count the embeddings and the "
                            "head as layers as torchtitan does (--pp-first-stage-less-layers 1 "
                            "--pp-last-stage-less-layers 1, or --framework torchtitan)")]
        return []
    why = split_problem(model.num_layers, pp, first_less, last_less)
    if not why and 0 in stage_layer_counts(model.num_layers, pp, first_less, last_less):
        # torchtitan allows a stage of embeddings or head alone; trainmem's stages hold decoder layers
        why = (f"with --pp-first-stage-less-layers {first_less} --pp-last-stage-less-layers {last_less} leaves a "
               f"stage without decoder layers ({model.num_layers} layers), which trainmem does not model")
    return [Problem("pp", pp, why, "choose a smaller PP size or smaller --pp-first/last-stage-less-layers")] if why else []


def split_problem(num_layers: int, stages: int, first_less: int, last_less: int) -> str:
    """Why torchtitan's split refuses ``stages`` stages of ``num_layers`` layers with the embeddings
    and the head weighing ``first_less`` and ``last_less`` layers ("" when it does not): its checks in
    ``generate_llm_fqn_per_model_part`` (pytorch/torchtitan v0.2.2
    ``torchtitan/distributed/pipeline_parallel.py`` L269-296: more stages than effective layers, an
    empty stage, a weight above the smallest stage)."""
    effective = num_layers + first_less + last_less
    if stages > effective:
        return f"exceeds the {effective} effective layers ({num_layers} layers + {first_less} + {last_less})"
    per = effective // stages
    if first_less > per or last_less > per:
        return (f"leaves {per} effective layers per stage, fewer than the embeddings' or the head's weight "
                f"({first_less}, {last_less})")
    return ""


def stage_layer_counts(num_layers: int, stages: int, first_less: int = 0, last_less: int = 0) -> tuple[int, ...]:
    """The decoder layers of each of ``stages`` pipeline stages, in order, as torchtitan splits a
    model (pytorch/torchtitan v0.2.2 ``torchtitan/distributed/pipeline_parallel.py``
    ``generate_llm_fqn_per_model_part`` L236-344, today ``_generate_llm_fqn_per_model_part``): the
    embeddings count as ``first_less`` layers and the final norm and head as ``last_less``
    (``job_config.py`` L377-387 ``pipeline_parallel_first_stage_less_layers`` /
    ``..._last_stage_less_layers``, 1 each by default), the ``L + first_less + last_less``
    effective layers are dealt out ``effective // stages`` a stage, the first ``effective % stages``
    stages one more, and the first and last stage give up their weight in layers. With both weights
    0 and ``stages`` dividing the layers this is the even split. Llama-3.1-405B (126 layers), 16
    stages, weights 1: 128 effective, 8 a stage: 7, 8 × 14, 7. Interleaved schedules split the
    ``pp × V`` virtual stages the same way (``num_virtual_stages``, L75-115)."""
    if stages == 1:
        return (num_layers,)
    effective = num_layers + first_less + last_less
    per, extra = divmod(effective, stages)
    counts = [per + (i < extra) for i in range(stages)]
    counts[0] -= first_less
    counts[-1] -= last_less
    return tuple(counts)


def stage_layers(num_layers: int, stages: int, stage: int, first_less: int = 0,
                 last_less: int = 0) -> tuple[int, int]:
    """The decoder layers ``[lo, hi)`` of pipeline stage ``stage`` of ``stages``
    (:func:`stage_layer_counts`)."""
    counts = stage_layer_counts(num_layers, stages, first_less, last_less)
    lo = sum(counts[:stage])
    return lo, lo + counts[stage]


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
                    shard_group: int | None = None, pp_less: tuple[int, int] = (0, 0)) -> list[Problem]:
    """Every divisibility rule ``model`` and the layout break, tensor parallelism first
    (``pp_less``: the embeddings' and the head's weight in torchtitan's stage split)."""
    out = tp_problems(model, tp, cp) + pp_problems(model, pp, *pp_less) + cp_problems(model, cp) + \
        ep_problems(model, ep, dp, shard_group)
    if seq_len is not None:
        out += sequence_problems(seq_len, tp, cp, sequence_parallel)
    return out
