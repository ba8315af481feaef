"""Command-line flags of ``lw-proxy`` (the seed's flags plus ours), checked before anything starts.

Every refusal goes through ``argparse``'s ``parser.error`` so the user sees one line naming the flag,
the value and what is accepted, and the process exits with status 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import stat
import sys
from dataclasses import dataclass, field

# RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_WILDCARDS = {"0.0.0.0", "::", "[::]", "*", ""}
PREFILL_DISPATCH = ("early", "on-metaserver")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


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
    # Never in repr(): a config that gets logged or printed must not show the keys.
    api_key: str | None = field(default=None, repr=False)
    backend_api_key: str | None = field(default=None, repr=False)
    allow_unauthenticated_admin: bool = False
    # One deadline per client request (body read, every retry and recompute included); a streamed
    # request must see its first decoder byte within first_byte_timeout and then never wait longer
    # than stream_idle_timeout between two chunks.
    request_timeout: float = 600.0
    first_byte_timeout: float = 180.0
    stream_idle_timeout: float = 60.0
    # Slow clients: headers (and an idle keep-alive connection) and gaps in the body are bounded.
    client_header_timeout: float = 10.0
    client_body_timeout: float = 30.0
    max_client_connections: int = 2048
    # A dedicated listener for decoders' callbacks (None: they use the client port).
    metaserver_port: int | None = None
    max_metaserver_connections: int = 8192
    # Without a dedicated listener: connections the client port admits past max_client_connections,
    # for decoders' callbacks only (other requests on them get 503).
    metaserver_reserved_connections: int = 256
    max_resume_bytes: int = 1 << 20  # text kept per stream so a recomputed choice can be resumed
    log_repeat_window: float = 10.0
    # "early": a parent's prefill is dispatched with the client request, in parallel with the decoder;
    # "on-metaserver": once all its decoder children POSTed /v1/metaserver (skipped when none needs it).
    prefill_dispatch: str = "early"
    # Streamed completions and chat: relay the prefiller's first token while the decoder loads (lw_proxy.relay).
    prefill_first: bool = True
    continue_after_prefill: bool = True  # with prefill_first: non-streamed answers (lw_proxy.prefill_continue)
    # with continue_after_prefill: streams of one choice too (prefill_continue.applies_stream)
    continue_streams: bool = False

    def __post_init__(self) -> None:
        for name in ("api_key", "backend_api_key"):
            why = key_problem(getattr(self, name))
            if why is not None:
                raise ValueError(f"{name}: {why}")

    @property
    def metaserver_url(self) -> str:
        return url_for(self.host, self.metaserver_port or self.port) + "/v1/metaserver"


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
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="deadline of one client request, body read, retries and recomputes included; "
                        "then 504 (a stream ends with an error event), seconds")
    p.add_argument("--first-byte-timeout", type=float, default=180.0,
                   help="a streamed request's decoder must send its first byte within this; else the "
                        "decoder counts as hung and another is tried, seconds")
    p.add_argument("--stream-idle-timeout", type=float, default=60.0,
                   help="longest gap between two chunks of a decoder's stream before the stream ends "
                        "with an error event, seconds")
    p.add_argument("--client-header-timeout", type=float, default=10.0,
                   help="a client must send its request headers within this; also how long an idle "
                        "keep-alive connection is kept, seconds")
    p.add_argument("--client-body-timeout", type=float, default=30.0,
                   help="longest silence while a client sends its body; then 400, seconds")
    p.add_argument("--max-client-connections", type=int, default=2048,
                   help="open client connections on the client port; beyond it new ones get 503 and are closed")
    p.add_argument("--metaserver-port", type=int, default=None,
                   help="serve decoders' /v1/metaserver callbacks on this port of --host, apart from clients, "
                        "so client overload cannot starve them (default: the client port)")
    p.add_argument("--max-metaserver-connections", type=int, default=8192,
                   help="open connections on the --metaserver-port listener")
    p.add_argument("--metaserver-reserved-connections", type=int, default=256,
                   help="without --metaserver-port: connections the client port admits past "
                        "--max-client-connections for decoders' /v1/metaserver callbacks only")
    p.add_argument("--max-resume-bytes", type=int, default=1 << 20,
                   help="generated text kept per stream so a recomputed choice can be resumed; a recompute "
                        "past it ends the stream with an error")
    p.add_argument("--log-repeat-window", type=float, default=10.0,
                   help="identical log messages within this many seconds are logged once, then counted (0: off)")
    p.add_argument("--prefill-dispatch", default="early", choices=PREFILL_DISPATCH,
                   help="when a request's prefill is sent: 'early' (default) with the client request, in "
                        "parallel with the decoder, so the decoder's scheduling and metaserver call are off "
                        "the critical path; 'on-metaserver' once every decoder child called /v1/metaserver, "
                        "which dispatches none when they all say needs_prefill: false (saves prefills where "
                        "decoders usually hold the prompt already)")
    p.add_argument("--prefill-first", action=argparse.BooleanOptionalAction, default=True,
                   help="streamed completions and chat completions (one prompt; echo only on a "
                        "completion's text prompt without log-probs; chat "
                        "without tools; sampled ones when the decoder continues from the prefill's token; "
                        "log-probs of the first token from the prefill): "
                        "send the prefiller's own first token to the client as soon as the prefill answers, "
                        "then the decoder's stream without its (identical) first token (see lw_proxy.relay); "
                        "with --continue-after-prefill also non-streamed answers (below). On by default; "
                        "--no-prefill-first sends every first token from the decoder")
    p.add_argument("--continue-after-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="with --prefill-first and early dispatch, a non-streamed answer (one prompt; no penalties, "
                        "bad_words or structured outputs; not when a stop string could begin in the first token) "
                        "is continued after its prefill: "
                        "the decoder gets the prompt plus the prefill's first token, loads the prompt and calls no "
                        "metaserver (see lw_proxy.prefill_continue). On by default; turn it off for decoders "
                        "running pd_streaming over a slow store, whose layer-by-layer pull hides the transfer "
                        "behind the prefill where a continuation loads after it")
    p.add_argument("--continue-streams", action=argparse.BooleanOptionalAction, default=False,
                   help="with --continue-after-prefill, a stream of one choice (one prompt; no continuous usage, "
                        "stop strings or completion log-probs) is continued after its prefill too: the client gets the "
                        "prefill's first token, then the stream of a decoder request of the prompt plus that token, "
                        "which spends no step on the prompt's last token (a forced first token spends one) but is "
                        "sent only once the prefill answered. Off by default: it shortens the gap after the first "
                        "token on an idle decoder (see docs/bench/pd.md); a busy decoder batches that step instead")
    p.add_argument("--api-key", default=None,
                   help="bearer token clients must send (not empty, no surrounding whitespace: both are refused); "
                        "prefer env LW_PROXY_API_KEY or --api-key-file: a command-line value shows in the process "
                        "list (a warning is printed)")
    p.add_argument("--api-key-file", default=None, help="file holding the client bearer token (one line)")
    p.add_argument("--allow-unauthenticated-admin", action="store_true",
                   help="serve /reset_prefix_cache without an API key (refused by default when no key is set)")
    p.add_argument("--backend-api-key", default=None,
                   help="bearer token sent to prefillers and decoders; prefer env LW_BACKEND_API_KEY or "
                        "--backend-api-key-file")
    p.add_argument("--backend-api-key-file", default=None, help="file holding the backend bearer token (one line)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--event-loop", default="auto", choices=list(EVENT_LOOPS),
                   help="asyncio's own loop, or uvloop (libuv; lower per-request latency); auto: uvloop when it is "
                        "installed (vLLM installs it; pip install uvloop), else asyncio")
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
    for name in ("request_timeout", "first_byte_timeout", "stream_idle_timeout", "client_header_timeout",
                 "client_body_timeout"):
        v = getattr(a, name)
        if not (v == v and 0.1 <= v <= 86400):
            parser.error(f"--{name.replace('_', '-')}: {v} is out of range (accepted: 0.1 to 86400 seconds)")
    for name in ("max_client_connections", "max_metaserver_connections"):
        v = getattr(a, name)
        if not 1 <= v <= 1_000_000:
            parser.error(f"--{name.replace('_', '-')}: {v} is out of range (accepted: 1-1000000)")
    if not 0 <= a.metaserver_reserved_connections <= 1_000_000:
        parser.error(f"--metaserver-reserved-connections: {a.metaserver_reserved_connections} is out of range "
                     "(accepted: 0-1000000)")
    if a.metaserver_port is not None and not (1 <= a.metaserver_port <= 65535 and a.metaserver_port != a.port):
        parser.error(f"--metaserver-port: {a.metaserver_port} is not a TCP port other than --port "
                     "(accepted: 1-65535, not equal to --port)")
    if not 0 <= a.max_resume_bytes <= 1 << 30:
        parser.error(f"--max-resume-bytes: {a.max_resume_bytes} is out of range (accepted: 0 to 1073741824)")
    if not (a.log_repeat_window == a.log_repeat_window and 0 <= a.log_repeat_window <= 3600):
        parser.error(f"--log-repeat-window: {a.log_repeat_window} is out of range (accepted: 0 to 3600 seconds)")
    api_key = _secret(parser, "api-key", a.api_key, a.api_key_file, "LW_PROXY_API_KEY")
    backend_key = _secret(parser, "backend-api-key", a.backend_api_key, a.backend_api_key_file, "LW_BACKEND_API_KEY")
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
        api_key=api_key,
        backend_api_key=backend_key,
        allow_unauthenticated_admin=a.allow_unauthenticated_admin,
        request_timeout=a.request_timeout,
        first_byte_timeout=a.first_byte_timeout,
        stream_idle_timeout=a.stream_idle_timeout,
        client_header_timeout=a.client_header_timeout,
        client_body_timeout=a.client_body_timeout,
        max_client_connections=a.max_client_connections,
        metaserver_port=a.metaserver_port,
        max_metaserver_connections=a.max_metaserver_connections,
        metaserver_reserved_connections=a.metaserver_reserved_connections,
        max_resume_bytes=a.max_resume_bytes,
        log_repeat_window=a.log_repeat_window,
        prefill_dispatch=a.prefill_dispatch,
        prefill_first=a.prefill_first,
        continue_after_prefill=a.continue_after_prefill,
        continue_streams=a.continue_streams,
    )
    return cfg, a


def key_problem(key: str | None) -> str | None:
    """Why ``key`` cannot be a bearer key, or None. None itself (no key) is fine. An empty key would
    silently mean "no authentication", and one with surrounding whitespace can never match (clients'
    tokens are read stripped), so both are refused rather than taken."""
    if key is None:
        return None
    if not key:
        return "is empty, which would turn authentication off; give a key, or none at all to run without one"
    if key != key.strip():
        return ("has leading or trailing whitespace (a pasted newline?), which no client's bearer token can "
                "match; remove it")
    return None


def _secret(parser: argparse.ArgumentParser, flag: str, value: str | None, path: str | None,
            env: str) -> str | None:
    """A key from ``--flag``, ``--flag-file`` or env ``env`` (at most one of the two flags).

    A file is read whole and stripped of surrounding whitespace; a missing, unreadable or empty file
    is refused naming the flag. A value on the command line or in ``env`` is taken as it is: empty
    (``--flag ""``, or ``env`` set to an unset variable's expansion) or with surrounding whitespace,
    it is refused (``key_problem``) rather than silently turning authentication off or never matching.
    A value on the command line works but is visible to every local user (ps, /proc/<pid>/cmdline):
    say so on stderr.
    """
    if value is not None and path is not None:
        parser.error(f"--{flag} and --{flag}-file are both given; use one")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"--{flag}-file: cannot read {path!r}: {e}")
        if not key or any(c.isspace() for c in key):
            parser.error(f"--{flag}-file: {path!r} must hold one key without spaces (it is empty or has several)")
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(f"lw-proxy: warning: --{flag}-file {path!r} is readable by other users (mode "
                  f"{stat.S_IMODE(mode):o}); chmod 600 it", file=sys.stderr)
        return key
    if value is not None:
        why = key_problem(value)
        if why is not None:
            parser.error(f"--{flag}: the key {why}")
        print(f"lw-proxy: warning: --{flag} on the command line is visible in the process list; "
              f"use env {env} or --{flag}-file", file=sys.stderr)
        return value
    value = os.environ.get(env)
    why = key_problem(value)
    if why is not None:
        parser.error(f"env {env}: the key {why} (unset {env} to run without a key)")
    return value
