"""A checkpointed BERT layer's first forward replayed tensor by tensor (``estimate/nograd.py``
``bert_layer``, ``reserved.layer_forward._nograd_forward``).

Found on the agreement grid's BERT rows with full recomputation: the replay made all of the layer's
saved tensors at once (eager attention's scores, probabilities and dropout mask, the MLP's
activations) where transformers' ``BertLayer`` under no_grad frees each as the next is made, and
opened segments trace does not.
"""
from __future__ import annotations

import pytest

import trainmem
from alloc_spy import segments
from trainmem.estimate.layers import layer_coefficients
from trainmem.estimate.nograd import NoGradLayer, bert_layer
from trainmem.estimate.quantities.model_facts import layer_key
from trainmem.spec.resolve import resolve

SET = ["num_hidden_layers=2", "max_position_embeddings=4096"]


def _walk(eager: bool, p: float) -> tuple[dict[int, tuple[float, float]], int]:
    """The temporaries alive (index -> (bytes per token, per token x key)) when the layer's output is
    made, and how many were made; each freed at most once, after it is made."""
    S = bert_layer(NoGradLayer(h=64, q=64, kv=64, f=256, stream=4, half=4, weight=4), 2, eager, p, p)
    live: dict[int, tuple[float, float]] = {}
    made = 0
    for e in S.events:
        if e == "o":
            return live, made
        if e == "t":
            live[made] = (S.sizes[made], S.sq[made])
            made += 1
        else:
            assert int(e[1:]) in live, f"temporary {e} freed twice or before it is made"
            del live[int(e[1:])]
    raise AssertionError("no output event")


@pytest.mark.parametrize("eager", [False, True])
def test_alive_at_the_output(eager):
    """At ``BertOutput``'s LayerNorm: its residual sum, the dropped ``dense`` output, the GELU's output,
    the attention output (``BertAttention``'s LayerNorm) and, with eager attention, the dropped
    probabilities (``attn_weights``, held by ``BertLayer.forward``'s ``_``); nothing else."""
    live, _ = _walk(eager, 0.1)
    want = sorted([(64 * 4, 0.0), (64 * 4, 0.0), (256 * 4, 0.0), (64 * 4, 0.0)] + ([(0.0, 2 * 4)] if eager else []))
    assert sorted(live.values()) == want


def test_dropout_adds_its_output_and_mask():
    """Each of the three dropouts (the probabilities' under eager attention, two residual branches')
    makes its output and its bool mask; without dropout neither is made."""
    assert _walk(True, 0.1)[1] - _walk(True, 0.0)[1] == 2 * 3
    assert _walk(False, 0.1)[1] - _walk(False, 0.0)[1] == 2 * 2


@pytest.mark.parametrize("precision,lora,expect", [("fp32", 0, True), ("bf16", 0, True), ("bf16-amp", 0, True),
                                                   ("bf16", 8, False)])
def test_written_in_one_dtype_without_adapters(precision, lora, expect):
    """Written for BERT in one dtype and under autocast; with LoRA (its casts are not written) none."""
    kw = dict(precision=precision, recompute="full", attention="eager", set=SET)
    if lora:
        kw["lora_rank"] = lora
    r = resolve("bert-base-uncased", **kw)
    assert bool(layer_coefficients(layer_key(r.model, r.training)).nograd_events) is expect


def _segments(monkeypatch, run) -> list[int]:
    """Sizes (MiB) of the large segments opened, in order."""
    out: list[int] = []
    segments(monkeypatch, run, lambda pool, size: out.append(size >> 20) if not pool.small else None)
    return out


def test_checkpointed_forward_opens_trace_segments(monkeypatch):
    """BERT-base cut to 2 layers, b2 s1024, fp32, eager attention, full recomputation: before the
    logits (240 MiB blocks) the replay opens the segments trace opens (the 96 MiB scores twice, the
    24 MiB dropout mask once); with the layer's tensors made at once it opened 96, 24, 96, 20, 24
    and 24 MiB ones. With the bottom checkpoint's kept input (``driver._checkpoint_input``) this needs the
    embeddings tensor by tensor (``driver._bert_embeddings_saved``): made as one saved block and the kept
    input, one 20 MiB segment more opened here and, in step 2, one 240 MiB logits segment fewer.
    Every segment of both steps is compared, the logits' too."""
    kw = dict(set=SET, batch_size=2, seq_len=1024, precision="fp32", attention="eager", recompute="full",
              use_cache=False)
    est = _segments(monkeypatch, lambda: trainmem.estimate("bert-base-uncased", **kw))
    tr = _segments(monkeypatch, lambda: trainmem.trace("bert-base-uncased", **kw))
    assert est == tr


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_embeddings_requested_tensor_by_tensor(monkeypatch, precision):
    """BERT's embeddings module under full recomputation (its output the bottom checkpoint's kept input):
    the replay's eight requests of 1 MiB and more from the word embedding on are trace's, in order: word,
    token-type embeddings, their sum, the (1, s, h) position embeddings, the second sum, the LayerNorm's
    output, the dropout's output and its bool mask (``quantities.head_moments.bert_embeddings``,
    ``driver._bert_embeddings_saved``). Before, the replay asked one 7.5 MiB block (fp32) and the kept input.
    (Then trace makes the query's output before the cuBLAS workspace, the replay after it: not compared.)"""
    from alloc_spy import requests
    kw = dict(set=SET, batch_size=2, seq_len=1024, precision=precision, attention="eager", recompute="full",
              use_cache=False)
    hidden = 2 * 1024 * 768 * (4 if precision == "fp32" else 2)
    seen = {}
    for name, run in (("e", trainmem.estimate), ("t", trainmem.trace)):
        out: list[int] = []
        requests(monkeypatch, lambda: run("bert-base-uncased", **kw), lambda n, _s: out.append(n))
        big = [n for n in out if n >= 1 << 20]
        i = big.index(hidden)                                     # the word embedding
        seen[name] = big[i:i + 8]
    assert seen["e"] == seen["t"]
    assert seen["t"][3] == hidden // 2 and seen["t"][7] == hidden // (4 if precision == "fp32" else 2)


def test_per_op_policy_keeps_the_fused_attention_output_only():
    """Under torchtitan's per-op policy BERT's written forward marks the fused SDPA output as kept and
    none of its linears (biased: ``addmm``, which the policy recomputes), matching the recipe's kept
    outputs, so the first forward is replayed tensor by tensor there too."""
    r = resolve("bert-base-uncased", precision="bf16", recompute="op", attention="sdpa", set=SET)
    lc = layer_coefficients(layer_key(r.model, r.training))
    assert len(lc.nograd_op) == 1
    assert lc.nograd_temps[lc.nograd_op[0]] == 768 * 2                # (b, s, h) in bf16
    assert [a for a, _b in lc.op_tensors if a == 768 * 2] == [768 * 2]  # the recipe's kept: that output


def test_per_op_policy_row_follows_trace(bench):
    """The agreement grid's BERT b8 s256 bf16 fused AdamW, per-op recomputation: +1.25 % against trace's
    peak reserved memory with the layer's tensors made at once, -0.31 % tensor by tensor."""
    r = bench.compare(bench.Case("bert", 8, 256, (("optimizer", "adam"), ("optimizer_impl", "fused"),
                                                  ("precision", "bf16"), ("recompute", "op"))), reserved=True)
    assert abs(r.reserved_diff) < 0.01, r.reserved_diff


def test_per_op_workspace_at_the_query_linear(monkeypatch):
    """Under the per-op policy the forward thread's cuBLAS workspace (8.125 MiB) is made inside the first
    matmul, right after its output (``_first_mm_workspace``): BERT's ``query`` linear (b2 s512 bf16: a
    1.5 MiB (b, s, h) output; trace makes the workspace right after it), not after the fused SDPA output
    the policy keeps (three linears and the attention later). Before it, as in trace, the embeddings'
    dropout output, the layer's input the checkpoint keeps (``reserved.driver._checkpoint_input``), and
    before that what the embeddings saved (the replay's one block, trace's tensors: not compared)."""
    from alloc_spy import requests
    kw = dict(set=SET, batch_size=2, seq_len=512, precision="bf16", attention="sdpa", recompute="op", use_cache=False)
    hidden = 2 * 512 * 768 * 2
    seen = {}
    for name, run in (("e", trainmem.estimate), ("t", trainmem.trace)):
        out: list[int] = []
        requests(monkeypatch, lambda: run("bert-base-uncased", **kw), lambda n, _s: out.append(n))
        big = [n for n in out if n >= 1 << 20]
        i = big.index(8519680)                                    # the workspace
        seen[name] = big[i - 2:i]
    assert seen["e"] == seen["t"] == [hidden, hidden]             # the layer's input, the query's output


def _signed(monkeypatch, run) -> list[float]:
    """Every request (MiB, two decimals) and free (negative) of 1 MiB and over while ``run()`` runs."""
    from trainmem import allocator
    seen: list[float] = []
    free = allocator.CachingAllocator.free

    def spy_free(self, handle):
        if handle in self._live and self._live[handle].requested >= 1 << 20:
            seen.append(-round(self._live[handle].requested / 2**20, 2))
        return free(self, handle)
    monkeypatch.setattr(allocator.CachingAllocator, "free", spy_free)
    from alloc_spy import requests
    requests(monkeypatch, run, lambda n, _s: seen.append(round(n / 2**20, 2)) if n >= 1 << 20 else None)
    return seen


def _around_scores(events: list[float], scores: float) -> list[float]:
    """From six events before the first request of the scores' size (the first layer's attention) to
    30 after."""
    i = events.index(scores)
    return events[max(0, i - 6):i + 30]


@pytest.mark.parametrize("recompute", ["full", "op"])
def test_autocast_eager_forward_in_trace_order(monkeypatch, one_torch_thread, recompute):
    """A narrow BERT (h 256, 4 heads) b4 s512 bf16-amp, eager attention, checkpointed: the first layer's
    requests and frees around its attention equal trace's: each linear's half input cast freed after its
    matmul, the half scores and scaled scores, softmax's fp32 input cast and output (autocast's fp32
    list), the fp32 dropout and its mask, the probabilities' half cast for the second matmul (before:
    the layer's tensors at once in one dtype; under the per-op policy the replay did not write eager
    attention's layer at all, its policy keeping nothing of it)."""
    from test_mlm_head_backward_replay import NARROW
    kw = dict(batch_size=4, seq_len=512, precision="bf16-amp", attention="eager", recompute=recompute)
    scores = round(4 * 4 * 512 * 512 * 2 / 2**20, 2)               # (b, heads, s, s) in bf16
    ours = _around_scores(_signed(monkeypatch, lambda: trainmem.estimate(NARROW, **kw)), scores)
    theirs = _around_scores(_signed(monkeypatch, lambda: trainmem.trace(NARROW, **kw)), scores)
    assert 2 * scores in theirs and ours == theirs


def test_one_sequence_makes_no_reshape_copies(monkeypatch, one_torch_thread):
    """At b = 1 the (1, heads, s, d) views fold into (heads, s, d) without copies: the first forward's
    requests through both layers' forward are trace's (BERT-base b1 s1024 fp32 eager, full recomputation;
    before, the query's, key's and value's 3 MiB copies around the scores)."""
    from test_mlm_head_side_replay import BERT
    kw = dict(batch_size=1, seq_len=1024, precision="fp32", attention="eager", recompute="full")
    logits = round(1024 * 30522 * 4 / 2**20, 2)                   # (1, s, vocab) fp32
    scores = round(12 * 1024 * 1024 * 4 / 2**20, 2)                # (1, heads, s, s) fp32

    def made(run):
        """From the first layer's key and value outputs (the workspace made around the query's differs)
        to the second layer's scores, before the logits."""
        events = [x for x in _signed(monkeypatch, run) if x > 0]
        events = events[:events.index(logits)]
        return events[events.index(scores) - 2:len(events) - events[::-1].index(scores)]
    assert made(lambda: trainmem.estimate(BERT, **kw)) == made(lambda: trainmem.trace(BERT, **kw))
