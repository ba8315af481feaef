"""Helpers for tests and benchmarks (tiny local models, engine runners). Not used in serving."""
