"""Tables, units, plots and progress a user can trust (issue 14, "Messages and pictures"): units
that scale with the run and are always labelled, parameter counts that never read 0.00B, tables
that fit the terminal (100 columns when piped; 72, 80, 100 and 132 set by COLUMNS) with aligned
columns, plots whose titles are whole and whose labels do not collide, a one-line message without
matplotlib, and progress bars only where they belong."""
from __future__ import annotations

import io
import json
import re
import sys

import pytest

import trainmem
from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.render.table import render_report
from trainmem.units import GiB, MiB, TiB, fmt, fmt_count, pick_unit

TINY = ["--set", "n_layer=1", "--set", "n_embd=8", "--set", "n_head=2", "--set", "vocab_size=100",
        "--set", "n_positions=32"]
TINY_SET = [s for s in TINY if s != "--set"]


def _reports():
    """A small model, a huge one, mixed dtypes, many options set, a framework with a long warning."""
    return {
        "tiny": trainmem.estimate("gpt2", set=TINY_SET),
        "gpt2": trainmem.estimate("gpt2"),
        "huge": trainmem.estimate("llama-3.1-405b", gpu="h100"),
        "mixed": trainmem.estimate("llama-3.1-8b", gpu="h100", batch_size=16, seq_len=4096),
        "many": trainmem.estimate("llama-3.1-8b", gpu="h100", dp=8, tp=2, zero=1, recompute="selective",
                                  lora_rank=16, optimizer_impl="fused", loss="chunked", loss_chunks=8,
                                  distributed_optimizer=False, compile=True, dropout=False,
                                  hold_output="backward", zero_grad="zeros", sequence_parallel=True),
        "framework": trainmem.estimate("llama-3.2-1b", framework="hf-trainer", framework_version="4.45"),
    }


@pytest.fixture(scope="module")
def reports():
    return _reports()


# ----- 1. units scale with the run, one unit per table, always labelled ------------------------------
def test_auto_units_follow_the_peak(reports):
    def unit_of(text):
        return re.search(r"\(values in (\w+)\)", text).group(1)

    assert reports["tiny"].peak_allocated < GiB and unit_of(render_report(reports["tiny"])) == "MiB"
    assert GiB <= reports["mixed"].peak_allocated < TiB and unit_of(render_report(reports["mixed"])) == "GiB"
    assert reports["huge"].peak_allocated >= TiB and unit_of(render_report(reports["huge"])) == "TiB"
    # the peak line is the peak in that unit
    r = reports["tiny"]
    assert f"{r.peak_allocated / MiB:,.2f} MiB" in render_report(r)


def test_one_unit_per_table(reports):
    for name, r in reports.items():
        text = render_report(r)
        unit = re.search(r"\(values in (\w+)\)", text).group(1)
        header = next(ln for ln in text.splitlines() if ln.startswith("component at the peak"))
        assert header.split()[-2] == unit, name
        labels = set(re.findall(r"\d (KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b", text))
        assert labels == {unit}, (name, labels)


@pytest.mark.parametrize("units, div", [("MiB", MiB), ("GB", 10**9), ("TiB", TiB), ("gib", GiB)])
def test_fixed_units_win(capsys, units, div):
    assert main(["estimate", "gpt2", "--seq-len", "256", "--units", units]) == 0
    out = capsys.readouterr().out
    label = {"gib": "GiB"}.get(units, units)
    r = trainmem.estimate("gpt2", seq_len=256)
    assert f"(values in {label})" in out
    v = r.peak_allocated / div
    assert (f"{v:,.2f} {label}" if v >= 0.005 else f"<0.01 {label}") in out


def test_unknown_units_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's exit
        main(["estimate", "gpt2", "--units", "parsec"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--units" in err[0] and "GiB" in err[0]


def test_json_stays_in_bytes(capsys):
    outs = []
    for units in ("auto", "MiB", "TB"):
        assert main(["estimate", "gpt2", "--seq-len", "128", "--json", "--units", units]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] == outs[2] and isinstance(outs[0]["peak_allocated"], int)


def test_nonzero_never_prints_as_zero():
    assert fmt(1, "GiB") == "<0.01 GiB" and fmt(0, "GiB") == "0.00 GiB"
    assert fmt(3 * MiB, "auto") == "3.00 MiB" and fmt(5 * GiB, "auto") == "5.00 GiB"
    assert pick_unit("auto", 2 * TiB) == "TiB" and pick_unit("auto", 10 * 1024) == "KiB"
    assert pick_unit("MB", 2 * TiB) == "MB"


# ----- 2. parameter counts, widths, aligned columns ------------------------------------------------------
@pytest.mark.parametrize("n, text", [(124_439_808, "124.4M"), (8_030_261_248, "8.03B"), (1_234, "1.23K"),
                                     (999, "999"), (405_853_388_800, "405.9B"), (999_960, "1.00M")])
def test_parameter_counts_are_scaled(n, text):
    assert fmt_count(n) == text


def test_no_zero_billion_params(reports):
    for name, r in reports.items():
        text = render_report(r)
        assert "0.00B params" not in text, name
        assert re.search(r"\(\d+(\.\d+)?[KMBT]? params\)", text), name
    assert "(1.94K params)" in render_report(reports["tiny"])  # 1,944 parameters
    assert reports["tiny"].model.num_params == 1944


def _component_block(text):
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("component at the peak"))
    j = lines.index("", i)
    return lines[i], lines[i + 1:j]


WIDTHS = [None, 72, 80, 100, 132]  # None: piped, no COLUMNS (100)


def _columns(monkeypatch, width):
    """Set COLUMNS to ``width`` (None: leave it unset, as a pipe sees it); the width lines must fit."""
    if width is not None:
        monkeypatch.setenv("COLUMNS", str(width))
    return width or 100


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("detail", [False, True])
def test_tables_fit_the_terminal_and_columns_align(reports, detail, width, monkeypatch):
    limit = _columns(monkeypatch, width)
    mixed = []  # rows whose dtype cell names two dtypes (bf16/fp32), aligned like the others
    for name, r in reports.items():
        text = render_report(r, detail=detail)
        if not detail:
            assert max(len(ln) for ln in text.splitlines()) <= limit, (name, text)
        header, rows = _component_block(text)
        # the amount and the share end where their headings end, the dtype where "dtype" ends
        unit = header.split()[-2]
        unit_end = header.rindex(unit) + len(unit)
        dtype_end = header.index("dtype") + len("dtype")
        for row in rows:
            m = re.fullmatch(r"(\S+)\s+(\S*)\s+(<?[\d,.]+)\s+([\d.]+%)", row)
            assert m, (name, row)
            assert m.end(3) == unit_end, (name, row)
            assert m.end(4) == len(header), (name, row)
            if m.group(2):
                assert m.end(2) == dtype_end, (name, row)
        mixed += [row for row in rows if re.fullmatch(r"\S+\s+\S+/\S+\s+.*", row)]
    assert detail or mixed  # a mixed-dtype cell is among these reports' rows (the set is chosen so)


def test_setup_line_wraps_with_indented_continuation(reports):
    text = render_report(reports["many"])
    lines = text.splitlines()
    blank = lines.index("")
    setup = lines[1:blank]
    assert len(setup) >= 2 and all(ln.startswith("  ") for ln in setup[1:])
    joined = " ".join(ln.strip() for ln in setup)
    for word in ("tp=2", "recompute=selective", "lora r=16", "loss-chunks=8", "sequence-parallel", "compile"):
        assert word in joined, word


@pytest.mark.parametrize("width", WIDTHS)
def test_trace_tensor_table_fits(width, monkeypatch):
    limit = _columns(monkeypatch, width)
    from trainmem.render.trace import largest_tensors
    rows = [{"block": (3 - i) * 300 * MiB, "category": "optimizer_states", "dtype": "bfloat16",
             "shape": [128256, 4096], "module": "model.layers.31.self_attn.q_proj.base_layer.lora_A.default" * (i + 1),
             "op": "_log_softmax_backward_data" * (i + 1)} for i in range(3)]
    text = largest_tensors(rows)
    lines = text.splitlines()
    assert "(MiB)" in lines[0] and all(len(ln) <= limit for ln in lines), text
    ends = {ln.index(" optimizer_states") for ln in lines[2:]}
    assert len(ends) == 1  # the size column ends at the same place on every row
    assert max(len(ln) for ln in largest_tensors(rows, detail=True).splitlines()) > limit  # --detail: everything


@pytest.mark.parametrize("width", WIDTHS)
def test_comparison_and_catalogues_fit(width, monkeypatch):
    limit = _columns(monkeypatch, width)
    from trainmem.measure.compare import compare_reports
    from trainmem.render.catalogue import render_gpus, render_models
    from trainmem.render.measure import render_comparison
    from trainmem.spec.hardware import catalogue_table
    from trainmem.spec.config import catalogue_names, resolve_model
    kw = dict(batch_size=2, seq_len=128, precision="fp32")
    c = compare_reports([("estimate", trainmem.estimate("gpt2", **kw)),
                         ("nemo", trainmem.estimate("gpt2", method="nemo", **kw)),
                         ("eleuther", trainmem.estimate("gpt2", method="eleuther", **kw))])
    text = render_comparison(c)
    assert max(len(ln) for ln in text.splitlines()) <= limit, text
    assert "values in MiB" in text or "values in GiB" in text
    exact = render_comparison(c, exact=True)  # byte counts: the difference columns give way, named
    assert max(len(ln) for ln in exact.splitlines()) <= limit, exact
    assert all(f"{rep.peak_allocated:,d}" in exact for rep in c.reports)  # every source's peak whole
    monkeypatch.setenv("COLUMNS", "160")  # the widest terminal: every column (117 wide here)
    full = max(len(ln) for ln in render_comparison(c, exact=True).splitlines())
    monkeypatch.delenv("COLUMNS")
    _columns(monkeypatch, width)
    assert ("left out on this narrow terminal" in exact) == (limit < full), exact
    rows = []
    for n in catalogue_names():
        m = resolve_model(n)
        rows.append({"name": n, "family": m.family, "head": m.head, "params": m.num_params, "layers": m.num_layers,
                     "hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "vocab": m.vocab_size})
    for t in (render_models(rows), render_gpus(catalogue_table())):
        assert max(len(ln) for ln in t.splitlines()) <= limit, t
    # the names --model and --gpu take are whole at every width (other columns give way first)
    models, gpus = render_models(rows).splitlines(), render_gpus(catalogue_table())
    assert [ln.split()[0] for ln in models[1:len(rows) + 1]] == catalogue_names()
    assert all(f"\n{g['name']} " in "\n" + gpus for g in catalogue_table())


@pytest.mark.parametrize("width", WIDTHS)
def test_measure_details_fit(width, monkeypatch):
    limit = _columns(monkeypatch, width)
    from trainmem.render.measure import measure_details
    r = trainmem.estimate("gpt2", set=TINY_SET)
    r.extra = {"phases": [{"step": 1, "name": "backward", "allocated": 10**6, "peak": 2 * 10**6, "reserved": None,
                           "where": "aten._scaled_dot_product_efficient_attention_backward.default" * 2}],
               "oom": {"phase": "forward@1", "message": "CUDA out of memory. " * 8, "allocated": 5 * 10**6,
                       "largest": [{"bytes": 10**6, "category": "activations/temporaries", "dtype": "float32",
                                    "shape": [8, 4, 64, 64], "name": "mul.Tensor output" * 5,
                                    "allocated_in": "forward@1"}]},
               "notes": ["a note " * 30], "environment": {"cpu": "x86_64", "threads": 2, "torch": "2", "transformers": "5"},
               "steps": 2, "runtime_s": 1.0}
    text = measure_details(r)
    assert max(len(ln) for ln in text.splitlines()) <= limit, text
    assert "phases in bytes" in text and "OUT OF MEMORY in forward@1" in text


# ----- 3. plots --------------------------------------------------------------------------------------------
plt = pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def grid():
    from trainmem.plan import sweep
    return sweep("llama-3.1-8b", "1,2,4", "1024,2048,4096,8192", gpu="h100", fsdp="full", dp=8,
                 recompute="full", attention="flash")


def _inside(fig, artist):
    renderer = fig.canvas.get_renderer()
    bb = artist.get_window_extent(renderer)
    w, h = fig.bbox.width, fig.bbox.height
    return bb.x0 >= -0.5 and bb.y0 >= -0.5 and bb.x1 <= w + 0.5 and bb.y1 <= h + 0.5


def test_sweep_plots_state_model_setup_units_and_keep_titles_whole(grid, tmp_path):
    from trainmem.render.plots import plot_heatmap, plot_stacked
    for d in (plot_heatmap(grid, str(tmp_path / "h.png")), plot_stacked(grid, str(tmp_path / "s.png"), over="seq")):
        fig = d["figure"]
        title = fig._suptitle
        assert title is not None and _inside(fig, title), d["kind"]
        text = title.get_text()
        assert "llama-3.1-8b" in text and "bf16-amp" in text and "fsdp=full" in text and "GiB" in text
        if d["kind"] == "stacked":
            axes = [ax for ax in fig.axes if ax.get_visible()]
            assert len(axes) == 3 and all(ax.get_ylim() == axes[0].get_ylim() for ax in axes)
            assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes)
            assert "(GiB)" in axes[0].get_ylabel()
        for ax in fig.axes:  # every tick label and axis label on the canvas
            for t in ax.get_xticklabels() + ax.get_yticklabels() + [ax.xaxis.label, ax.yaxis.label]:
                if t.get_text():
                    assert _inside(fig, t), t.get_text()


def test_a_long_title_wraps_inside_the_figure(grid, tmp_path):
    from trainmem.render.plots import plot_heatmap
    d = plot_heatmap(grid, str(tmp_path / "h.png"), title="a very long title " * 12)
    fig = d["figure"]
    assert "\n" in fig._suptitle.get_text() and _inside(fig, fig._suptitle)


def _crowded_report():
    """A hand-built trace report whose phases start a few events apart: their labels must stack."""
    r = trainmem.estimate("gpt2", set=TINY_SET)
    n = 200
    r.extra = {"timeline": [[i, (i + 1) * MiB, (i + 2) * MiB, {"parameters": MiB, "activations": i * MiB}]
                            for i in range(n)],
               "phase_events": [[name, step, start, start + 2] for step, base in ((1, 0), (2, 100))
                                for name, start in (("forward", base + 2), ("backward", base + 5),
                                                    ("optimizer_step", base + 8), ("zero_grad", base + 11))]}
    r.extra["phase_events"].insert(0, ["model_loaded", 0, 0, 1])
    return r


def test_timeline_labels_never_overlap(tmp_path):
    from trainmem.render.plots import plot_timeline
    d = plot_timeline(_crowded_report(), str(tmp_path / "t.png"))
    fig = d["figure"]
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in d["labels"]]
    assert len(boxes) == 9
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            a, b = boxes[i], boxes[j]
            assert not (a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1), (d["labels"][i].get_text(),
                                                                                      d["labels"][j].get_text())
    assert all(_inside(fig, t) for t in d["labels"]) and _inside(fig, fig._suptitle)
    assert d["units"] == "MiB" and "(MiB)" in fig.axes[0].get_ylabel()
    assert "gpt2" in fig._suptitle.get_text() and "bf16-amp" in fig._suptitle.get_text()


def test_without_matplotlib_one_line(monkeypatch, capsys, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib... raises ImportError
    from trainmem.render.plots import plot_timeline
    with pytest.raises(TrainmemError) as e:
        plot_timeline(_crowded_report(), str(tmp_path / "t.png"))
    assert str(e.value) == "plotting needs matplotlib: pip install 'trainmem[plot]'"
    assert main(["sweep", "gpt2", "--batch-size", "1,2", "--seq-len", "128", "--plot", str(tmp_path / "h.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["trainmem: error: plotting needs matplotlib: pip install 'trainmem[plot]'"]


# ----- 4. progress bars ------------------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_api(monkeypatch):
    pytest.importorskip("tqdm")
    from trainmem.progress import enabled_by_default, progress
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress(3, "work", enabled=True) as bar:
        bar.update(1)
    assert "work" in tty.getvalue()
    for stream, kw in ((_Tty(), {}), (io.StringIO(), {"enabled": True}), (_Tty(), {"enabled": False})):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress(3, "work", **kw) as bar:  # library default off; not a terminal; asked off
            bar.update(3)
        assert stream.getvalue() == "", kw
    with enabled_by_default(True):
        monkeypatch.setattr(sys, "stderr", tty := _Tty())
        with progress(2, "outer") as outer, progress(2, "inner") as inner:
            outer.update(1)
            inner.update(1)
        assert "outer" in tty.getvalue() and "inner" not in tty.getvalue()  # one bar at a time


def test_progress_missing_tqdm_draws_nothing(monkeypatch):
    from trainmem.progress import progress
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys, "stderr", tty := _Tty())
    with progress(2, "work", enabled=True) as bar:
        bar.update(2)
    assert tty.getvalue() == ""


TRACE_TINY = ["trace", "gpt2", *TINY, "--seq-len", "16", "--steps", "1", "--device", "cpu", "--precision", "fp32"]


def test_trace_cli_bar_on_a_terminal_only(monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", tty := _Tty())
    assert main(TRACE_TINY) == 0
    assert "trace" in tty.getvalue() and "\r" in tty.getvalue()
    for args, stream in ((TRACE_TINY + ["--json"], _Tty()), (TRACE_TINY, io.StringIO())):
        monkeypatch.setattr(sys, "stderr", stream)
        assert main(args) == 0
        assert stream.getvalue() == "", args
    monkeypatch.setattr(sys, "stderr", tty := _Tty())
    trainmem.trace("gpt2", set=TINY_SET, seq_len=16, steps=1, device="cpu", precision="fp32")
    assert tty.getvalue() == ""  # the library stays quiet unless asked


def test_fit_by_trace_counts_its_traces(monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", tty := _Tty())
    code = main(["fit", "gpt2", *TINY, "--seq-len", "16", "--by", "trace", "--gpu-memory", "40MiB",
                 "--context-memory", "0", "--precision", "fp32"])
    assert code in (0, 1)
    assert "fit --by trace" in tty.getvalue()
