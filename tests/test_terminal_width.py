"""Every table and message fits the user's terminal (``render.text.width``): the terminal's columns
read when rendering (COLUMNS first, as Python's ``shutil.get_terminal_size``), kept within 72 and
160; 100 when the output is piped and COLUMNS is unset. Each command's text output is checked at
72, 80, 100 and 132 columns."""
from __future__ import annotations

import io
import os
import shutil
import sys

import pytest

from trainmem.cli import main
from trainmem.render import text
from trainmem.render.text import fit_columns, width

WIDTHS = (72, 80, 100, 132)
TINY = ["--set", "n_layer=1", "--set", "n_embd=8", "--set", "n_head=2", "--set", "vocab_size=100",
        "--set", "n_positions=32"]


class _Tty(io.StringIO):
    def isatty(self):
        return True


# ----- 1. the width: read now, from the terminal, within the floor and the cap ----------------------------
def test_piped_without_columns_is_100():
    assert "COLUMNS" not in os.environ and not sys.stdout.isatty()  # conftest: as a pipe sees it
    assert width() == text.PIPED == 100


@pytest.mark.parametrize("columns, expected", [("72", 72), ("80", 80), ("132", 132), ("160", 160),
                                               ("40", 72), ("1000", 160)])
def test_columns_set_after_import_counts_within_floor_and_cap(monkeypatch, columns, expected):
    monkeypatch.setenv("COLUMNS", columns)  # trainmem was imported long before
    assert width() == expected
    assert text.FLOOR == 72 and text.CAP == 160


@pytest.mark.parametrize("cols, expected", [(120, 120), (50, 72), (300, 160)])
def test_a_terminal_without_columns_uses_its_size(monkeypatch, cols, expected):
    monkeypatch.setattr(sys, "stdout", _Tty())
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback: os.terminal_size((cols, 40)))
    assert width() == expected


def test_wrap_follows_the_width_of_the_moment(monkeypatch):
    line = "word " * 40
    monkeypatch.setenv("COLUMNS", "80")
    assert max(map(len, text.wrap(line))) <= 80 and max(map(len, text.wrap(line))) > 72
    monkeypatch.setenv("COLUMNS", "132")
    assert max(map(len, text.wrap(line))) > 100


# ----- 2. fit_columns: free text gives way, numbers keep their width ---------------------------------------
def test_fit_columns_shortens_the_name_then_leaves_out_optional_columns():
    heads = ("name", "n", "extra", "more")
    rows = [("a-rather-long-model-name-here", "123456789", "1", "2"), ("short", "1", "10", "20")]
    wide = fit_columns(heads, rows, width=60, shrink=0, shrink_min=8, optional=(3, 2))
    assert wide[1] == "a-rather-long-model-name-here 123456789     1    2"  # as wide as the widest cell
    narrow = fit_columns(heads, rows, width=30, shrink=0, shrink_min=8, optional=(3, 2))
    assert narrow[1] == "a-rather… 123456789     1    2" and len(narrow) == 3  # the name first, down to 8
    narrower = fit_columns(heads, rows, width=25, shrink=0, shrink_min=8, optional=(3, 2))
    assert narrower[1] == "a-rather… 123456789     1"  # then the optional columns, in the order given
    assert " ".join(ln.strip() for ln in narrower[3:]) == "(more left out on this narrow terminal: --json has them)"
    tight = fit_columns(heads, rows, width=18, shrink=0, shrink_min=8, optional=(3, 2))
    assert tight[1] == "a-rathe… 123456789" and tight[2] == "short    " + "1".rjust(9)
    assert " ".join(ln.strip() for ln in tight[3:]) == "(extra, more left out on this narrow terminal: --json has them)"
    assert all(len(ln) <= w for t, w in ((narrow, 30), (narrower, 25), (tight, 18)) for ln in t)  # the note wraps


# ----- 3. every command's text output at 72, 80, 100 and 132 columns ------------------------------------------
COMMANDS = {
    "estimate": ["estimate", "llama-3.1-8b", "--gpu", "h100", "--fsdp", "full", "--dp", "8", "--batch-size", "2",
                 "--seq-len", "4096", "--recompute", "full", "--attention", "flash"],
    "estimate-suggestions": ["estimate", "llama-3.1-70b", "--gpu", "a100-80gb", "--detail"],
    "trace": ["trace", "gpt2", "--seq-len", "16", "--batch-size", "1", *TINY],
    "compare": ["compare", "gpt2", "--batch-size", "2", "--seq-len", "128", "--gpu", "h100"],
    "fit": ["fit", "llama-3.1-8b", "--gpu", "h100", "--seq-len", "4096"],
    "sweep": ["sweep", "gpt2", "--batch-size", "1:20", "--seq-len", "128,256", "--gpu", "t4"],
    "plan": ["plan", "llama-3.1-8b", "--gpus", "8", "--global-batch", "64", "--seq-len", "4096", "--gpu", "h100"],
    "plan-explain": ["plan", "llama-3.1-8b", "--gpus", "2", "--global-batch", "8", "--seq-len", "2048",
                     "--gpu", "t4", "--explain"],  # nothing fits: the smallest cluster, the closest shape
    "validate": ["validate", "validation/published", "--cases", "nanogpt,lightning,colossal"],
    "models": ["models"],
    "gpus": ["gpus"],
    "calibrate": ["calibrate", "--plan"],
}


def _lines(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr().out
    assert rc in (0, 1), (argv, out)
    return out.splitlines()


@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_line_fits(capsys, monkeypatch, name, cols):
    if name == "trace":
        pytest.importorskip("transformers")
    if name == "validate":
        root = os.path.join(os.path.dirname(__file__), "..", "validation", "published")
        COMMANDS[name][1] = os.path.normpath(root)
    monkeypatch.setenv("COLUMNS", str(cols))
    lines = _lines(capsys, COMMANDS[name])
    assert lines and max(len(ln) for ln in lines) <= cols, "\n".join(ln for ln in lines if len(ln) > cols)


def test_plan_table_packs_on_a_narrow_terminal_and_says_what_it_left_out(capsys, monkeypatch):
    argv = COMMANDS["plan"]
    wide = _lines(capsys, argv)  # piped: 100 columns, the fixed table with every column
    assert any(ln.startswith("rank   dp  tp") and ln.endswith("MFU") for ln in wide)
    monkeypatch.setenv("COLUMNS", "72")
    narrow = _lines(capsys, argv)
    head = next(ln for ln in narrow if ln.startswith("rank dp tp"))
    assert "GiB/GPU" in head and "MFU" not in head
    assert "(tok/s/GPU, MFU left out on this narrow terminal: --json has them)" in narrow


@pytest.mark.slow
@pytest.mark.parametrize("cols", WIDTHS)
def test_the_whole_published_validation_fits(capsys, monkeypatch, cols):
    root = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "validation", "published"))
    monkeypatch.setenv("COLUMNS", str(cols))
    lines = _lines(capsys, ["validate", root])
    assert max(len(ln) for ln in lines) <= cols


# ----- 4. --help: argparse's layout at the same width; long choice lists move into the help text -------------
@pytest.mark.parametrize("cols", (72, 80, 100, 132))
@pytest.mark.parametrize("command", ["estimate", "trace", "measure", "compare", "fit", "sweep", "plan", "validate",
                                     "calibrate"])
def test_help_fits(capsys, monkeypatch, command, cols):
    """(At 72 one usage part is wider than what argparse leaves beside ``usage: trainmem estimate``:
    ``[--expandable-segments | --no-expandable-segments]``, which argparse never breaks: the usage is
    wrapped again under ``usage: ``.)"""
    monkeypatch.setenv("COLUMNS", str(cols))
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and max(len(ln) for ln in out.splitlines()) <= cols, out
    if command == "estimate":  # the optimizers listed in the help, not as a 300-column metavar
        assert "--optimizer OPTIMIZER" in out and "(one of: adamw, adam," in " ".join(out.split())
        assert "--batch-size, --per-device-train-batch-size" in out and "--micro-batch-size BATCH_SIZE" in out


def _usage(capsys, monkeypatch, cols: int) -> str:
    monkeypatch.setenv("COLUMNS", str(cols))
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    return capsys.readouterr().out.split("\n\n")[0]


def test_usage_wrapped_again_keeps_every_part_in_order(capsys, monkeypatch):
    """At 72 columns the usage's continuation lines start under ``usage: `` and hold argparse's
    parts in argparse's order (the same as at 160 columns, where argparse's own layout fits); the
    widest part stays whole on its line."""
    narrow, wide = _usage(capsys, monkeypatch, 72), _usage(capsys, monkeypatch, 160)
    assert " ".join(narrow.split()) == " ".join(wide.split())
    assert narrow.splitlines()[1].startswith(" " * 7 + "[") and not narrow.splitlines()[1].startswith(" " * 8)
    assert any(ln.strip() == "[--expandable-segments | --no-expandable-segments]" for ln in narrow.splitlines())
    assert wide.splitlines()[1].startswith(" " * len("usage: trainmem estimate "))

