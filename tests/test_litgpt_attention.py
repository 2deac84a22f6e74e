"""litgpt's attention and LoRA tensor pattern: ``--attention-call repeat-kv`` (trace's CUDA emulation
rewrites transformers' SDPA call as litgpt makes it, the estimate copies K/V to the query's heads) and
what ``--fused-qkv`` counts for LoRA on litgpt's fused q/k/v linear (one dropout, the zero-padded
delta that ``index_copy`` saves).

The litgpt side is checked on real CPU tensors, with the reshaping of litgpt's
``CausalSelfAttention.forward`` and ``LoRAQKVLinear.forward``/``zero_pad`` written out as in
litgpt/model.py and litgpt/lora.py at 43c44323 (https://github.com/Lightning-AI/litgpt/blob/
43c44323b9b7fb6e3b567c800e6668c3a9b1ecee/litgpt/model.py); the estimate against trace on small
configurations of a grouped-query Llama (hand-written formulas) and a multi-query Falcon (derived
from traces of transformers' FalconForCausalLM)."""
from __future__ import annotations

import pytest

from trainmem.errors import TrainmemError
from trainmem.spec.training import TrainingSpec

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem import estimate, trace  # noqa: E402
from trainmem.trace.cuda import litgpt_call  # noqa: E402


def _saved(fn):
    """The tensors autograd saves while ``fn`` runs (``saved_tensors_hooks``), and fn's result."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s):
        out = fn()
    return saved, out


def _litgpt_qkv(b: int, t: int, groups: int, q_per_kv: int, hs: int):
    """litgpt's split of the fused output (model.py ``CausalSelfAttention.forward``): view as
    (B, T, groups, q_per_kv + 2, hs), permute, split, expand k and v when heads differ, reshape."""
    heads = groups * q_per_kv
    fused = torch.randn(b, t, (heads + 2 * groups) * hs, requires_grad=True) * 1.0
    qkv = fused.view(b, t, groups, q_per_kv + 2, hs).permute(0, 2, 3, 1, 4)
    q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
    if groups != heads:
        k, v = k.expand(b, groups, q_per_kv, t, hs), v.expand(b, groups, q_per_kv, t, hs)
    return fused, tuple(z.reshape(b, -1, t, hs) for z in (q, k, v))


@pytest.mark.parametrize("groups, q_per_kv", [(2, 4), (1, 8), (4, 1)], ids=["gqa", "mqa", "mha"])
def test_litgpt_call_hands_sdpa_what_litgpt_does(groups, q_per_kv):
    """From transformers' (b, kv_heads, s, d) keys and values, ``litgpt_call`` gives SDPA tensors of
    litgpt's shapes: (b, heads, s, d), fresh copies with grouped-query heads, views (zero head
    stride) with one key/value head; SDPA then saves as many bytes as on litgpt's own tensors."""
    b, t, hs = 2, 8, 16
    fused, (q, k, v) = _litgpt_qkv(b, t, groups, q_per_kv, hs)
    lit_saved, _ = _saved(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    hf_k = torch.randn(b, groups, t, hs, requires_grad=True) * 1.0
    hf_v = torch.randn(b, groups, t, hs, requires_grad=True) * 1.0
    hq = torch.randn(b, groups * q_per_kv, t, hs, requires_grad=True) * 1.0
    k2, v2, mask, causal, gqa = litgpt_call(hq, hf_k, hf_v)
    assert mask is None and causal and not gqa
    assert k2.shape == v2.shape == k.shape == v.shape
    copied = groups not in (1, groups * q_per_kv)
    assert (k2.untyped_storage().data_ptr() != hf_k.untyped_storage().data_ptr()) == copied
    assert (k.untyped_storage().data_ptr() != fused.untyped_storage().data_ptr()) == copied
    hf_saved, _ = _saved(lambda: torch.nn.functional.scaled_dot_product_attention(
        hq, k2, v2, attn_mask=mask, is_causal=causal, enable_gqa=gqa))
    assert sorted(tuple(s.shape) for s in hf_saved) == sorted(tuple(s.shape) for s in lit_saved)


def _lora_qkv_saved(enable: tuple[bool, bool, bool], p: float = 0.05):
    """litgpt's ``LoRAQKVLinear.forward`` on a multi-head fused linear (lora.py at 43c44323): one
    dropout, one ``lora_A`` of r * n rows, ``conv1d`` per enabled part, ``zero_pad`` by
    ``index_copy``. Returns (saved tensors, input, the delta's width)."""
    b, t, h, r = 2, 8, 32, 4
    x = torch.randn(b, t, h, requires_grad=True) * 1.0
    n = sum(enable)
    lora_a = torch.randn(r * n, h, requires_grad=True)
    lora_b = torch.randn(h * n, r, requires_grad=True)
    ind = [i for part, on in enumerate(enable) if on for i in range(part * h, (part + 1) * h)]

    def forward():
        # nn.Dropout on CUDA runs native_dropout (a bool mask; the CPU's F.dropout multiplies by a float one)
        after_a = torch.nn.functional.linear(torch.native_dropout(x, p, True)[0], lora_a)
        after_b = torch.cat([torch.nn.functional.conv1d(a, w) for a, w in zip(
            after_a.transpose(-2, -1).chunk(n, dim=1), lora_b.unsqueeze(-1).split(h))], dim=1).transpose(-2, -1)
        if n == 3:
            return after_b
        z = after_b.transpose(0, 1)
        out = z.new_zeros((*z.shape[:-1], 3 * h)).view(-1, 3 * h)
        out = out.index_copy(1, torch.tensor(ind), z.reshape(-1, h * n))
        return out.view((*z.shape[:-1], 3 * h)).transpose(0, 1)

    saved, _ = _saved(forward)
    return saved, x, h * n


def test_lora_qkv_runs_one_dropout_and_index_copy_saves_the_delta():
    """The two LoRA terms of ``quantities.layer_terms.fused_qkv_lora``: litgpt saves one 1-byte dropout mask
    over the shared input (peft: one per adapted linear), and with q and v enabled (not k) the
    delta of q + v width that ``index_copy`` scatters, which it saves; with all three, no padding."""
    saved, x, width = _lora_qkv_saved((True, False, True))
    masks = [s for s in saved if s.dtype == torch.bool]
    assert len(masks) == 1 and masks[0].shape == x.shape
    assert any(s.shape[-1] == width and s.numel() == x.shape[0] * x.shape[1] * width for s in saved)
    saved_all, x_all, width_all = _lora_qkv_saved((True, True, True))
    assert len([s for s in saved_all if s.dtype == torch.bool]) == 1
    assert not any(s.shape[-1] == width_all for s in saved_all)


GQA = ["num_hidden_layers=2", "hidden_size=512", "intermediate_size=1024", "vocab_size=4000",
       "num_attention_heads=8", "num_key_value_heads=2", "head_dim=64", "use_cache=false"]
MQA = ["num_hidden_layers=2", "hidden_size=512", "num_attention_heads=8", "vocab_size=4000", "use_cache=false"]
OPTS = dict(batch_size=2, seq_len=256, precision="bf16", lora_rank=8, lora_dropout=0.05, lora_dtype="half",
            loss="half", hold_output="step", dropout=False, gpu="a100-40gb")


@pytest.mark.parametrize("model, sets", [("llama-3.2-1b", GQA), ("falcon-7b", MQA)], ids=["llama-gqa", "falcon-mqa"])
def test_estimate_agrees_with_trace(model, sets):
    """Both calls, estimate against trace, within 1 %; the Llama's difference between them is the
    K/V copies at the query's heads: 2 x (q - kv) bf16 bytes per token and layer."""
    got = {}
    for call in ("model", "repeat-kv"):
        e = estimate(model, set=sets, attention_call=call, **OPTS)
        t = trace(model, set=sets, attention_call=call, **OPTS)
        assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01), call
        got[call] = (e.peak_allocated, t.peak_allocated)
    if model == "llama-3.2-1b":
        extra = 2 * (512 - 128) * 2 * 2 * 256 * 2  # k and v, (q - kv) wide, bf16, b*s tokens, 2 layers
        assert got["repeat-kv"][0] - got["model"][0] == pytest.approx(extra, abs=2 ** 16)
        assert got["repeat-kv"][1] - got["model"][1] == pytest.approx(extra, abs=2 ** 16)
    else:  # transformers' Falcon hands SDPA a mask: math (s x s fp32 scores); litgpt's call: flash
        assert got["repeat-kv"][1] < got["model"][1]


def test_refused_in_one_line():
    for options, names in [(dict(attention="eager"), "--attention eager"), (dict(tp=2), "--tp")]:
        with pytest.raises(TrainmemError, match=names) as e:
            TrainingSpec(batch_size=1, seq_len=64, attention_call="repeat-kv", **options)
        assert "\n" not in str(e.value)
    # --compile: estimate keeps the copies (torchtune's layers, tests/test_torchtune_flags.py); trace refuses
    from trainmem.trace.compiled import check
    with pytest.raises(TrainmemError, match="--attention-call repeat-kv") as e:
        check(TrainingSpec(batch_size=1, seq_len=64, attention_call="repeat-kv", compile=True), object(), "cuda")
    assert "\n" not in str(e.value)
    with pytest.raises(TrainmemError, match="--attention-call"):
        TrainingSpec(batch_size=1, seq_len=64, attention_call="litgpt")
    with pytest.raises(TrainmemError, match="--attention-call repeat-kv"):
        estimate("bert-base-uncased", seq_len=64, attention_call="repeat-kv")
    from trainmem.workload import check_supported  # measure runs the call (litgpt_modules.LitgptAttentionCall)
    check_supported(TrainingSpec(batch_size=1, seq_len=64, attention_call="repeat-kv"), "measure")


# ----- SDPA's math kernel before PyTorch 2.5 (--torch-version < 2.5) ------------------------------------
@pytest.mark.parametrize("kv_heads, causal", [(1, True), (4, False)], ids=["mqa-causal", "mha-mask"])
def test_math_in_input_dtype_saves_what_the_reduced_precision_kernel_saves(kv_heads, causal):
    """The emulation's pre-2.5 math kernel (``trace.cuda.math_in_input_dtype``) against PyTorch's own:
    ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` (pytorch/pytorch PR #135964)
    runs the installed ``_scaled_dot_product_attention_math`` without the fp32 upcast of PR #128922.
    Both save the same tensors, in bf16."""
    from trainmem.trace.cuda import math_in_input_dtype
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 8, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    mask = None if causal else torch.ones(8, 8, dtype=torch.bool).tril()
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        real, _ = _saved(lambda: torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, causal))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)
    ours, _ = _saved(lambda: math_in_input_dtype(q, k, v, mask, 0.0, causal, None, False))
    assert sorted((tuple(s.shape), s.dtype) for s in ours) == sorted((tuple(s.shape), s.dtype) for s in real)
    assert all(s.dtype == torch.bfloat16 for s in ours if s.is_floating_point())


@pytest.mark.parametrize("model, sets", [("llama-3.2-1b", GQA), ("falcon-7b", MQA)], ids=["llama", "falcon-derived"])
def test_math_kernel_of_torch_2_1_estimate_agrees_with_trace(monkeypatch, model, sets):
    """``--torch-version 2.1`` with the math kernel (pinned for the Llama; transformers' Falcon gets
    it from its mask and single key/value head): the estimate against trace run with the emulation's
    pre-2.5 math kernel (the release check, which keeps trace on the installed PyTorch, lifted here
    only), within 1 %, and below the current release's fp32 math."""
    import trainmem.workload as workload
    opts = dict(OPTS, attention="sdpa-math" if model == "llama-3.2-1b" else "sdpa")
    monkeypatch.setattr(workload, "_check_release", lambda t, what: None)
    e = estimate(model, set=sets, torch_version="2.1", **opts)
    t = trace(model, set=sets, torch_version="2.1", **opts)
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.01)
    assert e.peak_allocated < estimate(model, set=sets, **opts).peak_allocated


def test_plan_keeps_data_parallel_layouts_with_the_litgpt_call():
    """``plan`` searches only --tp 1 --pp 1 --cp 1 under --attention-call repeat-kv (TrainingSpec refuses
    the others); a list asking for more is refused in one line."""
    from trainmem.plan.planner import plan
    res = plan("llama-3.2-1b", gpus=4, global_batch=16, seq_len=512, gpu="a100-40gb", attention_call="repeat-kv")
    assert res.top and all(lay.tp == 1 and lay.pp == 1 and lay.cp == 1 for lay in res.top)
    with pytest.raises(TrainmemError, match="--attention-call --cp 1,2"):
        plan("llama-3.2-1b", gpus=4, global_batch=16, seq_len=512, gpu="a100-40gb", attention_call="repeat-kv",
             cp="1,2")


# ----- --split-gate-up: litgpt's LLaMAMLP over transformers' fused gate_up_proj (Phi-3) -----------------
def test_split_gate_up_saves_one_more_dropout_and_lora_input_than_peft_on_the_fused_linear():
    """peft's adapter on a fused ``gate_up_proj`` (the real peft) against litgpt's ``fc_1`` and ``fc_2``
    (two ``LoRALinear``s, each ``linear(x) + lora_B(lora_A(dropout(x)))``, litgpt/lora.py at
    f247be87), on CPU tensors: litgpt saves one more dropout mask and dropped (b, s, h) input and one
    more rank-r output; the estimate's term is those bytes (1 + 2 + 2 r / h per hidden element, bf16)."""
    peft = pytest.importorskip("peft")
    b, s, h, f, r = 2, 8, 32, 64, 4
    fused = torch.nn.Module()
    fused.gate_up_proj = torch.nn.Linear(h, 2 * f, bias=False)
    lora = peft.get_peft_model(fused, peft.LoraConfig(r=r, target_modules=["gate_up_proj"], lora_dropout=0.05))
    lora.train()
    x = torch.randn(b, s, h, requires_grad=True) * 1.0
    peft_saved, _ = _saved(lambda: lora.base_model.model.gate_up_proj(x))
    w1, w2 = (torch.randn(f, h) for _ in range(2))
    a1, a2 = (torch.randn(r, h, requires_grad=True) for _ in range(2))
    b1, b2 = (torch.randn(f, r, requires_grad=True) for _ in range(2))

    def litgpt_mlp():
        drop = torch.nn.functional.dropout
        return [torch.nn.functional.linear(x, w) + drop(x, 0.05, True) @ a.t() @ bb.t()
                for w, a, bb in ((w1, a1, b1), (w2, a2, b2))]
    lit_saved, _ = _saved(litgpt_mlp)

    def count(saved, width):  # distinct storages of b*s rows of this width (matmul saves flattened views)
        return len({t.untyped_storage().data_ptr() for t in saved
                    if t.shape[-1] == width and t.numel() == b * s * width and t is not x})
    assert count(lit_saved, h) - count(peft_saved, h) == 2  # a mask and a dropped input (CPU: a float mask)
    assert count(lit_saved, r) - count(peft_saved, r) == 1  # lora_A's output, saved by lora_B
    from trainmem.spec.config import resolve_model
    m = resolve_model("phi-3-mini")
    opts = dict(batch_size=1, seq_len=512, precision="bf16", lora_rank=8, lora_dropout=0.05, lora_dtype="half",
                lora_targets="qkv_proj,gate_up_proj", loss="half", hold_output="step", set=["use_cache=false"])
    plain, split = (estimate("phi-3-mini", split_gate_up=v, **opts) for v in (False, True))
    per_token = m.hidden_size * (1 + 2) + 8 * 2

    def grew(category):  # what the split adds to a category of the peak's components
        return sum(c.bytes for c in split.components if str(c.category).endswith(category)) - \
            sum(c.bytes for c in plain.components if str(c.category).endswith(category))
    assert grew("activations") == pytest.approx(per_token * 512 * m.num_layers, abs=2 ** 21)
    # fc_2's own lora_A (r, h) per layer (lora.py LLaMAMLP: a LoRALinear each), bf16, and its two AdamW states
    assert grew("parameters") == m.num_layers * 8 * m.hidden_size * 2
    assert grew("optimizer_states") == 2 * m.num_layers * 8 * m.hidden_size * 2
    with pytest.raises(TrainmemError, match="--split-gate-up"):
        estimate("llama-3.2-1b", seq_len=64, split_gate_up=True)
