"""The engine's layer and outer coefficients for a derived architecture (``ModelSpec.family ==
"derived"``): any model type without hand-written formulas.

The coefficients are measured, not written: ``trainmem.trace.derive`` traces the real model cut to
a few layers at four batch/sequence points and fits each quantity (see its docstring). They are
keyed by what changes them — the config's fingerprint, precision, attention, dropout, LoRA — and
looked up in order: this process's memory, the coefficients shipped with the package
(``trainmem/spec/coefficients/``, for the catalogue's models in their default setups), the user
cache (``spec.profile.cache_dir()``), and last a derivation, which needs torch and transformers
(seconds) and is cached. This is the one place the estimate reaches up to ``trace``, and only for
a derived architecture whose coefficients are nowhere stored.

What the derivation does not cover is refused in one line (``derived_problems``): tensor and
context parallelism and sequence parallelism (the traced model is one GPU's), bitsandbytes 4-bit
bases before 0.43.2 (their MatMul4Bit keeps its input on the graph) outside decoder-only causal LMs.
A decoder's are traced with that input kept (``trainmem.bnb``), the bytes the graph keeps after each
layer's backward measured per layer kind (``trace.derive._graph_held``, ``LayerCoefs.graph_held``).
4-bit bases are traced as such (``trainmem.bnb`` emulates bitsandbytes' ``Linear4bit``: its outputs in its input's dtype,
fp32 under autocast over prepare_model_for_kbit_training's fp32 residual stream, its
dequantized weight in backward); the forward's dequantized weight is added by ``layer_coefs``.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from functools import lru_cache
from typing import Any

from ..errors import TrainmemError
from ..spec.kernel_paths import fused_releases, reference_path_note
from ..spec.model import ModelSpec
from ..spec.profile import read_cached, write_cached
from ..spec.sequence_rules import fixed_sequence
from ..spec.tf_releases import (DERIVED_TYPES, cache_values_own_dtype, code_release, kv_cache_kind, parse_transformers_version,
                                sdpa_ignores_softcap)
from ..spec.training import TrainingSpec, fused_skipped, without_cache
from .cache import BoundedCache
from .layers import LayerCoefs

COEF_VERSION = 19  # (quantized setups have keys of their own: ``key``)
#: the heads whose derived coefficients are checked against trace (tests/test_encdec_vit.py, test_derived.py,
#: test_encoder_heads.py, test_speech.py, test_vlm.py)
DERIVED_HEADS = ("causal-lm", "seq2seq-lm", "image-cls", "speech-seq2seq", "masked-lm", "seq-cls", "qa", "vlm")
#: an encoder's heads (``trace.derive.ENCODER_HEADS``): fitted with a per-sample term, their top
#: layer's forward measured (``head_forward``)
ENCODER_HEADS = ("masked-lm", "seq-cls", "qa")


def top_forward_measured(m: ModelSpec) -> bool:
    """Whether the derived path measures ``m``'s top-layer forward moments (``trace.derive._top_forward``):
    an encoder head's (no vocabulary-sized loss after its layers), and a decoder-only causal LM's, whose
    top layer may make a transient larger than its loss's (DeepSeek-V3.2's DSA indexer scores,
    transformers 5.24 ``models/deepseek_v32/modeling_deepseek_v32.py``: (b, index_n_heads, s, s) fp32
    logits inside the layer's forward). Not a vision-language model's nor an encoder-decoder's."""
    return m.head in ENCODER_HEADS or (m.head == "causal-lm" and not m.is_encoder_decoder and not m.is_vlm
                                       and not m.is_image)


#: the model types whose encoder heads' derived estimate is checked against trace
#: (tests/test_encoder_heads.py, docs/architectures.md); a decoder's classifier is not
DERIVED_ENCODER_TYPES = ("distilbert", "deberta-v2", "modernbert", "roberta")
#: the model types whose image classifier's derived estimate is checked against trace (ViT's, and the
#: vision towers of SigLIP's and CLIP's, ``SiglipForImageClassification``, ``CLIPForImageClassification``)
DERIVED_IMAGE_TYPES = ("vit", "siglip", "clip")


def derived_problems(m: ModelSpec, t: TrainingSpec) -> list[str]:
    """What a derived architecture's estimate cannot model in setup ``t`` (empty when it can)."""
    out = []
    if m.head not in DERIVED_HEADS:
        out.append(f"its {m.head} head ({m.architecture}; the derived estimate covers causal-lm, seq2seq-lm, "
                   f"speech-seq2seq, image-classification, masked-lm, sequence-classification and "
                   f"question-answering heads)")
    if m.is_vlm and t.recompute_every > 1:
        # (transformers' ``every_n_layers`` counts the vision tower's blocks before the language model's layers)
        out.append(f"--recompute-every {t.recompute_every} on a vision-language model (its vision tower's blocks are "
                   f"counted with its language model's layers; every layer checkpointed is modelled)")
    if checkpointed(m, t) and t.recompute_every > 1:
        out.append(f"--recompute-every {t.recompute_every} (an encoder-decoder's full-recompute coefficients are "
                   f"traced with every layer checkpointed)")
    if m.head in ENCODER_HEADS and m.model_type not in DERIVED_ENCODER_TYPES:
        out.append(f"its {m.architecture} {m.head} head (the derived estimate covers the masked-LM, sequence-"
                   f"classification and question-answering heads of {', '.join(DERIVED_ENCODER_TYPES)} only, "
                   f"checked against trace; use trace)")
    if m.head in ENCODER_HEADS and m.model_type == "deberta-v2" and t.recompute == "full":
        # its layers' bytes per sample and per position pair (``outer_per_sample``, ``outer_ssq``) are
        # counted for the layers that keep their tensors, not in the layer recomputed in backward
        # (tests/test_encoder_heads.py: -1.9% masked LM, -8.9% question answering)
        out.append("--recompute full on DeBERTa-v2 (its recomputed layer's relative-position repeats and indices, "
                   "per sample and per position pair, are not modelled; use trace)")
    if m.head == "image-cls" and m.model_type not in DERIVED_IMAGE_TYPES:
        out.append(f"its {m.architecture} image classifier (the derived estimate is checked against trace for "
                   f"{', '.join(DERIVED_IMAGE_TYPES)} only; use trace)")
    if m.is_encoder_decoder and t.pp > 1:
        out.append(f"--pp {t.pp} (an encoder-decoder's stacks are not split into pipeline stages)")
    if t.tp > 1 or t.sequence_parallel:
        out.append(f"--tp {t.tp}" + (" --sequence-parallel" if t.sequence_parallel else ""))
    if t.cp > 1:
        out.append(f"--cp {t.cp}")
    if t.softmax_saves_input:
        out.append(f"--torch-version {t.torch_version} (before 1.11 softmax also saves its input; the traces run "
                   f"the installed PyTorch)")
    if t.quantize and t.bnb_saves_input and (m.head != "causal-lm" or m.is_encoder_decoder or m.is_vlm):
        # (a decoder's graph-held inputs are measured per layer kind, ``trace.derive._graph_held``)
        out.append(f"--quantize {t.quantize} with bitsandbytes < 0.43.2 on its {m.head} head (MatMul4Bit keeps its "
                   f"input on the graph; measured for decoder-only causal LMs)")
    if t.quantize and t.quantize_via == "torchao":
        out.append("torchao NF4 base weights (torchtune's QLoRA; the derived coefficients are traced with "
                   "bitsandbytes' dequantization)")
    return out


def check(m: ModelSpec, t: TrainingSpec) -> None:
    bad = derived_problems(m, t)
    if bad:
        raise TrainmemError(f"{m.name} ({m.model_type}) has no hand-written formulas: its activations are derived "
                            f"from one-GPU traces of the real model, which do not cover {', '.join(bad)}")


def regime(m: ModelSpec, t: TrainingSpec) -> str:
    """Which side of the model's sliding window the sequence is on ("" without one): below it a
    sliding layer's mask is the causal mask (SDPA can run its causal kernels), above it is not, so
    each side has its own coefficients."""
    if m.family != "derived":
        return ""
    window = sliding_window(m)
    if not window or window >= m.max_positions:
        return ""
    return "above" if t.seq_len >= window else "below"


@lru_cache(maxsize=1024)
def sliding_window(m: ModelSpec) -> int:
    """The model's sliding attention window in tokens (0: none), as transformers' config reads it."""
    from ..spec.profile import profile_for
    return int(profile_for(dict(m.config)).summary.get("sliding_window", 0) or 0)


def batch1(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether ``m``'s coefficients under ``t`` are its micro-batch-1 set (``trace.derive.
    batch1_points``): a derived decoder or image model at batch 1, where some of transformers'
    tensors are views that larger batches copy. An encoder-decoder's two-length fit keeps its
    batch >= 2 points (not measured at batch 1)."""
    return m.family == "derived" and not m.is_encoder_decoder and t.batch_size == 1


def key(m: ModelSpec, t: TrainingSpec, one: bool | None = None, version: int = 0) -> str:
    """The cache key of ``m``'s coefficients under ``t``: everything the traced layer depends on;
    ``one``: of its micro-batch-1 set or not (default: ``batch1``); ``version``: under that
    ``COEF_VERSION`` (default: the current one; ``PREVIOUS_VERSIONS``' sets, ``_coefficients``)."""
    lora = (t.lora_rank, tuple(t.lora_targets or ()), t.lora_dropout, adapters_computed_half(t)) if t.lora_rank else ()
    parts = [m.fingerprint, activation_precision(t), t.attention, t.dropout, lora, regime(m, t), without_cache(t, m)]
    parts += release_parts(m, t)
    if t.attention_call == "repeat-kv":  # traced with litgpt's SDPA call (the keys of other setups are unchanged);
        parts.append(("attention-call", t.attention_call))  # mha's terms are added to transformers' layer (mha_kept)
    if not t.math_sdpa_upcasts:  # PyTorch < 2.5: traced with SDPA's math kernel in the inputs' dtype
        parts.append(("math-sdpa", "input-dtype"))
    if t.quantize:  # a 4-bit base is traced as one (the keys of other setups are unchanged)
        parts.append(("quantize", t.quantize, t.quantize_via))
        if t.bnb_saves_input:  # bitsandbytes < 0.43.2: traced with MatMul4Bit keeping its input (``bnb_saves_input``)
            parts.append(("bnb", "keeps-input"))
    if t.mixer_kernels != "reference" and not fused_skipped(m, t):  # traced with the packages' emulated mixer
        # Functions (``trainmem.mamba_kernels``, ``trainmem.fla_modules``) of these releases; a skipped one
        # traces the reference path, whose key it shares (the keys of other setups are unchanged)
        parts.append(("mixer-kernels", t.mixer_kernels, fused_releases(m.model_type)))
    if m.is_encoder_decoder:  # measured per backward moment (keys of earlier derivations no longer match)
        parts.append("by-moment")
        parts.append("two-lengths")  # fitted in the encoder's and the decoder's lengths (``at_lengths``)
    if checkpointed(m, t):  # traced with its layers checkpointed (the keys of other setups are unchanged)
        parts.append("checkpointed")
    if m.head in ENCODER_HEADS:  # fitted with a per-sample term, the top layer's forward measured
        parts.append(("encoder-head", m.head))
    if m.is_vlm:  # its vision side fitted in images (``trace.derive._vision_fit``): per image size and frozen tower
        parts.append(("vlm", t.image_size, t.freeze_vision_tower, t.recompute == "full"))
    if batch1(m, t) if one is None else one:  # fitted on batch-1 points (the keys of other batches are unchanged)
        parts.append("batch-1")
    return _key(version or COEF_VERSION, *parts)


def release_parts(m: ModelSpec, t: TrainingSpec, release: tuple[int, ...] | None = None) -> list[tuple[str, str]]:
    """What the traced code does that depends on its transformers release, where it differs from
    4.56-5.23's (their keys unchanged): the KV cache (``_cache_parts``) and Gemma-2's SDPA that drops
    the softcapping before 5.21 (``spec.tf_releases.sdpa_ignores_softcap``). ``release``: the run's
    (``--transformers-version``, else the installed transformers; ``_run_release``)."""
    release = _run_release(m, t) if release is None else release
    parts = _cache_parts(m, t, release)
    if t.attention.startswith("sdpa") and sdpa_ignores_softcap(m.model_type, release):
        parts.append(("sdpa", "softcap-dropped"))
    return parts


def _run_release(m: ModelSpec, t: TrainingSpec) -> tuple[int, ...]:
    """The release whose code the run executes (``spec.tf_releases.code_release``); for OPT and
    Granite, whose older code is corrected apart from the coefficients (``spec.tf_releases``), the
    installed one, which their coefficients were traced with."""
    given = None if m.model_type in DERIVED_TYPES else t.transformers_version
    return code_release(parse_transformers_version(given) if given is not None else None)


def _cache_parts(m: ModelSpec, t: TrainingSpec, release: tuple[int, ...]) -> list[tuple[str, str]]:
    """What release ``release``'s KV cache was, where it differs from 4.56-5.23's: a release before
    4.56 held the layers' own keys and values, not copies (``spec.tf_releases.kv_cache_kind``); from
    5.24 the cache keeps half values under autocast (``cache_values_own_dtype``). Derived
    architectures take a release from 5.17 only (``spec.tf_releases.DERIVED_RELEASES_FROM``); OPT's
    and Granite's older code is corrected apart (``spec.tf_releases``)."""
    if without_cache(t, m):
        return []
    if kv_cache_kind(release) == "reference":
        return [("kv-cache", "reference")]
    own = activation_precision(t).endswith("-amp") and cache_values_own_dtype(release)
    return [("values-cache", "own-dtype")] if own else []


def derivable(m: ModelSpec, t: TrainingSpec) -> str | None:
    """Why the installed transformers cannot derive ``m``'s coefficients for the release ``t`` runs
    (None: it can): the traces run the installed code, so its release rules must be the run's (OPT's
    and Granite's are the installed ones: ``_run_release``)."""
    if t.transformers_version is None:
        return None
    installed = code_release(None)
    if release_parts(m, t) == release_parts(m, t, installed):
        return None
    return (f"--transformers-version {t.transformers_version}: {m.name}'s coefficients for that release's "
            f"code (its KV cache or its SDPA attention differ from the installed transformers "
            f"{'.'.join(map(str, installed))}) are not shipped, and deriving them runs the installed code; "
            f"install transformers {t.transformers_version} to derive them, or drop --transformers-version")


@lru_cache(maxsize=4096)
def _key(version: int, *parts: Any) -> str:
    return hashlib.sha256(json.dumps([version, *parts], default=str).encode()).hexdigest()[:24]


def _stored(k: str, version: int = 0) -> dict[str, Any] | None:
    doc = read_cached("coefficients", k)
    return whole(doc) if doc is not None and doc.get("version") == (version or COEF_VERSION) else None


#: how near a whole number a coefficient's float is that number, relative to it (absolute below 1): ``whole``
FIT_NOISE = 1e-5


def whole(doc: Any) -> Any:
    """``doc`` (a coefficient set, as stored or derived) with every float within ``FIT_NOISE`` of a whole
    number made that number. Its coefficients are least-squares fits (``trace.derive._fitted``: numpy's
    float64 ``lstsq``) of whole byte counts at whole (b, s) points, where each tensor adds its element
    size times whole dimensions per term, a whole number; the fit returns it with float noise that differs
    with the machine and the cache that fitted it (8195.99999999 for 8196, 2.4e-09 for 0; t5-base's shipped
    4.0000016 re-derived here as 3.9999997). The replay rounds the sizes made of them to the allocator's
    blocks (``trainmem.allocator_rules.block_bytes``: 2048^2 token-key pairs x 64.000001 B is 256 MiB + 4 B,
    which occupies a 258 MiB segment, and no cached 256 MiB block serves it) and matches them with exact sizes
    (``reserved.loss_forward._head_side``), so a byte of noise was a jump (the agreement grid's Phi-3 b1
    s2048 fp32 eager full-recompute row: +10.1 % with 1e-6 B added to its coefficients near whole numbers;
    ``tools/fit_noise_audit.py``). ``FIT_NOISE`` lies above that noise, and a float this near a whole
    number moves by at most ``FIT_NOISE`` of itself (a byte per 10^5 tokens below 1 B per token); one
    further is kept: a gradient share (``LayerCoefs``' transients), a set derived at one point (bytes /
    tokens)."""
    if isinstance(doc, dict):
        return {k: whole(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [whole(v) for v in doc]
    if isinstance(doc, float) and math.isfinite(doc):
        near = round(doc)
        return float(near) if abs(doc - near) <= FIT_NOISE * max(1.0, abs(doc)) else doc
    return doc


#: the coefficient versions before this one, newest first, whose sets are read where this installation
#: cannot derive the setup's set again (another transformers release's code, or no torch): 18, before the
#: derivation recorded each saved tensor's last read in the forward (``trace.derive._last_reads``: the
#: replay chains a checkpointed layer's tensors, ``reserved.layer_forward._sequence_forward``); 17, before it recorded
#: each layer's backward (``trace.derive._layer_backward_sequence``: the H200 runs' 5.17.0 sets, which
#: ``tools/ship_sequence.py`` wrote with that release; the replay keeps such a layer's backward as one
#: block, ``reserved.layer_backward._recorded``). Everything else in such a set is the same as in this version's.
PREVIOUS_VERSIONS = (18, 17)
PREVIOUS_VERSION = PREVIOUS_VERSIONS[0]


def _older(k_old: tuple) -> dict[str, Any] | None:
    """The newest set stored under ``PREVIOUS_VERSIONS``' keys ``k_old`` ((version, key) pairs), else None."""
    return next((doc for v, k in k_old for doc in [_stored(k, v)] if doc is not None), None)


def _previous(k_old: tuple, why: str) -> dict[str, Any]:
    """The newest set stored under ``PREVIOUS_VERSIONS``' keys ``k_old``, else ``why`` refused in one line."""
    doc = _older(k_old)
    if doc is None:
        raise TrainmemError(why)
    return doc


@lru_cache(maxsize=512)
def _coefficients(k: str, m: ModelSpec, t: TrainingSpec, side: str, one: bool = False,
                  general: str = "", k_old: tuple = ()) -> dict[str, Any]:
    """The coefficients stored under key ``k``, else derived now. ``one``: the micro-batch-1 set
    (``batch1``); when it is stored nowhere and cannot be derived (no torch) but the batch >= 2 set
    (key ``general``) is stored, that set is used, marked ``batch1_fallback`` (its batch-1 copies
    make it slightly high: ``notes`` says so), so an estimate that worked without torch still does.
    Where it cannot be derived, the newest set stored under ``PREVIOUS_VERSIONS``' keys ``k_old`` is used."""
    doc = _stored(k)
    if doc is not None:
        return doc
    why = derivable(m, t)
    if why is not None:
        return _previous(k_old, why)
    try:
        from ..trace.derive import NotPolynomial, derive_coefficients
    except ImportError as e:
        doc = _older(k_old)
        doc = doc if doc is not None else _stored(general) if one and general else None
        if doc is not None:
            return doc if doc.get("version") in PREVIOUS_VERSIONS else dict(doc, batch1_fallback=True)
        raise TrainmemError(f"{m.name}: no stored coefficients for this setup, and deriving them needs torch and "
                            f"transformers ({e.name} is not installed)") from None
    try:
        doc = whole(derive_coefficients(m, t, side, batch1=one))
    except NotPolynomial as e:
        if m.is_encoder_decoder or m.is_image or m.is_vlm:  # (their point derivation is not checked against trace)
            raise
        # cached as such, so the next estimate goes straight to its point (``point_at``)
        doc = {"not_polynomial": str(e), "quantity": e.what}
    doc["version"] = COEF_VERSION
    write_cached("coefficients", k, doc)
    return doc


#: the most (batch, sequence) points a layout grid (fit, sweep, plan) derives one by one for a model
#: whose memory is not polynomial in them (``point_at``); a grid with more is refused in one line
POINT_LIMIT = 4


#: the config field of the chunk a Mamba-2 mixer's torch path pads the sequence to, by model type: each
#: type's ``*_chunk_scan`` (transformers 5.24) pads it to a whole number of chunks,
#: ``pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size`` (``models/mamba2/modeling_mamba2.py``
#: L286, ``bamba`` L496, ``falcon_h1`` L501, ``granitemoehybrid`` L417, ``nemotron_h`` L302, ``zamba2`` L558),
#: and runs its scan's tensors ((b, c, l, h, p), (b, h, c, l, l), ...) on the padded length; with the
#: field's default where a config leaves it out (each type's ``configuration_*.py``: ``chunk_size: int = 256``,
#: Nemotron-H's 128, which also reads a ``mamba_chunk_size`` key)
SCAN_CHUNK_FIELDS = {"mamba2": ("chunk_size", 256), "nemotron_h": ("chunk_size", 128),
                     "zamba2": ("chunk_size", 256), "bamba": ("mamba_chunk_size", 256),
                     "falcon_h1": ("mamba_chunk_size", 256), "granitemoehybrid": ("mamba_chunk_size", 256)}


def scan_chunk(m: ModelSpec) -> int:
    """The chunk a Mamba-2 mixer's torch path pads the sequence to (``SCAN_CHUNK_FIELDS``); 0 for
    any other model. The derivation's points (2048, 4096, 3072 tokens: ``trace.derive._points``) are
    whole numbers of such chunks (256, or 128 for Nemotron-H), so the fitted coefficients hold at
    sequences that are; at any other sequence the scan's tensors are those of the next whole chunk
    (at 128 tokens and chunk 256, twice the fit's bytes per token) and ``point_at`` derives the
    coefficients at the setup's own point instead."""
    if m.model_type not in SCAN_CHUNK_FIELDS:
        return 0
    field, default = SCAN_CHUNK_FIELDS[m.model_type]
    value = m.config.get(field, m.config.get("mamba_chunk_size", default) if m.model_type == "nemotron_h" else default)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def padded_scan(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether ``t``'s sequence is no whole number of ``m``'s scan chunks (``scan_chunk``)."""
    chunk = scan_chunk(m)
    return bool(chunk) and t.seq_len % chunk != 0


def point_at(m: ModelSpec, t: TrainingSpec) -> tuple[int, int] | None:
    """(batch, sequence) of ``t`` when ``m``'s coefficients under ``t`` hold at that point alone: a
    decoder whose fit over batch and sequence ``trace.derive`` refused (``NotPolynomial``: chunked
    linear attention, whose torch fallback loops over sequence chunks; compressed or sparse attention;
    convolution and state caches), or a Mamba-2 mixer's at a sequence its scan pads (``padded_scan``),
    derived at the setup's own point (``_at_point``). None otherwise (a hand-written family, a
    polynomial fit, a setup the derivation does not cover)."""
    if m.family != "derived" or derived_problems(m, t):
        return None
    at_point = padded_scan(m, t) or one_sequence(m) or "not_polynomial" in _lookup(m, t)
    return (t.batch_size, t.seq_len) if at_point else None


def one_sequence(m: ModelSpec) -> bool:
    """Whether ``m`` trains at one sequence length alone (``spec.sequence_rules.fixed_sequence``: Reformer's axial
    position embeddings), so that no fit over several sequences can be traced: its coefficients are derived at
    the setup's own point (``point_at``)."""
    return bool(fixed_sequence(m.model_type, m.config))


def point_quantity(m: ModelSpec, t: TrainingSpec) -> str:
    """What ``point_at`` derives at the point for: the quantity whose fit was refused, else the scan's padding."""
    if one_sequence(m):
        return (f"Reformer trains at prod(axial_pos_shape) = {fixed_sequence(m.model_type, m.config)} tokens alone, "
                "so no fit over several sequences can be traced")
    if padded_scan(m, t):
        return (f"Mamba-2 scan pads the sequence to a whole number of its {scan_chunk(m)}-token chunks, "
                f"and {t.seq_len} is not one")
    return _lookup(m, t)["quantity"]


def _doc(m: ModelSpec, t: TrainingSpec) -> dict[str, Any]:
    """The coefficients of ``m`` under ``t``: the fitted set, else (``point_at``) those at ``t``'s point."""
    # (a padded scan's point needs no fit: the fit's points are whole chunks, and are not traced for it)
    doc = {} if m.family == "derived" and (padded_scan(m, t) or one_sequence(m)) else _lookup(m, t)
    if doc and "not_polynomial" not in doc:
        return doc
    return _at_point(key(m, t), m, _canonical(t, m), regime(m, t), (t.batch_size, t.seq_len))


@lru_cache(maxsize=256)
def _at_point(k: str, m: ModelSpec, t: TrainingSpec, side: str, point: tuple[int, int]) -> dict[str, Any]:
    """The coefficients at ``point`` (``trace.derive.derive_coefficients``' ``point``: one trace of
    the cut model there), stored under the setup's key and the point, with the seconds it took."""
    pk = _key(COEF_VERSION, k, "point", *point)
    doc = _stored(pk)
    if doc is not None:
        return doc
    try:
        from ..trace.derive import derive_coefficients
    except ImportError as e:
        raise TrainmemError(f"{m.name}: its memory is not polynomial in the batch and sequence and no coefficients "
                            f"are stored at batch {point[0]}, sequence {point[1]}; deriving them needs torch and "
                            f"transformers ({e.name} is not installed)") from None
    start = time.perf_counter()
    doc = whole(derive_coefficients(m, t, side, point=point))
    doc.update(version=COEF_VERSION, seconds=round(time.perf_counter() - start, 2))
    write_cached("coefficients", pk, doc)
    return doc


def coefficients(m: ModelSpec, t: TrainingSpec) -> dict[str, Any]:
    """The derived coefficients of ``m`` under ``t`` (stored, cached, or derived now; at micro-batch
    1 its batch-1 set, ``batch1``); an encoder-decoder's read at ``t``'s ratio of decoder to encoder
    length (``at_lengths``)."""
    check(m, t)
    doc = _doc(m, t)
    if "terms" not in doc:
        return doc
    return _at_ratio(key(m, t), doc, *decoder_ratio(m, t))


#: ``_lookup``'s answers by the identity of its two specs, each entry holding them (so their ids are not
#: reused while it lives): the same specs estimated again (a sweep run twice, the planner's repeated calls)
#: skip the keys and the canonical spec (a ``dataclasses.replace`` that re-runs ``TrainingSpec``'s checks).
#: Not by equality: ModelSpec's leaves ``config`` out and the keys read it (``sliding_window``, ``scan_chunk``)
_LOOKUPS = BoundedCache(1024)


def _lookup(m: ModelSpec, t: TrainingSpec) -> dict[str, Any]:
    """``_coefficients`` of ``m`` under ``t`` (remembered for these very specs: ``_LOOKUPS``)."""
    # (an entry keeps its specs alive, so no other object has their ids while it is stored)
    return _LOOKUPS.get_or_build((id(m), id(t)), lambda: (m, t, _lookup_new(m, t)))[2]


def clear_lookups() -> None:
    """Forget ``_lookup``'s memo (``quantities.build.clear_cache``: the engine's caches cleared together)."""
    _LOOKUPS.clear()


def _lookup_new(m: ModelSpec, t: TrainingSpec) -> dict[str, Any]:
    one = batch1(m, t)
    return _coefficients(key(m, t), m, _canonical(t, m), regime(m, t), one, key(m, t, False) if one else "",
                         tuple((v, key(m, t, version=v)) for v in PREVIOUS_VERSIONS))


def decoder_ratio(m: ModelSpec, t: TrainingSpec) -> tuple[int, int]:
    """An encoder-decoder's decoder length over its encoder length (``--target-len`` over
    ``--seq-len``) as a reduced fraction (numerator, denominator); (1, 1) for other models. The
    engine's per-token terms count encoder tokens, b*s: b*d decoder tokens are b*s * d/s."""
    if not m.is_encoder_decoder:
        return 1, 1
    g = math.gcd(t.decoder_len, t.seq_len)
    return t.decoder_len // g, t.seq_len // g


_AT_RATIO: dict[tuple, dict[str, Any]] = {}


def _at_ratio(k: str, doc: dict[str, Any], num: int, den: int) -> dict[str, Any]:
    hit = _AT_RATIO.get((k, num, den))
    if hit is None:
        if len(_AT_RATIO) > 1024:
            _AT_RATIO.clear()
        hit = _AT_RATIO[(k, num, den)] = at_lengths(doc, num / den)
    return hit


def at_lengths(doc: dict[str, Any], r: float) -> dict[str, Any]:
    """An encoder-decoder's coefficients (``trace.derive.encdec_coefficients``: polynomials in the
    batch b, the encoder length s and the decoder length d) read at ``d = r*s``, in the terms the
    engine evaluates, all in the encoder's length: per token b*s (``b*d`` is ``r*b*s``), per token x
    key b*s^2 (the decoder's self-attention ``b*d^2`` is ``r^2*b*s^2``, its cross-attention ``b*d*s``
    ``r*b*s^2``), per position s, per position squared s^2 shared by the batch, and bytes: the
    format of the other architectures' coefficients, with each layer kind's and side's s^2 term
    in ``ssq``."""
    def at(c: dict[str, float]) -> tuple[float, float, float, float, float]:
        g = c.get
        return (g("n", 0.0) + r * g("nd", 0.0), g("s", 0.0) + r * g("sd", 0.0),
                g("nsq", 0.0) + r * r * g("nsqd", 0.0) + r * g("nsqx", 0.0),
                g("ssq", 0.0) + r * r * g("ssqd", 0.0) + r * g("ssqx", 0.0), g("1", 0.0))

    def transient(tr: dict[str, Any]) -> list[float]:
        n, _s, nsq, ssq, const = at(tr["coef"])
        return [n, nsq, const, tr["g"], ssq]   # [a, b, c, gradient share, d] (``layer_coefs``)
    kinds, ssq = {}, {}
    for k, v in doc["kinds"].items():
        n, pos, nsq, ssq[f"kind.{k}"], _c = at(v["saved"])
        kinds[k] = {"tok": n, "sq": nsq, "pos": pos, "transients": [transient(tr) for tr in v["transients"]],
                    "parts": {name: [at(c)[0], at(c)[2]] for name, c in v["parts"].items()},
                    "cache": at(v["cache"])[0], "held": at(v["held"])[0]}
        if "not_recomputed" in v:
            kinds[k]["not_recomputed"] = at(v["not_recomputed"])[0]
    out = dict(doc, kinds=kinds, ssq=ssq,
               moments={name: [transient(tr) for tr in trs] for name, trs in doc["moments"].items()})
    for side, name in (("first_layer", "first"), ("embed", "embed"), ("head", "head"), ("head_loss", "head_loss")):
        n, pos, nsq, ssq[name], _c = at(doc[side])
        out[side] = [n, pos, nsq]
    # [per token, per position, per token x key, per position squared] (``moment_activations``)
    out["moment_base"] = {name: list(at(c)[:4]) for name, c in doc.get("moment_base", {}).items()}
    return out


def moment_activations(m: ModelSpec, t: TrainingSpec) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """An encoder-decoder's activations alive at its bottom and decoder-bottom backward moments,
    each as (per token, per token x key, per position, per position squared): what the derivation
    measured there beside those layers' transients (``trace.derive._moment_base``: the layer's own
    tensors, those of the layers below it, the embedding sides still alive), plus, at the decoder
    bottom, the encoder layers the full model has beyond the cut one, each its kind's saved bytes.
    Zeros for other models (the engine then takes an average layer's share)."""
    doc = coefficients(m, t)
    base = doc.get("moment_base")
    if not base or not m.is_encoder_decoder or t.pp > 1:
        return (0.0,) * 4, (0.0,) * 4
    extra = _extra_encoder_layers(m, doc)
    out = []
    for name in ("bottom", "decoder_bottom"):
        out.append(_moment_base_at(doc, name, extra))
    return out[0], out[1]


def decoder_embedding_activations(m: ModelSpec, t: TrainingSpec) -> tuple[float, ...]:
    """A speech encoder-decoder's (Whisper's) activations alive when its decoder's tied token embedding
    runs its backward, after the decoder's layers and before the encoder's (``trace.derive.
    _decoder_embedding_base``): every encoder layer's kept tensors and the encoder's embedding side, as
    (per token, per token x key, per position, per position squared), the full model's encoder layers
    beyond the cut one's added; zeros where not measured (T5 and BART, whose shared embedding's backward
    comes after the encoder's; a pipeline)."""
    if not m.is_encoder_decoder or t.pp > 1:
        return (0.0,) * 4
    doc = coefficients(m, t)
    if "decoder_embedding" not in doc.get("moment_base", {}):
        return (0.0,) * 4
    return _moment_base_at(doc, "decoder_embedding", _extra_encoder_layers(m, doc))


def decoder_embedding_temporaries(m: ModelSpec, t: TrainingSpec) -> float:
    """Bytes per token of the backward's temporaries a speech encoder-decoder holds when its decoder
    embedding runs its backward, beyond the tied table's (``trace.derive._decoder_embedding_temp``: the
    encoder output's gradient, summed over the decoder layers' cross-attention, fp32 (b, S, d_model));
    0 where not measured."""
    if not m.is_encoder_decoder or t.pp > 1:
        return 0.0
    base = coefficients(m, t).get("moment_base", {}).get("decoder_embedding_temp")
    return float(base[0]) if base else 0.0  # (per token b*S, the b*d terms read at the setup's ratio)


def _extra_encoder_layers(m: ModelSpec, doc: dict[str, Any]) -> Any:
    """Layer kind -> how many more encoder layers the full model has than the cut one traced."""
    from collections import Counter
    lower, cut = m.num_layers - m.decoder_layers, doc["cut_kinds"]
    return Counter(doc["layer_kinds"][:lower]) - Counter(cut[:len(cut) // 2])


def _moment_base_at(doc: dict[str, Any], name: str, extra: Any) -> tuple[float, float, float, float]:
    """The activations measured at moment ``name`` (``moment_base``), as (per token, per token x key,
    per position, per position squared), the ``extra`` encoder layers' kept tensors added at the
    moments that have every encoder layer alive (the decoder bottom, the decoder embedding)."""
    n, pos, nsq, ssq = doc["moment_base"][name]
    if name != "bottom":
        for k, c in extra.items():
            v = doc["kinds"][k]
            n, nsq, pos = n + c * v["tok"], nsq + c * v["sq"], pos + c * v["pos"]
            ssq += c * doc["ssq"][f"kind.{k}"]
    return n, nsq, pos, ssq


def checkpointed(m: ModelSpec, t: TrainingSpec) -> bool:
    """Whether ``m``'s coefficients under ``t`` are derived from traces with every layer checkpointed
    (``trace.derive``): an encoder-decoder under full recompute, whose checkpointed layers keep more
    than their input (see ``layer_coefs``)."""
    return m.is_encoder_decoder and t.recompute == "full"


def activation_precision(t: TrainingSpec) -> str:
    """The precision the layers compute in, for the one-GPU derivation. ``bf16-mp`` is FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16)``: the forward runs on the all-gathered bf16 parameters
    (``_fsdp_param.py`` ``init_unsharded_param`` casts to ``param_dtype``) with its floating inputs
    cast to bf16 (``cast_forward_inputs=True``, ``_fsdp_state.py`` ``_root_pre_forward``), and no
    autocast: what every layer saves is what pure ``bf16`` training saves. Traced on one GPU as
    ``bf16-mp`` the model would keep its fp32 weights (no FSDP to gather them in bf16) and the
    activations would come out fp32, twice the real bytes (Phi-3 FSDP2 bf16-mp: +10.8% vs trace)."""
    return "bf16" if t.precision == "bf16-mp" else t.precision


def adapters_computed_half(t: TrainingSpec) -> bool:
    """Whether LoRA adapters compute in the model's half dtype: asked for (``lora_dtype="half"``),
    or under FSDP's ``bf16-mp``, whose ``MixedPrecisionPolicy(param_dtype=bf16)`` gathers every
    floating-point parameter of a unit in bf16, the fp32 adapters peft made included (torch
    ``_fully_shard/_fsdp_param.py``: each ``FSDPParam`` takes the policy's ``param_dtype``; FSDP1's
    ``MixedPrecision`` casts its flat parameter likewise). peft's ``_cast_input_dtype`` then casts
    the input to bf16, which it already is: no copy. The hand-written layers read it
    (``quantities.model_facts.layer_key``), and a derivation under ``bf16-mp`` runs peft with half adapters
    (``_canonical``). Found by trace: Llama (2 layers) FSDP2 dp 4 bf16-mp LoRA 16, 1 x 2048:
    +2.98% before (an fp32 copy of q's and v's input counted per layer); Phi-3 (derived): +1.71%."""
    return t.lora_half or t.precision == "bf16-mp"


def _canonical(t: TrainingSpec, m: ModelSpec | None = None) -> TrainingSpec:
    """``t`` reduced to what the derivation reads (so that equal keys share one derivation):
    ``recompute`` "full" stands for "derive without the KV cache" (``without_cache``); ``--attention-call
    mha`` derives transformers' own layer, to which ``quantities.layer_terms.mha_kept`` adds its terms."""
    from dataclasses import replace
    # 4-bit bases are traced as such; every bitsandbytes before 0.43.2 keeps MatMul4Bit's input the same
    # way (one release stands for them), later ones keep none (``TrainingSpec.bnb_saves_input``)
    old_bnb = "0.42.0" if t.quantize and t.bnb_saves_input else None
    return replace(t, batch_size=1, seq_len=128, target_len=None, later_seq_len=None, min_seq_len=None,
                   layer_rope_cache=None, rope_cache=None, grad_accum=1, dp=1, pp=1, zero=0, fsdp=None,
                   fsdp_version=2, fsdp_gathered="none",  # (TrainingSpec refuses units kept gathered without FSDP,
                   fsdp_auto_wrap_policy="transformer", fsdp_min_num_params=None,  # and a wrap policy without FSDP1)
                   fsdp_lora_units="separate", fsdp_limit_all_gathers=None,  # (FSDP1's alone: refused without it)
                   fsdp_offload_params=False, fsdp_sync_module_states=False,  # (FSDP1's: refused without it)
                   ddp_bucket_mb=None,                           # (DDP's alone: refused at dp 1)
                   grad_sync="micro-batch", ddp_init_stream="current",
                   precision=activation_precision(t),
                   lora_dtype="half" if (t.lora_rank and adapters_computed_half(t)) else t.lora_dtype,
                   # (a VLM's: its tower traced checkpointed, ``trace.derive._checkpoint_vision``; no other
                   # setup of one builds no cache but by its config, which the derivation reads)
                   recompute="full" if (t.recompute == "full" if m is not None and m.is_vlm else without_cache(t, m))
                   else "none",
                   recompute_every=1, bitsandbytes_version=old_bnb,
                   attention_call="model" if t.attention_call == "mha" else t.attention_call,
                   images=1)  # (a VLM's points set their own images: ``trace.derive.vlm_images``)


def stage_kinds(m: ModelSpec, t: TrainingSpec, stage: str, doc: dict[str, Any]) -> list[str]:
    """The kinds of the layers on this pipeline stage."""
    lo, hi = t.stage_span(len(doc["layer_kinds"]), stage)
    return doc["layer_kinds"][lo:hi]


def layer_coefs(m: ModelSpec, t: TrainingSpec, stage: str) -> LayerCoefs:
    """The stage's average layer (saved bytes and parts) with each of its kinds' backward transients;
    ``weights`` is 1 and ``after`` the share of the layer's gradients made before the transient's
    peak, so the engine's ``after * layer_grads`` counts them."""
    doc = coefficients(m, t)
    kinds = stage_kinds(m, t, stage, doc)
    count = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    total = len(kinds)
    tok = sum(doc["kinds"][k]["tok"] * c for k, c in count.items()) / total
    sq = sum(doc["kinds"][k]["sq"] * c for k, c in count.items()) / total
    typical = (tok, sq)
    if t.pp == 1 or stage == "first":  # the model's first layer keeps what it keeps (see derive)
        first_tok, _pos, first_sq = doc["first_layer"]
        tok, sq = tok + first_tok / total, sq + first_sq / total
    parts: dict[str, list[float]] = {}
    for k, c in count.items():
        for name, (a, b) in doc["kinds"][k]["parts"].items():
            acc = parts.setdefault(name, [0.0, 0.0])
            acc[0] += a * c / total
            acc[1] += b * c / total
    # the parts are a typical layer's; scaled to the stage's average layer
    fa = tok / typical[0] if typical[0] else 1.0
    fb = sq / typical[1] if typical[1] else 1.0
    parts = {n: [a * fa, b * fb] for n, (a, b) in parts.items()}
    # the parts are fitted one by one; what they leave of the layer's total is one more part
    rest = (tok - sum(a for a, _ in parts.values()), sq - sum(b for _, b in parts.values()))
    if rest[0] > 1e-3 or rest[1] > 1e-6:  # (float noise otherwise: the fits add up)
        parts["other"] = [max(rest[0], 0.0), max(rest[1], 0.0)]
    cands = [(k, j, tr) for k in count for j, tr in enumerate(doc["kinds"][k]["transients"])]
    if t.recompute == "full" and not doc.get("checkpointed") and recomputed_ends(m, t)[1]:
        # the transients are net of what their layer lost before its backward began (ViT's top
        # layer's output, freed by the final norm's backward: ``trace.derive._transients``); a
        # recomputed layer never made it again, and ``not_recomputed`` already leaves it out
        cands = [(k, j, [tr[0] + doc["kinds"].get(k, {}).get("transient_freed", 0.0), *tr[1:]]) for k, j, tr in cands]
    moments = _moments_of(m, t, doc["layer_kinds"])
    at = [moments[k] for k, _j, _tr in cands] if moments else []
    if moments:  # an encoder-decoder: its bottom and decoder-bottom layers' own transients
        from .layers import BOTTOM, DECODER_BOTTOM
        for name, bit in (("bottom", BOTTOM), ("decoder_bottom", DECODER_BOTTOM)):
            for j, tr in enumerate(doc.get("moments", {}).get(name, [])):
                cands.append((name, j, tr))
                at.append(bit)
    trans = tuple((f"derived.{k}.backward.{j}", a, b, c) for k, j, (a, b, c, _g, *_d) in cands)
    after = tuple(float(g) for _k, _j, (_a, _b, _c, g, *_d) in cands)
    # an encoder-decoder's (s, s) tensors of the moment, shared by the batch (T5's position bias)
    ssq = tuple(float(d[0]) if d else 0.0 for _k, _j, (_a, _b, _c, _g, *d) in cands)
    held = sum(doc["kinds"][k]["held"] * c for k, c in count.items()) / total
    # per token: what the graph's nodes keep until the graph is freed, not freed by the layer's
    # backward (bitsandbytes < 0.43.2 MatMul4Bit inputs: ``trace.derive._graph_held``)
    graph = sum(doc["kinds"][k].get("graph", 0.0) * c for k, c in count.items()) / total
    # the first layer's excess (LoRA: the 4-bit linears on its frozen input keep nothing) and a 4-bit
    # head's input (the final norm's output), spread over the stage's layers: the graph's total, which
    # the next micro-batch's forward meets, is exact; a backward moment's share of them is approximate
    graph += (doc.get("first_graph", 0.0) if t.pp == 1 or stage == "first" else 0.0) / total
    graph += (doc.get("head_graph", 0.0) if t.pp == 1 or stage == "last" else 0.0) / total
    # per token: the average layer's output, which a recomputed layer does not make again; its end
    # layers' own where they differ, as ``tok`` takes the first layer's excess (CLIP's top layer
    # keeps no output: nothing after it saves it)
    not_recomputed = sum(doc["kinds"][k].get("not_recomputed", 0.0) * c for k, c in count.items()) / total
    if t.pp == 1 or stage == "first":
        not_recomputed += doc.get("first_early", 0.0) / total
    cache = sum(doc["kinds"][k]["cache"] * c for k, c in count.items()) / total
    fwd = (0.0, 0.0)
    if t.quantize:
        # bitsandbytes MatMul4Bit dequantizes its weight in forward (quant4.py): the largest such
        # copy of the stage's layers is the forward transient (with its matmul's output); the
        # backward's copies are in the traced backward moments
        fwd = _largest_dequantized(m, t, stage)
    return LayerCoefs(max(tok, 0.0), max(sq, 0.0), tuple((n, a, b) for n, (a, b) in sorted(parts.items())),
                      trans, held=held, cache=cache, weights=1.0, after=after, fwd_const=fwd[0], fwd_tok=fwd[1],
                      not_recomputed=max(not_recomputed, 0.0), graph_held=max(graph, 0.0), checkpointed=bool(doc.get("checkpointed")),
                      transients_ssq=ssq if any(ssq) else (), transients_at=tuple(at),
                      **_sequence(doc, list(count)))


def _sequence(doc: dict[str, Any], kinds: list[str]) -> dict[str, tuple]:
    """The replay's view of a derived layer (``estimate.reserved``), where the derivation recorded it
    (``trace.derive._sequence``; coefficients derived before it did not) and the stage's layers are of
    one kind: its saved tensors one by one in the order they are made (``LayerCoefs.tensors``), its
    linears (``LayerCoefs.linears``): where autocast casts each trainable weight among them, its
    elements and its gradient's bytes per element (fp32: autocast caches only fp32 leaves that
    require grad, ``autocast_mode.cpp`` ``cached_cast``, and ``AccumulateGrad`` keeps the weight's
    dtype), and the tensors its forward makes and frees, in the order of it all
    (``LayerCoefs.fwd_temps``, ``fwd_events``); its backward likewise where the derivation recorded it
    (``trace.derive._backward_sequence``, ``LayerCoefs.bwd_events``: coefficients before version 18 did not)."""
    kind = doc["kinds"][kinds[0]] if len(kinds) == 1 else {}
    if "tensors" not in kind:
        return {}
    return {"tensors": tuple((float(a), float(b)) for a, b in kind["tensors"]),
            "linears": tuple((int(pos), float(w), 4) for pos, w in kind["linears"]),
            "fwd_temps": tuple((float(a), float(b)) for a, b in kind.get("temps", ())),
            "fwd_events": tuple(kind.get("events", ())),
            "bwd_temps": tuple(tuple(float(x) for x in c) for c in kind.get("bwd_temps", ())),
            "bwd_ins": tuple(tuple(float(x) for x in c) for c in kind.get("bwd_ins", ())),
            "bwd_grads": tuple(int(g) for g in kind.get("bwd_grads", ())),
            "bwd_events": tuple(kind.get("bwd_events", ())), "bwd_out": tuple(int(k) for k in kind.get("bwd_out", ()))}


def _moments_of(m: ModelSpec, t: TrainingSpec, kinds: list[str]) -> dict[str, int]:
    """An encoder-decoder's layer kinds mapped to the engine's backward moments at which their
    transients (measured at the kind's last layer, ``trace.derive``) are candidates
    (``moments._layers_backward``; empty for other models, whose every kind's transient is a
    candidate at every moment): a kind whose last layer is the top layer (the decoder's last) at
    the top, the decoder's first at the decoder bottom, the encoder's first at the bottom; a kind
    whose last layer runs its backward between those moments at the two moments around it (the
    decoder's middle layers: the top and the decoder bottom; the encoder's: the decoder bottom and
    the bottom). The bottom and decoder-bottom layers' own transients are measured too
    (``doc["moments"]``) and belong to their moment alone."""
    from .layers import BOTTOM, DECODER_BOTTOM, TOP
    if not m.is_encoder_decoder or t.pp > 1:
        return {}
    lower = m.num_layers - m.decoder_layers
    named = {len(kinds) - 1: TOP, lower: DECODER_BOTTOM, 0: BOTTOM}  # the layers the moments are named after
    last = {k: i for i, k in enumerate(kinds)}
    return {k: named.get(i, (TOP | DECODER_BOTTOM) if i >= lower else (DECODER_BOTTOM | BOTTOM))
            for k, i in last.items()}


def _largest_dequantized(m: ModelSpec, t: TrainingSpec, stage: str) -> tuple[float, float]:
    """(bytes of the largest dequantized 4-bit layer weight of the stage, its matmul output per
    token in the compute dtype)."""
    from .layers import Policy
    from .quant4 import dequant_dtypes, is_quantized
    dq, cast = dequant_dtypes(t)
    lo, hi = t.stage_span(m.num_layers, stage)
    best = max(((p.numel, p.shape[0]) for p in m.parameter_tensors()
                if p.layer is not None and lo <= p.layer < hi and is_quantized(p, t)), default=(0, 0))
    return float(best[0] * (dq + cast)), float(best[1] * Policy.of(t.precision).half)


def head_during_loss(m: ModelSpec, t: TrainingSpec, stage: str) -> float:
    """Bytes per token of the head's tensors alive while the model's own loss runs inside its
    forward and freed when the forward returns (the final norm's output, held by the forward's
    locals); 0 when the loop computes the loss outside the model (``--loss``) or off the last stage."""
    if t.loss is not None or not (t.pp == 1 or stage == "last"):
        return 0.0
    tok, s, _sq = coefficients(m, t)["head_loss"]
    return max(tok + s, 0.0)


def head_forward(m: ModelSpec, t: TrainingSpec, stage: str) -> float:
    """Bytes per token an image model's head holds at its forward's highest point beyond the head
    side's saved tensors (``trace.derive._head_forward``: SigLIP's attention-pooling head, run but
    not read); 0 when not measured (other models, coefficients derived before it was) or off the
    last pipeline stage."""
    if not (t.pp == 1 or stage == "last"):
        return 0.0
    doc = coefficients(m, t)
    tok, s, _sq = doc.get("head_forward", (0.0, 0.0, 0.0))
    return max(tok + s, 0.0)


def top_forward(m: ModelSpec, t: TrainingSpec, stage: str) -> tuple[tuple[float, ...], ...]:
    """An encoder head's forward moments from its top layer's first tensor to the logits, beyond
    every layer's saved tensors and the embedding and head sides (``trace.derive._top_forward``:
    the frame-held top-layer input, a linear's output beside its dropout's, a residual sum beside
    its LayerNorm's output, DeBERTa's attention scores while its top layer's attention runs): a
    sequence classifier's or question-answering head's forward peak, which has no vocabulary-sized
    loss after it. Up to ``trace.derive.TOP_MOMENTS`` moments (which is the highest depends on the
    batch and sequence), each as (bytes per token, per token x key, per position, per sample, per
    position pair shared by the batch), with what each layer below the top holds then beyond its
    saved tensors (``top_held``) for the full model's layers beyond the cut model's, less the cache the
    output holds (every layer's ``held``: the engine's moment adds it). A decoder's too
    (``top_forward_measured``). Empty for other heads, off the last pipeline stage, and under recompute
    (measured with every layer's tensors saved: a checkpointed layer saves none in forward)."""
    if not top_forward_measured(m) or t.recompute not in (None, "none") or not (t.pp == 1 or stage == "last"):
        return ()
    doc = coefficients(m, t)
    held, more = doc.get("top_held", {}), max(m.num_layers - doc.get("cut_layers", m.num_layers), 0)
    # the cache the output holds (each layer's ``held``, bytes per token) is freed by ``del out``, inside
    # the traced forward phase, so ``_top_forward`` counts it in each moment (not among the tensors alive
    # at the forward's end it takes off) and the engine's moment adds it again (``moments.Tokens.kv_held``,
    # every layer's): taken off here, as ``kind_forward`` does. Qwen3.5's linear-attention layers' cache
    # states (transformers 5.24 ``modeling_qwen3_5.py`` L585, L647: ``cache.update_conv_state``,
    # ``update_recurrent_state``) are 10.1 MiB a layer at the architecture sweep's config, 30.4 of its
    # 30.5 MiB top moment (peak +4.11% against trace; +0.24% without them)
    cache = sum(doc["kinds"][k].get("held", 0.0) for k in stage_kinds(m, t, stage, doc))
    top = tuple(tuple(float(c.get(k, 0.0) + more * held.get(k, 0.0) - (cache if k == "n" else 0.0))
                      for k in ("n", "nsq", "s", "b", "ssq")) for c in doc.get("top_forward", ()))
    lower = kind_forward(doc) if t.pp == 1 else None
    return top + ((lower, 0.0, 0.0, 0.0, 0.0),) if lower is not None and len(top) < 2 else top


def kind_forward(doc: dict[str, Any]) -> float | None:
    """The highest of a point set's layer kinds' forward peaks (``trace.derive._kind_forward``), each at
    its kind's highest layer ``J`` in the full model, as a top-forward moment (the engine adds it to
    every layer's saved tensors and the embedding and head sides): bytes per token, its measured peak
    over the tensors made before its layer less what is made from layer ``J`` on (each layer's saved
    bytes from ``J`` up, the head side) and less every layer's cache the output holds, which the
    engine's moment adds to the saved bytes that already count it. None for a fitted set (its kinds have no ``forward_peak``):
    their top layer's forward is ``top_forward``'s. The later layers' autocast weight copies, which
    the engine counts among the saved tensors and which are not made yet at ``J``, are not taken off
    (a few layers' half weights: high by them)."""
    kinds, order = doc.get("kinds", {}), doc.get("layer_kinds", [])
    peaks = {k: c["forward_peak"] for k, c in kinds.items() if "forward_peak" in c}
    if not peaks or not order:
        return None
    head = doc.get("head", [0.0])[0]
    # the engine's moment adds the cache the output holds (``moments.Tokens.kv_held``: every layer's ``held``),
    # which the layers' saved bytes (``tok``: every tensor of the layer alive at the forward's end) count already
    held = sum(kinds[k].get("held", 0.0) for k in order)
    out = []
    for kind, peak in peaks.items():
        j = max(i for i, k in enumerate(order) if k == kind)
        out.append(peak - sum(kinds[k]["tok"] for k in order[j:]) - head - held)
    return max(out)


def loss_upcasts(m: ModelSpec, t: TrainingSpec) -> bool | None:
    """Whether a derived masked or causal LM's own loss casts its logits to fp32 first, as traced
    (``trace.derive._loss_upcasts``: transformers' ``ForMaskedLMLoss``, ModernBERT's, and ``ForCausalLMLoss``);
    the heads that call ``CrossEntropyLoss()`` on the half logits do not (``quantities.model_facts.loss_upcasts``): BERT's
    masked-LM head, and the decoder-only class of an encoder-decoder family (transformers 5.24
    ``models/marian/modeling_marian.py`` and ``models/bart/modeling_bart.py`` ``...ForCausalLM.forward``:
    ``loss_fct = CrossEntropyLoss()`` on ``logits.view(-1, vocab)``). None where it was not measured: a
    causal LM derived in fp32 (its logits are fp32 either way) or before it was recorded, which keeps
    transformers' ``ForCausalLMLoss`` (``quantities.model_facts.loss_upcasts``)."""
    if m.family != "derived" or m.head not in ("masked-lm", "causal-lm") or derived_problems(m, t):
        return None
    measured = coefficients(m, t).get("loss_upcast")
    if m.head == "masked-lm":
        return bool(measured)
    return None if measured is None else bool(measured)


def outer_per_sample(m: ModelSpec, t: TrainingSpec, stage: str) -> float:
    """Bytes per sample (sized by the batch alone) an encoder head's model keeps through the step
    (``trace.derive.ENCODER_TERMS``' ``b``): a sequence classifier's pooled (b, h) output and
    (b, labels) logits on the head side, DeBERTa's per-layer ``repeat`` of the relative position
    projections over the batch (transformers 5.24 ``models/deberta_v2/modeling_deberta_v2.py``
    ``disentangled_attention_bias``: (b x heads, 2 x position_buckets, head_dim), saved by the
    ``bmm`` with the query) in the layers; 0 for other heads."""
    if m.is_vlm:
        return t.images * vision_side(m, t)["per_image"]
    return _summed(m, t, stage, "per_sample")


def first_free_casts(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes of the first layer's half weight copies no matmul saves (``trace.derive._weight_casts``'
    ``first_free``: with LoRA under autocast the frozen linears on the first layer's input, which needs no
    gradient, keep no copy of their weight, which the engine counts in every layer); measured for
    vision-language models (0 for others: the shipped coefficients of derived decoders predate it)."""
    if m.family != "derived" or derived_problems(m, t):
        return 0
    return int(coefficients(m, t).get("first_free_casts", 0))


def view_casts(m: ModelSpec, t: TrainingSpec, stage: str) -> int:
    """Bytes of the stage's average layer's half copies of weight *slices* its matmuls save under autocast
    (``trace.derive``'s ``view_casts``, per kind, the records ``trace.cuda.CudaEmulation._cast`` labels
    ``autocast_weight_view``). A per-expert MoE loop multiplies by each expert's slice, ``weight[e]`` (DBRX
    ``x.matmul(expert_w1.T)``, transformers 5.24 ``models/dbrx/modeling_dbrx.py`` L264-268; JetMoE
    ``F.linear(input_list[i], self.weight[i])``, ``models/jetmoe/modeling_jetmoe.py`` L154; LongCat-Flash
    ``F.linear(current_state, self.gate_up_proj[expert_idx])``, ``models/longcat_flash/modeling_longcat_flash.py``
    L198-200): autocast casts a view at every call, uncached (``aten/src/ATen/autocast_mode.cpp``
    ``cached_cast``: only fp32 leaves that require grad and are no view), so each expert hit keeps a
    half copy of its slice until its backward, in all the experts' half weights under a balanced routing
    (``trace.routing_values``). The engine's own count (``states``' ``layer_matmul_half``) has the linears'
    leaf weights only (grouped_mm experts are cast by none); this is added to it. 0 for coefficients
    derived before it was measured."""
    if m.family != "derived" or derived_problems(m, t):
        return 0
    doc = coefficients(m, t)
    kinds = stage_kinds(m, t, stage, doc)
    return int(sum(doc["kinds"][k].get("view_casts", 0) for k in kinds) / max(len(kinds), 1))


def vision_side(m: ModelSpec, t: TrainingSpec) -> dict[str, float]:
    """A vision-language model's vision tower and projector at the end of the forward (``trace.derive.
    _vision_fit``): bytes per image (its patches' saved activations through the whole tower, the
    projector's input and output; Qwen2-VL's at ``--image-size``, a part of the key) and constant bytes
    (a trained tower's cached half weight copies under autocast). Alive from the forward until the tower's
    backward, after the language model's: counted with the activations at every moment."""
    return coefficients(m, t).get("vision", {"per_image": 0.0, "const": 0.0})


def outer_const(m: ModelSpec, t: TrainingSpec, stage: str) -> float:
    """Bytes an encoder head's model keeps through the step whatever the batch and sequence
    (``trace.derive.ENCODER_TERMS``' constant): each DeBERTa-v2 layer's half casts of its (2 x
    position_buckets, h) relative embeddings for the query and key projections and their dropout's
    (5.24 ``modeling_deberta_v2.py`` ``disentangled_attention_bias``); 0 for other heads, whose
    derivations leave the constant out."""
    if m.is_vlm:
        return vision_side(m, t)["const"]
    return _summed(m, t, stage, "const")


def _summed(m: ModelSpec, t: TrainingSpec, stage: str, terms_of: str) -> float:
    """An encoder head's ``terms_of`` coefficients over the stage's layers, its first layer's
    excess and the embedding and head sides on the stages that hold them."""
    doc = coefficients(m, t)
    b = doc.get(terms_of)
    if not b:
        return 0.0
    out = sum(b.get(f"kind.{k}", 0.0) for k in kept_kinds(m, t, stage, doc))
    out += b.get("embed", 0.0) + b.get("first", 0.0) if (t.pp == 1 or stage == "first") else 0.0
    return out + (b.get("head", 0.0) if (t.pp == 1 or stage == "last") else 0.0)


def grad_views(m: ModelSpec, t: TrainingSpec) -> tuple[float, float, float]:
    """Bytes of gradient storages beyond the gradients, after backward, as (per token, per sequence
    position, constant):
    a parameter's ``.grad`` that ``AccumulateGrad`` stole as a view of a larger tensor
    (``trace.derive._grad_view_bytes``: ViT's class token at micro-batch 1 keeps the whole (1, s,
    hidden) embedding gradient, in the embeddings' dtype). Measured with the model's parameters
    as one GPU holds them; 0 where the gradients do not stay the autograd ones: FSDP and ZeRO
    reduce them into flat buffers, a pipeline stage holds part of the model, the optimizer in
    backward frees each as it is made; and for coefficients derived before it was measured."""
    if t.fsdp is not None or t.zero > 0 or t.pp > 1 or t.grads_freed_in_backward:
        return 0.0, 0.0, 0.0
    tok, pos, const = coefficients(m, t).get("grad_views", (0.0, 0.0, 0.0))
    return tok, pos, const


def outer(m: ModelSpec, t: TrainingSpec, stage: str) -> tuple[list[tuple[str, float, float]], float]:
    """Tensors outside the layers as (name, tok, sq), and the embedding side's bytes per sequence
    position shared by the batch (rotary tables built from ``(1, s)`` position ids)."""
    doc = coefficients(m, t)
    out: list[tuple[str, float, float]] = []
    pos = 0.0
    first_ckpt, top_ckpt = recomputed_ends(m, t) if not doc.get("checkpointed") else (False, False)
    if t.pp == 1 or stage == "first":
        tok, s, sq = doc["embed"]
        # a checkpointed first layer keeps its input, counted with the layers' kept inputs: where
        # the embedding side holds that tensor too (a norm saved it: CLIP's pre_layrnorm output,
        # ViT's and Falcon's embeddings), it is not counted twice
        tok -= doc.get("first_input", 0.0) if first_ckpt else 0.0
        # per-layer inputs (Gemma 3n's, ``trace.derive._per_layer_inputs``): measured for the cut model's layers,
        # made for every layer of the model
        per_layer, cut = doc.get("per_layer_inputs", (0.0, 1))
        tok += per_layer * (m.num_layers - cut) / cut
        out.append(("derived.embedding_side", tok, sq))
        pos = s + doc["first_layer"][1]
    # the layers' tensors sized by the sequence alone (not by the batch), counted with these
    pos += sum(doc["kinds"][k].get("pos", 0.0) for k in stage_kinds(m, t, stage, doc))
    if t.pp == 1 or stage == "last":
        tok, s, sq = doc["head"]
        # a checkpointed top layer keeps only its input; its output, which the final norm saves,
        # is then the head side's until the head's backward (measured: ``trace.derive._layer_outputs``)
        tok += doc.get("top_kept", 0.0) if top_ckpt else 0.0
        out.append(("derived.head_side", tok + max(s, 0.0), sq))  # a per-position term read as per token
    return out, pos


def recomputed_ends(m: ModelSpec, t: TrainingSpec) -> tuple[bool, bool]:
    """Whether a stage's first and top layers are checkpointed under ``t``'s full recompute: a layer
    is when its 1-based count on the stage is a multiple of ``recompute_every`` (torchtitan
    ``distributed/activation_checkpoint.py``, as ``quantities.build._build`` reads it), so the first one
    only when every layer is, the top one when the stage's layer count is a multiple."""
    if t.recompute != "full":
        return False, False
    layers = m.num_layers // (t.pp * t.virtual_stages)
    return t.recompute_every == 1, layers % t.recompute_every == 0


def logits_bytes(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes per element of the logits the traced model returns (an encoder-decoder's, measured by
    the derivation; 0 when not measured)."""
    return int(coefficients(m, t).get("logits_bytes", 0))


def kept_kinds(m: ModelSpec, t: TrainingSpec, stage: str, doc: dict[str, Any]) -> list[str]:
    """The kinds of the stage's layers that keep their tensors through the step: all of them, but
    under full recompute (an encoder head's coefficients are traced without it) only those not
    checkpointed (a checkpointed layer keeps its input alone: ``recomputed_ends``' rule, every
    ``recompute_every``-th layer of the stage is)."""
    kinds = stage_kinds(m, t, stage, doc)
    if t.recompute != "full" or m.head not in ENCODER_HEADS:
        return kinds
    return [k for i, k in enumerate(kinds) if (i + 1) % t.recompute_every]


def outer_ssq(m: ModelSpec, t: TrainingSpec, stage: str) -> float:
    """Bytes per sequence position squared, shared by the micro-batch: an encoder-decoder's (s, s)
    tensors (T5's relative position buckets, ``T5Attention.compute_bias``, which the first layer
    of each stack makes and its embedding saves), over all its layers, the first-layer excess and
    the embedding and head sides (0 for other architectures)."""
    doc = coefficients(m, t)
    ssq = doc.get("ssq")
    if not ssq:
        return 0.0
    kinds = kept_kinds(m, t, stage, doc)
    return (sum(ssq.get(f"kind.{k}", 0.0) for k in kinds)  # (an encoder head's ``head_loss`` and
            + sum(ssq.get(side, 0.0) for side in ("first", "embed", "head")))  # ``top_forward``: its moments')


def notes(m: ModelSpec, t: TrainingSpec) -> list[str]:
    """What a derived estimate's report should say: that its activations were measured, and an
    attention implementation other than the one asked for (a class without SDPA runs eager)."""
    point = point_at(m, t)
    k = (m, key(m, t), t.attention, point, t.mixer_kernels)  # (a skipped fused path shares the key, not the note)
    hit = _NOTES.get(k)
    if hit is None:  # (stored whole: a second estimate of the setup says what the first said)
        hit = _notes(m, _doc(m, t), t.attention, _canonical(t, m))
        if point:
            hit += (point_note(m, point_quantity(m, t), _doc(m, t)),)
        _NOTES[k] = hit
    return list(hit)


def point_note(m: ModelSpec, quantity: str, doc: dict[str, Any]) -> str:
    """The report's line for coefficients derived at the setup's point (``point_at``)."""
    b, s = doc["point"]
    return (f"{m.model_type}: its memory is not polynomial in the batch and sequence (its {quantity}): its "
            f"coefficients were derived at this batch ({b}) and sequence ({s}) only, from one trace of the cut "
            f"model ({doc.get('seconds', 0.0):.1f} s); another batch or sequence is derived again")


_NOTES: dict[tuple, tuple[str, ...]] = {}


def _notes(m: ModelSpec, doc: dict[str, Any], attention: str, t: TrainingSpec) -> tuple[str, ...]:
    out = [f"{m.model_type}: activations derived from traces of the real {m.architecture} "
           f"(trainmem.trace.derive), not hand-written formulas"]
    if doc.get("batch1_fallback"):
        out.append(f"{m.model_type}: no micro-batch-1 coefficients are stored for this setup and deriving them "
                   f"needs torch: it is estimated with those fitted on batches of 2 and more, which count as "
                   f"copies a few tensors that are views at batch 1 (slightly high)")
    if note := reference_path_note(m.model_type, t.mixer_kernels, fused_skipped(m, t)):
        out.append(note)
    if doc.get("attention") == "eager" and t.attention != "eager":
        out.append(f"{m.architecture} has no SDPA attention in transformers: it runs eager attention "
                   f"(--attention {attention} is not honoured)")
    return tuple(out)
