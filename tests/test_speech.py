"""Speech models: Whisper (``--task speech-seq2seq``, WhisperForConditionalGeneration) on its log-mel
``input_features``, its encoder's fixed length, ``--target-len``, and the derived estimate (fitted in
the batch and the decoder's length alone) against the trace of the real model; CTC refused.

Compared with expandable segments, as tests/test_encdec_vit.py does (there a block is the request
rounded to 512 bytes: the comparison is of the tensors themselves)."""
from __future__ import annotations

import json

import pytest
from transformers import Wav2Vec2Config, WhisperConfig

import trainmem

from test_cli import ERROR_PREFIX, run_cli

#: a narrow Whisper whose encoder takes 400 mel frames (200 positions): traced in seconds
WHISPER_SMALL = WhisperConfig(d_model=128, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, vocab_size=3000,
                              num_mel_bins=40, max_source_positions=200, max_target_positions=256,
                              pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=2,
                              architectures=["WhisperForConditionalGeneration"]).to_dict()
TOLERANCE = 0.005


def _error(**setup) -> float:
    est = trainmem.estimate(WHISPER_SMALL, expandable_segments=True, **setup).peak_allocated
    tr = trainmem.trace(WHISPER_SMALL, expandable_segments=True, **setup).peak_allocated
    return est / tr - 1


def test_whisper_config_without_architectures_is_its_speech_seq2seq_model():
    """WhisperForCausalLM (the decoder alone, speculative decoding's assistant) is not what is fine-tuned."""
    spec = trainmem.resolve_model({k: v for k, v in WHISPER_SMALL.items() if k != "architectures"})
    assert (spec.architecture, spec.head, spec.decoder_layers, spec.num_layers) == \
        ("WhisperForConditionalGeneration", "speech-seq2seq", 3, 6)
    assert (spec.mel_bins, spec.source_positions, spec.mel_frames, spec.max_positions) == (40, 200, 400, 256)
    assert trainmem.resolve_model(WHISPER_SMALL, task="speech-seq2seq") == trainmem.resolve_model(WHISPER_SMALL)


def test_encoder_length_is_fixed_and_target_defaults_to_the_decoder_positions():
    r = trainmem.resolve(WHISPER_SMALL)
    assert (r.training.seq_len, r.training.decoder_len) == (200, 256)
    assert trainmem.resolve(WHISPER_SMALL, target_len=64).training.decoder_len == 64


def test_sinusoidal_encoder_positions_get_no_gradient():
    """WhisperEncoder freezes its embed_positions (requires_grad_(False)): no gradient, no optimizer state."""
    spec = trainmem.resolve_model("whisper-small")
    frozen = [p for p in spec.parameter_tensors() if p.role == "unused"]
    assert [(p.name, p.shape) for p in frozen] == [("model.encoder.embed_positions.weight", (1500, 768))]


@pytest.mark.parametrize("name, params", [("whisper-tiny", 37_760_640), ("whisper-base", 72_593_920),
                                          ("whisper-small", 241_734_912), ("whisper-medium", 763_857_920),
                                          ("whisper-large-v3", 1_543_490_560)])
def test_catalogue_parameter_counts(name, params):
    """The counts transformers' WhisperForConditionalGeneration has (the decoder's embedding tied to proj_out)."""
    assert sum(p.numel for p in trainmem.resolve_model(name).parameter_tensors()) == params


@pytest.mark.parametrize("argv, names", [
    (["whisper-tiny", "--seq-len", "512"], "--seq-len 512"),
    (["whisper-tiny", "--target-len", "449"], "--target-len 449"),
    (["whisper-tiny", "--loss", "upcast"], "--loss upcast"),
    (["whisper-tiny", "--task", "seq2seq-lm"], "--task seq2seq-lm"),
])
def test_refusals_are_one_line(capsys, argv, names):
    code, out, err = run_cli(capsys, "estimate", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and names in lines[0], err


def test_ctc_is_refused_in_one_line(capsys, tmp_path):
    """Wav2Vec2ForCTC (the natural head of wav2vec2: --task ctc) is recognised and refused, in trace and
    estimate alike, in one line naming it, rather than traced without its input or derived wrongly."""
    cfg = Wav2Vec2Config(num_hidden_layers=2, vocab_size=32).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert trainmem.resolve_model(cfg).head == "ctc"
    for command in ("estimate", "trace"):
        code, out, err = run_cli(capsys, command, str(tmp_path))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), err
        assert "Wav2Vec2ForCTC" in lines[0] and "CTC" in lines[0]


def test_trace_runs_the_target_length():
    """The decoder's labels are --target-len tokens: the step's peak grows with them."""
    short = trainmem.trace(WHISPER_SMALL, batch_size=2, target_len=32, steps=1)
    long = trainmem.trace(WHISPER_SMALL, batch_size=2, target_len=256, steps=1)
    assert short.phases[1].peak < long.phases[1].peak


@pytest.mark.parametrize("setup", [
    dict(batch_size=2, target_len=64, precision="fp32"),
    dict(batch_size=4, target_len=192, precision="bf16-amp"),
    dict(batch_size=1, target_len=32, precision="fp16-amp"),
    dict(batch_size=4, target_len=128, precision="fp16-amp", lora_rank=32, lora_targets=["q_proj", "v_proj"]),
    dict(batch_size=4, target_len=128, precision="bf16-amp", recompute="full"),
], ids=["fp32", "bf16-amp", "fp16-amp-b1", "lora", "recompute"])
def test_estimate_agrees_with_trace(setup):
    assert abs(_error(**setup)) <= TOLERANCE


def test_fit_searches_the_micro_batch_at_the_fixed_encoder_length(capsys):
    """fit without --seq-len searches Whisper's micro-batch (its sequence is fixed); --batch-size, which
    would search the sequence, is refused in one line."""
    from trainmem.plan.fit import fit
    r = fit(WHISPER_SMALL, gpu_memory="2GiB", target_len=64)
    assert r.fits and r.search == "batch_size" and r.batch_size >= 1 and r.seq_len == 200
    code, out, err = run_cli(capsys, "fit", "whisper-tiny", "--gpu", "h100", "--batch-size", "4")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "drop --batch-size" in lines[0], err
