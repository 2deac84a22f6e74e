"""Which head is trained: ``--task``, as transformers' ``architectures`` field picks the class.

A config's ``architectures[0]`` names the class ``from_pretrained`` builds; the same model type has
one class per task (``T5Model``, ``T5ForConditionalGeneration``, ``T5ForSequenceClassification``).
``--task`` picks the class of another task through transformers' auto mappings (model type ->
class name, ``transformers/models/auto/modeling_auto.py``: ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
and its siblings), the way ``AutoModelForSeq2SeqLM.from_config`` would. Without ``--task`` the
config's ``architectures`` decides; a config without one gets its model type's natural head: the
first task of ``TASKS`` whose mapping has the type (a decoder's causal LM, T5's seq2seq LM, ViT's
image classifier). ``image-text-to-text`` (``AutoModelForImageTextToText``) is the task of the
multimodal classes of the types ``spec.vision`` runs (Qwen2-VL, Qwen2.5-VL, LLaVA, Gemma 3), picked from
their ``architectures`` (``task_of_class``).

Importing this module imports nothing heavy; the mappings are read only when a task has to be
looked up (``with_task`` for a class the config does not name, ``natural_class``).
"""
from __future__ import annotations

import sys

from typing import Any, Mapping

from ..errors import TrainmemError

#: task -> transformers' auto mapping of model type to class name, in the natural-head order
TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "question-answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    # a vision-language model (``spec.vision``): last, so that no model type's natural head changes
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}
#: task -> ModelSpec.head
HEAD_OF_TASK = {"causal-lm": "causal-lm", "seq2seq-lm": "seq2seq-lm", "speech-seq2seq": "speech-seq2seq",
                "ctc": "ctc", "image-classification": "image-cls",
                "masked-lm": "masked-lm", "sequence-classification": "seq-cls", "question-answering": "qa",
                "image-text-to-text": "vlm"}
#: the config key ``--task image-text-to-text`` sets where the class is also the type's causal LM (Gemma 3):
#: read by ``task_of_config``; part of the config's fingerprint (its profile is another), not of transformers'
#: config (``profile.hf_config_object`` drops keys that start with "_")
TASK_KEY = "_trainmem_task"
#: class-name endings that name one task whatever the model type ("ForConditionalGeneration" does
#: not: Gemma 3's and Llava's are multimodal causal LMs, T5's and BART's seq2seq LMs)
_SUFFIXES = {"causal-lm": ("ForCausalLM", "LMHeadModel"), "masked-lm": ("ForMaskedLM",),
             "sequence-classification": ("ForSequenceClassification",),
             "question-answering": ("ForQuestionAnswering",),
             "image-classification": ("ForImageClassification",), "ctc": ("ForCTC",)}
#: the model types whose speech seq2seq class trainmem builds its input for (``workload.model_batch``:
#: Whisper's log-mel ``input_features``); another type's speech class is refused in one line
SPEECH_SEQ2SEQ_TYPES = ("whisper",)
#: the model types whose CTC class trainmem builds its input for (raw 16 kHz ``input_values`` through
#: the 7-convolution feature encoder of ``Wav2Vec2FeatureEncoder``)
CTC_TYPES = ("wav2vec2", "hubert", "wavlm")


def _mapping(task: str) -> Mapping[str, Any]:
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        raise TrainmemError(f"--task {task}: looking up the class needs transformers: pip install transformers") \
            from None
    return getattr(modeling_auto, TASKS[task])


#: transformers 5.24's auto-mapping entries of the vision-language types (``spec.vision.VLM_TYPES``;
#: ``models/auto/modeling_auto.py``, tests/test_vlm.py checks them against it), read without importing
#: transformers (and torch) when it is not loaded yet: an estimate from shipped coefficients needs neither
VLM_CLASSES = {
    "image-text-to-text": {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                           "llava": "LlavaForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"},
    "causal-lm": {"gemma3": "Gemma3ForConditionalGeneration"},
    "sequence-classification": {"gemma3": "Gemma3ForSequenceClassification"},
}


def _class_for(task: str, model_type: str) -> Any:
    """transformers' class name of ``model_type`` for ``task`` (None: none); a VLM type's from ``VLM_CLASSES``
    while transformers is not imported."""
    from .vision import VLM_TYPES
    if model_type in VLM_TYPES and "transformers" not in sys.modules:
        return VLM_CLASSES.get(task, {}).get(model_type)
    return _mapping(task).get(model_type)


def task_of_class(model_type: str, class_name: str) -> str | None:
    """The task whose auto mapping gives ``class_name`` for ``model_type`` (None: none of TASKS). The
    image-text-to-text class of a type ``spec.vision`` runs (``VLM_TYPES``) is that task unless the causal-LM
    mapping lists it too: Gemma 3's ``Gemma3ForConditionalGeneration`` is what ``AutoModelForCausalLM`` loads
    for text fine-tuning (its vision tower's weights loaded, never run), so it stays a causal LM unless
    ``--task image-text-to-text`` marks the config (``TASK_KEY``, ``task_of_config``); another type's
    (``Qwen3_5ForConditionalGeneration``) is no task here, and ``trainable_class`` trains its text model."""
    from .vision import VLM_TYPES
    if (model_type in VLM_TYPES and _in(_class_for("image-text-to-text", model_type), class_name)
            and not _in(_class_for("causal-lm", model_type), class_name)):
        return "image-text-to-text"
    for task in TASKS:
        if task == "image-text-to-text":
            continue
        if _in(_class_for(task, model_type), class_name):
            return task
    # a class the mapping lists under a sibling type (Gemma3ForSequenceClassification is gemma3's,
    # its text model is gemma3_text): the ending that names one task
    return next((task for task, ends in _SUFFIXES.items() if class_name.endswith(ends)), None)


def task_of_config(config: Mapping[str, Any], class_name: str) -> str | None:
    """The task of ``config`` built as ``class_name``: the one ``--task`` marked (``TASK_KEY``), else
    ``task_of_class``'s."""
    return config.get(TASK_KEY) or task_of_class(str(config.get("model_type") or ""), class_name)


def _in(names: Any, class_name: str) -> bool:
    """Whether an auto mapping's entry (a class name or a list of them) names ``class_name``."""
    return class_name == names or (isinstance(names, (list, tuple)) and class_name in names)


def class_for_task(model_type: str, task: str) -> str:
    """The class transformers builds for ``task`` on ``model_type``; one line when there is none."""
    if task not in TASKS:
        raise TrainmemError(f"--task {task!r} is not one of: {', '.join(TASKS)}")
    name = _class_for(task, model_type)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    if not name:
        have = [t for t in TASKS if _class_for(t, model_type)]
        raise TrainmemError(f"--task {task}: transformers has no {task} class for model_type {model_type!r} "
                            f"(its tasks: {', '.join(have) or 'none of ' + ', '.join(TASKS)})")
    return str(name)


def is_base_class(model_type: str, class_name: str) -> bool:
    """Whether ``class_name`` is ``model_type``'s headless base model (``MODEL_MAPPING_NAMES``)."""
    from transformers.models.auto import modeling_auto
    names = modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    return class_name == names or (isinstance(names, (list, tuple)) and class_name in names)


def _natural_order(model_type: str) -> list[str]:
    """TASKS in the order a config without ``architectures`` picks its head: the speech seq2seq task
    first for the types trainmem builds speech input for (Whisper: its ``WhisperForCausalLM`` is the
    decoder alone, built as the assistant model of speculative decoding, transformers 5.24
    ``models/whisper/modeling_whisper.py`` ``WhisperForCausalLM``; what is fine-tuned is
    ``WhisperForConditionalGeneration``), else TASKS' own order."""
    if model_type in SPEECH_SEQ2SEQ_TYPES:
        return ["speech-seq2seq"] + [t for t in TASKS if t != "speech-seq2seq"]
    return list(TASKS)


def natural_class(model_type: str) -> str | None:
    """The class of the first task in ``_natural_order`` that ``model_type`` has (None: none)."""
    for task in _natural_order(model_type):
        name = _class_for(task, model_type)
        if name:
            return str(name[0] if isinstance(name, (list, tuple)) else name)
    return None


def trainable_class(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config``, or, where its ``architectures`` class is a ``...ForConditionalGeneration`` no task of TASKS
    builds (a vision-language checkpoint: Qwen3.5's ``Qwen3_5ForConditionalGeneration``) and its model type has
    a causal-LM class, the
    config naming that class (what ``AutoModelForCausalLM.from_config`` builds for text training, as TRL and
    the HF Trainer load it), with a note for the report. Without transformers, ``config`` as it is."""
    archs = config.get("architectures") or []
    mtype = str(config.get("model_type") or "")
    current = archs[0] if archs and isinstance(archs[0], str) else ""
    if not current and mtype in SPEECH_SEQ2SEQ_TYPES:
        # named explicitly, so the config's fingerprint (its profile's and coefficients' key) is that
        # of the speech class, never that of a profile an older trainmem built as its causal LM
        try:
            speech = class_for_task(mtype, "speech-seq2seq")
        except TrainmemError:  # no transformers: the config as it is
            return config
        return dict(config, architectures=[speech])
    try:
        if not current.endswith("ForConditionalGeneration") or not mtype or task_of_class(mtype, current) is not None:
            return config  # another head (token classification...) is refused where it is read
        causal = _class_for("causal-lm", mtype)
    except TrainmemError:  # no transformers: the config's own class stands
        return config
    causal = causal[0] if isinstance(causal, (list, tuple)) else causal
    if not causal or causal == current:
        return config
    out = dict(config, architectures=[causal])
    extra = dict(out.get("_trainmem") or {})
    extra["notes"] = list(extra.get("notes") or ()) + [
        f"{current} is no class trainmem trains; estimated as {causal}, the text model AutoModelForCausalLM "
        f"builds from this config (--task picks another)"]
    out["_trainmem"] = extra
    return out


def with_task(config: Mapping[str, Any], task: str | None, name: str) -> dict[str, Any]:
    """``config`` with ``architectures`` naming the class of ``task`` (unchanged without a task,
    or when its class already is that task's)."""
    cfg = dict(config)
    if task is None:
        return cfg
    if task not in TASKS:
        raise TrainmemError(f"--task {task!r} is not one of: {', '.join(TASKS)}")
    mtype = str(cfg.get("model_type") or "")
    if not mtype:
        raise TrainmemError(f"model {name!r}: --task {task} needs the config's model_type")
    from .vision import VLM_TYPES
    if task == "image-text-to-text" and mtype not in VLM_TYPES:
        raise TrainmemError(f"model {name!r}: --task image-text-to-text is run for model types "
                            f"{', '.join(VLM_TYPES)}, not {mtype!r}")
    cfg.pop(TASK_KEY, None)  # the task given replaces one marked, or a catalogue entry's own (``_trainmem.task``)
    if isinstance(cfg.get("_trainmem"), Mapping) and "task" in cfg["_trainmem"]:
        cfg["_trainmem"] = {k: v for k, v in cfg["_trainmem"].items() if k != "task"}
    archs = cfg.get("architectures") or []
    current = archs[0] if archs and isinstance(archs[0], str) else ""
    if current and current.endswith(_SUFFIXES.get(task, ("\0",))):
        return cfg
    if task == "causal-lm" and task_of_class(mtype, current) == "causal-lm":
        return cfg  # Gemma 3's multimodal class, as AutoModelForCausalLM loads it for text
    cls = text_class(cfg, name) if task == "causal-lm" and mtype in VLM_TYPES else class_for_task(mtype, task)
    if task == "image-text-to-text" and task_of_class(mtype, cls) != task:
        cfg[TASK_KEY] = task  # the class is also the type's causal LM (Gemma 3): the config says which
    if cls != current:
        cfg["architectures"] = [cls]
    return cfg


def text_class(config: Mapping[str, Any], name: str) -> str:
    """``--task causal-lm`` on a vision-language config: the causal-LM class of its language model's type
    (Gemma 3's ``gemma3_text``: ``Gemma3ForCausalLM``, built from the text config as
    ``spec.profile.config_for_class`` hands it), the text model alone; one line when transformers has none
    (Qwen2-VL's ``qwen2_vl_text``)."""
    from .profile import hf_config_object
    text = hf_config_object(config).get_text_config()
    cls = _mapping("causal-lm").get(str(text.model_type))
    cls = cls[0] if isinstance(cls, (list, tuple)) else cls
    if not cls:
        raise TrainmemError(f"model {name!r}: --task causal-lm: transformers has no causal-LM class for its language "
                            f"model ({text.model_type}); train it as image-text-to-text (drop --task)")
    return str(cls)
