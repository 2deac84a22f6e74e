"""Pipeline parallelism traced on torch.distributed.pipelining's own code in one process
(trace.distributed, wrappers.PipelineStageModule, workload.PipelineTrainStep): each stage a rank of a
fake process group running PipelineStage + Schedule1F1B; the first and the last stage traced; the
estimate checked against each stage."""
import pytest

from trainmem import estimate
from trainmem.errors import TrainmemError
from trainmem.estimate.engine import estimate_stage
from trainmem.spec.resolve import resolve
from trainmem.trace.api import trace

#: llama-3.2-1b's shape, cut down: 4 layers (2 per stage at --pp 2), untied head (vocab 4096)
SMALL = ["num_hidden_layers=4", "hidden_size=256", "num_attention_heads=8", "num_key_value_heads=4",
         "intermediate_size=1024", "vocab_size=4096", "head_dim=32", "tie_word_embeddings=false"]
#: the same with 8 layers (2 per stage at --pp 4)
EIGHT = ["num_hidden_layers=8"] + SMALL[1:]
BASE = {"batch_size": 2, "seq_len": 256}
#: estimate vs trace, each stage's peak allocated. Measured on these shapes (docs/trace.md, pipeline
#: section): -0.35% to +0.58% over pp 2 and 4, 1 and 2 micro-batches per stage, fp32 / bf16 /
#: bf16-amp, recompute none / full
TOLERANCE = 0.01


def _stages(overrides, **options):
    """{rank: (trace's peak allocated of that rank, estimate's peak allocated of its stage)} for the
    traced ranks of the first and the last stage."""
    r = trace("llama-3.2-1b", set=overrides, **BASE, **options)
    res = resolve("llama-3.2-1b", set=overrides, **BASE, **options)
    traced = {e["rank"]: (e["pipeline_stage"], e["peak_allocated"]) for e in r.extra["ranks"] if e["traced"]}
    pp = res.training.pp
    return r, {k: (v, estimate_stage(res.model, res.training, "first" if st == 0 else "last").peak_allocated)
               for k, (st, v) in traced.items() if st in (0, pp - 1)}


@pytest.mark.parametrize("overrides, options", [
    (SMALL, {"pp": 2, "grad_accum": 2, "precision": "bf16-amp"}),
    (SMALL, {"pp": 2, "grad_accum": 4, "precision": "fp32", "recompute": "full"}),
    (EIGHT, {"pp": 4, "grad_accum": 4, "precision": "bf16"}),
], ids=["pp2-ga2-amp", "pp2-ga4-fp32-full", "pp4-ga4-bf16"])
def test_each_traced_stage_agrees_with_the_estimate(overrides, options):
    r, stages = _stages(overrides, **options)
    assert sorted(stages) == [0, options["pp"] - 1]
    for stage, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (stage, traced, est)
    # the report is the worst traced stage's, and the estimate reports its worst stage too
    assert r.peak_allocated == max(t for t, _ in stages.values())
    worst = estimate("llama-3.2-1b", set=overrides, **BASE, **options)
    assert abs(worst.peak_allocated / r.peak_allocated - 1) < TOLERANCE


@pytest.mark.parametrize("options", [
    {"precision": "bf16-amp"}, {"precision": "bf16", "recompute": "full"},
], ids=["amp", "bf16-full"])
def test_tensor_parallel_stages_agree_with_the_estimate(options):
    """--pp 2 --tp 2: each stage tensor-parallel over a (pp, tp) mesh of 4 fake ranks; tp rank 0 of the
    first and of the last stage traced (ranks 0 and 2), each within 1% of the estimate's stage (measured:
    first +0.49% to +0.90%, last -0.54% to -0.10% over fp32 / bf16 / bf16-amp, recompute none / full)."""
    setup = {**BASE, "pp": 2, "tp": 2, "grad_accum": 2, **options}
    r = trace("llama-3.2-1b", set=SMALL, **setup)
    res = resolve("llama-3.2-1b", set=SMALL, **setup)
    ranks = r.extra["ranks"]
    assert [e["rank"] for e in ranks] == [0, 1, 2, 3] and r.extra["traced_ranks"] == [0, 2]
    assert [e["pipeline_stage"] for e in ranks] == [0, 0, 1, 1]
    assert "tensor-parallel rank of a traced stage" in ranks[1]["not_traced"] == ranks[3]["not_traced"]
    single = trace("llama-3.2-1b", set=SMALL, **{**setup, "tp": 1})
    for e in ranks[0], ranks[2]:
        stage = "first" if e["pipeline_stage"] == 0 else "last"
        est = estimate_stage(res.model, res.training, stage).peak_allocated
        assert abs(est / e["peak_allocated"] - 1) < TOLERANCE, (stage, e["peak_allocated"], est)
        # the stage's weights, gradients and states are split over tp: below the stage without TP
        alone = next(x for x in single.extra["ranks"] if x["rank"] == e["pipeline_stage"])
        assert e["parameters_bytes"] < 0.6 * alone["parameters_bytes"]
    assert r.peak_allocated == max(ranks[0]["peak_allocated"], ranks[2]["peak_allocated"])


#: since trace builds DDP as HF Trainer, accelerate and Lightning do, without ``bucket_cap_mb`` (torch's 1 MiB
#: first rebuilt bucket, then 25 MiB; it passed 25 before), stage 0's traced peak allocated holds 2.0 MiB of
#: ``allocator_overhead.rounding`` (a block left unsplit: 2,100,896 B against 5,792 B with 25 MiB buckets),
#: which the estimate nets out as placement: -1.81 % and -1.14 % on these 100 MiB stages, beyond 1 %
_ROUNDING = "trace's stage 0 counts 2 MiB of allocator rounding with DDP's default 1 MiB first bucket"


@pytest.mark.parametrize("overrides, options", [
    (SMALL, {"pp": 2, "dp": 2, "grad_accum": 2, "precision": "bf16-amp"}),
    (SMALL, {"pp": 2, "dp": 2, "grad_accum": 4, "precision": "fp32", "recompute": "full"}),
    pytest.param(SMALL, {"pp": 2, "dp": 2, "grad_accum": 2, "precision": "bf16-amp", "pp_schedule": "interleaved-1f1b"},
                 marks=pytest.mark.xfail(strict=True, reason=_ROUNDING)),
    pytest.param(SMALL, {"pp": 2, "dp": 4, "grad_accum": 4, "precision": "bf16", "pp_schedule": "gpipe"},
                 marks=pytest.mark.xfail(strict=True, reason=_ROUNDING)),
], ids=["pp2-dp2-ga2-amp", "pp2-dp2-ga4-fp32-full", "pp2-dp2-interleaved", "pp2-dp4-gpipe-bf16"])
def test_ddp_replicas_of_each_stage_agree_with_the_estimate(overrides, options):
    """--pp with --dp: each stage's module wrapped in DDP over its data-parallel group of a (pp, dp)
    mesh (trace.distributed.wrap_loaded), run by torch's PipelineStage, which keeps every micro-batch
    but the last under no_sync; DDP replica 0 of the first and of the last stage traced. Each within
    1% of the estimate's stage (measured: first +0.00% to +0.46%, last -0.51% to -0.09%: the last
    stage's gap is the allocator's rounding of its activations, which DDP's buckets shift)."""
    r, stages = _stages(overrides, **options)
    dp, pp = options["dp"], options["pp"]
    assert sorted(stages) == [0, (pp - 1) * dp] and r.extra["traced_ranks"] == [0, (pp - 1) * dp]
    ranks = r.extra["ranks"]
    assert [e["pipeline_stage"] for e in ranks] == [k // dp for k in range(pp * dp)]
    assert all("DDP replica" in e["not_traced"] for e in ranks if not e["traced"])
    assert f"DDP over {dp}" in r.extra["wrapper"]
    for stage, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (stage, traced, est)
    # each traced stage holds DDP buckets as large as its own weights (one copy of every gradient, in
    # the weights' dtype: gradient_as_bucket_view off), so the two stages' buckets differ
    buckets = {}
    for e in ranks:
        if e["traced"]:
            buckets[e["rank"]] = sum(c["bytes"] for c in e["components"] if c["name"] == "communication.ddp_buckets")
            assert abs(buckets[e["rank"]] / e["parameters_bytes"] - 1) < 0.001, (e["rank"], buckets)
    assert len(set(buckets.values())) == 2
    assert r.peak_allocated == max(t for t, _ in stages.values())


@pytest.mark.parametrize("options", [
    {"fsdp": "full", "precision": "bf16-amp"},
    {"fsdp": "full", "precision": "bf16-mp"},
    {"fsdp": "grad-op", "precision": "bf16-amp", "pp_schedule": "interleaved-1f1b"},
], ids=["full-amp", "full-bf16-mp", "grad-op-interleaved"])
def test_fsdp2_shards_each_stage_and_the_pipeline_reduces_once(options):
    """--pp with --fsdp (FSDP2, --grad-sync step): each stage module sharded over the dp dimension of a
    (pp, dp) mesh, run by torch's PipelineStage, which keeps the units' gradients unsharded through
    every micro-batch and reduce-scatters them after the schedule. Checked on the run itself: each
    traced stage holds a 1/dp shard of its weights (against the same stage traced without --dp) and,
    at its peak (in a backward after the first) its whole stage's gradients unsharded (dp x the shard);
    FSDP2's buffers are there; the other ranks are listed as FSDP2 ranks of their stage. (The
    estimate's agreement: test_pipeline_fsdp2_agrees_with_the_estimate.)"""
    setup = {**BASE, "pp": 2, "dp": 2, "grad_accum": 4, "grad_sync": "step", **options}
    r = trace("llama-3.2-1b", set=SMALL, **setup)
    single = {k: v for k, v in setup.items() if k not in ("dp", "fsdp", "grad_sync")}
    if single["precision"] == "bf16-mp":  # (FSDP's policy only) the same fp32 weights without FSDP
        single["precision"] = "bf16-amp"
    alone = trace("llama-3.2-1b", set=SMALL, **single)
    assert r.extra["traced_ranks"] == [0, 2] and f"FSDP2 fully_shard {options['fsdp']} over 2" in r.extra["wrapper"]
    ranks = r.extra["ranks"]
    assert [e["pipeline_stage"] for e in ranks] == [0, 0, 1, 1]
    assert all("FSDP2 rank of a traced stage" in e["not_traced"] for e in ranks if not e["traced"])
    names = set()
    for e in ranks:
        if e["traced"]:
            whole = next(x for x in alone.extra["ranks"] if x["rank"] == e["pipeline_stage"])
            assert abs(e["parameters_bytes"] / whole["parameters_bytes"] - 0.5) < 0.01, (e, whole)
            grads = sum(c["bytes"] for c in e["components"] if c["category"] == "gradients")
            # (under bf16-mp the first stage peaks before its gradients exist)
            if options["precision"] != "bf16-mp":
                assert abs(grads / (2 * e["parameters_bytes"]) - 1) < 0.01, (e["rank"], grads, e["parameters_bytes"])
            names |= {c["name"] for c in e["components"]}
    assert any(n.startswith("communication.fsdp") for n in names), names
    assert r.peak_allocated == max(e["peak_allocated"] for e in ranks if e["traced"])
    # the estimate warns outside the setups it is checked on (test_pipeline_fsdp2_agrees_with_the_estimate):
    # (1F1B); under GPipe, or full under interleaved 1F1B, it warns; never for DDP
    from trainmem.estimate.engine import PIPELINE_FSDP_WARNING
    warned = PIPELINE_FSDP_WARNING in estimate("llama-3.2-1b", set=SMALL, **setup).warnings
    assert warned == (options.get("pp_schedule") == "interleaved-1f1b" and options["fsdp"] == "full")
    for other in ({"pp_schedule": "gpipe"}, {"fsdp": "full", "pp_schedule": "interleaved-1f1b"}):
        assert PIPELINE_FSDP_WARNING in estimate("llama-3.2-1b", set=SMALL, **{**setup, **other}).warnings
    ddp = {**{k: v for k, v in setup.items() if k not in ("fsdp", "grad_sync")}, "precision": "bf16-amp"}
    assert PIPELINE_FSDP_WARNING not in estimate("llama-3.2-1b", set=SMALL, **ddp).warnings


#: PP x FSDP2 (--grad-sync step) where the estimate models torch's PipelineStage: the schedule's loss
#: outside the stage root (quantities.pipeline.pipeline_fsdp), grad-op's layers gathered once per stage
#: (moments.tokens, interleaved: each of the rank's stages). (stages checked, setup)
PP_FSDP = [
    ("both", SMALL, {"pp": 2, "grad_accum": 4, "fsdp": "grad-op", "precision": "bf16-amp"}),
    ("both", SMALL, {"pp": 2, "grad_accum": 4, "fsdp": "grad-op", "precision": "bf16-amp",
                     "pp_schedule": "interleaved-1f1b"}),
    ("both", EIGHT, {"pp": 4, "grad_accum": 4, "fsdp": "grad-op", "precision": "bf16-mp"}),
    # full (reshard after forward), 1F1B: the last stage's peak is the loss's backward with every unit
    # resharded by the forward before it; the first stage's, its top layer's and its root's unshard at a
    # backward (quantities.pipeline.pipeline_top_first), every layer above kept gathered (pipeline_kept_layer), nothing
    # reduced within the stage's backward (fsdp_no_sync), bf16-mp's new gradients beside the fp32 ones
    # (Quantities.fsdp_mp_new). (Interleaved orders: the warning)
    ("both", SMALL, {"pp": 2, "grad_accum": 2, "fsdp": "full", "precision": "bf16-amp"}),
    ("both", SMALL, {"pp": 2, "grad_accum": 2, "fsdp": "full", "precision": "bf16-mp"}),
    ("both", SMALL, {"pp": 2, "grad_accum": 4, "fsdp": "full", "precision": "bf16-amp", "recompute": "full"}),
    ("both", EIGHT, {"pp": 4, "grad_accum": 8, "fsdp": "full", "precision": "bf16-amp"}),
]


@pytest.mark.parametrize("which, overrides, options", PP_FSDP,
                         ids=["gradop-pp2", "gradop-interleaved", "gradop-pp4-mp", "full-amp",
                              "full-mp", "full-recompute", "full-pp4-amp"])
def test_pipeline_fsdp2_agrees_with_the_estimate(which, overrides, options):
    """Each checked stage's peak allocated, estimate against the traced PipelineStage + FSDP2 run
    (before these mechanisms: -1.4% to +11.7%; after: -0.6% to +0.5%; with the 3D work's: -0.6% to
    +0.0%, docs/trace.md)."""
    _, stages = _stages(overrides, dp=2, grad_sync="step", **options)
    last = options["pp"] - 1
    for stage, (traced, est) in stages.items():
        rank_stage = 0 if stage == 0 else last
        if which == "both" or rank_stage == last:
            assert abs(est / traced - 1) < TOLERANCE, (stage, traced, est)


@pytest.mark.parametrize("overrides, options", [
    (SMALL, {"pp": 2, "grad_accum": 4, "precision": "bf16-amp"}),
    (EIGHT, {"pp": 4, "grad_accum": 2, "precision": "bf16", "recompute": "full"}),
], ids=["pp2-ga4-amp", "pp4-ga2-bf16-full"])
def test_gpipe_keeps_every_micro_batch_and_agrees_with_the_estimate(overrides, options):
    r, stages = _stages(overrides, pp_schedule="gpipe", **options)
    for stage, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (stage, traced, est)
    assert "ScheduleGPipe" in r.extra["wrapper"]
    # GPipe's last stage holds every micro-batch's activations and logits: above 1F1B's, which holds one
    _, one = _stages(overrides, **options) if options["grad_accum"] >= options["pp"] else (None, None)
    if one is not None:
        last = options["pp"] - 1
        assert stages[last][0] > one[last][0]


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("fsdp", ["full", "grad-op"])
@pytest.mark.parametrize("precision", ["bf16-amp", "bf16-mp"])
def test_pipeline_fsdp2_grid_agrees_with_the_estimate(pp, schedule, fsdp, precision):
    """PP x FSDP2 over dp 2 without recompute: each stage within 1% of trace where the estimate does
    not warn (full under interleaved 1F1B: its first stage only, the last rank's units kept gathered
    between backwards being what the warning names)."""
    _, stages = _stages(SMALL if pp == 2 else EIGHT, pp=pp, dp=2, grad_sync="step", grad_accum=2 * pp,
                        fsdp=fsdp, precision=precision, pp_schedule=schedule)
    warned = fsdp == "full" and schedule == "interleaved-1f1b"
    for rank, (traced, est) in stages.items():
        if rank == 0 or not warned:
            assert abs(est / traced - 1) < TOLERANCE, (rank, traced, est)


@pytest.mark.slow
@pytest.mark.parametrize("pp, ga", [(2, 2), (2, 4), (4, 4), (4, 8)])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-amp"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_grid_agrees_with_the_estimate(pp, ga, precision, recompute, schedule):
    _, stages = _stages(SMALL if pp == 2 else EIGHT, pp=pp, grad_accum=ga, precision=precision, recompute=recompute,
                        pp_schedule=schedule)
    for stage, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (stage, traced, est)


#: LoRA under pipelining (tests/test_lora.py's Llama: 8 layers, h 512, r 16 on q and v), 2 x 1024 tokens
LORA = {"set": ["num_hidden_layers=8", "hidden_size=512", "intermediate_size=1024", "num_attention_heads=8",
                "num_key_value_heads=4", "head_dim=64", "vocab_size=2048"], "seq_len": 1024, "batch_size": 2,
        "lora_rank": 16}


def _lora_stages(**options):
    """As ``_stages``, for the LoRA model: {rank: (traced peak, the estimate's stage peak)}."""
    r = trace("llama-3.2-1b", **{**LORA, **options})
    res = resolve("llama-3.2-1b", **{**LORA, **options})
    stage = lambda st: "first" if st == 0 else "last"  # noqa: E731
    return r, {e["rank"]: (e["peak_allocated"], estimate_stage(res.model, res.training,
                                                              stage(e["pipeline_stage"])).peak_allocated)
               for e in r.extra["ranks"] if e["traced"]}


@pytest.mark.parametrize("options", [
    {"pp": 2, "grad_accum": 2},
    {"pp": 4, "grad_accum": 4, "pp_schedule": "gpipe", "recompute": "full"},
    {"pp": 2, "grad_accum": 4, "pp_schedule": "interleaved-1f1b"},
    {"pp": 2, "grad_accum": 2, "dp": 2},
], ids=["pp2-1f1b", "pp4-gpipe-full", "pp2-interleaved", "pp2-dp2"])
def test_lora_stages_agree_with_the_estimate(options):
    """peft's LoRA on each stage (the stage split cuts peft's base model: ``wrappers.pipeline_stage_module``):
    frozen base weights, fp32 adapters, bf16-amp. Measured (docs/trace.md, pipeline section): first stage
    -0.12% to -0.06%, last -0.93% to -0.27% over pp 2 and 4, 1F1B and GPipe, recompute none and full; the
    first stage was +1.3% / +3.2% before its top layer's output gradient was taken as the receive buffer
    (``quantities.pipeline.receives_output_grad``) and frozen linears' weight copies as freed by their backward."""
    r, stages = _lora_stages(**options)
    for rank, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (rank, traced, est)
    trainable = sum(c["bytes"] for c in r.extra["ranks"][0]["components"] if c["category"] == "optimizer_states")
    params = r.extra["ranks"][0]["parameters_bytes"]
    assert 0 < trainable < 0.1 * params  # AdamW's states over the adapters only: the base is frozen


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_lora_pipeline_grid_agrees_with_the_estimate(pp, schedule, recompute):
    _, stages = _lora_stages(pp=pp, grad_accum=pp, pp_schedule=schedule, recompute=recompute)
    for rank, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (rank, traced, est)


def test_the_last_stages_loss_runs_after_its_autocast_region():
    """Without LoRA, full recompute, bf16-amp: the checkpointed layers' weight copies live in autocast's
    cache until the stage forward's region closes, before the schedule's loss runs in its own
    (``quantities.pipeline.loss_after_stage_forward``); the last stage was +2.0% before (measured -0.19%)."""
    r, stages = _lora_stages(pp=2, grad_accum=2, recompute="full", lora_rank=None)
    assert not r.training.lora_rank
    for rank, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (rank, traced, est)


def test_a_receiving_stages_top_layer_adds_no_output_gradient():
    """The first stage's top layer back-propagates from the receive buffer (torch ``stage_backward``
    hands it to autograd): its MLP backward adds one (b, s, h) stream-dtype tensor less than the same
    layer on the last stage, whose output gradient comes from the final norm."""
    from trainmem.estimate.quantities.build import quantities
    from trainmem.estimate.quantities.pipeline import receives_output_grad
    from trainmem.estimate.moments import best_transient
    from trainmem.estimate.layers import TOP
    res = resolve("llama-3.2-1b", **LORA, pp=2, grad_accum=2)
    m, t = res.model, res.training
    assert receives_output_grad(t, "first") and not receives_output_grad(t, "last")
    n = t.batch_size * t.seq_len
    first, last = quantities(m, t, "first"), quantities(m, t, "last")
    _, a, _ = best_transient(first.transients, n, n * t.seq_len, 0, TOP, received=True)
    _, b, _ = best_transient(last.transients, n, n * t.seq_len, 0, TOP, received=True)
    assert b - a == n * m.hidden_size * 4   # fp32 residual stream under bf16-amp


def test_ranks_list_every_stage_and_the_first_holds_more_micro_batches():
    r = trace("llama-3.2-1b", set=EIGHT, **BASE, pp=4, grad_accum=4, precision="bf16")
    ranks = r.extra["ranks"]
    assert [e["rank"] for e in ranks] == [0, 1, 2, 3]
    assert [e["traced"] for e in ranks] == [True, False, False, True]
    assert r.extra["traced_ranks"] == [0, 3] and r.extra["world_size"] == 4
    first, last = ranks[0], ranks[3]
    # stage 0 holds the embedding (4096 x 256 fp32... here bf16), stage 3 the final norm and the head
    assert first["parameters_bytes"] != last["parameters_bytes"]
    # 1F1B: the first stage keeps 4 micro-batches' activations, the last one: more on the first stage
    acts = lambda e: sum(c["bytes"] for c in e["components"] if c["category"] == "activations")  # noqa: E731
    assert acts(first) > 2 * acts(last)
    assert r.extra["rank"] == (0 if first["peak_allocated"] >= last["peak_allocated"] else 3)
    assert any("Schedule1F1B" in w for w in r.warnings)


def test_a_middle_stage_is_traced_on_request():
    r = trace("llama-3.2-1b", set=EIGHT, **BASE, pp=4, grad_accum=4, precision="bf16", rank=1)
    assert [e["traced"] for e in r.extra["ranks"]] == [True, True, False, True]


@pytest.mark.parametrize("options, names", [
    ({"pp": 2}, "--grad-accum 1"),
    ({"pp": 2, "grad_accum": 2, "dp": 2, "fsdp": "full"}, "with --grad-sync micro-batch"),
    ({"pp": 2, "grad_accum": 2, "dp": 2, "fsdp": "full", "grad_sync": "step", "fsdp_version": 1},
     "--fsdp-version 1: torch's PipelineStage drives FSDP2"),
    ({"pp": 2, "grad_accum": 2, "dp": 2, "tp": 2}, "--dp with --tp needs --fsdp"),
    ({"pp": 2, "grad_accum": 2, "lora_rank": 8, "quantize": "nf4"}, "--quantize"),
    ({"pp": 2, "grad_accum": 2, "tp": 2, "lora_rank": 8}, "--lora-rank is not traced"),
    ({"pp": 2, "grad_accum": 2, "optimizer_in_backward": True}, "--optimizer-in-backward"),
    ({"pp": 2, "grad_accum": 2, "loss": "chunked", "loss_chunks": 4}, "chunked loss"),
    ({"pp": 2, "grad_accum": 2, "num_microbatches_in_flight": 1}, "--num-microbatches-in-flight 1"),
    ({"pp": 2, "grad_accum": 4, "num_microbatches_in_flight": 2, "pp_schedule": "gpipe"},
     "--num-microbatches-in-flight 2"),
    ({"pp": 2, "grad_accum": 2, "device": "cpu"}, "--device cpu"),
])
def test_combinations_not_built_are_refused_in_one_line(options, names):
    with pytest.raises(TrainmemError) as e:
        trace("llama-3.2-1b", set=SMALL, **BASE, **options)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_a_model_without_the_split_is_refused():
    gpt2 = ["n_layer=2", "n_embd=64", "n_head=4", "vocab_size=1000", "n_positions=128"]
    with pytest.raises(TrainmemError, match="pipeline split is written for Llama"):
        trace("gpt2", set=gpt2, batch_size=2, seq_len=64, pp=2, grad_accum=2)
    with pytest.raises(TrainmemError, match="not a llama seq-cls model"):  # the split's last stage is an LM head
        trace("llama-3.2-1b", set=SMALL, task="sequence-classification", batch_size=2, seq_len=64, pp=2,
              grad_accum=2)


def test_the_command_line_traces_both_stages_and_refuses_in_one_line(capsys):
    import json
    from trainmem.cli import main
    args = ["trace", "llama-3.2-1b", *[x for o in SMALL for x in ("--set", o)], "--batch-size", "2",
            "--seq-len", "128", "--pp", "2"]
    assert main([*args, "--grad-accum", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(e["rank"], e["traced"]) for e in d["ranks"]] == [(0, True), (1, True)]
    assert d["peak_allocated"] == max(e["peak_allocated"] for e in d["ranks"])
    assert main([*args, "--grad-accum", "2"]) == 0
    text = capsys.readouterr().out
    assert "ranks: 2 (pipeline ×2" in text and "* rank   0: traced" in text and "* rank   1: traced" in text
    assert main(args) == 2  # --grad-accum 1 < --pp 2: Schedule1F1B refuses it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--grad-accum 1" in err[0]


# ----- interleaved 1F1B: torch's ScheduleInterleaved1F1B, several stages per rank ----------------------
def test_the_estimates_interleaved_order_is_torchs():
    """estimate.schedules replays ScheduleInterleaved1F1B's op order without torch: each rank's
    compute actions equal torch's own (``_calculate_single_rank_operations``, padding dropped)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType
    from trainmem.estimate.schedules import rank_order
    for pp, local, micro in [(2, 2, 2), (2, 2, 4), (2, 3, 8), (4, 2, 4), (4, 2, 8), (4, 4, 12), (3, 2, 2), (8, 2, 16)]:
        for rank in range(pp):
            sch = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
            sch.pp_group_size, sch.n_local_stages, sch.rank, sch._n_microbatches = pp, local, rank, micro
            sch.number_of_rounds = max(1, micro // pp)
            sch.microbatches_per_round = micro // sch.number_of_rounds
            ops = [("F" if a.computation_type == _ComputationType.FORWARD else "B", (a.stage_index - rank) // pp,
                    a.microbatch_index) for a in sch._calculate_single_rank_operations(rank) if a is not None]
            assert tuple(ops) == rank_order(pp, local, micro, rank), (pp, local, micro, rank)


@pytest.mark.parametrize("overrides, options", [
    (SMALL, {"pp": 2, "grad_accum": 2, "precision": "fp32"}),
    (SMALL, {"pp": 2, "grad_accum": 4, "precision": "bf16-amp", "recompute": "full"}),
    (EIGHT, {"pp": 2, "grad_accum": 4, "precision": "bf16", "pp_virtual_stages": 4}),
    (EIGHT, {"pp": 4, "grad_accum": 8, "precision": "fp32"}),
], ids=["pp2-v2-ga2-fp32", "pp2-v2-ga4-amp-full", "pp2-v4-ga4-bf16", "pp4-v2-ga8-fp32"])
def test_interleaved_ranks_agree_with_the_estimate(overrides, options):
    r, stages = _stages(overrides, pp_schedule="interleaved-1f1b", **options)
    assert sorted(stages) == [0, options["pp"] - 1]
    for stage, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (stage, traced, est)
    v = options.get("pp_virtual_stages", 2)
    assert f"ScheduleInterleaved1F1B, {v} stages per rank" in r.extra["wrapper"]


def test_interleaved_last_rank_keeps_its_other_stages_micro_batches():
    """Under 1F1B the last stage has one micro-batch in flight; interleaved, the last rank also
    holds its other stage's micro-batches (forwarded in the warm-up) at its head stage's backward,
    so its peak is above 1F1B's with the same layers and weights on the rank."""
    _, one = _stages(SMALL, pp=2, grad_accum=2, precision="fp32")
    _, two = _stages(SMALL, pp=2, grad_accum=2, precision="fp32", pp_schedule="interleaved-1f1b")
    assert two[1][0] > one[1][0] and two[1][1] > one[1][1]


@pytest.mark.parametrize("options, names", [
    ({"pp": 2, "grad_accum": 2, "pp_virtual_stages": 2}, "--pp-virtual-stages 2 is for"),
    ({"pp": 2, "grad_accum": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 1}, "--pp-virtual-stages 1"),
    ({"pp": 2, "grad_accum": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 3}, "do not split into 6"),
    ({"pp": 2, "grad_accum": 5, "pp_schedule": "interleaved-1f1b"}, "--grad-accum 5"),
    ({"pp": 2, "grad_accum": 2, "pp_schedule": "interleaved-1f1b", "num_microbatches_in_flight": 2},
     "--num-microbatches-in-flight 2"),
    ({"pp": 2, "grad_accum": 2, "pp_schedule": "zero-bubble", "num_microbatches_in_flight": 2},
     "ScheduleInterleavedZeroBubble, whose virtual stages"),
    ({"pp": 2, "grad_accum": 5, "pp_schedule": "zero-bubble"}, "--grad-accum 5"),
])
def test_interleaved_options_not_built_are_refused_in_one_line(options, names):
    with pytest.raises(TrainmemError) as e:
        trace("llama-3.2-1b", set=SMALL, **BASE, **options)
    assert names in str(e.value) and "\n" not in str(e.value)
    if "num_microbatches_in_flight" not in options:  # the estimate refuses the same setups
        with pytest.raises(TrainmemError):
            estimate("llama-3.2-1b", set=SMALL, **BASE, **options)


def test_the_estimate_refuses_megatrons_interleaved_schedule_off_its_groups():
    # Megatron's interleaved schedule runs micro-batches in groups of pp: other counts raise there
    # (tests/test_megatron_loss.py checks the order it is modelled with)
    with pytest.raises(TrainmemError, match="multiple of --pp"):
        estimate("llama-3.2-1b", set=SMALL, **BASE, pp=2, grad_accum=3, pp_schedule="interleaved-1f1b",
                 framework="megatron")
    assert estimate("llama-3.2-1b", set=SMALL, **BASE, pp=2, grad_accum=2, pp_schedule="interleaved-1f1b",
                    framework="megatron").peak_allocated > 0


def test_the_command_line_takes_the_virtual_stages(capsys):
    import json
    from trainmem.cli import main
    args = ["estimate", "llama-3.2-1b", *[x for o in SMALL for x in ("--set", o)], "--batch-size", "2",
            "--seq-len", "128", "--pp", "2", "--grad-accum", "2", "--pp-schedule", "interleaved-1f1b"]
    assert main([*args, "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["training"]["pp_virtual_stages"] is None and two["peak_allocated"] > 0
    assert main([*args, "--pp-virtual-stages", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not split into 8" in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("ga", [2, 4, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-amp"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_interleaved_grid_agrees_with_the_estimate(ga, precision, recompute):
    r, stages = _stages(SMALL, pp=2, grad_accum=ga, precision=precision, recompute=recompute,
                        pp_schedule="interleaved-1f1b")
    for stage, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (stage, traced, est)
    # the estimate's components add up to its peak on each rank
    res = resolve("llama-3.2-1b", set=SMALL, **BASE, pp=2, grad_accum=ga, precision=precision, recompute=recompute,
                  pp_schedule="interleaved-1f1b")
    for stage in ("first", "last"):
        rep = estimate_stage(res.model, res.training, stage)
        assert sum(c.bytes for c in rep.components) == rep.peak_allocated


def test_zero_bubble_is_traced_and_the_estimate_refuses_it_in_one_line():
    """ScheduleInterleavedZeroBubble runs on the fake group (its input-gradient backward retains the
    graph until the weight-gradient backward): the last rank holds more than under interleaved 1F1B
    with the same stages; the estimate, which does not model the split backward, refuses it."""
    zb = trace("llama-3.2-1b", set=SMALL, **BASE, pp=2, grad_accum=4, precision="fp32", pp_schedule="zero-bubble")
    assert "ScheduleInterleavedZeroBubble, 2 stages per rank" in zb.extra["wrapper"]
    il = trace("llama-3.2-1b", set=SMALL, **BASE, pp=2, grad_accum=4, precision="fp32",
               pp_schedule="interleaved-1f1b")
    last = lambda r: next(e["peak_allocated"] for e in r.extra["ranks"] if e["rank"] == 1)  # noqa: E731
    assert last(zb) > last(il)
    with pytest.raises(TrainmemError) as e:
        estimate("llama-3.2-1b", set=SMALL, **BASE, pp=2, grad_accum=4, pp_schedule="zero-bubble")
    assert "--pp-schedule zero-bubble" in str(e.value) and "use trace" in str(e.value) and "\n" not in str(e.value)


def test_interleaved_schedule_runs_tensor_parallel_stages():
    """Each of a rank's virtual stages is parallelized over the one tp dimension of the (pp, tp) mesh
    (trace.distributed._pipeline_stage); the last rank's head is vocabulary-parallel, its losses under
    loss_parallel (wrappers.PipelineRankModule.get_output_embeddings). Measured against the estimate:
    first / last rank -0.01% / -0.27% (bf16-amp, M 2)."""
    setup = {**BASE, "pp": 2, "tp": 2, "grad_accum": 2, "precision": "bf16-amp", "pp_schedule": "interleaved-1f1b"}
    r = trace("llama-3.2-1b", set=SMALL, **setup)
    res = resolve("llama-3.2-1b", set=SMALL, **setup)
    assert r.extra["traced_ranks"] == [0, 2] and "tensor parallel ×2" in r.extra["wrapper"]
    for e in r.extra["ranks"]:
        if e["traced"]:
            est = estimate_stage(res.model, res.training, "first" if e["pipeline_stage"] == 0 else "last")
            assert abs(est.peak_allocated / e["peak_allocated"] - 1) < TOLERANCE, (e["rank"], est.peak_allocated)


# ----- torchtitan's weighted stage split and the (pp, dp, tp) mesh ------------------------------------
def test_torchtitans_split_counts_the_embeddings_and_the_head_as_layers():
    """spec.layout.stage_layer_counts is torchtitan's generate_llm_fqn_per_model_part: the effective
    layers (layers + weights) dealt out evenly, the first stages one more of the remainder, the first
    and last stage giving up their weight; with no weights and a divisor, the even split."""
    from trainmem.spec.layout import split_problem, stage_layer_counts
    assert stage_layer_counts(126, 16, 1, 1) == (7,) + (8,) * 14 + (7,)
    assert stage_layer_counts(32, 4, 1, 1) == (8, 9, 8, 7)   # 34 over 4: the first two get the remainder
    assert stage_layer_counts(5, 2, 1, 1) == (3, 2)
    assert stage_layer_counts(8, 4) == (2, 2, 2, 2) and stage_layer_counts(4, 2, 1, 1) == (2, 2)
    for layers, stages, a, b in ((126, 16, 1, 1), (32, 4, 1, 1), (10, 4, 2, 1), (7, 3, 0, 0)):
        counts = stage_layer_counts(layers, stages, a, b)
        assert sum(counts) == layers and max(counts) - min(counts) <= max(a, b) + 1
    assert "effective layers" in split_problem(2, 5, 1, 1)
    assert "fewer than the embeddings' or the head's weight" in split_problem(4, 3, 3, 0)
    assert split_problem(126, 16, 1, 1) == ""


def test_the_weighted_split_is_given_refused_or_set_by_the_torchtitan_preset():
    m405 = resolve("llama-3.1-405b", pp=16, grad_accum=16, pp_first_stage_less_layers=1,
                   pp_last_stage_less_layers=1).training
    assert [m405.stage_span(126, s) for s in m405.worst_stage_candidates] == [(0, 7), (7, 15), (119, 126)]
    for options, names in (({"pp": 16}, "--pp-first-stage-less-layers 1 --pp-last-stage-less-layers 1"),
                           ({"pp": 16, "pp_first_stage_less_layers": 1, "pp_last_stage_less_layers": 1,
                             "pp_schedule": "interleaved-1f1b"}, "with --pp-schedule interleaved-1f1b"),
                           ({"pp": 64, "pp_first_stage_less_layers": 3, "pp_last_stage_less_layers": 1},
                            "fewer than the embeddings' or the head's weight")):
        with pytest.raises(TrainmemError) as e:
            estimate("llama-3.1-405b", grad_accum=16, **options)
        assert names in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TrainmemError, match="not Megatron-LM's uneven split"):
        estimate("llama-3.1-405b", framework="megatron", pp=16, grad_accum=16, tp=8, pp_first_stage_less_layers=1,
                 pp_last_stage_less_layers=1)
    titan = resolve("llama-3.1-405b", framework="torchtitan", pp=16, grad_accum=16).training
    assert titan.pp_less == (1, 1)
    assert resolve("llama-3.1-405b", framework="torchtitan", pp=2, grad_accum=4, pp_schedule="interleaved-1f1b",
                   pp_virtual_stages=3).training.pp_less == (0, 0)
    # the even split where the layers divide: today's stages, today's numbers
    even = resolve("llama-3.2-1b", set=SMALL, **BASE, pp=2, grad_accum=2).training
    assert even.pp_less == (0, 0) and even.worst_stage_candidates == ("first", "last")
    # without --pp the weights split nothing: one line says so (and the torchtitan preset sets none)
    one = estimate("llama-3.2-1b", set=SMALL, **BASE, pp_first_stage_less_layers=1)
    assert any("--pp-first-stage-less-layers" in w and "changes nothing" in w for w in one.warnings)
    assert resolve("llama-3.2-1b", framework="torchtitan", set=SMALL, **BASE).training.pp_less == (0, 0)


@pytest.mark.parametrize("options", [
    {"precision": "bf16-mp", "sequence_parallel": True},
    {"precision": "bf16-amp", "recompute": "full"},
    {"precision": "bf16-mp", "recompute": "full", "layers": 5, "pp_first_stage_less_layers": 1,
     "pp_last_stage_less_layers": 1},
], ids=["bf16-mp-sp", "amp-full", "5-layers-weighted-bf16-mp-full"])
def test_fsdp2_and_tensor_parallel_stages_on_a_3d_mesh_agree_with_the_estimate(options):
    """--pp 2 --dp 2 --tp 2 --fsdp full: a (pp, dp, tp) mesh of 8 fake ranks, row-major as torchtitan's
    ParallelDims; each stage module parallelized over tp, then sharded with FSDP2 over dp
    (trace.distributed._pipeline_stage); rank 0 of the first and of the last stage traced (ranks 0
    and 4). Measured over 1F1B x bf16-amp / bf16-mp x recompute none / full x sequence parallel
    off / on, 4 layers and 5 (torchtitan's split, 3 + 2): first stage -0.55% to +0.01%, last -0.17%
    to -0.09% (docs/trace.md)."""
    options = dict(options)
    layers = options.pop("layers", 4)
    overrides = [f"num_hidden_layers={layers}"] + SMALL[1:]
    setup = {**BASE, "pp": 2, "dp": 2, "tp": 2, "fsdp": "full", "grad_sync": "step", "grad_accum": 2, **options}
    r = trace("llama-3.2-1b", set=overrides, **setup)
    res = resolve("llama-3.2-1b", set=overrides, **setup)
    ranks = r.extra["ranks"]
    assert r.extra["world_size"] == 8 and r.extra["traced_ranks"] == [0, 4]
    assert [e["pipeline_stage"] for e in ranks] == [k // 4 for k in range(8)]
    assert "FSDP2 fully_shard full over 2" in r.extra["wrapper"] and "tensor parallel ×2" in r.extra["wrapper"]
    assert all("FSDP2 and tensor-parallel rank" in e["not_traced"] for e in ranks if not e["traced"])
    for e in ranks:
        if e["traced"]:
            est = estimate_stage(res.model, res.training, "first" if e["pipeline_stage"] == 0 else "last")
            assert abs(est.peak_allocated / e["peak_allocated"] - 1) < TOLERANCE, (e["rank"], est.peak_allocated)
    # the stage's own layers, a quarter of its weights on each of the stage's 4 ranks
    first = res.training.stage_span(layers, "first")
    assert first == ((0, 3) if layers == 5 else (0, 2))


@pytest.mark.slow
@pytest.mark.parametrize("layers", [4, 5])
@pytest.mark.parametrize("precision", ["bf16-amp", "bf16-mp"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_3d_mesh_grid_agrees_with_the_estimate(layers, precision, recompute, sequence_parallel):
    """The 1F1B half of docs/trace.md's 3D table: --pp 2 --dp 2 --tp 2 --fsdp full, M 2, 4 layers or 5
    (torchtitan's split, 3 + 2); every traced stage within 1% (measured: -0.55% to +0.01%)."""
    weights = {"pp_first_stage_less_layers": 1, "pp_last_stage_less_layers": 1} if layers == 5 else {}
    _, stages = _stages([f"num_hidden_layers={layers}"] + SMALL[1:], pp=2, dp=2, tp=2, fsdp="full",
                        grad_sync="step", grad_accum=2, precision=precision, recompute=recompute,
                        sequence_parallel=sequence_parallel, **weights)
    assert sorted(stages) == [0, 4]
    for rank, (traced, est) in stages.items():
        assert abs(est / traced - 1) < TOLERANCE, (rank, traced, est)


def test_sequence_parallel_stages_exchange_their_local_shards():
    """--pp 2 --tp 2 --sequence-parallel: a stage sends and receives its (b, s/tp, h) shard
    (wrappers.PipelineStageModule.forward: DTensor.from_local / to_local at the boundary), so a
    stage's receive buffers are half those without sequence parallelism; within 1% of the estimate,
    which counts the buffers at s/tp (measured: +0.00% / -0.12%)."""
    setup = {**BASE, "pp": 2, "tp": 2, "grad_accum": 2, "precision": "bf16-amp"}
    sp = trace("llama-3.2-1b", set=SMALL, **setup, sequence_parallel=True)
    res = resolve("llama-3.2-1b", set=SMALL, **setup, sequence_parallel=True)
    plain = trace("llama-3.2-1b", set=SMALL, **setup)
    inputs = lambda r, k: next(sum(c["bytes"] for c in e["components"] if c["category"] == "inputs")  # noqa: E731
                               for e in r.extra["ranks"] if e["rank"] == k)
    assert inputs(sp, 2) < inputs(plain, 2)
    for e in sp.extra["ranks"]:
        if e["traced"]:
            est = estimate_stage(res.model, res.training, "first" if e["pipeline_stage"] == 0 else "last")
            assert abs(est.peak_allocated / e["peak_allocated"] - 1) < TOLERANCE, (e["rank"], est.peak_allocated)


def test_the_weighted_split_traces_stage_1_and_the_estimate_finds_the_same_worst_stage():
    """10 layers over 4 stages with the embeddings and the head one layer each (torchtitan): 12
    effective layers, 3 a stage: 2, 3, 3, 2 layers. Stage 1 holds a layer more than stage 0 with one
    micro-batch fewer in flight: trace traces stages 0, 1 and 3 and the estimate computes its middle
    stage; both find stage 1 the worst (measured: -0.01% / -0.28% / -0.06%)."""
    overrides = ["num_hidden_layers=10"] + SMALL[1:]
    setup = {**BASE, "pp": 4, "grad_accum": 4, "precision": "bf16-amp", "pp_first_stage_less_layers": 1,
             "pp_last_stage_less_layers": 1}
    r = trace("llama-3.2-1b", set=overrides, **setup)
    res = resolve("llama-3.2-1b", set=overrides, **setup)
    assert r.extra["traced_ranks"] == [0, 1, 3] and r.extra["rank"] == 1 and r.extra["pipeline_stage"] == "middle"
    assert [res.training.stage_span(10, s) for s in ("first", "middle", "last")] == [(0, 2), (2, 5), (8, 10)]
    for e in r.extra["ranks"]:
        if e["traced"]:
            name = {0: "first", 1: "middle", 3: "last"}[e["pipeline_stage"]]
            est = estimate_stage(res.model, res.training, name).peak_allocated
            assert abs(est / e["peak_allocated"] - 1) < TOLERANCE, (name, e["peak_allocated"], est)
    worst = estimate("llama-3.2-1b", set=overrides, **setup)
    assert worst.extra["pipeline_stage"] == "middle"
    assert abs(worst.peak_allocated / r.peak_allocated - 1) < TOLERANCE


#: SMALL with a 32000-token vocabulary: the last stage's logits (b, s, vocab) outweigh its layers
WIDE_VOCAB = [o if not o.startswith("vocab_size=") else "vocab_size=32000" for o in SMALL]


@pytest.mark.parametrize("options", [
    {"pp": 2, "precision": "fp16-amp", "recompute": "full"},
    {"pp": 2, "precision": "bf16-amp", "recompute": "none"},
    {"pp": 4, "precision": "fp16-amp", "recompute": "none"},
], ids=["pp2-fp16amp-full", "pp2-bf16amp-none", "pp4-fp16amp-none"])
def test_the_last_stage_keeps_each_output_to_the_next_forward(options):
    """Schedule1F1B's last stage keeps a micro-batch's half logits in ``fwd_cache`` through its
    backward and then in the schedule's ``output`` until the next forward returns
    (``moments.pipeline_output``): they are still allocated when the first micro-batch's backward
    ends, and the estimate's allocator replay keeps them there too. Peak reserved against trace, 4
    micro-batches, the last stage: before -9.7% to -12.2% (the replay freed the logits as the forward
    ended); after -1.1% to -1.4%."""
    overrides = WIDE_VOCAB if options["pp"] == 2 else ["num_hidden_layers=8"] + WIDE_VOCAB[1:]
    setup = {**BASE, "seq_len": 512, "grad_accum": 4, **options}
    r = trace("llama-3.2-1b", set=overrides, **setup)
    est = estimate("llama-3.2-1b", set=overrides, **setup)
    assert r.extra["pipeline_stage"] == "last" and est.extra["pipeline_stage"] == "last"
    # the (meta) example logits the step gives PipelineStage are no device memory
    # (trace.api._example_meta_uncounted): nothing above the parameters at load (before: 62.5 MiB)
    loaded = r.phase("model_loaded", 0)
    assert loaded.peak == loaded.allocated
    logits = BASE["batch_size"] * 512 * 32000 * 2  # one micro-batch's half logits
    ended = {p.name: p.allocated for p in r.phases if p.step == 1}
    assert ended["backward.micro1"] - ended["backward.micro4"] >= logits  # still held after the first
    assert est.phase("backward.micro1", 1).allocated == pytest.approx(ended["backward.micro1"], rel=0.01)
    assert est.peak_allocated == pytest.approx(r.peak_allocated, rel=TOLERANCE)
    assert abs(est.peak_reserved / r.peak_reserved - 1) <= 0.03, (est.peak_reserved, r.peak_reserved)


@pytest.mark.parametrize("options", [
    {"grad_accum": 4, "precision": "bf16-amp"},
    {"grad_accum": 2, "precision": "bf16", "recompute": "full"},
    {"grad_accum": 2, "precision": "fp16-amp", "recompute": "full"},
], ids=["ga4-bf16amp", "ga2-bf16-full", "ga2-fp16amp-full"])
def test_interleaved_last_rank_replays_logits_on_its_head_stage_only(options):
    """ScheduleInterleaved1F1B's last rank: only the pairs of its last local stage (the model's last,
    with the head) make logits and run the loss; its other stage's pairs keep their (b, s, h) output,
    each output in ``fwd_cache`` through its pair's backward (``_perform_action``'s ``output`` is gone
    as the action returns). The estimate's allocator replay walks the rank's order so
    (``reserved.driver._pipeline_pairs``). Peak reserved against trace, the last rank, vocab 32000 b2 s512:
    before +9.4% to +14.4% (every pair replayed with the head's logits); after -0.6% to +1.1%."""
    setup = {**BASE, "seq_len": 512, "pp": 2, "pp_schedule": "interleaved-1f1b", **options}
    r = trace("llama-3.2-1b", set=WIDE_VOCAB, **setup)
    est = estimate("llama-3.2-1b", set=WIDE_VOCAB, **setup)
    assert r.extra["pipeline_stage"] == "last" and est.extra["pipeline_stage"] == "last"
    assert est.peak_allocated == pytest.approx(r.peak_allocated, rel=TOLERANCE)
    assert abs(est.peak_reserved / r.peak_reserved - 1) <= 0.03, (est.peak_reserved, r.peak_reserved)


def test_the_last_stages_checkpointed_layers_cache_their_weight_copies_until_the_stage_forward_ends():
    """Full recompute under autocast on the last stage: each checkpointed layer's half weight copies
    stay in autocast's cache through the stage forward and are freed as its region closes, before the
    schedule's loss (``quantities.pipeline.loss_after_stage_forward``, ``Quantities.cast_stage_only``); the
    allocator replay makes them linear by linear there. Llama-3.2-1B's widths, 4 layers, first
    forward's reserved against trace: 662 MiB where trace has 862 before (the copies not replayed),
    equal after; peak reserved -2.7% -> +0.3%."""
    setup = {"set": ["num_hidden_layers=4", "vocab_size=8192", "tie_word_embeddings=false"], "batch_size": 1,
             "seq_len": 512, "pp": 2, "grad_accum": 2, "precision": "bf16-amp", "recompute": "full"}
    r = trace("llama-3.2-1b", **setup)
    est = estimate("llama-3.2-1b", **setup)
    assert r.extra["pipeline_stage"] == "last" and est.extra["pipeline_stage"] == "last"
    first = r.phase("forward.micro1", 1).reserved
    assert est.phase("forward.micro1", 1).reserved == pytest.approx(first, rel=0.02)
    assert est.peak_allocated == pytest.approx(r.peak_allocated, rel=TOLERANCE)
    assert abs(est.peak_reserved / r.peak_reserved - 1) <= 0.01, (est.peak_reserved, r.peak_reserved)
