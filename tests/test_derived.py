"""Architectures without hand-written formulas: profiles read from transformers, coefficients derived
from traces of the real model (trainmem.trace.derive), and the engine's estimate from them.

The checks: the derived estimate agrees with a trace of the same setup (the real model, all its
layers, two steps with the optimizer) over model types, precisions, attention, recompute and
accumulation; on the hand-written families the derived coefficients reproduce the hand formulas;
what derivation cannot do is one line; the shipped profiles and coefficients are current.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest

import trainmem
from trainmem.estimate import derived
from trainmem.spec import catalogue_names, load_config
from trainmem.spec.profile import read_cached

warnings.filterwarnings("ignore")

# the transformers default config of each type, cut to 3 layers (MoE types to 8 experts)
TYPES = {
    "qwen3": {}, "gemma2": {}, "gemma3_text": {}, "phi": {}, "gpt_neox": {}, "olmo2": {}, "starcoder2": {},
    "granite": {}, "falcon": {}, "qwen3_moe": {"num_experts": 8, "mlp_only_layers": [0]},
    "deepseek_v2": {"num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_routed_experts": 8,
                    "moe_intermediate_size": 1408},  # the default 1407 breaks grouped_mm in pure bf16
}
SETUPS = [dict(precision="bf16-amp"), dict(precision="bf16"), dict(precision="fp32", attention="eager"),
          dict(precision="bf16-amp", recompute="full"), dict(precision="bf16-amp", grad_accum=2)]
QUICK = [("qwen3", 0), ("gemma2", 1), ("phi", 3), ("deepseek_v2", 4), ("gpt_neox", 2)]


def _cfg(model_type: str) -> dict:
    return dict(model_type=model_type, num_hidden_layers=3, **TYPES[model_type])


def _agreement(model_type: str, setup: dict, b: int = 2, s: int = 1024) -> float:
    cfg = _cfg(model_type)
    est = trainmem.estimate(cfg, batch_size=b, seq_len=s, **setup)
    tr = trainmem.trace(cfg, batch_size=b, seq_len=s, **setup)
    return est.peak_allocated / tr.peak_allocated - 1


@pytest.mark.parametrize("model_type,setup", QUICK)
def test_derived_estimate_agrees_with_trace(model_type, setup):
    assert abs(_agreement(model_type, SETUPS[setup])) <= 0.005


#: micro-batch 1, which has coefficients of its own (``derived.batch1``: some tensors are views at
#: batch 1 that larger batches copy): (type, setup) pairs over types and setups. Falcon was +1.11%
#: (bf16-amp) and +0.20% (full recompute) with the batch >= 2 coefficients: SDPA's math kernel
#: (``aten/src/ATen/native/transformers/attention.cpp`` ``_scaled_dot_product_attention_math``)
#: multiplies its multi-query key, one head, expanded to the query's 71, and ``matmul`` reshapes the
#: expanded key and value for ``bmm``: a view at batch 1, a copy of all 71 heads at batch 2 and more
#: (``aten/src/ATen/native/LinearAlgebra.cpp`` ``_matmul_impl``); measured +0.22% and +0.001% since
QUICK_BATCH1 = [("falcon", 0), ("falcon", 3), ("qwen3", 0), ("gemma2", 1), ("phi", 3), ("gpt_neox", 2)]


@pytest.mark.parametrize("model_type,setup", QUICK_BATCH1)
def test_derived_estimate_agrees_with_trace_at_batch_1(model_type, setup):
    assert abs(_agreement(model_type, SETUPS[setup], b=1, s=2048)) <= 0.005


def test_batch_1_has_its_own_coefficients():
    """At batch 1 the estimate reads coefficients fitted on batch-1 points (a key of their own), at
    larger batches those fitted on batches 2 to 4; Falcon's multi-query attention saves less per
    token at batch 1 (its expanded key and value are views there)."""
    from trainmem.spec.resolve import resolve
    r1 = resolve(_cfg("falcon"), batch_size=1, seq_len=2048, precision="bf16-amp")
    r2 = r1.replace(batch_size=2)
    assert derived.batch1(r1.model, r1.training) and not derived.batch1(r2.model, r2.training)
    assert derived.key(r1.model, r1.training) != derived.key(r2.model, r2.training)
    one, more = derived.coefficients(r1.model, r1.training), derived.coefficients(r2.model, r2.training)
    assert one.get("batch") == 1 and "batch" not in more
    assert one["kinds"]["k0"]["tok"] < more["kinds"]["k0"]["tok"] + more["kinds"]["k0"]["pos"] / 2048


def test_batch_1_fit_that_misses_its_held_out_point_is_one_line(monkeypatch):
    """The batch-1 fit (three sequences at batch 1) is checked on a fourth as the others are."""
    from trainmem.trace import derive
    real = derive._runs

    def off_at_the_held_out_point(*args, **kwargs):
        runs = real(*args, **kwargs)
        runs[-1]["embed"] = int(runs[-1]["embed"] * 1.1) + 10 ** 6
        return runs
    monkeypatch.setattr(derive, "_runs", off_at_the_held_out_point)
    r = trainmem.resolve(dict(_cfg("qwen3"), hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64), batch_size=1, seq_len=512)
    assert derive.batch1_points(r.model, 2048) == [(1, 2048), (1, 3072), (1, 4096), (1, 2560)]
    with pytest.raises(trainmem.TrainmemError, match="embed bytes is not polynomial") as e:
        derive.derive_coefficients(r.model, derived._canonical(r.training, r.model), batch1=True)
    assert "\n" not in str(e.value)


def test_batch_1_without_its_stored_set_nor_torch_takes_the_stored_one_with_a_note(monkeypatch):
    """A setup whose batch-1 set is stored nowhere, where the derivation cannot run (no torch), is
    estimated with its stored batch >= 2 set, and says so in one warning."""
    from trainmem.estimate import quantities
    from trainmem.spec.resolve import resolve
    r = resolve("qwen3-0.6b", seq_len=2048, precision="bf16")
    one, more = derived.key(r.model, r.training), derived.key(r.model, r.training, False)
    # (stored nowhere: nor under the previous versions' keys, which are read where the derivation cannot run)
    old = {derived.key(r.model, r.training, version=v) for v in derived.PREVIOUS_VERSIONS}
    real = derived.read_cached
    monkeypatch.setattr(derived, "read_cached", lambda kind, k: None if k == one or k in old else real(kind, k))
    monkeypatch.setitem(sys.modules, "trainmem.trace.derive", None)  # import fails as without torch

    def fresh():
        derived._coefficients.cache_clear()
        derived._NOTES.clear()
        quantities.build.clear_cache()
    fresh()
    try:
        est = trainmem.estimate("qwen3-0.6b", seq_len=2048, precision="bf16")
        assert any("no micro-batch-1 coefficients" in w for w in est.warnings)
        assert real("coefficients", more) is not None
    finally:
        monkeypatch.undo()
        fresh()


def test_layout_arrays_with_batch_1_and_more_equal_single_estimates():
    """fit and the planner estimate arrays of micro-batches: the rows at batch 1 take the batch-1
    coefficients, the others the batch >= 2 ones, as single estimates do."""
    import numpy as np
    from trainmem.estimate.engine import estimate, estimate_layouts
    from trainmem.spec.resolve import resolve
    r = resolve("qwen3-0.6b", precision="bf16-amp", seq_len=2048)
    batches = np.array([1, 2, 1, 4])
    out = estimate_layouts(r.model, r.training, batch_size=batches)
    for b, p in zip(batches, out["peak_allocated"]):
        assert p == estimate(r.model, r.replace(batch_size=int(b)).training).peak_allocated


#: (batch, sequence) of the grid: a long sequence and a larger batch of shorter ones, and batch 1
#: (its own coefficients: ``QUICK_BATCH1``)
SIZES = ((3, 1536), (4, 768), (1, 3072))
GRID = [(ty, i, size) for ty in sorted(TYPES) for i in range(len(SETUPS)) for size in SIZES]


@pytest.mark.slow
@pytest.mark.parametrize("model_type,setup,size", GRID)
def test_derived_estimate_agrees_with_trace_grid(model_type, setup, size):
    """Must-show 2 of the any-architecture issue: within 0.5% over types and setups. (Falcon under
    full recompute was +0.83% at b=3, s=1536: its first layer's input, the word embeddings' fp32
    output that the input norm saves, was counted in the embedding side and again as the
    checkpoint's kept input, and the recomputed layer counted its output, which only the next
    layer's norm saved and a recomputation does not make: +0.035% since.)"""
    assert abs(_agreement(model_type, SETUPS[setup], *size)) <= 0.005


@pytest.mark.parametrize("model_type,targets", [("qwen3", None), ("gpt_neox", None),
                                                ("olmo2", ["q_proj", "v_proj"])])
def test_derived_lora_estimate_agrees_with_trace(model_type, targets):
    """peft's adapters on the real model; the first layer (frozen input: GPT-NeoX's parallel MLP
    saves nothing there) is measured apart from the typical layer."""
    setup = dict(precision="bf16", lora_rank=16, lora_targets=targets)
    assert abs(_agreement(model_type, setup, b=3, s=1536)) <= 0.005


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("setup", [dict(precision="bf16-amp"), dict(precision="bf16", attention="eager"),
                                   dict(precision="bf16-amp", recompute="full", batch_size=4),
                                   dict(precision="bf16-amp", dp=8, zero=3)])
def test_derived_coefficients_reproduce_the_hand_formulas(name, setup):
    """The same Llama/Qwen2 config through the derivation gives the hand-written layer's bytes
    (measured: at most 0.072%)."""
    cfg = dict(load_config(name)[1], _trainmem={"family": "derived"})
    opts = dict(dict(batch_size=1, seq_len=2048), **setup)
    hand = trainmem.estimate(name, **opts).peak_allocated
    der = trainmem.estimate(cfg, **opts).peak_allocated
    assert abs(der / hand - 1) <= 0.001


def test_sliding_window_regimes_are_derived_separately():
    """Above Mistral's 4096-token window transformers builds a sliding mask (SDPA leaves its
    causal kernels): the derivation on that side agrees with the trace."""
    cfg = dict(load_config("mistral-7b")[1], num_hidden_layers=2, _trainmem={"family": "derived"})
    for s in (2048, 8192):
        est = trainmem.estimate(cfg, batch_size=1, seq_len=s, precision="bf16-amp")
        tr = trainmem.trace(cfg, batch_size=1, seq_len=s, precision="bf16-amp")
        assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.005
    below = trainmem.estimate(cfg, batch_size=1, seq_len=2048, precision="bf16-amp")
    above = trainmem.estimate(cfg, batch_size=1, seq_len=8192, precision="bf16-amp")
    assert derived.regime(below.model, below.training) == "below"
    assert derived.regime(above.model, above.training) == "above"


# ----- what derivation cannot do: one line ---------------------------------------------------
@pytest.mark.parametrize("args,message", [
    (["gemma-2-9b", "--tp", "2"], "--tp 2 is not modelled for an architecture without hand-written formulas"),
    (["gemma-2-2b", "--cp", "2", "--seq-len", "4096"], "--cp 2 is not modelled"),
])
def test_cli_refuses_what_derivation_does_not_cover(capsys, args, message):
    from trainmem.cli import main
    assert main(["estimate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.slow
def test_sequence_dependent_op_count_is_derived_at_the_point():
    """Mamba's reference scan loops over the sequence: its ops change with the length, so the
    coefficients cannot be fitted; the estimate derives them at the setup's batch and sequence
    instead and says so (``derived.point_at``; tests/test_pointderive.py checks it against trace)."""
    est = trainmem.estimate(dict(model_type="mamba", num_hidden_layers=2, hidden_size=256, vocab_size=1000),
                            batch_size=2, seq_len=256)
    assert any("not polynomial in the batch and sequence" in w and "batch (2) and sequence (256)" in w
               for w in est.warnings)


def test_unknown_model_type_is_one_line():
    with pytest.raises(trainmem.TrainmemError, match="unsupported model_type 'no_such_arch'"):
        trainmem.estimate(dict(model_type="no_such_arch", architectures=["NoSuchForCausalLM"]))


def test_failing_step_is_one_line():
    """A config whose real step fails on fake tensors (grouped_mm needs 16-byte strides) is one line."""
    cfg = dict(model_type="deepseek_v2", num_hidden_layers=2, num_experts_per_tok=2, n_routed_experts=8,
               first_k_dense_replace=1)
    with pytest.raises(trainmem.TrainmemError, match="its training step fails when traced"):
        trainmem.trace(cfg, batch_size=1, seq_len=256, precision="bf16", steps=1)


@pytest.mark.parametrize("command", ["estimate", "trace"])
def test_cli_failing_step_is_one_line_and_exit_2(capsys, tmp_path, command):
    """The same config from a file at the command line: the estimate (which derives its coefficients
    by tracing) and the trace each answer one line, exit status 2."""
    from trainmem.cli import main
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
                                    num_hidden_layers=2, num_experts_per_tok=2, n_routed_experts=8,
                                    first_k_dense_replace=1)))
    assert main([command, str(path), "--precision", "bf16", "--batch-size", "1", "--seq-len", "256"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its training step fails when traced" in err[0], err


# ----- the shipped files ----------------------------------------------------------------------
def _derived_catalogue() -> list[str]:
    """The derived entries the estimate covers (a vision-language model is traced only: no coefficients)."""
    return [n for n in catalogue_names() if trainmem.resolve_model(n).family == "derived"
            and not trainmem.resolve_model(n).is_vlm]


def test_catalogue_has_at_least_45_entries_over_15_types():
    names = catalogue_names()
    types = {trainmem.resolve_model(n).model_type for n in names}
    assert len(names) >= 45 and len(types) >= 15


#: bytes per token an encoder-decoder's re-derived coefficients may differ by from the shipped ones
#: (float64 round-off of its scaled least squares, ``test_shipped_coefficients_are_current``)
ENCDEC_ROUNDOFF = 1e-4


def _default_size(m) -> dict:
    """The default setup's size options: an image model's sequence comes from its image size."""
    return {} if m.is_image or m.is_speech_seq2seq else {"seq_len": min(2048, m.max_positions)}


@pytest.mark.parametrize("name", ["qwen3-0.6b", "gemma-2-2b", "phi-2", "t5-base", "flan-t5-large",
                                  "vit-base-patch16-224", "whisper-tiny", "distilbert-base-uncased",
                                  "deberta-v3-base", "modernbert-base"])
def test_shipped_coefficients_are_current(name):
    """Re-deriving gives the shipped coefficients (else: make ship-derived)."""
    from trainmem.trace.derive import derive_coefficients
    r = trainmem.estimate(name, **_default_size(trainmem.resolve_model(name)))
    shipped = read_cached("coefficients", derived.key(r.model, r.training, False))  # the batch >= 2 set
    assert shipped is not None
    fresh = derive_coefficients(r.model, derived._canonical(r.training, r.model), derived.regime(r.model, r.training))
    if "terms" in fresh:  # an encoder-decoder's, fitted in its two lengths: compared at two ratios
        # (its least squares is column-scaled over terms from 1 to 10^11, ``derive._lstsq``: the float64
        # round-off of the read-back values depends on the machine's LAPACK, 1.6e-6 bytes per token on
        # one CI machine for T5's; a stale set differs by whole bytes)
        for ratio in (1.0, 0.25):
            shipped_at, fresh_at = derived.at_lengths(shipped, ratio), derived.at_lengths(fresh, ratio)
            for kind, v in fresh_at["kinds"].items():
                assert shipped_at["kinds"][kind]["tok"] == pytest.approx(v["tok"], rel=1e-9)
                flat = [x for tr in v["transients"] for x in tr]
                assert [x for tr in shipped_at["kinds"][kind]["transients"] for x in tr] == \
                    pytest.approx(flat, rel=1e-9, abs=ENCDEC_ROUNDOFF)
            assert shipped_at["embed"] == pytest.approx(fresh_at["embed"], rel=1e-9, abs=ENCDEC_ROUNDOFF)
            assert shipped_at["ssq"] == pytest.approx(fresh_at["ssq"], rel=1e-9, abs=ENCDEC_ROUNDOFF)
            for name, base in fresh_at["moment_base"].items():
                assert shipped_at["moment_base"][name] == pytest.approx(base, rel=1e-9, abs=ENCDEC_ROUNDOFF)
        assert shipped.get("logits_bytes") == fresh.get("logits_bytes")
        return
    for kind, v in fresh["kinds"].items():
        assert shipped["kinds"][kind]["tok"] == pytest.approx(v["tok"], rel=1e-9)
        flat = [x for tr in v["transients"] for x in tr]
        assert [x for tr in shipped["kinds"][kind]["transients"] for x in tr] == pytest.approx(flat, rel=1e-9, abs=1e-6)
    assert shipped["embed"] == pytest.approx(fresh["embed"], rel=1e-9, abs=1e-6)
    assert shipped.get("ssq", {}) == pytest.approx(fresh.get("ssq", {}), rel=1e-9, abs=1e-6)
    assert shipped.get("logits_bytes") == fresh.get("logits_bytes")


@pytest.mark.parametrize("name", ["qwen3-0.6b", "vit-base-patch16-224"])
def test_shipped_batch_1_coefficients_are_current(name):
    """Re-deriving the micro-batch-1 set gives the shipped one (else: make ship-derived)."""
    from trainmem.trace.derive import derive_coefficients
    r = trainmem.resolve(name, batch_size=1, **_default_size(trainmem.resolve_model(name)))
    shipped = read_cached("coefficients", derived.key(r.model, r.training))
    assert shipped is not None and shipped.get("batch") == 1
    fresh = derive_coefficients(r.model, derived._canonical(r.training, r.model), derived.regime(r.model, r.training),
                                batch1=True)
    for kind, v in fresh["kinds"].items():
        assert shipped["kinds"][kind]["tok"] == pytest.approx(v["tok"], rel=1e-9)
        flat = [x for tr in v["transients"] for x in tr]
        assert [x for tr in shipped["kinds"][kind]["transients"] for x in tr] == pytest.approx(flat, rel=1e-9, abs=1e-6)
    assert shipped["embed"] == pytest.approx(fresh["embed"], rel=1e-9, abs=1e-6)


def test_every_derived_catalogue_entry_has_shipped_coefficients():
    """The default setup's batch >= 2 set and, but for encoder-decoders, its micro-batch-1 set."""
    missing = []
    for name in _derived_catalogue():
        m = trainmem.resolve_model(name)
        from trainmem.spec.resolve import resolve
        t = resolve(name, **_default_size(m)).training
        for one in (False, True) if derived.batch1(m, t) else (False,):
            if read_cached("coefficients", derived.key(m, t, one)) is None:
                missing.append(f"{name}{' (batch 1)' if one else ''}")
    assert not missing, f"run make ship-derived: {missing}"


def test_catalogue_estimate_needs_no_torch(tmp_path):
    code = ("import sys, trainmem\n"
            "for n in ['qwen3-8b', 'gemma-2-9b', 'deepseek-v3', 'phi-3-mini']:\n"
            "    trainmem.estimate(n, batch_size=2, seq_len=2048)\n"
            "    trainmem.estimate(n, batch_size=1, seq_len=2048)\n"  # the shipped micro-batch-1 sets
            "print(json.dumps(['torch' in sys.modules, 'transformers' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True,
                         env={"TRAINMEM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]


#: the encoder entries (masked-LM heads of derived architectures) whose default setups ship their coefficients
ENCODERS = ["distilbert-base-uncased", "deberta-v3-base", "deberta-v3-large", "modernbert-base", "modernbert-large",
            "roberta-base"]


def test_encoder_catalogue_estimate_needs_no_torch(tmp_path):
    """The encoder entries estimate from their shipped profiles and coefficients: with torch and
    transformers unimportable (a derivation would need both) and an empty cache, each default setup (its
    micro-batch-1 set, not the batch >= 2 set that stands in for it: ``derived._coefficients``),
    its batch >= 2 set and fp32 with full recompute (refused on DeBERTa-v2: ``derived.check``) answer."""
    import os
    src = os.path.dirname(os.path.dirname(trainmem.__file__))  # this checkout's package, not an installed one
    code = ("import importlib.abc, json, sys\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'transformers'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import trainmem\n"
            "out = {}\n"
            f"for n in {ENCODERS!r}:\n"
            "    full = {} if n.startswith('deberta') else {'recompute': 'full'}\n"  # (refused on DeBERTa-v2)
            "    for opts in ({}, {'batch_size': 2}, dict(full, precision='fp32')):\n"
            "        r = trainmem.estimate(n, **opts)\n"
            "        assert not [w for w in r.warnings if 'micro-batch-1 coefficients' in w], (n, opts)\n"
            "        out[n] = r.peak_allocated\n"
            "print(json.dumps([out, 'torch' in sys.modules, 'transformers' in sys.modules]))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"TRAINMEM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": src})
    assert res.returncode == 0, res.stderr[-2000:]
    out, torch_in, tf_in = json.loads(res.stdout.strip().splitlines()[-1])
    assert (torch_in, tf_in) == (False, False)
    assert sorted(out) == sorted(ENCODERS) and all(peak > 0 for peak in out.values())
    assert not (tmp_path / "coefficients").exists()  # nothing derived into the cache


@pytest.mark.parametrize("name", ENCODERS)
def test_encoder_entries_are_masked_lm_of_their_type(name):
    """Each entry trains its checkpoint's masked-LM head as a derived architecture (DeBERTa-v3's hub config
    names no class: its entry names the type's natural head, DebertaV2ForMaskedLM)."""
    m = trainmem.resolve_model(name)
    assert (m.family, m.head) == ("derived", "masked-lm")
    assert m.model_type in ("distilbert", "deberta-v2", "modernbert", "roberta")


@pytest.mark.parametrize("setup", [dict(precision="bf16", quantize="nf4", lora_rank=16),
                                   dict(precision="bf16-amp", quantize="nf4-dq", lora_rank=8, batch_size=4)])
def test_derived_qlora_follows_the_hand_formulas(setup):
    """4-bit bases on a derived architecture: the frozen half base's activations plus the
    dequantized weights (estimate/derived.py); on Llama-3.1-8B read as derived, within 1% of the
    hand formulas' QLoRA (measured -0.32%, -0.33%)."""
    cfg = dict(load_config("llama-3.1-8b")[1], _trainmem={"family": "derived"})
    opts = dict(dict(batch_size=1, seq_len=2048), **setup)
    hand = trainmem.estimate("llama-3.1-8b", **opts).peak_allocated
    der = trainmem.estimate(cfg, **opts).peak_allocated
    assert abs(der / hand - 1) <= 0.01


#: a small GPT-NeoX (parallel residual: two norms) under lit-gpt's QLoRA loop: every linear 4-bit under
#: Fabric (the head too), the loop holding the previous micro-batch's loss (its graph) through the next forward
OLD_BNB_NEOX = dict(model_type="gpt_neox", num_hidden_layers=4, hidden_size=1024, intermediate_size=4096,
                    num_attention_heads=8, vocab_size=2048, use_cache=False)
OLD_BNB_SETUP = dict(batch_size=2, seq_len=1024, precision="bf16", lora_rank=8, lora_targets="query_key_value",
                     lora_dtype="half", quantize="nf4", quantize_via="fabric", hold_output="step", grad_accum=2,
                     optimizer="paged-adamw")


def test_derived_decoder_under_old_bitsandbytes_keeps_each_4bit_linears_input():
    """bitsandbytes < 0.43.2 ``MatMul4Bit`` keeps its input on the graph (``ctx.tensors = (A, B)``):
    the derivation traces it so and measures what the graph keeps after backward (``trace.derive.
    _graph_held``). GPT-NeoX's four 4-bit linears take four distinct bf16 inputs: the attention norm's
    output (h), the attention output (h), the MLP norm's output (h) and the GELU output (4h): 2 x 7h
    bytes per token (transformers 5.24 ``modeling_gpt_neox.py``). In the first layer the two norms'
    inputs are the frozen embedding's output, which needs no gradient, so only the attention output is
    kept (2 x 6h less); the 4-bit head keeps the final norm's output (2 x h)."""
    h = OLD_BNB_NEOX["hidden_size"]
    r = trainmem.resolve(OLD_BNB_NEOX, bitsandbytes_version="0.41.1", **OLD_BNB_SETUP)
    doc = derived.coefficients(r.model, r.training)
    assert doc["kinds"]["k0"]["graph"] == pytest.approx(2 * 7 * h, abs=1.0)
    assert doc["first_graph"] == pytest.approx(-2 * 6 * h, abs=1.0)
    assert doc["head_graph"] == pytest.approx(2 * h, abs=1.0)
    new = trainmem.resolve(OLD_BNB_NEOX, **OLD_BNB_SETUP)  # bitsandbytes >= 0.43.2: nothing kept
    assert derived.layer_coefs(new.model, new.training, "first").graph_held == 0.0


def test_derived_decoder_under_old_bitsandbytes_agrees_with_trace():
    """The estimate of a derived decoder's QLoRA under bitsandbytes 0.41.1 (it was refused: the
    coefficients were traced with a MatMul4Bit that keeps no input) agrees with trace (measured
    -0.01 %; the peak is the next micro-batch's forward, with the previous graph's inputs alive)."""
    kw = dict(OLD_BNB_SETUP, bitsandbytes_version="0.41.1")
    e = trainmem.estimate(OLD_BNB_NEOX, **kw)
    t = trainmem.trace(OLD_BNB_NEOX, **kw)
    assert e.component("activations.bnb_matmul4bit_inputs") > 0
    assert abs(e.peak_allocated / t.peak_allocated - 1) <= 0.005, (e.peak_allocated, t.peak_allocated)


def test_derived_qlora_with_old_bitsandbytes_off_decoders_is_one_line():
    """Only decoder-only causal LMs have their graph-held inputs measured; other heads are refused."""
    with pytest.raises(trainmem.TrainmemError, match="bitsandbytes < 0.43.2") as e:
        trainmem.estimate("distilbert-base-uncased", quantize="nf4", lora_rank=8, lora_targets="q_lin,v_lin",
                          bitsandbytes_version="0.42.0")
    assert "\n" not in str(e.value)


def test_layout_arrays_across_the_sliding_window_equal_single_estimates():
    """fit and the planner estimate arrays of sequences; on both sides of Gemma 2's 4096-token
    window each row takes its side's coefficients, as a single estimate does."""
    import numpy as np
    from trainmem.estimate.engine import estimate, estimate_layouts
    from trainmem.spec.resolve import resolve
    r = resolve("gemma-2-2b", precision="bf16-amp", seq_len=2048)
    seqs = np.array([1024, 2048, 4096, 8192])
    out = estimate_layouts(r.model, r.training, seq_len=seqs)
    for s, p in zip(seqs, out["peak_allocated"]):
        assert p == estimate(r.model, r.replace(seq_len=int(s)).training).peak_allocated


def test_derived_model_takes_a_shifted_logits_copy():
    """--loss-shift logits on a derived architecture: the derivation traces the layers with the
    model's own loss and no shift (trace/derive.py), so the option reaches the loss terms only
    (it was refused: the derivation kept the shift beside the loss it replaced)."""
    import trainmem
    # a config no shipped coefficients cover: the estimate derives it (OPT, as a fixture of the set)
    opt = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "ffn_dim": 1024, "vocab_size": 32000, "max_position_embeddings": 1024,
           "word_embed_proj_dim": 256}
    opts = dict(batch_size=4, seq_len=512, precision="fp16", loss="half", optimizer="sgd")
    shifted = trainmem.estimate(opt, loss_shift="logits", **opts)  # first: the derivation runs for it
    plain = trainmem.estimate(opt, **opts)
    # the half copy lives while log_softmax runs: the forward's peak, not backward's (quantities.loss.loss_bytes)
    fwd = [next(p.peak for p in r.phases if p.name == "forward" and p.step == 2) for r in (plain, shifted)]
    assert fwd[1] - fwd[0] == 4 * 512 * 32000 * 2


def _catalogue_types() -> dict[str, str]:
    """One catalogue entry per model type (the first by name)."""
    out: dict[str, str] = {}
    for name in catalogue_names():
        out.setdefault(trainmem.resolve_model(name).model_type, name)
    return out


def _cut_to(name: str, k: int) -> dict:
    """The catalogue entry's config with at most ``k`` layers per stack (its widths, heads and
    vocabulary kept; per-layer lists such as ``layer_types`` cut with it)."""
    from trainmem.trace.derive import _cut
    m = trainmem.resolve_model(name)
    cfg = dict(load_config(name)[1])
    dec = m.decoder_layers
    return _cut(cfg, m.num_layers, min(k, dec, m.num_layers - dec) if dec else min(k, m.num_layers), dec)


#: measured, not yet within 0.5% (none: phi-2's +0.73% was the default allocator's 2 MiB rounding of its
#: tensors over 10 MiB, which the estimate applied against a trace with expandable segments; both now run
#: in that mode, --expandable-segments)
CATALOGUE_GAPS: dict[str, str] = {}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [
    pytest.param(ty, marks=pytest.mark.xfail(strict=True, reason=CATALOGUE_GAPS[ty])) if ty in CATALOGUE_GAPS
    else ty for ty in sorted(_catalogue_types())])
def test_every_catalogue_model_type_agrees_with_trace(model_type):
    """Each model type of the catalogue (hand-written families and derived architectures), its
    first entry cut to 4 layers (an encoder-decoder to 2 + 2; DeepSeek-V3 keeps one MoE layer after
    its 3 dense ones), bf16-amp, batch 2 x 512 tokens (an image model at its image size; a
    vision-language model 2 x 1024 with one image per sample): the
    estimate within 0.5% of the trace, both with expandable segments (so that the allocator's unsplit
    1-10 MiB block remainders, which the estimate does not place, do not enter, and both charge each
    tensor its 512 B-rounded block)."""
    name = _catalogue_types()[model_type]
    cfg = _cut_to(name, 2 if trainmem.resolve_model(name).is_encoder_decoder else 4)
    m = trainmem.resolve_model(cfg)
    size = {} if m.is_image else {"target_len": 128} if m.is_speech_seq2seq else {"seq_len": 512}
    if m.is_vlm:  # one image per sample within the tokens: LLaVA-1.5's 576, Qwen2.5-VL's 64 at 224 px
        size = dict(seq_len=1024, **({"image_size": 224} if model_type.startswith("qwen2") else {}))
    setup = dict(batch_size=2, precision="bf16-amp", expandable_segments=True, **size)
    est = trainmem.estimate(cfg, **setup).peak_allocated
    tr = trainmem.trace(cfg, **setup).peak_allocated
    assert abs(est / tr - 1) <= 0.005, (name, est / tr - 1)


@pytest.mark.parametrize("precision", ["bf16-amp", "bf16"])
def test_derived_kv_cache_is_the_output_cache_of_the_installed_release(precision):
    """The derivation finds the KV cache on the model output whatever the release calls the field
    (``cache`` from 5.24, ``past_key_values`` before): a Qwen3 layer's cache holds its keys and values,
    the keys fp32 under autocast (rotary's fp32 cos/sin), the values half from 5.24
    (``spec.tf_releases.cache_values_own_dtype``), fp32 before."""
    from trainmem.spec.tf_releases import cache_values_own_dtype, code_release
    from trainmem.trace import derive
    r = trainmem.resolve(dict(_cfg("qwen3"), hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64), precision=precision, seq_len=256)
    doc = derive.derive_coefficients(r.model, derived._canonical(r.training, r.model))
    kv = r.model.kv_size
    if precision == "bf16":
        want = 2 * kv * 2
    else:
        want = kv * 4 + kv * (2 if cache_values_own_dtype(code_release(None)) else 4)
    assert {k: round(v["cache"], 6) for k, v in doc["kinds"].items()} == {k: want for k in doc["kinds"]}


def test_coefficient_keys_name_the_traced_releases_kv_cache(monkeypatch):
    """The derived coefficients' key says which KV cache the installed transformers' code built (the
    traces run it): 4.56-5.23's copies (the keys shipped before), earlier releases' references, 5.24's
    half values under autocast; a run without a cache (full recompute) or without autocast keeps one key."""
    r = trainmem.resolve("qwen3-0.6b")
    amp, pure, full = r.training, replace(r.training, precision="bf16"), replace(r.training, recompute="full")

    def keys(release):
        monkeypatch.setattr(derived, "code_release", lambda _v: release)
        return [derived.key(r.model, t) for t in (amp, pure, full)]
    k523, k524, k445 = keys((5, 23)), keys((5, 24)), keys((4, 45))
    assert k523[0] != k524[0] and k523[1:] == k524[1:]   # only the amp key with a cache moves at 5.24
    assert k445[0] not in (k523[0], k524[0]) and k445[1] != k523[1] and k445[2] == k523[2]


def test_mpt_context_bounds_its_sequences_and_its_derivation():
    """MPT builds its ALiBi bias for ``max_seq_len`` positions and slices it to the keys, so a longer
    sequence fails in the real model: the derivation's points stay within it (they reached 4096 and
    the step failed to broadcast), a longer ``--seq-len`` is refused in one line, and the estimate
    within the context agrees with the trace (MPT's own vocabulary, 50432: the peak is the loss's; with
    a 1000-token vocabulary, whose peak is the last layer's attention backward, the estimate is
    +0.9..+2.1% over the trace: not diagnosed)."""
    cfg = dict(model_type="mpt", n_layers=4, d_model=1024, n_heads=8, vocab_size=50432, max_seq_len=1024)
    with pytest.raises(trainmem.TrainmemError, match="--seq-len 2048 exceeds the 1024"):
        trainmem.estimate(cfg, batch_size=1, seq_len=2048)
    est = trainmem.estimate(cfg, batch_size=2, seq_len=1024, precision="bf16-amp")
    tr = trainmem.trace(cfg, batch_size=2, seq_len=1024, precision="bf16-amp")
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.005
