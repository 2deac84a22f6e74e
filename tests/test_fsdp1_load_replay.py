"""FSDP1 keeps one shard per unit: ``FlatParamHandle`` flattens the unit's parameters into one
``FlatParameter`` and keeps this rank's chunk of it (torch 2.13 ``fsdp/_flat_param.py`` ``shard``,
``_get_shard``: ``chunk.clone()``), so the load leaves one tensor per unit on the device, the root's
first, then each layer's, then the buffers (``reserved.fsdp._fsdp1_load``). The replay made every
parameter's shard a block of its own, which took other segments than trace's (two 32 MiB and two 20 MiB
segments for Phi-3's).
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.trace.api import trace

from test_fsdp_grad_op_replay import WIDE
import alloc_spy


@pytest.mark.parametrize("fsdp", ["full", "grad-op"])
def test_fsdp1_load_makes_one_shard_per_unit(monkeypatch, one_torch_thread, fsdp):
    """The wide 2-layer Llama, FSDP1 dp 2: the first three requests of 1 MiB and over are the root's
    shard (embeddings, final norm, head: 16,385,024 fp32 elements over 2 ranks) and each layer's
    (12,847,104 elements over 2), in trace and in the replay alike; then the model's buffers, which
    FSDP1 does not flatten (the rotary ``inv_freq`` and ``original_inv_freq``: 32 fp32 elements each)."""
    def first(fn) -> list[int]:
        seen: list[int] = []

        def note(nbytes, stream):
            if nbytes:                                  # (trace's empty storages ask for nothing)
                seen.append(nbytes)
        alloc_spy.requests(monkeypatch, fn, note)
        return seen[:5]
    kw = dict(batch_size=4, seq_len=512, use_cache=False, dp=2, fsdp=fsdp, fsdp_version=1)
    root, layer = (2 * 8000 * 1024 + 1024) * 4 // 2, (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024) * 4 // 2
    freq = 1024 // 16 // 2 * 4                          # head_dim / 2 fp32 frequencies
    assert first(lambda: trace(WIDE, **kw)) == [root, layer, layer, freq, freq]
    assert first(lambda: trainmem.estimate(WIDE, **kw)) == [root, layer, layer, freq, freq]
