"""bitsandbytes emulated in trace (trainmem/bnb.py): the state tensors of its 8-bit and paged
optimizers and the storage of its 4-bit linears equal bitsandbytes' own formulas (written here from
its source, not from trainmem's estimate), paged states stay off the device, and trace agrees
with the estimate on small Llama models."""
import pytest
import torch

from trainmem import estimate
from trainmem.bnb import Adam2State, Linear4bit, quantize_linears
from trainmem.trace.api import trace

SMALL = ["num_hidden_layers=2", "hidden_size=512", "num_attention_heads=8", "num_key_value_heads=4",
         "intermediate_size=1376", "vocab_size=8000", "head_dim=64", "tie_word_embeddings=false"]
BASE = {"batch_size": 2, "seq_len": 128, "precision": "bf16-amp"}


def _states(numel, blocksize, optim_bits=8, paged=False):
    """Run one step of the emulated optimizer on a meta parameter; its state dict."""
    p = torch.nn.Parameter(torch.empty(numel, device="meta"))
    p.grad = torch.empty(numel, device="meta")
    opt = Adam2State([p], optim_bits=optim_bits, is_paged=paged, blocksize=blocksize)
    opt.step()
    return opt.state[p]


@pytest.mark.parametrize("numel", [4095, 4096, 70_000, 1_000_001])
@pytest.mark.parametrize("blocksize", [256, 2048])
def test_8bit_state_tensors_follow_init_state(numel, blocksize):
    # bitsandbytes optim/optimizer.py Optimizer2State.init_state: fp32 states under min_8bit_size
    # (4096), else uint8 states of p's shape and fp32 absmax of ceil(n / blocksize)
    st = _states(numel, blocksize)
    if numel < 4096:
        assert {k for k, v in st.items() if torch.is_tensor(v)} == {"state1", "state2"}
        assert st["state1"].dtype == st["state2"].dtype == torch.float32
        assert st["state1"].numel() == numel
        return
    assert st["state1"].dtype == st["state2"].dtype == torch.uint8
    assert st["state1"].shape == st["state2"].shape == (numel,)
    blocks = numel // blocksize + (1 if numel % blocksize else 0)
    for k in ("absmax1", "absmax2"):
        assert st[k].dtype == torch.float32 and st[k].shape == (blocks,)
    assert st["qmap1"].shape == st["qmap2"].shape == (256,) and st["qmap1"].dtype == torch.float32


def test_qmaps_are_shared_by_the_parameters():
    ps = [torch.nn.Parameter(torch.empty(8192, device="meta")) for _ in range(3)]
    for p in ps:
        p.grad = torch.empty(8192, device="meta")
    opt = Adam2State(ps)
    opt.step()
    assert len({id(opt.state[p]["qmap1"]) for p in ps}) == 1


def test_paged_states_are_marked_and_small_ones_are_not():
    big, small = _states(200_000, 256, paged=True), _states(50_000, 256, paged=True)
    assert getattr(big["state1"], "is_paged", False) and getattr(big["state2"], "is_paged", False)
    assert not getattr(big["absmax1"], "is_paged", False)   # absmax is an ordinary device tensor
    assert not getattr(small["state1"], "is_paged", False)  # under 1e5 elements: zeros_like


def _optimizer_state_bytes(report):
    return sum(c.bytes for c in report.components if c.category == "optimizer_states")


def test_paged_states_are_absent_from_device_memory():
    # a bigger vocabulary: the embedding and head pass bitsandbytes' 1e5-element paging threshold
    full = trace("llama-3.2-1b", set=SMALL, optimizer="adamw-8bit", **BASE)
    paged = trace("llama-3.2-1b", set=SMALL, optimizer="paged-adamw-8bit", **BASE)
    gone = sum(p.numel for p in full.model.parameter_tensors() if p.numel >= 100_000)  # two uint8 states each
    assert _optimizer_state_bytes(full) - _optimizer_state_bytes(paged) >= 2 * gone * 0.99
    p32 = trace("llama-3.2-1b", set=SMALL, optimizer="paged-adamw", **BASE)
    small = sum(p.numel for p in full.model.parameter_tensors() if p.numel < 100_000)
    assert _optimizer_state_bytes(p32) < 2 * 4 * small * 1.1  # only the unpaged fp32 states


@pytest.mark.parametrize("quant", ["nf4", "nf4-dq"])
def test_4bit_storage_per_linear_is_the_packed_formula(quant):
    lin = torch.nn.Linear(1000, 700, bias=False, device="meta")
    model = torch.nn.Sequential(lin, torch.nn.Linear(700, 10, device="meta"))
    quantize_linears(model, quant, "fabric", "bf16", False, True)
    q = model[0]
    assert isinstance(q, Linear4bit)
    n = 1000 * 700
    blocks = -(-n // 64)  # quantize_4bit blocksize 64
    assert q.weight.dtype == torch.uint8 and q.weight.numel() == (n + 1) // 2
    assert q.code.numel() == 16 and q.code.dtype == torch.float32
    if quant == "nf4":
        assert q.absmax.dtype == torch.float32 and q.absmax.numel() == blocks
    else:  # double quantization: uint8 absmax, fp32 per 256 blocks, fp32 offset
        assert q.absmax.dtype == torch.uint8 and q.absmax.numel() == blocks
        assert q.absmax2.dtype == torch.float32 and q.absmax2.numel() == -(-blocks // 256)
        assert q.offset.numel() == 1
    assert q.quant_state.dtype == torch.float16  # Fabric quantizes an fp16 copy
    assert not any(p.requires_grad for p in q.parameters())



class _SubLinear(torch.nn.Linear):
    """A subclass of nn.Linear, as transformers' FalconLinear is."""


@pytest.mark.parametrize("via,replaced", [("fabric", True), ("transformers", False)])
def test_linear_subclasses_follow_each_converter(via, replaced):
    """Fabric's _convert_layers replaces every isinstance(child, nn.Linear) (a FalconLinear too);
    transformers 5.x's replace_with_bnb_linear only type(module) is nn.Linear. A Linear4bit already
    there is not quantized again."""
    model = torch.nn.Sequential(_SubLinear(64, 128, device="meta"), torch.nn.Linear(128, 64, device="meta"),
                                torch.nn.Linear(64, 8, device="meta"))
    quantize_linears(model, "nf4", via, "bf16", False, True)
    assert isinstance(model[0], Linear4bit) is replaced
    assert isinstance(model[1], Linear4bit)  # a plain linear, not the last module: both convert it
    first = model[1]
    quantize_linears(model, "nf4", via, "bf16", False, True)
    assert model[1] is first

def _agree(**options):
    kw = {**BASE, **options}
    t = trace("llama-3.2-1b", set=SMALL, **kw)
    e = estimate("llama-3.2-1b", set=SMALL, **kw)
    return t.peak_allocated, e.peak_allocated


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {"optimizer": "adamw-8bit"}, {"optimizer": "adamw-8bit", "bitsandbytes_version": "0.42.0"},
    {"optimizer": "paged-adamw-8bit"}, {"optimizer": "paged-adamw"}, {"optimizer": "lion"},
], ids=str)
def test_estimate_agrees_with_trace_on_bnb_optimizers(options):
    t, e = _agree(**options)
    assert abs(e / t - 1) < 0.005, (t, e)


FABRIC = {"quantize_via": "fabric", "precision": "bf16", "lora_dtype": "half"}


#: estimate vs trace under Fabric with bitsandbytes 0.42 (graph-kept 4-bit inputs), measured -2.2%
OLD_BNB_GAP = pytest.mark.xfail(strict=True, reason="estimate about -2% since the LoRA first-layer and frozen final-norm rules (bench_agreement fixes) met bitsandbytes 0.42's graph-kept inputs under Fabric; to be diagnosed")

QSMALL = ["num_hidden_layers=3", "hidden_size=512", "num_attention_heads=8", "num_key_value_heads=4",
          "intermediate_size=1376", "vocab_size=2000", "head_dim=64", "tie_word_embeddings=false"]


@pytest.mark.slow
@pytest.mark.parametrize("options, tolerance", [
    # bitsandbytes 0.42 (MatMul4Bit keeps its inputs on the graph) under Fabric: the mechanisms alone
    pytest.param({"quantize": "nf4", **FABRIC, "bitsandbytes_version": "0.42.0", "hold_output": "step",
                  "grad_accum": 2}, 0.005, marks=OLD_BNB_GAP),
    pytest.param({"quantize": "nf4-dq", **FABRIC, "bitsandbytes_version": "0.42.0", "hold_output": "backward",
                  "grad_accum": 2}, 0.005, marks=OLD_BNB_GAP),
    # the rest differ by a few MB of tensors outside bitsandbytes on this 3-layer model: the first
    # layer's input norm saves nothing when the frozen embedding's output needs no gradient, which
    # the estimate counts (a LoRA rule, ~1 % of this model's peak, 0.02 % of a 7B model's)
    ({"quantize": "nf4", **FABRIC}, 0.025),
    ({"quantize": "nf4"}, 0.025),  # transformers + prepare_model_for_kbit_training: fp32 linear outputs
    ({"quantize": "fp4-dq", "bitsandbytes_version": "0.42.0", "hold_output": "step"}, 0.025),
    ({"quantize": "nf4", "recompute": "full", "bitsandbytes_version": "0.42.0"}, 0.025),
], ids=str)
def test_estimate_agrees_with_trace_on_qlora(options, tolerance):
    kw = {**BASE, "seq_len": 512, "lora_rank": 8, **options}
    t = trace("llama-3.2-1b", set=QSMALL, **kw).peak_allocated
    e = estimate("llama-3.2-1b", set=QSMALL, **kw).peak_allocated
    assert abs(e / t - 1) < tolerance, (t, e)


def test_old_bitsandbytes_keeps_the_inputs_until_the_next_forward():
    """bitsandbytes < 0.43.2: ``ctx.tensors = (A, B)`` outlives backward; with the loop holding its
    loss the previous micro-batch's inputs are alive at the next forward's end, in trace and in
    the estimate alike."""
    kw = {**BASE, "seq_len": 512, "lora_rank": 8, "quantize": "nf4", **FABRIC, "hold_output": "step", "grad_accum": 2}
    new = trace("llama-3.2-1b", set=QSMALL, **kw).peak_allocated
    old = trace("llama-3.2-1b", set=QSMALL, bitsandbytes_version="0.42.0", **kw)
    e = estimate("llama-3.2-1b", set=QSMALL, bitsandbytes_version="0.42.0", **kw)
    held = e.component("activations.bnb_matmul4bit_inputs")
    assert held > 0 and old.peak_allocated - new > held  # the previous graph's inputs + this one's


@pytest.mark.xfail(strict=True, reason="estimate -2.2% (3 MB on this 3-layer model) since the LoRA first-layer and "
                   "frozen final-norm rules (bench_agreement fixes) met bitsandbytes 0.42's graph-kept inputs under "
                   "Fabric: which of them the first layer's frozen 4-bit linears keep is to be diagnosed")
def test_old_bitsandbytes_estimate_agrees_with_trace():
    kw = {**BASE, "seq_len": 512, "lora_rank": 8, "quantize": "nf4", **FABRIC, "hold_output": "step", "grad_accum": 2}
    old = trace("llama-3.2-1b", set=QSMALL, bitsandbytes_version="0.42.0", **kw)
    e = estimate("llama-3.2-1b", set=QSMALL, bitsandbytes_version="0.42.0", **kw)
    assert abs(e.peak_allocated / old.peak_allocated - 1) < 0.005


def test_quantized_base_weights_are_the_packed_bytes():
    # the loaded model: the 4-bit linears' packed codes + quant state instead of their fp32 weights
    lora = trace("llama-3.2-1b", set=SMALL, lora_rank=8, **BASE)
    q = trace("llama-3.2-1b", set=SMALL, lora_rank=8, quantize="nf4", **BASE)
    linears = [p.numel for p in lora.model.parameter_tensors() if p.role == "linear" and p.layer is not None]
    saved = sum(4 * n - ((n + 1) // 2 + 4 * -(-n // 64) + 64) for n in linears)
    diff = lora.phases[0].allocated - q.phases[0].allocated
    assert abs(diff - saved) < 512 * 4 * len(linears)  # the caching allocator's 512-byte rounding


def test_chunked_4bit_head_holds_the_earlier_chunks_outputs():
    """litgpt's QLoRA step (Lightning Fabric quantizes ``lm_head`` too; ``lm_head_chunk_size=128``
    runs it once per chunk): the last chunk's dequantized weight and its cast coexist with the first
    three chunks' bf16 outputs. On the published Llama-3.2-1B row's setup that forward moment is
    the peak, in the estimate and in trace alike (trace 5122.6 MiB; the estimate 5126.6 MiB, and 4938.7
    MiB, -3.6 %, before it counted the chunks)."""
    kw = dict(batch_size=2, seq_len=512, precision="bf16", optimizer="paged-adamw", lora_rank=32,
              lora_targets="q_proj,v_proj", grad_accum=4, loss="half", hold_output="step", lora_dropout=0.05,
              lora_dtype="half", quantize="nf4", quantize_via="fabric", bitsandbytes_version="0.42.0", loss_chunks=4,
              cast_output=True, set=["tie_word_embeddings=false", "use_cache=false"])
    t = trace("llama-3.2-1b", **kw)
    e = estimate("llama-3.2-1b", **kw)
    assert "lm_head" in t.peak_where and "backward" not in t.peak_where.lower()
    assert e.peak_where == "lm_head"
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.005)
