"""A derived architecture's estimate does not jump with the float noise of its fitted coefficients
(``estimate.derived.whole``): each least-squares coefficient is read as the whole number it is within
``FIT_NOISE`` of, so a set fitted a hair over (64.000001 B per token-key pair) or under (8195.99999 B per
token) on another machine gives the same estimate.

Found by ``tools/fit_noise_audit.py`` (1e-6 added to every float of each stored set within 1e-3 of a whole
number): 49 of the agreement grid's 114 derived rows moved by more than 0.1 % of their peak reserved, among
them Qwen3 b4 s512 FSDP1 grad-op +18.7 %, Qwen3 b1 s1024 FSDP grad-op LoRA -12.0 %, Phi-3 b1 s2048 fp32 eager
full recompute +10.1 % (the replay rounds sizes made of the coefficients to the allocator's blocks).
"""
from __future__ import annotations

from pathlib import Path

import pytest

#: agreement-grid rows (``docs/agreement_grid.json``) whose peak reserved jumped with 1e-6 B of noise
ROWS = ["phi3 1x2048 attention=eager precision=fp32 recompute=full",
        "qwen3 4x512 dp=2 fsdp=grad-op fsdp_version=1 grad_accum=2 grad_sync=step hold_output=backward precision=bf16",
        "qwen3 1x1024 dp=4 fsdp=grad-op lora_dropout=0.05 lora_rank=16"]


def _noisy(doc, delta: float):
    """``doc`` with ``delta`` added to each float within 1e-3 of a whole number (a fit's float noise)."""
    if isinstance(doc, dict):
        return {k: _noisy(v, delta) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_noisy(v, delta) for v in doc]
    return doc + delta if isinstance(doc, float) and abs(doc - round(doc)) <= 1e-3 else doc


def _estimate(monkeypatch, m, t, delta: float):
    """The estimate with every coefficient set read from storage or derived (``derived.read_cached``,
    ``trace.derive.derive_coefficients``) made noisy by ``delta``, the engine's memos forgotten around it."""
    from trainmem.estimate import derived, engine
    from trainmem.estimate.quantities.build import clear_cache
    from trainmem.trace import derive

    def forget():
        clear_cache()
        derived._coefficients.cache_clear()
        derived._at_point.cache_clear()
        derived._AT_RATIO.clear()
        engine.forget_replays()

    def noisy(fn):
        return lambda *a, **kw: (lambda doc: doc if doc is None else _noisy(doc, delta))(fn(*a, **kw))
    forget()
    with monkeypatch.context() as mp:
        mp.setattr(derived, "read_cached", noisy(derived.read_cached))
        mp.setattr(derive, "derive_coefficients", noisy(derive.derive_coefficients))
        try:
            return engine.estimate(m, t, reserved=True)
        finally:
            forget()


@pytest.mark.parametrize("name", ROWS, ids=["phi3-eager-fp32-full", "qwen3-fsdp1-grad-op", "qwen3-fsdp-lora"])
def test_peaks_steady_under_fit_noise(monkeypatch, bench, name):
    """Peak reserved and allocated move by under 0.01 % with 1e-6 added to or taken from the coefficients."""
    m, t = bench.stored_rows(Path(__file__).resolve().parents[1] / "docs" / "agreement_grid.json")[name].setup.specs()
    base = _estimate(monkeypatch, m, t, 0.0)
    for delta in (1e-6, -1e-6):
        noisy = _estimate(monkeypatch, m, t, delta)
        assert noisy.peak_reserved == pytest.approx(base.peak_reserved, rel=1e-4)
        assert noisy.peak_allocated == pytest.approx(base.peak_allocated, rel=1e-4)


def test_whole_keeps_fractions():
    """Only floats within ``FIT_NOISE`` of a whole number are made whole (relative to it; absolute below 1):
    a gradient share or a set derived at one point (bytes / tokens) keeps its fraction."""
    from trainmem.estimate.derived import FIT_NOISE, whole
    doc = {"tok": [8195.99999999, 2.4e-09, 64.000001], "g": 0.9998, "c": 1536.25, "n": 7, "s": "x",
           "far": [1.0 + 3 * FIT_NOISE, 3 * FIT_NOISE]}
    assert whole(doc) == {"tok": [8196.0, 0.0, 64.0], "g": 0.9998, "c": 1536.25, "n": 7, "s": "x",
                          "far": [1.0 + 3 * FIT_NOISE, 3 * FIT_NOISE]}
