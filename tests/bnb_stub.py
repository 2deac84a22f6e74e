"""Import a package that imports bitsandbytes at module level only for classes the test does not use
(galore_torch's 8-bit AdamW, apollo_torch's), on a machine without bitsandbytes: the names it imports
are stood in for while it loads, then removed again."""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

_NAMES = ("bitsandbytes", "bitsandbytes.optim", "bitsandbytes.optim.optimizer", "bitsandbytes.functional")


def import_without_bitsandbytes(name: str):
    """``name`` imported (bitsandbytes stood in for when it is missing); the test skips when ``name`` itself
    is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != "bitsandbytes":
            pytest.skip(f"{name} is not installed")
    stub = {n: types.ModuleType(n) for n in _NAMES}
    stub["bitsandbytes"].__path__ = []  # a package, so that ``import bitsandbytes.functional as F`` finds the stub
    stub["bitsandbytes.optim.optimizer"].Optimizer2State = torch.optim.Optimizer
    saved = {n: sys.modules.get(n) for n in stub}
    sys.modules.update(stub)
    try:
        return importlib.import_module(name)
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
