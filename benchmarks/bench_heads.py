"""``estimate`` against ``trace`` for the heads other than causal LM (docs/agreement.md, "Non-LM heads
sweep"): sequence classification and question answering on GPT-2, BERT, Llama and Qwen2 (masked LM
on BERT, the only one of them that has it), each at its real width and a tiny one (2 layers both)
x fp32, bf16-amp, fp16-amp, bf16 x recompute none, full x (2 x 64, 4 x 256): 288 setups.

    .venv/bin/python benchmarks/bench_heads.py                        # run the sweep, print the summary
    .venv/bin/python benchmarks/bench_heads.py out.jsonl              # ... and keep one JSON row per setup
    .venv/bin/python benchmarks/bench_heads.py out.jsonl before.jsonl # ... then compare with an earlier run

Each row: |estimate / trace - 1| of the step's peak allocated (``err``), and of the forward's and
the backward's phase peaks (``fwd``, ``bwd``), in percent, with where trace's peak is.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys

MODELS = {
    "gpt2-tiny": ("gpt2", ["num_hidden_layers=2", "pad_token_id=0", "vocab_size=1000", "n_embd=64", "n_head=4"]),
    "gpt2": ("gpt2", ["num_hidden_layers=2", "pad_token_id=50256"]),
    "bert-tiny": ("bert-base-uncased", ["num_hidden_layers=2", "vocab_size=1000", "hidden_size=64",
                                        "num_attention_heads=4", "intermediate_size=256"]),
    "bert": ("bert-base-uncased", ["num_hidden_layers=2"]),
    "llama-tiny": ("llama-3.2-1b", ["num_hidden_layers=2", "pad_token_id=0", "vocab_size=1000", "hidden_size=256",
                                    "intermediate_size=1024", "num_attention_heads=4", "num_key_value_heads=2",
                                    "head_dim=64"]),
    "llama": ("llama-3.2-1b", ["num_hidden_layers=2", "pad_token_id=0"]),
    "qwen2-tiny": ("qwen2.5-0.5b", ["num_hidden_layers=2", "pad_token_id=0", "vocab_size=1000", "hidden_size=256",
                                    "intermediate_size=1024", "num_attention_heads=4", "num_key_value_heads=2"]),
    "qwen2": ("qwen2.5-0.5b", ["num_hidden_layers=2", "pad_token_id=0"]),
}
TASKS = ("sequence-classification", "question-answering", "masked-lm")
PRECISIONS = ("fp32", "bf16-amp", "fp16-amp", "bf16")
RECOMPUTE = ("none", "full")
SHAPES = ((2, 64), (4, 256))


def setups():
    for arch, task, prec, rec, (b, s) in itertools.product(MODELS, TASKS, PRECISIONS, RECOMPUTE, SHAPES):
        if task != "masked-lm" or arch.startswith("bert"):
            yield arch, task, prec, rec, b, s


def compare(arch, task, prec, rec, b, s) -> dict:
    import trainmem
    name, sets = MODELS[arch]
    kw = dict(task=task, precision=prec, recompute=rec, batch_size=b, seq_len=s, optimizer="adamw", set=sets)
    e, t = trainmem.estimate(name, **kw), trainmem.trace(name, **kw)

    def phase(r, n):
        return max(p.peak for p in r.phases if p.name == n)

    return dict(arch=arch, head=task, prec=prec, rec=rec, b=b, s=s,
                err=100 * (e.peak_allocated / t.peak_allocated - 1),
                fwd=100 * (phase(e, "forward") / phase(t, "forward") - 1),
                bwd=100 * (phase(e, "backward") / phase(t, "backward") - 1),
                trace_at=f"{t.peak_phase}/{t.peak_where}", estimate_at=f"{e.peak_phase}/{e.peak_where}")


def summary(rows: list[dict], key: str) -> str:
    v = [abs(r[key]) for r in rows]
    return f"{statistics.median(v):.2f}% / {max(v):.2f}%"


def main(argv: list[str]) -> None:
    import torch
    torch.set_num_threads(1)
    rows = []
    with open(argv[0] if argv else os.devnull, "w", encoding="utf-8") as out:  # `make bench` passes no path
        for case in setups():
            rows.append(compare(*case))
            out.write(json.dumps(rows[-1]) + "\n")
            print(" ".join(map(str, case)), f"{rows[-1]['err']:+.2f}%", rows[-1]["trace_at"], flush=True)
    before = [json.loads(line) for line in open(argv[1], encoding="utf-8")] if len(argv) > 1 else None
    for arch in MODELS:
        mine = [r for r in rows if r["arch"] == arch]
        line = f"{arch:11} peak {summary(mine, 'err')}  forward {summary(mine, 'fwd')}"
        if before:
            line += f"  (before: peak {summary([r for r in before if r['arch'] == arch], 'err')})"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
