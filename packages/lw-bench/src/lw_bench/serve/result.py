"""What ``lw-bench serve`` reports: its JSON object (``--json``, ``--save``) is a ``ServeBenchResult``;
the fields below are the JSON's keys (lw_bench.serve.mode's docstring says what each figure means).

``summarize`` assembles the figures and ``run`` adds the run's own (engine start, runtime, load);
the whole is converted to this struct before it is emitted, so a key the code stops writing, writes
with another type or out of its bounds, or adds unannounced, fails the run instead of changing the
JSON quietly. Prefix lengths are string keys, times in seconds.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(ge=0)]
ByLength = dict[str, float | None]  # prefix length -> figure (None: no sample)


class ServeBenchConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Literal["bench", "tiny", "swa"]
    layers: Positive
    hidden: Positive
    dtype: Literal["float32", "bfloat16"]
    block_size: Positive
    lengths: list[Annotated[int, Meta(ge=32, le=4096)]]  # shared-prefix lengths, multiples of block_size
    reps: Positive
    rounds: Positive
    depths: list[Positive]  # layerwise prefetch depths
    tail: Annotated[int, Meta(ge=1, le=31)]  # unique tokens after the prefix, less than a block
    threads: Positive
    kv_bytes_per_token: Positive
    pool_capacity_bytes: Positive
    headline_depth: Positive
    max_model_len: Positive
    kv_cache_memory_bytes: Positive
    pool_path: str | None = None  # the embedded pool's directory (set by run)


class Samples(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    first: list[Seconds]
    second: list[Seconds]


class Ratios(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """At the longest length; None where a term is missing."""

    hit_vs_recompute: dict[str, float | None]  # pool mode -> ttft[mode] / ttft[recompute]
    layerwise_vs_bulk: dict[str, float | None]  # depth -> ttft[layerwise_d] / ttft[bulk]
    layered_vs_local: dict[str, float | None]  # pool mode -> local_ttft[mode] / local_ttft[recompute]
    load_layerwise_vs_bulk: dict[str, float | None]  # depth -> pool_load[layerwise_d] / pool_load[bulk]
    # --model swa: pool mode -> bytes read per hit / bytes read per hit with HMA off
    loaded_bytes_vs_hma_off: dict[str, float | None] = msgspec.field(default_factory=dict)


class Headline(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    length: Positive
    hit_vs_recompute: float | None
    layerwise_vs_bulk: float | None
    layered_vs_local: float | None
    targets: dict[str, float]


class Checks(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pool_hits_ok: bool
    local_hits_ok: bool
    saved_ok: bool
    problems: Annotated[list[str], Meta(max_length=20)]  # the first 20


class LoadAverage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    before: Seconds
    after: Seconds


class ServeBenchResult(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    config: ServeBenchConfig
    modes: list[str]  # engine names in first-run order
    ttft_s: dict[str, ByLength]  # mode -> median TTFT of first requests
    local_ttft_s: dict[str, ByLength]  # mode -> median TTFT of second requests (not for save)
    pool_hit_tokens: dict[str, dict[str, Annotated[int, Meta(ge=0)] | None]]
    pool_load_s: dict[str, ByLength]  # pool mode -> median (first - second); may be negative
    pool_loaded_bytes: dict[str, dict[str, Annotated[int, Meta(ge=0)] | None]]  # pool mode -> median bytes read per hit
    samples: dict[str, dict[str, Samples]]  # mode -> length -> every measured request
    ratios: Ratios
    headline: Headline
    checks: Checks
    engine_start_s: dict[str, Seconds]  # mode -> median over its rounds
    runtime_s: Seconds
    loadavg: LoadAverage  # the machine's 1-minute load average
    plot: str | None = None  # --plot: the PNG written


def checked(result: dict) -> ServeBenchResult:
    """The assembled report as the struct; ``msgspec.ValidationError`` names the key that is
    missing, extra, mistyped or out of bounds."""
    return msgspec.convert(result, ServeBenchResult)
