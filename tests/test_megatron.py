"""Megatron-LM's GPT as the published CI runs it (validation/published/megatron_ci_*): its loss
(``--loss vocab-parallel``, Megatron's ``_VocabParallelCrossEntropy``), grouped key/value heads on a
GPT-2-shaped layer (``_trainmem.num_kv_heads``) and what tensor parallelism leaves whole on every rank
(learned position tables, row-parallel biases)."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.spec import TrainingSpec
from trainmem.spec.config import resolve_model
from trainmem.spec.resolve import resolve
from trainmem.estimate.states import _tp_div

pytest.importorskip("transformers")
from trainmem.measure.runner import measure  # noqa: E402
from trainmem.trace import trace  # noqa: E402

TINY = dict(set=["n_layer=2", "n_embd=256", "n_head=4"], seq_len=256, batch_size=2)
TINY_LLAMA = dict(set=["num_hidden_layers=2", "hidden_size=256", "intermediate_size=512", "num_attention_heads=4",
                       "num_key_value_heads=2", "head_dim=64", "vocab_size=32000"], seq_len=256, batch_size=2)


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp", "fp32"])
@pytest.mark.parametrize("model,base", [("gpt2", TINY), ("llama-3.2-1b", TINY_LLAMA)], ids=["gpt2", "llama"])
def test_vocab_parallel_loss_estimate_agrees_with_trace(model, base, precision, one_torch_thread):
    # trace runs Megatron's autograd Function (workload.VocabParallelCrossEntropy) on the model's logits:
    # with half logits the peak is the loss's forward, the half logits beside the one fp32 copy it makes;
    # with fp32 ones the head's backward, its weight gradient beside the fp32 logits gradient (the softmax)
    e = trainmem.estimate(model, expandable_segments=True, precision=precision, loss="vocab-parallel", **base)
    r = trace(model, device="cuda", expandable_segments=True, precision=precision, loss="vocab-parallel", **base)
    assert e.peak_allocated == pytest.approx(r.peak_allocated, rel=0.002)
    assert e.peak_where == ("cross_entropy.backward" if precision == "fp32" else "cross_entropy")
    est = {(p.name, p.step): p for p in e.phases}
    for p in r.phases:
        assert est[(p.name, p.step)].allocated == pytest.approx(p.allocated, rel=0.015), (p.name, p.step)


def test_vocab_parallel_trace_is_the_real_cpu_run(one_torch_thread):
    r = trace("gpt2", device="cpu", loss="vocab-parallel", **TINY)
    m = measure("gpt2", device="cpu", loss="vocab-parallel", **TINY)
    assert [(p.name, p.step, p.allocated) for p in r.phases] == [(p.name, p.step, p.allocated) for p in m.phases]


def test_vocab_parallel_keeps_one_fp32_softmax_not_two_gradients():
    """Against transformers' upcast loss (fp32 copy freed, fp32 log-probabilities saved, two fp32
    gradients in backward), Megatron's saves the one fp32 copy it made and hands on its gradient in
    place: the backward peak loses two fp32 logits tensors and gains one bf16 one."""
    kw = dict(seq_len=2048, batch_size=2, precision="bf16", set=["vocab_size=256000"])
    up = trainmem.estimate("llama-3.2-1b", loss="upcast", **kw)
    vp = trainmem.estimate("llama-3.2-1b", loss="vocab-parallel", **kw)
    logits = 2 * 2048 * 256000
    assert up.phase("forward", 2).peak - vp.phase("forward", 2).peak == 4 * logits  # the upcast's freed copy
    assert up.phase("backward", 2).peak - vp.phase("backward", 2).peak == 2 * 4 * logits - 2 * logits


def test_megatron_preset_computes_its_own_loss():
    assert resolve("gpt2", framework="megatron").training.loss == "vocab-parallel"
    assert resolve("gpt2", framework="megatron", loss="upcast").training.loss == "upcast"
    with pytest.raises(TrainmemError, match="--loss-chunks 4 needs"):
        TrainingSpec(loss="vocab-parallel", loss_chunks=4)


def test_trace_refuses_vocab_parallel_over_tensor_parallel_ranks():
    with pytest.raises(TrainmemError, match="--loss vocab-parallel"):
        trace("llama-3.2-1b", loss="vocab-parallel", tp=2, **TINY_LLAMA)


GQA_GPT = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 512, "n_layer": 2, "n_head": 8,
           "vocab_size": 1024, "n_positions": 1024, "tie_word_embeddings": False, "_trainmem": {"num_kv_heads": 2}}


def test_grouped_kv_heads_on_a_gpt2_layer():
    m = resolve_model(GQA_GPT)
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (8, 2, 64)
    c_attn = [p for p in m.parameter_tensors() if p.name == "h.0.attn.c_attn.weight"][0]
    assert c_attn.shape == (512, 512 + 2 * 2 * 64)   # Megatron's linear_qkv: (heads + 2 groups) x head_dim
    mha = resolve_model({**GQA_GPT, "_trainmem": {}})
    n = lambda s: sum(p.numel for p in s.parameter_tensors())
    assert mha.num_kv_heads == 8 and n(mha) - n(m) == 2 * (512 + 1) * 2 * 6 * 64
    small = trainmem.estimate(GQA_GPT, seq_len=1024, batch_size=2, precision="bf16", attention="flash")
    whole = trainmem.estimate({**GQA_GPT, "_trainmem": {}}, seq_len=1024, batch_size=2, precision="bf16",
                              attention="flash")
    assert small.peak_allocated < whole.peak_allocated
    with pytest.raises(TrainmemError, match="num_kv_heads"):
        trace(GQA_GPT, seq_len=128, batch_size=1)


def test_tensor_parallel_keeps_position_table_and_row_biases_whole():
    m = resolve_model("gpt2")
    by = {p.name: p for p in m.parameter_tensors()}
    assert _tp_div(by["wpe.weight"], 4) == by["wpe.weight"].numel          # LanguageModelEmbedding's nn.Embedding
    assert _tp_div(by["h.0.attn.c_proj.bias"], 4) == 768                   # RowParallelLinear's bias
    assert _tp_div(by["h.0.mlp.c_proj.bias"], 4) == 768
    assert _tp_div(by["h.0.attn.c_attn.bias"], 4) == 3 * 768 // 4          # column-parallel: split
    assert _tp_div(by["h.0.mlp.c_fc.weight"], 4) == 768 * 3072 // 4
    assert _tp_div(by["wte.weight"], 4) == -(-50257 * 768 // 4)            # VocabParallelEmbedding


# ----- Megatron-LM's interleaved pipeline schedule --------------------------------------------------
from trainmem.estimate.schedules import in_flight_at_backwards, megatron_rank_order, rank_order  # noqa: E402


def test_megatron_interleaved_order_by_hand():
    # pp 2, 2 chunks a rank, 2 micro-batches, rank 1: table (0,c0) (1,c0) (0,c1) (1,c1); warm-up
    # (2 - 1 - 1) * 2 + (2 - 1) * 2 = 2 forwards; each steady step a forward, then the backward of the
    # table's k-th entry with its chunk reversed; the cool-down backwards
    assert megatron_rank_order(2, 2, 2, 1) == (("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("B", 1, 0), ("F", 1, 1),
                                               ("B", 1, 1), ("B", 0, 0), ("B", 0, 1))
    # rank 0: 2 * 1 + 2 = 4 warm-up forwards, all of them: every forward first
    assert [k for k, _, _ in megatron_rank_order(2, 2, 2, 0)] == ["F"] * 4 + ["B"] * 4


@pytest.mark.parametrize("pp,local,micro", [(4, 8, 4), (4, 2, 8), (2, 3, 6), (4, 2, 12)])
def test_megatron_interleaved_order_is_torchs_for_whole_groups(pp, local, micro):
    # with micro-batches a multiple of pp (the only counts Megatron runs with its default group of pp)
    # its table and torch's ScheduleInterleaved1F1B give every rank the same actions
    for rank in range(pp):
        assert megatron_rank_order(pp, local, micro, rank) == rank_order(pp, local, micro, rank)


def test_megatron_interleaved_last_rank_keeps_29_layer_pairs():
    """gpt3_7b_tp1_pp4_memory_speed: 32 layers, pp 4, one layer a virtual stage (8 chunks a rank),
    4 micro-batches: the last rank forwards 28 pairs in warm-up and one more before its first
    backward (its head chunk's first micro-batch): 29 one-layer pairs and one loss in flight."""
    assert in_flight_at_backwards(4, 8, 4, 3, 7, megatron=True)[0] == 29
    assert in_flight_at_backwards(4, 8, 4, 0, None, megatron=True)[0] == 32
    from trainmem.estimate.engine import estimate_stage
    gpt = {**GQA_GPT, "n_layer": 8, "vocab_size": 4096}
    r = trainmem.estimate(gpt, framework="megatron", precision="bf16", batch_size=1, seq_len=512, pp=2, grad_accum=2,
                          pp_schedule="interleaved-1f1b", pp_virtual_stages=2, attention="flash")
    last = estimate_stage(r.model, r.training, "last")
    layers = sum(c.bytes for c in last.components if c.name.startswith("activations.layers."))
    # pp 2, 2 chunks of 2 layers, 2 micro-batches, rank 1: 3 pairs in flight at its first backward
    assert in_flight_at_backwards(2, 2, 2, 1, 1, megatron=True)[0] == 3
    assert layers == 3 * 2 * last.extra["activations_per_layer"]
    # the chunk outputs are freed once sent, and the loss keeps one fp32 softmax
    assert not any(c.name.startswith("pipeline") for c in last.components)
    assert sum(c.bytes for c in last.components if c.name == "logits.log_probs") == 512 * 4096 * 4


# ----- Megatron-LM's DDP: fp32 main gradients under --bf16 -------------------------------------------
@pytest.mark.parametrize("precision,grad_bytes", [("bf16", 4), ("fp16", 2), ("fp32", 4)])
def test_megatron_ddp_keeps_its_gradient_buffer_from_wrap(precision, grad_bytes):
    """Megatron's DDP makes one contiguous gradient buffer at wrap (fp32 under --bf16, where
    arguments.py sets accumulate_allreduce_grads_in_fp32; the weights' dtype under --fp16 and fp32),
    with or without the distributed optimizer."""
    r = trainmem.estimate("gpt2", framework="megatron", precision=precision, seq_len=512, batch_size=2)
    n = sum(p.numel for p in r.model.parameter_tensors())
    grads = next(c for c in r.components if c.name == "gradients")
    assert grads.bytes == pytest.approx(n * grad_bytes, rel=0.005)   # (each tensor in 512-byte blocks)
    assert grads.dtype == ("fp32" if grad_bytes == 4 else "fp16")
    plain = trainmem.estimate("gpt2", precision=precision, seq_len=512, batch_size=2, optimizer_impl="fused")
    # the buffer exists before the first forward (the plain loop's gradients appear in backward)
    loaded = r.phase("model_loaded", 0).allocated - plain.phase("model_loaded", 0).allocated
    assert loaded >= n * grad_bytes
    assert not [w for w in r.training.extra["framework_warnings"] if "main gradients" in w]


def test_megatron_ddp_has_no_bucket_copies():
    # PyTorch DDP keeps flat buckets beside the gradients; Megatron's all-reduces the buffer in place
    torch_ddp = trainmem.estimate("gpt2", precision="bf16", seq_len=512, batch_size=2, dp=4)
    megatron = trainmem.estimate("gpt2", framework="megatron", precision="bf16", seq_len=512, batch_size=2, dp=4)
    assert any(c.name == "communication.ddp_buckets" for c in torch_ddp.components)
    assert not any(c.name.startswith("communication") for c in megatron.components)


# ----- --pp-stage: the rank a measurement was logged on -------------------------------------------
def test_pp_stage_reports_the_rank_asked_for():
    kw = dict(framework="megatron", precision="bf16", seq_len=1024, batch_size=4, pp=4, grad_accum=4)
    worst = trainmem.estimate("gpt2", **kw)
    first = trainmem.estimate("gpt2", pp_stage="first", **kw)
    last = trainmem.estimate("gpt2", pp_stage="last", **kw)
    assert (first.extra["pipeline_stage"], last.extra["pipeline_stage"]) == ("first", "last")
    assert worst.peak_allocated == max(first.peak_allocated, last.peak_allocated)
    assert first.peak_allocated != last.peak_allocated
    with pytest.raises(TrainmemError, match="pp_stage|pp-stage"):
        TrainingSpec(pp=2, pp_stage="middle")
    assert "--pp-stage last without --pp: one stage is every rank, so it changes nothing" in \
        trainmem.estimate("gpt2", pp_stage="last").warnings


def test_fit_and_plan_refuse_one_stage_and_sweep_names_it():
    """fit and plan judge a run by its worst pipeline stage; --pp-stage (one stage's rank) is refused
    there, and a sweep of one stage says so in its title and JSON."""
    from trainmem.plan import fit, plan, sweep
    kw = dict(framework="megatron", precision="bf16", gpu="h100-80gb")
    with pytest.raises(TrainmemError, match="^fit --pp-stage last: a run fits only when its worst"):
        fit("gpt2", seq_len=1024, pp=4, pp_stage="last", **kw)
    with pytest.raises(TrainmemError, match="^plan --pp-stage first: a run fits only when its worst"):
        plan("gpt2", gpus=8, global_batch=16, pp_stage="first", **kw)
    assert plan("gpt2", gpus=8, global_batch=16, pp_stage="worst", **kw).top   # the default is allowed
    one = sweep("gpt2", "1,2", "512", pp=4, grad_accum=4, pp_stage="last", **kw)
    worst = sweep("gpt2", "1,2", "512", pp=4, grad_accum=4, **kw)
    assert "the last pipeline stage's rank only" in one.render()
    assert one.to_dict()["pipeline_stage"] == "last" and worst.to_dict()["pipeline_stage"] is None
    assert "pipeline stage" not in worst.render()
    assert one.grid() != worst.grid()   # the last stage of GPT-2 under PP 4 is not the worst one
