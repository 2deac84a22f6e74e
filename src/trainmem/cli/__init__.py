"""Command line: parse -> specs -> API call -> render. Bad input: one line on stderr, exit 2.

The top of the house: commands import the library and ``trainmem.render``; nothing below imports
this package. ``options``: the shared flags; ``output``: printing a report; one module per
command group, each with a ``register(subparsers)`` listed in ``COMMANDS``. Importing it does not
import torch (trace and measure import it inside their commands).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import TrainmemError
from . import calibrate, estimate, measure, plan, trace, validate

COMMANDS = (estimate.register, trace.register, measure.register, plan.register, validate.register,
            calibrate.register)


class _Parser(argparse.ArgumentParser):
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
