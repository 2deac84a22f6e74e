"""Progress bars on stderr for the slow commands (trace, measure, `fit --by trace`, sweeps over trace).

One small API: ``with progress(total, desc) as bar: ... bar.update(1)``. A bar is drawn only when
it is asked for (``enabled=True``, or the default the CLI switches on with :func:`enabled_by_default`
and off for ``--json``), stderr is a terminal (``sys.stderr.isatty()``) and tqdm is installed
(https://github.com/tqdm/tqdm; it comes with transformers and the ``trace`` extra). Otherwise the
object does nothing: library calls print nothing unless their caller asks. A bar inside another
(the traces of a ``fit --by trace``) is not drawn: the outer one counts. A bar is as wide as the
terminal, at most ``render.text.CAP`` columns (tqdm shortens its text to that width).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

_state = {"default": False, "depth": 0}


class _Silent:
    """The bar that draws nothing."""

    def update(self, n: int = 1) -> None:
        """Nothing to advance."""

    def describe(self, text: str) -> None:
        """Nothing to relabel."""


class _Bar(_Silent):
    """A tqdm bar on stderr."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int = 1) -> None:
        """Advance the bar by ``n`` units of work."""
        self._bar.update(n)

    def describe(self, text: str) -> None:
        """Relabel the bar (e.g. with the value being tried)."""
        self._bar.set_postfix_str(text, refresh=True)


@contextlib.contextmanager
def enabled_by_default(flag: bool) -> Iterator[None]:
    """Within the block, :func:`progress` draws a bar when its caller does not say (the CLI: on,
    off under ``--json``); the library default outside is off."""
    old = _state["default"]
    _state["default"] = bool(flag)
    try:
        yield
    finally:
        _state["default"] = old


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


@contextlib.contextmanager
def progress(total: int | None, desc: str, enabled: bool | None = None) -> Iterator[_Silent]:
    """A progress bar of ``total`` units (None: a counter) labelled ``desc`` on stderr; yields an
    object with ``update(n)`` and ``describe(text)``. Silent when not enabled (``enabled`` or,
    when None, the default of :func:`enabled_by_default`), when stderr is not a terminal, inside
    another bar, or without tqdm. The bar is removed when the block ends (``leave=False``)."""
    on = _state["default"] if enabled is None else enabled
    tqdm = _tqdm() if on and not _state["depth"] and _isatty() else None
    _state["depth"] += 1
    try:
        if tqdm is None:
            yield _Silent()
            return
        bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, mininterval=0.2,
                   unit="step" if total is not None else "it", **_bar_width())
        try:
            yield _Bar(bar)
        finally:
            bar.close()
    finally:
        _state["depth"] -= 1


def _bar_width() -> dict[str, Any]:
    """tqdm's width option: the terminal's own width, followed as it is resized (``dynamic_ncols``;
    a bar redrawn in place must never wrap, so no floor), except that a terminal wider than
    ``render.text.CAP`` (160) gets a bar of that width, as every table."""
    import os
    from .render.text import CAP
    try:
        cols = os.get_terminal_size(sys.stderr.fileno()).columns  # the bar's own terminal
    except (AttributeError, ValueError, OSError):  # replaced or closed stderr: tqdm finds out itself
        cols = 0
    return {"ncols": CAP} if cols > CAP else {"dynamic_ncols": True}


def _isatty() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
