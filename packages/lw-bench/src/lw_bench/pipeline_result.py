"""What ``lw-bench pipeline`` reports: its JSON object (``--json``) is a ``PipelineBenchResult``.

The measuring child process encodes one and the parent decodes it against these types, so a key the
code stops writing, or writes with another type, fails the run instead of changing the JSON quietly.
Fields a mode does not have are ``None`` and left out of the JSON (``omit_defaults``): the host
bench has no ``save_s`` and no device fields, the device bench (``--kv-device``) no backend keys.
"""

from __future__ import annotations

from typing import Any

import msgspec


class PipelineBenchConfig(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    layers: int
    blocks: int
    block_bytes: int  # one layer of one block
    layer_bytes: int  # one layer of every block
    total_bytes: int  # every layer of every block
    reps: int
    depths: list[int]  # the prefetch depths measured
    backend: str
    compute_ms_target: float  # per layer
    matmul_n: int  # the matmul's size, calibrated to compute_ms_target
    blas_threads_env: dict[str, str | None]  # host bench: the BLAS thread variables the child ran with
    backend_keys: dict[str, Any] | None = None  # host bench: --backend-key
    kv_device: str | None = None  # device bench: the KV cache's torch device
    device_name: str | None = None  # device bench
    torch: str | None = None  # device bench: torch's version


class PipelineBenchResult(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    config: PipelineBenchConfig
    # medians over the repetitions, seconds
    t_compute_s: float  # compute only, every layer
    t_transfer_s: float  # bulk load alone, no compute
    t_bulk_s: float  # load every layer, then compute every layer
    t_layerwise_s: dict[str, float]  # wait_layer then compute, per layer; keyed by prefetch depth
    # (t_bulk - t_layerwise[d]) / min(t_compute, t_transfer): 1.0 hides the shorter one entirely
    hidden_fraction: dict[str, float]
    # the machine's own ceiling: a plain numpy memcpy of the same bytes alone, and next to the compute
    t_raw_copy_s: float
    t_raw_overlap_s: float
    raw_hidden_fraction: float
    per_layer_compute_ms: float
    per_layer_transfer_ms: float
    transfer_gbps: float
    layer_wait_ms: dict[str, float]  # median total time the forward pass blocked in wait_layer, by depth
    samples: dict[str, list[float]]  # every repetition's times: compute, transfer, bulk, layerwise_<d>, raw_*
    load_failures: int  # failed blocks over all runs (should be 0)
    errors: list[str]  # their messages (the first 20)
    verified: bool  # every load put exactly the saved bytes into the KV cache
    save_s: float | None = None  # device bench: the initial save
    plot: str | None = None  # --plot: the PNG written


def encode(result: PipelineBenchResult) -> bytes:
    return msgspec.json.encode(result)


def decode(raw: bytes | str) -> PipelineBenchResult:
    """The child's JSON line as a result; ``msgspec.ValidationError`` names a missing or mistyped key."""
    return msgspec.json.decode(raw, type=PipelineBenchResult)
