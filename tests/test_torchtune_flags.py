"""torchtune's compiled pieces as the estimate models them, read off the installed torch's inductor
partition on the CPU, and the README 'Optimization flags' rows (torchtune 1814feb17, Llama-3.2-3B on
an A100, peak_memory_active) they were found on.

* ``CEWithChunkedOutputLoss.compute_cross_entropy`` compiled (``training.compile_loss``): the partition
  saves the half logits chunk itself, its labels and two fp32 values per row; backward writes one
  gradient in the logits' dtype (``quantities.loss_kinds._compiled_chunked_loss_bytes``).
* ``nn.CrossEntropyLoss`` compiled on the fp32 logits torchtune's decoder returns: it saves those fp32
  logits themselves (``quantities.loss_kinds._compiled_fp32_loss_bytes``); only the LoRA single-device recipe keeps
  the compiled module, the full-finetune recipes run it eagerly
  (``quantities.loss_kinds.torchtune_compiles_whole_loss``).
* A layer that copies K and V to the query's heads (torchtune's ``MultiHeadAttention``) saves the
  copies under compile too (``--attention-call repeat-kv`` with ``--compile``).
* torchtune compiles layer by layer: its tied embedding's gradient is autograd's, not a compiled
  graph's (``quantities.head_grads.whole_model_compiled``).
* ``peak_active`` is scored by the allocated peak (``validate.active_peak``)."""
import functools
import json
import os

import pytest
import torch
import torch.nn.functional as F

import trainmem
from trainmem.estimate.quantities.build import quantities
from trainmem.estimate.quantities.loss_kinds import LossBytes
from trainmem.estimate.quantities.model_facts import F32
from trainmem.spec.resolve import resolve
from trainmem.validate import PEAKS, quantity, validate

PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")


def _saved(fn, *inputs):
    """The tensors inductor's partition of ``fn``'s joint graph saves for backward (shape, dtype),
    with inductor's decompositions, as ``torch.compile(fn)`` would partition it."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    out: list = []

    def fw(gm, _ins):
        ret = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        out.extend((tuple(r.meta["val"].shape), r.meta["val"].dtype) for r in ret[1:])
        return gm.forward

    backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _i: gm.forward, decompositions=select_decomp_table(),
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    torch._dynamo.reset()
    res = torch.compile(fn, backend=backend)(*inputs)
    (res if res.dim() == 0 else res.sum()).backward()
    return out


def _bytes(shape_dtype):
    shape, dtype = shape_dtype
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def test_compiled_chunked_loss_saves_the_half_chunk_and_16_bytes_per_row():
    rows, vocab = 64, 1000

    def compute_cross_entropy(logits, labels):  # torchtune ce_chunked_output_loss.py at 1814feb17
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

    x = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved(compute_cross_entropy, x, torch.randint(0, vocab, (rows,)))
    big = [s for s in saved if s[0] == (rows, vocab)]
    assert big == [((rows, vocab), torch.bfloat16)]          # the chunk itself, no fp32 log-probabilities
    per_row = sum(_bytes(s) for s in saved if s[0] != (rows, vocab)) / rows
    lb = LossBytes(saved=2, saves_out=1)
    from trainmem.estimate.quantities.loss_kinds import _compiled_chunked_loss_bytes
    b = _compiled_chunked_loss_bytes(0, 2)
    assert (b.saved, b.saves_out, b.forward_chunk, b.forward) == (lb.saved, 1, 0, 0)
    assert b.saved_tok == per_row == 16                       # amax, log (fp32) and the int64 labels
    assert b.backward_chunk == 2                              # one half gradient per chunk


def test_compiled_fp32_loss_saves_its_fp32_input():
    rows, vocab = 64, 1000
    x = torch.randn(rows, vocab, dtype=torch.float32, requires_grad=True)
    saved = _saved(lambda lg, lb: F.cross_entropy(lg, lb), x, torch.randint(0, vocab, (rows,)))
    assert [s for s in saved if s[0] == (rows, vocab)] == [((rows, vocab), torch.float32)]
    from trainmem.estimate.quantities.loss_kinds import _compiled_fp32_loss_bytes
    b = _compiled_fp32_loss_bytes(0, 2)
    assert (b.saved, b.saves_out, b.cast, b.backward, b.forward) == (F32, 1, F32, F32, 0)


def test_full_finetune_recipe_drops_the_compiled_loss():
    """torchtune's ``compile_loss`` compiles a non-chunked loss by returning ``torch.compile(loss)``
    (torchtune/training/_compile.py L80-82 at 1814feb17); ``full_finetune_single_device`` calls it
    without keeping the result (recipes/full_finetune_single_device.py L291-292), so the loss it
    calls is the eager module: dynamo never sees it. ``lora_finetune_single_device`` rebinds it (L296)."""
    from torch._dynamo.utils import counters

    def compile_loss(loss):                      # _compile.py L80-82, the non-chunked branch
        return torch.compile(loss, backend="eager")

    logits, labels = torch.randn(8, 50), torch.randint(0, 50, (8,))
    torch._dynamo.reset()
    counters.clear()
    loss_fn = torch.nn.CrossEntropyLoss()
    compile_loss(loss_fn)                        # the full-finetune recipes' call
    loss_fn(logits, labels)
    assert counters["stats"]["unique_graphs"] == 0
    loss_fn = compile_loss(loss_fn)              # the LoRA single-device recipe's
    loss_fn(logits, labels)
    assert counters["stats"]["unique_graphs"] == 1


def test_torchtune_full_finetune_loss_is_eager_under_compile():
    """The estimate's side of the above: with ``--cast-output`` and the plain loss, torchtune's full
    finetune under compile keeps the eager loss's fp32 log-probabilities (as without compile); the
    LoRA single-device recipe's compiled loss saves the fp32 logits it reads instead."""
    kw = dict(loss="upcast", cast_output=True)
    eager, _ = _q(**kw)
    full, _ = _q(compile=True, **kw)
    assert (full.loss_saved, full.loss_saves_out) == (eager.loss_saved, eager.loss_saves_out) == (F32, 0)
    lora, _ = _q(compile=True, lora_rank=8, **kw)
    assert (lora.loss_saved, lora.loss_saves_out) == (F32, 1)


def test_compiled_layer_saves_the_repeated_k_and_v():
    b, s, hidden, heads, kv_heads, d = 2, 64, 256, 8, 2, 32
    wq = torch.randn(heads * d, hidden, dtype=torch.bfloat16, requires_grad=True)
    wk = torch.randn(kv_heads * d, hidden, dtype=torch.bfloat16, requires_grad=True)
    wv = torch.randn(kv_heads * d, hidden, dtype=torch.bfloat16, requires_grad=True)

    def attention(x):  # torchtune modules/attention.py L288-290 at 1814feb17
        q = F.linear(x, wq).view(b, s, heads, d).transpose(1, 2)
        k = F.linear(x, wk).view(b, s, kv_heads, d).transpose(1, 2)
        v = F.linear(x, wv).view(b, s, kv_heads, d).transpose(1, 2)
        k = k.unsqueeze(2).expand(b, kv_heads, heads // kv_heads, s, d).flatten(1, 2)
        v = v.unsqueeze(2).expand(b, kv_heads, heads // kv_heads, s, d).flatten(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    saved = _saved(attention, torch.randn(b, s, hidden, dtype=torch.bfloat16, requires_grad=True))
    full_heads = [x for x in saved if x[0] == (b, heads, s, d)]
    assert len(full_heads) >= 4                               # q, the two copies, the output
    assert not [x for x in saved if x[0] == (b, kv_heads, s, d)]


@pytest.mark.slow
def test_compiled_llama32_3b_layer_saves_what_the_estimate_charges():
    """One Llama-3.2-3B layer at its real widths (24 query and 8 key/value heads of 128, hidden 3072,
    MLP 8192) written as torchtune's ``TransformerSelfAttentionLayer`` (RMSNorm upcast and
    ``type_as``, ``Llama3ScaledRoPE`` in fp32, K and V copied to the query's heads,
    modules/attention.py L288-290 at 1814feb17), partitioned as ``torch.compile`` does: the tensors it
    saves per token equal the estimate's per-layer charge (``saved_tok``) plus one (tokens, 3072) half
    tensor, the attention output transposed for ``output_proj``: a copy on the CPU, whose kernel lays
    its output out (b, h, s, d), a view of the kernel's output where that is (b, s, h, d) (the CUDA
    flash kernel; inductor's flex attention follows the query's stride order,
    torch/_inductor/kernel/flex/flex_attention.py). At 1/8 of the widths with one key/value head the
    partition keeps the un-copied K and V instead: the geometry matters, hence the real one."""
    b, s, hidden, heads, kv, d, inter = 1, 128, 3072, 24, 8, 128, 8192
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.bfloat16).div_(64).requires_grad_()
    wq, wk, wv, wo = w(heads * d, hidden), w(kv * d, hidden), w(kv * d, hidden), w(hidden, heads * d)
    w1, w2, w3, n1, n2 = w(inter, hidden), w(hidden, inter), w(inter, hidden), w(hidden), w(hidden)
    cache = torch.randn(s, d // 2, 2, generator=g)                  # the RoPE cache, fp32

    def rms(x, scale):                                              # modules/rms_norm.py
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * scale

    def rope(x):                                                    # Llama3ScaledRoPE.forward
        xs, c = x.float().reshape(*x.shape[:-1], -1, 2), cache.view(1, s, 1, d // 2, 2)
        out = torch.stack([xs[..., 0] * c[..., 0] - xs[..., 1] * c[..., 1],
                           xs[..., 1] * c[..., 0] + xs[..., 0] * c[..., 1]], -1)
        return out.flatten(3).type_as(x)

    def layer(x):
        h = rms(x, n1)
        q = rope(F.linear(h, wq).view(b, s, heads, d)).transpose(1, 2)
        k = rope(F.linear(h, wk).view(b, s, kv, d)).transpose(1, 2)
        v = F.linear(h, wv).view(b, s, kv, d).transpose(1, 2)
        k = k.unsqueeze(2).expand(b, kv, heads // kv, s, d).flatten(1, 2)
        v = v.unsqueeze(2).expand(b, kv, heads // kv, s, d).flatten(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + F.linear(o, wo)
        m = rms(x, n2)
        return x + F.linear(F.silu(F.linear(m, w1)) * F.linear(m, w3), w2)

    saved = _saved(layer, torch.randn(b, s, hidden, generator=g, dtype=torch.bfloat16, requires_grad=True))
    weights = {tuple(t.shape) for t in (wq, wk, wv, wo, w1, w2, w3, n1, cache)}
    per_token = sum(_bytes(x) for x in saved if x[0] not in weights) / (b * s)
    r = resolve("llama-3.2-3b", framework="torchtune", batch_size=1, seq_len=s, precision="bf16", gpu="a100-80gb",
                compile=True, attention="sdpa-flash", attention_call="repeat-kv", loss="chunked", loss_chunks=8,
                set={"num_hidden_layers": 2})
    assert per_token - hidden * 2 == quantities(r.model, r.training).saved_tok == 98_408


def _q(**kw):
    r = resolve("llama-3.2-1b", framework="torchtune", batch_size=1, seq_len=512, precision="bf16",
                gpu="a100-80gb", optimizer_impl="fused", set={"num_hidden_layers": 2}, **kw)
    return quantities(r.model, r.training), r


def _forward_end(**kw):
    rep = trainmem.estimate("llama-3.2-1b", framework="torchtune", batch_size=1, seq_len=512, precision="bf16",
                            gpu="a100-80gb", optimizer_impl="fused", recompute="full", set={"num_hidden_layers": 2},
                            loss="chunked", loss_chunks=8, **kw)
    return next(p for p in rep.phases if p.name == "forward" and p.step == 2)


def test_compiled_chunked_loss_counts_the_chunks_once():
    """After ``del logits`` the eager loss keeps each chunk's fp32 log-probabilities (4 B per logit),
    the compiled one the half chunks themselves (2 B) and 16 B per token; under full recompute the
    layers keep the same tensors either way, so the end of forward differs by exactly that. At the
    loss's forward the chunks the loss reads are what it saves: counted once."""
    q, r = _q(loss="chunked", loss_chunks=8, compile=True)
    assert q.loss_saves_out == 1 and q.loss_saved == q.logits_out == 2 and q.loss_forward_chunk == 0
    eager, compiled = _forward_end(), _forward_end(compile=True)
    logits, tokens = 512 * r.model.vocab_size, 512
    assert eager.allocated - compiled.allocated == pytest.approx(logits * (4 - 2) - 16 * tokens, abs=2**20)
    # the forward's peak: layers' inputs + the chunks once (+ per token), not the chunks twice
    assert compiled.peak - compiled.allocated < logits * 2 // 8 + 2**21


def test_torchtune_compiles_layers_not_the_tied_embedding():
    q_tt, _ = _q(loss="chunked", loss_chunks=8, compile=True)
    assert q_tt.tied_compiled == 0 and q_tt.tied_grad > 0      # autograd's input buffer, eager
    r = resolve("llama-3.2-1b", batch_size=1, seq_len=512, precision="bf16", gpu="a100-80gb", compile=True,
                set={"num_hidden_layers": 2})
    assert quantities(r.model, r.training).tied_compiled > 0   # torch.compile(model): the graph's tables


def test_peak_active_is_the_allocated_peak():
    assert "peak_active" in PEAKS
    rep = trainmem.estimate("llama-3.2-1b", batch_size=1, seq_len=256, set={"num_hidden_layers": 2})
    assert quantity(rep, "peak_active") == rep.peak_allocated


ROWS = {  # README 'Optimization flags' at 1814feb17, Peak Memory Active (GiB): fixture -> |error| bound
    "torchtune_flags_llama32_3b_full_packed": 0.01,
    "torchtune_flags_llama32_3b_full_chunked": 0.01,
    "torchtune_flags_llama32_3b_full_ac": 0.03,
    "torchtune_flags_llama32_3b_full_optbwd": 0.01,
    "torchtune_flags_llama32_3b_full_offload": 0.01,
    "torchtune_flags_llama32_3b_full_compile": 0.01,
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_readme_flags_rows(name):
    """The rows whose mechanisms are modelled (docs/validation.md, 2026-11-25 torchtune section);
    before this change: chunked +2.1 %, optbwd +11.8 %, offload +12.5 %, packed -3.5 %, AC +20.2 %;
    compile -7.7 % with the loss compiled (the recipe drops ``compile_loss``'s module)."""
    v = validate(PUBLISHED, ["estimate"], cases=[name])
    (c,) = [c for c in v.checks if c.primary]
    assert c.quantity == "peak_active"
    with open(os.path.join(PUBLISHED, name + ".json")) as f:
        assert c.measured == round(json.load(f)["measured"][0]["gib"] * 2**30)
    assert abs(c.error) <= ROWS[name]


def test_torchtune_preset_gives_bitsandbytes_no_implementation():
    """The preset's fused AdamW is torch's; bitsandbytes' optimizers have one implementation, which
    trace and measure refuse to be given one (``workload.check_supported``)."""
    assert resolve("llama-3.2-1b", framework="torchtune", optimizer="adamw-8bit").training.optimizer_impl is None
    assert resolve("llama-3.2-1b", framework="torchtune").training.optimizer_impl == "fused"


def _buffer_bytes(rep) -> int:
    return sum(c.bytes for c in rep.components if c.category == "buffers")


def test_shared_rope_cache_in_estimate_and_trace():
    """``--rope-cache N``: one fp32 ``theta`` [head_dim/2] and ``cache`` [N, head_dim/2, 2] for the
    whole model (torchtune's Llama 3.x builders share one ``Llama3ScaledRoPE``), in both reports'
    buffers and allocated peaks; the estimate charges theta its 512-byte block."""
    from trainmem import trace
    opts = dict(batch_size=1, seq_len=256, precision="bf16", recompute="full", gpu="a100-80gb",
                set={"num_hidden_layers": 2})
    e0, t0 = trainmem.estimate("llama-3.2-1b", **opts), trace("llama-3.2-1b", **opts)
    e1, t1 = trainmem.estimate("llama-3.2-1b", rope_cache=4096, **opts), trace("llama-3.2-1b", rope_cache=4096, **opts)
    cache = 4096 * 32 * 2 * 4                 # [4096, head_dim/2 = 32, 2] fp32, once
    assert _buffer_bytes(e1) - _buffer_bytes(e0) == cache + 512
    assert _buffer_bytes(t1) - _buffer_bytes(t0) == cache + 32 * 4
    assert e1.peak_allocated - e0.peak_allocated == t1.peak_allocated - t0.peak_allocated == cache + 512


def test_shared_rope_cache_refused_where_it_does_not_exist():
    from trainmem.errors import TrainmemError
    for model, kw in (("gpt2", {}), ("llama-3.2-1b", {"layer_rope_cache": 64})):
        with pytest.raises(TrainmemError) as err:
            trainmem.estimate(model, rope_cache=1024, seq_len=64, **kw)
        assert "\n" not in str(err.value) and "--rope-cache 1024" in str(err.value)


def test_e2e_tutorial_model_init():
    """torchtune's end-to-end tutorial (0cd8bc4ca) logs, after building Llama-3.2-3B with rank-64
    adapters in bf16 and loading the checkpoint: 6.21 GiB allocated, 6.27 GiB reserved. The bf16
    weights (3,212,749,824 x 2 B), the adapters and the shared RoPE cache (131072 positions, 64 MiB)
    give 6.2147 GiB; without the cache 6.15."""
    v = validate(PUBLISHED, ["estimate"], cases=["torchtune_e2e_llama32_3b_lora_init"])
    got = {c.quantity: c for c in v.checks}
    assert abs(got["phase:model_loaded@0:peak"].error) < 0.001
    assert abs(got["phase:model_loaded@0:reserved"].error) < 0.005


def test_trace_refuses_torchtune_compile_in_one_line():
    """trace --compile compiles a whole transformers model; torchtune compiles layer by layer."""
    from trainmem.errors import TrainmemError
    from trainmem.trace.compiled import check
    _q_unused, r = _q(loss="chunked", loss_chunks=8, compile=True)
    with pytest.raises(TrainmemError) as err:
        check(r.training, object(), "cuda")
    assert "\n" not in str(err.value) and "--framework torchtune" in str(err.value)
