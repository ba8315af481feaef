"""lw-proxy's flags: refusals name the flag and say why; good flags build the expected config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
    assert check_host("[fe80::1]") == "fe80::1"


def test_console_script_refuses_wildcard():
    exe = os.path.join(os.path.dirname(sys.executable), "lw-proxy")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "lw_proxy"]
    r = subprocess.run([*argv, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "decoders call it back" in r.stderr
