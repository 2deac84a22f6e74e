"""peft's ``target_modules="all-linear"`` shorthand resolved against a model's parameters.

peft 0.21.2 ``tuners/tuners_utils.py`` ``_maybe_include_all_linear_layers`` (L2430-2490) replaces
"all-linear" by the leaf names of every ``nn.Linear`` / ``Conv1D`` of the model (L2445-2459), less the
model's output embedding (``get_output_embeddings()``, L2464-2469: the causal LM's ``lm_head``,
GPT-NeoX's ``embed_out``); a ``LoraConfig`` without ``task_type`` keeps a classification head
(L2470-2478 drop it only for ``TaskType.SEQ_CLS``). Routers that are not ``nn.Linear`` (transformers
5's ``MixtralTopKRouter``, ``models/mixtral/modeling_mixtral.py``) and 3-D expert tensors
(``MixtralExperts``) are not linear modules, nor is a vision tower's ``Conv2d`` patch embedding.
On a mixture-of-experts model peft also adds the experts' and the router's transformers-4 names
(``utils/transformers_weight_conversion.py`` ``_resolve_string_target_modules``, L355-373), adapted
as 3-D parameters (``ParamWrapper``): not modelled under "all-linear", so refused.
"""
from __future__ import annotations

from typing import Any

from ..errors import TrainmemError

ALL_LINEAR = "all-linear"  # peft/utils/constants.py INCLUDE_LINEAR_LAYERS_SHORTHAND
#: leaf names of output embeddings (``get_output_embeddings()``) across transformers' LM heads
OUTPUT_EMBEDDINGS = frozenset({"lm_head", "embed_out"})


def is_all_linear(targets: Any) -> bool:
    """Whether ``targets`` (a tuple of names as ``TrainingSpec.lora_targets`` holds them) is peft's
    "all-linear" shorthand (peft lower-cases it, L2441; ``all_linear`` is accepted too)."""
    return (targets is not None and len(targets) == 1
            and str(targets[0]).strip().lower().replace("_", "-") == ALL_LINEAR)


def all_linear_targets(model: Any) -> tuple[str, ...]:
    """The leaf module names peft's "all-linear" adapts in ``model`` (a ModelSpec), sorted: each 2-D
    weight of role "linear" (an ``nn.Linear``: shape (out, in), or GPT-2's ``Conv1D`` (in, out)),
    less the output embedding. A VLM's names come from its language model only, as the trace applies
    them (``workload.language_model_targets``: LLaMA-Factory leaves the vision tower out). A
    mixture-of-experts model is refused in one line (the module's docstring)."""
    if model.num_experts:
        raise TrainmemError(f"--lora-targets all-linear with {model.name}, a mixture-of-experts model: peft 0.21 "
                            "adapts its experts and router too (ParamWrapper), which is not modelled; name the "
                            "modules, e.g. --lora-targets q_proj,k_proj,v_proj,o_proj")
    names = set()
    for p in model.parameter_tensors():
        if p.role != "linear" or len(p.shape) != 2 or p.module in OUTPUT_EMBEDDINGS:
            continue
        if model.is_vlm and ".language_model." not in f".{p.name}":
            continue
        names.add(p.module)
    return tuple(sorted(names))
