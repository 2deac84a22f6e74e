"""Build a ModelSpec from a Hugging Face config: catalogue name, config.json, model directory or hub id."""
from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from ..errors import TrainmemError
from .model import ModelSpec

_LLAMA_LIKE = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "mixtral": "mixtral"}


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
    Hugging Face hub id (needs huggingface_hub and network).
    """
    if not isinstance(model, str) or not model.strip():
        raise TrainmemError("MODEL is empty: give a catalogue name (see `trainmem models`), a config.json "
                            "path, a model directory or a Hugging Face hub id")
    key = model.strip()
    if key.lower() in _catalogue_files():
        return key.lower(), json.loads(_catalogue_config(key.lower()))
    if os.path.isdir(key):
        path = os.path.join(key, "config.json")
        if not os.path.isfile(path):
            raise TrainmemError(f"model directory {key!r} has no config.json")
        return os.path.basename(os.path.normpath(key)), _read_json(path)
    if os.path.isfile(key):
        return os.path.splitext(os.path.basename(key))[0], _read_json(key)
    if "/" in key and not key.startswith((".", "/")) and key.count("/") == 1:
        return key, _from_hub(key)
    raise TrainmemError(f"unknown model {model!r}: not a catalogue name (see `trainmem models`), "
                        f"not a file or directory, not a hub id (owner/name)")


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
def apply_overrides(config: dict[str, Any], overrides: Mapping[str, Any] | list[str] | None) -> dict[str, Any]:
    """Apply ``--set key=value`` overrides (values parsed as JSON when they parse, else strings)."""
    if not overrides:
        return config
    out = dict(config)
    items: list[tuple[str, Any]] = []
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        for item in overrides:
            if "=" not in item or not item.split("=", 1)[0].strip():
                raise TrainmemError(f"--set {item!r}: write key=value, e.g. --set num_hidden_layers=4")
            k, v = item.split("=", 1)
            try:
                val: Any = json.loads(v)
            except json.JSONDecodeError:
                val = v
            items.append((k.strip(), val))
    for k, v in items:
        out[k] = v
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
    if arch.endswith("Model"):
        return "base"
    raise TrainmemError(f"model {name!r}: unsupported architecture {arch!r}: trainmem knows causal LM, masked LM, "
                        f"sequence classification and base models")


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
    """GPT-2 configs, and nanoGPT's (no biases) as family ``nanogpt``."""
    h = _int(cfg, name, "n_embd", "hidden_size")
    family = extra.get("family") or ("nanogpt" if cfg.get("bias") is False else "gpt2")
    bias = cfg.get("bias", True) is not False
    return ModelSpec(
        family=family, head=_head(arch or "GPT2LMHeadModel", name),
        num_layers=_int(cfg, name, "n_layer", "num_hidden_layers"), hidden_size=h,
        num_heads=_int(cfg, name, "n_head", "num_attention_heads"),
        vocab_size=_int(cfg, name, "vocab_size"),
        ffn_size=_int(cfg, name, "n_inner", default=4 * h),
        activation=_activation(cfg.get("activation_function", "gelu_new"), name),
        max_positions=_int(cfg, name, "n_positions", "max_position_embeddings", default=1024),
        norm="layernorm", qkv_bias=bias, out_bias=bias, mlp_bias=bias, norm_bias=bias,
        tied_embeddings=cfg.get("tie_word_embeddings", True), position="learned",
        hidden_dropout=_float(cfg, name, "resid_pdrop", "dropout", default=0.1),
        attention_dropout=_float(cfg, name, "attn_pdrop", "dropout", default=0.1),
        causal_mask_buffer=bool(extra.get("causal_mask_buffer", False)), **common)


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
    """Llama, Mistral, Qwen2 and Mixtral: SwiGLU, RMSNorm, rotary positions, grouped KV heads."""
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
        **common)


def spec_from_config(config: Mapping[str, Any], name: str = "model") -> ModelSpec:
    """Parse a Hugging Face ``config.json`` dict into a ModelSpec."""
    cfg, extra, mtype, arch = _header(config, name)
    common: dict[str, Any] = dict(name=name, model_type=mtype, architecture=arch, config=cfg,
                                  num_labels=_num_labels(cfg, name))
    if mtype == "gpt2":
        return _gpt2_spec(cfg, extra, arch, name, common)
    if mtype in ("bert", "xlm-roberta-xl"):
        return _bert_spec(cfg, mtype, arch, name, common)
    if mtype in _LLAMA_LIKE:
        return _llama_spec(cfg, extra, mtype, arch, name, common)
    raise TrainmemError(f"model {name!r}: unsupported model_type {mtype!r} (trainmem knows gpt2, bert, "
                        f"xlm-roberta-xl, llama, mistral, qwen2, mixtral)")


def resolve_model(model: "str | ModelSpec | Mapping[str, Any]",
                  overrides: Mapping[str, Any] | list[str] | None = None) -> ModelSpec:
    """A ModelSpec from whatever the user gave: spec, config dict, name, path or hub id."""
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
