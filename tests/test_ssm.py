"""State-space and hybrid models (Mamba, Mamba-2, Nemotron-H, Granite 4.0-H): the derived estimate against
trace at small configs, and the mechanisms that make it agree.

- Mamba's reference scan loops over the sequence: the fit is refused by a probe at two short sequences
  (``trace.derive._probe_operations``) before its five long traces, and derived at the setup's point.
- A Mamba-2 mixer's torch scan pads the sequence to whole chunks (``estimate.derived.scan_chunk``): a
  sequence that is no whole number of chunks is derived at its point.
- A point set measures each layer kind's forward peak (``trace.derive._kind_forward``), placed at the
  kind's highest layer (``estimate.derived.kind_forward``): a hybrid whose top layer is not a Mamba layer
  peaks in a Mamba layer's forward (Nemotron-H).
- The report says which path of the mixer is modelled (``spec.kernel_paths``).
"""
from __future__ import annotations

import warnings

import pytest

import trainmem
from trainmem.estimate import derived
from trainmem.spec.config import spec_from_config
from trainmem.spec.kernel_paths import reference_path_note

warnings.filterwarnings("ignore")

#: Mamba (hidden 64, 2 layers, state 16): its torch scan loops over the sequence
MAMBA = dict(model_type="mamba", architectures=["MambaForCausalLM"], hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, vocab_size=1000, state_size=16, time_step_rank=4)
#: Mamba-2 (hidden 256, 2 layers, 16 heads of 32, chunk 256 by default; at hidden 64 the trace's allocator
#: rounding of the scan's many small tensors, which the coefficients' tensor bytes leave out, is 2% of the peak)
MAMBA2 = dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], hidden_size=256, num_hidden_layers=2,
              vocab_size=1000, num_heads=16, head_dim=32, n_groups=1, state_size=64)
#: Nemotron-H (hidden 64; Mamba-2 with 128 heads of 64, MoE, attention, MLP: the top layer is the MLP)
NEMOTRON_H = dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"], hidden_size=64,
                  vocab_size=1000, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                  num_attention_heads=4, num_key_value_heads=4, head_dim=16, intermediate_size=128,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=64, n_group=1, topk_group=1)
#: Granite 4.0-H (hidden 64, a Mamba-2 layer and an attention layer, 4 experts)
GRANITE_H = dict(model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 vocab_size=1000, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                 layer_types=["linear_attention", "full_attention"], mamba_n_heads=8, mamba_d_head=16)


def _both(cfg: dict, b: int, s: int):
    est = trainmem.estimate(cfg, batch_size=b, seq_len=s, precision="bf16-amp")
    tr = trainmem.trace(cfg, batch_size=b, seq_len=s, precision="bf16-amp")
    return est, tr


def test_scan_chunk_is_the_config_field_or_its_default():
    assert derived.scan_chunk(spec_from_config(dict(MAMBA2, chunk_size=128))) == 128
    assert derived.scan_chunk(spec_from_config(MAMBA2)) == 256
    assert derived.scan_chunk(spec_from_config(NEMOTRON_H)) == 128
    assert derived.scan_chunk(spec_from_config(dict(GRANITE_H, mamba_chunk_size=64))) == 64
    assert derived.scan_chunk(spec_from_config(MAMBA)) == 0


def test_kind_forward_is_placed_at_the_kinds_highest_layer():
    """Kind a's peak (50 per token) over what is made before its highest layer (index 2): the layers from
    it up (a's 10 and b's 3), the head side (2) and every layer's output-held cache (a's 1, twice)."""
    doc = {"layer_kinds": ["a", "b", "a", "b"], "head": [2.0, 0.0, 0.0],
           "kinds": {"a": {"tok": 10.0, "held": 1.0, "forward_peak": 50.0},
                     "b": {"tok": 3.0, "held": 0.0, "forward_peak": 4.0}}}
    assert derived.kind_forward(doc) == pytest.approx(50 - 13 - 2 - 2)
    del doc["kinds"]["a"]["forward_peak"], doc["kinds"]["b"]["forward_peak"]
    assert derived.kind_forward(doc) is None  # a fitted set: its top layer's forward is top_forward's


def test_reference_path_is_named_for_mixers_with_kernels():
    assert "mamba-ssm" in reference_path_note("mamba2") and "reference PyTorch path" in reference_path_note("mamba2")
    assert "flash-linear-attention" in reference_path_note("qwen3_next")
    assert reference_path_note("llama") == ""


@pytest.mark.slow
def test_mamba_fit_is_refused_by_the_probe_and_derived_at_the_point():
    est, tr = _both(MAMBA, 2, 128)
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.01
    doc = derived._lookup(est.model, est.training)
    assert "at sequences 128 and 192" in doc["not_polynomial"]  # the probe's, not the fit's
    assert any("batch (2) and sequence (128)" in w for w in est.warnings)
    assert any("reference PyTorch path" in w for w in tr.warnings)


@pytest.mark.slow
@pytest.mark.parametrize("b,s", [(2, 128), (1, 1000)])
def test_mamba2_padded_sequence_is_derived_at_the_point(b, s):
    est, tr = _both(MAMBA2, b, s)
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.01
    note = [w for w in est.warnings if "not polynomial" in w]
    assert len(note) == 1 and "whole number of its 256-token chunks" in note[0]


@pytest.mark.slow
def test_mamba2_whole_chunks_use_the_fit():
    est, tr = _both(MAMBA2, 4, 512)
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.01
    assert not any("not polynomial" in w for w in est.warnings)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [NEMOTRON_H, GRANITE_H], ids=["nemotron_h", "granitemoehybrid"])
def test_hybrid_peaks_in_a_mamba_layers_forward(cfg):
    """The trace's peak is a Mamba-2 layer's forward below the top layer; the estimate's the kinds' moment."""
    est, tr = _both(cfg, 2, 128)
    assert tr.peak_phase.startswith("forward") and "mamba" in tr.peak_where or "mixer" in tr.peak_where
    assert est.peak_where == "head.forward"
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= 0.01
