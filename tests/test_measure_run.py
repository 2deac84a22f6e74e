"""measure on the CPU, end to end: real training steps of tiny GPT-2, BERT (sequence
classification) and Llama configs, against ``trace(..., device="cpu")`` phase by phase; compare,
out of memory under a memory limit, the largest micro-batch, fixtures, the profiler trace, and the
CUDA bookkeeping (reserved, driver, context) with a probe that pretends to be a GPU."""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.cli import main  # noqa: E402
from campaign_probe import PretendGpu  # noqa: E402
from trainmem.measure.runner import fixture, measure  # noqa: E402
from trainmem.trace.api import trace  # noqa: E402

CONFIGS = {
    "gpt2": ("gpt2", ["n_layer=2", "n_embd=64", "n_head=4", "vocab_size=1000", "n_positions=128"]),
    "bert-seq-cls": ("bert-base-uncased", ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4",
                                           "intermediate_size=256", "vocab_size=1000",
                                           'architectures=["BertForSequenceClassification"]']),
    "llama": ("llama-3.2-1b", ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4",
                               "num_key_value_heads=2", "intermediate_size=256", "vocab_size=1000", "head_dim=16"]),
}
SETUP = dict(batch_size=2, seq_len=32, precision="fp32")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def trainmem_params(model, overrides):
    from trainmem.spec import TrainingSpec, resolve_model
    from trainmem.workload import hf_factory
    return hf_factory(resolve_model(model, overrides=overrides), TrainingSpec(**SETUP))().parameters()


def _args(name: str) -> list[str]:
    model, overrides = CONFIGS[name]
    out = [model]
    for o in overrides:
        out += ["--set", o]
    return out + ["--batch-size", "2", "--seq-len", "32", "--precision", "fp32", "--device", "cpu"]


def _cli(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", list(CONFIGS))
def test_measure_matches_cpu_trace_per_phase(name):
    model, overrides = CONFIGS[name]
    m = measure(model, device="cpu", overrides=overrides, **SETUP)
    t = trace(model, device="cpu", overrides=overrides, **SETUP)
    assert m.source == "measure" and m.peak_reserved is None and m.device_used is None
    assert [(p.name, p.step) for p in m.phases] == [(p.name, p.step) for p in t.phases]
    assert [p.name for p in m.phases[:5]] == ["model_loaded", "forward", "backward", "optimizer_step", "zero_grad"]
    for a, b in zip(m.phases, t.phases):
        for x, y in ((a.allocated, b.allocated), (a.peak, b.peak)):
            assert abs(x - y) <= 0.005 * y, (name, a, b)
    assert abs(m.peak_allocated - t.peak_allocated) <= 0.005 * t.peak_allocated
    assert m.peak_phase == t.peak_phase
    # the components add up to the peak; parameters and optimizer states are exact
    assert sum(c.bytes for c in m.components) == m.peak_allocated
    cats, tcats = m.by_category(), t.by_category()
    # named tensors are exact; the rest of the peak is what the tracer splits into activations,
    # logits and temporaries
    for cat in ("parameters", "buffers", "gradients", "optimizer_states", "inputs"):
        assert cats.get(cat, 0) == tcats.get(cat, 0), cat
    assert cats.get("activations", 0) == sum(tcats.get(c, 0) for c in ("activations", "logits", "temporaries"))
    n_tensors = len(list(trainmem_params(model, overrides)))
    # AdamW: two fp32 moments per parameter, and a 4-byte step counter per parameter tensor
    assert m.extra["optimizer_states_bytes"] == 2 * cats["parameters"] + 4 * n_tensors
    assert m.extra["oom"] is None and m.extra["environment"]["torch"] == torch.__version__


#: Phi-3's shape, cut down (transformers fuses its gate and up projections: ``--split-gate-up`` splits them)
PHI3 = ("phi-3-mini", ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=4",
                       "intermediate_size=256", "vocab_size=1000", "pad_token_id=0"])


@pytest.mark.parametrize("config, options", [
    (CONFIGS["llama"], {"fused_qkv": True}),
    (CONFIGS["llama"], {"attention_call": "repeat-kv"}),           # 2 key/value heads for 4 query heads
    (CONFIGS["llama"], {"fused_qkv": True, "attention_call": "repeat-kv", "precision": "bf16-amp"}),
    (PHI3, {"split_gate_up": True}),
    (CONFIGS["llama"], {"layer_rope_cache": 64}),  # torchtune's per-layer buffers, the same preparation
], ids=["fused-qkv", "repeat-kv", "fused-repeat-kv-amp", "split-gate-up", "layer-rope-cache"])
def test_measure_runs_litgpts_modules_and_call_as_cpu_trace_does(config, options):
    """litgpt's fused q/k/v and split gate/up linears (``workload.prepare_model``) and its SDPA call
    (``litgpt_modules.LitgptAttentionCall``): measure on the CPU builds and runs them as trace on the
    CPU does, byte for byte in every phase; each option changes what transformers' own model keeps
    (trace on the CPU ran transformers' modules and call, and no --layer-rope-cache buffers, before)."""
    model, overrides = config
    setup = {**SETUP, **options}
    m = measure(model, device="cpu", overrides=overrides, **setup)
    t = trace(model, device="cpu", overrides=overrides, **setup)
    assert [(p.name, p.step, p.allocated, p.peak) for p in m.phases] == \
        [(p.name, p.step, p.allocated, p.peak) for p in t.phases]
    assert m.peak_allocated == t.peak_allocated and m.peak_phase == t.peak_phase
    plain = {k: v for k, v in setup.items() if k not in ("fused_qkv", "attention_call", "split_gate_up",
                                                         "layer_rope_cache")}
    assert trace(model, device="cpu", overrides=overrides, **plain).peak_allocated != t.peak_allocated


def test_compare_cli_trace_vs_measure(capsys):
    code, out, _ = _cli(["compare"] + _args("bert-seq-cls") + ["--trace", "--measure", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["sources"] == ["estimate", "trace", "measure"] and d["reference"] == "measure"
    assert d["worst_phase_rel"]["trace"] < 0.005
    phases = [r for r in d["rows"] if r["kind"] == "phase"]
    assert len(phases) == 9 and all(abs(r["rel"]["trace"]) < 0.005 for r in phases)
    assert {"total", "category", "phase", "phase_peak"} <= {r["kind"] for r in d["rows"]}


def test_measure_cli_table_and_fixture(capsys, tmp_path):
    from trainmem.validate import load_fixtures, quantity, run
    fx_path = tmp_path / "measured" / "gpt2-tiny.json"
    fx_path.parent.mkdir()
    code, out, _ = _cli(["measure"] + _args("gpt2") + ["--save-fixture", str(fx_path)], capsys)
    assert code == 0
    assert "trainmem measure" in out and "phases in bytes" in out and "fixture written" in out
    fx = json.loads(fx_path.read_text())
    assert fx["device"] == "cpu" and fx["environment"]["torch"] == torch.__version__
    assert fx["command"].startswith("trainmem measure gpt2 --set n_layer=2") and "--device cpu" in fx["command"]
    assert fx["overrides"] == CONFIGS["gpt2"][1] and fx["setup"]["batch_size"] == 2
    # the format validate reads; its quantities give back the measured values
    (loaded,) = load_fixtures(str(tmp_path))
    rep = measure("gpt2", device="cpu", overrides=fx["overrides"], **SETUP)
    for item in loaded["measured"]:
        assert quantity(rep, item["quantity"]) == item["bytes"], item
    checks = run(str(tmp_path), ["estimate"])
    assert len(checks) == len(fx["measured"]) and all(c.predicted is not None for c in checks)


def test_out_of_memory_under_a_memory_limit(capsys):
    code, out, _ = _cli(["measure"] + _args("gpt2")[:-8] + ["--batch-size", "8", "--seq-len", "64", "--precision",
                        "fp32", "--device", "cpu", "--memory-limit", "8MiB", "--largest", "3"], capsys)
    assert code == 1
    assert "OUT OF MEMORY in forward@1" in out and "largest live tensors" in out
    assert "what would fit: micro-batch 2 at sequence 64" in out


def test_out_of_memory_report_and_find_max_batch():
    from trainmem.measure.runner import find_max_batch
    model, overrides = CONFIGS["gpt2"]
    r = measure(model, device="cpu", overrides=overrides, batch_size=4, seq_len=64, precision="fp32",
                memory_limit="8MiB", predict_on_oom=False)
    oom = r.extra["oom"]
    assert oom["phase"] == "forward@1" and oom["requested"] > 0 and r.fits is False
    assert oom["needed_at_least"] > 8 * 2**20 and r.device_used == oom["needed_at_least"]
    assert oom["largest"][0]["bytes"] >= oom["largest"][-1]["bytes"] > 0
    assert oom["by_kind"]["parameters"] == r.phases[0].allocated  # model_loaded holds only the model
    res = find_max_batch(model, device="cpu", overrides=overrides, seq_len=64, precision="fp32", memory_limit="8MiB")
    assert [t["batch_size"] for t in res["tries"]] == [1, 2, 4, 3]
    assert res["measured_max"] == 2 and res["first_failing"] == 3
    assert res["predicted_max"] == 2 and res["prediction"]["by"] == "trace"


def test_profile_writes_a_chrome_trace(tmp_path):
    model, overrides = CONFIGS["llama"]
    r = measure(model, steps=1, device="cpu", overrides=overrides, profile=str(tmp_path), **SETUP)
    (path,) = r.extra["files"]
    assert os.path.dirname(path) == str(tmp_path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "[memory]" for e in events)


# PretendGpu: a CPU probe that answers like a CUDA device (tests/campaign_probe.py, shared with the campaign)


def test_cuda_bookkeeping_with_a_pretend_gpu():
    model, overrides = CONFIGS["gpt2"]
    r = measure(model, device="cuda", overrides=overrides, probe=PretendGpu(), **SETUP)
    ctx = 300 * 2**20
    assert r.extra["cuda_context"] == ctx
    assert all(p.reserved is not None and p.reserved >= p.allocated for p in r.phases)
    assert r.peak_reserved >= r.peak_allocated and r.device_used == r.peak_reserved + ctx
    cats = r.by_category()
    assert cats["cuda_context"] == ctx and cats["allocator_overhead"] == r.peak_reserved - r.peak_allocated
    assert r.hardware.name == "Pretend GPU" and r.capacity == 2**30 and r.fits is True
    assert all(p["driver_used"] - p["reserved"] == ctx for p in r.extra["phases"])
    from trainmem.render.measure import measure_details
    text = measure_details(r, "auto")  # a small run: the driver's table in MiB
    assert "driver's view per phase (pretend" in text and "300.00 MiB" in text
    fx = fixture(r, command="trainmem measure ...")
    assert fx["device"] == "cuda" and any(q["quantity"] == "peak_reserved" for q in fx["measured"])
    # out of memory on the pretend GPU: needed = reserved + context + the refused allocation
    r = measure(model, device="cuda", overrides=overrides, probe=PretendGpu(limit=3 * 2**20), predict_on_oom=False,
                **SETUP)
    oom = r.extra["oom"]
    assert oom is not None and oom["needed_at_least"] == oom["reserved"] + ctx + oom["requested"]
