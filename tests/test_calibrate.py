"""`trainmem calibrate` and `--calibration FILE`, on a machine without a GPU.

What runs for real here: the CPU path of the command (it says what it would measure, exit 0), the
measurement process refusing without CUDA, and the parent's orchestration with a stand-in
interpreter. The profiles fed to estimate below are **constructed in the tests** (``build_profile``
on hand-written item results): they test the plumbing from a profile to ``device_used`` and the
peak, not any measured figure. The shipped profiles (the H200 measured on 2026-11-24) are hidden
from these tests (``no_bundled``) except where a test is about them.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import trainmem
from trainmem.cli import _Parser, main
from trainmem.cli import calibrate as cli_calibrate
from trainmem.errors import TrainmemError
from trainmem.measure.calibrate import ITEMS, build_profile, calibrate, plan, write_profile
from trainmem.spec import calibration as cal
from trainmem.spec.hardware import CUBLAS_WORKSPACE_SM90, catalogue
from trainmem.units import MiB

CUDA = False
try:
    import torch
    CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    pass

needs_no_gpu = pytest.mark.skipif(CUDA, reason="on a GPU machine calibrate measures for real")
SETUP = ["gpt2", "--batch-size", "2", "--seq-len", "128"]
CTX = 600 * MiB + 12_345            # a made-up context (plumbing only)
WS = 32 * MiB                       # a made-up per-handle cuBLAS workspace (plumbing only)


@pytest.fixture(autouse=True)
def no_bundled(request, monkeypatch):
    """The catalogue's figures as the baseline: shipped profiles hidden unless a test says ``shipped``."""
    if "shipped" not in request.keywords:
        monkeypatch.setattr(cal, "bundled", lambda: ())


def made_up_results(gpu: str = "NVIDIA H200", torch_version: str | None = None, ctx: int | None = CTX,
                    ws: int | None = WS) -> dict:
    """Item results as ``run_item`` returns them, written by hand: NOT measurements."""
    here = cal.local_versions()
    info = {"gpu": gpu, "total_memory": 150_754_820_096, "compute_capability": [9, 0],
            "driver": here["driver"], "cuda": "13.0", "torch": torch_version or here["torch"]}
    ok = {"ok": True, "refused": False, "reason": None, "info": {}, "details": {}}
    return {"gpu": dict(ok, item="gpu", values={}, info=info),
            "context_lazy": dict(ok, item="context_lazy", values={"context_lazy": 400 * MiB}),
            "cublas": dict(ok, item="cublas", values={"cublas_workspace": ws, "cublas_workspace_stream": ws,
                                                      "cublas_workspace_thread": ws, "cublaslt_workspace": MiB}),
            "training": dict(ok, item="training", values={"context_training": ctx, "workspaces_training": None}),
            "nccl": {"item": "nccl", "ok": False, "refused": False, "reason": "1 GPU visible", "values": {}}}


def profile_file(tmp_path, **kw) -> str:
    return write_profile(str(tmp_path / "profile.json"), build_profile(made_up_results(**kw), command="test"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def estimate_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "estimate", *SETUP, "--json", *argv)
    assert code == 0, err
    return json.loads(out)


def calibrate_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``trainmem calibrate ARGV`` through its own ``register`` (the lead registers it in cli/__init__)."""
    p = _Parser(prog="trainmem")
    cli_calibrate.register(p.add_subparsers(dest="command", parser_class=_Parser))
    a = p.parse_args(["calibrate", *argv])
    try:
        code = a.func(a)
    except TrainmemError as e:
        code = 2
        print(f"trainmem: error: {e}", file=sys.stderr)
    out, err = capsys.readouterr()
    return code, out, err


# ----- the command on the CPU ------------------------------------------------------------------------
@needs_no_gpu
def test_cpu_calibrate_says_what_it_would_measure_and_exits_0(capsys, tmp_path):
    code, out, err = calibrate_cli(capsys, "--out", str(tmp_path / "c.json"))
    assert code == 0, err
    assert "nothing measured: no CUDA GPU here" in out
    for item in ITEMS:
        assert f"  {item.name}" in out
    assert "CUDA_MODULE_LOADING=EAGER" in out and "cublas_workspace" in out
    assert not (tmp_path / "c.json").exists()
    code, out, _ = calibrate_cli(capsys, "--json")
    d = json.loads(out)
    assert code == 0 and d["measured"] is False and [x["item"] for x in d["plan"]] == [i.name for i in ITEMS]


@needs_no_gpu
def test_measurement_process_refuses_cleanly_without_cuda():
    cp = subprocess.run([sys.executable, "-m", "trainmem.measure.calibrate", "--item", "context_lazy"],
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(trainmem.__file__))))
    assert cp.returncode == 2
    assert "Traceback" not in cp.stderr
    lines = cp.stdout.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["ok"] is False and r["refused"] is True and "no CUDA GPU" in r["reason"]


def test_plan_lists_every_value_a_profile_has():
    keys = {k for it in plan() for k in it["values"]}
    assert set(cal.USED_VALUES) - {"context"} <= keys
    assert {"context_lazy", "context_eager", "context_training", "cublaslt_workspace", "nccl_per_communicator"} <= keys


# ----- the parent's orchestration, with a stand-in interpreter ----------------------------------------------
FAKE = textwrap.dedent('''\
    #!{python}
    import json, sys
    item = sys.argv[sys.argv.index("--item") + 1]
    if item == "cublas":
        raise SystemExit("crashed on purpose")   # no JSON: the parent records a failure, keeps going
    values = {{"context_lazy": {{"context_lazy": 1000}}, "training": {{"context_training": 2000}}}}.get(item, {{}})
    info = {{"gpu": "NVIDIA H200", "total_memory": 10**11, "compute_capability": [9, 0], "torch": "x"}}
    print("some library chatter")
    print(json.dumps({{"item": item, "ok": True, "values": values, "info": info if item == "gpu" else {{}}}}))
    ''')


def test_calibrate_runs_each_item_apart_and_a_crash_loses_nothing_else(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    written = []
    profile, results = calibrate(["context_lazy", "cublas", "training"], python=str(fake), write=written.append)
    assert set(results) == {"gpu", "context_lazy", "cublas", "training"}
    assert results["cublas"]["ok"] is False and "crashed on purpose" in results["cublas"]["reason"]
    assert profile["values"]["context_training"] == 2000 and profile["values"]["context"] == 2000
    assert profile["values"]["cublas_workspace"] is None and "crashed" in profile["reasons"]["cublas_workspace"]
    assert len(written) == 4 and written[1]["values"]["context"] == 1000   # the gpu, then context_lazy alone


def test_calibrate_rejects_unknown_items():
    with pytest.raises(TrainmemError, match="unknown item"):
        calibrate(["contxt"])


# ----- --calibration: the plumbing from a profile to the estimate -------------------------------------------
def test_matching_profile_changes_device_used_by_the_context_difference(capsys, tmp_path):
    path = profile_file(tmp_path)
    base = estimate_json(capsys, "--gpu", "h200")
    got = estimate_json(capsys, "--gpu", "h200", "--calibration", path)
    catalogue_ctx = catalogue()["h200"]["context_mib"] * MiB
    # two cuBLAS handles at the peak (optimizer step of step 1: forward and autograd threads)
    assert got["peak_allocated"] - base["peak_allocated"] == 2 * (WS - CUBLAS_WORKSPACE_SM90)  # H200: sm90 default
    extra = got["peak_reserved"] - base["peak_reserved"]     # the peak plus its 1/32 allocator margin
    assert got["device_used"] - base["device_used"] == extra + (CTX - catalogue_ctx)
    assert not got["warnings"]
    ctx = next(c for c in got["components"] if c["name"] == "cuda_context")
    assert ctx["bytes"] == CTX and "trainmem calibrate" in ctx["formula"]


def test_profile_context_alone_changes_device_used_by_exactly_the_difference(capsys, tmp_path):
    path = profile_file(tmp_path, ws=None)     # no workspace measured: the default stays
    base = estimate_json(capsys, "--gpu", "h200")
    got = estimate_json(capsys, "--gpu", "h200", "--calibration", path)
    assert got["peak_allocated"] == base["peak_allocated"]
    assert got["device_used"] - base["device_used"] == CTX - catalogue()["h200"]["context_mib"] * MiB


def test_profile_for_another_gpu_warns_once_and_changes_nothing(capsys, tmp_path):
    path = profile_file(tmp_path)
    base = estimate_json(capsys, "--gpu", "a100-80gb")
    got = estimate_json(capsys, "--gpu", "a100-80gb", "--calibration", path)
    assert (got["device_used"], got["peak_allocated"]) == (base["device_used"], base["peak_allocated"])
    assert len(got["warnings"]) == 1 and "not used" in got["warnings"][0] and "h200" in got["warnings"][0]


def test_profile_of_other_versions_is_used_with_one_note(capsys, tmp_path):
    path = profile_file(tmp_path, torch_version="0.0.1+cu999")
    got = estimate_json(capsys, "--gpu", "h200", "--calibration", path)
    if cal.local_versions()["torch"] is None:
        pytest.skip("no torch installed: no version to compare")
    assert len(got["warnings"]) == 1 and "torch 0.0.1+cu999" in got["warnings"][0]
    assert next(c for c in got["components"] if c["name"] == "cuda_context")["bytes"] == CTX


def test_context_memory_flag_wins_over_the_profile(capsys, tmp_path):
    path = profile_file(tmp_path)
    got = estimate_json(capsys, "--gpu", "h200", "--calibration", path, "--context-memory", "700MiB")
    base = estimate_json(capsys, "--gpu", "h200", "--context-memory", "700MiB")
    assert next(c for c in got["components"] if c["name"] == "cuda_context")["bytes"] == 700 * MiB
    assert got["peak_allocated"] - base["peak_allocated"] == 2 * (WS - CUBLAS_WORKSPACE_SM90)  # H200: sm90 default


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ('{"format": "something-else/1", "gpu": "x", "values": {}}', "not a calibration profile"),
    ('{"format": "trainmem-calibration/1", "gpu": "NVIDIA H200", "values": {"context": -5}}', "values.context"),
])
def test_bad_profile_file_is_one_error_line_exit_2(capsys, tmp_path, content, says):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run(capsys, "estimate", *SETUP, "--gpu", "h200", "--calibration", str(path))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainmem: error:")
    assert str(path) in lines[0] and says in lines[0] and "trainmem calibrate --out FILE" in lines[0]


def test_calibration_without_a_gpu_is_an_error(capsys, tmp_path):
    code, _, err = run(capsys, "estimate", *SETUP, "--calibration", profile_file(tmp_path))
    assert code == 2 and "--calibration needs a GPU: give --gpu h200" in err


def test_fit_and_the_layout_engine_use_the_profile_workspace(tmp_path):
    from trainmem.estimate.engine import estimate, estimate_layouts
    from trainmem.spec.resolve import resolve
    r = resolve("gpt2", batch_size=2, seq_len=128, gpu="h200", calibration=profile_file(tmp_path))
    assert r.hardware.cublas_workspace == WS and r.hardware.context == CTX
    arrays = estimate_layouts(r.model, r.training, r.hardware.cublas_workspace, batch_size=np.array([2, 4]))
    for i, b in enumerate((2, 4)):
        one = estimate(r.model, r.replace(batch_size=b).training, WS)
        assert arrays["peak_allocated"][i] == one.peak_allocated
    from trainmem.plan.fit import fit
    path = profile_file(tmp_path)
    fitted = fit("gpt2", gpu="h200", seq_len=128, calibration=path)
    again = trainmem.estimate("gpt2", gpu="h200", seq_len=128, batch_size=fitted.batch_size, calibration=path)
    assert fitted.report.device_used == again.device_used
    over = trainmem.estimate("gpt2", gpu="h200", seq_len=128, batch_size=fitted.batch_size + 1, calibration=path)
    assert again.device_peak <= fitted.limit < over.device_peak     # the largest that fits the calibrated GPU


def test_a_bundled_profile_of_the_gpu_is_used_without_the_flag(capsys, tmp_path, monkeypatch):
    profile = build_profile(made_up_results(), command="test")
    monkeypatch.setattr(cal, "bundled", lambda: (("h200-test.json", profile),))
    got = estimate_json(capsys, "--gpu", "h200")
    assert next(c for c in got["components"] if c["name"] == "cuda_context")["bytes"] == CTX
    other = estimate_json(capsys, "--gpu", "a100-80gb")
    assert next(c for c in other["components"] if c["name"] == "cuda_context")["bytes"] != CTX


@pytest.mark.shipped
def test_shipped_profiles_are_valid():
    shipped = cal.bundled()
    assert shipped, "the H200 profile measured on 2026-11-24 is shipped"
    for name, p in shipped:
        assert cal.profile_gpu(p) in catalogue(), name


@pytest.mark.shipped
def test_the_shipped_h200_profile_sets_the_context_without_a_version_warning(capsys):
    """The measured H200 (``trainmem calibrate``, driver 580, torch 2.11.0+cu130): its context after a
    training step (758 MiB, NVML's process figure less PyTorch's reserved) becomes ``device_used -
    peak_reserved``; this machine's torch is not compared with a bundled profile's."""
    name, p = cal.bundled_for(trainmem.spec.hardware.get_gpu("h200"))
    got = estimate_json(capsys, "--gpu", "h200")
    assert got["device_used"] - got["peak_reserved"] == p["values"]["context"]
    assert not [w for w in got["warnings"] if "calibration" in w]


def test_trace_uses_the_profile_workspace_and_context(tmp_path):
    pytest.importorskip("transformers")
    from trainmem.trace.api import trace
    tiny = ["n_layer=1", "n_embd=32", "n_head=2", "vocab_size=128", "n_positions=64"]
    r = trace("gpt2", set=tiny, batch_size=1, seq_len=16, steps=1, gpu="h200", calibration=profile_file(tmp_path))
    assert r.extra["cublas_workspace"] == WS
    assert r.device_used - r.peak_reserved == CTX


def test_an_item_that_cannot_be_measured_is_null_with_its_reason(monkeypatch):
    """measure_here in this process, CUDA pretended available: nccl finds fewer than two GPUs (a
    reason, not an error); cublas fails on the CPU torch (a failed result, not a traceback)."""
    from trainmem.measure import calibrate as mc
    monkeypatch.setattr(mc, "no_cuda_reason", lambda: None)
    r = mc.measure_here("nccl")
    assert r["ok"] is True and r["values"] == {"nccl_per_communicator": None}
    assert "GPU visible" in r["reasons"]["nccl_per_communicator"]
    if not CUDA:
        r = mc.measure_here("cublas")
        assert r["ok"] is False and not r["refused"] and r["reason"]


def test_a_negative_context_is_null_not_a_crash():
    results = made_up_results(ctx=-4096)
    p = build_profile(results)
    assert p["values"]["context_training"] is None and "-4096 B, outside" in p["reasons"]["context_training"]
    assert p["values"]["context"] == 400 * MiB and p["reasons"]["context_from"] == "context_lazy"


@pytest.mark.parametrize("width", [None, 72, 80, 100, 132])
def test_the_profile_table_names_what_estimate_uses_within_the_terminal(monkeypatch, width):
    from trainmem.render.calibrate import render_plan, render_profile
    if width is not None:  # None: piped, 100 columns
        monkeypatch.setenv("COLUMNS", str(width))
    text = render_profile(build_profile(made_up_results(), command="test"), "/tmp/x/calibration.json")
    words = " ".join(text.split())  # a note wraps under itself on a narrow terminal
    assert "used by estimate (from" in words and "item nccl failed: 1 GPU visible" in words
    text += "\n" + render_plan(plan(), "no CUDA GPU here", "/tmp/x/calibration.json")
    assert max(len(line) for line in text.splitlines()) <= (width or 100)


def test_default_cublas_workspace_follows_the_compute_capability():
    """CublasHandlePool.cpp: 32 MiB per handle on sm90 exactly (H100, H200), 8,519,680 B elsewhere;
    estimate and trace use the same rule, so they agree on an H200 (trace was 0.5% above before)."""
    from trainmem.spec.hardware import CUBLAS_WORKSPACE, default_cublas_workspace, get_gpu
    assert get_gpu("h200").handle_workspace == CUBLAS_WORKSPACE_SM90 == default_cublas_workspace((9, 0))
    assert get_gpu("a100-80gb").handle_workspace == CUBLAS_WORKSPACE == default_cublas_workspace(None)
    from trainmem.estimate.api import estimate
    from trainmem.trace.api import trace
    kw = dict(set=["n_layer=2"], batch_size=2, seq_len=256, gpu="h200")
    e, t = estimate("gpt2", **kw), trace("gpt2", **kw)
    assert t.extra["cublas_workspace"] == CUBLAS_WORKSPACE_SM90
    assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.01


def test_compare_passes_the_profile_and_measure_refuses_it(capsys, tmp_path):
    """Never accepted and ignored: compare's estimate uses the profile; measure reads the GPU itself."""
    path = profile_file(tmp_path)
    code, out, err = run(capsys, "compare", *SETUP, "--gpu", "h200", "--calibration", path, "--json")
    assert code in (0, 1), err
    got = json.loads(out)["reports"]["estimate"]
    calibrated = estimate_json(capsys, "--gpu", "h200", "--calibration", path)
    plain = estimate_json(capsys, "--gpu", "h200")
    assert got["device_used"] == calibrated["device_used"] != plain["device_used"]
    code, out, err = run(capsys, "measure", *SETUP, "--calibration", path, "--device", "cpu")
    assert code == 2 and "--calibration: measure reads" in err and err.count("\n") == 1
