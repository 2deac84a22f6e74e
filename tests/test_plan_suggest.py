"""suggest: single changes, each estimated, cheapest first, semantics marked; chunked cross-entropy."""
import pytest

import trainmem
from trainmem.estimate.layers import layer_coefficients
from trainmem.estimate.quantities.model_facts import layer_key
from trainmem.errors import TrainmemError
from trainmem.plan import format_suggestions, suggest, suggest_for_report

BASE = dict(gpu="a100-40gb", batch_size=4, seq_len=2048, dp=8, attention="eager")


@pytest.fixture(scope="module")
def sugg():
    return suggest("llama-3.2-1b", **BASE)


def test_every_single_change_is_estimated(sugg):
    base = trainmem.estimate("llama-3.2-1b", **BASE)
    names = [s.name for s in sugg]
    for want in ("flash-attention", "chunked-cross-entropy", "zero-1", "recompute-selective", "micro-batch-2",
                 "tp-x2", "recompute-full", "adamw-8bit", "pure-bf16", "offload-optimizer", "lora"):
        assert want in names, want
    # the peak is the start of backward (logits and their fp32 copies): applying the optimizer in
    # backward saves nothing there, so it is not offered; where the optimizer step peaks, it is
    small = suggest("llama-3.2-1b", gpu="a100-40gb", batch_size=1, seq_len=256)
    assert "optimizer-in-backward" not in names and "optimizer-in-backward" in [x.name for x in small]
    for s in sugg:
        r = trainmem.estimate("llama-3.2-1b", **{**BASE, **{k: v for k, v in s.change.items() if v is not None}})
        assert (s.peak_allocated, s.device_used, s.fits) == (r.peak_allocated, r.device_peak, r.fits)
        assert s.saved == base.device_peak - r.device_peak > 0


def test_sorted_by_cost_semantics_marked(sugg):
    singles = [s for s in sugg if s.name != "combined"]
    keys = [s.order for s in singles]
    assert keys == sorted(keys)
    sem = {s.name for s in singles if s.changes_semantics}
    assert sem == {"adamw-8bit", "pure-bf16", "lora"}
    first = [s.name for s in singles][:4]
    assert first[0] == "flash-attention" and "chunked-cross-entropy" in first
    half = next(s for s in sugg if s.name == "micro-batch-2")
    assert half.change == {"batch_size": 2, "grad_accum": 2}   # same sequences per step


def test_chunked_cross_entropy_upcasts_one_chunk_at_a_time():
    # torchtune's chunked output loss (--loss-chunks N alone means --loss chunked): every chunk's
    # half logits and fp32 log-probabilities are kept, so the end of forward is unchanged; the fp32
    # copy (forward) and the two fp32 gradients at the start of backward exist for one chunk only
    one = trainmem.estimate("llama-3.2-1b", batch_size=2, seq_len=1024, keep_logits=True)
    four = trainmem.estimate("llama-3.2-1b", batch_size=2, seq_len=1024, loss_chunks=4, keep_logits=True)
    assert four.training.loss == "chunked"
    n, v = 2 * 1024, 128256
    # the chunked loop takes the decoder's hidden states and drops the model output with its KV cache
    # (quantities.build._output_cache): the output `one` holds keeps what of the cache autograd does not save
    # (``held``) at the end of forward, and at the loss also the previous step's whole cache (``cache``)
    lc = layer_coefficients(layer_key(one.model, one.training))
    cache_end, cache_loss = 16 * n * lc.held, 16 * n * (lc.held + lc.cache)  # 16 layers
    assert one.phase("forward", 2).allocated - four.phase("forward", 2).allocated == cache_end > 0
    # + the final norm's fp32 output, which the model's own loss (not the chunked one) runs beside
    # (estimate.quantities.outer.head_during_loss)
    assert one.phase("forward", 2).peak - four.phase("forward", 2).peak == \
        (n - n // 4) * v * 4 + n * 2048 * 4 + cache_loss
    # backward: the two fp32 gradients exist for one chunk, but every chunk's half logits gradient
    # waits for the head's backward (moments._head_backward; trace agrees, test_loop_options)
    drop = one.phase("backward", 2).peak - four.phase("backward", 2).peak
    assert (n - n // 4) * v * 8 - n * v * 2 <= drop < (n - n // 4) * v * 8
    # at cross_entropy's backward (the peak from 2 x 2048 tokens: at 2 x 1024 it can be the optimizer
    # step's, where the held output's KV cache weighs as much) the half logits and the fp32 log-probabilities
    longer = trainmem.estimate("llama-3.2-1b", batch_size=2, seq_len=2048, keep_logits=True)
    assert longer.peak_allocated == longer.phase("backward", 2).peak
    assert longer.component("logits.logits") == 2 * n * v * 2 and longer.component("logits.log_probs") == 2 * n * v * 4
    three = trainmem.estimate("llama-3.2-1b", batch_size=2, seq_len=1024, loss_chunks=3, keep_logits=True)
    chunk = -(-n // 3)  # ceil: the largest chunk
    assert (n - chunk) * v * 8 - n * v * 2 <= one.phase("backward", 2).peak - three.phase("backward", 2).peak
    with pytest.raises(TrainmemError, match="loss-chunks"):
        trainmem.estimate("llama-3.2-1b", loss_chunks=0)
    with pytest.raises(TrainmemError, match="--loss chunked needs --loss-chunks"):
        trainmem.estimate("llama-3.2-1b", loss="chunked")
    with pytest.raises(TrainmemError, match="needs --loss chunked"):
        trainmem.estimate("llama-3.2-1b", loss="upcast", loss_chunks=4)


def test_not_applicable_changes_are_left_out():
    # fp32: no flash; seq-cls head: no chunked loss; dp = 1: no ZeRO; batch 1: nothing to halve
    s = suggest("bert-base-uncased", gpu="t4", precision="fp32", batch_size=1, seq_len=512,
                set=['architectures=["BertForSequenceClassification"]'])
    names = {x.name for x in s}
    assert names and not any(n in ("flash-attention", "chunked-cross-entropy", "zero-1") or n.startswith("micro-batch")
                             for n in names)


def test_format(sugg):
    text = format_suggestions(sugg, detail=True)
    assert "flash" in text and "[changes training]" in text and "GiB" in text
    assert format_suggestions([]) .startswith("no single change")


def test_hook_from_a_report(sugg):
    r = trainmem.estimate("llama-3.2-1b", **BASE)
    assert r.fits is False
    again = suggest_for_report(r)
    assert [(s.name, s.device_used) for s in again] == [(s.name, s.device_used) for s in sugg]
