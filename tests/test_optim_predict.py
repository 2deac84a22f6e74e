"""estimate and trace agree on what optimizer-in-backward saves (issue 6, must-show 3), on a
reduced Llama (the docs show the full Llama-3.1-8B on an H100 with the same agreement)."""
import pytest

import trainmem

SETUP = dict(precision="bf16", batch_size=1, seq_len=512, gpu="h100")
MODEL = ("llama-3.2-1b", ["num_hidden_layers=2"])


@pytest.mark.parametrize("oib", [False, True])
def test_estimate_and_trace_agree_within_2_percent(oib):
    name, over = MODEL
    e = trainmem.estimate(name, set=over, optimizer_in_backward=oib, **SETUP)
    t = trainmem.trace(name, overrides=over, optimizer_in_backward=oib, **SETUP)
    assert abs(e.peak_allocated / t.peak_allocated - 1) < 0.02, (e.peak_allocated, t.peak_allocated)


def test_predicted_reduction_matches_the_traced_one():
    name, over = MODEL
    est = [trainmem.estimate(name, set=over, optimizer_in_backward=o, **SETUP).peak_allocated for o in (False, True)]
    tr = [trainmem.trace(name, overrides=over, optimizer_in_backward=o, **SETUP).peak_allocated for o in (False, True)]
    assert est[1] < est[0] and tr[1] < tr[0]
    assert abs((1 - est[1] / est[0]) - (1 - tr[1] / tr[0])) < 0.02
