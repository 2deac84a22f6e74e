"""--transformers-version: older transformers model code, checked against real CPU runs of that code.

The installed transformers cannot run an older release's model, so each mechanism is checked by
running the older code's few lines for real on the CPU (the loss as 4.31-4.45 Llama, 4.46-4.48
``ForCausalLMLoss`` and pre-4.49 GPT-2 wrote it; the eager attention's ``torch.max`` clamp of
Llama 4.28-4.30 and OPT before 4.49) and comparing what it allocates or saves with the estimate's
bytes for that release. Then the defaults ``resolve`` applies and the one-line refusals.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trainmem import resolve
from trainmem.errors import TrainmemError
from trainmem.estimate.layers import Policy, layer_coefficients
from trainmem.estimate.quantities import layer_key, loss_bytes
from trainmem.measure.live import LiveBytes
from trainmem.spec.training import TrainingSpec
from trainmem.workload import check_supported

B, S, V = 2, 64, 2000  # a micro-batch of logits small enough for the CPU


def _old_loss(kind: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss as each release wrote it (spec/tf_releases.py cites the lines)."""
    if kind == "labels":  # 4.49+ ForCausalLMLoss: fp32 copy, labels padded and shifted
        x = logits.float()
        lab = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(x.view(-1, V), lab.reshape(-1))
    if kind == "loss-fp32-shift":  # 4.46-4.48 ForCausalLMLoss: fp32 copy, then its shifted copy
        x = logits.float()
        shift = x[..., :-1, :].contiguous()
        return F.cross_entropy(shift.view(-1, V), labels[..., 1:].reshape(-1))
    if kind == "shift-half":  # GPT-2 < 4.49, Llama 4.28-4.30: the shifted copy of the logits as they are
        shift = logits[..., :-1, :].contiguous()
        return F.cross_entropy(shift.view(-1, V), labels[..., 1:].reshape(-1))
    raise AssertionError(kind)


def _peak_per_logit(kind: str, dtype: torch.dtype) -> float:
    """Bytes per logit element at the loss's forward peak, measured on the CPU: the head's output
    and everything the loss allocates (``forward-fp32``: the model's forward upcasts first and the
    loss runs on the fp32 tensor it returns)."""
    h = torch.randn(B, S, 64, dtype=dtype, requires_grad=True)
    w = torch.randn(V, 64, dtype=dtype)
    labels = torch.randint(0, V, (B, S))
    with LiveBytes("cpu") as live:
        start = live.current
        logits = h @ w.t()  # the head's output (b, s, vocab) in the weights' dtype
        if kind == "forward-fp32":
            logits = logits.float()  # Llama 4.31-4.45: logits = logits.float() in the forward
            loss = _old_loss("shift-half", logits, labels)  # the loss then shifts the fp32 logits
        else:
            loss = _old_loss(kind, logits, labels)
        peak = live.peak - start
    del loss
    return peak / (B * S * V)


@pytest.mark.parametrize("version,kind", [("4.49", "labels"), ("4.46", "loss-fp32-shift"),
                                          ("4.45.2", "forward-fp32"), ("4.30", "shift-half")])
def test_release_loss_bytes_match_the_release_code_run_on_the_cpu(version, kind):
    """The estimate's loss bytes per logit for Llama in pure bf16 (the head's output, what the loss
    saves and its forward transients, the loop keeping only the loss) against the peak of the
    release's loss code run for real: within the one token fewer the shifted tensors have."""
    r = resolve("llama-3.2-1b", precision="bf16", transformers_version=version, attention="eager", seq_len=S)
    lb = loss_bytes(r.model, r.training, Policy.of("bf16"))
    predicted = lb.out + lb.forward + lb.saved
    measured = _peak_per_logit(kind, torch.bfloat16)
    assert measured == pytest.approx(predicted, rel=0.03), (kind, measured, predicted)


def test_release_losses_differ_as_their_copies():
    """The four releases' losses are four different sizes on the CPU, ordered as their copies."""
    sizes = [_peak_per_logit(k, torch.bfloat16) for k in ("shift-half", "labels", "forward-fp32", "loss-fp32-shift")]
    assert sizes == sorted(sizes) and len({round(x, 1) for x in sizes}) == 4


def _clamped_attention_saved(clamp: bool, precision: str, heads: int = 4, s: int = 32) -> int:
    """Bytes of (b, heads, s, s) tensors autograd saves in Llama 4.28's eager attention
    (modeling_llama.py L215-235 of 4.28.1), with or without its torch.max clamp, counted by
    saved-tensor hooks on a real CPU run: q, k, v in the compute dtype, the causal mask in the
    embeddings' dtype (``_prepare_decoder_attention_mask``: fp32 under autocast), CPU autocast to
    bf16 for ``bf16-amp``."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    q, k, v = (torch.randn(1, heads, s, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    mask_dtype = torch.float32 if precision != "bf16" else torch.bfloat16
    mask = torch.full((s, s), torch.finfo(mask_dtype).min, dtype=mask_dtype).triu(1)[None, None]
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[-1] == t.shape[-2] == s:   # (b, heads, s, s) tensors only
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-amp"):
        w = torch.matmul(q, k.transpose(2, 3)) / 4.0
        w = w + mask
        if clamp:
            w = torch.max(w, torch.tensor(torch.finfo(w.dtype).min))
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(p, v)
    out.float().sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16-amp", "bf16"])
def test_llama_clamp_saves_one_scores_tensor_as_the_real_op_does(precision):
    """Llama 4.28-4.30's clamp: the layer recipe's extra (b, heads, s, s) bytes per token x key
    equal what the clamped attention saves more than the unclamped one, run on the CPU (fp32 scores
    under autocast, where the fp32 mask promotes the sum)."""
    heads, s = 4, 32
    extra = _clamped_attention_saved(True, precision, heads, s) - _clamped_attention_saved(False, precision, heads, s)
    r_old = resolve("llama-3.2-1b", precision=precision, transformers_version="4.30", seq_len=S)
    r_new = resolve("llama-3.2-1b", precision=precision, attention="eager", seq_len=S)
    per_head = (layer_coefficients(layer_key(r_old.model, r_old.training)).sq
                - layer_coefficients(layer_key(r_new.model, r_new.training)).sq) / r_old.model.num_heads
    assert extra == per_head * heads * s * s > 0


def test_opt_clamp_raises_the_derived_layer_by_one_scores_tensor():
    """OPT before 4.49 (derived): the clamp's saved sum, fp16, per layer (quantities.derived_clamp)."""
    import json
    from pathlib import Path
    from trainmem.estimate.quantities import quantities
    fixture = Path(__file__).resolve().parents[1] / "validation/published/deepspeed_chat_opt13b_sft_zero2_b8.json"
    config = {k: v for k, v in json.loads(fixture.read_text())["model"].items() if not k.startswith("_")}
    base = dict(precision="fp16", attention="eager", seq_len=512, batch_size=8, loss="half")
    old = resolve(config, transformers_version="4.29.0.dev0", **base)
    new = resolve(config, **base)
    d = quantities(old.model, old.training).kept_sq - quantities(new.model, new.training).kept_sq
    assert d == old.model.num_heads * 2


@pytest.mark.parametrize("model,version,attention", [
    ("llama-3.2-1b", "4.35.2", "eager"), ("llama-3.2-1b", "4.36.0", "sdpa"), ("gpt2", "4.41.0", "eager"),
    ("gpt2", "4.42.0", "sdpa"), ("bert-base-uncased", "4.40.0", "eager"), ("bert-base-uncased", "4.41.0", "sdpa")])
def test_default_attention_follows_the_release(model, version, attention):
    assert resolve(model, transformers_version=version).training.attention == attention


def test_explicit_attention_and_replace_keep_the_release_rules():
    r = resolve("gpt2", transformers_version="4.40", attention="flash", precision="bf16-amp")
    assert r.training.attention == "flash"
    assert r.replace(attention=None).training.attention == "eager"
    assert resolve("gpt2", transformers_version="4.40").replace(batch_size=4).training.attention == "eager"


def test_hf_trainer_version_sets_the_transformers_release():
    r = resolve("llama-3.2-1b", framework="hf-trainer", framework_version="4.45")
    assert r.training.transformers_version == "4.45" and r.training.attention == "sdpa"
    assert not any("shifted" in w for w in r.training.extra["framework_warnings"])
    r = resolve("gpt2", framework="hf-trainer", framework_version="4.40")
    assert r.training.attention == "eager"


@pytest.mark.parametrize("options,text", [
    (dict(model="llama-3.2-1b", transformers_version="4.30", attention="sdpa"), "does not support SDPA"),
    (dict(model="qwen2.5-0.5b", transformers_version="4.36"), "has no qwen2 model"),
    (dict(model="gpt2", transformers_version="4.39", attention="flash", precision="bf16-amp"),
     "does not support flash_attention_2"),
    (dict(model="llama-3.2-1b", transformers_version="4.45", compile=True), "drop --compile"),
    (dict(model="llama-3.2-1b", transformers_version="4.45", tp=2), "drop --tp 2"),
    (dict(model="llama-3.2-1b", transformers_version="4.39"), "materialised (b, 1, s, s) causal mask"),
    (dict(model="llama-3.2-1b", transformers_version="4.12"), "4.16 and later"),
    (dict(model="llama-3.2-1b", transformers_version="four"), "is not a transformers release"),
])
def test_refusals_are_one_line(options, text):
    model = options.pop("model")
    with pytest.raises(TrainmemError) as e:
        resolve(model, **options)
    assert text in str(e.value) and "\n" not in str(e.value)


def test_trace_refuses_another_release():
    with pytest.raises(TrainmemError, match="trace runs the installed transformers"):
        check_supported(TrainingSpec(transformers_version="4.45.2"))
    import transformers
    check_supported(TrainingSpec(transformers_version=transformers.__version__))


def test_cli_refusal_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "-m", "trainmem", "estimate", "llama-3.2-1b", "--transformers-version",
                          "4.30", "--attention", "sdpa"], capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_sdpa_before_4_54_keeps_the_repeated_keys_and_values():
    """Before 4.54 transformers' Llama-style SDPA call repeats grouped K/V to the query's heads
    (spec.tf_releases.sdpa_repeats_kv): the layer is the one litgpt's repeat-kv call gives, which
    tests/test_litgpt_attention.py checks against trace; 4.54 and the installed code pass
    enable_gqa and keep the grouped tensors."""
    def layer(**kw):
        r = resolve("llama-3.2-1b", precision="bf16", seq_len=S, **kw)
        return layer_coefficients(layer_key(r.model, r.training))
    old, call, new = layer(transformers_version="4.45.2"), layer(attention_call="repeat-kv"), layer()
    assert old.tok == call.tok > new.tok and layer(transformers_version="4.54").tok == new.tok
    assert any(n == "attn.k_repeated" for n, *_ in old.parts)


def _value_cache_dtype(own_dtype: bool) -> torch.dtype:
    """A ``DynamicLayer``'s first update as each release wrote it (``_cache_held`` cites the lines):
    the empty caches created in the keys' dtype (up to 5.23) or each in its own (5.24), then
    ``torch.cat`` with the autocast layer's fp32 rotated keys and half values."""
    k, v = torch.zeros(B, 2, S, 8), torch.zeros(B, 2, S, 8, dtype=torch.bfloat16)
    empty_v = torch.tensor([], dtype=v.dtype if own_dtype else k.dtype)
    return torch.cat([empty_v, v], dim=-2).dtype


def test_installed_dynamic_cache_keeps_values_as_the_release_rule_says():
    """The installed transformers' own DynamicCache, fed fp32 keys and bf16 values as a Llama layer
    under autocast feeds it: its value cache is bf16 exactly when ``cache_values_own_dtype`` says so
    for the installed release (run under any installed release)."""
    from transformers.cache_utils import DynamicCache

    from trainmem.spec.tf_releases import cache_values_own_dtype, code_release
    cache = DynamicCache()
    k, v = torch.zeros(B, 2, S, 8), torch.zeros(B, 2, S, 8, dtype=torch.bfloat16)
    keys, values = cache.update(k, v, 0)
    own = cache_values_own_dtype(code_release(None))
    assert keys.dtype == torch.float32 and values.dtype == (torch.bfloat16 if own else torch.float32)
    assert _value_cache_dtype(own) == values.dtype and _value_cache_dtype(not own) != values.dtype


def test_value_cache_in_its_own_dtype_from_5_24_drops_one_fp32_copy():
    """bf16-amp with the KV cache: the layer's bytes the output holds beyond autograd's drop by
    the value cache's fp32 copy (kv_size x 4 B per token) from 5.24, its total cache by half that;
    bf16 (no promotion) and full recompute (no cache) are the same in both releases."""
    def layer(version, **kw):
        r = resolve("llama-3.2-1b", seq_len=S, transformers_version=version, **kw)
        return r.model, layer_coefficients(layer_key(r.model, r.training))
    m, old = layer("5.23.0")
    _, new = layer("5.24.0")
    assert old.held - new.held == m.kv_size * 4 and old.cache - new.cache == m.kv_size * 2
    assert old.tok == new.tok  # what autograd saves is the same size (a cast of v, or the cache's half v)
    for kw in ({"precision": "bf16"}, {"recompute": "full"}):
        assert layer("5.23.0", **kw)[1] == layer("5.24.0", **kw)[1]


def test_code_release_is_the_given_else_the_installed_release():
    from trainmem.spec.tf_releases import NEWEST_READ, code_release, installed_version, parse_transformers_version
    assert code_release((4, 45, 2)) == (4, 45, 2)
    assert code_release(None) == parse_transformers_version(installed_version())
    assert NEWEST_READ >= (5, 24)  # what an estimate without transformers installed models
    assert resolve("llama-3.2-1b").training.transformers_version is None  # nothing pinned by default
