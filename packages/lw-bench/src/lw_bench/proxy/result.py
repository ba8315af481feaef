"""What ``lw-bench proxy`` reports: its JSON object (``--json``) is a ``ProxyBenchResult`` (the
overhead points) or, with ``--soak N``, a ``SoakResult``; the fields below are the JSON's keys.

A point's figures are ``LoadStats`` (one closed-loop load, straight at the mock decoder or through
the proxy). ``ProxyBenchResult.points`` holds one ``ConcurrencyPoint`` per concurrency ``N`` under the
key ``c<N>``; the JSON object carries those keys at its top level (``as_json_object``), as it always
did, next to ``duration_s``, ``concurrency`` and ``targets``. Percentiles are NaN (JSON ``NaN``)
when a load completed no request.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

Count = Annotated[int, Meta(ge=0)]
Rate = Annotated[float, Meta(ge=0)]
Concurrency = Annotated[int, Meta(ge=1, le=4096)]


class LoadStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    requests: Count  # completed with HTTP 200
    errors: Count  # any other outcome
    rps: Rate
    p50_ms: float
    p99_ms: float
    mean_ms: float


class ConcurrencyPoint(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    direct: LoadStats  # straight at the mock decoder
    proxy: LoadStats  # through the proxy: the full PD flow
    added_p50_ms: float  # proxy p50 - direct p50
    throughput_ratio: Rate | None  # proxy rps / direct rps; None when direct completed nothing
    proxy_p99_over_p50: float | None  # NaN when the proxied load completed nothing


class ProxyTargets(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Reported, never asserted; each only when its concurrency (1, 64) was measured."""

    added_p50_ms_c1_le_2: bool | None = None
    throughput_ratio_c64_ge_0_5: bool | None = msgspec.field(default=None, name="throughput_ratio_c64_ge_0.5")
    p99_le_3x_p50_c64: bool | None = None


class ProxyBenchResult(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    duration_s: Annotated[float, Meta(gt=0)]  # seconds of load per (concurrency, target) point
    concurrency: list[Concurrency]  # the levels measured
    targets: ProxyTargets
    points: dict[str, ConcurrencyPoint]  # "c<N>" -> that level's point; top-level keys in the JSON


class SoakResult(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    requests: Annotated[int, Meta(ge=1)]
    concurrency: Concurrency
    fail_rate: Annotated[float, Meta(ge=0, lt=1)]  # share of mock answers that fail
    ok: Count
    errors: dict[str, Count]  # by HTTP status
    lost: Count  # no answer: connection error or client timeout
    wrong_answer: Count  # someone else's text or a malformed error
    elapsed_s: Rate
    rps: Rate
    rss_start_mib: Rate  # the proxy's RSS after the warm-up
    rss_end_mib: Rate
    rss_growth_mib: float


def checked(result: msgspec.Struct) -> Any:
    """``result`` with every field's bounds checked (msgspec checks ``Meta`` only on conversion);
    ``msgspec.ValidationError`` names the field out of bounds."""
    return msgspec.convert(msgspec.to_builtins(result), type(result))


def as_json_object(result: ProxyBenchResult | SoakResult) -> dict[str, Any]:
    """The report's JSON object: ``points`` spread into ``c<N>`` keys."""
    out: dict[str, Any] = msgspec.to_builtins(result)
    out.update(out.pop("points", {}))
    return out
