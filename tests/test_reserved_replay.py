"""The estimate's peak reserved memory: its step replayed through the caching-allocator simulator
(``trainmem.estimate.reserved``), checked against trace's block-by-block simulation of the real step.

The cases are those where the old rule (reserved = allocated + 1/32) was furthest from trace: a
vocabulary-sized loss whose freed fp32 blocks are split by the optimizer states, FSDP, per-tensor
optimizer temporaries. Each must land within 3% of trace's reserved peak, where the rule missed by
4% to 18% (measured when the replay was written: +1.0%, -0.4%, -0.2%, +0.4%, -1.2%, -0.9%, -1.8%;
since FSDP's side streams have pools of their own and the cuBLAS workspaces and each layer's
forward-only tensors are replayed: +0.8%, -0.8%, +0.6%, +0.4%, +0.6%, +1.8%, -1.7%; since each
linear's weight copy and gradients are replayed one by one: the same but the pipeline's, -0.1%).
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem.estimate.reserved.layer_forward import _kept_blocks
from trainmem.estimate.reserved.loss_forward import _logit_tensors
from trainmem.estimate.reserved.replay import _scaled
from trainmem.estimate.states import parameter_order as _parameter_order

L2 = ["num_hidden_layers=2"]

CASES = [
    ("llama-3.2-1b", dict(set=L2, batch_size=4, seq_len=1024, precision="bf16-amp", recompute="full")),
    ("gpt2", dict(set=["n_layer=2"], batch_size=8, seq_len=1024, precision="fp32")),
    ("qwen2.5-0.5b", dict(set=L2, batch_size=4, seq_len=1024, precision="bf16", fsdp="full", dp=4)),
    ("qwen2.5-0.5b", dict(set=L2, batch_size=4, seq_len=1024, precision="bf16-amp", optimizer_impl="for-loop")),
    ("llama-3.2-1b", dict(set=L2, batch_size=2, seq_len=1024, precision="bf16", lora_rank=16)),
    # FSDP2 with torchtitan's mixed precision: flat all-gather outputs, fp32 reduce-scatter inputs
    ("llama-3.1-8b", dict(set=["num_hidden_layers=4"], batch_size=1, seq_len=4096, precision="bf16-mp",
                          fsdp="full", dp=8)),
    # a 1F1B pipeline's first stage: four micro-batches in flight before the first backward
    ("llama-3.2-1b", dict(batch_size=1, seq_len=1024, precision="bf16-amp", pp=4, grad_accum=8)),
]


@pytest.mark.parametrize("model,kw", CASES, ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}={v}" for k, v in x.items() if k != "set"))
def test_estimate_reserved_follows_trace(model, kw):
    est = trainmem.estimate(model, gpu="h100", **kw)
    tr = trainmem.trace(model, gpu="h100", **kw)
    assert est.peak_allocated == pytest.approx(tr.peak_allocated, rel=0.005)
    rule = est.peak_allocated + est.peak_allocated // 32
    err, rule_err = est.peak_reserved / tr.peak_reserved - 1, rule / tr.peak_reserved - 1
    assert abs(err) <= 0.03, (err, rule_err)
    assert abs(err) < abs(rule_err)


#: one GPU, full fine-tuning under autocast (fp32 weights, bf16 matmuls): the replay missed each
#: linear's weight copy and its half and fp32 gradients (one block per layer before), the head's half
#: weight gradient and a tied embedding's sum, and made the optimizer's states grouped by tensor kind
#: rather than in parameter order. Before those: -4.8%, -4.4%, -3.4%, +4.9%, +4.7% against trace;
#: after: +0.2%, -0.1%, -0.1%, -0.5%, -0.4%.
AUTOCAST = [
    ("llama-3.2-1b", dict(set=L2, batch_size=2, seq_len=512, precision="bf16-amp")),
    ("llama-3.2-1b", dict(batch_size=2, seq_len=512, precision="bf16-amp")),
    ("llama-3.2-1b", dict(set=["tie_word_embeddings=false"], batch_size=2, seq_len=512, precision="bf16-amp")),
    ("gpt2-medium", dict(batch_size=2, seq_len=512, precision="bf16-amp")),
    ("qwen2.5-0.5b", dict(batch_size=2, seq_len=512, precision="bf16-amp")),
]


@pytest.mark.parametrize("model,kw", AUTOCAST, ids=lambda x: x if isinstance(x, str) else
                         "-".join(str(v) for v in x.get("set", ["as-configured"])))
def test_reserved_under_autocast_follows_trace(model, kw):
    est = trainmem.estimate(model, gpu="h100", **kw)
    tr = trainmem.trace(model, gpu="h100", **kw)
    assert est.peak_reserved == pytest.approx(tr.peak_reserved, rel=0.01)


def test_reserved_without_a_gpu_and_verdict_rule():
    """Reserved memory needs no --gpu; the fit verdict stays on allocated + 1/32 + context, as trace's."""
    r = trainmem.estimate("gpt2", batch_size=4, seq_len=512)
    assert r.peak_reserved is not None and r.peak_reserved >= r.peak_allocated
    g = trainmem.estimate("gpt2", batch_size=4, seq_len=512, gpu="a100-80gb")
    assert g.peak_reserved == r.peak_reserved
    assert g.device_used == g.peak_reserved + g.hardware.context
    assert g.device_peak == g.peak_allocated + g.peak_allocated // 32 + g.hardware.context


def test_logit_tensors_split_into_whole_tensors():
    # upcast loss backward: two fp32 logits-sized gradients
    assert _logit_tensors(800, 8, 100) == [400, 400]
    # amp: an fp32 and a half tensor
    assert _logit_tensors(600, 6, 100) == [400, 200]
    # four chunks of a half tensor, plus one chunk's transient (a block of what is left)
    assert _logit_tensors(200 + 50, 2, 100, chunks=4) == [50, 50, 50, 50, 50]
    assert _logit_tensors(0, 0, 100) == []


def test_kept_blocks_and_scaling():
    assert _kept_blocks([10, 30], 7, "full") == [7]
    assert _kept_blocks([10, 30], 20, "op") == [5, 15]
    assert _scaled([1, 3], 8) == [2, 6]
    assert _scaled([], 8) == [] and _scaled([1, 1], 0) == []


def test_states_in_parameter_order():
    """``model.parameters()``'s order: before the layers, each layer's tensors (its own adapters after
    the shared items), after the layers; one index per tensor copy."""
    items = (("before", 1, 8, (), 0), ("layer", 2, 4, (), 0), ("layer", 2, 2, (), 0), ("layer1", 1, 1, (), 0),
             ("after", 1, 16, (), 0))
    assert _parameter_order(items) == (0, 1, 2, 1, 2, 3, 4)


def test_phase_reserved_against_scherrmanns_measurement():
    """Moritz Scherrmann measured ``torch.cuda.memory_reserved()`` after loading BERT-large and after
    each forward (fp32, batch 4, seq 512). The replay's reserved memory at those phase ends must be
    within 1.5% of his numbers and within 0.5% of trace's simulation of the same step. When written:
    exact at the load, -0.34% and -0.73% at the forwards. Since the replay makes Adam's states in
    parameter order, as ``torch.optim`` does (it grouped them by tensor kind before): exact, -0.10%,
    -1.24%, where trace is exact, 0.00%, -1.30% (trace's cache after the first step differs from the
    real run's by that; the grouped order had made up for it by chance: +1.0% against trace)."""
    from trainmem.validate import _predict, _value, load_fixtures, quantity
    fx = next(f for f in load_fixtures() if f["_path"].endswith("scherrmann_bert_large_fp32.json"))
    rep, tr = _predict(trainmem.estimate, fx), _predict(trainmem.trace, fx)
    checked = 0
    for item in fx["measured"]:
        if item["quantity"].endswith(":reserved"):
            got, want = quantity(rep, item["quantity"]), _value(item)
            assert got is not None and abs(got / want - 1) <= 0.015, (item["quantity"], got, want)
            assert got == pytest.approx(quantity(tr, item["quantity"]), rel=0.005), item["quantity"]
            checked += 1
    assert checked == 3


def test_held_embeddings_free_a_block_for_the_backward_workspace():
    """Pure bf16 (Qwen3-0.6B, 2 layers, batch 8, seq 2048, the H200's 32 MiB cuBLAS workspaces):
    transformers' ``Qwen3Model.forward`` holds the embedding output as ``inputs_embeds`` until it
    returns, so its 32 MiB block is free when the head's first backward matmul allocates autograd's
    workspace; without it the workspace split a 9.3 GiB logits-sized segment for good and the second
    step's loss needed a new one (before: +25.8% against trace; after: -0.4%)."""
    kw = dict(set=L2, batch_size=8, seq_len=2048, precision="bf16", gpu="h200")
    est, tr = trainmem.estimate("qwen3-0.6b", **kw), trainmem.trace("qwen3-0.6b", **kw)
    assert est.peak_allocated == pytest.approx(tr.peak_allocated, rel=0.001)
    assert est.peak_reserved == pytest.approx(tr.peak_reserved, rel=0.01)


def test_held_embeddings_only_for_a_transformers_decoder_in_half():
    from trainmem.estimate.layers import Policy
    from trainmem.estimate.quantities.build import quantities
    from trainmem.estimate.quantities.head_moments import held_embeddings
    from trainmem.spec.resolve import resolve
    r = resolve("llama-3.2-1b", precision="bf16", batch_size=1, seq_len=128)
    assert held_embeddings(r.model, r.training, Policy.of("bf16")) == r.model.hidden_size * 2
    amp = resolve("llama-3.2-1b", precision="bf16-amp", batch_size=1, seq_len=128)
    assert held_embeddings(amp.model, amp.training, Policy.of("bf16-amp")) == 0
    titan = resolve("llama-3.2-1b", framework="torchtitan", precision="bf16", batch_size=1, seq_len=128)
    assert held_embeddings(titan.model, titan.training, Policy.of("bf16")) == 0
    gpt2 = resolve("gpt2", precision="bf16", batch_size=1, seq_len=128)
    assert held_embeddings(gpt2.model, gpt2.training, Policy.of("bf16")) == 0
    # Phi-2's LayerNorm saves its bf16 input: the embedding output is the first layer's saved tensor
    phi = resolve("phi-2", precision="bf16", batch_size=1, seq_len=128, transformers_version="5.17.0")
    assert quantities(phi.model, phi.training, "first").embeds_tok == 0
    qwen3 = resolve("qwen3-0.6b", precision="bf16", batch_size=1, seq_len=128, transformers_version="5.17.0")
    assert quantities(qwen3.model, qwen3.training, "first").embeds_tok == qwen3.model.hidden_size * 2


def test_full_recompute_keeps_autocast_copies_until_the_forward_ends():
    """Full recomputation under autocast (``reserved.layer_forward._checkpointed``, ``_recompute_casts``): the first
    forward's half weight copies stay in autocast's cache until the loss is computed, the layer's own
    tensors each live until the next is made, and the recomputed forward makes the copies again.
    Against trace (H200 workspaces): Qwen2.5-1.5B with 2 layers, batch 4, seq 2048 went from -19.5%
    to -1.4%; Llama-3.2-1B with 4 layers from +0.4% to -0.7%, its first forward's reserved memory
    from +4.1% to -1.1% (the phase column had added the copies the replay lacked)."""
    kw = dict(batch_size=4, seq_len=2048, precision="bf16-amp", recompute="full", gpu="h200")
    q = dict(kw, set=L2)
    est, tr = trainmem.estimate("qwen2.5-1.5b", **q), trainmem.trace("qwen2.5-1.5b", **q)
    assert est.peak_reserved == pytest.approx(tr.peak_reserved, rel=0.02)
    ll = dict(kw, set=["num_hidden_layers=4"])
    est, tr = trainmem.estimate("llama-3.2-1b", **ll), trainmem.trace("llama-3.2-1b", **ll)
    assert est.peak_reserved == pytest.approx(tr.peak_reserved, rel=0.01)
    assert est.phase("forward", 1).reserved == pytest.approx(tr.phase("forward", 1).reserved, rel=0.015)
    assert est.phase("backward", 1).reserved == pytest.approx(tr.phase("backward", 1).reserved, rel=0.01)


def test_a_whole_block_handed_out_counts_in_the_gap():
    """A large block is split only when more than 1 MiB would remain (``should_split``), so the 17th
    1.125 MiB gradient of a 20 MiB segment takes its whole 2 MiB tail: ``memory_allocated`` counts
    the block, the estimate's allocated peak counts ``block_bytes`` of the request. The replay's gap
    is reserved minus its allocated peak net of that excess, so the excess reaches the reserved
    estimate; blocks placed by the load are not counted again (the weights are at their placement)."""
    from trainmem.allocator import CachingAllocator
    from trainmem.allocator_rules import LARGE_BUFFER, block_bytes
    from trainmem.estimate.reserved.replay import _Replay
    n = 768 * 768 * 2                                      # one bf16 768 x 768 gradient, 1.125 MiB
    R = _Replay()
    R.mark("model_loaded", 0)
    hs = R.allocs([n] * 17)
    tail = R.a.block_size(hs[-1])
    assert tail == LARGE_BUFFER - 16 * n > block_bytes(n)  # the unsplit tail
    assert R.a.peak_allocated == R.a.reserved == LARGE_BUFFER
    assert R.peaks() == (17 * n, LARGE_BUFFER)             # the gap: the tail's excess
    R.free(hs[-1])
    assert R.over == 0
    loaded = _Replay()
    loaded.allocs([n] * 17)                                # the same blocks placed by the load
    loaded.mark("model_loaded", 0)
    assert loaded.peaks() == (LARGE_BUFFER, LARGE_BUFFER)
    expandable = _Replay(CachingAllocator(expandable_segments=True))
    expandable.mark("model_loaded", 0)
    expandable.allocs([n] * 17)                            # expandable segments split every block
    assert expandable.peaks()[0] == expandable.a.peak_allocated == 17 * n


def test_a_block_of_several_tensors_keeps_its_excess():
    """A block that stands for several tensors (``one=False``: a derived layer's parts by module and
    op, a backward moment's transient) has no placement of its own: the tail it takes is counted as
    allocated, not netted into the gap; a logits term's rest is such a block (``_Sizes.whole``)."""
    from trainmem.allocator_rules import LARGE_BUFFER, block_bytes
    from trainmem.estimate.reserved.loss_forward import _logit_allocs, _Sizes
    from trainmem.estimate.reserved.replay import _Replay
    n = 768 * 768 * 2
    R = _Replay()
    R.mark("model_loaded", 0)
    R.allocs([n] * 16)
    h = R.alloc(n, one=False)                              # the 2 MiB tail, taken whole
    assert R.a.block_size(h) > n and R.over == 0
    assert R.peaks() == (LARGE_BUFFER, LARGE_BUFFER)       # no gap: the tail counts as allocated
    sizes = _logit_tensors(200 + 50, 2, 100, chunks=4)
    assert sizes.whole == 4 and _logit_tensors(800, 8, 100).whole == 2
    for whole, over in ((1, LARGE_BUFFER - 16 * n - block_bytes(n)), (0, 0)):  # the tail a whole tensor's, a rest's
        S = _Replay()
        S.mark("model_loaded", 0)
        S.allocs([n] * 16)
        _logit_allocs(S, _Sizes([n], whole))
        assert S.over == over and S.peaks()[0] == LARGE_BUFFER - over


#: Raschka's ViT precision benchmark, 06_bf16-full, as trace runs it (transformers' ViT): the
#: gradients and states of the 768 x 768 and 768 x 3072 weights land in unsplit tails of earlier
#: blocks. Before the replay's allocated peak was counted net of that excess: -1.52% (1680.2 MiB
#: against trace's 1706.0); after: 0.00%.
VIT_HALF = dict(set=["num_labels=10"], batch_size=16, precision="bf16", optimizer="adam", zero_grad="zeros",
                hold_output="step", image_size=224, gpu="a100-40gb")


def test_pure_half_vit_reserved_follows_trace():
    est = trainmem.estimate("vit-base-patch16-224", **VIT_HALF)
    tr = trainmem.trace("vit-base-patch16-224", **VIT_HALF)
    assert est.peak_reserved == pytest.approx(tr.peak_reserved, rel=0.003)
