"""The transformers release a run uses (``--transformers-version``): what older model code holds.

trainmem's layer recipes and loss follow the installed transformers (5.x). Published runs, and
many users, ran older releases whose model code keeps other tensors. ``TrainingSpec.
transformers_version`` names the release; None means the installed one. Read from the wheels
of each release on PyPI (``transformers-X-py3-none-any.whl``, ``transformers/models/...``); line
numbers are those files'. What depends on it, for the hand-written families:

* **The causal-LM loss** (``causal_lm_loss``), one of ``LOSS_KINDS``:
  - ``"shift-half"``: ``shift_logits = logits[..., :-1, :].contiguous()`` on the head's output as it
    is, then ``CrossEntropyLoss``: trainmem's ``--loss half --loss-shift logits``. GPT-2 before 4.49
    (4.16.2 ``modeling_gpt2.py`` L1069-1078; 4.48.0 L1083-1094); Llama 4.28-4.30 (4.28.1
    ``modeling_llama.py`` L705, 4.30.2 L706); OPT before 4.49 (4.28.1 ``modeling_opt.py``
    L950-959, 4.48.0 L1188-1199).
  - ``"forward-fp32"``: the model's forward upcasts the logits (``logits = logits.float()``) and
    returns the fp32 tensor; the loss copies the shifted fp32 logits. Llama 4.31-4.45 (4.31.0
    ``modeling_llama.py`` L825-830; 4.44.2 L1209-1214; 4.45.2 L1214-1221: ``self.lm_head(...).float()``),
    Mistral 4.34-4.47 (4.35.2 L1023-1028; 4.46.0 and 4.47.0 upcast with labels only, rebinding the
    returned ``logits``: 4.46.0 L1080-1103), Mixtral 4.36-4.45 (4.36.0 L1227-1232; 4.44.2 L1290-1295),
    Qwen2 4.37-4.45 (4.40.0 L1183-1188; 4.45.2 L1187-1194).
  - ``"loss-fp32-shift"``: the model returns the half logits; ``loss_utils.ForCausalLMLoss``
    upcasts them (``logits = logits.float()``, alive until it returns) and copies the shifted fp32
    logits (4.46.0 ``loss/loss_utils.py`` L32-46, 4.48.0 L32-47). Llama, Qwen2, Mixtral 4.46-4.48
    (4.46.0 ``modeling_llama.py`` L1210-1214), Mistral 4.48.
  - ``"labels"``: ``ForCausalLMLoss`` pads and shifts the labels instead (4.49.0 ``loss_utils.py``
    L32-47: ``labels = nn.functional.pad(labels, (0, 1), value=ignore_index)``): the installed code,
    trainmem's model's own loss. GPT-2 and OPT call it from 4.49 (4.49.0 ``modeling_gpt2.py``
    L1084-1093, ``modeling_opt.py`` L1202).
  Granite (derived) 4.45-4.47 is ``"forward-fp32"``: ``logits = logits / self.config.logits_scaling``
  then ``logits = logits.float()`` (4.45.2 ``modeling_granite.py`` L1102-1108; 4.46.0 and 4.47.0 upcast
  with labels only, L1103-1110), 4.48 ``"loss-fp32-shift"`` (4.48.0 L862-866), 4.49 ``"labels"``.
  BERT's masked-LM and classification heads call ``CrossEntropyLoss`` on their logits in every
  release read (4.16.2 to 5.23): unchanged.
* **The default attention** (``default_attention``): eager until the family's transformers class
  declares ``_supports_sdpa = True``, from which release transformers picks SDPA by default (with
  torch >= 2.1.1, ``modeling_utils._check_and_enable_sdpa``, 4.36.0 L1456): Llama 4.36 (absent in
  4.35.2), Mistral, Mixtral and Qwen2 4.37 (absent in 4.36.0's Mistral and Mixtral), BERT 4.41
  (absent in 4.40.0), GPT-2 4.42 (absent in 4.41.0), OPT 4.47. Applied by ``spec.resolve`` only
  when ``--attention`` is not given; ``--attention sdpa`` before that release is refused, and so is
  ``--attention flash`` before the class supports flash_attention_2 (``FLASH_SINCE``).
* **SDPA with grouped keys and values** (``sdpa_repeats_kv``): before 4.54 the Llama-style classes
  copy K and V to the query's heads before ``scaled_dot_product_attention`` (``repeat_kv``); the
  kernel saves the copies. The estimate's layer recipe then runs as under ``--attention-call
  repeat-kv`` (the same ``expand`` + ``reshape``, ``is_causal`` and no mask). Granite (derived) with
  grouped heads refuses SDPA there.
* **Llama's SDPA call of 4.38-4.39**: ``LlamaModel._update_causal_mask`` materialises the causal
  mask and ``LlamaSdpaAttention`` passes it as ``attn_mask`` without ``is_causal`` (4.39.0
  ``modeling_llama.py`` L1058-1097, L674; 4.38.0 registers a ``causal_mask`` buffer), so CUDA runs the
  memory-efficient kernel with a mask; 4.40 skips the mask when it is only causal
  (``AttentionMaskConverter._ignore_causal_mask_sdpa``). Not modelled: refused.
* **Mixtral's experts** (``moe_expert_loop``): before 5.0 ``MixtralSparseMoeBlock`` holds a
  ``ModuleList`` of ``MixtralBlockSparseTop2MLP`` (``w2(act_fn(w1(x)) * w3(x))``, three ``nn.Linear``) and
  loops over them: each expert gathers its rows (``hidden_states[None, top_x]``), runs its MLP, multiplies
  by its routing weights (cast to the hidden dtype) and ``index_add_``s the result (4.39.3
  ``modeling_mixtral.py`` L840-883, 4.48.0 L112-150). Backward runs expert by expert (``layers._moe_loop``):
  its transients are one expert's rows, not the ``b*s*top_k`` rows of 5.x's grouped experts.
* **Eager attention's clamp** (``eager_clamp``): Llama 4.28-4.30 (4.28.1 ``modeling_llama.py``
  L227-228, 4.30.2 L226-228; gone in 4.31.0) and OPT before 4.49 (4.28.1 ``modeling_opt.py`` L224-225,
  4.48.0 L201-203) follow the mask addition with ``attn_weights = torch.max(attn_weights,
  torch.tensor(torch.finfo(attn_weights.dtype).min))``. ``maximum``'s derivative reads both inputs
  (tools/autograd/derivatives.yaml ``maximum``: ``at::where(self == other, grad / 2, grad)
  .masked_fill_(self < other, 0)``), so autograd saves the masked scores ``(b, heads, s, s)`` until
  the layer's backward, in the sum's dtype: the mask is built in ``inputs_embeds.dtype``
  (``_prepare_decoder_attention_mask``, 4.28.1 ``modeling_llama.py`` L464-473, ``modeling_opt.py``
  L538-547), so fp32 under autocast (fp32 embeddings), else the weights' dtype. Other eager differences of those releases save nothing more (GPT-2's ``torch.where``
  with its bool buffer, BERT's mask addition, the scaling by a 0-dim tensor).
* **The KV cache's value dtype** (``cache_values_own_dtype``): transformers' decoders build a
  ``DynamicCache`` in training whenever ``use_cache`` is set, and its ``torch.cat`` copies are the keys
  and values attention consumes. Up to 5.23 ``DynamicLayer.lazy_initialization`` created both empty
  tensors in the keys' dtype (5.23.0 ``cache_utils.py`` L113-116), so under autocast, where rotary
  makes fp32 keys, the half values were promoted to an fp32 copy; 5.24 creates the value cache in the
  values' own dtype (5.24.0 ``cache_utils.py`` L113-116), so that copy stays half and is the tensor
  attention saves. This rule applies to the run's code release (``code_release``): the given one, else
  the installed transformers, else the newest release read (``NEWEST_READ``), so an estimate agrees
  with a trace of the installed code; without transformers installed it models the newest release.
* **The KV cache's tensors** (``kv_cache_kind``, ``rotary_keys_half``): in training, with
  ``use_cache`` (default True), every release read builds a cache; each family's model turns it off
  under gradient checkpointing only (``if self.gradient_checkpointing and self.training: ...
  use_cache = False`` with a warning: Llama 4.28.1 ``modeling_llama.py`` L547, 4.35.2 L893-898, 4.36.0
  L1039; GPT-2 4.16.2 ``modeling_gpt2.py`` L871, 4.50.0 L887, 4.56.0 L839), as trainmem's ``kv_cache``
  assumes. What the cache holds changed twice:
  - ``"reference"``, before 4.56: the layer's own keys and values, no copy. Up to 4.35 the layer returns
    the tuple ``past_key_value = (key_states, value_states) if use_cache else None`` (Llama 4.28.1
    ``modeling_llama.py`` L212, 4.35.2 L385; Mistral 4.35.2 L263; GPT-2 ``present = (key, value)``, 4.16.2
    L329 to 4.50.0 L308, views of ``c_attn``'s output); 4.36-4.53 ``DynamicCache.update`` appends them
    on a layer's first update (4.36.0 ``cache_utils.py`` L124 ``self.key_cache.append(key_states)``,
    4.53.3 L549) and returns them; 4.54-4.55 ``DynamicLayer.update`` binds them (4.54.0 L98-100,
    4.55.4 L98-100: ``self.keys = key_states``). The cache is taken before ``repeat_kv`` in every
    release (4.35.2 ``modeling_llama.py`` L385-388, 4.45.2 L635-638). The keys are the rotary output
    and the values ``v_proj``'s output seen as ``(b, heads, s, d)`` through ``view(...).transpose(1,
    2)``: strided tensors in (b, s, heads, d) memory. A fused SDPA kernel (and flash_attention_2)
    takes and saves them as they are, so the cache costs nothing more while the graph lives; eager
    attention's ``torch.matmul`` (and SDPA's math path) folds (b, heads) into ``bmm``'s batch
    (``_matmul_impl``: ``expand(...).reshape(...)``), a contiguous copy of such a tensor at b > 1 (a
    view at b == 1), which autograd saves instead, and ``repeat_kv`` for grouped heads copies them
    too: the cache's tensors are then held by the output alone. GPT-2's views keep ``c_attn``'s whole
    ``(b, s, q + 2 kv)`` output alive. Checked by CPU runs of each release's lines
    (tests/test_transformers_version.py).
  - ``"copy"``, from 4.56: ``DynamicLayer.lazy_initialization`` creates empty tensors and
    ``update`` returns ``torch.cat`` copies (4.56.0 ``cache_utils.py`` L90-117), contiguous ones that
    attention takes and saves (their dtype: the value dtype above).
  Under autocast the rotated keys are half while the rotary's ``cos``/``sin`` are cast to the values'
  dtype, ``self.rotary_emb(value_states, ...)`` returning ``cos.to(dtype=x.dtype)`` (Llama 4.35.2
  ``modeling_llama.py`` L144-145, L377; 4.42.4 L120, L334), and fp32 from the release whose model
  computes them once from the embeddings' fp32 output (``position_embeddings =
  self.rotary_emb(hidden_states, position_ids)``): Llama 4.43 (4.43.4 L920), Qwen2 4.45 (4.45.2 L952;
  4.44.2 L311 on the values), Mistral and Mixtral 4.48 (4.48.0 ``modeling_mistral.py`` L538,
  ``modeling_mixtral.py`` L665; 4.47.0 on the values). OPT's cache of those releases holds the
  contiguous ``_shape`` copies that ``bmm`` saves through views (4.30.2 ``modeling_opt.py`` L153-154,
  L203-208), the bytes of the installed code's copies; Granite's (derived, 4.45.2
  ``modeling_granite.py`` L318-320, L868) is refused where it differs (``granite_cache_differs``).
* **Each attention layer's own rotary cache** (``layer_rotary_cache``): Llama 4.34-4.36, Mistral
  4.34-4.41, Mixtral 4.36-4.47 and Qwen2 4.37-4.44 build a ``*RotaryEmbedding`` in every attention
  layer (``self.rotary_emb = MistralRotaryEmbedding(self.head_dim, max_position_embeddings=...)``,
  4.39.3 ``modeling_mistral.py`` L232-236) whose ``__init__`` fills ``cos_cached`` and ``sin_cached``
  (``register_buffer(..., persistent=False)``) for all ``max_position_embeddings`` positions, each
  ``[max_position_embeddings, head_dim]`` in ``torch.get_default_dtype()`` (L103-116), which
  ``from_pretrained`` sets to the ``torch_dtype`` it loads in (``_set_default_torch_dtype``, 4.39.3
  ``modeling_utils.py`` L1304). Read: Llama 4.34.1 L141-142 (``[None, None]`` views), 4.35.2
  L135-136, 4.36.0 L145-146 (4.39.3 computes them per call); Mistral 4.34.1 L152-153, 4.36.0, 4.39.3,
  4.40.0, 4.41.2 (4.42.4 has none); Mixtral 4.36.0 L177-178, 4.39.3 L207-208, 4.44.2, 4.45.2,
  4.46.0, 4.47.0 (4.48.0 has none); Qwen2 4.40.0 L116-117, 4.41.2, 4.42.4, 4.43.4, 4.44.2 (4.45.2 has
  none; 4.37-4.39 not read, taken as 4.40.0's). Mistral-7B's 32 layers x 2 x 32768 x 128 x 2 bytes are 512 MiB beside the weights, which
  FSDP does not shard (buffers stay whole on every rank). Llama 4.28-4.30 keep an fp32 cache of
  another shape and 4.31-4.33 were not read: not modelled.
* **Gradient checkpointing's default** (``reentrant_checkpointing``): before 5.0 transformers
  checkpoints with ``use_reentrant=True`` (``gradient_checkpointing_enable``: ``if
  gradient_checkpointing_kwargs is None: gradient_checkpointing_kwargs = {"use_reentrant": True}``,
  4.39.3 ``modeling_utils.py`` L2114-2115, 4.56.0 L3810; given ``{}`` it passes nothing and torch's
  default applies: ``use_reentrant=None`` warns and becomes True, torch 2.13 ``utils/checkpoint.py``
  L486-496). 5.18.0 defaults to ``{"use_reentrant": False}`` (L3139), as the installed 5.24 does
  (``_activation_checkpointing_enable`` L3157-3158): the change is taken at 5.0 (5.0-5.17 not read).
  A reentrant checkpoint runs the layer's first forward under ``no_grad``, so no autograd node of it
  exists; its recompute's nodes die with ``CheckpointFunction.backward``, which holds the recomputed
  output while it back-propagates the layer (``estimate.layers._reentrant_recompute``).
* **Derived architectures** (their layers are traced from the installed transformers): OPT and
  Granite only. OPT's layer of those releases differs from the installed one by the clamp alone in
  fp16 and fp32 (its softmax upcasts fp16 scores as the installed one does; bf16 ones it did not),
  so other precisions are refused before 4.49. Granite's decoder layer of 4.45.2
  (``GraniteDecoderLayer.forward`` L602-624; eager attention L320-335: ``softmax(dtype=float32)
  .to(query_states.dtype)``, no clamp) is the installed one's, op for op.
* **Other derived architectures from 5.17** (``DERIVED_RELEASES_FROM``): their model code of 5.17
  to 5.24 was diffed against the installed 5.24 for every catalogue type that is derived (phi, phi3,
  gemma2, qwen3, olmo2, starcoder2, ...): what changed is the KV cache (above), the ``cache`` renames,
  ``slice_logits_to_keep`` (the same view at ``logits_to_keep=0``) and rotary's cos/sin (computed
  once per step without gradient), and one attention rule: **Gemma-2's SDPA** (``sdpa_ignores_softcap``).
  Gemma2, T5Gemma and VaultGemma declare ``_supports_sdpa = True`` until 5.20 (4.42.4
  ``modeling_gemma2.py`` L712; 5.20.0 L352) and ``False  # sdpa does not support softcapping`` from
  5.21.0 (L352), whose ``sdpa_attention_forward`` raises on ``softcap`` (5.24.0
  ``integrations/sdpa_attention.py`` L106-109); before, that function took ``softcap`` in ``**kwargs``
  and dropped it, so the default attention ran SDPA (no ``(b, heads, s, s)`` scores, softcapping
  skipped) where 5.21 and later run eager. Measured on an H200 with 5.17.0 (validation/measured/gemma-2-2b-*):
  Gemma-2-2B, b 2, s 2048, bf16-amp: 67,856 MiB peak allocated, against 81,465 MiB that trace (5.24,
  eager) and the eager coefficients give. A derived estimate keys its coefficients on both rules
  (``estimate.derived.key``); a set that is not shipped is derived from the installed code only when
  that code follows the same rules.
* **What cannot be expressed** (``transformers_problems``): a release before a family existed,
  other derived architectures before 5.17, ``--compile`` before 4.54 (and before 4.56 with a KV cache), the
  older losses under ``--tp`` or ``--pp``, SDPA or flash before a class supports them, Granite's older
  KV cache where it differs (``granite_cache_differs``); trace and measure refuse any release but the
  installed one (``workload``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..errors import TrainmemError

#: the oldest release trainmem models (the oldest read: BERT's and GPT-2's code of 4.16.2)
TRANSFORMERS_OLDEST = (4, 16)
LOSS_KINDS = ("labels", "loss-fp32-shift", "forward-fp32", "shift-half")
#: the first release with each hand-written family's (and OPT's) model class
ADDED = {"llama": (4, 28), "mistral": (4, 34), "mixtral": (4, 36), "qwen2": (4, 37), "gpt2": (4, 16),
         "bert": (4, 16), "opt": (4, 19), "granite": (4, 45)}
#: the first release whose class supports SDPA (and so uses it by default)
SDPA_SINCE = {"llama": (4, 36), "mistral": (4, 37), "mixtral": (4, 37), "qwen2": (4, 37), "bert": (4, 41),
              "gpt2": (4, 42), "opt": (4, 47), "granite": (4, 45)}
#: the first release whose class supports transformers' flash_attention_2 (``_supports_flash_attn_2 = True``:
#: Llama and Mistral 4.34.0, absent in Llama's 4.32.0; Mixtral 4.36.0; Qwen2 4.37.0; GPT-2 4.40.0, absent in
#: 4.39.0; OPT 4.36.0, absent in 4.35.2; Granite 4.45.2; BERT ``_supports_flash_attn = True`` in 5.0.0, absent
#: in 4.54.0)
FLASH_SINCE = {"llama": (4, 34), "mistral": (4, 34), "mixtral": (4, 36), "qwen2": (4, 37), "gpt2": (4, 40),
               "opt": (4, 36), "granite": (4, 45), "bert": (5, 0)}
#: per model type, the loss kind from each release on (ascending); before the first: the first's
_LOSS = {
    "gpt2": (((4, 16), "shift-half"), ((4, 49), "labels")),
    "opt": (((4, 19), "shift-half"), ((4, 49), "labels")),
    "llama": (((4, 28), "shift-half"), ((4, 31), "forward-fp32"), ((4, 46), "loss-fp32-shift"), ((4, 49), "labels")),
    "mistral": (((4, 34), "forward-fp32"), ((4, 48), "loss-fp32-shift"), ((4, 49), "labels")),
    "mixtral": (((4, 36), "forward-fp32"), ((4, 46), "loss-fp32-shift"), ((4, 49), "labels")),
    "qwen2": (((4, 37), "forward-fp32"), ((4, 46), "loss-fp32-shift"), ((4, 49), "labels")),
    "granite": (((4, 45), "forward-fp32"), ((4, 48), "loss-fp32-shift"), ((4, 49), "labels")),
}
#: the releases (from, until) whose eager attention clamps the masked scores with ``torch.max``
_CLAMP = {"llama": ((4, 28), (4, 31)), "opt": ((4, 19), (4, 49))}
#: derived model types whose older code trainmem corrects (their layers are traced from the installed code)
DERIVED_TYPES = ("opt", "granite")
#: other derived architectures take --transformers-version from this release (module docstring)
DERIVED_RELEASES_FROM = (5, 17)
#: model types whose SDPA path ignored the attention-logit softcapping, until the release that
#: declared them without SDPA (module docstring: 5.20.0 ``_supports_sdpa = True``, 5.21.0 False)
SOFTCAP_SDPA_UNTIL = {"gemma2": (5, 21), "t5gemma": (5, 21), "vaultgemma": (5, 21)}


#: the newest release whose code was read: what the estimate models when none is given or installed
NEWEST_READ = (5, 24)
#: from this release a ``DynamicLayer`` creates its value cache in the values' own dtype
VALUES_OWN_DTYPE_SINCE = (5, 24)
#: from this release a ``DynamicLayer`` returns ``torch.cat`` copies (before: the layer's own tensors)
CACHE_COPIES_SINCE = (4, 56)
CACHE_KINDS = ("copy", "reference")
#: the first release whose model computes rotary's cos/sin from the embeddings (fp32 under autocast)
#: rather than per layer in the values' dtype
_ROTARY_FROM_EMBEDDINGS = {"llama": (4, 43), "qwen2": (4, 45), "mistral": (4, 48), "mixtral": (4, 48)}


def parse_transformers_version(text: Any) -> tuple[int, ...]:
    """``"4.45.2"``, ``"v4.36"`` or ``"4.49.0.dev0"`` as (4, 45, 2), (4, 36), (4, 49, 0); a
    TrainmemError naming the option for anything else or a release older than ``TRANSFORMERS_OLDEST``."""
    raw = str(text).strip().lstrip("v").split("+")[0]
    nums = []
    for p in raw.split(".")[:3]:  # major.minor[.patch], a suffix such as ".dev0" ignored
        if not p.isdigit():
            break
        nums.append(p)
    if len(nums) < 2:
        raise TrainmemError(f"--transformers-version {text!r} is not a transformers release like 4.45.2 or 4.36")
    v = tuple(int(p) for p in nums)
    if v < TRANSFORMERS_OLDEST:
        raise TrainmemError(f"--transformers-version {raw}: trainmem models transformers 4.16 and later; give 4.16 "
                            "or newer, or drop it")
    return v


def model_key(model: Any) -> str:
    """The model code a release table is read for: the config's ``model_type`` of a Llama-style
    family (llama, mistral, qwen2, mixtral), else the family (gpt2, bert), a derived OPT or Granite model type;
    "" for what the tables do not cover."""
    family, mtype = getattr(model, "family", ""), getattr(model, "model_type", "")
    if family in ("llama", "mixtral") and mtype in ("llama", "mistral", "qwen2", "mixtral"):
        return mtype
    if family in ("gpt2", "bert"):
        return family
    if family == "derived" and mtype in DERIVED_TYPES:
        return mtype
    return ""


def causal_lm_loss(model: Any, version: tuple[int, ...] | None) -> str:
    """How the model's own causal-LM loss treats the logits in ``version`` (``LOSS_KINDS``; module
    docstring); "labels" (the installed code) for None or a family without a table."""
    rules = _LOSS.get(model_key(model))
    if version is None or not rules or getattr(model, "head", "") != "causal-lm":
        return "labels"
    kind = rules[0][1]
    for since, value in rules:
        if version >= since:
            kind = value
    return kind


def eager_clamp(model: Any, version: tuple[int, ...] | None) -> bool:
    """Whether eager attention saves its masked scores for ``torch.max``'s backward (module docstring)."""
    span = _CLAMP.get(model_key(model))
    return version is not None and span is not None and span[0] <= version < span[1]


def sdpa_repeats_kv(model: Any, version: tuple[int, ...] | None) -> bool:
    """Whether a release's SDPA call copies grouped keys and values to the query's heads first
    (``repeat_kv``, ``expand`` + ``reshape``) for a Llama-style family: every release before 4.54
    (4.36.0 ``modeling_llama.py`` L710-719, 4.44.2 L642-660, 4.53.3 ``integrations/sdpa_attention.py``
    L41-42); 4.54 passes ``enable_gqa=True`` instead when there is no mask and torch >= 2.5
    (4.54.0 ``integrations/sdpa_attention.py`` L27-33, ``use_gqa_in_sdpa``). The kernel then saves the
    copies, as under litgpt's call (``--attention-call repeat-kv``, which the estimate reuses)."""
    return (version is not None and version < (4, 54)
            and model_key(model) in ("llama", "mistral", "qwen2", "mixtral", "granite"))


def default_attention(model: Any, version: tuple[int, ...] | None) -> str | None:
    """The attention a release uses when none is asked for: "eager" before the family's SDPA
    support (``SDPA_SINCE``), else None (trainmem's default stays)."""
    since = SDPA_SINCE.get(model_key(model))
    if version is None or since is None or version >= since:
        return None
    return "eager"


def transformers_problems(model: Any, t: Any) -> str | None:
    """One line saying what ``t.transformers_version`` cannot model for ``model`` (None: fine)."""
    if t.transformers_version is None:
        return None
    v = parse_transformers_version(t.transformers_version)
    key = model_key(model)
    name = f"--transformers-version {t.transformers_version}"
    if not key and getattr(model, "family", "") == "derived" and DERIVED_RELEASES_FROM <= v[:2] <= NEWEST_READ:
        return None  # traced from the installed code; the key follows the release (``estimate.derived.key``)
    if not key:
        what = (f"{model.name} is a derived architecture: its layers and loss are traced from the installed "
                f"transformers, and releases from {'.'.join(map(str, DERIVED_RELEASES_FROM))} to "
                f"{'.'.join(map(str, NEWEST_READ))} are modelled" if getattr(model, "family", "") == "derived" else
                f"{model.name} ({model.family}) has no release table")
        return f"{name}: {what}; drop --transformers-version (its code of that release is not modelled)"
    if v < ADDED[key]:
        return f"{name} has no {key} model (added in {'.'.join(map(str, ADDED[key]))}); give a later release"
    since = SDPA_SINCE[key]
    if v < since and t.attention not in ("eager", "flash"):
        return (f"{name}: its {key} class does not support SDPA (from {'.'.join(map(str, since))}); give --attention "
                "eager or a later release")
    if key == "llama" and (4, 38) <= v < (4, 40) and t.attention.startswith("sdpa"):
        return (f"{name}: Llama's SDPA call of 4.38-4.39 passes a materialised (b, 1, s, s) causal mask instead of "
                "is_causal, which trainmem does not model; give --attention eager or flash, or another release")
    if v < FLASH_SINCE[key] and t.attention == "flash":
        return (f"{name}: its {key} class does not support flash_attention_2 (from "
                f"{'.'.join(map(str, FLASH_SINCE[key]))}); give --attention eager or a later release")
    if t.compile and v < (4, 54):
        return (f"{name}: torch.compile's partition of that release's model code is not modelled (the compiled "
                "recipes are read off the installed code's graphs); drop --compile or give a release from 4.54")
    if t.compile and kv_cache_kind(v) == "reference" and cache_built(model, t):
        return (f"{name}: its KV cache holds the layers' own keys and values, which the compiled recipes (read off "
                "the installed code's graphs, whose cache holds copies) do not model; drop --compile, give --use-cache "
                "false, or a release from 4.56")
    loop = [f for f, on in ((f"--tp {t.tp}", t.tp > 1), (f"--pp {t.pp}", t.pp > 1)) if on]
    if t.loss is None and causal_lm_loss(model, v) != "labels" and loop:
        return (f"{name}: its {key} loss copies the logits, which trainmem models for the eager loss on one "
                f"pipeline stage without tensor parallelism; drop {loop[0]} or --transformers-version")
    gqa = getattr(model, "num_heads", 0) != getattr(model, "num_kv_heads", 0)
    if key == "granite" and gqa and t.attention.startswith("sdpa") and sdpa_repeats_kv(model, v):
        return (f"{name}: Granite's SDPA call of that release copies the grouped keys and values to the query's "
                "heads, which its derived coefficients (traced from the installed call) do not hold; give "
                "--attention flash or eager, or a release from 4.54")
    if key == "granite" and granite_cache_differs(model, t, v):
        return (f"{name}: Granite's KV cache of that release holds the layer's own keys and values, which its derived "
                "coefficients (traced from the installed code's copies) do not hold under autocast or eager or math "
                "attention; give --precision bf16 or fp16 with --attention sdpa or flash, --recompute full, "
                "--use-cache false, or a release from 4.56")
    if key in DERIVED_TYPES and t.precision not in ("fp16", "fp32") and eager_clamp(model, v):
        return (f"{name} with {model.name} and --precision {t.precision}: OPT's eager softmax of that release runs in "
                "the scores' dtype where the installed one upcasts, so only fp16 and fp32 are modelled; use one of "
                "them or a release from 4.49")
    return None


def granite_cache_differs(model: Any, t: Any, version: tuple[int, ...]) -> bool:
    """Whether derived Granite's KV cache in release ``version`` holds other bytes than the installed
    code's traced copies: a cache is built (``use_cache``, no gradient checkpointing or pipeline), the
    release keeps references (``kv_cache_kind``), and either autocast runs (the installed code's fp32
    value copy against the half ``v_proj`` output of the reference) or eager or math attention saves
    reshaped copies, leaving the reference's tensors held by the output alone (module docstring)."""
    return (cache_built(model, t) and kv_cache_kind(version) == "reference"
            and (t.precision.endswith("-amp") or t.attention in ("eager", "sdpa-math")))


def cache_built(model: Any, t: Any) -> bool:
    """Whether transformers builds a KV cache in the run: ``use_cache`` on, no gradient checkpointing,
    no pipeline or context parallel loop (``estimate.quantities.model_facts.kv_cache`` for the hand families)."""
    from .training import config_use_cache  # (training imports this module)
    return t.recompute not in ("full", "op") and t.pp * t.cp == 1 and config_use_cache(model.config, t)


#: the first release whose decoder layers checkpoint themselves (``GradientCheckpointingLayer.__call__``,
#: 4.52.1 modeling_layers.py: inside a wrapper such as an FSDP unit); before it the model's loop checkpoints
#: ``decoder_layer.__call__`` (4.48.1 models/mistral/modeling_mistral.py L548-559), the wrapper included
CHECKPOINT_IN_LAYER_SINCE = (4, 52)


def checkpoint_wraps_unit(version: tuple[int, ...] | None) -> bool:
    """Whether the model code of release ``version`` (None: the installed one) runs gradient checkpointing
    around the module a wrapper (an FSDP unit) replaced each decoder layer with, so that the wrapper
    receives the checkpoint's detached inputs in the recompute (``CHECKPOINT_IN_LAYER_SINCE``)."""
    return code_release(version) < CHECKPOINT_IN_LAYER_SINCE


def code_release(version: tuple[int, ...] | None) -> tuple[int, ...]:
    """The transformers release whose model code a run executes: ``version`` (``--transformers-version``),
    else the installed transformers (read from its package metadata, nothing imported), else
    ``NEWEST_READ``."""
    return version if version is not None else _installed_release()


@lru_cache(maxsize=1)
def _installed_release() -> tuple[int, ...]:
    try:
        return parse_transformers_version(installed_version())
    except Exception:  # not installed, or a version string that is not a release: the newest read
        return NEWEST_READ


def sdpa_ignores_softcap(model_type: str, version: tuple[int, ...]) -> bool:
    """Whether release ``version``'s class of ``model_type`` runs SDPA as its default attention,
    dropping the attention-logit softcapping (Gemma-2's; ``SOFTCAP_SDPA_UNTIL``, module docstring)."""
    until = SOFTCAP_SDPA_UNTIL.get(model_type)
    return until is not None and version < until


def cache_values_own_dtype(version: tuple[int, ...]) -> bool:
    """Whether release ``version``'s ``DynamicCache`` keeps the values in their own dtype (module docstring)."""
    return version >= VALUES_OWN_DTYPE_SINCE


def kv_cache_kind(version: tuple[int, ...]) -> str:
    """What release ``version``'s KV cache holds (``CACHE_KINDS``, module docstring): ``"copy"``, the
    ``torch.cat`` copies of 4.56 and later, else ``"reference"``, the layer's own keys and values."""
    return "copy" if version >= CACHE_COPIES_SINCE else "reference"


def rotary_keys_half(model: Any, version: tuple[int, ...]) -> bool:
    """Whether a Llama-style layer of release ``version`` casts rotary's cos/sin to the values'
    dtype, so that under autocast its rotated keys (the cache's) are half, not fp32 (module docstring)."""
    since = _ROTARY_FROM_EMBEDDINGS.get(model_key(model))
    return since is not None and version < since


#: the releases (from, until) whose attention layers each keep a rotary cos/sin cache (module docstring)
_LAYER_ROTARY_CACHE = {"llama": ((4, 34), (4, 37)), "mistral": ((4, 34), (4, 42)), "mixtral": ((4, 36), (4, 48)),
                       "qwen2": ((4, 37), (4, 45))}


def layer_rotary_cache(model: Any, version: tuple[int, ...] | None) -> bool:
    """Whether every attention layer of release ``version`` keeps its own ``cos_cached`` and
    ``sin_cached`` of ``max_position_embeddings`` positions in the load dtype (module docstring)."""
    span = _LAYER_ROTARY_CACHE.get(model_key(model))
    return version is not None and span is not None and span[0] <= version < span[1]


#: the first release whose Mixtral holds its experts as one ``MixtralExperts`` module of 3-D parameters
#: (5.24.0 ``models/mixtral/modeling_mixtral.py`` L57-93, ``grouped_mm`` by default); before it a
#: ``ModuleList`` of ``MixtralBlockSparseTop2MLP`` run one after another (module docstring)
EXPERTS_FUSED_SINCE = (5, 0)


def moe_expert_loop(model: Any, version: tuple[int, ...] | None) -> bool:
    """Whether release ``version`` (None: the installed one) runs Mixtral's experts as transformers 4.x
    does: a Python loop over a ``ModuleList`` of ``MixtralBlockSparseTop2MLP`` (three ``nn.Linear``),
    each expert on the rows routed to it (4.36.0 ``modeling_mixtral.py`` L724-743; 4.39.3 L790-805,
    L840-883; 4.48.0 L67-82, L112-150), rather than 5.x's grouped experts (``EXPERTS_FUSED_SINCE``)."""
    return model_key(model) == "mixtral" and code_release(version) < EXPERTS_FUSED_SINCE


def reentrant_checkpointing(version: tuple[int, ...] | None) -> bool:
    """Whether transformers' gradient checkpointing of release ``version`` is reentrant by default
    (before 5.0; module docstring). None: the installed release (non-reentrant)."""
    return version is not None and version < (5, 0)


def installed_version() -> str:
    """The installed transformers' version (trace and measure run it)."""
    from importlib import metadata
    return metadata.version("transformers")


def same_release(version: str, installed: str) -> bool:
    """Whether two versions name the same major.minor release."""
    return parse_transformers_version(version)[:2] == parse_transformers_version(installed)[:2]
