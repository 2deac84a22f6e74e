"""Hardware: one GPU's capacity (exact bytes) and the memory taken before training starts."""
from __future__ import annotations

import json
from dataclasses import dataclass, asdict
from functools import lru_cache
from importlib import resources
from typing import Any

from ..errors import TrainmemError
from ..units import MiB, parse_bytes


# cuBLAS workspace per handle with PyTorch's default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"
# (two 4 MiB and eight 16 KiB chunks = 8,519,680 B; aten/src/ATen/cuda/CublasHandlePool.cpp). One
# handle per thread that runs matmuls: the forward thread and autograd's backward thread (Edward Rees,
# "Transformer Memory Arithmetic: Understanding all the Bytes in nanoGPT", https://erees.dev/transformer-memory/).
CUBLAS_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class Hardware:
    """A GPU. ``capacity`` is total device memory in bytes as NVML reports it; ``context`` the
    bytes taken before the first tensor (CUDA context, driver, other processes)."""

    name: str
    capacity: int
    context: int
    label: str = ""
    bandwidth_gbs: float = 0.0
    bf16_tflops: float = 0.0
    interconnect_gbs: float = 0.0

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise TrainmemError(f"GPU {self.name!r}: memory must be positive")
        if self.context < 0:
            raise TrainmemError(f"GPU {self.name!r}: context memory must be zero or more")
        if self.context >= self.capacity:
            raise TrainmemError(f"GPU {self.name!r}: context memory ({self.context} B) leaves nothing of "
                                f"its {self.capacity} B")

    def to_dict(self) -> dict[str, Any]:
        """The GPU's fields as a dict (JSON-ready)."""
        return asdict(self)


@lru_cache(maxsize=1)
def catalogue() -> dict[str, dict[str, Any]]:
    """The GPU catalogue (``gpus.json``): name -> memory_mib, context_mib, label, speeds, aliases,
    gpus_per_node, internode_gbs. Read once; do not modify the returned dict."""
    text = resources.files("trainmem.spec").joinpath("gpus.json").read_text()
    return json.loads(text)["gpus"]


_catalogue = catalogue  # the former private name, kept for callers not yet moved to catalogue()


def gpu_names() -> list[str]:
    """The catalogue's GPU names."""
    return list(catalogue())


def _lookup(name: str) -> tuple[str, dict[str, Any]]:
    """The catalogue key and entry of a GPU name or alias (case-insensitive; '_' and ' ' read as '-')."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    cat = catalogue()
    if key in cat:
        return key, cat[key]
    for k, v in cat.items():
        if key in v.get("aliases", ()):
            return k, v
    raise TrainmemError(f"unknown GPU {name!r}: see `trainmem gpus` for the catalogue, "
                        f"or give --gpu-memory SIZE (e.g. 40GiB)")


def get_gpu(name: str | None = None, memory: str | int | None = None,
            context: str | int | None = None) -> Hardware:
    """A catalogue GPU by name (aliases accepted), or a custom one from ``memory``.

    ``context`` overrides the memory taken before training starts (default: the catalogue's).
    """
    if name is None and memory is None:
        raise TrainmemError("give a GPU name (--gpu) or its memory (--gpu-memory)")
    ctx = None if context is None else parse_bytes(context)
    if name is not None:
        key, v = _lookup(name)
        cap = v["memory_mib"] * MiB if memory is None else parse_bytes(memory)
        return Hardware(key, cap, v["context_mib"] * MiB if ctx is None else ctx, v["label"],
                        v["bandwidth_gbs"], v["bf16_tflops"], v["interconnect_gbs"])
    cap = parse_bytes(memory)
    return Hardware("custom", cap, 500 * MiB if ctx is None else ctx, "custom GPU")


def catalogue_table() -> list[dict[str, Any]]:
    """Rows for `trainmem gpus`: name, label, exact capacity in bytes, context, specs."""
    rows = []
    for k, v in catalogue().items():
        rows.append({"name": k, "label": v["label"], "capacity_bytes": v["memory_mib"] * MiB,
                     "context_bytes": v["context_mib"] * MiB, "bandwidth_gbs": v["bandwidth_gbs"],
                     "bf16_tflops": v["bf16_tflops"], "interconnect_gbs": v["interconnect_gbs"],
                     "aliases": v.get("aliases", [])})
    return rows
