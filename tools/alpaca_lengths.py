"""Read lit-gpt's histogram of the Alpaca training samples' token lengths and give the length of a
run's longest later micro-batch (the ``later_seq_len`` of the ``litgpt_rt_*`` fixtures).

The source: lit-gpt ``tutorials/alpaca_length_histogram.png`` (Carlos Mocholí, "Clarifications
around `max_seq_length` (#586)", commit 2fc9bf16, 2023-09-26,
https://github.com/Lightning-AI/litgpt/blob/2fc9bf163350a4a9338edda7b3680c28e8ea676c/tutorials/alpaca_length_histogram.png),
shown in ``tutorials/oom.md`` of the same commit with "min(lengths)=35, max(lengths)=1034,
mean(lengths)=110.51988584979601, median(lengths)=96": the training split lit-gpt's
``scripts/prepare_alpaca.py`` makes for its default checkpoint, StableLM-Alpha-3B (the GPT-NeoX
tokenizer; 1034 is the longest sample the resource tables give for StableLM). A copy is
``tools/data/litgpt_2fc9bf16_alpaca_length_histogram.png`` (git blob 5035ae0b).

How it is read. matplotlib drew one bar per token length (the 999 bins between 35 and 1034), each
with a black edge, so every non-empty bin shows even when it holds one sample, and every empty bin
leaves a thin line on the axis (the baseline, taken as the median darkness of the columns between
740 and 1020 tokens, where the plot shows no bar). A column's darkness above that baseline is:

- in the body (below ``TAIL_FROM`` tokens), proportional to the samples there (bar heights of
  hundreds of samples dwarf the edges); scaled so that body and tail hold the training split's
  49,759 samples (51,759 in ``alpaca_data_cleaned_archive.json`` less the 2,000 test samples of
  ``prepare_alpaca.py``'s ``test_split_fraction=0.03865``);
- in the tail, counted in units of the longest sample's bar (1034 tokens, one sample by
  definition): a bin of k samples draws its edge once, so this undercounts bins of several
  samples, the tail is if anything heavier than read.

The reading gives mean 111.3 and median 97.5 (the page: 110.5 and 96), and one sample above 720
tokens, the longest. A run of lit-gpt 8641822 ``finetune/lora.py`` draws ``micro_batch_size``
indices with ``torch.randint(len(train_data), ...)`` per iteration and pads the micro-batch to its
longest sample; iteration 0 is forced to the longest sample; the resource tables' runs made 1,000
iterations. Its longest later micro-batch is the longest of 999 x micro_batch_size draws with
replacement, whose distribution function is F(x) ** n.

    python tools/alpaca_lengths.py            # the reading and the longest later sample per micro-batch size
"""
from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PNG = os.path.join(HERE, "data", "litgpt_2fc9bf16_alpaca_length_histogram.png")
TRAIN_SAMPLES = 51_759 - 2_000  # alpaca_data_cleaned_archive.json less prepare_alpaca.py's test split
LONGEST = 1034  # the longest training sample, StableLM-Alpha tokens (tutorials/oom.md at 2fc9bf16)
TAIL_FROM = 450  # tokens: above this the bars are a few samples high, counted one edge each
X_TICKS = (0, 200, 400, 600, 800, 1000)  # the plot's x tick labels
Y_TICK_STEP = 100  # the plot's y tick labels: 0, 100, ..., 700
ITERATIONS = 1000  # the resource tables' runs ("Time 1k iterations"; tutorials/finetune_lora.md at 0cc02afa)


def _frame(gray: np.ndarray) -> tuple[int, int, int, int]:
    """The plot frame's top and bottom rows and left and right columns (the lines darker than half
    over more than half the image's width or height)."""
    dark = gray < 128
    rows = np.nonzero(dark.sum(1) > gray.shape[1] // 2)[0]
    cols = np.nonzero(dark.sum(0) > gray.shape[0] * 0.7)[0]
    return int(rows[0]), int(rows[-1]), int(cols[0]), int(cols[-1])


def _ticks(line: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Pixel positions of the tick marks along one row or column just outside the frame."""
    idx = np.nonzero(line[lo:hi] < 128)[0] + lo
    return idx[np.concatenate([[True], np.diff(idx) > 1])]


def read(png: str = PNG) -> tuple[np.ndarray, np.ndarray, float]:
    """(token length of each pixel column, its darkness above the baseline, pixels per sample of
    bar height) from the histogram image."""
    from PIL import Image
    gray = np.asarray(Image.open(png).convert("L")).astype(float)
    top, bottom, left, right = _frame(gray)
    xt = _ticks(gray[bottom + 3], left + 1, right)
    yt = _ticks(gray[:, left - 3], top, bottom + 1)
    if len(xt) != len(X_TICKS):
        raise ValueError(f"{png}: found {len(xt)} x ticks, expected {len(X_TICKS)}")
    px_per_token = (xt[-1] - xt[0]) / (X_TICKS[-1] - X_TICKS[0])
    px_per_sample = (yt[-1] - yt[0]) / ((len(yt) - 1) * Y_TICK_STEP)
    dark = 1 - gray[top + 1:bottom, left + 1:right] / 255.0
    col = dark.sum(0)
    tok = (np.arange(left + 1, right) - xt[0]) / px_per_token + X_TICKS[0]
    base = float(np.median(col[(tok > 740) & (tok < 1020)]))
    excess = np.clip(col - base, 0, None)
    excess[(tok < 20) | (tok > LONGEST + 8)] = 0  # the frame's edges (the samples span 35 ... 1034)
    return tok, excess, px_per_sample


def counts(tok: np.ndarray, excess: np.ndarray, total: int = TRAIN_SAMPLES) -> np.ndarray:
    """Samples per pixel column: the tail (above ``TAIL_FROM``) in units of the longest sample's bar
    (one sample), the body proportional to its darkness so that the whole holds ``total``."""
    one = excess[(tok > LONGEST - 6) & (tok < LONGEST + 6)].sum()
    tail = tok > TAIL_FROM
    out = np.where(tail, excess / one, 0.0)
    body = np.where(tail, 0.0, excess)
    return out + body / body.sum() * (total - out.sum())


def longest_of(tok: np.ndarray, n: np.ndarray, draws: int, q: float = 0.5) -> float:
    """The length the longest of ``draws`` independent draws (with replacement) stays below with
    probability ``q``: the smallest x with F(x) ** draws >= q, F the histogram's distribution."""
    cdf = np.cumsum(n) / n.sum()
    return float(tok[int(np.searchsorted(cdf ** draws, q))])


def stats(tok: np.ndarray, n: np.ndarray) -> dict[str, float]:
    """Mean and median of the read histogram (the page states 110.5 and 96)."""
    cdf = np.cumsum(n) / n.sum()
    return {"mean": float((n * tok).sum() / n.sum()), "median": float(tok[int(np.searchsorted(cdf, 0.5))])}


def later_seq_len(micro_batch_size: int, longest: int, png: str = PNG) -> int:
    """A resource-table run's longest later micro-batch in its own tokenizer's tokens: the median of
    the longest of 999 x ``micro_batch_size`` draws (StableLM-Alpha tokens), scaled by the ratio of
    the run's longest sample to StableLM's (1034)."""
    tok, ex, _ = read(png)
    m = longest_of(tok, counts(tok, ex), (ITERATIONS - 1) * micro_batch_size)
    return round(m * longest / LONGEST)


def main() -> None:
    png = sys.argv[1] if len(sys.argv) > 1 else PNG
    tok, ex, _ = read(png)
    n = counts(tok, ex)
    s = stats(tok, n)
    print(f"read: mean {s['mean']:.1f}, median {s['median']:.1f} (page: 110.5, 96)")
    for t in (450, 500, 550, 600, 650, 700, 720):
        print(f"samples above {t}: {n[tok > t].sum():.1f}")
    for mb in (1, 2, 4):
        d = (ITERATIONS - 1) * mb
        q = [longest_of(tok, n, d, p) for p in (0.1, 0.5, 0.9)]
        print(f"micro-batch {mb}: longest of {d} draws, median {q[1]:.0f} (10-90 %: {q[0]:.0f}-{q[2]:.0f}) "
              f"StableLM tokens; phi-1.5 x 1044/1034 {q[1] * 1044 / LONGEST:.0f}, "
              f"Llama 2 x 1304/1034 {q[1] * 1304 / LONGEST:.0f}")


if __name__ == "__main__":
    main()
