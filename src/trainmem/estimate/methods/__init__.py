"""Named formula sets (``--method``). Each module exposes ``estimate(model, training) -> MemoryReport``.

``trainmem`` is the default and most accurate; the others reproduce published methods so a user
can compare them (full citations in ``docs/sources.md``): ``nemo`` Jianbin Chang's NeMo training-
memory post, ``korthikanti`` Korthikanti et al. 2023, ``eleuther`` EleutherAI's Transformer Math
101, ``rees`` Edward Rees's nanoGPT memory arithmetic, ``zero-calc`` the Medium article by
@maxshapp, ``bert-notebook`` Moritz Scherrmann's BERT-large notebook.
"""
from __future__ import annotations

from importlib import import_module
from typing import Callable

from ...errors import TrainmemError

METHODS: dict[str, str] = {
    "trainmem": "trainmem.estimate.engine",
    "nemo": "trainmem.estimate.methods.nemo",
    "korthikanti": "trainmem.estimate.methods.korthikanti",
    "eleuther": "trainmem.estimate.methods.eleuther",
    "rees": "trainmem.estimate.methods.rees",
    "zero-calc": "trainmem.estimate.methods.zero_calc",
    "bert-notebook": "trainmem.estimate.methods.bert_notebook",
}


_LOADED: dict[str, Callable] = {}


def get_method(name: str) -> Callable:
    """The ``estimate(model, training)`` function of the method called ``name``."""
    fn = _LOADED.get(name)
    if fn is None:
        if name not in METHODS:
            raise TrainmemError(f"--method {name!r} is not one of: {', '.join(METHODS)}")
        fn = _LOADED[name] = import_module(METHODS[name]).estimate
    return fn
