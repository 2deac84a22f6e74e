"""torchtitan's per-op selective activation checkpointing (--recompute op) and torchtune's activation
offloading (--offload-activations): the estimate against trace, which runs the real policy
(torch.utils.checkpoint with create_selective_checkpoint_contexts) and the real hooks
(saved_tensors_hooks) on the transformers model.

Trace runs with expandable segments: every tensor is then charged its own 512-byte-rounded block,
which is what the estimate counts (with the default caching allocator a block reused without a
split adds its remainder, a state of the allocator no formula follows)."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.spec.resolve import resolve
from trainmem.trace.api import trace

LLAMA = ["num_hidden_layers=2", "hidden_size=256", "intermediate_size=768", "num_attention_heads=4",
         "num_key_value_heads=2", "vocab_size=512"]
DEEP = ["num_hidden_layers=4"] + LLAMA[1:]


def _pair(set_, **kw):
    return (trainmem.estimate("llama-3.2-1b", set=set_, **kw),
            trace("llama-3.2-1b", set=set_, expandable_segments=True, **kw))


def _forward_end(r):
    return next(p.allocated for p in r.phases if p.name == "forward" and p.step == 1)


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp"])
def test_op_recompute_estimate_matches_trace(precision):
    est, tr = _pair(LLAMA, batch_size=2, seq_len=1024, precision=precision, recompute="op")
    assert abs(est.peak_allocated - tr.peak_allocated) <= 0.005 * tr.peak_allocated, \
        (est.peak_allocated, tr.peak_allocated)


def test_op_recompute_counts_matmuls_without_bias():
    """Qwen2's q/k/v linears have biases (addmm, not on torchtitan's list): only o, gate, up, down
    are counted, so the policy saves o and up; the estimate follows the same count."""
    est = trainmem.estimate("qwen2.5-0.5b", set=LLAMA, batch_size=2, seq_len=512, precision="bf16", recompute="op")
    tr = trace("qwen2.5-0.5b", set=LLAMA, batch_size=2, seq_len=512, precision="bf16", recompute="op",
               expandable_segments=True)
    assert abs(est.peak_allocated - tr.peak_allocated) <= 0.005 * tr.peak_allocated


def test_activations_order_none_op_full():
    """At the end of forward (activations and autocast copies alive, nothing back-propagated):
    no recompute keeps most, op less, full least, in the estimate and in trace alike."""
    ends = {}
    for rec in ("none", "op", "full"):
        est, tr = _pair(LLAMA, batch_size=2, seq_len=512, precision="bf16", recompute=rec)
        ends[rec] = (_forward_end(est), _forward_end(tr))
    for i in (0, 1):
        assert ends["none"][i] > ends["op"][i] > ends["full"][i], ends
    # the op policy's saved outputs, estimate against trace; the flash kernel's two RNG-state outputs
    # (philox seed and offset, a 512-byte block each per layer) are what the estimate leaves out
    assert 0 <= (ends["op"][1] - ends["full"][1]) - (ends["op"][0] - ends["full"][0]) <= 2 * 2 * 512


def test_trace_runs_the_selective_policy():
    """The workload's policy is torchtitan's: of a Llama layer's seven aten.mm calls (q, k, v, o,
    gate, up, down) the odd ones are saved, and no other op of the layer is (CPU: SDPA is not a
    fused kernel there)."""
    from trainmem.workload import hf_factory, hf_step
    r = resolve("llama-3.2-1b", set=DEEP, batch_size=2, seq_len=64, precision="fp32", recompute="op")
    model = hf_factory(r.model, r.training)()
    model.train()
    _, step = hf_step(model, r.model, r.training, "cpu")
    step(1)
    policy = step.checkpoint_policy
    assert policy.saved("aten.mm.default") == 4 * 4
    assert policy.decisions[("aten.mm.default", "recompute", "forward")] == 3 * 4
    saved_ops = {op for op, what, _ in policy.decisions if what == "save"}
    assert saved_ops == {"aten.mm.default"}


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp"])
def test_offload_estimate_matches_trace_and_lowers_the_peak(precision):
    kw = dict(batch_size=4, seq_len=1024, precision=precision, recompute="full")
    est, tr = _pair(DEEP, offload_activations=True, **kw)
    assert abs(est.peak_allocated - tr.peak_allocated) <= 0.01 * tr.peak_allocated
    est_full, tr_full = _pair(DEEP, **kw)
    assert tr.peak_allocated < tr_full.peak_allocated and est.peak_allocated < est_full.peak_allocated
    # at the end of forward no checkpointed input is left on the GPU: four layers' inputs fewer
    stream = 2 if precision == "bf16" else 4
    assert _forward_end(tr_full) - _forward_end(tr) == 4 * 4 * 1024 * 256 * stream


@pytest.mark.parametrize("options, names", [
    ({"recompute": "op", "recompute_every": 2}, "--recompute-every"),
    ({"recompute": "op", "lora_rank": 8}, "--recompute op"),
    ({"offload_activations": True}, "--offload-activations"),
    ({"offload_activations": True, "recompute": "op"}, "--offload-activations"),
    ({"offload_activations": True, "recompute": "full", "recompute_every": 2}, "--offload-activations"),
])
def test_combinations_trainmem_cannot_honour_are_refused(options, names):
    with pytest.raises(TrainmemError) as e:
        trainmem.estimate("llama-3.2-1b", **options)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_offload_is_refused_for_families_it_does_not_model():
    with pytest.raises(TrainmemError, match="--offload-activations"):
        trainmem.estimate("gpt2", recompute="full", offload_activations=True)


def test_torchtune_preset_accepts_offloading():
    r = resolve("llama-3.2-1b", framework="torchtune", recompute="full", offload_activations=True)
    assert r.training.offload_activations and r.training.recompute == "full"
    assert not resolve("llama-3.2-1b", framework="torchtune").training.offload_activations


MIXTRAL = ["num_hidden_layers=4", "hidden_size=256", "intermediate_size=512", "num_attention_heads=4",
           "num_key_value_heads=2", "vocab_size=512", "num_local_experts=4", "num_experts_per_tok=2"]


def test_mixtral_op_and_offload_against_trace():
    """A MoE layer: the policy counts q, k, v, o and the router's mm (the experts run _grouped_mm).
    Offloading raises this peak: the bottom layer's first backward node (the expert combine) still
    holds the next layer's input, brought back for its recompute; the estimate follows by the byte."""
    kw = dict(batch_size=4, seq_len=512, precision="bf16")
    est_op = trainmem.estimate("mixtral-8x7b", set=MIXTRAL, recompute="op", **kw)
    tr_op = trace("mixtral-8x7b", set=MIXTRAL, recompute="op", expandable_segments=True, **kw)
    assert abs(est_op.peak_allocated - tr_op.peak_allocated) <= 0.005 * tr_op.peak_allocated
    est, tr = {}, {}
    for off in (False, True):
        est[off] = trainmem.estimate("mixtral-8x7b", set=MIXTRAL, recompute="full", offload_activations=off, **kw)
        tr[off] = trace("mixtral-8x7b", set=MIXTRAL, recompute="full", offload_activations=off,
                        expandable_segments=True, **kw)
    assert tr[True].peak_allocated - tr[False].peak_allocated == 4 * 512 * 256 * 2  # one bf16 layer input
    assert est[True].peak_allocated - est[False].peak_allocated == 4 * 512 * 256 * 2


@pytest.mark.parametrize("options, names", [({"recompute": "op"}, "--recompute op"),
                                            ({"recompute": "full", "offload_activations": True},
                                             "--offload-activations")])
def test_plan_refuses_what_its_layouts_do_not_cover(options, names):
    from trainmem.plan.planner import plan
    with pytest.raises(TrainmemError) as e:
        plan("llama-3.2-1b", gpus=8, global_batch=64, gpu="h100", **options)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_suggest_offers_per_op_recompute_between_selective_and_full():
    from trainmem.plan.suggest import suggest
    names = [s.name for s in suggest("llama-3.2-1b", batch_size=8, seq_len=4096, gpu="a10g")]
    assert "recompute-op" in names


@pytest.mark.parametrize("attention, kv_heads, op", [
    ("sdpa", 2, "aten._scaled_dot_product_flash_attention.default"),
    ("sdpa-efficient", 4, "aten._scaled_dot_product_efficient_attention.default"),
    ("sdpa-cudnn", 2, "aten._scaled_dot_product_cudnn_attention.default"),
])
def test_emulated_sdpa_kernels_are_on_the_save_list(monkeypatch, attention, kv_heads, op):
    """Under trace's CUDA emulation each SDPA backend runs the aten op a GPU runs, which torchtitan's
    save list names: the policy saves one per layer and forward (2 layers x 2 steps)."""
    import trainmem.checkpointing as ck
    seen = []
    init = ck.OpCheckpointPolicy.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        seen.append(self)
    monkeypatch.setattr(ck.OpCheckpointPolicy, "__init__", record)
    cfg = [s if not s.startswith("num_key_value_heads") else f"num_key_value_heads={kv_heads}" for s in LLAMA]
    trace("llama-3.2-1b", set=cfg, batch_size=1, seq_len=256, precision="bf16", recompute="op", attention=attention)
    assert seen and seen[0].saved(op) == 2 * 2


@pytest.mark.parametrize("method", ["eleuther", "korthikanti", "nemo"])
def test_published_methods_refuse_what_they_have_no_formula_for(method):
    for options, names in (({"recompute": "op"}, "--recompute op"),
                           ({"recompute": "full", "offload_activations": True}, "--offload-activations")):
        with pytest.raises(TrainmemError, match=names):
            trainmem.estimate("llama-3.2-1b", method=method, **options)
