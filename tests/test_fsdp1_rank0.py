"""FSDP1 shards a unit's flat parameter into contiguous chunks, so rank 0's optimizer sees the first
parameters of each unit whole and nothing of the last ones (``use_orig_params=True``). The estimate's
reserved-memory replay allocates rank 0's optimizer states with those sizes
(``states.fsdp1_rank0_items``); here they are checked against the parameters real FSDP1 hands the
optimizer on rank 0 of the fake process group (trace)."""
from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import trainmem.workload as workload  # noqa: E402
from trainmem.allocator_rules import block_bytes  # noqa: E402
from trainmem.estimate.states import model_states  # noqa: E402
from trainmem.spec.resolve import resolve  # noqa: E402
from trainmem.trace.api import trace  # noqa: E402

#: 2 layers whose parameters do not divide evenly among the ranks' chunks
SMALL = ["num_hidden_layers=2", "hidden_size=256", "num_attention_heads=4", "num_key_value_heads=2",
         "intermediate_size=768", "vocab_size=1000", "head_dim=64", "tie_word_embeddings=false"]
OPTS = dict(batch_size=2, seq_len=64, precision="bf16-mp", fsdp="full", fsdp_version=1)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_rank0_states_follow_the_flat_parameter_chunks(monkeypatch, dp):
    seen: list[int] = []
    make = workload.make_optimizer

    def recording(t, params, *a, **kw):
        seen.extend(p.numel() for p in params)
        return make(t, params, *a, **kw)

    monkeypatch.setattr(workload, "make_optimizer", recording)
    trace("llama-3.2-1b", set=SMALL, dp=dp, steps=1, **OPTS)
    traced = Counter(block_bytes(n * 4) for n in seen if n)           # fp32 exp_avg, one per parameter
    r = resolve("llama-3.2-1b", set=SMALL, dp=dp, **OPTS)
    items = model_states(r.model, r.training).trainables
    replayed, empty = Counter(), 0
    for _where, k, _g, sts, _m in items:
        if sts and sts[0]:
            replayed[sts[0]] += k
        elif sts:
            empty += k
    assert replayed == traced
    # rank 0 holds nothing of a unit's last parameters (not a 1/dp share of each)
    assert empty == seen.count(0) > 0
