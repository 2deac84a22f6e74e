"""What one transformer layer saves for backward, op by op, in the dtype PyTorch really stores.

Every tensor is a pair of coefficients so that a layer's recipe is built once per (model, setup)
and evaluated for any batch and sequence length:

    elements = tok * (b * s) + sq * (b * s * s_kv)

``tok`` counts elements per token, ``sq`` per (query, key) pair (attention scores). Bytes follow
from the dtype: under autocast (CUDA policy, torch.amp) matmuls run in half precision and their
inputs are cast copies that autograd saves; ``layer_norm``, ``softmax``, ``log_softmax``, ``pow``
and the losses run in fp32; the residual stream keeps the embedding's dtype (fp32 with fp32
weights). Dropout saves a 1-byte bool mask on CUDA and nothing when p == 0. These rules come from
PyTorch's autocast op lists (aten/src/ATen/autocast_mode.cpp), its autograd formulas
(tools/autograd/derivatives.yaml) and the Hugging Face / nanoGPT model code the recipe mirrors
(the comment on each builder names the module). The tracer (``trainmem.trace``) runs the real
code and checks these recipes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from trainmem.errors import TrainmemError

from .group_events import Bwd, Fwd, at, index
from .nograd import NoGradLayer, NoGradSeq
from .nograd import bert_layer as nograd_bert
from .nograd import gpt2_block as nograd_gpt2
from .nograd import llama_layer as nograd_llama

F32, HALF = 4, 2


@dataclass(frozen=True)
class T:
    """A symbolic tensor: per-token and per-(token x key) element coefficients, and dtype bytes."""

    tok: float
    sq: float
    nbytes: int
    name: str = ""

    def bytes_coef(self) -> tuple[float, float]:
        return self.tok * self.nbytes, self.sq * self.nbytes


@dataclass(frozen=True)
class GroupT(T):
    """A forward group's temporary (``LayerCoefs.fwd_groups``) with sizes ``T`` cannot hold: ``pair`` elements
    per position pair (s, s), whatever the batch (the math SDPA kernel's causal mask, ``_math_kernel``);
    ``multi``: made only where the micro-batch holds more than one sequence (``matmul``'s copy of a strided
    query, a view at one sequence)."""

    pair: float = 0.0
    multi: bool = False


def group_coef(t: T) -> tuple[float, ...]:
    """A forward group's temporary as ``LayerCoefs.fwd_groups`` holds it: (bytes per token, per token x
    key), then, where it has them (``GroupT``), bytes per position pair and 1.0 where it is made only for
    more than one sequence (``reserved.parts._temp_bytes``)."""
    pair, multi = getattr(t, "pair", 0.0), getattr(t, "multi", False)
    return t.bytes_coef() + ((pair * t.nbytes, 1.0 if multi else 0.0) if pair or multi else ())


@dataclass
class Recipe:
    """Accumulates the tensors a layer saves (each storage once), the tensors the model's output
    holds without autograd saving them (``held``), and its backward transients.

    ``weights`` counts the matmul weight elements of the linears built so far (forward order): the
    backward of an op runs after the backward of every later op, whose weight gradients exist then.
    """

    saved: dict[int, T] = field(default_factory=dict)
    held: dict[int, T] = field(default_factory=dict)
    # ``held`` at a micro-batch of one sequence, where eager's and math's matmuls save the strided
    # (b, heads, s, d) views of an older release's cache as they are (``_cache_tensors``)
    held_b1: dict[int, T] = field(default_factory=dict)
    cache: float = 0.0  # bytes per token of the KV-cache copies the model output references
    transients: list[tuple[str, float, float, float, float, float, float, float]] = field(default_factory=list)
    weights: float = 0.0
    # per transient: the weight elements of the op itself whose autocast copy its backward has released
    own_cast: list[float] = field(default_factory=list)
    # per transient: of its tensors, bytes per token that are the layer's output gradient itself (``incoming``)
    incoming: list[float] = field(default_factory=list)
    # weight elements of the frozen linears built so far whose matmul saves the weight's half copy (LoRA
    # under autocast: ``Builder.frozen_linear``), and per transient how many there were then
    frozen: float = 0.0
    frozen_at: list[float] = field(default_factory=list)
    # of ``weights``: those of transformers' grouped experts, which ``_grouped_mm`` reads as they are
    # (no autocast rule: no half copy made, none freed in backward)
    uncast: float = 0.0
    fwd: tuple[float, float] = (0.0, 0.0)  # largest forward transient: (bytes, bytes per token of its output)
    fwd_scratch: float = 0.0  # largest dequantization peak before its matmul's output exists, bytes (quant4.py)
    # outputs of the ops torchtitan's per-op selective checkpointing may save (``op_checkpoint_saved``):
    # every ``aten.mm`` (a bias-free linear) in call order, and the fused SDPA kernels' outputs
    mm_outs: list[T] = field(default_factory=list)
    sdpa_outs: list[T] = field(default_factory=list)
    input_saved: bool = False  # a saved tensor is the layer's input itself (a norm in the input's dtype)
    graph_held: dict[int, T] = field(default_factory=dict)  # kept by autograd nodes outside save_for_backward
    graph_at: list[float] = field(default_factory=list)  # per transient: bytes per token of graph_held by then
    # LoRA, the first layer (``first_layer_unsaved``): its input needs no gradient, so what the ops
    # before the first adapter save, and the frozen linears on that grad-free input, autograd never keeps
    adapter_seen: bool = False
    # the grad-free tensor the first adapter reads, kept (not its id: once the tensor is gone, Python
    # may give a later tensor the same id, which then passed for it, run by run)
    free_input: Any = None
    prefix: frozenset = frozenset()      # ids saved before the first adapter
    post: set = field(default_factory=set)          # ids saved from the first adapter on
    free_extra: dict = field(default_factory=dict)  # saved in later layers only (adapter dropout masks)
    free_weights: list = field(default_factory=list)  # weight elements of the frozen linears on it
    first_adapter_op: int = -1  # index in ``transients`` of the first adapted linear (forward order)
    # tensors a layer makes in forward that may be freed there: frozen linears' inputs (when nothing
    # saves them) and RMSNorm's fp32 intermediates (``LayerCoefs.fwd_free``, the replay's free blocks)
    forward_only: dict = field(default_factory=dict)
    # eager attention's forward temporaries (``Builder._eager_forward``): how many tensors were saved
    # before its scores matmul, each temporary, and the events ("t", "fK", "s"; ``LayerCoefs.attn_events``)
    attn_at: int = -1
    attn_temps: list = field(default_factory=list)
    attn_events: list = field(default_factory=list)
    # other forward temporaries written in op order, as eager attention's: per group, how many tensors
    # were saved before it, each temporary, and the events (``Recipe.forward_group``: GPT-2's GELU,
    # Llama's RMSNorm and rotary embedding; ``Recipe.group_ahead``: the grouped-experts MoE block)
    fwd_groups: list = field(default_factory=list)
    # backward temporaries in op order (``Recipe.backward_group``: Llama's RMSNorm): per group, how many
    # transients were recorded before it (the op after it in forward order: its backward runs once that
    # op's has), how many tensors were saved before it, each temporary, and the events
    # (``LayerCoefs.bwd_groups``, ``reserved.layer_backward._group_backward``)
    bwd_groups: list = field(default_factory=list)
    # per transient: its tensors as (bytes per token, per token x key) each, and the index in ``linears`` of the linear whose backward it is (-1: none; ``at_linear``
    # while one is built): ``LayerCoefs.moment_blocks``, ``reserved.layer_backward._op_backward``
    moments: list = field(default_factory=list)
    # ... and per transient how many tensors the layer had saved by then (the ones its backward has not
    # released yet: ``reserved.layer_backward._release_saved``)
    moment_saved: list = field(default_factory=list)
    # bytes per token of the residual stream's gradient alive beside every backward op of the layer where
    # a branch's dropout made the branch's own (``_gpt2_branch_dropout``; ``LayerCoefs.resid_grad``)
    resid_grad: float = 0.0
    # a Llama decoder layer's residual stream written in op order (``_llama_layer``): ``down_proj``'s output
    # and the layer's output, made at the layer's end (``LayerCoefs.resid_tail``); () where not written
    resid_tail: tuple = ()
    at_linear: int = -1
    # each linear in forward order: (saved tensors before its weight is cast under autocast, weight
    # elements, bytes per element of its weight's gradient, 0 for a frozen one) (``LayerCoefs.linears``)
    linears: list = field(default_factory=list)
    # the indices in ``linears`` of those without a bias (``aten.mm``, not ``addmm``): ``LayerCoefs.mm_linears``
    mm_linears: list = field(default_factory=list)
    first_out: Any = None  # the first linear's output (``LayerCoefs.ws_at``: where the cuBLAS workspace is made)
    # of ``linear_in``'s tensors, those the layer's frames hold past their linear: id -> the saved tensor
    # made before it is released (its index), or -2 for the layer's end (``LayerCoefs.input_release``)
    input_release: dict = field(default_factory=dict)
    # ... and the tensor each reads, where autocast saves a half cast of it instead (None: it saves
    # the input itself, or the linear is frozen): ``LayerCoefs.linear_inputs``
    linear_in: list = field(default_factory=list)
    # a checkpointed layer's recomputation (full recompute; ``Recipe.recompute_moment``): the tensors
    # packed so far (saved tensors and frozen weights' copies), the moments of the recomputed forward
    # (live bytes per token beyond the saved ones, saved bytes so far, packs so far, whether at a pack),
    # and the gradients alive when backward first unpacks the layer (bytes per token, their stream
    # part, packs then). LoRA's frozen linears record them (``Builder.adapter``, ``frozen_linear``)
    packs: int = 0
    fwd_moments: list = field(default_factory=list)
    trigger: tuple = ()

    def save(self, *ts: T) -> None:
        for t in ts:
            self.saved[id(t)] = t
            self.packs += 1
            if self.adapter_seen:
                self.post.add(id(t))

    def recompute_moment(self, name: str, *live: T, at_pack: bool) -> None:
        """A moment of the layer's forward as its recomputation in backward runs it: ``live`` are the
        tensors the forward's Python frames hold then (the linear's input, peft's cast copy, the
        base output...), of which those not saved count beyond the saved tensors made so far.
        ``at_pack``: the moment is a pack itself (the last one is where non-reentrant checkpointing
        stops the recomputation, torch/utils/checkpoint.py ``_recomputation_hook.pack_hook``:
        ``raise _StopRecomputationError`` once ``recomp_counter`` reaches the forward's saved
        count); else it lies between packs and happens only if a later pack comes."""
        extra = {id(t): t for t in live if id(t) not in self.saved}
        so = [t.bytes_coef() for t in self.saved.values()]
        blocks = tuple(t.bytes_coef() for t in extra.values())
        self.fwd_moments.append((name, sum(a for a, _ in blocks), sum(b for _, b in blocks),
                                 sum(a for a, _ in so), sum(b for _, b in so), self.packs, at_pack, blocks))

    def recompute_moments(self, tok: float, sq: float) -> tuple[tuple[str, float, float, tuple], ...]:
        """Each recomputation moment as (name, bytes per token, per token x key, the unsaved tensors
        alive as (bytes per token, per token x key) each) over the whole layer's saved tensors, with
        the gradients alive since backward first unpacked the layer; () when that first unpack is
        not known (a pack after the last trigger recorded)."""
        if not self.trigger or self.trigger[2] != self.packs:
            return ()
        grads = self.trigger[0]
        return tuple((name, lt + st - tok + grads, ls + ss - sq, blocks)
                     for name, lt, ls, st, ss, k, at_pack, blocks in self.fwd_moments
                     if k < self.packs or (at_pack and k == self.packs))

    def first_layer_unsaved(self) -> list[T]:
        """Of the tensors a layer saves, those the first layer does not under LoRA: peft freezes the
        embeddings too, so the first layer's input requires no gradient, and autograd records no
        node (saves nothing) for an op none of whose inputs requires one (``torch/csrc/autograd``
        ``compute_requires_grad``; generated ``VariableType`` code builds ``grad_fn`` and its
        ``SavedVariable``s only under ``if (_any_requires_grad)``). Gradients start at the first
        adapter (``lora_A``'s weight), so the ops before it save nothing, nor does an adapter's
        dropout on the grad-free input save its mask (its output does not require grad)."""
        if not self.adapter_seen:
            return []
        out = {i: self.saved[i] for i in self.prefix if i not in self.post}
        out.update(self.free_extra)
        return list(out.values())

    def forward_group(self, temps: list, events: list, *saved: T) -> None:
        """Save ``saved`` with forward temporaries ``temps`` made and freed among them in op order, for
        the allocator replay (``reserved.layer_forward._attn_allocs``; ``LayerCoefs.fwd_groups``; codes
        ``group_events.Fwd``): "t" makes the next temporary, "fK" frees the K-th, "s" makes the next of ``saved``, "gK" frees the
        K-th once the tensor the caller makes next (the group's output) exists, "eK" once the layer's
        forward has returned (the replay: once the next layer's input exists, or where the layer makes
        its output, ``resid_tail``, then). The layer's input, made by the layer below (``_llama_norm_group``):
        "i" as the next of ``saved`` (its norm saves it), "j" as the next temporary (unsaved; the replay
        frees it once the layer's forward hooks have run); "cK" with the model's output (the KV cache's copies:
        ``_math_group``, ``_llama_rotary_cached_eager``), "hK" until the next "H" (``_llama_rotary_held``)."""
        assert events.count(Fwd.SAVED) + events.count(Fwd.INPUT) == len(saved)
        assert events.count(Fwd.TEMP) + events.count(Fwd.INPUT_TEMP) == len(temps)
        self.fwd_groups.append((len(self.saved), list(temps), list(events)))
        self.save(*saved)

    def group_ahead(self, temps: list, events: list, events_b1: list | None = None) -> None:
        """A group of forward temporaries as ``forward_group``'s whose saved tensors (its "s" events) the
        caller saves next, one ``save`` at a time: the ops between them record their backward moments
        (``transient``) among the saves (``_moe_forward_events``: the grouped experts' ops). ``events_b1``:
        its events where the micro-batch is one sequence, if they differ (``_math_group``)."""
        assert events.count(Fwd.TEMP) == len(temps)
        extra = (list(events_b1),) if events_b1 is not None else ()
        self.fwd_groups.append((len(self.saved), list(temps), list(events)) + extra)

    def backward_group(self, base: int, temps: list, events: list, cover: int = 0) -> None:
        """An op's backward tensors in op order, for the allocator replay only (``_op_backward``; the
        moments, ``transient``, are unchanged; codes ``group_events.Bwd``): "t" makes the next of ``temps``, "u" takes as the next the
        block an earlier group carried ("cK": its K-th, kept past its end; made where none is), "fK" frees the K-th, "sK" releases the layer's saved tensor ``base + K``
        (``Node::release_variables`` once its node has run), "wK" makes linear K's weight gradient (its
        ``.grad``), "hK" its half one under autocast as the next block, "xK" frees its half weight copy. Its
        temporaries left at the end are freed. ``cover``: the group is the backward of the ops whose moments
        are the next ``cover`` transients, which the replay then leaves out (``_op_backward``)."""
        assert sum(e in (Bwd.TEMP, Bwd.TAKE, Bwd.TAKE_STREAM) or e[0] == Bwd.HALF_GRAD for e in events) == len(temps)
        self.bwd_groups.append((len(self.transients), base, list(temps), list(events), cover))

    def hold(self, *ts: T, b1: tuple[T, ...] | None = None) -> None:
        """The model output references ``ts`` (``b1``: at a micro-batch of one, these instead)."""
        for t in ts:
            self.held[id(t)] = t
        for t in (ts if b1 is None else b1):
            self.held_b1[id(t)] = t

    def transient(self, name: str, *ts: T, const: float = 0.0, own_weights: float = 0.0,
                  own_uncast: float = 0.0, own_cast: float = 0.0, incoming: T | None = None) -> None:
        """A moment of this op's backward where ``ts`` are alive. Ops after it in forward order
        were back-propagated already, so only the tensors saved so far are still alive then:
        the recorded excess is relative to the whole layer's saved tensors. ``own_weights``: the
        weight elements of this op (a linear), whose gradient is part of ``const``; ``own_uncast``:
        of those, the elements autocast does not copy (grouped experts); ``incoming``: the one of
        ``ts`` that is the gradient of the layer's output as backward hands it to the layer (the
        residual stream's, alive until the branch before the last residual add is done), which a
        pipeline stage's top layer gets as its receive buffer (``quantities.layer_moments._layer_transients``)."""
        tok = sum(t.tok * t.nbytes for t in ts)
        sq = sum(t.sq * t.nbytes for t in ts)
        so_tok = sum(t.tok * t.nbytes for t in self.saved.values())
        so_sq = sum(t.sq * t.nbytes for t in self.saved.values())
        self.transients.append((name, tok, sq, const, so_tok, so_sq, self.weights + own_weights,
                                self.uncast + own_uncast))
        self.moments.append((tuple(t.bytes_coef() for t in ts), self.at_linear))
        self.moment_saved.append(len(self.saved))
        self.own_cast.append(own_cast)  # this op's weight elements whose half copy is freed by then
        self.incoming.append(incoming.tok * incoming.nbytes if incoming is not None else 0.0)
        self.frozen_at.append(self.frozen)
        self.graph_at.append(sum(t.tok * t.nbytes for t in self.graph_held.values()))

    def coefficients(self) -> tuple[float, float, dict[str, tuple[float, float]]]:
        """(bytes per token, bytes per token x key, per-name breakdown) of the saved tensors."""
        tok = sq = 0.0
        parts: dict[str, tuple[float, float]] = {}
        for t in self.saved.values():
            a, b = t.bytes_coef()
            tok += a
            sq += b
            key = t.name or "other"
            pa, pb = parts.get(key, (0.0, 0.0))
            parts[key] = (pa + a, pb + b)
        return tok, sq, parts


@dataclass(frozen=True)
class Policy:
    """Dtype policy of a precision setting."""

    amp: bool        # autocast active (fp32 weights, half matmuls)
    half: int        # bytes of the half type used by matmuls (2, or 4 in fp32 training)
    stream: int      # bytes of the residual stream (the embedding's dtype)
    weight: int      # bytes of a weight as stored

    @staticmethod
    def of(precision: str) -> "Policy":
        if precision == "fp32":
            return Policy(False, F32, F32, F32)
        if precision in ("bf16-amp", "fp16-amp"):
            return Policy(True, HALF, F32, F32)
        return Policy(False, HALF, HALF, HALF)


class Builder:
    """Helpers that mirror single PyTorch ops: what each saves and what it returns."""

    def __init__(self, pol: Policy, dropout: bool, sp_div: int = 1, capability: tuple[int, int] = (8, 0),
                 lora: tuple[tuple[str, int, int], ...] = (), lora_dropout: float = 0.0, lora_half: bool = False,
                 quant: tuple[int, int, int] = (0, 0, 0), quant_saves_input: bool = False, biased: tuple[str, ...] = (),
                 base_trains: bool = False, softmax_saves_input: bool = False, repeat_kv: bool = False,
                 math_upcast: bool = True):
        self.p = pol
        self.math_upcast = math_upcast  # PyTorch >= 2.5: SDPA's math kernel computes in fp32 (spec.releases)
        # --attention-call repeat-kv: SDPA gets K and V copied to the query's heads (litgpt's call)
        self.repeat_kv = repeat_kv
        self.softmax_saves_input = softmax_saves_input  # PyTorch < 1.11 (spec.releases)
        self.eager_clamp = False  # transformers' torch.max clamp of the masked scores (spec.tf_releases)
        self.fp16 = False  # the half type is fp16 (else bf16): softmax's half_to_float kernel, no fp32 copy
        self.norm_fp32_product = False  # torchtune 0.5-0.6.1's F.rms_norm: the fp32 normalized product saved
        self.biased = biased  # linears with a bias: ``addmm`` (not ``mm``) under F.linear / Conv1D
        self.addmm: tuple[str, ...] = ()  # the same, for the replay's backward order (``LayerKey.addmm``)
        # 4-bit base weights (quant4.py): bytes per element of the dequantized weight, of its cast to
        # the compute dtype and of the dequantization's scratch (torchao; 0, 0, 0: not quantized); old
        # MatMul4Bit saves its input
        self.quant, self.quant_saves_input = quant, quant_saves_input
        self.lora_dropout, self.lora_half = lora_dropout, lora_half
        # LoRA (peft): the base weights are frozen; the adapters' ranks by target module name
        self.lora = {name: rank for name, rank, _ in lora}
        # ... unless FSDP1 puts them in one flat parameter with the adapters (``base_trains``,
        # ``LayerKey.lora_base_trains``): then autograd treats them as trainable
        self.base_trains = bool(lora) and base_trains
        self.frozen = bool(lora) and not base_trains
        self.capability = capability  # the GPU's compute capability: which SDPA kernel runs
        self.r = Recipe()
        self.layer_input: T | None = None  # the layer's input (its residual stream), set by layer_coefficients
        self.dropout = dropout
        self.sp_div = sp_div
        # weight-gradient bytes per element while a linear's backward runs: the matmul's grad in
        # the compute dtype and, under autocast, its fp32 cast that becomes param.grad
        self.wgrad_bytes = (HALF + F32) if pol.amp else pol.weight
        # tensors the layer's forward frames hold while the linears below run (the norm's output the
        # attention or the MLP got), set by the layer builder: ``Recipe.recompute_moment``
        self.outer_live: tuple[T, ...] = ()
        self.ring = 1  # PyTorch's context parallelism: the ranks its ring attention runs over (_ring_attention)
        self.rms_input = False  # --rms-norm input: ``rms_norm_hf`` is ``rms_norm_input`` (old lit-gpt RMSNorm)
        self.manual_ln = False  # ModelSpec.manual_layernorm: ``layer_norm`` is ``layer_norm_manual``
        self.liger = False  # --liger: Liger-Kernel's RMSNorm and SwiGLU Functions (``rms_norm_liger``, ``_liger_swiglu``)
        # a gradient alive through the backward of the linears built while it is set (``_linear_backward``):
        # a post-LN layer's residual gradient, waiting for its MLP branch (``_bert_layer``)
        self.waiting_grad: tuple[T, ...] = ()

    # -- ops ------------------------------------------------------------------------------
    def t(self, tok: float, nbytes: int, name: str, sq: float = 0.0) -> T:
        return T(tok, sq, nbytes, name)

    def matmul_in(self, x: T, name: str) -> T:
        """Input of a linear/matmul as autograd saves it: a fresh half copy when autocast casts it."""
        if self.p.amp and x.nbytes != HALF:
            x = T(x.tok, x.sq, HALF, name)
        self.r.save(x)
        return x

    def linear(self, x: T, out: float, name: str, saved_name: str, in_features: float | None = None,
               out_name: str = "") -> T:
        """``F.linear``/``addmm``: saves the (cast) input; weight copies are counted separately.
        ``out_name``: the name of its output where a later op saves it. A linear without a bias
        runs ``aten.mm`` (``at::linear`` folds a 3-D input into ``matmul``); with one ``addmm``."""
        if self.frozen:
            return self.frozen_linear(x, out, name, saved_name, in_features)
        free_in = self.grad_starts(x) if self.base_trains else False
        if free_in:
            self.r.free_weights.append((x.tok if in_features is None else in_features) * out)
        xin = self.matmul_in(x, saved_name)
        y = T(out, 0.0, self.p.half, out_name or name)
        if not any(name == b or name.endswith("." + b) for b in self.biased):
            self.r.mm_outs.append(y)
        in_features = xin.tok if in_features is None else in_features
        w = in_features * out
        self.r.linears.append((len(self.r.saved), w, self.p.weight))  # (under autocast, cast after its input)
        if not any(name == b or name.endswith("." + b) for b in self.addmm):
            self.r.mm_linears.append(len(self.r.linears) - 1)
        if self.r.first_out is None:
            self.r.first_out = y
        self.r.linear_in.append(x if xin is not x else None)
        self.r.at_linear = len(self.r.linears) - 1
        self._linear_backward(name, x, xin, out, w)
        self.r.at_linear = -1
        self.r.weights += w
        rank = self.lora_rank_of(name)
        if rank:  # a LoRA target in a mixed FSDP1 unit: the trainable base, then the adapter
            self.adapter(x, name, saved_name, rank, free_in)
        return y

    def _linear_backward(self, name: str, x: T, xin: T, out: float, w: float) -> None:
        """A linear's backward moments. Without autocast: grad_out, grad_in and the weight gradient
        alive together. Under autocast (fp32 weights) ``MmBackward0`` makes grad_in and the weight
        gradient in the half dtype beside grad_out and everything saved; when it returns autograd
        releases what it saved (``Node::release_variables``: the half copy of the weight and, when
        autocast cast the input for it alone, that copy) and grad_out, and ``ToCopyBackward0`` then
        casts the weight gradient to fp32 while the half one is referenced: two moments, each below
        the sum of all of them. Found by trace: Llama-2-7B's ``down_proj`` (bf16-amp, 4 layers,
        FSDP2 dp 8, full recompute), 376 MiB counted where 204 and 172 MiB are alive."""
        wait = self.waiting_grad
        if not (self.p.amp and self.wgrad_bytes == HALF + F32):
            self.r.transient(f"{name}.backward", T(out, 0, self.p.half), T(xin.tok, 0, self.p.half), *wait,
                             const=w * self.wgrad_bytes, own_weights=w)
            return
        # MmBackward0: (b, s, out) and (b, s, in) gradients, the (in, out) weight gradient, half
        self.r.transient(f"{name}.backward", T(out, 0, self.p.half), T(xin.tok, 0, self.p.half), *wait,
                         const=w * HALF, own_weights=w)
        # ToCopyBackward0: grad_in, the half and the fp32 weight gradients; the input's own half copy freed
        own_input = [T(-xin.tok, 0, HALF)] if xin is not x else []
        self.r.transient(f"{name}.backward.cast", T(xin.tok, 0, self.p.half), *own_input, *wait,
                         const=w * (HALF + F32), own_weights=w, own_cast=w)

    def grad_starts(self, x: T) -> bool:
        """A trainable weight meets ``x`` (``base_trains``: the layer's base weights are views of a
        flat parameter that requires grad). In the first layer, whose input (the frozen embedding's
        output) requires no gradient, this is where gradients start: what was saved before is
        not (``Recipe.first_layer_unsaved``). Returns whether ``x`` is that grad-free input."""
        if not self.r.adapter_seen:
            self.r.prefix, self.r.free_input, self.r.adapter_seen = frozenset(self.r.saved), x, True
        return x is self.r.free_input

    def lora_rank_of(self, name: str) -> int:
        """The LoRA rank of the linear ``name`` (0: not a target)."""
        return next((r for t, r in self.lora.items() if name == t or name.endswith("." + t)), 0)

    def frozen_linear(self, x: T, out: float, name: str, saved_name: str, in_features: float | None = None) -> T:
        """A linear whose weight is frozen (LoRA training, peft ``tuners/lora/layer.py`` ``Linear``).
        The base ``F.linear`` saves no input: a frozen weight needs no gradient, and the input's
        gradient needs only the weight (``mm`` saves ``self`` only when ``mat2`` requires grad).
        A LoRA target adds ``lora_B(lora_A(dropout(x)))``: peft casts ``x`` to the adapter's dtype
        (``_cast_input_dtype``; adapters are fp32 over half weights, ``autocast_adapter_dtype``),
        ``lora_A`` saves that input (under autocast its half cast), ``lora_B`` the rank-r result."""
        rank = self.lora_rank_of(name)
        self.r.forward_only[id(x)] = x
        if not self.quant[0]:  # (a 4-bit weight is dequantized instead: ``dequantized``)
            self.r.linears.append((len(self.r.saved), (x.tok if in_features is None else in_features) * out, 0))
            self.r.linear_in.append(None)
        # the first layer (Recipe.first_layer_unsaved): is this linear's input the grad-free one?
        free_in = not self.r.adapter_seen or x is self.r.free_input
        if free_in:
            self.r.free_weights.append((x.tok if in_features is None else in_features) * out)
        elif not self.quant[0]:
            # its input needs a gradient, so ``mm`` saves the weight it multiplies: under autocast the
            # half copy of the frozen weight (not cached: autocast caches only leaves that require grad,
            # aten/src/ATen/autocast_mode.cpp ``cached_cast``), freed when its ``MmBackward0`` releases it
            # (a linear on the first layer's grad-free input saves none: ``first_free_weights``)
            self.r.frozen += (x.tok if in_features is None else in_features) * out
        if rank and not self.r.adapter_seen:
            self.r.prefix, self.r.free_input, self.r.adapter_seen = frozenset(self.r.saved), x, True
            self.r.first_adapter_op = len(self.r.transients)  # this linear's transient comes next
        # a bitsandbytes Linear4bit returns its output in its input's dtype (``Linear4bit.forward``:
        # ``matmul_4bit(x.to(compute_dtype), ...).to(inp_dtype)``, nn/modules.py L251-258 at
        # 0.42.0, L548-555 at 0.49.0): fp32 under autocast when its input is the fp32 residual
        # stream (peft's prepare_model_for_kbit_training casts the norms and embeddings to fp32)
        out_bytes = x.nbytes if self.quant[0] else self.p.half
        if not free_in and not self.quant[0]:
            self._frozen_pack(x, out, out_bytes, name, rank)
        if rank:
            self.adapter(x, name, saved_name, rank, free_in, (out, out_bytes))
        # backward: grad_out and grad_in, no weight gradient
        dq = self.dequantized(x, out, name, in_features, out_bytes)
        self.r.at_linear = -1 if self.quant[0] else len(self.r.linears) - 1
        self.r.transient(f"{name}.backward", T(out, 0, out_bytes), T(x.tok, 0, x.nbytes if self.quant[0] else
                                                                       self.p.half), const=dq)
        self.r.at_linear = -1
        return T(out, 0.0, out_bytes, name)

    def _frozen_pack(self, x: T, out: float, out_bytes: int, name: str, rank: int) -> None:
        """The base ``mm`` of a frozen linear whose input needs a gradient packs the weight (its half
        copy under autocast): a pack of a recomputed layer (``Recipe.recompute_moment``), with the
        linear's input and the frames' tensors alive. Without an adapter, when it is the layer's last
        pack its ``MmBackward0`` is the first node to unpack, fed the gradient of the layer's output
        (the residual stream's, and its cast to this output's dtype where the residual add casts it:
        ``AddBackward0`` hands each input the gradient in its own dtype)."""
        self.r.packs += 1
        if rank:
            return  # peft's adapter follows (``adapter``)
        self.r.recompute_moment(f"{name}.recompute", x, *self.outer_live, at_pack=True)
        stream = out / self.sp_div * self.p.stream
        self.r.trigger = (stream + (out * out_bytes if out_bytes != self.p.stream else 0.0), stream,
                          self.r.packs)

    def adapter(self, x: T, name: str, saved_name: str, rank: int, free_in: bool,
                base: tuple[float, int] = (0.0, 0)) -> None:
        """peft's ``lora_B(lora_A(dropout(x)))`` beside the base linear (``tuners/lora/layer.py``
        ``Linear.forward``): ``x`` cast to the adapter's dtype (``_cast_input_dtype``; fp32 adapters
        over half weights, ``autocast_adapter_dtype``), ``lora_A`` saves that input (under autocast
        its half cast), ``lora_B`` the rank-r result. In a mixed FSDP1 unit (``base_trains``) the
        adapters are views of the unit's flat parameter, in its dtype: the stored weights' (fp32 under
        autocast), ``param_dtype`` (bf16) under FSDP's mixed precision."""
        if self.base_trains:
            adapter = self.p.weight                                        # the flat parameter's dtype
        else:
            adapter = x.nbytes if (self.lora_half or x.nbytes == F32) else F32   # peft upcasts to fp32
        if self.lora_dropout > 0:
            # nn.Dropout on the (cast) input: a 1-byte mask and a new dropped tensor
            mask = T(x.tok, x.sq, 1, f"lora.{name}.dropout_mask")
            self.r.save(mask)
            if free_in:
                self.r.free_extra[id(mask)] = mask
        xc = x if adapter == x.nbytes else T(x.tok, x.sq, adapter, saved_name)   # peft's cast copy
        dropped = T(x.tok, x.sq, adapter, saved_name) if self.lora_dropout > 0 else xc
        # under autocast lora_A saves its half cast (per call), else the cast and/or dropped copy, or x itself
        xin = T(x.tok, x.sq, HALF, saved_name) if self.p.amp else dropped
        self.r.save(xin)
        if base[0] and not self.base_trains:
            self._adapter_moments(x, xc, dropped, name, rank, base)
        else:
            self.r.save(T(rank, 0, HALF if self.p.amp else adapter, f"lora.{name}"))

    def _adapter_moments(self, x: T, xc: T, dropped: T, name: str, rank: int, base: tuple[float, int]) -> None:
        """peft's ``Linear.forward`` (``tuners/lora/layer.py`` L1088-1110) as a recomputation runs it,
        after the base output ``result`` (``base``: its width and bytes per element): ``x`` cast to
        the adapter's dtype (``_cast_input_dtype``: ``xc``, a local until the forward returns), its
        dropout (``dropped``, freed when ``lora_A`` returns), ``lora_A`` packs its input, ``lora_B``
        the rank-r result (and its weight's copy); then, between packs, ``lora_B``'s output times
        ``scaling`` (both alive), ``result + ...`` (promoted: fp32 over a half base with fp32
        adapters) and ``result.to(torch_result_dtype)``. Backward first unpacks the layer at
        ``lora_B``'s ``MmBackward0`` when this is its last linear: alive then are the residual stream's
        gradient, its cast to the output's dtype, the sum's gradient cast to the base output's
        dtype where the sum was promoted (``ToCopyBackward0``, ``AddBackward0``) and the scaled
        gradient ``MulBackward0`` made for ``lora_B``, in the sum's dtype."""
        out, res_bytes = base
        res = T(out, 0, res_bytes)
        frames = (x, xc, *self.outer_live)
        self.r.recompute_moment(f"{name}.lora_A", res, dropped, *frames, at_pack=True)
        lo_bytes = HALF if self.p.amp else xc.nbytes              # lora_B's output (autocast: half)
        self.r.save(T(rank, 0, lo_bytes, f"lora.{name}"))
        self.r.recompute_moment(f"{name}.lora_B", res, *frames, at_pack=True)
        sum_bytes = max(res_bytes, lo_bytes)                       # type promotion of result + lora
        lora_out, scaled, total = T(out, 0, lo_bytes), T(out, 0, lo_bytes), T(out, 0, sum_bytes)
        self.r.recompute_moment(f"{name}.lora_B.scale", res, lora_out, scaled, *frames, at_pack=False)
        self.r.recompute_moment(f"{name}.lora.add", res, scaled, total, *frames, at_pack=False)
        if sum_bytes != res_bytes:
            self.r.recompute_moment(f"{name}.lora.cast", total, T(out, 0, res_bytes), *frames, at_pack=False)
        stream = out / self.sp_div * self.p.stream
        grads = (stream + (out * res_bytes if res_bytes != self.p.stream else 0.0)
                 + (out * res_bytes if sum_bytes != res_bytes else 0.0) + out * sum_bytes)
        self.r.trigger = (grads, stream, self.r.packs)

    def dequantized(self, x: T, out: float, name: str, in_features: float | None, out_bytes: float = 0) -> float:
        """A bitsandbytes 4-bit base weight (``Linear4bit`` -> ``MatMul4Bit``, quant4.py): bytes of its
        dequantized copy (the quant state's dtype, plus the cast to the compute dtype when they differ),
        made in forward (``F.linear(A, dequantize_4bit(B).to(A.dtype).t())``, bitsandbytes 0.42.0
        ``autograd/_functions.py`` L516) and again in backward (L546). Records the forward transient
        (that copy and the matmul's output) and, before bitsandbytes 0.43.2, saves the input (L522-523).
        A torchao NF4 weight (``linear_nf4``, quant4.py) is the same with ``get_original_weight``'s
        scratch beside the weight before the matmul runs: in forward a moment of its own
        (``fwd_scratch``), in backward one where only ``grad_output`` (``out_bytes`` per element)
        exists beside it (torchao ``nf4tensor.py`` v0.1 L409-435, L572-574)."""
        dq_bytes, cast_bytes, scratch = self.quant
        if not dq_bytes:
            return 0.0
        w = (x.tok if in_features is None else in_features) * out
        if self.quant_saves_input:
            # ``ctx.tensors = (A, B)``: A kept by the node itself, alive as long as the graph. A is
            # ``x.to(compute_dtype)``, and before bitsandbytes 0.48 the first input's dtype (fp32 or
            # bf16) becomes the compute dtype (``set_compute_type``), so A is the input itself
            self.r.save(x)
            self.r.graph_held[id(x)] = x
        dq = w * (dq_bytes + cast_bytes)
        if dq > self.r.fwd[0]:
            self.r.fwd = (dq, out * self.p.half)
        if scratch:
            peak = w * (dq_bytes + scratch)
            self.r.fwd_scratch = max(self.r.fwd_scratch, peak)
            self.r.transient(f"{name}.backward.dequantize", T(out, 0, out_bytes), const=peak)
        return dq

    def layer_norm(self, x: T, name: str) -> T:
        """``F.layer_norm`` (autocast fp32): saves the (fp32) input and fp32 mean/rstd per token."""
        if self.manual_ln:
            return self.layer_norm_manual(x, name)
        xin = x
        if self.p.amp and x.nbytes != F32:
            xin = T(x.tok, 0, F32, name)
        if self.base_trains:  # one op with the trainable weight: it saves all of it
            self.grad_starts(x)
        self.r.save(T(xin.tok, 0, xin.nbytes, name), T(2, 0, F32, name + ".stats"))
        self.r.input_saved |= xin is x and x is self.layer_input  # no cast: the input itself is saved
        return T(x.tok, 0, F32 if self.p.amp else x.nbytes, name + ".out")

    def layer_norm_manual(self, x: T, name: str) -> T:
        """A LayerNorm in Python ops: Raschka's LLMs-from-scratch ``LayerNorm.forward``
        (``ch05/10_llm-training-speed/00_orig.py`` L126-130 at 28c65cd): ``mean = x.mean(-1, keepdim)``;
        ``var = x.var(-1, keepdim, unbiased=False)`` saves ``x`` (the input itself, (b, s, h) x's
        dtype); ``norm_x = (x - mean) / torch.sqrt(var + eps)``: ``div`` saves both operands, the
        centred ``x - mean`` ((b, s, h) x's dtype) and the ``sqrt`` output ((b, s, 1) x's dtype, which
        ``SqrtBackward0`` saves as its result: the same tensor); ``self.scale * norm_x`` saves
        ``norm_x`` ((b, s, h)) for the weight's gradient; ``+ self.shift`` saves nothing. Three
        (b, s, h) tensors and one per token, where ``F.layer_norm`` saves one and two fp32 stats
        (tests/test_raschka.py counts them on the CPU). Output: x's dtype (fp32 and pure bf16 only:
        ``ModelSpec.manual_layernorm`` is refused under autocast, whose casts are not modelled here)."""
        if self.base_trains:
            self.grad_starts(x)
        self.r.save(x, T(x.tok, 0, x.nbytes, name + ".centred"), T(1, 0, x.nbytes, name + ".stats"),
                    T(x.tok, 0, x.nbytes, name + ".normalized"))
        self.r.input_saved |= x is self.layer_input
        return T(x.tok, 0, x.nbytes, name + ".out")

    def rms_norm_hf(self, x: T, name: str, rows: float = 1) -> T:
        """Hugging Face LlamaRMSNorm (Python ops): ``x.float()`` saved by ``pow``/``mul``; ``rsqrt``
        output (fp32, one per normalised row: per token, or per head and token for Qwen3's
        ``q_norm``/``k_norm`` over ``head_dim``, ``rows``); the normalised tensor cast back to the
        input dtype, saved by the multiply with the weight. Output dtype: weight dtype x input
        dtype promotion. Under ``--rms-norm input`` the norm is ``rms_norm_input``. ``norm_fp32_product``
        (torchtune 0.5-0.6.1's ``F.rms_norm(x.float(), weight=scale).to(x.dtype)``,
        spec.frameworks.torchtune_norm_saves_fp32): the multiply with the weight takes the fp32
        normalized tensor, which it saves (4 B), its fp32 product is transient and the output is cast
        back to the input's dtype."""
        if self.liger:
            return self.rms_norm_liger(x, name, rows)
        if self.rms_input:
            return self.rms_norm_input(x, name, rows)
        x32 = x if x.nbytes == F32 else T(x.tok, 0, F32, name)
        self.r.save(T(x32.tok, 0, F32, name), T(rows, 0, F32, name + ".stats"))
        # forward only: ``pow(2)``'s fp32 output (reduced by ``mean``) and ``x * rsqrt(...)``'s fp32
        # product (cast to the input dtype): freed within the forward (the replay's free blocks)
        for part in ("pow", "normed32"):
            t = T(x.tok, 0, F32, f"{name}.{part}")
            self.r.forward_only[id(t)] = t
        self.r.input_saved |= x32 is x and x is self.layer_input  # x.float() of an fp32 input is the input
        normed = T(x.tok, 0, F32 if self.norm_fp32_product else x.nbytes, name)  # a new tensor either way
        if not self.frozen:  # weight * normed saves normed only for the weight's gradient
            if self.base_trains:  # the first op with a trainable weight (x.float(), pow, rsqrt are not)
                self.grad_starts(x)
            self.r.save(normed)
        if self.norm_fp32_product:
            return T(x.tok, 0, x.nbytes, name + ".out")  # (weight * normed32).to(x.dtype)
        return T(x.tok, 0, max(self.p.weight, x.nbytes), name + ".out")

    def rms_norm_liger(self, x: T, name: str, rows: float = 1) -> T:
        """Liger-Kernel's ``LigerRMSNorm`` (``--liger``; casting_mode "llama", in_place=True for
        Llama, Mistral and Qwen2: transformers/rms_norm.py L7-41 at v0.6.4): one autograd Function,
        ``LigerRMSNormFunction`` (ops/rms_norm.py v0.6.4 L527-580, saved at L563; v0.3.0 L269-301; v0.8.2
        L612-664),
        whose ``ctx.save_for_backward(X, W, RSTD)`` keeps the input itself (``X.view(-1, dim)`` of
        the contiguous residual stream: no copy, ``ensure_contiguous``), the weight (a parameter)
        and ``RSTD``, one fp32 per row (``rstd_dtype = torch.float32`` in the llama and gemma modes,
        L389-390). v0.8.2 saves ``(X, RSTD)`` when the weight is None (elementwise_affine=False),
        the same activations. The Triton kernel makes no intermediate: the output is ``torch.empty``
        in X's dtype (L386), so nothing is freed within the forward (HF's ``pow`` and fp32 product
        are not made). Backward writes dX into dY in place (``dX = dY`` when in_place, L461-462) and
        sums an (sm_count, h) fp32 partial weight gradient (L454, L522: a few MiB, left out). A frozen weight
        (LoRA) changes nothing: X and RSTD are what dX needs."""
        if self.base_trains:  # one Function with the trainable weight: it saves all of it
            self.grad_starts(x)
        self.r.save(x, T(rows, 0, F32, name + ".stats"))   # X itself (its dtype), RSTD fp32 per row
        self.r.input_saved |= x is self.layer_input
        return T(x.tok, 0, x.nbytes, name + ".out")        # Y = torch.empty((n_rows, n_cols), dtype=X.dtype)

    def rms_norm_input(self, x: T, name: str, rows: float = 1) -> T:
        """An RMSNorm computed in its input's dtype (``--rms-norm input``): lit-gpt's ``RMSNorm.forward``
        before 6178c7cc (2023-10-24; ``lit_gpt/rmsnorm.py`` L17-21 at 8641822) and lightning-thunder's
        copy of it until PR2342 (2024-03-04; ``thunder/tests/lit_gpt_model.py`` L116-120 at 07da9a31b):
        ``norm_x = torch.mean(x * x, dim=-1, keepdim=True); x_normed = x * torch.rsqrt(norm_x + eps);
        return self.weight * x_normed``. ``x * x`` and ``x * rsqrt`` save ``x`` itself (no copy: the
        layer's input or the residual after attention, which nothing else keeps), ``rsqrt`` its output
        (one per row, in x's dtype: ``RsqrtBackward0`` saves ``result``), ``weight * x_normed`` saves
        ``x_normed`` (x's dtype) for the weight's gradient (none for a frozen weight). Forward only:
        ``x * x`` (x's dtype), reduced by ``mean``. Output: weight dtype x input dtype promotion."""
        self.r.save(x, T(rows, 0, x.nbytes, name + ".stats"))
        sq = T(x.tok, 0, x.nbytes, f"{name}.pow")
        self.r.forward_only[id(sq)] = sq
        self.r.input_saved |= x is self.layer_input
        if not self.frozen:
            if self.base_trains:
                self.grad_starts(x)
            self.r.save(T(x.tok, 0, x.nbytes, name))
        return T(x.tok, 0, max(self.p.weight, x.nbytes), name + ".out")

    def drop(self, x: T, p: float, name: str, keep_output: bool = False) -> T:
        """Dropout: a 1-byte mask when p > 0 (CUDA's fused kernel); identity when p == 0."""
        if p <= 0 or not self.dropout:
            if keep_output:
                self.r.save(x)
            return x
        self.r.save(T(x.tok, x.sq, 1, name + ".mask"))
        y = T(x.tok, x.sq, x.nbytes, name)
        if keep_output:
            self.r.save(y)
        if self.frozen and not x.sq:  # (LoRA: a residual branch's dropout, ``_dropout_pack``)
            self._dropout_pack(x, y, name)
        return y

    def _dropout_pack(self, x: T, y: T, name: str) -> None:
        """``native_dropout`` on a residual branch packs its mask, with its input and output alive
        (``Recipe.recompute_moment``). When it is the layer's last pack (GPT-2's ``resid_dropout``
        after ``mlp.c_proj``) its backward is the first node to unpack, fed the layer's output
        gradient and, where the residual add casts it, its cast to the branch's dtype
        (``AddBackward0`` hands each input the gradient in its own dtype)."""
        self.r.recompute_moment(f"{name}.recompute", x, y, *self.outer_live, at_pack=True)
        stream = x.tok * self.p.stream
        self.r.trigger = (stream + (x.tok * x.nbytes if x.nbytes != self.p.stream else 0.0), stream, self.r.packs)

    def sdpa(self, impl: str, head_dim: int, heads: float, kv_heads: float, p_drop: float) -> str:
        """The SDPA backend for this layer (``sdpa_backend``; ``impl`` may pin one)."""
        p = p_drop if (p_drop > 0 and self.dropout) else 0.0
        gqa = heads != kv_heads and not self.repeat_kv  # repeat-kv: SDPA sees the copies, equal heads
        return sdpa_backend(self.p.half, head_dim, gqa, capability=self.capability,
                            pinned=impl if impl in SDPA_PINS else None, dropout=p)

    def attention(self, q: T, k: T, v: T, heads: float, kv_heads: float, head_dim: int, impl: str,
                  p_drop: float, softmax_fp32_then_cast: bool, dropout_before_cast: bool = False) -> T:
        """Scaled dot-product attention; returns the context tensor the output projection consumes.

        eager: Python ops (``_eager_attention``). ``sdpa`` and the pinned kinds run the backend
        PyTorch's CUDA dispatcher picks (``sdpa_backend``), after transformers repeated K/V to the
        query's heads where it does not pass ``enable_gqa`` (``sdpa_repeats_kv``; the repeated copies
        are what the kernel then saves).
        """
        if impl == "eager":
            return self._eager_attention(q, k, v, heads, kv_heads, head_dim, p_drop, softmax_fp32_then_cast,
                                         dropout_before_cast)
        backend = self.sdpa(impl, head_dim, heads, kv_heads, p_drop)
        if heads != kv_heads and (self.repeat_kv or sdpa_repeats_kv(heads, kv_heads, head_dim)):
            # (b, heads, s, d) copies of K and V in their dtype: transformers' repeat_kv, or litgpt's
            # ``k.expand(B, groups, q_per_kv, T, hs).reshape(B, -1, T, hs)`` (``--attention-call
            # repeat-kv``, trace/cuda.py ``litgpt_call``), which is what the kernel then saves. With
            # one key/value head (multi-query) the reshape only drops a size-1 dimension: a view with
            # a zero head stride, so the kernel saves K and V themselves (nothing new) and its
            # backward makes dk, dv at the query's heads, as for grouped-query heads (kv_heads kept)
            if kv_heads > 1:
                k = T(heads * head_dim, 0, k.nbytes, "attn.k_repeated")
                v = T(heads * head_dim, 0, v.nbytes, "attn.v_repeated")
                kv_heads = heads
        if backend == "math":
            return self._math_attention(v, heads, kv_heads, head_dim, p_drop if self.dropout else 0.0)
        return self._fused_attention(backend, q, k, v, heads, kv_heads, head_dim)

    def _eager_attention(self, q: T, k: T, v: T, heads: float, kv_heads: float, head_dim: int,
                         p_drop: float, softmax_fp32_then_cast: bool, dropout_before_cast: bool = False) -> T:
        """``matmul(q, k^T)`` saves q and k (GQA: the repeated k/v copies), softmax saves its fp32
        output (autocast runs softmax in fp32), the probabilities cast back to half are saved by
        ``matmul(p, v)`` (or the dropout output and its mask); the ``(b, h, s, d)`` result is copied
        by ``transpose(1, 2).contiguous()`` into the context.

        Backward runs ``p @ v``'s, the dropout's, the cast's and softmax's in reverse order, each
        holding the gradient it receives and the one it makes, while only the tensors saved before it
        are still alive (``Recipe.transient``): ``p @ v`` with every probability tensor saved; the
        dropout with the mask and softmax's output; softmax with its output alone. transformers'
        eager attention casts before the dropout (Llama: ``softmax(dtype=float32).to(q.dtype)``,
        GPT-2: ``.type(value.dtype)``) except BERT's (``dropout_before_cast``: dropout in the softmax
        dtype, then autocast's cast inside the matmul). Found by trace: BERT-base pure bf16 at 1 x
        2048 with recompute, where layer 0's attention backward is the peak: +26% before (one
        backward moment holding the dropped probabilities, the mask and an fp32 gradient)."""
        half = self.p.half
        rep = heads / kv_heads
        if rep > 1:  # repeat_kv materialises expanded copies that matmul saves
            k = T(k.tok * rep, 0, k.nbytes, "attn.k_repeated")
            v = T(v.tok * rep, 0, v.nbytes, "attn.v_repeated")
        self.r.save(q, k, v)
        if not (self.eager_clamp or self.softmax_saves_input or dropout_before_cast or (p_drop > 0 and self.dropout)):
            self._eager_forward(heads, softmax_fp32_then_cast)
        if self.eager_clamp:
            # ``torch.max(attn_weights, torch.tensor(finfo.min))`` after the mask is added (older
            # transformers, ``spec.tf_releases.eager_clamp``): MaximumBackward saves its input, the
            # masked scores (b, heads, s, s), in the dtype of scores + mask: the mask is built in the
            # embeddings' dtype, the residual stream's (fp32 under autocast), so the wider of the two
            self.r.save(T(0, heads, max(half, self.p.stream), "attn.scores_clamp_input"))
        if self.softmax_saves_input:
            # PyTorch < 1.11 (``spec.releases``): SoftmaxBackward keeps softmax's input, the masked
            # scores (b, heads, s, s): fp32 under autocast (its fp32 cast) or in fp32 training; in
            # pure half the half scores (``dtype=float32`` upcasts inside the kernel, half_to_float)
            self.r.save(T(0, heads, F32 if (self.p.amp or half == F32) else half, "attn.softmax.input"))
        # softmax output as saved: fp32 under autocast, in fp32 training, or when the model asks
        # for dtype=float32 (Llama); else the half type
        sm = F32 if (self.p.amp or half == F32 or softmax_fp32_then_cast) else half
        probs = T(0, heads, sm, "attn.softmax")
        self.r.save(probs)
        # softmax's backward: the gradient of its output and ``_softmax_backward_data``'s, in its dtype
        self.r.transient("attn.softmax.backward", T(0, heads, sm), T(0, heads, sm))
        drop = p_drop > 0 and self.dropout
        dd = sm if dropout_before_cast else half  # the dtype the dropout runs in
        if sm != half and not (drop and dropout_before_cast):  # the half cast's backward: half in, fp32 out
            self.r.transient("attn.probs_cast.backward", T(0, heads, half), T(0, heads, sm))
        if drop:
            self.r.save(T(0, heads, 1, "attn.probs_dropout.mask"))
            self.r.transient("attn.dropout.backward", T(0, heads, dd), T(0, heads, dd))
            if dd != half:  # autocast's cast of the dropped probabilities, after the dropout
                self.r.transient("attn.probs_cast.backward", T(0, heads, half), T(0, heads, dd))
            pv = T(0, heads, half, "attn.probs")  # dropout output (or its half cast) feeds p @ v
        elif sm != half:
            pv = T(0, heads, half, "attn.probs")  # the half copy p @ v consumes
        else:
            pv = probs
        self.r.save(pv)
        # p @ v's backward: the probabilities' gradient (half) and v's
        self.r.transient("attn.pv.backward", T(0, heads, half), T(v.tok, 0, half))
        return T(heads * head_dim, 0, half, "attn.context")

    def _eager_forward(self, heads: float, fp32_then_cast: bool) -> None:
        """Eager attention's forward temporaries, each (b, heads, s, s), in op order for the allocator
        replay (``reserved.layer_forward._saved_and_casts``), beside the two tensors it saves: softmax's output and the
        probabilities' half copy. transformers 5.24.0 ``models/qwen2/modeling_qwen2.py``
        ``eager_attention_forward`` L155-159 (Llama, Mistral, Mixtral the same; GPT-2
        ``models/gpt2/modeling_gpt2.py`` L59-67, softmax without ``dtype``, its cast on the next line):
        ``matmul(q, k^T)`` (A, half) ``* scaling`` (B, half; A freed: ``mul`` by a Python scalar saves
        nothing), ``+ attention_mask`` (C; B freed: ``add`` saves nothing), in the wider of the scores'
        dtype and the mask's, which is built in the embeddings' dtype (the residual stream's: fp32 under
        autocast); ``softmax(C, dtype=float32)`` (D, fp32, saved by ``_softmax``'s backward) and
        ``.to(query.dtype)`` (E, saved by ``matmul(p, v)``), C freed when ``attn_weights`` is rebound
        after both (GPT-2: after D). torch 2.13 ``aten/src/ATen/native/SoftMax.cpp`` ``softmax``: a CUDA
        fp16 input with ``dtype=float`` runs ``_softmax(input, dim, half_to_float=true)``; any other
        (bf16) is first copied ``input_.toType(dtype)`` (F, fp32, freed once D is made: ``_softmax``
        saves its result, not its input). Under autocast C is fp32 already (softmax is on autocast's
        fp32 list, ``autocast_mode.cpp``, a no-op cast), and ``query`` is fp32 (rotary's fp32 ``cos``),
        so E is ``matmul``'s own bf16 cast, made after the rebinding frees C. Trace, Qwen2 b2 s1024
        pure bf16: A, B, -A, C, -B, F, D, -F, E, -C (56 and 112 MiB blocks), where the replay made D
        and E alone. Not written with dropout (its mask and output between), BERT's softmax before its
        cast, the clamp of older transformers or PyTorch < 1.11's saved softmax input: there the
        temporaries are left out."""
        half, r = self.p.half, self.r
        c = max(half, self.p.stream)                     # scores + mask: the wider dtype
        copy = fp32_then_cast and c == HALF and not self.p.amp and not self.fp16  # bf16 -> fp32 copy
        r.attn_at = len(r.saved)                         # D is the next saved tensor
        r.attn_temps = [T(0, heads, half), T(0, heads, half), T(0, heads, c)] + ([T(0, heads, F32)] if copy else [])
        ev = [Fwd.TEMP, Fwd.TEMP, Fwd.free(0), Fwd.TEMP, Fwd.free(1)] + (
            [Fwd.TEMP, Fwd.SAVED, Fwd.free(3)] if copy else [Fwd.SAVED])
        sm = F32 if (self.p.amp or half == F32 or fp32_then_cast) else half
        if sm == half:                                   # E is D: one saved tensor
            ev.append(Fwd.free(2))
        elif fp32_then_cast and not self.p.amp:          # D, E on one line, then C rebound
            ev += [Fwd.SAVED, Fwd.free(2)]
        else:                                            # C rebound before E is made
            ev += [Fwd.free(2), Fwd.SAVED]
        r.attn_events = ev

    def _math_attention(self, v: T, heads: float, kv_heads: float, head_dim: int, p_drop: float = 0.0) -> T:
        """at::_scaled_dot_product_attention_math: computes in fp32 (half inputs are upcast), scales
        q and k^T by sqrt(scale) (the matmul saves both; GQA expands k and v to all heads first),
        _safe_softmax saves its fp32 output and p @ v saves p and v (an fp32 copy when upcast or
        expanded). Its (b, h, s, d) output is copied into the context by transpose().contiguous().

        With dropout (``dropout_p > 0`` in training) the math path does not call ``native_dropout``
        (a bool mask): aten/src/ATen/native/transformers/attention.cpp builds the mask as
        ``at::empty_like(attn).bernoulli_(1 - p).div_(1 - p)`` and multiplies, so ``attn * mask``
        saves the fp32 mask (4 bytes per score) and p @ v saves the fp32 dropped probabilities
        instead of the softmax output (which softmax's backward keeps). Read off the ops on a CPU
        run of ``F.scaled_dot_product_attention`` under ``sdpa_kernel(MATH)`` (the same composite
        runs on CUDA): 8 more bytes per score element, tested against trace."""
        if not self.math_upcast:
            return self._math_attention_input_dtype(v, heads, kv_heads, head_dim, p_drop)
        half = self.p.half
        expand = heads != kv_heads
        vv = v if (not expand and half == F32) else T(heads * head_dim if expand else v.tok, 0, F32,
                                                      "attn.math.v")
        self.r.save(T(heads * head_dim, 0, F32, "attn.math.q_scaled"),
                    T(heads * head_dim, 0, F32, "attn.math.k_scaled"), vv)
        if p_drop == 0:
            self._math_scores(heads)
        self.r.save(T(0, heads, F32, "attn.math.softmax"))
        # backward, in reverse (as ``_eager_attention``): softmax's with its output alone alive, then
        # the dropout multiply's with its mask, then p @ v's with every probability tensor; each
        # holds the fp32 gradient it receives and the one it makes
        self.r.transient("attn.math.backward", T(0, heads, F32), T(0, heads, F32))
        if p_drop > 0:
            self.r.save(T(0, heads, F32, "attn.math.dropout_mask"))
            self.r.transient("attn.math.dropout.backward", T(0, heads, F32), T(0, heads, F32))
            self.r.save(T(0, heads, F32, "attn.math.probs_dropped"))
        self.r.transient("attn.math.pv.backward", T(0, heads, F32), T(vv.tok, 0, F32))
        return T(heads * head_dim, 0, half, "attn.context")

    def _math_scores(self, heads: float) -> None:
        """The math kernel's forward temporary, for the allocator replay (``reserved.layer_forward._attn_allocs``), as
        ``_eager_forward`` writes eager attention's: the scores, (b, heads, s, s) in fp32, made by the
        ``matmul`` of the scaled query and key, the causal mask added in place, then ``_safe_softmax``
        makes its output (saved) and the scores are freed when ``attn`` is rebound to it (torch 2.13
        ``aten/src/ATen/native/transformers/attention.cpp`` ``_scaled_dot_product_attention_math``:
        ``auto attn = at::matmul(q, k)``, ``attn.add_(*attn_mask)``, ``attn = at::_safe_softmax(attn,
        -1)``). Trace, Qwen2.5-0.5B (2 layers) b1 s1024 fp32: ``bmm`` 56 MiB, ``_safe_softmax`` 56 MiB,
        then the scores freed, in every forward and every recomputed one. Not written with dropout
        (its fp32 mask and dropped probabilities between)."""
        self.r.attn_at = len(self.r.saved)               # the softmax output is the next saved tensor
        self.r.attn_temps = [T(0, heads, F32)]
        self.r.attn_events = [Fwd.TEMP, Fwd.SAVED, Fwd.free(0)]

    def _math_attention_input_dtype(self, v: T, heads: float, kv_heads: float, head_dim: int,
                                    p_drop: float) -> T:
        """The math kernel before PyTorch 2.5 (``spec.releases.math_sdpa_upcasts``), in its inputs'
        dtype ``d`` (``self.p.half``): pytorch/pytorch 008887dc (the 2.1 line) attention.cpp
        ``_scaled_dot_product_attention_math``: ``query = query_ * sqrt(scale)`` (b, h, s, hd) and
        ``key.transpose(-2, -1) * sqrt(scale)``, both saved by ``at::matmul``'s bmm (a key with fewer
        heads is broadcast: ``expand`` + ``reshape``, a copy at the query's heads); the causal mask
        (``ones(L, S, bool).tril()`` made additive) is added in place, ``at::softmax`` saves its
        (b, h, s, s) output in d, ``at::dropout`` (CUDA: ``native_dropout``, a 1-byte mask) saves its
        mask and ``matmul(attn, value)`` the dropped probabilities and the value (a broadcast one
        copied at the query's heads). Backward holds two (b, h, s, s) gradients in d at a time."""
        d = self.p.half
        expand = heads != kv_heads
        vv = T(heads * head_dim, 0, d, "attn.math.v") if expand else v
        self.r.save(T(heads * head_dim, 0, d, "attn.math.q_scaled"),    # (b, h, s, hd) query * sqrt(scale)
                    T(heads * head_dim, 0, d, "attn.math.k_scaled"),    # (b, h, hd, s) scaled key (copy)
                    vv, T(0, heads, d, "attn.math.softmax"))            # (b, h, s, s) probabilities
        self.r.transient("attn.math.backward", T(0, heads, d), T(0, heads, d))
        if p_drop > 0:
            self.r.save(T(0, heads, 1, "attn.math.dropout_mask"), T(0, heads, d, "attn.math.probs_dropped"))
            self.r.transient("attn.math.dropout.backward", T(0, heads, d), T(0, heads, d))
        self.r.transient("attn.math.pv.backward", T(0, heads, d), T(vv.tok, 0, d))
        return T(heads * head_dim, 0, d, "attn.context")

    def _fused_attention(self, backend: str, q: T, k: T, v: T, heads: float, kv_heads: float,
                         head_dim: int) -> T:
        """Flash / memory-efficient / cuDNN kernels save q, k, v (k and v with their own heads),
        the output and an fp32 logsumexp per (head, token) (autograd's saved tensors of
        ``_scaled_dot_product_{flash,efficient,cudnn}_attention``). Their output has q's memory
        layout, (b, s, h, d), so the context the output projection saves is the same storage.

        Flash with head_dim not a multiple of 8: ``scaled_dot_product_attention`` (attention.cpp)
        pads q, k, v with ``pad_last_dim<8, false>`` (``at::pad``: new (b, h, s, d8) tensors, which
        the kernel saves instead of the originals), runs on them and slices the (b, h, s, d8) output
        (``post_process_flash_output``); transformers' ``transpose(1, 2).contiguous()`` then copies
        the slice into the context (sdpa_attention.py:205-206).
        """
        half = self.p.half
        dp = -(-head_dim // 8) * 8 if backend == "flash" else head_dim
        if dp != head_dim:
            q = T(heads * dp, 0, half, "attn.q_padded")
            k = T(kv_heads * dp, 0, half, "attn.k_padded")
            v = T(kv_heads * dp, 0, half, "attn.v_padded")
        out = T(heads * dp, 0, half, "attn.sdpa_out")
        lse = T(heads, 0, F32, "attn.logsumexp")
        self.r.save(q, k, v, out, lse)
        self.r.sdpa_outs += [out, lse]  # the kernel op's outputs (its RNG state tensors: a few bytes)
        ctx = out if dp == head_dim else T(heads * head_dim, 0, half, "attn.context")
        if self.ring > 1:
            # PyTorch's ring attention (states.torch_cp) returns the merger's output, ``self._out.to(
            # out_dtype)`` of an fp32 (b, h, s, d) tensor built by ``torch.cat`` (torch 2.13
            # _context_parallel/_attention.py ``_SDPAMerger.results``, ``_partial_update``): (b, h, s, d)
            # in memory, not the kernel's (b, s, h, d), so transformers' ``transpose(1, 2).contiguous()``
            # copies it (sdpa_attention.py) and the output projection saves that copy beside the output
            # the attention node saves
            ctx = T(heads * head_dim, 0, half, "attn.context")
        grads = _sdpa_grads(q, k, v, heads * dp, half)  # d(out) in flight, then dq, dk, dv: each a tensor
        if self.ring > 1:
            self._ring_backward(backend, q, k, v, heads, kv_heads, dp)
        elif backend == "flash":
            # flash_api.cpp mha_bwd: softmax_d (fp32 per head and token) and the fp32 dq accumulator
            # with head_dim rounded to 32 (<= 128) or 64; GQA: dk, dv expanded to all query heads
            d_r = -(-dp // (32 if dp <= 128 else 64)) * (32 if dp <= 128 else 64)
            gqa = T(2 * heads * dp if heads != kv_heads else 0, 0, half)
            self.r.transient("attn.flash.backward", *grads, T(heads, 0, F32), T(heads * d_r, 0, F32), gqa)
        elif backend == "cudnn":
            # cudnn-frontend SDPA backward: the fp32 dQ accumulator (b, h, s, d); the engine's own
            # workspace (get_workspace_size) is not known from source and not counted
            self.r.transient("attn.cudnn.backward", *grads, T(heads * head_dim, 0, F32))
        else:
            self.r.transient("attn.efficient.backward", *grads, T(heads, 0, F32))
        return ctx

    def _ring_backward(self, backend: str, q: T, k: T, v: T, heads: float, kv_heads: float, dp: int) -> None:
        """The backward of PyTorch's ring attention (torch 2.13 ``_context_parallel/_attention.py``
        ``_templated_ring_attention_backward`` L488-655, rotate method "allgather", head-tail load
        balancing) on context-parallel rank 0, the rank trace reports (every rank but the last
        computes iterations i >= 1 on the second half of its queries, ``query.chunk(2)[1]``). At the
        kernel call of such an iteration, per local token, beside the saved tensors: the residual
        stream's gradient, which waits for the attention branch (as in ``mlp.act.backward``); the
        output's gradient (``grad_out``, half); the fp32 accumulators ``zeros_like(query/key/value,
        dtype=float32)`` (L513-515; from i = 2 on the key/value ones are views of the last received
        buffer, as large); the key/value all-gather ``ft_c.all_gather_single(cat([k, v]))`` (``ring``
        ranks' keys and values in half) and the ``torch.cat`` that fed it, kept by ``next_kv``; the
        fp32 ``cat([grad_key, grad_value])`` sent by the last iteration and the all-to-all output
        awaiting ``next_buffer`` (``_AllToAllRotater``, L253-270); the previous call's dq, dk, dv (its
        outputs stay bound until this call returns) and this call's (dq for half the queries);
        ``logsumexp.chunk(2)[1].contiguous()``; and the kernel's own scratch for half the queries (the
        flash backward's ``softmax_d`` and fp32 dq accumulator, its key/value gradients expanded to
        the query's heads for GQA: ``_fused_attention``'s terms)."""
        half = self.p.half
        kv = k.tok + v.tok
        x = self.layer_input  # the residual stream's gradient (its dtype) waits for the attention branch
        ring = [T(x.tok if x is not None else 0.0, 0, x.nbytes if x is not None else half),
                T(heads * dp, 0, half),                         # grad_out, (b, h, s, d)
                T(q.tok + k.tok + v.tok, 0, half),              # the previous call's dq, dk, dv
                T(q.tok / 2 + kv, 0, half),                     # this call's (half the queries)
                T(q.tok + 3 * kv, 0, F32),                      # fp32 dq, dk/dv (or received), sent cat, all-to-all out
                T(kv * (self.ring + 1), 0, half),               # the all-gather of k, v and its cat input
                T(heads / 2, 0, F32)]                           # the logsumexp half, made contiguous
        if backend == "flash":
            d_r = -(-dp // (32 if dp <= 128 else 64)) * (32 if dp <= 128 else 64)
            ring.append(T((heads * d_r + heads) / 2, 0, F32))
            if heads != kv_heads:
                ring.append(T(2 * heads * dp, 0, half))
        elif backend == "cudnn":
            ring.append(T(heads * dp / 2, 0, F32))
        else:
            ring.append(T(heads / 2, 0, F32))
        self.r.transient(f"attn.ring_{backend}.backward", *ring)


# ----- which kernel F.scaled_dot_product_attention runs (PyTorch 2.13, CUDA) ---------------------
# The rules below restate PyTorch's CUDA dispatcher for dense 4-D inputs without an explicit mask
# (transformers passes ``is_causal`` and no mask for unpadded training batches): the filters of
# ``can_use_flash_attention`` / ``can_use_mem_efficient_attention`` / ``can_use_cudnn_attention``
# and ``select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, the shared
# checks of sdp_utils_cpp.h, and transformers' integrations/sdpa_attention.py (which repeats K/V
# itself or passes ``enable_gqa``). docs/attention.md has the table with the source lines;
# ``trainmem.trace.cuda.CudaEmulation`` makes the same choice from the tensors themselves.

#: cuDNN runtime version of the PyPI torch 2.13.0 wheels (CUDA 13.0, nvidia-cudnn-cu13 9.20.0.48)
CUDNN_VERSION = 92000
#: the SDPA backend each ``--attention`` value pins (``torch.nn.attention.sdpa_kernel``); ``flash``
#: (transformers' flash_attention_2) runs the same kernel in the workload
SDPA_PINS = {"flash": "flash", "sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa-math": "math",
             "sdpa-cudnn": "cudnn"}


def sdpa_repeats_kv(heads: float, kv_heads: float, head_dim: int, mask: bool = False) -> bool:
    """transformers ``sdpa_attention_forward``: with grouped-query attention it passes
    ``enable_gqa=True`` when ``use_gqa_in_sdpa`` holds (CUDA: no mask and k/v head_dim <= 256,
    sdpa_attention.py:43-52, 129-131), else ``repeat_kv`` copies K and V to the query's heads
    (``expand`` + ``reshape``, :20-28, :136-138) and SDPA sees no GQA."""
    return heads != kv_heads and (mask or head_dim > 256)


def sdpa_priority(capability: tuple[int, int] = (8, 0)) -> tuple[str, ...]:
    """The order ``select_sdp_backend`` tries: the global default (flash, efficient, math, cudnn;
    Context.h:481-486) unless ``check_prefer_cudnn_attention`` puts cuDNN first (cuDNN > 9.15.0 on
    sm90 / sm10x with a CUDA 13 build, sdp_utils.cpp ``priority_order``): the torch 2.13 wheels
    ship cuDNN 9.20, so H100/H200/B200 run cuDNN attention first."""
    if capability[0] in (9, 10) and CUDNN_VERSION > 91500:
        return ("cudnn", "flash", "efficient", "math")
    return ("flash", "efficient", "math", "cudnn")


def _flash_refusal(half: int, head_dim: int, capability: tuple[int, int], dropout: float) -> str:
    """``can_use_flash_attention``: check_head_dim_size_flash (q, k, v last dims equal and <= 256;
    any size: the composite pads it to a multiple of 8), check_flash_attention_hardware_support
    (sm80..sm121), check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120,
    check_dtypes_flash_attention (fp16/bf16). GQA passes with ``enable_gqa`` (check_batch_size_and_
    num_heads_dense<true>)."""
    if half != HALF:
        return "flash attention takes fp16/bf16 only (check_dtypes_flash_attention), not fp32"
    if head_dim > 256:
        return f"flash attention needs head_dim <= 256 (check_head_dim_size_flash), got {head_dim}"
    if not (8, 0) <= capability <= (12, 1):
        return f"flash attention needs sm80..sm121, not sm{capability[0]}{capability[1]}"
    if ((8, 6) <= capability <= (8, 9) or capability >= (12, 0)) and \
            (192 < head_dim <= 224 or (head_dim > 224 and dropout > 0)):
        return (f"flash attention cannot train head_dim {head_dim} on sm{capability[0]}{capability[1]} "
                "(check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120)")
    return ""


def _efficient_refusal(half: int, head_dim: int, sees_gqa: bool, capability: tuple[int, int]) -> str:
    """``can_use_mem_efficient_attention``: check_mem_efficient_hardware_support (sm50..sm121),
    check_head_dim_size_mem_efficient (last dims divisible by ``minimum_gemm_alignment``: 8 for
    fp16/bf16, 4 for fp32 on sm80+), dense inputs with equal head counts (2.13 builds
    ``check_batch_size_and_num_heads_dense<false>``: no GQA), dtypes fp16/bf16/fp32 on sm80+."""
    if not (5, 0) <= capability <= (12, 1):
        return f"memory-efficient attention needs sm50..sm121, not sm{capability[0]}{capability[1]}"
    # minimum_gemm_alignment: 4 on sm80+ (else 1), 128 bits (8 halves, 4 floats) with tensor cores
    align = 8 if half == HALF and capability >= (7, 0) else (4 if capability >= (8, 0) else 1)
    if head_dim % align:
        dtype = "fp16/bf16" if half == HALF else "fp32"
        return (f"memory-efficient attention needs head_dim divisible by {align} in {dtype} "
                f"(check_head_dim_size_mem_efficient), got {head_dim}")
    if sees_gqa:
        return ("memory-efficient attention in PyTorch 2.13 takes no grouped-query attention (q and k/v "
                "head counts differ; transformers passes enable_gqa)")
    return ""


def _cudnn_refusal(half: int, head_dim: int, capability: tuple[int, int], dropout: float) -> str:
    """``can_use_cudnn_attention``: check_dtypes_low_precision (fp16/bf16), check_cudnn_hardware_
    support (sm80..sm121), check_cudnn_dropout (p a multiple of 1/16), check_cudnn_tensor_shapes
    (head_dim a multiple of 8 and <= 128; 256 only on sm90/sm10x with cuDNN > 9.22). GQA passes
    with ``enable_gqa`` (check_batch_size_and_num_heads_dense<true, false>)."""
    if half != HALF:
        return "cuDNN attention takes fp16/bf16 only (check_dtypes_low_precision), not fp32"
    if not (8, 0) <= capability <= (12, 1):
        return f"cuDNN attention needs sm80..sm121, not sm{capability[0]}{capability[1]}"
    if dropout * 16 != int(dropout * 16):
        return ("cuDNN attention needs a dropout probability that is a multiple of 1/16 (check_cudnn_dropout), "
                f"got {dropout:g}")
    limit = 256 if (capability[0] in (9, 10) and CUDNN_VERSION > 92200) else 128
    if head_dim > limit or head_dim % 8:
        return (f"cuDNN attention (cuDNN {CUDNN_VERSION // 10000}.{CUDNN_VERSION // 100 % 100}) needs head_dim "
                f"a multiple of 8 and <= {limit} (check_cudnn_tensor_shapes), got {head_dim}")
    return ""


def sdpa_refusals(half: int, head_dim: int, gqa: bool = False, *, capability: tuple[int, int] = (8, 0),
                  dropout: float = 0.0) -> dict[str, str]:
    """Why each backend would refuse this call ("" where it accepts), in ``sdpa_priority`` order.
    ``gqa``: the model has fewer K/V heads than query heads."""
    sees_gqa = gqa and not sdpa_repeats_kv(2, 1, head_dim)  # else transformers repeated K/V
    reasons = {"flash": _flash_refusal(half, head_dim, capability, dropout),
               "efficient": _efficient_refusal(half, head_dim, sees_gqa, capability),
               "math": "",
               "cudnn": _cudnn_refusal(half, head_dim, capability, dropout)}
    return {b: reasons[b] for b in sdpa_priority(capability)}


def sdpa_backend(half: int, head_dim: int, gqa: bool, *, capability: tuple[int, int] = (8, 0),
                 pinned: str | None = None, dropout: float = 0.0) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs on CUDA for transformers' training call
    (no mask): the first backend of ``sdpa_priority`` whose checks pass (``select_sdp_backend``).
    ``half``: bytes of the attention dtype (2: fp16/bf16, 4: fp32); ``gqa``: the model has fewer
    K/V heads than query heads; ``pinned``: ``flash``/``efficient``/``math``/``cudnn`` or an
    ``--attention`` value that pins one (``sdpa_kernel``). A pinned backend PyTorch refuses raises
    a one-line ``TrainmemError`` naming the check (PyTorch raises "No available kernel")."""
    reasons = sdpa_refusals(half, head_dim, gqa, capability=capability, dropout=dropout)
    if pinned is not None and pinned not in ("sdpa", "eager"):
        backend = SDPA_PINS.get(pinned, pinned)
        if backend not in reasons:
            raise ValueError(f"unknown SDPA backend {pinned!r}")
        if reasons[backend]:
            flag = pinned if pinned in SDPA_PINS else f"sdpa-{backend}"
            raise TrainmemError(f"--attention {flag}: PyTorch refuses this model: {reasons[backend]}; "
                                "use --attention sdpa to let it choose")
        return backend
    return next(b for b, why in reasons.items() if not why)


def sdpa_pin_problem(attention: str, half: int, head_dim: int, heads: int, kv_heads: int, *, tp: int = 1,
                     capability: tuple[int, int] = (8, 0), dropout: float = 0.0) -> str | None:
    """The reason PyTorch refuses ``--attention`` ``attention`` for this model (None when it
    accepts or nothing is pinned): what ``sdpa_backend`` raises for a layer, as text, for
    validating a setup. ``heads``/``kv_heads``: the model's; ``tp`` splits both into whole heads
    per rank (``spec.layout.tp_problems``), so a rank sees GQA exactly when the model has it."""
    backend = SDPA_PINS.get(attention)
    if backend is None:
        return None
    why = sdpa_refusals(half, head_dim, heads != kv_heads, capability=capability, dropout=dropout)[backend]
    return why or None


# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerKey:
    family: str
    act_impl: str
    precision: str
    attention: str
    dropout: bool
    hidden_dropout: float
    attention_dropout: float
    h: int
    f: int
    q: int
    kv: int
    heads: int
    kv_heads: int
    head_dim: int
    tp: int
    sp: bool
    sp_gathered: bool  # sequence parallel as PyTorch's plan runs it: linears save the gathered input
    experts: int
    top_k: int
    pre_norm: bool
    lora: tuple[tuple[str, int, int], ...] = ()
    lora_dropout: float = 0.0
    lora_half: bool = False   # adapters in the model's half dtype (else fp32 over half weights)
    quant: tuple[int, int, int] = (0, 0, 0)  # 4-bit base weights: dequantized, cast, scratch bytes per element (quant4.py)
    quant_saves_input: bool = False  # bitsandbytes < 0.43.2: MatMul4Bit saves its input
    # the layer's backward runs inside a reentrant checkpoint's recompute (transformers < 5,
    # ``_reentrant_recompute``): its recomputed output, and bitsandbytes < 0.43.2's kept inputs,
    # live until the layer's backward ends
    reentrant: bool = False
    kv_cache: bool = False   # transformers builds a DynamicCache in training (config.use_cache)
    capability: tuple[int, int] = (8, 0)  # the GPU's compute capability (which SDPA kernel runs)
    biased: tuple[str, ...] = ()  # modules of a layer whose linear has a bias (set for --recompute op only)
    addmm: tuple[str, ...] = ()  # ... set always: which linears' backward is ``addmm``'s (``LayerCoefs.mm_linears``)
    ep: int = 1               # expert parallelism: ranks the experts are split over (AllToAllEP)
    ep_rows: float = 0.0      # ... token rows per own token that this rank's experts run on (ep_rank_rows)
    compiled: bool = False    # torch.compile: the saved set of inductor's partition (compiled_recipe)
    lora_base_trains: bool = False  # FSDP1 mixed units: LoRA's base weights are views of a flat parameter
    #                                 that requires grad, so autograd treats them as trainable
    softmax_saves_input: bool = False  # PyTorch < 1.11: softmax's node saves its input too (spec.releases)
    attention_call: str = "model"  # "repeat-kv": SDPA called as litgpt does (K/V copied to the query's heads)
    math_upcast: bool = True  # PyTorch >= 2.5: SDPA's math kernel upcasts half inputs (spec.releases)
    eager_clamp: bool = False  # transformers' eager attention clamps the masked scores (spec.tf_releases)
    cache_values_own_dtype: bool = False  # transformers >= 5.24: the value cache keeps v's dtype (spec.tf_releases)
    cache_kind: str = "copy"  # transformers >= 4.56: torch.cat copies; "reference": the layer's own k, v
    #                           (spec.tf_releases.kv_cache_kind)
    rotary_keys_half: bool = False  # older Llama-style code: rotary in the values' dtype, half keys under autocast
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on the query and key heads (ModelSpec.qk_norm)
    # torchtune 0.5-0.6.1: RMSNorm saves its fp32 normalized product (spec.frameworks.torchtune_norm_saves_fp32)
    norm_fp32_product: bool = False
    ring: int = 1  # PyTorch's context parallelism: the ranks of its ring attention (states.torch_cp); 1 none
    rms_norm_input: bool = False  # --rms-norm input: the RMSNorms compute in their input's dtype (old lit-gpt)
    liger: bool = False  # --liger: Liger-Kernel's RMSNorm, RoPE and SwiGLU Functions (Builder.rms_norm_liger, _liger_swiglu)
    unsloth: bool = False  # --unsloth-kernels: Unsloth's LoRA_QKV / LoRA_W / LoRA_MLP, RMSNorm and RoPE (_unsloth_layer)
    manual_layernorm: bool = False  # the LayerNorms in Python ops (ModelSpec.manual_layernorm)
    separate_qkv: bool = False  # GPT-2 family: q, k, v as three linears (ModelSpec.separate_qkv)
    expert_loop: bool = False  # transformers < 5: Mixtral's experts one nn.Linear MLP at a time (_moe_loop)
    # whose code the layer runs: "transformers" (its own module) or the framework of
    # spec.frameworks.OWN_MODEL_CODE that re-implements it (torchtune, torchtitan, litgpt...); transformers'
    # Llama layer and torchtitan's are written tensor by tensor for a checkpointed forward (nograd.py)
    model_code: str = ""
    # 4-bit base weights: bitsandbytes' ``Linear4bit`` (not torchao's NF4), double-quantized (``*-dq``)
    quant_bnb: bool = False
    quant_nested: bool = False


def ep_rank_rows(top_k: int, experts: int, ep: int, imbalance: float) -> float:
    """Rows the experts of the busiest expert-parallel rank run on, per token of a rank's own
    micro-batch (T = b*s tokens per rank, each routed to ``top_k`` experts).

    Every one of the ``ep`` ranks routes T*k (token, expert) pairs; the mean expert receives
    m = ep*T*k/E of them, so a rank's E/ep experts receive T*k on average. ``imbalance`` F puts
    F*m on one expert, capped at ep*T (a token picks an expert at most once, so an expert sees at
    most every token of the group: F <= E/k); the other experts of that rank keep the mean and the
    extra (F-1)*m is taken from experts on other ranks. The rank then receives
    T*k + (F-1)*m = T*k*(1 + (F-1)*ep/E) rows, at most all ep*T*k pairs of the group. With ep = 1
    every expert is on the rank and it always runs T*k rows, whatever the routing."""
    f = min(imbalance, experts / top_k)
    return top_k * min(float(ep), 1.0 + (f - 1.0) * ep / experts)


#: the layer backward moments of the engine (``moments._layers_backward``), as bits of a mask: the top
#: layer's, the bottom layer's and an encoder-decoder's decoder-bottom layer's
TOP, BOTTOM, DECODER_BOTTOM = 1, 2, 4
ALL_MOMENTS = TOP | BOTTOM | DECODER_BOTTOM


@dataclass(frozen=True)
class LayerCoefs:
    """Saved bytes of one layer: ``tok * b*s + sq * b*s*s_kv`` plus its largest backward transient."""

    tok: float
    sq: float
    parts: tuple[tuple[str, float, float], ...]
    transients: tuple[tuple[str, float, float, float], ...]  # (op, excess per token, per token x key, bytes)
    held: float = 0.0        # bytes per token the model output holds without autograd saving them
    cache: float = 0.0       # bytes per token of the KV cache the model output references (saved or not)
    weights: float = 0.0     # matmul weight elements of the layer (this rank)
    after: tuple[float, ...] = ()  # per transient: weight elements of the linears back-propagated before it
    fwd_const: float = 0.0   # the largest forward transient of a linear (a dequantized 4-bit weight), bytes
    fwd_tok: float = 0.0     # ... and its matmul output, bytes per token
    op_tok: float = 0.0      # --recompute op: bytes per token the selective policy saves (op_checkpoint_saved)
    op_sq: float = 0.0       # ... per token x key
    input_saved: float = 0.0  # bytes per token of the saved tensors that are the layer's input itself
    not_recomputed: float = 0.0  # per token: the layer's output, kept by what follows it, not by a recomputed layer
    graph_held: float = 0.0  # of the saved bytes per token, those autograd does not free in backward (quant4.py)
    # LoRA: of ``parts``, what the first layer does not save (``Recipe.first_layer_unsaved``), and the
    # weight elements of its frozen linears on the grad-free input (their half copies are not kept)
    first_unsaved: tuple[tuple[str, float, float], ...] = ()
    first_free_weights: tuple[float, ...] = ()
    # each saved tensor in the order autograd saves it: (bytes per token, per token x key), for the
    # allocator replay of the step (reserved/)
    tensors: tuple[tuple[float, float], ...] = ()
    # tensors made and freed within the layer's forward (the inputs of frozen linears nothing saves,
    # RMSNorm's fp32 intermediates), as ``tensors``: the free blocks they leave in the cache (reserved/)
    fwd_free: tuple[tuple[float, float], ...] = ()
    # measured with the layers checkpointed (a derived encoder-decoder under full recompute): ``tok``,
    # ``sq`` are what a checkpointed layer keeps, the transients include its recomputation
    checkpointed: bool = False
    # --recompute op: each op output the per-op policy keeps (``op_checkpoint_saved``), as ``tensors``
    op_tensors: tuple[tuple[float, float], ...] = ()
    transients_ssq: tuple[float, ...] = ()  # per transient: bytes per sequence position squared (shared by the batch)
    transients_at: tuple[int, ...] = ()  # per transient: the backward moments it belongs to (bit mask; () all)
    # per transient: of ``after``, the grouped experts' weight elements (no autocast copies to free)
    after_uncast: tuple[float, ...] = ()
    own_cast: tuple[float, ...] = ()  # per transient: the op's own weight elements whose half copy is freed
    # per transient: bytes per token of the layer's output gradient it counts (``Recipe.transient``'s ``incoming``)
    incoming: tuple[float, ...] = ()
    # per transient: weight elements of the frozen linears back-propagated before it whose half copies
    # their matmuls saved and released (``Recipe.frozen``; LoRA under autocast)
    after_frozen: tuple[float, ...] = ()
    first_adapter_op: int = -1  # LoRA: the transient of the first adapted linear (forward order); -1 none
    # a checkpointed layer's recomputed forward (``Recipe.recompute_moments``): (name, bytes per token,
    # per token x key, its unsaved tensors' blocks) over its saved tensors, the gradients alive since
    # its first unpack included; of those bytes per token, the layer's output gradient (a pipeline
    # stage's receive buffer at its top layer)
    recompute_moments: tuple[tuple[str, float, float, tuple], ...] = ()
    recompute_incoming: float = 0.0
    # each linear of the layer in forward order: (how many of ``tensors`` are saved before autocast
    # casts its weight, the weight's elements, bytes per element of its gradient (the weight's dtype;
    # 0: frozen)), for the allocator replay (reserved/)
    linears: tuple[tuple[int, float, int], ...] = ()
    # of ``linears``, the indices of those without a bias: ``mm``, whose backward makes the weight's gradient
    # before the input's (``reserved.layer_backward._mm_moment``); a biased one runs ``addmm``
    mm_linears: tuple[int, ...] = ()
    # how many of ``tensors`` are made before the first linear's matmul takes the cuBLAS workspace: those
    # saved before its weight is cast, and its output where that is the next saved (``first_matmul_at``); -1 none
    ws_at: int = -1
    # per linear (as ``linears``): where the unsaved input ``linear_inputs`` holds is released, if not once
    # its linear has run (-1): after the ``tensors`` entry of that index, or at the layer's end (-2); () all -1
    input_release: tuple[int, ...] = ()
    # per linear (as ``linears``): the (per token, per token x key) bytes of the input it reads but does
    # not save, autocast saving its half cast instead (a norm's fp32 output, GPT-2's fp32 GELU output),
    # and 1 where the next linear reads the same tensor (Llama's q, k, v projections); (0, 0, 0) where
    # the input is saved itself (``Recipe.linear_in``, ``linear_inputs``; the replay's
    # ``reserved.layer_forward._saved_and_casts``); () where no recipe lists them (a derived layer)
    linear_inputs: tuple[tuple[float, float, int], ...] = ()
    # a derived layer's forward one tensor at a time (``trace.derive._layer_sequence``): the tensors it
    # makes and frees within the forward, as ``tensors``, and the order of everything it makes ("s" the
    # next of ``tensors``, "c" the next linear's weight copy, "t" the next temporary, "fK" the K-th
    # temporary freed), for the allocator replay (reserved/layer_forward.py ``_sequence_forward``); () without one
    fwd_temps: tuple[tuple[float, float], ...] = ()
    fwd_events: tuple[str, ...] = ()
    # ... and its backward (``trace.derive._layer_backward_sequence``): each tensor it makes, its bytes in
    # ``trace.derive.BACKWARD_TERMS`` (per token, per position, per token x key, constant, per sample, per
    # position pair), the tensors the layer above leaves to it, its parameter gradients' bytes, the events
    # ("t", "fK", "g", "iK", "sK", "pK", "wK") and its tensors alive at its end, for reserved.layer_backward._recorded_backward
    bwd_temps: tuple[tuple[float, ...], ...] = ()
    bwd_ins: tuple[tuple[float, ...], ...] = ()
    bwd_grads: tuple[int, ...] = ()
    bwd_events: tuple[str, ...] = ()
    bwd_out: tuple[int, ...] = ()
    held_b1: float | None = None  # ``held`` at a micro-batch of one sequence (Recipe.held_b1); None: ``held``
    # a checkpointed hand-written layer's first forward, tensor by tensor (nograd.py): each temporary's
    # bytes per token and the events ("t" made, "fK" freed, "o" the output), for reserved.layer_forward._checkpointed
    nograd_temps: tuple[float, ...] = ()
    nograd_events: tuple[str, ...] = ()
    nograd_const: tuple[float, ...] = ()  # ... and each one's bytes beside those (a dequantized 4-bit weight)
    # ... and each one's bytes per token x key and per position pair (eager attention's scores,
    # ``nograd.eager``, ``nograd.bert_layer``; the math SDPA kernel's scores and mask, ``nograd.math_sdpa``),
    # () where all are 0
    nograd_sq: tuple[tuple[float, float], ...] = ()
    # ... and which of them torchtitan's per-op policy keeps (``NoGradSeq.op_kept``), for --recompute op
    nograd_op: tuple[int, ...] = ()
    nograd_mm0: int = -1  # ... the first matmul's output (where its cuBLAS workspace is made); -1: the first kept
    nograd_batched: tuple[int, ...] = ()  # ... those made only where a micro-batch holds several sequences
    # --recompute op: which of ``tensors`` (by index) are outputs the per-op policy keeps
    # (``op_checkpoint_kept``), which the layer's recomputation takes from the policy's cache, not remakes
    op_saved: tuple[int, ...] = ()
    adapters: int = 0  # LoRA: the layer's adapted linears (each a lora_A and a lora_B)
    # eager attention's forward temporaries (``Builder._eager_forward``): how many of ``tensors`` are
    # saved before its scores matmul (-1: not written), each temporary as ``tensors``, the events ("t"
    # the next temporary, "fK" the K-th freed, "s" the next of ``tensors``), for reserved.layer_forward._saved_and_casts
    attn_at: int = -1
    attn_temps: tuple[tuple[float, float], ...] = ()
    attn_events: tuple[str, ...] = ()
    # other forward temporaries in op order (``Recipe.forward_group``, ``group_ahead``): per group (how many of ``tensors``
    # are saved before it, each temporary as ``tensors`` with more terms where it has them: ``group_coef``, the
    # events, and where they differ the events at one sequence per micro-batch), for reserved.layer_forward._attn_allocs
    fwd_groups: tuple[tuple, ...] = ()
    # backward temporaries in op order (``Recipe.backward_group``): per group (how many transients precede it,
    # how many of ``tensors`` are saved before it, each temporary as ``tensors``, the events), for
    # reserved.layer_backward._group_backward
    bwd_groups: tuple[tuple, ...] = ()
    # per backward transient (``transients``' order, before any recomputation's): the op's backward
    # tensors alive then, (bytes per token, per token x key) each (``Recipe.transient``'s ``ts``), and
    # the index in ``linears`` of the linear it is the backward of (-1: another op):
    # ``reserved.layer_backward._op_backward`` makes them op by op instead of one block of the worst moment
    moment_blocks: tuple[tuple[tuple[tuple[float, float], ...], int], ...] = ()
    moment_saved: tuple[int, ...] = ()  # per moment: the tensors saved by then (``Recipe.moment_saved``)
    resid_grad: float = 0.0  # the residual stream's gradient held through the layer's backward (``Recipe.resid_grad``)
    # ``down_proj``'s output and the layer's output (bytes per token, per token x key) where the layer writes its
    # residual stream in op order (``Recipe.resid_tail``, ``_llama_resid``): reserved.layer_forward._resid_tail
    resid_tail: tuple[tuple[float, float], ...] = ()
    fwd_scratch: float = 0.0  # torchao NF4: the largest dequantization peak (weight and scratch) before its matmul, bytes

    def bytes(self, n: int, nsq: int) -> int:
        return int(self.tok * n + self.sq * nsq)

    def transient(self, n: int, nsq: int, grad_per_weight: float = 0.0) -> tuple[str, int]:
        """The op whose backward adds the most on top of the whole layer's saved tensors (can be
        negative: the tensors freed by then outweigh the gradients in flight). ``grad_per_weight``:
        gradient bytes per weight element; the gradients of the layer's later linears (computed
        before this op's backward) count at that moment."""
        name, v, _ = self.transient_parts(n, nsq, grad_per_weight)
        return name, v

    def transient_parts(self, n: int, nsq: int, grad_per_weight: float = 0.0) -> tuple[str, int, int]:
        """``transient`` and, of its bytes, those that are gradients of the layer's later linears."""
        best = ("", -(1 << 62), 0)
        after = self.after or (0.0,) * len(self.transients)
        for (name, a, b, c), w in zip(self.transients, after):
            g = int(w * grad_per_weight)
            v = int(a * n + b * nsq + c) + g
            if v > best[1]:
                best = (name, v, g)
        return best


def _reentrant_recompute(trans: tuple, r: Recipe, out_tok: float) -> tuple:
    """A reentrant checkpoint recomputes the layer in backward (torch 2.13 ``utils/checkpoint.py``
    ``CheckpointFunction.backward``, L278-331: ``outputs = ctx.run_function(*detached_inputs)`` under
    ``enable_grad``, then ``torch.autograd.backward(outputs_with_grad, args_with_grad)``), so while
    the layer is back-propagated its recomputed output is alive, held by ``outputs`` (``out_tok``:
    one residual-stream tensor per token; a non-reentrant checkpoint keeps only the saved tensors the
    recompute packs). The recomputed graph dies as it returns: bitsandbytes < 0.43.2 ``MatMul4Bit``
    keeps its input as ``ctx.tensors``, a node attribute autograd does not free op by op
    (``autograd/_functions.py`` L522-523 at 0.42.0), so at each backward moment of the layer the inputs
    its later 4-bit linears kept are alive too (``down_proj``'s input at the SwiGLU backward): each
    transient gains the graph-held bytes recorded after it (``Recipe.graph_at``)."""
    total = sum(t.tok * t.nbytes for t in r.graph_held.values())
    return tuple((name, a + out_tok + total - g, b, c) for (name, a, b, c), g in zip(trans, r.graph_at))


@lru_cache(maxsize=4096)
def layer_coefficients(k: LayerKey) -> LayerCoefs:
    """Build the recipe of one transformer layer (per rank) and reduce it to coefficients."""
    pol = Policy.of(k.precision)
    t = k.tp
    sp_div = t if k.sp else 1  # sequence parallel splits the replicated regions over TP ranks
    B = Builder(pol, k.dropout, sp_div, k.capability, k.lora, k.lora_dropout, k.lora_half, k.quant,
                k.quant_saves_input, k.biased, k.lora_base_trains, k.softmax_saves_input,
                k.attention_call == "repeat-kv", k.math_upcast)
    B.eager_clamp = k.eager_clamp
    B.addmm = k.addmm
    B.fp16 = k.precision in ("fp16", "fp16-amp")
    B.norm_fp32_product = k.norm_fp32_product
    B.ring = k.ring
    B.rms_input = k.rms_norm_input
    B.liger = k.liger
    B.manual_ln = k.manual_layernorm
    h, f, q, kv = k.h, k.f / t, k.q / t, k.kv / t
    heads, kvh = k.heads / t, k.kv_heads / t  # whole heads per rank (spec.layout.tp_problems)
    x = T(h / sp_div, 0, pol.stream, "residual")
    B.layer_input = x
    build = {"gpt2": _gpt2_layer, "nanogpt": _gpt2_layer, "bert": _bert_layer,
             "roberta-prenorm": _bert_layer}.get(k.family, _unsloth_layer if k.unsloth else _llama_layer)
    if compiled_recipe(k):
        build = _gpt2_layer_compiled if build is _gpt2_layer else _llama_layer_compiled
    build(B, k, x, h, f, q, kv, heads, kvh, sp_div)

    tok, sq, parts = B.r.coefficients()
    trans = tuple((name, a + st - tok, b + ss - sq, c) for name, a, b, c, st, ss, _w, _u in B.r.transients)
    if k.reentrant:
        trans = _reentrant_recompute(trans, B.r, x.tok * x.nbytes)
    wall = B.r.weights
    after = tuple(max(0.0, wall - w) for *_, w, _u in B.r.transients)
    after_uncast = tuple(max(0.0, B.r.uncast - u) for *_, u in B.r.transients)
    own_cast = tuple(B.r.own_cast)
    after_frozen = tuple(max(0.0, B.r.frozen - f) for f in B.r.frozen_at)
    held = sum(t.tok * t.nbytes for i, t in B.r.held.items() if i not in B.r.saved)
    held_b1 = sum(t.tok * t.nbytes for i, t in B.r.held_b1.items() if i not in B.r.saved)
    op_tok, op_sq = op_checkpoint_saved(B.r)
    input_saved = B.r.input_saved or id(x) in B.r.saved
    unsaved = tuple((t.name or "other", *t.bytes_coef()) for t in B.r.first_layer_unsaved())
    return LayerCoefs(tok, sq, tuple((n, a, b) for n, (a, b) in parts.items()), trans, held, B.r.cache, wall,
                      after, B.r.fwd[0], B.r.fwd[1], op_tok, op_sq, x.tok * x.nbytes if input_saved else 0.0,
                      graph_held=sum(t.tok * t.nbytes for t in B.r.graph_held.values()),
                      first_unsaved=unsaved, first_free_weights=tuple(B.r.free_weights) if B.r.adapter_seen else (),
                      tensors=tuple(t.bytes_coef() for t in B.r.saved.values()),
                      fwd_free=tuple(t.bytes_coef() for i, t in B.r.forward_only.items()
                                     if i not in B.r.saved and t is not x),
                      after_uncast=after_uncast if any(after_uncast) else (),
                      own_cast=own_cast if any(own_cast) else (),
                      incoming=tuple(B.r.incoming) if any(B.r.incoming) else (),
                      after_frozen=after_frozen if any(after_frozen) else (),
                      first_adapter_op=B.r.first_adapter_op, linears=tuple(B.r.linears), adapters=len(B.lora),
                      mm_linears=tuple(B.r.mm_linears),
                      ws_at=first_matmul_at(B.r), input_release=input_releases(B.r),
                      linear_inputs=linear_inputs(B.r),
                      recompute_moments=B.r.recompute_moments(tok, sq), fwd_scratch=B.r.fwd_scratch,
                      recompute_incoming=B.r.trigger[1] if B.r.trigger else 0.0,
                      op_tensors=tuple(t.bytes_coef() for t in op_checkpoint_kept(B.r)), held_b1=held_b1,
                      op_saved=_op_saved(B.r),
                      attn_at=B.r.attn_at, attn_temps=tuple(t.bytes_coef() for t in B.r.attn_temps),
                      attn_events=tuple(B.r.attn_events),
                      fwd_groups=tuple((at, tuple(group_coef(t) for t in ts), tuple(ev)) + tuple(tuple(x) for x in b1)
                                       for at, ts, ev, *b1 in B.r.fwd_groups),
                      bwd_groups=tuple((at, base, tuple(t.bytes_coef() for t in ts), tuple(ev), cover)
                                       for at, base, ts, ev, cover in B.r.bwd_groups),
                      moment_blocks=() if k.reentrant else tuple(B.r.moments),
                      moment_saved=() if k.reentrant else tuple(B.r.moment_saved),
                      resid_grad=0.0 if k.reentrant else B.r.resid_grad,
                      resid_tail=tuple(t.bytes_coef() for t in B.r.resid_tail),
                      **_nograd_sequence(k, pol, B, build))


def _nograd_sequence(k: LayerKey, pol: Policy, B: Builder, build: Any) -> dict:
    """A checkpointed layer's first forward tensor by tensor (``nograd.llama_layer``), where the layer
    is transformers' Llama decoder layer (``k.model_code``; Llama, Mistral, Qwen2) or torchtitan's
    Llama ``TransformerBlock`` (its own norm and rotation, ``nograd.titan_rms_norm``,
    ``titan_rotary``) as ``_llama_layer`` builds it in the plain case: transformers' layer also under
    autocast without LoRA or 4-bit weights (``NoGradLayer.amp``: the inputs' and weights' casts; peft's
    casts are not written), a fused SDPA kernel (grouped keys copied
    to the query's heads where the code does: transformers' releases of ``repeat-kv``, torchtitan's
    ``repeat_kv`` always), one sequence shard (no sequence or context parallelism), dense SwiGLU,
    HF's RMSNorm, 16-bit or bitsandbytes 4-bit linears (``nograd.dequantized``; not torchao's NF4,
    whose ``get_original_weight`` differs); else {} (the replay makes the layer's saved tensors at
    once, ``reserved.layer_forward._checkpointed``)."""
    if build is _bert_layer:
        return _bert_nograd(k, pol, B)
    if build is _gpt2_layer:
        return _gpt2_nograd(k, pol, B)
    titan = k.model_code == "torchtitan" and k.family == "llama"
    plain = (build is _llama_layer and (k.model_code == "transformers" or titan)
             and not (pol.amp and (B.lora or k.quant[0] or titan)) and not k.sp
             and k.ring == 1 and not k.experts
             and not (k.liger or k.rms_norm_input or k.norm_fp32_product or k.qk_norm)
             and (k.quant_bnb or not k.quant[0]) and not k.kv_cache and k.attention_call in ("model", "repeat-kv"))
    eager = plain and k.attention == "eager" and _nograd_eager(k, pol, B, titan)
    backend = B.sdpa(k.attention, k.head_dim, k.heads / k.tp, k.kv_heads / k.tp,
                     k.attention_dropout) if plain and k.attention != "eager" else ""
    math = backend == "math" and _nograd_math(k, pol, B, titan)
    if not plain or (backend not in ("flash", "efficient", "cudnn") and not math and not eager):
        return {}
    t = k.tp
    adapter = pol.weight if B.base_trains else (pol.half if k.lora_half else F32)
    repeat = k.heads != k.kv_heads and (titan or k.attention_call == "repeat-kv" or eager)
    L = NoGradLayer(k.h, k.q / t, k.kv / t, k.f / t, pol.stream, pol.half, pol.weight, dict(B.lora),
                    k.lora_dropout if B.lora else 0.0, adapter if B.lora else 0,
                    repeat, k.quant[:2], k.quant_nested, pol.amp, "torchtitan" if titan else "transformers",
                    k.heads / t if math else 0.0, math and k.heads != k.kv_heads and not repeat,
                    k.heads / t if eager else 0.0, eager and max(pol.half, pol.stream) != F32 and not B.fp16,
                    k.addmm)
    S = nograd_llama(L)                              # (the workspace at q_proj's output, biased or not)
    return {**_nograd_coefs(S, tuple(S.op_kept())), "nograd_mm0": S.mm0}


def _nograd_coefs(S: NoGradSeq, op: tuple[int, ...]) -> dict:
    """``LayerCoefs``' no-grad fields from a layer written tensor by tensor (``nograd.NoGradSeq``): each
    temporary's bytes per token (``nograd_temps``), beside (``nograd_const``), per token x key and per
    position pair (``nograd_sq``, (sq, pair) each), the events, and ``op``, the per-op policy's outputs."""
    return {"nograd_temps": tuple(S.sizes), "nograd_events": tuple(S.events),
            "nograd_const": tuple(S.consts) if any(S.consts) else (), "nograd_op": op,
            "nograd_sq": tuple(zip(S.sq, S.pair)) if any(S.sq) or any(S.pair) else (),
            "nograd_batched": tuple(S.batched)}


def _nograd_eager(k: LayerKey, pol: Policy, B: Builder, titan: bool) -> bool:
    """Whether the checkpointed first forward with transformers' eager attention is written op by op
    (``nograd.eager``): transformers' layer without attention dropout, the clamp of older transformers
    (``k.eager_clamp``) or PyTorch < 1.11's softmax (``B.softmax_saves_input``), as
    ``Builder._eager_forward`` writes the recorded one."""
    drop = k.attention_dropout > 0 and B.dropout
    return not titan and not drop and not k.eager_clamp and not B.softmax_saves_input


def _nograd_math(k: LayerKey, pol: Policy, B: Builder, titan: bool) -> bool:
    """Whether the checkpointed first forward on SDPA's math kernel is written op by op
    (``nograd.math_sdpa``): transformers' layer, PyTorch >= 2.5 (the kernel computes in fp32,
    ``k.math_upcast``), outside autocast (its casts of the query and keys before the kernel are not
    written) and without attention dropout (the kernel's fp32 mask and dropped probabilities)."""
    drop = k.attention_dropout > 0 and B.dropout
    return not titan and k.math_upcast and not pol.amp and not drop


def _bert_nograd(k: LayerKey, pol: Policy, B: Builder) -> dict:
    """A checkpointed BERT layer's first forward tensor by tensor (``nograd.bert_layer``), where
    ``_bert_layer`` builds transformers' post-LN ``BertLayer`` (in one dtype or under autocast): no adapters,
    quantized weights, tensor, sequence or context parallelism; eager attention or a fused SDPA
    kernel; the fused GELU (``F.gelu``). Else {} (the replay makes the layer's saved tensors at once). Against trace, BERT-base
    2 layers, b2 s1024, fp32, eager attention, full recomputation: the first forward's 96 MiB scores,
    softmax and dropout each freed as the next is made, the dropped probabilities held to the layer's
    end (docs/agreement.md, reserved section, 2026-11-26 ``bert``). Under torchtitan's per-op policy
    what it keeps is marked (``nograd_op``): the fused SDPA output only, BERT's linears having biases
    (``addmm``, not on the policy's list: ``op_checkpoint_saved``); ``nograd_mm0``, the first linear's
    output (``query``'s), is where the forward's cuBLAS workspace is made (``_first_mm_workspace``)."""
    if (B.lora or k.quant[0] or k.sp or k.tp != 1 or k.ring != 1 or k.pre_norm or k.kv_cache
            or k.family != "bert" or k.model_code not in ("", "transformers") or k.manual_layernorm
            or k.act_impl not in ("gelu", "gelu_pytorch_tanh") or k.eager_clamp or k.reentrant):
        return {}
    eager = k.attention == "eager"
    if not eager and B.sdpa(k.attention, k.head_dim, k.heads, k.kv_heads,
                            k.attention_dropout) not in ("flash", "efficient", "cudnn"):
        return {}
    L = NoGradLayer(k.h, k.q, k.kv, k.f, pol.stream, pol.half, pol.weight, amp=pol.amp)
    S = nograd_bert(L, k.heads, eager, k.hidden_dropout if B.dropout else 0.0,
                    k.attention_dropout if B.dropout else 0.0)
    return {**_nograd_coefs(S, tuple(S.sdpa)),       # (biased linears: ``addmm``, recomputed)
            "nograd_mm0": S.mm[0]}


def _gpt2_nograd(k: LayerKey, pol: Policy, B: Builder) -> dict:
    """A checkpointed GPT-2 layer's first forward tensor by tensor (``nograd.gpt2_block``), where
    ``_gpt2_layer`` builds transformers' ``GPT2Block`` in one dtype or under autocast (its casts written:
    b1 s1024 bf16-amp +1.75 % against trace's peak reserved memory at a32de05b, 0.00 %): no adapters, quantized
    weights, tensor, sequence or context parallelism, KV cache; one fused ``c_attn``; a fused SDPA
    kernel without padded copies (flash with a head size a multiple of 8, efficient, cuDNN); the
    ``gelu_new`` activation or a fused one. Else {} (the replay makes the layer's saved tensors at
    once, ``reserved.layer_forward._checkpointed``). Against trace, GPT-2 2 layers, b8 s256, pure bf16,
    FSDP1 full shard dp 4, Adam, full recomputation: the layer's tensors made at once opened a 12 MiB
    segment trace never opens, +24.39 % on the peak reserved memory; written, -0.02 %, every large
    segment as trace's (docs/agreement.md, reserved section, 2026-11-26 ``gpt2rc``). Torchtitan's per-op
    policy is not written for GPT-2 (``nograd_op`` empty: ``_op_forward`` keeps its block replay)."""
    if (B.lora or k.quant[0] or k.sp or k.tp != 1 or k.ring != 1 or k.kv_cache or k.family != "gpt2"
            or k.model_code not in ("", "transformers") or k.manual_layernorm or k.separate_qkv or k.reentrant
            or k.act_impl not in ("gelu_new", "gelu", "gelu_pytorch_tanh") or k.eager_clamp or B.softmax_saves_input):
        return {}
    eager = k.attention == "eager"
    backend = "" if eager else B.sdpa(k.attention, k.head_dim, k.heads, k.kv_heads, k.attention_dropout)
    if not eager and (backend not in ("flash", "efficient", "cudnn") or (backend == "flash" and k.head_dim % 8)):
        return {}
    L = NoGradLayer(k.h, k.q, k.kv, k.f, pol.stream, pol.half, pol.weight, amp=pol.amp)
    S = nograd_gpt2(L, k.hidden_dropout if B.dropout else 0.0, k.act_impl == "gelu_new", k.heads if eager else 0.0,
                    k.attention_dropout if B.dropout else 0.0)
    return {**_nograd_coefs(S, ()), "nograd_mm0": S.mm[0]}     # (per-op checkpointing not written here)


def _op_saved(r: Recipe) -> tuple[int, ...]:
    """Indices in the layer's saved tensors (``LayerCoefs.tensors``: ``r.saved`` in save order) of the
    outputs torchtitan's per-op policy keeps (``op_checkpoint_kept``): in the layer's recomputation in
    backward the policy hands those back from its cache (torch 2.13 ``utils/checkpoint.py``
    ``_CachedTorchDispatchMode``: a ``MUST_SAVE`` op pops its stored output, not rerun)."""
    kept = {id(t) for t in op_checkpoint_kept(r)}
    return tuple(i for i, k in enumerate(r.saved) if k in kept)


def op_checkpoint_kept(r: Recipe) -> list[T]:
    """The op outputs torchtitan's per-op policy keeps of one layer, each storage once, in call order
    (``op_checkpoint_saved``)."""
    return list({id(t): t for t in r.mm_outs[0::2] + r.sdpa_outs}.values())


def op_checkpoint_saved(r: Recipe) -> tuple[float, float]:
    """(bytes per token, per token x key) that torchtitan's per-op selective activation checkpointing
    keeps of one layer besides its input: the outputs its policy marks ``MUST_SAVE``, cached by
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` from the layer's forward until
    its recompute in backward takes them back. torchtitan v0.2.2 ``_op_sac_save_list``
    (torchtitan/models/llama3/infra/parallelize.py L36-51) and ``_apply_op_sac``'s policy
    (torchtitan/distributed/activation_checkpoint.py L98-128): every ``aten.mm`` is counted per layer
    call and the odd ones (1st, 3rd, ...) are saved, the even ones recomputed; the fused SDPA ops
    (``_scaled_dot_product_{flash,efficient,cudnn}_attention``) are saved whole. ``addmm`` (linears
    with a bias), ``bmm`` (eager attention) and the math SDPA path (a composite: its pieces reach the
    dispatcher, not ``_scaled_dot_product_attention_math``) are not on the list and are recomputed."""
    kept: dict[int, T] = {id(t): t for t in r.mm_outs[0::2] + r.sdpa_outs}
    return (sum(t.tok * t.nbytes for t in kept.values()), sum(t.sq * t.nbytes for t in kept.values()))


def first_matmul_at(r: Recipe) -> int:
    """How many of the layer's saved tensors exist when its first linear's matmul runs and takes the
    forward thread's cuBLAS workspace (made at its first use, after the matmul's output: ``at::mm``
    allocates its result, then ``at::cuda::blas::gemm`` takes the handle, torch 2.13
    ``aten/src/ATen/native/cuda/Blas.cpp`` ``addmm_out_cuda_impl``, ``CUDABlas.cpp``
    ``getCUDABlasLtWorkspace``): those saved before it, and its output where it is the next one saved
    (GPT-2's ``c_attn`` output, which a fused SDPA kernel saves whole). -1 without a linear."""
    if not r.linears:
        return -1
    at = r.linears[0][0]
    ids = list(r.saved)
    return at + 1 if at < len(ids) and ids[at] == id(r.first_out) else at


def input_releases(r: Recipe) -> tuple[int, ...]:
    """Per linear, where the unsaved input it reads (``linear_inputs``) is released when a frame holds
    it past the linear (``Recipe.input_release``): GPT-2's ``ln_1`` output, bound to ``hidden_states``
    in ``GPT2Block.forward`` until ``hidden_states = attn_output + residual`` rebinds it, after the
    residual add (ln_2's saved input); its ``ln_2`` output until the second residual add, the block's
    output (transformers 5.24.0 ``models/gpt2/modeling_gpt2.py`` L276-318). () where none is."""
    out = tuple(r.input_release.get(id(x), -1) if x is not None else -1 for x in r.linear_in)
    return out if any(k != -1 for k in out) else ()


def linear_inputs(r: Recipe) -> tuple[tuple[float, float, int], ...]:
    """Per linear of a layer (``Recipe.linears``), the input it reads but autograd does not keep:
    under autocast ``F.linear`` casts its fp32 input to the compute dtype and ``mm``/``addmm`` saves
    that cast (``aten/src/ATen/autocast_mode.cpp``: ``linear`` on the lower-precision list, its
    arguments cast; ``derivatives.yaml`` ``mm``: ``self`` saved for the weight's gradient), while the
    fp32 input stays alive in the caller's frame until the linear has run (GPT-2's ``ln_1`` output,
    held by ``GPT2Block.forward``'s ``hidden_states`` from L276 through ``self.attn`` until L285
    rebinds it; its fp32 GELU output, held
    by ``GPT2MLP.forward`` L242-243 until ``c_proj`` returns; transformers 5.24
    ``models/gpt2/modeling_gpt2.py``). (bytes per token, per token x key, 1 where the next linear reads
    the same tensor); (0, 0, 0) where the linear saves its input itself, the input is saved by
    another op, or the linear is frozen. Without autocast, or in a half compute dtype, every entry is
    (0, 0, 0)."""
    out = []
    for i, x in enumerate(r.linear_in):
        if x is None or id(x) in r.saved:
            out.append((0.0, 0.0, 0))
            continue
        shared = i + 1 < len(r.linear_in) and r.linear_in[i + 1] is x
        out.append((*x.bytes_coef(), int(shared)))
    return tuple(out) if any(a or b for a, b, _ in out) else ()


def _gpt2_layer(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float, kvh: float, sp_div: int) -> None:
    """transformers GPT2Block / nanoGPT Block: pre-LN, fused qkv (c_attn), GELU MLP."""
    pol, half = B.p, B.p.half
    a_in = B.layer_norm(x, "ln_1")
    a_out = T(h / sp_div, 0, a_in.nbytes, "ln_1.out")
    B.outer_live = (a_out,)  # GPT2Block's ``hidden_states`` while ``self.attn`` runs
    if k.separate_qkv:  # three linears: under autocast each saves its own half cast of the fp32 input
        for width in (q, kv, kv):
            B.linear(a_out, width, "c_attn", "c_attn.input", h)
        fused = None
    else:
        fused = B.linear(a_out, q + 2 * kv, "c_attn", "c_attn.input", h)
    qq, kk, vv = (T(q, 0, half, "attn.qkv"), T(kv, 0, half, "attn.qkv"), T(kv, 0, half, "attn.qkv"))
    backend = "eager" if k.attention == "eager" else B.sdpa(k.attention, k.head_dim, heads, kvh,
                                                            k.attention_dropout)
    qkv = fused or T(q + 2 * kv, 0, half, "attn.qkv")  # c_attn's output (b, s, q + 2 kv): q, k, v are views of it
    qkv_b1 = qkv  # what the cache's views keep at b == 1 (eager: the tensor matmul saves)
    copies = k.kv_cache and k.cache_kind == "copy"
    if backend == "eager":
        # matmul's copies of q, k, v (strided views of c_attn's output: _matmul_impl reshapes them; at
        # b == 1 views of it, then qkv itself), or of q and the cache's contiguous k and v: q + 2 kv
        saved = T(q + 2 * kv, 0, half, "attn.qkv")
        B.r.save(saved)
        qq = kk = vv = T(0, 0, half, "attn.qkv")
        qkv_b1 = saved
    elif backend == "flash" and k.head_dim % 8:
        # the kernel saves padded copies of q, k, v (Builder._fused_attention); the cache's copies
        # of k and v (transformers, config.use_cache) live as long as the model output
        if copies:
            kk, vv = T(kv, 0, half, "attn.k_cache"), T(kv, 0, half, "attn.v_cache")
            B.r.hold(kk, vv)
    elif backend != "math":
        # the kernel saves q as a view: the whole c_attn output stays alive. With a KV cache
        # (transformers, config.use_cache) from 4.56 k and v are the cache's copies (torch.cat).
        B.r.save(qkv)
        qq = T(0, 0, half, "attn.qkv")
        if copies:
            kk, vv = T(kv, 0, half, "attn.k_cache"), T(kv, 0, half, "attn.v_cache")
        else:
            kk = vv = qq
    if copies:
        B.r.cache = 2 * kv * half  # the cache's copies of k and v
    elif k.kv_cache:
        _hold_cache(B, (qkv,), (qkv_b1,))  # before 4.56 the cache's k and v are views of c_attn's output: all of it
    ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                      softmax_fp32_then_cast=False)
    B.linear(ctx, h, "c_proj", "c_proj.input")
    hf = k.family == "gpt2"  # transformers' GPT2Block (its frames' lifetimes; nanoGPT's Block differs)
    _gpt2_branch_dropout(B, h / sp_div, k.hidden_dropout if hf else 0.0, "attn.resid_dropout", k.hidden_dropout)
    x2 = T(h / sp_div, 0, pol.stream, "residual")
    if hf:
        B.r.input_release[id(a_out)] = len(B.r.saved)  # ``hidden_states`` rebound by the residual add (x2, next)
    m_in = B.layer_norm(x2, "ln_2")
    m_out = T(h / sp_div, 0, m_in.nbytes, "ln_2.out")
    if hf:
        B.r.input_release[id(m_out)] = -2  # ... and by the second, the block's output
    B.outer_live = (m_out,)  # ``hidden_states`` while ``self.mlp`` runs (``residual`` is what ln_2 saved)
    B.linear(m_out, f, "c_fc", "c_fc.input", h)
    act = _gelu(B, k.act_impl, f, h / sp_div)
    B.linear(act, h, "mlp.c_proj", "mlp.c_proj.input")
    _gpt2_branch_dropout(B, h / sp_div, k.hidden_dropout if hf else 0.0, "mlp.resid_dropout", k.hidden_dropout)
    B.outer_live = ()


def _gpt2_branch_dropout(B: Builder, h: float, p: float, name: str, p_drop: float) -> None:
    """A GPT-2 residual branch's output projection and dropout (``Builder.drop``: its mask saved), with
    their outputs in op order for the allocator replay (``Recipe.forward_group``): ``c_proj``'s output
    (the compute dtype), freed once the dropout has made its own (``GPT2Attention.forward`` /
    ``GPT2MLP.forward`` rebind it), and the dropout's output, which ``GPT2Block.forward`` holds as
    ``attn_output`` / ``feed_forward_hidden_states`` until it returns, after the residual adds (transformers
    5.24.0 ``models/gpt2/modeling_gpt2.py`` L225-226, L241-245, L276-318): "e" hands it to the replay's
    layer end (freed once the next layer's input exists). Trace, GPT-2 b1 s2048 fp32: ``addmm`` 6,
    ``native_dropout``'s output 6 MiB, then its mask, the ``addmm`` output freed, the residual ``add`` in its place.
    Without dropout, under LoRA (``Builder._dropout_pack``) or in nanoGPT's ``Block`` (``p`` 0: its
    lifetimes differ), ``Builder.drop`` alone, with the dropout probability ``p_drop``."""
    half = B.p.half
    if p <= 0 or not B.dropout or B.frozen:
        B.drop(T(h, 0, half, "resid"), p_drop, name)
        return
    B.r.forward_group([T(h, 0, half, "resid"), T(h, 0, half, name)],
                      [Fwd.TEMP, Fwd.TEMP, Fwd.SAVED, Fwd.free(0), Fwd.end(1)],
                      T(h, 0, 1, name + ".mask"))
    B.r.resid_grad = h * B.p.stream  # (b, s, h), the residual stream's dtype: its gradient, apart from the branch's


def _bert_layer(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float, kvh: float, sp_div: int) -> None:
    """transformers BertLayer (post-LN) / XLMRobertaXLLayer (pre-LN): separate q, k, v linears."""
    pol, half = B.p, B.p.half
    if k.pre_norm:
        a_in = B.layer_norm(x, "attention.self_attn_layer_norm")
        src = T(h / sp_div, 0, a_in.nbytes, "attention.ln.out")
    else:
        src = x  # the previous layer's LayerNorm output
    qq = B.linear(src, q, "query", "qkv.input", h)
    kk = B.linear(src, kv, "key", "qkv.input", h)
    vv = B.linear(src, kv, "value", "qkv.input", h)
    qq, kk, vv = T(q, 0, half, "attn.q"), T(kv, 0, half, "attn.k"), T(kv, 0, half, "attn.v")
    ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                      softmax_fp32_then_cast=False, dropout_before_cast=True)
    B.linear(ctx, h, "attention.output.dense", "attention.output.dense.input")
    if k.pre_norm:
        B.drop(T(h / sp_div, 0, half, "resid"), k.hidden_dropout, "attention.output.dropout")
        x2 = T(h / sp_div, 0, pol.stream, "residual")
        m_in = B.layer_norm(x2, "LayerNorm")
        src2 = T(h / sp_div, 0, m_in.nbytes, "LayerNorm.out")
    else:
        ln1 = _bert_branch_end(B, k, h / sp_div, "attention.output", Fwd.next_saved(1))
        src2 = T(h / sp_div, 0, ln1.nbytes, "attention.output.LayerNorm.out")
    if not k.pre_norm:
        # post-LN: the output LayerNorm's input gradient (b, s, h), residual dtype, reaches the residual
        # add's two inputs as one tensor; the attention branch's (``attention.output.LayerNorm``'s
        # output) waits in autograd's input buffer for the MLP branch's gradient, so it is alive
        # through the MLP's linears' backward (transformers 5.24 bert/modeling_bert.py L352, ``BertOutput.
        # forward``: ``self.LayerNorm(hidden_states + input_tensor)``). Found by trace at ``output.
        # dense``'s backward, 2 layers, fp32, 4 x 256: BERT hidden 64 seq-cls -0.9%; hidden 256 QA
        # -1.2% once ``qa_outputs.input``, wrongly kept there, was not (quantities.model_facts.HEAD_KEYS)
        B.waiting_grad = (T(h / sp_div, 0, pol.stream),)
    B.linear(src2, f, "intermediate.dense", "intermediate.dense.input", h)
    act = _gelu(B, k.act_impl, f, h / sp_div, incoming=k.pre_norm)  # post-LN: LayerNorm's gradient
    B.linear(act, h, "output.dense", "output.dense.input")
    B.waiting_grad = ()
    if k.pre_norm:
        dropped = B.drop(T(h / sp_div, 0, half, "resid"), k.hidden_dropout, "output.dropout")
    else:
        # its output is the next layer's input, saved by the next layer's q/k/v (or the head)
        dropped = T(h / sp_div, 0, half, "output.dropout")
        out = _bert_branch_end(B, k, h / sp_div, "output", Fwd.end(1), dropped)
        if not B.frozen:
            # recomputed (full recompute), the layer stops at this last pack with its frames holding
            # ``attention_output`` (``feed_forward_chunk``; saved itself only without autocast), the
            # dropout's output (``BertOutput.forward``'s ``hidden_states``) and the LayerNorm's output,
            # while the layer's output gradient, which backward brought to the LayerNorm whose unpack
            # started the recomputation, is alive (transformers 5.24 bert/modeling_bert.py L349-352,
            # L417-419). Found by trace: BERT (2 layers, hidden 64) seq-cls bf16-amp, full recompute,
            # 4 x 256: -1.3% before, the recomputed top layer's ``NativeLayerNormBackward0``
            B.r.recompute_moment("output.LayerNorm.recompute", src2, dropped, out, at_pack=True)
            B.r.trigger = (h / sp_div * pol.stream, h / sp_div * pol.stream, B.r.packs)


def _bert_branch_end(B: Builder, k: LayerKey, h: float, name: str, last: str, dropped: T | None = None) -> T:
    """A post-LN ``BertLayer`` branch's end: ``BertSelfOutput`` / ``BertOutput.forward`` (transformers 5.24
    ``models/bert/modeling_bert.py`` L290-294, L349-353): ``dense``, ``dropout``, then
    ``LayerNorm(hidden_states + input_tensor)``; returns the LayerNorm's output. The dropout saves its
    mask and the LayerNorm its input (the residual sum) and fp32 mean and rstd, as ``Builder.drop`` and
    ``Builder.layer_norm``. With a trained base and dropout, their order for the allocator replay
    (``Recipe.forward_group``): the dense's output and the dropout's output (both (b, s, h) in the
    compute dtype), the mask, the dense's output freed as ``hidden_states`` is rebound, the sum and the
    statistics; the dropout's output lives until the LayerNorm has made its output (``hidden_states``
    rebound again): ``last`` "n1" frees it once the next saved tensor exists (the attention branch's
    LayerNorm output, saved by ``intermediate.dense``), "e1" once the layer has returned (the output
    branch's LayerNorm output is the next layer's input). Trace, BERT b8 s256 bf16: ``addmm`` 3 MiB,
    ``native_dropout`` 3 + 1.5 MiB, the ``addmm`` output freed, the sum 3 MiB, the LayerNorm's output
    3 MiB, the dropout's output freed. ``dropped``: the dropout's output where the caller names it."""
    pol, half = B.p, B.p.half
    drop = f"{name}.dropout"
    dropped = dropped or T(h, 0, half, drop)
    summed = T(h, 0, pol.stream, f"{name}.LayerNorm")
    if k.hidden_dropout <= 0 or not B.dropout or B.frozen or B.manual_ln or (pol.amp and summed.nbytes != F32):
        B.drop(T(h, 0, half, "resid"), k.hidden_dropout, drop)
        return B.layer_norm(summed, f"{name}.LayerNorm")
    if B.base_trains:
        B.grad_starts(summed)
    B.r.forward_group([T(h, 0, half, "resid"), dropped],
                      [Fwd.TEMP, Fwd.TEMP, Fwd.SAVED, Fwd.free(0), Fwd.SAVED, Fwd.SAVED, last],
                      T(h, 0, 1, drop + ".mask"), T(h, 0, summed.nbytes, f"{name}.LayerNorm"),
                      T(2, 0, F32, f"{name}.LayerNorm.stats"))
    return T(h, 0, F32 if pol.amp else summed.nbytes, f"{name}.LayerNorm.out")


def _llama_layer(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float, kvh: float, sp_div: int) -> None:
    """transformers LlamaDecoderLayer / MixtralDecoderLayer: RMSNorm, rotary, GQA, SwiGLU (MoE).

    Under sequence parallelism the norms run on the (b, s/tp, h) sequence shard, and the input of
    attention and of the MLP is all-gathered before the column-parallel linears, which save that
    gathered (b, s, h) tensor (their own half cast of it under autocast): PyTorch's plan
    (``trainmem.wrappers.tp_layer_plan``, torchtitan's ``apply_tp``) all-gathers in
    ``PrepareModuleInput`` (torch 2.13 ``torch/distributed/tensor/parallel/style.py``,
    ``PrepareModuleInput._prepare_input_arg`` -> ``redistribute`` to ``Replicate``), outside the
    linear, and ``F.linear`` on the gathered DTensor saves its local tensor, the whole sequence.
    Megatron-LM (``--framework megatron``, ``LayerKey.sp_gathered`` false) saves the shard instead
    and gathers it again in backward (``megatron/core/tensor_parallel/layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication.forward``: ``ctx.save_for_backward(input,
    weight)`` before the all-gather into its global buffer)."""
    pol, half = B.p, B.p.half
    gathered = h if k.sp_gathered else h / sp_div  # what the column-parallel linears get (and save)
    resid = _llama_resid(B, k, gathered)  # the residual stream in op order (the input made below, its adds)
    src = _llama_norm(B, x, "input_layernorm", gathered, inp=resid)  # shared input of q/k/v
    B.outer_live = (src,)  # the decoder layer's ``hidden_states`` while ``self_attn`` runs
    proj = {}
    for name, width, out, rows in (("q_proj", q, "attn.q", heads), ("k_proj", kv, "attn.k", kvh),
                                   ("v_proj", kv, "attn.v", 0)):
        proj[name] = B.linear(src, width, name, f"{name}.input", h, out_name=out)
        if k.qk_norm and rows:  # Qwen3: q_norm after q_proj, k_norm after k_proj (forward order)
            _head_norm(B, proj[name], name, src, rows)
    # rotary: q*cos + rotate_half(q)*sin makes new q and k tensors; cos/sin are shared per model;
    # v is v_proj's output itself
    qq, kk, vv = T(q, 0, half, "attn.q_rot"), T(kv, 0, half, "attn.k_rot"), proj["v_proj"]
    backend = "eager" if k.attention == "eager" else B.sdpa(k.attention, k.head_dim, heads, kvh, k.attention_dropout)
    if k.kv_cache:
        # (b == 1: eager's and math's matmuls reshape the strided tensors into views, see _cache_tensors)
        shares = k.cache_kind == "copy" or backend in ("flash", "efficient", "cudnn")
        if k.liger:  # Liger's RoPE rotates k_proj's output in place, in its dtype (liger_modules.RopeFunction):
            # half, or fp32 from a 4-bit linear under autocast (Builder.frozen_linear), not rotary's fp32 cos/sin
            k = dataclasses.replace(k, rotary_keys_half=proj["k_proj"].nbytes != F32)
        _hold_cache(B, _cache_tensors(k, pol, kk, vv, kv, shares), _cache_tensors(k, pol, kk, vv, kv, True))
    if resid and _rotary_repeated(B, k, backend, heads, kvh):      # (released after o_proj: ``_llama_resid_events``)
        _llama_rotary_held(B, proj["q_proj"], proj["k_proj"], qq, kk, vv, q_saved=backend != "eager")
    elif _rotary_in_order(B, k, backend, heads, kvh):
        _llama_rotary_group(B, proj["q_proj"], proj["k_proj"], qq, kk, vv)
    elif _rotary_cached(B, k, backend, heads, kvh):
        _llama_rotary_cached(B, proj["q_proj"], proj["k_proj"], qq, kk, vv)
    elif resid and _rotary_cached_eager(B, k, backend, heads, kvh):
        _llama_rotary_cached_eager(B, proj["q_proj"], proj["k_proj"], qq, kk, vv)
    if _math_in_order(B, k, backend, heads, kvh):                # the math kernel's attention, in op order
        ctx = _llama_math_attention(B, k, proj, heads, kvh)
    else:
        ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                          softmax_fp32_then_cast=True)
    if resid and backend == "eager" and not pol.amp:              # ``matmul(p, v)``'s (b, heads, s, d) output,
        B.r.forward_group([T(q, 0, half, "attn.pv")], [Fwd.TEMP, Fwd.SAVED, Fwd.free(0)],
                          ctx)                                    # freed once copied into ctx
    B.linear(ctx, h, "o_proj", "o_proj.input")
    x2 = T(h / sp_div, 0, pol.stream, "residual")
    branch = T(h, 0, half, "o_proj.out") if resid else None      # o_proj's output: (b, s, h), compute dtype
    src2 = _llama_norm(B, x2, "post_attention_layernorm", gathered, branch=branch)
    # ``hidden_states`` while ``self.mlp`` runs (LlamaMLP's ``x``), and ``residual``, which the norm
    # saved as its fp32 cast where it is half (an fp32 one is the tensor the norm saved)
    B.outer_live = (src2,) if x2.nbytes == F32 else (src2, x2)
    if k.experts and k.ep > 1:
        _moe_ep(B, src2, h, f, k.experts, k.top_k, k.ep, k.ep_rows)
    elif k.experts and k.expert_loop:
        _moe_loop(B, src2, h, f, k.experts, k.top_k)
    elif k.experts:
        _moe(B, src2, h, f, k.experts, k.top_k)
    elif k.liger:
        _liger_swiglu(B, f, h, src2, "mlp")
    else:
        _swiglu(B, f, h, src2, "mlp", fused_gate_up=False)
    if resid:                                                     # down_proj's output (compute dtype), then
        B.r.resid_tail = (T(h, 0, half, "down_proj.out"), T(h, 0, pol.stream, "residual"))  # the layer's
    B.outer_live = ()


def _llama_norm(B: Builder, x: T, name: str, gathered: float, inp: bool = False, branch: T | None = None) -> T:
    """A Llama decoder layer's RMSNorm and its output (``src``: what the next linears read, (b, s, h) or the
    gathered sequence under SP), saved here without autocast by a trainable linear (``Builder.linear``:
    no per-call casts; frozen linears save none). Where the norm is transformers' own in Python ops with a
    trainable weight and no SP (``_llama_norm_group``; under autocast on an fp32 stream), in op order;
    else ``Builder.rms_norm_hf`` (the same saved tensors, its temporaries freed at the layer's end).
    ``inp``, ``branch``: the residual stream written with it (``_llama_resid``): the norm's input is the
    layer's, made by the layer below; the residual add before it, of ``branch`` (o_proj's output)."""
    if _plain_hf_norm(B) and gathered == x.tok and B.sp_div == 1 and (not B.p.amp or x.nbytes == F32):
        return _llama_norm_group(B, x, name, inp, branch)
    a_in = B.rms_norm_hf(x, name)
    src = T(gathered, 0, a_in.nbytes, name + ".out")
    if not B.p.amp and not B.frozen:
        B.r.save(src)
    return src


def _llama_resid(B: Builder, k: LayerKey, gathered: float) -> bool:
    """Whether the Llama layer's residual stream is written in op order (transformers 5.24.0
    ``models/llama/modeling_llama.py`` ``LlamaDecoderLayer.forward`` L296-315): where both norms are
    (``_llama_norm``'s group: transformers' norm, no SP), without tensor parallelism (o_proj's and
    down_proj's outputs are DTensor redistributions there), experts or Liger's SwiGLU (whose outputs
    are made otherwise). The layer's input (``hidden_states``, the layer below's output, which
    ``LlamaModel.forward`` L393-394 holds until the layer returns and rebinds it) is taken from the layer
    below (``_llama_norm_group``'s "i"/"j"); ``o_proj``'s output (L270, held by ``hidden_states`` L299)
    is freed once the first add ``residual + hidden_states`` (L308) has made the stream's next tensor,
    which lives until the layer returns (``residual`` L311, unless the second norm saves it); then
    ``down_proj``'s output and the second add, the layer's output (``Recipe.resid_tail``), after which
    ``down_proj``'s output, the first add's and the layer's input die as the layer returns."""
    return (_plain_hf_norm(B) and gathered == k.h and B.sp_div == 1 and k.tp == 1 and not k.experts
            and not k.liger and (not B.p.amp or B.p.stream == F32))


def _plain_hf_norm(B: Builder) -> bool:
    """Whether ``Builder.rms_norm_hf`` is transformers' ``LlamaRMSNorm`` as written (no Liger kernel,
    input-dtype or torchtune variant) with a trainable weight and no LoRA (whose first-layer saves
    ``grad_starts`` tracks)."""
    return not (B.liger or B.rms_input or B.norm_fp32_product or B.frozen or B.base_trains or B.lora)


def _llama_norm_group(B: Builder, x: T, name: str, inp: bool = False, branch: T | None = None) -> T:
    """transformers 5.24.0 ``LlamaRMSNorm.forward`` (``models/llama/modeling_llama.py`` L62-67) without
    autocast, in op order (``Recipe.forward_group``) with the tensors ``rms_norm_hf`` saves, then its
    output, which the q/k/v or gate/up linears save. Per token: ``hidden_states.to(torch.float32)``
    (fp32, saved by ``pow`` and the multiply; the input itself when it is fp32, counted as
    ``rms_norm_hf`` counts it); ``pow(2)`` (fp32, temporary: freed once ``mean`` has reduced it);
    ``mean(-1, keepdim=True)`` (``variance``, fp32 per row, held by the frame until the return);
    ``variance + eps`` (fp32 per row, freed once ``rsqrt`` has run); ``rsqrt`` (fp32 per row, saved);
    ``hidden_states * rsqrt`` (fp32, rebinds ``hidden_states``: held until the return); its
    ``.to(input_dtype)`` (a new half tensor where the input is half, saved by the weight's multiply;
    the fp32 product itself, no copy, where it is fp32); ``self.weight * ...`` (the output, weight x
    input dtype promotion), then the frame's ``variance`` and fp32 product are freed. Trace, a 2-layer
    Llama (h 1024) b4 s512 pure bf16 asks 8 MiB, 8 MiB, 8 KiB x3, 8 MiB, 4 MiB, 4 MiB; the replay
    had asked 8 MiB, 8 KiB, 4 MiB x2 and made ``pow``'s and the product's 8 MiB after the layer. Under
    autocast (an fp32 residual stream: fp32 weight and ops, which autocast leaves alone) as in fp32, but
    the output is not saved: the linears save their half casts of it, and ``_saved_and_casts`` makes it
    as their held input (``layers.linear_inputs``), the "g" temporary freed once it exists. ``inp``,
    ``branch``: the residual stream before it (``_llama_resid_events``)."""
    half = x.nbytes != F32                                        # the input's dtype: bf16/fp16 or fp32
    x32 = T(x.tok, 0, F32, name)                                  # x.to(float32): (b, s, h) fp32
    temps = [T(x.tok, 0, F32, name + ".pow"), T(1, 0, F32, name + ".variance"),  # (b, s, h), (b, s, 1)
             T(1, 0, F32, name + ".eps")]                                         # (b, s, 1) fp32
    stats = T(1, 0, F32, name + ".stats")                         # rsqrt: (b, s, 1) fp32, saved
    normed = T(x.tok, 0, x.nbytes, name)                          # .to(input_dtype): saved by weight * ...
    out = T(x.tok, 0, max(B.p.weight, x.nbytes), name + ".out")   # the norm's output: (b, s, h)
    saved = [x32, stats, normed, out]
    B.r.input_saved |= not half and x is B.layer_input
    if half:
        temps.append(T(x.tok, 0, F32, name + ".normed32"))        # hidden * rsqrt: (b, s, h) fp32
        events = [Fwd.SAVED, Fwd.TEMP, Fwd.TEMP, Fwd.free(0), Fwd.TEMP, Fwd.SAVED, Fwd.free(2), Fwd.TEMP, Fwd.SAVED,
                  Fwd.SAVED, Fwd.free(1), Fwd.free(3)]
        _rms_norm_backward_half(B, x, len(B.r.saved), name)
    elif B.p.amp:                                                 # autocast: fp32 as below, but the output is
        events = [Fwd.SAVED, Fwd.TEMP, Fwd.TEMP, Fwd.free(0), Fwd.TEMP, Fwd.SAVED, Fwd.free(2), Fwd.SAVED,
                  Fwd.after(1)]                                   # the linears' unsaved input (their half casts)
        saved.pop()                                               # ``variance`` freed once it exists
        _rms_norm_backward_fp32(B, x, len(B.r.saved), name, saves_out=False)
    else:                                                         # fp32: .to(fp32) is the product itself
        events = [Fwd.SAVED, Fwd.TEMP, Fwd.TEMP, Fwd.free(0), Fwd.TEMP, Fwd.SAVED, Fwd.free(2), Fwd.SAVED, Fwd.SAVED,
                  Fwd.free(1)]
        _rms_norm_backward_fp32(B, x, len(B.r.saved), name)
    pre, events = _llama_resid_events(x, half, inp, branch, events)
    B.r.forward_group(pre + temps, events, *saved)
    return out


def _llama_resid_events(x: T, half: bool, inp: bool, branch: T | None, events: list) -> tuple[list, list]:
    """The residual stream's tensors before a Llama norm's (``_llama_norm_group``'s ``events``, whose first
    "s" is ``x.to(float32)``: the input itself in an fp32 stream), as temporaries to put first and the
    events with them (``_llama_resid``). ``inp``: the norm's input is the layer's, made by the layer below
    (fp32 stream: "i", the saved tensor; half stream: "j", unsaved, held until the layer's module call
    returns, its forward hooks run: ``nn.Module._call_impl`` holds ``args``).
    ``branch``: o_proj's output (compute dtype), after which ``LlamaAttention.forward`` returns and its locals
    held past the attention die ("H", ``_llama_rotary_held``), then the first residual add's output ``x`` (the
    stream's dtype), o_proj's output freed once it exists; in a half stream it is unsaved, held until the layer
    returns (``residual``, transformers 5.24.0 ``modeling_llama.py`` L308-311); in an fp32 stream it is
    the norm's first saved tensor."""
    def shifted(k: int, evs: list) -> list:                     # (indexed events: fK, gK)
        return [e if e in (Fwd.SAVED, Fwd.TEMP) else at(e[0], index(e) + k) for e in evs]
    if inp and half:                                              # the layer's input: (b, s, h) half
        return [x], [Fwd.INPUT_TEMP] + shifted(1, events)
    if inp:
        return [], [Fwd.INPUT] + events[1:]
    if branch is not None and half:                               # o_proj's output ("H": the attention's held locals
        return [branch, x], [Fwd.TEMP, Fwd.DROP_HELD, Fwd.TEMP, Fwd.free(0)] + shifted(2, events) + [Fwd.end(1)]
    if branch is not None:                                        # freed), the add's
        return [branch], [Fwd.TEMP, Fwd.DROP_HELD, Fwd.SAVED, Fwd.free(0)] + shifted(1, events[1:])
    return [], events


def _rms_norm_backward_half(B: Builder, x: T, base: int, name: str = "") -> None:
    """``LlamaRMSNorm``'s backward on a half input (``_llama_norm_group``'s saved tensors from ``base``: 0
    ``x.to(float32)``, 1 ``rsqrt``, 2 the normalized half tensor, 3 the output), node by node as autograd
    runs the forward's ops in reverse (torch 2.13 ``tools/autograd/derivatives.yaml``), for the replay
    (``Recipe.backward_group``): the output's gradient g ((b, s, h), the output's dtype) arrives
    (0); ``MulBackward0`` of ``weight * normed`` (``other``'s gradient first, ``grad * self``, then
    ``self``'s, ``grad * other``: the generated node's order, seen on CPU with a dispatch mode):
    ``grad * weight`` (1, the normalized one's) and ``grad * normed`` (2, summed to the weight's, then
    freed), g and ``normed`` released; ``ToCopyBackward0``: its fp32 cast (3); ``MulBackward0`` of
    ``hidden * rsqrt``: ``grad * hidden`` (4, summed to rsqrt's (b, s, 1), freed) and ``grad * rsqrt``
    (5), the cast freed, ``rsqrt`` released; ``RsqrtBackward0``, ``AddBackward0`` and
    ``MeanBackward0``'s (b, s, 1) ones left out (the small pool); ``MeanBackward0``'s expanded ``div``
    (6); ``PowBackward0``: ``pow(x, 1)`` (7), ``* 2`` (8), ``grad * ...`` (9), then those, the mean's and
    the saved fp32 input released; the two gradients of the fp32 input summed (10, ``add``); its
    ``ToCopyBackward0`` to the input's dtype (11), added to the residual stream's gradient (12, which
    waited in autograd's input buffer since the layer's output add: ``_swiglu_backward``'s carry) into
    the gradient of the norm's input (13), both freed. Each (b, s, h) in the dtype written; g (0) is the
    gradients of the linears reading the norm summed, carried from ``_swiglu_backward`` ("u" events,
    ``reserved.layer_backward._run_group``; made where nothing is carried). Trace (the real nodes on fake tensors), a Llama (h 1024) b2 s512 pure
    bf16: 2, 2 (-2 -2 -2), 4 (-2), 4, 4 (-4 -4), 4, 4, 4, 4 (-4 x4), 4 (-4 -4), 2 (-4) MiB, where the
    replay made none of them (transformers 5.24 ``models/llama/modeling_llama.py`` L62-67)."""
    out = max(B.p.weight, x.nbytes)                               # the output's (and g's) dtype
    temps = [T(x.tok, 0, out), T(x.tok, 0, x.nbytes), T(x.tok, 0, out)] + \
        [T(x.tok, 0, F32) for _ in range(8)] + [T(x.tok, 0, x.nbytes)] * 3
    t, u, free, rel = Bwd.TEMP, Bwd.TAKE, Bwd.free, Bwd.release
    events = [rel(3), u, t, t, free(2), free(0), rel(2), t, free(1), t, t, free(4), free(3), rel(1),
              t, t, t, t, free(7), free(8), free(6), rel(0), t, free(5), free(9), t, free(10), u, t, free(11), free(12)]
    B.r.backward_group(base, temps, _norm_stream_events(events, name))


def _rms_norm_backward_fp32(B: Builder, x: T, base: int, name: str = "", saves_out: bool = True) -> None:
    """``LlamaRMSNorm``'s backward on an fp32 input without autocast, as ``_rms_norm_backward_half`` but
    ``x.to(float32)`` is the input itself (no node, no copy) and ``.to(input_dtype)`` the product itself, so
    no ``ToCopyBackward0`` runs and the input's gradients accumulate in autograd's input buffer
    (``torch/csrc/autograd/input_buffer.cpp`` ``InputBuffer::add``: out of place, both freed) with the
    residual stream's, which waited there since the layer's output add: ``grad * weight`` (1), ``grad *
    normed`` (2, summed, freed), g and ``normed`` released; ``grad * hidden`` (3, summed, freed) and
    ``grad * rsqrt`` (4), (1) freed, ``rsqrt`` released; (4) added to the residual one (5, taken from
    ``_swiglu_backward``'s carry: 6), both freed; ``MeanBackward0``'s ``div`` (7), ``PowBackward0``'s
    ``pow`` (8), ``* 2`` (9), ``grad * ...`` (10), those and the input released; (10) added (11), each
    (b, s, h) fp32. Trace, a Llama (h 1024) b2 s512 fp32: 4, 4 (-4 -4 -4), 4, 4 (-4 -4), 4 (-4 -4), 4, 4, 4,
    4 (-4 x4), 4 (-4 -4) MiB. Under autocast (an fp32 stream: the norm's ops in fp32, autocast leaves them
    alone) the same, but the output is not saved (``saves_out``; the linears save their half casts)."""
    temps = [T(x.tok, 0, F32) for _ in range(12)]
    t, u, free, rel = Bwd.TEMP, Bwd.TAKE, Bwd.free, Bwd.release
    events = [rel(3)] * saves_out + [u, t, t, free(2), free(0), rel(2), t, t, free(3), free(1), rel(1), u, t,
                                     free(4), free(5), t, t, t, t, free(8), free(9), free(7), rel(0), t,
                                     free(6), free(10)]
    B.r.backward_group(base, temps, _norm_stream_events(events, name))


def _norm_stream_events(events: list, name: str) -> list:
    """A Llama norm's backward events (``_rms_norm_backward_half``/``_fp32``) with the residual stream's
    gradient across the attention branch: the post-attention norm's last tensor, its input's gradient
    ((b, s, h), the stream's dtype: the norm's added to the one the layer's output add handed down), is
    the gradient of the attention block's residual add (``hidden_states = residual + hidden_states``,
    transformers 5.24 ``models/llama/modeling_llama.py`` L238-239): ``AddBackward0`` hands it to o_proj's
    backward and to the residual path, where it waits in the input norm's ``AddBackward0`` input buffer
    (torch 2.13 ``torch/csrc/autograd/input_buffer.cpp`` ``InputBuffer::add``) through the attention
    branch, so it is kept ("kK") rather than freed at the group's end, and the input norm's group takes
    it as its residual gradient ("r", for its second "u") rather than making one. Trace (the real nodes
    on fake tensors), Llama-3.2-1B-shaped GQA (h 2048) b4 s512 eager fp32: the post-attention norm's
    backward ends 16 (-16 -16) MiB, the input norm's adds 16 (-16 -16) MiB, where the replay freed the
    16 MiB sum at the first group's end and made a 16 MiB residual gradient at the second."""
    if name.endswith("post_attention_layernorm"):
        last = sum(e in (Bwd.TEMP, Bwd.TAKE) for e in events) - 1
        return events + [Bwd.keep_stream(last)]
    if name.endswith("input_layernorm"):
        at = [i for i, e in enumerate(events) if e == Bwd.TAKE][1]
        return events[:at] + [Bwd.TAKE_STREAM] + events[at + 1:]
    return events


def _rotary_in_order(B: Builder, k: LayerKey, backend: str, heads: float, kvh: float) -> bool:
    """Whether ``_llama_rotary_group`` writes the rotary embedding's tensors: transformers' own
    ``apply_rotary_pos_emb`` (no Liger RoPE, no Qwen3 q/k norms, no KV cache) without autocast (whose
    fp32 ``cos``/``sin`` make fp32 products) or LoRA, before a fused SDPA kernel that saves the rotated
    q and k and v themselves (no padded or repeated copies, no ring attention), or eager attention
    without grouped key/value heads (``Builder._eager_attention``: its matmuls save q, k, v themselves;
    with them ``repeat_kv``'s copies, and the rotated k and v live until the attention returns)."""
    if B.p.amp or k.liger or k.qk_norm or k.kv_cache or not _plain_hf_norm(B) or B.ring > 1:
        return False
    if backend == "eager":                                         # ``matmul(q, k^T)`` saves q, k and v
        return heads == kvh                                       # themselves without repeat_kv's copies
    if backend not in ("flash", "efficient", "cudnn") or (backend == "flash" and k.head_dim % 8):
        return False
    return heads == kvh or not (B.repeat_kv or sdpa_repeats_kv(heads, kvh, k.head_dim))


def _rotary_repeated(B: Builder, k: LayerKey, backend: str, heads: float, kvh: float) -> bool:
    """Whether ``_llama_rotary_held`` writes the rotary embedding's tensors: as ``_rotary_in_order``, before
    eager attention, whose matmuls save copies (``repeat_kv``'s of k and v with grouped key/value heads, else
    ``matmul``'s reshaped copies of the transposed q, k and v: ``Builder._eager_attention``'s saved q, k, v),
    or before a fused SDPA kernel that gets ``repeat_kv``'s copies (``sdpa_repeats_kv``, more than one
    key/value head; not ``--attention-call repeat-kv``, whose copies are made apart)."""
    if B.p.amp or k.liger or k.qk_norm or k.kv_cache or not _plain_hf_norm(B) or B.ring > 1 or B.repeat_kv:
        return False
    if backend == "eager":
        return True
    if heads == kvh or kvh <= 1:
        return False
    if backend not in ("flash", "efficient", "cudnn") or (backend == "flash" and k.head_dim % 8):
        return False
    return sdpa_repeats_kv(heads, kvh, k.head_dim)


def _llama_rotary_held(B: Builder, q_out: T, k_out: T, qq: T, kk: T, vv: T, q_saved: bool) -> None:
    """``_llama_rotary_group`` where the attention saves ``repeat_kv``'s copies of the rotated k and of v, not
    them (``_rotary_repeated``): ``v_proj``'s output and the rotated k are then ``LlamaAttention.forward``'s
    locals (``key_states``, ``value_states``, transformers 5.24.0 ``models/llama/modeling_llama.py``
    L244-271), held until it returns after ``o_proj`` ("hK": ``reserved.layer_forward._group_allocs`` frees
    them at the next "H", the residual branch's, ``_llama_resid_events``), and so is the rotated q under eager
    attention (``q_saved`` False), whose ``matmul(q, k^T)`` saves its own reshaped copy of the transposed q
    (``Builder._eager_attention``'s saved q); a fused kernel saves the rotated q itself. Trace, the wide
    Llama with 4 of 16 key/value heads, eager, pure bf16, after the projections (4, the workspace, 1, 1 MiB)
    and the rotary temporaries: ``repeat_kv``'s 4, 4 MiB, matmul's 4 MiB copy of q, the scores ..., the
    context, ``o_proj``'s output, then the rotated q (4 MiB), k and v (1 MiB) freed."""
    temps = [q_out, k_out, vv]                                    # (b, s, q), (b, s, kv), (b, s, kv): compute dtype
    events = [Fwd.TEMP, Fwd.WORKSPACE, Fwd.TEMP, Fwd.TEMP]        # q_proj (the workspace), k_proj, v_proj outputs
    saved, held = [], []
    for x, rot, keep in ((q_out, qq, q_saved), (k_out, kk, False)):
        b = len(temps)
        temps += [T(x.tok, 0, x.nbytes, "rotary.cos"), T(x.tok / 2, 0, x.nbytes, "rotary.neg"),  # x*cos, -x2
                  T(x.tok, 0, x.nbytes, "rotary.cat"), T(x.tok, 0, x.nbytes, "rotary.sin")]     # cat, cat*sin
        events += [Fwd.TEMP, Fwd.TEMP, Fwd.TEMP, Fwd.free(b + 1), Fwd.TEMP, Fwd.free(b + 2)]
        if keep:                                                  # the rotated tensor: saved by the kernel
            events.append(Fwd.SAVED)
            saved.append(rot)
        else:                                                     # ... or a local held past the attention
            temps.append(T(rot.tok, 0, rot.nbytes, rot.name + ".held"))
            events.append(Fwd.TEMP)
            held.append(Fwd.hold(b + 4))
        events += [Fwd.free(b), Fwd.free(b + 3)]
    B.r.forward_group(temps, events + [Fwd.free(0), Fwd.free(1)] + held + [Fwd.hold(2)], *saved)


def _rotary_cached(B: Builder, k: LayerKey, backend: str, heads: float, kvh: float) -> bool:
    """Whether ``_llama_rotary_cached`` writes the rotary embedding's tensors: as ``_rotary_in_order`` but with
    transformers' KV cache (``k.kv_cache``) of copies (``cache_kind`` "copy", transformers >= 4.56), before a
    fused SDPA kernel that takes the cache's keys and values as they are (no padded or repeated copies), so
    that they are the tensors the kernel saves (``_cache_tensors``' ``shares``). Not under autocast."""
    if B.p.amp or k.liger or k.qk_norm or not k.kv_cache or k.cache_kind != "copy" or not _plain_hf_norm(B) \
            or B.ring > 1 or B.repeat_kv:
        return False
    if backend not in ("flash", "efficient", "cudnn") or (backend == "flash" and k.head_dim % 8):
        return False
    return heads == kvh or not sdpa_repeats_kv(heads, kvh, k.head_dim)


def _llama_rotary_cached(B: Builder, q_out: T, k_out: T, qq: T, kk: T, vv: T) -> None:
    """``_llama_rotary_group`` with a KV cache of copies (``_rotary_cached``): ``cache.update`` (transformers
    5.24.0 ``models/llama/modeling_llama.py`` L252, ``cache_utils.py`` ``DynamicLayer.update`` L119-138: ``torch.cat``
    of the empty cache and the new keys, then values) copies the rotated k and ``v_proj``'s output into the
    cache's tensors (``kk``, ``vv``: what the cache holds and the kernel saves), and rebinding ``key_states``,
    ``value_states`` to them frees the two originals. Trace, a Qwen2-shaped layer (896 wide, 2 key/value heads)
    b1 s1024 bf16: after the rotary temporaries, ``q_proj``'s and ``k_proj``'s outputs freed, then two 0.25 MiB
    copies made and the rotated k and ``v_proj``'s output (0.25 MiB each) freed."""
    temps = [q_out, k_out, vv]                                    # (b, s, q), (b, s, kv), (b, s, kv): compute dtype
    events = [Fwd.TEMP, Fwd.WORKSPACE, Fwd.TEMP, Fwd.TEMP]        # q_proj (the workspace), k_proj, v_proj outputs
    for b, x in ((3, q_out), (7, k_out)):
        temps += [T(x.tok, 0, x.nbytes, "rotary.cos"), T(x.tok / 2, 0, x.nbytes, "rotary.neg"),  # x*cos, -x2
                  T(x.tok, 0, x.nbytes, "rotary.cat"), T(x.tok, 0, x.nbytes, "rotary.sin")]     # cat, cat*sin
        events += [Fwd.TEMP, Fwd.TEMP, Fwd.TEMP, Fwd.free(b + 1), Fwd.TEMP, Fwd.free(b + 2),
                   Fwd.SAVED if b == 3 else Fwd.TEMP, Fwd.free(b), Fwd.free(b + 3)]
    temps.append(T(kk.tok, 0, kk.nbytes, "attn.k_rot"))          # the rotated k, before its cache copy
    B.r.forward_group(temps, events + [Fwd.free(0), Fwd.free(1), Fwd.SAVED, Fwd.SAVED, Fwd.free(11), Fwd.free(2)],
                      qq, kk, vv)


def _rotary_cached_eager(B: Builder, k: LayerKey, backend: str, heads: float, kvh: float) -> bool:
    """Whether ``_llama_rotary_cached_eager`` writes the rotary embedding's tensors: a KV cache of copies as
    ``_rotary_cached``, before eager attention with grouped key/value heads (more than one), whose matmuls save
    ``repeat_kv``'s copies of the cache's tensors, not them."""
    if B.p.amp or k.liger or k.qk_norm or not k.kv_cache or k.cache_kind != "copy" or not _plain_hf_norm(B) \
            or B.ring > 1 or B.repeat_kv:
        return False
    return backend == "eager" and heads != kvh and kvh > 1


def _llama_rotary_cached_eager(B: Builder, q_out: T, k_out: T, qq: T, kk: T, vv: T) -> None:
    """``_llama_rotary_cached`` before eager attention with grouped key/value heads (``_rotary_cached_eager``):
    the cache's copies of the rotated k and of ``v_proj``'s output (``kk``, ``vv``) are saved by nothing
    (the matmuls save ``repeat_kv``'s copies of them, ``Builder._eager_attention``) but held by the cache,
    which the model output references ("cK": ``reserved.layer_forward._group_allocs``, freed with the output,
    ``_LayerCarry.out_refs``; ``Recipe.hold`` in the recipe, ``_hold_cache``), and the rotated q is a local of
    ``LlamaAttention.forward`` held until it returns after ``o_proj`` ("hK", as ``_llama_rotary_held``): matmul
    saves its own reshaped copy. Trace, the wide Llama with 4 of 16 key/value heads, eager, pure bf16, a KV
    cache: after the rotary temporaries and the projections' outputs freed, two 1 MiB copies, the rotated k and
    ``v_proj``'s output freed, then ``repeat_kv``'s 4, 4 MiB and matmul's 4 MiB copy of q."""
    temps = [q_out, k_out, vv]                                    # (b, s, q), (b, s, kv), (b, s, kv): compute dtype
    events = [Fwd.TEMP, Fwd.WORKSPACE, Fwd.TEMP, Fwd.TEMP]        # q_proj (the workspace), k_proj, v_proj outputs
    for b, x in ((3, q_out), (8, k_out)):
        temps += [T(x.tok, 0, x.nbytes, "rotary.cos"), T(x.tok / 2, 0, x.nbytes, "rotary.neg"),  # x*cos, -x2
                  T(x.tok, 0, x.nbytes, "rotary.cat"), T(x.tok, 0, x.nbytes, "rotary.sin"),     # cat, cat*sin
                  T(x.tok, 0, x.nbytes, "rotary.rotated")]                                     # their sum
        events += [Fwd.TEMP, Fwd.TEMP, Fwd.TEMP, Fwd.free(b + 1), Fwd.TEMP, Fwd.free(b + 2), Fwd.TEMP, Fwd.free(b),
                   Fwd.free(b + 3)]
    temps += [T(kk.tok, 0, kk.nbytes, "kv_cache.k"), T(vv.tok, 0, vv.nbytes, "kv_cache.v")]  # the cache's copies
    B.r.forward_group(temps, events + [Fwd.free(0), Fwd.free(1), Fwd.TEMP, Fwd.TEMP, Fwd.free(12), Fwd.free(2),
                                       Fwd.out_ref(13), Fwd.out_ref(14), Fwd.hold(7)])


def _llama_rotary_group(B: Builder, q_out: T, k_out: T, qq: T, kk: T, vv: T) -> None:
    """``LlamaAttention.forward``'s projections and rotary embedding in op order (``Recipe.forward_group``;
    transformers 5.24.0 ``models/llama/modeling_llama.py`` L119-148 ``rotate_half``,
    ``apply_rotary_pos_emb``, and the attention's forward), saving ``v_proj``'s output (``vv``) and the
    rotated ``qq``, ``kk``, which the attention saves next (``Builder._fused_attention``,
    ``_eager_attention``; saved again there, in place). In the compute dtype (no autocast: ``cos``/``sin``
    are cast to the hidden states' dtype by ``LlamaRotaryEmbedding.forward``): ``q_proj``'s and ``k_proj``'s outputs (held as
    ``query_states``/``key_states`` until ``apply_rotary_pos_emb`` returns and rebinds them); per q
    then k: ``q * cos``, ``-x2`` (half of q's width, freed once ``torch.cat`` has run), the ``cat``
    (freed once multiplied), ``rotate_half(q) * sin``, their sum (the rotated tensor, saved), then
    both products freed. ``mul`` by a ``cos``/``sin`` that needs no gradient saves only them. Trace, a
    2-layer Llama (h 1024) b4 s512 pure bf16: ``q_proj`` 4 MiB, the cuBLAS workspace, ``k_proj``,
    ``v_proj`` 4 MiB, then 4, 2, 4, 4, 4 MiB twice. "w": the forward thread's cuBLAS workspace, where the
    step's first matmul makes it (``first_matmul_at``), after ``q_proj``'s output (``_group_allocs``)."""
    temps = [q_out, k_out]                                        # (b, s, q), (b, s, kv) in the compute dtype
    events = [Fwd.TEMP, Fwd.WORKSPACE, Fwd.TEMP, Fwd.SAVED]       # q_proj (the workspace), k_proj, v_proj outputs
    for base, x in ((2, q_out), (6, k_out)):
        temps += [T(x.tok, 0, x.nbytes, "rotary.cos"), T(x.tok / 2, 0, x.nbytes, "rotary.neg"),  # x*cos, -x2
                  T(x.tok, 0, x.nbytes, "rotary.cat"), T(x.tok, 0, x.nbytes, "rotary.sin")]     # cat, cat*sin
        events += [Fwd.TEMP, Fwd.TEMP, Fwd.TEMP, Fwd.free(base + 1), Fwd.TEMP, Fwd.free(base + 2), Fwd.SAVED,
                   Fwd.free(base), Fwd.free(base + 3)]
    B.r.forward_group(temps, events + [Fwd.free(0), Fwd.free(1)], vv, qq, kk)


def _math_in_order(B: Builder, k: LayerKey, backend: str, heads: float, kvh: float) -> bool:
    """Whether ``_llama_math_attention`` writes the attention of a Llama-style layer op by op: SDPA's math
    kernel as PyTorch >= 2.5 runs it (``B.math_upcast``: in fp32), without dropout, on transformers' own
    projections, rotary embedding and ``sdpa_attention_forward`` (no LoRA or frozen base, Liger, Qwen3 q/k
    norms, sequence, tensor or context parallelism, litgpt's call), and a KV cache, if any, of transformers
    >= 4.56 (``torch.cat`` copies: ``_cache_tensors``): with grouped key/value heads passed as ``enable_gqa``
    (the kernel's ``repeat_interleave`` copies are contiguous, so only the strided query is copied by
    ``matmul``); with equal heads only on the cache's copies (contiguous, where the rotated keys and
    ``v_proj``'s output are (b, s, heads, d) memory that ``matmul`` would copy too) in a half dtype (in fp32
    the values themselves are saved, which the group does not write)."""
    if backend != "math" or not B.math_upcast or (k.attention_dropout > 0 and B.dropout) or not _plain_hf_norm(B):
        return False
    if k.liger or k.qk_norm or B.ring > 1 or B.sp_div != 1 or k.tp != 1 or B.repeat_kv or k.attention_call != "model":
        return False
    if heads != kvh and sdpa_repeats_kv(heads, kvh, k.head_dim):
        return False
    if heads == kvh and (B.p.half == F32 or not k.kv_cache):     # equal heads: the cache's contiguous copies,
        return False                                              # half (the values' fp32 copy is what is saved)
    return not k.kv_cache or k.cache_kind == "copy"


class _Ops:
    """A forward group's temporaries and events (``Recipe.group_ahead``) written op by op: ``make`` a
    temporary (its index), ``free`` some, ``save`` the next saved tensor."""

    def __init__(self) -> None:
        self.temps: list[T] = []
        self.events: list[str] = []

    def make(self, t: T | None) -> int | None:
        if t is None:
            return None
        self.temps.append(t)
        self.events.append(Fwd.TEMP)
        return len(self.temps) - 1

    def free(self, *idx: int | None) -> None:
        self.events += [Fwd.free(i) for i in idx if i is not None]

    def save(self) -> None:
        self.events.append(Fwd.SAVED)

    def hold(self, *idx: int | None) -> None:
        self.events += [Fwd.out_ref(i) for i in idx if i is not None]  # referenced by the model output


def _llama_math_attention(B: Builder, k: LayerKey, proj: dict, heads: float, kvh: float) -> T:
    """``LlamaAttention.forward`` from its projections' outputs to ``o_proj``'s input on SDPA's math
    kernel (``_math_in_order``), in op order (``Recipe.group_ahead``: ``_math_group``, at one
    sequence per micro-batch and at more), saving what ``_math_attention`` saves (three (b, s, heads x d)
    fp32 tensors: the scaled query or ``matmul``'s copy of it, the values and the scaled keys at the
    query's heads; the fp32 softmax; the same backward moments; the order the kernel makes them in, each
    the same bytes), then the context ``o_proj`` saves."""
    q = heads * k.head_dim                                        # the query's width, and the kernel's keys'
    many, one = _math_group(B, k, proj, heads, True), _math_group(B, k, proj, heads, False)
    assert [group_coef(t) for t in many.temps] == [group_coef(t) for t in one.temps]
    B.r.group_ahead(many.temps, many.events, one.events)
    B.r.save(T(q, 0, F32, "attn.math.q_scaled"), T(q, 0, F32, "attn.math.v"), T(q, 0, F32, "attn.math.k_scaled"))
    B.r.save(T(0, heads, F32, "attn.math.softmax"))
    B.r.transient("attn.math.backward", T(0, heads, F32), T(0, heads, F32))  # as ``_math_attention``'s
    B.r.transient("attn.math.pv.backward", T(0, heads, F32), T(q, 0, F32))
    return T(q, 0, B.p.half, "attn.context")


def _math_group(B: Builder, k: LayerKey, proj: dict, heads: float, many: bool) -> _Ops:
    """The temporaries of ``_llama_math_attention`` in op order (``many``: more than one sequence per
    micro-batch). transformers 5.24.0 ``models/llama/modeling_llama.py`` L119-148 (``rotate_half``,
    ``apply_rotary_pos_emb``) and ``LlamaAttention.forward``, ``cache_utils.py`` ``DynamicLayer.update``
    L90-117 (``torch.cat``), ``integrations/sdpa_attention.py`` ``sdpa_attention_forward`` (``enable_gqa``,
    ``is_causal``; ``transpose(1, 2).contiguous()`` after); autocast casts SDPA's fp32 inputs to half
    (on its lower-precision list, torch 2.13 ``autocast_mode.cpp``); the kernel (``_math_kernel``). Trace,
    Llama-3.2-1B shapes (2 layers) b1 s1024, per layer in MiB, fp32: q_proj 8, k_proj 2, v_proj 2, rotary
    8, 4, 8, -4, 8, -8, 8 (q rotated), -8, -8 and 2, 1, 2, -1, 2, -2, 2, -2, -2, then -8 -2 (the
    projections), the cache's ``cat`` 2 and 2, -2 -2 (rotated k, v_proj), then the kernel: the scaled
    query 8, the mask (``ones`` 1, ``tril`` 1, -1, ``where`` 4 fp32, -1), the keys and values at the
    query's heads (8, 8), the scaled keys 8, the scores 128, softmax 128, -128, ``attn @ v`` 8, -8 (the
    expanded keys), -4 (mask), the context 8, -8. Pure bf16 adds the fp32 copies of q, k, v (8, 2, 2) before
    the scaling, ``attn.to(bf16)`` 64 and the output's bf16 copy 4, freed as the kernel returns; bf16-amp
    the same on autocast's bf16 casts of the fp32 rotated q and cached keys (4, 1). The cache's copies
    live as long as the model's output (trace: freed with it after the loss), here too ("cK":
    ``reserved.driver._forward`` frees them with the output)."""
    pol, half = B.p, B.p.half
    qo, ko, vo = proj["q_proj"], proj["k_proj"], proj["v_proj"]   # (b, s, q), (b, s, kv) x2 in the compute dtype
    rd = F32 if pol.amp and not k.rotary_keys_half else half      # rotary's products: cos/sin's dtype (fp32 under autocast)
    o = _Ops()
    iq, ik, iv = o.make(qo), o.make(ko), o.make(vo)
    rot = []
    for x in (qo, ko):                                            # q * cos + rotate_half(q) * sin, then k
        a = o.make(T(x.tok, 0, rd, "rotary.cos"))                 # x * cos
        n = o.make(T(x.tok / 2, 0, x.nbytes, "rotary.neg"))       # -x2
        c = o.make(T(x.tok, 0, x.nbytes, "rotary.cat"))           # cat(-x2, x1)
        o.free(n)
        b = o.make(T(x.tok, 0, rd, "rotary.sin"))                 # cat * sin
        o.free(c)
        rot.append(o.make(T(x.tok, 0, rd, "rotary.out")))         # the sum: rotated q, k
        o.free(a, b)
    o.free(iq, ik)                                                # query_states, key_states rebound
    vd = vo.nbytes                                                # the values' dtype as SDPA gets them
    if k.kv_cache:                                                # DynamicLayer.update: torch.cat copies
        kc = o.make(T(ko.tok, 0, rd, "kv_cache.k"))               # the keys' dtype; the values' own from 5.24,
        vd = vd if k.cache_values_own_dtype else max(vd, rd)      # else promoted to the keys' (_cache_tensors)
        o.hold(kc, o.make(T(vo.tok, 0, vd, "kv_cache.v")))        # held by the model output (the cache)
        o.free(rot[1], iv)                                        # the rotated keys, v_proj's output rebound
    casts = [o.make(T(w, 0, half, "attn.autocast")) for w, d in ((qo.tok, rd), (ko.tok, rd), (vo.tok, vd))
             if pol.amp and d != half]                            # autocast's half casts of SDPA's fp32 inputs
    out = _math_kernel(o, half, (qo.tok, ko.tok), heads, many, ko.tok != qo.tok)  # (grouped: narrower keys)
    o.free(*casts)                                                # dropped as SDPA returns
    o.save()                                                      # transpose(1, 2).contiguous(): o_proj's input
    o.free(out)                                                   # (the rotated query, the keys or values:
    return o                                                      # held until o_proj, freed as the group ends)


def _math_kernel(o: _Ops, half: int, widths: tuple, heads: float, many: bool, gqa: bool = True) -> int:
    """torch 2.13 ``aten/src/ATen/native/transformers/attention.cpp`` ``_scaled_dot_product_attention_math``
    with grad and ``enable_gqa`` (``_math_group``; ``widths``: the query's and the keys' per token, the
    values' as the keys'), the ops ``nograd.math_sdpa`` lists: where the inputs are half (``up``) their
    fp32 copies (``.to(kFloat)``); the scaled query (saved at one sequence); the (s, s) causal mask
    (``is_causal``: bool ``ones`` and ``tril``, ``convert_boolean_attn_mask``'s fp32 ``where``); with
    ``gqa`` the keys and values at the query's heads (``repeat_interleave``: the values saved by
    ``matmul(attn, value)``; with equal heads the values' fp32 copy is, made before the scaled query);
    the scaled keys (saved); at more than one sequence ``matmul``'s contiguous copy of the scaled query,
    whose (b, heads, s, d) view of (b, s, heads, d) memory folds into bmm's batch only by a copy (saved
    instead of it: a view at b 1); the (b, heads, s, s) fp32 scores; softmax (saved); its half copy
    (returned, dropped by ``scaled_dot_product_attention``); ``attn @ v`` (fp32) and its half copy; the
    kernel's locals freed as it returns. Trace, the same shapes at b2 s256 pure bf16: ..., the scaled
    keys 1, the query's copy 1, the scores 4, ..., and the scaled query freed after the expanded keys.
    Equal heads (b2 s256 bf16): the same without ``repeat_interleave``, the values' fp32 copy kept. Returns
    its output's index."""
    q, kv = widths
    up = half != F32
    qa = o.make(T(q, 0, F32, "attn.math.q32") if up else None)     # query_.to(kFloat)
    ka = o.make(T(kv, 0, F32, "attn.math.k32") if up else None)    # key.to(kFloat)
    va = o.make(T(kv, 0, F32, "attn.math.v32") if up and gqa else None)  # value.to(kFloat), expanded below
    if up and not gqa:
        o.save()                                                  # ... or saved by attn @ v as it is
    qs = o.make(GroupT(q, 0, F32, "attn.math.q_scaled", multi=True))  # query_acc * scaling_factor: a temporary
    if not many:                                                  # at more than one sequence, else saved
        o.save()
    ones = o.make(GroupT(0, 0, 1, "attn.math.ones", pair=1))      # (s, s) bool
    tril = o.make(GroupT(0, 0, 1, "attn.math.tril", pair=1))
    o.free(ones)
    mask = o.make(GroupT(0, 0, F32, "attn.math.mask", pair=1))    # convert_boolean_attn_mask: fp32 where(...)
    o.free(tril)
    ke = o.make(T(q, 0, F32, "attn.math.k_expanded") if gqa else None)  # repeat_interleave to the query's heads
    if gqa:
        o.save()                                                  # ... the values so expanded
    o.save()                                                      # key.transpose(-2, -1) * scaling_factor
    if many:
        o.save()                                                  # matmul's copy of the scaled query
    sc = o.make(T(0, heads, F32, "attn.math.scores"))             # matmul(q, k), the mask added in place
    o.save()                                                      # _safe_softmax(attn, -1)
    o.free(sc)
    ac = o.make(T(0, heads, half, "attn.math.attn_half") if up else None)  # attn.to(origin_dtype)
    pv = o.make(T(q, 0, F32, "attn.math.pv"))                     # matmul(attn, value)
    out = o.make(T(q, 0, half, "attn.math.out")) if up else pv    # .to(origin_dtype)
    if up:
        o.free(pv)
    o.free(ke, qs, mask, va, ka, qa, ac)
    return out


def _unsloth_dequant(B: Builder, w: float) -> float:
    """Bytes of one 4-bit weight of ``w`` elements dequantized in backward by Unsloth's
    ``fast_dequantize(W.t(), W_quant)`` without its global buffer (unsloth 2026.3.5
    ``kernels/utils.py`` L470-580, the CUDA path): the weight in its quant state's dtype (half) and
    the fp32 absmax of its 64-element blocks (double quantization's ``out_absmax``), freed by
    ``del`` before the next. A 16-bit base weight (no quant state) is used as it is: none."""
    return w * (B.p.half + F32 / 64) if B.quant[0] else 0.0


def _unsloth_layer(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float, kvh: float,
                   sp_div: int) -> None:
    """A Llama-family layer as Unsloth's ``FastLlamaModel.patch_peft_model`` runs it (``--unsloth-kernels``;
    unsloth 2026.3.5 ``models/llama.py`` L3334-3420: every layer whose q/k/v, o and gate/up/down
    projections all carry LoRA adapters, without dropout or bias; ``LlamaDecoderLayer_fast_forward``,
    ``LlamaAttention_fast_forward`` L696-791). Each op is one autograd Function; what each saves
    (``kernels/``, line numbers at that release):

    * the RMSNorms: ``Fast_RMS_Layernorm`` (``rms_layernorm.py`` L162-236) saves ``(X, W, r)``, X the
      norm's input itself, r fp32 per row; Y is ``torch.empty`` in X's dtype and backward writes dX
      into dY (not Gemma): Liger's saved set (``Builder.rms_norm_liger``);
    * ``LoRA_QKV`` (``fast_lora.py`` L327-420) saves X, the input norm's output, with the adapters
      (parameters); its backward gets dQ, dK, dV, writes dX over X (``out = X``, inplace) and
      dequantizes the three 4-bit weights one at a time (L489-509, ``_unsloth_dequant``);
    * RoPE: ``fast_rope_embedding`` (``rope_embedding.py`` L282-302) rotates ``Q.transpose(1, 2)
      .contiguous()``, which is Q's own (b, s, heads, d) storage, in place; it keeps cos and sin
      (the model's): nothing per token;
    * attention: flash-attn (``flash_attn_func`` on (b, s, heads, d) views, ``utils/attention_dispatch.py``
      L171-177), else xformers, else SDPA: the fused kernel's saved set, as SDPA's flash kernel
      (``Builder._fused_attention``: q, k, v, the output, the fp32 logsumexp; no K/V copies for GQA);
    * ``LoRA_W`` for o_proj (``fast_lora.py`` L562-638) saves X, the attention's output (the same
      storage); backward makes dX = dY @ W.t() with the weight dequantized;
    * ``LoRA_MLP`` (``fast_lora.py`` L28-230) saves ``(X, e, g)``: the post-attention norm's output and
      the gate and up projections' outputs (half); SwiGLU's h is transient. Its backward: ``DW =
      matmul_lora(dY, downW.t(), ...)`` (b, s, f) new (its dequantized weight in the global buffer,
      ``estimate.unsloth``), ``swiglu_DWf_DW_dfg_kernel`` writes h, df, de over DW, e, g; dX is
      written over X (``out = X``), while upW and then gateW are dequantized (one at a time) and
      ``df @ upB.t()`` is (b, s, r); dY, the residual stream's gradient, is alive throughout.

    The matmuls' dequantization in forward (``matmul_lora``) uses ``fast_dequantize(...,
    use_global_buffer=True)``: a buffer kept for the run (``estimate.unsloth.weight_buffer_bytes``),
    no forward transient here. Reentrant checkpointing recomputes the layer before its backward."""
    half, stream = B.p.half, B.p.stream
    a_in = B.rms_norm_liger(x, "input_layernorm")
    src = T(h, 0, a_in.nbytes, "qkv.input")
    B.r.save(src)                                                       # LoRA_QKV: ctx.save_for_backward(..., X)
    qq, kk, vv = T(q, 0, half, "attn.q"), T(kv, 0, half, "attn.k"), T(kv, 0, half, "attn.v")
    r_qkv = B.lora_rank_of("q_proj")
    # LoRA_QKV.backward: dQ, dK, dV and (b, s, r) products alive; one dequantized weight at a time
    B.r.transient("self_attn.qkv.backward", T(q + 2 * kv + r_qkv, 0, half),
                  const=_unsloth_dequant(B, h * max(q, kv)))
    ctx = B._fused_attention("flash", qq, kk, vv, heads, kvh, k.head_dim)
    B.r.save(ctx)                                                       # LoRA_W: X, the attention output itself
    r_o = B.lora_rank_of("o_proj")
    grad_out = T(h, 0, stream)
    B.r.transient("self_attn.o_proj.backward", grad_out, T(q + r_o, 0, half),
                  const=_unsloth_dequant(B, h * q))
    x2 = T(h, 0, stream, "residual")
    m_in = B.rms_norm_liger(x2, "post_attention_layernorm")
    src2 = T(h, 0, m_in.nbytes, "mlp.input")
    B.r.save(src2, T(f, 0, half, "mlp.gate_out"), T(f, 0, half, "mlp.up_out"))   # LoRA_MLP: (X, e, g)
    r_mlp = B.lora_rank_of("up_proj")
    # LoRA_MLP.backward: dY (the layer's output gradient), DW (b, s, f), (b, s, r) products, a dequantized weight
    B.r.transient("mlp.backward", grad_out, T(f + r_mlp, 0, half), const=_unsloth_dequant(B, h * f),
                  incoming=grad_out)


def _head_norm(B: Builder, y: T, proj: str, src: T, rows: float) -> None:
    """Qwen3's ``q_norm`` or ``k_norm`` on the output ``y`` of ``proj`` (transformers 5.24
    ``models/qwen3/modeling_qwen3.py`` L245-246: ``self.q_norm(self.q_proj(hidden_states)
    .view(hidden_shape))``): ``Qwen3RMSNorm`` (L50-67, LlamaRMSNorm's Python ops) over ``head_dim``
    of the (b, s, heads, d) projection, so per token it saves the fp32 ``x.float()`` (the
    projection's width x 4 bytes), one fp32 ``rsqrt`` per head (``rows``), and the normalised
    half tensor for its weight's gradient (``Builder.rms_norm_hf``). Under tensor parallelism each
    rank normalises its own heads (``rows``, the width: per rank) with the whole (head_dim,)
    weight, torchtitan's ``SequenceParallel(sequence_dim=2)`` on ``attention.q_norm`` / ``k_norm``
    (pytorch/torchtitan ``torchtitan/models/qwen3/infra/parallelize.py``, ``apply_non_moe_tp``;
    ``trainmem.wrappers.tp_layer_plan``). Rotary then makes new tensors of the normalised q and k,
    as of the projections' outputs without the norms.

    Under LoRA, a frozen projection that is not a target gives the first layer, whose input needs no
    gradient, an output that needs none: its norm saves nothing there (``Recipe.free_extra``)."""
    before = set(B.r.saved)
    B.rms_norm_hf(y, "attn." + proj[0] + "_norm", rows=rows)
    if B.frozen and not B.lora_rank_of(proj) and (not B.r.adapter_seen or src is B.r.free_input):
        B.r.free_extra.update({i: t for i, t in B.r.saved.items() if i not in before})


def _cache_tensors(k: LayerKey, pol: Policy, kk: T, vv: T, kv: float, shares: bool) -> tuple[T, T]:
    """The keys and values one Llama-style layer's KV cache holds, (b, kv_heads, s, d) each: ``kk`` and
    ``vv`` themselves (the tensors attention takes, and saves unless it copies them: ``repeat_kv`` for
    grouped heads, flash's padding, the math path's scaling) where they are the cache's, else tensors
    of their own, which the output alone holds. ``k.cache_kind`` (``spec.tf_releases.kv_cache_kind``):

    * "copy" (transformers >= 4.56): ``DynamicLayer.update``'s ``torch.cat`` copies (4.56.0
      ``cache_utils.py`` L90-117), contiguous, which attention takes as they are, in the keys' dtype:
      under autocast the rotary's cos/sin are fp32 (the embeddings' dtype), so k is an fp32 copy
      attention casts to half (not saved); up to 5.23 ``lazy_initialization`` created both empty caches
      in the keys' dtype (5.23.0 ``cache_utils.py`` L113-116: ``self.dtype = key_states.dtype``), so
      ``torch.cat`` promoted the half values to fp32 too, and attention saved its own half cast of them;
      5.24.0 creates the value cache in the values' dtype (L113-116: ``dtype=value_states.dtype``), the
      very half tensor attention takes (``k.cache_values_own_dtype``).
    * "reference" (before 4.56): the rotated keys and ``v_proj``'s output themselves, strided
      ``view(...).transpose(1, 2)`` tensors in (b, s, heads, d) memory. A fused kernel takes and saves
      them as they are; eager's ``torch.matmul`` and the math path's fold (b, heads) into bmm's batch
      (``_matmul_impl``: ``expand(...).reshape(...)``), a copy of such a tensor, which autograd saves
      instead, except at b == 1, where the reshape is a view. Under autocast the keys are half where
      rotary casts cos/sin to the values' dtype (``k.rotary_keys_half``,
      ``spec.tf_releases.rotary_keys_half``), else fp32.

    ``shares``: whether the tensors attention takes (``kk``, ``vv``) are the cache's own."""
    half = pol.half
    copy = k.cache_kind == "copy"
    fp32_keys = pol.amp and not k.rotary_keys_half
    kc = T(kv, 0, F32, "kv_cache.k") if fp32_keys else kk if shares else T(kv, 0, half, "kv_cache.k")
    fp32_values = pol.amp and copy and not k.cache_values_own_dtype
    vc = T(kv, 0, F32, "kv_cache.v") if fp32_values else vv if shares else T(kv, 0, half, "kv_cache.v")
    return kc, vc


def _hold_cache(B: Builder, cache: tuple[T, ...], b1: tuple[T, ...] | None = None) -> None:
    """The model output references ``cache`` (``b1``: the same tensors as seen at a micro-batch of one,
    ``Recipe.held_b1``) (``LayerCoefs.cache``): what autograd does not save of it counts while the
    output lives (``LayerCoefs.held``), the rest once backward has freed it."""
    B.r.hold(*cache, b1=b1)
    B.r.cache = sum(t.tok * t.nbytes for t in cache)


def compiled_recipe(k: LayerKey) -> bool:
    """Whether the layer has a ``torch.compile`` recipe (``_llama_layer_compiled``,
    ``_gpt2_layer_compiled``): under ``--compile``, for the llama (Llama, Mistral, Qwen2) and
    transformers' GPT-2 families with a fused
    SDPA kernel, without LoRA, 4-bit bases, experts or tensor parallelism (the setups whose
    partition was read off trace --compile). Other layers keep the eager recipe (the estimate warns)."""
    if not k.compiled or k.family not in ("llama", "gpt2"):   # (nanoGPT's own modules: not read off)
        return False
    if k.lora or k.quant[0] or k.experts or k.tp > 1 or k.attention == "eager" or k.qk_norm:
        return False  # (Qwen3's q/k norms: not read off a compiled graph)
    return layer_sdpa_backend(k) in ("flash", "efficient", "cudnn") and not (k.head_dim % 8)


def layer_sdpa_backend(k: LayerKey) -> str:
    """The SDPA kernel a layer of ``k`` runs (``sdpa_backend``), or "eager" for eager attention."""
    if k.attention == "eager":
        return "eager"
    p = k.attention_dropout if (k.attention_dropout > 0 and k.dropout) else 0.0
    return sdpa_backend(Policy.of(k.precision).half, k.head_dim, k.heads != k.kv_heads, capability=k.capability,
                        pinned=k.attention if k.attention in SDPA_PINS else None, dropout=p)


def sdpa_saves_padded(k: LayerKey) -> bool:
    """Whether the layer's SDPA saves padded copies of q, k and v instead of the tensors it is
    given: the flash kernel with a head_dim that is not a multiple of 8, which
    ``scaled_dot_product_attention`` pads with ``pad_last_dim<8, false>`` (``at::pad``: new
    (b, h, s, d8) tensors) before ``_scaled_dot_product_flash_attention`` saves them
    (aten/src/ATen/native/transformers/attention.cpp, the flash case; ``_fused_attention``)."""
    return layer_sdpa_backend(k) == "flash" and k.head_dim % 8 != 0


# ----- torch.compile: the tensors inductor's partition saves --------------------------------------
# Under ``torch.compile`` AOTAutograd traces the joint forward and backward graph with inductor's
# decompositions (``torch/_inductor/decomposition.py`` ``select_decomp_table``: ``F.layer_norm``,
# ``F.gelu``, SiLU, the RMSNorm's Python ops and autocast's casts all become pointwise ops and
# reductions) and inductor's ``partition_fn`` splits it with ``min_cut_rematerialization_partition``
# (``torch/_functorch/partitioners.py``): every pointwise op and reduction may be recomputed in the
# backward (``is_fusible``; ``should_ban_recomputation`` bans matmuls, SDPA and random ops), so the
# forward saves the cheapest cut of tensors from which the backward's fused kernels recompute the
# rest: the matmuls' inputs and outputs in their compute dtype, SDPA's outputs, the per-token
# statistics of the norms, and the residual stream where it is cheaper than the normalized tensor.
# The recipes below are that cut for transformers' Llama and GPT-2 blocks, read off the partitioned
# forward graph of trace --compile (``trainmem.trace.compiled``; a middle layer of a four-layer
# model; the first layer may pick a tensor of equal cost elsewhere) and checked against it in
# tests/test_estimate_compile.py.


def _llama_layer_compiled(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float,
                          kvh: float, sp_div: int) -> None:
    """LlamaDecoderLayer under ``torch.compile``. Saved per token: the layer's input (the residual
    stream, its dtype) and the residual after attention, from which the backward recomputes each
    RMSNorm (``hidden.float().pow(2).mean(-1)``...), with the norms' fp32 ``rsqrt`` (1 per token
    each); each norm's output in the compute dtype, the one input of q/k/v and of gate/up (``mm``
    saves its input; under autocast the cast is the saved tensor, made once for the three
    linears, where eager autocast makes one per call); the rotated q and k and v in the compute
    dtype, SDPA's output and fp32 logsumexp (the kernel's saved tensors; the rotary products and
    their fp32 intermediates under autocast are recomputed); the gate and up outputs and their
    SiLU product (down's input), the SiLU itself recomputed (eager saves it too)."""
    pol, half = B.p, B.p.half
    B.r.save(x, T(1, 0, F32, "input_layernorm.stats"))   # (b, s, h) stream dtype; rsqrt (b, s, 1) fp32
    src = T(h, 0, half, "input_layernorm.out")          # (b, s, h) compute dtype: q/k/v's shared input
    proj = {name: B.linear(src, width, name, f"{name}.input", h, out_name=out)
            for name, width, out in (("q_proj", q, "attn.q"), ("k_proj", kv, "attn.k"), ("v_proj", kv, "attn.v"))}
    # rotary outputs (b, heads, s, d) in the compute dtype (autocast: the casts SDPA gets), v as v_proj made it
    qq, kk, vv = T(q, 0, half, "attn.q_rot"), T(kv, 0, half, "attn.k_rot"), T(kv, 0, half, "attn.v")
    if not pol.amp:
        vv = proj["v_proj"]
    if k.kv_cache:
        # the cache's copies (_cache_tensors; --compile is refused with an older release's cache): returned outputs
        _hold_cache(B, _cache_tensors(k, pol, kk, vv, kv, True))
    ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                      softmax_fp32_then_cast=True)       # saves q, k, v, out (b, s, q) half, lse (b, heads, s) fp32
    B.linear(ctx, h, "o_proj", "o_proj.input")
    # the residual after attention (b, s, h) stream dtype, and post_attention_layernorm's rsqrt
    B.r.save(T(h, 0, pol.stream, "residual"), T(1, 0, F32, "post_attention_layernorm.stats"))
    src2 = T(h, 0, half, "post_attention_layernorm.out")  # (b, s, h) compute dtype: gate/up's input
    gate = B.linear(src2, f, "mlp.gate_proj", "mlp.gate_proj.input", h, out_name="mlp.gate_out")
    up = B.linear(src2, f, "mlp.up_proj", "mlp.up_proj.input", h, out_name="mlp.up_out")
    B.r.save(gate, up)                                    # (b, s, f) compute dtype each
    grad_out = T(h, 0, pol.stream)                        # the layer's output gradient, as _swiglu's
    B.r.transient("mlp.act.backward", T(3 * f, 0, half), grad_out, incoming=grad_out)  # as _swiglu's (fused here)
    B.linear(T(f, 0, half, "mlp.act_product"), h, "mlp.down_proj", "mlp.down_proj.input")  # (b, s, f) saved


def _compiled_layer_norm(B: Builder, x: T, name: str) -> None:
    """``F.layer_norm`` under ``torch.compile`` (inductor's ``native_layer_norm`` decomposition):
    the backward needs the normalized input and ``rstd``; the min cut saves the normalized tensor
    (fp32, (b, s, h)) and ``rstd`` when the input is fp32 (autocast over an fp32 residual stream:
    equal cost to the input, and ``mean`` is then not needed), else the half input with the fp32
    ``mean`` and ``rstd`` ((b, s, 1) each), from which it recomputes the normalized tensor."""
    if x.nbytes == F32:
        B.r.save(T(x.tok, 0, F32, name + ".normalized"), T(1, 0, F32, name + ".stats"))
    else:
        B.r.save(x, T(2, 0, F32, name + ".stats"))


def _gpt2_layer_compiled(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float,
                         kvh: float, sp_div: int) -> None:
    """GPT2Block under ``torch.compile``. Saved per token: each LayerNorm's cut
    (``_compiled_layer_norm``) and its output in the compute dtype (the input of ``c_attn`` /
    ``c_fc``, Conv1D's ``addmm``); ``c_attn``'s whole output (q is a view of it), the KV cache's
    copies of k and v when transformers makes one (SDPA saves those), SDPA's output and fp32
    logsumexp; the residual dropouts' bool masks (random ops are not recomputed: partitioners.py
    ``should_ban_recomputation`` keeps their outputs); ``c_fc``'s output and the GELU output
    (``c_proj``'s input: the tanh chain between them is recomputed, eager saves four tensors)."""
    half = B.p.half
    _compiled_layer_norm(B, x, "ln_1")
    B.linear(T(h, 0, half, "ln_1.out"), q + 2 * kv, "c_attn", "c_attn.input", h)   # (b, s, h) half saved
    B.r.save(T(q + 2 * kv, 0, half, "attn.qkv"))          # c_attn's output (b, s, 3h) half, kept by q's view
    qq = kk = vv = T(0, 0, half, "attn.qkv")
    if k.kv_cache:                                        # torch.cat's copies (b, heads, s, d) half
        kk, vv = T(kv, 0, half, "attn.k_cache"), T(kv, 0, half, "attn.v_cache")
        B.r.cache = 2 * kv * half
    ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                      softmax_fp32_then_cast=False)       # out (b, s, q) half, lse (b, heads, s) fp32
    B.linear(ctx, h, "c_proj", "c_proj.input")
    B.drop(T(h, 0, half, "resid"), k.hidden_dropout, "attn.resid_dropout")      # bool (b, s, h)
    _compiled_layer_norm(B, T(h, 0, B.p.stream, "residual"), "ln_2")
    fc = B.linear(T(h, 0, half, "ln_2.out"), f, "c_fc", "c_fc.input", h)       # (b, s, h) half saved
    B.r.save(T(f, 0, half, "mlp.c_fc_out"))               # (b, s, f) half
    grad_out = T(h, 0, B.p.stream)                        # the layer's output gradient, waiting meanwhile
    B.r.transient("mlp.act.backward", T(2 * f, 0, half), grad_out, incoming=grad_out)  # d(gelu out), d(c_fc out)
    del fc
    B.linear(T(f, 0, half, "mlp.act"), h, "mlp.c_proj", "mlp.c_proj.input")   # GELU output (b, s, f) half
    B.drop(T(h, 0, half, "resid"), k.hidden_dropout, "mlp.resid_dropout")       # bool (b, s, h)


def _sdpa_grads(q: "T", k: "T", v: "T", out: float, half: int) -> tuple:
    """The tensors in flight at a fused SDPA kernel's backward, each its own: the output's gradient
    (``out`` wide, the one the output projection's backward handed over) and the kernel's dq, dk, dv,
    which the kernel allocates before its scratch (torch 2.13 ``aten/src/ATen/native/transformers/cuda/
    flash_attn/flash_api.cpp`` ``mha_bwd``: dq, dk, dv ``empty_like`` of q, k, v where not given, then
    ``softmax_d`` and the fp32 ``dq_accum``; the efficient kernel's grad_q/k/v likewise). One block of
    their sum stood for them (BERT b8 s256 pure bf16: 12 MiB, where trace makes three of 3 MiB beside
    the 3 MiB output gradient)."""
    return (T(out, 0, half), T(q.tok, 0, half), T(k.tok, 0, half), T(v.tok, 0, half))


def _gelu(B: Builder, impl: str, f: float, h: float = 0.0, incoming: bool = True) -> T:
    """The MLP activation on the ``c_fc``/``intermediate`` output (half under autocast). ``incoming``:
    the residual stream's gradient at its backward is the layer's output gradient (a pre-LN layer; a
    post-LN one's is its final LayerNorm's input gradient).

    ``gelu`` / ``gelu_pytorch_tanh`` (fused ``F.gelu``): saves its input, returns the input dtype.
    ``gelu_new`` (transformers NewGELUActivation, Python ops): under autocast ``pow`` runs in fp32 and
    saves an fp32 copy of the input; ``tanh`` saves its fp32 output; the final product saves
    ``0.5 * x`` (half) and ``1 + tanh`` (fp32) and returns fp32, which the next linear casts again.
    Without autocast the same ops save x, tanh, 0.5x and 1 + tanh in the working dtype.
    """
    half = B.p.half
    if impl == "gelu_new":
        wide = F32 if B.p.amp else half
        _gelu_new_forward(B, f, wide)
        # backward: the incoming gradient (the next linear's input gradient, cast back to wide) and
        # the two gradients the final product's MulBackward makes, all of the activation's size; the
        # residual stream's gradient (b, s, h) waits for the attention branch meanwhile
        grad_out = T(h, 0, B.p.stream)
        B.r.transient("mlp.act.backward", T(f, 0, wide), T(f, 0, wide), T(f, 0, wide), grad_out,
                      incoming=grad_out if incoming else None)
        if wide != half:
            # under autocast the product's factors differ in dtype (``0.5 * x`` half, ``1 + tanh``
            # fp32): MulBackward0 returns both gradients in fp32 and the engine then casts the half
            # factor's to its dtype beside them (torch/csrc/autograd/engine.cpp ``validate_outputs``:
            # ``grad.to(metadata dtype)``), the saved factors still held by the node (in a recomputed
            # layer they are not: ``quantities.model_facts.ENGINE_CAST``). Found by trace: GPT-2 (2 layers, n_embd
            # 64) sequence classification, bf16-amp, 4 x 256: -1.5% before
            B.r.transient("mlp.act.backward.engine_cast", T(f, 0, wide), T(f, 0, wide), T(f, 0, wide),
                          T(f, 0, half), grad_out, incoming=grad_out if incoming else None)
        return T(f, 0, wide, "mlp.act.out")
    B.r.save(T(f, 0, half, "mlp.act.input"))
    return T(f, 0, half, "mlp.act.out")


def _gelu_new_forward(B: Builder, f: float, wide: int) -> None:
    """transformers NewGELUActivation's forward in op order (transformers 5.24.0 ``activations.py``
    L65-66: ``0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 *
    torch.pow(input, 3.0))))``, Python evaluating left to right): ``0.5 * input`` (half, saved by
    the final product), ``pow``'s input (under autocast its fp32 copy, ``pow`` being on autocast's
    fp32 list, ``aten/src/ATen/autocast_mode.cpp``; else ``input`` itself, the ``c_fc`` output), then
    four unsaved temporaries of ``wide`` elements, each freed once the next op has read it (``pow``,
    ``* 0.044715``, ``input +``, ``* sqrt(2/pi)``: a product with a Python scalar and ``add`` save
    nothing), ``tanh`` (saved, its output) and ``1 + tanh`` (saved). Under autocast the ``c_fc``
    output (half) is no saved tensor: ``GPT2MLP.forward`` (``models/gpt2/modeling_gpt2.py``
    L241-242) holds it as ``hidden_states`` until ``self.act`` returns its fp32 product, which the
    replay makes next (``LayerCoefs.linear_inputs``). Trace, GPT-2 b1 s1024 bf16-amp: ``addmm`` 6,
    ``mul`` 6, ``_to_copy`` 12, ``pow``, ``mul``, ``add``, ``mul``, ``tanh``, ``add``, ``mul`` 12 MiB each."""
    half = B.p.half
    x, t = T(f, 0, half, "mlp.c_fc.out"), [T(f, 0, wide) for _ in range(4)]
    chain = [Fwd.TEMP, Fwd.TEMP, Fwd.free(1), Fwd.TEMP, Fwd.free(2), Fwd.TEMP, Fwd.free(3), Fwd.SAVED, Fwd.free(4),
             Fwd.SAVED]                                           # pow .. tanh, 1 + tanh (temporaries 1-4)
    half_x, tanh, one = T(f, 0, half, "mlp.act.half_x"), T(f, 0, wide, "mlp.act.tanh"), T(f, 0, wide, "mlp.act.one_plus_tanh")
    if wide != half:                                              # the c_fc output a temporary (0), pow's fp32 copy saved
        B.r.forward_group([x] + t, [Fwd.TEMP, Fwd.SAVED, Fwd.SAVED] + chain + [Fwd.after(0)], half_x,
                          T(f, 0, wide, "mlp.act.pow_input"), tanh, one)
    else:                                                         # pow saves the c_fc output itself
        chain = [Fwd.free(index(e) - 1) if e[0] == Fwd.FREE else e for e in chain]
        B.r.forward_group(t, [Fwd.SAVED, Fwd.SAVED] + chain, T(f, 0, wide, "mlp.act.pow_input"), half_x, tanh, one)


def _moe(B: Builder, src: T, h: float, f: float, experts: int, top_k: int) -> None:
    """A Mixtral-style sparse MoE block as transformers >= 5 runs it (``grouped_mm`` experts, its
    default): the router (``F.linear``, fp32 softmax over experts, top-k, renormalised weights),
    then the tokens gathered in expert order (S = top_k rows per token), one ``_grouped_mm`` for
    gate and up together, SwiGLU, one for down, the routing weights (fp32) multiplied in, the
    rows put back in token order and summed.

    ``_grouped_mm`` has no autocast rule and transformers casts its input to the weights' dtype,
    so under autocast (fp32 weights) the experts compute and save fp32 tensors, and no half copies
    of the expert weights are made. The routing weights are fp32, so the weighted output and its
    gradients are fp32 too.

    Under LoRA the experts are frozen (peft's targets are ``nn.Linear`` modules; transformers' grouped
    experts are bare parameters): ``_grouped_mm`` saves an operand only for the other's gradient
    (``derivatives.yaml``, ``_grouped_mm``: ``self`` from ``mat2``, ``mat2`` from ``self``), so the
    gathered rows and the product, which only the weight gradients need, are not kept, and no expert
    weight gradient is made in backward.
    """
    wd = B.p.weight
    k = top_k
    trainable = not B.frozen
    # router: saves its (cast) input, the fp32 softmax, top-k indices, the sum and the pre-division
    # weights of the in-place renormalisation
    B.linear(src, experts, "mlp.gate", "router.input", h)
    B.r.save(T(experts, 0, F32, "router.softmax"), T(k, 0, 8, "router.topk_index"),
             T(k + 1, 0, F32, "router.topk_weights"))
    # gather: the token rows in expert order, their routing weights, and the int64 permutations
    # (sorted expert ids, perm // top_k, inverse permutation) the index backward needs
    xin = T(k * h, 0, wd, "experts.input")
    B.r.save(T(k, 0, F32, "experts.routing_weights"), T(3 * k, 0, 8, "experts.indices"))
    _moe_forward_events(B.r, xin, f, h, k, wd, trainable, src.nbytes)
    if trainable:
        B.r.save(xin)
    # gate_up: saves the gathered rows; its (S, 2f) output is saved by silu (gate) and the
    # product (up) as views; the product is saved by down; down's output by the routing multiply
    grad_w = wd  # the weight gradient comes in the parameter's dtype and layout (stolen as .grad)
    B.r.transient("experts.gate_up.backward", T(2 * k * f, 0, wd), T(k * h, 0, wd),
                  const=experts * 2 * f * h * grad_w * trainable, own_weights=experts * 2 * f * h * trainable,
                  own_uncast=experts * 2 * f * h * trainable)
    B.r.weights += experts * 2 * f * h * trainable
    B.r.uncast += experts * 2 * f * h * trainable
    B.r.save(T(2 * k * f, 0, wd, "experts.gate_up_out"), T(k * f, 0, wd, "experts.silu_out"))
    # SwiGLU backward (the product, saved by down, is freed by then): down's input gradient and the
    # product's two gradients
    B.r.transient("experts.act.backward", T(k * f, 0, wd), T(k * f, 0, wd), T(k * f, 0, wd))  # one tensor each
    if trainable:
        B.r.save(T(k * f, 0, wd, "experts.act_product"))
    B.r.transient("experts.down.backward", T(k * h, 0, wd), T(k * f, 0, wd),
                  const=experts * f * h * grad_w * trainable, own_weights=experts * f * h * trainable,
                  own_uncast=experts * f * h * trainable)
    B.r.weights += experts * f * h * trainable
    B.r.uncast += experts * f * h * trainable
    B.r.save(T(k * h, 0, wd, "experts.down_out"))
    # combine backward: index_put of the gradient into zeros, both products' gradients (fp32)
    # and the cast back to the experts' dtype
    B.r.transient("experts.combine.backward", T(k * h, 0, F32), T(k * h, 0, F32), T(k * h, 0, F32),
                  T(k * h, 0, wd))                            # one tensor each


def _moe_forward_events(r: Recipe, rows: T, f: float, h: float, k: int, wd: int, trainable: bool,
                        hidden: int) -> None:
    """The forward temporaries of ``grouped_mm_experts_forward`` (transformers 5.24
    ``integrations/moe.py`` L424-537), in op order among the block's large saved tensors, for the
    allocator replay: one forward group (``Recipe.group_ahead``, ``LayerCoefs.fwd_groups``, replayed by
    ``reserved.layer_forward._attn_allocs``; the estimate's allocated moments do not read them) whose
    saved tensors ``_moe`` saves next, from the gathered rows on, with the block's backward moments
    between them. Events as ``Recipe.forward_group``'s: "t" the next temporary, "fK" the K-th freed,
    "s" the next saved tensor (S = ``k`` rows per token):

    * the gathered rows ``hidden_states[perm // num_top_k]`` ((S, h), the experts' dtype ``wd``, L456):
      saved by gate/up's ``_grouped_mm`` for its weight's gradient; with frozen experts (LoRA: no
      operand saved, ``derivatives.yaml`` ``_grouped_mm``) a temporary that the local name
      ``selected_hidden_states_g`` holds until the function returns;
    * gate/up's (S, 2f) output and ``act_fn(gate)`` (S, f), saved (``_default_apply_gate`` L579);
    * the product ``act_fn(gate) * up`` (S, f): saved by down's ``_grouped_mm``, or with frozen
      experts a temporary freed when down's output rebinds ``proj_out`` (L511);
    * down's (S, h) output, saved by the routing multiply;
    * ``proj_out * sample_weights_g.unsqueeze(-1)`` ((S, h) fp32: the routing weights are fp32, L524),
      saved by nothing (the ``inv_perm`` index saves its indices only), freed when its permuted copy
      ``weighted_out[inv_perm]`` ((S, h) fp32, L529) rebinds the name; that copy lives until the
      function returns (the ``view(...).sum(dim=1)`` reads it and saves nothing);
    * the (T, h) fp32 sum (L535), a temporary where ``.to(hidden_states.dtype)`` casts it to a half
      hidden stream (``hidden`` bytes); else it is the block's output.

    Trace (Mixtral-shaped, b4 s512, fp32, LoRA r16) makes these blocks in this order; the replay had
    the saved ones only, so its forward opened one (S, f) segment per layer fewer than trace."""
    weighted, perm = T(k * h, 0, F32, "experts.weighted"), T(k * h, 0, F32, "experts.weighted_perm")
    sum32 = [T(h, 0, F32, "experts.sum32")] if hidden != F32 else []
    if trainable:                                             # rows and product saved
        temps = [weighted, perm] + sum32
        ev = [Fwd.SAVED] * 5 + [Fwd.TEMP, Fwd.TEMP, Fwd.free(0)] + ([Fwd.TEMP, Fwd.free(2)] if sum32 else []) + [
            Fwd.free(1)]
    else:                                                     # rows and product temporaries
        temps = [rows, T(k * f, 0, wd, "experts.act_product"), weighted, perm] + sum32
        ev = [Fwd.TEMP, Fwd.SAVED, Fwd.SAVED, Fwd.TEMP, Fwd.SAVED, Fwd.free(1), Fwd.TEMP, Fwd.TEMP, Fwd.free(2)] + (
            [Fwd.TEMP, Fwd.free(4)] if sum32 else []) + [Fwd.free(3), Fwd.free(0)]
    r.group_ahead(temps, ev)                                  # the next saved tensor: rows or gate/up's


def _moe_loop(B: Builder, src: T, h: float, f: float, experts: int, top_k: int) -> None:
    """Mixtral's sparse MoE block as transformers 4.x runs it (``tf_releases.moe_expert_loop``; 4.48.0
    ``models/mixtral/modeling_mixtral.py`` L112-150, 4.39.3 L840-883): the router as in ``_moe`` (its
    weights then cast to the hidden dtype, L125), then for each expert in turn ``current_state =
    hidden_states[None, top_x]`` (a gathered copy; ``torch.where`` gives ``idx`` and ``top_x`` as views
    of one (rows, 2) int64 ``nonzero``, which the indexing saves), ``w2(act_fn(w1(x)) * w3(x))``
    (``MixtralBlockSparseTop2MLP``, L67-82: three ``nn.Linear``, saving as ``_swiglu`` does), ``*
    routing_weights[top_x, idx, None]`` (saves the expert's output and the weight column) and
    ``index_add_`` into the block's output, which saves the weighted rows too (torch 2.13
    ``csrc/autograd/generated/Functions.h`` L2993, ``IndexAddBackward0::source_``). Rows per expert:
    ``top_k / experts`` per token, the even spread (a real run's busiest expert gets more).

    Backward runs expert by expert, the last first (each expert's nodes come after the previous
    expert's ``index_add_``), so its transients are one expert's rows, beside the layer output's
    gradient (waiting for the attention branch, as in ``_swiglu``), the routing weights' (b*s, top_k)
    gradient (each expert's ``IndexBackward0`` puts its column into zeros, summed until the cast's
    backward runs after the last expert) and, from the second expert on, the block input's gradient
    summed so far ((b*s, h): each gather's ``IndexBackward0`` makes a zeroed one, ``index_backward``).
    The linears' weights count once each (``in_features`` over the rows: the weight is (f, h) whatever
    the rows). Checked against 4.48.1's block run on the CPU (even routing, bf16, frozen or trained
    experts): the saved bytes and the backward peak equal to the byte (``tests/test_moe_loop.py`` runs
    the same op sequence)."""
    k, n = top_k, top_k / experts
    wd = src.nbytes                       # hidden_states' dtype: the rows, the cast routing weights
    pd = max(B.p.half, wd)                # the weighted rows' dtype (half output x hidden-dtype weight)
    B.linear(src, experts, "mlp.gate", "router.input", h)
    B.r.save(T(experts, 0, F32, "router.softmax"), T(k, 0, 8, "router.topk_index"),
             T(k + 1, 0, F32, "router.topk_weights"))
    grad_out, rw_grad = T(h / B.sp_div, 0, B.p.stream), T(k, 0, wd)
    for e in range(experts):
        later = (rw_grad, T(h, 0, wd)) if e < experts - 1 else ()   # made by the experts after e
        wait = (grad_out, rw_grad, *later[1:])
        # IndexBackward0 of the gather: the rows' gradient and the zeroed (b*s, h) one it is put into
        B.r.transient("experts.gather.backward", T(n * h, 0, wd), T(h, 0, wd), *wait)
        B.r.save(T(2 * n, 0, 8, "experts.where_index"))  # idx and top_x (int64)
        rows = T(n * h, 0, wd, "experts.rows")
        B.waiting_grad = wait
        gate = B.linear(rows, n * f, "mlp.experts.w1", "experts.input", h / n)
        up = B.linear(rows, n * f, "mlp.experts.w3", "experts.input", h / n)
        gate, silu, up = (T(n * f, 0, gate.nbytes, "experts.w1_out"), T(n * f, 0, gate.nbytes, "experts.silu_out"),
                          T(n * f, 0, up.nbytes, "experts.w3_out"))
        B.r.save(gate, silu, up)
        B.r.transient("experts.act.backward", T(3 * n * f, 0, max(gate.nbytes, up.nbytes)), *wait,
                      incoming=grad_out)
        prod = T(n * f, 0, max(gate.nbytes, up.nbytes), "experts.act_product")
        y = B.linear(prod, n * h, "mlp.experts.w2", "experts.w2.input", f / n)
        B.waiting_grad = ()
        B.r.save(T(n * h, 0, y.nbytes, "experts.w2_out"), T(n, 0, wd, "experts.routing_weight"),
                 T(n * h, 0, pd, "experts.weighted_out"))
        # IndexAddBackward0 (the gradient's rows, index_select) and MulBackward0 (both products' gradients)
        B.r.transient("experts.combine.backward", T(3 * n * h, 0, pd), grad_out, *later, incoming=grad_out)


def _moe_ep(B: Builder, src: T, h: float, f: float, experts: int, top_k: int, ep: int, rows: float) -> None:
    """The sparse MoE block under expert parallelism, as transformers 5.23 runs it in training
    (``DistributedConfig(ep_size=N)``, ``AutoEP`` -> ``AllToAllEP``, src/transformers/distributed/
    expert_parallel.py): this rank holds E/N experts (``MoEParamShard``: ``Shard(0)``, and
    ``_is_expert_parallel`` set). Per token of its own micro-batch (k = top_k):

    - the router, as without EP;
    - dispatch: ``order = argsort(expert_ids)`` and ``hidden_states[order // k]`` (``index`` saves
      ``order // k``; ``order`` is kept for the combine's ``index_put``, which saves it): 2k int64;
      the (T*k, h) send rows and the ``all_to_all_single_autograd`` output (``rows`` per token,
      ``ep_rank_rows``) are not saved (the all-to-all's backward is the reverse all-to-all);
    - this rank's experts (``grouped_mm_experts_forward``, integrations/moe.py) on the received rows,
      top-1 with unit weights (``ones_like``, no gradient) in the rows' dtype: the gathered rows,
      ``perm // 1`` and the inverse permutation (int64, saved by the two ``index`` ops that need a
      gradient; ``sample_weights[perm]`` has none, so ``perm`` is not kept), the unit weights
      gathered by ``perm`` (saved by the weighting multiply, which keeps no copy of down's output:
      its other factor needs no gradient), the EP sentinel mask (bool, saved by ``masked_fill_`` /
      ``masked_fill``) and the masked copy of gate_up's output (``masked_fill`` out of place; the
      grouped_mm output itself is not kept), its SiLU and the product;
    - combine: the reverse all-to-all, ``token_outputs[order] = recv_out`` into a (T*k, h)
      ``empty_like``, multiplied by the fp32 routing weights (which saves ``token_outputs``) and
      summed over k.

    Every expert-side tensor has ``rows`` rows per token: the busiest rank's load. Forward-only
    copies (the send rows, the grouped_mm outputs before masking) are not counted as transients.
    """
    wd = B.p.weight  # the rows' dtype: the MoE input (fp32 under autocast, else the weights') = the experts'
    k = top_k
    el = experts / ep  # experts on this rank
    B.linear(src, experts, "mlp.gate", "router.input", h)
    B.r.save(T(experts, 0, F32, "router.softmax"), T(k, 0, 8, "router.topk_index"),
             T(k + 1, 0, F32, "router.topk_weights"))
    B.r.save(T(2 * k, 0, 8, "ep.dispatch_indices"))
    # dispatch backward (last in backward): the received rows' gradient, the reverse all-to-all's
    # (T*k, h) output and the scatter into the (T, h) input gradient
    B.r.transient("ep.dispatch.backward", T(rows * h, 0, wd), T(k * h, 0, wd), T(h, 0, wd))
    B.r.save(T(rows * h, 0, wd, "experts.input"), T(rows, 0, wd, "experts.routing_weights"),
             T(2 * rows, 0, 8, "experts.indices"), T(rows, 0, 1, "experts.sentinel_mask"))
    grad_w = wd
    B.r.transient("experts.gate_up.backward", T(2 * rows * f, 0, wd), T(rows * h, 0, wd),
                  const=el * 2 * f * h * grad_w, own_weights=el * 2 * f * h, own_uncast=el * 2 * f * h)
    B.r.weights += el * 2 * f * h
    B.r.uncast += el * 2 * f * h
    B.r.save(T(2 * rows * f, 0, wd, "experts.gate_up_out"), T(rows * f, 0, wd, "experts.silu_out"))
    B.r.transient("experts.act.backward", T(3 * rows * f, 0, wd))
    B.r.save(T(rows * f, 0, wd, "experts.act_product"))
    B.r.transient("experts.down.backward", T(rows * h, 0, wd), T(rows * f, 0, wd),
                  const=el * f * h * grad_w, own_weights=el * f * h,
                  own_uncast=el * f * h)
    B.r.weights += el * f * h
    B.r.uncast += el * f * h
    B.r.save(T(k * h, 0, wd, "ep.combine_rows"))
    # combine backward (first in backward): the fp32 product's gradient, token_outputs' gradient,
    # its gather by ``order`` and the reverse all-to-all's (rows, h) output
    B.r.transient("ep.combine.backward", T(k * h, 0, F32), T(2 * k * h, 0, wd), T(rows * h, 0, wd))


def _swiglu(B: Builder, f: float, h: float, src: T, name: str, fused_gate_up: bool) -> None:
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``: gate and up save their (cast) input; ``silu``
    saves the gate output; the product saves silu's output and the up output; down saves the
    product. Frozen linears under autocast (LoRA) save no input cast, so the order of the saved
    outputs places the weight copies among them (``reserved.layer_forward._saved_and_casts``): there
    the gate and silu outputs are saved before ``up_proj``, as Python evaluates
    ``act_fn(gate_proj(x))`` before ``up_proj(x)`` (transformers 5.24 ``models/llama/modeling_llama.py``
    ``LlamaMLP.forward`` L164): trace, Qwen2.5-1.5B LoRA r16 bf16-amp b4 s2048, asks the gate copy, the gate
    and silu outputs, then up_proj's input cast and copy (tests/test_lora_swiglu_order.py)."""
    half = B.p.half
    gate, up = T(f, 0, half, f"{name}.gate_out"), T(f, 0, half, f"{name}.up_out")
    silu = T(f, 0, half, f"{name}.silu_out")
    at, base, lin = len(B.r.transients), len(B.r.saved), len(B.r.linears)
    if fused_gate_up:
        B.matmul_in(src, f"{name}.gate_up.input")
    else:
        # the outputs, in half or, for a 4-bit linear, its input's dtype (``Builder.frozen_linear``)
        gate = B.linear(src, f, f"{name}.gate_proj", f"{name}.gate_proj.input", h, out_name=f"{name}.gate_out")
        if B.frozen:  # a frozen linear's output is not an aten.mm output: name it as the others
            gate = T(f, 0, gate.nbytes, f"{name}.gate_out")
        # (``silu`` saves the gate output before ``up_proj`` runs: both alive in its forward)
        outer, B.outer_live = B.outer_live, (*B.outer_live, gate, T(f, 0, gate.nbytes, f"{name}.silu_out"))
        if B.frozen and B.p.amp:  # frozen under autocast: gate's and silu's outputs saved before up_proj runs
            B.r.save(gate, B.outer_live[-1])  # (``act_fn(gate_proj(x))`` is evaluated first; see the docstring)
        up = B.linear(src, f, f"{name}.up_proj", f"{name}.up_proj.input", h, out_name=f"{name}.up_out")
        B.outer_live, silu = outer, B.outer_live[-1]
        if B.frozen:
            up = T(f, 0, up.nbytes, f"{name}.up_out")
    B.r.save(*((up,) if B.frozen and B.p.amp and not fused_gate_up else (gate, silu, up)))
    pd = max(gate.nbytes, up.nbytes, half)  # the product's dtype (type promotion)
    # the product's backward (MulBackward0; the product itself, saved by down, is freed by then): down's
    # input gradient and the product's two gradients, all (b, s, f), while the residual stream's
    # gradient (b, s, h) in the stream's dtype waits for the attention branch: the layer's output gradient
    # itself, as the residual add hands it to both branches (a pipeline stage's receive buffer at its top layer)
    # Three tensors, not one block: down's input gradient (the product's), then ``MulBackward0``'s two
    # (``derivatives.yaml`` ``mul.Tensor``: ``self: grad * other``, ``other: grad * self``), each (b, s, f)
    # in the product's dtype (trace: ``mul`` +f, ``mul`` +f after down's ``mm``; the replay's op-by-op
    # backward makes each its own block, ``reserved.layer_backward._op_backward``)
    grad_out = T(h / B.sp_div, 0, B.p.stream)
    B.r.transient(f"{name}.act.backward", T(f, 0, pd), T(f, 0, pd), T(f, 0, pd), grad_out, incoming=grad_out)
    prod = T(f, 0, pd, f"{name}.act_product")
    B.linear(prod, h, f"{name}.down_proj", f"{name}.down_proj.input")
    if not (fused_gate_up or B.p.amp or B.frozen or B.sp_div != 1) and len(B.r.saved) == base + 4 \
            and len(B.r.transients) == at + 4 and B.r.bwd_groups and B.r.bwd_groups[-1][1] == base - 4:
        _swiglu_backward(B, f, h, lin)
    elif B.p.amp and not (fused_gate_up or B.frozen or B.sp_div != 1) and len(B.r.saved) == base + 6 \
            and len(B.r.transients) == at + 7 and B.r.bwd_groups and B.r.bwd_groups[-1][1] == base - 3:
        _swiglu_backward_autocast(B, f, h, lin)


def _swiglu_backward(B: Builder, f: float, h: float, lin: int) -> None:
    """``LlamaMLP``'s backward, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (transformers 5.24
    ``models/llama/modeling_llama.py``), without autocast, node by node as autograd runs them (by
    ``sequence_nr``, the latest first: down, the product, up, SiLU, gate), for the replay in place of the
    four moments ``_swiglu`` records (``Recipe.backward_group`` with its cover; the moments, the
    closed form's, are unchanged). Saved from ``base`` (``len(saved)`` before the MLP): 0 gate's output,
    1 SiLU's, 2 up's, 3 the product; at ``base - 1`` the norm's output the gate and up linears saved
    (``_llama_norm_group``). Linear ``lin`` is gate's, then up's, down's. Tensors, each (b, s, width) in
    the compute dtype: the layer's output gradient g (0, h: handed to the MLP); ``MmBackward0`` of down:
    its weight's gradient, then the product's (1, f; ``mm``: ``mat2``'s first, ``_mm_moment``), the product
    released; ``MulBackward0``: ``grad * silu`` (2, up's output's; ``other``'s first) and ``grad * up`` (3,
    SiLU's), the product's gradient freed, SiLU's and up's outputs released; up's ``MmBackward0``: its
    weight's gradient, its input's (4, h), (2) freed; ``SiluBackward0`` (``silu_backward``): gate's
    output's (5, f), (3) freed, gate's output released; gate's ``MmBackward0``: its weight's, its
    input's (6, h), (5) freed, the norm's output released (both its readers have run); the two input
    gradients summed (7, h; the norm's incoming gradient), (4) and (6) freed; (7) and g carried to the
    norm's backward ("cK", ``_rms_norm_backward_half``: g is the residual stream's gradient, alive in
    autograd's input buffer until the norm's input gradient is added to it). Trace (the real nodes on
    fake tensors), Qwen2-0.5B-shaped (h 896, f 4864) b2 s1024 pure bf16: 8.3, 19 (-19); 19, 19 (-19 x3);
    8.3, 3.5 (-19); 19 (-19 -19); 8.3, 3.5 (-19 -3.5); 3.5 (-3.5 -3.5) MiB, where the moments made g
    beside each op's tensors and the product's three gradients at once."""
    base = len(B.r.saved) - 4
    half = B.p.half
    temps = [T(h, 0, B.p.stream), T(f, 0, half), T(f, 0, half), T(f, 0, half), T(h, 0, half), T(f, 0, half),
             T(h, 0, half), T(h, 0, half)]
    t, free, rel, wg, carry = Bwd.TEMP, Bwd.free, Bwd.release, Bwd.weight_grad, Bwd.carry
    events = [Bwd.TAKE, wg(lin + 2), t, rel(3), t, t, free(1), rel(1), rel(2), wg(lin + 1), t, free(2),
              t, free(3), rel(0), wg(lin), t, free(5), rel(-1), t, free(4), free(6), carry(7), carry(0)]
    B.r.at_linear = -1
    B.r.backward_group(base, temps, events, cover=0)
    at, _base, ts, ev, _c = B.r.bwd_groups.pop()
    B.r.bwd_groups.append((at - 4, base, ts, ev, 4))


def _swiglu_backward_autocast(B: Builder, f: float, h: float, lin: int) -> None:
    """``_swiglu_backward`` under autocast (fp32 weights and stream, half matmuls): saved from ``base``: 0
    gate's and 1 up's own half casts of the norm's fp32 output, 2 gate's output, 3 SiLU's, 4 up's, 5 the
    product; each linear's ``MmBackward0`` makes its half weight gradient ("hK", a block of its own), its
    input's gradient, then releases its input, its weight's half copy ("xK") and its saved input;
    ``ToCopyBackward0`` casts the weight's gradient to the fp32 ``.grad`` ("wK"), the half one freed; the
    gradient of an input autocast cast (gate's, up's) is cast back to fp32 (``ToCopyBackward0``, the half
    one freed); down's output gradient is the residual one's half cast (``AddBackward0`` hands it in the
    output's dtype). Tensors: g (0, h fp32), its cast (1, h), down's half weight gradient (2), the
    product's (3, f), ``grad * silu`` (4), ``grad * up`` (5), up's half weight gradient (6), input's (7,
    h) and its fp32 cast (8), SiLU's (9, f), gate's half weight gradient (10), input's (11) and its cast
    (12), the sum (13, fp32; carried with g to ``_rms_norm_backward_fp32``). Trace, a Llama (h 1024,
    f 2816) b2 s512 bf16-amp: 2; 5.5, 5.5 (-2 -5.5 -5.5); 11 (-5.5); 5.5, 5.5 (-5.5 x3); 5.5, 2 (-5.5 -5.5
    -2); 11 (-5.5); 4 (-2); 5.5 (-5.5 -5.5); 5.5, 2 (-5.5 -5.5 -2); 11 (-5.5); 4 (-2); 4 (-4 -4) MiB."""
    base = len(B.r.saved) - 6
    half = B.p.half
    d, u, g = lin + 2, lin + 1, lin
    sizes = [(h, F32), (h, half), (0, 0), (f, half), (f, half), (f, half), (0, 0), (h, half), (h, F32),
             (f, half), (0, 0), (h, half), (h, F32), (h, F32)]
    temps = [T(a, 0, b) for a, b in sizes]
    t, free, rel, wg, hg, xc = Bwd.TEMP, Bwd.free, Bwd.release, Bwd.weight_grad, Bwd.half_grad, Bwd.drop_copy
    events = [Bwd.TAKE, t, hg(d), t, free(1), rel(5), xc(d), wg(d), free(2),
              t, t, free(3), rel(3), rel(4),
              hg(u), t, free(4), xc(u), rel(1), wg(u), free(6), t, free(7),
              t, free(5), rel(2),
              hg(g), t, free(9), xc(g), rel(0), wg(g), free(10), t, free(11),
              t, free(8), free(12), Bwd.carry(13), Bwd.carry(0)]
    B.r.at_linear = -1
    B.r.backward_group(base, temps, events)
    at, _base, ts, ev, _c = B.r.bwd_groups.pop()
    B.r.bwd_groups.append((at - 7, base, ts, ev, 7))


def _liger_swiglu(B: Builder, f: float, h: float, src: T, name: str) -> None:
    """Liger-Kernel's ``LigerSwiGLUMLP`` (``--liger``): ``down_proj(LigerSiLUMulFunction.apply(
    gate_proj(x), up_proj(x)))`` (transformers/swiglu.py L7-25 at v0.6.4). ``LigerSiLUMulFunction``
    (ops/swiglu.py v0.6.4 L102-117, unchanged from v0.3.0 to v0.8.2) saves ``(a, b)``, the gate and up
    outputs themselves (half: the linears' outputs), and returns ``c = torch.empty_like(a)`` (L64):
    silu(a) is recomputed in the kernel, never stored. Its backward kernel writes da and db over
    the saved a and b (``swiglu_backward`` returns ``a.view(...)``, ``b.view(...)``, L83-100), so the
    only new tensor of the activation's backward is the product's gradient (b, s, f) that
    ``down_proj``'s backward hands it, beside the residual stream's gradient waiting for the
    attention branch (as ``_swiglu``)."""
    gate = B.linear(src, f, f"{name}.gate_proj", f"{name}.gate_proj.input", h, out_name=f"{name}.gate_out")
    if B.frozen:  # a frozen linear's output is not an aten.mm output: name it as the others
        gate = T(f, 0, gate.nbytes, f"{name}.gate_out")
    outer, B.outer_live = B.outer_live, (*B.outer_live, gate)   # the gate output alive while up_proj runs
    up = B.linear(src, f, f"{name}.up_proj", f"{name}.up_proj.input", h, out_name=f"{name}.up_out")
    B.outer_live = outer
    if B.frozen:
        up = T(f, 0, up.nbytes, f"{name}.up_out")
    B.r.save(gate, up)                                           # ctx.save_for_backward(a, b)
    grad_out = T(h / B.sp_div, 0, B.p.stream)
    # the Function's backward: dc (b, s, f) in c's dtype (a's), da and db written over a and b
    B.r.transient(f"{name}.act.backward", T(f, 0, gate.nbytes), grad_out, incoming=grad_out)
    prod = T(f, 0, gate.nbytes, f"{name}.act_product")           # c = torch.empty_like(a)
    B.linear(prod, h, f"{name}.down_proj", f"{name}.down_proj.input")
