"""Two rules of older transformers releases (``spec.tf_releases``):

* every attention layer of Mistral 4.34-4.41 (Llama 4.34-4.36, Mixtral 4.36-4.47, Qwen2 4.37-4.44)
  keeps its own ``cos_cached`` and ``sin_cached`` [max_position_embeddings, head_dim] in the load
  dtype (4.39.3 ``modeling_mistral.py`` L103-116, L232-236): ``estimate.states._hf_layer_rotary_cache``;
* before 5.0 transformers checkpoints with ``use_reentrant=True`` (4.39.3 ``modeling_utils.py``
  L2114-2115), whose first forward builds no autograd node, so bitsandbytes < 0.43.2 ``MatMul4Bit``
  keeps no inputs for checkpointed layers: ``estimate.quantities.build._graph_held``.

The first is checked against two published runs of the same benchmark under two releases."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem import estimate
from trainmem.spec.tf_releases import layer_rotary_cache, reentrant_checkpointing

PUBLISHED = Path(__file__).resolve().parent.parent / "validation" / "published"


class _M:
    family, head = "llama", "causal-lm"

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        if model_type == "mixtral":
            self.family = "mixtral"


@pytest.mark.parametrize("model_type, has, lacks", [
    ("mistral", [(4, 34, 1), (4, 39, 3), (4, 41, 2)], [(4, 42, 4), (4, 48, 1), (5, 24)]),
    ("mixtral", [(4, 36, 0), (4, 45, 2), (4, 47, 0)], [(4, 48, 0)]),
    ("qwen2", [(4, 40, 0), (4, 44, 2)], [(4, 45, 2)]),
    ("llama", [(4, 34, 1), (4, 36, 0)], [(4, 39, 3)]),
])
def test_layer_rotary_cache_releases(model_type, has, lacks):
    """The releases whose wheels hold ``register_buffer("cos_cached", ...)`` in the attention's
    rotary module, and the first ones that do not."""
    m = _M(model_type)
    assert all(layer_rotary_cache(m, v) for v in has)
    assert not any(layer_rotary_cache(m, v) for v in lacks)
    assert not layer_rotary_cache(m, None)


def test_reentrant_before_5():
    assert reentrant_checkpointing((4, 39, 3)) and reentrant_checkpointing((4, 56, 0))
    assert not reentrant_checkpointing((5, 18, 0)) and not reentrant_checkpointing(None)


SMALL = dict(batch_size=2, seq_len=512, optimizer="adamw", recompute="full", attention="flash", gpu="a100-80gb",
             set={"num_hidden_layers": 4})


def _buffers(rep) -> int:
    return sum(c.bytes for c in rep.components if c.category == "buffers")


@pytest.mark.parametrize("precision, nbytes, extra", [
    ("fp16", 2, {}), ("bf16-amp", 4, {}), ("fp16", 2, {"dp": 2, "fsdp": "full", "fsdp_version": 1}),
])
def test_rotary_cache_bytes(precision, nbytes, extra):
    """Four Mistral layers: 2 x 32768 x 128 per layer in the load dtype (half weights: 2 bytes, fp32
    weights under autocast: 4), whole on every FSDP rank; the peak rises by the same bytes."""
    opts = dict(SMALL, precision=precision, **extra)
    old, new = estimate("mistral-7b", transformers_version="4.41.2", **opts), \
        estimate("mistral-7b", transformers_version="4.42.4", **opts)
    cache = 4 * 2 * 32768 * 128 * nbytes
    assert _buffers(old) - _buffers(new) == cache
    assert old.peak_allocated - new.peak_allocated == cache


def _published(name: str) -> tuple[int, dict]:
    d = json.loads((PUBLISHED / f"{name}.json").read_text())
    return d["measured"][0]["bytes"], d["setup"]


def test_rotary_cache_against_two_published_runs():
    """fms-acceleration's Mistral-7B full fine-tuning on one A100, batch 4, peaks at the optimizer
    step: 72,972,297,728 bytes under transformers 4.39.3 (Jul 2024) and 72,434,837,504 under 4.48.1
    (Feb 2025), 537,460,224 bytes apart. The estimate's two setups differ by the 32 layers' caches,
    2^29 bytes, 0.1 % from the measured difference."""
    old_meas, old_setup = _published("fmsjul24_mistral7b_full_g1_b4")
    new_meas, new_setup = _published("hf_fms_mistral7b_full_g1_b4")
    old, new = estimate("mistral-7b", **old_setup), estimate("mistral-7b", **new_setup)
    cache = 32 * 2 * 32768 * 128 * 2
    assert old.peak_allocated - new.peak_allocated == cache
    assert abs((old_meas - new_meas) - cache) / (old_meas - new_meas) < 0.002


def test_reentrant_checkpoint_keeps_no_bnb_inputs():
    """QLoRA over bitsandbytes 0.42.0 (``MatMul4Bit`` keeps its input as ``ctx.tensors``): under the
    installed transformers' non-reentrant checkpointing every layer's first forward keeps them until
    backward ends; under 4.39.3's reentrant one only the layer being back-propagated holds them, so
    the extra over bitsandbytes 0.43.3 is less than one layer's share of the non-reentrant extra."""
    opts = dict(SMALL, precision="bf16-amp", lora_rank=8, lora_targets="q_proj,v_proj", quantize="nf4",
                quantize_via="transformers")
    opts.pop("attention")

    def extra(**kw):
        return (estimate("mistral-7b", bitsandbytes_version="0.42.0", **opts, **kw).peak_allocated
                - estimate("mistral-7b", bitsandbytes_version="0.43.3", **opts, **kw).peak_allocated)
    whole, reentrant = extra(), extra(transformers_version="4.39.3")
    assert 0 < reentrant < whole / 4


def _act_backward(**kw) -> float:
    """Bytes per token the Mistral-7B layer's SwiGLU backward adds over its saved tensors."""
    from trainmem.estimate.layers import layer_coefficients
    from trainmem.estimate.quantities.model_facts import layer_key
    from trainmem.spec.resolve import resolve
    r = resolve("mistral-7b", precision="fp16-amp", lora_rank=16, lora_targets="q_proj,v_proj",
                recompute="full", attention="flash", **kw)
    return dict((n, a) for n, a, _b, _c in layer_coefficients(layer_key(r.model, r.training)).transients)[
        "mlp.act.backward"]


def test_reentrant_recompute_keeps_the_layer_output():
    """``CheckpointFunction.backward`` holds the recomputed layer's output (``outputs``) while it
    back-propagates the layer: one residual-stream tensor per token (fp32 under autocast over fp32
    weights, 4096 x 4 bytes) at every backward moment of the layer, under transformers 4 only."""
    assert _act_backward(transformers_version="4.39.3") - _act_backward() == 4096 * 4


def test_recompute_keeps_bnb_inputs_to_the_layer_end():
    """Under 4.39.3's reentrant checkpoint the recomputed layer's ``MatMul4Bit`` inputs die with the
    recomputed graph, at the end of the layer's backward: at the SwiGLU's backward, ``down_proj``'s
    input (the (b, s, ffn) product, fp32 under autocast over fp32 activations) is still alive, beside
    the recomputed output (the same saved set, so the transients compare directly)."""
    q = dict(quantize="nf4", quantize_via="transformers", bitsandbytes_version="0.42.0")
    assert _act_backward(transformers_version="4.39.3", **q) - _act_backward(**q) == 14336 * 4 + 4096 * 4
