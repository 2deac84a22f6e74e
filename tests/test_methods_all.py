"""Every named method: runs on varied setups, integer bytes, documented functions."""
import inspect
from importlib import import_module

import pytest

import trainmem
from trainmem.estimate.methods import METHODS, get_method
from trainmem.spec import TrainingSpec

NAMES = [n for n in METHODS if n != "trainmem"]
SETUPS = [
    dict(batch_size=2, seq_len=256),
    dict(batch_size=1, seq_len=512, precision="fp32", optimizer="sgd-momentum", recompute="full"),
    dict(batch_size=2, seq_len=256, tp=2, sequence_parallel=True, recompute="selective", dp=4, zero=1),
    dict(batch_size=1, seq_len=128, dp=8, zero=3, optimizer="lion", pp=2),
    dict(batch_size=1, seq_len=128, dp=2, zero=2, offload_optimizer=True, optimizer="adafactor"),
    dict(batch_size=1, seq_len=128, precision="bf16", optimizer="adamw-8bit", optimizer_bucket_mb=1000.0, dp=2),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("model", ["nanogpt-124m", "bert-base-uncased", "llama-3.2-1b"])
def test_runs_with_integer_bytes(name, model):
    spec = trainmem.resolve_model(model)
    for kw in SETUPS:
        r = get_method(name)(spec, TrainingSpec(**kw))
        assert r.method == name and r.source == "estimate"
        assert isinstance(r.peak_allocated, int) and r.peak_allocated > 0
        for c in r.components:
            assert isinstance(c.bytes, int) and c.bytes >= 0 and c.formula and c.dtype
        for p in r.phases:
            assert isinstance(p.allocated, int) and isinstance(p.peak, int) and p.peak >= p.allocated
        assert r.peak_allocated == max(p.peak for p in r.phases)
        r.to_dict()


@pytest.mark.parametrize("name", NAMES)
def test_functions_documented(name):
    mod = import_module(METHODS[name])
    assert mod.__doc__
    for fname, fn in inspect.getmembers(mod, inspect.isfunction):
        if fn.__module__ == mod.__name__ and not fname.startswith("_"):
            assert fn.__doc__, f"{name}.{fname} has no docstring"
