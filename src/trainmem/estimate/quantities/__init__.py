"""The quantities of one rank that do not depend on batch, sequence or accumulation.

``quantities(m, t, stage)`` gathers, for one model trained one way on one pipeline stage:
model states (``states.py``), the layer's saved tensors as bytes per token and per token x key
(``layers.py``), the tensors outside the layers (embeddings, final norm, head input), the loss's
bytes per logit, the autocast cache, optimizer temporaries and communication buffers. The step
(``moments.py``) then turns them into bytes for any batch and sequence, on Python numbers or on
numpy arrays; ``gather`` stacks the quantities of many layouts into arrays for that.

Conventions: ``n`` = tokens on this rank (micro-batch x local sequence), ``nsq`` = tokens x keys
(n x full sequence: context parallelism sees every key); a per-token pair ``(tok, sq)`` stands
for ``int(tok * n + sq * nsq)`` bytes.

The package, bottom of the import order first (a module imports only modules above it in this
list; ``build.quantities`` is the entry point):

* ``model_facts``:     Facts of the model and the run that the other modules read
* ``record``:          The ``Quantities`` dataclass
* ``loss_kinds``:      Each loss implementation's bytes per logit (``LossBytes``)
* ``loss``:            The loss's bytes
* ``layer_terms``:     Terms added to a layer's coefficients
* ``layer_moments``:   The layers' saved tensors and transients at the backward moments
* ``outer``:           The tensors outside the layers
* ``zero_partition``:  DeepSpeed ZeRO-1/2's gradients and buffers
* ``zero_offload``:    DeepSpeed ZeRO's optimizer offload
* ``zero3_gather``:    DeepSpeed ZeRO-3's gathered parameters
* ``zero_step``:       DeepSpeed ZeRO's step
* ``optimizer_step``:  The optimizer step's temporaries
* ``head_grads``:      The head's and embedding's gradients
* ``head_moments``:    The final norm and the head around the loss
* ``fsdp1``:           FSDP1's own quantities
* ``pipeline``:        Pipeline parallelism
* ``fsdp_root``:       FSDP's unsharded buffers (``fsdp_buffers``) and its root unit around the loss
* ``build``:           The builder
"""
from __future__ import annotations

from . import (build, fsdp1, fsdp_root, head_grads, head_moments, layer_moments, layer_terms, loss, loss_kinds,
               model_facts, optimizer_step, outer, pipeline, record, zero3_gather, zero_offload, zero_partition,
               zero_step)
from .build import SHAPE_FIELDS, quantities, shape_quantities, unsloth_offloads
from .loss import loss_mode
from .model_facts import HEAD_KEYS, PER_POSITION, is_lm, layer_key, loss_upcasts
from .optimizer_step import step_copies
from .outer import HEAD_LOGITS, HEAD_LOSS, HEAD_NEXT, HEAD_NEXT2, HEAD_SAVED
from .record import Quantities, TransientTable, gather
from .zero_partition import PARTITION_BOTTOM, PARTITION_EMBEDDING, PARTITION_TOP, without_gpu_flatten

__all__ = ["build", "fsdp1", "fsdp_root", "head_grads", "head_moments", "layer_moments", "layer_terms", "loss",
           "loss_kinds", "model_facts", "optimizer_step", "outer", "pipeline", "record", "zero3_gather", "zero_offload",
           "zero_partition", "zero_step", "HEAD_KEYS", "HEAD_LOGITS", "HEAD_LOSS", "HEAD_NEXT", "HEAD_NEXT2",
           "HEAD_SAVED", "PARTITION_BOTTOM", "PARTITION_EMBEDDING", "PARTITION_TOP", "PER_POSITION", "SHAPE_FIELDS",
           "Quantities", "TransientTable", "gather", "is_lm", "layer_key", "loss_mode", "loss_upcasts", "quantities",
           "shape_quantities", "step_copies", "unsloth_offloads", "without_gpu_flatten"]
