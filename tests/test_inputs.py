"""Inputs a user can trust (issue 14): ``--set`` keys and values, GPU names, sizes, hub ids.

Each case here was silently wrong before: ``--set num_hidden_layers=2`` left GPT-2 at 12 layers,
``--set foo=bar`` was ignored, ``--gpu a100`` meant the 80 GB card, ``--gpu-memory 40`` meant
40 bytes, ``1e400GiB`` was a traceback, a hub model in the local cache needed HF_HUB_OFFLINE=1.
No GPU and no network: NVML is a fake module, the hub cache a folder in tmp_path.
"""
from __future__ import annotations

import json
import re
import socket
import sys
import types

import pytest

import trainmem
from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.spec import config as config_mod
from trainmem.spec.config import config_schema, resolve_model
from trainmem.spec.hardware import catalogue, get_gpu, gpu_aliases, match_gpu
from trainmem.units import GiB, MiB, parse_bytes


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code: int, err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("trainmem: warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("trainmem: error:"), (code, err)
    assert "Traceback" not in err
    return lines[0]


# ----- --set ---------------------------------------------------------------------------------
def test_set_standard_name_reaches_gpt2_attribute_map():
    two = resolve_model("gpt2", ["num_hidden_layers=2"])
    assert two.num_layers == 2 and two.config["n_layer"] == 2
    assert two.num_params == resolve_model("gpt2", ["n_layer=2"]).num_params < resolve_model("gpt2").num_params
    # the mapping names of attribute_map, all of them
    spec = resolve_model("gpt2", ["hidden_size=512", "num_attention_heads=8", "max_position_embeddings=512"])
    assert (spec.hidden_size, spec.num_heads, spec.max_positions) == (512, 8, 512)


def test_set_standard_name_in_the_cli(capsys):
    code, out, _ = run(capsys, "estimate", "gpt2", "--seq-len", "256", "--set", "num_hidden_layers=2", "--json")
    assert code == 0
    code, out12, _ = run(capsys, "estimate", "gpt2", "--seq-len", "256", "--json")
    assert json.loads(out)["peak_allocated"] < json.loads(out12)["peak_allocated"]


def test_set_mixtral_num_experts_is_num_local_experts():
    assert resolve_model("mixtral-8x7b", ["num_experts=4"]).num_experts == 4
    assert resolve_model("mixtral-8x7b").num_experts == 8


@pytest.mark.parametrize("item, named", [("foo=bar", "nearest known field is"),
                                         ("num_hidden_layer=2", "did you mean num_hidden_layers?"),
                                         ("n_layers=2", "did you mean n_layer?")])
def test_unknown_set_key_is_an_error_naming_a_key(capsys, item, named):
    line = one_error_line(*run(capsys, "estimate", "gpt2", "--set", item)[::2])
    assert named in line and repr(item.split("=")[0]) in line
    fields, amap = config_schema("gpt2")
    suggested = re.search(r"(?:did you mean|nearest known field is) ([A-Za-z0-9_]+)", line).group(1)
    assert suggested in set(resolve_model("gpt2").config) | fields | set(amap), suggested


@pytest.mark.parametrize("item, expected", [("n_layer=2.5", "an integer"), ("n_layer=abc", "an integer"),
                                            ("resid_pdrop=abc", "a finite number"),
                                            ("resid_pdrop=NaN", "a finite number"),
                                            ("tie_word_embeddings=maybe", "true or false"),
                                            ("architectures=3", "a JSON list")])
def test_set_value_of_the_wrong_type_is_one_line(capsys, item, expected):
    line = one_error_line(*run(capsys, "estimate", "gpt2", "--set", item)[::2])
    key, value = item.split("=")
    assert f"{key}={value}" in line and expected in line


def test_set_values_that_fit_the_type_are_converted():
    spec = resolve_model("gpt2", ["n_layer=3.0", "resid_pdrop=0", "tie_word_embeddings=False"])
    assert spec.config["n_layer"] == 3 and type(spec.config["n_layer"]) is int
    assert spec.config["resid_pdrop"] == 0.0 and type(spec.config["resid_pdrop"]) is float
    assert spec.tied_embeddings is False
    with pytest.raises(TrainmemError, match="n_layer must be an integer"):  # the API's mapping too
        trainmem.estimate("gpt2", set={"n_layer": 2.5})


def test_bundled_config_table_agrees_with_transformers():
    """The offline table (used while transformers is not imported) says what transformers says."""
    pytest.importorskip("transformers")
    for model_type in sorted({resolve_model(n).model_type for n in config_mod.catalogue_names()}):
        fields_tf, amap_tf = config_schema(model_type, "transformers")
        fields_b, amap_b = config_schema(model_type, "bundled")
        assert amap_tf == amap_b, model_type
        assert fields_tf <= fields_b, (model_type, sorted(fields_tf - fields_b))
        if "vision_config" in fields_tf:  # a composite config (SigLIP, CLIP): its sizes are in vision_config
            continue
        # an image model has an image size where a language model has a vocabulary
        size = "image_size" if "image_size" in fields_tf else "vocab_size"
        assert {"num_hidden_layers", size} <= fields_b | set(amap_b), model_type


# ----- GPU names -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a100", "v100", "gh200", "A100 PCIe"])
def test_family_with_several_sizes_is_ambiguous(capsys, name):
    line = one_error_line(*run(capsys, "estimate", "gpt2", "--gpu", name)[::2])
    assert "ambiguous" in line
    listed = [k for k in catalogue() if f"{k} (" in line]
    assert len(listed) >= 2 and len({catalogue()[k]["memory_mib"] for k in listed}) >= 2


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100-sxm-80gb"),
                                       ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                       ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                                       ("Tesla V100-SXM2-32GB", "v100-32gb"),
                                       ("NVIDIA GeForce RTX 4090", "rtx-4090"),
                                       ("nvidia geforce rtx-5090", "rtx-5090"),
                                       ("NVIDIA GH200 480GB", "gh200-96gb"),
                                       ("AMD Instinct MI250X/MI250", "mi250x"),
                                       ("a100 80 GB", "a100-80gb"), ("rtx4090", "rtx-4090")])
def test_nvidia_smi_names_resolve(name, key):
    assert get_gpu(name).name == key
    assert get_gpu(name).capacity == catalogue()[key]["memory_mib"] * MiB


def test_every_catalogued_name_resolves_to_its_own_entry():
    for key in catalogue():
        for name in [key] + gpu_aliases(key):
            assert match_gpu(name) == key, (name, key)


def test_new_cards_are_catalogued():
    for key in ("a40", "rtx-a6000", "l40", "l40s", "rtx-5090", "h800", "h20", "gh200-96gb", "gh200-144gb",
                "b200", "gb200", "mi250x", "mi325x"):
        assert key in catalogue() and catalogue()[key].get("source"), key
    assert catalogue()["mi250x"]["memory_mib"] * MiB == 68702699520  # one GCD, as PyTorch sees it


def test_unknown_gpu_gets_did_you_mean(capsys):
    line = one_error_line(*run(capsys, "estimate", "gpt2", "--gpu", "H10")[::2])
    assert "did you mean" in line and "h100-sxm-80gb" in line


def test_gpus_command_shows_every_alias(capsys):
    code, out, _ = run(capsys, "gpus")
    assert code == 0
    for key in catalogue():
        for alias in gpu_aliases(key):
            assert alias in out, alias
    code, out, _ = run(capsys, "gpus", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert "a100" not in rows["a100-80gb"]["aliases"] and "NVIDIA A100-SXM4-80GB" in rows["a100-80gb"]["aliases"]


# ----- --gpu auto through a fake NVML --------------------------------------------------------
def fake_nvml(devices: list[tuple[str, int]], init_error: Exception | None = None) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.calls = []

    def init():
        if init_error is not None:
            raise init_error
        m.calls.append("init")
    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetHandleByUUID = lambda u: 0
    m.nvmlDeviceGetName = lambda h: devices[h][0].encode()
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=devices[h][1], free=0, used=0)
    return m


def test_auto_matches_the_catalogue_with_nvml_capacity(monkeypatch):
    nvml = fake_nvml([("NVIDIA H100 80GB HBM3", 85520809984 - 2 * MiB), ("NVIDIA A100-SXM4-40GB", 40960 * MiB)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    hw = get_gpu("auto")
    assert hw.name == "h100-sxm-80gb" and hw.capacity == 85520809984 - 2 * MiB
    assert hw.context == catalogue()["h100-sxm-80gb"]["context_mib"] * MiB and hw.bf16_tflops > 0
    assert nvml.calls[-1] == "shutdown"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert get_gpu("auto").name == "a100-40gb"


def test_auto_unknown_card_is_custom_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([("NVIDIA RTX A4000", 16376 * MiB)]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = trainmem.estimate("gpt2", seq_len=256, gpu="auto")
    assert r.capacity == 16376 * MiB and r.hardware.label == "NVIDIA RTX A4000"
    assert any("not in the GPU catalogue" in w for w in r.warnings)


@pytest.mark.parametrize("setup, reason", [("missing", "not installed"), ("no-driver", "did not start"),
                                           ("hidden", "hides every GPU"), ("no-gpu", "none numbered 0")])
def test_auto_without_nvml_or_gpu_is_one_line(capsys, monkeypatch, setup, reason):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if setup == "missing":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    elif setup == "no-driver":
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([], RuntimeError("Driver Not Loaded")))
    else:
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([]))
        if setup == "hidden":
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    line = one_error_line(*run(capsys, "estimate", "gpt2", "--gpu", "auto")[::2])
    assert reason in line and "--gpu NAME" in line


# ----- sizes ---------------------------------------------------------------------------------
def test_bare_gpu_memory_is_gib_and_says_so(capsys):
    r = trainmem.estimate("gpt2", seq_len=256, gpu_memory="40")
    assert r.capacity == 40 * GiB
    assert any("--gpu-memory 40 has no unit: read as 40 GiB" in w for w in r.warnings)
    code, out, err = run(capsys, "estimate", "gpt2", "--seq-len", "256", "--gpu-memory", "40", "--json")
    assert code == 0 and json.loads(out)["capacity"] == 40 * GiB
    assert trainmem.estimate("gpt2", seq_len=256, gpu_memory="40GiB").warnings == \
        trainmem.estimate("gpt2", seq_len=256, gpu_memory=40 * GiB).warnings  # a unit or an int: no note


@pytest.mark.parametrize("flag, value, words", [("--gpu-memory", "1e400GiB", "not a finite number"),
                                                ("--gpu-memory", "-1GiB", "negative"),
                                                ("--gpu-memory", "nan", "not a finite number"),
                                                ("--gpu-memory", "inf", "not a finite number"),
                                                ("--gpu-memory", "1e30TiB", "too large"),
                                                ("--context-memory", "1e400GiB", "not a finite number"),
                                                ("--context-memory", "-5MiB", "negative")])
def test_bad_sizes_are_one_line(capsys, flag, value, words):
    line = one_error_line(*run(capsys, "estimate", "gpt2", "--gpu", "h100", f"{flag}={value}")[::2])
    assert words in line and flag in line and value in line


def test_parse_bytes_units():
    assert parse_bytes("512MiB") == 512 * MiB and parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5") == int(1.5 * GiB) and parse_bytes(1234) == 1234  # Python ints are bytes
    with pytest.raises(TrainmemError, match="not a finite"):
        parse_bytes(float("nan"))


# ----- model paths and hub ids ---------------------------------------------------------------
@pytest.fixture
def offline(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("network used")
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def fake_cache(root, repo_id: str, config: dict, with_ref: bool = True) -> None:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    if with_ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("abc123")


@pytest.mark.parametrize("with_ref", [True, False])
def test_hub_model_in_the_local_cache_works_offline(tmp_path, monkeypatch, offline, with_ref):
    cfg = json.loads(json.dumps(resolve_model("llama-3.2-1b").config))
    cfg["num_hidden_layers"] = 3
    fake_cache(tmp_path, "someone/tiny-llama", cfg, with_ref)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    spec = resolve_model("someone/tiny-llama")
    assert spec.name == "someone/tiny-llama" and spec.num_layers == 3


def test_hf_home_locates_the_cache(tmp_path, monkeypatch, offline):
    fake_cache(tmp_path / "hub", "someone/gpt", resolve_model("gpt2").config)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model("someone/gpt").num_layers == 12


def test_hub_id_of_a_catalogue_model_uses_the_bundled_entry_and_says_so(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    r = trainmem.estimate("meta-llama/Llama-3.1-8B", seq_len=256)
    assert r.model.num_params == resolve_model("llama-3.1-8b").num_params
    assert any("using the bundled catalogue entry llama-3.1-8b" in w for w in r.warnings)


@pytest.mark.parametrize("path", ["./missing/dir", "/no/such/config.json", "~/no-such-trainmem-dir/x",
                                  "a/b/c", "missing.json"])
def test_missing_local_path_says_no_such_file(capsys, offline, path):
    line = one_error_line(*run(capsys, "estimate", path)[::2])
    assert f"no such file or directory: {path}" in line and "offline" not in line


def test_every_nvidia_card_has_its_compute_capability():
    """gpus.json carries torch.cuda.get_device_capability per NVIDIA card (AMD: none)."""
    from trainmem.spec.hardware import catalogue, get_gpu
    for key, v in catalogue().items():
        hw = get_gpu(key)
        if key.startswith("mi"):
            assert hw.capability is None
        else:
            assert hw.capability is not None and 7 <= hw.capability[0] <= 12, key
    assert get_gpu("h20").capability == (9, 0) and get_gpu("l4").capability == (8, 9)


@pytest.mark.parametrize("gpu, sm90", [("h20", True), ("h800", True), ("a100-80gb", False), ("l4", False)])
def test_trace_takes_the_cublas_workspace_from_the_capability(gpu, sm90):
    """PyTorch's default cuBLAS workspace is 32 MiB per handle on sm90 (CublasHandlePool.cpp): the
    trace used to guess Hopper from the name and missed the H20."""
    pytest.importorskip("torch")
    import trainmem
    from trainmem.trace.tracker import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_SM90
    r = trainmem.trace("gpt2", set=["n_layer=1", "n_embd=64", "n_head=2", "vocab_size=128", "n_positions=64"],
                       seq_len=16, steps=1, gpu=gpu, precision="fp32")
    assert r.extra["cublas_workspace"] == (CUBLAS_WORKSPACE_SM90 if sm90 else CUBLAS_WORKSPACE)
