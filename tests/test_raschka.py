"""Raschka's LLMs-from-scratch ``00_orig.py`` (GPT-2 124M from scratch, fp32, batch 8 x 1024), traced.

trace runs HIS module (``tests/raschka_gpt.py``, copied from 00_orig.py at 28c65cd) and HIS loop
(00_orig.py lines 296-303: ``zero_grad()`` first, ``calc_loss_batch``, ``backward``, ``step`` with
``torch.optim.AdamW(lr=5e-4, weight_decay=0.1)``) on the emulated CUDA caching allocator, and is
checked against the two numbers the README's 'Baseline' log prints at the end of training on an
A100 (PyTorch 2.6.0): ``memory_allocated`` 2.5069 GB and ``memory_reserved`` 26.2617 GB (both
``/ 1024**3``, i.e. GiB, rounded to 4 decimals: half a unit is 0.05 MiB).
"""
from __future__ import annotations

import pytest
import torch

from trainmem.trace.api import trace

rg = pytest.importorskip("raschka_gpt")

B, T = 8, 1024
GiB = 1024 ** 3
PRINTED_RESERVED_GIB = 26.2617   # README 'Baseline': Reserved memory
PRINTED_ALLOCATED_GIB = 2.5069   # README 'Baseline': Allocated memory
ROUNDING = 0.00005 * GiB          # the 4th decimal of the printed GiB


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1)   # 00_orig.py line 411


def _step(model, optimizer, it):
    optimizer.zero_grad()
    inp = torch.randint(0, 50257, (B, T), device="cuda")
    tgt = torch.randint(0, 50257, (B, T), device="cuda")
    loss = rg.loss_batch(model, inp, tgt)
    loss.backward()
    optimizer.step()


@pytest.fixture(scope="module")
def traced():
    return trace(lambda: rg.GPTModel(rg.GPT_CONFIG_124M), _step, steps=3, optimizer_fn=_optimizer, gpu="a100-80gb")


def test_reserved_matches_printed(traced):
    # reserved only grows (no empty_cache in the script): the end-of-training value is the peak
    assert abs(traced.peak_reserved - PRINTED_RESERVED_GIB * GiB) <= ROUNDING


def test_allocated_after_step_matches_printed(traced):
    after = [p for p in traced.phases if p.name == "optimizer_step"][-1]
    assert abs(after.allocated - PRINTED_ALLOCATED_GIB * GiB) <= ROUNDING


def _estimate(model: str, **kw):
    from trainmem import estimate
    return estimate(model=model, batch_size=B, seq_len=T, precision="fp32", optimizer="adamw", attention="eager",
                    gpu="a100-80gb", **kw)


def test_from_scratch_layernorm_is_what_transformers_gpt2_misses(traced):
    # transformers' GPT-2 (F.layer_norm, no mask buffers) under the same options misses his module's peak
    # by more than 3%; the catalogue entry with the Python-op LayerNorm and the mask buffers is within 0.5%
    hf = _estimate("gpt2", set=["tie_word_embeddings=false"])
    ours = _estimate("raschka-gpt-124m")
    assert traced.peak_allocated - hf.peak_allocated > 0.03 * traced.peak_allocated
    assert abs(ours.peak_allocated - traced.peak_allocated) < 0.005 * traced.peak_allocated
    assert abs(ours.peak_reserved - PRINTED_RESERVED_GIB * GiB) < 0.005 * PRINTED_RESERVED_GIB * GiB


def test_manual_layernorm_saves_three_hidden_tensors_and_one_per_token():
    # Builder.layer_norm_manual's count, on the CPU: x, x - mean, norm_x (b, s, h) and sqrt(var + eps) (b, s, 1)
    ln, x = rg.LayerNorm(64), torch.randn(2, 16, 64, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ln(x)
    assert sorted(saved.values()) == [2 * 16 * 4] + [2 * 16 * 64 * 4] * 3


def test_manual_layernorm_estimate_adds_its_saved_tensors():
    # per layer two LayerNorms, each two (b, s, h) fp32 tensors and one fp32 per token beyond F.layer_norm's
    # input and two fp32 stats; plus the final norm; plus the twelve (T, T) fp32 mask buffers
    hf = _estimate("gpt2", set=["tie_word_embeddings=false"])
    ours = _estimate("raschka-gpt-124m")
    acts = lambda r: sum(c.bytes for c in r.components if c.category == "activations")   # noqa: E731
    per_norm = B * T * (2 * 768 * 4 + 4 - 8)
    assert acts(ours) - acts(hf) == (2 * 12 + 1) * per_norm
    buffers = lambda r: sum(c.bytes for c in r.components if c.category == "buffers")   # noqa: E731
    assert buffers(ours) - buffers(hf) == 12 * T * T * 4


def _amp_step(model, optimizer, it):
    optimizer.zero_grad()
    inp = torch.randint(0, 50257, (B, T), device="cuda")
    tgt = torch.randint(0, 50257, (B, T), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = rg.loss_batch(model, inp, tgt)   # F.cross_entropy on the bf16 logits, inside autocast
    loss.backward()
    optimizer.step()


def test_manual_layernorm_under_autocast_matches_a_trace_of_his_module():
    # his loop under bf16 autocast: the Python-op LayerNorm runs on the fp32 residual stream (its ops are not on
    # autocast's lists), W_query/W_key/W_value each save their own bf16 cast of its output, and his
    # F.cross_entropy on the bf16 logits is --loss half (log_softmax in bf16, nll_loss's fp32 copy)
    traced_amp = trace(lambda: rg.GPTModel(rg.GPT_CONFIG_124M), _amp_step, steps=3, optimizer_fn=_optimizer,
                       gpu="a100-80gb")
    from trainmem import estimate
    est = estimate(model="raschka-gpt-124m", batch_size=B, seq_len=T, precision="bf16-amp", optimizer="adamw",
                   attention="eager", loss="half", gpu="a100-80gb")
    assert abs(est.peak_allocated - traced_amp.peak_allocated) < 0.005 * traced_amp.peak_allocated
    assert abs(est.peak_reserved - traced_amp.peak_reserved) < 0.015 * traced_amp.peak_reserved
    casts = {c.name: c.bytes for c in est.components}["activations.layers.c_attn.input"]
    assert casts == 3 * 12 * B * T * 768 * 2   # three (b, s, h) bf16 casts per layer, not c_attn's one


@pytest.mark.parametrize("option", [{"precision": "bf16-mp", "fsdp": "full", "dp": 2}, {"compile": True}])
def test_manual_layernorm_refuses_what_it_does_not_model(option):
    from trainmem.errors import TrainmemError
    opts = {"precision": "fp32", **option}
    with pytest.raises(TrainmemError, match="manual_layernorm"):
        from trainmem import estimate
        estimate(model="raschka-gpt-124m", batch_size=B, seq_len=T, optimizer="adamw", **opts)


def test_trace_refuses_the_catalogue_entry():
    from trainmem.errors import TrainmemError
    with pytest.raises(TrainmemError, match="factory"):
        trace("raschka-gpt-124m", batch_size=1, seq_len=64, precision="fp32")


# ----- 01_opt_single_gpu.py's model: pure bf16, SDPA, F.cross_entropy on bf16 logits ------------------
def test_pure_half_loss_tensors_are_half_blocks():
    # nll_loss_backward's and _log_softmax_backward_data's gradients: two bf16 (b*s, vocab) tensors,
    # not one fp32-sized block (which no freed bf16 block fits, so the replay reserved more)
    from trainmem.estimate.reserved.loss_forward import _logit_tensors
    elems = 8 * 1024 * 50257
    assert _logit_tensors(elems * 4, 4, elems, 1, elem=2) == [elems * 2, elems * 2]
    assert _logit_tensors(elems * 8, 8, elems) == [elems * 4, elems * 4]   # fp32: unchanged


def test_opt_model_reserved_estimate_matches_trace_of_his_code():
    # 01_opt's GPTModel at batch 8, vocab 50257, without torch.compile (README row 7, 'Using FlashAttention')
    B8, V = 8, 50257
    cfg = dict(rg.GPT_CONFIG_124M, vocab_size=V)

    def opt(model):
        return torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.1, fused=True)

    def step(model, optimizer, it):
        optimizer.zero_grad()
        inp = torch.randint(0, V, (B8, T), device="cuda")
        loss = rg.loss_batch(model, inp, torch.randint(0, V, (B8, T), device="cuda"))
        loss.backward()
        optimizer.step()

    traced_opt = trace(lambda: rg.OptGPTModel(cfg).to(torch.bfloat16), step, steps=3, optimizer_fn=opt,
                       gpu="a100-40gb")
    from trainmem import estimate
    est = estimate(model="gpt2", set=["tie_word_embeddings=false", "activation_function=gelu_pytorch_tanh"],
                   batch_size=B8, seq_len=T, precision="bf16", optimizer="adamw", optimizer_impl="fused",
                   attention="sdpa", loss="half", use_cache=False, gpu="a100-40gb")
    assert abs(est.peak_allocated - traced_opt.peak_allocated) < 0.01 * traced_opt.peak_allocated
    assert abs(est.peak_reserved - traced_opt.peak_reserved) < 0.01 * traced_opt.peak_reserved
    assert abs(traced_opt.peak_reserved - 5.9004 * GiB) < 0.01 * 5.9004 * GiB   # README row 7
