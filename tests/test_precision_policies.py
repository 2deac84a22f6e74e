"""Precision policies as frameworks run them: a master copy only where the framework keeps one,
and FSDP's mixed-precision policy (--precision bf16-mp)."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate.states import model_states
from trainmem.spec import TrainingSpec

M = trainmem.resolve_model("llama-3.2-1b")


def states(**o):
    return model_states(M, TrainingSpec(seq_len=1024, **o))


def test_master_copy_only_where_the_framework_keeps_one():
    # FSDP on bf16 parameters (and plain PyTorch, Lightning bf16-true) keeps no fp32 copy; DeepSpeed's
    # ZeRO bf16 optimizer and Megatron's distributed optimizer do; --master-weights says it outright
    fsdp = states(precision="bf16", fsdp="full", dp=8)
    zero = states(precision="bf16", zero=3, dp=8)
    fsdp_fp32 = states(precision="bf16", fsdp="full", dp=8, master_weights="fp32")
    zero_none = states(precision="bf16", zero=3, dp=8, master_weights="none")
    assert fsdp.master == 0 and zero_none.master == 0 and states(precision="bf16").master == 0
    # the same fp32 copy, DeepSpeed's as one flat tensor rounded once (states.flat_zero), FSDP's per tensor
    MiB = 2 ** 20
    assert zero.master > 0 and zero.master <= fsdp_fp32.master < zero.master + 2 * MiB
    assert states(precision="bf16", distributed_optimizer=True, dp=8).master > 0
    # the states follow: fp32 with a master copy, bf16 without (2 bytes instead of 4 per element)
    assert fsdp_fp32.optimizer == pytest.approx(2 * fsdp.optimizer, rel=0.005)  # + rounding
    assert zero.optimizer <= fsdp_fp32.optimizer < zero.optimizer + 2 * 2 * MiB  # two flat states
    assert zero_none.optimizer <= fsdp.optimizer < zero_none.optimizer + 2 * 2 * MiB


def test_fsdp_mixed_precision_policy():
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded parameters, gradients and
    # states as under autocast, but the layers are gathered in bf16 and compute runs in bf16 without
    # autocast's weight copies
    mp = states(precision="bf16-mp", fsdp="full", dp=8)
    amp = states(precision="bf16-amp", fsdp="full", dp=8)
    assert (mp.weights, mp.grads, mp.optimizer, mp.master) == (amp.weights, amp.grads, amp.optimizer, 0)
    assert 2 * mp.layer_params_full == amp.layer_params_full
    r_mp = trainmem.estimate(M, precision="bf16-mp", fsdp="full", dp=8, seq_len=1024)
    r_bf16 = trainmem.estimate(M, precision="bf16", fsdp="full", dp=8, seq_len=1024)
    # the activations are those of bf16 compute
    assert r_mp.extra["activations_per_layer"] == r_bf16.extra["activations_per_layer"]


def test_bad_precision_combinations():
    with pytest.raises(TrainmemError, match="bf16-mp is FSDP"):
        TrainingSpec(precision="bf16-mp")
    with pytest.raises(TrainmemError, match="--master-weights is for half weights"):
        TrainingSpec(precision="bf16-amp", master_weights="fp32")
    with pytest.raises(TrainmemError, match="--master-weights"):
        TrainingSpec(precision="bf16", master_weights="fp16")


def test_trace_refuses_a_master_copy_it_cannot_run():
    pytest.importorskip("transformers")
    from trainmem.trace import trace
    with pytest.raises(TrainmemError, match="--master-weights fp32"):
        trace("gpt2", device="cpu", set=["n_layer=1"], seq_len=64, precision="bf16", master_weights="fp32")
