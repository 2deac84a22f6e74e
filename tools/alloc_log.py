"""Log what the estimate's allocator replay and trace ask of the simulated caching allocator, side by side.

    PYTHONPATH=src .venv/bin/python tools/alloc_log.py "qwen2 8x256 attention=sdpa-math dp=4 fsdp=grad-op"
    PYTHONPATH=src .venv/bin/python tools/alloc_log.py ROW --out /tmp/x --at-least 4 --stack 16.01

ROW is a setup of the agreement grid exactly as docs/agreement_grid.json names it (benchmarks/bench_agreement.py,
``Case.name``). Both sides drive ``trainmem.allocator.CachingAllocator`` (the estimate through
``estimate(..., reserved=True)``, trace through its emulated CUDA), so one spy sees either: every request and free
of ``--at-least`` MiB and over ("A size stream", "F size") and every segment opened ("S size -> reserved,
allocated"), in order, to OUT/estimate.txt and OUT/trace.txt. It prints both peaks and the first segment where the
two sequences of opened segments part. ``--stack SIZE`` prints where the estimate's replay asks a block of SIZE MiB
(to 0.01 MiB), to find the code that makes a request that differs. This is how each mechanism of the reserved
replay in docs/agreement.md was found: the first segment one side opens and the other does not, and the requests
just before it."""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 2 ** 20


def _spy(log: list, at_least: float, stack: float | None) -> None:
    """Wrap the allocator's request, free and segment calls so that they append to ``log``."""
    from trainmem import allocator
    cls = allocator.CachingAllocator
    alloc, free, dev = cls.allocate, cls.free, cls._device_alloc
    sizes: dict = {}

    def spy_alloc(self, nbytes, tag=None, stream=None):
        h = alloc(self, nbytes, tag, stream)
        sizes[h] = nbytes
        if nbytes >= at_least * MiB:
            log.append(f"A {nbytes / MiB:9.2f} s={stream}")
        if stack is not None and round(nbytes / MiB, 2) == stack:
            traceback.print_stack(limit=8)
        return h

    def spy_free(self, h):
        if sizes.get(h, 0) >= at_least * MiB:
            log.append(f"F {sizes[h] / MiB:9.2f}")
        return free(self, h)

    def spy_dev(self, pool, size):
        b = dev(self, pool, size)
        if b is not None:
            log.append(f"S {size / MiB:9.2f} -> reserved {self.reserved / MiB:.1f} allocated {self.allocated / MiB:.1f}")
        return b
    cls.allocate, cls.free, cls._device_alloc = spy_alloc, spy_free, spy_dev


def _segments(lines: list[str]) -> list[str]:
    return [ln.split("->")[0].strip() for ln in lines if ln.startswith("S ")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("row", help="an agreement-grid setup, as docs/agreement_grid.json names it")
    ap.add_argument("--out", default=".", help="folder for estimate.txt and trace.txt (default: here)")
    ap.add_argument("--at-least", type=float, default=1.0, help="log requests of this many MiB and over (default 1)")
    ap.add_argument("--stack", type=float, help="print the estimate's call stack at each request of this many MiB")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_agreement import stored_rows
    from trainmem.estimate.engine import estimate
    from trainmem.trace.api import trace
    rows = stored_rows(ROOT / "docs" / "agreement_grid.json")
    if a.row not in rows:
        print(f"alloc_log: error: {a.row!r} is not a row of docs/agreement_grid.json (copy its name from there)",
              file=sys.stderr)
        return 2
    m, t = rows[a.row].setup.specs()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logs: dict[str, list[str]] = {}
    for side, run, stack in (("estimate", lambda: estimate(m, t, reserved=True), a.stack),
                             ("trace", lambda: trace(m, training=t), None)):
        log: list[str] = []
        from trainmem import allocator
        saved = (allocator.CachingAllocator.allocate, allocator.CachingAllocator.free,
                 allocator.CachingAllocator._device_alloc)
        _spy(log, a.at_least, stack)
        try:
            r = run()
        finally:
            (allocator.CachingAllocator.allocate, allocator.CachingAllocator.free,
             allocator.CachingAllocator._device_alloc) = saved
        (out / f"{side}.txt").write_text("\n".join(log) + "\n")
        logs[side] = log
        print(f"{side:9} peak reserved {r.peak_reserved / MiB:10.1f} MiB, allocated {r.peak_allocated / MiB:10.1f} MiB,"
              f" {len(log)} events -> {out / (side + '.txt')}")
    se, st = _segments(logs["estimate"]), _segments(logs["trace"])
    part = next((i for i, (x, y) in enumerate(zip(se, st)) if x != y), None)
    if part is None and len(se) == len(st):
        print(f"the same {len(se)} segments on both sides")
    else:
        i = part if part is not None else min(len(se), len(st))
        print(f"segments part at the {i + 1}th: estimate {se[i] if i < len(se) else '-'}, "
              f"trace {st[i] if i < len(st) else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
