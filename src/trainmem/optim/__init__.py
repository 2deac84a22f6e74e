"""Memory-saving training helpers. ``optimizer_in_backward``: the optimizer step inside backward."""
from .in_backward import (GlobalClipError, GradientAccumulationError, OptimizerInBackward,
                          optimizer_in_backward)

__all__ = ["optimizer_in_backward", "OptimizerInBackward", "GradientAccumulationError", "GlobalClipError"]
