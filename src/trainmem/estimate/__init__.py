"""Closed-form estimates: formulas from the model's hyperparameters, component by component."""
