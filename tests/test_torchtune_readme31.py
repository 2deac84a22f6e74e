"""The torchtune README memory table of 2024-09-24 (commit 30b8519e8, 'Memory and training speed',
Llama 3.1; validation/published/torchtune_readme31_*.json): what its two largest misses are not.

* Llama-3.1-8B full fine-tune on one RTX 4090 (estimate +6.2 %): the peak is the head's backward under
  ``CEWithChunkedOutputLoss``, where the output weight's gradient of each of the 8 chunks meets in its
  ``AccumulateGrad`` input buffer. ``quantities.head_grads.chunk_head_grads`` counts three weight-sized gradients
  there (the first chunk's, the second's and their sum), found with trace, whose dispatch mode makes
  every tensor subclass-like and so every ``InputBuffer`` accumulation out of place
  (``trace/cuda_kernels.py``). Checked here on plain tensors, where ``InputBuffer::accumulate`` takes
  CUDA's path (``torch/csrc/autograd/input_buffer.cpp``; only stream handling is device-specific): the
  first add is out of place, the later ones in place. So the three gradients are eager CUDA's too.
  What did move it (+6.2 % -> +5.1 %): the run's bitsandbytes was 0.43.3 (0.44.0's release commit is
  dated the day the table was merged), whose 8-bit states keep one fp32 ``absmax`` per 2048 elements,
  not 256 (``Optimizer2State.init_state`` L458-461 at 0.43.3); PagedAdamW8bit pages the uint8 states,
  not ``absmax``, so those are the optimizer's only device bytes besides the small tensors'.
* Llama-3.1-70B LoRA on 8 A100s (estimate +10.8 %): under the fixture's mapping (FSDP2 over 8 ranks,
  2 x 2048 packed tokens, every layer checkpointed) four terms that do not depend on any modelling
  choice already exceed the published 27.6 GiB at the first layer's backward: the bf16 shards, the
  root (embedding, norm, output) FSDP2 keeps gathered from its forward to the end of backward before
  PyTorch 2.8 (``_fsdp_state.py`` ``_lazy_init``: ``post_forward_mesh_info = None``), that layer's
  gathered parameters with the next one's all-gather output (its ``pre_backward`` prefetch), and the
  80 checkpointed layer inputs. The figure belongs to some other setup (docs/validation.md,
  2026-11-25, sixteenth session)."""
import json
import math
import os

import torch
import torch.nn.functional as F

import trainmem
from trainmem.estimate.quantities.build import quantities
from trainmem.spec.resolve import resolve
from trainmem.validate import _value

PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")


def _fixture(name):
    with open(os.path.join(PUBLISHED, name + ".json")) as f:
        return json.load(f)


def _weight_grad_adds(chunks: int, vocab: int = 1000, hidden: int = 64):
    """The adds autograd runs while summing the output weight's per-chunk gradients of a chunked head
    (torchtune's ``TransformerDecoder.forward`` with ``num_output_chunks``: ``[self.output(chunk) for
    chunk in h.chunk(n, dim=1)]``, a chunked cross-entropy on each), as (op name, bytes it allocated)
    from the CPU profiler, which observes the ops without changing how they dispatch."""
    from torch.profiler import ProfilerActivity, profile
    w = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=torch.bfloat16))
    h = torch.randn(2, 4 * chunks, hidden, dtype=torch.bfloat16, requires_grad=True)
    outs = [F.linear(c, w) for c in h.chunk(chunks, dim=1)]
    labels = torch.zeros(8, dtype=torch.long)
    loss = sum(F.cross_entropy(o.reshape(-1, vocab).float(), labels, reduction="sum") for o in outs)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.name in ("aten::add", "aten::add_")], \
        vocab * hidden * 2


def test_the_chunks_weight_gradients_are_summed_out_of_place_once():
    adds, grad_bytes = _weight_grad_adds(4)
    assert adds.count(("aten::add", grad_bytes)) == 1          # first chunk's + second's: a new tensor
    assert [a for a in adds if a[0] == "aten::add_"] == [("aten::add_", 0)] * 2  # the others into it
    assert len(adds) == 3


def test_the_estimate_counts_those_three_gradients_for_the_8b_row():
    fx = _fixture("torchtune_readme31_llama31_8b_full_4090")
    r = resolve(fx["model"], **fx["setup"])
    q = quantities(r.model, r.training, "worst")
    head = next(p for p in r.model.parameter_tensors() if p.layer is None and p.role == "linear")
    assert q.chunk_head_grads >= 3 * head.numel * 2                 # bf16 (vocab, hidden), block-rounded


def _states(report) -> int:
    return next(c.bytes for c in report.components if c.name == "optimizer_states")


def test_the_8b_full_row_keeps_bitsandbytes_0433_absmax_blocks():
    """PagedAdamW8bit under bitsandbytes 0.43.3 (the fixture's release) against 0.44.1: every tensor of
    at least 4096 elements has two fp32 absmax tensors of ceil(n / 2048) entries, not ceil(n / 256)
    (``optim/optimizer.py`` ``Optimizer2State.init_state``: ``blocks = n // 2048`` L458 at 0.43.3,
    ``n // 256`` L480 at 0.44.0); each is one allocation, rounded up to 512 B by the caching allocator."""
    fx = _fixture("torchtune_readme31_llama31_8b_full_4090")
    assert fx["setup"]["bitsandbytes_version"] == "0.43.3"
    old = trainmem.estimate(fx["model"], **fx["setup"])
    new = trainmem.estimate(fx["model"], **dict(fx["setup"], bitsandbytes_version="0.44.1"))
    r = resolve(fx["model"], **fx["setup"])
    big = [p.numel for p in r.model.parameter_tensors() if p.numel >= 4096]
    fewer = sum(2 * 4 * (math.ceil(n / 256) - math.ceil(n / 2048)) for n in big)   # fp32 (blocks,) x 2
    assert abs(_states(new) - _states(old) - fewer) <= 2 * 512 * len(big)
    assert new.peak_allocated - old.peak_allocated >= fewer - 2 * 512 * len(big)


def _fsdp2_floor(fx) -> int:
    """Bytes one rank holds at the first layer's backward whatever else is modelled (module docstring)."""
    r = resolve(fx["model"], **fx["setup"])
    m, t = r.model, r.training
    params = list(m.parameter_tensors())
    total = sum(p.numel for p in params)
    layer = sum(p.numel for p in params if p.layer == 0)
    root = sum(p.numel for p in params if p.layer is None)
    inputs = m.num_layers * t.batch_size * t.seq_len * m.hidden_size   # one checkpointed input per layer
    return 2 * (total // t.dp + root + 2 * layer + inputs)             # bf16 throughout


def test_the_70b_lora_figure_is_below_what_fsdp2_must_hold():
    fx = _fixture("torchtune_readme31_llama31_70b_lora_8xa100")
    floor = _fsdp2_floor(fx)
    assert _value(fx["measured"][0]) < floor
    report = trainmem.estimate(fx["model"], **fx["setup"])
    assert report.peak_allocated >= floor       # the estimate is not pulled below it to meet the figure
