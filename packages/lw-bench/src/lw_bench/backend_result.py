"""What ``lw-bench backend`` reports: its JSON object (``--json``) is a ``BackendBenchResult``.

Rows are built as these structs where they are measured (this process or the reading one), so the
JSON's keys and types are the fields below. ``hosts`` is left out unless ``--host-tcp-netns`` gave it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

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


class BackendBenchResult(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    backend: str  # the backend's name
    backend_keys: dict[str, Any]  # --backend-key
    quick: bool
    setup_s: float  # the pool's set-up
    results: list[BackendRow]
    metadata: list[MetadataRow]
    stats: dict[str, int]  # the backend's stats() after the run
    hosts: list[str] | None = None  # --host-tcp-netns: the writer's and the reader's namespaces
