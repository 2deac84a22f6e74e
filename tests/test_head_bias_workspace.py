"""Where the reserved replay makes autograd's cuBLAS workspace when the head's linear has a bias.

The first cuBLAS call of autograd's thread binds that thread's workspace (8.125 MiB on an A100). A
bias-free head (a causal LM's ``lm_head``) runs ``mm``, whose ``MmBackward0`` makes the weight's
gradient first; BERT's masked-LM decoder (transformers 5.24 ``models/bert/modeling_bert.py`` L494,
``nn.Linear(hidden_size, vocab_size, bias=True)``) runs ``addmm``, whose ``AddmmBackward0`` makes the
input's gradient first, so the workspace comes before the (vocab, hidden) weight gradient
(``quantities.head_moments.head_input_grad_first``, ``reserved.loss_backward._head_backward``). Before, the replay made it after
that gradient for every head but DeepSpeed ZeRO-3's wrapped linear: the agreement grid's BERT rows
placed it in the tail of a logits segment that trace leaves whole.
"""
from __future__ import annotations

import trainmem
from trainmem.trace.api import trace
import alloc_spy

# a narrow 2-layer BERT with a wide vocabulary: the (vocab, hidden) blocks are far from the workspace's size
BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 256, "intermediate_size": 1024,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 30522, "max_position_embeddings": 512,
        "type_vocab_size": 2}
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 256, "n_head": 4, "n_layer": 2,
        "vocab_size": 50257, "n_positions": 512}
WS = 8 * 2**20 + 2**17                      # one cuBLAS workspace on an A100 (8.125 MiB)


def _requests(monkeypatch, run, wgrad: int) -> list[str]:
    """The caching allocator's requests of a workspace's size ("ws") and of the head's weight's
    ("w": ``wgrad`` bytes, or up to the 2 MiB the replay rounds a gradient's block to) while ``run()``
    runs, in order (the replay's and trace's allocator being ``trainmem.allocator.CachingAllocator``)."""
    seen: list[str] = []

    def note(nbytes, stream):
        if nbytes == WS:
            seen.append("ws")
        elif wgrad <= nbytes < wgrad + 2 * 2**20:
            seen.append("w")
    alloc_spy.requests(monkeypatch, run, note)
    return seen


def _order(monkeypatch, cfg: dict, wgrad: int, **kw) -> tuple[list[str], list[str]]:
    ours = _requests(monkeypatch, lambda: trainmem.estimate(cfg, **kw), wgrad)
    theirs = _requests(monkeypatch, lambda: trace(cfg, **kw), wgrad)
    return ours, theirs


def test_masked_lm_workspace_before_the_weight_gradient(monkeypatch, one_torch_thread):
    """BERT MLM in fp32: the first step's requests of a workspace's size and of the head's (vocab,
    hidden) fp32 weight gradient come in trace's order: the load's weight, the forward's workspace,
    autograd's workspace, then the gradient (before: the gradient, then the workspace)."""
    wgrad = 30522 * 256 * 4
    ours, theirs = _order(monkeypatch, BERT, wgrad, batch_size=2, seq_len=256, precision="fp32")
    assert theirs[:4] == ["w", "ws", "ws", "w"]
    assert ours[:4] == theirs[:4]


def test_causal_lm_workspace_after_the_weight_gradient(monkeypatch, one_torch_thread):
    """GPT-2 (a bias-free tied head) in fp32: autograd's workspace still follows the weight's gradient,
    in the replay as in trace."""
    wgrad = 50257 * 256 * 4
    ours, theirs = _order(monkeypatch, GPT2, wgrad, batch_size=2, seq_len=256, precision="fp32")
    assert theirs[:4] == ["w", "ws", "w", "ws"]
    assert ours[:4] == theirs[:4]
