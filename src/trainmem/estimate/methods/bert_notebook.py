"""``--method bert-notebook``: the per-tensor, per-phase accounting of Moritz Scherrmann's
notebook "Understand GPU Memory Usage when Training Language Models"
(https://moritzscherrmann.com/blog/2024/GPU-Memory_BERT/), a Jupyter notebook that fine-tunes
BERT-large for sequence classification in fp32 with AdamW, batch 4, sequence 512.

The notebook predicts ``torch.cuda.memory_allocated()`` after every phase of two training
iterations and the peak. Its parts:

* weights W: every parameter tensor as the CUDA caching allocator stores it. Blocks are
  rounded up to 512 bytes; a request above 10 MiB gets its own segment rounded up to 2 MiB,
  and the block is not split when the rest of the segment is 1 MiB or less, so the tensor
  holds the whole segment (BERT-large's 30522 x 1024 fp32 word embedding: 119.23 MiB asked,
  120.00 MiB allocated);
* gradients = W; Adam moments = 2W, created by the first ``optimizer.step()``;
* forward tensors F kept for the backward pass, listed one by one (inputs, embedding sum /
  layer norm / dropout, per layer Q, K, V, scores, probabilities, probability dropout,
  context, projections, layer norms with their per-token statistics, GELU, dropouts; pooler;
  classifier); dropout tensors count 1 byte per element (boolean masks), all others the
  element size;
* one cuBLAS workspace (4096·1024·2 + 16·1024·8 bytes) appears in the first forward, a second
  one (the autograd thread's handle) in the first backward;
* the peak comes during the backward of the last encoder layer of step 2, with the weights,
  the Adam moments, F, both workspaces and a temporary term the notebook fitted from the
  profiler: b·s·i·e + i·h·e + 2·b·s·i + h·h·e − b·s·h (i intermediate size, e element size).

Two notebook assumptions are kept: the inputs are counted at the element size (3·b·s values)
and the classifier output has one value per sample (the notebook's "dimension 1"), although
BertForSequenceClassification with two labels emits b·2 logits (a 16-byte difference here).
"""
from __future__ import annotations

from ...allocator_rules import block_bytes
from ...report import Component, Phase
from ..common import simple_report
from ._shared import CUBLAS_WORKSPACE_BYTES

METHOD = "bert-notebook"

MiB = 1 << 20

#: Adam-like moment tensors per weight, by optimizer.
_MOMENTS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1, "lion": 1}


def allocator_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator books for one tensor of ``nbytes`` (allocated, not reserved).

    Counts the request rounded up to 512 bytes; for requests above 10 MiB, which get a fresh
    segment rounded up to 2 MiB, the whole segment when the remainder after the block would be
    1 MiB or less (the allocator does not split it off): ``allocator_rules.block_bytes``, PyTorch's
    CUDACachingAllocator rules, as Scherrmann's notebook observed them (119.23 MiB embedding ->
    120.00 MiB).
    """
    return block_bytes(nbytes)


def weight_bytes(model, bytes_per_element: int = 4) -> int:
    """Allocated bytes of all parameter tensors, each rounded by :func:`allocator_block_bytes`.

    Counts every trainable tensor of ``model`` once (tied ones once) at ``bytes_per_element``.
    Source: Scherrmann's notebook, "Estimating GPU Memory Usage for Model Weights".
    """
    return sum(allocator_block_bytes(t.numel * bytes_per_element) for t in model.parameter_tensors())


def forward_tensors(model, batch_size: int, seq_len: int, element_size: int = 4,
                    hidden_dropout: bool = True, attention_dropout: bool = True) -> list[tuple[str, int, int]]:
    """The tensors the forward pass keeps for backward: (name, elements, bytes).

    Counts, for a BERT encoder with a sequence-classification head: 3·b·s inputs; embedding
    sum, layer norm and its two per-token statistics, dropout; per layer Q, K, V (b·s·h each),
    attention scores, probabilities and probability dropout (a·b·s² each), context, attention
    output dense, its layer norm (+ 2·b·s statistics) and dropout, intermediate dense and GELU
    (b·s·i each), output dense, layer norm (+ statistics) and dropout; pooler dense and tanh,
    classifier dropout (b·h), targets and classifier output (b each). Dropout tensors are
    boolean masks, 1 byte per element; the rest take ``element_size`` bytes. Dropouts whose
    probability is zero (or that are disabled) keep no mask and are left out.
    Source: Scherrmann's notebook, ``getNumElementsPerFfwTensor`` / ``getExpectedMemoryPerFfwTensor``.
    """
    b, s = batch_size, seq_len
    h, i, a, L = model.hidden_size, model.ffn_size, model.num_heads, model.num_layers
    bs, bsh, bsi, abss = b * s, b * s * h, b * s * i, a * b * s * s
    out: list[tuple[str, int, int]] = []

    def add(name: str, numel: int, dropout: bool = False) -> None:
        if dropout:
            out.append((name, numel, numel))
        else:
            out.append((name, numel, numel * element_size))

    add("inputs", 3 * bs)
    add("embeddings.sum", bsh)
    add("embeddings.layer_norm.mean", bs)
    add("embeddings.layer_norm.rstd", bs)
    add("embeddings.layer_norm", bsh)
    if hidden_dropout:
        add("embeddings.dropout", bsh, dropout=True)
    for layer in range(L):
        p = f"layer.{layer}."
        add(p + "attention.query", bsh)
        add(p + "attention.key", bsh)
        add(p + "attention.value", bsh)
        add(p + "attention.scores", abss)
        add(p + "attention.probs", abss)
        if attention_dropout:
            add(p + "attention.probs_dropout", abss, dropout=True)
        add(p + "attention.context", bsh)
        add(p + "attention.output_dense", bsh)
        add(p + "attention.layer_norm.mean", bs)
        add(p + "attention.layer_norm.rstd", bs)
        add(p + "attention.layer_norm", bsh)
        if hidden_dropout:
            add(p + "attention.dropout", bsh, dropout=True)
        add(p + "mlp.intermediate_dense", bsi)
        add(p + "mlp.gelu", bsi)
        add(p + "mlp.output_dense", bsh)
        add(p + "mlp.layer_norm.mean", bs)
        add(p + "mlp.layer_norm.rstd", bs)
        add(p + "mlp.layer_norm", bsh)
        if hidden_dropout:
            add(p + "mlp.dropout", bsh, dropout=True)
    add("pooler.dense", b * h)
    add("pooler.tanh", b * h)
    if hidden_dropout:
        add("classifier.dropout", b * h, dropout=True)
    add("targets", b)
    add("classifier", b)
    return out


def forward_tensor_bytes(model, batch_size: int, seq_len: int, element_size: int = 4,
                         hidden_dropout: bool = True, attention_dropout: bool = True) -> int:
    """Sum of :func:`forward_tensors` bytes (element-size tensors, 1-byte dropout masks)."""
    return sum(n for _, _, n in forward_tensors(model, batch_size, seq_len, element_size,
                                                hidden_dropout, attention_dropout))


def temp_gradient_bytes(batch_size: int, seq_len: int, hidden: int, intermediate: int, element_size: int = 4) -> int:
    """The notebook's temporary memory at the backward peak (last encoder layer), in bytes.

    Counts b·s·i·e + i·h·e + 2·b·s·i + h·h·e − b·s·h bytes: a b·s·i activation gradient, the
    i x h and h x h weight gradients being formed, 2 more bytes per b·s·i element, less b·s·h
    bytes already released. The notebook's author fitted these terms with the profiler.
    Source: Scherrmann's notebook, ``getTempGradientCalculationMemory``.
    """
    b, s, h, i, e = batch_size, seq_len, hidden, intermediate, element_size
    return b * s * i * e + i * h * e + 2 * b * s * i + h * h * e - b * s * h


def _warnings(model, training) -> list[str]:
    """What the notebook's accounting does not model for this run, one sentence each."""
    warnings: list[str] = []
    if training.precision != "fp32":
        warnings.append("the bert-notebook method was validated in fp32 only; 16-bit runs keep a mix of dtypes")
    if training.optimizer not in _MOMENTS:
        warnings.append(f"bert-notebook counts Adam's two moments; optimizer {training.optimizer} is counted alike")
    if model.family not in ("bert", "roberta-prenorm") or model.head != "seq-cls":
        warnings.append(f"bert-notebook lists the forward tensors of a BERT encoder with a classification head; "
                        f"{model.name} ({model.family}, {model.head}) is estimated as if it were one")
    if training.world_size > 1 or training.recompute != "none" or training.grad_accum > 1:
        warnings.append("bert-notebook models one GPU, no recomputation, no gradient accumulation; "
                        "those settings are ignored")
    return warnings


def _phases(W: int, F: int, ws: int, temp: int, k: int) -> list[Phase]:
    """model_loaded, then forward / backward / optimizer_step / zero_grad of steps 1 and 2."""
    phases: list[Phase] = [Phase("model_loaded", 1, W, W)]
    moments = 0  # Adam's moments appear in the first optimizer step
    for step in (1, 2):
        fwd = W + moments + F + (1 if step == 1 else 2) * ws  # the backward handle's workspace comes in step 1's backward
        phases.append(Phase("forward", step, fwd, fwd))
        bwd = W + moments + W + 2 * ws  # F released, gradients W held
        bwd_peak = W + moments + F + 2 * ws + temp
        phases.append(Phase("backward", step, bwd, max(bwd_peak, bwd), where="backward of the last encoder layer"))
        moments = k * W
        opt = W + moments + W + 2 * ws
        phases.append(Phase("optimizer_step", step, opt, opt))
        zg = W + moments + 2 * ws  # gradients released (set to None)
        phases.append(Phase("zero_grad", step, zg, opt))
    return phases


def _components(tensors: list[tuple[str, int, int]], W: int, k: int, ws: int, temp: int,
                wb: int, e: int) -> list[Component]:
    """The components alive at the peak: weights, moments, forward tensors by group, workspaces, temp."""
    groups: dict[str, int] = {}
    for name, _, n in tensors:
        key = "inputs" if name in ("inputs", "targets") else \
            "activations.layers" if name.startswith("layer.") else \
            "activations.embeddings" if name.startswith("embeddings.") else "activations.head"
        groups[key] = groups.get(key, 0) + n
    wdt = "fp32" if wb == 4 else "16-bit"
    edt = "fp32" if e == 4 else "16-bit"
    return [
        Component("parameters", "parameters", W, wdt, "Σ allocator_block(numel·bytes) over weights", persistent=True),
        Component("optimizer_states", "optimizer_states", k * W, wdt, f"{k} × weights (Adam moments)",
                  persistent=True),
        Component("inputs", "inputs", groups.get("inputs", 0), f"{e}-byte",
                  "3·b·s inputs + b targets, counted at the element size as the notebook does"),
        Component("activations.embeddings", "activations", groups.get("activations.embeddings", 0), edt,
                  "embedding sum, layer norm (+ statistics), dropout mask (1 B)"),
        Component("activations.layers", "activations", groups.get("activations.layers", 0), edt,
                  "per layer: Q, K, V, scores, probs, probs-dropout (1 B), context, dense, norms, GELU, dropouts"),
        Component("activations.head", "activations", groups.get("activations.head", 0), edt,
                  "pooler dense + tanh, classifier dropout (1 B), classifier output"),
        Component("workspace.cublas", "workspace", 2 * ws, "uint8", "2 × (4096·1024·2 + 16·1024·8)",
                  persistent=True),
        Component("temporaries.gradient_calculation", "temporaries", temp, edt,
                  "b·s·i·e + i·h·e + 2·b·s·i + h·h·e − b·s·h"),
    ]


def estimate(model, training):
    """The notebook's per-phase prediction of allocated memory for two training iterations.

    Counts weights W (:func:`weight_bytes`, allocator-rounded), gradients W, optimizer
    moments k·W (Adam k = 2), forward tensors F (:func:`forward_tensors`), one cuBLAS
    workspace per handle (forward, then backward) and the temporary gradient term
    (:func:`temp_gradient_bytes`). Phases (allocated at the end, peak within): model_loaded W;
    forward(1) W + F + ws; backward(1) 2W + 2ws, peak W + F + 2ws + temp; optimizer_step(1)
    (2 + k)W + 2ws; zero_grad(1) (1 + k)W + 2ws; step 2 alike with the moments already
    there; the overall peak (1 + k)W + F + 2ws + temp in backward(2). Element size 4 in fp32,
    2 otherwise. Source: the notebook.
    """
    b, s = training.batch_size, training.seq_len
    wb = training.weight_bytes
    e = 4 if training.precision == "fp32" else 2
    k = _MOMENTS.get(training.optimizer, 2)
    warnings = _warnings(model, training)
    hd = training.dropout and model.hidden_dropout > 0
    ad = training.dropout and model.attention_dropout > 0

    W = weight_bytes(model, wb)
    tensors = forward_tensors(model, b, s, e, hd, ad)
    F = sum(n for _, _, n in tensors)
    ws = CUBLAS_WORKSPACE_BYTES
    temp = temp_gradient_bytes(b, s, model.hidden_size, model.ffn_size, e)

    phases = _phases(W, F, ws, temp, k)
    peak = max(p.peak for p in phases)
    peak_step = max((p for p in phases), key=lambda p: (p.peak, p.step))
    comps = _components(tensors, W, k, ws, temp, wb, e)
    # The components are those alive at the peak (backward of the last encoder layer, the first
    # one back-propagated): no full set of parameter gradients yet, so they sum to the peak.
    report = simple_report(METHOD, model, training, comps, peak_allocated=peak, phases=phases,
                           peak_phase=peak_step.name, peak_where="backward of the last encoder layer, step 2",
                           warnings=warnings)
    report.extra["forward_tensor_bytes"] = F
    report.extra["weight_bytes"] = W
    return report
