"""``--method rees``: "Transformer Memory Arithmetic: Understanding all the Bytes in nanoGPT"
(Edward Rees, 2023, https://erees.dev/transformer-memory/).

The setup it models: nanoGPT (GPT-2) trained on one GPU with automatic mixed precision
(fp32 weights, 16-bit matmuls under autocast) and Adam(W). Allocated memory (not reserved):

* steady state 16N + 4N_buf: fp32 weights 4N, fp32 registered buffers 4N_buf (nanoGPT's
  per-layer causal masks), fp32 gradients 4N, fp32 Adam moments 8N; plus the int64 inputs
  and targets 2·b·s·8 and two cuBLAS workspaces of 8,519,680 bytes (one per handle: forward
  and backward run on different threads), as Rees's table counts them;
* activations L(36N_e + 6N_a) + 6N_e + 6N_l, with N_e = b·s·h, N_a = b·a·s², N_l = b·s·v.
  Attention 14N_e + 6N_a: fp32 layer-norm input 4N_e, 16-bit QKV input 2N_e, Q and K 4N_e,
  fp32 softmax output 4N_a, 16-bit probabilities and V 2N_a + 2N_e, output-projection input
  2N_e. MLP 22N_e: fp32 layer-norm input 4N_e, fc1 input 2N_e, the 4x-wide GELU input 8N_e
  and fc2 input 8N_e. Outside the layers the fp32 final-norm input 4N_e and the head input
  2N_e; the 16-bit logits 2N_l and an fp32 copy 4N_l kept by the loss;
* peak = steady state + activations + 4N_l (the fp32 gradient of the logits at the start of
  the backward pass).

Rees writes "GB" for the activation (17.429) and peak (21.648) figures; both reproduce in
GiB (2**30 bytes), not in decimal GB.
"""
from __future__ import annotations

from ...report import Component, Phase
from ..common import simple_report
from ._shared import CUBLAS_WORKSPACE_BYTES

METHOD = "rees"


def steady_state_parts(num_params: int, num_buffer_elements: int, batch_size: int, seq_len: int) -> dict[str, int]:
    """Steady-state allocated bytes (AMP Adam, one GPU), by component.

    Counts fp32 weights 4N, fp32 buffers 4N_buf, fp32 gradients 4N, fp32 Adam moments 8N,
    int64 inputs and targets 2·b·s·8, and two cuBLAS workspaces (8,519,680 B each).
    Source: Rees, "Weights, gradients and states" and its table.
    """
    return {
        "weights": 4 * num_params,
        "buffers": 4 * num_buffer_elements,
        "gradients": 4 * num_params,
        "adam_moments": 8 * num_params,
        "inputs": 2 * batch_size * seq_len * 8,
        "cublas_workspaces": 2 * CUBLAS_WORKSPACE_BYTES,
    }


def activation_parts(batch_size: int, seq_len: int, hidden: int, heads: int, layers: int, vocab: int) -> dict[str, int]:
    """Activation bytes after the forward pass, by where they live.

    Counts per layer 36N_e + 6N_a (attention 14N_e + 6N_a, MLP 22N_e; fp32 layer-norm inputs
    and softmax output, 16-bit matmul inputs), 6N_e outside the layers (fp32 final norm input,
    16-bit head input) and 6N_l for the logits (16-bit logits and the loss's fp32 copy).
    Source: Rees, "Peak memory usage".
    """
    ne = batch_size * seq_len * hidden
    na = batch_size * heads * seq_len * seq_len
    nl = batch_size * seq_len * vocab
    return {"layers": layers * (36 * ne + 6 * na), "outside_layers": 6 * ne, "logits": 6 * nl}


def backward_extra_bytes(batch_size: int, seq_len: int, vocab: int) -> int:
    """4N_l: the fp32 logits gradient allocated at the start of the backward pass. Rees."""
    return 4 * batch_size * seq_len * vocab


def estimate(model, training):
    """Rees's estimate of allocated memory: steady state, activations and the backward peak.

    Counts :func:`steady_state_parts` (N = ``model.num_params``, N_buf = elements of
    ``model.buffer_tensors()`` at 4 bytes each, as Rees's 4N_buf), :func:`activation_parts`
    and :func:`backward_extra_bytes`; peak = their sum. Phases of step 2 (steady state): after
    forward and during backward. Source: Rees.
    """
    b, s = training.batch_size, training.seq_len
    n_buf = sum(_numel(t.shape) for t in model.buffer_tensors())
    st = steady_state_parts(model.num_params, n_buf, b, s)
    act = activation_parts(b, s, model.hidden_size, model.num_heads, model.num_layers, model.vocab_size)
    extra = backward_extra_bytes(b, s, model.vocab_size)
    warnings: list[str] = []
    if not training.amp:
        warnings.append(f"rees method models automatic mixed precision (fp32 weights, 16-bit matmuls); "
                        f"precision {training.precision} is estimated as if it were AMP")
    if training.optimizer not in ("adam", "adamw"):
        warnings.append(f"rees method models Adam(W); optimizer {training.optimizer} is counted as Adam (8N states)")
    if training.world_size > 1 or training.recompute != "none":
        warnings.append("rees method models one GPU without parallelism or recomputation; those settings are ignored")
    comps = [
        Component("parameters", "parameters", st["weights"], "fp32", "4·N", persistent=True),
        Component("buffers", "buffers", st["buffers"], "fp32", "4·N_buf", persistent=True),
        Component("gradients", "gradients", st["gradients"], "fp32", "4·N", persistent=True),
        Component("optimizer_states", "optimizer_states", st["adam_moments"], "fp32", "8·N (Adam moments)",
                  persistent=True),
        Component("inputs", "inputs", st["inputs"], "int64", "2·b·s·8 (inputs and targets)"),
        Component("workspace.cublas", "workspace", st["cublas_workspaces"], "uint8",
                  "2 · 8,519,680 (one cuBLAS handle each for forward and backward)", persistent=True),
        Component("activations.layers", "activations", act["layers"], "fp32/16-bit", "L·(36·N_e + 6·N_a)"),
        Component("activations.outside_layers", "activations", act["outside_layers"], "fp32/16-bit", "6·N_e"),
        Component("logits", "logits", act["logits"], "16-bit+fp32", "6·N_l"),
        Component("temporaries.logits_grad", "temporaries", extra, "fp32", "4·N_l (start of backward)"),
    ]
    steady = sum(st.values())
    after_forward = steady + sum(act.values())
    peak = after_forward + extra
    phases = [
        Phase("forward", 2, after_forward, after_forward),
        Phase("backward", 2, steady, peak, where="start of the backward pass (logits gradient)"),
    ]
    return simple_report(METHOD, model, training, comps, peak_allocated=peak, phases=phases,
                         peak_phase="backward", peak_where="start of the backward pass", warnings=warnings)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
