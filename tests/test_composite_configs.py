"""A vision-language checkpoint's config trained as text (Qwen3.5's hub configs name
``Qwen3_5ForConditionalGeneration``; TRL and the HF Trainer load them with ``AutoModelForCausalLM``, which builds
``Qwen3_5ForCausalLM`` from the composite config's text config): ``spec.tasks.trainable_class`` and
``spec.profile.config_for_class``."""
import json

import pytest

transformers = pytest.importorskip("transformers")
if "qwen3_5" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
    pytest.skip("this transformers has no Qwen3.5", allow_module_level=True)

from trainmem.spec.config import resolve_model  # noqa: E402
from trainmem.spec.profile import config_for_class  # noqa: E402
from trainmem.trace.api import trace  # noqa: E402

TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=1024, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32)


@pytest.fixture(scope="module")
def composite():
    cfg = transformers.AutoConfig.for_model("qwen3_5", text_config=TEXT).to_dict()
    cfg["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def test_the_text_class_is_built_from_the_text_config(composite):
    cfg = transformers.AutoConfig.for_model("qwen3_5", text_config=TEXT)
    assert isinstance(config_for_class(transformers.Qwen3_5ForCausalLM, cfg), transformers.Qwen3_5TextConfig)
    assert config_for_class(transformers.Qwen3_5ForConditionalGeneration, cfg) is cfg


def test_a_vision_language_class_is_trained_as_the_causal_lm_with_a_note(composite, tmp_path):
    m = resolve_model(composite)
    assert m.architecture == "Qwen3_5ForCausalLM" and m.head == "causal-lm"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(composite))
    r = trace(str(path), batch_size=1, seq_len=128, precision="bf16-amp")
    assert any("Qwen3_5ForConditionalGeneration is no class trainmem trains" in w for w in r.warnings)
    # the text model's parameters only, no vision tower: as many as Qwen3_5ForCausalLM has
    import torch
    with torch.device("meta"):
        text_model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT))
    assert sum(p.numel() for p in text_model.parameters()) == sum(t.numel for t in m.parameter_tensors())
