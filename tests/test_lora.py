"""LoRA as peft runs it: frozen base linears save no input, LoRA targets save their input in the
adapter's dtype, frozen norm weights save no normalised copy, adapters are fp32. Checked against
trace, which wraps the real transformers model with peft's get_peft_model on fake tensors."""
import pytest

import trainmem

pytest.importorskip("peft")
from trainmem.trace import trace  # noqa: E402

LLAMA = dict(set=["num_hidden_layers=8", "hidden_size=512", "intermediate_size=1024", "num_attention_heads=8",
                  "num_key_value_heads=4", "head_dim=64", "vocab_size=2048"], seq_len=1024, batch_size=2, lora_rank=16)
GPT2 = dict(set=["n_layer=8", "n_embd=256", "n_head=4", "vocab_size=2048"], seq_len=512, batch_size=2, lora_rank=8)
ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
CASES = [("llama-3.2-1b", LLAMA, {}), ("llama-3.2-1b", LLAMA, {"precision": "bf16"}),
         ("llama-3.2-1b", LLAMA, {"precision": "fp32"}), ("llama-3.2-1b", LLAMA, {"lora_targets": ALL}),
         ("gpt2", GPT2, {}), ("gpt2", GPT2, {"precision": "bf16", "lora_targets": "c_attn,c_proj,c_fc"}),
         # LoRA dropout (torchtune, litgpt: 0.05) and adapters in the model's half dtype (torchtune, litgpt)
         ("llama-3.2-1b", LLAMA, {"lora_dropout": 0.05}),
         ("llama-3.2-1b", LLAMA, {"precision": "bf16", "lora_dtype": "half", "lora_dropout": 0.05}),
         ("llama-3.2-1b", LLAMA, {"precision": "fp32", "lora_dropout": 0.1}),
         # every projection adapted under gradient checkpointing (most QLoRA/LoRA fine-tunes): the peak is
         # the top layer's recomputed forward (quantities.layer_moments.recompute_transients), -7.4% / -11.4% before
         ("llama-3.2-1b", LLAMA, {"lora_targets": ALL, "recompute": "full"}),
         ("llama-3.2-1b", LLAMA, {"lora_targets": ALL, "recompute": "full", "lora_dropout": 0.05}),
         ("llama-3.2-1b", LLAMA, {"lora_targets": ALL, "recompute": "full", "precision": "bf16",
                                  "lora_dropout": 0.05}),
         # GPT-2's last pack is its residual dropout's mask, after mlp.c_proj's adapter: -8.75% before
         ("gpt2", GPT2, {"precision": "bf16", "lora_targets": "c_attn,c_proj,c_fc", "recompute": "full",
                         "lora_dropout": 0.05})]


@pytest.mark.parametrize("model,base,extra", CASES, ids=lambda x: x if isinstance(x, str) else "")
def test_lora_estimate_agrees_with_peft_trace(model, base, extra, one_torch_thread):
    e = trainmem.estimate(model, **base, **extra)
    r = trace(model, device="cuda", **base, **extra)
    # what is left: the first layer's ops before its first adapter save nothing (their input needs
    # no gradient), which the per-layer estimate does not separate (1/8 of a norm here)
    # with LoRA dropout the first layer's unsaved pre-adapter ops weigh a little more (its masks too)
    peak_tol, fwd_tol = (0.03, 0.035) if extra.get("lora_dropout") else (0.025, 0.03)
    assert e.peak_allocated == pytest.approx(r.peak_allocated, rel=peak_tol)
    est = {(p.name, p.step): p for p in e.phases}
    for p in r.phases:
        tol = fwd_tol if p.name == "forward" else 0.001  # model states (fp32 or half adapters) exactly
        assert est[(p.name, p.step)].allocated == pytest.approx(p.allocated, rel=tol), (p.name, p.step)


def test_frozen_linears_save_no_input():
    # all seven projections adapted vs only q and v: the five extra targets each save one input copy
    # (bf16 under autocast) and a rank-r result, nothing else changes in the layer
    qv = trainmem.estimate("llama-3.2-1b", seq_len=2048, lora_rank=16)
    every = trainmem.estimate("llama-3.2-1b", seq_len=2048, lora_rank=16, lora_targets=ALL)
    n, h, f, r, layers = 2048, 2048, 8192, 16, 16
    inputs = (2 * h + 2 * h + f) * n * 2          # k, o (h wide), gate, up (h), down (f) inputs in bf16
    ranks = 5 * r * n * 2
    assert (every.extra["activations_per_layer"] - qv.extra["activations_per_layer"]
            == pytest.approx(inputs + ranks, abs=64))
    assert layers * (inputs + ranks) < every.peak_allocated


def test_real_cpu_run_with_peft(one_torch_thread):
    # measure runs the real peft model; a frozen base has no gradients or optimizer states
    from trainmem.errors import TrainmemError
    from trainmem.measure.runner import measure
    o = dict(set=["n_layer=2", "n_embd=128", "n_head=4", "vocab_size=512"], seq_len=128, batch_size=2)
    lora = measure("gpt2", device="cpu", lora_rank=4, **o)
    full = measure("gpt2", device="cpu", **o)
    assert lora.peak_allocated < full.peak_allocated
    with pytest.raises(TrainmemError, match="--device cuda"):
        trace("gpt2", device="cpu", lora_rank=4, **o)


def test_torchtune_preset_builds_half_adapters():
    r = trainmem.estimate("llama-3.2-1b", framework="torchtune", lora_rank=8)
    assert r.training.lora_dtype == "half" and r.training.precision == "bf16"
    assert trainmem.estimate("llama-3.2-1b", framework="torchtune", lora_rank=8,
                             lora_dtype="fp32").training.lora_dtype == "fp32"  # an explicit option wins
    assert trainmem.estimate("llama-3.2-1b", lora_rank=8).training.lora_dtype is None  # peft: fp32


def test_chunked_loss_runs_through_the_peft_wrapper(one_torch_thread):
    # torchtune's chunked output needs the decoder under peft's wrapper (get_base_model): the trace
    # runs, and its model-state phases are the estimate's
    o = dict(LLAMA, loss="chunked", loss_chunks=4)
    r = trace("llama-3.2-1b", device="cuda", **o)
    e = trainmem.estimate("llama-3.2-1b", **o)
    est = {(p.name, p.step): p for p in e.phases}
    for p in r.phases:
        if p.name != "forward":
            assert est[(p.name, p.step)].allocated == pytest.approx(p.allocated, rel=0.001), (p.name, p.step)



def test_recomputed_forward_is_a_backward_moment():
    # full recompute: the top layer's recomputation stops at down_proj's lora_B pack (the layer's last),
    # where its frames hold, beyond every saved tensor (bf16-amp, per token, h 512, f 1024): the SwiGLU
    # product down_proj got (bf16, 2f), peft's fp32 copy of it (4f), the base output (bf16, 2h) and
    # LlamaMLP's input (the fp32 norm output, 4h); with the layer's output gradient (fp32, 4h), its
    # bf16 cast for the MLP branch (2h) and MulBackward0's scaled gradient (bf16, 2h)
    from trainmem.estimate.quantities.build import quantities
    from trainmem.estimate.quantities.layer_moments import recompute_transients
    h, f = 512, 1024
    full = trainmem.estimate("llama-3.2-1b", **LLAMA, lora_targets=ALL, recompute="full")
    assert full.peak_where == "layer[7].mlp.down_proj.lora_B"
    lc = quantities(full.model, full.training, "first").detail.layer
    moments = {name: a for name, a, _b, _blocks in lc.recompute_moments}
    assert moments["mlp.down_proj.lora_B"] == (2 * f + 4 * f + 2 * h + 4 * h) + (4 * h + 2 * h + 2 * h)
    assert len(recompute_transients(full.training, lc)) == len(lc.recompute_moments)
    # without recompute nothing is recomputed: the layer's transients are its backward ops' alone
    none = trainmem.estimate("llama-3.2-1b", **LLAMA, lora_targets=ALL)
    assert recompute_transients(none.training, lc) == ()
    assert none.peak_where != full.peak_where


def test_peft_wrapping_shows_no_library_deprecation_warning(one_torch_thread):
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps the model: a
    FutureWarning the user cannot act on, kept off trace's stderr (workload.apply_lora)."""
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = trace("llama-3.2-1b", set=["num_hidden_layers=1"], seq_len=32, batch_size=1, lora_rank=4)
    assert r.peak_allocated > 0
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in seen]
