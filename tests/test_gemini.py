"""ColossalAI Gemini (``--gemini cuda``, ``estimate/gemini.py``): the chunk manager's rules on small
hand-worked cases, what rank 0 holds in an estimate, the options it is refused with, and the two
published ColossalAI-Pytorch-lightning runs (validation/published)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.errors import TrainmemError
from trainmem.estimate.gemini import chunk_layout, chunk_utils, filter_exlarge, gemini_rank, search_chunk_size
from trainmem.validate import validate

ROOT = Path(__file__).resolve().parents[1]
B = block_bytes

# GPT-2 with n_embd 64, 2 layers, vocab 1000, 128 positions: parameters in registration order
TINY = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
        "n_positions": 128, "n_ctx": 128, "vocab_size": 1000, "tie_word_embeddings": True}
LAYER = (64, 64, 12288, 192, 4096, 64, 64, 64, 16384, 256, 16384, 64)  # ln_1, c_attn, c_proj, ln_2, c_fc, c_proj
TINY_NUMELS = (64000, 8192) + LAYER * 2 + (64, 64)
OPTS = dict(precision="fp16", gemini="cuda", dp=2, batch_size=1, seq_len=128)


def test_chunk_utilisation_and_search_by_hand():
    """Parameters of 5, 3 and 4 elements: chunks of 6 hold [5] [3] [4] (12 of 18 elements), of 8
    [5, 3] [4] (12 of 16). The search over 5, 7, 9 (range 4 in 2 steps above the largest, 5) finds
    5 -> 12/15, 7 -> [5] [3, 4] 12/14, 9 -> [5, 3] [4] 12/18: 7."""
    util = chunk_utils(np.array([6, 8]), (5, 3, 4))
    assert util.tolist() == [12 / 18, 12 / 16]
    assert search_chunk_size((5, 3, 4), search_range=4, n_grids=2) == 7


def test_extra_large_parameters_are_left_out_of_the_search():
    """``_filter_exlarge_params``: one 1000-element parameter among eleven of 6 is above mean + 3
    std (88.8 + 3 x 274.7 = 913), so the search starts at 6 and, all parameters being 6, keeps 6."""
    numels = (1000,) + (6,) * 11
    assert filter_exlarge(numels) == (6,) * 11
    assert search_chunk_size(numels) == 6


def test_chunk_layout_gives_a_larger_tensor_a_chunk_of_its_own():
    """``append_tensor``: a tensor goes into the last chunk while it fits, else into a new chunk of
    chunk_size, or of its own size when larger (100 > 64)."""
    layout = chunk_layout((100, 30, 30, 40, 10, 50), 64)
    assert [(c.size, c.params) for c in layout] == [(100, (0,)), (64, (1, 2)), (64, (3, 4)), (64, (5,))]
    g = gemini_rank((100, 30, 30, 40, 10, 50), (None, 0, 0, 1, 1, None), (0,), dp=2, chunk_size=64)
    # rank 0 owns chunks 0 and 2; chunk 1 (layer 0) is gathered, chunk 3 holds no layer's parameter
    assert g.fp16_chunks == (B(200), B(128)) and g.fp32_chunks == (B(400), B(256))
    assert g.states == (100, 40, 10) and g.gathered_layer == (B(128), 0) and g.gathered_always == 0
    assert g.grad_hook == 2 * B(80)   # the largest layer parameter (40) as grad and grad / dp, fp16


def _tiny(tmp_path: Path) -> Path:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    return cfg


def test_rank0_holds_its_chunks_and_states_and_no_gradients(tmp_path):
    """The tiny GPT-2 in chunks of 20,000 elements, by hand: wte (64,000) has chunk 0 to itself;
    chunk 1 wpe + layer 0's ln_1; chunk 2 its c_attn, c_proj and ln_2; chunk 3 its c_fc; chunk 4 its
    MLP c_proj and layer 1's ln_1; chunks 5-7 the same for layer 1, ln_f in chunk 7. Over 2 ranks rank
    0 owns chunks 0, 2, 4, 6: fp16 and fp32 copies of them, Adam's two fp32 states of their 13
    parameters, no gradient memory; each layer's backward gathers two of rank 1's chunks (1 and 3,
    5 and 7) beside grad_handle's two copies of the 16,384-element gradient."""
    from trainmem.estimate.quantities.build import quantities
    from trainmem.estimate.states import model_states
    from trainmem.spec.resolve import resolve
    res = resolve(str(_tiny(tmp_path)), gemini_chunk_size=20_000, **OPTS)
    assert tuple(p.numel for p in res.model.parameter_tensors()) == TINY_NUMELS
    st = model_states(res.model, res.training)
    assert st.weights == B(128_000) + 3 * B(40_000)
    assert st.master == B(256_000) + 3 * B(80_000)
    mine = (64000, 12288, 192, 4096, 64, 64, 64, 16384, 64, 64, 64, 16384, 256)
    assert st.optimizer == sum(2 * B(4 * n) for n in mine)
    assert st.grads == st.layer_grads == st.head_grads == 0 and st.step_tensors == 0
    q = quantities(res.model, res.training)
    assert q.gemini_top == q.gemini_low == 2 * B(40_000) + 2 * B(2 * 16384)
    assert q.step_temp == 0   # HybridAdam's fused multi-tensor step
    rep = trainmem.estimate(str(_tiny(tmp_path)), gemini_chunk_size=20_000, **OPTS)
    names = {c.name for c in rep.components}
    assert "gradients" not in names and not any("ddp" in n or "deepspeed" in n for n in names)


def test_searched_chunk_size_is_used_without_one_given(tmp_path):
    """Without --gemini-chunk-size the chunk size is ``search_chunk_size`` over the model's
    parameters: the tiny GPT-2's 64,000-element wte is left out as extra large, so the search
    starts at the 16,384-element c_fc weight."""
    from trainmem.estimate.gemini import model_gemini
    from trainmem.spec.resolve import resolve
    res = resolve(str(_tiny(tmp_path)), **OPTS)
    size = model_gemini(res.model, res.training).chunk_size
    assert size == search_chunk_size(TINY_NUMELS) and (size - 16384) % (64 * 1024**2 // 1024) == 0


@pytest.mark.parametrize("extra, flag", [
    (dict(zero=3), "--zero"), (dict(fsdp="full"), "--fsdp"), (dict(tp=2), "--tp"), (dict(pp=2), "--pp"),
    (dict(grad_accum=2), "--grad-accum"), (dict(lora_rank=8), "--lora-rank"),
    (dict(offload_optimizer=True), "--offload-optimizer"), (dict(master_weights="none"), "--master-weights"),
    (dict(zero_grad="zeros"), "--zero-grad zeros"), (dict(optimizer="sgd"), "HybridAdam"),
    (dict(optimizer_impl="foreach"), "HybridAdam"), (dict(precision="bf16-amp"), "--precision fp16"),
    (dict(gemini="auto"), "placement_policy 'cuda' only"), (dict(gemini_chunk_size=0), "positive"),
])
def test_refused_with_what_gemini_is_not_modelled_with(extra, flag):
    with pytest.raises(TrainmemError, match=flag):
        trainmem.estimate("gpt2", **{**OPTS, **extra})


def test_chunk_size_without_gemini_is_refused():
    with pytest.raises(TrainmemError, match="give --gemini cuda"):
        trainmem.estimate("gpt2", precision="fp16", gemini_chunk_size=10**6)


def test_trace_plan_and_published_methods_refuse_gemini():
    with pytest.raises(TrainmemError, match="use estimate for ColossalAI Gemini"):
        trainmem.trace("gpt2", **OPTS)
    with pytest.raises(TrainmemError, match="--method nemo"):
        trainmem.estimate("gpt2", method="nemo", **OPTS)
    from trainmem.plan import plan
    with pytest.raises(TrainmemError, match="plan --gemini"):
        plan("gpt2", 4, seq_len=128, global_batch=8, gpu="a100-40gb", precision="fp16", gemini="cuda")


def test_cli_refusal_is_one_line():
    p = subprocess.run([sys.executable, "-m", "trainmem", "estimate", "gpt2", "--precision", "fp16", "--dp", "2",
                        "--gemini", "cpu"], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_published_colossalai_gemini_runs():
    """Lightning's ColossalAIStrategy(placement_policy='cuda') on GPT-2 XL b40 over 4 A100s and the
    12B GPT-2 b1 over 8 (ColossalAI-Pytorch-lightning 6a82b80): within 1% of rank 0's published
    peak (before, as fp16 ZeRO-3: +8.1% and +39.6%)."""
    v = validate(str(ROOT / "validation" / "published"), ["estimate"], ["colossalai_gemini"])
    checks = [c for c in v.checks if c.quantity == "peak_allocated"]
    assert len(checks) == 2
    for c in checks:
        assert abs(c.error) < 0.01, (c.case, c.error)
