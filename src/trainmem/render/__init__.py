"""Renderers: a report as a table, JSON, plots."""
