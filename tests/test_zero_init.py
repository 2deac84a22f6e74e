"""DeepSpeed ZeRO-3 with and without ``deepspeed.zero.Init`` (``--zero-init``): a model built whole is
moved to the GPU by ``deepspeed.initialize`` and partitioned there parameter by parameter, then
``defragment`` empties the cache (``TrainingSpec.ds_whole_load``, ``estimate.states.zero3_whole_load``).
The replay is checked against DeepSpeed's own engine traced on the fake group (``trace.deepspeed_engine``)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.errors import TrainmemError
from trainmem.estimate.reserved import _Replay, _replay_build
from trainmem.estimate.states import model_states
from trainmem.spec.resolve import resolve

MiB = 2 ** 20
# an untied Llama (the whole model is the embedding, two layers and the head), small enough to trace;
# dp 8 with SGD and small engine buffers, so that the whole model is the largest thing at load
UNTIED = dict(set=["num_hidden_layers=2", "hidden_size=512", "intermediate_size=1024", "num_attention_heads=8",
                   "num_key_value_heads=4", "head_dim=64", "vocab_size=32000"], seq_len=16, batch_size=1,
              zero=3, dp=8, precision="bf16", optimizer="sgd", reduce_bucket_size=100_000,
              stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
MODEL = "llama-3.1-8b"


def _load_phase(report):
    return next(p for p in report.phases if p.name == "model_loaded")


def _param_bytes(model, t):
    """Each parameter's bf16 bytes, in registration order (every layer)."""
    return [p.numel * 2 for p in model.parameter_tensors()]


def test_whole_model_then_one_partition_is_the_load_peak():
    """Off: the engine holds the whole bf16 model, and the first parameter's partition (the embedding's,
    ceil(numel / 8) elements) is made before the whole embedding is freed; every later partition
    replaces a larger whole tensor. On: the model is never whole on the GPU."""
    rs = resolve(MODEL, **UNTIED)
    whole = sum(block_bytes(b) for b in _param_bytes(rs.model, rs.training))
    first = rs.model.parameter_tensors()[0]
    assert first.role == "embedding"
    off = trainmem.estimate(MODEL, zero_init="off", **UNTIED)
    on = trainmem.estimate(MODEL, zero_init="on", **UNTIED)
    buffers = model_states(rs.model, rs.training).buffers
    assert _load_phase(off).peak == whole + block_bytes(-(-first.numel // 8) * 2) + buffers
    assert _load_phase(on).peak < whole
    assert _load_phase(on).allocated == _load_phase(off).allocated  # what stays is the same
    assert trainmem.estimate(MODEL, **UNTIED).peak_allocated == off.peak_allocated  # DeepSpeed's default: off


def test_estimate_replays_deepspeeds_conversion(one_torch_thread):
    """DeepSpeed 0.19.8's engine on the fake group (trace) against the estimate's replay of the same
    load: the allocated peak of ``model_loaded`` and the reserved peak before ``defragment`` empties
    the cache (the first partition, 4 MB, takes a fresh 20 MiB segment beside the whole model's)."""
    pytest.importorskip("deepspeed")
    from trainmem.trace import trace
    r = trace(MODEL, **UNTIED)
    end = r.extra["phase_events"][0][3]
    timeline = r.extra["timeline"][:end + 1]
    traced_alloc, traced_reserved = max(x[1] for x in timeline), max(x[2] for x in timeline)
    e = trainmem.estimate(MODEL, **UNTIED)
    assert _load_phase(e).peak == traced_alloc
    rs = resolve(MODEL, **UNTIED)
    replay = _Replay()
    _replay_build(replay, model_states(rs.model, rs.training).build)
    assert replay.peaks() == (traced_alloc, traced_reserved)
    assert replay.a.reserved < traced_reserved / 2  # empty_cache released the whole model's segments
    # after defragment the fp32 master is cloned from an fp32 copy of the flat partition
    # (quantities.deepspeed_fp32_convert) and the optimizer gathers each parameter whole in turn
    # (states.ds_init_gathers): the head's (the largest) takes a fresh segment; both stay cached, and
    # the load ends with the same reserved memory as DeepSpeed's engine
    end, traced_end = _load_phase(e), _load_phase(r).reserved
    assert end.reserved >= end.allocated + block_bytes(32000 * 512 * 2)
    assert end.reserved == traced_end


def test_llama31_8b_whole_load_on_eight_gpus():
    """Llama-3.1-8B in bf16 over 8 ranks (the ml-engineering rows): 14.96 GiB of weights, its embedding's
    partition on top (the allocated peak of the load), and the segments the allocator holds then."""
    kw = dict(seq_len=8192, batch_size=1, zero=3, dp=8, precision="bf16", offload_optimizer=True,
              recompute="full", zero_init="off")
    rs = resolve(MODEL, **kw)
    st = model_states(rs.model, rs.training)
    sizes = _param_bytes(rs.model, rs.training)
    assert sum(sizes) == 16_060_522_496
    peak = sum(block_bytes(b) for b in sizes) + block_bytes(-(-128256 * 4096 // 8) * 2) + st.buffers
    assert st.build_peak == peak
    replay = _Replay()
    _replay_build(replay, st.build)
    assert replay.peaks()[0] == peak
    assert 15.2 * 2 ** 30 < replay.peaks()[1] < 15.3 * 2 ** 30


@pytest.mark.parametrize("options,match", [
    ({"zero": 2, "zero_init": "off"}, "--zero-init configures DeepSpeed ZeRO-3: give --zero 3"),
    ({"zero": 3, "zero_init": "off", "remote_device": "cpu"}, "--remote-device cpu is deepspeed.zero.Init's"),
    ({"zero": 3, "zero_init": "maybe"}, "--zero-init 'maybe' is not one of: on, off"),
])
def test_zero_init_refusals(options, match):
    with pytest.raises(TrainmemError, match=match):
        trainmem.estimate("gpt2", dp=2, precision="bf16", **options)


def test_zero_init_without_zero_is_one_line_on_the_cli():
    p = subprocess.run([sys.executable, "-m", "trainmem", "estimate", "gpt2", "--zero-init", "off"],
                       capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "--zero-init" in p.stderr


def test_defaults_by_framework():
    """A hand-written loop: off (DeepSpeed's path for a model built outside zero.Init), on with
    --remote-device; the HF Trainer, TRL and Accelerate build under zero.Init with ZeRO-3."""
    base = dict(zero=3, dp=2, precision="bf16")
    assert not resolve("gpt2", **base).training.ds_zero_init
    assert not resolve("gpt2", framework="deepspeed", **base).training.ds_zero_init
    assert resolve("gpt2", remote_device="gpu", **base).training.ds_zero_init
    for fw in ("hf-trainer", "trl", "accelerate"):
        t = resolve("gpt2", framework=fw, **base).training
        assert t.ds_zero_init and not t.ds_whole_load, fw
        assert not resolve("gpt2", framework=fw, zero_init="off", **base).training.ds_zero_init
        assert resolve("gpt2", framework=fw, zero=2, dp=2, precision="bf16").training.zero_init is None


def test_trace_refuses_zero_init_on(monkeypatch):
    from trainmem.trace import deepspeed_engine, trace
    monkeypatch.setattr(deepspeed_engine, "available", lambda: True)
    with pytest.raises(TrainmemError, match="--zero-init on"):
        trace("gpt2", zero=3, dp=2, precision="bf16", zero_init="on", seq_len=16, batch_size=1)


def test_a_load_peak_not_asked_for_says_so_and_suggests_zero_init():
    """The peak at the whole-model load with --zero-init not given: one warning line names it, and the
    suggestions offer --zero-init on (its estimate: the load peak gone, the step's peak left)."""
    setup = dict(zero=3, dp=64, precision="bf16", gpu="h100", batch_size=1, seq_len=4096, recompute="full")
    r = trainmem.estimate("llama-3.1-70b", **setup)
    assert r.peak_phase.startswith("model_loaded")
    assert sum("--zero-init on" in w for w in r.warnings) == 1
    on = trainmem.estimate("llama-3.1-70b", zero_init="on", **setup)
    assert not any("--zero-init on" in w for w in on.warnings) and not on.peak_phase.startswith("model_loaded")
    off = trainmem.estimate("llama-3.1-70b", zero_init="off", **setup)  # asked for: no warning
    assert off.peak_allocated == r.peak_allocated and not any("--zero-init on" in w for w in off.warnings)
    from trainmem.plan.suggest import suggest
    s = next(x for x in suggest("llama-3.1-70b", **setup) if x.name == "zero-init")
    assert s.change == {"zero_init": "on"} and s.peak_allocated == on.peak_allocated < r.peak_allocated
