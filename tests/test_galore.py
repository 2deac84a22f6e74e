"""GaLore (the HF Trainer's galore_* optimizers): the names and options, the states of each target
weight, and the step's allocations, against a real CPU run of galore_torch where it is installed.

galore_torch's ``__init__`` imports its 8-bit AdamW, which imports bitsandbytes; where bitsandbytes
is missing (it needs CUDA) a stand-in module lets the AdamW and Adafactor be imported: the 8-bit
class is never built here.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trainmem  # noqa: E402
from trainmem.errors import TrainmemError  # noqa: E402
from trainmem.estimate.galore import (GTensor, galore_state_bytes, projected_shape, projector_bytes,  # noqa: E402
                                      step_order, step_peak)
from trainmem.estimate.quantities.optimizer_step import galore_oib_bytes, galore_step_bytes  # noqa: E402
from trainmem.estimate.states import block_bytes, model_states  # noqa: E402
from trainmem.spec import TrainingSpec, resolve_model  # noqa: E402
from trainmem.spec.resolve import framework_names  # noqa: E402
from trainmem.spec.training import galore_target  # noqa: E402
from bnb_stub import import_without_bitsandbytes  # noqa: E402
from test_cli import assert_one_error_line, run_cli  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
SET = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2}


def _galore_torch():
    return import_without_bitsandbytes("galore_torch")


# ----- the mechanism: the projector an fp32 SVD leaves ------------------------------------------------
def test_fp32_projector_keeps_the_whole_svd_factor():
    """``Vh[:r, :]`` of an fp32 gradient is a view: the projector keeps all of Vh (k, n); a bf16
    gradient's is cast to a new (r, n) tensor (galore_projector.py L86-92)."""
    g = torch.randn(160, 64)
    _, _, vh = torch.linalg.svd(g, full_matrices=False)
    kept = vh[:8, :]
    assert kept.untyped_storage().nbytes() == 64 * 64 * 4 == projector_bytes((160, 64), 8, "std", 4)[0]
    half = kept.type(torch.bfloat16)
    assert half.untyped_storage().nbytes() == 8 * 64 * 2 == projector_bytes((160, 64), 8, "std", 2)[0]
    assert projected_shape((160, 64), 8, "std") == (160, 8) and projected_shape((64, 160), 8, "std") == (8, 160)
    assert projected_shape((160, 64), 8, "reverse_std") == (8, 64)


# ----- a real CPU run of galore_torch ------------------------------------------------------------------
def _model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).to(dtype)


def _projectors(opt):
    out = []
    for st in opt.state.values():
        om = st["projector"].ortho_matrix if "projector" in st else None
        out += [] if om is None else (om if isinstance(om, list) else [om])
    return out


def _state_storage_bytes(opt) -> int:
    seen = {}
    for st in opt.state.values():
        for v in [x for x in st.values() if torch.is_tensor(x)]:
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    for v in _projectors(opt):
        seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def _groups(m, targets):
    names = {n + ".weight" for n, mod in m.named_modules()
             if isinstance(mod, torch.nn.Linear) and any(k in n for k in targets)}
    tensors = [GTensor(tuple(p.shape), n in names) for n, p in m.named_parameters()]
    return names, tensors


def _build(gt, kind, m, names, kw, per_parameter=False):
    cls = gt.GaLoreAdafactor if kind == "galore-adafactor" else gt.GaLoreAdamW
    extra = {"scale_parameter": False, "relative_step": False} if kind == "galore-adafactor" else {}
    if per_parameter:  # the HF Trainer's layerwise optimizer_dict (trainer_optimizer.py L168-173)
        return [cls([{"params": [p], **(kw if n in names else {})}], lr=1e-3, **extra)
                for n, p in m.named_parameters()]
    groups = [{"params": [p for n, p in m.named_parameters() if n not in names]},
              {"params": [p for n, p in m.named_parameters() if n in names], **kw}]
    return cls(groups, lr=1e-3, **extra)


def _measured_steps(m, opts, steps=4):
    """Peak bytes above what is live before each step (LiveBytes; the projectors tracked, so their
    replacement at a projector-update step is seen freed); per-parameter optimizers: the largest
    single step."""
    from trainmem.measure import LiveBytes
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    out = []
    for _ in range(steps):
        m(input_ids=ids, labels=ids).loss.backward()
        best = 0
        for o in opts:
            with LiveBytes() as lb:
                lb.track(m, opts, [_projectors(x) for x in opts])
                before = lb.mark("before")
                o.step()
                best = max(best, lb.mark("step").peak - before.current)
        out.append(best)
        for o in opts:
            o.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", ["galore-adamw", "galore-adafactor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("proj", ["std", "reverse_std", "full"])
def test_states_and_step_match_real_galore_torch(kind, dtype, proj):
    """States (projectors included) and the step's peak, at a steady step (1, 3) and at a projector
    update (2: update_proj_gap 2), byte for byte as galore_torch allocates them."""
    gt = _galore_torch()
    m = _model(dtype)
    names, tensors = _groups(m, ("attn", "mlp"))
    kw = {"rank": 8, "update_proj_gap": 2, "scale": 0.25, "proj_type": proj}
    opt = _build(gt, kind, m, names, kw)
    measured = _measured_steps(m, [opt])
    w = 4 if dtype == torch.float32 else 2
    assert _state_storage_bytes(opt) == sum(sum(galore_state_bytes(kind, x.shape, x.target, w, 8, proj))
                                            for x in tensors)
    order = step_order(tensors)
    steady, update = (step_peak(order, kind, w, 8, proj, svd, scratch=False) for svd in (False, True))
    assert measured[1] == measured[3] == steady, (measured, steady)
    assert measured[2] == update, (measured, update)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layerwise_step_matches_real_galore_torch(dtype):
    """The layerwise variant: one GaLoreAdamW per parameter; the largest single step."""
    gt = _galore_torch()
    m = _model(dtype)
    names, tensors = _groups(m, ("attn", "mlp"))
    opts = _build(gt, "galore-adamw", m, names, {"rank": 8, "update_proj_gap": 2, "scale": 0.25, "proj_type": "std"},
                  per_parameter=True)
    measured = _measured_steps(m, opts)
    w = 4 if dtype == torch.float32 else 2
    steady, update = (step_peak(tensors, "galore-adamw", w, 8, "std", svd, layerwise=True, scratch=False)
                      for svd in (False, True))
    assert measured[1] == measured[3] == steady and measured[2] == update, (measured, steady, update)


# ----- the estimate -----------------------------------------------------------------------------------
def _spec(**kw):
    return TrainingSpec(**framework_names({"batch_size": 2, "seq_len": 32, "precision": "bf16",
                                           "optim_target_modules": "attn,mlp", **kw}))


def test_estimate_counts_galore_states_and_step():
    """The states are the projectors and projected states of the attention and MLP weights (bf16:
    (r, n) / (m, r) projector casts) plus plain bf16 Adam states elsewhere, each allocator-rounded;
    the step phase rises by the replayed step."""
    m = resolve_model("llama-3.2-1b", SET)
    t = _spec(optimizer="galore_adamw", optim_args="rank=8")
    r = 8
    expected = 0
    for p in m.parameter_tensors():
        if galore_target(t, p):
            mm, n = p.shape
            a, b = (mm, r) if mm >= n else (r, n)
            proj = r * n * 2 if mm >= n else mm * r * 2
            expected += block_bytes(proj) + 2 * block_bytes(a * b * 2)
        else:
            expected += 2 * block_bytes(p.numel * 2)
    assert {p.module for p in m.parameter_tensors() if galore_target(t, p)} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert model_states(m, t).optimizer == expected
    rep = trainmem.estimate(m, training=t)
    ph = rep.phase("optimizer_step", 2)
    assert ph.peak - ph.allocated == galore_step_bytes(m, t) > 0


def test_fp32_weights_keep_whole_factors():
    """bf16-amp (fp32 weights and gradients): each projector keeps the fp32 SVD factor, min(m, n)^2."""
    m = resolve_model("llama-3.2-1b", SET)
    t = _spec(optimizer="galore_adamw", optim_args="rank=8", precision="bf16-amp")
    q = next(p for p in m.parameter_tensors() if p.module == "q_proj")
    st = galore_state_bytes("galore-adamw", q.shape, True, 4, 8, "std")
    k, big = min(q.shape), max(q.shape)
    assert st == (k * k * 4, big * 8 * 4, big * 8 * 4)
    assert model_states(m, t).optimizer > model_states(m, _spec(optimizer="galore_adamw", optim_args="rank=8")).optimizer


def test_layerwise_is_optimizer_in_backward():
    """galore_adamw_layerwise: trainmem's optimizer-in-backward, no gradients kept, each parameter's
    gradient plus its own step at once (galore_oib_bytes)."""
    t = _spec(optimizer="galore_adamw_layerwise")
    assert t.optimizer == "galore-adamw" and t.optimizer_in_backward
    m = resolve_model("llama-3.2-1b", SET)
    mid, end = galore_oib_bytes(m, t)
    assert end >= mid > 0
    full = resolve_model("llama-3.2-1b")  # 1.2B parameters: no gradients kept outweighs the step in backward
    lw, whole = (trainmem.estimate(full, training=_spec(optimizer=o)).peak_allocated
                 for o in ("galore_adamw_layerwise", "galore_adamw"))
    assert lw < whole


def test_8bit_states_are_bitsandbytes_on_the_projected_shape():
    """GaLoreAdamW8bit: Optimizer2State's uint8 states + fp32 absmax per 256 on the projected gradient
    (p.data swapped for it, adamw8bit.py L55-61); tensors under 4096 elements keep fp32 states."""
    st = galore_state_bytes("galore-adamw-8bit", (4096, 4096), True, 2, 128, "std")
    n = 4096 * 128
    assert st == (128 * 4096 * 2, n, n, n // 256 * 4, n // 256 * 4)
    assert galore_state_bytes("galore-adamw-8bit", (64,), False, 2, 128, "std") == (64 * 4, 64 * 4)


# ----- options and refusals ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, word", [
    (["--optimizer", "galore_adamw"], "--optim-target-modules"),
    (["--optimizer", "galore_adafactor_layerwise", "--optim-target-modules", "attn"], "relative_step"),
    (["--optimizer", "galore_adamw", "--optim-target-modules", "attn", "--zero", "2", "--dp", "2"], "--zero"),
    (["--optimizer", "galore_adamw", "--optim-target-modules", "attn", "--optim-args", "rank=8,foo=1"], "foo"),
    (["--optimizer", "galore_adamw", "--optim-target-modules", "attn", "--optim-args", "proj_type=diag"], "proj_type"),
    (["--optimizer", "galore_adamw_layerwise", "--optim-target-modules", "attn", "--dp", "2"], "DDP"),
    (["--optimizer", "adamw", "--optim-args", "rank=8"], "--optim-args"),
    (["--optimizer", "galore_adamw", "--optim-target-modules", "nothing_here"], "No target modules"),
])
def test_refusals_are_one_line(capsys, args, word):
    line = assert_one_error_line(*run_cli(capsys, "estimate", "llama-3.2-1b", "--seq-len", "64", *args))
    assert word in line, line


def test_gpt2_conv1d_is_refused(capsys):
    line = assert_one_error_line(*run_cli(capsys, "estimate", "gpt2", "--optimizer", "galore_adamw",
                                          "--optim-target-modules", "all-linear"))
    assert "Conv1D" in line


# ----- trace ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer, precision", [("galore_adamw", "bf16"), ("galore_adamw", "bf16-amp"),
                                                  ("galore_adafactor", "bf16"), ("galore_adafactor", "bf16-amp")])
@pytest.mark.parametrize("gap", [1, 1000])
def test_trace_step_is_the_replayed_step(optimizer, precision, gap):
    """trace runs the HF Trainer's groups with galore_torch's classes, or where it is missing
    galore_optim's, on the real model; its second optimizer step (states made; update_proj_gap 1: a
    projector update, 1000: a steady step) rises by exactly the replayed step (``linalg_svd``'s
    in-kernel input copy is invisible to trace on fake tensors: scratch=False)."""
    kw = dict(set=SET, optimizer=optimizer, precision=precision, optim_target_modules="attn,mlp",
              optim_args=f"rank=8,update_proj_gap={gap}", batch_size=2, seq_len=32)
    ph = trainmem.trace("llama-3.2-1b", **kw).phase("optimizer_step", 2)
    m, t = resolve_model("llama-3.2-1b", SET), _spec(**{k: v for k, v in kw.items() if k != "set"})
    tensors = step_order([GTensor(p.shape, galore_target(t, p)) for p in m.parameter_tensors()])
    assert ph.peak - ph.allocated == step_peak(tensors, t.optimizer, t.weight_bytes, 8, "std", gap == 1,
                                               block_bytes, scratch=False)


def test_trace_layerwise_agrees_with_estimate():
    """The layerwise hooks (trainer_optimizer.py L164-184) traced: the estimate's peak within 0.5%
    (the same setup with adamw_torch differs by as much, in backward: 1.1% here, not GaLore's)."""
    kw = dict(set=SET, optimizer="galore_adamw_layerwise", precision="bf16", optim_target_modules="attn,mlp",
              optim_args="rank=8,update_proj_gap=2", batch_size=2, seq_len=32)
    e, t = trainmem.estimate("llama-3.2-1b", **kw), trainmem.trace("llama-3.2-1b", **kw)
    assert abs(e.peak_allocated - t.peak_allocated) <= 0.005 * t.peak_allocated, (e.peak_allocated, t.peak_allocated)


def test_trace_refuses_8bit(capsys):
    line = assert_one_error_line(*run_cli(capsys, "trace", "llama-3.2-1b", "--set", "num_hidden_layers=2",
                                          "--seq-len", "32", "--optimizer", "galore_adamw_8bit",
                                          "--optim-target-modules", "attn"))
    assert "not traced" in line
