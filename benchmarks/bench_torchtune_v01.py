"""torchtune v0.1.0's single-device LoRA run, rebuilt module by module and traced: why the LoRA
tutorial's published peak reserved memory (validation/published/torchtune_tut_*.json) is about 6 %
above trainmem's estimate.

torchtune cannot be installed here, so its Llama-2 LoRA model and its training loop are written out
below from the source at commit ff594c231 (v0.1.0, https://github.com/pytorch/torchtune/tree/ff594c231):

* ``torchtune/models/llama2/_component_builders.py`` L199-250 (``lora_llama2``): one
  ``TransformerDecoderLayer`` is built, then ``TransformerDecoder`` deep-copies it num_layers times
  (``torchtune/modules/transformer.py`` L93, L137), so during the build 33 layers exist on the GPU
  (the recipe builds on the device in bf16: ``recipes/lora_finetune_single_device.py`` L254-255);
  the template is freed when the builder returns and its blocks stay cached. Each copy keeps its own
  ``RotaryPositionalEmbeddings`` cache, fp32 [4096, 64, 2] (``torchtune/modules/position_embeddings.py``
  L38, L72-73): 32 x 2 MiB resident buffers.
* ``lora_llama2_self_attention`` L321-363 builds its ``LoRALinear``\\ s without ``dropout``, and
  ``lora_llama2`` passes no ``lora_dropout`` to ``lora_llama2_mlp`` (L216-222) nor to the output's
  ``LoRALinear`` (L236-239): at this commit every adapter runs with p = 0 (``lora.py`` L47), although
  ``lora_llama2_7b`` takes ``lora_dropout=0.05``.
* ``TransformerDecoder.forward`` returns ``self.output(h).float()`` (L210): fp32 logits. The recipe
  (L447-453) shifts them into a contiguous fp32 copy, transposes it and applies
  ``nn.CrossEntropyLoss``; ``logits`` (the shifted copy) stays referenced until the next forward
  returns. log_softmax makes a contiguous copy of its transposed input (PyTorch
  ``aten/src/ATen/native/cuda/SoftMax.cu`` ``host_softmax``: ``input_.contiguous()``).
* The batches are padded to the longest sample of the batch (``torchtune/utils/collate.py`` L50-59)
  after truncation to 512 tokens (``torchtune/datasets/_alpaca.py`` L66): the sequence length
  changes from micro-batch to micro-batch.

What it prints, per tutorial case: trainmem's estimate of the fixture, the replica traced at a fixed
2 x 512 batch (the fixture's mapping), and the replica traced over micro-batches whose padded length
varies. The varying lengths are uniform pseudo-random integers in [64, 512] (``--seed``, 0): an illustration
of padding to the longest sample, not Alpaca-cleaned's own distribution, which cannot be read here.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_torchtune_v01.py            # both cases, 300 micro-batches
    PYTHONPATH=src .venv/bin/python benchmarks/bench_torchtune_v01.py --micro 60 --case qv_r8 --seed 1
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, FFN, VOCAB, MAX_SEQ = 4096, 32, 11008, 32000, 4096   # lora_llama2_7b (_model_builders.py)
ATTN = ("q_proj", "k_proj", "v_proj", "output_proj")
CASES = {   # fixture name -> (attention targets, LoRA on the MLP and on the output, rank)
    "qv_r8": (("q_proj", "v_proj"), False, 8),
    "qv_r64": (("q_proj", "v_proj"), False, 64),
    "all_r8": (ATTN, True, 8),
    "all_r64": (ATTN, True, 64),
}


class RMSNorm(nn.Module):
    """torchtune/modules/rms_norm.py: fp32 statistics, the result cast back, times ``scale``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps, self.scale = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.scale


class RoPE(nn.Module):
    """torchtune/modules/position_embeddings.py: an fp32 cos/sin cache of [max_seq_len, dim/2, 2]."""

    def __init__(self, dim: int, max_seq_len: int = MAX_SEQ, base: int = 10_000) -> None:
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        self.register_buffer("theta", theta, persistent=False)
        idx = torch.einsum("i, j -> ij", torch.arange(max_seq_len, dtype=theta.dtype, device=theta.device), theta)
        self.register_buffer("cache", torch.stack([torch.cos(idx), torch.sin(idx)], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = self.cache[: x.size(1)]
        xs = x.float().reshape(*x.shape[:-1], -1, 2)                  # fp32 copy of q or k
        cache = cache.view(1, xs.size(1), 1, xs.size(3), 2)
        out = torch.stack([xs[..., 0] * cache[..., 0] - xs[..., 1] * cache[..., 1],
                           xs[..., 1] * cache[..., 0] + xs[..., 0] * cache[..., 1]], -1)
        return out.flatten(3).type_as(x)


class LoRALinear(nn.Module):
    """torchtune/modules/peft/lora.py: frozen weight, ``lora_b(lora_a(dropout(x))) * alpha / rank``."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.scaling = alpha / rank
        self.weight = nn.Parameter(nn.Linear(d_in, d_out, bias=False).weight)
        self.dropout = nn.Dropout(p=dropout)
        self.lora_a, self.lora_b = nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.scaling * self.lora_b(self.lora_a(self.dropout(x)))


class Attention(nn.Module):
    """torchtune/modules/attention.py ``CausalSelfAttention`` (no KV cache: ``is_causal=True``)."""

    def __init__(self, proj: dict[str, nn.Module]) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (proj[k] for k in ATTN)
        self.pos_embeddings = RoPE(DIM // HEADS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, DIM // HEADS) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.pos_embeddings(q), self.pos_embeddings(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, -1))


class Layer(nn.Module):
    """torchtune/modules/transformer.py ``TransformerDecoderLayer`` with ``FeedForward``."""

    def __init__(self, attn: Attention, w1: nn.Module, w2: nn.Module, w3: nn.Module) -> None:
        super().__init__()
        self.sa_norm, self.attn, self.mlp_norm = RMSNorm(DIM), attn, RMSNorm(DIM)
        self.w1, self.w2, self.w3 = w1, w2, w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.sa_norm(x)) + x
        y = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Decoder(nn.Module):
    """``TransformerDecoder``: the layer deep-copied ``n`` times; fp32 logits."""

    def __init__(self, layer: Layer, n: int, output: nn.Module) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(n)])
        self.norm, self.output = RMSNorm(DIM), output

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


def make_layer(targets: tuple[str, ...], mlp: bool, rank: int) -> Layer:
    """One decoder layer as ``lora_llama2`` builds it (adapters with p = 0, see the module docstring)."""
    def lin(d_in: int, d_out: int, on: bool) -> nn.Module:
        return LoRALinear(d_in, d_out, rank, 2 * rank) if on else nn.Linear(d_in, d_out, bias=False)
    attn = Attention({k: lin(DIM, DIM, k in targets) for k in ATTN})
    return Layer(attn, lin(DIM, FFN, mlp), lin(FFN, DIM, mlp), lin(DIM, FFN, mlp))


def build(case: str, layers: int) -> nn.Module:
    """The model with only the adapters trainable and every layer checkpointed
    (``utils.set_activation_checkpointing``: ``apply_activation_checkpointing``, non-reentrant)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    targets, mlp, rank = CASES[case]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)                     # utils.set_default_dtype(self._dtype)
    try:
        output = LoRALinear(DIM, VOCAB, rank, 2 * rank) if mlp else nn.Linear(DIM, VOCAB, bias=False)
        model = Decoder(make_layer(targets, mlp, rank), layers, output)
    finally:
        torch.set_default_dtype(previous)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Layer))
    return model


def loop(case: str, lengths: list[int], micro: int, template: bool = True) -> Callable[..., None]:
    """One optimizer step of the recipe's loop (L443-474): ``micro`` micro-batches of 2 sequences,
    the i-th padded to ``lengths[i % len(lengths)]`` tokens. ``template``: before the first step the
    builder's template layer is made on the device and freed, as the build leaves it cached."""
    state: dict[str, Any] = {"i": 0, "logits": None}
    targets, mlp, rank = CASES[case]

    def step(model: nn.Module, optimizer: Any, i: int) -> None:
        if i == 1 and template:
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device("cuda"):
                    make_layer(targets, mlp, rank)              # made, then dropped
            finally:
                torch.set_default_dtype(previous)
        loss_fn = nn.CrossEntropyLoss()
        for _ in range(micro):
            s = lengths[state["i"] % len(lengths)]
            state["i"] += 1
            input_ids = torch.zeros(2, s, dtype=torch.long).to("cuda")
            labels = torch.zeros(2, s, dtype=torch.long).to("cuda")
            logits = model(input_ids)
            state["logits"] = None                              # the previous step's, replaced
            logits = logits[..., :-1, :].contiguous().transpose(1, 2)
            loss = loss_fn(logits, labels[..., 1:].contiguous()) / 64
            loss.backward()
            state["logits"] = logits                            # referenced until the next forward
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def traced(case: str, layers: int, lengths: list[int], micro: int, steps: int, template: bool = True) -> Any:
    """trainmem's trace of the replica on an emulated RTX 4090 (AdamW over ``model.parameters()``,
    recipe L306)."""
    from trainmem.trace import trace
    return trace(lambda: build(case, layers), loop(case, lengths, micro, template), steps=steps,
                 optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01),
                 gpu="rtx-4090")


def estimated(case: str, layers: int | None = None) -> Any:
    """trainmem's estimate of the fixture's own setup."""
    import trainmem
    root = Path(__file__).resolve().parents[1]
    fx = json.loads((root / f"validation/published/torchtune_tut_llama2_7b_lora_{case}.json").read_text())
    setup = dict(fx["setup"])
    if layers is not None:
        setup["overrides"] = [f"num_hidden_layers={layers}"]
    return trainmem.estimate(fx["model"], **setup), fx["measured"][0]["bytes"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument("--micro", type=int, default=300, help="micro-batches of varying length (10 per step)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the varying lengths")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    varying = [rng.randint(64, 512) for _ in range(args.micro)]
    print(f"{'case':8s} {'published':>10s} {'estimate':>10s} {'trace 2x512':>12s} {'trace varying':>14s}  (GB reserved)")
    for case in args.case or ["qv_r8", "all_r64"]:
        t0 = time.perf_counter()
        est, published = estimated(case)
        fixed = traced(case, 32, [512], 3, 2)
        vary = traced(case, 32, varying, 10, max(1, args.micro // 10))
        print(f"{case:8s} {published / 1e9:10.2f} {est.peak_reserved / 1e9:10.2f} {fixed.peak_reserved / 1e9:12.2f} "
              f"{vary.peak_reserved / 1e9:14.2f}  ({time.perf_counter() - t0:.0f} s; allocated peak: estimate "
              f"{est.peak_allocated / 1e9:.2f}, trace {fixed.peak_allocated / 1e9:.2f})")


if __name__ == "__main__":
    main()
