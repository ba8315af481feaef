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
    mechanism: str | None = None  # device bench: the copier's device_copy_mechanism (--mechanism)


class RateRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``--rates``: one case and mechanism (``lw_bench.pipeline_rates``); GB/s are 1e9 bytes/s."""

    case: str  # "16 KiB", "64 KiB", "256 KiB" (segment sizes) or "model" (32 x 512 x 64 KiB)
    layers: int
    blocks: int
    segment_bytes: int  # one block of one layer
    total_bytes: int
    mechanism: str  # asked for: staged, kernel, batch_dma
    load_gbps: float  # pool -> device through the pipeline (bulk loads), median
    save_gbps: float  # device -> pool through the pipeline (reserve, copies, commit), median
    ceiling_load_gbps: float  # pinned host -> device DMA of the same bytes, same run
    ceiling_save_gbps: float  # device -> pinned host
    load_of_ceiling: float
    save_of_ceiling: float
    used: dict[str, int]  # batches each mechanism really moved (saves and loads)
    verified: bool
    error: str | None = None  # the mechanism failed here (its rates are 0)
    # The pool's own counters that moved over this case and mechanism (``Backend.stats`` deltas):
    # how the store moved the bytes, e.g. Mooncake's put_direct_bytes / put_staged_bytes.
    store_counts: dict[str, int] = msgspec.field(default_factory=dict)


class HostRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``--host-work``: one case and mechanism with copies that move nothing (``lw_bench.pipeline_rates``):
    the host's own work per window (one block of one layer), the fastest of the repetitions."""

    case: str  # as RateRow
    layers: int
    blocks: int
    segment_bytes: int
    windows: int  # layers x blocks
    mechanism: str  # kernel or batch_dma
    load_ns_per_window: float  # a bulk load (open, leases, address lookups, batches, release)
    save_ns_per_window: float  # a save (reserve, address lookups, batches, commit)
    load_bound_gbps: float  # the rate the host work alone allows: bytes / load time
    save_bound_gbps: float
    used: dict[str, int]  # batches each mechanism was handed (saves and loads)


class ModelRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``--model-shaped``: a dense prefill against loading its prefix (``lw_bench.pipeline_model``)."""

    shape: str
    tokens: int
    prefill_s: float
    kv_bytes: int
    pcie_load_s: float  # at the pinned-DMA ceiling
    pcie_over_prefill: float
    load_s: dict[str, float]  # per mechanism, at the model-shaped case's measured load rate
    load_over_prefill: dict[str, float]


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
    mechanism_counts: dict[str, int] | None = None  # device bench: batches the loads moved per mechanism
    rates: list[RateRow] | None = None  # device bench, --rates (or the model case for --model-shaped)
    model_shaped: list[ModelRow] | None = None  # device bench, --model-shaped
    host_work: list[HostRow] | None = None  # --kv-device cpu-torch --host-work
    plot: str | None = None  # --plot: the PNG written


def encode(result: PipelineBenchResult) -> bytes:
    return msgspec.json.encode(result)


def decode(raw: bytes | str) -> PipelineBenchResult:
    """The child's JSON line as a result; ``msgspec.ValidationError`` names a missing or mistyped key."""
    return msgspec.json.decode(raw, type=PipelineBenchResult)
