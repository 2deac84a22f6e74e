"""plan: layouts consistent with the cluster, the ones that fit, ranked; rejections explained; the
smallest cluster named when nothing fits; seed 002's ZeRO x checkpointing walk."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.plan import plan
from trainmem.plan.timing import TERMS

GiB = 2**30


@pytest.fixture(scope="module")
def big():
    return plan("llama-3.1-70b", 512, seq_len=4096, global_batch=1024, gpu="a100-80gb", top=5)


def test_layouts_are_consistent_and_fit(big):
    m = trainmem.resolve_model("llama-3.1-70b")
    assert big.valid > 5000 and 0 < big.fitting < big.valid and len(big.top) == 5
    for x in big.top:
        assert x.dp * x.tp * x.pp * x.cp == 512 and x.dp * x.micro_batch * x.grad_accum == 1024
        assert m.num_heads % x.tp == 0 and m.ffn_size % x.tp == 0 and m.num_layers % x.pp == 0 and 4096 % x.cp == 0
        assert not (x.pp > 1 and x.zero >= 2)
        # the shown numbers are the scalar estimator's
        r = trainmem.estimate(m, gpu="a100-80gb", seq_len=4096, **x.options())
        assert (x.device_used, x.fits) == (r.device_peak, True) and x.margin == r.margin
        assert x.step_time == pytest.approx(sum(x.times[k] for k in TERMS))
    times = [x.step_time for x in big.top]
    assert times == sorted(times)
    assert all(x.why for x in big.top[:-1]) and not big.top[-1].why


def test_explain_lists_rejections(big):
    reasons = " | ".join(f"{w}: {r} ({n} {u})" for w, r, n, u in big.rejected)
    assert "does not divide the 80 layers" in reasons and "attention heads" in reasons
    assert "ZeRO-2/3" in reasons and "(15 shapes)" in reasons  # pp=32: 15 (tp, cp) splits of 512 GPUs
    text = big.render(explain=True)
    assert "why the other layouts were rejected" in text and "need more than" in text
    assert "by parallel shape" in text and "why the best beat the next" in text
    assert sum(s["layouts"] for s in big.shapes) == big.valid
    assert sum(s["fitting"] for s in big.shapes) == big.fitting


def test_time_model_terms():
    r = plan("llama-3.1-8b", 16, seq_len=2048, global_batch=64, gpu="h100", tp=2, pp="1,2", cp=1, zero="0,1",
             recompute="none,full", all_layouts=True, top=50)
    by = {(x.pp, x.zero, x.recompute, x.micro_batch): x for x in r.rows}
    a, b = by[(2, 1, "none", 1)], by[(2, 1, "none", 2)]
    # pipeline bubble: compute x (pp-1)/m, m = micro-batches per step
    assert a.times["bubble"] == pytest.approx((a.times["compute"] + a.times["recompute"]) / a.grad_accum)
    assert b.grad_accum * 2 == a.grad_accum and b.times["bubble"] == pytest.approx(2 * a.times["bubble"])
    assert by[(1, 0, "none", 1)].times["bubble"] == 0
    full, none = by[(1, 0, "full", 1)], by[(1, 0, "none", 1)]
    assert full.times["recompute"] > 0 == none.times["recompute"]
    assert full.times["compute"] == none.times["compute"]
    assert by[(1, 1, "none", 1)].times["dp_comm"] == none.times["dp_comm"]   # ZeRO-1 moves what DDP moves


def test_nothing_fits_names_the_smallest_cluster():
    r = plan("llama-3.1-70b", 8, seq_len=4096, global_batch=64, gpu="a100-40gb")
    assert r.fitting == 0 and not r.top
    n = r.smallest_cluster
    assert n and n > 8 and r.smallest_layout.fits
    lay = r.smallest_layout
    assert lay.dp * lay.tp * lay.pp * lay.cp == n
    again = plan("llama-3.1-70b", n, seq_len=4096, global_batch=64, gpu="a100-40gb", top=1)
    assert again.top
    text = r.render()
    assert "NOTHING FITS" in text and f"smallest cluster that fits: {n}" in text


XLMR = dict(seq_len=512, global_batch=512, batch_size=8, tp=1, pp=1, cp=1, zero="1,2,3", recompute="none,full",
            all_layouts=True, top=6)


def _fit_table(method, gpu):
    r = plan("xlm-roberta-xl", 64, gpu=gpu, method=method, **XLMR)
    assert r.valid == 6 and len(r.rows) == 6
    return {(x.zero, x.recompute): (x.device_used, x.fits) for x in r.rows}


def test_seed002_walk_zero_calc():
    # seed 002: XLM-RoBERTa-XL, 64 GPUs, batch 8 per GPU, sequence 512, ZeRO 1/2/3 x checkpointing.
    # With the model's real 3.48B parameters every row fits an 80 GB A100 (seed: "feasible with A100").
    t80 = _fit_table("zero-calc", "a100-80gb")
    assert all(f for _, f in t80.values())
    # device = allocated + 500 MiB context; zero-calc's stage-1 figure: 2pP + 12P/N + activations
    from trainmem.estimate.methods import zero_calc
    P = trainmem.resolve_model("xlm-roberta-xl").num_params
    act = zero_calc.activation_bytes(36, 512, 8, 2560, 32, 2)
    assert t80[(1, "none")][0] == zero_calc.model_state_bytes(P, 64, 2, 1) + act + 500 * 2**20


def test_seed002_walk_trainmem():
    t80 = _fit_table("trainmem", "a100-80gb")
    t40 = _fit_table("trainmem", "a100-40gb")
    assert all(f for _, f in t80.values())
    # on a 40 GB A100, stage 1 or 2 without checkpointing does not fit; checkpointing or stage 3 does
    assert {k for k, (_, f) in t40.items() if not f} == {(1, "none"), (2, "none")}
    assert t80[(3, "full")][0] < t80[(1, "full")][0] < t80[(1, "none")][0]


def test_bad_input():
    with pytest.raises(TrainmemError, match="global-batch"):
        plan("gpt2", 8, gpu="h100")
    with pytest.raises(TrainmemError, match="needs a GPU"):
        plan("gpt2", 8, global_batch=8)
    with pytest.raises(TrainmemError, match="--fsdp"):
        plan("gpt2", 8, global_batch=8, gpu="h100", fsdp="full")
    with pytest.raises(TrainmemError, match="--zero 5"):
        plan("gpt2", 8, global_batch=8, gpu="h100", zero="5")
    with pytest.raises(TrainmemError, match="learned positions"):
        plan("gpt2", 8, seq_len=4096, global_batch=8, gpu="h100")


def test_lora_goes_through_the_engine_on_arrays():
    r = plan("llama-3.2-1b", 8, seq_len=1024, global_batch=16, gpu="l4", lora_rank=8, tp="1,2", pp=1, cp=1,
             zero="0,1", recompute="none")
    assert r.vectorised and r.top
    x = r.top[0]
    e = trainmem.estimate("llama-3.2-1b", gpu="l4", seq_len=1024, lora_rank=8, **x.options())
    assert x.device_used == e.device_peak


def test_scalar_path_for_other_methods():
    r = plan("llama-3.2-1b", 8, seq_len=1024, global_batch=16, gpu="l4", method="korthikanti", tp="1,2", pp=1,
             cp=1, zero="0,1", recompute="none")
    assert not r.vectorised and r.top
    x = r.top[0]
    e = trainmem.estimate("llama-3.2-1b", gpu="l4", seq_len=1024, method="korthikanti", **x.options())
    assert x.device_used == e.device_peak
