"""Trace under gradient accumulation runs four micro-batches per optimizer step: from the second
on, each finds the gradients allocated and the previous output in the same state, so they repeat
the same allocations; the simulated allocator's reserved memory settles by the third. Checked here
on fully traced steps (what the shortcut relies on), then that a longer accumulation is reported
as such and gives the same peaks."""
import pytest

from trainmem.trace.api import TRACED_MICRO_BATCHES, trace

TINY = ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
        "intermediate_size=128", "vocab_size=1000", "head_dim=16"]


@pytest.mark.parametrize("options", [{}, {"hold_output": "step"}, {"recompute": "full"}, {"zero_grad": "zeros"},
                                     {"lora_rank": 8}, {"precision": "fp32", "attention": "eager"}])
def test_micro_batches_after_the_first_repeat_the_same_allocations(options):
    assert TRACED_MICRO_BATCHES == 4
    r = trace("llama-3.2-1b", set=TINY, batch_size=2, seq_len=64, grad_accum=4, **options)
    ph = {(p.name, p.step): p for p in r.phases}
    for step in (1, 2):
        for phase in ("forward", "backward"):
            two, three, four = (ph[(f"{phase}.micro{k}", step)] for k in (2, 3, 4))
            assert two.allocated == three.allocated == four.allocated
            assert two.peak == three.peak == four.peak
            assert three.reserved == four.reserved


def test_a_long_accumulation_is_traced_in_four_and_says_so():
    r = trace("llama-3.2-1b", set=TINY, batch_size=2, seq_len=64, grad_accum=64, recompute="full")
    names = [p.name for p in r.phases if p.step == 1]
    assert names[4:8] == ["forward.micro3", "backward.micro3", "forward.micro4-64", "backward.micro4-64"]
    assert any("traced 4 of the 64 micro-batches" in w for w in r.warnings)
    full = trace("llama-3.2-1b", set=TINY, batch_size=2, seq_len=64, grad_accum=4, recompute="full")
    assert (r.peak_allocated, r.peak_reserved) == (full.peak_allocated, full.peak_reserved)
