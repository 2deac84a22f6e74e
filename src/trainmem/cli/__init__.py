"""Command line: parse -> specs -> API call -> render. Bad input: one line on stderr, exit 2.

The top of the house: commands import the library and ``trainmem.render``; nothing below imports
this package. ``options``: the shared flags; ``output``: printing a report; one module per
command group, each with a ``register(subparsers)`` listed in ``COMMANDS``. Importing it does not
import torch (trace and measure import it inside their commands).
"""
from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from ..errors import TrainmemError
from . import calibrate, estimate, measure, plan, trace, validate

COMMANDS = (estimate.register, trace.register, measure.register, plan.register, validate.register,
            calibrate.register)


class _Formatter(argparse.HelpFormatter):
    """argparse's help layout at the width of every other output (``render.text.width``: the
    terminal's, within 72..160, 100 when piped), less argparse's own two-column margin. An option
    with a long list of choices (argparse writes ``{a,b,...}`` as one unbreakable word) shows its
    name in capitals instead, the choices then listed in its help, where they wrap."""

    LONG = 24  # a choice list longer than this is moved into the help text

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        from ..render.text import width as terminal_width
        super().__init__(prog, indent_increment, max_help_position, width or terminal_width() - 2)

    @classmethod
    def _long_choices(cls, action: argparse.Action) -> str:
        """The choices of an option that lists too many to show as its metavar, else ""."""
        if not action.option_strings or action.choices is None:
            return ""
        listed = (action.metavar[1:-1] if isinstance(action.metavar, str) and action.metavar.startswith("{")
                  else ",".join(map(str, action.choices)) if action.metavar is None else "")
        return listed.replace(",", ", ") if len(listed) > cls.LONG else ""

    def _metavar_formatter(self, action: argparse.Action, default_metavar: str):  # type: ignore[override]
        if self._long_choices(action):
            return super()._metavar_formatter(argparse.Action(action.option_strings, action.dest,
                                                              metavar=action.dest.upper()), default_metavar)
        return super()._metavar_formatter(action, default_metavar)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        listed = self._long_choices(action)
        return (text or "") + f" (one of: {listed})" if listed else text

    # argparse's own split of a usage line into parts it never breaks (Lib/argparse.py,
    # ``HelpFormatter._format_usage``'s ``part_regexp``, CPython 3.11-3.13)
    USAGE_PART = re.compile(r"\(.*?\)+(?=\s|$)|\[.*?\]+(?=\s|$)|\S+")

    def _format_usage(self, usage, actions, groups, prefix) -> str:  # type: ignore[override]
        """argparse's usage, unless one of its parts passes the width where argparse indents the
        continuation lines (under the command's name: ``[--expandable-segments |
        --no-expandable-segments]`` at 72 columns); then every continuation line starts under the
        first option instead, at ``usage: ``'s width, the parts wrapped again in their order."""
        text = super()._format_usage(usage, actions, groups, prefix)
        if max(map(len, text.splitlines())) <= self._width:
            return text
        head = prefix if prefix is not None else "usage: "
        words = self.USAGE_PART.findall(" ".join(text.strip()[len(head):].split()))
        lines, indent = [head + words[0]], " " * len(head)
        for w in words[1:]:
            if len(lines[-1]) + 1 + len(w) > self._width:
                lines.append(indent + w)
            else:
                lines[-1] += " " + w
        return "\n".join(lines) + "\n\n"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        """An option's names, its argument once after the last (``--batch-size, --micro-batch-size
        N``), broken after a comma where the names would pass the width."""
        if not action.option_strings:
            return super()._format_action_invocation(action)
        parts = list(action.option_strings)
        if action.nargs != 0:
            parts[-1] += " " + self._format_args(action, action.dest.upper())
        room = self._width - self._current_indent
        lines = [parts[0]]
        for p in parts[1:]:
            if len(lines[-1]) + 2 + len(p) + 1 > room:
                lines[-1] += ","
                lines.append(p)
            else:
                lines[-1] += ", " + p
        return ("\n" + " " * (self._current_indent + 2)).join(lines)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # one clear line, exit 2 (no usage dump)
        sys.stderr.write(f"trainmem: error: {message} (see `trainmem {self.prog.split()[-1]} --help`)\n"
                         if " " in self.prog else f"trainmem: error: {message} (see `trainmem --help`)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The ``trainmem`` parser with every command of ``COMMANDS``."""
    from .. import __version__
    p = _Parser(prog="trainmem", description="How much GPU memory will this training run take, where does it "
                                             "go, will it fit?")
    p.add_argument("--version", action="version", version=f"trainmem {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in COMMANDS:
        register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trainmem ARGV``; the exit status (0 ok, 1 does not fit, 2 bad input, 130 interrupted)."""
    p = build_parser()
    a = p.parse_args(argv)
    if not getattr(a, "func", None):
        p.print_help()
        return 2
    from ..progress import enabled_by_default
    try:
        with enabled_by_default(not getattr(a, "json", False)):  # bars on a terminal's stderr, none with --json
            return a.func(a)
    except TrainmemError as e:
        sys.stderr.write(f"trainmem: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
