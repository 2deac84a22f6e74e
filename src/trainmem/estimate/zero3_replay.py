"""DeepSpeed ZeRO-3's parameter coordinator replayed over a model's module order: which parameters
are gathered (whole, in the engine's dtype) at each module's forward and backward once the
coordinator's trace is complete (the run's second step on).

The coordinator is the same in DeepSpeed v0.14.2 (the published rows' pin) and v0.19.8 (installed):
``runtime/zero/partitioned_param_coordinator.py`` ``fetch_sub_module`` (v0.14.2 L261-391, v0.19.8
L310-490), ``release_sub_module`` (L395-403 / L494-533), ``__params_to_release`` (L487-517 /
L634-664), ``__all_gather_params_`` (L436-474 / L582-620). What it does, replayed here:

* Every module is fetched at its forward pre-hook and its backward pre-hook (``parameter_offload.py``
  ``_register_deepspeed_module``: every submodule, those without parameters of their own too), and
  each fetch advances ``__step_id`` (v0.19.8 L490). The recorded order (``record_module``) is the
  forward's pre-order and the backward's reverse post-order; the parameter queue lists each module's
  own parameters at its step (``record_parameters``, sorted by ``ds_id``: registration order).
* A fetch gathers the module's parameters not yet gathered, pops their own entries off the queue
  (setting ``__most_recent_step_id_param_fetched_for``), then prefetches: it pops queue entries while
  the parameters it gathers stay under ``min(stage3_max_live_parameters - n_available,
  stage3_prefetch_bucket_size)`` elements (v0.19.8 L452-476). An entry whose parameter is gathered
  already is popped without counting, and its step is recorded as the parameter's most recent fetch,
  so the prefetcher runs past every gathered parameter. ``n_available`` counts every gathered
  element (L593, L630) and is reset to 0 at each forward's start (``reset_step`` L287; v0.14.2 L239).
* A module's release (post hook) keeps a parameter whose most recent fetch step lies ahead
  (L649-651), or that recurs in the modules of the order within ``stage3_max_reuse_distance``
  elements (L656-662); a parameter still in flight is not released (``__release_param``: AVAILABLE only).
* Storage (``partition_parameters.py``): one parameter gathered alone is gathered into its own buffer
  (``all_gather_coalesced`` -> ``_all_gather_sequential`` for ``len(params) == 1``, v0.19.8 L1598;
  v0.14.2 L1205); a
  group of several into one flat buffer, from which the first wait builds every member by
  ``torch.cat`` (``AllGatherCoalescedHandle.wait`` L761-803); the handle, holding the flat buffer,
  stays in ``__inflight_param_registry`` until the group's last member is fetched (coordinator L406).

* A ZeRO-3 leaf module (``set_z3_leaf_modules``; DeepSpeed >= 0.18.0 makes Mixtral's, Qwen2-MoE's and
  Qwen3-MoE's MoE blocks leaves by default) is one fetch of every parameter under it, its submodules
  unhooked (``module_order``'s ``leaves``). A fetch waits on its parameters in a ``set``'s order, which
  varies run to run: taken here in the order that holds the most (``_wait_order``). The release's
  reuse-distance walk counts a leaf's parameters only when the module released is a leaf (``_release``).
* Fused experts (transformers >= 5) are multiplied through a view of the gathered weight, which autograd
  saves: their storage outlives ZeRO-3's release until their layer's backward (``view_held``).

Parameters of ``stage3_param_persistence_threshold`` (1e5, ``zero/config.py`` L228) elements or fewer
persist gathered (``parameter_offload.py`` ``mark_persistent_parameters`` L317-329) and are left out
(norms: negligible). Modules without parameters that the spec does not name (activations, rotary
embeddings, dropout) are left out of the order: they only add prefetch rounds, and the prefetcher
outruns the forward anyway.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import permutations
from typing import Callable

from ..allocator_rules import block_bytes

#: DeepSpeed's ``stage3_param_persistence_threshold`` default (v0.19.8 ``runtime/zero/config.py`` L228;
#: v0.14.2 the same): parameters of this many elements or fewer stay gathered and are left out here
PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True)
class Use:
    """One module fetch of the recorded order: forward or backward, its own parameters (indices)."""
    forward: bool
    params: tuple[int, ...]
    layer: int | None = None   # the decoder layer it belongs to (None outside the layers)
    name: str = ""
    active: bool = False       # a recomputed forward of a module whose backward has begun: not released
    below: tuple[int, ...] | None = None   # a ZeRO-3 leaf's: None; else every parameter under the module


@dataclass(frozen=True)
class Moment:
    """The gathered storage at a module's fetch (after its prefetch, before its compute), in ``replay``'s
    ``size`` units (elements unless given)."""
    use: Use
    gathered: int              # every gathered parameter's storage and the flat buffers alive
    fresh: int                 # of it: layers' parameters gathered since their forward use, never released
    available: int = 0         # the coordinator's ``n_available`` count (gathered parameters' elements)
    kept: int = 0              # layers' weights as their forward gathered them, released since and not yet
    #                            back-propagated: under torch's ``F.linear`` autograd's saved views still hold them
    own_kept: int = 0          # of ``kept``: this use's own parameters (freed once its backward has run)
    waits: int = 0             # the most storage held during the fetch's waits (``_wait_order``), where above
    #                            ``gathered``: one group's members built while another's flat output is alive
    views: int = 0             # fused experts' storage released since their forward, held by the view autograd
    #                            saved until their backward (``view_held``), beside ``gathered``


@dataclass
class _State:
    numels: tuple[int, ...]
    size: Callable[[int], int]                          # elements -> the storage counted for one tensor
    status: list[int]                                   # 0 not available, 1 in flight, 2 available
    group: dict[int, int] = field(default_factory=dict)  # parameter -> its gather group
    groups: dict[int, list] = field(default_factory=dict)  # group -> [members, flat elements, pending set]
    recent: dict[int, int] = field(default_factory=dict)
    fresh: set = field(default_factory=set)
    used: set = field(default_factory=set)              # layers' parameters their forward has used
    done: set = field(default_factory=set)              # parameters whose backward has run
    n_available: int = 0
    prefix: list = field(default_factory=list)          # elements of the order's uses before each index
    occurs: dict = field(default_factory=dict)          # parameter -> the indices of the uses holding it
    prefix_below: list = field(default_factory=list)    # the same over every parameter under each module
    occurs_below: dict = field(default_factory=dict)    # (what a leaf's release walks: ``_release``)
    log: list = field(default_factory=list)             # storage events (``events``): (+1, key, elements) / (-1, key, 0)
    marks: list = field(default_factory=list)           # the log's length at each use's fetch
    waits: int = 0                                      # the most storage held during the last fetch's waits
    views: frozenset = frozenset()                      # parameters autograd saves as views (``view_held``)
    recompute_from: int = 0                             # uses before it: a forward autograd saves nothing of
    saved: set = field(default_factory=set)             # ``views`` a forward saved, their backward not run yet
    held: set = field(default_factory=set)              # of them: released since, their storage held by the view
    sizes: tuple = ()                                   # ``size`` of each parameter (``__post_init__``)
    live: set = field(default_factory=set)              # parameters whose status is not 0 (``_storage`` walks them)

    def __post_init__(self) -> None:
        """``size`` of each parameter, once per distinct width (few: a layer's shapes repeat), where not given;
        ``live``: the parameters gathered or in flight."""
        if not self.sizes:
            memo: dict[int, int] = {}
            self.sizes = tuple(memo[n] if n in memo else memo.setdefault(n, self.size(n)) for n in self.numels)
        self.live = {p for p, st in enumerate(self.status) if st}


def _gather(s: _State, params: list[int]) -> None:
    """``__all_gather_params_``: one group of the parameters not gathered yet (L582-613)."""
    todo = sorted(p for p in set(params) if s.status[p] == 0)
    if not todo:
        return
    gid = len(s.groups) + 1
    flat = sum(s.numels[p] for p in todo) if len(todo) > 1 else 0   # (sum numel,) flat all-gather output
    s.groups[gid] = [todo, flat, set(todo)]
    for p in todo:
        s.status[p], s.group[p] = 1, gid
        s.live.add(p)
    s.log.extend([(1, -gid, flat)] if flat else [(1, todo[0], s.numels[todo[0]])])   # the gather's output
    s.n_available += sum(s.numels[p] for p in todo)


def _wait(s: _State, p: int) -> None:
    """The fetch's wait: the group's first wait builds every member; ``p`` leaves the registry."""
    members, flat, pending = s.groups[s.group[p]]
    for q in members:
        if s.status[q] == 1:
            s.status[q] = 2
            if flat:
                s.log.append((1, q, s.numels[q]))       # built from the flat output by ``torch.cat``
    pending.discard(p)
    if flat and not pending:
        s.log.append((-1, -s.group[p], 0))              # the handle leaves the registry: its flat output freed


def _storage(s: _State) -> tuple[int, int]:
    """Storage held (``size`` of each tensor): gathered parameters (a coalesced group's members only once waited) and the
    flat buffers of groups with a member still in flight; and those of them fresh since forward."""
    total = fresh = 0
    sizes, status = s.sizes, s.status
    for p in s.live:                                    # (status 1 or 2; a sum of ints: any order)
        st = status[p]
        if st == 2 or (st == 1 and s.groups[s.group[p]][1] == 0):
            total += sizes[p]
            fresh += sizes[p] if p in s.fresh else 0
    total += sum(s.size(flat) for _, flat, pending in s.groups.values() if pending)
    return total, fresh


def _kept(s: _State, params) -> int:
    """Storage of ``params`` that a layer's forward used and whose backward has not run, held only by
    that forward's saved views (released by the coordinator since, ``fresh`` no more)."""
    sizes = s.sizes
    return sum(sizes[p] for p in (s.used if params is s.used else s.used.intersection(params)) - s.done - s.fresh)


def _prefetch(s: _State, queue: deque, bucket: int, max_live: int) -> None:
    """The prefetch loop (v0.19.8 L452-485, v0.14.2 L353-386)."""
    if bucket <= 0:
        return
    limit = min(max_live - s.n_available, bucket)
    chosen: list[int] = []
    numel = 0
    while queue and numel < limit:
        p, step = queue.popleft()
        do = s.status[p] == 0 and p not in chosen
        s.recent[p] = max(s.recent.get(p, -10**10), step)
        if do:
            chosen.append(p)
            numel += s.numels[p]
    _gather(s, chosen)


def _rise(s: _State, order) -> int:
    """The most storage (``size`` units) the waits on ``order`` (parameters in flight) add to what is
    held before them: a coalesced group's members built at its first wait, its flat output freed at
    the wait on its last member in the registry (``_wait``)."""
    built: set = set()
    left: dict = {}
    rise = top = 0
    for p in order:
        gid = s.group[p]
        members, flat, pending = s.groups[gid]
        if not flat:
            continue                                     # gathered alone into its own buffer: counted
        if gid not in built:
            built.add(gid)
            rise += sum(s.sizes[q] for q in members if s.status[q] == 1)
            top = max(top, rise)
        rest = left.setdefault(gid, set(pending))
        rest.discard(p)
        if not rest:
            rise -= s.size(flat)
    return top


def _wait_order(s: _State, own: list[int]) -> tuple[list[int], int]:
    """The fetch's waits and the most storage they add (``_rise``). DeepSpeed waits on the module's
    parameters in the order of a Python ``set`` of them (v0.19.8 ``partitioned_param_coordinator.py``
    L364 ``params_to_fetch = set(iter_params(...))``, L391 ``for param in params_to_fetch``; v0.14.2
    L276 a ``frozenset``, L297): CPython hashes an object by its address, so the order is any from run to run
    (trace, the real engine on fake tensors, reached 440 and 340 MiB gathered at the same fetch in two
    runs: a small Mixtral's MoE block waiting on its experts' ``down_proj``, in a new group, before or
    after ``gate_up_proj``, the last member of an older one). Where the module's parameters in flight
    belong to several groups, the order that reaches the most (up to 6 of them; else ``ds_id``
    order), the first in ``ds_id`` order of those that reach it."""
    waiting = [p for p in sorted(set(own)) if p in s.groups[s.group[p]][2]]
    best, top = waiting, _rise(s, waiting)
    if 1 < len({s.group[p] for p in waiting}) and len(waiting) <= 6:
        for order in permutations(waiting):
            rise = _rise(s, order)
            if rise > top:
                best, top = list(order), rise
    return best, top


def _fetch(s: _State, uses: tuple[Use, ...], i: int, queue: deque, bucket: int, max_live: int) -> None:
    """``fetch_sub_module`` at step ``i`` of a complete trace; ``s.waits``: the most storage held
    during its waits (``_wait_order``), 0 where they add nothing."""
    own = list(uses[i].params)
    _gather(s, own)
    order, rise = _wait_order(s, own)
    s.waits = _storage(s)[0] + rise if rise else 0
    for p in order:                                     # in ``__inflight_param_registry``
        _wait(s, p)
    for p in own:
        if uses[i].forward and uses[i].layer is not None:
            s.fresh.add(p)                              # a layer's weight as its forward used it
            s.used.add(p)
            if p in s.views and i >= s.recompute_from:
                s.saved.add(p)                          # a view of its gathered storage saved for backward
    ahead = {p for p in own if s.recent.get(p, -10**10) < i}
    for _ in range(len(ahead)):                         # its own entries off the queue (L428-434)
        if queue:
            p, step = queue.popleft()
            s.recent[p] = step
    _prefetch(s, queue, bucket, max_live)


def _release(s: _State, uses: tuple[Use, ...], i: int, dist: int) -> None:
    """``release_sub_module`` after the module fetched at step ``i`` (``__step_id`` is then i + 1). The
    reuse-distance walk (L656-662) passes the uses from i + 1 until the elements passed reach ``dist``:
    those in [i + 1, stop), found on the prefix sums. It lists each passed module's parameters with
    ``iter_params(module, recurse=z3_leaf_module(submodule_to_release))`` (v0.19.8 L659; v0.14.2 L513):
    recursive, every parameter under each module, where the module released is a leaf; else each one's
    own, none for a leaf (a MoE block's are its router's and experts')."""
    step = i + 1
    leaf = uses[i].below is None
    prefix, occurs = (s.prefix_below, s.occurs_below) if leaf else (s.prefix, s.occurs)
    stop = bisect_left(prefix, prefix[step] + dist, lo=step) if dist > 0 else step
    for p in uses[i].params if not uses[i].active else ():
        if s.recent.get(p, -10**10) > step or s.status[p] != 2:
            continue
        occ = occurs[p]
        k = bisect_left(occ, step)
        if k < len(occ) and occ[k] < stop:
            continue                                    # used again within the distance
        s.status[p] = 0
        s.live.discard(p)
        s.n_available -= s.numels[p]
        view = p in s.saved and p not in s.done and uses[i].forward
        s.log.append((-2 if view else -1, p, 0))        # -2: its storage lives on in the saved view
        if view:
            s.held.add(p)
        s.fresh.discard(p)


def replay(uses: tuple[Use, ...], numels: tuple[int, ...], dist: int, bucket: int,
           max_live: int, size: Callable[[int], int] = int, views: frozenset = frozenset()) -> list[Moment]:
    """The gathered storage (elements) at each fetch of one step with the trace complete: ``uses``
    the recorded order, ``numels`` each parameter's elements, ``dist`` ``stage3_max_reuse_distance``,
    ``bucket`` ``stage3_prefetch_bucket_size``, ``max_live`` ``stage3_max_live_parameters``. The step
    starts with every parameter released (the previous optimizer step's ``_partition_all_parameters``).
    ``size``: the storage counted for a tensor of so many elements (default: the elements). ``views``:
    the parameters whose forward storage autograd keeps through a view (``view_held``)."""
    s = _State(numels, size, [0] * len(numels), views=frozenset(views))
    out = []
    for i, use in _run(s, uses, dist, bucket, max_live):
        held = sum(s.sizes[p] for p in s.held - s.done)
        out.append(Moment(use, *_storage(s), s.n_available, _kept(s, s.used), _kept(s, use.params), s.waits, held))
    return out


def view_held(roles: tuple[str, ...]) -> frozenset:
    """Indices of the parameters whose gathered storage a layer's forward keeps alive until that layer's
    backward, whatever ZeRO-3 releases: fused experts, which transformers (5.24 ``integrations/moe.py``
    ``_grouped_linear``) multiplies as ``_grouped_mm(input, weight.transpose(-2, -1))`` (its eager loop:
    ``F.linear(x, self.gate_up_proj[expert_idx])``), so autograd saves a view of the storage, not the
    parameter: ZeRO-3's ``free_param`` (``param.data = torch.empty(0)``) frees nothing while the view
    lives (DeepSpeed's ``zero3_linear_wrap``, ``zero/linear.py``, saves the weight it is given: a
    parameter, whose storage ``free_param`` swaps out, for ``nn.Linear``; here a view, which keeps it).
    ``roles``: each parameter's (``ParamTensor.role``), ``expert`` held.
    Found by trace: Mixtral's real widths cut to 4 layers over 8 ranks held 11,322 MiB gathered at layer
    3's backward where the replay without it held 5,536."""
    return frozenset(i for i, r in enumerate(roles) if r == "expert")


def _run(s: _State, uses: tuple[Use, ...], dist: int, bucket: int, max_live: int):
    """The step's fetches in order: yields each use's index and itself after its fetch (and prefetch),
    releasing its parameters once the caller resumes."""
    s.prefix, s.prefix_below = [0], [0]
    first_bwd = next((k for k, u in enumerate(uses) if not u.forward), len(uses))
    s.recompute_from = first_bwd if any(u.forward for u in uses[first_bwd:]) else 0   # the first forward: no_grad
    for k, use in enumerate(uses):
        own = use.params if use.below is not None else ()                 # a leaf's own: none
        below = use.below if use.below is not None else use.params
        s.prefix.append(s.prefix[-1] + sum(s.numels[p] for p in own))
        s.prefix_below.append(s.prefix_below[-1] + sum(s.numels[p] for p in below))
        for p in own:
            s.occurs.setdefault(p, []).append(k)
        for p in below:
            s.occurs_below.setdefault(p, []).append(k)
    queue = deque((p, i) for i, use in enumerate(uses) for p in sorted(set(use.params)))
    for i, use in enumerate(uses):
        s.marks.append(len(s.log))
        _fetch(s, uses, i, queue, bucket, max_live)
        s.marks.append(len(s.log))
        yield i, use
        if not use.forward:
            s.done.update(use.params)
        _release(s, uses, i, dist)


def events(uses: tuple[Use, ...], numels: tuple[int, ...], dist: int, bucket: int,
           max_live: int, views: frozenset = frozenset()) -> tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]:
    """The gathered storage's allocations and frees at each use of ``replay``'s step, in order: per use,
    those of its fetch (before the module runs) and those of its release (after it), each
    (+1, key, elements) where a tensor of the engine's dtype is made (a parameter gathered alone into
    its own buffer, ``_all_gather_sequential``; a coalesced group's flat output; each member built from
    it by ``torch.cat`` at the group's first wait) and (-1, key, 0) where it is freed (a parameter
    released, ``__release_param``; the flat output when the group's last member leaves
    ``__inflight_param_registry``, coordinator v0.19.8 L406). Keys: a parameter's index, or minus a
    group's number for its flat output. What is still gathered after the last use stays so until the
    optimizer step partitions every parameter (the caller frees it). ``bucket`` 0 and ``dist`` 0: the
    run's first step, before the order is recorded (each module gathers its own parameters and releases
    them after its forward or backward: ``release_sub_module`` v0.19.8 L502-507). A parameter of ``views``
    released after its forward is (-2, key, 0): its storage lives on in the view autograd saved until
    its layer's backward (``view_held``)."""
    s = _State(numels, int, [0] * len(numels), views=frozenset(views), sizes=numels)
    for _ in _run(s, uses, dist, bucket, max_live):
        pass
    ends = s.marks[1:] + [len(s.log)]
    spans = [tuple(s.log[a:b]) for a, b in zip(s.marks, ends)]
    return tuple(zip(spans[0::2], spans[1::2]))


@lru_cache(maxsize=64)
def gather_events(params: tuple[tuple[str, int, int | None], ...], head: str | None, tied_head: int | None,
                  recompute: bool, dist: int, bucket: int, max_live: int, reduce_bucket: int = 0,
                  leaves: tuple[str, ...] = (), views: frozenset = frozenset(),
                  no_backward: frozenset = frozenset()) -> tuple:
    """The recorded order's uses, each as (forward, layer, whether it has parameters of its own, its
    fetch's ``events``, its release's, the elements of the gradient bucket's flat ``cat`` its backward's
    gradient hook makes, ``reduce_cats``, 0 for none), for the run's first step (no prefetch, each
    module's parameters released after it) and for the steps after it (the reductions are the same in
    both); arguments as ``gathered_zones``'s, and ``no_backward`` as ``without_backward``'s."""
    uses, numels = module_order(list(params), head, tied_head, recompute, leaves)
    uses = without_backward(uses, no_backward)
    cats = reduce_cats(uses, numels, reduce_bucket, persistent_by_module(list(params), head, leaves))
    return tuple(tuple((u.forward, u.layer, bool(u.params), *ev, cats.get(i, 0))
                       for i, (u, ev) in enumerate(zip(uses, events(uses, numels, d, b, max_live, views))))
                 for d, b in ((0, 0), (dist, bucket)))


def _call_key(name: str) -> tuple[int, int]:
    """A layer's modules in the order its forward calls them: the norm before attention, attention,
    the norm after it, the MLP (registration order, e.g. Llama's, lists the norms last); in a
    mixture-of-experts block the router (``mlp.gate``) before the experts, which its routing feeds
    (transformers 5.24 ``Qwen3MoeSparseMoeBlock`` registers ``experts`` first, ``modeling_qwen3_moe.py``
    L274-281, and calls ``self.gate`` first)."""
    part = (0 if ("input_layernorm" in name or ".ln_1." in name) else 1 if "attn" in name else
            2 if ("post_attention" in name or ".ln_2." in name) else 3)
    return part, 0 if name.endswith(".gate.weight") else 1


def _path(name: str, head: str | None, leaves: tuple[str, ...] = ()) -> list[str]:
    """The modules from the root to a parameter's own: the root (the task model, e.g.
    ``LlamaForCausalLM``), then the LM head, or the base model and the parameter's module path, cut
    at a ZeRO-3 leaf module among ``leaves`` (module paths): a leaf's submodules get no hooks, its
    own fetch gathers every parameter under it (DeepSpeed v0.19.8 ``parameter_offload.py``
    ``_register_deepspeed_module`` L350-356; ``partitioned_param_coordinator.py`` L364
    ``iter_params(recurse=is_leaf)``)."""
    parts = name.split(".")[:-1]
    for k in range(len(parts)):
        if ".".join(parts[:k + 1]) in leaves:
            parts = parts[:k + 1]
            break
    return ["<root>", "<head>"] if ".".join(parts) == head else ["<root>", "<base>"] + parts


def _key(path: list[str]) -> str:
    return ".".join(path)


def _tree(names: list[str], head: str | None, leaves: tuple[str, ...] = ()) -> dict:
    """The module tree of ``names`` in call order: every module path and the containers above it
    (a ``ModuleList``, the prefix before an index, is never called)."""
    root: dict = {}
    for name in names:
        path, node = _path(name, head, leaves), root
        for k in range(len(path)):
            if k + 1 < len(path) and path[k + 1].isdigit():
                continue
            node = node.setdefault(_key(path[:k + 1]), {})
    return root


def _forward_sorted(params: list[tuple[str, int, int | None]]) -> list[int]:
    """Indices of ``params`` in call order: each layer's modules by ``_call_key`` (stable), the
    layers in place among the tensors registered before and after them."""
    key = {i: (p[2], _call_key(p[0])) for i, p in enumerate(params) if p[2] is not None}
    out, layer = [], sorted(key, key=lambda i: key[i])
    for i, p in enumerate(params):
        if p[2] is None:
            out.append(i)
        elif i == min(key):
            out.extend(layer)
    return out


def _is_layer(path: str) -> bool:
    """A decoder layer's container: the path ends in the layer's index (``layers.3``, ``h.3``)."""
    return path.rsplit(".", 1)[-1].isdigit()


def _walk(tree: dict, pre: list[str], post: list[str]) -> None:
    for key, sub in tree.items():
        pre.append(key)
        _walk(sub, pre, post)
        post.append(key)


def module_order(params: list[tuple[str, int, int | None]], head: str | None, tied_head: int | None,
                 recompute: bool, leaves: tuple[str, ...] = ()) -> tuple[tuple[Use, ...], tuple[int, ...]]:
    """The recorded order of one step (``record_module`` at every fetch) and each parameter's elements,
    from ``params`` (name, elements on this rank's whole copy, layer) in registration order: the
    forward's pre-order, then the backward's reverse post-order (a module's backward pre-hook fires
    when its output's gradient is ready, ``parameter_offload.py`` ``_pre_backward_module_hook``), under
    ``recompute`` each layer's forward again right after its own backward hook (non-reentrant
    checkpointing unpacks the layer's first saved tensor in its backward). ``head`` names the LM
    head's module (last in forward, first in backward); a tied head (``tied_head``: the table's
    index) uses the embedding's parameter. Persistent parameters are left out (module docstring).
    ``leaves``: the module paths of ZeRO-3 leaf modules (``_path``), each one use with its subtree's
    parameters (a mixture-of-experts block's router and experts: ``quantities.zero3_gather._z3_leaves``)."""
    own: dict[str, list[int]] = {}
    for i, (name, numel, _) in enumerate(params):
        if numel > PERSISTENCE_THRESHOLD:
            own.setdefault(_key(_path(name, head, leaves)), []).append(i)
    if tied_head is not None:
        own["<root>.<head>"] = [tied_head]
    layer_of: dict[str, int] = {}
    for name, _, layer in params:
        path = _path(name, head, leaves)
        for k in range(3, len(path) + 1):
            if layer is not None and str(layer) in path[2:k]:
                layer_of[_key(path[:k])] = layer
    names = [params[i][0] for i in _forward_sorted(params)]
    tree = _tree(names + (["<head>.weight"] if tied_head is not None else []),
                 head if tied_head is None else "<head>", leaves)
    pre: list[str] = []
    post: list[str] = []
    _walk(tree, pre, post)
    under: dict[str, set[int]] = {k: set() for k in pre}   # every parameter at or under each module
    for j, ps in own.items():                            # (k == j or j.startswith(k + ".")): j's dotted prefixes
        for k in [j] + [j[:d] for d, c in enumerate(j) if c == "."]:
            if k in under:
                under[k].update(ps)
    below = {k: None if k.split("<base>.", 1)[-1] in leaves else tuple(sorted(under[k])) for k in pre}

    def use(forward: bool, k: str, active: bool = False) -> Use:
        return Use(forward, tuple(own.get(k, ())), layer_of.get(k), k, active, below[k])
    uses = [use(True, k) for k in pre]
    for k in reversed(post):
        uses.append(use(False, k))
        if recompute and _is_layer(k):
            chain = _last_chain(tree, k)
            uses.extend(use(True, j, j in chain) for j in pre if j == k or j.startswith(k + "."))
    return tuple(uses), tuple(n for _, n, _ in params)


def without_backward(uses: tuple[Use, ...], params: frozenset) -> tuple[Use, ...]:
    """``uses`` without the backward use of each module whose own parameters are all in ``params``, the
    modules whose backward never runs (the tied head, "<root>.<head>", kept). DeepSpeed fetches a module
    for backward from its output's gradient: a forward hook (``_pre_backward_module_hook``) wraps the
    outputs in ``PreBackwardFunctionForModule``, whose ``backward`` runs the pre-backward fetch (v0.19.8
    ``runtime/zero/parameter_offload.py`` L455-485, ``_run_before_backward_function``);
    an output that needs no gradient, a frozen embedding's over integer ids, is never reached by
    backward, so that module is not fetched and not recorded (trace, Llama-3.2-1B LoRA ZeRO-3: the
    tied table gathered for the embedding's and the head's forward and the head's backward only,
    released after the head's backward)."""
    if not params:
        return uses
    return tuple(u for u in uses if u.forward or not u.params or not set(u.params) <= params
                 or u.name == "<root>.<head>")


def _last_chain(tree: dict, key: str) -> set[str]:
    """``key`` and its last-called child, that one's, and so on: the modules whose backward hooks fire
    before a checkpointed layer is recomputed (each one's output gradient reaches its
    ``PreBackwardFunctionForModule`` before any node that unpacks a saved tensor, which recomputes the
    layer under non-reentrant checkpointing; a layer's output is its residual add of the MLP's, the MLP's
    its last projection's). Their parameters stay gathered through the recomputed forward: DeepSpeed frees
    a parameter only when no module using it is active (v0.19.8 ``partitioned_param_coordinator.py``
    ``__release_param``: ``not param.ds_active_sub_modules``), and their backward has begun."""
    def find(node: dict) -> dict | None:
        for k, sub in node.items():
            if k == key:
                return sub
            hit = find(sub)
            if hit is not None:
                return hit
        return None
    out, node = {key}, find(tree) or {}
    while node:
        last = list(node)[-1]
        out.add(last)
        node = node[last]
    return out


def persistent_by_module(params: list[tuple[str, int, int | None]], head: str | None,
                         leaves: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """The persistent parameters (``PERSISTENCE_THRESHOLD`` elements or fewer: norms, biases, a small
    router) by the key of the module that owns them, as ``module_order`` keys its uses: never fetched,
    but their gradients are reduced by their hooks like every other (``reduce_cats``)."""
    out: dict[str, list[int]] = {}
    for i, (name, numel, _) in enumerate(params):
        if 0 < numel <= PERSISTENCE_THRESHOLD:
            out.setdefault(_key(_path(name, head, leaves)), []).append(i)
    return {k: tuple(v) for k, v in out.items()}


def reduce_cats(uses: tuple[Use, ...], numels: tuple[int, ...], bucket: int,
                persistent: dict[str, tuple[int, ...]] | None = None) -> dict[int, int]:
    """Elements of the flat ``cat`` each of ZeRO-3's gradient bucket reductions makes during backward,
    by the index of the use whose gradient hook runs it: gradients join the bucket in the order backward
    makes them; a gradient that would take the bucket past ``reduce_bucket_size`` elements first reduces
    it (``reduce_independent_p_g_buckets_and_remove_grads``, v0.19.8 ``stage3.py`` L1583-1585; v0.14.2
    L1191-1243); a parameter's hook runs after its last use's backward (a tied table's at the
    embedding's, after the head's contribution). The reduction's ``reduce_scatter_coalesced``
    concatenates a bucket of several tensors into one new tensor (``comm/coalesced_collectives.py`` L122; one tensor alone is reduced in place). The last
    bucket, reduced after backward (``independent_gradient_partition_epilogue``), is not listed.
    ``persistent`` (``persistent_by_module``): the persistent parameters, never fetched, whose hooks
    still put their gradients in the bucket (``create_reduce_and_remove_grad_hooks``, v0.19.8
    ``stage3.py`` L1487-1559, hooks every parameter that requires a gradient), at their module's backward
    (found by trace: a 2-layer Llama ZeRO-3 over 4 ranks with 1e7-element buckets reduces four 8,390,656-
    element ``cat`` a step, two projections and a 2,048-element norm each). ``bucket`` 0: none."""
    first_bwd = next((i for i, u in enumerate(uses) if not u.forward), len(uses))
    last: dict[int, int] = {}                            # parameter -> its last backward use: a gradient
    for i in range(first_bwd, len(uses)):                # accumulates over every use (a tied table's over
        if not uses[i].forward:                          # the head's and the embedding's), then its hook
            last.update({p: i for p in uses[i].params + (persistent or {}).get(uses[i].name, ())})
    out: dict[int, int] = {}
    cur: list[int] = []
    for p, i in sorted(last.items(), key=lambda item: item[1]) if bucket > 0 else ():
        if cur and sum(cur) + numels[p] > bucket:
            out[i] = max(out.get(i, 0), sum(cur) if len(cur) > 1 else 0)
            cur = []
        cur.append(numels[p])
    return out


def _low_kept(mo: Moment, cat: int, bottom: int) -> int:
    """Under torch's ``F.linear``, a lower layer's backward moment: the storage gathered (``fresh``
    included: the forward's own storage, still gathered) and, beside it, the forward storage of every
    layer weight whose backward has not run that the coordinator has released (and re-gathered) since
    (``Moment.kept``), less the one layer's kept weights the bottom layer's moment counts itself
    (``deepspeed_linear_kept``, ``bottom``). At the fetch that includes the module's own weights; at
    its reduction's ``cat`` (the gradient hook after its backward, ``reduce_cats``) their forward
    storage is gone: ``MmBackward`` released its saved transposed view once it ran (torch
    ``torch/csrc/autograd/engine.cpp`` ``call_function``/``release_variables`` when the graph is not
    kept), and the coordinator's ``free_param`` had left nothing else holding it. Found by trace with
    DeepSpeed's linear wrapper left out (Llama-3-8B cut to 6 layers, dp 8, one token): the peak is
    layer 3's ``up_proj`` reduction ``cat`` with layers 0-2's and layer 3's remaining forward weights
    alive, where the bottom moment counted one layer's."""
    return max(mo.gathered + mo.kept, mo.gathered + mo.kept - mo.own_kept + cat) - bottom


@lru_cache(maxsize=256)
def gathered_zones(params: tuple[tuple[str, int, int | None], ...], head: str | None, tied_head: int | None,
                   recompute: bool, dist: int, bucket: int, max_live: int,
                   forward_storage_kept: bool, reduce_bucket: int, weight_bytes: int,
                   expandable: bool, leaves: tuple[str, ...] = (),
                   views: frozenset = frozenset()) -> tuple[int, int, int, int]:
    """Bytes ZeRO-3 holds gathered (each tensor's caching-allocator block, ``weight_bytes`` per element,
    ``allocator_rules.block_bytes`` under ``expandable`` segments or not), the most at each of four stretches of a step with the trace
    complete (``replay`` over ``module_order``): the top layer's forward; from the end of forward
    (the head's forward) through the modules above the layers in backward (the head's); the top
    layer's backward; the other layers' backward (the embedding's own backward, the last module, not
    included: ``deepspeed_gathered_embedding``).
    ``forward_storage_kept``: torch's ``F.linear`` keeps each layer's weights as its forward gathered
    them until its backward (``deepspeed_linear_kept`` counts that storage), so a layer's parameter
    still gathered since its forward use is not counted again. ``reduce_bucket``: ZeRO-3's
    ``reduce_bucket_size`` with every parameter trainable (0: none), whose reductions during backward
    (``reduce_cats``) make their flat ``cat`` beside what is gathered at that module's backward: counted
    there with it. ``leaves``: ZeRO-3 leaf modules' paths (``module_order``); ``views``: the parameters
    whose released forward storage autograd holds (``view_held``), counted beside the gathered."""
    uses, numels = module_order(list(params), head, tied_head, recompute, leaves)
    def size(n: int) -> int:
        return block_bytes(n * weight_bytes, expandable)     # (n,) engine dtype
    moments = replay(uses, numels, dist, bucket, max_live, size, views)
    top_layer = max((u.layer for u in uses if u.layer is not None), default=None)
    first_bwd = next(i for i, u in enumerate(uses) if not u.forward)
    head_fwd = max((i for i, u in enumerate(uses[:first_bwd]) if u.layer is None), default=0)

    def held(mo: Moment, cat: int = 0) -> int:
        """after the fetch (with the reduction's ``cat`` after its backward), or during its waits"""
        kept = mo.fresh if forward_storage_kept else -mo.views   # F.linear's kept weights: deepspeed_linear_kept
        return max(mo.gathered + cat, mo.waits) - kept
    fwd = [held(mo) for i, mo in enumerate(moments[:first_bwd]) if mo.use.layer == top_layer]
    cats = reduce_cats(uses, numels, reduce_bucket)
    head, top, low = [held(moments[head_fwd])], [], []
    bottom = sum(size(n) for _, n, layer in params if layer == 0 and n > PERSISTENCE_THRESHOLD)
    for i in range(first_bwd, len(moments) - 1):
        mo = moments[i]
        zone = head if mo.use.layer is None else top if mo.use.layer == top_layer else low
        if zone is low and forward_storage_kept:
            zone.append(_low_kept(mo, size(cats.get(i, 0)) if cats.get(i) else 0, bottom))
            continue
        zone.append(held(mo, size(cats[i]) if cats.get(i) else 0))
    top = top or head
    return max(fwd, default=0), max(head), max(top), max(low, default=max(top))
