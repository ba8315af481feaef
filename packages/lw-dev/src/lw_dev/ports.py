"""Ports for tests on 127.0.0.1: a free one (aiohttp's ``unused_port``: bound, read, released) and
the URL of one nobody listens on (connections are refused). Several distinct ports on one host at
once: ``lw_memcache.local.free_ports``."""

from __future__ import annotations

from aiohttp.test_utils import unused_port as free_port

__all__ = ["dead_url", "free_port"]


def dead_url() -> str:
    """``http://127.0.0.1:<port>`` where nothing listens any more: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"
