"""The command line never answers with a traceback.

Hypothesis draws command lines from the real option names of ``estimate``, ``fit``, ``sweep`` and
``plan`` with values that are legal, nonsense, out of range, negative, huge or not numbers at all,
and runs them in-process through ``trainmem.cli.main``. Whatever the input: no exception escapes,
the exit status is 0 (answered, fits or no GPU), 1 (answered, does not fit) or 2 (bad input), and
an exit 2 prints exactly one line on stderr. Slow commands (trace, measure) get a fixed list of bad
inputs instead: they must refuse before running anything.
"""
from __future__ import annotations

import io
import contextlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from trainmem.cli import main

MODELS = ["gpt2", "gpt2", "gpt2", "llama-3.2-1b", "llama-3.2-1b", "bert-large-uncased", "mixtral-8x7b", "nosuchmodel", "./missing/dir",
          "meta-llama/Llama-3.1-8B", ""]
NUMBERS = ["0", "1", "2", "3", "4", "7", "8", "16", "-1", "1.5", "1e400", "nan", "inf", "abc", "", "99999999"]
SIZES = ["40", "40GiB", "80GB", "-1GiB", "1e400GiB", "nan", "inf", "0", "512MiB", "12XB", "1e3", "0.5TiB"]
GPUS = ["h100", "a100", "v100", "NVIDIA H100 80GB HBM3", "a100-80gb", "nosuchgpu", "H10", "rtx4090", "b200", ""]
SETS = ["n_layer=2", "num_hidden_layers=2", "foo=bar", "n_layer=abc", "n_layer=2.5", "n_layer", "=3",
        "num_hidden_layer=2", "hidden_size=-5", "n_embd=0"]

# (flag, values): the values each flag is tried with; None: a flag without a value
ESTIMATE_OPTIONS = {
    "--batch-size": NUMBERS, "--seq-len": NUMBERS + ["4096", "1000000"], "--grad-accum": NUMBERS,
    "--precision": ["bf16-amp", "fp16-amp", "fp32", "bf16", "fp16", "bf16-mp", "fp8", "x"],
    "--optimizer": ["adamw", "sgd", "adafactor", "adamw8bit", "lion", "paged_adamw_8bit", "x"],
    "--zero": NUMBERS, "--fsdp": ["full", "hybrid", "grad-op", "none", "x"], "--dp": NUMBERS,
    "--tp": NUMBERS, "--pp": NUMBERS, "--cp": NUMBERS, "--sequence-parallel": None,
    "--pp-schedule": ["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "x"], "--pp-virtual-stages": NUMBERS,
    "--distributed-optimizer": None, "--offload-optimizer": ["cpu", "none", "x"],
    "--recompute": ["none", "full", "selective", "x"], "--recompute-every": NUMBERS,
    "--attention": ["eager", "sdpa", "flash", "sdpa-flash", "sdpa-math", "sdpa-efficient", "sdpa-cudnn", "x"],
    "--hold-output": ["loss", "backward", "step", "x"], "--keep-logits": None,
    "--zero-grad": ["none", "zeros", "x"], "--optimizer-in-backward": None,
    "--lora-rank": NUMBERS, "--lora-dtype": ["half", "fp32", "x"], "--no-dropout": None,
    "--loss": ["upcast", "half", "chunked", "fused", "x"], "--loss-chunks": NUMBERS,
    "--liger": None, "--liger-version": ["0.6.4", "0.8.2", "0.2.0", "x", ""],
    "--megatron-version": ["0.18.0", "core_v0.19.0", "0.9", "x", ""],
    "--master-weights": ["fp32", "none", "x"], "--compile": None,
    "--framework": ["hf-trainer", "torchtune", "lightning", "nanogpt", "x"],
    "--gpu": GPUS, "--gpu-memory": SIZES, "--context-memory": SIZES, "--max-fraction": NUMBERS + ["0.9"],
    "--units": ["GiB", "GB", "MiB", "auto", "x"], "--set": SETS, "--json": None, "--detail": None,
}
PLAN_OPTIONS = {**ESTIMATE_OPTIONS, "--gpus": NUMBERS, "--global-batch": NUMBERS, "--top": NUMBERS,
                "--pp": NUMBERS, "--tp": NUMBERS + ["1,2", "3"], "--zero": ["0,3", "1", "x"]}
SWEEP_OPTIONS = {**ESTIMATE_OPTIONS, "--batch-size": ["1,2", "1:8", "0", "x", "8:1", "-1"],
                 "--seq-len": ["128,256", "128:1024:128", "0", "x", "3000"], "--by": ["estimate", "x"]}
FIT_OPTIONS = {**ESTIMATE_OPTIONS, "--by": ["estimate", "x"], "--seq-multiple": NUMBERS}
COMMANDS = {"estimate": ESTIMATE_OPTIONS, "fit": FIT_OPTIONS, "sweep": SWEEP_OPTIONS, "plan": PLAN_OPTIONS}


@st.composite
def command_lines(draw):
    cmd = draw(st.sampled_from(sorted(COMMANDS)))
    opts = COMMANDS[cmd]
    argv = [cmd, draw(st.sampled_from(MODELS))]
    for flag in draw(st.lists(st.sampled_from(sorted(opts)), max_size=5, unique=True)):
        values = opts[flag]
        if values is None:
            argv.append(flag)
        else:
            argv.append(f"{flag}={draw(st.sampled_from(values))}")
    return argv


def run(argv: list[str]) -> tuple[int, str, str]:
    """``trainmem ARGV`` in-process: (exit status, stdout, stderr). Any exception fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own exits (its errors, --help)
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def check(argv: list[str]) -> None:
    code, out, err = run(argv)
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out, (argv, err)
    if code == 2:
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("trainmem: warning:")]
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith("trainmem: error:"), (argv, err)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(command_lines())
def test_no_traceback_and_one_rule_for_exit_codes(argv):
    check(argv)


CASES = [
    ["estimate", "gpt2", "--gpu-memory=1e400GiB"],
    ["estimate", "gpt2", "--gpu-memory=-1GiB"],
    ["estimate", "gpt2", "--gpu-memory=nan"],
    ["estimate", "gpt2", "--set", "foo=bar"],
    ["estimate", "gpt2", "--set", "num_hidden_layer=2"],
    ["estimate", "gpt2", "--gpu", "a100"],
    ["estimate", "llama-3.1-8b", "--tp", "16"],
    ["estimate", "gpt2", "--zero", "3", "--fsdp", "full", "--dp", "2"],
    ["estimate", "gpt2", "--distributed-optimizer", "--zero", "3", "--dp", "2"],
    ["estimate", "gpt2", "--megatron-version", "0.18.0"],
    ["estimate", "gpt2", "--framework", "megatron", "--megatron-version", "latest"],
    ["plan", "llama-3.1-8b", "--gpus", "7", "--gpu", "h100", "--global-batch", "8"],
    ["plan", "llama-3.1-8b", "--gpus", "8", "--tp", "3", "--gpu", "h100", "--global-batch", "8"],
    ["trace", "nosuchmodel"],
    ["trace", "gpt2", "--batch-size", "0"],
    ["trace", "gpt2", "--gpu-memory=1e400GiB"],
    ["measure", "gpt2", "--batch-size=-3"],
    ["validate", "/nonexistent/dir"],
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) for c in CASES])
def test_named_bad_inputs_get_one_line(argv):
    code, out, err = run(argv)
    assert code == 2, (argv, code, out[-300:], err)
    check(argv)


def test_pointless_setup_warns_on_stderr_and_answers():
    code, out, err = run(["estimate", "gpt2", "--zero", "3"])
    assert code == 0
    warnings = [x for x in err.splitlines() if x.startswith("trainmem: warning:")]
    assert len(warnings) == 1 and "--dp 1" in warnings[0], err
    assert "warning" not in out  # said once, on stderr, not in the table
