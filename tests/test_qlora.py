"""QLoRA: bitsandbytes 4-bit base weights (``--quantize``) in the estimate, refused by trace and
measure, and the published litgpt QLoRA runs scored by ``trainmem validate``."""
import copy
import os
import subprocess
import sys

import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate.moments import StepFlags, tokens, walk
from trainmem.estimate.quantities.build import clear_cache, quantities
from trainmem.estimate.states import model_states
from trainmem.spec import TrainingSpec
from trainmem.spec.config import resolve_model
from trainmem.validate import load_fixtures, validate
from trainmem.workload import check_supported

SMALL = resolve_model({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                       "intermediate_size": 704, "num_attention_heads": 8, "num_key_value_heads": 4,
                       "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 512,
                       "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"})
# (out, in) of each nn.Linear of one LlamaDecoderLayer: q, k, v, o, gate, up, down
LINEARS = [(256, 256), (128, 256), (128, 256), (256, 256), (704, 256), (704, 256), (256, 704)]
PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")


def _ceil512(n: int) -> int:
    return max(512, -(-n // 512) * 512)


def _bnb_layout(numel: int, double_quant: bool) -> int:
    """bitsandbytes' quantize_4bit, worked out by hand: two 4-bit codes per uint8, one fp32 absmax per
    64 elements (or a uint8 absmax per block + an fp32 one per 256 blocks + the fp32 offset), and the
    16-entry fp32 code table; each tensor its own 512-byte-rounded CUDA block."""
    blocks = -(-numel // 64)
    packed = _ceil512((numel + 1) // 2)
    table = _ceil512(16 * 4)
    if not double_quant:
        return packed + _ceil512(blocks * 4) + table
    return packed + _ceil512(4) + _ceil512(blocks) + _ceil512(-(-blocks // 256) * 4) + table


@pytest.mark.parametrize("mode", ["nf4", "fp4", "nf4-dq", "fp4-dq"])
def test_state_bytes_follow_the_bitsandbytes_layout(mode):
    st = model_states(SMALL, TrainingSpec(precision="bf16", lora_rank=8, quantize=mode))
    expected = SMALL.num_layers * sum(_bnb_layout(o * i, mode.endswith("-dq")) for o, i in LINEARS)
    assert st.quantized == expected
    # transformers keeps lm_head; Lightning Fabric (litgpt) quantizes it too
    fab = model_states(SMALL, TrainingSpec(precision="bf16", lora_rank=8, quantize=mode, quantize_via="fabric"))
    assert fab.quantized == expected + _bnb_layout(1000 * 256, mode.endswith("-dq"))
    plain = model_states(SMALL, TrainingSpec(precision="bf16", lora_rank=8))
    assert st.weights < plain.weights and st.lora_params == plain.lora_params and st.grads == plain.grads


def test_litgpt_spelling_and_none():
    assert TrainingSpec(lora_rank=8, quantize="bnb.nf4-dq").quantize == "nf4-dq"
    assert TrainingSpec(quantize="none").quantize is None


@pytest.mark.parametrize("opts", [dict(quantize="nf4"), dict(quantize="nf4", lora_rank=8, tp=2),
                                  dict(quantize="int3", lora_rank=8), dict(bitsandbytes_version="0.42.0"),
                                  dict(quantize="nf4", lora_rank=8, bitsandbytes_version="new")])
def test_refused_with_one_line(opts):
    with pytest.raises(TrainmemError) as e:
        TrainingSpec(**opts)
    assert "\n" not in str(e.value)


def test_full_finetuning_refused_at_the_cli():
    out = subprocess.run([sys.executable, "-m", "trainmem.cli", "estimate", "llama-3.2-1b", "--quantize", "nf4"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "--lora-rank" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_measure_refuses_quantize_and_trace_emulates_it():
    with pytest.raises(TrainmemError, match="--quantize nf4"):
        check_supported(TrainingSpec(lora_rank=8, quantize="nf4"), "measure")
    check_supported(TrainingSpec(lora_rank=8), "measure")  # LoRA alone still runs
    check_supported(TrainingSpec(lora_rank=8, quantize="nf4"), "trace")  # trainmem.bnb emulates Linear4bit


def test_trace_on_the_cpu_refuses_before_running():
    pytest.importorskip("transformers")
    from trainmem.trace import trace
    with pytest.raises(TrainmemError, match="--device cpu"):
        trace(SMALL, device="cpu", seq_len=32, lora_rank=8, quantize="nf4")


@pytest.mark.parametrize("via", ["transformers", "fabric"])
def test_forward_peak_holds_the_largest_dequantized_weight(via):
    clear_cache()
    # a large MLP and a short sequence, so that the dequantized weight is not hidden by the logits
    m = resolve_model(SMALL, ["intermediate_size=8192", "hidden_size=1024", "num_attention_heads=16"])
    t = TrainingSpec(batch_size=1, seq_len=16, precision="bf16", lora_rank=8, quantize="nf4", quantize_via=via,
                     hold_output="loss")
    q = quantities(m, t)
    without = copy.copy(q)
    without.fwd_temp, without.fwd_temp_tok, without.head_temp = 0, 0.0, 0
    largest = 8192 * 1024 * 2  # gate/up/down dequantized to bf16 (transformers: no cast)
    if via == "fabric":
        largest *= 2           # fp16 quant state, then the bf16 copy for the matmul
    flags = StepFlags.of(m, t)
    n = t.seq_len
    tk = tokens(q, flags, n, n * n, 1, 1)
    tk0 = tokens(without, flags, n, n * n, 1, 1)
    fwd = max(q.fixed + sum(mo.parts) for mo in walk(q, flags, tk, 1)[0] if mo.phase == "forward" and mo.valid)
    fwd0 = max(without.fixed + sum(mo.parts) for mo in walk(without, flags, tk0, 1)[0]
               if mo.phase == "forward" and mo.valid)
    assert fwd - fwd0 >= largest - 2 * n * 1024 * 2  # at least the weight, less what it displaces
    r = trainmem.estimate(m, **{k: getattr(t, k) for k in ("batch_size", "seq_len", "precision", "lora_rank",
                                                           "quantize", "quantize_via", "hold_output")})
    assert max(p.peak for p in r.phases if p.name.startswith("forward")) == fwd
    clear_cache()


def test_backward_transient_holds_the_dequantized_weight():
    t = TrainingSpec(batch_size=1, seq_len=16, precision="bf16", lora_rank=8)
    plain = quantities(SMALL, t)
    quant = quantities(SMALL, TrainingSpec(batch_size=1, seq_len=16, precision="bf16", lora_rank=8, quantize="nf4"))
    # each linear's backward: its transient grows by exactly its dequantized bf16 weight
    grown = sorted(round(qt[2] - pt[2]) for qt, pt in zip(quant.transients, plain.transients) if qt[2] != pt[2])
    assert grown == sorted(o * i * 2 for o, i in LINEARS)


def test_old_bitsandbytes_saves_the_linear_inputs():
    """bitsandbytes < 0.43.2 MatMul4Bit.forward kept ``ctx.tensors = (A, B)``: every 4-bit linear saves
    its input (shared by q/k/v and by gate/up), so a layer saves more than with a current release."""
    base = dict(batch_size=1, seq_len=64, precision="bf16", lora_rank=8, quantize="nf4")
    new = quantities(SMALL, TrainingSpec(**base))
    old = quantities(SMALL, TrainingSpec(**base, bitsandbytes_version="0.42.0"))
    # attention input, o_proj's input (the SDPA output's storage, already saved), MLP input, down's input
    assert old.saved_tok - new.saved_tok == (256 + 256 + 704) * 2


def test_published_qlora_fixtures_are_scored():
    names = [fx for fx in load_fixtures(PUBLISHED) if fx["setup"].get("quantize")]
    assert len(names) >= 8
    for fx in names:  # (torchtune's QLoRA is torchao's NF4Tensor: tests/test_quant4_torchao.py)
        torchao = fx["setup"].get("quantize_via") == "torchao" or fx["setup"].get("framework") == "torchtune"
        assert ("torchao" if torchao else "bitsandbytes") in fx["setup_note"] and fx["setup"].get("lora_rank")
    v = validate(PUBLISHED, ["estimate"], cases=["QLoRA"])
    primary = [c for c in v.checks if c.primary]
    assert len(primary) == len(names)
    assert all(c.predicted and c.measured and c.error is not None for c in primary)
