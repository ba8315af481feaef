"""lw-proxy's flags: refusals name the flag and say why; good flags build the expected config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lw_dev.ports import free_port
from lw_proxy.config import check_host, parse_args


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as ei:
        parse_args(argv)
    assert ei.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0"])
def test_wildcard_bind_host_is_refused(host, capsys):
    err = _refused(["--host", host], capsys)
    assert "--host" in err and "wildcard" in err and "decoders call it back" in err


@pytest.mark.parametrize("flag,value,text", [
    ("--decoder-hosts", "10.0.0.110.0.0.2", "two addresses glued together"),
    ("--decoder-hosts", "10.0.0.1:8000", "port glued on"),
    ("--prefiller-hosts", "10.0.0.1,10.0.0.2", "not a valid host name"),
    ("--prefiller-hosts", "bad_host", "not a valid host name"),
    ("--prefiller-hosts", "host.123", "last label is all digits"),
    ("--prefiller-hosts", " 10.0.0.1", "surrounded by spaces"),
    ("--host", "1.2.3.4.5", "two addresses glued together"),
])
def test_malformed_hosts_are_refused(flag, value, text, capsys):
    err = _refused([flag, value], capsys)
    assert flag.rstrip("s").split("-")[2] in err and text in err


@pytest.mark.parametrize("argv,text", [
    (["--decoder-hosts", "a", "b", "--decoder-ports", "1"], "--decoder-hosts has 2 entries but --decoder-ports has 1"),
    (["--prefiller-ports", "70000"], "not a TCP port"),
    (["--port", "0"], "--port: 0 is not a TCP port"),
    (["--max-retries", "-1"], "--max-retries"),
    (["--retry-delay", "nan"], "--retry-delay"),
    (["--metaserver-timeout", "0"], "--metaserver-timeout"),
    (["--max-body-bytes", "10"], "--max-body-bytes"),
    (["--decoder-hosts", "a", "a", "--decoder-ports", "1", "1"], "listed twice"),
    (["--request-timeout", "0"], "--request-timeout: 0.0 is out of range (accepted: 0.1 to 86400 seconds)"),
    (["--first-byte-timeout", "inf"], "--first-byte-timeout"),
    (["--stream-idle-timeout", "nan"], "--stream-idle-timeout"),
    (["--client-header-timeout", "-1"], "--client-header-timeout"),
    (["--client-body-timeout", "1e9"], "--client-body-timeout"),
    (["--max-client-connections", "0"], "--max-client-connections: 0 is out of range (accepted: 1-1000000)"),
    (["--max-metaserver-connections", "2000000"], "--max-metaserver-connections"),
    (["--metaserver-port", "8000"], "--metaserver-port: 8000 is not a TCP port other than --port"),
    (["--metaserver-port", "70000"], "--metaserver-port"),
    (["--max-resume-bytes", "-1"], "--max-resume-bytes"),
    (["--metaserver-reserved-connections", "-1"], "--metaserver-reserved-connections"),
    (["--log-repeat-window", "4000"], "--log-repeat-window"),
])
def test_bad_numbers_and_counts_are_refused(argv, text, capsys):
    assert text in _refused(argv, capsys)


def test_good_flags_build_the_config():
    cfg, _ = parse_args(["--host", "127.0.0.1", "--port", "9000",
                         "--prefiller-hosts", "node-1.local", "::1", "--prefiller-ports", "8100", "8101",
                         "--decoder-hosts", "10.0.0.5", "--decoder-ports", "8200",
                         "--max-retries", "5", "--retry-delay", "0.5", "--api-key", "k"])
    assert cfg.prefillers == ["http://node-1.local:8100", "http://[::1]:8101"]
    assert cfg.decoders == ["http://10.0.0.5:8200"]
    assert cfg.metaserver_url == "http://127.0.0.1:9000/v1/metaserver"
    assert (cfg.max_retries, cfg.retry_delay, cfg.api_key) == (5, 0.5, "k")
    assert cfg.prefill_first and not parse_args(["--no-prefill-first"])[0].prefill_first  # on by default
    assert cfg.continue_after_prefill and not parse_args(["--no-continue-after-prefill"])[0].continue_after_prefill
    assert not cfg.continue_streams and parse_args(["--continue-streams"])[0].continue_streams  # off by default
    assert check_host("[fe80::1]") == "fe80::1"
    cfg, _ = parse_args(["--port", "9000", "--metaserver-port", "9001", "--request-timeout", "30"])
    assert cfg.metaserver_url == "http://127.0.0.1:9001/v1/metaserver" and cfg.request_timeout == 30


def test_console_script_refuses_wildcard():
    exe = os.path.join(os.path.dirname(sys.executable), "lw-proxy")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "lw_proxy"]
    r = subprocess.run([*argv, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "decoders call it back" in r.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_console_script_serves_both_listeners_and_stops_on_sigterm(loop):
    import importlib.util
    import json
    import signal
    import time
    import urllib.error
    import urllib.request

    port, mport = free_port(), free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "lw-proxy")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "lw_proxy"]
    if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:  # without it: refused, naming the fix
        r = subprocess.run([*argv, "--port", str(port), "--event-loop", "uvloop"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0 and "pip install uvloop" in r.stderr, r.stderr
        return
    p = subprocess.Popen([*argv, "--port", str(port), "--metaserver-port", str(mport), "--log-level", "info",
                          "--event-loop", loop], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2) as r:
                    assert json.load(r)["decode_instances"] == 1
                break
            except urllib.error.HTTPError as e:  # 503: no healthy decoder, but it serves
                assert e.code == 503
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, p.stderr.read() if p.poll() else ""
                time.sleep(0.1)
        req = urllib.request.Request(f"http://127.0.0.1:{mport}/v1/metaserver", method="POST",
                                     data=b'{"lw_parent_id": "x", "request_id": "r"}')
        try:
            urllib.request.urlopen(req, timeout=5)
            raise AssertionError("an unknown parent must not be accepted")
        except urllib.error.HTTPError as e:
            assert e.code == 404 and "unknown lw_parent_id" in json.load(e)["error"]["message"]
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
        err = p.stderr.read()
        assert f"event loop {loop}" in err and "client auth: off" in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_event_loop_auto_takes_uvloop_when_installed_and_asyncio_otherwise(monkeypatch):
    import importlib.util

    from lw_proxy.cli import loop_factory

    assert loop_factory("asyncio") == ("asyncio", None)
    have = importlib.util.find_spec("uvloop") is not None
    assert loop_factory("auto")[0] == ("uvloop" if have else "asyncio")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    assert loop_factory("auto") == ("asyncio", None)
    with pytest.raises(SystemExit, match="pip install uvloop"):
        loop_factory("uvloop")
    with pytest.raises(SystemExit, match="--event-loop 'trio'"):
        loop_factory("trio")


def test_bad_event_loop_flag_is_refused(capsys):
    err = _refused(["--event-loop", "trio"], capsys)
    assert "--event-loop" in err and "uvloop" in err
