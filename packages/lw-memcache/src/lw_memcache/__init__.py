"""lw-memcache: memcache_hybrid as a pool backend for the layerwise KV connector.

Importing this package never imports memcache_hybrid; that happens when a backend is created.
"""

from lw_memcache.backend import MemcacheBackend
from lw_memcache.copies import DeviceRegion
from lw_memcache.handles import MemcacheHandle

__version__ = "0.1.0"
__all__ = ["DeviceRegion", "MemcacheBackend", "MemcacheHandle"]
