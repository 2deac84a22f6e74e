"""DeepSpeed ZeRO-3 makes an untied head's weight gradient whole at its ``MmBackward0``, beside the
logits' gradient and the gathered head, before its hook partitions it (``quantities.zero_partition.deepspeed_head_wgrad``,
moment ``deepspeed.head_wgrad``; v0.14.2 ``stage3.py`` ``__add_grad_to_ipg_bucket`` L1191-1243). Found
by tracing DeepSpeed 0.14.2's engine on Giles Thomas's Llama-3-8B ZeRO-3 row at one token: the traced
peak (31,721 MiB) is the head's ``mm`` backward, which the estimate had no moment for (30,814 MiB; now
31,704). docs/validation.md, sixteenth session."""
from __future__ import annotations

import json
import os

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.estimate.quantities.zero_partition import deepspeed_head_wgrad
from trainmem.estimate.states import model_states
from trainmem.spec.resolve import resolve

PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")
HEAD = 128256 * 4096   # Meta-Llama-3-8B's untied head (vocab x hidden)


def _fx(name: str) -> dict:
    return json.load(open(os.path.join(PUBLISHED, name + ".json")))


def _wgrad(fx: dict, **over) -> int:
    r = resolve(fx["model"], **{**fx["setup"], **over})
    return deepspeed_head_wgrad(r.model, r.training, model_states(r.model, r.training))


def test_head_gradient_whole_in_fp16_under_zero3_only():
    fx = _fx("gpjt_llama3_8b_zero3_s1_dp8_es")
    assert _wgrad(fx) == block_bytes(HEAD * 2, True)
    assert _wgrad(fx, deepspeed_version="0.19.8") == block_bytes(HEAD * 2, True)   # every release
    assert _wgrad(fx, zero=2, zero_init=None) == 0                                # ZeRO-1/2: the bucket path
    tied = dict(fx, model={**fx["model"], "tie_word_embeddings": True})
    assert _wgrad(tied) == 0                                                      # waits in the input buffer
    assert _wgrad(fx, lora_rank=8) == 0                                           # a frozen head


def test_one_token_row_peaks_at_the_head_gradient():
    """At one token the activations are nothing and every layer's matmul weights are kept gathered
    (``deepspeed_linear_kept``): the head's backward, one head gradient above the loss's, is the peak."""
    fx = _fx("gpjt_llama3_8b_zero3_s1_dp8_es")
    r = trainmem.estimate(fx["model"], **fx["setup"])
    assert r.peak_where == "deepspeed.head_wgrad"
    longer = trainmem.estimate(fx["model"], **{**fx["setup"], "seq_len": 1001})
    assert longer.peak_where != "deepspeed.head_wgrad"        # the loss's fp32 logits outweigh it there
