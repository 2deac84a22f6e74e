"""EleutherAI Transformer Math 101 as quoted by Edward Rees, "Transformer Memory Arithmetic"
(https://erees.dev/transformer-memory/)."""
import pytest

import trainmem
from trainmem.estimate.methods import eleuther, get_method
from trainmem.spec import TrainingSpec

GiB = 2**30


def test_nanogpt_activations_12_02():
    # Rees: EleutherAI's sbhL(34 + 5as/h) for GPT-2 small (b=12, s=1024, h=768, L=12, a=12)
    # "we get an estimate of only 12.02GB". The figure is 12,910,067,712 bytes: 12.02 in GiB
    # (12.91 in decimal GB), so Rees's "GB" means GiB here.
    assert eleuther.activation_bytes(1024, 12, 768, 12, 12) == 12_910_067_712
    r = get_method("eleuther")(trainmem.resolve_model("nanogpt-124m"),
                               TrainingSpec(batch_size=12, seq_len=1024, precision="bf16-amp"))
    assert r.component("activations") / GiB == pytest.approx(12.02, abs=0.005)


def test_bytes_per_param_table():
    assert sum(eleuther.bytes_per_param("bf16-amp", "adamw").values()) == 16
    assert sum(eleuther.bytes_per_param("fp32", "adamw").values()) == 16
    assert eleuther.bytes_per_param("bf16-amp", "adamw-8bit")["optimizer_states"] == 6
    assert eleuther.bytes_per_param("bf16-amp", "sgd-momentum")["optimizer_states"] == 8


def test_recompute_and_zero():
    s, b, h, a, L = 1024, 12, 768, 12, 12
    assert eleuther.activation_bytes(s, b, h, a, L, recompute="full") == 2 * s * b * h * L
    spec = trainmem.resolve_model("nanogpt-124m")
    r0 = get_method("eleuther")(spec, TrainingSpec(batch_size=1, seq_len=128, dp=4))
    r3 = get_method("eleuther")(spec, TrainingSpec(batch_size=1, seq_len=128, dp=4, zero=3))
    states = lambda r: sum(c.bytes for c in r.components if c.persistent)  # noqa: E731
    assert states(r0) == 16 * spec.num_params
    assert states(r3) == 4 * spec.num_params
