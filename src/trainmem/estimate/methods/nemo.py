"""``--method nemo``: the estimate of Jianbin Chang, "GPT Training Memory Estimation - NeMo
Training Practice" (blog post, 2023,
https://shjwudp.github.io/blog/2023/gpt-training-memory-estimation-nemo-training-practice/).

The setup it models: a GPT-Next (LLaMA-like, SwiGLU) model trained in NeMo with bf16 mixed
precision, tensor parallelism ``t`` with sequence parallelism, data parallelism ``d`` and the
ZeRO-1 distributed optimizer (apex ``distributed_fused_adam``), selective activation
recomputation. Memory per GPU is static memory + activations + the cross-entropy overhead.

Where the post's prose and its table disagree, this module follows the table (it is what the
post's numbers are), and says so:

* static memory: the prose sums bf16 weights 2P/t, bf16 gradients 2P/t and sharded optimizer
  states 10P/(td) to (4 + 10/d)P/t; every row of the table instead equals (6 + 10/d)P/t, i.e.
  the gradients are held as fp32 main gradients (4P/t). We count 4P/t.
* selective-recompute activations: the prose writes sbhL(10 + 28.25/t) + ...; the table
  follows sbhL(8 + 28.25/t) + 2sbh + (3sbh + 4sbv)/t. We use 8.

Notation: s sequence length, b micro-batch, h hidden size, a heads, L layers, v vocabulary,
t = ``training.tp``, d = ``training.dp``, P = ``model.num_params``.
"""
from __future__ import annotations

from fractions import Fraction

from ...report import Component
from ..common import simple_report
from ._shared import ceil_bytes

METHOD = "nemo"
MiB = 1 << 20


# ----- static memory ---------------------------------------------------------------------
def static_memory(num_params: int, dp: int, tp: int) -> dict[str, int]:
    """Static memory of one GPU in bytes: bf16 weights, fp32 main gradients, sharded states.

    Counts: weights 2P/t (bf16), main gradients 4P/t (fp32; the post's table, not its prose),
    optimizer states (2 x 4 bytes fp32 moments + 2 bytes int16 weight remainders) P/(t d),
    sharded over the data-parallel group by the distributed optimizer. Total (6 + 10/d)P/t.
    Source: Chang's NeMo post, section 2.1 and its table in section 3.1.
    """
    per_rank = Fraction(num_params, tp)
    return {
        "weights": ceil_bytes(2 * per_rank),
        "main_grads": ceil_bytes(4 * per_rank),
        "optimizer_states": ceil_bytes(10 * per_rank / dp),
    }


def static_bytes(num_params: int, dp: int, tp: int) -> int:
    """Total static memory (6 + 10/d)·P/t in bytes (bf16 weights, fp32 grads, sharded fp32+int16 states). Chang's NeMo post."""
    return ceil_bytes(Fraction(num_params, tp) * (6 + Fraction(10, dp)))


# ----- activations -----------------------------------------------------------------------
def selective_activation_parts(s: int, b: int, h: int, L: int, v: int, tp: int) -> dict[str, int]:
    """Activations with selective recomputation under TP + SP, in bytes, split by where they live.

    Counts (mostly bf16 tensors, fp32 logits): ``layers`` sbhL(8 + 28.25/t) for the L
    transformer layers; ``outside_layers`` 2sbh + 3sbh/t for the embedding dropout mask and the
    final norm / output-layer inputs; ``logits`` 4sbv/t for the fp32 logits the loss keeps.
    Total sbhL(8 + 28.25/t) + 2sbh + (3sbh + 4sbv)/t, the expression the NeMo post's table follows
    (its prose says 10 instead of 8). Source: Chang's NeMo post, section 2.2 and table 3.1.
    """
    sbh = s * b * h
    return {
        "layers": ceil_bytes(sbh * L * (8 + Fraction(113, 4 * tp))),
        "outside_layers": ceil_bytes(2 * sbh + Fraction(3 * sbh, tp)),
        "logits": ceil_bytes(Fraction(4 * s * b * v, tp)),
    }


def selective_activation_bytes(s: int, b: int, h: int, L: int, v: int, tp: int) -> int:
    """sbhL(8 + 28.25/t) + 2sbh + (3sbh + 4sbv)/t bytes (bf16 activations, fp32 logits). NeMo post's table."""
    sbh = s * b * h
    return ceil_bytes(sbh * L * (8 + Fraction(113, 4 * tp)) + 2 * sbh + Fraction(3 * sbh + 4 * s * b * v, tp))


def full_activation_parts(s: int, b: int, h: int, a: int, L: int, v: int) -> dict[str, int]:
    """Activations without recomputation and without TP, in bytes.

    Counts per layer sbh(38.25 + 5as/h): attention 11sbh + 5as^2b (bf16 inputs of the QKV,
    QK^T, PV and output matmuls, 1-byte dropout masks, bf16 softmax output), SwiGLU MLP
    23.25sbh (ffn = 2.65625h), two norm inputs 4sbh. Outside the layers 5sbh (embedding dropout
    mask, final norm input, output-layer input) and 4sbv for the fp32 logits.
    Source: Chang's NeMo post, section 2.2 (after Korthikanti et al. 2023, with a SwiGLU MLP).
    """
    sbh = s * b * h
    return {
        "layers": ceil_bytes(L * (Fraction(153, 4) * sbh + 5 * a * s * s * b)),
        "outside_layers": 5 * sbh,
        "logits": 4 * s * b * v,
    }


def full_activation_bytes(s: int, b: int, h: int, a: int, L: int, v: int) -> int:
    """L·sbh(38.25 + 5as/h) + 5sbh + 4sbv bytes (no recomputation, t = 1). NeMo post, section 2.2."""
    return sum(full_activation_parts(s, b, h, a, L, v).values())


def cross_entropy_parts(s: int, b: int, v: int, tp: int) -> dict[str, int]:
    """Cross-entropy overhead at the end of the forward pass, in bytes.

    Counts the fp32 input of the loss, 4sbv/t, and with tensor parallelism (t > 1) a
    communication buffer 2sbv/t for the vocab-parallel loss. Total 6sbv/t when t > 1.
    Source: Chang's NeMo post, section 2.3.
    """
    out = {"input": ceil_bytes(Fraction(4 * s * b * v, tp))}
    out["tp_buffer"] = ceil_bytes(Fraction(2 * s * b * v, tp)) if tp > 1 else 0
    return out


def cross_entropy_bytes(s: int, b: int, v: int, tp: int) -> int:
    """4sbv/t (+ 2sbv/t when t > 1) bytes: fp32 loss input and the TP buffer. NeMo post, section 2.3."""
    return sum(cross_entropy_parts(s, b, v, tp).values())


# ----- distributed-optimizer buckets -------------------------------------------------------
def right_bucket_bytes(num_params: int, num_layers: int, tp: int) -> int:
    """The bucket size that fits one layer: 4·P/(L·t) bytes (one layer's fp32 elements on a rank).

    NeMo gives each transformer layer its own distributed-optimizer bucket; P/t parameters live
    on a rank, P/(Lt) per layer, 4 bytes each in the fp32 bucket. Source: Chang's NeMo post, section 3.2.
    """
    return ceil_bytes(Fraction(4 * num_params, num_layers * tp))


def bucket_padding_bytes(num_params: int, num_layers: int, tp: int, dp: int, bucket_bytes: int) -> int:
    """Static memory wasted per rank by a distributed-optimizer bucket larger than a layer.

    Mechanism: NeMo allocates one bucket per layer, and a bucket holds ``bucket_bytes / 4``
    elements whatever the layer needs. Each layer is therefore padded from P/(Lt) to
    bucket/4 elements, and every per-element buffer of the static memory is allocated at the
    padded size: bf16 weights (2 B), fp32 main gradients (4 B) and the d-sharded fp32 moments
    and int16 remainders (10/d B), so the waste is
    (6 + 10/d) · L · (bucket − 4P/(Lt)) / 4 bytes; zero when the bucket is not larger.
    With the NeMo post's gpt-1b, t=4, d=2 and a 200 MB bucket this gives 12.9 GiB of static memory,
    near the 12.5 GB the post's memory snapshot showed (its estimate without padding: 3.61).
    Source: Chang's NeMo post, section 3.2 (mechanism); the per-buffer accounting is ours.
    """
    per_layer_need = Fraction(4 * num_params, num_layers * tp)
    excess = Fraction(bucket_bytes) - per_layer_need
    if excess <= 0:
        return 0
    return ceil_bytes((6 + Fraction(10, dp)) * num_layers * excess / 4)


# ----- the method ------------------------------------------------------------------------
def estimate(model, training):
    """NeMo estimate of one GPU's memory: static + activations + cross-entropy overhead.

    Counts bf16 weights, fp32 main gradients and d-sharded optimizer states (static memory,
    (6 + 10/d)P/t), activations by ``training.recompute`` (selective: the TP/SP formula of the
    table; none: the per-layer sbh(38.25 + 5as/h) formula; full: only each layer's bf16 input
    2sbh/t, Korthikanti et al.'s full-recompute term, which the post does not give), and the
    fp32 cross-entropy input with its TP buffer. Source: Chang's NeMo post.
    """
    s, b = training.seq_len, training.batch_size
    h, a, L, v = model.hidden_size, model.num_heads, model.num_layers, model.vocab_size
    t, d = training.tp, training.dp
    P = model.num_params
    warnings: list[str] = []
    if training.precision not in ("bf16-amp", "fp16-amp", "bf16", "fp16"):
        warnings.append("nemo method models bf16 mixed precision; the fp32 setup is estimated as if it were bf16")
    if training.pp > 1:
        warnings.append("nemo method does not model pipeline parallelism (the NeMo post, section 5); --pp is ignored")

    st = static_memory(P, d, t)
    comps = [
        Component("parameters", "parameters", st["weights"], "bf16", "2·P/t", persistent=True),
        Component("gradients", "gradients", st["main_grads"], "fp32",
                  "4·P/t (fp32 main grads, as the NeMo post's table; its prose says bf16 2·P/t)", persistent=True),
        Component("optimizer_states", "optimizer_states", st["optimizer_states"], "fp32+int16",
                  "(2·4 + 2)·P/(t·d): fp32 Adam moments + int16 weight remainders, ZeRO-1 sharded",
                  persistent=True),
    ]
    if training.optimizer_bucket_mb is not None:
        bucket = int(round(training.optimizer_bucket_mb * MiB))
        right = right_bucket_bytes(P, L, t)
        waste = bucket_padding_bytes(P, L, t, d, bucket)
        if waste:
            comps.append(Component("optimizer_states.bucket_padding", "optimizer_states", waste, "mixed",
                                   "(6 + 10/d)·L·(bucket − 4P/(L·t))/4: per-layer buckets padded past the layer",
                                   persistent=True))
            warnings.append(
                f"distributed-optimizer bucket {training.optimizer_bucket_mb:g} MiB exceeds one layer's fp32 "
                f"shard 4P/(L·t) = {right / MiB:.1f} MiB; NeMo makes one bucket per layer, so "
                f"{waste / MiB:,.0f} MiB ({waste / (1 << 30):.2f} GiB) per rank is padding. "
                f"Use a bucket of at most {right / MiB:.0f} MiB.")

    if training.recompute == "selective":
        parts = selective_activation_parts(s, b, h, L, v, t)
        comps += [
            Component("activations.layers", "activations", parts["layers"], "bf16",
                      "s·b·h·L·(8 + 28.25/t) (the NeMo post's table; its prose says 10 + 28.25/t)"),
            Component("activations.outside_layers", "activations", parts["outside_layers"], "bf16",
                      "2·s·b·h + 3·s·b·h/t"),
            Component("logits.saved", "logits", parts["logits"], "fp32", "4·s·b·v/t"),
        ]
    elif training.recompute == "none":
        if t > 1:
            warnings.append("nemo method gives the no-recompute activations for t = 1 only; they are not divided by t")
        parts = full_activation_parts(s, b, h, a, L, v)
        comps += [
            Component("activations.layers", "activations", parts["layers"], "bf16",
                      "L·s·b·h·(38.25 + 5·a·s/h)"),
            Component("activations.outside_layers", "activations", parts["outside_layers"], "bf16", "5·s·b·h"),
            Component("logits.saved", "logits", parts["logits"], "fp32", "4·s·b·v"),
        ]
    else:  # full recomputation: not in the NeMo post
        warnings.append("the NeMo post gives no full-recompute formula; layers keep only their bf16 input 2·s·b·h/t "
                        "(Korthikanti et al. 2023)")
        sbh = s * b * h
        parts = selective_activation_parts(s, b, h, L, v, t)
        comps += [
            Component("activations.layers", "activations", ceil_bytes(Fraction(2 * sbh * L, t)), "bf16",
                      "2·s·b·h·L/t"),
            Component("activations.outside_layers", "activations", parts["outside_layers"], "bf16",
                      "2·s·b·h + 3·s·b·h/t"),
            Component("logits.saved", "logits", parts["logits"], "fp32", "4·s·b·v/t"),
        ]
    ce = cross_entropy_parts(s, b, v, t)
    comps.append(Component("logits.cross_entropy", "logits", ce["input"], "fp32", "4·s·b·v/t"))
    if ce["tp_buffer"]:
        comps.append(Component("communication.cross_entropy", "communication", ce["tp_buffer"], "16-bit",
                               "2·s·b·v/t (vocab-parallel loss buffer, t > 1)"))
    return simple_report(METHOD, model, training, comps, peak_phase="forward",
                         peak_where="cross-entropy at the end of the forward pass", warnings=warnings)
