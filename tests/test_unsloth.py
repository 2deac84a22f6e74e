"""Unsloth (``--framework unsloth``: ``--unsloth-gc``, ``--unsloth-kernels``, ``--loss unsloth``): what its
checkpointing keeps on the GPU, what its LoRA Functions and kernels save, what its compiled fused loss
allocates, read off unsloth 2026.3.5 (tag March-2026) and unsloth_zoo 2026.3.4 (38f4871f); the estimate
only (trace, measure and plan refuse it).

* ``UnslothCheckpointFunction`` (unsloth_zoo ``gradient_checkpointing.py`` L384-634): a layer input of
  more than 2 MiB goes to pinned host memory (L438-476) except the top layer's after the first step;
  one persistent GPU buffer (L355, L466) takes the recomputed layer's input (L526-532);
* ``LoRA_QKV`` saves X; ``LoRA_W`` X; ``LoRA_MLP`` (X, e, g); ``Fast_RMS_Layernorm`` (X, W, r); RoPE is
  in place (``kernels/fast_lora.py``, ``rms_layernorm.py``, ``rope_embedding.py``);
* ``UnslothFusedLoss`` (``fused_losses/cross_entropy_loss.py``): saves the input gradient; each chunk is
  one inductor-planned pool of half logits and an (N, h) gradient (checked against the installed
  torch's inductor below).
"""
import re

import pytest
import torch

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate import unsloth
from trainmem.estimate.layers import LayerKey, layer_coefficients
from trainmem.estimate.quantities.build import quantities
from trainmem.estimate.quantities.loss_kinds import _unsloth_loss_bytes
from trainmem.estimate.layers import Policy
from trainmem.spec.resolve import resolve
from trainmem.spec.frameworks import preset_options

MODEL = "llama-3.1-8b"
SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QLORA = dict(precision="bf16", quantize="nf4-dq", lora_rank=16, lora_targets=SEVEN, recompute="full",
             reentrant=True, batch_size=1, seq_len=8192)


def _est(**kw):
    return trainmem.estimate(MODEL, **{**QLORA, **kw})


# ----- the preset ---------------------------------------------------------------------------------------
def test_preset_is_fast_language_model_qlora():
    """get_peft_model's defaults (r=16, the seven projections, dropout 0, use_gradient_checkpointing=
    'unsloth'), from_pretrained's load_in_4bit with double quantization, the adapters upcast to fp32 over
    bf16 weights, UnslothSFTConfig's adamw_8bit, batch 4, accumulation 2."""
    o = preset_options("unsloth")
    assert (o["quantize"], o["lora_rank"], o["lora_targets"], o["lora_dropout"], o["lora_dtype"]) == \
        ("nf4-dq", 16, SEVEN, 0.0, "fp32")
    assert (o["precision"], o["optimizer"], o["batch_size"], o["grad_accum"]) == ("bf16", "adamw-8bit", 4, 2)
    assert (o["recompute"], o["reentrant"], o["unsloth_gc"], o["unsloth_kernels"], o["loss"]) == \
        ("full", True, True, True, "unsloth")
    t = resolve(MODEL, framework="unsloth").training
    assert t.extra["framework_warnings"] == ()


def test_preset_rules_follow_the_setup():
    """No checkpointing turns both off; adapter dropout (or fewer targets) leaves peft's modules in place
    (patch_peft_model), which one warning line says; short sequences keep the offloaded checkpointing
    (its switch is the model's max_seq_length, ``--no-unsloth-gc``), whose 2 MiB threshold keeps them."""
    assert resolve(MODEL, framework="unsloth", seq_len=256).training.unsloth_gc
    assert not resolve(MODEL, framework="unsloth", unsloth_gc=False).training.unsloth_gc
    t = resolve(MODEL, framework="unsloth", recompute="none").training
    assert (t.unsloth_gc, t.reentrant) == (False, None)
    t = resolve(MODEL, framework="unsloth", lora_dropout=0.05).training
    assert not t.unsloth_kernels and "patch_peft_model" in t.extra["framework_warnings"][0]


def test_trace_refuses_it():
    """trace runs no Unsloth kernel (the workload check measure shares): one line naming estimate."""
    with pytest.raises(TrainmemError, match="use estimate"):
        trainmem.trace(MODEL, framework="unsloth", batch_size=1, seq_len=1024)


def test_options_refuse_what_is_not_modelled():
    with pytest.raises(TrainmemError, match="--unsloth-gc is Unsloth's reentrant"):
        _est(unsloth_gc=True, reentrant=False)
    with pytest.raises(TrainmemError, match="--unsloth-kernels is Unsloth's patch"):
        _est(unsloth_kernels=True, lora_targets=("q_proj", "v_proj"))
    with pytest.raises(TrainmemError, match="--loss unsloth is Unsloth's fused loss"):
        _est(loss="unsloth", precision="bf16-amp")


# ----- the offloaded checkpointing ---------------------------------------------------------------------------
def test_offload_keeps_the_top_input_and_one_buffer():
    """With 8192 x 4096 bf16 inputs (64 MiB, above the 2 MiB threshold) the checkpointed inputs on the
    GPU are the top layer's alone, beside a buffer of one input; torch's reentrant checkpoint keeps
    all 32."""
    one = 8192 * 4096 * 2
    plain, gc = _est(), _est(unsloth_gc=True)
    assert plain.component("activations.layers.checkpointed_inputs") == 32 * one
    assert gc.component("activations.layers.checkpointed_inputs") == one
    assert gc.component("workspace.unsloth_gc_buffer") == one
    # forward's end: 31 inputs fewer, one buffer more
    assert plain.phase("forward", 2).allocated - gc.phase("forward", 2).allocated == 30 * one


def test_small_inputs_stay_on_the_gpu():
    """b·s·h <= 1 Mi elements (2 MiB of bf16) is not offloaded (``new_size > MINIMUM_SIZE``): the inputs
    stay as torch's checkpoint keeps them, and the buffer keeps its initial 2 MiB."""
    assert unsloth.offloads(4096, 2, 257) and not unsloth.offloads(4096, 2, 256)
    plain, gc = _est(seq_len=256), _est(seq_len=256, unsloth_gc=True)
    assert gc.component("activations.layers.checkpointed_inputs") == \
        plain.component("activations.layers.checkpointed_inputs")
    assert gc.component("workspace.unsloth_gc_buffer") == 2 * 1024 * 1024


# ----- the layer kernels ------------------------------------------------------------------------------------
H, F, HEADS, KVH, D, R = 64, 176, 4, 2, 16, 8


def _layer(unsloth_kernels: bool, quant: bool = True):
    lora = tuple((m, R, 1) for m in SEVEN)
    return layer_coefficients(LayerKey("llama", "silu", "bf16", "sdpa", False, 0.0, 0.0, H, F, HEADS * D, KVH * D,
                                       HEADS, KVH, D, 1, False, False, 0, 0, True, lora, 0.0, False,
                                       (2, 0, 0) if quant else (0, 0, 0), False, True, False,
                                       unsloth=unsloth_kernels))


def test_layer_saves_what_unsloths_functions_save():
    """Per token, bf16: each RMSNorm's input itself and an fp32 r (the first norm's input is the layer's
    input); LoRA_QKV's X; q, k, v, the attention output and its fp32 logsumexp per head (the fused
    kernel; LoRA_W's X is that output); LoRA_MLP's X, e, g."""
    lc = _layer(True)
    q, kv = HEADS * D, KVH * D
    expected = 2 * (H + H + q + 2 * kv + q + H + H + 2 * F) + 2 * 4 + 4 * HEADS
    assert lc.tok == expected
    assert lc.input_saved == 2 * H
    assert lc.tok < _layer(False).tok   # peft's modules save more (the SwiGLU product, adapter inputs...)


def test_mlp_backward_holds_dy_dw_and_one_dequantized_weight():
    """LoRA_MLP.backward: the (b, s, f) DW, (b, s, r) products and dY beside the layer's saved tensors;
    one 4-bit weight dequantized at a time (half + the fp32 absmax of its 64-blocks); a 16-bit base
    weight is used as it is."""
    trans = {n: (a, c) for n, a, _b, c in _layer(True).transients}
    a, c = trans["mlp.backward"]
    assert a == 2 * H + 2 * (F + R) + 2 * H      # dY, DW and the products, + the reentrant recomputed output
    assert c == H * F * (2 + 4 / 64)
    assert dict((n, c) for n, _a, _b, c in _layer(True, quant=False).transients)["mlp.backward"] == 0


def test_dequantization_buffer_is_the_largest_weight():
    """``fast_dequantize(..., use_global_buffer=True)``: one buffer of the largest 4-bit weight (Llama-3.1-8B's
    4096 x 14336 MLP projections) in bf16 and its fp32 absmax, kept."""
    r = _est(unsloth_kernels=True)
    assert r.component("workspace.unsloth_dequant_buffer") == 4096 * 14336 * 2 + 4096 * 14336 // 64 * 4


# ----- the fused loss ---------------------------------------------------------------------------------------
def test_fused_loss_keeps_no_logits():
    """UnslothFusedLoss returns no logits and saves the (b, s, h) input gradient; the estimate's loss
    forward is one chunk's half logits and (N, h) gradient beside it (one chunk by default)."""
    r = _est(loss="unsloth")
    t = r.training
    q = quantities(r.model, t)
    assert (q.logits_out, q.loss_forward_chunk, q.loss_saved_tok) == (0, 2, 4096 * 2)
    assert q.loss_chunk_tok == 4096 * 2 and q.head_loss_tok == 4096 * 2 + 8
    assert r.component("logits.logits") == 0


def _inductor_pool(n: int, h: int, v: int) -> tuple[int, list[str]]:
    """The memory-planning pool inductor allocates for unsloth_zoo's ``accumulate_chunk`` (its loss
    function ``compute_fused_ce_loss`` under ``torch.func.grad_and_value``, L69-131 and L234-311, the
    frozen-head branch), compiled with unsloth_zoo's options (memory_planning on) on the CPU; and the
    wrapper's buffer lines."""
    from torch._inductor.utils import run_and_get_code

    def loss_function(hidden, weight, labels, divisor):
        logits = torch.nn.functional.linear(hidden.to(dtype=weight.dtype), weight, None)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, weight.shape[0]).float().contiguous(),
                                                 labels.view(-1).contiguous(), reduction="sum")
        loss = loss / divisor
        return loss, (loss.detach(),)

    def accumulate_chunk(grad_inputs_j, hidden_j, weight, labels_j, divisor, accumulated):
        (g,), (_loss, (unscaled,)) = torch.func.grad_and_value(loss_function, argnums=(0,), has_aux=True)(
            hidden_j, weight, labels_j, divisor)
        accumulated.add_(unscaled)
        grad_inputs_j[:] = g

    opts = {"epilogue_fusion": True, "max_autotune": False, "shape_padding": True, "memory_planning": True,
            "dce": True}
    f = torch.compile(accumulate_chunk, dynamic=False, fullgraph=True, options=opts)
    hidden = torch.randn(n, h, dtype=torch.bfloat16)
    _, codes = run_and_get_code(f, torch.empty_like(hidden), hidden, torch.randn(v, h, dtype=torch.bfloat16),
                                torch.randint(0, v, (n,)), torch.tensor(float(n)), torch.zeros(()))
    lines = [ln.strip() for ln in codes[0].splitlines() if "alloc_from_pool" in ln or "= empty_strided_cpu(" in ln]
    pools = [int(m.group(1)) for ln in lines for m in [re.search(r"empty_strided_cpu\(\((\d+), \)", ln)] if m]
    return sum(pools), lines


@pytest.mark.slow
def test_inductor_plans_one_half_logits_buffer():
    """The compiled chunk allocates N·V half logits (the gradient overwrites them) and the (N, h)
    gradient, nothing else of size: what ``_unsloth_loss_bytes`` and ``loss_chunk_tok`` count."""
    n, h, v = 64, 32, 1000
    pool, lines = _inductor_pool(n, h, v)
    assert not any("torch.float32, (64, 1000)" in ln for ln in lines)   # no fp32 logits
    b = _unsloth_loss_bytes(type("M", (), {"hidden_size": h})(), Policy.of("bf16"))
    assert pool == n * v * b.forward_chunk + n * h * 2


def test_layouts_on_both_sides_of_the_threshold_match_estimate():
    """fit and plan's array path (``estimate_layouts``) splits the rows whose input is offloaded from those
    whose is not (the offload keys the quantities): each matches ``trainmem.estimate`` of its own size."""
    import numpy as np
    from trainmem.estimate.engine import estimate_layouts
    r = resolve(MODEL, framework="unsloth", batch_size=1, seq_len=128)
    seqs = np.array([128, 256, 384, 8192])
    out = estimate_layouts(r.model, r.training, seq_len=seqs)
    for s, got in zip(seqs, out["peak_allocated"]):
        assert got == trainmem.estimate(MODEL, framework="unsloth", batch_size=1, seq_len=int(s)).peak_allocated


def test_biased_projections_are_left_to_peft():
    """Qwen2's q/k/v carry biases: patch_peft_model patches its O and MLP only (L3391-3393); a partly
    patched layer is not modelled: the preset counts peft's modules, warned; the option is refused."""
    t = resolve("qwen2.5-7b", framework="unsloth").training
    assert not t.unsloth_kernels and "carry a bias" in t.extra["framework_warnings"][0]
    with pytest.raises(TrainmemError, match="projections carry biases"):
        trainmem.estimate("qwen2.5-7b", **{**QLORA, "unsloth_kernels": True})


def test_loss_chunks_split_the_compiled_pool():
    """``--loss unsloth --loss-chunks 4`` (UNSLOTH_CE_LOSS_N_CHUNKS=4): ``torch.chunk`` into 4 pieces of
    ceil(N/4) tokens, each its own pool of half logits and (tokens, h) gradient, made and freed in turn:
    the loss's forward transient (beside the final norm's output and the labels) is one piece's pool."""
    from trainmem.estimate.moments import StepFlags, tokens
    n, v, h = 8192, 128256, 4096

    def loss_forward(chunks):
        r = _est(loss="unsloth", loss_chunks=chunks)
        q = quantities(r.model, r.training)
        return tokens(q, StepFlags.of(r.model, r.training), n, n * n, 1, 1).loss_forward
    held = n * (h * 2 + 8)                        # the final norm's output and the shifted labels
    assert loss_forward(1) == held + n * (v * 2 + h * 2)
    assert loss_forward(4) == held + n // 4 * (v * 2 + h * 2)
