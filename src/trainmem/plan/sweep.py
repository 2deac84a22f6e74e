"""``sweep``: the memory of every (micro-batch, sequence length) pair of a grid."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import TrainmemError
from ..report import CATEGORIES, MemoryReport
from ..progress import progress
from ..render.text import width, wrap
from ..units import scale
from ..spec.training import default_seq_len
from ._common import Evaluator, parse_int_list, refuse_varying_lengths

MAX_CELLS = 20_000


@dataclass
class SweepCell:
    """One grid point: its report, or why it has none (e.g. a sequence past learned positions)."""

    batch_size: int
    seq_len: int
    report: MemoryReport | None
    error: str = ""

    @property
    def device_used(self) -> int | None:
        """What counts against the GPU (device memory, else reserved, else allocated)."""
        return None if self.report is None else self.report.device_peak

    @property
    def fits(self) -> bool | None:
        """Whether the cell fits the GPU within ``max_fraction`` (None without a report or a GPU)."""
        return None if self.report is None else self.report.fits

    def categories(self) -> dict[str, int]:
        """Bytes per component category of the cell (empty without a report)."""
        return {} if self.report is None else self.report.by_category()


@dataclass
class SweepResult:
    """A grid of reports: rows are micro-batch sizes, columns sequence lengths."""

    model: str
    gpu: str | None
    capacity: int | None
    limit: int | None
    method: str
    batch_sizes: list[int]
    seq_lens: list[int]
    cells: list[list[SweepCell]] = field(repr=False)
    stage: str = ""   # "first"/"last": the one pipeline stage's rank every cell reports (--pp-stage)

    def cell(self, batch_size: int, seq_len: int) -> SweepCell:
        """The cell of one (micro-batch, sequence length) pair."""
        return self.cells[self.batch_sizes.index(batch_size)][self.seq_lens.index(seq_len)]

    def grid(self) -> list[list[int | None]]:
        """Device memory (bytes) per cell, rows by micro-batch, columns by sequence length."""
        return [[c.device_used for c in row] for row in self.cells]

    def fits_grid(self) -> list[list[bool | None]]:
        """Fit verdict per cell, rows by micro-batch, columns by sequence length."""
        return [[c.fits for c in row] for row in self.cells]

    def categories(self) -> list[str]:
        """The component categories present anywhere in the grid, in report order."""
        seen = set()
        for row in self.cells:
            for c in row:
                seen.update(c.categories())
        return [k for k in CATEGORIES if k in seen]

    def to_dict(self) -> dict[str, Any]:
        """The grid as JSON-ready data, one entry per cell."""
        return {"model": self.model, "gpu": self.gpu, "capacity": self.capacity, "limit": self.limit,
                "method": self.method, "pipeline_stage": self.stage or None, "batch_sizes": list(self.batch_sizes), "seq_lens": list(self.seq_lens),
                "cells": [{"batch_size": c.batch_size, "seq_len": c.seq_len,
                           "peak_allocated": None if c.report is None else c.report.peak_allocated,
                           "device_used": c.device_used, "fits": c.fits, "categories": c.categories(),
                           "error": c.error or None}
                          for row in self.cells for c in row]}

    def render(self, units: str = "auto") -> str:
        """Plain-text grid: a row per sequence length, a column per micro-batch; ``*`` = does not fit.
        One unit (``auto``: from the largest cell, ``trainmem.units.pick_unit``). More micro-batch
        sizes than fit the terminal (``render.text.width``: 8 columns of 10 at 100, 6 at 72) continue
        in further blocks below."""
        div, label = scale(units, max([c.device_used or 0 for row in self.cells for c in row] or [0]) or None)
        lines = wrap(f"device memory ({label}) of {self.model}" + (f" on {self.gpu}" if self.gpu else "")
                     + (f", the {self.stage} pipeline stage's rank only" if self.stage else "")
                     + (f", limit {self.limit / div:.2f} {label}" if self.limit else "") + "; * = does not fit")
        per_block = max(1, (width() - 11) // 10)  # the sequence column (11), then cells of 10
        for start in range(0, len(self.batch_sizes), per_block):
            cols = range(start, min(start + per_block, len(self.batch_sizes)))
            if start:
                lines.append("")
            lines.append("seq \\ batch".rjust(11) + "".join(f"{self.batch_sizes[i]:>10d}" for i in cols))
            lines += [self._row(j, cols, div) for j in range(len(self.seq_lens))]
        errs = sorted({c.error for row in self.cells for c in row if c.error})
        for e in errs:
            lines += wrap(f"n/a: {e}")
        return "\n".join(lines)

    def _row(self, j: int, cols: range, div: int) -> str:
        """One sequence length's cells for the micro-batch columns ``cols``."""
        row = f"{self.seq_lens[j]:>11d}"
        for i in cols:
            c = self.cells[i][j]
            if c.report is None:
                row += f"{'n/a':>10s}"
            else:
                row += f"{c.device_used / div:>9.2f}{'*' if c.fits is False else ' '}"
        return row


def _check_some_valid(cells: list[list[SweepCell]]) -> None:
    """A grid with no valid cell answers nothing: TrainmemError naming why (the distinct reasons)."""
    errors = [c.error for row in cells for c in row]
    if all(errors):
        reasons = list(dict.fromkeys(errors))
        more = f" (and {len(reasons) - 2} more reasons)" if len(reasons) > 2 else ""
        raise TrainmemError(f"every cell is invalid: {'; '.join(reasons[:2])}{more}")


def sweep(model: Any, batch_sizes: "str | Iterable[int]" = (1,), seq_lens: "str | Iterable[int] | None" = None,
          by: str = "estimate", **options: Any) -> SweepResult:
    """Estimate every (micro-batch, sequence length) pair; ``batch_sizes`` and ``seq_lens`` are lists
    or strings such as ``"1,2,4"`` and ``"128:4096:128"``. ``options``: those of ``trainmem.estimate``
    (``model`` may be a ``Resolved``); no ``seq_lens``: the model's default sequence (2048, or its
    learned positions when fewer). The inputs are resolved once; each cell replaces the two
    sizes (``Resolved.replace``) and a cell the setup does not allow is reported as n/a; when
    every cell is n/a, TrainmemError says why. A cell fits within ``max_fraction`` of the GPU."""
    refuse_varying_lengths(options)
    bs = parse_int_list(batch_sizes, "--batch-size")
    options.pop("batch_size", None)
    options.pop("seq_len", None)
    ev = Evaluator(model, by=by, **options)
    # no sequence lengths: the one default every command uses (spec.training.default_seq_len)
    ss = parse_int_list(seq_lens, "--seq-len") if seq_lens is not None else [default_seq_len(ev.model)]
    if len(bs) * len(ss) > MAX_CELLS:
        raise TrainmemError(f"the grid has {len(bs) * len(ss):,} cells; sweep at most {MAX_CELLS:,}")
    cells: list[list[SweepCell]] = []
    # by trace, a bar on stderr (trainmem.progress; the CLI enables it)
    with progress(len(bs) * len(ss), "sweep --by trace", None if by == "trace" else False) as bar:
        for b in bs:
            row = []
            for s in ss:
                try:
                    row.append(SweepCell(b, s, ev.report(batch_size=b, seq_len=s)))
                except TrainmemError as e:
                    row.append(SweepCell(b, s, None, str(e)))
                bar.update(1)
            cells.append(row)
    _check_some_valid(cells)
    hw, t = ev.hardware, ev.resolved.training
    stage = t.pp_stage if t.pp > 1 and t.pp_stage != "worst" else ""   # --pp-stage: said in the title
    return SweepResult(ev.model.name, None if hw is None else hw.name, None if hw is None else hw.capacity,
                       ev.limit, ev.method if by == "estimate" else "trace", bs, ss, cells, stage)
