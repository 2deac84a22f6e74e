"""A heterogeneous transformers config (``integrations/heterogeneity``: ``per_layer_config`` overrides by layer
index, whose global attributes raise ``AmbiguousGlobalPerLayerAttributeError`` when read): Gemma 4's text model,
whose full-attention layers have wider heads. The summary takes a per-layer size's largest value
(``spec.profile._config_value``) and the derivation's cut model keeps the overrides of its own layers
(``trace.derive._cut``); the estimate then agrees with a trace of the real model."""
import json

import pytest

transformers = pytest.importorskip("transformers")
if "gemma4_text" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
    pytest.skip("this transformers has no Gemma 4", allow_module_level=True)

from trainmem import estimate  # noqa: E402
from trainmem.spec.profile import summary  # noqa: E402
from trainmem.trace.api import trace  # noqa: E402
from trainmem.trace.derive import _cut  # noqa: E402

LAYERS = 6
SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size_per_layer_input=16, num_hidden_layers=LAYERS,
             sliding_window=64, layer_types=["sliding_attention"] * 5 + ["full_attention"],
             per_layer_config={"5": {"head_dim": 64}})


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    cfg = transformers.AutoConfig.for_model("gemma4_text", **SMALL).to_dict()
    cfg["architectures"] = ["Gemma4ForCausalLM"]
    path = tmp_path_factory.mktemp("gemma4") / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_summary_reads_the_largest_per_layer_value():
    cfg = transformers.AutoConfig.for_model("gemma4_text", **SMALL)
    assert summary(cfg)["head_dim"] == 64   # layer 5's override, not the sliding layers' 32


def test_the_cut_model_keeps_the_overrides_of_its_layers_only():
    cut = _cut({"num_hidden_layers": LAYERS, "per_layer_config": {"1": {"head_dim": 64}, "5": {"head_dim": 64}}},
               LAYERS, 3)
    assert cut["per_layer_config"] == {"1": {"head_dim": 64}} and cut["num_hidden_layers"] == 3


def test_gemma4_estimate_agrees_with_its_trace(config_path):
    kw = dict(batch_size=2, seq_len=256, precision="bf16-amp", gpu="h100")
    est, traced = estimate(config_path, **kw), trace(config_path, **kw)
    assert abs(est.peak_allocated - traced.peak_allocated) < 0.01 * traced.peak_allocated
