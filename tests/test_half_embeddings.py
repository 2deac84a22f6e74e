"""``--half-embeddings``: TRL 0.12-0.21's ``peft_module_casting_to_bf16`` after peft's
``prepare_model_for_kbit_training`` on a 4-bit model under bf16 autocast: the embeddings and LM head
in bf16, the other weights that are not 4-bit fp32. Checked against the parameter arithmetic, against
trace of the same setup (the real transformers model with the modules cast as TRL casts them) and
against the fms-acceleration Mistral-7B QLoRA rows (TRL 0.13.0)."""
import json
import os

import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.spec.resolve import resolve

PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")
# Mistral-7B cut to 2 layers and a 1024-token vocabulary: the peak is a layer's backward either way
SMALL = dict(set=["num_hidden_layers=2", "vocab_size=1024"], batch_size=2, seq_len=1024, precision="bf16-amp",
             optimizer="adamw", recompute="full", attention="sdpa", lora_rank=16,
             lora_targets="q_proj,k_proj,v_proj,o_proj", quantize="nf4-dq")


@pytest.mark.parametrize("opts", [dict(), dict(quantize="nf4", lora_rank=8, precision="bf16"),
                                  dict(lora_rank=8, precision="bf16-amp"),
                                  dict(quantize="nf4", lora_rank=8, precision="bf16-amp", quantize_via="fabric")])
def test_refused_outside_qlora_under_autocast(opts):
    with pytest.raises(TrainmemError, match="--half-embeddings"):
        resolve("llama-3.2-1b", half_embeddings=True, **opts)


def _component(report, name):
    return sum(c.bytes for c in report.components if c.name == name)


def test_tables_half_no_head_copy_first_input_half():
    """Embedding and head (each 1024 x 4096) lose 2 bytes per element; autocast keeps no half copy
    of a half head; the first layer's checkpointed input is half: (2, 1024, 4096) x 2 bytes less."""
    off = trainmem.estimate("mistral-7b", **{**SMALL, "set": ["num_hidden_layers=2"]})
    on = trainmem.estimate("mistral-7b", half_embeddings=True, **{**SMALL, "set": ["num_hidden_layers=2"]})
    tables = 2 * 32000 * 4096
    assert _component(off, "parameters") - _component(on, "parameters") == tables * 2
    assert _component(off, "activations.autocast_weight_copies.head") == 32000 * 4096 * 2
    assert _component(on, "activations.autocast_weight_copies.head") == 0
    first = 2 * 1024 * 4096 * 2
    assert _component(off, "activations.layers.checkpointed_inputs") - \
        _component(on, "activations.layers.checkpointed_inputs") == first
    assert on.peak_allocated < off.peak_allocated


@pytest.mark.slow
def test_against_trace():
    """What the option saves at the peak (a layer's backward: the two tables and the first layer's
    input) agrees with trace, which casts the built model's modules as TRL does
    (``workload.cast_half_embeddings``), within 5 % of the saving."""
    from trainmem.trace import trace
    est = [trainmem.estimate("mistral-7b", half_embeddings=h, **SMALL).peak_allocated for h in (False, True)]
    tr = [trace("mistral-7b", half_embeddings=h, **SMALL).peak_allocated for h in (False, True)]
    saved_est, saved_trace = est[0] - est[1], tr[0] - tr[1]
    assert saved_trace > 0 and abs(saved_est - saved_trace) <= 0.05 * saved_trace


@pytest.mark.parametrize("batch", [4, 8])
def test_fms_mistral_qlora_rows(batch):
    """fms-acceleration's Mistral-7B QLoRA rows (TRL 0.13.0, torch.cuda.max_memory_allocated): the
    estimate with the option within 0.5 %, and below the estimate without it."""
    fx = json.load(open(os.path.join(PUBLISHED, f"hf_fms_mistral7b_qlora_g1_b{batch}.json")))
    measured = fx["measured"][0]["bytes"]
    assert fx["setup"]["half_embeddings"] is True
    with_it = trainmem.estimate(fx["model"], **fx["setup"]).peak_allocated
    without = trainmem.estimate(fx["model"], **{**fx["setup"], "half_embeddings": False}).peak_allocated
    assert abs(with_it - measured) / measured < 0.005
    assert without > with_it
