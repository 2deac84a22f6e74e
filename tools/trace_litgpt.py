"""Trace litgpt's own LoRA fine-tuning step on the emulated GPU (the numbers in
docs/validation.md, "Lightning Fabric's fp32 logits, litgpt's missing KV cache").

It needs litgpt importable (``pip install litgpt==0.5.3`` in another environment, or
``PYTHONPATH`` pointing at an unpacked wheel, or at a tree exported from the litgpt repository at a
commit: ``litgpt/model.py``, ``config.py``, ``lora.py``, an ``__init__.py`` importing ``GPT`` and
``Config``, and a ``utils.py`` holding ``find_multiple``, ``map_old_state_dict_weights`` and
``chunked_cross_entropy`` from that commit's; lit-gpt 2023's ``lit_gpt`` package renamed so); trainmem
does not depend on it. lit-gpt 2023's LoRA ``Config`` names (``r``, ``alpha``, ``to_query``, ...) are
recognised. ``--quantize nf4`` replaces every ``nn.Linear`` by trainmem's emulated bitsandbytes
``Linear4bit`` as Lightning Fabric's ``BitsandbytesPrecision`` does (``trainmem.bnb``, bitsandbytes
0.42.0's ``MatMul4Bit``, which keeps its input). The step is
``litgpt/finetune/lora.py``'s: ``logits = model(input_ids, lm_head_chunk_size=128)``, the last
chunk shifted, ``chunked_cross_entropy``, ``backward`` of the loss over the accumulation, then
``optimizer.step()`` and ``zero_grad()``. ``--cast`` emulates Lightning Fabric's
``_FabricModule.forward``, which hands the loop ``precision.convert_output(output)``: every chunk
``.to(torch.get_default_dtype())``. ``--steps 1 --grad-accum 1`` traces one iteration (lit-gpt
8641822 forces its longest sample into the first iteration only).

    python tools/trace_litgpt.py Llama-3.2-1B --batch-size 1 --seq-len 512 --lora-r 32 --cast
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help="a litgpt config name (litgpt.config.name_to_config)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--all-layers", action="store_true", help="LoRA on every linear and the head (else q and v)")
    p.add_argument("--cast", action="store_true", help="Fabric's fp32 copy of the output")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--gpu", default="a100-40gb")
    p.add_argument("--quantize", choices=("nf4",), default=None, help="Fabric's 4-bit linears (QLoRA)")
    a = p.parse_args()
    import torch
    import trainmem
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    from litgpt.utils import chunked_cross_entropy

    def factory() -> torch.nn.Module:
        old = "r" in {f.name for f in dataclasses.fields(Config)}  # lit-gpt 2023: r, alpha, to_query, ...
        pre = ("", "to_") if old else ("lora_", "lora_")
        kw = {("r" if old else "lora_r"): a.lora_r, ("alpha" if old else "lora_alpha"): 16,
              ("dropout" if old else "lora_dropout"): 0.05, f"{pre[1]}query": True, f"{pre[1]}value": True}
        if a.all_layers:
            kw.update({f"{pre[1]}{k}": True for k in ("key", "projection", "mlp", "head")})
        cfg = Config.from_name(a.name, **kw)
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # precision bf16-true: Fabric builds the model in bf16
        try:
            with torch.device("cuda"):
                model = GPT(cfg)
        finally:
            torch.set_default_dtype(before)
        model.max_seq_length = a.seq_len  # fit() sets it to the longest sample (its RoPE cache)
        mark_only_lora_as_trainable(model)
        if a.quantize:
            from trainmem.bnb import quantize_linears
            quantize_linears(model, a.quantize, "fabric", "bf16", saves_input=True, keep_compute_dtype=False)
        return model

    def optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=2e-4)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for _ in range(a.grad_accum):
            ids = torch.randint(0, 1000, (a.batch_size, a.seq_len), device="cuda")
            out = model(ids, lm_head_chunk_size=128)
            if a.cast:
                out = [c.to(torch.get_default_dtype()) for c in out]
            step.logits = out  # the loop's name, rebound before the loss (the previous output freed)
            del out
            step.logits[-1] = step.logits[-1][..., :-1, :]
            loss = chunked_cross_entropy(step.logits, ids[..., 1:])
            (loss / a.grad_accum).backward()
        optimizer.step()
        optimizer.zero_grad()

    rep = trainmem.trace(factory, step, steps=a.steps, optimizer_fn=optimizer_fn, gpu=a.gpu)
    print(json.dumps({"model": a.name, "batch_size": a.batch_size, "seq_len": a.seq_len, "cast": a.cast,
                      "peak_allocated_mib": round(rep.peak_allocated / 2**20, 1), "where": rep.peak_where}))


if __name__ == "__main__":
    main()
