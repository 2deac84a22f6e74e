"""Seed 003: BERT-large fp32 sequence classification, eager attention, batch 4 x 512, AdamW,
traced for CUDA, against the per-phase ``torch.cuda`` numbers the notebook printed.

Allocated (MiB) after: model loaded 1279.25, forward 1 7930.20, backward 1 2574.77, optimizer step 1
5133.26, zero_grad 1 3854.01, forward 2 10496.82, backward 2 5133.26, optimizer step 2 5133.26,
zero_grad 2 3854.01; peak 10562.79. The notebook's print function calls ``gc.collect()`` and
``torch.cuda.empty_cache()`` first, so its reserved values (1290, 8244, 2972, 5154, 3994, 10926,
5570, 5570, 3994 MiB) are compared with a trace of the same loop.
"""
from __future__ import annotations

import gc
import time

import pytest
import torch

import trainmem
from trainmem.trace.api import trace

MiB = 1024 * 1024
OVERRIDES = ['architectures=["BertForSequenceClassification"]']
SEED_ALLOCATED = {("model_loaded", 0): 1279.25, ("forward", 1): 7930.20, ("backward", 1): 2574.77,
                  ("optimizer_step", 1): 5133.26, ("zero_grad", 1): 3854.01, ("forward", 2): 10496.82,
                  ("backward", 2): 5133.26, ("optimizer_step", 2): 5133.26, ("zero_grad", 2): 3854.01}
SEED_RESERVED = {"model_loaded": 1290, "forward1": 8244, "backward1": 2972, "step1": 5154, "zero_grad1": 3994,
                 "forward2": 10926, "backward2": 5570, "step2": 5570, "zero_grad2": 3994}
SEED_PEAK = 10562.79


@pytest.fixture(scope="module")
def catalogue_trace():
    t0 = time.perf_counter()
    r = trace("bert-large-uncased", overrides=OVERRIDES, batch_size=4, seq_len=512, precision="fp32",
              attention="eager", optimizer="adamw")
    return r, time.perf_counter() - t0


def test_phases_match_seed(catalogue_trace):
    report, runtime = catalogue_trace
    print(f"\nBERT-large trace: {runtime:.1f}s")
    for (name, step), seed in SEED_ALLOCATED.items():
        got = report.phase(name, step).allocated / MiB
        print(f"  {name:15s} step {step}: trace {got:9.2f} MiB  seed {seed:9.2f} MiB  ({got - seed:+.2f})")
        assert abs(got - seed) / seed < 0.005
        assert abs(got - seed) < 0.02     # in fact to the printed 0.01 MiB


def test_peak_matches_seed(catalogue_trace):
    report, _ = catalogue_trace
    peak = report.peak_allocated / MiB
    print(f"\npeak: trace {peak:.2f} MiB, seed {SEED_PEAK} MiB ({peak - SEED_PEAK:+.2f}) at {report.peak_phase}: "
          f"{report.peak_where}")
    assert abs(peak - SEED_PEAK) / SEED_PEAK < 0.005
    # seed: the peak is in the second backward, in the last encoder layer
    assert report.peak_phase == "backward@2"
    assert "encoder.layer.23" in report.peak_where


def test_report_contents(catalogue_trace):
    report, _ = catalogue_trace
    cats = report.by_category()
    assert cats["parameters"] == 335_143_938 * 4          # BertForSequenceClassification, 2 labels
    assert cats["optimizer_states"] == 2 * cats["parameters"]
    assert cats["workspace"] == 2 * 8_519_680
    # dropout masks are bool (1 byte): 16 heads x 4 x 512 x 512 per layer
    assert report.component("activations.bert.encoder.layer.*.attention.self.native_dropout") == \
        24 * (4 * 16 * 512 * 512 * (4 + 1))
    assert sum(c.bytes for c in report.components) == report.peak_allocated
    assert report.extra["timeline"][-1][1] == report.phase("zero_grad", 2).allocated
    assert report.peak_reserved >= report.peak_allocated
    assert report.source == "trace"
    d = report.to_dict()
    assert d["phases"][0]["name"] == "model_loaded"


def test_reserved_with_the_notebooks_loop():
    """The notebook's own loop, with gc.collect() + empty_cache() before every print."""
    spec = trainmem.resolve_model("bert-large-uncased", overrides=OVERRIDES)

    def factory():
        import transformers
        cfg = transformers.AutoConfig.for_model("bert", **{k: v for k, v in spec.config.items() if k != "model_type"})
        return transformers.BertForSequenceClassification._from_config(cfg, attn_implementation="eager")

    log: dict[str, tuple[int, int]] = {}

    def snap(name: str) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        log[name] = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())

    def step(model, optimizer, i):
        if i == 1:
            snap("model_loaded")
        batch = {"input_ids": torch.randint(100, 30000, (4, 512)).to("cuda"),
                 "labels": torch.zeros(4, dtype=torch.long).to("cuda")}
        loss = model(**batch).loss
        snap(f"forward{i}")
        loss.backward()
        snap(f"backward{i}")
        optimizer.step()
        snap(f"step{i}")
        optimizer.zero_grad()
        snap(f"zero_grad{i}")

    trace(factory, step, steps=2, optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5))
    print()
    for name, seed in SEED_RESERVED.items():
        alloc, res = log[name]
        print(f"  {name:12s} allocated {alloc / MiB:9.2f}  reserved {res / MiB:7.0f} MiB  seed {seed} "
              f"({(res / MiB - seed) / seed:+.2%})")
        assert abs(res / MiB - seed) / seed < 0.03
    assert log["model_loaded"][1] == 1290 * MiB and log["forward1"][1] == 8244 * MiB
