"""Loading model configs: catalogue name, config.json path, model directory, hub id; overrides;
malformed configs fail with a TrainmemError that names the problem."""
from __future__ import annotations

import json

import pytest

import trainmem
from trainmem import TrainmemError
from trainmem.spec import apply_overrides, load_config, resolve_model, spec_from_config

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 1000, "max_position_embeddings": 256, "tie_word_embeddings": False,
}
# embed + lm_head + final norm, and per layer q, k, v, o, gate, up, down and two norms
TINY_LLAMA_PARAMS = 2 * 1000 * 64 + 64 + 3 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 176 + 2 * 64)


def _write(path, data) -> str:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


# ----- where a config comes from ---------------------------------------------------------
def test_tiny_llama_count_by_hand():
    assert resolve_model(dict(TINY_LLAMA)).num_params == TINY_LLAMA_PARAMS


@pytest.mark.parametrize("given", ["llama-3.1-8b", "Llama-3.1-8B", "  llama-3.1-8b "])
def test_load_by_catalogue_name(given):
    name, cfg = load_config(given)
    assert name == "llama-3.1-8b"
    assert cfg["hidden_size"] == 4096 and cfg["model_type"] == "llama"
    spec = resolve_model(given)
    assert (spec.name, spec.num_layers, spec.num_kv_heads) == ("llama-3.1-8b", 32, 8)


def test_load_by_config_path(tmp_path):
    path = _write(tmp_path / "my-tiny.json", TINY_LLAMA)
    spec = resolve_model(path)
    assert spec.name == "my-tiny"
    assert spec.num_params == TINY_LLAMA_PARAMS
    assert spec.config["num_hidden_layers"] == 3


@pytest.mark.parametrize("trailing", ["", "/"])
def test_load_by_model_directory(tmp_path, trailing):
    d = tmp_path / "tiny-llama"
    d.mkdir()
    _write(d / "config.json", TINY_LLAMA)
    spec = resolve_model(str(d) + trailing)
    assert spec.name == "tiny-llama"
    assert spec.num_params == TINY_LLAMA_PARAMS


def test_catalogue_file_and_copy_agree(tmp_path):
    """The same config through a file gives the same spec as the catalogue name."""
    _, cfg = load_config("qwen2.5-0.5b")
    by_file = resolve_model(_write(tmp_path / "q.json", cfg))
    by_name = resolve_model("qwen2.5-0.5b")
    assert by_file.num_params == by_name.num_params == 494_032_768
    assert by_file == spec_from_config(cfg, "q")


def test_directory_without_config(tmp_path):
    d = tmp_path / "empty-model"
    d.mkdir()
    with pytest.raises(TrainmemError, match=r"empty-model.*has no config\.json"):
        load_config(str(d))


def test_hub_id_offline_says_pass_a_local_config(monkeypatch, tmp_path):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import; pin them so no cache or network is consulted
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(TrainmemError) as err:
        resolve_model("trainmem-tests/no-such-model")
    msg = str(err.value)
    assert "trainmem-tests/no-such-model" in msg
    assert "config.json" in msg and "local" in msg


@pytest.mark.parametrize("given", ["no-such-model", "llama-9"])  # paths: tests/test_inputs.py
def test_unknown_name(given):
    with pytest.raises(TrainmemError, match="unknown model") as err:
        resolve_model(given)
    assert repr(given) in str(err.value)
    assert "trainmem models" in str(err.value)


@pytest.mark.parametrize("given", ["", "   "])
def test_empty_name(given):
    with pytest.raises(TrainmemError, match="MODEL is empty"):
        resolve_model(given)


# ----- overrides -------------------------------------------------------------------------
def test_overrides_change_the_spec_and_not_the_catalogue():
    full = resolve_model("llama-3.1-8b")
    small = resolve_model("llama-3.1-8b", overrides=["num_hidden_layers=4"])
    assert small.num_layers == 4
    assert small.num_params == full.embedding_params + 4 * full.layer_params
    assert small.config["num_hidden_layers"] == 4
    again = resolve_model("llama-3.1-8b")
    assert again.num_layers == 32 and load_config("llama-3.1-8b")[1]["num_hidden_layers"] == 32


def test_override_values_are_parsed_as_json():
    cfg = {"a": 1}
    out = apply_overrides(cfg, ["n=4", "f=0.5", "t=true", "s=silu", "l=[1, 2]", " k = null", "e=a=b"])
    assert out == {"a": 1, "n": 4, "f": 0.5, "t": True, "s": "silu", "l": [1, 2], "k": None, "e": "a=b"}
    assert cfg == {"a": 1}  # the input is not changed


def test_override_mapping_and_spec():
    tied = resolve_model("llama-3.1-8b", overrides={"tie_word_embeddings": True})
    untied = resolve_model("llama-3.1-8b")
    assert tied.tied_embeddings and not untied.tied_embeddings
    assert untied.num_params - tied.num_params == 128256 * 4096
    # overriding a spec re-parses its config
    spec = resolve_model(dict(TINY_LLAMA))
    wider = resolve_model(spec, overrides=["vocab_size=2000"])
    assert wider.num_params - spec.num_params == 2 * 1000 * 64
    assert resolve_model(spec) is spec


@pytest.mark.parametrize("item", ["num_hidden_layers", "=4", " =4"])
def test_malformed_override(item):
    with pytest.raises(TrainmemError, match="key=value"):
        resolve_model("gpt2", overrides=[item])


def test_override_can_make_a_config_invalid():
    with pytest.raises(TrainmemError, match="num_hidden_layers must be positive"):
        resolve_model("llama-3.1-8b", overrides=["num_hidden_layers=0"])


# ----- malformed configs ------------------------------------------------------------------
def test_invalid_json_file(tmp_path):
    path = _write(tmp_path / "broken.json", '{"model_type": "llama", "hidden_size": 64,')
    with pytest.raises(TrainmemError, match=r"broken\.json.*not valid JSON"):
        resolve_model(path)


def test_json_that_is_not_an_object(tmp_path):
    path = _write(tmp_path / "list.json", "[1, 2, 3]")
    with pytest.raises(TrainmemError, match="expected a JSON object"):
        resolve_model(path)


def _bad(**change):
    cfg = dict(TINY_LLAMA, **change)
    return {k: v for k, v in cfg.items() if v is not ...}


@pytest.mark.parametrize("cfg,message", [
    (_bad(model_type=...), r"missing 'model_type'"),
    (_bad(hidden_size="64"), r"hidden_size must be an integer, got '64'"),
    (_bad(hidden_size=64.5), r"hidden_size must be an integer, got 64\.5"),
    (_bad(hidden_size=True), r"hidden_size must be an integer"),
    (_bad(num_hidden_layers=-2), r"num_hidden_layers must be positive, got -2"),
    (_bad(vocab_size=...), r"missing 'vocab_size'"),
    (_bad(hidden_size=66), r"hidden_size 66 is not divisible by num_attention_heads 4; set head_dim"),
    (_bad(num_key_value_heads=3), r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (_bad(model_type="no_such_arch"), r"unsupported model_type 'no_such_arch': transformers .* does not know it"),
    (_bad(architectures=["LlamaForTokenClassification"]), r"unsupported architecture 'LlamaForTokenClassification'"),
    (_bad(architectures="LlamaForCausalLM"), r"'architectures' must be a list"),
    (_bad(hidden_act="gelu"), r"unsupported gated activation 'gelu'"),
    (_bad(attention_dropout=1.5), r"attention_dropout must be in \[0, 1\)"),
])
def test_malformed_config(tmp_path, cfg, message):
    path = _write(tmp_path / "bad-model.json", cfg)
    with pytest.raises(TrainmemError, match=message) as err:
        resolve_model(path)
    assert "bad-model" in str(err.value)  # names the model it is about


def test_head_dim_allows_indivisible_hidden():
    spec = resolve_model(_bad(hidden_size=66, head_dim=16))
    assert (spec.head_dim, spec.q_size, spec.kv_size) == (16, 64, 32)


@pytest.mark.parametrize("cfg,message", [
    ({"model_type": "gpt2", "n_embd": 100, "n_head": 12, "n_layer": 2, "vocab_size": 10},
     r"hidden_size 100 is not divisible by num_attention_heads 12"),
    ({"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 0,
      "intermediate_size": 256, "vocab_size": 10}, r"num_hidden_layers must be positive, got 0"),
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 10,
      "activation_function": "tanh"}, r"unsupported hidden activation 'tanh'"),
])
def test_malformed_other_families(cfg, message):
    with pytest.raises(TrainmemError, match=message):
        spec_from_config(cfg, "odd")


def test_trainmem_error_is_a_value_error():
    with pytest.raises(ValueError):
        trainmem.resolve_model("no-such-model")
