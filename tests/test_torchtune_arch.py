"""torchtune's own attention on models with grouped-query heads (Qwen2/2.5, Mistral, Llama 3.x):
``--framework torchtune`` counts the K and V copies ``MultiHeadAttention.forward`` makes.

Every torchtune release copies K and V to the query's heads before SDPA when ``num_heads !=
num_kv_heads`` (``torchtune/modules/attention.py`` L288-291 at v0.6.1, ``k.unsqueeze(2).expand(
expand_shape).flatten(1, 2)``), and the kernel saves the copies. Traced with torchtune 0.6.1's own
``qwen2`` layer on the CPU (saved-tensor hooks, docs/validation.md 2026-11-25), the K/V it saves per
token are 2 x 14 x 64 x 2 B = 3,584 B where transformers' ``Qwen2DecoderLayer`` saves 2 x 2 x 64 x 2
= 512 B: 3,072 B more, which is 2 x (heads - kv_heads) x head_dim half values. The preset sets
``attention_call repeat-kv`` (``spec.frameworks._repeats_kv``), which charges exactly that."""
import pytest

import trainmem
from trainmem.spec.resolve import resolve

SETUP = dict(batch_size=2, seq_len=1024, gpu="h100-80gb")


def test_torchtune_preset_repeats_kv_on_grouped_query_models():
    """Qwen2.5-0.5B (14 query heads, 2 key/value heads of 64) and Mistral-7B (32/8 of 128): repeat-kv."""
    for name in ("qwen2.5-0.5b", "mistral-7b"):
        assert resolve(name, framework="torchtune", **SETUP).training.attention_call == "repeat-kv"


def test_torchtune_preset_leaves_mha_derived_and_given_calls():
    """Llama-2-7B has as many key/value heads as query heads (nothing is copied); Phi-3-mini and
    Qwen3 are derived (transformers' traced layers); an explicit --attention-call model is kept;
    tensor parallelism does not run that call."""
    assert resolve("llama-2-7b", framework="torchtune", **SETUP).training.attention_call == "model"
    assert resolve("qwen3-0.6b", framework="torchtune", **SETUP).training.attention_call == "model"
    assert resolve("qwen2.5-0.5b", framework="torchtune", attention_call="model",
                   **SETUP).training.attention_call == "model"
    assert resolve("qwen2.5-7b", framework="torchtune", tp=2, **SETUP).training.attention_call == "model"


@pytest.mark.parametrize("name, layers, heads, kv, head_dim", [("qwen2.5-0.5b", 24, 14, 2, 64),
                                                                 ("mistral-7b", 32, 32, 8, 128)])
def test_torchtune_activations_count_the_kv_copies(name, layers, heads, kv, head_dim):
    """Per layer, activations with the preset minus with transformers' call = tokens x 2 x (heads -
    kv_heads) x head_dim x 2 B (bf16): the copies torchtune's layer saves; at a forward peak (Qwen2.5-0.5B:
    its logits chunks) the peak rises by them times the layers, no recompute."""
    tt = trainmem.estimate(name, framework="torchtune", **SETUP)
    hf = trainmem.estimate(name, framework="torchtune", attention_call="model", **SETUP)
    tokens = SETUP["batch_size"] * SETUP["seq_len"]
    copies = tokens * 2 * (heads - kv) * head_dim * 2
    assert tt.extra["activations_per_layer"] - hf.extra["activations_per_layer"] == copies
    if tt.peak_phase.startswith("forward"):
        assert tt.peak_allocated - hf.peak_allocated == layers * copies
