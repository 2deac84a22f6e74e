"""Mixture-of-experts routing imbalance (--moe-imbalance) and expert parallelism (--ep), docs/moe.md."""
import json

import pytest
import torch
import transformers
from gloo_ranks import run_ranks

import trainmem
from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.estimate.layers import ep_rank_rows, layer_coefficients
from trainmem.estimate.quantities.model_facts import layer_key
from trainmem.estimate.states import model_states
from trainmem.measure.live import LiveBytes
from trainmem.spec import TrainingSpec, resolve_model
from trainmem.trace.api import trace

# a small Mixtral: 4 layers, hidden 256, MLP 512, 4 experts, top-2
MIXTRAL = ["num_hidden_layers=4", "hidden_size=256", "intermediate_size=512", "num_attention_heads=4",
           "num_key_value_heads=2", "vocab_size=512", "num_local_experts=4", "num_experts_per_tok=2"]
L, H, FF, E, K = 4, 256, 512, 4, 2


def _est(**kw):
    return trainmem.estimate("mixtral-8x7b", set=MIXTRAL, **{"batch_size": 4, "seq_len": 512, **kw})


def _experts_bytes(r) -> int:
    """Saved bytes of the expert side (the rows the experts run on), summed over the layers."""
    return sum(c.bytes for c in r.components if c.name.startswith("activations.layers.experts."))


# ----- the routing imbalance on one rank ------------------------------------------------------------
def _real_step_peak(skewed: bool, implementation: str) -> int:
    """Peak live CPU bytes of a real forward + backward of a tiny transformers Mixtral whose router
    sends every token to experts 0 and 1 (``skewed``: the busiest expert gets E/k = 2x the mean, the
    most top-2 routing allows) or spreads the tokens evenly (each expert 1x the mean)."""
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                     num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    model.config._experts_implementation = implementation

    def route(self, hidden_states):  # MixtralTopKRouter.forward with the expert choice fixed
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        t = torch.arange(hidden_states.shape[0])
        idx = torch.stack([t * 0, t * 0 + 1], 1) if skewed else torch.stack([t % 4, (t + 1) % 4], 1)
        top = probs.gather(1, idx)
        return logits, top / top.sum(-1, keepdim=True), idx

    for layer in model.model.layers:
        layer.mlp.gate.forward = route.__get__(layer.mlp.gate)
    ids = torch.randint(0, 128, (2, 32))
    with LiveBytes() as live:
        model(input_ids=ids, labels=ids).loss.backward()
    return live.peak


def test_grouped_mm_experts_do_not_depend_on_the_routing():
    """transformers' default experts (``grouped_mm``) hold b*s*k rows whatever the routing: the real
    step's peak is the same with every token on two experts as with an even spread. The per-expert
    loop (``eager``) is not: the check can tell them apart."""
    assert _real_step_peak(True, "grouped_mm") == _real_step_peak(False, "grouped_mm")
    assert _real_step_peak(True, "eager") != _real_step_peak(False, "eager")


def test_imbalance_without_ep_changes_nothing_and_says_so():
    base, skewed = _est(precision="bf16"), _est(precision="bf16", moe_imbalance=2.0)
    assert skewed.peak_allocated == base.peak_allocated
    assert [(c.name, c.bytes) for c in skewed.components] == [(c.name, c.bytes) for c in base.components]
    assert any("--moe-imbalance 2" in w and "changes nothing" in w for w in skewed.warnings)
    assert not any("moe-imbalance" in w for w in base.warnings)


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp"])
def test_estimate_matches_trace_with_and_without_imbalance(precision):
    """The estimate's MoE layer against the traced transformers Mixtral (grouped_mm), within 0.5%;
    the imbalance on one rank changes neither."""
    kw = dict(batch_size=4, seq_len=512, precision=precision)
    tr = trace("mixtral-8x7b", set=MIXTRAL, expandable_segments=True, **kw)
    tr2 = trace("mixtral-8x7b", set=MIXTRAL, expandable_segments=True, moe_imbalance=2.0, **kw)
    est = _est(**kw)
    assert abs(est.peak_allocated - tr.peak_allocated) <= 0.005 * tr.peak_allocated
    assert tr2.peak_allocated == tr.peak_allocated and tr2.training.moe_imbalance == 2.0


# ----- expert parallelism -----------------------------------------------------------------------------
def _busiest_rank_rows(tokens: int, top_k: int, experts: int, ep: int, imbalance: float) -> int:
    """Route ``ep`` ranks' tokens explicitly: expert 0 gets ``imbalance`` x the mean (capped at one
    pair per token), the other experts on its rank the mean, the rest spread over the other ranks'
    experts; return the pairs rank 0 receives. Independent of ``ep_rank_rows``' algebra."""
    pairs = ep * tokens * top_k
    mean = pairs // experts
    load = [0] * experts
    load[0] = min(int(imbalance * mean), ep * tokens)
    local = experts // ep
    for e in range(1, local):
        load[e] = mean
    rest, others = pairs - sum(load[:local]), list(range(local, experts))
    for i, e in enumerate(others):  # what is left, evenly over the other ranks' experts
        load[e] = rest // len(others) + (i < rest % len(others))
    if not others:
        load[0] += pairs - sum(load)
    assert sum(load) == pairs and min(load) >= 0
    return sum(load[:local])


@pytest.mark.parametrize("experts, top_k, ep, f", [(8, 2, 2, 1.0), (8, 2, 4, 2.0), (8, 2, 8, 3.0), (8, 2, 8, 9.0),
                                                   (64, 8, 8, 1.5), (4, 2, 4, 2.0), (8, 1, 2, 1.0)])
def test_busiest_rank_rows_match_an_explicit_routing(experts, top_k, ep, f):
    tokens = 4096
    assert ep_rank_rows(top_k, experts, ep, f) * tokens == _busiest_rank_rows(tokens, top_k, experts, ep, f)


def test_ep_one_runs_b_s_k_rows_whatever_the_imbalance():
    for f in (1.0, 1.5, 4.0, 100.0):
        assert ep_rank_rows(2, 8, 1, f) == 2


def _expert_row_bytes(w: int) -> int:
    """Bytes the expert side saves per received row (from the shapes, docs/moe.md): the gathered row
    (h), gate_up's masked output (2f), silu's output (f), the product (f), all in the weights' dtype
    ``w``; its unit routing weight (w), two int64 permutations and the bool sentinel mask."""
    return (H + 4 * FF) * w + w + 2 * 8 + 1


@pytest.mark.parametrize("precision, w", [("bf16", 2), ("bf16-amp", 4)])
def test_imbalance_raises_the_busiest_ranks_expert_activations(precision, w):
    tokens = 4 * 512
    base = _est(precision=precision, dp=4, ep=4)
    for f in (1.5, 2.0):
        r = _est(precision=precision, dp=4, ep=4, moe_imbalance=f)
        extra_rows = tokens * K * (f - 1) * 4 / E  # (F-1) x the mean expert load of the EP group
        assert _experts_bytes(r) - _experts_bytes(base) == L * extra_rows * _expert_row_bytes(w)
        assert r.peak_allocated - base.peak_allocated >= L * extra_rows * _expert_row_bytes(w)
    # without imbalance a rank's experts receive b*s*k rows, as the experts of one GPU do; per row they
    # keep unit weights in the rows' dtype (not fp32 routing weights, which need a gradient there), so
    # neither down's output nor the permutation that gathers the weights; and the sentinel mask besides
    one = _est(precision=precision)
    assert _experts_bytes(base) - _experts_bytes(one) == L * tokens * K * (-H * w + (w - 4) - 8 + 1)


def test_ep_divides_the_expert_states_exactly():
    m = resolve_model("mixtral-8x7b", overrides=MIXTRAL)
    expert = sum(p.numel for p in m.parameter_tensors() if p.role == "expert")
    assert expert == L * E * 3 * FF * H
    for ep in (2, 4):
        a, b = (model_states(m, TrainingSpec(dp=4, ep=x, precision="bf16")) for x in (1, ep))
        cut = expert * (ep - 1) // ep
        assert a.grads - b.grads == cut * 2 and a.optimizer - b.optimizer == 2 * cut * 2
        assert a.weights - b.weights == cut * 2 and a.params_rank - b.params_rank == cut
    # sharded states: the EP ranks hold different experts, each sharded over dp/ep: the same 1/dp per rank
    a, b = (model_states(m, TrainingSpec(dp=4, ep=x, fsdp="full", precision="bf16")) for x in (1, 4))
    assert (a.weights, a.grads, a.optimizer) == (b.weights, b.grads, b.optimizer)
    assert a.layer_params_full - b.layer_params_full == (E - 1) * 3 * FF * H * 2  # gathers one expert, not four


@pytest.mark.parametrize("options, says", [
    (dict(dp=4, ep=3), "--ep 3 does not divide the 4 experts per layer"),
    (dict(dp=2, ep=4), "--ep 4 does not divide the 2 data-parallel ranks"),
    (dict(ep=2), "--ep 2 does not divide the 1 data-parallel ranks"),
    (dict(dp=8, ep=4, fsdp="hybrid", fsdp_node_size=2), "--ep 4 does not divide the 2 ranks of the FSDP sharding"),
    (dict(dp=4, ep=2, tp=2), "--ep 2 with --tp/--pp/--cp > 1 is not modelled"),
    (dict(moe_imbalance=0.5), "--moe-imbalance must be a number >= 1"),
])
def test_layout_refusals_are_one_line(options, says):
    with pytest.raises(TrainmemError) as e:
        _est(**options)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("model, options, says", [
    ("llama-3.2-1b", dict(dp=2, ep=2), "--ep 2 needs a mixture-of-experts model"),
    ("llama-3.2-1b", dict(moe_imbalance=2.0), "has no experts to route to"),
    ("qwen3-30b-a3b", dict(dp=2, ep=2), "--ep 2 is not modelled for the trace-fitted MoE layers"),
])
def test_models_without_hand_written_moe_refuse_ep(model, options, says):
    with pytest.raises(TrainmemError) as e:
        trainmem.estimate(model, **options)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_cli_exit_codes(capsys):
    assert main(["estimate", "mixtral-8x7b", "--dp", "6", "--ep", "3"]) == 2
    assert "--ep 3 does not divide the 8 experts" in capsys.readouterr().err
    assert main(["estimate", "mixtral-8x7b", "--moe-imbalance", "0.5"]) == 2
    assert main(["plan", "mixtral-8x7b", "--gpus", "8", "--global-batch", "8", "--gpu", "h100", "--ep", "2"]) == 2
    assert "plan --ep" in capsys.readouterr().err
    assert main(["estimate", "mixtral-8x7b", "--dp", "8", "--ep", "8", "--moe-imbalance", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"ep": 8' in out and '"moe_imbalance": 2.0' in out


def test_trace_and_measure_refuse_ep_in_one_line():
    from trainmem.workload import check_supported
    with pytest.raises(TrainmemError) as e:
        trace("mixtral-8x7b", set=MIXTRAL, dp=2, ep=2)
    assert "--ep 2" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TrainmemError, match="--ep 2"):
        check_supported(TrainingSpec(dp=2, ep=2), "measure")


def test_lora_on_expert_parallel_experts_is_refused():
    with pytest.raises(TrainmemError, match="--lora-targets experts with --ep 2"):
        _est(dp=2, ep=2, lora_rank=8, lora_targets="experts")
    assert _est(dp=2, ep=2, lora_rank=8).training.ep == 2  # peft's defaults (q_proj, v_proj) are not experts


def test_ep_shows_in_the_setup_line():
    from trainmem.render.table import setup_parts
    parts = setup_parts(_est(dp=4, ep=4, moe_imbalance=2.0))
    assert any("ep=4" in p for p in parts) and any("moe-imbalance" in p for p in parts)


def test_imbalance_is_capped_at_every_token():
    """Top-k routing picks an expert at most once per token, so an expert sees at most every token of
    the EP group: imbalances above E/k give the same load."""
    a, b = _est(dp=4, ep=4, moe_imbalance=2.0), _est(dp=4, ep=4, moe_imbalance=50.0)
    assert a.peak_allocated == b.peak_allocated
    assert ep_rank_rows(2, 4, 4, 2.0) == ep_rank_rows(2, 4, 4, 50.0) == 4.0


# ----- the expert-parallel layer against transformers' AllToAllEP on two gloo ranks ---------------------
EP_SCRIPT = r"""
import json, sys, warnings
import torch, torch.distributed as dist
warnings.filterwarnings("ignore")
rank, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2)
import transformers
transformers.logging.set_verbosity_error()
from torch.distributed.device_mesh import init_device_mesh
from transformers.distributed.expert_parallel import AllToAllEP
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "tp"))
T, H, FF, E, K = 64, 32, 48, 4, 2
result = {}
for dtype in ("float32", "bfloat16"):
    for pattern in ("even", "skewed"):
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=FF, num_local_experts=E,
                                         num_experts_per_tok=K)
        cfg._experts_implementation = "grouped_mm"
        torch.manual_seed(0)
        ex = MixtralExperts(cfg).to(getattr(torch, dtype))
        # this rank's E/2 experts, as MoEParamShard (Shard(0)) leaves them, and its expert count
        ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.data[2 * rank:2 * rank + 2].clone())
        ex.down_proj = torch.nn.Parameter(ex.down_proj.data[2 * rank:2 * rank + 2].clone())
        ex.num_experts, ex._is_expert_parallel = 2, True
        ep = AllToAllEP(ex, mesh["ep"], mesh["tp"])
        x = torch.randn(T, H, dtype=getattr(torch, dtype), requires_grad=True)
        t = torch.arange(T)
        if pattern == "even":   # every expert gets the mean, T*K/E pairs from each rank
            idx = torch.stack([t % E, (t + 1) % E], 1)
        else:                   # expert 0 gets every token (2x the mean), expert 1 the mean, 2 and 3 the rest
            idx = torch.stack([t * 0, torch.where(t < T // 2, 1, torch.where(t < 3 * T // 4, 2, 3))], 1)
        w = torch.rand(T, K, requires_grad=True)
        skip = {p.untyped_storage().data_ptr() for p in (x, w, ex.gate_up_proj, ex.down_proj)}
        seen, saved = set(), [0]
        def pack(tensor):
            s = tensor.untyped_storage()
            if s.data_ptr() not in seen and s.data_ptr() not in skip:
                seen.add(s.data_ptr())
                saved[0] += s.nbytes()
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = ep(x, idx, w)
        y.float().sum().backward()
        result[f"{dtype}-{pattern}"] = saved[0]
with open(f"{out}.{rank}", "w") as f:
    json.dump(result, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def ep_saved(tmp_path_factory):
    """Bytes autograd saves in transformers' AllToAllEP forward on each of two gloo ranks (the inputs,
    routing weights and expert weights excluded), per dtype and routing pattern."""
    tmp = tmp_path_factory.mktemp("ep")
    out = tmp / "saved"
    run_ranks(tmp / "rank.py", EP_SCRIPT, out)
    return [json.loads((tmp / f"saved.{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize("precision, dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
@pytest.mark.parametrize("pattern, imbalance", [("even", 1.0), ("skewed", 2.0)])
def test_ep_layer_matches_all_to_all_ep(ep_saved, precision, dtype, pattern, imbalance):
    """The recipe's dispatch, expert and combine tensors (``_moe_ep``) against what transformers'
    AllToAllEP really saves on the busiest of two ranks: 64 tokens, hidden 32, MLP 48, 4 experts, top-2.
    The skewed routing is the one ``ep_rank_rows`` assumes (expert 0 at 2x the mean, expert 1 at the
    mean): rank 0 receives 192 rows, rank 1 64. Not counted: grouped_mm's int32 offsets (4 bytes per
    local expert, no token dependence)."""
    m = resolve_model("mixtral-8x7b", overrides=["hidden_size=32", "intermediate_size=48", "num_local_experts=4",
                                                 "num_experts_per_tok=2", "num_attention_heads=4",
                                                 "num_key_value_heads=2"])
    t = TrainingSpec(precision=precision, dp=2, ep=2, moe_imbalance=imbalance)
    coefs = layer_coefficients(layer_key(m, t))
    per_token = sum(a for name, a, _ in coefs.parts if name.startswith(("ep.", "experts.")))
    busiest = max(rank[f"{dtype}-{pattern}"] for rank in ep_saved)
    assert busiest - 2 * 4 == per_token * 64
