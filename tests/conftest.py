"""Shared fixtures."""
import pytest


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch thread: CPU memory measurements of real runs then see one
    allocation order (intra-op parallel kernels can allocate per-thread scratch)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
