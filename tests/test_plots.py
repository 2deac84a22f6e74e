"""Plots render headlessly (Agg) to PNG and SVG; the data behind them is returned and checked."""
import pytest

from trainmem.errors import TrainmemError
from trainmem.plan import sweep
from trainmem.render.plots import plot_heatmap, plot_stacked, plot_sweep

GiB = 2**30


@pytest.fixture(scope="module")
def grid():
    # seed 003's heatmap: BERT-large fp32 on a 24 GiB card, batch x sequence, bert-notebook formulas
    return sweep("bert-large-uncased", "4,8,16", "128,256,384,512", method="bert-notebook", gpu_memory="24GiB",
                 context_memory="1195.04MiB", precision="fp32", attention="eager",
                 set=['architectures=["BertForSequenceClassification"]'])


def _png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_heatmap(grid, tmp_path):
    out = tmp_path / "heatmap.png"
    d = plot_heatmap(grid, str(out))
    assert _png(out) and d["kind"] == "heatmap" and d["units"] == "GiB"
    assert d["batch_sizes"] == [4, 8, 16] and d["seq_lens"] == [128, 256, 384, 512]
    assert d["limit"] == 24.0
    for i, row in enumerate(grid.grid()):
        assert d["values"][i] == [v / GiB for v in row]
    assert d["fits"] == [[v <= 24 for v in row] for row in d["values"]]
    # seed 003: batch 4 fits everywhere, batch 16 at 512 does not, batch 8 at 512 fits (< batch 11)
    assert all(d["fits"][0]) and d["fits"][1][3] and not d["fits"][2][3]


def test_stacked_over_sequence(grid, tmp_path):
    out = tmp_path / "bars.svg"
    d = plot_stacked(grid, str(out), over="seq")
    assert out.read_text().lstrip().startswith(("<?xml", "<svg"))
    assert d["over"] == "seq" and d["x"] == [128, 256, 384, 512] and len(d["panels"]) == 3
    assert d["limit"] == 24.0
    assert {"parameters", "optimizer_states", "activations", "cuda_context", "temporaries"} <= set(d["categories"])
    for panel, b in zip(d["panels"], [4, 8, 16]):
        assert panel["fixed"] == b
        for j, s in enumerate(d["x"]):
            stacked = sum(panel["values"][c][j] for c in d["categories"] if c in panel["values"])
            # the bars add up to the device memory the GPU sees (allocated at the peak + context)
            assert stacked == pytest.approx(grid.cell(b, s).device_used / GiB, rel=1e-12)
            assert panel["totals"][j] == grid.cell(b, s).device_used / GiB
    # batch 4 x 128 tokens: the optimizer step peaks, which bert-notebook's components do not itemise
    assert "other" in d["panels"][0]["values"] and "other" not in d["panels"][2]["values"]


def test_stacked_over_batch_and_kind_guess(tmp_path):
    r = sweep("gpt2", "1,2,4", "512", gpu="t4")
    d = plot_sweep(r, str(tmp_path / "x.png"))              # 1-D grid: bars
    assert d["kind"] == "stacked" and d["over"] == "batch" and d["x"] == [1, 2, 4]
    assert [p["fixed"] for p in d["panels"]] == [512]
    d = plot_sweep(r, str(tmp_path / "my_heatmap.png"))     # the name says heatmap
    assert d["kind"] == "heatmap" and len(d["values"]) == 3 and len(d["values"][0]) == 1


def test_bad_requests(grid, tmp_path):
    with pytest.raises(TrainmemError, match=".png or .svg"):
        plot_heatmap(grid, str(tmp_path / "x.jpg"))
    with pytest.raises(TrainmemError, match="heatmap, stacked"):
        plot_sweep(grid, str(tmp_path / "x.png"), kind="pie")
    wide = sweep("gpt2", "1:7", "128,256", gpu="t4")
    with pytest.raises(TrainmemError, match="at most 6"):
        plot_stacked(wide, str(tmp_path / "x.png"), over="seq")
