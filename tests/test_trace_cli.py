"""`trainmem trace` on the command line, and the timeline plot."""
import json

from trainmem.cli import main

TINY = ["gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4", "--batch-size", "2",
        "--seq-len", "64"]


def test_trace_json_has_the_contract_and_source(capsys):
    assert main(["trace", *TINY, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["source"] == "trace"
    assert isinstance(d["peak_allocated"], int) and d["peak_reserved"] >= d["peak_allocated"]
    names = {(p["name"], p["step"]) for p in d["phases"]}
    assert {("forward", 1), ("backward", 2), ("optimizer_step", 2), ("zero_grad", 2)} <= names
    assert d["peak_allocated"] == max(p["peak"] for p in d["phases"])


def test_trace_table_lists_largest_tensors_and_writes_a_timeline(capsys, tmp_path):
    out = tmp_path / "timeline.png"
    assert main(["trace", *TINY, "--timeline", str(out)]) == 0
    text = capsys.readouterr().out
    assert "largest live tensors at the peak" in text and "timeline written" in text
    assert out.stat().st_size > 10_000
    from trainmem.render.plots import plot_timeline
    from trainmem.units import UNITS
    from trainmem.trace.api import trace
    r = trace("gpt2", overrides=["n_layer=2", "n_embd=64", "n_head=4"], batch_size=2, seq_len=64)
    data = plot_timeline(r, str(tmp_path / "t.svg"))
    # the stacked series add up to the allocated memory at every plotted event
    for i, (ev, alloc, _res, _cats) in enumerate(r.extra["timeline"]):
        total = sum(series[i] for series in data["series"].values()) * UNITS[data["units"]]  # the plot's unit
        assert abs(total - alloc) <= 1
    assert [p[0] for p in data["phases"]][:2] == ["model_loaded", "forward"]


def test_trace_bad_input_is_one_line(capsys, tmp_path):
    assert main(["trace", *TINY, "--steps", "0"]) == 2
    assert main(["trace", *TINY, "--timeline", str(tmp_path / "x.txt")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 2 and all(ln.startswith("trainmem: error:") for ln in err)


def test_trace_cpu_device(capsys):
    assert main(["trace", *TINY, "--device", "cpu", "--precision", "fp32", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["peak_reserved"] is None  # byte-exact host accounting has no allocator cache
