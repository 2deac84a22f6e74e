"""Renderers: results as text and plots. ``table``: a report as a table; ``suggestions``: what would
make a setup fit; ``fit``: a fit result; ``measure``: measured runs and comparisons; ``trace``: the
largest tensors of a trace; ``catalogue``: the model and GPU lists; ``plots``: sweeps and timelines
(matplotlib). The library computes, these turn its results into text; the CLI wires the two."""
