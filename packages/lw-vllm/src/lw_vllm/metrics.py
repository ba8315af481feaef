"""Connector metrics through vLLM's connector-stats mechanism.

How vLLM moves them (0.32): each worker's ``get_kv_connector_stats()`` rides back to the scheduler
in ``KVConnectorOutput`` (TP workers' stats are merged with ``aggregate``); the scheduler then calls
its own connector's ``get_kv_connector_stats()`` and aggregates that too, so scheduler-side numbers
(lookups, hits, metaserver waits) are supported as well. The merged ``to_dict()`` travels to the
front-end process in ``SchedulerStats``, where ``build_kv_connector_stats`` rebuilds it for the log
line ("KV Transfer metrics: ...") and ``build_prom_metrics`` feeds vLLM's own ``/metrics``.

The payload is a plain dict of counters plus short lists of samples (for histograms), so it
serialises with msgpack across processes and sums across workers and steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# Counters: payload key -> (Prometheus name, help). Names carry their unit; vLLM's own prefix.
COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:lw_pool_lookups_total", "Pool lookups (one per request and scheduling attempt)"),
    "lookup_errors": ("vllm:lw_pool_lookup_errors_total", "Lookups the pool could not answer (treated as misses)"),
    "lookup_tokens": ("vllm:lw_pool_lookup_tokens_total", "Prompt tokens looked up in the pool"),
    "hit_tokens": ("vllm:lw_pool_hit_tokens_total", "Prompt tokens found in the pool (beyond vLLM's own prefix cache)"),
    "loaded_objects": ("vllm:lw_pool_loaded_objects_total", "Pool objects (chunks) loaded into the KV cache"),
    "loaded_bytes": ("vllm:lw_pool_loaded_bytes_total", "Bytes loaded from the pool into the KV cache"),
    "load_failed_blocks": ("vllm:lw_pool_load_failed_blocks_total",
                           "KV blocks whose load failed or missed its deadline (recomputed or failed by policy)"),
    "load_errors": ("vllm:lw_pool_load_errors_total", "Steps whose loads reported at least one error"),
    "load_deadline_misses": ("vllm:lw_pool_load_deadline_misses_total", "Layers (and recurrent states) whose load missed layer_wait_timeout_s"),
    "saved_objects": ("vllm:lw_pool_saved_objects_total", "Pool objects committed (published)"),
    "saved_bytes": ("vllm:lw_pool_saved_bytes_total", "Bytes written to the pool and committed"),
    "save_failed_objects": ("vllm:lw_pool_save_failed_objects_total", "Objects whose save failed (not published)"),
    "save_errors": ("vllm:lw_pool_save_errors_total", "Steps whose saves reported at least one error"),
    "save_deadline_misses": ("vllm:lw_pool_save_deadline_misses_total", "Layers (and recurrent states) whose save missed save_timeout_s"),
    "evictions": ("vllm:lw_pool_evictions_total", "Pool evictions observed (pool-wide counter, seen from this worker)"),
    # The embedded pool's disk tier (embedded_disk_path), as this worker's process counts it.
    "disk_hits": ("vllm:lw_pool_disk_hits_total", "Pool objects opened from the disk tier"),
    "disk_bytes_read": ("vllm:lw_pool_disk_read_bytes_total", "Bytes read from the disk tier"),
    "demotions": ("vllm:lw_pool_demotions_total", "Objects evicted from DRAM and written to the disk tier"),
    "demotion_drops": ("vllm:lw_pool_demotion_drops_total",
                       "Objects evicted from DRAM that the disk tier dropped (queue full, disk full or failing)"),
    "disk_evictions": ("vllm:lw_pool_disk_evictions_total", "Files the disk tier evicted to stay under its capacity"),
    "disk_corrupt": ("vllm:lw_pool_disk_corrupt_total", "Disk-tier files found torn or corrupt (removed; misses)"),
    "device_register_failures": ("vllm:lw_pool_device_register_failures_total",
                                 "Pool memory ranges the KV cache's device could not register (their copies go "
                                 "through pinned staging)"),
    "store_register_refusals": ("vllm:lw_pool_store_register_refusals_total",
                                "Host memory arenas the store refused to register (their transfers copy through the "
                                "store's staging instead)"),
    "disk_read_errors": ("vllm:lw_pool_disk_read_errors_total",
                         "Disk-tier files that could not be read (I/O error, no memory; misses, files kept)"),
    "pd_prefill_not_in_pool": ("vllm:lw_pool_pd_prefill_not_in_pool_total",
                               "Decoder requests whose prefill the metaserver reported committed while the pool held "
                               "none of it (another pool, model identity or KV layout; computed here instead)"),
    "pd_metaserver_refused": ("vllm:lw_pool_pd_metaserver_refused_total",
                              "Remote-prefill requests whose metaserver URL pd_allowed_metaservers does not allow "
                              "(never called; the request is computed here)"),
}
# Histograms: payload key -> (Prometheus name, help, buckets).
_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HISTOGRAMS: dict[str, tuple[str, str, tuple[float, ...]]] = {
    "layer_wait_s": ("vllm:lw_pool_layer_wait_seconds",
                     "Time the forward pass waited for one layer's pool load", _WAIT_BUCKETS),
    "save_wait_s": ("vllm:lw_pool_save_wait_seconds",
                    "Time a step waited for pool saves (the step's own, or a preempted request's background ones)",
                    _WAIT_BUCKETS),
    "metaserver_wait_s": ("vllm:lw_pool_metaserver_wait_seconds",
                          "Time a decoder waited for its remote prefill (metaserver answer)",
                          _WAIT_BUCKETS + (30.0, 60.0, 120.0)),
}
# Samples kept per interval and histogram: a long interval keeps the first ones and counts the rest
# in "<key>_dropped" (the counters stay exact).
MAX_SAMPLES = 4096


def empty_data() -> dict[str, Any]:
    d: dict[str, Any] = {k: 0 for k in COUNTERS}
    for k in HISTOGRAMS:
        d[k] = []
        d[k + "_dropped"] = 0
    return d


def merge_into(dst: dict[str, Any], src: dict[str, Any]) -> dict[str, Any]:
    for k in COUNTERS:
        dst[k] = dst.get(k, 0) + src.get(k, 0)
    for k in HISTOGRAMS:
        samples = dst.setdefault(k, [])
        new = src.get(k) or []
        room = MAX_SAMPLES - len(samples)
        samples.extend(new[:max(room, 0)])
        dst[k + "_dropped"] = dst.get(k + "_dropped", 0) + src.get(k + "_dropped", 0) + max(len(new) - max(room, 0), 0)
    return dst


@dataclass
class LayerwiseStats(KVConnectorStats):
    """One interval of connector numbers (counters and samples); sums under ``aggregate``."""

    data: dict[str, Any] = field(default_factory=dict)  # the base class's field, typed for mypy

    def __post_init__(self) -> None:
        if not self.data:
            self.data = empty_data()

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge_into(self.data, other.data if other is not None else {})
        return self

    def is_empty(self) -> bool:
        d = self.data
        return not any(d.get(k) for k in COUNTERS) and not any(d.get(k) for k in HISTOGRAMS)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        out["lookups"] = d.get("lookups", 0)
        out["hit_rate_pct"] = round(100.0 * d.get("hit_tokens", 0) / d["lookup_tokens"], 1) if d.get("lookup_tokens") else 0.0
        for k in ("hit_tokens", "loaded_objects", "loaded_bytes", "load_failed_blocks", "load_deadline_misses",
                  "saved_objects", "saved_bytes", "save_failed_objects", "save_deadline_misses", "evictions",
                  "lookup_errors", "pd_prefill_not_in_pool", "pd_metaserver_refused"):
            out[k] = d.get(k, 0)
        for k in POLLED[1:]:  # the disk tier's, when it is on
            if d.get(k):
                out[k] = d[k]
        w = d.get("layer_wait_s") or []
        if w:
            out["layer_wait_avg_ms"] = round(1e3 * sum(w) / len(w), 3)
            out["layer_wait_max_ms"] = round(1e3 * max(w), 3)
        m = d.get("metaserver_wait_s") or []
        if m:
            out["metaserver_wait_avg_s"] = round(sum(m) / len(m), 3)
        return out


class Collector:
    """Thread-safe accumulator one connector role owns; ``take()`` hands the interval to vLLM."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_data()

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                if k not in COUNTERS:
                    raise KeyError(f"unknown connector counter {k!r}; known: {', '.join(COUNTERS)}")
                self._data[k] += int(v)

    def observe(self, key: str, values: list[float] | tuple[float, ...]) -> None:
        if key not in HISTOGRAMS:
            raise KeyError(f"unknown connector histogram {key!r}; known: {', '.join(HISTOGRAMS)}")
        with self._lock:
            merge_into(self._data, {key: list(values)})

    def take(self) -> LayerwiseStats | None:
        with self._lock:
            data, self._data = self._data, empty_data()
        st = LayerwiseStats(data=data)
        return None if st.is_empty() else st


# Counters the backend keeps itself (``backend.stats()``), turned into increments by ``PoolCounters``.
POLLED = ("evictions", "disk_hits", "disk_bytes_read", "demotions", "demotion_drops", "disk_evictions", "disk_corrupt",
          "disk_read_errors", "store_register_refusals")
# Those of them this process's backend counts from 0 itself (not pool-wide): the first look counts too.
FROM_ZERO = frozenset({"store_register_refusals"})


class PoolCounters:
    """Turns the backend's own counters (``POLLED`` in ``backend.stats()``: the pool-wide eviction
    count, the disk tier's, the store's refused registrations) into increments, polled at most
    every ``period_s``. A pool-wide counter's first look is its baseline; one this process counts
    from 0 (``FROM_ZERO``) counts from its first look on."""

    def __init__(self, backend: Any, period_s: float = 1.0) -> None:
        self.backend, self.period_s = backend, period_s
        self._last: dict[str, int] = {}
        self._next = 0.0

    def poll(self) -> dict[str, int]:
        now = time.monotonic()
        if now < self._next or self.backend is None:
            return {}
        self._next = now + self.period_s
        try:
            stats = self.backend.stats()
        except Exception:  # a pool that cannot answer shows up in load/save errors instead
            return {}
        out: dict[str, int] = {}
        for k in POLLED:
            if k not in stats:
                continue
            cur = int(stats[k])
            last = self._last.get(k, 0 if k in FROM_ZERO else None)
            self._last[k] = cur
            if last is not None and cur > last:  # first look, or the pool was recreated: new baseline
                out[k] = cur - last
        return out


class LayerwisePromMetrics(KVConnectorPromMetrics):
    """Registers the connector's metrics with vLLM's Prometheus registry, per engine label."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in COUNTERS.items():
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}
        self._hists: dict[str, dict[int, Any]] = {}
        for key, (name, doc, buckets) in HISTOGRAMS.items():
            h = self._histogram_cls(name=name, documentation=doc, buckets=list(buckets), labelnames=labelnames)
            self._hists[key] = {i: h.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data or {}
        for key, per_engine in self._counters.items():
            v = d.get(key, 0)
            if v and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
        for key, per_engine in self._hists.items():
            h = per_engine.get(engine_idx)
            if h is not None:
                for s in d.get(key) or ():
                    h.observe(s)
