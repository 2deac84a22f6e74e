"""Two ways frameworks keep fewer activations on the GPU, as code the workload runs.

* ``OpCheckpointPolicy``: torchtitan's per-op selective activation checkpointing (``mode =
  "selective"``, ``selective_ac_option = "op"``), torchtitan v0.2.2: each transformer block runs
  under ``torch.utils.checkpoint.checkpoint`` with ``context_fn`` =
  ``create_selective_checkpoint_contexts(policy)`` (torchtitan/distributed/activation_checkpoint.py
  L52-137, ``_apply_op_sac``), whose policy saves the outputs of the ops in ``_op_sac_save_list``
  (torchtitan/models/llama3/infra/parallelize.py L36-51) except every second ``aten.mm`` of the
  block, and recomputes every other op. ``checkpoint_kwargs`` gives what ``ptd_checkpoint_wrapper``
  passes to ``checkpoint`` there (non-reentrant, ``early_stop`` False: ActivationCheckpoint's default,
  torchtitan/config/job_config.py L651-675).
* ``OffloadActivations``: torchtune's activation offloading (torchtune v0.6.1
  torchtune/training/_activation_offloading.py L24-353): a ``saved_tensors_hooks`` pair that copies
  every saved tensor of at least ``min_offload_size`` bytes that is not an ``nn.Parameter`` or
  ``nn.Buffer`` to pinned CPU memory in forward and back to the GPU in backward, with its stream
  bookkeeping: in forward the GPU tensor is kept (``fwd_stash``) until ``max_fwd_stash_size`` more
  tensors were packed or backward starts; in backward a tensor brought back stays (``bwd_tensor_stash``)
  until the next autograd node that brings one back has run, or, when something else took a
  reference to it, as long as that reference lives (``record_stream``). torchtune applies it with
  activation checkpointing only (recipes/full_finetune_distributed.py L205-213), so what leaves the
  GPU is mostly the checkpointed layers' inputs (torch 2.13 torch/utils/checkpoint.py L842-847,
  ``_CheckpointFrame.save_inputs``, saves them outside the checkpoint's own hooks), and it exempts the output head (``get_act_offloading_ctx_manager``,
  L393-418; here: the hooks are entered around the base model only, not the head or the loss).

Under trace's CUDA emulation (``trace/cuda.py``: device tensors on ``meta``, streams and events no-ops)
the CPU copy is only the tensor's shape, stride and dtype: its bytes leave the tracker's device
accounting when the GPU tensor dies, and bringing it back allocates a new device tensor, as
``.to("cuda")`` does. On a real device the copies are real.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from torch.autograd.graph import saved_tensors_hooks

#: the device type that stands for the GPU under trace's emulation (trace/cuda.py EMULATED)
_EMULATED = "meta"


def _op(root: Any, path: str) -> Any:
    """``root.path`` where this PyTorch build has it, else None."""
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def op_save_list() -> frozenset:
    """torchtitan v0.2.2 ``_op_sac_save_list`` (parallelize.py L36-51), the ops this build has."""
    names = ("aten.mm.default", "aten._scaled_dot_product_efficient_attention.default",
             "aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_cudnn_attention.default",
             "aten._scaled_dot_product_attention_math.default",
             "aten._scaled_dot_product_fused_attention_overrideable.default",
             "_c10d_functional.reduce_scatter_tensor.default", "aten.max.default",
             "torch_attn._varlen_attn.default")
    ops = {_op(torch.ops, n) for n in names}
    ops |= {_op(torch._higher_order_ops, n) for n in ("flex_attention", "inductor_compiled_code")}
    return frozenset(o for o in ops if o is not None)


class OpCheckpointPolicy:
    """torchtitan's per-op policy (activation_checkpoint.py L98-128), one fresh counter per
    checkpointed call (``context_fn``, L126-128). ``force_recompute_shapes``: the ``(in, out)`` weight
    shapes of ``per_op_sac_force_recompute_mm_shapes_by_fqns`` (default ``["moe.router.gate"]``, an FQN
    of torchtitan's own MoE; no module of a transformers model has it, so none are forced here).
    ``decisions`` counts (op name, "save" or "recompute", "forward" or "recompute") over the run."""

    def __init__(self, force_recompute_shapes: frozenset = frozenset()) -> None:
        self.save_list = op_save_list()
        self.force = force_recompute_shapes
        self.decisions: dict[tuple[str, str, str], int] = defaultdict(int)

    def context_fn(self) -> tuple[Any, Any]:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        meta: dict[str, int] = defaultdict(int)
        return create_selective_checkpoint_contexts(self._policy(meta))

    def _policy(self, meta: dict[str, int]) -> Callable[..., Any]:
        from torch.utils.checkpoint import CheckpointPolicy
        mm, to_copy = torch.ops.aten.mm.default, torch.ops.aten._to_copy.default

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            mode = "recompute" if ctx.is_recompute else "forward"
            save = False
            if func == to_copy and "cuda" in str(args[0].device) and str(kwargs.get("device")) == "cpu":
                save = True  # device-to-host copies are never recomputed
            elif func == mm and tuple(args[1].shape) in self.force:
                save = False
            else:
                if func == mm:
                    meta[f"{mode}_mm_count"] += 1
                save = func in self.save_list and not (func == mm and meta[f"{mode}_mm_count"] % 2 == 0)
            self.decisions[(str(func), "save" if save else "recompute", mode)] += 1
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
        return policy

    def checkpoint_kwargs(self) -> dict[str, Any]:
        """What torchtitan's ``ptd_checkpoint_wrapper`` hands ``torch.utils.checkpoint.checkpoint``."""
        return {"use_reentrant": False, "context_fn": self.context_fn, "early_stop": False,
                "preserve_rng_state": True}

    def saved(self, op: str, mode: str = "forward") -> int:
        """How many outputs of ``op`` (e.g. ``"aten.mm.default"``) the policy saved in ``mode``."""
        return self.decisions.get((op, "save", mode), 0)


class _Host:
    """The CPU copy of an emulated device tensor: its layout only (the data does not exist)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype, self.device = tuple(t.shape), t.stride(), t.dtype, t.device


def _to_host(t: torch.Tensor, pin: bool) -> Any:
    if t.device.type == _EMULATED:
        return _Host(t)
    host = torch.empty_like(t, pin_memory=pin, device="cpu")
    host.copy_(t, non_blocking=True)
    return host


def _to_device(h: Any) -> torch.Tensor:
    if isinstance(h, _Host):
        return torch.empty_strided(h.shape, h.stride, dtype=h.dtype, device=h.device)
    return h.to("cuda", non_blocking=True)


class OffloadActivations(saved_tensors_hooks):
    """torchtune v0.6.1 ``OffloadActivations`` with ``use_streams=True`` (its default), the memory
    behaviour of L133-346: see the module docstring. ``min_offload_size`` (1024 B) and
    ``max_fwd_stash_size`` (5) are torchtune's defaults."""

    def __init__(self, use_pin_memory: bool = True, max_fwd_stash_size: int = 5, min_offload_size: int = 1024) -> None:
        self.min_bytes, self.max_stash, self.pin = min_offload_size, max_fwd_stash_size, use_pin_memory
        self.tracker: dict[int, tuple[Any, bool]] = {}   # id -> (host copy or tensor, offloaded)
        self.tensor_id = 0
        self.first_forward_call, self.first_backward_call = True, True
        self.fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}
        self.bwd_tensor_stash: dict[int, torch.Tensor] = {}
        self.bwd_ev_stash: dict[int, Any] = {}
        self.curr_graph_id: Any = None
        self.curr_node: Any = None
        self.offloaded_bytes = 0   # bytes packed to the host over the run (a check for tests)
        super().__init__(self._pack, self._unpack)

    def _pack(self, activation: torch.Tensor) -> int:
        if self.first_forward_call:
            self.first_forward_call, self.first_backward_call = False, True
        self.tensor_id += 1
        tid = self.tensor_id
        nbytes = activation.element_size() * activation.nelement()
        on_gpu = activation.device.type in ("cuda", _EMULATED)  # a CPU run has nothing to move off a device
        if on_gpu and nbytes >= self.min_bytes and not isinstance(activation, (torch.nn.Parameter, torch.nn.Buffer)):
            for old in [k for k in self.fwd_stash if k <= tid - self.max_stash]:
                del self.fwd_stash[old]   # the copy stream is done with it (s0.wait_event)
            self.tracker[tid] = (_to_host(activation, self.pin), True)
            self.fwd_stash[tid] = (activation, None)  # kept alive until the copy stream is done
            self.offloaded_bytes += nbytes
        else:
            self.tracker[tid] = (activation, False)
        return tid

    def _unpack(self, tid: int) -> torch.Tensor:
        if self.first_backward_call:
            self.curr_graph_id = torch._C._current_graph_task_id()
            torch.autograd.variable.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.first_backward_call, self.first_forward_call = False, True
        value, offloaded = self.tracker.pop(tid)
        if not offloaded:
            return value
        node = torch._C._current_autograd_node()
        previous: list[int] = []
        if torch._C._current_graph_task_id() == self.curr_graph_id and self.curr_node is not node:
            self.curr_node = node
            previous = list(self.bwd_tensor_stash)
        from_host = tid not in self.fwd_stash
        if from_host:
            value = _to_device(value)
            self.bwd_tensor_stash[tid] = value
            uses = torch._C._storage_Use_Count(value.untyped_storage()._cdata)
        else:
            value = self.fwd_stash[tid][0]

        def hook(outputs: Any, inputs: Any) -> Any:
            if from_host:
                back = self.bwd_tensor_stash[tid]
                if torch._C._storage_Use_Count(back.untyped_storage()._cdata) > uses:
                    del self.bwd_tensor_stash[tid]   # record_stream: lives as long as its other users
                else:
                    self.bwd_ev_stash[tid] = None
            self.fwd_stash.clear()                   # backward has started: the forward copies are done
            for old in previous:
                self.bwd_tensor_stash.pop(old, None)
            return outputs
        node.register_hook(hook)
        return value

    def _end_of_backward(self) -> None:
        self.bwd_tensor_stash.clear()
        self.bwd_ev_stash.clear()
