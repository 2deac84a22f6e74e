"""The ``--json`` / ``MemoryReport.to_dict()`` contract that scripts and CI jobs rely on (DESIGN.md).

* ``--json`` prints exactly one JSON object with ``source``, ``peak_allocated`` (int),
  ``peak_reserved`` (int or null), ``device_used`` (int or null: reserved + CUDA context),
  ``components`` ([{name, category, bytes}]), ``phases`` ([{name, step, allocated, peak, reserved}])
  and ``fits`` (bool, or null without a GPU);
* ``trainmem.estimate(model, **options)`` with the flags' snake_case names gives the same object;
* ``to_dict()`` survives ``json.dumps``/``json.loads`` unchanged;
* every component's category is one of ``report.CATEGORIES``;
* text output is labelled in the unit system asked for (GiB by default, GB on request).
"""
from __future__ import annotations

import json

import pytest

import trainmem
from trainmem.cli import main
from trainmem.estimate.methods import METHODS
from trainmem.report import CATEGORIES, PHASE_NAMES
from trainmem.spec import get_gpu
from trainmem.units import GB, GiB

# API options (snake_case) -> the same setup as CLI flags. Each is a distinct kind of setup.
SETUPS = [
    pytest.param("gpt2", dict(seq_len=1024), id="gpt2-defaults"),
    pytest.param("llama-3.1-8b", dict(gpu="h100"), id="llama-h100"),
    pytest.param("llama-3.1-8b", dict(batch_size=2, seq_len=4096, precision="bf16", optimizer="adamw-8bit",
                                      zero=2, dp=8, tp=2, pp=2, recompute="selective", attention="flash",
                                      gpu="a100-80gb", max_fraction=0.9, context_memory="1GiB"),
                 id="llama-parallel-a100"),
    pytest.param("mixtral-8x7b", dict(seq_len=1024, tp=8, pp=4, dp=2, zero=1, recompute="full",
                                      grad_accum=4, gpu="h200"), id="mixtral-moe"),
    pytest.param("qwen2.5-0.5b", dict(seq_len=512, batch_size=4, lora_rank=16, lora_targets="q_proj,v_proj",
                                      optimizer="adamw", optimizer_impl="fused", gpu_memory="24GiB"),
                 id="qwen-lora-custom-gpu"),
    pytest.param("bert-base-uncased", dict(seq_len=128, batch_size=32, precision="fp32", attention="eager",
                                           optimizer="sgd-momentum", optimizer_in_backward=True,
                                           set=["num_hidden_layers=6"], gpu="a10g"), id="bert-fp32-oib-set"),
    pytest.param("nanogpt-124m", dict(seq_len=1024, batch_size=12, compile=True, dropout=False,
                                      fsdp="full", dp=4), id="nanogpt-fsdp-compile"),
    pytest.param("gpt2-medium", dict(seq_len=1024, method="korthikanti", tp=4, sequence_parallel=True,
                                     gpu="v100-32gb"), id="seed-method-korthikanti"),
]

BOOL_FLAGS = {"sequence_parallel", "compile", "optimizer_in_backward", "offload_optimizer",
              "distributed_optimizer"}


def cli_args(model: str, options: dict) -> list[str]:
    """The CLI arguments that say what ``options`` say to the Python API."""
    argv = ["estimate", model]
    for key, value in options.items():
        if key == "dropout":
            if not value:
                argv.append("--no-dropout")
        elif key == "set":
            for item in value:
                argv += ["--set", item]
        elif key in BOOL_FLAGS:
            if value:
                argv.append("--" + key.replace("_", "-"))
        else:
            argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def cli_json(capsys, model: str, options: dict) -> tuple[int, str, dict]:
    try:
        code = main(cli_args(model, options) + ["--json"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert err == "", err
    return code, out, json.loads(out)  # the whole of stdout is one JSON document


def check_contract(d: dict, with_gpu: bool) -> None:
    assert isinstance(d, dict)
    assert d["source"] == "estimate"
    assert type(d["peak_allocated"]) is int and d["peak_allocated"] > 0
    for key in ("peak_reserved", "device_used"):
        assert d[key] is None or type(d[key]) is int
    assert d["fits"] is None or type(d["fits"]) is bool
    if with_gpu:
        assert type(d["peak_reserved"]) is int and d["peak_reserved"] >= d["peak_allocated"]
        assert type(d["device_used"]) is int and type(d["fits"]) is bool
        assert d["device_used"] > d["peak_reserved"]  # reserved + CUDA context
        assert d["fits"] == (d["margin"] >= 0)
    else:
        assert d["fits"] is None and d["device_used"] is None
        if d["method"] == "trainmem":  # reserved from the replayed step; the published methods have none
            assert type(d["peak_reserved"]) is int and d["peak_reserved"] >= d["peak_allocated"]
    assert isinstance(d["components"], list) and d["components"]
    for c in d["components"]:
        assert {"name", "category", "bytes"} <= set(c)
        assert isinstance(c["name"], str) and c["name"]
        assert c["category"] in CATEGORIES
        assert type(c["bytes"]) is int
    assert isinstance(d["phases"], list) and d["phases"]
    for p in d["phases"]:
        assert {"name", "step", "allocated", "peak", "reserved"} <= set(p)
        assert isinstance(p["name"], str) and type(p["step"]) is int and p["step"] >= 0
        assert type(p["allocated"]) is int and type(p["peak"]) is int
        assert p["reserved"] is None or type(p["reserved"]) is int


@pytest.mark.parametrize("model, options", SETUPS)
def test_cli_json_is_one_object_with_the_contract(capsys, model, options):
    code, out, d = cli_json(capsys, model, options)
    with_gpu = "gpu" in options or "gpu_memory" in options
    assert code == (1 if d["fits"] is False else 0)  # one exit rule: 1 only when a GPU is given and it does not fit
    check_contract(d, with_gpu)
    assert json.loads(out.strip()) == d and out.strip().startswith("{") and out.strip().endswith("}")


@pytest.mark.parametrize("model, options", SETUPS)
def test_python_api_equals_cli_json(capsys, model, options):
    _, _, from_cli = cli_json(capsys, model, options)
    report = trainmem.estimate(model, **options)
    assert isinstance(report, trainmem.MemoryReport)
    suggestions = from_cli.pop("suggestions", [])  # estimate --gpu --json adds what would make it fit
    assert isinstance(suggestions, list) and (suggestions == [] or report.fits is False)
    assert report.to_dict() == from_cli


@pytest.mark.parametrize("model, options", SETUPS)
def test_to_dict_round_trips_through_json(model, options):
    d = trainmem.estimate(model, **options).to_dict()
    assert json.loads(json.dumps(d)) == d  # only JSON types: no tuples, sets, NaN, numpy ints
    json.dumps(d, allow_nan=False)


def test_device_used_is_reserved_plus_cuda_context():
    for gpu, ctx in (("h100", None), ("a100-80gb", "2GiB")):
        r = trainmem.estimate("llama-3.2-1b", seq_len=1024, gpu=gpu, context_memory=ctx)
        context = get_gpu(gpu, context=ctx).context
        assert r.device_used == r.peak_reserved + context
        assert r.to_dict()["device_used"] == r.device_used
        # and the report lists the context as a component of that category
        assert sum(c.bytes for c in r.components if c.category == "cuda_context") == context


def test_without_gpu_fits_and_device_memory_are_null():
    d = trainmem.estimate("gpt2", seq_len=256).to_dict()
    assert d["fits"] is None and d["device_used"] is None and d["capacity"] is None
    # reserved memory needs no GPU: the step replayed through the caching allocator (estimate/reserved/)
    assert d["peak_reserved"] >= d["peak_allocated"]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_keeps_the_contract(method):
    """Every formula set returns the same shape of report (components in known categories)."""
    done = 0
    for model in ("gpt2", "bert-base-uncased", "llama-3.2-1b"):
        for gpu in (None, "h100"):
            try:
                r = trainmem.estimate(model, method=method, seq_len=512, gpu=gpu)
            except trainmem.TrainmemError:
                continue  # a method may not cover a family; saying so is its right
            d = r.to_dict()
            check_contract(d, gpu is not None)
            assert d["method"] == method
            assert json.loads(json.dumps(d)) == d
            done += 1
    assert done >= 2, f"method {method} estimated nothing"


def test_phase_names_are_known():
    r = trainmem.estimate("llama-3.2-1b", seq_len=1024, grad_accum=3)
    for p in r.phases:
        assert p.name.split(".")[0] in PHASE_NAMES, p.name


def test_fields_are_never_removed():
    """Extra fields are welcome, these names are the promise."""
    d = trainmem.estimate("gpt2", seq_len=128, gpu="l4").to_dict()
    assert {"source", "peak_allocated", "peak_reserved", "device_used", "components", "phases",
            "fits"} <= set(d)


# ----- units -----------------------------------------------------------------------------------
def _table(capsys, *extra: str) -> str:
    assert main(["estimate", "llama-3.2-1b", "--seq-len", "1024", "--gpu", "h100", *extra]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def test_units_default_binary_and_labelled(capsys):
    out = _table(capsys)
    r = trainmem.estimate("llama-3.2-1b", seq_len=1024, gpu="h100")
    assert "GiB" in out and " GB" not in out
    assert f"{r.peak_allocated / GiB:,.2f} GiB" in out
    assert f"{r.device_used / GiB:,.2f} GiB" in out
    assert "(values in GiB)" in out


def test_units_gb_on_request_and_labelled(capsys):
    out = _table(capsys, "--units", "GB")
    r = trainmem.estimate("llama-3.2-1b", seq_len=1024, gpu="h100")
    assert "GiB" not in out
    assert f"{r.peak_allocated / GB:,.2f} GB" in out
    assert f"{r.capacity / GB:,.2f} GB" in out
    assert "(values in GB)" in out
    # the two renderings differ by the unit, not by the bytes: the JSON is unit-free
    assert r.peak_allocated / GB != pytest.approx(r.peak_allocated / GiB)


def test_json_is_unit_free(capsys):
    outs = []
    for units in ("GiB", "GB"):
        assert main(["estimate", "gpt2", "--seq-len", "256", "--json", "--units", units]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]
