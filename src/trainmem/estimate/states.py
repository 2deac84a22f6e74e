"""Model states on one GPU: weights, buffers, master weights, gradients, optimizer states.

Counted per tensor, so that each allocation is rounded the way PyTorch's CUDA caching allocator
rounds it (``block_bytes``), then sharded: tensor parallelism divides matmul weights and
embeddings by ``tp``; pipeline stages hold their own layers (the worst stage is reported); ZeRO
stage 1/2/3 (or FSDP) divides optimizer states / gradients / weights over the sharding group.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..spec.model import ModelSpec, ParamTensor
from ..spec.training import TrainingSpec

SMALL = 1 << 20          # requests up to 1 MiB go to the small pool
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
MIN_BLOCK = 512


def block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator charges a fresh request of ``nbytes``.

    Requests round up to 512 B. A request over 10 MiB gets a segment rounded up to 2 MiB and the
    block is not split when the remainder is <= 1 MiB, so it occupies the whole segment (seed 003:
    a 119.23 MiB embedding occupies 120.00 MiB). Source: c10/cuda/CUDACachingAllocator.cpp
    (round_size, get_allocation_size, shouldSplit).
    """
    if nbytes <= 0:
        return 0
    rounded = max(MIN_BLOCK, (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)
    if rounded < MIN_LARGE_ALLOC:
        return rounded
    seg = (rounded + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
    return seg if seg - rounded <= SMALL else rounded


@dataclass(frozen=True)
class States:
    """Persistent per-rank bytes (allocator-rounded) and the facts the phases need."""

    weights: int
    buffers: int
    master: int
    grads: int
    optimizer: int
    step_tensors: int
    trainable: int            # trainable parameters on this rank (before ZeRO sharding)
    params_rank: int          # parameters held on this rank (before ZeRO-3 sharding)
    layer_grads: int          # gradient bytes of one layer on this rank
    head_grads: int           # gradient bytes produced by the head / final norm (first in backward)
    layer_matmul_half: int    # half-precision copies of one layer's matmul weights (autocast)
    head_matmul_half: int     # half copy of the LM head / tied embedding used as head
    largest_param: int        # bytes of the largest trainable tensor (for-loop optimizer temporaries)
    foreach_group: int        # bytes of all trainable tensors of one dtype (foreach temporaries)
    layer_params_full: int    # bytes of one layer's weights unsharded (ZeRO-3 gather unit)
    lora_params: int


def _tp_div(p: ParamTensor, tp: int) -> int:
    """Elements of ``p`` on one tensor-parallel rank: matmul weights, their biases and embeddings
    are split; norms and routers are replicated (Megatron-LM layout)."""
    if tp == 1 or p.role in ("norm", "router"):
        return p.numel
    return -(-p.numel // tp)


def _lora_tensors(m: ModelSpec, t: TrainingSpec) -> list[tuple[str, int, int | None]]:
    """(module, elements, layer) of LoRA A and B matrices on the targeted linear modules."""
    if not t.lora_rank:
        return []
    targets = set(t.lora_targets or default_lora_targets(m))
    out = []
    for p in m.parameter_tensors():
        if p.is_matmul and p.module in targets and len(p.shape) >= 2 and p.role != "embedding":
            rows, cols = p.shape[-2], p.shape[-1]
            if m.family in ("gpt2", "nanogpt"):  # Conv1D stores (in, out)
                rows, cols = cols, rows
            experts = p.shape[0] if len(p.shape) == 3 else 1
            out.append((p.module, experts * t.lora_rank * (rows + cols), p.layer))
    return out


def default_lora_targets(m: ModelSpec) -> tuple[str, ...]:
    """peft's default target modules for the model type (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)."""
    if m.family in ("gpt2", "nanogpt"):
        return ("c_attn",)
    if m.family in ("bert", "roberta-prenorm"):
        return ("query", "value")
    return ("q_proj", "v_proj")


def _state_bytes(optimizer: str, shape: tuple[int, ...], numel: int, sbytes: int) -> tuple[int, ...]:
    """Optimizer state tensors of one parameter, in bytes each.

    adam/adamw: exp_avg and exp_avg_sq in the state dtype (torch.optim). sgd: none;
    sgd-momentum: momentum_buffer. lion: exp_avg. adafactor (transformers, beta1=None): factored
    second moment, row + column vectors for matrices, a full tensor for vectors, in fp32.
    adamw-8bit (bitsandbytes): two uint8 states plus an fp32 absmax per 2048-element block for
    tensors of >= 4096 elements, fp32 states below that.
    """
    if optimizer in ("adam", "adamw"):
        return (numel * sbytes, numel * sbytes)
    if optimizer == "sgd":
        return ()
    if optimizer in ("sgd-momentum", "lion"):
        return (numel * sbytes,)
    if optimizer == "adafactor":
        if len(shape) >= 2:
            lead = numel // (shape[-1] * shape[-2])
            return (lead * shape[-2] * 4, lead * shape[-1] * 4)
        return (numel * 4,)
    if optimizer == "adamw-8bit":
        if numel < 4096:
            return (numel * 4, numel * 4)
        blocks = -(-numel // 2048)
        return (numel + blocks * 4, numel + blocks * 4)
    raise ValueError(optimizer)


def _insert_buffer(load: list[tuple[str, int]], name: str, nbytes: int) -> None:
    """Put a buffer where ``Module._apply`` moves it: after its module's parameters and children
    (nanoGPT's mask after ``attn.c_proj``; BERT's ids after the embeddings' LayerNorm; rotary
    frequencies after the final norm)."""
    owner = name.rsplit(".", 1)[0]
    if owner.endswith(".attn"):
        anchor = owner + ".c_proj."
    elif owner.endswith("embeddings"):
        anchor = owner + ".LayerNorm."
    else:
        anchor = None
    idx = len(load)
    if anchor:
        hits = [i for i, (n, _) in enumerate(load) if n.startswith(anchor)]
        if hits:
            idx = hits[-1] + 1
    elif name.startswith("rotary_emb"):
        hits = [i for i, (n, _) in enumerate(load) if n.startswith("norm.")]
        if hits:
            idx = hits[-1] + 1
    load.insert(idx, (name, nbytes))


class _LoadSim:
    """The CUDA caching allocator for a sequence of allocations with no frees (``model.to``).

    Same rules as ``trainmem.trace.allocator`` (512 B rounding; small pool <= 1 MiB in 2 MiB
    segments, split when >= 512 B remain; large requests from 20 MiB segments below 10 MiB, else a
    segment rounded to 2 MiB; a large block is split only when more than 1 MiB remains; best fit),
    reduced to what a free-less sequence needs: the sizes of the free remainders.
    """

    def __init__(self) -> None:
        self.small: list[int] = []
        self.large: list[int] = []
        self.allocated = 0

    def allocate(self, nbytes: int) -> None:
        size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL
        pool = self.small if small else self.large
        fits = [b for b in pool if b >= size]
        if fits:
            block = min(fits)
            pool.remove(block)
        else:
            block = (2 * SMALL if small else 20 * SMALL if size < MIN_LARGE_ALLOC
                     else -(-size // ROUND_LARGE) * ROUND_LARGE)
        rest = block - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL):
            pool.append(rest)
            self.allocated += size
        else:
            self.allocated += block

    def signature(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(sorted(self.small)), tuple(sorted(self.large))

    def prune(self, min_small: int, min_large: int) -> None:
        """Forget free remainders smaller than every request still to come in their pool: best fit
        can never pick them, so dropping them changes no outcome (and lets layers repeat)."""
        self.small = [b for b in self.small if b >= min_small]
        self.large = [b for b in self.large if b >= min_large]


@lru_cache(maxsize=4096)
def _placed_bytes(before: tuple[int, ...], layer: tuple[int, ...], layers: int, after: tuple[int, ...]) -> int:
    """Allocated bytes after ``model.to("cuda")`` places the tensors in order into an empty
    allocator: blocks carved from earlier segments can keep an unsplit remainder of up to 1 MiB,
    so the total exceeds the sum of rounded sizes (seed 001's "gaps"). Layers repeat: once the
    free remainders after a layer repeat an earlier layer's, the rest is extrapolated exactly."""
    sim = _LoadSim()
    for x in before:
        sim.allocate(x)
    future = [max(MIN_BLOCK, -(-x // MIN_BLOCK) * MIN_BLOCK) for x in layer + after]
    huge = 1 << 62
    min_small = min((r for r in future if r <= SMALL), default=huge)
    min_large = min((r for r in future if r > SMALL), default=huge)
    seen: dict[tuple, tuple[int, int]] = {}
    i = 0
    while i < layers:
        sim.prune(min_small, min_large)
        sig = sim.signature()
        if sig in seen:
            j, alloc_j = seen[sig]
            period, per_period = i - j, sim.allocated - alloc_j
            cycles = (layers - i) // period
            sim.allocated += cycles * per_period
            i += cycles * period
            seen = {}
            if i >= layers:
                break
        seen[sig] = (i, sim.allocated)
        for x in layer:
            sim.allocate(x)
        i += 1
    for x in after:
        sim.allocate(x)
    return sim.allocated


_STATES_CACHE: dict[tuple, "States"] = {}


def model_states(m: ModelSpec, t: TrainingSpec, stage: str = "first") -> States:
    """Persistent memory of one rank. ``stage``: which pipeline stage ("first" or "last").

    Cached on the fields that change model states (not batch, sequence, recomputation, ...), so a
    sweep over activations reuses them."""
    key = (m, stage, t.tp, t.pp, t.precision, t.zero_stage, t.shard_group, t.optimizer, t.impl,
           t.lora_rank, t.lora_targets, t.distributed_optimizer, t.offload_optimizer)
    hit = _STATES_CACHE.get(key)
    if hit is None:
        if len(_STATES_CACHE) >= 4096:
            _STATES_CACHE.clear()
        hit = _STATES_CACHE[key] = _model_states(m, t, stage)
    return hit


def _model_states(m: ModelSpec, t: TrainingSpec, stage: str) -> States:
    """Sum over the tensors on this rank. Transformer layers are identical, so one layer (the
    first on the rank) is counted and multiplied by the layers on the rank."""
    tp, pp = t.tp, t.pp
    per_stage = m.num_layers // pp
    lo, hi = (0, per_stage) if stage == "first" else (m.num_layers - per_stage, m.num_layers)
    tied_names = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight")

    def on_rank(p: ParamTensor) -> bool:
        if pp == 1:
            return True
        if p.layer is not None:
            return lo <= p.layer < hi
        is_input_side = p.role == "embedding"
        if stage == "first":
            return is_input_side
        # the last stage holds the final norm and the head; a tied head keeps its own copy
        return not is_input_side or (m.tied_embeddings and p.name.endswith(tied_names))

    w = t.weight_bytes
    half_master = t.precision in ("bf16", "fp16") and (t.zero_stage >= 1 or t.distributed_optimizer)
    # gradient dtype: the parameter's, except Megatron/NeMo's fp32 main-grad buffers
    gbytes = 4 if t.distributed_optimizer else w
    # optimizer state dtype: fp32 when there is an fp32 master copy, else the parameter's dtype
    sbytes = 4 if (w == 4 or half_master) else w
    zero = t.zero_stage
    # Megatron's distributed optimizer shards the fp32 master copy and the states like ZeRO-1
    zero_states = max(zero, 1) if t.distributed_optimizer else zero
    d = t.shard_group

    buffers = master = grads = opt = step_t = lora_w = 0
    trainable = params_rank = layer_grads = head_grads = lmh = hmh = largest = group = lpf = 0
    lora = _lora_tensors(m, t)
    frozen = bool(lora)
    fused_step = t.impl == "fused" and t.optimizer in ("adam", "adamw")
    # load order: tensors before the layers, one layer, tensors after the layers (bytes each)
    before: list[tuple[str, int]] = []
    layer: list[tuple[str, int]] = []
    after: list[tuple[str, int]] = []

    for p in m.first_layer_and_outer_tensors:  # layer 0 stands for the first layer on this rank
        if p.layer is None and not on_rank(p):
            continue
        k = per_stage if p.layer is not None else 1  # identical layers on this rank
        n = _tp_div(p, tp)
        params_rank += k * n
        wb = n * w
        item = (p.name, -(-wb // d) if zero == 3 else wb)
        (layer if p.layer is not None else (after if layer else before)).append(item)
        if p.layer is not None:
            lpf += wb
            # autocast caches half copies of the weights its matmuls cast; transformers' grouped_mm
            # experts have no autocast rule and run in the weights' dtype (no copies)
            if p.is_matmul and t.amp and p.role != "expert":
                lmh += n * 2
        elif p.is_matmul and t.amp:
            hmh += n * 2
        if frozen:
            continue
        trainable += k * n
        g = block_bytes(-(-n * gbytes // d) if zero >= 2 else n * gbytes)
        grads += k * g
        if p.layer is not None:
            layer_grads += g
        elif p.role != "embedding":
            head_grads += g
        sh = -(-n // d) if zero_states >= 1 else n
        if half_master:
            master += k * block_bytes(sh * 4)
        for sb in _state_bytes(t.optimizer, p.shape, sh, sbytes):
            opt += k * block_bytes(sb)
        if fused_step:
            step_t += k * block_bytes(4)
        largest = max(largest, n * sbytes)
        group += k * block_bytes(sh * sbytes)
    if m.tied_embeddings and t.amp and m.head in ("causal-lm", "masked-lm") and (pp == 1 or stage == "last"):
        # the tied embedding is also the LM head: autocast casts it for the head matmul
        emb = next(p for p in m.parameter_tensors() if p.role == "embedding")
        hmh += _tp_div(emb, tp) * 2
    for mod, n, lyr in lora:
        if lyr is not None and not (lo <= lyr < hi):
            continue
        n = -(-n // tp) if tp > 1 else n
        trainable += n
        lora_w += block_bytes(-(-n * w // d) if zero == 3 else n * w)
        g = block_bytes(-(-n * gbytes // d) if zero >= 2 else n * gbytes)
        grads += g
        if lyr == lo:
            layer_grads += g
        sh = -(-n // d) if zero_states >= 1 else n
        if half_master:  # adapters are trainable: they get the fp32 master copy too
            master += block_bytes(sh * 4)
        for sb in _state_bytes(t.optimizer, (sh,), sh, sbytes):
            opt += block_bytes(sb)
        largest = max(largest, n * sbytes)
        group += block_bytes(sh * sbytes)
    for b in m.buffer_tensors():
        nb = {"float32": 4, "int64": 8, "bool": 1}.get(b.dtype, w)
        numel = 1
        for x in b.shape:
            numel *= x
        if b.name.startswith("h."):  # nanoGPT's per-layer mask: part of the layer
            if int(b.name.split(".")[1]) != 0:  # layer 0 stands for every layer on this rank
                continue
            buffers += per_stage * block_bytes(numel * nb)
            _insert_buffer(layer, b.name, numel * nb)
            continue
        buffers += block_bytes(numel * nb)
        _insert_buffer(after if not b.name.startswith("embeddings") else before, b.name, numel * nb)
    placed = _placed_bytes(tuple(x for _, x in before), tuple(x for _, x in layer), per_stage,
                           tuple(x for _, x in after))
    weights = placed - buffers + lora_w
    if t.offload_optimizer:  # ZeRO-Offload: fp32 master weights and optimizer states live in host memory
        master = opt = step_t = 0
    lora_total = sum(n for _, n, _ in lora)
    return States(weights, buffers, master, grads, opt, step_t, trainable, params_rank, layer_grads,
                  head_grads, lmh, hmh, largest, group, lpf, lora_total)


model_states.cache_clear = _STATES_CACHE.clear  # type: ignore[attr-defined]
