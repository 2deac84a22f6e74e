"""A bounded memo for the engine's per-setup records (model states, quantities)."""
from __future__ import annotations

from typing import Any, Callable


class BoundedCache(dict):
    """A dict that forgets everything once it holds ``limit`` entries (sweeps over many setups
    must not grow without bound; a cleared cache only costs a recomputation)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get_or_build(self, key: Any, build: Callable[[], Any]) -> Any:
        """The value stored under ``key``, built (and stored) on a miss."""
        hit = self.get(key)
        if hit is None:
            if len(self) >= self.limit:
                self.clear()
            hit = self[key] = build()
        return hit
