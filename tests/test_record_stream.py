"""Frees that wait for another stream (``Tensor.record_stream``) and how far the CPU runs ahead.

The caching allocator keeps a block freed while another stream may still read it out of its pool
until a later ``malloc`` finds the recorded event complete (``CUDACachingAllocator.cpp``:
``recordStream``, ``insert_events``, ``process_events``). FSDP1 frees each unit's gathered flat
parameter that way, recorded on the default stream, and its rate limiter bounds how far the CPU runs
ahead: each reshard records a free event and each unshard waits on the CPU for the oldest of two
(torch ``fsdp/_runtime_utils.py`` ``_reshard``/``_unshard``, ``_limiter_utils.py``). The estimate
replays that worst case (``estimate/reserved/fsdp.py`` ``_Fsdp1Lag``); trace runs FSDP1 itself, with
``record_stream`` and the limiter's ``Event.synchronize`` seen by its CUDA emulation. The checks
below: the allocator rule, the limiter's order in the replay, and trace against the estimate on
what the mechanism adds to reserved memory (one gathered layer in every setup tried: 118 MiB for a
4-layer Llama-3.2-1B shape, 388 MiB for a Llama-2-7B layer, with and without full recomputation,
under ``no_sync`` accumulation too).
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.allocator import CachingAllocator, SimulatedOutOfMemory
from trainmem.estimate import reserved as rv

MiB = 2 ** 20


def test_a_pending_block_is_not_reused_until_released():
    a = CachingAllocator()
    h = a.allocate(100 * MiB, stream=1)           # on a side stream (FSDP1's unshard stream)
    token = a.free_pending(h)                     # freed, the default stream may still read it
    assert (a.allocated, a.reserved, a.stats.pending) == (0, 100 * MiB, 100 * MiB)
    a.allocate(100 * MiB, stream=1)               # the same stream cannot take it back yet
    assert a.reserved == 200 * MiB
    a.release(token)                              # its event found complete
    assert a.stats.pending == 0
    a.allocate(100 * MiB, stream=1)               # now it is reused
    assert a.reserved == 200 * MiB


def test_a_pending_block_does_not_merge_and_shows_in_snapshots():
    a = CachingAllocator()
    whole = a.allocate(60 * MiB)
    a.free(whole)                                 # a 60 MiB segment, free
    left, right = a.allocate(20 * MiB), a.allocate(20 * MiB)
    a.free_pending(left)
    a.free(right)                                 # merges with the free tail, not with the pending block
    states = [b["state"] for s in a.segments() for b in s["blocks"]]
    assert states == ["active_pending_free", "inactive"]
    assert a.segments()[0]["allocated_size"] == 0


def test_release_upto_follows_the_order_of_the_frees():
    a = CachingAllocator()
    first = a.free_pending(a.allocate(10 * MiB))
    tick = a.pending_tick                          # an event recorded after the first free
    a.free_pending(a.allocate(10 * MiB))
    a.release_upto(tick)
    assert a.stats.pending == 10 * MiB and first not in a._pending


def test_a_full_device_waits_for_pending_frees_before_failing():
    """``release_cached_blocks`` calls ``synchronize_and_free_events`` before freeing the cache."""
    a = CachingAllocator(capacity=100 * MiB)
    a.free_pending(a.allocate(80 * MiB))
    a.allocate(80 * MiB)                          # fits only once the pending block is released
    assert a.reserved == 80 * MiB and a.stats.pending == 0
    with pytest.raises(SimulatedOutOfMemory):
        a.allocate(40 * MiB)


def test_the_limiter_releases_a_free_two_reshards_later():
    """``_Fsdp1Lag``: an unshard waits for the free event of the reshard two before it, so the unit
    freed just before is still pending and the one before that is reusable."""
    R = rv.replay._Replay()
    lag = rv.fsdp._Fsdp1Lag()
    blocks = []
    for _layer in range(3):
        lag.wait(R)
        blocks.append(R.alloc(100 * MiB, rv.replay.GATHER_STREAM))
        lag.defer(R, blocks[-1], lag.event())
    assert R.a.stats.pending == 200 * MiB         # the first released at the third unshard
    assert R.a.reserved == 200 * MiB              # the third reused the first's block
    lag.synchronize(R)                            # the next batch's blocking copy
    assert R.a.stats.pending == 0


L4 = ["num_hidden_layers=4", "vocab_size=1024"]
CASES = [
    ("llama-3.2-1b", dict(set=L4, batch_size=2, seq_len=512, precision="bf16-mp", recompute="none")),
    ("llama-3.2-1b", dict(set=L4, batch_size=2, seq_len=512, precision="bf16", recompute="full")),
    # FSDP1's no_sync while accumulating: the layers are still resharded in backward
    ("llama-3.2-1b", dict(set=L4, batch_size=2, seq_len=512, precision="bf16", grad_accum=2, grad_sync="step")),
]


def _no_deferral(monkeypatch):
    """Both sides with FSDP1's frees made at once (the replay's ``defer`` a plain free; trace without
    the ``record_stream`` hook); the replay run anew, not read from the engine's memo."""
    import trainmem.trace.cuda as tc
    from trainmem.estimate import engine
    engine.forget_replays()
    monkeypatch.setattr(rv.fsdp._Fsdp1Lag, "defer", lambda self, R, h, tick: R.free(h))
    monkeypatch.setattr(tc, "_record_stream_patches", lambda tracker: {})


@pytest.mark.parametrize("model,kw", CASES, ids=["bf16-mp", "bf16-full-recompute", "bf16-no-sync"])
def test_fsdp1_pending_frees_add_the_same_bytes_in_trace_and_estimate(model, kw, monkeypatch):
    kw = dict(kw, fsdp="full", fsdp_version=1, dp=4, gpu="h100")
    est, tr = trainmem.estimate(model, **kw), trainmem.trace(model, **kw)
    with monkeypatch.context() as m:
        _no_deferral(m)
        est0, tr0 = trainmem.estimate(model, **kw), trainmem.trace(model, **kw)
    assert est.peak_allocated == est0.peak_allocated and tr.peak_allocated == tr0.peak_allocated
    added = tr.peak_reserved - tr0.peak_reserved
    assert added > 0                              # trace sees FSDP1's record_stream and its limiter
    assert est.peak_reserved - est0.peak_reserved == added


def test_fsdp2_makes_no_pending_free(monkeypatch):
    """FSDP2 holds its buffers until an event instead of ``record_stream``: nothing changes."""
    kw = dict(set=L4, batch_size=2, seq_len=512, precision="bf16-mp", fsdp="full", dp=4, gpu="h100")
    tr, est = trainmem.trace("llama-3.2-1b", **kw), trainmem.estimate("llama-3.2-1b", **kw)
    with monkeypatch.context() as m:
        _no_deferral(m)
        assert trainmem.trace("llama-3.2-1b", **kw).peak_reserved == tr.peak_reserved
        assert trainmem.estimate("llama-3.2-1b", **kw).peak_reserved == est.peak_reserved
