"""What ``lw-bench backend`` reports: its JSON object (``--json``) is a ``BackendBenchResult``.

Rows are built as these structs where they are measured (this process or the reading one), so the
JSON's keys and types are the fields below. ``hosts`` is left out unless ``--host-tcp-netns`` gave it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Case = Literal["64KiB", "4MiB", "layer_16KiB"]


class BackendRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    case: Case
    op: Literal["put", "get"]
    process: Literal["same", "other", "other-host"]  # where the reads ran
    object_bytes: int
    objects: int
    bytes: int  # bytes moved by one repetition
    gbps: float  # backend, GB/s (1e9 bytes/s)
    memcpy_gbps: float  # numpy memcpy of the same bytes, same process
    ratio: float  # gbps / memcpy_gbps
    ms_per_call: float  # one batch call (one layer for layer_16KiB)


class MetadataRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    case: Case
    op: Literal["reserve+commit", "open+release"]
    keys_per_call: int
    ms_per_call: float


class GetBreakdown(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where one get row's time goes, per call (one batch; one layer for layer_16KiB), each part the
    best of the repetitions: ``open`` and ``release`` (the layer case opens once, outside its timed
    calls), ``read`` (the copy and its checks) and ``memcpy`` (the same bytes copied by numpy)."""

    case: Case
    process: Literal["same", "other", "other-host"]
    keys_per_call: Annotated[int, Meta(ge=1)]
    open_ms: Annotated[float, Meta(ge=0)]
    read_ms: Annotated[float, Meta(ge=0)]
    release_ms: Annotated[float, Meta(ge=0)]
    memcpy_ms: Annotated[float, Meta(ge=0)]
    # layer_16KiB only: the memcpy of every layer over open + every layer's read + release, i.e. the
    # whole load against memcpy, open included (a backend that fetches at open pays for it here);
    # open + release is the best of the repeated open+release (metadata) where this process timed
    # it, else the single open and release around the timed reads (other processes).
    load_ratio: Annotated[float, Meta(ge=0)] | None = None


class BackendBenchResult(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    backend: str  # the backend's name
    backend_keys: dict[str, Any]  # --backend-key
    quick: bool
    setup_s: float  # the pool's set-up
    results: list[BackendRow]
    metadata: list[MetadataRow]
    stats: dict[str, int]  # the backend's stats() after the run
    breakdown: list[GetBreakdown] = []  # where each get row's time goes
    hosts: list[str] | None = None  # --host-tcp-netns: the writer's and the reader's namespaces
