"""Command-line flags of ``lw-proxy`` (the seed's flags plus ours), checked before anything starts.

Every refusal goes through ``argparse``'s ``parser.error`` so the user sees one line naming the flag,
the value and what is accepted, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from dataclasses import dataclass, field

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_WILDCARDS = {"0.0.0.0", "::", "[::]", "*", ""}


class HostError(ValueError):
    pass


def check_host(host: str, *, bind: bool = False) -> str:
    """Return ``host`` normalised (IPv6 without brackets) or raise ``HostError`` saying why.

    Catches what a shell or a YAML list easily produces: two IPs glued together
    ("10.0.0.110.0.0.2"), a port glued on ("10.0.0.1:8000"), a comma-joined list, stray spaces.
    """
    h = host.strip()
    if h != host or not h:
        raise HostError(f"{host!r} is not a host (empty or surrounded by spaces)")
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if bind and (h in _WILDCARDS or _is_unspecified(h)):
        raise HostError(
            f"{host!r} is a wildcard address; lw-proxy must bind a concrete address because decoders "
            "call it back at http://<host>:<port>/v1/metaserver (use e.g. 127.0.0.1 or this node's IP)"
        )
    if ":" in h:
        try:
            return str(ipaddress.IPv6Address(h))
        except ValueError:
            raise HostError(
                f"{host!r} is neither an IPv6 address nor a host name (a port glued on? pass ports separately)"
            ) from None
    if re.fullmatch(r"[0-9.]+", h):
        try:
            return str(ipaddress.IPv4Address(h))
        except ValueError:
            raise HostError(f"{host!r} is not a valid IPv4 address (two addresses glued together?)") from None
    labels = h.rstrip(".").split(".")
    if len(h) > 253 or not all(_LABEL.match(lab) for lab in labels):
        raise HostError(f"{host!r} is not a valid host name (letters, digits, '-' and '.', e.g. node-1.local)")
    if labels[-1].isdigit():
        raise HostError(f"{host!r} is not a valid host name: its last label is all digits")
    return h


def _is_unspecified(h: str) -> bool:
    try:
        return ipaddress.ip_address(h).is_unspecified
    except ValueError:
        return False


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefillers: list[str] = field(default_factory=list)  # base URLs, "http://h:p"
    decoders: list[str] = field(default_factory=list)
    max_retries: int = 3
    retry_delay: float = 0.1
    metaserver_timeout: float = 30.0
    prefill_timeout: float = 300.0
    backend_timeout: float = 600.0
    connect_timeout: float = 5.0
    health_interval: float = 2.0
    max_body_bytes: int = 32 << 20
    max_connections: int = 1024
    api_key: str | None = None
    backend_api_key: str | None = None

    @property
    def metaserver_url(self) -> str:
        return url_for(self.host, self.port) + "/v1/metaserver"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lw-proxy",
        description="Layerwise PD-disaggregation proxy: decoder first, one prefill per request via /v1/metaserver.",
    )
    p.add_argument("--host", default="127.0.0.1", help="concrete bind address; decoders call it back (no wildcards)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", default=["127.0.0.1"])
    p.add_argument("--prefiller-ports", "--prefiller-port", nargs="+", type=int, default=[8100])
    p.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=["127.0.0.1"])
    p.add_argument("--decoder-ports", "--decoder-port", nargs="+", type=int, default=[8200])
    p.add_argument("--max-retries", type=int, default=3, help="extra attempts per backend call (0-100)")
    p.add_argument("--retry-delay", type=float, default=0.1, help="seconds between attempts")
    p.add_argument("--metaserver-timeout", type=float, default=30.0,
                   help="longest a decoder's metaserver POST is held before a 504 (decoder then recomputes)")
    p.add_argument("--prefill-timeout", type=float, default=300.0, help="deadline of one prefill request, seconds")
    p.add_argument("--backend-timeout", type=float, default=600.0,
                   help="longest silence on a backend connection before it counts as dead, seconds")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--health-interval", type=float, default=2.0, help="probe period for backends taken out, seconds")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest accepted request body")
    p.add_argument("--max-connections", type=int, default=1024, help="pool size of the shared backend session")
    p.add_argument("--api-key", default=os.environ.get("LW_PROXY_API_KEY"),
                   help="bearer token clients must send (env LW_PROXY_API_KEY); /healthcheck and /v1/metaserver stay open")
    p.add_argument("--backend-api-key", default=os.environ.get("LW_BACKEND_API_KEY"),
                   help="bearer token sent to prefillers and decoders (env LW_BACKEND_API_KEY)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _backends(parser: argparse.ArgumentParser, role: str, hosts: list[str], ports: list[int]) -> list[str]:
    if len(hosts) != len(ports):
        parser.error(
            f"--{role}-hosts has {len(hosts)} entries but --{role}-ports has {len(ports)}; give one port per host"
        )
    urls = []
    for h, port in zip(hosts, ports):
        try:
            h = check_host(h)
        except HostError as e:
            parser.error(f"--{role}-hosts: {e}")
        if not 1 <= port <= 65535:
            parser.error(f"--{role}-ports: {port} is not a TCP port (accepted: 1-65535)")
        urls.append(url_for(h, port))
    if len(set(urls)) != len(urls):
        parser.error(f"--{role}-hosts/--{role}-ports: the same backend is listed twice: {urls}")
    return urls


def parse_args(argv: list[str] | None = None) -> tuple[ProxyConfig, argparse.Namespace]:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        host = check_host(a.host, bind=True)
    except HostError as e:
        parser.error(f"--host: {e}")
    if not 1 <= a.port <= 65535:
        parser.error(f"--port: {a.port} is not a TCP port (accepted: 1-65535; decoders need a fixed port)")
    if not 0 <= a.max_retries <= 100:
        parser.error(f"--max-retries: {a.max_retries} is out of range (accepted: 0-100)")
    for name in ("retry_delay",):
        v = getattr(a, name)
        if not (v == v and 0 <= v <= 60):
            parser.error(f"--{name.replace('_', '-')}: {v} is out of range (accepted: 0-60 seconds)")
    for name in ("metaserver_timeout", "prefill_timeout", "backend_timeout", "connect_timeout", "health_interval"):
        v = getattr(a, name)
        if not (v == v and 0 < v <= 86400):
            parser.error(f"--{name.replace('_', '-')}: {v} is out of range (accepted: >0 to 86400 seconds)")
    if not 1024 <= a.max_body_bytes <= 1 << 31:
        parser.error(f"--max-body-bytes: {a.max_body_bytes} is out of range (accepted: 1024 to 2147483648)")
    if not 1 <= a.max_connections <= 100_000:
        parser.error(f"--max-connections: {a.max_connections} is out of range (accepted: 1-100000)")
    cfg = ProxyConfig(
        host=host,
        port=a.port,
        prefillers=_backends(parser, "prefiller", a.prefiller_hosts, a.prefiller_ports),
        decoders=_backends(parser, "decoder", a.decoder_hosts, a.decoder_ports),
        max_retries=a.max_retries,
        retry_delay=a.retry_delay,
        metaserver_timeout=a.metaserver_timeout,
        prefill_timeout=a.prefill_timeout,
        backend_timeout=a.backend_timeout,
        connect_timeout=a.connect_timeout,
        health_interval=a.health_interval,
        max_body_bytes=a.max_body_bytes,
        max_connections=a.max_connections,
        api_key=a.api_key or None,
        backend_api_key=a.backend_api_key or None,
    )
    return cfg, a
