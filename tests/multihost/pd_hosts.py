"""A 1P1D stack across the two test hosts: prefiller and lw-proxy on host A, decoder on host B,
both engines memcache clients (host_tcp, DRAM 0) of the cluster's pool; the decoder calls the
proxy back on A's address, which its pd_allowed_metaservers lists. Same warm-ups as lw_bench.pd.stack.start_stack."""

from __future__ import annotations

from pathlib import Path

from cluster import Cluster

from lw_bench.pd.stack import SERVER_START_TIMEOUT_S, Stack, post_json, start_proxy, start_vllm, wait_ready

PREFILL_PORT, DECODE_PORT, PROXY_PORT = 8100, 8200, 8300


def start_cross_host_stack(cluster: Cluster, model: str, log_dir: Path, *, metaserver_timeout_s: float) -> Stack:
    """Call with this thread on host A (``cluster.hosts.entered("a")``): readiness checks and
    warm-ups go over the hosts' addresses."""
    from lw_bench import models

    mla = model == "mla"
    model_dir = str(models.mla_model() if mla else models.gqa_model())
    block = 16 if mla else 32
    common = {"use_layerwise": True, "metaserver_timeout_s": metaserver_timeout_s}
    sizes = {"max_model_len": 1024, "kv_cache_bytes": 32 << 20, "block_size": block, "mla": mla, "log_dir": log_dir}
    prefill = start_vllm("prefill", model_dir, kv_role="kv_producer", extra=cluster.extra("a", "prefill", **common),
                         cpu="0", host=cluster.a, port=PREFILL_PORT, launcher=cluster.launcher("a"), **sizes)
    decode = proxy = None
    try:
        allowed = [f"http://{cluster.a}:{PROXY_PORT}/v1/metaserver"]  # the proxy, on host A
        decode = start_vllm("decode", model_dir, kv_role="kv_consumer",
                            extra=cluster.extra("b", "decode", **common, pd_allowed_metaservers=allowed),
                            cpu="1", host=cluster.b, port=DECODE_PORT, launcher=cluster.launcher("b"), **sizes)
        wait_ready([prefill.proc, decode.proc], "/health", SERVER_START_TIMEOUT_S)
        for s in (prefill, decode):
            for path, body in (("/v1/completions", {"prompt": "warm up", "logprobs": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}],
                                                         "logprobs": True, "top_logprobs": 2})):
                status, out = post_json(s.url + path, {"model": "tiny", "max_tokens": 2, **body})
                assert status == 200, f"warm-up {path} on {s.proc.name}: {status} {out}"
        proxy = start_proxy("proxy", prefill.url, decode.url, log_dir, "--metaserver-timeout",
                            str(metaserver_timeout_s * 2), host=cluster.a, port=PROXY_PORT,
                            launcher=cluster.launcher("a"))
        status, out = post_json(proxy.url + "/v1/completions",
                                {"model": "tiny", "prompt": "ka lo mi ne ru " * 30, "max_tokens": 2, "logprobs": 2})
        assert status == 200, f"PD warm-up through the proxy: {status} {out}"
    except BaseException:
        for p in (proxy, prefill.proc, decode.proc if decode is not None else None):
            if p is not None:
                p.stop()
        raise
    return Stack(prefill, decode, proxy, log_dir, block, metaserver_timeout_s)
