"""Types the architecture sweep refused (docs/architectures.md): each fixed in trainmem, or refused in one line
that says whose the failure is (transformers' bug, a step trainmem does not model, a trace without data)."""
from __future__ import annotations

import pytest

import trainmem
from trainmem.trace.derive import _cut

from conftest import load_benchmark

bench = load_benchmark("bench_architectures")
SETUP = dict(batch_size=2, seq_len=64, precision="bf16-amp")


def _pct(model_type: str, **setup) -> float:
    """Estimate against trace of the type's sweep config (with its hub fields), peak allocated, in %."""
    r = trainmem.resolve(bench.tiny_config(model_type), **(setup or SETUP))
    est, tr = trainmem.estimate(r), trainmem.trace(r)
    return 100.0 * (est.peak_allocated - tr.peak_allocated) / tr.peak_allocated


@pytest.mark.parametrize("model_type,field", [("ministral", "head_dim"), ("lfm2_moe", "layer_types"),
                                              ("dbrx", "attn_config")])
def test_transformers_config_bug_is_refused_as_such(model_type, field):
    """transformers 5.24's default configs of these types do not build (its bug, not trainmem's): one line that
    says so and names the field the hub config gives."""
    cfg = {k: v for k, v in bench.tiny_config(model_type).items() if k != field}
    with pytest.raises(trainmem.TrainmemError, match=r"a bug of transformers .* not of trainmem; give .*"
                       + field.split("_config")[0]):
        trainmem.estimate(cfg, **SETUP)


@pytest.mark.parametrize("model_type", ["ministral", "lfm2_moe", "mimo_v2_flash", "marian"])
def test_with_its_hub_fields_the_type_runs_and_the_estimate_agrees(model_type):
    assert abs(_pct(model_type)) < 1.0


def test_marian_positions_are_frozen_and_its_loss_runs_on_half_logits():
    """Marian's sinusoidal positions are built frozen (``nn.Embedding(..., _freeze=True)``): no gradient, no
    state; its ``CrossEntropyLoss()`` runs on the half logits, which the derivation measures (before: the
    upcast loss was assumed, +3.4 % at 2 x 128)."""
    r = trainmem.resolve(bench.tiny_config("marian"), **SETUP)
    unused = {p.name for p in r.model.parameter_tensors() if p.role == "unused"}
    assert "model.decoder.embed_positions.weight" in unused
    from trainmem.estimate.quantities import loss_mode
    assert loss_mode(r.model, r.training) == "half"
    llama = trainmem.resolve(bench.tiny_config("llama"), **SETUP)
    assert loss_mode(llama.model, llama.training) == "upcast"  # transformers' ForCausalLMLoss, measured so


def test_longcat_flash_layers_are_its_num_layers():
    """LongCat-Flash's num_hidden_layers counts two attention sublayers per layer: its layer list has num_layers."""
    cfg = bench.tiny_config("longcat_flash")
    r = trainmem.resolve(cfg, **SETUP)
    assert r.model.num_layers == cfg["num_layers"] == 2


@pytest.mark.parametrize("model_type", ["dbrx", "longcat_flash", "jetmoe"])
def test_a_per_expert_loop_runs_on_a_balanced_routing_and_the_estimate_agrees(model_type):
    """Experts run one by one on the tokens routed to each (``nonzero``/``torch.where`` of the routing mask, or
    its counts read back by ``.tolist()``): the trace gives the router's top-k a balanced choice
    (``trace.routing_values``) and sizes them from it; the derived estimate agrees (before: refused in one line)."""
    assert abs(_pct(model_type)) < 1.0


@pytest.mark.parametrize("model_type", ["musicgen", "musicgen_melody"])
def test_musicgen_decoder_is_refused_for_its_codebook_input(model_type):
    """MusicgenForCausalLM is built from the composite config's ``decoder`` (not ambiguous any more), and its
    input of codebooks per sample is refused in one line."""
    with pytest.raises(trainmem.TrainmemError, match="4 codebooks of audio codes per sample"):
        trainmem.estimate(bench.tiny_config(model_type), **SETUP)


def test_cut_of_a_kv_sharing_decoder_shares_in_its_last_half():
    cfg = bench.tiny_config("gemma3n_text")
    assert cfg["num_kv_shared_layers"] == 10 and cfg["num_hidden_layers"] == 20
    small = _cut(cfg, 20, 10)
    assert small["num_hidden_layers"] == 10 and small["num_kv_shared_layers"] == 5
    assert small["layer_types"] == cfg["layer_types"][:10]
    assert "num_kv_shared_layers" not in _cut({k: v for k, v in cfg.items() if k != "num_kv_shared_layers"}, 20, 10)


@pytest.mark.slow
def test_gemma3n_text_runs_and_the_estimate_agrees():
    """Gemma 3n's KV-sharing layers: the cut model (``_cut``) builds and its coefficients hold on the full model,
    its per-layer inputs counted for all 20 layers, not the cut's 10 (``trace.derive._per_layer_inputs``: -1.7 %
    at 4 x 512 without). Its activation sparsity is set in every layer here: the cut model's first layers are all
    sparse, and a kind does not tell a sparse layer from a dense one (docs/architectures.md)."""
    cfg = dict(bench.tiny_config("gemma3n_text"), activation_sparsity_pattern=[0.95] * 20)
    kw = dict(batch_size=2, seq_len=512, precision="bf16-amp")
    est, tr = trainmem.estimate(cfg, **kw), trainmem.trace(cfg, **kw)
    assert abs(est.peak_allocated - tr.peak_allocated) < 0.01 * tr.peak_allocated


@pytest.mark.parametrize("model_type", ["nemotron", "xmod", "xlnet", "pegasus", "recurrent_gemma", "zamba2", "xlstm"])
def test_types_the_sweep_refused_run_and_the_estimate_agrees(model_type):
    """Nemotron (autocast queried by the emulated device type), X-MOD (its default language), XLNet (no position
    limit, parameters made by a legacy constructor), Pegasus's decoder-only class (its layers from the config it
    built with), and the sweep configs of RecurrentGemma, Zamba2 and xLSTM (transformers' own steps failed)."""
    assert abs(_pct(model_type)) < 1.0


def test_nemotron_layernorm1p_runs_in_the_autocast_dtype_with_autocast_off():
    """``NemotronLayerNorm1P`` casts its arguments to ``torch.get_autocast_dtype(input.device.type)`` and runs
    ``F.layer_norm`` under ``maybe_autocast(..., enabled=False)``: half, not autocast's fp32 layer norm."""
    tr = trainmem.trace(bench.tiny_config("nemotron"), **SETUP)
    norms = [c for c in tr.components if c.name.endswith("input_layernorm.native_layer_norm")]
    assert norms and all("bfloat16" in c.dtype for c in norms)
    assert not any(c.name.endswith("input_layernorm.native_layer_norm") and c.dtype == "float32"
                   for c in tr.components)


def test_decoder_only_class_counts_the_decoders_layers():
    """BartForCausalLM of a config with 4 encoder and 2 decoder layers (distilbart-12-6's shape) builds the 2."""
    cfg = dict(bench.tiny_config("bart"), encoder_layers=4, decoder_layers=2)
    r = trainmem.resolve(cfg, **SETUP)
    assert r.model.num_layers == 2 and not r.model.decoder_layers


def test_xlnet_has_no_position_limit():
    from trainmem.spec.profile import NO_POSITION_LIMIT
    r = trainmem.resolve(bench.tiny_config("xlnet"), **SETUP)
    assert r.model.max_positions == NO_POSITION_LIMIT


@pytest.mark.parametrize("model_type", ["git", "got_ocr2"])
def test_a_class_taking_images_says_its_step_fed_text_alone(model_type):
    """GIT's and GOT-OCR2's classes are trained on images (their forward takes ``pixel_values``), which trainmem
    feeds to its vision-language types only: a text-only step that fails says so in its one line."""
    with pytest.raises(trainmem.TrainmemError, match="its forward takes pixel_values.*fed text alone"):
        trainmem.estimate(bench.tiny_config(model_type), **SETUP)


def test_moe_imbalance_is_refused_for_a_per_expert_loop():
    """The loops are traced on a balanced routing: an imbalance, which would change their busiest expert's
    transients, is refused in one line rather than ignored."""
    with pytest.raises(trainmem.TrainmemError, match="--moe-imbalance 2: dbrx's experts run one by one"):
        trainmem.estimate(bench.tiny_config("dbrx"), moe_imbalance=2.0, **SETUP)


def test_dbrx_experts_are_read_from_its_ffn_config():
    """DBRX keeps its experts' count, top-k and width in ``ffn_config`` (``DbrxFFNConfig``) and stacks its experts
    along the rows of 2-D parameters (``DbrxExpertGLU.w1/v1/w2``, (experts * ffn, hidden)): the spec reads them as a
    mixture of experts and the stacked weights as experts (before: no experts, the weights classed as norms)."""
    cfg = bench.tiny_config("dbrx")
    ffn = cfg["ffn_config"]
    m = trainmem.resolve(cfg, **SETUP).model
    assert (m.num_experts, m.experts_top_k, m.ffn_size) == (ffn["moe_num_experts"], ffn["moe_top_k"],
                                                           ffn["ffn_hidden_size"])
    roles = {t.name.rsplit(".", 1)[-1]: t.role for t in m._tensors if ".ffn." in t.name}
    assert roles["w1"] == roles["v1"] == roles["w2"] == "expert" and roles["weight"] == "router"
