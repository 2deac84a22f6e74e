"""Build a ModelSpec from a Hugging Face config: catalogue name, config.json, model directory or hub id."""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import sys
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from ..errors import TrainmemError
from .model import ModelSpec

_LLAMA_LIKE = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "mixtral": "mixtral"}
#: derived model types whose layers are also written by hand, for what their one-GPU traces cannot
#: give (tensor parallelism, ``tensor_parallel_twin``): Qwen3 is Llama with per-head q/k norms
HAND_TWINS = ("qwen3",)


# ----- catalogue ---------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _catalogue_files() -> dict[str, str]:
    root = resources.files("trainmem.spec").joinpath("catalogue")
    return {p.name[:-5]: p.name for p in root.iterdir() if p.name.endswith(".json")}


def catalogue_names() -> list[str]:
    """Names of the bundled model configs (work offline)."""
    return sorted(_catalogue_files())


@lru_cache(maxsize=None)
def _catalogue_config(name: str) -> str:
    return resources.files("trainmem.spec").joinpath("catalogue", _catalogue_files()[name]).read_text()


def load_config(model: str) -> tuple[str, dict[str, Any]]:
    """Resolve ``model`` to (display name, raw config dict).

    Order: bundled catalogue name, path to a config.json, model directory with a config.json,
    Hugging Face hub id (``hub_config``: the local hub cache, a catalogue entry of the same name,
    then the network). Something written as a path (``./x``, ``~/x``, ``/x``, ``a/b/c``,
    ``x.json``) that does not exist is "no such file or directory", never a hub lookup.
    """
    if not isinstance(model, str) or not model.strip():
        raise TrainmemError("MODEL is empty: give a catalogue name (see `trainmem models`), a config.json "
                            "path, a model directory or a Hugging Face hub id")
    key = model.strip()
    if key.lower() in _catalogue_files():
        return key.lower(), json.loads(_catalogue_config(key.lower()))
    path = os.path.expanduser(key)
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise TrainmemError(f"model directory {key!r} has no config.json")
        return os.path.basename(os.path.normpath(path)), _read_json(cfg_path)
    if os.path.isfile(path):
        return os.path.splitext(os.path.basename(path))[0], _read_json(path)
    if _HUB_ID.fullmatch(key) and not key.lower().endswith(".json"):
        return key, hub_config(key)
    if key.startswith((".", "/", "~")) or "/" in key or os.sep in key or key.lower().endswith(".json"):
        raise TrainmemError(f"no such file or directory: {key}")
    close = difflib.get_close_matches(key.lower(), catalogue_names(), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise TrainmemError(f"unknown model {model!r}: {hint}not a catalogue name (see `trainmem models`), "
                        f"not a file or directory, not a hub id (owner/name)")


# a hub repo id: owner/name, letters, digits, '-', '_', '.' (huggingface_hub validate_repo_id)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def hf_cache_dir() -> str:
    """The Hugging Face hub cache folder, as huggingface_hub/constants.py finds it: HF_HUB_CACHE,
    else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub. Read at each call (huggingface_hub reads it once, at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.path.expandvars(os.environ[var]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(os.path.expandvars(home)), "hub")


def cached_hub_file(repo_id: str, filename: str = "config.json") -> str | None:
    """``filename`` of hub model ``repo_id`` in the local cache, or None. Layout (huggingface_hub,
    "Understand caching", https://huggingface.co/docs/huggingface_hub/guides/manage-cache):
    ``models--OWNER--NAME/refs/main`` holds the commit whose ``snapshots/COMMIT/`` has the files;
    without that ref, the newest snapshot that has the file."""
    repo = os.path.join(hf_cache_dir(), "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="utf-8") as f:
            path = os.path.join(snapshots, f.read().strip(), filename)
        if os.path.isfile(path):
            return path
    except OSError:
        pass
    try:
        found = [os.path.join(snapshots, d, filename) for d in os.listdir(snapshots)]
    except OSError:
        return None
    found = [p for p in found if os.path.isfile(p)]
    return max(found, key=os.path.getmtime) if found else None


def hub_config(repo_id: str) -> dict[str, Any]:
    """The config of hub model ``repo_id``, without the network when it can: the local hub cache
    first (offline, no HF_HUB_OFFLINE needed); else, when the repo's name is a catalogue name
    (``meta-llama/Llama-3.1-8B`` -> ``llama-3.1-8b``), the bundled copy, with a note saying so
    (reports carry it as a warning: ``model_notes``); else huggingface_hub's download."""
    path = cached_hub_file(repo_id)
    if path is not None:
        return _read_json(path)
    name = repo_id.split("/", 1)[1].lower()
    if name in _catalogue_files():
        cfg = json.loads(_catalogue_config(name))
        extra = dict(cfg.get("_trainmem") or {})
        extra["notes"] = list(extra.get("notes", ())) + [
            f"{repo_id}: using the bundled catalogue entry {name} (the hub's config.json is not in the local "
            f"cache {hf_cache_dir()}; pass a local config.json to use another)"]
        cfg["_trainmem"] = extra
        return cfg
    return _from_hub(repo_id)


def model_notes(model: ModelSpec) -> list[str]:
    """How the model's config was found, one line each, for the report's warnings (e.g. a hub id
    answered by the bundled catalogue entry): ``_trainmem.notes`` of its config."""
    extra = model.config.get("_trainmem") if isinstance(model.config, Mapping) else None
    notes = extra.get("notes", ()) if isinstance(extra, Mapping) else ()
    return [str(n) for n in notes] if isinstance(notes, (list, tuple)) else []


def input_notes(model: ModelSpec | None, hardware: Any = None) -> list[str]:
    """How the inputs were read, for a report's warnings: ``model_notes`` of the model, then the
    GPU's ``Hardware.notes`` (a size without a unit, a GPU ``--gpu auto`` did not find)."""
    return (model_notes(model) if model is not None else []) + list(getattr(hardware, "notes", ()) or ())


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TrainmemError(f"malformed config {path!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise TrainmemError(f"malformed config {path!r}: not UTF-8 text") from None
    except OSError as e:
        raise TrainmemError(f"cannot read config {path!r}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise TrainmemError(f"malformed config {path!r}: expected a JSON object")
    return data


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP check of the hub endpoint, so an offline machine fails at once instead of after
    huggingface_hub's retries. HF_HUB_OFFLINE=1 means offline; a local cache still answers then."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return True  # let huggingface_hub serve from its cache (or raise its offline error)
    import socket
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _from_hub(repo_id: str) -> dict[str, Any]:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise TrainmemError(f"{repo_id!r} looks like a hub id, but huggingface_hub is not installed: "
                            f"pip install huggingface_hub, or pass a local config.json") from None
    if not _hub_reachable():
        raise TrainmemError(f"cannot reach the Hugging Face hub to fetch {repo_id!r}: you seem to be offline; "
                            f"download its config.json and pass the local path")
    try:
        path = hf_hub_download(repo_id, "config.json")
    except Exception as e:  # offline, gated, missing: all end the same way for the user
        kind = type(e).__name__
        raise TrainmemError(f"cannot fetch the config of hub model {repo_id!r} ({kind}); if you are offline "
                            f"or the repo is gated, download its config.json and pass the local path") from None
    return _read_json(path)


# ----- overrides ---------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _bundled_fields() -> dict[str, Any]:
    return json.loads(resources.files("trainmem.spec").joinpath("config_fields.json").read_text())


def config_schema(model_type: str, source: str = "auto") -> tuple[frozenset[str], dict[str, str]]:
    """(standard field names, attribute_map) of ``model_type``'s transformers config class.

    ``attribute_map`` maps a standard name to the one the class stores (GPT2Config: ``num_hidden_layers``
    -> ``n_layer``; transformers/models/gpt2/configuration_gpt2.py ``attribute_map``). ``source``:
    ``transformers`` reads the class (its dataclass fields and ``__init__`` parameters),
    ``bundled`` the table ``config_fields.json`` made from it, ``auto`` the class when transformers
    is already imported (importing it imports torch, seconds), else the table. Fields common to
    every config (``PretrainedConfig``'s) are included; an unknown model_type has none."""
    table = _bundled_fields()
    base = frozenset(table["base"])
    use = source if source != "auto" else ("transformers" if "transformers" in sys.modules else "bundled")
    if use == "transformers":
        try:
            from transformers import CONFIG_MAPPING
            cls = CONFIG_MAPPING[model_type]
        except (ImportError, KeyError):
            cls = None
        if cls is not None:
            names = set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}
            if dataclasses.is_dataclass(cls):
                names |= {f.name for f in dataclasses.fields(cls)}
            return frozenset(names) | base, dict(getattr(cls, "attribute_map", {}) or {})
    fam = table["families"].get(model_type, {})
    return frozenset(fam.get("fields", ())) | base, dict(fam.get("attribute_map", {}))


def _parse_items(overrides: Mapping[str, Any] | list[str]) -> list[tuple[str, Any, str | None]]:
    """(key, value, text) of each override: ``--set`` text parsed as JSON when it parses (else the
    text itself); a Mapping's values as given (text None)."""
    if isinstance(overrides, Mapping):
        return [(str(k).strip(), v, None) for k, v in overrides.items()]
    if isinstance(overrides, str):
        overrides = [overrides]
    items = []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item or not item.split("=", 1)[0].strip():
            raise TrainmemError(f"--set {item!r}: write key=value, e.g. --set num_hidden_layers=4")
        k, v = item.split("=", 1)
        try:
            val: Any = json.loads(v)
        except json.JSONDecodeError:
            val = v
        items.append((k.strip(), val, v))
    return items


# fields spec_from_config reads as flags; a config may leave them out (their default applies)
_BOOL_FIELDS = frozenset({"tie_word_embeddings", "attention_bias", "mlp_bias", "bias"})


def _typed(key: str, value: Any, text: str | None, current: Any, model: str) -> Any:
    """``value`` checked against the type of the config's ``current`` value: an int stays an int
    (2.0 is 2; 2.5 or abc is an error), a float takes any finite number, a bool true or false, a
    string any text, a list or object the same JSON type. No current value: a flag trainmem reads
    (``_BOOL_FIELDS``) must be true or false; anything else is taken as given (``spec_from_config``
    checks what it reads)."""
    shown = text if text is not None else json.dumps(value) if _jsonable(value) else repr(value)
    def fail(expected: str) -> TrainmemError:
        has = f" ({model} has {json.dumps(given)})" if given is not None else ""
        return TrainmemError(f"--set {key}={shown}: {key} must be {expected}{has}")
    given = current
    if current is None and key in _BOOL_FIELDS:
        current = False  # read as a flag by spec_from_config: only true or false make sense
    if current is None:
        return value
    if isinstance(current, bool):
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if isinstance(value, bool):
            return value
        raise fail("true or false")
    if isinstance(current, int):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail("an integer")
    if isinstance(current, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise fail("a finite number")
    if isinstance(current, str):
        if isinstance(value, str):
            return value
        if text is not None:
            return text  # e.g. --set hidden_act=1: the text as written
        raise fail("a string")
    if isinstance(current, (list, dict)) and not isinstance(value, type(current)):
        raise fail("a JSON " + ("list" if isinstance(current, list) else "object"))
    return value


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def apply_overrides(config: dict[str, Any], overrides: Mapping[str, Any] | list[str] | None) -> dict[str, Any]:
    """Apply ``--set key=value`` overrides (values parsed as JSON when they parse, else strings).

    A key is known when the config has it or it is a standard field of the model's transformers
    config class (``config_schema``); a standard name the class stores under another name
    (``attribute_map``: GPT-2's ``num_hidden_layers`` is ``n_layer``) sets the stored one, and
    every spelling the config holds. An unknown key is an error naming the closest known key (a
    config without ``model_type`` has no schema: any key goes); a value is checked against the
    type of the one it replaces (``_typed``)."""
    if not overrides:
        return config
    out = dict(config)
    mtype = str(config.get("model_type") or "")
    fields, amap = config_schema(mtype)
    reverse: dict[str, list[str]] = {}
    for alias, stored in amap.items():
        reverse.setdefault(stored, []).append(alias)
    known = set(config) | fields | set(amap) | set(amap.values())
    for key, value, text in _parse_items(overrides):
        if key not in known and mtype:  # without a model_type there is no schema (spec_from_config says so)
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = (f"did you mean {close[0]}?" if close else
                    f"the nearest known field is {difflib.get_close_matches(key, sorted(known), n=1, cutoff=0)[0]} "
                    f"(the model's config.json lists its fields)")
            raise TrainmemError(f"--set {key}: the {mtype} config has no field {key!r}; {hint}")
        stored = amap.get(key, key)
        spellings = [k for k in dict.fromkeys([stored, key] + reverse.get(stored, [])) if k in out] or [stored]
        current = next((out[k] for k in spellings if out.get(k) is not None), None)
        typed = _typed(key, value, text, current, "the config")
        for k in spellings:
            out[k] = typed
    return out


# ----- parsing -----------------------------------------------------------------------------
def _get(cfg: Mapping[str, Any], name: str, *keys: str, default: Any = None, required: bool = True) -> Any:
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    if required and default is None:
        raise TrainmemError(f"malformed config for {name!r}: missing {keys[0]!r}")
    return default


def _int(cfg: Mapping[str, Any], name: str, *keys: str, default: Any = None) -> int:
    v = _get(cfg, name, *keys, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise TrainmemError(f"malformed config for {name!r}: {keys[0]} must be an integer, got {v!r}")
    if v <= 0:
        raise TrainmemError(f"malformed config for {name!r}: {keys[0]} must be positive, got {v!r}")
    return int(v)


def _float(cfg: Mapping[str, Any], name: str, *keys: str, default: float = 0.0) -> float:
    v = _get(cfg, name, *keys, default=default, required=False)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TrainmemError(f"malformed config for {name!r}: {keys[0]} must be a number, got {v!r}")
    return float(v)


def _head(arch: str, name: str) -> str:
    if arch.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    if arch.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked-lm"
    if arch.endswith("ForSequenceClassification"):
        return "seq-cls"
    if arch.endswith("ForQuestionAnswering"):
        return "qa"
    if arch.endswith("Model"):
        return "base"
    raise TrainmemError(f"model {name!r}: unsupported architecture {arch!r}: trainmem knows causal LM, masked LM, "
                        f"sequence classification, extractive question answering and base models")


def _activation(act: Any, name: str) -> str:
    a = str(act).lower()
    if a.startswith("gelu"):
        return "gelu"
    if a in ("relu",):
        return "relu"
    raise TrainmemError(f"model {name!r}: unsupported hidden activation {act!r}")


def _num_labels(cfg: Mapping[str, Any], name: str) -> int:
    if isinstance(cfg.get("id2label"), dict) and cfg["id2label"]:
        return len(cfg["id2label"])
    return _int(cfg, name, "num_labels", default=2)


def _count(cfg: Mapping[str, Any], name: str, key: str, default: int) -> int:
    """A count that may be zero (e.g. num_local_experts), read strictly: an integer, never a string."""
    v = cfg.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < 0:
        raise TrainmemError(f"malformed config for {name!r}: {key} must be a non-negative integer, got {v!r}")
    return int(v)


def _header(config: Mapping[str, Any], name: str) -> tuple[dict[str, Any], Mapping[str, Any], str, str]:
    """Check the fields every config needs; return (config, its '_trainmem' extras, model_type, architecture)."""
    if not isinstance(config, Mapping):
        raise TrainmemError(f"malformed config for {name!r}: expected a JSON object")
    cfg = dict(config)
    extra = cfg.get("_trainmem", {}) or {}
    if not isinstance(extra, Mapping):
        raise TrainmemError(f"malformed config for {name!r}: '_trainmem' must be a JSON object")
    mtype = cfg.get("model_type")
    if not mtype:
        raise TrainmemError(f"malformed config for {name!r}: missing 'model_type' (e.g. llama, gpt2, bert)")
    if not isinstance(mtype, str):
        raise TrainmemError(f"malformed config for {name!r}: 'model_type' must be a string, got {mtype!r}")
    archs = cfg.get("architectures") or []
    if archs and not isinstance(archs, list):
        raise TrainmemError(f"malformed config for {name!r}: 'architectures' must be a list")
    arch = archs[0] if archs else ""
    if not isinstance(arch, str):
        raise TrainmemError(f"malformed config for {name!r}: 'architectures' must list class names, got {arch!r}")
    return cfg, extra, mtype, arch


def _gpt2_spec(cfg: dict[str, Any], extra: Mapping[str, Any], arch: str, name: str,
               common: dict[str, Any]) -> ModelSpec:
    """GPT-2 configs, and nanoGPT's (no biases) as family ``nanogpt``. ``_trainmem.num_kv_heads``: grouped
    key/value heads on that layer (Megatron-LM's GPT with ``--group-query-attention --num-query-groups N``:
    megatron/core/transformer/attention.py ``SelfAttention``, one fused ``linear_qkv`` of
    ``(heads + 2 * groups) * head_dim`` outputs); transformers' GPT-2 has none, so trace refuses it.
    ``_trainmem.manual_layernorm``: every LayerNorm written in Python ops (Raschka's LLMs-from-scratch
    ``LayerNorm``, ``Builder.layer_norm_manual``); ``_trainmem.causal_mask_buffer``: a (T, T) float32
    mask buffer per layer (nanoGPT's non-flash path, Raschka's ``MultiHeadAttention.mask``);
    ``_trainmem.qkv_bias``: false drops the query/key/value bias alone (Raschka's ``qkv_bias=False``);
    ``_trainmem.separate_qkv``: the query, key and value are three linears on the norm's output, not one
    fused ``c_attn`` (Raschka's ``W_query``, ``W_key``, ``W_value``): the same weights and activations, but under
    autocast each casts its fp32 input to half on its own (``layers._gpt2_layer``)."""
    h = _int(cfg, name, "n_embd", "hidden_size")
    family = extra.get("family") or ("nanogpt" if cfg.get("bias") is False else "gpt2")
    bias = cfg.get("bias", True) is not False
    heads = _int(cfg, name, "n_head", "num_attention_heads")
    return ModelSpec(
        family=family, head=_head(arch or "GPT2LMHeadModel", name),
        num_layers=_int(cfg, name, "n_layer", "num_hidden_layers"), hidden_size=h,
        num_heads=heads, num_kv_heads=_int(extra, name, "num_kv_heads", default=heads),
        vocab_size=_int(cfg, name, "vocab_size"),
        ffn_size=_int(cfg, name, "n_inner", default=4 * h),
        activation=_activation(cfg.get("activation_function", "gelu_new"), name),
        max_positions=_int(cfg, name, "n_positions", "max_position_embeddings", default=1024),
        norm="layernorm", qkv_bias=bool(extra.get("qkv_bias", bias)), out_bias=bias, mlp_bias=bias, norm_bias=bias,
        tied_embeddings=cfg.get("tie_word_embeddings", True), position="learned",
        hidden_dropout=_float(cfg, name, "resid_pdrop", "dropout", default=0.1),
        attention_dropout=_float(cfg, name, "attn_pdrop", "dropout", default=0.1),
        causal_mask_buffer=bool(extra.get("causal_mask_buffer", False)),
        manual_layernorm=bool(extra.get("manual_layernorm", False)),
        separate_qkv=bool(extra.get("separate_qkv", False)), **common)


def _bert_spec(cfg: dict[str, Any], mtype: str, arch: str, name: str, common: dict[str, Any]) -> ModelSpec:
    """BERT (post-norm) and XLM-RoBERTa-XL (pre-norm, family ``roberta-prenorm``)."""
    family = "bert" if mtype == "bert" else "roberta-prenorm"
    return ModelSpec(
        family=family,
        head=_head(arch or ("BertForMaskedLM" if mtype == "bert" else "XLMRobertaXLForMaskedLM"), name),
        num_layers=_int(cfg, name, "num_hidden_layers"), hidden_size=_int(cfg, name, "hidden_size"),
        num_heads=_int(cfg, name, "num_attention_heads"), vocab_size=_int(cfg, name, "vocab_size"),
        ffn_size=_int(cfg, name, "intermediate_size"),
        activation=_activation(cfg.get("hidden_act", "gelu"), name),
        max_positions=_int(cfg, name, "max_position_embeddings", default=512),
        norm="layernorm", qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
        tied_embeddings=cfg.get("tie_word_embeddings", True), position="learned",
        type_vocab_size=_int(cfg, name, "type_vocab_size", default=2),
        hidden_dropout=_float(cfg, name, "hidden_dropout_prob", default=0.1),
        attention_dropout=_float(cfg, name, "attention_probs_dropout_prob", default=0.1),
        pre_norm=family != "bert", embedding_norm=family == "bert", final_norm=family != "bert",
        **common)


def _llama_spec(cfg: dict[str, Any], extra: Mapping[str, Any], mtype: str, arch: str, name: str,
                common: dict[str, Any]) -> ModelSpec:
    """Llama, Mistral, Qwen2 and Mixtral: SwiGLU, RMSNorm, rotary positions, grouped KV heads; and
    Qwen3's tensor-parallel twin (``tensor_parallel_twin``). Qwen3 is Llama with an RMSNorm over ``head_dim`` on every query and key head (transformers 5.24
    ``models/qwen3/modeling_qwen3.py`` L229-230 ``self.q_norm = Qwen3RMSNorm(self.head_dim, ...)``,
    L245-246 ``self.q_norm(self.q_proj(hidden_states).view(hidden_shape))``): ``qk_norm``."""
    family = extra.get("family") or _LLAMA_LIKE[mtype]
    act = str(cfg.get("hidden_act", "silu")).lower()
    if act not in ("silu", "swish"):
        raise TrainmemError(f"model {name!r}: unsupported gated activation {act!r} (trainmem knows SwiGLU/silu)")
    heads = _int(cfg, name, "num_attention_heads")
    h = _int(cfg, name, "hidden_size")
    attn_bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        family=family, head=_head(arch or "LlamaForCausalLM", name),
        num_layers=_int(cfg, name, "num_hidden_layers"), hidden_size=h, num_heads=heads,
        num_kv_heads=_int(cfg, name, "num_key_value_heads", default=heads),
        # without head_dim, ModelSpec derives hidden/heads (and explains when it does not divide)
        head_dim=_int(cfg, name, "head_dim") if cfg.get("head_dim") is not None else None,
        vocab_size=_int(cfg, name, "vocab_size"), ffn_size=_int(cfg, name, "intermediate_size"),
        activation="swiglu",
        max_positions=_int(cfg, name, "max_position_embeddings", default=4096),
        norm="rmsnorm", qkv_bias=attn_bias or mtype == "qwen2", out_bias=attn_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), norm_bias=False,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), position="rotary",
        attention_dropout=_float(cfg, name, "attention_dropout", default=0.0),
        num_experts=_count(cfg, name, "num_local_experts", 0) if mtype == "mixtral" else 0,
        experts_top_k=_count(cfg, name, "num_experts_per_tok", 2) if mtype == "mixtral" else 0,
        qk_norm=mtype == "qwen3", **common)


def _deberta_problem_type(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config``, or, for DeBERTa-v2's sequence classifier of several labels without a ``problem_type``,
    the config with ``single_label_classification`` and a note. Without it the model's loss picks the
    labelled rows with ``(labels >= 0).nonzero()`` (transformers 5.24 ``models/deberta_v2/
    modeling_deberta_v2.py`` L1059-1068), whose size depends on the data and which fake tensors cannot
    trace; with it, ``CrossEntropyLoss`` on every row: the same tensors but for a (batch, labels) gather
    (bytes), as when every label is set (the HF Trainer's classification examples)."""
    archs = config.get("architectures") or []
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) and config["id2label"] \
        else config.get("num_labels", 2)
    if config.get("model_type") != "deberta-v2" or config.get("problem_type") or not isinstance(labels, int) \
            or labels < 2 or archs[:1] != ["DebertaV2ForSequenceClassification"]:
        return config
    out = dict(config, problem_type="single_label_classification")
    extra = dict(out.get("_trainmem") or {})
    extra["notes"] = list(extra.get("notes") or ()) + [
        "DebertaV2ForSequenceClassification without a problem_type: estimated as single_label_classification "
        "(its loss's nonzero() over the labels cannot be traced; the memory differs by a (batch, labels) gather)"]
    out["_trainmem"] = extra
    return out


def spec_from_config(config: Mapping[str, Any], name: str = "model") -> ModelSpec:
    """Parse a Hugging Face ``config.json`` dict into a ModelSpec (a class no task builds: the causal-LM
    class of its type, ``spec.tasks.trainable_class``; a catalogue entry's ``_trainmem.task``: the task it is
    trained on, as ``--task`` gives it, where its class alone does not say: Gemma 3's multimodal entry)."""
    from .tasks import TASK_KEY, trainable_class, with_task
    task = (config.get("_trainmem") or {}).get("task") if isinstance(config.get("_trainmem"), Mapping) else None
    if task and TASK_KEY not in config:
        config = with_task(config, task, name)
    cfg, extra, mtype, arch = _header(_deberta_problem_type(trainable_class(config)), name)
    common: dict[str, Any] = dict(name=name, model_type=mtype, architecture=arch, config=cfg,
                                  num_labels=_num_labels(cfg, name))
    if extra.get("family") == "derived":  # any model type through derived coefficients (spec.profile)
        return _derived_spec(cfg, arch, name, common)
    if mtype == "gpt2":
        return _gpt2_spec(cfg, extra, arch, name, common)
    if mtype in ("bert", "xlm-roberta-xl"):
        return _bert_spec(cfg, mtype, arch, name, common)
    if mtype in _LLAMA_LIKE:
        return _llama_spec(cfg, extra, mtype, arch, name, common)
    return _derived_spec(cfg, arch, name, common)


def _derived_spec(cfg: dict[str, Any], arch: str, name: str, common: dict[str, Any]) -> ModelSpec:
    """Any other model_type: the sizes and tensors transformers builds for it (``spec.profile``:
    shipped for catalogue entries, else built on the meta device with transformers and cached);
    its activations are derived from traces of the real model (``trace.derive``)."""
    from .profile import fingerprint, profile_for
    try:
        prof = profile_for(cfg)
    except TrainmemError as e:
        raise TrainmemError(f"model {name!r}: {e}") from None
    s = prof.summary
    learned = any(p.role == "embedding" and p.layer == -1 and len(p.shape) == 2 and
                  s["max_positions"] <= p.shape[0] <= s["max_positions"] + 2 and p.shape[0] != s["vocab_size"]
                  for p in prof.outer)
    heads, kv = s["num_heads"], s["num_kv_heads"]
    from .tasks import HEAD_OF_TASK
    head = HEAD_OF_TASK[s.get("task", "causal-lm")]
    image = dict(image_size=s["image_size"], patch_size=s["patch_size"], num_channels=s.get("num_channels", 3),
                 class_tokens=s.get("class_tokens", 0)) if head == "image-cls" else {}
    if head == "speech-seq2seq":  # Whisper: the log-mel input and the encoder's fixed length (profile.summary)
        image = dict(mel_bins=s["mel_bins"], source_positions=s["source_positions"])
    return ModelSpec(
        family="derived", head=head, num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        decoder_layers=s.get("decoder_layers", 0), **image,
        num_heads=heads, num_kv_heads=kv if kv and heads % kv == 0 else heads,
        head_dim=s["head_dim"] or max(1, s["hidden_size"] // heads), vocab_size=s["vocab_size"],
        ffn_size=s["ffn_size"], activation="gelu", max_positions=s["max_positions"],
        tied_embeddings=s["tie_word_embeddings"], position=_derived_position(cfg, learned),
        num_experts=s["num_experts"], experts_top_k=s["experts_top_k"] if s["num_experts"] else 0,
        fingerprint=fingerprint(cfg), **dict(common, architecture=prof.architecture))


#: model types whose attention bias is built once for the config's whole context and sliced to the
#: sequence, so that a longer sequence fails to broadcast: MPT's ALiBi (transformers
#: models/mpt/modeling_mpt.py, ``MptModel.forward`` builds ``build_mpt_alibi_tensor(num_heads,
#: config.max_seq_len)``; ``MptAttention.forward`` slices its last ``key_length`` columns)
_BIAS_TABLE_TYPES = ("mpt",)


def _derived_position(cfg: dict[str, Any], learned: bool) -> str:
    """A derived model's positions: "learned" (a table of learned embeddings), "bias-table" (an
    attention bias as long as the context, ``_BIAS_TABLE_TYPES``), else "rotary" (any scheme that
    runs at any length: rotary, relative buckets, ALiBi built per sequence as BLOOM's)."""
    if learned:
        return "learned"
    return "bias-table" if cfg.get("model_type") in _BIAS_TABLE_TYPES else "rotary"


def tensor_parallel_twin(m: ModelSpec, tp: int, cp: int = 1) -> ModelSpec:
    """The model as the estimate runs it under ``--tp``: a derived Qwen3 (dense, without sliding
    layers) becomes its hand-written Llama-family twin with ``qk_norm`` (``_llama_spec``), whose
    formulas split the heads per rank as the Llama tensor-parallel path does; its one-GPU traced
    coefficients (``estimate/derived.py``) cannot, since the traced layer is one GPU's whole layer.
    Back at ``tp`` 1 the twin becomes the derived model again: the one-GPU estimate keeps the
    coefficients its measured runs were checked with (tests/test_measured_gpu.py). Sizes the config
    leaves to transformers' defaults are the derived spec's (read off the model transformers builds).
    Any other model is returned as it is."""
    if tp > 1 and cp == 1 and m.family == "derived" and m.model_type in HAND_TWINS and not m.num_experts \
            and not m.config.get("use_sliding_window"):
        sizes = dict(num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                     num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
                     intermediate_size=m.ffn_size, max_position_embeddings=m.max_positions,
                     tie_word_embeddings=m.tied_embeddings)
        cfg = {**sizes, **{k: v for k, v in m.config.items() if v is not None}}
        common = dict(name=m.name, model_type=m.model_type, architecture=m.architecture, config=m.config,
                      num_labels=m.num_labels)
        return dataclasses.replace(_llama_spec(cfg, {"family": "llama"}, m.model_type, m.architecture, m.name, common), head=m.head)
    if tp == 1 and m.family != "derived" and m.model_type in HAND_TWINS:
        return spec_from_config(m.config, m.name)
    return m


def resolve_model(model: "str | ModelSpec | Mapping[str, Any]",
                  overrides: Mapping[str, Any] | list[str] | None = None, task: str | None = None) -> ModelSpec:
    """A ModelSpec from whatever the user gave: spec, config dict, name, path or hub id; with
    ``task``, the class transformers has for that task (``spec.tasks.with_task``)."""
    if task is not None:
        from .tasks import with_task
        base = resolve_model(model, overrides)
        cfg = with_task(dict(base.config), task, base.name)
        return base if cfg == dict(base.config) else _cached_spec(base.name, json.dumps(cfg, sort_keys=True))
    if isinstance(model, ModelSpec):
        if overrides:
            return spec_from_config(apply_overrides(dict(model.config), overrides), model.name)
        return model
    if isinstance(model, Mapping):
        return spec_from_config(apply_overrides(dict(model), overrides), "model")
    if isinstance(model, str) and model.strip().lower() in _catalogue_files() and \
            (overrides is None or isinstance(overrides, (list, tuple))):
        return _catalogue_spec(model.strip().lower(), tuple(overrides or ()))
    name, cfg = load_config(model)
    return _cached_spec(name, json.dumps(apply_overrides(cfg, overrides), sort_keys=True))


@lru_cache(maxsize=1024)
def _catalogue_spec(name: str, overrides: tuple[str, ...]) -> ModelSpec:
    """Catalogue entries are immutable: parse each (name, overrides) once."""
    _, cfg = load_config(name)
    return spec_from_config(apply_overrides(cfg, list(overrides)), name)


@lru_cache(maxsize=256)
def _cached_spec(name: str, cfg_json: str) -> ModelSpec:
    return spec_from_config(json.loads(cfg_json), name)
