"""A profile kept in the user cache is used again only while it is what this trainmem and the installed
transformers would build (``spec.profile._current``)."""
import json
import os

import pytest

pytest.importorskip("transformers")

from trainmem.spec import profile as P  # noqa: E402

TINY = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 64}


def _cached_path(monkeypatch, tmp_path) -> str:
    monkeypatch.setenv("TRAINMEM_CACHE", str(tmp_path))
    P._profile_for.cache_clear()
    P.profile_for(TINY)
    return os.path.join(str(tmp_path), "profiles", f"{P.fingerprint(TINY)}.json")


def _mark(path: str, **fields) -> None:
    doc = json.load(open(path))
    doc.update(fields)
    json.dump(doc, open(path, "w"))
    P._profile_for.cache_clear()


def test_a_profile_from_the_installed_transformers_is_reused(monkeypatch, tmp_path):
    path = _cached_path(monkeypatch, tmp_path)
    _mark(path, architecture="MarkedByTheTest")
    assert P.profile_for(TINY).architecture == "MarkedByTheTest"


def test_a_profile_from_another_transformers_is_built_again(monkeypatch, tmp_path):
    path = _cached_path(monkeypatch, tmp_path)
    _mark(path, architecture="MarkedByTheTest", transformers_version="4.0.0")
    prof = P.profile_for(TINY)
    assert prof.architecture == "GPT2LMHeadModel"
    assert json.load(open(path))["transformers_version"] == P._installed_transformers()


def test_a_type_revision_outdates_profiles_written_before_it():
    doc = {"version": P.PROFILE_VERSION, "model_type": "dbrx", "transformers_version": ""}
    assert not P._current(doc, shipped=False) and not P._current(doc, shipped=True)
    assert P._current(dict(doc, revision=P.TYPE_REVISION["dbrx"]), shipped=False)
    assert P._current(dict(doc, model_type="llama"), shipped=True)


def test_a_shipped_profile_stands_whatever_transformers_is_installed():
    doc = {"version": P.PROFILE_VERSION, "model_type": "llama", "transformers_version": "1.0.0"}
    assert P._current(doc, shipped=True) and not P._current(doc, shipped=False)
