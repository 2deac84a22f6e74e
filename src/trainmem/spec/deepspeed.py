"""A DeepSpeed config file read as trainmem options.

``--deepspeed-config ds_config.json`` (``deepspeed_config=`` in the API) takes the ``zero_optimization``
section a DeepSpeed user already has: ``stage`` -> ``zero``, ``reduce_bucket_size``,
``overlap_comm``, ``contiguous_gradients``, ``sub_group_size``, ``stage3_max_reuse_distance``,
``stage3_prefetch_bucket_size`` (the last three only under stage 3, which alone reads them), and
``offload_optimizer.device`` ``cpu``/``nvme`` -> ``offload_optimizer``. ``"auto"`` values are resolved the way the Hugging Face
Trainer fills them before it starts DeepSpeed (transformers ``integrations/deepspeed.py``,
``HfTrainerDeepSpeedConfig.trainer_config_finalize`` L232 in transformers 5.23: ``reduce_bucket_size``
= hidden_size x hidden_size, ``stage3_prefetch_bucket_size`` = 0.9 x hidden_size^2; the third ``auto`` key it fills,
``stage3_param_persistence_threshold``, is not a trainmem option: parameters below it, norms and
biases, stay whole, a few MiB). Keys trainmem does not model are
named in one line, not silently dropped, when they would change memory (``offload_param``).

The engine's top-level keys that change memory are read too (``engine_options``): ``bf16.enabled`` /
``fp16.enabled`` true -> ``--precision bf16`` / ``fp16`` (the engine casts the module, no autocast:
deepspeed 0.19.8 ``runtime/engine.py`` ``_configure_distributed_model``; the old ``bfloat16`` key
too, ``runtime/precision_config.py`` L34-38), ``train_micro_batch_size_per_gpu`` -> ``batch_size``
(``runtime/config.py`` L343-348), ``gradient_accumulation_steps`` -> ``grad_accum`` (L208-209),
``train_batch_size`` divided over the ``--dp`` ranks where those two are not given (L607-648);
``"auto"`` leaves them to the flags, as the HF Trainer fills them from its TrainingArguments.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ..errors import TrainmemError

#: zero_optimization keys read as TrainingSpec fields of the same name
_SAME = ("reduce_bucket_size", "overlap_comm", "contiguous_gradients", "sub_group_size",
         "stage3_max_reuse_distance", "stage3_prefetch_bucket_size")
#: ... of them, those every stage reads
_ALL_STAGES = ("reduce_bucket_size", "overlap_comm", "contiguous_gradients")


def load_config(source: Any) -> dict:
    """The config as a dict: ``source`` a dict, or a path to a JSON file."""
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise TrainmemError(f"--deepspeed-config {path}: cannot read it ({e.strerror}); give a DeepSpeed JSON config")
    except json.JSONDecodeError as e:
        raise TrainmemError(f"--deepspeed-config {path}: not valid JSON (line {e.lineno}: {e.msg})")
    if not isinstance(data, dict):
        raise TrainmemError(f"--deepspeed-config {path}: a DeepSpeed config is a JSON object")
    return data


def zero_options(source: Any, hidden_size: int | None) -> dict[str, Any]:
    """TrainingSpec options from a DeepSpeed config's ``zero_optimization`` section (see the module
    docstring); ``hidden_size`` resolves ``"auto"`` (None: ``auto`` is refused)."""
    cfg = load_config(source)
    zo = cfg.get("zero_optimization") or {}
    if not isinstance(zo, Mapping):
        raise TrainmemError("--deepspeed-config: zero_optimization must be a JSON object")
    out: dict[str, Any] = {}
    stage = zo.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise TrainmemError(f"--deepspeed-config: zero_optimization.stage {stage!r} is not one of 0, 1, 2, 3")
    out["zero"] = stage
    for key in _SAME:
        if key in zo and (stage == 3 or key in _ALL_STAGES):
            out[key] = _value(key, zo[key], hidden_size)
    offload = zo.get("offload_optimizer") or {}
    if isinstance(offload, Mapping) and offload.get("device") in ("cpu", "nvme"):
        out["offload_optimizer"] = True
    param = zo.get("offload_param") or {}
    if isinstance(param, Mapping) and param.get("device") in ("cpu", "nvme"):
        raise TrainmemError("--deepspeed-config: zero_optimization.offload_param (ZeRO-Infinity parameter "
                            "offload) is not modelled; remove it from the config, or estimate without it")
    if stage == 0:  # the engine options configure ZeRO only
        out = {"zero": 0}
    return out


def engine_options(source: Any, dp: int = 1) -> dict[str, Any]:
    """TrainingSpec options from a DeepSpeed config's top-level engine keys (the module docstring):
    ``precision``, ``batch_size``, ``grad_accum``, each only where the file gives a value ("auto"
    and absent keys give none); ``dp`` ranks divide ``train_batch_size`` (``_batch_options``)."""
    cfg = load_config(source)
    out: dict[str, Any] = {}
    half = []
    for key, precision in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = cfg.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            half.append((key, precision))
    if len({p for _, p in half}) > 1:
        raise TrainmemError("--deepspeed-config: bf16.enabled and fp16.enabled are both true (DeepSpeed refuses "
                            "it); enable one of them")
    if half:
        out["precision"] = half[0][1]
    out.update(_batch_options(cfg, dp))
    return out


def _batch_options(cfg: Mapping[str, Any], dp: int) -> dict[str, Any]:
    """``batch_size`` and ``grad_accum`` from the config's batch keys, the ones it leaves out derived
    over ``dp`` data-parallel ranks as the engine derives them (deepspeed 0.19.8 ``runtime/config.py``
    ``_set_batch_related_parameters`` L607-648: micro = train_batch_size // dp // accumulation;
    accumulation = train_batch_size // micro // dp, 1 when only train_batch_size is given)."""
    given = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = cfg.get(key)
        if value is None or value == "auto":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainmemError(f"--deepspeed-config: {key} must be a positive integer or \"auto\", got {value!r}")
        given[key] = value
    train, micro = given.get("train_batch_size"), given.get("train_micro_batch_size_per_gpu")
    accum = given.get("gradient_accumulation_steps")
    if train is not None and micro is None:
        micro = train // dp // (accum or 1)
        accum = accum or 1
    elif train is not None and accum is None:
        accum = train // micro // dp
    if (micro is not None and micro < 1) or (accum is not None and accum < 1):
        raise TrainmemError(f"--deepspeed-config: train_batch_size {train} is less than one sample per rank over "
                            f"--dp {dp}; give train_micro_batch_size_per_gpu")
    return {k: v for k, v in (("batch_size", micro), ("grad_accum", accum)) if v is not None}


#: the flag each engine option is given by, for a contradiction's message
ENGINE_FLAGS = {"precision": ("--precision", "bf16.enabled/fp16.enabled"),
                "batch_size": ("--batch-size", "train_micro_batch_size_per_gpu"),
                "grad_accum": ("--grad-accum", "gradient_accumulation_steps")}


def _value(key: str, value: Any, hidden_size: int | None) -> Any:
    """One key's value: booleans as booleans, sizes as integers (``5e8`` accepted), ``auto`` as the
    Hugging Face Trainer fills it."""
    if key in ("overlap_comm", "contiguous_gradients"):
        if not isinstance(value, bool):
            raise TrainmemError(f"--deepspeed-config: zero_optimization.{key} must be true or false, got {value!r}")
        return value
    if value == "auto":
        if key not in ("reduce_bucket_size", "stage3_prefetch_bucket_size"):
            raise TrainmemError(f"--deepspeed-config: zero_optimization.{key} 'auto' is not filled by the HF "
                                "Trainer; give a number")
        if hidden_size is None:
            raise TrainmemError(f"--deepspeed-config: {key} 'auto' needs the model's hidden size")
        # transformers 5.23 integrations/deepspeed.py L232 and L236-237
        return hidden_size * hidden_size if key == "reduce_bucket_size" else int(0.9 * hidden_size * hidden_size)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TrainmemError(f"--deepspeed-config: zero_optimization.{key} must be a whole number, got {value!r}")
    return int(value)
