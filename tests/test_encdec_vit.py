"""Encoder-decoders (T5, BART) and vision transformers (ViT): ``--task``, ``--target-len``,
``--image-size``, and the derived estimate against the trace of the real model.

The estimate is compared with a trace, both with the allocator's expandable segments
(``expandable_segments=True``): there a block is the request rounded to 512 bytes, so the
comparison is of the tensors themselves. With the default allocator a request between
1 and 10 MiB may leave an unsplit remainder of its 20 MiB segment (PyTorch
``c10/cuda/CUDACachingAllocator.cpp``, ``should_split``), which these small models' activations
and gradients meet often and which the estimate's allocator model does not place (up to 3% of
the peak of ViT-Base at batch 4 x 577 tokens; the allocator model is not this module's subject).
"""
from __future__ import annotations

import itertools

import pytest
from transformers import BartConfig, T5Config, ViTConfig

import trainmem
from trainmem.errors import TrainmemError

from test_cli import ERROR_PREFIX, run_cli

T5_SMALL = T5Config(d_model=256, d_ff=1024, num_layers=3, num_heads=4, d_kv=64, vocab_size=2000,
                    decoder_start_token_id=0, pad_token_id=0, feed_forward_proj="gated-gelu",
                    tie_word_embeddings=False, architectures=["T5ForConditionalGeneration"]).to_dict()
BART_SMALL = BartConfig(d_model=256, encoder_ffn_dim=1024, decoder_ffn_dim=1024, encoder_layers=3, decoder_layers=3,
                        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=2000,
                        max_position_embeddings=1024, architectures=["BartForConditionalGeneration"]).to_dict()
VIT_SMALL = ViTConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4,
                      num_labels=10, architectures=["ViTForImageClassification"]).to_dict()
MODELS = {"t5": T5_SMALL, "bart": BART_SMALL, "vit": VIT_SMALL}
TOLERANCE = 0.005


def _size(name: str, s: int) -> dict:
    """``s`` as the model takes it: image models a side in pixels (224 -> 197 tokens, 384 -> 577)."""
    return {"image_size": {128: 224, 512: 384}[s]} if name == "vit" else {"seq_len": s}


def _error(name: str, **setup) -> float:
    est = trainmem.estimate(MODELS[name], expandable_segments=True, **setup).peak_allocated
    tr = trainmem.trace(MODELS[name], expandable_segments=True, **setup).peak_allocated
    return est / tr - 1


# ----- the head, the sizes ---------------------------------------------------------------------
def test_natural_head_without_architectures():
    t5 = trainmem.resolve_model({k: v for k, v in T5_SMALL.items() if k != "architectures"})
    vit = trainmem.resolve_model({k: v for k, v in VIT_SMALL.items() if k != "architectures"})
    assert (t5.architecture, t5.head, t5.decoder_layers, t5.num_layers) == \
        ("T5ForConditionalGeneration", "seq2seq-lm", 3, 6)
    assert (vit.architecture, vit.head) == ("ViTForImageClassification", "image-cls")


def test_headless_base_model_is_trained_with_its_natural_head():
    """ViT-in21k's config names ViTModel (no head): it is trained as ViTForImageClassification."""
    spec = trainmem.resolve_model(dict(VIT_SMALL, architectures=["ViTModel"]))
    assert spec.architecture == "ViTForImageClassification" and spec.head == "image-cls"


def test_task_picks_transformers_class():
    spec = trainmem.resolve_model("t5-base", task="sequence-classification")
    assert spec.architecture == "T5ForSequenceClassification" and spec.head == "seq-cls"
    assert trainmem.resolve("t5-base", task="seq2seq-lm").model == trainmem.resolve_model("t5-base")


def test_image_size_sets_the_sequence():
    r = trainmem.resolve("vit-base-patch16-224", image_size=384)
    assert (r.training.image_size, r.training.seq_len) == (384, (384 // 16) ** 2 + 1)
    assert trainmem.resolve("vit-base-patch16-224").training.seq_len == 197
    assert r.replace(image_size=224).training.seq_len == 197


@pytest.mark.parametrize("argv, names", [
    (["vit-base-patch16-224", "--task", "seq2seq-lm"], "--task seq2seq-lm"),
    (["vit-base-patch16-224", "--seq-len", "128"], "--seq-len"),
    (["vit-base-patch16-224", "--image-size", "100"], "--image-size 100"),
    (["llama-3.2-1b", "--image-size", "224"], "--image-size 224"),
    (["qwen3-0.6b", "--target-len", "64"], "--target-len 64"),
    (["bart-large", "--seq-len", "256", "--target-len", "2048"], "--target-len 2048"),
    (["t5-base", "--loss", "upcast"], "--loss upcast"),
    (["t5-base", "--recompute", "full", "--recompute-every", "2"], "--recompute-every 2"),
])
def test_refusals_are_one_line(capsys, argv, names):
    code, out, err = run_cli(capsys, "estimate", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and names in lines[0], err


def test_trace_runs_the_target_length():
    """The decoder's labels are --target-len tokens: its logits shrink with it."""
    short = trainmem.trace(T5_SMALL, batch_size=2, seq_len=256, target_len=64, steps=1)
    full = trainmem.trace(T5_SMALL, batch_size=2, seq_len=256, steps=1)
    assert short.training.decoder_len == 64 and full.training.decoder_len == 256
    assert short.phases[1].peak < full.phases[1].peak


def test_derivation_refuses_a_fit_that_misses_its_held_out_point(monkeypatch):
    """The two-length fit of an encoder-decoder is checked on a held-out (batch, encoder length,
    decoder length) point: a traced quantity it does not reproduce there is refused in one line."""
    from trainmem.estimate import derived
    from trainmem.trace import derive
    real = derive._runs

    def off_at_the_held_out_point(*args, **kwargs):
        runs = real(*args, **kwargs)
        kind = sorted(runs[-1]["saved"])[0]
        runs[-1]["saved"][kind] = int(runs[-1]["saved"][kind] * 1.1) + 10 ** 6
        return runs
    monkeypatch.setattr(derive, "_runs", off_at_the_held_out_point)
    r = trainmem.resolve(dict(T5_SMALL, d_model=192), seq_len=256, target_len=64)
    with pytest.raises(TrainmemError, match="not polynomial") as e:
        derive.derive_coefficients(r.model, derived._canonical(r.training))
    assert "\n" not in str(e.value) and "target=" in str(e.value)


# ----- estimate against trace ----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_estimate_agrees_with_trace(name):
    """One setup per model, kept fast; the grid below is slow."""
    assert abs(_error(name, batch_size=2, precision="bf16-amp", **_size(name, 512))) <= TOLERANCE


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_full_recompute_agrees_with_trace(name):
    """An encoder-decoder under full recompute (coefficients traced with the layers checkpointed):
    T5 keeps each stack's position bias and the decoder's cross-attention bias leaf as inputs of its
    checkpointed layers, and the peak is the decoder's first layer's recomputed backward."""
    assert abs(_error(name, batch_size=4, precision="fp32", recompute="full", seq_len=512)) <= TOLERANCE


#: the catalogue's encoder-decoders narrowed to 2 + 2 layers (their widths, heads and vocabularies kept)
NARROWED = {"t5-base": ["num_layers=2", "num_decoder_layers=2"],
            "bart-large": ["encoder_layers=2", "decoder_layers=2"]}
#: (encoder length, decoder length): short targets (summaries) and targets longer than the input
LENGTHS = [(512, 128), (256, 512)]


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_target_length_agrees_with_trace(name):
    """--target-len other than --seq-len: the coefficients are fitted in both lengths (per token of
    each stack, per query x key pair of the encoder's, the decoder's and the cross attention) and
    read at the setup's; the encoder's first layer's backward, where the decoder's tensors are gone,
    is the peak under full recompute at (512, 128)."""
    for (s, d), recompute in itertools.product(LENGTHS, ("none", "full")):
        err = _error(name, batch_size=4, precision="fp32", recompute=recompute, seq_len=s, target_len=d)
        assert abs(err) <= TOLERANCE, (s, d, recompute, err)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NARROWED))
def test_catalogue_encdec_target_length_agrees_with_trace(name):
    """t5-base and bart-large (2 + 2 layers), bf16-amp, batch 8: (512, 128) and (256, 512), recompute
    none and full, within 0.5% of the trace."""
    for (s, d), recompute in itertools.product(LENGTHS, ("none", "full")):
        setup = dict(set=NARROWED[name], batch_size=8, precision="bf16-amp", recompute=recompute, seq_len=s,
                     target_len=d)
        est = trainmem.estimate(name, expandable_segments=True, **setup).peak_allocated
        tr = trainmem.trace(name, expandable_segments=True, **setup).peak_allocated
        assert abs(est / tr - 1) <= TOLERANCE, (s, d, recompute, est / tr - 1)


GRID = list(itertools.product((1, 4), (128, 512), ("bf16-amp", "fp32"), ("none", "full")))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_estimate_agrees_with_trace_grid(name):
    """Batch 1 and 4, sequence 128 and 512 (ViT: 224 and 384 pixels), bf16-amp and fp32, recompute
    none and full: within 0.5% of the trace's peak (ViT at batch 1 x 384 px under full recompute was
    -0.8% until the class token's gradient, a view of the whole embedding gradient, was counted:
    ``trace.derive._grad_view_bytes``)."""
    worst = []
    for b, s, precision, recompute in GRID:
        err = _error(name, batch_size=b, precision=precision, recompute=recompute, **_size(name, s))
        worst.append((abs(err), (b, s, precision, recompute), err))
    assert max(worst)[0] <= TOLERANCE, max(worst)


def test_fit_searches_an_image_models_micro_batch():
    """fit on an image model: the sequence is its image size's patches, the micro-batch is searched."""
    from trainmem.plan.fit import fit
    r = fit("vit-base-patch16-224", gpu="h100", image_size=384)
    assert r.fits and r.seq_len == 577 and r.search == "batch_size"
    over = trainmem.estimate("vit-base-patch16-224", gpu="h100", image_size=384, batch_size=r.batch_size + 1)
    assert over.device_peak > r.limit >= r.device_used


# ----- vision towers of composite configs -----------------------------------------------------
def _tower(config_cls, arch: str) -> dict:
    """A 2-layer vision tower of width 128 in its composite config (a text config beside it), as
    the hub publishes CLIP's and SigLIP's."""
    return config_cls(vision_config=dict(hidden_size=128, image_size=64, intermediate_size=512, num_attention_heads=4,
                                         num_hidden_layers=2, patch_size=16),
                      text_config=dict(hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                       num_hidden_layers=1, vocab_size=1000),
                      architectures=[arch], num_labels=10).to_dict()


@pytest.mark.parametrize("model_type", ["clip", "siglip"])
def test_vision_tower_of_a_composite_config(model_type):
    """CLIP's and SigLIP's image classifiers read their sizes from the vision config (spec.profile),
    with the same tensors as transformers' class, and trace runs them. SigLIP's tower builds an
    attention-pooling head its classifier runs but never reads (it mean-pools; CLIP's, its pooled
    output's norm): those parameters get no gradient in the real step (the trace's optimizer states
    are the trained parameters') and none in the estimate, whose
    head forward holds the head's (b, s, h) key and value projections; the estimate is within 0.5%
    of the trace."""
    import torch
    import transformers
    from transformers import CLIPConfig, SiglipConfig
    arch = {"clip": "CLIPForImageClassification", "siglip": "SiglipForImageClassification"}[model_type]
    cfg = _tower({"clip": CLIPConfig, "siglip": SiglipConfig}[model_type], arch)
    spec = trainmem.resolve_model(cfg)
    with torch.device("meta"):
        real = getattr(transformers, arch)(transformers.AutoConfig.for_model(**cfg))
    assert (spec.head, spec.num_layers, spec.hidden_size, spec.image_size, spec.patch_size) == \
        ("image-cls", 2, 128, 64, 16)
    assert spec.num_params == sum(p.numel() for p in real.parameters())
    unused = {p.name for p in spec.parameter_tensors() if p.role == "unused"}
    # what the classifier never reads: SigLIP's pooling head, CLIP's norm of the pooled class token
    expected = {"siglip": ".head.", "clip": ".post_layernorm."}[model_type]
    assert unused and all(expected in n for n in unused)
    setup = dict(batch_size=4, image_size=96, precision="bf16-amp")
    tr = trainmem.trace(cfg, expandable_segments=True, **setup)
    assert tr.training.seq_len == spec.image_tokens(96)
    est = trainmem.estimate(cfg, expandable_segments=True, **setup)
    assert abs(est.peak_allocated / tr.peak_allocated - 1) <= TOLERANCE
    # the optimizer states of the trained parameters only: AdamW's two fp32 tensors per trained element
    trained = spec.num_params - sum(p.numel for p in spec.parameter_tensors() if p.role == "unused")
    states = sum(c.bytes for c in tr.components if c.name.startswith("optimizer_states"))
    assert 8 * trained <= states < 8 * spec.num_params


#: 3-layer vision towers of width 256 (224 px, patches of 16), as ViT's above: CLIP's and SigLIP's
#: image classifiers in their composite configs, and ViT's
def _tower256(config_cls, arch: str) -> dict:
    return config_cls(vision_config=dict(hidden_size=256, image_size=224, intermediate_size=1024,
                                         num_attention_heads=4, num_hidden_layers=3, patch_size=16),
                      text_config=dict(hidden_size=128, intermediate_size=512, num_attention_heads=4,
                                       num_hidden_layers=1, vocab_size=1000),
                      architectures=[arch], num_labels=10).to_dict()


def _towers() -> dict:
    from transformers import CLIPConfig, SiglipConfig
    return {"clip": _tower256(CLIPConfig, "CLIPForImageClassification"),
            "siglip": _tower256(SiglipConfig, "SiglipForImageClassification"), "vit": VIT_SMALL}


def _tower_error(name: str, **setup) -> float:
    cfg = _towers()[name]
    est = trainmem.estimate(cfg, expandable_segments=True, **setup).peak_allocated
    return est / trainmem.trace(cfg, expandable_segments=True, **setup).peak_allocated - 1


@pytest.mark.parametrize("name", ["clip", "siglip", "vit"])
@pytest.mark.parametrize("setup", [
    # full recompute, bf16-amp: CLIP was +1.5% (the first layer's kept input, the embedding side's
    # output, counted twice; the recomputed layer's output counted though a recomputation does not
    # make it; ViT had both and a transient net of its top layer's output, which cancelled)
    dict(batch_size=4, image_size=384, precision="bf16-amp", recompute="full"),
    # eager attention at 224 px: -7.5% (ViT) before the transients were chosen over image lengths
    # (the MLP's backward, the largest at 197 tokens, was dropped for the attention's at >= 512)
    dict(batch_size=4, image_size=224, precision="fp32", recompute="full", attention="eager"),
    # eager, bf16-amp, 384 px: +0.5% to +1% before a layer's cached half weight copies were counted
    # freed by its backward (the attention's softmax backward comes after the MLP's)
    dict(batch_size=1, image_size=384, precision="bf16-amp", attention="eager"),
    # batch 1 (its own coefficients, ``derived.batch1``): SigLIP was +0.72% with those of batches 2
    # to 4, where its pooling head's ``nn.MultiheadAttention`` copies the transposed (s, b, h) input
    # and adds the bias apart, while at batch 1 one addmm projects the (s, 1, h) input (a view)
    dict(batch_size=1, image_size=384, precision="bf16-amp"),
    dict(batch_size=1, image_size=224, precision="fp32", recompute="full"),
])
def test_vision_tower_agrees_with_trace(name, setup):
    assert abs(_tower_error(name, **setup)) <= TOLERANCE


TOWER_GRID = list(itertools.product((1, 4), (224, 384), ("bf16-amp", "fp32"), ("none", "full"), ("sdpa", "eager")))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["clip", "siglip", "vit"])
def test_vision_tower_grid(name):
    """Batch 1 and 4, 224 and 384 px, bf16-amp and fp32, recompute none and full, SDPA and eager
    attention (32 setups): within 0.5% of the trace. (SigLIP at batch 1 x 384 px, bf16-amp, no recompute,
    SDPA, +0.72% with the batch >= 2 coefficients, is within 0.03% with its batch-1 set.)"""
    worst = []
    for b, px, precision, recompute, attention in TOWER_GRID:
        err = _tower_error(name, batch_size=b, image_size=px, precision=precision, recompute=recompute,
                           attention=attention)
        worst.append((abs(err), (b, px, precision, recompute, attention), err))
    assert max(worst)[0] <= TOLERANCE, max(worst)


def test_image_derivation_refuses_a_fit_that_misses_its_held_out_point(monkeypatch):
    """An image model's fit is checked on a held-out (batch, image size) point too: a traced quantity
    it does not reproduce there is refused in one line."""
    from trainmem.estimate import derived
    from trainmem.trace import derive
    real = derive._runs

    def off_at_the_held_out_point(*args, **kwargs):
        runs = real(*args, **kwargs)
        runs[-1]["first_input"] = int(runs[-1]["first_input"] * 1.1) + 10 ** 6
        return runs
    monkeypatch.setattr(derive, "_runs", off_at_the_held_out_point)
    r = trainmem.resolve(_towers()["clip"], image_size=224, recompute="full")
    with pytest.raises(TrainmemError, match="first layer's input is not polynomial") as e:
        derive.derive_coefficients(r.model, derived._canonical(r.training, r.model))
    assert "\n" not in str(e.value)


def test_class_token_gradient_keeps_the_embedding_gradient_at_batch_1():
    """A real CPU step of a small ViT: at micro-batch 1 the class token's ``.grad`` is a view of the
    whole (1, s, hidden) embedding gradient (``AccumulateGrad`` steals the ``narrow``), at batch 2 a
    tensor of its own; the derived coefficients' gradient views (``derived.grad_views``) give exactly
    that storage less the token's own bytes, at batch 1 only."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    from trainmem.estimate import derived
    cfg = ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_labels=10)
    spec = dict(cfg.to_dict(), architectures=["ViTForImageClassification"])
    for b in (1, 2):
        torch.manual_seed(0)
        model = ViTForImageClassification(cfg)
        model(pixel_values=torch.randn(b, 3, 224, 224), labels=torch.zeros(b, dtype=torch.long)).loss.backward()
        g = model.vit.embeddings.cls_token.grad
        real = g.untyped_storage().nbytes() - g.numel() * g.element_size()
        r = trainmem.resolve(spec, batch_size=b, precision="fp32")
        tok, pos, const = derived.grad_views(r.model, r.training)
        n = b * r.training.seq_len
        assert real == (197 - 1) * 64 * 4 if b == 1 else real == 0
        assert round(tok * n + pos * r.training.seq_len + const) == real
