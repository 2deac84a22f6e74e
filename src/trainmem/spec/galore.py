"""GaLore as the HF Trainer builds it: the ``optim`` names, ``optim_target_modules``, ``optim_args``.

transformers 5.24.0 ``trainer_optimizer.py``:
* ``_get_galore_optimizer`` (L351-381): ``galore_adamw`` / ``_8bit`` / ``galore_adafactor`` and their
  ``_layerwise`` variants are galore_torch's ``GaLoreAdamW``, ``GaLoreAdamW8bit``, ``GaLoreAdafactor``;
  ``optim_args`` gives ``rank`` (128), ``update_proj_gap`` (200), ``scale`` (0.25), ``proj_type``
  ("std"); ``galore_adafactor`` (not its layerwise variant) gets ``scale_parameter=False,
  relative_step=False``.
* ``_setup_low_rank_optimizer`` (L101-193): the weights of the ``nn.Linear`` modules whose name
  ``check_target_module_exists`` matches (or every ``nn.Linear`` under "all-linear", the LM head
  included) form a group with the GaLore options; every other parameter a plain group of the same
  class. Layerwise: one optimizer per parameter, stepped and ``zero_grad``'d from a
  ``register_post_accumulate_grad_hook`` (trainmem's ``optimizer_in_backward``); it refuses DDP and
  gradient accumulation.
* ``TrainingArguments.optim_args`` is parsed as ``"k1=v1,k2=v2"`` (``trainer_optimizer.py``
  ``OptimizerContext``: ``optim_args.replace(" ", "").split(",")``, each ``key, value = mapping.split("=")``).
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import TrainmemError

#: trainmem's names of galore_torch's three optimizers
GALORE_OPTIMIZERS = ("galore-adamw", "galore-adamw-8bit", "galore-adafactor")
#: apollo_torch's APOLLOAdamW (the HF Trainer's ``apollo_adamw``: ``_get_apollo_optimizer`` L384-410)
APOLLO_OPTIMIZERS = ("apollo-adamw",)
#: the optimizers over the HF Trainer's two groups (``_setup_low_rank_optimizer``)
LOWRANK_OPTIMIZERS = GALORE_OPTIMIZERS + APOLLO_OPTIMIZERS
#: the HF Trainer's names: (trainmem optimizer, layerwise)
LOWRANK_HF_NAMES = {"galore_adamw": ("galore-adamw", False), "galore_adamw_8bit": ("galore-adamw-8bit", False),
                    "galore_adafactor": ("galore-adafactor", False),
                    "galore_adamw_layerwise": ("galore-adamw", True),
                    "galore_adamw_8bit_layerwise": ("galore-adamw-8bit", True),
                    "apollo_adamw": ("apollo-adamw", False), "apollo_adamw_layerwise": ("apollo-adamw", True)}
#: ``GaLoreProjector.project``'s proj_type values (galore_torch 1.0 ``galore_projector.py`` L14-43)
PROJ_TYPES = ("std", "reverse_std", "right", "left", "full")
#: ``_get_galore_optimizer``'s defaults (trainer_optimizer.py L369-374)
GALORE_DEFAULTS = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
#: ``_get_apollo_optimizer``'s (L398-405)
APOLLO_DEFAULTS = {"rank": 128, "proj": "random", "scale_type": "channel", "update_proj_gap": 200, "scale": 1.0,
                   "proj_type": "std"}
#: galore_adafactor_layerwise: HF builds each per-parameter GaLoreAdafactor with the Trainer's ``lr`` but
#: without ``relative_step=False`` (L379-380 set it for ``galore_adafactor`` only), and Adafactor's
#: constructor raises "Cannot combine manual `lr` and `relative_step=True` options" (galore_torch
#: ``adafactor.py`` L113-114): the run never starts
ADAFACTOR_LAYERWISE = ("--optimizer galore_adafactor_layerwise: the HF Trainer builds each per-parameter "
                       "GaLoreAdafactor with its lr but without relative_step=False (trainer_optimizer.py L379-380), "
                       "which GaLoreAdafactor's constructor refuses (\"Cannot combine manual `lr` and "
                       "`relative_step=True`\"); use galore_adafactor or galore_adamw_layerwise")


def parse_optim_args(text: Any, optimizer: str = "galore-adamw") -> dict[str, Any]:
    """GaLore's (APOLLO's) options from an HF ``optim_args`` string ("rank=64,update_proj_gap=200,
    scale=0.25,proj_type=std"), completed with ``GALORE_DEFAULTS`` (``APOLLO_DEFAULTS``). A key the
    optimizer does not read is refused (the HF Trainer would drop it silently), and what trainmem does
    not model: APOLLO's ``proj=svd`` and ``proj_type`` other than std, reverse_std, left, right
    (apollo_torch's random projector raises on "full"; other sides are not modelled)."""
    defaults = APOLLO_DEFAULTS if optimizer in APOLLO_OPTIMIZERS else GALORE_DEFAULTS
    out = dict(defaults)
    if text is None or text == "":
        return out
    if not isinstance(text, str):
        raise TrainmemError(f"--optim-args must be a string \"k1=v1,k2=v2\", got {text!r}")
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in defaults:
            raise TrainmemError(f"--optim-args {text!r}: {item!r} is not one of --optimizer {optimizer}'s k=v "
                                f"options ({', '.join(defaults)})")
        try:
            out[key] = type(defaults[key])(value)
        except ValueError:
            raise TrainmemError(f"--optim-args {text!r}: {key} must be a {type(defaults[key]).__name__}, "
                                f"got {value!r}") from None
    if out["rank"] <= 0 or out["update_proj_gap"] <= 0:
        raise TrainmemError(f"--optim-args {text!r}: rank and update_proj_gap must be positive")
    kinds = PROJ_TYPES if optimizer not in APOLLO_OPTIMIZERS else ("std",)  # (APOLLO's channel scaling
    #                                                 divides along the projected side: std only, apollo.py L147-152)
    if out["proj_type"] not in kinds:
        raise TrainmemError(f"--optim-args {text!r}: proj_type must be one of {', '.join(kinds)}")
    if optimizer in APOLLO_OPTIMIZERS and (out["proj"] != "random" or out["scale_type"] != "channel"):
        raise TrainmemError(f"--optim-args {text!r}: trainmem models APOLLO at the HF Trainer's proj=random and "
                            "scale_type=channel (its SVD projector and tensor-wise scaling are not modelled)")
    return out


def target_modules(value: Any) -> "tuple[str, ...] | str | None":
    """``optim_target_modules`` as given: a list (tuple) of names, "all-linear", or a comma-separated
    string of names (the CLI's form) read as that list."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.replace("_", "-").strip() == "all-linear":
            return "all-linear"
        names = tuple(x.strip() for x in value.split(",") if x.strip())
        if not names:
            raise TrainmemError("--optim-target-modules is empty: give module names (q_proj,v_proj) or all-linear")
        return names
    if isinstance(value, (list, tuple)) and value and all(isinstance(x, str) for x in value):
        return tuple(value)
    raise TrainmemError(f"--optim-target-modules must be a list of module names or all-linear, got {value!r}")


def is_target(targets: "tuple[str, ...] | str", module_name: str) -> bool:
    """Whether the HF Trainer puts the weight of the ``nn.Linear`` named ``module_name`` in GaLore's
    group: every one under "all-linear", else ``check_target_module_exists`` over a list
    (transformers 5.24.0 ``trainer_utils.py`` L1042-1049: the name itself, a substring of it, or a
    regex ``fullmatch`` of it)."""
    if targets == "all-linear":
        return True
    return (module_name in targets or any(k in module_name for k in targets)
            or any(re.fullmatch(k, module_name) for k in targets))
