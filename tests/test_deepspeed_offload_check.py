"""DeepSpeed ZeRO-1/2 with the optimizer offloaded checks each gradient of the rank's partition for
inf/NaN elementwise before handing it to the host (``quantities.zero_offload.deepspeed_offload_check``): v0.14.2
``stage_1_and_2.py`` ``copy_grads_in_partition`` L1320-1333 -> ``update_overflow_tracker_for_param_grad``
L1167-1170 -> ``_has_inf_or_nan`` L2019-2025 (an fp32 copy, three bool masks, a second fp32 tensor: 11 B
per element of the whole gradient, all alive at once), replaced by a max/min test in DeepSpeed #8325
(``runtime/utils.py`` ``has_inf_or_nan``, first in v0.19.6), after which the norm's float64 copy is the
largest step (``quantities.zero_offload.deepspeed_offload_steps``). Found on Giles Thomas's Llama-3-8B ZeRO-2 offload
rows over 8 GPUs (docs/validation.md, fifteenth session)."""
from __future__ import annotations

import json
import os

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.estimate.quantities.zero_offload import deepspeed_offload_check, deepspeed_offload_check_head
from trainmem.spec.resolve import resolve

MiB = 2 ** 20
PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")
EMB = 128256 * 4096   # Meta-Llama-3-8B's embedding (and untied head) elements


def _fixture(name: str) -> tuple[dict, trainmem.MemoryReport, dict]:
    fx = json.load(open(os.path.join(PUBLISHED, name + ".json")))
    r = trainmem.estimate(fx["model"], **fx["setup"])
    return fx, r, {m["quantity"]: m["mib"] * MiB for m in fx["measured"]}


def _check(fx: dict, **over) -> tuple[int, int]:
    m, t, st = _resolved(fx, **over)
    return deepspeed_offload_check(m, t, st)


def _resolved(fx: dict, **over):
    from trainmem.estimate.states import model_states
    r = resolve(fx["model"], **{**fx["setup"], **over})
    return r.model, r.training, model_states(r.model, r.training)


def test_check_is_eleven_bytes_of_the_embedding_beside_its_own_gradient():
    """Rank 0's partition (ceil(8,030,261,248 / 8) elements) starts with the embedding, its largest
    parameter; 525,336,576 elements pass ``reduce_bucket_size`` (5e8), so its fp16 gradient is its own
    tensor (``extra_large_param_to_reduce``) while the check runs."""
    fx = json.load(open(os.path.join(PUBLISHED, "gpjt_llama3_8b_zero2_offload_gc_s1_dp8_es.json")))
    own, check = _check(fx)
    assert own == block_bytes(EMB * 2, True)
    assert check == 2 * block_bytes(EMB * 4, True) + 3 * block_bytes(EMB, True)
    # a bucket larger than the embedding takes its gradient into the bucket buffer (a view, no own tensor)
    own, check2 = _check(fx, reduce_bucket_size=600_000_000)
    assert own == 0 and check2 == check
    # offloading forces contiguous gradients on (``contiguous_gradients or self.cpu_offload``, v0.14.2 L205)
    assert _check(fx, reduce_bucket_size=600_000_000, contiguous_gradients=False) == (0, check)


def test_largest_step_is_the_check_up_to_v0195_then_the_norms_float64_copy():
    """Up to v0.19.5 the elementwise check (11 B per element) is the largest of the three steps; v0.19.6
    (#8325) checks with ``amax``/``amin``, so the norm's float64 copy (8 B per element) is, as at v0.19.8
    and a current release. ZeRO-3 and an optimizer on the device have none of it."""
    fx = json.load(open(os.path.join(PUBLISHED, "gpjt_llama3_8b_zero2_offload_gc_s1_dp8_es.json")))
    eleven = 2 * block_bytes(EMB * 4, True) + 3 * block_bytes(EMB, True)
    assert _check(fx, deepspeed_version="0.19.5")[1] == eleven
    for v in ("0.19.6", "0.19.8", None):
        assert _check(fx, deepspeed_version=v) == (block_bytes(EMB * 2, True), block_bytes(EMB * 8, True))
    assert _check(fx, offload_optimizer=False) == (0, 0)
    z3 = json.load(open(os.path.join(PUBLISHED, "gpjt_llama3_8b_zero3_s1_dp8_es.json")))
    assert _check(z3) == (0, 0)


def test_head_check_only_for_an_untied_head_reduced_at_the_top():
    """The head's gradient is backward's first; the final norm's hook reduces its bucket when the two pass
    ``reduce_bucket_size``: there its check runs, on the rank that holds the head. Tied heads have none;
    a bucket holding both reduces later (not counted)."""
    fx = json.load(open(os.path.join(PUBLISHED, "gpjt_llama3_8b_zero2_offload_gc_s1_dp8_es.json")))
    m, t, st = _resolved(fx)
    assert deepspeed_offload_check_head(m, t, st) == deepspeed_offload_check(m, t, st)   # same size as the embedding
    m, t, st = _resolved(fx, reduce_bucket_size=600_000_000)
    assert deepspeed_offload_check_head(m, t, st) == (0, 0)
    tied = dict(fx, model={**fx["model"], "tie_word_embeddings": True})
    m, t, st = _resolved(tied)
    assert deepspeed_offload_check_head(m, t, st) == (0, 0)
    assert deepspeed_offload_check(m, t, st)[1] > 0


def test_published_rows_peak_at_the_worst_ranks_check():
    """Rank 0's peak (23,929 MiB at every sequence length: the embedding's check comes after the
    activations are freed) and rank 7's (the head's check at the top of backward, beside the 32
    checkpointed layer inputs: 24,205 and 24,484 MiB at 1001 and 2001 tokens) were 15-20 % over the
    estimate; the estimate's peak is now the worse of the two checks, within 1 % of the worst rank."""
    for s in (1, 1001, 2001):
        _fx, r, measured = _fixture(f"gpjt_llama3_8b_zero2_offload_gc_s{s}_dp8_es")
        assert r.peak_where in ("deepspeed.offload_check", "deepspeed.offload_check.head")
        assert s == 1 or r.peak_where == "deepspeed.offload_check.head"
        assert abs(r.peak_allocated / measured["peak_active"] - 1) < 0.01


def test_qwen_one_gpu_rows_do_not_peak_at_the_check():
    """Qwen1.5-0.5B on one GPU (batch 1, 2048 tokens): the embedding's check (151936 x 1024 x 11 B,
    1,632 MiB) is below the loss's peak; these rows stay within 0.2 %."""
    _fx, r, measured = _fixture("gpjt_qwen15_05b_zero2_offload_gc_b1_s2048_es")
    assert r.peak_where != "deepspeed.offload_check"
    assert abs(r.peak_allocated / measured["peak_active"] - 1) < 0.002


def test_rank0_gradients_are_its_partition_in_registration_order():
    """Rank 0 hands the host the parameters overlapping its ceil(8,030,261,248 / 8) elements: the
    embedding whole first, the last one only in part (``grad_position``'s ``num_elements``); the
    replay takes them in backward's order, the embedding's three steps last."""
    from trainmem.estimate.quantities.zero_offload import deepspeed_offload_epilogue, deepspeed_offload_grads
    fx = json.load(open(os.path.join(PUBLISHED, "gpjt_llama3_8b_zero2_offload_gc_s1_dp8_es.json")))
    m, t, st = _resolved(fx)
    grads = deepspeed_offload_grads(m, t, st)
    assert grads[0] == (EMB, EMB)
    assert sum(piece for piece, _whole in grads) == -(-st.trainable // 8)
    assert grads[-1][0] < grads[-1][1]                          # cut by the partition's end
    assert deepspeed_offload_epilogue(m, t, st)[-3:] == ((EMB * 8,), (EMB * 4, EMB, EMB, EMB, EMB * 4), (EMB * 4,))
