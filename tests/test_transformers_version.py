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
from trainmem.estimate.quantities.loss import loss_bytes
from trainmem.estimate.quantities.model_facts import layer_key
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
    """OPT before 4.49 (derived): the clamp's saved sum, fp16, per layer (quantities.layer_terms.derived_clamp)."""
    import json
    from pathlib import Path
    from trainmem.estimate.quantities.build import quantities
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
    (dict(model="llama-3.2-1b", transformers_version="4.55", compile=True), "holds the layers' own keys and values"),
    (dict(model="granite-3.1-8b", transformers_version="4.45.2", precision="bf16-amp", attention="flash"),
     "Granite's KV cache"),
    (dict(model="granite-3.1-8b", transformers_version="4.45.2", precision="bf16", attention="eager"),
     "Granite's KV cache"),
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
    """A ``DynamicLayer``'s first update as each release wrote it (``layers._cache_tensors`` cites the lines):
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, kvh, s, d = x.shape
    return x if n == 1 else x[:, :, None].expand(b, kvh, n, s, d).reshape(b, kvh * n, s, d)


def _old_llama_cache(heads: int, kv_heads: int, head_dim: int, precision: str, attention: str,
                     rotary_half: bool, b: int) -> tuple[float, float]:
    """One Llama attention of transformers before 4.56 run for real on the CPU (4.35.2
    ``modeling_llama.py`` L366-396, 4.45.2 L612-661): q/k/v projections seen as ``(b, heads, s, d)``
    by ``view(...).transpose(1, 2)``, rotary with cos/sin in the values' dtype (``rotary_half``, 4.35.2
    L144-145, L377) or the embeddings' fp32 (4.45.2 L976), the cache's tuple or ``DynamicCache``
    reference to k and v (4.35.2 L385; 4.36.0 ``cache_utils.py`` L124) taken before ``repeat_kv``, then
    eager attention or SDPA (``"sdpa-math"``: its math path). Returns (bytes per token of the cache
    autograd does not save, bytes per token of the cache), read by saved-tensor hooks; CPU autocast
    to bf16 for ``bf16-amp``; a micro-batch of ``b`` sequences."""
    s = 16
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    wdtype = torch.float32 if precision in ("fp32", "bf16-amp") else dtype
    x = torch.randn(b, s, heads * head_dim, dtype=wdtype, requires_grad=True)
    wq, wk, wv = (torch.randn(n * head_dim, heads * head_dim, dtype=wdtype) for n in (heads, kv_heads, kv_heads))
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-amp"):
        q = F.linear(x, wq).view(b, s, heads, head_dim).transpose(1, 2)
        k = F.linear(x, wk).view(b, s, kv_heads, head_dim).transpose(1, 2)
        v = F.linear(x, wv).view(b, s, kv_heads, head_dim).transpose(1, 2)
        cos, sin = (torch.randn(1, 1, s, head_dim, dtype=v.dtype if rotary_half else x.dtype) for _ in range(2))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        cache = (k, v)  # past_key_value = (key_states, value_states) if use_cache else None
        kr, vr = _repeat_kv(k, heads // kv_heads), _repeat_kv(v, heads // kv_heads)
        if attention == "eager":
            w = torch.matmul(q, kr.transpose(2, 3)) / head_dim ** 0.5
            out = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), vr)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.MATH if attention == "sdpa-math" else SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    del out
    unsaved = sum(t.untyped_storage().nbytes() for t in cache if t.untyped_storage().data_ptr() not in saved)
    return unsaved / (b * s), sum(t.untyped_storage().nbytes() for t in cache) / (b * s)


@pytest.mark.parametrize("model,version,precision,attention", [
    ("llama-2-7b", "4.35.2", "bf16", "eager"), ("llama-2-7b", "4.40.0", "bf16", "sdpa"),
    ("llama-2-7b", "4.40.0", "bf16-amp", "sdpa"), ("llama-2-7b", "4.45.2", "bf16-amp", "sdpa"),
    ("llama-2-7b", "4.45.2", "bf16-amp", "eager"), ("llama-2-7b", "4.45.2", "fp32", "sdpa-math"),
    ("llama-3.2-1b", "4.35.2", "bf16-amp", "eager"), ("llama-3.2-1b", "4.45.2", "bf16", "sdpa"),
    ("llama-3.2-1b", "4.55.0", "bf16", "sdpa"), ("llama-3.2-1b", "4.55.0", "bf16-amp", "sdpa")])
def test_reference_cache_held_as_the_old_code_saves_it_on_the_cpu(model, version, precision, attention):
    """Before 4.56 the cache holds the layer's own rotated keys and values (spec.tf_releases.kv_cache_kind):
    the estimate's bytes per token the output holds beyond autograd (``LayerCoefs.held``) and its
    whole cache (``.cache``) equal what the release's lines keep on a CPU run, per key/value element:
    a fused kernel saves the cache's tensors, eager's matmul, the math path and repeat_kv (grouped
    heads before 4.54) copy them (except matmul's at one sequence, where its reshape is a view:
    ``LayerCoefs.held_b1``); under autocast the keys are fp32 from Llama 4.43."""
    from trainmem.spec.tf_releases import kv_cache_kind, parse_transformers_version, rotary_keys_half
    r = resolve(model, precision=precision, transformers_version=version, attention=attention, seq_len=S)
    m, release = r.model, parse_transformers_version(version)
    assert kv_cache_kind(release) == "reference"
    lc = layer_coefficients(layer_key(m, r.training))
    d = 16  # a narrow head: the bytes per key/value element do not depend on the width
    gqa = m.num_heads // m.num_kv_heads if release < (4, 54) or attention == "eager" else 1
    per_element = 2 * d  # two kv heads of d elements per token
    for b, held in ((2, lc.held), (1, lc.held_b1)):
        unsaved, cache = _old_llama_cache(2 * gqa, 2, d, precision, attention, rotary_keys_half(m, release), b)
        assert (held / m.kv_size, lc.cache / m.kv_size) == (unsaved / per_element, cache / per_element), b


def _old_gpt2_cache(attention: str, b: int, h: int = 32, heads: int = 2) -> tuple[float, float]:
    """GPT-2's attention before 4.56 run for real on the CPU in bf16 (4.16.2 ``modeling_gpt2.py``
    L192-229, L279-285, L313-329; 4.42.4 ``GPT2SdpaAttention`` L623-660): ``c_attn``'s output split
    into q, k, v and seen as heads by ``view`` + ``permute``, ``present = (key, value)``, then eager's
    two matmuls or SDPA. Returns (bytes per token of ``c_attn``'s output the cache's views keep that
    autograd does not save, bytes per token the cache keeps), read by saved-tensor hooks."""
    s, d = 16, h // heads
    x = torch.randn(b * s, h, dtype=torch.bfloat16, requires_grad=True)
    w, bias = torch.randn(h, 3 * h, dtype=torch.bfloat16), torch.zeros(3 * h, dtype=torch.bfloat16)
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        qkv = torch.addmm(bias, x, w).view(b, s, 3 * h)   # Conv1D
        q, k, v = (t.view(b, s, heads, d).permute(0, 2, 1, 3) for t in qkv.split(h, dim=2))  # _split_heads
        present = (k, v)
        if attention == "eager":
            scores = torch.matmul(q, k.transpose(-1, -2)) / (float(d) ** 0.5)
            causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
            scores = torch.where(causal, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype))
            out = torch.matmul(F.softmax(scores, dim=-1).type(v.dtype), v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    del out
    storage = present[0].untyped_storage()
    return (0.0 if storage.data_ptr() in saved else storage.nbytes() / (b * s)), storage.nbytes() / (b * s)


@pytest.mark.parametrize("version,attention", [("4.21", "eager"), ("4.45.2", "sdpa")])
def test_gpt2_cache_views_keep_c_attn_output_as_the_old_code_on_the_cpu(version, attention):
    """GPT-2 before 4.56: the cache's k and v are views of ``c_attn``'s whole (b, s, 3h) output;
    eager's matmuls save copies of the strided q, k, v (views at one sequence), SDPA the views
    themselves. The estimate's held and cache bytes per token (bf16) match the CPU run's per
    element of ``c_attn``'s output, at two sequences and at one (``LayerCoefs.held_b1``)."""
    r = resolve("gpt2", precision="bf16", transformers_version=version, attention=attention, seq_len=S)
    lc = layer_coefficients(layer_key(r.model, r.training))
    width = 3 * r.model.hidden_size
    for b, held in ((2, lc.held), (1, lc.held_b1)):
        unsaved, cache = _old_gpt2_cache(attention, b)
        assert (held / width, lc.cache / width) == (unsaved / 96, cache / 96), b
    assert lc.cache == width * 2


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3.2-1b"])
def test_installed_cache_copies_held_as_its_eager_attention_saves_them(model):
    """The installed release (4.56 and later, ``kv_cache_kind`` "copy"): the installed
    ``DynamicCache`` returns new tensors, and the installed eager attention
    (``modeling_llama.eager_attention_forward``) saves them through views, or, for grouped heads,
    ``repeat_kv``'s copies: the cache is then held by the output alone. The estimate's held bytes per
    token in pure bf16 match a CPU run of those two functions, per key/value element."""
    from types import SimpleNamespace

    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from trainmem.spec.tf_releases import code_release, kv_cache_kind
    r = resolve(model, precision="bf16", attention="eager", seq_len=S)
    m, lc = r.model, layer_coefficients(layer_key(r.model, r.training))
    assert kv_cache_kind(code_release(None)) == "copy"
    groups, b, s, d = m.num_heads // m.num_kv_heads, 2, 16, 8
    q = torch.randn(b, 2 * groups, s, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, 2, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        keys, values = DynamicCache().update(k, v, 0)
        eager_attention_forward(SimpleNamespace(num_key_value_groups=groups, training=True), q, keys, values,
                                None, d ** -0.5)
    assert keys is not k and values is not v  # copies
    unsaved = sum(t.untyped_storage().nbytes() for t in (keys, values) if t.untyped_storage().data_ptr() not in saved)
    assert lc.held / m.kv_size == unsaved / (b * s * 2 * d)
    assert (lc.held > 0) == (groups > 1)


def test_older_cache_refusals_spare_runs_without_a_cache():
    """Granite's and --compile's refusals of an older release's cache (spec.tf_releases) leave runs that
    build none: gradient checkpointing (the published FMS Granite runs), ``--use-cache false``; and a
    release with the cache's copies."""
    for kw in ({"recompute": "full"}, {"use_cache": False}):
        resolve("granite-3.1-8b", transformers_version="4.45.2", precision="bf16-amp", attention="flash", **kw)
        resolve("llama-3.2-1b", transformers_version="4.55", compile=True, **kw)
    resolve("llama-3.2-1b", transformers_version="4.56", compile=True)
    resolve("granite-3.1-8b", transformers_version="4.45.2", precision="bf16", attention="flash")
