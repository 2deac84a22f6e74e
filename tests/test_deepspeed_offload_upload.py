"""DeepSpeed ZeRO-1/2 with the optimizer offloaded, before v0.17.0, copies the rank's fp32 master partition
to the GPU at each step to cast it into the half partition (``quantities.zero_offload.deepspeed_offload_upload``):
v0.14.2 ``stage_1_and_2.py`` L1868-1871 ``bit16_partitions[partition_id].data.copy_(fp32_partition.to(
get_accelerator().current_device_name()).data)``; DeepSpeed #7309 (first in v0.17.0) replaced it by a
pinned 16-bit host buffer. Found on Giles Thomas's Llama-3-8B ZeRO-2 offload rows (ranks 1-4 at 20,418 MiB,
docs/validation.md)."""
from __future__ import annotations

import json
import os

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.estimate.quantities.zero_offload import deepspeed_offload_upload
from trainmem.estimate.states import model_states
from trainmem.spec.resolve import resolve

MiB = 2 ** 20
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "validation", "published",
                       "gpjt_llama3_8b_zero2_offload_gc_s1_dp8_es.json")
PARAMS = 8_030_261_248   # Meta-Llama-3-8B


def _upload(**over) -> int:
    fx = json.load(open(FIXTURE))
    r = resolve(fx["model"], **{**fx["setup"], **over})
    return deepspeed_offload_upload(r.training, model_states(r.model, r.training))


def test_upload_is_the_fp32_partition_up_to_v0169():
    """ceil(8,030,261,248 / 16) x 2 elements per rank (padded to 2 x dp), 4 B each; none from v0.17.0,
    for a current release, on the device's optimizer or under ZeRO-3."""
    part = -(-PARAMS // 16) * 2
    assert _upload() == block_bytes(part * 4, True)
    assert _upload(deepspeed_version="0.16.9") == block_bytes(part * 4, True)
    assert _upload(dp=2) == block_bytes(-(-PARAMS // 4) * 2 * 4, True)
    for over in ({"deepspeed_version": "0.17.0"}, {"deepspeed_version": None}, {"offload_optimizer": False},
                 {"zero": 3, "offload_optimizer": False}):
        assert _upload(**over) == 0, over


def test_upload_sets_the_step_peak_when_the_partition_is_large():
    """On one rank the partition is the whole model: the step holds the half weights, the offload buffer and
    the fp32 copy (DeepSpeed #7309: "about 3x that of params_FP16"), above every backward moment; v0.17.0's
    step makes nothing on the GPU."""
    fx = json.load(open(FIXTURE))
    setup = {**fx["setup"], "dp": 1}
    old = trainmem.estimate(fx["model"], **{**setup, "deepspeed_version": "0.16.9"})
    new = trainmem.estimate(fx["model"], **{**setup, "deepspeed_version": "0.17.0"})
    weights = PARAMS * 2
    assert old.peak_where == "optimizer.step"
    assert old.peak_allocated >= weights + PARAMS * 4
    assert new.peak_where != "optimizer.step"
    assert new.peak_allocated < weights + PARAMS * 4
