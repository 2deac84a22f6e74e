"""The later micro-batches of lit-gpt's resource-table runs (``litgpt_rt_*``): their length read from
lit-gpt's own Alpaca length histogram (``tools/alpaca_lengths.py``; lit-gpt 2fc9bf16
``tutorials/alpaca_length_histogram.png``, whose statistics ``tutorials/oom.md`` states)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("alpaca_lengths", ROOT / "tools" / "alpaca_lengths.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


al = _tool()


def test_longest_of_is_the_order_statistic():
    """Uniform lengths 1..100: the longest of n draws stays below x with probability (x / 100) ** n."""
    tok = np.arange(1, 101, dtype=float)
    counts = np.ones(100)
    for draws, q in ((1, 0.5), (10, 0.5), (999, 0.5), (999, 0.1)):
        want = next(x for x in range(1, 101) if (x / 100) ** draws >= q)
        assert al.longest_of(tok, counts, draws, q) == want
    assert al.longest_of(tok, counts, 50) < al.longest_of(tok, counts, 500)


def test_reading_matches_what_the_page_states():
    """tutorials/oom.md at 2fc9bf16: min 35, max 1034, mean 110.52, median 96; the longest bar is one sample."""
    pytest.importorskip("PIL")
    tok, excess, _ = al.read()
    n = al.counts(tok, excess)
    s = al.stats(tok, n)
    assert s["mean"] == pytest.approx(110.52, rel=0.015)
    assert s["median"] == pytest.approx(96, abs=2)
    assert n.sum() == pytest.approx(al.TRAIN_SAMPLES)
    assert n[tok > 720].sum() == pytest.approx(1.0)  # the longest sample alone
    assert tok[np.nonzero(n > 0.3)[0][-1]] == pytest.approx(al.LONGEST, abs=3)  # a one-sample bar spans two columns
    assert n[tok < 30].sum() < 1  # nothing below the shortest (35)


def _rt_fixtures():
    from trainmem.validate import load_fixtures
    return [fx for fx in load_fixtures() if "litgpt_rt_" in fx["_path"]]


def test_resource_table_fixtures_take_the_later_length_from_the_histogram():
    """Each ``litgpt_rt_*`` row's ``later_seq_len`` is the median longest of its 999 x micro_batch_size
    later draws, scaled from StableLM tokens by the ratio of the row's longest sample to 1034: not a
    value chosen per row."""
    pytest.importorskip("PIL")
    rows = _rt_fixtures()
    assert len(rows) >= 27
    for fx in rows:
        s = fx["setup"]
        assert s["later_seq_len"] == al.later_seq_len(s["batch_size"], s["seq_len"]), fx["name"]


def test_qlora_rows_do_not_depend_on_the_later_length_below_the_histogram_tail():
    """The one-GPU QLoRA rows' peak is the first micro-batch's backward for every later length from
    128 tokens to the 90 % point of the longest later sample: the exact later length does not move them."""
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    from trainmem import estimate
    from trainmem.validate import _predict
    tok, excess, _ = al.read()
    n = al.counts(tok, excess)
    rows = [fx for fx in _rt_fixtures() if fx["setup"].get("quantize")]
    assert len(rows) == 8
    for fx in rows:
        s = fx["setup"]
        hi = round(al.longest_of(tok, n, 999 * s["batch_size"], 0.9) * s["seq_len"] / al.LONGEST)
        peaks = {_predict(estimate, dict(fx, setup=dict(s, later_seq_len=v))).peak_allocated
                 for v in (128, s["later_seq_len"], hi)}
        assert len(peaks) == 1, fx["name"]
        full = {k: v for k, v in s.items() if k != "later_seq_len"}
        assert _predict(estimate, dict(fx, setup=full)).peak_allocated > peaks.pop()  # the upper bound
