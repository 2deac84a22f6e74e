"""Sequence lengths a model's training step accepts, beyond its position table (``ModelSpec.max_positions``).

Reformer (transformers 5.24 ``models/reformer/modeling_reformer.py``) refuses two sequences in training mode:

- its axial position embeddings (``config.axial_pos_embds``, default True) broadcast one weight per axis to
  ``axial_pos_shape`` and, training, raise unless the sequence is exactly ``prod(axial_pos_shape)``
  (``AxialPositionEmbeddings.forward`` L232-239: "If training, make sure that config.axial_pos_shape factors ...
  multiply to sequence length");
- its chunked attention pads the sequence to a multiple of the least common multiple of its layers' chunk
  lengths (``_get_least_common_mult_chunk_len`` L161-174), and training raises instead of padding
  (``ReformerModel.forward`` L2029-2035).

So a Reformer trains at one sequence length: ``trace`` runs it there, and ``estimate`` derives its
coefficients at the setup's own point (``estimate.derived.point_at``) rather than fitting them over
several sequences, which its step would refuse.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def fixed_sequence(model_type: str, config: Mapping[str, Any]) -> int:
    """The one sequence length ``config``'s model trains at (0: any): a Reformer with axial position embeddings,
    ``prod(axial_pos_shape)`` tokens (``AxialPositionEmbeddings.forward`` L232-239); its defaults (64, 64) and
    True as ``ReformerConfig`` gives them (``configuration_reformer.py`` L115-116)."""
    if model_type != "reformer" or not config.get("axial_pos_embds", True):
        return 0
    return math.prod(int(x) for x in config.get("axial_pos_shape") or (64, 64))


def _chunk_multiple(config: Mapping[str, Any]) -> int:
    """The multiple a training Reformer's sequence must be: the least common multiple of the chunk lengths of
    the attention types in ``attn_layers`` (``_get_least_common_mult_chunk_len`` L161-174; chunk lengths default
    64, ``configuration_reformer.py`` L131-132)."""
    kinds = set(config.get("attn_layers") or ("local", "lsh"))
    lengths = [int(config.get(f"{k}_attn_chunk_length") or 64) for k in ("local", "lsh") if k in kinds]
    return math.lcm(*lengths) if lengths else 1


def sequence_problem(model_type: str, config: Mapping[str, Any], seq_len: int) -> str:
    """The one line refusing ``--seq-len seq_len`` for a ``model_type`` model of ``config`` ("" when its training
    step takes it)."""
    if model_type != "reformer":
        return ""
    fixed = fixed_sequence(model_type, config)
    if fixed and seq_len != fixed:
        shape = " x ".join(str(x) for x in config.get("axial_pos_shape") or (64, 64))
        return (f"--seq-len {seq_len}: Reformer's axial position embeddings train at exactly prod(axial_pos_shape) = "
                f"{shape} = {fixed} tokens (transformers modeling_reformer.py AxialPositionEmbeddings.forward); "
                f"use --seq-len {fixed}, or give axial_pos_shape factors that multiply to {seq_len}")
    multiple = _chunk_multiple(config)
    if seq_len % multiple:
        return (f"--seq-len {seq_len}: a training Reformer's sequence must be a multiple of {multiple}, the least "
                f"common multiple of its attention chunk lengths (transformers modeling_reformer.py "
                f"ReformerModel.forward refuses to pad while training); use --seq-len {-(-seq_len // multiple) * multiple}")
    return ""
