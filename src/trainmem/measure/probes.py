"""Where the numbers of a measured run come from: one *probe* per device, and the phase recorder.

A probe answers the same questions on every device: ``allocated()`` (bytes of live tensors now),
``reserved()`` (the caching allocator's segments; None on the CPU), ``peak()`` (the highest
allocated since the last ``reset_peak()``), ``peak_reserved()``, ``driver()`` (the driver's view
of the device, CUDA only) and ``live()`` (the live storages, where the probe knows them).

* :class:`CpuProbe` — real tensors on the CPU, counted by :class:`~trainmem.measure.live.LiveBytes`
  (the CPU has no allocator statistics of its own). ``limit`` makes an allocation beyond it raise
  ``torch.OutOfMemoryError``, as the CUDA allocator does.
* :class:`CudaProbe` — the CUDA caching allocator's own statistics (``torch.cuda.memory_allocated``,
  ``memory_reserved``, ``max_memory_allocated``, ``reset_peak_memory_stats``), the driver's figure
  from NVML (``pynvml``, package nvidia-ml-py) or, without it, from ``cudaMemGetInfo``
  (``torch.cuda.mem_get_info``), and ``limit`` through ``torch.cuda.set_per_process_memory_fraction``.

:class:`PhaseRecorder` turns the end of each phase of the training step (``workload.TrainStep``'s
``on_phase`` callback) into a :class:`~trainmem.report.Phase`, resets the peak, and keeps what it
needs to split the peak into components (gradients and optimizer states alive at the peak,
bracketed by post-accumulate-grad hooks to within one gradient tensor).
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..errors import TrainmemError
from ..report import Phase
from .live import LiveBytes

MiB = 2**20


# ----- CPU --------------------------------------------------------------------------------------------
class CpuProbe:
    """Real CPU tensors, counted by LiveBytes (see its docstring for what it sees)."""

    kind = "cpu"

    def __init__(self, limit: int | None = None, watch_resize: bool = False) -> None:
        self.limit = limit
        self.lb = LiveBytes(device="cpu", limit=limit, watch_resize=watch_resize)
        self.notes: list[str] = []
        self.device = torch.device("cpu")

    def __enter__(self) -> "CpuProbe":
        gc.collect()
        self.lb.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lb.__exit__(*exc)

    def allocated(self) -> int:
        return self.lb.current

    def reserved(self) -> int | None:
        return None

    def peak(self) -> int:
        return self.lb.peak_since_mark

    def peak_reserved(self) -> int | None:
        return None

    def peak_where(self) -> str:
        return self.lb.peak_op

    def reset_peak(self) -> None:
        self.lb.reset_peak()

    def driver(self) -> dict[str, Any] | None:
        return None

    def set_tag(self, tag: str) -> None:
        self.lb.tag = tag

    def live(self) -> list[dict[str, Any]] | None:
        return self.lb.live()

    def alive_at_peak(self, t: torch.Tensor) -> bool | None:
        """Whether ``t`` (alive now) was already allocated when the phase's peak was reached."""
        i = self.lb.allocation_index(getattr(t, "_local_tensor", t))
        return None if i is None else i <= self.lb.peak_seq

    def sync(self) -> None:
        pass

    def empty_cache(self) -> None:
        gc.collect()

    def stats(self) -> dict[str, Any]:
        return {"allocations": self.lb.allocations, "limit": self.limit}


# ----- NVML ---------------------------------------------------------------------------------------------
NVML_MISSING = ("NVML not available (the module pynvml is not installed: pip install nvidia-ml-py): the "
                "driver's figure comes from cudaMemGetInfo (torch.cuda.mem_get_info), which counts every "
                "process on the GPU, and the CUDA context cannot be told apart from other processes' memory")


def _norm_uuid(u: Any) -> str:
    if isinstance(u, bytes):
        u = u.decode()
    u = str(u).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            u = u[len(prefix):]
    return u


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class Nvml:
    """The driver's view of one GPU through NVML (what ``nvidia-smi`` shows).

    ``open(cuda_index)`` finds the NVML device of a CUDA index *before* CUDA is initialised, so
    that the memory used before this process touched the GPU can be read (``baseline``): the
    NVML index is the CUDA index mapped through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs).
    ``verify(uuid)`` checks the guess against the UUID CUDA reports once initialised (CUDA's
    default FASTEST_FIRST order can differ from NVML's PCI order) and switches to the right device,
    forgetting the baseline, when it was wrong. ``module`` replaces ``import pynvml`` (tests).
    """

    def __init__(self, nv: Any, handle: Any) -> None:
        self.nv = nv
        self.handle = handle
        self.baseline: int | None = None

    @classmethod
    def open(cls, cuda_index: int, module: Any = None) -> tuple["Nvml | None", str]:
        nv = module
        if nv is None:
            try:
                import pynvml as nv  # nvidia-ml-py
            except ImportError:
                return None, NVML_MISSING
        try:
            nv.nvmlInit()
        except Exception as e:  # NVMLError: no driver, no permission, ...
            return None, f"NVML could not be initialised ({e}); driver figures come from cudaMemGetInfo"
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            entry: str | None = None
            if visible is not None:
                items = [x.strip() for x in visible.split(",") if x.strip()]
                entry = items[cuda_index] if cuda_index < len(items) else None
            if entry is None:
                handle = nv.nvmlDeviceGetHandleByIndex(cuda_index)
            elif entry.isdigit():
                handle = nv.nvmlDeviceGetHandleByIndex(int(entry))
            elif entry.upper().startswith("MIG-"):
                return None, ("CUDA_VISIBLE_DEVICES names a MIG instance: NVML memory figures are per physical "
                              "GPU, so none are recorded; driver figures come from cudaMemGetInfo")
            else:
                handle = cls._by_uuid(nv, entry)
        except Exception as e:
            return None, f"NVML has no device for CUDA index {cuda_index} ({e}); driver figures come from cudaMemGetInfo"
        return cls(nv, handle), ""

    @staticmethod
    def _by_uuid(nv: Any, uuid: str) -> Any:
        u = uuid if uuid.upper().startswith(("GPU-", "MIG-")) else "GPU-" + uuid
        try:
            return nv.nvmlDeviceGetHandleByUUID(u)
        except TypeError:  # old bindings want bytes
            return nv.nvmlDeviceGetHandleByUUID(u.encode())

    def uuid(self) -> str:
        return _norm_uuid(self.nv.nvmlDeviceGetUUID(self.handle))

    def verify(self, cuda_uuid: str | None) -> str:
        """Make sure the handle is CUDA's device; returns a note when it had to be corrected."""
        if not cuda_uuid:
            return ""
        want = _norm_uuid(cuda_uuid)
        try:
            if self.uuid() == want:
                return ""
            self.handle = self._by_uuid(self.nv, want)
        except Exception as e:
            return f"could not match the NVML device to CUDA's ({e})"
        self.baseline = None
        return ("the NVML device guessed before CUDA started was not CUDA's (device order); the baseline "
                "before this process is unknown")

    def device_used(self) -> int:
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)

    def total(self) -> int:
        return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).total)

    def process_used(self, pid: int | None = None) -> int | None:
        """This process's memory on the device as the driver accounts it (None where NVML does not
        say: containers with their own PID namespace, Windows WDDM, ...)."""
        pid = os.getpid() if pid is None else pid
        try:
            procs = self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return None
        for p in procs:
            if getattr(p, "pid", None) == pid:
                used = getattr(p, "usedGpuMemory", None)
                return None if used is None else int(used)
        return None

    def driver_version(self) -> str | None:
        try:
            return _text(self.nv.nvmlSystemGetDriverVersion())
        except Exception:
            return None

    def name(self) -> str | None:
        try:
            return _text(self.nv.nvmlDeviceGetName(self.handle))
        except Exception:
            return None

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


# ----- CUDA ---------------------------------------------------------------------------------------------
def parse_device(text: str) -> tuple[str, int]:
    """``cpu``, ``cuda`` or ``cuda:N`` -> (kind, index)."""
    t = str(text).strip().lower()
    if t == "cpu":
        return "cpu", 0
    if t == "cuda":
        return "cuda", 0
    if t.startswith("cuda:") and t[5:].isdigit():
        return "cuda", int(t[5:])
    raise TrainmemError(f"--device {text!r}: use cpu, cuda or cuda:N")


def cuda_unavailable_reason() -> str | None:
    """None when torch can use a CUDA device, else why not (one line)."""
    if not torch.cuda.is_available():
        built = torch.version.cuda
        if built is None:
            return (f"--device cuda: this torch ({torch.__version__}) is built without CUDA; install a CUDA build "
                    f"of torch, or measure on the CPU with --device cpu")
        return (f"--device cuda: torch {torch.__version__} (CUDA {built}) sees no CUDA device (driver missing, "
                f"CUDA_VISIBLE_DEVICES empty?); measure on the CPU with --device cpu")
    return None


class CudaProbe:
    """The CUDA caching allocator's statistics for one device, plus the driver's figure.

    Entering: NVML's baseline (before this process initialises CUDA, where NVML is there), CUDA
    initialisation on ``index``, ``gc.collect()`` + ``torch.cuda.empty_cache()``, the memory limit
    (``torch.cuda.set_per_process_memory_fraction``: the allocator raises ``OutOfMemoryError``
    when its reserved memory would pass it), memory history recording for snapshots, and
    ``reset_peak_memory_stats``. Leaving undoes the limit and the history recording.
    """

    kind = "cuda"

    def __init__(self, index: int = 0, limit: int | None = None, record_history: bool = False,
                 history_entries: int = 100_000, nvml_module: Any = None) -> None:
        self.index = index
        self.limit = limit
        self.record_history = record_history
        self.history_entries = history_entries
        self.nvml_module = nvml_module
        self.nvml: Nvml | None = None
        self.notes: list[str] = []
        self.device = torch.device("cuda", index)
        self.start_allocated = 0
        self.total = 0
        self._fraction_set = False

    def __enter__(self) -> "CudaProbe":
        why = cuda_unavailable_reason()
        if why:
            raise TrainmemError(why)
        n = torch.cuda.device_count()
        if self.index >= n:
            raise TrainmemError(f"--device cuda:{self.index}: only {n} CUDA device(s) visible")
        self.nvml, note = Nvml.open(self.index, self.nvml_module)
        if note:
            self.notes.append(note)
        if self.nvml is not None:
            try:
                self.nvml.baseline = self.nvml.device_used()  # before this process's CUDA context, if not yet made
            except Exception as e:
                self.notes.append(f"NVML memory query failed ({e})")
                self.nvml = None
        already = torch.cuda.is_initialized()
        torch.cuda.set_device(self.index)
        props = torch.cuda.get_device_properties(self.index)
        if self.nvml is not None:
            if already:
                self.nvml.baseline = None  # this process had a context already: the baseline includes it
            note = self.nvml.verify(str(getattr(props, "uuid", "") or ""))
            if note:
                self.notes.append(note)
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.total = int(torch.cuda.mem_get_info(self.device)[1])
        if self.limit is not None:
            frac = self.limit / self.total
            if frac > 1:
                self.notes.append(f"--memory-limit {self.limit} B exceeds the device's {self.total} B: no limit set")
            else:
                torch.cuda.set_per_process_memory_fraction(frac, self.device)
                self._fraction_set = True
        if self.record_history:
            torch.cuda.memory._record_memory_history(max_entries=self.history_entries, device=self.device)
        self.start_allocated = int(torch.cuda.memory_allocated(self.device))
        if self.start_allocated:
            self.notes.append(f"{self.start_allocated} B were already allocated on the device before the model "
                              "was built (tensors of this process from before): they are included in every figure")
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.record_history:
            try:
                torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            except Exception:
                pass
        if self._fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self._fraction_set = False
        if self.nvml is not None:
            self.nvml.close()

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def reserved(self) -> int | None:
        return int(torch.cuda.memory_reserved(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def peak_reserved(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.device))

    def peak_where(self) -> str:
        return ""

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()

    def set_tag(self, tag: str) -> None:
        pass

    def live(self) -> list[dict[str, Any]] | None:
        return None

    def driver(self) -> dict[str, Any] | None:
        """The driver's view now: ``used`` (whole device, as nvidia-smi), ``process`` (this process,
        NVML only), ``baseline`` (device memory used before this process started CUDA, NVML only)."""
        if self.nvml is not None:
            try:
                return {"used": self.nvml.device_used(), "process": self.nvml.process_used(),
                        "baseline": self.nvml.baseline, "source": "nvml"}
            except Exception as e:
                self.notes.append(f"NVML query failed mid-run ({e}); switching to cudaMemGetInfo")
                self.nvml = None
        free, total = torch.cuda.mem_get_info(self.device)
        return {"used": int(total - free), "process": None, "baseline": None, "source": "cudaMemGetInfo"}

    def stats(self) -> dict[str, Any]:
        s = torch.cuda.memory_stats(self.device)
        return {k: s.get(k) for k in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
                if k in s} | {"limit": self.limit, "total": self.total}


def context_bytes(reserved: int | None, driver: dict[str, Any] | None) -> int | None:
    """The CUDA context (and whatever else the driver counts for this process beyond the caching
    allocator): driver − reserved. Uses this process's figure where NVML gives it, else the
    device's minus the baseline before this process, else the device's (other processes included)."""
    if reserved is None or driver is None:
        return None
    if driver.get("process") is not None:
        return int(driver["process"]) - reserved
    if driver.get("baseline") is not None:
        return int(driver["used"]) - int(driver["baseline"]) - reserved
    return int(driver["used"]) - reserved


# ----- phases ---------------------------------------------------------------------------------------------
@dataclass
class PhaseRecord:
    """Everything recorded at the end of one phase (``phase`` is the report's view of it)."""

    phase: Phase
    peak_reserved: int | None
    driver: dict[str, Any] | None
    gradients_at_peak: int
    states_at_peak: int
    inputs: int

    @property
    def context(self) -> int | None:
        return context_bytes(self.phase.reserved, self.driver)

    def to_dict(self) -> dict[str, Any]:
        d = self.phase.to_dict()
        d["peak_reserved"] = self.peak_reserved
        if self.driver is not None:
            d["driver_used"] = self.driver.get("used")
            d["process_used"] = self.driver.get("process")
            d["driver_source"] = self.driver.get("source")
            d["cuda_context"] = self.context
        d["gradients_at_peak"] = self.gradients_at_peak
        d["optimizer_states_at_peak"] = self.states_at_peak
        return d


def tensor_bytes(tensors: Iterable[Any], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages of ``tensors`` (on ``device`` when given); a ``DTensor``
    counts its local shard (``_local_tensor``), the memory this rank holds."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        if device is not None and t.device.type != device.type:
            continue
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += s.nbytes()
    return total


def optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    if optimizer is None:
        return
    for st in getattr(optimizer, "state", {}).values():
        if isinstance(st, dict):
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    yield v


class PhaseRecorder:
    """Phase bookkeeping of a measured run, for any probe.

    ``mark(name, step, micro)`` is called at the end of each phase (model_loaded at step 0, then
    forward, backward, optimizer_step, zero_grad per step; with gradient accumulation forward and
    backward once per micro-batch, named ``forward.micro1`` ...). ``in_progress`` names the phase
    running now (where an out-of-memory error happened). ``watch(params, optimizer, inputs)``
    installs post-accumulate-grad hooks that note the gradients and optimizer states alive when the
    peak rises, so the peak can be split into components.
    """

    def __init__(self, probe: Any, grad_accum: int = 1, empty_cache: bool = False) -> None:
        self.probe = probe
        self.grad_accum = grad_accum
        self.empty_cache = empty_cache
        self.records: list[PhaseRecord] = []
        self.current: tuple[str, int, int | None] = ("model_loaded", 0, None)
        self.params: list[torch.Tensor] = []
        self.optimizer: Any = None
        self.inputs: Callable[[], int] = lambda: 0
        self._handles: list[Any] = []
        self._seen = 0
        self._grads_at_peak = 0
        self._states_at_peak = 0
        probe.set_tag(self.in_progress)

    # ----- names -----------------------------------------------------------------------------------
    def label(self, name: str, micro: int | None) -> str:
        if self.grad_accum > 1 and micro is not None and name in ("forward", "backward"):
            return f"{name}.micro{micro + 1}"
        return name

    @property
    def in_progress(self) -> str:
        name, step, micro = self.current
        return f"{self.label(name, micro)}@{step}"

    def next_phase(self, name: str, step: int, micro: int | None) -> tuple[str, int, int | None]:
        if name == "model_loaded":
            return ("forward", 1, 0)
        if name == "forward":
            return ("backward", step, micro)
        if name == "backward":
            m = (micro or 0) + 1
            return ("forward", step, m) if m < self.grad_accum else ("optimizer_step", step, None)
        if name == "optimizer_step":
            return ("zero_grad", step, None)
        return ("forward", step + 1, 0)

    # ----- hooks -----------------------------------------------------------------------------------
    def watch(self, params: list[torch.Tensor], optimizer: Any = None,
              inputs: Callable[[], int] | None = None) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        if inputs is not None:
            self.inputs = inputs
        for p in self.params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def unwatch(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def grad_bytes(self) -> int:
        return tensor_bytes(p.grad for p in self.params if p.grad is not None)

    def state_bytes(self) -> int:
        return tensor_bytes(optimizer_tensors(self.optimizer))

    def _on_grad(self, p: torch.Tensor) -> None:
        pk = self.probe.peak()
        if pk > self._seen:  # the peak rose since the last look: it happened after the previous gradient
            self._seen = pk
            grads = self.grad_bytes()
            if p.grad is not None:
                # every other gradient alive now was there at the previous look, so at the peak; this one
                # is exact where the probe knows allocation order (CPU), else: the peak came before it
                # when memory has come down since (one gradient tensor of uncertainty)
                alive = getattr(self.probe, "alive_at_peak", lambda t: None)(p.grad)
                if alive is None:
                    alive = pk <= self.probe.allocated()
                if not alive:
                    grads -= tensor_bytes([p.grad])
            self._grads_at_peak = grads
            self._states_at_peak = self.state_bytes()

    # ----- marks -----------------------------------------------------------------------------------
    def mark(self, name: str, step: int, micro: int | None = None) -> PhaseRecord:
        probe = self.probe
        probe.sync()
        allocated = probe.allocated()
        peak = max(probe.peak(), allocated)
        grads, states = self.grad_bytes(), self.state_bytes()
        if peak > self._seen:  # the peak came after the last gradient hook of the phase
            self._grads_at_peak, self._states_at_peak = grads, states
        rec = PhaseRecord(Phase(self.label(name, micro), step, allocated, peak, probe.reserved(), probe.peak_where()),
                          probe.peak_reserved(), probe.driver(), self._grads_at_peak, self._states_at_peak,
                          self.inputs())
        self.records.append(rec)
        if self.empty_cache:
            probe.empty_cache()
        probe.reset_peak()
        self._seen = probe.peak()
        self._grads_at_peak, self._states_at_peak = grads, states
        self.current = self.next_phase(name, step, micro)
        probe.set_tag(self.in_progress)
        return rec

    @property
    def phases(self) -> list[Phase]:
        return [r.phase for r in self.records]

    def peak_record(self) -> PhaseRecord | None:
        """The first phase reaching the highest peak."""
        best: PhaseRecord | None = None
        for r in self.records:
            if best is None or r.phase.peak > best.phase.peak:
                best = r
        return best
