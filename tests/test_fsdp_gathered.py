"""``--fsdp-gathered``: FSDP2 units kept gathered from their forward to their backward.

Before PyTorch 2.8 ``fully_shard`` never resharded the root unit after forward (pytorch/pytorch PR
#154704), and torchtitan's ``parallelize_llama`` left the last transformer block gathered too. trace
runs it by passing ``reshard_after_forward=False`` to those units (torch 2.13 then keeps them gathered
exactly as the old clamp did); the estimate adds the root's and the last layer's unsharded parameters
to the moments between the end of forward and their backward (``quantities.fsdp_root.fsdp2_root_gathered``,
``fsdp2_last_gathered``). Both are checked here on a Llama cut to four layers, FSDP2 over two ranks
of the fake process group."""
from __future__ import annotations

import pytest

from trainmem.errors import TrainmemError
from trainmem.spec.training import TrainingSpec, setup_warnings

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem import estimate, trace  # noqa: E402

SMALL = {"num_hidden_layers": 4}
BASE = dict(batch_size=2, seq_len=256, precision="bf16-mp", fsdp="full", dp=2, set=SMALL, gpu="h100")
#: torchtitan's loop of 2024: fp32 logits from the model, the loss on them, the output held a step
TORCHTITAN_2024 = dict(loss="half", cast_output=True, hold_output="step")


def _both(**options):
    return estimate("llama-3.2-1b", **options), trace("llama-3.2-1b", **options)


@pytest.mark.parametrize("gathered", ["none", "root", "root-last"])
@pytest.mark.parametrize("loop", [TORCHTITAN_2024, dict(loss="upcast"), {}], ids=["titan-2024", "upcast", "own-loss"])
@pytest.mark.parametrize("recompute", ["full", "none"])
def test_estimate_agrees_with_trace(gathered, loop, recompute):
    e, t = _both(**BASE, **loop, recompute=recompute, fsdp_gathered=gathered)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.005)


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_the_kept_units_add_their_parameters_at_the_loss(recompute):
    """Under torchtitan's 2024 loop the peak is the loss's backward. Keeping the root gathered adds
    its unsharded bf16 parameters there (embeddings and head, the final norm); keeping the last layer
    too adds one layer's. trace and the estimate must both move by those bytes, within 1 % (one MiB
    of the allocator's blocks: trace finds one more with the last layer kept, the estimate with the
    root). 4 x 1024 tokens: the fp32 logits, not the optimizer step, make the peak."""
    opts = {**BASE, **TORCHTITAN_2024, "recompute": recompute, "batch_size": 4, "seq_len": 1024}
    vocab, hidden, inter, kv = 128256, 2048, 8192, 512         # Llama-3.2-1B, tied head (one matrix)
    root = (vocab * hidden + hidden) * 2                       # embedding (= head) and final norm, bf16
    layer = (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden) * 2
    runs = {g: _both(**opts, fsdp_gathered=g) for g in ("none", "root", "root-last")}
    for i in (0, 1):                                           # estimate, trace
        none, root_kept, last_kept = (runs[g][i].peak_allocated for g in ("none", "root", "root-last"))
        assert root_kept - none == pytest.approx(root, rel=0.01)
        assert last_kept - root_kept == pytest.approx(layer, rel=0.01)


def test_refused_without_fsdp2():
    for bad in (dict(), dict(fsdp="full", dp=2, fsdp_version=1), dict(fsdp="full", dp=2, pp=2, grad_accum=2)):
        with pytest.raises(TrainmemError, match="--fsdp-gathered root"):
            TrainingSpec(fsdp_gathered="root", **bad)
    with pytest.raises(TrainmemError, match="fsdp_gathered|--fsdp-gathered"):
        TrainingSpec(fsdp="full", dp=2, fsdp_gathered="last")


def test_warned_where_nothing_is_resharded():
    assert any("--fsdp-gathered" in w for w in setup_warnings(TrainingSpec(fsdp="grad-op", dp=2,
                                                                          fsdp_gathered="root")))
    assert not any("--fsdp-gathered" in w for w in setup_warnings(TrainingSpec(fsdp="full", dp=2,
                                                                              fsdp_gathered="root")))
