"""torchtune v0.1.0's LoRA run rebuilt from its source (benchmarks/bench_torchtune_v01.py) and traced:
what the LoRA tutorial fixtures' ~6 % gap is made of.

* the build reproduces the memory torchtune printed after model init (QLoRA tutorial at ff594c231,
  docs/source/tutorials/qlora_finetune.rst L154-157: 13.96 GB allocated, 13.98 GB reserved);
* at the fixtures' fixed 2 x 512 batch the traced step's allocated peak is the estimate's (the
  fixtures say ``--cast-output`` and ``--layer-rope-cache 4096``) but for the loop's shifted fp32
  logits, one row per sample shorter than the fp32 output ``--cast-output`` holds;
* batches whose padded length changes every micro-batch make the caching allocator reserve more
  than fixed-length batches do (``--min-seq-len``, tests/test_min_seq_len.py).
"""
from __future__ import annotations

import random

import pytest
from conftest import load_benchmark

pytest.importorskip("torch")

GB = 10 ** 9


@pytest.fixture(scope="module")
def tt():
    return load_benchmark("bench_torchtune_v01")


def test_build_reproduces_the_published_model_init_memory(tt):
    """The 33 layers alive while ``_get_clones`` deep-copies the template, the RoPE caches and the
    adapters: torchtune's own log of the LoRA (q, v, rank 8) model init, to its printed 0.01 GB."""
    import torch
    from trainmem.trace import trace

    def build_only(model, optimizer, i):
        tt.loop("qv_r8", [512], 0, template=True)(model, optimizer, i)   # the template, no batch

    r = trace(lambda: tt.build("qv_r8", 32), build_only, steps=1, gpu="rtx-4090",
              optimizer_fn=lambda m: torch.optim.AdamW(m.parameters()))
    assert round(r.peak_allocated / GB, 2) == 13.96
    assert round(r.peak_reserved / GB, 2) == 13.98


def test_fixed_length_step_is_the_estimate_plus_two_named_terms(tt):
    """4 layers of the q, v rank-8 case at 2 x 512: trace(torchtune's step) = estimate(fixture) + the
    shifted fp32 logits the loop holds - the unshifted fp32 logits ``--cast-output`` holds (one row
    per sample more). The fixture's ``--layer-rope-cache 4096`` counts the layers' RoPE buffers (its
    theta in a 512-byte block where the replica's 256 B are counted as such); its ``--min-seq-len``
    changes reserved memory only: the allocated peak is the 512-token micro-batch's."""
    layers, b, s, vocab = 4, 2, 512, tt.VOCAB
    est, _published = tt.estimated("qv_r8", layers)
    got = tt.traced("qv_r8", layers, [s], 3, 2, template=False)
    held_shifted = b * (s - 1) * vocab * 4                  # logits[..., :-1, :].contiguous(), fp32
    held_cast = b * s * vocab * 4                           # what --cast-output keeps: the fp32 output
    expected = est.peak_allocated + held_shifted - held_cast
    assert abs(got.peak_allocated - expected) < 0.002 * got.peak_allocated


def test_varying_padded_length_grows_reserved_memory(tt):
    """Padding to the longest sample (a 512-token batch, then lengths drawn from 64-512) against
    fixed 512-token batches, 2 layers: the allocated peak is no higher, the reserved memory is."""
    rng = random.Random(0)
    lengths = [512] + [rng.randint(64, 512) for _ in range(29)]
    fixed = tt.traced("qv_r8", 2, [512], 3, 2, template=False)
    varying = tt.traced("qv_r8", 2, lengths, 10, 3, template=False)
    assert varying.peak_allocated <= fixed.peak_allocated
    assert varying.peak_reserved > fixed.peak_reserved + 0.05 * GB


def _tutorial_setup():
    import json
    from pathlib import Path
    d = json.loads((Path(__file__).parents[1] / "validation" / "published"
                    / "torchtune_tut_llama2_7b_lora_qv_r8.json").read_text())
    return d["model"], dict(d["setup"])


def test_the_estimate_replays_the_build_and_reproduces_the_init_log():
    """The estimate of the q, v rank-8 fixture (``--framework torchtune --framework-version 0.1.0``)
    replays the build (``quant4.torchtune_v01_build``: the template, the embedding and the head, the 32
    deep copies, the template freed): its model-init phase is torchtune's log to the printed 0.01 GB.
    The same options without the preset build nothing: the model's tensors alone, 0.4 GB lower."""
    import trainmem
    model, setup = _tutorial_setup()
    phase = trainmem.estimate(model, **setup).phase("model_loaded", 0)
    assert round(phase.peak / GB, 2) == 13.96
    assert round(phase.reserved / GB, 2) == 13.98
    bare = {k: v for k, v in setup.items() if k not in ("framework", "framework_version")}
    plain = trainmem.estimate(model, **bare).phase("model_loaded", 0)
    assert plain.peak == plain.allocated == phase.allocated     # the same model, no template
    assert phase.reserved - plain.reserved > 0.35 * GB          # the template's cached blocks


@pytest.mark.parametrize("version, opts, builds", [
    ("0.1.0", dict(lora_rank=8), True),             # lora_llama2: one layer, _get_clones
    ("0.5.0", {}, True),                            # llama2(): the same up to 0.5
    ("0.6.1", {}, False),                           # a list of layers built in a loop
    ("0.6.1", dict(lora_rank=8), False),            # each LoRA layer its own RoPE, no template
    ("0.1.0", dict(lora_rank=8, dp=2), False),      # the distributed recipe builds off the device
    ("0.1.0", dict(lora_rank=8, precision="fp32"), False),  # replayed in bf16 only
    ("0.1.0", dict(lora_rank=8, quantize="nf4"), True),     # torchao 0.1's NF4 build (its own case)
    (None, dict(lora_rank=8, layer_rope_cache=4096), False),  # no preset: no torchtune build
])
def test_which_runs_replay_torchtune_s_build(version, opts, builds):
    from trainmem.estimate.quant4 import builds_on_device
    from trainmem.spec.resolve import resolve
    kw = dict(framework="torchtune", framework_version=version) if version else {}
    t = resolve("llama-2-7b", batch_size=2, seq_len=512, gpu="rtx-4090", **kw, **opts).training
    assert builds_on_device(t) is builds


def test_the_replay_runs_the_loops_shift_and_log_softmax_copy():
    """torchtune < 0.3's loss in the reserved replay (``reserved.loss_forward._torchtune_loop_loss``): from the fp32
    output, the shifted fp32 copy (kept as the held output), ``log_softmax``'s contiguous copy of its
    transposed input beside its fp32 output, the copy freed: 3 shifted-sized tensors at the top."""
    from types import SimpleNamespace
    from trainmem.estimate.reserved.loss_forward import _torchtune_loop_loss
    from trainmem.estimate.reserved.replay import _Replay
    b, s, vocab, per_token = 2, 512, 32000, 8 * 1024          # tensors of whole 512-byte units
    full, shifted = b * s * vocab, b * (s - 1) * vocab
    q = SimpleNamespace(logit_width=vocab, tp=1)
    tk = SimpleNamespace(loss_saved=shifted * 4 + per_token)
    R = _Replay()
    out = [R.alloc(full * 4)]                                  # the decoder's fp32 output
    saved = _torchtune_loop_loss(R, q, tk, out, full, b)
    assert len(saved) == 2 and len(out) == 1
    assert R.a.block_size(out[0]) == shifted * 4               # the loop's logits: the shifted copy
    assert R.a.allocated == 2 * shifted * 4 + per_token        # the copy and the log-probabilities
    assert R.a.peak_allocated == 3 * shifted * 4 + per_token   # ... with log_softmax's contiguous input


@pytest.mark.parametrize("version, opts, shifts", [
    ("0.1.0", dict(lora_rank=8), True),
    ("0.2.1", {}, True),
    ("0.3.0", {}, False),                                      # CEWithChunkedOutputLoss, del logits
    ("0.1.0", dict(lora_rank=8, hold_output="loss"), False),   # not the release's loop
    (None, dict(lora_rank=8, cast_output=True, hold_output="step", loss="upcast"), False),  # no preset
])
def test_which_runs_replay_the_loops_shift(version, opts, shifts):
    from trainmem.estimate.quantities.build import quantities
    from trainmem.spec.resolve import resolve
    kw = dict(framework="torchtune", framework_version=version) if version else {}
    r = resolve("llama-2-7b", batch_size=2, seq_len=512, gpu="rtx-4090", **kw, **opts)
    assert bool(quantities(r.model, r.training, "worst").loss_tt_shift) is shifts
