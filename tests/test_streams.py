"""The caching allocator keeps a pool per CUDA stream (``trainmem.allocator``, "Streams"): FSDP's
all-gather and reduce-scatter buffers, made on its side streams, are cached where the default
stream cannot reuse them. Checked against the torchtitan benchmark's logged max-reserved memory
(Llama 3.1 8B, FSDP2 over 8 and 128 H100s), where one shared pool was 7-11% low."""
from __future__ import annotations

from pathlib import Path

import pytest

import trainmem
from trainmem.allocator import CachingAllocator
from trainmem.validate import validate

ROOT = Path(__file__).resolve().parents[1]
MiB = 2 ** 20
TITAN = ["torchtitan_llama31_8b_fsdp8_b2_s8192", "torchtitan_llama31_8b_fsdp128_b2_s8192"]


def test_a_block_is_reused_only_by_its_own_stream():
    a = CachingAllocator()
    a.current_stream = 1
    h = a.allocate(100 * MiB)
    a.free(h)
    a.current_stream = 0
    a.allocate(100 * MiB)                     # the stream-1 block is cached but not usable here
    assert a.reserved == 200 * MiB
    a.allocate(100 * MiB, stream=1)           # stream 1 takes its own cached block back
    assert a.reserved == 200 * MiB
    assert sorted(s["stream"] for s in a.segments()) == [0, 1]


def test_empty_cache_releases_every_stream():
    a = CachingAllocator()
    for stream in (0, 1, 2):
        a.free(a.allocate(30 * MiB, stream=stream))
    a.empty_cache()
    assert a.reserved == 0


def test_fsdp2_side_streams_hold_their_own_segments_in_trace():
    """trace runs FSDP2's own code: its all-gather output and reduce-scatter output land on the
    emulated side streams, so the traced reserved memory exceeds a one-pool simulation's."""
    kw = dict(set=["num_hidden_layers=2"], batch_size=2, seq_len=512, precision="bf16-mp", fsdp="full", dp=4)
    r = trainmem.trace("llama-3.2-1b", **kw)
    e = trainmem.estimate("llama-3.2-1b", **kw)
    assert r.peak_allocated == pytest.approx(e.peak_allocated, rel=0.005)
    assert abs(e.peak_reserved / r.peak_reserved - 1) < 0.03


def test_published_torchtitan_estimate():
    v = validate(str(ROOT / "validation" / "published"), ["estimate"], TITAN)
    errors = [c.error for c in v.checks if c.quantity == "peak_reserved"]
    assert len(errors) == 2 and all(abs(e) < 0.05 for e in errors), errors


@pytest.mark.slow
def test_published_torchtitan_trace():
    """trace of the full 32-layer model on the fake group: within 2% of the published max reserved
    (one pool: -6.9% and -6.1%)."""
    v = validate(str(ROOT / "validation" / "published"), ["trace"], TITAN)
    errors = [c.error for c in v.checks if c.quantity == "peak_reserved" and c.predictor == "trace"]
    assert len(errors) == 2 and all(abs(e) < 0.02 for e in errors), errors
