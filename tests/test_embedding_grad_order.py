"""The gradients of the tables before the layers in autograd's order (``reserved.optimizer._embedding_grads_first``).

BERT's embeddings make the word lookup first and add the position table's last (transformers 5.24
``models/bert/modeling_bert.py`` L100-105), so autograd's engine, which runs the ready node of the highest
sequence number first, makes the position table's gradient before the word table's own
(``embedding_dense_backward``) and before the tied sum that becomes its ``.grad``. The replay made
the word table's two first.
"""
from __future__ import annotations

import trainmem
from alloc_spy import requests

KW = dict(set=["num_hidden_layers=2", "max_position_embeddings=4096"], batch_size=1, seq_len=96,
          precision="fp32", use_cache=False)
WORD = 30522 * 768 * 4          # bert-base-uncased's word table (and its gradient, states), fp32
POS = 4096 * 768 * 4            # its position table at 4096 positions


def _tables(monkeypatch, run) -> str:
    """The requests of a word-table size ("W", up to the replay's block rounding) or a position-table
    size ("p"), in order."""
    out: list[str] = []

    def note(nbytes, _stream):
        if WORD <= nbytes < WORD + (2 << 20):
            out.append("W")
        elif nbytes == POS:
            out.append("p")
    requests(monkeypatch, run, note)
    return "".join(out)


def test_position_table_gradient_before_the_word_tables(monkeypatch):
    """BERT-base cut to 2 layers, fp32, AdamW, b1 s96: the word- and position-table-sized requests of
    the whole run (loads, the head's gradient, the position table's, the word table's own and the
    tied sum, the optimizer's states and temporaries) come in trace's order."""
    est = _tables(monkeypatch, lambda: trainmem.estimate("bert-base-uncased", **KW))
    tr = _tables(monkeypatch, lambda: trainmem.trace("bert-base-uncased", **KW))
    assert "pWW" in tr                                            # position, then the word table's two
    assert est == tr
