"""A Llama decoder layer's forward in the allocator replay in trace's op order, without autocast
(transformers 5.24.0 ``models/llama/modeling_llama.py``): ``LlamaRMSNorm.forward`` L62-67 (``to(float32)``,
``pow(2)``, ``mean``, ``+ eps``, ``rsqrt``, the fp32 product, its cast, the weight's product) and
``apply_rotary_pos_emb`` L119-148 (``q * cos``, ``-x2``, ``cat``, ``* sin``, their sum, for q then k) with
the projections' outputs (``layers._llama_norm_group``, ``layers._llama_rotary_group``). Before, the
replay made only the saved tensors there (8 MiB, 8 KiB, 4 MiB x2 before the cuBLAS workspace where trace
makes 8, 8 MiB, 8 KiB x3, 8, 4, 4, 4 MiB) and the norm's fp32 ``pow`` and product after the layer: a wide
2-layer Llama b4 s512 pure bf16 was -8.6 % under trace's peak reserved memory, now -1.6 %
(docs/agreement.md, reserved section, 2026-11-26 llamafwd). Under autocast the norm alone (its output the
linears' held input)."""
from __future__ import annotations

import pytest

from test_fsdp_grad_op_replay import WIDE

KW = dict(batch_size=4, seq_len=512, use_cache=False)
WS = 8 * 2**20 + 128 * 2**10                                    # the cuBLAS workspace (8.125 MiB)


def _layer_requests(monkeypatch, run) -> list[int]:
    """The first layer's requests from its first norm's ``pow(2)`` (fp32 (b, s, h), the request before the
    first of the fp32 ``variance``'s (b, s, 1): the fp32 cast before it is the input itself in fp32,
    which the replay makes as the tensor the norm saves) to the attention's fp32 logsumexp (b, heads, s),
    the cuBLAS workspace left out (made before or after ``q_proj``'s output)."""
    from alloc_spy import requests
    log: list[int] = []
    requests(monkeypatch, run, lambda n, _s: log.append(n))
    row = 4 * 512 * 4
    lse = 4 * WIDE["num_attention_heads"] * 512 * 4
    first = log.index(row) - 1
    return [n for n in log[first:log.index(lse, first)] if n != WS]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_replay_asks_what_the_llama_layer_makes(monkeypatch, precision):
    """Without trace: the requests follow the layer's code, tensor by tensor (shapes from the config)."""
    import trainmem
    e = 2 if precision == "bf16" else 4                          # the compute dtype's bytes
    tok, h = 4 * 512, WIDE["hidden_size"]
    f32, row, act = tok * h * 4, tok * 4, tok * h * e            # (b, s, h) fp32, (b, s, 1) fp32, (b, s, h)
    norm = [f32, row, row, row] + ([f32, act] if e == 2 else [f32]) + [act]
    rotary = [act, act // 2, act, act, act]                      # q * cos, -x2, cat, * sin, the sum
    want = norm + [act, act, act] + rotary + rotary + [act]      # q/k/v_proj, q and k rotated, SDPA's output
    got = _layer_requests(monkeypatch, lambda: trainmem.estimate(WIDE, precision=precision, **KW))
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_replay_asks_what_trace_asks(monkeypatch, precision):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import trainmem
    from trainmem.trace.api import trace
    tr = _layer_requests(monkeypatch, lambda: trace(WIDE, precision=precision, **KW))
    est = _layer_requests(monkeypatch, lambda: trainmem.estimate(WIDE, precision=precision, **KW))
    assert est == tr


def _norm_requests(monkeypatch, run) -> list[int]:
    """Under autocast: the first layer's requests from its first norm's ``pow(2)`` to ``q_proj``'s half weight
    copy (``h x h`` in bf16), inclusive."""
    from alloc_spy import requests
    log: list[int] = []
    requests(monkeypatch, run, lambda n, _s: log.append(n))
    first = log.index(4 * 512 * 4) - 1
    return log[first:log.index(WIDE["hidden_size"] ** 2 * 2, first) + 1]


def test_the_norm_under_autocast_in_op_order(monkeypatch):
    """bf16-amp (an fp32 residual stream): the norm's ops in fp32, its fp32 output made as the linears'
    held input before ``q_proj``'s half cast of it and the weight's copy (``layers._llama_norm_group``)."""
    import trainmem
    tok, h = 4 * 512, WIDE["hidden_size"]
    f32, row = tok * h * 4, tok * 4
    want = [f32, row, row, row, f32, f32, tok * h * 2, h * h * 2]  # pow .. product, output, its cast, weight's
    assert _norm_requests(monkeypatch, lambda: trainmem.estimate(WIDE, precision="bf16-amp", **KW)) == want


@pytest.mark.slow
def test_the_norm_under_autocast_asks_what_trace_asks(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import trainmem
    from trainmem.trace.api import trace
    tr = _norm_requests(monkeypatch, lambda: trace(WIDE, precision="bf16-amp", **KW))
    est = _norm_requests(monkeypatch, lambda: trainmem.estimate(WIDE, precision="bf16-amp", **KW))
    assert est == tr
