"""Edward Rees, "Transformer Memory Arithmetic: Understanding all the Bytes in nanoGPT"
(https://erees.dev/transformer-memory/): GPT-2 small, b=12, s=1024, AMP AdamW."""
import pytest

import trainmem
from trainmem.estimate.methods import get_method
from trainmem.spec import TrainingSpec

GiB = 2**30


@pytest.fixture(scope="module")
def report():
    return get_method("rees")(trainmem.resolve_model("nanogpt-124m"),
                              TrainingSpec(batch_size=12, seq_len=1024, precision="bf16-amp", optimizer="adamw"))


def test_steady_state_table(report):
    # Rees's table "GPT2 Small / Predicted": N 124,373,760; model memory 547,826,688;
    # gradients 497,495,040; Adam buffers 994,990,080; cuBLAS 17,039,360; inputs 196,608;
    # total 2,057,547,776 bytes.
    assert report.model.num_params == 124_373_760
    assert report.component("parameters") + report.component("buffers") == 547_826_688
    assert report.component("gradients") == 497_495_040
    assert report.component("optimizer_states") == 994_990_080
    assert report.component("workspace") == 17_039_360
    assert report.component("inputs") == 196_608
    steady = sum(report.component(n) for n in
                 ("parameters", "buffers", "gradients", "optimizer_states", "workspace", "inputs"))
    assert steady == 2_057_547_776


def test_activations(report):
    # Rees: "Using my function above I estimate 17.429GB" -- reproduces in GiB.
    act = report.component("activations") + report.component("logits")
    assert act / GiB == pytest.approx(17.429, rel=1e-3)
    assert act / 1e9 != pytest.approx(17.429, rel=1e-3)  # decimal GB would be 18.71


def test_peak(report):
    # Rees: "Using this formula we expect 21.648GB peak allocated memory" -- GiB.
    assert report.peak_allocated / GiB == pytest.approx(21.648, rel=1e-3)
    assert report.phase("backward", 2).peak == report.peak_allocated
