"""FSDP1 ``CPUOffload(offload_params=True)`` (``--fsdp-offload-params``): the sharded flat parameters
pinned in host memory, each unit gathered to the device for compute, the reduced gradient shards kept
on the device until the end of backward and then handed to the host optimizer, which steps there
(torch 2.13 ``fsdp/_flat_param.py`` L1249-1265, L1335-1338, L1694-1698; ``_runtime_utils.py``
L905-991): what the estimate keeps and drops, with QLoRA, and the setups refused in one line."""
import pytest

import trainmem

from trainmem.errors import TrainmemError
from trainmem.estimate.quantities.build import clear_cache
from trainmem.estimate.states import model_states
from trainmem.spec import TrainingSpec
from trainmem.spec.config import resolve_model
from trainmem.workload import check_supported

SMALL = resolve_model({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                       "intermediate_size": 704, "num_attention_heads": 8, "num_key_value_heads": 4,
                       "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 512,
                       "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"})
FULL = dict(precision="bf16", dp=2, fsdp="full", fsdp_version=1)
QLORA = dict(FULL, lora_rank=8, quantize="nf4-dq")


def test_full_training_keeps_no_parameter_state_on_the_device():
    on, off = model_states(SMALL, TrainingSpec(**FULL)), model_states(SMALL, TrainingSpec(**FULL, fsdp_offload_params=True))
    assert on.weights > 0 and on.optimizer > 0
    # the shards, the optimizer states and the fused step's scalar: host memory
    assert off.weights == 0 and off.optimizer == 0 and off.master == 0 and off.step_tensors == 0
    # the reduced gradient shards stay on the device until the post-backward final callback
    assert off.grads == on.grads and off.layer_grads == on.layer_grads
    # each unit is gathered on the device as before: its padded unsharded flat parameter
    assert off.layer_tensors == on.layer_tensors and off.root_tensors == on.root_tensors
    assert off.layer_params_full == on.layer_params_full
    # nothing of the optimizer step on the device: no state-sized temporaries
    assert off.largest_param == 0 and off.foreach_group == 0 and on.foreach_group > 0
    assert all(item[3] == () and item[4] == 0 for item in off.trainables)


def test_qlora_keeps_only_the_quant_state():
    on = model_states(SMALL, TrainingSpec(**QLORA))
    off = model_states(SMALL, TrainingSpec(**QLORA, fsdp_offload_params=True))
    # the packed codes' shards go to the host; the quant state (no parameter) stays whole on the GPU
    assert 0 < off.quantized < on.quantized
    assert off.weights == off.quantized  # no adapter shard, no norm shard on the device
    assert off.layer_tensors == on.layer_tensors  # the gathered codes and norms of one layer
    assert off.optimizer == 0 and off.grads == on.grads


def test_estimate_drops_by_at_least_the_resident_states():
    clear_cache()
    kw = dict(batch_size=2, seq_len=64, **FULL)
    on = trainmem.estimate(SMALL, **kw)
    off = trainmem.estimate(SMALL, **kw, fsdp_offload_params=True)
    st = model_states(SMALL, TrainingSpec(**FULL))
    assert off.peak_allocated <= on.peak_allocated - st.weights
    assert off.peak_allocated > 0


@pytest.mark.parametrize("opts, names", [
    (dict(fsdp_version=2), "--fsdp-version 1"),                   # FSDP2's CPUOffloadPolicy
    (dict(fsdp="grad-op"), "--fsdp full"),
    (dict(dp=1), "--dp"),
    (dict(precision="bf16-mp"), "bf16-mp"),
    (dict(grad_accum=2, grad_sync="step"), "--grad-sync"),
    (dict(optimizer="adamw-8bit"), "adamw-8bit"),
    (dict(optimizer_impl="fused"), "fused"),
])
def test_setups_not_modelled_are_refused_in_one_line(opts, names):
    with pytest.raises(TrainmemError) as e:
        TrainingSpec(**{**FULL, "fsdp_offload_params": True, **opts})
    assert "\n" not in str(e.value) and "--fsdp-offload-params" in str(e.value) and names in str(e.value)


def test_trace_and_measure_refuse_it():
    for what in ("trace", "measure"):
        with pytest.raises(TrainmemError, match="--fsdp-offload-params") as e:
            check_supported(TrainingSpec(**FULL, fsdp_offload_params=True), what)
        assert "\n" not in str(e.value)


def test_cli_flag():
    from trainmem.cli import build_parser
    from trainmem.cli.options import training_options
    a = build_parser().parse_args(["estimate", "llama-2-7b", "--dp", "2", "--fsdp", "full", "--fsdp-version", "1",
                                   "--fsdp-offload-params"])
    assert training_options(a)["fsdp_offload_params"] is True


def test_unshard_copies_the_host_shard_in_on_its_own_stream():
    """``pre_unshard`` copies the host shard to the device on the pre-unshard stream before the
    all-gather allocates the unsharded flat parameter; the copy is dropped after, but its block stays
    cached in that stream's pool (reserved, not allocated, and unusable by the default stream)."""
    from trainmem.allocator import CachingAllocator
    from trainmem.estimate.reserved.fsdp import _Fsdp
    from trainmem.estimate.reserved.replay import GATHER_STREAM, GRAD_STREAM, _Replay
    MiB = 2**20
    off, on = _Replay(CachingAllocator()), _Replay(CachingAllocator())
    for R, host in ((off, 2), (on, 0)):
        fs = _Fsdp(False, (GATHER_STREAM, GRAD_STREAM), host=host)
        fs.reshard(R, fs.unshard(R, 400 * MiB, ()))
    assert off.a.allocated == on.a.allocated == 0
    assert off.a.reserved == on.a.reserved + 200 * MiB   # the 400 MiB unit's half, copied in
    assert off.a.peak_allocated == on.a.peak_allocated + 200 * MiB


def test_quantities_carry_the_shard_count():
    from trainmem.estimate.quantities.build import quantities
    clear_cache()
    assert quantities(SMALL, TrainingSpec(**FULL, fsdp_offload_params=True)).fsdp1_host_shards == 2
    assert quantities(SMALL, TrainingSpec(**FULL)).fsdp1_host_shards == 0
