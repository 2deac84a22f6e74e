"""The bundled model catalogue: every entry's parameter and buffer counts equal the real model's.

The real model is the transformers class named by the entry's ``architectures`` (picked through
the matching Auto class), built from the same config on the meta device, so nothing is
allocated; nanogpt-124m is compared with the nanoGPT module in ``tests/nanogpt_model.py``, raschka-gpt-124m
with Raschka's GPTModel in ``tests/raschka_gpt.py``.

Build times (transformers 5.23, torch 2.13, meta device, measured when the catalogue was
written): every entry builds in under 0.5 s, the largest (llama-3.1-405b, 126 layers) in about
0.3 s. No build comes near the 5 s budget, so every comparison uses the full layer count; the
per-layer and non-layer split is checked separately with 1- and 2-layer builds.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache

import pytest
import torch
import transformers
from transformers import AutoConfig

import trainmem
from trainmem.spec import catalogue_names, load_config
from trainmem.spec.vision import VLM_TYPES

from nanogpt_model import GPT, GPTConfig

# Exact parameter counts (transformers, tied tensors once). Published figures agree where they
# exist: Llama-2-7b 6,738,415,616; Llama-3.1-8B 8,030,261,248; Mixtral-8x7B 46,702,792,704;
# Qwen2.5-7B 7,615,616,512; nanoGPT GPT-2 small with the padded vocabulary 124,373,760.
EXPECTED_PARAMS = {
    "bert-base-uncased": 109_514_298,
    "bert-large-uncased": 335_174_458,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "nanogpt-124m": 124_373_760,
    "raschka-gpt-124m": 163_009_536,   # Raschka's GPTModel, GPT_CONFIG_124M (untied head, no qkv bias)
    "nemo-gpt-1b": 1_410_766_848,
    "nemo-gpt-5b": 5_231_161_344,
    "nemo-gpt-7b": 6_837_645_312,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
    "xlm-roberta-xl": 3_482_741_760,
    # encoders' masked-LM heads (derived): the published sizes are DistilBERT 66M, DeBERTa-v3-base 86M
    # backbone + 98M embedding (184M), -large 304M + 131M, ModernBERT-base 149M, -large 395M
    "distilbert-base-uncased": 66_985_530,
    "deberta-v3-base": 184_551_780,
    "deberta-v3-large": 435_191_908,
    "modernbert-base": 149_655_232,
    "modernbert-large": 395_881_664,
    "roberta-base": 124_697_433,  # published: 125M
    # the families without hand-written formulas (spec.profile, family "derived") and the newer
    # hand-family checkpoints; Gemma-2-2B's 2,614,341,888 is the published figure
    "deepseek-v2-lite": 15_706_484_224,
    "deepseek-v3": 671_026_404_352,
    "falcon-7b": 6_921_720_704,
    "gemma-2-27b": 27_227_128_320,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-3-12b": 11_766_034_176,
    "gemma-3-1b": 999_885_952,
    "gemma-3-27b": 27_009_346_304,
    "gemma-3-4b": 3_880_263_168,
    "granite-3.1-8b": 8_170_848_256,
    "llama-3.3-70b": 70_553_706_496,
    "llama-4-scout": 107_769_861_120,  # the text model (Meta's 109B counts the vision tower too)
    "mistral-nemo-12b": 12_247_782_400,
    "mistral-small-24b": 23_572_403_200,
    "olmo-2-13b": 13_716_198_400,
    "olmo-2-7b": 7_298_617_344,
    "phi-2": 2_779_683_840,
    "phi-3-medium": 13_960_238_080,
    "phi-3-mini": 3_821_079_552,
    "phi-4": 14_659_507_200,
    "pythia-1.4b": 1_414_647_808,
    "pythia-12b": 11_846_072_320,
    "pythia-1b": 1_011_781_632,
    "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016,
    "qwen2.5-coder-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-14b": 14_768_307_200,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-32b": 32_762_123_264,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "smollm2-1.7b": 1_711_376_384,
    "smollm2-135m": 134_515_008,
    "smollm2-360m": 361_821_120,
    "starcoder2-3b": 3_030_371_328,
    # encoder-decoders and vision transformers (--task seq2seq-lm / image-classification). transformers
    # 5.23 ties T5's head always (T5Config.__post_init__ forces tie_word_embeddings=True; a config's
    # False now only turns the decoder output scaling off), so Flan-T5 counts its lm_head once: Flan-T5-large
    # 750,251,008 here against the 783,150,080 of transformers 4.x's untied head
    "t5-base": 222_903_552,
    "t5-large": 737_668_096,
    "flan-t5-large": 750_251_008,
    "flan-t5-xl": 2_783_959_040,
    "vit-base-patch16-224": 86_567_656,  # the published ViT-B/16 figure, 1000-class head included
    "vit-large-patch16-224": 304_326_632,
    "bart-large": 406_291_456,
    # the model cards' 248M (flan-t5-base, with transformers 4's untied head: 247,577,856), 139M and 632M
    # (vit-huge's ViTModel; trained here with the 2-label classifier from_pretrained builds, no pooler)
    "flan-t5-base": 222_903_552,
    "bart-base": 139_420_416,
    "vit-huge-patch14-224-in21k": 630_767_362,
    # SiglipModel (both towers) 203,155,970, the model card's 203M; its vision tower's classifier trained
    "siglip-base-patch16-224": 92_885_762,
    # vision-language models (--task image-text-to-text): vision tower, projector and language model; each the
    # hub's safetensors count (Qwen2.5-VL-3B's 3.75B, -7B's 8.29B, llava-1.5-7b-hf's 7.06B, gemma-3-4b-it's 4.3B)
    "qwen2.5-vl-3b": 3_754_622_976,
    "qwen2.5-vl-7b": 8_292_166_656,
    "llava-1.5-7b": 7_063_427_072,
    "gemma-3-4b-it": 4_300_079_472,

    # WhisperForConditionalGeneration (--task speech-seq2seq), proj_out tied to the decoder's embedding, the
    # encoder's frozen sinusoidal positions counted (transformers' own totals: 37.8M, 72.6M, 241.7M, 763.9M, 1543.5M)
    "whisper-tiny": 37_760_640,
    "whisper-base": 72_593_920,
    "whisper-small": 241_734_912,
    "whisper-medium": 763_857_920,
    "whisper-large-v3": 1_543_490_560,
}
HF_NAMES = sorted(n for n in EXPECTED_PARAMS if n not in ("nanogpt-124m", "raschka-gpt-124m"))

_AUTO_BY_SUFFIX = (
    ("ForCausalLM", transformers.AutoModelForCausalLM),
    ("LMHeadModel", transformers.AutoModelForCausalLM),
    ("ForMaskedLM", transformers.AutoModelForMaskedLM),
    ("ForSequenceClassification", transformers.AutoModelForSequenceClassification),
    ("WhisperForConditionalGeneration", transformers.AutoModelForSpeechSeq2Seq),
    ("ForConditionalGeneration", transformers.AutoModelForSeq2SeqLM),
    ("ForImageClassification", transformers.AutoModelForImageClassification),
    ("Model", transformers.AutoModel),
)
_BYTES = {"float32": 4, "int64": 8, "bool": 1, "bfloat16": 2, "float16": 2}
_TORCH_DTYPES = {torch.float32: "float32", torch.int64: "int64", torch.bool: "bool", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}


def _raw(name: str) -> dict:
    return load_config(name)[1]


def _hf_config(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def _layers_key(cfg: dict) -> str:
    return "n_layer" if cfg["model_type"] == "gpt2" else "num_hidden_layers"


def _with_layers(cfg: dict, k: int) -> dict:
    """``cfg`` with ``k`` layers (a vision tower's classifier, SigLIP's: its vision config's; a vision-language
    model's: its language model's)."""
    if cfg["model_type"] in VLM_TYPES:
        if "text_config" in cfg:
            return dict(cfg, text_config=dict(cfg["text_config"], num_hidden_layers=k))
        return dict(cfg, num_hidden_layers=k)
    if "vision_config" in cfg:
        return dict(cfg, vision_config=dict(cfg["vision_config"], num_hidden_layers=k))
    return dict(cfg, **{_layers_key(cfg): k})


@lru_cache(maxsize=None)
def _real_model_counts(cfg_json: str) -> tuple[int, int, tuple[tuple[int, str], ...]]:
    """(parameters, buffer elements, (numel, dtype) per buffer) of the real model on meta."""
    cfg = json.loads(cfg_json)
    if cfg.get("_trainmem", {}).get("family") == "nanogpt":
        with torch.device("meta"):
            model = GPT(GPTConfig.from_hf_config(cfg))
    elif cfg.get("_trainmem", {}).get("manual_layernorm"):   # Raschka's GPTModel (tests/raschka_gpt.py)
        import raschka_gpt
        with torch.device("meta"):
            model = raschka_gpt.GPTModel({"vocab_size": cfg["vocab_size"], "context_length": cfg["n_positions"],
                                          "emb_dim": cfg["n_embd"], "n_heads": cfg["n_head"],
                                          "n_layers": cfg["n_layer"], "drop_rate": cfg["resid_pdrop"],
                                          "qkv_bias": cfg["_trainmem"].get("qkv_bias", True)})
    else:
        cfg = _hf_config(cfg)
        arch = cfg["architectures"][0]
        auto = transformers.AutoModelForImageTextToText if cfg["model_type"] in VLM_TYPES else \
            next(a for suffix, a in _AUTO_BY_SUFFIX if arch.endswith(suffix))
        with torch.device("meta"):
            model = auto.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
        assert type(model).__name__ == arch, f"{auto.__name__} built {type(model).__name__}, not {arch}"
    params = sum(p.numel() for p in model.parameters())  # parameters() yields tied tensors once
    buffers = tuple((b.numel(), _TORCH_DTYPES[b.dtype]) for b in model.buffers())
    return params, sum(n for n, _ in buffers), buffers


def real_counts(cfg: dict) -> tuple[int, int, tuple[tuple[int, str], ...]]:
    return _real_model_counts(json.dumps(cfg, sort_keys=True))


# ----- the catalogue itself ------------------------------------------------------------------
def test_catalogue_has_every_entry():
    assert catalogue_names() == sorted(EXPECTED_PARAMS)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_entry_is_a_plain_hf_config(name):
    cfg = _raw(name)
    # hub configs themselves carry _name_or_path / _attn_implementation (Phi-3, Gemma-2-27B)
    assert {k for k in cfg if k.startswith("_")} <= {"_comment", "_trainmem", "_name_or_path", "_attn_implementation"}
    assert isinstance(cfg["model_type"], str) and cfg["model_type"]
    assert isinstance(cfg["architectures"], list) and len(cfg["architectures"]) == 1
    spec = trainmem.resolve_model(name)
    assert spec.name == name
    assert spec.architecture == cfg["architectures"][0]


# ----- parameter counts ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_param_count_equals_real_model(name):
    params, _, _ = real_counts(_raw(name))
    assert trainmem.resolve_model(name).num_params == params


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_param_count_is_pinned(name):
    # catches a config value drifting in a way both counts would follow
    assert trainmem.resolve_model(name).num_params == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_layer_and_non_layer_params(name):
    """One layer's parameters and everything outside the layers, from 1- and 2-layer builds
    (models whose layers differ, e.g. DeepSeek's dense first layers, are counted layer by layer)."""
    cfg = _raw(name)
    if not trainmem.resolve_model(name).uniform_layers:
        pytest.skip("layers differ: no single layer size")
    one, _, _ = real_counts(_with_layers(cfg, 1))
    two, _, _ = real_counts(_with_layers(cfg, 2))
    spec = trainmem.resolve_model(name)
    assert spec.layer_params == two - one
    assert spec.embedding_params == one - (two - one)
    assert spec.num_params == spec.embedding_params + spec.num_layers * spec.layer_params


# ----- buffers -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_buffers_equal_real_model(name):
    _, numel, buffers = real_counts(_raw(name))
    spec = trainmem.resolve_model(name)
    mine = spec.buffer_tensors()
    assert sum(math.prod(b.shape) for b in mine) == numel
    real_bytes = sum(n * _BYTES[d] for n, d in buffers)
    assert sum(math.prod(b.shape) * _BYTES.get(b.dtype, 4) for b in mine) == real_bytes


def test_nanogpt_mask_buffers():
    spec = trainmem.resolve_model("nanogpt-124m")
    masks = [b for b in spec.buffer_tensors() if b.name.endswith("attn.bias")]
    assert len(masks) == 12
    assert all(b.shape == (1, 1, 1024, 1024) and b.dtype == "float32" for b in masks)


# ----- head selection ------------------------------------------------------------------------
def _base_arch(arch: str) -> str:
    for suffix in ("LMHeadModel", "ForCausalLM", "ForMaskedLM"):
        if arch.endswith(suffix):
            return arch[: -len(suffix)]
    raise AssertionError(arch)


@pytest.mark.parametrize("suffix,labels", [("ForSequenceClassification", None),
                                           ("ForSequenceClassification", 3), ("Model", None)])
@pytest.mark.parametrize("name", [n for n in HF_NAMES if trainmem.resolve_model(n).family != "derived"])
def test_head_selection(name, suffix, labels):
    """Same config, other head (classifier with 2 or 3 labels, or the bare model)."""
    cfg = _raw(name)
    change = {"architectures": [_base_arch(cfg["architectures"][0]) + suffix]}
    if labels:
        change["num_labels"] = labels
    params, _, _ = real_counts(dict(cfg, **change))
    spec = trainmem.resolve_model(name, overrides=change)
    assert spec.head == ("seq-cls" if suffix.startswith("For") else "base")
    assert spec.num_params == params
    if suffix.startswith("For"):  # a tied LM head adds nothing, so only the classifier must show
        assert spec.num_params != EXPECTED_PARAMS[name]
    assert not any(t.name.startswith(("lm_head", "cls.")) for t in spec.parameter_tensors())


# ----- individual entries --------------------------------------------------------------------
@pytest.mark.parametrize("name,layers,hidden,heads,ffn,published", [
    ("nemo-gpt-1b", 24, 2048, 16, 5440, 1.41e9),
    ("nemo-gpt-5b", 24, 4096, 32, 10880, 5.23e9),
    ("nemo-gpt-7b", 32, 4096, 32, 10880, 6.84e9),
])
def test_nemo_gpt_next_matches_seed(name, layers, hidden, heads, ffn, published):
    """Seed 000's table: L, h, v = 50257 and P to three significant digits."""
    s = trainmem.resolve_model(name)
    assert (s.family, s.num_layers, s.hidden_size, s.num_heads) == ("gpt-next", layers, hidden, heads)
    assert s.vocab_size == 50257
    assert s.ffn_size == ffn == 2.65625 * hidden
    assert (s.activation, s.position, s.norm) == ("swiglu", "rotary", "rmsnorm")
    assert not (s.tied_embeddings or s.qkv_bias or s.out_bias or s.mlp_bias)
    assert float(f"{s.num_params:.2e}") == published


@pytest.mark.parametrize("name,tied", [("llama-3.2-1b", True), ("llama-3.2-3b", True), ("qwen2.5-0.5b", True),
                                       ("qwen2.5-1.5b", True), ("qwen2.5-7b", False), ("qwen2.5-72b", False),
                                       ("llama-3.1-8b", False), ("gpt2-xl", True)])
def test_tied_embeddings(name, tied):
    assert trainmem.resolve_model(name).tied_embeddings is tied


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-72b"])
def test_qwen_has_qkv_bias_only(name):
    s = trainmem.resolve_model(name)
    assert s.qkv_bias and not s.out_bias and not s.mlp_bias
    biases = {t.module for t in s.parameter_tensors() if t.role == "bias"}
    assert biases == {"q_proj", "k_proj", "v_proj"}


def test_mixtral_experts():
    s = trainmem.resolve_model("mixtral-8x7b")
    assert (s.family, s.num_experts, s.experts_top_k) == ("mixtral", 8, 2)
    assert s.active_params == 12_879_925_248  # published: "12.9B active"; 2 of 8 experts per token


def test_nanogpt_module_runs():
    """The reusable nanoGPT module: tiny CPU forward with and without targets."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (3, 10))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 10, 64) and loss.ndim == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(64)) < 0.5  # near-uniform at init
    logits, loss = model(idx)
    assert logits.shape == (3, 1, 64) and loss is None
    assert model.lm_head.weight is model.transformer.wte.weight
    # causal: the first position's output ignores later tokens
    other = idx.clone()
    other[:, 5:] = (other[:, 5:] + 1) % 64
    a, _ = model(idx, idx)
    b, _ = model(other, other)
    assert torch.allclose(a[:, :5], b[:, :5]) and not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("name", [n for n in HF_NAMES if trainmem.resolve_model(n).family == "derived"
                                  and trainmem.resolve_model(n).head == "causal-lm"])
def test_derived_sequence_classifier_is_traced_not_estimated(name):
    """A derived model type's sequence-classification class (--task sequence-classification) is read
    as such (its head's tensors), and the estimate, whose coefficients cover causal LM, seq2seq LM,
    image classification and some encoders' heads (``derived.DERIVED_ENCODER_TYPES``), refuses it in
    one line."""
    cfg = _raw(name)
    arch = cfg["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    if not hasattr(transformers, arch):
        pytest.skip(f"transformers has no {arch}")
    spec = trainmem.resolve_model(name, overrides={"architectures": [arch]})
    assert spec.head == "seq-cls" and spec.architecture == arch
    with pytest.raises(trainmem.TrainmemError, match="derived estimate covers"):
        trainmem.estimate(spec, seq_len=128)