"""TRL's SFTTrainer ``loss_type="chunked_nll"`` (``--loss chunked-nll``, the default from TRL 1.7):
trace and measure run it as TRL writes it (``workload._patch_chunked_nll``); the estimate models it
(``quantities.loss_kinds._chunked_nll_bytes``), checked against trace, and refuses a derived architecture or a
4-bit head in one line; the trl preset sets it where the estimate models it and warns elsewhere. Also
the metrics of the older loss_type='nll' path (``frameworks.trl_metric_bytes``)."""
import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.spec.resolve import resolve

pytest.importorskip("transformers")
from trainmem.measure.runner import measure  # noqa: E402
from trainmem.trace import trace  # noqa: E402

GPT2 = dict(set=["n_layer=2", "n_embd=256", "n_head=4"], seq_len=256, batch_size=2)
LLAMA = ["num_hidden_layers=2"]   # Llama 3.2's 128256-token vocabulary, two layers


def test_trace_is_the_real_cpu_run(one_torch_thread):
    """The chunked loss on fake tensors is the real one on the CPU, byte for byte, phase by phase."""
    r = trace("gpt2", device="cpu", loss="chunked-nll", **GPT2)
    m = measure("gpt2", device="cpu", loss="chunked-nll", **GPT2)
    assert [(p.name, p.step, p.allocated, p.peak) for p in r.phases] == \
        [(p.name, p.step, p.allocated, p.peak) for p in m.phases]


def _forward_peak(loss, batch):
    r = trace("llama-3.2-1b", device="cuda", set=LLAMA, loss=loss, batch_size=batch, seq_len=512,
              precision="bf16-amp", lora_rank=8, recompute="full")
    return r.phase("forward", 1).peak


def test_no_logits_tensor_of_the_micro_batch():
    """Two more sequences of 512 tokens grow the chunked loss's forward peak by less than their half
    logits (the chunks' logits do not grow with the batch); the upcast loss by more than their fp32
    logits."""
    vocab, tokens = 128256, 2 * 512
    chunked = _forward_peak("chunked-nll", 4) - _forward_peak("chunked-nll", 2)
    upcast = _forward_peak("upcast", 4) - _forward_peak("upcast", 2)
    assert chunked < tokens * vocab * 2 < tokens * vocab * 4 < upcast


@pytest.mark.parametrize("precision", ["bf16-amp", "bf16", "fp32"])
@pytest.mark.parametrize("batch, seq", [(2, 512), (1, 300), (1, 100)])
def test_estimate_agrees_with_trace_over_a_frozen_head(precision, batch, seq):
    """A LoRA run's chunked loss: the head weight's copy per chunk (half under autocast, fp32 in pure
    bf16, none in fp32), the chunk's four logits-sized tensors, the gathered hidden states; one chunk
    (100 tokens) or several, the last one partial."""
    kw = dict(set=LLAMA, batch_size=batch, seq_len=seq, precision=precision, lora_rank=8, recompute="full",
              use_cache=False, loss="chunked-nll")
    e, t = trainmem.estimate("llama-3.2-1b", **kw), trace("llama-3.2-1b", device="cuda", **kw)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.003)
    est = {(p.name, p.step): p for p in e.phases}
    for p in t.phases:
        assert est[(p.name, p.step)].peak == pytest.approx(p.peak, rel=0.003), (p.name, p.step)


@pytest.mark.parametrize("precision", ["bf16-amp", "bf16", "fp32"])
@pytest.mark.parametrize("model, batch, seq", [("llama-3.1-8b", 2, 512), ("llama-3.1-8b", 1, 100),
                                               ("llama-3.2-1b", 1, 300)])
def test_estimate_agrees_with_trace_over_a_trained_head(model, precision, batch, seq):
    """Full fine-tuning: the head weight's gradient per chunk, cast to the weight's dtype and summed
    out of place in autograd's input buffer (several chunks) or not (one); an untied head (Llama 3.1)
    and a tied one (Llama 3.2, whose buffer waits for the embedding's gradient)."""
    kw = dict(set=LLAMA, batch_size=batch, seq_len=seq, precision=precision, recompute="full", use_cache=False,
              loss="chunked-nll")
    e, t = trainmem.estimate(model, **kw), trace(model, device="cuda", **kw)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.003)
    est = {(p.name, p.step): p for p in e.phases}
    for p in t.phases:
        if p.name in ("forward", "backward"):
            assert est[(p.name, p.step)].peak == pytest.approx(p.peak, rel=0.003), (p.name, p.step)


def test_estimate_refuses_what_it_does_not_model_in_one_line():
    for model, options in (("gemma-2-2b", {}), ("llama-3.2-1b", dict(lora_rank=8, quantize="nf4",
                                                                       quantize_via="fabric"))):
        with pytest.raises(TrainmemError) as e:
            trainmem.estimate(model, loss="chunked-nll", seq_len=512, **options)
        assert "\n" not in str(e.value) and "--loss chunked-nll" in str(e.value) and "trace" in str(e.value)
    with pytest.raises(TrainmemError) as e:
        resolve("bert-base-uncased", loss="chunked-nll")
    assert "causal LMs" in str(e.value)


def test_the_trl_preset_sets_it_where_the_estimate_models_it():
    for options in ({}, dict(lora_rank=16), dict(lora_rank=16, quantize="nf4")):
        t = resolve("llama-3.2-1b", framework="trl", **options).training
        assert t.loss == "chunked-nll" and t.extra["framework_warnings"] == (), options
    assert resolve("llama-3.2-1b", framework="trl", framework_version="1.6").training.loss is None
    derived = resolve("gemma-2-2b", framework="trl").training    # the model's own loss, an upper bound, warned
    assert derived.loss is None
    assert any("chunked_nll" in w and "trace --loss chunked-nll" in w for w in derived.extra["framework_warnings"])


TINY = ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
        "intermediate_size=128", "vocab_size=1000", "head_dim=16"]


@pytest.mark.parametrize("wrap", [dict(dp=2), dict(dp=2, fsdp="full"), dict(dp=2, fsdp="full", fsdp_version=1)],
                         ids=["ddp", "fsdp2", "fsdp1"])
def test_it_runs_inside_the_data_parallel_wrappers(wrap):
    """TRL patches the model's forward, so DDP's and FSDP's hooks (FSDP's root unshard of the head
    and embeddings) run around it: the traced step runs and differs from the upcast loss's."""
    runs = {loss: trace("llama-3.2-1b", set=TINY, batch_size=2, seq_len=64, precision="bf16-amp", loss=loss, **wrap)
            for loss in ("upcast", "chunked-nll")}
    assert runs["chunked-nll"].peak_allocated != runs["upcast"].peak_allocated


# ----- the metrics of a loss_type='nll' run (TRL 0.15 to 1.6) -----------------------------------------------
def _entropy_from_logits(logits, chunk_size=128):
    """trl v1.9.0 trl/trainer/utils.py L526-560, as written there."""
    import torch
    import torch.nn.functional as F
    original_shape = logits.shape[:-1]
    num_classes = logits.shape[-1]
    flat_logits = logits.reshape(-1, num_classes)
    entropies = []
    for chunk in flat_logits.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        chunk_entropy = -(torch.exp(logps) * logps).sum(-1)
        entropies.append(chunk_entropy)
    entropies = torch.cat(entropies, dim=0)
    return entropies.reshape(original_shape)


@pytest.mark.parametrize("b, s, vocab", [(2, 300, 1000), (1, 300, 1000), (4, 513, 3000)])
def test_the_metrics_warning_is_what_trls_metric_code_holds(b, s, vocab):
    """SFTTrainer.compute_loss's nll-path metrics (trl v1.9.0 sft_trainer.py L1762-1797, the shifted view,
    entropy, argmax), run for real on the CPU over held fp32 logits: their peak is the warning's
    figure (trl_metric_bytes) within the small per-token tensors."""
    import torch
    from trainmem.measure.live import LiveBytes
    from trainmem.spec.frameworks import trl_metric_bytes
    labels = torch.randint(0, vocab, (b, s))
    with LiveBytes() as lb:
        logits = torch.randn(b, s, vocab)        # outputs.logits, fp32 (accelerate's convert_outputs_to_fp32)
        with torch.no_grad():
            shift_logits, shift_labels = logits[..., :-1, :], labels[..., 1:]
            per_token_entropy = _entropy_from_logits(shift_logits)
            predictions = shift_logits.argmax(dim=-1)
            mask = shift_labels != -100
            entropy_sum = (per_token_entropy * mask).sum()
            correct = ((predictions == shift_labels) & mask).sum()
        del logits, per_token_entropy, predictions, mask, entropy_sum, correct
    expected = trl_metric_bytes(b, s, vocab, 4, (1, 6))
    assert expected <= lb.peak <= expected * 1.02


def test_the_metrics_warning_names_the_nll_runs_only():
    def warned(**options):
        return [w for w in resolve("llama-3.2-1b", framework="trl", **options).training.extra["framework_warnings"]
                if "accuracy" in w]
    assert warned(framework_version="1.6") and warned(loss="upcast") and warned(framework_version="0.15")
    assert not warned() and not warned(framework_version="0.14") and not warned(framework_version="1.6", loss="half")


@pytest.mark.parametrize("setup", [dict(dp=2, fsdp="full"), dict(dp=2, fsdp="full", lora_rank=8), dict(grad_accum=2)],
                         ids=["fsdp2", "fsdp2-lora", "accumulation"])
def test_estimate_agrees_with_trace_sharded_and_accumulating(setup):
    """Under FSDP2 the root's head is unsharded while TRL's loss runs (its copies and gradient are
    whole); with accumulation the step holds the first micro-batch's gradients through the second."""
    kw = dict(set=LLAMA, batch_size=2, seq_len=512, recompute="full", loss="chunked-nll", **setup)
    e, t = trainmem.estimate("llama-3.1-8b", **kw), trace("llama-3.1-8b", device="cuda", **kw)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.003)
