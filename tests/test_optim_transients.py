"""The optimizer step's own transient memory: measured with LiveBytes on a real fp32 GPT-2
(2 layers, hidden 64) on the CPU, against what ``trainmem.estimate`` predicts.

torch 2.13's AdamW (torch/optim/adam.py): for-loop makes two temporaries of one parameter at a
time (``exp_avg_sq.sqrt()`` and its quotient), foreach one temporary per parameter for the whole
group at once (``_foreach_sqrt``), fused none.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trainmem  # noqa: E402
from trainmem.estimate.quantities.optimizer_step import oib_update_bytes, step_temporaries  # noqa: E402
from trainmem.estimate.states import model_states  # noqa: E402
from trainmem.measure import LiveBytes  # noqa: E402
from trainmem.optim import optimizer_in_backward  # noqa: E402
from trainmem.spec import TrainingSpec, resolve_model  # noqa: E402

SET = {"n_layer": 2, "n_embd": 64, "n_head": 4}
IMPLS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
B, S = 2, 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def spec():
    return resolve_model("gpt2", SET)


def _hf_model(spec):
    from transformers import GPT2Config, GPT2LMHeadModel
    keys = GPT2Config().to_dict()
    cfg = GPT2Config(**{k: v for k, v in spec.config.items() if k in keys})
    torch.manual_seed(0)
    m = GPT2LMHeadModel(cfg)
    assert sum(p.numel() for p in m.parameters()) == spec.num_params
    assert all(p.dtype == torch.float32 for p in m.parameters())
    return m


def _loss(m):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.config.vocab_size, (B, S), generator=g)
    return m(input_ids=ids, labels=ids).loss


def steady_step_bytes(m, opt) -> int:
    """Bytes ``opt.step()`` allocates above what is live before it, in the steady state (two steps first:
    the states exist), measured with LiveBytes on the CPU."""
    for _ in range(2):
        _loss(m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _loss(m).backward()
    with LiveBytes() as lb:
        lb.track(m, opt)
        before = lb.mark("before")
        opt.step()
        during = lb.mark("optimizer_step")
    return during.peak - before.current


def _close(measured: int, predicted: int) -> bool:
    if predicted == 0:
        return measured == 0
    return abs(measured - predicted) <= 0.05 * predicted


@pytest.mark.parametrize("impl", list(IMPLS))
def test_step_transient_matches_estimate(spec, impl):
    m = _hf_model(spec)
    measured = steady_step_bytes(m, torch.optim.AdamW(m.parameters(), **IMPLS[impl]))

    rep = trainmem.estimate("gpt2", set=SET, precision="fp32", optimizer_impl=impl, batch_size=B, seq_len=S)
    ph = rep.phase("optimizer_step", 2)
    predicted = ph.peak - ph.allocated
    st = model_states(spec, TrainingSpec(precision="fp32", optimizer_impl=impl, batch_size=B, seq_len=S))
    assert predicted == step_temporaries(rep.training, st)
    assert _close(measured, predicted), (impl, measured, predicted)
    largest = max(p.numel() for p in m.parameters()) * 4
    group = sum(p.numel() for p in m.parameters()) * 4
    expected = {"for-loop": 2 * largest, "foreach": group, "fused": 0}[impl]
    assert measured == expected, (impl, measured, expected)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_in_backward_update_transient_matches_estimate(spec, impl):
    """Per-parameter updates inside backward: the update's temporaries (and with the gradient,
    which is alive until the hook frees it) for the worst parameter."""
    m = _hf_model(spec)
    params = list(m.parameters())
    lb = LiveBytes()
    worst = {"tmp": 0, "with_grad": 0}
    start: dict[int, tuple[int, int]] = {}

    def first(p):  # runs before the optimizer's hook (registered earlier)
        start[id(p)] = (lb.mark("hook").current, p.grad.untyped_storage().nbytes())

    def last(p):
        cur, g = start[id(p)]
        pk = lb.mark("update").peak
        worst["tmp"] = max(worst["tmp"], pk - cur)
        worst["with_grad"] = max(worst["with_grad"], pk - cur + g)

    for p in params:
        p.register_post_accumulate_grad_hook(first)
    opt = optimizer_in_backward(m, torch.optim.AdamW, **IMPLS[impl])
    for p in params:
        p.register_post_accumulate_grad_hook(last)
    for _ in range(2):
        _loss(m).backward()
        opt.step()
    worst.update(tmp=0, with_grad=0)
    loss = _loss(m)
    with lb:
        lb.track(m, opt)
        loss.backward()
        opt.step()
    opt.remove()

    t = TrainingSpec(precision="fp32", optimizer_impl=impl, batch_size=B, seq_len=S, optimizer_in_backward=True)
    st = model_states(spec, t)
    assert _close(worst["tmp"], step_temporaries(t, st)), (impl, worst, step_temporaries(t, st))
    _, at_end = oib_update_bytes(spec, t, st)
    assert _close(worst["with_grad"], at_end), (impl, worst, at_end)
