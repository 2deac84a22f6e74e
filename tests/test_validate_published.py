"""The published-measurement set (validation/published/): every fixture says where its number comes
from and how it was mapped, its model and setup resolve, estimate runs on each, and the summary has a
row per framework. Accuracy is reported (`trainmem validate`, docs/validation.md), not asserted."""
import os

import pytest

from trainmem.spec.resolve import resolve
from trainmem.validate import (PEAKS, describe, framework, load_fixtures, primary_quantity, summary,
                               validate)

PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")
FIXTURES = load_fixtures(PUBLISHED)
IDS = [os.path.basename(fx["_path"]) for fx in FIXTURES]
METRIC_WORDS = ("max_memory_allocated", "max_memory_reserved", "memory_reserved", "memory_allocated", "NVML",
                "nvidia-smi", "peak_memory_reserved", "peak_memory_active")


def test_the_set_is_large_and_spans_frameworks():
    assert len(FIXTURES) >= 30
    assert len({framework(fx) for fx in FIXTURES}) >= 6


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_fixture_names_source_framework_gpu_metric(fx):
    d = describe(fx)
    assert d["case"] and d["case"] != fx["_path"]
    assert d["source_url"] and d["source_url"].startswith("https://"), "source needs a URL"
    assert isinstance(fx["source"], dict) and fx["source"].get("author") and fx["source"].get("where")
    assert d["framework"] not in ("", "unknown") and d["framework_version"]
    assert d["gpu"] and d["metric"] and fx.get("setup_note")
    assert any(w in d["metric"] for w in METRIC_WORDS), "metric must say what was read"
    q = primary_quantity(fx)
    assert q in PEAKS and q in d["metric"] or q in ("phase:optimizer_step@1:allocated", "phase:model_loaded@0:peak")


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_fixture_model_and_setup_resolve(fx):
    opts = dict(fx["setup"])
    r = resolve(fx["model"], set=fx.get("overrides"), **opts)
    assert r.model.num_layers > 0 and r.training.batch_size >= 1
    if primary_quantity(fx) in ("peak_reserved", "device_used"):
        assert r.hardware is not None, "reserved and device memory need a GPU in the setup"


ACCELERATE_FSDP2 = (1, 6)  # accelerate's first release with FSDP2 (PR #3394, "Initial FSDP2 support", Mar 2025)


def test_fsdp_under_accelerate_before_fsdp2_is_fsdp1():
    """A run whose framework_version names an accelerate release without FSDP2 (before 1.6) and
    that shards with FSDP wrapped with FSDP1 ``FullyShardedDataParallel`` (accelerator.py
    ``prepare_model``): its setup must say ``fsdp_version 1`` (trainmem's default is FSDP2)."""
    import re
    checked = 0
    for fx in FIXTURES:
        m = re.search(r"accelerate (\d+)\.(\d+)", fx.get("framework_version", ""))
        if m and "fsdp" in fx["setup"] and (int(m.group(1)), int(m.group(2))) < ACCELERATE_FSDP2:
            assert fx["setup"].get("fsdp_version") == 1, os.path.basename(fx["_path"])
            checked += 1
    assert checked >= 1  # the fms-acceleration and fms-hf-tuning FSDP rows


def test_estimate_runs_on_every_published_fixture():
    v = validate(PUBLISHED, ["estimate"])
    assert v.not_run == []
    primary = [c for c in v.checks if c.primary]
    assert len(primary) == len(FIXTURES)
    assert all(c.predicted is not None and c.predicted > 0 for c in primary)
    s = summary(v.checks)["estimate"]
    assert set(s["frameworks"]) == {framework(fx) for fx in FIXTURES}
    assert sum(int(f["n"]) for f in s["frameworks"].values()) == len(FIXTURES) == s["overall"]["n"]
    assert sum(int(f["n"]) for f in s["sources"].values()) == len(FIXTURES)
    for st in list(s["frameworks"].values()) + [s["overall"]]:
        assert 0 <= st["within_5pct"] <= st["n"] and st["median"] <= st["p90"] <= st["max"]


@pytest.mark.slow
def test_trace_runs_or_says_why_not():
    v = validate(PUBLISHED, ["trace"])
    ran = {c.case for c in v.checks}
    skipped = {n.case for n in v.not_run}
    assert ran and ran.isdisjoint(skipped) and len(ran | skipped) == len(FIXTURES)
    assert all(n.reason and "\n" not in n.reason for n in v.not_run)
    assert all(c.predicted is not None for c in v.checks if c.primary)
