"""DDP built on a side stream (``--ddp-init-stream side``, Lightning's DDPStrategy: ``wrappers.ddp``): the
construction's broadcast chunks and the first iteration's bucket stay cached in a pool nothing else
uses (``estimate.reserved.ddp._ddp_side_stream``). Found by Raschka's cvpr2023 Fabric DDP row (-19.95 %)."""
import pytest

from trainmem.allocator import CachingAllocator
from trainmem.estimate.api import estimate
from trainmem.estimate.reserved.ddp import DDP_INIT_STREAM, _ddp_side_stream, flat_copies
from trainmem.estimate.reserved.replay import _Replay

MiB = 1 << 20


def test_broadcast_chunks_close_once_they_hold_250_mib():
    # compute_bucket_assignment_by_size: a chunk is closed by the tensor that takes it to >= 250 MiB;
    # a chunk of one tensor is flattened to a view of it (tensor_flatten.h), no copy
    cap = 250 * MiB
    assert flat_copies([100 * MiB] * 3 + [5 * MiB] * 2, cap) == [300 * MiB, 10 * MiB]
    assert flat_copies([100 * MiB] * 3 + [10 * MiB], cap) == [300 * MiB]
    assert flat_copies([250 * MiB, 1], cap) == []
    assert flat_copies([4, 4], cap) == [8]


class _States:
    def __init__(self, load, grads):
        self.load, self.grads = tuple(load), grads


def _replay(load, grads):
    R = _Replay(CachingAllocator())
    _ddp_side_stream(R, _States(load, grads))
    return R


def test_side_stream_segments_stay_reserved_and_apart():
    # two chunks (300 and 10 MiB) freed, then a 310 MiB bucket: larger than either, a segment of its own
    R = _replay([100 * MiB] * 3 + [5 * MiB] * 2, 310 * MiB)
    assert R.a.allocated == 0 and R.a.reserved == 620 * MiB
    R.free(R.alloc(10 * MiB))                       # the default stream cannot use the side stream's cache
    assert R.a.reserved == 630 * MiB
    # one chunk of 100 MiB: the bucket of the same size takes its block on the same stream
    assert _replay([50 * MiB, 50 * MiB], 100 * MiB).a.reserved == 100 * MiB
    assert DDP_INIT_STREAM != 0


def test_cvpr23_fabric_ddp_row():
    """torchvision-shaped ViT-B/16 under Fabric's DDP (fixture cvpr23_05): the side stream holds the two
    broadcast chunks (252 and 78 MiB segments of the 327 MiB of fp32 weights) and the one 328 MiB bucket.
    Built on the current stream, the construction's flat copies and first bucket are replayed too
    (``reserved.ddp._ddp_init``), in the default pool where the step reuses them, so the side stream adds at
    least its own 658 MiB and at most what trace's two constructions differ by (3862 - 3166 MiB)."""
    opts = dict(set=["num_labels=10"], task="image-classification", batch_size=16, optimizer="adam",
                optimizer_impl="foreach", zero_grad="zeros", hold_output="step", image_size=224,
                gpu="a100-40gb", attention="sdpa", precision="bf16-amp", dp=4)
    cur, side = (estimate("vit-base-patch16-224", ddp_init_stream=s, **opts) for s in ("current", "side"))
    assert side.peak_allocated == cur.peak_allocated
    assert (252 + 78 + 328) * MiB <= side.peak_reserved - cur.peak_reserved <= (3862 - 3166) * MiB


@pytest.mark.slow
def test_trace_agrees_on_the_side_stream():
    """trace runs Lightning's construction (the real DDP inside the emulated side stream): within 2 %
    of the estimate on the same setup (3862 / 3813 MiB; 3166 / 3155 built on the current stream)."""
    from trainmem.trace.api import trace
    opts = dict(set=["num_labels=10"], task="image-classification", batch_size=16, optimizer="adam",
                optimizer_impl="foreach", zero_grad="zeros", hold_output="step", image_size=224,
                gpu="a100-40gb", attention="sdpa", precision="bf16-amp", dp=4, ddp_init_stream="side")
    r, e = trace("vit-base-patch16-224", **opts), estimate("vit-base-patch16-224", **opts)
    assert abs(r.peak_reserved - e.peak_reserved) <= 0.02 * r.peak_reserved
    cur = trace("vit-base-patch16-224", **{**opts, "ddp_init_stream": "current"})
    assert r.peak_reserved - cur.peak_reserved >= (252 + 78 + 328) * MiB


def test_lightning_preset_builds_plain_ddp_on_the_side_stream():
    """``--framework lightning`` (2.6.5: DDPStrategy._setup_model's side stream, since 2.1.0): plain DDP
    gets ``ddp_init_stream side``, which adds the construction's chunks and the first bucket (about twice
    GPT-2's 475 MiB of fp32 weights) to reserved only; an explicit ``current`` wins; FSDP and one rank
    get nothing (the option would be refused there)."""
    from trainmem.spec.frameworks import preset_options
    assert preset_options("lightning", given={"dp": 4})["ddp_init_stream"] == "side"
    for given in ({"dp": 4, "fsdp": "full"}, {"dp": 4, "zero": 2}, {"dp": 1}, {"dp": 4, "pp": 2}):
        assert "ddp_init_stream" not in preset_options("lightning", given=given), given
    opts = dict(framework="lightning", dp=4, batch_size=4, seq_len=512)
    side, cur = estimate("gpt2", **opts), estimate("gpt2", ddp_init_stream="current", **opts)
    assert side.peak_allocated == cur.peak_allocated
    assert 1.9 * 474 * MiB < side.peak_reserved - cur.peak_reserved < 2.2 * 475 * MiB
    estimate("gpt2", framework="lightning", dp=4, fsdp="full", batch_size=4, seq_len=512)  # not refused
