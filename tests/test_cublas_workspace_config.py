"""``--cublas-workspace-config``: the run's CUBLAS_WORKSPACE_CONFIG, parsed as PyTorch parses it
(aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize``), in estimate, trace and measure."""
import pytest

from trainmem import estimate
from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.measure.alloc_conf import apply_cublas
from trainmem.spec.hardware import CUBLAS_WORKSPACE, CUBLAS_WORKSPACE_SM90, parse_cublas_workspace_config
from trainmem.trace.api import trace

TINY = ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
        "num_key_value_heads=2", "vocab_size=256"]


@pytest.mark.parametrize("config, size", [(":4096:8", CUBLAS_WORKSPACE_SM90), (":4096:2:16:8", CUBLAS_WORKSPACE),
                                          (":16:8", 16 * 1024 * 8), ("x:4096:1", 4096 * 1024)])
def test_parsed_as_pytorch_parses_it(config, size):
    assert parse_cublas_workspace_config(config) == size


def _workspace(report):
    return sum(c.bytes for c in report.components if c.category == "workspace")


def test_estimate_counts_the_configured_workspace_per_handle():
    kw = dict(set=TINY, batch_size=1, seq_len=64, gpu="h100")
    assert _workspace(estimate("llama-3.2-1b", **kw)) == 2 * CUBLAS_WORKSPACE_SM90   # Hopper's default
    assert _workspace(estimate("llama-3.2-1b", cublas_workspace_config=":16:8", **kw)) == 2 * 16 * 1024 * 8
    assert _workspace(estimate("llama-3.2-1b", cublas_workspace_config=":4096:8", gpu="a100-80gb",
                               **{k: v for k, v in kw.items() if k != "gpu"})) == 2 * CUBLAS_WORKSPACE_SM90


def test_trace_allocates_the_configured_workspace():
    kw = dict(set=TINY, batch_size=1, seq_len=64, gpu="a100-80gb")
    small = trace("llama-3.2-1b", cublas_workspace_config=":16:8", **kw)
    big = trace("llama-3.2-1b", cublas_workspace_config=":4096:8", **kw)
    assert small.extra["cublas_workspace"] == 16 * 1024 * 8
    assert big.extra["cublas_workspace"] == CUBLAS_WORKSPACE_SM90
    assert _workspace(big) - _workspace(small) == 2 * (CUBLAS_WORKSPACE_SM90 - 16 * 1024 * 8)


def test_a_value_pytorch_would_ignore_is_refused(capsys):
    with pytest.raises(TrainmemError, match="SIZE_KIB:COUNT"):
        estimate("llama-3.2-1b", cublas_workspace_config="4096")
    assert main(["estimate", "llama-3.2-1b", "--cublas-workspace-config", "32MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cublas-workspace-config" in err


def test_measure_sets_the_variable_before_the_first_matmul_and_refuses_a_different_one():
    env: dict[str, str] = {}
    apply_cublas(":4096:8", "cuda", env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    apply_cublas(":4096:8", "cuda", env)   # the same value given twice: fine
    with pytest.raises(TrainmemError, match="environment sets CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        apply_cublas(":16:8", "cuda", env)
    with pytest.raises(TrainmemError, match="--device cpu"):
        apply_cublas(":16:8", "cpu", {})
    apply_cublas(None, "cpu", env)   # not given: nothing to do


def test_blackwell_defaults_to_32_mib_from_pytorch_2_11():
    from trainmem.spec.hardware import default_cublas_workspace
    assert default_cublas_workspace((10, 0)) == CUBLAS_WORKSPACE_SM90          # a current PyTorch
    assert default_cublas_workspace((12, 0), (2, 11)) == CUBLAS_WORKSPACE_SM90
    assert default_cublas_workspace((10, 0), (2, 10)) == CUBLAS_WORKSPACE      # before PR #175344
    assert default_cublas_workspace((8, 0)) == CUBLAS_WORKSPACE
    kw = dict(set=TINY, batch_size=1, seq_len=64, gpu="b200")
    assert _workspace(estimate("llama-3.2-1b", **kw)) == 2 * CUBLAS_WORKSPACE_SM90
    assert _workspace(estimate("llama-3.2-1b", torch_version="2.10", **kw)) == 2 * CUBLAS_WORKSPACE

