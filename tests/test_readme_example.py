"""The README's example is what `make run` prints today: its command (the Makefile's ``run`` target) run
through the CLI, compared line for line with the README's block. (The block went stale once: a later
change of the reserved replay moved the printed peak by 3.9 GiB while the README kept the old one.)"""
import re
from pathlib import Path

from trainmem.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run_command() -> list[str]:
    make = (ROOT / "Makefile").read_text()
    line = re.search(r"^run:.*\n\t\$\(BIN\)/trainmem (.+)$", make, re.M)
    assert line, "the Makefile's run target names no trainmem command"
    return line.group(1).split()


def _readme_block() -> tuple[list[str], list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```\n\$ trainmem (.+?)\n(.*?)```", text, re.S)
    assert block, "README has no example block"
    return block.group(1).split(), block.group(2).rstrip("\n").splitlines()


def test_readme_example_is_the_make_run_command():
    assert _readme_block()[0] == _run_command()


def test_readme_example_prints_what_the_estimate_prints_now(capsys):
    argv, expected = _readme_block()
    assert main(argv) == 0
    printed = capsys.readouterr().out.rstrip("\n").splitlines()
    assert printed == expected
