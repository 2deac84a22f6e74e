"""DeepSpeed ZeRO-3 of a model built outside ``zero.Init`` in releases up to 0.19.3 trains with torch's own
``F.linear``: ``MmBackward`` saves the transposed weight, a view of the gathered storage, so ZeRO-3's
``free_param`` after the module's forward frees nothing until that linear's backward
(``quantities.zero3_gather.deepspeed_linear_kept``; ``zero3_linear_wrap`` saves the parameter itself and is installed
only by ``zero.Init``'s ``__enter__`` at v0.14.2, also for ``Init(module=...)`` from DeepSpeed #8189, v0.19.4).
Found on Giles Thomas's Llama-3-8B ZeRO-3 rows over 8 GPUs (docs/validation.md, fifteenth session)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.estimate.quantities.zero3_gather import deepspeed_linear_kept
from trainmem.spec.resolve import resolve

MiB = 2 ** 20
PUBLISHED = os.path.join(os.path.dirname(__file__), "..", "validation", "published")
#: one Llama-3-8B layer's matmul weights: q, o (4096 x 4096), k, v (1024 x 4096), gate, up, down (14336 x 4096)
LAYER = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096


def _fx(name: str) -> dict:
    return json.load(open(os.path.join(PUBLISHED, name + ".json")))


def _kept(fx: dict, **over) -> int:
    r = resolve(fx["model"], **{**fx["setup"], **over})
    return deepspeed_linear_kept(r.model, r.training)


def test_kept_is_one_layers_matmul_weights_whole_in_fp16():
    fx = _fx("gpjt_llama3_8b_zero3_s1001_dp8_es")
    weights = [(4096, 4096)] * 2 + [(1024, 4096)] * 2 + [(14336, 4096)] * 3
    assert sum(a * b for a, b in weights) == LAYER
    assert _kept(fx) == sum(block_bytes(a * b * 2, True) for a, b in weights)


def test_kept_only_without_the_linear_wrapper():
    fx = _fx("gpjt_llama3_8b_zero3_s1001_dp8_es")
    assert _kept(fx, deepspeed_version="0.19.1") > 0
    assert _kept(fx, deepspeed_version="0.19.3") > 0       # the last release without #8189
    assert _kept(fx, deepspeed_version="0.19.4") == 0      # #8189: the wrapper for existing models too
    assert _kept(fx, deepspeed_version="0.19.8") == 0
    assert _kept(fx, deepspeed_version=None) == 0
    assert _kept(fx, zero_init="on") == 0                  # zero.Init's __enter__ installs the wrapper
    assert _kept(fx, recompute="full") == 0                # checkpointed layers save nothing in forward
    assert _kept(fx, dp=1) == 0                            # one rank: the gathered parameter is its partition
    assert _kept(fx, zero=2, zero_init=None) == 0          # not ZeRO-3


def test_saved_transpose_keeps_the_storage_after_the_parameter_is_swapped_out():
    """The mechanism in torch itself: ``F.linear`` on a 3-d input saves ``weight.t()``; replacing the
    parameter's storage (what ``free_param`` does) leaves the saved view's storage alive until backward."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(2, 3, 4, requires_grad=True)
    old = w.data
    y = torch.nn.functional.linear(x, w)
    storage = old.untyped_storage()
    w.data = torch.empty(0)
    saved = [t for t in _saved_tensors(y.grad_fn) if t.untyped_storage().data_ptr() == storage.data_ptr()]
    assert saved, "the linear's autograd graph keeps no view of the weight's storage"


def _saved_tensors(fn) -> list:
    out, seen, todo = [], set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        for name in dir(f):
            if name.startswith("_saved_"):
                v = getattr(f, name)
                if isinstance(v, torch.Tensor):
                    out.append(v)
        todo.extend(n for n, _ in f.next_functions)
    return out


def test_published_zero3_rows():
    """Before: -39.8 / -36.6 / -30.5 % (S = 1, 1001, 2001). The 32 layers' kept weights (13,312 MiB) are
    counted at the loss, where the estimate's peak is at 1001 and 2001 tokens: now within 5.1 %; the
    rest (about 2 GiB at both lengths, 5.6 GiB at one token) is not found (docs/validation.md)."""
    for s, lo in ((1, -0.17), (1001, -0.06), (2001, -0.05)):
        fx = _fx(f"gpjt_llama3_8b_zero3_s{s}_dp8_es")
        r = trainmem.estimate(fx["model"], **fx["setup"])
        measured = next(m["mib"] for m in fx["measured"] if m["quantity"] == "peak_active") * MiB
        parts = {c.name: c.bytes for c in r.components}
        assert parts["communication.deepspeed_linear_kept"] == 32 * _kept(fx)
        assert lo < r.peak_allocated / measured - 1 < 0


@pytest.mark.slow
def test_estimate_is_deepspeeds_own_engine_with_torchs_linear(monkeypatch):
    """The estimate's 0.14.2 path (torch's ``F.linear`` keeping every layer's gathered weights) against
    DeepSpeed's own engine made to run torch's ``F.linear`` too: DeepSpeed 0.19.8's
    ``zero_optimization.memory_efficient_linear: false`` (``runtime/zero/config.py`` L346;
    ``partition_parameters.py`` L1080-1091: ``Init(module=...)`` then installs no ``zero3_linear_wrap``), what
    v0.14.2 did for a model built outside ``zero.Init``. Giles Thomas's Llama-3-8B ZeRO-3 setup at one token
    (dp 8, fp16, no zero.Init) cut to 4 layers: the allocated peaks agree to the byte's MiB (8,419.1 MiB, the
    head's weight-gradient matmul in the second backward), so the published rows' remaining shortfall is no
    allocation of DeepSpeed's stage-3 code (docs/validation.md, twenty-fourth session). Without
    ``deepspeed_linear_kept`` the estimate reads 7,587 MiB."""
    pytest.importorskip("deepspeed")
    from trainmem.trace import deepspeed_engine, trace
    own = deepspeed_engine.config

    def config(t):
        cfg = own(t)
        cfg["zero_optimization"]["memory_efficient_linear"] = False
        return cfg
    monkeypatch.setattr(deepspeed_engine, "config", config)
    fx = _fx("gpjt_llama3_8b_zero3_s1_dp8_es")
    setup = {k: v for k, v in fx["setup"].items() if not k.endswith("_version")}
    traced = trace(fx["model"], set={"num_hidden_layers": 4}, **setup)
    est = trainmem.estimate(fx["model"], set={"num_hidden_layers": 4}, **fx["setup"])
    assert abs(est.peak_allocated - traced.peak_allocated) < MiB
