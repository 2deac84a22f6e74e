"""Multi-rank measure (``trainmem.measure.distributed``) on the CPU: real runs of a tiny Llama on a
gloo process group of 2 ranks, launched by ``trainmem measure --launcher torchrun`` (torchelastic,
spawned processes) and by ``torchrun`` itself, through DDP, FSDP2, FSDP1 and tensor parallelism;
the per-rank reports gathered on rank 0; the refusals; launcher detection and the worst rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from trainmem.cli import main  # noqa: E402
from trainmem.errors import TrainmemError  # noqa: E402
from trainmem.measure.distributed import combine, launcher_env, worst_key  # noqa: E402
from trainmem.measure.runner import measure  # noqa: E402
from trainmem.report import MemoryReport, Phase  # noqa: E402

MODEL = "llama-3.2-1b"
SET = ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
       "intermediate_size=128", "vocab_size=256", "head_dim=16"]
SETUP = dict(batch_size=2, seq_len=16, precision="fp32")
#: the projections tensor parallelism splits: per layer q, o (64×64), k, v (64×32), gate, up, down (64×128)
PROJECTION_BYTES = 2 * 4 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
#: and the vocabulary-parallel embedding (256×64), which is also the tied output head
EMBEDDING_BYTES = 4 * 256 * 64


def _args(*extra: str) -> list[str]:
    words = ["measure", MODEL]
    for s in SET:
        words += ["--set", s]
    return words + ["--batch-size", "2", "--seq-len", "16", "--precision", "fp32", "--device", "cpu", *extra]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                        "SLURM_NTASKS")}
    env["TRANSFORMERS_VERBOSITY"] = "error"
    return env


def _run(cmd: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env())


def _launched(*flags: str) -> dict:
    """``trainmem measure ... --launcher torchrun --nproc-per-node 2 --json`` in a subprocess."""
    p = _run([sys.executable, "-m", "trainmem", *_args(*flags, "--launcher", "torchrun", "--nproc-per-node", "2",
                                                       "--json")])
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def _phase(summary: dict, name: str, step: int) -> dict:
    return next(p for p in summary["phases"] if p["name"] == name and p["step"] == step)


@pytest.fixture(scope="module")
def single():
    """One process, no parallelism: the model's full parameter bytes and its memory after loading."""
    r = measure(MODEL, 2, device="cpu", overrides=SET, **SETUP)
    params = next(c.bytes for c in r.components if c.name == "parameters")
    loaded = next(p for p in r.phases if p.name == "model_loaded")
    return {"params": params, "loaded": loaded.allocated, "report": r}


def _check_gathered(d: dict) -> list[dict]:
    ranks = d["ranks"]
    assert [s["rank"] for s in ranks] == [0, 1]
    assert all(s["world_size"] == 2 for s in ranks)
    assert d["extra"]["world_size"] == 2 and d["extra"]["gathered"] is True
    worst = max(ranks, key=worst_key)
    assert d["extra"]["rank"] == worst["rank"]
    assert d["peak_allocated"] == worst["peak_allocated"] == max(s["peak_allocated"] for s in ranks)
    for s in ranks:  # every rank ran every phase of both steps
        assert [(p["name"], p["step"]) for p in s["phases"]][:2] == [("model_loaded", 0), ("forward", 1)]
        assert len(s["phases"]) == 9 and s["oom"] is None
    return ranks


def test_ddp_keeps_the_whole_model_on_every_rank(single):
    d = _launched("--dp", "2")
    ranks = _check_gathered(d)
    assert d["training"]["dp"] == 2 and d["training"]["fsdp"] is None
    assert "DDP" in d["extra"]["wrapper"]
    for s in ranks:
        assert s["parameters_bytes"] == single["params"]
        # DDP's Reducer allocates its gradient buckets (one flat copy of the gradients) at construction
        loaded = _phase(s, "model_loaded", 0)["allocated"]
        assert loaded == pytest.approx(single["loaded"] + single["params"], rel=0.01)


@pytest.mark.parametrize("version", [2, 1])
def test_fsdp_full_shards_the_parameters_in_half(single, version):
    d = _launched("--dp", "2", "--fsdp", "full", "--fsdp-version", str(version))
    ranks = _check_gathered(d)
    assert d["training"]["fsdp"] == "full" and d["training"]["fsdp_version"] == version
    assert ("FSDP1" if version == 1 else "FSDP2") in d["extra"]["wrapper"]
    for s in ranks:
        assert s["parameters_bytes"] == pytest.approx(single["params"] / 2, rel=0.01)
        # after loading a rank holds its shard only: the full tensors were freed when sharded
        assert _phase(s, "model_loaded", 0)["allocated"] == pytest.approx(single["loaded"] / 2, rel=0.02)
        # AdamW's two states are per shard too
        assert s["optimizer_states_bytes"] == pytest.approx(single["params"], rel=0.02)
    assert d["peak_allocated"] < single["report"].peak_allocated


def test_tensor_parallel_halves_the_projections_and_the_embedding(single):
    """torchtitan's plan (trainmem.wrappers.tensor_parallel): the projections and the (tied)
    embedding halved, the norms replicated; the loss runs under loss_parallel on gloo."""
    d = _launched("--tp", "2")
    ranks = _check_gathered(d)
    assert d["training"]["tp"] == 2
    for s in ranks:
        assert s["parameters_bytes"] == single["params"] - (PROJECTION_BYTES + EMBEDDING_BYTES) // 2


def test_out_of_memory_on_every_rank():
    """A LiveBytes limit each rank runs into at the same op: both report it, rank 0 gathers, exit 1."""
    p = _run([sys.executable, "-m", "trainmem", *_args("--dp", "2", "--fsdp", "full", "--memory-limit", "800KiB",
                                                       "--launcher", "torchrun", "--nproc-per-node", "2", "--json")])
    assert p.returncode == 1, p.stderr[-3000:]
    d = json.loads(p.stdout)
    phases = [s["oom"]["phase"] for s in d["ranks"]]
    assert phases[0] == phases[1] and phases[0].endswith("@1")  # the same op on both: no rank left waiting
    assert d["extra"]["oom"]["phase"] == phases[0] and d["fits"] is False


def test_inside_torchrun_rank0_prints_for_all(single):
    """Run as each rank of ``torchrun --standalone``: no flag; rank 0 prints the gathered JSON, the
    other rank nothing."""
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "trainmem", *_args("--dp", "2", "--fsdp", "full", "--json")])
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(p.stdout)  # one document: rank 1 printed nothing
    ranks = _check_gathered(d)
    assert d["extra"]["launcher"] == "torchrun"
    assert all(s["parameters_bytes"] == pytest.approx(single["params"] / 2, rel=0.01) for s in ranks)


@pytest.mark.parametrize("flags, text", [
    (["--dp", "3", "--launcher", "torchrun", "--nproc-per-node", "2"], "world size is 2"),
    (["--dp", "2", "--tp", "2", "--launcher", "torchrun", "--nproc-per-node", "4"], "--dp with --tp needs --fsdp"),
    (["--dp", "2"], "--launcher torchrun --nproc-per-node 2"),
    (["--nproc-per-node", "2"], "--nproc-per-node needs --launcher torchrun"),
    (["--dp", "2", "--zero", "2", "--launcher", "torchrun", "--nproc-per-node", "2"], "ZeRO stage 2 (DeepSpeed)"),
    (["--pp", "2", "--launcher", "torchrun", "--nproc-per-node", "2"], "--pp 2"),
    (["--tp", "2", "--sequence-parallel", "--launcher", "torchrun", "--nproc-per-node", "2"], "--sequence-parallel"),
    (["--dp", "2", "--fsdp", "full", "--recompute", "full", "--launcher", "torchrun", "--nproc-per-node", "2"],
     "--recompute full with several ranks"),
    (["--dp", "2", "--fsdp", "full", "--grad-accum", "2", "--grad-sync", "step", "--launcher", "torchrun",
      "--nproc-per-node", "2"], "--grad-sync step with several ranks"),
    (["--dp", "2", "--launcher", "torchrun", "--nproc-per-node", "2", "--save-fixture", "/tmp/x.json"],
     "--save-fixture with several ranks"),
])
def test_bad_layouts_refused_in_one_line(capsys, flags, text):
    assert main(_args(*flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainmem: error:") and text in err[0], err


def test_tensor_parallel_refused_for_other_families(capsys):
    args = ["measure", "gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4", "--seq-len", "16",
            "--precision", "fp32", "--device", "cpu", "--tp", "2", "--launcher", "torchrun", "--nproc-per-node", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Llama, Mistral, Qwen2 and Qwen3" in err[0]


def test_trace_still_refuses_parallelism():
    """trace runs data, tensor and pipeline parallelism on a fake process group of the emulated GPU
    (tests/test_trace_distributed.py, tests/test_trace_tp.py, tests/test_trace_pp.py); on the CPU,
    and a 1F1B pipeline with fewer micro-batches than stages, it refuses in one line."""
    from trainmem.trace.api import trace
    with pytest.raises(TrainmemError, match="trace --dp 2 runs on the emulated GPU"):
        trace(MODEL, overrides=SET, dp=2, device="cpu", **SETUP)
    with pytest.raises(TrainmemError, match="needs at least as many micro-batches as stages"):
        trace(MODEL, overrides=SET, pp=2, **SETUP)


def test_fsdp_version_is_checked():
    from trainmem.spec import TrainingSpec
    assert TrainingSpec().fsdp_version == 2
    with pytest.raises(TrainmemError, match="fsdp-version 3"):
        TrainingSpec(fsdp="full", fsdp_version=3)
    with pytest.raises(TrainmemError, match="give --fsdp full"):
        TrainingSpec(fsdp_version=1)


def test_launcher_env():
    assert launcher_env({}) is None
    assert launcher_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == \
        {"rank": 1, "world_size": 4, "local_rank": 1, "launcher": "torchrun"}
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3", "MASTER_ADDR": "node1"}
    assert launcher_env(slurm) == {"rank": 3, "world_size": 8, "local_rank": 3, "launcher": "srun"}
    assert launcher_env({k: v for k, v in slurm.items() if k != "MASTER_ADDR"}) is None
    with pytest.raises(TrainmemError):
        launcher_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_the_worst_rank_is_reported():
    def rep(rank: int, peak: int, reserved: int | None = None) -> tuple[dict, MemoryReport]:
        r = MemoryReport("measure", [], [Phase("forward", 1, peak, peak, reserved)], peak, reserved,
                         extra={"device": "cpu"})
        return {"rank": rank, "peak_allocated": peak, "peak_reserved": reserved, "device_used": None}, r

    from trainmem.spec import TrainingSpec
    t = TrainingSpec(dp=3)
    out = combine([rep(0, 100), rep(1, 300), rep(2, 200)], t)
    assert out.peak_allocated == 300 and out.extra["rank"] == 1
    assert [s["rank"] for s in out.extra["ranks"]] == [0, 1, 2]
    assert out.to_dict()["ranks"] == out.extra["ranks"]
    from trainmem.render.measure import measure_details
    text = measure_details(out, "KiB").splitlines()
    assert "ranks: 3 (DDP over 3); the tables above are rank 1, the worst" in text
    assert [ln.split(":")[0] for ln in text if "rank " in ln and ":" in ln and "peak allocated" in ln] == \
        ["  rank   0", "* rank   1", "  rank   2"]
    # reserved memory (CUDA) decides before allocated; a tie goes to the lower rank
    out = combine([rep(0, 300, 400), rep(1, 200, 500)], t)
    assert out.extra["rank"] == 1
    out = combine([rep(1, 100), rep(0, 100)], t)
    assert out.extra["rank"] == 0


def test_srun_environment_is_a_launcher(single, tmp_path):
    """Two processes started as ``srun`` starts them (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID,
    MASTER_ADDR and MASTER_PORT exported, no RANK): each is a rank, rank 0 prints for both."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(_clean_env(), SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "trainmem", *_args("--dp", "2", "--json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert outs[1][0] == ""  # rank 1 prints nothing
    d = json.loads(outs[0][0])
    _check_gathered(d)
    assert d["extra"]["launcher"] == "srun"
    assert all(s["parameters_bytes"] == single["params"] for s in d["ranks"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_refused_before_any_rank_starts(capsys):
    assert main(_args("--dp", "2", "--device", "cuda", "--launcher", "torchrun", "--nproc-per-node", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0]
