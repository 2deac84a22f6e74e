"""``trace --compile``: the model's forward and backward as AOTAutograd partitions them for inductor.

``torch.compile(model)`` with inductor captures the forward (dynamo), traces the joint forward +
backward graph (AOTAutograd, with inductor's decompositions), and splits it with inductor's
partitioner (``torch._inductor.compile_fx.partition_fn``: inductor's joint-graph passes, then
``torch._functorch.partitioners.min_cut_rematerialization_partition(compiler="inductor")``), which
chooses the tensors the forward saves for the backward: a min cut of the joint graph that prefers
recomputing cheap (fusible) ops in the backward over saving their outputs. Inductor then compiles
each graph into fused kernels.

Dynamo itself cannot trace this step: it inlines the CUDA emulation's ``__torch_function__``
(``trace/cuda.py``: the autocast policy, SDPA backend choice, cast cache), whose Python graph-breaks
(``Tensor._is_view`` returns a non-tensor), so the model would split into many small graphs, none
the one inductor sees. trainmem therefore captures the whole model call the way AOTAutograd does
behind dynamo, without dynamo: ``torch._functorch.aot_autograd.aot_function`` on the model's
``functional_call`` (parameters and buffers lifted as inputs), traced on fake tensors with the
tracker suspended and the CUDA emulation active, so the joint graph has the casts, attention
kernels and dropout the GPU runs. The partition uses inductor's own ``partition_fn`` and
decomposition table. The two graphs then run op by op under the tracker (``GraphRunner``) inside
AOTAutograd's ``CompiledFunction``: what the forward saves is exactly what the partitioner chose.

Inside each graph, inductor's kernels never materialize the intermediates they fuse, and its
memory planning frees a buffer after its last use. The runner models both (see ``GraphRunner``);
what remains different from inductor is listed in docs/trace.md ("--compile").
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch

from ..errors import TrainmemError

_aten = torch.ops.aten


def prepare() -> None:
    """Build inductor's joint-graph pattern tables before the CUDA emulation is installed.

    ``torch._inductor.fx_passes.joint_graph.lazy_init`` traces its replacement patterns once, on
    the device it is given or, with none (the emulated GPU's ``meta`` inputs give none,
    ``torch._dynamo.utils.get_inputs_devices``), on ``cuda`` when ``torch.cuda.is_available()``,
    which the emulation answers True; a CPU-only build cannot create those tensors. Built here on
    the CPU, the cached tables are what the partition reuses (the patterns match graph structure,
    not devices)."""
    try:
        from torch._inductor.fx_passes.joint_graph import lazy_init
    except ImportError as e:  # pragma: no cover - a torch build without inductor
        raise TrainmemError(f"--compile needs torch._inductor to partition the graph ({e})") from None
    lazy_init()


# ----- which graph nodes inductor materializes --------------------------------------------------------
#: ops inductor lowers to a view or reinterpretation of their input (no buffer of their own)
_VIEW_OPS = frozenset(getattr(_aten, n).default for n in (
    "view", "_unsafe_view", "reshape", "expand", "permute", "t", "transpose", "squeeze", "unsqueeze", "slice",
    "select", "alias", "as_strided", "unfold", "split", "split_with_sizes", "diagonal", "unbind", "view_as_real",
    "view_as_complex") if hasattr(_aten, n) and "default" in getattr(_aten, n).overloads())


def _is_pointwise(node: torch.fx.Node) -> bool:
    """An op inductor lowers to a ``Pointwise`` IR node (``torch.Tag.pointwise`` on its overload,
    as ``torch/_inductor/lowering.py`` registers pointwise lowerings), or a dtype conversion."""
    t = node.target
    tags = getattr(t, "tags", ())
    if torch.Tag.pointwise in tags:
        return True
    return t in (torch.ops.prims.convert_element_type.default, _aten._to_copy.default)


def fused_away(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of ``gm`` whose output inductor never writes to memory: pointwise ops whose every
    user is another pointwise op or a view of one, inside the same graph. Inductor keeps such a
    node as an unrealized ``Pointwise`` and inlines its expression into each consumer's kernel
    (``torch/_inductor/graph.py`` realizes a buffer when an extern kernel, a reduction over many
    reads, or a graph output needs it; ``ir.Pointwise`` otherwise stays a loop body). Reductions,
    matmuls, attention and graph outputs (what the forward returns and saves) are materialized."""
    out = set()
    outputs = {a for a in next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes}
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function" or node in outputs or not _is_pointwise(node):
            continue
        users = list(node.users)
        if users and all(_fusible_user(u, out) for u in users):
            out.add(node)
    return out


def _fusible_user(user: torch.fx.Node, fused: set[torch.fx.Node]) -> bool:
    """True when ``user`` reads its input inside a fused kernel: a pointwise op, or a view whose
    own users are all fused."""
    if user.op != "call_function":
        return False
    if _is_pointwise(user):
        return True
    return False


class GraphRunner:
    """Run an FX graph op by op, each ATen op as eager PyTorch runs it (so the tracker sees each
    output allocated), freeing each value after its last use.

    * **Liveness.** Inductor's generated code deletes each buffer after its last read (``del
      buf3`` in the wrapper code, ``torch/_inductor/codegen/wrapper.py`` ``FreeIfNotReusedLine``);
      the runner drops its reference at the same point. The boxed inputs (AOTAutograd's calling
      convention, ``_boxed_call``) are cleared once read, so a saved tensor dies at its last use in
      the backward, as in the compiled backward.
    * **Fusion.** With ``fuse``, the pointwise nodes of :func:`fused_away` run with the tracker
      paused: their outputs exist only inside a fused kernel and never take device memory.
    """

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, pause: Callable[[], Any], fuse: bool = True) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.pause = pause
        self.fused = fused_away(gm) if fuse else set()
        last: dict[torch.fx.Node, int] = {}
        for i, n in enumerate(self.nodes):
            for a in n.all_input_nodes:
                last[a] = i
        self.free_at: list[list[torch.fx.Node]] = [[] for _ in self.nodes]
        for n, i in last.items():
            self.free_at[i].append(n)
        for i, n in enumerate(self.nodes):
            if n.op != "output" and n not in last:
                self.free_at[i].append(n)   # an output no one reads: freed at once
        self.n_inputs = sum(1 for n in self.nodes if n.op == "placeholder")

    def __call__(self, args: list[Any]) -> Any:
        env: dict[torch.fx.Node, Any] = {}
        placeholders = iter(args)
        load = lambda a: torch.fx.node.map_arg(a, lambda n: env[n])  # noqa: E731
        for i, n in enumerate(self.nodes):
            if n.op == "placeholder":
                env[n] = next(placeholders)
                if i + 1 == len(self.nodes) or self.nodes[i + 1].op != "placeholder":
                    args.clear()   # the graph owns its inputs now (boxed calling convention)
            elif n.op == "call_function":
                ctx = self.pause() if n in self.fused else contextlib.nullcontext()
                with ctx:
                    env[n] = n.target(*load(n.args), **load(n.kwargs))
            elif n.op == "get_attr":
                env[n] = getattr(self.gm, n.target)
            elif n.op == "output":
                return load(n.args[0])
            else:
                raise TrainmemError(f"--compile: a {n.op} node in the partitioned graph; trace runs "
                                    f"call_function graphs only")
            for d in self.free_at[i]:
                env.pop(d, None)
        raise AssertionError("graph without output")


# ----- the compiled model ---------------------------------------------------------------------------------
def _flatten_output(out: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The tensors of a model's output and a function that rebuilds an output of the same kind from
    them. A transformers ``ModelOutput`` keeps its class and fields; a KV cache it returns
    (``past_key_values``) becomes the tuple of its tensors, which keeps the same storages alive."""
    if isinstance(out, torch.Tensor):
        return [out], lambda ts: ts[0]
    if isinstance(out, (tuple, list)):
        parts = [_flatten_output(o) for o in out]
        sizes = [len(p[0]) for p in parts]

        def rebuild_seq(ts: list[torch.Tensor]) -> Any:
            res, k = [], 0
            for (_, fn), n in zip(parts, sizes):
                res.append(fn(ts[k:k + n]))
                k += n
            return type(out)(res) if isinstance(out, tuple) and type(out) is not tuple and hasattr(out, "_fields") \
                else type(out)(res) if isinstance(out, list) else tuple(res)
        return [t for p in parts for t in p[0]], rebuild_seq
    if isinstance(out, dict) or hasattr(out, "keys"):
        keys = list(out.keys())
        parts = [_flatten_output(out[k]) for k in keys]
        sizes = [len(p[0]) for p in parts]
        cls = type(out)

        def rebuild_map(ts: list[torch.Tensor]) -> Any:
            vals, k = {}, 0
            for key, (_, fn), n in zip(keys, parts, sizes):
                vals[key] = fn(ts[k:k + n])
                k += n
            return cls(**vals)
        return [t for p in parts for t in p[0]], rebuild_map
    if out is None or isinstance(out, (int, float, bool, str)):
        return [], lambda ts: out
    tensors = _cache_tensors(out)
    if tensors is not None:
        return tensors, lambda ts: tuple(ts)
    raise TrainmemError(f"--compile: the model returned a {type(out).__name__}, which trace cannot pass "
                        f"through the compiled graph")


def _cache_tensors(cache: Any) -> list[torch.Tensor] | None:
    """The key and value tensors of a transformers ``Cache`` (``layers[i].keys``/``.values``)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    out = []
    for layer in layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _partition(gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's ``partition_fn`` (joint-graph passes, then the min-cut partitioner), without the
    joint-graph constant folding (``config.joint_graph_constant_folding``): on the emulated GPU's
    ``meta`` tensors it mistakes the flash-attention RNG state for a constant and breaks the
    graph's order. It replaces input-independent tensors by ``full`` (scalars and masks built from
    sizes), none of which is a saved activation."""
    from torch._inductor import config
    from torch._inductor.compile_fx import partition_fn
    with config.patch(joint_graph_constant_folding=False):
        return partition_fn(gm, joint_inputs, **kwargs)


class CompiledModel(torch.nn.Module):
    """``torch.compile(model)`` as trace runs it: the first call captures and partitions the joint
    graph for the call's keyword inputs (:func:`capture`); every call runs the compiled forward,
    whose backward AOTAutograd's ``CompiledFunction`` runs when ``loss.backward()`` reaches it."""

    def __init__(self, module: torch.nn.Module, tracker: Any, fuse: bool = True) -> None:
        super().__init__()
        self.module = module
        self._tracker = tracker
        self._fuse = fuse
        self._compiled: dict[Any, tuple[Callable, list]] = {}
        self.graphs: list[tuple[str, torch.fx.GraphModule]] = []

    def forward(self, **kwargs: Any) -> Any:
        names = sorted(kwargs)
        tensors = [k for k in names if isinstance(kwargs[k], torch.Tensor)]
        key = tuple((k, tuple(kwargs[k].shape), kwargs[k].dtype) if k in tensors else (k, repr(kwargs[k]))
                    for k in names) + (torch.is_autocast_enabled("cuda"), torch.is_grad_enabled())
        if key not in self._compiled:
            self._compiled[key] = self._capture(kwargs, tensors)
        fn, rebuild = self._compiled[key]
        params = self._params()
        flat = fn(*[p for _, p in params], *[kwargs[k] for k in tensors])
        return rebuild[0](list(flat))

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.module.named_parameters()) + \
            list(self.module.named_buffers())

    def _capture(self, kwargs: dict[str, Any], tensors: list[str]) -> tuple[Callable, list]:
        """``aot_function`` over the module's functional call, with inductor's decompositions and
        partition; compiled graphs run by :class:`GraphRunner`."""
        from torch._functorch.aot_autograd import aot_function
        from torch._inductor.decomposition import select_decomp_table

        module, params = self.module, self._params()
        names = [n for n, _ in params]
        consts = {k: v for k, v in kwargs.items() if k not in tensors}
        rebuild: list[Callable] = []

        def fn(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            pb = dict(zip(names, flat[:len(names)]))
            batch = dict(zip(tensors, flat[len(names):]), **consts)
            out = torch.func.functional_call(module, pb, (), batch, tie_weights=True)
            ts, rb = _flatten_output(out)
            rebuild[:] = [rb]
            return tuple(ts)

        tracker = self._tracker

        def compiler(kind: str) -> Callable:
            def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
                self.graphs.append((kind, gm))
                return GraphRunner(gm, tracker.paused, self._fuse)
            return compile_graph

        compiled = aot_function(fn, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                partition_fn=_partition, decompositions=select_decomp_table(),
                                num_params_buffers=len(names), keep_inference_input_mutations=True)
        return _Traced(compiled, tracker), rebuild


class _Traced:
    """An ``aot_function`` traces and compiles at its first call, then runs the compiled function
    in that same call. The first call is therefore made on fake copies of the inputs with the
    tracker suspended (nothing of it reaches the device); every call, the first included, then
    runs the compiled graphs under the tracker."""

    def __init__(self, compiled: Callable, tracker: Any) -> None:
        self.compiled, self.tracker, self.traced = compiled, tracker, False

    def __call__(self, *args: Any) -> Any:
        if not self.traced:
            from torch._subclasses.fake_tensor import FakeTensorMode
            # a fake mode that takes the constants the model creates while traced (transformers'
            # DynamicLayer starts its cache as ``torch.tensor([])``, a plain meta tensor here)
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with self.tracker.tracing():
                self.compiled(*fake)
            self.traced = True
        return self.compiled(*args)


def check(t: Any, spec: Any, device: str) -> None:
    """Refuse what ``trace --compile`` cannot run as ``torch.compile`` would, one line each."""
    if spec is None:
        raise TrainmemError("--compile with your own step_fn: compile the module in your step function "
                            "instead; trace's --compile compiles the transformers model it builds")
    if device != "cuda":
        raise TrainmemError("--compile traces on the emulated GPU only (--device cuda): the partition is "
                            "inductor's CUDA one")
    if t.dp > 1 or t.tp > 1 or t.fsdp is not None:
        raise TrainmemError("--compile with --dp/--tp/--fsdp: trace compiles one GPU's model; the "
                            "distributed wrappers' hooks are not captured in the graph (use estimate)")
    if t.loss_chunks > 1:
        raise TrainmemError(f"--compile with --loss-chunks {t.loss_chunks}: the chunked loss calls the model's "
                            f"body and head itself, outside the compiled call; drop one of them")
