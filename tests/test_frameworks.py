"""Framework presets (``--framework``, ``spec.frameworks``): every preset resolves and estimates;
explicit options override it; unknown names and versions are one-line errors; the header names the
preset; and each preset changes the estimate the way its mechanism says (nanoGPT and Accelerate
hold the output, torchtune's chunked loss, torchtitan's FSDP mixed precision and layer-wise
recompute, Lightning's late zero_grad, DeepSpeed's and Megatron's fp32 master copy, the HF
Trainer's version rules). docs/frameworks.md carries ``markdown_table()``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainmem
from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.plan import fit
from trainmem.render.table import render_report
from trainmem.spec.frameworks import (COLUMNS, FRAMEWORKS, PRESETS, REPOS, get_preset, markdown_table,
                                      preset_options)
from trainmem.spec.resolve import resolve, resolve_setup
from trainmem.spec.training import TrainingSpec

MODEL = "llama-3.2-1b"
SMALL = dict(batch_size=2, seq_len=512)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "frameworks.md"


def est(framework=None, **options):
    return trainmem.estimate(MODEL, framework=framework, **{**SMALL, **options})


# ----- every preset ------------------------------------------------------------------------------------
def test_the_issue_lists_nine_frameworks():
    assert FRAMEWORKS == ("plain", "hf-trainer", "trl", "accelerate", "torchtune", "torchtitan", "lightning", "litgpt", "nanogpt",
                          "deepspeed", "megatron", "unsloth")


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_each_preset_resolves_and_estimates(name):
    r = resolve(MODEL, framework=name, **SMALL)
    t = r.training
    assert t.extra["framework"] == name and t.extra["framework_version"] is None
    for k, v in preset_options(name, model=r.model).items():
        assert getattr(t, k) == (SMALL[k] if k in SMALL else v), k  # the options given win (trl's seq_len)
    report = trainmem.estimate(r)
    assert report.peak_allocated > 0 and report.training is t


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_each_preset_cites_every_option(name):
    p = PRESETS[name]
    assert set(COLUMNS) <= set(p.cells)
    for option, cell in p.cells.items():
        assert cell.value is not None or cell.shown, (name, option)
        if cell.value is not None:
            assert cell.sources, (name, option)  # a value the preset sets has its source lines
        for s in cell.sources:
            assert s.repo in REPOS and s.lines.replace("-", "").isdigit(), (name, option, s)
            assert s.url.startswith("https://github.com/") and f"#L{s.lines.split('-')[0]}" in s.url
    for rule in p.since:
        assert rule.source.repo in REPOS and rule.option in TrainingSpec.__dataclass_fields__


def test_plain_is_trainmems_defaults():
    assert preset_options("plain") == {}
    assert est("plain").peak_allocated == est().peak_allocated


def test_docs_table_is_the_presets_table():
    assert markdown_table() in DOCS.read_text(encoding="utf-8"), \
        "docs/frameworks.md is out of date: paste spec.frameworks.markdown_table() into it"


# ----- explicit options win -------------------------------------------------------------------------------
def test_explicit_options_override_the_preset():
    t = resolve(MODEL, framework="nanogpt", hold_output="loss", precision="fp32", optimizer_impl="foreach").training
    assert (t.hold_output, t.precision, t.optimizer_impl, t.loss) == ("loss", "fp32", "foreach", "half")
    assert t.extra["framework_given"] == {"hold_output": "loss", "precision": "fp32", "optimizer_impl": "foreach"}


def test_none_means_not_given():
    assert resolve(MODEL, framework="nanogpt", hold_output=None, dropout=None).training.hold_output == "step"


@pytest.mark.parametrize("framework, given, expect", [
    ("torchtune", dict(loss="upcast"), dict(loss="upcast", loss_chunks=1)),
    ("torchtune", dict(loss_chunks=4), dict(loss="chunked", loss_chunks=4)),
    ("torchtitan", dict(recompute="none"), dict(recompute="none", recompute_every=1)),
    ("torchtitan", dict(recompute_every=4), dict(recompute="none", recompute_every=4)),
    ("nanogpt", dict(keep_logits=True), dict(hold_output="step")),
    ("nanogpt", dict(keep_logits=False), dict(hold_output="step")),
    ("torchtitan", dict(dp=8, zero=2), dict(zero=2, fsdp=None)),
])
def test_giving_one_of_a_linked_pair_drops_the_presets_other(framework, given, expect):
    if given == dict(recompute_every=4):  # --recompute-every needs --recompute full: still an error
        with pytest.raises(TrainmemError, match="recompute-every"):
            resolve(MODEL, framework=framework, **given)
        return
    t = resolve(MODEL, framework=framework, **given).training
    assert {k: getattr(t, k) for k in expect} == expect


def test_a_training_spec_beside_the_framework_is_the_base():
    t = resolve(MODEL, framework="torchtune", training=TrainingSpec(batch_size=3, seq_len=256, precision="fp32"),
                attention="eager").training
    assert (t.batch_size, t.seq_len, t.precision, t.loss, t.attention) == (3, 256, "bf16", "chunked", "eager")


def test_replace_applies_the_preset_again():
    r = resolve(MODEL, framework="torchtitan", batch_size=2)
    assert (r.training.precision, r.training.fsdp) == ("bf16-amp", None)
    wide = r.replace(dp=8)
    assert (wide.training.precision, wide.training.fsdp, wide.training.batch_size) == ("bf16-mp", "full", 2)
    assert wide.training.extra["framework"] == "torchtitan"
    assert r.replace(dp=8).replace(dp=None).training == r.training
    again = resolve(wide, seq_len=1024)
    assert (again.training.fsdp, again.training.seq_len) == ("full", 1024)
    assert resolve(wide).training is wide.training


def test_fit_and_a_factory_take_the_framework():
    f = fit(MODEL, gpu="h100", framework="torchtune", seq_len=1024)
    assert f.fits and f.report.training.extra["framework"] == "torchtune"
    t, _, _ = resolve_setup(framework="nanogpt")
    assert (t.hold_output, t.loss, t.seq_len) == ("step", "half", 2048)


# ----- one-line errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, words", [
    (dict(framework="torchtitn"), ["--framework 'torchtitn'", "did you mean torchtitan?"]),
    (dict(framework="hf-trainer", framework_version="3.0"), ["--framework-version 3.0", "4.31 to 5.23.0"]),
    (dict(framework="hf-trainer", framework_version="6.1"), ["--framework-version 6.1"]),
    (dict(framework="hf-trainer", framework_version="latest"), ["'latest' is not a version"]),
    (dict(framework="nanogpt", framework_version="1.0"), ["no version-dependent defaults"]),
    (dict(framework_version="4.45"), ["--framework-version needs --framework"]),
    (dict(framework="torchtitan", precision="bf16-mp"), ["bf16-mp"]),  # one GPU: no FSDP to run it
])
def test_unknown_names_and_versions_are_one_line_errors(options, words):
    with pytest.raises(TrainmemError) as e:
        resolve(MODEL, **options)
    text = str(e.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_names_are_case_insensitive():
    assert get_preset(" TorchTune ").name == "torchtune"


# ----- the header and the warnings ------------------------------------------------------------------------
def test_the_header_names_the_preset_first():
    def header(r):  # the setup line, joined where it wraps at 100 columns
        lines = render_report(r).splitlines()
        return " ".join(ln.strip() for ln in lines[1:lines.index("")])

    line = header(est("torchtune"))
    assert line.startswith(f"{MODEL} (1.24B params) · framework torchtune · bf16 ·"), line
    assert "loss=chunked" in line and "loss-chunks=8" in line and "optimizer-impl=fused" in line
    line = header(est("hf-trainer", framework_version="4.45"))
    assert "· framework hf-trainer 4.45 · fp32 ·" in line and "optimizer-impl=foreach" in line
    assert "framework" not in header(est())


@pytest.mark.parametrize("framework, options, words", [
    ("nanogpt", dict(dp=4, fsdp="full"), "nanoGPT's train.py runs one GPU or DDP"),
    ("torchtitan", dict(dp=8, zero=1), "is DeepSpeed's ZeRO"),
    ("deepspeed", dict(dp=8, fsdp="full"), "DeepSpeed shards with --zero"),
    ("megatron", dict(dp=8, zero=1), "Megatron-LM does not run it"),   # (its bf16 main gradients are counted)
    ("lightning", dict(distributed_optimizer=True), "Megatron's"),
])
def test_setups_a_framework_does_not_run_are_named(framework, options, words):
    warnings = resolve(MODEL, framework=framework, **options).training.extra["framework_warnings"]
    assert len(warnings) == 1 and words in warnings[0] and "\n" not in warnings[0], warnings


def test_the_presets_own_setups_have_no_warnings():
    for name in FRAMEWORKS:
        if name != "litgpt":
            assert resolve(MODEL, framework=name).training.extra["framework_warnings"] == (), name
    # litgpt's GPT unties a tied head (MODEL ties it): one line says so; an untied model has none
    tied = resolve(MODEL, framework="litgpt").training.extra["framework_warnings"]
    assert len(tied) == 1 and "no weight tying" in tied[0]
    assert resolve("llama-3.1-8b", framework="litgpt").training.extra["framework_warnings"] == ()
    assert resolve(MODEL, framework="deepspeed", precision="bf16", zero=3, dp=8).training.extra[
        "framework_warnings"] == ()
    # a config without a dtype: transformers 5 loads whatever the weights are, unknown here
    assert "names no dtype" in resolve("gpt2", framework="hf-trainer").training.extra["framework_warnings"][0]


# ----- each preset's mechanism ----------------------------------------------------------------------------
def test_nanogpt_holds_the_output_through_the_step():
    same = dict(precision="bf16-amp", optimizer_impl="fused", loss="half", dropout=False)
    nano, hf = est("nanogpt", **same), est("hf-trainer", **same)
    assert nano.training.hold_output == "step" and hf.training.hold_output == "loss"
    assert nano.peak_allocated >= hf.peak_allocated
    assert nano.phase("optimizer_step", 2).peak > hf.phase("optimizer_step", 2).peak  # the logits are still there


def test_accelerate_holds_the_output_too():
    acc, hf = est("accelerate"), est("hf-trainer")
    assert acc.training.precision == hf.training.precision == "bf16"  # the bf16 checkpoint, no autocast
    assert acc.peak_allocated >= hf.peak_allocated
    assert acc.phase("optimizer_step", 2).peak > hf.phase("optimizer_step", 2).peak


def test_torchtunes_chunked_loss_lowers_the_backward_peak():
    tune = est("torchtune", batch_size=4, seq_len=2048)
    upcast = est("torchtune", batch_size=4, seq_len=2048, loss="upcast")
    assert tune.training.loss_chunks == 8 and upcast.training.loss_chunks == 1
    assert tune.phase("backward", 2).peak < upcast.phase("backward", 2).peak
    assert tune.training.precision == "bf16"
    assert tune.component("parameters") == pytest.approx(2 * tune.model.num_params, rel=0.001)  # pure bf16


def test_torchtitan_shards_with_fsdp_mixed_precision_and_no_autocast_copies():
    one = resolve(MODEL, framework="torchtitan").training
    assert (one.precision, one.fsdp, one.recompute, one.recompute_every) == ("bf16-amp", None, "full", 2)
    big = dict(batch_size=4, seq_len=2048, recompute="none", dp=8)
    mp, amp = est("torchtitan", **big), est("torchtitan", **big, precision="bf16-amp")
    assert (mp.training.precision, mp.training.fsdp) == ("bf16-mp", "full")
    assert not [c for c in mp.components if "autocast" in c.name]
    assert mp.by_category()["activations"] < amp.by_category()["activations"]
    assert resolve(MODEL, framework="torchtitan", dp=4, pp=2).training.fsdp == "grad-op"
    assert resolve(MODEL, framework="torchtitan", tp=2).training.precision == "fp32"


def test_torchtitans_every_second_layer_recompute_sits_between_none_and_full():
    peaks = [est("torchtitan", batch_size=4, seq_len=2048, **o).peak_allocated
             for o in (dict(recompute="none"), {}, dict(recompute="full", recompute_every=1))]
    assert peaks[0] > peaks[1] > peaks[2]


def test_lightning_keeps_the_last_steps_gradients_through_the_forward():
    light, late = est("lightning"), est("lightning", zero_grad="none")
    assert light.training.precision == "fp32" and light.training.zero_grad == "zeros"
    grads = light.model.num_params * 4
    assert light.phase("forward", 2).peak - late.phase("forward", 2).peak == pytest.approx(grads, rel=0.01)


def test_deepspeed_and_megatron_keep_an_fp32_master_copy_of_half_weights():
    for name in ("deepspeed", "megatron"):
        master, none = est(name, precision="bf16"), est(name, precision="bf16", master_weights="none")
        assert master.training.master_weights == "fp32" and master.training.fp32_master
        assert master.peak_allocated - none.peak_allocated >= 4 * master.model.num_params
        assert est(name).training.precision == "fp32" and est(name).training.master_weights is None
    assert est("megatron").training.zero_grad == "zeros"


def test_hf_trainer_version_rules():
    opts = {v: preset_options("hf-trainer", v, model=resolve(MODEL).model)
            for v in ("4.31", "4.32", "4.53", "4.54", "5.0", "5.23")}
    assert [opts[v]["optimizer_impl"] for v in opts] == ["for-loop", "foreach", "foreach", "fused", "fused", "fused"]
    assert [opts[v]["precision"] for v in opts] == ["fp32"] * 4 + ["bf16"] * 2
    assert preset_options("hf-trainer", model=resolve(MODEL).model) == opts["5.23"]
    old, new = est("hf-trainer", framework_version="4.53"), est("hf-trainer", framework_version="4.54")
    assert new.phase("optimizer_step", 2).peak < old.phase("optimizer_step", 2).peak  # fused: no temporaries
    v5 = est("hf-trainer")
    assert v5.component("parameters") * 2 == pytest.approx(new.component("parameters"), rel=0.001)  # bf16, not fp32


# ----- the command line -----------------------------------------------------------------------------------
def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_flags_override_the_preset(capsys):
    code, out, err = run_cli(capsys, "estimate", MODEL, "--framework", "nanogpt", "--hold-output", "loss",
                             "--seq-len", "512", "--json")
    assert code == 0, err
    t = json.loads(out)["training"]
    assert (t["hold_output"], t["loss"], t["optimizer_impl"], t["dropout"]) == ("loss", "half", "fused", False)
    code, out, err = run_cli(capsys, "estimate", MODEL, "--framework", "torchtitan", "--precision", "bf16-amp",
                             "--dp", "8", "--recompute", "none", "--seq-len", "512")
    assert code == 0, err
    assert "framework torchtitan · bf16-amp" in out and "fsdp=full" in out and "recompute" not in out


def test_cli_unknown_framework_is_one_line(capsys):
    code, out, err = run_cli(capsys, "estimate", MODEL, "--framework", "megatorn")
    assert code == 2 and out == "" and err.count("\n") == 1 and "did you mean megatron?" in err


def test_cli_without_a_framework_keeps_the_defaults(capsys):
    code, out, err = run_cli(capsys, "estimate", MODEL, "--json")
    assert code == 0 and json.loads(out)["training"] == TrainingSpec(seq_len=2048).to_dict()


def test_hf_trainer_qlora_runs_the_kbit_prepared_model():
    """peft's prepare_model_for_kbit_training casts what is not 4-bit to fp32 and the Trainer
    autocasts: the preset's QLoRA is bf16-amp; an explicit --precision bf16 is kept and warned."""
    import trainmem
    r = trainmem.estimate("llama-3.1-8b", framework="hf-trainer", quantize="nf4", lora_rank=16, seq_len=1024)
    assert r.training.precision == "bf16-amp"
    r = trainmem.estimate("llama-3.1-8b", framework="hf-trainer", quantize="nf4", lora_rank=16, seq_len=1024,
                          precision="bf16")
    assert r.training.precision == "bf16"
    assert any("prepare_model_for_kbit_training" in w for w in r.warnings)


# ----- litgpt ---------------------------------------------------------------------------------------------
#: what a litgpt user gives on the command line (later_seq_len: their data's later micro-batches); the
#: rest is the preset's
LITGPT_GIVEN = ("batch_size", "seq_len", "later_seq_len", "grad_accum", "lora_rank", "lora_targets", "gpu")


def _litgpt_fixtures():
    from trainmem.validate import load_fixtures
    return [fx for fx in load_fixtures() if fx.get("framework") == "litgpt" and fx["setup"].get("lora_rank")
            and fx["setup"].get("dp", 1) == 1 and not fx["setup"].get("quantize")
            and fx["setup"].get("torch_version") is None]  # the Sept. 2023 Falcon tutorial: older attention call


@pytest.mark.parametrize("fx", _litgpt_fixtures(), ids=lambda fx: fx["name"])
def test_litgpt_preset_is_the_published_runs_mapping(fx):
    """The single-GPU LoRA runs of litgpt's config hub and lit-gpt's resource tables were mapped by hand,
    option by option, from the scripts' source (each fixture's setup_note). --framework litgpt with only
    what the command line gives (and bf16-true, the configs' precision) makes the same estimate."""
    s = fx["setup"]
    opts = {"set": fx["overrides"]} if fx.get("overrides") else {}
    mine = {k: v for k, v in s.items() if k in LITGPT_GIVEN}
    assert s["precision"] == "bf16"
    hand = trainmem.estimate(fx["model"], **s, **opts)
    preset = trainmem.estimate(fx["model"], framework="litgpt", precision="bf16-true", **mine, **opts)
    assert preset.peak_allocated == hand.peak_allocated


def test_litgpt_preset_follows_the_setup():
    t = resolve("llama-3.1-8b", framework="litgpt", lora_rank=8, seq_len=1000).training
    assert (t.loss, t.loss_chunks, t.cast_output, t.fused_qkv, t.use_cache, t.lora_dropout, t.attention_call) == \
        ("half", 8, True, True, False, 0.05, "repeat-kv")
    assert resolve("phi-3-mini", framework="litgpt").training.split_gate_up is True
    assert resolve("llama-3.1-8b", framework="litgpt", precision="32-true").training.cast_output is False
    dist = resolve("llama-3.1-8b", framework="litgpt", dp=4).training     # finetune/full.py: FSDP1
    assert (dist.fsdp, dist.fsdp_version, dist.recompute) == ("full", 1, "full")
    assert resolve("llama-3.1-8b", framework="litgpt", dp=4, lora_rank=8).training.fsdp_version == 2
    q = resolve("llama-3.1-8b", framework="litgpt", lora_rank=8, quantize="nf4", precision="bf16-true").training
    assert (q.optimizer, q.quantize_via) == ("paged-adamw", "fabric")
    assert not resolve("falcon-7b", framework="litgpt").training.fused_qkv  # transformers' Falcon fuses them


def test_other_names_of_a_framework():
    assert resolve(MODEL, framework="Trainer").training == resolve(MODEL, framework="hf-trainer").training
    assert resolve(MODEL, framework="lit-gpt").training.extra["framework"] == "litgpt"
    assert resolve(MODEL, framework="pytorch-lightning").training.extra["framework"] == "lightning"
    with pytest.raises(TrainmemError, match="did you mean"):
        resolve(MODEL, framework="torchtitn")


# ----- trl ------------------------------------------------------------------------------------------------
def test_trl_version_rules():
    """SFTConfig's defaults by release: bf16 from 0.19, gradient checkpointing and use_cache=False from
    0.22, the Trainer's fused AdamW with the transformers TRL requires from 0.21; max_length 1024 always."""
    model = resolve(MODEL).model
    opts = {v: preset_options("trl", v, model=model) for v in ("0.12", "0.18", "0.19", "0.21", "0.22", "1.6", "1.9")}
    assert [opts[v]["precision"] for v in opts] == ["fp32", "fp32"] + ["bf16-amp"] * 5
    assert [opts[v]["optimizer_impl"] for v in opts] == ["foreach"] * 3 + ["fused"] * 4
    assert [opts[v]["recompute"] for v in opts] == ["none"] * 4 + ["full"] * 3
    assert [opts[v].get("use_cache") for v in opts] == [None] * 4 + [False] * 3
    assert {opts[v]["seq_len"] for v in opts} == {1024}
    assert preset_options("trl", model=model) == opts["1.9"]
    old, new = est("trl", framework_version="0.21"), est("trl", framework_version="0.22")
    # gradient checkpointing: each layer keeps its input only
    assert new.extra["activations_per_layer"] * 10 < old.extra["activations_per_layer"]
    assert new.phase("forward", 1).peak < old.phase("forward", 1).peak
    assert resolve(MODEL, framework="trl").training.seq_len == 1024
    assert resolve(MODEL, framework="trl", seq_len=300).training.seq_len == 300


def test_trl_qlora_adapters_follow_the_release():
    """From 0.26 SFTTrainer casts a quantized model's trainable parameters to bf16; before, peft keeps
    the adapters fp32; 0.12-0.21 also cast the embeddings and head back to bf16 when bf16 is on
    (--half-embeddings: by default from 0.19; before, the preset's fp32 runs no autocast and no cast)."""
    q = dict(quantize="nf4", lora_rank=16)
    assert resolve("llama-3.1-8b", framework="trl", **q).training.lora_dtype == "half"
    new = resolve("llama-3.1-8b", framework="trl", framework_version="0.25", **q).training
    assert new.lora_dtype is None and not new.half_embeddings
    old = resolve("llama-3.1-8b", framework="trl", framework_version="0.20", **q).training
    assert old.precision == "bf16-amp" and old.lora_dtype is None and old.half_embeddings
    assert not any("peft_module_casting_to_bf16" in w for w in old.extra.get("framework_warnings", []))
    fp32 = resolve("llama-3.1-8b", framework="trl", framework_version="0.18", **q).training
    assert fp32.precision == "fp32" and not fp32.half_embeddings
    given = resolve("llama-3.1-8b", framework="trl", framework_version="0.20", half_embeddings=False, **q).training
    assert not given.half_embeddings
    assert any("peft_module_casting_to_bf16" in w for w in given.extra["framework_warnings"])
    assert resolve("llama-3.1-8b", framework="trl", lora_rank=16).training.lora_dtype is None  # not quantized


def test_trl_computes_its_chunked_loss_from_1_7():
    """loss_type defaults to chunked_nll from 1.7 (--loss chunked-nll); a derived architecture, which the
    estimate does not model under it, keeps the model's own loss with a warning."""
    def setup(model=MODEL, **options):
        t = resolve(model, framework="trl", **options).training
        return t.loss, any("chunked_nll" in w for w in t.extra["framework_warnings"])
    assert setup() == setup(framework_version="1.7") == ("chunked-nll", False)
    assert setup(framework_version="1.6") == (None, False) and setup(loss="upcast") == ("upcast", False)
    assert setup("gemma-2-2b") == (None, True)


#: what fms-hf-tuning's benchmark gives SFTTrainer (its TrainingArguments and model loading); the rest
#: is TRL's (9b80f3d, between 0.11 and 0.12: --framework-version 0.12)
#: (and the transformers release its requirements pin, which TRL's preset does not imply, and the FSDP1 of
#: its accelerate 0.34.2)
FMS_GIVEN = ("batch_size", "seq_len", "grad_accum", "gpu", "lora_rank", "lora_targets", "lora_dropout", "dp",
             "fsdp", "attention", "recompute", "precision", "quantize", "quantize_via", "bitsandbytes_version",
             "transformers_version", "fsdp_version")


def _fms_fixtures():
    from trainmem.validate import load_fixtures
    return [fx for fx in load_fixtures() if fx["name"].startswith("fms-acceleration PowerLM-3B")]


@pytest.mark.parametrize("fx", _fms_fixtures(), ids=lambda fx: fx["name"])
def test_trl_preset_is_the_published_runs_mapping(fx):
    """fms-acceleration's PowerLM-3B runs went through TRL's SFTTrainer; each was mapped by hand from
    the benchmark's settings (setup_note). --framework trl --framework-version 0.12 with only what the
    benchmark sets gives the same estimate."""
    s = fx["setup"]
    opts = {"set": fx["overrides"]} if fx.get("overrides") else {}
    hand = trainmem.estimate(fx["model"], **s, **opts)
    preset = trainmem.estimate(fx["model"], framework="trl", framework_version="0.12",
                               **{k: v for k, v in s.items() if k in FMS_GIVEN}, **opts)
    assert preset.peak_allocated == hand.peak_allocated


@pytest.mark.parametrize("version", [None, "0.20"])
@pytest.mark.parametrize("lora", [{}, {"lora_rank": 16}, {"lora_rank": 16, "quantize": "nf4"}],
                         ids=["full", "lora", "qlora"])
def test_trl_preset_estimate_agrees_with_trace(version, lora):
    """The preset's setup (bf16 autocast over fp32 weights, checkpointed layers from 0.22, no KV cache,
    seq 1024, the model's own loss; QLoRA's bf16 adapters from 0.26) traced as transformers runs it
    gives the estimate's peak."""
    from trainmem.trace import trace
    kw = dict(framework="trl", framework_version=version, set=["num_hidden_layers=2"], batch_size=2, **lora)
    e, t = trainmem.estimate(MODEL, **kw), trace(MODEL, **kw)
    assert e.training.recompute == ("full" if version is None else "none") and t.training.seq_len == 1024
    assert e.peak_allocated == pytest.approx(t.peak_allocated, rel=0.002)


def test_torchtitan_zero_0_is_replicated_and_plan_explores_its_layouts():
    """--zero 0 given with --dp is a replicated run (torchtitan's DDP: autocast, no FSDP policy); the
    planner, which gives every layout its zero stage and recompute, runs under the preset (the
    preset's --recompute-every 2 applies to full recompute only)."""
    t = resolve("llama-3.1-8b", framework="torchtitan", dp=8, zero=0).training
    assert (t.fsdp, t.precision) == (None, "bf16-amp")
    assert resolve("llama-3.1-8b", framework="torchtitan", dp=8).training.precision == "bf16-mp"
    from trainmem.plan import plan
    p = plan("llama-3.1-8b", gpus=16, gpu="h100", global_batch=64, seq_len=4096, framework="torchtitan")
    assert p.fitting > 0 and p.top


@pytest.mark.parametrize("framework", ["litgpt", "trl"])
def test_plan_keeps_a_presets_data_parallel_options_to_their_layouts(framework):
    """litgpt's attention call and fused q/k/v, TRL's chunked loss are modelled on one GPU and data
    parallelism: under their presets the planner keeps tp, pp (and for litgpt cp) at 1 instead of failing."""
    from trainmem.plan import plan
    p = plan("llama-3.1-8b", gpus=16, gpu="h100", global_batch=64, seq_len=4096, framework=framework)
    assert p.top and all(x.tp == 1 and x.pp == 1 for x in p.top)


def test_hf_trainer_version_without_a_release_table_warns_of_the_shifted_logits():
    """--framework-version sets --transformers-version for the models spec/tf_releases.py covers
    (tests/test_transformers_version.py); another model keeps the installed code, and the report says
    its older loss may copy the shifted logits."""
    r = resolve("phi-2", framework="hf-trainer", framework_version="4.45")
    assert r.training.transformers_version is None
    warnings = r.training.extra["framework_warnings"]
    assert any("shifted logits" in w and "\n" not in w for w in warnings), warnings
    assert resolve(MODEL, framework="hf-trainer", framework_version="4.45").training.transformers_version == "4.45"
