"""``estimate`` (formulas) against ``trace`` (the real training step on tensors without data).

    .venv/bin/python benchmarks/bench_agreement.py               # the sampled option grid (410 setups)
    .venv/bin/python benchmarks/bench_agreement.py --write       # ... and write docs/agreement.md's grid section
    .venv/bin/python benchmarks/bench_agreement.py --subset      # its 40-setup subset (the slow test)
    .venv/bin/python benchmarks/bench_agreement.py --reserved --write   # ... with peak reserved per row (~12 min)
    .venv/bin/python benchmarks/bench_agreement.py --draw 3 --write   # re-run the FSDP1 draw only, keep the rest
    .venv/bin/python benchmarks/bench_agreement.py --draw 5      # the DeepSpeed ZeRO draw only (40 setups)
    .venv/bin/python benchmarks/bench_agreement.py --classic     # six families x precision x attention x recompute (72)
    .venv/bin/python benchmarks/bench_agreement.py --quick       # the representative subset (14)
    .venv/bin/python benchmarks/bench_agreement.py --classic --family qwen2 --explain 2   # why rows differ

Sampled grid (``sampled_grid``): ten families (the six below, Mistral, and Qwen3, Gemma-2 and Phi-3,
which the estimate knows through derived coefficients), each setup drawn with ``random.Random(11)``
over the options trace runs: precision (fp32, bf16-amp, bf16, fp16-amp; bf16-mp under FSDP2),
attention (eager, sdpa, sdpa-math), recompute (none, full, op), optimizer (AdamW, Adam, SGD with and
without momentum, Adafactor; foreach, fused, for-loop), LoRA (rank 8/16/64, dropout), data and tensor
parallel layouts on a fake process group (DDP 2/4, FSDP2 full 2/4/8 and grad-op 2/4, TP 2 with and
without sequence parallelism, TP 4 + SP, TP 2 x FSDP2 2), activation offloading, the loss (the
model's, upcast, half, half in chunks, torchtune's chunked, a shifted-logits copy), the loop (output
held until the loss, backward or the next step; ``zero_grad(set_to_none=False)``; two micro-batches).
A second draw of 60 (``_extra_axes``) adds pipeline parallelism (``--pp 2``, 1F1B or GPipe, 2 to 4
micro-batches, on Llama, Llama-3.2, Qwen2 and Mistral) and the optimizers trace emulates outside
torch.optim (bitsandbytes' AdamW8bit, PagedAdamW8bit, PagedAdamW; lion-pytorch's Lion).
A third draw of 40 is FSDP1's (``_fsdp1_axes``); a fourth of 30 (``_pp_axes``) is pipelines of
4-layer Llama, Llama-3.2, Qwen2 and Mistral: interleaved 1F1B (two virtual stages per rank), 1F1B
and GPipe, alone, with DDP replicas of each stage or tensor-parallel stages. A fifth of 40
(``_zero_axes``) is DeepSpeed ZeRO 1/2/3 through DeepSpeed's own engine (dp 2/4, bf16/fp16 weights
with its fp32 master, gradient buckets from its default 5e8 down to 1e6 elements, ``overlap_comm``
and ``contiguous_gradients`` on or off): trace refuses them where DeepSpeed is not installed.
What trace refuses is steered to the nearest setup it runs (``sample_case``).

Classic grid (``grid``): six model families (2 layers each, realistic widths, full vocabularies, so the s x s
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
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

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

    @property
    def reserved_diff(self) -> float | None:
        """estimate / trace - 1 of the peak reserved (``max_memory_reserved``): the estimate's replay of
        the step through the caching allocator (``estimate/reserved/``) against trace's simulation of
        the real op stream; None where either has none (the estimate replays only with ``reserved``)."""
        return _reserved_diff(self.estimate, self.trace)


def _reserved_diff(e: Any, t: Any) -> float | None:
    a, b = getattr(e, "peak_reserved", None), getattr(t, "peak_reserved", None)
    return None if a is None or not b else a / b - 1


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


# --- the sampled option grid (issue 11: >= 200 setups over the option space trace runs) -----------

#: families of the sampled grid: the six above plus Mistral (sliding-window config, GQA) and three
#: architectures the estimate only knows through derived coefficients (spec/coefficients)
GRID_FAMILIES: dict[str, tuple[str, list[str]]] = {
    **FAMILIES,
    # Mistral-7B shape narrowed: GQA 16 / 4, untied head, vocab 32000
    "mistral": ("mistral-7b", ["num_hidden_layers=2", "hidden_size=1024", "intermediate_size=3584",
                               "num_attention_heads=16", "num_key_value_heads=4"]),
    # Qwen3-0.6B: q/k norms, GQA 16 / 8, head_dim 128, tied head, vocab 151936 (derived)
    "qwen3": ("qwen3-0.6b", ["num_hidden_layers=2"]),
    # Gemma-2-2B: soft-capped logits, sandwich norms, head_dim 256, vocab 256000 (derived)
    "gemma2": ("gemma-2-2b", ["num_hidden_layers=2"]),
    # Phi-3-mini narrowed: fused qkv_proj and gate_up_proj, vocab 32064 (derived)
    "phi3": ("phi-3-mini", ["num_hidden_layers=2", "hidden_size=1024", "intermediate_size=2816",
                            "num_attention_heads=16", "num_key_value_heads=16"]),
}
#: families whose layers have hand-written recipes (recompute op, offload); TP: torchtitan's plan
RECIPE_FAMILIES = ("gpt2", "bert", "llama", "llama-gqa", "qwen2", "mixtral", "mistral")
TP_FAMILIES = {"llama": 16, "llama-gqa": 8, "qwen2": 2, "mistral": 4}  # -> kv heads (TP degree divides it)
CAUSAL = tuple(f for f in GRID_FAMILIES if f != "bert")
LORA_TARGETS = {"phi3": ("qkv_proj", "o_proj")}  # peft has no default for phi3
GRID_SHAPES = ((1, 2048), (2, 1024), (4, 512), (8, 256), (2, 512), (1, 1024))
#: data / tensor parallel layouts (each on a fake process group; one rank traced)
LAYOUTS = (
    ("single", {}), ("ddp2", {"dp": 2}), ("ddp4", {"dp": 4}),
    ("fsdp2", {"fsdp": "full", "dp": 2}), ("fsdp4", {"fsdp": "full", "dp": 4}), ("fsdp8", {"fsdp": "full", "dp": 8}),
    ("gradop2", {"fsdp": "grad-op", "dp": 2}), ("gradop4", {"fsdp": "grad-op", "dp": 4}),
    ("tp2", {"tp": 2}), ("tp2sp", {"tp": 2, "sequence_parallel": True}),
    ("tp4sp", {"tp": 4, "sequence_parallel": True}), ("tp2xfsdp2", {"tp": 2, "fsdp": "full", "dp": 2}),
)
LAYOUT_WEIGHTS = (9, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1, 1)


@dataclass(frozen=True)
class Case:
    """One setup of the sampled grid: a family, a shape and the TrainingSpec options away from the
    defaults (sorted (name, value) pairs, so a Case is hashable and prints the same every run)."""
    family: str
    batch: int
    seq: int
    options: tuple[tuple[str, object], ...] = ()
    layers: int = 2  # decoder layers (the fourth draw's pipelines have 4: two stages of two virtual stages)

    @property
    def name(self) -> str:
        def short(k, v):
            if v is True:
                return k
            if isinstance(v, tuple):
                v = "+".join(v)
            return f"{k}={v}"
        layers = f"layers={self.layers} " if self.layers != 2 else ""
        return f"{self.family} {self.batch}x{self.seq} {layers}" + " ".join(short(k, v) for k, v in self.options)

    def specs(self):
        model, overrides = GRID_FAMILIES[self.family]
        # the families of the pipelined draw (PP_FAMILIES) all name their depth num_hidden_layers
        more = [f"num_hidden_layers={self.layers}"] if self.layers != 2 else []
        m = resolve_model(model, overrides=overrides + more)
        t = TrainingSpec(batch_size=self.batch, seq_len=self.seq, **dict(self.options))
        return m, t


#: families whose transformers body trace cuts into pipeline stages (``wrappers.PP_MODEL_TYPES``:
#: Llama, Mistral, Qwen2 causal LMs)
PP_FAMILIES = ("llama", "llama-gqa", "qwen2", "mistral")
#: bitsandbytes' 8-bit and paged optimizers and lion-pytorch's Lion (trace emulates them, ``trainmem.bnb``)
EXTERNAL_OPTIMIZERS = ("adamw-8bit", "paged-adamw-8bit", "paged-adamw", "lion")
#: setups of the second draw (``sampled_grid``): pipeline parallelism and the external optimizers
EXTRA_SETUPS, EXTRA_SEED = 60, 12
#: setups of the third draw: FSDP1 (FullyShardedDataParallel, ``--fsdp-version 1``)
FSDP1_SETUPS, FSDP1_SEED = 40, 13
FSDP1_LAYOUTS = ({"fsdp": "full", "dp": 2}, {"fsdp": "full", "dp": 4}, {"fsdp": "grad-op", "dp": 2},
                 {"fsdp": "grad-op", "dp": 4})
#: setups of the fourth draw: pipelines of 4 layers (interleaved 1F1B, 1F1B, GPipe; DDP replicas of
#: each stage, tensor-parallel stages), on PP_FAMILIES
PP_SETUPS, PP_SEED = 30, 14
#: the fourth draw's schedules and the layout around the pipeline ((name, options), weights)
PP_SCHEDULES, PP_SCHEDULE_WEIGHTS = ("interleaved-1f1b", "1f1b", "gpipe"), (5, 2, 1)
PP_LAYOUTS, PP_LAYOUT_WEIGHTS = (("alone", {}), ("ddp2", {"dp": 2}), ("ddp4", {"dp": 4}), ("tp2", {"tp": 2})), (4, 3, 1, 2)
#: setups of the fifth draw: DeepSpeed ZeRO 1/2/3 through DeepSpeed's own engine (``trace.deepspeed_engine``;
#: traced only where DeepSpeed is installed), on every family
ZERO_SETUPS, ZERO_SEED = 40, 15
#: its gradient buckets (elements): DeepSpeed's default 5e8, 5e7, and 1e7 and 1e6 (smaller than one
#: layer's gradients of most families: reduced in backward, larger parameters alone)
ZERO_BUCKETS, ZERO_BUCKET_WEIGHTS = (None, 50_000_000, 10_000_000, 1_000_000), (2, 1, 2, 2)


def _pipelined(o: dict) -> None:
    """A setup turned into one trace pipelines (``trace/distributed.py`` ``_check_pp``): two stages,
    no other layout, LoRA, chunked loss, offloading or held output; bf16-mp as bf16 autocast."""
    for k in ("dp", "tp", "fsdp", "sequence_parallel", "lora_rank", "lora_targets", "lora_dropout",
              "loss_chunks", "offload_activations"):
        o.pop(k, None)
    if o["precision"] == "bf16-mp":
        o["precision"] = "bf16-amp"
    if o.get("loss") == "chunked":
        o["loss"] = "half"
    o["hold_output"] = "loss"
    o["pp"] = 2


def _pp_axes(rng, family: str, o: dict) -> int:
    """The fourth draw's axes on top of a first-draw setup, on a 4-layer model (returned: the
    layers): ``--pp 2`` under torch's ScheduleInterleaved1F1B (two virtual stages of one layer per
    rank), Schedule1F1B or ScheduleGPipe (two layers per stage), 2, 4 or 8 micro-batches, alone,
    with DDP replicas of each stage (``--dp 2``/``4``) or, under the one-stage schedules,
    tensor-parallel stages (``--tp 2``). What trace does not pipeline (``trace/distributed.py``
    ``_check_pp``: FSDP, LoRA, a chunked loss, a held output; ``--tp`` under an interleaved
    schedule) is steered to setups it runs, as in ``_extra_axes``; the external optimizers of the
    second draw on a third of the setups without TP."""
    _pipelined(o)
    o["grad_accum"] = _pick(rng, (2, 4, 8), (3, 3, 1))
    o["pp_schedule"] = _pick(rng, PP_SCHEDULES, PP_SCHEDULE_WEIGHTS)
    _, lay = _pick(rng, PP_LAYOUTS, PP_LAYOUT_WEIGHTS)
    if "tp" in lay and (o["pp_schedule"] == "interleaved-1f1b" or TP_FAMILIES[family] % lay["tp"]):
        lay = {"dp": 2}
    o.update(lay)
    if "tp" not in o and rng.random() < 0.33:
        o["optimizer"] = _pick(rng, EXTERNAL_OPTIMIZERS, (3, 2, 1, 1))
        o.pop("optimizer_impl", None)  # one implementation each (workload.check_supported)
    if "tp" in o and o["recompute"] == "op":
        o["recompute"] = "full"
    return 4


def _fsdp1_axes(rng, o: dict, family: str = "") -> None:
    """The third draw's axes on top of a first-draw setup: the layout becomes FSDP1 (full or grad-op
    over 2 or 4 ranks; tensor parallelism dropped), LoRA adapters in units of their own or in their
    layer's (``--fsdp-lora-units``), gradients synced every micro-batch or under ``no_sync``
    (``--grad-sync step``). Steered away from what FSDP1 itself fails on (``trace/distributed.py``):
    bf16-mp with adapters in units of their own (fp32 input into bf16 weights), pure half weights
    with fp32 adapters in one flat parameter (FSDP1's uniform dtype), and BERT's adapters in units
    of their own (peft's policy splits its tied embedding from the head: ``spec.training.fsdp1_tied_split``;
    tested after the draw, so the other setups stay the ones drawn before)."""
    for k in ("tp", "sequence_parallel", "fsdp", "dp", "offload_activations"):
        o.pop(k, None)
    o.update(_pick(rng, FSDP1_LAYOUTS))
    o["fsdp_version"] = 1
    if o.get("lora_rank"):
        if o["precision"] == "bf16-mp" or rng.random() < 0.5 or family in ("bert",):
            o["fsdp_lora_units"] = "layer"
        if o.get("fsdp_lora_units") == "layer" and o["precision"] in ("bf16", "fp16"):
            o["lora_dtype"] = "half"
    if o.get("grad_accum", 1) > 1 and rng.random() < 0.5:
        o["grad_sync"] = "step"


def _zero_axes(rng, o: dict) -> None:
    """The fifth draw's axes on top of a first-draw setup: DeepSpeed ZeRO stage 1, 2 or 3 over 2 or
    4 ranks, bf16 or fp16 weights with DeepSpeed's fp32 master (its mode on the GPU), the gradient
    bucket (``ZERO_BUCKETS``), ``overlap_comm`` and ``contiguous_gradients`` on or off (DeepSpeed's
    defaults where not drawn). Steered to what trace runs through the engine
    (``trace.deepspeed_engine.check``): no FSDP, tensor parallelism or activation offloading, a
    torch.optim optimizer (Adafactor becomes AdamW), the engine's own ``zero_grad``, the loss inside
    the engine's forward (a chunked loss becomes the half one)."""
    for k in ("fsdp", "tp", "sequence_parallel", "offload_activations", "zero_grad", "loss_chunks"):
        o.pop(k, None)
    if o.get("loss") == "chunked":
        o["loss"] = "half"
    o["zero"] = _pick(rng, (1, 2, 3), (2, 3, 2))
    o["dp"] = _pick(rng, (2, 4))
    o["precision"] = _pick(rng, ("bf16", "fp16"), (3, 1))
    if o["optimizer"] == "adafactor":
        o["optimizer"] = "adamw"
        o.pop("optimizer_impl", None)
    bucket = _pick(rng, ZERO_BUCKETS, ZERO_BUCKET_WEIGHTS)
    if bucket is not None:
        o["reduce_bucket_size"] = bucket
    if rng.random() < 0.5:
        o["overlap_comm"] = o["zero"] != 3   # the other way from DeepSpeed's default (on for stage 3 only)
    if rng.random() < 0.3:
        o["contiguous_gradients"] = False


def _pick(rng, choices, weights=None):
    return rng.choices(choices, weights=weights)[0]


def _extra_axes(rng, family: str, o: dict) -> None:
    """The second draw's axes on top of a first-draw setup: pipeline parallelism (``--pp 2``, one
    stage per layer, 1F1B or GPipe, 2 to 4 micro-batches) on the families trace pipelines, else
    (and on a third of the pipelined ones) an external optimizer. What trace does not pipeline
    (``trace/distributed.py`` ``_check_pp``: other layouts, LoRA, a chunked loss, a held output)
    and bitsandbytes over DTensor shards are steered to setups it runs."""
    if family in PP_FAMILIES and rng.random() < 0.6:
        _pipelined(o)
        o["grad_accum"] = _pick(rng, (2, 3, 4))
        if rng.random() < 0.25:
            o["pp_schedule"] = "gpipe"
        if rng.random() < 0.33:
            o["optimizer"] = _pick(rng, EXTERNAL_OPTIMIZERS, (3, 2, 1, 1))
    else:
        o["optimizer"] = _pick(rng, EXTERNAL_OPTIMIZERS, (3, 2, 1, 1))
        if "fsdp" in o or "tp" in o:  # bitsandbytes takes plain tensors: DDP or one GPU instead
            for k in ("fsdp", "tp", "sequence_parallel"):
                o.pop(k, None)
            o["dp"] = _pick(rng, (1, 2))
            if o["dp"] == 1:
                del o["dp"]
            if o["precision"] == "bf16-mp":
                o["precision"] = "bf16-amp"
    if o["optimizer"] in EXTERNAL_OPTIMIZERS:
        o.pop("optimizer_impl", None)  # one implementation each (workload.check_supported)


def sample_case(rng, family: str, extra: bool | str = False) -> Case:
    """Draw one setup for ``family``: every axis on its own (``extra``: then the second draw's
    pipeline and optimizer axes, ``_extra_axes``), then the combinations trace or the spec refuses
    are steered to the nearest accepted one (TP only on torchtitan's Llama-style plan, ``bf16-mp``
    only under FSDP, ``op`` recompute and offloading only where a recipe exists ...)."""
    o: dict = {}
    b, s = _pick(rng, GRID_SHAPES)
    o["precision"] = _pick(rng, ("fp32", "bf16-amp", "bf16", "fp16-amp"), (3, 5, 3, 1))
    o["attention"] = _pick(rng, ("eager", "sdpa", "sdpa-math"), (3, 6, 1))
    o["recompute"] = _pick(rng, ("none", "full", "op"), (5, 3, 2))
    name, lay = _pick(rng, LAYOUTS, LAYOUT_WEIGHTS)
    if "tp" in lay and (family not in TP_FAMILIES or TP_FAMILIES[family] % lay["tp"]):
        name, lay = ("fsdp2", {"fsdp": "full", "dp": 2}) if rng.random() < 0.5 else ("single", {})
    o.update(lay)
    if o.get("fsdp") == "full" and rng.random() < 0.5:
        o["precision"] = "bf16-mp"  # FSDP2's MixedPrecisionPolicy(param_dtype=bf16)
    o["optimizer"] = _pick(rng, ("adamw", "adam", "sgd", "sgd-momentum", "adafactor"), (8, 1, 1, 1, 1))
    impl = _pick(rng, (None, "fused", "for-loop"), (8, 1, 1))
    if impl and o["optimizer"] != "adafactor":
        o["optimizer_impl"] = impl
    if rng.random() < 0.2 and o["recompute"] != "op":  # peft's LoRA (op recompute is full training only)
        o["lora_rank"] = _pick(rng, (8, 16, 64))
        if family in LORA_TARGETS:
            o["lora_targets"] = LORA_TARGETS[family]
        if rng.random() < 0.3:
            o["lora_dropout"] = 0.05
    if family in CAUSAL and "tp" not in o:
        loss = _pick(rng, ("model", "upcast", "half", "half-chunks", "chunked", "shift"), (10, 2, 2, 1, 2, 1))
        if loss == "upcast":
            o["loss"] = "upcast"
        elif loss == "half":
            o["loss"] = "half"
        elif loss == "half-chunks":
            o["loss"], o["loss_chunks"] = "half", 4
        elif loss == "chunked":
            o["loss"], o["loss_chunks"] = "chunked", _pick(rng, (4, 8))
        elif loss == "shift":
            o["loss"], o["loss_shift"] = "half", "logits"
    o["hold_output"] = _pick(rng, ("loss", "backward", "step"), (6, 1, 1))
    if rng.random() < 0.15:
        o["zero_grad"] = "zeros"
    if rng.random() < 0.2:
        o["grad_accum"] = 2
    layers = 2
    if extra == "fsdp1":
        _fsdp1_axes(rng, o, family)
    elif extra == "pp":
        layers = _pp_axes(rng, family, o)
    elif extra == "zero":
        _zero_axes(rng, o)
    elif extra:
        _extra_axes(rng, family, o)
    # what trace refuses (trace/distributed.py ``check``), or cannot run on meta tensors: adafactor
    # over DTensor shards, LoRA under the TP plan, a loss outside the wrapper's forward, fused SGD
    dtensor = "fsdp" in o or "tp" in o
    if dtensor and o["optimizer"] == "adafactor":
        o["optimizer"] = "adamw"
    if "tp" in o:
        for k in ("lora_rank", "lora_targets", "lora_dropout"):
            o.pop(k, None)
    if o.get("dp", 1) > 1 and (o.get("loss") == "chunked" or o.get("loss_chunks", 1) > 1):
        o.pop("loss_chunks", None)
        o["loss"] = "half"
    if o["optimizer"].startswith("sgd") and o.get("optimizer_impl") == "fused":
        del o["optimizer_impl"]  # aten::_fused_sgd_ has no meta kernel
    if family not in RECIPE_FAMILIES and o.get("loss_shift"):
        del o["loss_shift"]
    if family not in RECIPE_FAMILIES and o["recompute"] == "op":
        o["recompute"] = "full"
    if o["recompute"] == "op" and o.get("tp", 1) > 1:
        o["recompute"] = "full"
    if (o["recompute"] == "full" and family in ("llama", "llama-gqa", "qwen2", "mixtral", "mistral")
            and name == "single" and "lora_rank" not in o and "pp" not in o and rng.random() < 0.3):
        o["offload_activations"] = True
    if o["attention"] == "sdpa-math" and o["precision"] in ("fp32",):
        o["attention"] = "sdpa"
    defaults = {"precision": "bf16-amp", "attention": "sdpa", "recompute": "none", "optimizer": "adamw",
                "hold_output": "loss", "dp": 1}
    opts = tuple(sorted((k, v) for k, v in o.items() if defaults.get(k, object()) != v))
    return Case(family, b, s, opts, layers)


def sampled_grid(n: int = 240, seed: int = 11, extra: int = EXTRA_SETUPS) -> list[Case]:
    """``n`` distinct setups drawn with ``random.Random(seed)``, the families in turn (so each has
    n / len(GRID_FAMILIES) of them), then ``extra`` more drawn with ``random.Random(EXTRA_SEED)``
    with the pipeline and external-optimizer axes (``_extra_axes``; added after the first 240 were
    published, so those stay the same setups), then ``FSDP1_SETUPS`` FSDP1 setups
    (``_fsdp1_axes``, ``random.Random(FSDP1_SEED)``), then ``PP_SETUPS`` pipelines of the
    ``PP_FAMILIES`` (``_pp_axes``, ``random.Random(PP_SEED)``), then ``ZERO_SETUPS`` DeepSpeed ZeRO
    setups (``_zero_axes``, ``random.Random(ZERO_SEED)``): deterministic, the same list on every run."""
    import random
    out: list[Case] = []
    seen: set[Case] = set()
    draws = ((random.Random(seed), n, False), (random.Random(EXTRA_SEED), extra, True),
             (random.Random(FSDP1_SEED), FSDP1_SETUPS if extra else 0, "fsdp1"),
             (random.Random(PP_SEED), PP_SETUPS if extra else 0, "pp"),
             (random.Random(ZERO_SEED), ZERO_SETUPS if extra else 0, "zero"))
    for rng, count, second in draws:
        fams = list(PP_FAMILIES if second == "pp" else GRID_FAMILIES)
        i = start = len(out)
        while len(out) < start + count:
            c = sample_case(rng, fams[(i - start) % len(fams)], extra=second)
            if c not in seen:
                seen.add(c)
                out.append(c)
                i += 1
    return out


def grid_subset(n: int = 40, pipelines: int = 6) -> list[Case]:
    """Every k-th setup of the first two draws, ``n`` of them (the slow test's deterministic subset,
    which predates the FSDP1 draw), and every k-th of the fourth draw's pipelines, ``pipelines`` of
    them (interleaved 1F1B and DDP replicas of stages)."""
    g = sampled_grid()[:240 + EXTRA_SETUPS]
    pp = draw_cases(4)
    return g[::len(g) // n][:n] + pp[::len(pp) // pipelines][:pipelines]


def compare(setup: Setup, reserved: bool = False) -> Row:
    """Estimate and trace of one setup; ``reserved``: the estimate also replays the step through the
    caching allocator (``estimate(..., reserved=True)``) for its peak reserved (``Row.reserved_diff``)."""
    from trainmem.trace.api import trace
    m, t = setup.specs()
    t0 = time.perf_counter()
    tr = trace(m, training=t)
    seconds = time.perf_counter() - t0
    est = estimate(m, t, reserved=reserved)
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


def grid_stats(rows: list[Row]) -> dict:
    """The sampled grid's summary: |estimate / trace - 1| of the peak, median, p90, max, and how
    many setups are within 0.5% and 2%."""
    d = sorted(abs(r.diff) for r in rows)
    worst = max(rows, key=lambda r: abs(r.diff))
    return {"setups": len(rows), "median": statistics.median(d), "p90": d[min(len(d) - 1, int(0.9 * len(d)))],
            "max": d[-1], "worst": worst.setup.name, "within_0.5%": sum(x <= 0.005 for x in d),
            "within_2%": sum(x <= 0.02 for x in d)}


def reserved_stats(rows: list) -> dict | None:
    """The grid's summary of peak reserved (``Row.reserved_diff``, |estimate / trace - 1|) over the rows
    that have it: median, p90, max, and how many setups are within 1% and 5%; None if none has it."""
    d = sorted((abs(_reserved_diff(r.estimate, r.trace)), r.setup.name) for r in rows
               if _reserved_diff(r.estimate, r.trace) is not None)
    if not d:
        return None
    x = [v for v, _ in d]
    return {"setups": len(x), "median": statistics.median(x), "p90": x[min(len(x) - 1, int(0.9 * len(x)))],
            "max": x[-1], "worst": d[-1][1], "within_1%": sum(v <= 0.01 for v in x),
            "within_5%": sum(v <= 0.05 for v in x)}


def replay_excess(e: Any) -> float | None:
    """How far the estimate's allocator replay's own allocated peak (``extra["replay_peak_allocated"]``)
    exceeds the estimate's allocated peak (replay / estimate - 1). The estimate's peak reserved is its
    allocated peak plus the replay's gap (reserved minus that replay peak), so a replay that holds
    blocks the step does not (a positive excess) shrinks the gap: the reserved difference of such a
    row lies in those blocks, not in the allocator's placement."""
    x = (getattr(e, "extra", None) or {}).get("replay_peak_allocated")
    return None if not x or not e.peak_allocated else x / e.peak_allocated - 1


def _reserved_cols(r: Any) -> str:
    """The row's peak reserved, estimate and trace (MiB), their difference and the replay's excess
    (``replay_excess``); '' without it."""
    d = _reserved_diff(r.estimate, r.trace)
    if d is None:
        return ""
    x = replay_excess(r.estimate)
    return (f"  reserved {100 * d:+7.2f}%  {r.estimate.peak_reserved / MiB:9.1f} "
            f"{r.trace.peak_reserved / MiB:9.1f}" + ("" if x is None else f"  replay {100 * x:+6.2f}%"))


def print_grid(rows: list[Row], refused: list[tuple[Case, str]], out=sys.stdout) -> dict:
    """One line per setup (the estimate's and the trace's peak and where each is; with their peak
    reserved where the rows have it, ``--reserved``), then the summary (and reserved's)."""
    for r in rows:
        print(f"{100 * r.diff:+7.2f}%  {r.estimate.peak_allocated / MiB:9.1f} {r.trace.peak_allocated / MiB:9.1f}  "
              f"{r.setup.name}  [{r.estimate.peak_where}]{_reserved_cols(r)}", file=out)
    for c, why in refused:
        print(f"refused  {c.name}: {why}", file=out)
    st = grid_stats(rows)
    print(f"{st['setups']} setups ({len(refused)} refused): |peak difference| median {100 * st['median']:.2f}%, "
          f"p90 {100 * st['p90']:.2f}%, max {100 * st['max']:.2f}% ({st['worst']}); within 0.5%: "
          f"{st['within_0.5%']}, within 2%: {st['within_2%']}", file=out)
    rs = reserved_stats(rows)
    if rs:
        print(f"peak reserved, {rs['setups']} setups: |difference| median {100 * rs['median']:.2f}%, p90 "
              f"{100 * rs['p90']:.2f}%, max {100 * rs['max']:.2f}% ({rs['worst']}); within 1%: {rs['within_1%']}, "
              f"within 5%: {rs['within_5%']}", file=out)
    return st


def grid_markdown(rows: list[Row], st: dict, top: int = 30) -> str:
    """The grid section of docs/agreement.md: the summary and the largest disagreements."""
    lines = [f"{st['setups']} setups: median |peak diff| {100 * st['median']:.2f}%, p90 {100 * st['p90']:.2f}%, "
             f"max {100 * st['max']:.2f}%; within 0.5%: {st['within_0.5%']}, within 2%: {st['within_2%']}. "
             "Every row: `docs/agreement_grid.json`.", "",
             f"The {top} largest differences:", "",
             "| setup | estimate MiB | trace MiB | diff | estimate's peak |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -abs(r.diff))[:top]:
        lines.append(f"| {r.setup.name} | {r.estimate.peak_allocated / MiB:.1f} | {r.trace.peak_allocated / MiB:.1f} "
                     f"| {100 * r.diff:+.2f}% | {r.estimate.peak_where} |")
    return "\n".join(lines) + "\n"


GRID_BEGIN, GRID_END = "<!-- sampled-grid:begin -->", "<!-- sampled-grid:end -->"
RESERVED_BEGIN, RESERVED_END = "<!-- reserved-grid:begin -->", "<!-- reserved-grid:end -->"


def layout_class(c: Case) -> str:
    """A setup's layout, as the reserved summary groups rows: DeepSpeed ZeRO, FSDP1, FSDP2, a pipeline,
    tensor parallelism, DDP or one GPU (the first that applies), and whether the family's layers are
    derived (``estimate/derived.py``: Qwen3, Gemma-2, Phi-3)."""
    o = dict(c.options)
    kind = ("DeepSpeed ZeRO" if "zero" in o else "FSDP1" if o.get("fsdp_version") == 1 else "FSDP2" if "fsdp" in o
            else "pipeline" if "pp" in o else "TP" if "tp" in o else "DDP" if o.get("dp", 1) > 1 else "one GPU")
    return kind + (", derived layers" if c.family not in RECIPE_FAMILIES else "")


def _reserved_by_layout(have: list) -> list[str]:
    """Table rows: per ``layout_class``, the setups, median and max |peak reserved diff|, within 5%."""
    groups: dict[str, list[float]] = {}
    for r in have:
        groups.setdefault(layout_class(r.setup), []).append(abs(_reserved_diff(r.estimate, r.trace)))
    return [f"| {k} | {len(v)} | {100 * statistics.median(v):.2f}% | {100 * max(v):.2f}% | {sum(x <= 0.05 for x in v)} |"
            for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def reserved_markdown(rows: list, rs: dict, top: int = 30) -> str:
    """The reserved section of docs/agreement.md: the summary of peak reserved over the rows run with
    ``--reserved``, by layout (``layout_class``), and their largest disagreements."""
    lines = [f"{rs['setups']} setups run with `--reserved`: median |peak reserved diff| {100 * rs['median']:.2f}%, "
             f"p90 {100 * rs['p90']:.2f}%, max {100 * rs['max']:.2f}%; within 1%: {rs['within_1%']}, within 5%: "
             f"{rs['within_5%']}. Every row: `docs/agreement_grid.json` (`estimate_reserved`, `trace_reserved`).", "",
             "| layout | setups | median | max | within 5% |", "|---|---|---|---|---|"]
    have = [r for r in rows if _reserved_diff(r.estimate, r.trace) is not None]
    lines += _reserved_by_layout(have) + ["", f"The {top} largest differences of peak reserved:", "",
              "| setup | estimate MiB | trace MiB | diff | allocated diff | replay's allocated peak over the estimate's |",
              "|---|---|---|---|---|---|"]
    for r in sorted(have, key=lambda r: -abs(_reserved_diff(r.estimate, r.trace)))[:top]:
        x = _stored_excess(r)
        lines.append(f"| {r.setup.name} | {r.estimate.peak_reserved / MiB:.1f} | {r.trace.peak_reserved / MiB:.1f} "
                     f"| {100 * _reserved_diff(r.estimate, r.trace):+.2f}% | {100 * r.diff:+.2f}% | "
                     + ("-" if x is None else f"{100 * x:+.2f}%") + " |")
    return "\n".join(lines) + "\n"


def _stored_excess(r: Any) -> float | None:
    """``replay_excess`` of a fresh row, or the one a stored row kept."""
    x = replay_excess(r.estimate)
    return getattr(r.estimate, "replay_excess", None) if x is None else x


def _between(text: str, begin: str, end: str, body: str) -> str:
    a, b = text.index(begin) + len(begin), text.index(end)
    return text[:a] + "\n" + body + text[b:]


def _json_row(r: Any) -> dict:
    """One row of docs/agreement_grid.json; the reserved keys only where the row has them."""
    out = {"family": r.setup.family, "batch": r.setup.batch, "seq": r.setup.seq,
           **({"layers": r.setup.layers} if r.setup.layers != 2 else {}),
           "options": {k: list(v) if isinstance(v, tuple) else v for k, v in r.setup.options},
           "estimate": r.estimate.peak_allocated, "trace": r.trace.peak_allocated, "diff": round(r.diff, 6),
           "estimate_at": r.estimate.peak_where, "trace_at": r.trace.peak_where}
    d = _reserved_diff(r.estimate, r.trace)
    if d is not None:
        out.update(estimate_reserved=r.estimate.peak_reserved, trace_reserved=r.trace.peak_reserved,
                   reserved_diff=round(d, 6))
        x = _stored_excess(r)
        if x is not None:
            out["replay_excess"] = round(x, 6)
    return out


def write_doc(rows: list[Row], st: dict, doc: Path, js: Path) -> None:
    """Replace the text between the grid markers of ``doc`` (and the reserved markers, where rows have
    peak reserved) and write every row to ``js`` (the reserved summary as ``reserved_summary``)."""
    text = _between(doc.read_text(), GRID_BEGIN, GRID_END, grid_markdown(rows, st))
    rs = reserved_stats(rows)
    if rs:
        text = _between(text, RESERVED_BEGIN, RESERVED_END, reserved_markdown(rows, rs))
    doc.write_text(text)
    js.write_text(json.dumps({"summary": st, **({"reserved_summary": rs} if rs else {}),
                              "rows": [_json_row(r) for r in rows]}, indent=1) + "\n")


def draw_cases(draw: int, n: int = 240) -> list[Case]:
    """The sampled grid's ``draw``-th draw: 1, the first ``n``; 2, the pipeline and external-optimizer
    setups after them; 3, the FSDP1 setups; 4, the 4-layer pipelines; 5, DeepSpeed ZeRO's."""
    g = sampled_grid(n)
    third = n + EXTRA_SETUPS + FSDP1_SETUPS
    fourth = third + PP_SETUPS
    return {1: g[:n], 2: g[n:n + EXTRA_SETUPS], 3: g[n + EXTRA_SETUPS:third], 4: g[third:fourth],
            5: g[fourth:]}[draw]


@dataclass
class StoredRow:
    """A row of docs/agreement_grid.json kept as it was (``--draw N --write`` re-runs one draw):
    its setup, both peaks and where each is, as ``grid_markdown`` and ``write_doc`` read a Row."""
    setup: Case
    estimate: Any
    trace: Any
    diff: float


def stored_rows(js: Path) -> dict[str, StoredRow]:
    """The rows of ``js`` by setup name."""
    from types import SimpleNamespace
    out = {}
    for r in json.loads(js.read_text())["rows"]:
        opts = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in r["options"].items()))
        case = Case(r["family"], r["batch"], r["seq"], opts, r.get("layers", 2))
        out[case.name] = StoredRow(case, SimpleNamespace(peak_allocated=r["estimate"], peak_where=r["estimate_at"],
                                                         peak_reserved=r.get("estimate_reserved"),
                                                         replay_excess=r.get("replay_excess")),
                                   SimpleNamespace(peak_allocated=r["trace"], peak_where=r["trace_at"],
                                                   peak_reserved=r.get("trace_reserved")), r["diff"])
    return out


def merged_rows(rows: list, js: Path, n: int = 240) -> list:
    """The whole grid's rows in grid order: ``rows`` where re-run, else the stored one (if any)."""
    fresh, stored = {r.setup.name: r for r in rows}, stored_rows(js)
    return [fresh.get(c.name) or stored[c.name] for c in sampled_grid(n) if c.name in fresh or c.name in stored]


def run_grid(cases: list[Case], reserved: bool = False) -> tuple[list[Row], list[tuple[Case, str]]]:
    """Compare every case (``reserved``: with peak reserved); the ones the spec or trace refuses are
    returned apart (with the reason)."""
    from trainmem.errors import TrainmemError
    rows, refused = [], []
    for c in cases:
        try:
            rows.append(compare(c, reserved))
        except TrainmemError as e:
            refused.append((c, str(e)))
    return rows, refused


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the representative subset the fast test runs")
    ap.add_argument("--classic", action="store_true",
                    help="the 72-setup grid of six families x precision x attention x recompute")
    ap.add_argument("--subset", action="store_true", help="the sampled grid's 40-setup subset (the slow test's)")
    ap.add_argument("-n", type=int, default=240, help="setups of the sampled grid's first draw (default 240; "
                    "the 60 of the second draw follow)")
    ap.add_argument("--draw", type=int, choices=(1, 2, 3, 4, 5), help="only the sampled grid's Nth draw (3: the 40 "
                    "FSDP1 setups; 4: the 30 pipelines of 4 layers; 5: the 40 DeepSpeed ZeRO setups, which need "
                    "DeepSpeed installed); with --write the other rows are kept as "
                    "docs/agreement_grid.json has them")
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    ap.add_argument("--explain", type=int, default=0, metavar="N", help="break down the N largest disagreements")
    ap.add_argument("--keep-logits", action="store_true",
                    help="the loop keeps the model output (outputs = model(...)) until the next step")
    ap.add_argument("--reserved", action="store_true",
                    help="also compare peak reserved (the estimate's allocator replay, estimate/reserved/, against "
                    "trace's simulated allocator): printed per row, summarised, and with --write kept in "
                    "docs/agreement_grid.json (estimate_reserved, trace_reserved, reserved_diff)")
    ap.add_argument("--write", action="store_true",
                    help="write the sampled grid's summary to docs/agreement.md and its rows to docs/agreement_grid.json")
    a = ap.parse_args(argv)
    if a.write and "TRAINMEM_CACHE" not in os.environ:
        # derived models' coefficients fitted now, by this code: a user cache holds sets an earlier
        # version fitted under the same COEF_VERSION (float noise, or a change that did not bump it), and
        # the stored rows must be what a fresh installation estimates (the 2026-11-26 grid's Qwen3 ZeRO-2
        # row read -0.06 % from an older cache, +22.91 % fresh, before 68d86750)
        os.environ["TRAINMEM_CACHE"] = tempfile.mkdtemp(prefix="trainmem-grid-")
    t0 = time.perf_counter()
    if a.quick or a.classic:
        setups = list(QUICK) if a.quick else grid()
        if a.keep_logits:
            setups = [replace(s, keep_logits=True) for s in setups]
        if a.family:
            setups = [s for s in setups if s.family in a.family]
        rows = [compare(s) for s in setups]
        print_table(rows)
    else:
        cases = grid_subset() if a.subset else draw_cases(a.draw, a.n) if a.draw else sampled_grid(a.n)
        if a.family:
            cases = [c for c in cases if c.family in a.family]
        rows, refused = run_grid(cases, a.reserved)
        st = print_grid(rows, refused)
        if a.write:
            root = Path(__file__).resolve().parents[1]
            js = root / "docs" / "agreement_grid.json"
            part = a.draw or a.subset or a.family   # a part re-run: the other rows kept as stored
            every = merged_rows(rows, js, a.n) if part else rows
            write_doc(every, grid_stats(every) if part else st, root / "docs" / "agreement.md", js)
            if part:
                print(f"written with the other draws' stored rows: {len(every)} setups")
    print(f"{len(rows)} traces in {time.perf_counter() - t0:.1f} s "
          f"(trace median {statistics.median(r.seconds for r in rows):.2f} s)")
    for r in sorted(rows, key=lambda r: -abs(r.diff))[:a.explain]:
        explain(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
