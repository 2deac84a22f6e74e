"""Calibration profiles: this machine's memory outside PyTorch's tensors, measured by ``trainmem calibrate``.

A profile is a JSON file (``measure/calibrate.py`` writes it on a GPU) keyed by the GPU (device
name, total memory, compute capability) and the versions it was measured with (driver, CUDA,
torch, date). Of its ``values`` (bytes, or null with the reason in ``reasons``) two are used by
estimate, trace, fit, sweep, suggest and plan when the profile's GPU is the GPU chosen:

* ``context``: the CUDA context and what else the driver holds for the process beyond PyTorch's
  caching allocator, after a small training step (replaces the catalogue's ``context_mib``, so
  ``device_used`` changes);
* ``cublas_workspace``: one cuBLAS handle's workspace (replaces ``spec.hardware.CUBLAS_WORKSPACE``
  in the estimate and the capability default in trace).

This package is torch-free (estimate must not need torch). Bundled profiles are the ``*.json``
files of this folder (package data), consulted when ``--gpu`` names a catalogue GPU that has one
and no ``--calibration`` is given (their versions are not compared with this machine's: a bundled
profile is its GPU as measured). Shipped: the NVIDIA H200 (driver 580, CUDA 13.0, torch 2.11.0),
measured on 2026-11-24.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from functools import lru_cache
from importlib import metadata, resources
from typing import Any, Mapping, NamedTuple

from ...errors import TrainmemError
from ..hardware import Hardware, match_gpu, normalize_gpu_name

#: the format tag every profile carries (a reader refuses other major versions)
FORMAT = "trainmem-calibration/1"

#: the profile's keys that name the GPU and the versions it was measured with
KEY_FIELDS = ("gpu", "total_memory", "compute_capability", "driver", "cuda", "torch", "date")

#: the values trainmem uses, and what each replaces
USED_VALUES = {
    "context": "Hardware.context (the catalogue's context_mib): device_used = peak reserved + context",
    "cublas_workspace": "spec.hardware.CUBLAS_WORKSPACE (per cuBLAS handle; the estimate counts two handles)",
}

FIX = "write one with `trainmem calibrate --out FILE` on the GPU, or leave --calibration out"


class Match(NamedTuple):
    """Whether a profile is used for a GPU, and the notes that say why not or what differs."""

    used: bool
    notes: tuple[str, ...]


def load_profile(path: str | os.PathLike) -> dict[str, Any]:
    """The profile in the JSON file ``path``, checked (``check_profile``). An unreadable file or
    an invalid profile is one TrainmemError naming the file and the fix."""
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise TrainmemError(f"--calibration {where}: no such file; {FIX}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TrainmemError(f"--calibration {where}: cannot be read ({e.__class__.__name__}); {FIX}") from None
    except json.JSONDecodeError as e:
        raise TrainmemError(f"--calibration {where}: not JSON (line {e.lineno}: {e.msg}); {FIX}") from None
    return check_profile(data, where)


def check_profile(data: Any, where: str = "profile") -> dict[str, Any]:
    """``data`` when it is a calibration profile: the format tag, a GPU name, and ``values`` whose
    ``context`` and ``cublas_workspace`` are null or whole bytes (``context`` below the total
    memory). Else one TrainmemError naming ``where`` and the fix."""
    def bad(why: str) -> TrainmemError:
        return TrainmemError(f"--calibration {where}: {why}; {FIX}")
    if not isinstance(data, Mapping):
        raise bad("not a calibration profile (a JSON object is expected)")
    fmt = str(data.get("format", ""))
    if not fmt.startswith("trainmem-calibration/"):
        raise bad("not a calibration profile (no \"format\": \"trainmem-calibration/1\")")
    if fmt.split("/", 1)[1] != FORMAT.split("/", 1)[1]:
        raise bad(f"format {fmt!r} is not the {FORMAT!r} this trainmem reads")
    if not isinstance(data.get("gpu"), str) or not data["gpu"].strip():
        raise bad("no GPU name (\"gpu\")")
    values = data.get("values")
    if not isinstance(values, Mapping):
        raise bad("no \"values\" object")
    for k in USED_VALUES:
        v = values.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise bad(f"values.{k} must be null or a whole number of bytes >= 0, got {v!r}")
    total = data.get("total_memory")
    if isinstance(total, int) and isinstance(values.get("context"), int) and values["context"] >= total:
        raise bad(f"values.context ({values['context']} B) is not below the GPU's total memory ({total} B)")
    return dict(data)


def profile_gpu(profile: Mapping[str, Any]) -> str:
    """The catalogue key of the profile's GPU (matched by name, as ``--gpu`` is), else its name
    normalized (``spec.hardware.normalize_gpu_name``), which is how an uncatalogued ``--gpu auto``
    GPU is named."""
    name = str(profile["gpu"])
    return match_gpu(name) or normalize_gpu_name(name)


def local_versions() -> dict[str, str | None]:
    """The versions here that a profile records, read without importing torch or starting NVML:
    ``torch`` (the installed distribution's version), ``driver`` (``/proc/driver/nvidia/version``,
    the NVIDIA kernel module on Linux). None where not known (no torch, no NVIDIA driver)."""
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    driver = None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", f.read())
        driver = m.group(1) if m else None
    except OSError:
        pass
    return {"torch": torch_version, "driver": driver}


def matches(profile: Mapping[str, Any], hw: Hardware, source: str = "profile",
            here: Mapping[str, str | None] | None = None) -> Match:
    """Whether ``profile`` is for the GPU ``hw`` (the same catalogue GPU, or the same device name
    for a GPU outside the catalogue). A GPU that differs: not used, one note. Versions that differ
    from ``here`` (``local_versions()`` by default; only those known here are compared): used,
    one note naming them."""
    gpu = profile_gpu(profile)
    if gpu != hw.name:
        return Match(False, (f"calibration {source} is for {profile['gpu']} ({gpu}), not the GPU chosen "
                             f"({hw.name}): not used; give --gpu {gpu} or a profile measured on {hw.name}",))
    here = local_versions() if here is None else here
    differ = [f"{k} {profile.get(k)} (here {v})" for k, v in here.items()
              if v is not None and profile.get(k) is not None and str(profile.get(k)) != str(v)]
    if not differ:
        return Match(True, ())
    return Match(True, (f"calibration {source} was measured with {', '.join(differ)}: used; run "
                        f"`trainmem calibrate` with these versions for an exact profile",))


def apply(hw: Hardware, profile: Mapping[str, Any], source: str, keep_context: bool = False,
          notes: tuple[str, ...] = ()) -> Hardware:
    """``hw`` with the profile's measured ``context`` (unless ``keep_context``: --context-memory
    was given, and wins) and ``cublas_workspace``; null values leave the catalogue's figures."""
    values = profile["values"]
    context = hw.context if keep_context or values.get("context") is None else int(values["context"])
    ws = values.get("cublas_workspace")
    return dataclasses.replace(hw, context=context, cublas_workspace=hw.cublas_workspace if ws is None else int(ws),
                               calibration=source, notes=hw.notes + tuple(notes))


@lru_cache(maxsize=1)
def bundled() -> tuple[tuple[str, dict[str, Any]], ...]:
    """The profiles shipped in this folder as (file name, profile), read once. A shipped file
    that is not a valid profile is a packaging error and raises."""
    out = []
    for f in sorted(resources.files(__name__).iterdir(), key=lambda f: f.name):
        if f.name.endswith(".json"):
            out.append((f.name, check_profile(json.loads(f.read_text(encoding="utf-8")), f"(bundled) {f.name}")))
    return tuple(out)


def bundled_for(hw: Hardware) -> tuple[str, dict[str, Any]] | None:
    """The bundled profile for ``hw``'s GPU: of those whose GPU matches, the one measured with
    the torch installed here, else the most recent (``date``); None when none matches."""
    mine = [(n, p) for n, p in bundled() if profile_gpu(p) == hw.name]
    if not mine:
        return None
    torch_here = local_versions()["torch"]
    same = [x for x in mine if torch_here is not None and x[1].get("torch") == torch_here]
    return max(same or mine, key=lambda x: str(x[1].get("date", "")))


def calibrated(hw: Hardware | None, calibration: Any = None, context_given: bool = False) -> Hardware | None:
    """The GPU with a calibration applied: ``calibration`` (a profile file path or a loaded
    profile) when given, else a bundled profile of ``hw``'s GPU. A profile for another GPU is not
    used and says so in ``hw.notes``; one measured with other versions is used, with a note.
    ``calibration`` without a GPU is a TrainmemError."""
    if calibration is None:
        found = bundled_for(hw) if hw is not None else None
        if found is None:
            return hw
        source, profile = f"(bundled) {found[0]}", found[1]
    else:
        if isinstance(calibration, Mapping):
            source, profile = "(given)", check_profile(calibration, "(given)")
        elif not isinstance(calibration, (str, os.PathLike)):
            raise TrainmemError(f"calibration= must be a profile file path or a loaded profile, got "
                                f"{type(calibration).__name__}")
        else:
            source, profile = os.fspath(calibration), load_profile(calibration)
        if hw is None:
            raise TrainmemError(f"--calibration needs a GPU: give --gpu {profile_gpu(profile)} (the profile's GPU)")
    # a bundled profile describes its GPU as measured, whatever torch this machine has (often a CPU
    # build that is not the machine being planned for): its versions are not compared here
    m = matches(profile, hw, source, here={} if calibration is None else None)
    if not m.used:
        return dataclasses.replace(hw, notes=hw.notes + m.notes)
    return apply(hw, profile, source, keep_context=context_given, notes=m.notes)
