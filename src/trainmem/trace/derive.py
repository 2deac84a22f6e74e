"""Derive a layer's activation coefficients from traces of the real model (any architecture).

The hand-written families describe a layer op by op (``estimate/layers.py``). For every other
architecture transformers ships, the same coefficients are measured: the real model, cut to a few
layers (``reduced_config``: enough to contain each kind of layer), is traced — forward, the loss,
backward, on the emulated GPU, no optimizer — at four batch/sequence points, and each quantity
the engine needs is fitted exactly as ``tok * b*s + pos * s + sq * b*s^2 + const`` (a backward
transient as ``a * b*s + b * b*s^2 + c``), then checked on a fifth point. A quantity that the fit
does not reproduce there is refused with one line rather than extrapolated. Micro-batch 1, where
some tensors are views that larger batches copy, has a set of its own, fitted on batch-1 points
(``batch1_points``, ``BATCH1_TERMS``). An encoder-decoder's quantities are fitted in its two
lengths, the encoder's and the decoder's (``ENCDEC_TERMS``, ``encdec_coefficients``).

What is measured in one trace (``_measure``), with ``n = b*s`` tokens:

Bytes are the tensors' own (``nbytes``): exact polynomials. The allocator's rounding and unsplit
block remainders, which the trace's totals include, are not part of the coefficients.

* ``saved[kind]``: bytes a layer holds at the end of the forward (its tensors saved for backward,
  or otherwise still referenced), attributed to the layer by the module that allocated them;
* ``embed`` / ``head``: the same for tensors made outside the layers before the first layer
  (embeddings, rotary tables, masks) and after the last (final norm, the head's input, a logit
  soft-cap's saved tanh), the returned logits and the loss excluded (the engine's
  ``loss_bytes`` models those);
* ``transient[kind]``: the backward of a layer at its highest point, over the tensors the engine
  already counts there (every layer's saved tensors, parameter gradients, the workspace): the
  backward temporaries alive (the incoming gradient included) less the layer's saved tensors freed
  by then; ``grads``: the share of the layer's parameter gradients already made at that point;
* for full recompute, which the engine models as each layer keeping its input and one layer
  re-created in its backward: ``first_input`` (the embedding side's bytes that are the first
  layer's input, which its checkpoint keeps again), ``top_kept`` (the top layer's output, which
  the final norm saves) and ``not_recomputed`` (a layer's output, which only what follows it
  saved and a recomputation does not make again).

The sequence points straddle the model's sliding window, if any, so that sliding layers are
measured in the regime long sequences run in.
"""
from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

from ..errors import TrainmemError
from ..progress import progress
from ..spec import ModelSpec, TrainingSpec
from ..spec.profile import build_profile, layer_stacks, layers_list
from ..spec.vision import VISION_SIDE, VLM_TYPES, min_seq_len, vision_inputs
from ..estimate.derived import checkpointed, scan_chunk, sliding_window, top_forward_measured
from ..estimate.quantities import is_lm
from ..workload import (apply_lora, apply_quantization, attention_implementation, emulated_mixers, freeze_vision_tower,
                        hf_factory, model_batch, step_failure, unwrapped)

#: relative error a fitted quantity may show on the held-out point (plus DERIVE_SLACK bytes)
DERIVE_TOLERANCE = 0.005
DERIVE_SLACK = 4096


class NotPolynomial(TrainmemError):
    """A derived quantity the fit over batch and sequence does not reproduce (``what`` names it):
    ``estimate.derived`` then derives the coefficients at the setup's own point (``point``)."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


def _measured_extras(m: ModelSpec, runs: list[dict], pts: list, n_cut: int, out: dict[str, Any]) -> None:
    """What only some models have, written into ``out``: the first layer's and the head's bytes the
    graph holds until the loop drops the loss (old bitsandbytes' kept 4-bit inputs, ``_graph_held``),
    Gemma 3n's per-layer inputs (bytes per token at the cut model's ``n_cut`` layers,
    ``_per_layer_inputs``) and, where the logits are half, whether the
    model's own loss upcasts them (``estimate.derived.loss_upcasts``)."""
    for side in ("first", "head"):  # (``_graph_held``; ``estimate.derived.layer_coefs``)
        if any(r["graph"][side] for r in runs):
            out[f"{side}_graph"] = _fitted(m, f"{side} side's graph-held bytes", pts, [r["graph"][side] for r in runs],
                                           ("n",))[0]
    if any(r["per_layer_inputs"] for r in runs):
        tok = _fitted(m, "per-layer inputs' bytes", pts, [r["per_layer_inputs"] for r in runs], ("n",))[0]
        out["per_layer_inputs"] = [tok, n_cut]
    if m.head == "causal-lm" and runs[-1]["logits_bytes"] == 2:
        out["loss_upcast"] = bool(runs[-1]["loss_upcast"])


def derive_coefficients(m: ModelSpec, t: TrainingSpec, regime: str = "", batch1: bool = False,
                        point: tuple[int, int] | None = None) -> dict[str, Any]:
    """The coefficients of ``m`` trained as ``t`` (one GPU, no recompute; ``t.recompute == "full"``
    derives them without the KV cache, as transformers runs checkpointed layers, and an
    encoder-decoder's with its layers checkpointed, ``estimate.derived.checkpointed``), as a JSON-ready dict:
    ``kinds`` (per layer kind: saved tok/sq and parts, transient a/b/c and gradient share),
    ``layer_kinds`` (the kind of each of the model's layers), ``embed``/``head`` (tok, sq).

    ``batch1``: the coefficients of micro-batch 1 (a decoder or image model), fitted on points of
    batch 1 alone (``batch1_points``), in the same format (``batch: 1``); see ``BATCH1_TERMS``. ``point``:
    (batch, sequence): one trace there, for a model not polynomial in them (``NotPolynomial``), each
    quantity's bytes over b*s its per-token term (``_fitted``, ``_point_candidates``)."""
    no_cache = t.recompute == "full"  # spec.training.without_cache: derive with use_cache off
    # an encoder-decoder under full recompute is traced with its layers checkpointed (``checkpointed``)
    ckpt = checkpointed(m, t)
    base = replace(t, recompute="none", recompute_every=1, grad_accum=1, hold_output="loss", loss="upcast",
                   later_seq_len=None, min_seq_len=None,
                   loss_chunks=1, loss_shift="labels", optimizer_in_backward=False, zero_grad="none")
    cfg, kinds_full, kinds_small = reduced_config(m)
    if no_cache:
        cfg = dict(cfg, use_cache=False)
    s0 = _base_seq(m, regime, t.image_size)
    if m.is_encoder_decoder:  # two lengths: the encoder's and the decoder's (``encdec_coefficients``)
        return encdec_coefficients(m, t, cfg, (kinds_full, kinds_small), base, s0)
    points, check, terms = ([], point, ("n", "s", "nsq", "1")) if point else _points(m, s0, batch1)
    # refinements of the backward transients applied to the encoder-decoder, image and encoder-head
    # models only (``_transients``' early frees, ``_candidates``' gradients: ModernBERT's classifier,
    # whose top layer's backward peaks after the head's backward freed the final norm's tensors, was
    # +1.4% without them): decoder LMs would need them too, but their shipped coefficients predate
    # them and re-shipping is the lead's call
    refined = m.is_image or m.head in ENCODER_HEADS
    if not point and not regime:
        _probe_operations(m, cfg, kinds_small, base, ckpt)
    # a VLM under full recompute: transformers checkpoints its vision tower's blocks too (they are
    # ``GradientCheckpointingLayer``s: ``modeling_utils.py`` ``set_gradient_checkpointing`` L3240-3249), traced so
    runs = _runs(m, cfg, kinds_small, base, points + [check], ckpt, vision_ckpt=m.is_vlm and t.recompute == "full")
    out: dict[str, Any] = {"layer_kinds": kinds_full, "kinds": {}, "points": points + [check],
                           "attention": attention_implementation(m, t)[0], "seq_base": s0}
    if ckpt:
        out["checkpointed"] = True
    if batch1:
        out["batch"] = 1
    out.update({"point": list(point)} if point else {})
    pts = points + [check]

    def fit(what: str, ys: list[int], check_fit: bool = True) -> dict[str, float]:
        # (at batch 1 the per-position term is the per-token one: ``BATCH1_TERMS`` has no ``s``)
        return dict({"s": 0.0}, **dict(zip(terms, _fitted(m, what, pts, ys, terms, check_fit))))
    for kind in sorted(set(kinds_small)):
        _kind_coefficients(m, kind, runs, (pts, terms, fit, refined), out)
        if point and "kind_forward" in runs[-1]:  # (``_kind_forward``: per token at the point)
            out["kinds"][kind]["forward_peak"] = runs[-1]["kind_forward"].get(kind, 0) / (point[0] * point[1])
    c = fit("first layer's bytes", [r["first"] for r in runs])
    out["first_layer"] = [c["n"], c["s"], c["nsq"]]
    if m.head in ENCODER_HEADS:
        out.setdefault("ssq", {})["first"] = c.get("ssq", 0.0)
        out.setdefault("const", {})["first"] = c.get("1", 0.0) - runs[-1]["wcast"]["first"]
    # full recompute (``derived.layer_coefs``, ``derived.outer``): the first layer's input where the
    # embedding side holds it (kept again as a checkpoint input), the top layer's output kept by what
    # follows it, and the end layers' outputs beside their kinds' (``_layer_outputs``), per token
    for name, what in (("first_input", "first layer's input"), ("top_kept", "top layer's kept output"),
                       ("first_early", "end layers' outputs")):
        out[name] = _fitted(m, what, pts, [r[name] for r in runs], ("n",))[0]
    if m.head in ENCODER_HEADS:
        _encoder_head_top(m, runs, (pts, terms, fit), len(kinds_small), out)
    elif top_forward_measured(m):
        _decoder_top(m, runs, (pts, terms, fit), len(kinds_small), out)
    _measured_extras(m, runs, pts, len(kinds_small), out)
    sides = _outside_layers(m, runs, fit)
    if m.is_vlm:
        sides["vision"] = _vision_fit(m, [r["images"] for r in runs], [r["vision"] for r in runs])
        # (its decoders' shipped coefficients predate it: ``estimate.derived.first_free_casts``)
        sides["first_free_casts"] = runs[-1]["wcast"]["first_free"]
    for terms_of in ("per_sample", "ssq", "const"):  # (an encoder head's: the layers' and the sides' in one dict each)
        if terms_of in sides:
            sides[terms_of] = dict(out.get(terms_of, {}), **sides[terms_of])
    return dict(out, **sides)


def _kind_coefficients(m: ModelSpec, kind: str, runs: list[dict[str, Any]], how: tuple, out: dict[str, Any]) -> None:
    """One layer kind's coefficients into ``out["kinds"][kind]`` (``derive_coefficients``); ``how``: (the
    points, the terms, the fitting function, whether the transients are refined)."""
    pts, terms, fit, refined = how
    # a layer may keep tensors sized by the sequence alone (Falcon's rotary cos/sin cache)
    # and a few bytes per layer whatever the size (a norm's ``1 + weight``): fitted, then left out
    c = fit(f"layer {kind} saved bytes", [r["saved"][kind] for r in runs])
    parts = {}
    for name in runs[-1]["parts"][kind]:
        ys = [r["parts"][kind].get(name, 0) for r in runs]
        # the same terms as the layer's total, so the parts' coefficients add up to it (least
        # squares is linear in the data); their per-position terms are in the total's ``pos``
        cp = fit("", ys, check_fit=False)
        parts[name] = [cp["n"], cp["nsq"]]
    trans = _candidates(m, pts, [r["transient"][kind] for r in runs], [r["made"][kind] for r in runs],
                        runs[-1]["total_g"][kind], terms, with_grads=refined)
    cache = _fitted(m, f"layer {kind} KV cache", pts, [r["cache"][kind] for r in runs], ("n",))[0]
    held = _fitted(m, f"layer {kind} output-held bytes", pts, [r["held"][kind] for r in runs], ("n",))[0]
    out["kinds"][kind] = {"tok": c["n"], "sq": c["nsq"], "pos": c["s"], "parts": parts, "transients": trans,
                          "cache": cache, "held": held, **_sequence(runs, kind, fit)}
    if runs[-1].get("view_casts", {}).get(kind):  # (the same at every point: a constant, ``derived.view_casts``)
        out["kinds"][kind]["view_casts"] = runs[-1]["view_casts"][kind]
    if any(r["graph"][kind] for r in runs):  # kept by the graph's nodes until it is freed (``_graph_held``)
        out["kinds"][kind]["graph"] = _fitted(m, f"layer {kind} graph-held bytes", pts,
                                              [r["graph"][kind] for r in runs], ("n",))[0]
    if m.head in ENCODER_HEADS:  # (``ENCODER_TERMS``: ``estimate.derived.outer_ssq``, ``outer_per_sample``)
        out.setdefault("ssq", {})[f"kind.{kind}"] = c.get("ssq", 0.0)
        out.setdefault("per_sample", {})[f"kind.{kind}"] = c.get("b", 0.0)
        # (at batch 1, ``BATCH1_TERMS``, the per-sample bytes are in the constant)
        out.setdefault("const", {})[f"kind.{kind}"] = c.get("1", 0.0) - runs[-1]["wcast"][kind]
    # the layer's output, kept only by what follows the layer (the next layer, the final norm):
    # a layer recomputed in its backward does not make it again (quantities.layer_moments._recompute);
    # measured at the kind's typical layer (``_analyse``'s ``at``), whose output the next layer
    # keeps (CLIP's top layer's, which nothing after it saves, is freed in forward)
    out["kinds"][kind]["not_recomputed"] = _fitted(m, f"layer {kind} output", pts,
                                                   [r["early"][f"@typical.{kind}"] for r in runs], ("n",))[0]
    if refined:
        # the bytes the transients took off as freed before the backward began (``_transients``'
        # early frees, at the kind's last layer: ViT's top layer's output, saved by the final
        # norm): a recomputed layer never made them again (derived.layer_coefs adds them back)
        out["kinds"][kind]["transient_freed"] = _fitted(m, f"layer {kind} early-freed bytes", pts,
                                                        [r["early"][kind] for r in runs], ("n",))[0]


def _encoder_head_top(m: ModelSpec, runs: list[dict[str, Any]], how: tuple, cut_layers: int,
                      out: dict[str, Any]) -> None:
    """An encoder head's forward moments above the layers' saved tensors (``_top_forward``), what each
    layer holds then, and whether its masked-LM loss upcasts (``estimate.derived.loss_upcasts``)."""
    pts, terms, fit = how
    out["top_forward"] = _top_candidates(m, pts, [r["top_forward"] for r in runs], terms)
    out["top_held"] = dict(fit("top forward's held bytes per layer", [r["top_held"] for r in runs]))
    out["cut_layers"] = cut_layers
    if m.head == "masked-lm":
        out["loss_upcast"] = bool(runs[-1]["loss_upcast"])


def _sequence(runs: list[dict[str, Any]], kind: str, fit: Any) -> dict[str, list]:
    """A kind's forward one tensor at a time (``_layer_sequence``): its saved tensors and its
    temporaries, each fitted as the parts are (bytes per token, per token x key), its linears'
    weight casts among them, and the order of it all; where every point made the same tensors in
    the same order (else nothing: the replay keeps the parts); the saved tensors' last reads ("uK",
    ``_last_reads``) where every point read them at the same places (else the events without them:
    the replay chains them, as before COEF_VERSION 19)."""
    seqs = [r["sequence"][kind] for r in runs]
    first = seqs[0]
    plain = [[e for e in q["events"] if e[0] != "u"] for q in seqs]
    if any(len(q["tensors"]) != len(first["tensors"]) or q["casts"] != first["casts"] or p != plain[0]
           for q, p in zip(seqs, plain)):
        return {}
    events = first["events"] if all(q["events"] == first["events"] for q in seqs) else plain[0]

    def fitted(what: str) -> list[list[float]]:
        out = []
        for j in range(len(first[what])):
            cp = fit("", [q[what][j] for q in seqs], check_fit=False)
            out.append([cp["n"], cp["nsq"]])
        return out
    return {"tensors": fitted("tensors"), "linears": first["casts"], "temps": fitted("temps"),
            "events": events, **_backward_sequence([q.get("backward", {}) for q in seqs], fit)}


#: the terms of a backward sequence's tensor (``_backward_sequence``; ``estimate.derived.backward_bytes``
#: reads them): per token b*s, per position s, per token x key b*s^2, constant, per sample b, per position
#: pair s^2 (those the fit has: ``derive_coefficients``' terms, the others 0)
BACKWARD_TERMS = ("n", "s", "nsq", "1", "b", "ssq")


def _backward_sequence(seqs: list[dict[str, list]], fit: Any) -> dict[str, Any]:
    """A kind's backward one tensor at a time (``_layer_backward_sequence``), each tensor's bytes fitted
    in ``BACKWARD_TERMS`` (a backward tensor may be of a constant size: autocast's half weight gradient),
    the gradients' bytes as measured (constant), under ``bwd_``; where every point ran the same events
    (else nothing: the replay keeps the one block of the worst moment)."""
    first = seqs[0]
    if not first or any(q.get("events") != first["events"] or q["out"] != first["out"] or q["grads"] != first["grads"]
                        or len(q["ins"]) != len(first["ins"]) for q in seqs):
        return {}

    def fitted(what: str) -> list[list[float]]:
        out = []
        for j in range(len(first[what])):
            cp = fit("", [q[what][j] for q in seqs], check_fit=False)
            out.append([float(cp.get(t, 0.0)) for t in BACKWARD_TERMS])
        return out
    return {"bwd_temps": fitted("temps"), "bwd_ins": fitted("ins"), "bwd_grads": first["grads"],
            "bwd_events": first["events"], "bwd_out": first["out"]}


def _outside_layers(m: ModelSpec, runs: list[dict[str, Any]], fit: Any) -> dict[str, list[float]]:
    """The fitted quantities outside the layers: the embedding side, the head side and its loss
    (and an image model's head forward) per token, per position and per token x key; the gradients
    kept as views of larger tensors (``_grad_view_bytes``) per token, per position and constant."""
    out: dict[str, Any] = {}
    for side in ("embed", "head", "head_loss") + (("head_forward",) if m.is_image else ()):
        c = fit(f"{side} bytes", [r[side] for r in runs])
        out[side] = [c["n"], c["s"], c["nsq"]]
        if m.head in ENCODER_HEADS:  # its bytes per sample, per position pair, constant (``ENCODER_TERMS``)
            out.setdefault("per_sample", {})[side] = c.get("b", 0.0)
            out.setdefault("ssq", {})[side] = c.get("ssq", 0.0)
            out.setdefault("const", {})[side] = c.get("1", 0.0) - runs[-1]["wcast"].get(side, 0)
    c = fit("gradient views' bytes", [r["grad_views"] for r in runs])
    out["grad_views"] = [c["n"], c["s"], c["1"]]
    return out


def _points(m: ModelSpec, s0: int, batch1: bool) -> tuple[list[tuple[int, int]], tuple[int, int], tuple[str, ...]]:
    """(the fitting points, the held-out one, the terms) of a decoder, encoder or image model. Batch
    1 is a special case (some transposes are views there, copies for larger batches): the points use
    batches of 2 and more, and batch 1 has its own set (``batch1``: ``batch1_points``). An encoder's
    classifier or question-answering head (``ENCODER_HEADS``) has tensors sized by the batch alone
    (a sequence classifier's pooled (b, h) output, its (b, labels) logits) and by the sequence
    squared alone (DeBERTa's (1, s, s) relative positions, their clamped indices in each layer):
    ``ENCODER_TERMS``, and two more points, batch 4 at ``2 s0`` and batch 2 at ``1.5 s0`` (two
    batches at each of the three lengths: the six columns are independent on these six points)."""
    if batch1:
        *points, check = batch1_points(m, s0)
        return points, check, BATCH1_TERMS
    seqs = _image_seqs(m, s0) if m.is_image else (s0, 2 * s0, s0 + s0 // 2)
    points = [(2, seqs[0]), (4, seqs[0]), (2, seqs[1]), (3, seqs[2])]
    if m.head in ENCODER_HEADS:
        return points + [(4, seqs[1]), (2, seqs[2])], (4, seqs[2]), ENCODER_TERMS
    return points, (4, seqs[2]), ("n", "s", "nsq", "1")


#: images per sample at each fitting point of a vision-language model, the held-out one last (``_points``:
#: (2, s0), (4, s0), (2, 2 s0), (3, 1.5 s0), held out (4, 1.5 s0)); at micro-batch 1 (``batch1_points``:
#: s0, 1.5 s0, 2 s0, held out 1.25 s0). The language model's quantities do not depend on them (its
#: sequence counts the image tokens); the vision tower's are fitted in the micro-batch's images
#: (``_vision_fit``), which these make independent of its samples
VLM_IMAGES = (1, 1, 2, 1, 2)
VLM_IMAGES_BATCH1 = (1, 2, 1, 2)


def vlm_images(m: ModelSpec, image_size: int | None, points: list[tuple[int, ...]]) -> list[int]:
    """Images per sample at a vision-language model's fitting ``points`` (``VLM_IMAGES``), as many as a
    point's sequence holds (``spec.vision.min_seq_len``: below a sliding window, Gemma 3's 1024 tokens, the
    points hold one 256-token image, not two: the fit is then in the batch's images alone)."""
    per = vision_inputs(m.config).tokens(image_size)
    pattern = VLM_IMAGES if len(points) == len(VLM_IMAGES) else VLM_IMAGES_BATCH1
    return [max(1, min(n, s // (per + 1))) for n, (_b, s, *_r) in zip(pattern, points)]


def _vision_fit(m: ModelSpec, imgs: list[int], ys: list[int]) -> dict[str, float]:
    """A vision-language model's vision side (``_analyse``'s ``vision``: what its vision tower and projector
    keep at the end of the forward) fitted as ``per_image * I + const`` in the micro-batch's images ``imgs`` =
    b x images per sample (``vlm_images``) over all points but the last, which it must reproduce
    (``DERIVE_TOLERANCE``). Every image runs the same tower at the same size (LLaVA's and Gemma 3's fixed
    image; Qwen2-VL's ``--image-size``, a part of the key): its tensors are (images x patches, ...) or per
    image (eager attention's (heads, patches, patches) per image or per window), so per image; the constant
    is autocast's cached half copies of a trained tower's weights, saved by its matmuls."""
    import numpy as np
    a = np.array([[float(i), 1.0] for i in imgs])
    coef = np.linalg.lstsq(a[:-1], np.array(ys[:-1], dtype=np.float64), rcond=None)[0]
    predicted = float(a[-1] @ coef)
    if abs(predicted - ys[-1]) > DERIVE_TOLERANCE * abs(ys[-1]) + DERIVE_SLACK:
        raise NotPolynomial(f"{m.name}: its vision tower's saved bytes are not linear in the images (predicted "
                            f"{predicted:,.0f} B, traced {ys[-1]:,} B at {imgs[-1]} images); trainmem will not "
                            f"extrapolate them: use trace", "vision tower")
    return {"per_image": float(coef[0]), "const": float(coef[1])}


#: the heads of an encoder (bidirectional attention, no KV cache) whose derivation fits a per-sample
#: and a per-position-pair term (``ENCODER_TERMS``, ``_points``) and measures the top layer's forward
#: (``_top_forward``)
ENCODER_HEADS = ("masked-lm", "seq-cls", "qa")
#: an encoder head's terms: a decoder's, then per sample (``b``) and per position pair shared by the
#: batch (``ssq`` = s^2: DeBERTa-v2's ``build_relative_position`` (1, s, s) int64 and each layer's
#: ``torch.clamp`` of it, transformers 5.24 ``models/deberta_v2/modeling_deberta_v2.py``); the
#: constant is kept too (``const``: each DeBERTa layer's half casts and dropout of the (2 x buckets, h)
#: relative embeddings it projects, whatever the batch and sequence)
ENCODER_TERMS = ("n", "s", "nsq", "1", "b", "ssq")


#: the terms of a micro-batch-1 fit: at b = 1 the tokens are the positions (``n`` = ``s``), so a
#: quantity is ``tok * s + sq * s^2 + const``, the per-position bytes counted in ``tok``
BATCH1_TERMS = ("n", "nsq", "1")


def batch1_points(m: ModelSpec, s0: int) -> list[tuple[int, int]]:
    """The (batch, sequence) points of a micro-batch-1 fit, the held-out one last: batch 1 at
    ``s0``, ``1.5 s0`` and ``2 s0`` (three points for ``BATCH1_TERMS``' three terms, the sequences
    of the batch >= 2 points), checked at ``1.25 s0``; an image model's are whole patch grids near
    those lengths (``_image_seqs``). They stay on the side of a sliding window ``s0`` is on
    (``_base_seq``: a shorter point crossed Phi-3-medium's, whose mask then takes other operations)."""
    if m.is_image:
        s1, s2, s15 = _image_seqs(m, s0)
        return [(1, s1), (1, s15), (1, s2), (1, _image_seqs(m, s0 + s0 // 4)[0])]
    return [(1, s0), (1, s0 + s0 // 2), (1, 2 * s0), (1, s0 + s0 // 4)]


#: an encoder-decoder's quantities are polynomials in the batch b, the encoder's length s
#: (``--seq-len``) and the decoder's d (``--target-len``): bytes per token of each stack (``n`` =
#: b*s, ``nd`` = b*d), per query x key pair of the encoder's self-attention (``nsq`` = b*s^2), the
#: decoder's (``nsqd`` = b*d^2) and its cross-attention (``nsqx`` = b*d*s), per position of each
#: (``s``, ``sd``), per position pair shared by the batch (``ssq`` = s^2, ``ssqd`` = d^2, ``ssqx`` =
#: d*s: T5's position buckets and biases, ``T5Attention.compute_bias``, and the (1, heads, d, s)
#: cross-attention bias it makes of zeros), and a constant
ENCDEC_TERMS = ("n", "nd", "nsq", "nsqd", "nsqx", "s", "sd", "ssq", "ssqd", "ssqx", "1")
#: the terms of a backward transient of an encoder-decoder (no per-position terms, as for one length)
ENCDEC_TRANSIENT = ("n", "nd", "nsq", "nsqd", "nsqx", "1", "ssq", "ssqd", "ssqx")


#: a speech encoder-decoder's (Whisper's) terms: its encoder's length S is fixed by its config
#: (``ModelSpec.source_positions``; WhisperEncoder refuses any other), so a quantity is a polynomial
#: in the batch b and the decoder's length d alone: b, b*d, b*d^2, 1, d, d^2. Written in
#: ``ENCDEC_TERMS``' names, each the term that is that monomial at S (``n`` = b*S, ``nd`` = b*d,
#: ``nsqd`` = b*d^2, ``s`` = S for a constant, ``sd`` = d, ``ssqd`` = d^2): the terms of S the
#: two-length fit has (b*S^2, b*d*S, S^2, d*S) are then folded into these, and
#: ``estimate.derived.at_lengths`` reads them at the setup's S unchanged. A saved quantity's constant
#: is ``1``, which ``at_lengths`` drops as it drops the two-length fit's: the bytes a layer keeps
#: whatever the batch and lengths are its weights' half copies (with LoRA, autocast casts the frozen
#: weights at each call and the matmul saves the copy: ``autocast_mode.cpp`` ``cached_cast`` caches
#: only leaves that require grad), which the engine counts itself (``autocast_weight_copies``;
#: whisper-small LoRA r32 +18.5% against trace with the constant read as per encoder position); a
#: tensor of the encoder's S positions shared by the batch would fall in it too (Whisper saves none:
#: ``embed_positions(all_positions)`` is only added). A backward transient's constant is ``1`` and
#: its per-decoder-position term ``ssqx`` (d*S), as ``ENCDEC_TRANSIENT`` has no per-position terms
FIXED_ENCODER_TERMS = ("n", "nd", "nsqd", "1", "sd", "ssqd")
FIXED_ENCODER_TRANSIENT = ("n", "nd", "nsqd", "1", "ssqd", "ssqx")


#: a speech encoder-decoder's smallest decoder length of the fit (``fixed_encoder_points``)
FIXED_ENCODER_D0 = 128


def fixed_encoder_points(m: ModelSpec) -> list[tuple[int, int, int]]:
    """A speech encoder-decoder's (batch, encoder length, decoder length) points, the held-out one
    last: the fixed encoder length S, decoder lengths 128, 256 and 384 at batches 2 and 3 (six points
    for the six ``FIXED_ENCODER_TERMS``: a quadratic in d per batch, the two batches separating
    per-sample terms from shared ones); held out: batch 4 at 512. The cut model is traced with
    ``max_target_positions`` raised to 512 where the config has fewer (Whisper's 448;
    ``fixed_encoder_config``). Every length is a multiple of 128: SDPA's kernels pad the query length
    of what they allocate (the memory-efficient kernel's logsumexp to 32, ``aten/src/ATen/native/
    transformers/cuda/attention.cu`` ``kAlignLSE``; the flash kernel's backward accumulators to 128,
    its ``seqlen_q_rounded``), which makes the bytes a step function of d between those multiples:
    whisper-tiny's decoder layer backward traced at d = 96 (fit through 64, 128, 192) missed by 1.4%
    under bf16-amp, at d = 256 by 43% in pure bf16. A setup's length between them is read off the
    polynomial (the padding's bytes, at most b x heads x 128 x head_dim x 4 per tensor, left out)."""
    d0, S = FIXED_ENCODER_D0, m.source_positions
    return [(b, S, d) for d in (d0, 2 * d0, 3 * d0) for b in (2, 3)] + [(4, S, 4 * d0)]


def fixed_encoder_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The cut speech model's config with room for ``fixed_encoder_points``' longest decoder length
    (its decoder's position table longer: a parameter, which the derivation does not measure; the
    activations per decoder token are the same)."""
    longest = 4 * FIXED_ENCODER_D0
    return dict(cfg, max_target_positions=max(int(cfg.get("max_target_positions") or 0), longest))


def encdec_points(s0: int) -> list[tuple[int, int, int]]:
    """An encoder-decoder's (batch, encoder length, decoder length) points, the held-out one last:
    six length pairs (equal, either twice the other, one three times the other), not on one conic,
    so that the quadratic in the two lengths is determined, each at batches 2 and 3, which separates
    the per-sample terms from those shared by the batch (11 terms, 12 points); held out: batch 4
    at lengths (1.5 s0, s0), a pair none of the others has."""
    h = s0 // 2
    pairs = [(s0, s0), (2 * s0, 2 * s0), (2 * s0, s0), (s0, 2 * s0), (s0 + h, h), (h, s0 + h)]
    return [(b, s, d) for s, d in pairs for b in (2, 3)] + [(4, s0 + h, s0)]


def encdec_coefficients(m: ModelSpec, t: TrainingSpec, cfg: dict[str, Any], kinds: tuple[list[str], list[str]],
                        base: TrainingSpec, s0: int) -> dict[str, Any]:
    """``derive_coefficients`` of an encoder-decoder: every quantity fitted in ``ENCDEC_TERMS`` (a
    dict of term -> coefficient, a backward transient ``{"coef": ..., "g": gradient share}``), so the
    estimate takes any target length (``estimate.derived.at_lengths`` reads them at the setup's)."""
    kinds_full, kinds_small = kinds
    ckpt = checkpointed(m, t)
    fixed = m.is_speech_seq2seq  # the encoder's length fixed (``FIXED_ENCODER_TERMS``)
    pts = fixed_encoder_points(m) if fixed else encdec_points(s0)
    cfg = fixed_encoder_config(cfg) if fixed else cfg
    runs = _runs(m, cfg, kinds_small, base, pts, ckpt)
    terms = FIXED_ENCODER_TERMS if fixed else ENCDEC_TERMS
    transient_terms = FIXED_ENCODER_TRANSIENT if fixed else ENCDEC_TRANSIENT
    out: dict[str, Any] = {"terms": list(terms), "layer_kinds": kinds_full, "kinds": {}, "points": pts,
                           "attention": attention_implementation(m, t)[0], "seq_base": s0,
                           "logits_bytes": runs[-1]["logits_bytes"]}
    if ckpt:
        out["checkpointed"] = True

    def fit(what: str, ys: list[int], names: tuple[str, ...] = terms, check_fit: bool = True) -> dict[str, float]:
        return dict(zip(names, _fitted(m, what, pts, ys, names, check_fit)))

    def moment(key: str) -> list[dict[str, Any]]:
        return _candidates(m, pts, [r["transient"][key] for r in runs], [r["made"][key] for r in runs],
                           runs[-1]["total_g"][key], transient_terms, with_grads=True)
    per_token = ("n", "nd")  # what the KV cache, the output's tensors hold: (b, s, ...) and (b, d, ...)
    for kind in sorted(set(kinds_small)):
        v = out["kinds"][kind] = {
            "saved": fit(f"layer {kind} saved bytes", [r["saved"][kind] for r in runs]),
            # (fitted in the same terms as the total, so they add up to it; not checked one by one)
            "parts": {name: fit("", [r["parts"][kind].get(name, 0) for r in runs], check_fit=False)
                      for name in runs[-1]["parts"][kind]},
            "transients": moment(kind),
            "cache": fit(f"layer {kind} KV cache", [r["cache"][kind] for r in runs], per_token),
            "held": fit(f"layer {kind} output-held bytes", [r["held"][kind] for r in runs], per_token)}
        if not ckpt:  # the layer's output, which a recomputed layer does not keep (see derive_coefficients)
            v["not_recomputed"] = fit(f"layer {kind} output", [r["early"].get(kind, 0) for r in runs], per_token)
    out["moments"] = {name: moment(f"@{name}") for name in ("bottom", "decoder_bottom")}
    # what those two moments' transients are measured over (``_moment_base``), and the cut model's
    # layer kinds (the full model's decoder bottom has more encoder layers alive)
    out["moment_base"] = {name: fit(f"{name} layer's activations", [r["base"][name] for r in runs])
                          for name in ("bottom", "decoder_bottom")}
    if fixed:  # (Whisper's decoder embedding, ``_decoder_embedding_base``; the keys of T5's and BART's unchanged)
        out["moment_base"]["decoder_embedding"] = fit("decoder embedding's backward activations",
                                                      [r["base"]["decoder_embedding"] for r in runs])
        out["moment_base"]["decoder_embedding_temp"] = fit("decoder embedding's backward temporaries",
                                                           [r["base"]["decoder_embedding_temp"] for r in runs])
    out["cut_kinds"] = kinds_small
    out["first_layer"] = fit("first layer's bytes", [r["first"] for r in runs])
    for side in ("embed", "head", "head_loss"):
        out[side] = fit(f"{side} bytes", [r[side] for r in runs])
    return out


def _runs(m: ModelSpec, cfg: dict[str, Any], kinds: list[str], base: TrainingSpec, points: list[tuple[int, ...]],
          ckpt: bool, vision_ckpt: bool = False) -> list[dict[str, Any]]:
    """``_measure`` at each (batch, sequence) point; a step that fails on fake tensors is one line."""
    try:
        with _quiet(), progress(len(points), f"deriving {m.name}'s coefficients") as bar:
            runs = []
            images = vlm_images(m, base.image_size, points) if m.is_vlm else [1] * len(points)
            for (b, s, *d), n in zip(points, images):  # (an encoder-decoder's points carry the decoder's length)
                size = base.image_size if m.is_vlm else _image_side(m, s)
                runs.append(_measure(m, cfg, kinds, replace(base, batch_size=b, seq_len=s, target_len=d[0] if d else None,
                                                            image_size=size, images=n), ckpt, vision_ckpt))
                runs[-1]["images"] = b * n  # (the micro-batch's: ``_vision_fit``)
                bar.update(1)
            return runs
    except TrainmemError:
        raise
    except Exception as e:  # the real model's step fails on fake tensors: say which and why, once
        raise TrainmemError(step_failure(m, e)) from None


#: the two short sequences ``_probe_operations`` traces (batch 2) before the fit's points, in chunks of 64
#: tokens or of a Mamba-2 mixer's scan (``estimate.derived.scan_chunk``: a padded and an unpadded sequence
#: run different operations, and the fit's points are whole chunks): two and three, as the fit's points
#: have several (at one chunk some of the scan's tensors have a dimension of 1, and ops that copy
#: elsewhere make views: Nemotron-H's backward makes 331 tensors at one chunk, 339 at two and more)
PROBE_CHUNKS = (2, 3)

#: the quantity a model whose backward runs different operations at different sizes is refused for
#: (``_probe_operations``, ``_candidates``: ``estimate.derived`` names it in the report's point note)
OPS_VARY = "backward transients (its backward runs different operations at different sizes)"


def _probe_operations(m: ModelSpec, cfg: dict[str, Any], kinds: list[str], base: TrainingSpec, ckpt: bool) -> None:
    """Refuse the fit (``NotPolynomial``) before its points when the cut model's backward runs a
    different number of operations at two short sequences (``PROBE_CHUNKS``, batch 2): a model whose
    operation count grows with the sequence (Mamba's reference scan, ``mamba_selective_scan``'s
    ``for index in range(seq_len)``, transformers 5.24 ``models/mamba/modeling_mamba.py`` L261-265;
    chunked linear attention's loop over sequence chunks) would otherwise be traced op by op at the
    fit's five points of 2048 to 4096 tokens (minutes for Mamba on 2 cores) only for ``_candidates``
    to refuse it after them. Run for a decoder LM whose points have no sliding-window
    regime (below or above a window the two short sequences could sit on another side of it than
    the fit's points); the encoder-decoder, image and vision-language models are not probed."""
    if m.is_encoder_decoder or m.is_image or m.is_vlm or m.head in ENCODER_HEADS or (
            m.learned_positions and m.max_positions < PROBE_CHUNKS[-1] * (scan_chunk(m) or 64)):
        return
    seqs = tuple(k * (scan_chunk(m) or 64) for k in PROBE_CHUNKS)
    runs = _runs(m, cfg, kinds, base, [(2, s) for s in seqs], ckpt)
    for kind in sorted(set(kinds)):
        counts = {len(r["transient"].get(kind, ())) for r in runs}
        if len(counts) > 1:
            raise NotPolynomial(f"{m.name}: its backward runs different operations at different sizes "
                                f"(layer {kind}: {' and '.join(str(len(r['transient'].get(kind, ()))) for r in runs)}"
                                f" moments at sequences {' and '.join(map(str, seqs))}); trainmem cannot fit "
                                "its transients (use trace)", OPS_VARY)


# ----- the model cut to a few layers ----------------------------------------------------------------
def _layer_types(cfg: dict[str, Any], n: int) -> list[str]:
    lt = cfg.get("layer_types")
    if lt is None and cfg.get("model_type") in VLM_TYPES:  # a VLM's language model: its text config's, resolved
        from ..spec.profile import hf_config_object
        lt = getattr(hf_config_object(cfg).get_text_config(), "layer_types", None)
    return [str(x) for x in lt] if isinstance(lt, list) and len(lt) == n else [""] * n


def reduced_config(m: ModelSpec) -> tuple[dict[str, Any], list[str], list[str]]:
    """(config of the model cut to its first K layers, the kind of each layer of the full model, the
    kind of each of the K layers). A kind is the layer's parameter signature and its ``layer_types``
    entry (sliding or full attention). K is the smallest count (at least 3 when the model has 3:
    the first, a middle and the top layer differ in what they keep)
    whose layers contain every kind; per-layer lists of the config are cut with it."""
    from ..spec.profile import profile_for
    full_cfg = {k: v for k, v in dict(m.config).items() if not k.startswith("_")}
    prof = profile_for(full_cfg)
    L = m.num_layers
    full = [f"{k}:{a}" if a else k for k, a in zip(prof.layer_kinds, _layer_types(full_cfg, L))]
    want = set(full)
    dec = m.decoder_layers  # an encoder-decoder: both stacks cut to k layers (k <= the shorter one)
    top = min(L - dec, dec) if dec else L
    for k in range(min(3, L - dec, dec) if dec else min(3, L), top + 1):
        cfg = _cut(full_cfg, L, k, dec)
        try:
            small = build_profile(cfg)
        except TrainmemError:
            if full_cfg.get("num_kv_shared_layers") or (k < top and _cut_loses_a_type(full_cfg, cfg, L)):
                # too few layers for a type of every shared layer among the unshared ones (``_cut``), or for
                # a layer type the config requires (OLMo-Hybrid's attention among its linear-attention layers,
                # transformers 5.24 models/olmo_hybrid/configuration_olmo_hybrid.py L146-149; Zamba's second
                # hybrid layer, whose shared block ties to the first one's, models/zamba/modeling_zamba.py L854-862)
                continue
            raise
        sig_small = {kind: tuple((p.name, p.shape) for p in ts) for kind, ts in small.kinds.items()}
        sig_full = {tuple((p.name, p.shape) for p in ts): kind for kind, ts in prof.kinds.items()}
        names = [sig_full.get(sig_small[kd], "?") for kd in small.layer_kinds]
        kinds = [f"{k_}:{a}" if a else k_ for k_, a in zip(names, _layer_types(cfg, len(names)))]
        if want <= set(kinds):
            return cfg, full, kinds
        if k >= 16:
            break
    raise TrainmemError(f"{m.name}: its layer kinds ({', '.join(sorted(want))}) do not all appear in its first "
                        f"layers; trainmem cannot derive its coefficients (use trace)")


def _cut_loses_a_type(full_cfg: dict[str, Any], cfg: dict[str, Any], L: int) -> bool:
    """Whether the cut config ``cfg`` has fewer layers of some type (``layer_types``, or Zamba's
    ``layers_block_type``) than the full config ``full_cfg`` (``L`` layers), counted up to two: a type it lacks, or
    a type whose later layers tie their weights to the first one of it and that the cut keeps once."""
    for key in ("layer_types", "layers_block_type"):
        full, cut = full_cfg.get(key), cfg.get(key)
        if isinstance(full, list) and isinstance(cut, list) and len(full) == L:
            if any(cut.count(t) < min(2, full.count(t)) for t in set(full)):
                return True
    return False


#: an encoder-decoder's layer counts: T5's num_layers / num_decoder_layers, BART's encoder_layers /
#: decoder_layers (its num_hidden_layers is an alias of encoder_layers)
_ENCODER_KEYS = ("num_layers", "encoder_layers", "num_hidden_layers")
_DECODER_KEYS = ("num_decoder_layers", "decoder_layers")


def _cut(cfg: dict[str, Any], L: int, k: int, dec: int = 0) -> dict[str, Any]:
    """``cfg`` cut to its first ``k`` layers (an encoder-decoder: ``k`` in each stack; a vision-language
    model: its language model's, in its ``text_config`` where it has one, the vision tower kept whole:
    ``vlm_images``)."""
    if cfg.get("model_type") in VLM_TYPES and isinstance(cfg.get("text_config"), dict):
        return dict(cfg, text_config=_cut(cfg["text_config"], L, k))
    out = {}
    for key, v in cfg.items():
        out[key] = v[:k] if isinstance(v, list) and len(v) == L and key != "architectures" else v
    if isinstance(cfg.get("per_layer_config"), dict) and not dec:
        # a heterogeneous config's overrides by layer index (transformers' integrations/heterogeneity, Gemma 4's
        # wider full-attention heads): those of the kept layers only (its validation refuses an index >= k)
        out["per_layer_config"] = {i: v for i, v in cfg["per_layer_config"].items() if str(i).isdigit() and int(i) < k}
    if dec:
        for key in _ENCODER_KEYS + _DECODER_KEYS:
            if key in out:
                out[key] = k
        if not any(key in cfg for key in _DECODER_KEYS):
            out["num_decoder_layers" if "num_layers" in cfg else "decoder_layers"] = k
        return out
    # (the decoder-only class of an encoder-decoder family builds its decoder's layers: the decoder's count,
    # ProphetNet's ``num_decoder_layers``, whose config refuses ``num_hidden_layers``)
    counts = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", *_DECODER_KEYS)
    for key in counts:
        if key in out:
            out[key] = k
    if not any(key in cfg for key in counts):
        out["num_hidden_layers"] = k
    shared = cfg.get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < L and k < L:
        # Gemma 3n's and Gemma 4's last ``num_kv_shared_layers`` layers reuse the keys and values of the last
        # earlier layer of their type (transformers 5.24 models/gemma3n/configuration_gemma3n.py L205-225
        # ``kv_sharing_modes``: every type among the shared layers needs one among the others): the cut model's
        # last half shares as the full model's last layers do (``reduced_config`` matches its kinds)
        out["num_kv_shared_layers"] = min(shared, k // 2)
    return out


def _base_seq(m: ModelSpec, regime: str = "", image_size: int | None = None) -> int:
    """The smallest sequence of the fitting points: 2048; with a sliding window some sequence
    reaches (``estimate.derived.regime``), sequences that stay
    on one side of it (``regime`` "below": every point shorter than the window, where transformers'
    ``sdpa_mask`` drops the mask for ``is_causal`` (``_ignore_causal_mask_sdpa``: kv length below
    the local attention size); "above": twice the window and more); within the learned positions."""
    window = sliding_window(m) if regime else 0  # "": no window, or one no sequence reaches
    s0 = 2048
    if window and regime == "below":
        s0 = max(128, window // 4)  # points up to half the window: transformers keeps is_causal only below it
    elif window:
        s0 = max(2048, 2 * window)
    if m.learned_positions:
        s0 = min(s0, m.max_positions // 2)
    if m.is_vlm and not (window and regime == "below"):  # room for ``VLM_IMAGES``' images, each after a text
        vis = vision_inputs(m.config)                     # token (below a window: one, ``vlm_images``)
        s0 = max(s0, -(-min_seq_len(max(VLM_IMAGES), vis.tokens(image_size)) // 128) * 128)
    elif m.is_vlm:
        s0 = max(s0, -(-min_seq_len(1, vision_inputs(m.config).tokens(image_size)) // 128) * 128)
    return max(128, s0 // 128 * 128)


def _image_seqs(m: ModelSpec, s0: int) -> tuple[int, int, int]:
    """An image model's sequences near ``s0``, ``2 s0`` and ``1.5 s0``: squares of whole patch
    rows plus the class tokens (each is an image size the model takes)."""
    def near(s: float) -> int:
        return m.image_tokens(max(2, round((s - m.class_tokens) ** 0.5)) * m.patch_size)
    return near(s0), near(2 * s0), near(1.5 * s0)


def _image_side(m: ModelSpec, s: int) -> int | None:
    """The image side in pixels whose patches make sequence ``s`` (None: not an image model)."""
    if not m.is_image:
        return None
    return round((s - m.class_tokens) ** 0.5) * m.patch_size


# ----- one trace ------------------------------------------------------------------------------------
def _measure(m: ModelSpec, cfg: dict[str, Any], kinds: list[str], t: TrainingSpec, ckpt: bool = False,
             vision_ckpt: bool = False) -> dict[str, Any]:
    """Trace forward + loss + backward of the cut model at ``t``'s batch and sequence (``ckpt``: with
    every layer checkpointed, as ``workload.TrainStep`` enables it for ``--recompute full``; ``vision_ckpt``:
    a VLM's vision tower's blocks alone, ``_checkpoint_vision``)."""
    from .api import _device, _load_to_device, _on_device
    small = replace(m, num_layers=len(kinds), config=cfg, decoder_layers=len(kinds) // 2 if m.decoder_layers else 0)
    dev = _device(True, None, t, False, None, None, None, None, False)
    tracker = dev.tracker
    tracker.reads = True  # each forward tensor's last read (``_last_reads``)
    amp = {"bf16-amp": torch.bfloat16, "fp16-amp": torch.float16}.get(t.precision)
    with dev.env, dev.emulation:
        with dev.build_ctx:
            model = hf_factory(small, t)()
            _on_device(model)  # (a legacy constructor's CPU tensors: XLNet's)
            freeze_vision_tower(model, small, t)  # (a VLM: Qwen2-VL's host grid hook, --freeze-vision-tower)
            model = apply_lora(apply_quantization(model, t), small, t)
            if ckpt:  # transformers' GradientCheckpointingLayer, non-reentrant (as TrainStep enables it)
                inner = unwrapped(model)
                (getattr(inner, "activation_checkpointing_enable", None) or inner.gradient_checkpointing_enable)()
            if vision_ckpt:
                _checkpoint_vision(unwrapped(model))
        with tracker:
            _load_to_device(tracker, model)
        tracker.name_modules(model)
        stacks = _stacks(model, m, len(kinds))  # peft's wrapper adds ``base_model.model.``
        params = [p for p in model.parameters() if p.requires_grad]
        hooks = tracker.watch_parameters(params)
        first_in: list[Any] = []  # the record of the first layer's hidden-state input (``_first_input``)
        hooks.append(model.get_submodule(f"{stacks[0][0]}.0").register_forward_pre_hook(
            _first_input(tracker, first_in), with_kwargs=True))
        vision_in: list[Any] = []  # a VLM's vision tower's tensor inputs (``_tower_inputs``)
        hooks += _tower_inputs(model, tracker, vision_in) if m.is_vlm else []
        try:  # (--mixer-kernels fused: the packages' mixer Functions, emulated as in a trace's step)
            with tracker, tracker.hooks(), emulated_mixers(model, t):
                model.train()
                tracker.begin_step(1)
                batch = model_batch(small, t, "cuda")  # ids and labels; an image model's pixel values
                ctx = torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext()
                with ctx:
                    out = model(**batch)  # the model's own loss, inside its forward
                    loss = out.loss
                # the KV cache the output references (transformers builds one whenever use_cache is set)
                cache = [tracker.live[i] for i in _storages(_output_cache(out)) if i in tracker.live]
                before = len(tracker.ev_rec)
                del out
                released = (before, len(tracker.ev_rec))
                loss.backward()
                before = len(tracker.ev_rec)
                del loss  # the graph goes: what its nodes kept outside save_for_backward is freed now
                graph_freed = (before, len(tracker.ev_rec))
                tracker.end_step()
                tracker.mark_gradients(params)
                views = _grad_view_bytes(tracker, params)
        finally:
            tracker.finish()
            for h in hooks:
                h.remove()
    return dict(_analyse(tracker, stacks, kinds, cache, (released, graph_freed), m.vocab_size if is_lm(m) else -1,
                         early_frees=m.is_encoder_decoder or m.is_image or m.head in ENCODER_HEADS,
                         shared_frees=t.batch_size if (m.is_encoder_decoder and ckpt) else 0, first_in=first_in,
                         top=top_forward_measured(m), vision=vision_in if m.is_vlm else None),
                grad_views=views, per_layer_inputs=_per_layer_inputs(tracker, stacks, len(kinds), m.config))


def _per_layer_inputs(tracker: Any, stacks: list[tuple[str, int]], k: int, config: Any) -> int:
    """Bytes of the embedding side's per-layer inputs alive at the forward's end (counted in its ``embed``):
    Gemma 3n's (and Gemma 4's) ``hidden_size_per_layer_input`` wide input of every layer, made once before the
    first layer (transformers 5.24 ``models/gemma3n/modeling_gemma3n.py`` ``Gemma3nTextModel.get_per_layer_inputs``:
    ``embed_tokens_per_layer(input_ids).reshape(*input_ids.shape, num_hidden_layers, hidden_size_per_layer_input)``,
    and ``project_per_layer_inputs``: the projection of the embeddings to that shape, its norm, the sum and the
    scaling). Their size is the layer count's: the cut model's ``k`` layers' here, the full model's in the
    estimate (``estimate.derived.outer``). The tensors of shape (..., k, width) or (..., k * width)."""
    width = (config or {}).get("hidden_size_per_layer_input") if isinstance(config, dict) else None
    if not isinstance(width, int) or width <= 0:
        return 0
    recs = tracker.records
    end = next(pm for pm in tracker.phase_marks if pm.name == "forward").end_event
    _, layer_of, _, _ = _layer_index(stacks)
    first = min((r.alloc_event for r in recs if r.phase == "forward" and layer_of(r) is not None), default=0)
    def kept(r: Any) -> bool:  # an embedding-side tensor alive at the forward's end (``_analyse``'s ``embed``)
        return r.phase == "forward" and r.category in ("activations", "temporaries") and r.alloc_event < first \
            and r.label != "autocast_weight_cache" and (r.free_event is None or r.free_event > end - 1)
    return sum(r.nbytes for r in recs if kept(r) and (tuple(r.shape or ())[-2:] == (k, width)
                                                      or tuple(r.shape or ())[-1:] == (k * width,)))


def _checkpoint_vision(model: Any) -> None:
    """A VLM's vision tower traced as ``--recompute full`` runs it: transformers' ``gradient_checkpointing_enable``
    (``workload.TrainStep``, non-reentrant) checkpoints every ``GradientCheckpointingLayer`` of the model, the
    tower's blocks among them; the language model's layers are left unchecked here (the engine models their
    recompute from the layers' coefficients, ``quantities.layer_moments._recompute``)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    for name, mod in model.named_modules():
        if hasattr(mod, "gradient_checkpointing") and not VISION_SIDE.search(name):
            mod.gradient_checkpointing = False


def _grad_view_bytes(tracker: Any, params: list[Any]) -> int:
    """Bytes of the gradients' storages beyond the gradients themselves, after backward.

    ``AccumulateGrad`` steals an incoming gradient that nothing else references and whose strides
    match the parameter's in its dimensions larger than 1 (torch 2.13
    ``torch/csrc/autograd/functions/accumulate_grad.h`` L188-201, ``utils/grad_layout_contract.h``
    L29-50: size-1 dimensions are not compared), even when it is a view of a larger tensor: the
    ``.grad`` then keeps that tensor's whole storage alive until ``zero_grad(set_to_none=True)``.
    ViT's class token at micro-batch 1: ``cls_token.expand(1, -1, -1)`` then ``torch.cat`` along the
    sequence (transformers 5.23 ``modeling_vit.py`` ``ViTEmbeddings.forward``), whose backward hands
    the token a ``narrow`` of the (1, s, hidden) embedding gradient, and ``ExpandBackward``'s
    ``sum_to`` returns it unchanged when no dimension was expanded (``ExpandUtils.h`` ``sum_to``);
    from batch 2 the sum makes a fresh (1, 1, hidden) tensor. Each storage counted once."""
    own: dict[int, int] = defaultdict(int)
    size: dict[int, int] = {}
    for g in (p.grad for p in params if p.grad is not None):
        key = id(g.untyped_storage())  # the tracker's key of a storage
        if key in tracker.live:
            size[key] = tracker.live[key].nbytes
            own[key] += g.numel() * g.element_size()
    return sum(max(0, size[k] - own[k]) for k in size)


def _output_cache(out: Any) -> Any:
    """The KV cache a model output carries: the field is ``cache`` from transformers 5.24
    (5.24.0 ``modeling_outputs.py`` L153, ``BaseModelOutputWithPast.cache``), ``past_key_values``
    before (5.23.0 L153); None without one."""
    found = getattr(out, "cache", None)
    return found if found is not None else getattr(out, "past_key_values", None)


def _first_input(tracker: Any, out: list[Any]) -> Any:
    """A forward pre-hook for the first layer that appends the tracker's record of its hidden-state
    input (the first positional tensor, else the ``hidden_states`` keyword) to ``out``: the tensor a
    checkpointed first layer keeps (``torch/utils/checkpoint.py``, the non-reentrant frame saves the
    layer's tensor inputs), which the embedding side may already hold (``_analyse``'s ``first_input``)."""
    def hook(_module: Any, args: tuple, kwargs: dict) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
        rec = tracker.live.get(id(x.untyped_storage())) if isinstance(x, torch.Tensor) else None
        if rec is not None and not out:
            out.append(rec)
    return hook


def _stacks(model: Any, m: ModelSpec, layers: int) -> list[tuple[str, int]]:
    """The cut model's layer lists (name, layers): an encoder-decoder's two, else one."""
    if m.is_encoder_decoder:
        return layer_stacks(model, {"num_layers": layers, "decoder_layers": layers // 2})
    return [(layers_list(model, layers), layers)]


def _storages(obj: Any, depth: int = 0, seen: set | None = None) -> set[int]:
    """ids of the storages of the tensors reachable from ``obj`` (a cache object, its lists)."""
    seen = set() if seen is None else seen
    out: set[int] = set()
    if obj is None or depth > 5 or id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.add(id(obj.untyped_storage()))
        return out
    items: Any = obj if isinstance(obj, (list, tuple)) else (obj.values() if isinstance(obj, dict) else
                                                             getattr(obj, "__dict__", {}).values())
    for v in items:
        out |= _storages(v, depth + 1, seen)
    return out


@contextlib.contextmanager
def _quiet() -> Any:
    """transformers' and Python's warnings off while the derivation's traces run (its notices about
    the reference kernels or deprecated names are about the traced program, not the user's)."""
    import warnings
    import transformers
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)


def _analyse(tracker: Any, stacks: list[tuple[str, int]], kinds: list[str], cache: list,
             windows: tuple[tuple[int, int], ...], vocab: int, early_frees: bool = False, shared_frees: int = 0, first_in: list | None = None,
             top: bool = False, vision: list | None = None) -> dict[str, Any]:
    recs = tracker.records
    measure_top = top  # (``top`` names the top layer's index below)
    first_ids = {r.rid for r in first_in or ()}  # the first layer's hidden-state input (``_first_input``)
    end = next(pm for pm in tracker.phase_marks if pm.name == "forward").end_event
    pat, layer_of, starts, ends = _layer_index(stacks)
    logits = [r for r in recs if r.category == "logits"]
    logits_ev, events = logits[0].alloc_event if logits else end, defaultdict(list)
    for r, i in ((r, layer_of(r)) for r in recs if r.phase == "forward"):
        events[i].append(r.alloc_event) if i is not None else None
    layer_events = [e for v in events.values() for e in v]
    first_layer_ev, last_layer_ev = min(layer_events, default=0), max(layer_events, default=0)
    # an encoder-decoder's tensors made between its stacks (the encoder's final norm, the decoder's
    # embeddings and masks) are the embedding side's, like those made before the first layer
    gaps = [(max(events[e], default=0), min(events[s_], default=0)) for e, s_ in zip(ends, starts[1:])]

    def alive_at(r: Any, e: int) -> bool:
        return r.alloc_event <= e and (r.free_event is None or r.free_event > e)

    # (the layers' records alive at the end; the head side's; a layer's half copies of weight views, weights'
    # bytes kept apart from the activations as autocast's cached copies are: ``derived.view_casts``)
    saved_rec, head_rec, view_rec = defaultdict(list), [], defaultdict(list)
    embed = head = first_input = head_wcast = 0
    head_loss = _head_loss(tracker, recs, end, (last_layer_ev, logits_ev))
    seen = _vision_saved(recs, end, {r.rid for r in vision}) if vision is not None else set()
    for r in recs:
        if r.rid in seen or r.phase != "forward" or r.category not in ("activations", "temporaries") or \
                r.label == "autocast_weight_cache" or not alive_at(r, end - 1):
            continue
        i = layer_of(r)
        if i is not None:
            (view_rec if r.label == "autocast_weight_view" else saved_rec)[i].append(r)
        elif r.alloc_event < first_layer_ev or any(a < r.alloc_event < b for a, b in gaps):
            embed += r.nbytes
            # of it, the first layer's input, which something saved (its norm, in the input's dtype)
            first_input += r.nbytes if r.rid in first_ids else 0
        elif last_layer_ev < r.alloc_event < logits_ev:
            head += r.nbytes
            head_rec.append(r)
            head_wcast += r.nbytes if (r.op == "_to_copy" and len(r.shape or ()) == 2) else 0
    # a kind's bytes come from a layer inside its stack when the cut model has one. The top layer's
    # output may be kept by what follows it (a post-norm model's final norm saves it, OLMo 2): that
    # excess is the head's; an image model's top layer may keep less (nothing after it saves its
    # output: CLIP's classifier slices and means it), a difference of the layers' (``first``), as
    # the first layer's: with LoRA its frozen input saves nothing in a frozen branch (GPT-NeoX's
    # parallel MLP), and an encoder-decoder's at the ends of its stacks (once per model).
    top, image = len(kinds) - 1, vocab == -1 and early_frees
    typical, saved, parts = _typical_layers(kinds, starts, ends, saved_rec, pat)
    sequence = {kind: _sequences(tracker, layer_of, i, saved_rec, (end, logits_ev, vocab)) for kind, i in typical.items()}

    def excess(i: int) -> int:
        return sum(r.nbytes for r in saved_rec[i]) - saved[kinds[i]] if typical[kinds[i]] != i else 0
    wcast = _weight_casts(saved_rec, kinds, typical, sorted(set(starts + ends) - {top}) if top > 0 else [],
                          head_wcast)
    top_less = min(excess(top), 0) if image else 0
    head += excess(top) - top_less
    first = sum(excess(i) for i in sorted(set(starts + ends) - {top})) + top_less if top > 0 else 0
    # an encoder-decoder's bottom and decoder-bottom layers measured as such (a kind's: its last layer)
    at = {"bottom": 0, "decoder_bottom": starts[1]} if len(starts) > 1 else {f"typical.{k}": typical[k] for k in typical}
    trans, made, total_g, early = _transients(tracker, recs, layer_of, kinds, saved_rec, vocab, early_frees,
                                              shared_frees, at, cast_frees=image)
    base = _moment_bases(recs, layer_of, at, saved_rec, shared_frees, (end, logits_ev), vocab)
    outputs = _layer_outputs(recs, layer_of, saved_rec, kinds, typical, top, image and top_less != 0,
                             sorted(set(starts + ends) - {top}))
    kv, held = _kv_and_held(recs, cache, layer_of, typical, windows[0])
    graph = _graph_sides(saved_rec, kinds, typical, head_rec, windows[1])
    # the logits' element size: BART adds its fp32 ``final_logits_bias`` buffer to the half head
    # output under autocast, so its logits (and its loss) are fp32 (estimate.quantities.loss.loss_bytes)
    logits_bytes = logits[0].nbytes // max(1, _numel(logits[0].shape)) if logits else 0
    return {"saved": saved, "logits_bytes": logits_bytes,
            "view_casts": {kind: sum(r.nbytes for r in view_rec[i]) for kind, i in typical.items()}, "loss_upcast": _loss_upcasts(recs, logits),
            "vision": sum(r.nbytes for r in recs if r.rid in seen),
            "wcast": wcast, "parts": parts, "early": early, "base": base,
            "cache": kv, "held": held, "graph": graph,
            "embed": embed, "head": head, "head_loss": head_loss - head, "first": first, "transient": trans,
            "made": made, "total_g": total_g, "first_input": first_input, "sequence": sequence, **outputs,
            "head_forward": _head_forward(tracker, recs, (last_layer_ev, logits_ev), head) if image else 0,
            **(_forward_peaks(tracker, recs, kinds, events, (logits_ev, end), layer_of) if measure_top else {})}


def _forward_peaks(tracker: Any, recs: list, kinds: list[str], events: dict[int, list[int]], ends: tuple[int, int],
                   layer_of: Any) -> dict[str, Any]:
    """The top layer's forward moments (``_top_forward``) and each kind's forward peak (``_kind_forward``);
    ``ends``: the logits' first event, the forward's end."""
    logits_ev, end = ends
    return _top_forward(tracker, recs, (min(events[len(kinds) - 1], default=0), logits_ev, end), layer_of,
                        len(kinds) - 3) | {"kind_forward": _kind_forward(tracker, recs, kinds, events, end)}


def _tower_inputs(model: Any, tracker: Any, out: list[Any]) -> list[Any]:
    """Forward pre-hooks on a VLM's vision tower (the outermost ``VISION_SIDE`` modules but the projector)
    that append the tracker's records of its tensor inputs to ``out``: Qwen2-VL's patches cast to the tower's
    dtype by its model (transformers 5.24 ``modeling_qwen2_5_vl.py`` ``get_image_features``:
    ``pixel_values.type(self.visual.dtype)``), which its patch embedding saves, are made outside the tower
    and sized by the images. (LLaVA's and Gemma 3's towers take the fp32 pixels, an input, and cast them
    inside.)"""
    def hook(_module: Any, args: tuple, kwargs: dict) -> None:
        for x in list(args) + list(kwargs.values()):
            rec = tracker.live.get(id(x.untyped_storage())) if isinstance(x, torch.Tensor) else None
            if rec is not None:
                out.append(rec)
    names = [n for n, _mod in model.named_modules() if re.search(r"(^|\.)(visual|vision_tower)$", n)]
    return [model.get_submodule(n).register_forward_pre_hook(hook, with_kwargs=True) for n in names]


def _vision_saved(recs: list, end: int, tower_in: set[int]) -> set[int]:
    """The records of a vision-language model's vision side alive at the end of the forward (``end``): the
    tensors its vision tower and projector made (``spec.vision.VISION_SIDE``) and saved for backward, autocast's
    cached half weight copies among them (a trained tower's leaves: ``autocast_mode.cpp`` ``cached_cast``;
    a frozen tower's are cast per call and freed: the engine leaves the vision tower out of its own count,
    ``states``). Left out of the embedding side, whose per-token fit they would break: they are sized by
    the images (``_vision_fit``). A frozen tower's pixels need no gradient, so it saves nothing: what is
    left is the trained projector's input. ``tower_in``: the tower's inputs made outside it (``_tower_inputs``)."""
    return {r.rid for r in recs if r.phase == "forward" and (VISION_SIDE.search(r.module or "") or r.rid in tower_in)
            and (r.category in ("activations", "temporaries") or r.label == "autocast_weight_cache")
            and r.alloc_event <= end - 1 and (r.free_event is None or r.free_event > end - 1)}


def _weight_casts(saved_rec: dict[int, list], kinds: list[str], typical: dict[str, int], ends: list[int],
                  head_wcast: int) -> dict[str, int]:
    """The 2-D weight copies a layer's matmuls save (autocast's uncached casts of frozen LoRA bases), per
    kind at its typical layer, the end layers' (``ends``) excess over their kinds' as ``first``, and the
    head's (a frozen LoRA head's uncached copy: the engine's ``cast_head``): the engine counts every
    layer's copies (``quantities.head_moments._autocast_copies``), so an encoder head's constant (``ENCODER_TERMS``)
    leaves them out."""
    def wcasts(i: int) -> int:
        return sum(r.nbytes for r in saved_rec[i] if r.op == "_to_copy" and len(r.shape or ()) == 2)
    out = {kind: wcasts(i) for kind, i in typical.items()}
    out["first"] = sum(wcasts(i) - out[kinds[i]] for i in ends)
    out["head"] = head_wcast
    # the first layer's copies no matmul saved (LoRA: its frozen linears on the grad-free input, the copies
    # the engine counts in every layer: ``Quantities.cast_first_free``), against another layer of its kind
    same = [i for i in range(1, len(kinds)) if kinds[i] == kinds[0]]
    out["first_free"] = max(wcasts(same[0]) - wcasts(0), 0) if same else 0
    return out


def _kv_and_held(recs: list, cache: list, layer_of: Any, typical: dict[str, int],
                 released: tuple[int, int]) -> tuple[dict[str, int], dict[str, int]]:
    """Per kind, at its typical layer: the KV cache, all of it, and what dies with the output (``held``:
    freed in ``released``, not saved)."""
    kv = {kind: sum(r.nbytes for r in cache if layer_of(r) == i) for kind, i in typical.items()}
    held = {kind: sum(r.nbytes for r in recs if layer_of(r) == i and r.free_event is not None
                      and released[0] <= r.free_event < released[1]) for kind, i in typical.items()}
    return kv, held


def _graph_held(saved: list, graph_freed: tuple[int, int]) -> int:
    """Bytes of a layer's forward tensors that outlive its backward and die with the graph, when
    the loop drops the loss (``graph_freed``: the events of ``del loss``): what autograd nodes keep
    outside ``save_for_backward``, which backward does not release. bitsandbytes < 0.43.2's
    ``MatMul4Bit`` keeps its input ``A`` so (``ctx.tensors = (A, B)``, ``autograd/_functions.py``
    L522-523 at 0.42.0; emulated by ``trainmem.bnb``); the engine counts these bytes for every layer
    whose backward has run (``LayerCoefs.graph_held``, ``moments``' ``graph_layer``)."""
    return sum(r.nbytes for r in saved if r.free_event is not None and graph_freed[0] <= r.free_event < graph_freed[1])


def _graph_sides(saved_rec: dict[int, list], kinds: list[str], typical: dict[str, int], head_rec: list,
                 graph_freed: tuple[int, int]) -> dict[str, int]:
    """What the graph keeps after backward (``_graph_held``): per kind at its typical layer; ``first``,
    the first layer's excess over its kind's (LoRA: its frozen input needs no gradient, so the 4-bit
    linears on it keep nothing; GPT-NeoX's parallel MLP keeps none of its inputs there); ``head``, the
    head side's (a 4-bit ``lm_head``'s input, the final norm's output: Fabric quantizes the head too)."""
    graph = {kind: _graph_held(saved_rec[i], graph_freed) for kind, i in typical.items()}
    graph["first"] = _graph_held(saved_rec[0], graph_freed) - graph[kinds[0]] if typical[kinds[0]] != 0 else 0
    graph["head"] = _graph_held(head_rec, graph_freed)
    return graph


def _head_loss(tracker: Any, recs: list, end: int, window: tuple[int, int]) -> int:
    """The head's tensors alive while the loss runs inside the forward (the final norm's output,
    referenced by the forward's locals), those that outlive the forward included, at the loss's
    highest point (a tensor the head replaces, e.g. Granite's logits before ``logits /
    logits_scaling``, is gone by then). ``window``: the last layer's last event, the logits' first."""
    last_layer_ev, logits_ev = window
    cur, best, loss_peak = 0, -1, logits_ev
    for e, code in enumerate(tracker.ev_rec[:end]):
        cur += recs[code].nbytes if code >= 0 else -recs[~code].nbytes
        if e > logits_ev and cur > best:
            best, loss_peak = cur, e
    return sum(r.nbytes for r in recs if r.phase == "forward" and last_layer_ev < r.alloc_event < logits_ev
               and r.category in ("activations", "temporaries") and r.label != "autocast_weight_cache"
               and r.alloc_event <= loss_peak and (r.free_event is None or r.free_event > loss_peak))


def _layer_outputs(recs: list, layer_of: Any, saved_rec: dict[int, list], kinds: list[str], typical: dict[str, int],
                   top: int, top_in_first: bool, ends: list[int]) -> dict[str, int]:
    """What each layer kept at the end of the forward and lost before its own backward began: its
    output, which only what follows the layer saved (the next layer's norm, the final norm) and
    which a recomputed layer does not make again (``torch/utils/checkpoint.py``: the non-reentrant
    recomputation stops once the tensors the layer's backward unpacks exist). ``top_kept``: the top
    layer's (kept by the final norm, or nothing when the head does not save it: CLIP's);
    ``first_early``: the end layers' difference from their kind's typical layer, counted as the
    first layer's excess is (``_analyse``'s ``first``: the top layer's only when its own saved bytes'
    difference is, ``top_in_first``)."""
    def early(i: int) -> int:
        w0 = min((r.alloc_event for r in recs if r.phase == "backward" and layer_of(r) == i), default=None)
        return 0 if w0 is None else sum(r.nbytes for r in saved_rec[i] if r.free_event is not None
                                         and r.free_event < w0)

    def excess(i: int) -> int:
        return early(i) - early(typical[kinds[i]]) if typical[kinds[i]] != i else 0
    first = sum(excess(i) for i in ends) + (excess(top) if top_in_first else 0) if top > 0 else 0
    return {"top_kept": early(top), "first_early": first}


def _head_forward(tracker: Any, recs: list, window: tuple[int, int], head: int) -> int:
    """An image model's head forward: the most bytes its tensors made after the last layer hold at
    once before the logits (SigLIP's vision tower runs its attention-pooling head, whose keys and
    values are (b, s, h) projections of the whole sequence, though its classifier mean-pools and
    never reads the head's output), less the head side's tensors that outlive the forward (``head``,
    which the engine counts with the activations)."""
    start, stop = window
    cur = best = 0
    for e in range(start + 1, stop):
        code = tracker.ev_rec[e]
        r = recs[code] if code >= 0 else recs[~code]
        if r.phase != "forward" or r.category not in ("activations", "temporaries") or r.alloc_event <= start \
                or r.label == "autocast_weight_cache":
            continue
        cur += r.nbytes if code >= 0 else -r.nbytes
        best = max(best, cur)
    return max(best - head, 0)


def _loss_upcasts(recs: list, logits: list) -> bool:
    """Whether the model's own loss casts its half logits to fp32 before the log-softmax: its
    ``_log_softmax`` output has more bytes than the logits. transformers' ``loss_utils.ForMaskedLMLoss``
    does (``logits = logits.float()``: ModernBERT's ``self.loss_function``); the masked-LM heads that
    call ``CrossEntropyLoss()`` on the logits as they are (BERT's, DistilBERT's, DeBERTa-v2's) do not
    (``estimate.quantities.model_facts.loss_upcasts``)."""
    if not logits:
        return False
    lsm = next((r for r in recs if r.phase == "forward" and r.op == "_log_softmax"
                and r.alloc_event > logits[0].alloc_event), None)
    return lsm is not None and lsm.nbytes > logits[0].nbytes


def _top_forward(tracker: Any, recs: list, window: tuple[int, int, int], layer_of: Any, below: int
                 ) -> dict[str, Any]:
    """An encoder head's forward from its top layer's first tensor to the logits (a classifier's or
    question-answering head has no vocabulary-sized loss after it: this is its forward's peak): the
    most bytes of forward tensors alive at once (activations and temporaries, autocast's weight
    copies apart: the engine counts those) less those alive at the forward's end made before the
    logits (every layer's saved tensors, the embedding and head sides: what the engine counts at
    that moment). What it holds beyond them are tensors only Python frames reference: the top
    layer's input and the base model's ``embedding_output`` while the layer runs, a linear's output
    next to its dropout's and its residual sum next to its LayerNorm's output (transformers 5.24
    ``models/distilbert/modeling_distilbert.py`` ``TransformerBlock.forward``,
    ``models/deberta_v2/modeling_deberta_v2.py`` ``DebertaV2Output.forward``: the forms
    ``bert_top_forward`` counts by hand for BERT). ``window``: the top layer's first event, the
    logits' (the forward's end when no output is marked as logits: question answering's two), the
    forward's end. Each moment of the window (``top_forward``: which is the highest depends on the
    batch and sequence, ``_top_candidates``), and ``top_held``: what layer ``below`` (two below the
    top: the layer just below it makes the top layer's input, which every model holds then) made that
    is alive when the top layer begins and freed before the forward ends, which the full model holds
    for each of its layers below the top (DeBERTa-v2's encoder keeps every layer's fp32 LayerNorm
    output in ``all_hidden_states`` until it returns, 5.24 ``DebertaV2Encoder.forward``; under autocast
    the next layer's linears save half casts; DistilBERT's holds none). None below 3 layers."""
    start, stop, end = window

    def counted(r: Any) -> bool:
        return r.phase == "forward" and r.category in ("activations", "temporaries") \
            and r.label != "autocast_weight_cache"
    cur, series = 0, []
    for e in range(stop):
        code = tracker.ev_rec[e]
        r = recs[code] if code >= 0 else recs[~code]
        if counted(r):
            cur += r.nbytes if code >= 0 else -r.nbytes
        if e >= start:
            series.append(cur)
    kept = sum(r.nbytes for r in recs if counted(r) and r.alloc_event < stop
               and (r.free_event is None or r.free_event >= end))
    held = sum(r.nbytes for r in recs if counted(r) and below >= 0 and layer_of(r) == below
               and r.alloc_event < start and r.free_event is not None and start <= r.free_event < end)
    return {"top_forward": [x - kept for x in series], "top_held": held}


def _kind_forward(tracker: Any, recs: list, kinds: list[str], events: dict[int, list[int]], end: int
                  ) -> dict[str, int]:
    """Per kind, its last layer's forward peak over what the engine counts as made before that layer:
    the most bytes of forward tensors alive at once in the layer's forward (activations and
    temporaries, autocast's weight copies apart, as ``_top_forward``) less those made before the
    layer began that are alive at the forward's end (the layers below's saved tensors and the
    embedding side). What it holds beyond them is the layer's own saved tensors made by then and its
    temporaries: a Mamba-2 mixer's torch scan makes (b, c, l, s, h) fp32 ``G``, ``L`` and ``M`` and
    (b, c, l, h, p) ``Y_diag`` at once (transformers 5.24 ``models/nemotron_h/modeling_nemotron_h.py``
    ``mamba2_chunk_scan`` L274-378), above any later layer's forward peak when a
    hybrid's top layer is an attention or MLP layer (Nemotron-H). ``estimate.derived.top_forward``
    places it at the kind's highest layer in the full model (coefficients at a point only)."""
    counted = [r.phase == "forward" and r.category in ("activations", "temporaries")
               and r.label != "autocast_weight_cache" for r in recs]
    last = {kind: i for i, kind in enumerate(kinds) if events.get(i)}
    windows = {kind: (min(events[i]), max(events[i])) for kind, i in last.items()}
    stop = max((w[1] for w in windows.values()), default=-1)
    peak = dict.fromkeys(windows, 0)
    cur = 0
    for e in range(stop + 1):
        code = tracker.ev_rec[e]
        j = code if code >= 0 else ~code
        if counted[j]:
            cur += recs[j].nbytes if code >= 0 else -recs[j].nbytes
        for kind, (a, b) in windows.items():
            if a <= e <= b and cur > peak[kind]:
                peak[kind] = cur
    out = {}
    for kind, (a, _) in windows.items():
        before = sum(r.nbytes for r, c in zip(recs, counted) if c and r.alloc_event < a
                     and (r.free_event is None or r.free_event >= end))
        out[kind] = peak[kind] - before
    return out


def _fit_moments(m: ModelSpec, a: Any, y: Any, scaled: bool, what: str, label: str) -> tuple[Any, Any]:
    """Each moment's series ``y`` (runs x moments) fitted on the basis rows ``a`` of all runs but the last
    (``_lstsq``), checked on the last: (coefficients, terms x moments; which moments the held-out run
    confirms). ``NotPolynomial`` when none does, or the confirmed ones miss the held-out run's highest."""
    import numpy as np
    coef = _lstsq(a[:-1], y[:-1], scaled)            # terms x moments
    pred = a[-1] @ coef
    ok = np.abs(pred - y[-1]) <= DERIVE_TOLERANCE * np.abs(y[-1]) + DERIVE_SLACK
    if not ok.any() or abs(pred[ok].max() - y[-1].max()) > DERIVE_TOLERANCE * abs(y[-1].max()) + DERIVE_SLACK:
        raise NotPolynomial(f"{m.name}: the derived {what} is not polynomial in the batch and sequence; "
                            f"trainmem will not extrapolate it: use trace", label)
    return coef, ok


def _decoder_top(m: ModelSpec, runs: list[dict[str, Any]], how: tuple, cut_layers: int, out: dict[str, Any]) -> None:
    """A decoder's top-layer forward moments as an encoder head's (``_encoder_head_top``); a decoder whose top
    layer runs different operations at different sizes keeps none (its forward peak taken at the loss, as
    before these were measured)."""
    try:
        _encoder_head_top(m, runs, how, cut_layers, out)
    except NotPolynomial:
        for k in ("top_forward", "top_held", "cut_layers"):
            out.pop(k, None)


def _top_candidates(m: ModelSpec, pts: list[tuple[int, ...]], series: list[list[int]], terms: tuple[str, ...]
                    ) -> list[dict[str, float]]:
    """An encoder head's top-forward moments worth keeping (``_top_forward``): each moment fitted in
    ``terms`` over all points but the last and checked on it, like the backward transients
    (``_candidates``); of those, the ones that are the highest somewhere on a grid of batch and
    sequence (DeBERTa's attention moment at long sequences, its feed-forward's at short ones), at
    most ``TOP_MOMENTS``, those highest at the most grid points. Each as {term: coefficient}."""
    import numpy as np
    if len(pts) == 1:  # one traced point (``derive_coefficients``' ``point``): its highest moment per token
        return [dict.fromkeys(terms, 0.0) | {terms[0]: max(series[0]) / _basis(pts[0], terms)[0]}]
    if len({len(x) for x in series}) != 1:
        raise NotPolynomial(f"{m.name}: its top layer's forward runs different operations at different sizes; "
                            "trainmem cannot derive its forward peak (use trace)", "top forward")
    y = np.array(series, dtype=np.float64)           # runs x moments
    coef, ok = _fit_moments(m, np.array([_basis(p, terms) for p in pts]), y, False, "top-layer forward",
                            "top forward")
    grid = np.array([_basis((b, s), terms) for b in (1, 2, 4, 8, 16, 32, 64)
                     for s in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 32768)])
    vals = grid @ coef
    vals[:, ~ok] = -np.inf
    wins = np.bincount(vals.argmax(1), minlength=y.shape[1])
    keep = sorted(int(j) for j in np.argsort(-wins)[:TOP_MOMENTS] if wins[j] > 0)
    return [{k: float(coef[i, j]) for i, k in enumerate(terms)} for j in keep]


#: the most top-forward moments an encoder head keeps (``Quantities.head_fwd*``: fixed fields)
TOP_MOMENTS = 2


def _moment_bases(recs: list, layer_of: Any, at: dict[str, int], saved_rec: dict[int, list], shared: int,
                  ends: tuple[int, int], vocab: int = 0) -> dict[str, int]:
    """``_moment_base`` of each layer ``at`` names; ``ends``: the forward's last event, the logits' first."""
    end, logits_ev = ends
    fwd_saved = [r for r in recs if r.phase == "forward" and r.category in ("activations", "temporaries")
                 and r.label != "autocast_weight_cache" and r.alloc_event < logits_ev
                 and (r.free_event is None or r.free_event > end - 1)]
    out = {name: _moment_base(recs, layer_of, i, fwd_saved, saved_rec, shared) for name, i in at.items()}
    if "decoder_bottom" in at:
        out["decoder_embedding"] = _decoder_embedding_base(recs, fwd_saved)
        out["decoder_embedding_temp"] = _decoder_embedding_temp(recs, vocab)
    return out


def _decoder_backward_start(recs: list) -> int | None:
    """The first event of the decoder embedding's backward (None: it runs none)."""
    evs = [r.alloc_event for r in recs if r.phase == "backward" and (r.module or "").endswith("decoder.embed_tokens")]
    return min(evs) if evs else None


def _decoder_embedding_temp(recs: list, vocab: int) -> int:
    """The backward's temporaries alive when the decoder embedding's backward begins, but the tied
    head's part of the table's gradient (the engine's ``tied_grad``): the gradient of the encoder's
    output, which each decoder layer's cross-attention ``k_proj`` and ``v_proj`` add to (b, S, d_model)
    and which waits there for the encoder's backward (0 when the embedding runs no backward)."""
    w0 = _decoder_backward_start(recs)
    if w0 is None:
        return 0
    return sum(r.nbytes for r in recs if r.phase == "backward" and r.alloc_event < w0
               and (r.free_event is None or r.free_event > w0) and r.category not in ("gradients", "workspace")
               and not (len(r.shape) == 2 and r.shape[0] == vocab))


def _decoder_embedding_base(recs: list, fwd_saved: list) -> int:
    """The forward's saved bytes still alive when an encoder-decoder's decoder embedding runs its
    backward (0 when it runs none). Whisper's decoder has a token embedding of its own, tied to its
    ``proj_out`` (transformers 5.24 ``models/whisper/modeling_whisper.py`` ``WhisperDecoder``,
    ``WhisperForConditionalGeneration._tied_weights_keys``), whose backward (``EmbeddingBackward0``'s
    dense (vocab, d_model) gradient added to the head's part) runs once the decoder's first layer is
    done and before the encoder's layers, all of whose saved tensors are then alive (the engine's
    moment ``embeddings.decoder_backward``); T5's and BART's shared embedding's runs after the encoder's."""
    w0 = _decoder_backward_start(recs)
    if w0 is None:
        return 0
    return sum(r.nbytes for r in fwd_saved if r.free_event is None or r.free_event >= w0)


def _moment_base(recs: list, layer_of: Any, i: int, fwd_saved: list, saved_rec: dict[int, list], shared: int) -> int:
    """The bytes an encoder-decoder's layer ``i``'s backward transient (``_transients``) is measured
    over: everything the forward saved (outside the loss) that is still alive when the layer's
    backward begins, the layer's own saved tensors all counted (its transient takes off those freed),
    and, traced checkpointed (``shared``: the batch), the tensors shared by the batch that other
    layers kept and that were freed before then (its transient takes those off too). At the bottom
    layer these are its own tensors and the encoder's embedding side, not the other layers' nor the
    decoder's embedding side (freed by the decoder's backward): the engine counts these bytes at
    the bottom and decoder-bottom moments (``derived.moment_activations``) rather than an average
    layer's share."""
    w0 = min(r.alloc_event for r in recs if r.phase == "backward" and layer_of(r) == i)
    own = {r.rid for r in saved_rec[i]}
    out = sum(r.nbytes for r in fwd_saved if r.rid in own or r.free_event is None or r.free_event >= w0)
    if shared:
        out += sum(r.nbytes for j, rs in saved_rec.items() if j != i for r in rs
                   if len(r.shape) > 1 and int(r.shape[0]) != shared and r.free_event is not None and r.free_event < w0)
    return out


def _layer_index(stacks: list[tuple[str, int]]) -> tuple[Any, Any, list[int], list[int]]:
    """(the layers' module-name pattern, record -> model-wide layer number or None, each list's first
    layer, each list's last layer): an encoder-decoder's lists are numbered on from one to the next."""
    pat = re.compile("(" + "|".join(re.escape(p) for p, _ in stacks) + r")\.(\d+)(?:\.|$)")
    first_of, start = {}, 0
    for prefix, count in stacks:
        first_of[prefix], start = start, start + count
    starts = sorted(first_of.values())
    ends = [i + c - 1 for i, (_, c) in zip(starts, stacks)]

    def layer_of(r: Any) -> int | None:
        mm = pat.match(r.module or "")
        return first_of[mm.group(1)] + int(mm.group(2)) if mm else None
    return pat, layer_of, starts, ends


def _typical_layers(kinds: list[str], starts: list[int], ends: list[int], saved_rec: dict[int, list],
                    pat: Any) -> tuple[dict[str, int], dict[str, int], dict[str, dict[str, int]]]:
    """Per kind: the layer that stands for it (one inside its list when there is one, else its
    list's first, else its last), its saved bytes and their parts by module and op."""
    rank = {i: (1 if i in starts else 2 if i in ends else 0) for i in range(len(kinds))}
    typical: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        if kind not in typical or rank[i] < rank[typical[kind]]:
            typical[kind] = i
    saved: dict[str, int] = {}
    parts: dict[str, dict[str, int]] = {}
    for kind, i in typical.items():
        saved[kind] = sum(r.nbytes for r in saved_rec[i])
        by: dict[str, int] = defaultdict(int)
        for r in saved_rec[i]:
            rel = pat.sub("", r.module or "", count=1).lstrip(".")
            by[f"{rel or 'layer'}.{r.op}"] += r.nbytes
        parts[kind] = dict(by)
    return typical, saved, parts


def _sequences(tracker: Any, layer_of: Any, i: int, saved_rec: dict[int, list], at: tuple[int, int, int]) -> dict:
    """Layer ``i``'s forward (``_layer_sequence``) and, under ``backward``, its backward
    (``_layer_backward_sequence``); ``at``: the forward's end event, the logits' first, the vocabulary."""
    end, logits, vocab = at
    recs = tracker.records
    return dict(_layer_sequence(recs, layer_of, i, saved_rec[i], end, logits),
                backward=_layer_backward_sequence(tracker, recs, layer_of, i, saved_rec, vocab))


def _layer_sequence(recs: list, layer_of: Any, i: int, saved: list, end: int, logits: int) -> dict[str, list]:
    """Layer ``i``'s forward as the allocator sees it, for the estimate's replay of the step
    (``estimate.reserved``): the bytes of each tensor it saves, one by one in the order they are
    made (``parts`` sums them by module and op: a norm's fp32 upcast and its cast back are one part
    there); each 2-D weight copy autocast caches in it (``cuda.py``: the ``autocast_weight_cache``
    label) as (how many of those saved tensors were made before it, its elements); the bytes of each
    tensor it makes and frees within the forward (``temps``); and the order of it all (``events``:
    "s" the next saved tensor made, "c" the next weight copy, "t" the next temporary, "fK" the K-th
    temporary freed, "dK@J" the K-th freed by the next layer's forward once J of its tensors are made
    (all of them: at its end, as a layer's output in half, which the next layer's RMSNorm copies to
    fp32 and keeps as its residual), "dK@end" freed once the head has made the logits: by the loss,
    as the keys transformers 5.24's ``DynamicCache`` concatenates in fp32 under autocast), "uK" the
    K-th saved tensor's last read in the forward (``_last_reads``)."""
    saved_ids = {r.rid for r in saved}
    fwd = sorted((r for r in recs if r.phase == "forward" and layer_of(r) == i), key=lambda r: r.alloc_event)
    casts = [r for r in fwd if r.label == "autocast_weight_cache" and len(r.shape or ()) == 2]
    cast_ids = {r.rid for r in casts}
    temps = [r for r in fwd if r.rid not in saved_ids and r.rid not in cast_ids and r.label != "autocast_weight_cache"
             and r.category in ("activations", "temporaries") and r.free_event is not None and r.free_event < end]
    order = sorted(saved, key=lambda r: r.alloc_event)
    index = {r.rid: k for k, r in enumerate(temps)}
    ev = [(r.alloc_event, "s" if r.rid in saved_ids else "c") for r in order + casts]
    ev += [(r.alloc_event, "t") for r in temps]
    last = max((e for e, _x in ev), default=0)
    # the next layer's tensors as the replay makes them (its saved tensors, temporaries, weight copies)
    nxt = [r.alloc_event for r in recs if r.phase == "forward" and layer_of(r) == i + 1 and (
        (r.category in ("activations", "temporaries") and r.label != "autocast_weight_cache")
        or (r.label == "autocast_weight_cache" and len(r.shape or ()) == 2))]
    for r in temps:  # freed within the layer, by the next layer after J of its tensors ("dK@J"), or by the loss
        late = r.free_event > last and nxt
        j = sum(1 for a in nxt if a < r.free_event)
        ev.append((r.free_event, (f"d{index[r.rid]}@end" if r.free_event > logits else f"d{index[r.rid]}@{j}")
                   if late else f"f{index[r.rid]}"))
    ev += _last_reads(order)
    return {"tensors": [r.nbytes for r in order], "temps": [r.nbytes for r in temps],
            "events": [e for _n, e in sorted(ev, key=lambda x: x[0])],
            "casts": [[sum(1 for x in order if x.alloc_event < c.alloc_event), _numel(c.shape)] for c in casts]}


def _last_reads(order: list) -> list[tuple[float, str]]:
    """Each saved tensor's last read in the forward as an event "uK" (K: its index in ``order``, the
    saved tensors in the order they are made), placed after the reading op's outputs and before
    anything after it (``Record.last_read``: the event count once those outputs were logged; a
    half step keeps it apart from the events' own integer positions); one no forward op read
    (a kernel's extra output: flash attention's logsumexp) right after it is made. For the replay of
    a checkpointed layer's first forward (``estimate.reserved.layer_forward._sequence_forward``, ``keep=False``):
    non-reentrant checkpointing saves nothing there (torch 2.13 ``utils/checkpoint.py``
    ``_checkpoint_hook`` L1153-1163), so such a tensor dies once its last consumer has run:
    transformers 5.24 ``models/qwen3/modeling_qwen3.py`` ``Qwen3RMSNorm.forward`` L61-63's fp32 copy
    lives until ``hidden_states * torch.rsqrt(...)`` has made the product, ``Qwen3MLP.forward`` L82's
    ``act_fn(gate_proj(x))`` until ``* up_proj(x)`` has. A layer's local variable that Python holds
    past its last read (a return at the function's end) is freed at that read here."""
    return [((r.last_read if r.last_read > r.alloc_event else r.alloc_event + 1) - 0.5, f"u{k}")
            for k, r in enumerate(order)]


def _layer_backward_sequence(tracker: Any, recs: list, layer_of: Any, i: int, saved_rec: dict[int, list],
                             vocab: int) -> dict[str, list]:
    """Layer ``i``'s backward as the allocator sees it, for the estimate's replay (``estimate.reserved``
    ``_recorded_backward``), in the form of its forward's (``_layer_sequence``). Its window runs from the
    first allocation after the layer above's last backward allocation (from its own first, at the top)
    to the first allocation after its own last (``tracker.ev_rec``: every allocation and free of the
    step, in order). Events: "t" the next backward tensor made (a gradient of an activation, an op's
    formula temporary, autocast's half weight gradient, an ``InputBuffer`` sum: category not
    ``gradients`` nor ``workspace``, as ``_transients`` counts them), its bytes in ``temps``; "fK" the
    K-th of them freed; "g" the next parameter gradient made (``.grad``, its bytes in ``grads``: constant);
    "iK" the K-th (in allocation order) of the tensors the layer above's window left alive (``out`` of
    that window, the gradients flowing down: measured at layer ``i + 1``, ``ins``) freed; "sK" / "pK"
    the K-th saved tensor (``_layer_sequence``'s order) of this layer / of the layer below freed
    (``fn.release_variables()`` once the node that saved it has run: ``Engine::evaluate_function``,
    ``torch/csrc/autograd/engine.cpp``, torch 2.13; the layer below's output, saved here as this layer's
    input, is the layer below's); "wK" the K-th 2-D autocast weight copy of the layer's forward freed. ``out``: the indices of
    this window's tensors alive at its end, in allocation order (the next layer's ``iK``). Empty when
    the layer has no backward allocation (frozen and needing no input gradient)."""
    ev_rec = tracker.ev_rec

    def span(j: int) -> tuple[int, int] | None:
        evs = [r.alloc_event for r in recs if r.phase == "backward" and layer_of(r) == j]
        return (min(evs), max(evs)) if evs else None

    def next_alloc(e: int) -> int:  # the first allocation event after ``e`` (the end of the events: their count)
        return next((k for k in range(e + 1, len(ev_rec)) if ev_rec[k] >= 0), len(ev_rec))
    own, above, above2 = span(i), span(i + 1), span(i + 2)
    if own is None:
        return {}
    start, end = (next_alloc(above[1]) if above else own[0]), next_alloc(own[1])
    above_start = (next_alloc(above2[1]) if above2 else above[0]) if above else start

    def temp(r: Any) -> bool:  # (``_transients``' backward temporaries)
        return r.phase == "backward" and r.category not in ("gradients", "workspace") and not (
            len(r.shape) == 2 and r.shape[0] == vocab)

    def alive_out(r: Any, lo: int, hi: int) -> bool:  # made in [lo, hi) and alive at ``hi``
        return lo <= r.alloc_event < hi and (r.free_event is None or r.free_event >= hi) and temp(r)
    ins = sorted((r for r in recs if above and alive_out(r, above_start, start)),
                 key=lambda r: r.alloc_event)
    in_index = {r.rid: k for k, r in enumerate(ins)}
    saved_index = {r.rid: ("s", k) for k, r in enumerate(sorted(saved_rec[i], key=lambda r: r.alloc_event))}
    saved_index.update({r.rid: ("p", k) for k, r in enumerate(sorted(saved_rec.get(i - 1, ()),
                                                                      key=lambda r: r.alloc_event))})
    casts = sorted((r for r in recs if r.label == "autocast_weight_cache" and r.phase == "forward"
                    and layer_of(r) == i and len(r.shape or ()) == 2), key=lambda r: r.alloc_event)
    saved_index.update({r.rid: ("w", k) for k, r in enumerate(casts)})
    temps, grads, events, index = [], [], [], {}
    for e in range(start, end):
        code = ev_rec[e]
        r = recs[code] if code >= 0 else recs[~code]
        if code >= 0 and temp(r):
            index[r.rid] = len(temps)
            temps.append(r.nbytes)
            events.append("t")
        elif code >= 0 and r.category == "gradients":
            grads.append(r.nbytes)
            events.append("g")
        elif code < 0 and r.rid in index:
            events.append(f"f{index[r.rid]}")
        elif code < 0 and r.rid in in_index:
            events.append(f"i{in_index[r.rid]}")
        elif code < 0 and r.rid in saved_index:
            events.append("%s%d" % saved_index[r.rid])
    out = [index[r.rid] for r in sorted((r for r in recs if r.rid in index and alive_out(r, start, end)),
                                        key=lambda r: r.alloc_event)]
    return {"temps": temps, "grads": grads, "events": events, "out": out, "ins": [r.nbytes for r in ins]}


def _numel(shape: Any) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _transients(tracker: Any, recs: list, layer_of: Any, kinds: list[str], saved_rec: dict[int, list],
                vocab: int, early_frees: bool = False, shared_frees: int = 0, at: dict[str, int] | None = None,
                cast_frees: bool = False) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, int],
                                                   dict[str, int]]:
    """Per kind (its last layer in the cut model), the backward transient after each event of the
    layer's backward (see the module docstring), the layer's gradient bytes made by then, and the
    layer's gradient bytes in all. The op sequence does not depend on batch or sequence, so event
    ``j`` of the window is the same moment in every run. ``at``: more layers measured, by name
    (an encoder-decoder's bottom and decoder-bottom layers, ``@name`` in the results).
    ``cast_frees`` (image models): the layer's half weight copies that autocast cached in its
    forward count as freed when its backward frees them (the matmul that saved one is done with it:
    ``aten/src/ATen/autocast_mode.cpp`` ``cached_cast`` keeps a leaf's copy for the autocast region,
    and the matmul's saved reference is what outlives it); the engine counts every layer's copies
    at a layer's moment (``quantities.head_moments._autocast_copies``). Decoder LMs' shipped coefficients
    predate this; their linears' copies are taken off by the engine's gradient share."""
    trans: dict[str, list[int]] = {}
    early: dict[str, int] = {}  # the layer's tensors freed before its backward began (its output, kept by what follows)
    made_at: dict[str, list[int]] = {}
    total_g: dict[str, int] = {}
    for i, kind in enumerate(kinds):
        evs = [r.alloc_event for r in recs if r.phase == "backward" and layer_of(r) == i]
        if not evs:
            continue
        w0, w1 = min(evs), max(evs)
        saved_ids = {r.rid for r in saved_rec[i]}
        if cast_frees:
            saved_ids |= {r.rid for r in recs if r.label == "autocast_weight_cache" and r.phase == "forward"
                          and layer_of(r) == i}
        def temp(r: Any) -> bool:
            # a backward temporary (not a parameter gradient, not a workspace); a tied head's
            # weight gradient waiting for the embedding's is the engine's ``tied_grad``
            return r.phase == "backward" and r.category not in ("gradients", "workspace") and not (
                len(r.shape) == 2 and r.shape[0] == vocab)
        temps = sum(r.nbytes for r in recs if r.alloc_event < w0 and (r.free_event is None or r.free_event >= w0)
                    and temp(r))
        # the layer's tensors that outlived the forward but died before its backward began: the
        # top layer's output that only the final norm saved (ViT's ``layernorm``), freed by the
        # head's backward. Counted for encoder-decoder and image models (``early_frees``); decoder
        # LMs have them too, but their shipped coefficients predate this (docs/architectures.md)
        freed = sum(r.nbytes for r in saved_rec[i] if r.free_event is not None and r.free_event < w0) \
            if early_frees else 0
        if shared_frees:
            # an encoder-decoder traced checkpointed, whose layers keep only their checkpoint inputs:
            # the tensors shared by the batch (a first dimension other than the batch: T5's position
            # biases, (s, s, heads) embedding outputs or (1, heads, s, s), kept as inputs of the
            # checkpointed layers that read them) that other layers kept and that were freed before
            # this layer's backward began; the engine counts them at every moment
            # (``derived.outer_ssq``), so this layer's transient takes them off
            freed += sum(r.nbytes for j, rs in saved_rec.items() if j != i for r in rs
                         if len(r.shape) > 1 and int(r.shape[0]) != shared_frees and r.free_event is not None
                         and r.free_event < w0)
        made = 0
        series, mades = [], []
        for e in range(w0, w1 + 1):
            code = tracker.ev_rec[e]
            r = recs[code] if code >= 0 else recs[~code]
            if code >= 0:
                if temp(r):
                    temps += r.nbytes
                elif r.category == "gradients" and layer_of(r) == i:
                    made += r.nbytes
            else:
                if temp(r) and r.alloc_event < e:
                    temps -= r.nbytes
                elif r.rid in saved_ids:
                    freed += r.nbytes
            series.append(temps - freed)
            mades.append(made)
        for key in [kind] + [f"@{name}" for name, pos in (at or {}).items() if pos == i]:
            trans[key], made_at[key] = series, mades
            early[key] = sum(r.nbytes for r in saved_rec[i] if r.free_event is not None and r.free_event < w0)
            total_g[key] = sum(r.nbytes for r in recs if r.category == "gradients" and layer_of(r) == i)
    return trans, made_at, total_g, early


def _candidates(m: ModelSpec, pts: list[tuple[int, ...]], series: list[list[int]], made: list[list[int]],
                total_g: int, terms: tuple[str, ...] = ("n", "s", "nsq", "1"), with_grads: bool = False
                ) -> list[Any]:
    """The backward transients worth keeping: each moment of the window fitted as
    ``a*n + b*nsq + c`` over all runs but the last and checked on it; of those, the ones
    that are the largest somewhere on a grid of batch and sequence. Each as [a, b, c, gradient
    share]. ``with_grads`` (encoder-decoder and image models): the layer's gradients made by a
    moment count when choosing the largest (two moments with the same temporaries, before and after
    a weight gradient is made, differ by it). ``terms`` ``ENCDEC_TRANSIENT`` (an encoder-decoder):
    the moment is fitted in those terms of the two lengths (T5's position bias gradient is summed
    over the batch to (s, s, heads) in the first layer's backward, and a checkpointed layer's
    recomputation makes its stack's position bias again: the terms shared by the batch), the grid
    has decoder lengths of its own, and each is returned as ``{"coef": {term: ...}, "g": share}``."""
    import numpy as np
    if len(pts) == 1:
        return _point_candidates(pts[0], series[0], made[0], total_g)
    if len({len(x) for x in series}) != 1:
        raise NotPolynomial(f"{m.name}: its backward runs different operations at different sizes; trainmem "
                            "cannot derive its transients (use trace)", OPS_VARY)
    y = np.array(series, dtype=np.float64)           # runs x moments
    two = "nd" in terms
    basis = terms if two else ("n", "nsq", "1")
    coef, ok = _fit_moments(m, np.array([_basis(p, basis) for p in pts]), y, two, "backward transient",
                            "backward transient")
    lengths = (16, 128, 512, 4096, 32768) if m.is_image else (512, 4096, 32768)
    if m.is_speech_seq2seq:  # the encoder's one length; decoder lengths up to its positions
        grid = np.array([_basis((b, m.source_positions, d), basis) for b in (1, 4, 32)
                         for d in (8, 64, 128, 256, m.max_positions)])
    else:
        grid = np.array([_basis((b, s, d) if two else (b, s), basis) for b in (1, 4, 32) for s in lengths
                         for d in ((128,) + lengths if two else (0,))])
    vals = grid @ coef
    g = np.array(made, dtype=np.float64).max(0)
    if with_grads:  # a moment's own gradients made by then count in the choice (the engine adds them)
        vals = vals + g
    vals[:, ~ok] = -np.inf
    keep = sorted(set(int(j) for j in vals.argmax(1)))
    share = [float(g[j] / total_g) if total_g else 0.0 for j in range(len(g))]
    if two:
        return [{"coef": {k: float(coef[i, j]) for i, k in enumerate(basis)}, "g": share[j]} for j in keep]
    return [[float(coef[0, j]), float(coef[1, j]), float(coef[2, j]), share[j]] for j in keep]


def _point_candidates(point: tuple[int, ...], series: list[int], made: list[int], total_g: int) -> list[list[float]]:
    """The backward transients of one traced point (``derive_coefficients``' ``point``): the moments
    no other moment matches in both its temporaries and its gradients made by then (the engine adds
    a moment's gradient share of the layer's gradients, whose bytes depend on the setup: each moment
    that can be the highest is kept), each as [bytes per token b*s, 0, 0, gradient share]."""
    n = float(point[0] * point[1])
    order = sorted(range(len(series)), key=lambda j: (-series[j], -made[j]))
    keep, best_g = [], -1
    for j in order:  # by temporaries, highest first: kept when it has made more gradients than those before it
        if made[j] > best_g:
            keep.append(j)
            best_g = made[j]
    return [[series[j] / n, 0.0, 0.0, made[j] / total_g if total_g else 0.0] for j in sorted(keep)]


# ----- fitting --------------------------------------------------------------------------------------
def _basis(point: tuple[int, ...], terms: tuple[str, ...]) -> list[float]:
    """The terms at ``point``: (batch, sequence) or an encoder-decoder's (batch, encoder length,
    decoder length) (see ``ENCDEC_TERMS``)."""
    b, s, *rest = point
    d = rest[0] if rest else s
    v = {"n": b * s, "s": s, "nsq": b * s * s, "ssq": s * s, "1": 1, "b": b,
         "nd": b * d, "sd": d, "nsqd": b * d * d, "nsqx": b * d * s, "ssqd": d * d, "ssqx": d * s}
    return [float(v[k]) for k in terms]


def _lstsq(a: Any, y: Any, scaled: bool) -> Any:
    """Least squares of ``a @ x = y``; ``scaled``: with each column divided by its largest value
    first (the two-length terms span 1 to 10^11, beyond what unscaled least squares resolves)."""
    import numpy as np
    if not scaled:
        return np.linalg.lstsq(a, y, rcond=None)[0]
    norm = np.abs(a).max(0)
    norm[norm == 0] = 1.0
    x = np.linalg.lstsq(a / norm, y, rcond=None)[0]
    return x / (norm[:, None] if x.ndim == 2 else norm)


def _fitted(m: ModelSpec, what: str, points: list[tuple[int, ...]], ys: list[int], terms: tuple[str, ...],
            check_fit: bool = True) -> tuple[float, ...]:
    """Coefficients of ``terms`` (``n`` = b*s, ``s``, ``nsq`` = b*s^2, ``1``; an encoder-decoder's
    ``ENCDEC_TERMS``) fitted by least squares to all points but the last, which they must reproduce
    (``DERIVE_TOLERANCE``). One point (``derive_coefficients``' ``point``): the bytes there divided by
    the first term's value (``n``: the point's tokens) as that term, the others 0 (exact there only)."""
    import numpy as np
    if len(points) == 1:
        return tuple(float(ys[0]) / _basis(points[0], terms)[0] if i == 0 else 0.0 for i in range(len(terms)))
    a = np.array([_basis(p, terms) for p in points[:-1]])
    coef = _lstsq(a, np.array(ys[:-1], dtype=np.float64), "nd" in terms)
    if check_fit:
        predicted = float(np.dot(coef, _basis(points[-1], terms)))
        actual = ys[-1]
        if abs(predicted - actual) > DERIVE_TOLERANCE * abs(actual) + DERIVE_SLACK:
            at = ", ".join(f"{k}={v}" for k, v in zip(("b", "s", "target"), points[-1]))
            raise NotPolynomial(f"{m.name}: the derived {what} is not polynomial in the batch and sequence "
                                f"(predicted {predicted:,.0f} B, traced {actual:,} B at {at}); trainmem "
                                f"will not extrapolate it: use trace", what)
    return tuple(float(x) for x in coef)


__all__ = ["derive_coefficients", "NotPolynomial", "encdec_coefficients", "reduced_config", "DERIVE_TOLERANCE", "ENCDEC_TERMS",
           "FIXED_ENCODER_TERMS", "FIXED_ENCODER_TRANSIENT", "fixed_encoder_points",
           "BATCH1_TERMS", "batch1_points"]
