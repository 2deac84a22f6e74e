"""measure's bookkeeping without a model or a GPU: phase recorder with a fake probe, NVML with a
fake pynvml module, CUDA-only options on a CPU machine, snapshot writing, OOM message parsing."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import TrainmemError  # noqa: E402
from trainmem.measure.probes import (NVML_MISSING, CudaProbe, Nvml, PhaseRecorder, context_bytes,  # noqa: E402
                                     parse_device, tensor_bytes)
from trainmem.measure.runner import requested_bytes, save_snapshot  # noqa: E402


class ScriptedProbe:
    """A probe whose allocator is a number the test moves by hand."""

    kind = "cuda"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.now = 0
        self.top = 0
        self.tags: list[str] = []
        self.emptied = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.top = max(self.top, self.now)

    def allocated(self) -> int:
        return self.now

    def reserved(self) -> int:
        return (self.now + 2**21 - 1) // 2**21 * 2**21

    def peak(self) -> int:
        return self.top

    def peak_reserved(self) -> int:
        return (self.top + 2**21 - 1) // 2**21 * 2**21

    def peak_where(self) -> str:
        return ""

    def reset_peak(self) -> None:
        self.top = self.now

    def driver(self) -> dict:
        return {"used": self.reserved() + 500 * 2**20 + 2**30, "process": None, "baseline": 2**30,
                "source": "scripted"}

    def set_tag(self, tag: str) -> None:
        self.tags.append(tag)

    def sync(self) -> None:
        pass

    def empty_cache(self) -> None:
        self.emptied += 1


def test_phase_recorder_sequence_and_peaks():
    pr = ScriptedProbe()
    rec = PhaseRecorder(pr, grad_accum=2)
    assert rec.in_progress == "model_loaded@0"
    pr.alloc(1000)
    rec.mark("model_loaded", 0)
    assert rec.in_progress == "forward.micro1@1"
    pr.alloc(5000)
    pr.alloc(-2000)
    r = rec.mark("forward", 1, 0)
    assert (r.phase.name, r.phase.step, r.phase.allocated, r.phase.peak) == ("forward.micro1", 1, 4000, 6000)
    assert rec.in_progress == "backward.micro1@1"
    pr.alloc(-1000)
    r = rec.mark("backward", 1, 0)
    assert (r.phase.allocated, r.phase.peak) == (3000, 4000)  # the peak restarts at the phase's start
    assert rec.in_progress == "forward.micro2@1"
    rec.mark("forward", 1, 1)
    rec.mark("backward", 1, 1)
    assert rec.in_progress == "optimizer_step@1"
    rec.mark("optimizer_step", 1)
    assert rec.in_progress == "zero_grad@1"
    rec.mark("zero_grad", 1)
    assert rec.in_progress == "forward.micro1@2"
    assert [p.name for p in rec.phases] == ["model_loaded", "forward.micro1", "backward.micro1", "forward.micro2",
                                            "backward.micro2", "optimizer_step", "zero_grad"]
    assert rec.peak_record().phase.name == "forward.micro1"
    assert pr.tags[0] == "model_loaded@0" and pr.tags[-1] == "forward.micro1@2"
    # reserved and the driver's figure: context = used − baseline − reserved
    assert r.phase.reserved == 2**21 and r.context == 500 * 2**20
    assert r.to_dict()["cuda_context"] == 500 * 2**20


def test_phase_recorder_without_accumulation_and_empty_cache():
    pr = ScriptedProbe()
    rec = PhaseRecorder(pr, grad_accum=1, empty_cache=True)
    rec.mark("model_loaded", 0)
    r = rec.mark("forward", 1, 0)
    assert r.phase.name == "forward" and rec.in_progress == "backward@1" and pr.emptied == 2


def test_gradients_at_the_peak_are_bracketed_by_hooks():
    """The peak inside backward is split with the gradients alive then, not at the phase's end."""
    pr = ScriptedProbe()
    rec = PhaseRecorder(pr)
    lin = torch.nn.Linear(8, 4)
    rec.watch(list(lin.parameters()))
    rec.mark("model_loaded", 0)
    pr.alloc(10_000)
    rec.mark("forward", 1, 0)
    pr.alloc(50_000)            # the backward's peak comes first ...
    pr.alloc(-50_000)
    lin(torch.randn(2, 8)).sum().backward()   # ... then both gradients arrive (hooks look at the peak)
    r = rec.mark("backward", 1, 0)
    assert r.phase.peak == 60_000
    assert r.gradients_at_peak == 0           # none existed when the peak was reached
    assert rec.grad_bytes() == (8 * 4 + 4) * 4
    rec.unwatch()


def test_tensor_bytes_counts_shared_storage_once():
    a = torch.zeros(100)
    assert tensor_bytes([a, a[10:], a.view(10, 10), torch.zeros(3)]) == 400 + 12


def test_parse_device():
    assert parse_device("cpu") == ("cpu", 0)
    assert parse_device("cuda") == ("cuda", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    with pytest.raises(TrainmemError):
        parse_device("tpu")


def test_context_bytes():
    assert context_bytes(None, {"used": 5}) is None
    assert context_bytes(100, {"used": 1000, "process": 400, "baseline": None}) == 300
    assert context_bytes(100, {"used": 1000, "process": None, "baseline": 200}) == 700
    assert context_bytes(100, {"used": 1000, "process": None, "baseline": None}) == 900


# ----- NVML ---------------------------------------------------------------------------------------
def _fake_pynvml(uuids=("GPU-aaaa", "GPU-bbbb"), used=(111, 222), procs=None):
    nv = types.SimpleNamespace()
    nv.calls = []
    nv.nvmlInit = lambda: nv.calls.append("init")
    nv.nvmlShutdown = lambda: nv.calls.append("shutdown")
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetHandleByUUID = lambda u: [x.lower() for x in uuids].index(u.lower())
    nv.nvmlDeviceGetUUID = lambda h: uuids[h]
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used[h], total=1000, free=1000 - used[h])
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: procs or []
    nv.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    nv.nvmlDeviceGetName = lambda h: "Fake GPU"
    return nv


def test_nvml_absent_gives_a_clear_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    nv, note = Nvml.open(0)
    assert nv is None and note == NVML_MISSING and "pip install nvidia-ml-py" in note


def test_nvml_maps_cuda_visible_devices(monkeypatch):
    fake = _fake_pynvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    nv, note = Nvml.open(0, module=fake)
    assert note == "" and nv.handle == 1 and nv.device_used() == 222
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    nv, _ = Nvml.open(0, module=fake)
    assert nv.handle == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    nv, note = Nvml.open(0, module=fake)
    assert nv is None and "MIG" in note


def test_nvml_verify_switches_device_and_forgets_baseline(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = _fake_pynvml()
    nv, _ = Nvml.open(0, module=fake)
    nv.baseline = 111
    assert nv.verify("aaaa") == "" and nv.baseline == 111           # torch's uuid has no "GPU-" prefix
    note = nv.verify("bbbb")
    assert nv.handle == 1 and nv.baseline is None and "order" in note
    assert nv.driver_version() == "550.54.15" and nv.name() == "Fake GPU"


def test_nvml_process_figure(monkeypatch):
    import os
    fake = _fake_pynvml(procs=[types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=4242),
                               types.SimpleNamespace(pid=1, usedGpuMemory=7)])
    nv, _ = Nvml.open(0, module=fake)
    assert nv.process_used() == 4242
    assert nv.process_used(pid=99999999) is None


def test_cuda_probe_on_a_machine_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TrainmemError, match="--device cpu"):
        with CudaProbe(0):
            pass


# ----- OOM messages and snapshots ------------------------------------------------------------------
def test_requested_bytes_from_cuda_message():
    msg = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
           "1.06 GiB is free.")
    assert requested_bytes(msg) == 2 * 2**30
    assert requested_bytes("Tried to allocate 20.50 MiB") == int(20.5 * 2**20)
    assert requested_bytes("CUBLAS_STATUS_ALLOC_FAILED") is None


def test_save_snapshot_pickle_and_html(tmp_path):
    """The files --snapshot/--html write, from a snapshot of the documented format (no GPU needed)."""
    snap = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 4096, "size": 1024, "stream": 0, "frames": [{"filename": "x.py", "line": 1,
                                                                               "name": "f"}]},
        {"action": "free_requested", "addr": 4096, "size": 1024, "stream": 0, "frames": []}]]}
    pk, html = tmp_path / "s.pickle", tmp_path / "s.html"
    assert save_snapshot(snap, str(pk), str(html)) == [str(pk), str(html)]
    assert pickle.loads(pk.read_bytes()) == snap
    assert "<html" in html.read_text()


# ----- CLI ------------------------------------------------------------------------------------------
def test_cli_import_does_not_import_torch():
    code = ("import sys, trainmem.cli as c; c.build_parser(); import trainmem.measure; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _cli(argv, capsys):
    from trainmem.cli import main
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_snapshot_needs_cuda(capsys, tmp_path):
    code, _, err = _cli(["measure", "gpt2", "--device", "cpu", "--snapshot", str(tmp_path / "s.pickle")], capsys)
    assert code == 2 and "need --device cuda" in err and "--profile" in err


def test_cli_device_cuda_without_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = _cli(["measure", "gpt2", "--set", "n_layer=1", "--device", "cuda", "--seq-len", "8"], capsys)
    assert code == 2 and "--device cpu" in err


def test_cli_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        _cli(["measure", "gpt2", "--device", "tpu"], capsys)
    assert e.value.code == 2
    code, _, err = _cli(["measure", "gpt2", "--device", "cpu", "--find-max-batch"], capsys)
    assert code == 2 and "--memory-limit" in err
    code, _, err = _cli(["measure", "gpt2", "--device", "cpu", "--find-max-batch", "--memory-limit", "1GiB",
                         "--profile", "x"], capsys)
    assert code == 2 and "does not take --profile" in err
    code, _, err = _cli(["measure", "gpt2", "--device", "cpu", "--tp", "2"], capsys)
    assert code == 2 and "Llama, Mistral, Qwen2 and Qwen3" in err  # measure's TP plan (measure/distributed.py)
    code, _, err = _cli(["measure", "gpt2", "--device", "cpu", "--dp", "2"], capsys)
    assert code == 2 and "--launcher torchrun --nproc-per-node 2" in err
    code, _, err = _cli(["measure", "gpt2", "--device", "cpu", "--pp", "2"], capsys)
    assert code == 2 and "not supported: --pp 2" in err
    code, _, err = _cli(["compare", "gpt2", "--reference", "measure"], capsys)
    assert code == 2 and "needs --measure" in err
    code, _, err = _cli(["measure", "gpt2", "--device", "cpu", "--save-fixture", "x.txt"], capsys)
    assert code == 2 and ".json" in err


def test_compare_estimate_only_json(capsys):
    code, out, _ = _cli(["compare", "gpt2", "--seq-len", "128", "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["sources"] == ["estimate"] and d["reference"] == "estimate"
    assert any(r["kind"] == "phase" for r in d["rows"])
