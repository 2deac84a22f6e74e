"""Module globals swapped for the length of a block: how trace puts a package's emulated kernels into
transformers' modeling files (``liger_modules.rope``, ``torchtitan_modules.rope``,
``mamba_kernels.swap``, ``fla_modules.fused_mixers``). A modeling file's forward reads such a global
(``apply_rotary_pos_emb``, ``mamba_inner_fn``, ``torch_chunk_gated_delta_rule``...) at each call, also
in a checkpoint's recompute, so the swap covers the whole step."""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Mapping

from torch import nn


@contextlib.contextmanager
def swapped(replacements: Mapping[tuple[Any, str], Any]) -> Iterator[None]:
    """Each ``(module, name)`` global set to its replacement while the block runs; the old values
    restored after it, also when it raises."""
    saved = {(mod, name): getattr(mod, name) for mod, name in replacements}
    try:
        for (mod, name), value in replacements.items():
            setattr(mod, name, value)
        yield
    finally:
        for (mod, name), old in saved.items():
            setattr(mod, name, old)


def model_files(model: nn.Module, names: Any) -> set:
    """The modules defining ``model``'s submodule classes that hold a global of one of ``names``."""
    return {sys.modules[type(m).__module__] for m in model.modules()
            if any(hasattr(sys.modules.get(type(m).__module__), name) for name in names)}
