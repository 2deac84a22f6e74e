"""``estimate`` (formulas) against ``trace`` (the real training step on tensors without data).

    .venv/bin/python benchmarks/bench_agreement.py               # the full grid (72 setups)
    .venv/bin/python benchmarks/bench_agreement.py --quick       # the representative subset (14)
    .venv/bin/python benchmarks/bench_agreement.py --family qwen2 --explain 2   # why rows differ

Grid: six model families (2 layers each, realistic widths, full vocabularies, so the s x s
attention terms and the vocab-sized loss tensors both matter) x precision (fp32, bf16-amp, bf16) x
attention (eager, sdpa) x recomputation (none, full), each at one of three (batch, seq) shapes with
the same token count. Every setup runs 2 steps of AdamW (PyTorch's default implementation on CUDA:
foreach) on one emulated A100; the loop is the tracer's (``trainmem.workload``): by default
``loss = model(**batch).loss`` (the output is dropped before backward, ``keep_logits=False``, as
the HF Trainer does); ``--keep-logits`` runs every setup with ``outputs = model(**batch)`` kept
until the next step instead.

The table prints both peaks, their difference (estimate / trace - 1) and the difference of the
allocated memory at the end of each phase of both steps. The last lines give the median and the
largest |difference| of the peak. ``--explain N`` prints, for the N rows that differ most, the
estimate's components next to the trace's largest live tensors at its peak.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

from trainmem.estimate.engine import estimate
from trainmem.report import MemoryReport
from trainmem.spec import TrainingSpec, resolve_model

MiB = 2 ** 20

#: family -> (catalogue model, overrides). Two layers, real widths and vocabularies.
FAMILIES: dict[str, tuple[str, list[str]]] = {
    # GPT-2 small: tied wte, learned positions, gelu_new, fused qkv (Conv1D), dropout 0.1
    "gpt2": ("gpt2", ["n_layer=2", "n_positions=4096"]),
    # BERT-base masked LM: post-LN, dropout 0.1, MLM transform head tied to the word embeddings
    "bert": ("bert-base-uncased", ["num_hidden_layers=2", "max_position_embeddings=4096"]),
    # Llama-2 style: multi-head attention, untied head, vocab 32000
    "llama": ("llama-2-7b", ["num_hidden_layers=2", "hidden_size=2048", "intermediate_size=5504",
                             "num_attention_heads=16", "num_key_value_heads=16"]),
    # Llama-3.2-1B: grouped-query attention (32 / 8 heads), tied head, vocab 128256
    "llama-gqa": ("llama-3.2-1b", ["num_hidden_layers=2"]),
    # Qwen2.5-0.5B: q/k/v biases, GQA 14 / 2, tied head, vocab 151936
    "qwen2": ("qwen2.5-0.5b", ["num_hidden_layers=2"]),
    # Mixtral-like: 8 experts, top-2, GQA 16 / 4
    "mixtral": ("mixtral-8x7b", ["num_hidden_layers=2", "hidden_size=1024", "intermediate_size=3584",
                                 "num_attention_heads=16", "num_key_value_heads=4"]),
}
PRECISIONS = ("fp32", "bf16-amp", "bf16")
ATTENTION = ("eager", "sdpa")
RECOMPUTE = ("none", "full")
SHAPES = ((2, 2048), (4, 1024), (8, 512))
PHASES = (("model_loaded", 0), ("forward", 1), ("backward", 1), ("optimizer_step", 1), ("zero_grad", 1),
          ("forward", 2), ("backward", 2), ("optimizer_step", 2), ("zero_grad", 2))
PHASE_TAGS = ("load", "fwd1", "bwd1", "opt1", "zg1", "fwd2", "bwd2", "opt2", "zg2")


@dataclass(frozen=True)
class Setup:
    family: str
    batch: int
    seq: int
    precision: str
    attention: str
    recompute: str
    keep_logits: bool = False

    @property
    def name(self) -> str:
        rc = "" if self.recompute == "none" else f" rc={self.recompute}"
        keep = " keep" if self.keep_logits else ""
        return f"{self.family} {self.batch}x{self.seq} {self.precision} {self.attention}{rc}{keep}"

    def specs(self):
        model, overrides = FAMILIES[self.family]
        m = resolve_model(model, overrides=overrides)
        t = TrainingSpec(batch_size=self.batch, seq_len=self.seq, precision=self.precision,
                         attention=self.attention, recompute=self.recompute, keep_logits=self.keep_logits)
        return m, t


@dataclass
class Row:
    setup: Setup
    estimate: MemoryReport
    trace: MemoryReport
    seconds: float
    phase_diff: dict[str, float] = field(default_factory=dict)

    @property
    def diff(self) -> float:
        return self.estimate.peak_allocated / self.trace.peak_allocated - 1


def grid() -> list[Setup]:
    """Families x precision x attention x recompute; the shape rotates so that every family meets
    every shape."""
    out = []
    for fi, fam in enumerate(FAMILIES):
        ci = 0
        for prec in PRECISIONS:
            for attn in ATTENTION:
                for rc in RECOMPUTE:
                    b, s = SHAPES[(fi + ci) % len(SHAPES)]
                    out.append(Setup(fam, b, s, prec, attn, rc))
                    ci += 1
    return out


#: the representative subset the fast test runs: every family, precision, attention kind and both
#: recompute settings, the GQA/math-SDPA fallback, tied-head accumulation and MoE routing
QUICK = (
    Setup("gpt2", 2, 1024, "fp32", "eager", "none"),
    Setup("gpt2", 4, 512, "bf16-amp", "sdpa", "full"),
    Setup("bert", 2, 1024, "bf16-amp", "eager", "none"),
    Setup("bert", 4, 512, "bf16", "sdpa", "none"),
    Setup("bert", 1, 2048, "fp32", "sdpa", "full"),
    Setup("llama", 1, 2048, "bf16-amp", "sdpa", "none"),
    Setup("llama", 2, 1024, "bf16", "eager", "full"),
    Setup("llama-gqa", 2, 1024, "fp32", "sdpa", "none"),
    Setup("llama-gqa", 4, 512, "bf16-amp", "eager", "none"),
    Setup("qwen2", 1, 2048, "bf16", "sdpa", "none"),
    Setup("qwen2", 2, 1024, "bf16-amp", "eager", "full"),
    Setup("mixtral", 4, 512, "bf16-amp", "sdpa", "none"),
    Setup("mixtral", 1, 2048, "fp32", "eager", "none"),
    Setup("mixtral", 2, 1024, "bf16", "sdpa", "full"),
)


def compare(setup: Setup) -> Row:
    from trainmem.trace.api import trace
    m, t = setup.specs()
    t0 = time.perf_counter()
    tr = trace(m, training=t)
    seconds = time.perf_counter() - t0
    est = estimate(m, t)
    row = Row(setup, est, tr, seconds)
    for (name, step), tag in zip(PHASES, PHASE_TAGS):
        a = _phase(est, name, step)
        b = _phase(tr, name, step)
        if a is not None and b:
            row.phase_diff[tag] = a / b - 1
    return row


def _phase(r: MemoryReport, name: str, step: int) -> int | None:
    for p in r.phases:
        if p.name == name and p.step == step:
            return p.allocated
    return None


def summary(rows: list[Row]) -> tuple[float, float]:
    d = [abs(r.diff) for r in rows]
    return statistics.median(d), max(d)


def print_table(rows: list[Row], out=sys.stdout) -> None:
    tags = ("fwd1", "bwd1", "opt1", "fwd2", "bwd2", "zg2")
    head = f"{'setup':40s} {'estimate':>10s} {'trace':>10s} {'diff':>7s} | " + " ".join(f"{t:>6s}" for t in tags)
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        ph = " ".join(f"{100 * r.phase_diff[t]:+6.2f}" if t in r.phase_diff else f"{'-':>6s}" for t in tags)
        print(f"{r.setup.name:40s} {r.estimate.peak_allocated / MiB:10.1f} {r.trace.peak_allocated / MiB:10.1f} "
              f"{100 * r.diff:+6.2f}% | {ph}", file=out)
    med, mx = summary(rows)
    worst = max(rows, key=lambda r: abs(r.diff))
    phase_all = [abs(v) for r in rows for v in r.phase_diff.values()]
    print("-" * len(head), file=out)
    print(f"peak (MiB; allocated), phases: allocated at the end of each phase, estimate / trace - 1 (%)", file=out)
    print(f"{len(rows)} setups: |peak difference| median {100 * med:.2f}%, max {100 * mx:.2f}% ({worst.setup.name}); "
          f"|phase difference| median {100 * statistics.median(phase_all):.2f}%, max {100 * max(phase_all):.2f}%",
          file=out)


def explain(row: Row, out=sys.stdout, top: int = 14) -> None:
    """The estimate's breakdown at its peak next to the trace's at its own."""
    e, t = row.estimate, row.trace
    print(f"\n== {row.setup.name}: estimate {e.peak_allocated / MiB:.1f} MiB at {e.peak_phase} {e.peak_where}; "
          f"trace {t.peak_allocated / MiB:.1f} MiB at {t.peak_phase} {t.peak_where}", file=out)
    print("  estimate components:", file=out)
    for c in sorted(e.components, key=lambda c: -c.bytes)[:top]:
        print(f"    {c.bytes / MiB:10.2f}  {c.name}", file=out)
    print("  trace components:", file=out)
    for c in sorted(t.components, key=lambda c: -c.bytes)[:top]:
        print(f"    {c.bytes / MiB:10.2f}  {c.name} ({c.dtype})", file=out)
    print(f"  trace SDPA backends: {t.extra.get('sdpa_backends')}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the representative subset the fast test runs")
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    ap.add_argument("--explain", type=int, default=0, metavar="N", help="break down the N largest disagreements")
    ap.add_argument("--keep-logits", action="store_true",
                    help="the loop keeps the model output (outputs = model(...)) until the next step")
    a = ap.parse_args(argv)
    setups = list(QUICK) if a.quick else grid()
    if a.keep_logits:
        setups = [replace(s, keep_logits=True) for s in setups]
    if a.family:
        setups = [s for s in setups if s.family in a.family]
    t0 = time.perf_counter()
    rows = [compare(s) for s in setups]
    print_table(rows)
    print(f"{len(rows)} traces in {time.perf_counter() - t0:.1f} s "
          f"(trace median {statistics.median(r.seconds for r in rows):.2f} s)")
    for r in sorted(rows, key=lambda r: -abs(r.diff))[:a.explain]:
        explain(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
