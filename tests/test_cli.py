"""The command line: bad input is one clear line on stderr and exit status 2, never a traceback;
``--max-fraction`` turns "does not fit" into exit status 1; ``models`` and ``gpus`` list the
catalogues.

Most cases run ``trainmem.cli.main`` in-process (fast); one test runs the installed ``trainmem``
console script in a subprocess to prove the real entry point prints no traceback either.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trainmem
from trainmem.cli import main
from trainmem.spec import catalogue_names, get_gpu
from trainmem.spec.hardware import catalogue_table

ERROR_PREFIX = "trainmem: error:"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``trainmem ARGV`` in-process: (exit status, stdout, stderr).

    argparse errors leave through SystemExit (our parser's ``error``); TrainmemErrors come back as
    the return value of ``main``. The console script does ``sys.exit(main())``, so both are the
    process's exit status.
    """
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, out: str, err: str) -> str:
    assert code == 2, f"exit status {code}, stderr: {err!r}"
    assert "Traceback" not in err and "Traceback" not in out
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    assert err.endswith("\n") and err.count("\n") == 1
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert len(lines[0]) > len(ERROR_PREFIX) + 10  # says something
    assert out == ""  # no partial report on stdout
    return lines[0]


# ----- bad input ----------------------------------------------------------------------------------
# (argv after `trainmem estimate`, a fragment the message must contain: it names the bad input)
BAD_INPUT = [
    pytest.param(["no-such-model"], "unknown model 'no-such-model'", id="unknown-model"),
    pytest.param(["llama-3.1-8b", "--tp", "3"], "--tp 3 does not divide the 32 attention heads", id="tp-heads"),
    pytest.param(["qwen2.5-7b", "--tp", "7"], "the 4 key/value heads", id="tp-kv-heads"),  # 7 | 28 heads
    pytest.param(["llama-3.1-8b", "--pp", "5"], "--pp 5 does not divide the 32 layers", id="pp-layers"),
    pytest.param(["gpt2", "--seq-len", "512", "--batch-size", "0"], "--batch-size", id="batch-zero"),
    pytest.param(["gpt2", "--seq-len", "-5"], "--seq-len", id="seq-negative"),
    pytest.param(["gpt2", "--seq-len", "512", "--dp", "0"], "--dp", id="dp-zero"),
    pytest.param(["gpt2", "--seq-len", "512", "--tp", "-2"], "--tp", id="tp-negative"),
    pytest.param(["gpt2", "--seq-len", "512", "--grad-accum", "0"], "--grad-accum", id="grad-accum-zero"),
    pytest.param(["gpt2", "--seq-len", "many"], "'many' is not an integer", id="seq-not-int"),
    pytest.param(["gpt2", "--seq-len", "512", "--lora-rank", "-1"], "--lora-rank", id="lora-rank-negative"),
    pytest.param(["gpt2", "--seq-len", "512", "--precision", "fp8"], "fp8", id="precision"),
    pytest.param(["gpt2", "--seq-len", "512", "--optimizer", "foo"], "foo", id="optimizer"),
    pytest.param(["gpt2", "--seq-len", "512", "--optimizer-impl", "magic"], "magic", id="optimizer-impl"),
    pytest.param(["gpt2", "--seq-len", "512", "--recompute", "x"], "--recompute", id="recompute"),
    pytest.param(["gpt2", "--seq-len", "512", "--attention", "y"], "--attention", id="attention"),
    pytest.param(["gpt2", "--seq-len", "512", "--zero", "5"], "--zero", id="zero"),
    pytest.param(["gpt2", "--seq-len", "512", "--fsdp", "half"], "--fsdp", id="fsdp"),
    pytest.param(["gpt2", "--seq-len", "512", "--units", "parsec"], "--units", id="units"),
    pytest.param(["gpt2", "--seq-len", "512", "--method", "guess"], "--method", id="method"),
    pytest.param(["gpt2", "--seq-len", "512", "--no-such-flag"], "--no-such-flag", id="unknown-flag"),
    pytest.param(["gpt2", "--seq-len", "512", "--lora-targets", "c_attn"], "--lora-rank", id="lora-targets-no-rank"),
    pytest.param(["gpt2", "--seq-len", "512", "--lora-rank", "8", "--lora-targets", "q_proj"],
                 "--lora-targets q_proj: no such linear module in gpt2", id="lora-target-missing"),
    pytest.param(["llama-3.2-1b", "--lora-rank", "8", "--lora-targets", "q_proj,c_attn"],
                 "--lora-targets c_attn", id="lora-target-one-missing"),
    pytest.param(["gpt2", "--seq-len", "512", "--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'", id="unknown-gpu"),
    pytest.param(["gpt2", "--seq-len", "512", "--gpu", "h100", "--max-fraction", "1.5"], "--max-fraction",
                 id="max-fraction-above-1"),
    pytest.param(["gpt2", "--seq-len", "512", "--gpu", "h100", "--max-fraction", "0"], "--max-fraction",
                 id="max-fraction-zero"),
    pytest.param(["gpt2", "--seq-len", "512", "--max-fraction", "0.9"], "needs a GPU", id="max-fraction-no-gpu"),
    pytest.param(["gpt2", "--seq-len", "512", "--gpu-memory", "lots"], "'lots'", id="gpu-memory-unreadable"),
    pytest.param(["gpt2", "--seq-len", "512", "--gpu-memory", "0"], "memory must be positive", id="gpu-memory-zero"),
    pytest.param(["gpt2", "--seq-len", "512", "--gpu", "h100", "--context-memory", "100GiB"], "leaves nothing",
                 id="context-exceeds-gpu"),
    pytest.param(["gpt2", "--seq-len", "512", "--context-memory", "1GiB"], "needs a GPU", id="context-no-gpu"),
    pytest.param(["gpt2", "--seq-len", "1025"], "--seq-len 1025 exceeds the 1024", id="seq-beyond-positions"),
    pytest.param(["bert-base-uncased", "--seq-len", "513"], "512 learned positions", id="bert-seq-beyond"),
    pytest.param(["gpt2", "--seq-len", "512", "--precision", "fp32", "--attention", "flash"], "half precision",
                 id="flash-fp32"),
    pytest.param(["gpt2", "--seq-len", "512", "--optimizer-in-backward", "--grad-accum", "4"], "--grad-accum",
                 id="oib-grad-accum"),
    pytest.param(["gpt2", "--seq-len", "512", "--sequence-parallel"], "--tp > 1", id="sp-without-tp"),
    pytest.param(["gpt2", "--seq-len", "500", "--cp", "3"], "--cp 3", id="cp-seq"),
    pytest.param(["gpt2", "--seq-len", "512", "--fsdp", "full", "--zero", "2"], "both shard", id="fsdp-zero"),
    pytest.param(["gpt2", "--seq-len", "512", "--fsdp", "full", "--zero", "3"], "give one of them", id="fsdp-zero-same"),
    pytest.param(["gpt2", "--distributed-optimizer", "--zero", "1", "--dp", "8"], "Megatron", id="distopt-zero"),
    # the loop, precision and LoRA options
    pytest.param(["gpt2", "--lora-rank", "4", "--lora-dropout", "2"], "--lora-dropout must be in [0, 1)",
                 id="lora-dropout-range"),
    pytest.param(["gpt2", "--lora-dtype", "half"], "need --lora-rank", id="lora-dtype-no-rank"),
    pytest.param(["gpt2", "--master-weights", "fp32"], "--master-weights is for half weights", id="master-amp"),
    pytest.param(["gpt2", "--recompute-every", "2"], "needs --recompute full", id="recompute-every-none"),
    pytest.param(["gpt2", "--recompute", "full", "--recompute-every", "0"], "positive", id="recompute-every-0"),
    pytest.param(["gpt2", "--zero-grad", "maybe"], "invalid choice", id="zero-grad-choice"),
    pytest.param(["gpt2", "--hold-output", "forever"], "invalid choice", id="hold-output-choice"),
    pytest.param(["gpt2", "--loss", "chunked"], "--loss chunked needs --loss-chunks", id="chunked-no-chunks"),
    pytest.param(["gpt2", "--loss", "upcast", "--loss-chunks", "4"], "needs --loss chunked", id="upcast-chunks"),
    pytest.param(["gpt2", "--precision", "bf16-mp"], "bf16-mp is FSDP", id="mp-without-fsdp"),
    pytest.param(["gpt2", "--hold-output", "backward", "--keep-logits"], "contradicts", id="hold-keep"),
    pytest.param(["gpt2", "--seq-len", "512", "--set", "n_layer"], "key=value", id="set-no-value"),
    pytest.param(["gpt2", "--seq-len", "512", "--set", "n_head=7"], "not divisible", id="set-bad-heads"),
    pytest.param(["gpt2", "--seq-len", "512", "--set", "n_layer=0"], "n_layer must be positive", id="set-zero-layers"),
    pytest.param(["gpt2", "--seq-len", "512", "--set", "resid_pdrop=2"], "hidden_dropout", id="set-bad-dropout"),
    pytest.param(["gpt2", "--seq-len", "512", "--set", "_trainmem=5"], "_trainmem", id="set-bad-extra"),
    pytest.param(["gpt2", "--seq-len", "512", "--set", 'architectures=["GPT2ForSequenceClassification"]',
                  "--set", 'num_labels="two"'], "num_labels", id="set-string-num-labels"),
    pytest.param(["llama-3.2-1b", "--set", "architectures=[5]"], "architectures", id="set-bad-architectures"),
    pytest.param(["llama-3.2-1b", "--set", "model_type=[1]"], "model_type", id="set-bad-model-type"),
    pytest.param(["mixtral-8x7b", "--set", 'num_local_experts="eight"'], "num_local_experts",
                 id="set-string-experts"),
    pytest.param(["mixtral-8x7b", "--set", "num_local_experts=2.5"], "num_local_experts", id="set-fraction-experts"),
    pytest.param(["mixtral-8x7b", "--set", "num_experts_per_tok=9"], "experts_top_k", id="set-top-k-too-big"),
]


@pytest.mark.parametrize("argv, fragment", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    line = assert_one_error_line(*run_cli(capsys, "estimate", *argv))
    assert fragment in line


@pytest.fixture
def configs(tmp_path: Path) -> dict[str, Path]:
    """Malformed config files, and a model directory without one."""
    good = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 128}
    files = {
        "invalid_json": '{"model_type": "llama", "hidden_size": 64,',
        "not_an_object": "[1, 2, 3]",
        "missing_model_type": json.dumps({k: v for k, v in good.items() if k != "model_type"}),
        "string_hidden_size": json.dumps(dict(good, hidden_size="4096")),
        "float_layers": json.dumps(dict(good, num_hidden_layers=2.5)),
        "missing_vocab": json.dumps({k: v for k, v in good.items() if k != "vocab_size"}),
        "unknown_model_type": json.dumps(dict(good, model_type="no_such_arch")),
        "unknown_architecture": json.dumps(dict(good, architectures=["LlamaForTokenWrangling"])),
        "good": json.dumps(good),
    }
    out = {}
    for name, text in files.items():
        p = tmp_path / f"{name}.json"
        p.write_text(text)
        out[name] = p
    p = tmp_path / "not_utf8.json"
    p.write_bytes(b'\xff\xfe{"model_type": "llama"}')
    out["not_utf8"] = p
    (tmp_path / "empty_dir").mkdir()
    out["dir_without_config"] = tmp_path / "empty_dir"
    return out


@pytest.mark.parametrize("which, fragment", [
    ("invalid_json", "not valid JSON"),
    ("not_an_object", "expected a JSON object"),
    ("missing_model_type", "missing 'model_type'"),
    ("string_hidden_size", "hidden_size must be an integer, got '4096'"),
    ("float_layers", "num_hidden_layers must be an integer"),
    ("missing_vocab", "missing 'vocab_size'"),
    ("unknown_model_type", "unsupported model_type 'no_such_arch'"),
    ("unknown_architecture", "unsupported architecture"),
    ("not_utf8", "not UTF-8"),
    ("dir_without_config", "has no config.json"),
])
def test_malformed_config_is_one_line_and_exit_2(capsys, configs, which, fragment):
    line = assert_one_error_line(*run_cli(capsys, "estimate", str(configs[which]), "--seq-len", "64"))
    assert fragment in line
    if which != "dir_without_config":
        assert configs[which].name in line or configs[which].stem in line  # names the file


def test_good_config_file_estimates(capsys, configs):
    code, out, err = run_cli(capsys, "estimate", str(configs["good"]), "--seq-len", "64", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["peak_allocated"] > 0


def test_no_command_prints_help_and_exit_2(capsys):
    code, out, err = run_cli(capsys)
    assert code == 2
    assert "estimate" in out and "Traceback" not in err


def test_installed_script_prints_no_traceback():
    """The real console script, in a subprocess (two runs: each pays the interpreter's start-up).

    Bad input raised deep inside the API -> one line, status 2; a setup that does not fit under
    --max-fraction -> status 1 (the script passes main()'s return value to sys.exit)."""
    script = Path(sys.executable).with_name("trainmem")
    assert script.exists(), f"console script not installed next to {sys.executable}"
    p = subprocess.run([str(script), "estimate", "llama-3.1-8b", "--tp", "3"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), p.stderr
    assert "--tp 3" in lines[0] and p.stdout == ""
    p = subprocess.run([str(script), "estimate", "llama-3.1-8b", "--gpu", "h100", "--max-fraction", "0.9"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr == "" and "DOES NOT FIT" in p.stdout


# ----- exit status 1: does not fit -----------------------------------------------------------------
def test_max_fraction_exit_1_when_it_does_not_fit(capsys):
    # Llama-3.1-8B, bf16 autocast + AdamW on one 80 GB GPU: ~150 GiB of model states alone
    code, out, err = run_cli(capsys, "estimate", "llama-3.1-8b", "--gpu", "h100", "--max-fraction", "0.9")
    assert code == 1 and err == ""
    assert "DOES NOT FIT" in out
    # the same JSON says so too
    code, out, _ = run_cli(capsys, "estimate", "llama-3.1-8b", "--gpu", "h100", "--max-fraction", "0.9", "--json")
    d = json.loads(out)
    assert code == 1 and d["fits"] is False and d["device_used"] > 0.9 * d["capacity"]


def test_max_fraction_exit_0_when_it_fits(capsys):
    code, out, err = run_cli(capsys, "estimate", "gpt2", "--seq-len", "1024", "--gpu", "h100",
                             "--max-fraction", "0.5")
    assert (code, err) == (0, "")
    assert "FITS" in out and "DOES NOT FIT" not in out


def test_without_max_fraction_not_fitting_exits_1(capsys):
    # one exit rule (issue 14): a GPU given and the report does not fit it -> 1, --max-fraction or not
    code, out, _ = run_cli(capsys, "estimate", "llama-3.1-8b", "--gpu", "h100")
    assert code == 1 and "DOES NOT FIT" in out


def test_max_fraction_compares_device_memory_with_the_fraction(capsys):
    """The threshold is the verdict's device memory (allocated + 1/32 margin + CUDA context) against
    F x capacity; the replayed reserved memory + context is reported beside it."""
    r = trainmem.estimate("gpt2", seq_len=1024, batch_size=8, gpu="a10g")
    assert r.device_used == r.peak_reserved + get_gpu("a10g").context
    assert r.device_peak == r.peak_allocated + r.peak_allocated // 32 + get_gpu("a10g").context
    f = r.device_peak / r.capacity
    assert 0.05 < f < 0.95
    above, below = f"{f * 1.001:.6f}", f"{f * 0.999:.6f}"
    argv = ["estimate", "gpt2", "--seq-len", "1024", "--batch-size", "8", "--gpu", "a10g", "--max-fraction"]
    assert run_cli(capsys, *argv, above)[0] == 0
    assert run_cli(capsys, *argv, below)[0] == 1


# ----- catalogues -------------------------------------------------------------------------------
def test_models_lists_every_catalogue_entry(capsys):
    code, out, err = run_cli(capsys, "models")
    assert (code, err) == (0, "")
    first_words = [line.split()[0] for line in out.splitlines()[1:] if line.strip()]
    assert sorted(first_words) == sorted(catalogue_names())
    assert len(catalogue_names()) >= 20
    code, out, _ = run_cli(capsys, "models", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == catalogue_names()
    by_name = {r["name"]: r for r in rows}
    assert by_name["llama-3.1-8b"]["params"] == 8_030_261_248
    assert by_name["mixtral-8x7b"]["experts"] == 8


def test_gpus_prints_capacities_in_bytes(capsys):
    code, out, err = run_cli(capsys, "gpus")
    assert (code, err) == (0, "")
    table = catalogue_table()
    assert len(table) >= 10
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.strip()}
    for row in table:
        cap = get_gpu(row["name"]).capacity
        assert row["capacity_bytes"] == cap
        assert f"{cap:,d}" in lines[row["name"]]  # exact bytes, not a rounded GiB figure
    assert "85,520,809,984" in lines["h100-sxm-80gb"]  # 81,559 MiB as nvidia-smi reports it
    code, out, _ = run_cli(capsys, "gpus", "--json")
    rows = json.loads(out)
    assert code == 0 and {r["name"]: r["capacity_bytes"] for r in rows} == {
        r["name"]: r["capacity_bytes"] for r in table}
    assert all(isinstance(r["capacity_bytes"], int) for r in rows)


def test_default_sequence_fits_the_models_learned_positions(capsys):
    """Without --seq-len: 2048 tokens, or the model's learned positions when fewer."""
    assert main(["estimate", "gpt2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["seq_len"] == 1024
    assert main(["estimate", "bert-base-uncased", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["seq_len"] == 512
    assert main(["estimate", "llama-3.2-1b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["seq_len"] == 2048


def test_framework_flag_names_are_the_same_options(capsys):
    """--per-device-train-batch-size / --micro-batch-size, --gradient-accumulation-steps, --seq-length /
    --max-seq-len set the same fields as --batch-size, --grad-accum, --seq-len (estimate, sweep, plan)."""
    def training(*argv):
        rc, out, _ = run_cli(capsys, "estimate", "gpt2", "--json", *argv)
        assert rc == 0
        t = json.loads(out)["training"]
        return t["batch_size"], t["seq_len"], t["grad_accum"]
    ours = training("--batch-size", "3", "--seq-len", "256", "--grad-accum", "4")
    assert ours == (3, 256, 4)
    assert training("--per-device-train-batch-size", "3", "--max-seq-len", "256",
                    "--gradient-accumulation-steps", "4") == ours
    assert training("--micro-batch-size", "3", "--seq-length", "256", "--grad-accum", "4") == ours
    rc, out, _ = run_cli(capsys, "sweep", "gpt2", "--micro-batch-size", "1,2", "--max-seq-len", "128,256", "--json")
    d = json.loads(out)
    assert rc == 0 and d["batch_sizes"] == [1, 2] and d["seq_lens"] == [128, 256] and len(d["cells"]) == 4


def test_use_cache_takes_true_or_false(capsys):
    rc, _, err = run_cli(capsys, "estimate", "gpt2", "--use-cache", "maybe")
    assert rc == 2 and err.count("\n") == 1 and "--use-cache" in err
    rc, out, _ = run_cli(capsys, "estimate", "gpt2", "--use-cache", "false", "--json")
    assert rc == 0 and json.loads(out)["training"]["use_cache"] is False
