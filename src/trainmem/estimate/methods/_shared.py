"""Small pieces the named formula methods share: exact integer arithmetic and fixed sizes.

Every method works in integer bytes. Formulas with fractional coefficients (``28.25/t``,
``10/d``) are evaluated exactly with ``fractions.Fraction`` and rounded up once, at the end.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Union

Number = Union[int, Fraction]

#: cuBLAS workspace one handle allocates lazily on its first GEMM, in bytes (uint8 blocks):
#: a 4096 KiB x 2 pool plus a 16 KiB x 8 pool, as PyTorch's CublasHandlePool sizes it.
#: PyTorch creates one handle per thread, so forward (main thread) and backward (autograd
#: thread) each own one. Edward Rees ("Transformer Memory Arithmetic",
#: https://erees.dev/transformer-memory/) and Moritz Scherrmann's BERT-large notebook
#: (https://moritzscherrmann.com/blog/2024/GPU-Memory_BERT/) both count 8,519,680 bytes per handle.
from ...spec.hardware import CUBLAS_WORKSPACE as CUBLAS_WORKSPACE_BYTES


def ceil_bytes(x: Number) -> int:
    """Round an exact (possibly fractional) byte amount up to a whole byte."""
    f = Fraction(x)
    return -((-f.numerator) // f.denominator)

