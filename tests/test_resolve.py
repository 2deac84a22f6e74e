"""The one input resolver (``trainmem.spec.resolve``): defaults, one-line errors that name the input,
``Resolved.replace`` re-validation, estimate of a Resolved == estimate of the same options, and
fit / sweep resolving the model once."""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate.api import estimate
from trainmem.plan import fit, sweep
from trainmem.plan._common import Evaluator
from trainmem.spec import Hardware, TrainingSpec, get_gpu
from trainmem.spec import hardware as hardware_module
from trainmem.spec.resolve import Resolved, resolve, resolve_setup
from trainmem.units import GiB, MiB

RESOLVE = sys.modules["trainmem.spec.resolve"]


# ----- defaults -------------------------------------------------------------------------------------
def test_defaults():
    r = resolve("llama-3.2-1b")
    assert isinstance(r, Resolved) and r.model.name == "llama-3.2-1b"
    assert r.training == TrainingSpec(seq_len=2048)
    assert (r.hardware, r.method, r.max_fraction, r.limit) == (None, "trainmem", 1.0, None)


@pytest.mark.parametrize("model, seq", [("gpt2", 1024), ("bert-base-uncased", 512), ("llama-3.2-1b", 2048)])
def test_seq_len_defaults_to_the_models(model, seq):
    assert resolve(model).training.seq_len == seq
    assert resolve(model, seq_len=None).training.seq_len == seq
    assert resolve(model, seq_len=128).training.seq_len == 128


def test_hardware_is_built_once_from_the_options():
    assert resolve("gpt2", gpu="h100").hardware == get_gpu("h100")
    custom = resolve("gpt2", gpu_memory="24GiB", context_memory="1GiB").hardware
    assert (custom.name, custom.capacity, custom.context) == ("custom", 24 * GiB, GiB)
    hw = get_gpu("a10g")
    assert resolve("gpt2", gpu=hw).hardware is hw and resolve("gpt2", hardware=hw).hardware is hw
    assert resolve("gpt2", gpu=hw, context_memory="2GiB").hardware == dataclasses.replace(hw, context=2 * GiB)
    r = resolve("gpt2", gpu="h100", max_fraction=0.9)
    assert r.limit == int(0.9 * r.hardware.capacity)


def test_options_are_the_api_names():
    r = resolve("qwen2.5-0.5b", batch_size=4, seq_len=512, lora_rank=16, lora_targets="q_proj, v_proj",
                optimizer_impl="fused", method="eleuther", set=["num_hidden_layers=2"])
    assert r.training.lora_targets == ("q_proj", "v_proj") and r.training.batch_size == 4
    assert r.model.num_layers == 2 and r.method == "eleuther"
    assert resolve("qwen2.5-0.5b", overrides=["num_hidden_layers=2"]).model == r.model
    assert resolve("qwen2.5-0.5b", lora_rank=8, lora_targets=("q_proj",)).training.lora_targets == ("q_proj",)


def test_training_and_resolved_take_options_on_top():
    t = TrainingSpec(batch_size=2, seq_len=256, precision="fp32", attention="eager")
    assert resolve("gpt2", training=t).training is t
    assert resolve("gpt2", training=t, batch_size=8).training == dataclasses.replace(t, batch_size=8)
    base = resolve("gpt2", gpu="t4", max_fraction=0.8, batch_size=2, seq_len=512)
    again = resolve(base, seq_len=1024)
    assert again.model is base.model and again.hardware is base.hardware and again.max_fraction == 0.8
    assert again.training == dataclasses.replace(base.training, seq_len=1024)
    assert resolve(base, gpu="h100").hardware == get_gpu("h100")
    assert resolve(base, set=["n_layer=2"]).model.num_layers == 2 and resolve(base).model is base.model


def test_setup_without_a_model():
    t, hw, fraction = resolve_setup(batch_size=3, gpu="h100", max_fraction=0.5)
    assert (t.batch_size, t.seq_len, hw, fraction) == (3, 2048, get_gpu("h100"), 0.5)
    with pytest.raises(TrainmemError, match="overrides"):
        resolve_setup(set=["n_layer=2"])


# ----- errors: one line, naming the input -------------------------------------------------------------
@pytest.mark.parametrize("model, options, names", [
    ("gpt2", dict(batch_sise=2), ["batch_sise", "batch_size"]),
    ("gpt2", dict(bogus=1, other=2), ["bogus", "other"]),
    ("gpt2", dict(precision="fp8"), ["--precision", "fp8"]),
    ("gpt2", dict(batch_size=0), ["--batch-size"]),
    ("gpt2", dict(max_fraction=0), ["--max-fraction", "0"]),
    ("gpt2", dict(max_fraction=1.5, gpu="h100"), ["--max-fraction", "1.5"]),
    ("gpt2", dict(context_memory="1GiB"), ["--context-memory"]),
    ("gpt2", dict(gpu="no-such-gpu"), ["no-such-gpu"]),
    ("gpt2", dict(gpu_memory="lots"), ["lots"]),
    ("gpt2", dict(gpu="h100", hardware=get_gpu("t4")), ["hardware"]),
    ("gpt2", dict(tp=5), ["--tp 5"]),
    ("gpt2", dict(seq_len=4096), ["--seq-len 4096", "1024"]),
    ("gpt2", dict(set=["n_layer=2"], overrides=["n_layer=3"]), ["set=", "overrides="]),
    ("gpt2", dict(training="big"), ["training="]),
    ("no-such-model", {}, ["no-such-model"]),
    (42, {}, ["model", "int"]),
])
def test_errors_are_one_line_and_name_the_input(model, options, names):
    with pytest.raises(TrainmemError) as e:
        resolve(model, **options)
    msg = str(e.value)
    assert "\n" not in msg
    for name in names:
        assert name in msg


def test_estimate_raises_the_resolvers_errors():
    with pytest.raises(TrainmemError, match="unknown option"):
        trainmem.estimate("gpt2", batch_sise=2)
    with pytest.raises(TrainmemError, match="--max-fraction"):
        trainmem.estimate("gpt2", gpu="h100", max_fraction=2)


# ----- Resolved.replace ---------------------------------------------------------------------------------
def test_replace_changes_training_only():
    r = resolve("llama-3.2-1b", gpu="h100", max_fraction=0.9, method="korthikanti", seq_len=1024)
    r2 = r.replace(batch_size=4, recompute="full")
    assert r2.model is r.model and r2.hardware is r.hardware
    assert (r2.method, r2.max_fraction) == ("korthikanti", 0.9)
    assert r2.training == dataclasses.replace(r.training, batch_size=4, recompute="full")
    assert r.training.batch_size == 1 and r.replace() is r
    assert r.replace(seq_len=None).training.seq_len == 2048                 # None: the default
    assert r.replace(optimizer_impl="fused").replace(optimizer_impl=None).training.optimizer_impl is None


@pytest.mark.parametrize("changes, text", [
    (dict(batch_size=0), "--batch-size"),           # TrainingSpec.__post_init__
    (dict(precision="fp8"), "--precision"),
    (dict(attention="flash", precision="fp32"), "--attention flash"),
    (dict(tp=5), "--tp 5"),                         # checked against the model again
    (dict(seq_len=100, cp=8), "--cp 8"),
    (dict(gpu="h100"), "gpu"),                      # replace varies the training setup only
])
def test_replace_revalidates(changes, text):
    r = resolve("llama-3.2-1b", gpu="h100")
    with pytest.raises(TrainmemError, match=text) as e:
        r.replace(**changes)
    assert "\n" not in str(e.value)


def test_a_resolved_is_checked_when_built():
    r = resolve("gpt2")
    with pytest.raises(TrainmemError, match="learned positions"):
        Resolved(r.model, TrainingSpec(seq_len=2048), None)
    with pytest.raises(TrainmemError, match="--max-fraction"):
        Resolved(r.model, r.training, None, max_fraction=0)


# ----- estimate of a Resolved == estimate of the same options -------------------------------------------
SETUPS = [
    ("gpt2", dict(seq_len=1024)),
    ("llama-3.1-8b", dict(gpu="h100")),
    ("llama-3.1-8b", dict(batch_size=2, seq_len=4096, precision="bf16", optimizer="adamw-8bit", zero=2, dp=8,
                          tp=2, pp=2, recompute="selective", attention="flash", gpu="a100-80gb", max_fraction=0.9,
                          context_memory="1GiB")),
    ("qwen2.5-0.5b", dict(seq_len=512, batch_size=4, lora_rank=16, lora_targets="q_proj,v_proj",
                          optimizer_impl="fused", gpu_memory="24GiB")),
    ("bert-base-uncased", dict(seq_len=128, batch_size=32, precision="fp32", attention="eager",
                               optimizer="sgd-momentum", optimizer_in_backward=True, set=["num_hidden_layers=6"],
                               gpu="a10g")),
    ("gpt2-medium", dict(seq_len=1024, method="korthikanti", tp=4, sequence_parallel=True, gpu="v100-32gb")),
]


def _json(report) -> str:
    return json.dumps(report.to_dict(), sort_keys=True)


@pytest.mark.parametrize("model, options", SETUPS)
def test_estimate_of_resolved_equals_estimate_of_options(model, options):
    r = resolve(model, **options)
    assert _json(estimate(r)) == _json(estimate(model, **options))
    assert _json(trainmem.estimate(r)) == _json(trainmem.estimate(model, **options))


def test_estimate_of_resolved_with_options_on_top():
    r = resolve("llama-3.2-1b", gpu="h100", seq_len=1024)
    assert _json(estimate(r, batch_size=4)) == _json(estimate("llama-3.2-1b", gpu="h100", seq_len=1024,
                                                             batch_size=4))


# ----- fit, sweep and the Evaluator resolve the model once ----------------------------------------------
@pytest.fixture
def count_models(monkeypatch):
    calls = []
    real = RESOLVE.resolve_model

    def counting(model, overrides=None):
        calls.append(model)
        return real(model, overrides)

    monkeypatch.setattr(RESOLVE, "resolve_model", counting)
    return calls


def test_fit_resolves_the_model_once(count_models):
    r = fit("llama-3.2-1b", gpu="h100", seq_len=2048, recompute="selective")
    assert r.fits and r.evaluations > 5
    assert len(count_models) == 1
    count_models.clear()
    r = fit("llama-3.2-1b", gpu="h100", batch_size=1)              # the sequence search too
    assert r.fits and r.evaluations > 5 and len(count_models) == 1


def test_fit_of_a_resolved_resolves_nothing(count_models):
    base = resolve("gpt2", gpu="t4")
    count_models.clear()
    r = fit(base, seq_len=512)
    assert r.fits and count_models == []
    assert r.batch_size == fit("gpt2", gpu="t4", seq_len=512).batch_size


def test_sweep_and_evaluator_resolve_once(count_models):
    res = sweep("gpt2", "1,2,4", "256,512", gpu="t4")
    assert len(res.batch_sizes) * len(res.seq_lens) == 6 and len(count_models) == 1
    count_models.clear()
    ev = Evaluator("gpt2", gpu="t4", max_fraction=0.9, attention="eager")
    reports = [ev.report(batch_size=b) for b in (1, 2, 4)]
    assert len(count_models) == 1 and ev.calls == 3
    assert (ev.model.name, ev.hardware, ev.max_fraction, ev.method) == ("gpt2", get_gpu("t4"), 0.9, "trainmem")
    assert ev.options == {"attention": "eager"} and ev.limit == int(0.9 * get_gpu("t4").capacity)
    assert _json(reports[1]) == _json(estimate("gpt2", gpu="t4", max_fraction=0.9, attention="eager",
                                               batch_size=2))


# ----- public names ------------------------------------------------------------------------------------
def test_catalogue_is_public():
    cat = hardware_module.catalogue()
    assert "a10g" in cat and hardware_module._catalogue() is cat
    assert list(cat) == hardware_module.gpu_names()
    assert trainmem.resolve is resolve and trainmem.Resolved is Resolved


def test_trace_takes_the_resolvers_options():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    tiny = ["n_layer=2", "n_embd=64", "n_head=4"]
    kw = dict(batch_size=2, seq_len=64, device="cpu")
    r = trainmem.trace("gpt2", set=tiny, gpu_memory="1GiB", context_memory="100MiB", max_fraction=0.5, **kw)
    assert (r.hardware.capacity, r.hardware.context, r.max_fraction) == (GiB, 100 * MiB, 0.5)
    same = trainmem.trace("gpt2", overrides=tiny, hardware=Hardware("custom", GiB, 100 * MiB, "custom GPU"), **kw)
    assert (same.peak_allocated, same.model.num_layers) == (r.peak_allocated, 2)
    assert trainmem.trace(resolve("gpt2", set=tiny, batch_size=2, seq_len=64), device="cpu").peak_allocated \
        == r.peak_allocated


# ----- framework presets (tests/test_frameworks.py has the presets themselves) ----------------------------
def test_framework_options_go_through_the_resolver():
    r = resolve("llama-3.2-1b", framework="nanogpt", batch_size=2, gpu="h100")
    assert r.training.extra["framework"] == "nanogpt" and r.training.hold_output == "step"
    assert r.training.extra["framework_given"] == {"batch_size": 2}
    # the same option values without the preset are the same setup (extra is not compared)
    assert r.training == resolve("llama-3.2-1b", batch_size=2, hold_output="step", loss="half",
                                 optimizer_impl="fused", dropout=False).training
    # a Resolved made under a preset keeps it and the options given so far; a new framework replaces it
    again = resolve(r, seq_len=512)
    assert (again.training.hold_output, again.training.batch_size, again.training.seq_len) == ("step", 2, 512)
    other = resolve(r, framework="torchtune")
    assert (other.training.extra["framework"], other.training.loss, other.training.batch_size) == \
        ("torchtune", "chunked", 2)
    assert resolve(r, framework_version=None).training is r.training
    with pytest.raises(TrainmemError, match="unknown option"):
        resolve("gpt2", framwork="nanogpt")


def test_estimate_and_the_evaluator_take_the_framework():
    ev = Evaluator("llama-3.2-1b", framework="torchtitan", batch_size=1, seq_len=512)
    assert ev.resolved.training.recompute_every == 2
    assert ev.report(dp=8).training.precision == "bf16-mp"
    assert estimate("llama-3.2-1b", framework="torchtitan", batch_size=1, seq_len=512).training == \
        ev.resolved.training


# ----- a framework's own names of a precision or an optimizer ---------------------------------------
@pytest.mark.parametrize("name, ours", [("bf16-true", "bf16"), ("bf16-mixed", "bf16-amp"), ("16-true", "fp16"),
                                        ("16-mixed", "fp16-amp"), ("32-true", "fp32")])
def test_lightning_precision_names_are_trainmems(name, ours):
    a = estimate("llama-3.2-1b", seq_len=256, precision=name)
    b = estimate("llama-3.2-1b", seq_len=256, precision=ours)
    assert a.training.precision == ours and a.peak_allocated == b.peak_allocated
    # under a preset too: the user's name replaces the preset's precision
    assert resolve("gpt2", framework="lightning", precision=name).training.precision == ours


@pytest.mark.parametrize("optim, ours, impl", [("adamw_torch", "adamw", "foreach"), ("adamw_torch_fused", "adamw", "fused"),
                                               ("adamw_bnb_8bit", "adamw-8bit", None),
                                               ("adamw_8bit", "adamw-8bit", None),
                                               ("paged_adamw_8bit", "paged-adamw-8bit", None),
                                               ("paged_adamw_32bit", "paged-adamw", None)])
def test_hf_trainer_optim_names_are_trainmems(optim, ours, impl):
    t = resolve("gpt2", optimizer=optim).training
    assert t.optimizer == ours and t.optimizer_impl == impl
    assert resolve("gpt2", optimizer=optim, optimizer_impl=impl).training == t
    # the Trainer preset's own implementation gives way to the one the name says
    if impl:
        assert resolve("gpt2", framework="hf-trainer", optimizer=optim).training.optimizer_impl == impl


def test_an_optim_name_that_contradicts_optimizer_impl_is_refused():
    with pytest.raises(TrainmemError, match="adamw_torch_fused runs the fused implementation.*foreach"):
        resolve("gpt2", optimizer="adamw_torch_fused", optimizer_impl="foreach")


def test_names_trainmem_does_not_model_are_refused_at_the_cli():
    from trainmem.cli import main
    for args in (["--optimizer", "no_such_optim"], ["--precision", "transformer-engine"]):
        with pytest.raises(SystemExit) as e:
            main(["estimate", "gpt2", *args])
        assert e.value.code == 2
