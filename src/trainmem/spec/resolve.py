"""One input resolver: the model, the training setup, the GPU, the method and the max fraction.

``resolve(model, **options)`` is the one place the public API's keyword options (named as the CLI
flags in snake_case) are interpreted. ``estimate``, ``trace``, ``measure``, ``fit``, ``sweep``,
``suggest`` and ``plan`` call it once and vary the training setup with :meth:`Resolved.replace`,
which re-validates the setup without resolving the model or the GPU again.

Options:

* every :class:`TrainingSpec` field (``batch_size``, ``seq_len``, ``precision``, ``optimizer``,
  ``optimizer_impl``, ``zero``, ``fsdp``, ``dp``/``tp``/``pp``/``cp``, ``recompute``,
  ``attention``, ``lora_rank``, ``lora_targets`` as ``"q_proj,v_proj"`` or a tuple, ...);
  ``seq_len`` None means :func:`default_seq_len` of the model;
* ``training``: a ready TrainingSpec (training options given beside it apply on top of it);
* ``gpu`` (a catalogue name or a :class:`Hardware`), ``gpu_memory``, ``context_memory``, or
  ``hardware`` (a Hardware); ``calibration`` (a profile file of ``trainmem calibrate``, or a loaded
  profile): its measured CUDA context and cuBLAS workspace replace the catalogue's when its GPU is
  the GPU chosen (``spec.calibration.calibrated``; a bundled profile of the GPU is used without it);
* ``max_fraction`` (in (0, 1]), ``method`` (an estimate method), ``set`` / ``overrides`` (config
  overrides such as ``["num_hidden_layers=2"]``), ``task`` (the head trained, ``spec.tasks.TASKS``:
  the class transformers has for it replaces the config's ``architectures``);
* ``image_size`` (image models: sets ``seq_len``, which is then refused) and ``target_len``
  (encoder-decoders: the decoder's tokens, default ``seq_len``) are TrainingSpec fields;
* ``framework`` (a preset of ``spec.frameworks``: ``nanogpt``, ``torchtune``, ...) and
  ``framework_version``: the preset's option values go first, the explicit training options on
  top (``preset_training``); the setup remembers the framework in ``TrainingSpec.extra``
  (``framework``, ``framework_version``, ``framework_given``: the explicit options, and
  ``framework_warnings``: one line each for what the framework does not run or trainmem does not
  count), so :meth:`Resolved.replace` applies the preset again to the changed setup.

A value of None means "not given". Every bad input raises one :class:`TrainmemError` whose single
line names the input.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import TrainmemError
from ..units import parse_bytes
from .config import resolve_model, tensor_parallel_twin
from .frameworks import FRAMEWORKS, LINKED, get_preset, parse_version, preset_options, preset_warnings
from .calibration import calibrated
from .hardware import Hardware, get_gpu
from .lora_targets import all_linear_targets, is_all_linear
from .model import ModelSpec
from .deepspeed import ENGINE_FLAGS, engine_options, optimizer_options, zero_options
from .releases import parse_torch_version, torch_defaults
from .tf_releases import default_attention, model_key, parse_transformers_version
from .galore import LOWRANK_HF_NAMES
from .training import (OPTIMIZER_ALIASES, PRECISION_ALIASES, optimizer_refusal, TrainingSpec, check_against, deepspeed_problems, default_seq_len,
                       image_sizes, HF_TORCHAO_BLOCK, TORCHAO_OPTIMIZERS)

TRAINING_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainingSpec) if f.name != "extra")
HARDWARE_OPTIONS = frozenset({"gpu", "gpu_memory", "context_memory", "hardware", "calibration"})
FRAMEWORK_OPTIONS = frozenset({"framework", "framework_version"})
OTHER_OPTIONS = (frozenset({"max_fraction", "method", "set", "overrides", "training", "task", "deepspeed_config"})
                 | FRAMEWORK_OPTIONS)
OPTIONS = TRAINING_FIELDS | HARDWARE_OPTIONS | OTHER_OPTIONS
TRAINING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingSpec) if f.name != "extra"}


def check_options(options: Mapping[str, Any], known: frozenset[str] = OPTIONS) -> None:
    """Raise one TrainmemError naming every option not in ``known`` (with the closest known name)."""
    unknown = sorted(set(options) - known)
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    raise TrainmemError(f"unknown option(s): {', '.join(hints)}; options are the TrainingSpec fields "
                        f"(batch_size, seq_len, precision, ...), gpu, gpu_memory, context_memory, calibration, max_fraction, "
                        f"method, set, framework and framework_version")


def check_max_fraction(value: Any) -> Any:
    """The max fraction of the GPU a setup may take: 1.0 when None, else a number in (0, 1]."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise TrainmemError(f"--max-fraction must be in (0, 1], got {value!r}")
    return value


def training_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainingSpec fields among ``options`` that are given (not None), ``lora_targets`` as a tuple."""
    out = {k: v for k, v in options.items() if k in TRAINING_FIELDS and v is not None}
    out = framework_names(out)
    if isinstance(out.get("lora_targets"), str):
        out["lora_targets"] = tuple(x.strip() for x in out["lora_targets"].split(",") if x.strip())
    return out


def framework_names(given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with a framework's own names of a precision or an optimizer read as trainmem's
    (``spec.training.PRECISION_ALIASES``: Lightning's "bf16-true", "16-mixed"...;
    ``OPTIMIZER_ALIASES``: the HF Trainer's ``optim`` names). An optimizer name that implies an
    implementation (``adamw_torch_fused``) sets ``optimizer_impl`` too, and contradicting an
    ``optimizer_impl`` also given is refused in one line; an HF name trainmem does not model
    (``OPTIMIZERS_REFUSED``: APOLLO, galore_adafactor_layerwise, XLA/NPU...) is refused in one line naming it."""
    out = dict(given)
    p = out.get("precision")
    if isinstance(p, str) and p.strip().lower() in PRECISION_ALIASES:
        out["precision"] = PRECISION_ALIASES[p.strip().lower()]
    o = out.get("optimizer")
    if optimizer_refusal(o):
        raise TrainmemError(optimizer_refusal(o))
    if isinstance(o, str) and o.strip().lower() in LOWRANK_HF_NAMES:
        # galore_*_layerwise: one optimizer per parameter stepped from its post-accumulate-grad hook, the
        # gradient freed by its zero_grad (trainer_optimizer.py L164-184): trainmem's optimizer-in-backward
        out["optimizer"], layerwise = LOWRANK_HF_NAMES[o.strip().lower()]
        if layerwise:
            out["optimizer_in_backward"] = True
    if isinstance(o, str) and o.strip().lower() in OPTIMIZER_ALIASES:
        name, impl = OPTIMIZER_ALIASES[o.strip().lower()]
        out["optimizer"] = name
        if o.strip().lower() == "adamw_torch" and out.get("optimizer_impl") is None:
            # the HF Trainer builds torch.optim.AdamW without fused or foreach (transformers trainer_optimizer.py
            # L201-208), so torch's own default runs, not a preset's fused one: foreach on CUDA from PyTorch 2.0
            # (torch/optim/optimizer.py ``_default_to_fused_or_foreach``), the for-loop before
            tv = out.get("torch_version")
            out["optimizer_impl"] = "for-loop" if tv is not None and parse_torch_version(str(tv)) < (2, 0) \
                else "foreach"
        if name in TORCHAO_OPTIMIZERS and out.get("torchao_block_size") is None:
            out["torchao_block_size"] = HF_TORCHAO_BLOCK  # the HF Trainer's block_size (256, AdamW4bit too)
        if impl is not None:
            if out.get("optimizer_impl") not in (None, impl):
                raise TrainmemError(f"--optimizer {o} runs the {impl} implementation, but --optimizer-impl is "
                                    f"{out['optimizer_impl']}: drop one of them")
            out["optimizer_impl"] = impl
    return out


def hardware_from(gpu: "str | Hardware | None" = None, gpu_memory: Any = None, context_memory: Any = None,
                  hardware: Hardware | None = None, calibration: Any = None) -> Hardware | None:
    """The GPU the options name (None without one), calibrated (``spec.calibration.calibrated``:
    ``calibration``'s profile, else a bundled one of the GPU; ``context_memory`` wins over a
    profile's context)."""
    hw = _named_hardware(gpu, gpu_memory, context_memory, hardware)
    if hw is not None and hw.calibration and calibration is None:
        return hw  # calibrated already (a Resolved's GPU carried over)
    return calibrated(hw, calibration, context_given=context_memory is not None)


def _named_hardware(gpu: "str | Hardware | None", gpu_memory: Any, context_memory: Any,
                    hardware: Hardware | None) -> Hardware | None:
    """``hardware`` or ``gpu`` as a Hardware (with ``context_memory`` replacing its context when
    given), else the catalogue's ``gpu`` or a custom GPU of ``gpu_memory`` (``spec.hardware.get_gpu``)."""
    if isinstance(gpu, Hardware):
        if hardware is not None and hardware != gpu:
            raise TrainmemError("gpu= and hardware= name two different GPUs: give one of them")
        gpu, hardware = None, gpu
    if hardware is not None:
        if not isinstance(hardware, Hardware):
            raise TrainmemError(f"hardware= must be a trainmem Hardware, got {type(hardware).__name__}; "
                                f"give gpu=NAME or gpu_memory=SIZE instead")
        if gpu is not None or gpu_memory is not None:
            raise TrainmemError("hardware= and gpu=/gpu_memory= both name the GPU: give one of them")
        if context_memory is None:
            return hardware
        return dataclasses.replace(hardware, context=parse_bytes(context_memory))
    if gpu is None and gpu_memory is None:
        if context_memory is not None:
            raise TrainmemError("--context-memory needs a GPU: give --gpu NAME or --gpu-memory SIZE")
        return None
    if gpu is not None and not isinstance(gpu, str):
        raise TrainmemError(f"--gpu must be a GPU name or a Hardware, got {type(gpu).__name__}")
    return get_gpu(gpu, gpu_memory, context_memory)


@dataclass(frozen=True)
class Resolved:
    """A model, a training setup and a GPU (None: none given), checked against each other.

    ``method`` is the estimate method; ``max_fraction`` the fraction of the GPU the peak may take.
    Constructing one validates it: the max fraction, and the checks that need both the model and
    the setup (``check_against``: heads and layers divisible by TP and PP, learned positions ...).
    """

    model: ModelSpec
    training: TrainingSpec
    hardware: Hardware | None
    method: str = "trainmem"
    max_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec):
            raise TrainmemError(f"Resolved.model must be a ModelSpec, got {type(self.model).__name__}")
        if not isinstance(self.training, TrainingSpec):
            raise TrainmemError(f"training= must be a TrainingSpec, got {type(self.training).__name__}")
        if self.hardware is not None and not isinstance(self.hardware, Hardware):
            raise TrainmemError(f"hardware= must be a Hardware, got {type(self.hardware).__name__}")
        if not isinstance(self.method, str) or not self.method:
            raise TrainmemError(f"--method must be a method name, got {self.method!r}")
        check_max_fraction(self.max_fraction)
        # a derived Qwen3 under --tp: its hand-written twin (spec.config.tensor_parallel_twin)
        object.__setattr__(self, "model", tensor_parallel_twin(self.model, self.training.tp, self.training.cp))
        check_against(self.model, self.training)

    @property
    def limit(self) -> int | None:
        """Bytes the peak may take: ``max_fraction`` of the GPU (None without a GPU)."""
        if self.hardware is None:
            return None
        return int(self.max_fraction * self.hardware.capacity)

    def replace(self, **training_changes: Any) -> "Resolved":
        """The same model, GPU, method and max fraction with ``training_changes`` applied to the
        training setup (``dataclasses.replace``), validated again. A change to None restores the
        field's default (``seq_len``: the model's ``default_seq_len``); under a framework preset it
        restores the preset's value, and the preset is applied again to the changed setup."""
        check_options(training_changes, TRAINING_FIELDS)
        if not training_changes:
            return self
        extra = self.training.extra
        if extra.get("framework"):
            given = {k: v for k, v in extra["framework_given"].items() if k not in training_changes}
            given.update(training_values(training_changes))
            t = preset_training(extra["framework"], extra.get("framework_version"), given, self.model)
            return dataclasses.replace(self, training=t)
        changes = training_values(training_changes)
        for k, v in training_changes.items():
            if v is None:
                changes[k] = default_seq_len(self.model) if k == "seq_len" else TRAINING_DEFAULTS[k]
        if self.model.is_image and "seq_len" not in training_values(training_changes):
            changes = image_sizes(self.model, {k: v for k, v in changes.items() if k != "seq_len"},
                                  self.training.image_size)
        if any(changes.get(k, getattr(self.training, k)) is not None for k in ("torch_version", "transformers_version")):
            # an option set back to None takes its release's default (``_release_defaults``)
            kept = set(training_values(training_changes)) | {
                f for f in TRAINING_DEFAULTS
                if f not in training_changes and getattr(self.training, f) != TRAINING_DEFAULTS[f]}
            changes = _release_defaults({**_fields(self.training), **changes}, kept, self.model)
        return dataclasses.replace(self, training=dataclasses.replace(self.training, **changes))


def _overrides(options: Mapping[str, Any]) -> Any:
    """The config overrides: ``set`` or ``overrides`` (both only when they agree)."""
    s, o = options.get("set"), options.get("overrides")
    if s and o and s != o:
        raise TrainmemError("set= and overrides= are the same option (config overrides): give one of them")
    return s or o or None


def _model(model: Any, overrides: Any, task: str | None = None) -> ModelSpec:
    """The ModelSpec of ``model`` (a name, path, config dict, ModelSpec or Resolved), overridden,
    with the head of ``task`` (``spec.tasks``)."""
    extra = (task,) if task is not None else ()
    if isinstance(model, ModelSpec) and not overrides and task is None:
        return model  # (already resolved)
    if isinstance(model, Resolved):
        return resolve_model(model.model, overrides, *extra) if (overrides or task) else model.model
    if isinstance(model, (str, os.PathLike, ModelSpec, Mapping)):
        return resolve_model(os.fspath(model) if isinstance(model, os.PathLike) else model, overrides, *extra)
    raise TrainmemError(f"model must be a catalogue name, config path, hub id, config dict, ModelSpec or "
                        f"Resolved, got {type(model).__name__}")


def model_of(model: Any, options: Mapping[str, Any]) -> ModelSpec:
    """The ModelSpec ``model`` and ``options`` name (their ``set``/``overrides`` and ``task``), without
    checking any training option against it."""
    return _model(model, _overrides(options), options.get("task"))


def training_from(options: Mapping[str, Any], model: ModelSpec | None = None,
                  base: TrainingSpec | None = None) -> TrainingSpec:
    """The TrainingSpec of ``options``: their training fields on top of ``training=`` (or ``base``),
    else a new one whose ``seq_len`` defaults to the model's ``default_seq_len`` (2048 without a
    model). With ``framework`` (or a base made under one) the preset goes between the base and the
    options (``preset_training``). ``lora_targets`` "all-linear" becomes the model's linear modules
    as peft expands it (``spec.lora_targets``). DeepSpeed's engine options without its ZeRO stage are refused."""
    t = _training_from(options, model, base)
    if model is not None and is_all_linear(t.lora_targets):  # peft's shorthand, named as peft expands it
        t = dataclasses.replace(t, lora_targets=all_linear_targets(model))
    problem = deepspeed_problems(t) or _manual_layernorm_problem(model, t)
    if problem:
        raise TrainmemError(problem)
    return t


def _manual_layernorm_problem(model: ModelSpec | None, t: TrainingSpec) -> str | None:
    """A model whose LayerNorms are Python ops (``_trainmem.manual_layernorm``) is modelled for fp32,
    pure bf16/fp16 and autocast (its ops run on the fp32 stream: none is on autocast's lower-precision
    list), without FSDP's bf16-mp policy, torch.compile or tensor parallelism (``Builder.layer_norm_manual``)."""
    if model is None or not model.manual_layernorm:
        return None
    if t.precision == "bf16-mp" or t.compile or t.tp > 1:
        return (f"{model.name}: its Python-op LayerNorm (_trainmem.manual_layernorm) is modelled for "
                f"--precision fp32/bf16/fp16/bf16-amp/fp16-amp without --compile or --tp; use one of those or "
                f"F.layer_norm's model")
    return None


def _training_from(options: Mapping[str, Any], model: ModelSpec | None, base: TrainingSpec | None) -> TrainingSpec:
    given = training_values(options)
    if options.get("deepspeed_config") is not None:
        given = _with_deepspeed_config(options["deepspeed_config"], given, model)
    start = options.get("training")
    if start is None:
        start = base
    if start is not None and not isinstance(start, TrainingSpec):
        raise TrainmemError(f"training= must be a TrainingSpec, got {type(start).__name__}")
    if model is not None:  # an image model's sequence comes from its image size
        given = image_sizes(model, given, start.image_size if start is not None else None)
    framework, version = options.get("framework"), options.get("framework_version")
    prior = start.extra if start is not None and start.extra.get("framework") else None
    if prior is not None:
        if framework is None and version is None and not given:
            return start
        if framework is None or get_preset(framework).name == prior["framework"]:
            framework = prior["framework"]
            version = prior.get("framework_version") if version is None else version
        return preset_training(framework, version, {**prior["framework_given"], **given}, model)
    if framework is not None:
        return preset_training(framework, version, given, model, start)
    if version is not None:
        raise TrainmemError(f"--framework-version needs --framework NAME (one of: {', '.join(FRAMEWORKS)})")
    if start is not None:
        if not given:
            return start
        kept = set(given) | {f for f in TRAINING_DEFAULTS if getattr(start, f) != TRAINING_DEFAULTS[f]}
        return dataclasses.replace(start, **_release_defaults({**_fields(start), **given}, kept, model))
    if "seq_len" not in given and model is not None:
        given["seq_len"] = default_seq_len(model)
    return TrainingSpec(**_release_defaults(given, set(given), model))


def _fields(t: TrainingSpec) -> dict[str, Any]:
    return {f: getattr(t, f) for f in TRAINING_DEFAULTS}


def _release_defaults(fields: dict[str, Any], kept: set[str], model: ModelSpec | None = None) -> dict[str, Any]:
    """``fields`` with the defaults of their ``torch_version`` (``spec.releases.torch_defaults``: an
    older PyTorch's zero_grad, optimizer loop and attention) and of their ``transformers_version``
    for ``model`` (``spec.tf_releases.default_attention``: eager before the family's SDPA support)
    for the options not in ``kept``. Eager wins when either release implies it."""
    implied: dict[str, Any] = {}
    version = fields.get("torch_version")
    if version is not None:
        implied = torch_defaults(parse_torch_version(version), fields.get("fsdp"), fields.get("zero") or 0)
    tf = fields.get("transformers_version")
    if tf is not None and model is not None:
        attention = default_attention(model, parse_transformers_version(tf))
        if attention is not None:
            implied["attention"] = attention
    return {**fields, **{k: v for k, v in implied.items() if k not in kept}}


def _with_deepspeed_config(source: Any, given: dict[str, Any], model: ModelSpec | None) -> dict[str, Any]:
    """``given`` completed by a DeepSpeed config's ``zero_optimization`` and engine keys (precision,
    micro-batch, accumulation, the ``optimizer`` section: ``spec.deepspeed``): a flag given explicitly wins
    where it agrees; a ``--zero`` stage, precision, batch size, accumulation, optimizer or optimizer
    implementation other than the file's is refused."""
    from_file = zero_options(source, model.hidden_size if model is not None else None)
    if "zero" in given and given["zero"] != from_file["zero"]:
        raise TrainmemError(f"--zero {given['zero']} contradicts the DeepSpeed config's zero_optimization.stage "
                            f"{from_file['zero']}: give one of them")
    engine = {**engine_options(source, given.get("dp") or 1),
              **optimizer_options(source, bool(from_file.get("offload_optimizer") or given.get("offload_optimizer")))}
    for field, value in engine.items():
        if field == "optimizer_impl" and value is None and given.get(field) != "fused":
            continue  # torch.optim's default chooser: foreach, or the for-loop before PyTorch 2.0
        if field in given and given[field] != value:
            flag, key = ENGINE_FLAGS[field]
            fix = "give one of them, or \"auto\" in the config"
            if field.startswith("optimizer"):
                fix = "drop the flag (DeepSpeed's engine builds and steps the config's optimizer)"
            shown = "torch.optim's default, never fused" if value is None else value
            raise TrainmemError(f"{flag} {given[field]} contradicts the DeepSpeed config's {key} ({shown}): {fix}")
    return {**from_file, **{k: v for k, v in engine.items() if v is not None}, **given}


def preset_training(framework: str, version: Any, given: Mapping[str, Any], model: ModelSpec | None = None,
                    start: TrainingSpec | None = None) -> TrainingSpec:
    """The TrainingSpec of a framework preset: ``start``'s fields (a TrainingSpec given beside
    the framework; else the defaults), the preset's values (``spec.frameworks.preset_options``) on
    top, the ``given`` options (not None) on top of those. Giving one option of a linked pair
    (``recompute``/``recompute_every``, ``loss``/``loss_chunks``, ``zero``/``fsdp``,
    ``hold_output``/``keep_logits``) drops the preset's value of the other. The framework, its
    version, ``given`` and the preset's warnings go to ``extra``."""
    name = get_preset(framework).name
    text = None if version is None else str(version).strip().lstrip("v")
    parse_version(get_preset(name), text)
    given = {k: v for k, v in given.items() if v is not None and not (k == "keep_logits" and v is False)}
    base = {} if start is None else {f.name: getattr(start, f.name) for f in dataclasses.fields(start)
                                     if f.name not in ("extra", "keep_logits")}
    # the rules see ``zero`` only where it was given (``--zero 0`` is a choice: no sharding)
    defaults = {k: v for k, v in TRAINING_DEFAULTS.items() if k != "zero"}
    values = preset_options(name, text, given, model, {**defaults, **base})
    for group in LINKED:
        if any(k in given for k in group):
            for k in group:
                values.pop(k, None)
    fields = {**base, **values, **given}
    if name == "hf-trainer" and text is not None and fields.get("transformers_version") is None \
            and model is not None and model_key(model):
        # the Trainer is transformers itself: its release is the model code's (a derived model other than
        # OPT keeps the installed code, with the preset's warning, spec.frameworks._check_hf)
        fields["transformers_version"] = text
    preset = get_preset(name)
    if fields.get("torch_version") is not None and preset.min_torch is not None and \
            parse_torch_version(fields["torch_version"]) < parse_torch_version(preset.min_torch):
        raise TrainmemError(f"--framework {name} runs on PyTorch {preset.min_torch} or newer: --torch-version "
                            f"{fields['torch_version']} is older; drop one of them")
    # the release's defaults replace what neither the user nor the framework chose explicitly
    explicit = set(given) | {k for k in values if k not in preset.torch_derived}
    fields = _release_defaults(fields, explicit, model)
    if "seq_len" not in fields and model is not None:
        fields["seq_len"] = default_seq_len(model)
    extra: dict[str, Any] = {"framework": name, "framework_version": text, "framework_given": dict(given)}
    t = TrainingSpec(**fields, extra=extra)
    extra["framework_warnings"] = tuple(preset_warnings(name, text, t, model, frozenset(given)))
    return t


def _hardware(options: Mapping[str, Any], base: Hardware | None) -> Hardware | None:
    """The GPU of ``options``, else ``base`` (``context_memory`` alone replaces base's context)."""
    gpu, memory, context, hw = (options.get(k) for k in ("gpu", "gpu_memory", "context_memory", "hardware"))
    if gpu is None and memory is None and hw is None:
        hw = base
    return hardware_from(gpu, memory, context, hw, options.get("calibration"))


def resolve(model: Any, **options: Any) -> Resolved:
    """Resolve the model, training setup, GPU, method and max fraction of the API's options.

    ``model``: a catalogue name, config.json path, model directory, hub id, config dict or
    ModelSpec (``spec.config.resolve_model``), or a ``Resolved`` (its values, with ``options``
    applied on top). See the module's docstring for the options. Raises TrainmemError.
    """
    check_options(options)
    base = model if isinstance(model, Resolved) else None
    spec = _model(model, _overrides(options), options.get("task"))
    training = training_from(options, spec, base.training if base else None)
    hardware = _hardware(options, base.hardware if base else None)
    method = options.get("method") or (base.method if base else "trainmem")
    max_fraction = options.get("max_fraction")
    if max_fraction is None:
        max_fraction = base.max_fraction if base else 1.0
    return Resolved(spec, training, hardware, method, max_fraction)


def resolve_setup(**options: Any) -> tuple[TrainingSpec, Hardware | None, float]:
    """Training setup, GPU and max fraction without a model (a user's own module factory): the
    options of ``resolve`` (``method`` is ignored); ``seq_len`` defaults to 2048."""
    check_options(options)
    if _overrides(options):
        raise TrainmemError("set=/overrides= change a model config: a model factory builds its own module, "
                            "so give no config overrides")
    return training_from(options), _hardware(options, None), check_max_fraction(options.get("max_fraction"))
