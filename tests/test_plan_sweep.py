"""sweep: a grid of estimates; range syntax; invalid cells."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.plan import sweep
from trainmem.plan._common import divisors, parse_int_list


def test_parse_int_list():
    assert parse_int_list("1,2,4") == [1, 2, 4]
    assert parse_int_list("128:512:128") == [128, 256, 384, 512]
    assert parse_int_list("4,1:3,2") == [1, 2, 3, 4]
    assert parse_int_list("8:8") == [8]
    assert parse_int_list([3, 1]) == [1, 3]
    for bad in ("0", "a", "5:1", "1:9:0", ""):
        with pytest.raises(TrainmemError):
            parse_int_list(bad, "--seq-len")


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert divisors(49) == [1, 7, 49]


def test_grid_equals_estimates():
    r = sweep("gpt2", "1,2", "256:1024:256", gpu="t4", attention="eager")
    assert r.batch_sizes == [1, 2] and r.seq_lens == [256, 512, 768, 1024]
    for b in r.batch_sizes:
        for s in r.seq_lens:
            e = trainmem.estimate("gpt2", batch_size=b, seq_len=s, gpu="t4", attention="eager")
            c = r.cell(b, s)
            assert (c.device_used, c.fits) == (e.device_peak, e.fits)
            assert c.categories() == e.by_category()
    grid = r.grid()
    assert all(grid[0][j] < grid[1][j] for j in range(4))          # monotone in the micro-batch
    assert all(row[j] < row[j + 1] for row in grid for j in range(3))  # and in the sequence
    text = r.render()
    assert "seq \\ batch" in text and "GiB" in text
    d = r.to_dict()
    assert len(d["cells"]) == 8 and d["limit"] == r.capacity


def test_invalid_cells_are_na():
    r = sweep("gpt2", "1", "1024,2048", gpu="t4")   # GPT-2 has 1024 learned positions
    assert r.cell(1, 1024).report is not None
    c = r.cell(1, 2048)
    assert c.report is None and c.fits is None and "learned positions" in c.error
    assert "n/a" in r.render()


def test_too_many_cells():
    with pytest.raises(TrainmemError, match="cells"):
        sweep("gpt2", "1:200", "1:200", gpu="t4")
