"""FSDP1's ``ShardingStrategy.NO_SHARD`` (``--fsdp no-shard --fsdp-version 1``): every rank holds each
unit's whole flat parameter, its whole gradient (all-reduced in place, torch 2.13
``fsdp/_runtime_utils.py`` ``_reduce_grad_no_shard`` L932-949) and the optimizer states of the whole
model; it is what FSDP1 itself runs at world size 1 (``fsdp/_init_utils.py`` L430-438). Against
plain DDP over the same ranks the one difference trainmem models is DDP's bucket buffers."""
import pytest

from trainmem import estimate
from trainmem.errors import TrainmemError
from trainmem.trace.api import trace

TINY = ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
        "intermediate_size=128", "vocab_size=1000", "head_dim=16"]
NO_SHARD = {"fsdp": "no-shard", "fsdp_version": 1}


def _components(r):
    return {c.name: c.bytes for c in r.components}


@pytest.mark.parametrize("options", [
    {"precision": "bf16-amp"}, {"precision": "bf16"},
    {"precision": "bf16", "lora_rank": 16, "recompute": "full"},
    {"precision": "bf16", "lora_rank": 16, "quantize": "nf4-dq"},
])
def test_no_shard_is_ddp_without_its_buckets(options):
    """Same parameters, gradients, optimizer states and activations as DDP over the same ranks;
    DDP's bucket buffers (a second copy of the gradients, ``gradient_as_bucket_view=False``) are
    absent, and the peak is lower by exactly them."""
    o = {"batch_size": 2, "seq_len": 512, **options}
    ns = estimate("llama-3.2-1b", dp=4, **NO_SHARD, **o)
    ddp = estimate("llama-3.2-1b", dp=4, **o)
    a, d = _components(ns), _components(ddp)
    buckets = d.pop("communication.ddp_buckets")
    assert buckets > 0 and a == d
    assert ddp.peak_allocated - ns.peak_allocated == buckets


def test_no_shard_is_fsdp1_at_world_size_one():
    """FSDP1 switches every strategy to NO_SHARD over one rank: the estimate over 8 ranks is the
    estimate over one, and does not depend on --dp."""
    o = {"batch_size": 2, "seq_len": 512, "precision": "bf16-mp", "lora_rank": 16, "fsdp_version": 1}
    one = estimate("llama-3.2-1b", fsdp="full", dp=1, **o)
    for dp in (2, 8):
        ns = estimate("llama-3.2-1b", fsdp="no-shard", dp=dp, **o)
        assert (ns.peak_allocated, ns.peak_reserved) == (one.peak_allocated, one.peak_reserved)
        assert _components(ns) == _components(one)
    assert not any("changes nothing" in w for w in estimate("llama-3.2-1b", dp=2, **NO_SHARD).warnings)


def test_no_shard_refused_under_fsdp2():
    with pytest.raises(TrainmemError) as e:
        estimate("llama-3.2-1b", fsdp="no-shard", dp=2)
    assert "\n" not in str(e.value) and "--fsdp-version 1" in str(e.value)


def test_trace_runs_fsdp1_no_shard():
    """trace wraps the model in FullyShardedDataParallel(sharding_strategy=NO_SHARD) on the fake group:
    the step is the one FSDP1 runs over one rank, and the estimate agrees with it within 0.1 %."""
    o = {"batch_size": 2, "seq_len": 64, "precision": "bf16-amp", "fsdp_version": 1}
    ns = trace("llama-3.2-1b", set=TINY, fsdp="no-shard", dp=2, **o)
    one = trace("llama-3.2-1b", set=TINY, fsdp="full", dp=1, **o)
    assert (ns.peak_allocated, ns.peak_reserved) == (one.peak_allocated, one.peak_reserved)
    assert not any("fsdp" in c.name and c.name.startswith("communication") for c in ns.components)
    est = estimate("llama-3.2-1b", set=TINY, fsdp="no-shard", dp=2, **o)
    assert abs(est.peak_allocated - ns.peak_allocated) <= 0.001 * ns.peak_allocated
