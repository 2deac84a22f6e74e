"""DeepSpeed ZeRO-1/2's reduction of the last bucket at backward's epilogue makes a flat copy of each group of
partition slices ``allreduce_and_scatter`` gathers past ``reduce_bucket_size`` (``quantities.zero_partition.deepspeed_epilogue_cats``,
``reserved.zero_step._zero12_epilogue``): ``average_tensor`` cuts the bucket into one slice per partition, merged by rank,
and ``allreduce_bucket``'s ``self.flatten`` concatenates a group of more than one (v0.19.8 ``stage_1_and_2.py``
L1590-1725, L2359-2367).

Found by the agreement grid's row ``gemma2 1x2048 attention=eager dp=4 optimizer=sgd overlap_comm precision=fp16
recompute=full zero=1``: trace makes a 1066.5 MiB ``cat`` of the embedding's first three partition slices on
the reduction stream before ``grads_in_partition`` (-7.43 % before)."""
from __future__ import annotations

import pytest

from trainmem.estimate.quantities.zero_partition import deepspeed_epilogue_cats
from trainmem.estimate.states import model_states
from trainmem.spec.resolve import resolve

ROW = dict(batch_size=1, seq_len=2048, attention="eager", dp=4, optimizer="sgd", overlap_comm=True, precision="fp16",
           recompute="full", zero=1)
SET = ["num_hidden_layers=2"]
TRAINABLE = 745_558_272          # Gemma-2-2B cut to 2 layers; its embedding 256000 x 2304 = 589,824,000


def _cats(**over) -> tuple[int, ...]:
    r = resolve("gemma-2-2b", **{**ROW, "set": SET, **over})
    return deepspeed_epilogue_cats(r.model, r.training, model_states(r.model, r.training))


def test_the_embeddings_first_three_slices():
    """The last bucket is the embedding alone (589.8M elements, larger than the 5e8 bucket); its slices on
    ranks 0-2 are whole partitions (ceil(745,558,272 / 8) x 2 elements each) and pass 5e8 together: one
    ``cat`` of 3 partitions in fp16; rank 3's slice alone is a view. Two ranks: a partition of 372.8M
    elements and the embedding's rest on rank 1 (217.0M) together pass 5e8: one ``cat`` of both slices."""
    part = -(-TRAINABLE // 8) * 2
    assert _cats() == (3 * part * 2,)
    part2 = -(-TRAINABLE // 4) * 2
    assert _cats(dp=2) == (589_824_000 * 2,)
    assert part2 < 589_824_000


@pytest.mark.parametrize("over", [{"contiguous_gradients": False}, {"offload_optimizer": True}, {"zero": 3},
                                  {"overlap_comm": False}, {"dp": 1}])
def test_none_off_that_path(over):
    """Without contiguous gradients (``buffered_reduce_fallback``), offloaded, ZeRO-3, ZeRO-1 reducing after
    backward (no hooks), one rank (one slice: a view)."""
    assert _cats(**over) == ()


@pytest.mark.slow
def test_grid_row_within_one_percent_of_trace(one_torch_thread):
    import trainmem
    from trainmem.trace.api import trace
    e = trainmem.estimate("gemma-2-2b", set=SET, **ROW)
    t = trace("gemma-2-2b", set=SET, **ROW)
    assert abs(e.peak_reserved / t.peak_reserved - 1) < 0.01
