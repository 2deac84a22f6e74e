"""``--cast-output``: Lightning Fabric hands the loop an fp32 copy of the model's logits
(``_FabricModule.forward`` -> ``precision.convert_output``) and litgpt's loop rebinds ``logits``
before its loss. The estimate's formulas (``quantities.loss_kinds._cast_output_loss_bytes`` and the
``output.cast`` moment) are checked against trace, which runs that step on a transformers Llama cut
to two layers: the head's chunks, their fp32 copies, litgpt's chunked cross-entropy and backward."""
from __future__ import annotations

import pytest

from trainmem.errors import TrainmemError
from trainmem.spec.training import TrainingSpec

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem import estimate, trace  # noqa: E402

TWO_LAYERS = {"num_hidden_layers": 2}
BASE = dict(batch_size=2, seq_len=256, loss="half", hold_output="step", grad_accum=2, attention="sdpa",
            set=TWO_LAYERS, gpu="a100-40gb")


def _both(**options):
    return estimate("llama-3.2-1b", **options), trace("llama-3.2-1b", **options)


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp", "fp32"])
@pytest.mark.parametrize("extra", [dict(loss_chunks=4, lora_rank=8, lora_dtype="half"), dict(loss_chunks=4),
                                   dict(lora_rank=8), dict(loss_chunks=2, hold_output="loss", lora_rank=8)],
                         ids=["chunks-lora", "chunks-full", "one-piece-lora", "chunks-hold-loss"])
def test_estimate_agrees_with_trace(precision, extra):
    e, t = _both(**{**BASE, **extra, "precision": precision, "cast_output": True})
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01)


def test_the_cast_copy_is_the_peak_of_a_half_lora_run():
    """With a frozen head and a small adapter, the peak is where forward returns: the previous
    micro-batch's fp32 copy (still the loop's ``logits``), the head's half chunks and their new fp32
    copies; trace finds it at the cast (``_to_copy``), the estimate at its ``output.cast`` moment."""
    opts = {**BASE, "loss_chunks": 4, "lora_rank": 8, "lora_dtype": "half", "precision": "bf16"}
    e, t = _both(**opts, cast_output=True)
    assert e.peak_where == "output.cast"
    assert "_to_copy" in t.peak_where
    # the replayed step (estimate/reserved/) makes the fp32 copies too
    assert e.peak_reserved == pytest.approx(t.peak_reserved, rel=0.02)
    plain = trace("llama-3.2-1b", **opts)
    # per logit element: 4 B (previous copy) + 2 B (half) + 4 B (fp32) at the cast against the plain
    # loop's half logits and log-probabilities; the copy adds at least one half logits' worth
    logits = 2 * 256 * 128256 * 2
    assert t.peak_allocated - plain.peak_allocated > logits


def test_fp32_logits_are_not_copied():
    """``tensor.to(torch.float32)`` returns an fp32 tensor itself: no copy, only the loop's
    rebinding before its loss remains (it frees the previous output earlier)."""
    opts = {**BASE, "loss_chunks": 4, "lora_rank": 8, "precision": "fp32"}
    cast, plain = trace("llama-3.2-1b", **opts, cast_output=True), trace("llama-3.2-1b", **opts)
    assert cast.peak_allocated < plain.peak_allocated
    assert "output.cast" not in estimate("llama-3.2-1b", **opts, cast_output=True).peak_where


@pytest.mark.parametrize("options, names", [
    (dict(cast_output=True), "--cast-output"),
    (dict(cast_output=True, loss="chunked", loss_chunks=4), "--loss chunked"),
    (dict(cast_output=True, loss="half", loss_shift="logits"), "--loss-shift"),
    (dict(cast_output=True, loss="half", pp=2, grad_accum=2), "--pp"),
    (dict(cast_output=True, loss="half", tp=2), "--tp"),
])
def test_refused_in_one_line(options, names):
    with pytest.raises(TrainmemError) as e:
        TrainingSpec(batch_size=1, seq_len=64, **options)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_refused_for_a_head_without_logits_the_loop_reads():
    with pytest.raises(TrainmemError, match="--cast-output"):
        estimate("bert-large-uncased", batch_size=1, seq_len=64, loss="half", cast_output=True)


def test_fp32_chunked_half_loss_agrees_with_trace():
    """litgpt's chunked loss on fp32 logits without the cast (``--precision fp32 --loss half
    --loss-chunks N``): each chunk's fp32 gradients exist one chunk at a time, as in half precision
    (the estimate counted them for the whole micro-batch: +10.6% on this setup before)."""
    e, t = _both(**{**BASE, "loss_chunks": 4, "lora_rank": 8, "precision": "fp32"})
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01)


def test_use_cache_false_is_not_answered_from_the_cache():
    """``--set use_cache=false`` (litgpt's GPT has no KV cache in training): ModelSpec's equality
    leaves the config out, so the estimate's quantities cache must key on the cache itself (two
    specs differing only in ``use_cache`` got one answer before)."""
    opts = dict(batch_size=1, seq_len=512, precision="bf16", loss="half", hold_output="step")
    with_cache = estimate("llama-3.2-1b", set=["tie_word_embeddings=false"], **opts)
    without = estimate("llama-3.2-1b", set=["tie_word_embeddings=false", "use_cache=false"], **opts)
    assert any(c.name == "activations.kv_cache" for c in with_cache.components)
    assert not any(c.name == "activations.kv_cache" for c in without.components)


def test_derived_model_without_cache_agrees_with_trace():
    """A derived architecture (Phi) with ``use_cache=false`` is derived without the KV cache, as
    transformers then builds none (the profile's fingerprint leaves ``use_cache`` out)."""
    from trainmem.estimate import derived
    from trainmem.spec.resolve import resolve
    opts = dict(batch_size=2, seq_len=256, precision="bf16", loss="half", loss_chunks=2, hold_output="step",
                grad_accum=2, lora_rank=8, lora_dtype="half", cast_output=True, gpu="a100-40gb")
    cut = ["num_hidden_layers=2"]
    runs = [resolve("phi-2", set=s, **opts) for s in (cut, cut + ["use_cache=false"])]
    keys = {derived.key(r.model, r.training) for r in runs}
    assert len(keys) == 2
    e, t = (f("phi-2", set=cut + ["use_cache=false"], **opts) for f in (estimate, trace))
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01)


@pytest.mark.parametrize("layout", [
    dict(dp=2),
    dict(dp=2, fsdp="full", lora_rank=8, lora_dtype="half"),
    # Lightning Fabric's FSDPStrategy as litgpt configures it: FSDP1, adapters in their layer's unit,
    # activation checkpointing of every block, no_sync while accumulating
    dict(dp=2, fsdp="full", fsdp_version=1, lora_rank=8, lora_dtype="half", fsdp_lora_units="layer",
         grad_sync="step", recompute="full"),
], ids=["ddp", "fsdp2-lora", "fsdp1-litgpt"])
def test_estimate_agrees_with_trace_data_parallel(layout):
    e, t = _both(**{**BASE, "precision": "bf16", "cast_output": True, **layout})
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01)


# ----- --fused-qkv: litgpt's fused q/k/v linear ---------------------------------------------------------
def _litgpt_attention_saves_fused_output(groups: int, q_per_kv: int) -> bool:
    """litgpt's CausalSelfAttention reshaping (litgpt 0.5.3 ``model.py`` L268-290) on real CPU
    tensors: does a tensor autograd saves share the fused q/k/v output's storage?"""
    import torch
    b, t, hs = 2, 8, 16
    heads = groups * q_per_kv
    x = torch.randn(b, t, 32, requires_grad=True)
    w = torch.randn((heads + 2 * groups) * hs, 32)
    fused = torch.nn.functional.linear(x, w)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        qkv = fused.view(b, t, groups, q_per_kv + 2, hs).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        if q_per_kv > 1:
            k, v = k.expand(b, groups, q_per_kv, t, hs), v.expand(b, groups, q_per_kv, t, hs)
        q, k, v = (z.reshape(b, -1, t, hs) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.sum().backward()
    ptr = fused.untyped_storage().data_ptr()
    return any(s.untyped_storage().data_ptr() == ptr for s in saved)


def test_fused_qkv_output_is_kept_only_with_one_query_head_per_group():
    assert _litgpt_attention_saves_fused_output(groups=4, q_per_kv=1)
    assert not _litgpt_attention_saves_fused_output(groups=2, q_per_kv=2)


@pytest.mark.parametrize("model", ["llama-2-7b", "mistral-7b"])
def test_fused_qkv_adds_the_query_and_key_widths_per_layer(model):
    """The estimate keeps, per layer, the fused output's query and key part (the value part is what
    transformers' attention saves too) when the model has as many key/value heads as query heads;
    with LoRA on q and v, ``LoRAQKVLinear``'s zero-padded delta (q + kv wide, saved by index_copy)
    and one dropout instead of peft's two (tests/test_litgpt_attention.py checks both on the CPU)."""
    from trainmem.spec.config import resolve_model
    m = resolve_model(model)
    opts = dict(batch_size=1, seq_len=512, precision="bf16", lora_rank=8, lora_targets="q_proj,v_proj",
                lora_dtype="half", loss="half", hold_output="step", lora_dropout=0.05)
    plain, fused = (estimate(model, fused_qkv=f, **opts) for f in (False, True))
    parts = {c.name: c.bytes for c in fused.components}
    tokens = 512 * m.num_layers
    expected = (m.q_size + m.kv_size) * 2 * tokens if m.num_heads == m.num_kv_heads else 0
    assert parts.get("activations.layers.attn.fused_qkv", 0) == pytest.approx(expected, rel=1e-6)
    zero_pad, one_dropout = (m.q_size + m.kv_size) * 2 * tokens, -m.hidden_size * (1 + 2) * tokens
    assert fused.peak_allocated - plain.peak_allocated == pytest.approx(expected + zero_pad + one_dropout,
                                                                        abs=2 ** 21)


def test_fused_qkv_is_refused_where_transformers_fuses_or_with_tensor_parallelism():
    """trace and measure run litgpt's fused linear (tests/test_litgpt_modules.py, tests/test_measure_run.py)."""
    from trainmem.workload import check_supported
    with pytest.raises(TrainmemError, match="--fused-qkv"):
        estimate("phi-3-mini", seq_len=64, fused_qkv=True)
    check_supported(TrainingSpec(batch_size=1, seq_len=64, fused_qkv=True), "measure")
    with pytest.raises(TrainmemError, match="--fused-qkv"):
        TrainingSpec(batch_size=1, seq_len=64, fused_qkv=True, tp=2)


def test_layout_arrays_equal_the_scalar_estimate():
    """The planner's engine on arrays of layouts counts the cast copy and the fused q/k/v output as
    the scalar estimate does (``plan`` keeps ``--tp 1 --pp 1`` with these options)."""
    from dataclasses import replace

    import numpy as np

    from trainmem.estimate.engine import estimate_layouts
    from trainmem.spec.config import resolve_model
    m = resolve_model("llama-2-7b")
    for base in (TrainingSpec(precision="bf16", loss="half", loss_chunks=4, hold_output="step", cast_output=True,
                              fused_qkv=True, lora_rank=8, lora_dtype="half", grad_accum=4),
                 TrainingSpec(precision="bf16-amp", loss="upcast", cast_output=True, fused_qkv=True, dp=4,
                              fsdp="full")):
        b, seq = np.array([1, 2, 4, 3]), np.array([512, 1024, 2048, 1304])
        out = estimate_layouts(m, base, batch_size=b, seq_len=seq)
        for i in range(len(b)):
            r = estimate(m, training=replace(base, batch_size=int(b[i]), seq_len=int(seq[i])))
            assert int(out["peak_allocated"][i]) == r.peak_allocated


def test_plan_keeps_one_gpu_layouts_for_litgpt_options():
    from trainmem.plan.planner import plan
    res = plan("llama-3.2-1b", gpus=4, global_batch=16, seq_len=512, gpu="a100-40gb", loss="half", cast_output=True)
    assert res.top and all(lay.tp == 1 and lay.pp == 1 for lay in res.top)
    with pytest.raises(TrainmemError, match="--cast-output --tp 1,2"):
        plan("llama-3.2-1b", gpus=4, global_batch=16, seq_len=512, gpu="a100-40gb", loss="half", cast_output=True,
             tp="1,2")
