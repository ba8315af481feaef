"""Mooncake Store backend of the layerwise KV pool (``backend: "mooncake"``).

Importing this package never imports Mooncake's client library: that happens when a backend is
opened (``lw_mooncake.backend``) or a master/holder is started (``lw_mooncake.cli``).
"""

__version__ = "0.1.0"
