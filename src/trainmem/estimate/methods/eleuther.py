"""``--method eleuther``: EleutherAI's "Transformer Math 101" (Q. Anthony, S. Biderman,
H. Schoelkopf, EleutherAI blog, April 2023, https://blog.eleuther.ai/transformer-math/).

Training memory = model weights + gradients + optimizer states + activations, per parameter:

* weights: 4 bytes in fp32 training, 2 bytes in 16-bit (mixed or pure) training;
* gradients: the weights' dtype, 4 or 2 bytes;
* optimizer states: AdamW 12 bytes (fp32 copy of the weights 4 + momentum 4 + variance 4),
  8-bit AdamW 6 (4 + 1 + 1), SGD with momentum 8 (4 + 4); the fp32 copy is only needed
  when the weights are not already fp32, so fp32 training keeps 8 / 2 / 4 bytes. Mixed
  precision AdamW totals 2 + 2 + 12 = 16 bytes per parameter, as does fp32 AdamW (4 + 4 + 8).
  Plain SGD, Lion (one momentum) and Adafactor (factored second moment, about nothing per
  parameter) are not in the blog's table; they are counted by the same rule and flagged.
* model states are divided by the tensor- and pipeline-parallel sizes, and ZeRO stage 1 / 2 /
  3 shards the optimizer states / + gradients / + weights over the data-parallel group;
* activations (16-bit, after Korthikanti et al. 2023): sbhL(10 + 24/t + 5as/(ht)) with no
  recomputation (sbhL(34 + 5as/h) at t = 1), sbhL(10 + 24/t) with selective recomputation,
  2sbhL with full recomputation.

Edward Rees ("Transformer Memory Arithmetic", https://erees.dev/transformer-memory/) quotes
this activation formula at 12.02 for nanoGPT GPT-2 small with b = 12, s = 1024: the value
reproduces in GiB (12,910,067,712 bytes), not in decimal GB (12.91).
"""
from __future__ import annotations

from fractions import Fraction

from ...report import Component
from ..common import simple_report
from ._shared import ceil_bytes

METHOD = "eleuther"

#: Optimizer state bytes per parameter besides the fp32 weight copy (Transformer Math 101).
_STATE_BYTES = {"adamw": 8, "adam": 8, "adamw-8bit": 2, "sgd-momentum": 4, "sgd": 0, "lion": 4, "adafactor": 0}
_IN_TABLE = ("adamw", "adam", "adamw-8bit", "sgd-momentum")


def bytes_per_param(precision: str, optimizer: str) -> dict[str, int]:
    """Bytes per parameter of weights, gradients and optimizer states, by Transformer Math 101.

    Weights and gradients: 4 (fp32) or 2 (16-bit). Optimizer: the moments (AdamW 8, 8-bit
    AdamW 2, SGD-momentum 4) plus a 4-byte fp32 weight copy when the weights are 16-bit.
    Source: EleutherAI, Transformer Math 101, "Training" section.
    """
    wb = 4 if precision == "fp32" else 2
    copy = 0 if precision == "fp32" else 4
    return {"weights": wb, "gradients": wb, "optimizer_states": state_bytes_per_param(optimizer) + copy}


def state_bytes_per_param(optimizer: str) -> int:
    """The table's bytes per parameter, or for an optimizer it has no row for, trainmem's states of
    a large fp32 tensor per element, rounded (``states.state_bytes``: Adagrad 4, AdEMAMix 12; a paged
    optimizer's large states are off the device, 0)."""
    if optimizer in _STATE_BYTES:
        return _STATE_BYTES[optimizer]
    from ..states import state_bytes
    n = 1 << 20
    return round(sum(state_bytes(optimizer, (n,), n, 4)) / n)


def activation_bytes(s: int, b: int, h: int, a: int, L: int, tp: int = 1, recompute: str = "none") -> int:
    """Activation bytes of L layers (16-bit activations, 1-byte dropout masks).

    Counts sbhL(10 + 24/t + 5as/(ht)) without recomputation, sbhL(10 + 24/t) with selective
    recomputation, 2sbhL with full recomputation (5as/h·sbh written as 5as²b, exact).
    Source: EleutherAI, Transformer Math 101, "Activations and Batch Size".
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh * L
    if recompute == "selective":
        return ceil_bytes(L * (10 * sbh + Fraction(24 * sbh, tp)))
    return ceil_bytes(L * (10 * sbh + Fraction(24 * sbh + 5 * a * s * s * b, tp)))


def model_state_bytes(num_params: int, training) -> dict[str, int]:
    """Weights, gradients and optimizer states of one GPU in bytes.

    Counts :func:`bytes_per_param` times P/(t·p), ZeRO-sharded over the data-parallel group by
    stage (1: optimizer states, 2: + gradients, 3: + weights); offloaded states leave the GPU.
    Source: EleutherAI, Transformer Math 101, "Sharded Optimizers" and "3D Parallelism".
    """
    per = bytes_per_param(training.precision, training.optimizer)
    per_gpu = Fraction(num_params, training.tp * training.pp)
    z, n = training.zero_stage, training.shard_group
    return {
        "weights": ceil_bytes(per["weights"] * per_gpu / (n if z >= 3 else 1)),
        "gradients": ceil_bytes(per["gradients"] * per_gpu / (n if z >= 2 else 1)),
        "optimizer_states": 0 if training.offload_optimizer else
        ceil_bytes(per["optimizer_states"] * per_gpu / (n if z >= 1 else 1)),
    }


def estimate(model, training):
    """Transformer Math 101 estimate of one GPU's training memory.

    Counts weights, gradients and optimizer states (:func:`model_state_bytes`, dtype by
    precision) and 16-bit activations (:func:`activation_bytes`); the total is their sum.
    Source: EleutherAI, Transformer Math 101 (2023).
    """
    s, b = training.seq_len, training.batch_size
    h, a, L = model.hidden_size, model.num_heads, model.num_layers
    warnings: list[str] = []
    if training.optimizer not in _IN_TABLE:
        warnings.append(f"Transformer Math 101 has no row for {training.optimizer}; counted "
                        f"{state_bytes_per_param(training.optimizer)} state bytes per parameter plus the fp32 copy")
    if training.sequence_parallel:
        warnings.append("Transformer Math 101 does not model sequence parallelism; activations are not divided by it")
    ms = model_state_bytes(model.num_params, training)
    wdt = "fp32" if training.precision == "fp32" else "16-bit"
    act = activation_bytes(s, b, h, a, L, training.tp, training.recompute)
    formula = {"none": "s·b·h·L·(10 + 24/t + 5·a·s/(h·t))", "selective": "s·b·h·L·(10 + 24/t)",
               "full": "2·s·b·h·L"}[training.recompute]
    comps = [
        Component("parameters", "parameters", ms["weights"], wdt, "bytes/param · P/(t·p)", persistent=True),
        Component("gradients", "gradients", ms["gradients"], wdt, "bytes/param · P/(t·p)", persistent=True),
        Component("optimizer_states", "optimizer_states", ms["optimizer_states"], "fp32",
                  f"{bytes_per_param(training.precision, training.optimizer)['optimizer_states']}·P/(t·p)",
                  persistent=True),
        Component("activations", "activations", act, "16-bit", formula),
    ]
    return simple_report(METHOD, model, training, comps, warnings=warnings)
