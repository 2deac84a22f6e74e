"""torchao NF4Tensor base weights (torchtune's QLoRA, ``quantize_via="torchao"``): the byte layout and
the dequantization peak against torchao's own code run on CPU (when torchao is importable) and
against numbers recorded from such runs, the published 512 x 512 figure of torchtune's QLoRA
tutorial, the estimate's wiring, and the refusals."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.errors import TrainmemError
from trainmem.estimate.quant4 import DEQUANT_SCRATCH, dequant_scratch, torchao_storage
from trainmem.estimate.states import model_states
from trainmem.spec import TrainingSpec
from trainmem.workload import check_supported

from test_qlora import LINEARS, SMALL

PARTS = ("nf4", "scaler_mean", "quantization_factor", "quantized_scalers", "quantized_data")

#: Recorded on CPU (torch 2.13.0+cpu) from ``to_nf4(torch.randn(shape, dtype=torch.bfloat16), 64, 256)``
#: and ``get_original_weight()`` under a dispatch mode counting live storages (``_Live`` below):
#: torchao 0.18.0 as installed (``torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py``), and
#: pytorch/ao ``torchao/dtypes/nf4tensor.py`` at tag v0.1 (the release torchtune 0.1.x pins) loaded
#: from source. Storage bytes of each inner tensor; the dequantization's peak live bytes and the
#: bytes of the weight it returns.
RECORDED = {
    ("0.18.0", (512, 512)): ({"quantized_data": 131072, "quantized_scalers": 4096, "quantization_factor": 32,
                              "scaler_mean": 2, "nf4": 32}, 3678208, 524288),
    ("0.18.0", (1024, 2816)): ({"quantized_data": 1441792, "quantized_scalers": 45056, "quantization_factor": 352,
                                "scaler_mean": 2, "nf4": 32}, 40460288, 5767168),
    ("0.1", (512, 512)): ({"quantized_data": 131072, "quantized_scalers": 4096, "quantization_factor": 8192,
                           "scaler_mean": 2, "nf4": 32}, 3678208, 524288),
    ("0.1", (1024, 2816)): ({"quantized_data": 1441792, "quantized_scalers": 45056, "quantization_factor": 90112,
                             "scaler_mean": 2, "nf4": 32}, 40460288, 5767168),
}


def _layout(numel: int, version: str) -> dict[str, int]:
    t = TrainingSpec(precision="bf16", lora_rank=8, quantize="nf4", quantize_via="torchao", torchao_version=version)
    return dict(zip(_order(t.torchao_release() < (0, 3)), torchao_storage(numel, t.torchao_release() < (0, 3))))


def _order(full_factor: bool) -> tuple[str, ...]:
    """torchao_storage's allocation order: the factor before the int8 scalers before torchao 0.3."""
    return PARTS if full_factor else ("nf4", "scaler_mean", "quantized_scalers", "quantization_factor",
                                      "quantized_data")


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_layout_matches_recorded_torchao_runs(key):
    version, shape = key
    parts, peak, weight = RECORDED[key]
    numel = shape[0] * shape[1]
    assert _layout(numel, version) == parts
    # get_original_weight: the bf16 weight and the scratch beside it, all alive before it returns
    assert numel * (2 + DEQUANT_SCRATCH) == peak and numel * 2 == weight


def test_tutorial_qlora_linear_bytes():
    """torchtune's QLoRA tutorial (docs/source/tutorials/qlora_finetune.rst at 0914d5cfb, torchao 0.1):
    ``LoRALinear(512, 512, rank=8, alpha=0.1, quantize_base=True)`` built on the GPU leaves
    ``torch.cuda.memory_allocated()`` at 177,152 bytes (the unquantized layer: 1,081,344). The
    adapters are fp32 (no default dtype set): 2 x 512 x 8 x 4 B; every tensor its own block."""
    adapters = 2 * block_bytes(512 * 8 * 4)
    nf4 = sum(block_bytes(b) for b in _layout(512 * 512, "0.1").values())
    assert nf4 + adapters == 177_152
    assert block_bytes(512 * 512 * 4) + adapters == 1_081_344


class _Live(TorchDispatchMode):
    """Bytes of the storages made by ops and still referenced; the peak after each op."""

    def __init__(self):
        super().__init__()
        self.refs, self.size, self.peak = {}, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if type(t) is torch.Tensor:
                key = t.untyped_storage().data_ptr()
                self.refs.setdefault(key, []).append(weakref.ref(t))
                self.size[key] = t.untyped_storage().nbytes()
        for key in [k for k, rs in self.refs.items() if all(r() is None for r in rs)]:
            del self.refs[key], self.size[key]
        self.peak = max(self.peak, sum(self.size.values()))
        return out


def test_layout_and_dequantization_of_installed_torchao():
    torchao = pytest.importorskip("torchao")
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:  # torchao < 0.17
        from torchao.dtypes.nf4tensor import to_nf4
    version = torchao.__version__.split("+")[0]
    for shape in ((512, 512), (1024, 2816)):
        w = torch.randn(shape, dtype=torch.bfloat16)
        q = to_nf4(w, 64, 256)
        got = {n: getattr(q, n).untyped_storage().nbytes() for n in PARTS}
        assert got == _layout(w.numel(), version)
        live = _Live()
        with live:
            weight = q.get_original_weight()
        assert live.peak == w.numel() * (2 + DEQUANT_SCRATCH)
        assert weight.dtype == torch.bfloat16 and weight.untyped_storage().nbytes() == w.numel() * 2


def _spec(**kw):
    return TrainingSpec(precision="bf16", lora_rank=8, quantize="nf4", quantize_via="torchao", **kw)


def test_model_states_count_the_torchao_layout():
    for version, full in (("0.1", True), (None, False)):
        st = model_states(SMALL, _spec(torchao_version=version))
        expected = SMALL.num_layers * sum(sum(block_bytes(b) for b in torchao_storage(o * i, full))
                                          for o, i in LINEARS)
        assert st.quantized == expected
    assert dequant_scratch(_spec()) == DEQUANT_SCRATCH and dequant_scratch(_spec(compile=True)) == 0
    assert dequant_scratch(TrainingSpec(precision="bf16", lora_rank=8, quantize="nf4")) == 0


def test_estimate_counts_the_dequantization_scratch():
    """The scratch (12.03 B per element of the largest layer weight, gate/up: 704 x 256) is a moment of
    its own in forward and backward: eager torchao peaks above the same run without it (compiled:
    the scratch is fused away), by no more than the scratch itself."""
    kw = dict(model=SMALL, batch_size=1, seq_len=64, precision="bf16", optimizer="adamw", lora_rank=8,
              quantize="nf4", quantize_via="torchao")
    eager = trainmem.estimate(**kw).peak_allocated
    fused = trainmem.estimate(**kw, compile=True).peak_allocated
    scratch = 704 * 256 * DEQUANT_SCRATCH
    assert 0 < eager - fused <= scratch + 512


def test_torchtune_preset_picks_torchao():
    from trainmem.spec.resolve import preset_training
    t = preset_training("torchtune", "0.1.0", {"lora_rank": 8, "quantize": "nf4"})
    assert t.quantize_via == "torchao" and t.torchao_version == "0.1"
    t = preset_training("torchtune", "0.6.1", {"lora_rank": 8, "quantize": "nf4"})
    assert t.quantize_via == "torchao" and t.torchao_version is None


@pytest.mark.parametrize("given, message", [
    (dict(quantize="fp4"), "torchao's NF4Tensor is NF4"),
    (dict(quantize="nf4-dq"), "torchao's NF4Tensor is NF4"),
    (dict(quantize="nf4", quantize_via="fabric"), "drop quantize_via"),
    (dict(quantize="bnb.nf4"), "names bitsandbytes"),
])
def test_torchtune_refuses_other_quantizers(given, message):
    from trainmem.spec.resolve import preset_training
    with pytest.raises(TrainmemError, match=message):
        preset_training("torchtune", None, {"lora_rank": 8, **given})


def test_refusals():
    from trainmem.spec.resolve import preset_training
    with pytest.raises(TrainmemError, match="--framework trl quantizes with bitsandbytes"):
        preset_training("trl", None, {"lora_rank": 8, "quantize": "nf4", "quantize_via": "torchao"})
    with pytest.raises(TrainmemError, match="torchao_version describes"):
        TrainingSpec(lora_rank=8, quantize="nf4", torchao_version="0.1")
    with pytest.raises(TrainmemError, match="give --precision bf16"):
        TrainingSpec(precision="bf16-amp", lora_rank=8, quantize="nf4", quantize_via="torchao")
    with pytest.raises(TrainmemError, match="trace does not run"):
        check_supported(_spec(), "trace")


#: Live bytes after each alloc/free event of torchao 0.1's ``to_nf4`` of a (256, 4096) bf16 weight and of
#: torchtune v0.1.0's NF4 ``clone`` (``to_nf4(weight.get_original_weight())``), recorded on CPU (torch
#: 2.13.0+cpu) by running pytorch/ao ``torchao/dtypes/nf4tensor.py`` at tag v0.1 from source under a
#: dispatch mode that logs each new storage and each storage's release (the weight given excluded).
TO_NF4_V01 = [32, 2097184, 2129952, 2261024, 163872, 32800, 32802, 65570, 32802, 65570, 65698, 66210, 33442, 32930,
              65698, 98466, 131234, 98466, 65698, 98466, 131234, 98466, 131234, 98466, 114850, 82082, 81954, 49186,
              2146338, 2179106, 2310178, 213026, 81954, 2179106, 35733538, 69287970, 35733538, 37830690, 46219298,
              12664866, 10567714, 14762018, 18956322, 14762018, 15286306, 15253538, 13156386, 4767778, 573474]
CLONE_V01 = [524288, 4718592, 4194304, 4718592, 8912896, 8388608, 9437184, 10485760, 10518528, 10551296, 10518528,
             11567104, 12615680, 11567104, 12615680, 13664256, 12615680, 14712832, 10518528, 6324224, 5275648, 4227072,
             4194304, 3145728, 2097152] + [2097152 + x for x in TO_NF4_V01] + [573474]


def _trajectory(events) -> list[int]:
    live, cur, out = {}, 0, []
    for ev in events:
        if ev[0] == "a":
            live[ev[1]] = ev[2]
            cur += ev[2]
        else:
            cur -= live.pop(ev[1])
        out.append(cur)
    return out


def test_v01_to_nf4_and_clone_events_match_the_recorded_source_run():
    from trainmem.estimate.quant4 import _Events
    e = _Events()
    e.to_nf4(256 * 4096)
    assert _trajectory(e.ev) == TO_NF4_V01
    e = _Events()
    w = e.original_weight(256 * 4096)
    e.to_nf4(256 * 4096)
    e.f(w)
    assert _trajectory(e.ev) == CLONE_V01


def test_torchtune_v01_build_reserves_the_published_init_figure():
    """torchtune's QLoRA tutorial (v0.1.0, torchao 0.1): Llama-2-7B QLoRA, 'Peak memory reserved, model
    init' 9.13 GB. The build and load replayed through the simulated caching allocator; the model
    it leaves is the estimate's weights."""
    from trainmem.allocator import CachingAllocator
    from trainmem.estimate.quant4 import torchtune_v01_build
    from trainmem.spec.config import resolve_model
    m = resolve_model("llama-2-7b")
    t = TrainingSpec(precision="bf16", lora_rank=8, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "up_proj", "down_proj"),
                     lora_dtype="half", quantize="nf4", quantize_via="torchao", torchao_version="0.1",
                     layer_rope_cache=4096)
    a, live, kept = CachingAllocator(), {}, {}
    for ev in torchtune_v01_build(m, t):
        if ev[0] == "a":
            live[ev[1]], kept[ev[1]] = a.allocate(ev[2]), block_bytes(ev[2])
        else:
            a.free(live.pop(ev[1]))
            del kept[ev[1]]
    assert abs(a.reserved / 9.13e9 - 1) < 0.005
    st = model_states(m, t)
    adapters = 32 * sum(block_bytes(8 * i * 2) + block_bytes(o * 8 * 2)
                        for o, i in [(4096, 4096)] * 4 + [(11008, 4096)] * 3)
    # the model the estimate loads, but transformers' two model-level rotary buffers (256 B each),
    # which torchtune's model has not (each layer keeps its own RoPE cache: layer_rope_cache)
    assert sum(block_bytes(b) for b in st.load) + adapters - sum(kept.values()) == 2 * 512
    assert st.build and st.build_temp > 0
    assert not model_states(m, TrainingSpec(precision="bf16", lora_rank=8, quantize="nf4",
                                            quantize_via="torchao")).build
