"""The proxy's Prometheus metrics, on a registry of its own (several proxies may live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Sub-millisecond buckets matter: the proxy's own overhead is what we watch.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "lw_proxy_requests_total", "Client requests answered, by endpoint and HTTP status", ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "lw_proxy_errors_total",
            "Failures by kind: bad_request, auth, upstream_connect, upstream_status, upstream_died, timeout, "
            "client_disconnect, prefill_failed, recompute_exhausted, forbidden, relay_mismatch (--prefill-first: "
            "the decoder's first token differed; the choice was resumed after the relayed one)",
            ["kind"], registry=r,
        )
        self.retries = Counter("lw_proxy_retries_total", "Backend calls retried, by backend role", ["role"], registry=r)
        self.in_flight = Gauge("lw_proxy_requests_in_flight", "Client requests being served", ["endpoint"], registry=r)
        self.request_seconds = Histogram(
            "lw_proxy_request_duration_seconds", "Client request duration until the last byte",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.backend_seconds = Histogram(
            "lw_proxy_backend_request_duration_seconds", "Duration of one backend call until its last byte",
            ["role", "backend"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.backend_healthy = Gauge(
            "lw_proxy_backend_healthy", "1 when the backend takes traffic, 0 while it is out and probed",
            ["role", "backend"], registry=r,
        )
        self.backend_load = Gauge(
            "lw_proxy_backend_load_tokens", "Estimated tokens in flight on the backend (balancing key)",
            ["role", "backend"], registry=r,
        )
        self.backend_in_flight = Gauge(
            "lw_proxy_backend_requests_in_flight", "Calls open on the backend right now", ["role", "backend"],
            registry=r,
        )
        self.backend_failures = Counter(
            "lw_proxy_backend_failures_total",
            "Calls that failed on the backend (connect error, 502/503/504, empty 200, died before a "
            "non-streamed body was complete); "
            "each takes it out of rotation until a health probe passes",
            ["role", "backend"], registry=r,
        )
        self.metaserver_wait = Histogram(
            "lw_proxy_metaserver_wait_seconds", "How long a decoder's metaserver POST was held, by outcome",
            ["outcome"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.prefills = Counter(
            "lw_proxy_prefill_dispatches_total",
            "Prefill dispatches by outcome (ok, error: also when it ended after its decoder answered; cancelled: "
            "no decoder answered, a metaserver wait timed out on it, or shutdown; skipped: on-metaserver dispatch "
            "and every decoder child said it holds the prompt)", ["outcome"],
            registry=r,
        )
        self.recomputes = Counter(
            "lw_proxy_recompute_resubmissions_total", "Choices resubmitted after stop_reason == 'recomputed'",
            registry=r,
        )
        self.relayed_first = Counter(
            "lw_proxy_prefill_first_relayed_total",
            "Completions and chat completions whose first token the client got from the prefill's answer "
            "(--prefill-first, the default): streams relayed it while the decoder still loaded; non-streamed "
            "answers were continued after it by the decoder (or ended with it)",
            registry=r,
        )
        self.not_relayed = Counter(
            "lw_proxy_prefill_first_not_relayed_total",
            "Streamed completions and chat completions whose first token came from the decoder although "
            "--prefill-first is on (and non-streamed answers the proxy meant to continue after their prefill "
            "but could not: decoder_first, token), by reason (request: a kind the relay does not apply to, "
            "e.g. several prompts, tools; decoder_first: the decoder's answer started, or the prefill failed, before the "
            "prefill answered; "
            "token: the prefill's first token cannot be relayed: EOS or a stop token, empty or partial UTF-8 text, "
            "a tool call or reasoning, the asked log-probs missing; not_forced: sampled, and the decoder does not "
            "continue from the prefill's token)", ["reason"],
            registry=r,
        )
        self.prefill_reused = Counter(
            "lw_proxy_prefill_reused_total",
            "Metaserver calls of a retried decoder answered from the parent's one prefill (none dispatched)",
            registry=r,
        )
        self.connections_refused = Counter(
            "lw_proxy_connections_refused_total",
            "Connections answered 503 and closed at once because the listener was at its cap", ["listener"],
            registry=r,
        )
        self.parents = Gauge("lw_proxy_pending_parents", "Parent requests with metaserver bookkeeping", registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
