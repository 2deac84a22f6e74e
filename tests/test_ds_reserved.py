"""The reserved replay of DeepSpeed runs (``estimate/reserved/``): ZeRO-3's reduce ``cat`` per bucket
(one rank too), ZeRO-3's step states once per tensor, ZeRO-1/2's offload epilogue copies per gradient,
and an older transformers release's fp32-logits loss tensor by tensor. Found on Giles Thomas's
Qwen1.5-0.5B rows (docs/validation.md, fifteenth session); each test checks one mechanism."""
from __future__ import annotations

from dataclasses import replace

import pytest

import trainmem
from trainmem import allocator
from trainmem.estimate.quantities.zero_offload import deepspeed_offload_epilogue
from trainmem.estimate.quantities.zero_step import deepspeed_reduce_cat
from trainmem.estimate.states import model_states
from trainmem.spec.resolve import resolve

MiB = 2 ** 20
# a tied Qwen2 (Qwen1.5's shape, cut down) small enough to trace in seconds: its table is the largest tensor
QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256,
        "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}
ZERO3 = dict(framework="hf-trainer", zero=3, dp=1, precision="fp16", batch_size=1, seq_len=256, zero_init="off")


def _requests(monkeypatch) -> list:
    """Every (bytes, stream) request the simulated allocators get from now on."""
    seen: list = []
    original = allocator.CachingAllocator.allocate

    def allocate(self, nbytes, tag=None, stream=None):
        seen.append((nbytes, self.current_stream if stream is None else stream))
        return original(self, nbytes, tag, stream)
    monkeypatch.setattr(allocator.CachingAllocator, "allocate", allocate)
    return seen


def test_zero3_reduce_cat_on_one_rank():
    """One rank concatenates a bucket of several gradients as several ranks do (the Qwen rows' 885 MiB
    ``cat``): the model's fp16 gradients up to the bucket; a model of one trainable tensor reduces it in
    place (``reduce_scatter_coalesced`` L102-105); ZeRO-2 has none."""
    rs = resolve(QWEN, **ZERO3)
    st = model_states(rs.model, rs.training)
    assert deepspeed_reduce_cat(rs.training, st) >= st.trainable * 2
    assert st.trainables[0][:2] == ("before", 1)                # the embedding, one tensor
    assert deepspeed_reduce_cat(rs.training, replace(st, trainables=st.trainables[:1])) == 0
    two = {k: v for k, v in ZERO3.items() if k != "zero_init"}
    assert deepspeed_reduce_cat(resolve(QWEN, **{**two, "zero": 2}).training, st) == 0


def test_zero3_step_states_once_per_tensor(monkeypatch):
    """ZeRO-3's replayed step makes each state kind as one flat tensor of the fp32 partition (a per-layer
    tensor's copies were counted twice: the states were 2 x 2 layers' worth here, 28.8 GB instead of
    1.77 GB on Qwen1.5-0.5B). Requests of the fp32 partition's size: the init's fp32 copy and master
    (2), the first step's fp32 gradient and two Adam states (3), the second step's fp32 gradient (1)."""
    kw = dict(ZERO3, reduce_bucket_size=100_000)
    rs = resolve(QWEN, **kw)
    fp32 = model_states(rs.model, rs.training).trainable * 4
    seen = _requests(monkeypatch)
    trainmem.estimate(QWEN, **kw)
    assert sum(1 for n, _s in seen if fp32 <= n <= fp32 + 2 * MiB) == 6


def test_zero3_reserved_on_one_rank_follows_trace(one_torch_thread):
    """DeepSpeed 0.19.8's engine traced on one rank (ZeRO-3, fp16, the model loaded whole): the replay
    has the reduce stream's ``cat`` and the states made once, so the reserved peak is trace's within 1%
    (1328 MiB against 1332, -0.3%; before: 1308, -1.8%; on Qwen1.5-0.5B s1 12424 against 12426, before -7.2%)."""
    pytest.importorskip("deepspeed")
    from trainmem.trace import trace
    e, r = trainmem.estimate(QWEN, **ZERO3), trace(QWEN, **ZERO3)
    assert abs(e.peak_allocated - r.peak_allocated) < 0.003 * r.peak_allocated
    assert abs(e.peak_reserved - r.peak_reserved) < 0.01 * r.peak_reserved


OFFLOAD = dict(framework="hf-trainer", zero=2, dp=1, precision="fp16", batch_size=1, seq_len=256,
               offload_optimizer=True)


def test_offload_epilogue_copies_per_release(monkeypatch):
    """ZeRO-2 offloading its optimizer: at the boundary each gradient gets a float64 copy for its norm, then
    (up to v0.19.5) the inf/nan check's fp32 copy, three bool tensors and a second fp32 tensor, then an fp32
    copy for the host; the embedding's (the largest, backward's last) among them. From v0.19.6 (#8325) the
    check allocates nothing per element; the norm's and the host's copies stay (v0.19.8 L2161-2178)."""
    old = resolve(QWEN, **OFFLOAD, deepspeed_version="0.19.5")
    st = model_states(old.model, old.training)
    emb = 32000 * 256                                           # the embedding's elements
    assert deepspeed_offload_epilogue(old.model, old.training, st)[-3:] == (
        (emb * 8,), (emb * 4, emb, emb, emb, emb * 4), (emb * 4,))
    new = resolve(QWEN, **OFFLOAD, deepspeed_version="0.19.6")
    steps = deepspeed_offload_epilogue(new.model, new.training, st)
    assert steps[-2:] == ((emb * 8,), (emb * 4,)) and all(len(s) == 1 for s in steps)
    assert deepspeed_offload_epilogue(old.model, resolve(QWEN, **{**OFFLOAD, "offload_optimizer": False}).training,
                                      st) == ()
    seen = _requests(monkeypatch)
    trainmem.estimate(QWEN, **OFFLOAD, deepspeed_version="0.14.2")
    sizes = [n for n, _s in seen]
    assert emb * 8 in sizes and sizes.count(emb) >= 3 * 2   # float64; isnan, isinf, or (each replayed step)
    seen.clear()
    trainmem.estimate(QWEN, **OFFLOAD)
    sizes = [n for n, _s in seen]
    assert emb * 8 in sizes and emb not in sizes              # the norm's float64 copy; no bool masks


def test_fp32_logits_loss_replayed_tensor_by_tensor(monkeypatch):
    """transformers 4.40's Qwen2 forward returns fp32 logits and shifts them: the replay makes the half
    logits, their fp32 copy, the shifted fp32 copy (one row fewer) and log_softmax's, and in backward
    nll_loss's and log_softmax's gradients (shifted), SliceBackward's zero-filled whole fp32 gradient,
    then ToCopyBackward's half one. The installed release (labels shifted in the loss) is not replayed so."""
    kw = dict(zero=0, dp=1, precision="fp16", batch_size=3, seq_len=50, framework="hf-trainer")
    full, shifted = 3 * 50 * 32000, 3 * 49 * 32000
    seen = _requests(monkeypatch)
    trainmem.estimate(QWEN, **kw, transformers_version="4.40.0")
    sizes = [n for n, _s in seen]
    i = sizes.index(full * 4)                                   # the fp32 logits
    assert sizes[i - 1] == full * 2                             # after the half ones
    assert sizes[i + 1:i + 3] == [shifted * 4, shifted * 4]     # the shifted copy, log_softmax's output
    j = sizes.index(shifted * 4, i + 3)                         # backward: nll_loss's, log_softmax's gradient
    assert sizes[j:j + 4] == [shifted * 4, shifted * 4, full * 4, full * 2]
    seen.clear()
    trainmem.estimate(QWEN, **kw)
    assert shifted * 4 not in [n for n, _s in seen]


def _fetcher(monkeypatch, recorded: bool, max_live: int, kept: int = 2) -> list:
    """The gather-stream requests of ``_Zero3Fetch`` over two layers of parameters of 10, 20 and 30
    elements (1 byte each), prefetch bucket 25, every layer's forward then backward."""
    from types import SimpleNamespace

    from trainmem.estimate.reserved.replay import GATHER_STREAM, _Replay
    from trainmem.estimate.reserved.zero_gather import _Zero3Fetch
    q = SimpleNamespace(ds_layer_params=(10, 20, 30), ds_param_bytes=1, ds_streams=1, ds_prefetch=25,
                        ds_max_live=max_live, layers=2, ds_layers_kept=kept, ds_emb_kept=0, ds_emb_numel=0)
    seen = _requests(monkeypatch)
    R = _Replay()
    z = _Zero3Fetch(R, q, recorded)
    for i in range(2):
        z.forward(R, i)
    for i in reversed(range(2)):
        z.backward(R, i)
    assert R.a.allocated == 0                                   # everything gathered is released
    assert {s for _n, s in seen} == {GATHER_STREAM}
    return [n for n, _s in seen]


def test_zero3_gathers_one_parameter_at_a_time_before_the_order_is_recorded(monkeypatch):
    """The first forward (no recorded order): each parameter gathered at its module and released after
    it, in forward and again in backward; no flat prefetch output."""
    assert _fetcher(monkeypatch, recorded=False, max_live=1000) == [10, 20, 30] * 4


def test_zero3_prefetch_groups_run_ahead_within_the_live_limit(monkeypatch):
    """Once the order is recorded each module's fetch prefetches whole parameters up to the bucket (25):
    the groups (10, 20), (30), (10, 20), (30) as flat outputs, each group's parameters built from it at
    its first fetch; with stage3_max_live_parameters 1000 the prefetch runs ahead into the second layer
    before the first layer's parameters are built; with 40 (the first layer kept gathered) it stops, and
    the second layer's parameters are fetched one by one."""
    assert _fetcher(monkeypatch, recorded=True, max_live=1000) == [30, 30, 10, 20, 30, 30, 30, 10, 20, 30]
    assert _fetcher(monkeypatch, recorded=True, max_live=40) == [30, 30, 10, 20, 30, 10, 20, 30]


def test_zero3_layers_not_kept_are_gathered_again_in_backward(monkeypatch):
    """A layer whose next use is past stage3_max_reuse_distance (``ds_layers_kept`` 0) is released after
    its forward and gathered again, parameter by parameter, at its backward."""
    sizes = _fetcher(monkeypatch, recorded=True, max_live=1000, kept=0)
    assert sizes[-6:] == [10, 20, 30, 10, 20, 30]


def test_zero3_reduce_cat_bucket_by_bucket():
    """The gradients fill reduce_bucket_size in backward order: Llama-3.2-1B cut to 4 layers (506M
    elements) has the layers' gradients (and the final norm's) in the first bucket, concatenated, and
    the tied embedding alone in the second, reduced in place (found by trace: a 464 MiB ``cat``, bf16)."""
    from trainmem.estimate.quantities.zero_step import deepspeed_reduce_cats
    rs = resolve("llama-3.2-1b", framework="hf-trainer", zero=3, dp=2, precision="bf16",
                 set=["num_hidden_layers=4"])
    st = model_states(rs.model, rs.training)
    cats = deepspeed_reduce_cats(rs.training, st)
    layers = sum(p.numel for p in rs.model.parameter_tensors() if p.role != "embedding")
    assert len(cats) == 2 and cats[1] == 0
    assert layers * 2 <= cats[0] < layers * 2 + 4 * MiB and cats[0] // MiB == 464
    assert deepspeed_reduce_cat(rs.training, st) == cats[0]
