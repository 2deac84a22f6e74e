"""Mechanisms of the default method beyond the seeds' cases."""
import trainmem
from trainmem.estimate.states import model_states
from trainmem.spec import TrainingSpec, resolve_model

GiB = 2**30


def test_distributed_optimizer_bucket_warning_names_the_right_size():
    r = trainmem.estimate("nemo-gpt-1b", tp=4, dp=2, seq_len=8192, precision="bf16", distributed_optimizer=True,
                          optimizer_bucket_mb=200, recompute="selective", sequence_parallel=True, attention="flash")
    m = resolve_model("nemo-gpt-1b")
    right = 4 * m.num_params / (m.num_layers * 4) / 2**20
    assert any("exceeds one layer" in w and f"{right:.0f} MiB" in w for w in r.warnings), r.warnings
    ok = trainmem.estimate("nemo-gpt-1b", tp=4, dp=2, seq_len=8192, precision="bf16", distributed_optimizer=True,
                           optimizer_bucket_mb=right * 0.9, recompute="selective", sequence_parallel=True,
                           attention="flash")
    assert not ok.warnings


def test_zero_stages_shard_states_grads_weights():
    m = resolve_model("llama-3.2-1b")
    base = dict(precision="bf16-amp", dp=8)
    s0, s1, s2, s3 = (model_states(m, TrainingSpec(zero=z, **base)) for z in range(4))
    assert s1.optimizer * 7 < s0.optimizer          # states / 8 (plus per-tensor rounding)
    assert s1.grads == s0.grads and s2.grads * 7 < s0.grads
    assert s2.weights == s0.weights and s3.weights * 7 < s0.weights


def test_offload_moves_optimizer_states_off_the_gpu():
    r = trainmem.estimate("llama-3.2-1b", precision="bf16", zero=2, dp=8, offload_optimizer=True)
    assert r.component("optimizer_states") == 0 and r.component("master_weights") == 0


def test_lora_trains_only_adapters():
    full = trainmem.estimate("llama-3.2-1b", precision="bf16", batch_size=1, seq_len=512)
    lora = trainmem.estimate("llama-3.2-1b", precision="bf16", batch_size=1, seq_len=512, lora_rank=16)
    m = resolve_model("llama-3.2-1b")
    # peft defaults for llama: q_proj and v_proj, r x (in + out) each
    expected = m.num_layers * 16 * ((m.hidden_size + m.q_size) + (m.hidden_size + m.kv_size))
    st = model_states(m, TrainingSpec(precision="bf16", lora_rank=16))
    assert st.trainable == expected
    assert lora.phase("optimizer_step", 2).allocated < full.phase("optimizer_step", 2).allocated / 2


def test_optimizer_in_backward_drops_the_gradients_and_lowers_the_peak():
    opts = dict(precision="bf16", batch_size=1, seq_len=512)
    std = trainmem.estimate("llama-3.2-1b", **opts)
    oib = trainmem.estimate("llama-3.2-1b", optimizer_in_backward=True, **opts)
    assert oib.peak_allocated < std.peak_allocated
    assert oib.phase("backward", 2).allocated < std.phase("backward", 2).allocated


def test_pipeline_reports_the_worst_stage_and_first_stage_holds_pp_microbatches():
    r = trainmem.estimate("llama-2-7b", pp=4, grad_accum=8, seq_len=4096, precision="bf16", zero=1, dp=2)
    assert r.extra["pipeline_stage"] in ("first", "last")
    from trainmem.estimate.engine import estimate_stage
    m = resolve_model("llama-2-7b")
    t1 = TrainingSpec(pp=4, grad_accum=8, seq_len=4096, precision="bf16")
    t2 = TrainingSpec(pp=4, grad_accum=8, seq_len=4096, precision="bf16", num_microbatches_in_flight=1)
    a, b = estimate_stage(m, t1, "first"), estimate_stage(m, t2, "first")
    acts = lambda r: r.phase("forward.micro1", 1).allocated  # noqa: E731
    assert acts(a) > acts(b)


def test_tensor_parallel_divides_activations_and_sequence_parallel_divides_more():
    base = dict(precision="bf16", seq_len=4096, attention="flash")
    t1 = trainmem.estimate("llama-2-7b", **base).extra["activations_per_layer"]
    t4 = trainmem.estimate("llama-2-7b", tp=4, **base).extra["activations_per_layer"]
    sp = trainmem.estimate("llama-2-7b", tp=4, sequence_parallel=True, **base).extra["activations_per_layer"]
    meg = trainmem.estimate("llama-2-7b", tp=4, sequence_parallel=True, framework="megatron",
                            **base).extra["activations_per_layer"]
    assert meg < sp < t4 < t1
    assert abs(meg * 4 / t1 - 1) < 0.02  # Megatron-LM's SP: everything split over the 4 ranks
    # PyTorch's plan (trace checks it, tests/test_trace_tp.py): the q/k/v and the gate/up linears each
    # share and save the all-gathered (b, s, h) bf16 input instead of Megatron's (b, s/4, h) shard
    assert sp - meg == 2 * (4096 * 4096 * 2) * 3 // 4


def test_flash_removes_the_quadratic_term():
    eager = trainmem.estimate("llama-3.2-1b", precision="bf16-amp", seq_len=2048, attention="eager")
    flash = trainmem.estimate("llama-3.2-1b", precision="bf16-amp", seq_len=2048, attention="flash")
    m = resolve_model("llama-3.2-1b")
    # eager keeps an fp32 softmax and a bf16 copy per head and key: 6 bytes x b x heads x s^2 per layer
    diff = eager.extra["activations_per_layer"] - flash.extra["activations_per_layer"]
    assert diff >= 6 * m.num_heads * 2048 * 2048


def test_periodic_load_simulation_equals_the_full_allocator_simulation(monkeypatch):
    """The model-load placement extrapolates repeating layers and forgets dead remainders; it must
    give exactly what the caching-allocator simulation of the whole sequence gives (with expandable
    segments too, where there are no remainders)."""
    from trainmem.estimate import states
    from trainmem.allocator import CachingAllocator
    exact = states._placed_bytes.__wrapped__
    checked = []

    def compare(before, layer, layers, after, expandable=False):
        a = CachingAllocator(expandable_segments=expandable)
        for x in before + layer * layers + after:
            a.allocate(x)
        got = exact(before, layer, layers, after, expandable)
        checked.append((got, a.allocated))
        return got

    monkeypatch.setattr(states, "_placed_bytes", compare)
    for name in ("nanogpt-124m", "bert-large-uncased", "llama-2-70b", "mixtral-8x7b", "qwen2.5-1.5b"):
        for kw in (dict(), dict(precision="bf16"), dict(tp=2), dict(zero=3, dp=8), dict(expandable_segments=True)):
            states._STATES_CACHE.clear()
            states.model_states(resolve_model(name), TrainingSpec(**kw))
    states._STATES_CACHE.clear()
    assert len(checked) == 25
    assert all(got == want for got, want in checked), checked
