"""Terms added to a layer's coefficients: the pipeline stage's layer, a derived layer's clamp, LitGPT's
fused QKV, LoRA on fused QKV, torch's MultiheadAttention and split gate/up projections."""
from __future__ import annotations

from dataclasses import replace

from ...errors import TrainmemError
from ...spec.model import ModelSpec
from ...spec.tf_releases import eager_clamp
from ...spec.training import TrainingSpec
from ..derived import adapters_computed_half, layer_coefs as derived_layer
from ..layers import HALF, LayerCoefs, Policy, layer_coefficients, layer_sdpa_backend, sdpa_saves_padded
from ..states import default_lora_targets
from .model_facts import F32, layer_key


def fused_qkv_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--fused-qkv``: litgpt's ``CausalSelfAttention`` computes q, k and v with one linear of
    ``(n_head + 2 * n_query_groups) * head_size`` outputs, views it as (B, T, groups, q_per_kv + 2,
    head) and permutes it to (B, groups, q_per_kv + 2, T, head), splits q, k and v and reshapes each
    to (B, heads, T, head) (litgpt 0.5.3 ``litgpt/model.py`` L268-290; the same at 00af8b0d). With
    one query head per key/value group (q_per_kv = 1) those reshapes are views of the fused output,
    and the value goes to SDPA as such: SDPA saves it, so the whole fused output (with LoRA, the sum
    ``pretrained + lora``) stays alive until the layer's backward. transformers' attention (separate
    ``q_proj``/``k_proj``/``v_proj``) keeps only the value projection's output, counted already: the
    difference is the query and key widths, per token, in the matmul dtype (``pol.half``; shape
    (b, s, q_size + kv_size)). With grouped-query heads (q_per_kv > 1) ``expand`` then ``reshape``
    copies, and nothing more is kept (litgpt v0.5.13 ``litgpt/model.py`` L472-479, L490-499,
    L536-539 splits the fused output into q, k and v views and repeats k and v with
    ``repeat_interleave``: the same tensors kept). Nor when the flash kernel pads a head_dim that
    is not a multiple of 8 (``layers.sdpa_saves_padded``): SDPA then saves a padded copy of the
    value, not the view, and the fused output is freed with the layer's forward (found on the
    lightning-thunder Lit-GPT open_llama_3b run, head_dim 100: trace keeps no fused output, and the
    estimate was 1300 MiB over it at 2 x 2048 tokens, 26 layers). Under autocast with the weights trained (no
    LoRA), each of transformers' three linears casts the fp32 input to half for itself and saves
    that cast (autocast caches weights, not activations); litgpt's one linear makes and saves one:
    two (b, s, h) half casts fewer (found by trace: Mistral-shaped, bf16-amp, 16 MiB over 2 layers at
    2 x 1024 tokens). With LoRA on q, k or v, ``fused_qkv_lora``'s terms too."""
    if not t.fused_qkv:
        return lc
    parts = [(n, b) for n, b in fused_qkv_lora(m, t, pol) if b]
    if m.num_heads == m.num_kv_heads and not sdpa_saves_padded(layer_key(m, t)):
        parts.append(("attn.fused_qkv", float((m.q_size + m.kv_size) * pol.half)))  # (b, s, q + k) of the output
    if pol.amp and not t.lora_rank:  # (b, s, h) half casts of the input: transformers' three, litgpt's one
        parts.append(("attn.fused_qkv.one_cast", -2.0 * m.hidden_size * HALF))
    if not parts:
        return lc
    extra = sum(b for _, b in parts)
    tensors = lc.tensors + tuple((b, 0.0) for _, b in parts) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + tuple((n, b, 0.0) for n, b in parts), tensors=tensors)


def _stage_layer(m: ModelSpec, t: TrainingSpec, pol: Policy, stage: str) -> LayerCoefs:
    """The stage's layer: a derived architecture's traced coefficients (with an older release's
    clamp, ``derived_clamp``), else the hand-written recipe's."""
    if m.family == "derived":
        return derived_clamp(m, t, pol, derived_layer(m, t, stage))
    return layer_coefficients(layer_key(m, t))


def derived_clamp(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """A derived layer (traced from the installed transformers) as an older release's eager
    attention runs it, where the two differ by one saved tensor (``spec.tf_releases.eager_clamp``:
    OPT before 4.49). ``OPTAttention.forward`` adds the (b, 1, s, s) mask to the (b, heads, s, s) bmm
    scores and clamps the sum with ``torch.max(attn_weights, torch.tensor(finfo.min))`` (4.28.1
    ``modeling_opt.py`` L224-225; with ``device=`` from 4.30: a 0-dim tensor per layer, not counted),
    whose backward keeps the sum: per layer, heads x dtype bytes per token x key, in the scores'
    dtype. ``spec.tf_releases.transformers_problems`` admits fp16 and fp32 only, where the rest of
    that release's eager path (``softmax(dtype=float32).to(float16)`` for fp16 scores, plain softmax
    for fp32, dropout, ``bmm`` with the values) saves what the installed ``eager_attention_forward``
    saves. The layer's traced backward transients are kept as measured relative to its saved
    tensors: exact for the moments before ``MaximumBackward`` runs (the MLP, the output projection,
    ``bmm``'s and softmax's backward), one tensor high for the q/k/v projections' backward after it."""
    if not (t.attention == "eager" and eager_clamp(m, t.transformers_release)):
        return lc
    sq = float(m.num_heads * pol.half)  # (b, heads, s, s) in the scores' dtype: fp16 or fp32
    tensors = lc.tensors + ((0.0, sq),) if lc.tensors else lc.tensors
    return replace(lc, sq=lc.sq + sq, parts=lc.parts + (("attn.scores_clamp_input", 0.0, sq),), tensors=tensors)


def litgpt_terms(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """A layer of transformers' model as litgpt's own modules differ from it (``--fused-qkv``,
    ``--split-gate-up``), or torchvision's (``--attention-call mha``): ``lc`` with their per-token
    terms added."""
    return mha_kept(m, t, pol, split_gate_up_kept(m, t, pol, lora_qkv_kept(m, t, pol, fused_qkv_kept(m, t, pol, lc))))


def lora_qkv_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--lora-qkv``: litgpt's ``LoRAQKVLinear`` on a model's own fused ``query_key_value`` (GPT-NeoX,
    Falcon), against peft's adapter on the whole linear that the derived layer was traced with: bytes per
    token of one layer, in the adapters' dtype (``pol.half`` for half adapters, else fp32; half under
    autocast). ``forward`` runs ``after_A = F.linear(self.lora_dropout(x), self.lora_A)`` (one dropout,
    as peft's), ``after_B = self.conv1d(after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1))``, whose
    grouped conv saves its (b, r * n, s) input where peft's ``lora_B`` saves a (b, s, r) one
    (``lora.qkv.lora_A_rows``: (n - 1) * r more), and ``zero_pad``: with some but not all parts
    enabled, ``result.index_copy(1, lora_ind, x.reshape(-1, sum(self.qkv_shapes)))`` scatters the
    (b * s, enabled widths) delta into zeros of the fused width (lit_gpt/lora.py L256-296 at 8641822;
    litgpt/lora.py L334-338 at 43c44323), and ``index_copy``'s backward reads its ``source``
    (derivatives.yaml: ``source: grad.index_select(dim, index)...``; ``fused_qkv_lora``), so the delta
    stays saved until the layer's backward (``lora.qkv.zero_pad``). peft's full-width delta is saved
    by nothing. StableLM-3B, q and v: 16 layers x 8192 x 2 B = 0.27 MB per token."""
    if not t.lora_qkv:
        return lc
    from ..states import fused_qkv_widths
    widths = fused_qkv_widths(m, t)
    adapter = HALF if pol.amp else (pol.half if adapters_computed_half(t) else F32)
    parts = [("lora.qkv.lora_A_rows", float((len(widths) - 1) * t.lora_rank * adapter))]
    if len(widths) < 3:
        parts.append(("lora.qkv.zero_pad", float(sum(widths) * adapter)))
    parts = [(n, b) for n, b in parts if b]
    if not parts:
        return lc
    extra = sum(b for _, b in parts)
    tensors = lc.tensors + tuple((b, 0.0) for _, b in parts) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + tuple((n, b, 0.0) for n, b in parts), tensors=tensors)


def mha_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--attention-call mha``: torchvision's ``EncoderBlock`` runs ``nn.MultiheadAttention(x, x, x,
    need_weights=False)`` (torchvision/models/vision_transformer.py ``EncoderBlock.forward``), whose
    ``F.multi_head_attention_forward`` (torch/nn/functional.py, 2.0-2.13) works sequence-first: it
    makes q, k and v one contiguous (3, s, b, h) copy of the packed ``in_proj`` output
    (``_in_projection_packed``) and hands SDPA (b, heads, s, d) views of it, then runs
    ``attn_output.permute(2, 0, 1, 3).contiguous()`` for ``out_proj``. Against transformers'
    ``ViTSelfAttention`` + ``ViTSelfOutput`` (three linears, batch-first) that saves, per layer:

    * one (b, s, h) tensor more, in the matmul dtype (``pol.half``), where the kernel lays its output
      out as (b, s, heads, d) whatever the query's strides: the memory-efficient kernel
      (``_efficient_attention_forward``: ``at::empty({B, M, num_heads, Kv})``) and, before PyTorch
      2.2, the flash kernel (FlashAttention v1 packs q, k, v as (b * s, heads, d) and returns a
      contiguous output; FlashAttention-2, which SDPA runs from 2.2 on (the 2.2 release notes; pytorch/pytorch
      issue #106280 "Ship FlashAttentionV2"), allocates ``empty_like(q)``). MHA's
      permute of that output is then a copy, which ``out_proj``'s ``linear`` saves beside the output
      SDPA keeps; transformers' ``transpose(1, 2).contiguous()`` of it is a view. With FlashAttention-2
      the output follows the query's sequence-first layout and the permute is a view: nothing more
      (so on the CPU, whose flash kernel does the same: tests/test_memopt.py);
    * under autocast, two (b, s, h) half tensors fewer: the one packed ``in_proj`` casts the fp32
      LayerNorm output to half once and saves it once, transformers' three linears three times (on
      the CPU, measured: tests/test_memopt.py).

    The math and cuDNN kernels keep other tensors of the packed copy (the math kernel's value is a
    view of it) and are refused."""
    if t.attention_call != "mha":
        return lc
    backend = layer_sdpa_backend(layer_key(m, t))
    if backend not in ("efficient", "flash"):
        raise TrainmemError(f"--attention-call mha is modelled for SDPA's memory-efficient and flash kernels; this "
                            f"setup runs the {backend} kernel: give --attention sdpa-efficient or drop --attention-call")
    release = t.torch_release
    parts = []
    if backend == "efficient" or (release is not None and release < (2, 2)):
        parts.append(("attn.mha_out_copy", float(m.hidden_size * pol.half)))  # (b, s, h): the permuted output
    if pol.amp:
        parts.append(("attn.mha_one_cast", -2.0 * m.hidden_size * HALF))  # (b, s, h) half casts: 1, not 3
    if not parts:
        return lc
    extra = sum(b for _, b in parts)
    tensors = lc.tensors + tuple((b, 0.0) for _, b in parts) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + tuple((n, b, 0.0) for n, b in parts), tensors=tensors)


def split_gate_up_kept(m: ModelSpec, t: TrainingSpec, pol: Policy, lc: LayerCoefs) -> LayerCoefs:
    """``--split-gate-up``: litgpt's ``LLaMAMLP`` runs the gate and up projections as two
    ``LoRALinear``s, ``fc_1`` and ``fc_2``, each with its own ``nn.Dropout`` and ``lora_A``
    (litgpt/lora.py ``LLaMAMLP.__init__`` at f247be87; litgpt/config.py there gives Phi-3
    ``mlp_class_name="LLaMAMLP"``, and scripts/convert_hf_checkpoint.py L294-298 splits the
    checkpoint's ``gate_up_proj`` into ``fc_1`` and ``fc_2``), where transformers' ``Phi3MLP`` has one
    fused ``gate_up_proj`` and peft one adapter on it. With LoRA on it and a LoRA dropout, litgpt
    keeps one more 1-byte mask and dropped (b, s, h) copy per layer (in the adapters' dtype; lora_A's
    half cast under autocast) and one more rank-r ``lora_A`` output; the projections' outputs are the
    same bytes (``fc_1``'s saved by the SiLU, ``fc_2``'s by the product, where transformers' two
    chunks are views that keep the fused output). Under autocast with the weights trained (no LoRA)
    each of the two linears casts the fp32 input to half for itself and saves that cast, where
    transformers' one linear saves one: one (b, s, h) half cast more (found by trace: Phi-3-shaped,
    bf16-amp, 8 MiB over 2 layers at 2 x 1024 tokens)."""
    if not t.split_gate_up:
        return lc
    if pol.amp and not t.lora_rank:
        extra = float(m.hidden_size * HALF)  # fc_2's own (b, s, h) half cast of the input
    elif t.lora_rank and "gate_up_proj" in set(t.lora_targets or default_lora_targets(m)):
        adapter = pol.half if adapters_computed_half(t) else F32
        dropped = HALF if pol.amp else adapter
        # a dropout: its mask and dropped copy; none: under autocast the second lora_A's own half cast
        own = m.hidden_size * (1 + dropped) if t.lora_dropout > 0 else (m.hidden_size * HALF if pol.amp else 0)
        extra = float(own + t.lora_rank * dropped)
    else:
        return lc
    tensors = lc.tensors + ((extra, 0.0),) if lc.tensors else lc.tensors
    return replace(lc, tok=lc.tok + extra, parts=lc.parts + (("lora.mlp.split_gate_up", extra, 0.0),), tensors=tensors)


def fused_qkv_lora(m: ModelSpec, t: TrainingSpec, pol: Policy) -> tuple[tuple[str, float], ...]:
    """LoRA on litgpt's fused q/k/v linear (``LoRAQKVLinear``), against peft's adapters on the
    separate ``q_proj``/``k_proj``/``v_proj`` that the layer recipe counts: bytes per token, by name.

    * One dropout, one ``lora_A``: ``F.linear(self.lora_dropout(x), self.lora_A)`` runs once over the
      shared input with ``lora_A`` of ``r * n`` rows for the n enabled parts (litgpt/lora.py
      ``LoRAQKVLinear.__init__`` and ``forward``, at 43c44323 and 00af8b0d; lit_gpt/lora.py at
      29de2828), where peft puts an ``nn.Dropout`` and an ``lora_A`` on each of the n linears, each
      saving a 1-byte mask and its dropped (b, s, h) copy: n - 1 of those are not made (negative).
    * ``zero_pad``: with some but not all of q, k and v enabled the delta (b, s, widths of the enabled
      parts) is scattered into zeros of the fused width with ``index_copy`` (or ``index_copy_``,
      litgpt from f247be87), whose backward formula reads ``source`` (tools/autograd's
      derivatives.yaml, ``index_copy``: ``source.dim() > 0 ? grad.index_select(dim, index).expand_as(
      source) : ...``), so autograd saves the delta until the layer's backward (checked on the CPU:
      ``IndexCopyBackward0._saved_source``).
    The delta and the dropped copy are in the adapters' dtype (``pol.half`` for half adapters, else
    fp32; under autocast lora_A saves its half cast and lora_B's output is half)."""
    if not t.lora_rank:
        return ()
    targets = set(t.lora_targets or default_lora_targets(m))
    widths = {"q_proj": m.q_size, "k_proj": m.kv_size, "v_proj": m.kv_size}
    on = [w for name, w in widths.items() if name in targets]
    adapter = pol.half if adapters_computed_half(t) else F32
    dropped = HALF if pol.amp else adapter   # lora_A's saved input (Builder.adapter)
    out = []
    if t.lora_dropout > 0 and len(on) > 1:  # (b, s, h) mask (1 B) and dropped copy per extra peft adapter
        out.append(("lora.qkv.one_dropout", -float((len(on) - 1) * m.hidden_size * (1 + dropped))))
    elif pol.amp and len(on) > 1:  # no dropout: each peft lora_A saves its own half cast of the fp32 input
        out.append(("lora.qkv.one_cast", -float((len(on) - 1) * m.hidden_size * HALF)))
    if 0 < len(on) < 3:
        out.append(("lora.qkv.zero_pad", float(sum(on) * (HALF if pol.amp else adapter))))
    return tuple(out)
