"""Tensor (and sequence) parallelism traced on torch.distributed's own code in one process
(trace.distributed, wrappers.tensor_parallel): parallelize_module with torchtitan's Llama plan on a
fake process group of dp x tp ranks; DTensor's local shards counted; the estimate checked against it."""
import itertools

import pytest

from trainmem import estimate
from trainmem.errors import TrainmemError
from trainmem.trace.api import trace

#: a small Llama whose every TP split is even: 8 heads, 4 KV heads, untied head (vocab 4096)
SMALL = ["num_hidden_layers=2", "hidden_size=256", "num_attention_heads=8", "num_key_value_heads=4",
         "intermediate_size=1024", "vocab_size=4096", "head_dim=32", "tie_word_embeddings=false"]
#: the same shape with a tied head and a vocabulary that 3 ranks do not divide (torch.chunk: 334, 334, 332)
TIED = ["num_hidden_layers=2", "hidden_size=96", "num_attention_heads=6", "num_key_value_heads=3",
        "intermediate_size=192", "vocab_size=1000", "head_dim=16"]
BASE = {"batch_size": 2, "seq_len": 256, "precision": "bf16-amp"}


def _run(overrides=SMALL, **options):
    return trace("llama-3.2-1b", set=overrides, **{**BASE, **options})


def _est(overrides=SMALL, **options):
    return estimate("llama-3.2-1b", set=overrides, **{**BASE, **options})


def _component(r, prefix):
    return sum(c.bytes for c in r.components if c.name == prefix or c.name.startswith(prefix + "."))


def _local_numel(name, shape, tp):
    """Elements of one parameter's storage on a rank, from the model's own tensor shape: the plan's
    column-parallel weights (q/k/v, gate/up, the output head) and the vocabulary-parallel embedding
    split dim 0, the row-parallel ones (o, down) dim 1, into torch.chunk's pieces; norms are
    replicated. Every rank's storage is the first piece's size: ``Shard._shard_tensor`` scatters into
    ``torch.empty_like`` of the padded first piece and narrows the last ranks' (torch 2.13
    ``distributed/tensor/placement_types.py``), as FSDP2 pads its shards."""
    colwise = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    if not any(k in name for k in colwise + ("o_proj", "down_proj")):
        return shape.numel()
    dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
    return shape.numel() // shape[dim] * -(-shape[dim] // tp)


def _model_parameters(overrides, tp):
    """The fp32 bytes of every parameter of the transformers model (built on meta) on a rank, and in all."""
    import torch
    import transformers
    from trainmem.spec.resolve import resolve
    from trainmem.workload import hf_config
    r = resolve("llama-3.2-1b", set=overrides)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config(r.model, r.training))
    seen, total, whole = set(), 0, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += 4 * _local_numel(name, p.shape, tp)
        whole += 4 * p.numel()
    return total, whole


@pytest.mark.parametrize("overrides, tp, rank", [(SMALL, 2, 0), (SMALL, 4, 3), (TIED, 3, 0), (TIED, 3, 2)])
def test_each_rank_holds_its_shards(overrides, tp, rank):
    """The parameters trace counts are the DTensor local shards of every sharded weight (not their
    global size), exactly as DTensor splits the model's own tensors; a tied head stays tied. The
    last rank of an uneven split holds a padded storage and smaller optimizer states: not above rank 0."""
    r = _run(overrides, tp=tp, rank=rank, precision="fp32")
    expected, whole = _model_parameters(overrides, tp)
    assert _component(r, "parameters") == expected < whole / tp * 1.5
    assert r.extra["world_size"] == tp and r.extra["traced_ranks"] == [rank]
    assert r.phases[0].name == "model_loaded" and expected <= r.phases[0].allocated < expected + 512 * 64
    if rank:
        assert r.peak_allocated <= _run(overrides, tp=tp, precision="fp32").peak_allocated


def test_logits_are_vocabulary_parallel():
    """The head's logits are each rank's (b·s, vocab/tp) slice, and the loss runs on them
    (loss_parallel: no rank ever holds the whole vocabulary's logits)."""
    r = _run(tp=4, precision="bf16", hold_output="step", largest=200)
    logits = [x for x in r.extra["largest_tensors"] if x["category"] == "logits"]
    assert logits and all(x["shape"][-1] == 4096 // 4 and x["bytes"] == 2 * 256 * 1024 * 2 for x in logits)
    assert not [x for x in r.extra["largest_tensors"] if x["shape"] and x["shape"][-1] == 4096 and x["category"] != "gradients"]


def test_the_embedding_gradient_is_the_whole_table():
    """RowwiseParallel shards the embedding over the vocabulary, but its gradient is the whole
    (vocab, hidden) table on every rank: DTensor has no Shard(0) strategy for
    embedding_dense_backward (estimate.states._replicated_grad). Here the peak is the optimizer step,
    where it counts; the estimate agrees to the byte's neighbourhood."""
    r = _run(tp=4, sequence_parallel=True, recompute="full", largest=200)
    assert r.peak_phase.startswith("optimizer_step")
    grads = [x for x in r.extra["largest_tensors"] if x["category"] == "gradients" and x["module"] == "model.embed_tokens"]
    assert [x["shape"] for x in grads] == [[4096, 256]]
    e = _est(tp=4, sequence_parallel=True, recompute="full")
    assert abs(e.peak_allocated - r.peak_allocated) <= 0.001 * r.peak_allocated


def test_sequence_parallel_lowers_activations():
    """Sequence parallelism runs the norms and the residual stream on the (b, s/tp, h) shard: the
    peak falls, and the layers' saved tensors with it; the estimate follows."""
    for tp in (2, 4):
        tp_only, sp = _run(tp=tp, seq_len=1024), _run(tp=tp, seq_len=1024, sequence_parallel=True)
        assert sp.peak_allocated < tp_only.peak_allocated
        # what the forward leaves saved for backward (end of the second step's forward)
        assert _forward_end(sp) < _forward_end(tp_only)
        drop_e = _est(tp=tp, seq_len=1024).peak_allocated - _est(tp=tp, seq_len=1024,
                                                                 sequence_parallel=True).peak_allocated
        drop_t = tp_only.peak_allocated - sp.peak_allocated
        assert abs(drop_e - drop_t) <= 0.01 * tp_only.peak_allocated
    assert "sequence parallelism" in sp.extra["wrapper"]


def _forward_end(r):
    return next(p.allocated for p in r.phases if p.name == "forward" and p.step == 2)


def _agree(**options):
    r, e = _run(**options), _est(**options)
    return (e.peak_allocated - r.peak_allocated) / r.peak_allocated


def test_estimate_agrees_with_trace_fast():
    assert abs(_agree(tp=2, sequence_parallel=True)) <= 0.005


GRID = list(itertools.product([2, 4], [False, True], [256, 1024], ["bf16-amp", "bf16"], ["none", "full"]))


@pytest.mark.slow
@pytest.mark.parametrize("tp, sp, seq, precision, recompute", GRID)
def test_estimate_agrees_with_trace(tp, sp, seq, precision, recompute):
    """Peak allocated within 0.5% on the 32 setups of docs/trace.md's tensor-parallel table."""
    err = _agree(tp=tp, sequence_parallel=sp, seq_len=seq, precision=precision, recompute=recompute)
    assert abs(err) <= 0.005, f"{err:+.2%}"


def test_fsdp2_over_the_dp_dimension_of_a_2d_mesh():
    """--dp 2 --fsdp full --tp 2: FSDP2 shards the TP shards again over dp (a (dp, tp) mesh of 4 ranks)."""
    r = _run(dp=2, fsdp="full", tp=2, precision="fp32")
    expected, _ = _model_parameters(SMALL, 2)
    assert expected / 2 <= _component(r, "parameters") <= expected / 2 + 4096
    assert r.extra["world_size"] == 4 and len(r.extra["ranks"]) == 4
    assert _component(r, "communication.fsdp_unsharded_params") > 0


@pytest.mark.parametrize("options, names", [
    ({"tp": 2, "pp": 2}, "--pp 2"),
    ({"tp": 2, "cp": 2, "pp": 2, "grad_accum": 2}, "--pp 2"),
    ({"tp": 2, "dp": 2}, "--dp with --tp needs --fsdp"),
    ({"tp": 2, "lora_rank": 8}, "--lora-rank"),
    ({"tp": 2, "loss": "chunked", "loss_chunks": 4}, "--loss chunked"),
    ({"tp": 2, "dp": 2, "fsdp": "full", "fsdp_version": 1}, "--fsdp-version 1"),
    ({"tp": 2, "rank": 2}, "rank 2"),
])
def test_refused_in_one_line(options, names):
    with pytest.raises(TrainmemError) as e:
        _run(**options)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_refused_for_a_family_without_a_plan_and_on_the_cpu():
    with pytest.raises(TrainmemError, match="Llama, Mistral, Qwen2 and Qwen3") as e:
        trace("gpt2", set=["n_layer=2", "n_embd=64", "n_head=4", "vocab_size=1000", "n_positions=128"],
              tp=2, batch_size=2, seq_len=64)
    assert "\n" not in str(e.value)
    with pytest.raises(TrainmemError, match="--device cpu"):
        _run(tp=2, device="cpu")
