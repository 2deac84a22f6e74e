"""`trainmem validate` over the published fixtures."""
import json
import os

import pytest

from trainmem.cli import main
from trainmem.errors import TrainmemError
from trainmem.validate import load_fixtures, run, summary

ROOT = os.path.join(os.path.dirname(__file__), "..", "validation")


def test_every_fixture_names_its_source_and_setup():
    fixtures = load_fixtures(ROOT)
    assert len(fixtures) >= 2
    for fx in fixtures:
        assert fx.get("source"), fx["_path"]
        assert fx["measured"], fx["_path"]


def test_estimate_accuracy_on_published_measurements():
    checks = run(ROOT, ["estimate"])
    s = summary(checks)["estimate"]
    assert s["n"] >= 12
    assert s["max"] < 0.005  # every published allocated/peak figure within 0.5%
    assert s["median"] < 0.001


def test_validate_cli_json(capsys):
    assert main(["validate", ROOT, "--predictors", "estimate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["estimate"]["max"] < 0.005


def test_bad_fixture_directory_is_one_clear_error(capsys, tmp_path):
    assert main(["validate", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainmem: error:")


def test_malformed_fixture(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(TrainmemError, match="malformed fixture"):
        load_fixtures(str(tmp_path))
