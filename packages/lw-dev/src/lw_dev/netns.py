"""Test hosts as Linux network namespaces (root only).

    with Hosts(["a", "b"]) as hosts:                 # 10.231.0.1 and 10.231.0.2
        srv = hosts.popen("b", [sys.executable, "-m", "http.server", "--bind", hosts.addr("b"), "8080"])
        hosts.run("a", ["curl", f"http://{hosts.addr('b')}:8080/"])

Layout: one namespace per host (``<prefix><pid>-<host>``) with loopback up and an ``eth0`` that
is one end of a veth pair; the other ends sit on a bridge inside a *switch* namespace
(``<prefix><pid>-sw``). The root namespace gets no interface, no address and no route: traffic
between hosts stays on the veths and each host's loopback, and a host has no route anywhere else
(only its /24). Hosts share the file system, /dev/shm and huge pages (as containers on one machine
would); only the network is separate.

Clean-up removes everything even on failure: ``close`` (also run by ``__exit__``, a pytest
finalizer and an atexit hook) kills the processes started through ``popen`` (their whole
process group), then every process still inside the namespaces, then deletes the namespaces
(which deletes the veths and the bridge with them). ``start`` first removes what a crashed run
left: namespaces with this prefix whose creator pid is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

DEFAULT_PREFIX = "lwh"
DEFAULT_SUBNET = "10.231.0.0/24"
_IP = "ip"
_CLONE_NEWNET = 0x40000000
_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class HostsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([_IP, *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise HostsError(f"`ip {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _kill_namespace(ns: str, wait_s: float = 5.0) -> None:
    """SIGTERM then SIGKILL whatever runs in ``ns``, then delete it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = namespace_pids(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            break
    _ip("netns", "del", ns, check=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cleanup_leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces named ``<prefix><pid>-*`` whose creating process ``pid`` is gone."""
    pat = re.compile(rf"^{re.escape(prefix)}(\d+)-[a-z0-9]+$")
    removed = []
    for ns in list_namespaces():
        m = pat.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_namespace(ns)
            removed.append(ns)
    return removed


def available() -> str | None:
    """None when network namespaces can be made here, else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{DEFAULT_PREFIX}{os.getpid()}-probe"
    try:
        p = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns` unusable: {e}"
    if p.returncode != 0:
        return f"`ip netns add` refused: {p.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """pytest.skip, with the reason, where this OS or user cannot make network namespaces."""
    why = available()
    if why:
        import pytest

        pytest.skip(f"test hosts need network namespaces: {why}")


class Hosts:
    """2-3 (up to 250) hosts on one private /24, joined by a bridge in a switch namespace."""

    def __init__(self, names: Sequence[str] = ("a", "b"), *, subnet: str = DEFAULT_SUBNET,
                 prefix: str = DEFAULT_PREFIX) -> None:
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or not net.is_private or net.prefixlen > 29:
            raise ValueError(f"subnet={subnet!r}: expected a private IPv4 network of /29 or larger, e.g. 10.231.0.0/24")
        if not names or len(set(names)) != len(names) or not all(_NAME.match(n) and n != "sw" for n in names):
            raise ValueError(f"names={list(names)!r}: expected distinct names of 1-8 lowercase letters/digits, not 'sw'")
        hosts = list(net.hosts())
        if len(names) > len(hosts):
            raise ValueError(f"names: {len(names)} hosts do not fit in {subnet}")
        self.net = net
        self.prefix = prefix
        self.tag = f"{prefix}{os.getpid()}"
        self.addrs = {n: str(hosts[i]) for i, n in enumerate(names)}
        self.procs: list[subprocess.Popen[Any]] = []
        self._started = False
        self._atexit_registered = False

    # ----- names -----

    def ns(self, host: str) -> str:
        if host != "sw" and host not in self.addrs:
            raise KeyError(f"no host {host!r}; hosts: {', '.join(self.addrs)}")
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        self.ns(host)
        return self.addrs[host]

    @property
    def namespaces(self) -> list[str]:
        return [self.ns("sw"), *(self.ns(h) for h in self.addrs)]

    # ----- life cycle -----

    def __enter__(self) -> Hosts:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Hosts:
        cleanup_leftovers(self.prefix)
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True
        self._started = True
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        sw = self.ns("sw")
        for ns in self.namespaces:
            if ns in list_namespaces():  # our own pid's name: a previous Hosts of this process leaked it
                _kill_namespace(ns)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, (host, addr) in enumerate(self.addrs.items()):
            ns = self.ns(host)
            # Both ends are created inside namespaces: the root namespace never holds either.
            _ip("-n", sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5.0)
        for ns in self.namespaces:
            if ns in list_namespaces():
                _kill_namespace(ns)
        if self._atexit_registered:
            atexit.unregister(self.close)
            self._atexit_registered = False

    # ----- running things on a host -----

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside ``host``'s network namespace."""
        if not self._started:
            raise HostsError("Hosts is not started")
        return [_IP, "netns", "exec", self.ns(host), *argv]

    def popen(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host`` in its own process group; ``close`` ends it (and its children)."""
        kw.setdefault("start_new_session", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(self.argv(host, argv), **kw)
        self.procs.append(p)
        return p

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 30.0, **kw: Any) -> subprocess.CompletedProcess[str]:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(host, argv), timeout=timeout, **kw)

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """Move the *calling thread* into ``host``'s network namespace (setns), so this test process
        talks to the hosts' servers over their addresses as a client on ``host`` would; restored on
        exit. Other threads stay where they were; children started meanwhile inherit ``host``."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net", "rb") as own, open(f"/run/netns/{self.ns(host)}", "rb") as target:
            if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                raise HostsError(f"setns into {self.ns(host)}: {os.strerror(ctypes.get_errno())}")
            try:
                yield
            finally:
                if libc.setns(own.fileno(), _CLONE_NEWNET) != 0:
                    raise HostsError(f"setns back to the original namespace: {os.strerror(ctypes.get_errno())}")

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(received, sent) bytes on ``host``'s eth0: what crossed the host boundary."""
        base = "/sys/class/net/eth0/statistics"
        out = self.run(host, ["cat", f"{base}/rx_bytes", f"{base}/tx_bytes"], timeout=10)
        if out.returncode != 0:
            raise HostsError(f"reading {host}'s eth0 counters: {out.stderr.strip()}")
        rx, tx = (int(x) for x in out.stdout.split())
        return rx, tx


@contextlib.contextmanager
def hosts(names: Sequence[str] = ("a", "b"), **kw: Any) -> Iterator[Hosts]:
    h = Hosts(names, **kw)
    with h:
        yield h
