"""FSDP1's replay asks the allocator for the bytes the real tensors have, not for the blocks the estimate
charges them (``allocator_rules.block_bytes``, which rounds a request of 10 MiB or more up to its whole
2 MiB segment when it would open one): a layer's unsharded flat parameter (``quantities.fsdp1``
``fsdp1_layer_raw``, torch 2.13 ``fsdp/_flat_param.py`` ``_alloc_padded_unsharded_flat_param``
L1395-1410) and the head's and the input embedding's unsharded gradients (``reserved.fsdp._unsharded_grads``).
A rounded request does not fit a block of the tensor's own size that an earlier micro-batch left
cached: the replay opened segments trace does not (Phi-3 cut to 2 layers, FSDP1 dp 4, two
micro-batches under ``--grad-sync step``: peak reserved +22.4 % against trace before, +7.7 % after)."""
from __future__ import annotations

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.trace.api import trace

from test_fsdp_grad_op_replay import WIDE
import alloc_spy


def test_fsdp1_requests_flat_parameters_and_root_gradients_at_their_bytes(monkeypatch, one_torch_thread):
    """The wide 2-layer Llama, FSDP1 dp 2, plain SGD (no optimizer states, whose blocks are another
    matter): each layer's flat parameter is 12,847,104 fp32 elements (49.01 MiB), the head's and the
    embedding's gradients 8000 x 1024 fp32 (31.25 MiB) each. Trace and the replay ask for those bytes and
    never for their 50 and 32 MiB blocks."""
    def sizes(fn) -> list[int]:
        seen: list[int] = []
        alloc_spy.requests(monkeypatch, fn, lambda nbytes, stream: seen.append(nbytes))
        return seen
    kw = dict(batch_size=4, seq_len=512, use_cache=False, dp=2, fsdp="full", fsdp_version=1, optimizer="sgd")
    layer, table = (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024) * 4, 8000 * 1024 * 4
    tr, est = sizes(lambda: trace(WIDE, **kw)), sizes(lambda: trainmem.estimate(WIDE, **kw))
    for raw in (layer, table):
        assert raw in tr and raw in est
        assert block_bytes(raw) > raw and block_bytes(raw) not in tr and block_bytes(raw) not in est
