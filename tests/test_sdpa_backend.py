"""Which kernel ``F.scaled_dot_product_attention`` runs, as PyTorch 2.13's CUDA dispatcher decides
it, and what that kernel keeps for backward (docs/attention.md).

The estimate decides from scalars (``estimate.layers.sdpa_backend``), the trace's CUDA emulation
from the tensors transformers hands to SDPA (``trace.cuda.CudaEmulation._choose_backend``); both
must give the same answer, and the same bytes: flash pads a head_dim that is not a multiple of 8
(OpenLLaMA-3B: 100) and keeps the padded copies instead of an s x s score matrix.
"""
from __future__ import annotations

import pytest

from trainmem.errors import TrainmemError
from trainmem.estimate.engine import estimate
from trainmem.estimate.layers import (F32, HALF, layer_coefficients, sdpa_backend, sdpa_pin_problem,
                                      sdpa_priority, sdpa_refusals)
from trainmem.estimate.quantities.model_facts import layer_key
from trainmem.spec import TrainingSpec, resolve_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.trace.api import trace  # noqa: E402
from trainmem.trace.cuda import CudaEmulation  # noqa: E402

SM80, SM90 = (8, 0), (9, 0)
HEAD_DIMS = (64, 100, 128, 160, 256, 257)

#: (head_dim, dtype bytes, GQA) -> backend on an A100 (flash, efficient, math, cudnn)
EXPECTED_SM80 = {
    **{(d, HALF, g): "flash" for d in HEAD_DIMS[:-1] for g in (False, True)},
    (257, HALF, False): "math", (257, HALF, True): "math",          # > 256, not a multiple of 8
    **{(d, F32, False): "efficient" for d in HEAD_DIMS[:-1]},       # fp32: no flash; 4-aligned
    **{(d, F32, True): "math" for d in HEAD_DIMS[:-1]},             # efficient takes no GQA (2.13)
    (257, F32, False): "math", (257, F32, True): "math",
}
#: on an H100/H200 (cuDNN 9.20 first): cuDNN where head_dim is a multiple of 8 and <= 128
EXPECTED_SM90 = {**EXPECTED_SM80, **{(d, HALF, g): "cudnn" for d in (64, 128) for g in (False, True)}}

OPEN_LLAMA_3B = ["hidden_size=3200", "num_attention_heads=32", "num_key_value_heads=32",
                 "intermediate_size=8640", "max_position_embeddings=4096"]


def _sdpa_inputs(head_dim: int, dtype, gqa: bool, b: int = 2, s: int = 256, heads: int = 8):
    """q, k, v and enable_gqa as transformers' ``sdpa_attention_forward`` passes them (its own
    ``use_gqa_in_sdpa`` / ``repeat_kv``), on the emulated device."""
    from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa
    kvh = heads // 4 if gqa else heads
    q = torch.empty(b, s, heads, head_dim, device="meta", dtype=dtype).transpose(1, 2)
    k = torch.empty(b, kvh, s, head_dim, device="meta", dtype=dtype)
    v = torch.empty(b, kvh, s, head_dim, device="meta", dtype=dtype)
    enable_gqa = False
    if gqa:
        if use_gqa_in_sdpa(None, k, v):
            enable_gqa = True
        else:
            k, v = repeat_kv(k, heads // kvh), repeat_kv(v, heads // kvh)
    return q, k, v, enable_gqa


# ----- the choice table ---------------------------------------------------------------------------
@pytest.mark.parametrize("capability, table", [(SM80, EXPECTED_SM80), (SM90, EXPECTED_SM90)])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("half", (HALF, F32))
@pytest.mark.parametrize("gqa", (False, True))
def test_estimate_and_trace_choose_the_same_backend(capability, table, head_dim, half, gqa):
    want = table[(head_dim, half, gqa)]
    assert sdpa_backend(half, head_dim, gqa, capability=capability) == want
    emu = CudaEmulation(capability=capability)
    q, k, v, enable_gqa = _sdpa_inputs(head_dim, torch.bfloat16 if half == HALF else torch.float32, gqa)
    assert emu._choose_backend(q, k, v, None, 0.0, True, enable_gqa) == want
    # every backend's verdict, not only the winner
    est = sdpa_refusals(half, head_dim, gqa, capability=capability)
    got = emu.sdpa_refusals(q, k, v, None, 0.0, True, enable_gqa)
    assert {b: bool(w) for b, w in est.items()} == {b: bool(w) for b, w in got.items()}


def test_priority_order():
    assert sdpa_priority(SM80) == ("flash", "efficient", "math", "cudnn")
    assert sdpa_priority(SM90) == ("cudnn", "flash", "efficient", "math")
    assert CudaEmulation(capability=SM80)._priority() == list(sdpa_priority(SM80))
    assert CudaEmulation(capability=SM90)._priority() == list(sdpa_priority(SM90))


def test_dropout_that_cudnn_cannot_represent_falls_back_to_flash():
    """cuDNN's dropout has a 1/16 resolution (check_cudnn_dropout): GPT-2's 0.1 runs flash."""
    assert sdpa_backend(HALF, 64, False, capability=SM90, dropout=0.1) == "flash"
    assert sdpa_backend(HALF, 64, False, capability=SM90, dropout=0.125) == "cudnn"
    q, k, v, _ = _sdpa_inputs(64, torch.bfloat16, False)
    assert CudaEmulation(capability=SM90)._choose_backend(q, k, v, None, 0.1, True, False) == "flash"


# ----- OpenLLaMA-3B: head_dim 100 runs flash, linear in the sequence -----------------------------
def test_open_llama_3b_attention_is_linear_in_the_sequence():
    m = resolve_model("llama-2-7b", overrides=["num_hidden_layers=26"] + OPEN_LLAMA_3B)
    assert m.head_dim == 100
    for precision in ("bf16-amp", "bf16"):
        t = TrainingSpec(batch_size=1, seq_len=2048, precision=precision, attention="sdpa")
        lc = layer_coefficients(layer_key(m, t))
        assert lc.sq == 0, "flash keeps no s x s tensor"
        parts = dict((n, a) for n, a, _ in lc.parts)
        # the padded copies: 32 heads x 104 bf16 values per token each
        assert parts["attn.q_padded"] == parts["attn.k_padded"] == parts["attn.v_padded"] == 32 * 104 * 2
        assert parts["attn.sdpa_out"] == 32 * 104 * 2 and parts["attn.context"] == 3200 * 2
        math = layer_coefficients(layer_key(m, TrainingSpec(batch_size=1, seq_len=2048, precision=precision,
                                                               attention="sdpa-math")))
        assert math.sq > 0
    # the whole model at 4096 tokens: the math path's fp32 scores would add tens of GiB
    t = dict(batch_size=4, seq_len=4096, precision="bf16-amp")
    flash = estimate(m, TrainingSpec(attention="sdpa", **t)).peak_allocated
    math = estimate(m, TrainingSpec(attention="sdpa-math", **t)).peak_allocated
    assert math - flash > 20 * 2 ** 30


def _phase(r, name, step):
    return next(p.allocated for p in r.phases if p.name == name and p.step == step)


def _component(r, suffix):
    return sum(c.bytes for c in r.components if c.name.endswith(suffix))


@pytest.mark.parametrize("precision", ("bf16-amp", "bf16"))
def test_open_llama_3b_estimate_agrees_with_trace(precision):
    m = resolve_model("llama-2-7b", overrides=["num_hidden_layers=2"] + OPEN_LLAMA_3B)
    for seq in (1024, 4096):
        t = TrainingSpec(batch_size=2, seq_len=seq, precision=precision, attention="sdpa")
        e, r = estimate(m, t), trace(m, training=t)
        assert r.extra["sdpa_backends"] == {"flash": 4}   # 2 layers x 2 steps
        assert abs(e.peak_allocated / r.peak_allocated - 1) < 0.01
        assert abs(_phase(e, "forward", 2) / _phase(r, "forward", 2) - 1) < 0.01
        if seq < 4096:
            continue
        # at this peak (the loss) every layer's attention tensors are alive: the trace's padded
        # copies (three constant_pad_nd outputs per layer) and the context copy are the estimate's
        assert "loss" in e.peak_where or "cross_entropy" in e.peak_where, e.peak_where
        padded = 2 * 2 * seq * 32 * 104 * 2   # layers x tokens x heads x 104 x bf16
        assert _component(r, "self_attn.constant_pad_nd") == 3 * padded
        assert _component(e, "attn.q_padded") + _component(e, "attn.k_padded") + \
            _component(e, "attn.v_padded") == 3 * padded
        assert _component(r, "self_attn.clone") == _component(e, "attn.context") == 2 * 2 * seq * 3200 * 2


# ----- pinned backends ------------------------------------------------------------------------------
SMALL = ["num_hidden_layers=2", "hidden_size=1024", "num_attention_heads=8", "num_key_value_heads=8",
         "intermediate_size=2816"]


@pytest.mark.parametrize("pin", ("sdpa-flash", "sdpa-efficient", "sdpa-math", "sdpa-cudnn"))
def test_pinned_backends_estimate_agrees_with_trace(pin):
    m = resolve_model("llama-2-7b", overrides=SMALL)
    t = TrainingSpec(batch_size=2, seq_len=1024, precision="bf16-amp", attention=pin)
    e, r = estimate(m, t), trace(m, training=t)
    assert r.extra["sdpa_backends"] == {pin[len("sdpa-"):]: 4}
    assert abs(e.peak_allocated / r.peak_allocated - 1) < 0.01, (e.peak_allocated, r.peak_allocated)
    key = layer_key(m, t)
    assert (layer_coefficients(key).sq > 0) == (pin == "sdpa-math")


def test_cudnn_keeps_what_flash_keeps():
    """cuDNN saves q, k, v, the output and fp32 stats, as flash does for head_dim 128."""
    m = resolve_model("llama-2-7b", overrides=SMALL)
    coefs = {pin: layer_coefficients(layer_key(m, TrainingSpec(batch_size=1, seq_len=512, precision="bf16",
                                                               attention=pin)))
             for pin in ("sdpa-flash", "sdpa-cudnn")}
    assert coefs["sdpa-flash"].tok == coefs["sdpa-cudnn"].tok


# ----- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("pin, overrides, precision, match", [
    ("sdpa-flash", ["hidden_size=2112", "num_attention_heads=8", "num_key_value_heads=8"], "bf16",
     "head_dim <= 256"),
    ("sdpa-efficient", ["num_key_value_heads=2"], "bf16-amp", "grouped-query"),
    ("sdpa-efficient", OPEN_LLAMA_3B, "bf16-amp", "divisible by 8"),
    ("sdpa-cudnn", ["hidden_size=1280", "num_attention_heads=8", "num_key_value_heads=8"], "bf16",
     r"<= 128"),
    ("sdpa-cudnn", OPEN_LLAMA_3B, "bf16", "multiple of 8"),
])
def test_pins_pytorch_refuses_are_one_line_errors(pin, overrides, precision, match):
    m = resolve_model("llama-2-7b", overrides=["num_hidden_layers=2"] + overrides)
    t = TrainingSpec(batch_size=1, seq_len=256, precision=precision, attention=pin)
    with pytest.raises(TrainmemError, match=match) as err:
        estimate(m, t)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--attention {pin}")
    problem = sdpa_pin_problem(pin, HALF, m.head_dim, m.num_heads, m.num_kv_heads)
    assert problem and problem in msg
    with pytest.raises(TrainmemError, match=match):
        trace(m, training=t)


def test_accepted_pins_have_no_problem():
    assert sdpa_pin_problem("sdpa", HALF, 100, 32, 32) is None
    assert sdpa_pin_problem("sdpa-math", F32, 257, 32, 8) is None
    assert sdpa_pin_problem("sdpa-flash", HALF, 100, 32, 8) is None
    assert sdpa_pin_problem("sdpa-cudnn", HALF, 128, 32, 8, capability=SM90) is None
    assert "fp32" in sdpa_pin_problem("sdpa-flash", F32, 64, 8, 8)


@pytest.mark.parametrize("dropout", (True, False))
def test_math_attention_with_dropout_keeps_its_fp32_mask_and_dropped_probabilities(dropout):
    """The math path's dropout is ``empty_like(attn).bernoulli_().div_()`` times the fp32 scores: an
    fp32 mask and fp32 dropped probabilities are saved (8 bytes per score); GPT-2 has attention
    dropout 0.1. Without the two the estimate was 23% below trace at this size (real code)."""
    m = resolve_model("gpt2", overrides=["n_layer=4"])
    t = TrainingSpec(batch_size=4, seq_len=1024, precision="bf16-amp", attention="sdpa-math", dropout=dropout)
    e, r = estimate(m, t), trace(m, training=t)
    assert abs(e.peak_allocated / r.peak_allocated - 1) < 0.005, (e.peak_allocated, r.peak_allocated)
