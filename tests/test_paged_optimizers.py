"""bitsandbytes' paged optimizers keep their states in CUDA unified memory, not device memory."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate.states import block_bytes, model_states
from trainmem.spec import TrainingSpec

M = trainmem.resolve_model("llama-3.2-1b")


@pytest.mark.parametrize("paged,plain", [("paged-adamw-8bit", "adamw-8bit"), ("paged-adamw", "adamw")])
def test_paged_states_are_not_device_memory(paged, plain):
    # rank 64 on q_proj (2048 x 2048): both adapters have 131072 >= 1e5 elements, so paged
    p = model_states(M, TrainingSpec(optimizer=paged, lora_rank=64, lora_targets=("q_proj",)))
    q = model_states(M, TrainingSpec(optimizer=plain, lora_rank=64, lora_targets=("q_proj",)))
    assert q.optimizer > 0
    # PagedAdamW: nothing on the device; PagedAdamW8bit: only the fp32 absmax per 256 elements
    # (bitsandbytes >= 0.44.0) and the two shared 256-entry quantization maps
    per_layer = 0 if paged == "paged-adamw" else 2 * 2 * block_bytes(131072 // 256 * 4)
    qmaps = 0 if paged == "paged-adamw" else 2 * block_bytes(256 * 4)
    assert p.optimizer == M.num_layers * per_layer + qmaps
    assert (p.weights, p.grads) == (q.weights, q.grads)
    r = trainmem.estimate(M, optimizer=paged, lora_rank=64, lora_targets="q_proj")
    assert r.component("optimizer_states") == p.optimizer


def test_small_tensors_are_not_paged():
    """bitsandbytes ``get_state_buffer`` pages tensors of >= 1e5 elements only (0.42.0
    optim/optimizer.py L304-312): rank-16 adapters of v_proj (512 x 16 = 8192 and 16 x 2048 =
    32768 elements) keep ordinary fp32 states on the device."""
    p = model_states(M, TrainingSpec(optimizer="paged-adamw", lora_rank=16, lora_targets=("v_proj",)))
    assert p.optimizer == M.num_layers * 2 * (block_bytes(8192 * 4) + block_bytes(32768 * 4))


def test_trace_runs_bitsandbytes_emulated_and_the_cpu_does_not_page():
    """On the CPU bitsandbytes does not page (``get_state_buffer`` falls back to ``zeros_like``):
    a paged optimizer's states are ordinary tensors there, as the plain one's."""
    pytest.importorskip("transformers")
    from trainmem.trace import trace
    opts = dict(device="cpu", set=["n_layer=1", "n_embd=64", "n_head=2", "vocab_size=1000"], seq_len=64)
    paged = trace("gpt2", optimizer="paged-adamw-8bit", **opts)
    plain = trace("gpt2", optimizer="adamw-8bit", **opts)
    assert paged.component("optimizer_states") == plain.component("optimizer_states") > 0
