"""Property tests of the default estimate (``--method trainmem``) over random training setups.

Setups are drawn from every catalogue family (small GPT-2/BERT/Qwen, Llama, the Mixtral MoE, the
NeMo GPT, XLM-RoBERTa-XL) with random batch, sequence (within learned positions), precision,
optimizer and its implementation, ZeRO stage and DP size, TP and PP sizes that divide heads and
layers, sequence parallelism, recomputation, attention (flash only with half precision), LoRA,
gradient accumulation, optimizer-in-backward (only without accumulation), torch.compile, dropout.

Invariants:
  * invalid combinations raise TrainmemError and nothing else; valid ones never raise;
  * more batch or sequence never lowers ``peak_allocated``;
  * a higher ZeRO stage, a larger TP or a larger PP never raises the per-GPU model states;
  * recomputation never raises activations: full <= selective <= none;
  * the components (less cuda_context and allocator_overhead) sum to ``peak_allocated``;
  * every phase's peak >= its allocated; ``peak_allocated`` == the largest phase peak.

"Per-GPU model states" is measured with ``trainmem.estimate.states.model_states``: weights +
master weights + gradients + optimizer states (+ fused-Adam step tensors), i.e. the categories
parameters, master_weights, gradients and optimizer_states, per pipeline stage. The report's
phases are not used for it because the optimizer_step phase also holds buffers, inputs, the cuBLAS
workspace and communication buffers (DDP buckets exist only at ZeRO-0, ZeRO-3 adds gathered
layers), and with PP > 1 the report shows whichever stage peaks higher, which can switch between
the two setups compared. ``test_states_quantity_is_what_the_report_shows`` ties the quantity to
the report's components.

Examples per test are limited (see ``FAST``); the whole file runs in a few seconds.
``TRAINMEM_PROPERTY_EXAMPLES=N`` raises the limit for a deeper search.
"""
from __future__ import annotations

import os
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import trainmem
from trainmem import TrainmemError, TrainingSpec
from trainmem.estimate import engine
from trainmem.estimate.derived import ENCODER_HEADS, sliding_window
from trainmem.estimate.states import PEFT_DEFAULT_TARGETS, flat_zero, model_states
from trainmem.report import CATEGORIES
from trainmem.spec import catalogue_names, resolve_model
from trainmem.spec.galore import LOWRANK_OPTIMIZERS
from trainmem.spec.training import (ATTENTION, BNB_OPTIMIZERS, LOMO_OPTIMIZERS, OPTIMIZER_IMPLS, OPTIMIZERS,
                                    PRECISIONS, RECOMPUTE, TORCHAO_OPTIMIZERS)
from trainmem.estimate.layers import F32, HALF, sdpa_pin_problem

# TRAINMEM_PROPERTY_EXAMPLES=1000 searches deeper (minutes); the default keeps the file to seconds
# (derandomized by tests/conftest.py's profile; TRAINMEM_PROPERTY_EXAMPLES=N draws N random examples)
FAST = settings(max_examples=int(os.environ.get("TRAINMEM_PROPERTY_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
LEARNED_POSITIONS = {"gpt2", "nanogpt", "bert", "roberta-prenorm"}
STATE_CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_states")
#: the optimizers modelled under every layout the setups draw (ZeRO, TP, PP, LoRA, ...): not GaLore, APOLLO
#: or LOMO, which update whole weights of one process and refuse those (their own setups: ``single_process``)
LAYOUT_OPTIMIZERS = tuple(o for o in OPTIMIZERS if o not in LOWRANK_OPTIMIZERS + LOMO_OPTIMIZERS)


@lru_cache(maxsize=None)
def model(name: str):
    return resolve_model(name)


#: the decoder-only and encoder-only catalogue models; encoder-decoders (two stacks, --target-len, no
#: pipeline split), image models (--image-size sets the sequence) and Whisper (a fixed encoder length) have
#: their own option space and their own tests (tests/test_encdec_vit.py, tests/test_speech.py);
#: vision-language models have theirs in tests/test_vlm.py; the derived encoders (DistilBERT, DeBERTa-v3,
#: ModernBERT, RoBERTa: heads fitted per sample and per position pair, some setups refused) in
#: tests/test_encoder_heads.py and tests/test_derived.py
MODELS = [n for n in catalogue_names()
          if not model(n).is_encoder_decoder and model(n).head not in ("image-cls", "vlm", "speech-seq2seq")
          and not (model(n).family == "derived" and model(n).head in ENCODER_HEADS)]


def max_seq(m) -> int:
    """Learned position tables bound the sequence; rotary models are kept to 8k to stay quick."""
    return m.max_positions if m.family in LEARNED_POSITIONS else min(m.max_positions, 8192)


def tp_choices(m) -> list[int]:
    """TP sizes that divide the attention heads, the key/value heads and the MLP (a derived
    architecture's estimate is for one TP rank: spec.layout refuses TP for it)."""
    if m.family == "derived":
        return [1]
    return [d for d in (1, 2, 3, 4, 5, 6, 7, 8, 16) if m.num_heads % d == 0
            and m.num_kv_heads % d == 0 and m.ffn_size % d == 0]


def pp_choices(m) -> list[int]:
    return [d for d in range(1, 17) if m.num_layers % d == 0]


def matmul_modules(m) -> list[str]:
    return sorted({p.module for p in m.parameter_tensors() if p.is_matmul})


@st.composite
def setups(draw, models=tuple(MODELS)):
    """(model name, ModelSpec, options) for a valid setup (options as ``trainmem.estimate`` takes)."""
    name = draw(st.sampled_from(models))
    m = model(name)
    precision = draw(st.sampled_from([p for p in PRECISIONS if p != "bf16-mp"]))  # bf16-mp needs FSDP
    attention = draw(st.sampled_from(ATTENTION if precision != "fp32" else ("eager", "sdpa")))
    derived = m.family == "derived"
    if derived:  # the setups whose coefficients ship with the package (no derivation in this test)
        precision, attention = draw(st.sampled_from(("bf16-amp", "bf16", "fp32"))), "sdpa"
    grad_accum = draw(st.integers(1, 4))
    tp = draw(st.sampled_from(tp_choices(m)))
    sp = tp > 1 and draw(st.booleans())
    cp = 1 if derived else draw(st.sampled_from((1, 1, 1, 2)))
    unit = cp * (tp if sp else 1)  # CP splits the sequence, sequence parallelism each rank's part
    seq = unit * draw(st.integers(1, max_seq(m) // unit))
    lora_rank = 0 if derived else draw(st.sampled_from((0, 0, 0, 4, 16)))
    lora_targets = None
    if lora_rank and draw(st.booleans()):
        lora_targets = tuple(draw(st.lists(st.sampled_from(matmul_modules(m)), min_size=1, max_size=3,
                                           unique=True)))
    options = dict(
        batch_size=draw(st.integers(1, 16)), seq_len=seq, grad_accum=grad_accum, precision=precision,
        optimizer=draw(st.sampled_from(LAYOUT_OPTIMIZERS)),
        optimizer_impl=draw(st.sampled_from((None,) + OPTIMIZER_IMPLS)),
        zero=draw(st.integers(0, 3)), dp=draw(st.sampled_from((1, 2, 4, 8, 64))), tp=tp,
        pp=draw(st.sampled_from(pp_choices(m))), cp=cp, sequence_parallel=sp,
        recompute=draw(st.sampled_from(RECOMPUTE)), attention=attention,
        optimizer_in_backward=grad_accum == 1 and draw(st.booleans()),
        lora_rank=lora_rank, lora_targets=lora_targets, compile=draw(st.booleans()),
        dropout=True if derived else draw(st.booleans()), distributed_optimizer=draw(st.sampled_from((False, False, False, True))),
    )
    if m.manual_layernorm:  # a Python-op LayerNorm is modelled without FSDP's bf16-mp, --compile and --tp
        precision = {"bf16-mp": "bf16-amp"}.get(precision, precision)
        tp = 1
        options.update(compile=False, tp=1, sequence_parallel=False, precision=precision)
    if sdpa_pin_problem(attention, F32 if precision == "fp32" else HALF, m.head_dim, m.num_heads,
                        m.num_kv_heads, tp=tp, dropout=m.attention_dropout if options["dropout"] else 0.0):
        options["attention"] = "sdpa"  # a pinned kernel PyTorch refuses for this model
    if options["distributed_optimizer"]:
        options["zero"] = 0  # Megatron's distributed optimizer is its own ZeRO-1 (no --zero with it)
    if options["optimizer"] in TORCHAO_OPTIMIZERS:
        # torchao's low-bit AdamW is modelled on whole tensors or FSDP2 shards, not ZeRO / Megatron partitions
        options.update(zero=0, distributed_optimizer=False)
    if not impl_exists(options["optimizer"], options["optimizer_impl"]):
        options["optimizer_impl"] = None  # an implementation the optimizer does not have
    if options["recompute"] == "op" and not op_applies(m, options):
        options["recompute"] = "full"  # torchtitan's per-op policy is modelled for full training, one TP rank
    return name, m, options


def impl_exists(optimizer: str, impl) -> bool:
    """Whether the optimizer has that implementation (TrainingSpec._check_optimizer_impl): RMSprop and
    schedule_free's no fused one, bitsandbytes' Lion/RMSprop/AdEMAMix one only."""
    if impl == "fused" and (optimizer == "rmsprop" or optimizer.startswith("schedule-free")):
        return False
    if impl is not None and optimizer in TORCHAO_OPTIMIZERS:  # one implementation (a compiled step)
        return False
    return impl is None or optimizer not in BNB_OPTIMIZERS or optimizer in ("adamw-8bit", "paged-adamw-8bit",
                                                                            "paged-adamw")


def op_applies(m, o) -> bool:
    """Where ``--recompute op`` is modelled (TrainingSpec._check_recompute, training.check_against;
    not with DeepSpeed ZeRO-3, whose step fails there: ``training.op_recompute_zero3_problem``)."""
    return m.family != "derived" and not o.get("lora_rank") and o.get("tp", 1) == 1 and o.get("zero", 0) != 3


def stages(t: TrainingSpec) -> tuple[str, ...]:
    return ("first",) if t.pp == 1 else ("first", "last")


def stage_reports(m, t: TrainingSpec):
    """One report per pipeline stage (the public estimate returns the stage that peaks higher)."""
    return [engine.estimate_stage(m, t, s) for s in stages(t)]


def states_bytes(m, t: TrainingSpec, stage: str) -> int:
    s = model_states(m, t, stage)
    return s.weights + s.master + s.grads + s.optimizer + s.step_tensors


def stage_states(m, t: TrainingSpec) -> dict[str, int]:
    """Model states per stage; with PP = 1 the single stage is both the first and the last."""
    if t.pp == 1:
        v = states_bytes(m, t, "first")
        return {"first": v, "last": v}
    return {s: states_bytes(m, t, s) for s in ("first", "last")}


def forward_allocated(r) -> list[int]:
    """Allocated memory at the end of the first forward of each step."""
    out = {}
    for p in r.phases:
        if p.name.startswith("forward") and p.step not in out:
            out[p.step] = p.allocated
    return [out[k] for k in sorted(out)]


# ----- errors ------------------------------------------------------------------------------------
LORA_NAMES = ("q_proj", "v_proj", "c_attn", "query", "value", "experts", "gate", "o_proj", "down_proj",
              "lm_head", "nonexistent")


@st.composite
def raw_setups(draw):
    """Any combination, valid or not, and the reasons it must be refused."""
    name = draw(st.sampled_from(MODELS))
    m = model(name)
    o = dict(
        batch_size=draw(st.integers(-1, 8)), seq_len=draw(st.sampled_from((-5, 0, 1, 100, 512, 513, 1024, 1025,
                                                                            2048, 4096, 9000))),
        grad_accum=draw(st.integers(0, 3)), precision=draw(st.sampled_from(PRECISIONS)),
        optimizer=draw(st.sampled_from(LAYOUT_OPTIMIZERS)), zero=draw(st.integers(0, 3)),
        dp=draw(st.sampled_from((0, 1, 2, 8))), tp=draw(st.sampled_from((1, 2, 3, 4, 5, 7, 8, 16))),
        pp=draw(st.sampled_from((1, 2, 3, 4, 5, 7, 8))), cp=draw(st.sampled_from((1, 2, 3))),
        sequence_parallel=draw(st.booleans()), recompute=draw(st.sampled_from(RECOMPUTE)),
        attention=draw(st.sampled_from(ATTENTION)), optimizer_in_backward=draw(st.booleans()),
        lora_rank=draw(st.sampled_from((0, 8))),
        lora_targets=draw(st.one_of(st.none(), st.lists(st.sampled_from(LORA_NAMES), min_size=1, max_size=2,
                                                        unique=True).map(",".join))),
    )
    why = []
    if min(o["batch_size"], o["seq_len"], o["grad_accum"], o["dp"]) <= 0:
        why.append("non-positive size")
    if o["precision"] == "bf16-mp":
        why.append("FSDP's mixed precision without FSDP")
    if o["precision"] == "fp32" and o["attention"] in ("flash", "sdpa-flash", "sdpa-cudnn"):
        why.append("flash in fp32")
    if "flash in fp32" not in why and sdpa_pin_problem(
            o["attention"], F32 if o["precision"] == "fp32" else HALF, m.head_dim, m.num_heads, m.num_kv_heads,
            tp=o["tp"], dropout=m.attention_dropout):
        why.append("a pinned SDPA kernel PyTorch refuses for this model")
    if o["optimizer_in_backward"] and o["grad_accum"] > 1:
        why.append("optimizer in backward with accumulation")
    if o["sequence_parallel"] and o["tp"] == 1:
        why.append("sequence parallel without TP")
    if o["optimizer"] in TORCHAO_OPTIMIZERS and o["zero"]:
        why.append("torchao's low-bit optimizer under DeepSpeed ZeRO")
    if o["lora_targets"] and not o["lora_rank"]:
        why.append("LoRA targets without a rank")
    if m.num_heads % o["tp"]:
        why.append("TP does not divide heads")
    if m.num_kv_heads % o["tp"]:
        why.append("TP does not split kv heads")
    if m.ffn_size % o["tp"]:
        why.append("TP does not divide the MLP size")
    if m.num_layers % o["pp"]:
        why.append("PP does not divide layers")
    if o["seq_len"] > 0 and o["seq_len"] % o["cp"]:
        why.append("CP does not divide the sequence")
    if o["sequence_parallel"] and o["seq_len"] > 0 and (o["seq_len"] // o["cp"]) % o["tp"]:
        why.append("TP does not divide the sequence")
    if m.family in LEARNED_POSITIONS and o["seq_len"] > m.max_positions:
        why.append("sequence beyond learned positions")
    if o["lora_rank"] and o["lora_targets"] and set(o["lora_targets"].split(",")) - set(matmul_modules(m)):
        why.append("LoRA target the model lacks")
    if o["recompute"] == "op" and not op_applies(m, o):
        why.append("per-op recompute with LoRA, TP, ZeRO-3 or a derived architecture")
    if m.family == "derived":  # measured on one GPU's real model (estimate/derived.py)
        if o["tp"] > 1:
            why.append("TP of a derived architecture")
        if o["cp"] > 1:
            why.append("CP of a derived architecture")
        if o["lora_rank"] and not o["lora_targets"] and m.model_type not in PEFT_DEFAULT_TARGETS:
            why.append("LoRA without targets where peft has no default")
    return name, o, why


@FAST
@given(raw_setups())
def test_invalid_combinations_raise_trainmem_error_and_valid_ones_never_raise(case):
    name, options, why = case
    try:
        r = trainmem.estimate(name, **options)
    except TrainmemError as e:
        assert why, f"valid setup refused: {e}"
        assert str(e)
        return
    # anything but TrainmemError propagates and fails the test by itself
    assert not why, f"accepted a setup that must be refused ({'; '.join(why)})"
    assert r.peak_allocated > 0


@FAST
@given(setups())
def test_valid_setups_never_raise_and_report_is_consistent(case):
    name, m, o = case
    r = trainmem.estimate(name, **o)
    # components sum to the peak (the context and the allocator's cache are device memory, not allocated)
    allocated = sum(c.bytes for c in r.components if c.category not in ("cuda_context", "allocator_overhead"))
    assert allocated == r.peak_allocated
    assert all(c.category in CATEGORIES for c in r.components)
    # every amount is real memory; the one exception is the bookkeeping line that reconciles the
    # activation parts with the per-layer total, which may be off by float rounding (a byte per layer)
    for c in r.components:
        if c.name == "activations.rounding":
            assert abs(c.bytes) <= m.num_layers * max(o["pp"], o["grad_accum"]) * 64, c
        else:
            assert c.bytes >= 0, c
    # phases: peak >= allocated, and the report's peak is the largest phase peak
    assert r.phases
    assert all(p.peak >= p.allocated >= 0 for p in r.phases)
    assert r.peak_allocated == max(p.peak for p in r.phases)
    assert any(p.peak == r.peak_allocated and f"{p.name}@{p.step}" == r.peak_phase for p in r.phases)


@st.composite
def single_process(draw):
    """(model name, ModelSpec, options) for GaLore, APOLLO and LOMO: one process (``dp`` for the non-
    layerwise GaLore/APOLLO), no sharding or model parallelism, no LoRA, a model with ``nn.Linear``
    layers (not GPT-2's Conv1D)."""
    name, m, o = draw(setups(models=tuple(n for n in MODELS if model(n).model_type != "gpt2")))
    optimizer = draw(st.sampled_from(LOWRANK_OPTIMIZERS + LOMO_OPTIMIZERS))
    if optimizer == "adalomo" and m.num_experts:
        optimizer = "lomo"  # AdaLomo's factored moments cannot update a 3-D expert tensor (refused)
    layerwise = optimizer in LOMO_OPTIMIZERS or (optimizer != "galore-adafactor" and draw(st.booleans()))
    o = dict(o, optimizer=optimizer, optimizer_impl=None, zero=0, tp=1, pp=1, cp=1, sequence_parallel=False,
             lora_rank=0, lora_targets=None, distributed_optimizer=False, optimizer_in_backward=layerwise,
             grad_accum=1 if layerwise else o["grad_accum"], dp=1 if layerwise else o["dp"])
    if optimizer in LOMO_OPTIMIZERS and o["precision"] == "fp16":
        o["precision"] = "fp16-amp"  # Lomo's fp16 loss path raises in the HF Trainer (refused)
    if optimizer not in LOMO_OPTIMIZERS:
        o["optim_target_modules"] = draw(st.sampled_from(("all-linear", tuple(matmul_modules(m)[:2]))))
        o["optim_args"] = draw(st.sampled_from((None, "rank=8", "rank=64,update_proj_gap=50")))
    if o["recompute"] == "op" and not op_applies(m, o):
        o["recompute"] = "full"
    return name, m, o


@FAST
@given(single_process(), st.data())
def test_single_process_optimizers_valid_and_monotonic(case, data):
    """GaLore, APOLLO, LOMO: the report is consistent, and more batch or a longer sequence never
    lowers the peak."""
    name, m, o = case
    test_valid_setups_never_raise_and_report_is_consistent.hypothesis.inner_test(case)
    r1 = trainmem.estimate(name, **o)
    more = trainmem.estimate(name, **dict(o, batch_size=o["batch_size"] + data.draw(st.integers(1, 8))))
    longer = trainmem.estimate(name, **dict(o, seq_len=same_side_of_window(m, o["seq_len"])))
    assert more.peak_allocated >= r1.peak_allocated and longer.peak_allocated >= r1.peak_allocated


@FAST
@given(setups(), st.data())
def test_more_batch_never_lowers_the_peak(case, data):
    name, m, o = case
    more = data.draw(st.integers(1, 16), label="extra batch")
    r1 = trainmem.estimate(name, **o)
    r2 = trainmem.estimate(name, **dict(o, batch_size=o["batch_size"] + more))
    assert r2.peak_allocated >= r1.peak_allocated


@FAST
@given(setups(), st.data())
def test_longer_sequence_never_lowers_the_peak(case, data):
    name, m, o = case
    unit = o["cp"] * (o["tp"] if o["sequence_parallel"] else 1)
    longer = unit * data.draw(st.integers(o["seq_len"] // unit, same_side_of_window(m, o["seq_len"]) // unit),
                              label="longer units")
    r1 = trainmem.estimate(name, **o)
    r2 = trainmem.estimate(name, **dict(o, seq_len=longer))
    assert r2.peak_allocated >= r1.peak_allocated


def same_side_of_window(m, seq: int) -> int:
    """The longest sequence on ``seq``'s side of the model's sliding window (``max_seq`` without
    one). Crossing it really can lower the peak: below the window transformers passes SDPA no mask
    and ``enable_gqa``, which PyTorch 2.13's memory-efficient kernel refuses, so an fp32 GQA model
    (Phi-3-medium, window 2047) runs the math kernel and saves its (b, h, s, s) fp32 scores; above it
    the mask is real, K/V are repeated and the efficient kernel runs (found by this test: 1646 tokens
    178 GB, 2132 tokens 157 GB at batch 16 over 10 stages)."""
    window = sliding_window(m)
    return min(max_seq(m), window - 1) if window and seq < window else max_seq(m)


@FAST
@given(setups())
def test_higher_zero_stage_never_raises_model_states(case):
    name, m, o = case
    o = dict(o, distributed_optimizer=False)  # DeepSpeed's stages; Megatron's optimizer does not take them
    if o["optimizer"] in TORCHAO_OPTIMIZERS:
        o["optimizer"] = "adamw-8bit"  # torchao's optimizer is not modelled under ZeRO (refused)
    if o["recompute"] == "op":
        o["recompute"] = "full"  # refused with ZeRO-3; model states do not depend on it
    by_stage = {z: stage_states(m, TrainingSpec(**dict(o, zero=z))) for z in range(4)}
    for lo in range(4):
        for hi in range(lo + 1, 4):
            for s in ("first", "last"):
                if lo == 0 and o["precision"] in ("bf16", "fp16") and not o["distributed_optimizer"]:
                    # Not a ZeRO effect but a recipe change: pure-half training without ZeRO keeps
                    # the optimizer states in the half dtype and no master copy (torch.optim on bf16
                    # parameters), while DeepSpeed's ZeRO-1/2/3 with bf16/fp16 keeps an fp32 master
                    # copy and fp32 states (sharded /dp). With a small DP group that costs more.
                    # (LoRA adapters take the base weights' dtype, as peft casts them, so the same
                    # holds for them.)
                    assert model_states(m, TrainingSpec(**dict(o, zero=0)), s).master == 0
                    assert model_states(m, TrainingSpec(**dict(o, zero=hi)), s).master > 0
                    continue
                clone = model_states(m, TrainingSpec(**dict(o, zero=hi)), s).master if lo == 0 and \
                    TrainingSpec(**dict(o, zero=hi)).ds_fp32_clone else 0
                # DeepSpeed's ZeRO on fp32 weights (fp32, or autocast's fp32 parameters) clones the rank's
                # partition for its optimizer (stage_1_and_2.py ``clone().float()``), which plain training
                # does not: at a small DP group that clone outweighs what the stage shards (dp 1: a whole
                # fp32 copy more). Every other state never grows with the stage.
                # DeepSpeed ZeRO-3 keeps the master and each optimizer state as one flat tensor
                # (states.flat_zero): one allocation rounded up by the allocator (< 2 MiB), where the
                # per-tensor count rounds each tensor by at most 512 B
                flat = 2 * 2 ** 20 * 3 if flat_zero(TrainingSpec(**dict(o, zero=hi))) else 0
                assert by_stage[hi][s] - clone - flat <= by_stage[lo][s], (lo, hi, s)


@FAST
@given(setups())
def test_larger_tp_never_raises_model_states(case):
    """(Not for torchao's low-bit AdamW: it quantizes a state only when the block size divides the tensor,
    ``torchao_optim.quantized``, so a TP shard that stops being a whole number of blocks keeps fp32 states:
    bert-base-uncased, adamw-torchao-8bit, tp 4 holds more than tp 3.)"""
    name, m, o = case
    if o["optimizer"] in TORCHAO_OPTIMIZERS:
        return
    sizes = [tp for tp in tp_choices(m) if not (o["sequence_parallel"] and o["seq_len"] % tp)]
    values = []
    for tp in sizes:
        opts = dict(o, tp=tp, sequence_parallel=o["sequence_parallel"] and tp > 1)
        if tp > 1 and opts["recompute"] == "op":
            opts["recompute"] = "full"  # op is modelled on one TP rank; model states do not depend on it
        values.append(stage_states(m, TrainingSpec(**opts)))
    for a, b in zip(values, values[1:]):
        assert b["first"] <= a["first"] and b["last"] <= a["last"], (sizes, values)


@FAST
@given(setups())
def test_larger_pp_never_raises_model_states(case):
    name, m, o = case
    sizes = pp_choices(m)
    values = [stage_states(m, TrainingSpec(**dict(o, pp=pp))) for pp in sizes]
    for a, b in zip(values, values[1:]):
        assert b["first"] <= a["first"] and b["last"] <= a["last"], (sizes, values)


@FAST
@given(setups())
def test_recompute_never_raises_activations(case):
    """full <= selective <= none and full <= op <= none, compared at the end of forward, stage by stage.

    Only activations differ between the three setups at that moment (model states, inputs,
    workspace and logits do not depend on recomputation), so the allocated memory at the end of
    forward orders exactly as the activations do. Stage by stage, because with PP > 1 the public
    report may show a different stage for each setup.
    """
    name, m, o = case
    per_mode = {}
    per_layer = {}
    modes = [r for r in RECOMPUTE if r != "op" or op_applies(m, o)]
    for mode in modes:
        t = TrainingSpec(**dict(o, recompute=mode))
        reps = stage_reports(m, t)
        per_mode[mode] = [forward_allocated(r) for r in reps]
        per_layer[mode] = [r.extra["activations_per_layer"] for r in reps]
    for i in range(len(per_mode["none"])):
        for step in range(len(per_mode["none"][i])):
            full, sel, none = (per_mode[k][i][step] for k in ("full", "selective", "none"))
            assert full <= sel <= none, (i, step, full, sel, none)
            if "op" in per_mode:  # torchtitan's per-op policy keeps the input and some op outputs
                assert full <= per_mode["op"][i][step] <= none
        assert per_layer["full"][i] <= per_layer["selective"][i] <= per_layer["none"][i]


@FAST
@given(setups())
def test_states_quantity_is_what_the_report_shows(case):
    """The model-states measure above is the report's: its components of those categories (the
    persistent ones, on the reported stage) come from the same ``model_states`` value."""
    name, m, o = case
    r = trainmem.estimate(name, **o)
    t = r.training
    stage = r.extra.get("pipeline_stage") or "first"
    s = model_states(m, t, stage)
    cats = r.by_category()
    assert cats.get("parameters", 0) == s.weights
    assert cats.get("master_weights", 0) == s.master
    # gradients and optimizer states are listed as alive at the peak: never more than the full amounts
    # (DeepSpeed ZeRO-2's gradient buffer holds the whole parameters that overlap the rank's partition,
    # quantities.zero_partition.deepspeed_partition_grads; under accumulation the earlier micro-batches' are kept
    # beside it, ``all_grad_tensors``: tests/test_trace_deepspeed.py, against DeepSpeed's engine)
    from trainmem.estimate.quantities.zero_partition import deepspeed_partition_grads
    held = deepspeed_partition_grads(m, t, s)
    earlier = held if (t.zero == 2 and t.grad_accum > 1) else 0
    assert cats.get("gradients", 0) <= max(s.grads, held) + earlier
    assert cats.get("optimizer_states", 0) <= s.optimizer + s.step_tensors


# ----- a few fixed cases the random search may not draw -------------------------------------------
@pytest.mark.parametrize("name", ["mixtral-8x7b", "llama-3.1-405b", "xlm-roberta-xl", "nanogpt-124m"])
def test_large_and_unusual_models_keep_the_invariants(name):
    m = model(name)
    base = dict(seq_len=min(1024, max_seq(m)), batch_size=2)
    r = trainmem.estimate(name, **base)
    assert sum(c.bytes for c in r.components) == r.peak_allocated
    assert r.peak_allocated == max(p.peak for p in r.phases)
    assert trainmem.estimate(name, **dict(base, batch_size=4)).peak_allocated >= r.peak_allocated
    tps = tp_choices(m)
    states = [stage_states(m, TrainingSpec(**dict(base, tp=tp))) for tp in tps]
    assert all(b["first"] <= a["first"] for a, b in zip(states, states[1:]))
