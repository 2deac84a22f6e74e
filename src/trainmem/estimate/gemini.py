"""ColossalAI Gemini as Lightning's ``ColossalAIStrategy`` ran it in 2022: what one rank holds.

Source: ColossalAI at commit bbc58d881 (hpcaitech/ColossalAI main on 2022-08-18, the day of the
ColossalAI-Pytorch-lightning GPT benchmark 6a82b80; ``colossalai/gemini/chunk.py``,
``chunk_mgr.py``, ``colossalai/nn/parallel/data_parallel.py`` and ``colossalai/zero/utils/
zero_hook_v2.py`` are identical at the v0.1.9 and v0.1.10 tags), and Lightning's strategy
(Lightning-AI/lightning 2fef6d9403 ``src/pytorch_lightning/strategies/colossalai.py`` L243-289,
the same code as hpcaitech/ColossalAI-Pytorch-lightning 39b39a6 ``strategies/colossalai.py``).

The strategy builds ``ChunkManager(chunk_size, process_group, enable_distributed_storage=True,
init_device=cuda)`` (placement_policy 'cuda'), wraps the model in ``ZeroDDP`` and the optimizer
(HybridAdam) in ``ZeroOptimizer``. ``chunk_size`` is ``ChunkManager.search_chunk_size(model,
search_range=64 * 1024**2, n_grids=1024, min_chunk_size=None)`` unless given.

* ``ZeroDDP.__init__`` (data_parallel.py L220-232): for each parameter, in ``module.parameters()``
  order, an fp32 copy ``fp32_p = p.float()`` and the parameter cast ``p.data = p.half()``; ``p`` is
  appended to the chunk group 'fp16_param', ``fp32_p`` to 'fp32_param'. Both groups get the same
  chunks (same element counts in the same order).
* ``ChunkManager.append_tensor`` (chunk_mgr.py L53-95): a tensor goes into the group's last chunk
  if it fits, else a new chunk of ``chunk_size`` elements (or of the tensor's size when larger,
  L72-75) is made; chunk ``i`` of a group is owned by rank ``i % dp`` (``_get_next_src_rank``
  L97-111, round robin). Chunks are whole, not split: the owner keeps the chunk's storage
  (``Chunk.__init__`` chunk.py L79-92: ``torch.empty(chunk_size)``, padding included), the others
  free it.
* Forward and backward (zero_hook_v2.py L24-41, chunk.py L145-159): before an op, the chunks of
  its parameters are gathered (``Chunk.access``: the full storage allocated again, broadcast from
  the owner); after it they are released lazily when every tensor of the chunk is in state HOLD.
  In backward a parameter goes HOLD_AFTER_BWD after its op and READY_FOR_REDUCE when its
  gradient arrives, so a chunk stays gathered until every parameter in it has its gradient
  (``ZeroDDP.grad_handle`` data_parallel.py L274-288: reduce, then ``release_chunk``).
* Gradients (``grad_handle``): the autograd gradient (fp16) is divided by the world size (a new
  tensor), copied over the parameter's slot in its fp16 chunk (``copy_tensor_to_chunk_slice``,
  chunk.py L225-235) and an empty tensor is returned: no gradient buffer; after backward each
  owned parameter's ``.grad`` is its fp16 chunk slice (``_setup_grads_ptr`` L247-254).
* ``ZeroOptimizer.step`` (colossalai/zero/zero_optimizer.py L129-146): the owned parameters are
  pointed at their fp32 chunk slices and HybridAdam steps them with its fused multi-tensor CUDA
  kernel (colossalai/nn/optimizer/hybrid_adam.py L95-145: ``exp_avg`` and ``exp_avg_sq`` are
  ``torch.zeros_like(p, dtype=float)`` of each owned parameter, at its first step; no
  temporaries), then the fp32 chunks are copied into the fp16 ones in place
  (``copy_chunk_group``, chunk_mgr.py L300-310).

The sharded chunks with ``keep_gathered`` (``colossalai/gemini/update/chunkv2.py``, ``ChunkV2``)
were in the tree then but not used by ``ZeroDDP``, which imports ``colossalai.gemini.chunk``
(data_parallel.py L6); the search in megabytes (``search_range_mb``, ``min_chunk_size_mb``) came
with Lightning's support for colossalai 0.1.11 (5e6f9b5a20, December 2022).

So rank ``r`` holds its fp16 chunks (2 bytes per chunk element), its fp32 chunks (4 bytes) and two
fp32 Adam states per parameter of its chunks (unpadded), and gathers the other ranks' fp16 chunks
while their parameters are computed. trainmem reports rank 0: the benchmark's numbers are rank
0's (its ``MemoryMonitor`` prints on rank 0), and rank 0 owns chunk 0, the first parameters (a
language model's embedding).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..allocator_rules import block_bytes
from ..spec.model import ModelSpec
from ..spec.training import TrainingSpec

#: Lightning's ``ColossalAIStrategy`` chunk search defaults (2fef6d9403 colossalai.py L131-133)
SEARCH_RANGE = 64 * 1024**2
N_GRIDS = 1024


def filter_exlarge(numels: tuple[int, ...]) -> tuple[int, ...]:
    """The parameter sizes the chunk search considers: those at most mean + 3 std of all of them
    (``_filter_exlarge_params``, chunk_mgr.py L339-344: numpy's population std)."""
    arr = np.array(numels, dtype=np.float64)
    upper = arr.mean() + 3 * arr.std()
    return tuple(x for x in numels if x <= upper)


def chunk_utils(sizes: np.ndarray, numels: tuple[int, ...]) -> np.ndarray:
    """``ChunkManager.get_chunk_util`` (chunk_mgr.py L241-261) for every chunk size in ``sizes`` at
    once: parameter elements over the elements of the chunks they fill, a chunk being opened when
    the next parameter does not fit in the current one."""
    total = np.zeros_like(sizes)
    cur = np.zeros_like(sizes)
    for s in numels:
        opened = (total == 0) | (cur + s > sizes)
        total = np.where(opened, total + sizes, total)
        cur = np.where(opened, s, cur + s)
    return sum(numels) / total


@lru_cache(maxsize=64)
def search_chunk_size(numels: tuple[int, ...], search_range: int = SEARCH_RANGE, n_grids: int = N_GRIDS) -> int:
    """``ChunkManager.search_chunk_size`` (chunk_mgr.py L263-298, ``min_chunk_size=None``): from the
    largest considered parameter up to it + ``search_range`` in steps of ``search_range // n_grids``,
    the first chunk size of the highest utilization."""
    considered = filter_exlarge(numels)
    smallest = max(considered)
    sizes = np.arange(smallest, smallest + search_range + 1, search_range // n_grids, dtype=np.int64)
    util = chunk_utils(sizes, considered)
    return int(sizes[int(np.argmax(util))])  # the first maximum: ``if chunk_util > max_chunk_util``


@dataclass(frozen=True)
class Chunk:
    """One chunk: its size in elements (padding included) and its parameters (indices into the
    parameter list)."""

    size: int
    params: tuple[int, ...]


def chunk_layout(numels: tuple[int, ...], chunk_size: int) -> tuple[Chunk, ...]:
    """The chunks ``ChunkManager.append_tensor`` fills with parameters of these sizes, in order
    (chunk_mgr.py L65-88, ``Chunk.append`` chunk.py L98-125): into the last chunk while it has room,
    else a new chunk of ``chunk_size`` elements, or of the parameter's own size when larger."""
    chunks: list[tuple[int, int, list[int]]] = []   # (size, used, params)
    for i, n in enumerate(numels):
        if chunks and chunks[-1][1] + n <= chunks[-1][0]:
            size, used, params = chunks[-1]
            chunks[-1] = (size, used + n, params + [i])
        else:
            chunks.append((max(n, chunk_size), n, [i]))
    return tuple(Chunk(size, tuple(params)) for size, _used, params in chunks)


@dataclass(frozen=True)
class GeminiRank:
    """What one rank holds (bytes, each allocation rounded by the caching allocator).

    ``fp16_chunks``/``fp32_chunks``: its own chunks (chunk_size x 2 / x 4, ``torch.empty`` each);
    ``states``: the numel of each parameter of its chunks (two fp32 Adam states each);
    ``gathered_layer``: per decoder layer, the fp16 chunks of other ranks gathered while that layer
    back-propagates (every chunk holding one of its parameters: a chunk stays gathered until all of
    its parameters have gradients); ``gathered_always``: other ranks' fp16 chunks gathered from the
    head's backward to the end of backward (a tied embedding's chunk: its gradient comes last);
    ``grad_hook``: the largest layer parameter's gradient and its ``grad / dp`` copy, both alive in
    ``grad_handle`` (data_parallel.py L275-281) while the layer back-propagates."""

    fp16_chunks: tuple[int, ...]
    fp32_chunks: tuple[int, ...]
    states: tuple[int, ...]
    gathered_layer: tuple[int, ...]
    gathered_always: int
    grad_hook: int
    chunk_size: int
    chunk_params: tuple[int, ...] = ()   # parameters in each of its own chunks (``states`` in that order)


def gemini_rank(numels: tuple[int, ...], layers: tuple[int | None, ...], tied: tuple[int, ...], dp: int,
                chunk_size: int | None = None, rank: int = 0, expandable: bool = False) -> GeminiRank:
    """Rank ``rank``'s holdings for parameters of ``numels`` elements (``module.parameters()``
    order), ``layers[i]`` the decoder layer of parameter i (None outside the layers), ``tied`` the
    indices of parameters used at both ends of the model (a tied embedding) over ``dp`` ranks."""
    size = chunk_size or search_chunk_size(numels)
    chunks = chunk_layout(numels, size)
    mine = [c for i, c in enumerate(chunks) if i % dp == rank]
    others = [c for i, c in enumerate(chunks) if i % dp != rank]
    nlayers = 1 + max((x for x in layers if x is not None), default=-1)
    gathered = [0] * nlayers
    for c in others:
        for lyr in sorted({layers[j] for j in c.params if layers[j] is not None}):
            gathered[lyr] += block_bytes(c.size * 2, expandable)
    always = sum(block_bytes(c.size * 2, expandable) for c in others if set(c.params) & set(tied))
    largest = max((n for n, lyr in zip(numels, layers) if lyr is not None), default=max(numels))
    hook = (2 if dp > 1 else 1) * block_bytes(largest * 2, expandable)   # grad, and grad / dp when dp > 1
    return GeminiRank(tuple(block_bytes(c.size * 2, expandable) for c in mine),
                      tuple(block_bytes(c.size * 4, expandable) for c in mine),
                      tuple(numels[j] for c in mine for j in c.params), tuple(gathered), always, hook, size,
                      tuple(len(c.params) for c in mine))


_TIED_NAMES = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight")  # (= states.TIED_NAMES)


@lru_cache(maxsize=64)
def _of_model(m: ModelSpec, dp: int, chunk_size: int | None, expandable: bool) -> GeminiRank:
    params = m.parameter_tensors()
    tied = tuple(i for i, p in enumerate(params) if m.tied_embeddings and p.name.endswith(_TIED_NAMES))
    return gemini_rank(tuple(p.numel for p in params), tuple(p.layer for p in params), tied, dp, chunk_size,
                       expandable=expandable)


def model_gemini(m: ModelSpec, t: TrainingSpec) -> GeminiRank | None:
    """Rank 0's Gemini holdings for this model and run (``gemini_rank`` over the model's parameters
    in registration order, ``module.parameters()``'s); None without ``--gemini``."""
    if t.gemini is None:
        return None
    return _of_model(m, t.dp, t.gemini_chunk_size, t.expandable_segments)
