"""``--method zero-calc``: the ZeRO planning calculator of the Medium article by @maxshapp,
"Understanding and Estimating GPU Memory Demands for Training LLMs in practise"
(https://medium.com/@maxshapp/understanding-and-estimating-gpu-memory-demands-for-training-llms-in-practise-c5ef20a4baff;
read here in a Chinese repost with a worked LLaMA-2-70B case).

* Model states, with p the bytes of a 16-bit (2) or fp32 (4) parameter and P parameters:
  (p + p + 12)·P for stage 0 (weights, gradients, fp32 master + Adam moments); ZeRO over N
  GPUs: stage 1 2pP + 12P/N, stage 2 pP + (p + 12)P/N, stage 3 (2p + 12)P/N. With the
  optimizer offloaded (ZeRO-Offload) the 12 bytes per parameter leave the GPU.
* Activations (after Korthikanti et al. 2023, written with the precision p):
  L·p·s·b·h·(16 + 2/p + 2as/h + as/(p·h)) bytes; for p = 2 this is sbhL(34 + 5as/h).
* Activation checkpointing is modelled, as the article's function does, by taking the square
  root of the activation figure *in GB*: bytes = sqrt(GB)·1e9. It is a quirk (the result
  depends on the unit; the article motivates it by Chen et al.'s sqrt(n) checkpointing) kept
  because it is this method's published rule.

The article calls XLM-RoBERTa-XL "a 10B model" and plans with model_size = 10, but XLM-R XL
(36 layers, hidden 2560, vocab 250,880) has about 3.48e9 parameters; the 10.7B model is
XLM-R XXL. :func:`gpu_memory_required_gb` therefore takes the model size explicitly, and
:func:`estimate` uses the ModelSpec's exact count.
"""
from __future__ import annotations

import math
from fractions import Fraction

from ...report import Component
from ..common import simple_report
from ._shared import ceil_bytes

METHOD = "zero-calc"
GB = 10**9


def precision_bytes(training) -> int:
    """p: 4 for fp32 training, 2 for fp16/bf16 (mixed or pure). @maxshapp's article."""
    return 4 if training.precision == "fp32" else 2


def model_state_parts(num_params: int, num_gpus: int, p: int = 2, stage: int = 0,
                      offload: bool = False) -> dict[str, int]:
    """Bytes of weights (p·P), gradients (p·P) and optimizer states (12·P, fp32) on one GPU.

    ZeRO stage 1 divides the optimizer states by the GPU count, stage 2 also the gradients,
    stage 3 also the weights; ``offload`` removes the optimizer states from the GPU.
    Source: @maxshapp's article, ``gpu_memory_required`` and the LLaMA-2-70B ZeRO-2-offload case.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    P, n = num_params, num_gpus
    return {
        "weights": ceil_bytes(Fraction(p * P, n if stage >= 3 else 1)),
        "gradients": ceil_bytes(Fraction(p * P, n if stage >= 2 else 1)),
        "optimizer_states": 0 if offload else ceil_bytes(Fraction(12 * P, n if stage >= 1 else 1)),
    }


def model_state_bytes(num_params: int, num_gpus: int, p: int = 2, stage: int = 0, offload: bool = False) -> int:
    """Total model-state bytes per GPU, (p + p + 12)·P split by ZeRO stage. @maxshapp's article."""
    return sum(model_state_parts(num_params, num_gpus, p, stage, offload).values())


def activation_bytes(num_layers: int, seq_len: int, batch_size: int, hidden: int, heads: int, p: int = 2) -> int:
    """L·p·s·b·h·(16 + 2/p + 2as/h + as/(p·h)) bytes of activations, exact.

    Counts per layer 16p·sbh of p-byte tensors, 2sbh of 1-byte dropout masks, 2p·as²b for
    the attention scores and softmax output and as²b for the attention dropout mask; written
    as L·(sbh(16p + 2) + (2p + 1)·a·s²·b) so it stays an integer. Source: @maxshapp's article.
    """
    sbh = seq_len * batch_size * hidden
    return num_layers * (sbh * (16 * p + 2) + (2 * p + 1) * heads * seq_len * seq_len * batch_size)


def checkpointed_activation_bytes(activation_bytes_: int) -> int:
    """The article's checkpointing rule: sqrt(activations in GB), back in bytes (sqrt(GB)·1e9)."""
    return round(math.sqrt(activation_bytes_ / GB) * GB)


def gpu_memory_required_gb(model_size: float, num_gpus: int, num_layers: int, seq_len: int, batch_size: int,
                           hidden: int, heads: int, precision: int = 2, activations_checkpoint: bool = False,
                           stage: int = 0, offload: bool = False) -> float:
    """The article's planning figure in GB for a model of ``model_size`` billion parameters.

    Model states (p + p + 12)·model_size GB split by ZeRO stage, plus the activations in GB
    rounded to 2 decimals as the article rounds them, square-rooted when checkpointing. Source:
    @maxshapp's article, ``gpu_memory_required`` (``offload`` added: the 12 bytes leave the GPU).
    """
    p = precision
    opt = 0 if offload else 12
    states = {0: (2 * p + opt) * model_size,
              1: 2 * p * model_size + opt * model_size / num_gpus,
              2: p * model_size + (p + opt) * model_size / num_gpus,
              3: (2 * p + opt) * model_size / num_gpus}[stage]
    act = round(activation_bytes(num_layers, seq_len, batch_size, hidden, heads, p) / GB, 2)
    if activations_checkpoint:
        act = act ** 0.5
    return states + act


def estimate(model, training):
    """@maxshapp's estimate of one GPU's memory: ZeRO-split model states plus activations.

    Counts p-byte weights and gradients and 12-byte fp32 optimizer states per parameter
    (P = ``model.num_params``, N = ``training.shard_group``, stage = ``training.zero_stage``,
    offload = ``training.offload_optimizer``), and p-byte activations
    (:func:`activation_bytes`, every head counted as a full head, no GQA), square-rooted in GB
    when ``training.recompute`` is not "none". Source: @maxshapp's article.
    """
    p = precision_bytes(training)
    ms = model_state_parts(model.num_params, training.shard_group, p, training.zero_stage,
                           training.offload_optimizer)
    act = activation_bytes(model.num_layers, training.seq_len, training.batch_size, model.hidden_size,
                           model.num_heads, p)
    warnings: list[str] = []
    formula = "L·p·s·b·h·(16 + 2/p + 2·a·s/h + a·s/(p·h))"
    if training.recompute != "none":
        act = checkpointed_activation_bytes(act)
        formula = "sqrt(activations in GB)·1e9 (@maxshapp's checkpointing rule)"
        warnings.append("zero-calc models activation checkpointing as the square root of the activations in GB, "
                        "a unit-dependent rule kept from @maxshapp's Medium article")
    if training.tp > 1 or training.pp > 1:
        warnings.append("zero-calc does not model tensor or pipeline parallelism; --tp/--pp are ignored")
    dt = "fp32" if p == 4 else "16-bit"
    comps = [
        Component("parameters", "parameters", ms["weights"], dt, "p·P (ZeRO-3: /N)", persistent=True),
        Component("gradients", "gradients", ms["gradients"], dt, "p·P (ZeRO-2/3: /N)", persistent=True),
        Component("optimizer_states", "optimizer_states", ms["optimizer_states"], "fp32",
                  "12·P (ZeRO-1+: /N; 0 when offloaded)", persistent=True),
        Component("activations", "activations", act, dt, formula),
    ]
    return simple_report(METHOD, model, training, comps, warnings=warnings)
