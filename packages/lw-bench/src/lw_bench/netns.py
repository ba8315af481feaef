"""Hosts as Linux network namespaces for ``lw-bench backend --host-tcp-netns A,B`` (root): this
process's main thread moves into A (so the pool it starts and its own client live there) and the
cross-process reader into B; every byte between them crosses the namespaces' link."""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

CLONE_NEWNET = 0x40000000


def parse_pair(value: str) -> tuple[str, str]:
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise SystemExit(f"lw-bench backend --host-tcp-netns={value!r}: expected two network namespace names, A,B")
    for p in parts:
        if not os.path.exists(f"/run/netns/{p}"):
            raise SystemExit(f"lw-bench backend --host-tcp-netns: no network namespace {p!r} (see `ip netns list`)")
    return parts[0], parts[1]


def address(ns: str) -> str:
    """The first global IPv4 address in namespace ``ns``."""
    out = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, timeout=10)
    for line in out.stdout.splitlines():
        f = line.split()
        if "inet" in f:
            return f[f.index("inet") + 1].split("/")[0]
    raise SystemExit(f"lw-bench backend --host-tcp-netns: namespace {ns!r} has no IPv4 address ({out.stderr.strip()})")


def setns(ns: str) -> None:
    """Move the calling thread into network namespace ``ns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{ns}", "rb") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}: {os.strerror(ctypes.get_errno())}")


@contextmanager
def entered(ns: str | None) -> Iterator[None]:
    """The calling thread in ``ns`` for the block (nothing when ``ns`` is None)."""
    if ns is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net", "rb") as own:
        setns(ns)
        try:
            yield
        finally:
            libc.setns(own.fileno(), CLONE_NEWNET)
