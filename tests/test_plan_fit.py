"""fit: exact search over the estimator; seed 003 reproduced (largest batch 11, longest sequence 400)."""
import sys

import pytest
from hypothesis import given, settings, strategies as st

import trainmem
from trainmem.errors import TrainmemError
from trainmem.plan import fit
from trainmem.plan.fit import search_max, search_max_many

MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def bert():
    return trainmem.resolve_model("bert-large-uncased", overrides=['architectures=["BertForSequenceClassification"]'])


# Seed 003: RTX 3090 (24 GiB), default occupation 895.04 MiB measured before torch + ~300 MiB CUDA context.
NOTEBOOK = dict(method="bert-notebook", gpu_memory="24GiB", context_memory=round(895.04 * MiB) + 300 * MiB,
                precision="fp32", optimizer="adamw", attention="eager")


def test_seed003_largest_batch_at_512(bert):
    r = fit(bert, seq_len=512, **NOTEBOOK)
    assert r.fits and r.search == "batch_size" and r.batch_size == 11 and r.seq_len == 512
    assert r.next_value == 12 and r.next_device_used > 24 * GiB
    assert r.margin == 24 * GiB - r.device_used > 0
    # seed methods compare allocated + context with the GPU (no allocator overhead)
    assert r.device_used == r.peak_allocated + NOTEBOOK["context_memory"]


def test_seed003_longest_sequence_at_batch_16(bert):
    # The seed reads 416 off its bar chart, but its own formulas put batch 16 x 416 at ~24.12 GiB
    # (over the 24 GiB card) and 400 at ~23.06 GiB: the longest multiple of 16 that fits is 400.
    r = fit(bert, batch_size=16, seq_multiple=16, **NOTEBOOK)
    assert r.fits and r.search == "seq_len" and r.seq_len == 400 and r.batch_size == 16
    assert r.next_value == 416
    assert r.next_device_used / GiB == pytest.approx(24.12, abs=0.005)
    assert r.device_used / GiB == pytest.approx(23.06, abs=0.005)


def test_fit_is_the_boundary_of_the_estimator():
    opts = dict(gpu="h100", precision="bf16-amp", attention="sdpa", recompute="selective")
    r = fit("llama-3.2-1b", seq_len=2048, **opts)
    assert r.fits and r.limited_by == "memory"
    at = trainmem.estimate("llama-3.2-1b", seq_len=2048, batch_size=r.batch_size, **opts)
    over = trainmem.estimate("llama-3.2-1b", seq_len=2048, batch_size=r.batch_size + 1, **opts)
    assert at.fits and not over.fits
    assert (r.peak_allocated, r.device_used, r.margin) == (at.peak_allocated, at.device_peak, at.margin)
    # the engine on arrays: 21 powers of two, then the sizes inside the bracket (4 < 8 here: 3)
    assert r.evaluations <= 21 + r.batch_size


@pytest.mark.parametrize("k_max", [1, 2, 5, 64, 1000, 1 << 20])
def test_array_search_finds_what_the_scalar_search_finds(k_max):
    for t in sorted({0, 1, 2, 3, 63, 64, 65, 777, k_max // 3, k_max - 1, k_max}):
        if t > k_max:
            continue
        got = search_max_many(lambda ks: ks <= t, k_max)
        assert got[:2] == search_max(lambda k: k <= t, k_max), (k_max, t)


def test_fit_by_arrays_equals_a_search_over_the_scalar_estimate():
    opts = dict(gpu="h100", precision="bf16-amp", recompute="full", attention="sdpa", seq_len=4096)
    r = fit("qwen2.5-1.5b", **opts)

    def fits(b: int) -> bool:
        e = trainmem.estimate("qwen2.5-1.5b", batch_size=b, **opts)
        return e.device_peak <= e.capacity
    assert (r.batch_size, r.next_value) == search_max(fits, 1 << 20)
    r = fit("llama-3.2-1b", batch_size=2, gpu="a100-40gb", seq_multiple=256)

    def fits_seq(k: int) -> bool:
        e = trainmem.estimate("llama-3.2-1b", batch_size=2, seq_len=256 * k, gpu="a100-40gb")
        return e.device_peak <= e.capacity
    k, bad = search_max(fits_seq, (1 << 22) // 256)
    assert (r.seq_len, r.next_value) == (256 * k, 256 * bad)


def test_seq_search_step_and_learned_positions():
    r = fit("gpt2", batch_size=1, gpu="h100")              # tiny model: stopped by the 1024 positions
    assert r.fits and r.seq_len == 1024 and r.limited_by == "max_positions" and r.next_value is None
    r = fit("llama-3.2-1b", batch_size=1, gpu="a10g", cp=2, tp=2, sequence_parallel=True, seq_multiple=96)
    assert r.step == 96 and r.seq_len % 96 == 0 and r.fits


def test_seq_search_resolves_at_its_first_step():
    # cp = 3 divides no power of two: the search starts at lcm(128, 3) = 384, not at a default 2048
    r = fit("llama-3.2-1b", batch_size=1, gpu="h100", cp=3)
    assert r.step == 384 and r.fits and r.seq_len % 384 == 0
    # the GPU may come as a Hardware, or with the Resolved model
    hw = trainmem.get_gpu("h100")
    assert fit("gpt2", hardware=hw, seq_len=512).batch_size == fit("gpt2", gpu="h100", seq_len=512).batch_size
    assert fit(trainmem.resolve("gpt2", gpu=hw), seq_len=512).batch_size == \
        fit("gpt2", gpu="h100", seq_len=512).batch_size


def test_nothing_fits_suggests():
    r = fit("llama-3.1-8b", seq_len=4096, gpu="l4")
    assert not r.fits and r.batch_size is None and r.margin < 0
    assert r.suggestions and all(s.saved > 0 for s in r.suggestions)
    d = r.to_dict()
    assert {"batch_size", "seq_len", "peak_allocated", "device_used", "margin"} <= set(d)


def test_bad_input():
    with pytest.raises(TrainmemError, match="not both"):
        fit("gpt2", gpu="h100", seq_len=512, batch_size=2)
    with pytest.raises(TrainmemError, match="--seq-len N"):
        fit("gpt2", gpu="h100")
    with pytest.raises(TrainmemError, match="needs a GPU"):
        fit("gpt2", seq_len=512)


def test_by_trace_without_tracer(monkeypatch):
    monkeypatch.setitem(sys.modules, "trainmem.trace.api", None)  # import fails as if not built yet
    with pytest.raises(TrainmemError, match="--by trace needs the tracer"):
        fit("gpt2", gpu="h100", seq_len=512, by="trace")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 4096))
def test_search_max_finds_the_threshold(threshold, k_max):
    calls = []

    def fits(k):
        calls.append(k)
        return k <= threshold

    k, bad = search_max(fits, k_max)
    assert k == min(threshold, k_max)
    assert bad == (None if threshold >= k_max else k + 1)
    assert all(1 <= c <= k_max for c in calls)
    assert len(calls) <= 2 * k_max.bit_length() + 2
