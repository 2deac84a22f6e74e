"""``--lora-qkv``: lit-gpt's ``LoRAQKVLinear`` on a model's own fused ``query_key_value`` with only some
parts adapted (lit_gpt/lora.py at 8641822; litgpt/lora.py at 43c44323): its adapter sizes and the
zero-padded delta ``index_copy`` keeps until the layer's backward (``quantities.layer_terms.lora_qkv_kept``)."""
from __future__ import annotations

import pytest

import trainmem
from trainmem.estimate.states import _lora_tensors

NEOX = dict(model_type="gpt_neox", num_hidden_layers=4, hidden_size=1024, intermediate_size=4096,
            num_attention_heads=8, vocab_size=2048, use_cache=False)
#: Falcon-7B's shape, cut: 71 query heads of 64, one key/value head (multi-query), a (4544 + 2 x 64)-row fused linear
FALCON = dict(model_type="falcon", num_hidden_layers=2, hidden_size=4544, num_attention_heads=71, multi_query=True,
              new_decoder_architecture=False, parallel_attn=True, vocab_size=2048, use_cache=False)
SETUP = dict(batch_size=2, seq_len=512, precision="bf16", lora_rank=8, lora_targets="query_key_value",
             lora_dtype="half", lora_dropout=0.05, loss="half", optimizer="adamw")


def test_zero_padded_delta_is_kept_per_layer():
    """q and v of GPT-NeoX: the (b*s, 2h) bf16 delta per layer, and lora_A's r more rows (its (b, 2r, s)
    output, saved by the grouped conv, where peft's lora_B saves (b, s, r))."""
    peft = trainmem.estimate(NEOX, **SETUP)
    lit = trainmem.estimate(NEOX, lora_qkv="q,v", **SETUP)
    n, h, r, layers = 2 * 512, NEOX["hidden_size"], SETUP["lora_rank"], NEOX["num_hidden_layers"]
    assert lit.component("activations.layers.lora.qkv.zero_pad") == pytest.approx(layers * n * 2 * h * 2, rel=1e-3)
    assert lit.component("activations.layers.lora.qkv.lora_A_rows") == pytest.approx(layers * n * r * 2, rel=1e-3)
    assert peft.component("activations.layers.lora.qkv.zero_pad") == 0
    assert lit.peak_allocated > peft.peak_allocated


def test_all_three_parts_need_no_padding():
    lit = trainmem.estimate(NEOX, lora_qkv="q,k,v", **SETUP)
    assert lit.component("activations.layers.lora.qkv.zero_pad") == 0


def test_adapter_sizes_follow_lit_gpt():
    """lora_A: r rows per enabled part over the input; lora_B: the enabled parts' widths (Falcon-7B's q
    4544 and v 64, its one key/value head), where peft's adapter spans the whole fused width."""
    r = trainmem.resolve(FALCON, lora_qkv="q,v", **SETUP)
    a, b = zip(*(ab for mod, _n, _l, ab in _lora_tensors(r.model, r.training) if mod == "query_key_value"))
    rank, h = SETUP["lora_rank"], FALCON["hidden_size"]
    assert set(a) == {2 * rank * h} and set(b) == {rank * (4544 + 64)}
    peft = trainmem.resolve(FALCON, **SETUP)
    _a, b_peft = zip(*(ab for mod, _n, _l, ab in _lora_tensors(peft.model, peft.training) if mod == "query_key_value"))
    assert set(b_peft) == {rank * (4544 + 2 * 64)}


@pytest.mark.parametrize("options, match", [
    (dict(lora_qkv="q,x"), "--lora-qkv 'q,x'"),
    (dict(lora_qkv="q,q"), "--lora-qkv 'q,q'"),
    (dict(lora_qkv="q,v", lora_targets="dense"), "--lora-qkv models litgpt's LoRA on a fused query_key_value"),
])
def test_bad_input_is_one_line(options, match):
    with pytest.raises(trainmem.TrainmemError, match=match) as e:
        trainmem.estimate(NEOX, **dict(SETUP, **options))
    assert "\n" not in str(e.value)


def test_a_model_without_a_fused_linear_is_refused():
    with pytest.raises(trainmem.TrainmemError, match="has no such linear"):
        trainmem.estimate("llama-3.2-1b", lora_rank=8, lora_targets="q_proj,v_proj", lora_qkv="q,v")


def test_trace_refuses_it_in_one_line():
    with pytest.raises(trainmem.TrainmemError, match="--lora-qkv q,v: trace and measure run peft's adapter") as e:
        trainmem.trace(NEOX, lora_qkv="q,v", **SETUP)
    assert "\n" not in str(e.value)
