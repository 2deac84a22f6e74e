"""Closed-form estimates: formulas from the model's hyperparameters, component by component.

The package is callable: ``trainmem.estimate(model, **options)`` is ``trainmem.estimate.api.estimate``.
"""
from ..callable_package import make_callable

make_callable(__name__, "trainmem.estimate.api:estimate")
