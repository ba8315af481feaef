"""The network-namespace test hosts: two hosts reach each other (ping, HTTP) on their private
addresses, and nothing is left behind -- after a normal exit, a failing body, or a crashed run."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from lw_dev import netns
from lw_dev.netns import require_netns


def _http_server(h: netns.Hosts, host: str, port: int, directory: str) -> subprocess.Popen:
    srv = h.popen(host, [sys.executable, "-m", "http.server", "--bind", h.addr(host), str(port), "-d", directory],
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return srv


def _get(h: netns.Hosts, host: str, url: str, timeout_s: float = 20.0) -> str:
    code = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=2).read().decode())"
    deadline = time.monotonic() + timeout_s
    while True:
        r = h.run(host, [sys.executable, "-c", code, url], timeout=10)
        if r.returncode == 0 or time.monotonic() > deadline:
            return r.stdout if r.returncode == 0 else f"FAILED: {r.stderr[-500:]}"
        time.sleep(0.2)


_ECHO = ("import socket, sys; s = socket.create_server((sys.argv[1], int(sys.argv[2]))); c, _ = s.accept();"
         "c.sendall(c.recv(64).upper())")
_PING = ("import socket, sys, time\nt = time.monotonic() + 15\nwhile True:\n  try:\n"
         "    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), 2); break\n"
         "  except OSError:\n    if time.monotonic() > t: raise\n    time.sleep(0.1)\n"
         "c.sendall(b'ping'); print(c.recv(64).decode())")


def ping(h: netns.Hosts, src: str, dst: str, port: int) -> str:
    """A TCP round trip from ``src`` to ``dst`` (no ping binary needed)."""
    h.popen(dst, [sys.executable, "-c", _ECHO, h.addr(dst), str(port)])
    r = h.run(src, [sys.executable, "-c", _PING, h.addr(dst), str(port)], timeout=30)
    return r.stdout.strip() if r.returncode == 0 else f"FAILED: {r.stderr[-500:]}"


@pytest.mark.slow  # network namespaces
def test_hosts_ping_each_other_on_their_own_addresses(two_hosts: netns.Hosts) -> None:
    a, b = two_hosts.addr("a"), two_hosts.addr("b")
    assert (a, b) == ("10.231.0.1", "10.231.0.2")
    assert ping(two_hosts, "a", "b", 18081) == "PING"
    assert ping(two_hosts, "b", "a", 18082) == "PING"
    # Each host has loopback and its eth0 on the /24, and no route out of it.
    routes = two_hosts.run("a", ["ip", "-4", "route", "show"]).stdout
    assert routes.strip().splitlines() == [f"10.231.0.0/24 dev eth0 proto kernel scope link src {a}"], routes
    assert "UP" in two_hosts.run("a", ["ip", "link", "show", "lo"]).stdout


@pytest.mark.slow  # network namespaces
def test_http_between_hosts_crosses_the_link(two_hosts: netns.Hosts, tmp_path) -> None:
    (tmp_path / "hello.txt").write_text("hello from b\n")
    _http_server(two_hosts, "b", 18080, str(tmp_path))
    rx0, _ = two_hosts.link_bytes("a")
    body = _get(two_hosts, "a", f"http://{two_hosts.addr('b')}:18080/hello.txt")
    assert body == "hello from b\n\n", body
    rx1, _ = two_hosts.link_bytes("a")
    assert rx1 > rx0  # the answer came in over a's eth0
    # The server binds b's address only: on a's own loopback nothing answers.
    r = two_hosts.run("a", [sys.executable, "-c", "import socket; socket.create_connection(('127.0.0.1', 18080), 2)"])
    assert r.returncode != 0 and "ConnectionRefused" in r.stderr


@pytest.mark.slow  # network namespaces
def test_entered_puts_this_thread_on_a_host(two_hosts: netns.Hosts, tmp_path) -> None:
    (tmp_path / "x.txt").write_text("x")
    _http_server(two_hosts, "b", 18084, str(tmp_path))
    own = os.readlink("/proc/thread-self/ns/net")
    with two_hosts.entered("a"):
        assert os.readlink("/proc/thread-self/ns/net") != own
        body = _get_here(f"http://{two_hosts.addr('b')}:18084/x.txt")
    assert body == "x"
    assert os.readlink("/proc/thread-self/ns/net") == own


def _get_here(url: str, timeout_s: float = 20.0) -> str:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow  # network namespaces
def test_close_removes_namespaces_links_and_processes() -> None:
    require_netns()
    h = netns.Hosts(["a", "b", "c"])
    with h:
        names = h.namespaces
        assert set(names) <= set(netns.list_namespaces())
        assert ping(h, "c", "a", 18083) == "PING"
        sleeper = h.popen("b", ["sleep", "600"])
        # A process started behind the harness's back (not through popen) is ended too.
        stray = subprocess.Popen(h.argv("c", ["sleep", "600"]), start_new_session=True)
    assert sleeper.poll() is not None
    stray.wait(10)
    assert not set(names) & set(netns.list_namespaces())
    root_links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert "br0" not in root_links and "veth" not in root_links


@pytest.mark.slow  # network namespaces
def test_a_failing_body_still_cleans_up() -> None:
    require_netns()
    h = netns.Hosts(["a", "b"])
    with pytest.raises(ZeroDivisionError):
        with h:
            names = h.namespaces
            p = h.popen("a", ["sleep", "600"])
            raise ZeroDivisionError
    assert p.poll() is not None
    assert not set(names) & set(netns.list_namespaces())


@pytest.mark.slow  # network namespaces
def test_leftovers_of_a_crashed_run_are_removed() -> None:
    require_netns()
    # A "crashed run": a child creates hosts and is SIGKILLed before it can clean up.
    code = ("import time; from lw_dev import netns; h = netns.Hosts(['a', 'b']);"
            "h.start(); h.popen('a', ['sleep', '600']); print(h.tag, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
    try:
        tag = child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait(10)
    assert tag.startswith("lwh")
    left = [ns for ns in netns.list_namespaces() if ns.startswith(tag + "-")]
    assert len(left) == 3, left  # sw, a, b
    removed = netns.cleanup_leftovers()
    assert set(left) <= set(removed)
    assert not [ns for ns in netns.list_namespaces() if ns.startswith(tag + "-")]


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="names="):
        netns.Hosts(["a", "a"])
    with pytest.raises(ValueError, match="subnet="):
        netns.Hosts(["a"], subnet="8.8.8.0/24")
