"""Qwen3 (dense) under tensor parallelism: a derived family on one GPU, its hand-written Llama-family
twin with per-head q/k norms under --tp (``spec.config.tensor_parallel_twin``, ``ModelSpec.qk_norm``,
``estimate.layers._head_norm``), checked per rank against trace's DTensor run of torchtitan's Qwen3
plan (``wrappers.tp_layer_plan``: ``SequenceParallel(sequence_dim=2)`` on q_norm / k_norm)."""
from dataclasses import replace

import pytest

from trainmem import TrainmemError, estimate, resolve
from trainmem.estimate.layers import Policy, layer_coefficients
from trainmem.estimate.quantities.model_facts import layer_key
from trainmem.trace.api import trace

from test_trace_tp import GRID

#: a small Qwen3 whose every TP split is even: 8 heads, 4 KV heads of 32, untied head
SMALL = ["num_hidden_layers=2", "hidden_size=256", "num_attention_heads=8", "num_key_value_heads=4",
         "intermediate_size=1024", "vocab_size=4096", "head_dim=32", "tie_word_embeddings=false"]
BASE = {"batch_size": 2, "seq_len": 256, "precision": "bf16-amp"}


def _agree(**options):
    o = {**BASE, **options}
    e, r = estimate("qwen3-0.6b", set=SMALL, **o), trace("qwen3-0.6b", set=SMALL, **o)
    return (e.peak_allocated - r.peak_allocated) / r.peak_allocated


def test_qwen3_is_derived_on_one_gpu_and_its_hand_written_twin_under_tp():
    one, eight = resolve("qwen3-32b").model, resolve("qwen3-32b", tp=8).model
    assert one.family == "derived" and not one.qk_norm
    assert (eight.family, eight.qk_norm, eight.num_heads, eight.num_kv_heads, eight.head_dim) == \
        ("llama", True, 64, 8, 128)
    assert sum(p.numel for p in eight.parameter_tensors()) == sum(p.numel for p in one.parameter_tensors())
    norms = [p for p in eight.parameter_tensors() if p.layer == 0 and p.module in ("q_norm", "k_norm")]
    assert [p.shape for p in norms] == [(128,), (128,)] and all(p.role == "norm" for p in norms)
    assert resolve("qwen3-32b", tp=8).replace(tp=1).model == one  # back to the derived model
    assert not resolve("qwen2.5-7b", tp=2).model.qk_norm


@pytest.mark.parametrize("options, message", [
    (dict(set=["use_sliding_window=true", "max_window_layers=14"]), "without hand-written formulas"),
    (dict(cp=2), "without hand-written formulas"),
])
def test_what_has_no_twin_is_refused_in_one_line(options, message):
    with pytest.raises(TrainmemError, match=message) as e:
        estimate("qwen3-0.6b", tp=2, **options)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("precision", ["bf16-amp", "bf16", "fp32"])
@pytest.mark.parametrize("tp", [2, 4])
def test_head_norms_save_per_rank(precision, tp):
    """Each of q_norm and k_norm saves, per token and rank, its fp32 input (the projection's local
    width x 4 bytes: ``x.float()``, the projection itself in fp32 training, which nothing else
    saves), one fp32 rsqrt per local head, and the normalised tensor in the input's dtype (the
    projection's: the half type, fp32 in fp32 training)."""
    r = resolve("qwen3-0.6b", set=SMALL, tp=tp, precision=precision)
    k = layer_key(r.model, r.training)
    with_norms, without = layer_coefficients(k), layer_coefficients(replace(k, qk_norm=False))
    m, half = r.model, Policy.of(precision).half
    width, heads = (m.q_size + m.kv_size) / tp, (m.num_heads + m.num_kv_heads) / tp
    assert with_norms.tok - without.tok == width * 4 + heads * 4 + width * half


def test_each_rank_holds_whole_head_norms():
    """Under --tp the projections are split, q_norm and k_norm weights (head_dim,) are replicated:
    the estimate's parameters are the trace's DTensor local shards (fp32 training: 4 bytes each)."""
    e = estimate("qwen3-0.6b", set=SMALL, tp=2, **{**BASE, "precision": "fp32"})
    r = trace("qwen3-0.6b", set=SMALL, tp=2, **{**BASE, "precision": "fp32"})
    params = [sum(c.bytes for c in x.components if c.name == "parameters" or c.name.startswith("parameters."))
              for x in (e, r)]
    m = resolve("qwen3-0.6b", set=SMALL, tp=2).model  # the twin; every split below is even
    local = [4 * (p.numel if p.role == "norm" else p.numel // 2) for p in m.parameter_tensors()]
    # trace counts the tensors' bytes; the estimate's component their allocator blocks (512-byte
    # multiples: each (32,) norm's 128 bytes take 512)
    assert params[1] == sum(local) and params[0] == sum(-(-b // 512) * 512 for b in local)
    assert any(p.module == "q_norm" for p in m.parameter_tensors())


def test_qwen3_32b_takes_tp_8():
    one, eight = (estimate("qwen3-32b", tp=tp, batch_size=1, seq_len=4096, sequence_parallel=tp > 1)
                  for tp in (1, 8))
    assert eight.peak_allocated < one.peak_allocated / 4


@pytest.mark.parametrize("options", [dict(tp=2, sequence_parallel=True), dict(tp=4)])
def test_estimate_agrees_with_trace_fast(options):
    assert abs(_agree(**options)) <= 0.005


def test_the_twin_agrees_with_trace_on_one_gpu():
    """The hand-written formulas with the head norms at --tp 1 too (the estimate itself keeps the
    derived coefficients there): the twin run through the engine against trace."""
    from trainmem.estimate.engine import estimate as engine_estimate
    for options in (dict(), dict(precision="bf16", lora_rank=8), dict(recompute="full", seq_len=1024)):
        o = {**BASE, **options}
        twin = resolve("qwen3-0.6b", set=SMALL, tp=2, **o).model
        e = engine_estimate(twin, resolve("qwen3-0.6b", set=SMALL, **o).training)
        r = trace("qwen3-0.6b", set=SMALL, **o)
        assert abs(e.peak_allocated / r.peak_allocated - 1) <= 0.005, options


@pytest.mark.slow
@pytest.mark.parametrize("tp, sp, seq, precision, recompute", GRID)  # test_trace_tp's 32 setups
def test_estimate_agrees_with_trace(tp, sp, seq, precision, recompute):
    """Peak allocated within 0.5% on the 32 setups of docs/trace.md's tensor-parallel table, on Qwen3."""
    err = _agree(tp=tp, sequence_parallel=sp, seq_len=seq, precision=precision, recompute=recompute)
    assert abs(err) <= 0.005, f"{err:+.2%}"


def test_plan_runs_qwen3_under_tp_as_estimate_does():
    """plan evaluates layouts on arrays (``estimate_layouts``): Qwen3 at tp 1 as the derived model,
    above it as the twin, each layout byte for byte the scalar estimate; tp x cp stays refused."""
    from trainmem.plan import plan
    from trainmem.plan.planner import LAYOUT_FIELDS, REC_NAMES, Planner
    filters = {"tp": [1, 2, 4], "pp": [1, 2], "cp": [1, 2], "dp": None, "b": None, "ga": None, "zero": [0, 1],
               "rec": [0, 2]}
    P = Planner("qwen3-8b", 2048, 8, 0.5, None, None, filters, gpu="h100-80gb")
    a, rejected, mem, _, _ = P.evaluate(8, with_times=False)
    assert {1, 2, 4} <= set(a["tp"].tolist()) and not ((a["tp"] > 1) & (a["cp"] > 1)).any()
    assert any("twin is modelled without --cp" in why for _, why, _, _ in rejected)
    for i in range(len(a["tp"])):
        x = {k: int(a[k][i]) for k in LAYOUT_FIELDS}
        e = estimate("qwen3-8b", gpu="h100-80gb", seq_len=2048, tp=x["tp"], pp=x["pp"], cp=x["cp"], dp=x["dp"],
                     zero=x["zero"], recompute=REC_NAMES[x["rec"]], batch_size=x["b"], grad_accum=x["ga"],
                     sequence_parallel=x["tp"] > 1)
        assert int(mem["peak_allocated"][i]) == e.peak_allocated, x
    assert plan("qwen3-8b", 8, seq_len=2048, global_batch=8, gpu="h100-80gb", tp=2, cp=1).top
