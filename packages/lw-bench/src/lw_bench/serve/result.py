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
    model: Literal["bench", "tiny", "swa", "gdn"]
    layers: Positive
    hidden: Positive
    dtype: Literal["float32", "bfloat16"]
    block_size: Positive
    lengths: list[Annotated[int, Meta(ge=32, le=16384)]]  # shared-prefix lengths, multiples of block_size
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
    backends: list[Literal["embedded", "memcache", "mooncake"]] = msgspec.field(default_factory=lambda: ["embedded"])
    # --disk-dir: the disk tier's directory, the disk/save engine's DRAM pool and the tier's capacity
    disk_dir: str | None = None
    disk_dram_bytes: Positive | None = None
    disk_capacity_bytes: Positive | None = None
    disk_direct_io: bool = False  # --disk-direct-io: the tier read with embedded_disk_direct_io


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


class BackendRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One backend's main-job rows (lw_bench.serve.backends)."""

    save_mode: str  # the engine of its miss + save
    hit_mode: str  # the engine of its pool hits (layerwise, headline depth)
    save_ttft_s: ByLength
    hit_ttft_s: ByLength
    save_vs_recompute: ByLength  # save overhead: miss + save TTFT / no-pool TTFT
    hit_vs_recompute: ByLength


class DiskRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The embedded pool's disk-hit row (lw_bench.serve.disk)."""

    path: str  # the tier's directory
    dram_bytes: Positive  # the disk/save engine's DRAM pool
    direct_io: bool = False  # the tier's reads: direct I/O (--disk-direct-io) or buffered
    hit_ttft_s: ByLength  # disk hit, first request
    vs_dram_hit: ByLength  # / the embedded DRAM hit at the same depth
    vs_recompute: ByLength
    read_gbps: ByLength  # bytes read per hit / (first - second TTFT), GB/s
    seq_read_gbps: list[Annotated[float, Meta(gt=0)]]  # the directory's sequential read, one per disk/hit engine
    read_vs_seq: ByLength  # read_gbps / median sequential read
    disk_hits: list[Annotated[int, Meta(ge=0)]]  # the connector's disk_hits counter, per disk/hit engine
    disk_read_bytes: list[Annotated[int, Meta(ge=0)]]
    expected_hits: Annotated[int, Meta(ge=0)]  # chunks the first requests of one engine loaded (= disk_hits when all came from disk)
    disk_hits_ok: bool  # every disk/hit engine counted disk hits
    target: float  # goal for read_vs_seq


class StatesRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``--model gdn``: the save engine's recurrent-state objects (lw_bench.serve.mode._states)."""

    chunk_objects: Annotated[int, Meta(ge=0)]  # attention chunks its first requests saved
    objects: int  # state objects committed besides them (its saved_objects counter less the chunks)
    per_prefix: float  # objects / prefixes saved (1: the last boundary of each prompt)
    bytes_per_object: int | None  # one state object: every GDN layer's state at one boundary
    save_failed_objects: Annotated[int, Meta(ge=0)]
    ssm_dtype: str | None = None  # the recurrent state's dtype as the save engine ran it (by the CPU)


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
    backend_rows: dict[str, BackendRow] = msgspec.field(default_factory=dict)  # backend -> its rows
    disk: DiskRow | None = None  # --disk-dir
    states: StatesRow | None = None  # --model gdn


def checked(result: dict) -> ServeBenchResult:
    """The assembled report as the struct; ``msgspec.ValidationError`` names the key that is
    missing, extra, mistyped or out of bounds."""
    return msgspec.convert(result, ServeBenchResult)
