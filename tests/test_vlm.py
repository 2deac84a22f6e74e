"""Vision-language models (``--task image-text-to-text``: Qwen2.5-VL, LLaVA, Gemma 3): the task picked from
``architectures``, the image tokens of ``--images`` and ``--image-size`` inside ``--seq-len``, the batch as the
processor and TRL's collator make it, ``--freeze-vision-tower`` and LoRA on the language model, the trace of the
real model's step, the estimate against it (``estimate.derived``: the language model's layers fitted in batch
and sequence, the vision side per image), and the one-line refusals.

The models are their real transformers classes cut to 3 language-model layers and 2 vision layers with small
widths (the real vocabularies and image geometry kept: Qwen's 14-pixel patches merged 2x2, CLIP's 336-pixel
images, SigLIP's 896-pixel ones pooled to 256 tokens); each trace takes about a second.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import trainmem
from trainmem.errors import TrainmemError
from trainmem.spec.resolve import resolve
from trainmem.spec.vision import vision_inputs
from trainmem.workload import hf_factory, model_batch, prepare_model

from test_cli import ERROR_PREFIX, run_cli

QWEN = transformers.Qwen2_5_VLConfig(
    text_config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=152064,
                     rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}),
    vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256,
                       fullatt_block_indexes=[1], window_size=112),
    architectures=["Qwen2_5_VLForConditionalGeneration"]).to_dict()
LLAVA = transformers.LlavaConfig(
    text_config=dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                     num_attention_heads=4, vocab_size=32064),
    vision_config=dict(model_type="clip_vision_model", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, image_size=336, patch_size=14, projection_dim=256),
    architectures=["LlavaForConditionalGeneration"]).to_dict()
GEMMA = transformers.Gemma3Config(
    text_config=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=262208),
    vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       image_size=896, patch_size=14),
    architectures=["Gemma3ForConditionalGeneration"]).to_dict()
MODELS = {"qwen2_5_vl": (QWEN, {"image_size": 224}), "llava": (LLAVA, {}),
          "gemma3": (dict(GEMMA, _trainmem_task="image-text-to-text"), {})}  # (its class is also a causal LM)


def _trace(name: str, **setup) -> trainmem.MemoryReport:
    cfg, size = MODELS[name]
    return trainmem.trace(cfg, **{"batch_size": 2, "seq_len": 1280, "precision": "bf16", "steps": 2, **size, **setup})


# ----- the task, the image tokens --------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_architectures_pick_image_text_to_text(name):
    spec = trainmem.resolve_model(MODELS[name][0])
    assert spec.head == "vlm" and spec.is_vlm and spec.architecture == MODELS[name][0]["architectures"][0]


def test_gemma3_multimodal_class_is_a_causal_lm_unless_the_task_says_image_text_to_text():
    """AutoModelForCausalLM loads Gemma 3's multimodal class for text fine-tuning (transformers' causal-LM
    mapping lists it): a hub config of it trains on text, its vision tower's weights loaded; the catalogue's
    gemma-3-4b-it entry and --task image-text-to-text train it on images; --task causal-lm undoes that."""
    assert trainmem.resolve_model("gemma-3-4b").head == "causal-lm"
    hub = {k: v for k, v in trainmem.resolve_model("gemma-3-4b-it").config.items() if k != "_trainmem_task"}
    text = trainmem.resolve_model(hub)
    assert (text.architecture, text.head) == ("Gemma3ForConditionalGeneration", "causal-lm")
    assert trainmem.resolve_model("gemma-3-4b-it", task="causal-lm").head == "causal-lm"
    assert trainmem.resolve_model(hub, task="image-text-to-text").head == "vlm"
    assert trainmem.resolve_model("gemma-3-4b-it").head == "vlm"
    # the text fine-tune holds the vision tower's weights beside the text-only entry's
    assert text.num_params > trainmem.resolve_model("gemma-3-4b").num_params


@pytest.mark.parametrize("name, size, tokens", [
    ("qwen2.5-vl-3b", 448, 256),      # (448/14)^2 = 1024 patches merged 2x2
    ("qwen2.5-vl-7b", 1008, 1296),
    ("llava-1.5-7b", None, 576),      # CLIP-L/14 at 336 px, the class token dropped
    ("gemma-3-4b-it", None, 256),     # SigLIP's 64x64 patches pooled to mm_tokens_per_image
])
def test_tokens_per_image(name, size, tokens):
    vis = vision_inputs(trainmem.resolve_model(name).config)
    assert vis.size_problem(size) is None and vis.tokens(size) == tokens


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batch_is_the_processors(name):
    """ids with images x tokens placeholders per sample, labels equal to the ids (TRL's collator), the pixels."""
    cfg, size = MODELS[name]
    r = resolve(cfg, batch_size=2, seq_len=1280, images=2, **size)
    batch = model_batch(r.model, r.training, "cpu")
    vis = vision_inputs(r.model.config)
    per = vis.tokens(r.training.image_size)
    assert batch["input_ids"].shape == (2, 1280) and torch.equal(batch["labels"], batch["input_ids"])
    assert ((batch["input_ids"] == vis.image_token_id).sum(dim=1) == 2 * per).all()
    # each image after a text token: two runs of placeholders (Qwen's rope index, Gemma's bidirectional blocks)
    is_image = (batch["input_ids"][0] == vis.image_token_id).int()
    assert (is_image[1:] - is_image[:-1] == 1).sum().item() == 2 and is_image[0] == 0
    if name == "qwen2_5_vl":   # 224 px: a 16x16 grid of 14-pixel patches, each row 3 x 2 frames x 14 x 14
        assert batch["pixel_values"].shape == (2 * 2 * 16 * 16, 1176)
        assert batch["image_grid_thw"].tolist() == [[1, 16, 16]] * 4
        assert batch["mm_token_type_ids"].sum().item() == 2 * 2 * per
    else:
        side = vis.side(None)
        assert batch["pixel_values"].shape == (4, 3, side, side) and batch["pixel_values"].dtype == torch.float32
        assert ("token_type_ids" in batch) == (name == "gemma3")


# ----- freezing, LoRA ------------------------------------------------------------------------------
@pytest.mark.parametrize("name, frozen_prefix, trained_prefix", [
    ("qwen2_5_vl", "model.visual.blocks.", "model.visual.merger."),  # LLaMA-Factory keeps the merger trained
    ("llava", "model.vision_tower.", "model.multi_modal_projector."),
    ("gemma3", "model.vision_tower.", "model.multi_modal_projector."),
])
def test_freeze_vision_tower(name, frozen_prefix, trained_prefix):
    cfg, size = MODELS[name]
    r = resolve(cfg, seq_len=1280, freeze_vision_tower=True, **size)
    with torch.device("meta"):
        model = prepare_model(hf_factory(r.model, r.training)(), r.model, r.training)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(frozen_prefix) or ".patch_embed." in n for n in frozen)
    assert any(n.startswith(trained_prefix) for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_lora_targets_the_language_model_only(name):
    """CLIP's and SigLIP's attention have q_proj/k_proj/v_proj too: the adapters go on the language model's."""
    cfg, size = MODELS[name]
    r = resolve(cfg, seq_len=1280, lora_rank=8, lora_targets="q_proj,v_proj", **size)
    with torch.device("meta"):
        model = prepare_model(hf_factory(r.model, r.training)(), r.model, r.training)
    adapters = [n for n, _ in model.named_parameters() if "lora_A" in n]
    assert len(adapters) == 2 * 3 and all(".language_model." in n for n in adapters)


# ----- trace --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_trace_runs_the_real_step(name):
    r = _trace(name)
    assert r.model.is_vlm and r.peak_allocated > 0
    assert not any("returned zeros" in w for w in r.warnings) or name == "qwen2_5_vl"  # (Qwen's rope index)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_more_images_and_a_frozen_tower_move_the_peak(name):
    """A second image per sample runs the vision tower on twice the patches (more saved activations); a frozen
    tower keeps no gradients, optimizer states nor saved activations of its own."""
    one, two, frozen = _trace(name), _trace(name, images=2), _trace(name, freeze_vision_tower=True)
    assert two.peak_allocated > one.peak_allocated > frozen.peak_allocated


@pytest.mark.parametrize("setup", [dict(precision="bf16-amp"), dict(recompute="full"),
                                   dict(lora_rank=16, lora_targets="q_proj,k_proj,v_proj,o_proj")])
def test_trace_setups(setup):
    assert _trace("qwen2_5_vl", **setup).peak_allocated < _trace("qwen2_5_vl", precision="fp32").peak_allocated


# ----- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, names", [
    (["llava-1.5-7b", "--seq-len", "512"], "--seq-len 512"),                      # 576 image tokens
    (["llava-1.5-7b", "--seq-len", "2048", "--images", "4"], ">= 2308"),          # 4 x (576 + 1)
    (["llava-1.5-7b", "--seq-len", "576"], ">= 577"),
    (["llava-1.5-7b", "--seq-len", "2048", "--image-size", "224"], "--image-size 224"),
    (["qwen2.5-vl-3b", "--seq-len", "2048"], "--image-size"),                     # no default size
    (["qwen2.5-vl-3b", "--seq-len", "2048", "--image-size", "500"], "multiple of 28"),
    (["gemma-3-4b-it", "--seq-len", "2048", "--loss", "upcast"], "--loss upcast"),
    (["gemma-3-4b-it", "--seq-len", "2048", "--fsdp", "full"], "--fsdp"),
    (["llama-3.2-1b", "--images", "2"], "--images"),
    (["llama-3.2-1b", "--freeze-vision-tower"], "--freeze-vision-tower"),
    (["llama-3.2-1b", "--task", "image-text-to-text"], "image-text-to-text"),
    (["qwen2.5-vl-3b", "--task", "causal-lm"], "--task causal-lm"),                # no text class for qwen2_5_vl_text
])
def test_refusals_are_one_line(capsys, argv, names):
    code, out, err = run_cli(capsys, "trace", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and names in lines[0], err


# ----- estimate ------------------------------------------------------------------------------------
#: |estimate / trace - 1| of the peak allocated these tiny models stay within (measured: 0.5% at most,
#: LLaVA's -0.36% from the allocator's unsplit blocks of its tiny tensors, which trace counts; the
#: 72-setup grid at real widths, benchmarks/bench_vlm.py, has the numbers of docs/agreement.md)
ESTIMATE_BOUND = 0.01


@pytest.mark.parametrize("name, setup", [
    ("qwen2_5_vl", {}), ("llava", {}), ("gemma3", {}),
    ("qwen2_5_vl", {"images": 2, "precision": "fp16-amp", "freeze_vision_tower": True}),
    ("llava", {"images": 2, "precision": "fp16-amp", "freeze_vision_tower": True}),
    ("gemma3", {"batch_size": 1, "lora_rank": 8, "lora_targets": "q_proj,v_proj"}),
])
def test_estimate_agrees_with_trace(name, setup):
    """The derived estimate (the language model's layers fitted in batch and sequence, the vision tower and
    projector per image: ``trace.derive._vision_fit``) against the real step traced."""
    cfg, size = MODELS[name]
    kw = {"batch_size": 2, "seq_len": 1280, "precision": "bf16", **size, **setup}
    e, t = trainmem.estimate(cfg, **kw), trainmem.trace(cfg, steps=2, **kw)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=ESTIMATE_BOUND)
    per_sample = sum(c.bytes for c in e.components if c.name == "activations.derived.per_sample")
    # the vision side is counted; under LoRA peft freezes the tower and the projector: it saves nothing
    assert (per_sample > 0) == (not setup.get("lora_rank"))


def test_estimate_frozen_tower_keeps_no_gradients_nor_states_for_it():
    """--freeze-vision-tower: the tower's parameters leave the optimizer (LLaVA's projector stays trained), and
    the tower saves nothing for backward, so the per-image bytes drop to the projector's."""
    cfg, _ = MODELS["llava"]
    kw = dict(batch_size=2, seq_len=1280, precision="bf16")
    full, frozen = trainmem.estimate(cfg, **kw), trainmem.estimate(cfg, freeze_vision_tower=True, **kw)
    traced = trainmem.trace(cfg, steps=2, freeze_vision_tower=True, **kw)

    def states(r):
        return sum(c.bytes for c in r.components if c.name.startswith("optimizer_states"))

    def vision(r):
        return sum(c.bytes for c in r.components if c.name == "activations.derived.per_sample" or
                   any(k in c.name for k in (".vision_tower.", ".multi_modal_projector.")))
    assert states(frozen) < states(full)
    assert states(frozen) == pytest.approx(states(traced), rel=0.02)  # (the estimate's 512-byte blocks)
    assert 0 < vision(frozen) < vision(full) and vision(frozen) == pytest.approx(vision(traced), abs=16)  # (fit)


def test_unread_vision_parameters_get_no_gradient():
    """LLaVA reads CLIP's penultimate layer: its last layer and post-layernorm get no gradient (no optimizer
    state); SigLIP's pooling head, built when vision_use_head is on, neither. Qwen2-VL reads its whole tower."""
    from trainmem.spec.profile import profile_for
    unused = {name: {p.name for p in profile_for(MODELS[name][0]).outer if p.role == "unused"} for name in MODELS}
    assert not unused["qwen2_5_vl"]
    assert unused["llava"] and all(".encoder.layers.1." in n or ".post_layernorm." in n for n in unused["llava"])
    assert any(".post_layernorm." in n for n in unused["llava"])
    assert unused["gemma3"] and all(".vision_tower.head." in n for n in unused["gemma3"])


@pytest.mark.parametrize("argv, names", [
    (["llava-1.5-7b", "--seq-len", "1024", "--recompute", "full", "--recompute-every", "2"], "--recompute-every 2"),
])
def test_estimate_refusals_are_one_line(capsys, argv, names):
    code, out, err = run_cli(capsys, "estimate", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and names in lines[0], err


@pytest.mark.parametrize("name", ["qwen2.5-vl-3b", "qwen2.5-vl-7b", "llava-1.5-7b", "gemma-3-4b-it"])
def test_images_are_read_without_transformers_as_with_it(name):
    """The catalogue's estimate needs no transformers: its image fields read from the config dict and its
    classes' defaults give what transformers' config objects give."""
    from trainmem.spec.vision import _plain_vision_inputs
    cfg = {k: v for k, v in trainmem.resolve_model(name).config.items() if not k.startswith("_")}
    assert _plain_vision_inputs(cfg) == vision_inputs(cfg)


def test_bundled_vlm_classes_are_transformers():
    """``spec.tasks.VLM_CLASSES`` (read while transformers is not imported) is transformers' auto mapping."""
    from transformers.models.auto import modeling_auto
    from trainmem.spec.tasks import TASKS, VLM_CLASSES
    for task, mapping in TASKS.items():
        for mtype in MODELS | {"qwen2_vl": None}:
            assert getattr(modeling_auto, mapping).get(mtype) == VLM_CLASSES.get(task, {}).get(mtype), (task, mtype)


def test_catalogue_estimate_needs_no_torch(tmp_path):
    """The shipped coefficients (tools/ship_derived.py ``_ship_vlm``: one image per sample, any --images reads
    them; Qwen2.5-VL at 448 px) answer the catalogue's VLMs without torch or transformers."""
    import json
    import subprocess
    import sys
    code = ("import json, sys, trainmem\n"
            "for n, kw in [('qwen2.5-vl-3b', {'image_size': 448}), ('qwen2.5-vl-7b', {'image_size': 448}),\n"
            "              ('llava-1.5-7b', {}), ('gemma-3-4b-it', {})]:\n"
            "    for b in (1, 2):\n"
            "        trainmem.estimate(n, batch_size=b, seq_len=2048, images=2, precision='bf16', **kw)\n"
            "        trainmem.estimate(n, batch_size=b, seq_len=2048, precision='bf16-amp', freeze_vision_tower=True, **kw)\n"
            "print(json.dumps(['torch' in sys.modules, 'transformers' in sys.modules]))\n")
    src = str(Path(trainmem.__file__).resolve().parents[1])  # (this checkout's trainmem)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"TRAINMEM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": src})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]


def _small_vocab(cfg: dict) -> dict:
    """``cfg`` with a 4096-token vocabulary and the image token inside it (a real CPU step in seconds)."""
    out = dict(cfg, vocab_size=4096, image_token_id=4000)
    if "text_config" in cfg:
        out["text_config"] = dict(cfg["text_config"], vocab_size=4096)
    if cfg["model_type"] in ("llava", "gemma3"):
        out["image_token_index"] = 4000
    if cfg["model_type"] == "gemma3":  # SigLIP at 224 px: 16x16 patches pooled to 4x4 tokens
        out.update(vision_config=dict(cfg["vision_config"], image_size=224), mm_tokens_per_image=16)
    return out


@pytest.mark.parametrize("name, seq, images", [("qwen2_5_vl", 160, 2), ("llava", 600, 1), ("gemma3", 64, 2)])
def test_batch_runs_the_real_model_on_real_tensors(name, seq, images):
    """The batch is one the model accepts with data (as measure feeds it on a GPU): the placeholder count check,
    Qwen's 3-D rope index over the modality ids (each image one group), Gemma's bidirectional image blocks."""
    cfg, size = MODELS[name]
    r = resolve(_small_vocab(cfg), batch_size=2, seq_len=seq, images=images, precision="fp32", **size)
    assert vision_inputs(r.model.config).image_token_id == 4000
    model = hf_factory(r.model, r.training)()
    out = model(**model_batch(r.model, r.training, "cpu"))
    out.loss.backward()
    assert out.logits.shape[:2] == (2, seq) and torch.isfinite(out.loss)
    if name == "qwen2_5_vl":  # the image tokens got 3-D positions: the rope deltas are not all zero
        assert model.model.rope_deltas is not None and (model.model.rope_deltas != 0).any()


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_images_must_be_a_positive_integer(capsys, value):
    """``--images`` (images per sample): 0, a negative count and a non-number are one error line, exit 2;
    the Python API refuses 0 as TrainmemError."""
    code, out, err = run_cli(capsys, "estimate", "llava-1.5-7b", "--seq-len", "2048", f"--images={value}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and "--images" in lines[0], err
    if value == "0":
        with pytest.raises(TrainmemError, match="--images must be a positive integer"):
            trainmem.estimate("llava-1.5-7b", seq_len=2048, images=0)
