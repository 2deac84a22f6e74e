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
from trainmem.allocator_rules import block_bytes
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


def test_torchtune_gemma2_caps_the_hidden_state_not_the_logits():
    """torchtune's ``Gemma2FinalNorm`` soft-caps the normed (b, s, hidden) state before the output
    projection; transformers' ``Gemma2ForCausalLM`` caps the (b, s, vocab) logits, whose tanh result
    the derived head side measured. Under --framework torchtune the head side trades that bf16
    logits-sized tensor for a bf16 hidden-sized one, and no chunk frees a capped copy
    (``quantities.head_grads.torchtune_cap_bytes``, ``softcap_saved``). Traced with torchtune 0.6.1's own
    ``gemma2`` (2 layers of Gemma-2-2B, 2 x 1024, full_finetune step) the estimate went from +7.69 %
    to -0.14 % of it (docs/validation.md, 2026-11-25)."""
    import dataclasses

    from trainmem.estimate.quantities.build import quantities

    r = resolve("gemma-2-2b", framework="torchtune", **SETUP)
    m, tt = r.model, r.training
    plain = dataclasses.replace(tt, extra={})   # the same options, not torchtune's model code
    q_tt, q_hf = quantities(m, tt), quantities(m, plain)
    assert q_tt.outer_head_tok - q_hf.outer_head_tok == m.hidden_size * 2 - m.vocab_size * 2
    assert (q_tt.softcap_saved, q_hf.softcap_saved) == (0, 2)


def test_torchtune_cap_only_for_gemma2():
    """Models without a final logit soft-cap, or other frameworks, keep transformers' head side."""
    import dataclasses

    from trainmem.spec.frameworks import caps_hidden_not_logits

    r = resolve("gemma-2-2b", framework="torchtune", **SETUP)
    assert caps_hidden_not_logits(r.model, r.training)
    assert not caps_hidden_not_logits(r.model, dataclasses.replace(r.training, extra={}))
    q = resolve("qwen3-0.6b", framework="torchtune", **SETUP)
    assert not caps_hidden_not_logits(q.model, q.training)


def test_torchtune_gemma2_trace_caps_the_hidden_state_as_the_estimate():
    """trace runs transformers' Gemma-2 with torchtune's chunked loop: under --framework torchtune the
    loop caps the final hidden state once (``workload._chunked_output``, ``cap_hidden``), so no chunk
    saves a logits-sized tanh; trace and estimate agree (2 layers, 1 x 256). Both matched torchtune
    0.6.1's own model traced at 2 x 1024 to 0.14 % (docs/validation.md, 2026-11-25)."""
    from trainmem.trace import trace

    opts = dict(framework="torchtune", batch_size=1, seq_len=256, gpu="h100-80gb", set={"num_hidden_layers": 2})
    t = trace("gemma-2-2b", **opts)
    e = trainmem.estimate("gemma-2-2b", **opts)
    assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.005
    fwd = t.phase("forward", 1).allocated - t.phase("model_loaded", 0).allocated
    hf = trace("gemma-2-2b", **{**opts, "framework": None, "loss": "chunked", "loss_chunks": 8, "precision": "bf16",
                                 "optimizer_impl": "fused", "zero_grad": "none", "hold_output": "loss", "use_cache": False})
    fwd_hf = hf.phase("forward", 1).allocated - hf.phase("model_loaded", 0).allocated
    m = resolve("gemma-2-2b", **opts).model
    # the 8 chunks' logits-sized tanh (32 x vocab, bf16) in place of one hidden-sized tanh (256 x hidden),
    # each in the caching allocator's blocks; within 1 MiB (the chunks' other transients)
    expected = 8 * block_bytes(32 * m.vocab_size * 2, False) - block_bytes(256 * m.hidden_size * 2, False)
    assert abs((fwd_hf - fwd) - expected) <= 2**20, (fwd_hf - fwd, expected)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "mistral-7b"])
def test_torchtune_05_06_rms_norm_saves_its_fp32_product(name):
    """torchtune 0.5.0-0.6.1's RMSNorm is ``F.rms_norm(x.float(), weight=scale).to(x.dtype)``: the
    weight's multiply saves the fp32 normalized tensor (4 B) where the Python ops of 0.4 (and
    transformers) save its bf16 cast (2 B). Per layer (two norms), 2 x 2 B x hidden per token more at
    the preset's 0.6.1 than at --framework-version 0.4.0; traced with torchtune 0.6.1's own ``qwen2``
    layer the difference is 1,792 B per norm and token at hidden 896 (docs/validation.md)."""
    new = trainmem.estimate(name, framework="torchtune", **SETUP)
    old = trainmem.estimate(name, framework="torchtune", framework_version="0.4.0", **SETUP)
    h = resolve(name, **SETUP).model.hidden_size
    tokens = SETUP["batch_size"] * SETUP["seq_len"]
    assert new.extra["activations_per_layer"] - old.extra["activations_per_layer"] == tokens * 2 * 2 * h


def test_torchtune_rms_norm_only_for_its_own_norm_and_releases():
    """Gemma (its own norm) and derived models keep transformers' norm; 0.4 and older too; a release
    the preset does not know is refused in one line."""
    from trainmem.errors import TrainmemError
    from trainmem.spec.frameworks import torchtune_norm_saves_fp32

    r = resolve("mistral-7b", framework="torchtune", **SETUP)
    assert torchtune_norm_saves_fp32(r.model, r.training)
    assert not torchtune_norm_saves_fp32(*_mt("mistral-7b", framework_version="0.4"))
    assert torchtune_norm_saves_fp32(*_mt("mistral-7b", framework_version="0.5.0"))
    assert not torchtune_norm_saves_fp32(*_mt("gemma-2-2b"))
    with pytest.raises(TrainmemError, match="framework-version"):
        resolve("mistral-7b", framework="torchtune", framework_version="0.7", **SETUP)


def _mt(name, **options):
    r = resolve(name, framework="torchtune", **options, **SETUP)
    return r.model, r.training


def test_torchtune_rms_norm_trace_runs_it_as_the_estimate_counts_it():
    """trace swaps the model's RMSNorm forward for torchtune's ``F.rms_norm`` (``workload.torchtune_rms_norms``)
    at 0.5-0.6.1 and not at 0.4: the two traces' forward differs by the norms' fp32 products, and each
    agrees with its estimate. (2 layers of Qwen2.5-0.5B at 1 x 256; at 2 x 1024 the trace came within
    0.02 % of torchtune 0.6.1's own ``qwen2`` model, Mistral-7B within 0.02 % of its ``mistral``.)"""
    from trainmem.trace import trace

    opts = dict(framework="torchtune", batch_size=1, seq_len=256, gpu="h100-80gb", set={"num_hidden_layers": 2})
    new, old = trace("qwen2.5-0.5b", **opts), trace("qwen2.5-0.5b", framework_version="0.4.0", **opts)
    for t, version in ((new, None), (old, "0.4.0")):
        e = trainmem.estimate("qwen2.5-0.5b", framework_version=version, **opts)
        assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.005
    fwd = [t.phase("forward", 1).allocated - t.phase("model_loaded", 0).allocated for t in (new, old)]
    h = 896
    norms = 2 * 2 + 1   # two per layer and the final norm, each 2 B x hidden per token more
    assert abs((fwd[0] - fwd[1]) - norms * 256 * 2 * h) <= 2**20, fwd
