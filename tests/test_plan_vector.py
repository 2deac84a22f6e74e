"""The vectorised layout memory equals trainmem.estimate for a sample of layouts (within 2%)."""
import random
from dataclasses import replace

import numpy as np
import pytest

import trainmem
from trainmem.estimate.states import block_bytes
from trainmem.plan.vector import REC_CODES, block_np, layout_memory
from trainmem.spec import TrainingSpec, get_gpu

RECS = {v: k for k, v in REC_CODES.items()}
H100 = get_gpu("h100")


def _sample(m, n, seed):
    rnd = random.Random(seed)
    rows = []
    while len(rows) < n:
        tp, pp, cp = rnd.choice([1, 2, 4, 8]), rnd.choice([1, 2, 4, 5]), rnd.choice([1, 2, 4])
        dp, b, ga = rnd.choice([1, 2, 8, 64]), rnd.choice([1, 2, 3]), rnd.choice([1, 2, 4, 16])
        zero = 0 if dp == 1 else (rnd.choice([0, 1, 2, 3]) if pp == 1 else rnd.choice([0, 1]))
        if m.num_heads % tp or (m.num_kv_heads % tp and tp % m.num_kv_heads) or m.num_layers % pp:
            continue
        rows.append((tp, pp, cp, dp, zero, rnd.choice([0, 1, 2]), b, ga))
    return rows


CASES = [
    ("llama-3.1-70b", TrainingSpec(), 4096),
    ("llama-3.1-70b", TrainingSpec(precision="bf16", optimizer="adamw-8bit", attention="flash"), 8192),
    ("mixtral-8x7b", TrainingSpec(optimizer_impl="fused", loss_chunks=4), 2048),
    ("llama-3.2-1b", TrainingSpec(precision="fp32", optimizer="sgd-momentum", optimizer_impl="for-loop",
                                  attention="eager"), 1024),
    ("gpt2", TrainingSpec(compile=True, optimizer="lion"), 1024),
    ("xlm-roberta-xl", TrainingSpec(optimizer="adafactor"), 512),
    ("qwen2.5-7b", TrainingSpec(precision="fp16", dropout=False), 2048),
]


@pytest.mark.parametrize("name,base,seq", CASES, ids=[f"{c[0]}-{c[1].precision}-{c[1].optimizer}" for c in CASES])
def test_vector_matches_estimate(name, base, seq):
    m = trainmem.resolve_model(name)
    rows = _sample(m, 12, hash(name) % 1000)
    out = layout_memory(m, base, seq, H100.context, *np.array(rows).T)
    for i, (tp, pp, cp, dp, zero, rec, b, ga) in enumerate(rows):
        t = replace(base, tp=tp, pp=pp, cp=cp, dp=dp, zero=zero, recompute=RECS[rec], batch_size=b,
                    grad_accum=ga, sequence_parallel=tp > 1, seq_len=seq)
        r = trainmem.estimate(m, training=t, gpu=H100)
        assert int(out["peak_allocated"][i]) == pytest.approx(r.peak_allocated, rel=0.02), rows[i]
        assert int(out["device_used"][i]) == pytest.approx(r.device_used, rel=0.02), rows[i]
        assert int(out["stage"][i]) == (1 if r.extra.get("pipeline_stage") == "last" else 0) or \
            abs(int(out["peak_allocated"][i]) - r.peak_allocated) < 0.02 * r.peak_allocated


def test_llama_is_byte_exact():
    # large tensors: the allocator's placement adds nothing, so the vectorised model is exact
    m = trainmem.resolve_model("llama-3.1-8b")
    rows = _sample(m, 20, 7)
    out = layout_memory(m, TrainingSpec(), 2048, H100.context, *np.array(rows).T)
    for i, (tp, pp, cp, dp, zero, rec, b, ga) in enumerate(rows):
        r = trainmem.estimate(m, gpu=H100, tp=tp, pp=pp, cp=cp, dp=dp, zero=zero, recompute=RECS[rec],
                              batch_size=b, grad_accum=ga, sequence_parallel=tp > 1, seq_len=2048)
        assert (int(out["peak_allocated"][i]), int(out["device_used"][i])) == (r.peak_allocated, r.device_used)


def test_block_np_matches_block_bytes():
    xs = [0, 1, 511, 512, 513, 1 << 20, (1 << 20) + 1, 10 << 20, (10 << 20) + 1, (11 << 20) + 5, 125018112,
          (13 << 20) + (1 << 19), 3 << 30]
    assert block_np(np.array(xs)).tolist() == [block_bytes(x) for x in xs]


def test_unsupported_settings_are_refused():
    m = trainmem.resolve_model("gpt2")
    one = [np.array([1])] * 8
    for t in (TrainingSpec(lora_rank=8), TrainingSpec(offload_optimizer=True), TrainingSpec(fsdp="full"),
              TrainingSpec(optimizer_in_backward=True)):
        with pytest.raises(NotImplementedError):
            layout_memory(m, t, 512, 0, *one)
