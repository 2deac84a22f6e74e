"""Hardware: one GPU's capacity (exact bytes) and the memory taken before training starts."""
from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, asdict, field
from functools import lru_cache
from importlib import resources
from typing import Any

from ..errors import TrainmemError
from ..units import MiB, is_bare_number, parse_bytes


# cuBLAS workspace per handle with PyTorch's default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"
# (two 4 MiB and eight 16 KiB chunks = 8,519,680 B; aten/src/ATen/cuda/CublasHandlePool.cpp). One
# handle per thread that runs matmuls: the forward thread and autograd's backward thread (Edward Rees,
# "Transformer Memory Arithmetic: Understanding all the Bytes in nanoGPT", https://erees.dev/transformer-memory/).
CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
# Hopper (compute capability 9.0 exactly) defaults to ":4096:8", 32 MiB per handle
# (aten/src/ATen/cuda/CublasHandlePool.cpp ``getChosenWorkspaceSize`` / ``parseChosenWorkspaceSize``,
# read at commit 26a39059ec58); every other GPU keeps CUBLAS_WORKSPACE. From PyTorch 2.11 Blackwell (major 10
# and 12) has the 32 MiB too (``use32mb = major == 9 || major == 10 || major == 12``: pytorch/pytorch PR #175344,
# merged 2026-02-19, before 2.11's release of 2026-03-23; its revert, PR #182669, was closed unmerged).
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
BLACKWELL_32MIB_TORCH = (2, 11)


def parse_cublas_workspace_config(value: str) -> int | None:
    """Bytes of one cuBLAS handle's workspace under ``CUBLAS_WORKSPACE_CONFIG=value``, as PyTorch reads it
    (aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize``, the same at 26a39059ec58 and on
    main in 2026: every ``:SIZE:COUNT`` match of ``std::regex(":([0-9]+):([0-9]+)")`` adds SIZE KiB x
    COUNT; ``":4096:8"`` is 32 MiB, ``":16:8"`` 128 KiB). None where nothing matches (PyTorch then warns
    and keeps its default)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", value)
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else None


def default_cublas_workspace(capability: tuple[int, int] | None, torch_release: tuple[int, int] | None = None) -> int:
    """One cuBLAS handle's workspace with no CUBLAS_WORKSPACE_CONFIG set, by compute capability (unknown:
    the pre-Hopper size) and PyTorch release (``torch_release`` (major, minor); None: a current one)."""
    if capability is None:
        return CUBLAS_WORKSPACE
    cap = tuple(capability)
    blackwell = cap[0] in (10, 12) and (torch_release is None or tuple(torch_release) >= BLACKWELL_32MIB_TORCH)
    return CUBLAS_WORKSPACE_SM90 if cap == (9, 0) or blackwell else CUBLAS_WORKSPACE


def handle_workspace(hw: "Hardware | None", t: Any) -> int | None:
    """One cuBLAS handle's workspace for the run ``t`` on ``hw``: ``--cublas-workspace-config`` where given,
    else a calibration profile's measurement, else PyTorch's default for the GPU and the run's release
    (None: no GPU and no setting, the engine's pre-Hopper default)."""
    if getattr(t, "cublas_workspace", None) is not None:
        return t.cublas_workspace
    if hw is None:
        return None
    if hw.cublas_workspace is not None:
        return hw.cublas_workspace
    return default_cublas_workspace(hw.capability, getattr(t, "torch_release", None))


@dataclass(frozen=True)
class Hardware:
    """A GPU. ``capacity`` is total device memory in bytes as NVML reports it; ``context`` the
    bytes taken before the first tensor (CUDA context, driver, other processes). ``notes``: how
    the inputs were read (a size without a unit, a GPU ``--gpu auto`` did not find in the
    catalogue), one line each; reports carry them as warnings. They take no part in equality.
    ``cublas_workspace``: bytes of one cuBLAS handle's workspace where a calibration profile
    measured it (None: PyTorch's default, ``CUBLAS_WORKSPACE``); ``calibration``: the profile
    that set ``context`` and ``cublas_workspace`` (``spec.calibration``; "" for none)."""

    name: str
    capacity: int
    context: int
    label: str = ""
    bandwidth_gbs: float = 0.0
    bf16_tflops: float = 0.0
    interconnect_gbs: float = 0.0
    notes: tuple[str, ...] = field(default=(), compare=False)
    capability: tuple[int, int] | None = None  # CUDA compute capability (gpus.json); None: not known
    cublas_workspace: int | None = None
    calibration: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise TrainmemError(f"GPU {self.name!r}: memory must be positive")
        if self.context < 0:
            raise TrainmemError(f"GPU {self.name!r}: context memory must be zero or more")
        if self.context >= self.capacity:
            raise TrainmemError(f"GPU {self.name!r}: context memory ({self.context} B) leaves nothing of "
                                f"its {self.capacity} B")
        if self.cublas_workspace is not None and self.cublas_workspace < 0:
            raise TrainmemError(f"GPU {self.name!r}: the cuBLAS workspace must be zero or more")

    @property
    def handle_workspace(self) -> int:
        """One cuBLAS handle's workspace on this GPU: measured (a calibration profile), else
        PyTorch's default for its compute capability (``default_cublas_workspace``)."""
        if self.cublas_workspace is not None:
            return self.cublas_workspace
        return default_cublas_workspace(self.capability)

    def to_dict(self) -> dict[str, Any]:
        """The GPU's fields as a dict (JSON-ready: ``notes`` and ``capability`` lists)."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        d["capability"] = None if self.capability is None else list(self.capability)
        return d


@lru_cache(maxsize=1)
def catalogue() -> dict[str, dict[str, Any]]:
    """The GPU catalogue (``gpus.json``): name -> memory_mib, context_mib, label, speeds, aliases,
    gpus_per_node, internode_gbs. Read once; do not modify the returned dict."""
    text = resources.files("trainmem.spec").joinpath("gpus.json").read_text()
    return json.loads(text)["gpus"]


_catalogue = catalogue  # the former private name, kept for callers not yet moved to catalogue()

# words nvidia-smi, NVML, torch and rocm-smi put before the model name ("NVIDIA GeForce RTX 4090",
# "Tesla V100-SXM2-32GB", "AMD Instinct MI300X"); dropped when names are compared
_VENDOR_WORDS = ("nvidia", "tesla", "geforce", "amd", "instinct")


def gpu_names() -> list[str]:
    """The catalogue's GPU names."""
    return list(catalogue())


def normalize_gpu_name(name: str) -> str:
    """A GPU name in the form the catalogue compares: lower case, words joined by '-', the vendor
    words (NVIDIA, Tesla, GeForce, AMD, Instinct) dropped, a size written as ``80gb`` ("80 GB",
    "80G", "80GiB"). ``NVIDIA A100-SXM4-80GB`` -> ``a100-sxm4-80gb``; ``NVIDIA GeForce RTX 4090`` -> ``rtx-4090``."""
    s = re.sub(r"(?<![a-z0-9])(\d+)\s*-?\s*g(?:i?b)?\b", r"\1gb", str(name).strip().lower())
    words = [w for w in re.split(r"[^a-z0-9]+", s) if w]
    while words and words[0] in _VENDOR_WORDS:
        words.pop(0)
    return "-".join(words)


def gpu_aliases(key: str) -> list[str]:
    """Every other name catalogue GPU ``key`` answers to: its aliases, then its device names as
    nvidia-smi / NVML / rocm-smi print them."""
    v = catalogue()[key]
    return list(v.get("aliases", ())) + list(v.get("nvidia_smi", ()))


@lru_cache(maxsize=1)
def _name_index() -> dict[str, str]:
    """Normalized name (key, alias or device name; also without dashes) -> catalogue key."""
    index: dict[str, str] = {}
    for key in catalogue():
        for n in [key] + gpu_aliases(key):
            norm = normalize_gpu_name(n)
            for form in (norm, norm.replace("-", "")):
                if index.setdefault(form, key) != key:
                    raise TrainmemError(f"gpus.json: the name {n!r} belongs to {index[form]!r} and {key!r}")
    return index


def match_gpu(name: str) -> str | None:
    """The catalogue key that ``name`` names exactly (key, alias or nvidia-smi name, compared
    normalized), else None."""
    norm = normalize_gpu_name(name)
    index = _name_index()
    return index.get(norm) or index.get(norm.replace("-", ""))


def _lookup(name: str) -> tuple[str, dict[str, Any]]:
    """The catalogue key and entry of a GPU name. An exact name (key, alias, nvidia-smi name)
    wins; a name that begins several entries' names (``a100``: 40 and 80 GB, SXM and PCIe) is
    ambiguous and lists them; an unknown name gets the closest names."""
    cat = catalogue()
    key = match_gpu(name)
    if key is not None:
        return key, cat[key]
    norm = normalize_gpu_name(name)
    words = norm.split("-")
    family = [k for k in cat if norm and any(normalize_gpu_name(n).split("-")[:len(words)] == words
                                             for n in [k] + gpu_aliases(k))]
    if len(family) == 1:
        return family[0], cat[family[0]]
    if family:
        listed = ", ".join(f"{k} ({cat[k]['memory_mib'] / 1024:.0f} GiB)" for k in family)
        raise TrainmemError(f"GPU {name!r} is ambiguous: {listed}; name one of them (`trainmem gpus` lists all)")
    close = difflib.get_close_matches(norm, sorted(_name_index()), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(dict.fromkeys(_name_index()[c] for c in close))}? " if close else ""
    raise TrainmemError(f"unknown GPU {name!r}: {hint}see `trainmem gpus` for the catalogue, "
                        f"or give --gpu-memory SIZE (e.g. 40GiB)")


def _visible_handle(nvml: Any) -> Any:
    """NVML's handle of the device CUDA numbers 0: the first entry of CUDA_VISIBLE_DEVICES (an
    index or a GPU-UUID), else index 0. NVML numbers devices by PCI bus; CUDA does too when
    CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA C Programming Guide, "CUDA Environment Variables")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = "0" if visible is None else visible.split(",")[0].strip()
    if first.startswith("GPU-"):
        return nvml.nvmlDeviceGetHandleByUUID(first)
    if first.startswith("MIG-"):
        raise TrainmemError(f"--gpu auto: CUDA_VISIBLE_DEVICES={visible!r} selects a MIG instance, whose memory "
                            f"NVML does not give as a device's; give --gpu-memory SIZE")
    if not first.isdigit():
        raise TrainmemError(f"--gpu auto: CUDA_VISIBLE_DEVICES={visible!r} hides every GPU; unset it, or give "
                            f"--gpu NAME or --gpu-memory SIZE")
    count = int(nvml.nvmlDeviceGetCount())
    if int(first) >= count:
        raise TrainmemError(f"--gpu auto: NVML sees {count} GPU(s), none numbered {first}; give --gpu NAME or "
                            f"--gpu-memory SIZE")
    return nvml.nvmlDeviceGetHandleByIndex(int(first))


def detect_gpu() -> tuple[str, int]:
    """(device name, total memory in bytes) of the local GPU CUDA numbers 0, read through NVML
    (``pynvml`` from nvidia-ml-py: nvmlDeviceGetName, nvmlDeviceGetMemoryInfo(...).total, the
    figure nvidia-smi shows). One-line TrainmemError without NVML, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        raise TrainmemError("--gpu auto reads the GPU through NVML, which is not installed (pip install "
                            "nvidia-ml-py); give --gpu NAME or --gpu-memory SIZE") from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no NVIDIA driver here
        raise TrainmemError(f"--gpu auto: NVML did not start ({str(e) or type(e).__name__}): no NVIDIA GPU or "
                            f"driver here; give --gpu NAME or --gpu-memory SIZE") from None
    try:
        handle = _visible_handle(pynvml)
        name = pynvml.nvmlDeviceGetName(handle)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except TrainmemError:
        raise
    except Exception as e:
        raise TrainmemError(f"--gpu auto: NVML could not read the GPU ({str(e) or type(e).__name__}); give "
                            f"--gpu NAME or --gpu-memory SIZE") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return (name.decode() if isinstance(name, bytes) else str(name)), total


def _auto_gpu(memory: Any, context: int | None, notes: list[str]) -> Hardware:
    """``--gpu auto``: the local GPU (``detect_gpu``) with NVML's capacity; the catalogue entry
    its name matches gives the context and speeds, else a custom GPU (500 MiB context)."""
    device, total = detect_gpu()
    cap = total if memory is None else parse_bytes(memory, "--gpu-memory")
    key = match_gpu(device)
    if key is None:
        notes.append(f"--gpu auto: {device!r} is not in the GPU catalogue: using NVML's {total:,} B with "
                     f"a 500 MiB context and no speeds")
        return Hardware(normalize_gpu_name(device) or "auto", cap, 500 * MiB if context is None else context,
                        device, notes=tuple(notes))
    v = catalogue()[key]
    return Hardware(key, cap, v["context_mib"] * MiB if context is None else context, v["label"],
                    v["bandwidth_gbs"], v["bf16_tflops"], v["interconnect_gbs"], notes=tuple(notes),
                    capability=_capability(v))


def _capability(entry: dict[str, Any]) -> tuple[int, int] | None:
    """A catalogue entry's CUDA compute capability as a tuple (None where the catalogue has none)."""
    c = entry.get("capability")
    return (int(c[0]), int(c[1])) if c else None


def get_gpu(name: str | None = None, memory: str | int | None = None,
            context: str | int | None = None) -> Hardware:
    """A catalogue GPU by name (key, alias or nvidia-smi name; ``auto``: the local GPU through
    NVML), or a custom one from ``memory``. A size without a unit is read as GiB and says so in
    ``Hardware.notes`` (which reports carry as warnings). ``context`` overrides the memory taken
    before training starts (default: the catalogue's)."""
    if name is None and memory is None:
        raise TrainmemError("give a GPU name (--gpu) or its memory (--gpu-memory)")
    notes = [f"{flag} {value.strip()} has no unit: read as {value.strip()} GiB"
             for flag, value in (("--gpu-memory", memory), ("--context-memory", context)) if is_bare_number(value)]
    ctx = None if context is None else parse_bytes(context, "--context-memory")
    if name is not None and name.strip().lower() == "auto":
        return _auto_gpu(memory, ctx, notes)
    if name is not None:
        key, v = _lookup(name)
        cap = v["memory_mib"] * MiB if memory is None else parse_bytes(memory, "--gpu-memory")
        return Hardware(key, cap, v["context_mib"] * MiB if ctx is None else ctx, v["label"],
                        v["bandwidth_gbs"], v["bf16_tflops"], v["interconnect_gbs"], notes=tuple(notes),
                        capability=_capability(v))
    cap = parse_bytes(memory, "--gpu-memory")
    return Hardware("custom", cap, 500 * MiB if ctx is None else ctx, "custom GPU", notes=tuple(notes))


def catalogue_table() -> list[dict[str, Any]]:
    """Rows for `trainmem gpus`: name, label, exact capacity in bytes, context, specs, every other
    name it answers to (``aliases``: aliases, then nvidia-smi names) and the capacity's source."""
    rows = []
    for k, v in catalogue().items():
        rows.append({"name": k, "label": v["label"], "capacity_bytes": v["memory_mib"] * MiB,
                     "context_bytes": v["context_mib"] * MiB, "bandwidth_gbs": v["bandwidth_gbs"],
                     "bf16_tflops": v["bf16_tflops"], "interconnect_gbs": v["interconnect_gbs"],
                     "aliases": gpu_aliases(k), "source": v.get("source", "")})
    return rows
