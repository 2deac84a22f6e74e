"""LOMO and AdaLomo (the HF Trainer's ``lomo`` / ``adalomo``): the update inside backward, each
parameter's from lomo_optim's tensor hook, measured against a real CPU run of lomo_optim's hook where
it is installed; the names, states and refusals always."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trainmem  # noqa: E402
from trainmem.estimate.quantities.optimizer_step import lomo_temporaries, lomo_update_bytes  # noqa: E402
from trainmem.estimate.states import model_states, state_bytes  # noqa: E402
from trainmem.spec import TrainingSpec, resolve_model  # noqa: E402
from test_cli import assert_one_error_line, run_cli  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SET = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2}


def _hook_peak(kind: str, dtype: torch.dtype, shape: tuple[int, int]) -> tuple[int, int]:
    """Peak bytes one call of lomo_optim's hook adds, above the gradient of the parameter it updates
    and the incoming gradient of the next (LiveBytes), and the incoming gradient's bytes."""
    lomo = pytest.importorskip("lomo_optim")
    from trainmem.measure import LiveBytes
    torch.manual_seed(0)
    model = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self   # AdaLomo's constructor moves its states with .cuda()
    try:
        opt = (lomo.AdaLomo if kind == "adalomo" else lomo.Lomo)(model, lr=1e-3)
    finally:
        torch.Tensor.cuda = cuda
    p = model.weight
    for _ in range(2):  # the second call is a steady one (AdaLomo's step counter past 0)
        p.grad = torch.randn(shape).to(dtype)
        incoming = torch.randn(shape).to(dtype)
        with LiveBytes() as lb:
            lb.track(model, opt, [opt.__dict__.get("exp_avg_sq_row", {}), opt.__dict__.get("exp_avg_sq_col", {})],
                     p.grad, incoming)
            before = lb.mark("before")
            opt.grad_func(incoming)
            peak = lb.mark("hook").peak - before.current
    return peak, incoming.untyped_storage().nbytes()


@pytest.mark.parametrize("kind", ["lomo", "adalomo"])
@pytest.mark.parametrize("precision", ["bf16", "bf16-amp"])
def test_hook_matches_real_lomo_optim(kind, precision):
    """One hook call: the fp32 copies (half weights), AdaLomo's update tensors, the gradient freed."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    peak, _ = _hook_peak(kind, dtype, (256, 128))  # every tensor a whole number of 512 B blocks
    t = TrainingSpec(optimizer=kind, precision=precision)
    assert peak == lomo_temporaries(t, (256, 128)), (peak, lomo_temporaries(t, (256, 128)))


def test_states():
    """AdaLomo: row and column fp32 of each matrix, a vector's own; Lomo: none."""
    assert state_bytes("adalomo", (4096, 11008), 4096 * 11008, 2) == (4096 * 4, 11008 * 4)
    assert state_bytes("adalomo", (4096,), 4096, 2) == (4096 * 4,)
    assert state_bytes("lomo", (4096, 11008), 4096 * 11008, 2) == ()
    m = resolve_model("llama-3.2-1b", SET)
    t = TrainingSpec(optimizer="adalomo", precision="bf16", seq_len=32)
    assert t.optimizer_in_backward
    assert model_states(m, t).optimizer == sum(
        -(-(sum(512 * -(-b // 512) for b in state_bytes("adalomo", p.shape, p.numel, 2))) // 1)
        for p in m.parameter_tensors())


def test_update_pairs_a_gradient_with_the_next():
    """A hook holds its parameter's incoming gradient, the neighbour's accumulated one and that one's
    update temporaries."""
    m = resolve_model("llama-3.2-1b", SET)
    t = TrainingSpec(optimizer="lomo", precision="bf16", seq_len=32)
    ps = list(m.parameter_tensors())
    mid, end = lomo_update_bytes(m, t)
    blk = lambda b: 512 * -(-b // 512)  # noqa: E731
    assert mid == max(blk(p.numel * 2) + blk(q.numel * 2) + lomo_temporaries(t, q.shape) for p, q in zip(ps, ps[1:]))
    assert end >= mid
    rep = trainmem.estimate(m, training=t)
    assert rep.peak_allocated < trainmem.estimate(m, training=TrainingSpec(optimizer="sgd", precision="bf16",
                                                                             seq_len=32)).peak_allocated + end


@pytest.mark.parametrize("args, word", [
    (["--optimizer", "lomo", "--precision", "fp16"], "clip_coef"),
    (["--optimizer", "adalomo", "--zero", "3", "--dp", "2"], "--zero"),
    (["--optimizer", "lomo", "--grad-accum", "2"], "accumulate"),
])
def test_refusals_are_one_line(capsys, args, word):
    line = assert_one_error_line(*run_cli(capsys, "estimate", "llama-3.2-1b", "--seq-len", "64", *args))
    assert word in line, line


@pytest.mark.parametrize("optimizer", ["lomo", "adalomo"])
def test_trace_agrees_with_estimate(optimizer):
    """trace runs lomo_optim's hooks (or galore_optim's port of them) with ``fused_backward`` and no
    step, as accelerate does; the estimate's peak within 0.01%, its reserved (each hook's update replayed
    when the next gradient exists) within 0.5% (a one-layer Llama-3.2-1B, pure bf16)."""
    kw = dict(set={"num_hidden_layers": 1, "vocab_size": 32000}, optimizer=optimizer, precision="bf16",
              batch_size=1, seq_len=64)
    e, t = trainmem.estimate("llama-3.2-1b", **kw), trainmem.trace("llama-3.2-1b", **kw)
    assert abs(e.peak_allocated - t.peak_allocated) <= 1e-4 * t.peak_allocated, (e.peak_allocated, t.peak_allocated)
    assert abs(e.peak_reserved - t.peak_reserved) <= 5e-3 * t.peak_reserved, (e.peak_reserved, t.peak_reserved)
