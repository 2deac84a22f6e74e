"""Multi-GPU ``measure`` on torch.distributed: one process per rank, the real wrappers, one report.

Every rank builds the model, wraps it as the TrainingSpec asks, trains ``steps`` steps and records
its memory phase by phase with the probe and :class:`~trainmem.measure.probes.PhaseRecorder` of a
single-process run (CUDA's allocator statistics, or ``LiveBytes`` per process on the CPU). Each
rank's report is gathered on rank 0 (``dist.gather_object``), which returns the report of the worst
rank (the highest device memory, else the highest peak allocated) with ``extra["ranks"]``: one
dict per rank (rank, world size, peaks, phases, its local parameter bytes, ...).

Wrappers: ``trainmem.wrappers`` (DDP, FSDP2 ``fully_shard``, FSDP1 ``FullyShardedDataParallel``,
tensor parallelism with ``parallelize_module``; each cited there), the same code trace runs on its
fake process group.

The layout is a ``DeviceMesh`` (``torch/distributed/device_mesh.py`` ``init_device_mesh``) of
dp × tp ranks, which must be the world size. Out of scope, refused in one line: DeepSpeed ZeRO,
pipeline, context and sequence parallelism (``workload.check_supported``), DDP over tensor
parallelism and FSDP1 with it; recompute, LoRA and the optimizer in backward with several ranks
(not exercised yet).

Launching: inside ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``torch/distributed/run.py``) or ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``,
``SLURM_LOCALID`` with ``MASTER_ADDR``/``MASTER_PORT`` exported by the job script) every process is
one rank (:func:`launcher_env`). :func:`launch` starts the ranks itself, on this node, through
torchelastic's ``elastic_launch`` (``torch/distributed/launcher/api.py``, what ``torchrun
--standalone`` runs: a c10d rendezvous on ``localhost:0``), and returns rank 0's gathered report.
The process group is NCCL on CUDA (device ``cuda:LOCAL_RANK``) and gloo on the CPU.

On the CPU ``LiveBytes`` counts each process's tensors; it hands ``DTensor`` ops back to the
subclass (their local tensors are counted) and sees ``UntypedStorage.resize_``, which FSDP uses to
free and re-allocate unsharded parameters. Buffers the gloo / NCCL backends allocate themselves
(their worker threads, NCCL's own memory) are not seen on the CPU; on CUDA the allocator's
statistics include what goes through it.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Any

import torch

from ..errors import TrainmemError
from ..progress import progress
from ..report import MemoryReport
from ..spec import TrainingSpec
from ..wrappers import TP_MODEL_TYPES
from ..wrappers import mesh as _mesh
from ..wrappers import wrap, wrapper_name  # noqa: F401  (the wrappers, shared with trace's fake process group)
from .probes import CpuProbe, CudaProbe, PhaseRecorder, parse_device
from .runner import _check_outputs, _inputs, _limit_hardware, _not_applied, _report, _Run, _run

# ----- where we run ---------------------------------------------------------------------------------------
def launcher_env(environ: Any = None) -> dict[str, Any] | None:
    """The rank, world size and local rank a launcher gave this process, or None outside one.

    torchrun (``torch/distributed/run.py``) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT``; under ``srun`` the ranks are ``SLURM_PROCID`` of
    ``SLURM_NTASKS`` (local ``SLURM_LOCALID``) and the job script exports ``MASTER_ADDR`` (and
    ``MASTER_PORT``, default 29500), as torch's env:// rendezvous needs."""
    env = os.environ if environ is None else environ
    try:
        if "RANK" in env and "WORLD_SIZE" in env:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", rank))
            return {"rank": rank, "world_size": world, "local_rank": local, "launcher": "torchrun"}
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env:
            rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
            local = int(env.get("SLURM_LOCALID", 0))
            return {"rank": rank, "world_size": world, "local_rank": local, "launcher": "srun"}
    except ValueError as e:
        raise TrainmemError(f"the launcher's rank variables are not integers ({e})") from None
    return None


def several(t: TrainingSpec) -> bool:
    """Whether a setup needs several ranks of torch.distributed (data or tensor parallelism, FSDP)."""
    return t.dp * t.tp > 1 or t.fsdp is not None


def needs_launcher(t: TrainingSpec) -> str:
    """The one-line refusal for a parallel setup run outside a launcher."""
    n = t.dp * t.tp
    return (f"{_layout(t)} runs {n} process{'es' if n > 1 else ''}, one per rank: add --launcher torchrun "
            f"--nproc-per-node {n}, or run `trainmem measure` inside torchrun or srun")


def _layout(t: TrainingSpec) -> str:
    parts = [f"--dp {t.dp}"] if t.dp > 1 or t.fsdp else []
    if t.fsdp:
        parts.append(f"--fsdp {t.fsdp}" + (" (FSDP1)" if t.fsdp_version == 1 else ""))
    if t.tp > 1:
        parts.append(f"--tp {t.tp}")
    return " ".join(parts) or "this setup"


def check_layout(model: Any, t: TrainingSpec, world_size: int) -> None:
    """Refuse, in one line, a layout the wrappers cannot build on ``world_size`` ranks."""
    if t.dp * t.tp != world_size:
        raise TrainmemError(f"--dp {t.dp} × --tp {t.tp} = {t.dp * t.tp} ranks, but the world size is {world_size}: "
                            f"give --dp × --tp = {world_size} (or --nproc-per-node {t.dp * t.tp})")
    if t.tp > 1:
        if t.fsdp is None and t.dp > 1:
            raise TrainmemError("--dp with --tp needs --fsdp (FSDP2 over the dp dimension of the mesh): DDP does "
                                "not wrap tensor-parallel DTensor parameters")
        if t.fsdp is not None and t.fsdp_version == 1:
            raise TrainmemError("--fsdp-version 1 does not combine with --tp here: use FSDP2 (--fsdp-version 2)")
        if model.model_type not in TP_MODEL_TYPES:
            raise TrainmemError(f"--tp {t.tp}: measure's tensor-parallel plan is written for Llama, Mistral, Qwen2 and Qwen3 "
                                f"layers (q/k/v/o and gate/up/down projections), not {model.model_type} "
                                f"({model.name})")
    if t.fsdp == "hybrid":
        shard = t.shard_group
        if t.dp % shard:
            raise TrainmemError(f"--fsdp hybrid: --dp {t.dp} is not a multiple of the shard group "
                                f"({shard} ranks, fsdp_node_size)")
    refuse = [("--recompute full", t.recompute != "none"), ("--lora-rank", bool(t.lora_rank)),
              ("--optimizer-in-backward", t.optimizer_in_backward),
              # gradients accumulated unsharded under no_sync(): the measured loop syncs every micro-batch
              ("--grad-sync step", t.accumulates_unsharded)]
    bad = [name for name, on in refuse if on]
    if bad:
        raise TrainmemError(f"{', '.join(bad)} with several ranks is not measured yet (the wrappers and "
                            "checkpointing / adapters / per-parameter hooks are not exercised together); "
                            "measure it on one GPU or use estimate")


# ----- one rank -------------------------------------------------------------------------------------------
def measure_rank(model: Any, steps: int = 2, *, device: str = "cuda", training: TrainingSpec | None = None,
                 overrides: Any = None, gpu: Any = None, gpu_memory: Any = None, context_memory: Any = None,
                 max_fraction: float | None = None, memory_limit: Any = None, snapshot: str | None = None,
                 html: str | None = None, profile: str | None = None, largest: int = 10, seed: int = 0,
                 empty_cache: bool = False, predict_on_oom: bool = True, predict_by: str = "auto",
                 progress_bar: bool | None = None, env: dict[str, Any] | None = None,
                 **training_options: Any) -> MemoryReport:
    """Measure this rank of a torch.distributed run and gather every rank's report on rank 0.

    The arguments are :func:`trainmem.measure.runner.measure`'s. Rank 0 returns the worst rank's
    report with ``extra["ranks"]`` (every rank's summary); the other ranks return their own report
    with ``extra["gathered"] = False``. Checks that can fail are made before the process group
    starts, so every rank refuses alike in one line."""
    import torch.distributed as dist
    t0 = time.perf_counter()
    env = env or launcher_env()
    if env is None:
        raise TrainmemError("no launcher: RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS with MASTER_ADDR "
                            "(srun) are not set")
    if not isinstance(steps, int) or steps < 1:
        raise TrainmemError(f"--steps must be a positive integer, got {steps!r}")
    kind, index = parse_device(device)
    if kind == "cuda" and device.strip().lower() != "cuda":
        raise TrainmemError(f"--device {device}: with several ranks each uses cuda:LOCAL_RANK; give --device cuda")
    r, options, overrides = _inputs(model, training, overrides, dict(training_options, gpu=gpu, gpu_memory=gpu_memory,
                                                                     context_memory=context_memory,
                                                                     max_fraction=max_fraction))
    t = r.training
    check_layout(r.model, t, env["world_size"])
    if snapshot or html or profile:
        raise TrainmemError("--snapshot, --html and --profile are single-process outputs; with several ranks they "
                            "are not written yet (measure one rank's setup on one GPU for them)")
    limit = _check_outputs(kind, memory_limit, None, None, None)
    rank, world, local = env["rank"], env["world_size"], env["local_rank"]
    if kind == "cuda":
        if not torch.cuda.is_available():
            from .probes import cuda_unavailable_reason
            raise TrainmemError(f"--device cuda: {cuda_unavailable_reason() or 'CUDA is not available'}")
        if local >= torch.cuda.device_count():
            raise TrainmemError(f"rank {rank} is local rank {local}, but this node has {torch.cuda.device_count()} "
                                "CUDA device(s) visible: one GPU per rank")
        index = local
        torch.cuda.set_device(index)
    dev = torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")
    own_group = _init_group(env, dev)
    try:
        if dist.get_world_size() != world:
            raise TrainmemError(f"the process group has {dist.get_world_size()} ranks, the launcher said {world}")
        probe = CpuProbe(limit, watch_resize=True) if kind == "cpu" else CudaProbe(index, limit)
        mesh = _mesh(t, kind)
        run = _Run(r, options, overrides, model, kind, probe, r.hardware or _limit_hardware(kind, limit), limit,
                   steps, seed, empty_cache, PhaseRecorder(probe, t.grad_accum, empty_cache), _not_applied(t))
        run.wrap = lambda module: _settled(wrap(module, r.model, t, mesh, dev))
        torch.manual_seed(seed)  # the same weights and batches on every rank (tensor parallelism needs them)
        with progress(steps + 1, "measure", progress_bar if rank == 0 else False) as bar:
            run.on_step = bar.update
            _run(run, largest, None, None, None)
        probe.empty_cache()
        report = _report(run, time.perf_counter() - t0, predict_on_oom, predict_by)
        summary = rank_summary(report, rank, world, local, run.params_b)
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object((summary, report), gathered, dst=0)
        dist.barrier()  # no rank closes its connections while rank 0 still receives (gloo aborts then)
    finally:
        if own_group:
            dist.destroy_process_group()
    if rank != 0:
        report.extra["gathered"] = False
        return report
    assert gathered is not None
    return combine(gathered, t, env["launcher"])


#: seconds a wrapped model is left alone before it is read (:func:`_settled`): more than one pass of
#: the NCCL watchdog (``kWatchdogThreadSleepMillis`` = 100 ms, ProcessGroupNCCL.hpp)
SETTLE_S = 0.25


def _settled(module: Any) -> Any:
    """``module`` once the collectives its wrapper ran while being built have let go of their tensors.

    DDP's constructor broadcasts rank 0's parameters and buffers in flat buckets
    (``_sync_module_states`` -> ``_broadcast_coalesced``, torch/nn/parallel/distributed.py). The work
    object of each broadcast holds its flat bucket, and the process group's own thread keeps a reference
    to a finished work until it takes its next item (gloo: ``ProcessGroupGloo::runLoop``,
    torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, resets ``workInProgress_`` after ``execute``;
    NCCL: the watchdog thread drops completed work on its next pass). Read at once, ``model_loaded``
    counts a parameters-sized bucket on some runs and not on others: 30 and 49 of 200 readings on two
    gloo ranks, none after waiting 10 ms. The wait makes the phase what it is in a training run, where
    the first batch is made long after the wrapper returns."""
    time.sleep(SETTLE_S)
    return module


def _init_group(env: dict[str, Any], dev: torch.device) -> bool:
    """Start the process group (NCCL on CUDA, bound to this rank's GPU; gloo on the CPU) from the
    env:// variables, which are exported from srun's; False when one was running already."""
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    if env["launcher"] == "srun":
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env["rank"]), str(env["world_size"])
        os.environ["LOCAL_RANK"] = str(env["local_rank"])
    kw: dict[str, Any] = {"backend": "nccl" if dev.type == "cuda" else "gloo",
                          "timeout": datetime.timedelta(minutes=10)}
    if dev.type == "cuda":
        kw["device_id"] = dev
    dist.init_process_group(**kw)
    return True


def rank_summary(report: MemoryReport, rank: int, world: int, local: int, params_b: int) -> dict[str, Any]:
    """One rank's entry of ``extra["ranks"]``."""
    ex = report.extra
    return {"rank": rank, "world_size": world, "local_rank": local, "host": socket.gethostname(),
            "device": ex.get("device"), "peak_allocated": int(report.peak_allocated),
            "peak_reserved": report.peak_reserved, "device_used": report.device_used,
            "peak_phase": report.peak_phase, "peak_where": report.peak_where,
            "parameters_bytes": int(params_b), "optimizer_states_bytes": ex.get("optimizer_states_bytes"),
            "cuda_context": ex.get("cuda_context"), "oom": ex.get("oom"),
            "components": [c.to_dict() for c in report.components],
            "phases": ex.get("phases") or [p.to_dict() for p in report.phases]}


def worst_key(summary: dict[str, Any]) -> tuple[int, int]:
    """What makes a rank the worst: its device memory (CUDA), else its peak reserved, else its peak
    allocated; the lower rank on a tie."""
    for k in ("device_used", "peak_reserved", "peak_allocated"):
        if summary.get(k) is not None:
            return int(summary[k]), -int(summary["rank"])
    return 0, -int(summary["rank"])


def combine(gathered: list[tuple[dict[str, Any], MemoryReport]], t: TrainingSpec,
            launcher: str | None = None) -> MemoryReport:
    """The worst rank's report, with every rank's summary in ``extra["ranks"]``."""
    gathered = sorted(gathered, key=lambda g: g[0]["rank"])
    summaries = [g[0] for g in gathered]
    worst_summary, worst = max(gathered, key=lambda g: worst_key(g[0]))
    worst.extra.update({"ranks": summaries, "rank": worst_summary["rank"], "world_size": len(summaries),
                        "gathered": True, "wrapper": wrapper_name(t),
                        "launcher": launcher})
    worst.warnings = list(worst.warnings)
    return worst


# ----- launching the ranks here --------------------------------------------------------------------------
def _rank_entry(model: Any, steps: int, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """What each process started by :func:`launch` runs: ("ok", report) on rank 0, ("ok", None)
    elsewhere, ("error", line) for a refusal, ("crash", text) for anything else (printed here)."""
    try:
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        rep = measure_rank(model, steps, **kwargs)
        return "ok", (rep if rep.extra.get("gathered") else None)
    except TrainmemError as e:
        return "error", str(e)
    except Exception as e:  # a real failure: its traceback on this rank's stderr, one line for the caller
        import traceback
        traceback.print_exc(file=sys.stderr)
        return "crash", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


#: options of ``measure`` that are not inputs of ``spec.resolve``
RUN_OPTIONS = ("device", "memory_limit", "snapshot", "html", "profile", "largest", "seed", "empty_cache",
               "predict_on_oom", "predict_by", "progress_bar", "probe")


def launch(model: Any, steps: int = 2, *, nproc_per_node: int, training: TrainingSpec | None = None,
           overrides: Any = None, **kwargs: Any) -> MemoryReport:
    """Start ``nproc_per_node`` ranks on this node and return rank 0's gathered report.

    Uses torchelastic's ``elastic_launch`` (``torch/distributed/launcher/api.py``) with the
    standalone rendezvous ``torchrun --standalone`` uses (c10d on ``localhost:0``, a fresh run id;
    ``torch/distributed/run.py``); the processes are started with ``spawn`` and run
    :func:`measure_rank`. The setup is resolved and its layout checked here first, so a refusal
    costs no process start. ``kwargs``: :func:`trainmem.measure.runner.measure`'s options."""
    import uuid
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    if not isinstance(nproc_per_node, int) or isinstance(nproc_per_node, bool) or nproc_per_node < 1:
        raise TrainmemError(f"--nproc-per-node must be a positive integer, got {nproc_per_node!r}")
    if kwargs.get("probe") is not None:
        raise TrainmemError("a probe object cannot be handed to launched ranks")
    if not isinstance(steps, int) or steps < 1:
        raise TrainmemError(f"--steps must be a positive integer, got {steps!r}")
    kwargs.pop("probe", None)
    kind, _ = parse_device(kwargs.get("device", "cuda"))
    if kind == "cuda":  # before any process starts (device_count does not create a CUDA context)
        from .probes import cuda_unavailable_reason
        why = cuda_unavailable_reason()
        if why:
            raise TrainmemError(why)
        if torch.cuda.device_count() < nproc_per_node:
            raise TrainmemError(f"--nproc-per-node {nproc_per_node}: this node has {torch.cuda.device_count()} "
                                "CUDA device(s) visible, and each rank needs its own")
    r, _, _ = _inputs(model, training, overrides, {k: v for k, v in kwargs.items() if k not in RUN_OPTIONS})
    opts = dict(kwargs, training=training, overrides=overrides)
    check_layout(r.model, r.training, nproc_per_node)
    parse_device(opts.get("device", "cuda"))
    if kwargs.get("snapshot") or kwargs.get("html") or kwargs.get("profile"):
        raise TrainmemError("--snapshot, --html and --profile are single-process outputs; with several ranks they "
                            "are not written yet (measure one rank's setup on one GPU for them)")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc_per_node, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="spawn",
                          monitor_interval=0.1)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    try:
        results = elastic_launch(config, _rank_entry)(model, steps, opts)
    except ChildFailedError as e:
        first = next(iter(e.failures.values()), None)
        why = getattr(first, "message", "") or "see its output above"
        raise TrainmemError(f"a rank of the launched run failed: {str(why).strip().splitlines()[0]}") from None
    outcomes = [results[k] for k in sorted(results)]
    for status, value in outcomes:
        if status != "ok":
            raise TrainmemError(value if status == "error" else f"a rank failed: {value}")
    report = outcomes[0][1]
    if report is None:
        raise TrainmemError("rank 0 returned no gathered report")
    report.extra["launcher"] = f"torchrun (elastic_launch, {nproc_per_node} processes)"
    return report
