"""Moritz Scherrmann's BERT-large notebook, "Understand GPU Memory Usage when Training Language
Models" (https://moritzscherrmann.com/blog/2024/GPU-Memory_BERT/): fp32, AdamW, batch 4, sequence 512, two iterations."""
import pytest

import trainmem
from trainmem.estimate.methods import bert_notebook, get_method
from trainmem.spec import TrainingSpec

MiB = 2**20


@pytest.fixture(scope="module")
def spec():
    return trainmem.resolve_model("bert-large-uncased", overrides=['architectures=["BertForSequenceClassification"]'])


@pytest.fixture(scope="module")
def report(spec):
    return get_method("bert-notebook")(spec, TrainingSpec(batch_size=4, seq_len=512, precision="fp32",
                                                          optimizer="adamw"))


def test_embedding_rounding():
    # Scherrmann's notebook: embedding 119.23 MiB expected, 120.00 MiB allocated on the GPU.
    raw = 30522 * 1024 * 4
    assert raw / MiB == pytest.approx(119.23, abs=0.005)
    assert bert_notebook.allocator_block_bytes(raw) == 120 * MiB
    assert bert_notebook.allocator_block_bytes(8) == 512


def test_weights_and_forward_tensors(report):
    # The notebook: "Expected GPU usage by storing model weigths: 1279.25 MiB" (incl. the embedding's
    # rounding), "forward pass tensors: 6642.82 MiB", "ADAM moments: 2558.49 MiB", cuBLAS 8.12 MiB.
    assert report.extra["weight_bytes"] / MiB == pytest.approx(1279.25, abs=0.005)
    assert report.extra["forward_tensor_bytes"] / MiB == pytest.approx(6642.82, abs=0.005)
    assert report.component("optimizer_states") / MiB == pytest.approx(2558.49, abs=0.01)
    assert report.component("workspace") == 2 * 8_519_680  # printed as 8.12 (8.125) MiB each


# The notebook, "Allocated GPU memory by torch" after each phase of train_bert (MiB).
PHASES = [("model_loaded", 1, 1279.25), ("forward", 1, 7930.20), ("backward", 1, 2574.77),
          ("optimizer_step", 1, 5133.26), ("zero_grad", 1, 3854.01), ("forward", 2, 10496.82),
          ("backward", 2, 5133.26), ("optimizer_step", 2, 5133.26), ("zero_grad", 2, 3854.01)]


@pytest.mark.parametrize("name,step,mib", PHASES)
def test_phases(report, name, step, mib):
    assert report.phase(name, step).allocated / MiB == pytest.approx(mib, abs=0.05)


def test_peak(report):
    # The notebook: "Expected maximum allocated memory by tensors: 10562.81 MiB" (measured 10562.79).
    assert report.peak_allocated / MiB == pytest.approx(10562.81, abs=0.02)
    assert report.phase("backward", 2).peak == report.peak_allocated
