"""``trainmem calibrate``: this machine's GPU memory outside PyTorch's tensors, measured.

Each *item* runs in its own fresh process (``python -m trainmem.measure.calibrate --item NAME``,
which prints one JSON line), so that a crash, a hang or an out-of-memory error in one loses
nothing else, and so that the CUDA context can be measured from a process that has none yet, with
``CUDA_MODULE_LOADING`` set before CUDA starts. ``calibrate()`` runs them, ``build_profile()``
turns their results into a calibration profile (``spec.calibration``: keyed by GPU, driver, CUDA,
torch and date; values in bytes, or null with the reason), ``write_profile()`` writes it.

Where the numbers come from:

* the **CUDA context** is the driver's figure for the process minus ``torch.cuda.memory_reserved()``
  (``probes.context_bytes``): NVML's memory of this process (``nvmlDeviceGetComputeRunningProcesses``),
  else the device's used memory minus its used memory read before this process started CUDA,
  else ``cudaMemGetInfo`` (other processes included; the item's ``details`` say which);
* the **cuBLAS workspaces** are ordinary caching-allocator blocks: PyTorch's
  ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (read at pytorch/pytorch commit 26a39059ec58)
  allocates one per (handle, stream) in ``setWorkspaceForHandle`` through
  ``getNewWorkspace()`` = ``c10::cuda::CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``,
  so each shows as growth of ``torch.cuda.memory_allocated()`` at the first GEMM of a handle on a
  stream. ``parseChosenWorkspaceSize`` sizes it from ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT``
  pairs), by default ``:4096:2:16:8`` = 8,519,680 B, and 32 MiB (``4096 * 8 * 1024``) when the
  device is exactly sm90 (Hopper: H100, H200). A handle belongs to a thread (``DeviceThreadHandlePool``
  pool windows): training has two, the forward thread's and autograd's device thread's.
  ``getCUDABlasLtWorkspace`` allocates a separate cuBLASLt workspace per (handle, stream) of
  ``getCUDABlasLtWorkspaceSize()`` bytes (``CUBLASLT_WORKSPACE_SIZE`` in KiB, default 1024 KiB,
  capped at the cuBLAS size), unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes it use the cuBLAS
  one. ``torch._C._cuda_clearCublasWorkspaces()`` (``clearCublasWorkspaces``) frees both maps.
  Those sizes are PyTorch's source; what is *measured* here is what this torch does.

Only the ``context`` (the training item's, else the lazy-loading one) and ``cublas_workspace``
values are used by estimate and trace (``spec.calibration.USED_VALUES``); the rest is recorded.
Torch is imported only inside the measurements, never at import.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import TrainmemError
from ..spec.calibration import FORMAT, check_profile, load_profile, matches, profile_gpu  # noqa: F401 (re-exported)

__all__ = ["ITEMS", "Item", "plan", "calibrate", "run_item", "build_profile", "write_profile", "load_profile",
           "matches", "default_out", "main"]


@dataclass(frozen=True)
class Item:
    """One measurement: its name, the values (bytes) it gives, what it measures and how, the
    environment its process starts with, and its time limit in seconds."""

    name: str
    keys: tuple[str, ...]
    what: str
    how: str
    env: tuple[tuple[str, str], ...] = ()
    timeout: int = 120


ITEMS: tuple[Item, ...] = (
    Item("gpu", (), "the GPU and the versions the profile is keyed by",
         "torch.cuda.get_device_properties(0) (name, total_memory, major.minor), torch.__version__, "
         "torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.nccl.version(), NVML "
         "nvmlSystemGetDriverVersion / nvmlSystemGetCudaDriverVersion"),
    Item("context_lazy", ("context_lazy",), "CUDA context just after CUDA starts, kernels loaded on first use",
         "fresh process with CUDA_MODULE_LOADING=LAZY: NVML before CUDA starts, torch.empty(1, device='cuda'), "
         "then the driver's figure for the process - torch.cuda.memory_reserved()",
         env=(("CUDA_MODULE_LOADING", "LAZY"),)),
    Item("cublas", ("cublas_workspace", "cublas_workspace_stream", "cublas_workspace_thread", "cublaslt_workspace"),
         "cuBLAS workspace per handle (and per extra stream, per extra thread) and the cuBLASLt workspace",
         "growth of torch.cuda.memory_allocated() at the first torch.mm(out=) of this thread, on a second "
         "stream, in a second thread, then at the first torch.addmm with a 1-D bias (cuBLASLt's "
         "gemm_and_bias path); torch._C._cuda_clearCublasWorkspaces() frees them all (their sum)"),
    Item("training", ("context_training", "workspaces_training"),
         "CUDA context after two training steps (the context estimate uses) and the cuBLAS/cuBLASLt "
         "workspaces the steps leave",
         "fresh process, environment as given: a 2-layer decoder (RMSNorm, SDPA, SwiGLU; hidden 256, "
         "batch 2 x 256 tokens) under bf16 autocast with AdamW, 2 steps; context = driver - reserved; "
         "workspaces = memory freed by torch._C._cuda_clearCublasWorkspaces()"),
    Item("cudnn", ("cudnn_context", "cudnn_conv_workspace"),
         "device memory cuDNN takes at its first use, and one convolution's workspace",
         "driver - reserved before and after the first F.conv2d (8x64x56x56, 3x3, fp32); the "
         "convolution's peak allocated beyond its input, weight and output"),
    Item("sdpa", ("sdpa_flash_forward_extra", "sdpa_flash_backward_extra", "sdpa_flash_context",
                  "sdpa_efficient_forward_extra", "sdpa_efficient_backward_extra", "sdpa_efficient_context",
                  "sdpa_cudnn_forward_extra", "sdpa_cudnn_backward_extra", "sdpa_cudnn_context"),
         "scaled_dot_product_attention's transient memory per backend (flash, memory-efficient, cuDNN)",
         "q, k, v bf16 2x8x1024x64, causal, under torch.nn.attention.sdpa_kernel: peak allocated beyond the "
         "output in forward, beyond dq/dk/dv in backward; context growth at the backend's first call"),
    Item("nccl", ("nccl_per_communicator",), "NCCL's device memory per communicator (two GPUs or more)",
         "two processes (ranks) on GPUs 0 and 1: driver - reserved before and after "
         "init_process_group('nccl') and the first all_reduce; null with one GPU visible"),
    Item("context_eager", ("context_eager",), "CUDA context just after CUDA starts, every kernel module loaded",
         "as context_lazy with CUDA_MODULE_LOADING=EAGER", env=(("CUDA_MODULE_LOADING", "EAGER"),), timeout=240),
)

_BY_NAME = {i.name: i for i in ITEMS}


def plan() -> list[dict[str, Any]]:
    """What ``calibrate`` measures, item by item: name, values, what, how (what the CPU prints)."""
    return [{"item": i.name, "values": list(i.keys), "what": i.what, "how": i.how,
             "environment": dict(i.env)} for i in ITEMS]


# ----- the parent: one subprocess per item ------------------------------------------------------------
def run_item(item: Item, python: str = sys.executable, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run one item in a fresh process and return its result (``ok``, ``values``, ``info``,
    ``details``, ``reason``); a crash, a time-out or no result is a failed result, never an error."""
    import trainmem
    env = dict(os.environ, **dict(item.env))
    root = os.path.dirname(os.path.dirname(os.path.abspath(trainmem.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [python, "-m", "trainmem.measure.calibrate", "--item", item.name, *extra]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=item.timeout, env=env)
    except subprocess.TimeoutExpired:
        return _failed(item.name, f"no result within {item.timeout} s (killed)")
    except OSError as e:
        return _failed(item.name, f"could not start {python} ({e.strerror})")
    lines = [ln for ln in cp.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = " | ".join(cp.stderr.strip().splitlines()[-3:])
        return _failed(item.name, f"exit status {cp.returncode} and no result; stderr: {tail or '(empty)'}")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return _failed(item.name, f"exit status {cp.returncode}; its result line is not JSON")


def _failed(name: str, reason: str, refused: bool = False) -> dict[str, Any]:
    return {"item": name, "ok": False, "refused": refused, "reason": reason, "values": {}, "info": {}, "details": {}}


def calibrate(items: list[str] | None = None, on_result: Callable[[dict], None] | None = None,
              python: str = sys.executable, command: str = "trainmem calibrate",
              write: Callable[[dict], Any] | None = None) -> tuple[dict[str, Any] | None, dict[str, dict]]:
    """Run the ``gpu`` item, then (when it found a CUDA device) every other item of ``items``
    (default all): (the profile, or None when the ``gpu`` item measured nothing; every result by
    item). ``command``: the command line recorded in the profile; ``write(profile)`` is called
    after every item once the GPU is known, so a run stopped from outside keeps what it measured."""
    names = [i.name for i in ITEMS] if items is None else ["gpu"] + [n for n in items if n != "gpu"]
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown:
        raise TrainmemError(f"calibrate: unknown item(s) {', '.join(unknown)}; items are {', '.join(_BY_NAME)}")
    results: dict[str, dict] = {}
    for name in names:
        results[name] = run_item(_BY_NAME[name], python)
        if on_result is not None:
            on_result(results[name])
        if name == "gpu" and not results[name].get("ok"):
            return None, results
        if write is not None:
            write(build_profile(results, command=command))
    return build_profile(results, command=command), results


def build_profile(results: dict[str, dict], command: str = "", date: str | None = None) -> dict[str, Any]:
    """The calibration profile of item results (``run_item``'s dicts, by item name; ``gpu``
    needed): the GPU and versions from ``gpu``, every item's values (a failed item's as null, with
    its reason in ``reasons``), and ``context``: the training item's context, else the lazy one."""
    gpu = results.get("gpu") or {}
    if not gpu.get("ok"):
        raise TrainmemError(f"calibrate: no GPU measured ({gpu.get('reason', 'no gpu item')})")
    info = gpu.get("info", {})
    values: dict[str, int | None] = {}
    reasons: dict[str, str] = {}
    for name, res in results.items():
        keys = _BY_NAME[name].keys if name in _BY_NAME else tuple(res.get("values", {}))
        for k in keys:
            v = res.get("values", {}).get(k) if res.get("ok") else None
            values[k] = None if v is None else int(v)
            if v is None:
                reasons[k] = str(res.get("reasons", {}).get(k) or res.get("reason") or "not measured")
    total = info.get("total_memory") if isinstance(info.get("total_memory"), int) else None
    for k in ("context_training", "context_lazy", "context_eager", "cublas_workspace"):
        v = values.get(k)
        if v is not None and (v < 0 or (total is not None and v >= total)):  # another process moved the figure
            reasons[k] = f"measured {v} B, outside 0 .. the GPU's {total} B: another process changed its memory"
            values[k] = None
    _choose(values, reasons)
    profile = {"format": FORMAT, "gpu": info.get("gpu"), "total_memory": info.get("total_memory"),
               "compute_capability": info.get("compute_capability"), "driver": info.get("driver"),
               "cuda": info.get("cuda"), "torch": info.get("torch"), "cudnn": info.get("cudnn"),
               "nccl": info.get("nccl"), "date": date or _now(), "command": command,
               "values": values, "reasons": reasons, "items": results}
    return check_profile(profile, "the measured profile")


def _choose(values: dict[str, int | None], reasons: dict[str, str]) -> None:
    """``values["context"]``: the context after a training step when measured (what a run's
    context is: the driver's figure beside the allocator's reserved memory, ``measure``'s
    definition), else the one just after CUDA starts with lazy loading; ``context_from`` says which."""
    for k in ("context_training", "context_lazy"):
        if values.get(k) is not None:
            values["context"] = values[k]
            reasons.pop("context", None)
            reasons["context_from"] = k
            return
    values["context"] = None
    reasons["context"] = "neither context_training nor context_lazy was measured"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def default_out(profile: dict[str, Any] | None = None) -> str:
    """Where ``trainmem calibrate`` writes without ``--out``: the user cache
    (``spec.profile.cache_dir()``, ``$TRAINMEM_CACHE``) under ``calibration/GPU.json``."""
    from ..spec.profile import cache_dir
    name = profile_gpu(profile) if profile else "GPU"
    return os.path.join(cache_dir(), "calibration", f"{name}.json")


def write_profile(path: str, profile: dict[str, Any]) -> str:
    """Write ``profile`` (checked) as JSON at ``path`` (its folder created); returns ``path``."""
    from ..paths import check_dir, check_file
    check_profile(profile, path)
    folder = os.path.dirname(os.path.abspath(path))
    check_dir(folder, "--out")
    check_file(path, "--out")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1, sort_keys=False)
        f.write("\n")
    return path


# ----- the child: one measurement, one JSON line ----------------------------------------------------------
class _Driver:
    """The driver's figure for this process on CUDA device ``index``: NVML (``probes.Nvml``),
    opened and its baseline read before this process starts CUDA, else ``cudaMemGetInfo``."""

    def __init__(self, index: int = 0) -> None:
        from .probes import Nvml
        self.index = index
        self.nv, self.note = Nvml.open(index)
        if self.nv is not None:
            try:
                self.nv.baseline = self.nv.device_used()
            except Exception as e:  # NVMLError
                self.nv, self.note = None, f"NVML memory query failed ({e}); cudaMemGetInfo used"

    def verify(self) -> None:
        """Once CUDA runs: make sure NVML's device is CUDA's (by UUID)."""
        import torch
        if self.nv is not None:
            note = self.nv.verify(str(getattr(torch.cuda.get_device_properties(self.index), "uuid", "") or ""))
            self.note = "; ".join(x for x in (self.note, note) if x)

    def figures(self) -> dict[str, Any]:
        import torch
        if self.nv is not None:
            return {"used": self.nv.device_used(), "process": self.nv.process_used(),
                    "baseline": self.nv.baseline, "source": "nvml"}
        free, total = torch.cuda.mem_get_info(self.index)
        return {"used": int(total - free), "process": None, "baseline": None, "source": "cudaMemGetInfo"}

    def context(self) -> tuple[int | None, dict[str, Any]]:
        """(driver - reserved now, the figures it came from)."""
        import torch
        from .probes import context_bytes
        torch.cuda.synchronize(self.index)
        fig = self.figures()
        fig["reserved"] = int(torch.cuda.memory_reserved(self.index))
        return context_bytes(fig["reserved"], fig), fig


def _grown(fn: Callable[[], Any], index: int = 0) -> int:
    """Growth of ``torch.cuda.memory_allocated`` across ``fn()`` (synchronized before and after)."""
    import torch
    torch.cuda.synchronize(index)
    before = torch.cuda.memory_allocated(index)
    fn()
    torch.cuda.synchronize(index)
    return int(torch.cuda.memory_allocated(index) - before)


def _cleared() -> int | None:
    """Bytes ``torch._C._cuda_clearCublasWorkspaces()`` frees (every cuBLAS and cuBLASLt workspace
    of the process); None where this torch does not have it."""
    import torch
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return None
    return -_grown(clear)


def _block(nbytes: int) -> int:
    """The caching allocator's block for a request: rounded up to 512 B (``kMinBlockSize``,
    c10/cuda/CUDACachingAllocator.cpp ``round_size``)."""
    return -(-int(nbytes) // 512) * 512


def _env_info() -> dict[str, Any]:
    """The environment variables that change what is measured (the cuBLAS ones as
    CublasHandlePool.cpp reads them; TORCH_CUBLASLT_WORKSPACE_SIZE too, in case a newer torch
    reads that name), recorded with each item."""
    keys = ("CUDA_MODULE_LOADING", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
            "TORCH_CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")
    return {k: os.environ.get(k) for k in keys}


def measure_gpu(drv: _Driver) -> tuple[dict, dict, dict]:
    """The ``gpu`` item: (values, info, details)."""
    import torch
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {"gpu": props.name, "total_memory": int(props.total_memory),
                            "compute_capability": [props.major, props.minor], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "device_count": torch.cuda.device_count(),
                            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:
        info["nccl"] = None
    info["driver"] = drv.nv.driver_version() if drv.nv is not None else None
    info["cuda_driver"] = _cuda_driver(drv)
    details = {"environment": _env_info(), "nvml": drv.note or "ok",
               "nvml_total": drv.nv.total() if drv.nv is not None else None}
    return {}, info, details


def _cuda_driver(drv: _Driver) -> str | None:
    """The CUDA version the driver supports (NVML ``nvmlSystemGetCudaDriverVersion``: 12040 -> 12.4)."""
    if drv.nv is None:
        return None
    try:
        v = int(drv.nv.nv.nvmlSystemGetCudaDriverVersion())
    except Exception:
        return None
    return f"{v // 1000}.{v % 1000 // 10}"


def measure_context(drv: _Driver) -> tuple[dict, dict, dict]:
    """``context_lazy`` / ``context_eager``: the context just after CUDA starts (the mode is the
    process's ``CUDA_MODULE_LOADING``, set by the parent)."""
    import torch
    mode = os.environ.get("CUDA_MODULE_LOADING", "").lower() or "default"
    torch.empty(1, device="cuda")
    drv.verify()
    ctx, fig = drv.context()
    return {f"context_{mode}": ctx}, {}, {"driver": fig, "nvml": drv.note or "ok", "environment": _env_info()}


def measure_cublas(drv: _Driver) -> tuple[dict, dict, dict]:
    """The ``cublas`` item (see the module doc for the source of each workspace)."""
    import threading
    import torch
    n = 256
    a, b, out = (torch.randn(n, n, device="cuda") for _ in range(3))
    bias = torch.randn(n, device="cuda")
    values = {"cublas_workspace": _grown(lambda: torch.mm(a, b, out=out))}
    details: dict[str, Any] = {"same_handle_again": _grown(lambda: torch.mm(a, b, out=out))}
    stream = torch.cuda.Stream()

    def on_stream() -> None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.mm(a, b, out=out)
        torch.cuda.current_stream().wait_stream(stream)

    def in_thread() -> None:
        t = threading.Thread(target=lambda: torch.mm(a, b, out=out))
        t.start()
        t.join()

    values["cublas_workspace_stream"] = _grown(on_stream)
    values["cublas_workspace_thread"] = _grown(in_thread)
    values["cublaslt_workspace"] = _grown(lambda: torch.addmm(bias, a, b, out=out))
    details["cleared_all"] = _cleared()
    a16, b16, o16, bias16 = a.bfloat16(), b.bfloat16(), out.bfloat16(), bias.bfloat16()
    details["bf16_addmm_first_after_clear"] = _grown(lambda: torch.addmm(bias16, a16, b16, out=o16))
    details["preferred_blas_library"] = str(torch.backends.cuda.preferred_blas_library())
    details["environment"] = _env_info()
    return values, {}, details


def _decoder(torch: Any, vocab: int, hidden: int, heads: int, layers: int) -> Any:
    """A small Llama-like decoder in plain torch (RMSNorm, causal SDPA, SwiGLU, untied head)."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
            self.qkv, self.o = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
            self.gate, self.up = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(hidden, 4 * hidden, bias=False)
            self.down = nn.Linear(4 * hidden, hidden, bias=False)

        def forward(self, x: Any) -> Any:
            b, t, h = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
            x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    return nn.Sequential(nn.Embedding(vocab, hidden), *[Block() for _ in range(layers)], nn.RMSNorm(hidden),
                         nn.Linear(hidden, vocab, bias=False))


def measure_training(drv: _Driver) -> tuple[dict, dict, dict]:
    """The ``training`` item: two steps of ``_decoder`` under bf16 autocast with AdamW."""
    import torch
    torch.manual_seed(0)
    vocab, shape = 1024, (2, 256)
    model = _decoder(torch, vocab, 256, 4, 2).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, shape, device="cuda")
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    drv.verify()
    ctx, fig = drv.context()
    values = {"context_training": ctx, "workspaces_training": _cleared()}
    details = {"driver": fig, "allocated": int(torch.cuda.memory_allocated()), "nvml": drv.note or "ok",
               "model": "2-layer decoder, hidden 256, 4 heads, vocab 1024, batch 2 x 256, bf16 autocast, AdamW",
               "environment": _env_info()}
    return values, {}, details


def measure_cudnn(drv: _Driver) -> tuple[dict, dict, dict]:
    """The ``cudnn`` item: context growth at the first convolution and its workspace."""
    import torch
    if not torch.backends.cudnn.is_available():
        raise _Unmeasurable("cuDNN is not available to this torch")
    x = torch.randn(8, 64, 56, 56, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda")
    drv.verify()
    ctx0, _ = drv.context()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = torch.nn.functional.conv2d(x, w, padding=1)
    ctx1, fig = drv.context()
    workspace = int(torch.cuda.max_memory_allocated()) - before - _block(y.untyped_storage().nbytes())
    values = {"cudnn_context": None if ctx0 is None or ctx1 is None else ctx1 - ctx0, "cudnn_conv_workspace": workspace}
    details = {"shape": "x 8x64x56x56 fp32, w 64x64x3x3, padding 1", "cudnn": torch.backends.cudnn.version(),
               "benchmark": torch.backends.cudnn.benchmark, "driver": fig}
    return values, {}, details


class _Unmeasurable(Exception):
    """A value that cannot be measured here (not an error): its reason."""


def _sdpa_backend(torch: Any, drv: _Driver, backend: str) -> dict[str, int | None]:
    """One SDPA backend's transient bytes in forward and backward and its context growth."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    block = _block(q.untyped_storage().nbytes())
    ctx0, _ = drv.context()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(getattr(SDPBackend, backend)):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        fwd = int(torch.cuda.max_memory_allocated()) - before - block
        g = torch.ones_like(o)
        torch.cuda.synchronize()
        mid = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o.backward(g)
        torch.cuda.synchronize()
    bwd = int(torch.cuda.max_memory_allocated()) - mid - 3 * block
    ctx1, _ = drv.context()
    return {"forward_extra": fwd, "backward_extra": bwd,
            "context": None if ctx0 is None or ctx1 is None else ctx1 - ctx0}


def measure_sdpa(drv: _Driver) -> tuple[dict, dict, dict]:
    """The ``sdpa`` item: flash, memory-efficient and cuDNN attention, each on its own tensors."""
    import torch
    drv.verify()
    values: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    for key, backend in (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
                         ("cudnn", "CUDNN_ATTENTION")):
        try:
            got = _sdpa_backend(torch, drv, backend)
        except Exception as e:  # the backend refuses this GPU/dtype/shape, or does not exist in this torch
            got = {}
            first = (str(e).strip().splitlines() or [""])[0][:200]
            for part in ("forward_extra", "backward_extra", "context"):
                reasons[f"sdpa_{key}_{part}"] = f"{backend}: {type(e).__name__}: {first}"
        for part, v in got.items():
            values[f"sdpa_{key}_{part}"] = v
    details = {"shape": "q, k, v bf16 2x8x1024x64, causal; extras beyond the output (forward) and dq, dk, dv "
                        "(backward)", "reasons": reasons}
    return values, {}, details


def measure_nccl(drv: _Driver) -> tuple[dict, dict, dict]:
    """The ``nccl`` item: two rank processes (``nccl_rank``) on GPUs 0 and 1."""
    import tempfile
    import torch
    n = torch.cuda.device_count()
    if n < 2:
        raise _Unmeasurable(f"{n} GPU visible: an NCCL communicator between GPUs needs two or more")
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        raise _Unmeasurable("this torch has no NCCL backend (torch.distributed.is_nccl_available() is False)")
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [subprocess.Popen([sys.executable, "-m", "trainmem.measure.calibrate", "--item", "nccl_rank",
                                   "--rank", str(r), "--world", "2", "--init", init], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        try:
            outs = [p.communicate(timeout=90) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise _Unmeasurable("the two NCCL ranks did not finish within 90 s (killed)") from None
    ranks = [json.loads(next((ln for ln in o.splitlines()[::-1] if ln.startswith("{")), "{}")) for o, _ in outs]
    grown = [r.get("values", {}).get("nccl_per_communicator") for r in ranks]
    if any(g is None for g in grown):
        reasons = "; ".join(str(r.get("reason") or (e.strip().splitlines() or ["no result"])[-1])
                            for r, (_, e) in zip(ranks, outs))
        raise _Unmeasurable(f"a rank gave no figure: {reasons}")
    return {"nccl_per_communicator": max(grown)}, {}, {"ranks": ranks}


def measure_nccl_rank(drv: _Driver, rank: int, world: int, init: str) -> tuple[dict, dict, dict]:
    """One rank of ``nccl``: driver - reserved before and after the communicator's first all_reduce."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    x = torch.ones(1 << 20, device=f"cuda:{rank}")
    drv.verify()
    ctx0, _ = drv.context()
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize(rank)
        ctx1, fig = drv.context()
    finally:
        dist.destroy_process_group()
    grown = None if ctx0 is None or ctx1 is None else ctx1 - ctx0
    return {"nccl_per_communicator": grown}, {}, {"rank": rank, "driver": fig}


_MEASURE: dict[str, Callable[..., tuple[dict, dict, dict]]] = {
    "gpu": measure_gpu, "context_lazy": measure_context, "context_eager": measure_context,
    "cublas": measure_cublas, "training": measure_training, "cudnn": measure_cudnn, "sdpa": measure_sdpa,
    "nccl": measure_nccl}


def no_cuda_reason() -> str | None:
    """None when torch sees a CUDA device, else why not (one line). Imports torch."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install torch, a CUDA build)"
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return None


def measure_here(name: str, rank: int = 0, world: int = 2, init: str = "") -> dict[str, Any]:
    """Run item ``name`` in this process: its result dict (never raises). NVML's baseline is read
    before anything starts CUDA."""
    index = rank if name == "nccl_rank" else 0
    try:
        drv = _Driver(index)
    except ImportError as e:  # probes imports torch
        return _failed(name, f"torch is not installed ({e.name} is missing)", refused=True)
    why = no_cuda_reason()
    if why:
        return _failed(name, f"no CUDA GPU here ({why})", refused=True)
    try:
        if name == "nccl_rank":
            values, info, details = measure_nccl_rank(drv, rank, world, init)
        else:
            values, info, details = _MEASURE[name](drv)
    except _Unmeasurable as e:
        keys = _BY_NAME[name].keys if name in _BY_NAME else ()
        return dict(_failed(name, str(e)), ok=True, values={k: None for k in keys}, reasons={k: str(e) for k in keys})
    except Exception as e:
        return _failed(name, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
    reasons = details.pop("reasons", {}) if isinstance(details.get("reasons"), dict) else {}
    return {"item": name, "ok": True, "refused": False, "reason": None, "values": values, "info": info,
            "details": details, "reasons": reasons}


def main(argv: list[str] | None = None) -> int:
    """``python -m trainmem.measure.calibrate --item NAME``: one JSON line on stdout; exit 0 when
    measured, 1 when the measurement failed, 2 when refused (no CUDA GPU, no torch)."""
    p = argparse.ArgumentParser(prog="python -m trainmem.measure.calibrate",
                                description="One trainmem calibrate measurement, printed as one JSON line.")
    p.add_argument("--item", required=True, choices=[*_MEASURE, "nccl_rank"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--init", default="")
    a = p.parse_args(argv)
    result = measure_here(a.item, a.rank, a.world, a.init)
    print(json.dumps(result, default=str), flush=True)
    if result.get("refused"):
        return 2
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
