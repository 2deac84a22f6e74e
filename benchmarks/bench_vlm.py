"""``estimate`` against ``trace`` for vision-language models (``--task image-text-to-text``; docs/agreement.md,
"Vision-language models"): Qwen2.5-VL-3B, LLaVA-1.5-7B and Gemma-3-4B-it at their real widths, vocabularies and
whole vision towers, their language models cut to a few layers (2; Gemma 3's 6, one full-attention layer among
its five sliding ones) x images per sample (1, 2) x micro-batch (1, 2) x the tuning (full, ``--freeze-vision-tower``,
LoRA r16 on the language model's q/k/v/o) x precision (bf16, fp16-amp): 72 setups, and 6 under ``--recompute
full`` (the tower's blocks checkpointed too: each family x precision, full tuning, 2 images, micro-batch 2);
AdamW, 2048 tokens (Qwen2.5-VL's images 448 px: 256 tokens each; LLaVA's 576, Gemma 3's 256).

    .venv/bin/python benchmarks/bench_vlm.py                           # the sweep, the summary only
    .venv/bin/python benchmarks/bench_vlm.py out.jsonl                 # ... and one JSON row per setup
    .venv/bin/python benchmarks/bench_vlm.py out.jsonl --family llava-1.5  # one family
    .venv/bin/python benchmarks/bench_vlm.py out.jsonl --recompute-only    # the --recompute full setups

Each row: estimate / trace - 1 of the step's peak allocated (``err``, percent), where each has its peak, and the
seconds the estimate took (its first setup of a kind derives the coefficients: a few traces of the cut model).
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time

#: family -> (catalogue model, its language model's layers, setup options)
MODELS = {
    "qwen2.5-vl": ("qwen2.5-vl-3b", 2, {"image_size": 448}),
    "llava-1.5": ("llava-1.5-7b", 2, {}),
    "gemma-3": ("gemma-3-4b-it", 6, {}),
}
IMAGES = (1, 2)
BATCHES = (1, 2)
TUNING = ("full", "frozen-tower", "lora")
PRECISIONS = ("bf16", "fp16-amp")
SEQ_LEN = 2048


def config(family: str) -> dict:
    """The catalogue entry's config with its language model cut to the family's layers (in its
    ``text_config`` where it has one: ``--set`` reaches top-level fields only)."""
    import trainmem
    name, layers, _ = MODELS[family]
    cfg = dict(trainmem.resolve_model(name).config)  # (Gemma 3's entry marks its task: spec.tasks.TASK_KEY)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = dict(cfg["text_config"], num_hidden_layers=layers)
    else:
        cfg["num_hidden_layers"] = layers
    return cfg


def setups(families=None):
    for fam, n, b, tune, prec in itertools.product(families or MODELS, IMAGES, BATCHES, TUNING, PRECISIONS):
        yield fam, n, b, tune, prec, "none"
    for fam, prec in itertools.product(families or MODELS, PRECISIONS):
        yield fam, 2, 2, "full", prec, "full"


def options(family: str, images: int, batch: int, tuning: str, precision: str, recompute: str = "none") -> dict:
    extra = {"frozen-tower": {"freeze_vision_tower": True},
             "lora": {"lora_rank": 16, "lora_targets": "q_proj,k_proj,v_proj,o_proj"}}.get(tuning, {})
    return dict(MODELS[family][2], images=images, batch_size=batch, seq_len=SEQ_LEN, precision=precision,
                optimizer="adamw", recompute=recompute, **extra)


def compare(family: str, images: int, batch: int, tuning: str, precision: str, recompute: str = "none") -> dict:
    import trainmem
    cfg, kw = config(family), options(family, images, batch, tuning, precision, recompute)
    start = time.perf_counter()
    e = trainmem.estimate(cfg, **kw)
    seconds = time.perf_counter() - start
    t = trainmem.trace(cfg, steps=2, **kw)
    return dict(family=family, images=images, b=batch, tuning=tuning, prec=precision, recompute=recompute,
                err=100 * (e.peak_allocated / t.peak_allocated - 1), estimate_mib=e.peak_allocated / 2 ** 20,
                trace_mib=t.peak_allocated / 2 ** 20, trace_at=f"{t.peak_phase}/{t.peak_where}",
                estimate_at=f"{e.peak_phase}/{e.peak_where}", estimate_s=round(seconds, 2))


def summary(rows: list[dict]) -> str:
    errs = sorted(abs(r["err"]) for r in rows)
    return (f"{len(rows)} setups: best {errs[0]:.2f}%, median {statistics.median(errs):.2f}%, "
            f"worst {errs[-1]:.2f}% (|estimate / trace - 1| of the peak allocated)")


def main(argv: list[str]) -> None:
    out = argv[0] if argv and not argv[0].startswith("--") else os.devnull  # `make bench` passes no path
    families = [argv[argv.index("--family") + 1]] if "--family" in argv else None
    only = "--recompute-only" in argv  # the --recompute full setups alone
    rows = []
    with open(out, "w") as f:
        for setup in setups(families):
            if only and setup[-1] != "full":
                continue
            row = compare(*setup)
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{row['family']:11s} img {row['images']} b {row['b']} {row['tuning']:12s} {row['prec']:8s} "
                  f"{'recompute ' if row['recompute'] == 'full' else ''}"
                  f"{row['estimate_mib']:10.1f} {row['trace_mib']:10.1f} {row['err']:+6.2f}%  "
                  f"{row['trace_at']}", flush=True)
    for fam in sorted({r["family"] for r in rows}):
        print(f"{fam}: {summary([r for r in rows if r['family'] == fam])}")
    print(f"all: {summary(rows)}")


if __name__ == "__main__":
    main(sys.argv[1:])
