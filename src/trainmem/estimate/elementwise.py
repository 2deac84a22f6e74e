"""Arithmetic that means the same on Python numbers and on numpy arrays.

The engine's step (``moments.py``) is written once with these helpers and plain operators, so the
same code gives one layout's bytes (Python ints: exact, fast) or a million layouts' at once (int64
and float64 arrays, element by element). Every helper returns exactly what the scalar expression
would: ``int(x)`` and ``x.astype(int64)`` both truncate toward zero; Python's and numpy's float64
products are the same IEEE operations.
"""
from __future__ import annotations

from typing import Any

import numpy as np

I64 = np.int64
NEVER = -(1 << 62)  # the value of a moment that does not happen (never the largest)


def is_array(*xs: Any) -> bool:
    for x in xs:  # (a loop, not ``any()`` over a generator: the engine calls this thousands of times per estimate)
        if isinstance(x, np.ndarray):
            return True
    return False


def where(cond: Any, a: Any, b: Any) -> Any:
    """``a if cond else b``, element by element when ``cond`` is an array."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, a, b)
    return a if cond else b


def maximum(a: Any, b: Any) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a >= b else b


def minimum(a: Any, b: Any) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return a if a <= b else b


def trunc(x: Any) -> Any:
    """``int(x)`` (toward zero) for a float or a float array."""
    if isinstance(x, np.ndarray):
        return x.astype(I64)
    return int(x)


def ceil_div(a: Any, b: Any) -> Any:
    return -(-a // b)


def next_pow2(x: Any) -> Any:
    """The smallest power of two >= x (x >= 1), as ``triton.next_power_of_2``."""
    if isinstance(x, np.ndarray):
        return (2 ** np.ceil(np.log2(np.maximum(x, 1)))).astype(I64)
    return 1 << (int(x) - 1).bit_length()
