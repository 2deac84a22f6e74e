"""Allocation tracker: watch a real training step run on tensors that hold no data.

A :class:`Tracker` is a ``TorchDispatchMode``. Every ATen operation that runs while it is active —
in the forward, inside autograd's backward, in the optimizer — passes through it; each output whose
storage it has not seen before is an *allocation* of ``storage.nbytes()`` bytes, handed to an
allocator simulation (:mod:`trainmem.allocator`). A ``weakref.finalize`` on the storage
object reports the *free* at the moment the last tensor using it dies, exactly when PyTorch would
give the block back. Views, in-place ops and ``detach`` share storages and so cost nothing.

Each storage gets a record: its category (parameter, buffer, input, activation saved for backward,
temporary, gradient, optimizer state, workspace, logits), the module and op that allocated it, the
phase (model_loaded, forward, backward, optimizer_step, zero_grad) and the step. Categories are
refined as the step proceeds: a backward temporary that autograd stores in ``param.grad`` becomes
a gradient (post-accumulate-grad hook), tensors kept by ``optimizer.state`` become optimizer states
(global optimizer step hook), forward tensors packed by autograd become activations (saved-tensor
hooks) and the root module's returned logits become logits.

Module attribution uses global forward pre/post hooks in the forward and, in the backward, the
sequence number of the autograd node being executed (``torch._C._current_autograd_node``), mapped
back to the module that was running when the node was created.

The tracker itself holds no tensor: it keys live storages by ``id`` and forgets them when they die.
"""
from __future__ import annotations

import bisect
import re
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..allocator import CachingAllocator, ExactAllocator
from . import cuda_kernels
from .routing_values import RoutingValues

#: cuBLAS workspace per handle (spec.hardware: 8,519,680 B, 32 MiB on sm90 exactly)
from ..spec.hardware import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_SM90  # noqa: F401  (re-exported)

_aten = torch.ops.aten

#: ops that run a cuBLAS GEMM/GEMV/dot and therefore bind the thread's cuBLAS handle + workspace
MATMUL_OPS = frozenset(
    getattr(_aten, name).default for name in (
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "dot", "vdot",
        "_addmm_activation",
    ) if hasattr(_aten, name) and "default" in getattr(_aten, name).overloads()
)

#: factory ops through which optimizers create their state (zeros_like, empty_like, clone, ...)
def _overloads(*names: str) -> frozenset:
    out = set()
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            out.add(getattr(packet, ov))
    return frozenset(out)


#: factory ops through which optimizers create their state (zeros_like, empty_like, clone, ...)
_STATE_FACTORY = _overloads("zeros_like", "empty_like", "ones_like", "full_like", "zeros", "empty", "full",
                            "clone", "_to_copy", "scalar_tensor", "lift_fresh_copy", "copy", "empty_strided")

_HOST_COPIES = frozenset({_aten._to_copy.default, _aten.copy_.default})


def _is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (``torch._subclasses.FakeTensor``: no data), e.g. a host buffer made
    under ``Tracker.fake_host``."""
    return isinstance(t, FakeTensor)


def _wrapper_types() -> tuple[type, ...]:
    """Tensor subclasses whose storage is their local tensor's (DTensor), where torch.distributed exists."""
    try:
        from torch.distributed.tensor import DTensor
    except (ImportError, AttributeError):
        return ()
    return (DTensor,)


_WRAPPERS = _wrapper_types()


def local(t: Any) -> Any:
    """The tensor holding the storage of ``t``: a DTensor's local shard, else ``t``."""
    return t._local_tensor if _WRAPPERS and isinstance(t, _WRAPPERS) else t

PHASES = ("model_loaded", "forward", "backward", "optimizer_step", "zero_grad")


class DataDependentSize(RuntimeError):
    """An op whose sizes come from a tensor's values, which a trace without data does not have
    (``Tracker._sized_by_data``)."""


@dataclass
class Record:
    """One storage (one allocator block) and what the tracker knows about it."""

    rid: int
    handle: int | None
    nbytes: int
    block: int
    category: str
    label: str
    module: str
    op: str
    phase: str
    step: int
    alloc_event: int
    free_event: int | None = None
    dtype: str = ""
    shape: tuple[int, ...] = ()
    saved: bool = False
    # the forward's last op that took this storage as an input (``Tracker.reads``): the count of
    # events (``ev_rec``) logged once that op's outputs were made; -1: no forward op read it
    last_read: int = -1


@dataclass
class PhaseMark:
    """A closed phase: allocated at its end, highest allocated within it, reserved at its end."""

    name: str
    step: int
    allocated: int
    peak: int
    reserved: int
    where: str = ""
    start_event: int = 0
    end_event: int = 0


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)  # str() only when needed: it is slow
    return name[:-8] if name.endswith(".default") else name


_LAYER_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def module_pattern(name: str) -> str:
    """``bert.encoder.layer.3.output`` -> ``bert.encoder.layer.*.output`` (layers folded together)."""
    return _LAYER_INDEX.sub(".*", name)


class Tracker(TorchDispatchMode):
    """Feed every storage allocation and free of a running program into an allocator simulation.

    ``device_type`` is the device whose tensors count (``"meta"`` when emulating CUDA, ``"cpu"``
    under a CPU FakeTensorMode). ``cublas_workspace`` > 0 allocates a cuBLAS workspace at the first
    matmul of the forward thread and of the autograd backward thread, as CUDA does.
    """

    def __init__(self, allocator: CachingAllocator | ExactAllocator, *, device_type: str,
                 cublas_workspace: int = 0, emulate_cuda_kernels: bool = False) -> None:
        super().__init__()
        self.allocator = allocator
        self.device_type = device_type
        self.cublas_workspace = cublas_workspace
        self.emulate_cuda_kernels = emulate_cuda_kernels
        self.records: list[Record] = []
        self.live: dict[int, Record] = {}          # id(untyped storage) -> record
        self.recorded: set[int] = set()            # storages whose free waits for the default stream
        # event log: record id (>= 0 allocation, ~rid free) and allocator state after the event
        self.ev_rec: list[int] = []
        self.ev_alloc: list[int] = []
        self.ev_reserved: list[int] = []
        self.peak = 0
        self.peak_event = -1
        self.peak_context = ""
        self.phase = "model_loaded"
        self.step = 0
        self.phase_start = 0
        self.phase_peak = 0
        self.phase_peak_where = ""
        self.phase_marks: list[PhaseMark] = []
        self.module_stack: list[str] = []
        self.module_names: dict[int, str] = {}
        self.param_names: dict[int, str] = {}
        self._seq_starts: list[int] = []
        self._seq_names: list[str] = []
        self._labels: list[str] = []
        self._workspaces: dict[str, int | None] = {}
        self._closed = False
        self._pending_inputs = True
        self.warnings: list[str] = []
        self.ops_seen = 0
        self.data_dependent = 0
        self.value_read = ""  # the last host read of an integer tensor's values (``note_value_read``)
        self._scalar_producer: dict[int, str] = {}
        self.routing = RoutingValues(device_type)  # values a MoE router's choice decides (routing_values)
        self._scopes: list[tuple[str, str]] = []
        self._paused = False      # ops pass through uncounted (trace --compile: fused kernels' insides)
        self._adopt: tuple[Any, torch.Tensor, int] | None = None  # (op, result, donor storage key)
        self._cpp_inplace = 0     # inside a C++ kernel whose add runs in place on CUDA (math SDPA)
        self._suspended = False   # module hooks ignored too (trace --compile: tracing the graph)
        self.fake_host: Any = None  # a FakeTensorMode for device-to-host copies (``CudaEmulation.fake_host``)
        self.graph_module: str | None = None  # the module a compiled graph's node came from
        self.reads = False        # note each forward op's inputs (``Record.last_read``, ``_note_reads``)

    # ----- modes -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _WRAPPERS and any(issubclass(t, _WRAPPERS) for t in types):
            # a DTensor op (FSDP2's sharded parameters, their gradients and optimizer states): let the
            # subclass run it, so that the ops on its local tensors come back here to be counted
            # (as torch/distributed/_tools/fsdp2_mem_tracker.py ``FSDPMemTracker.__torch_dispatch__``)
            return NotImplemented
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and self._is_tracked_tensor(args[0]) \
                and (self._suspended or not self._paused):
            # data-dependent Python control flow on a tensor that holds no data (also while a
            # --compile graph is captured, which specializes on the answer, as dynamo does). Answer
            # as a clean batch would: all(...) is True and any(...) is False (no padding, no packed
            # sequences, no inf/nan), other booleans False, numbers 1 (a step counter, a loss). A
            # ``torch._check_tensor_all`` (``_is_all_true``: torch/__init__.py ``_check_tensor_all_with``,
            # transformers' ``torch_compilable_check``, e.g. a VLM's image-token count) holds, as on a
            # batch the model accepts.
            t = args[0]
            v = self.routing.value(t)
            if v is not None:  # (a value the router's choice decides: ``routing_values``)
                return v.item()
            self.data_dependent += 1
            if t.dtype == torch.bool:
                return self._scalar_producer.get(self._scalar_key(t)) in ("all", "_is_all_true")
            return 1.0 if t.is_floating_point() else 1
        if self._paused:
            out = func(*args, **kwargs)
            if self._suspended:
                self._note_scalar(func, out)
            return out
        self.ops_seen += 1
        self._settle()
        if self.phase != "backward" and torch._C._current_graph_task_id() != -1:
            self.enter_phase("backward")
        if self.emulate_cuda_kernels and func in _HOST_COPIES:
            host = self._host_copy(func, args, kwargs)
            if host is not None:
                return host
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            out = self.routing.sized(func, args, kwargs)
            if out is None:
                raise self._sized_by_data(func, e) from None
        else:
            self.routing.after(func, args, kwargs, out)
        donor = self._donor(func, args, kwargs, out) if self.emulate_cuda_kernels else None
        if donor is not None:
            self._adopt = (func, out, id(donor.untyped_storage()))
        else:
            self._register_outputs(func, out)
        if self.reads and self.phase == "forward":
            self._note_reads(args, kwargs)
        self._note_scalar(func, out)
        if self.cublas_workspace and func in MATMUL_OPS:
            self._cublas(func)
        if self.emulate_cuda_kernels:
            self._kernel_scratch(func, args, out)
        return out

    def _note_reads(self, args: tuple, kwargs: dict) -> None:
        """Mark each live storage among an op's tensor inputs (a view's: its base's) as read by it, at the
        event count after its outputs were made (``Record.last_read``): where a tensor's last consumer in
        the forward has run. Under non-reentrant checkpointing a layer's first forward saves nothing
        (torch 2.13 ``utils/checkpoint.py`` ``_checkpoint_hook`` L1153: its ``pack_hook`` returns a
        ``_Holder``, L811), so a tensor lives until its last consumer, not to the backward
        (``trace.derive._layer_sequence``'s "uK" events, ``estimate.reserved.layer_forward._sequence_forward``)."""
        at = len(self.ev_rec)
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                rec = self.live.get(id(local(t).untyped_storage()))
            except (RuntimeError, NotImplementedError):
                continue
            if rec is not None:
                rec.last_read = at

    def _sized_by_data(self, func: Any, e: Exception) -> Exception:
        """An op that failed because a size comes from a tensor's values, which tensors without data do not
        have, as one line naming the op and the module; any other failure as it was. ``nonzero`` (and
        ``torch.where(mask)``, ``masked_select``) sizes its output by the count of true entries: its meta
        kernel raises (torch/_meta_registrations.py ``nonzero``). A size read back to the host
        (``.tolist()``: ``trace.cuda.CudaEmulation._host_read`` answers zeros) that then fails a shape check:
        JetMoE's expert sizes (transformers 5.24 ``models/jetmoe/modeling_jetmoe.py`` L192-195
        ``expert_size = gates.long().sum(0).tolist()``, then ``inputs.split(expert_size)``, L152). The
        per-expert MoE loops (DBRX's, JetMoE's, LongCat-Flash's) get their sizes from a balanced routing
        (``routing_values``, tried first); this is the line for a size no router's choice decides."""
        name = _op_name(func)
        where = self._current_module() or "the model"
        if name.split(".")[0] in ("nonzero", "nonzero_static", "masked_select", "nonzero_numpy") and \
                isinstance(e, NotImplementedError):
            return DataDependentSize(f"{name.split('.')[0]} in {where}: its size is a count of a tensor's values, "
                                     f"which the trace has no data for (no router's top-k decides it)")
        if self.value_read and name.split(".")[0] in ("split_with_sizes", "split"):
            return DataDependentSize(f"{name.split('.')[0]} in {where}: sizes from a tensor's "
                                     f"{self.value_read}, zeros without data (no router's top-k decides them)")
        return e

    def note_value_read(self, what: str) -> None:
        """Remember that the program read the values of a non-scalar device integer tensor to the host (its
        ``.tolist()``, answered with zeros): what and where (``_sized_by_data``)."""
        self.value_read = what

    def _note_scalar(self, func: Any, out: Any) -> None:
        """Remember which op made a device bool scalar (``all``, ``any``...), for its host read."""
        if isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.dim() == 0 \
                and out.device.type == self.device_type:
            if len(self._scalar_producer) > 64:
                self._scalar_producer.clear()
            self._scalar_producer[self._scalar_key(out)] = _op_name(func).split(".")[0]

    def asserted(self, t: torch.Tensor) -> bool:
        """Whether device bool scalar ``t`` is a ``torch._check_tensor_all``'s condition (``_is_all_true``:
        torch/__init__.py ``_check_tensor_all_with``, as transformers' ``torch_compilable_check`` calls it),
        which reads True: the check holds on a batch the model accepts (a VLM's image-token count)."""
        return t.dtype == torch.bool and self._scalar_producer.get(self._scalar_key(t)) == "_is_all_true"

    @staticmethod
    def _scalar_key(t: torch.Tensor) -> int:
        """A scalar's identity: its storage (a fake tensor's, while a graph is captured)."""
        try:
            return id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return id(t)

    def _host_copy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A device-to-host copy (e.g. the gradient of ``cpu_tensor.cuda()``): zeros on the host. A copy
        into a device tensor from a host tensor without data (``fake_host``: ZeRO-Offload's updated half
        partition, ``stage_1_and_2.py`` v0.19.8 L3094-3096) writes the device tensor in place: nothing is
        allocated (run by the fake tensor's dispatch it would stand the device tensor's whole storage
        in for it, a new one)."""
        src = args[0] if func is _aten._to_copy.default else args[1]
        if func is _aten.copy_.default and self._is_tracked_tensor(args[0]) and _is_fake(src):
            return args[0]
        if not self._is_tracked_tensor(src):
            return None
        if func is _aten._to_copy.default:
            dev = kwargs.get("device")
            if dev is None or torch.device(dev).type != "cpu":
                return None
            v = self.routing.value(src)
            if v is not None:
                return v.to(dtype=kwargs.get("dtype") or src.dtype)
            self.data_dependent += 1
            if self.fake_host is not None:  # a host buffer made without data (``CudaEmulation.fake_host``)
                with self.fake_host:
                    return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype, device="cpu")
            return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype, device="cpu")
        dst = args[0]
        if isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
            self.data_dependent += 1
            return dst
        return None

    def _is_tracked_tensor(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device_type

    # ----- allocation / free ---------------------------------------------------------------------
    def _register_outputs(self, func: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self._register(func, out)
        elif isinstance(out, (tuple, list)):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._register(func, t)

    def _register(self, func: Any, t: torch.Tensor, category: str | None = None, label: str | None = None,
                  module: str | None = None, op: str | None = None, handle: Any = False) -> Record | None:
        """Record ``t``'s storage as a new block (``handle``: the block it takes over instead of
        allocating one, see :meth:`_take_over`)."""
        t = local(t)
        if t.device.type != self.device_type or t.is_sparse or t.layout != torch.strided:
            return None
        if getattr(t, "is_paged", False):
            # bitsandbytes' paged tensors (``F.get_paged``: cudaMallocManaged, marked ``is_paged``) live
            # in unified memory, outside the caching allocator (emulated: trainmem.bnb.paged_zeros)
            return None
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        key = id(st)
        rec = self.live.get(key)
        nbytes = st.nbytes()
        if rec is not None:
            if nbytes == rec.nbytes:
                return rec
            # resize_ grew the storage: its old block is freed and a new one allocated
            self._on_free(key, rec.rid)
        if category is None and self._scopes:
            category, label = self._scopes[-1]
        if category is None:
            category, label2 = self._category_for(func)
            if label is None and label2:
                label = label2
        if label is None:
            label = self._labels[-1] if self._labels else ""
        if module is None:
            module = self._current_module()
        if handle is False:
            handle = self.allocator.allocate(nbytes)
        if op is None:
            op = _op_name(func) if func is not None else ""
        rec = Record(len(self.records), handle, nbytes, self.allocator.block_size(handle), category,
                     label, module, op, self.phase, self.step,
                     len(self.ev_rec), dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape))
        self.records.append(rec)
        self.live[key] = rec
        weakref.finalize(st, self._on_free, key, rec.rid)
        self._log(rec.rid)
        return rec

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run the block without counting its outputs (``trace.compiled``: an intermediate inside a
        fused kernel, which never takes device memory)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    @contextmanager
    def tracing(self) -> Iterator[None]:
        """Capture a graph on fake tensors (``trace.compiled``): no op counted, no module hook."""
        was = self._paused, self._suspended
        self._paused = self._suspended = True
        try:
            yield
        finally:
            self._paused, self._suspended = was

    def record_stream(self, tensor: Any, stream: Any) -> None:
        """``tensor.record_stream(stream)``: when ``stream`` is the default stream and the tensor's
        block was allocated on another, its free waits until the GPU has run the default stream past
        it (``CachingAllocator.free_pending``, released by ``torch.cuda.Event.synchronize`` or
        ``torch.cuda.synchronize``: ``cuda._event_class``). A use recorded on a side stream is not
        modelled (freed at once): no wait of the code bounds when such a stream's work completes.
        FSDP1 records its gathered flat parameter on the default stream before freeing it
        (``fsdp/_flat_param.py`` ``_free_unsharded_flat_param``)."""
        if self._closed or getattr(stream, "stream_id", None) != 0:
            return
        self._settle()
        try:
            key = id(tensor.untyped_storage())
        except (RuntimeError, NotImplementedError):
            return
        rec = self.live.get(key)
        if rec is not None and self.allocator.block_stream(rec.handle) != 0:
            self.recorded.add(key)

    def _free_block(self, rec: Record, pending: bool = False) -> None:
        if pending:
            self.allocator.free_pending(rec.handle)
        else:
            self.allocator.free(rec.handle)
        rec.handle = None

    def _on_free(self, key: int, rid: int) -> None:
        if self._closed:
            return
        rec = self.live.get(key)
        if rec is None or rec.rid != rid:
            return
        if self._adopt is not None and self._settle(key):
            return
        del self.live[key]
        pending = key in self.recorded
        self.recorded.discard(key)
        self._free_block(rec, pending)
        rec.free_event = len(self.ev_rec)
        self._log(~rid)

    # ----- CUDA's in-place paths (trace.cuda_kernels) ----------------------------------------------
    def _donor(self, func: Any, args: tuple, kwargs: dict, out: Any) -> torch.Tensor | None:
        """The input whose block ``out`` takes over on CUDA if that input dies at once: the ``add``
        of the math SDPA kernel's mask (:meth:`cpp_inplace`, ``trace.cuda_kernels``)."""
        if not self._cpp_inplace or func not in cuda_kernels.SUBCLASS_FUNCTIONAL:
            return None
        a = cuda_kernels.adoptable(func, args, kwargs, out)
        if a is None or id(a.untyped_storage()) not in self.live:
            return None
        return a

    def _settle(self, freed: int | None = None) -> bool:
        """Decide a pending adoption (:meth:`_donor`): when the next event is the free of the donor
        (storage key ``freed``), nothing else held it, which is when CUDA's code runs the in-place
        variant: the result takes over the donor's block (True: that free is consumed). Anything
        else first allocates the result, as the out-of-place op did."""
        if self._adopt is None:
            return False
        func, out, key = self._adopt
        self._adopt = None
        if freed == key:
            self._take_over(func, out, key)
            return True
        self._register_outputs(func, out)
        return False

    def _take_over(self, func: Any, out: torch.Tensor, key: int) -> None:
        """``out`` takes over the block of the dying donor (storage key ``key``): the donor's
        record ends and ``out``'s begins, the allocator untouched. Logged as the donor's free and
        ``out``'s allocation; between the two, the timeline shows the block as free, so that its
        breakdown by category always adds up to the allocated bytes."""
        donor = self.live.pop(key)
        self.recorded.discard(key)
        handle, donor.handle = donor.handle, None
        donor.free_event = len(self.ev_rec)
        self._log(~donor.rid)
        self.ev_alloc[-1] -= donor.block
        self._register(func, out, category=donor.category, label=donor.label, handle=handle)

    @contextmanager
    def cpp_inplace(self) -> Iterator[None]:
        """Ops run inside are a C++ kernel that adds in place on a plain CUDA tensor and out of
        place here (``_scaled_dot_product_attention_math``: ``attn.add_(*attn_mask)``)."""
        self._cpp_inplace += 1
        try:
            yield
        finally:
            self._cpp_inplace -= 1

    def _log(self, code: int) -> None:
        a = self.allocator
        self.ev_rec.append(code)
        self.ev_alloc.append(a.allocated)
        self.ev_reserved.append(a.reserved)
        if code >= 0:
            if a.allocated > self.phase_peak:
                self.phase_peak = a.allocated
                self.phase_peak_where = self._where(self.records[code])
            if a.allocated > self.peak:
                self.peak = a.allocated
                self.peak_event = len(self.ev_rec) - 1
                self.peak_context = self.phase_peak_where

    def _where(self, rec: Record) -> str:
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        parts = [rec.module or "<top level>"]
        if node is not None:
            parts.append(f"({node.name()})")
        parts.append(rec.op)
        if rec.label:
            parts.append(f"[{rec.label}]")
        return " ".join(parts)

    def allocate_extra(self, nbytes: int, category: str, label: str, op: str = "") -> int:
        """Allocate memory that no tensor stands for (workspaces, kernel scratch); returns a rid."""
        self._settle()
        handle = self.allocator.allocate(nbytes)
        rec = Record(len(self.records), handle, nbytes, self.allocator.block_size(handle), category, label,
                     self._current_module(), op, self.phase, self.step, len(self.ev_rec))
        self.records.append(rec)
        self._log(rec.rid)
        return rec.rid

    def free_extra(self, rid: int) -> None:
        rec = self.records[rid]
        if rec.handle is None and rec.free_event is not None:
            return
        self._free_block(rec)
        rec.free_event = len(self.ev_rec)
        self._log(~rid)

    def _cublas(self, func: Any) -> None:
        thread = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if thread not in self._workspaces:
            self._workspaces[thread] = self.allocate_extra(
                self.cublas_workspace, "workspace", f"cublas_{thread}", _op_name(func))

    def _kernel_scratch(self, func: Any, args: tuple, out: Any) -> None:
        """Scratch memory that CUDA kernels allocate inside an op (freed before the op returns)."""
        sizes: list[int] = []
        name = _op_name(func)
        if name == "_scaled_dot_product_flash_attention_backward":
            # flash_api.cpp mha_bwd: seqlen rounded to 128, head_dim to 32 (<= 128) or 64
            q = args[1]
            b, h, t, d = q.shape
            t_r = -(-t // 128) * 128
            m = 32 if d <= 128 else 64
            d_r = -(-d // m) * m
            sizes += [b * h * t_r * 4,            # softmax_d (fp32)
                      b * t_r * h * d_r * 4]      # dq_accum (fp32)
            k = args[2]
            if k.shape[1] != h:                   # GQA: dk, dv expanded to all query heads
                sizes += [2 * b * k.shape[2] * h * d * k.element_size()]
        elif name == "_scaled_dot_product_efficient_attention_backward":
            q = args[1]
            b, h, t, d = q.shape
            sizes += [b * h * t * 4]              # delta (fp32)
        elif name == "_scaled_dot_product_cudnn_attention_backward":
            # cudnn-frontend SDPA backward: the fp32 dQ accumulator (b, h, s_q, d_qk); the engine's
            # own workspace (get_workspace_size) is not known from source
            q = args[1]
            b, h, t, d = q.shape
            sizes += [b * h * t * d * 4]
        if sizes:
            rids = [self.allocate_extra(n, "temporaries", "kernel_scratch", name) for n in sizes]
            for r in rids:
                self.free_extra(r)

    # ----- categories ----------------------------------------------------------------------------
    def _category_for(self, func: Any) -> tuple[str, str]:
        ph = self.phase
        if ph == "model_loaded":
            return "temporaries", ""
        if ph == "step_start" or (ph == "forward" and self._pending_inputs and not self.module_stack):
            return "inputs", ""
        if ph == "forward":
            return "activations", ""
        if ph == "backward":
            if self.module_stack:  # activation checkpointing: the forward runs again inside backward
                return "activations", "recomputed"
            return "temporaries", ""
        if ph == "optimizer_step":
            if func in _STATE_FACTORY:
                return "optimizer_states", ""
            return "temporaries", ""
        return "temporaries", ""

    def reclassify(self, t: torch.Tensor, category: str, label: str = "") -> None:
        """Give the storage of ``t`` a category (e.g. when it becomes a gradient)."""
        self._settle()
        t = local(t)
        if not self._is_tracked_tensor(t):
            return
        rec = self.live.get(id(t.untyped_storage()))
        if rec is not None:
            rec.category = category
            rec.label = label

    def register_existing(self, t: torch.Tensor, category: str, label: str, module: str) -> None:
        """Count a tensor created outside the tracker (e.g. a parameter moved to the device)."""
        self._settle()
        self._register(None, t, category=category, label=label, module=module, op="to(device)")

    @contextmanager
    def scope(self, category: str, label: str) -> Iterator[None]:
        """Give the storages allocated inside the block this category and label (a wrapper's
        communication buffers: FSDP's all-gather and reduce-scatter, DDP's buckets)."""
        self._scopes.append((category, label))
        try:
            yield
        finally:
            self._scopes.pop()

    def resized(self, st: Any) -> None:
        """``UntypedStorage.resize_`` changed a storage's size in place (FSDP frees an unsharded
        parameter with ``resize_(0)`` and brings it back with ``resize_(n)``, which no dispatch mode
        sees): its old block is freed and, when it has bytes again, a new one allocated."""
        if self._closed or st.device.type != self.device_type:
            return
        self._settle()
        key = id(st)
        rec = self.live.get(key)
        nbytes = st.nbytes()
        if rec is not None:
            if rec.nbytes == nbytes:
                return
            self._on_free(key, rec.rid)
        if nbytes == 0:
            return
        category, label = self._scopes[-1] if self._scopes else self._category_for(None)
        label = label or (rec.label if rec is not None else "")
        handle = self.allocator.allocate(nbytes)
        new = Record(len(self.records), handle, nbytes, self.allocator.block_size(handle),
                     rec.category if (rec is not None and not self._scopes) else category, label,
                     self._current_module(), "resize_", self.phase, self.step, len(self.ev_rec),
                     dtype=rec.dtype if rec is not None else "", shape=rec.shape if rec is not None else ())
        self.records.append(new)
        self.live[key] = new
        weakref.finalize(st, self._on_free, key, new.rid)
        self._log(new.rid)

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Label the allocations made inside the block (e.g. ``autocast_weight_cache``)."""
        self._labels.append(name)
        try:
            yield
        finally:
            self._labels.pop()

    # ----- phases --------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._close_phase()
        self.step = step
        self.phase = "step_start"
        self._pending_inputs = True
        self._open_phase()

    def end_step(self) -> None:
        self._close_phase()
        self.phase = "between_steps"
        self._open_phase()

    def enter_phase(self, name: str) -> None:
        if name == self.phase:
            return
        carry = self.phase == "step_start"
        if self.phase == "forward" and name == "backward":
            self.end_of_forward_cleanup()
        peak, where = self.phase_peak, self.phase_peak_where
        self._close_phase()
        self.phase = name
        self._open_phase()
        if carry and peak > self.phase_peak:
            # allocations before the first forward (the batch) belong to the forward phase
            self.phase_peak, self.phase_peak_where = peak, where

    def _open_phase(self) -> None:
        self.phase_start = len(self.ev_rec)
        self.phase_peak = self.allocator.allocated
        self.phase_peak_where = ""

    def _close_phase(self) -> None:
        self._settle()
        if self.phase in PHASES:
            a = self.allocator
            self.phase_marks.append(PhaseMark(self.phase, self.step, a.allocated, max(self.phase_peak, a.allocated),
                                              a.reserved, self.phase_peak_where, self.phase_start, len(self.ev_rec)))

    def finish(self) -> None:
        """Stop listening to frees (objects dying after the trace must not count)."""
        self._close_phase()
        self.phase = "done"
        self._closed = True

    # ----- module attribution --------------------------------------------------------------------
    def name_modules(self, root: torch.nn.Module) -> None:
        for name, mod in root.named_modules(remove_duplicate=False):
            self.module_names.setdefault(id(mod), name)
        for name, p in root.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(p), name)

    def _current_module(self) -> str:
        if self.graph_module is not None:
            return self.graph_module
        if self.module_stack:
            return self.module_stack[-1]
        node = torch._C._current_autograd_node() if self.phase == "backward" else None
        if node is None:
            return ""
        seq = node._sequence_nr()
        if seq >= (1 << 63) or node.name().endswith("AccumulateGrad"):
            var = getattr(node, "variable", None)
            pname = self.param_names.get(id(var), "") if var is not None else ""
            return pname.rsplit(".", 1)[0] if pname else ""
        i = bisect.bisect_right(self._seq_starts, seq) - 1
        return self._seq_names[i] if i >= 0 else ""

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._suspended:
            return
        name = self.module_names.get(id(module))
        if name is None:
            # a module the model does not register, called inside one it does (transformers'
            # ``ACT2FN[activation](out)`` in Qwen3.5's ``torch_causal_conv1d_fn``, modeling_qwen3_5.py
            # L251): named under its caller, so its tensors stay the enclosing layer's
            name = type(module).__name__
            name = f"{self.module_stack[-1]}.{name}" if self.module_stack and self.module_stack[-1] else name
        if not self.module_stack:
            if torch._C._current_graph_task_id() == -1 and self.phase in (
                    "step_start", "backward", "optimizer_step", "zero_grad", "between_steps"):
                self.enter_phase("forward")
            self._pending_inputs = False
        self.module_stack.append(name)
        self._seq_starts.append(torch._C._autograd._get_sequence_nr())
        self._seq_names.append(name)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._suspended:
            return
        if self.module_stack:
            self.module_stack.pop()
        self._seq_starts.append(torch._C._autograd._get_sequence_nr())
        self._seq_names.append(self.module_stack[-1] if self.module_stack else "")
        # the outermost module's output is the logits, except a pipeline stage's before the last
        # (hidden states: wrappers.PipelineStageModule.returns_logits)
        if not self.module_stack and self.phase == "forward" and getattr(module, "returns_logits", True):
            self._mark_logits(output)

    def _mark_logits(self, output: Any) -> None:
        cand: list[torch.Tensor] = []
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            cand = [logits]
        elif isinstance(output, torch.Tensor):
            cand = [output] if output.dim() >= 2 else []
        elif isinstance(output, (tuple, list)):
            cand = [t for t in output if isinstance(t, torch.Tensor) and t.dim() >= 2][:1]
        for t in cand:
            t = local(t)
            if self._is_tracked_tensor(t):
                rec = self.live.get(id(t.untyped_storage()))
                if rec is not None and rec.category == "activations":
                    rec.category = "logits"

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Mark the storage of a tensor autograd saves as saved (an activation), and keep what autograd
        keeps without hooks: a leaf itself, anything else detached. ``SavedVariable``'s constructor
        (torch/csrc/autograd/saved_variable.cpp, "if (!is_output || is_leaf_) { saved_original_ = true;
        data_ = variable; }") keeps a leaf's own TensorImpl, so ``param.data = ...`` after the save
        releases the old storage: DeepSpeed ZeRO-3 frees a gathered parameter that way while its
        ``LinearFunctionForZeroStage3`` holds the parameter for backward (``free_param``,
        partition_parameters.py; ``setup_context`` saves ``weight``, zero/linear.py). A detached alias
        would pin the gathered storage until backward. Non-leaves stay detached: an output returned
        by the hook itself would make a reference cycle through its grad_fn, which autograd avoids
        by saving outputs without it."""
        if self._is_tracked_tensor(t) and not (_WRAPPERS and isinstance(t, _WRAPPERS)):
            rec = self.live.get(id(t.untyped_storage()))
            if rec is not None:
                rec.saved = True
        return t if t.is_leaf else t.detach()

    @contextmanager
    def hooks(self, optimizers: Iterable[Any] = ()) -> Iterator[None]:
        """Install the global module/optimizer/autograd hooks for the duration of the block."""
        from torch.nn.modules import module as _module
        from torch.optim import optimizer as _optim

        handles = [
            _module.register_module_forward_pre_hook(self._pre_forward),
            _module.register_module_forward_hook(self._post_forward, always_call=True),
            _optim.register_optimizer_step_pre_hook(self._opt_pre),
            _optim.register_optimizer_step_post_hook(self._opt_post),
        ]
        orig_backward = torch.autograd.backward
        orig_grad = torch.autograd.grad
        orig_resize = torch.UntypedStorage.resize_
        orig_opt_zero = torch.optim.Optimizer.zero_grad
        orig_mod_zero = torch.nn.Module.zero_grad
        tracker = self

        def backward(*a: Any, **k: Any) -> Any:
            if torch._C._current_graph_task_id() == -1 and not tracker._suspended:
                tracker.enter_phase("backward")
            return orig_backward(*a, **k)

        def grad(*a: Any, **k: Any) -> Any:
            if torch._C._current_graph_task_id() == -1 and not tracker._suspended:
                tracker.enter_phase("backward")
            return orig_grad(*a, **k)

        def opt_zero(self_: Any, *a: Any, **k: Any) -> Any:
            if torch._C._current_graph_task_id() == -1:
                tracker.enter_phase("zero_grad")
            return orig_opt_zero(self_, *a, **k)

        def mod_zero(self_: Any, *a: Any, **k: Any) -> Any:
            if torch._C._current_graph_task_id() == -1:
                tracker.enter_phase("zero_grad")
            return orig_mod_zero(self_, *a, **k)

        def resize_(st: Any, size: int) -> Any:
            out = orig_resize(st, size)
            tracker.resized(st)
            return out

        torch.autograd.backward = backward
        torch.autograd.grad = grad
        torch.UntypedStorage.resize_ = resize_  # as fsdp2_mem_tracker's MemTracker._track_resize
        torch.optim.Optimizer.zero_grad = opt_zero
        torch.nn.Module.zero_grad = mod_zero
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            torch.autograd.backward = orig_backward
            torch.autograd.grad = orig_grad
            torch.UntypedStorage.resize_ = orig_resize
            torch.optim.Optimizer.zero_grad = orig_opt_zero
            torch.nn.Module.zero_grad = orig_mod_zero
            for h in handles:
                h.remove()

    def watch_parameters(self, params: Iterable[torch.Tensor]) -> list[Any]:
        """Post-accumulate-grad hooks that mark each parameter's ``.grad`` storage as a gradient."""
        handles = []
        for p in params:
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return handles

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.reclassify(p.grad, "gradients", "")

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        if torch._C._current_graph_task_id() == -1:
            self.enter_phase("optimizer_step")

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.mark_optimizer_state(opt)

    def mark_optimizer_state(self, opt: Any) -> None:
        for state in getattr(opt, "state", {}).values():
            if not isinstance(state, dict):
                continue
            for key, val in state.items():
                if isinstance(val, torch.Tensor):
                    self.reclassify(val, "optimizer_states", str(key))

    def mark_gradients(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if p.grad is not None:
                self.reclassify(p.grad, "gradients", "")

    def end_of_forward_cleanup(self) -> None:
        """Forward tensors still alive but not saved by autograd are temporaries (or inputs/logits)."""
        self._settle()
        for rec in self.live.values():
            if rec.category == "activations" and not rec.saved and rec.phase == "forward" \
                    and rec.step == self.step and rec.label != "autocast_weight_cache":
                rec.category = "temporaries"

    # ----- results -------------------------------------------------------------------------------
    def live_at(self, event: int) -> list[Record]:
        """Records whose block was allocated at ``event`` (inclusive)."""
        return [r for r in self.records
                if r.alloc_event <= event and (r.free_event is None or r.free_event > event)]

    def timeline(self, max_points: int = 4000) -> list[list[Any]]:
        """[event index, allocated, reserved, {category: bytes}] after each event (downsampled;
        reserved is None for byte-exact host accounting)."""
        exact = isinstance(self.allocator, ExactAllocator)
        n = len(self.ev_rec)
        if n == 0:
            return []
        cats: dict[str, int] = defaultdict(int)
        keep = set(range(n)) if n <= max_points else self._downsample(max_points)
        out = []
        for i, code in enumerate(self.ev_rec):
            rec = self.records[code if code >= 0 else ~code]
            if code >= 0:
                cats[rec.category] += rec.block
            else:
                cats[rec.category] -= rec.block
            if i in keep:
                out.append([i, self.ev_alloc[i], None if exact else self.ev_reserved[i],
                            {k: v for k, v in cats.items() if v}])
        return out

    def _downsample(self, max_points: int) -> set[int]:
        n = len(self.ev_rec)
        width = -(-n // max_points)
        keep = {0, n - 1, max(self.peak_event, 0)}
        for start in range(0, n, width):
            seg = range(start, min(n, start + width))
            keep.add(max(seg, key=lambda i: self.ev_alloc[i]))
            keep.add(min(seg, key=lambda i: self.ev_alloc[i]))
        for m in self.phase_marks:
            keep.add(max(0, m.end_event - 1))
        return keep
