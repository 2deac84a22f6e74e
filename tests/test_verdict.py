"""One fit verdict for estimate and trace: same allocated peak, same verdict, the margin it assumes stated."""
from __future__ import annotations

import pytest

from trainmem.allocator_rules import reserved_overhead
from trainmem.report import MemoryReport
from trainmem.spec.hardware import Hardware

GiB = 1 << 30
HW = Hardware("test-gpu", capacity=40 * GiB, context=500 << 20)


def report(source: str, allocated: int, reserved: int, capacity: int = HW.capacity) -> MemoryReport:
    return MemoryReport(source=source, components=[], phases=[], peak_allocated=allocated,
                        peak_reserved=reserved, device_used=reserved + HW.context, capacity=capacity,
                        method="trainmem" if source == "estimate" else source, hardware=HW)


def test_estimate_and_trace_agree_when_allocated_agrees():
    alloc = 38 * GiB
    est = report("estimate", alloc, alloc + reserved_overhead(alloc))
    # the allocator simulation keeps 1.5 GiB cached over allocated: more than the 1/32 rule's 1.19 GiB
    tr = report("trace", alloc, alloc + 3 * GiB // 2)
    limit = est.device_peak + GiB // 8   # between the two reserved models
    est.capacity = tr.capacity = limit
    assert est.fits is True
    assert tr.fits is True          # before: trace counted its simulation and said it does not fit
    assert tr.margin == est.margin
    (w,) = tr.verdict_warnings()
    assert "1/32" in w and "does not fit" in w


def test_fit_basis_names_the_rule_and_the_context():
    alloc = 10 * GiB
    tr = report("trace", alloc, alloc)
    assert "1/32" in tr.fit_basis and "CUDA context" in tr.fit_basis
    assert tr.to_dict()["fit_basis"] == tr.fit_basis
    m = report("measure", alloc, alloc + GiB)
    assert m.device_peak == alloc + GiB + HW.context
    assert "measured" in m.fit_basis


@pytest.mark.parametrize("extra", [0, 1 << 20, 2 * GiB])
def test_trace_verdict_is_the_estimate_rule(extra):
    alloc = 20 * GiB + 12345
    tr = report("trace", alloc, alloc + extra)
    assert tr.device_peak == alloc + alloc // 32 + HW.context
