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
def _packets(*names: str) -> frozenset:
    """The ATen (and prims) op packets of these names that this PyTorch build has."""
    out = set()
    for n in names:
        for ns in (_aten, torch.ops.prims):
            if hasattr(ns, n):
                out.add(getattr(ns, n))
    return frozenset(out)


#: ops inductor lowers to a view of their input (``torch/_inductor/lowering.py``: ``view``,
#: ``permute``, ``expand``... return ``ir.View``/``ReinterpretView``): they take no memory and read
#: through to an unrealized input
_VIEWS = _packets("view", "_unsafe_view", "reshape", "expand", "permute", "t", "transpose", "squeeze", "unsqueeze",
                  "slice", "select", "alias", "as_strided", "unfold", "split", "split_with_sizes", "diagonal",
                  "unbind", "view_as_real", "view_as_complex", "_reshape_alias", "expand_copy", "permute_copy",
                  "view_copy")
#: ops without ``Tag.pointwise`` that inductor still lowers to a ``Pointwise`` loop body
#: (``lowering.py``: indexing through ``ops.indirect_indexing`` -- gather, index, embedding --,
#: copies and dtype conversions, padding, scatter-free concatenation, constant and random
#: factories through ``ops.constant``/``ops.index_expr``/``inductor_random``)
_POINTWISE_EXTRA = _packets("gather", "index", "embedding", "clone", "_to_copy", "convert_element_type", "copy",
                            "constant_pad_nd", "slice_scatter", "select_scatter", "iota", "full", "scalar_tensor",
                            "full_like", "zeros_like", "ones_like", "rand", "randn", "rand_like", "randn_like",
                            "lift_fresh_copy", "masked_fill", "where", "_unsafe_index", "cat")
#: reductions: inductor reads a pointwise producer inside the reduction's own loop
_REDUCTIONS = _packets("sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "std", "argmax",
                       "argmin", "any", "all", "logsumexp")


def _packet(node: torch.fx.Node) -> Any:
    return getattr(node.target, "overloadpacket", None)


def _is_pointwise(node: torch.fx.Node) -> bool:
    """An op inductor lowers to a ``Pointwise`` IR node: ``torch.Tag.pointwise`` on its overload (the
    ops ``lowering.py`` registers with ``make_pointwise``), or one of :data:`_POINTWISE_EXTRA`."""
    if node.op != "call_function":
        return False
    return torch.Tag.pointwise in getattr(node.target, "tags", ()) or _packet(node) in _POINTWISE_EXTRA


def fused_away(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of ``gm`` whose output inductor never writes to memory: pointwise ops (and views
    of them) all of whose users read them inside their own kernel -- another pointwise op, a
    reduction, or a view read that way. Inductor keeps such a node as an unrealized
    ``ir.Pointwise`` and inlines its expression into each consumer's loop
    (``torch/_inductor/graph.py`` ``GraphLowering``: a buffer is realized when an extern kernel --
    matmul, attention, a fallback op -- reads it, or when it is a graph output: what the forward
    returns and saves, what the backward returns). Not modelled: ``realize_reads_threshold`` and
    ``realize_opcount_threshold`` (inductor also realizes a pointwise node read by more than 4
    consumers or built from more than 30 ops, to bound recomputation)."""
    outputs = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    fused: set[torch.fx.Node] = set()

    def inlined(user: torch.fx.Node) -> bool:
        """``user`` reads its input inside its own loop (whether or not ``user``'s own result is
        then written out); a view that is itself returned or saved needs its base in memory."""
        if user.op != "call_function":
            return False
        if _is_pointwise(user) or _packet(user) in _REDUCTIONS:
            return True
        if (_packet(user) in _VIEWS or user.target is operator.getitem) and user not in outputs:
            return bool(user.users) and all(inlined(u) for u in user.users)
        return False

    for node in reversed(gm.graph.nodes):
        if node in outputs or not _is_pointwise(node):
            continue
        if node.users and all(inlined(u) for u in node.users):
            fused.add(node)
    for node in gm.graph.nodes:  # a view of a fused value is never materialized either
        if (_packet(node) in _VIEWS or node.target is operator.getitem) and node.args \
                and node.args[0] in fused:
            fused.add(node)
    return fused


class GraphRunner:
    """Run an FX graph op by op, each ATen op as eager PyTorch runs it (so the tracker sees each
    output allocated), freeing each value after its last use.

    * **Liveness.** Inductor's generated code deletes each buffer after its last read (``del
      buf3`` in the wrapper code, ``torch/_inductor/codegen/wrapper.py`` ``FreeIfNotReusedLine``);
      the runner drops its reference at the same point. The boxed inputs (AOTAutograd's calling
      convention, ``_boxed_call``) are cleared once read, so a saved tensor dies at its last use in
      the backward, as in the compiled backward.
    * **Modules.** Each op's allocations are charged to the module it was traced in.
    * **Fusion.** With ``fuse``, the pointwise nodes of :func:`fused_away` run with the tracker
      paused: their outputs exist only inside a fused kernel and never take device memory.
    """

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, tracker: Any, fuse: bool = True) -> None:
        self.gm = gm
        self.nodes = list(gm.graph.nodes)
        self.tracker = tracker
        self.pause = tracker.paused
        # the module each node was traced in (:func:`_tag_modules`; a backward node inherits its
        # forward node's, AOTAutograd ``copy_fwd_metadata_to_bw_nodes``)
        self.modules = [(n.meta.get("custom") or {}).get(_MODULE, "") for n in self.nodes]
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
                self.tracker.graph_module = self.modules[i]
                try:
                    with ctx:
                        env[n] = _call(n.target, load(n.args), load(n.kwargs))
                finally:
                    self.tracker.graph_module = None
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


def _call(target: Any, args: tuple, kwargs: dict) -> Any:
    """Run one node. The RNG wrappers the partitioner puts around a random op it recomputes
    (``run_and_save_rng_state`` in the forward, ``run_with_rng_state`` in the backward,
    ``torch/_prims/rng_prims.py``) run the op itself; the saved state is the generator's 16-byte
    host tensor on CUDA (``torch.cuda.get_rng_state()``), no device memory."""
    name = getattr(target, "__name__", "")
    if name == "run_and_save_rng_state":
        op, *rest = args
        return torch.zeros(16, dtype=torch.uint8), op(*rest, **kwargs)
    if name == "run_with_rng_state":
        _, op, *rest = args
        return op(*rest, **kwargs)
    return target(*args, **kwargs)


# ----- the compiled model ---------------------------------------------------------------------------------
def _flatten_output(out: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The tensors of a model's output and a function that rebuilds an output of the same kind from
    them. A transformers ``ModelOutput`` keeps its class and fields; a KV cache it returns
    (``past_key_values``) becomes the tuple of its tensors, which keeps the same storages alive."""
    if isinstance(out, torch.Tensor):
        return [out], lambda ts: ts[0]
    if isinstance(out, (tuple, list)):
        parts = [_flatten_output(o) for o in out]

        def rebuild_seq(ts: list[torch.Tensor]) -> Any:
            res = _rebuild_parts(parts, ts)
            if isinstance(out, list):
                return res
            return type(out)(*res) if hasattr(out, "_fields") else tuple(res)  # a namedtuple, or a tuple
        return [t for p in parts for t in p[0]], rebuild_seq
    if isinstance(out, dict) or hasattr(out, "keys"):
        keys = list(out.keys())
        parts = [_flatten_output(out[k]) for k in keys]
        cls = type(out)
        return [t for p in parts for t in p[0]], lambda ts: cls(**dict(zip(keys, _rebuild_parts(parts, ts))))
    if out is None or isinstance(out, (int, float, bool, str)):
        return [], lambda ts: out
    tensors = _cache_tensors(out)
    if tensors is not None:
        return tensors, lambda ts: tuple(ts)
    raise TrainmemError(f"--compile: the model returned a {type(out).__name__}, which trace cannot pass "
                        f"through the compiled graph")


def _rebuild_parts(parts: list[tuple[list, Callable]], ts: list[torch.Tensor]) -> list[Any]:
    """Each part rebuilt from its own slice of ``ts`` (the parts' tensors, in order)."""
    out, k = [], 0
    for tensors, rebuild in parts:
        out.append(rebuild(ts[k:k + len(tensors)]))
        k += len(tensors)
    return out


def _cache_tensors(cache: Any) -> list[torch.Tensor] | None:
    """The key and value tensors of a transformers ``Cache`` (``layers[i].keys``/``.values``; an
    ``EncoderDecoderCache``'s self-attention then cross-attention caches)."""
    inner = [getattr(cache, n, None) for n in ("self_attention_cache", "cross_attention_cache")]
    if any(c is not None for c in inner):
        return [t for c in inner if c is not None for t in (_cache_tensors(c) or [])]
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
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V
    # inductor's compile_fx sets its fake mode around AOTAutograd (``V.set_fake_mode``); the RNG
    # pass (``replace_random.fuse_seed_creation_pass``) creates its seed tensor in it
    with config.patch(joint_graph_constant_folding=False), _meta_as_device(), \
            V.set_fake_mode(detect_fake_mode(joint_inputs)):
        return partition_fn(gm, joint_inputs, **kwargs)


@contextlib.contextmanager
def _meta_as_device():
    """Let inductor's joint-graph patterns see the emulated GPU's ``meta`` tensors as device tensors.

    ``PatternMatcherPass.apply`` skips every node ``fallback_node_due_to_unsupported_type`` marks,
    and ``torch/_inductor/lowering.py`` ``unsupported_input_tensor``/``unsupported_output_tensor``
    mark any ``meta`` tensor: on the emulated GPU no pattern would apply (the full + scatter of the
    loss backward would not become a pointwise ``where``, ``scatter_upon_const_tensor``). While
    the partition runs, a meta tensor is judged as the device tensor it stands for."""
    from torch._inductor import lowering
    orig_in, orig_out = lowering.unsupported_input_tensor, lowering.unsupported_output_tensor

    def judge(orig: Callable) -> Callable:
        def check(t: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
            if t.is_meta:
                return bool(t.is_complex() or t.is_sparse)
            return orig(t, *args, **kwargs)
        return check

    lowering.unsupported_input_tensor, lowering.unsupported_output_tensor = judge(orig_in), judge(orig_out)
    try:
        yield
    finally:
        lowering.unsupported_input_tensor, lowering.unsupported_output_tensor = orig_in, orig_out


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
                return GraphRunner(gm, tracker, self._fuse)
            return compile_graph

        def traced(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with _tag_modules(tracker.module_names), _tag_checkpoints(module):
                return fn(*flat)

        compiled = aot_function(traced, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                partition_fn=_partition, decompositions=select_decomp_table(),
                                num_params_buffers=len(names), keep_inference_input_mutations=True)
        return _Traced(compiled, tracker), rebuild


@contextlib.contextmanager
def _composites_decomposed():
    """Trace CompositeImplicitAutograd ops through their decomposition, as on a GPU.

    PyTorch registers Python ``Meta`` kernels for some composite ops (``torch/_meta_registrations.py``,
    ``torch/_refs``: ``nll_loss``, ``dropout``, ``_fused_rms_norm`` ...). Under AOTAutograd's Python
    dispatcher a ``meta`` tensor takes that kernel instead of the composite's decomposition, and
    the op gets no autograd formula (autograd's not-implemented fallback): the loss's backward
    would be missing from the joint graph. CUDA tensors never see those kernels, so while the
    graph is traced they are set aside."""
    from torch._C import DispatchKey
    removed = []
    for name in dir(_aten):
        packet = getattr(_aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if DispatchKey.Meta in op.py_kernels and \
                    torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
                removed.append((op, op.py_kernels.pop(DispatchKey.Meta)))
                op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in removed:
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


#: the key of ``node.meta["custom"]`` that names the module a node was traced in
_MODULE = "trainmem_module"


@contextlib.contextmanager
def _tag_modules(names: dict[int, str]):
    """While the joint graph is traced, give each node the name of the module running
    (``node.meta["custom"]``: ``torch.fx.proxy`` copies ``fx.traceback``'s current meta onto every
    node it creates while AOTAutograd preserves node meta)."""
    from torch.fx import traceback as fx_traceback
    from torch.nn.modules import module as _module
    stack: list[str] = []

    def set_meta() -> None:
        fx_traceback.get_current_meta()["custom"] = {_MODULE: stack[-1] if stack else ""}

    def pre(mod: torch.nn.Module, args: Any) -> None:
        stack.append(names.get(id(mod), type(mod).__name__))
        set_meta()

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        if stack:
            stack.pop()
        set_meta()

    handles = [_module.register_module_forward_pre_hook(pre),
               _module.register_module_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        fx_traceback.get_current_meta().pop("custom", None)


@contextlib.contextmanager
def _tag_checkpoints(module: torch.nn.Module):
    """transformers' gradient checkpointing as dynamo compiles it. Dynamo turns a non-reentrant
    ``torch.utils.checkpoint.checkpoint`` into the ``tag_activation_checkpoint`` higher-order op,
    whose body AOTAutograd inlines with every node tagged ``recompute=PREFER_RECOMPUTE`` and one
    ``ac_graph_id`` per region (``torch/_higher_order_ops/wrap.py``); the min-cut partitioner then
    recomputes those nodes in the backward and saves none of them (``must_recompute``,
    ``torch/_functorch/partitioners.py``). Here each checkpointing layer's
    ``_gradient_checkpointing_func`` runs its body directly with the same tags."""
    from torch.fx import traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy
    layers = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False)
              and "_gradient_checkpointing_func" in vars(m)]
    ids = iter(range(1, 1 << 30))

    def run(fn: Callable, *args: Any, **kwargs: Any) -> Any:
        meta = fx_traceback.get_current_meta()
        meta["recompute"], meta["ac_graph_id"] = CheckpointPolicy.PREFER_RECOMPUTE, next(ids)
        try:
            return fn(*args, **kwargs)
        finally:
            meta.pop("recompute", None)
            meta.pop("ac_graph_id", None)

    saved = {m: m._gradient_checkpointing_func for m in layers}
    for m in layers:
        m._gradient_checkpointing_func = run
    try:
        yield
    finally:
        for m, f in saved.items():
            m._gradient_checkpointing_func = f


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
            with self.tracker.tracing(), _composites_decomposed():
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
    if t.dp > 1 or t.tp > 1 or t.pp > 1 or t.fsdp is not None:
        raise TrainmemError("--compile with --dp/--tp/--pp/--fsdp: trace compiles one GPU's whole model; "
                            "the distributed wrappers' hooks and pipeline stages are not captured in the "
                            "graph (use estimate)")
    if t.recompute == "op":
        raise TrainmemError("--compile with --recompute op: torchtitan's per-op policy tags each op for the "
                            "partitioner inside dynamo's checkpoint region, which trace does not capture; "
                            "use --recompute full or none")
    if t.extra.get("framework") == "torchtune":
        raise TrainmemError("--compile with --framework torchtune: torchtune compiles each decoder layer and its loss "
                            "apart (training.compile_model, compile_loss), trace compiles the whole model; use "
                            "estimate, which models torchtune's way")
    if t.cast_output:
        raise TrainmemError("--compile with --cast-output: trace compiles the whole model, not torchtune's layers "
                            "with the cast and the loss apart; drop one of them (estimate runs both for torchtune)")
    if t.attention_call != "model":
        raise TrainmemError(f"--compile with --attention-call {t.attention_call}: trace compiles the transformers "
                            "model's own attention call; drop one of them (estimate runs both)")
    if t.offload_activations:
        raise TrainmemError("--compile with --offload-activations: torchtune's saved-tensor hooks run "
                            "outside the compiled graph, which trace does not capture; drop one of them")
    if t.loss_chunks > 1:
        raise TrainmemError(f"--compile with --loss-chunks {t.loss_chunks}: the chunked loss calls the model's "
                            f"body and head itself, outside the compiled call; drop one of them")


def setup(t: Any, spec: Any, device: str) -> None:
    """Before a ``--compile`` trace: refuse what it cannot run (:func:`check`), then build
    inductor's pattern tables while no GPU is emulated (:func:`prepare`)."""
    check(t, spec, device)
    prepare()
