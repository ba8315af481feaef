"""The stack ``lw-bench pd`` measures on, once per store: ONE prefiller serving two decoders.

* ``prefill`` (kv_producer, ``pd_streaming`` on: it publishes each layer as its save ends, which a
  non-streaming decoder simply does not read);
* ``decode`` (kv_consumer, non-streaming) behind ``proxy`` (``--no-prefill-first``: the decoder's
  path, every first token from the decoder), and behind ``proxy_relay`` (the proxy's default
  ``--prefill-first``: the prefiller's own first token goes to the client);
* ``decode_stream`` (kv_consumer, ``pd_streaming``) behind ``proxy_stream`` (``--no-prefill-first``).

So the prefiller alone, non-streaming PD, prefill-first PD and streaming PD run on the very same
prefiller, alternated, in one run. Every engine uses the bench-only backend ``throttled``
(lw_bench.pd.throttle): on store ``embedded`` unthrottled (it only writes the per-layer timeline),
on store ``throttled`` behind a link of ``throttle_bytes_per_s`` per engine process, and on store
``memcache`` unthrottled around lw-memcache (a MetaService and ``lw-memcache hold`` on this host,
host_shm; needs memcache_hybrid, i.e. ``uv sync --all-extras``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lw_bench.pd.stack import (
    SERVER_START_TIMEOUT_S,
    Proc,
    VllmServer,
    cpu_ids,
    post_json,
    start_proxy,
    start_vllm,
    wait_ready,
)
from lw_bench.pd.throttle import NAME as THROTTLED
from lw_bench.pd.throttle import sitecustomize_dir

STORES = ("embedded", "throttled", "memcache")
ROLES = ("prefill", "decode", "decode_stream")


@dataclass
class CompareStack:
    store: str
    servers: dict[str, VllmServer]
    proxies: dict[str, Proc]  # "pd", "pd_stream", optionally "pd_relay" and "pd_stream_relay"
    timelines: dict[str, Path]  # role -> the throttled backend's timeline file
    log_dir: Path
    _tl_marks: dict[str, int] = field(default_factory=dict)
    pool: Any = None  # store "memcache": its LocalMemcache, stopped with the stack

    def mark(self) -> None:
        for s in self.servers.values():
            s.mark()
        self._tl_marks = {r: (p.stat().st_size if p.exists() else 0) for r, p in self.timelines.items()}

    def new_events(self, role: str) -> list[dict[str, Any]]:
        import json

        p = self.timelines[role]
        if not p.exists():
            return []
        with open(p, "rb") as f:
            f.seek(self._tl_marks.get(role, 0))
            return [json.loads(x) for x in f.read().decode().splitlines() if x.strip().endswith("}")]

    def stop(self) -> None:
        try:
            for p in [*self.proxies.values(), *(s.proc for s in self.servers.values())]:
                p.stop()
        finally:
            if self.pool is not None:
                self.pool.stop()


def engine_extra(store: str, pool_path: str, timeline: Path, *, streaming: bool, bytes_per_s: int,
                 metaserver_timeout_s: float, memcache: dict[str, Any] | None = None) -> dict[str, Any]:
    """``memcache``: the pool's ``extra_config`` (store "memcache")."""
    if store == "memcache":
        assert memcache is not None, "store memcache needs its pool's extra_config"
        inner: dict[str, Any] = {"throttle_inner": "memcache", **{k: v for k, v in memcache.items() if k != "backend"}}
    else:
        inner = {"embedded_path": pool_path, "embedded_capacity_bytes": 512 << 20}
    return {"backend": THROTTLED, **inner,
            "use_layerwise": True, "metaserver_timeout_s": metaserver_timeout_s, "pd_streaming": streaming,
            "throttle_bytes_per_s": bytes_per_s if store == "throttled" else 0, "timeline_path": str(timeline)}


def start_compare_stack(store: str, log_dir: Path, pool_path: str, *, block_size: int, max_model_len: int,
                        bytes_per_s: int, relay: bool, metaserver_timeout_s: float = 30.0,
                        pin: bool = False, continue_streams: bool = False) -> CompareStack:
    """``pin``: each engine's whole process tree (API server too, not only vLLM's OpenMP threads) runs
    on its CPU through ``taskset``, the proxies and this process on the decoders' CPU: the prefiller
    gets a core of its own, as it would on its own host, and its TTFT is not the client's or the
    decoders' CPU time (on a 2-core box they otherwise land on its core)."""
    from lw_bench import models

    if store not in STORES:
        raise ValueError(f"store={store!r}: expected one of {STORES}")
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = str(models.gqa_model())
    site = sitecustomize_dir(log_dir)
    env = {"PYTHONPATH": os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH", "")) if x)}
    timelines = {r: log_dir / f"{r}-timeline.jsonl" for r in ROLES}
    c0, c1 = cpu_ids()
    on: dict[str, tuple[str, ...]] = {c: (("taskset", "-c", c) if pin and c0 != c1 else ()) for c in (c0, c1)}
    if on[c1]:
        os.sched_setaffinity(0, {int(c1)})
    spec = {"prefill": ("kv_producer", True, c0), "decode": ("kv_consumer", False, c1),
            "decode_stream": ("kv_consumer", True, c1)}
    servers: dict[str, VllmServer] = {}
    proxies: dict[str, Proc] = {}
    stack = CompareStack(store, servers, proxies, timelines, log_dir)
    try:
        memcache = None
        if store == "memcache":
            from lw_memcache.local import LocalMemcache

            stack.pool = LocalMemcache(dram_size="512MB", workdir=log_dir / "memcache", holder=True)
            stack.pool.start()
            memcache = stack.pool.extra_config
        for role, (kv_role, streaming, cpu) in spec.items():
            extra = engine_extra(store, pool_path, timelines[role], streaming=streaming, bytes_per_s=bytes_per_s,
                                 metaserver_timeout_s=metaserver_timeout_s, memcache=memcache)
            servers[role] = start_vllm(role, model_dir, kv_role=kv_role, extra=extra, cpu=cpu, log_dir=log_dir,
                                       block_size=block_size, mla=False, max_model_len=max_model_len,
                                       kv_cache_bytes=64 << 20, env_extra=env, launcher=on[cpu], tools=True)
        wait_ready([s.proc for s in servers.values()], "/health", SERVER_START_TIMEOUT_S)
        for s in servers.values():
            status, out = post_json(s.url + "/v1/completions", {"model": "tiny", "prompt": "warm up", "max_tokens": 2})
            assert status == 200, f"warm-up of {s.proc.name}: {status} {out}"
        flags = ("--metaserver-timeout", str(metaserver_timeout_s * 2))
        pf = servers["prefill"].url
        # PD and streaming PD: every first token from the decoder (the proxy's default relays the prefill's)
        off = (*flags, "--no-prefill-first")
        proxies["pd"] = start_proxy("proxy", pf, servers["decode"].url, log_dir, *off, launcher=on[c1])
        proxies["pd_stream"] = start_proxy("proxy-stream", pf, servers["decode_stream"].url, log_dir, *off,
                                           launcher=on[c1])
        if relay:
            on_flags = (*flags, "--prefill-first", *(("--continue-streams",) if continue_streams else ()))
            proxies["pd_relay"] = start_proxy("proxy-relay", pf, servers["decode"].url, log_dir, *on_flags,
                                              launcher=on[c1])
            proxies["pd_stream_relay"] = start_proxy("proxy-stream-relay", pf, servers["decode_stream"].url, log_dir,
                                                     *on_flags, launcher=on[c1])
        # One PD round trip per proxy: first saves, loads and metaserver calls pay one-time costs.
        for name, p in proxies.items():
            body = {"model": "tiny", "prompt": f"ka lo mi ne ru {name} " * 30, "max_tokens": 2, "temperature": 0.0}
            status, out = post_json(p.url + "/v1/completions", body)
            assert status == 200, f"PD warm-up through {p.name}: {status} {out}"
    except BaseException:
        stack.stop()
        raise
    return stack
