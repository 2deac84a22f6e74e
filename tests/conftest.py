"""Shared fixtures and helpers."""
import importlib.util
import sys
from pathlib import Path

import pytest


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module (tests reuse the benchmarks' setups)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch thread: CPU memory measurements of real runs then see one
    allocation order (intra-op parallel kernels can allocate per-thread scratch)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    """Derived coefficients and profiles built by tests go to a private cache, not the user's."""
    import os
    import tempfile
    os.environ.setdefault("TRAINMEM_CACHE", tempfile.mkdtemp(prefix="trainmem-test-cache-"))
