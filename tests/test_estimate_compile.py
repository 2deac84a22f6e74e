"""``estimate --compile`` against ``trace --compile`` (AOTAutograd's joint graph, partitioned by
inductor's min-cut partitioner and run op by op, ``trainmem.trace.compiled``).

* A layer's saved tensors: the bytes one more layer adds to what the partitioned forward graph
  saves for the backward (a middle layer: the model with three layers less the model with two)
  equal the compiled recipe's bytes per token (``layers._llama_layer_compiled``,
  ``layers._gpt2_layer_compiled``) times the tokens.
* The loss: the partition saves the half logits and 16 bytes per token (``quantities.
  _compiled_loss_bytes``), read off the same graph.
* The step's peak: estimate --compile within 2% of trace --compile on the setups the recipes were
  read from (before this change: +26% to +46% on the same setups)."""

import pytest
import torch

import trainmem
import trainmem.trace.compiled as compiled
from trainmem.estimate.layers import layer_coefficients
from trainmem.estimate.quantities.model_facts import layer_key
from trainmem.spec.resolve import resolve
from trainmem.trace.api import trace
from compile_graphs import saved_bases


class _Catch:
    """The CompiledModel each trace builds (its partitioned graphs)."""

    def __init__(self, monkeypatch):
        self.models = []
        orig = compiled.CompiledModel.__init__

        def init(model, module, tracker, fuse=True):
            orig(model, module, tracker, fuse)
            self.models.append(model)
        monkeypatch.setattr(compiled.CompiledModel, "__init__", init)

    def forward(self):
        return next(gm for k, gm in self.models[-1].graphs if k == "forward")


def _saved(fw: torch.fx.GraphModule, user_outputs: int) -> list[tuple[torch.fx.Node, torch.Tensor]]:
    """``saved_bases`` less autocast's casts of the weights (counted by the estimate apart, ``cast_layer``)."""
    found = []
    for base, v in saved_bases(fw, user_outputs):
        src = base.args[0] if base.args else None
        if isinstance(src, torch.fx.Node) and src.op == "placeholder" and src.meta["val"].is_floating_point() \
                and "convert_element_type" in str(base.target):
            continue   # autocast's half copy of a weight
        found.append((base, v))
    return found


def _saved_bytes(fw, user_outputs):
    return sum(v.untyped_storage().nbytes() for _, v in _saved(fw, user_outputs))


LAYERS = {"llama-3.2-1b": "num_hidden_layers", "gpt2": "n_layer"}


@pytest.mark.parametrize("model,precision", [("llama-3.2-1b", "bf16-amp"), ("llama-3.2-1b", "bf16"),
                                             ("gpt2", "bf16-amp"), ("gpt2", "bf16")])
def test_a_layer_saves_what_the_partition_saves(monkeypatch, model, precision):
    """One middle layer's saved bytes in the partitioned forward (three layers less two) equal
    the compiled recipe's per-token bytes times the tokens, exactly."""
    catch = _Catch(monkeypatch)
    b, s = 2, 128
    got = []
    for n_layers in (2, 3):
        trace(model, set=[f"{LAYERS[model]}={n_layers}"], compile=True, batch_size=b, seq_len=s,
              precision=precision, steps=1)
        got.append(_saved_bytes(catch.forward(), user_outputs=2 + 2 * n_layers))  # loss, logits, K and V
    r = resolve(model, batch_size=b, seq_len=s, precision=precision, compile=True)
    m, t = r.model, r.training
    coefs = layer_coefficients(layer_key(m, t))
    assert coefs.sq == 0
    # + the SDPA kernel's RNG seed and offset (uint64 (2,) and (), 24 bytes), not modelled
    assert 0 <= got[1] - got[0] - coefs.tok * b * s <= 24


def test_the_loss_saves_the_logits_and_16_bytes_per_token(monkeypatch):
    """What the partition saves outside the layers for the loss: the half logits (returned too)
    and, per token, the fp32 max and log-sum-exp and the int64 padded labels
    (``_compiled_loss_bytes``: saved_tok 16)."""
    from trainmem.estimate.quantities.loss import loss_bytes
    from trainmem.estimate.quantities.loss_kinds import LossBytes
    from trainmem.estimate.layers import Policy
    catch = _Catch(monkeypatch)
    b, s = 2, 128
    trace("llama-3.2-1b", set=["num_hidden_layers=2"], compile=True, batch_size=b, seq_len=s,
          precision="bf16-amp", steps=1)
    fw = catch.forward()
    tagged = [(n, v) for n, v in _saved(fw, 2 + 2 * 2)
              if not (n.meta.get("custom") or {}).get(compiled._MODULE, "")]  # the loss: no module
    r = resolve("llama-3.2-1b", batch_size=b, seq_len=s, precision="bf16-amp", compile=True)
    m, t = r.model, r.training
    lb: LossBytes = loss_bytes(m, t, Policy.of("bf16-amp"))
    per_token = sum(v.untyped_storage().nbytes() for _, v in tagged if v.numel() >= b * s)
    assert per_token == lb.saved_tok * b * s + 2 * 8  # + the padding column of the labels (one per sample)
    logits = [v for n, v in _saved(fw, 1) if v.numel() == b * s * m.vocab_size]
    assert logits and logits[0].dtype == torch.bfloat16 and lb.saved == 2  # half logits, saved (hold_output loss)


SETUPS = [("llama-3.2-1b", 4, 2048, "bf16-amp"), ("llama-3.2-1b", 4, 2048, "bf16"),
          ("gpt2", 8, 1024, "bf16-amp"), ("gpt2", 8, 1024, "bf16")]


@pytest.mark.parametrize("model,b,s,precision", SETUPS)
def test_estimate_compile_within_2_percent_of_trace(model, b, s, precision):
    """The step's peak (two steps, AdamW, SDPA, two layers): estimate --compile within 2% of
    trace --compile (measured -1.2%..+0.7%; before the compiled loss and layers +26%..+46%)."""
    kw = dict(set=[f"{LAYERS[model]}=2"], batch_size=b, seq_len=s, precision=precision, compile=True)
    e, t = trainmem.estimate(model, **kw), trace(model, **kw)
    assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.02


def test_estimate_compile_small_setup_within_2_percent():
    """A fast case of the above: llama, two layers, 2 x 512, bf16-amp."""
    kw = dict(set=["num_hidden_layers=2", "vocab_size=32000"], batch_size=2, seq_len=512, precision="bf16-amp",
              compile=True)
    e, t = trainmem.estimate("llama-3.2-1b", **kw), trace("llama-3.2-1b", **kw)
    assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.02


@pytest.mark.parametrize("options,warned", [
    (dict(), False),
    (dict(attention="eager"), True),      # hand-written attention: the eager layers
    (dict(lora_rank=8), True),            # LoRA: not read off a partition
])
def test_the_warning_names_layers_without_a_compiled_recipe(options, warned):
    """``estimate --compile`` warns exactly where its layers keep the eager step's saved tensors."""
    from trainmem.estimate.engine import COMPILE_WARNING
    r = trainmem.estimate("llama-3.2-1b", batch_size=1, seq_len=512, precision="bf16-amp", compile=True, **options)
    assert (COMPILE_WARNING in r.warnings) == warned


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp"])
def test_tied_embedding_backward_under_compile(precision):
    """A tied embedding's compiled backward (``quantities.head_grads.compiled_tied_grads``: the head's part and
    two fp32 tables of the embedding's, summed in the graph): llama-3.2-1b with two layers, where
    the backward's peak is that moment; the backward phase's peak within 2% of trace --compile
    (the eager quantities: bf16 -20%, bf16-amp +14%)."""
    kw = dict(set=["num_hidden_layers=2"], batch_size=2, seq_len=1024, precision=precision, compile=True)
    e, t = trainmem.estimate("llama-3.2-1b", **kw), trace("llama-3.2-1b", **kw)
    pe, pt = ({(p.name, p.step): p.peak for p in r.phases} for r in (e, t))
    assert abs(pe[("backward", 2)] / pt[("backward", 2)] - 1) < 0.02
