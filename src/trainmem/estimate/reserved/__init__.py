"""Reserved memory of an estimate: the step's allocations and frees replayed through the allocator.

``torch.cuda.max_memory_reserved()`` exceeds the allocated peak by what the caching allocator holds
in cached blocks that the peak's requests could not use: a block freed earlier is split by smaller
requests and a later large request needs a fresh segment (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``:
``get_free_block`` takes the smallest cached block that fits, ``shouldSplit`` splits a large block when
more than 1 MiB remains, ``alloc_block`` calls ``cudaMalloc`` otherwise; a freed block stays
reserved). A fixed fraction cannot follow that: trace measured from 3% (LoRA) to 32% (FSDP with
full recomputation) of the allocated peak. So the estimate builds its own sequence of requests, tensor
by tensor where the estimate knows the tensors and block by block where it knows only their sum, and
runs it through the same simulator as ``trace`` (``trainmem.allocator.CachingAllocator``):

* load: each weight and buffer in load order (``States.load``), an fp32 master copy per trainable
  tensor where one is kept;
* each micro-batch: the input batch; forward: the base model's unsaved embedding output
  (``quantities.head_moments.held_embeddings``, freed before the head), the embeddings' saved tensors, per layer
  FSDP's gathered parameters, the tensors autograd saves (``LayerCoefs.tensors``, one block each)
  with autocast's half copy of each linear's weight made between them where its linear runs
  (``LayerCoefs.linears``) and the fp32 input it casts and does not save alive until then
  (``LayerCoefs.linear_inputs``) or, under recomputation, the kept input with the layer's tensors made and
  freed again (under full recomputation with autocast one after another, the copies kept in
  autocast's cache until the loss: ``_checkpointed``); the head side's tensors (a masked LM's one by
  one, ``quantities.outer.head_side_tensors``), the head's half copy, the logits,
  the loss's transient and saved tensors; backward: the loss
  gradients, the head's weight gradient (under autocast its half form first), a tied head's part,
  the untied head's and final norm's gradients, per layer (last first) the recomputed tensors, the
  largest backward transient (a derived layer whose derivation recorded its backward, without
  recomputation: that record's tensors, frees and gradients in order, ``_recorded_backward``), each
  linear's weight gradient as its backward makes it (under
  autocast: half gradient, copy freed, fp32 ``.grad``), the layer's other gradients, FSDP's
  unsharded gradients; the embeddings' gradients (a tied one: its own part and the sum);
* FSDP under SHARD_GRAD_OP (``--fsdp grad-op``): each layer gathered at its forward and kept gathered
  until its post-backward (``_layer_gather``); FSDP's sharded gradients: one flat reduce-scatter
  output per unit on its stream, made again and dropped where the gradients exist (``_flat_grads``);
  FSDP2 under bf16-mp: the flat bf16 all-gather input before each output (``_Fsdp.gather_output``);
  FSDP1's root flat gradient at the end of backward (``_root_reduce_input``), a tied head's
  out-of-place sum before it (and FSDP2's, the root resharded or not);
* FSDP1: each gathered flat parameter freed pending until the GPU passes its free, as far behind as
  FSDP1's rate limiter lets the GPU be (``_Fsdp1Lag``), and the backward prefetch of the layer below
  (the top layer's by the root's pre-backward hook, before the model's own loss's backward:
  ``_loss_gradient``);
  FSDP2 before PyTorch 2.5: each reduce-scatter input on the reduce-scatter stream, freed when the
  reduce returns (``_Fsdp.reduce``);
* DeepSpeed ZeRO-3: where the coordinator's replay applies (``quantities.zero3_gather.deepspeed_gather_events``),
  every parameter gathered, every prefetch's flat output and the members built from it, and each
  release, in the replay's order around the compute, each gradient bucket's flat ``cat`` at the hook
  that reduces it (``_Zero3Replay``), and the untied head's whole weight gradient at its backward; elsewhere the embedding's table gathered on its all-gather stream
  at its forward and backward (kept between them once its module order is recorded), the layers'
  parameters gathered there one at a time in the first step and by the prefetch's flat outputs after
  it (``_Zero3Fetch``),
  each bucket's flat reduction input on its reduce stream, its step's float64 norm copies, flat fp32
  gradient and flat states (``_zero3_step``);
* DDP: its construction's broadcast copies and first bucket, its rebuilt buckets at the forward after
  the first reducing backward (``_ddp_init``, ``_ddp_rebuild``; under an interleaved pipeline schedule
  one DDP per virtual stage, ``_DdpStages``); torch's pipeline stage's receive buffers, made once
  (``recv_buffers``); a gradient added into an existing ``.grad`` as a tensor of its own (``_accumulated``);
* the optimizer step: the states of every trainable tensor at the first step, in parameter order
  (``torch.optim``'s lazy ``_init_group``), then the step's temporaries as per-tensor blocks;
  ``zero_grad(set_to_none=True)`` frees the gradients.

Two steps are replayed with up to two micro-batches each, as the moments are (``moments.py``). The
result is the reserved-minus-allocated gap at the end, added to the estimate's own allocated peak,
with the replay's allocated peak counted as the estimate counts it: each block allocated after the
load at ``block_bytes`` of its request, not at the unsplit block it got (``_Replay``: a large block
is split only when more than 1 MiB would remain, so a 1.125 MiB gradient landing in a 2 MiB tail
takes all of it, and ``memory_allocated`` counts that; the excess stays in the gap);
the replay is coarser than the moments (a backward transient is one block, Megatron's selective policy's kept tensors are scaled), so its
allocated peak is not the estimate's, but the segments it leaves behind are those of tensors of the
estimate's sizes in the step's order. With ``TrainingSpec.expandable_segments`` the simulator runs in
that mode (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: one segment per pool grown by mapping
pages, every block split to its request; ``trainmem.allocator``). Used for one layout at a time
(``estimate``); the layout arrays of the planner keep the 1/32 rule (``allocator_rules.reserved_overhead``).

The package, bottom of the import order first (a module imports only modules above it in this
list; ``driver.reserved_gap`` is the entry point):

* ``replay``:          The replay's allocator and step state
* ``zero_step``:       DeepSpeed ZeRO's side of the replay outside the layers
* ``zero_gather``:     DeepSpeed ZeRO-3's parameter gathers in the replay
* ``optimizer``:       Gradients and the optimizer in the replay
* ``ddp``:             DDP and pipeline stages in the replay
* ``fsdp``:            PyTorch FSDP in the replay
* ``parts``:           What the replay's passes hand each other
* ``layer_forward``:   A layer's forward in the replay
* ``layer_backward``:  A layer's backward in the replay
* ``loss_forward``:    The head side's forward in the replay
* ``loss_backward``:   The head side's backward in the replay
* ``driver``:          The replay's driver
"""
from __future__ import annotations

from . import (ddp, driver, fsdp, layer_backward, layer_forward, loss_backward, loss_forward, optimizer, parts, replay,
               zero_gather, zero_step)
from .ddp import flat_copies
from .driver import reserved_gap

__all__ = ["ddp", "driver", "fsdp", "layer_backward", "layer_forward", "loss_backward", "loss_forward", "optimizer",
           "parts", "replay", "zero_gather", "zero_step", "flat_copies", "reserved_gap"]
