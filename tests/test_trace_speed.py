"""trace's speed-only patches of DTensor's sharding propagation (``trace.distributed._speed_patches``:
a foreach op's strategy expanded once per distinct shard spec, the strided-shard scan once per
schema) change nothing in a report: the same small FSDP2 traces, with and without them, give the
same report to the byte (every component, phase, peak, the largest tensors, the timeline and the
allocator's statistics). The first trace of a setup in a process sees a few more ops (DTensor's
process-wide caches filling), so each setup is traced once before the two compared. The speed itself is a benchmark (``benchmarks/bench_trace.py``), not a test."""
import pytest

from trainmem.trace import distributed as dist_mod
from trainmem.trace.api import trace

# 4 identical decoder layers, so the optimizer's foreach ops see repeated shard specs
TINY = ["num_hidden_layers=4", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
        "intermediate_size=128", "vocab_size=1000", "head_dim=16"]
BASE = {"batch_size": 2, "seq_len": 64}


def _comparable(report):
    d = report.to_dict()
    d["extra"].pop("runtime_s")
    return d


@pytest.mark.parametrize("options", [
    {"dp": 4, "fsdp": "full", "precision": "bf16-amp"},
    {"dp": 2, "fsdp": "grad-op", "precision": "bf16-mp", "recompute": "full"},
    {"dp": 2, "fsdp": "full", "tp": 2, "sequence_parallel": True, "precision": "bf16"},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_speed_patches_leave_the_report_unchanged(options, monkeypatch):
    taken = []
    groups = dist_mod._foreach_groups

    def counted(*args):
        out = groups(*args)
        if out is not None:
            taken.append((len(out[0]), len(out[1])))
        return out
    monkeypatch.setattr(dist_mod, "_foreach_groups", counted)
    trace("llama-3.2-1b", set=TINY, **BASE, **options)
    taken.clear()
    fast = trace("llama-3.2-1b", set=TINY, **BASE, **options)
    # the deduplicated path ran: fewer distinct specs than tensors in the optimizer's foreach ops
    assert taken and all(distinct < n for distinct, n in taken)
    monkeypatch.setattr(dist_mod, "_speed_patches", lambda: {})
    slow = trace("llama-3.2-1b", set=TINY, **BASE, **options)
    assert _comparable(fast) == _comparable(slow)
