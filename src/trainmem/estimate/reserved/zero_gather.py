"""DeepSpeed ZeRO-3's parameter gathers in the replay: the coordinator's recorded gathers, prefetches,
releases and reduce buckets (``_Zero3Replay``), else the embedding's and layers' gathers on the
all-gather stream (``_Zero3Fetch``)."""
from __future__ import annotations

from typing import Any

from ..quantities import Quantities
from .replay import GATHER_STREAM, GRAD_STREAM, _Replay


class _Zero3Fetch:
    """DeepSpeed ZeRO-3's gathers of the layers' parameters (``quantities.zero3_gather.deepspeed_layer_params``) on the
    all-gather stream, one micro-batch's forward and backward (nothing off ZeRO-3 over several ranks),
    where the coordinator's replay does not apply (``_Zero3Replay`` where it does).

    Before the module order is recorded (the run's first forward: ``is_complete_trace``, v0.19.8
    ``partitioned_param_coordinator.py`` L417-420) each module fetches its own parameters, each a
    whole tensor, and releases them after its forward (``release_sub_module`` L502-507: every parameter
    of the module while the trace is incomplete), and so again at its backward: one parameter alive at
    a time. Once it is recorded, each module's fetch also starts a prefetch (L451-480): parameters of
    the recorded order not gathered yet, whole, until they reach min(stage3_prefetch_bucket_size,
    stage3_max_live_parameters - the elements gathered or in flight) (``__n_available_params``: up at
    each all-gather L593, down at each release L630), gathered as one flat ``all_gather_coalesced``
    output (``partition_parameters.py`` ``_all_gather_dtype`` L1329-1350); the first of them fetched
    waits on the handle, which builds every parameter of the group by ``torch.cat``
    (``AllGatherCoalescedHandle.wait`` L761-803), and the flat output goes when the last of them is
    popped from ``__inflight_param_registry`` (coordinator L407-411). A layer's module and each of its
    parameters' modules fetch (modules without parameters of their own, attention and MLP, are left
    out), so the prefetch runs ahead up to the live-parameter limit: on Llama-3.2-1B cut to 2 layers
    (ZeRO-3 dp 4 bf16, one layer per group) trace's second forward holds both layers' flat outputs
    (116 MiB each) when the first layer's parameters are built. The top ``ds_layers_kept`` layers keep
    their parameters until their backward (``__params_to_release`` L634-664); the others are released
    after their forward and gathered again, one at a time, at their backward (the backward's prefetch
    is not replayed); the final norm and the head are left out."""

    def __init__(self, R: _Replay, q: Quantities, recorded: bool) -> None:
        self.numels, self.k = q.ds_layer_params, len(q.ds_layer_params)
        self.wb, self.stream = q.ds_param_bytes, GATHER_STREAM * q.ds_streams
        self.bucket = q.ds_prefetch if recorded else 0
        self.max_live, self.total = q.ds_max_live, q.layers * self.k
        self.kept_from = q.layers - q.ds_layers_kept if recorded else q.layers
        self.group_of: dict = {}  # parameter index -> its group
        self.flats: dict = {}     # group -> [flat handle, its parameters not yet fetched, (start, stop)]
        self.built: dict = {}     # parameter index -> handle, built from a flat output, not yet fetched
        self.held: dict = {}      # layer -> its parameters' handles, kept until its backward
        self.queue = 0            # the next parameter of the recorded order not yet taken
        self.avail = q.ds_emb_numel  # the embedding, fetched
        if self.k:
            self._prefetch(R)     # the embedding's fetch: the first group
        if not (q.ds_emb_kept and recorded):
            self.avail -= q.ds_emb_numel  # ... released after its forward

    def _numel(self, idx: int) -> int:
        return self.numels[idx % self.k]

    def _prefetch(self, R: _Replay) -> None:
        """One module's fetch: the next group's flat output, (n,) engine dtype."""
        most = min(self.bucket, self.max_live - self.avail)
        start, n = self.queue, 0
        while self.queue < self.total and n < most:
            n += self._numel(self.queue)
            self.queue += 1
        if n:
            g = len(self.flats)                                   # groups are never removed from flats
            self.group_of.update({j: g for j in range(start, self.queue)})
            self.flats[g] = [R.alloc(n * self.wb, self.stream), self.queue - start, (start, self.queue)]
            self.avail += n

    def _fetch(self, R: _Replay, idx: int) -> Any:
        """The parameter ``idx`` of the layers gathered: from its group's flat output, or on its own."""
        g = self.group_of.pop(idx, None)
        if g is None:                                             # not prefetched: fetched now
            self.queue = max(self.queue, idx + 1)
            self.avail += self._numel(idx)
            return R.alloc(self._numel(idx) * self.wb, self.stream)
        flat = self.flats[g]
        if idx not in self.built:                                 # the handle's wait: the group's parameters
            a, b = flat[2]                                        # built, each (numel,) by torch.cat
            self.built.update({j: R.alloc(self._numel(j) * self.wb, self.stream) for j in range(a, b)})
        flat[1] -= 1
        if flat[1] == 0:                                          # the last of the group popped
            R.free(flat[0])
        return self.built.pop(idx)

    def forward_end(self, R: _Replay) -> None:
        """The final norm and the head: left out."""

    def forward(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s forward: its module's fetch, then each parameter's module's."""
        if not self.k:
            return
        self._prefetch(R)
        for j in range(self.k):
            h = self._fetch(R, i * self.k + j)
            self._prefetch(R)
            if i >= self.kept_from:
                self.held.setdefault(i, []).append(h)
            else:
                R.free(h)                                         # released after its module's forward
                self.avail -= self._numel(j)

    def backward(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s backward (called after it): its kept parameters released, or each gathered and
        released in turn."""
        if i in self.held:
            R.frees(self.held.pop(i))
        elif self.k:
            for n in self.numels:
                R.free(R.alloc(n * self.wb, self.stream))


class _Zero3Replay:
    """DeepSpeed ZeRO-3's gathered parameters as the coordinator's replay makes and frees them
    (``quantities.zero3_gather.deepspeed_gather_events``, ``zero3_replay.events``), one micro-batch's forward and
    backward: every module fetch of the recorded order in turn, the parameters gathered alone, the
    prefetches' flat outputs, the members built from them and each release, each its own block of the
    engine's dtype on the all-gather stream (the ``torch.cat`` of ``AllGatherCoalescedHandle.wait`` runs
    in ``fetch_sub_module``'s stream context, v0.19.8 ``partitioned_param_coordinator.py`` L400). The
    replay's modules run in stretches around the compute the reserved replay knows: the root's and the
    embedding's forward fetches before the embedding, a layer's before its forward (``forward``), the
    final norm's and the head's before the head's, backward's first modules (root, head, base model,
    final norm) before the loss's backward (``backward_start``), a layer's backward fetches (under full
    recompute its forward's again among them) before its backward (``before``), the embedding's backward
    fetch last (``embedding``); each stretch's fetches in order, a module's releases before the next module with
    parameters is fetched (it has run by then), the last one's once the stretch's compute is done
    (``settle``). The run's first forward and backward, before the order is recorded, gather each
    module's own parameters and release them after it; what is still gathered at the end is released
    by the step (``done``)."""

    def __init__(self, R: _Replay, q: Quantities, recorded: bool) -> None:
        self.uses = q.ds_events[1 if recorded else 0]
        self.wb, self.stream = q.ds_param_bytes, GATHER_STREAM * q.ds_streams
        self.pos = 0
        self.live: dict = {}      # key (a parameter's index, or minus a group's number) -> its handle
        self.pending: list = []   # handles released by the stretch's modules, freed once its compute is done
        # under torch's F.linear (``quantities.zero3_gather.deepspeed_linear_kept``) a layer's weights released in its
        # forward stay alive in what autograd saved until that layer's backward: layer -> their handles
        self.keep = q.ds_linear_kept > 0
        self.saved: dict = {}
        self.cats: list = []      # the stretch's gradient-bucket reductions: elements of each flat ``cat``
        self.grad_stream = GRAD_STREAM * q.ds_streams
        self._run(R, lambda fwd, layer: fwd and layer is None)   # the root's and the embedding's forward

    def _apply(self, R: _Replay, events: tuple, later: bool, hold: int | None = None,
               layer: int | None = None) -> None:
        for sign, key, numel in events:
            if sign > 0:
                self.live[key] = R.alloc(numel * self.wb, self.stream)   # (numel,) engine dtype
            elif hold is not None or sign == -2:                  # -2: a saved view holds it (view_held)
                self.saved.setdefault(hold if hold is not None else layer, []).append(self.live.pop(key, None))
            elif later:
                self.pending.append(self.live.pop(key, None))
            else:
                R.free(self.live.pop(key, None))

    def _run(self, R: _Replay, take) -> None:
        """Run the uses from here on while ``take(forward, layer)`` holds: their fetches, and their
        releases (a flat output's free at a fetch at once; a parameter's once its module has run: at
        the next fetch of a module with parameters of its own, or after the stretch's compute)."""
        while self.pos < len(self.uses) and take(*self.uses[self.pos][:2]):
            fwd, layer, own, fetch, release, cat = self.uses[self.pos]
            self.cats.append(cat)
            if own:                                               # the modules before it have run
                self.settle(R)
            self._apply(R, fetch, later=False)
            self._apply(R, release, later=True, hold=layer if (self.keep and fwd) else None, layer=layer)
            self.pos += 1

    def settle(self, R: _Replay) -> None:
        """The stretch's compute done: its gradient buckets reduced, each a flat ``cat`` of the gradients
        in their dtype made and freed on the reduce stream (``quantities.zero_step.deepspeed_reduce_cats``), and the
        parameters its modules released freed."""
        for n in self.cats:
            R.free(R.alloc(n * self.wb, self.grad_stream))        # (n,) gradient dtype
        self.cats = []
        R.frees(self.pending)
        self.pending = []

    def forward(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s forward fetches (its module's and its children's)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: fwd and layer == i)

    def forward_end(self, R: _Replay) -> None:
        """The final norm's and the head's forward fetches."""
        self.settle(R)
        self._run(R, lambda fwd, layer: fwd and layer is None)

    def backward_root(self, R: _Replay) -> None:
        """Backward's first module use, the root's: its pre-backward hook runs at the gradient of the
        root's output, the loss, before the loss's backward (DeepSpeed v0.19.8 ``parameter_offload.py``
        ``_register_deepspeed_module`` puts ``PreBackwardFunctionForModule`` on each module's outputs;
        under a recorded order its fetch prefetches what comes next)."""
        self.settle(R)
        first = [True]

        def take(fwd: bool, layer: int | None) -> bool:
            ok, first[0] = first[0] and not fwd and layer is None, False
            return ok
        self._run(R, take)

    def backward_start(self, R: _Replay) -> None:
        """Backward's next modules' fetches (the head, the base model, the final norm): at their outputs'
        gradients, the head's once the loss's backward has made the logits' (in the run's first backward,
        each module's own parameters gathered there; trace, Llama GQA ZeRO-3 LoRA: the head's 501 MiB
        gathered after the loss's fp32 gradients are freed)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: layer is None)

    def before(self, R: _Replay, i: int) -> None:
        """Layer ``i``'s backward fetches (under full recompute its forward's again among them)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: layer == i)

    def backward(self, R: _Replay, i: int) -> None:
        """After layer ``i``'s backward: its modules' releases, and the weights its forward saved."""
        self.settle(R)
        R.frees(self.saved.pop(i, []))

    def embedding(self, R: _Replay) -> None:
        """The embedding's backward fetch (the last module's)."""
        self.settle(R)
        self._run(R, lambda fwd, layer: True)

    def done(self, R: _Replay) -> None:
        """Every parameter still gathered released (by the step's ``_partition_all_parameters``)."""
        self.settle(R)
        R.frees(list(self.live.values()) + [h for hs in self.saved.values() for h in hs])
        self.live, self.saved = {}, {}
