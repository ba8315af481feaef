"""Which metaserver URLs an engine may call (``pd_allowed_metaservers``).

A decoder's metaserver URL arrives in the request's ``kv_transfer_params``, i.e. from whoever sent
the request: the proxy, but also any client that reaches a ``kv_both`` engine or a decoder
directly. The engine POSTs there and parks the request for up to ``metaserver_timeout_s``, so an
unchecked URL lets a client make the engine call any address it names. An engine calls only URLs
this rule allows; any other is refused before a connection is made (the request is then computed
as a plain request).

The rule:

* ``pd_allowed_metaservers`` unset (``None``, the default): the URL's host is this machine's
  loopback (``localhost``, ``127.0.0.0/8``, ``::1``), any port, and its path is exactly the
  proxy's ``/v1/metaserver``. A proxy on the engines' host (the single-host set-up) works with no
  setting; nothing else does.
* a list of URLs (``scheme://host[:port][/path]``): the URL's scheme, host and port equal one
  entry's (an entry without a port means the scheme's default, 80 or 443), and its path is the
  entry's path or lies below it (``/v1`` allows ``/v1/metaserver``, not ``/v1x``); an entry without
  a path allows every path of that origin. Hosts compare case-insensitively, IP addresses by value.
* an empty list: no metaserver at all (every remote-prefill request is computed locally).

URLs with user information (``user:pass@``) are never allowed. Standard library only (lw-core's
base).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from lw_core.wire import METASERVER_PATH

SCHEMES = {"http": 80, "https": 443}
LOOPBACK_NAMES = frozenset({"localhost"})
DEFAULT_RULE = f"loopback hosts (localhost, 127.0.0.0/8, ::1), any port, path {METASERVER_PATH}"
ENTRY_FORM = "an http:// or https:// URL: scheme://host[:port][/path], no user, query or fragment"


@dataclass(frozen=True)
class Origin:
    """One allowed entry: scheme, host (lower case; an IP address in its canonical form), port and
    path prefix ("" for any path)."""

    scheme: str
    host: str
    port: int
    path: str

    def allows(self, scheme: str, host: str, port: int, path: str) -> bool:
        if (scheme, host, port) != (self.scheme, self.host, self.port):
            return False
        return not self.path or path == self.path or path.startswith(self.path + "/")


def _host(parts: SplitResult) -> str | None:
    host = parts.hostname  # lower case, brackets of an IPv6 literal removed
    if not host:
        return None
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.rstrip(".")


def _parts(url: str) -> tuple[str, str, int, str] | str:
    """(scheme, host, port, path) of an http(s) URL, or why it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"not a URL ({e})"
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        return "not an http:// or https:// URL"
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return "it carries user information"
    host = _host(parts)
    if host is None:
        return "it names no host"
    if "%" in parts.path or "\\" in parts.path or any(seg in (".", "..") for seg in parts.path.split("/")):
        return "its path has escapes or dot segments"
    return scheme, host, SCHEMES[scheme] if port is None else port, parts.path


def parse_entry(entry: str) -> Origin:
    """One ``pd_allowed_metaservers`` entry; ``ValueError`` saying what is wrong with it."""
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"{entry!r} is not accepted; accepted: {ENTRY_FORM}")
    got = _parts(entry)
    if isinstance(got, str):
        raise ValueError(f"{entry!r} is not accepted ({got}); accepted: {ENTRY_FORM}")
    parts = urlsplit(entry)
    if parts.query or parts.fragment or entry.endswith(("?", "#")):
        raise ValueError(f"{entry!r} is not accepted (it has a query or fragment); accepted: {ENTRY_FORM}")
    scheme, host, port, path = got
    return Origin(scheme, host, port, path.rstrip("/"))


def _loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class MetaserverAllowList:
    """The rule above for one engine. ``entries``: ``pd_allowed_metaservers`` (``None``: the
    loopback default); every entry is checked here (``ValueError`` names a bad one)."""

    def __init__(self, entries: Sequence[str] | None) -> None:
        self.default = entries is None
        self.origins = tuple(parse_entry(e) for e in entries or ())

    def why_refused(self, url: str) -> str | None:
        """``None`` when ``url`` may be called, else why not (for the log line)."""
        got = _parts(url)
        if isinstance(got, str):
            return got
        scheme, host, port, path = got
        if self.default:
            if _loopback(host) and path == METASERVER_PATH:
                return None
            return f"pd_allowed_metaservers is unset, which allows {DEFAULT_RULE} only"
        if any(o.allows(scheme, host, port, path) for o in self.origins):
            return None
        if not self.origins:
            return "pd_allowed_metaservers is empty (no metaserver is allowed)"
        return f"not under any of pd_allowed_metaservers ({', '.join(self.describe())})"

    def allows(self, url: str) -> bool:
        return self.why_refused(url) is None

    def describe(self) -> list[str]:
        """The allowed entries as URLs (for messages)."""
        if self.default:
            return [DEFAULT_RULE]
        out = []
        for o in self.origins:
            host = f"[{o.host}]" if ":" in o.host else o.host
            out.append(f"{o.scheme}://{host}:{o.port}{o.path}")
        return out
