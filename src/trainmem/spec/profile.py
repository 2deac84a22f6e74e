"""An architecture's tensors as transformers builds them: the profile of any decoder model.

The hand-written families (``architectures.py``) list their tensors from formulas. Every other
``model_type`` transformers ships is read from the model itself: ``build_profile`` builds the
class its config's ``architectures`` names on the ``meta`` device (no memory, ~0.05 s) and records
each parameter (name, shape, role, leaf module, layer), each buffer, the decoder layers'
``ModuleList`` and the sizes the engine needs (read from the config *object*, so that defaults
and ``attribute_map`` spellings are transformers' own). Identical layers share one *kind*; a
model whose layers differ (DeepSeek's dense first layers, Qwen3-MoE's ``mlp_only_layers``) lists
one kind per layer.

Profiles are keyed by ``fingerprint(config)``: the catalogue's are shipped under
``spec/profiles/`` (so that ``estimate`` on them needs neither torch nor transformers), others are
built once and kept in the user cache (``cache_dir()``).

Roles, from the module that owns the parameter: ``nn.Embedding`` -> embedding; the weight of an
``nn.Linear``/``Conv1D``/convolution -> linear (``router`` when it is a MoE gate: a linear whose
output width is the number of experts); a Linear's bias -> bias; a 3-D parameter of another
module (transformers >= 5 fuses each MoE layer's experts into ``(experts, out, in)`` tensors), or a 2-D
one of an experts module stacking them along its rows (DBRX) -> expert; anything else (norm weights and biases, SSM vectors) -> norm.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from ..errors import TrainmemError
from .model import BufferTensor, ParamTensor

PROFILE_VERSION = 3
#: model types whose profile changed after PROFILE_VERSION 3, each with its revision: a profile of such a
#: type that an earlier trainmem wrote into the user cache is built again. DBRX (1): its experts, top-k and
#: expert width are read from ``ffn_config`` (``_SUB_CONFIGS``), where profiles before said it had none.
#: ProphetNet (1): its ``max_positions`` is two below its table (``_POSITION_MARGIN``). (MusicGen's logits width,
#: ``_codebooks``, needs none: its profile was refused before, so none is cached.)
TYPE_REVISION = {"dbrx": 1, "prophetnet": 1}
_LAYER_LIST_NAMES = ("layers", "h", "layer", "blocks", "block", "decoder_layers")
#: the config keys (after transformers resolves its attribute_map) a profile's summary reads
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_top_k")
#: sub-configs whose keys are the model's own sizes: DBRX keeps its experts, their top-k and width in
#: ``ffn_config`` (transformers 5.24 ``models/dbrx/configuration_dbrx.py``: ``DbrxFFNConfig.moe_num_experts``,
#: ``moe_top_k``, ``ffn_hidden_size``; ``modeling_dbrx.py`` ``DbrxExperts`` sizes its weights from them)
_SUB_CONFIGS = ("ffn_config",)
#: model types whose ``num_hidden_layers`` counts something other than their decoder layers, and the key that
#: counts those: LongCat-Flash's layers each hold two attention sublayers, and its ``num_hidden_layers`` is
#: ``2 * num_layers`` (transformers 5.24 ``models/longcat_flash/configuration_longcat_flash.py`` L117-118, the
#: cache's layers) while ``LongcatFlashModel.layers`` has ``num_layers`` (``modeling_longcat_flash.py`` L568)
_LAYER_COUNT_KEY = {"longcat_flash": "num_layers"}


def fingerprint(config: Mapping[str, Any]) -> str:
    """A stable hash of a config: its keys and values except trainmem's own (``_trainmem``) and
    fields that do not change the tensors (dtype, versions, token ids, names)."""
    skip = {"_trainmem", "_name_or_path", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
            "eos_token_id", "pad_token_id", "use_cache", "auto_map", "quantization_config", "initializer_range"}
    core = {k: v for k, v in config.items() if k not in skip}
    text = json.dumps(core, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Profile:
    """The tensors of one architecture (see the module docstring)."""

    model_type: str
    architecture: str
    layers_prefix: str                         # e.g. "model.layers"
    summary: dict[str, Any]                    # sizes for ModelSpec
    outer: tuple[ParamTensor, ...]             # tensors outside the layers, registration order
    kinds: dict[str, tuple[ParamTensor, ...]]  # per layer kind, layer index 0 (renumbered on use)
    layer_kinds: tuple[str, ...]               # the kind of each layer
    buffers: tuple[BufferTensor, ...]
    transformers_version: str = ""
    #: an encoder-decoder's two layer lists, (dotted name, layers) each, encoder first; their layers
    #: are numbered on from one list to the next. Empty: one list, ``layers_prefix``
    stacks: tuple[tuple[str, int], ...] = ()

    def layer_names(self) -> list[tuple[str, int]]:
        """(the list's dotted name, the index in it) of each layer, in the model's numbering."""
        stacks = self.stacks or ((self.layers_prefix, len(self.layer_kinds)),)
        return [(prefix, j) for prefix, count in stacks for j in range(count)]

    def parameter_tensors(self) -> list[ParamTensor]:
        """Every parameter, layers in order between the tensors registered before and after them
        (an encoder-decoder's tensors between its two lists, e.g. the encoder's final norm, come
        after the layers)."""
        before = [p for p in self.outer if p.layer == -1]
        after = [p for p in self.outer if p.layer != -1]
        out = [ParamTensor(p.name, p.shape, p.role, p.module, None) for p in before]
        for i, (kind, (prefix, j)) in enumerate(zip(self.layer_kinds, self.layer_names())):
            for p in self.kinds[kind]:
                out.append(ParamTensor(f"{prefix}.{j}.{p.name}", p.shape, p.role, p.module, i))
        out += [ParamTensor(p.name, p.shape, p.role, p.module, None) for p in after]
        return out

    @property
    def uniform(self) -> bool:
        return len(set(self.layer_kinds)) <= 1

    def to_json(self) -> dict[str, Any]:
        def row(p: ParamTensor) -> list[Any]:
            return [p.name, list(p.shape), p.role, p.module] + ([p.layer] if p.layer == -1 else [])
        return {"version": PROFILE_VERSION, "model_type": self.model_type, "architecture": self.architecture,
                "layers_prefix": self.layers_prefix, "summary": self.summary,
                "outer": [row(p) for p in self.outer],
                "kinds": {k: [row(p) for p in v] for k, v in self.kinds.items()},
                "layer_kinds": list(self.layer_kinds),
                "buffers": [[b.name, list(b.shape), b.dtype] for b in self.buffers],
                "transformers_version": self.transformers_version,
                **({"revision": TYPE_REVISION[self.model_type]} if self.model_type in TYPE_REVISION else {}),
                **({"stacks": [list(x) for x in self.stacks]} if self.stacks else {})}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Profile":
        def tensor(r: list[Any], layer: int | None) -> ParamTensor:
            return ParamTensor(r[0], tuple(r[1]), r[2], r[3], r[4] if len(r) > 4 else layer)
        return Profile(d["model_type"], d["architecture"], d["layers_prefix"], dict(d["summary"]),
                       tuple(tensor(r, None) for r in d["outer"]),
                       {k: tuple(tensor(r, 0) for r in v) for k, v in d["kinds"].items()},
                       tuple(d["layer_kinds"]), tuple(BufferTensor(n, tuple(s), dt) for n, s, dt in d["buffers"]),
                       d.get("transformers_version", ""), tuple((str(a), int(b)) for a, b in d.get("stacks", ())))


# ----- where profiles live --------------------------------------------------------------------
def cache_dir() -> str:
    """trainmem's user cache: $TRAINMEM_CACHE, else $XDG_CACHE_HOME/trainmem, else ~/.cache/trainmem."""
    if os.environ.get("TRAINMEM_CACHE"):
        return os.path.expanduser(os.environ["TRAINMEM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trainmem")


def _shipped(kind: str, key: str) -> str | None:
    try:
        f = resources.files("trainmem.spec").joinpath(kind, f"{key}.json")
        return f.read_text() if f.is_file() else None
    except (FileNotFoundError, ModuleNotFoundError):
        return None


def read_cached(kind: str, key: str) -> dict[str, Any] | None:
    """A shipped (``trainmem/spec/<kind>/``) or cached (``cache_dir()/<kind>/``) JSON document."""
    text = _shipped(kind, key)
    if text is None:
        path = os.path.join(cache_dir(), kind, f"{key}.json")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def write_cached(kind: str, key: str, doc: Mapping[str, Any]) -> None:
    """Keep ``doc`` in the user cache; a cache that cannot be written is skipped silently (the
    document is rebuilt next time)."""
    folder = os.path.join(cache_dir(), kind)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{key}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(folder, f"{key}.json"))
    except OSError:
        pass


@lru_cache(maxsize=1)
def _installed_transformers() -> str | None:
    """The installed transformers release (``tf_releases.installed_version``: its distribution metadata,
    transformers not imported), or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from .tf_releases import installed_version
    try:
        return installed_version()
    except PackageNotFoundError:
        return None


def _current(doc: Mapping[str, Any] | None, shipped: bool) -> bool:
    """Whether a stored profile is the one this trainmem would build now: the same ``PROFILE_VERSION`` and
    model-type revision (``TYPE_REVISION``), and, for one in the user cache, built by the installed
    transformers (a release's model classes may name, shape or fuse their parameters differently: transformers
    5 stacks MoE experts into 3-D tensors). A shipped profile (the catalogue's, built under the pinned
    transformers) stands whatever is installed: it is what lets trainmem run without transformers."""
    if doc is None or doc.get("version") != PROFILE_VERSION:
        return False
    if doc.get("revision", 0) != TYPE_REVISION.get(str(doc.get("model_type")), 0):
        return False
    installed = None if shipped else _installed_transformers()
    return installed is None or doc.get("transformers_version", "") in ("", installed)


@lru_cache(maxsize=256)
def _profile_for(key: str, config_json: str) -> Profile:
    text = _shipped("profiles", key)
    doc = json.loads(text) if text is not None else read_cached("profiles", key)
    if _current(doc, shipped=text is not None):
        return Profile.from_json(doc)
    prof = build_profile(json.loads(config_json))
    write_cached("profiles", key, prof.to_json())
    return prof


def profile_for(config: Mapping[str, Any]) -> Profile:
    """The profile of ``config``: shipped, cached, or built with transformers (then cached); the task
    ``--task`` marked (``tasks.TASK_KEY``) is kept for ``build_profile``."""
    from .tasks import TASK_KEY
    clean = {k: v for k, v in config.items() if not k.startswith("_") or k == TASK_KEY}
    return _profile_for(fingerprint(config), json.dumps(clean, sort_keys=True, default=str))


# ----- building one -----------------------------------------------------------------------------
def hf_config_object(config: Mapping[str, Any]) -> Any:
    """transformers' config object for a config dict (its class from ``model_type``)."""
    try:
        import transformers
    except ImportError:
        raise TrainmemError(f"model_type {config.get('model_type')!r} has no bundled profile; reading it needs "
                            f"transformers: pip install transformers") from None
    # (a copy: transformers' config classes update the nested dicts they are given, a composite config's
    # ``rope_scaling`` among them, which would change the caller's config and its fingerprint)
    d = copy.deepcopy({k: v for k, v in config.items() if not k.startswith("_") and k != "model_type"})
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # a published config's validation notes are not the user's
    mtype = str(config["model_type"])
    try:
        return transformers.AutoConfig.for_model(mtype, **d)
    except Exception as e:  # noqa: BLE001 - an unknown type, or transformers' validation of the values
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        if mtype not in CONFIG_MAPPING_NAMES:
            raise TrainmemError(f"unsupported model_type {mtype!r}: transformers {transformers.__version__} does "
                                f"not know it (a newer transformers may)") from None
        why = " ".join(str(e).split())[:200]
        raise TrainmemError(f"model_type {mtype!r}: transformers {transformers.__version__} rejects this config "
                            f"({type(e).__name__}: {why})") from None
    finally:
        transformers.logging.set_verbosity(level)


def model_class(config: Mapping[str, Any], cfg_obj: Any) -> Any:
    """The class of the config: its ``architectures[0]`` when transformers has it and it has a
    head, else its model type's natural head (``spec.tasks.natural_class``: a decoder's causal LM, T5's seq2seq LM,
    ViT's image classifier)."""
    import transformers
    from .tasks import is_base_class, natural_class
    archs = config.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if archs and cls is None:
        raise TrainmemError(f"architecture {archs[0]!r}: transformers {transformers.__version__} has no such class")
    if cls is not None and is_base_class(str(config["model_type"]), cls.__name__):
        cls = None  # a headless base model (ViT-in21k's ViTModel): trained with its type's natural head
    if cls is None:
        name = natural_class(str(config["model_type"]))
        cls = getattr(transformers, name, None) if name else None
        if cls is None:
            raise TrainmemError(f"model_type {config['model_type']!r}: transformers has no class for any task "
                                f"trainmem trains (causal LM, seq2seq LM, image, masked-LM or sequence "
                                f"classification) for it") from None
    return cls


def build_profile(config: Mapping[str, Any]) -> Profile:
    """Build the model of ``config`` on the meta device and read its tensors (needs torch and
    transformers)."""
    import torch
    import transformers
    mtype = str(config.get("model_type"))
    shared = shared_layers(config)
    if shared:
        raise TrainmemError(f"model_type {mtype!r}: {shared}; trainmem models stacks of distinct layers and "
                            f"neither estimates nor traces shared ones")
    cfg = hf_config_object(config)
    cls = model_class(config, cfg)
    from .tasks import TASKS, task_of_config
    task = task_of_config(config, cls.__name__)
    if task is None:
        raise TrainmemError(f"model_type {mtype!r} ({cls.__name__}): trainmem derives the classes of the tasks "
                            f"{', '.join(TASKS)}; this class is none of them (give --task)")
    own = default_language(config_for_class(cls, cfg))
    unmodelled = unmodelled_step(mtype, cls)
    if unmodelled:
        raise TrainmemError(f"model_type {mtype!r} ({cls.__name__}): {unmodelled}")
    model = _build_meta(cls, own, mtype)
    # a vision tower's classifier on a composite config (SigLIP's, CLIP's): its sizes are the vision config's
    vision = getattr(cfg, "vision_config", None) if task == "image-classification" else None
    # (else the config the class was built with: a decoder-only class of an encoder-decoder family sets
    # ``is_encoder_decoder`` False on its own copy, PegasusForCausalLM and ProphetNetForCausalLM, transformers
    # 5.24 ``models/pegasus/modeling_pegasus.py`` L1021-1024; BartForCausalLM on the config it is given)
    summ = dict(summary(vision), vocab_size=summary(cfg, labels_only=True)["vocab_size"]) if vision is not None \
        else summary(getattr(model, "config", None) or own)
    unused = without_gradient(model, summ) if task == "image-classification" else \
        text_without_gradient(model, summ) if task == "causal-lm" \
        else vlm_without_gradient(model, cfg) if task == "image-text-to-text" else frozenset()
    # parameters the model builds frozen, whatever its task: no gradient, no state (Whisper's sinusoidal encoder
    # positions, ``WhisperEncoder.__init__``: ``self.embed_positions.requires_grad_(False)``; Marian's sinusoidal
    # positions, transformers 5.24 ``models/marian/modeling_marian.py`` L76-77 ``nn.Embedding(..., _freeze=True)``,
    # which torch/nn/modules/sparse.py makes a ``Parameter(requires_grad=not _freeze)``)
    unused = unused | frozenset(n for n, p in model.named_parameters() if not p.requires_grad)
    return profile_of_module(model, mtype, cls.__name__, dict(summ, task=task), transformers.__version__, unused)


#: model types whose training step trainmem does not model, and why: BLT (Byte Latent Transformer) runs its bytes
#: through a local encoder, a global transformer over patches and a local decoder of different widths, and its
#: patches' count comes from its entropy model's predictions on the bytes themselves (transformers 5.24
#: ``models/blt/modeling_blt.py`` ``BltModel.forward`` L1211-1226, ``BltPatcher.patch_lengths_from_entropies``
#: L933-984), so no config sizes its global sequence
_UNMODELLED_TYPES = {
    "blt": "its bytes run through a local encoder, a global transformer and a local decoder of different widths, "
           "the global one over patches its entropy patcher picks from the data (patching_mode 'entropy'); trainmem "
           "sizes one stack over the --seq-len tokens and does not model it",
}


def unmodelled_step(mtype: str, cls: Any) -> str:
    """Why trainmem does not model the training step of ``cls`` ("" when it does): ``_UNMODELLED_TYPES``, and
    the drafters whose forward needs another model's states: Gemma 4's assistants (for speculative decoding)
    raise without the target model's ``inputs_embeds`` and ``shared_kv_states``, the keys and values every one
    of their layers reads instead of computing its own (transformers 5.24
    ``models/gemma4_assistant/modeling_gemma4_assistant.py`` L165-166, ``models/gemma4_unified_assistant``
    alike)."""
    import inspect
    if mtype in _UNMODELLED_TYPES:
        return _UNMODELLED_TYPES[mtype]
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return ""
    if "shared_kv_states" not in params:
        return ""
    return ("a speculative-decoding drafter: its forward reads its target model's shared_kv_states and "
            "inputs_embeds, not input_ids; trainmem does not model its training")


_QSA_FIX = ("give the QSA indexer's fields (indexer_n_heads, indexer_kv_heads=1, indexer_head_dim, indexer_budget, "
            "indexer_compress_ratio) as a Qwen4-Exp checkpoint's config does")
_COMPASS_FIX = ("give rope_parameters per layer type ({\"full_attention\": {\"rope_type\": \"default\", \"rope_theta\": "
                "...}}) as CohereLabs/North-Micro-Vision-Instruct's config does")

#: configs transformers 5.24 accepts but its own model class does not build from (its bugs, hit by any
#: ``from_config``/``from_pretrained`` of such a config), keyed by model type: (whether the built config has the
#: bug, the fix)
_TRANSFORMERS_BUGS = {
    # MinistralConfig leaves ``head_dim`` None without one (configuration_ministral.py L71; Mistral's defaults
    # it to hidden_size // num_attention_heads, configuration_mistral.py L83): ``head_dim**-0.5`` fails
    # (modeling_ministral.py L147)
    "ministral": (lambda c: getattr(c, "head_dim", None) is None, "give head_dim (Ministral-8B's hub config: 128)"),
    # Lfm2MoeConfig has no default ``layer_types`` (configuration_lfm2_moe.py L87; LFM2's derives them from
    # ``full_attn_idxs``, configuration_lfm2.py L82-87); ``Lfm2MoeDecoderLayer`` indexes it (modeling_lfm2_moe.py L474)
    "lfm2_moe": (lambda c: getattr(c, "layer_types", None) is None,
                 "give layer_types (\"conv\" or \"full_attention\" per layer, as LFM2-8B-A1B's hub config does)"),
    # DbrxAttention reads ``attn_config.rope_theta`` (modeling_dbrx.py L184), a field DbrxAttentionConfig does not
    # declare (configuration_dbrx.py L28-42): only a config that sets it builds
    "dbrx": (lambda c: getattr(getattr(c, "attn_config", None), "rope_theta", None) is None,
             "give attn_config.rope_theta (DBRX's hub config: 500000)"),
    # every Qwen4ExpTextAttention builds a QSA indexer (modeling_qwen4_exp.py L857) that divides
    # ``indexer_budget // indexer_compress_ratio`` (L697-699), fields whose defaults are None (configuration_qwen4_exp.py
    # L156-160, "setting this enables QSA"): only a config that sets them builds
    "qwen4_exp_text": (lambda c: getattr(c, "indexer_budget", None) is None, _QSA_FIX),
    "qwen4_exp": (lambda c: getattr(c, "indexer_budget", None) is None, _QSA_FIX),
    # CohereCompassTextConfig defaults ``rope_parameters`` to {} (configuration_cohere_compass.py L134) and its rotary
    # embedding reads one entry per layer type (modeling_cohere_compass.py L79-80)
    "cohere_compass_text": (lambda c: not set(c.layer_types) <= set(c.rope_parameters or {}), _COMPASS_FIX),
    "cohere_compass": (lambda c: not set(c.layer_types) <= set(c.rope_parameters or {}), _COMPASS_FIX),
    # ZambaModel ties each hybrid layer's shared attention block to the first hybrid layer's (modeling_zamba.py
    # L854-862); with one hybrid layer the tie has no target (modeling_utils.py ``get_expanded_tied_weights_keys``)
    "zamba": (lambda c: list(c.layers_block_type).count("hybrid") == 1,
              "give at least two \"hybrid\" layers in layers_block_type (Zyphra/Zamba-7B-v1 has 13 of 76)"),
}


def _build_meta(cls: Any, own: Any, mtype: str) -> Any:
    """``cls`` built from its config ``own`` on the meta device (buffers as an fp32 build); a config that
    does not build is one line naming transformers' error (a known bug of transformers: which, and the fix)."""
    import torch
    import transformers
    try:
        with torch.device("meta"):
            return cls._from_config(own, dtype=torch.float32)
    except Exception as e:  # a config that does not build: say which and why, once
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]  # (timm's ImportError starts with a blank)
        why = f"{type(e).__name__}: {lines[0][:160] if lines else ''}"
        bug = _TRANSFORMERS_BUGS.get(mtype)
        if bug is not None and bug[0](own):
            raise TrainmemError(f"model_type {mtype!r}: {cls.__name__} does not build from this config ({why}): a "
                                f"bug of transformers {transformers.__version__} (its from_pretrained fails alike), "
                                f"not of trainmem; {bug[1]}") from None
        raise TrainmemError(f"model_type {mtype!r}: {cls.__name__} does not build from this config on the meta "
                            f"device ({why})") from None


def shared_layers(config: Mapping[str, Any]) -> str:
    """Why ``config``'s layers share weights ("" when they do not): ALBERT runs one layer group's
    modules for all ``num_hidden_layers`` applications (transformers 5.24
    ``models/albert/modeling_albert.py`` ``AlbertTransformer.forward``: ``group_idx = int(i /
    (num_hidden_layers / num_hidden_groups))``, ``self.albert_layer_groups[group_idx]``), so its layer
    list has ``num_hidden_groups`` entries, not one per layer; the recurrent-depth models loop a stack
    of layers (``_looped_layers``)."""
    looped = _looped_layers(config)
    if looped:
        return looped
    groups, layers = config.get("num_hidden_groups"), config.get("num_hidden_layers")
    if config.get("model_type") != "albert" or not isinstance(groups, int) or not isinstance(layers, int):
        return ""
    if groups >= layers:
        return ""
    return (f"its {layers} layers run the weights of {groups} shared layer group{'s' if groups > 1 else ''} "
            f"(albert_layer_groups, num_hidden_groups={groups})")


def _looped_layers(config: Mapping[str, Any]) -> str:
    """Why a recurrent-depth model's layers run more than once per step ("" for any other): HRM-Text runs its
    low-level stack ``L_cycles`` times and its high-level stack once in each of ``H_cycles`` cycles
    (transformers 5.24 ``models/hrm_text/modeling_hrm_text.py`` L486-515, ``L_module`` and ``H_module``: both
    ``HrmTextStack``s of ``num_layers_per_stack`` layers; the earlier low-level cycles without gradient,
    ``L_bp_cycles``); Dory runs its ``n_recurrent_layers`` middle layers ``n_recurrent_loops`` times between its
    input and output layers (``models/dory/modeling_dory.py`` L479-515), defaults as their configs give them
    (``configuration_hrm_text.py`` L93-94, ``configuration_dory.py`` L81)."""
    mtype = config.get("model_type")
    if mtype == "hrm_text":
        h, l_ = int(config.get("H_cycles", 2)), int(config.get("L_cycles", 3))
        return (f"its two layer stacks (L_module, H_module) run in {h} high-level cycles of {l_} low-level ones "
                f"(H_cycles={h}, L_cycles={l_}), each cycle over the same layers' weights")
    loops = config.get("n_recurrent_loops", 2)
    if mtype == "dory" and isinstance(loops, int) and loops > 1:
        return (f"its recurrent middle layers (n_recurrent_layers) run {loops} times (n_recurrent_loops={loops}) "
                f"over the same weights, between its input and output layers")
    return ""


def config_for_class(cls: Any, cfg: Any) -> Any:
    """The config ``cls`` is built from: a composite config's text config where the class takes that (Qwen3.5's
    ``Qwen3_5ForCausalLM`` of a ``qwen3_5`` checkpoint's ``Qwen3_5Config``, as ``AutoModelForCausalLM.from_config``
    hands it the text config), else ``cfg`` itself."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(cfg, wanted):
        return cfg
    try:
        text = getattr(cfg, "get_text_config", lambda: None)()
    except ValueError:  # several text configs (transformers 5.24 ``PreTrainedConfig.get_text_config``)
        text = None
    if text is not None and isinstance(text, wanted):
        return text
    # the one sub-config of the class's own config class: MusicGen's ``decoder`` (``MusicgenConfig`` holds
    # ``text_encoder``, ``audio_encoder`` and ``decoder``; 5.24 ``models/musicgen/modeling_musicgen.py``
    # ``MusicgenForConditionalGeneration.__init__`` builds ``MusicgenForCausalLM._from_config(config.decoder)``)
    subs = [getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", None) or {}]
    subs = [c for c in subs if isinstance(c, wanted)]
    return subs[0] if len(subs) == 1 else cfg


def default_language(config: Any) -> Any:
    """``config`` with a language where the model takes one per batch and none is set: X-MOD's layers run
    one adapter per language and refuse a batch without ``lang_ids`` or ``default_language`` ("Input language
    unknown. Please call ``XmodPreTrainedModel.set_default_language()``", transformers 5.24
    ``models/xmod/modeling_xmod.py`` L729-734); the step trains on the first of the config's ``languages``,
    as ``set_default_language(languages[0])`` sets it (L620-631); ``--set default_language=de_DE`` picks another."""
    langs = getattr(config, "languages", None)
    if hasattr(config, "default_language") and config.default_language is None and langs:
        config.default_language = list(langs)[0]
    return config


def without_gradient(model: Any, summ: Mapping[str, Any]) -> frozenset[str]:
    """The parameters an image classifier's training step leaves without a gradient: modules it
    builds but its forward does not run (SigLIP's vision tower builds its attention-pooling
    ``head``, ``SiglipVisionTransformer.__init__``, which ``SiglipForImageClassification.forward``
    skips: it mean-pools the last hidden state). Found by running the step, forward, the model's own
    loss and backward, on meta tensors of one image (no memory): a parameter whose ``.grad`` is still
    None gets no gradient and no optimizer state (``torch.optim`` skips it)."""
    import torch
    side = summ.get("image_size")
    if not isinstance(side, int):
        return frozenset()
    pixels = torch.empty(1, int(summ.get("num_channels", 3)), side, side, device="meta")
    try:
        out = model(pixel_values=pixels, labels=torch.zeros(1, dtype=torch.long, device="meta"))
        out.loss.backward()
    except Exception:  # a step that does not run on meta tensors: every parameter is taken as trained
        return frozenset()
    return frozenset(name for name, p in model.named_parameters() if p.requires_grad and p.grad is None)


def text_without_gradient(model: Any, summ: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The parameters a causal LM's training step on text leaves without a gradient: modules it builds
    but does not run on ``input_ids`` alone. A multimodal class's vision tower and projector
    (``AutoModelForCausalLM`` loads Gemma 3's ``Gemma3ForConditionalGeneration`` whole; ``Gemma3Model.forward``
    runs ``get_image_features`` only for ``pixel_values``; Fuyu's ``vision_embed_tokens``), and the
    cross-attention of an encoder-decoder family's decoder-only class (transformers 5.24
    ``models/bart/modeling_bart.py`` ``BartDecoderLayer.forward``: ``if encoder_hidden_states is not
    None:`` runs ``encoder_attn``; BartForCausalLM, MBart, Blenderbot, PLBart, MVP, Marian, Pegasus get
    none), and DeepSeek-V3.2's DSA indexer (``models/deepseek_v32/modeling_deepseek_v32.py``
    ``DeepseekV32Indexer.forward`` is ``@torch.no_grad()``, L178: it returns top-k token indices).
    Found as ``without_gradient`` finds them: a step of eight tokens on meta tensors, no memory,
    whose data-dependent reads (``.item()``, e.g. BART's mask checks) are answered by ``_meta_scalars``.
    In a MoE model the routing of meta tokens is no real routing: its experts and routers are kept as
    trained (``summ``'s ``num_experts``)."""
    if not (_meta_step(model) or _meta_step_half(model)):
        return frozenset()  # a step that does not run on meta tensors: every parameter is taken as trained
    unused = frozenset(name for name, p in model.named_parameters() if p.requires_grad and p.grad is None)
    if (summ or {}).get("num_experts"):
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        unused = frozenset(n for n in unused if _role(modules.get(n.rpartition(".")[0]), n.rpartition(".")[2],
                                                      params[n], summ["num_experts"]) not in ("expert", "router")
                           and "expert" not in n)
    for p in model.parameters():
        p.grad = None
    return unused


def _meta_step(model: Any) -> bool:
    """Run a step of eight tokens of ``model`` on meta tensors (no memory); whether it ran."""
    import torch
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    try:
        with _meta_scalars():
            model(input_ids=ids, labels=ids).loss.backward()
    except Exception:
        model.zero_grad(set_to_none=True)
        return False
    return True


def _meta_step_half(model: Any) -> bool:
    """``_meta_step`` with the model cast to bf16 and back: transformers' ``grouped_mm`` experts take half
    inputs only (5.24 ``integrations/moe.py``; the fp32 meta build's step fails there: DeepSeek-V3.2,
    Mixtral). Each tensor gets its own dtype back (meta tensors: no data, no memory)."""
    import torch
    params = {n: p.dtype for n, p in model.named_parameters()}
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    model.to(torch.bfloat16)
    try:
        return _meta_step(model)
    finally:
        for n, p in model.named_parameters():
            p.data = p.data.to(params[n])
        for n, b in model.named_buffers():  # (``Module.to`` replaces the buffers)
            owner, _, leaf = n.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = b.to(buffers[n])


def _meta_scalars() -> Any:
    """A dispatch mode answering a meta tensor's ``.item()`` (``aten._local_scalar_dense``) as trace's
    tracker answers a clean batch's (``trace/tracker.py`` ``Tracker.__torch_dispatch__``): booleans False,
    numbers 1."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..trace.routing_values import RoutingValues
    values = RoutingValues("meta")  # (X-MOD's adapter of the step's language: ``trace.routing_values``)

    class MetaScalars(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
                t = args[0]
                v = values.value(t)
                if v is not None:
                    return v.item()
                return False if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
            try:
                out = func(*args, **kwargs)
            except (RuntimeError, NotImplementedError):
                out = values.sized(func, args, kwargs)
                if out is None:
                    raise
                return out
            values.after(func, args, kwargs, out)
            return out
    return MetaScalars()


def vlm_without_gradient(model: Any, cfg: Any) -> frozenset[str]:
    """The parameters a vision-language model's training step on images leaves without a gradient
    (``vision.unread_vision_parameters``: modules its vision tower runs but whose output no loss reads)."""
    from .vision import unread_vision_parameters
    return unread_vision_parameters(cfg, [name for name, _p in model.named_parameters()])


def summary(cfg: Any, labels_only: bool = False) -> dict[str, Any]:
    """The sizes a ModelSpec needs, read from transformers' config object (defaults and aliases
    resolved by transformers). An encoder-decoder counts the layers of both stacks
    (``decoder_layers`` of them in the decoder); an image model (``image_size`` and ``patch_size``
    in its config) has no vocabulary: its ``vocab_size`` is its label count (``labels_only``: that
    alone, of a composite config whose vision config has the sizes)."""
    def first(*keys: str, default: Any = None) -> Any:
        for k in keys:
            v = _config_value(cfg, k)
            if v is not None and not isinstance(v, bool):
                return v
        return default
    if labels_only:
        return {"vocab_size": len(getattr(cfg, "id2label", None) or {}) or int(first("num_labels", default=2))}
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    cfg = text if text is not None else cfg
    if first("hidden_size", "d_model", "n_embd", "dim") is None:
        raise TrainmemError(f"model_type {getattr(cfg, 'model_type', '?')!r}: its config names no hidden size "
                            f"(hidden_size, d_model, n_embd or dim); trainmem cannot size its layers")
    h = int(first("hidden_size", "d_model", "n_embd", "dim"))
    heads = int(first("num_attention_heads", "n_head", "num_heads", default=1))
    kv = first("num_key_value_heads", "num_kv_heads", "n_head_kv", default=None)
    if kv is None and getattr(cfg, "multi_query", False):
        kv = 1
    head_dim = first("head_dim", "attention_head_dim", "d_kv", default=None)
    experts = int(first(*_EXPERT_KEYS, default=0) or 0)
    # a local window (Mistral, Gemma), or Llama 4's chunked attention: beyond it the mask is no
    # longer the causal one, so derived coefficients need both sides (estimate.derived.regime)
    window = first("sliding_window", "attention_window", "attention_chunk_size", default=0)
    if not first(*_TOPK_KEYS, default=0):
        experts = 0  # no top-k in the config: not read as a mixture of experts
    own = _LAYER_COUNT_KEY.get(str(getattr(cfg, "model_type", "")))
    # the decoder-only class of an encoder-decoder family (its config ``is_decoder`` and no longer
    # ``is_encoder_decoder``) has the decoder's layers: distilbart-12-6's BartForCausalLM six, not twelve
    decoder_only = bool(getattr(cfg, "is_decoder", False)) and not getattr(cfg, "is_encoder_decoder", False)
    keys = ((own,) if own else ()) + (("decoder_layers", "num_decoder_layers") if decoder_only else ())
    layers = int(first(*keys, "encoder_layers", "num_hidden_layers", "n_layer", "num_layers"))
    decoder = int(first("decoder_layers", "num_decoder_layers", default=layers)) \
        if getattr(cfg, "is_encoder_decoder", False) else 0
    image = first("image_size", default=None), first("patch_size", default=None)
    labels = len(getattr(cfg, "id2label", None) or {}) or int(first("num_labels", default=2))
    out = {"num_layers": layers + decoder, "decoder_layers": decoder, "hidden_size": h,
           "num_heads": heads, "num_kv_heads": int(kv) if kv else heads,
           "head_dim": int(head_dim) if head_dim else (h // heads if h % heads == 0 else None),
           "vocab_size": int(first("vocab_size", default=labels)) * _codebooks(cfg),
           "ffn_size": int(first("intermediate_size", "ffn_hidden_size", "n_inner", "d_ff", "encoder_ffn_dim",
                                 default=4 * h) or 4 * h),
           "max_positions": _max_positions(first("max_position_embeddings", "n_positions", "max_seq_len",
                                                 default=2048)) - _POSITION_MARGIN.get(str(cfg.model_type), 0),
           "num_experts": experts,
           "experts_top_k": int(first(*_TOPK_KEYS, default=0) or 0) if experts else 0,
           "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
           "sliding_window": window if isinstance(window, int) else 0,
           "use_cache": bool(getattr(cfg, "use_cache", True))}
    if out["decoder_layers"] and isinstance(first("num_mel_bins", default=None), int):
        # a speech encoder-decoder (Whisper): its mel channels, its encoder's fixed positions, and as
        # max_positions its decoder's learned ones (``max_target_positions``)
        out.update(mel_bins=int(first("num_mel_bins")), source_positions=int(first("max_source_positions")),
                   max_positions=int(first("max_target_positions", default=out["max_positions"])))
    if isinstance(image[0], int) and isinstance(image[1], int):
        out.update(image_size=image[0], patch_size=image[1], num_channels=int(first("num_channels", default=3)))
    return out


def _config_value(cfg: Any, key: str) -> Any:
    """``cfg.key``, or None. A per-layer list (Gemma 3n's ``intermediate_size``) and an attribute of a
    heterogeneous config (transformers' ``integrations/heterogeneity``: Gemma 4's ``head_dim``, which reading
    globally raises ``AmbiguousGlobalPerLayerAttributeError``) give their largest value over the layers: the
    summary's sizes are a ModelSpec's bounds (the attention kernels' head size, the FFN width); the layers'
    own tensors and activations come from the model itself (profile_of_module, trace.derive)."""
    try:
        v = getattr(cfg, key, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attribute guard, whatever its class
        layers = getattr(cfg, "per_layer_config", None) or []
        values = [getattr(lc, key, None) for lc in layers]
        values = [x for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
        return max(values) if values else None
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return max(v)
    if v is None:
        subs = (getattr(cfg, name, None) for name in _SUB_CONFIGS)
        v = next((getattr(sub, key) for sub in subs if sub is not None and getattr(sub, key, None) is not None), None)
    return v


def image_class_tokens(model: Any, summ: Mapping[str, Any]) -> int:
    """Tokens an image model adds to its patches (ViT's and CLIP's class token: 1; SigLIP: 0): the
    rows of its position embeddings beyond the patches of its ``image_size``."""
    patches = (summ["image_size"] // summ["patch_size"]) ** 2
    for name, p in model.named_parameters():
        if "position_embedding" in name and p.dim() >= 2 and p.shape[-1] == summ["hidden_size"]:
            return max(p.numel() // summ["hidden_size"] - patches, 0)
    return 0


def layer_stacks(model: Any, summ: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The layer lists: an encoder-decoder's encoder and decoder lists (the ModuleLists of
    ``GradientCheckpointingLayer``s, encoder first), else the one list ``layers_list`` finds."""
    dec = summ.get("decoder_layers", 0)
    if not dec:
        return [(layers_list(model, summ["num_layers"]), summ["num_layers"])]
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer
    found = [(name, len(mod)) for name, mod in model.named_modules() if isinstance(mod, torch.nn.ModuleList)
             and len(mod) and all(isinstance(x, GradientCheckpointingLayer) for x in mod)]
    enc = summ["num_layers"] - dec
    if len(found) != 2 or [n for _, n in found] != [enc, dec]:
        raise TrainmemError(f"{type(model).__name__}: expected an encoder list of {enc} layers and a decoder list "
                            f"of {dec}, found {found}")
    return found


def layers_list(model: Any, num_layers: int) -> str:
    """The dotted name of the decoder layers' ModuleList (the longest list of ``num_layers``)."""
    import torch
    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers]
    if not found:
        raise TrainmemError(f"{type(model).__name__}: no list of {num_layers} layers found among its modules")
    found.sort(key=lambda nm: (nm[0].rsplit(".", 1)[-1] not in _LAYER_LIST_NAMES, nm[0].count(".")))
    return found[0][0]


#: the positions of a model without a sequence length limit (``_max_positions``)
NO_POSITION_LIMIT = 1 << 31


def _codebooks(cfg: Any) -> int:
    """The codebooks each position of ``cfg``'s decoder predicts (1: text), by which its logits per position are
    wider than its vocabulary: MusicGen's ``num_codebooks`` heads, each (vocab_size, hidden), stacked into logits of
    (batch, num_codebooks, seq, vocab_size) (transformers 5.24 ``models/musicgen/modeling_musicgen.py`` L727,
    ``MusicgenForCausalLM.__init__``'s ``lm_heads``), so trainmem sizes its logits and heads by num_codebooks x
    vocab_size (``workload.audio_codebooks`` feeds its batch)."""
    books = getattr(cfg, "num_codebooks", None)
    return books if isinstance(books, int) and not isinstance(books, bool) and books > 1 else 1


#: positions of the table a model's longest sequence cannot use, by model type: ProphetNet's decoder numbers its
#: main stream from ``padding_idx`` + 1 (``cumsum(attention_mask) + padding_idx``, transformers 5.24
#: ``models/prophetnet/modeling_prophetnet.py`` L372-375; ``pad_token_id`` 0 in its configs) and its predicting
#: streams one further (``self.position_embeddings._forward(position_ids + 1)``, L1160), so a sequence's last
#: predicting position is seq + 1, which the table of ``max_position_embeddings`` rows holds up to seq =
#: max_position_embeddings - 2 (a longer one fails the embedding's lookup, or the relative buckets' ``view``,
#: L1274-1289, L803-808)
_POSITION_MARGIN = {"prophetnet": 2}


def _max_positions(value: Any) -> int:
    """A config's position limit; a value below 1 is transformers' "no sequence length limit": XLNet's
    relative positions (transformers 5.24 ``models/xlnet/configuration_xlnet.py`` L148-151,
    ``max_position_embeddings`` returns -1), which any ``--seq-len`` fits."""
    n = int(value)
    return n if n > 0 else NO_POSITION_LIMIT


def _role(mod: Any, pname: str, param: Any, experts: int) -> str:
    import torch
    conv1d = type(mod).__name__ == "Conv1D"  # transformers.pytorch_utils.Conv1D (GPT-2 style)
    if isinstance(mod, torch.nn.Embedding):
        return "embedding"
    if isinstance(mod, torch.nn.Linear) or conv1d or isinstance(mod, torch.nn.modules.conv._ConvNd):
        if pname == "bias":
            return "bias"
        if experts and isinstance(mod, torch.nn.Linear) and mod.out_features == experts:
            return "router"
        return "linear"
    if param.dim() == 3:
        return "expert"
    if param.dim() == 2 and experts and "expert" in type(mod).__name__.lower() and param.shape[0] % experts == 0:
        return "expert"  # experts stacked along dim 0 of a 2-D parameter: DBRX's ``DbrxExpertGLU`` w1/v1/w2,
        # (experts * ffn, hidden) each, sliced per expert (transformers 5.24 ``modeling_dbrx.py`` L290-306)
    if param.dim() == 2 and experts and param.shape[0] == experts:
        return "router"  # a router kept as a bare (experts, hidden) parameter
    return "norm"


def profile_of_module(model: Any, model_type: str, architecture: str, summ: dict[str, Any],
                      tf_version: str = "", unused: frozenset[str] = frozenset()) -> Profile:
    """Read the parameters and buffers of a built (meta) model into a Profile; ``unused``: the
    parameters the training step leaves without a gradient (role ``unused``, ``without_gradient``)."""
    stacks = layer_stacks(model, summ)
    modules = dict(model.named_modules())
    first_of, start = {}, 0  # each list's name -> the model-wide number of its first layer
    for prefix, count in stacks:
        first_of[prefix], start = start, start + count
    pat = re.compile("(" + "|".join(re.escape(p) for p, _ in stacks) + r")\.(\d+)\.(.+)$")
    per_layer: dict[int, list[ParamTensor]] = {i: [] for i in range(summ["num_layers"])}
    outer: list[ParamTensor] = []
    seen_layers = False
    for name, p in model.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        mod = modules.get(mod_name)
        role = "unused" if name in unused else _role(mod, pname, p, summ["num_experts"])
        leaf = mod_name.rsplit(".", 1)[-1] if mod_name else ""
        m = pat.match(name)
        if m:
            seen_layers = True
            per_layer[first_of[m.group(1)] + int(m.group(2))].append(ParamTensor(m.group(3), tuple(p.shape), role,
                                                                                  leaf, 0))
        else:
            outer.append(ParamTensor(name, tuple(p.shape), role, leaf, None if seen_layers else -1))
    kinds: dict[str, tuple[ParamTensor, ...]] = {}
    sig_to_kind: dict[tuple, str] = {}
    layer_kinds = []
    for i in range(summ["num_layers"]):
        tensors = tuple(per_layer[i])
        sig = tuple((p.name, p.shape, p.role) for p in tensors)
        if sig not in sig_to_kind:
            sig_to_kind[sig] = f"k{len(sig_to_kind)}"
            kinds[sig_to_kind[sig]] = tensors
        layer_kinds.append(sig_to_kind[sig])
    bufs = []
    for name, b in model.named_buffers():
        dt = {"torch.float32": "float32", "torch.int64": "int64", "torch.bool": "bool", "torch.bfloat16": "bfloat16",
              "torch.float16": "float16"}.get(str(b.dtype), "model")
        bufs.append(BufferTensor(name, tuple(b.shape), dt))
    summ = dict(summ, tie_word_embeddings=not any(p.role != "embedding" and p.layer is None and
                                                  len(p.shape) == 2 and p.shape[0] == summ["vocab_size"]
                                                  for p in outer if p.layer != -1))
    if "image_size" in summ:
        summ["class_tokens"] = image_class_tokens(model, summ)
    return Profile(model_type, architecture, stacks[0][0], summ, tuple(outer), kinds, tuple(layer_kinds), tuple(bufs),
                   tf_version, tuple(stacks) if len(stacks) > 1 else ())
