"""plan, suggestions, sweep and fit: verdicts a user can trust (issue 14).

An impossible cluster layout is bad input (exit 2, naming the rules), not "use larger GPUs";
suggestions list what makes the setup fit, each re-estimated, sorted by a documented cost, in
--json too; sweep honours --max-fraction, exits 1 when nothing fits and 2 when no cell is valid.
"""
import json

import pytest

import trainmem
from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.plan import plan, suggest
from trainmem.plan.infeasible import has_valid_layout
from trainmem.plan.planner import enumerate_layouts


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --- 1. plan: no valid layout is an error naming the rules; valid but too big keeps the advice ----------------
def test_plan_with_no_valid_layout_names_the_rules(capsys):
    rc, out, err = run(capsys, "plan", "llama-3.1-8b", "--gpus", "7", "--gpu", "h100", "--global-batch", "8")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    # 7 GPUs: the only shapes are tp=7, pp=7, cp=7 or dp=7, each broken by its own rule
    assert "no valid layout of llama-3.1-8b on 7 GPUs" in err
    assert "tp=7 does not divide the 32 attention heads" in err and "8 key/value heads" in err
    assert "pp=7 does not divide the 32 layers" in err and "dp=7 does not divide the global batch of 8" in err
    assert err.count("(1 shape rejected)") == 4
    assert "nearby: 4, 8" in err            # 5 and 6 have a factor no rule allows either
    assert "larger GPUs" not in err and "NOTHING FITS" not in err


def test_plan_with_an_impossible_tp_list(capsys):
    rc, out, err = run(capsys, "plan", "llama-3.1-8b", "--gpus", "8", "--tp", "3", "--gpu", "h100",
                       "--global-batch", "8")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "--tp 3 does not divide the 8 GPUs" in err and "does not divide the 32 attention heads" in err
    assert "larger GPUs" not in err
    with pytest.raises(TrainmemError, match="needs dp > 1"):   # ZeRO over one rank: nothing valid left
        plan("llama-3.1-8b", 1, global_batch=8, gpu="h100", zero="1,2")


def test_plan_valid_but_too_big_keeps_the_advice_and_exits_1(capsys):
    rc, out, err = run(capsys, "plan", "llama-3.2-1b", "--gpus", "1", "--gpu", "t4", "--global-batch", "8",
                       "--seq-len", "4096")
    assert rc == 1 and err == ""
    assert "NOTHING FITS: none of the 12 valid layouts" in out and "smallest cluster that fits: 2 x t4" in out


@pytest.mark.parametrize("filters", [{}, {"tp": [2]}, {"pp": [2, 4], "zero": [2, 3]}, {"b": [3]},
                                     {"zero": [1]}, {"cp": [3]}])
def test_the_diagnosis_agrees_with_the_enumeration(filters):
    # has_valid_layout walks the shapes with the rules in its own code: it must say "valid" exactly
    # when the planner's enumeration keeps a layout
    m = trainmem.resolve_model("llama-3.1-8b")
    f = {"zero": [0, 1, 2, 3], "rec": [0, 1, 2], **filters}
    for n in range(1, 41):
        for gb, seq in ((8, 2048), (12, 1536)):
            kept = len(enumerate_layouts(m, n, seq, gb, f)[0]["tp"]) > 0
            assert has_valid_layout(m, n, seq, gb, f) == kept, (n, gb, seq, filters)


# --- 2. suggestions --------------------------------------------------------------------------------------------
EXAMPLE = dict(gpu="h100", batch_size=16, seq_len=4096)


def _re_estimated(s, **base):
    return trainmem.estimate("llama-3.1-8b", **{**base, **s.change})


def test_every_suggestion_is_the_engine_estimate_of_its_change():
    sugg = suggest("llama-3.1-8b", **EXAMPLE)
    assert sugg and sugg[-1].name == "combined"     # nothing fits alone: a stack of changes does
    for s in sugg:
        r = _re_estimated(s, **EXAMPLE)
        assert (s.peak_allocated, s.device_used, s.margin, s.fits) == (r.peak_allocated, r.device_peak, r.margin,
                                                                       r.fits), s.name
    both = sugg[-1]
    assert both.fits and len(both.parts) >= 2 and not any(s.fits for s in sugg[:-1])


def test_the_text_lists_only_changes_that_fit(capsys):
    rc, out, _ = run(capsys, "estimate", "llama-3.1-8b", "--gpu", "h100", "--batch-size", "16", "--seq-len", "4096")
    tail = out[out.index("no single change makes it fit"):]
    assert "these together do" in tail and "=> peak allocated" in tail and "--detail lists them" in tail
    assert " no\n" not in tail and "  no" not in tail          # no row says "fits: no"
    rc, out, _ = run(capsys, "estimate", "llama-3.1-8b", "--gpu", "h100", "--batch-size", "16", "--seq-len", "4096",
                     "--detail")
    assert "every change that lowers the memory" in out and "   no\n" in out


def test_fitting_view_keeps_the_cheapest_fitting_change_of_each_family():
    base = dict(gpu="a100-40gb", batch_size=4, seq_len=2048, dp=8, attention="eager")
    sugg = suggest("llama-3.2-1b", **base)
    from trainmem.render.suggestions import format_suggestions
    text = format_suggestions(sugg)
    fitting = [s for s in sugg if s.fits and s.name != "combined"]
    assert fitting
    shown = [s for s in fitting if s.title[:40] in text]
    assert len({s.family for s in shown}) == len(shown)     # one per family
    for s in shown:  # ... the cheapest of its family that fits
        assert s.order == min(x.order for x in fitting if x.family == s.family)
    for s in sugg:
        if s.fits is False and s.name != "combined":
            assert f"{s.title[:40]}" not in text.split("single changes")[-1]


def test_order_is_the_documented_cost():
    # eager attention (so that selective recompute saves something): every kind of change appears
    sugg = [s for s in suggest("llama-3.2-1b", gpu="a100-40gb", batch_size=8, seq_len=2048, attention="eager")
            if s.name != "combined"]
    names = [s.name for s in sugg]
    assert [s.order for s in sugg] == sorted(s.order for s in sugg)
    # (ZeRO-3 over 2 GPUs is not among them: DeepSpeed's prefetcher keeps up to stage3_max_live_parameters
    # (1e9) elements gathered through backward, most of this 1.24B-parameter model in fp32, which outweighs
    # the halved states: estimate.zero3_replay; over 4 GPUs it saves memory)
    want = ["recompute-selective", "adamw-8bit", "recompute-full", "pure-bf16", "offload-optimizer", "more-gpus-4",
            "lora"]
    assert [n for n in names if n in want] == want
    assert names.index("micro-batch-4") < names.index("recompute-full")   # same training, ≈2% per halving


def test_pure_bf16_8bit_states_and_offload_are_offered_where_they_fit():
    base = dict(batch_size=1, seq_len=512, recompute="full")
    big = dict(gpu_memory="1000GiB", context_memory="0B")
    dev = {k: trainmem.estimate("llama-3.2-3b", **base, **big, **ch).device_peak
           for k, ch in (("adamw-8bit", {"optimizer": "adamw-8bit"}), ("pure-bf16", {"precision": "bf16"}),
                         ("offload-optimizer", {"offload_optimizer": True}))}
    cap = max(dev.values())
    assert trainmem.estimate("llama-3.2-3b", **base, **big).device_peak > cap   # the base does not fit
    sugg = suggest("llama-3.2-3b", **base, gpu_memory=f"{cap}B", context_memory="0B")
    fit = {s.name for s in sugg if s.fits}
    assert set(dev) <= fit
    assert next(s for s in sugg if s.name == "pure-bf16").changes_semantics


def test_no_bf16_suggestion_on_a_gpu_without_bf16():
    assert "pure-bf16" not in {s.name for s in suggest("llama-3.2-1b", gpu="t4", batch_size=4, seq_len=2048)}


def test_data_parallelism_is_never_reduced_when_dp_is_1():
    for opts in (dict(batch_size=16, seq_len=4096), dict(batch_size=2, seq_len=2048, tp=2)):
        sugg = suggest("llama-3.1-8b", gpu="h100", **opts)
        assert sugg
        for s in sugg:
            assert s.change.get("dp", 1) >= 1
            assert "halving the data-parallel" not in s.note and "data parallel 1 ->" not in s.title
    # dp even: TP x 2 may keep the GPU count by halving dp, and says so
    tp2 = next(s for s in suggest("llama-3.2-1b", gpu="a100-40gb", batch_size=4, dp=8) if s.name == "tp-x2")
    assert tp2.change == {"tp": 2, "dp": 4}


def test_suggestions_are_in_the_json(capsys):
    rc, out, _ = run(capsys, "estimate", "llama-3.1-8b", "--gpu", "h100", "--batch-size", "16", "--seq-len", "4096",
                     "--json")
    d = json.loads(out)
    sugg = d["suggestions"]
    assert sugg and all({"change", "peak_allocated", "device_used", "margin", "fits", "order"} <= set(s)
                        for s in sugg)
    last = sugg[-1]
    assert last["name"] == "combined" and last["fits"] and len(last["parts"]) >= 2
    r = trainmem.estimate("llama-3.1-8b", **{**EXAMPLE, **last["change"]})
    assert r.peak_allocated == last["peak_allocated"] and r.fits
    rc, out, _ = run(capsys, "estimate", "gpt2", "--gpu", "h100", "--json")
    assert rc == 0 and json.loads(out)["suggestions"] == []


# --- 3. sweep and fit exit codes; --max-fraction ---------------------------------------------------------------
def test_sweep_honours_max_fraction_and_exits_1_when_nothing_fits(capsys):
    rc, out, _ = run(capsys, "sweep", "gpt2", "--gpu", "t4", "--batch-size", "1,4", "--seq-len", "512")
    assert rc == 0 and "*" not in out.splitlines()[-1]
    rc, out, _ = run(capsys, "sweep", "gpt2", "--gpu", "t4", "--max-fraction", "0.1", "--batch-size", "1,4",
                     "--seq-len", "512")
    assert rc == 1 and "limit 1.50 GiB" in out and out.splitlines()[-1].count("*") == 2
    rc, out, _ = run(capsys, "sweep", "gpt2", "--gpu", "t4", "--max-fraction", "0.1", "--json", "--batch-size", "1",
                     "--seq-len", "512")
    assert rc == 1 and [c["fits"] for c in json.loads(out)["cells"]] == [False]


def test_sweep_without_a_gpu_answers(capsys):
    rc, out, _ = run(capsys, "sweep", "gpt2", "--batch-size", "1,2", "--seq-len", "256")
    assert rc == 0 and "gpt2" in out


def test_sweep_with_every_cell_invalid_is_an_error(capsys):
    rc, out, err = run(capsys, "sweep", "gpt2", "--gpu", "t4", "--batch-size", "1,4", "--seq-len", "2048,4096")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "every cell is invalid" in err and "1024 learned positions" in err
    rc, out, _ = run(capsys, "sweep", "gpt2", "--gpu", "t4", "--batch-size", "1", "--seq-len", "512,4096")
    assert rc == 0 and "n/a" in out                     # some valid cells: the sweep answers


def test_fit_exits_1_when_nothing_fits(capsys):
    rc, out, _ = run(capsys, "fit", "llama-3.1-8b", "--gpu", "t4", "--seq-len", "2048")
    assert rc == 1 and "NOTHING FITS" in out
    rc, out, _ = run(capsys, "fit", "gpt2", "--gpu", "t4", "--seq-len", "512")
    assert rc == 0


def test_sweep_without_seq_len_uses_the_models_default_sequence(capsys):
    """One sequence default for every command: GPT-2's 1024 learned positions, not 2048 (which made
    every cell invalid)."""
    from trainmem.cli import main
    assert main(["sweep", "gpt2", "--batch-size", "1,2", "--json"]) == 0
    import json
    d = json.loads(capsys.readouterr().out)
    assert d["seq_lens"] == [1024]
    assert main(["sweep", "llama-3.2-1b", "--batch-size", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_lens"] == [2048]


@pytest.mark.parametrize("width, blocks", [(None, 3), (72, 4), (80, 4), (100, 3), (132, 2)])
def test_a_wide_sweep_grid_fits_the_terminal(capsys, monkeypatch, width, blocks):
    from trainmem.cli import main
    if width is not None:  # None: piped, 100 columns
        monkeypatch.setenv("COLUMNS", str(width))
    assert main(["sweep", "gpt2", "--batch-size", "1:20", "--seq-len", "128,256"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(len(x) for x in out) <= (width or 100)
    heads = [x for x in out if x.lstrip().startswith("seq \\ batch")]
    assert len(heads) == blocks  # 20 micro-batch sizes in blocks of 6 (72), 6 (80), 8 (100), 12 (132)
    cols = [int(v) for h in heads for v in h.split()[3:]]
    assert cols == list(range(1, 21))  # every size once, in order


@pytest.mark.parametrize("width", [None, 72, 80, 100, 132])
@pytest.mark.parametrize("argv", [["llama-3.1-8b", "--gpu", "h100"], ["llama-3.1-8b", "--gpu", "h100", "--detail"],
                                  ["llama-3.1-70b", "--gpu", "a100-80gb", "--detail"]])
def test_suggestion_costs_and_notes_wrap_to_the_terminal_width(capsys, monkeypatch, argv, width):
    """The costs, notes and a combination's parts are free text: they wrap to render.text.width() (a
    combination of per-op recompute and 8-bit Adam printed a 103-column line before); the change
    column is shortened to what the terminal leaves."""
    from trainmem.render.text import width as terminal_width
    if width is not None:  # None: piped, 100 columns
        monkeypatch.setenv("COLUMNS", str(width))
    assert terminal_width() == (width or 100)
    rc, out, _ = run(capsys, "estimate", *argv)
    assert rc == 1 and "cost:" in out
    assert max(len(ln) for ln in out.splitlines()) <= terminal_width(), out
    head = next(ln for ln in out.splitlines() if ln.startswith(" #  change"))
    assert head.endswith("fits") and len(head) == min(terminal_width(), 93)  # 48-wide changes fit from 93 on
