"""``lw-bench``: measurements of the pool and the layer pipeline (see the root README)."""

__version__ = "0.1.0"
