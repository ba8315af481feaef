"""The metaserver allow rule (lw_core.metaserver_allow, ``pd_allowed_metaservers``): the loopback
default, listed origins with path prefixes, and the URLs a client could use to get around them."""

from __future__ import annotations

import pytest

from lw_core.config import ConfigError, parse_config
from lw_core.metaserver_allow import MetaserverAllowList, parse_entry

DEFAULT = MetaserverAllowList(None)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/v1/metaserver",
    "http://127.0.0.1:1/v1/metaserver",  # any port
    "http://127.3.2.1:8000/v1/metaserver",
    "http://localhost:8000/v1/metaserver",
    "http://LOCALHOST:8000/v1/metaserver",
    "http://[::1]:8000/v1/metaserver",
    "https://127.0.0.1:8443/v1/metaserver",
])
def test_the_default_allows_a_proxy_on_loopback(url: str) -> None:
    assert DEFAULT.allows(url), DEFAULT.why_refused(url)


@pytest.mark.parametrize("url, why", [
    ("http://10.0.0.5:8000/v1/metaserver", "unset"),  # another host
    ("http://169.254.169.254/v1/metaserver", "unset"),  # a cloud metadata address
    ("http://127.0.0.1:8000/reset_prefix_cache", "unset"),  # another local endpoint
    ("http://127.0.0.1:8000/v1/metaserver/x", "unset"),
    ("http://127.0.0.1:8000/v1/x/../metaserver", "dot segments"),
    ("http://127.0.0.1:8000/v1/%6detaserver", "escapes"),
    ("http://127.0.0.1:8000@evil.example/v1/metaserver", "user information"),
    ("http://user:pw@127.0.0.1:8000/v1/metaserver", "user information"),
    ("http://localhost.evil.example/v1/metaserver", "unset"),
    ("http://[::ffff:10.0.0.1]:80/v1/metaserver", "unset"),
    ("ftp://127.0.0.1/v1/metaserver", "http://"),
    ("http:///v1/metaserver", "no host"),
    ("http://127.0.0.1:99999/v1/metaserver", "not a URL"),
])
def test_the_default_refuses_everything_else_saying_why(url: str, why: str) -> None:
    refused = DEFAULT.why_refused(url)
    assert refused is not None and why in refused, refused


def test_listed_entries_match_scheme_host_port_and_path_prefix() -> None:
    allow = MetaserverAllowList(["http://10.0.0.5:8000/v1", "https://Proxy.Example", "http://[::2]:9000"])
    for url in ("http://10.0.0.5:8000/v1/metaserver", "http://10.0.0.5:8000/v1", "https://proxy.example/v1/metaserver",
                "https://proxy.example:443/anything", "http://[::2]:9000/v1/metaserver",
                "http://[0:0:0:0:0:0:0:2]:9000/v1/metaserver"):
        assert allow.allows(url), (url, allow.why_refused(url))
    for url in ("http://10.0.0.5:8001/v1/metaserver",  # other port
                "https://10.0.0.5:8000/v1/metaserver",  # other scheme
                "http://10.0.0.5:8000/v1x/metaserver",  # not below /v1
                "http://10.0.0.5:8000/v2/metaserver",
                "http://10.0.0.50:8000/v1/metaserver",  # a string prefix of the host is not the host
                "http://10.0.0.5.evil.example:8000/v1/metaserver",
                "http://proxy.example/v1/metaserver",  # https only, port 443 only
                "https://proxy.example:8443/v1/metaserver",
                "http://127.0.0.1:8000/v1/metaserver"):  # a list replaces the loopback default
        refused = allow.why_refused(url)
        assert refused is not None and "not under any of pd_allowed_metaservers" in refused, url
    assert allow.describe() == ["http://10.0.0.5:8000/v1", "https://proxy.example:443", "http://[::2]:9000"]


def test_an_empty_list_allows_nothing() -> None:
    refused = MetaserverAllowList([]).why_refused("http://127.0.0.1:8000/v1/metaserver")
    assert refused is not None and "empty" in refused


@pytest.mark.parametrize("entry, why", [
    ("10.0.0.5:8000", "http://"),
    ("ftp://10.0.0.5", "http://"),
    ("http://", "no host"),
    ("http://u@10.0.0.5", "user information"),
    ("http://10.0.0.5/?x=1", "query or fragment"),
    ("http://10.0.0.5/#f", "query or fragment"),
    ("http://10.0.0.5/a/../b", "dot segments"),
    ("http://10.0.0.5:70000", "not a URL"),
])
def test_bad_entries_say_what_is_wrong(entry: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_entry(entry)


def test_config_checks_the_entries_and_names_the_key() -> None:
    assert parse_config({}).pd_allowed_metaservers is None
    assert parse_config({"pd_allowed_metaservers": ["http://10.0.0.5:8000/v1/metaserver"]}).pd_allowed_metaservers \
        == ("http://10.0.0.5:8000/v1/metaserver",)
    assert parse_config({"pd_allowed_metaservers": []}).pd_allowed_metaservers == ()
    with pytest.raises(ConfigError, match=r"pd_allowed_metaservers: entry 'http://u@h' is not accepted \(it carries"):
        parse_config({"pd_allowed_metaservers": ["http://u@h"]})
    with pytest.raises(ConfigError, match=r"pd_allowed_metaservers='http://h' is not accepted; accepted: a list"):
        parse_config({"pd_allowed_metaservers": "http://h"})
    with pytest.raises(ConfigError, match="at most 64 entries"):
        parse_config({"pd_allowed_metaservers": [f"http://h{i}" for i in range(65)]})
    assert parse_config({}).pd_metaserver_max_connections == 1024
    with pytest.raises(ConfigError, match=r"pd_metaserver_max_connections=0 is not accepted; accepted: an integer >= 1"):
        parse_config({"pd_metaserver_max_connections": 0})
