"""trainmem fit / sweep / plan on the command line."""
import json

import pytest

from trainmem.cli import main

BERT = ["bert-large-uncased", "--set", 'architectures=["BertForSequenceClassification"]', "--method",
        "bert-notebook", "--gpu-memory", "24GiB", "--context-memory", "1195.04MiB", "--precision", "fp32",
        "--attention", "eager"]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_fit_json(capsys):
    rc, out, _ = run(capsys, "fit", *BERT, "--seq-len", "512", "--json")
    d = json.loads(out)
    assert rc == 0 and d["batch_size"] == 11 and d["seq_len"] == 512
    assert {"batch_size", "seq_len", "peak_allocated", "device_used", "margin"} <= set(d)
    rc, out, _ = run(capsys, "fit", *BERT, "--batch-size", "16", "--seq-multiple", "16")
    assert rc == 0 and "longest sequence (multiple of 16) at micro-batch 16: 400" in out
    assert "sequence length 416 would need 24.12 GiB" in out


def test_fit_short_prints_suggestions(capsys):
    rc, out, _ = run(capsys, "fit", "llama-3.2-1b", "--gpu", "t4", "--seq-len", "4096")
    assert rc == 1 and "NOTHING FITS" in out and "no single change makes it fit; these together do" in out


def test_fit_errors(capsys):
    rc, _, err = run(capsys, "fit", "gpt2", "--gpu", "h100")
    assert rc == 2 and "--seq-len N" in err
    rc, _, err = run(capsys, "fit", "gpt2", "--gpu", "h100", "--seq-len", "256", "--batch-size", "2")
    assert rc == 2 and "not both" in err


def test_sweep_plots(capsys, tmp_path):
    h, s = tmp_path / "heatmap.png", tmp_path / "stacked.svg"
    rc, out, _ = run(capsys, "sweep", "gpt2", "--batch-size", "1,2", "--seq-len", "256:512:256", "--gpu", "t4",
                     "--plot", str(h), "--plot", f"stacked={s}")
    assert rc == 0 and h.stat().st_size > 0 and s.stat().st_size > 0
    assert "wrote heatmap plot" in out and "wrote stacked plot" in out and "seq \\ batch" in out
    rc, out, _ = run(capsys, "sweep", "gpt2", "--batch-size", "1", "--seq-len", "256", "--gpu", "t4", "--json")
    assert rc == 0 and json.loads(out)["cells"][0]["fits"] is True
    rc, _, err = run(capsys, "sweep", "gpt2", "--seq-len", "9:1", "--gpu", "t4")
    assert rc == 2 and "START:STOP" in err


def test_plan_explain(capsys):
    rc, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpus", "16", "--gpu", "h100", "--seq-len", "4096",
                     "--global-batch", "64", "--top", "3", "--explain")
    assert rc == 0 and "rank" in out and "why the best beat the next" in out
    assert "why the other layouts were rejected" in out and "by parallel shape" in out
    rc, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpus", "16", "--gpu", "h100", "--seq-len", "4096",
                     "--global-batch", "64", "--top", "2", "--json", "--tp", "1,2", "--zero", "0,1")
    d = json.loads(out)
    assert rc == 0 and len(d["top"]) == 2 and all(x["tp"] in (1, 2) and x["zero"] in (0, 1) for x in d["top"])


def test_plan_nothing_fits(capsys):
    rc, out, _ = run(capsys, "plan", "llama-3.1-70b", "--gpus", "8", "--gpu", "a100-40gb", "--seq-len", "4096",
                     "--global-batch", "64")
    assert rc == 1 and "NOTHING FITS" in out and "smallest cluster that fits" in out


def test_plan_needs_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt2", "--gpu", "h100"])
    assert e.value.code == 2
    assert "--gpus" in capsys.readouterr().err
