"""GPT-2's forward in the allocator replay in trace's op order (transformers 5.24.0
``models/gpt2/modeling_gpt2.py``): the token and position embeddings' outputs held by
``GPT2Model.forward`` until it returns, their sum freed once the embeddings' dropout has made the first
layer's input, which exists before the layer is called (``quantities.head_moments.gpt2_embeddings``,
``reserved.layer_forward._input_first``); the cuBLAS workspace made at ``c_attn``'s matmul, after its
output (``layers.first_matmul_at``, ``reserved.layer_forward._saved_mm_workspace``); each residual
branch's ``c_proj`` output and dropout output (``layers._gpt2_branch_dropout``); ``ln_1``'s and ``ln_2``'s
outputs held until the residual adds rebind them (``layers.input_releases``). Before, the replay put
the workspace before the embeddings and made none of those tensors: the grid's GPT-2 b1 s2048 fp32
(loss upcast, two micro-batches) was +14.3 % over trace's peak reserved memory, now 0.00 %
(docs/agreement.md, reserved section, 2026-11-26 gpt2).
"""
from __future__ import annotations

import pytest

from trainmem.spec import TrainingSpec, resolve_model

GPT2 = ("gpt2", ["n_layer=2", "n_embd=256", "n_head=4", "n_positions=2048"])


def _setup(precision: str):
    m = resolve_model(GPT2[0], overrides=GPT2[1])
    return m, TrainingSpec(batch_size=1, seq_len=2048, precision=precision)


def test_the_embeddings_gpt2_holds():
    from trainmem.estimate.quantities.build import quantities
    m, t = _setup("fp32")
    q = quantities(m, t)
    h = 256 * 4                                                 # (b, s, h) fp32 per token
    assert (q.embeds_tok, q.embeds_pos, q.embeds_sum_tok) == (h, h, h)
    llama = resolve_model("llama-3.2-1b", overrides=["num_hidden_layers=2"])
    assert quantities(llama, t).embeds_pos == quantities(llama, t).embeds_sum_tok == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16-amp"])
def test_the_workspace_follows_c_attn_s_output(precision):
    from trainmem.estimate.quantities.build import quantities
    m, t = _setup(precision)
    lc = quantities(m, t).detail.layer
    pos = lc.linears[0][0]                                      # saved before c_attn's weight is cast
    assert lc.ws_at == pos + 1                                  # its output, which the SDPA kernel saves
    assert lc.tensors[pos] == (3 * 256 * (4 if precision == "fp32" else 2), 0)


def _placed(monkeypatch, fn) -> list:
    """(request MiB, segment by opening order, offset MiB) of every request of 1 MiB or more until the
    first one of a logits' size or more after the first layer's (the first forward's head)."""
    from trainmem import allocator
    orig = allocator.CachingAllocator.allocate
    out: list = []
    segs: dict = {}
    stop = [False]

    def spy(self, nbytes, tag=None, stream=None):
        h = orig(self, nbytes, tag, stream)
        stop[0] = stop[0] or (len(out) > 8 and nbytes >= 2048 * 50257 * 2)
        if h is not None and nbytes >= 1 << 20 and not stop[0]:
            b = head = self._live[h]
            while head.prev is not None:
                head = head.prev
            out.append((nbytes >> 10, segs.setdefault(head.addr, len(segs)), (b.addr - head.addr) >> 10))
        return h
    monkeypatch.setattr(allocator.CachingAllocator, "allocate", spy)
    try:
        fn()
    finally:
        monkeypatch.undo()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-amp"])
def test_the_first_forward_lands_where_trace_s_does(monkeypatch, precision):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from trainmem.estimate.engine import estimate, forget_replays
    from trainmem.trace.api import trace
    m, t = _setup(precision)
    forget_replays()                                            # (the replay runs under the spy)
    est = _placed(monkeypatch, lambda: estimate(m, t, reserved=True))
    tr = _placed(monkeypatch, lambda: trace(m, training=t))
    assert len(tr) > 20
    assert est == tr                                            # before: the workspace first, then apart
