"""``--torch-version``: an older PyTorch's defaults, what its autograd saves, and what it lacks
(``trainmem.spec.releases``)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.spec.resolve import resolve
from trainmem.validate import validate

ROOT = Path(__file__).resolve().parents[1]
BERT = dict(set=['architectures=["BertForSequenceClassification"]'], batch_size=8, seq_len=512, precision="fp32",
            optimizer="adamw", attention="eager")


def test_release_defaults_apply_to_what_is_not_given():
    """Before 2.0: zero_grad keeps zeroed gradients, Adam(W) loops over parameters, no SDPA; an
    explicit option wins; a framework's own explicit choice (nanoGPT's set_to_none=True) stays."""
    t = resolve("gpt2", torch_version="1.13").training
    assert (t.zero_grad, t.optimizer_impl, t.attention) == ("zeros", "for-loop", "eager")
    t = resolve("gpt2", torch_version="1.13", zero_grad="none", optimizer_impl="foreach").training
    assert (t.zero_grad, t.optimizer_impl) == ("none", "foreach")
    t = resolve("gpt2", torch_version="2.1").training
    assert (t.zero_grad, t.attention) == ("none", "sdpa")
    nano = resolve("gpt2", framework="nanogpt", torch_version="1.13").training
    assert (nano.zero_grad, nano.optimizer_impl, nano.attention) == ("none", "for-loop", "eager")
    hf = resolve("gpt2", framework="hf-trainer", framework_version="4.31", torch_version="1.13").training
    assert hf.zero_grad == "zeros"
    assert resolve("gpt2", torch_version="1.8").training.precision == "fp16-amp"
    r = resolve("gpt2", torch_version="1.10")
    assert r.replace(batch_size=4).training.zero_grad == "zeros"
    assert r.replace(zero_grad=None).training.zero_grad == "zeros"


@pytest.mark.parametrize("options, named", [
    (dict(torch_version="1.10", attention="sdpa"), "--attention sdpa"),
    (dict(torch_version="1.13", compile=True), "--compile"),
    (dict(torch_version="1.12", optimizer_impl="fused"), "--optimizer-impl fused"),
    (dict(torch_version="2.0", optimizer_in_backward=True), "--optimizer-in-backward"),
    (dict(torch_version="1.9", precision="bf16-amp"), "--precision bf16-amp"),
    (dict(torch_version="1.10", fsdp="full", dp=2), "--fsdp full"),
    (dict(torch_version="2.2", fsdp="full", dp=2, fsdp_version=2), "--fsdp-version 2"),
    (dict(torch_version="1.5"), "1.6 and later"),
    (dict(torch_version="two"), "not a PyTorch release"),
    (dict(torch_version="1.13", framework="torchtune"), "runs on PyTorch 2.0 or newer"),
])
def test_what_a_release_lacks_is_refused(options, named):
    with pytest.raises(TrainmemError, match=named.replace("+", r"\+")):
        resolve("gpt2", **options)


def test_fsdp_is_fsdp1_before_2_4():
    assert resolve("gpt2", torch_version="2.2", fsdp="full", dp=2).training.fsdp_version == 1


def test_softmax_input_is_saved_before_1_11():
    """PyTorch < 1.11 saves softmax's input: every eager attention layer keeps its fp32 scores,
    (b, heads, s, s) x 4 bytes, until its backward; 1.11 does not."""
    old = trainmem.estimate("bert-large-uncased", torch_version="1.10", zero_grad="none", optimizer_impl="foreach", **BERT)
    new = trainmem.estimate("bert-large-uncased", torch_version="1.11", zero_grad="none", optimizer_impl="foreach", **BERT)
    scores = 24 * 8 * 16 * 512 * 512 * 4  # layers x b x heads x s x s, fp32
    assert old.component("activations.layers.attn.softmax.input") == scores
    assert new.component("activations.layers.attn.softmax.input") == 0
    assert old.peak_allocated - new.peak_allocated >= scores * 0.99


def test_log_softmax_keeps_the_loss_input_before_1_11():
    """The upcast loss's fp32 logits copy is saved by log_softmax before 1.11 (freed after the loss
    since): the loss's saved bytes grow by one fp32 logits tensor."""
    from trainmem.estimate.quantities.loss import loss_bytes
    from trainmem.estimate.layers import Policy
    from trainmem.spec.config import resolve_model
    from trainmem.spec.training import TrainingSpec
    m = resolve_model("gpt2")
    pol = Policy.of("fp16-amp")
    common = dict(precision="fp16-amp", attention="eager", loss="upcast")
    old = loss_bytes(m, TrainingSpec(torch_version="1.10", **common), pol)
    new = loss_bytes(m, TrainingSpec(torch_version="1.11", **common), pol)
    assert old.saved - new.saved == 4 and new.forward - old.forward == 4


def test_published_hf_trainer_bert_runs_of_early_2022():
    """The HF docs' BERT-large runs (V100, January 2022, PyTorch 1.10): within 5% each on device
    memory with the release's softmax; the batch-4 fp32 run was -10.9% before (the scores of 24
    layers missing)."""
    names = sorted(p.stem for p in (ROOT / "validation" / "published").glob("hf_trainer_bert_large_*.json"))
    v = validate(str(ROOT / "validation" / "published"), ["estimate"], names)
    hf = [c for c in v.checks if c.quantity == "device_used"]
    assert len(names) == 9 and len(hf) == 9
    assert all(abs(c.error) < 0.05 for c in hf), [(c.case, c.error) for c in hf]


def test_trace_refuses_another_release():
    with pytest.raises(TrainmemError, match="trace runs the installed PyTorch"):
        trainmem.trace("gpt2", set=["n_layer=1"], torch_version="1.10", seq_len=64)


def test_cli_flag_and_derived_models_refusal():
    out = subprocess.run([sys.executable, "-m", "trainmem", "estimate", "gpt2", "--torch-version", "1.10",
                          "--seq-len", "128", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"torch_version": "1.10"' in out.stdout
    bad = subprocess.run([sys.executable, "-m", "trainmem", "estimate", "gpt2", "--torch-version", "1.10",
                          "--attention", "sdpa"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    with pytest.raises(TrainmemError, match="torch-version 1.10"):
        trainmem.estimate("qwen3-0.6b", torch_version="1.10", seq_len=128)


def test_torchtitan_launcher_name_is_not_read_by_2_9():
    """torchtitan's run_train.sh sets PYTORCH_ALLOC_CONF (since e629fe58a, 2025-08-15), which the CUDA
    allocator of PyTorch 2.9 does not read (spec.releases.cuda_reads_pytorch_alloc_conf): the preset
    implies no expandable segments there and keeps them on other releases; an explicit setting (a run
    started with the old PYTORCH_CUDA_ALLOC_CONF) wins."""
    from trainmem.spec.releases import cuda_reads_pytorch_alloc_conf
    assert not cuda_reads_pytorch_alloc_conf((2, 9)) and not cuda_reads_pytorch_alloc_conf((2, 9, 1))
    assert cuda_reads_pytorch_alloc_conf(None) and cuda_reads_pytorch_alloc_conf((2, 10))
    titan = dict(framework="torchtitan", dp=8, seq_len=256)
    assert resolve("llama-3.1-8b", torch_version="2.9", **titan).training.expandable_segments is False
    assert resolve("llama-3.1-8b", torch_version="2.10", **titan).training.expandable_segments is True
    assert resolve("llama-3.1-8b", **titan).training.expandable_segments is True
    assert resolve("llama-3.1-8b", torch_version="2.9", expandable_segments=True,
                   **titan).training.expandable_segments is True
    # the allocator mode reaches the replay: the same setup reserves more without expandable segments
    off = trainmem.estimate("llama-3.1-8b", torch_version="2.9", **titan)
    on = trainmem.estimate("llama-3.1-8b", torch_version="2.9", expandable_segments=True, **titan)
    assert off.peak_allocated == pytest.approx(on.peak_allocated, rel=1e-3)
    assert off.peak_reserved > on.peak_reserved


def test_published_qwen3_fsdp8_rows_of_september_2025():
    """PR #1690's Qwen3-32B FSDP 8 rows (run_train.sh with PYTORCH_ALLOC_CONF on a 2.9 nightly):
    within 2 % each on peak reserved without expandable segments; batch 1 was -8.0 % with them."""
    names = ["torchtitan_pr1690_qwen3_32b_fsdp8_b1_s4096_ac", "torchtitan_pr1690_qwen3_32b_fsdp8_b2_s4096_ac"]
    v = validate(str(ROOT / "validation" / "published"), ["estimate"], names)
    res = [c for c in v.checks if c.quantity == "peak_reserved"]
    assert len(res) == 2 and all(abs(c.error) < 0.02 for c in res), [(c.case, c.error) for c in res]
