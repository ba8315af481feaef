"""lw-proxy."""
__version__ = "0.1.0"
