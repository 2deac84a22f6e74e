"""bitsandbytes' paged optimizers keep their states in CUDA unified memory, not device memory."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate.states import model_states
from trainmem.spec import TrainingSpec

M = trainmem.resolve_model("llama-3.2-1b")


@pytest.mark.parametrize("paged,plain", [("paged-adamw-8bit", "adamw-8bit"), ("paged-adamw", "adamw")])
def test_paged_states_are_not_device_memory(paged, plain):
    p = model_states(M, TrainingSpec(optimizer=paged, lora_rank=16))
    q = model_states(M, TrainingSpec(optimizer=plain, lora_rank=16))
    assert p.optimizer == 0 < q.optimizer
    assert (p.weights, p.grads) == (q.weights, q.grads)
    r = trainmem.estimate(M, optimizer=paged, lora_rank=16)
    assert r.component("optimizer_states") == 0


def test_trace_refuses_bitsandbytes():
    pytest.importorskip("transformers")
    from trainmem.trace import trace
    with pytest.raises(TrainmemError, match="not in torch.optim"):
        trace("gpt2", device="cpu", set=["n_layer=1"], seq_len=64, optimizer="paged-adamw-8bit")
