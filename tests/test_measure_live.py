"""LiveBytes (real-tensor memory tracker) against the PyTorch profiler's allocator events."""
from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

from trainmem.measure import LiveBytes, profiler_peak, storage_preserved  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mlp_step():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                            torch.nn.GELU(), torch.nn.Linear(512, 10))
    opt = torch.optim.AdamW(m.parameters(), foreach=False)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step():
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()  # optimizer states exist before the measured step
    return step


def _gpt2_step():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, loss_type="ForCausalLM")
    m = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))

    def step():
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    return step


@pytest.mark.parametrize("build", [_mlp_step, _gpt2_step], ids=["mlp", "gpt2-tiny"])
def test_peak_matches_profiler(build):
    prof_peak, prof_end, _ = profiler_peak(build())
    step = build()
    with LiveBytes() as lb:
        step()
    assert prof_peak > 1 << 20
    assert abs(lb.peak - prof_peak) <= 0.005 * prof_peak, (lb.peak, prof_peak)
    assert abs(lb.current - prof_end) <= 0.005 * prof_peak, (lb.current, prof_end)


def test_storage_objects_are_preserved():
    assert storage_preserved()


def test_alloc_free_views_and_inplace():
    with LiveBytes() as lb:
        a = torch.empty(1000)                 # 4000 B
        assert lb.current == 4000
        v = a.view(10, 100)[2:5]              # a view: no new memory
        a.add_(1)                             # in place: none
        assert lb.current == 4000
        del a
        assert lb.current == 4000             # the view keeps the storage alive
        del v
        assert lb.current == 0
        b = torch.ones(10, 10) * 2            # ones (400) and the product (400); ones freed
        assert lb.current == 400 and lb.peak == 4000
        t = torch.tensor([1.0, 2.0])          # torch.tensor goes through lift_fresh
        assert lb.current == 408
        del b, t
    assert lb.current == 0 and lb.allocations == 4


def test_saved_for_backward_is_counted_until_released():
    w = torch.randn(64, 64, requires_grad=True)
    with LiveBytes() as lb:
        h = torch.tanh(torch.randn(32, 64) @ w)  # tanh saves its output for backward
        y = h.sum()
        del h
        assert lb.current >= 2 * 32 * 64 * 4  # the input and tanh's saved output are alive
        y.backward()
        del y
        gc.collect()
        assert lb.current == 64 * 64 * 4      # only w.grad is left
    assert w.grad is not None


def test_preexisting_memory_is_ignored_unless_tracked():
    m = torch.nn.Linear(100, 100)
    with LiveBytes() as lb:
        m.weight.t()                        # a view of memory from before
        assert lb.current == 0
    with LiveBytes() as lb:
        added = lb.track(m)
        assert added == (100 * 100 + 100) * 4 == lb.current
        m.bias = None                       # releasing tracked memory is seen
        assert lb.current == 100 * 100 * 4


def test_marks_and_phases():
    with LiveBytes() as lb:
        a = torch.empty(250)                # 1000 B
        b = torch.empty(500)                # 2000 B
        del b
        m1 = lb.mark("forward")
        c = torch.empty(100)
        m2 = lb.mark("backward")
    assert (m1.name, m1.current, m1.peak) == ("forward", 1000, 3000)
    assert (m2.current, m2.peak) == (1400, 1400)
    phases = lb.phases(step=1)
    assert [p.name for p in phases] == ["forward", "backward"] and phases[0].peak == 3000
    assert lb.peak == 3000
    del a, c


def test_resize_is_followed():
    with LiveBytes() as lb:
        out = torch.empty(0)
        torch.cat([torch.ones(100), torch.ones(100)], out=out)  # resizes out's storage
        assert lb.current == 800
        del out
        assert lb.current == 0
