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

The ``optimizer`` section is read too (``optimizer_options``): with it the engine builds its own optimizer
and the HF Trainer hands it a ``DummyOptim`` instead of its ``optim=`` one (transformers 5.24
``integrations/deepspeed.py`` ``deepspeed_optim_sched`` L576-577), so the section, not ``--optimizer``, says
what steps. Its ``params`` (lr, betas, ``"auto"``) change no memory; the keys that choose the class do.
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


#: optimizer.type names the engine builds itself and trainmem does not model, and why (deepspeed 0.19.8
#: ``runtime/engine.py`` ``_configure_basic_optimizer`` L2501-2546)
_DS_UNMODELLED = {
    "lamb": "DeepSpeed's FusedLamb (deepspeed/ops/lamb) has no model in trainmem",
    "lion": "DeepSpeed's FusedLion (its multi-tensor CUDA kernel) has no model in trainmem (its --optimizer lion "
            "is lion-pytorch's per-tensor loop)",
    "muadam": "mup's MuAdam has no model in trainmem", "muadamw": "mup's MuAdamW has no model in trainmem",
    "musgd": "mup's MuSGD has no model in trainmem",
    "muon": "DeepSpeed's MuonWithAuxAdam (its Newton-Schulz step) has no model in trainmem"}
#: torch.optim classes the engine builds by name (``getattr(torch.optim, type)``, engine.py L2547-2549:
#: the exact class name) that trainmem models, as trainmem's optimizer
_TORCH_BY_NAME = {"SGD": "sgd", "RMSprop": "rmsprop"}


def optimizer_options(source: Any, offload: bool = False) -> dict[str, Any]:
    """``optimizer`` and ``optimizer_impl`` from a DeepSpeed config's ``optimizer`` section, as
    deepspeed 0.19.8 builds it (``runtime/engine.py`` ``_configure_basic_optimizer`` L2476-2550;
    ``runtime/config.py`` L518-520 lower-cases the names in ``DEEPSPEED_OPTIMIZERS``, L52-66):

    - "Adam"/"AdamW": AdamW unless "Adam" with ``params.adam_w_mode`` false (L2487-2490, default true:
      config.py L72-73); the class from ``get_optimizer_configuration`` (L2377-2409): ``torch_adam`` true
      -> torch.optim.Adam/AdamW with ``params.foreach`` (``_torch_impl``); under ``offload_optimizer``
      DeepSpeedCPUAdam on the host (no step on the GPU: no implementation set); else deepspeed's FusedAdam,
      ``optimizer_impl`` "fused": its states are ``zeros_like(p)`` in the (flat fp32 partition's) dtype and
      one ``multi_tensor_adam`` launch per dtype steps every tensor in place, chunks of 2048*32 elements,
      no temporaries beyond a one-int overflow flag (``ops/adam/fused_adam.py`` L13, L96, L136-191;
      ``ops/adam/multi_tensor_apply.py``), as torch's ``fused=True`` step, trainmem's "fused".
    - "Adagrad": torch.optim.Adagrad (DeepSpeedCPUAdagrad under offload), L2495-2500.
    - a torch.optim class by exact name (L2547-2549): "SGD" (momentum > 0: "sgd-momentum"), "RMSprop"
      at its defaults (momentum 0, not centered: trainmem's rmsprop keeps one state); under ZeRO only with
      ``zero_allow_untested_optimizer`` true, as the engine asserts (L2294-2301; ``runtime/zero/utils.py``
      ``ZERO_SUPPORTED_OPTIMIZERS`` L45-48 lists Adam(W), FusedAdam, the CPU ones, Adagrad and Lion).
    - the others (Lamb, Lion, MuAdam, MuAdamW, MuSGD, Muon, any other name) refused in one line.
    An absent section gives {} (the flags decide, as the HF Trainer's ``optim`` does)."""
    cfg = load_config(source)
    if "optimizer" not in cfg:
        return {}
    sec = cfg["optimizer"]
    name = sec.get("type") if isinstance(sec, Mapping) else None
    params = sec.get("params") or {} if isinstance(sec, Mapping) else {}
    if not isinstance(name, str) or not isinstance(params, Mapping):
        raise TrainmemError("--deepspeed-config: optimizer must be an object with a \"type\" (\"AdamW\", \"Adam\", "
                            "\"Adagrad\", \"SGD\"...) and optional \"params\"; fix the section or remove it")
    low = name.lower()
    if low in ("adam", "adamw"):
        adamw = low == "adamw" or params.get("adam_w_mode", True) is not False
        if params.get("torch_adam") is not True and offload:  # DeepSpeedCPUAdam: no step on the GPU
            return {"optimizer": "adamw" if adamw else "adam"}
        impl = _torch_impl(params) if params.get("torch_adam") is True else "fused"
        return _with_impl("adamw" if adamw else "adam", impl)
    if low == "adagrad":
        return {"optimizer": "adagrad"} if offload else _with_impl("adagrad", _torch_impl(params))
    if low in _DS_UNMODELLED:
        raise TrainmemError(f"--deepspeed-config: optimizer.type {name!r}: {_DS_UNMODELLED[low]}; give the section "
                            "\"AdamW\" (or Adam, Adagrad, SGD, RMSprop), or estimate without it")
    ours = _TORCH_BY_NAME.get(name)
    if ours == "sgd" and params.get("momentum", 0):
        ours = "sgd-momentum"
    if ours == "rmsprop" and (params.get("momentum", 0) or params.get("centered") is True):
        raise TrainmemError("--deepspeed-config: optimizer RMSprop with momentum or centered keeps states trainmem "
                            "does not model (it models RMSprop's square_avg alone); drop them from params")
    if ours is None:
        raise TrainmemError(f"--deepspeed-config: optimizer.type {name!r} is not one trainmem models (DeepSpeed "
                            "builds Adam/AdamW/Adagrad itself, any other as a torch.optim class of that exact name); "
                            "give \"AdamW\", \"Adam\", \"Adagrad\", \"SGD\" or \"RMSprop\"")
    zo = cfg.get("zero_optimization")
    if isinstance(zo, Mapping) and zo.get("stage", 0) and cfg.get("zero_allow_untested_optimizer") is not True:
        # engine.py _do_optimizer_sanity_check L2294-2301 against zero/utils.py ZERO_SUPPORTED_OPTIMIZERS L45-48
        raise TrainmemError(f"--deepspeed-config: optimizer.type {name!r} under ZeRO stops DeepSpeed at start (an "
                            "untested ZeRO optimizer); add \"zero_allow_untested_optimizer\": true to the config")
    return _with_impl(ours, _torch_impl(params))


def _torch_impl(params: Mapping[str, Any]) -> str | None:
    """A torch.optim class's implementation from its ``fused``/``foreach`` arguments (torch 2.13
    ``torch/optim/adamw.py``: ``fused=True`` one kernel, ``foreach=False`` the per-tensor loop, neither
    given: torch's default, which trainmem's release defaults choose: None)."""
    if params.get("fused") is True:
        return "fused"
    if params.get("foreach") is True:
        return "foreach"
    if params.get("foreach") is False:
        return "for-loop"
    return None


def _with_impl(optimizer: str, impl: str | None) -> dict[str, Any]:
    """The options: ``optimizer_impl`` None (torch's default chooser) is kept, so that a ``fused`` flag,
    which torch never defaults to (torch 2.13 ``torch/optim/adam.py`` L933-943), is refused."""
    return {"optimizer": optimizer, "optimizer_impl": impl}


#: the flag each engine option is given by, for a contradiction's message
ENGINE_FLAGS = {"optimizer": ("--optimizer", "optimizer.type"),
                "optimizer_impl": ("--optimizer-impl", "optimizer section's implementation"),
                "precision": ("--precision", "bf16.enabled/fp16.enabled"),
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
