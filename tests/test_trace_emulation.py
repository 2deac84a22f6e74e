"""The CUDA emulation and the tracker on small programs whose bytes can be counted by hand.

Every expected number below is derived from the allocator rules of tests/test_allocator.py
(512 B rounding) and the tensor sizes; ``torch.cuda.memory_allocated()`` inside a traced step
answers from the allocator simulation.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from trainmem.errors import TrainmemError
from trainmem.trace.api import trace

WS = 8_519_680      # cuBLAS workspace per handle (non-Hopper default)
MiB = 1024 * 1024


def _run(step, factory=nn.Module, **kw):
    """Trace one step of ``step(model)`` and return (report, the values it recorded)."""
    seen: dict[str, object] = {}

    def fn(model):
        step(model, seen)

    return trace(factory, fn, steps=1, **kw), seen


def test_seed_001_cublas_workspace_snippet():
    """Seed 001 prints 512, 8520704, 8521216, 17041408 for this program on a GPU."""
    def step(model, seen):
        a = torch.randn(2, 2, requires_grad=True).cuda()
        a.retain_grad()
        seen["a"] = torch.cuda.memory_allocated()
        out = a.mm(a)
        seen["mm"] = torch.cuda.memory_allocated()
        gradient = torch.randn(2, 2).cuda()
        seen["gradient"] = torch.cuda.memory_allocated()
        out.backward(gradient)
        seen["backward"] = torch.cuda.memory_allocated()

    report, seen = _run(step)
    assert seen == {"a": 512, "mm": 8_520_704, "gradient": 8_521_216, "backward": 17_041_408}
    assert report.by_category()["workspace"] == 2 * WS


def test_autocast_policy_and_weight_cache():
    def factory():
        return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))

    def step(model, seen):
        lin, ln = model[0], model[1]
        x = torch.empty(8, 64, device="cuda")                       # 2048 B
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(x)
            seen["first"] = torch.cuda.memory_allocated() - base
            y2 = lin(x)
            seen["second"] = torch.cuda.memory_allocated() - base - seen["first"]
            seen["dtypes"] = (y.dtype, ln(y).dtype, F.softmax(y, -1).dtype, y.float().exp().dtype,
                              torch.exp(y).dtype, y.sum().dtype)
            before_exit = torch.cuda.memory_allocated()
        seen["exit"] = before_exit - torch.cuda.memory_allocated()
        del y, y2

    report, seen = _run(step, factory)
    # first linear: x cast to bf16 (1024 B), weight cast (8192 B, cached), bias cast (128 -> 512 B,
    # cached), output (1024 B), and the forward cuBLAS workspace
    assert seen["first"] == 1024 + 8192 + 512 + 1024 + WS
    # second linear: the weight and bias casts come from the autocast cache
    assert seen["second"] == 1024 + 1024
    # linear in bf16; layer_norm, softmax, exp in fp32; sum accumulates to fp32
    assert seen["dtypes"] == (torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.float32,
                              torch.float32)
    # leaving autocast clears the cache: x needs no grad, so autograd did not keep the casts
    assert seen["exit"] == 8192 + 512


def test_dropout_keeps_a_bool_mask():
    def step(model, seen):
        x = torch.empty(1000, 1000, device="cuda", requires_grad=True)
        base = torch.cuda.memory_allocated()
        y = F.dropout(x, 0.1, training=True)
        seen["delta"] = torch.cuda.memory_allocated() - base
        seen["eval"] = F.dropout(x, 0.1, training=False) is x
        del y

    _, seen = _run(step)
    # output 4,000,000 B -> 4,000,256; mask 1,000,000 B (bool) -> 1,000,448
    assert seen["delta"] == 4_000_256 + 1_000_448
    assert seen["eval"]


@pytest.mark.parametrize("dtype,mask,backend", [
    (torch.bfloat16, False, "flash"), (torch.float32, False, "efficient"), (torch.bfloat16, True, "efficient")])
def test_sdpa_backend_choice(dtype, mask, backend):
    def step(model, seen):
        q = torch.empty(2, 4, 128, 64, device="cuda", dtype=dtype, requires_grad=True)
        m = torch.zeros(128, 128, device="cuda", dtype=dtype) if mask else None
        base = torch.cuda.memory_allocated()
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=m, is_causal=not mask)
        seen["delta"] = torch.cuda.memory_allocated() - base
        out.float().sum().backward()

    report, seen = _run(step)
    assert report.extra["sdpa_backends"] == {backend: 1}
    out_bytes = 2 * 4 * 128 * 64 * dtype.itemsize
    if backend == "flash":   # output + logsumexp (fp32, B x H x T) + two philox scalars
        assert out_bytes + 4096 <= seen["delta"] <= out_bytes + 4096 + 1024
    else:                    # output + logsumexp (fp32, B x H x T rounded up to 32) + philox
        assert seen["delta"] >= out_bytes + 4096


def test_flash_pads_a_head_dim_that_is_not_a_multiple_of_8():
    """attention.cpp pads q, k, v to head_dim 104 (new tensors the kernel keeps), runs flash and
    slices the output; the caller's transpose(1, 2).contiguous() then copies the slice."""
    def step(model, seen):
        q, k, v = (torch.empty(2, 4, 128, 100, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        base = torch.cuda.memory_allocated()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        seen["delta"] = torch.cuda.memory_allocated() - base
        seen["shape"] = tuple(out.shape)
        ctx = out.transpose(1, 2).contiguous()
        seen["copy"] = torch.cuda.memory_allocated() - base - seen["delta"]
        ctx.float().sum().backward()
        seen["grad"] = tuple(q.grad.shape)

    report, seen = _run(step)
    assert report.extra["sdpa_backends"] == {"flash": 1}
    assert seen["shape"] == seen["grad"] == (2, 4, 128, 100)
    padded = 2 * 4 * 128 * 104 * 2            # 212,992 B each
    # padded q, k, v and output, logsumexp (fp32, B x H x T), two philox scalars
    assert 4 * padded + 4096 <= seen["delta"] <= 4 * padded + 4096 + 1024
    assert seen["copy"] == 2 * 4 * 128 * 100 * 2


def test_cudnn_attention_runs_first_on_hopper():
    """torch 2.13 wheels ship cuDNN 9.20: on sm90 ``priority_order`` tries cuDNN first; it keeps
    the output and fp32 stats (B x H x T x 1), as flash does."""
    def step(model, seen):
        q = torch.empty(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        base = torch.cuda.memory_allocated()
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        seen["delta"] = torch.cuda.memory_allocated() - base
        out.float().sum().backward()

    report, seen = _run(step, capability=(9, 0))
    assert report.extra["sdpa_backends"] == {"cudnn": 1}
    assert seen["delta"] == 2 * 4 * 128 * 64 * 2 + 4096 + 2 * 512
    report, _ = _run(step, capability=(8, 0))
    assert report.extra["sdpa_backends"] == {"flash": 1}


def test_a_pinned_backend_pytorch_refuses_is_an_error():
    def step(model, seen):
        q = torch.empty(2, 4, 128, 100, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)

    with pytest.raises(TrainmemError, match="divisible by 8"):
        _run(step, attention_backend="efficient")
    report, _ = _run(step, attention_backend="math")
    assert report.extra["sdpa_backends"] == {"math": 1}


def test_foreach_is_the_default_optimizer_implementation():
    def factory():
        return nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)])    # 4 x 1 MiB

    def run(foreach):
        def step(model, opt):
            model(torch.empty(4, 512, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        return trace(factory, step, steps=1,
                     optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), foreach=foreach))

    default, loop = run(None), run(False)
    ph_default, ph_loop = default.phase("optimizer_step", 1), loop.phase("optimizer_step", 1)
    assert ph_default.allocated == ph_loop.allocated                  # params + grads + 2 states
    # foreach: _foreach_sqrt of all exp_avg_sq at once (4 MiB) on top of the states
    assert ph_default.peak - ph_default.allocated >= 4 * MiB
    # for-loop: one parameter's sqrt and division at a time (1 MiB blocks)
    assert ph_loop.peak - ph_loop.allocated <= 3 * MiB
    assert "_foreach" in ph_default.where


def test_categories_phases_and_report_fields():
    report = trace("llama-3.1-8b", overrides=["num_hidden_layers=2", "hidden_size=256", "num_attention_heads=4",
                                              "num_key_value_heads=2", "intermediate_size=512", "vocab_size=2000",
                                              "head_dim=64"],
                   batch_size=4, seq_len=512, precision="bf16-amp", gpu="a100-80gb")
    names = [(p.name, p.step) for p in report.phases]
    assert names == [("model_loaded", 0), ("forward", 1), ("backward", 1), ("optimizer_step", 1), ("zero_grad", 1),
                     ("forward", 2), ("backward", 2), ("optimizer_step", 2), ("zero_grad", 2)]
    cats = report.by_category()
    for cat in ("parameters", "buffers", "activations", "optimizer_states", "workspace", "inputs"):
        assert cats.get(cat, 0) > 0, cat
    assert sum(c.bytes for c in report.components) == report.peak_allocated
    assert report.device_used == report.peak_reserved + report.hardware.context
    assert report.fits is True and report.capacity == report.hardware.capacity
    assert report.extra["sdpa_backends"] == {"flash": 4}
    assert report.peak_phase == "backward@2"
    rows = report.extra["largest_tensors"]
    assert rows == sorted(rows, key=lambda r: -r["block"]) and {"shape", "dtype", "module", "op"} <= set(rows[0])
    tl = report.extra["timeline"]
    assert max(e[1] for e in tl) == report.peak_allocated
    assert all(sum(e[3].values()) == e[1] for e in tl)            # the breakdown adds up to allocated
    # activations attributed to modules (layer indices folded), backward peak to the autograd node
    names = {c.name for c in report.components}
    assert "activations.model.layers.*.mlp.act_fn.silu" in names
    assert "activations.autocast_weight_cache" in names
    assert "(LogSoftmaxBackward0)" in report.peak_where


def test_gradient_checkpointing_and_expandable_segments():
    small = ["num_hidden_layers=4", "hidden_size=256", "num_attention_heads=4", "num_key_value_heads=4",
             "intermediate_size=1024", "vocab_size=512", "head_dim=64"]
    kw = dict(overrides=small, batch_size=4, seq_len=256, precision="bf16-amp")
    plain = trace("llama-3.1-8b", **kw)
    ckpt = trace("llama-3.1-8b", recompute="full", **kw)
    expandable = trace("llama-3.1-8b", expandable_segments=True, **kw)
    fwd_plain = plain.phase("forward", 2).allocated - plain.phase("zero_grad", 1).allocated
    fwd_ckpt = ckpt.phase("forward", 2).allocated - ckpt.phase("zero_grad", 1).allocated
    assert fwd_ckpt < fwd_plain / 2                   # only the layer inputs are kept
    assert ckpt.component("activations") < plain.component("activations")
    assert any("recomputed" in c.name for c in ckpt.components) or ckpt.peak_allocated < plain.peak_allocated
    assert expandable.peak_allocated <= plain.peak_allocated
    assert expandable.extra["expandable_segments"] is True


def test_cpu_and_cuda_traces_of_the_same_step():
    def factory():
        return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))

    def step(model, opt):
        dev = next(model.parameters()).device
        model(torch.empty(16, 256, device=dev)).sum().backward()
        opt.step()
        opt.zero_grad()

    opt_fn = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)   # noqa: E731
    cpu = trace(factory, step, device="cpu", optimizer_fn=opt_fn)
    cuda = trace(factory, step, device="cuda", optimizer_fn=opt_fn)
    params = 2 * (256 * 256 + 256) * 4
    assert cpu.phase("model_loaded").allocated == params                   # byte-exact on the CPU
    assert cuda.phase("model_loaded").allocated == params                  # all multiples of 512
    assert cuda.peak_allocated >= cpu.peak_allocated + 2 * WS
    assert cpu.peak_reserved is None and cuda.peak_reserved >= cuda.peak_allocated


def test_errors():
    with pytest.raises(TrainmemError, match="factory"):
        trace(nn.Linear(2, 2), lambda m: None)
    with pytest.raises(TrainmemError, match="step_fn"):
        trace(lambda: nn.Linear(2, 2))
    with pytest.raises(TrainmemError, match="parallel"):
        trace("gpt2", tp=2)
    with pytest.raises(TrainmemError, match="nanoGPT"):
        trace("nanogpt-124m")
    with pytest.raises(TrainmemError, match="selective"):
        trace("gpt2", recompute="selective")
    with pytest.raises(TrainmemError, match="device"):
        trace("gpt2", device="tpu")


def test_optimizer_in_backward_frees_gradients_during_backward():
    small = ["num_hidden_layers=2", "hidden_size=256", "num_attention_heads=4", "num_key_value_heads=4",
             "intermediate_size=1024", "vocab_size=512", "head_dim=64"]
    kw = dict(overrides=small, batch_size=2, seq_len=128, precision="bf16-amp")
    std = trace("llama-3.1-8b", **kw)
    inbwd = trace("llama-3.1-8b", optimizer_in_backward=True, **kw)
    params = std.by_category()["parameters"]
    # after backward the standard step holds every gradient; the in-backward step holds none
    assert std.phase("backward", 2).allocated - inbwd.phase("backward", 2).allocated >= params
    assert inbwd.peak_allocated < std.peak_allocated


def test_simulated_out_of_memory():
    report = trace("gpt2", batch_size=16, seq_len=1024, precision="fp32", gpu="t4", simulate_oom=True)
    assert report.fits is False
    assert any("out of memory" in w for w in report.warnings)
    assert report.extra["allocator"]["num_ooms"] == 1
    assert report.peak_reserved <= report.hardware.capacity - report.hardware.context
