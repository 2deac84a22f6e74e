"""A vision-language model's images: how many LLM tokens an image becomes, and the batch its processor makes.

``--task image-text-to-text`` (``spec.tasks``) trains transformers' ``AutoModelForImageTextToText`` class of
a config: a vision tower, a projector and a causal language model whose input embeddings get the projected
image features scattered over the image placeholder tokens (``inputs_embeds.masked_scatter(image_mask,
image_features)``: transformers 5.24 ``models/qwen2_5_vl/modeling_qwen2_5_vl.py`` L1219-1225,
``models/llava/modeling_llava.py`` and ``models/gemma3/modeling_gemma3.py`` L859-864). ``--seq-len`` counts
every text token, the placeholders included; ``--images`` is the images per sample, ``--image-size`` their
square side in pixels. Per family (transformers 5.24):

* **Qwen2-VL, Qwen2.5-VL** (dynamic resolution): the processor cuts an ``S x S`` image into
  ``(S/14)^2`` patches of ``temporal_patch_size x 14 x 14`` pixels (a still image repeated over the 2
  frames) and hands them flattened, ``pixel_values`` [patches, 3*2*14*14] fp32 for all images of the batch,
  with ``image_grid_thw`` [images, 3] int64 = (1, S/14, S/14); the vision merger folds each 2x2 block
  (``spatial_merge_size``) into one LLM token: ``(S/28)^2`` tokens per image, ``S`` a multiple of 28
  (``image_processing_qwen2_vl.py`` ``smart_resize`` rounds to ``patch_size * merge_size``). No image
  size in the config: ``--image-size`` is required. The processor also returns ``mm_token_type_ids``
  (1 on image tokens: ``processing_qwen2_5_vl.py`` L33 ``return_mm_token_type_ids = True``), from which
  the model computes its 3-D rotary positions (``get_rope_index``).
* **LLaVA-1.5**: CLIP's ``[images, 3, S, S]`` fp32 at the config's ``vision_config.image_size`` (336), its
  ``(S/14)^2`` patch features (the class token dropped: ``vision_feature_select_strategy`` "default";
  kept, +1, under "full") are the image's tokens: 576.
* **Gemma 3**: SigLIP's ``[images, 3, 896, 896]``, its 64x64 patch features average-pooled to
  ``mm_tokens_per_image`` (256) tokens (``Gemma3MultiModalProjector``); the processor returns
  ``token_type_ids`` (1 on image tokens: ``processing_gemma3.py`` L70-71), with which the language model
  attends bidirectionally inside each image (``create_masks_for_vision_model``).

The labels are the input ids, image placeholders included, as TRL's ``DataCollatorForVisionLanguageModeling``
makes them (trl ``trainer/sft_trainer.py`` ``_collate_language_modeling``: ``labels = input_ids.clone()``,
``-100`` on padding only: "Vision tokens are left unchanged because their handling in loss computation has
to be done by the model"); the batches here have no padding.
"""
from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import TrainmemError

#: the model types whose image-text-to-text class trainmem traces
VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "llava", "gemma3")
#: LLaMA-Factory's vision-tower module names per type (``freeze_vision_tower``: LLaMA-Factory
#: ``src/llamafactory/model/model_utils/visual.py`` ``COMPOSITE_MODELS`` ``vision_model_keys``: Qwen2-VL's
#: ``visual.patch_embed`` and ``visual.blocks``, its merger staying trained as the projector; LLaVA's and
#: Gemma 3's ``vision_tower``), matched as dotted-name parts of the transformers 5.24 modules
#: (``model.visual.blocks``, ``model.vision_tower``)
VISION_TOWER = {"qwen2_vl": ("visual.patch_embed", "visual.blocks"), "qwen2_5_vl": ("visual.patch_embed", "visual.blocks"),
                "llava": ("vision_tower",), "gemma3": ("vision_tower",)}

#: a VLM's vision side, its vision tower and projector, by dotted module or parameter name (transformers 5.24:
#: Qwen2-VL's ``model.visual`` with its ``merger``, LLaVA's and Gemma 3's ``model.vision_tower`` and
#: ``model.multi_modal_projector``; under peft ``base_model.model.`` before them)
VISION_SIDE = re.compile(r"(^|\.)(visual|vision_tower|multi_modal_projector)(\.|$)")


def in_vision_tower(model_type: str, name: str) -> bool:
    """Whether parameter ``name`` is one ``--freeze-vision-tower`` freezes (``VISION_TOWER``, as
    ``vision_tower_parameters`` matches them on the built model)."""
    return any(f".{k}." in f".{name}" for k in VISION_TOWER.get(model_type, ()))


@dataclass(frozen=True)
class VisionInputs:
    """The image side of a VLM config: ``kind`` "patches" (Qwen2-VL's flattened patches) or "pixels"."""

    model_type: str
    kind: str
    patch: int              # the vision tower's patch side in pixels
    channels: int
    image_token_id: int
    default_size: int = 0   # the config's image side (0: none, --image-size is required)
    merge: int = 1          # Qwen2-VL: patches merged per side into one LLM token
    temporal: int = 1       # Qwen2-VL: frames per patch (a still image is repeated)
    fixed_tokens: int = 0   # LLM tokens per image when the size is fixed (LLaVA, Gemma 3)

    def size_problem(self, size: int | None) -> str | None:
        """Why ``size`` (``--image-size``; None: not given) cannot be taken (None: it can)."""
        if size is None:
            return None if self.default_size else (f"--image-size: a {self.model_type} model has no image size in its "
                                                    f"config (dynamic resolution): give --image-size, a multiple of "
                                                    f"{self.patch * self.merge}")
        if self.kind == "patches" and size % (self.patch * self.merge):
            return (f"--image-size {size} is not a multiple of {self.patch * self.merge} pixels ({self.patch}-pixel "
                    f"patches merged {self.merge}x{self.merge}, as {self.model_type}'s processor resizes)")
        if self.kind == "pixels" and size != self.default_size:
            return (f"--image-size {size}: {self.model_type}'s vision tower takes {self.default_size}-pixel images "
                    f"only (its processor resizes every image to it): drop --image-size")
        return None

    def side(self, size: int | None) -> int:
        return size or self.default_size

    def tokens(self, size: int | None) -> int:
        """LLM tokens of one ``size`` x ``size`` image (the placeholders its sample's ids carry)."""
        if self.kind == "pixels":
            return self.fixed_tokens
        return (self.side(size) // (self.patch * self.merge)) ** 2

    def patches(self, size: int | None) -> int:
        """Vision-tower patches of one image."""
        return (self.side(size) // self.patch) ** 2


def vision_inputs(config: Mapping[str, Any]) -> VisionInputs:
    """The image side of a VLM config dict (its ``vision_config`` and image token), as transformers 5.24's
    config classes default them."""
    mtype = str(config.get("model_type"))
    if mtype not in VLM_TYPES:
        raise TrainmemError(f"--task image-text-to-text: trainmem runs it for {', '.join(VLM_TYPES)}, not "
                            f"model_type {mtype!r}")
    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    return _vision_inputs(json.dumps(clean, sort_keys=True, default=str))


#: the image fields' defaults of transformers 5.24's config classes, for reading a config without transformers
#: (``_plain_vision_inputs``): ``models/qwen2_5_vl/configuration_qwen2_5_vl.py`` L58-61 and L186 (Qwen2-VL's the
#: same), ``models/llava/configuration_llava.py`` L59-60 (its default CLIP tower) and L72-75,
#: ``models/gemma3/configuration_gemma3.py`` L207-210
_DEFAULTS = {"qwen2_vl": {"image_token_id": 151655, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_channels": 3},
             "qwen2_5_vl": {"image_token_id": 151655, "patch_size": 14, "spatial_merge_size": 2,
                            "temporal_patch_size": 2, "in_channels": 3},
             "llava": {"image_token_index": 32000, "image_size": 336, "patch_size": 14,
                       "vision_feature_select_strategy": "default"},
             "gemma3": {"image_token_index": 262144, "mm_tokens_per_image": 256}}


def _plain_vision_inputs(d: dict[str, Any]) -> VisionInputs:
    """``_vision_inputs`` without transformers (an estimate from shipped coefficients needs neither it nor
    torch): the config's own fields, else its class's defaults (``_DEFAULTS``); a field neither has (Gemma 3's
    SigLIP image and patch sizes) is one line asking for transformers."""
    mtype = str(d["model_type"])
    v, dflt = dict(d.get("vision_config") or {}), dict(_DEFAULTS[mtype])
    if mtype == "llava" and v.get("model_type", "clip_vision_model") != "clip_vision_model":
        dflt.pop("image_size"), dflt.pop("patch_size")  # (the defaults are LLaVA's CLIP tower's, not another's)

    def get(key: str, src: dict[str, Any] = d) -> Any:
        alias = {"image_token_id": "image_token_index", "image_token_index": "image_token_id"}.get(key)
        for k in (key, alias):
            if k is not None and src.get(k) is not None:
                return src[k]
        if key not in dflt:
            raise TrainmemError(f"a {mtype} config without vision_config.{key}: reading its default needs "
                                f"transformers (pip install transformers)")
        return dflt[key]
    token = int(get("image_token_id"))
    if mtype in ("qwen2_vl", "qwen2_5_vl"):
        return VisionInputs(mtype, "patches", int(get("patch_size", v)), int(v.get("in_chans") or get("in_channels", v)),
                            token, merge=int(get("spatial_merge_size", v)), temporal=int(get("temporal_patch_size", v)))
    side, patch = int(get("image_size", v)), int(get("patch_size", v))
    tokens = ((side // patch) ** 2 + (1 if get("vision_feature_select_strategy") == "full" else 0)
              if mtype == "llava" else int(get("mm_tokens_per_image")))
    return VisionInputs(mtype, "pixels", patch, int(v.get("num_channels") or 3), token, default_size=side,
                        fixed_tokens=tokens)


@functools.lru_cache(maxsize=32)
def _vision_inputs(config_json: str) -> VisionInputs:
    """The image side as transformers' config classes read it; without transformers imported already (an
    estimate from shipped coefficients imports neither it nor torch), from the dict (``_plain_vision_inputs``)
    where that has every field."""
    if "transformers" not in sys.modules:
        try:
            return _plain_vision_inputs(json.loads(config_json))
        except TrainmemError:
            pass
    try:
        import transformers
    except ImportError:
        return _plain_vision_inputs(json.loads(config_json))
    d = json.loads(config_json)
    mtype = str(d.pop("model_type"))
    cfg = transformers.AutoConfig.for_model(mtype, **d)
    v = cfg.vision_config
    token = int(getattr(cfg, "image_token_id", None) if getattr(cfg, "image_token_id", None) is not None
                else cfg.image_token_index)
    if mtype in ("qwen2_vl", "qwen2_5_vl"):
        return VisionInputs(mtype, "patches", int(v.patch_size), int(v.in_channels), token,
                            merge=int(v.spatial_merge_size), temporal=int(v.temporal_patch_size))
    side, patch = int(v.image_size), int(v.patch_size)
    if mtype == "llava":
        tokens = (side // patch) ** 2 + (1 if cfg.vision_feature_select_strategy == "full" else 0)
    else:  # gemma3: the patch grid average-pooled to mm_tokens_per_image
        tokens = int(cfg.mm_tokens_per_image)
    return VisionInputs(mtype, "pixels", patch, int(getattr(v, "num_channels", 3)), token, default_size=side,
                        fixed_tokens=tokens)


def image_batch(spec: Any, t: Any, device: Any) -> dict[str, Any]:
    """A VLM micro-batch as its processor and TRL's collator make it (module docstring): ``input_ids`` and
    ``labels`` [b, seq_len] int64 in which each image's placeholders follow one text token (``placeholders``),
    the rest random text; the pixels in fp32 (the processor's dtype; the HF Trainer's
    ``_prepare_input`` moves them to the device without a cast unless DeepSpeed runs: transformers 5.24
    ``trainer.py`` ``_prepare_input``); Qwen2-VL's ``image_grid_thw`` and ``mm_token_type_ids``, Gemma 3's
    ``token_type_ids``. The ids are made on the host and copied, as a loop copies its batch."""
    import torch
    vis = vision_inputs(spec.config)
    b, s, n = t.batch_size, t.seq_len, t.images
    per = vis.tokens(t.image_size)
    ids = torch.randint(0, min(spec.vocab_size, vis.image_token_id), (b, s))
    kinds = torch.zeros(b, s, dtype=torch.long)  # the processor's modality ids: 1 on image tokens
    for start in placeholders(n, per):
        ids[:, start:start + per] = vis.image_token_id
        kinds[:, start:start + per] = 1
    out: dict[str, Any] = {"input_ids": ids.to(device), "labels": ids.clone().to(device)}
    side = vis.side(t.image_size)
    if vis.kind == "patches":
        grid = side // vis.patch
        row = vis.channels * vis.temporal * vis.patch * vis.patch
        out["pixel_values"] = torch.randn(b * n * grid * grid, row, device=device)
        thw = torch.tensor([[1, grid, grid]] * (b * n), dtype=torch.long)
        out["image_grid_thw"] = thw if _emulated(device) else thw.to(device)
        out["mm_token_type_ids"] = kinds.to(device)
    else:
        out["pixel_values"] = torch.randn(b * n, vis.channels, side, side, device=device)
        if vis.model_type == "gemma3":
            out["token_type_ids"] = kinds.to(device)
    return out


def placeholders(images: int, per: int) -> list[int]:
    """Where each image's ``per`` placeholder tokens start in a sample: after one text token each, as the chat
    templates wrap every image (Qwen2-VL's ``<|vision_start|>``, Gemma 3's ``<start_of_image>``, LLaVA's prompt
    text). Back-to-back images would be one modality group, which Qwen2-VL's ``get_rope_index`` reads as one
    image (``itertools.groupby`` over ``mm_token_type_ids``: ``modeling_qwen2_5_vl.py`` L1011-1029) and Gemma 3's
    ``get_block_sequence_ids_for_mask`` as one bidirectional block. A sample holds ``images x (per + 1)``
    tokens at least (``min_seq_len``)."""
    return [i * (per + 1) + 1 for i in range(images)]


def min_seq_len(images: int, per: int) -> int:
    """The tokens ``images`` images of ``per`` tokens take with the text token before each (``placeholders``)."""
    return images * (per + 1)


def _emulated(device: Any) -> bool:
    """Whether ``device`` is trace's emulated GPU, whose tensors are ``meta`` (``trace.cuda``): there
    Qwen2-VL's ``image_grid_thw`` stays on the host. The vision tower sizes its rotary positions, window
    index and attention splits from its values (``.tolist()``: transformers 5.24 ``vision_utils.py``
    ``get_vision_position_ids``, ``get_vision_window_index``; ``modeling_qwen2_5_vl.py`` L316-318, L1077),
    which a tensor without data cannot give; on a GPU it is [images, 3] int64 and the few index tensors
    made from it (``cu_seqlens``, ``window_index``), a 512-byte block each, which the trace does not
    count. The rotary positions meet the device's tensors: ``host_grid_positions`` makes them there."""
    import torch
    return torch.empty(0, device=device).device.type == "meta"


def unread_vision_parameters(cfg: Any, names: list[str]) -> frozenset[str]:
    """Of a VLM's parameter ``names`` (transformers' config object ``cfg``), those its step on images gives no
    gradient: modules its vision tower runs whose output no loss reads, so ``torch.optim`` keeps no state for
    them. LLaVA reads CLIP's ``hidden_states[vision_feature_layer]`` (transformers 5.24
    ``models/llava/modeling_llava.py`` L133-146, the layers' outputs after the embeddings: -2 is the output of
    the last layer but one), so CLIP's layers above it and its ``post_layernorm`` (applied to the pooled class
    token only, ``models/clip/modeling_clip.py`` ``CLIPVisionTransformer.forward``) get none; SigLIP's
    attention-pooling ``head``, which Gemma 3's tower builds when ``vision_use_head`` is on, runs on the last
    hidden state that Gemma 3 reads before it (``models/gemma3/modeling_gemma3.py`` L766-768). Qwen2-VL reads
    its whole tower through its merger."""
    mtype = getattr(cfg, "model_type", "")
    v = getattr(cfg, "vision_config", None)
    out = set()
    if mtype == "llava" and v is not None:
        layer = cfg.vision_feature_layer
        layers = int(v.num_hidden_layers)
        top = max(layer) if isinstance(layer, (list, tuple)) else layer
        read = top if top >= 0 else layers + 1 + top   # hidden_states[k]: the output of layer k - 1
        pat = re.compile(r"(^|\.)vision_tower\.(?:vision_model\.)?encoder\.layers\.(\d+)\.")
        out |= {n for n in names if (mm := pat.search(n)) and int(mm.group(2)) >= read}
        out |= {n for n in names if ".vision_tower.post_layernorm." in f".{n}" or ".vision_model.post_layernorm." in n}
    if mtype == "gemma3":
        out |= {n for n in names if ".vision_tower.head." in f".{n}"}
    return frozenset(out)


def vision_tower_parameters(model: Any, model_type: str) -> list[Any]:
    """The parameters ``--freeze-vision-tower`` freezes (``VISION_TOWER``: LLaMA-Factory's keys)."""
    return [p for name, p in model.named_parameters() if in_vision_tower(model_type, name)]


def host_grid_positions(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward pre-hook on Qwen2-VL's vision tower (``add_host_grid_hook``): with ``grid_thw`` on the host
    (trace, ``_emulated``) and the patches on the device, its rotary position ids [patches, 2] int64, computed
    from the host grid as the tower would (``get_vision_position_ids``), made on the device, where the tower
    multiplies them with its ``inv_freq``; the tower pops them from its kwargs (``vision_utils.py``: "if it
    contains the precomputed tensor under the natural key ... the function pops and returns it"). Nothing on a
    GPU, where the grid is a device tensor."""
    from transformers.vision_utils import get_vision_position_ids
    states = args[0] if args else kwargs.get("hidden_states")
    grid = args[1] if len(args) > 1 else kwargs.get("grid_thw")
    if grid is None or grid.device.type != "cpu" or states.device.type == "cpu" or "position_ids" in kwargs:
        return None
    return args, dict(kwargs, position_ids=get_vision_position_ids(grid, module.spatial_merge_size).to(states.device))


def add_host_grid_hook(model: Any, spec: Any) -> None:
    """``host_grid_positions`` on a Qwen2-VL / Qwen2.5-VL model's vision tower (``model.visual``)."""
    if spec.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        return
    for name, mod in model.named_modules():
        if name.endswith("visual") and hasattr(mod, "spatial_merge_size"):
            mod.register_forward_pre_hook(host_grid_positions, with_kwargs=True)
