"""Shared fixtures and helpers."""
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

try:  # property tests draw the same examples on every run, so `make test` passes or fails alike on CI;
    # TRAINMEM_PROPERTY_EXAMPLES=N (any N) draws random ones, --hypothesis-seed S repeats a search
    from hypothesis import settings as _hypothesis_settings
    _hypothesis_settings.register_profile("trainmem", derandomize="TRAINMEM_PROPERTY_EXAMPLES" not in os.environ)
    _hypothesis_settings.load_profile("trainmem")
except ImportError:
    pass


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module (tests reuse the benchmarks' setups)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def estimate_patched(monkeypatch, m, t, patches) -> Any:
    """The estimate of model ``m`` under ``t`` with ``patches`` ((object, attribute, value) each) in place,
    the quantities' cache and the remembered replays cleared before and after, so that it neither reads
    nor leaves a result made without them (tests comparing a mechanism with its absence)."""
    from trainmem import estimate
    from trainmem.estimate import engine, quantities
    quantities.build._CACHE.clear()
    engine.forget_replays()
    for obj, name, value in patches:
        monkeypatch.setattr(obj, name, value)
    try:
        return estimate(m, training=t)
    finally:
        monkeypatch.undo()
        quantities.build._CACHE.clear()
        engine.forget_replays()


@pytest.fixture(scope="session")
def bench():
    """``benchmarks/bench_agreement.py`` (the agreement grid's setups, ``Case``, ``compare``), loaded once:
    its rows run trace, so without torch and transformers the tests that take it are skipped."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return load_benchmark("bench_agreement")


@pytest.fixture(autouse=True)
def _piped_width(monkeypatch):
    """Every test sees output as a pipe sees it (``render.text.width``: 100 columns), whatever COLUMNS
    the shell that runs pytest exports; a test about other widths sets COLUMNS itself."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(autouse=True)
def _fresh_replays():
    """Every test replays its setups anew (``engine.forget_replays``): a replay remembered from an earlier
    test would hide the allocations a test spies on, making it depend on which tests ran before."""
    from trainmem.estimate import engine
    engine.forget_replays()


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
