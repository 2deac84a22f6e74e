"""The default method (``--method trainmem``): one GPU's memory through the training step.

One engine for one layout and for many. It runs in three stages:

1. ``quantities.build.quantities(m, t, stage)``: what does not depend on batch or sequence: model states
   per tensor with allocator rounding (``states.py``), a layer's saved tensors op by op in the
   dtype PyTorch stores (``layers.py``), embeddings / head / loss bytes, the autocast cache of
   half weight copies, optimizer temporaries, DDP buckets or ZeRO-3 gathered layers;
2. ``moments.tokens`` and ``moments.walk``: those quantities for a batch and sequence, and the
   step as named moments (two steps, two micro-steps each), whose largest is the peak;
3. ``breakdown``: the peak moment as named components, and the phases (for one layout).

``estimate(m, t)`` returns a ``MemoryReport`` (the worst pipeline stage). ``estimate_layouts``
evaluates stages 1-2 for arrays of layouts (the planner): the quantities of each distinct
parallel shape are computed once, stacked into arrays, and the same ``tokens``/``walk`` code runs
on the arrays, so both paths give the same bytes (tests/test_plan_layouts.py checks 1,000 layouts).
"""
from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import numpy as np

from ..allocator_rules import reserved_overhead
from ..errors import TrainmemError
from .reserved import reserved_gap
from .quantities import step_copies, without_gpu_flatten
from .states import fsdp_grad_op
from ..report import MemoryReport
from ..spec.hardware import CUBLAS_WORKSPACE
from ..spec.model import ModelSpec
from ..spec.training import RECOMPUTE, TrainingSpec, padded_lengths
from .derived import notes as derived_notes
from .breakdown import components, phase_label, phases, where_label
from .moments import StepFlags, peak, pipeline_output, tokens, walk
from .layers import compiled_recipe
from .megatron_buffers import kept_buffers, pipeline_inputs_kept, rerun_batches_kept, tp_rank0_note
from .quantities import SHAPE_FIELDS, gather, layer_key, quantities, shape_quantities

#: layout fields ``estimate_layouts`` takes as arrays: SHAPE_FIELDS pick the quantities
TOKEN_FIELDS = ("batch_size", "seq_len", "grad_accum")


COMPILE_WARNING = ("--compile: the layers are the eager step's saved tensors (inductor's partition, which "
                   "recomputes their elementwise chains and saves fewer, is modelled for the llama and GPT-2 "
                   "families with a fused SDPA kernel, without LoRA, 4-bit bases, experts or --tp); "
                   "use trace --compile for this model (docs/trace.md)")

#: the warning of an estimate of pipeline stages sharded with FSDP2 outside the setups checked against
#: trace (docs/trace.md, the pipeline section). Modelled: the schedule's loss outside the stage root
#: (``quantities.pipeline.pipeline_fsdp``), gradients accumulated unsharded through the schedule and reduced only
#: after it (``quantities.fsdp_root.fsdp_no_sync``), the first stage's top layer gathered before its root
#: (``quantities.pipeline.pipeline_top_first``), ``full``'s back-propagated layers kept gathered through the
#: stage's backward (``quantities.pipeline.pipeline_kept_layer``), ``grad-op``'s layers gathered once per stage
#: (``moments.tokens``), under ``bf16-mp`` each micro-batch's new bf16 gradients beside the fp32 ones FSDP2
#: accumulates (``Quantities.fsdp_mp_new``). Not modelled: units that torch's PipelineStage keeps gathered
#: after a backward (stage.py ``backward_maybe_with_nosync``: ``set_reshard_after_backward(False)``) into a
#: following backward of the rank (``full`` under interleaved orders), GPipe's last stage under FSDP2
PIPELINE_FSDP_WARNING = ("--pp with --fsdp: torch's PipelineStage keeps FSDP2's units gathered from a backward "
                         "to the stage's next forward and their gradients unsharded; the estimate is checked "
                         "against trace for 1F1B and, without recompute, grad-op under interleaved 1F1B; here "
                         "use trace (-6.1% to +1.5% against this estimate on the setups of docs/trace.md)")


def pipeline_fsdp_warning(t: TrainingSpec) -> str | None:
    """The warning of an estimate of pipeline stages under FSDP2 outside the setups the estimate is
    checked on (``PIPELINE_FSDP_WARNING``): None without a pipeline or FSDP, under 1F1B and, without
    recompute, for ``grad-op`` under interleaved 1F1B."""
    if not (t.pp > 1 and t.fsdp is not None and t.shard_group > 1):
        return None
    checked = t.pp_schedule == "1f1b" or (fsdp_grad_op(t) and t.pp_schedule == "interleaved-1f1b"
                                          and t.recompute == "none")
    return None if checked else PIPELINE_FSDP_WARNING


def compile_warning(m: ModelSpec, t: TrainingSpec) -> str | None:
    """The warning of an ``estimate --compile`` whose layers have no compiled recipe
    (``layers.compiled_recipe``: they keep the eager step's saved tensors, an overestimate)."""
    if not t.compile or (m.family != "derived" and compiled_recipe(layer_key(m, t))):
        return None
    return COMPILE_WARNING


def estimate(m: ModelSpec, t: TrainingSpec, cublas_workspace: int | None = None,
             reserved: bool = False, capability: tuple[int, int] | None = None,
             room: int | None = None) -> MemoryReport:
    """One GPU's training memory for model ``m`` trained as ``t`` (the worst pipeline stage).
    ``cublas_workspace``: bytes of one cuBLAS handle's workspace (None: ``CUBLAS_WORKSPACE``,
    PyTorch's default ``:4096:2:16:8``; a calibration profile gives the measured size,
    ``Hardware.cublas_workspace``). ``reserved``: also replay the step through the caching
    allocator for ``peak_reserved`` (``reserved/``; milliseconds, where the rest takes
    microseconds: ``trainmem.estimate`` asks for it, sweeps of the engine do not). ``capability``:
    the GPU's compute capability, which sizes Transformer Engine's workspace (``megatron_buffers``;
    None: not known). ``room``: the GPU's bytes beside its CUDA context, which decide where DeepSpeed
    ZeRO-1/2 flattens its parameters (``quantities.zero_partition.without_gpu_flatten``; None: no GPU given, on the GPU)."""
    if t.trainer is not None and not t.extra.get("dpo_policy_step"):
        # TRL's DPOTrainer (the policy's step here, marked, plus the reference) or RewardTrainer
        from .preference import estimate_dpo, estimate_reward
        kind = estimate_dpo if t.trainer == "dpo" else estimate_reward
        return kind(m, t, estimate, cublas_workspace=cublas_workspace, reserved=reserved, capability=capability,
                    room=room)
    ws = CUBLAS_WORKSPACE if cublas_workspace is None else int(cublas_workspace)
    stage = "first"
    if t.pp > 1:  # the worst stage by allocated memory; only it is replayed for reserved memory
        reps = {s: estimate_stage(m, t, s, ws, capability=capability, room=room) for s in t.worst_stage_candidates}
        stage = max(reps, key=lambda s: reps[s].peak_allocated)  # (the first of equals: first, middle, last)
        rep = reps[stage]
    if t.pp == 1 or reserved:
        rep = estimate_stage(m, t, stage, ws, reserved, capability, room)
    warning = compile_warning(m, t)
    if warning:
        rep.warnings.append(warning)
    for warning in (pipeline_fsdp_warning(t), zero_init_warning(t, rep)):
        if warning:
            rep.warnings.append(warning)
    if m.family == "derived":
        rep.warnings.extend(derived_notes(m, t))
    return rep


def zero_init_warning(t: TrainingSpec, rep: MemoryReport) -> str | None:
    """One line when the peak is DeepSpeed ZeRO-3's whole-model load and ``--zero-init`` was not given
    (``TrainingSpec.ds_zero_init``: off, DeepSpeed's path for a model built outside ``zero.Init``): a
    loop that builds the model under ``deepspeed.zero.Init`` (as the HF Trainer and Accelerate do) never
    holds it whole, and its peak is the step's."""
    if t.zero_init is not None or not t.ds_whole_load or not rep.peak_phase.startswith("model_loaded"):
        return None
    return ("the peak is DeepSpeed's load of the whole model onto each GPU before ZeRO-3 partitions it (a model "
            "built outside deepspeed.zero.Init); if your loop builds it under zero.Init, give --zero-init on")


def estimate_stage(m: ModelSpec, t: TrainingSpec, stage: str, handle_ws: int = CUBLAS_WORKSPACE,
                   reserved: bool = False, capability: tuple[int, int] | None = None,
                   room: int | None = None) -> MemoryReport:
    """The report of one pipeline stage (``first``, ``middle`` or ``last``); ``handle_ws``: one cuBLAS
    handle's workspace in bytes; ``reserved``: replay the step for ``peak_reserved``; ``capability``:
    the GPU's compute capability, ``room`` its bytes beside the CUDA context (``estimate``)."""
    q0 = quantities(m, t, stage)
    q = without_gpu_flatten(q0, room)
    flags = StepFlags.of(m, t)
    b, ga = t.batch_size, t.grad_accum
    n = b * (t.seq_len // t.cp)      # tokens on this rank
    nsq = n * t.seq_len              # token x key pairs (context parallelism sees every key)
    tk = tokens(q, flags, n, nsq, b, ga)
    # (the micro-steps after the first: none without accumulation, whose walk has one micro-step)
    tk_later = tokens(q, flags, n, nsq, b, ga, later=True) if ga > 1 else tk
    after = later_tokens(m, t, stage, flags)
    kept = kept_buffers(m, t, stage, n, nsq, capability)  # Megatron's and TE's, from the first forward on
    # Megatron's pipeline inputs and (0.18) the step's batches, after backward
    pipe, saved = pipeline_inputs_kept(m, t, stage, n), rerun_batches_kept(m, t, stage, n)
    if after is None:
        moments, ends = walk(q, flags, tk, ga, handle_ws, tk_later, kept=sum(kept), pipe_kept=pipe, batches_kept=saved)
    else:  # --later-seq-len: the run's first micro-batch at seq_len, every later one shorter
        tk_later = after[1]
        moments, ends = walk(q, flags, tk, ga, handle_ws, tk_later, after[0], kept=sum(kept), pipe_kept=pipe,
                             batches_kept=saved)
    total, i, totals = peak(moments, q.fixed)
    mo = moments[i]
    if after is not None and (mo.micro or mo.step > 1):  # the peak is in a micro-batch after the first
        at, an, ansq = after[0 if not mo.micro else 1], after[2], after[3]
    else:
        at, an, ansq = (tk_later if mo.micro else tk), n, nsq  # the terms of the peak's micro-step
    rep = MemoryReport(source="estimate", method="trainmem",
                       components=components(q, at, mo, t, an, ansq, m, handle_ws, kept, (pipe, saved)),
                       phases=phases(moments, totals, ends, ga), peak_allocated=total,
                       peak_phase=f"{phase_label(mo.phase, mo.micro, ga)}@{mo.step}",
                       peak_where=where_label(mo, q, at), model=m, training=t)
    tk = at if after is None else tk  # (--later-seq-len: the replay is of micro-batches at seq_len, the
    # first's, whose blocks the allocator keeps cached for the shorter ones after it)
    # reserved: the step replayed through the caching allocator (reserved/)
    if reserved:
        gap, marks = replayed_gap(q0, q, flags, tk, (after is None and bool(mo.micro), n, nsq, b, ga, t.recompute,
                                                    step_copies(t), handle_ws), varying_steps(m, t, stage, flags))
        rep.peak_reserved = total + gap
        _phase_reserved(rep, marks)
        # the replay's own allocated peak (bytes): the gap stands on it, so where it exceeds the estimate's
        # the replay holds blocks the step does not (benchmarks/bench_agreement.py --reserved shows both)
        rep.extra["replay_peak_allocated"] = max((mk[1] for mk in marks.values()), default=0)
    rep.extra["pipeline_stage"] = stage if t.pp > 1 else None
    for note in (tp_rank0_note(m, t, stage, n), flatten_note(q, room)):
        if note:
            rep.warnings.append(note)
    rep.extra["activations_per_layer"] = tk.layer
    return rep


#: ``reserved_gap``'s answers by the setup's quantities (``quantities``' cached object, built once per setup
#: and never changed afterwards: ``quantities.record.Quantities``), then by the replay's other arguments (``replayed_gap``)
_GAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forget_replays() -> None:
    """Drop every remembered replay (``replayed_gap``): the next estimate of any setup replays it anew
    (what a caller that watches the replay's allocations, e.g. a test's spy on the allocator, needs)."""
    _GAPS.clear()


def replayed_gap(q0, q, flags: StepFlags, tk, args: tuple, varying: list) -> tuple[int, dict]:
    """``reserved.driver.reserved_gap`` of ``q`` (``q0`` as ``without_gpu_flatten`` left it, or its copy without the
    flat group), remembered: the replay reads only its arguments, so a setup replayed again (the planner
    re-estimates its top layouts on every call; ``fit``'s searches meet a setup more than once) reuses it.
    ``args``: (whether ``tk`` are a later micro-step's terms, at the first micro-batch's length, then
    ``reserved_gap``'s n, nsq, b, ga, recompute, temp_copies, handle_ws); ``tk`` the terms they name
    (``moments.tokens`` of ``q``, ``flags`` and those). ``varying`` (``--min-seq-len``): replayed each time."""
    rest = args[1:]
    if varying:
        return reserved_gap(q, flags, tk, *rest, varying)
    per = _GAPS.setdefault(q0, {})
    key = (q is not q0, flags, *args)
    if key not in per:
        per[key] = reserved_gap(q, flags, tk, *rest, varying)
    gap, marks = per[key]
    return gap, dict(marks)


def flatten_note(q, room: int | None) -> str | None:
    """One line when DeepSpeed ZeRO-1/2's flat group is taken to be made on the GPU without a GPU to
    decide it (``quantities.zero_partition.without_gpu_flatten``: ``room`` None)."""
    if room is not None or not q.ds_flat_group:
        return None
    return (f"DeepSpeed >= 0.19.0 flattens the ZeRO-1/2 parameters on the GPU when the flat group "
            f"({q.ds_flat_group / 2**30:.2f} GiB) fits in its free memory, else on the host; no GPU given, so it is "
            "taken to fit (the load holds the parameters twice): give --gpu or --gpu-memory to decide it")


def later_tokens(m: ModelSpec, t: TrainingSpec, stage: str, flags: StepFlags) -> tuple | None:
    """``--later-seq-len``: the terms of the micro-batches after the run's first, which are padded to
    ``later_seq_len`` tokens per sample where the first has ``seq_len`` (lit-gpt's ``get_batch``):
    (the terms of a step's first micro-step, of its later micro-steps, their tokens on this rank,
    their token x key pairs), from the setup at that length (its own quantities: a derived model's
    coefficients can depend on the length); None without the option or at ``seq_len``."""
    if t.later_seq_len is None or t.later_seq_len == t.seq_len:
        return None
    tl = replace(t, seq_len=t.later_seq_len, later_seq_len=None)
    ql = quantities(m, tl, stage)
    b, ga = t.batch_size, t.grad_accum
    n = b * tl.seq_len               # tokens on this rank (no context parallelism: TrainingSpec refuses it)
    nsq = n * tl.seq_len
    return tokens(ql, flags, n, nsq, b, ga), tokens(ql, flags, n, nsq, b, ga, later=True), n, nsq


def varying_steps(m: ModelSpec, t: TrainingSpec, stage: str, flags: StepFlags) -> list:
    """``--min-seq-len``: the micro-batches the reserved replay runs after the run's first two steps
    at ``seq_len``, at the padded lengths of ``training.padded_lengths``, grouped into steps of
    ``grad_accum`` (the last one partial), each micro-batch as (its quantities, its Tokens, tokens
    on this rank, token x key pairs). Empty without the option. The allocated peak stays that of
    the steps at ``seq_len``: a shorter micro-batch saves less, and meets at most the output a
    micro-batch as long as the longest left held."""
    lengths = padded_lengths(t)
    _one_point_refuses(m, t, "--min-seq-len", f"its {len(set(lengths))} padded lengths", len(set(lengths)),
                       "drop --min-seq-len, or use trace")
    b, ga = t.batch_size, t.grad_accum
    micro = []
    for length in lengths:
        ql = quantities(m, replace(t, seq_len=length, min_seq_len=None), stage)
        n = b * length               # tokens on this rank (no context parallelism: TrainingSpec refuses it)
        micro.append((ql, tokens(ql, flags, n, n * length, b, ga, later=True), n, n * length))
    return [micro[i:i + ga] for i in range(0, len(micro), ga)]


def _one_point_refuses(m: ModelSpec, t: TrainingSpec, option: str, what: str, count: int, fix: str) -> None:
    """Refuses ``option`` in one line when it needs ``m`` at more than ``derived.POINT_LIMIT`` other
    (batch, sequence) points and ``m``'s coefficients hold at one point only (``derived.point_at``:
    each point is a trace of its own)."""
    from .derived import POINT_LIMIT, point_at
    if count > POINT_LIMIT and point_at(m, t) is not None:
        raise TrainmemError(f"{option}: {m.name}'s memory is not polynomial in the batch and sequence, so its "
                            f"coefficients are derived at each (batch, sequence) point by a trace of its own, and "
                            f"{what} would need {count} (at most {POINT_LIMIT}); {fix}")


def _phase_reserved(rep: MemoryReport, marks: dict) -> None:
    """Reserved memory at each phase's end: the replay's (``reserved/``) plus what the replay's
    allocated peak so far falls short of the estimate's (the replay lists fewer tensors; at the
    end this gives the report's peak reserved), never below the estimate's allocated peak so far
    nor above the peak reserved (without ``empty_cache`` reserved memory only grows). A phase whose
    replay emptied the cache (DeepSpeed's ``defragment`` at load: ``states.zero3_whole_load``) starts
    "so far" again from what it leaves allocated."""
    high = 0
    for p in rep.phases:
        mark = marks.get((p.name, p.step))
        emptied = mark is not None and mark[2]
        high = p.allocated if emptied else max(high, p.peak)
        if mark is not None:
            reserved, replay_high, _ = mark
            p.reserved = min(rep.peak_reserved, max(reserved + max(0, high - replay_high), high))


def estimate_layouts(m: ModelSpec, base: TrainingSpec, cublas_workspace: int | None = None,
                     capability: tuple[int, int] | None = None, room: int | None = None,
                     **layout: Any) -> dict[str, np.ndarray]:
    """Peak memory of one GPU for many layouts at once.

    ``layout``: any of ``SHAPE_FIELDS`` and ``TOKEN_FIELDS`` as equal-length arrays (``recompute``
    as names or as indices into ``RECOMPUTE``); fields not given come from ``base``. Returns int64
    arrays: ``peak_allocated`` and ``peak_reserved`` (the worst pipeline stage, as ``estimate``),
    ``stage`` (0 first, 1 last) and ``params_rank`` (parameters on a rank before ZeRO sharding, the
    larger stage). The layouts must be valid (``spec.layout.layout_problems``).
    ``cublas_workspace``: one cuBLAS handle's workspace, and ``capability`` and ``room``, as for ``estimate``.
    """
    ws = CUBLAS_WORKSPACE if cublas_workspace is None else int(cublas_workspace)
    if base.later_seq_len is not None:
        raise TrainmemError(f"--later-seq-len {base.later_seq_len} is modelled by estimate and trace of one setup; "
                            "fit, sweep and plan evaluate layouts without it: drop --later-seq-len")
    if base.min_seq_len is not None:
        raise TrainmemError(f"--min-seq-len {base.min_seq_len} is modelled by estimate and trace of one setup; "
                            "fit, sweep and plan evaluate layouts without it: drop --min-seq-len")
    if base.trainer is not None:
        raise TrainmemError(f"--trainer {base.trainer} is modelled by estimate, trace and sweep (one setup at a "
                            "time); fit and plan evaluate layouts of the plain step: drop --trainer, or use sweep")
    if base.pp_weighted:
        raise TrainmemError("--pp-first-stage-less-layers / --pp-last-stage-less-layers (torchtitan's weighted stage "
                            "split, whose worst stage may be a middle one) are modelled by estimate and trace of one "
                            "setup; fit, sweep and plan compare the first and last stages: drop them")
    cols = _columns(base, layout)
    parts = _regime_parts(m, base, cols)
    if parts is not None:  # a derived architecture's sequences on both sides of its sliding window, or batch 1 and more
        n = len(cols["tp"])
        out = {"peak_allocated": np.zeros(n, np.int64), "peak_reserved": np.zeros(n, np.int64),
               "stage": np.zeros(n, np.int64), "params_rank": np.zeros(n, np.int64)}
        for rows, b in parts:
            sub = estimate_layouts(m, b, ws, capability, room, **{k: v[rows] for k, v in cols.items()
                                                if k in layout or k in ("seq_len", "batch_size")})
            for k in out:
                out[k][rows] = sub[k]
        return out
    out = _stage_arrays(m, base, cols, "first", ws, capability, room)
    out["stage"] = np.zeros(len(cols["tp"]), np.int64)
    sel = np.nonzero(cols["pp"] > 1)[0]
    if len(sel):
        last = _stage_arrays(m, base, {k: v[sel] for k, v in cols.items()}, "last", ws, capability, room)
        take = last["peak_allocated"] > out["peak_allocated"][sel]
        rows = sel[take]
        out["peak_allocated"][rows] = last["peak_allocated"][take]
        out["stage"][rows] = 1
        out["params_rank"][sel] = np.maximum(out["params_rank"][sel], last["params_rank"])
    out["peak_reserved"] = out["peak_allocated"] + reserved_overhead(out["peak_allocated"])
    return out


def _regime_parts(m: ModelSpec, base: TrainingSpec, cols: dict[str, np.ndarray]) -> list | None:
    """For a derived architecture whose sequences fall on both sides of its sliding window (each
    side has its own coefficients, ``derived.regime``), or an encoder-decoder whose decoder-to-
    encoder length ratio differs between the sequences (a fixed ``--target-len``: its coefficients
    are read at each ratio, ``derived.decoder_ratio``), or whose micro-batches are 1 in some rows and
    larger in others (batch 1 has coefficients of its own, ``derived.batch1``): the rows of each side,
    ratio or batch class and a base setup there. None when all rows share one (the usual case)."""
    if base.unsloth_gc:
        return _unsloth_parts(m, base, cols)
    if m.family != "derived":
        return None
    from dataclasses import replace
    from .derived import batch1, decoder_ratio, point_at, regime

    def side(t: TrainingSpec) -> tuple:
        # a model whose coefficients hold at one point (``derived.point_at``): each point on its own
        return regime(m, t), decoder_ratio(m, t), batch1(m, t), point_at(m, t)
    seqs, batches = cols["seq_len"], cols["batch_size"]
    points = {(int(s), int(b)) for s, b in zip(seqs, batches)}
    _one_point_refuses(m, replace(base, seq_len=int(seqs[0]), batch_size=int(batches[0])),
                       "fit and plan", "the grid's batch sizes and sequence lengths", len(points),
                       "plan: give at most that many with --batch-size; fit: "
                       "sweep the sizes instead (each cell derived at its point)")
    sides: dict[tuple, list[tuple[int, int]]] = {}
    for s, b in points:
        sides.setdefault(side(replace(base, seq_len=s, batch_size=b)), []).append((s, b))

    def rows(pairs: list[tuple[int, int]]) -> np.ndarray:
        keys = seqs * (int(batches.max()) + 1) + batches
        return np.nonzero(np.isin(keys, [s * (int(batches.max()) + 1) + b for s, b in pairs]))[0]
    if len(sides) < 2:
        return None if side(base) in sides else [(np.arange(len(seqs)), replace(base, seq_len=int(seqs[0]),
                                                                                batch_size=int(batches[0])))]
    return [(rows(v), replace(base, seq_len=v[0][0], batch_size=v[0][1])) for v in sides.values()]


def _unsloth_parts(m: ModelSpec, base: TrainingSpec, cols: dict[str, np.ndarray]) -> list | None:
    """``--unsloth-gc``: the rows whose micro-batch's layer input is offloaded (above 2 MiB,
    ``quantities.build.unsloth_offloads``, which keys the quantities) and those whose input stays, each with a
    base setup on its side; None when every row is on the base's side."""
    from dataclasses import replace
    from . import unsloth
    from .layers import Policy
    from .quantities import unsloth_offloads
    tokens = cols["seq_len"] * cols["batch_size"]
    off = np.asarray(unsloth.offloads(m.hidden_size, Policy.of(base.precision).stream, tokens))
    if (off == unsloth_offloads(m, base)).all():
        return None
    return [(rows, replace(base, seq_len=int(cols["seq_len"][rows[0]]), batch_size=int(cols["batch_size"][rows[0]])))
            for rows in (np.nonzero(off)[0], np.nonzero(~off)[0]) if len(rows)]


def _columns(base: TrainingSpec, layout: dict[str, Any]) -> dict[str, np.ndarray]:
    unknown = set(layout) - set(SHAPE_FIELDS) - set(TOKEN_FIELDS)
    if unknown:
        raise ValueError(f"estimate_layouts: not layout fields: {', '.join(sorted(unknown))}")
    size = max((np.size(v) for v in layout.values()), default=1)
    cols = {}
    for k in SHAPE_FIELDS + TOKEN_FIELDS:
        v = layout.get(k, getattr(base, k))
        if k == "recompute" and np.asarray(v).dtype.kind in "USO":  # names -> indices into RECOMPUTE
            v = np.vectorize(RECOMPUTE.index, otypes=[np.int64])(v)
        cols[k] = np.broadcast_to(np.asarray(v, dtype=np.int64), (size,)).copy()
    return cols


def _stage_arrays(m: ModelSpec, base: TrainingSpec, cols: dict[str, np.ndarray], stage: str,
                  handle_ws: int = CUBLAS_WORKSPACE, capability: tuple[int, int] | None = None,
                  room: int | None = None) -> dict[str, np.ndarray]:
    """``quantities`` per distinct parallel shape, gathered; then ``tokens`` and ``walk`` on arrays."""
    # (+ whether FSDP accumulates unsharded, and interleaved 1F1B's micro-batches: shape_quantities' key)
    ga = cols["grad_accum"]
    accumulation = ga if base.virtual_stages > 1 else (ga > 1) * int(base.grad_sync == "step")
    first, inv = group_rows(*(cols[k] for k in SHAPE_FIELDS), np.asarray(accumulation, dtype=np.int64))
    rows = np.stack([cols[k][first] for k in SHAPE_FIELDS + TOKEN_FIELDS], 1).tolist()
    shapes = shape_quantities(m, base, stage, rows)
    q = without_gpu_flatten(gather(shapes, inv), room)   # (DeepSpeed's flat group, row by row)
    b, s, ga = cols["batch_size"], cols["seq_len"], cols["grad_accum"]
    n = b * (s // cols["cp"])
    nsq = n * s
    flags = StepFlags.of(m, base)
    if stage == "last":  # every row pipelined (estimate_layouts' pp > 1 rows): the schedule keeps the output
        flags = replace(flags, pipe_out=pipeline_output(base, pipelined=True))
    tk = tokens(q, flags, n, nsq, b, ga)
    kept = kept_buffers(m, base, stage, n, nsq, capability, cols["tp"], cols["sequence_parallel"])
    pipe = pipeline_inputs_kept(m, base, stage, n, cols["tp"], cols["sequence_parallel"], cols["pp"])
    saved = rerun_batches_kept(m, base, stage, n, cols["tp"], cols["pp"], s, ga)
    moments, _ = walk(q, flags, tk, ga, handle_ws, tokens(q, flags, n, nsq, b, ga, later=True), kept=sum(kept),
                      pipe_kept=pipe, batches_kept=saved)
    total, _, _ = peak(moments, q.fixed)
    params = np.array([x[3] for x in shapes], dtype=np.int64)[inv]
    return {"peak_allocated": np.asarray(total, dtype=np.int64), "params_rank": params}


def group_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of equal-length non-negative integer columns: (first row index of each group,
    the group of each row), through one mixed-radix key (much faster than ``np.unique(axis=0)``)."""
    key = np.zeros(len(cols[0]), np.int64)
    for c in cols:
        c = np.asarray(c, dtype=np.int64)
        key = key * (int(c.max(initial=0)) + 1) + c
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)
