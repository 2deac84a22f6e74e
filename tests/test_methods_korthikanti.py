"""Korthikanti et al. activations, checked against the numbers quoted by Edward Rees ("Transformer
Memory Arithmetic", https://erees.dev/transformer-memory/) and by @maxshapp on Medium
(https://medium.com/@maxshapp/understanding-and-estimating-gpu-memory-demands-for-training-llms-in-practise-c5ef20a4baff)."""
import pytest

import trainmem
from trainmem.estimate.methods import get_method, korthikanti
from trainmem.spec import TrainingSpec

GiB = 2**30


def test_llama2_70b_33tb():
    # @maxshapp's article: LLaMA-2-70B, L=80, s=4096, b=64, h=8192, a=64, p=2 (no GQA):
    # 80·2·4096·64·8192·(...=97) = 33TB, "每层是416GB" (416 GB per layer).
    per_layer = korthikanti.layer_activation_bytes(4096, 64, 8192, 64)
    assert per_layer / 1e9 == pytest.approx(416, rel=0.01)
    assert korthikanti.activation_bytes(4096, 64, 8192, 64, 80) / 1e12 == pytest.approx(33, rel=0.01)
    r = get_method("korthikanti")(trainmem.resolve_model("llama-2-70b"),
                                  TrainingSpec(batch_size=64, seq_len=4096, precision="bf16-amp"))
    assert r.component("activations.layers") / 1e12 == pytest.approx(33, rel=0.01)


def test_gpt2_small_12_02():
    # Rees quotes sbhL(34 + 5as/h) at 12.02 (GiB) for nanoGPT GPT-2 small, b=12, s=1024.
    assert korthikanti.activation_bytes(1024, 12, 768, 12, 12) / GiB == pytest.approx(12.02, abs=0.005)


def test_parallel_forms():
    s, b, h, a, t = 2048, 1, 4096, 32, 4
    sbh = s * b * h
    none1 = korthikanti.layer_activation_bytes(s, b, h, a)
    assert none1 == sbh * 34 + 5 * a * s * s * b
    assert korthikanti.layer_activation_bytes(s, b, h, a, t, True) * t == none1
    assert korthikanti.layer_activation_bytes(s, b, h, a, t, False) == 10 * sbh + (24 * sbh + 5 * a * s * s * b) // t
    assert korthikanti.layer_activation_bytes(s, b, h, a, t, True, "selective") == 34 * sbh // t
    assert korthikanti.layer_activation_bytes(s, b, h, a, t, False, "selective") == 10 * sbh + 24 * sbh // t
    assert korthikanti.layer_activation_bytes(s, b, h, a, t, False, "full") == 2 * sbh
