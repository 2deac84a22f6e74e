"""torchtune's activation offloading (--offload-activations) with LoRA (docs/validation.md, 2026-11-25,
fifteenth session): trace's hooks on the transformers body inside peft, the estimate's peft leaf, and the
torchtune README rows that run it.

Trace runs with expandable segments (each tensor its own 512-byte-rounded block, what the estimate
counts), on the 4-layer Llama of tests/test_recompute_op.py."""
import json
import os

import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate.quantities.layer_moments import offload_stash_keeps_top_input, peft_offload_leaf
from trainmem.spec.resolve import resolve
from trainmem.trace.api import trace
from trainmem.validate import validate

DEEP = ["num_hidden_layers=4", "hidden_size=256", "intermediate_size=768", "num_attention_heads=4",
        "num_key_value_heads=2", "vocab_size=512"]
KW = dict(batch_size=4, seq_len=1024, recompute="full", lora_rank=8)
INPUT = 4 * 1024 * 256 * 2  # one bf16 layer input (b, s, h)
PUBLISHED = os.path.join(os.path.dirname(__file__), os.pardir, "validation", "published")


def _forward_end(r):
    return next(p.allocated for p in r.phases if p.name == "forward" and p.step == 1)


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp"])
def test_lora_offload_estimate_matches_trace(precision):
    """Before the fix trace's hooks sat on peft's ``LoraModel``, which ``PeftModel.forward`` never calls:
    nothing was offloaded (trace's peak and forward end did not move); the estimate, without the
    embedding leaf, was 2.2 % (bf16) below trace once trace offloaded."""
    est = trainmem.estimate("llama-3.2-1b", set=DEEP, precision=precision, offload_activations=True, **KW)
    tr = trace("llama-3.2-1b", set=DEEP, precision=precision, offload_activations=True,
               expandable_segments=True, **KW)
    assert abs(est.peak_allocated - tr.peak_allocated) <= 0.002 * tr.peak_allocated
    tr_kept = trace("llama-3.2-1b", set=DEEP, precision=precision, expandable_segments=True, **KW)
    est_kept = trainmem.estimate("llama-3.2-1b", set=DEEP, precision=precision, **KW)
    # layers 1 and 2's inputs leave the GPU; layer 0's is peft's embedding leaf, layer 3's stays in the
    # stash (the frozen final norm packs four offloadable tensors after it, one fewer than the stash holds)
    two = 2 * INPUT * (1 if precision == "bf16" else 2)
    assert _forward_end(tr_kept) - _forward_end(tr) == two == _forward_end(est_kept) - _forward_end(est)


def test_peft_leaf_only_for_transformers_models():
    t = resolve("llama-3.2-1b", set=DEEP, offload_activations=True, **KW).training
    assert peft_offload_leaf(t, "only", 2048.0) == (("first_layer.offload_leaf", -2048.0, 0.0),)
    tt = resolve("llama-3.2-1b", set=DEEP, framework="torchtune", offload_activations=True, **KW).training
    assert peft_offload_leaf(tt, "only", 2048.0) == ()   # torchtune's own model: no enable_input_require_grads
    full = resolve("llama-3.2-1b", set=DEEP, offload_activations=True, recompute="full").training
    assert peft_offload_leaf(full, "only", 2048.0) == ()
    assert offload_stash_keeps_top_input(t) and not offload_stash_keeps_top_input(full)


@pytest.mark.parametrize("version, left", [("0.3.1", 0), ("0.4.0", 1), (None, 1)])
def test_lora_offload_lowers_the_estimate_by_the_inputs(version, left):
    """torchtune's own model (the 1B's 16 layers at 2 x 2048): every checkpointed input leaves the GPU
    but, from v0.4.0 (parameters exempt from offloading), the top layer's, left in the stash."""
    kw = dict(framework="torchtune", batch_size=2, seq_len=2048, recompute="full", lora_rank=8)
    if version:
        kw["framework_version"] = version
    on = trainmem.estimate("llama-3.2-1b", offload_activations=True, **kw)
    off = trainmem.estimate("llama-3.2-1b", **kw)
    assert _forward_end(off) - _forward_end(on) == (16 - left) * 2 * 2048 * 2048 * 2


def test_offload_with_a_4bit_base_is_still_refused():
    with pytest.raises(TrainmemError) as e:
        trainmem.estimate("llama-3.2-1b", recompute="full", lora_rank=8, quantize="nf4", offload_activations=True)
    assert "--offload-activations" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, bound", [("torchtune_readme31_llama31_8b_lora_4090", 0.01),
                                         ("torchtune_flags_llama32_3b_lora", 0.05)])
def test_readme_lora_rows_with_offloading(name, bound):
    """Sep 2024 8B LoRA (1x 4090, 16.2 GiB): +6.29 % mapped without offloading; Nov 2024 3B LoRA
    (8.5 GiB): refused before (offloading with LoRA was not modelled)."""
    v = validate(PUBLISHED, ["estimate"], cases=[name])
    (c,) = [c for c in v.checks if c.primary]
    with open(os.path.join(PUBLISHED, name + ".json")) as f:
        assert json.load(f)["setup"]["offload_activations"] is True
    assert c.quantity == "peak_active" and abs(c.error) <= bound
