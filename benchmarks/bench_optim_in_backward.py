"""Peak memory of a real CPU training run: standard loop vs optimizer-in-backward.

Standard: ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``.
In-backward: ``trainmem.optim.optimizer_in_backward`` (one AdamW per parameter, stepped from its
post-accumulate-grad hook, gradient freed at once).

Each run builds the model from the same random seed, trains ``--steps`` steps on the same batches with
the same hyper-parameters, and measures live tensor bytes with ``trainmem.measure.LiveBytes``
(weights included: the peak is what ``max_memory_allocated`` would report on a GPU). Then the
two runs' parameters are compared with ``torch.allclose``.

    python benchmarks/bench_optim_in_backward.py            # the Lightning post's stack + two small GPTs
    python benchmarks/bench_optim_in_backward.py --quick    # small sizes (what the test runs)

``impl``: for-loop = ``foreach=False`` (like for like: per-parameter updates either way);
default = ``foreach=None`` (PyTorch's choice: for-loop for CPU tensors, foreach on CUDA);
foreach = ``foreach=True`` (CUDA's default, forced on the CPU).
"""
from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass
from typing import Callable

import torch

from trainmem.measure import LiveBytes
from trainmem.optim import optimizer_in_backward

IMPLS = {"for-loop": {"foreach": False}, "default": {}, "foreach": {"foreach": True}}
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    batches: list
    loss: Callable[[torch.nn.Module, object], torch.Tensor]


def linear_stack(layers: int = 20, width: int = 2048, batch: int = 64, steps: int = 5) -> Workload:
    """The example of Lightning AI's "Faster PyTorch Training by Reducing Peak Memory (combining
    backward pass + optimizer step)"
    (https://lightning.ai/pages/community/tutorial/faster-pytorch-training-by-reducing-peak-memory/):
    a stack of 20 Linear layers trained with AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    batches = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(steps)]

    def loss(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])
    return Workload(f"linear x{layers} {width}x{width} b{batch}", model, batches, loss)


def tiny_gpt2(layers: int = 4, hidden: int = 256, vocab: int = 1024, batch: int = 2, seq: int = 32,
              steps: int = 5) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=seq,
                     loss_type="ForCausalLM")
    model = GPT2LMHeadModel(cfg)
    batches = [torch.randint(0, vocab, (batch, seq)) for _ in range(steps)]

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss
    return Workload(f"gpt2 L{layers} h{hidden} v{vocab} b{batch}x{seq}", model, batches, loss)


def tiny_llama(layers: int = 4, hidden: int = 256, vocab: int = 1024, batch: int = 2, seq: int = 32,
               steps: int = 5) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=seq, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    batches = [torch.randint(0, vocab, (batch, seq)) for _ in range(steps)]

    def loss(m, ids):
        return m(input_ids=ids, labels=ids).loss
    return Workload(f"llama L{layers} h{hidden} v{vocab} b{batch}x{seq}", model, batches, loss)


def train(w: Workload, model: torch.nn.Module, impl: str, in_backward: bool) -> int:
    """Train ``model`` on ``w.batches``; return the peak live bytes (weights included)."""
    kw = dict(HYPER, **IMPLS[impl])
    torch.manual_seed(1)  # dropout masks: the same in both runs
    with LiveBytes() as lb:
        lb.track(model)
        if in_backward:
            opt = optimizer_in_backward(model, torch.optim.AdamW, **kw)
        else:
            opt = torch.optim.AdamW(model.parameters(), **kw)
        for b in w.batches:
            w.loss(model, b).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if in_backward:
            opt.remove()
        return lb.peak


@dataclass
class Row:
    model: str
    impl: str
    standard: int
    in_backward: int
    equal: bool
    seconds: float

    @property
    def reduction(self) -> float:
        return 1 - self.in_backward / self.standard


def compare(w: Workload, impl: str) -> Row:
    t0 = time.perf_counter()
    m_std = copy.deepcopy(w.model)
    m_oib = copy.deepcopy(w.model)
    std = train(w, m_std, impl, in_backward=False)
    oib = train(w, m_oib, impl, in_backward=True)
    equal = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7)
                for a, b in zip(m_std.parameters(), m_oib.parameters()))
    return Row(w.name, impl, std, oib, equal, time.perf_counter() - t0)


def workloads(quick: bool) -> list[Workload]:
    """Weight-dominated runs (few tokens per step, as in fine-tuning with small micro-batches),
    where the gradients are a large share of the peak, plus one activation-dominated run (many
    tokens, small model) that shows when the trick does not pay."""
    if quick:
        return [linear_stack(layers=20, width=512, batch=8),
                tiny_llama(layers=6, hidden=256, vocab=256, batch=1, seq=8)]
    return [linear_stack(),
            tiny_llama(layers=8, hidden=512, vocab=1024, batch=1, seq=32),
            tiny_gpt2(layers=8, hidden=512, vocab=1024, batch=1, seq=32),
            tiny_gpt2(layers=2, hidden=128, vocab=512, batch=2, seq=32)]


def table(rows: list[Row]) -> str:
    mib = 1 << 20
    head = f"{'model':<34} {'impl':<9} {'standard peak':>14} {'in-backward peak':>17} {'reduction':>10} {'params equal':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.model:<34} {r.impl:<9} {r.standard / mib:>10.2f} MiB {r.in_backward / mib:>13.2f} MiB "
                     f"{100 * r.reduction:>9.1f}% {str(r.equal):>13}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds instead of minutes)")
    ap.add_argument("--impl", action="append", choices=list(IMPLS), help="repeatable; default: all")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: deterministic results, no spinning on a busy machine)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for w in workloads(a.quick):
        for impl in a.impl or list(IMPLS):
            rows.append(compare(w, impl))
    print(f"torch {torch.__version__}, CPU ({a.threads} thread(s)), AdamW {HYPER}, {len(w.batches)} steps; "
          "peak = live tensor bytes incl. weights (trainmem.measure.LiveBytes)")
    print(table(rows))


if __name__ == "__main__":
    main()
