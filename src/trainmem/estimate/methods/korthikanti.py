"""``--method korthikanti``: activation memory after Korthikanti et al.

V. A. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro,
"Reducing Activation Recomputation in Large Transformer Models", Proceedings of Machine
Learning and Systems 5 (MLSys 2023), arXiv:2205.05198.

Per transformer layer of a GPT-style model (GELU MLP of width 4h) with 16-bit activations and
1-byte dropout masks, the bytes kept for the backward pass are (s sequence, b micro-batch,
h hidden, a heads, t tensor-parallel size):

==========================================  =============================
no parallelism                              sbh(34 + 5as/h)
tensor parallel                             sbh(10 + 24/t + 5as/(ht))
tensor + sequence parallel                  sbh(34/t + 5as/(ht))
tensor parallel + selective recompute       sbh(10 + 24/t)
tensor + sequence parallel + selective      sbh·34/t
full recompute                              2sbh (the layer input; /t with SP)
==========================================  =============================

Outside the layers this module adds, as Jianbin Chang's NeMo training-memory post
(https://shjwudp.github.io/blog/2023/gpt-training-memory-estimation-nemo-training-practice/)
lists them after the paper: the embedding dropout mask sbh, the inputs of the final norm and
of the output layer 2sbh each (all /t under SP) and the fp32 logits 4sbv/t. With 1F1B
pipelining the first stage holds L/p layers for p micro-batches, i.e. L layers' worth, so
activations are not divided by the pipeline size.

Model states are the usual mixed-precision Adam 16 bytes per parameter (2 fp16 weights, 2 fp16
gradients, 12 fp32 master weights + Adam moments; Rajbhandari et al., ZeRO, SC 2020) divided by
t·p, with ZeRO stages sharding states / gradients / weights over the data-parallel group.
"""
from __future__ import annotations

from fractions import Fraction

from ...report import Component
from ..common import simple_report
from ._shared import ceil_bytes

METHOD = "korthikanti"


def layer_activation_bytes(s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none") -> int:
    """Bytes one transformer layer keeps for backward (16-bit activations, 1-byte masks).

    Counts the paper's per-layer activation memory for the given tensor-parallel size,
    sequence parallelism and recomputation (see the module table); 5as/h·sbh is written as
    5as²b so the result is exact. Source: Korthikanti et al. 2023, sections 4.1-4.2 and 5.
    """
    sbh = s * b * h
    attn = 5 * a * s * s * b  # softmax output, its dropout mask and dropout output
    t = tp
    if recompute == "full":
        return ceil_bytes(Fraction(2 * sbh, t)) if sequence_parallel else 2 * sbh
    if recompute == "selective":
        return ceil_bytes(Fraction(34 * sbh, t)) if sequence_parallel else ceil_bytes(10 * sbh + Fraction(24 * sbh, t))
    if sequence_parallel:
        return ceil_bytes(Fraction(34 * sbh + attn, t))
    return ceil_bytes(10 * sbh + Fraction(24 * sbh + attn, t))


def activation_bytes(s: int, b: int, h: int, a: int, L: int, tp: int = 1, sequence_parallel: bool = False,
                     recompute: str = "none") -> int:
    """L layers of :func:`layer_activation_bytes` (16-bit activations). Korthikanti et al. 2023."""
    return L * layer_activation_bytes(s, b, h, a, tp, sequence_parallel, recompute)


def outside_layer_bytes(s: int, b: int, h: int, v: int, tp: int = 1, sequence_parallel: bool = False) -> dict[str, int]:
    """Activations outside the layers, in bytes.

    Counts the embedding dropout mask sbh (1 byte per element), the 16-bit inputs of the final
    norm and of the output projection (2sbh each), divided by t under sequence parallelism, and
    the fp32 logits kept for the loss, 4sbv/t. Source: Chang's NeMo post, section 2.2, after the paper.
    """
    sbh_div = tp if sequence_parallel else 1
    return {
        "embedding_dropout": ceil_bytes(Fraction(s * b * h, sbh_div)),
        "final_inputs": ceil_bytes(Fraction(4 * s * b * h, sbh_div)),
        "logits": ceil_bytes(Fraction(4 * s * b * v, tp)),
    }


def model_state_bytes(num_params: int, training) -> dict[str, int]:
    """Weights, gradients and optimizer states of one GPU in bytes (mixed-precision Adam, 16 B/param).

    Counts 2 B fp16 weights + 2 B fp16 gradients + 12 B fp32 master weights and Adam moments
    per parameter (fp32 training: 4 + 4 + 8), divided by t·p; ZeRO-1 shards the optimizer
    states, ZeRO-2 also the gradients, ZeRO-3 also the weights over the data-parallel group;
    optimizer offload moves the states to the CPU. Source: Rajbhandari et al. 2020 (ZeRO).
    """
    half = training.precision != "fp32"
    w, g, o = (2, 2, 12) if half else (4, 4, 8)
    per_gpu = Fraction(num_params, training.tp * training.pp)
    z, n = training.zero_stage, training.shard_group
    return {
        "weights": ceil_bytes(w * per_gpu / (n if z >= 3 else 1)),
        "gradients": ceil_bytes(g * per_gpu / (n if z >= 2 else 1)),
        "optimizer_states": 0 if training.offload_optimizer else ceil_bytes(o * per_gpu / (n if z >= 1 else 1)),
    }


def estimate(model, training):
    """Korthikanti et al. activations plus 16 B/param model states for one GPU.

    Counts: model states by :func:`model_state_bytes`; per-layer activations by
    :func:`layer_activation_bytes` for ``training.tp``, ``training.sequence_parallel`` and
    ``training.recompute`` (16-bit activations) times L; the activations outside the layers and
    the fp32 logits by :func:`outside_layer_bytes`. Source: Korthikanti et al., MLSys 2023.
    """
    s, b = training.seq_len, training.batch_size
    h, a, L, v = model.hidden_size, model.num_heads, model.num_layers, model.vocab_size
    t, sp = training.tp, training.sequence_parallel
    warnings: list[str] = []
    if training.precision == "fp32":
        warnings.append("the paper's activation formulas assume 16-bit activations; fp32 would store about twice as much")
    if model.activation != "gelu" or model.ffn_size != 4 * h:
        warnings.append("the paper's per-layer formula assumes a GELU MLP of width 4h; "
                        f"{model.name} has a {model.activation} MLP of width {model.ffn_size}")
    if model.num_kv_heads != model.num_heads:
        warnings.append("the paper's formula assumes as many key/value heads as query heads (no GQA)")
    ms = model_state_bytes(model.num_params, training)
    wdt = "fp32" if training.precision == "fp32" else "fp16"
    per_layer = layer_activation_bytes(s, b, h, a, t, sp, training.recompute)
    out = outside_layer_bytes(s, b, h, v, t, sp)
    comps = [
        Component("parameters", "parameters", ms["weights"], wdt, "2·P/(t·p) (ZeRO-3: /dp)", persistent=True),
        Component("gradients", "gradients", ms["gradients"], wdt, "2·P/(t·p) (ZeRO-2/3: /dp)", persistent=True),
        Component("optimizer_states", "optimizer_states", ms["optimizer_states"], "fp32",
                  "12·P/(t·p) master weights + Adam moments (ZeRO-1+: /dp; 0 when offloaded)", persistent=True),
        Component("activations.layers", "activations", L * per_layer, "fp16",
                  _layer_formula(t, sp, training.recompute)),
        Component("activations.outside_layers", "activations", out["embedding_dropout"] + out["final_inputs"],
                  "fp16", "5·s·b·h (/t with SP)"),
        Component("logits", "logits", out["logits"], "fp32", "4·s·b·v/t"),
    ]
    return simple_report(METHOD, model, training, comps, peak_phase="backward_peak",
                         peak_where="start of the backward pass (all activations held)", warnings=warnings)


def _layer_formula(t: int, sp: bool, recompute: str) -> str:
    if recompute == "full":
        return "L·2·s·b·h" + ("/t" if sp else "")
    if recompute == "selective":
        return "L·s·b·h·34/t" if sp else "L·s·b·h·(10 + 24/t)"
    if sp:
        return "L·s·b·h·(34/t + 5·a·s/(h·t))"
    if t > 1:
        return "L·s·b·h·(10 + 24/t + 5·a·s/(h·t))"
    return "L·s·b·h·(34 + 5·a·s/h)"
