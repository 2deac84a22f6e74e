"""QLoRA under FSDP1 (bitsandbytes >= 0.43 ``quant_storage``: the packed 4-bit codes stored in the
model's dtype, flattened and sharded with the layer's norms; the quant state whole on every rank):
the estimate's sharded 4-bit bytes, a small model's estimate, and the shardings still refused."""
import pytest

import trainmem

from trainmem.errors import TrainmemError
from trainmem.estimate.quant4 import fsdp_packed_bytes, is_quantized
from trainmem.estimate.quantities.build import clear_cache, quantities
from trainmem.estimate.states import model_states
from trainmem.spec import TrainingSpec
from trainmem.spec.config import resolve_model
from trainmem.workload import check_supported

SMALL = resolve_model({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                       "intermediate_size": 704, "num_attention_heads": 8, "num_key_value_heads": 4,
                       "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 512,
                       "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"})
# (out, in) of each nn.Linear of one LlamaDecoderLayer: q, k, v, o, gate, up, down
LINEARS = [(256, 256), (128, 256), (128, 256), (256, 256), (704, 256), (704, 256), (256, 704)]
FSDP1 = dict(precision="bf16", lora_rank=8, quantize="nf4-dq", dp=2, fsdp="full", fsdp_version=1)


def _ceil512(n: int) -> int:
    return max(512, -(-n // 512) * 512)


def _state(numel: int) -> int:
    """The double-quantized quant state, by hand: fp32 offset, uint8 absmax per 64 elements, fp32
    absmax per 256 blocks, the 16-entry fp32 code; each its own 512-byte block (whole on each rank)."""
    blocks = -(-numel // 64)
    return _ceil512(4) + _ceil512(blocks) + _ceil512(-(-blocks // 256) * 4) + _ceil512(64)


def test_packed_codes_are_sharded_and_gathered_with_the_layer():
    st = model_states(SMALL, TrainingSpec(**FSDP1))
    numels = [o * i for o, i in LINEARS]
    # bf16 storage: numel // 4 elements of 2 bytes = numel / 2 bytes of codes; this rank holds half of them
    shard = sum(_ceil512(n // 2 // 2) + _state(n) for n in numels)
    assert st.quantized == SMALL.num_layers * shard
    # the layer unit gathered: every linear's codes (numel / 2 bytes) and the two bf16 norms
    assert st.layer_params_full == sum(n // 2 for n in numels) + 2 * 256 * 2
    assert sorted(st.layer_tensors) == sorted([n // 2 for n in numels] + [256 * 2, 256 * 2])
    # against the model's parameter count: half a byte per quantized parameter, gathered or over both ranks
    t = TrainingSpec(**FSDP1)
    quantized = [p.numel for p in SMALL.parameter_tensors() if is_quantized(p, t)]
    assert sum(quantized) == SMALL.num_layers * sum(numels)
    assert 2 * sum(fsdp_packed_bytes(n, t) for n in quantized) == sum(quantized)
    assert SMALL.num_layers * (st.layer_params_full - 2 * 256 * 2) == sum(quantized) // 2
    one = model_states(SMALL, TrainingSpec(precision="bf16", lora_rank=8, quantize="nf4-dq"))
    assert st.quantized < one.quantized and st.lora_params == one.lora_params
    plain = model_states(SMALL, TrainingSpec(**{**FSDP1, "quantize": None}))
    assert st.grads == plain.grads  # the frozen 4-bit codes get no gradient


def test_small_model_estimate():
    clear_cache()
    t = TrainingSpec(batch_size=2, seq_len=64, **FSDP1)
    plain_t = TrainingSpec(**{**FSDP1, "batch_size": 2, "seq_len": 64, "quantize": None})
    r = trainmem.estimate(SMALL, batch_size=2, seq_len=64, **FSDP1)
    plain = trainmem.estimate(SMALL, batch_size=2, seq_len=64, **{**FSDP1, "quantize": None})
    assert 0 < r.peak_allocated < plain.peak_allocated
    # the bytes saved at rest are those of the weights: a sharded bf16 layer against its sharded codes
    st, ps = model_states(SMALL, t), model_states(SMALL, plain_t)
    assert st.weights < ps.weights
    # the gathered layer unit holds the codes (numel / 2 bytes), not the bf16 weights (2 bytes each)
    assert st.layer_params_full < ps.layer_params_full / 3
    assert quantities(SMALL, t).fixed < quantities(SMALL, plain_t).fixed


@pytest.mark.parametrize("opts", [
    dict(tp=2, fsdp=None, fsdp_version=2),                        # tensor parallel
    dict(fsdp=None, fsdp_version=2, zero=3),                      # DeepSpeed ZeRO-3
    dict(fsdp_version=2),                                         # FSDP2
    dict(fsdp="hybrid"),                                          # HSDP
    dict(fsdp_lora_units="layer", lora_dtype="half"),             # adapters inside the layer's unit
    dict(precision="bf16-mp"),                                    # FSDP mixed precision casts the codes
    dict(quantize="nf4", quantize_via="torchao", extra={"framework": "torchtune"}, fsdp_version=2),
])
def test_shardings_not_modelled_are_refused_in_one_line(opts):
    with pytest.raises(TrainmemError) as e:
        TrainingSpec(**{**FSDP1, **opts})
    assert "\n" not in str(e.value) and "--quantize" in str(e.value)


def test_trace_and_measure_refuse_it():
    for what in ("trace", "measure"):
        with pytest.raises(TrainmemError, match="--quantize nf4-dq") as e:
            check_supported(TrainingSpec(**FSDP1), what)
        assert "\n" not in str(e.value)
