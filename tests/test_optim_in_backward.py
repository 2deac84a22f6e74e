"""trainmem.optim.optimizer_in_backward: same updates as the standard loop, less memory, loud
failures where the technique cannot work."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from trainmem.optim import (GlobalClipError, GradientAccumulationError,  # noqa: E402
                            OptimizerInBackward, optimizer_in_backward)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # deterministic matmuls: bit-for-bit comparisons


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4))


def _batches(n=5):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def _loss(m, x):
    return m(x).pow(2).mean()


def _train_standard(m, opt, batches, sched=None):
    lrs = []
    for x in batches:
        _loss(m, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
            lrs.append(sched.get_last_lr())
    return lrs


def _same(a, b, exact=False):
    for p, q in zip(a.parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q)
        else:
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kw, exact", [({"foreach": False}, True), ({}, True), ({"foreach": True}, False),
                                       ({"fused": True}, False)], ids=["for-loop", "default", "foreach", "fused"])
def test_same_parameters_as_standard_loop(kw, exact):
    a, b = _model(), _model()
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    _train_standard(a, torch.optim.AdamW(a.parameters(), **hyper), _batches())
    opt = optimizer_in_backward(b, torch.optim.AdamW, **hyper)
    _train_standard(b, opt, _batches())
    _same(a, b, exact)
    assert all(p.grad is None for p in b.parameters())
    assert opt.updates == 5 * len(list(b.parameters())) and opt.iterations == 5


def test_one_optimizer_and_one_hook_per_parameter_and_no_data_access():
    class Watched(torch.nn.Parameter):
        touched = 0

        @property
        def data(self):
            Watched.touched += 1
            return torch.nn.Parameter.data.__get__(self)

        @data.setter
        def data(self, value):
            Watched.touched += 1
            torch.nn.Parameter.data.__set__(self, value)

    w, b = Watched(torch.randn(4, 3)), Watched(torch.randn(4))
    ptrs = (w.data_ptr(), b.data_ptr())
    Watched.touched = 0
    opt = optimizer_in_backward([w, b], torch.optim.AdamW, lr=0.1)
    assert len(opt.optimizers) == 2
    assert [o.param_groups[0]["params"] for o in opt.optimizers] == [[w], [b]]
    assert len(w._post_accumulate_grad_hooks) == 1 and len(b._post_accumulate_grad_hooks) == 1
    v0 = w._version
    x = torch.randn(5, 3)
    for _ in range(2):
        (x @ w.t() + b).pow(2).sum().backward()
        opt.step()
    assert Watched.touched == 0                       # updates in place, never through .data
    assert (w.data_ptr(), b.data_ptr()) == ptrs and w._version > v0
    assert type(w) is Watched and w.grad is None


def test_fsdp2_style_hook_call_without_process_group():
    """FSDP2 assigns the reduce-scattered shard to ``sharded_param.grad`` and then calls the
    parameter's ``_post_accumulate_grad_hooks`` itself (``foreach_reduce``). Do the same."""
    a, b = _model(), _model()
    _train_standard(a, torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False), _batches(2))
    opt = optimizer_in_backward(b, torch.optim.AdamW, lr=1e-2, foreach=False)
    for x in _batches(2):
        grads = torch.autograd.grad(_loss(b, x), list(b.parameters()))
        for p, g in zip(b.parameters(), grads):
            p.grad = g                                 # what FSDP2 does after reduce-scatter
            for hook in (p._post_accumulate_grad_hooks or {}).values():
                hook(p)
            assert p.grad is None
        opt.step()
    _same(a, b, exact=True)


def test_fsdp2_single_rank_gloo():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    except Exception as e:  # pragma: no cover - platform without gloo
        pytest.skip(f"no single-rank gloo process group: {e}")
    try:
        a, b = _model(), _model()
        for m in (a, b):
            fully_shard(m[0])
            fully_shard(m)
        assert all(isinstance(p, DTensor) for p in b.parameters())
        _train_standard(a, torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False), _batches(3))
        opt = optimizer_in_backward(b, torch.optim.AdamW, lr=1e-2, foreach=False)
        _train_standard(b, opt, _batches(3))
        assert opt.updates == 3 * len(list(b.parameters()))
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.allclose(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-7)
        assert all(p.grad is None for p in b.parameters())
    finally:
        dist.destroy_process_group()


def test_lr_scheduler_drives_every_parameter():
    a, b = _model(), _model()
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    ob = optimizer_in_backward(b, torch.optim.AdamW, lr=1e-2, foreach=False)
    sa = torch.optim.lr_scheduler.OneCycleLR(oa, max_lr=3e-2, total_steps=6)
    sb = torch.optim.lr_scheduler.OneCycleLR(ob, max_lr=3e-2, total_steps=6)
    la = _train_standard(a, oa, _batches(), sa)
    lb = _train_standard(b, ob, _batches(), sb)
    assert la == lb and len(set(map(tuple, la))) > 1
    _same(a, b, exact=True)
    # a manual edit of the group reaches the per-parameter optimizers at their next update
    ob.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in b.parameters()]
    _loss(b, _batches(1)[0]).backward()
    ob.step()
    assert all(o.param_groups[0]["lr"] == 0.0 for o in ob.optimizers)
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))  # lr 0: no change


def test_param_groups_keep_their_options():
    m = _model()
    groups = [{"params": list(m[0].parameters()), "lr": 0.1},
              {"params": list(m[3].parameters()) + list(m[2].parameters()), "weight_decay": 0.0}]
    opt = optimizer_in_backward(groups, torch.optim.AdamW, lr=1e-3, weight_decay=0.5)
    lr = {id(o.param_groups[0]["params"][0]): (o.param_groups[0]["lr"], o.param_groups[0]["weight_decay"])
          for o in opt.optimizers}
    assert lr[id(m[0].weight)] == (0.1, 0.5) and lr[id(m[3].weight)] == (1e-3, 0.0)
    std = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.5)
    assert opt.state_dict()["param_groups"] == std.state_dict()["param_groups"]


def test_state_dict_round_trip_and_interchange_with_standard_optimizer():
    hyper = dict(lr=1e-2, foreach=False)
    a, b, c = _model(), _model(), _model()
    batches = _batches(6)
    # a: standard throughout
    _train_standard(a, torch.optim.AdamW(a.parameters(), **hyper), batches)
    # b: in-backward for 3 steps, checkpoint, new object, load, 3 more
    ob = optimizer_in_backward(b, torch.optim.AdamW, **hyper)
    _train_standard(b, ob, batches[:3])
    sd = copy.deepcopy(ob.state_dict())
    ob.remove()
    ob2 = optimizer_in_backward(b, torch.optim.AdamW, **hyper)
    ob2.load_state_dict(sd)
    assert ob2.state_dict()["param_groups"] == sd["param_groups"]
    for k, st in sd["state"].items():
        for name, v in st.items():
            assert torch.equal(ob2.state_dict()["state"][k][name], v)
    _train_standard(b, ob2, batches[3:])
    _same(a, b, exact=True)
    # c: in-backward for 3 steps, then its checkpoint loaded into a standard AdamW
    oc = optimizer_in_backward(c, torch.optim.AdamW, **hyper)
    _train_standard(c, oc, batches[:3])
    oc.remove()
    std = torch.optim.AdamW(c.parameters(), **hyper)
    std.load_state_dict(oc.state_dict())
    _train_standard(c, std, batches[3:])
    _same(a, c, exact=True)
    # and a standard checkpoint loaded into an in-backward optimizer
    d = _model()
    od = torch.optim.AdamW(d.parameters(), **hyper)
    _train_standard(d, od, batches[:3])
    oib = optimizer_in_backward(d, torch.optim.AdamW, **hyper)
    oib.load_state_dict(od.state_dict())
    _train_standard(d, oib, batches[3:])
    _same(a, d, exact=True)
    assert set(oib.state) == set(d.parameters()) and "exp_avg" in oib.state[d[0].weight]


def test_zero_grad_is_a_no_op_and_grads_are_freed_in_backward():
    m = _model()
    opt = optimizer_in_backward(m, torch.optim.SGD, lr=0.1)
    seen = []
    m[3].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is None))
    _loss(m, _batches(1)[0]).backward()
    assert seen == [True]  # freed by the optimizer's hook, registered first
    m[0].weight.grad = torch.ones_like(m[0].weight)
    opt.zero_grad()
    assert m[0].weight.grad is not None  # zero_grad touches nothing
    m[0].weight.grad = None


def test_gradient_accumulation_raises():
    m = _model()
    opt = optimizer_in_backward(m, torch.optim.AdamW, lr=1e-2)
    x = _batches(1)[0]
    _loss(m, x).backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(GradientAccumulationError, match="grad_accum=1.*standard optimizer"):
        _loss(m, x).backward()
    # nothing was updated by the refused backward
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    assert all(p.grad is None for p in m.parameters())  # and left no gradient behind
    opt.step()  # closes the iteration: the next backward is fine, and equals a clean run
    _loss(m, x).backward()
    opt.step()
    ref = _model()
    oref = optimizer_in_backward(ref, torch.optim.AdamW, lr=1e-2)
    for _ in range(2):
        _loss(ref, x).backward()
        oref.step()
    _same(ref, m, exact=True)


def test_global_norm_clipping_raises_and_value_clipping_works():
    m = _model()
    opt = optimizer_in_backward(m, torch.optim.SGD, lr=1.0)
    with pytest.raises(GlobalClipError, match="clip_grad_value"):
        opt.clip_grad_norm_(1.0)
    a, b = _model(), _model()
    x = _batches(1)[0] * 100
    _loss(a, x).backward()
    torch.nn.utils.clip_grad_value_(a.parameters(), 1e-3)
    torch.optim.SGD(a.parameters(), lr=1.0).step()
    ob = optimizer_in_backward(b, torch.optim.SGD, lr=1.0, clip_grad_value=1e-3)
    _loss(b, x).backward()
    ob.step()
    _same(a, b, exact=True)


def test_remove_and_context_manager():
    m = _model()
    with optimizer_in_backward(m, torch.optim.SGD, lr=0.1) as opt:
        assert opt.active
        _loss(m, _batches(1)[0]).backward()
        opt.step()
        assert all(p.grad is None for p in m.parameters())
    assert not opt.active and all(not p._post_accumulate_grad_hooks for p in m.parameters())
    before = [p.detach().clone() for p in m.parameters()]
    _loss(m, _batches(1)[0]).backward()
    assert all(p.grad is not None for p in m.parameters())  # hooks gone: plain gradients
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))


def test_refuses_what_cannot_work():
    class DistributedDataParallel(torch.nn.Module):  # stands in for the real wrapper's name
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="FSDP2"):
        optimizer_in_backward(DistributedDataParallel(), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="Optimizer class"):
        optimizer_in_backward(_model(), "adamw")
    with pytest.raises(ValueError, match="empty"):
        optimizer_in_backward([], torch.optim.SGD, lr=0.1)
    frozen = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="empty"):
        optimizer_in_backward(frozen, torch.optim.SGD, lr=0.1)
    assert isinstance(optimizer_in_backward(_model(), torch.optim.SGD, lr=0.1), torch.optim.Optimizer)
    assert isinstance(optimizer_in_backward(_model(), torch.optim.SGD, lr=0.1), OptimizerInBackward)
